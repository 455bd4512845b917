"""Checkpoint load / save validation: the stored optimizer settings are validated and applied (or a structural
mismatch refused), tensors that would poison the next step are refused naming the tensor, and bad paths /
shared-memory extra tensors give clear errors; a refused load leaves the trainer bit-identical and a failed
save leaves the previous file as it was."""
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mamba_rl import CheckpointError, load_checkpoint, read_checkpoint, save_checkpoint
from mamba_rl.train.checkpoint import tensor_sha256
from tests.helpers import IN, make_trainer, rewrite_checkpoint

D = 8  # SMALL_CFG.d_model
CUSTOM = {"lr": 1e-3, "betas": (0.5, 0.6), "eps": 1e-3, "weight_decay": 0.3, "max_grad_norm": 0.1}


def data(n, seed=21):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 4, IN, generator=g), torch.randn(2, 4, D, generator=g),
             torch.rand(2, 4, generator=g) < 0.25) for _ in range(n)]


def buffers(t):
    bufs = (t.net.arena, t.exp_avg, t.exp_avg_sq, t.scalars, t.scaler.scale, t.scaler.growth_tracker,
            t.state.conv, t.state.ssm, t.hyper, t.net.compute_arena)
    return [b for b in bufs if b is not None]  # no compute copy in f32


def settings_of(t):
    return (t.lr, t.betas, t.eps, t.weight_decay, t.max_grad_norm, t.dtype, t.no_decay)


def assert_refused(path, match, exc=CheckpointError, dtype="f32", settings="checkpoint"):
    """Load ``path`` into a stepped trainer: ``exc`` matching ``match``, every buffer and setting unchanged."""
    t = make_trainer(dtype, seed=5)
    x, d, s = data(1, seed=3)[0]
    t.step(x, d, episode_starts=s)
    before, attrs = [b.clone() for b in buffers(t)], settings_of(t)
    with pytest.raises(exc, match=match):
        if settings == "checkpoint":  # the default, as the agent calls it
            load_checkpoint(path, t)
        else:
            load_checkpoint(path, t, settings=settings)
    for i, (a, b) in enumerate(zip(before, buffers(t))):
        assert torch.equal(a, b), f"buffer {i} changed by a refused load"
    assert settings_of(t) == attrs
    return t


@pytest.fixture
def src(tmp_path):
    t = make_trainer(seed=3, **CUSTOM)
    for x, d, s in data(2):
        t.step(x, d, episode_starts=s)
    return save_checkpoint(tmp_path / "src.safetensors", t)


def rewrite_tensors(src, dst, fn):
    """``src`` with its tensors edited by ``fn`` and the digests recomputed (a file whose digests are valid)."""
    with safe_open(str(src), framework="pt") as f:
        meta = json.loads(f.metadata()["mamba_rl"])
    tensors = load_file(str(src))
    fn(tensors)
    meta["sha256"] = {k: tensor_sha256(v) for k, v in tensors.items()}
    save_file(tensors, str(dst), metadata={"mamba_rl": json.dumps(meta)})
    return dst


# ------------------------------------------------------------------------------------- A: settings
def test_load_applies_the_stored_hyperparameters_and_resumes_bit_identically(tmp_path):
    steps = data(6)
    a = make_trainer(seed=1, **CUSTOM)
    for x, d, s in steps[:2]:
        a.step(x, d, episode_starts=s)
    p = save_checkpoint(tmp_path / "h.safetensors", a)
    b = make_trainer(seed=9)  # the defaults: betas (0.9, 0.999), eps 1e-8, no weight decay, no clip, lr 3e-4
    load_checkpoint(p, b)
    assert (b.lr, b.betas, b.eps, b.weight_decay, b.max_grad_norm) == (1e-3, (0.5, 0.6), 1e-3, 0.3, 0.1)
    assert torch.equal(a.hyper, b.hyper)
    for x, d, s in steps[2:]:
        ma, mb = a.step(x, d, episode_starts=s), b.step(x, d, episode_starts=s)
        assert float(ma.clip_coef) < 1.0 and torch.equal(ma.clip_coef, mb.clip_coef)  # the stored clip is used
    for u, v in zip(buffers(a), buffers(b)):
        assert torch.equal(u, v)
    assert b.state_dict()["meta"] == a.state_dict()["meta"]


def test_a_stored_none_max_grad_norm_turns_the_clip_off(tmp_path):
    a = make_trainer(seed=1)  # max_grad_norm None
    p = save_checkpoint(tmp_path / "n.safetensors", a)
    b = make_trainer(seed=2, max_grad_norm=0.01)
    load_checkpoint(p, b)
    assert b.max_grad_norm is None and math.isinf(float(b.hyper[5]))
    x, d, s = data(1)[0]
    assert float(b.step(x, d, episode_starts=s).clip_coef) == 1.0


def test_settings_trainer_keeps_the_trainers_settings(tmp_path, src):
    b = make_trainer(seed=9, dtype="bf16", no_decay=None, max_grad_norm=2.0)
    hyper = b.hyper.clone()
    load_checkpoint(src, b, settings="trainer")
    assert torch.equal(b.hyper, hyper)  # lr, betas, eps, weight decay, clip: all the trainer's own
    assert (b.lr, b.betas, b.eps, b.weight_decay, b.max_grad_norm) == (3e-4, (0.9, 0.999), 1e-8, 0.0, 2.0)
    assert torch.equal(b.net.arena, read_checkpoint(src)[1]["master"])  # the weights did load


@pytest.mark.parametrize("field,ckpt_value,trainer_kw", [("dtype", "'f32'", {"dtype": "bf16"}),
                                                          ("no_decay", "'reference'", {"no_decay": None})])
def test_a_structural_mismatch_is_refused_naming_both_values(tmp_path, field, ckpt_value, trainer_kw):
    p = save_checkpoint(tmp_path / "s.safetensors", make_trainer(seed=1))
    t = make_trainer(seed=5, **trainer_kw)
    before = [b.clone() for b in buffers(t)]
    mine = repr(getattr(t, field))
    with pytest.raises(CheckpointError, match=f"{field} differs: the checkpoint's is {ckpt_value}, this trainer's "
                                              f"is {mine}"):
        load_checkpoint(p, t)
    assert all(torch.equal(u, v) for u, v in zip(before, buffers(t)))


def test_another_batch_and_seq_len_load_the_weights_and_keep_the_state(tmp_path, src):
    t = make_trainer(seed=5, batch=3, seq_len=7)
    state = t.state.ssm.clone()
    load_checkpoint(src, t)
    assert torch.equal(t.net.arena, read_checkpoint(src)[1]["master"]) and torch.equal(t.state.ssm, state)
    assert t.betas == (0.5, 0.6)


BAD_FIELDS = [
    ("betas", [2.0, 5.0], r"betas must be a pair \[beta1, beta2\] of finite numbers in \[0, 1\), got \[2.0, 5.0\]"),
    ("betas", [0.9], r"betas must be a pair .* got \[0.9\]"),
    ("betas", "0.9,0.99", r"betas must be a pair .* got '0.9,0.99'"),
    ("betas", [0.9, float("nan")], r"betas must be a pair .* got \[0.9, nan\]"),
    ("eps", -1, "eps must be a finite number > 0, got -1"),
    ("eps", 0.0, "eps must be a finite number > 0, got 0.0"),
    ("weight_decay", "nan", "weight_decay must be a finite number >= 0, got 'nan'"),
    ("weight_decay", float("nan"), "weight_decay must be a finite number >= 0, got nan"),
    ("weight_decay", -0.1, "weight_decay must be a finite number >= 0, got -0.1"),
    ("max_grad_norm", -1, r"max_grad_norm must be null \(no clip\) or a finite number > 0, got -1"),
    ("max_grad_norm", float("inf"), r"max_grad_norm must be null \(no clip\) or a finite number > 0, got inf"),
    ("max_grad_norm", True, r"max_grad_norm must be null .* got True"),
    ("dtype", "fp8", r"dtype must be one of \['bf16', 'f16', 'f32', 'tf32'\], got 'fp8'"),
    ("batch", -5, "batch must be an int >= 1, got -5"),
    ("batch", 2.0, "batch must be an int >= 1, got 2.0"),
    ("seq_len", 0, "seq_len must be an int >= 1, got 0"),
    ("no_decay", "all", "no_decay must be \"reference\" or null, got 'all'"),
    ("extra", [1, 2], r"'extra' \(the caller's dict\) must be a JSON object, got \[1, 2\]"),
]


@pytest.mark.parametrize("settings", ["checkpoint", "trainer"])
@pytest.mark.parametrize("field,value,match", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v, _ in BAD_FIELDS])
def test_invalid_stored_fields_are_refused(tmp_path, src, field, value, match, settings):
    p = rewrite_checkpoint(src, tmp_path / "bad.safetensors", meta_fn=lambda m: m.__setitem__(field, value))
    assert_refused(p, match, settings=settings)


def test_bad_settings_argument():
    t = make_trainer()
    with pytest.raises(ValueError, match=r"settings must be one of \['checkpoint', 'trainer'\], got 'mine'"):
        t.load_state_dict(t.state_dict(), settings="mine")
    with pytest.raises(ValueError, match=r"settings must be one of .* got None"):
        load_checkpoint("unused.safetensors", t, settings=None)


# --------------------------------------------------------------------------- B: poisonous tensors
def test_negative_exp_avg_sq_with_valid_digests_is_refused(tmp_path, src):
    def neg(t):
        t["exp_avg_sq"][5] = -0.5

    p = rewrite_tensors(src, tmp_path / "neg.safetensors", neg)
    t = assert_refused(p, r"tensor 'exp_avg_sq' holds 1 negative values of \d+ \(min -0.5\); expected finite "
                          r"values >= 0")
    x, d, s = data(1)[0]
    t.step(x, d, episode_starts=s)  # the trainer the refused file left alone still steps to finite weights
    assert torch.isfinite(t.net.arena).all()


@pytest.mark.parametrize("tensor", ["state_ssm", "state_conv", "exp_avg_sq"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_carried_state_or_moment_with_valid_digests_is_refused(tmp_path, src, tensor, value):
    def poison(t):
        t[tensor].view(-1)[1] = value

    p = rewrite_tensors(src, tmp_path / "nf.safetensors", poison)
    assert_refused(p, f"tensor '{tensor}' holds 1 non-finite values")


def test_carried_state_of_another_dtype_is_refused(tmp_path, src):
    p = rewrite_tensors(src, tmp_path / "f64.safetensors",
                        lambda t: t.__setitem__("state_ssm", t["state_ssm"].double()))
    assert_refused(p, r"tensor 'state_ssm' expected dtype torch.float32 \(the carried state's\), got torch.float64")


@pytest.mark.parametrize("what", ["state_ssm", "state_conv", "exp_avg_sq_negative"])
def test_save_refuses_a_poisonous_trainer_and_keeps_the_previous_file(tmp_path, what):
    t = make_trainer(seed=1)
    x, d, s = data(1)[0]
    t.step(x, d, episode_starts=s)
    p = save_checkpoint(tmp_path / "c.safetensors", t)
    raw = Path(p).read_bytes()
    with torch.no_grad():
        if what == "exp_avg_sq_negative":
            t.exp_avg_sq[0] = -1.0
        else:
            getattr(t.state, what[len("state_"):]).view(-1)[0] = float("nan")
    tensor = "exp_avg_sq" if what == "exp_avg_sq_negative" else what
    with pytest.raises(CheckpointError, match=f"refusing to write .*tensor '{tensor}' holds 1"):
        save_checkpoint(p, t)
    assert Path(p).read_bytes() == raw
    assert sorted(q.name for q in tmp_path.iterdir()) == ["c.safetensors"]


# ---------------------------------------------------------------------------------- C: clear errors
@pytest.mark.parametrize("bad", [None, 3, "", ["a"]])
def test_bad_paths_name_the_argument(tmp_path, bad):
    t = make_trainer()
    before = [b.clone() for b in buffers(t)]
    want = rf"path must be a non-empty file path \(str, bytes or os.PathLike\), got {re.escape(repr(bad))}"
    with pytest.raises(ValueError, match="load_checkpoint: " + want):
        load_checkpoint(bad, t)
    with pytest.raises(ValueError, match="read_checkpoint: " + want):
        read_checkpoint(bad)
    with pytest.raises(ValueError, match="save_checkpoint: " + want):
        save_checkpoint(bad, t)
    assert all(torch.equal(u, v) for u, v in zip(before, buffers(t)))
    assert list(tmp_path.iterdir()) == []


def test_load_of_a_folder_is_refused_clearly(tmp_path):
    with pytest.raises(CheckpointError, match="is a folder; expected a checkpoint file"):
        load_checkpoint(tmp_path, make_trainer())


def test_save_to_an_existing_folder_is_refused_clearly(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "keep.txt").write_text("x")
    with pytest.raises(IsADirectoryError, match=r"save_checkpoint: path must be a file path .* got '.*ck', an "
                                                r"existing folder"):
        save_checkpoint(folder, make_trainer())
    assert [q.name for q in folder.iterdir()] == ["keep.txt"]
    assert sorted(q.name for q in tmp_path.iterdir()) == ["ck"]  # no temporary beside it either


def test_save_under_a_file_is_refused_clearly(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="needs the folder .*f', but a part of it exists and is not a folder"):
        save_checkpoint(tmp_path / "f" / "c.safetensors", make_trainer())
    assert (tmp_path / "f").read_text() == "x"


def test_extra_tensors_sharing_memory_are_saved_as_independent_copies(tmp_path):
    t = make_trainer(seed=1)
    base = torch.arange(10, dtype=torch.float32)
    p = save_checkpoint(tmp_path / "x.safetensors", t, extra_tensors={"h": base[:3], "g": base[:3],
                                                                      "tail": base[5:], "t": base.view(2, 5).t()})
    et = load_checkpoint(p, make_trainer(seed=2))["extra_tensors"]
    assert torch.equal(et["h"], base[:3]) and torch.equal(et["g"], base[:3]) and torch.equal(et["tail"], base[5:])
    assert torch.equal(et["t"], base.view(2, 5).t())
    et["h"][0] = 99.0
    assert float(et["g"][0]) == 0.0 and float(base[0]) == 0.0  # independent of each other and of the source


def test_a_failed_save_leaves_the_previous_file(tmp_path):
    t = make_trainer(seed=1)
    p = save_checkpoint(tmp_path / "c.safetensors", t, extra={"v": 1})
    raw = Path(p).read_bytes()
    with pytest.raises(ValueError, match="extra must be JSON-serialisable"):
        save_checkpoint(p, t, extra={"v": float("nan")})
    with pytest.raises(ValueError, match="extra_tensors must map str -> torch.Tensor"):
        save_checkpoint(p, t, extra_tensors={"v": [1.0]})
    with pytest.raises(ValueError, match="extra_tensors must be a dict"):
        save_checkpoint(p, t, extra_tensors=[torch.ones(1)])
    assert Path(p).read_bytes() == raw
    assert [q.name for q in tmp_path.iterdir()] == ["c.safetensors"]


def test_save_refuses_a_non_trainer_and_sparse_or_meta_extra_tensors(tmp_path):
    """save_checkpoint names a wrong ``trainer`` (TypeError) and an extra tensor without dense data (ValueError)
    instead of a raw AttributeError / torch error, and writes nothing."""
    t = make_trainer()
    with pytest.raises(TypeError, match="trainer must be a MambaTrainer, got NoneType"):
        save_checkpoint(tmp_path / "a", None)
    with pytest.raises(ValueError, match=r"extra_tensors\['m'\]: expected a dense \(strided\) tensor with data, got a "
                                         r"meta tensor"):
        save_checkpoint(tmp_path / "b", t, extra_tensors={"m": torch.empty(3, device="meta")})
    with pytest.raises(ValueError, match=r"extra_tensors\['s'\]: .* got layout torch.sparse_coo"):
        save_checkpoint(tmp_path / "c", t, extra_tensors={"s": torch.eye(3).to_sparse()})
    assert list(tmp_path.iterdir()) == []
