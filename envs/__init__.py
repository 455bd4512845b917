"""Environments for mamba_rl: a gymnasium vector-env factory and POMDP (velocity-masked) tasks.

``make_vec_env`` builds a ``gymnasium.vector`` env from any registered id - gymnasium's own,
the ``mamba_rl/*NoVel*`` ids registered here, or POPGym's ``popgym-*`` ids (optional extra:
``pip install -e .[popgym]``; the ``popgym`` package is imported on first use of such an id).
Everything is gymnasium's: ``SyncVectorEnv``/``AsyncVectorEnv`` in the default NextStep
autoreset mode, ``RecordEpisodeStatistics``, ``FlattenObservation``, ``NormalizeObservation``
and ``RecordVideo``.
"""

from __future__ import annotations

import functools
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from .pomdp import POMDP_ENV_IDS, MaskObservation, make_masked_env, register_pomdp_envs

__all__ = [
    "make_env",
    "make_vec_env",
    "adopt_vec_env",
    "finished_episodes",
    "find_vector_wrapper",
    "needs_flatten",
    "MaskObservation",
    "POMDP_ENV_IDS",
    "make_masked_env",
    "register_pomdp_envs",
]

register_pomdp_envs()


def _ensure_registered(env_id: str) -> None:
    """Import the package that registers ``env_id`` when it is a POPGym id."""
    if env_id.startswith("popgym") and env_id not in gym.registry:
        try:
            import popgym  # noqa: F401  (registers the popgym-* ids)
        except ImportError as err:
            raise ImportError(
                f"env id {env_id!r} needs the optional 'popgym' package: "
                "pip install -e .[popgym]  (or pip install popgym)"
            ) from err
    if env_id not in gym.registry:
        raise gym.error.NameNotFound(
            f"unknown env id {env_id!r}; expected a registered gymnasium id such as "
            f"'CartPole-v1', one of {sorted(POMDP_ENV_IDS)} or a 'popgym-*' id"
        )


def needs_flatten(space: spaces.Space) -> bool:
    """True unless ``space`` is already a 1-D float32 ``Box`` (the backbone's input format)."""
    return not (
        isinstance(space, spaces.Box) and len(space.shape) == 1 and space.dtype == np.float32
    )


def make_env(
    env_id: str,
    idx: int = 0,
    capture_video: bool = False,
    video_dir: str = "videos",
    flatten_obs: bool = True,
    env_kwargs: dict[str, Any] | None = None,
) -> gym.Env:
    """Build one (non-vector) env: ``gym.make`` plus optional video and flattening.

    Args:
        env_id: a registered gymnasium id (see module doc).
        idx: index of this env in its vector env; only env 0 records video.
        capture_video: record episodes of env 0 with ``gymnasium.wrappers.RecordVideo``
            (needs ``render_mode="rgb_array"`` support and moviepy).
        video_dir: folder the videos go to.
        flatten_obs: flatten Box/Discrete/MultiDiscrete/Tuple/Dict observations into one
            float32 vector with ``gymnasium.wrappers.FlattenObservation`` (discrete parts
            become one-hot) followed by ``DtypeObservation(float32)``.
        env_kwargs: extra keyword arguments for ``gym.make``.

    Raises:
        ImportError: a ``popgym-*`` id without the popgym package.
        gymnasium.error.NameNotFound: unknown id.
    """
    _ensure_registered(env_id)
    kwargs = dict(env_kwargs or {})
    record = capture_video and idx == 0
    if record:
        kwargs["render_mode"] = "rgb_array"
    env = gym.make(env_id, **kwargs)
    if record:
        env = gym.wrappers.RecordVideo(env, video_dir, disable_logger=True)
    if flatten_obs and needs_flatten(env.observation_space):
        if not (isinstance(env.observation_space, spaces.Box) and len(env.observation_space.shape) == 1):
            env = gym.wrappers.FlattenObservation(env)
        if env.observation_space.dtype != np.float32:
            env = gym.wrappers.DtypeObservation(env, np.float32)
    return env


def make_vec_env(
    env_id: str,
    num_envs: int = 8,
    seed: int | None = None,
    async_: bool = False,
    capture_video: bool = False,
    video_dir: str = "videos",
    normalize_obs: bool = False,
    flatten_obs: bool = True,
    env_kwargs: dict[str, Any] | None = None,
    normalize_reward: bool = False,
    gamma: float = 0.99,
) -> gym.vector.VectorEnv:
    """Build a gymnasium vector env of ``num_envs`` copies of ``env_id``.

    The stack, innermost first: per env ``make_env`` (gym.make, RecordVideo on env 0,
    FlattenObservation); ``SyncVectorEnv`` (or ``AsyncVectorEnv`` with ``async_``) in
    gymnasium's default NextStep autoreset mode; vector ``RecordEpisodeStatistics`` (raw
    returns and lengths in ``info["episode"]``); vector ``NormalizeObservation`` and
    ``NormalizeReward`` (discounted-return scaling with ``gamma``) if asked. Episode statistics
    are recorded before any normalisation, so they are the raw returns.

    The env is not reset here. ``seed`` seeds the vector action space; reset with
    ``env.reset(seed=seed)`` to seed sub-env ``i`` with ``seed + i`` (what RecurrentPPO does).

    Args:
        env_id: registered id (gymnasium, ``mamba_rl/...`` or ``popgym-...``).
        num_envs: number of sub-envs, >= 1.
        seed: seed for the action space, or None.
        async_: one process per sub-env (``AsyncVectorEnv``).
        capture_video, video_dir, flatten_obs, env_kwargs: see ``make_env``.
        normalize_obs: running mean/std observation normalisation (gymnasium's vector
            ``NormalizeObservation``; freeze it with ``update_running_mean = False``).
        normalize_reward: scale rewards by the running std of the discounted return
            (gymnasium's vector ``NormalizeReward``, NextStep-aware). gamma: its discount.

    Returns:
        A ``gymnasium.vector.VectorEnv`` whose ``single_observation_space`` is a 1-D float32
        Box when ``flatten_obs`` is set.

    Raises:
        ValueError: ``num_envs < 1``.
        ImportError / gymnasium.error.NameNotFound: see ``make_env``.
    """
    if int(num_envs) < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    _ensure_registered(env_id)
    thunks = [
        functools.partial(
            make_env,
            env_id,
            idx=i,
            capture_video=capture_video,
            video_dir=video_dir,
            flatten_obs=flatten_obs,
            env_kwargs=env_kwargs,
        )
        for i in range(int(num_envs))
    ]
    cls = gym.vector.AsyncVectorEnv if async_ else gym.vector.SyncVectorEnv
    envs = cls(thunks, autoreset_mode=AutoresetMode.NEXT_STEP)
    envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    if normalize_obs:
        envs = gym.wrappers.vector.NormalizeObservation(envs)
    if normalize_reward:
        envs = gym.wrappers.vector.NormalizeReward(envs, gamma=gamma)
    if seed is not None:
        envs.action_space.seed(int(seed))
    return envs


def find_vector_wrapper(env: gym.vector.VectorEnv, wrapper_type: type) -> gym.vector.VectorEnv | None:
    """Return the outermost wrapper of type ``wrapper_type`` in a vector-env stack, or None."""
    while True:
        if isinstance(env, wrapper_type):
            return env
        inner = getattr(env, "env", None)
        if inner is None or inner is env:
            return None
        env = inner


def adopt_vec_env(envs: gym.vector.VectorEnv, num_envs: int) -> gym.vector.VectorEnv:
    """Check that a caller-built vector env fits an agent of ``num_envs`` envs and flatten its observations.

    Returns:
        ``envs``, wrapped in vector ``FlattenObservation`` (unless already 1-D Box) and
        ``DtypeObservation(float32)`` when its observations are not 1-D float32 Box.

    Raises:
        ValueError: not a VectorEnv, another sub-env count, or an autoreset mode other than NextStep.
    """
    if not isinstance(envs, gym.vector.VectorEnv):
        raise ValueError(f"env must be an env id or a gymnasium.vector.VectorEnv, got {type(envs).__name__}")
    if envs.num_envs != num_envs:
        raise ValueError(f"the vector env has {envs.num_envs} sub-envs but config.num_envs is "
                         f"{num_envs}; pass num_envs={envs.num_envs}")
    mode = envs.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
    if mode != AutoresetMode.NEXT_STEP:
        raise ValueError(f"RecurrentPPO needs NextStep autoreset (gymnasium's default), got {mode}")
    space = envs.single_observation_space
    if needs_flatten(space):
        if not (isinstance(space, spaces.Box) and len(space.shape) == 1):
            envs = gym.wrappers.vector.FlattenObservation(envs)
        envs = gym.wrappers.vector.DtypeObservation(envs, np.float32)
    return envs


def finished_episodes(info: dict[str, Any]) -> list[tuple[float, int]]:
    """(return, length) of every sub-env whose episode ended at this step, from the ``info`` of a
    vector env wrapped in ``RecordEpisodeStatistics`` (raw, unnormalised returns)."""
    if "_episode" not in info:
        return []
    return [(float(info["episode"]["r"][i]), int(info["episode"]["l"][i]))
            for i in np.nonzero(np.asarray(info["_episode"]))[0]]
