"""Picklable observation and action wrappers and helpers over a vector-env stack.

:class:`FlattenObs` / :class:`Float32Obs` (one env) and :class:`FlattenVecObs` (a vector env) are
gymnasium's FlattenObservation / DtypeObservation without the lambdas that keep envs from being
pickled (checkpointed mid-episode). :class:`JointAction` turns a MultiDiscrete action into one Discrete. :func:`find_vector_wrapper` finds a wrapper in a stack,
:func:`finished_episodes` reads RecordEpisodeStatistics' info.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from .envpool_backend import EnvPoolVecEnv

__all__ = ["FlattenObs", "Float32Obs", "UnsupportedSpace", "UnsupportedObservationSpace", "UnsupportedActionSpace", "JointAction", "MAX_JOINT_ACTIONS", "joined_already", "FlattenVecObs", "needs_flatten", "flatten_vec_obs", "find_vector_wrapper",
           "finished_episodes", "finished_episode_arrays", "raw_observation_space", "requires_prev_action"]


class FlattenObs(gym.ObservationWrapper):
    """Flatten any flattenable observation space into one 1-D Box (discrete parts one-hot), as
    ``gymnasium.wrappers.FlattenObservation`` does, but picklable (no lambda inside), so that
    vector envs of such envs can be checkpointed mid-episode."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self._inner_space = env.observation_space
        self.observation_space = spaces.flatten_space(env.observation_space)

    def observation(self, observation: Any) -> np.ndarray:
        return spaces.flatten(self._inner_space, observation)


class UnsupportedSpace(TypeError):
    """An env's space that the agent takes in no form; ``kind`` says which ("action" / "observation"). A
    TypeError, as before these had classes of their own; the CLI reports it as bad input, naming the kind."""

    kind = "env"


class UnsupportedObservationSpace(UnsupportedSpace):
    """An observation space that does not flatten to a Box (gymnasium's Graph, Sequence, or a space holding one)."""

    kind = "observation"


class UnsupportedActionSpace(UnsupportedSpace):
    """An action space other than Discrete, 1-D MultiDiscrete or Box, or a discrete one without any action (the
    agent's heads: mamba_rl.agents.heads)."""

    kind = "action"


class Float32Obs(gym.ObservationWrapper):
    """Cast a Box observation to float32 (``gymnasium.wrappers.DtypeObservation``, picklable).

    Raises:
        UnsupportedObservationSpace: the observation space is not a Box (after any flattening)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        space = env.observation_space
        if not isinstance(space, spaces.Box):
            raise UnsupportedObservationSpace(f"expected one that flattens to a Box (Box, Discrete, MultiDiscrete, "
                                              f"MultiBinary, Text, Tuple / Dict of them), got {space!r}")
        self.observation_space = spaces.Box(space.low.astype(np.float32), space.high.astype(np.float32),
                                            shape=space.shape, dtype=np.float32)

    def observation(self, observation: Any) -> np.ndarray:
        return np.asarray(observation, dtype=np.float32)


MAX_JOINT_ACTIONS = 4096  # JointAction's largest product of nvec


class JointAction(gym.ActionWrapper):
    """A ``MultiDiscrete(nvec)`` action space as one ``Discrete(prod(nvec))``: joint action ``k`` is the
    row-major index of the components (``numpy.unravel_index(k, nvec)``; for POPGym's Battleship ``row * cols +
    col``), and each component's ``start`` is added back for the env. A policy's categorical over the joint action
    can put its mass on any set of combinations (say "any cell not yet shot"), which a product of independent
    per-component categoricals cannot. Picklable (no lambda inside).

    Raises:
        ValueError: an action space that is not a 1-D MultiDiscrete, or one of more than
            :data:`MAX_JOINT_ACTIONS` combinations (the policy's logits grow with them).
    """

    def __init__(self, env: gym.Env):
        super().__init__(env)
        space = env.action_space
        if not isinstance(space, spaces.MultiDiscrete) or space.nvec.ndim != 1:
            raise ValueError(f"JointAction: expected a 1-D MultiDiscrete action space, got {' '.join(repr(space).split())}")
        self.nvec = tuple(int(v) for v in space.nvec)
        self.start = np.asarray(space.start, dtype=space.dtype)
        n = int(np.prod(self.nvec))
        if n > MAX_JOINT_ACTIONS:
            raise ValueError(f"JointAction: expected at most {MAX_JOINT_ACTIONS} joint actions, got prod(nvec) = {n} "
                             f"(nvec {list(self.nvec)})")
        self._dtype = space.dtype
        self.action_space = spaces.Discrete(n)

    def action(self, action: Any) -> np.ndarray:
        return (np.asarray(np.unravel_index(int(action), self.nvec)) + self.start).astype(self._dtype)


def joined_already(envs: gym.vector.VectorEnv) -> bool:
    """Whether a vector env acts through :class:`JointAction`: a Discrete single action space and, where the
    sub-envs live in this process (SyncVectorEnv), a JointAction in its first sub-env's wrapper chain. An
    AsyncVectorEnv's sub-envs live in its workers, so its Discrete space is taken at its word."""
    if not isinstance(envs.single_action_space, spaces.Discrete):
        return False
    base = envs.unwrapped
    if not isinstance(base, gym.vector.SyncVectorEnv):
        return True
    e = base.envs[0]
    while e is not None:
        if isinstance(e, JointAction):
            return True
        e = getattr(e, "env", None)
    return False


def needs_flatten(space: spaces.Space) -> bool:
    """True unless ``space`` is already a 1-D float32 ``Box`` (the backbone's input format)."""
    return not (
        isinstance(space, spaces.Box) and len(space.shape) == 1 and space.dtype == np.float32
    )


class FlattenVecObs(gym.vector.VectorObservationWrapper):
    """Vector counterpart of :class:`FlattenObs` + :class:`Float32Obs`: every sub-env's observation
    flattened (discrete parts one-hot) into a float32 row. Picklable, unlike gymnasium's vector
    FlattenObservation / DtypeObservation."""

    def __init__(self, env: gym.vector.VectorEnv):
        super().__init__(env)
        self._inner_single = env.single_observation_space
        flat = spaces.flatten_space(self._inner_single)
        self.single_observation_space = spaces.Box(flat.low.astype(np.float32), flat.high.astype(np.float32),
                                                   shape=flat.shape, dtype=np.float32)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, env.num_envs)

    def observations(self, observations: Any) -> np.ndarray:
        rows = gym.vector.utils.iterate(self.env.observation_space, observations)
        return np.stack([spaces.flatten(self._inner_single, o) for o in rows]).astype(np.float32, copy=False)


def find_vector_wrapper(env: gym.vector.VectorEnv, wrapper_type: type) -> gym.vector.VectorEnv | None:
    """Return the outermost wrapper of type ``wrapper_type`` in a vector-env stack, or None."""
    while True:
        if isinstance(env, wrapper_type):
            return env
        inner = getattr(env, "env", None)
        if inner is None or inner is env:
            return None
        env = inner


def finished_episode_arrays(info: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(returns [E] float64, lengths [E] int64) of the E sub-envs whose episode ended at this step, in sub-env
    order, from the ``info`` of a vector env wrapped in ``RecordEpisodeStatistics`` (raw, unnormalised
    returns); two empty arrays when none ended."""
    if "_episode" not in info:
        return np.zeros(0, dtype=np.float64), np.zeros(0, dtype=np.int64)
    idx = np.flatnonzero(info["_episode"])
    ep = info["episode"]
    return np.asarray(ep["r"])[idx].astype(np.float64), np.asarray(ep["l"])[idx].astype(np.int64)


def finished_episodes(info: dict[str, Any]) -> list[tuple[float, int]]:
    """(return, length) of every sub-env whose episode ended at this step, from the ``info`` of a
    vector env wrapped in ``RecordEpisodeStatistics`` (raw, unnormalised returns)."""
    rets, lens = finished_episode_arrays(info)
    return list(zip(rets.tolist(), lens.tolist()))


def flatten_vec_obs(envs: gym.vector.VectorEnv) -> gym.vector.VectorEnv:
    """``envs``, wrapped in :class:`FlattenVecObs` unless its observations are a 1-D float32 Box already."""
    return FlattenVecObs(envs) if needs_flatten(envs.single_observation_space) else envs


def raw_observation_space(envs: gym.vector.VectorEnv, env_id: str | None = None,
                          env_kwargs: dict[str, Any] | None = None) -> spaces.Space | None:
    """The single-env observation space before this package's flattening, read from the stack: the space a
    :class:`FlattenVecObs` flattens, else (a SyncVectorEnv) the one its first sub-env's :class:`FlattenObs`
    flattens, else that sub-env's own (its outermost wrapper's), or an EnvPool vector env's single observation space.
    For an AsyncVectorEnv without FlattenVecObs (the sub-envs live in the workers): the space of one env of
    ``env_id`` (with ``env_kwargs``) built here, or None without an id."""
    vec = find_vector_wrapper(envs, FlattenVecObs)
    if vec is not None:
        return vec._inner_single
    if isinstance(envs.unwrapped, EnvPoolVecEnv):
        return envs.unwrapped.single_observation_space
    if not isinstance(envs.unwrapped, gym.vector.SyncVectorEnv):
        return None if env_id is None else _ask_one_env(env_id, env_kwargs, lambda env: env.observation_space)
    first = envs.unwrapped.envs[0]
    e = first
    while e is not None:
        if isinstance(e, FlattenObs):
            return e._inner_space
        e = getattr(e, "env", None)
    return first.observation_space


def requires_prev_action(envs: gym.vector.VectorEnv, env_id: str | None = None,
                         env_kwargs: dict[str, Any] | None = None) -> bool:
    """Whether the env declares that its observation alone is not enough without the previous action: POPGym's
    ``obs_requires_prev_action`` (Morad et al. 2023; True for MultiarmedBandit, Battleship, Concentration and
    their levels), read off the base env (``env.unwrapped``). A SyncVectorEnv is asked directly (True if any
    sub-env says so); an AsyncVectorEnv's sub-envs live in its workers, so one env of ``env_id`` (with
    ``env_kwargs``) is built here and asked, and without an id the answer is False, as for an EnvPool vector env
    (no POPGym task runs there) and for any env that does not define the attribute."""
    base = envs.unwrapped
    if isinstance(base, gym.vector.SyncVectorEnv):
        return any(bool(getattr(e.unwrapped, "obs_requires_prev_action", False)) for e in base.envs)
    if isinstance(base, EnvPoolVecEnv) or env_id is None:
        return False
    return _ask_one_env(env_id, env_kwargs, lambda env: bool(getattr(env.unwrapped, "obs_requires_prev_action", False)))


def _ask_one_env(env_id: str, env_kwargs: dict[str, Any] | None, read: Any) -> Any:
    """``read(env)`` of one unflattened env of ``env_id`` built here and closed after: what an AsyncVectorEnv's
    sub-envs, which live in its workers, would answer."""
    from .vector import make_env  # vector imports this module

    env = make_env(env_id, flatten_obs=False, env_kwargs=env_kwargs)
    try:
        return read(env)
    finally:
        env.close()
