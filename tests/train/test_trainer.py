"""MambaTrainer on the reference backend: AdamW parity, clipping, accumulation, split step, f16 scaler,
A_log reaching the scan, carried state and resets."""
import math

import pytest
import torch

from mamba_rl import (
    MambaBackbone,
    MambaConfig,
    MambaTrainer,
    RecurrentState,
)
from tests.helpers import IN, make_net, make_trainer, rand_state

CFG = MambaConfig(d_model=16, n_layers=2, d_state=4)


def _A(tr):
    """[n_layers, d_inner, d_state] = -exp(A_log) of the trainer's current master weights."""
    return torch.stack([-torch.exp(l.mixer.A_log.detach()) for l in tr.net.layers])


def make(seed=0, **kw):
    net = MambaBackbone(CFG, 5, seed=seed, backend="reference")
    return net, MambaTrainer(net, batch=3, seq_len=8, **kw)


def step_on_known_grad(net, tr, x, d, s, extra_grad_sq=None):
    """Accumulate the gradient of (x, d), return a copy of it, then step on exactly that gradient (a second
    forward with a zero d_temporal adds nothing)."""
    z = net.initial_state(tr.batch)
    tr.forward(x, initial_state=z, episode_starts=s)
    tr.backward_step(d, accumulate=True)
    g = net.grad_arena.clone()
    tr.forward(x, initial_state=z, episode_starts=s)
    m = tr.backward_step(torch.zeros_like(d), extra_grad_sq=extra_grad_sq)
    return g, m


def data(gen, B=3, T=8, scale=1.0):
    return (torch.randn(B, T, 5, generator=gen), scale * torch.randn(B, T, 16, generator=gen),
            torch.rand(B, T, generator=gen) < 0.2)


@pytest.mark.parametrize("weight_decay,no_decay", [(0.0, "reference"), (0.1, "reference"), (0.1, None)])
def test_adamw_matches_torch_over_100_steps(weight_decay, no_decay):
    gen = torch.Generator().manual_seed(0)
    net, tr = make(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, no_decay=no_decay)
    ref = {n: torch.nn.Parameter(p.detach().clone()) for n, p in net.named_parameters()}
    from mamba_rl.model.init import is_no_decay
    groups = [{"params": [p for n, p in ref.items() if not (no_decay and is_no_decay(n))], "weight_decay": weight_decay},
              {"params": [p for n, p in ref.items() if no_decay and is_no_decay(n)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(100):
        x, d, s = data(gen)
        g, _ = step_on_known_grad(net, tr, x, d, s)
        for n, p in ref.items():
            p.grad = net.arena_view(g, n).clone()
        opt.step()
    for n, p in net.named_parameters():
        err = (p.detach() - ref[n].detach()).norm() / ref[n].detach().norm()
        assert err <= 1e-6, (n, float(err))
    assert int(tr.scalars[0]) == 100


def test_global_clip_includes_extra_grad_sq():
    gen = torch.Generator().manual_seed(1)
    net, tr = make(lr=1e-3, max_grad_norm=0.5)
    x, d, s = data(gen)
    g, m = step_on_known_grad(net, tr, x, d, s, extra_grad_sq=torch.tensor(9.0))
    g2 = float(g.double().square().sum())
    total = math.sqrt(g2 + 9.0)
    assert float(m.grad_norm) == pytest.approx(total, rel=1e-6)
    assert float(m.clip_coef) == pytest.approx(min(1.0, 0.5 / (total + 1e-6)), rel=1e-6)


def test_accumulate_equals_sum_of_gradients():
    gen = torch.Generator().manual_seed(2)
    x1, d1, s1 = data(gen)
    x2, d2, s2 = data(gen)
    net_a, a = make(lr=1e-3)
    a.forward(x1, episode_starts=s1, initial_state=net_a.initial_state(3))
    a.backward_step(d1, accumulate=True)
    a.forward(x2, episode_starts=s2, initial_state=net_a.initial_state(3))
    a.backward_step(d2)
    net_b, b = make(lr=1e-3)
    b.forward(x1, episode_starts=s1, initial_state=net_b.initial_state(3))
    b.backward_step(d1, accumulate=True)
    gsum = net_b.grad_arena.clone()
    b.forward(x2, episode_starts=s2, initial_state=net_b.initial_state(3))
    b.backward_step(d2, accumulate=True)
    assert not torch.equal(gsum, net_b.grad_arena)
    b.forward(x2, episode_starts=s2, initial_state=net_b.initial_state(3))
    b.backward_step(torch.zeros_like(d2))
    torch.testing.assert_close(net_a.arena, net_b.arena, rtol=0, atol=0)


def test_fused_step_equals_split_step():
    gen = torch.Generator().manual_seed(3)
    net_a, a = make(lr=1e-3, max_grad_norm=1.0)
    net_b, b = make(lr=1e-3, max_grad_norm=1.0)
    for _ in range(3):
        x, d, s = data(gen)
        ma = a.step(x, d, episode_starts=s)
        b.forward(x, episode_starts=s)
        mb = b.backward_step(d)
        assert ma.to_dict() == mb.to_dict()
    torch.testing.assert_close(net_a.arena, net_b.arena, rtol=0, atol=0)
    torch.testing.assert_close(a.state.ssm, b.state.ssm, rtol=0, atol=0)


def test_carried_state_and_reset():
    gen = torch.Generator().manual_seed(4)
    net, tr = make(lr=0.0)
    x, d, _ = data(gen)
    y1 = tr.forward(x)  # from zeros
    tr.backward_step(d)
    y2 = tr.forward(x)  # continues from y1's final state
    tr.backward_step(d)
    assert not torch.allclose(y1, y2)
    tr.reset_state()
    y3 = tr.forward(x)
    tr.backward_step(d)
    torch.testing.assert_close(y3, y1, rtol=0, atol=0)
    tr.reset_state(torch.tensor([True, False, False]))
    assert tr.state.ssm[:, 0].abs().sum() == 0 and tr.state.ssm[:, 1].abs().sum() > 0


def test_A_log_reaches_the_scan_after_training():
    """Regression (seed pitfall): after AdamW updates A_log the scan must use the new A = -exp(A_log)."""
    gen = torch.Generator().manual_seed(5)
    net, tr = make(lr=5e-2)
    A0 = _A(tr).clone()
    x = torch.randn(3, 8, 5, generator=gen)
    for _ in range(5):
        tr.step(x, torch.randn(3, 8, 16, generator=gen), initial_state=net.initial_state(3))
    assert not torch.allclose(_A(tr), A0)
    # The forward now depends on the updated A_log: perturbing A_log back changes the features.
    y_now, _ = net(x)
    with torch.no_grad():
        for l, a in zip(net.layers, A0):
            l.mixer.A_log.copy_(torch.log(-a))
    y_old, _ = net(x)
    assert not torch.allclose(y_now, y_old)


def test_f16_overflow_is_skipped_and_scale_halves():
    gen = torch.Generator().manual_seed(6)
    net, tr = make(dtype="f16", lr=1e-3)
    x, d, s = data(gen)
    tr.step(x, d * 1e-6, episode_starts=s)  # a clean step
    before = [t.clone() for t in (net.arena, tr.exp_avg, tr.exp_avg_sq, tr.scalars[:3], net.compute_arena)]
    scale0 = float(tr.scaler.scale)
    m = tr.step(x, d * 1e30, episode_starts=s)  # overflows in f16
    assert bool(m.overflow_skipped) and int(m.step) == 1
    for a, b in zip(before, (net.arena, tr.exp_avg, tr.exp_avg_sq, tr.scalars[:3], net.compute_arena)):
        assert torch.equal(a, b)
    assert float(tr.scaler.scale) == scale0 / 2
    for t in (net.arena, tr.exp_avg, tr.exp_avg_sq, net.grad_arena):
        assert torch.isfinite(t).all()


def test_f16_scale_grows_after_growth_interval():
    gen = torch.Generator().manual_seed(7)
    net, tr = make(dtype="f16", lr=1e-4, growth_interval=3)
    x, d, s = data(gen)
    s0 = float(tr.scaler.scale)
    for i in range(3):
        m = tr.step(x, d * 1e-7, episode_starts=s)
        assert not bool(m.overflow_skipped)
    assert float(tr.scaler.scale) == 2 * s0
    assert int(m.step) == 3


def test_bf16_reference_runs_close_to_f32():
    gen = torch.Generator().manual_seed(8)
    x, d, s = data(gen)
    net32, t32 = make(lr=1e-3)
    net16, t16 = make(dtype="bf16", lr=1e-3)
    y32 = t32.forward(x, episode_starts=s)
    y16 = t16.forward(x, episode_starts=s)
    assert float((y16 - y32).norm() / y32.norm()) < 2e-2
    t32.backward_step(d, accumulate=True)
    t16.backward_step(d, accumulate=True)
    assert float((net16.grad_arena - net32.grad_arena).norm() / net32.grad_arena.norm()) < 2e-2


def test_zero_copy_buffers_equal_copying():
    gen = torch.Generator().manual_seed(9)
    x, d, s = data(gen)
    net_a, a = make(lr=1e-3)
    net_b, b = make(lr=1e-3)
    a.step(x, d, episode_starts=s)
    b.x_buf.copy_(x)
    b.d_buf.copy_(d)
    b.starts_buf.copy_(s)
    b.step(None, None)
    assert torch.equal(net_a.arena, net_b.arena)
    with pytest.raises(ValueError, match="starts_buf"):
        b.step(None, None, episode_starts=s)


# ---- edge cases: bad inputs, resets, numerics, interplay with plain torch




def test_trainer_carried_state_equals_forward_handoff():
    tr = make_trainer(lr=0.0)  # lr 0: weights stay, only the state moves
    net = tr.net
    g = torch.Generator().manual_seed(12)
    xs = [torch.randn(2, 4, IN, generator=g) for _ in range(3)]
    ss = [torch.rand(2, 4, generator=g) < 0.3 for _ in range(3)]
    st = None
    for x, s in zip(xs, ss):
        tr.step(x, torch.randn(2, 4, 8, generator=g), episode_starts=s)
        _, st = net(x, st, s)
        assert torch.equal(tr.state.ssm, st.ssm.detach()) and torch.equal(tr.state.conv, st.conv.detach())
    tr.reset_state(torch.tensor([False, True]))
    assert torch.count_nonzero(tr.state.ssm[:, 1]) == 0 and torch.equal(tr.state.ssm[:, 0], st.ssm[:, 0].detach())
    feat = tr.forward(xs[0])  # continues from the carried state with row 1 zeroed
    mask = torch.tensor([1.0, 0.0]).view(1, 2, 1, 1)
    y, _ = net(xs[0], RecurrentState(st.conv.detach() * mask, st.ssm.detach() * mask))
    assert torch.equal(feat, y.detach())


def test_trainer_initial_state_overrides_carried():
    tr = make_trainer(lr=0.0)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(2, 4, IN, generator=g)
    tr.forward(torch.randn(2, 4, IN, generator=g))  # moves the carried state
    init = rand_state(tr.net, 2, g)
    feat = tr.forward(x, initial_state=init)
    y, fin = tr.net(x, init)
    assert torch.equal(feat, y.detach()) and torch.equal(tr.state.ssm, fin.ssm.detach())


def test_trainer_step_matches_torch_adamw_autograd():
    """Fused step == autograd grads of <feat, d> + torch.optim.AdamW with clip, on an independent copy."""
    g = torch.Generator().manual_seed(14)
    tr = make_trainer(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, no_decay=None)
    ref = make_net()
    params = {n: p.detach().clone().requires_grad_() for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(params.values(), lr=1e-2, weight_decay=0.1)
    st = None
    for _ in range(4):
        x, d = torch.randn(2, 4, IN, generator=g), torch.randn(2, 4, 8, generator=g)
        s = torch.rand(2, 4, generator=g) < 0.3
        tr.step(x, d, episode_starts=s)
        opt.zero_grad()
        y, st2 = torch.func.functional_call(ref, params, (x, st, s))
        (y * d).sum().backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 0.5)
        opt.step()
        st = st2.detach()
    for n, p in tr.net.named_parameters():
        torch.testing.assert_close(p, params[n], rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_equals_sum():
    g = torch.Generator().manual_seed(15)
    data = [(torch.randn(2, 4, IN, generator=g), torch.randn(2, 4, 8, generator=g)) for _ in range(2)]
    a = make_trainer(lr=1e-2, betas=(0.0, 0.999))
    init = a.net.initial_state(2)
    for i, (x, d) in enumerate(data):
        a.forward(x, initial_state=init)
        m = a.backward_step(d, accumulate=(i == 0))
    assert int(m.step) == 1
    ref = make_net()
    for x, d in data:
        (ref(x)[0] * d).sum().backward()
    torch.testing.assert_close(m.grad_norm.float(), ref.grad_arena.norm(), rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(a.net.grad_arena) == 0  # cleared after the step


def test_f16_overflow_skip_keeps_everything():
    tr = make_trainer("f16", lr=1e-2)
    snap = [t.clone() for t in (tr.net.arena, tr.exp_avg, tr.exp_avg_sq, tr.net.compute_arena)]
    m = tr.step(torch.randn(2, 4, IN), torch.full((2, 4, 8), 1e6))
    assert bool(m.overflow_skipped) and int(m.step) == 0 and float(m.loss_scale) == 2.0 ** 15
    assert all(torch.equal(a, b) for a, b in zip(snap, (tr.net.arena, tr.exp_avg, tr.exp_avg_sq, tr.net.compute_arena)))
    m = tr.step(torch.randn(2, 4, IN), torch.randn(2, 4, 8) * 1e-4)
    assert not bool(m.overflow_skipped) and int(m.step) == 1 and not torch.equal(tr.net.arena, snap[0])


def test_bf16_trainer_close_to_f32():
    g = torch.Generator().manual_seed(16)
    x, d = torch.randn(2, 4, IN, generator=g), torch.randn(2, 4, 8, generator=g)
    a, b = make_trainer("f32", lr=1e-3), make_trainer("bf16", lr=1e-3)
    fa, fb = a.forward(x), b.forward(x)
    assert fb.dtype == torch.float32
    torch.testing.assert_close(fb, fa, rtol=0.05, atol=0.05)
    ma, mb = a.backward_step(d), b.backward_step(d)
    assert abs(float(ma.grad_norm) - float(mb.grad_norm)) < 0.05 * float(ma.grad_norm)
    assert torch.equal(b.net.compute_arena, b.net.arena.to(torch.bfloat16))


def test_accumulate_then_fused_step_sums_grads():
    a = make_trainer(lr=1e-2)
    b = make_net()
    g = torch.Generator().manual_seed(21)
    x1, d1, x2, d2 = (torch.randn(2, 4, n, generator=g) for n in (IN, 8, IN, 8))
    a.forward(x1)
    assert a.backward_step(d1, accumulate=True) is None
    m = a.step(x2, d2, initial_state=a.net.initial_state(2))
    (b(x1)[0] * d1).sum().backward()
    (b(x2)[0] * d2).sum().backward()
    torch.testing.assert_close(m.grad_norm.float(), b.grad_arena.norm(), rtol=1e-5, atol=1e-6)


def test_returned_features_are_safe_to_modify_and_metrics_frozen():
    a, b = make_trainer(), make_trainer()
    x, d = torch.randn(2, 4, IN), torch.randn(2, 4, 8)
    fa = a.forward(x)
    fa.mul_(0).add_(float("nan"))  # the caller scribbles on the returned features
    b.forward(x)
    ma, mb = a.backward_step(d), b.backward_step(d)
    assert torch.equal(ma.grad_norm, mb.grad_norm) and torch.equal(a.net.arena, b.net.arena)
    frozen = ma.to_dict()
    a.step(x, d)
    assert ma.to_dict() == frozen and frozen["step"] == 1


def test_tf32_is_f32_on_the_cpu_bit_for_bit():
    """dtype="tf32" opts the CUDA GEMMs into TF32 tensor cores; the CPU has none, so there it is "f32" exactly."""
    import torch as _t

    from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer

    cfg = MambaConfig(d_model=32, n_layers=2, d_state=8)
    g = _t.Generator().manual_seed(3)
    data = [(_t.randn(2, 16, 5, generator=g), _t.randn(2, 16, 32, generator=g), _t.rand(2, 16, generator=g) < 0.2)
            for _ in range(3)]
    arenas = []
    for dtype in ("f32", "tf32"):
        net = MambaBackbone(cfg, 5, seed=1)
        tr = MambaTrainer(net, 2, 16, dtype=dtype, lr=1e-3)
        assert not tr.tf32
        for x, d, s in data:
            tr.step(x, d, episode_starts=s)
        arenas.append(net.arena.clone())
    assert _t.equal(arenas[0], arenas[1])
