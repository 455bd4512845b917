"""Env factories: one env (:func:`make_env`) and a gymnasium vector env (:func:`make_vec_env`).

The stack is gymnasium's: ``SyncVectorEnv`` / ``AsyncVectorEnv`` in the default NextStep autoreset
mode (or, with ``backend="envpool"``, an EnvPool pool with the same semantics, :mod:`.envpool_backend`),
``RecordEpisodeStatistics``, ``NormalizeReward`` and ``NormalizeObservation`` (as the bit-identical subclasses
of :mod:`.stats`, cheaper and able to step in parts) and ``RecordVideo``; observations are flattened by the picklable
wrappers of :mod:`mamba_rl.envs.wrappers`.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from .envpool_backend import ENV_BACKENDS, EnvPoolVecEnv, envpool_task, require_envpool
from .guards import NONFINITE_POLICIES, EnvGuard
from .registry import check_env_id
from .stats import VecEpisodeStatistics, VecNormalizeObservation, VecNormalizeReward
from .wrappers import FlattenObs, Float32Obs, JointAction, flatten_vec_obs, needs_flatten, raw_observation_space

__all__ = ["make_env", "make_vec_env", "check_start_method", "resolve_env_backend", "has_continuous_part"]


def resolve_env_backend(backend: str, env_id: str, async_: bool = False, capture_video: bool = False) -> str:
    """The env backend a vector env of ``env_id`` runs on: "gymnasium" or "envpool".

    ``"auto"`` picks EnvPool when it is installed, has the id (:func:`mamba_rl.envs.envpool_task`) and neither
    gymnasium's async workers nor video recording are asked for; else gymnasium.

    Raises:
        ValueError: an unknown backend, or "envpool" with ``async_`` / ``capture_video`` (EnvPool runs its own
            thread pool and records no video) or an id EnvPool does not have.
        ImportError: "envpool" without the envpool package.
    """
    if backend not in ENV_BACKENDS:
        raise ValueError(f"env backend must be one of {ENV_BACKENDS}, got {backend!r}")
    if backend == "gymnasium":
        return backend
    if backend == "auto":
        return "envpool" if (not async_ and not capture_video and envpool_task(env_id) is not None) else "gymnasium"
    if async_:
        raise ValueError("env backend 'envpool' steps its envs in its own C++ thread pool; expected async_envs=False "
                         "(drop --async-envs), got async_envs=True")
    if capture_video:
        raise ValueError("env backend 'envpool' records no video; expected capture_video=False (or use "
                         "--env-backend gymnasium), got capture_video=True")
    require_envpool(env_id)
    return backend


def check_start_method(start_method: str | None) -> None:
    """Raise ValueError unless ``start_method`` is None or a start method this platform has."""
    methods = multiprocessing.get_all_start_methods()
    if start_method is not None and start_method not in methods:
        raise ValueError(f"unknown multiprocessing start method {start_method!r}; this platform has {methods}")


def make_env(
    env_id: str,
    idx: int = 0,
    capture_video: bool = False,
    video_dir: str = "videos",
    flatten_obs: bool = True,
    env_kwargs: dict[str, Any] | None = None,
    checks: bool = True,
    joint_action: bool = False,
) -> gym.Env:
    """Build one (non-vector) env: ``gym.make`` plus optional video, joint action and flattening.

    Args:
        env_id: a registered gymnasium id (see module doc).
        idx: index of this env in its vector env; only env 0 records video.
        capture_video: record episodes of env 0 with ``gymnasium.wrappers.RecordVideo``
            (needs ``render_mode="rgb_array"`` support and moviepy).
        video_dir: folder the videos go to.
        flatten_obs: flatten Box/Discrete/MultiDiscrete/Tuple/Dict observations into one
            float32 vector with :class:`FlattenObs` (gymnasium's FlattenObservation, picklable;
            discrete parts become one-hot) followed by :class:`Float32Obs`.
        env_kwargs: extra keyword arguments for ``gym.make``.
        checks: keep the two checking wrappers ``gym.make`` adds, ``PassiveEnvChecker`` (API checks on the
            first reset and step) and ``OrderEnforcing`` (no step before a reset), as the id's spec asks.
            False leaves both out (``TimeLimit`` and everything else stay): :func:`make_vec_env` keeps them
            on sub-env 0 only, since the copies are the same env and the vector env resets them together.
        joint_action: a MultiDiscrete action space becomes one Discrete over every combination
            (:class:`~mamba_rl.envs.wrappers.JointAction`).

    Raises:
        ValueError: ``joint_action`` for an action space that is not a 1-D MultiDiscrete of at most
            ``MAX_JOINT_ACTIONS`` combinations.
        ImportError: a ``popgym-*`` id without the popgym package, or a ``module:EnvId`` whose
            module cannot be imported.
        gymnasium.error.NameNotFound: unknown id (see :func:`check_env_id`).
    """
    resolved = check_env_id(env_id)
    kwargs = dict(env_kwargs or {})
    record = capture_video and idx == 0
    if record:
        kwargs["render_mode"] = "rgb_array"
    if checks:
        env = gym.make(env_id, **kwargs)
    else:  # the same spec without the two checking layers (~1 µs a step each)
        env = gym.make(dataclasses.replace(gym.spec(resolved), order_enforce=False), disable_env_checker=True,
                       **kwargs)
    if record:
        env = gym.wrappers.RecordVideo(env, video_dir, disable_logger=True)
    if joint_action:
        env = JointAction(env)
    if flatten_obs and needs_flatten(env.observation_space):
        if not (isinstance(env.observation_space, spaces.Box) and len(env.observation_space.shape) == 1):
            env = FlattenObs(env)
        if env.observation_space.dtype != np.float32:
            env = Float32Obs(env)
    return env


def make_vec_env(
    env_id: str,
    num_envs: int = 8,
    seed: int | None = None,
    async_: bool = False,
    capture_video: bool = False,
    video_dir: str = "videos",
    normalize_obs: bool = False,
    obs_norm_discrete: bool = False,
    flatten_obs: bool = True,
    env_kwargs: dict[str, Any] | None = None,
    normalize_reward: bool = False,
    gamma: float = 0.99,
    start_method: str | None = None,
    nonfinite: str = "raise",
    backend: str = "gymnasium",
    env_parts: int = 1,
    joint_action: bool = False,
) -> gym.vector.VectorEnv:
    """Build a gymnasium vector env of ``num_envs`` copies of ``env_id``.

    The stack, innermost first: per env ``make_env`` (gym.make, with its PassiveEnvChecker and
    OrderEnforcing on env 0 only; RecordVideo on env 0, FlattenObservation); ``SyncVectorEnv`` (or
    ``AsyncVectorEnv`` with ``async_``) in gymnasium's default NextStep autoreset mode, or with
    ``backend="envpool"`` an :class:`~mamba_rl.envs.EnvPoolVecEnv` in its place;
    :class:`~mamba_rl.envs.guards.EnvGuard` (non-finite observations / rewards, dead async workers);
    :class:`~mamba_rl.envs.stats.VecEpisodeStatistics` (gymnasium's vector RecordEpisodeStatistics: raw
    returns and lengths in ``info["episode"]``); vector ``NormalizeObservation`` and
    :class:`~mamba_rl.envs.stats.VecNormalizeReward` (gymnasium's vector NormalizeReward:
    discounted-return scaling with ``gamma``) if asked. Episode statistics are recorded before any
    normalisation, so they are the raw returns.

    The env is not reset here. ``seed`` seeds the vector action space; reset with
    ``env.reset(seed=seed)`` to seed sub-env ``i`` with ``seed + i`` (what RecurrentPPO does).

    Args:
        env_id: registered id (gymnasium, ``mamba_rl/...`` or ``popgym-...``).
        num_envs: number of sub-envs, >= 1.
        seed: seed for the action space, or None.
        async_: one process per sub-env (``AsyncVectorEnv``).
        capture_video, video_dir, flatten_obs, env_kwargs: see ``make_env``.
        normalize_obs: running mean/std observation normalisation (gymnasium's vector
            ``NormalizeObservation``; freeze it with ``update_running_mean = False``) of an observation space
            with a continuous part (:func:`has_continuous_part`); an all-discrete one (Discrete, MultiDiscrete,
            MultiBinary and their Tuple / Dict: one-hot codes after flattening) is left as it is, as
            rl-baselines3-zoo normalises only continuous observations (measured: the frozen normaliser cost
            POPGym's RepeatPreviousEasy 0.11 MMER on 2 of 6 runs and changed the other discrete tasks within
            their seed noise, ``benchmarks/learning/README.md``).
        obs_norm_discrete: with ``normalize_obs``, normalise an all-discrete observation space too.
        normalize_reward: scale rewards by the running std of the discounted return
            (gymnasium's vector ``NormalizeReward``, NextStep-aware). gamma: its discount.
        start_method: with ``async_``, the multiprocessing start method of the workers
            ("fork", "spawn", "forkserver"; None: the platform's default). Under "spawn" and
            "forkserver" each worker imports this package and, for a ``module:EnvId`` id, that
            module, so it must be importable there (on ``sys.path`` / ``PYTHONPATH``).
        nonfinite: what a NaN / inf observation or reward does: "raise" (NonFiniteEnvError naming the
            env and the step) or "zero" (replaced by 0 and counted); see :class:`EnvGuard`.
        backend: "gymnasium" (the Sync/AsyncVectorEnv above), "envpool" (an :class:`EnvPoolVecEnv` in place
            of it, same semantics, ``env_kwargs`` go to ``envpool.make``; the wrappers above it are the same) or
            "auto" (:func:`resolve_env_backend`).
        env_parts: 1, or 2: on the EnvPool backend two pools of fixed halves of the envs that the rollout can
            step separately (:mod:`mamba_rl.envs.parts`); the gymnasium backend ignores it (one part).
        joint_action: each sub-env's MultiDiscrete action becomes one Discrete over every combination
            (:class:`~mamba_rl.envs.wrappers.JointAction`); gymnasium backend only ("auto" picks it).

    Returns:
        A ``gymnasium.vector.VectorEnv`` whose ``single_observation_space`` is a 1-D float32
        Box when ``flatten_obs`` is set.

    Raises:
        ValueError: ``num_envs < 1``, an unknown start method, nonfinite policy or backend, an EnvPool
            backend that cannot run this (see :func:`resolve_env_backend`) or ``joint_action`` with it, or
            ``joint_action`` for an action space it cannot join (see :class:`~mamba_rl.envs.wrappers.JointAction`).
        ImportError / gymnasium.error.NameNotFound: see ``make_env``; ImportError: "envpool" without envpool.
    """
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be 'raise' or 'zero', got {nonfinite!r}")
    if isinstance(num_envs, bool) or not isinstance(num_envs, (int, np.integer)) or num_envs < 1:
        raise ValueError(f"num_envs must be an int >= 1, got {num_envs!r}")
    if env_parts not in (1, 2) or isinstance(env_parts, bool):
        raise ValueError(f"env_parts must be 1 or 2, got {env_parts!r}")
    check_start_method(start_method)
    if joint_action and backend == "auto":  # the wrapper wraps gymnasium envs
        backend = "gymnasium"
    if joint_action and backend == "envpool":
        raise ValueError("joint_action wraps each gymnasium env of the vector env; expected env backend 'gymnasium' "
                         "or 'auto', got 'envpool'")
    if resolve_env_backend(backend, env_id, async_, capture_video) == "envpool":
        envs = EnvPoolVecEnv(env_id, int(num_envs), seed=0 if seed is None else int(seed), pool_kwargs=env_kwargs,
                             parts=2 if env_parts == 2 and int(num_envs) >= 2 else 1)
        if flatten_obs:
            envs = flatten_vec_obs(envs)
    else:
        check_env_id(env_id)
        envs = _gymnasium_vec_env(env_id, int(num_envs), async_, capture_video, video_dir, flatten_obs, env_kwargs,
                                  start_method, joint_action)
    envs = EnvGuard(envs, nonfinite)  # below the statistics and normalisation: they never see a NaN
    envs = VecEpisodeStatistics(envs)
    if normalize_obs and (obs_norm_discrete or has_continuous_part(raw_observation_space(envs, env_id, env_kwargs))):
        envs = VecNormalizeObservation(envs)
    if normalize_reward:
        envs = VecNormalizeReward(envs, gamma=gamma)
    if seed is not None:
        envs.action_space.seed(int(seed))
    return envs


def has_continuous_part(space: spaces.Space) -> bool:
    """Whether ``space`` has a continuous part: a ``Box`` (any dtype), or a ``Tuple`` / ``Dict`` / ``OneOf``
    holding one. ``Discrete``, ``MultiDiscrete``, ``MultiBinary``, ``Text`` and their compositions are all-discrete."""
    if isinstance(space, spaces.Box):
        return True
    if isinstance(space, (spaces.Tuple, spaces.OneOf)):
        return any(has_continuous_part(s) for s in space.spaces)
    if isinstance(space, spaces.Dict):
        return any(has_continuous_part(s) for s in space.spaces.values())
    return False


def _gymnasium_vec_env(env_id: str, num_envs: int, async_: bool, capture_video: bool, video_dir: str,
                       flatten_obs: bool, env_kwargs: dict[str, Any] | None,
                       start_method: str | None, joint_action: bool = False) -> gym.vector.VectorEnv:
    """gymnasium's Sync/AsyncVectorEnv (NextStep autoreset) of ``num_envs`` :func:`make_env` envs."""
    thunks = [
        functools.partial(
            make_env,
            env_id,
            idx=i,
            capture_video=capture_video,
            video_dir=video_dir,
            flatten_obs=flatten_obs,
            env_kwargs=env_kwargs,
            checks=i == 0,
            joint_action=joint_action,
        )
        for i in range(num_envs)
    ]
    if async_:
        return gym.vector.AsyncVectorEnv(thunks, autoreset_mode=AutoresetMode.NEXT_STEP, context=start_method)
    return gym.vector.SyncVectorEnv(thunks, autoreset_mode=AutoresetMode.NEXT_STEP)
