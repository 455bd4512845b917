"""Where a training step's time goes: the kernels of one graph replay of ``MambaTrainer.step`` with their stream,
start and duration (torch.profiler's chrome trace), and per kernel the time it ran alone, overlapped or not at
all (a kernel that runs alone is on the step's critical path).

3 layers, d_state 16, expand 2, input_dim 32 (bench.py's model); fresh random inputs and output gradients.

Usage (device): python3 benchmarks/timeline.py --out $OUT/timeline.json [--shape 128x64x1024 ...] [--dtype bf16]
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHAPES = ["128x16x64", "128x64x128", "128x16x512", "128x64x1024"]


def replay_kernels(tr) -> list[tuple[str, int, float, float]]:
    """[(kernel name, stream, start µs from the first kernel, duration µs)] of one replay of ``tr``'s step graph."""
    from torch.profiler import ProfilerActivity, profile
    gr = tr._graphs["step"]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gr.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    ks = sorted(((e["name"], e.get("args", {}).get("stream"), e["ts"], e["dur"]) for e in events
                 if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda k: k[2])
    t0 = ks[0][2]
    return [(n, s, round(ts - t0, 2), d) for n, s, ts, d in ks]


def critical(ks) -> dict:
    """Span, idle time, and per kernel name the µs it ran alone and its share of the overlapped time."""
    span = max(ts + du for _, _, ts, du in ks)
    pts = sorted({0.0, span, *(ts for _, _, ts, _ in ks), *(ts + du for _, _, ts, du in ks)})
    idle, solo, shared = 0.0, collections.defaultdict(float), collections.defaultdict(float)
    for a, b in zip(pts, pts[1:]):
        mid = (a + b) / 2
        run = [n.split("(")[0] for n, _, ts, du in ks if ts <= mid < ts + du]
        if not run:
            idle += b - a
        elif len(run) == 1:
            solo[run[0]] += b - a
        else:
            for r in run:
                shared[r] += (b - a) / len(run)
    names = sorted(set(solo) | set(shared), key=lambda k: -(solo[k] + shared[k]))
    return dict(span_us=round(span, 1), idle_us=round(idle, 1),
                kernels=[dict(name=k, solo_us=round(solo[k], 1), shared_us=round(shared[k], 1)) for k in names])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", nargs="+", default=SHAPES, metavar="DMxBxT")
    ap.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    a = ap.parse_args(argv)
    from benchmarks.ab_trees import parse_rows

    shapes = dict(zip(a.shape, parse_rows(ap, a.shape, "--shape")))  # every shape checked before the first is profiled
    if not torch.cuda.is_available():
        raise SystemExit("timeline: needs a CUDA device")
    from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dtype=a.dtype, rows={})
    for sh, (dm, B, T) in shapes.items():
        net = MambaBackbone(MambaConfig(d_model=dm, n_layers=3), 32, device="cuda", seed=0, backend="cuda")
        tr = MambaTrainer(net, batch=B, seq_len=T, dtype=a.dtype, lr=1e-3)
        g = torch.Generator(device="cuda").manual_seed(B * T)
        tr.x_buf.copy_(torch.randn(B, T, 32, device="cuda", generator=g))
        tr.d_buf.copy_(torch.randn(B, T, dm, device="cuda", generator=g))
        for _ in range(3):
            tr.step(None, None)
        tr.capture_graph()
        for _ in range(10):
            tr._graphs["step"].replay()
        ks = replay_kernels(tr)
        out["rows"][sh] = dict(trace=ks, **critical(ks))
        r = out["rows"][sh]
        print(f"{sh} {a.dtype}: span {r['span_us']} µs, idle {r['idle_us']}", flush=True)
        for k in r["kernels"][:8]:
            print(f"   {k['solo_us']:9.1f} solo {k['shared_us']:8.1f} shared  {k['name'][:70]}", flush=True)
        del tr, net
        with open(a.out, "w") as f:  # after every shape: a later failure keeps the rows already profiled
            json.dump(out, f)


if __name__ == "__main__":
    main()
