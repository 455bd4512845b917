"""The small-GEMM kernels of the fused step (csrc/wgrad.cu, csrc/xdt.cu) vs their float64 references, on fresh
random inputs: grouped weight gradients (split and unsplit tiles, strided operands, column sums, several jobs
in one launch, accumulation into a non-zero destination, bit-reproducible, under graph capture), x_proj +
dt_proj forward and backward (odd row counts, d_inner not a multiple of 32, dt_rank not a multiple of 8);
AdamW's in-kernel gradient zeroing; the fused node with the kernels on vs off."""
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.fixture(scope="module")
def ext():
    from mamba_rl.ops.extension import extension, extension_error
    e = extension("cuda")
    assert e is not None, f"extension failed to load: {extension_error('cuda')!r}"
    e.set_poison(True)
    yield e
    e.set_poison(False)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _jobs(K, shapes, dtype, gen):
    """[(a [K, M], b [K, N] or None, c [M, N] float32 non-zero)] on CUDA."""
    jobs = []
    for M, N in shapes:
        a = torch.randn(K, M, generator=gen).to("cuda", dtype)
        b = None if N is None else torch.randn(K, N, generator=gen).to("cuda", dtype)
        c = torch.randn(M, 1 if N is None else N, generator=gen).cuda()
        jobs.append((a, b, c.view(M) if N is None else c))
    return jobs


# the default model's weight-gradient shapes (out_proj, dt_proj, x_proj, in_proj, input_proj, its bias), odd ones
# (element loads), and widths that are multiples of 8 but not of the 64-wide tile (tensor cores, partial tiles)
SHAPES = [(128, 256), (256, 8), (40, 256), (512, 128), (128, 32), (128, None), (1, 1), (65, 3), (7, 130), (72, 136),
          (8, 8)]


@pytest.mark.parametrize("K", [1, 7, 1024, 5000])
@pytest.mark.parametrize("dtype,tensor_cores", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False),
                                                (torch.float16, True), (torch.float16, False)])
def test_wgrad_grouped_vs_ref(ext, K, dtype, tensor_cores):
    """Every path of the kernel (bf16 / f16 jobs with aligned rows on tensor cores or, tensor_cores=False, on FFMA;
    float32 on FFMA; column sums) within float32 rounding of the float64 reference."""
    from mamba_rl.ops.small_gemm import wgrad_grouped_ref
    tol = 2e-6
    gen = torch.Generator().manual_seed(K)
    jobs = _jobs(K, SHAPES, dtype, gen)
    ref = [(a, b, c.clone()) for a, b, c in jobs]
    ext.wgrad_grouped(jobs, tensor_cores=tensor_cores)
    wgrad_grouped_ref(ref)
    for (a, b, c), (_, _, cr) in zip(jobs, ref):
        assert torch.isfinite(c).all()
        # float32 accumulation over K terms: elementwise within tol * (|a|^T |b| + |c|), the scale of the
        # rounding errors (a relative norm alone fails on a single output that nearly cancels)
        scale = (a.double().abs().t() @ (torch.ones_like(a[:, :1]) if b is None else b).double().abs())
        scale = scale.reshape(c.shape) + cr.double().abs()
        assert ((c.double() - cr.double()).abs() <= tol * scale).all(), (a.shape, None if b is None else b.shape)
        if c.numel() >= 64:
            assert rel(c, cr) <= tol, (a.shape, None if b is None else b.shape)


def test_wgrad_strided_operands_and_mixed_dtypes(ext):
    from mamba_rl.ops.small_gemm import wgrad_grouped, wgrad_grouped_ref
    gen = torch.Generator().manual_seed(5)
    K = 777
    dbc = torch.randn(K, 40, generator=gen).cuda()  # dt_proj's B operand is dbc[:, :8] (row stride 40)
    ddt = torch.randn(K, 256, generator=gen).to("cuda", torch.bfloat16)
    big = torch.randn(300, 20, generator=gen).cuda()
    dst = big[10:266, 4:12]  # a strided destination view
    dh = torch.randn(K, 128, generator=gen).cuda()
    bias = torch.randn(128, generator=gen).cuda()
    jobs = [(ddt, dbc[:, :8], dst), (dh, None, bias)]  # a bf16, b float32: per-operand dtypes
    ref = [(ddt, dbc[:, :8], dst.clone()), (dh, None, bias.clone())]
    big_before = big.clone()
    wgrad_grouped(ext, jobs)
    wgrad_grouped_ref(ref)
    assert rel(dst, ref[0][2]) <= 2e-6 and rel(bias, ref[1][2]) <= 2e-6
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[10:266, 4:12] = False
    assert torch.equal(big[outside], big_before[outside])  # nothing written outside the view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tensor_cores", [True, False])
def test_wgrad_load_paths(ext, dtype, tensor_cores):
    """Operands read with 16-byte loads (aligned base, row stride and width) next to ones that must be read element
    by element (a base off by one element, an odd row stride, a width not a multiple of 4 / 8), every forced
    K-slice length and the plan's: all within float32 rounding of the float64 reference."""
    from mamba_rl.ops.small_gemm import wgrad_grouped_ref
    gen = torch.Generator().manual_seed(11)
    K = 301
    big = torch.randn(K, 304, generator=gen).to("cuda", dtype)
    cases = [(big[:, :64], big[:, 64:192]),         # aligned: 16-byte loads (bf16 / f16: tensor cores)
             (big[:, 1:65], big[:, 200:264]),       # base off by one element: element loads for a
             (big[:, 8:20], big[:, 24:40]),         # width 12: 16-byte loads for f32 only
             (big[:, 16:24], big[:, 200:272]),      # widths 8 and 72: partial tiles (bf16 / f16: tensor cores)
             (big[::2, :36][:150], big[1::2, 40:45][:150]),  # row stride 608, width 5
             (big[:, 100:103], None)]
    for sl in (0, 16, 48, 64, 1024):
        jobs, ref = [], []
        for a, b in cases:
            c = torch.randn(a.shape[1], 1 if b is None else b.shape[1], generator=gen).cuda()
            c = c.view(-1) if b is None else c
            jobs.append((a, b, c))
            ref.append((a, b, c.clone()))
        ext.wgrad_grouped([(a, b, c) for a, b, c in jobs], slice=sl, tensor_cores=tensor_cores)
        wgrad_grouped_ref(ref)
        for (a, b, c), (_, _, cr) in zip(jobs, ref):
            scale = a.double().abs().t() @ (torch.ones_like(a[:, :1]) if b is None else b).double().abs()
            scale = scale.reshape(c.shape) + cr.double().abs()
            assert ((c.double() - cr.double()).abs() <= 2e-6 * scale).all(), (sl, a.shape, a.stride())
    with pytest.raises(ValueError, match="slice"):
        ext.wgrad_grouped([(big[:, :4], None, torch.zeros(4, device="cuda"))], slice=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wgrad_deterministic_and_capturable(ext, dtype):
    from mamba_rl.ops.small_gemm import wgrad_grouped
    gen = torch.Generator().manual_seed(9)
    jobs = _jobs(20000, SHAPES[:6], dtype, gen)
    c0 = [c.clone() for _, _, c in jobs]
    outs = []
    for _ in range(3):
        for (_, _, c), c00 in zip(jobs, c0):
            c.copy_(c00)
        wgrad_grouped(ext, jobs)
        outs.append([c.clone() for _, _, c in jobs])
    assert all(torch.equal(x, y) for o in outs[1:] for x, y in zip(o, outs[0]))
    g = torch.cuda.CUDAGraph()
    for (_, _, c), c00 in zip(jobs, c0):
        c.copy_(c00)
    with torch.cuda.graph(g):
        wgrad_grouped(ext, jobs)
    for _ in range(2):
        for (_, _, c), c00 in zip(jobs, c0):
            c.copy_(c00)
        g.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(c, x) for (_, _, c), x in zip(jobs, outs[0]))


def test_wgrad_bad_input_raises(ext):
    a = torch.randn(8, 4, device="cuda")
    with pytest.raises(ValueError, match="expected shape"):
        ext.wgrad_grouped([(a, torch.randn(8, 3, device="cuda"), torch.zeros(4, 2, device="cuda"))])
    with pytest.raises(ValueError, match="rows"):
        ext.wgrad_grouped([(a, torch.randn(9, 3, device="cuda"), torch.zeros(4, 3, device="cuda"))])
    with pytest.raises(ValueError, match="float32"):
        ext.wgrad_grouped([(a, None, torch.zeros(4, device="cuda", dtype=torch.float64))])


@pytest.mark.parametrize("rows,D,R,N", [(1024, 256, 8, 16), (37, 96, 6, 8), (5, 33, 3, 16), (1, 256, 16, 16)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_xdt_vs_ref(ext, rows, D, R, N, dtype, tol):
    from mamba_rl.ops.small_gemm import xdt_bwd, xdt_bwd_ref, xdt_fwd, xdt_fwd_ref
    gen = torch.Generator().manual_seed(rows + D)
    E = R + 2 * N
    mk = lambda *s: torch.randn(*s, generator=gen).to("cuda", dtype)  # noqa: E731
    xc, wx, wdt = mk(rows, D), mk(E, D) / D ** 0.5, mk(D, R) / R ** 0.5
    dbc, dt = xdt_fwd(ext, xc, wx, wdt)
    dbc_r, dt_r = xdt_fwd_ref(xc, wx, wdt)
    assert dbc.dtype == dtype and dt.dtype == dtype
    assert rel(dbc, dbc_r) <= tol and rel(dt, dt_r) <= tol
    ddt, dB, dC, dxc = mk(rows, D), mk(rows, N), mk(rows, N), mk(rows, D)
    ddbc_r, dxc_r = xdt_bwd_ref(ddt, dB, dC, wx, wdt, dxc)
    ddbc = xdt_bwd(ext, ddt, dB, dC, wx, wdt, dxc)  # dxc in place
    assert torch.equal(ddbc[:, R:R + N], dB) and torch.equal(ddbc[:, R + N:], dC)
    assert rel(ddbc, ddbc_r) <= tol and rel(dxc, dxc_r) <= tol


def test_xdt_bad_input_raises(ext):
    xc = torch.randn(4, 32, device="cuda")
    with pytest.raises(ValueError, match="x_proj.weight"):
        ext.xdt_fwd(xc, torch.randn(10, 31, device="cuda"), torch.randn(32, 2, device="cuda"))
    with pytest.raises(ValueError, match="dtype"):
        ext.xdt_fwd(xc, torch.randn(10, 32, device="cuda", dtype=torch.bfloat16), torch.randn(32, 2, device="cuda"))


@pytest.mark.parametrize("skip", [False, True])
def test_adamw_zero_grad(ext, skip):
    from mamba_rl.ops import optim as O
    g = torch.Generator(device="cuda").manual_seed(3)
    P = 10_000
    hyper = O.make_hyper(1e-3, (0.9, 0.999), 1e-8, 0.01, None, True, "cuda")
    grad = torch.randn(P, device="cuda", generator=g)
    if skip:
        grad[17] = float("inf")
    p, m, v = (torch.randn(P, device="cuda", generator=g) for _ in range(3))
    v = v.abs()
    sc = torch.zeros(8, dtype=torch.float64, device="cuda")
    O.grad_stats(grad, None, torch.ones(1, device="cuda"), hyper, sc)
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    O.adamw_step(p2, grad.clone(), m2, v2, hyper, sc, 5000)
    O.adamw_step(p, grad, m, v, hyper, sc, 5000, zero_grad=True)
    assert torch.equal(p, p2) and torch.equal(m, m2) and torch.equal(v, v2)
    assert torch.count_nonzero(grad) == 0


def _fused_node_outputs(dtype, flags):
    """(features, final conv, final ssm, gradient arena, dL/dx) of a 2-layer fused node (d_model 128, 4 x 50, random
    resets) on fixed random inputs, with ``model.fused``'s switches in ``flags`` set for the call (restored after)."""
    from mamba_rl import MambaBackbone, MambaConfig
    from mamba_rl.model import fused
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 50, 32, generator=gen).cuda()
    gout = torch.randn(4, 50, 128, generator=gen).cuda()
    starts = (torch.rand(4, 50, generator=gen) < 0.1).cuda()
    old = {k: getattr(fused, k) for k in flags}
    for k, v in flags.items():
        setattr(fused, k, v)
    try:
        net = MambaBackbone(MambaConfig(d_model=128, n_layers=2), 32, device="cuda", seed=1, backend="cuda")
        net.set_compute_dtype({"f32": torch.float32, "bf16": torch.bfloat16}[dtype])
        xr = x.clone().requires_grad_()
        y, st = net(xr, None, starts)
        (y * gout).sum().backward()
        return y.detach(), st.conv.detach(), st.ssm.detach(), net.grad_arena.clone(), xr.grad
    finally:
        for k, v in old.items():
            setattr(fused, k, v)


@pytest.mark.parametrize("dtype,tol", [("f32", 2e-6), ("bf16", 2e-2)])
def test_fused_node_kernels_on_vs_off(dtype, tol):
    """The whole fused backward with the small-GEMM kernels forced on equals the torch-GEMM path (the same math,
    other summation orders / roundings); both paths are also compared with float64 in tests/train."""
    on = _fused_node_outputs(dtype, {"WGRAD": "on", "XDT": "on"})
    off = _fused_node_outputs(dtype, {"WGRAD": "off", "XDT": "off"})
    for a, b in zip(on, off):
        assert torch.isfinite(a).all() and rel(a, b) <= tol


@pytest.mark.parametrize("flag,kernel", [("CONV_DW", "conv"), ("NORM_DW", "norm")])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_fused_node_weight_gradient_partials_grouped_vs_in_the_kernel(dtype, flag, kernel):
    """The conv's and the norms' weight gradients summed in the grouped launch (fused.CONV_DW / NORM_DW "grouped":
    the kernels' partials as column-sum jobs) against each kernel's own sums: the same partials summed in another
    order, so float32 rounding apart in the gradient arena, and every other output the same bits."""
    grouped = _fused_node_outputs(dtype, {"WGRAD": "on", flag: "grouped"})
    own = _fused_node_outputs(dtype, {"WGRAD": "on", flag: kernel})
    for i, (a, b) in enumerate(zip(grouped, own)):
        assert torch.isfinite(a).all()
        assert rel(a, b) <= 1e-6 if i == 3 else torch.equal(a, b)


def _starts_every_kind(B, T, gen):
    """episode_starts with a start at t = 0, one in the middle, one at T - 1 and random ones (rows of 8 that cross
    a start, and the last step)."""
    s = torch.rand(B, T, generator=gen) < 0.1
    s[0, 0] = True
    if B > 1:
        s[1, T // 2] = True
        s[1, T - 1] = True
    return s.cuda()


@pytest.mark.parametrize("B,T", [(16, 64), (3, 37), (5, 2), (1, 9), (2, 1)])
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("init", [True, False])
def test_conv_xdt_fwd_is_conv_then_xdt_bit_for_bit(ext, B, T, K, dtype, init):
    """conv_xdt_fwd (the conv's rows computed inside the x_proj + dt_proj kernel) gives the bits of conv_fwd then
    xdt_fwd: xc, dbc, dt and the final window, at row blocks inside one sequence and across sequences (T not a
    multiple of 8, T < d_conv - 1), with resets anywhere, a strided input (the in_proj output's left half) and
    with / without an initial window; and the float64 reference within rounding."""
    from mamba_rl.ops.conv import causal_conv1d_ref
    from mamba_rl.ops.small_gemm import xdt_fwd_ref
    gen = torch.Generator().manual_seed(B * 100 + T * 10 + K)
    D, R, N = 96, 6, 16
    E = R + 2 * N
    xz = torch.randn(B, T, 2 * D, generator=gen).to("cuda", dtype)
    x = xz[..., :D]  # strided, as the fused node passes it
    w = (torch.randn(D, K, generator=gen) / K ** 0.5).cuda()
    cb = torch.randn(D, generator=gen).cuda()
    st = torch.randn(B, D, K - 1, generator=gen).cuda() if init else None
    starts = _starts_every_kind(B, T, gen)
    wx = (torch.randn(E, D, generator=gen) / D ** 0.5).to("cuda", dtype)
    wdt = (torch.randn(D, R, generator=gen) / R ** 0.5).to("cuda", dtype)
    xc0, fin0 = ext.conv_fwd(x, w, cb, st, starts)
    dbc0, dt0 = ext.xdt_fwd(xc0.view(B * T, D), wx, wdt)
    fin_out = torch.full((B, D, K - 1), float("nan"), device="cuda")
    xc, dbc, dt, fin = ext.conv_xdt_fwd(x, w, cb, st, starts, fin_out, wx, wdt)
    assert fin.data_ptr() == fin_out.data_ptr()
    for a, b in ((xc, xc0), (dbc, dbc0), (dt, dt0), (fin, fin0)):
        assert a.dtype == b.dtype and torch.equal(a.view(b.shape), b)
    xc_r, fin_r = causal_conv1d_ref(x.double(), w.double(), cb.double(), None if st is None else st.double(), starts)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert rel(xc, xc_r) <= tol and rel(fin, fin_r) <= tol
    dbc_r, dt_r = xdt_fwd_ref(xc.view(B * T, D), wx, wdt)  # from the kernel's rounded xc
    assert rel(dbc, dbc_r) <= tol and rel(dt, dt_r) <= tol
    # without final_out: a new final window, the same bits
    xc2, _, _, fin2 = ext.conv_xdt_fwd(x, w, cb, st, starts, None, wx, wdt)
    assert torch.equal(xc2, xc) and torch.equal(fin2, fin0)


def test_conv_xdt_fwd_bad_input_raises(ext):
    x = torch.randn(2, 5, 32, device="cuda")
    w, cb = torch.randn(32, 4, device="cuda"), torch.randn(32, device="cuda")
    wx, wdt = torch.randn(10, 32, device="cuda"), torch.randn(32, 2, device="cuda")
    with pytest.raises(ValueError, match="d_conv must be 2, 3 or 4"):
        ext.conv_xdt_fwd(x, torch.randn(32, 5, device="cuda"), cb, None, None, None, wx, wdt)
    with pytest.raises(ValueError, match="x_proj.weight"):
        ext.conv_xdt_fwd(x, w, cb, None, None, None, torch.randn(10, 31, device="cuda"), wdt)
    with pytest.raises(ValueError, match="dtype"):
        ext.conv_xdt_fwd(x, w, cb, None, None, None, wx.bfloat16(), wdt)
    with pytest.raises(ValueError, match="final_out"):
        ext.conv_xdt_fwd(x, w, cb, None, None, torch.zeros(2, 32, 2, device="cuda"), wx, wdt)


@pytest.mark.parametrize("rows,C,I", [(1024, 128, 32), (7, 128, 4), (37, 96, 45), (5, 40, 1), (16, 1024, 12),
                                      (3, 256, 48), (20011, 128, 32)])
@pytest.mark.parametrize("odt", [torch.float32, torch.bfloat16])
def test_input_rmsnorm_fwd_vs_ref(ext, rows, C, I, odt):
    """input_rmsnorm_fwd: h = x @ W^T + b in float32 and RMSNorm(h) in one pass, within float32 rounding of the
    float64 reference; the norm is the bits of rmsnorm_fwd on the returned h; x_copy receives h. 16 x 1024 x 12
    stages the weights unpadded (12 x 1025 floats exceed 48 KB), the others padded, and where in_dim <= 32 and
    C <= 128 keeps them in registers (norm_fwd_inreg_kernel); 20011 rows are more than either prologue's grid
    (one wave of blocks), so its blocks walk several rows each."""
    from mamba_rl.ops.norm import rms_norm_ref
    gen = torch.Generator().manual_seed(rows + C + I)
    x = torch.randn(rows, I, generator=gen).cuda()
    wi = (torch.randn(C, I, generator=gen) / I ** 0.5).cuda()
    bi = torch.randn(C, generator=gen).cuda()
    w = (1 + 0.2 * torch.randn(C, generator=gen)).cuda()
    cp = torch.full((rows, C), float("nan"), device="cuda")
    h, u, rstd = ext.input_rmsnorm_fwd(x, wi, bi, w, 1e-5, odt, x_copy=cp)
    assert h.dtype == torch.float32 and u.dtype == odt and rstd.shape == (rows, 1)
    h_r = x.double() @ wi.double().t() + bi.double()
    assert rel(h, h_r) <= 2e-6
    assert torch.equal(cp, h)
    u2, rstd2 = ext.rmsnorm_fwd(h, w, 1e-5, odt)
    assert torch.equal(u, u2) and torch.equal(rstd, rstd2)
    assert rel(u, rms_norm_ref(h_r, w.double(), 1e-5)) <= (2e-6 if odt == torch.float32 else 1e-2)


def _bits(t):
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("I,C", [(i, c) for i in (1, 4, 17, 32) for c in (64, 96, 128)]
                         + [(33, 128), (32, 160), (33, 160)])
@pytest.mark.parametrize("rows", [7, 20011])
@pytest.mark.parametrize("odt", [torch.float32, torch.bfloat16])
def test_input_rmsnorm_weights_in_registers_give_the_staged_bits(ext, rows, C, I, odt):
    """Where in_dim <= 32 and d_model <= 128 the input projection's weights live in registers (csrc/norm.cu
    norm_fwd_inreg_kernel; the in_dim bucket's inputs past in_dim are -0 x +0 FMAs): h, the norm, rstd and x_copy
    are bit for bit (signed zeros included) those of the shared-memory path (ext.norm_set_inreg(False)), and within
    float32 rounding of the float64 reference. Row 0, column 0 sums underflowing products to -0 plus a -0 bias, so h
    there is -0 only if the padding FMAs keep a -0 sum. 20011 rows are more than one wave of blocks. 33 inputs or
    160 channels (just outside) take the shared-memory path either way (the kernel names, torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from mamba_rl.ops.norm import rms_norm_ref
    gen = torch.Generator().manual_seed(7 * rows + 131 * C + I)
    x = torch.randn(rows, I, generator=gen)
    wi = torch.randn(C, I, generator=gen) / I ** 0.5
    bi = torch.randn(C, generator=gen)
    w = 1 + 0.2 * torch.randn(C, generator=gen)
    x[0], wi[0], bi[0] = 1e-30, -1e-30, -0.0
    x, wi, bi, w = x.cuda(), wi.cuda(), bi.cuda(), w.cuda()
    inreg = I <= 32 and C <= 128
    outs = []
    try:
        for on in (True, False):
            ext.norm_set_inreg(on)
            cp = torch.full((rows, C), float("nan"), device="cuda")
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                res = ext.input_rmsnorm_fwd(x, wi, bi, w, 1e-5, odt, x_copy=cp)
                torch.cuda.synchronize()
            names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            norm = [n for n in names if "norm_fwd" in n]
            assert len(norm) == 1 and ("norm_fwd_inreg_kernel" in norm[0]) == (on and inreg), names
            outs.append(list(res) + [cp])
    finally:
        ext.norm_set_inreg(True)
    for name, a, b in zip(["h", "out", "rstd", "x_copy"], *outs):
        assert torch.equal(_bits(a), _bits(b)), name
    h, u, _, cp = outs[0]
    assert torch.signbit(h[0, 0]) and h[0, 0] == 0
    assert torch.equal(_bits(cp), _bits(h))
    h_r = x.double() @ wi.double().t() + bi.double()
    assert rel(h, h_r) <= 2e-6
    assert rel(u, rms_norm_ref(h_r, w.double(), 1e-5)) <= (2e-6 if odt == torch.float32 else 1e-2)


def test_input_rmsnorm_fwd_bad_input_raises(ext):
    x, w = torch.randn(4, 32, device="cuda"), torch.randn(128, device="cuda")
    wi, bi = torch.randn(128, 32, device="cuda"), torch.randn(128, device="cuda")
    with pytest.raises(ValueError, match="in_dim \\* C"):
        ext.input_rmsnorm_fwd(torch.randn(4, 100, device="cuda"), torch.randn(128, 100, device="cuda"), bi, w, 1e-5,
                              torch.float32)
    with pytest.raises(ValueError, match="in_w"):
        ext.input_rmsnorm_fwd(x, torch.randn(128, 31, device="cuda"), bi, w, 1e-5, torch.float32)
    with pytest.raises(ValueError, match="contiguous float32"):
        ext.input_rmsnorm_fwd(x.double(), wi, bi, w, 1e-5, torch.float32)
    with pytest.raises(ValueError, match="x_copy"):
        ext.input_rmsnorm_fwd(x, wi, bi, w, 1e-5, torch.float32, x_copy=torch.zeros(4, 127, device="cuda"))


FEWER = {"CONV_XDT": ("auto", "off"), "INPUT_NORM": ("auto", "off"), "OUT_PROJ_LT": (True, False),
         "FINAL_DIRECT": ("auto", "off")}


@pytest.mark.parametrize("dtype,tol", [("f32", 2e-6), ("bf16", 2e-2)])
def test_fused_node_fewer_launches_on_vs_off(dtype, tol):
    """The fused node with the conv inside the x_proj kernel, the input projection inside the first norm, the
    float32 out_proj through cuBLASLt (all on) against all off: the same features and gradients within rounding
    (f32: the same math in other summation orders; bf16: the input projection now runs in float32)."""
    on = _fused_node_outputs(dtype, {name: vals[0] for name, vals in FEWER.items()})
    off = _fused_node_outputs(dtype, {name: vals[1] for name, vals in FEWER.items()})
    for a, b in zip(on, off):
        assert torch.isfinite(a).all() and rel(a, b) <= tol


def test_final_state_into_writes_the_given_tensors_and_skips_what_does_not_fit():
    """fused.final_state_into: the next CUDA fused forward writes the final states into the given tensors and
    returns them (not differentiable, the values of a forward without it); tensors of another shape, or overlapping
    the initial state, are refused (new tensors returned, the given ones untouched); the hint is used once."""
    from mamba_rl import MambaBackbone, MambaConfig
    from mamba_rl.model import fused
    net = MambaBackbone(MambaConfig(d_model=64, n_layers=2), 8, device="cuda", seed=2, backend="cuda")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 20, 8, generator=gen).cuda()
    s0 = net.initial_state(3)
    s0.conv.normal_(generator=torch.Generator(device="cuda").manual_seed(1))
    s0.ssm.normal_(generator=torch.Generator(device="cuda").manual_seed(2))
    y0, f0 = net(x, s0)
    conv = torch.full_like(f0.conv, float("nan"))
    ssm = torch.full_like(f0.ssm, float("nan"))
    with fused.final_state_into(conv, ssm):
        y1, f1 = net(x, s0)
    assert f1.conv is conv and f1.ssm is ssm and not conv.requires_grad
    assert torch.equal(conv, f0.conv) and torch.equal(ssm, f0.ssm) and torch.equal(y1, y0)
    y1.sum().backward()  # the features still backpropagate
    y2, f2 = net(x, s0)  # the hint was used once
    assert f2.conv is not conv
    bad = torch.full((2, 3, net.cfg.d_inner, 5), float("nan"), device="cuda")
    with fused.final_state_into(bad, ssm):
        _, f3 = net(x, s0)
    assert f3.conv is not bad and torch.isnan(bad).all() and torch.equal(f3.conv, f0.conv)
    with fused.final_state_into(s0.conv, s0.ssm):  # the initial state itself: refused
        _, f4 = net(x, s0)
    assert f4.conv is not s0.conv and torch.equal(f4.ssm, f0.ssm)


@pytest.mark.parametrize("rows,C", [(1024, 128), (7, 128), (33, 256), (5, 40), (300, 512)])
@pytest.mark.parametrize("low", [None, torch.bfloat16])
def test_rmsnorm_fwd_bwd_is_fwd_then_bwd_bit_for_bit(ext, rows, C, low):
    """rmsnorm_fwd_bwd: the forward and backward of RMSNorm in one pass give the bits of rmsnorm_fwd (float32 out,
    rstd) then rmsnorm_bwd (dx, its low-precision copy, dw: assigned here, added there)."""
    gen = torch.Generator().manual_seed(rows + C)
    x = (3 * torch.randn(rows, C, generator=gen)).cuda()
    w = (1 + 0.2 * torch.randn(C, generator=gen)).cuda()
    dy = torch.randn(rows, C, generator=gen).cuda()
    out0, rstd0 = ext.rmsnorm_fwd(x, w, 1e-5, torch.float32)
    dw0 = torch.zeros(C, device="cuda")
    dxc0 = None if low is None else torch.empty(rows, C, device="cuda", dtype=low)
    dx0 = ext.rmsnorm_bwd(dy, x, rstd0, w, dw0, None, dxc0)
    dw = torch.full((C,), float("nan"), device="cuda")
    dxc = None if low is None else torch.empty(rows, C, device="cuda", dtype=low)
    out, rstd, dx = ext.rmsnorm_fwd_bwd(x, w, 1e-5, dy, dw, dxc)
    assert torch.equal(out, out0) and torch.equal(rstd, rstd0) and torch.equal(dx, dx0) and torch.equal(dw, dw0)
    if low is not None:
        assert torch.equal(dxc, dxc0)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_grad_known_gives_the_bits_of_the_plain_backward(dtype):
    """fused.grad_known: the forward runs the final norm's backward with the announced gradient; a backward with
    that tensor gives the features, x's gradient and the arena of a plain forward + backward, bit for bit; a
    backward with another gradient (or the announced one changed in place) ignores what the forward computed."""
    from mamba_rl import MambaBackbone, MambaConfig
    from mamba_rl.model import fused
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 40, 32, generator=gen).cuda()
    starts = (torch.rand(4, 40, generator=gen) < 0.1).cuda()
    g1 = torch.randn(4, 40, 128, generator=gen).cuda()
    g2 = torch.randn(4, 40, 128, generator=gen).cuda()

    def run(g_bwd, hint=None, bump=False):
        net = MambaBackbone(MambaConfig(n_layers=2), 32, device="cuda", seed=3, backend="cuda")
        net.set_compute_dtype({"f32": torch.float32, "bf16": torch.bfloat16}[dtype])
        xr = x.clone().requires_grad_()
        ctx = fused.grad_known(hint) if hint is not None else torch.enable_grad()
        with ctx:
            y, _ = net(xr, None, starts)
        if bump:
            hint.mul_(2.0).div_(2.0)  # same values, a new version: must not be trusted
        y.backward(g_bwd)
        return y.detach(), xr.grad, net.grad_arena.clone()

    plain1, plain2 = run(g1), run(g2)
    g1c = g1.clone()
    for got, want in ((run(g1, g1), plain1), (run(g2, g1), plain2), (run(g1c, g1c, bump=True), plain1)):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_the_float32_step_prints_no_blas_library_warning():
    """The float32 out_proj through cuBLASLt switches torch's preferred BLAS library inside the node; torch's
    one-per-process "experimental feature" warning about that is not shown to the caller (a fresh process, where
    it would fire)."""
    import subprocess
    import sys
    code = ("import warnings, torch\nwarnings.simplefilter('always')\n"
            "from mamba_rl import MambaBackbone, MambaConfig\n"
            "net = MambaBackbone(MambaConfig(d_model=64, n_layers=1), 4, device='cuda', backend='cuda')\n"
            "y, _ = net(torch.randn(2, 9, 4, device='cuda'))\ny.sum().backward()\ntorch.cuda.synchronize()\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
    assert "preferred_blas_library" not in r.stderr + r.stdout
