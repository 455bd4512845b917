"""A CUDA agent deeper than the one-token kernel's 16 layers acts and trains: the stepper falls back to the
torch step (ops/capability.py) inside the rollout graph instead of failing at the first rollout step."""
import math

import pytest
import torch

pytestmark = pytest.mark.cuda


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_20_layer_cuda_agent_trains(tmp_path):
    from mamba_rl.agents import PPOConfig, RecurrentPPO

    cfg = PPOConfig(d_model=32, n_layers=20, d_state=16, num_envs=4, num_steps=16, num_minibatches=2,
                    update_epochs=1, total_timesteps=128, device="cuda", seed=3, track=False, checkpoint_every=0,
                    runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt"))
    agent = RecurrentPPO("CartPole-v1", config=cfg)
    assert agent.policy.net.backend == "cuda"
    before = agent.policy.net.arena.clone()
    agent.learn()
    assert agent.update == 2 and agent.global_step == 128
    assert torch.isfinite(agent.policy.net.arena).all() and not torch.equal(before, agent.policy.net.arena)
    assert all(math.isfinite(m["losses/value_loss"]) for m in agent.history)
    agent.close()
