"""Run names and run folders: every run gets folders of its own (issue #15).

A run is named ``{env}__{exp_name}__{seed}__{unix_time}__{suffix}`` (CleanRL's name plus a short
random suffix), so two runs started in the same second with the same env, experiment name and
seed, on one host or on several sharing a file system, get different names. The name alone is not
trusted: :func:`claim_run` creates the run's folders (``runs_dir/name`` when tracking, and
``checkpoint_dir/name``) with exclusive ``mkdir`` and, should one exist already, draws a new
suffix and tries again, so a new run never writes into a folder it did not create.

A resumed run writes into its own folders on purpose: :func:`adopt_run` marks them as the
agent's without the exclusive check.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

__all__ = ["new_run_name", "run_folders", "claim_run", "adopt_run", "RunFolderError"]

_SUFFIX_BYTES = 3  # 6 hex digits: 16.7M names per (env, exp_name, seed, second)
_MAX_TRIES = 16


class RunFolderError(RuntimeError):
    """No fresh run folder could be created (each try found an existing one)."""


def new_run_name(config: Any, unix_time: int | None = None, suffix: str | None = None) -> str:
    """``{env}__{exp_name}__{seed}__{unix_time}__{suffix}`` ('/' and ':' in env ids become '_').

    Args:
        config: a PPOConfig (reads ``env_id``, ``exp_name``, ``seed``).
        unix_time: seconds since the epoch (default: now).
        suffix: the random part (default: 6 fresh hex digits from :mod:`secrets`).
    """
    t = int(time.time()) if unix_time is None else int(unix_time)
    suffix = secrets.token_hex(_SUFFIX_BYTES) if suffix is None else suffix
    env = config.env_id.replace("/", "_").replace(":", "_")
    return f"{env}__{config.exp_name}__{config.seed}__{t}__{suffix}"


def run_folders(config: Any, name: str) -> list[Path]:
    """The folders a run named ``name`` writes: ``runs_dir/name`` (when ``track``) and ``checkpoint_dir/name``."""
    out = [Path(config.runs_dir) / name] if config.track else []
    return out + [Path(config.checkpoint_dir) / name]


def _create_exclusively(folders: list[Path]) -> bool:
    """mkdir every folder, none pre-existing; on a clash remove the ones made here and return False."""
    made: list[Path] = []
    for folder in folders:
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            folder.mkdir()  # atomic: exactly one creator wins, also across hosts on a shared file system
        except FileExistsError:
            for m in reversed(made):
                m.rmdir()
            return False
        made.append(folder)
    return True


def claim_run(agent: Any) -> str:
    """Create the agent's run folders exclusively (once per agent) and return its run name.

    Called before anything of the run is written (``RecurrentPPO.learn``, the CLI before it prints
    the name). When a folder of ``agent.run_name`` exists already, the agent gets a new name (new
    random suffix, same time) and the claim is tried again. Resumed agents (:func:`adopt_run`)
    keep their name and folders.

    Raises:
        RunFolderError: every try found an existing folder.
        OSError: a folder cannot be created (permissions, read-only file system).
    """
    if getattr(agent, "_run_claimed", False):
        for folder in run_folders(agent.config, agent.run_name):
            folder.mkdir(parents=True, exist_ok=True)
        return agent.run_name
    name = agent.run_name
    for _ in range(_MAX_TRIES):
        if _create_exclusively(run_folders(agent.config, name)):
            agent.run_name = name
            agent._run_claimed = True
            return name
        parts = name.split("__")
        unix_time = int(parts[3]) if len(parts) >= 5 and parts[3].isdigit() else None
        name = new_run_name(agent.config, unix_time=unix_time)
    raise RunFolderError(f"could not create a fresh run folder for {agent.run_name!r} after {_MAX_TRIES} tries "
                         f"(under {agent.config.runs_dir!r} / {agent.config.checkpoint_dir!r})")


def adopt_run(agent: Any, name: str) -> None:
    """Make ``name`` the agent's run, writing into its existing folders on purpose (resume)."""
    agent.run_name = name
    agent._run_claimed = True
