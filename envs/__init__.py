"""Environments for mamba_rl: a gymnasium vector-env factory and POMDP (velocity-masked) tasks.

``make_vec_env`` builds a ``gymnasium.vector`` env from any id ``gymnasium.make`` accepts -
gymnasium's own, the ``mamba_rl/*NoVel*`` ids registered here, ``module:EnvId`` ids (the module is
imported first, in the main process and in every async worker), or POPGym's ``popgym-*`` ids
(optional extra: ``pip install -e .[popgym]``; the ``popgym`` package is imported on first use of
such an id). ``list_env_ids`` (``mamba-rl envs``) lists them. The stack is gymnasium's:
``SyncVectorEnv``/``AsyncVectorEnv`` in the default NextStep autoreset mode,
``RecordEpisodeStatistics``, ``NormalizeObservation`` and ``RecordVideo``; observations are
flattened by :class:`FlattenObs` / :class:`Float32Obs`, picklable equivalents of gymnasium's
FlattenObservation / DtypeObservation (whose lambdas keep envs from being checkpointed).
"""

from __future__ import annotations

import functools
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from .guards import EnvGuard, EnvWorkerDied, NonFiniteEnvError, flatten_observation  # noqa: F401 (re-export)
from .pomdp import POMDP_ENV_IDS, MaskObservation, make_masked_env, register_pomdp_envs

__all__ = [
    "make_env",
    "make_vec_env",
    "adopt_vec_env",
    "finished_episodes",
    "find_vector_wrapper",
    "check_env_id",
    "check_start_method",
    "list_env_ids",
    "FlattenObs",
    "FlattenVecObs",
    "Float32Obs",
    "needs_flatten",
    "MaskObservation",
    "POMDP_ENV_IDS",
    "make_masked_env",
    "register_pomdp_envs",
    "EnvGuard",
    "EnvWorkerDied",
    "NonFiniteEnvError",
    "flatten_observation",
]

register_pomdp_envs()


def _import_popgym(env_id: str) -> None:
    try:
        import popgym  # noqa: F401  (registers the popgym-* ids)
    except ImportError as err:
        raise ImportError(
            f"env id {env_id!r} needs the optional 'popgym' package: "
            "pip install -e .[popgym]  (or pip install popgym)"
        ) from err


def check_env_id(env_id: str) -> str:
    """Check that ``gymnasium.make(env_id)`` can find ``env_id``, the way it will look it up.

    Accepts every id form gymnasium does: registered ids (``CartPole-v1``, ``mamba_rl/...``),
    ``popgym-*`` ids (imports popgym on first use), ``module:EnvId`` (imports ``module``, which
    registers ``EnvId``, as ``gymnasium.make`` does; the same import happens again in every
    async worker process) and unversioned ids (the latest version).

    Returns:
        The registered id ``gymnasium.make`` will build.

    Raises:
        ImportError: the module of a ``module:EnvId`` id, or popgym for a ``popgym-*`` id, cannot
            be imported.
        gymnasium.error.NameNotFound (or another gymnasium.error.Error): no such id, with
            gymnasium's suggestion (``Did you mean: `CartPole`?``) when it has one.
    """
    if not isinstance(env_id, str) or env_id.count(":") > 1:
        raise gym.error.NameNotFound(f"malformed env id {env_id!r}; expected '[module:][namespace/]Name[-vN]'")
    name = env_id.split(":")[-1]
    if name.startswith("popgym") and name not in gym.registry:
        _import_popgym(env_id)
    try:
        from gymnasium.envs.registration import _find_spec  # what gymnasium.make uses

        return _find_spec(env_id).id
    except ModuleNotFoundError as err:
        raise ImportError(f"env id {env_id!r}: {err}") from err
    except gym.error.Error as err:
        raise type(err)(
            f"unknown env id {env_id!r}: {err} Expected an id that gymnasium.make accepts, such as "
            f"'CartPole-v1', 'module:EnvId', one of {sorted(POMDP_ENV_IDS)} or a 'popgym-*' id "
            "(list them: mamba-rl envs)"
        ) from err


_ensure_registered = check_env_id  # the old private name


def list_env_ids(everything: bool = False) -> dict[str, list[str]]:
    """The env ids this package offers, by source.

    Args:
        everything: also list every id in gymnasium's registry (key ``"gymnasium"``).

    Returns:
        ``{"mamba_rl": [...the POMDP ids...], "popgym": [...] (only when popgym is installed),
        "gymnasium": [...] (only with ``everything``)}``, each sorted.
    """
    out = {"mamba_rl": sorted(POMDP_ENV_IDS)}
    try:
        import popgym  # noqa: F401
    except ImportError:
        pass
    else:
        out["popgym"] = sorted(i for i in gym.registry if i.startswith("popgym"))
    if everything:
        taken = {i for ids in out.values() for i in ids}
        out["gymnasium"] = sorted(i for i in gym.registry if i not in taken)
    return out


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


class Float32Obs(gym.ObservationWrapper):
    """Cast a Box observation to float32 (``gymnasium.wrappers.DtypeObservation``, picklable)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        space = env.observation_space
        if not isinstance(space, spaces.Box):
            raise TypeError(f"Float32Obs expects a Box observation space, got {space!r}")
        self.observation_space = spaces.Box(space.low.astype(np.float32), space.high.astype(np.float32),
                                            shape=space.shape, dtype=np.float32)

    def observation(self, observation: Any) -> np.ndarray:
        return np.asarray(observation, dtype=np.float32)


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
            float32 vector with :class:`FlattenObs` (gymnasium's FlattenObservation, picklable;
            discrete parts become one-hot) followed by :class:`Float32Obs`.
        env_kwargs: extra keyword arguments for ``gym.make``.

    Raises:
        ImportError: a ``popgym-*`` id without the popgym package, or a ``module:EnvId`` whose
            module cannot be imported.
        gymnasium.error.NameNotFound: unknown id (see :func:`check_env_id`).
    """
    check_env_id(env_id)
    kwargs = dict(env_kwargs or {})
    record = capture_video and idx == 0
    if record:
        kwargs["render_mode"] = "rgb_array"
    env = gym.make(env_id, **kwargs)
    if record:
        env = gym.wrappers.RecordVideo(env, video_dir, disable_logger=True)
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
    flatten_obs: bool = True,
    env_kwargs: dict[str, Any] | None = None,
    normalize_reward: bool = False,
    gamma: float = 0.99,
    start_method: str | None = None,
    nonfinite: str = "raise",
) -> gym.vector.VectorEnv:
    """Build a gymnasium vector env of ``num_envs`` copies of ``env_id``.

    The stack, innermost first: per env ``make_env`` (gym.make, RecordVideo on env 0,
    FlattenObservation); ``SyncVectorEnv`` (or ``AsyncVectorEnv`` with ``async_``) in
    gymnasium's default NextStep autoreset mode; :class:`~mamba_rl.envs.guards.EnvGuard` (non-finite
    observations / rewards, dead async workers); vector ``RecordEpisodeStatistics`` (raw
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
        start_method: with ``async_``, the multiprocessing start method of the workers
            ("fork", "spawn", "forkserver"; None: the platform's default). Under "spawn" and
            "forkserver" each worker imports this package and, for a ``module:EnvId`` id, that
            module, so it must be importable there (on ``sys.path`` / ``PYTHONPATH``).
        nonfinite: what a NaN / inf observation or reward does: "raise" (NonFiniteEnvError naming the
            env and the step) or "zero" (replaced by 0 and counted); see :class:`EnvGuard`.

    Returns:
        A ``gymnasium.vector.VectorEnv`` whose ``single_observation_space`` is a 1-D float32
        Box when ``flatten_obs`` is set.

    Raises:
        ValueError: ``num_envs < 1``, an unknown start method or nonfinite policy.
        ImportError / gymnasium.error.NameNotFound: see ``make_env``.
    """
    if nonfinite not in ("raise", "zero"):
        raise ValueError(f"nonfinite must be 'raise' or 'zero', got {nonfinite!r}")
    if int(num_envs) < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    check_start_method(start_method)
    check_env_id(env_id)
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
    if async_:
        envs = gym.vector.AsyncVectorEnv(thunks, autoreset_mode=AutoresetMode.NEXT_STEP, context=start_method)
    else:
        envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=AutoresetMode.NEXT_STEP)
    envs = EnvGuard(envs, nonfinite)  # below the statistics and normalisation: they never see a NaN
    envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    if normalize_obs:
        envs = gym.wrappers.vector.NormalizeObservation(envs)
    if normalize_reward:
        envs = gym.wrappers.vector.NormalizeReward(envs, gamma=gamma)
    if seed is not None:
        envs.action_space.seed(int(seed))
    return envs


def check_start_method(start_method: str | None) -> None:
    """Raise ValueError unless ``start_method`` is None or a start method this platform has."""
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    if start_method is not None and start_method not in methods:
        raise ValueError(f"unknown multiprocessing start method {start_method!r}; this platform has {methods}")


def find_vector_wrapper(env: gym.vector.VectorEnv, wrapper_type: type) -> gym.vector.VectorEnv | None:
    """Return the outermost wrapper of type ``wrapper_type`` in a vector-env stack, or None."""
    while True:
        if isinstance(env, wrapper_type):
            return env
        inner = getattr(env, "env", None)
        if inner is None or inner is env:
            return None
        env = inner


def adopt_vec_env(envs: gym.vector.VectorEnv, num_envs: int, nonfinite: str = "raise") -> gym.vector.VectorEnv:
    """Check that a caller-built vector env fits an agent of ``num_envs`` envs and flatten its observations.

    Returns:
        ``envs``, wrapped in :class:`FlattenVecObs` when its observations are not 1-D float32 Box, then in
        an :class:`EnvGuard` with ``nonfinite`` unless it holds one already (outermost: wrappers of the
        caller's, such as a normalisation, see the values before the guard does).

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
        envs = FlattenVecObs(envs)
    if find_vector_wrapper(envs, EnvGuard) is None:
        envs = EnvGuard(envs, nonfinite)
    return envs


def finished_episodes(info: dict[str, Any]) -> list[tuple[float, int]]:
    """(return, length) of every sub-env whose episode ended at this step, from the ``info`` of a
    vector env wrapped in ``RecordEpisodeStatistics`` (raw, unnormalised returns)."""
    if "_episode" not in info:
        return []
    return [(float(info["episode"]["r"][i]), int(info["episode"]["l"][i]))
            for i in np.nonzero(np.asarray(info["_episode"]))[0]]
