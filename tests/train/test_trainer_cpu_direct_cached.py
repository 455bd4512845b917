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


# Found by review and fixed: after ``tr.state = RecurrentState(...)`` with other values, _take_state still copied
# the trainer's old flat state buffer, so the step (direct and autograd alike) started from the state the caller
# had replaced, and ``initial_state=`` (copied into the new object) was ignored too. A re-bound state that requires
# grad: the autograd path raised (in-place write of a leaf) where the direct one wrote it under no_grad
@pytest.mark.parametrize("path", ["direct", "autograd"])
@pytest.mark.parametrize("how", ["rebind", "rebind_requires_grad", "rebind_then_initial_state"])
def test_a_rebound_state_with_other_values_is_the_start(path, how):
    from mamba_rl import RecurrentState

    from .test_trainer_cpu_direct_adversarial import rand_state
    a, b = _pair()
    (x, d, s), (x2, d2, s2) = data(3, 20, IN, CFG.d_model, n=2)
    step = (lambda t, *args, **kw: t.step(*args, **kw)) if path == "direct" else ref_step
    step(a, x, d, episode_starts=s)
    step(b, x, d, episode_starts=s)
    want = rand_state(CFG, 3, seed=7)
    if how in ("rebind", "rebind_requires_grad"):
        rg = how == "rebind_requires_grad"
        a.state = RecurrentState(want.conv.clone().requires_grad_(rg), want.ssm.clone().requires_grad_(rg))
        step(a, x2, d2, episode_starts=s2)
        assert a._state_used.conv.grad_fn is None and not a._state_used.ssm.requires_grad
    else:
        a.state = RecurrentState(torch.zeros_like(want.conv), torch.zeros_like(want.ssm))
        step(a, x2, d2, initial_state=want, episode_starts=s2)
    step(b, x2, d2, initial_state=want, episode_starts=s2)
    assert torch.equal(a.state.conv, b.state.conv) and torch.equal(a.state.ssm, b.state.ssm)
    assert torch.equal(a.net.arena, b.net.arena) and torch.equal(a.exp_avg_sq, b.exp_avg_sq)


# Found by review and fixed: _optimize cached a [1] view of extra_sq_buf keyed on the buffer's identity; after
# ``trainer.extra_sq_buf.data = ...`` (same object, new storage) the C++ grad_stats kept reading the old storage,
# so a head's extra_grad_sq was silently left out of the global norm and the clip
def test_extra_sq_buf_with_a_swapped_storage_is_read():
    a, b = _pair(max_grad_norm=1.0)
    (x, d, _), (x2, d2, _) = data(3, 20, IN, CFG.d_model, n=2)
    for t in (a, b):
        t.forward(x)
        t.backward_step(d, extra_grad_sq=0.0)
    a.extra_sq_buf.data = torch.zeros(())
    ma, mb = [(t.forward(x2), t.backward_step(d2, extra_grad_sq=1e8))[1] for t in (a, b)]
    assert float(ma.grad_norm) > 1e4
    assert ma.to_dict() == mb.to_dict() and torch.equal(a.net.arena, b.net.arena)


# Found by review and fixed: copy.deepcopy(trainer) raised "cannot pickle 'module' object" (the CPU extension
# module held for the direct step); pickling "worked" only as far as that, and a pickled trainer's state / moment
# views would come back detached from the unpickled backbone's re-bound arenas, so it is refused with a clear error
def test_deepcopy_continues_bit_identically_and_pickle_is_refused_clearly():
    import copy
    import pickle
    a, b = _pair()
    (x, d, s), (x2, d2, s2), (x3, d3, s3) = data(3, 20, IN, CFG.d_model, n=3)
    a.step(x, d, episode_starts=s)
    ref_step(b, x, d, episode_starts=s)
    c = copy.deepcopy(a)
    assert c.net is not a.net and c._cpu_direct() and c.state.conv is c._state_own[0]
    for t in (c, a):
        t.step(x2, d2, episode_starts=s2)
        t.step(x3, d3, episode_starts=s3)
    ref_step(b, x2, d2, episode_starts=s2)
    ref_step(b, x3, d3, episode_starts=s3)
    assert_same(a, b)
    assert_same(c, b)
    assert copy.copy(a).net is a.net
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(a)


# Found by review and fixed: an initial_state with autograd history (the final state of a net(...) call under
# grad mode) made _load's in-place copy raise "a leaf Variable that requires grad is being used in an in-place
# operation" after the conv half was copied, leaving the carried state's flat buffer with autograd history for
# good; from then on the autograd path ran the per-op reference math (an initial state requiring grad) while the
# direct path ran the kernels, so the two paths' weights differed
@pytest.mark.parametrize("zero_copy", [False, True])
def test_initial_state_with_autograd_history(zero_copy):
    a, b = _pair()
    (x, d, s), (x2, d2, s2) = data(3, 20, IN, CFG.d_model, n=2)
    _, st = a.net(x)
    assert st.conv.requires_grad
    for t, step in ((a, lambda t, *q, **k: t.step(*q, **k)), (b, ref_step)):
        if zero_copy:
            t.x_buf.copy_(x2)
            t.starts_buf.copy_(s2)
            step(t, None, d2, initial_state=st)
        else:
            step(t, x2, d2, initial_state=st, episode_starts=s2)
        assert not t._state_flat.requires_grad and not t._state_used_flat.requires_grad
        step(t, x, d, episode_starts=s)
    assert_same(a, b)
