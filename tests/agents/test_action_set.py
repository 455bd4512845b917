"""The action-set loss (PPOConfig.action_set_coef) and the joint action (PPOConfig.joint_action): the targets
against a brute-force loop, the loss against its formula, the wrapper, the head, the update (its gradient in the
backbone and the head), checkpoints, the refusals; the captured update is the ``cuda`` test at the end, the
data-parallel one is in tests/agents/test_ddp.py.
"""

from __future__ import annotations

import math
import re
import pickle

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

from mamba_rl import CheckpointError
from mamba_rl.agents import PPOConfig, RecurrentPPO
from mamba_rl.agents.loss import action_set_loss, action_set_targets
from mamba_rl.agents.policy import Policy
from mamba_rl.agents.tags import ACTION_SET_LOSS
from mamba_rl.envs import MAX_JOINT_ACTIONS, JointAction, make_vec_env

NOREPEAT = "mamba_rl_test/NoRepeat-v0"
TINY = dict(env_id=NOREPEAT, num_envs=4, num_steps=16, num_minibatches=2, update_epochs=2, d_model=16, n_layers=2,
            d_state=4, device="cpu", seed=5, total_timesteps=10_000, checkpoint_every=0, track=False)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class NoRepeat(gym.Env):
    """A board of ``nvec`` cells (MultiDiscrete action: row, column): +1 for a cell not yet shot in the episode, -1
    for a repeat; the observation is noise, so the set of cells shot lives in the agent's memory only. Episodes of
    ``length`` steps (truncated)."""

    def __init__(self, nvec=(3, 4), length=7):
        self.action_space = spaces.MultiDiscrete(nvec)
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.length, self.nvec = length, tuple(nvec)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.shot = 0, set()
        return self.np_random.uniform(-1, 1, 2).astype(np.float32), {}

    def step(self, action):
        if not self.action_space.contains(np.asarray(action, dtype=self.action_space.dtype)):
            raise ValueError(f"NoRepeat: action {action!r} is not in {self.action_space}")
        cell = tuple(int(a) for a in action)
        reward = -1.0 if cell in self.shot else 1.0
        self.shot.add(cell)
        self.t += 1
        return self.np_random.uniform(-1, 1, 2).astype(np.float32), reward, False, self.t >= self.length, {}


if NOREPEAT not in gym.registry:
    gym.register(NOREPEAT, entry_point=NoRepeat)


def _agent(tmp_path, **kw):
    cfg = dict(TINY, runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt"))
    cfg.update(kw)
    return RecurrentPPO(config=PPOConfig(**cfg))


# ------------------------------------------------------------------------------------------- the targets
def _brute_targets(actions, starts, valid, nvec):
    n, t, _ = actions.shape
    k = int(np.prod(nvec))
    target, known = np.zeros((n, t, k), bool), np.zeros((n, t), np.float32)
    for i in range(n):
        first = None
        for s in range(t):
            if starts[i, s]:
                first = s
            if first is None or not valid[i, s]:
                continue
            known[i, s] = 1.0
            for r in range(first, s):
                if valid[i, r]:
                    target[i, s, int(np.ravel_multi_index(tuple(actions[i, r]), nvec))] = True
    return target, known


@pytest.mark.parametrize("nvec", [(5,), (3, 4), (2, 3, 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_targets_are_the_actions_taken_earlier_in_the_episode(nvec, seed):
    rng = np.random.default_rng(seed)
    n, t = 5, 37
    actions = np.stack([rng.integers(0, m, (n, t)) for m in nvec], -1)
    starts = rng.random((n, t)) < 0.15
    starts[0, :] = False  # an episode carried over from before the window: nothing known
    starts[1, :] = True  # an episode at every step: every set empty
    starts[2, 0] = True
    valid = rng.random((n, t)) > 0.2
    target, known = action_set_targets(torch.as_tensor(actions, dtype=torch.float32), torch.as_tensor(starts),
                                       torch.as_tensor(valid, dtype=torch.float32), nvec)
    want_t, want_k = _brute_targets(actions, starts, valid, nvec)
    assert target.dtype == torch.bool and tuple(target.shape) == (n, t, int(np.prod(nvec)))
    np.testing.assert_array_equal(known.numpy(), want_k)
    np.testing.assert_array_equal(target.numpy(), want_t)
    assert known[0].sum() == 0 and not target[1].any() and target.any()


def test_targets_refuse_inputs_of_another_shape_or_dtype():
    with pytest.raises(ValueError, match=r"expected actions \[2, 3, 2\] and valid \[2, 3\].*got actions \(2, 3, 1\)"):
        action_set_targets(torch.zeros(2, 3, 1), torch.zeros(2, 3, dtype=torch.bool), torch.ones(2, 3), (3, 4))
    for starts in (torch.zeros(2, 3), torch.zeros(6, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"expected starts a bool \[N, T\] tensor, got torch\.\w+ \((6|2, 3)"):
            action_set_targets(torch.zeros(2, 3, 1), starts, torch.ones(2, 3), (3,))


def test_loss_is_the_mean_bce_over_the_known_steps():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 5, generator=g, dtype=torch.float64)
    target = torch.rand(3, 6, 5, generator=g) < 0.4
    known = (torch.rand(3, 6, generator=g) < 0.7).double()
    p = torch.sigmoid(logits)
    bce = -(target * p.log() + (~target) * (1 - p).log()).mean(-1)
    want = (bce * known).sum() / known.sum()
    torch.testing.assert_close(action_set_loss(logits, target, known), want)
    torch.testing.assert_close(action_set_loss(logits, target, known, torch.tensor(2 * float(known.sum()))),
                               want / 2)  # a global count (data-parallel): this rank's share
    assert action_set_loss(logits, target, torch.zeros(3, 6, dtype=torch.float64)) == 0  # nothing known: 0, not NaN


# ------------------------------------------------------------------------------------------ the wrapper
def test_joint_action_is_the_row_major_index_of_the_components():
    class Grid(gym.Env):
        action_space = spaces.MultiDiscrete([3, 4], start=[1, -2])
        observation_space = spaces.Box(-1, 1, (1,), np.float32)

        def step(self, action):
            self.last = action
            return np.zeros(1, np.float32), 0.0, False, False, {}

    env = JointAction(Grid())
    assert env.action_space == spaces.Discrete(12)
    for k in range(12):
        env.step(k)
        row, col = divmod(k, 4)
        np.testing.assert_array_equal(env.unwrapped.last, [row + 1, col - 2])
        assert env.unwrapped.last.dtype == Grid.action_space.dtype
    assert pickle.loads(pickle.dumps(JointAction(NoRepeat()))).action_space == spaces.Discrete(12)


def test_joint_action_refuses_what_it_cannot_join():
    with pytest.raises(ValueError, match=r"expected a 1-D MultiDiscrete action space, got Box"):
        JointAction(gym.make("Pendulum-v1"))
    with pytest.raises(ValueError, match=r"expected a 1-D MultiDiscrete action space, got Discrete\(2\)"):
        make_vec_env("CartPole-v1", 2, joint_action=True)
    with pytest.raises(ValueError, match=f"at most {MAX_JOINT_ACTIONS} joint actions, got prod\\(nvec\\) = 4225"):
        JointAction(NoRepeat(nvec=(65, 65)))
    with pytest.raises(ValueError, match="expected env backend 'gymnasium' or 'auto', got 'envpool'"):
        make_vec_env(NOREPEAT, 2, joint_action=True, backend="envpool")


# ------------------------------------------------------------------------------------ config and policy
def test_config_fields_refuse_bad_values_and_round_trip():
    assert PPOConfig().action_set_coef == 0.0 and PPOConfig().joint_action is False
    for bad in (-1.0, float("nan"), 1e4, "1"):
        with pytest.raises(ValueError, match="PPOConfig.action_set_coef"):
            PPOConfig(action_set_coef=bad)
    with pytest.raises(ValueError, match="PPOConfig.joint_action"):
        PPOConfig(joint_action=1)
    with pytest.raises(ValueError, match=r"PPOConfig.joint_action wraps each gymnasium env; expected env_backend "
                                         r"'gymnasium' or 'auto', got 'envpool'"):
        PPOConfig(joint_action=True, env_backend="envpool")
    c = PPOConfig(action_set_coef=10.0, joint_action=True)
    assert PPOConfig.from_dict(c.to_dict()) == c
    old = {k: v for k, v in c.to_dict().items() if k not in ("action_set_coef", "joint_action")}
    assert PPOConfig.from_dict(old).action_set_coef == 0.0  # a checkpoint from before the fields: off


def test_the_agent_refuses_a_box_action_a_huge_set_and_joint_action_on_a_given_env(tmp_path):
    with pytest.raises(ValueError, match=r"needs a Discrete or MultiDiscrete action space, got Box"):
        _agent(tmp_path, env_id="Pendulum-v1", action_set_coef=1.0)
    big = "mamba_rl_test/NoRepeatBig-v0"
    if big not in gym.registry:
        gym.register(big, entry_point=NoRepeat, kwargs=dict(nvec=(70, 70)))
    with pytest.raises(ValueError, match=f"expected at most {MAX_JOINT_ACTIONS}, got 4900"):
        _agent(tmp_path, env_id=big, action_set_coef=1.0)
    envs = make_vec_env(NOREPEAT, 4)
    with pytest.raises(ValueError, match=r"a given vector env must be joined already .* expected a Discrete action "
                                         r"space of JointAction sub-envs, got MultiDiscrete\(\[3 4\]\)"):
        RecurrentPPO(envs, config=PPOConfig(**dict(TINY, joint_action=True)))
    envs.close()
    plain = make_vec_env("CartPole-v1", 4)  # Discrete, but not joined: its actions are not joint indices
    with pytest.raises(ValueError, match=r"of JointAction sub-envs, got Discrete\(2\)"):
        RecurrentPPO(plain, config=PPOConfig(**dict(TINY, env_id="CartPole-v1", joint_action=True)))
    plain.close()
    joined = make_vec_env(NOREPEAT, 4, joint_action=True)
    RecurrentPPO(joined, config=PPOConfig(**dict(TINY, joint_action=True))).close()


def test_the_head_exists_only_when_on_and_leaves_the_other_heads_as_they_were():
    kw = dict(backbone=PPOConfig(d_model=16, n_layers=1, d_state=4).backbone, obs_dim=3,
              action_space=spaces.MultiDiscrete([3, 4]), device=torch.device("cpu"), seed=2, backend="reference")
    off, on = Policy(**kw), Policy(**kw, action_set=True)
    assert off.action_set is None and tuple(on.action_set.weight.shape) == (12, 16)
    assert list(on.heads.keys()) == list(off.heads.keys()) + ["action_set"]
    for k, v in off.heads.state_dict().items():
        assert torch.equal(v, on.heads.state_dict()[k]), k
    assert [x.weight.shape for x in on.fused_linears()] == [x.weight.shape for x in off.fused_linears()]  # acting
    assert Policy(**dict(kw, action_space=spaces.Discrete(7)), action_set=True).action_set.out_features == 7


# ------------------------------------------------------------------------------------------- the update
def test_the_loss_trains_the_head_and_reaches_the_backbone(tmp_path):
    """One update from the same weights and rollout with C 0 and C 3: only the action-set head and the backbone
    differ after it (the fused heads' gradient is the same PPO loss's), and with C 3 the head has moved."""
    runs = {}
    for coef in (0.0, 3.0):
        agent = _agent(tmp_path / str(coef), joint_action=True, action_set_coef=coef)
        assert agent.envs.single_action_space == spaces.Discrete(12)
        agent.collect_rollout()
        head0 = None if agent.policy.action_set is None else agent.policy.action_set.weight.detach().clone()
        m = agent.update_policy()
        runs[coef] = (agent, head0, m)
    (off, _, m0), (on, head0, m1) = runs[0.0], runs[3.0]
    assert torch.equal(off.buffer.actions, on.buffer.actions)  # the same rollout: acting never reads the head
    assert ACTION_SET_LOSS not in m0 and 0.3 < m1[ACTION_SET_LOSS] < 1.0  # BCE near log 2 at the start
    assert not torch.equal(off.policy.net.arena, on.policy.net.arena)
    assert not torch.equal(on.policy.action_set.weight, head0)
    for a in (off, on):
        a.close()


def test_the_set_is_learned_in_a_short_run(tmp_path):
    """80 updates: the head's loss ends far below the best memoryless guess, a constant probability p for every cell
    (its BCE is the entropy of p, p the share of the set's bits that are 1 over the steps that count)."""
    agent = _agent(tmp_path, joint_action=True, action_set_coef=5.0, total_timesteps=80 * 64, target_kl=None,
                   d_model=32, learning_rate=3e-3)
    agent.learn()
    losses = [m[ACTION_SET_LOSS] for m in agent.history]
    assert all(math.isfinite(x) for x in losses)
    up = agent.updater
    p = float((up.set_target.float().mean(-1) * up.set_known).sum() / up.set_known.sum())
    guess = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert 0.1 < p < 0.4 and np.mean(losses[-5:]) < 0.4 * guess, (p, guess, losses)
    agent.close()


def test_run_takes_any_weight_with_the_head_and_refuses_one_without_it(tmp_path):
    agent = _agent(tmp_path, action_set_coef=1.0)
    agent.collect_rollout()
    rows = lambda: torch.arange(4).view(2, 2)  # noqa: E731
    before = agent.policy.action_set.weight.detach().clone()
    m = agent.updater.run(agent.config.replace(action_set_coef=0.0), rows)  # a schedule's end: the head is idle
    assert torch.equal(agent.policy.action_set.weight, before) and m[ACTION_SET_LOSS] > 0  # measured, not trained
    agent.updater.run(agent.config.replace(action_set_coef=2.0), rows)
    assert not torch.equal(agent.policy.action_set.weight, before)
    agent.close()
    plain = _agent(tmp_path / "plain")
    plain.collect_rollout()
    with pytest.raises(ValueError, match=r"built without the action-set head; expected a config with action_set_coef "
                                         r"0, got 2.0"):
        plain.updater.run(plain.config.replace(action_set_coef=2.0), rows)
    plain.close()


def test_anneal_action_set_scales_the_weight_by_the_lr_anneals_fraction(tmp_path):
    """anneal_action_set: update u of n uses C (1 - (u - 1) / n), the fraction CleanRL anneals the lr by, with the lr
    anneal on or off; off, every update uses C."""
    n = 4
    for anneal_lr in (True, False):
        agent = _agent(tmp_path / str(anneal_lr), action_set_coef=4.0, anneal_action_set=True, anneal_lr=anneal_lr,
                       total_timesteps=n * 64)
        seen = []
        agent.learn(callback=lambda a, m: seen.append(float(a.updater.set_coef)))
        assert seen == pytest.approx([4.0 * (1 - u / n) for u in range(n)]), seen
        assert agent.current_lr(2) == pytest.approx(agent.config.learning_rate * (0.75 if anneal_lr else 1.0))
        agent.close()
    plain = _agent(tmp_path / "plain", action_set_coef=4.0, total_timesteps=2 * 64)
    seen = []
    plain.learn(callback=lambda a, m: seen.append(float(a.updater.set_coef)))
    assert seen == [4.0, 4.0]
    plain.close()


# ---------------------------------------------------------------------------------------- checkpoints
def test_resume_is_exact_and_a_disagreeing_layout_is_a_clear_error(tmp_path):
    kw = dict(joint_action=True, action_set_coef=2.0, total_timesteps=4 * 64, checkpoint_every=1)
    straight = _agent(tmp_path, **kw)
    straight.learn()
    straight.close()
    ckpt = tmp_path / "ckpt" / straight.run_name / "update_000002"
    resumed = RecurrentPPO.load(ckpt, restore_envs=True)
    assert resumed.config.joint_action and resumed.policy.action_set is not None
    resumed.learn()
    resumed.close()
    for a, b in zip(straight.history[2:], resumed.history):
        assert a[ACTION_SET_LOSS] == b[ACTION_SET_LOSS] and a["losses/policy_loss"] == b["losses/policy_loss"]
    assert torch.equal(resumed.policy.net.arena, straight.policy.net.arena)
    assert torch.equal(resumed.policy.action_set.weight, straight.policy.action_set.weight)
    RecurrentPPO.load(ckpt, action_set_coef=5.0).close()  # another weight on resume is fine
    with pytest.raises(CheckpointError, match=r"saved with the action-set head \(action_set_coef 2.0\), but the config "
                                              r"to load it into has action_set_coef 0; resume with --action-set-coef 2.0"):
        RecurrentPPO.load(ckpt, action_set_coef=0.0)
    other = "mamba_rl_test/NoRepeat23-v0"
    if other not in gym.registry:
        gym.register(other, entry_point=NoRepeat, kwargs=dict(nvec=(2, 3)))
    with pytest.raises(CheckpointError, match=r"its heads action_set.bias \[12\], .*actor.linear.bias \[12\].* do not "
                                              r"fit this policy's \(action_set.bias \[6\].*saved with env_id "
                                              r"'mamba_rl_test/NoRepeat-v0'\); resume with the checkpoint's env"):
        RecurrentPPO.load(ckpt, env_id=other)


def test_joint_action_may_not_change_on_resume_even_at_the_same_head_width(tmp_path):
    """nvec (2, 2): 2 + 2 per-component logits and 2 x 2 joint ones, the same shapes, other meanings."""
    sq = "mamba_rl_test/NoRepeat22-v0"
    if sq not in gym.registry:
        gym.register(sq, entry_point=NoRepeat, kwargs=dict(nvec=(2, 2)))
    agent = _agent(tmp_path, env_id=sq, joint_action=True, action_set_coef=1.0)
    path = agent.save(tmp_path / "c")
    agent.close()
    for restore in (False, True):
        with pytest.raises(CheckpointError, match=r"saved with joint_action True .* has joint_action False; resume "
                                                  r"with --joint-action"):
            RecurrentPPO.load(path, joint_action=False, restore_envs=restore)
    plain = _agent(tmp_path / "p", env_id=sq)
    path = plain.save(tmp_path / "p_c")
    plain.close()
    with pytest.raises(CheckpointError, match=r"saved with joint_action False .* resume with --no-joint-action"):
        RecurrentPPO.load(path, joint_action=True, restore_envs=True)


def test_evaluate_and_predict_act_in_the_joint_action_space(tmp_path):
    agent = _agent(tmp_path, joint_action=True, action_set_coef=1.0)
    res = agent.evaluate(num_episodes=2)
    assert list(res.lengths) == [7, 7] and np.all(np.abs(res.returns) <= 7)
    action, _ = agent.predict(np.zeros((3, 2), np.float32), reward=np.zeros(3, np.float32))
    assert action.shape[0] == 3 and ((0 <= action) & (action < 12)).all()
    agent.close()


# --------------------------------------------------------------------------------------------- CUDA
@cuda
@pytest.mark.cuda
def test_the_captured_update_equals_the_eager_one_with_the_action_set(tmp_path):
    from tests.agents.test_gpu_loop import _copy_rollout as copy_rollout, assert_same_update

    kw = dict(num_envs=8, num_steps=24, device="cuda", joint_action=True, action_set_coef=3.0)
    g, e = _agent(tmp_path / "g", cuda_graphs=True, **kw), _agent(tmp_path / "e", cuda_graphs=False, **kw)
    g.collect_rollout()
    copy_rollout(g, e)
    mg, me = g.update_policy(), e.update_policy()
    assert 0.3 < mg[ACTION_SET_LOSS] < 1.0
    assert_same_update(g, e, mg, me)
    g.close()
    e.close()


@pytest.mark.parametrize("argv,msg", [
    (["--env-id", "CartPole-v1", "--joint-action"],
     r"--joint-action \(PPOConfig.joint_action\): JointAction: expected a 1-D MultiDiscrete action space, got "
     r"Discrete\(2\)"),
    (["--env-id", "mamba_rl_test/NoRepeat2D-v0", "--joint-action"],
     r"--joint-action \(PPOConfig.joint_action\): JointAction: expected a 1-D MultiDiscrete action space, got "
     r"MultiDiscrete\(\[\[2 2\] \[2 2\]\]\)$"),
    (["--env-id", "mamba_rl_test/NoRepeat2D-v0", "--action-set-coef", "1"],
     r"the env's action space: MultiDiscrete action spaces must be 1-D"),  # the env's fault, not the option's
    (["--env-id", "Pendulum-v1", "--action-set-coef", "1"],
     r"--action-set-coef \(PPOConfig.action_set_coef\): the action-set loss needs a Discrete or MultiDiscrete action "
     r"space, got Box"),
])
def test_the_cli_reports_an_option_the_env_cannot_take_in_one_line(tmp_path, capsys, argv, msg):
    from mamba_rl.agents.cli import main

    if "mamba_rl_test/NoRepeat2D-v0" not in gym.registry:
        gym.register("mamba_rl_test/NoRepeat2D-v0", entry_point=NoRepeat, kwargs=dict(nvec=((2, 2), (2, 2))))

    assert main(["train", *argv, "--total-timesteps", "1024", "--no-progress", "--runs-dir", str(tmp_path / "r"),
                 "--checkpoint-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(msg, err[0]), err
    assert not (tmp_path / "r").exists() and not (tmp_path / "c").exists()  # refused before any run folder
