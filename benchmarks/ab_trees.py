"""A/B of two or more source trees' training step on one GPU: each tree imported in its own processes, with its
own extension build directory, the trees alternating round by round (benchmarks/NOTES.md: machines of one kind
differ by 10-15 %, and one machine drifts, so a kernel change is timed against its parent on the same machine,
interleaved).

A tree is a directory holding ``mamba_rl/``, ``csrc/``, ``agents/``, ``envs/``, ``pyproject.toml`` and
``benchmarks/bench.py`` of one revision, e.g.::

    mkdir -p /tmp/old && git archive REV mamba_rl csrc agents envs pyproject.toml benchmarks/bench.py \\
        | tar x -C /tmp/old

Each (round, tree) is one process that runs ``bench.bench_train`` (graph replay, median µs of ``--iters`` calls;
kernels per replay) on every row; the first round builds each tree's extension into ``TREE/.build`` (or
``--build`` builds them all first, in parallel). Writes ``--out`` (JSON: device, torch, date, every
measurement, and per tree and row the median over the rounds) after every process, and prints a table of the
medians against the first tree.

Usage (device): python3 benchmarks/ab_trees.py --trees /tmp/old . --rows 128x16x512 128x64x1024 --dtype bf16 \\
    --rounds 2 --out $OUT/ab.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import json, sys
tree, rows, dtype, iters = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
sys.path.insert(0, tree)
sys.path.insert(0, tree + "/benchmarks")
import torch, bench
out = []
for dm, B, T in rows:
    n = iters or (40 if B * T >= 16384 else 100)
    r = bench.bench_train(dm, B, T, dtype, n)
    out.append(dict(d_model=dm, B=B, T=T, dtype=dtype, us=r["us"], kernels=r["kernels"]))
print("RESULT" + json.dumps(dict(rows=out, device=torch.cuda.get_device_name(), torch=torch.__version__)))
"""


def parse_rows(ap: argparse.ArgumentParser, rows: list[str], flag: str = "--rows") -> list[tuple[int, int, int]]:
    """``["128x16x64"]`` -> ``[(128, 16, 64)]`` (d_model, B, T, each >= 1); argparse's error naming ``flag``
    otherwise (benchmarks/timeline.py's ``--shape`` too)."""
    out = []
    for r in rows:
        try:
            dm, B, T = (int(v) for v in r.split("x"))
        except ValueError:
            ap.error(f"{flag} expects DMxBxT (e.g. 128x64x1024), got {r!r}")
        if min(dm, B, T) < 1:
            ap.error(f"{flag} expects d_model, B and T >= 1, got {r!r}")
        out.append((dm, B, T))
    return out


def check_trees(ap: argparse.ArgumentParser, trees: list[str]) -> list[str]:
    """The trees as absolute paths; argparse's error for fewer than two or one that lacks a part the child needs."""
    if len(trees) < 2:
        ap.error(f"--trees needs at least two trees to compare, got {len(trees)}")
    out = []
    for t in trees:
        t = os.path.abspath(t)
        missing = [p for p in ("mamba_rl", "csrc", os.path.join("benchmarks", "bench.py"))
                   if not os.path.exists(os.path.join(t, p))]
        if missing:
            ap.error(f"--trees: {t} lacks {missing} (a tree: git archive REV mamba_rl csrc agents envs "
                     f"pyproject.toml benchmarks/bench.py | tar x -C DIR)")
        out.append(t)
    if len(set(out)) != len(out):
        ap.error(f"--trees: the same tree twice in {out}")
    return out


def _env(tree: str) -> dict:
    return dict(os.environ, MAMBA_RL_BUILD_DIR=os.path.join(tree, ".build"), PYTHONPATH=tree)


def summarise(res: list[dict], trees: list[str]) -> dict:
    """``{tree: {"DMxBxT": median µs over the rounds}}``."""
    med: dict[str, dict[str, float]] = {}
    for t in trees:
        by_row: dict[str, list[float]] = {}
        for r in res:
            if r["tree"] == t:
                by_row.setdefault(f"{r['d_model']}x{r['B']}x{r['T']}", []).append(r["us"])
        med[t] = {k: statistics.median(v) for k, v in by_row.items()}
    return med


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs="+", required=True, help="two or more source trees; the first is the base")
    ap.add_argument("--rows", nargs="+", default=["128x16x64", "128x64x128", "128x16x512", "128x64x1024"],
                    metavar="DMxBxT")
    ap.add_argument("--dtype", default="bf16", choices=["f32", "bf16", "f16"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=0, help="calls per timing (0: 100, or 40 from B*T = 16384)")
    ap.add_argument("--build", action="store_true", help="build every tree's CUDA extension first, in parallel")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    rows = parse_rows(ap, a.rows)
    trees = check_trees(ap, a.trees)
    if a.rounds < 1 or a.iters < 0:
        ap.error(f"--rounds must be >= 1 and --iters >= 0, got {a.rounds} and {a.iters}")
    if a.build:
        procs = [subprocess.Popen([sys.executable, "-m", "mamba_rl.build", "--kind", "cuda"], cwd=t, env=_env(t),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for t in trees]
        for t, p in zip(trees, procs):
            _, err = p.communicate()
            if p.returncode != 0:
                print(f"ab_trees: the build of {t} failed (rc {p.returncode}):\n{err[-3000:]}", file=sys.stderr)
                return 1
    out = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), dtype=a.dtype,
               trees=trees, results=[], failed=[])
    for rnd in range(a.rounds):
        for t in trees:
            p = subprocess.run([sys.executable, "-c", _CHILD, t, json.dumps(rows), a.dtype, str(a.iters)],
                               capture_output=True, text=True, env=_env(t))
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
            if p.returncode != 0 or not line:
                out["failed"].append(dict(tree=t, round=rnd, rc=p.returncode, stderr=p.stderr[-3000:]))
                print(f"ab_trees: round {rnd}, {t} failed (rc {p.returncode}):\n{p.stderr[-3000:]}", file=sys.stderr)
            else:
                r = json.loads(line[0][len("RESULT"):])
                out.update(device=r["device"], torch=r["torch"])
                for row in r["rows"]:
                    out["results"].append(dict(row, tree=t, round=rnd))
                    print(f"round {rnd} {os.path.basename(t) or t}: {row['d_model']}x{row['B']}x{row['T']} "
                          f"{row['us']:.1f} µs, {row['kernels']} kernels", flush=True)
            out["median_us"] = summarise(out["results"], trees)
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
    med, base = out["median_us"], trees[0]
    print("| DMxBxT | " + " | ".join(trees) + " |")
    print("|---" * (len(trees) + 1) + "|")
    for dm, B, T in rows:
        k = f"{dm}x{B}x{T}"
        cells = []
        for t in trees:
            v, b = med[t].get(k), med[base].get(k)
            cells.append("-" if v is None else f"{v:.1f}" + ("" if t == base or not b else f" ({v / b - 1:+.1%})"))
        print(f"| {k} | " + " | ".join(cells) + " |")
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
