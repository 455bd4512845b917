"""Episode evaluation of a :class:`~mamba_rl.agents.policy.Policy` in a fresh single env.

Each env step is one backbone step: :meth:`Policy.act` gives the action and the critic value of
the same observation together. The memory is reset at every episode start (zero recurrent
state, zero previous action and reward), as in docs/architecture.md, "Reset semantics".
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

from mamba_rl.envs import find_vector_wrapper, make_env

from .policy import Policy
from .validation import check_int

__all__ = ["EvalResult", "evaluate_policy"]


@dataclass
class EvalResult:
    """Outcome of :func:`evaluate_policy` / :meth:`RecurrentPPO.evaluate`.

    Attributes:
        returns: [episodes] float64 undiscounted returns. lengths: [episodes] int64 steps.
        values: per episode, the [length] float32 critic values along the episode.
    """

    returns: np.ndarray
    lengths: np.ndarray
    values: list

    @property
    def mean(self) -> float:
        return float(np.mean(self.returns))

    @property
    def std(self) -> float:
        return float(np.std(self.returns))


def reward_scale_of(train_envs: gym.vector.VectorEnv | None) -> float:
    """The factor the training envs' NormalizeReward applied to rewards (what the prev-reward input saw):
    1 / sqrt(return variance + epsilon) of its current statistics, 1.0 without one."""
    rnorm = None if train_envs is None else find_vector_wrapper(train_envs, gym.wrappers.vector.NormalizeReward)
    return 1.0 if rnorm is None else float(1.0 / np.sqrt(rnorm.return_rms.var + rnorm.epsilon))


def obs_normaliser(train_envs: gym.vector.VectorEnv | None) -> Callable[[np.ndarray], np.ndarray]:
    """The training envs' observation normalisation with its statistics frozen, as a function of flat raw
    observations [B, obs_dim] (or [obs_dim]) to float32 (gymnasium's NormalizeObservation formula:
    (obs - mean) / sqrt(var + epsilon), read from the live statistics at each call); the identity without one."""
    norm = None if train_envs is None else find_vector_wrapper(train_envs, gym.wrappers.vector.NormalizeObservation)
    if norm is None:
        return lambda obs: obs
    return lambda obs: ((obs - norm.obs_rms.mean) / np.sqrt(norm.obs_rms.var + norm.epsilon)).astype(np.float32)


def evaluate_policy(policy: Policy, env_id: str, num_episodes: int = 10, deterministic: bool = False,
                    seed: int = 0, video_dir: str | None = None, train_envs: gym.vector.VectorEnv | None = None,
                    generator: torch.Generator | None = None, progress: bool = False,
                    joint_action: bool = False) -> EvalResult:
    """Run ``num_episodes`` episodes of ``env_id``, resetting the memory per episode.

    Args:
        policy: the policy to act with (one backbone step per env step).
        env_id: the env, built with :func:`mamba_rl.envs.make_env`.
        num_episodes: >= 1. Episode k resets the env with seed ``seed + k``.
        deterministic: the mode of the action distribution instead of a sample.
        video_dir: record videos there (gymnasium RecordVideo) when given.
        train_envs: the training vector env: its observation normalisation statistics are applied,
            frozen, and its reward normalisation scales the previous-reward input (frozen).
        generator: the sampling generator. Give evaluation a generator of its own (as
            ``RecurrentPPO.evaluate`` does): sharing the rollout's would change the training run.
        progress: show a tqdm bar (on stderr) over the episodes, with the running mean return.
        joint_action: build the env with :class:`mamba_rl.envs.JointAction` (as a policy trained with
            ``PPOConfig.joint_action`` saw it).

    Returns:
        :class:`EvalResult` with returns, lengths and per-step critic values.

    Raises:
        ValueError: ``num_episodes`` not an int >= 1; ``seed`` not an int with ``seed + num_episodes - 1`` in
            [0, 2**32 - 1] (gymnasium's seed range).
    """
    check_int("num_episodes", num_episodes, lo=1)
    check_int("seed", seed, lo=0, hi=2**32 - num_episodes)
    env = make_env(env_id, capture_video=video_dir is not None, video_dir=video_dir or "videos",
                   joint_action=joint_action)
    normalise, reward_scale = obs_normaliser(train_envs), reward_scale_of(train_envs)
    returns, lengths, values = [], [], []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=num_episodes, unit="episode", dynamic_ncols=True, file=sys.stderr)
    try:
        for ep in range(num_episodes):
            obs, _ = env.reset(seed=seed + ep)
            state, start, reward = policy.initial_state(1), True, 0.0
            total, steps, vals = 0.0, 0, []
            while True:
                action, state, value = policy.act(normalise(obs[None]), state, episode_start=[start],
                                                  deterministic=deterministic, reward=[reward * reward_scale],
                                                  generator=generator)
                vals.append(float(value[0]))
                obs, reward, term, trunc, _ = env.step(action[0])
                total += float(reward)
                steps += 1
                start = False
                if term or trunc:
                    break
            returns.append(total)
            lengths.append(steps)
            values.append(np.asarray(vals, dtype=np.float32))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(ret=f"{np.mean(returns):.1f}", refresh=False)
    finally:
        if bar is not None:
            bar.close()
        env.close()
    return EvalResult(np.asarray(returns, dtype=np.float64), np.asarray(lengths, dtype=np.int64), values)
