"""PPOConfig.obs_norm_freeze_steps: the observation normaliser stops updating at the first rollout at or past
the step, on a fresh run and after a resume; bad values are errors naming the field."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from mamba_rl.agents import PPOConfig, RecurrentPPO
from mamba_rl.envs import find_vector_wrapper

TINY = dict(num_envs=2, num_steps=16, num_minibatches=1, update_epochs=1, d_model=8, n_layers=1, d_state=2,
            device="cpu", seed=5, track=False, checkpoint_every=0, normalize_obs=True)


def _rms(agent):
    return find_vector_wrapper(agent.envs, gym.wrappers.vector.NormalizeObservation).obs_rms


def test_the_normaliser_counts_only_the_steps_before_the_freeze(tmp_path):
    # 32 steps per rollout; freeze at 64: rollouts 1-2 update the statistics, rollouts 3-4 (at 64, 96) do not
    runs = {}
    for freeze in (0, 64):
        agent = RecurrentPPO("CartPole-v1", config=PPOConfig(**TINY, total_timesteps=128, obs_norm_freeze_steps=freeze,
                                                             checkpoint_dir=str(tmp_path / f"f{freeze}")))
        agent.learn()
        runs[freeze] = (_rms(agent).count, _rms(agent).mean.copy())
        agent.close()
    # gymnasium's RunningMeanStd starts at count 1e-4 and also counts the 2 observations of the first reset
    assert runs[0][0] == pytest.approx(2 + 128 + 1e-4) and runs[64][0] == pytest.approx(2 + 64 + 1e-4)
    assert not np.array_equal(runs[0][1], runs[64][1])


def test_a_resume_past_the_freeze_step_stays_frozen(tmp_path):
    """Trained to 96 steps with the freeze at 64, saved, resumed to 160: the statistics are those of the
    first 64 steps, as in the uninterrupted run."""
    cfg = dict(TINY, obs_norm_freeze_steps=64)
    whole = RecurrentPPO("CartPole-v1", config=PPOConfig(**cfg, total_timesteps=160, checkpoint_dir=str(tmp_path / "a")))
    whole.learn()
    first = RecurrentPPO("CartPole-v1", config=PPOConfig(**cfg, total_timesteps=96, checkpoint_dir=str(tmp_path / "b")))
    first.learn()
    first.save(tmp_path / "b" / "mid")
    first.close()
    resumed = RecurrentPPO.load(tmp_path / "b" / "mid", total_timesteps=160)
    resumed.learn()
    assert resumed.global_step == whole.global_step == 160
    for attr in ("mean", "var", "count"):
        assert np.array_equal(getattr(_rms(resumed), attr), getattr(_rms(whole), attr)), attr
    assert _rms(resumed).count == pytest.approx(2 + 64 + 1e-4)  # the first reset's 2 observations and 64 steps
    whole.close(), resumed.close()


@pytest.mark.parametrize("kw,match", [
    (dict(obs_norm_freeze_steps=-1, normalize_obs=True), r"PPOConfig.obs_norm_freeze_steps"),
    (dict(obs_norm_freeze_steps=1.5, normalize_obs=True), r"PPOConfig.obs_norm_freeze_steps"),
])
def test_bad_freeze_values_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(**kw)


def test_the_freeze_step_is_ignored_without_normalize_obs():
    """The default freezes after 20k steps; turning the normaliser off (--no-normalize-obs) needs no second flag."""
    cfg = PPOConfig(normalize_obs=False)
    assert cfg.obs_norm_freeze_steps == 20_000 and not cfg.normalize_obs


def test_a_run_that_normalised_discrete_observations_resumes_with_its_normaliser(tmp_path):
    """Before 2026-12-04 normalize_obs normalised all-discrete (one-hot) observations too; with obs_norm_discrete off
    (the continuous-only rule) make_vec_env leaves them as they are, so a checkpoint holding their statistics gets
    its normaliser back on resume (its policy was trained on normalised inputs), with the saved statistics."""
    from mamba_rl.envs import make_vec_env

    cfg = PPOConfig(**TINY, env_id="FrozenLake-v1", total_timesteps=64, checkpoint_dir=str(tmp_path / "ck"),
                    obs_norm_discrete=False)
    fresh = RecurrentPPO(config=cfg)
    assert find_vector_wrapper(fresh.envs, gym.wrappers.vector.NormalizeObservation) is None  # that rule
    fresh.close()
    # the old stack: the normaliser over the one-hot codes
    old_envs = gym.wrappers.vector.NormalizeObservation(make_vec_env("FrozenLake-v1", 2, seed=5))
    agent = RecurrentPPO(old_envs, config=cfg)
    agent.learn()
    path = agent.save(tmp_path / "old")
    saved = (_rms(agent).mean.copy(), _rms(agent).var.copy(), _rms(agent).count)
    agent.close()
    assert saved[2] > 1  # it did update

    resumed = RecurrentPPO.load(path)
    try:
        rms = _rms(resumed)
        np.testing.assert_array_equal(rms.mean, saved[0])
        np.testing.assert_array_equal(rms.var, saved[1])
        assert rms.count == saved[2]
        resumed.learn(total_timesteps=96)  # and it trains on
        assert resumed.global_step == 96
    finally:
        resumed.close()
