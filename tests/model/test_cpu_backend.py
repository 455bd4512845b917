"""The "cpu" backend (C++/OpenMP kernels under the fused whole-backbone node) against the float64 reference:
features, final state, every parameter gradient and d_input, for every reset pattern; the stepper against
forward over T = 1000 with resets. Skips only where the CPU kernels cannot be built (no C++ compiler)."""
import pytest
import torch

from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer, RecurrentState
from tests.helpers import RESET_PATTERNS, loss_and_grads, needs_cpu_kernels, rel, starts_for

pytestmark = needs_cpu_kernels()

CFG = MambaConfig(d_model=16, n_layers=2, d_state=8, d_conv=4, expand=2)
IN = 5


def pair(seed=0):
    net = MambaBackbone(CFG, IN, backend="cpu", seed=seed)
    ref = MambaBackbone(CFG, IN, backend="reference", dtype=torch.float64, seed=seed)
    assert net.backend == "cpu"
    return net, ref


@pytest.mark.parametrize("T", [1, 3, 63, 64, 65, 1000])
@pytest.mark.parametrize("pattern", RESET_PATTERNS)
def test_backbone_matches_float64_reference(T, pattern):
    if T == 1000 and pattern not in ("random", "none"):
        pytest.skip("long sequences: the random and no-reset patterns cover them")
    g = torch.Generator().manual_seed(T * 7 + len(pattern))
    B = 3
    net, ref = pair()
    x = torch.randn(B, T, IN, generator=g)
    starts = starts_for(pattern, B, T, g, clean_row=True)
    s0 = RecurrentState(torch.randn(CFG.n_layers, B, CFG.d_inner, CFG.d_conv - 1, generator=g) * 0.5,
                        torch.randn(CFG.n_layers, B, CFG.d_inner, CFG.d_state, generator=g) * 0.5)
    wy = torch.randn(B, T, CFG.d_model, generator=g)
    wc, ws = torch.randn_like(s0.conv), torch.randn_like(s0.ssm)
    w = (wy, wc, ws)
    y, fin, dx, grads = loss_and_grads(net, x, s0, starts, w, torch.float32)
    ry, rfin, rdx, rgrads = loss_and_grads(ref, x, s0, starts, w, torch.float64)
    assert rel(y, ry) <= 1e-4
    assert rel(fin.conv, rfin.conv) <= 1e-4 and rel(fin.ssm, rfin.ssm) <= 1e-4
    assert rel(dx, rdx) <= 1e-4
    for name, _ in net._layout:  # every parameter's gradient, one by one
        assert rel(net.arena_view(grads, name), ref.arena_view(rgrads, name)) <= 1e-4, name


def test_stepper_equals_forward_T1000_with_resets():
    g = torch.Generator().manual_seed(5)
    B, T = 4, 1000
    net, ref = pair(seed=3)
    x = torch.randn(B, T, IN, generator=g)
    starts = torch.rand(B, T, generator=g) < 0.01
    st = net.stepper(batch=B)
    feats = torch.stack([st.step(x[:, t], episode_starts=starts[:, t]).clone() for t in range(T)], 1)
    with torch.no_grad():
        ry, rfin = ref(x.double(), None, starts)
    assert rel(feats, ry) <= 1e-4
    assert rel(st.state.conv, rfin.conv) <= 1e-4 and rel(st.state.ssm, rfin.ssm) <= 1e-4


def test_bound_cpu_step_is_the_checked_step_bit_for_bit_and_follows_weights_and_states():
    """Stepper.step's bound CPU call (one PreparedStep per packed weights and state) gives the very floats of
    MambaBackbone.step, sees in-place weight updates, re-binds when the state is replaced, and leaves the
    stepper's own error messages to the checked path."""
    g = torch.Generator().manual_seed(11)
    B, T = 3, 40
    net, _ = pair(seed=4)
    x = torch.randn(T, B, IN, generator=g)
    starts = torch.rand(T, B, generator=g) < 0.2
    st = net.stepper(batch=B)
    twin = net.initial_state(B)
    for t in range(T):
        out = st.step(x[t], episode_starts=starts[t])
        ref = net.step(x[t], twin, starts[t])
        assert torch.equal(out, ref)
        if t == 10:  # an optimizer-like in-place update of the weights
            with torch.no_grad():
                net.arena.mul_(1.01)
        if t == 20:  # a new state object: the bound call must follow it
            st.state = st.state.clone()
    assert st._cpu_prep is not None and st._cpu_prep[1] is st.state.conv
    assert torch.equal(st.state.ssm, twin.ssm) and torch.equal(st.state.conv, twin.conv)
    # float64 input: cast by the checked path, the same numbers as a float32 one
    a = st.get_state()
    y32 = st.step(x[0]).clone()
    st.load_state(a)
    assert torch.equal(st.step(x[0].double()), y32)
    with pytest.raises(ValueError, match=r"Stepper.step: x_t: expected shape \[3, 5\]"):
        st.step(torch.randn(B, IN + 1))
    with pytest.raises(ValueError, match="Stepper.step: episode_starts"):
        st.step(x[0], episode_starts=torch.zeros(1, B, dtype=torch.bool))


def test_trainer_step_on_cpu_backend_matches_reference_trainer():
    g = torch.Generator().manual_seed(9)
    B, T = 2, 33
    nets = [MambaBackbone(CFG, IN, backend=b, seed=1) for b in ("cpu", "reference")]
    trs = [MambaTrainer(n, batch=B, seq_len=T, lr=1e-3, max_grad_norm=0.5) for n in nets]
    for _ in range(5):
        x = torch.randn(B, T, IN, generator=g)
        d = torch.randn(B, T, CFG.d_model, generator=g)
        s = torch.rand(B, T, generator=g) < 0.1
        for tr in trs:
            tr.step(x, d, episode_starts=s)
    assert rel(nets[0].arena, nets[1].arena) <= 1e-5
    assert rel(trs[0].state.ssm, trs[1].state.ssm) <= 1e-4


def test_auto_falls_back_to_the_reference_with_one_warning(monkeypatch):
    """Where the CPU kernels cannot load, backend="auto" runs the reference and warns once, naming the cause
    and the fix; backend="cpu" raises instead."""
    from mamba_rl.model import backbone as bb
    from mamba_rl.ops import extension as ext
    monkeypatch.setattr(ext, "_LOADED", {})
    monkeypatch.setattr(ext, "_ERRORS", {"cpu": ext.BuildError("cpu", "no C++ compiler found (looked for 'c++')",
                                                                "install a C++ compiler with OpenMP")})
    monkeypatch.setattr(bb, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler.*Fix: install a C\\+\\+ compiler"):
        net = MambaBackbone(CFG, IN)
    assert net.backend == "reference"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert MambaBackbone(CFG, IN).backend == "reference"  # the warning comes once per process
    with pytest.raises(RuntimeError, match="cpu kernels could not load"):
        MambaBackbone(CFG, IN, backend="cpu")


def test_double_backward_with_retained_graph_and_initial_state_grad():
    """A retained graph backpropagates twice (the scan keeps its checkpoints), giving twice the gradient."""
    g = torch.Generator().manual_seed(11)
    net = MambaBackbone(CFG, IN, backend="cpu")
    x = torch.randn(3, 8, IN, generator=g, requires_grad=True)
    s = RecurrentState(torch.randn(CFG.n_layers, 3, CFG.d_inner, CFG.d_conv - 1, generator=g).requires_grad_(),
                       torch.randn(CFG.n_layers, 3, CFG.d_inner, CFG.d_state, generator=g).requires_grad_())
    f, fs = net(x, initial_state=s, episode_starts=torch.rand(3, 8, generator=g) < 0.3)
    loss = f.sum() + fs.ssm.pow(2).sum()
    loss.backward(retain_graph=True)
    once = (x.grad.clone(), s.ssm.grad.clone())
    loss.backward()
    assert torch.allclose(x.grad, 2 * once[0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(s.ssm.grad, 2 * once[1], rtol=1e-5, atol=1e-6)


def test_empty_batch_on_cpu_backend():
    y, st = MambaBackbone(CFG, IN, backend="cpu")(torch.randn(0, 5, IN))
    assert y.shape == (0, 5, CFG.d_model) and st.ssm.shape == (CFG.n_layers, 0, CFG.d_inner, CFG.d_state)


@pytest.mark.parametrize("T", [1, 65, 200])
@pytest.mark.parametrize("pattern", RESET_PATTERNS)
def test_whole_backbone_entry_is_the_python_node_bit_for_bit(T, pattern, monkeypatch):
    """The CPU extension's backbone_fwd / backbone_bwd (one C++ call each way) against the fused node's Python
    over the same kernels (fused.CPU_WHOLE = "off"): the very floats of the features, both final states,
    d_input and every parameter gradient, with an initial state, gradients into the final states, and a
    second backward through a retained graph."""
    import mamba_rl.model.fused as fused

    g = torch.Generator().manual_seed(T * 3 + len(pattern))
    B = 3
    net, _ = pair(seed=2)
    x = torch.randn(B, T, IN, generator=g)
    starts = starts_for(pattern, B, T, g)
    s0 = RecurrentState(torch.randn(CFG.n_layers, B, CFG.d_inner, CFG.d_conv - 1, generator=g),
                        torch.randn(CFG.n_layers, B, CFG.d_inner, CFG.d_state, generator=g))
    w = (torch.randn(B, T, CFG.d_model, generator=g), torch.randn_like(s0.conv), torch.randn_like(s0.ssm))
    runs = {}
    for mode in ("auto", "off"):
        monkeypatch.setattr(fused, "CPU_WHOLE", mode)
        runs[mode] = loss_and_grads(net, x, s0, starts, w, torch.float32)
    (y, fin, dx, grads), (y2, fin2, dx2, grads2) = runs["auto"], runs["off"]
    assert torch.equal(y, y2) and torch.equal(fin.conv, fin2.conv) and torch.equal(fin.ssm, fin2.ssm)
    assert torch.equal(dx, dx2) and torch.equal(grads, grads2)
    assert grads.abs().sum() > 0 and dx.abs().sum() > 0
    # a retained graph: a second backward adds the gradients again, the same floats as the Python node's
    twice = {}
    for mode in ("auto", "off"):
        monkeypatch.setattr(fused, "CPU_WHOLE", mode)
        net.zero_grad()
        out, _ = net(x, s0, starts)
        loss = (out * w[0]).sum()
        loss.backward(retain_graph=True)
        once = net.grad_arena.clone()
        loss.backward()
        twice[mode] = net.grad_arena.clone()
        torch.testing.assert_close(twice[mode], 2 * once, rtol=1e-4, atol=1e-5)
    assert torch.equal(twice["auto"], twice["off"])


def test_whole_backbone_entry_refuses_bad_arguments_by_name():
    """backbone_fwd / backbone_bwd check what they are given (ValueError naming the argument), as every
    binding function does."""
    from mamba_rl.model.fused import _packed

    net, _ = pair()
    ext = net.kernels
    L, B, T = CFG.n_layers, 2, 5
    iw, ib, nf, layers = _packed(net, net.arena)
    conv0 = torch.zeros(L, B, CFG.d_inner, CFG.d_conv - 1)
    ssm0 = torch.zeros(L, B, CFG.d_inner, CFG.d_state)
    x = torch.randn(B, T, IN)
    with pytest.raises(ValueError, match=r"backbone_fwd: x: expected shape \[B, T, input_dim\]"):
        ext.backbone_fwd(x[0], iw, ib, nf, layers, conv0, ssm0, None, 1e-5)
    with pytest.raises(ValueError, match=r"backbone_fwd: input_proj.weight: expected shape \[d_model, 4\]"):
        ext.backbone_fwd(x[..., :4], iw, ib, nf, layers, conv0, ssm0, None, 1e-5)
    with pytest.raises(ValueError, match=r"backbone_fwd: ssm_state: expected a contiguous \[2, 2, 32, 8\] tensor, "
                                         r"got shape \[2, 1, 32, 8\]"):
        ext.backbone_fwd(x, iw, ib, nf, layers, conv0, ssm0[:, :1], None, 1e-5)
    with pytest.raises(ValueError, match="episode_starts: expected dtype bool, got Float"):
        ext.backbone_fwd(x, iw, ib, nf, layers, conv0, ssm0, torch.zeros(B, T), 1e-5)
    feat, _, _, saved = ext.backbone_fwd(x, iw, ib, nf, layers, conv0, ssm0, None, 1e-5)
    gi, gb, gn, grads = _packed(net, net.grad_arena)
    with pytest.raises(ValueError, match=r"backbone_bwd: grad_features: expected shape \[2, 5, 16\]"):
        ext.backbone_bwd(saved, feat[:, :2], None, None, gi, gb, gn, grads, False)
    with pytest.raises(ValueError, match=r"backbone_bwd: grads: expected 2 layers, got 1"):
        ext.backbone_bwd(saved, feat, None, None, gi, gb, gn, grads[:1], False)
    with pytest.raises(ValueError, match=r"backbone_bwd: grad layer 0: expected 10 tensors, got 9"):
        ext.backbone_bwd(saved, feat, None, None, gi, gb, gn, [grads[0][:9], grads[1]], False)
    # another backbone's gradients (dt_rank 3 against the forward's 2): refused before anything is written
    other = MambaBackbone(MambaConfig(**{**CFG.to_dict(), "dt_rank": 3}), IN, backend="cpu")
    before = other.grad_arena.clone()
    with pytest.raises(ValueError, match=r"backbone_bwd: grad x_proj.weight: expected shape \[17, 32\], "
                                         r"got \[19, 32\]"):
        ext.backbone_bwd(saved, feat, None, None, *_packed(other, other.grad_arena), False)
    assert torch.equal(other.grad_arena, before)
    with pytest.raises(ValueError, match=r"backbone_fwd: layer 1 x_proj.weight: expected shape"):
        ext.backbone_fwd(x, iw, ib, nf, [layers[0], layers[1][:4] + [layers[1][4][:-1]] + layers[1][5:]], conv0,
                         ssm0, None, 1e-5)



@pytest.mark.parametrize("layer", ["Mamba1", "Mamba3"])
def test_a_refused_dtype_move_leaves_the_backbone_as_it_was(layer):
    """backend="cpu" takes float32 masters only: ``.double()`` raises the ValueError naming it before anything
    moves, so the arena, the parameters and the backend stay float32 / "cpu" and the outputs are unchanged
    (before, the arena was float64 when the error came)."""
    cfg = CFG if layer == "Mamba1" else MambaConfig(d_model=32, n_layers=1, layer="Mamba3")
    net = MambaBackbone(cfg, IN, backend="cpu", seed=3)
    x = torch.randn(2, 7, IN, generator=torch.Generator().manual_seed(3))
    y0 = net(x)[0].detach()
    with pytest.raises(ValueError, match="backend='cpu' needs float32 masters, got torch.float64"):
        net.double()
    assert net.arena.dtype == torch.float32 and net.backend == "cpu"
    assert all(p.dtype == torch.float32 and p.data_ptr() >= net.arena.data_ptr() for p in net.parameters())
    assert torch.equal(net(x)[0], y0)
