"""An episode start wipes everything of the old episode from the agent's input too (previous action and reward
are zeroed by a select, not a multiply), so a NaN / inf of the old episode never reaches the new one."""
import numpy as np
import pytest
import torch

from mamba_rl import RecurrentState
from mamba_rl.agents import PPOConfig, RecurrentPPO
from mamba_rl.agents.policy import PolicyState


@pytest.fixture
def agent(tmp_path):
    cfg = PPOConfig(d_model=16, n_layers=1, d_state=4, num_envs=2, num_steps=8, num_minibatches=1, update_epochs=1,
                    total_timesteps=16, prev_action=True, prev_reward=True, track=False, device="cpu",
                    runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt"))
    ag = RecurrentPPO("Pendulum-v1", config=cfg)
    yield ag
    ag.close()


def test_nan_action_of_the_old_episode_does_not_leak_past_a_start(agent):
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((2, 3)).astype(np.float32)
    starts = np.ones(2, bool)
    fresh, _ = agent.predict(obs, agent.initial_policy_state(2), starts, deterministic=True, reward=np.zeros(2))
    with pytest.raises(ValueError, match=r"obs rows \[0, 1\] hold NaN / inf values"):  # refused at the door
        agent.predict(np.full((2, 3), np.nan, np.float32), agent.initial_policy_state(2), starts, reward=np.zeros(2))
    # the old episode's last action and memory NaN (as a NaN from a user's own loop would leave them)
    _, old = agent.predict(obs, agent.initial_policy_state(2), starts, deterministic=True, reward=np.zeros(2))
    bad_state = PolicyState(RecurrentState(torch.full_like(old.recurrent.conv, float("nan")),
                                           torch.full_like(old.recurrent.ssm, float("nan"))),
                            torch.full_like(old.prev_action, float("nan")), old.prev_reward, old.episode_step)
    after, state = agent.predict(obs, bad_state, starts, deterministic=True, reward=np.zeros(2))
    np.testing.assert_array_equal(after, fresh)
    assert bool(state.recurrent.ssm.isfinite().all())


def test_inf_last_reward_passed_with_a_start_is_ignored(agent):
    obs = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    starts = np.ones(2, bool)
    fresh, _ = agent.predict(obs, agent.initial_policy_state(2), starts, deterministic=True, reward=np.zeros(2))
    got, state = agent.predict(obs, agent.initial_policy_state(2), starts, deterministic=True,
                               reward=np.array([np.inf, np.nan]))
    np.testing.assert_array_equal(got, fresh)
    assert bool(state.recurrent.ssm.isfinite().all())


def test_per_env_arguments_of_the_wrong_length_name_themselves(agent):
    obs = np.random.default_rng(2).standard_normal((2, 3)).astype(np.float32)
    with pytest.raises(ValueError, match=r"episode_start must hold one value per env, expected shape \[2\], got \[3\]"):
        agent.predict(obs, agent.initial_policy_state(2), np.ones(3, bool), reward=np.zeros(2))
    with pytest.raises(ValueError, match=r"reward must hold one value per env, expected shape \[2\], got \[3\]"):
        agent.predict(obs, agent.initial_policy_state(2), np.zeros(2, bool), reward=np.zeros(3))
    with pytest.raises(ValueError, match="state must be the PolicyState a previous call returned"):
        agent.predict(obs, ("not", "a state"), np.zeros(2, bool), reward=np.zeros(2))
