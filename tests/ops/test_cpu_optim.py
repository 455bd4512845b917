"""The CPU optimizer kernels (csrc/cpu/optim.cpp: grad_stats, adamw_step) against their float64 twin
(:func:`mamba_rl.ops.optim.grad_stats_ref` / :func:`adamw_step_ref` run on float64 copies), the float32
reference and ``torch.optim.AdamW`` + ``clip_grad_norm_``, on fresh random inputs (never zeros: moments,
weights and gradients all random), plus the skip-on-overflow semantics and the argument errors.

Runs on any CPU; skipped (with the cause) only when no C++ compiler can build the kernels.
"""
import math

import pytest
import torch

from mamba_rl.ops.optim import (BC1, BC2, CLIP_COEF, FOUND_INF, GRAD_NORM, INV_SCALE, STEP, adamw_step,
                                adamw_step_ref, grad_stats, grad_stats_ref, make_hyper)


def _case(P, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(P, generator=g)
    grad = torch.randn(P, generator=g) * scale
    m = torch.randn(P, generator=g) * 0.1
    v = torch.rand(P, generator=g) * 0.01 + 1e-6
    return p, grad, m, v


def _scalars(step=0.0):
    s = torch.zeros(8, dtype=torch.float64)
    s[STEP], s[BC1], s[BC2] = step, 1.0, 1.0
    return s


@pytest.mark.parametrize("P,n_decay,clip,loss_scale,step", [
    (1, 1, 0.5, 1.0, 0.0), (37, 20, None, 1.0, 3.0), (100_003, 60_001, 0.5, 1.0, 7.0),
    (350_720, 300_000, 1e-3, 1024.0, 0.0), (50_000, 0, 10.0, 65536.0, 11.0), (50_000, 50_000, 0.5, 1.0, 1e9)])
def test_grad_stats_and_adamw_match_the_float64_twin(cpu_ext, P, n_decay, clip, loss_scale, step):
    p, grad, m, v = _case(P, seed=P + n_decay, scale=loss_scale)
    hyper = make_hyper(3e-3, (0.9, 0.999), 1e-8, 0.1, clip, False, "cpu")
    extra = torch.tensor(0.37)
    s_c, s_64 = _scalars(step), _scalars(step)
    ls = torch.tensor([loss_scale])
    grad_stats(grad, extra, ls, hyper, s_c, kernels=cpu_ext)
    grad_stats_ref(grad.double(), extra.double(), ls.double(), hyper, s_64)
    for k in (STEP, BC1, BC2, FOUND_INF, INV_SCALE):
        assert s_c[k].item() == pytest.approx(s_64[k].item(), rel=1e-12, abs=0), k
    assert s_c[GRAD_NORM].item() == pytest.approx(s_64[GRAD_NORM].item(), rel=1e-10)
    assert s_c[CLIP_COEF].item() == pytest.approx(s_64[CLIP_COEF].item(), rel=1e-10)
    c = [t.clone() for t in (p, m, v)]
    d = [t.double() for t in (p, m, v)]
    comp = torch.empty(P)
    adamw_step(c[0], grad, c[1], c[2], hyper, s_c, n_decay, comp, kernels=cpu_ext)
    adamw_step_ref(d[0], grad.double(), d[1], d[2], hyper, s_64, n_decay)
    for a, b in zip(c, d):
        assert torch.isfinite(a).all()
        # float32 roundings of a few operations: relative to each element, with a floor at 1% of the
        # tensor's mean magnitude (elements that cancel to ~0, e.g. m = m + w1 (g - m), keep absolute error)
        err = ((a.double() - b).abs() / (b.abs() + 1e-2 * b.abs().mean())).max().item()
        assert err < 1e-5, err
    assert torch.equal(comp, c[0])
    # and next to the float32 reference: a few float32 roundings apart at most
    r = [t.clone() for t in (p, m, v)]
    s_r = _scalars(step)
    grad_stats_ref(grad, extra, ls, hyper, s_r)
    adamw_step_ref(r[0], grad, r[1], r[2], hyper, s_r, n_decay)
    for a, b in zip(c, r):
        assert torch.allclose(a, b, rtol=2e-6, atol=1e-7)


def test_adamw_matches_torch_optim_adamw_over_several_steps(cpu_ext):
    P, n_decay, steps = 5_000, 3_000, 6
    p0, _, _, _ = _case(P, seed=1)
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(P, generator=g) for _ in range(steps)]
    lr, wd, mgn = 1e-2, 0.05, 0.5
    hyper = make_hyper(lr, (0.9, 0.99), 1e-7, wd, mgn, False, "cpu")
    s = _scalars()
    p, m, v = p0.clone(), torch.zeros(P), torch.zeros(P)
    q = p0.clone().requires_grad_()  # torch: two groups over views of one leaf are not allowed, so two leaves
    qa, qb = q.detach()[:n_decay].clone().requires_grad_(), q.detach()[n_decay:].clone().requires_grad_()
    opt = torch.optim.AdamW([{"params": [qa], "weight_decay": wd}, {"params": [qb], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.99), eps=1e-7, foreach=False)
    for gr in grads:
        grad_stats(gr, None, torch.ones(1), hyper, s, kernels=cpu_ext)
        adamw_step(p, gr, m, v, hyper, s, n_decay, kernels=cpu_ext)
        qa.grad, qb.grad = gr[:n_decay].clone(), gr[n_decay:].clone()
        torch.nn.utils.clip_grad_norm_([qa, qb], mgn)
        opt.step()
    ref = torch.cat([qa.detach(), qb.detach()])
    assert ((p - ref).abs() / (ref.abs() + 1e-3)).max().item() < 1e-5
    assert s[STEP].item() == steps


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("skip", [True, False])
def test_overflow_flag_and_skip_semantics(cpu_ext, bad, skip):
    P = 20_000
    p, grad, m, v = _case(P, seed=5)
    grad[12_345] = bad
    hyper = make_hyper(1e-3, (0.9, 0.999), 1e-8, 0.0, 0.5, skip, "cpu")
    s, s_ref = _scalars(4.0), _scalars(4.0)
    s[BC1] = s_ref[BC1] = 0.3
    grad_stats(grad, None, torch.ones(1), hyper, s, kernels=cpu_ext)
    grad_stats_ref(grad, None, torch.ones(1), hyper, s_ref)
    assert s[FOUND_INF].item() == 1.0 == s_ref[FOUND_INF].item()
    assert s[STEP].item() == s_ref[STEP].item() == (4.0 if skip else 5.0)
    assert s[BC1].item() == s_ref[BC1].item()
    before = [t.clone() for t in (p, m, v)]
    comp = p.clone()
    adamw_step(p, grad, m, v, hyper, s, 0, comp, kernels=cpu_ext)
    if skip:  # nothing written, the compute copy included
        for a, b in zip((p, m, v), before):
            assert torch.equal(a, b)
        assert torch.equal(comp, before[0])
    else:  # applied like the reference (the non-finite norm makes the clip factor NaN / 0)
        r = [t.clone() for t in before]
        adamw_step_ref(r[0], grad, r[1], r[2], hyper, s_ref, 0)
        for a, b in zip((p, m, v), r):
            assert torch.equal(torch.isnan(a), torch.isnan(b))


def test_grad_norm_is_the_same_for_any_thread_count(cpu_ext):
    _, grad, _, _ = _case(300_000, seed=9)
    hyper = make_hyper(1e-3, (0.9, 0.999), 1e-8, 0.0, 0.5, False, "cpu")
    old = torch.get_num_threads()
    norms = []
    try:
        for nt in (1, 2, 3):
            torch.set_num_threads(nt)
            s = _scalars()
            grad_stats(grad, None, torch.ones(1), hyper, s, kernels=cpu_ext)
            norms.append(s[GRAD_NORM].item())
    finally:
        torch.set_num_threads(old)
    assert norms[0] == norms[1] == norms[2]
    assert norms[0] == pytest.approx(math.sqrt(grad.double().square().sum().item()), rel=1e-12)


def test_bf16_compute_copy_is_the_cast_of_the_new_weights(cpu_ext):
    P = 4_097
    p, grad, m, v = _case(P, seed=3)
    hyper = make_hyper(1e-3, (0.9, 0.999), 1e-8, 0.01, None, False, "cpu")
    s = _scalars()
    grad_stats(grad, None, torch.ones(1), hyper, s, kernels=cpu_ext)
    comp = torch.zeros(P, dtype=torch.bfloat16)
    adamw_step(p, grad, m, v, hyper, s, P, comp, kernels=cpu_ext)
    assert torch.equal(comp, p.to(torch.bfloat16))


def test_bad_arguments_raise_value_errors_naming_them(cpu_ext):
    P = 64
    p, grad, m, v = _case(P, seed=4)
    hyper = make_hyper(1e-3, (0.9, 0.999), 1e-8, 0.0, None, False, "cpu")
    s = _scalars()
    with pytest.raises(ValueError, match=r"adamw_step: exp_avg: expected 64 elements, got shape \[63\]"):
        cpu_ext.adamw_step(p, grad, m[:63], v, hyper, s, 0, None)
    with pytest.raises(ValueError, match=r"adamw_step: grad: expected dtype Float, got Double"):
        cpu_ext.adamw_step(p, grad.double(), m, v, hyper, s, 0, None)
    with pytest.raises(ValueError, match=r"adamw_step: n_decay: expected a value in \[0, 64\], got 65"):
        cpu_ext.adamw_step(p, grad, m, v, hyper, s, 65, None)
    with pytest.raises(ValueError, match=r"adamw_step: param: expected a flat \[P\] arena, got shape \[8, 8\]"):
        cpu_ext.adamw_step(p.view(8, 8), grad, m, v, hyper, s, 0, None)
    with pytest.raises(ValueError, match=r"adamw_step: hyper: expected dtype Double, got Float"):
        cpu_ext.adamw_step(p, grad, m, v, hyper.float(), s, 0, None)
    with pytest.raises(ValueError, match=r"adamw_step: compute: expected dtype float32, bfloat16 or float16, got Int"):
        cpu_ext.adamw_step(p, grad, m, v, hyper, s, 0, torch.zeros(P, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"grad_stats: scalars: expected 8 elements, got shape \[7\]"):
        cpu_ext.grad_stats(grad, None, torch.ones(1), hyper, s[:7].clone())
    with pytest.raises(ValueError, match=r"grad_stats: loss_scale: expected dtype Float, got Double"):
        cpu_ext.grad_stats(grad, None, torch.ones(1, dtype=torch.float64), hyper, s)
    with pytest.raises(ValueError, match=r"grad_stats: grad: expected a contiguous tensor"):
        cpu_ext.grad_stats(torch.randn(2 * P)[::2], None, torch.ones(1), hyper, s)


@pytest.mark.parametrize("skip_step", [False, True])
@pytest.mark.parametrize("P,n_decay,compute", [(1, 1, None), (100_003, 60_001, "f32"), (350_720, 300_000, "bf16")])
def test_zero_grad_in_the_pass_is_the_step_then_a_zeroed_arena(cpu_ext, P, n_decay, compute, skip_step):
    """adamw_step(zero_grad=True) zeroes the gradient in the same pass: param, moments and the compute copy are
    bit for bit those of the step without it, and the arena is all zeros after it, on a skipped overflow step
    too (whose weights, moments and compute copy stay as they were), for 1 and 2 threads."""
    old = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            p, grad, m, v = _case(P, seed=P + nt)
            if skip_step:
                grad[P // 2] = float("inf")
            hyper = make_hyper(1e-3, (0.9, 0.999), 1e-8, 0.1, 0.5, skip_step, "cpu")
            s = _scalars(2.0)
            grad_stats(grad, None, torch.ones(1), hyper, s, kernels=cpu_ext)
            dt = {None: None, "f32": torch.float32, "bf16": torch.bfloat16}[compute]
            outs = []
            for zero in (False, True):
                st = [t.clone() for t in (p, grad, m, v)]
                comp = None if dt is None else torch.full((P,), 7.0, dtype=dt)
                adamw_step(st[0], st[1], st[2], st[3], hyper, s.clone(), n_decay, comp, kernels=cpu_ext,
                           zero_grad=zero)
                outs.append((st, comp))
            (a, ca), (b, cb) = outs
            for k in (0, 2, 3):
                assert torch.equal(a[k], b[k]), k
            if compute is not None:
                assert torch.equal(ca, cb)
            assert torch.equal(a[1], grad)  # without zero_grad the arena is left as it was
            assert not b[1].any() and not torch.signbit(b[1]).any()  # +0.0 everywhere
            if skip_step:
                assert torch.equal(b[0], p) and torch.equal(b[2], m) and torch.equal(b[3], v)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("extra,clip,want", [(math.inf, None, 1.0), (math.inf, 0.5, 0.0), (math.nan, None, math.nan),
                                             (math.nan, 0.5, math.nan)])
def test_clip_coefficient_of_a_non_finite_norm_matches_the_twin(cpu_ext, extra, clip, want):
    """max_grad_norm None (no clipping) keeps the coefficient 1 also when the norm is infinite (here through a
    head's squared norm, which the overflow flag does not see), where inf / inf would give NaN; a finite
    max_grad_norm gives 0, and a NaN norm a NaN coefficient, in the kernel and the float64 twin alike."""
    _, grad, _, _ = _case(1000, seed=9)
    hyper = make_hyper(1e-3, (0.9, 0.999), 1e-8, 0.0, clip, False, "cpu")
    s, s_ref = _scalars(), _scalars()
    grad_stats(grad, torch.tensor(extra), torch.ones(1), hyper, s, kernels=cpu_ext)
    grad_stats_ref(grad.double(), torch.tensor(extra, dtype=torch.float64), torch.ones(1, dtype=torch.float64),
                   hyper, s_ref)
    for got in (s[CLIP_COEF].item(), s_ref[CLIP_COEF].item()):
        assert (math.isnan(got) and math.isnan(want)) or got == want, (got, want)
