"""Per-seed curves of popgym.py runs: why one seed lags another.

For each variant folder given (``{out}/{method}[__{variant}]``) and one task, one column of two panels: the mean
return of the last 100 episodes of every seed (top) and the update's policy entropy (bottom; runs made before
the ``entropy`` column existed have none), plus a printed line per seed: peak, where, final, the drop after
the peak and the first step at which the curve reached ``--level``.

    python benchmarks/learning/seed_curves.py --out benchmarks/learning/cartpolenovel \\
        --task mamba_rl/CartPoleNoVel-v1 --variants mamba mamba__normobs mamba__normobs_freeze20k \\
        --level 400 --png benchmarks/learning/cartpolenovel/seed_curves.png
"""
from __future__ import annotations

import argparse
import csv
import glob
import math
import os


def read(path: str) -> dict[str, list[float]]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    cols = {k: [] for k in ("global_step", "mean_return_last100", "entropy")}
    for r in rows:
        for k in cols:
            v = r.get(k)
            cols[k].append(float(v) if v not in (None, "") else math.nan)
    return cols


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--task", required=True, help="the task as in the file names' prefix (/ and : as _ )")
    ap.add_argument("--variants", nargs="+", required=True)
    ap.add_argument("--level", type=float, default=None, help="report the first step the curve reaches this")
    ap.add_argument("--png", default=None)
    a = ap.parse_args(argv)
    task = a.task.replace("/", "_").replace(":", "_")
    data = {}
    for v in a.variants:
        runs = {}
        for p in sorted(glob.glob(os.path.join(a.out, v, f"{task}__seed*.csv"))):
            if not os.path.exists(p[:-4] + ".json"):
                continue  # an unfinished run
            runs[p.rsplit("seed", 1)[1][:-4]] = c = read(p)
            ys = c["mean_return_last100"]
            i = max(range(len(ys)), key=lambda j: -math.inf if math.isnan(ys[j]) else ys[j])
            first = next((c["global_step"][j] for j, y in enumerate(ys) if a.level is not None and y >= a.level), None)
            print(f"{v} seed {p.rsplit('seed', 1)[1][:-4]}: peak {ys[i]:.3f} at {c['global_step'][i] / 1000:.0f}k, "
                  f"final {ys[-1]:.3f}, drop after peak {ys[i] - ys[-1]:.3f}"
                  + (f", first >= {a.level:g} at {first / 1000:.0f}k" if first else
                     (f", never >= {a.level:g}" if a.level is not None else "")))
        data[v] = runs
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, len(a.variants), figsize=(4.2 * len(a.variants), 6), squeeze=False, sharex=True)
        for j, v in enumerate(a.variants):
            for s, c in data[v].items():
                (line,) = axes[0, j].plot(c["global_step"], c["mean_return_last100"], label=f"seed {s}")
                axes[1, j].plot(c["global_step"], c["entropy"], color=line.get_color(), lw=0.8)
            axes[0, j].set_title(f"{a.task}\n{v}", fontsize=8)
            axes[0, j].set_ylabel("mean return, last 100 episodes")
            axes[1, j].set_ylabel("policy entropy (update)")
            axes[1, j].set_xlabel("env steps")
            axes[0, j].legend(fontsize=7)
            for ax in axes[:, j]:
                ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(a.png, dpi=80)
        plt.close(fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
