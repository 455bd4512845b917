"""The grouped weight-gradient kernel (csrc/wgrad.cu) alone, on the default model's 14 jobs (3 layers of out_proj,
dt_proj, x_proj, in_proj; input_proj and its bias) at K = B*T rows: µs per launch (a CUDA graph of 20 launches,
median of 15 replays), for each dtype, K-slice length (0 = the plan's choice), path (tensor cores on / off) and
the same dW as torch GEMMs beside it. Fresh random operands; nothing is timed on zeros.

    python benchmarks/wgrad_kernel.py --rows 1024 4096 --dtypes f32 bf16 --slices 0 128 256 --out X.json

--source step: the jobs of a real training step (B = 16, T = K / 16) recorded from the trainer's backward instead
of the synthetic ones; --each: also each job alone and the launch without it (the plan's slice, per path), which
shows which jobs set the launch's time (its tail); --jobs: a subset of the jobs (indices); --once: eager launches,
no timing, for a profiler; --cold: every launch after a 256 MB write that evicts L2 (the write's own time, timed
alone, subtracted), as in a step whose operands were written long before; --no-bias: without the bias column sums.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def default_jobs(K: int, dtype: torch.dtype, d_model: int = 128, d_state: int = 16, expand: int = 2,
                 input_dim: int = 32, n_layers: int = 3):
    """The weight-gradient jobs of one backward of the default model, with the operand layouts fused.py uses:
    (a [K, M], b [K, N] or None, c [M, N] float32)."""
    di, r = expand * d_model, -(-d_model // 16)
    E = r + 2 * d_state
    mk = lambda *s: torch.randn(*s, device="cuda").to(dtype)  # noqa: E731
    jobs = []
    for _ in range(n_layers):
        dbc = mk(K, E)
        jobs += [(mk(K, d_model), mk(K, di), torch.zeros(d_model, di, device="cuda")),   # out_proj
                 (mk(K, di), dbc[:, :r], torch.zeros(di, r, device="cuda")),            # dt_proj
                 (mk(K, E), mk(K, di), torch.zeros(E, di, device="cuda")),              # x_proj
                 (mk(K, 2 * di), mk(K, d_model), torch.zeros(2 * di, d_model, device="cuda"))]  # in_proj
    jobs += [(mk(K, d_model), mk(K, input_dim), torch.zeros(d_model, input_dim, device="cuda")),
             (torch.randn(K, d_model, device="cuda"), None, torch.zeros(d_model, device="cuda"))]  # bias: float32 dh
    return jobs


def step_jobs(K: int, dtype: str):
    """The jobs of one eager backward of the default model's trainer at B = 16, T = K / 16 (fresh random input and
    d_temporal), as fused.py hands them to the kernel (operands kept alive)."""
    from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer
    from mamba_rl.model import fused
    fused.WGRAD = "on"  # every size through the grouped kernel, so that its jobs can be recorded
    net = MambaBackbone(MambaConfig(d_model=128, n_layers=3), 32, device="cuda", seed=0, backend="cuda")
    tr = MambaTrainer(net, batch=16, seq_len=K // 16, dtype=dtype, lr=1e-3)
    tr.x_buf.copy_(torch.randn(16, K // 16, 32, device="cuda"))
    tr.d_buf.copy_(torch.randn(16, K // 16, 128, device="cuda"))
    ext = net.kernels
    real, rec = ext.wgrad_grouped, []

    def record(jobs, *a, **kw):
        rec.extend((x, y, z.clone()) for x, y, z in jobs)
        return real(jobs, *a, **kw)
    ext.wgrad_grouped = record
    try:
        tr.step(None, None)
        torch.cuda.synchronize()
    finally:
        ext.wgrad_grouped = real
    return rec


def _time_graph(fn, n_launch: int = 20, reps: int = 15, flush=None) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n_launch):
            if flush is not None:
                flush.fill_(1.0)
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1000.0 / n_launch)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--dtypes", nargs="+", default=["f32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--slices", type=int, nargs="+", default=[0])
    ap.add_argument("--paths", nargs="+", default=["tc", "ffma"], choices=["tc", "ffma"])
    ap.add_argument("--no-torch", action="store_true", help="skip the torch GEMM peer")
    ap.add_argument("--source", choices=["synthetic", "step"], default="synthetic")
    ap.add_argument("--cold", action="store_true", help="evict L2 before every launch (its time subtracted)")
    ap.add_argument("--no-bias", action="store_true", help="leave out the column-sum (bias) job")
    ap.add_argument("--jobs", type=int, nargs="+", default=None, help="only these jobs (indices of the job list)")
    ap.add_argument("--once", action="store_true", help="launch each dtype's jobs 3 times eagerly, no timing (for a "
                    "profiler: ncu -k wgrad_kernel --launch-skip 1 --launch-count 1)")
    ap.add_argument("--each", action="store_true", help="also time each job alone and the launch without it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from mamba_rl.ops.extension import extension
    ext = extension("cuda")
    rows = []
    flush = torch.zeros(24 << 20, device="cuda") if args.cold else None  # 96 MB written: L2 (50 MB) evicted
    base = _time_graph(lambda: None, flush=flush) if args.cold else 0.0
    tag = dict(source=args.source, cold=args.cold, bias=not args.no_bias)
    for K in args.rows:
        for name in args.dtypes:
            dt = DTYPES[name]
            torch.manual_seed(K)
            jobs = step_jobs(K, name) if args.source == "step" else default_jobs(K, dt)
            if args.no_bias:
                jobs = [j for j in jobs if j[1] is not None]
            if args.jobs is not None:
                if any(not 0 <= i < len(jobs) for i in args.jobs):
                    ap.error(f"--jobs: indices in [0, {len(jobs)}) expected, got {args.jobs}")
                jobs = [jobs[i] for i in args.jobs]
            if args.source == "step" and K == args.rows[0]:
                for a, b, c in jobs:
                    print("  job", tuple(a.shape), a.dtype, a.stride(0), a.data_ptr() % 16,
                          None if b is None else (tuple(b.shape), b.dtype, b.stride(0), b.data_ptr() % 16), flush=True)
            paths = ["ffma"] if dt == torch.float32 else args.paths
            if args.once:
                for _ in range(3):
                    ext.wgrad_grouped(jobs, 0, paths[0] == "tc")
                torch.cuda.synchronize()
                continue
            for path in paths:
                for sl in args.slices:
                    us = _time_graph(lambda: ext.wgrad_grouped(jobs, slice=sl, tensor_cores=path == "tc"),
                                     flush=flush) - base
                    rows.append({"K": K, "dtype": name, "path": path, "slice": sl, "us": round(us, 2),
                                 "jobs": args.jobs, **tag})
                    print(json.dumps(rows[-1]), flush=True)
            if args.each:
                for path in paths:
                    for i, (a, b, c) in enumerate(jobs):
                        one, rest = [jobs[i]], jobs[:i] + jobs[i + 1:]
                        alone = _time_graph(lambda: ext.wgrad_grouped(one, tensor_cores=path == "tc"),
                                            flush=flush) - base
                        without = _time_graph(lambda: ext.wgrad_grouped(rest, tensor_cores=path == "tc"),
                                              flush=flush) - base if rest else None
                        rows.append({"K": K, "dtype": name, "path": path, "job": i, "a": list(a.shape),
                                     "a_dtype": str(a.dtype), "b": None if b is None else list(b.shape),
                                     "b_dtype": None if b is None else str(b.dtype),
                                     "alone_us": round(alone, 2),
                                     "without_us": None if without is None else round(without, 2), **tag})
                        print(json.dumps(rows[-1]), flush=True)
            if not args.no_torch:
                def torch_dw():
                    for a, b, c in jobs:
                        if b is None:
                            c.add_(a.sum(0))
                        else:
                            c.add_(torch.mm(a.t(), b).float())
                us = _time_graph(torch_dw, flush=flush) - base
                rows.append({"K": K, "dtype": name, "path": "torch", "slice": None, "us": round(us, 2), **tag})
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "what": __doc__.split("\n\n")[0]}
        with open(args.out, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
