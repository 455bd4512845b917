"""Reset semantics of the reference backbone (ARCHITECTURE.md section 3), in float64.

- gradcheck of the whole backbone (every parameter, x and the initial state) with resets;
- a sequence with episode starts equals running each episode on its own from a zero state (the first
  segment from initial_state), for start patterns at t=0, t=T-1, every step, adjacent, none;
- the ops' final conv window / SSM state equal those of the independent runs.
"""
import pytest
import torch

from mamba_rl import MambaBackbone, MambaConfig, RecurrentState
from mamba_rl.ops import causal_conv1d_ref, selective_scan_ref

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
    gen = torch.Generator().manual_seed(hash(pattern) % 1000)
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
