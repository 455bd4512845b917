"""Learning curves of a run from its TensorBoard event files (``mamba-rl plot RUN_DIR``).

Needs matplotlib (``pip install -e ".[plot]"``). One PNG: the episodic return against global env
steps (every episode as a dot, plus a running mean over k = min(100, max(1, episodes // 10)) episodes, as the
legend says), and one panel per ``losses/*`` tag (y limits from the 1st..99th percentile when the opening
points would flatten the curve).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .tags import EPISODIC_RETURN as _RETURN

__all__ = ["read_scalars", "plot_run"]


def read_scalars(run_dir: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """``{tag: (steps, values)}`` of every scalar in the event files under ``run_dir``, as TensorBoard shows them:
    a resumed run's several event files are read in order as one stream, so the steps that a resume from an
    earlier checkpoint purged (the ``purge_step`` of its writer) are dropped from the files before it.

    Raises:
        FileNotFoundError: ``run_dir`` is not a folder or holds no TensorBoard event file.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run folder at {run_dir}")
    if not any(run_dir.glob("events.out.tfevents.*")):
        raise FileNotFoundError(f"no TensorBoard event files in {run_dir} (expected a folder like runs/<run name>)")
    # one accumulator over the folder (0: keep every point): it purges across files as TensorBoard does
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    series = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags().get("scalars", [])}
    out = {}
    for tag, points in series.items():
        if tag != _RETURN:  # one value per step (a resumed run may log a step twice: keep the last)
            points = list(dict(points).items())
        points.sort(key=lambda p: p[0])  # stable: episodes ending at one step keep their order
        out[tag] = ([p[0] for p in points], [p[1] for p in points])
    return out


def _robust_limits(values: np.ndarray) -> tuple[float, float] | None:
    """(low, high) y limits that leave out outliers, or None where the finite values have none (or are fewer
    than 20): Tukey's far-out fences, the quartiles -/+ 3 interquartile ranges, so that a loss's large opening
    values (the value loss before the critic has learned anything) or a lone spike (an explained variance of -4e7
    where the target barely varied) do not flatten the rest of the curve; percentiles of ~100 points do not drop
    a lone spike."""
    finite = values[np.isfinite(values)] if len(values) else values
    if len(finite) < 20:
        return None
    q1, q3 = np.percentile(finite, [25, 75])
    iqr = q3 - q1 if q3 > q1 else abs(q3) * 0.1 + 1e-12
    lo, hi = max(finite.min(), q1 - 3 * iqr), min(finite.max(), q3 + 3 * iqr)
    if finite.min() >= lo and finite.max() <= hi:
        return None
    pad = 0.05 * (hi - lo) if hi > lo else abs(hi) * 0.1 + 1e-12
    return lo - pad, hi + pad


def _robust_ylim(ax, values) -> None:
    """Clip the panel's y axis to :func:`_robust_limits` where it finds outliers, noted in its corner."""
    lim = _robust_limits(values)
    if lim is not None:
        ax.set_ylim(*lim)
        ax.text(0.99, 0.97, "y: outliers clipped (3 IQR)", transform=ax.transAxes, ha="right", va="top", fontsize=7,
                alpha=0.6)


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run's learning curves into a PNG and return its path.

    Args:
        run_dir: a TensorBoard run folder (``runs/<run name>``).
        out: the image to write (default ``run_dir/curves.png``; ".png" added when it has no suffix).

    Raises:
        ImportError: matplotlib is not installed (the ``plot`` extra).
        FileNotFoundError: no event files in ``run_dir``.
        NotADirectoryError: a part of ``out``'s folder exists and is not a folder.
        ValueError: the run has no scalars to plot yet, or ``out`` is an existing folder.
    """
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError('mamba-rl plot needs matplotlib: pip install -e ".[plot]" (or pip install matplotlib)') \
            from err
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    out = Path(out) if out is not None else Path(run_dir) / "curves.png"
    if out.is_dir():
        raise ValueError(f"--out must be the path of the image to write, got {str(out)!r}, an existing folder")
    if not out.suffix:  # matplotlib would write out + ".png": name the file it writes
        out = out.with_suffix(".png")
    scalars = read_scalars(run_dir)
    losses = sorted(t for t in scalars if t.startswith("losses/"))
    panels = ([_RETURN] if _RETURN in scalars else []) + losses
    if not panels:
        raise ValueError(f"{run_dir}: no episodic return or losses logged yet")
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, tag in zip(axes.flat, panels):
        steps, values = scalars[tag]
        if tag == _RETURN:
            ax.plot(steps, values, ".", ms=2, alpha=0.3, label="episodes")
            k = max(1, min(100, len(values) // 10))
            mean = np.convolve(values, np.ones(k) / k, mode="valid")
            ax.plot(steps[k - 1:], mean, lw=1.5, label=f"running mean of {k} episodes")
            ax.legend(loc="best", fontsize=8)
        else:
            ax.plot(steps, values, lw=1)
            _robust_ylim(ax, np.asarray(values, dtype=float))
        ax.set_title(tag, fontsize=10)
        ax.set_xlabel("env steps")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(Path(run_dir).name, fontsize=9)
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as err:
        plt.close(fig)
        raise NotADirectoryError(f"--out {str(out)!r}: a part of its folder {str(out.parent)!r} exists and is not a "
                                 f"folder ({err})") from err
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
