"""Worker of tests/train/test_trainer_cuda_sizes.py, one d_model per process (a crash must not take the
test run with it): the cuda backend at a wide d_model against the float64 reference (forward, final state,
gradients through autograd and through MambaTrainer), eager vs graph-captured training (bit-identical), a
no-grad forward and the stepper. Prints OK and exits 0 when every check passes.

Usage: python -m tests.train.size_worker D_MODEL [N_LAYERS]
"""
import sys

import torch

from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer

IN, B, T = 7, 2, 5


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all(), "non-finite output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(dm: int, L: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = MambaConfig(d_model=dm, n_layers=L)
    g = torch.Generator().manual_seed(dm + L)
    x = torch.randn(B, T, IN, generator=g).cuda()
    starts = (torch.rand(B, T, generator=g) < 0.3).cuda()
    d = torch.randn(B, T, dm, generator=g).cuda()
    ref = MambaBackbone(cfg, IN, device="cuda", seed=1, backend="reference", dtype=torch.float64)
    yr, finr = ref(x.double(), episode_starts=starts)
    (yr * d.double()).sum().backward()

    # 1. no-grad forward and forward + backward through autograd
    net = MambaBackbone(cfg, IN, device="cuda", seed=1, backend="cuda")
    assert net.backend == "cuda"
    with torch.no_grad():
        y0, _ = net(x, episode_starts=starts)
    assert rel(y0, yr) < 1e-4, ("no-grad forward", rel(y0, yr))
    y, fin = net(x, episode_starts=starts)
    (y * d).sum().backward()
    assert rel(y, yr) < 1e-4 and rel(fin.ssm, finr.ssm) < 1e-4 and rel(fin.conv, finr.conv) < 1e-4
    e = rel(net.grad_arena, ref.grad_arena)
    assert e < 1e-4, ("autograd grads", e)
    for (n, p), (_, pr) in zip(net.named_parameters(), ref.named_parameters()):
        assert rel(p.grad, pr.grad) < 1e-3, n

    # 2. the trainer's gradient (split step, accumulate) equals the reference's
    net2 = MambaBackbone(cfg, IN, device="cuda", seed=1, backend="cuda")
    tr = MambaTrainer(net2, B, T, dtype="f32", lr=1e-3, max_grad_norm=1.0)
    tr.forward(x, initial_state=net2.initial_state(B), episode_starts=starts)
    tr.backward_step(d, accumulate=True)
    e = rel(net2.grad_arena, ref.grad_arena)
    assert e < 1e-4, ("trainer grads", e)

    # 3. eager vs graph-captured fused steps: bit-identical (f32), and bf16 trains (finite)
    for dtype in ("f32", "bf16"):
        ne = MambaBackbone(cfg, IN, device="cuda", seed=2, backend="cuda")
        ng = MambaBackbone(cfg, IN, device="cuda", seed=2, backend="cuda")
        te = MambaTrainer(ne, B, T, dtype=dtype, lr=1e-3, max_grad_norm=1.0)
        tg = MambaTrainer(ng, B, T, dtype=dtype, lr=1e-3, max_grad_norm=1.0)
        tg.capture_graph()
        for i in range(3):
            xi = torch.randn(B, T, IN, generator=g).cuda()
            di = torch.randn(B, T, dm, generator=g).cuda()
            me = te.step(xi, di, episode_starts=starts)
            mg = tg.step(xi, di, episode_starts=starts)
            assert mg.graph_replayed and not me.graph_replayed
        assert torch.isfinite(ne.arena).all()
        assert torch.equal(ne.arena, ng.arena), (dtype, "eager vs graph arenas differ")
        assert torch.equal(te.state.ssm, tg.state.ssm)
        del ne, ng, te, tg

    # 4. the stepper (kernel or fallback) equals forward token by token
    st = net.stepper(batch=B)
    with torch.no_grad():
        yf, _ = net(x[:, :2], episode_starts=starts[:, :2])
    for t in range(2):
        ys = st.step(x[:, t], episode_starts=starts[:, t])
        assert rel(ys, yf[:, t]) < 1e-4, ("stepper", t, rel(ys, yf[:, t]), net.kernel_support("step"))
    torch.cuda.synchronize()
    print("OK", dm, L, "step kernel:", tuple(net.kernel_support("step")), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2)
