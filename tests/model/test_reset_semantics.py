"""Reset semantics of the reference backbone (docs/architecture.md, "Reset semantics"), in float64.

- gradcheck of the whole backbone (every parameter, x and the initial state) with resets;
- a sequence with episode starts equals running each episode on its own from a zero state (the first
  segment from initial_state), for start patterns at t=0, t=T-1, every step, adjacent, none;
- the ops' final conv window / SSM state equal those of the independent runs.
"""

import zlib

import pytest
import torch

from mamba_rl import (
    MambaBackbone,
    MambaConfig,
    MambaTrainer,
    RecurrentState,
)
from mamba_rl.ops import causal_conv1d_ref, selective_scan_ref
from tests.helpers import F64, IN, make_net, per_episode_oracle, rand_state

torch.set_default_dtype(torch.float32)


def tiny(seed=0, d_model=8, n_layers=2, d_state=4, d_conv=4, input_dim=3):
    cfg = MambaConfig(d_model=d_model, n_layers=n_layers, d_state=d_state, d_conv=d_conv, expand=2)
    return MambaBackbone(cfg, input_dim, seed=seed, backend="reference", dtype=torch.float64)


def random_state(net, B, gen):
    s = net.initial_state(B)
    return RecurrentState(torch.randn(s.conv.shape, generator=gen, dtype=torch.float64),
                          torch.randn(s.ssm.shape, generator=gen, dtype=torch.float64))


def start_patterns(B, T, gen):
    pats = {
        "none": torch.zeros(B, T, dtype=torch.bool),
        "t0": torch.zeros(B, T, dtype=torch.bool),
        "last": torch.zeros(B, T, dtype=torch.bool),
        "every": torch.ones(B, T, dtype=torch.bool),
        "adjacent": torch.zeros(B, T, dtype=torch.bool),
        "random": torch.rand(B, T, generator=gen) < 0.25,
    }
    pats["t0"][:, 0] = True
    pats["last"][:, T - 1] = True
    pats["adjacent"][:, T // 2:T // 2 + 2] = True
    mixed = torch.rand(B, T, generator=gen) < 0.3
    mixed[0] = False  # a row with no start at all
    pats["mixed_rows"] = mixed
    return pats


@pytest.mark.parametrize("pattern", ["none", "t0", "last", "every", "adjacent", "random", "mixed_rows"])
def test_sequence_equals_independent_episodes(pattern):
    gen = torch.Generator().manual_seed(zlib.crc32(pattern.encode()) % 1000)  # the same in every process
    net = tiny()
    B, T = 3, 11
    x = torch.randn(B, T, 3, generator=gen, dtype=torch.float64)
    init = random_state(net, B, gen)
    starts = start_patterns(B, T, gen)[pattern]
    y, final = net(x, init, starts)
    for b in range(B):
        cut = [0] + [t for t in range(T) if starts[b, t] and t > 0] + [T]
        for i in range(len(cut) - 1):
            lo, hi = cut[i], cut[i + 1]
            if lo == hi:
                continue
            from_init = lo == 0 and not starts[b, 0]
            st = init.index(slice(b, b + 1)) if from_init else None
            yi, fi = net(x[b:b + 1, lo:hi], st, None)
            torch.testing.assert_close(y[b:b + 1, lo:hi], yi, rtol=1e-12, atol=1e-12)
            if hi == T:
                torch.testing.assert_close(final.conv[:, b:b + 1], fi.conv, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(final.ssm[:, b:b + 1], fi.ssm, rtol=1e-12, atol=1e-12)


def test_output_depends_only_on_own_episode():
    """Changing inputs before the latest start of a row leaves outputs after it unchanged."""
    gen = torch.Generator().manual_seed(3)
    net = tiny()
    x = torch.randn(2, 12, 3, generator=gen, dtype=torch.float64)
    starts = torch.zeros(2, 12, dtype=torch.bool)
    starts[0, 5] = True
    y1, f1 = net(x, random_state(net, 2, gen), starts)
    x2 = x.clone()
    x2[0, :5] = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    y2, f2 = net(x2, random_state(net, 2, gen), starts)
    torch.testing.assert_close(y1[0, 5:], y2[0, 5:], rtol=0, atol=0)
    torch.testing.assert_close(f1.ssm[:, 0], f2.ssm[:, 0], rtol=0, atol=0)
    assert not torch.allclose(y1[1], y2[1])  # row 1 has no start: its initial state matters


def test_gradcheck_backbone_with_resets_and_initial_state():
    gen = torch.Generator().manual_seed(0)
    net = tiny(d_model=4, n_layers=2, d_state=2, d_conv=3, input_dim=2)
    B, T = 2, 5
    x = torch.randn(B, T, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    init = random_state(net, B, gen)
    init.conv.requires_grad_()
    init.ssm.requires_grad_()
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[0, 2] = True
    starts[1, 0] = True
    names = [n for n, _ in net.named_parameters()]
    params = [p for _, p in net.named_parameters()]

    def f(x, conv, ssm, *ps):
        return torch.func.functional_call(net, dict(zip(names, ps)), (x, RecurrentState(conv, ssm), starts))[0]

    inputs = (x, init.conv, init.ssm) + tuple(p.detach().clone().requires_grad_() for p in params)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_conv_final_window_after_late_start():
    gen = torch.Generator().manual_seed(1)
    B, T, D, K = 2, 6, 5, 4
    x = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    w = torch.randn(D, K, generator=gen, dtype=torch.float64)
    b = torch.randn(D, generator=gen, dtype=torch.float64)
    st = torch.randn(B, D, K - 1, generator=gen, dtype=torch.float64)
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[0, T - 1] = True
    _, final = causal_conv1d_ref(x, w, b, st, starts)
    assert torch.equal(final[0, :, :2], torch.zeros(D, 2, dtype=torch.float64))
    assert torch.equal(final[0, :, 2], x[0, T - 1])
    assert torch.equal(final[1], x[1, T - 3:].T)


def test_conv_matches_torch_conv1d_without_resets():
    gen = torch.Generator().manual_seed(2)
    B, T, D, K = 2, 9, 6, 4
    x = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    w = torch.randn(D, K, generator=gen, dtype=torch.float64)
    b = torch.randn(D, generator=gen, dtype=torch.float64)
    out, _ = causal_conv1d_ref(x, w, b)
    ref = torch.nn.functional.conv1d(x.transpose(1, 2), w.unsqueeze(1), b, padding=K - 1, groups=D)[..., :T]
    torch.testing.assert_close(out, torch.nn.functional.silu(ref).transpose(1, 2), rtol=1e-12, atol=1e-12)


def test_scan_reset_zeroes_state():
    gen = torch.Generator().manual_seed(4)
    B, T, D, N = 2, 4, 3, 2
    args = [torch.randn(B, T, D, generator=gen, dtype=torch.float64) for _ in range(2)]
    A_log = torch.randn(D, N, generator=gen, dtype=torch.float64)
    Bm, Cm = (torch.randn(B, T, N, generator=gen, dtype=torch.float64) for _ in range(2))
    Dp, bias = torch.randn(D, generator=gen, dtype=torch.float64), torch.randn(D, generator=gen, dtype=torch.float64)
    z = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    s0 = torch.randn(B, D, N, generator=gen, dtype=torch.float64)
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[:, 0] = True
    y1, f1 = selective_scan_ref(args[0], args[1], A_log, Bm, Cm, Dp, z, bias, s0, starts)
    y2, f2 = selective_scan_ref(args[0], args[1], A_log, Bm, Cm, Dp, z, bias, None, None)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    torch.testing.assert_close(f1, f2, rtol=0, atol=0)


# ---- edge cases: bad inputs, resets, numerics, interplay with plain torch




PATTERNS = {
    "none": lambda B, T, g: torch.zeros(B, T, dtype=torch.bool),
    "t0": lambda B, T, g: torch.zeros(B, T, dtype=torch.bool).index_fill_(1, torch.tensor([0]), True),
    "last": lambda B, T, g: torch.zeros(B, T, dtype=torch.bool).index_fill_(1, torch.tensor([T - 1]), True),
    "every": lambda B, T, g: torch.ones(B, T, dtype=torch.bool),
    "adjacent": lambda B, T, g: torch.zeros(B, T, dtype=torch.bool).index_fill_(1, torch.tensor([2, 3, 4]), True),
    "random": lambda B, T, g: torch.rand(B, T, generator=g) < 0.3,
    "per_row": lambda B, T, g: torch.stack([torch.zeros(T, dtype=torch.bool), torch.ones(T, dtype=torch.bool),
                                            torch.arange(T) % 2 == 1, torch.arange(T) == T - 2]),
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("d_conv", [1, 3, 6])
def test_resets_equal_independent_episodes_f64(pattern, d_conv):
    cfg = MambaConfig(d_model=8, n_layers=2, d_state=4, d_conv=d_conv, expand=2)
    net = make_net(cfg, dtype=F64)
    g = torch.Generator().manual_seed(1)
    B, T = 4, 9
    x = torch.randn(B, T, IN, generator=g, dtype=F64)
    starts = PATTERNS[pattern](B, T, g)
    init = rand_state(net, B, g)
    y, fin = net(x, initial_state=init, episode_starts=starts)
    y_ref, fin_ref = per_episode_oracle(net, x, starts, init)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fin.conv, fin_ref.conv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fin.ssm, fin_ref.ssm, rtol=1e-12, atol=1e-12)


def test_output_before_start_does_not_leak_f64():
    """Perturbing x before a row's reset (and its initial state) changes nothing at or after the reset."""
    net = make_net(MambaConfig(d_model=8, n_layers=2, d_state=4, d_conv=4), dtype=F64)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 10, IN, generator=g, dtype=F64)
    starts = torch.zeros(2, 10, dtype=torch.bool)
    starts[0, 5] = True
    init = rand_state(net, 2, g)
    y, fin = net(x, init, starts)
    x2 = x.clone()
    x2[0, :5] += 10.0
    init2 = init.clone()
    init2.ssm[:, 0] += 5.0
    init2.conv[:, 0] += 5.0
    y2, fin2 = net(x2, init2, starts)
    assert torch.equal(y[0, 5:], y2[0, 5:]) and torch.equal(y[1], y2[1])
    assert not torch.equal(y[0, :5], y2[0, :5])
    assert torch.equal(fin.ssm[:, 0], fin2.ssm[:, 0]) and torch.equal(fin.conv[:, 0], fin2.conv[:, 0])


@pytest.mark.parametrize("B,T", [(1, 1), (1, 7), (3, 1)])
def test_tiny_shapes_equal_oracle(B, T):
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, IN, generator=g, dtype=F64)
    starts = torch.rand(B, T, generator=g) < 0.5
    init = rand_state(net, B, g)
    y, fin = net(x, init, starts)
    y_ref, fin_ref = per_episode_oracle(net, x, starts, init)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fin.ssm, fin_ref.ssm, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("splits", [[1] * 12, [2, 1, 9], [5, 7], [1, 11], [11, 1], [3, 3, 3, 3]])
def test_chunked_forward_equals_one_pass_f64(splits):
    cfg = MambaConfig(d_model=8, n_layers=2, d_state=4, d_conv=5, expand=2)  # chunks shorter than d_conv-1
    net = make_net(cfg, dtype=F64)
    g = torch.Generator().manual_seed(4)
    B, T = 3, 12
    x = torch.randn(B, T, IN, generator=g, dtype=F64)
    starts = torch.rand(B, T, generator=g) < 0.25
    init = rand_state(net, B, g)
    y, fin = net(x, init, starts)
    st, ys, t = init, [], 0
    for n in splits:
        yc, st = net(x[:, t:t + n], st, starts[:, t:t + n])
        ys.append(yc)
        t += n
    torch.testing.assert_close(torch.cat(ys, 1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.conv, fin.conv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.ssm, fin.ssm, rtol=1e-12, atol=1e-12)


def test_stepper_equals_forward_f64_with_resets_and_initial_state():
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(5)
    B, T = 3, 10
    x = torch.randn(B, T, IN, generator=g, dtype=F64)
    starts = torch.rand(B, T, generator=g) < 0.3
    starts[:, -1] = True
    init = rand_state(net, B, g)
    y, fin = net(x, init, starts)
    st = net.stepper(B)
    st.load_state(init)
    ys = [st.step(x[:, t], episode_starts=starts[:, t]).clone() for t in range(T)]
    torch.testing.assert_close(torch.stack(ys, 1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.get_state().ssm, fin.ssm, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.get_state().conv, fin.conv, rtol=1e-12, atol=1e-12)


def test_stepper_reset_mask_equals_episode_start():
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 6, IN, generator=g, dtype=F64)
    a, b = net.stepper(2), net.stepper(2)
    for t in range(3):
        a.step(x[:, t])
        b.step(x[:, t])
    a.reset(torch.tensor([True, False]))
    for t in range(3, 6):
        ya = a.step(x[:, t])
        yb = b.step(x[:, t], episode_starts=torch.tensor([t == 3, False]))
        assert torch.equal(ya, yb)


def test_stepper_sees_weight_updates_in_place():
    net = make_net()
    tr = MambaTrainer(net, batch=2, seq_len=4, lr=1e-2, dtype="bf16")
    st = net.stepper(2)
    x = torch.randn(2, IN)
    y0 = st.step(x).clone()
    st.reset()
    tr.step(torch.randn(2, 4, IN), torch.randn(2, 4, 8))
    y1 = st.step(x).clone()
    assert not torch.equal(y0, y1)
    fresh = net.stepper(2)
    assert torch.equal(fresh.step(x), y1)  # reads the refreshed bf16 compute copy


def test_non_contiguous_and_expanded_x_f64():
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(7)
    base = torch.randn(IN, 6, 2, generator=g, dtype=F64)
    x_nc = base.permute(2, 1, 0)  # [2, 6, IN], non-contiguous
    assert not x_nc.is_contiguous()
    starts_nc = (torch.rand(6, 2, generator=g) < 0.3).t()
    y, fin = net(x_nc, episode_starts=starts_nc)
    y_c, fin_c = net(x_nc.contiguous(), episode_starts=starts_nc.contiguous())
    assert torch.equal(y, y_c) and torch.equal(fin.ssm, fin_c.ssm)
    x_exp = torch.randn(1, 1, IN, generator=g, dtype=F64).expand(2, 6, IN)  # stride-0 view
    y_e, _ = net(x_exp)
    assert torch.equal(y_e, net(x_exp.contiguous())[0])
    x_str = torch.randn(2, 12, IN, generator=g, dtype=F64)[:, ::2]  # strided in T
    assert torch.equal(net(x_str)[0], net(x_str.contiguous())[0])
    # a non-contiguous initial state
    init = rand_state(net, 2, g)
    init_nc = RecurrentState(init.conv.transpose(2, 3).contiguous().transpose(2, 3),
                             init.ssm.transpose(0, 1).contiguous().transpose(0, 1))
    assert torch.equal(net(x_nc, init_nc)[0], net(x_nc, init)[0])


def test_initial_state_given_equals_carried():
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 8, IN, generator=g, dtype=F64)
    _, st = net(x[:, :4])
    y_given, _ = net(x[:, 4:], initial_state=st)
    y_all, _ = net(x)
    torch.testing.assert_close(y_given, y_all[:, 4:], rtol=1e-12, atol=1e-12)
    zero = net.initial_state(2)
    assert torch.equal(net(x, initial_state=zero)[0], net(x)[0])


def test_long_sequence_chunked_and_finite():
    cfg = MambaConfig(d_model=4, n_layers=1, d_state=2, d_conv=4, expand=1)
    net = make_net(cfg, input_dim=2)
    g = torch.Generator().manual_seed(9)
    T = 2048
    x = torch.randn(1, T, 2, generator=g) * 3
    starts = torch.zeros(1, T, dtype=torch.bool)
    starts[0, 1500] = True
    y, fin = net(x, episode_starts=starts)
    assert torch.isfinite(y).all() and torch.isfinite(fin.ssm).all()
    y1, st = net(x[:, :1024], episode_starts=starts[:, :1024])
    y2, st = net(x[:, 1024:], st, starts[:, 1024:])
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st.ssm, fin.ssm, rtol=1e-5, atol=1e-5)
    # after the reset, equal to a fresh run of the tail
    y_tail, _ = net(x[:, 1500:])
    torch.testing.assert_close(y[:, 1500:], y_tail, rtol=1e-5, atol=1e-5)


def test_grad_flows_into_initial_state_only_when_asked():
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 5, IN, generator=g, dtype=F64, requires_grad=True)
    init = rand_state(net, 2, g)
    init.ssm.requires_grad_()
    starts = torch.zeros(2, 5, dtype=torch.bool)
    starts[1, 0] = True  # row 1 starts fresh: no gradient into its initial state
    y, _ = net(x, init, starts)
    y.square().sum().backward()
    assert init.ssm.grad[:, 0].abs().sum() > 0 and torch.equal(init.ssm.grad[:, 1], torch.zeros_like(init.ssm.grad[:, 1]))
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_gradcheck_x_and_state_small():
    cfg = MambaConfig(d_model=4, n_layers=1, d_state=2, d_conv=2, expand=1)
    net = make_net(cfg, dtype=F64, input_dim=2)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 2, generator=g, dtype=F64, requires_grad=True)
    init = rand_state(net, 2, g)
    conv = init.conv.clone().requires_grad_()
    ssm = init.ssm.clone().requires_grad_()
    starts = torch.tensor([[False, True, False], [False, False, True]])
    assert torch.autograd.gradcheck(lambda a, c, s: net(a, RecurrentState(c, s), starts)[0], (x, conv, ssm))


@pytest.mark.parametrize("where", ["x_nan", "x_inf", "init_ssm_nan", "init_conv_nan"])
def test_nonfinite_does_not_leak_across_reset(where):
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(19)
    x = torch.randn(2, 6, IN, generator=g, dtype=F64)
    starts = torch.zeros(2, 6, dtype=torch.bool)
    starts[:, 3] = True
    init = net.initial_state(2)
    if where == "x_nan":
        x[0, 1] = float("nan")
    elif where == "x_inf":
        x[0, 1] = float("inf")
    elif where == "init_ssm_nan":
        init.ssm[:, 0] = float("nan")
    else:
        init.conv[:, 0] = float("nan")
    y, fin = net(x, init, starts)
    assert torch.isfinite(y[0, 3:]).all()
    assert torch.isfinite(fin.ssm).all() and torch.isfinite(fin.conv).all()


def test_nonfinite_row_does_not_touch_other_rows():
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(20)
    x = torch.randn(3, 6, IN, generator=g, dtype=F64)
    y_ref, _ = net(x)
    x[1, 2] = float("nan")
    y, fin = net(x)
    assert torch.equal(y[0], y_ref[0]) and torch.equal(y[2], y_ref[2])
    assert torch.isfinite(fin.ssm[:, [0, 2]]).all()


@pytest.mark.parametrize("cfg", [
    MambaConfig(d_model=1, n_layers=1, d_state=1, d_conv=1, expand=1),
    MambaConfig(d_model=2, n_layers=1, d_state=1, d_conv=16, expand=1, dt_rank=2),
    MambaConfig(d_model=4, n_layers=1, d_state=3, d_conv=2, expand=3, dt_rank=12),
], ids=["all_ones", "dconv16", "dt_rank_max"])
def test_extreme_configs_equal_oracle_and_stepper(cfg):
    net = make_net(cfg, dtype=F64, input_dim=1)
    g = torch.Generator().manual_seed(22)
    x = torch.randn(3, 7, 1, generator=g, dtype=F64)
    starts = torch.rand(3, 7, generator=g) < 0.3
    init = rand_state(net, 3, g)
    y, fin = net(x, init, starts)
    assert torch.isfinite(y).all()
    y_ref, fin_ref = per_episode_oracle(net, x, starts, init)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fin.conv, fin_ref.conv, rtol=1e-12, atol=1e-12)
    st = net.stepper(3)
    st.load_state(init)
    ys = torch.stack([st.step(x[:, t], starts[:, t]).clone() for t in range(7)], 1)
    torch.testing.assert_close(ys, y, rtol=1e-12, atol=1e-12)


def test_starts_none_equals_all_false():
    net = make_net(dtype=F64)
    x = torch.randn(2, 5, IN, dtype=F64)
    init = rand_state(net, 2, torch.Generator().manual_seed(23))
    a, fa = net(x, init)
    b, fb = net(x, init, torch.zeros(2, 5, dtype=torch.bool))
    assert torch.equal(a, b) and torch.equal(fa.conv, fb.conv) and torch.equal(fa.ssm, fb.ssm)
