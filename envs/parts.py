"""Stepping a vector env in parts: act on one group of sub-envs while another group's envs step.

A vector env whose sub-envs fall into fixed row ranges that step independently (an
:class:`~mamba_rl.envs.EnvPoolVecEnv` with ``parts=2``: two EnvPool pools, each stepping in its own C++ threads
with the GIL released) offers, besides ``step``:

* ``part_rows``: a tuple of ``slice`` objects over the N sub-envs, in order, covering all of them;
* ``send_part(part, actions)``: start stepping the sub-envs of ``part_rows[part]`` (``actions``: their rows);
  returns at once;
* ``recv_part(part)``: wait for that step; returns ``(obs, rewards, terminations, truncations, info)`` of those
  rows, as ``step`` returns them for all rows (NextStep autoreset).

The wrappers this package stacks over such an env (:class:`~mamba_rl.envs.EnvGuard`,
:class:`~mamba_rl.envs.VecEpisodeStatistics`, :class:`~mamba_rl.envs.VecNormalizeObservation`,
:class:`~mamba_rl.envs.VecNormalizeReward`) are :class:`PartedStep` wrappers: one ``_post(rows, ...)`` does their
work for ``step`` (``rows = slice(None)``, unchanged results) and for ``recv_part`` (the part's rows; per-env
accumulators are sliced by rows, and running statistics are shared by the parts: each part's rows update them in
turn, the parallel-Welford merge of the two halves, which equals the update with all rows up to rounding; the
second half of a step is normalised with the first half's update already in). :func:`env_part_rows` says whether
a whole stack can step in parts. The rollout (:func:`mamba_rl.agents.rollout.collect_rollout`) uses it to act on
one half while the other half's pool steps (issue 25's "two halves").
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

__all__ = ["PartedStep", "env_part_rows"]


class PartedStep:
    """Mixin for a ``gymnasium.vector.VectorWrapper`` whose per-step work is ``_post(rows, obs, rewards,
    terminations, truncations, info)`` on the rows it got: ``step`` and ``recv_part`` both go through it.
    Put it first in the bases, so that its ``step`` is the one used."""

    def _post(self, rows: slice, obs: Any, rewards: Any, terminations: Any, truncations: Any,
              info: dict[str, Any]) -> tuple:
        raise NotImplementedError

    def step(self, actions: Any):
        """Step every sub-env and apply this wrapper to all rows."""
        return self._post(slice(None), *self.env.step(actions))

    @property
    def part_rows(self) -> tuple[slice, ...]:
        """The inner env's row ranges (see the module doc)."""
        return self.env.part_rows

    def send_part(self, part: int, actions: Any) -> None:
        """Start stepping the sub-envs of ``part_rows[part]`` (see the module doc)."""
        self.env.send_part(part, actions)

    def recv_part(self, part: int) -> tuple:
        """Wait for ``part``'s step and apply this wrapper to its rows (see the module doc)."""
        return self._post(self.part_rows[part], *self.env.recv_part(part))


def env_part_rows(envs: gym.vector.VectorEnv) -> tuple[slice, ...] | None:
    """The row ranges a vector-env stack can step separately, or None: every wrapper is a :class:`PartedStep`
    and the innermost env has ``part_rows`` with more than one part, ``send_part`` and ``recv_part``."""
    env = envs
    while isinstance(env, gym.vector.VectorWrapper):
        if not isinstance(env, PartedStep):
            return None
        env = env.env
    rows = getattr(env, "part_rows", None)
    if rows is None or len(rows) < 2 or not (callable(getattr(env, "send_part", None))
                                             and callable(getattr(env, "recv_part", None))):
        return None
    return tuple(rows)
