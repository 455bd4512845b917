"""RecurrentPPO.evaluate: one backbone step per env step, and properties of what it returns.

Checked against the real implementation only: the episodes are the env's (CartPole pays 1 per step, so a
return is its length), every value is the critic of the step's own observation (the first one equals
``value()`` from a fresh state), greedy evaluation does not depend on the sampling generator, and the
result is reproducible.
"""

from __future__ import annotations

import numpy as np
import pytest

from mamba_rl.agents import RecurrentPPO

TINY = dict(num_envs=2, num_steps=16, num_minibatches=1, update_epochs=1, d_model=16, n_layers=2, d_state=4,
            device="cpu", seed=7, total_timesteps=32, track=False)


def _agent(**kw) -> RecurrentPPO:
    return RecurrentPPO("mamba_rl/CartPoleNoVel-v1", prev_action=True, prev_reward=True, **TINY, **kw)


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


@pytest.mark.parametrize("deterministic", [False, True])
def test_episodes_and_values_are_the_envs_and_the_critics(deterministic):
    from mamba_rl.envs import make_env

    agent = _agent()
    res = agent.evaluate(3, deterministic=deterministic, seed=200)
    assert res.returns.dtype == np.float64 and res.lengths.dtype == np.int64
    # CartPoleNoVel pays 1 per step and ends within 500 steps: every return is its episode's length
    np.testing.assert_array_equal(res.returns, res.lengths.astype(np.float64))
    assert ((res.lengths >= 1) & (res.lengths <= 500)).all()
    assert res.mean == pytest.approx(res.returns.mean()) and res.std == pytest.approx(res.returns.std())
    env = make_env(agent.config.env_id)
    for k, vals in enumerate(res.values):
        assert vals.dtype == np.float32 and np.isfinite(vals).all()
        obs, _ = env.reset(seed=200 + k)  # each episode starts from a fresh memory: V(first obs) from zeros
        first = agent.value(obs[None], agent.initial_policy_state(1), episode_start=[True], reward=[0.0])
        assert vals[0] == first[0]
    env.close()
    agent.close()


def test_greedy_evaluation_ignores_the_sampling_generator():
    import torch

    from mamba_rl.agents.evaluate import evaluate_policy

    agent = _agent()
    runs = [evaluate_policy(agent.policy, agent.config.env_id, 3, deterministic=True, seed=300,
                            train_envs=agent.envs, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    np.testing.assert_array_equal(runs[0].returns, runs[1].returns)
    for a, b in zip(runs[0].values, runs[1].values):
        np.testing.assert_array_equal(a, b)
    same = agent.evaluate(3, deterministic=True, seed=300)  # the agent's own generator: the same episodes
    np.testing.assert_array_equal(same.returns, runs[0].returns)
    agent.close()


def test_bad_episode_count():
    agent = _agent()
    with pytest.raises(ValueError, match="num_episodes must be an int >= 1, got 0"):
        agent.evaluate(0)
    agent.close()


def test_evaluate_names_a_seed_out_of_gymnasiums_range(tmp_path):
    from mamba_rl.agents import PPOConfig, RecurrentPPO

    agent = RecurrentPPO("CartPole-v1", config=PPOConfig(num_envs=2, num_steps=8, num_minibatches=1, d_model=16,
                                                         n_layers=1, track=False, device="cpu"))
    for seed in (-1, 2**32 - 1, 1.5):  # episode 1's seed would be 2**32 for the second
        with pytest.raises(ValueError, match="seed"):
            agent.evaluate(num_episodes=2, seed=seed)
    assert len(agent.evaluate(num_episodes=2, seed=2**32 - 2).returns) == 2
    agent.close()
