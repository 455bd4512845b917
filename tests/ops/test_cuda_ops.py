"""CUDA kernels vs the float64 references: conv1d and selective scan, forward and backward.

Fresh random inputs and reset patterns per case; outputs and workspaces are poisoned with NaN before each
call, so an element the kernel forgot to write fails the check. f32 rel err <= 1e-4, bf16 <= 2e-2.
"""
import re

import pytest
import torch

from tests.helpers import check_dbc_out

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

TS = [1, 3, 63, 64, 65, 1000, 2049]
BS = [1, 7, 64]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def rel(a, b):
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite (unwritten?) elements"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def starts_pattern(B, T, g, p=0.05):
    s = torch.rand(B, T, generator=g, device="cuda") < p
    if B > 1:
        s[1, 0] = True
    if B > 2 and T > 2:
        s[2, T // 2] = True
    return s


def dims(T):
    return 40 if T >= 1000 else 80  # non-multiples of the block widths: partial tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("B", BS)
@pytest.mark.parametrize("T", TS)
def test_conv1d(ext, T, B, dtype):
    from mamba_rl.ops import causal_conv1d
    from mamba_rl.ops import conv as convmod
    g = torch.Generator(device="cuda").manual_seed(1000 * T + B)
    D, K = dims(T), 4
    big = torch.randn(B, T, 2 * D, device="cuda", generator=g).to(dtype)
    x = big[..., :D]  # non-contiguous view, like the in_proj split
    w = torch.randn(D, K, device="cuda", generator=g) * 0.5
    b = torch.randn(D, device="cuda", generator=g) * 0.2
    st = torch.randn(B, D, K - 1, device="cuda", generator=g)
    starts = starts_pattern(B, T, g)
    dout = torch.randn(B, T, D, device="cuda", generator=g).to(dtype)
    dfin = torch.randn(B, D, K - 1, device="cuda", generator=g)

    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b, st)]
    out, fin = causal_conv1d(*leaves, starts)
    assert out.dtype == dtype and fin.dtype == torch.float32
    grads = torch.autograd.grad([out, fin], leaves, [dout, dfin])

    rleaves = [t.detach().double().requires_grad_(True) for t in (x, w, b, st)]
    rout, rfin = convmod.causal_conv1d_ref(*rleaves, starts)
    rgrads = torch.autograd.grad([rout, rfin], rleaves, [dout.double(), dfin.double()])
    tol = TOL[dtype]
    assert rel(out, rout) <= tol
    assert rel(fin, rfin) <= tol
    for name, a, r in zip(["dx", "dweight", "dbias", "dstate"], grads, rgrads):
        assert rel(a, r) <= tol, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("B", BS)
@pytest.mark.parametrize("T", TS)
def test_selective_scan(ext, T, B, dtype):
    from mamba_rl.ops import scan as scanmod
    from mamba_rl.ops import selective_scan
    g = torch.Generator(device="cuda").manual_seed(7 + 1000 * T + B)
    D, N, R = dims(T), 16, 8
    xz = torch.randn(B, T, 2 * D, device="cuda", generator=g).to(dtype)
    x, z = xz[..., :D], xz[..., D:]
    dbc = torch.randn(B, T, R + 2 * N, device="cuda", generator=g).to(dtype)
    Bm, Cm = dbc[..., R:R + N], dbc[..., R + N:]
    dt = (torch.randn(B, T, D, device="cuda", generator=g) * 0.5 - 1.0).to(dtype)
    A_log = torch.log(torch.arange(1, N + 1, device="cuda", dtype=torch.float32)).repeat(D, 1) \
        + 0.1 * torch.randn(D, N, device="cuda", generator=g)
    Dp = torch.randn(D, device="cuda", generator=g)
    dtb = torch.randn(D, device="cuda", generator=g) * 0.5 - 2.0
    s0 = torch.randn(B, D, N, device="cuda", generator=g)
    starts = starts_pattern(B, T, g)
    dy = torch.randn(B, T, D, device="cuda", generator=g).to(dtype)
    dfin = torch.randn(B, D, N, device="cuda", generator=g)

    ins = (x, dt, A_log, Bm, Cm, Dp, z, dtb, s0)
    leaves = [t.detach().clone().requires_grad_(True) for t in ins]
    y, fin = selective_scan(*leaves, starts)
    assert y.dtype == dtype and fin.dtype == torch.float32
    grads = torch.autograd.grad([y, fin], leaves, [dy, dfin])

    rleaves = [t.detach().double().requires_grad_(True) for t in ins]
    ry, rfin = scanmod.selective_scan_ref(*rleaves, starts)
    rgrads = torch.autograd.grad([ry, rfin], rleaves, [dy.double(), dfin.double()])
    tol = TOL[dtype]
    assert rel(y, ry) <= tol
    assert rel(fin, rfin) <= tol
    names = ["dx", "ddt", "dA_log", "dB", "dC", "dD", "dz", "ddt_bias", "dstate"]
    for name, a, r in zip(names, grads, rgrads):
        assert rel(a, r) <= tol, name


def test_scan_default_width_no_state(ext):
    """d_inner 256 (full tiles), no initial state, no resets, y-only loss; eager twice is bit-identical."""
    from mamba_rl.ops import scan as scanmod
    from mamba_rl.ops import selective_scan
    g = torch.Generator(device="cuda").manual_seed(3)
    B, T, D, N = 16, 64, 256, 16
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g)
    ins = [mk(B, T, D), mk(B, T, D) * 0.5 - 1, torch.log(torch.arange(1, N + 1, device="cuda").float()).repeat(D, 1),
           mk(B, T, N), mk(B, T, N), torch.ones(D, device="cuda"), mk(B, T, D), mk(D) * 0.5 - 2]
    dy = mk(B, T, D)
    outs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_(True) for t in ins]
        y, _ = selective_scan(*leaves)
        outs.append([y] + list(torch.autograd.grad(y, leaves, dy)))
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)
    rleaves = [t.double().requires_grad_(True) for t in ins]
    ry, _ = scanmod.selective_scan_ref(*rleaves)
    rg = torch.autograd.grad(ry, rleaves, dy.double())
    assert rel(outs[0][0], ry) <= 1e-4
    for a, r in zip(outs[0][1:], rg):
        assert rel(a, r) <= 1e-4


def test_graph_capture_conv_scan(ext):
    """fwd+bwd of conv and scan captured in a CUDA graph; replay == eager, bit for bit."""
    from mamba_rl.ops import causal_conv1d, selective_scan
    g = torch.Generator(device="cuda").manual_seed(5)
    B, T, D, N = 8, 50, 64, 16
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g)
    xi, z, dt, Bm, Cm = mk(B, T, D), mk(B, T, D), mk(B, T, D) - 1, mk(B, T, N), mk(B, T, N)
    w, cb = mk(D, 4).requires_grad_(), mk(D).requires_grad_()
    A_log = torch.zeros(D, N, device="cuda").requires_grad_()
    Dp, dtb = mk(D).requires_grad_(), mk(D).requires_grad_()
    starts = starts_pattern(B, T, g)
    dy = mk(B, T, D)

    def step():
        xc, _ = causal_conv1d(xi, w, cb, None, starts)
        y, _ = selective_scan(xc, dt, A_log, Bm, Cm, Dp, z, dtb, None, starts)
        return torch.autograd.grad(y, [w, cb, A_log, Dp, dtb], dy)

    eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        static = step()
    gr.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, static):
        assert torch.equal(a, b)


@pytest.mark.parametrize("odt", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
# 20011 x 128 and 9001 x 512 need more row groups than the backward's grid has warps (at most 2 blocks of 8 warps
# an SM), so each warp walks several groups and the block partials cover many rows each
@pytest.mark.parametrize("rows,C", [(1, 128), (7, 128), (1000, 128), (4099, 128), (33, 256), (5, 40), (20011, 128),
                                    (9001, 512)])
def test_rms_norm(ext, rows, C, odt):
    from mamba_rl.ops import rms_norm
    from mamba_rl.ops.norm import rms_norm_ref
    g = torch.Generator(device="cuda").manual_seed(rows * 7 + C)
    x = torch.randn(rows, C, device="cuda", generator=g) * 3
    w = 1 + 0.2 * torch.randn(C, device="cuda", generator=g)
    dy = torch.randn(rows, C, device="cuda", generator=g).to(odt)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rms_norm(xl, wl, 1e-5, odt)
    assert y.dtype == odt
    dx, dw = torch.autograd.grad(y, [xl, wl], dy)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    yr = rms_norm_ref(xr, wr, 1e-5)
    dxr, dwr = torch.autograd.grad(yr, [xr, wr], dy.double())
    tol = TOL[odt]
    assert rel(y, yr) <= tol and rel(dx, dxr) <= tol and rel(dw, dwr) <= tol
    # the fused-backbone entry points: rstd out, dw accumulated, residual grad added
    u, rstd = ext.rmsnorm_fwd(x, w, 1e-5, odt)
    assert torch.equal(u, y.detach()) and rstd.shape == (rows, 1)
    acc = torch.randn(C, device="cuda")
    acc0 = acc.clone()
    dh_acc = torch.randn(rows, C, device="cuda")
    dh = ext.rmsnorm_bwd(dy, x, rstd, w, acc, dh_acc)
    assert rel(dh, dxr + dh_acc.double()) <= tol
    assert rel(acc - acc0, dwr) <= max(tol, 1e-5)
    dh2 = ext.rmsnorm_bwd(dy, x, rstd, w, acc0, dh_acc)  # repeatable: the counter reset itself
    assert torch.equal(dh, dh2) and torch.equal(acc, acc0)


@pytest.mark.parametrize("rows,C", [(1024, 128), (65536, 128), (9001, 512)])
def test_rms_norm_bwd_last_block_sum_is_the_same_over_many_launches(ext, rows, C):
    """The backward's dw is each block's partial summed by the block that arrives last at the counter
    (last_block_arrive): a partial it read before another block's store was visible would change dw. 200
    launches back to back, half adding into a random dw (read before the counter's atomic), half into zeros:
    every dw of a half the same bits, and the random ones acc0 + the others."""
    g = torch.Generator(device="cuda").manual_seed(rows + C)
    x = torch.randn(rows, C, device="cuda", generator=g) * 2
    w = 1 + 0.2 * torch.randn(C, device="cuda", generator=g)
    dy = torch.randn(rows, C, device="cuda", generator=g)
    _, rstd = ext.rmsnorm_fwd(x, w, 1e-5, torch.float32)
    acc0 = torch.randn(C, device="cuda", generator=g)
    added = torch.stack([acc0.clone() for _ in range(100)])
    zero = torch.zeros(100, C, device="cuda")
    for i in range(100):
        ext.rmsnorm_bwd(dy, x, rstd, w, added[i], None)
        ext.rmsnorm_bwd(dy, x, rstd, w, zero[i], None)
    torch.cuda.synchronize()
    assert torch.equal(added, added[:1].expand_as(added)), "dw (added) differs between launches"
    assert torch.equal(zero, zero[:1].expand_as(zero)), "dw (from zero) differs between launches"
    assert torch.equal(added[0], acc0 + zero[0])


@pytest.mark.parametrize("rows,C", [(1, 128), (1000, 128), (1024, 128), (20011, 128), (33, 256), (9001, 512),
                                    (5, 40)])
def test_rms_norm_bwd_dw_partials_sum_to_dw(ext, rows, C):
    """rmsnorm_bwd / rmsnorm_fwd_bwd with dw_partials (the grouped weight-gradient launch sums them, fused.NORM_DW):
    dx (and the forward's out / rstd) the same bits as with dw_acc / dw_out, and the [norm_bwd_blocks(rows, C), C]
    partials sum (float64) to the kernel's dw; exactly one of dw_acc / dw_partials, of the right shape, else a
    ValueError."""
    g = torch.Generator(device="cuda").manual_seed(rows * 3 + C)
    x = torch.randn(rows, C, device="cuda", generator=g) * 2
    w = 1 + 0.2 * torch.randn(C, device="cuda", generator=g)
    dy = torch.randn(rows, C, device="cuda", generator=g).to(torch.bfloat16)
    dh_acc = torch.randn(rows, C, device="cuda", generator=g)
    _, rstd = ext.rmsnorm_fwd(x, w, 1e-5, torch.float32)
    nb = ext.norm_bwd_blocks(rows, C)
    dw = torch.zeros(C, device="cuda")
    dxc, dxc_p = (torch.empty(rows, C, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dx = ext.rmsnorm_bwd(dy, x, rstd, w, dw, dh_acc, dxc)
    part = torch.full((nb, C), float("nan"), device="cuda")
    dx_p = ext.rmsnorm_bwd(dy, x, rstd, w, None, dh_acc, dxc_p, dw_partials=part)
    assert torch.equal(dx_p, dx) and torch.equal(dxc_p, dxc)
    tol = 1e-6 * (part.double().abs().sum(0) + 1e-30)
    assert ((part.double().sum(0) - dw.double()).abs() <= tol).all()
    dwo = torch.empty(C, device="cuda")
    out, rs, dx2 = ext.rmsnorm_fwd_bwd(x, w, 1e-5, dy, dwo)
    part.fill_(float("nan"))
    out_p, rs_p, dx2_p = ext.rmsnorm_fwd_bwd(x, w, 1e-5, dy, None, dw_partials=part)
    assert torch.equal(out_p, out) and torch.equal(rs_p, rs) and torch.equal(dx2_p, dx2)
    assert ((part.double().sum(0) - dwo.double()).abs() <= 1e-6 * (part.double().abs().sum(0) + 1e-30)).all()
    with pytest.raises(ValueError, match="exactly one of dw_acc"):
        ext.rmsnorm_bwd(dy, x, rstd, w, dw, dh_acc, dw_partials=part)
    with pytest.raises(ValueError, match="exactly one of dw_acc"):
        ext.rmsnorm_bwd(dy, x, rstd, w, None, dh_acc)
    with pytest.raises(ValueError, match="norm_bwd_blocks"):
        ext.rmsnorm_bwd(dy, x, rstd, w, None, dh_acc, dw_partials=torch.zeros(nb + 1, C, device="cuda"))


def test_bwd_out_and_accumulate_args(ext):
    """conv_bwd(dx_out=, dw_acc=, db_acc=) and scan_bwd(dz_out=, acc=) write strided views / add in place."""
    g = torch.Generator(device="cuda").manual_seed(42)
    B, T, D, N, K = 3, 37, 80, 16, 4
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g)
    starts = starts_pattern(B, T, g)
    x, w, cb, dout = mk(B, T, D), mk(D, K), mk(D), mk(B, T, D)
    dx, dw, db, _ = ext.conv_bwd(x, w, cb, None, starts, dout, None, False)
    buf = torch.full((B, T, 2 * D), float("nan"), device="cuda")
    wa, ba = mk(D, K), mk(D)
    wa0, ba0 = wa.clone(), ba.clone()
    r = ext.conv_bwd(x, w, cb, None, starts, dout, None, False, dx_out=buf[..., :D], dw_acc=wa, db_acc=ba)
    assert torch.equal(buf[..., :D], dx) and torch.isnan(buf[..., D:]).all()
    assert r[1] is wa and torch.allclose(wa, wa0 + dw, atol=1e-6) and torch.allclose(ba, ba0 + db, atol=1e-6)
    xs, dt, z, Bm, Cm = mk(B, T, D), mk(B, T, D) - 1, mk(B, T, D), mk(B, T, N), mk(B, T, N)
    A_log, Dp, dtb = torch.zeros(D, N, device="cuda"), mk(D), mk(D)
    _, _, ckpt = ext.scan_fwd(xs, dt, A_log, Bm, Cm, Dp, z, dtb, None, starts, True)
    ref = ext.scan_bwd(xs, dt, A_log, Bm, Cm, Dp, z, dtb, None, starts, ckpt, dout, None, False)
    acc = [mk(D, N), mk(D), mk(D)]
    acc0 = [a.clone() for a in acc]
    buf.fill_(float("nan"))
    out = ext.scan_bwd(xs, dt, A_log, Bm, Cm, Dp, z, dtb, None, starts, ckpt, dout, None, False,
                       dz_out=buf[..., D:], acc=acc)
    assert torch.equal(buf[..., D:], ref[6]) and torch.isnan(buf[..., :D]).all()
    for a, a0, k in zip(acc, acc0, (2, 5, 7)):
        assert torch.allclose(a, a0 + ref[k], atol=1e-5)
    for k in (0, 1, 3, 4):
        assert torch.equal(out[k], ref[k])


@pytest.mark.parametrize("B,T,D,K", [(3, 37, 80, 4), (16, 64, 256, 4), (2, 5, 300, 3), (1, 1, 40, 2),
                                     (4, 48, 130, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_bwd_partials_sum_to_the_weight_gradient(ext, B, T, D, K, dtype):
    """conv_bwd(partials=True) (the grouped weight-gradient launch sums them, fused.CONV_DW): dx and dinit the same
    bits as the summing call, and the partials [B * ceil(T / 16), D * K] / [.., D] sum (float64) to its dweight
    (flattened, [D][K] order) and dbias; with resets, an initial window and dfinal, chunks cut by T and channels
    past a block. partials=True with dw_acc is a ValueError."""
    g = torch.Generator(device="cuda").manual_seed(B * T + D + K)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g)
    starts = starts_pattern(B, T, g, p=0.1)
    x, w, cb, dout = mk(B, T, D).to(dtype), mk(D, K), mk(D), mk(B, T, D).to(dtype)
    init, dfinal = mk(B, D, K - 1), mk(B, D, K - 1)
    dx, dw, db, dinit = ext.conv_bwd(x, w, cb, init, starts, dout, dfinal, True)
    dxp, dwp, dbp, dinitp = ext.conv_bwd(x, w, cb, init, starts, dout, dfinal, True, partials=True)
    rows = B * -(-T // 16)
    assert dwp.shape == (rows, D * K) and dbp.shape == (rows, D) and dwp.dtype == dbp.dtype == torch.float32
    assert torch.equal(dxp, dx) and torch.equal(dinitp, dinit)
    for part, full in ((dwp, dw.reshape(-1)), (dbp, db)):
        s = part.double().sum(0)
        assert ((s - full.double()).abs() <= 1e-6 * (part.double().abs().sum(0) + 1e-30)).all()
    with pytest.raises(ValueError, match="partials"):
        ext.conv_bwd(x, w, cb, init, starts, dout, dfinal, True, dw_acc=mk(D, K), db_acc=mk(D), partials=True)


def test_fwd_final_out_args(ext):
    """conv_fwd(final_out=) and scan_fwd(final_out=) write the final state into the given slice of a stacked
    state (what the fused backbone does instead of a torch.stack), the same bits as without it; scan_fwd's
    final_out may not be its initial state."""
    g = torch.Generator(device="cuda").manual_seed(43)
    B, T, D, N, K = 3, 37, 80, 16, 4
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g)
    nan = float("nan")
    starts = starts_pattern(B, T, g)
    x, w, cb, st = mk(B, T, D), mk(D, K), mk(D), mk(B, D, K - 1)
    out, fin = ext.conv_fwd(x, w, cb, st, starts)
    stack = torch.full((2, B, D, K - 1), nan, device="cuda")
    out2, fin2 = ext.conv_fwd(x, w, cb, st, starts, final_out=stack[1])
    assert torch.equal(out2, out) and torch.equal(stack[1], fin) and torch.isnan(stack[0]).all()
    assert fin2.data_ptr() == stack[1].data_ptr()
    xs, dt, z, Bm, Cm, s0 = mk(B, T, D), mk(B, T, D) - 1, mk(B, T, D), mk(B, T, N), mk(B, T, N), mk(B, D, N)
    A_log, Dp, dtb = torch.zeros(D, N, device="cuda"), mk(D), mk(D)
    args = (xs, dt, A_log, Bm, Cm, Dp, z, dtb, s0, starts, True)
    try:
        for seg in (1, 3, 0):  # the final state comes from the last segment's blocks
            ext.scan_set_segments(seg)
            y, sf, ck = ext.scan_fwd(*args)
            sstack = torch.full((2, B, D, N), nan, device="cuda")
            y2, sf2, ck2 = ext.scan_fwd(*args, final_out=sstack[0])
            assert torch.equal(y2, y) and torch.equal(ck2, ck) and torch.equal(sstack[0], sf), seg
            assert torch.isnan(sstack[1]).all() and sf2.data_ptr() == sstack[0].data_ptr()
    finally:
        ext.scan_set_segments(0)
    with pytest.raises(ValueError, match="initial state"):
        ext.scan_fwd(*args, final_out=s0)
    with pytest.raises(ValueError, match="final_out"):
        ext.scan_fwd(*args, final_out=torch.empty(B, D, N + 1, device="cuda"))


# ---- the two-level split of the scan over T (segments of whole chunks, see csrc/scan_common.cuh) ----

def _scan_case(B, T, D, N, dtype, seed):
    """Random scan inputs with resets on chunk edges (row 0: every multiple of the chunk, row 1: one step
    before and after each edge), random resets elsewhere, an initial state and a final-state gradient."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    R = 8
    xz = torch.randn(B, T, 2 * D, device="cuda", generator=g).to(dtype)
    dbc = torch.randn(B, T, R + 2 * N, device="cuda", generator=g).to(dtype)
    ins = (xz[..., :D], (torch.randn(B, T, D, device="cuda", generator=g) * 0.5 - 1.0).to(dtype),
           torch.log(torch.arange(1, N + 1, device="cuda", dtype=torch.float32)).repeat(D, 1)
           + 0.1 * torch.randn(D, N, device="cuda", generator=g),
           dbc[..., R:R + N], dbc[..., R + N:], torch.randn(D, device="cuda", generator=g), xz[..., D:],
           torch.randn(D, device="cuda", generator=g) * 0.5 - 2.0, torch.randn(B, D, N, device="cuda", generator=g))
    starts = starts_pattern(B, T, g, p=0.03)
    t = torch.arange(T, device="cuda")
    starts[0] |= t % 16 == 0
    if B > 1:
        starts[1] |= (t % 16 == 15) | (t % 16 == 1)
    dy = torch.randn(B, T, D, device="cuda", generator=g).to(dtype)
    dfin = torch.randn(B, D, N, device="cuda", generator=g)
    return ins, starts, dy, dfin


def _scan_run(ins, starts, dy, dfin):
    from mamba_rl.ops import selective_scan
    leaves = [t.detach().clone().requires_grad_(True) for t in ins]
    y, fin = selective_scan(*leaves, starts)
    return [y, fin] + list(torch.autograd.grad([y, fin], leaves, [dy, dfin]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T,N", [(1, 16), (15, 16), (16, 16), (17, 16), (33, 16), (48, 16), (100, 16),
                                 (257, 16), (1025, 16), (2049, 16), (47, 8), (300, 8)])
def test_scan_time_segments(ext, T, N, dtype):
    """Every segment count (forced: 1, 2, 3, 7, one chunk per segment; and the automatic choice) gives the
    float64 reference's y, final state and all nine gradients, with resets on chunk and segment edges; in f32
    the split changes results only by rounding (<= 1e-5 relative to the one-segment result)."""
    from mamba_rl.ops import scan as scanmod
    B, D = 3, 48  # 48 channels: a full and a partial channel tile
    ins, starts, dy, dfin = _scan_case(B, T, D, N, dtype, seed=11 + T + N)
    rleaves = [t.detach().double().requires_grad_(True) for t in ins]
    ry, rfin = scanmod.selective_scan_ref(*rleaves, starts)
    ref = [ry, rfin] + list(torch.autograd.grad([ry, rfin], rleaves, [dy.double(), dfin.double()]))
    names = ["y", "final_state", "dx", "ddt", "dA_log", "dB", "dC", "dD", "dz", "ddt_bias", "dstate"]
    nC = -(-T // ext.scan_chunk())
    tol = TOL[dtype]
    one = None
    try:
        for forced in (1, 2, 3, 7, nC, 0):
            ext.scan_set_segments(forced)
            if forced:
                for bwd in (False, True):
                    got = ext.scan_segments(B, T, D, N, bwd)
                    assert 1 <= got <= min(forced, nC) and (forced > nC or got == -(-nC // -(-nC // forced)))
            out = _scan_run(ins, starts, dy, dfin)
            for name, a, r in zip(names, out, ref):
                assert rel(a, r) <= tol, (forced, name, rel(a, r))
            if forced == 1:
                one = out
            elif dtype == torch.float32:
                for name, a, o in zip(names, out, one):
                    assert rel(a, o) <= 1e-5, (forced, name, rel(a, o))
    finally:
        ext.scan_set_segments(0)


def test_scan_segments_auto_split_fills_the_gpu(ext):
    """The automatic split uses several segments when B * D is small and one when the grid is already full."""
    D, N = 256, 16
    assert ext.scan_segments(4, 4096, D, N, False) > 1 and ext.scan_segments(4, 4096, D, N, True) > 1
    assert ext.scan_segments(16, 2048, D, N, True) > 1
    assert ext.scan_segments(256, 4096, D, N, False) == 1 and ext.scan_segments(256, 4096, D, N, True) == 1
    assert ext.scan_segments(4, 16, D, N, True) == 1  # one chunk: nothing to split


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_scan_segment_reset_clears_non_finite_state(ext, bad):
    """A reset inside a segment, or exactly on a segment's first step, clears a non-finite initial state
    through the segment combine, as in the sequential scan: outputs and per-step gradients after the reset
    match the float64 reference."""
    from mamba_rl.ops import scan as scanmod
    B, T, D, N = 2, 64, 40, 16
    ins, _, dy, dfin = _scan_case(B, T, D, N, torch.float32, seed=99)
    ins = list(ins)
    s0 = ins[8].clone()
    s0[:, :3] = float(bad)
    ins[8] = s0
    starts = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    starts[0, 20] = True  # inside segment 1 of 4
    starts[1, 32] = True  # the first step of segment 2
    rleaves = [t.detach().double().requires_grad_(True) for t in ins]
    ry, rfin = scanmod.selective_scan_ref(*rleaves, starts)
    rg = torch.autograd.grad([ry, rfin], rleaves[:2], [dy.double(), dfin.double()])
    try:
        ext.scan_set_segments(4)
        assert ext.scan_segments(B, T, D, N, False) == 4 and ext.scan_segments(B, T, D, N, True) == 4
        from mamba_rl.ops import selective_scan
        leaves = [t.detach().clone().requires_grad_(True) for t in ins]
        y, fin = selective_scan(*leaves, starts)
        gx, gdt = torch.autograd.grad([y, fin], leaves[:2], [dy, dfin])
    finally:
        ext.scan_set_segments(0)
    for row, t0 in ((0, 20), (1, 32)):
        assert rel(y[row, t0:], ry[row, t0:]) <= 1e-4
        assert rel(fin[row], rfin[row]) <= 1e-4
        assert rel(gx[row, t0:], rg[0][row, t0:]) <= 1e-4
        assert rel(gdt[row, t0 + 1:], rg[1][row, t0 + 1:]) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_scan_bwd_wide_build_gives_the_same_bits(ext, dtype):
    """Where one segment's grid overfills 3 blocks per SM (B * channel tiles > 3 * SMs, d_state 16) the
    backward runs its 4-blocks-per-SM build (csrc/scan_common.cuh, SCAN_BWD_MINB_WIDE): the float64
    reference's results, and per-row results bit-equal to the 3-block build's, which runs the same rows
    as two halves (each half's grid fits 3 blocks per SM)."""
    from mamba_rl.ops import scan as scanmod
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    D, N, T = 256, 16, 40
    tiles = D // 32  # channels per block at d_state 16: 128 threads / 4 lanes per channel
    half = 3 * sms // tiles // 2 + 1
    B = 2 * half
    assert B * tiles > 3 * sms and half * tiles <= 3 * sms
    ins, starts, dy, dfin = _scan_case(B, T, D, N, dtype, seed=5)
    batched = [True, True, False, True, True, False, True, False, True]  # x dt A_log B C D z dt_bias state0
    per_row = ["y", "final_state", "dx", "ddt", None, "dB", "dC", None, "dz", None, "dstate"]
    try:
        ext.scan_set_segments(1)  # one segment for the whole batch and for each half
        whole = _scan_run(ins, starts, dy, dfin)
        halves = []
        for sl in (slice(0, half), slice(half, B)):
            part = [t[sl] if b else t for t, b in zip(ins, batched)]
            halves.append(_scan_run(part, starts[sl], dy[sl], dfin[sl]))
    finally:
        ext.scan_set_segments(0)
    for i, name in enumerate(per_row):
        if name is not None:
            assert torch.equal(whole[i], torch.cat([halves[0][i], halves[1][i]])), name
    rleaves = [t.detach().double().requires_grad_(True) for t in ins]
    ry, rfin = scanmod.selective_scan_ref(*rleaves, starts)
    ref = [ry, rfin] + list(torch.autograd.grad([ry, rfin], rleaves, [dy.double(), dfin.double()]))
    for i, (a, r) in enumerate(zip(whole, ref)):
        assert rel(a, r) <= TOL[dtype], i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_scan_bwd_automatic_build_takes_the_pair_build_for_long_segments(ext, dtype):
    """Where one segment's grid overfills 3 blocks per SM at d_state 16, the automatic backward takes the pair
    build (8 states a thread) for segments of >= 8 chunks and the 4-block build for shorter ones; where the 3-block
    grid is split over T and its reductions are too large for its cooperative launch (more than 4 dB / dC sums a
    thread), the 4-block build with its own split (csrc/scan.cu, measured in benchmarks/NOTES.md): bit for bit what
    forcing that build gives, cooperative launch or not, and the float64 reference's values."""
    from mamba_rl.ops import scan as scanmod
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    D, N = 256, 16
    full = 3 * sms // (D // 32) + 1  # 4-state channel tiles of 32: the grid overfills 3 blocks per SM
    cases = [(full, 128, 2), (full, 40, 4)]
    for B, T in ((16, 64), (16, 500), (4, 1100)):  # the 3-block grid split over T
        try:
            ext.scan_set_bwd_blocks(3)
            nseg3 = ext.scan_segments(B, T, D, N, True)
        finally:
            ext.scan_set_bwd_blocks(0)
        assert nseg3 > 1, (B, T)
        cases.append((B, T, 4 if B * T * 2 * N > 4 * (D // 32) * B * nseg3 * 128 else 3))
    assert {c[2] for c in cases[2:]} == {3, 4}, cases  # both sides of the rule (132 SMs: 3, 4, 3)
    for B, T, build in cases:
        try:  # the automatic build's split is the forced build's (the 3- and 4-block builds differ only there)
            ext.scan_set_bwd_blocks(build)
            nseg = ext.scan_segments(B, T, D, N, True)
        finally:
            ext.scan_set_bwd_blocks(0)
        assert ext.scan_segments(B, T, D, N, True) == nseg, (B, T, build, nseg)
        ins, starts, dy, dfin = _scan_case(B, T, D, N, dtype, seed=T)
        runs = {}
        try:
            for forced in (0, build):
                for coop in (7, 0):
                    ext.scan_set_bwd_blocks(forced)
                    ext.set_coop(coop)
                    runs[forced, coop] = _scan_run(ins, starts, dy, dfin)
        finally:
            ext.scan_set_bwd_blocks(0)
            ext.set_coop(7)
        for key, out in runs.items():
            for i, (a, b) in enumerate(zip(out, runs[0, 7])):
                assert torch.equal(a, b), (B, T, key, i)
        rleaves = [t.detach().double().requires_grad_(True) for t in ins]
        ry, rfin = scanmod.selective_scan_ref(*rleaves, starts)
        ref = [ry, rfin] + list(torch.autograd.grad([ry, rfin], rleaves, [dy.double(), dfin.double()]))
        for i, (a, r) in enumerate(zip(runs[0, 7], ref)):
            assert rel(a, r) <= TOL[dtype], (B, T, i, rel(a, r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("B,T,D,N,forced", [(3, 100, 48, 16, 0), (3, 100, 48, 16, 3), (3, 100, 48, 16, 7),
                                            (16, 64, 256, 16, 0), (2, 33, 40, 16, 1), (3, 300, 48, 8, 0),
                                            (3, 300, 48, 8, 5), (4, 2049, 40, 16, 0), (3, 2049, 48, 16, 129)])
def test_scan_cooperative_launch_gives_the_same_bits(ext, B, T, D, N, forced, dtype):
    """Each scan direction as one cooperative launch (local pass, grid barrier, main pass, grid barrier, the
    backward's reductions; csrc/scan_common.cuh) gives bit for bit the separate launches' y, final state and
    all nine gradients, at split and unsplit shapes (the last case's 387-block grid of 129 one-chunk segments
    may exceed the co-resident limit, where both runs take the separate launches), and the float64 reference's
    values."""
    from mamba_rl.ops import scan as scanmod
    ins, starts, dy, dfin = _scan_case(B, T, D, N, dtype, seed=B * 1000 + T + N + forced)
    try:
        ext.scan_set_segments(forced)
        ext.set_coop(0)
        sep = _scan_run(ins, starts, dy, dfin)
        ext.set_coop(7)
        coop = _scan_run(ins, starts, dy, dfin)
    finally:
        ext.set_coop(7)
        ext.scan_set_segments(0)
    names = ["y", "final_state", "dx", "ddt", "dA_log", "dB", "dC", "dD", "dz", "ddt_bias", "dstate"]
    for name, a, b in zip(names, coop, sep):
        assert torch.equal(a, b), name
    rleaves = [t.detach().double().requires_grad_(True) for t in ins]
    ry, rfin = scanmod.selective_scan_ref(*rleaves, starts)
    ref = [ry, rfin] + list(torch.autograd.grad([ry, rfin], rleaves, [dy.double(), dfin.double()]))
    for name, a, r in zip(names, coop, ref):
        assert rel(a, r) <= TOL[dtype], (name, rel(a, r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("B,T,D,K", [(16, 64, 256, 4), (3, 100, 80, 4), (7, 65, 80, 3), (2, 1, 40, 2),
                                     (32, 256, 80, 4), (64, 128, 256, 4), (64, 2049, 40, 4)])
def test_conv_bwd_cooperative_launch_gives_the_same_bits(ext, B, T, D, K, dtype):
    """The conv backward and its weight-gradient sums as one cooperative launch (grid barrier between them;
    csrc/conv.cuh) give bit for bit the two launches' dx, dweight, dbias and dstate, and the float64
    reference's values; the large grids (64 x 128 at 256 channels, 64 x 2049) may exceed the co-resident
    limit, where both runs take the two launches. 32 x 256 at 80 channels is 512 (row, chunk) partials in 512
    blocks: the long columns' 32 row groups (common.cuh colsum_rg) in both the cooperative sums and
    colsum_kernel."""
    from mamba_rl.ops import causal_conv1d
    from mamba_rl.ops import conv as convmod
    g = torch.Generator(device="cuda").manual_seed(B * 10000 + T + K)
    big = torch.randn(B, T, 2 * D, device="cuda", generator=g).to(dtype)
    ins = (big[..., :D], torch.randn(D, K, device="cuda", generator=g) * 0.5,
           torch.randn(D, device="cuda", generator=g) * 0.2, torch.randn(B, D, K - 1, device="cuda", generator=g))
    starts = starts_pattern(B, T, g)
    dout = torch.randn(B, T, D, device="cuda", generator=g).to(dtype)
    dfin = torch.randn(B, D, K - 1, device="cuda", generator=g)

    def run():
        leaves = [t.detach().clone().requires_grad_(True) for t in ins]
        out, fin = causal_conv1d(*leaves, starts)
        return torch.autograd.grad([out, fin], leaves, [dout, dfin])

    try:
        ext.set_coop(0)
        sep = run()
        ext.set_coop(7)
        coop = run()
    finally:
        ext.set_coop(7)
    names = ["dx", "dweight", "dbias", "dstate"]
    for name, a, b in zip(names, coop, sep):
        assert torch.equal(a, b), name
    rleaves = [t.detach().double().requires_grad_(True) for t in ins]
    rout, rfin = convmod.causal_conv1d_ref(*rleaves, starts)
    rgrads = torch.autograd.grad([rout, rfin], rleaves, [dout.double(), dfin.double()])
    for name, a, r in zip(names, coop, rgrads):
        assert rel(a, r) <= TOL[dtype], (name, rel(a, r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("B,T,N", [(16, 64, 16), (3, 257, 16), (5, 100, 8)])
def test_scan_bwd_builds_match_the_reference(ext, B, T, N, dtype):
    """Every backward build (3 blocks per SM; at d_state 16 also the 4-block one and the 2-block pair build with 8
    states a thread, each with the split sized for it: ext.scan_set_bwd_blocks) gives the float64 reference's
    values, and the same bits as one cooperative launch or as separate launches (at 16 x 64 the forced builds
    split T, so the cooperative launch includes the local pass; d_state 8 takes the 3-block build whatever is
    forced)."""
    from mamba_rl.ops import scan as scanmod
    D = 256 if B == 16 else 48
    ins, starts, dy, dfin = _scan_case(B, T, D, N, dtype, seed=7 * B + T + N)
    rleaves = [t.detach().double().requires_grad_(True) for t in ins]
    ry, rfin = scanmod.selective_scan_ref(*rleaves, starts)
    ref = [ry, rfin] + list(torch.autograd.grad([ry, rfin], rleaves, [dy.double(), dfin.double()]))
    try:
        for blocks in (2, 3, 4):
            outs = []
            for coop in (0, 7):
                ext.scan_set_bwd_blocks(blocks)
                ext.set_coop(coop)
                outs.append(_scan_run(ins, starts, dy, dfin))
                for i, (a, r) in enumerate(zip(outs[-1], ref)):
                    assert rel(a, r) <= TOL[dtype], (blocks, coop, i, rel(a, r))
            for i, (a, b) in enumerate(zip(*outs)):  # one cooperative launch or the separate ones: the same bits
                assert torch.equal(a, b), (blocks, i)
    finally:
        ext.scan_set_bwd_blocks(0)
        ext.set_coop(7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("B,T,N", [(3, 37, 16), (5, 100, 8), (16, 64, 16)])
def test_scan_bwd_dbc_out_gives_the_same_bits(ext, B, T, N, dtype):
    """scan_bwd(dbc_out=) writes dB / dC straight into the last 2N columns of a [B*T, R + 2N] buffer (the fused
    backward's dL/d[dt_low, B, C]; exact width, and a column block of a wider one: row stride > R + 2N) with the
    bits of the plain call, through the cooperative launch's reductions and the separate reduction kernel alike,
    and returns them as [B, T, N] views of it; every other element keeps its contents (NaN, random), the other
    outputs are unchanged. The call of fused.py too: dz_out, acc and dbc_out together."""
    D, R = (256 if B == 16 else 48), 8
    E = R + 2 * N
    ins, starts, dy, dfin = _scan_case(B, T, D, N, dtype, seed=31 * B + T + N)
    g = torch.Generator(device="cuda").manual_seed(5 * B + T)
    x, dt, A_log, Bm, Cm, Dp, z, dtb, _ = ins
    try:
        for coop in (0, 7):
            ext.set_coop(coop)
            _, _, ckpt = ext.scan_fwd(*ins, starts, True)
            ref = ext.scan_bwd(*ins, starts, ckpt, dy, dfin, True)
            wide = torch.randn(B * T, E + 6, device="cuda", generator=g).to(dtype)
            for full, c0 in ((torch.full((B * T, E), float("nan"), device="cuda", dtype=dtype), 0), (wide, 2)):
                out = check_dbc_out(lambda buf: ext.scan_bwd(*ins, starts, ckpt, dy, dfin, True, dbc_out=buf),
                                    ref, full, c0, R, N, coop)
                assert out[3].shape == (B, T, N) and out[4].shape == (B, T, N)
            # fused.py's call: no initial state, dz into half of a dxz buffer, acc added into, dbc_out
            _, _, ckpt = ext.scan_fwd(x, dt, A_log, Bm, Cm, Dp, z, dtb, None, starts, True)
            plain = ext.scan_bwd(x, dt, A_log, Bm, Cm, Dp, z, dtb, None, starts, ckpt, dy, None, False)
            dxz = torch.empty(B, T, 2 * D, device="cuda", dtype=dtype)
            acc = [torch.zeros(D, N, device="cuda"), torch.zeros(D, device="cuda"), torch.zeros(D, device="cuda")]
            ddbc = torch.empty(B * T, E, device="cuda", dtype=dtype)
            out = ext.scan_bwd(x, dt, A_log, Bm, Cm, Dp, z, dtb, None, starts, ckpt, dy, None, False, dxz[..., D:],
                               acc, dbc_out=ddbc)
            assert torch.equal(ddbc[:, R:R + N], plain[3].view(B * T, N))
            assert torch.equal(ddbc[:, R + N:], plain[4].view(B * T, N))
            assert torch.equal(out[0], plain[0]) and torch.equal(out[1], plain[1])
            assert torch.equal(dxz[..., D:], plain[6])
    finally:
        ext.set_coop(7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("d_model", [16, 48, 64, 128, 200, 256, 512])  # dt_rank 1, 3, 4, 8, 13, 16, 32
def test_dt_proj_gemm_into_ddbc_columns_keeps_its_bits(dtype, d_model):
    """The fused backward without the x_proj kernel (B*T > 2048 rows) has torch.mm write ddt @ dt_proj.weight into
    the first dt_rank columns of ddbc [B*T, dt_rank + 2N] (out=, a row stride of dt_rank + 2N) instead of
    concatenating a fresh product: cuBLAS takes the strided output as is (the other columns untouched, no copy
    back), with the bits of the fresh product from dt_rank 2 up, so the fused gradients keep theirs there. At
    dt_rank 1 (d_model <= 16) cuBLAS takes another kernel for a one-column strided output (H100, torch 2.11 +
    CUDA 13.0: f32 and f16 differ in the last bits, bf16 not), so there the values agree to rounding."""
    g = torch.Generator(device="cuda").manual_seed(d_model)
    di, r = 2 * d_model, -(-d_model // 16)
    for rows, n in ((2049, 16), (4096, 16), (64 * 1024, 16), (4096, 8)):
        ddt = torch.randn(rows, di, device="cuda", generator=g).to(dtype)
        wdt = torch.randn(di, r, device="cuda", generator=g).to(dtype)
        ddbc = torch.full((rows, r + 2 * n), float("nan"), device="cuda", dtype=dtype)
        out = torch.mm(ddt, wdt, out=ddbc[:, :r])
        assert out.data_ptr() == ddbc.data_ptr() and out.stride() == (r + 2 * n, 1)
        fresh = torch.mm(ddt, wdt)
        if r > 1:
            assert torch.equal(ddbc[:, :r], fresh), (rows, n)
        else:
            tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]  # ~2 ulp of the dtype
            scale = float(fresh.abs().max())  # another summation order: errors scale with the largest sums
            torch.testing.assert_close(ddbc[:, :r], fresh, rtol=tol, atol=tol * scale,
                                       msg=lambda m: f"{(rows, n)}: {m}")
        assert torch.isnan(ddbc[:, r:]).all()


def test_scan_bwd_dbc_out_rejects_bad_buffers(ext):
    """A dbc_out of the wrong shape, strides, dtype or device is a ValueError naming the expected and the received
    value (csrc/binding_common.h's dbc_out_views; the CPU binding raises the same), raised before anything runs."""
    B, T, D, N, R = 2, 19, 48, 16, 8
    E = R + 2 * N
    ins, starts, dy, dfin = _scan_case(B, T, D, N, torch.float32, seed=3)
    _, _, ckpt = ext.scan_fwd(*ins, starts, True)
    bad = {
        re.escape("selective_scan: dbc_out: expected shape [38, dt_rank + 32], got [38, 31]"):
            torch.zeros(B * T, 31, device="cuda"),
        re.escape("selective_scan: dbc_out: expected shape [38, dt_rank + 32], got [37, 40]"):
            torch.zeros(B * T - 1, E, device="cuda"),
        re.escape("selective_scan: dbc_out: expected shape [38, dt_rank + 32], got [2, 19, 40]"):
            torch.zeros(B, T, E, device="cuda"),
        re.escape("selective_scan: dbc_out: expected strides [>= 40, 1], got [1, 38]"):
            torch.zeros(E, B * T, device="cuda").t(),
        re.escape("selective_scan: dbc_out: expected strides [>= 40, 1], got [8, 1]"):  # overlapping rows
            torch.zeros(8 * B * T + E, device="cuda").as_strided((B * T, E), (8, 1)),
        re.escape("selective_scan: dbc_out: expected dtype Float (same as x), got BFloat16"):
            torch.zeros(B * T, E, device="cuda", dtype=torch.bfloat16),
        re.escape("selective_scan: dbc_out: expected a CUDA tensor, got device cpu"): torch.zeros(B * T, E),
    }
    for match, t in bad.items():
        with pytest.raises(ValueError, match=match):
            ext.scan_bwd(*ins, starts, ckpt, dy, dfin, True, dbc_out=t)


def test_tuning_knobs_reject_bad_values(ext):
    """set_coop takes a mask in 0..7 and scan_set_bwd_blocks 0, 2, 3 or 4; anything else is a ValueError naming what
    was expected and what came."""
    with pytest.raises(ValueError, match=r"set_coop: expected a mask in 0\.\.7.*got 8"):
        ext.set_coop(8)
    with pytest.raises(ValueError, match=r"set_coop: expected.*got -1"):
        ext.set_coop(-1)
    with pytest.raises(ValueError, match=r"scan_set_bwd_blocks: expected 0 \(automatic\), 2, 3 or 4, got 5"):
        ext.scan_set_bwd_blocks(5)
