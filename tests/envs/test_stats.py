"""envs/stats.py: the vector statistics / reward normalisation wrappers give gymnasium's results bit for bit."""

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from mamba_rl.envs import find_vector_wrapper, make_vec_env
from mamba_rl.envs.stats import VecEpisodeStatistics, VecNormalizeReward, mean_var


class RandomEpisodes(gym.Env):
    """Random rewards (float64), terminations and truncations at ~10% / 5% per step, from its own seed."""

    def __init__(self, seed: int = 0):
        self.observation_space = spaces.Box(-1, 1, (2,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.rng = np.random.default_rng(seed)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        r = float(self.rng.normal() * 3 + action)
        return self.rng.random(2).astype(np.float32), r, bool(self.rng.random() < 0.1), bool(self.rng.random() < 0.05), {}


def _vec(n: int, mode: AutoresetMode) -> gym.vector.VectorEnv:
    return gym.vector.SyncVectorEnv([lambda i=i: RandomEpisodes(i) for i in range(n)], autoreset_mode=mode)


def _same(a, b) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _same(a[k], b[k])
        return
    if a is None or b is None:
        assert a is None and b is None
        return
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == object:  # SAME_STEP's final_obs / final_info: one entry per sub-env
        for x, y in zip(a.reshape(-1), b.reshape(-1)):
            _same(x, y)
    elif a.dtype.kind == "f":
        assert a.tobytes() == b.tobytes()
    else:
        np.testing.assert_array_equal(a, b)


def test_mean_var_is_numpy_mean_and_var_bit_for_bit():
    rng = np.random.default_rng(0)
    for trial in range(400):
        n = int(rng.integers(1, 3000))
        x = (rng.standard_normal(n) * 10 ** rng.uniform(-3, 4) + rng.uniform(-50, 50)).astype(
            (np.float32, np.float64)[trial % 2])
        m, v = mean_var(x)
        assert m.tobytes() == np.mean(x, axis=0).tobytes() and type(m) is type(np.mean(x, axis=0))
        assert v.tobytes() == np.var(x, axis=0).tobytes() and type(v) is type(np.var(x, axis=0))
    with pytest.raises(ValueError, match=r"expected a non-empty 1-D float array, got int64 \(3,\)"):
        mean_var(np.arange(3))


# gymnasium 1.2's NormalizeReward keeps no previous dones (it accumulates over the NextStep reset step)
_OLD_GYM_NORMALIZE = not hasattr(gym.wrappers.vector.NormalizeReward(_vec(1, AutoresetMode.NEXT_STEP)), "_prev_dones")


@pytest.mark.skipif(_OLD_GYM_NORMALIZE, reason="this gymnasium's NormalizeReward predates the NextStep rule")
@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
@pytest.mark.parametrize("n", [1, 7, 64])
def test_wrappers_match_gymnasium_step_by_step(mode, n):
    buf = 3 if n == 64 else 100  # 64 envs: more episodes end in one step than the queues hold
    ours = VecNormalizeReward(VecEpisodeStatistics(_vec(n, mode), buffer_length=buf), gamma=0.97)
    ref = gym.wrappers.vector.NormalizeReward(gym.wrappers.vector.RecordEpisodeStatistics(_vec(n, mode),
                                                                                          buffer_length=buf), gamma=0.97)
    _same(ours.reset(seed=1)[0], ref.reset(seed=1)[0])
    rng = np.random.default_rng(5)
    finished = 0
    for t in range(300):
        a = rng.integers(0, 2, n)
        if t == 150:  # frozen statistics take the same path
            ours.update_running_mean = ref.update_running_mean = False
        o1, r1, te1, tr1, i1 = ours.step(a)
        o2, r2, te2, tr2, i2 = ref.step(a)
        _same(o1, o2), _same(r1, r2), _same(te1, te2), _same(tr1, tr2)
        i1.get("episode", {}).pop("t", None), i2.get("episode", {}).pop("t", None)  # wall-clock times
        _same(i1, i2)
        finished += int(np.sum(te1 | tr1))
    assert finished > 20
    s1, s2 = ours.env, ref.env
    _same(ours.accumulated_reward, ref.accumulated_reward)
    for attr in ("mean", "var"):
        _same(getattr(ours.return_rms, attr), getattr(ref.return_rms, attr))
    assert ours.return_rms.count == ref.return_rms.count
    assert list(s1.return_queue) == list(s2.return_queue) and list(s1.length_queue) == list(s2.length_queue)
    assert len(s1.return_queue) == min(buf, finished) and len(s1.time_queue) == len(s2.time_queue)
    assert s1.episode_count == s2.episode_count
    _same(s1.episode_returns, s2.episode_returns), _same(s1.episode_lengths, s2.episode_lengths)


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_normalize_reward_keeps_its_rules_on_a_gymnasium_without_them(mode, monkeypatch):
    """gymnasium 1.2's NormalizeReward sets neither ``_prev_dones`` nor ``_autoreset_mode`` (on the H200 host,
    whose gymnasium is 1.2.2, every normalised-reward run raised AttributeError): ours sets its own, and gives
    the same rewards as on the gymnasium that has them."""
    n = 7
    ref = VecNormalizeReward(_vec(n, mode), gamma=0.97)
    original_init = gym.wrappers.vector.NormalizeReward.__init__

    def old_init(self, env, gamma=0.99, epsilon=1e-8):
        original_init(self, env, gamma=gamma, epsilon=epsilon)
        for attr in ("_prev_dones", "_autoreset_mode"):
            self.__dict__.pop(attr, None)

    monkeypatch.setattr(gym.wrappers.vector.NormalizeReward, "__init__", old_init)
    ours = VecNormalizeReward(_vec(n, mode), gamma=0.97)
    _same(ours.reset(seed=2)[0], ref.reset(seed=2)[0])
    rng = np.random.default_rng(3)
    for _ in range(200):
        a = rng.integers(0, 2, n)
        _same(ours.step(a)[1], ref.step(a)[1])
    _same(ours.accumulated_reward, ref.accumulated_reward)
    assert ours.return_rms.count == ref.return_rms.count


def test_make_vec_env_uses_them_and_they_are_gymnasiums_types():
    envs = make_vec_env("CartPole-v1", 2, normalize_reward=True)
    assert isinstance(find_vector_wrapper(envs, gym.wrappers.vector.NormalizeReward), VecNormalizeReward)
    assert isinstance(find_vector_wrapper(envs, gym.wrappers.vector.RecordEpisodeStatistics), VecEpisodeStatistics)
    envs.close()


def test_only_sub_env_0_keeps_the_checking_wrappers():
    envs = make_vec_env("CartPole-v1", 3)

    def chain(e):
        out = []
        while isinstance(e, gym.Wrapper):
            out.append(type(e).__name__)
            e = e.env
        return out

    subs = envs.unwrapped.envs
    assert chain(subs[0]) == ["TimeLimit", "OrderEnforcing", "PassiveEnvChecker"]
    assert chain(subs[1]) == chain(subs[2]) == ["TimeLimit"]
    assert subs[1].spec.max_episode_steps == 500
    with pytest.raises(gym.error.ResetNeeded):  # a step before the reset still fails (sub-env 0)
        envs.step(np.zeros(3, np.int64))
    envs.close()
