"""The cuda backend under the trainer API, on the GPU (skipped without one).

- whole backbone, f32 and bf16, vs the float64 reference: features, final state, every parameter gradient
  and d_input, with random resets and a random initial state;
- eager vs CUDA-graph replay: bit-identical over 10 steps, with an lr change between replays, for the
  fused step and the split forward/backward_step;
- A_log reaches the scan after training in graph mode;
- f16 forced overflow under graph replay: skipped, nothing changed, no NaN;
- a checkpoint made on GPU loads on CPU (reference backend) and gives the same features, and back;
- the stepper under a captured graph equals forward.
"""
import math

import pytest
import torch

from mamba_rl import (
    MambaBackbone,
    MambaConfig,
    MambaTrainer,
    RecurrentState,
    load_checkpoint,
    save_checkpoint,
)

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

CFG = MambaConfig(d_model=64, n_layers=3, d_state=16)
IN = 12


def _A(tr):
    """[n_layers, d_inner, d_state] = -exp(A_log) of the trainer's current master weights."""
    return torch.stack([-torch.exp(l.mixer.A_log.detach()) for l in tr.net.layers])


def rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def random_inputs(B, T, gen, dev="cuda"):
    x = torch.randn(B, T, IN, generator=gen).to(dev)
    starts = (torch.rand(B, T, generator=gen) < 0.1).to(dev)
    net = MambaBackbone(CFG, IN, device="cpu", backend="reference")
    s = net.initial_state(B)
    init = RecurrentState(torch.randn(s.conv.shape, generator=gen), 0.5 * torch.randn(s.ssm.shape, generator=gen))
    return x, starts, init.to(dev)


@pytest.mark.parametrize("dtype,tol", [("f32", 1e-4), ("bf16", 2e-2)])
@pytest.mark.parametrize("B,T", [(1, 1), (7, 65), (16, 64)])
def test_backbone_cuda_vs_float64_reference(dtype, tol, B, T):
    gen = torch.Generator().manual_seed(B * 1000 + T)
    net = MambaBackbone(CFG, IN, device="cuda", seed=3, backend="cuda")
    net.set_compute_dtype({"f32": torch.float32, "bf16": torch.bfloat16}[dtype])
    ref = MambaBackbone(CFG, IN, device="cuda", seed=3, backend="reference", dtype=torch.float64)
    x, starts, init = random_inputs(B, T, gen)
    g = torch.randn(B, T, CFG.d_model, generator=gen).cuda()
    xa = x.clone().requires_grad_()
    y, fin = net(xa, init, starts)
    (y * g).sum().backward()
    xr = x.double().requires_grad_()
    yr, finr = ref(xr, init.to(torch.float64), starts)
    (yr * g.double()).sum().backward()
    assert torch.isfinite(y).all()
    assert rel(y, yr) <= tol
    assert rel(fin.ssm, finr.ssm) <= tol and rel(fin.conv, finr.conv) <= tol
    assert rel(xa.grad, xr.grad) <= tol
    for (n, p), (_, pr) in zip(net.named_parameters(), ref.named_parameters()):
        assert rel(p.grad, pr.grad) <= tol, n


def _trainer(dtype="f32", seed=0, B=8, T=32):
    net = MambaBackbone(CFG, IN, device="cuda", seed=seed, backend="cuda")
    return net, MambaTrainer(net, B, T, dtype=dtype, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)


def _batches(n, B=8, T=32, scale=1.0):
    gen = torch.Generator().manual_seed(42)
    return [(torch.randn(B, T, IN, generator=gen).cuda(), scale * torch.randn(B, T, CFG.d_model, generator=gen).cuda(),
             (torch.rand(B, T, generator=gen) < 0.1).cuda()) for _ in range(n)]


@pytest.mark.parametrize("dtype", ["f32", "tf32", "bf16", "f16"])
def test_eager_vs_graph_fused_step_bit_identical(dtype):
    data = _batches(10, scale=1e-3 if dtype == "f16" else 1.0)
    net_e, eager = _trainer(dtype)
    net_g, graph = _trainer(dtype)
    graph.capture_graph()
    for i, (x, d, s) in enumerate(data):
        if i == 5:
            eager.set_lr(3e-4)
            graph.set_lr(3e-4)
        me = eager.step(x, d, episode_starts=s)
        mg = graph.step(x, d, episode_starts=s)
        assert mg.graph_replayed and not me.graph_replayed
        a, b = me.to_dict(), mg.to_dict()
        a.pop("graph_replayed"), b.pop("graph_replayed")
        assert a == b, (i, a, b)
    assert torch.equal(net_e.arena, net_g.arena)
    assert torch.equal(eager.exp_avg_sq, graph.exp_avg_sq)
    assert torch.equal(eager.state.ssm, graph.state.ssm)
    if net_e.compute_arena is not None:
        assert torch.equal(net_e.compute_arena, net_g.compute_arena)


@pytest.mark.parametrize("dtype,wgrad,B,T", [("f32", "off", 16, 64), ("bf16", "auto", 16, 64),
                                             ("f32", "off", 4, 1024), ("f32", "on", 16, 64), ("f32", "on", 4, 1024)])
def test_weight_gradients_on_a_side_stream(dtype, wgrad, B, T):
    """The weight gradients on their own stream (fused.WGRAD_STREAM) against the same step with them in the
    chain, over steps whose operands are freed and reallocated in between (a buffer reused too early would show
    here): cuBLAS weight gradients (f32 with the grouped kernel off, bf16) run the same GEMMs on the same operands,
    so the same bits; the grouped kernel launches once per layer on the side stream and once per step in the
    chain, with K slices chosen per launch, so float32 rounding apart (and eager = captured bit for bit)."""
    from mamba_rl.model import fused
    gen = torch.Generator().manual_seed(11)
    data = [(torch.randn(B, T, IN, generator=gen).cuda(), torch.randn(B, T, CFG.d_model, generator=gen).cuda(),
             (torch.rand(B, T, generator=gen) < 0.05).cuda()) for _ in range(4)]

    def run(stream, capture):
        fused.WGRAD_STREAM, fused.WGRAD = stream, wgrad
        try:
            net, tr = _trainer(dtype, seed=5, B=B, T=T)
            if capture:
                tr.capture_graph()
            out = []
            for x, d, s in data:
                m = tr.step(x, d, episode_starts=s).to_dict()
                m.pop("graph_replayed")
                out.append(m)
                torch.empty(1 << 20, device="cuda").fill_(float("nan"))  # reuse freed blocks with garbage
            torch.cuda.synchronize()
            return net.arena.clone(), tr.exp_avg_sq.clone(), out
        finally:
            fused.WGRAD_STREAM, fused.WGRAD = "auto", "auto"

    chain, side, side_graph = run("off", False), run("on", False), run("on", True)
    assert torch.isfinite(chain[0]).all()
    assert torch.equal(side[0], side_graph[0]) and torch.equal(side[1], side_graph[1]) and side[2] == side_graph[2]
    if wgrad == "on":
        assert rel(side[0], chain[0]) < 1e-5 and rel(side[1], chain[1]) < 1e-4
    else:
        assert torch.equal(side[0], chain[0]) and torch.equal(side[1], chain[1]) and side[2] == chain[2]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_weight_gradient_partials_in_the_grouped_launch_vs_in_the_kernels(dtype):
    """The trainer's step (the final norm's backward inside the forward, dL/dfeatures known) with the conv's and
    the norms' weight gradients summed in the grouped launch (fused.CONV_DW / NORM_DW "grouped", the default)
    against each kernel's own sums: float32 rounding apart over 4 steps, and eager = captured bit for bit."""
    from mamba_rl.model import fused
    data = _batches(4, B=16, T=64)

    def run(mode, capture):
        fused.CONV_DW, fused.NORM_DW = ("grouped", "grouped") if mode == "grouped" else ("conv", "norm")
        try:
            net, tr = _trainer(dtype, seed=3, B=16, T=64)
            if capture:
                tr.capture_graph()
            for x, d, s in data:
                tr.step(x, d, episode_starts=s)
            torch.cuda.synchronize()
            return net.arena.clone(), tr.exp_avg.clone()
        finally:
            fused.CONV_DW, fused.NORM_DW = "grouped", "grouped"

    grouped, own, grouped_graph = run("grouped", False), run("own", False), run("grouped", True)
    assert torch.isfinite(grouped[0]).all()
    assert torch.equal(grouped[0], grouped_graph[0]) and torch.equal(grouped[1], grouped_graph[1])
    assert rel(grouped[0], own[0]) < 1e-5 and rel(grouped[1], own[1]) < 1e-4


def test_eager_vs_graph_split_step_bit_identical():
    data = _batches(10)
    net_e, eager = _trainer()
    net_g, graph = _trainer()
    graph.capture_graph()
    for i, (x, d, s) in enumerate(data):
        if i == 4:
            eager.set_lr(5e-4)
            graph.set_lr(5e-4)
        ye = eager.forward(x, episode_starts=s)
        yg = graph.forward(x, episode_starts=s)
        assert torch.equal(ye, yg)
        acc = i % 3 == 1
        me = eager.backward_step(d * ye, accumulate=acc, extra_grad_sq=torch.tensor(0.25, device="cuda"))
        mg = graph.backward_step(d * yg, accumulate=acc, extra_grad_sq=torch.tensor(0.25, device="cuda"))
        if not acc:
            a, b = me.to_dict(), mg.to_dict()
            a.pop("graph_replayed"), b.pop("graph_replayed")
            assert a == b
    assert torch.equal(net_e.arena, net_g.arena)


def test_graph_buffers_moved_raises():
    net, tr = _trainer()
    tr.capture_graph()
    net._bind_arena(net.arena.clone())  # what a move or a replaced arena does to the captured pointers
    x, d, s = _batches(1)[0]
    with pytest.raises(RuntimeError, match="has moved"):
        tr.step(x, d, episode_starts=s)


def test_capture_keeps_the_garbage_collector_out_and_restores_it():
    """GraphSet.capture collects before the capture, keeps Python's collector off during it (a collection
    mid-capture could destroy a dead trainer's graphs and pool) and restores the collector's state after, also
    when the body raises; a trainer left in a dead reference cycle does not break the next one's capture."""
    import gc

    from mamba_rl.graphs import GraphSet
    seen = []
    gs = GraphSet("test", lambda: ())
    x = torch.ones(4, device="cuda")
    gs.capture("a", lambda: seen.append(gc.isenabled()) or x.mul_(2.0))
    assert seen == [False] and gc.isenabled()
    with pytest.raises(ValueError, match="boom"):
        gs.capture("b", lambda: (_ for _ in ()).throw(ValueError("boom")))
    assert gc.isenabled()
    torch.cuda.synchronize()
    gc.disable()
    try:  # a collector the caller turned off stays off
        gs.capture("c", lambda: x.add_(1.0))
        assert not gc.isenabled()
    finally:
        gc.enable()
    for _ in range(3):  # dead cycles that hold captured trainers, then a fresh capture
        net, tr = _trainer()
        tr.capture_graph()
        tr.cycle = tr
        del net, tr
        net2, tr2 = _trainer()
        tr2.capture_graph()
        x2, d2, s2 = _batches(1)[0]
        assert tr2.step(x2, d2, episode_starts=s2).graph_replayed


def test_A_log_reaches_scan_in_graph_mode():
    net, tr = _trainer()
    tr.set_lr(5e-2)
    tr.capture_graph()
    A0 = _A(tr).clone()
    x, d, s = _batches(1)[0]
    y0 = tr.forward(x, initial_state=net.initial_state(8), episode_starts=s)
    tr.backward_step(torch.zeros_like(d))  # step with zero gradient: decay-free params keep their values
    for x, d, s in _batches(5):
        tr.step(x, d, episode_starts=s)
    assert not torch.allclose(_A(tr), A0)
    # features computed now must match a fresh reference built from the trained weights
    ref = MambaBackbone(CFG, IN, device="cuda", backend="reference")
    with torch.no_grad():
        ref.arena.copy_(net.arena)
    y1 = tr.forward(x, initial_state=net.initial_state(8), episode_starts=s)
    yr, _ = ref(x, net.initial_state(8), s)
    assert rel(y1, yr) <= 1e-4
    assert rel(y1, y0) > 1e-3


def test_f16_overflow_skipped_in_graph_mode():
    net, tr = _trainer("f16")
    tr.capture_graph()
    x, d, s = _batches(1, scale=1e-3)[0]
    tr.step(x, d, episode_starts=s)
    snap = [t.clone() for t in (net.arena, tr.exp_avg, tr.exp_avg_sq, tr.scalars[:3], net.compute_arena)]
    scale = float(tr.scaler.scale)
    m = tr.step(x, d * 1e30, episode_starts=s)
    assert m.graph_replayed and bool(m.overflow_skipped)
    for a, b in zip(snap, (net.arena, tr.exp_avg, tr.exp_avg_sq, tr.scalars[:3], net.compute_arena)):
        assert torch.equal(a, b)
    assert float(tr.scaler.scale) == scale / 2
    for t in (net.arena, tr.exp_avg, tr.exp_avg_sq, net.grad_arena, net.compute_arena):
        assert torch.isfinite(t).all()


def test_checkpoint_gpu_to_cpu_and_back(tmp_path):
    net, tr = _trainer()
    for x, d, s in _batches(3):
        tr.step(x, d, episode_starts=s)
    p = save_checkpoint(tmp_path / "gpu.safetensors", tr)
    cpu_net = MambaBackbone(CFG, IN, device="cpu", seed=9, backend="reference")
    cpu_tr = MambaTrainer(cpu_net, 8, 32, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)
    load_checkpoint(p, cpu_tr)
    x, _, s = _batches(1)[0]
    y_gpu, _ = net(x)
    y_cpu, _ = cpu_net(x.cpu())
    assert rel(y_gpu.cpu(), y_cpu) <= 1e-4
    p2 = save_checkpoint(tmp_path / "cpu.safetensors", cpu_tr)
    net2, tr2 = _trainer(seed=77)
    load_checkpoint(p2, tr2)
    assert torch.equal(net2.arena.cpu(), cpu_net.arena)


def test_stepper_graph_sees_trainer_updates_and_detects_moves():
    net, tr = _trainer("bf16", B=4, T=8)
    st = net.stepper(4).capture_graph()
    x = torch.randn(4, IN, device="cuda")
    a = st.step(x).clone()
    for xb, d, s in _batches(3, B=4, T=8):
        tr.step(xb, d, episode_starts=s)
    st.reset()
    b = st.step(x).clone()
    assert not torch.equal(a, b)  # the graph reads the compute copy that AdamW rewrote in place
    st.reset()
    ref = net.stepper(4)  # eager, same weights
    assert rel(b, ref.step(x)) <= 1e-6
    st.reset()
    st.x_buf.copy_(x)  # zero-copy: write the static buffers, replay without arguments
    st.starts_buf.zero_()
    assert torch.equal(st.step(None), b)
    net.set_compute_dtype(torch.bfloat16)  # a new compute copy: the captured pointers are stale
    with pytest.raises(RuntimeError, match="has moved"):
        st.step(x)


@pytest.mark.parametrize("B", [1, 16, 256])
def test_stepper_graph_equals_forward(B):
    gen = torch.Generator().manual_seed(B)
    net = MambaBackbone(CFG, IN, device="cuda", seed=1, backend="cuda")
    T = 1024 if B <= 16 else 64
    x, starts, _ = random_inputs(B, T, gen)
    y, final = net(x, None, starts)
    st = net.stepper(B).capture_graph()
    ys = torch.stack([st.step(x[:, t], starts[:, t]).clone() for t in range(T)], 1)
    assert rel(ys, y) <= 1e-4
    assert rel(st.state.ssm, final.ssm) <= 1e-4 and rel(st.state.conv, final.conv) <= 1e-4


def test_stepper_built_and_captured_under_inference_mode_gives_normal_tensors():
    """A stepper built and captured inside torch.inference_mode() owns normal tensors (state, static inputs, the
    graph's output): outside the mode its output feeds autograd, its state resets, and it steps as one built
    outside the mode, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    net = MambaBackbone(CFG, IN, device="cuda", seed=1, backend="cuda")
    with torch.inference_mode():
        st = net.stepper(4).capture_graph()
    ref = net.stepper(4).capture_graph()
    x, starts, _ = random_inputs(4, 6, gen)
    for t in range(6):
        out = st.step(x[:, t], starts[:, t])
        assert torch.equal(out, ref.step(x[:, t], starts[:, t]))
    assert not out.is_inference() and not st.state.ssm.is_inference() and not st.x_buf.is_inference()
    w = torch.randn(CFG.d_model, device="cuda", requires_grad=True)
    (out * w).sum().backward()  # saves out for backward: refused for an inference tensor
    assert w.grad is not None
    st.reset(torch.tensor([True, False, True, False], device="cuda"))


@pytest.mark.parametrize("B", [1, 16, 256])
def test_stepper_direct_launch_equals_graph_replay(B):
    """The public step(x) launches the captured kernel directly (PreparedStep): the same bits as the replay, in
    the output and in both states, with and without episode starts; other inputs take the checked path."""
    gen = torch.Generator().manual_seed(7)
    net = MambaBackbone(CFG, IN, device="cuda", seed=2, backend="cuda")
    st = net.stepper(B).capture_graph()
    assert st._fast is not None
    x, starts, _ = random_inputs(B, 3, gen)
    for t in range(3):
        s0 = st.get_state()
        a = st.step(x[:, t], starts[:, t] if t else None).clone()
        sa = st.get_state()
        st.load_state(s0)
        st.x_buf.copy_(x[:, t])
        st.starts_buf.copy_(starts[:, t]) if t else st.starts_buf.zero_()
        st._graphs["step"].replay()
        torch.cuda.synchronize()
        assert torch.equal(a, st._out) and torch.equal(sa.ssm, st.state.ssm) and torch.equal(sa.conv, st.state.conv)
    s0 = st.get_state()
    a = st.step(x[:, 0].double()).clone()  # float64: cast on the checked path, same result
    st.load_state(s0)
    assert torch.equal(a, st.step(x[:, 0]))
    with pytest.raises(ValueError, match="expected shape"):
        st.step(x[:1, 0] if B > 1 else x[:, 0, :3])


@pytest.mark.parametrize("d_model", [64, 128])  # 128: cluster2 to B = 32, cluster3 to 128, then one block per rows
@pytest.mark.parametrize("B", [1, 16, 64, 256])
def test_stepper_step_none_equals_step_x(B, d_model):
    """The public step's two forms after capture: step(None) (the graph's replay on x_buf / starts_buf written in
    place) and step(x, starts) (the same kernel launched directly on the caller's tensors) give the same bits, in
    the output and both states, with and without starts; a rebound x_buf or starts_buf is refused by the pointer
    guard instead of being silently ignored by the replay."""
    gen = torch.Generator().manual_seed(11)
    net = MambaBackbone(MambaConfig(d_model=d_model, n_layers=3, d_state=16), IN, device="cuda", seed=3,
                        backend="cuda")
    st = net.stepper(B).capture_graph()
    x, starts, _ = random_inputs(B, 4, gen)
    for t in range(4):
        s_t = starts[:, t] | (torch.arange(B, device="cuda") % 3 == t % 3) if t % 2 else None
        s0 = st.get_state()
        a = st.step(x[:, t], s_t).clone()
        sa = st.get_state()
        st.load_state(s0)
        st.x_buf.copy_(x[:, t])
        st.starts_buf.copy_(s_t) if s_t is not None else st.starts_buf.zero_()
        b = st.step(None)
        torch.cuda.synchronize()
        assert torch.equal(a, b) and torch.equal(sa.ssm, st.state.ssm) and torch.equal(sa.conv, st.state.conv)
    for name in ("x_buf", "starts_buf"):
        buf = getattr(st, name)
        setattr(st, name, buf.clone())
        with pytest.raises(RuntimeError, match="has moved"):
            st.step(None)
        setattr(st, name, buf)
    st.step(None)


@pytest.mark.parametrize("d_model", [64, 128])
def test_stepper_graph_launched_from_cpp_equals_torch_replay_and_guards_in_place_swaps(d_model):
    """The stepper's graph goes through the extension's GraphLauncher (cudaGraphLaunch from C++, the step draws no
    random numbers): the same bits as torch's CUDAGraph.replay, in the output and both states; the guard still
    refuses a rebound buffer, a storage swapped in place under the same object (seen by the C++ side, which also
    guards the public step(x)), and accepts a new object over the captured storage, then guards that one."""
    gen = torch.Generator().manual_seed(13)
    net = MambaBackbone(MambaConfig(d_model=d_model, n_layers=3, d_state=16), IN, device="cuda", seed=4,
                        backend="cuda")
    B = 16
    st = net.stepper(B).capture_graph()
    assert set(st._graphs._launch) == {"step"}, "the CUDA backend's stepper launches its graph from C++"
    x, starts, _ = random_inputs(B, 3, gen)
    for t in range(3):
        st.x_buf.copy_(x[:, t])
        st.starts_buf.copy_(starts[:, t])
        s0 = st.get_state()
        a = st.step(None).clone()
        sa = st.get_state()
        st.load_state(s0)
        st._graphs["step"].replay()  # torch's replay of the same graph
        torch.cuda.synchronize()
        assert torch.equal(a, st._out) and torch.equal(sa.ssm, st.state.ssm) and torch.equal(sa.conv, st.state.conv)
    # the direct launch (public step(x), outside no_grad) records no autograd graph
    y = st.step(x[:, 0].clone().requires_grad_())
    assert not y.requires_grad and not st.state.ssm.requires_grad
    # a new object over the same storage: accepted, and then it is the one guarded
    st.state.ssm = st.state.ssm.view(st.state.ssm.shape)
    st.step(None)
    st.step(x[:, 0])
    for name in ("ssm", "conv"):
        buf = getattr(st.state, name)
        keep = buf.data
        buf.data = keep.clone()  # the storage swapped in place: same object, another pointer
        with pytest.raises(RuntimeError, match="has moved"):
            st.step(None)
        with pytest.raises(RuntimeError, match="has moved"):
            st.step(x[:, 0])  # the direct launch's guard
        buf.data = keep
    st.step(None)
    torch.cuda.synchronize()
    eager = MambaBackbone(MambaConfig(d_model=d_model, n_layers=3, d_state=16), IN, device="cuda", seed=4,
                          backend="cuda").stepper(B)
    assert not eager._graphs._launch and not eager._graphs  # nothing captured, nothing bound

def test_norm_fwd_x_copy():
    from mamba_rl.ops.extension import extension
    ext = extension("cuda")
    h = torch.randn(77, 96, device="cuda")
    w = torch.randn(96, device="cuda")
    cp = torch.full_like(h, float("nan"))
    u, r = ext.rmsnorm_fwd(h, w, 1e-5, torch.bfloat16, x_copy=cp)
    u2, r2 = ext.rmsnorm_fwd(h, w, 1e-5, torch.bfloat16)
    assert torch.equal(cp, h) and torch.equal(u, u2) and torch.equal(r, r2)


def test_tf32_uses_tensor_cores_only_inside_the_trainer_and_stays_close_to_float64():
    """dtype="tf32": the trainer's GEMMs run with allow_tf32 (other bits than f32), torch's global flag is as the
    caller left it after every call, and features / final state stay within TF32's error of the float64
    reference (d_model 256: cuBLAS GEMMs with K = 256 / 512)."""
    cfg = MambaConfig(d_model=256, n_layers=2, d_state=16)
    B, T = 8, 64
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(B, T, IN, generator=gen).cuda()
    starts = (torch.rand(B, T, generator=gen) < 0.1).cuda()
    d = torch.randn(B, T, cfg.d_model, generator=gen).cuda()
    before = torch.backends.cuda.matmul.allow_tf32
    feats = {}
    for dtype in ("f32", "tf32"):
        net = MambaBackbone(cfg, IN, device="cuda", seed=5, backend="cuda")
        tr = MambaTrainer(net, B, T, dtype=dtype, lr=1e-3)
        feats[dtype] = tr.forward(x, episode_starts=starts).clone()
        assert torch.backends.cuda.matmul.allow_tf32 == before
        m = tr.step(x, d, episode_starts=starts)
        assert torch.backends.cuda.matmul.allow_tf32 == before
        g = float(m.grad_norm)
        assert math.isfinite(g) and g > 0
    ref = MambaBackbone(cfg, IN, device="cuda", seed=5, backend="reference", dtype=torch.float64)
    yr, _ = ref(x.double(), ref.initial_state(B).to(torch.float64), starts)
    assert rel(feats["f32"], yr) <= 1e-4
    assert 1e-6 < rel(feats["tf32"], yr) <= 5e-3
    assert not torch.equal(feats["tf32"], feats["f32"])


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_default_model_step_replay_launches_at_most_40_kernels(dtype):
    """Issue 18's launch budget: one captured training step of the default model (d_model 128, 3 layers, 16 x 64,
    32 inputs) runs at most 40 kernels, memcpys and memsets (torch.profiler over one replay); the forward writes
    the final state straight into the carried state (the same tensors, the values of a plain forward)."""
    from torch.profiler import ProfilerActivity, profile
    net = MambaBackbone(MambaConfig(), 32, device="cuda", seed=0, backend="cuda")
    twin = MambaBackbone(MambaConfig(), 32, device="cuda", seed=0, backend="cuda")
    tr = MambaTrainer(net, 16, 64, dtype=dtype, lr=1e-3)
    twin.set_compute_dtype(net.compute_dtype)
    gen = torch.Generator().manual_seed(9)
    x, d = torch.randn(16, 64, 32, generator=gen).cuda(), torch.randn(16, 64, 128, generator=gen).cuda()
    tr.capture_graph()
    conv, ssm = tr.state.conv, tr.state.ssm
    tr.step(x, d)  # from the initial weights and a zero state
    with torch.no_grad():
        _, fin = twin(x)
    assert tr.state.conv is conv and tr.state.ssm is ssm
    assert torch.equal(fin.ssm, tr.state.ssm) and torch.equal(fin.conv, tr.state.conv)
    graph = tr._graphs["step"]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert 20 <= len(names) <= 40, names
