"""Adversarial cases of the two-halves rollout (PPOConfig.env_overlap="on", mamba_rl.envs.parts) that the plain
rollout (env_overlap="off") handles: they run over the FakePool of tests/envs/test_envpool.py, so everywhere.

They pin two bugs found by testing, fixed since:

* an interrupted rollout left a half's EnvPool step sent and never received, so the next ``learn()`` of the same
  agent (a Ctrl-C in a notebook, then continuing) raised ``ValueError`` from ``EnvPoolVecEnv.send_part`` on every
  later call ("not sent yet"); ``collect_rollout`` now receives what it sent before the interrupt propagates;
* ``RecurrentPPO.load(..., normalize_obs=False)`` of a checkpoint with observation statistics re-added the
  normaliser as gymnasium's ``NormalizeObservation`` (not a ``PartedStep``) after ``env_parts`` was computed, so
  the rollout called ``send_part`` on it (``AttributeError``); it adds the ``VecNormalizeObservation`` now.
"""

from __future__ import annotations

import pytest

from mamba_rl.agents import RecurrentPPO
from tests.agents.test_env_overlap import _agent
from tests.envs.test_envpool import _fake_pools


@pytest.mark.parametrize("overlap", [
    "off",
    "on",
])
def test_learn_continues_after_a_keyboard_interrupt_mid_rollout(monkeypatch, tmp_path, overlap):
    _fake_pools(monkeypatch)
    agent = _agent(tmp_path, overlap, num_envs=5, num_steps=16, num_minibatches=1, total_timesteps=5 * 16 * 3)
    act, calls = agent.actor.act, [0]

    def interrupted_act(*args):
        calls[0] += 1
        if calls[0] == 7:  # mid-rollout (with halves: part 0 of step 3 acted and sent, part 1 not yet)
            raise KeyboardInterrupt
        return act(*args)

    monkeypatch.setattr(agent.actor, "act", interrupted_act)
    with pytest.raises(KeyboardInterrupt):
        agent.learn()
    assert agent.update == 0 and agent.interrupted_checkpoint is not None
    agent.learn()  # continue in the same process
    assert agent.update == agent.num_updates == 3
    agent.close()


@pytest.mark.parametrize("overlap", [
    "off",
    "on",
])
def test_load_without_normalize_obs_keeps_training(monkeypatch, tmp_path, overlap):
    _fake_pools(monkeypatch)
    agent = _agent(tmp_path, overlap, normalize_obs=True, total_timesteps=4 * 32)
    agent.learn()
    agent.close()
    resumed = RecurrentPPO.load(agent.checkpoint_root / "final", normalize_obs=False, total_timesteps=2 * 4 * 32)
    resumed.learn()
    assert resumed.update == 2
    resumed.close()
