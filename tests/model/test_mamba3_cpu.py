"""Mamba-3 on the "cpu" backend (C++ mixer core, csrc/cpu/mamba3*.cpp, under the whole-backbone node of
mamba_rl/model/fused_m3.py) against the float64 reference: features, final state, every parameter gradient
and d_input for T in {1, 3, 63, 64, 65, 1000} and every reset pattern; the stepper (one C++ call per token)
against forward over T = 1000 with resets; the trainer, resume, the backend choice and the AdamW no-decay
group. Skips only where the CPU kernels cannot be built."""
import math
import re
import warnings

import pytest
import torch

from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer, load_checkpoint, save_checkpoint
from mamba_rl.model.mamba3 import Mamba3State
from tests.helpers import RESET_PATTERNS as PATTERNS, angle_err, loss_and_grads, needs_cpu_kernels, rel, starts_for

pytestmark = needs_cpu_kernels()

F64 = torch.float64
IN = 3


@pytest.fixture
def cpu_ext():
    """The CPU kernel module with output poisoning on (every fresh output starts as NaN)."""
    from mamba_rl.ops.extension import extension
    e = extension("cpu")
    e.set_poison(True)
    yield e
    e.set_poison(False)


def m3cfg(**kw):
    base = dict(layer="Mamba3", d_model=8, n_layers=2, d_state=8, expand=2, headdim=4)
    base.update(kw)
    return MambaConfig(**base)


def pair(cfg, seed=0, jitter=0.3):
    """(cpu-backend net, float64 reference net) with equal parameters, moved off the init (B/C biases, D and
    the norms are all 1 there) so every term of the backward is exercised."""
    net = MambaBackbone(cfg, IN, backend="cpu", seed=seed)
    ref = MambaBackbone(cfg, IN, backend="reference", dtype=F64, seed=seed)
    assert net.backend == "cpu"
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        ref.arena.add_(torch.randn(ref.arena.shape, generator=g, dtype=F64) * jitter)
        net.arena.copy_(ref.arena)
    return net, ref


def check_against_reference(net, ref, x, s0, starts, tol=1e-4):
    """Run both nets forward and backward (a loss on the features and on every part of the final state) and
    compare features, final state, d_input and each parameter's gradient."""
    g = torch.Generator().manual_seed(7)
    B, T = x.shape[:2]
    wy = torch.randn(B, T, net.cfg.d_model, generator=g, dtype=F64)
    wc, ws = torch.randn(s0.conv.shape, generator=g, dtype=F64), torch.randn(s0.ssm.shape, generator=g, dtype=F64)
    w = (wy, wc, ws)
    y, fin, dx, grads = loss_and_grads(net, x, s0, starts, w, torch.float32)
    assert y.grad_fn is None and type(fin) is Mamba3State
    ry, rfin, rdx, rgrads = loss_and_grads(ref, x, s0, starts, w, F64)
    assert rel(y, ry) <= tol
    assert rel(fin.ssm, rfin.ssm) <= tol and rel(fin.k, rfin.k) <= tol and rel(fin.v, rfin.v) <= tol
    assert angle_err(fin.angle, rfin.angle) <= 1e3 * tol
    assert rel(dx, rdx) <= tol
    # every parameter's gradient, one by one, relative to its own norm, with a floor of 1e-6 of the whole
    # gradient's norm: a gradient that is zero in exact arithmetic comes out as float32 rounding noise
    # (e.g. C_bias under the gated out norm with a reset at every step: y is then x times a per-head
    # scalar, which the RMSNorm divides out)
    floor = 1e-6 * rgrads.norm().item()
    for name, _ in net._layout:
        a, b = net.arena_view(grads, name).double(), ref.arena_view(rgrads, name)
        assert torch.isfinite(a).all() and (a - b).norm().item() <= tol * b.norm().item() + floor, name


@pytest.mark.parametrize("T", [1, 3, 63, 64, 65, 1000])
def test_every_reset_pattern_matches_float64_reference(T):
    """One row per reset pattern (rows are independent), so each T is one run; T = 1000 crosses 16 of the
    backward's checkpoint chunks."""
    g = torch.Generator().manual_seed(T)
    cfg = m3cfg(d_model=4, d_state=4, headdim=4) if T == 1000 else m3cfg()
    net, ref = pair(cfg, seed=T % 5)
    B = len(PATTERNS)
    x = torch.randn(B, T, IN, generator=g, dtype=F64)
    starts = torch.cat([starts_for(p, 1, T, g) for p in PATTERNS])
    s0 = net.initial_state(B).to(F64)
    s0 = Mamba3State(torch.randn(s0.conv.shape, generator=g, dtype=F64) * 2,
                     torch.randn(s0.ssm.shape, generator=g, dtype=F64) * 0.5)
    check_against_reference(net, ref, x, s0, starts, tol=2e-4 if T == 1000 else 1e-4)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("kw", [dict(), dict(is_outproj_norm=True, rope_fraction=1.0),
                                dict(A_activation="softplus", n_layers=1, d_state=6, headdim=8)])
def test_variants_and_patterns_match_float64_reference(pattern, kw):
    """Gated out norm, all pairs rotated (rope_fraction 1), the softplus A, a d_state with unrotated
    entries (6: R = 1 of 3 pairs), across a chunk boundary (T = 70)."""
    g = torch.Generator().manual_seed(PATTERNS.index(pattern))
    net, ref = pair(m3cfg(**kw), seed=1)
    B, T = 2, 70
    x = torch.randn(B, T, IN, generator=g, dtype=F64)
    s0 = net.initial_state(B).to(F64)
    s0 = Mamba3State(torch.randn(s0.conv.shape, generator=g, dtype=F64),
                     torch.randn(s0.ssm.shape, generator=g, dtype=F64) * 0.5)
    check_against_reference(net, ref, x, s0, starts_for(pattern, B, T, g))


def test_kernel_outputs_are_all_written_and_old_nans_never_leak(cpu_ext):
    """With output poisoning on (every fresh kernel output starts as NaN), a NaN left anywhere means a
    kernel forgot an element; a NaN / inf of an old episode (initial state, an earlier input) must not
    reach a later episode, in forward or backward."""
    g = torch.Generator().manual_seed(3)
    net, _ = pair(m3cfg(is_outproj_norm=True), seed=2)
    c = net.cfg
    B, T = 3, 70
    x = torch.randn(B, T, IN, generator=g)
    x[0, :5] = math.nan
    s0 = net.initial_state(B)
    s0.conv[:, 1] = math.inf
    s0.ssm[:, 1] = math.nan
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[0, 5] = True
    starts[1, 0] = True
    xx = x.clone().requires_grad_()
    y, fin = net(xx, s0, starts)
    assert torch.isfinite(y[0, 5:]).all() and torch.isfinite(y[1:]).all()
    assert torch.isfinite(fin.conv).all() and torch.isfinite(fin.ssm).all()
    y[:, 5:].sum().backward()
    assert torch.isfinite(xx.grad[1:]).all() and torch.isfinite(xx.grad[0, 5:]).all()
    # the core alone, every output fresh (poisoned) and every parameter gradient returned
    from mamba_rl.model.fused_m3 import m3_core_params
    v = {n: net.arena_view(net.arena, n) for n, _ in net._layout}
    prm = m3_core_params(v, 0, c)
    zxbc = torch.randn(B, T, 2 * c.d_inner + 2 * c.d_state + 3 * c.nheads + c.num_rope_angles, generator=g)
    kw = dict(eps=1e-5, A_floor=c.A_floor, heavy_tail=True)
    yk, cf, sf, ckpt = cpu_ext.m3_fwd(zxbc, c.headdim, *prm[:6], prm[6], None, None, starts, need_ckpt=True, **kw)
    out = cpu_ext.m3_bwd(zxbc, c.headdim, *prm[:6], prm[6], None, None, starts, ckpt=ckpt, dy=torch.randn_like(yk),
                         dcarry=None, dssm=None, **kw)
    for t in [yk, cf, sf] + out:
        assert torch.isfinite(t).all()


def test_core_refuses_bad_shapes_naming_expected_and_received(cpu_ext):
    net, _ = pair(m3cfg(), seed=0)
    from mamba_rl.model.fused_m3 import m3_core_params
    c = net.cfg
    prm = m3_core_params({n: net.arena_view(net.arena, n) for n, _ in net._layout}, 0, c)
    Dp = 2 * c.d_inner + 2 * c.d_state + 3 * c.nheads + c.num_rope_angles
    kw = dict(eps=1e-5, A_floor=1e-4, heavy_tail=True, need_ckpt=False)
    with pytest.raises(ValueError, match=rf"zxbc: expected a last dim .* got {Dp + 3}"):
        cpu_ext.m3_fwd(torch.zeros(2, 4, Dp + 3), c.headdim, *prm, None, None, None, None, **kw)
    with pytest.raises(ValueError, match=r"carry \(\[angle \| k \| v\]\): expected shape \[2, 4, 14\], got \[2, 4, 13\]"):
        cpu_ext.m3_fwd(torch.zeros(2, 4, Dp), c.headdim, *prm, None, torch.zeros(2, 4, 13), None, None, **kw)
    with pytest.raises(ValueError, match=r"zxbc: expected dtype float32.*Double"):
        cpu_ext.m3_fwd(torch.zeros(2, 4, Dp, dtype=F64), c.headdim, *prm, None, None, None, None, **kw)
    big = [*prm[:3], torch.ones(257), *prm[4:]]  # past the core's stack buffers for B and C
    with pytest.raises(ValueError, match=re.escape("B_norm.weight: expected shape [d_state] with 2 <= d_state <= 256, "
                                                   "got [257]")):
        cpu_ext.m3_fwd(torch.zeros(2, 4, Dp), c.headdim, *big, None, None, None, None, **kw)


def test_one_token_step_refuses_bad_inputs_naming_expected_and_received(cpu_ext):
    """m3_backbone_step runs the same input checks as Mamba-1's backbone_step before it touches any state."""
    net, _ = pair(m3cfg(), seed=0)
    c = net.cfg
    inp_w, inp_b, normf, layers = net._packed_step_weights()
    st = net.initial_state(2)
    tail = (float(c.rms_norm_eps), c.headdim, float(c.A_floor), True)
    x = torch.zeros(2, IN)
    with pytest.raises(ValueError, match=re.escape(f"m3_backbone_step: input_proj.weight: expected shape "
                                                   f"[d_model, {IN + 1}], got [{c.d_model}, {IN}]")):
        cpu_ext.m3_backbone_step(torch.zeros(2, IN + 1), inp_w, inp_b, normf, layers, st.conv, st.ssm, None, *tail)
    with pytest.raises(ValueError, match=re.escape("m3_backbone_step: episode_starts: expected a contiguous [2] "
                                                   "bool tensor, got shape [3] dtype Bool")):
        cpu_ext.m3_backbone_step(x, inp_w, inp_b, normf, layers, st.conv, st.ssm, torch.zeros(3, dtype=torch.bool),
                                 *tail)
    with pytest.raises(ValueError, match="m3_backbone_step: layers: expected at least 1 layer, got 0"):
        cpu_ext.m3_backbone_step(x, inp_w, inp_b, normf, [], st.conv, st.ssm, None, *tail)
    assert not st.conv.any() and not st.ssm.any()


def test_stepper_equals_forward_T1000_with_resets():
    """The stepper's one C++ call per token runs the sequence kernel's own core: T steps equal the forward
    (features, final state) and the float64 reference."""
    g = torch.Generator().manual_seed(5)
    B, T = 3, 1000
    net, ref = pair(m3cfg(d_model=4, d_state=4, headdim=4), seed=3)
    x = torch.randn(B, T, IN, generator=g)
    starts = torch.rand(B, T, generator=g) < 0.01
    starts[1, 500:502] = True
    s0 = net.initial_state(B)
    s0 = Mamba3State(torch.randn(s0.conv.shape, generator=g), torch.randn(s0.ssm.shape, generator=g) * 0.5)
    st = net.stepper(batch=B)
    assert net.kernel_support("step")
    st.load_state(s0)
    feats = torch.stack([st.step(x[:, t], episode_starts=starts[:, t]).clone() for t in range(T)], 1)
    with torch.no_grad():
        y, fin = net(x, s0, starts)
        ry, rfin = ref(x.double(), s0.to(F64), starts)
    assert rel(feats, y) <= 1e-5 and rel(st.state.ssm, fin.ssm) <= 1e-5
    assert rel(feats, ry) <= 2e-4
    assert rel(st.state.ssm, rfin.ssm) <= 2e-4 and rel(st.state.k, rfin.k) <= 2e-4
    assert angle_err(st.state.angle, rfin.angle) <= 1e-2


def test_trainer_on_cpu_backend_matches_reference_trainer_and_resumes_bit_identically(tmp_path):
    """MambaTrainer.step and forward + backward_step on the cpu backend follow the reference trainer (same
    AdamW over the same arena layout); a checkpoint taken mid-run resumes to the same arena and state to
    the bit."""
    g = torch.Generator().manual_seed(9)
    B, T = 2, 33
    cfg = m3cfg()
    nets = [MambaBackbone(cfg, IN, backend=b, seed=1) for b in ("cpu", "reference")]
    assert nets[0].backend == "cpu"
    trs = [MambaTrainer(n, batch=B, seq_len=T, lr=1e-3, max_grad_norm=0.5, weight_decay=0.1) for n in nets]
    assert trs[0]._cpu_kernels is not None  # the C++ grad-norm / AdamW passes run too
    data = [(torch.randn(B, T, IN, generator=g), torch.randn(B, T, cfg.d_model, generator=g),
             torch.rand(B, T, generator=g) < 0.1) for _ in range(6)]
    for x, d, s in data[:3]:
        for tr in trs:
            tr.step(x, d, episode_starts=s)
    x, d, s = data[3]
    for tr in trs:  # the split API
        tr.forward(x, episode_starts=s)
        tr.backward_step(d)
    assert rel(nets[0].arena, nets[1].arena) <= 1e-5
    assert rel(trs[0].state.ssm, trs[1].state.ssm) <= 1e-4
    path = save_checkpoint(tmp_path / "m3cpu.safetensors", trs[0])
    other = MambaTrainer(MambaBackbone(cfg, IN, backend="cpu", seed=7), batch=B, seq_len=T, lr=1e-3,
                         max_grad_norm=0.5, weight_decay=0.1)
    load_checkpoint(path, other)
    for x, d, s in data[4:]:
        for tr in (trs[0], other):
            tr.step(x, d, episode_starts=s)
    assert torch.equal(trs[0].net.arena, other.net.arena)
    assert torch.equal(trs[0].exp_avg_sq, other.exp_avg_sq)
    assert torch.equal(trs[0].state.conv, other.state.conv) and torch.equal(trs[0].state.ssm, other.state.ssm)


def test_no_decay_group_is_the_seeds():
    """AdamW's no-decay group (the arena tail after n_decay): dt_bias, D, every norm scale and every bias,
    B_bias and C_bias included; nothing else."""
    net = MambaBackbone(m3cfg(is_outproj_norm=True), IN, backend="cpu")
    tail = {n for n, p in net.named_parameters() if (p.data_ptr() - net.arena.data_ptr()) // 4 >= net.n_decay}
    want = {"input_proj.bias", "norm_f.weight"} | {
        f"layers.{i}.{k}" for i in range(2) for k in ("norm.weight", "mixer.dt_bias", "mixer.B_bias", "mixer.C_bias",
                                                         "mixer.B_norm.weight", "mixer.C_norm.weight", "mixer.D",
                                                         "mixer.norm.weight")}
    assert tail == want


def test_backend_choice_and_fallbacks(monkeypatch):
    """auto -> cpu where the kernels built; the reference runs (and agrees) where they do not apply: a
    bf16 compute copy, swapped-in parameters, a gradient into the initial state, frozen parameters."""
    net = MambaBackbone(m3cfg(), IN)
    assert net.backend == "cpu" and net.kernel_support("sequence") and net.kernel_support("step")
    assert not net.kernel_support("scan")
    with pytest.raises(ValueError, match="backend='cuda' needs a CUDA device"):
        MambaBackbone(m3cfg(), IN, backend="cuda")
    with pytest.raises(ValueError, match="float32 masters"):
        MambaBackbone(m3cfg(), IN, backend="cpu", dtype=F64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, IN, generator=g)
    y, fin = net(x)
    assert y.grad_fn is not None and type(y.grad_fn).__name__ == "_M3BackboneBackward"
    # initial state with grad: the reference math (autograd), same numbers
    s0 = net.initial_state(2)
    s0 = Mamba3State(s0.conv.requires_grad_(), s0.ssm.requires_grad_())
    y2, _ = net(x, s0)
    assert type(y2.grad_fn).__name__ != "_M3BackboneBackward" and rel(y2, y) <= 1e-5
    y2.sum().backward()
    assert s0.ssm.grad is not None and torch.isfinite(s0.ssm.grad).all()
    # a bf16 compute copy: the CPU kernels are float32 only, the reference runs
    net.set_compute_dtype(torch.bfloat16)
    assert not net.kernel_support("sequence") and "float32" in net.kernel_support("sequence").reason
    net.set_compute_dtype(torch.float32)


def test_auto_falls_back_to_the_reference_with_one_warning(monkeypatch):
    from mamba_rl.model import mamba3 as m3
    from mamba_rl.ops import extension as ext
    monkeypatch.setattr(ext, "_LOADED", {})
    monkeypatch.setattr(ext, "_ERRORS", {"cpu": ext.BuildError("cpu", "no C++ compiler found (looked for 'c++')",
                                                                "install a C++ compiler with OpenMP")})
    monkeypatch.setattr(m3, "_WARNED", set())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        a = MambaBackbone(m3cfg(), IN)
        b = MambaBackbone(m3cfg(), IN)
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert a.backend == b.backend == "reference"
    assert len(msgs) == 1 and "no C++ compiler" in msgs[0] and "Mamba3" in msgs[0], msgs
    with pytest.raises(RuntimeError, match="cpu kernels could not load"):
        MambaBackbone(m3cfg(), IN, backend="cpu")
