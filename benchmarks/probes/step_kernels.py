"""The one-token CUDA kernels alone, per batch size, kernel and rows per block / cluster, with float32 and bfloat16
GEMM weights: each captured 20 times in one CUDA graph, the median of 15 replays divided by 20 (µs a launch).
Random weights and states (tests/ops/test_cuda_step.make_weights), the default model (d_model 128, 3 layers,
d_state 16, input_dim 32). Device only:

    python3 benchmarks/probes/step_kernels.py [--batch 1 16 64 256]

prints one line per dtype and B: ``<kernel><R>=<µs>`` (``ERR(...)`` where the kernel does not take the shape)."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mamba_rl.ops.extension import extension  # noqa: E402
from mamba_rl.ops.step import backbone_step_packed, pack_step_weights  # noqa: E402
from tests.ops.test_cuda_step import make_weights  # noqa: E402

KERNELS = (("auto", (0,)), ("rows", (1, 2)), ("cluster", (1, 2)), ("cluster2", (1, 2, 4, 8, 16)),
           ("cluster3", (8, 16, 24, 32)))


def per_launch_us(f) -> float:
    f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            f()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(15):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / 20)
    return sorted(ts)[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256, 512])
    a = ap.parse_args()
    ext = extension("cuda")
    if ext is None:
        raise SystemExit("step_kernels: needs the CUDA extension and a GPU")
    L, in_dim = 3, 32
    print(torch.cuda.get_device_name(), torch.__version__)
    for gdt in (torch.float32, torch.bfloat16):
        packed = pack_step_weights(make_weights(in_dim, 128, L, seed=1, gemm_dtype=gdt), L, 256)
        for B in a.batch:
            x = torch.randn(B, in_dim, device="cuda")
            cs, ss = torch.randn(L, B, 256, 3, device="cuda"), torch.randn(L, B, 256, 16, device="cuda")
            st = torch.zeros(B, dtype=torch.bool, device="cuda")
            res = []
            for kern, Rs in KERNELS:
                for R in Rs:
                    if kern.startswith("cluster") and (B + R - 1) // R > 64:  # > 64 clusters: not a candidate
                        continue
                    try:
                        us = per_launch_us(lambda: backbone_step_packed(ext, x, packed, cs, ss, st, 1e-5, kern, R))
                        res.append(f"{kern}{R if kern != 'auto' else ''}={us:.1f}")
                    except RuntimeError as e:
                        res.append(f"{kern}{R}=ERR({str(e)[:50]})")
            print(str(gdt).removeprefix("torch."), B, " ".join(res), flush=True)


if __name__ == "__main__":
    main()
