"""Checkpoint integrity: per-tensor SHA-256 digests checked on load, non-finite weights / moments refused on
save and load, and range checks of the optimizer / scaler metadata (CheckpointError naming field, expected
and received; the trainer is left unchanged)."""
import functools
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mamba_rl import CheckpointError, MambaBackbone, MambaConfig, MambaTrainer, load_checkpoint, save_checkpoint
from tests.helpers import rewrite_checkpoint

CFG = MambaConfig(d_model=16, n_layers=1, d_state=4)
IN = 3


def trainer(seed=0, dtype="f32"):
    return MambaTrainer(MambaBackbone(CFG, IN, seed=seed, backend="reference"), batch=2, seq_len=4, dtype=dtype)


def stepped(seed=0, dtype="f32"):
    g = torch.Generator().manual_seed(100 + seed)
    t = trainer(seed, dtype)
    t.step(torch.randn(2, 4, IN, generator=g), torch.randn(2, 4, 16, generator=g))
    return t


def snapshot(t):
    return [x.clone() for x in (t.net.arena, t.exp_avg, t.exp_avg_sq, t.scalars, t.scaler.scale, t.state.ssm,
                                t.state.conv, t.hyper)]


def assert_refused(path, match, dtype="f32"):
    t = stepped(seed=5, dtype=dtype)
    before = snapshot(t)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path, t)
    for i, (a, b) in enumerate(zip(before, snapshot(t))):
        assert torch.allclose(a, b, rtol=0, atol=0, equal_nan=True), f"buffer {i} changed by a refused load"


rewrite = functools.partial(rewrite_checkpoint, keep_digest=True)  # edited tensors keep their digests


@pytest.fixture
def ckpt(tmp_path):
    return save_checkpoint(tmp_path / "a.safetensors", stepped(), extra_tensors={"head": torch.randn(5)})


def test_digests_are_saved_and_round_trip(ckpt):
    with safe_open(ckpt, "pt") as f:
        meta = json.loads(f.metadata()["mamba_rl"])
    assert set(meta["sha256"]) == {"master", "exp_avg", "exp_avg_sq", "state_conv", "state_ssm", "extra/head"}
    t = trainer(seed=9)
    load_checkpoint(ckpt, t)
    assert torch.equal(t.net.arena, load_file(ckpt)["master"])


@pytest.mark.parametrize("tensor", ["master", "exp_avg_sq", "extra/head"])
def test_overwritten_payload_bytes_are_refused_naming_the_tensor(tmp_path, ckpt, tensor):
    d = bytearray(open(ckpt, "rb").read())
    n = struct.unpack("<Q", d[:8])[0]
    s, _ = json.loads(d[8:8 + n])[tensor]["data_offsets"]
    d[8 + n + s: 8 + n + s + 8] = b"\x00\x00\x80\x3f" * 2  # two float32 1.0: finite, but not what was saved
    p = tmp_path / "bad.safetensors"
    p.write_bytes(bytes(d))
    assert_refused(p, f"tensor '{tensor}' is corrupt: SHA-256")


def test_nan_payload_is_refused(tmp_path, ckpt):
    d = bytearray(open(ckpt, "rb").read())
    n = struct.unpack("<Q", d[:8])[0]
    s, _ = json.loads(d[8:8 + n])["master"]["data_offsets"]
    d[8 + n + s: 8 + n + s + 64] = b"\xff" * 64
    p = tmp_path / "nan.safetensors"
    p.write_bytes(bytes(d))
    assert_refused(p, "'master' is corrupt")


def test_tensor_added_or_removed_is_refused(tmp_path, ckpt):
    p = rewrite(ckpt, tmp_path / "x.safetensors", tensors_fn=lambda t: t.__setitem__("extra/new", torch.ones(2)))
    assert_refused(p, r"unexpected \['extra/new'\]")
    p = rewrite(ckpt, tmp_path / "y.safetensors", tensors_fn=lambda t: t.pop("extra/head"))
    assert_refused(p, r"missing \['extra/head'\]")


def test_checkpoint_without_digests_still_loads(tmp_path, ckpt):
    p = rewrite(ckpt, tmp_path / "old.safetensors", keep_digest=False)
    t = trainer(seed=9)
    meta = load_checkpoint(p, t)
    assert torch.equal(t.net.arena, load_file(ckpt)["master"]) and "head" in meta["extra_tensors"]


@pytest.mark.parametrize("tensor", ["master", "exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_without_digest_are_refused_on_load(tmp_path, ckpt, tensor, value):
    p = rewrite(ckpt, tmp_path / "nf.safetensors", tensors_fn=lambda t: t[tensor].__setitem__(3, value),
                keep_digest=False)
    assert_refused(p, f"tensor '{tensor}' holds 1 non-finite values")


@pytest.mark.parametrize("tensor", ["master", "exp_avg", "exp_avg_sq"])
def test_save_refuses_non_finite_and_keeps_the_previous_file(tmp_path, tensor):
    t = stepped()
    p = save_checkpoint(tmp_path / "c.safetensors", t)
    raw = open(p, "rb").read()
    buf = {"master": t.net.arena, "exp_avg": t.exp_avg, "exp_avg_sq": t.exp_avg_sq}[tensor]
    with torch.no_grad():
        buf[1] = float("nan")
    with pytest.raises(CheckpointError, match=f"refusing to write .*'{tensor}' holds 1 non-finite"):
        save_checkpoint(p, t)
    assert open(p, "rb").read() == raw
    assert sorted(x.name for x in tmp_path.iterdir()) == ["c.safetensors"]  # no temporary left behind
    with pytest.raises(CheckpointError):
        save_checkpoint(tmp_path / "new.safetensors", t)
    assert not (tmp_path / "new.safetensors").exists()


def test_save_removes_its_own_stale_temporary_and_no_siblings(tmp_path):
    """A save of ``ckpt`` removes what a killed save of ``ckpt`` left (``.tmp-ckpt-<12 hex>.safetensors``), not
    the temporary of a save of ``ckpt-best`` in the same folder, which ``.tmp-ckpt-`` begins too (two saves
    running at once made the other fail), nor anything else that merely begins with the prefix."""
    t = stepped()
    own = tmp_path / ".tmp-ckpt-0123456789ab.safetensors"
    others = [tmp_path / ".tmp-ckpt-best-0123456789ab.safetensors", tmp_path / ".tmp-ckpt-notes.txt",
              tmp_path / ".tmp-ckpt-0123456789ab.safetensors.bak"]
    for f in [own, *others]:
        f.write_bytes(b"x")
    save_checkpoint(tmp_path / "ckpt", t)
    assert not own.exists() and all(f.read_bytes() == b"x" for f in others)
    load_checkpoint(tmp_path / "ckpt", trainer())


@pytest.mark.parametrize("field,value,match", [
    ("scale", 0.0, "scaler scale must be a finite number > 0, got 0.0"),
    ("scale", -5.0, "scaler scale must be a finite number > 0, got -5.0"),
    ("scale", "inf", "numeric"),
    ("growth_interval", 0, "scaler growth_interval must be an int >= 1, got 0"),
    ("growth_interval", 2.5, "scaler growth_interval must be an int >= 1, got 2.5"),
    ("growth_factor", 1.0, "scaler growth_factor must be a finite number > 1, got 1.0"),
    ("backoff_factor", 1.5, r"scaler backoff_factor must be a number in \(0, 1\), got 1.5"),
    ("growth_tracker", -1, "scaler growth_tracker must be an int >= 0, got -1"),
])
def test_scaler_ranges_are_checked(tmp_path, ckpt, field, value, match):
    p = rewrite(ckpt, tmp_path / "s.safetensors", meta_fn=lambda m: m["scaler"].__setitem__(field, value))
    assert_refused(p, match, dtype="f16")


@pytest.mark.parametrize("field,value,match", [
    ("bias_correction1", 0.0, r"bias_correction1 .* must be a number in \(0, 1\], got 0.0"),
    ("bias_correction2", 1.5, r"bias_correction2 .* must be a number in \(0, 1\], got 1.5"),
    ("step", 2 ** 62, r"step must be an int in \[0, 2\*\*53\]"),
    ("lr", -1.0, "lr must be a finite number >= 0, got -1.0"),
])
def test_optimizer_ranges_are_checked(tmp_path, ckpt, field, value, match):
    p = rewrite(ckpt, tmp_path / "o.safetensors", meta_fn=lambda m: m.__setitem__(field, value))
    assert_refused(p, match)


def test_fresh_trainer_checkpoint_loads(tmp_path):
    """bias corrections are 1 before the first step, and step 0 is valid."""
    p = save_checkpoint(tmp_path / "f.safetensors", trainer(seed=2))
    load_checkpoint(p, trainer(seed=3))
