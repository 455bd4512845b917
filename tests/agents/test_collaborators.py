"""The agent's typed parts on their own: PPOUpdate reads the config it is given and refuses another layout,
resolve_device, the validation helpers, and the env-id lookup through gymnasium's public API."""

from __future__ import annotations

import math

import pytest
import torch

from mamba_rl.agents import PPOConfig, RecurrentPPO
from mamba_rl.agents.devices import resolve_device
from mamba_rl.agents.distributed import shard_permutation
from mamba_rl.agents.validation import check_bool, check_choice, check_int, check_real

TINY = dict(num_envs=4, num_steps=16, num_minibatches=2, update_epochs=2, d_model=16, n_layers=1, d_state=4,
            device="cpu", seed=11, total_timesteps=10_000, track=False, checkpoint_every=0)


def _agent(tmp_path, name):
    return RecurrentPPO("CartPole-v1", config=PPOConfig(**TINY, checkpoint_dir=str(tmp_path / name)))


def _copy_rollout(src, dst):
    for k in ("inputs", "actions", "logprobs", "values", "rewards", "terminations", "truncations", "episode_starts",
              "valid", "advantages", "returns"):
        getattr(dst.buffer, k).copy_(getattr(src.buffer, k))
    dst.buffer.initial_state.copy_(src.buffer.initial_state)


def test_the_update_reads_the_config_it_is_given(tmp_path):
    a, b = _agent(tmp_path, "a"), _agent(tmp_path, "b")
    a.collect_rollout()
    _copy_rollout(a, b)
    rows = lambda agent: (lambda: shard_permutation(agent.rngs.minibatch, 4, 2))  # noqa: E731
    ma = a.updater.run(a.config, rows(a))
    mb = b.updater.run(b.config.replace(ent_coef=0.5, vf_coef=0.0), rows(b))  # the same rollout and minibatches
    assert ma["losses/entropy"] != mb["losses/entropy"] or ma["losses/value_loss"] != mb["losses/value_loss"]
    assert not torch.equal(a.policy.net.arena, b.policy.net.arena)  # other coefficients, other steps
    with pytest.raises(ValueError, match=r"PPOUpdate.run: expected a config with \{'num_envs': 4, .*'num_minibatches': 2"
                                         r".*got \{.*'num_minibatches': 1"):
        a.updater.run(a.config.replace(num_minibatches=1), rows(a))
    with pytest.raises(ValueError, match=r"draw_rows\(\) must give int64 \[2, 2\], got torch.int64 \(4,\)"):
        a.updater.run(a.config, lambda: torch.arange(4))
    a.close(), b.close()


def test_learn_with_a_new_horizon_updates_with_the_agents_current_config(tmp_path):
    agent = _agent(tmp_path, "h")
    agent.learn(total_timesteps=64)
    assert agent.config.total_timesteps == 64 and agent.update == 1
    agent.learn(total_timesteps=128)  # replaces agent.config; the update runs with it (no stale copy to refuse)
    assert agent.update == 2 and agent.config.total_timesteps == 128
    agent.close()


def test_resolve_device_on_this_machine(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="backend 'cuda' needs a CUDA device, got device cpu"):
        resolve_device("cpu", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    for asked in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=rf"device '{asked}': CUDA is not available on this machine"):
            resolve_device(asked)


def test_resolve_device_refuses_backend_cpu_on_a_gpu_and_kernels_that_cannot_load(monkeypatch):
    from mamba_rl.ops import extension as ext_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the check needs no real GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="backend 'cpu' needs device 'cpu', got device cuda:0"):
        resolve_device("cuda:0", "cpu")
    monkeypatch.setattr(ext_mod, "extension", lambda kind="cuda": None)
    monkeypatch.setattr(ext_mod, "extension_error", lambda kind="cuda": "the build failed: boom")
    with pytest.raises(ValueError, match=r"backend 'cpu': the cpu kernels could not load \(the build failed: boom\); "
                                         r"use backend 'auto'"):
        resolve_device("cpu", "cpu")
    assert resolve_device("cpu", "auto") == torch.device("cpu") and resolve_device("cpu", "reference").type == "cpu"



def test_validation_helpers_name_expected_and_received():
    assert check_int("n", 3, lo=1) == 3 and check_real("x", 0.5, 0.0, 1.0) == 0.5
    assert check_real("x", None, optional=True) is None and check_bool("b", False) is False
    assert check_choice("c", "f32", ("f32", "bf16")) == "f32"
    cases = [(lambda: check_int("n", True, lo=1), "n must be an int >= 1, got True"),
             (lambda: check_int("n", 0, lo=1, hi=3), r"n must be an int in \[1, 3\], got 0"),
             (lambda: check_real("x", math.nan, 0.0, 1.0), "x must be a finite number, got nan"),
             (lambda: check_real("x", 10 ** 400), "x must be a finite number, got 1000"),  # not OverflowError
             (lambda: check_real("x", 0.0, 0.0, 1.0, lo_open=True), r"x must be in \(0.0, 1.0\], got 0.0"),
             (lambda: check_bool("b", 1), r"b must be a bool \(True or False\), got 1"),
             (lambda: check_choice("c", "f64", ("f32",)), r"c must be one of \('f32',\), got 'f64'")]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_env_ids_resolve_as_gymnasium_make_does():
    import gymnasium as gym

    from mamba_rl.envs import check_env_id

    assert check_env_id("CartPole-v1") == "CartPole-v1"
    assert check_env_id("mamba_rl/CartPoleNoVel") == "mamba_rl/CartPoleNoVel-v1"  # unversioned: the latest
    with pytest.raises(gym.error.VersionNotFound, match="unknown env id 'CartPole-v9'"):
        check_env_id("CartPole-v9")
    with pytest.raises(gym.error.NameNotFound, match="malformed env id"):
        check_env_id("a:b:c")
