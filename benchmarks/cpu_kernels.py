"""CPU kernels (csrc/cpu, loaded by mamba_rl/ops/extension.py) vs the pure-torch reference vs the GEMM floor.

Rows (default model: d_model 128, 3 layers, d_inner 256, d_state 16, d_conv 4, dt_rank 8):
  step   one-token ``backbone_step`` at B=8 (all layers, one C++ call) | ``backbone_step_ref`` |
         the 13 F.linear calls of the same shapes timed alone.
  layer  conv1d + selective scan forward + backward of one layer at [B=2, T=128, 256], N=16, with the
         fused.py call pattern (strided views, dx/dz written into halves of one buffer, weight grads
         accumulated) | the refs' forward + autograd backward in float32 | that layer's GEMMs timed alone
         (4 forward F.linear, 8 backward matmuls).
  train  a whole training step at [B=2, T=128]: ``MambaTrainer.step`` on the cpu backend
         (mamba_rl/model/fused.py's forward and hand-written backward, the C++ grad_stats + AdamW) |
         the reference backend's forward + autograd backward + torch's fused AdamW | every GEMM of that
         forward + backward timed alone (fused.py's exact calls and shapes).

Each number is the minimum over ``--rounds`` interleaved rounds of the mean wall time of ``--calls``
calls, so a busy machine inflates all columns alike rather than one of them. Run:

    python benchmarks/cpu_kernels.py                 # 2 threads, then 1
    python benchmarks/cpu_kernels.py --threads 2 --rounds 30
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from mamba_rl.config import MambaConfig
from mamba_rl.ops.extension import load_extension
from mamba_rl.ops.step import LAYER_KEYS, backbone_step_ref


class _Cfg:
    rms_norm_eps = 1e-5


def step_case(ext, B, cfg, in_dim, g):
    """(ours, reference, gemm floor) callables for the one-token step."""
    from mamba_rl.model.backbone import MambaBackbone
    net = MambaBackbone(cfg, in_dim, seed=0, backend="reference")
    w = {k: v.detach() for k, v in net.step_weights().items()}
    L, di, N, K = cfg.n_layers, cfg.d_inner, cfg.d_state, cfg.d_conv
    layers = [[w[f"layers.{i}.{k}"].contiguous() for k in LAYER_KEYS] for i in range(L)]
    for t in layers:
        t[2] = t[2].reshape(di, K)
    cs, ss = torch.zeros(L, B, di, K - 1), torch.zeros(L, B, di, N)
    cs_r, ss_r = cs.clone(), ss.clone()
    x = torch.randn(B, in_dim, generator=g)
    starts = torch.zeros(B, dtype=torch.bool)
    starts[0] = True
    ours = lambda: ext.backbone_step(x, w["input_proj.weight"], w["input_proj.bias"], w["norm_f.weight"], layers,
                                     cs, ss, starts, 1e-5, 0)
    ref = lambda: backbone_step_ref(x, w, cs_r, ss_r, starts, _Cfg)
    h = torch.randn(B, cfg.d_model, generator=g)
    xc, dtr, y = torch.randn(B, di, generator=g), torch.randn(B, cfg.dt_rank_value, generator=g), \
        torch.randn(B, di, generator=g)

    def gemms():
        F.linear(x, w["input_proj.weight"], w["input_proj.bias"])
        for t in layers:
            F.linear(h, t[1])
            F.linear(xc, t[4])
            F.linear(dtr, t[5])
            F.linear(y, t[9])
    return ours, ref, gemms


def layer_case(ext, B, T, D, N, K, R, dm, g):
    """(ours, reference, gemm floor) callables for one layer's conv + scan forward + backward."""
    from mamba_rl.ops.conv import causal_conv1d_ref
    from mamba_rl.ops.scan import selective_scan_ref
    rn = lambda *s: torch.randn(*s, generator=g)
    xz = rn(B, T, 2 * D)
    xi, z = xz[..., :D], xz[..., D:]
    cw, cb = rn(D, K) * 0.5, rn(D) * 0.1
    A_log = torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(D, 1)
    Dp, dtb = torch.ones(D), rn(D) * 0.5 - 2.0
    dbc = rn(B, T, R + 2 * N)
    dt = rn(B, T, D) * 0.5 - 1.0
    starts = torch.rand(B, T, generator=g) < 0.02
    dy = rn(B, T, D)
    dxz = torch.empty(B, T, 2 * D)
    acc = [torch.zeros(D, N), torch.zeros(D), torch.zeros(D)]
    dcw, dcb = torch.zeros(D, K), torch.zeros(D)

    def ours():
        xc, _ = ext.conv_fwd(xi, cw, cb, None, starts)
        y, _, ck = ext.scan_fwd(xc, dt, A_log, dbc[..., R:R + N], dbc[..., R + N:], Dp, z, dtb, None, starts, True)
        dxc = ext.scan_bwd(xc, dt, A_log, dbc[..., R:R + N], dbc[..., R + N:], Dp, z, dtb, None, starts, ck, dy,
                           None, False, dxz[..., D:], acc)[0]
        ext.conv_bwd(xi, cw, cb, None, starts, dxc, None, False, dxz[..., :D], dcw, dcb)

    leaves = [t.clone().requires_grad_(True) for t in (xi, cw, cb, dt, A_log, dbc, Dp, z, dtb)]

    def ref():
        xi_, cw_, cb_, dt_, A_, dbc_, Dp_, z_, dtb_ = leaves
        xc, _ = causal_conv1d_ref(xi_, cw_, cb_, None, starts)
        y, _ = selective_scan_ref(xc, dt_, A_, dbc_[..., R:R + N], dbc_[..., R + N:], Dp_, z_, dtb_, None, starts)
        torch.autograd.grad(y, leaves, dy)

    BT = B * T
    Win, Wx, Wdt, Wout = rn(2 * D, dm), rn(R + 2 * N, D), rn(D, R), rn(dm, D)
    u, xc2, dtr, y2 = rn(BT, dm), rn(BT, D), rn(BT, R), rn(BT, D)
    g1, g2, g3, g4 = rn(BT, 2 * D), rn(BT, R + 2 * N), rn(BT, D), rn(BT, dm)

    def gemms():
        F.linear(u, Win)
        F.linear(xc2, Wx)
        F.linear(dtr, Wdt)
        F.linear(y2, Wout)
        for gg, W, a in ((g1, Win, u), (g2, Wx, xc2), (g3, Wdt, dtr), (g4, Wout, y2)):
            gg @ W
            gg.t() @ a
    return ours, ref, gemms


def train_case(ext, B, T, cfg, in_dim, g):
    """(ours, reference, gemm floor) callables for a whole training step (forward, backward, AdamW)."""
    from mamba_rl.model.backbone import MambaBackbone
    from mamba_rl.train.trainer import MambaTrainer
    x = torch.randn(B, T, in_dim, generator=g)
    starts = torch.rand(B, T, generator=g) < 0.02
    gfeat = torch.randn(B, T, cfg.d_model, generator=g)
    L, di, N, K, r = cfg.n_layers, cfg.d_inner, cfg.d_state, cfg.d_conv, cfg.dt_rank_value

    net = MambaBackbone(cfg, in_dim, seed=0, backend="cpu")
    tr = MambaTrainer(net, batch=B, seq_len=T, lr=1e-4, max_grad_norm=0.5)

    def ours():
        tr.step(x, gfeat, episode_starts=starts)

    rnet = MambaBackbone(cfg, in_dim, seed=0, backend="reference")
    ropt = torch.optim.AdamW(rnet.parameters(), lr=1e-4, fused=True)

    def ref():
        ropt.zero_grad(set_to_none=False)
        feat, _ = rnet(x, None, starts)
        feat.backward(gfeat)
        ropt.step()

    BT, dm = B * T, cfg.d_model
    rn = lambda *s: torch.randn(*s, generator=g)
    x2, bi, Wi = rn(BT, in_dim), rn(dm), rn(dm, in_dim)
    Ws = [(rn(2 * di, dm), rn(r + 2 * N, di), rn(di, r), rn(dm, di)) for _ in range(L)]
    u, xc, dbc, y, h = rn(BT, dm), rn(BT, di), rn(BT, r + 2 * N), rn(BT, di), rn(BT, dm)
    dout, ddt, ddbc, dxz = rn(BT, dm), rn(BT, di), rn(BT, r + 2 * N), rn(BT, 2 * di)
    gW = [tuple(torch.zeros_like(w) for w in ws) for ws in Ws]
    gWi = torch.zeros(dm, in_dim)

    def gemms():  # fused.py's GEMMs, same calls and shapes
        torch.addmm(bi, x2, Wi.t())
        for Win, Wx, Wdt, Wout in Ws:
            torch.mm(u, Win.t())
            torch.mm(xc, Wx.t())
            torch.mm(dbc[:, :r], Wdt.t())
            torch.addmm(h, y, Wout.t())
        for (Win, Wx, Wdt, Wout), (gin, gx, gdt, gout) in zip(Ws, gW):
            gout.addmm_(dout.t(), y)
            torch.mm(dout, Wout)
            gdt.addmm_(ddt.t(), dbc[:, :r])
            torch.mm(ddt, Wdt)
            gx.addmm_(ddbc.t(), xc)
            torch.addmm(xc, ddbc, Wx)
            gin.addmm_(dxz.t(), u)
            torch.mm(dxz, Win)
        gWi.addmm_(dout.t(), x2)
    return ours, ref, gemms


def bench(cases, rounds, calls):
    """Interleaved timing: {row: {col: seconds}} as the min over rounds of the mean over calls."""
    best = {row: {col: math.inf for col in fns} for row, (fns, _) in cases.items()}
    for rnd in range(rounds):
        for row, (fns, ncalls) in cases.items():
            for col, fn in fns.items():
                if fn is None or (col == "reference" and rnd >= max(2, rounds // 5)):
                    continue  # the reference is slow and steady: a few rounds suffice
                fn()
                t0 = time.perf_counter()
                for _ in range(ncalls[col]):
                    fn()
                best[row][col] = min(best[row][col], (time.perf_counter() - t0) / ncalls[col])
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=10, help="calls per timed batch of the fast columns")
    ap.add_argument("--no-reference", action="store_true", help="skip the (slow) reference column")
    args = ap.parse_args()
    ext = load_extension("cpu")
    cfg = MambaConfig()  # d_model 128, 3 layers, d_state 16, d_conv 4, expand 2, dt_rank 8
    in_dim = 8
    for nt in args.threads:
        torch.set_num_threads(nt)
        g = torch.Generator().manual_seed(0)
        c = args.calls
        cases = {}
        for row, (fns, calls) in {
            "step B=8, 3 layers": (step_case(ext, 8, cfg, in_dim, g), (10 * c, 2, 10 * c)),
            "conv+scan fwd+bwd [2,128,256]": (layer_case(ext, 2, 128, cfg.d_inner, cfg.d_state, cfg.d_conv,
                                                         cfg.dt_rank_value, cfg.d_model, g), (c, 1, c)),
            "train step [2,128] fwd+bwd+AdamW": (train_case(ext, 2, 128, cfg, in_dim, g), (max(1, c // 2), 1,
                                                                                          max(1, c // 2))),
        }.items():
            ours, ref, gemms = fns
            cases[row] = ({"ours": ours, "reference": None if args.no_reference else ref, "GEMMs alone": gemms},
                          dict(zip(("ours", "reference", "GEMMs alone"), calls)))
        best = bench(cases, args.rounds, args.calls)
        print(f"\n{nt} thread(s), torch {torch.__version__}; times in ms (min over rounds)")
        print(f"{'':34s} {'ours':>9s} {'reference':>10s} {'GEMMs alone':>12s} {'ours/GEMMs':>11s} {'ref/ours':>9s}")
        for row, cols in best.items():
            o, r, gm = cols["ours"] * 1e3, cols["reference"] * 1e3, cols["GEMMs alone"] * 1e3
            rs = "-" if math.isinf(r) else f"{r:10.3f}"
            sp = "-" if math.isinf(r) else f"{r / o:8.1f}x"
            print(f"{row:34s} {o:9.3f} {rs:>10s} {gm:12.3f} {o / gm:10.2f}x {sp:>9s}")


if __name__ == "__main__":
    main()
