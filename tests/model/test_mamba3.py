"""Mamba-3 (SISO) reference backbone, ``MambaConfig(layer="Mamba3")`` (mamba_rl/model/mamba3.py).

- config: every Mamba-3 field validated (expected vs received), to_dict/from_dict round trip, old dicts load;
- the recurrence equals an independent parallel (quadratic, complex-rotation) form, initial state included;
- float64 gradcheck of the whole backbone (every parameter, x, the initial state) with resets;
- a sequence with episode starts equals independent per-episode runs, for every reset pattern; a NaN of an
  old episode never leaks; stepper == forward over T = 1000 with resets; chunked forward == one forward;
- the arena's no-decay group, the trainer's step / forward / backward_step, checkpoints with the Mamba-3
  state, the backend choice;
- (slow) the running parity of 0/1 inputs at T = 64, learned by a small Mamba-3 with the trainer, Mamba-1
  beside it.
"""
import math
import time
import warnings

import pytest
import torch

from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer, RecurrentState, load_checkpoint, save_checkpoint
from mamba_rl.model.mamba3 import Mamba3Backbone, Mamba3State, m3_is_no_decay, m3_param_layout
from mamba_rl.ops.mamba3_ref import mamba3_scan_ref, mamba3_step_ref
from mamba_rl.train.checkpoint import CheckpointError
from tests.helpers import F64, per_episode_oracle

IN = 3


def m3cfg(**kw):
    base = dict(layer="Mamba3", d_model=4, n_layers=2, d_state=4, expand=2, headdim=2)
    base.update(kw)
    return MambaConfig(**base)


def m3net(seed=0, dtype=F64, input_dim=IN, **kw):
    return MambaBackbone(m3cfg(**kw), input_dim, seed=seed, backend="reference", dtype=dtype)


def rand_state(net, B, gen, scale=0.5):
    s = net.initial_state(B)
    return Mamba3State(torch.randn(s.conv.shape, generator=gen, dtype=s.conv.dtype) * scale,
                       torch.randn(s.ssm.shape, generator=gen, dtype=s.ssm.dtype) * scale)


def start_patterns(B, T, gen):
    pats = {name: torch.zeros(B, T, dtype=torch.bool) for name in ("none", "t0", "last", "adjacent")}
    pats["t0"][:, 0] = True
    pats["last"][:, T - 1] = True
    pats["adjacent"][:, T // 2:T // 2 + 2] = True
    pats["every"] = torch.ones(B, T, dtype=torch.bool)
    pats["random"] = torch.rand(B, T, generator=gen) < 0.3
    mixed = torch.rand(B, T, generator=gen) < 0.3
    mixed[0] = False  # one row without any start
    pats["mixed_rows"] = mixed
    return pats


PATTERNS = ["none", "t0", "last", "every", "adjacent", "random", "mixed_rows"]


# ------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kw, words", [
    (dict(layer="Mamba2"), ["layer", "('Mamba1', 'Mamba3')", "'Mamba2'"]),
    (dict(layer="Mamba3", headdim=48), ["headdim", "divide", "256", "48"]),
    (dict(headdim=0), ["headdim", "[1, 1024]", "0"]),
    (dict(headdim=True), ["headdim", "int", "True"]),
    (dict(rope_fraction=0.25), ["rope_fraction", "0.5 or 1.0", "0.25"]),
    (dict(dt_min=0.0), ["dt_min", "(0, 10)", "0.0"]),
    (dict(dt_max=float("nan")), ["dt_max", "(0, 10)", "nan"]),
    (dict(dt_min=0.05, dt_max=0.01), ["dt_max", ">= dt_min", "0.01"]),
    (dict(A_floor=1.5), ["A_floor", "(0, 1)", "1.5"]),
    (dict(A_activation="relu"), ["A_activation", "('heavy_tail', 'softplus')", "'relu'"]),
    (dict(is_outproj_norm=1), ["is_outproj_norm", "bool", "1"]),
    (dict(layer="Mamba3", d_state=3, headdim=64), ["d_state", "rotary angle", "3"]),
])
def test_config_errors_name_field_expected_and_received(kw, words):
    with pytest.raises(ValueError) as e:
        MambaConfig(**kw)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_config_round_trip_and_derived_sizes():
    c = MambaConfig(layer="Mamba3", d_model=12, d_state=10, expand=2, headdim=6, rope_fraction=0.5,
                    dt_min=2e-3, dt_max=0.2, A_floor=1e-3, is_outproj_norm=True)
    assert MambaConfig.from_dict(c.to_dict()) == c
    assert (c.d_inner, c.nheads, c.num_rope_angles) == (24, 4, 2)  # int(10 * 0.5) = 5 -> even 4 -> 2 pairs
    assert MambaConfig(layer="Mamba3", d_state=8, rope_fraction=1.0).num_rope_angles == 4
    # a Mamba-1 config saved before the Mamba-3 fields existed loads as today's default
    old = {k: v for k, v in MambaConfig().to_dict().items() if k in ("d_model", "n_layers", "d_state", "d_conv",
                                                                     "expand", "dt_rank", "rms_norm_eps")}
    assert MambaConfig.from_dict(old) == MambaConfig()
    with pytest.raises(ValueError, match="unknown fields"):
        MambaConfig.from_dict(dict(old, mimo_rank=4))


# ------------------------------------------------------------------------------------------- the op
def _parallel_form(q, k, v, adt, dt, trap, qb, kb, ang, D, z, state):
    """The SISO recurrence written as one causal sum (independent of the loop): rotations as complex
    multiplications of the pairs, the trapezoid as the weight of (k_s, v_s) on S_t."""
    B, T, H, N = q.shape
    R = ang.shape[-1]
    a0, S0, k0, v0 = state
    lam = torch.sigmoid(trap)
    theta = a0.unsqueeze(1) + torch.cumsum(math.pi * torch.tanh(ang) * dt.unsqueeze(-1), dim=1)  # [B, T, H, R]

    def rot(t):
        c = torch.view_as_complex(t[..., :2 * R].reshape(*t.shape[:-1], R, 2).contiguous())
        r = torch.view_as_real(c * torch.polar(torch.ones_like(theta), theta)).flatten(-2)
        return torch.cat((r, t[..., 2 * R:]), -1)

    qr, kr = rot(q + qb), rot(k + kb)
    cs = torch.cumsum(adt, dim=1)  # [B, T, H]
    tt = torch.arange(T)
    causal = tt[:, None] >= tt[None, :]
    decay = torch.exp((cs.unsqueeze(2) - cs.unsqueeze(1)).masked_fill(~causal[None, :, :, None], -math.inf))
    nxt = torch.cat(((1 - lam[:, 1:]) * dt[:, 1:], torch.zeros_like(dt[:, :1])), 1)  # (1-lam_{s+1}) dt_{s+1}
    wts = decay * ((lam * dt).unsqueeze(1) + nxt.unsqueeze(1) * (tt[:, None] > tt[None, :])[None, :, :, None])
    score = torch.einsum("bthn,bshn->btsh", qr, kr)
    y = torch.einsum("btsh,btsh,bshp->bthp", wts, score, v)
    S_init = S0 + ((1 - lam[:, 0]) * dt[:, 0])[..., None, None] * v0.unsqueeze(-1) * k0.unsqueeze(-2)
    y = y + torch.exp(cs)[..., None] * torch.einsum("bhpn,bthn->bthp", S_init, qr)
    y = (y + D[:, None] * v) * torch.nn.functional.silu(z)
    S_T = torch.einsum("bsh,bshp,bshn->bhpn", wts[:, -1], v, kr) + torch.exp(cs[:, -1])[..., None, None] * S_init
    return y, (torch.remainder(theta[:, -1], 2 * math.pi), S_T, kr[:, -1], v[:, -1])


def _op_inputs(gen, B=2, T=9, H=3, P=2, N=6, R=2):
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    adt = -torch.rand(B, T, H, generator=gen, dtype=F64)
    dt = torch.rand(B, T, H, generator=gen, dtype=F64) + 0.1
    args = (r(B, T, H, N), r(B, T, H, N), r(B, T, H, P), adt, dt, r(B, T, H), r(H, N), r(H, N), r(B, T, H, R) * 2,
            r(H), r(B, T, H, P))
    state = (r(B, H, R) * 3, r(B, H, P, N), r(B, H, N), r(B, H, P))
    return args, state


@pytest.mark.parametrize("R", [1, 3])  # some pairs rotated / all pairs rotated (N = 6)
def test_recurrence_equals_parallel_complex_form(R):
    gen = torch.Generator().manual_seed(10 + R)
    args, state = _op_inputs(gen, R=R)
    y, fin = mamba3_scan_ref(*args, state=state)
    y2, fin2 = _parallel_form(*args, state)
    torch.testing.assert_close(y, y2, rtol=1e-10, atol=1e-10)
    for a, b in zip(fin, fin2):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_op_reset_is_a_select_and_step_equals_scan():
    gen = torch.Generator().manual_seed(3)
    args, state = _op_inputs(gen)
    bad = tuple(torch.full_like(s, math.nan) for s in state)
    starts = torch.zeros(2, 9, dtype=torch.bool)
    starts[:, 0] = True
    y, fin = mamba3_scan_ref(*args, state=bad, episode_starts=starts)
    y0, fin0 = mamba3_scan_ref(*args, state=None)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, y0, rtol=0, atol=0)
    st = state
    for t in range(9):
        yt, st = mamba3_step_ref(*(a[:, t] if a.dim() > 2 else a for a in args), st)
        torch.testing.assert_close(yt, mamba3_scan_ref(*args, state=state)[0][:, t], rtol=1e-12, atol=1e-12)
    for a, b in zip(st, mamba3_scan_ref(*args, state=state)[1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"state.ssm: expected shape \[2, 3, 2, 6\]"):
        mamba3_scan_ref(*args, state=(state[0], state[1][:, :, :1], state[2], state[3]))


# ------------------------------------------------------------------------------------------- backbone
def test_backbone_layout_state_and_dispatch():
    net = m3net()
    assert isinstance(net, Mamba3Backbone) and isinstance(net, MambaBackbone) and net.backend == "reference"
    c = net.cfg
    s = net.initial_state(5)
    assert isinstance(s, Mamba3State) and isinstance(s, RecurrentState)
    R, N, P, H = c.num_rope_angles, c.d_state, c.headdim, c.nheads
    assert s.conv.shape == (2, 5, H, R + N + P) and s.ssm.shape == (2, 5, c.d_inner, N)
    assert (s.angle.shape, s.k.shape, s.v.shape, s.ssm_heads.shape) == \
        ((2, 5, H, R), (2, 5, H, N), (2, 5, H, P), (2, 5, H, P, N))
    assert type(s.clone()) is Mamba3State and type(s.index(slice(0, 2))) is Mamba3State
    names = [n for n, _ in m3_param_layout(c, IN)]
    no_decay = {n for n in names if m3_is_no_decay(n)}
    assert no_decay == {"input_proj.bias", "norm_f.weight"} | {
        f"layers.{i}.{k}" for i in range(2) for k in ("norm.weight", "mixer.dt_bias", "mixer.B_bias", "mixer.C_bias",
                                                         "mixer.B_norm.weight", "mixer.C_norm.weight", "mixer.D")}
    # decay group first: everything after n_decay is the no-decay group
    for n, p in net.named_parameters():
        off = p.data_ptr() - net.arena.data_ptr()
        assert (off // p.element_size() >= net.n_decay) == (n in no_decay), n
    # mamba_ssm init: ones, the dt range, the rescaled out_proj
    mx = net.layers[0].mixer
    for t in (mx.B_bias, mx.C_bias, mx.D, mx.B_norm.weight, mx.C_norm.weight):
        assert torch.equal(t, torch.ones_like(t))
    dt = torch.nn.functional.softplus(mx.dt_bias)
    assert ((dt >= 1e-3 - 1e-12) & (dt <= 0.1 + 1e-12)).all()
    assert mx.out_proj.weight.abs().max() <= 1 / math.sqrt(c.d_inner) / math.sqrt(2)
    assert net.layers[0].mixer.in_proj.weight.shape == (2 * c.d_inner + 2 * N + 3 * H + R, c.d_model)
    assert "norm" in dict(m3net(is_outproj_norm=True).layers[0].mixer.named_children())


def test_backend_choice():
    """Mamba-3's kernel backends (tests/model/test_mamba3_cpu.py, test_mamba3_cuda.py) need their device;
    float64 masters run the reference without a warning."""
    with pytest.raises(ValueError, match="backend='cuda' needs a CUDA device, got cpu"):
        MambaBackbone(m3cfg(), IN, backend="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert MambaBackbone(m3cfg(), IN, backend="auto", dtype=F64).backend == "reference"


@pytest.mark.parametrize("kw", [dict(n_layers=2), dict(n_layers=1, rope_fraction=1.0, is_outproj_norm=True)])
def test_gradcheck_backbone_with_resets_and_initial_state(kw):
    gen = torch.Generator().manual_seed(0)
    net = m3net(input_dim=2, d_model=2, **kw)  # d_inner 4: 2 heads of 2, d_state 4
    B, T = 2, 4
    x = torch.randn(B, T, 2, generator=gen, dtype=F64, requires_grad=True)
    init = rand_state(net, B, gen)
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[0, 2] = True
    starts[1, 0] = True
    names = [n for n, _ in net.named_parameters()]
    params = [p for _, p in net.named_parameters()]

    def f(x, carry, ssm, *ps):
        feat, fin = torch.func.functional_call(net, dict(zip(names, ps)), (x, Mamba3State(carry, ssm), starts))
        return feat, fin.ssm, fin.k, fin.v

    inputs = (x, init.conv.requires_grad_(), init.ssm.requires_grad_()) + tuple(
        p.detach().clone().requires_grad_() for p in params)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_sequence_equals_independent_episodes(pattern):
    gen = torch.Generator().manual_seed(PATTERNS.index(pattern))
    net = m3net(d_state=6, headdim=4)
    B, T = 3, 11
    x = torch.randn(B, T, IN, generator=gen, dtype=F64)
    init = rand_state(net, B, gen)
    starts = start_patterns(B, T, gen)[pattern]
    y, final = net(x, init, starts)
    y_ref, final_ref = per_episode_oracle(net, x, starts, init)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final.conv, final_ref.conv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final.ssm, final_ref.ssm, rtol=1e-12, atol=1e-12)
    if pattern != "none":  # the pattern matters: without the starts the result differs
        assert not torch.allclose(y, net(x, init)[0])


def test_nan_of_an_old_episode_never_leaks():
    gen = torch.Generator().manual_seed(4)
    net = m3net()
    B, T = 2, 8
    x = torch.randn(B, T, IN, generator=gen, dtype=F64)
    x[0, :3] = math.nan  # row 0's first episode is poisoned
    init = rand_state(net, B, gen)
    init.conv[:, 1] = math.inf  # row 1's carried state is poisoned
    init.ssm[:, 1] = math.nan
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[0, 3] = True
    starts[1, 0] = True
    y, final = net(x, init, starts)
    assert torch.isfinite(y[0, 3:]).all() and torch.isfinite(y[1]).all()
    assert torch.isfinite(final.conv).all() and torch.isfinite(final.ssm).all()
    torch.testing.assert_close(y[0, 3:], net(x[:1, 3:])[0][0], rtol=0, atol=0)
    # the stepper's reset is a select too
    st = net.initial_state(B)
    st.conv.fill_(math.nan)
    out = net.step(x[:, 4], st, torch.ones(B, dtype=torch.bool))
    assert torch.isfinite(out).all()


def test_stepper_equals_forward_over_1000_steps_with_resets():
    gen = torch.Generator().manual_seed(5)
    net = m3net(n_layers=2, d_model=4, d_state=4, headdim=4)
    B, T = 2, 1000
    x = torch.randn(B, T, IN, generator=gen, dtype=F64)
    starts = torch.rand(B, T, generator=gen) < 0.02
    starts[0, 0] = True
    starts[1, 500:502] = True
    init = rand_state(net, B, gen)
    with torch.no_grad():
        y, final = net(x, init, starts)
    stp = net.stepper(B)
    stp.load_state(init)
    ys = torch.stack([stp.step(x[:, t], starts[:, t]).clone() for t in range(T)], 1)
    torch.testing.assert_close(ys, y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(stp.state.ssm, final.ssm, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(stp.state.k, final.k, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(stp.state.v, final.v, rtol=1e-10, atol=1e-10)
    d = torch.remainder(stp.state.angle - final.angle + math.pi, 2 * math.pi) - math.pi  # circular difference
    assert d.abs().max() < 1e-9
    assert ((final.angle >= 0) & (final.angle < 2 * math.pi)).all()
    # chunks handing the state on equal the one forward
    with torch.no_grad():
        s, parts = init, []
        for lo, hi in ((0, 1), (1, 300), (300, 301), (301, 1000)):
            yc, s = net(x[:, lo:hi], s, starts[:, lo:hi])
            parts.append(yc)
    torch.testing.assert_close(torch.cat(parts, 1), y, rtol=1e-10, atol=1e-10)


def test_float32_matches_float64():
    gen = torch.Generator().manual_seed(6)
    n64, n32 = m3net(dtype=F64), m3net(dtype=torch.float32)
    x = torch.randn(2, 16, IN, generator=gen, dtype=F64)
    starts = torch.rand(2, 16, generator=gen) < 0.2
    y64, _ = n64(x, None, starts)
    y32, _ = n32(x.float(), None, starts)
    torch.testing.assert_close(y32.double(), y64, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------- trainer
def _trainer(seed=0, **kw):
    net = MambaBackbone(m3cfg(d_model=8, headdim=4), IN, seed=seed, backend="reference")
    return MambaTrainer(net, batch=2, seq_len=6, lr=1e-2, **kw)


def test_trainer_step_equals_forward_plus_backward_step_and_lowers_the_loss():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 6, IN, generator=gen)
    target = torch.randn(2, 6, 8, generator=gen)
    starts = torch.zeros(2, 6, dtype=torch.bool)
    starts[1, 3] = True
    a, b = _trainer(), _trainer()
    losses = []
    for _ in range(5):
        feat = a.forward(x, a.net.initial_state(2), starts).requires_grad_()
        loss = 0.5 * (feat - target).pow(2).sum()
        loss.backward()
        losses.append(loss.item())
        a.backward_step(feat.grad)
        with torch.no_grad():
            fb, _ = b.net(x, None, starts)
        b.step(x, fb - target, b.net.initial_state(2), starts)
        torch.testing.assert_close(a.net.arena, b.net.arena, rtol=1e-6, atol=1e-7)
    assert losses[-1] < losses[0]
    assert type(a.state) is Mamba3State and a.state.ssm.abs().sum() > 0


def test_trainer_bf16_compute_copy_runs_close_to_f32():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 6, IN, generator=gen)
    d = torch.randn(2, 6, 8, generator=gen)
    a, b = _trainer(), _trainer(dtype="bf16")
    fa, fb = a.forward(x), b.forward(x)
    assert fb.dtype == torch.float32 and torch.isfinite(fb).all()
    torch.testing.assert_close(fb, fa, rtol=0.05, atol=0.05)
    m = b.backward_step(d)
    assert math.isfinite(float(m.grad_norm)) and float(m.grad_norm) > 0
    torch.testing.assert_close(b.net.compute_arena.float(), b.net.arena, rtol=1e-2, atol=1e-2)  # refreshed by AdamW


def test_weight_decay_skips_the_no_decay_group():
    tr = _trainer(weight_decay=0.5)
    before = tr.net.arena.clone()
    tr.step(torch.zeros(2, 6, IN), torch.zeros(2, 6, 8))  # zero gradient: only the decay moves weights
    changed = tr.net.arena != before
    nd = tr.net.n_decay
    assert changed[:nd].any() and not changed[nd:].any()


def test_checkpoint_round_trip_with_mamba3_state(tmp_path):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 6, IN, generator=gen)
    d = torch.randn(2, 6, 8, generator=gen)
    a = _trainer(seed=1)
    for _ in range(2):
        a.step(x, d)
    assert a.state.conv.abs().sum() > 0 and a.state.ssm.abs().sum() > 0
    path = save_checkpoint(tmp_path / "m3.safetensors", a, extra={"note": "m3"})
    b = _trainer(seed=2)
    meta = load_checkpoint(path, b)
    assert meta["config"]["layer"] == "Mamba3" and meta["extra"] == {"note": "m3"}
    for t1, t2 in ((a.net.arena, b.net.arena), (a.exp_avg, b.exp_avg), (a.exp_avg_sq, b.exp_avg_sq),
                   (a.state.conv, b.state.conv), (a.state.ssm, b.state.ssm)):
        assert torch.equal(t1, t2)
    a.step(x, d)
    b.step(x, d)
    assert torch.equal(a.net.arena, b.net.arena) and torch.equal(a.state.conv, b.state.conv)
    # a Mamba-1 trainer refuses it, naming the configs
    m1 = MambaTrainer(MambaBackbone(MambaConfig(d_model=8, n_layers=2, d_state=4), IN, backend="reference"), 2, 6)
    with pytest.raises(CheckpointError, match="Mamba3"):
        load_checkpoint(path, m1)


def test_mamba1_state_dict_saved_before_the_mamba3_fields_still_loads():
    cfg = MambaConfig(d_model=8, n_layers=1, d_state=4)
    a = MambaTrainer(MambaBackbone(cfg, IN, seed=1, backend="reference"), 2, 6)
    a.step(torch.randn(2, 6, IN), torch.randn(2, 6, 8))
    sd = a.state_dict()
    sd["meta"]["config"] = {k: v for k, v in sd["meta"]["config"].items()
                            if k in ("d_model", "n_layers", "d_state", "d_conv", "expand", "dt_rank", "rms_norm_eps")}
    b = MambaTrainer(MambaBackbone(cfg, IN, seed=2, backend="reference"), 2, 6)
    b.load_state_dict(sd)
    assert torch.equal(a.net.arena, b.net.arena) and torch.equal(a.state.ssm, b.state.ssm)


# ------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reference_on_cuda_matches_float64_and_graphs_replay_eagerly():
    """The reference backend on a GPU (what layer='Mamba3' runs there until its kernels exist): f32 and the
    bf16 compute copy vs float64 (features, final state, gradients), stepper and trainer CUDA graphs
    replaying the eager steps bit for bit."""
    gen = torch.Generator().manual_seed(11)
    cfg = m3cfg(d_model=32, n_layers=2, d_state=16, headdim=16)
    B, T = 4, 65
    x = torch.randn(B, T, IN, generator=gen)
    starts = torch.rand(B, T, generator=gen) < 0.1
    g = torch.randn(B, T, 32, generator=gen)
    ref = MambaBackbone(cfg, IN, seed=3, backend="reference", dtype=F64)
    y_ref, f_ref = ref(x.double(), None, starts)
    (y_ref * g.double()).sum().backward()
    for dtype, tol in (("f32", 1e-4), ("bf16", 5e-2)):
        net = MambaBackbone(cfg, IN, device="cuda", seed=3, backend="reference")
        net.set_compute_dtype({"f32": torch.float32, "bf16": torch.bfloat16}[dtype])
        net.zero_grad()
        y, f = net(x.cuda(), None, starts.cuda())
        (y * g.cuda()).sum().backward()
        torch.testing.assert_close(y.double().cpu(), y_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(f.ssm.double().cpu(), f_ref.ssm, rtol=tol, atol=tol)
        gr = net.grad_arena.double().cpu()
        assert (gr - ref.grad_arena).norm() <= 10 * tol * ref.grad_arena.norm(), dtype
    # stepper graph == eager steps
    net = MambaBackbone(cfg, IN, device="cuda", seed=3, backend="reference")
    eager, graphed = net.stepper(B), net.stepper(B).capture_graph()
    for t in range(8):
        a = eager.step(x[:, t].cuda(), starts[:, t].cuda())
        b = graphed.step(x[:, t].cuda(), starts[:, t].cuda())
        assert torch.equal(a, b)
    assert torch.equal(eager.state.conv, graphed.state.conv) and torch.equal(eager.state.ssm, graphed.state.ssm)
    # trainer graph == eager trainer
    trs = [MambaTrainer(MambaBackbone(cfg, IN, device="cuda", seed=3, backend="reference"), B, T, lr=1e-3)
           for _ in range(2)]
    trs[1].capture_graph()
    for _ in range(3):
        ms = [tr.step(x.cuda(), g.cuda(), None, starts.cuda()) for tr in trs]
        assert ms[1].graph_replayed and not ms[0].graph_replayed
    assert torch.equal(trs[0].net.arena, trs[1].net.arena)
    assert torch.equal(trs[0].state.conv, trs[1].state.conv)


# ------------------------------------------------------------------------------------------- parity
def _parity_run(layer: str, seed: int = 0, max_steps: int = 1500, T: int = 64, B: int = 32, lr: float = 3e-3,
                **m3_kw):
    """Train backbone + a linear head with the trainer on the running count mod 2 of random 0/1 inputs
    (a label at every step); stop once a fresh batch of 256 sequences is >= 97% right. Returns (accuracy on
    512 fresh sequences over all T positions, steps, seconds)."""
    torch.manual_seed(seed)
    kw = dict(d_model=16, n_layers=1, d_state=8, expand=2)
    if layer == "Mamba3":
        kw.update(layer="Mamba3", **{"headdim": 8, **m3_kw})
    net = MambaBackbone(MambaConfig(**kw), 1, seed=seed, backend="reference")
    tr = MambaTrainer(net, batch=B, seq_len=T, lr=lr, max_grad_norm=1.0)
    head = torch.nn.Linear(16, 1)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1000 + seed)

    def data(n):
        bits = torch.randint(0, 2, (n, T, 1), generator=gen).float()
        return bits, bits.cumsum(1).remainder(2)

    def accuracy(n):
        x, y = data(n)
        with torch.no_grad():
            return ((head(net(x)[0]) > 0).float() == y).float().mean().item()

    t0 = time.time()
    step = 0
    while step < max_steps:
        x, y = data(B)
        feat = tr.forward(x, initial_state=net.initial_state(B)).requires_grad_()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head(feat), y)
        opt.zero_grad()
        loss.backward()
        m = tr.backward_step(feat.grad, extra_grad_sq=sum(p.grad.pow(2).sum() for p in head.parameters()))
        for p in head.parameters():
            p.grad.mul_(m.clip_coef.to(p.dtype))
        opt.step()
        step += 1
        if step % 50 == 0 and accuracy(256) >= 0.97:
            break
    return accuracy(512), step, time.time() - t0


@pytest.mark.slow
def test_parity_is_learned_by_mamba3_with_mamba1_beside_it(record_property):
    """Default Mamba-3 parameterisation (heavy-tail A, dt in [1e-3, 0.1]), d_model 16, 1 layer, d_state 8,
    4 heads of 8. Parity from scratch by gradient descent depends on the seed: a run can settle on angle
    steps that differ by pi/2 rather than pi between the bits, with a fast decay (measured on seeds 0-5, one
    thread, at most 1000 updates: 5 of 6 reached >= 0.97, seed 2 stayed at 0.53; A_activation="softplus" also
    5 of 6, in fewer updates; Mamba-1 0.56-0.62 on seeds 0-2). So seeds 0, 1, 2 are tried in order, at most
    1000 updates each, and the first that reaches 95% on fresh sequences counts. Mamba-1 (same width, d_state 8)
    gets that seed and the same budget (at most 1000 updates, the same early stop)."""
    tried = []
    for seed in (0, 1, 2):
        acc3, steps3, sec3 = _parity_run("Mamba3", seed=seed, max_steps=1000)
        tried.append((seed, acc3, steps3, sec3))
        if acc3 >= 0.95:
            break
    acc1, steps1, sec1 = _parity_run("Mamba1", seed=seed, max_steps=1000)
    print(f"\nparity T=64: Mamba-3 {acc3:.3f} (seed {seed}, {steps3} updates, {sec3:.0f} s; tried "
          f"{[(s, round(a, 3)) for s, a, _, _ in tried]}); Mamba-1 {acc1:.3f} ({steps1} updates, {sec1:.0f} s)")
    record_property("mamba3_accuracy", acc3)
    record_property("mamba1_accuracy", acc1)
    assert acc3 >= 0.95, f"Mamba-3 reached {[(s, round(a, 3)) for s, a, _, _ in tried]} (seed, accuracy)"
