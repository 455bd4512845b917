"""Run names and run folders: every run gets folders of its own.

A run is named ``{env}__{exp_name}__{seed}__{unix_time}__{suffix}`` (CleanRL's name plus a short
random suffix), so two runs started in the same second with the same env, experiment name and
seed, on one host or on several sharing a file system, get different names. The name alone is not
trusted: :func:`claim_run` creates the run's folders (``runs_dir/name`` when tracking, and
``checkpoint_dir/name``) with exclusive ``mkdir`` and, should one exist already, draws a new
suffix and tries again, so a new run never writes into a folder it did not create.

A resumed run writes into its own folders on purpose: :func:`adopt_run` marks them as the
run's without the exclusive check. A :class:`Run` (name, claimed) is what the agent holds.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from .config import PPOConfig

__all__ = ["Run", "Progress", "new_run_name", "run_folders", "claim_run", "adopt_run", "RunFolderError"]

_SUFFIX_BYTES = 3  # 6 hex digits: 16.7M names per (env, exp_name, seed, second)
_MAX_TRIES = 16


class RunFolderError(RuntimeError):
    """No fresh run folder could be created (each try found an existing one)."""


@dataclass
class Run:
    """A run's identity: its ``name`` (the folder name under ``runs_dir`` and ``checkpoint_dir``) and
    whether its folders are this process's (``claimed``: created by :func:`claim_run`, or adopted by
    :func:`adopt_run` on resume)."""

    name: str
    claimed: bool = False


@dataclass
class Progress:
    """How far a run is: ``global_step`` (env steps of all ranks together), ``update`` (whole updates
    done), ``recent_returns`` (the last 100 finished episodes' raw returns) and ``lr_plan``, the lr anneal
    as fractions of the initial lr: linear from (update u0, fraction f0) down to 0 at update ``end``
    (None until ``learn`` plans it; see ``RecurrentPPO.current_lr``). Checkpoints save it."""

    global_step: int = 0
    update: int = 0
    recent_returns: deque = field(default_factory=lambda: deque(maxlen=100))
    lr_plan: tuple[float, float, float] | None = None


def new_run_name(config: PPOConfig, unix_time: int | None = None, suffix: str | None = None) -> str:
    """``{env}__{exp_name}__{seed}__{unix_time}__{suffix}`` ('/' and ':' in env ids become '_').

    Args:
        config: reads ``env_id``, ``exp_name``, ``seed``.
        unix_time: seconds since the epoch (default: now).
        suffix: the random part (default: 6 fresh hex digits from :mod:`secrets`).
    """
    t = int(time.time()) if unix_time is None else int(unix_time)
    suffix = secrets.token_hex(_SUFFIX_BYTES) if suffix is None else suffix
    env = config.env_id.replace("/", "_").replace(":", "_")
    return f"{env}__{config.exp_name}__{config.seed}__{t}__{suffix}"


def run_folders(config: PPOConfig, name: str) -> list[Path]:
    """The folders a run named ``name`` writes: ``runs_dir/name`` (when ``track``) and ``checkpoint_dir/name``."""
    out = [Path(config.runs_dir) / name] if config.track else []
    return out + [Path(config.checkpoint_dir) / name]


def _create_exclusively(folders: list[Path]) -> bool:
    """mkdir every folder, none pre-existing; on a clash remove the ones made here and return False, on
    any other error (an OSError: permissions, a path through a file) remove them and re-raise, so a failed
    claim leaves no empty run folder behind."""
    made: list[Path] = []
    try:
        for folder in folders:
            folder.parent.mkdir(parents=True, exist_ok=True)
            try:
                folder.mkdir()  # atomic: exactly one creator wins, also across hosts on a shared file system
            except FileExistsError:
                _remove_empty(made)
                return False
            made.append(folder)
    except BaseException:
        _remove_empty(made)
        raise
    return True


def _remove_empty(made: list[Path]) -> None:
    for m in reversed(made):
        try:
            m.rmdir()
        except OSError:  # no longer empty or already gone: leave it
            pass


def claim_run(run: Run, config: PPOConfig) -> str:
    """Create ``run``'s folders exclusively (once per run) and return its name.

    Called before anything of the run is written (``RecurrentPPO.learn``, the CLI before it prints
    the name). When a folder of ``run.name`` exists already, the run gets a new name (new random
    suffix, same time) and the claim is tried again. A claimed or adopted run (:func:`adopt_run`)
    keeps its name and folders (re-created when missing).

    Args:
        run: the run to claim (``name`` and ``claimed`` are updated in place).
        config: where the folders go (``runs_dir`` when ``track``, ``checkpoint_dir``).

    Raises:
        RunFolderError: every try found an existing folder.
        OSError: a folder cannot be created (permissions, read-only file system).
    """
    if run.claimed:
        for folder in run_folders(config, run.name):
            folder.mkdir(parents=True, exist_ok=True)
        return run.name
    name = run.name
    for _ in range(_MAX_TRIES):
        if _create_exclusively(run_folders(config, name)):
            run.name, run.claimed = name, True
            return name
        parts = name.split("__")
        unix_time = int(parts[3]) if len(parts) >= 5 and parts[3].isdigit() else None
        name = new_run_name(config, unix_time=unix_time)
    raise RunFolderError(f"could not create a fresh run folder for {run.name!r} after {_MAX_TRIES} tries "
                         f"(under {config.runs_dir!r} / {config.checkpoint_dir!r})")


def adopt_run(run: Run, name: str) -> None:
    """Make ``name`` the run's, writing into its existing folders on purpose (resume)."""
    run.name, run.claimed = name, True
