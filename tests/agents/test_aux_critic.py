"""The two-horizon critic (PPOConfig.aux_gamma): a second value head at another discount, its GAE, the mixed
advantage, its value loss, checkpoints, logging; and with aux_gamma None (off) the agent of before.

The manual-backward parity with the aux head lives with the other parity tests (tests/agents/test_host_path.py);
the CUDA graph paths are the ``cuda`` tests at the end (skipped without a GPU).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from mamba_rl import CheckpointError
from mamba_rl.agents import PPOConfig, RecurrentPPO
from mamba_rl.agents.gae import AUX_STD_EPS, add_advantages, advantage_moments, combine_advantages, compute_gae
from mamba_rl.agents.tags import AUX_EXPLAINED_VARIANCE, AUX_METRICS, AUX_VALUE_LOSS

TINY = dict(num_envs=4, num_steps=16, num_minibatches=2, update_epochs=2, d_model=16, n_layers=2, d_state=4,
            device="cpu", seed=5, total_timesteps=10_000, checkpoint_every=0, track=False)
AUX = dict(aux_gamma=0.9, aux_gae_lambda=0.65, aux_adv_weight=0.3, aux_adv_add=None)  # the rescaled mix
ADD = dict(aux_gamma=0.0, aux_adv_add=6.0)  # the default: immediate-reward credit added in reward units
OFF = dict(aux_gamma=None)  # the default is on

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _agent(tmp_path, env="CartPole-v1", **kw):
    cfg = dict(TINY, runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt"))
    cfg.update(kw)
    return RecurrentPPO(env, config=PPOConfig(**cfg))


# ------------------------------------------------------------------------------------------- the mixing
def _np_combine(adv, aux, valid, w, eps=AUX_STD_EPS):
    """The reference: numpy float64 stds over the valid entries, the formula as written."""
    a, b, v = adv.double().numpy(), aux.double().numpy(), valid.numpy()
    sa, sb = a[v].std(), b[v].std()
    if sb <= eps:
        out = a
    else:
        out = (1 - w) * a + w * b * sa / sb
    return np.where(v, out, 0.0)


def _rollout(n=6, t=40, seed=0):
    """Rewards, dones and NextStep valid flags with episode boundaries, and two critics' values."""
    g = torch.Generator().manual_seed(seed)
    term = torch.rand(n, t, generator=g) < 0.07
    trunc = (torch.rand(n, t, generator=g) < 0.04) & ~term
    valid = torch.ones(n, t, dtype=torch.bool)
    valid[:, 1:] = ~(term | trunc)[:, :-1]  # the step after a done is the reset step
    rewards = torch.randn(n, t, generator=g) * 2 + 0.5
    rewards[~valid] = 0.0
    values, aux_values = torch.randn(n, t, generator=g) * 3, torch.randn(n, t, generator=g)
    nv, aux_nv = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return rewards, values, aux_values, term, trunc, valid, nv, aux_nv


@pytest.mark.parametrize("w", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_combine_advantages_is_the_formula_with_masked_stds(w, seed):
    rewards, values, aux_values, term, trunc, valid, nv, aux_nv = _rollout(seed=seed)
    assert (~valid).sum() > 5 and (term | trunc).sum() > 10  # boundaries and reset steps in the data
    adv, _ = compute_gae(rewards, values, term, trunc, valid, nv, 0.99, 0.95)
    aux_adv, _ = compute_gae(rewards, aux_values, term, trunc, valid, aux_nv, 0.9, 0.65)
    # garbage at the reset steps must not enter the stds (a select, so not even NaN)
    adv_dirty, aux_dirty = adv.clone(), aux_adv.clone()
    adv_dirty[~valid], aux_dirty[~valid] = float("nan"), 1e6
    got = combine_advantages(adv_dirty, aux_dirty, valid, w)
    want = _np_combine(adv, aux_adv, valid, w)
    assert got.dtype == torch.float32 and got.shape == adv.shape
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-6, atol=2e-6)
    assert torch.equal(got[~valid], torch.zeros(int((~valid).sum())))
    # the result keeps the main advantage's scale: std(A_mix) within [|1 - 2w|, 1] * std(A_main)
    s_main, s_mix = adv[valid].std().item(), got[valid].std().item()
    assert abs(1 - 2 * w) * s_main - 1e-5 <= s_mix <= s_main + 1e-5
    if w == 0.0:
        assert torch.equal(got, adv)
    if w == 1.0:  # A_aux itself, rescaled to A_main's std
        np.testing.assert_allclose(got[valid].std().item(), s_main, rtol=1e-5)


def test_combine_advantages_guards_a_flat_aux_advantage():
    rewards, values, _, term, trunc, valid, nv, _ = _rollout(seed=2)
    adv, _ = compute_gae(rewards, values, term, trunc, valid, nv, 0.99, 0.95)
    for flat in (torch.zeros_like(adv), torch.full_like(adv, 0.25), torch.full_like(adv, 0.25) + 1e-12):
        got = combine_advantages(adv, flat, valid, 0.3)
        assert torch.isfinite(got).all()
        assert torch.equal(got, torch.where(valid, adv, 0.0))  # no aux signal: A_main alone
    # just above eps the aux term is used (and stays finite)
    tiny = torch.where(valid, torch.randn(adv.shape, generator=torch.Generator().manual_seed(0)) * 1e-6, 0.0)
    got = combine_advantages(adv, tiny, valid, 0.3)
    assert torch.isfinite(got).all() and not torch.equal(got, torch.where(valid, adv, 0.0))
    # no valid step at all: zeros, no NaN
    none = torch.zeros_like(valid)
    assert torch.equal(combine_advantages(adv, adv * 2, none, 0.3), torch.zeros_like(adv))


def test_moments_of_shards_summed_give_the_whole_rollouts_mix():
    """Data-parallel: each rank's five sums, added, are the moments of all ranks' rollouts together."""
    rewards, values, aux_values, term, trunc, valid, nv, aux_nv = _rollout(n=8, seed=4)
    adv, _ = compute_gae(rewards, values, term, trunc, valid, nv, 0.99, 0.95)
    aux_adv, _ = compute_gae(rewards, aux_values, term, trunc, valid, aux_nv, 0.9, 0.65)
    whole = combine_advantages(adv, aux_adv, valid, 0.3)
    m = advantage_moments(adv[:3], aux_adv[:3], valid[:3]) + advantage_moments(adv[3:], aux_adv[3:], valid[3:])
    assert m.dtype == torch.float64 and m.shape == (5,) and m[0] == valid.sum()
    parts = torch.cat([combine_advantages(adv[:3], aux_adv[:3], valid[:3], 0.3, m),
                       combine_advantages(adv[3:], aux_adv[3:], valid[3:], 0.3, m)])
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=1e-6)


def test_combine_advantages_checks_its_inputs():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"weight must be in \[0, 1\], got 1.5"):
        combine_advantages(a, a, a > 0, 1.5)
    with pytest.raises(ValueError, match=r"one \[N, T\] shape, got \[2, 3\], \[2, 4\], \[2, 3\]"):
        advantage_moments(a, torch.zeros(2, 4), a > 0)
    with pytest.raises(ValueError, match="valid must be bool, got torch.float32"):
        advantage_moments(a, a, a)


@pytest.mark.parametrize("coef", [0.0, 6.0])
def test_add_advantages_is_the_formula_and_checks_its_inputs(coef):
    rewards, values, aux_values, term, trunc, valid, nv, aux_nv = _rollout(seed=3)
    a, _ = compute_gae(rewards, values, term, trunc, valid, nv, 0.99, 0.95)
    b, _ = compute_gae(rewards, aux_values, term, trunc, valid, aux_nv, 0.0, 0.65)
    got = add_advantages(a, b, valid, coef)
    want = torch.where(valid, a.double() + coef * b.double(), torch.zeros((), dtype=torch.float64))
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))
    for bad in (-1.0, True, None, "6"):
        with pytest.raises(ValueError, match=f"coef must be a finite real number >= 0, got {bad!r}"):
            add_advantages(a, b, valid, bad)
    with pytest.raises(ValueError, match="add_advantages: valid must be a torch.Tensor, got ndarray"):
        add_advantages(a, b, valid.numpy(), coef)
    with pytest.raises(ValueError, match=r"add_advantages: expected .* of one \[N, T\] shape"):
        add_advantages(a, b[:, :-1], valid, coef)
    with pytest.raises(ValueError, match="add_advantages: valid must be bool, got torch.float32"):
        add_advantages(a, b, valid.float(), coef)


# ------------------------------------------------------------------------------------------- the config
@pytest.mark.parametrize("field,value,msg", [
    ("aux_gamma", 1.5, r"PPOConfig.aux_gamma must be in \[0.0, 1.0\], got 1.5"),
    ("aux_gamma", -0.1, r"PPOConfig.aux_gamma must be in \[0.0, 1.0\], got -0.1"),
    ("aux_gamma", "0.9", r"PPOConfig.aux_gamma must be a finite number or None, got '0.9'"),
    ("aux_gamma", True, r"PPOConfig.aux_gamma must be a finite number or None, got True"),
    ("aux_gamma", float("nan"), r"PPOConfig.aux_gamma must be a finite number or None, got nan"),
    ("aux_gae_lambda", 1.01, r"PPOConfig.aux_gae_lambda must be in \[0.0, 1.0\], got 1.01"),
    ("aux_gae_lambda", None, r"PPOConfig.aux_gae_lambda must be a finite number, got None"),
    ("aux_adv_weight", -0.5, r"PPOConfig.aux_adv_weight must be in \[0.0, 1.0\], got -0.5"),
    ("aux_adv_weight", 2, r"PPOConfig.aux_adv_weight must be in \[0.0, 1.0\], got 2"),
    ("aux_adv_add", -1.0, r"PPOConfig.aux_adv_add must be in \[0.0, 1000.0\], got -1.0"),
    ("aux_adv_add", 1e20, r"PPOConfig.aux_adv_add must be in \[0.0, 1000.0\], got 1e\+20"),
    ("aux_adv_add", "6", r"PPOConfig.aux_adv_add must be a finite number or None, got '6'"),
])
def test_config_refuses_bad_aux_values(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        PPOConfig(**{field: value})


def test_config_defaults_and_round_trip():
    c = PPOConfig()
    assert c.aux_gamma == 0.0 and c.aux_adv_add == 6.0 and c.aux_gae_lambda == 0.65 and c.aux_adv_weight == 0.3
    on = PPOConfig(aux_gamma=0.9, aux_gae_lambda=1.0, aux_adv_weight=0.0, aux_adv_add=None)
    assert PPOConfig.from_dict(on.to_dict()) == on
    off = PPOConfig(aux_gamma=None)
    assert PPOConfig.from_dict(off.to_dict()) == off
    mixed = PPOConfig(**AUX).to_dict()
    del mixed["aux_adv_add"]  # a checkpoint from before the additive form: the rescaled mix it trained with
    assert PPOConfig.from_dict(mixed) == PPOConfig(**AUX)
    old = c.to_dict()
    for k in ("aux_gamma", "aux_gae_lambda", "aux_adv_weight", "aux_adv_add"):  # from before the feature: no aux head
        del old[k]
    assert PPOConfig.from_dict(old) == PPOConfig(aux_gamma=None, aux_adv_add=None)


def test_cli_aux_flags(tmp_path, capsys):
    from mamba_rl.agents.cli import build_parser, main

    ns = build_parser().parse_args(["train", "--aux-gamma", "0.9", "--aux-gae-lambda", "0.5", "--aux-adv-weight", "0.2"])
    assert (ns.aux_gamma, ns.aux_gae_lambda, ns.aux_adv_weight) == (0.9, 0.5, 0.2)
    assert build_parser().parse_args(["train", "--aux-gamma", "none"]).aux_gamma is None
    assert main(["train", "--aux-gamma", "1.2", "--device", "cpu"]) == 2
    assert "--aux-gamma (PPOConfig.aux_gamma) must be in [0.0, 1.0], got 1.2" in capsys.readouterr().err
    assert build_parser().parse_args(["train", "--aux-adv-add", "3"]).aux_adv_add == 3.0
    assert build_parser().parse_args(["train", "--aux-adv-add", "none"]).aux_adv_add is None
    assert main(["train", "--aux-adv-weight", "-1", "--device", "cpu"]) == 2
    assert "--aux-adv-weight (PPOConfig.aux_adv_weight) must be in [0.0, 1.0], got -1.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--aux-gamma", "x"])
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    assert "--aux-gamma FLOAT|none" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ heads and rollout
def test_aux_head_exists_only_when_enabled_and_leaves_the_others_as_they_were(tmp_path):
    off, on = _agent(tmp_path / "off", **OFF), _agent(tmp_path / "on", **AUX)
    assert off.policy.aux_critic is None and "aux_critic" not in off.policy.heads
    assert off.buffer.aux_values is None and off.buffer.aux_advantages is None and off.buffer.aux_returns is None
    assert off.updater.pack.shape[-1] == off.policy.action_dim + 5
    aux = on.policy.aux_critic
    assert aux is not None and aux.linear.weight.shape == (1, 16)
    # CleanRL's critic init: orthogonal gain 1 (a unit-norm row), zero bias
    torch.testing.assert_close(aux.linear.weight.norm(), torch.tensor(1.0))
    assert torch.equal(aux.linear.bias, torch.zeros(1))
    assert not torch.equal(aux.linear.weight, on.policy.critic.linear.weight)
    # the actor, the critic and the backbone start as without the aux head
    for k, p in off.policy.heads.named_parameters():
        assert torch.equal(p, dict(on.policy.heads.named_parameters())[k]), k
    assert torch.equal(off.policy.net.arena, on.policy.net.arena)
    # its parameters are in the head optimizer's arena (they train) and nowhere twice
    n_on = sum(p.numel() for p in on.policy.heads.parameters())
    assert on.head_optimizer.param_arena.numel() == n_on == off.head_optimizer.param_arena.numel() + 17
    arena = on.head_optimizer.param_arena
    for p in aux.parameters():
        assert arena.data_ptr() <= p.data_ptr() < arena.data_ptr() + arena.numel() * arena.element_size()
    assert on.updater._hand_grads and on.updater.pack.shape[-1] == on.policy.action_dim + 7
    off.close()
    on.close()


def test_eager_rollout_stores_aux_values_and_their_gae(tmp_path, toy_envs):
    """Episodes of 3 + i steps (truncated, so bootstrapped); the aux critic's values are its head on the
    rollout's features, its advantages GAE(aux_gamma, aux_gae_lambda) of them; the main GAE is unchanged."""
    agent = RecurrentPPO(toy_envs(), config=PPOConfig(**dict(TINY, env_id="toy", num_steps=24, runs_dir=str(tmp_path),
                                                             checkpoint_dir=str(tmp_path)), **AUX))
    agent.collect_rollout()
    agent.collect_rollout()  # a carried state
    b, pol = agent.buffer, agent.policy
    # the update recomputes features from the stored inputs; both critics' stored values must be their heads'
    with torch.no_grad():
        feat, _ = pol.net(b.inputs, b.initial_state, b.episode_starts)
        torch.testing.assert_close(pol.aux_critic(feat), b.aux_values, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pol.critic(feat), b.values, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(b.aux_values, b.values)
    # the bootstrap values: both heads one step further from the carried state, as finish() computed them (the
    # stage still holds that input; finish() restored the state)
    st = agent.stepper
    saved = st.get_state()
    with torch.no_grad():
        out = agent.actor._heads(slice(None), st)
    st.load_state(saved)
    p_dim = pol.actor.out_dim
    main_nv, aux_nv = out[:, p_dim], out[:, p_dim + 1]
    assert not torch.equal(main_nv, aux_nv)
    adv, ret = compute_gae(b.rewards, b.values, b.terminations, b.truncations, b.valid, main_nv, 0.99, 0.95)
    aux_adv, aux_ret = compute_gae(b.rewards, b.aux_values, b.terminations, b.truncations, b.valid, aux_nv, 0.9, 0.65)
    assert b.truncations.sum() >= 8 and (~b.valid).sum() >= 8  # episode boundaries inside the rollout
    assert torch.equal(b.aux_advantages, aux_adv) and torch.equal(b.aux_returns, aux_ret)
    assert torch.equal(b.advantages, adv) and torch.equal(b.returns, ret)
    assert torch.equal(b.aux_advantages[~b.valid], torch.zeros(int((~b.valid).sum())))
    assert not torch.allclose(b.aux_advantages, b.advantages)
    agent.close()


def test_actors_and_update_refuse_a_disagreeing_aux_setup(tmp_path):
    from mamba_rl.agents.rollout import EagerActor, RolloutBuffer
    from mamba_rl.agents.update import PPOUpdate

    agent = _agent(tmp_path, **AUX)
    p = agent.policy
    plain = RolloutBuffer(4, 16, p.input_dim, p.obs_dim, p.action_dim, True, agent.stepper.state, torch.device("cpu"))
    with pytest.raises(ValueError, match="EagerActor: aux_gamma 0.9 needs a policy with an aux critic and a "
                                         "RolloutBuffer with aux=True"):
        EagerActor(p, agent.stepper, plain, agent.rngs.sample, 0.99, 0.95, aux_gamma=0.9)
    with pytest.raises(ValueError, match="aux critic True, buffer aux True"):
        EagerActor(p, agent.stepper, agent.buffer, agent.rngs.sample, 0.99, 0.95)
    with pytest.raises(ValueError, match=r"PPOUpdate: aux_gamma None needs"):
        PPOUpdate(agent.config.replace(aux_gamma=None), p, agent.trainer, agent.head_optimizer, agent.buffer)
    with pytest.raises(ValueError, match="built with the aux critic .* got None"):
        agent.updater.run(agent.config.replace(aux_gamma=None), agent._draw_rows)
    agent.close()


# ---------------------------------------------------------------------------------------- the update
def test_update_mixes_the_advantages_and_adds_the_aux_value_loss(tmp_path):
    agent = _agent(tmp_path, **AUX)
    agent.collect_rollout()
    b, up, a = agent.buffer, agent.updater, agent.policy.action_dim
    m = agent.update_policy()
    want = combine_advantages(b.advantages, b.aux_advantages, b.valid, 0.3)
    assert torch.equal(up.pack[..., a + 2], want)  # the policy's advantage column is the mixed one
    assert torch.equal(up.pack[..., a + 3], b.returns)  # the main critic's targets are its own returns
    assert torch.equal(up.pack[..., a + 5], b.aux_values) and torch.equal(up.pack[..., a + 6], b.aux_returns)
    assert set(AUX_METRICS) <= set(m)
    assert math.isfinite(m[AUX_VALUE_LOSS]) and m[AUX_VALUE_LOSS] > 0 and math.isfinite(m[AUX_EXPLAINED_VARIANCE])
    assert m["debug/rollout_parity"] < 1e-4  # both critics' stored values recomputed by the update
    # the aux head learned: its weights moved, and its loss is the form of the main one's
    assert not torch.equal(agent.policy.aux_critic.linear.bias, torch.zeros(1))
    agent.close()


def test_update_adds_the_immediate_reward_advantage_by_default(tmp_path):
    """The default (aux_gamma 0, aux_adv_add 6): the aux returns are the rewards, and the policy's advantage
    column is A_main + 6 A_aux, exactly add_advantages of the buffer's two."""
    agent = _agent(tmp_path)
    assert (agent.config.aux_gamma, agent.config.aux_adv_add) == (0.0, 6.0)
    agent.collect_rollout()
    b, up, a = agent.buffer, agent.updater, agent.policy.action_dim
    agent.update_policy()
    assert torch.equal(up.pack[..., a + 2], add_advantages(b.advantages, b.aux_advantages, b.valid, 6.0))
    # gamma 0: the aux target is the (normalised) reward itself, (r - V) + V up to rounding
    torch.testing.assert_close(b.aux_returns[b.valid], b.rewards[b.valid], rtol=1e-6, atol=1e-6)
    agent.close()


def test_aux_value_loss_reaches_the_backbone_and_aux_adv_weight_reaches_the_policy(tmp_path):
    """Three agents on the same rollout: off, on with w = 0 (only the aux value loss differs), on with w = 0.3."""
    agents = [_agent(tmp_path / str(i), **kw) for i, kw in enumerate([OFF, dict(AUX, aux_adv_weight=0.0), AUX])]
    for ag in agents:
        ag.collect_rollout()
    assert torch.equal(agents[0].buffer.advantages, agents[1].buffer.advantages)
    ms = [ag.update_policy() for ag in agents]
    # with w = 0 the policy's advantage is the main one: the same policy loss in the first minibatch's graph,
    # yet the backbone moves differently (the aux value loss's gradient)
    assert not torch.equal(agents[0].policy.net.arena, agents[1].policy.net.arena)
    assert ms[1][AUX_VALUE_LOSS] > 0 and AUX_VALUE_LOSS not in ms[0]
    assert torch.equal(agents[1].updater.pack[..., 3], agents[1].buffer.advantages)  # w = 0: unmixed
    assert not torch.equal(agents[2].updater.pack[..., 3], agents[2].buffer.advantages)
    for ag in agents:
        ag.close()


# ------------------------------------------------------------------------------ feature off = before
_BASE_COMMIT = "b6154ab964fa23934bcefc5c8c8860a1ef3a8ac2"  # main before the two-horizon critic

_PROBE = textwrap.dedent('''
    import importlib.util, sys
    agents_dir, out = sys.argv[1], sys.argv[2]

    class _Finder:  # mamba_rl.agents from agents_dir (this tree's or the base commit's)
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name == "mamba_rl.agents":
                return importlib.util.spec_from_file_location(name, agents_dir + "/__init__.py",
                                                              submodule_search_locations=[agents_dir])
            return None

    sys.meta_path.insert(0, _Finder)
    import torch
    from mamba_rl.agents import PPOConfig, RecurrentPPO
    import mamba_rl.agents as ag
    assert ag.__file__.startswith(agents_dir), ag.__file__
    res = {}
    for name, kw in {"discrete": dict(env_id="CartPole-v1"),
                     "box": dict(env_id="Pendulum-v1", clip_vloss=False, norm_adv=True)}.items():
        off = {"aux_gamma": None} if "aux_gamma" in PPOConfig.__dataclass_fields__ else {}  # on by default now
        cfg = PPOConfig(num_envs=4, num_steps=16, num_minibatches=2, update_epochs=2, d_model=16, n_layers=2,
                        d_state=4, device="cpu", seed=3, total_timesteps=3 * 64, checkpoint_every=0, track=False,
                        runs_dir=out + "/runs", checkpoint_dir=out + "/ckpt", prev_reward=False, **kw, **off)
        agent = RecurrentPPO(config=cfg)
        agent.learn()
        res[name] = dict(history=[{k: v for k, v in m.items() if not k.startswith(("charts/", "perf/"))}
                                  for m in agent.history],
                         arena=agent.policy.net.arena.clone(), moments=torch.cat([agent.trainer.exp_avg.reshape(-1),
                                                                                  agent.trainer.exp_avg_sq.reshape(-1)]),
                         heads={k: v.clone() for k, v in agent.policy.heads.state_dict().items()},
                         head_moments=torch.cat([agent.head_optimizer.exp_avg, agent.head_optimizer.exp_avg_sq]),
                         advantages=agent.buffer.advantages.clone(), values=agent.buffer.values.clone())
        agent.close()
    torch.save(res, out + "/res.pt")
''')


def _base_agents(tmp_path: Path) -> Path:
    """The base commit's agents/ exported into tmp_path (skip when this is not a git checkout holding it)."""
    root = Path(__file__).resolve().parents[2]
    try:
        subprocess.run(["git", "-C", str(root), "cat-file", "-e", _BASE_COMMIT + "^{commit}"], check=True,
                       capture_output=True)
        tar = subprocess.run(["git", "-C", str(root), "archive", _BASE_COMMIT, "agents"], check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"the base commit {_BASE_COMMIT[:10]} is not available in this checkout")
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        tf.extractall(tmp_path / "base", filter="data")
    return tmp_path / "base" / "agents"


def _probe(agents_dir: Path, out: Path) -> dict:
    out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _PROBE, str(agents_dir), str(out)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out / "res.pt")


def test_feature_off_is_bit_identical_to_the_code_before_it(tmp_path):
    """aux_gamma None (off): three updates of a discrete and a Box agent give the very bits of the base
    commit's code: losses and every metric, backbone and head weights, both optimizers' moments, the rollout."""
    import mamba_rl.agents

    base = _probe(_base_agents(tmp_path), tmp_path / "old")
    now = _probe(Path(mamba_rl.agents.__file__).parent, tmp_path / "new")
    for name in ("discrete", "box"):
        b, n = base[name], now[name]
        assert len(n["history"]) == 3, name
        for hn, hb in zip(n["history"], b["history"]):  # every metric, exactly; a metric added since is 0 here
            assert {k: v for k, v in hn.items() if k in hb} == hb, name
            assert all(hn[k] == 0.0 for k in hn.keys() - hb.keys()), (name, hn.keys() - hb.keys())
        for k in ("arena", "moments", "head_moments", "advantages", "values"):
            assert torch.equal(n[k], b[k]), (name, k)
        assert n["heads"].keys() == b["heads"].keys()
        for k in b["heads"]:
            assert torch.equal(n["heads"][k], b["heads"][k]), (name, k)


# ---------------------------------------------------------------------------- checkpoints, end to end
def test_resume_with_the_aux_head_is_exact_and_a_mismatch_is_a_clear_error(tmp_path):
    straight = _agent(tmp_path, **AUX, total_timesteps=4 * 64, checkpoint_every=1)
    straight.learn()
    straight.close()
    ckpt = tmp_path / "ckpt" / straight.run_name / "update_000002"
    resumed = RecurrentPPO.load(ckpt, restore_envs=True)
    assert resumed.config.aux_gamma == 0.9 and resumed.policy.aux_critic is not None
    resumed.learn()
    resumed.close()
    assert len(resumed.history) == 2
    for a, b in zip(straight.history[2:], resumed.history):
        for k in a:
            if k.startswith(("losses/", "backbone/")):
                assert a[k] == b[k], k  # the same losses (aux ones included), to the bit
    assert torch.equal(resumed.policy.net.arena, straight.policy.net.arena)
    for (k, p), (_, q) in zip(resumed.policy.heads.named_parameters(), straight.policy.heads.named_parameters()):
        assert torch.equal(p, q), k
    assert torch.equal(resumed.head_optimizer.exp_avg_sq, straight.head_optimizer.exp_avg_sq)
    # another aux discount on resume is fine (the head is the same), its absence is not, nor the other way round
    RecurrentPPO.load(ckpt, aux_gamma=0.8).close()
    with pytest.raises(CheckpointError, match=r"was saved with the two-horizon critic \(aux_gamma 0.9: an aux critic "
                                              r"head\), but the config to load it into has aux_gamma None"):
        RecurrentPPO.load(ckpt, aux_gamma=None)
    plain = _agent(tmp_path / "plain", **OFF)
    path = plain.save(tmp_path / "plain_ckpt")
    plain.close()
    with pytest.raises(CheckpointError, match=r"was saved without the two-horizon critic .* has an aux_gamma; "
                                              r"resume without it \(--aux-gamma none\)"):
        RecurrentPPO.load(path, aux_gamma=0.9)


def test_cli_resume_into_a_disagreeing_aux_setup_is_one_error_line(tmp_path, capsys):
    from mamba_rl.agents.cli import main

    agent = _agent(tmp_path, **AUX)
    path = agent.save(tmp_path / "c")
    agent.close()
    assert main(["train", "--resume", str(path), "--aux-gamma", "none", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0] and "aux_gamma None" in err[0]


def test_short_run_with_the_aux_critic_logs_its_losses(tmp_path, toy_envs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mamba_rl.agents import SCALAR_TAGS

    agent = _agent(tmp_path, env="mamba_rl/CartPoleNoVel-v1", **AUX, track=True, total_timesteps=3 * 64,
                   prev_reward=True)
    agent.learn()
    agent.close()
    for m in agent.history:
        for k in ("losses/value_loss", "losses/policy_loss", AUX_VALUE_LOSS, AUX_EXPLAINED_VARIANCE,
                  "backbone/grad_norm"):
            assert math.isfinite(m[k]), (k, m)
        assert m[AUX_VALUE_LOSS] > 0 and m["backbone/overflow_skipped"] == 0
    acc = EventAccumulator(str(tmp_path / "runs" / agent.run_name))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert set(SCALAR_TAGS) <= tags and set(AUX_METRICS) <= tags
    logged = [e.value for e in acc.Scalars(AUX_VALUE_LOSS)]
    assert logged == pytest.approx([m[AUX_VALUE_LOSS] for m in agent.history])
    # and a box-action agent (the autograd path) trains with it too
    box = _agent(tmp_path / "box", env="Pendulum-v1", **AUX, total_timesteps=2 * 64)
    assert not box.updater._hand_grads
    box.learn()
    box.close()
    assert all(math.isfinite(m[AUX_VALUE_LOSS]) for m in box.history)


# ----------------------------------------------------------------------------------------------- CUDA
def _gpu_agent(tmp_path, graphs=True, env="CartPole-v1", **kw):
    cfg = dict(num_envs=8, num_steps=24, num_minibatches=2, update_epochs=2, total_timesteps=10_000, d_model=16,
               n_layers=2, d_state=16, device="cuda", cuda_graphs=graphs, track=False, checkpoint_every=0,
               runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt"), seed=3, **AUX)
    cfg.update(kw)
    return RecurrentPPO(env, config=PPOConfig(**cfg))


_ROLLOUT_KEYS = ("inputs", "actions", "logprobs", "values", "rewards", "terminations", "truncations",
                 "episode_starts", "valid", "advantages", "returns", "aux_values", "aux_advantages", "aux_returns")


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("terminate", [False, True])
def test_graph_rollout_computes_the_aux_values_and_gae_of_the_eager_actor(tmp_path, terminate, toy_envs):
    """The graph actor's act / finish graphs with the aux head: its values are the aux head on the stored inputs
    (recomputed eagerly), its GAE is compute_gae of them at aux_gamma / aux_gae_lambda with the bootstrap
    value of the aux head; the update's parity covers both critics."""
    from mamba_rl.agents.device_actor import GraphActor

    agent = RecurrentPPO(toy_envs(terminate=terminate), config=PPOConfig(
        env_id="toy", num_envs=4, num_steps=24, num_minibatches=2, update_epochs=2, total_timesteps=10_000,
        d_model=16, n_layers=2, d_state=16, device="cuda", track=False, checkpoint_every=0, seed=3,
        runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt"), **AUX))
    assert isinstance(agent.actor, GraphActor) and agent.actor.hist.shape[-1] == agent.policy.input_dim + 1 + 1 + 1 + 2
    agent.collect_rollout()
    agent.collect_rollout()
    b, pol = agent.buffer, agent.policy
    with torch.no_grad():
        feat, _ = pol.net(b.inputs, b.initial_state, b.episode_starts)
        torch.testing.assert_close(pol.aux_critic(feat), b.aux_values, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pol.critic(feat), b.values, rtol=1e-4, atol=1e-4)
        # the bootstrap value: both heads one step further from the carried state (the stage holds its input)
        st = agent.stepper.state.clone()
        stage = agent.actor.stage_t.to("cuda")
        d = pol.input_dim
        f_next = pol.net.step(stage[:, :d].contiguous(), st, stage[:, d] > 0.5)
        nv, aux_nv = pol.critic(f_next), pol.aux_critic(f_next)
    cpu = {k: getattr(b, k).cpu() for k in _ROLLOUT_KEYS}
    adv, ret = compute_gae(cpu["rewards"], cpu["values"], cpu["terminations"], cpu["truncations"], cpu["valid"],
                           nv.cpu(), 0.99, 0.95)
    aux_adv, aux_ret = compute_gae(cpu["rewards"], cpu["aux_values"], cpu["terminations"], cpu["truncations"],
                                   cpu["valid"], aux_nv.cpu(), 0.9, 0.65)
    for got, want in ((cpu["advantages"], adv), (cpu["returns"], ret), (cpu["aux_advantages"], aux_adv),
                      (cpu["aux_returns"], aux_ret)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(cpu["aux_advantages"], cpu["advantages"])
    assert agent.update_policy()["debug/rollout_parity"] < 1e-4
    agent.close()


@cuda
@pytest.mark.cuda
def test_graph_actor_and_eager_actor_agree_with_the_aux_critic(tmp_path):
    """The graph actor's rollout replayed through an eager actor of the same policy (its stored inputs and
    starts staged step by step, its rewards and flags, its final stage): both critics' values and every GAE
    column agree. (The two actors sample with different generators; the values depend on the inputs only.)"""
    from mamba_rl.agents.rollout import EagerActor, RolloutBuffer

    g = _gpu_agent(tmp_path / "g")
    g.collect_rollout()
    b, pol = g.buffer, g.policy
    # the eager actor's finish() on the graph actor's rewards / flags and the eager heads: the same GAE
    eb = RolloutBuffer(8, 24, pol.input_dim, pol.obs_dim, pol.action_dim, True, g.stepper.state,
                       torch.device("cpu"), aux=True)
    ea = EagerActor(pol, pol.net.stepper(batch=8), eb, torch.Generator().manual_seed(0), 0.99, 0.95,
                    aux_gamma=0.9, aux_gae_lambda=0.65)
    ea.begin()
    ea.stepper.load_state(b.initial_state)
    for t in range(24):  # replay the stored inputs through the eager heads
        ea.stager.stage[:, :-1] = b.inputs[:, t].cpu().numpy()
        ea.stager.stage[:, -1] = b.episode_starts[:, t].cpu().numpy()
        ea.act(t)
    for k in ("rewards", "terminations", "truncations", "valid"):
        getattr(eb, k).copy_(getattr(b, k).cpu())
    ea.stager.stage[:] = g.actor.stage_t.numpy()
    ea.finish()
    for k in ("values", "aux_values", "advantages", "returns", "aux_advantages", "aux_returns"):
        torch.testing.assert_close(getattr(eb, k), getattr(b, k).cpu(), rtol=1e-4, atol=1e-4, msg=k)
    g.close()


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("env", ["CartPole-v1", "Pendulum-v1"])
def test_graph_agent_trains_with_the_aux_critic(tmp_path, env):
    agent = _gpu_agent(tmp_path, env=env, total_timesteps=3 * 8 * 24, target_kl=0.5)
    agent.learn()
    for m in agent.history:
        assert all(math.isfinite(m[k]) for k in ("losses/value_loss", "losses/policy_loss", *AUX_METRICS)), m
    assert agent.history[-1]["debug/rollout_parity"] < 1e-4
    agent.close()


def test_compute_gae_refuses_non_tensors_and_non_real_discounts():
    r = torch.zeros(2, 3)
    b = torch.zeros(2, 3, dtype=torch.bool)
    for g in (None, 1.5, True, "0.9"):
        with pytest.raises(ValueError, match="gamma and gae_lambda must be real numbers in \\[0, 1\\], got"):
            compute_gae(r, r, b, b, ~b, torch.zeros(2), g, 0.95)
    with pytest.raises(ValueError, match="rewards must be a torch.Tensor, got ndarray"):
        compute_gae(r.numpy(), r, b, b, ~b, torch.zeros(2), 0.9, 0.95)


def test_a_refused_saved_config_names_the_checkpoint_not_a_flag():
    from mamba_rl import CheckpointError
    from mamba_rl.agents.checkpoint import agent_config

    saved = PPOConfig().to_dict()
    assert agent_config({"ppo_config": dict(saved)}) == PPOConfig()
    saved["aux_adv_add"] = -60.0
    with pytest.raises(CheckpointError, match="the checkpoint's saved config is refused: aux_adv_add must be in"):
        agent_config({"ppo_config": saved})
