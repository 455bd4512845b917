"""Checkpoints: bit-identical resume, atomic writes, clear errors that leave the trainer unchanged."""
import os

import pytest
import torch

from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer, load_checkpoint, save_checkpoint
from mamba_rl.checkpoint import CheckpointError

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
