"""Autograd semantics of the kernel backends' fused whole-backbone node, against the reference backend.

The fused node writes parameter gradients straight into the gradient arena; where that would differ from
autograd (frozen parameters, parameter hooks, autograd.grad w.r.t. x, double backward) the backbone runs
the reference math, leaves ``.grad`` alone, or raises a clear error (MambaBackbone's docstring)."""
import pytest
import torch

from mamba_rl import MambaBackbone, MambaConfig
from tests.helpers import needs_cpu_kernels

pytestmark = needs_cpu_kernels()

CFG = MambaConfig(d_model=16, n_layers=2, d_state=8, d_conv=4, expand=2)
IN = 3


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def pair(seed=0):
    return (MambaBackbone(CFG, IN, backend="cpu", seed=seed),
            MambaBackbone(CFG, IN, backend="reference", seed=seed))


def inputs(seed=1, B=3, T=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, IN, generator=g), torch.rand(B, T, generator=g) < 0.2, torch.randn(B, T, CFG.d_model, generator=g)


@pytest.mark.parametrize("frozen", ["layers.0.mixer.D", "norm_f.weight", "all_but_norm_f"])
def test_frozen_parameters_match_reference(frozen):
    """Frozen parameters get no gradient, the others the reference's, and the output requires grad."""
    x, starts, w = inputs()
    grads = []
    for net in pair():
        for name, p in net.named_parameters():
            if (frozen == "all_but_norm_f" and not name.startswith("norm_f")) or name == frozen:
                p.requires_grad_(False)
        if net.backend == "cpu":
            assert not net.autograd_support(x) and "requires_grad=False" in net.autograd_support(x).reason
        y, _ = net(x, episode_starts=starts)
        assert y.requires_grad
        (y * w).sum().backward()
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
    for name in grads[1]:
        assert rel(grads[0][name], grads[1][name]) < 1e-4, name
    frozen_names = [n for n in grads[1] if (frozen == "all_but_norm_f" and not n.startswith("norm_f")) or n == frozen]
    for n in frozen_names:
        assert float(grads[0][n].abs().sum()) == 0.0, n


def test_all_frozen_backbone_with_input_grad_matches_reference():
    """A frozen backbone: dx as the reference, no parameter gradient; without input grad the fused node runs
    and its output needs no grad."""
    x, starts, w = inputs(2)
    dxs = []
    for net in pair():
        net.requires_grad_(False)
        y0, _ = net(x, episode_starts=starts)
        assert not y0.requires_grad
        if net.backend == "cpu":
            assert net.autograd_support(x)  # nothing is differentiated: the kernels may run
        xx = x.clone().requires_grad_()
        y, _ = net(xx, episode_starts=starts)
        (y * w).sum().backward()
        dxs.append(xx.grad)
        assert float(net.grad_arena.abs().sum()) == 0.0
    assert rel(dxs[0], dxs[1]) < 1e-4


def test_parameter_hooks_fire_like_reference():
    x, starts, w = inputs(3)
    seen = []
    for net in pair():
        hits = []
        net.get_parameter("layers.1.mixer.A_log").register_hook(lambda g, hits=hits: hits.append(g.clone()))
        acc = []
        net.get_parameter("input_proj.weight").register_post_accumulate_grad_hook(lambda p, acc=acc: acc.append(1))
        y, _ = net(x, episode_starts=starts)
        (y * w).sum().backward()
        assert len(hits) == 1 and len(acc) == 1
        seen.append(hits[0])
    assert rel(seen[0], seen[1]) < 1e-4


def test_autograd_grad_wrt_input_leaves_param_grads_alone():
    """autograd.grad(out, [x]) returns the reference's dx and writes nothing into .grad (the arena)."""
    x, starts, w = inputs(4)
    dxs = []
    for net in pair():
        xx = x.clone().requires_grad_()
        y, _ = net(xx, episode_starts=starts)
        dx, = torch.autograd.grad((y * w).sum(), [xx])
        dxs.append(dx)
        assert float(net.grad_arena.abs().sum()) == 0.0, net.backend
        y2, _ = net(xx, episode_starts=starts)
        (y2 * w).sum().backward(inputs=[xx])
        assert float(net.grad_arena.abs().sum()) == 0.0, net.backend
    assert rel(dxs[0], dxs[1]) < 1e-4


def test_backward_still_accumulates_like_reference():
    x, starts, w = inputs(5)
    g = []
    for net in pair():
        xx = x.clone().requires_grad_()
        for _ in range(2):  # accumulates over two backwards
            y, _ = net(xx, episode_starts=starts)
            (y * w).sum().backward()
        g.append((net.grad_arena.clone(), xx.grad.clone()))
    assert rel(g[0][0], g[1][0]) < 1e-4 and rel(g[0][1], g[1][1]) < 1e-4


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba3"])
@pytest.mark.parametrize("clear", ["optimizer", "module", "assign"])
def test_a_torch_optimizer_trains_the_kernel_backend_as_the_reference(clear, layer):
    """The standard loop: ``opt.zero_grad()`` (set_to_none=True by default) sets every ``.grad`` to None; the next
    backward must start from zero and fill ``.grad`` again (the fused node writes the arena only: before the fix
    the kernel backend's parameters kept ``.grad`` None and silently never moved after the first step)."""
    x, starts, w = inputs(6)
    cfg = CFG if layer == "Mamba1" else MambaConfig(d_model=16, n_layers=2, d_state=8, layer="Mamba3", headdim=8)
    nets = [MambaBackbone(cfg, IN, backend=b, seed=0) for b in ("cpu", "reference")]
    opts = [torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9) for net in nets]  # not Adam: its step
    # turns a rounding-level difference of a near-zero gradient into a full lr
    for it in range(4):
        for net, opt in zip(nets, opts):
            if clear == "optimizer":
                opt.zero_grad()
            elif clear == "module":
                net.zero_grad(set_to_none=True)
            else:  # the user's own tensors: a stale .grad replaced by zeros of another storage
                for q in net.parameters():
                    q.grad = torch.zeros_like(q)
            for _ in range(2):  # two backwards accumulate after the clear
                y, _ = net(x * (it + 1), episode_starts=starts)
                (y * w).sum().backward()
            assert all(q.grad is not None for q in net.parameters()), net.backend
            opt.step()
        kern, ref = (dict(net.named_parameters()) for net in nets)
        grads = [torch.cat([q.grad.reshape(-1) for q in net.parameters()]) for net in nets]
        assert rel(grads[0], grads[1]) < 1e-4, (it, rel(grads[0], grads[1]))
        for name in ref:
            assert rel(kern[name], ref[name]) < 1e-4, (it, name)
    moved = not torch.equal(nets[0].arena, MambaBackbone(cfg, IN, backend="cpu", seed=0).arena)
    assert nets[0].backend == "cpu" and moved


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("layer", ["Mamba1", "Mamba3"])
def test_a_torch_optimizer_trains_the_cuda_backend_as_the_reference(layer):
    """The same loop on the CUDA backend (its fused node shares the pre-hook): ``opt.zero_grad()`` between steps."""
    x, starts, w = (t.cuda() for t in inputs(7))
    cfg = CFG if layer == "Mamba1" else MambaConfig(d_model=16, n_layers=2, d_state=8, layer="Mamba3", headdim=8)
    nets = [MambaBackbone(cfg, IN, backend=b, seed=0, device="cuda") for b in ("cuda", "reference")]
    opts = [torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9) for net in nets]
    for it in range(3):
        for net, opt in zip(nets, opts):
            opt.zero_grad()
            y, _ = net(x * (it + 1), episode_starts=starts)
            (y * w).sum().backward()
            assert all(q.grad is not None for q in net.parameters()), net.backend
            opt.step()
    assert nets[0].backend == "cuda" and rel(nets[0].arena, nets[1].arena) < 1e-4
    assert not torch.equal(nets[0].arena, MambaBackbone(cfg, IN, backend="cuda", seed=0, device="cuda").arena)


def test_double_backward_raises_a_clear_error():
    x, starts, _ = inputs(6)
    net, ref = pair()
    xr = x.clone().requires_grad_()
    gr, = torch.autograd.grad(ref(xr, episode_starts=starts)[0].square().sum(), xr, create_graph=True)
    gr.sum().backward()  # the reference supports it
    xx = x.clone().requires_grad_()
    y, _ = net(xx, episode_starts=starts)
    with pytest.raises(RuntimeError, match="create_graph=True.*backend='reference'"):
        torch.autograd.grad(y.square().sum(), xx, create_graph=True)


def test_autograd_support_predicate():
    from mamba_rl.ops.capability import autograd_support
    p = torch.nn.Parameter(torch.randn(3))
    q = torch.nn.Parameter(torch.randn(2))
    assert autograd_support([("p", p), ("q", q)])
    q.requires_grad_(False)
    s = autograd_support([("p", p), ("q", q)])
    assert not s and "'q'" in s.reason
    assert autograd_support([("p", p), ("q", q)], grad_enabled=False)
    p.requires_grad_(False)
    assert autograd_support([("p", p), ("q", q)])
    assert not autograd_support([("p", p), ("q", q)], inputs_require_grad=True)
    p.requires_grad_(True)
    q.requires_grad_(True)
    h = p.register_hook(lambda g: g)
    s = autograd_support([("p", p), ("q", q)])
    assert not s and "hook" in s.reason
    h.remove()
    assert autograd_support([("p", p), ("q", q)])
