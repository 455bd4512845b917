"""The selective-scan kernels alone on the GPU: ext.scan_fwd and ext.scan_bwd at the d_model-128 shapes of
bench.py's ``ROWS`` (d_inner 256, d_state 16, dt_rank 8; B / C / z as the fused node passes them: strided views),
each call captured in a CUDA graph and timed as the median of replays (CUDA events), f32 and bf16.
With ``--tree PATH`` the package (and so the kernel sources and their build) is imported from PATH, so two
builds (e.g. before / after a kernel change) can be timed by two processes on the same machine.
Where the build has ``scan_set_segments``, each shape is also timed with the time split forced off (1
segment), and the segment counts are recorded.

``--bwd-blocks 0,2,3,4`` times the backward's builds (``ext.scan_set_bwd_blocks``) instead, ``--coop MASK`` sets
``ext.set_coop`` for the run (0: every pass as its own launch).

Usage (device): python3 benchmarks/scan_kernels.py [--tree PATH] [--label NAME] [--shape 16x64 ...]
    [--segments 1,2] [--bwd-blocks 0,2,3,4] [--coop 0] --out scan.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

SHAPES = [(16, 64), (64, 128), (256, 32), (16, 512), (16, 2048), (64, 1024), (4, 4096)]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--label", default="this")
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--shape", action="append", default=None, help="BxT (repeatable); default: all of SHAPES")
    ap.add_argument("--once", action="store_true", help="one eager forward and backward per shape, no timing "
                    "(for a profiler)")
    ap.add_argument("--segments", default=None,
                    help="comma-separated forced segment counts to time instead of auto / one_segment, e.g. 1,2,3")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: both")
    ap.add_argument("--bwd-blocks", default=None,
                    help="comma-separated backward builds to time (0 = automatic; 3, 4, or 2 = the pair build: blocks "
                    "per SM with the split sized for it; ext.scan_set_bwd_blocks), each as its own mode")
    ap.add_argument("--coop", type=int, default=None, help="ext.set_coop mask for the whole run (default: the build's)")
    a = ap.parse_args(argv)
    bwd_blocks = []
    if a.bwd_blocks:
        try:
            bwd_blocks = [int(n) for n in a.bwd_blocks.split(",")]
        except ValueError:
            ap.error(f"--bwd-blocks expects comma-separated integers from 0, 2, 3, 4, got {a.bwd_blocks!r}")
        if any(n not in (0, 2, 3, 4) for n in bwd_blocks):
            ap.error(f"--bwd-blocks expects values from 0, 2, 3, 4, got {a.bwd_blocks!r}")
        if a.segments:
            ap.error("--segments and --bwd-blocks are two kinds of modes: give one of them")
    sys.path.insert(0, a.tree)
    import torch
    import mamba_rl
    from mamba_rl.ops.extension import extension, extension_error
    ext = extension("cuda")
    if ext is None:
        sys.exit(f"scan_kernels: no CUDA extension: {extension_error('cuda')}")
    print(f"[{a.label}] mamba_rl from {mamba_rl.__file__}", flush=True)
    D, N, R = 256, 16, 8
    rows = []

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(gr):
            fn()
        for _ in range(3):
            gr.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(a.iters):
            e0.record(); gr.replay(); e1.record(); e1.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e3)
        ts.sort()
        return ts[len(ts) // 2]

    has_seg = hasattr(ext, "scan_set_segments")
    if a.coop is not None:
        ext.set_coop(a.coop)
    shapes = [tuple(int(v) for v in sh.split("x")) for sh in a.shape] if a.shape else SHAPES
    dtypes = [getattr(torch, a.dtype)] if a.dtype else [torch.float32, torch.bfloat16]
    for B, T in shapes:
        for dtype in dtypes:
            g = torch.Generator(device="cuda").manual_seed(B * T)
            xz = torch.randn(B, T, 2 * D, device="cuda", generator=g).to(dtype)
            dbc = torch.randn(B, T, R + 2 * N, device="cuda", generator=g).to(dtype)
            x, z, Bm, Cm = xz[..., :D], xz[..., D:], dbc[..., R:R + N], dbc[..., R + N:]
            xc = x.contiguous()
            dt = (torch.randn(B, T, D, device="cuda", generator=g) * 0.5 - 1).to(dtype)
            A_log = torch.log(torch.arange(1, N + 1, device="cuda", dtype=torch.float32)).repeat(D, 1)
            Dp, dtb = torch.ones(D, device="cuda"), torch.randn(D, device="cuda", generator=g) * 0.5 - 2
            starts = torch.rand(B, T, device="cuda", generator=g) < 0.01
            dy = torch.randn(B, T, D, device="cuda", generator=g).to(dtype)
            _, _, ck = ext.scan_fwd(xc, dt, A_log, Bm, Cm, Dp, z, dtb, None, starts, True)
            fwd = lambda: ext.scan_fwd(xc, dt, A_log, Bm, Cm, Dp, z, dtb, None, starts, True)
            bwd = lambda: ext.scan_bwd(xc, dt, A_log, Bm, Cm, Dp, z, dtb, None, starts, ck, dy, None, False)
            if a.once:
                bwd()
                torch.cuda.synchronize()
                continue
            modes = [("auto", 0), ("one_segment", 1)] if has_seg else [("auto", 0)]
            if has_seg and a.segments:
                modes = [(f"forced_{n}", int(n)) for n in a.segments.split(",")]
            if bwd_blocks:
                modes = [(f"bwd_blocks_{n}", ("bb", n)) for n in bwd_blocks]
            for mode, forced in modes:
                try:
                    if isinstance(forced, tuple):
                        ext.scan_set_bwd_blocks(forced[1])
                        forced = 0
                    if has_seg:
                        ext.scan_set_segments(forced)
                    r = dict(label=a.label, mode=mode, B=B, T=T, D=D, N=N, dtype=str(dtype).split(".")[-1],
                             fwd_us=round(timed(fwd), 1), bwd_us=round(timed(bwd), 1))
                    if has_seg:
                        r["nseg_fwd"] = ext.scan_segments(B, T, D, N, False)
                        r["nseg_bwd"] = ext.scan_segments(B, T, D, N, True)
                finally:  # the knobs back to automatic, also when a timing fails
                    if has_seg:
                        ext.scan_set_segments(0)
                    if bwd_blocks:
                        ext.scan_set_bwd_blocks(0)
                rows.append(r)
                print(r, flush=True)
    if a.out:
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=date, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
