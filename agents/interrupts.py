"""Signals of a training run: SIGTERM as Ctrl-C, and no second signal in the middle of a save.

* :func:`terminate_as_interrupt` makes SIGTERM (what SLURM, Kubernetes, ``kill`` and torchrun send before
  they kill a job) raise :class:`Interrupted`, a ``KeyboardInterrupt``, so that a run saves its
  ``interrupted`` checkpoint exactly as on Ctrl-C. ``mamba-rl train`` then exits with 128 + the signal
  number: 130 after Ctrl-C (SIGINT), 143 after SIGTERM (:func:`exit_code`).
* :func:`interrupt_once` wraps a training loop: the first Ctrl-C (or SIGTERM, where it interrupts) raises as
  usual and at once switches both signals to holding, so a second one that follows within microseconds
  cannot cut short the handler that saves ``interrupted``.
* :func:`ignore_until_exit`, once a run has stopped on a signal: a later SIGINT / SIGTERM prints one line and is
  ignored, so the process ends with the first signal's exit code (one raised while the interpreter shuts down
  would surface as a traceback from an atexit callback).
* :func:`deferred_signals` wraps the ``interrupted`` save: a second Ctrl-C or SIGTERM while it runs prints
  one line and is otherwise ignored, so the save completes (a resume command never points at a folder
  that was cut short). SIGKILL still ends the process at once; the previous checkpoint folder is then
  left in place (:func:`mamba_rl.agents.checkpoint.save_agent` replaces a folder as a whole).

Signal handlers can only be set from the main thread; elsewhere both functions do nothing.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Iterator

__all__ = ["Interrupted", "terminate_as_interrupt", "interrupt_once", "deferred_signals", "ignore_until_exit",
           "exit_code"]


class Interrupted(KeyboardInterrupt):
    """KeyboardInterrupt raised by a signal other than SIGINT; ``signum`` is that signal's number."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum} ({signal.Signals(signum).name})")
        self.signum = signum


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_interrupted(signum: int, frame: Any) -> None:  # noqa: ARG001 - signal handler signature
    raise Interrupted(signum)


def terminate_as_interrupt() -> bool:
    """Make SIGTERM raise :class:`Interrupted` in the main thread. Returns False (nothing changed) when
    called from another thread."""
    if not _main_thread():
        return False
    signal.signal(signal.SIGTERM, _raise_interrupted)
    return True


def exit_code(err: BaseException) -> int:
    """The exit code of a run that ``err`` (a KeyboardInterrupt) ended: 128 + signal number, as a shell
    reports a process killed by it (130 for SIGINT / Ctrl-C, 143 for SIGTERM)."""
    return 128 + getattr(err, "signum", int(signal.SIGINT))


def _hold(what: str, received: list[int]):
    def hold(signum: int, frame: Any) -> None:  # noqa: ARG001 - signal handler signature
        received.append(signum)
        print(f"\n{signal.Signals(signum).name} received while saving {what}: waiting for the save to finish "
              f"(SIGKILL would abort it and keep the previous checkpoint)", file=sys.stderr, flush=True)
    return hold


@contextlib.contextmanager
def interrupt_once(what: str) -> Iterator[list[int]]:
    """While the block runs, the first SIGINT (and SIGTERM where :func:`terminate_as_interrupt` made it raise)
    raises ``KeyboardInterrupt`` / :class:`Interrupted` and first switches both signals to holding (a later
    one prints that ``what`` is being saved and is otherwise ignored), so the ``except KeyboardInterrupt``
    that saves runs to its end however fast a second signal follows. The previous handlers are restored when
    the block exits (after that handler). Signals whose handler is not the raising one are left alone."""
    received: list[int] = []
    if not _main_thread():
        yield received
        return
    watched = [s for s, raising in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, _raise_interrupted))
               if signal.getsignal(s) is raising]
    old = {s: signal.getsignal(s) for s in watched}
    hold = _hold(what, received)

    def first(signum: int, frame: Any) -> None:  # noqa: ARG001
        for s in watched:  # before anything else: a second signal now only prints
            signal.signal(s, hold)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Interrupted(signum)

    for s in watched:
        signal.signal(s, first)
    try:
        yield received
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def deferred_signals(what: str) -> Iterator[list[int]]:
    """Hold off SIGINT and SIGTERM while the block runs (e.g. a checkpoint save).

    A signal that arrives meanwhile prints ``what`` is still being saved and is otherwise ignored; the
    yielded list collects the signal numbers received. The previous handlers are restored on exit.
    """
    received: list[int] = []
    if not _main_thread():
        yield received
        return

    old = {s: signal.signal(s, _hold(what, received)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def ignore_until_exit() -> bool:
    """From now on SIGINT and SIGTERM print one line each and are otherwise ignored: for a run that has already
    stopped on a signal and is closing down (its exit code is the first signal's). Returns False (nothing
    changed) when called from another thread."""
    if not _main_thread():
        return False

    def ignore(signum: int, frame: Any) -> None:  # noqa: ARG001 - signal handler signature
        print(f"\n{signal.Signals(signum).name} received while the run is already stopping: ignored", file=sys.stderr,
              flush=True)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, ignore)
    return True
