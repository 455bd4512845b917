"""CUDA AdamW / grad_stats kernels vs the references in mamba_rl.ops.optim and torch.optim.AdamW."""
import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.fixture(scope="module")
def oc():
    from mamba_rl.ops.extension import extension, extension_error
    assert extension("cuda") is not None, f"extension failed to load: {extension_error('cuda')!r}"
    from mamba_rl.ops import optim
    return optim


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(P, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(P, device="cuda", generator=g) for _ in range(2)] + \
        [torch.zeros(P, device="cuda"), torch.zeros(P, device="cuda")]


@pytest.mark.parametrize("P,n_decay,cdtype", [(1, 1, None), (1000, 300, torch.bfloat16),
                                              (350_001, 200_000, torch.float16), (2_000_000, 0, None)])
def test_kernels_vs_ref(oc, P, n_decay, cdtype):
    from mamba_rl.ops import optim as O
    hyper = O.make_hyper(1e-3, (0.9, 0.999), 1e-8, 0.05, 1.0, False, "cuda")
    p, _, m, v = make(P, P)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    sc, rsc = torch.zeros(8, dtype=torch.float64, device="cuda"), torch.zeros(8, dtype=torch.float64, device="cuda")
    comp = None if cdtype is None else torch.full((P,), float("nan"), dtype=cdtype, device="cuda")
    ls = torch.ones(1, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    for it in range(10):
        grad = torch.randn(P, device="cuda", generator=g) * (0.01 if it % 2 else 3.0)
        extra = torch.tensor(0.25 * it, device="cuda")
        hyper[0] = 1e-3 * (1 + it)  # schedule: read at run time
        oc.grad_stats(grad, extra, ls, hyper, sc)
        O.grad_stats_ref(grad, extra, ls, hyper, rsc)
        assert torch.allclose(sc, rsc, rtol=1e-12, atol=0), (sc, rsc)
        oc.adamw_step(p, grad, m, v, hyper, sc, n_decay, comp)
        O.adamw_step_ref(rp, grad, rm, rv, hyper, rsc, n_decay)
    assert rel(p, rp) <= 1e-6 and rel(m, rm) <= 1e-6 and rel(v, rv) <= 1e-6
    if comp is not None:
        assert torch.equal(comp, p.to(cdtype))


@pytest.mark.parametrize("clip", [None, 0.5])
def test_vs_torch_adamw_100_steps(oc, clip):
    from mamba_rl.ops import optim as O
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(64, 33), (129,), (7, 5)]
    n_decay = 64 * 33
    tp = [torch.randn(*s, device="cuda", generator=g).requires_grad_(True) for s in shapes]
    P = sum(t.numel() for t in tp)
    arena = torch.cat([t.detach().reshape(-1) for t in tp]).clone()
    m, v = torch.zeros_like(arena), torch.zeros_like(arena)
    opt = torch.optim.AdamW([{"params": tp[:1], "weight_decay": 0.1}, {"params": tp[1:], "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.99), eps=1e-8, foreach=False)
    hyper = O.make_hyper(3e-3, (0.9, 0.99), 1e-8, 0.1, clip, False, "cuda")
    sc = torch.zeros(8, dtype=torch.float64, device="cuda")
    ls = torch.ones(1, device="cuda")
    for it in range(100):
        grads = [torch.randn(t.shape, device="cuda", generator=g) for t in tp]
        for t, gr in zip(tp, grads):
            t.grad = gr.clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(tp, clip)
        opt.step()
        flat = torch.cat([gr.reshape(-1) for gr in grads])
        oc.grad_stats(flat, None, ls, hyper, sc)
        oc.adamw_step(arena, flat, m, v, hyper, sc, n_decay)
    ref = torch.cat([t.detach().reshape(-1) for t in tp])
    assert rel(arena, ref) <= 1e-6
    assert sc[0].item() == 100


def test_f16_overflow_skips(oc):
    from mamba_rl.ops import optim as O
    P = 10_000
    hyper = O.make_hyper(1e-3, (0.9, 0.999), 1e-8, 0.01, 1.0, True, "cuda")
    p, grad, m, v = make(P, 3)
    m.normal_(); v.uniform_()
    comp = p.half()
    sc = torch.zeros(8, dtype=torch.float64, device="cuda")
    sc[0], sc[1], sc[2] = 5, 0.4, 0.005
    ls = torch.full((1,), 65536.0, device="cuda")
    grad[123] = float("inf")
    grad[7] = float("nan")
    before = [t.clone() for t in (p, m, v, comp, sc)]
    oc.grad_stats(grad, None, ls, hyper, sc)
    assert sc[5].item() == 1.0 and sc[0].item() == 5 and sc[1].item() == 0.4 and sc[2].item() == 0.005
    oc.adamw_step(p, grad, m, v, hyper, sc, 5000, comp)
    for a, b in zip((p, m, v, comp), before):
        assert torch.equal(a, b)
    # a clean step after the overflow unscales by 1/65536 and steps
    grad2 = torch.randn(P, device="cuda") * 65536
    oc.grad_stats(grad2, None, ls, hyper, sc)
    assert sc[5].item() == 0.0 and sc[0].item() == 6 and abs(sc[6].item() - 1 / 65536) < 1e-20
    oc.adamw_step(p, grad2, m, v, hyper, sc, 5000, comp)
    assert torch.isfinite(p).all() and not torch.equal(p, before[0])


def test_graph_replay_follows_lr(oc):
    from mamba_rl.ops import optim as O
    P = 50_000
    hyper = O.make_hyper(1e-3, (0.9, 0.999), 1e-8, 0.01, 1.0, False, "cuda")
    p, grad, m, v = make(P, 9)
    sc = torch.zeros(8, dtype=torch.float64, device="cuda")
    ls = torch.ones(1, device="cuda")
    e = [t.clone() for t in (p, m, v, sc)]

    def step(pp, mm, vv, ss):
        oc.grad_stats(grad, None, ls, hyper, ss)
        oc.adamw_step(pp, grad, mm, vv, hyper, ss, 1000)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(*[t.clone() for t in (p, m, v, sc)])
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        step(p, m, v, sc)
    for lr in (1e-3, 5e-4, 0.0, 2e-3):
        hyper[0] = lr
        gr.replay()
        step(*e)
    torch.cuda.synchronize()
    for a, b in zip((p, m, v, sc), e):
        assert torch.equal(a, b)
