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


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_nonfinite_or_negative_extra_grad_sq_skips_the_step(bad, backend):
    """A head's squared norm given as a device scalar is not checked where it is given (that would sync): a
    NaN, inf or negative one (a bug in the caller, whose square root is NaN) skips the step."""
    torch.manual_seed(1)
    net = MambaBackbone(MambaConfig(d_model=16, n_layers=1, d_state=4), 3, seed=2, backend=backend)
    tr = MambaTrainer(net, batch=2, seq_len=8, lr=1e-2, skip_nonfinite=True)
    x, d = torch.randn(2, 8, 3), torch.randn(2, 8, 16)
    before = net.arena.clone()
    tr.forward(x)
    m = tr.backward_step(d, extra_grad_sq=torch.tensor(bad))
    assert bool(m.overflow_skipped) and torch.equal(net.arena, before)
    tr.forward(x)
    m = tr.backward_step(d, extra_grad_sq=torch.tensor(0.25))  # a valid one steps
    assert not bool(m.overflow_skipped) and torch.isfinite(net.arena).all() and not torch.equal(net.arena, before)


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_a_skipped_nan_batch_does_not_poison_later_steps(backend):
    """A NaN input row is skipped and its carried state row keeps what it started from, so the next clean
    batch steps normally (before: the carried state went NaN and every later step was skipped)."""
    torch.manual_seed(2)
    net = MambaBackbone(MambaConfig(d_model=16, n_layers=1, d_state=4), 3, seed=3, backend=backend)
    tr = MambaTrainer(net, batch=2, seq_len=8, lr=1e-2, skip_nonfinite=True)
    x, d = torch.randn(2, 8, 3), torch.randn(2, 8, 16)
    tr.step(x, d)
    state_before = tr.state.ssm.clone()
    bad = x.clone()
    bad[0, 4, 1] = float("nan")
    assert bool(tr.step(bad, d).overflow_skipped)
    assert torch.isfinite(tr.state.ssm).all()
    assert torch.equal(tr.state.ssm[:, 0], state_before[:, 0])  # the bad row kept its state
    m = tr.step(x, d)
    assert not bool(m.overflow_skipped) and int(m.step) == 2 and torch.isfinite(net.arena).all()
