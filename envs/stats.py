"""Vector-level episode statistics and reward normalisation with less work per vector step.

:class:`VecEpisodeStatistics` and :class:`VecNormalizeReward` are gymnasium's vector
``RecordEpisodeStatistics`` and ``NormalizeReward`` (they subclass them, so ``find_vector_wrapper``, the
checkpoints, evaluation and the data-parallel statistics merge find them as before) with a ``step`` that
gives bit-identical results with fewer numpy calls:

* the boolean-mask gathers and scatters of the originals become whole-array updates followed by a masked
  ``copyto`` for the sub-envs at a NextStep reset step (the same elements, dtypes and order of operations
  for every sub-env whose value is kept);
* the running statistics of the discounted return take the batch mean and variance from one reduction
  each (:func:`mean_var`), the very reductions ``np.mean`` / ``np.var`` run, instead of two full calls.

Both support gymnasium's three autoreset modes as the originals do; the tests compare them with the
originals step by step over random episodes. They, and :class:`VecNormalizeObservation` (gymnasium's vector
``NormalizeObservation``), also step in parts (:mod:`mamba_rl.envs.parts`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.wrappers.vector import NormalizeObservation, NormalizeReward, RecordEpisodeStatistics

from .parts import PartedStep

__all__ = ["VecEpisodeStatistics", "VecNormalizeReward", "VecNormalizeObservation", "mean_var"]


def mean_var(x: np.ndarray) -> tuple[np.generic, np.generic]:
    """``(np.mean(x, axis=0), np.var(x, axis=0))`` of a 1-D float array, bit for bit, from one sum each.

    ``np.mean`` is ``add.reduce(x) / n`` cast to x's dtype, ``np.var`` the same sum over ``(x - mean)**2``
    (numpy's ``_methods._mean`` / ``_var``, with ``n`` as an ``intp``); this computes exactly those two sums.

    Raises:
        ValueError: ``x`` is not a non-empty 1-D float array.
    """
    if x.ndim != 1 or x.dtype.kind != "f" or x.shape[0] == 0:
        raise ValueError(f"mean_var: expected a non-empty 1-D float array, got {x.dtype} {x.shape}")
    n = np.intp(x.shape[0])
    t = x.dtype.type
    mean = t(np.add.reduce(x) / n)
    d = np.subtract(x, mean)
    np.multiply(d, d, out=d)
    return mean, t(np.add.reduce(d) / n)


class VecEpisodeStatistics(PartedStep, RecordEpisodeStatistics):
    """gymnasium's vector ``RecordEpisodeStatistics`` (same attributes, queues and ``info["episode"]``),
    stepping without masked updates when no sub-env finished at the previous step.

    Args:
        env: the vector env. buffer_length: length of the return / length / time queues.
        stats_key: the info key of the statistics ("episode").
    """

    def _post(self, rows: slice, observations: Any, rewards: Any, terminations: Any, truncations: Any,
              infos: dict[str, Any]):
        """Record the statistics of the sub-envs ``rows`` (all: gymnasium's ``RecordEpisodeStatistics.step``)."""
        if not isinstance(infos, dict):
            raise ValueError(f"VecEpisodeStatistics needs the vector env's info to be a dict, got {type(infos).__name__}")
        prev = self.prev_dones[rows]
        returns, lengths, starts = self.episode_returns[rows], self.episode_lengths[rows], self.episode_start_times[rows]
        returns += rewards
        lengths += 1
        if self._autoreset_mode != AutoresetMode.SAME_STEP and prev.any():
            # the NextStep reset step after a done starts the next episode's statistics at 0 (not counted)
            np.copyto(returns, 0.0, where=prev)
            np.copyto(lengths, 0, where=prev)
            np.copyto(starts, time.perf_counter(), where=prev)
        dones = np.logical_or(terminations, truncations)
        self.prev_dones[rows] = dones
        if dones.any():
            num_dones = np.sum(dones)
            key = self._stats_key
            if key in infos or f"_{key}" in infos:
                raise ValueError(f"Attempted to add episode stats with key '{key}' but this key already exists in "
                                 f"info: {list(infos.keys())}")
            episode_time_length = np.round(time.perf_counter() - starts, 6)
            infos[key] = {"r": np.where(dones, returns, 0.0),
                          "l": np.where(dones, lengths, 0),
                          "t": np.where(dones, episode_time_length, 0.0)}
            infos[f"_{key}"] = dones
            self.episode_count += num_dones
            idx = np.nonzero(dones)[0]
            for queue, values in ((self.time_queue, episode_time_length), (self.return_queue, returns),
                                  (self.length_queue, lengths)):
                # a bounded deque keeps its last maxlen items: extending with only those leaves the same deque
                queue.extend(values[idx if queue.maxlen is None else idx[-queue.maxlen:]])
            if self._autoreset_mode == AutoresetMode.SAME_STEP:
                returns[dones] = 0
                lengths[dones] = 0
                starts[dones] = time.perf_counter()
        return observations, rewards, terminations, truncations, infos


class VecNormalizeReward(PartedStep, NormalizeReward):
    """gymnasium's vector ``NormalizeReward`` (same attributes: ``return_rms``, ``accumulated_reward``,
    ``gamma``, ``epsilon``, ``update_running_mean``), giving bit-identical rewards and statistics with fewer
    numpy calls per step.

    It follows gymnasium 1.4's semantics whatever gymnasium is installed: the step after a NextStep
    autoreset leaves the accumulated return alone, and a SameStep reset starts a new return at once.
    gymnasium 1.2's own wrapper has neither rule (and none of the attributes that carry them), so this class
    keeps its own ``_autoreset_mode`` and ``_prev_dones``.

    Args:
        env: the vector env. gamma: the discount of the accumulated return. epsilon: added to the variance.
    """

    def __init__(self, env: VectorEnv, gamma: float = 0.99, epsilon: float = 1e-8):
        super().__init__(env, gamma=gamma, epsilon=epsilon)
        self._prev_dones = np.zeros((self.num_envs,), dtype=np.float32)
        self._autoreset_mode = self.env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Reset the envs and clear the accumulated returns and the previous dones."""
        self.accumulated_reward[:] = 0
        self._prev_dones[:] = 0
        return self.env.reset(seed=seed, options=options)

    def _post(self, rows: slice, obs: Any, reward: Any, terminated: Any, truncated: Any, info: dict[str, Any]):
        """Scale the rewards of the sub-envs ``rows`` by the running std of the discounted return."""
        same_step = self._autoreset_mode == AutoresetMode.SAME_STEP
        acc, prev_dones = self.accumulated_reward[rows], self._prev_dones[rows]
        update = acc * self.gamma * (1 - terminated) + reward  # the original's expression, for every sub-env
        if same_step or not prev_dones.any():  # every sub-env active
            acc[:] = update
            if self._update_running_mean:
                self._update_rms(acc)
        else:  # the reset step of a NextStep env leaves its return alone
            active = prev_dones == 0
            np.copyto(acc, update, where=active, casting="same_kind")
            if self._update_running_mean and active.any():
                self._update_rms(acc[active])
        dones = np.logical_or(terminated, truncated)
        prev_dones[:] = dones
        if same_step:
            acc[dones] = 0
        return obs, reward / np.sqrt(self.return_rms.var + self.epsilon), terminated, truncated, info

    def _update_rms(self, x: np.ndarray) -> None:
        """``self.return_rms.update(x)`` with the batch moments of :func:`mean_var`."""
        mean, var = mean_var(x)
        self.return_rms.update_from_moments(mean, var, x.shape[0])


class VecNormalizeObservation(PartedStep, NormalizeObservation):
    """gymnasium's vector ``NormalizeObservation`` (same ``obs_rms``, ``epsilon``, ``update_running_mean`` and
    results) that also steps in parts (:mod:`mamba_rl.envs.parts`: each part's rows update the shared ``obs_rms``
    and are normalised with it).

    Args:
        env: the vector env. epsilon: added to the variance.
    """

    def _post(self, rows: slice, obs: Any, reward: Any, terminated: Any, truncated: Any, info: dict[str, Any]):
        """Update the running statistics with the observations of ``rows`` and normalise them."""
        return self.observations(obs), reward, terminated, truncated, info
