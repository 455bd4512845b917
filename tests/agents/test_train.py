"""RecurrentPPO end to end on CPU: TensorBoard tags, exact resume, evaluation memory resets, spaces."""

import math
import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from mamba_rl import CheckpointError
from mamba_rl.agents import SCALAR_TAGS, PPOConfig, RecurrentPPO
from mamba_rl.envs import find_vector_wrapper

TINY = dict(num_envs=4, num_steps=32, num_minibatches=2, update_epochs=2, d_model=16, n_layers=2, d_state=4,
            device="cpu", seed=7)


def _cfg(tmp_path, **kw):
    d = dict(TINY, runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt"))
    d.update(kw)
    return PPOConfig(**d)


def test_tensorboard_writes_every_tag(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    agent = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, total_timesteps=2 * 128, checkpoint_every=0))
    agent.learn()
    agent.close()
    run_dir = tmp_path / "runs" / agent.run_name
    assert agent.run_name.startswith("CartPole-v1__mamba_ppo__7__")
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    missing = set(SCALAR_TAGS) - tags
    assert not missing, f"missing tags {sorted(missing)}"
    assert len(acc.Scalars("losses/value_loss")) == 2  # once per update
    assert [e.step for e in acc.Scalars("charts/SPS")] == [128, 256]  # x axis: global env steps
    rets = [e.value for e in acc.Scalars("charts/episodic_return")]
    assert rets and all(r >= 8 for r in rets)  # CartPole episodes last >= 8 steps
    lr = [e.value for e in acc.Scalars("charts/learning_rate")]
    assert lr == pytest.approx([agent.config.learning_rate, agent.config.learning_rate / 2])  # linear anneal
    text_tags = acc.Tags().get("tensors", [])
    assert any("hyperparameters" in t for t in text_tags)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")])])
def test_resume_continues_with_identical_losses(tmp_path, device):
    cfg = _cfg(tmp_path, num_steps=16, total_timesteps=4 * 64, checkpoint_every=1, normalize_obs=True,
               prev_action=True, prev_reward=True, device=device)
    straight = RecurrentPPO("mamba_rl/CartPoleNoVel-v1", config=cfg)
    straight.learn()
    straight.close()
    ckpt = tmp_path / "ckpt" / straight.run_name / "update_000002"
    resumed = RecurrentPPO.load(ckpt, restore_envs=True)  # the env snapshot (a pickle) only on request
    assert resumed.update == 2 and resumed.global_step == 2 * 64
    resumed.learn()
    resumed.close()
    keys = [k for k in straight.history[0] if k.startswith("losses/") or k.startswith("backbone/")]
    assert len(resumed.history) == 2
    for a, b in zip(straight.history[2:], resumed.history):
        for k in keys:
            if not (math.isnan(a[k]) and math.isnan(b[k])):
                assert a[k] == b[k], (k, a[k], b[k])
    # and the final weights are bit-identical
    torch.testing.assert_close(resumed.policy.net.arena, straight.policy.net.arena, rtol=0, atol=0)
    for (n, p), (_, q) in zip(straight.policy.heads.named_parameters(), resumed.policy.heads.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


def test_evaluation_resets_memory_per_episode(tmp_path):
    agent = RecurrentPPO("mamba_rl/CartPoleNoVel-v1", config=_cfg(tmp_path, total_timesteps=128, track=False))
    many = agent.evaluate(3, deterministic=True, seed=100)
    alone = agent.evaluate(1, deterministic=True, seed=102)  # the 3rd episode, run from a fresh agent state
    np.testing.assert_array_equal(many.values[2], alone.values[0])
    assert many.returns[2] == alone.returns[0]
    # control: memory does matter for this agent, so equal values above mean it was reset
    obs = np.zeros((1, agent.policy.obs_dim), np.float32)
    _, s = agent.predict(obs)
    _, s = agent.predict(obs + 1, s, reward=[1.0])  # the default agent takes the last reward as an input
    v_carry = agent.value(obs, s, episode_start=[False], reward=[1.0])
    v_reset = agent.value(obs, s, episode_start=[True])  # a start needs no reward: the input is 0 there
    assert not np.allclose(v_carry, v_reset)
    agent.close()


def test_predict_api_shapes_and_errors(tmp_path):
    agent = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, total_timesteps=128, track=False, prev_reward=True))
    obs = np.zeros((3, 4), np.float32)
    a, s = agent.predict(obs, deterministic=True)
    assert a.shape == (3,) and a.dtype.kind == "i" and s.recurrent.ssm.shape[1] == 3
    a1, s1 = agent.predict(obs, s, episode_start=np.zeros(3, bool), reward=np.ones(3))
    assert a1.shape == (3,)
    single, _ = agent.predict(np.zeros(4, np.float32))
    assert np.ndim(single) == 0
    with pytest.raises(ValueError, match=r"obs must be \[B, 4\]"):
        agent.predict(np.zeros((3, 5), np.float32))
    with pytest.raises(ValueError, match="pass reward="):
        agent.predict(obs, s)
    # a reward the agent could not have seen in training is refused, and the state is left as it was
    for bad, msg in [([np.nan, 0.0, 0.0], "reward must be finite"), ([0.0, np.inf, 0.0], "reward must be finite"),
                     ([1e39, 0.0, 0.0], "reward must be finite"), ([None, 0.0, 0.0], "reward must be numbers"),
                     (["a", "b", "c"], "reward must be numbers"), ("1", "reward must be numbers"),
                     ([0.0, 1.0], r"one value per env, expected shape \[3\]")]:
        with pytest.raises(ValueError, match=msg), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # 1e39: no numpy overflow warning before the error
            agent.predict(obs, s, reward=bad)
    assert torch.isfinite(s.recurrent.ssm).all()
    # value(): the same reward rule (no stale reward from the state)
    with pytest.raises(ValueError, match="value: this agent uses prev_reward; pass reward="):
        agent.value(obs, s1, episode_start=np.zeros(3, bool))
    with pytest.raises(ValueError, match="value: reward must be finite"):
        agent.value(obs, s1, episode_start=np.zeros(3, bool), reward=[np.nan, 0.0, 0.0])
    v = agent.value(obs, s1, episode_start=np.zeros(3, bool), reward=np.ones(3))
    assert v.shape == (3,) and np.isfinite(v).all()
    agent.close()
    # without prev_reward the reward is not an input: anything given is ignored
    off = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path / "off", total_timesteps=128, track=False,
                                                   prev_reward=False))
    _, s = off.predict(obs)
    a2, _ = off.predict(obs, s, reward=["a", "b", "c"])
    assert a2.shape == (3,)
    off.close()


class _AnyEnv(gym.Env):
    def __init__(self, observation_space, action_space):
        self.observation_space, self.action_space = observation_space, action_space

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        assert self.action_space.contains(action), action
        self.t += 1
        return self.observation_space.sample(), 1.0, self.t >= 5, False, {}


@pytest.mark.parametrize("obs_space,act_space", [
    (spaces.MultiDiscrete([3, 4]), spaces.Discrete(3)),  # sb3-contrib's RecurrentPPO crashes here
    (spaces.Tuple((spaces.Discrete(2), spaces.Discrete(4))), spaces.MultiDiscrete([2, 3])),
    (spaces.Dict({"p": spaces.Box(-1, 1, (2,)), "d": spaces.Discrete(3)}), spaces.Box(-2, 2, (2,), np.float32)),
    (spaces.Discrete(5), spaces.Discrete(2, start=1)),
])
def test_observation_and_action_spaces_train(tmp_path, obs_space, act_space):
    gym.register("mamba_rl_test/Any-v0", entry_point=_AnyEnv,
                 kwargs={"observation_space": obs_space, "action_space": act_space})
    try:
        agent = RecurrentPPO("mamba_rl_test/Any-v0", config=_cfg(tmp_path, total_timesteps=128, track=False,
                                                                 prev_action=True, prev_reward=True))
        assert agent.policy.obs_dim == spaces.flatdim(obs_space)
        agent.learn()
        m = agent.history[-1]
        assert all(np.isfinite(m[k]) for k in ("losses/value_loss", "losses/policy_loss", "losses/entropy"))
        assert m["debug/rollout_parity"] < 1e-5
        res = agent.evaluate(1)
        assert res.lengths[0] == 5
        agent.close()
    finally:
        del gym.registry["mamba_rl_test/Any-v0"]


def test_box_actions_are_clipped_for_the_env_and_stored_raw(tmp_path):
    agent = RecurrentPPO("Pendulum-v1", config=_cfg(tmp_path, total_timesteps=128, track=False))
    agent.policy.heads["actor"].log_std.data.fill_(2.0)  # std e^2: many samples fall outside [-2, 2]
    agent.collect_rollout()
    acts = agent.buffer.actions
    assert acts.abs().max() > 2.0  # stored unclipped (its logprob is the sampled one)
    env_a = agent.policy.stager(4).to_env(acts[:, 0].numpy())
    assert np.abs(env_a).max() <= 2.0 and env_a.shape == (4, 1)
    agent.close()


def test_popgym_env_trains(tmp_path):
    pytest.importorskip("popgym")
    agent = RecurrentPPO("popgym-RepeatPreviousEasy-v0", config=_cfg(tmp_path, total_timesteps=128, track=False))
    agent.learn()
    assert np.isfinite(agent.history[-1]["losses/value_loss"])
    agent.close()


def test_resume_never_reads_the_env_pickle_unless_asked(tmp_path):
    cfg = _cfg(tmp_path, num_steps=16, total_timesteps=64)
    agent = RecurrentPPO("CartPole-v1", config=cfg)
    agent.learn()
    agent.close()
    ckpt = tmp_path / "ckpt" / agent.run_name / "final"
    (ckpt / "envs.pkl").write_bytes(b"not a pickle")  # a tampered env snapshot
    resumed = RecurrentPPO.load(ckpt)  # default: safetensors + JSON only, fresh envs
    assert resumed.update == agent.update
    resumed.close()
    with pytest.raises(CheckpointError, match=r"this envs.pkl \(SHA-256 [0-9a-f]{12}\.\.\.\) is not the one saved with "
                                              r"agent.safetensors"):
        RecurrentPPO.load(ckpt, restore_envs=True)  # refused before anything is unpickled


def test_predict_takes_raw_observations_and_normalises_them_as_training_did(tmp_path):
    """predict / value apply the agent's own observation normalisation (frozen training statistics) and
    reward scale, so a plain env loop on raw observations acts as evaluate() does."""
    from mamba_rl.agents.evaluate import obs_normaliser, reward_scale_of

    agent = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, total_timesteps=256, track=False, prev_reward=True))
    agent.learn()
    norm = find_vector_wrapper(agent.envs, gym.wrappers.vector.NormalizeObservation)
    assert norm is not None and not np.allclose(norm.obs_rms.var, 1.0)  # the statistics moved in training
    raw = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    want = ((raw - norm.obs_rms.mean) / np.sqrt(norm.obs_rms.var + norm.epsilon)).astype(np.float32)
    np.testing.assert_array_equal(obs_normaliser(agent.envs)(raw), want)
    scale = reward_scale_of(agent.envs)
    assert scale != 1.0
    a, s = agent.predict(raw, deterministic=True, reward=np.ones(3))
    b, t, _ = agent.policy.act(want, None, None, True, np.ones(3) * scale)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(agent.value(raw, s, [False] * 3, reward=np.ones(3)),
                                  agent.policy.value(want, t, [False] * 3, np.ones(3) * scale))
    agent.close()
