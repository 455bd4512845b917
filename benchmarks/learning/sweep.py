"""Many learning runs in parallel on one host (one process per run, one torch thread each), then a table.

Each run is ``run.py`` (RecurrentPPO on one env, seed and configuration; one CSV row per update). Runs are
pinned to one thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``) so that N runs on N cores do
not fight over them. The summary gives, per env and variant over its seeds: the final mean return of the
last 100 training episodes, MMER (the maximum over training of that mean, POPGym's metric), the first step
at which it reached ``--threshold`` (if given; once 100 episodes have finished) and the wall time then, and the deterministic evaluation return of the final policy.

Usage:
    python benchmarks/learning/sweep.py --env mamba_rl/CartPoleNoVel-v1 --seeds 1 2 3 --total 100000 \
        --variant default --variant "fast:learning_rate=1e-3,num_steps=32,num_minibatches=1" \
        --parallel 12 --device cuda --threshold 475 --out runs_dir
Writes ``{out}/*.csv`` and ``{out}/summary.json``; prints a markdown table.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``"name:k=v,k=v"`` -> (name, ["k=v", ...]); ``"default"`` -> ("default", [])."""
    name, _, rest = spec.partition(":")
    return name, [kv for kv in rest.split(",") if kv]


def summarise(path: str, threshold: float | None) -> dict:
    rows = list(csv.DictReader(open(path)))
    m100 = [(int(r["global_step"]), float(r["mean_return_last100"])) for r in rows
            if r["mean_return_last100"] not in ("", "nan")]
    m100 = [(s, v) for s, v in m100 if not math.isnan(v)]
    seen, full = 0, set()  # the steps at which 100 episodes or more have finished (a full window)
    for r in rows:
        seen += int(r["episodes"])
        if seen >= 100:
            full.add(int(r["global_step"]))
    hit = next((s for s, v in m100 if threshold is not None and v >= threshold and s in full), None)
    hit_wall = next((float(r["wall_s"]) for r in rows if hit is not None and int(r["global_step"]) == hit), None)
    ev = path[:-4] + ".eval.json"
    eval_mean = json.load(open(ev))["mean"] if os.path.exists(ev) else math.nan
    return {"eval": eval_mean, "final": m100[-1][1] if m100 else math.nan, "mmer": max((v for _, v in m100), default=math.nan),
            "steps": int(rows[-1]["global_step"]) if rows else 0, "hit_step": hit, "hit_wall_s": hit_wall,
            "wall_s": float(rows[-1]["wall_s"]) if rows else math.nan}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", action="append", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--total", type=int, default=100_000)
    ap.add_argument("--variant", action="append", default=None, help='"name:field=value,field=value"')
    ap.add_argument("--parallel", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--timeout", type=float, default=None, help="seconds before unfinished runs are killed")
    ap.add_argument("--stop-at", type=float, default=None, help="run.py --stop-at for every run")
    ap.add_argument("--eval-episodes", type=int, default=20, help="run.py --eval-episodes for every run")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    variants = [parse_variant(v) for v in (a.variant or ["default"])]
    os.makedirs(a.out, exist_ok=True)
    jobs = []
    for env in a.env:
        for name, sets in variants:
            for seed in a.seeds:
                cmd = [sys.executable, os.path.join(HERE, "run.py"), "--env", env, "--seed", str(seed), "--total",
                       str(a.total), "--device", a.device, "--variant", name, "--out", a.out, "--threads", "1",
                       "--d-model", "128", "--n-layers", "3", "--eval-episodes", str(a.eval_episodes)]
                if a.stop_at is not None:
                    cmd += ["--stop-at", str(a.stop_at)]
                for kv in sets:
                    cmd += ["--set", kv]
                jobs.append(cmd)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    running, t0 = [], time.time()
    logs = open(os.path.join(a.out, "sweep.log"), "a")
    while jobs or running:
        while jobs and len(running) < a.parallel:
            running.append(subprocess.Popen(jobs.pop(0), env=env, stdout=logs, stderr=logs))
        time.sleep(1.0)
        running = [p for p in running if p.poll() is None]
        if a.timeout and time.time() - t0 > a.timeout:
            for p in running:
                p.kill()
            print(f"sweep: timeout, {len(running)} runs killed, {len(jobs)} not started", file=sys.stderr)
            break
    summary = {}
    for path in sorted(glob.glob(os.path.join(a.out, "*__seed*.csv"))):
        base = os.path.basename(path)[:-4]
        key, _, seed = base.rpartition("__seed")
        summary.setdefault(key, {})[seed] = summarise(path, a.threshold)
    json.dump({"total": a.total, "threshold": a.threshold, "device": a.device, "runs": summary},
              open(os.path.join(a.out, "summary.json"), "w"), indent=1)
    print("| env__variant | seeds | final mean of last 100 (per seed) | MMER mean | steps to threshold | "
          "wall s to threshold | deterministic eval (per seed) |")
    print("|---|---|---|---|---|---|---|")
    for key, per in summary.items():
        fin = " / ".join(f"{v['final']:.0f}" if abs(v['final']) > 5 else f"{v['final']:.2f}" for v in per.values())
        mm = sum(v["mmer"] for v in per.values()) / len(per)
        hits = " / ".join(str(v["hit_step"]) for v in per.values())
        walls = " / ".join("-" if v.get("hit_wall_s") is None else f"{v['hit_wall_s']:.1f}" for v in per.values())
        ev = " / ".join(f"{v['eval']:.0f}" if abs(v['eval']) > 5 else f"{v['eval']:.2f}" for v in per.values())
        print(f"| {key} | {len(per)} | {fin} | {mm:.3f} | {hits} | {walls} | {ev} |")
    print(f"sweep: {time.time() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
