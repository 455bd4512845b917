"""Checks at the env boundary: non-finite observations / rewards, dead async workers, raw observations.

* :class:`EnvGuard` wraps a vector env (innermost, right above the Sync/AsyncVectorEnv in
  :func:`mamba_rl.envs.make_vec_env`, so that episode statistics and the running normalisation
  statistics never see a NaN) and checks every observation and reward it returns. ``nonfinite="raise"``
  (the default) raises :class:`NonFiniteEnvError` naming the sub-env, the step and what was non-finite;
  ``"zero"`` replaces the non-finite values with 0 and counts them (:attr:`EnvGuard.nonfinite_obs`,
  :attr:`EnvGuard.nonfinite_rewards`; the agent logs them as ``env/nonfinite_obs`` and
  ``env/nonfinite_rewards``).
  Over an ``AsyncVectorEnv`` it also turns the bare ``BrokenPipeError`` / ``EOFError`` of a worker that
  died (killed, out of memory) into :class:`EnvWorkerDied`, which names the worker, its pid and its exit
  code or signal, and closes such an env without waiting on the dead worker. Any other exception the
  vector env raises from ``step`` (the env's own, or gymnasium's when an observation does not
  fit the observation space) becomes :class:`EnvStepError`, naming the step and the space. All three are
  :class:`EnvFailure`: what ``mamba-rl train`` reports as one error line after saving the last whole update.
* :func:`flatten_observation` flattens a raw (Dict, Tuple, ...) observation the way training does, for
  ``predict()``; it raises ValueError naming the space when the observation does not fit it.
"""

from __future__ import annotations

import signal
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from .parts import PartedStep

__all__ = ["EnvGuard", "EnvFailure", "NonFiniteEnvError", "EnvWorkerDied", "EnvStepError", "NONFINITE_POLICIES",
           "flatten_observation"]

NONFINITE_POLICIES = ("raise", "zero")


class EnvFailure(Exception):
    """The env failed while the agent stepped it: the base of :class:`NonFiniteEnvError`,
    :class:`EnvWorkerDied` and :class:`EnvStepError` (the env's fault, not the agent's)."""


class NonFiniteEnvError(EnvFailure, ValueError):
    """An env returned a NaN or inf observation or reward (policy ``nonfinite="raise"``)."""


class EnvWorkerDied(EnvFailure, RuntimeError):
    """An ``AsyncVectorEnv`` worker process died (its pipe broke)."""


class EnvStepError(EnvFailure, RuntimeError):
    """The vector env raised while resetting or stepping (the original exception is its ``__cause__``)."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is not responding (still running, but its pipe is closed)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


class EnvGuard(PartedStep, gym.vector.VectorWrapper):
    """Check a vector env's observations and rewards for NaN / inf, and name dead async workers.

    Args:
        env: the vector env (observations: a float array [num_envs, ...] or a Dict/Tuple of arrays).
        nonfinite: ``"raise"``: raise :class:`NonFiniteEnvError`; ``"zero"``: replace each non-finite
            value by 0 and count it.

    Steps in parts too (:mod:`mamba_rl.envs.parts`): a vector step counts when part 0 is received, and the
    messages name the sub-env's index in the whole vector env.

    Attributes:
        nonfinite: the policy. steps: ``step`` calls so far (a reset does not count).
        nonfinite_obs: observation values zeroed so far (policy "zero"). nonfinite_rewards: rewards
            zeroed so far.

    Raises:
        ValueError: an unknown policy.
        NonFiniteEnvError: (from reset / step) a non-finite value under policy "raise"; the message names
            the sub-env index, the step (``step`` calls of this vector env, 1-based; 0 is the reset)
            and whether the observation or the reward was non-finite.
        EnvWorkerDied: (from reset / step) an async worker process died.
    """

    def __init__(self, env: gym.vector.VectorEnv, nonfinite: str = "raise"):
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        super().__init__(env)
        self.nonfinite = nonfinite
        self.steps = 0
        self.nonfinite_obs = 0
        self.nonfinite_rewards = 0

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: Any = None, options: Any = None):
        obs, info = self._call(lambda: self.env.reset(seed=seed, options=options), "the reset", wrap=False)
        return self._check_obs(obs, "reset"), info

    def step(self, actions: Any):
        out = self._call(lambda: self.env.step(actions), f"step {self.steps + 1}")
        self.steps += 1
        return self._post(slice(None), *out)

    def recv_part(self, part: int):
        # not wrapped: a part's protocol error (a part not sent) is its caller's, and an env's own failure here
        # is the parted backend's to report
        out = self._call(lambda: self.env.recv_part(part), f"step {self.steps + (part == 0)}", wrap=False)
        self.steps += part == 0
        return self._post(self.part_rows[part], *out)

    def close(self, **kwargs: Any) -> None:
        """Close the vector env. An ``AsyncVectorEnv`` with a dead worker is torn down here (its live workers
        terminated, its pipes closed, the processes joined): gymnasium's own close would wait on the dead
        worker's pending step and raise ``EOFError``, again when the env is garbage collected."""
        u = self.env.unwrapped
        procs = getattr(u, "processes", None)
        if not procs or getattr(u, "closed", False) or all(p.exitcode is None for p in procs):
            return self.env.close(**kwargs)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for pipe in getattr(u, "parent_pipes", None) or ():
            if pipe is not None:
                pipe.close()
        for p in procs:
            p.join()
        u.closed = True
        self.closed = True

    def _post(self, rows: slice, obs: Any, reward: Any, term: Any, trunc: Any, info: dict[str, Any]):
        where, first = f"step {self.steps}", rows.start or 0
        return self._check_obs(obs, where, first), self._check_reward(reward, where, first), term, trunc, info

    # ------------------------------------------------------------------ checks
    def _call(self, fn, where: str, wrap: bool = True):
        """``fn()``; a dead async worker's pipe error becomes :class:`EnvWorkerDied`, and with ``wrap`` (steps:
        the env's own failure, not its caller's arguments, as a reset's seed / options are) any other
        exception but gymnasium's own (``gym.error.Error``: a misuse of the API) :class:`EnvStepError`."""
        try:
            return fn()
        except (BrokenPipeError, EOFError, ConnectionResetError) as err:
            dead = self._dead_worker()
            if dead is None:
                if not wrap:
                    raise
                raise EnvStepError(f"the vector env's pipe broke at {where} ({type(err).__name__}: {err})") from err
            raise dead from err
        except (EnvFailure, gym.error.Error):  # gymnasium's errors name a misuse of the API (ResetNeeded, ...)
            raise
        except Exception as err:
            if not wrap:
                raise
            raise EnvStepError(
                f"the vector env raised {type(err).__name__} at {where}: {err} (each sub-env must return an "
                f"observation of the observation space {self.single_observation_space})") from err

    def _dead_worker(self) -> EnvWorkerDied | None:
        """The error naming the first dead worker of an AsyncVectorEnv, or None (not async / none dead)."""
        procs = getattr(self.env.unwrapped, "processes", None)
        if not procs:
            return None
        for p in procs:
            p.join(timeout=0.5 if p.exitcode is None else 0)
        for i, p in enumerate(procs):
            if p.exitcode is not None:
                return EnvWorkerDied(f"async env worker {i} (env {i}, pid {p.pid}) {_describe_exit(p.exitcode)}; "
                                     f"the vector env cannot continue. Its other workers are "
                                     f"{'alive' if all(q.exitcode is None for j, q in enumerate(procs) if j != i) else 'also dead'}")
        return EnvWorkerDied(f"an async env worker's pipe broke but every worker process ({len(procs)}) is alive")

    def _fix(self, arr: np.ndarray, bad: np.ndarray) -> np.ndarray:
        out = np.array(arr, copy=True)
        out[bad] = 0
        return out

    def _check_obs(self, obs: Any, where: str, first: int = 0) -> Any:
        """``obs`` checked (policy "zero": fixed); ``first`` is the sub-env index of its row 0."""
        if isinstance(obs, dict):
            return {k: self._check_obs(v, where, first) for k, v in obs.items()}
        if isinstance(obs, tuple):
            return tuple(self._check_obs(v, where, first) for v in obs)
        arr = np.asarray(obs)
        if arr.dtype.kind != "f" or np.isfinite(arr).all():  # kind "f": every numpy floating type
            return obs
        bad = ~np.isfinite(arr)
        if self.nonfinite == "raise":
            rows = np.nonzero(bad.reshape(arr.shape[0], -1).any(axis=1))[0] if arr.ndim else np.array([0])
            vals = arr.reshape(arr.shape[0], -1)[rows[0]] if arr.ndim else arr.reshape(1)
            rows = rows + first
            raise NonFiniteEnvError(
                f"env {int(rows[0])} returned a non-finite observation at {where} of the vector env "
                f"(expected finite values, got {vals[~np.isfinite(vals)][:4].tolist()} among {vals.size}; "
                f"envs with non-finite observations: {rows.tolist()}). Fix the env, or pass "
                f"nonfinite='zero' (mamba-rl train --nonfinite zero) to replace them by 0 and count them")
        self.nonfinite_obs += int(bad.sum())
        return self._fix(arr, bad)

    def _check_reward(self, reward: Any, where: str, first: int = 0) -> Any:
        arr = np.asarray(reward)
        if arr.dtype.kind != "f" or np.isfinite(arr).all():
            return reward
        bad = ~np.isfinite(arr)
        if self.nonfinite == "raise":
            rows = np.nonzero(bad.reshape(-1))[0]
            raise NonFiniteEnvError(
                f"env {int(rows[0]) + first} returned a non-finite reward at {where} of the vector env (expected a "
                f"finite number, got {float(arr.reshape(-1)[rows[0]])}; envs with non-finite rewards: "
                f"{(rows + first).tolist()}). Fix the env, or pass nonfinite='zero' (mamba-rl train --nonfinite zero) "
                f"to replace them by 0 and count them")
        self.nonfinite_rewards += int(bad.sum())
        return self._fix(arr, bad)


def flatten_observation(space: spaces.Space, obs: Any, obs_dim: int) -> np.ndarray:
    """One raw observation of ``space``, or a batch of them, as the float32 rows training feeds the policy.

    Args:
        space: the single env's raw observation space (before flattening).
        obs: one observation of ``space`` (e.g. a dict for a Dict space), a batch as a vector env returns
            it (a dict / tuple of arrays with a leading batch axis B), or a list of observations.
        obs_dim: the flat width the policy expects (``spaces.flatdim(space)``).

    Returns:
        float32 [obs_dim] for one observation, [B, obs_dim] for a batch (discrete parts one-hot, as
        :class:`mamba_rl.envs.FlattenObs` does during training).

    Raises:
        ValueError: ``obs`` is neither one observation of ``space`` nor a batch of them; the message
            names the space.
    """
    def bad(why: str) -> ValueError:
        return ValueError(f"predict: expected one observation of the env's observation space {space} (or a "
                          f"batch of them, as its vector env returns), got {type(obs).__name__}: {why}")

    if isinstance(obs, list) and obs and not isinstance(space, spaces.Box):
        try:
            rows = [np.asarray(spaces.flatten(space, o), dtype=np.float32) for o in obs]
        except Exception as err:  # noqa: BLE001 - gymnasium raises several types for a mismatch
            raise bad(f"{type(err).__name__}: {err}") from err
        return _checked(np.stack(rows), obs_dim, bad)
    single_err = None
    try:
        flat = np.asarray(spaces.flatten(space, obs), dtype=np.float32)
        if flat.shape == (obs_dim,) and _fits(space, obs):
            return flat
    except Exception as err:  # noqa: BLE001
        single_err = err
    try:
        leaves = _leaves(obs)
        b = int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else 0
        if b < 1:
            raise ValueError("no leading batch axis")
        rows = [np.asarray(spaces.flatten(space, o), dtype=np.float32)
                for o in gym.vector.utils.iterate(gym.vector.utils.batch_space(space, b), obs)]
        return _checked(np.stack(rows), obs_dim, bad)
    except ValueError as err:
        if "predict:" in str(err):
            raise
        raise bad(f"{single_err or err}") from err
    except Exception as err:  # noqa: BLE001
        raise bad(f"{type(err).__name__}: {single_err or err}") from err


def _checked(rows: np.ndarray, obs_dim: int, bad) -> np.ndarray:
    if rows.ndim != 2 or rows.shape[1] != obs_dim:
        raise bad(f"flattened to shape {rows.shape}, expected [B, {obs_dim}]")
    return rows


def _leaves(obs: Any) -> list:
    if isinstance(obs, dict):
        return [x for v in obs.values() for x in _leaves(v)]
    if isinstance(obs, tuple):
        return [x for v in obs for x in _leaves(v)]
    return [obs]


def _fits(space: spaces.Space, obs: Any) -> bool:
    """True when ``obs`` has the structure and leaf shapes of one sample of ``space`` (not a batch)."""
    if isinstance(space, spaces.Dict):
        return isinstance(obs, dict) and set(obs) == set(space.spaces) and all(
            _fits(s, obs[k]) for k, s in space.spaces.items())
    if isinstance(space, spaces.Tuple):
        return isinstance(obs, tuple) and len(obs) == len(space.spaces) and all(
            _fits(s, o) for s, o in zip(space.spaces, obs))
    if isinstance(space, spaces.Discrete):
        return np.ndim(obs) == 0
    if isinstance(space, (spaces.Box, spaces.MultiBinary, spaces.MultiDiscrete)):
        return tuple(np.shape(obs)) == tuple(space.shape)
    return True
