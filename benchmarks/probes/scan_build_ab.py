"""The training step (bench.py's ``bench_train``: graph replay, median µs) with the scan backward's builds
alternating in one process: ``ext.scan_set_bwd_blocks(n)`` for each n of ``--builds`` (0 = the automatic
choice, 2 = the pair build with 8 states a thread, 3 / 4 = the 4-state builds; csrc/scan_bwd.cuh), round by
round, so a build is timed against another on the same GPU with the same drift. Prints per row and build the
median over rounds and its ratio to the first build; writes ``--out`` (JSON with every round).

Usage (device): python3 benchmarks/probes/scan_build_ab.py --builds 0,2 --rows 128x16x64 128x64x128 \\
    --dtypes bf16 f32 --rounds 3 --out ab.json
"""
import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench  # noqa: E402
from ab_trees import parse_rows  # noqa: E402

DTYPES = ("bf16", "f32")  # bench_train takes the trainer's dtype names


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--builds", default="0,2", help="comma-separated scan_set_bwd_blocks values (0, 2, 3, 4)")
    ap.add_argument("--rows", nargs="+", default=["128x16x64", "128x64x128", "128x256x32", "128x16x512",
                                                  "128x64x1024"], help="DMxBxT")
    ap.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["bf16", "f32"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=0, help="calls per timing (0: 100, or 40 from 16,384 tokens)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    try:
        builds = [int(v) for v in a.builds.split(",")]
    except ValueError:
        ap.error(f"--builds expects comma-separated integers from 0, 2, 3, 4, got {a.builds!r}")
    bad = [b for b in builds if b not in (0, 2, 3, 4)]
    if bad:
        ap.error(f"--builds expects values from 0, 2, 3, 4, got {bad}")
    rows = parse_rows(ap, a.rows)
    if a.rounds < 1 or a.iters < 0:
        ap.error(f"--rounds expects >= 1 and --iters >= 0, got {a.rounds} and {a.iters}")
    if a.out and not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
        ap.error(f"--out: the folder of {a.out!r} does not exist")
    from mamba_rl.ops.extension import extension, extension_error
    ext = extension("cuda")
    if ext is None:
        sys.exit(f"scan_build_ab: no CUDA extension: {extension_error('cuda')}")
    meas = []
    for rnd in range(a.rounds):
        for dm, B, T in rows:
            for dt in a.dtypes:
                for bld in builds:
                    n = a.iters or (40 if B * T >= 16384 else 100)
                    ext.scan_set_bwd_blocks(bld)
                    try:
                        r = bench.bench_train(dm, B, T, dt, n)
                    finally:
                        ext.scan_set_bwd_blocks(0)
                    meas.append(dict(round=rnd, d_model=dm, B=B, T=T, dtype=dt, build=bld, us=r["us"],
                                     kernels=r["kernels"]))
                    print(meas[-1], flush=True)
    table = []
    for dm, B, T in rows:
        for dt in a.dtypes:
            med = {bld: statistics.median(m["us"] for m in meas if (m["d_model"], m["B"], m["T"], m["dtype"],
                                                                      m["build"]) == (dm, B, T, dt, bld))
                   for bld in builds}
            table.append(dict(d_model=dm, B=B, T=T, dtype=dt, median_us=med,
                              ratio={bld: med[bld] / med[builds[0]] for bld in builds}))
            cells = [f"build {bld}: {med[bld]:.1f} µs ({med[bld] / med[builds[0]]:.3f})" for bld in builds]
            print(f"{dm}x{B}x{T} {dt}: " + "  ".join(cells), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           builds=builds, rounds=a.rounds, measurements=meas, medians=table), f, indent=1)


if __name__ == "__main__":
    main()
