"""Partially observable variants of classic-control tasks: velocities masked out.

These are the standard memory benchmarks of recurrent RL (e.g. the "NoVel" tasks of
sb3-contrib's RecurrentPPO benchmarks and the POMDP suites of Ni et al. 2022): the agent
sees positions only and must infer velocities from its history.

Registered ids (registration happens on ``import mamba_rl.envs``):

* ``mamba_rl/CartPoleNoVel-v1``  - CartPole-v1, observation ``[x, theta]`` (cart velocity and
  pole angular velocity removed); 500 steps max, reward threshold 475.
* ``mamba_rl/PendulumNoVel-v1``  - Pendulum-v1, observation ``[cos(theta), sin(theta)]``
  (angular velocity removed); 200 steps max.
* ``mamba_rl/MountainCarContinuousNoVel-v0`` - MountainCarContinuous-v0, observation
  ``[position]`` (velocity removed); 999 steps max, reward threshold 90.

The dynamics, rewards and time limits are gymnasium's own; only the observation changes.
"""

from __future__ import annotations

from typing import Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

__all__ = ["MaskObservation", "POMDP_ENV_IDS", "make_masked_env", "register_pomdp_envs"]


class MaskObservation(gym.ObservationWrapper):
    """Keep only the listed entries of a 1-D ``Box`` observation.

    Args:
        env: environment whose observation space is a 1-D ``gymnasium.spaces.Box``.
        keep: indices of the observation entries to keep, in the order given.

    Raises:
        TypeError: the observation space is not a 1-D Box.
        ValueError: ``keep`` is empty, repeats an index or has an index out of range.
    """

    def __init__(self, env: gym.Env, keep: Sequence[int]):
        super().__init__(env)
        space = env.observation_space
        if not isinstance(space, spaces.Box) or len(space.shape) != 1:
            raise TypeError(
                f"MaskObservation expects a 1-D Box observation space, got {space!r}"
            )
        if isinstance(keep, (str, bytes)) or any(isinstance(i, bool) or not isinstance(i, (int, np.integer))
                                                 for i in keep):
            raise ValueError(f"MaskObservation keep must be a sequence of int indices, got {keep!r}")
        keep = [int(i) for i in keep]
        n = space.shape[0]
        if not keep or len(set(keep)) != len(keep) or min(keep) < 0 or max(keep) >= n:
            raise ValueError(
                f"MaskObservation keep must be distinct indices in [0, {n}), got {keep}"
            )
        self._keep = np.asarray(keep, dtype=np.int64)
        self.observation_space = spaces.Box(
            low=space.low[self._keep], high=space.high[self._keep], dtype=space.dtype
        )

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[self._keep]


def make_masked_env(base_id: str, keep: Sequence[int], **kwargs) -> gym.Env:
    """Entry point of the masked ids: the raw ``base_id`` env wrapped in ``MaskObservation``.

    The raw env is taken from ``gym.make(base_id).unwrapped`` so that the only wrappers are
    ``MaskObservation`` and those the outer ``gym.make`` of the masked id adds (one TimeLimit,
    order enforcing, env checker). ``kwargs`` (e.g. ``render_mode``) go to the base env.
    Module-level so that the env (and its spec) pickle.
    """
    env = gym.make(base_id, max_episode_steps=None, disable_env_checker=True, **kwargs)
    return MaskObservation(env.unwrapped, keep)


# id -> (base id, kept indices, max_episode_steps, reward_threshold)
POMDP_ENV_IDS = {
    "mamba_rl/CartPoleNoVel-v1": ("CartPole-v1", (0, 2), 500, 475.0),
    "mamba_rl/PendulumNoVel-v1": ("Pendulum-v1", (0, 1), 200, None),
    "mamba_rl/MountainCarContinuousNoVel-v0": ("MountainCarContinuous-v0", (0,), 999, 90.0),
}


def register_pomdp_envs() -> None:
    """Register the velocity-masked ids listed in ``POMDP_ENV_IDS`` (idempotent)."""
    for env_id, (base_id, keep, max_steps, threshold) in POMDP_ENV_IDS.items():
        if env_id in gym.registry:
            continue
        gym.register(
            id=env_id,
            entry_point=make_masked_env,
            kwargs={"base_id": base_id, "keep": list(keep)},
            max_episode_steps=max_steps,
            reward_threshold=threshold,
        )
