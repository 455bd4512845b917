"""Any id gymnasium.make accepts (``module:EnvId`` too, sync and async under every
start method), env listing, and flattened-observation envs that pickle."""

import multiprocessing
import pickle
import sys
import textwrap

import gymnasium as gym
import numpy as np
import pytest
from mamba_rl.envs import POMDP_ENV_IDS, check_env_id, list_env_ids, make_env, make_vec_env

MODULE = textwrap.dedent('''
    import gymnasium as gym
    from gymnasium import spaces


    class TinyEnv(gym.Env):
        """Discrete(3) observations (flattened to one-hot), 4-step episodes."""

        observation_space = spaces.Discrete(3)
        action_space = spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 0
            return 0, {}

        def step(self, action):
            self.t += 1
            return self.t % 3, 1.0, self.t >= 4, False, {}


    gym.register("TinyMod-v0", entry_point=TinyEnv)
''')


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    """A module ``tinyenvmod`` that registers ``TinyMod-v0`` when imported (not imported yet), on
    sys.path and PYTHONPATH."""
    name = "tinyenvmod"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    yield name
    sys.modules.pop(name, None)
    gym.registry.pop("TinyMod-v0", None)


def test_module_colon_id_sync(env_module):
    env_id = f"{env_module}:TinyMod-v0"
    assert "TinyMod-v0" not in gym.registry
    assert check_env_id(env_id) == "TinyMod-v0"
    envs = make_vec_env(env_id, 2, seed=0)
    obs, _ = envs.reset(seed=0)
    assert obs.shape == (2, 3) and obs.dtype == np.float32
    envs.close()


@pytest.mark.parametrize("method", multiprocessing.get_all_start_methods())
def test_module_colon_id_async_every_start_method(env_module, method):
    envs = make_vec_env(f"{env_module}:TinyMod-v0", 2, seed=0, async_=True, start_method=method)
    try:
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (2, 3)
        for _ in range(5):
            obs, *_ = envs.step(np.zeros(2, dtype=np.int64))
    finally:
        envs.close()


def test_agent_takes_a_module_colon_id(env_module, tmp_path):
    from mamba_rl.agents import RecurrentPPO

    agent = RecurrentPPO(f"{env_module}:TinyMod-v0", num_envs=2, num_steps=8, num_minibatches=1, update_epochs=1,
                         d_model=8, n_layers=1, d_state=2, device="cpu", total_timesteps=16, track=False,
                         checkpoint_dir=str(tmp_path / "ckpt"))
    agent.learn()
    assert agent.global_step == 16 and agent.policy.obs_dim == 3
    assert agent.run_name.startswith("tinyenvmod_TinyMod-v0__")  # no ':' in folder names
    agent.close()


def test_bad_ids_and_start_methods_are_clear_errors():
    with pytest.raises(gym.error.NameNotFound, match="Did you mean: `CartPole`"):
        check_env_id("CartPol-v1")
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        check_env_id("no_such_module_xyz:Foo-v0")
    with pytest.raises(ValueError, match="start method 'threads'"):
        make_vec_env("CartPole-v1", 2, async_=True, start_method="threads")


def test_list_env_ids():
    ids = list_env_ids()
    assert ids["mamba_rl"] == sorted(POMDP_ENV_IDS)
    assert "CartPole-v1" in list_env_ids(everything=True)["gymnasium"]


def test_flattened_envs_pickle():
    env = make_env("FrozenLake-v1")  # Discrete obs: flattened to one-hot
    assert env.observation_space.shape == (16,)
    envs = make_vec_env("FrozenLake-v1", 2, seed=0, normalize_obs=True)
    envs.reset(seed=0)
    envs.step(np.ones(2, dtype=np.int64))
    clone = pickle.loads(pickle.dumps(envs))
    a = envs.step(np.full(2, 2, dtype=np.int64))
    b = clone.step(np.full(2, 2, dtype=np.int64))
    np.testing.assert_array_equal(a[0], b[0])
    envs.close(), clone.close()


@pytest.mark.parametrize("extra", [[], ["--async-envs", "--async-start-method", "spawn"]])
def test_cli_trains_on_a_module_colon_id(env_module, tmp_path, extra):
    import subprocess

    r = subprocess.run(
        [sys.executable, "-m", "mamba_rl", "train", "--env-id", f"{env_module}:TinyMod-v0", "--num-envs", "2",
         "--num-steps", "8", "--num-minibatches", "1", "--update-epochs", "1", "--d-model", "8", "--n-layers", "1",
         "--d-state", "2", "--device", "cpu", "--total-timesteps", "16", "--no-track", "--no-progress",
         "--checkpoint-dir", str(tmp_path / "ckpt"), *extra],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "checkpoint: " in r.stdout and "tinyenvmod_TinyMod-v0__" in r.stdout
