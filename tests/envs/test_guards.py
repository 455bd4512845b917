"""The env boundary (envs/guards.py): non-finite observations / rewards, dead async workers."""

import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from mamba_rl.envs import EnvGuard, EnvWorkerDied, NonFiniteEnvError, find_vector_wrapper, make_vec_env


class NaNEnv(gym.Env):
    """Box(3) observations; from step ``at`` on, returns a NaN observation (``what="obs"``) or reward."""

    def __init__(self, at: int = 3, what: str = "reward", bad_env: bool = True):
        self.observation_space = spaces.Box(-1, 1, (3,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.at, self.what, self.bad, self.t = at, what, bad_env, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, np.float32), {}

    def step(self, action):
        self.t += 1
        obs, reward = np.full(3, 0.5, np.float32), 1.0
        if self.bad and self.t >= self.at:
            if self.what == "obs":
                obs[1] = np.nan
            else:
                reward = float("nan")
        return obs, reward, self.t >= 50, False, {}


def _vec(what: str, nonfinite: str = "raise") -> gym.vector.VectorEnv:
    envs = [lambda: NaNEnv(what=what, bad_env=False), lambda: NaNEnv(what=what, bad_env=True)]
    return EnvGuard(gym.vector.SyncVectorEnv(envs), nonfinite)


@pytest.mark.parametrize("what", ["obs", "reward"])
def test_nonfinite_values_raise_naming_env_step_and_kind(what):
    envs = _vec(what)
    envs.reset(seed=0)
    envs.step(np.zeros(2, np.int64))
    envs.step(np.zeros(2, np.int64))
    with pytest.raises(NonFiniteEnvError, match=rf"env 1 returned a non-finite {'observation' if what == 'obs' else 'reward'} at step 3"):
        envs.step(np.zeros(2, np.int64))


def test_zero_policy_replaces_and_counts():
    envs = _vec("obs", "zero")
    envs.reset(seed=0)
    for _ in range(4):
        obs, reward, *_ = envs.step(np.zeros(2, np.int64))
        assert np.isfinite(obs).all() and np.isfinite(reward).all()
    assert envs.nonfinite_obs == 2 and envs.nonfinite_rewards == 0  # steps 3 and 4 of env 1, one value each
    assert obs[1, 1] == 0.0 and obs[1, 0] == 0.5


def test_make_vec_env_puts_the_guard_below_the_statistics():
    envs = make_vec_env("CartPole-v1", 2, normalize_obs=True, nonfinite="zero")
    guard = find_vector_wrapper(envs, EnvGuard)
    assert guard is not None and guard.nonfinite == "zero"
    assert isinstance(guard.env, gym.vector.SyncVectorEnv)  # right above the raw vector env
    envs.close()
    with pytest.raises(ValueError, match="nonfinite must be 'raise' or 'zero', got 'ignore'"):
        make_vec_env("CartPole-v1", 2, nonfinite="ignore")


def test_a_killed_async_worker_is_named():
    envs = make_vec_env("CartPole-v1", 2, async_=True, start_method="fork")
    try:
        envs.reset(seed=0)
        envs.step(np.zeros(2, np.int64))
        proc = envs.unwrapped.processes[1]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)
        with pytest.raises(EnvWorkerDied, match=rf"async env worker 1 \(env 1, pid {proc.pid}\) was killed by SIGKILL"):
            for _ in range(3):
                envs.step(np.zeros(2, np.int64))
    finally:
        t0 = time.time()
        try:
            envs.close(terminate=True)
        except Exception:  # noqa: BLE001 - the broken pipe again; the test is about the step's error
            pass
        assert time.time() - t0 < 30
