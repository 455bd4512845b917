"""Checkpoints: bit-identical resume, atomic writes, clear errors that leave the trainer unchanged."""

import pytest
import torch

from mamba_rl import (
    CheckpointError,
    MambaBackbone,
    MambaConfig,
    MambaTrainer,
    load_checkpoint,
    save_checkpoint,
)
from tests.helpers import IN, SMALL_CFG, make_trainer, rewrite_checkpoint

CFG = MambaConfig(d_model=16, n_layers=2, d_state=4)


def make(cfg=CFG, seed=0, dtype="f32"):
    net = MambaBackbone(cfg, 5, seed=seed, backend="reference")
    return net, MambaTrainer(net, batch=2, seq_len=6, lr=3e-3, weight_decay=0.01, max_grad_norm=1.0, dtype=dtype)


def batches(n):
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(2, 6, 5, generator=gen), torch.randn(2, 6, 16, generator=gen),
             torch.rand(2, 6, generator=gen) < 0.2) for _ in range(n)]


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_resume_is_bit_identical(tmp_path, dtype):
    data = batches(8)
    if dtype == "f16":  # small enough that some steps pass the 2**16 loss scale, so both paths are exercised
        data = [(x, d * 1e-3, s) for x, d, s in data]
    net_a, a = make(dtype=dtype)
    for x, d, s in data:
        a.step(x, d, episode_starts=s)
    net_b, b = make(dtype=dtype)
    for x, d, s in data[:3]:
        b.step(x, d, episode_starts=s)
    path = save_checkpoint(tmp_path / "ck.safetensors", b, extra={"note": "k=3"})
    net_c, c = make(seed=123, dtype=dtype)  # different init: everything must come from the file
    meta = load_checkpoint(path, c)
    assert meta["extra"] == {"note": "k=3"} and meta["step"] == int(b.scalars[0]) > 0
    for x, d, s in data[3:]:
        c.step(x, d, episode_starts=s)
    assert torch.equal(net_a.arena, net_c.arena)
    assert torch.equal(a.exp_avg, c.exp_avg) and torch.equal(a.exp_avg_sq, c.exp_avg_sq)
    assert torch.equal(a.state.ssm, c.state.ssm)
    assert torch.equal(a.scaler.scale, c.scaler.scale)


def test_no_pickle_and_atomic(tmp_path):
    _, tr = make()
    p = tmp_path / "ck.safetensors"
    save_checkpoint(p, tr)
    with open(p, "rb") as f:
        head = f.read(8)
    assert int.from_bytes(head, "little") > 0  # safetensors: u64 header length, then JSON
    assert [q.name for q in tmp_path.iterdir()] == ["ck.safetensors"]  # no temp file left behind


def test_truncated_checkpoint_raises_and_leaves_trainer_unchanged(tmp_path):
    _, tr = make()
    p = tmp_path / "ck.safetensors"
    save_checkpoint(p, tr)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    net2, tr2 = make(seed=5)
    before = net2.arena.clone()
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(p, tr2)
    assert torch.equal(before, net2.arena)


def test_other_d_model_raises_and_leaves_trainer_unchanged(tmp_path):
    _, tr = make()
    p = save_checkpoint(tmp_path / "ck.safetensors", tr)
    net2, tr2 = make(cfg=MambaConfig(d_model=32, n_layers=2, d_state=4), seed=5)
    before = net2.arena.clone()
    with pytest.raises(CheckpointError, match="d_model"):
        load_checkpoint(p, tr2)
    assert torch.equal(before, net2.arena)


def test_missing_and_foreign_files(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "nope.safetensors")
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(2)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(CheckpointError, match="not a mamba_rl checkpoint"):
        load_checkpoint(tmp_path / "foreign.safetensors")


# ---- edge cases: bad inputs, resets, numerics, interplay with plain torch




def _ck_batches(n, scale=1.0):
    g = torch.Generator().manual_seed(17)
    return [(torch.randn(2, 4, IN, generator=g), torch.randn(2, 4, 8, generator=g) * scale,
             torch.rand(2, 4, generator=g) < 0.3) for _ in range(n)]


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_checkpoint_resume_bit_identical_with_carried_state(tmp_path, dtype):
    data = _ck_batches(6, 1e-3 if dtype == "f16" else 1.0)
    kw = dict(lr=3e-3, weight_decay=0.01, max_grad_norm=1.0)
    a = make_trainer(dtype, **kw)
    for x, d, s in data:
        a.step(x, d, episode_starts=s)
    b = make_trainer(dtype, **kw)
    for x, d, s in data[:2]:
        b.step(x, d, episode_starts=s)
    b.set_lr(3e-3)
    path = save_checkpoint(tmp_path / "c.safetensors", b)
    c = make_trainer(dtype, seed=9, **kw)
    load_checkpoint(path, c)
    assert torch.equal(c.state.ssm, b.state.ssm) and torch.count_nonzero(c.state.ssm) > 0
    for x, d, s in data[2:]:
        c.step(x, d, episode_starts=s)
    assert torch.equal(a.net.arena, c.net.arena) and torch.equal(a.exp_avg_sq, c.exp_avg_sq)
    assert torch.equal(a.state.ssm, c.state.ssm) and torch.equal(a.scalars, c.scalars)
    if dtype != "f32":
        assert torch.equal(a.net.compute_arena, c.net.compute_arena)


_write_variant = rewrite_checkpoint


@pytest.fixture
def src_ckpt(tmp_path):
    t = make_trainer(seed=3)
    t.step(torch.randn(2, 4, IN), torch.randn(2, 4, 8))
    return save_checkpoint(tmp_path / "src.safetensors", t)


def _assert_unchanged_after_failed_load(path, exc=CheckpointError):
    t = make_trainer()
    t.step(torch.randn(2, 4, IN), torch.randn(2, 4, 8))
    snap = [x.clone() for x in (t.net.arena, t.exp_avg, t.exp_avg_sq, t.scalars, t.scaler.scale, t.state.ssm,
                                t.state.conv, t.hyper)]
    with pytest.raises(exc):
        load_checkpoint(path, t)
    after = (t.net.arena, t.exp_avg, t.exp_avg_sq, t.scalars, t.scaler.scale, t.state.ssm, t.state.conv, t.hyper)
    for i, (a, b) in enumerate(zip(snap, after)):
        assert torch.equal(a, b), f"buffer {i} changed by a failed load"


def test_checkpoint_garbage_truncated_missing(tmp_path, src_ckpt):
    raw = open(src_ckpt, "rb").read()
    cases = {"empty": b"", "8": raw[:8], "head": raw[:40], "half": raw[:len(raw) // 2], "minus1": raw[:-1],
             "garbage": bytes(range(256)) * 4, "bighdr": b"\xff" * 8 + b"{}"}
    for name, content in cases.items():
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(content)
        _assert_unchanged_after_failed_load(p)
    _assert_unchanged_after_failed_load(tmp_path / "nope.safetensors")
    _assert_unchanged_after_failed_load(tmp_path)  # a directory
    p = _write_variant(src_ckpt, tmp_path / "v.safetensors", meta_fn=lambda m: m.update(format_version=99))
    _assert_unchanged_after_failed_load(p)


def test_checkpoint_wrong_config_and_input_dim(tmp_path):
    for cfg, ind in ((MambaConfig(d_model=8, n_layers=3, d_state=4, d_conv=3), IN),
                     (MambaConfig(d_model=8, n_layers=2, d_state=4, d_conv=4), IN), (SMALL_CFG, IN + 1)):
        t = MambaTrainer(MambaBackbone(cfg, ind, backend="reference"), batch=2, seq_len=4)
        p = save_checkpoint(tmp_path / "w.safetensors", t)
        _assert_unchanged_after_failed_load(p)


def test_checkpoint_other_batch_loads_weights_keeps_state(tmp_path):
    t = make_trainer(seed=4, batch=3)
    t.step(torch.randn(3, 4, IN), torch.randn(3, 4, 8))
    p = save_checkpoint(tmp_path / "b.safetensors", t)
    u = make_trainer()
    load_checkpoint(p, u)
    assert torch.equal(u.net.arena, t.net.arena) and u.state.ssm.shape[1] == 2


@pytest.mark.parametrize("variant", ["step_str", "scaler_empty", "lr_nan", "lr_negative", "no_state_ssm",
                                     "bad_state_ssm_shape"])
def test_checkpoint_bad_fields_leave_trainer_unchanged(tmp_path, src_ckpt, variant):
    meta_fn = tensors_fn = None
    if variant == "step_str":
        meta_fn = lambda m: m.update(step="abc")  # noqa: E731
    elif variant == "scaler_empty":
        meta_fn = lambda m: m.update(scaler={})  # noqa: E731
    elif variant == "lr_nan":
        meta_fn = lambda m: m.update(lr=float("nan"))  # noqa: E731
    elif variant == "lr_negative":
        meta_fn = lambda m: m.update(lr=-1.0)  # noqa: E731
    elif variant == "no_state_ssm":
        tensors_fn = lambda t: t.pop("state_ssm")  # noqa: E731
    else:
        tensors_fn = lambda t: t.__setitem__("state_ssm", torch.zeros(3))  # noqa: E731
    p = _write_variant(src_ckpt, tmp_path / "bad.safetensors", meta_fn, tensors_fn)
    _assert_unchanged_after_failed_load(p)


def test_checkpoint_integer_master_rejected(tmp_path, src_ckpt):
    p = _write_variant(src_ckpt, tmp_path / "int.safetensors",
                       tensors_fn=lambda t: t.__setitem__("master", (t["master"] * 100).long()))
    _assert_unchanged_after_failed_load(p)


@pytest.mark.parametrize("raw", ["[1, 2]", "null", "3"])
def test_checkpoint_non_object_metadata(tmp_path, src_ckpt, raw):
    p = _write_variant(src_ckpt, tmp_path / "m.safetensors", raw_meta=raw)
    _assert_unchanged_after_failed_load(p)


def test_checkpoint_f16_into_f32_trainer_does_not_rescale_grads(tmp_path):
    src = make_trainer("f16")
    p = save_checkpoint(tmp_path / "f16.safetensors", src)
    a, b = make_trainer("f32"), make_trainer("f32")
    try:
        load_checkpoint(p, a)
    except CheckpointError:
        return  # refusing the dtype mismatch is acceptable
    b.net.arena.copy_(a.net.arena)
    x, d = torch.randn(2, 4, IN), torch.randn(2, 4, 8)
    ma, mb = a.step(x, d), b.step(x, d)
    torch.testing.assert_close(ma.grad_norm, mb.grad_norm)


def test_save_checkpoint_bad_extra(tmp_path):
    tr = make_trainer()
    with pytest.raises(ValueError, match="a"):
        save_checkpoint(tmp_path / "x.safetensors", tr, extra_tensors={"a": [1]})
    with pytest.raises(ValueError, match="t"):
        save_checkpoint(tmp_path / "y.safetensors", tr, extra={"t": torch.tensor(1.0)})
