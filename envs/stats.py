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
originals step by step over random episodes.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.wrappers.vector import NormalizeReward, RecordEpisodeStatistics

__all__ = ["VecEpisodeStatistics", "VecNormalizeReward", "mean_var"]


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


class VecEpisodeStatistics(RecordEpisodeStatistics):
    """gymnasium's vector ``RecordEpisodeStatistics`` (same attributes, queues and ``info["episode"]``),
    stepping without masked updates when no sub-env finished at the previous step.

    Args:
        env: the vector env. buffer_length: length of the return / length / time queues.
        stats_key: the info key of the statistics ("episode").
    """

    def step(self, actions: Any):
        """Step the envs and record the statistics (see gymnasium's ``RecordEpisodeStatistics.step``)."""
        observations, rewards, terminations, truncations, infos = self.env.step(actions)
        if not isinstance(infos, dict):
            raise ValueError(f"VecEpisodeStatistics needs the vector env's info to be a dict, got {type(infos).__name__}")
        prev = self.prev_dones
        self.episode_returns += rewards
        self.episode_lengths += 1
        if self._autoreset_mode != AutoresetMode.SAME_STEP and prev.any():
            # the NextStep reset step after a done starts the next episode's statistics at 0 (not counted)
            np.copyto(self.episode_returns, 0.0, where=prev)
            np.copyto(self.episode_lengths, 0, where=prev)
            np.copyto(self.episode_start_times, time.perf_counter(), where=prev)
        self.prev_dones = dones = np.logical_or(terminations, truncations)
        if dones.any():
            num_dones = np.sum(dones)
            key = self._stats_key
            if key in infos or f"_{key}" in infos:
                raise ValueError(f"Attempted to add episode stats with key '{key}' but this key already exists in "
                                 f"info: {list(infos.keys())}")
            episode_time_length = np.round(time.perf_counter() - self.episode_start_times, 6)
            infos[key] = {"r": np.where(dones, self.episode_returns, 0.0),
                          "l": np.where(dones, self.episode_lengths, 0),
                          "t": np.where(dones, episode_time_length, 0.0)}
            infos[f"_{key}"] = dones
            self.episode_count += num_dones
            idx = np.nonzero(dones)[0]
            for queue, values in ((self.time_queue, episode_time_length), (self.return_queue, self.episode_returns),
                                  (self.length_queue, self.episode_lengths)):
                # a bounded deque keeps its last maxlen items: extending with only those leaves the same deque
                queue.extend(values[idx if queue.maxlen is None else idx[-queue.maxlen:]])
            if self._autoreset_mode == AutoresetMode.SAME_STEP:
                self.episode_returns[dones] = 0
                self.episode_lengths[dones] = 0
                self.episode_start_times[dones] = time.perf_counter()
        return observations, rewards, terminations, truncations, infos


class VecNormalizeReward(NormalizeReward):
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

    def step(self, actions: Any):
        """Step the envs and scale the rewards by the running std of the discounted return."""
        obs, reward, terminated, truncated, info = self.env.step(actions)
        same_step = self._autoreset_mode == AutoresetMode.SAME_STEP
        acc = self.accumulated_reward
        update = acc * self.gamma * (1 - terminated) + reward  # the original's expression, for every sub-env
        if same_step or not self._prev_dones.any():  # every sub-env active
            acc[:] = update
            if self._update_running_mean:
                self._update_rms(acc)
        else:  # the reset step of a NextStep env leaves its return alone
            active = self._prev_dones == 0
            np.copyto(acc, update, where=active, casting="same_kind")
            if self._update_running_mean and active.any():
                self._update_rms(acc[active])
        dones = np.logical_or(terminated, truncated)
        self._prev_dones = dones.astype(np.float32)
        if same_step:
            acc[dones] = 0
        return obs, reward / np.sqrt(self.return_rms.var + self.epsilon), terminated, truncated, info

    def _update_rms(self, x: np.ndarray) -> None:
        """``self.return_rms.update(x)`` with the batch moments of :func:`mean_var`."""
        mean, var = mean_var(x)
        self.return_rms.update_from_moments(mean, var, x.shape[0])
