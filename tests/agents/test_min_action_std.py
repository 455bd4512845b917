"""PPOConfig.min_action_std: the Gaussian's log_std floor, as a fraction of each action dimension's half-range."""

import math

import numpy as np
import pytest
import torch
from gymnasium import spaces
from mamba_rl.agents import PPOConfig, RecurrentPPO
from mamba_rl.agents.heads import ActorHead

TINY = dict(num_envs=4, num_steps=32, num_minibatches=2, update_epochs=2, d_model=16, n_layers=2, d_state=4,
            seed=7, track=False)


def _agent(tmp_path, device="cpu", **kw):
    cfg = PPOConfig(**dict(TINY, device=device, runs_dir=str(tmp_path / "runs"),
                           checkpoint_dir=str(tmp_path / "ckpt"), **kw))
    return RecurrentPPO("Pendulum-v1", config=cfg)


def test_floor_is_log_of_the_fraction_of_each_half_range():
    box = spaces.Box(np.array([-2.0, 0.0, -np.inf]), np.array([2.0, 0.5, np.inf]), dtype=np.float32)
    head = ActorHead(8, box)
    floor = head.log_std_floor(0.2)
    assert floor.dtype == torch.float32 and floor.shape == (3,)
    # half-ranges 2, 0.25 and (an infinite bound) 1
    torch.testing.assert_close(floor, torch.tensor([math.log(0.4), math.log(0.05), math.log(0.2)]))
    assert torch.isneginf(head.log_std_floor(0.0)).all()
    assert ActorHead(8, spaces.Discrete(3)).log_std_floor(0.2) is None
    assert ActorHead(8, spaces.MultiDiscrete([2, 3])).log_std_floor(0.2) is None


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.2"])
def test_out_of_range_fraction_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="PPOConfig.min_action_std must be"):
        PPOConfig(min_action_std=bad)


def test_update_raises_a_low_log_std_to_the_floor_and_zero_turns_it_off(tmp_path):
    agent = _agent(tmp_path / "on", total_timesteps=128, min_action_std=0.2)
    actor = agent.policy.heads["actor"]
    actor.log_std.data.fill_(-3.0)  # std 0.05, far below 0.2 * 2 = 0.4
    agent.learn()
    floor = math.log(0.4)
    ls = actor.log_std.detach()
    # each head step is followed by the projection, so the last step leaves it at or above the floor
    assert float(ls.min()) >= floor - 1e-7
    assert float(ls.min()) < floor + 0.05  # a few Adam steps of lr 2e-3 move it only a little above
    # the rollout samples with the parameter the update left (the host copy)
    assert float(agent.policy.host_log_std().min()) >= floor - 1e-7
    agent.close()

    off = _agent(tmp_path / "off", total_timesteps=128, min_action_std=0.0)
    off.policy.heads["actor"].log_std.data.fill_(-3.0)
    off.learn()
    assert float(off.policy.heads["actor"].log_std.detach().max()) < -2.9  # only the optimizer moved it
    off.close()


def test_a_changed_fraction_takes_effect_in_the_next_update(tmp_path):
    agent = _agent(tmp_path, total_timesteps=128, min_action_std=0.0)
    actor = agent.policy.heads["actor"]
    actor.log_std.data.fill_(-3.0)
    agent.learn()
    assert float(actor.log_std.detach().max()) < -2.9
    agent.config = agent.config.replace(min_action_std=0.1)
    agent.learn(total_timesteps=256)
    assert float(actor.log_std.detach().min()) >= math.log(0.2) - 1e-7
    agent.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_update_applies_and_refreshes_the_floor(tmp_path):
    agent = _agent(tmp_path, device="cuda", total_timesteps=128, min_action_std=0.0, cuda_graphs=True)
    actor = agent.policy.heads["actor"]
    actor.log_std.data.fill_(-3.0)
    agent.learn()
    assert float(actor.log_std.detach().max()) < -2.9
    agent.config = agent.config.replace(min_action_std=0.2)  # the captured graph reads the refreshed floor
    agent.learn(total_timesteps=256)
    assert float(actor.log_std.detach().min()) >= math.log(0.4) - 1e-6
    agent.close()
