"""The EnvPool backend: a C++ thread pool of envs (Weng et al. 2022) behind the gymnasium vector-env API.

Optional: ``pip install -e ".[envpool]"``. :func:`envpool_task` says whether EnvPool can run an env id (its
own ids, e.g. ``CartPole-v1``, and this package's velocity-masked ids of tasks it has, e.g.
``mamba_rl/CartPoleNoVel-v1``); :class:`EnvPoolVecEnv` adapts ``envpool.make(..., env_type="gymnasium")`` in
sync mode (every step steps all envs) to what the rollout expects of the gymnasium path:

* NextStep autoreset (EnvPool's own: the step after a done returns the first observation of the next
  episode with reward 0 and no done, and ignores its action), declared in ``metadata["autoreset_mode"]``;
* rows in env order (a sync-mode batch is reordered by its ``env_id`` when EnvPool returns another order);
* float32 observations (the masked ids keep the same entries as :class:`mamba_rl.envs.MaskObservation`),
  float64 rewards and bool dones, as a gymnasium ``SyncVectorEnv`` returns them; ``info`` is empty, so
  the vector statistics above add ``info["episode"]`` exactly as on the gymnasium path;
* seeding: ``reset(seed=s)`` gives sub-env i the seed ``s + i`` (EnvPool seeds env i with ``seed + i`` at
  construction, so a reset with a new seed rebuilds the pool); EnvPool's random streams are its own, so the
  trajectories differ from the gymnasium path's for the same seed, not their dynamics.

:func:`mamba_rl.envs.make_vec_env` stacks the same guard, statistics and normalisation wrappers over it as
over a SyncVectorEnv. EnvPool's async mode (``batch_size < num_envs``, a different subset of envs per step)
is not offered: the recurrent rollout steps every env every step (one state row per env, [N, T] storage).
Instead, ``parts=2`` splits the envs into two pools of fixed rows that step one while the other waits
(:meth:`EnvPoolVecEnv.send_part` / :meth:`EnvPoolVecEnv.recv_part`, EnvPool's own ``send`` / ``recv``, which
release the GIL): the rollout acts on one half while the other half's pool steps (:mod:`mamba_rl.envs.parts`).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from .pomdp import POMDP_ENV_IDS

__all__ = ["EnvPoolVecEnv", "envpool_available", "envpool_task", "ENV_BACKENDS"]

ENV_BACKENDS = ("gymnasium", "envpool", "auto")


def envpool_available() -> bool:
    """Whether the optional ``envpool`` package can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec("envpool") is not None
    except (ImportError, ValueError, AttributeError):  # e.g. sys.modules["envpool"] set to None (blocked)
        return False


def require_envpool(env_id: str) -> None:
    """Raise ImportError (naming the extra to install) unless the optional envpool package is installed."""
    if not envpool_available():
        raise ImportError(f"env backend 'envpool' needs the optional envpool package: pip install -e \".[envpool]\" "
                          f"(or pip install envpool), or use --env-backend gymnasium / auto; got env id {env_id!r}")


@functools.lru_cache(maxsize=None)
def _envpool_ids() -> frozenset[str]:
    import envpool

    return frozenset(envpool.list_all_envs())


def envpool_task(env_id: str) -> tuple[str, tuple[int, ...] | None, int | None] | None:
    """What EnvPool runs for ``env_id``: ``(EnvPool task id, kept observation entries or None, max episode
    steps or None)``, or None when EnvPool is not installed or has no such task. ``mamba_rl/*NoVel*`` ids map to
    their base task with the velocities masked (same kept entries and time limit as the gymnasium id)."""
    if not envpool_available():
        return None
    ids = _envpool_ids()
    if env_id in POMDP_ENV_IDS:
        base, keep, max_steps, _ = POMDP_ENV_IDS[env_id]
        return (base, tuple(keep), max_steps) if base in ids else None
    return (env_id, None, None) if env_id in ids else None


class _QuietBounds(warnings.catch_warnings):
    """A ``warnings.catch_warnings`` without gymnasium's warning about EnvPool's float64 Box bounds being cast
    to its float32 spaces (said once per pool otherwise)."""

    def __enter__(self):
        out = super().__enter__()
        warnings.filterwarnings("ignore", message=".*precision lowered by casting", category=UserWarning)
        return out


class EnvPoolVecEnv(gym.vector.VectorEnv):
    """A sync-mode EnvPool pool as a gymnasium ``VectorEnv`` with the gymnasium path's semantics (module doc).

    Args:
        env_id: an id :func:`envpool_task` maps (EnvPool's own, or a ``mamba_rl/*NoVel*`` id of a task it has).
        num_envs: sub-envs, >= 1.
        seed: the seed of sub-env 0 until a ``reset(seed=...)`` sets another (sub-env i: ``seed + i``).
        num_threads: EnvPool's worker threads per pool (0: EnvPool's default, one per core up to its envs).
        pool_kwargs: extra keyword arguments for ``envpool.make`` (e.g. ``max_episode_steps``).
        parts: 1, or 2 pools of fixed row ranges (:attr:`part_rows`: rows ``[0, N//2)`` and ``[N//2, N)``; sub-env
            i keeps the seed ``seed + i``) that can step separately (:meth:`send_part` / :meth:`recv_part`);
            :meth:`step` steps both at once, the same transitions as one pool of N.

    Raises:
        ImportError: envpool is not installed (``pip install -e ".[envpool]"``).
        ValueError: EnvPool has no task for ``env_id``, ``num_envs < 1``, or ``parts`` not 1 or 2 (or 2 with
            fewer than 2 envs).
    """

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(self, env_id: str, num_envs: int, seed: int = 0, num_threads: int = 0,
                 pool_kwargs: dict[str, Any] | None = None, parts: int = 1):
        require_envpool(env_id)
        task = envpool_task(env_id)
        if task is None:
            raise ValueError(f"EnvPool has no task for env id {env_id!r}; expected one of envpool.list_all_envs() or a "
                             f"{sorted(POMDP_ENV_IDS)} id of one (use --env-backend gymnasium for this id)")
        if int(num_envs) < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if parts not in (1, 2) or isinstance(parts, bool) or (parts == 2 and int(num_envs) < 2):
            raise ValueError(f"EnvPoolVecEnv: expected parts 1 or 2 (2 needs num_envs >= 2), got parts={parts!r} "
                             f"with num_envs={num_envs}")
        self.env_id, self.task_id, keep, max_steps = env_id, task[0], task[1], task[2]
        self.num_envs, self.num_threads = int(num_envs), int(num_threads)
        self.pool_kwargs = dict(pool_kwargs or {})
        if max_steps is not None:
            self.pool_kwargs.setdefault("max_episode_steps", max_steps)
        self._keep = None if keep is None else np.asarray(keep, dtype=np.int64)
        half = self.num_envs // 2
        self.part_rows = (slice(0, self.num_envs),) if parts == 1 else (slice(0, half), slice(half, self.num_envs))
        self._orders = tuple(np.arange(r.stop - r.start, dtype=np.int32) for r in self.part_rows)
        self._seed = int(seed)
        self.pools = self._make_pools(self._seed)
        self._sent = [False] * len(self.pools)  # a part's step sent and not received yet
        with _QuietBounds():
            space, act_space = self.pools[0].observation_space, self.pools[0].action_space
        if self._keep is not None:
            space = spaces.Box(space.low[self._keep], space.high[self._keep], dtype=space.dtype)
        if isinstance(space, spaces.Box) and space.dtype != np.float32:
            space = spaces.Box(space.low.astype(np.float32), space.high.astype(np.float32), dtype=np.float32)
        self.single_observation_space = space
        self.single_action_space = act_space
        self.observation_space = gym.vector.utils.batch_space(space, self.num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, self.num_envs)
        self.closed = False

    def _make_pools(self, seed: int) -> tuple:
        import envpool

        with _QuietBounds():
            return tuple(envpool.make(self.task_id, env_type="gymnasium", num_envs=r.stop - r.start,
                                      batch_size=r.stop - r.start, seed=seed + r.start, num_threads=self.num_threads,
                                      **self.pool_kwargs) for r in self.part_rows)

    def _close_pools(self) -> None:
        for pool in getattr(self, "pools", ()):
            pool.close()

    def _rows(self, part: int, obs: np.ndarray, info: dict[str, Any], *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        """Part ``part``'s batch in env order, observations masked and float32."""
        env_id, order = info.get("env_id"), self._orders[part]
        if env_id is not None and not (env_id.shape == order.shape and (env_id == order).all()):
            order = np.argsort(env_id, kind="stable")
            obs, arrays = obs[order], tuple(a[order] for a in arrays)
        if self._keep is not None:
            obs = obs[:, self._keep]
        return (np.asarray(obs, dtype=np.float32), *arrays)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Reset every sub-env; ``seed`` (an int) reseeds sub-env i with ``seed + i`` (a new pool).

        Raises:
            ValueError: ``options`` (EnvPool's sync mode resets all envs) or a seed that is not an int.
        """
        if options:
            raise ValueError(f"EnvPoolVecEnv.reset: expected no options (every env is reset), got {options!r}")
        for h, sent in enumerate(self._sent):  # a step sent and never received (an interrupted rollout)
            if sent:
                self.pools[h].recv()
                self._sent[h] = False
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
                raise ValueError(f"EnvPoolVecEnv.reset: expected an int seed (sub-env i gets seed + i), got {seed!r}")
            if int(seed) != self._seed or getattr(self, "_stepped", False):
                self._close_pools()
                self._seed = int(seed)
                self.pools = self._make_pools(self._seed)
        self._stepped = True
        with _QuietBounds():
            parts = [self._rows(h, *pool.reset())[0] for h, pool in enumerate(self.pools)]
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)), {}

    def send_part(self, part: int, actions: Any) -> None:
        """Start stepping the sub-envs of ``part_rows[part]`` with ``actions`` (their rows); returns at once.

        Raises:
            ValueError: an unknown part, or a part sent twice without a :meth:`recv_part` between.
        """
        if not 0 <= part < len(self.pools) or self._sent[part]:
            raise ValueError(f"EnvPoolVecEnv.send_part: expected a part in [0, {len(self.pools)}) not sent yet, got "
                             f"part {part!r} (sent: {self._sent})")
        self.pools[part].send(np.asarray(actions))
        self._sent[part] = True

    def recv_part(self, part: int):
        """Wait for the step of ``part`` sent last; returns its rows as :meth:`step` does (NextStep autoreset).

        Raises:
            ValueError: ``part`` was not sent.
        """
        if not 0 <= part < len(self.pools) or not self._sent[part]:
            raise ValueError(f"EnvPoolVecEnv.recv_part: expected a part sent with send_part, got part {part!r} "
                             f"(sent: {self._sent})")
        obs, reward, term, trunc, info = self.pools[part].recv()
        self._sent[part] = False
        obs, reward, term, trunc = self._rows(part, obs, info, reward, term, trunc)
        return obs, reward.astype(np.float64), term.astype(bool, copy=False), trunc.astype(bool, copy=False), {}

    def step(self, actions: Any):
        """Step every sub-env (NextStep autoreset; every part at once); returns float32 obs, float64 rewards, bool
        dones, ``{}``."""
        actions = np.asarray(actions)
        for h, rows in enumerate(self.part_rows):
            self.send_part(h, actions[rows])
        outs = [self.recv_part(h) for h in range(len(self.pools))]
        if len(outs) == 1:
            return outs[0]
        return (*(np.concatenate([o[i] for o in outs]) for i in range(4)), {})

    def close_extras(self, **kwargs: Any) -> None:
        """Close the pools (their threads)."""
        self._close_pools()

    def __getstate__(self):
        raise TypeError("an EnvPool vector env cannot be pickled (its envs live in a C++ thread pool)")
