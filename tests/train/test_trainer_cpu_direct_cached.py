"""The cpu-direct step's per-step shortcuts (benchmarks/NOTES.md, 2026-12-04 late): the checks of ``_cpu_direct``
that read only the class, the config and the dtypes are cached under a key, the per-parameter ones (and the
``.grad`` identity check of ``_attach_grads_cpu``) run every step in one loop, and ``backbone_fwd`` writes the
final states into the trainer's carried state. Each test changes one thing between two steps of the same trainer
and checks that the next step sees it, with the same bits as the autograd path."""
from __future__ import annotations

import pytest
import torch

from mamba_rl.model import fused

from .test_trainer_cpu_direct_adversarial import CFG, IN, assert_same, data, make, ref_step


def _pair(**kw):
    return make(**kw), make(**kw)


def test_state_written_in_place_and_same_bits():
    a, b = _pair()
    conv, ssm = a.state.conv, a.state.ssm
    for x, d, s in data(3, 20, IN, CFG.d_model, n=3):
        a.step(x, d, episode_starts=s)
        ref_step(b, x, d, episode_starts=s)
    assert a.state.conv is conv and a.state.ssm is ssm
    assert_same(a, b)


def test_rebound_state_falls_back_to_the_copy():
    a, b = _pair()
    (x, d, s), (x2, d2, s2) = data(3, 20, IN, CFG.d_model, n=2)
    a.step(x, d, episode_starts=s)
    ref_step(b, x, d, episode_starts=s)
    # a caller's own state object (not the trainer's views): the step copies the final state into it
    a.state = type(a.state)(a.state.conv.clone(), a.state.ssm.clone())
    a.step(x2, d2, episode_starts=s2)
    ref_step(b, x2, d2, episode_starts=s2)
    assert torch.equal(a.state.conv, b.state.conv) and torch.equal(a.state.ssm, b.state.ssm)
    assert torch.equal(a.net.arena, b.net.arena)


@pytest.mark.parametrize("change", ["hook", "freeze", "swap", "cpu_whole_off", "set_to_none", "new_grad_arena"])
def test_a_change_between_steps_is_seen(change, monkeypatch):
    a, b = _pair()
    (x, d, s), (x2, d2, s2), (x3, d3, s3) = data(3, 20, IN, CFG.d_model, n=3)
    a.step(x, d, episode_starts=s)
    ref_step(b, x, d, episode_starts=s)
    assert a._cpu_direct() and a._direct_static is not None
    p = a.net.layers[0].mixer.x_proj.weight if hasattr(a.net.layers[0], "mixer") else next(a.net.parameters())
    if change == "hook":
        h = p.register_hook(lambda g: g)
        assert not a._cpu_direct()
        h.remove()
    elif change == "freeze":
        p.requires_grad_(False)
        assert not a._cpu_direct()
        p.requires_grad_(True)
    elif change == "swap":
        params, name, q = a.net._param_slots[3]
        params[name] = torch.nn.Parameter(q.detach().clone())
        assert not a._cpu_direct()
        params[name] = q
    elif change == "cpu_whole_off":
        monkeypatch.setattr(fused, "CPU_WHOLE", "off")
        assert not a._cpu_direct()
        monkeypatch.setattr(fused, "CPU_WHOLE", "auto")
    elif change == "set_to_none":
        for t in (a, b):
            t.net._param_slots[5][2].grad = None  # what torch.optim's zero_grad(set_to_none=True) does
        assert a._cpu_direct() and not a._grads_seen  # the step re-attaches the views
    elif change == "new_grad_arena":
        for t in (a, b):
            t.net.grad_arena = torch.zeros_like(t.net.grad_arena)
            t.net.attach_grads()
        assert a._cpu_direct() and not a._grads_seen
    assert a._cpu_direct()
    a.step(x2, d2, episode_starts=s2)
    ref_step(b, x2, d2, episode_starts=s2)
    a.step(x3, d3, episode_starts=s3)
    ref_step(b, x3, d3, episode_starts=s3)
    assert_same(a, b)
    for q in a.net.parameters():  # the views the step wrote are the ones .grad shows
        assert q.grad is not None and q.grad.data_ptr() >= a.net.grad_arena.data_ptr()


def test_backbone_fwd_out_arguments_checked():
    tr = make()
    net = tr.net
    su = tr._state_used
    x = torch.randn(3, 20, IN)
    st = torch.zeros(3, 20, dtype=torch.bool)
    with torch.no_grad():
        with pytest.raises(ValueError, match="conv_out"):
            fused.cpu_whole_forward(net, x, su.conv, su.ssm, st, torch.zeros(1, 2, 3), tr.state.ssm)
        with pytest.raises(ValueError, match="ssm_out"):
            fused.cpu_whole_forward(net, x, su.conv, su.ssm, st, tr.state.conv, tr.state.ssm.double())
        with pytest.raises(ValueError, match="ssm_out"):
            fused.cpu_whole_forward(net, x, su.conv, su.ssm, st, None, su.ssm)  # the initial state itself
        with pytest.raises(ValueError, match="conv_out"):
            fused.cpu_whole_forward(net, x, su.conv, su.ssm, st, tr.state.conv.transpose(2, 3), None)
        _, c, s, _ = fused.cpu_whole_forward(net, x, su.conv, su.ssm, st, tr.state.conv, tr.state.ssm)
        _, c2, s2, _ = fused.cpu_whole_forward(net, x, su.conv, su.ssm, st)
    assert c is tr.state.conv and s is tr.state.ssm
    assert torch.equal(c, c2) and torch.equal(s, s2)


def test_optimizer_sees_extra_grad_sq_and_a_rebound_buffer():
    """_optimize calls the C++ grad_stats with a cached [1] view of extra_sq_buf: a new value, and a re-bound
    buffer, must both reach the norm (same clip as a trainer that never cached the view)."""
    a, b = _pair(max_grad_norm=0.01)
    (x, d, s), (x2, d2, s2) = data(3, 20, IN, CFG.d_model, n=2)
    for tr in (a, b):
        tr.forward(x, episode_starts=s)
        tr.backward_step(d, extra_grad_sq=4.0)
    b._extra_sq1 = None
    a.extra_sq_buf = torch.zeros((), dtype=torch.float32)  # re-bound between steps
    for tr in (a, b):
        tr.forward(x2, episode_starts=s2)
        m = tr.backward_step(d2, extra_grad_sq=9.0)
        assert m.grad_norm.item() >= 3.0
    assert torch.equal(a.net.arena, b.net.arena) and torch.equal(a.scalars, b.scalars)
