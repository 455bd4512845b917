"""RecurrentPPO.evaluate: one backbone step per env step, and the returns of the two-call loop it replaced."""

from __future__ import annotations

import numpy as np
import pytest

from mamba_rl.agents import RecurrentPPO

TINY = dict(num_envs=2, num_steps=16, num_minibatches=1, update_epochs=1, d_model=16, n_layers=2, d_state=4,
            device="cpu", seed=7, total_timesteps=32, track=False)


def _agent(**kw) -> RecurrentPPO:
    return RecurrentPPO("mamba_rl/CartPoleNoVel-v1", prev_action=True, prev_reward=True, **TINY, **kw)


def _old_evaluate(agent: RecurrentPPO, num_episodes: int, deterministic: bool, seed: int):
    """The loop evaluate used before: value() then predict() per env step (two backbone steps)."""
    from mamba_rl.envs import make_env

    env = make_env(agent.config.env_id)  # no normalize_obs in this config
    scale = _reward_scale(agent)  # the prev-reward input sees rewards scaled as in training
    returns, lengths, values = [], [], []
    for ep in range(num_episodes):
        obs, _ = env.reset(seed=seed + ep)
        state, start, reward, total, steps, vals = None, True, 0.0, 0.0, 0, []
        while True:
            r_in = [reward * scale]
            vals.append(float(agent.value(obs[None], state or agent.initial_policy_state(1), [start], reward=r_in)[0]))
            action, state = agent.predict(obs[None], state, episode_start=[start], deterministic=deterministic,
                                          reward=r_in)
            obs, reward, term, trunc, _ = env.step(action[0])
            total, steps, start = total + float(reward), steps + 1, False
            if term or trunc:
                break
        returns.append(total)
        lengths.append(steps)
        values.append(np.asarray(vals, dtype=np.float32))
    env.close()
    return np.asarray(returns), np.asarray(lengths), values


def _reward_scale(agent: RecurrentPPO) -> float:
    import gymnasium as gym

    from mamba_rl.envs import find_vector_wrapper

    rnorm = find_vector_wrapper(agent.envs, gym.wrappers.vector.NormalizeReward)
    return float(1.0 / np.sqrt(rnorm.return_rms.var + rnorm.epsilon))


def test_one_backbone_step_per_env_step(monkeypatch):
    agent = _agent()
    stepper_cls = type(agent.stepper)
    calls = []
    real_step = stepper_cls.step

    def counting_step(self, *args, **kwargs):
        calls.append(self.batch)
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(stepper_cls, "step", counting_step)
    res = agent.evaluate(3, deterministic=False, seed=100)
    assert len(calls) == int(res.lengths.sum()) > 0  # was 2 per env step (value() then predict())
    assert set(calls) == {1}
    assert [len(v) for v in res.values] == res.lengths.tolist()
    agent.close()


def test_same_returns_as_before_on_a_fixed_seed():
    # recorded at the commit before the split (value() + predict() per env step), CPU, this config
    agent = _agent()
    sampled = agent.evaluate(4, deterministic=False, seed=100)
    greedy = agent.evaluate(4, deterministic=True, seed=100)
    assert sampled.returns.tolist() == [22.0, 44.0, 21.0, 56.0]
    assert greedy.returns.tolist() == [9.0, 10.0, 10.0, 9.0]
    agent.close()


@pytest.mark.parametrize("deterministic", [False, True])
def test_matches_the_two_call_loop_exactly(deterministic):
    agent = _agent()
    rng = agent.sample_generator.get_state()
    new = agent.evaluate(3, deterministic=deterministic, seed=200)
    agent.sample_generator.set_state(rng)  # the old loop samples from the same generator state
    returns, lengths, values = _old_evaluate(agent, 3, deterministic, seed=200)
    np.testing.assert_array_equal(new.returns, returns)
    np.testing.assert_array_equal(new.lengths, lengths)
    for a, b in zip(new.values, values):
        np.testing.assert_array_equal(a, b)  # the value comes from the same backbone step, bit for bit
    agent.close()


def test_bad_episode_count():
    agent = _agent()
    with pytest.raises(ValueError, match="num_episodes must be >= 1"):
        agent.evaluate(0)
    agent.close()
