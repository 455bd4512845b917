"""The two-halves rollout (PPOConfig.env_overlap, mamba_rl.envs.parts): act on one half of the envs while the
other half's EnvPool pool steps. Runs over the FakePool of tests/envs/test_envpool.py (gymnasium's CartPole behind
EnvPool's sync-mode API) everywhere, and on the real EnvPool where it is installed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mamba_rl.agents import PPOConfig, RecurrentPPO
from mamba_rl.agents.device_actor import GraphActor
from mamba_rl.agents.rollout import EagerActor
from mamba_rl.envs import envpool_available
from tests.envs.test_envpool import _fake_pools

BUFFER = ("inputs", "actions", "logprobs", "values", "rewards", "terminations", "truncations", "episode_starts",
          "valid", "advantages", "returns")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _agent(tmp_path, overlap, **kw):
    cfg = dict(env_id="CartPole-v1", env_backend="envpool", env_overlap=overlap, num_envs=4, num_steps=32,
               num_minibatches=2, update_epochs=1, total_timesteps=4096, d_model=16, n_layers=2, d_state=4,
               device="cpu", track=False, checkpoint_every=0, seed=5, normalize_obs=False, normalize_reward=False,
               runs_dir=str(tmp_path / f"r{overlap}"), checkpoint_dir=str(tmp_path / f"c{overlap}"),
               env_kwargs=None)
    cfg.pop("env_kwargs")
    cfg.update(kw)
    return RecurrentPPO(config=PPOConfig(**cfg))


def test_overlapped_cpu_rollouts_and_updates_equal_the_plain_ones(monkeypatch, tmp_path):
    """Over 3 rollouts and updates with resets mid-rollout, the halves give the plain loop's inputs, actions,
    rewards, dones, starts and episodes bit for bit (the CPU sampler draws the same uniforms for two half batches
    as for one whole batch: fewer than 16 per draw, torch's serial path), and its values, log-probs, advantages,
    carried state and weights up to rounding (the step's GEMMs over 2 rows round otherwise than over 4)."""
    _fake_pools(monkeypatch)
    a, b = _agent(tmp_path, "on"), _agent(tmp_path, "off")
    assert isinstance(a.actor, EagerActor) and a.env_parts == (slice(0, 2), slice(2, 4)) and b.env_parts is None
    assert a.actor.parts == a.env_parts and b.actor.parts == (slice(0, 4),)
    for _ in range(3):
        ea, _ = a.collect_rollout()
        eb, _ = b.collect_rollout()
        assert ea == eb and len(ea) > 0
        for k in BUFFER:
            x, y = getattr(a.buffer, k), getattr(b.buffer, k)
            if x.is_floating_point() and k not in ("inputs", "rewards"):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=k)
            else:
                assert torch.equal(x, y), k
        for k in ("conv", "ssm"):
            torch.testing.assert_close(getattr(a.stepper.state, k), getattr(b.stepper.state, k), rtol=1e-5, atol=1e-6)
        for k in ("next_obs", "next_start", "next_done", "prev_action", "prev_reward"):
            assert torch.equal(getattr(a.carry, k), getattr(b.carry, k)), k
        sa, sb = a.update_policy(), b.update_policy()
        assert sa["debug/rollout_parity"] < 1e-5 and sb["debug/rollout_parity"] < 1e-5
        assert sa["losses/approx_kl"] == pytest.approx(sb["losses/approx_kl"], rel=1e-3, abs=1e-7)
    torch.testing.assert_close(a.policy.net.arena, b.policy.net.arena, rtol=1e-4, atol=1e-6)
    a.close()
    b.close()


def test_overlap_on_needs_envs_that_step_in_parts(tmp_path, toy_envs):
    with pytest.raises(ValueError, match=r"env_overlap 'on' steps two EnvPool pools .*got env_backend 'gymnasium'"):
        PPOConfig(env_overlap="on")
    with pytest.raises(ValueError, match=r"expected env_backend 'envpool' and num_envs >= 2 .*num_envs 1"):
        PPOConfig(env_overlap="on", env_backend="envpool", num_envs=1, num_minibatches=1)
    with pytest.raises(ValueError, match=r"PPOConfig.env_overlap must be one of"):
        PPOConfig(env_overlap="yes")
    with pytest.raises(ValueError, match=r"env_overlap 'on' needs a vector env that steps in parts"):
        RecurrentPPO(toy_envs(), config=PPOConfig(env_id="toy", env_backend="envpool", env_overlap="on", num_envs=4,
                                                  device="cpu", track=False, checkpoint_every=0,
                                                  runs_dir=str(tmp_path / "r"), checkpoint_dir=str(tmp_path / "c")))


def test_auto_overlap_starts_at_the_measured_env_count(monkeypatch, tmp_path):
    from mamba_rl.agents.config import OVERLAP_MIN_ENVS

    _fake_pools(monkeypatch)
    small = _agent(tmp_path, "auto", num_envs=4)
    assert small.env_parts is None and OVERLAP_MIN_ENVS > 4
    small.close()
    monkeypatch.setattr("mamba_rl.agents.ppo.OVERLAP_MIN_ENVS", 4)
    big = _agent(tmp_path, "auto", num_envs=4)
    assert big.env_parts == (slice(0, 2), slice(2, 4))
    big.close()


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("real", [False, True])
def test_graph_actor_in_halves_keeps_the_rollout_semantics(monkeypatch, tmp_path, real):
    """The graph actor with one act graph per half: the update recomputes every stored value and log-prob from
    the stored initial state and starts (so each half's state was carried, copied back and reset right), resets
    mid-rollout, and two rollouts in a row."""
    if real and not envpool_available():
        pytest.skip("envpool is not installed")
    if not real:
        _fake_pools(monkeypatch)
    agent = _agent(tmp_path, "on", device="cuda", num_envs=8, num_steps=48, normalize_obs=True, normalize_reward=True)
    assert isinstance(agent.actor, GraphActor) and agent.actor.parts == (slice(0, 4), slice(4, 8))
    for _ in range(3):
        episodes, _ = agent.collect_rollout()
        b = agent.buffer
        starts, valid = b.episode_starts.cpu(), b.valid.cpu()
        done = (b.terminations | b.truncations).cpu()
        # NextStep: the step after a done is invalid, the one after that starts an episode
        assert (~valid[:, 1:] == done[:, :-1]).all() and (starts[:, 2:] == done[:, :-2]).all()
        assert done.sum() > 4 and len(episodes) == int(done.sum())
        assert agent.update_policy()["debug/rollout_parity"] < 1e-4
    assert np.isfinite(agent.policy.net.arena.cpu().numpy()).all()
    agent.close()
