"""CPU kernels (csrc/cpu via mamba_rl.ops.extension) vs the float64 references, forward and backward.

Every case draws fresh random inputs (never zeros: initial states, upstream gradients and accumulators
included) and compares float32 kernel results with the float64 references (gradients from the refs'
autograd) at relative error <= 1e-4 over whole tensors. Outputs are NaN-poisoned on allocation
(``set_poison``), so an element a kernel forgets to write fails the finiteness check. Rows of the batch
carry the reset patterns: none, at t = 0, at T-1, at every step, two adjacent starts, random.

Runs on any CPU; skipped (with the cause) only when no C++ compiler can build the kernels.
"""
import math
import re

import pytest
import torch

from mamba_rl.ops.conv import causal_conv1d_ref
from mamba_rl.ops.norm import rms_norm_ref
from mamba_rl.ops.scan import selective_scan_ref
from tests.helpers import check_dbc_out, seq_forward_ref

TOL = 1e-4


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all(), "non-finite (unwritten?) elements"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def starts_patterns(T, g):
    """[6, T] bool: rows with no start, a start at 0, at T-1, at every step, two adjacent, random."""
    s = torch.zeros(6, T, dtype=torch.bool)
    s[1, 0] = True
    s[2, T - 1] = True
    s[3, :] = True
    s[4, T // 2] = True
    s[4, min(T - 1, T // 2 + 1)] = True
    s[5] = torch.rand(T, generator=g) < 0.1
    return s


def rn(g, *shape, scale=1.0, shift=0.0):
    return torch.randn(*shape, generator=g) * scale + shift


def conv_inputs(g, B, T, D, K):
    big = rn(g, B, T, 2 * D)  # x as the left half of an in_proj-like output: non-contiguous rows
    return dict(x=big[..., :D], w=rn(g, D, K, scale=0.5), b=rn(g, D, scale=0.2), st=rn(g, B, D, K - 1))


def scan_inputs(g, B, T, D, N, R=3):
    xz = rn(g, B, T, 2 * D)
    dbc = rn(g, B, T, R + 2 * N)
    dt = rn(g, B, T, D, scale=0.5, shift=-1.0)
    dt[0, :, :2] = 25.0  # softplus above its threshold (20) ...
    dt[-1, :, -2:] = -30.0  # ... and deep in its exponential tail
    A_log = torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(D, 1) + rn(g, D, N, scale=0.1)
    return dict(x=xz[..., :D], dt=dt, A_log=A_log, Bm=dbc[..., R:R + N], Cm=dbc[..., R + N:],
                Dp=rn(g, D), z=xz[..., D:], dtb=rn(g, D, scale=0.5, shift=-2.0), s0=rn(g, B, D, N))


def conv_ref_grads(inp, starts, dout, dfin):
    leaves = [inp[k].detach().double().requires_grad_(True) for k in ("x", "w", "b", "st")]
    out, fin = causal_conv1d_ref(*leaves, starts)
    return out, fin, torch.autograd.grad([out, fin], leaves, [dout.double(), dfin.double()])


def scan_ref_grads(inp, starts, dy, dfin):
    keys = ("x", "dt", "A_log", "Bm", "Cm", "Dp", "z", "dtb", "s0")
    leaves = [inp[k].detach().double().requires_grad_(True) for k in keys]
    y, fin = selective_scan_ref(*leaves, starts)
    return y, fin, torch.autograd.grad([y, fin], leaves, [dy.double(), dfin.double()])


# --------------------------------------------------------------------------------------- causal conv1d
@pytest.mark.parametrize("T", [1, 3, 63, 64, 65, 1000])
def test_conv_fwd_bwd_vs_reference(cpu_ext, T):
    g = torch.Generator().manual_seed(11 + T)
    D, K = (40 if T >= 1000 else 80), 4  # 80 = two full 32-channel blocks + a partial one
    inp = conv_inputs(g, 6, T, D, K)
    starts = starts_patterns(T, g)
    dout_big = rn(g, 6, T, 2 * D)
    dout = dout_big[..., D:]  # strided upstream gradient
    dfin = rn(g, 6, D, K - 1)
    out, fin = cpu_ext.conv_fwd(inp["x"], inp["w"], inp["b"], inp["st"], starts)
    rout, rfin, rg = conv_ref_grads(inp, starts, dout, dfin)
    assert out.dtype == torch.float32 and out.is_contiguous()
    assert rel(out, rout) <= TOL and rel(fin, rfin) <= TOL
    dx, dw, db, dst = cpu_ext.conv_bwd(inp["x"], inp["w"], inp["b"], inp["st"], starts, dout, dfin, True)
    for name, a, r in zip(("dx", "dweight", "dbias", "dstate"), (dx, dw, db, dst), rg):
        assert rel(a, r) <= TOL, name


@pytest.mark.parametrize("K", [1, 2, 7])
def test_conv_any_width(cpu_ext, K):
    """d_conv other than 4 (1: no carried window), odd channel counts, no initial state / no dfinal."""
    g = torch.Generator().manual_seed(5 + K)
    T, D = 70, 3
    inp = conv_inputs(g, 6, T, D, K)
    starts = starts_patterns(T, g)
    dout, dfin = rn(g, 6, T, D), rn(g, 6, D, K - 1)
    out, fin = cpu_ext.conv_fwd(inp["x"], inp["w"], inp["b"], inp["st"], starts)
    rout, rfin, rg = conv_ref_grads(inp, starts, dout, dfin)
    assert fin.shape == (6, D, K - 1)
    assert rel(out, rout) <= TOL and (K == 1 or rel(fin, rfin) <= TOL)
    dx, dw, db, dst = cpu_ext.conv_bwd(inp["x"], inp["w"], inp["b"], inp["st"], starts, dout, dfin, True)
    assert rel(dx, rg[0]) <= TOL and rel(dw, rg[1]) <= TOL and rel(db, rg[2]) <= TOL
    assert dst.shape == (6, D, K - 1) and (K == 1 or rel(dst, rg[3]) <= TOL)
    # no initial state, no starts, no dfinal, no dinit
    out0, _ = cpu_ext.conv_fwd(inp["x"], inp["w"], inp["b"], None, None)
    leaves = [inp[k].detach().double().requires_grad_(True) for k in ("x", "w", "b")]
    rout0, _ = causal_conv1d_ref(*leaves)
    rg0 = torch.autograd.grad(rout0, leaves, dout.double())
    dx0, dw0, db0, dst0 = cpu_ext.conv_bwd(inp["x"], inp["w"], inp["b"], None, None, dout, None, False)
    assert dst0 is None
    assert rel(out0, rout0) <= TOL
    for a, r in zip((dx0, dw0, db0), rg0):
        assert rel(a, r) <= TOL


def test_conv_bwd_strided_out_and_accumulate(cpu_ext):
    """dx_out (a strided half of a buffer) is written in place, its other half untouched; dw_acc/db_acc
    receive the gradients added to their previous (non-zero) contents."""
    g = torch.Generator().manual_seed(3)
    B, T, D, K = 6, 37, 80, 4
    inp = conv_inputs(g, B, T, D, K)
    starts = starts_patterns(T, g)
    dout, dfin = rn(g, B, T, D), rn(g, B, D, K - 1)
    _, _, rg = conv_ref_grads(inp, starts, dout, dfin)
    buf = rn(g, B, T, 2 * D)
    right = buf[..., D:].clone()
    dw_acc, db_acc = rn(g, D, K), rn(g, D)
    dw0, db0 = dw_acc.clone(), db_acc.clone()
    dx, dw, db, _ = cpu_ext.conv_bwd(inp["x"], inp["w"], inp["b"], inp["st"], starts, dout, dfin, False,
                                     buf[..., :D], dw_acc, db_acc)
    assert dx.data_ptr() == buf.data_ptr() and dw.data_ptr() == dw_acc.data_ptr()
    assert rel(buf[..., :D], rg[0]) <= TOL
    assert torch.equal(buf[..., D:], right)
    assert rel(dw_acc - dw0, rg[1]) <= TOL and rel(db_acc - db0, rg[2]) <= TOL


# ------------------------------------------------------------------------------------ selective scan
@pytest.mark.parametrize("T", [1, 3, 63, 64, 65, 1000])
def test_scan_fwd_bwd_vs_reference(cpu_ext, T):
    g = torch.Generator().manual_seed(7 + T)
    D, N = (40 if T >= 1000 else 80), 16
    inp = scan_inputs(g, 6, T, D, N)
    starts = starts_patterns(T, g)
    dy, dfin = rn(g, 6, T, D), rn(g, 6, D, N)
    args = [inp[k] for k in ("x", "dt", "A_log", "Bm", "Cm", "Dp", "z", "dtb", "s0")]
    y, fin, ckpt = cpu_ext.scan_fwd(*args, starts, True)
    ry, rfin, rg = scan_ref_grads(inp, starts, dy, dfin)
    assert rel(y, ry) <= TOL and rel(fin, rfin) <= TOL
    assert ckpt.shape == (6, math.ceil(T / cpu_ext.scan_chunk()), D, N)
    grads = cpu_ext.scan_bwd(*args, starts, ckpt, dy, dfin, True)
    names = ("dx", "ddt", "dA_log", "dB", "dC", "dD", "dz", "ddt_bias", "dstate")
    for name, a, r in zip(names, grads, rg):
        assert rel(a, r) <= TOL, name


@pytest.mark.parametrize("N", [1, 5])
def test_scan_any_state_size(cpu_ext, N):
    """d_state other than 8/16, a d_inner below one channel block, T across a checkpoint boundary."""
    g = torch.Generator().manual_seed(100 + N)
    T, D = 70, 3
    inp = scan_inputs(g, 6, T, D, N, R=2)
    starts = starts_patterns(T, g)
    dy, dfin = rn(g, 6, T, D), rn(g, 6, D, N)
    args = [inp[k] for k in ("x", "dt", "A_log", "Bm", "Cm", "Dp", "z", "dtb", "s0")]
    y, fin, ckpt = cpu_ext.scan_fwd(*args, starts, True)
    ry, rfin, rg = scan_ref_grads(inp, starts, dy, dfin)
    assert rel(y, ry) <= TOL and rel(fin, rfin) <= TOL
    for a, r in zip(cpu_ext.scan_bwd(*args, starts, ckpt, dy, dfin, True), rg):
        assert rel(a, r) <= TOL


def test_scan_bwd_strided_out_and_accumulate(cpu_ext):
    """The fused.py call: no initial state, dz into the right half of a dxz buffer (left half untouched),
    acc = [dA_log, dD, dt_bias] grads added to non-zero contents, no dinit; need_ckpt=False gives None."""
    g = torch.Generator().manual_seed(42)
    B, T, D, N = 6, 77, 80, 16
    inp = scan_inputs(g, B, T, D, N)
    starts = starts_patterns(T, g)
    dy = rn(g, B, T, D)
    args = [inp[k] for k in ("x", "dt", "A_log", "Bm", "Cm", "Dp", "z", "dtb")]
    y_nock, fin_nock, none = cpu_ext.scan_fwd(*args, None, starts, False)
    assert none is None
    y, _, ckpt = cpu_ext.scan_fwd(*args, None, starts, True)
    assert torch.equal(y, y_nock)
    keys = ("x", "dt", "A_log", "Bm", "Cm", "Dp", "z", "dtb")
    leaves = [inp[k].detach().double().requires_grad_(True) for k in keys]
    ry, _ = selective_scan_ref(*leaves, None, starts)
    rg = torch.autograd.grad(ry, leaves, dy.double())
    assert rel(y, ry) <= TOL
    dxz = rn(g, B, T, 2 * D)
    left = dxz[..., :D].clone()
    acc = [rn(g, D, N), rn(g, D), rn(g, D)]
    acc0 = [a.clone() for a in acc]
    out = cpu_ext.scan_bwd(*args, None, starts, ckpt, dy, None, False, dxz[..., D:], acc)
    dx, ddt, dA, dB, dC, dD, dz, ddb, dinit = out
    assert dinit is None and dz.data_ptr() == dxz[..., D:].data_ptr() and dA.data_ptr() == acc[0].data_ptr()
    assert torch.equal(dxz[..., :D], left)
    for name, a, r in (("dx", dx, rg[0]), ("ddt", ddt, rg[1]), ("dB", dB, rg[3]), ("dC", dC, rg[4]),
                       ("dz", dxz[..., D:], rg[6])):
        assert rel(a, r) <= TOL, name
    for name, a, a0, r in (("dA_log", acc[0], acc0[0], rg[2]), ("dD", acc[1], acc0[1], rg[5]),
                           ("ddt_bias", acc[2], acc0[2], rg[7])):
        assert rel(a - a0, r) <= TOL, name


def test_scan_bwd_dbc_out(cpu_ext):
    """dbc_out, the fused backward's dL/d[dt_low, B, C] buffer [B*T, R + 2N] (the CUDA contract): dB / dC land
    in its last 2N columns with the bits of the plain call and come back as [B, T, N] views of them; every other
    element keeps its contents (NaN in an exact-width buffer, random around a column block of a wider one: a row
    stride above R + 2N). The other outputs are unchanged. A bad shape, stride, dtype or device raises ValueError
    naming the expected and the received value."""
    g = torch.Generator().manual_seed(44)
    B, T, D, N, R = 6, 37, 24, 5, 3
    E = R + 2 * N
    inp = scan_inputs(g, B, T, D, N, R)
    starts = starts_patterns(T, g)
    dy, dfin = rn(g, B, T, D), rn(g, B, D, N)
    args = [inp[k] for k in ("x", "dt", "A_log", "Bm", "Cm", "Dp", "z", "dtb", "s0")]
    _, _, ckpt = cpu_ext.scan_fwd(*args, starts, True)
    ref = cpu_ext.scan_bwd(*args, starts, ckpt, dy, dfin, True)
    for full, c0 in ((torch.full((B * T, E), float("nan")), 0), (rn(g, B * T, E + 6), 2)):
        out = check_dbc_out(lambda buf: cpu_ext.scan_bwd(*args, starts, ckpt, dy, dfin, True, dbc_out=buf),
                            ref, full, c0, R, N)
        assert out[3].shape == (B, T, N) and out[4].shape == (B, T, N)
    bad = {
        re.escape("selective_scan: dbc_out: expected shape [222, dt_rank + 10], got [222, 9]"): torch.zeros(B * T, 9),
        re.escape("selective_scan: dbc_out: expected shape [222, dt_rank + 10], got [221, 13]"):
            torch.zeros(B * T - 1, E),
        re.escape("selective_scan: dbc_out: expected shape [222, dt_rank + 10], got [6, 37, 13]"):
            torch.zeros(B, T, E),
        re.escape("selective_scan: dbc_out: expected strides [>= 13, 1], got [1, 222]"): torch.zeros(E, B * T).t(),
        re.escape("selective_scan: dbc_out: expected strides [>= 13, 1], got [4, 1]"):  # overlapping rows
            torch.zeros(4 * B * T + E).as_strided((B * T, E), (4, 1)),
        r"selective_scan: dbc_out: expected dtype float32.*got Double": torch.zeros(B * T, E, dtype=torch.float64),
        r"selective_scan: dbc_out: expected a CPU tensor, got device meta": torch.empty(B * T, E, device="meta"),
    }
    for match, t in bad.items():
        with pytest.raises(ValueError, match=match):
            cpu_ext.scan_bwd(*args, starts, ckpt, dy, dfin, True, dbc_out=t)


def test_results_do_not_depend_on_thread_count(cpu_ext):
    """1 vs 2 OpenMP threads (different task splits and reduction groups) agree to float rounding:
    conv, scan and RMSNorm forward + backward, and a few backbone steps."""
    g = torch.Generator().manual_seed(9)
    w = make_weights(g, 5, 48, 2, 16, 4)
    a = step_args(w, 2, 96, 4)
    xs, st0, ss0 = rn(g, 5, 7, 5), rn(g, 2, 7, 96, 3), rn(g, 2, 7, 96, 16)
    nx, nw, ndy = rn(g, 300, 64), rn(g, 64), rn(g, 300, 64)
    B, T, D, N, K = 3, 130, 100, 16, 4
    inp = scan_inputs(g, B, T, D, N)
    cin = conv_inputs(g, B, T, D, K)
    starts = starts_patterns(T, g)[:B]
    dy, dfin, dcf = rn(g, B, T, D), rn(g, B, D, N), rn(g, B, D, K - 1)
    args = [inp[k] for k in ("x", "dt", "A_log", "Bm", "Cm", "Dp", "z", "dtb", "s0")]
    prev = torch.get_num_threads()
    res = []
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            y, fin, ck = cpu_ext.scan_fwd(*args, starts, True)
            sg = cpu_ext.scan_bwd(*args, starts, ck, dy, dfin, True)
            co, cf = cpu_ext.conv_fwd(cin["x"], cin["w"], cin["b"], cin["st"], starts)
            cg = cpu_ext.conv_bwd(cin["x"], cin["w"], cin["b"], cin["st"], starts, dy, dcf, True)
            cs, ss = st0.clone(), ss0.clone()
            feats = [cpu_ext.backbone_step(xs[t], *a, cs, ss, torch.rand(7, generator=torch.Generator().manual_seed(t))
                                           < 0.3, 1e-5, 0) for t in range(5)]
            u, rstd = cpu_ext.rmsnorm_fwd(nx, nw, 1e-5, torch.float32)
            dwn = torch.ones(64)
            dh = cpu_ext.rmsnorm_bwd(ndy, nx, rstd, nw, dwn, None)
            res.append([y, fin, *sg, co, cf, *cg, *feats, cs, ss, u, rstd, dh, dwn])
    finally:
        torch.set_num_threads(prev)
    for a, b in zip(*res):
        assert rel(a, b) <= 1e-6


def test_resets_select_not_multiply(cpu_ext):
    """NaN/inf in the carried state of a row that starts an episode at t = 0 never reach its outputs or
    gradients (and rows without a start do carry them: the test would notice a state that is ignored)."""
    g = torch.Generator().manual_seed(1)
    B, T, D, N, K = 2, 5, 8, 4, 3
    inp = scan_inputs(g, B, T, D, N)
    cin = conv_inputs(g, B, T, D, K)
    inp["s0"][0, 0, 0] = float("nan")
    inp["s0"][1, 0, 0] = float("nan")
    cin["st"][0, 1, 0] = float("inf")
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[0, 0] = True
    args = [inp[k] for k in ("x", "dt", "A_log", "Bm", "Cm", "Dp", "z", "dtb", "s0")]
    y, fin, ck = cpu_ext.scan_fwd(*args, starts, True)
    assert torch.isfinite(y[0]).all() and torch.isfinite(fin[0]).all() and not torch.isfinite(y[1]).all()
    dy, dfin = rn(g, B, T, D), rn(g, B, D, N)
    grads = cpu_ext.scan_bwd(*args, starts, ck, dy, dfin, True)
    for t in (grads[0], grads[1], grads[6], grads[8]):  # dx, ddt, dz, dinit of row 0
        assert torch.isfinite(t[0]).all()
    out, cf = cpu_ext.conv_fwd(cin["x"], cin["w"], cin["b"], cin["st"], starts)
    assert torch.isfinite(out[0]).all() and torch.isfinite(cf[0]).all()
    dx, _, _, dst = cpu_ext.conv_bwd(cin["x"], cin["w"], cin["b"], cin["st"], starts, rn(g, B, T, D),
                                     rn(g, B, D, K - 1), True)
    assert torch.isfinite(dx[0]).all() and torch.isfinite(dst[0]).all()


# ------------------------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("rows,C", [(1, 128), (7, 40), (1000, 128), (5, 3)])
def test_rmsnorm_vs_reference(cpu_ext, rows, C):
    g = torch.Generator().manual_seed(rows * 7 + C)
    x, w, dy = rn(g, rows, C, scale=3.0), rn(g, C, scale=0.2, shift=1.0), rn(g, rows, C)
    u, rstd = cpu_ext.rmsnorm_fwd(x, w, 1e-5, torch.float32)
    xr, wr = x.double().requires_grad_(True), w.double().requires_grad_(True)
    ur = rms_norm_ref(xr, wr, 1e-5)
    dxr, dwr = torch.autograd.grad(ur, [xr, wr], dy.double())
    assert rstd.shape == (rows, 1) and rel(u, ur) <= TOL
    assert rel(rstd, torch.rsqrt(x.double().square().mean(-1, keepdim=True) + 1e-5)) <= TOL
    dw_acc, dh_acc = rn(g, C), rn(g, rows, C)
    dw0 = dw_acc.clone()
    dh = cpu_ext.rmsnorm_bwd(dy, x, rstd, w, dw_acc, dh_acc)
    assert rel(dh, dxr + dh_acc.double()) <= TOL
    assert rel(dw_acc - dw0, dwr) <= TOL
    dh_only = cpu_ext.rmsnorm_bwd(dy, x, rstd, w, dw_acc, None)
    assert rel(dh_only, dxr) <= TOL


# ------------------------------------------------------------------------------ one-token backbone step
def make_weights(g, in_dim, dm, L, N, K):
    di, r = 2 * dm, math.ceil(dm / 16)
    w = {"input_proj.weight": rn(g, dm, in_dim, scale=in_dim ** -0.5), "input_proj.bias": rn(g, dm, scale=0.1),
         "norm_f.weight": rn(g, dm, scale=0.1, shift=1.0)}
    for i in range(L):
        p = f"layers.{i}."
        w[p + "norm.weight"] = rn(g, dm, scale=0.1, shift=1.0)
        w[p + "mixer.in_proj.weight"] = rn(g, 2 * di, dm, scale=dm ** -0.5)
        w[p + "mixer.conv1d.weight"] = rn(g, di, 1, K, scale=0.5)
        w[p + "mixer.conv1d.bias"] = rn(g, di, scale=0.1)
        w[p + "mixer.x_proj.weight"] = rn(g, r + 2 * N, di, scale=di ** -0.5)
        w[p + "mixer.dt_proj.weight"] = rn(g, di, r, scale=r ** -0.5)
        dt0 = torch.exp(torch.rand(di, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        w[p + "mixer.dt_proj.bias"] = torch.log(torch.expm1(dt0))
        w[p + "mixer.A_log"] = torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(di, 1) \
            + rn(g, di, N, scale=0.1)
        w[p + "mixer.D"] = rn(g, di, scale=0.1, shift=1.0)
        w[p + "mixer.out_proj.weight"] = rn(g, dm, di, scale=di ** -0.5)
    return w


def step_args(w, L, di, K):
    from mamba_rl.ops.step import LAYER_KEYS
    layers = [[w[f"layers.{i}.{k}"] for k in LAYER_KEYS] for i in range(L)]
    for t in layers:
        t[2] = t[2].reshape(di, K)
    return w["input_proj.weight"], w["input_proj.bias"], w["norm_f.weight"], layers


@pytest.mark.parametrize("dm,L,N,K,T", [(64, 2, 16, 4, 1000), (24, 1, 5, 3, 70), (16, 2, 8, 1, 40)],
                         ids=["default-T1000", "N5-K3", "N8-K1"])
def test_backbone_step_equals_sequence_reference(cpu_ext, dm, L, N, K, T):
    """T calls of backbone_step (states carried in place, resets per row) == one float64 sequence pass.

    The T calls run on one thread: a thousand short OpenMP regions on a shared 2-core CI runner can stall
    on every barrier when another process holds a core; the 2-thread step is covered by
    test_results_do_not_depend_on_thread_count."""
    g = torch.Generator().manual_seed(dm + N + K)
    in_dim, di = 5, 2 * dm
    w = make_weights(g, in_dim, dm, L, N, K)
    starts = starts_patterns(T, g)
    B = starts.shape[0]
    x = rn(g, B, T, in_dim)
    conv0, ssm0 = rn(g, L, B, di, K - 1), rn(g, L, B, di, N)
    cs, ss = conv0.clone(), ssm0.clone()
    a = step_args(w, L, di, K)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        feats = [cpu_ext.backbone_step(x[:, t].contiguous(), *a, cs, ss, starts[:, t].contiguous(), 1e-5, 0)
                 for t in range(T)]
    finally:
        torch.set_num_threads(prev)
    ref, rcf, rsf = seq_forward_ref(x, w, L, starts, conv0, ssm0)
    assert rel(torch.stack(feats, 1), ref) <= TOL
    assert rel(ss, rsf) <= TOL
    assert K == 1 or rel(cs, rcf) <= TOL


def test_backbone_step_matches_step_ref_without_starts(cpu_ext):
    """episode_starts=None (no resets) and the reference one-token step agree; rows_per_block is ignored."""
    from mamba_rl.ops.step import backbone_step_ref

    class Cfg:
        rms_norm_eps = 1e-5
    g = torch.Generator().manual_seed(77)
    dm, L, N, K, B, in_dim = 32, 2, 16, 4, 3, 7
    w = make_weights(g, in_dim, dm, L, N, K)
    cs, ss = rn(g, L, B, 2 * dm, K - 1), rn(g, L, B, 2 * dm, N)
    csr, ssr = cs.double(), ss.double()
    wd = {k: v.double() for k, v in w.items()}
    for t in range(4):
        x = rn(g, B, in_dim)
        out = cpu_ext.backbone_step(x, *step_args(w, L, 2 * dm, K), cs, ss, None, 1e-5, 3)
        ref = backbone_step_ref(x.double(), wd, csr, ssr, None, Cfg)
        assert rel(out, ref) <= TOL
    assert rel(ss, ssr) <= TOL and rel(cs, csr) <= TOL


# ---------------------------------------------------------------------------------------- bad inputs
def raises(match, fn, *args, **kw):
    with pytest.raises((ValueError, RuntimeError), match=match):
        fn(*args, **kw)


def test_bad_inputs_name_expected_and_received(cpu_ext):
    g = torch.Generator().manual_seed(0)
    B, T, D, N, K = 2, 5, 8, 4, 4
    c = conv_inputs(g, B, T, D, K)
    s = scan_inputs(g, B, T, D, N)
    sargs = [s[k] for k in ("x", "dt", "A_log", "Bm", "Cm", "Dp", "z", "dtb", "s0")]
    # dtype (float32 only), naming the argument, the expected and the received dtype
    with pytest.raises(ValueError, match=r"causal_conv1d: x: expected dtype float32.*got Double"):
        cpu_ext.conv_fwd(c["x"].double(), c["w"], c["b"], None, None)
    raises(r"selective_scan: dt: expected dtype float32.*got BFloat16", cpu_ext.scan_fwd, sargs[0],
           sargs[1].bfloat16(), *sargs[2:], None, False)
    raises(r"causal_conv1d: weight: expected dtype float32.*got Half", cpu_ext.conv_fwd, c["x"], c["w"].half(),
           c["b"], None, None)
    # shapes
    raises(re.escape("causal_conv1d: conv_state: expected shape [2, 8, 3], got [2, 8, 4]"), cpu_ext.conv_fwd,
           c["x"], c["w"], c["b"], torch.ones(B, D, K), None)
    raises(re.escape("selective_scan: Bm: expected shape [2, 5, 4], got [2, 5, 3]"), cpu_ext.scan_fwd,
           sargs[0], sargs[1], sargs[2], sargs[3][..., :3], *sargs[4:], None, False)
    raises(r"causal_conv1d: x: expected shape \[B, T, D\], got \[5, 8\]", cpu_ext.conv_fwd, c["x"][0], c["w"],
           c["b"], None, None)
    raises(r"episode_starts: expected dtype bool, got Float", cpu_ext.conv_fwd, c["x"], c["w"], c["b"], None,
           torch.zeros(B, T))
    raises(re.escape("episode_starts: expected shape [2, 5], got [2, 4]"), cpu_ext.scan_fwd, *sargs,
           torch.zeros(B, T - 1, dtype=torch.bool), False)
    # strides: the last dim must be unit-stride
    raises(r"selective_scan: z: expected last-dim stride 1", cpu_ext.scan_fwd, *sargs[:6],
           torch.ones(B, D, T).transpose(1, 2), *sargs[7:], None, False)
    # device
    raises(r"causal_conv1d: bias: expected a CPU tensor, got device meta", cpu_ext.conv_fwd, c["x"], c["w"],
           torch.empty(D, device="meta"), None, None)
    # backward-only arguments
    y, fin, ck = cpu_ext.scan_fwd(*sargs, None, True)
    dy = torch.ones(B, T, D)
    raises(r"checkpoints: expected the ckpt of scan_fwd\(\.\.\., need_ckpt=True\), got None", cpu_ext.scan_bwd,
           *sargs, None, None, dy, None, False)
    raises(r"acc: expected \[dA_log_acc, dD_acc, ddt_bias_acc\], got 2 tensors", cpu_ext.scan_bwd, *sargs, None,
           ck, dy, None, False, None, [torch.zeros(D, N), torch.zeros(D)])
    raises(r"give both dw_acc and db_acc or neither", cpu_ext.conv_bwd, c["x"], c["w"], c["b"], None, None,
           dy, None, False, None, torch.zeros(D, K))
    raises(re.escape("rms_norm: out_dtype: expected float32 (the CPU kernels are float32 only), got BFloat16"),
           cpu_ext.rmsnorm_fwd, torch.ones(3, 4), torch.ones(4), 1e-5, torch.bfloat16)
    # backbone_step
    w = make_weights(g, 3, 8, 1, N, K)
    inp_w, inp_b, nf, layers = step_args(w, 1, 16, K)
    cs, ss = torch.ones(1, B, 16, K - 1), torch.ones(1, B, 16, N)
    raises(re.escape("backbone_step: ssm_state: expected shape [1, 2, 16, 4], got [1, 3, 16, 4]"),
           cpu_ext.backbone_step, torch.ones(B, 3), inp_w, inp_b, nf, layers, cs, torch.ones(1, 3, 16, N), None,
           1e-5, 0)
    raises(r"backbone_step: layer 0: expected 10 tensors, got 9", cpu_ext.backbone_step, torch.ones(B, 3), inp_w,
           inp_b, nf, [layers[0][:9]], cs, ss, None, 1e-5, 0)
    raises(r"backbone_step: in_proj.weight: expected dtype float32.*got Double", cpu_ext.backbone_step,
           torch.ones(B, 3), inp_w, inp_b, nf, [[t.double() if i == 1 else t for i, t in enumerate(layers[0])]],
           cs, ss, None, 1e-5, 0)


def test_missing_compiler_error_names_cause_and_fix(monkeypatch):
    """Without a C++ compiler the loader's error (which the caller's fallback warning shows) says what is
    missing and how to install it."""
    from mamba_rl.ops.extension import check_cpu_toolchain
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler found.*g\+\+.*build-essential"):
        check_cpu_toolchain()
