"""Evaluation and predict() never perturb training."""

import numpy as np
import torch
from mamba_rl.agents import PPOConfig, RecurrentPPO

CFG = dict(num_envs=2, num_steps=16, num_minibatches=1, update_epochs=1, d_model=16, n_layers=1, d_state=4,
           device="cpu", seed=5, total_timesteps=3 * 32, track=False, checkpoint_every=0)


def _train(tmp_path, name, callback=None):
    agent = RecurrentPPO("CartPole-v1", config=PPOConfig(**CFG, checkpoint_dir=str(tmp_path / name)))
    agent.learn(callback=callback)
    agent.close()
    return agent


def test_stochastic_evaluate_and_predict_mid_run_leave_training_unchanged(tmp_path):
    plain = _train(tmp_path, "plain")

    def evaluate_midway(agent, metrics):
        if metrics["update"] == 1:
            agent.evaluate(2, deterministic=False)
            obs = np.zeros((3, agent.policy.obs_dim), np.float32)
            agent.predict(obs, deterministic=False)

    probed = _train(tmp_path, "probed", evaluate_midway)
    torch.testing.assert_close(probed.policy.net.arena, plain.policy.net.arena, rtol=0, atol=0)
    for (n, p), (_, q) in zip(plain.policy.heads.named_parameters(), probed.policy.heads.named_parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=n)
    assert [h["losses/value_loss"] for h in probed.history] == [h["losses/value_loss"] for h in plain.history]


def test_evaluate_is_reproducible(tmp_path):
    agent = RecurrentPPO("CartPole-v1", config=PPOConfig(**CFG, checkpoint_dir=str(tmp_path)))
    a = agent.evaluate(3, deterministic=False, seed=4)
    b = agent.evaluate(3, deterministic=False, seed=4)
    np.testing.assert_array_equal(a.returns, b.returns)
    agent.close()
