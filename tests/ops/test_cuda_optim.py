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


def test_grad_stats_last_block_sum_is_the_same_over_many_launches(oc):
    """grad_stats' totals are the blocks' partials summed by the block that arrives last at the counter
    (last_block_arrive): 200 launches back to back over 4M elements (a full grid of blocks), each into its own
    zeroed scalars, give the same bits, and those of the float64 twin to 1e-12."""
    from mamba_rl.ops import optim as O
    hyper = O.make_hyper(1e-3, (0.9, 0.999), 1e-8, 0.05, 1.0, False, "cuda")
    grad = torch.randn(4_000_001, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    ls = torch.ones(1, device="cuda")
    scs = torch.zeros(200, 8, dtype=torch.float64, device="cuda")
    for i in range(200):
        oc.grad_stats(grad, None, ls, hyper, scs[i])
    rsc = torch.zeros(8, dtype=torch.float64, device="cuda")
    O.grad_stats_ref(grad, None, ls, hyper, rsc)
    torch.cuda.synchronize()
    assert torch.equal(scs, scs[:1].expand_as(scs))
    assert torch.allclose(scs[0], rsc, rtol=1e-12, atol=0), (scs[0], rsc)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_vs_torch_adamw_100_steps(oc, clip):
    from mamba_rl.ops import optim as O
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(64, 33), (129,), (7, 5)]
    n_decay = 64 * 33
    tp = [torch.randn(*s, device="cuda", generator=g).requires_grad_(True) for s in shapes]
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


def _optim_case(P, cdtype, offset, seed):
    """Arenas (views at ``offset`` elements into their storage: unaligned where offset % 4 != 0) and buffers."""
    from mamba_rl.ops import optim as O
    g = torch.Generator(device="cuda").manual_seed(seed)

    def arena(scale=1.0):
        return (torch.randn(P + offset, device="cuda", generator=g) * scale)[offset:]
    p, m, v = arena(), arena(0.1), arena(0.01).abs()
    comp = None if cdtype is None else torch.full((P + offset,), float("nan"), device="cuda").to(cdtype)[offset:]
    hyper = O.make_hyper(1e-3, (0.9, 0.999), 1e-8, 0.05, 1.0, True, "cuda")
    sc = torch.zeros(8, dtype=torch.float64, device="cuda")
    sc[0], sc[1], sc[2] = 3, 0.271, 0.003
    return dict(p=p, m=m, v=v, comp=comp, hyper=hyper, sc=sc, ls=torch.full((1,), 1024.0, device="cuda")), g


def _clone_case(c):
    return {k: (None if t is None else t.clone()) for k, t in c.items()}


@pytest.mark.parametrize("P,cdtype,offset,fits", [(1, None, 0, True), (1000, torch.bfloat16, 0, True),
                                                  (354_001, torch.bfloat16, 0, True), (99_999, torch.float16, 3, True),
                                                  (540_672, None, 0, True), (540_673, torch.bfloat16, 0, False),
                                                  (2_000_000, None, 1, False)])
def test_optim_step_fused_gives_the_two_launches_bits(oc, P, cdtype, offset, fits):
    """One cooperative launch (grad_stats + AdamW) against the two launches: the same bits in every output,
    over clean steps, an overflow step (skipped: nothing but the gradient changes), a head's extra norm and a
    clipped step; arenas aligned or not; where the arena does not fit, both paths are the two launches."""
    case, g = _optim_case(P, cdtype, offset, seed=P)
    fused, split = case, _clone_case(case)
    for it in range(6):
        grad = torch.randn(P, device="cuda", generator=g) * (1024.0 * (0.01 if it % 2 else 5.0))
        if it == 3:
            grad[P // 2] = float("inf")
        extra = None if it == 1 else torch.tensor(0.5 * it, device="cuda")
        grads = [grad.clone(), grad.clone()]
        ran = oc.optim_step(fused["p"], grads[0], fused["m"], fused["v"], extra, fused["ls"], fused["hyper"],
                            fused["sc"], min(7, P), fused["comp"], zero_grad=True)
        assert ran is fits
        oc.grad_stats(grads[1], extra, split["ls"], split["hyper"], split["sc"])
        oc.adamw_step(split["p"], grads[1], split["m"], split["v"], split["hyper"], split["sc"], min(7, P),
                      split["comp"], zero_grad=True)
        torch.cuda.synchronize()
        assert (fused["sc"][5].item() == 1.0) is (it == 3)
        for k in ("p", "m", "v", "comp", "sc"):
            if fused[k] is not None:
                assert torch.equal(fused[k], split[k]), (it, k)
        assert not grads[0].any() and not grads[1].any()
    assert fused["sc"][0].item() == 3 + 5  # six steps, one skipped


def test_optim_step_captured_replays_follow_new_values(oc):
    """The fused launch inside a CUDA graph: replays with new gradients and learning rates give the eager two
    launches' bits (the grid barrier and the statistics are rebuilt every replay)."""
    from mamba_rl.ops import optim as O
    case, g = _optim_case(354_001, torch.bfloat16, 0, seed=11)
    eager = _clone_case(case)
    grad = torch.empty(354_001, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture, on throw-away copies
        w = _clone_case(case)
        O.optim_step(w["p"], grad.normal_(), w["m"], w["v"], None, w["ls"], w["hyper"], w["sc"], 100, w["comp"])
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        ran = O.optim_step(case["p"], grad, case["m"], case["v"], None, case["ls"], case["hyper"], case["sc"], 100,
                           case["comp"], zero_grad=True)
    assert ran is True
    for lr in (1e-3, 5e-4, 0.0, 2e-3):
        src = torch.randn(354_001, device="cuda", generator=g) * 300.0
        case["hyper"][0] = eager["hyper"][0] = lr
        grad.copy_(src)
        gr.replay()
        g2 = src.clone()
        oc.grad_stats(g2, None, eager["ls"], eager["hyper"], eager["sc"])
        oc.adamw_step(eager["p"], g2, eager["m"], eager["v"], eager["hyper"], eager["sc"], 100, eager["comp"],
                      zero_grad=True)
    torch.cuda.synchronize()
    for k in ("p", "m", "v", "comp", "sc"):
        assert torch.equal(case[k], eager[k]), k
    assert not grad.any()


def test_optim_step_off_and_on_cpu_are_the_two_functions(oc, monkeypatch):
    """FUSED = False runs the two launches (returns False, same bits); a CPU arena runs the references."""
    from mamba_rl.ops import optim as O
    case, g = _optim_case(10_000, None, 0, seed=5)
    other = _clone_case(case)
    grad = torch.randn(10_000, device="cuda", generator=g)
    monkeypatch.setattr(O, "FUSED", False)
    assert O.optim_step(case["p"], grad.clone(), case["m"], case["v"], None, case["ls"], case["hyper"], case["sc"],
                        50, None) is False
    monkeypatch.setattr(O, "FUSED", True)
    assert O.optim_step(other["p"], grad.clone(), other["m"], other["v"], None, other["ls"], other["hyper"],
                        other["sc"], 50, None) is True
    for k in ("p", "m", "v", "sc"):
        assert torch.equal(case[k], other[k]), k
    cpu = {k: (None if t is None else t.cpu()) for k, t in _clone_case(case).items()}
    ref = _clone_case(cpu)
    gc = grad.cpu()
    assert O.optim_step(cpu["p"], gc.clone(), cpu["m"], cpu["v"], None, cpu["ls"], cpu["hyper"], cpu["sc"], 50,
                        None) is False
    O.grad_stats_ref(gc, None, ref["ls"], ref["hyper"], ref["sc"])
    O.adamw_step_ref(ref["p"], gc, ref["m"], ref["v"], ref["hyper"], ref["sc"], 50)
    for k in ("p", "m", "v", "sc"):
        assert torch.equal(cpu[k], ref[k]), k
