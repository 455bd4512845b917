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


@pytest.mark.parametrize("dtype,tol", [("f32", 2e-6), ("bf16", 2e-2)])
def test_fused_node_kernels_on_vs_off(dtype, tol):
    """The whole fused backward with the small-GEMM kernels forced on equals the torch-GEMM path (the same math,
    other summation orders / roundings); both paths are also compared with float64 in tests/train."""
    from mamba_rl import MambaBackbone, MambaConfig
    from mamba_rl.model import fused
    cfg = MambaConfig(d_model=128, n_layers=2)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 50, 32, generator=gen).cuda()
    gout = torch.randn(4, 50, 128, generator=gen).cuda()
    starts = (torch.rand(4, 50, generator=gen) < 0.1).cuda()
    grads = {}
    for mode in ("off", "on"):
        fused.WGRAD = fused.XDT = mode
        try:
            net = MambaBackbone(cfg, 32, device="cuda", seed=1, backend="cuda")
            net.set_compute_dtype({"f32": torch.float32, "bf16": torch.bfloat16}[dtype])
            y, _ = net(x, None, starts)
            (y * gout).sum().backward()
            grads[mode] = (y.detach(), net.grad_arena.clone())
        finally:
            fused.WGRAD = fused.XDT = "auto"
    assert rel(grads["on"][0], grads["off"][0]) <= tol
    assert rel(grads["on"][1], grads["off"][1]) <= tol
