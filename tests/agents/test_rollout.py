"""Rollout, episode boundaries and minibatches of RecurrentPPO on a deterministic toy env (CPU, f32).

The ``toy_envs`` fixture (tests/agents/conftest.py): obs = [t / 10, noise], reward = 1 + action; env i
terminates after 3 + i steps when ``terminate`` else is truncated by a TimeLimit of 3 + i steps. Episodes
of different lengths put resets at different columns of the rollout.
"""

import numpy as np
import pytest
import torch
from mamba_rl.agents import PPOConfig, RecurrentPPO
from mamba_rl.agents.distributed import shard_permutation


def small_agent(envs, tmp_path, **kw):
    cfg = dict(num_envs=envs.num_envs, num_steps=24, num_minibatches=2, update_epochs=2, total_timesteps=10_000,
               d_model=16, n_layers=2, d_state=4, device="cpu", track=False, checkpoint_every=0,
               runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt"), seed=3)
    cfg.update(kw)
    return RecurrentPPO(envs, config=PPOConfig(env_id="toy", **cfg))


@pytest.mark.parametrize("terminate", [False, True])
def test_rollout_masks_the_reset_step_and_sets_episode_starts(tmp_path, terminate, toy_envs):
    agent = small_agent(toy_envs(terminate=terminate), tmp_path)
    agent.collect_rollout()
    b = agent.buffer
    done = b.terminations | b.truncations
    for i in range(4):
        length = 3 + i
        # episode: `length` real steps, then 1 reset step; period length + 1
        period = length + 1
        for t in range(24):
            phase = t % period
            assert bool(b.valid[i, t]) == (phase != length), (i, t)
            assert bool(b.episode_starts[i, t]) == (phase == 0), (i, t)
            assert bool(done[i, t]) == (phase == length - 1), (i, t)
            if phase == length:  # reset step: env ignored the action, reward 0, not trained on
                assert b.rewards[i, t] == 0 and b.advantages[i, t] == 0 and b.returns[i, t] == 0
                # obs at the reset step is the FINAL obs of the episode (t = length), with the pre-reset state
                assert b.obs[i, t, 0] == pytest.approx(length / 10)
                assert not b.episode_starts[i, t]
        assert (b.truncations[i].any().item() != terminate) and (b.terminations[i].any().item() == terminate)


def test_truncation_bootstraps_with_value_of_final_obs(tmp_path, toy_envs):
    agent = small_agent(toy_envs(terminate=False), tmp_path)
    agent.collect_rollout()
    b, g, lam = agent.buffer, agent.config.gamma, agent.config.gae_lambda
    i, t = 0, 2  # env 0: truncated at column 2, reset step at column 3 holds V(final obs)
    assert b.truncations[i, t] and not b.valid[i, t + 1]
    expect = b.rewards[i, t] + g * b.values[i, t + 1] - b.values[i, t]
    torch.testing.assert_close(b.advantages[i, t], expect)
    # column 1 continues into column 2 only (the recursion stops at the done)
    d1 = b.rewards[i, 1] + g * b.values[i, 2] - b.values[i, 1]
    torch.testing.assert_close(b.advantages[i, 1], d1 + g * lam * expect)


def test_state_is_zero_at_every_episode_start_in_rollout_and_update(tmp_path, toy_envs):
    torch.manual_seed(0)
    agent = small_agent(toy_envs(), tmp_path)
    agent.collect_rollout()  # carries a non-zero state into the next rollout
    agent.collect_rollout()
    b, net, critic = agent.buffer, agent.policy.net, agent.policy.heads["critic"]
    assert b.initial_state.ssm.abs().sum() > 0  # the carried state is not zero...
    garbage = net.initial_state(1)
    garbage.conv.normal_()
    garbage.ssm.normal_()
    checked = 0
    with torch.no_grad():
        for i in range(4):
            for t in torch.nonzero(b.episode_starts[i]).flatten().tolist():
                # ...but from every episode start on, the rollout's values are those of a zero state:
                # running from a random state with a reset at column 0 reproduces them exactly
                y, _ = net(b.inputs[i:i + 1, t:], garbage, b.episode_starts[i:i + 1, t:])
                torch.testing.assert_close(critic(y)[0], b.values[i, t:], rtol=1e-5, atol=1e-5)
                checked += 1
            # control: without the reset flag the garbage state changes the values (the test has power)
            t0 = int(torch.nonzero(b.episode_starts[i])[0])
            starts = b.episode_starts[i:i + 1, t0:].clone()
            starts[0, 0] = False
            y, _ = net(b.inputs[i:i + 1, t0:], garbage, starts)
            assert not torch.allclose(critic(y)[0, 0], b.values[i, t0], atol=1e-4)
        # the update: the trainer's features from the stored initial state and episode_starts
        rows = torch.arange(2)
        y_tr = agent.trainer.forward(b.inputs[rows], initial_state=b.initial_state.index(rows),
                                     episode_starts=b.episode_starts[rows])
        for i in range(2):
            for t in torch.nonzero(b.episode_starts[i]).flatten().tolist():
                y0, _ = net(b.inputs[i:i + 1, t:], None, b.episode_starts[i:i + 1, t:])  # None = zero state
                torch.testing.assert_close(y_tr[i, t:], y0[0], rtol=1e-5, atol=1e-5)
                checked += 1
    assert checked > 20


def test_update_recomputes_the_rollout_features_at_the_first_minibatch(tmp_path, toy_envs):
    agent = small_agent(toy_envs(), tmp_path)
    agent.collect_rollout()
    agent.collect_rollout()  # non-zero initial state and resets mid-rollout
    b = agent.buffer
    assert b.episode_starts[:, 1:].any() and b.initial_state.ssm.abs().sum() > 0
    # every minibatch, before any optimizer step: the trainer's features give the rollout's values and logprobs
    with torch.no_grad():
        c = agent.config
        for rows in shard_permutation(agent.rngs.minibatch, c.num_envs, c.num_minibatches):
            y = agent.trainer.forward(b.inputs[rows], initial_state=b.initial_state.index(rows),
                                      episode_starts=b.episode_starts[rows])
            torch.testing.assert_close(agent.policy.heads["critic"](y), b.values[rows], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(agent.policy.heads["actor"](y).log_prob(b.actions[rows]), b.logprobs[rows],
                                       rtol=1e-5, atol=1e-5)
    # and the agent's own diagnostic for its first minibatch agrees
    metrics = agent.update_policy()
    assert metrics["debug/rollout_parity"] < 1e-5


def test_minibatches_are_fixed_shape_slices_over_envs(tmp_path, toy_envs):
    agent = small_agent(toy_envs(n=8), tmp_path, num_minibatches=4)
    for _ in range(3):  # the draw the agent's update makes per epoch
        mbs = shard_permutation(agent.rngs.minibatch, 8, 4)
        assert mbs.shape == (4, 2) and mbs.dtype == torch.int64
        assert sorted(mbs.reshape(-1).tolist()) == list(range(8))  # a partition of the envs
    assert agent.trainer.batch == 2 and agent.trainer.seq_len == 24
    with pytest.raises(ValueError, match=r"num_envs \(8\) must be divisible by num_minibatches \(3\)"):
        PPOConfig(num_envs=8, num_minibatches=3)


def test_state_carries_across_rollouts(tmp_path, toy_envs):
    agent = small_agent(toy_envs(), tmp_path)
    agent.collect_rollout()
    end_state = agent.stepper.get_state()
    agent.collect_rollout()
    # the second rollout starts from where the first ended (no global zeroing)
    torch.testing.assert_close(agent.buffer.initial_state.ssm, end_state.ssm, rtol=0, atol=0)
    assert end_state.ssm.abs().sum() > 0


def test_memoryless_resets_every_step(tmp_path, toy_envs):
    agent = small_agent(toy_envs(), tmp_path, memoryless=True)
    agent.collect_rollout()
    assert agent.buffer.episode_starts.all()


def test_vector_env_mismatch_raises(tmp_path, toy_envs):
    with pytest.raises(ValueError, match="has 4 sub-envs but config.num_envs is 8"):
        RecurrentPPO(toy_envs(4), config=PPOConfig(num_envs=8, device="cpu"))


def test_rollout_reports_every_finished_episode_in_order(tmp_path, toy_envs):
    """The episodes a rollout reports (collected as arrays per step, turned into tuples once) are the
    (global step, return, length) of every episode RecordEpisodeStatistics closed, step by step, env order."""
    envs = toy_envs(n=4, terminate=True)
    agent = small_agent(envs, tmp_path)
    seen = []
    step = agent.envs.step

    def recording_step(actions):
        out = step(actions)
        info = out[4]
        if "_episode" in info:
            idx = np.flatnonzero(info["_episode"])
            gs = agent.global_step + agent.config.num_envs  # the step these episodes are logged at
            seen.extend((gs, float(info["episode"]["r"][i]), int(info["episode"]["l"][i])) for i in idx)
        return out

    agent.envs.step = recording_step
    episodes, _ = agent.collect_rollout()
    assert episodes == seen and len(seen) > 10
    assert {length for _, _, length in episodes} == {3, 4, 5, 6}  # env i's episodes last 3 + i steps
    assert all(isinstance(s, int) and isinstance(r, float) and isinstance(n, int) for s, r, n in episodes)
    assert all(length <= ret <= 2 * length for _, ret, length in episodes)  # reward 1 + action per step


def test_time_encoding_follows_each_envs_episode_clock_across_rollouts(tmp_path, toy_envs):
    """With ``time_encoding`` K the last 2K input columns hold time_features of the in-episode step: the toy env's
    own step counter (obs[0] * 10), 0 at every episode start, counted on through the reset step and across
    rollouts (the carry), never by the rollout's column."""
    from mamba_rl.agents.policy import time_features
    k = 3
    agent = small_agent(toy_envs(terminate=True), tmp_path, time_encoding=k, num_steps=10)
    assert agent.policy.input_dim == 2 + 2 + 1 + 2 * k  # obs, previous action one-hot, previous reward, time
    for _ in range(3):  # 30 steps: episodes of 3-6 steps cross the rollouts' boundaries
        agent.collect_rollout()
        b = agent.buffer
        env_t = torch.round(b.obs[..., 0] * 10).to(torch.int64)  # [N, T]
        assert bool((env_t[b.episode_starts] == 0).all())
        want = time_features(env_t.reshape(-1).numpy(), k).reshape(b.num_envs, b.num_steps, 2 * k)
        np.testing.assert_array_equal(b.inputs[..., -2 * k:].numpy(), want)
    assert agent.carry.episode_step.dtype == torch.int64


def test_predict_counts_the_episode_step_and_restarts_it(tmp_path, toy_envs):
    """``predict``'s PolicyState carries the in-episode step: 0 on a fresh state or a start, +1 per call."""
    agent = small_agent(toy_envs(), tmp_path, time_encoding=2)
    obs = np.zeros((2, 2), np.float32)
    _, st = agent.predict(obs, None)
    assert st.episode_step.tolist() == [0, 0]
    for t in range(1, 4):
        _, st = agent.predict(obs, st, np.array([False, t == 2]), reward=np.zeros(2))
        assert st.episode_step.tolist() == [t, 0 if t == 2 else (t - 2 if t > 2 else t)]
    with pytest.raises(ValueError, match=r"state.episode_step must be a \[3\] tensor"):
        agent.predict(np.zeros((3, 2), np.float32), st, np.zeros(3, bool), reward=np.zeros(3))


def test_resume_with_a_time_encoding_is_exact_and_another_one_is_a_clear_error(tmp_path):
    """The carry's in-episode steps are saved with the checkpoint: a resumed run takes the same updates, bit for
    bit; loading into another time encoding (another input width) is refused before anything is loaded."""
    from mamba_rl import CheckpointError
    cfg = dict(env_id="CartPole-v1", num_envs=2, num_steps=32, num_minibatches=1, update_epochs=1, d_model=16,
               n_layers=1, d_state=4, device="cpu", track=False, seed=0, total_timesteps=4 * 64, checkpoint_every=1,
               runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt"), time_encoding=3)
    straight = RecurrentPPO(config=PPOConfig(**cfg))
    straight.learn()
    straight.close()
    ckpt = tmp_path / "ckpt" / straight.run_name / "update_000002"
    resumed = RecurrentPPO.load(ckpt, restore_envs=True)
    assert resumed.config.time_encoding == 3 and int(resumed.carry.episode_step.max()) > 0
    resumed.learn()
    resumed.close()
    assert len(resumed.history) == 2
    for a, b in zip(straight.history[2:], resumed.history):
        assert {k: v for k, v in a.items() if k.startswith("losses/")} == \
            {k: v for k, v in b.items() if k.startswith("losses/")}
    assert torch.equal(resumed.policy.net.arena, straight.policy.net.arena)
    with pytest.raises(CheckpointError, match=r"saved with time_encoding 3 \(an input of 6 time columns\), but the "
                                              r"config to load it into has time_encoding 0; resume with "
                                              r"--time-encoding 3"):
        RecurrentPPO.load(ckpt, time_encoding=0)
