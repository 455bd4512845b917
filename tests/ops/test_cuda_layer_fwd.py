"""layer_fwd (csrc/layer.cu: one Mamba layer's forward in one launch) on fresh random inputs: every output against
float64 computed from the kernel's own rounded intermediates (stage by stage, so bf16 / f16 rounding of one stage
does not hide an error in the next), the conv, checkpoints and final states bit for bit against conv_fwd and
scan_fwd on the same inputs; tiles of 32 steps crossed with resets anywhere, T < d_conv - 1, d_conv 2-4, initial
states or none, normed rows given or computed; bad input raises; the whole fused node with it on vs off."""
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

DM, DI, N = 128, 256, 16


@pytest.fixture(scope="module")
def ext():
    from mamba_rl.ops.extension import extension, extension_error
    e = extension("cuda")
    assert e is not None, f"extension failed to load: {extension_error('cuda')!r}"
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("layer_fwd needs thread-block clusters (compute capability >= 9.0)")
    e.set_poison(True)
    yield e
    e.set_poison(False)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _inputs(B, T, K, R, dtype, init, gen):
    cuda = dict(device="cuda")
    f = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(**cuda)  # noqa: E731
    E = R + 2 * N
    starts = torch.rand(B, T, generator=gen) < 0.15
    starts[0, 0] = True
    if B > 1:
        starts[1, T - 1] = True
        starts[1, T // 2] = True
    return dict(
        h=f(B * T, DM), norm_w=1 + 0.1 * f(DM), w_in=f(2 * DI, DM, scale=DM ** -0.5).to(dtype),
        conv_w=f(DI, K, scale=K ** -0.5), conv_b=0.1 * f(DI),
        conv_init=f(B, DI, K - 1) if init else None, starts=starts.cuda(),
        w_x=f(E, DI, scale=DI ** -0.5).to(dtype), w_dt=f(DI, R, scale=R ** -0.5).to(dtype),
        A_log=torch.log(torch.rand(DI, N, generator=gen) * 15 + 1).cuda(), D=f(DI), dt_bias=f(DI) - 2,
        ssm_init=f(B, DI, N) if init else None, w_out=f(DM, DI, scale=DI ** -0.5).to(dtype))


def _run(ext, a, B, T, u=None, rstd=None):
    K = a["conv_w"].shape[1]
    conv_final = torch.full((B, DI, K - 1), float("nan"), device="cuda")
    ssm_final = torch.full((B, DI, N), float("nan"), device="cuda")
    out = ext.layer_fwd(a["h"], B, T, u, rstd, a["norm_w"], 1e-5, a["w_in"], a["conv_w"], a["conv_b"],
                        a["conv_init"], a["starts"], conv_final, a["w_x"], a["w_dt"], a["A_log"], a["D"],
                        a["dt_bias"], a["ssm_init"], ssm_final, a["w_out"])
    return out, conv_final, ssm_final


@pytest.mark.parametrize("B,T", [(16, 64), (3, 37), (2, 1), (1, 100), (5, 33), (4, 2)])
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("init", [True, False])
def test_layer_fwd_every_output_against_float64_and_the_separate_kernels(ext, B, T, K, dtype, init):
    from mamba_rl.ops.conv import causal_conv1d_ref
    from mamba_rl.ops.norm import rms_norm_ref
    from mamba_rl.ops.scan import selective_scan_ref
    from mamba_rl.ops.small_gemm import xdt_fwd_ref
    R = 8 if K != 3 else 5  # dt_rank not a multiple of 4 too
    gen = torch.Generator().manual_seed(B * 1000 + T * 10 + K)
    a = _inputs(B, T, K, R, dtype, init, gen)
    (h_out, u, rstd, xz, xc, dbc, dt, y, ckpt), conv_final, ssm_final = _run(ext, a, B, T)
    for t in (h_out, u, rstd, xz, xc, dbc, dt, y, ckpt, conv_final, ssm_final):
        assert torch.isfinite(t).all()  # every element written (outputs are allocated as NaN)
    tol = 3e-6 if dtype == torch.float32 else 8e-3
    h64 = a["h"].double()
    assert rel(u, rms_norm_ref(h64, a["norm_w"].double())) <= tol
    assert rel(rstd, torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5)) <= 3e-6
    assert rel(xz, u.double() @ a["w_in"].double().t()) <= tol
    xi, z = xz.view(B, T, 2 * DI)[..., :DI], xz.view(B, T, 2 * DI)[..., DI:]
    # the conv: conv_fwd's taps and order on the same input, so its bits; and float64
    xc0, fin0 = ext.conv_fwd(xi, a["conv_w"], a["conv_b"], a["conv_init"], a["starts"])
    assert torch.equal(xc, xc0) and torch.equal(conv_final, fin0)
    xc_r, fin_r = causal_conv1d_ref(xi.double(), a["conv_w"].double(), a["conv_b"].double(),
                                    None if a["conv_init"] is None else a["conv_init"].double(), a["starts"])
    assert rel(xc, xc_r) <= tol and rel(conv_final, fin_r) <= 3e-6
    dbc_r, dt_r = xdt_fwd_ref(xc.view(B * T, DI), a["w_x"], a["w_dt"])
    assert rel(dbc, dbc_r) <= tol
    dt_r2 = (dbc[:, :R].double() @ a["w_dt"].double().t())  # from the kernel's rounded dbc
    assert rel(dt, dt_r2) <= tol
    Bm, Cm = dbc.view(B, T, -1)[..., R:R + N], dbc.view(B, T, -1)[..., R + N:]
    # the scan: scan_fwd's step on the same inputs (one time segment), so the states' bits; y's sum over the
    # states runs in another order
    ext.scan_set_segments(1)
    try:
        y0, sf0, ck0 = ext.scan_fwd(xc, dt.view(B, T, DI), a["A_log"], Bm, Cm, a["D"], z, a["dt_bias"],
                                    a["ssm_init"], a["starts"], True)
    finally:
        ext.scan_set_segments(0)
    assert torch.equal(ckpt, ck0) and torch.equal(ssm_final, sf0)
    assert rel(y, y0) <= (1e-6 if dtype == torch.float32 else 8e-3)
    y_r, sf_r = selective_scan_ref(xc.double(), dt.view(B, T, DI).double(), a["A_log"].double(), Bm.double(),
                                   Cm.double(), a["D"].double(), z.double(), a["dt_bias"].double(),
                                   None if a["ssm_init"] is None else a["ssm_init"].double(), a["starts"])
    assert rel(y, y_r) <= (2e-5 if dtype == torch.float32 else 1e-2) and rel(ssm_final, sf_r) <= 2e-5
    assert rel(h_out, h64 + y.view(B * T, DI).double() @ a["w_out"].double().t()) <= 3e-6
    # bit-reproducible, and the given normed rows (input_rmsnorm_fwd's) give the same layer
    again, cf2, sf2 = _run(ext, a, B, T, u=u, rstd=rstd)
    assert all(torch.equal(p, q) for p, q in zip(again, (h_out, u, rstd, xz, xc, dbc, dt, y, ckpt)))
    assert torch.equal(cf2, conv_final) and torch.equal(sf2, ssm_final)


def test_layer_fwd_bad_input_raises(ext):
    gen = torch.Generator().manual_seed(0)
    a = _inputs(2, 5, 4, 8, torch.float32, True, gen)
    with pytest.raises(ValueError, match="d_model 128"):
        _run(ext, dict(a, h=torch.randn(10, 64, device="cuda"), norm_w=torch.ones(64, device="cuda")), 2, 5)
    with pytest.raises(ValueError, match="d_state 16"):
        _run(ext, dict(a, A_log=torch.zeros(DI, 8, device="cuda")), 2, 5)
    with pytest.raises(ValueError, match="dtype"):
        _run(ext, dict(a, w_x=a["w_x"].bfloat16()), 2, 5)
    with pytest.raises(ValueError, match="B\\*T"):
        _run(ext, a, 2, 6)
    with pytest.raises(ValueError, match="conv_init"):
        _run(ext, dict(a, conv_init=torch.zeros(2, DI, 2, device="cuda")), 2, 5)
    with pytest.raises(ValueError, match="episode_starts"):
        _run(ext, dict(a, starts=torch.zeros(2, 5, device="cuda")), 2, 5)
    assert "d_conv" in ext.layer_fwd_supported(128, 256, 16, 8, 5)
    assert ext.layer_fwd_supported(128, 256, 16, 8, 4) is None


@pytest.mark.parametrize("dtype,tol", [("f32", 3e-6), ("bf16", 2e-2)])
def test_fused_node_layer_fwd_on_vs_off(dtype, tol):
    """The fused node (2 layers, random resets) with every layer's forward in one launch equals the separate
    kernels' forward (other summation orders), features, final states, every gradient and dL/dx; both paths
    are compared with float64 in tests/train."""
    from .test_cuda_small_gemm import _fused_node_outputs
    on = _fused_node_outputs(dtype, {"LAYER_FWD": "on"})
    off = _fused_node_outputs(dtype, {"LAYER_FWD": "off"})
    for p, q in zip(on, off):
        assert torch.isfinite(p).all() and rel(p, q) <= tol
