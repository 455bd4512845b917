"""The one kernel-capability predicate (mamba_rl.ops.capability) and the fallbacks behind it, on the CPU:
limits and reasons, torch.func.functional_call with swapped parameters on the cpu backend (= the reference
backend), the whole-backbone node with its norms on torch ops (the path a d_model the CUDA norm kernels do
not take runs), and the binding's ValueError for a bad argument."""
import pytest
import torch

from mamba_rl import MambaBackbone, MambaConfig
from mamba_rl.ops.capability import Support, kernel_support
from mamba_rl.ops.extension import extension
from tests.helpers import needs_cpu_kernels as _needs_cpu_kernels
from tests.helpers import rel

needs_cpu_kernels = _needs_cpu_kernels()

CFG = MambaConfig(d_model=16, n_layers=2, d_state=8, d_conv=4, expand=2)
IN = 5


def test_support_is_a_truthy_pair():
    assert Support(True) and not Support(False, "why")
    ok, reason = kernel_support("cuda", "scan", d_state=16)
    assert ok and reason == ""


@pytest.mark.parametrize("op,kw,bad", [
    ("rms_norm_fwd", dict(d_model=1024), dict(d_model=1025)),
    ("rms_norm_bwd", dict(d_model=512), dict(d_model=640)),
    ("conv", dict(d_conv=4), dict(d_conv=5)),
    ("scan", dict(d_state=8), dict(d_state=4)),
    ("sequence", dict(d_state=16, d_conv=4), dict(d_state=32, d_conv=4)),
    ("step", dict(d_state=16, d_conv=4, n_layers=17), dict(d_state=16, d_conv=3, n_layers=3)),
])
def test_cuda_limits_name_expected_and_received(op, kw, bad):
    if op != "step":
        assert kernel_support("cuda", op, **kw).ok
    s = kernel_support("cuda", op, **bad)
    assert not s.ok and s.reason
    received = str(list(bad.values())[0] if op != "step" else 3)
    assert received in s.reason
    if op == "step":  # 17 layers: refused before any device query
        s = kernel_support("cuda", "step", **kw)
        assert not s.ok and "16" in s.reason and "17" in s.reason


def test_cpu_kernels_take_any_size_but_only_float32():
    assert kernel_support("cpu", "rms_norm_bwd", d_model=4096)
    assert kernel_support("cpu", "scan", d_state=4)
    assert kernel_support("cpu", "step", d_state=3, d_conv=2, n_layers=128)
    s = kernel_support("cpu", "sequence", d_state=16, d_conv=4, dtype=torch.bfloat16)
    assert not s.ok and "bfloat16" in s.reason
    assert not kernel_support("reference", "scan", d_state=16)
    with pytest.raises(ValueError, match="op must be one of"):
        kernel_support("cuda", "nope")
    with pytest.raises(ValueError, match="needs d_state"):
        kernel_support("cuda", "scan")


def test_backbone_reports_swapped_parameters():
    net = MambaBackbone(CFG, IN, backend="reference")
    s = net.kernel_support("sequence")
    assert not s.ok and "reference" in s.reason


@needs_cpu_kernels
@pytest.mark.parametrize("with_grad", [False, True])
def test_functional_call_on_cpu_backend_equals_reference(with_grad):
    """functional_call(net, other_params, x) computes with other_params on the kernel backend too."""
    g = torch.Generator().manual_seed(11)
    net = MambaBackbone(CFG, IN, backend="cpu", seed=0)
    ref = MambaBackbone(CFG, IN, backend="reference", seed=0, dtype=torch.float64)
    assert net.backend == "cpu" and net.kernel_support("sequence")
    other = {n: (p.detach() + 0.05 * torch.randn(p.shape, generator=g)).requires_grad_(with_grad)
             for n, p in net.named_parameters()}
    other64 = {n: p.detach().double().requires_grad_(with_grad) for n, p in other.items()}
    x = torch.randn(3, 9, IN, generator=g)
    starts = torch.rand(3, 9, generator=g) < 0.2
    y, fin = torch.func.functional_call(net, other, (x,), {"episode_starts": starts})
    yr, finr = torch.func.functional_call(ref, other64, (x.double(),), {"episode_starts": starts})
    y_arena, _ = net(x, episode_starts=starts)  # outside the call: the arena's own weights again
    assert rel(y, yr) < 1e-5 and rel(fin.ssm, finr.ssm) < 1e-5 and rel(fin.conv, finr.conv) < 1e-5
    assert rel(y_arena, yr) > 1e-3  # the swapped weights really differ from the arena's
    assert net.kernel_support("sequence")  # restored after the call
    if with_grad:
        w = torch.randn(y.shape, generator=g)
        gs = torch.autograd.grad((y * w).sum(), list(other.values()))
        gr = torch.autograd.grad((yr * w.double()).sum(), list(other64.values()))
        for n, a, b in zip(other, gs, gr):
            assert rel(a, b) < 1e-4, n
        assert float(net.grad_arena.abs().sum()) == 0.0  # nothing went into the arena's gradients


@needs_cpu_kernels
def test_step_with_swapped_parameters_uses_them():
    from torch.nn.utils.stateless import _reparametrize_module
    g = torch.Generator().manual_seed(12)
    net = MambaBackbone(CFG, IN, backend="cpu", seed=0)
    ref = MambaBackbone(CFG, IN, backend="reference", seed=0, dtype=torch.float64)
    other = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in net.named_parameters()}
    with torch.no_grad():
        ref.arena.copy_(torch.cat([other[n].reshape(-1) for n in _arena_order(net)]).double())
    x = torch.randn(4, IN, generator=g)
    s, sr = net.initial_state(4), ref.initial_state(4)
    with _reparametrize_module(net, other):
        assert not net.kernel_support("step")
        y = net.step(x, s)
    yr = ref.step(x.double(), sr)
    assert rel(y, yr) < 1e-5 and rel(s.ssm, sr.ssm) < 1e-5


def _arena_order(net):
    return sorted((n for n, _ in net._layout), key=lambda n: net._offsets[n][0])


@needs_cpu_kernels
@pytest.mark.parametrize("T", [1, 17])
def test_fused_node_with_torch_norms_matches_float64(monkeypatch, T):
    """The whole-backbone node with both norm kernels refused (as the CUDA ones are for d_model > 512 /
    1024): forward, final state, every parameter gradient and d_input against the float64 reference."""
    import mamba_rl.model.fused as fused
    monkeypatch.setattr(fused, "_norm_ok", lambda net, out_dtype: (False, False))
    g = torch.Generator().manual_seed(13 + T)
    B = 3
    net = MambaBackbone(CFG, IN, backend="cpu", seed=1)
    ref = MambaBackbone(CFG, IN, backend="reference", seed=1, dtype=torch.float64)
    x = torch.randn(B, T, IN, generator=g)
    starts = torch.rand(B, T, generator=g) < 0.2
    xa, xr = x.clone().requires_grad_(), x.double().requires_grad_()
    y, fin = net(xa, episode_starts=starts)
    yr, finr = ref(xr, episode_starts=starts)
    w = torch.randn(y.shape, generator=g)
    (y * w).sum().backward()
    (yr * w.double()).sum().backward()
    assert rel(y, yr) < 1e-5 and rel(fin.ssm, finr.ssm) < 1e-5
    assert rel(xa.grad, xr.grad) < 1e-4
    for (n, p), (_, pr) in zip(net.named_parameters(), ref.named_parameters()):
        assert rel(p.grad, pr.grad) < 1e-4, n


@needs_cpu_kernels
def test_cpu_binding_raises_value_error_naming_expected_and_received():
    ext = extension("cpu")
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"rms_norm: weight: expected shape \[8\], got \[7\]"):
        ext.rmsnorm_fwd(x, torch.ones(7), 1e-5, torch.float32)


def test_fused_helpers_low_precision_on_torch_ops():
    """The fused node's bf16 helpers on their torch fallbacks: the residual GEMM keeps h in float32 and
    accumulates a @ b in float32; the norm backward also returns dx in the compute dtype."""
    import mamba_rl.model.fused as fused
    g = torch.Generator().manual_seed(14)
    h = torch.randn(6, 8, generator=g)
    a, b = torch.randn(6, 5, generator=g).bfloat16(), torch.randn(5, 8, generator=g).bfloat16()
    out = fused._residual_mm(h, a, b)
    assert out.dtype == torch.float32
    ref = h + a.float() @ b.float()
    # float32 accumulation where torch has addmm(out_dtype=float32) for these inputs, else bf16 product
    tol = 1e-5 if fused._ADDMM_OUT_DTYPE else 2e-2
    assert torch.allclose(out, ref, rtol=tol, atol=tol * float(ref.abs().max()))
    x, dy, w = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g), torch.rand(8, generator=g) + 0.5
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5)
    dw = torch.zeros(8)
    dx, dx_c = fused._norm_bwd(None, False, dy, x, rstd, w, dw, None, torch.bfloat16)
    assert dx.dtype == torch.float32 and dx_c.dtype == torch.bfloat16 and torch.equal(dx_c, dx.bfloat16())
    dx32, none = fused._norm_bwd(None, False, dy, x, rstd, w, torch.zeros(8), None, torch.float32)
    assert none is None and torch.equal(dx32, dx)
