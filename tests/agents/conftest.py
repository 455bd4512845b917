"""Fixtures shared by the agent tests."""

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces


class ToyEnv(gym.Env):
    def __init__(self, length: int, terminate: bool):
        self.length, self.terminate = length, terminate
        self.observation_space = spaces.Box(-10, 10, (2,), np.float32)
        self.action_space = spaces.Discrete(2)

    def _obs(self):
        return np.array([self.t / 10.0, self.np_random.normal()], dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), 1.0 + float(action), self.terminate and self.t >= self.length, False, {}


def make_toy_envs(n=4, terminate=False):
    def make(i):
        def thunk():
            env = ToyEnv(3 + i, terminate)
            return env if terminate else gym.wrappers.TimeLimit(env, max_episode_steps=3 + i)
        return thunk
    envs = gym.vector.SyncVectorEnv([make(i) for i in range(n)])
    return gym.wrappers.vector.RecordEpisodeStatistics(envs)




@pytest.fixture
def toy_envs():
    """``toy_envs(n=4, terminate=False)``: a RecordEpisodeStatistics SyncVectorEnv of n :class:`ToyEnv`
    (env i: episodes of 3 + i steps, terminated when ``terminate`` else truncated by a TimeLimit)."""
    return make_toy_envs
