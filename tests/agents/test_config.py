"""PPOConfig holds the backbone's MambaConfig: every field (dt_rank, rms_norm_eps too) reaches the agent,
survives to_dict/from_dict and a checkpoint, and older flat configs still load."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mamba_rl import MambaConfig
from mamba_rl.agents import PPOConfig, RecurrentPPO
from mamba_rl import CheckpointError

TINY = dict(num_envs=2, num_steps=8, num_minibatches=1, update_epochs=1, device="cpu", seed=3,
            total_timesteps=16, track=False)
BACKBONE = MambaConfig(d_model=16, n_layers=1, d_state=4, d_conv=3, expand=2, dt_rank=3, rms_norm_eps=1e-3)
OLD_FLAT = ("d_model", "n_layers", "d_state", "d_conv", "expand")  # what pre-backbone configs stored


def test_the_backbone_lives_in_one_place():
    """``backbone`` is PPOConfig's only representation of the backbone: no flat field to disagree with it."""
    fields = {f.name for f in dataclasses.fields(PPOConfig)}
    flat = {f.name for f in dataclasses.fields(MambaConfig) if f.init}
    assert "backbone" in fields and not fields & flat
    c = PPOConfig(d_model=16)
    for name in flat:  # every backbone field may be given flat, and is read through ``backbone`` only
        PPOConfig(**{name: getattr(BACKBONE, name)})
        with pytest.raises(AttributeError, match=rf"read config.backbone.{name}"):
            getattr(c, name)


def test_flat_backbone_fields_map_into_backbone():
    c = PPOConfig(d_model=16, n_layers=1, d_state=4, d_conv=3, dt_rank=3, rms_norm_eps=1e-3)
    assert c.backbone == BACKBONE
    assert PPOConfig(backbone=MambaConfig(d_model=16, n_layers=1), d_state=4, d_conv=3, dt_rank=3,
                     rms_norm_eps=1e-3) == c  # flat fields change the backbone given
    assert PPOConfig(backbone=BACKBONE) == c
    r = c.replace(d_model=32, num_envs=4, num_minibatches=2)
    assert r.backbone == dataclasses.replace(BACKBONE, d_model=32) and r.num_envs == 4
    assert r.replace(backbone=BACKBONE).backbone == BACKBONE
    assert PPOConfig().backbone == MambaConfig()
    with pytest.raises(ValueError, match="MambaConfig.dt_rank"):
        PPOConfig(d_model=16, dt_rank=100)  # > d_inner
    with pytest.raises(ValueError, match="MambaConfig.rms_norm_eps"):
        PPOConfig(rms_norm_eps=0.0)
    with pytest.raises(ValueError, match="PPOConfig.backbone must be a MambaConfig"):
        PPOConfig(backbone={"d_model": 16})


def test_to_dict_from_dict_round_trip_is_nested_and_json():
    c = PPOConfig(backbone=BACKBONE, **TINY)
    d = json.loads(json.dumps(c.to_dict()))
    assert d["backbone"] == BACKBONE.to_dict() and "d_model" not in d
    assert PPOConfig.from_dict(d) == c
    auto = PPOConfig(d_model=32).to_dict()
    assert auto["backbone"]["dt_rank"] == "auto" and PPOConfig.from_dict(auto).backbone.dt_rank_value == 2


def test_old_flat_config_dict_still_loads():
    d = PPOConfig(backbone=BACKBONE, **TINY).to_dict()
    bb = d.pop("backbone")
    d.update({k: bb[k] for k in OLD_FLAT})  # a pre-backbone checkpoint's ppo_config
    c = PPOConfig.from_dict(d)
    assert c.backbone == MambaConfig(**{k: bb[k] for k in OLD_FLAT})  # dt_rank / eps: the old defaults
    with pytest.raises(ValueError, match="unknown fields"):
        PPOConfig.from_dict({**d, "d_modell": 3})


def _rewrite_ppo_config(ckpt_file, edit) -> None:
    """Rewrite the ppo_config inside a checkpoint's JSON metadata (to forge an older checkpoint)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(ckpt_file), framework="pt") as f:
        header = f.metadata()
    tensors = load_file(str(ckpt_file))
    (key, text), = [(k, v) for k, v in header.items() if '"ppo_config"' in v]
    meta = json.loads(text)
    edit(meta["extra"]["ppo_config"])
    save_file(tensors, str(ckpt_file), metadata={**header, key: json.dumps(meta)})


def test_dt_rank_and_eps_reach_the_agent_and_survive_a_checkpoint(tmp_path):
    agent = RecurrentPPO("CartPole-v1", dt_rank=3, rms_norm_eps=1e-3, d_model=16, n_layers=1, d_state=4, d_conv=3,
                         checkpoint_dir=str(tmp_path / "ckpt"), **TINY)
    assert agent.config.backbone == BACKBONE
    assert agent.policy.net.cfg == BACKBONE  # the backbone was built from it, not from copied fields
    assert dict(agent.policy.net.named_parameters())["layers.0.mixer.dt_proj.weight"].shape[1] == 3
    agent.learn()
    path = agent.save(tmp_path / "saved")
    loaded = RecurrentPPO.load(path)
    assert loaded.config == agent.config and loaded.policy.net.cfg == BACKBONE
    torch.testing.assert_close(loaded.policy.net.arena, agent.policy.net.arena, rtol=0, atol=0)
    # a backbone field changed at load time reaches the backbone too, which then does not fit the weights
    with pytest.raises(CheckpointError, match="rms_norm_eps"):
        RecurrentPPO.load(path, rms_norm_eps=1e-4)
    agent.close()
    loaded.close()


def test_checkpoint_with_old_flat_config_loads(tmp_path):
    agent = RecurrentPPO("CartPole-v1", d_model=16, n_layers=1, d_state=4, **TINY)
    path = agent.save(tmp_path / "old")

    def flatten(pc):
        bb = pc.pop("backbone")
        pc.update({k: bb[k] for k in OLD_FLAT})

    _rewrite_ppo_config(path / "agent.safetensors", flatten)
    loaded = RecurrentPPO.load(path)
    assert loaded.config.backbone == agent.config.backbone
    torch.testing.assert_close(loaded.policy.net.arena, agent.policy.net.arena, rtol=0, atol=0)
    agent.close()
    loaded.close()


def test_mamba3_takes_every_backend():
    """Mamba-3 has CPU and CUDA kernels: every backend is a valid config (the device checks come later)."""
    for backend in ("auto", "reference", "cpu", "cuda"):
        assert PPOConfig(layer="Mamba3", backend=backend).backend == backend


@pytest.mark.parametrize("bad", ["yes", "on", 1, 0, None, 2.0])
def test_prev_action_takes_a_bool_or_auto(bad):
    assert PPOConfig().prev_action == "auto"
    assert PPOConfig(prev_action=True).prev_action is True
    with pytest.raises(ValueError, match=r"PPOConfig.prev_action must be True, False or 'auto', got"):
        PPOConfig(prev_action=bad)


def test_prev_action_auto_follows_the_action_space_and_the_env_declaration(tmp_path):
    """'auto' turns the previous-action input on for discrete actions and for an env that declares it needs it
    (POPGym's ``obs_requires_prev_action``), off for Box actions otherwise; True / False override both."""
    import gymnasium as gym
    import numpy as np
    from gymnasium import spaces
    from mamba_rl.agents.heads import action_input_dim

    class NeedsPrev(gym.Env):
        obs_requires_prev_action = True  # with Box actions: only the declaration turns "auto" on
        observation_space, action_space = spaces.Discrete(2), spaces.Box(-1.0, 1.0, (1,), np.float32)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return 0, {}

        def step(self, action):
            return int(action[0] > 0), 1.0, False, False, {}

    gym.register("mamba_rl_test/NeedsPrevAgent-v0", entry_point=NeedsPrev, max_episode_steps=8)
    tiny = dict(d_model=16, n_layers=1, d_state=4, num_envs=2, num_steps=8, num_minibatches=1, update_epochs=1,
                total_timesteps=16, device="cpu", track=False, checkpoint_every=0, prev_reward=False,
                checkpoint_dir=str(tmp_path / "ckpt"))  # learn() saves a final checkpoint: not into the repo
    try:
        for env_id, prev, want in [("mamba_rl_test/NeedsPrevAgent-v0", "auto", True),
                                   ("mamba_rl_test/NeedsPrevAgent-v0", False, False),
                                   ("mamba_rl/CartPoleNoVel-v1", "auto", True),  # discrete actions
                                   ("mamba_rl/CartPoleNoVel-v1", False, False),
                                   ("mamba_rl/PendulumNoVel-v1", "auto", False),  # Box actions, no declaration
                                   ("mamba_rl/PendulumNoVel-v1", True, True)]:
            agent = RecurrentPPO(env_id, prev_action=prev, **tiny)
            try:
                pol = agent.policy
                assert pol.use_prev_action is want, (env_id, prev)
                assert pol.input_dim == pol.obs_dim + (action_input_dim(pol.action_space) if want else 0)
                agent.learn()  # one rollout and update through that input
            finally:
                agent.envs.close()
    finally:
        del gym.registry["mamba_rl_test/NeedsPrevAgent-v0"]


def test_prev_action_input_refuses_other_settings():
    from mamba_rl.agents.policy import prev_action_input

    envs = None  # never read for True / False, nor before the setting is refused
    assert prev_action_input(True, envs) is True and prev_action_input(False, envs) is False
    with pytest.raises(ValueError, match="prev_action must be True, False or 'auto', got 'on'"):
        prev_action_input("on", envs)


def test_unknown_fields_are_named_with_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"PPOConfig: unknown fields \['foo'\]; expected PPOConfig's fields \['env_id'"):
        PPOConfig(foo=1)
    with pytest.raises(ValueError, match=r"unknown fields \['bar'\]"):
        PPOConfig().replace(bar=2)
    agent = RecurrentPPO("CartPole-v1", config=PPOConfig(num_envs=2, num_steps=8, num_minibatches=1, d_model=16,
                                                         n_layers=1, total_timesteps=16, track=False, device="cpu",
                                                         checkpoint_dir=str(tmp_path / "ckpt")))
    folder = agent.save(tmp_path / "ck")
    agent.close()
    with pytest.raises(ValueError, match=r"unknown fields \['foo'\]"):  # RecurrentPPO.load(path, **overrides)
        RecurrentPPO.load(folder, foo=1)


@pytest.mark.parametrize("bad", [-1, 17, True, 2.0, "6"])
def test_time_encoding_takes_an_int_in_range_and_old_dicts_read_none(bad):
    with pytest.raises(ValueError, match="PPOConfig.time_encoding must be an int"):
        PPOConfig(time_encoding=bad)
    assert PPOConfig(time_encoding=16).time_encoding == 16
    d = PPOConfig(backbone=BACKBONE, **TINY, time_encoding=4).to_dict()
    assert PPOConfig.from_dict(d).time_encoding == 4
    del d["time_encoding"]  # a checkpoint from before the time encoding had none
    assert PPOConfig.from_dict(d).time_encoding == 0


def test_obs_norm_discrete_is_a_bool_reaching_the_envs_and_old_dicts_read_false(tmp_path):
    from mamba_rl.envs import find_vector_wrapper
    import gymnasium as gym
    with pytest.raises(ValueError, match="PPOConfig.obs_norm_discrete must be a bool"):
        PPOConfig(obs_norm_discrete="yes")
    d = PPOConfig(backbone=BACKBONE, **TINY, obs_norm_discrete=True).to_dict()
    assert PPOConfig.from_dict(d).obs_norm_discrete is True
    del d["obs_norm_discrete"]  # a checkpoint from before the flag: the continuous-only rule
    assert PPOConfig.from_dict(d).obs_norm_discrete is False
    agent = RecurrentPPO(config=PPOConfig(env_id="FrozenLake-v1", num_envs=2, num_steps=8, num_minibatches=1,
                                          d_model=16, n_layers=1, d_state=4, device="cpu", track=False,
                                          checkpoint_every=0, obs_norm_discrete=True,
                                          runs_dir=str(tmp_path / "runs")))
    try:
        assert find_vector_wrapper(agent.envs, gym.wrappers.vector.NormalizeObservation) is not None
    finally:
        agent.close()
