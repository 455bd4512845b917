"""MambaTrainer(skip_nonfinite=True): a step whose gradient is NaN / inf leaves weights, moments and the step
counter unchanged in float32 too (not only under the f16 scaler); without it the NaN reaches the weights."""
import pytest
import torch

from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_nonfinite_step_is_skipped_only_when_asked(backend):
    torch.manual_seed(0)
    B, T, I = 2, 8, 3
    x, d = torch.randn(B, T, I), torch.randn(B, T, 16)
    bad = d.clone()
    bad[1, 3, 5] = float("nan")
    for skip in (True, False):
        net = MambaBackbone(MambaConfig(d_model=16, n_layers=1, d_state=4), I, seed=1, backend=backend)
        tr = MambaTrainer(net, batch=B, seq_len=T, lr=1e-2, skip_nonfinite=skip)
        tr.step(x, d)
        before = [net.arena.clone(), tr.exp_avg.clone(), tr.exp_avg_sq.clone()]
        m = tr.step(x, bad)
        after = [net.arena, tr.exp_avg, tr.exp_avg_sq]
        if skip:
            assert bool(m.overflow_skipped) and int(m.step) == 1
            assert all(torch.equal(a, b) for a, b in zip(before, after))
        else:
            assert not bool(m.overflow_skipped) and not torch.isfinite(net.arena).all()


def test_skip_nonfinite_must_be_a_bool():
    net = MambaBackbone(MambaConfig(d_model=16, n_layers=1, d_state=4), 3, backend="reference")
    with pytest.raises(ValueError, match="skip_nonfinite must be a bool, got 1"):
        MambaTrainer(net, batch=1, seq_len=1, skip_nonfinite=1)
