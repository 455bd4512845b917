"""Aggregate the per-seed CSVs of run.py into curves.csv and learning_curves.png.

Usage: python benchmarks/learning/plot.py [--data benchmarks/learning/data] [--out benchmarks/learning]

curves.csv: one row per (env_id, variant, global_step) with the mean, min and max over seeds of
mean_return_last20 (the mean return of the last 20 finished episodes at that step) and the
number of seeds. The PNG plots the mean over seeds with a min-max band, one panel per env.
"""

from __future__ import annotations

import argparse
import csv
import glob
import math
import os
from collections import defaultdict


def main(argv=None) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser()
    p.add_argument("--data", default=os.path.join(here, "data"))
    p.add_argument("--out", default=here)
    p.add_argument("--header", default="", help="extra line(s) for the CSV header comment")
    a = p.parse_args(argv)

    series = defaultdict(lambda: defaultdict(dict))  # (env, variant) -> step -> seed -> value
    for path in sorted(glob.glob(os.path.join(a.data, "*.csv"))):
        with open(path) as f:
            for row in csv.DictReader(f):
                v = float(row["mean_return_last20"])
                if math.isnan(v):
                    continue
                series[(row["env_id"], row["variant"])][int(row["global_step"])][int(row["seed"])] = v

    out_csv = os.path.join(a.out, "curves.csv")
    with open(out_csv, "w", newline="") as f:
        for line in a.header.splitlines():
            f.write(f"# {line}\n")
        w = csv.writer(f)
        w.writerow(["env_id", "variant", "global_step", "seeds", "mean", "min", "max", "per_seed"])
        for (env, variant), steps in sorted(series.items()):
            for step in sorted(steps):
                vals = steps[step]
                xs = list(vals.values())
                w.writerow([env, variant, step, len(xs), f"{sum(xs) / len(xs):.2f}", f"{min(xs):.2f}",
                            f"{max(xs):.2f}", " ".join(f"s{s}={v:.1f}" for s, v in sorted(vals.items()))])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = sorted({env for env, _ in series})
    fig, axes = plt.subplots(1, len(envs), figsize=(6 * len(envs), 4.2), squeeze=False)
    for ax, env in zip(axes[0], envs):
        for (e, variant), steps in sorted(series.items()):
            if e != env:
                continue
            xs = sorted(s for s in steps if len(steps[s]) == max(len(v) for v in steps.values()))
            mean = [sum(steps[s].values()) / len(steps[s]) for s in xs]
            lo = [min(steps[s].values()) for s in xs]
            hi = [max(steps[s].values()) for s in xs]
            n = max(len(v) for v in steps.values())
            label = f"{'Mamba memory' if variant == 'mamba' else 'memoryless (state reset every step)'} ({n} seeds)"
            line, = ax.plot(xs, mean, label=label)
            ax.fill_between(xs, lo, hi, alpha=0.2, color=line.get_color())
        ax.axhline(475, ls="--", lw=0.8, color="gray")
        ax.set_title(env)
        ax.set_xlabel("env steps")
        ax.set_ylabel("mean return, last 20 episodes")
        ax.set_ylim(0, 520)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle("RecurrentPPO + Mamba backbone (d_model 64, 2 layers), CPU; mean over seeds, band = min..max")
    fig.tight_layout()
    png = os.path.join(a.out, "learning_curves.png")
    fig.savefig(png, dpi=110)
    print(out_csv, png)


if __name__ == "__main__":
    main()
