"""Console output of a training run: a progress bar that moves during the rollout, notices printed
once and outside the bar, and the CPU thread policy applied before the model is built.

The bar polls the agent's step counter from a daemon thread (every ``interval`` seconds), so it moves
within seconds of the start, while the first rollout is still running, without the rollout
calling back into it.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable

import torch

__all__ = ["StepProgress", "notice", "resolve_threads", "apply_thread_policy"]


def notice(message: str) -> None:
    """Print ``message`` on stderr without breaking an active tqdm bar (``tqdm.write``)."""
    from tqdm.auto import tqdm

    tqdm.write(message, file=sys.stderr)


class StepProgress:
    """A tqdm bar over env steps that follows ``get_step()`` from a background thread.

    Args:
        total: steps of the whole run. initial: steps already done (a resumed run).
        get_step: returns the current step count (read from the polling thread; an int read is atomic).
        interval: seconds between polls.
    """

    def __init__(self, total: int, initial: int, get_step: Callable[[], int], interval: float = 0.5):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)
        self._get_step = get_step
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._poll, args=(interval,), daemon=True, name="mamba_rl-progress")
        self._thread.start()

    def _poll(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.sync()

    def sync(self, **postfix: str) -> None:
        """Move the bar to the current step (and set its postfix, when given)."""
        with self._lock:
            step = min(int(self._get_step()), self.bar.total)
            if postfix:
                self.bar.set_postfix(refresh=False, **postfix)
            if step != self.bar.n:
                self.bar.update(step - self.bar.n)

    def close(self) -> None:
        """Stop polling and close the bar (idempotent)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            self.bar.close()


def resolve_threads(threads: int) -> int:
    """The torch CPU thread count for ``PPOConfig.threads``: ``threads`` when > 0; for 0 (auto),
    ``$OMP_NUM_THREADS`` when the user set it to a positive int, else 1.

    Why 1: the policy acts on a batch of a few envs per step, where a second thread gains little
    (measured ~15% for the default model on 2 cores), while one thread per run lets N seeds share N
    cores at their solo speed (torch's default, one thread per core in every process, oversubscribes
    the machine N-fold). Raise it with ``--threads N`` for a single large run.
    """
    if threads > 0:
        return int(threads)
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return 1


def apply_thread_policy(threads: int) -> int:
    """``torch.set_num_threads(resolve_threads(threads))``; returns the count. Call it before the
    model is built."""
    n = resolve_threads(threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
