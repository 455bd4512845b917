"""POPGym memory tasks x seeds x methods, many runs in parallel, a table of MMER and one PNG of curves.

Methods:
* ``mamba``: :class:`mamba_rl.agents.RecurrentPPO` with its defaults (8 envs x 128 steps; since the eighth session's
  ``prev_action="auto"`` the previous action is an input on every discrete-action task) plus any
  ``--set name=value`` overrides (a named configuration: ``--variant``). ``--set ent_coef_end=V`` (and
  ``clip_coef_end``, ``action_set_coef_end``) is the harness's own schedule, not a PPOConfig field: the
  coefficient goes linearly from its configured value at the first update to V at the last (set on
  ``agent.config`` between updates);
  ``--set obs_norm_freeze_step=N`` (with ``normalize_obs=True``) is ``PPOConfig.obs_norm_freeze_steps``: the
  observation normaliser's statistics freeze once N env steps are done.
  ``--set obs_norm_clip=V`` clips the normalised observations to [-V, V] (sb3's ``clip_obs``).
  ``--set time_obs=K`` appends K sinusoid pairs of the in-episode step to the observation (an env wrapper, so the
  observation normaliser sees them; the agent's own form is ``PPOConfig.time_encoding``).
  ``--set gae_lambda_value=L`` computes the value targets with GAE lambda L, the advantages keeping ``gae_lambda``.
  ``--set head_hidden=W`` makes the actor and critic heads MLPs with two hidden tanh layers of W units (sb3's
  ``MlpLstmPolicy`` heads) instead of one linear layer (CPU runs).
  ``--set reward_head=C`` (with ``reward_head_q=K``, default 1) adds a per-action head of the immediate reward,
  regressed on the taken action's reward (weight K), and its Mean Actor-Critic term (weight C) to the actor's loss
  (CPU runs, ``aux_gamma=0``). ``--set action_set=C`` is ``PPOConfig.action_set_coef`` (the name of the runs from
  when it was a harness patch; ``joint_action`` too is a PPOConfig field now).
* ``sb3``: sb3-contrib's RecurrentPPO, ``MlpLstmPolicy`` with ``lstm_hidden_size=128``, 8 envs
  (``DummyVecEnv``), ``n_steps=128``, every other hyperparameter sb3-contrib's default (lr 3e-4,
  batch 128, 10 epochs, gamma 0.99, GAE lambda 0.95, ent 0, separate critic LSTM). Observations that are
  not a 1-D Box are one-hot flattened (gymnasium's ``FlattenObservation``), as the mamba agent does.
  ``--sb3-prev-action``: the observation is (obs, previous action) through POPGym's ``PreviousAction``
  wrapper (POPGym marks Battleship, Concentration and MultiarmedBandit ``obs_requires_prev_action``);
  its runs go to ``sb3__prev``.

Metric: MMER (POPGym, Morad et al. 2023), the maximum over training of the mean return of the last 100
finished episodes (all envs together), read after every rollout (every 1024 env steps for both methods).

Each run is one process with one torch thread (``OMP_NUM_THREADS=1``); ``--jobs`` of them run at once.
A run writes ``{out}/{method}[__{variant}]/{task}__seed{seed}.csv`` (columns ``global_step, episodes,
mean_return_last100, wall_s``; one row per rollout) and, when it finished, ``...seed{seed}.json``
(final numbers, versions). A run whose JSON exists for the same budget is not run again (``--rerun`` forces
it), so sb3's slow side is run once and its committed results are reused until a version changes.
SIGTERM or Ctrl-C to the harness (``timeout``, a scheduler) is passed on to its running workers, each of which
writes its JSON with the steps it reached and ``"stopped"``; the harness exits 143 / 130, and its next call runs
the stopped runs again (from the start: a run has no resume).
Then ``summary.json``, ``table.md`` (MMER mean +- std per task and method, per-seed values) and
``curves.png`` (env steps on x, one panel per task, mean over seeds with a min..max band) are written.

Usage (from the repo root):
    python benchmarks/learning/popgym.py --methods mamba sb3 --seeds 0 1 2 --total 200000 --jobs 8 \\
        --out benchmarks/learning/popgym
    python benchmarks/learning/popgym.py --methods mamba --variant prev --set prev_action=True \\
        --set prev_reward=True --tasks AutoencodeEasy BattleshipEasy --seeds 0 1 2 --out /tmp/abl
    python benchmarks/learning/popgym.py --summarise-only --out benchmarks/learning/popgym
"""
from __future__ import annotations

import argparse
import ast
import csv
import glob
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections import deque

HERE = os.path.dirname(os.path.abspath(__file__))
# run as a script, this folder is sys.path[0], and this file would shadow the popgym package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
ROOT = os.path.dirname(os.path.dirname(HERE))

TASKS = ("RepeatPreviousEasy", "AutoencodeEasy", "PositionOnlyCartPoleEasy", "NoisyPositionOnlyCartPoleEasy",
         "MultiarmedBanditEasy", "BattleshipEasy", "ConcentrationEasy", "PositionOnlyPendulumEasy")
METHODS = ("mamba", "sb3")
ROLLOUT = (8, 128)  # envs, steps per env per rollout: the same for both methods
# --set ent_coef_end=V: a linear schedule from ent_coef to V over the run
SCHEDULED = ("ent_coef", "clip_coef", "action_set_coef")


def env_id(task: str) -> str:
    """``"AutoencodeEasy"`` -> ``"popgym-AutoencodeEasy-v0"``; a full id (``popgym-...`` or one with a
    ``/`` or ``:``, e.g. ``mamba_rl/CartPoleNoVel-v1``) is returned as given."""
    if task.startswith("popgym-") or "/" in task or ":" in task or task.endswith(("-v0", "-v1")):
        return task
    return f"popgym-{task}-v0"


def file_name(task: str) -> str:
    """The task as part of a file name: ``/`` and ``:`` become ``_`` (``mamba_rl/CartPoleNoVel-v1`` ->
    ``mamba_rl_CartPoleNoVel-v1``)."""
    return task.replace("/", "_").replace(":", "_")


def parse_sets(items: list[str]) -> dict:
    """``["lr=1e-3", "prev_action=True"]`` -> ``{"lr": 0.001, "prev_action": True}`` (Python literals; a value
    that is not one stays a string). Raises ValueError on an item without ``=``."""
    out = {}
    for item in items:
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--set expects NAME=VALUE, got {item!r}")
        try:
            out[key] = ast.literal_eval(val)
        except (ValueError, SyntaxError):
            out[key] = val
    return out


def mmer(curve: list[tuple[int, float]]) -> float:
    """MMER of a curve of ``(global_step, mean_return_last100)``: the max over its finite values (NaN if
    there are none)."""
    vals = [v for _, v in curve if not math.isnan(v)]
    return max(vals) if vals else math.nan


def _versions(method: str) -> dict:
    import gymnasium
    import numpy
    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
         "gymnasium": gymnasium.__version__}
    try:
        import popgym  # noqa: F401
        from importlib.metadata import version

        v["popgym"] = version("popgym")
        if method == "sb3":
            v["stable_baselines3"] = version("stable_baselines3")
            v["sb3_contrib"] = version("sb3_contrib")
    except Exception:  # noqa: BLE001 (a version we cannot read is left out, not fatal)
        pass
    return v


class _CurveWriter:
    """One CSV row per rollout: global_step, episodes finished so far, mean of the last 100, wall s, the
    policy entropy of the update, and (mamba only; NaN for sb3) the mean return of the episodes that finished in
    this rollout (``ep_mean``; NaN when none did), the update's approx_kl, clipfrac and explained variance."""

    def __init__(self, path: str):
        self.f = open(path, "w", newline="")
        self.w = csv.writer(self.f)
        self.w.writerow(["global_step", "episodes", "mean_return_last100", "wall_s", "entropy", "ep_mean", "approx_kl",
                         "clipfrac", "explained_variance"])
        self.t0 = time.time()
        self.curve: list[tuple[int, float]] = []

    def row(self, step: int, episodes: int, m100: float, entropy: float = math.nan, ep_mean: float = math.nan,
            kl: float = math.nan, clipfrac: float = math.nan, ev: float = math.nan) -> None:
        self.curve.append((step, m100))
        self.w.writerow([step, episodes, f"{m100:.5f}", f"{time.time() - self.t0:.1f}", f"{entropy:.4f}",
                         f"{ep_mean:.2f}", f"{kl:.5f}", f"{clipfrac:.4f}", f"{ev:.4f}"])
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def _adv_norm_over_rollout() -> None:
    """``--set adv_norm_batch=True`` (harness only, no agent change; with ``norm_adv``): every minibatch's advantages
    are normalised by the mean and unbiased std of the whole rollout's valid advantages (computed once per update,
    after the rollout is loaded) instead of by its own. It patches this process's ``PPOUpdate`` the way the
    data-parallel path passes global statistics (``adv_norm``) to the loss; one process per run, so nothing else
    sees it."""
    import torch

    from mamba_rl.agents import update as U

    stats: dict = {}
    load, grads, loss = U.PPOUpdate._load_rollout, U.categorical_ppo_grads, U.ppo_loss

    def _load_rollout(self, *a, **k):
        r = load(self, *a, **k)
        ad = self.action_dim
        adv, mask = self.pack[..., ad + 2], self.pack[..., ad + 4]
        with torch.no_grad():
            count = mask.sum().clamp_min(1.0)
            mean = (adv * mask).sum() / count
            var = ((adv - mean).pow(2) * mask).sum() / (count - 1).clamp_min(1.0)
        stats["v"] = (mean, var.sqrt())
        return r

    def _grads(c, features, actor, critic, mb, count, adv_norm=None, *a, **k):
        return grads(c, features, actor, critic, mb, count, stats["v"] if adv_norm is None else adv_norm, *a, **k)

    def _loss(c, dist, newvalue, mb, count, adv_norm=None):
        return loss(c, dist, newvalue, mb, count, stats["v"] if adv_norm is None else adv_norm)

    U.PPOUpdate._load_rollout, U.categorical_ppo_grads, U.ppo_loss = _load_rollout, _grads, _loss


def _obs_norm_clip(bound: float) -> None:
    """``--set obs_norm_clip=V`` (harness only, no agent change; with ``normalize_obs``): the observation normaliser's
    output clipped to [-V, V], as sb3's ``VecNormalize(clip_obs=V)`` does. It patches this process's
    ``VecNormalizeObservation.observations`` (one process per run, so nothing else sees it)."""
    import numpy as np
    from gymnasium.wrappers.vector import NormalizeObservation

    from mamba_rl.envs import stats as S

    def observations(self, obs):
        return np.clip(NormalizeObservation.observations(self, obs), -bound, bound)

    S.VecNormalizeObservation.observations = observations


def _value_lambda(value_lambda: float) -> None:
    """``--set gae_lambda_value=L`` (harness only, CPU rollout): the value targets are GAE(gamma, L) returns while
    the advantages keep ``gae_lambda``, to tell which of the two a lambda change acts through. It patches this
    process's ``rollout.compute_gae`` (one process per run, so nothing else sees it)."""
    from mamba_rl.agents import rollout as R
    from mamba_rl.agents.gae import compute_gae

    def split(rewards, values, terminations, truncations, valid, next_value, gamma, gae_lambda):
        adv, _ = compute_gae(rewards, values, terminations, truncations, valid, next_value, gamma, gae_lambda)
        _, ret = compute_gae(rewards, values, terminations, truncations, valid, next_value, gamma, value_lambda)
        return adv, ret

    R.compute_gae = split


def _mlp_heads(width: int) -> None:
    """``--set head_hidden=W`` (harness only, CPU rollout): the actor and critic heads (the aux critic too) as MLPs
    with two hidden tanh layers of W units on the backbone's features, as sb3's ``MlpLstmPolicy`` has after its
    LSTM (net_arch pi=[64, 64], vf=[64, 64]), instead of one linear layer; CleanRL's init (hidden gain sqrt(2),
    output gain 0.01 / 1). The rollout's fused head GEMM becomes an identity (it hands back the features, exactly)
    and the heads run after it; the update takes autograd's head gradients (the hand-written ones assume linear
    heads). It patches this process's heads, ``Policy.fused_heads`` / ``fused_linears`` and the rollout's
    ``_heads`` (one process per run, so nothing else sees it)."""
    import torch
    from torch import nn

    from mamba_rl.agents import heads as H
    from mamba_rl.agents import policy as P
    from mamba_rl.agents import rollout as R

    class MLP(nn.Sequential):
        def __init__(self, d_in: int, out: int, gain: float, generator):
            layers = []
            for i in range(2):
                layers += [H._layer_init(nn.Linear(d_in if i == 0 else width, width), math.sqrt(2), generator),
                           nn.Tanh()]
            super().__init__(*layers, H._layer_init(nn.Linear(width, out), gain, generator))
            self.out_features = out

    actor_init, critic_init = H.ActorHead.__init__, H.CriticHead.__init__

    def actor(self, d_model, action_space, generator=None):
        actor_init(self, d_model, action_space, generator)
        self.linear = MLP(d_model, self.linear.out_features, 0.01, generator)

    def critic(self, d_model, generator=None):
        critic_init(self, d_model, generator)
        self.linear = MLP(d_model, 1, 1.0, generator)

    def fused_heads(self):
        d = self.net.cfg.d_model
        return torch.eye(d), torch.zeros(d)

    heads = R.EagerActor._heads

    @torch.no_grad()
    def _heads(self, rows, stepper):
        feat = heads(self, rows, stepper)  # the identity GEMM: the features themselves
        p = self.policy
        cols = [p.actor.linear(feat), p.critic.linear(feat)]
        if p.aux_critic is not None:
            cols.append(p.aux_critic.linear(feat))
        return torch.cat(cols, -1)

    H.ActorHead.__init__, H.CriticHead.__init__ = actor, critic
    P.Policy.fused_heads, P.Policy.fused_linears = fused_heads, lambda self: []
    R.EagerActor._heads = _heads


def _reward_head(mac: float, q_coef: float) -> None:
    """``--set reward_head=C [reward_head_q=K]`` (harness only, CPU rollout, aux_gamma 0): a per-action head of
    the immediate reward, Q0(s, a) (one output per action; per component for a MultiDiscrete, an additive
    model), regressed on the taken action's (scaled) reward with weight K (0.5 K (Q0(s, a_t) - r_t)^2, its
    gradient into the backbone too), and the Mean Actor-Critic term (Allen et al. 2017) of it in the actor's
    loss, -C sum_a pi(a | s) Q0(s, a) with Q0 detached: the policy gradient of the immediate reward over every
    action at once instead of the sampled one. It patches this process's ``ActorHead`` and the update's
    ``ppo_loss`` (one process per run, so nothing else sees it)."""
    import torch
    from torch import nn

    from mamba_rl.agents import heads as H
    from mamba_rl.agents import loss as L
    from mamba_rl.agents import update as U

    actor_init, actor_fwd, base_loss = H.ActorHead.__init__, H.ActorHead.forward, U.ppo_loss

    def init(self, d_model, action_space, generator=None):  # Q0: one more linear output (CleanRL's init, gain 1)
        actor_init(self, d_model, action_space, generator)
        if self.kind == "gaussian":
            raise ValueError("reward_head: expected a discrete action space, got a Box")
        self.q0_head = H._layer_init(nn.Linear(d_model, self.out_dim), 1.0, generator)

    def forward(self, features):  # the update's loss reads dist.q0; the rollout's fused head GEMM never computes it
        dist = actor_fwd(self, features)
        dist.q0 = self.q0_head(features)
        return dist

    def ppo_loss(c, dist, newvalue, mb, count, *rest):
        loss, st = base_loss(c, dist, newvalue, mb, count, *rest)
        if c.aux_gamma != 0.0:
            raise ValueError(f"reward_head: expected aux_gamma 0 (its returns are the rewards), got {c.aux_gamma}")
        r, mask = mb.aux_returns, mb.mask
        q_loss, mac_sum = 0.0, 0.0
        sizes = list(dist.splits) or [dist.params[0].shape[-1]]  # the categoricals: nvec, or [n]
        for i, (q, logp) in enumerate(zip(torch.split(dist.q0, sizes, -1), dist._logps())):
            taken = q.gather(-1, mb.actions[..., i:i + 1].long()).squeeze(-1)
            q_loss = q_loss + 0.5 * L.masked_mean((taken - r) ** 2, mask, count)
            mac_sum = mac_sum + (logp.exp() * q.detach()).sum(-1)
        mac_loss = -L.masked_mean(mac_sum, mask, count)
        return loss + q_coef * q_loss + mac * mac_loss, st

    H.ActorHead.__init__, H.ActorHead.forward, U.ppo_loss = init, forward, ppo_loss


def _time_obs_env(base: str, n_freq: int) -> str:
    """``--set time_obs=K`` (harness only): the task with the in-episode step t (0 at reset) appended to its
    observation as K sinusoid pairs, sin / cos(2 pi t / P) for periods P = 4, 8, ..., 2^(K+1) steps (the
    positional encoding of Vaswani et al. 2017, here of the agent's own step count, which a memory can only count
    for itself otherwise). Registers ``<base>-time<K>`` in this process's gymnasium registry and returns that id."""
    import gymnasium as gym
    import numpy as np

    if base.startswith("popgym-"):
        import popgym  # noqa: F401  (registers the popgym-* ids)
    if n_freq < 1:
        raise ValueError(f"time_obs: expected a number of frequencies >= 1, got {n_freq}")
    new = f"mamba_rl_harness/{base}-time{n_freq}-v0"
    if new not in gym.registry:
        from mamba_rl.agents.policy import time_features

        class TimeObs(gym.ObservationWrapper):
            def __init__(self, env):
                super().__init__(env)
                self.t = 0
                self.observation_space = gym.spaces.Tuple(
                    (env.observation_space, gym.spaces.Box(-1.0, 1.0, (2 * n_freq,), np.float32)))

            def reset(self, **kw):
                self.t = 0
                return super().reset(**kw)

            def step(self, action):
                self.t += 1
                return super().step(action)

            def observation(self, obs):
                return obs, time_features(np.array([self.t]), n_freq)[0]

        gym.register(new, entry_point=lambda **kw: TimeObs(gym.make(base, **kw)))
    return new


def run_mamba(task: str, seed: int, total: int, sets: dict, out: _CurveWriter, eval_episodes: int) -> dict:
    """Train mamba_rl's RecurrentPPO; returns ``{"eval": deterministic mean return or NaN}``."""
    import tempfile

    tmp = tempfile.mkdtemp(prefix="mamba_rl_popgym_")  # the run's checkpoints and logs: removed when it ends
    try:
        return _run_mamba_in(tmp, task, seed, total, sets, out, eval_episodes)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_mamba_in(tmp: str, task: str, seed: int, total: int, sets: dict, out: _CurveWriter,
                  eval_episodes: int) -> dict:
    from mamba_rl.agents import RecurrentPPO

    kw = dict(seed=seed, total_timesteps=total, num_envs=ROLLOUT[0], num_steps=ROLLOUT[1], device="cpu",
              threads=1, track=False, checkpoint_every=0, checkpoint_dir=tmp, runs_dir=tmp)
    given, sets = sets, dict(sets)
    # harness-level schedules (not PPOConfig fields): FIELD_end = the value FIELD reaches at the last update,
    # linearly from its configured value at the first (set on agent.config between updates, which the
    # update reads afresh each time)
    sched = {f: sets.pop(f + "_end") for f in SCHEDULED if f + "_end" in sets}
    # obs_norm_freeze_step=N, the name of the earlier runs: PPOConfig.obs_norm_freeze_steps (the same rule: the
    # rollouts that start at or past N env steps leave the normaliser's mean / std alone)
    if "obs_norm_freeze_step" in sets:
        sets["obs_norm_freeze_steps"] = sets.pop("obs_norm_freeze_step")
    if sets.pop("adv_norm_batch", False):
        _adv_norm_over_rollout()
    if "gae_lambda_value" in sets:
        _value_lambda(float(sets.pop("gae_lambda_value")))
    if "obs_norm_clip" in sets:
        _obs_norm_clip(float(sets.pop("obs_norm_clip")))
    if "head_hidden" in sets:
        _mlp_heads(int(sets.pop("head_hidden")))
    if "reward_head" in sets:
        _reward_head(float(sets.pop("reward_head")), float(sets.pop("reward_head_q", 1.0)))
    if "action_set" in sets:  # the name of the twenty-ninth session's runs (then a harness patch)
        sets["action_set_coef"] = sets.pop("action_set")
    task_id = env_id(task)
    if "time_obs" in sets:
        task_id = _time_obs_env(task_id, int(sets.pop("time_obs")))
    kw.update(sets)
    agent = RecurrentPPO(task_id, **kw)
    start = {f: getattr(agent.config, f) for f in sched}
    n_up = agent.num_updates
    last = deque(maxlen=100)
    n = [0]

    def callback(agent, metrics):
        rets = [r for _, r, _ in agent.last_episodes]
        last.extend(rets)
        n[0] += len(rets)
        out.row(int(metrics["global_step"]), n[0], sum(last) / len(last) if last else math.nan,
                float(metrics.get("losses/entropy", math.nan)), sum(rets) / len(rets) if rets else math.nan,
                float(metrics.get("losses/approx_kl", math.nan)), float(metrics.get("losses/clipfrac", math.nan)),
                float(metrics.get("losses/explained_variance", math.nan)))
        if sched:  # the value for the next update (1-based update k: start + (end - start) * (k - 1) / (n - 1))
            frac = min(int(metrics["update"]) / max(n_up - 1, 1), 1.0)
            agent.config = agent.config.replace(**{f: start[f] + (e - start[f]) * frac for f, e in sched.items()})

    agent.learn(callback=callback)
    ev = math.nan
    if eval_episodes:
        ev = float(agent.evaluate(num_episodes=eval_episodes, deterministic=True).mean)
    agent.close()
    return {"eval": ev, "config": _config_of(given)}


def _config_of(sets: dict) -> dict:
    """The ``--set`` values of a run as JSON values (numbers, strings, bools and None as they are; others as repr)."""
    return {k: (v if isinstance(v, (int, float, str, bool)) or v is None else repr(v)) for k, v in sets.items()}


def run_sb3(task: str, seed: int, total: int, sets: dict, out: _CurveWriter, eval_episodes: int,
            prev_action: bool = False) -> dict:
    """Train sb3-contrib's RecurrentPPO (LSTM 128, 8 envs, n_steps 128; ``sets`` override its kwargs, e.g.
    ``--variant g09 --set gamma=0.9`` into ``sb3__g09``; the table's LSTM column is the folder ``sb3``, without any). ``prev_action``: wrap the env in POPGym's own ``PreviousAction``
    (the observation becomes (obs, previous action), one-hot flattened). No evaluation (``eval_episodes`` is
    ignored)."""
    import gymnasium as gym
    import torch
    from gymnasium import spaces
    from sb3_contrib import RecurrentPPO as SB3RecurrentPPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    from mamba_rl.envs.registry import check_env_id  # registers mamba_rl/* ids; imports popgym for popgym-*

    torch.set_num_threads(1)
    eid = check_env_id(env_id(task))

    def make():
        env = gym.make(eid)
        if prev_action:
            from popgym.wrappers import PreviousAction

            env = PreviousAction(env.unwrapped)  # POPGym's wrappers take the bare POPGymEnv
        sp = env.observation_space
        if not (isinstance(sp, spaces.Box) and len(sp.shape) == 1):
            env = gym.wrappers.FlattenObservation(env)
        return env

    venv = make_vec_env(make, n_envs=ROLLOUT[0], seed=seed)
    kw = dict(n_steps=ROLLOUT[1], seed=seed, device="cpu", verbose=0, policy_kwargs={"lstm_hidden_size": 128})
    kw.update(sets)
    model = SB3RecurrentPPO("MlpLstmPolicy", venv, **kw)
    seen = [0]

    class Curve(BaseCallback):
        def _on_step(self) -> bool:
            for info in self.locals.get("infos", ()):
                if "episode" in info:
                    seen[0] += 1
            return True

        def _on_rollout_end(self) -> None:
            buf = [e["r"] for e in self.model.ep_info_buffer]  # sb3 keeps the last 100 finished episodes
            out.row(int(self.model.num_timesteps), seen[0], sum(buf) / len(buf) if buf else math.nan)

    model.learn(total_timesteps=total, callback=Curve())
    venv.close()
    return {"eval": math.nan, "config": {k: repr(v) for k, v in kw.items() if k not in ("seed", "device", "verbose")}}


def run_dir(out: str, method: str, variant: str | None) -> str:
    return os.path.join(out, method + (f"__{variant}" if variant else ""))


def worker(a) -> int:
    """One run (``--worker``): the CSV curve, then the JSON of its final numbers. A run stopped by SIGTERM (``timeout``,
    a scheduler, the harness passing on its own) or Ctrl-C still writes its JSON, with the steps it reached and
    ``"stopped"`` naming the signal (the summary counts it as a run of that many steps; the next call of the harness
    runs it again); the worker then exits with 128 + the signal number. A signal before the run has imported its
    libraries ends the worker without a JSON (its CSV then has no rows; the next call runs it again too)."""
    from mamba_rl.agents.interrupts import exit_code, ignore_until_exit, terminate_as_interrupt

    d = run_dir(a.out, a.worker, a.variant)
    os.makedirs(d, exist_ok=True)
    base = os.path.join(d, f"{file_name(a.task)}__seed{a.seed}")
    if os.path.exists(base + ".json"):  # an earlier run's numbers must not outlive the CSV rewritten below
        os.remove(base + ".json")
    versions = _versions(a.worker)  # imports torch & co. before a signal can raise inside an import
    w = _CurveWriter(base + ".csv")
    sets = parse_sets(a.set)
    t0 = time.time()
    terminate_as_interrupt()
    stopped = None
    try:
        if a.worker == "mamba":
            extra = run_mamba(a.task, a.seed, a.total, sets, w, a.eval_episodes)
        else:
            extra = run_sb3(a.task, a.seed, a.total, sets, w, a.eval_episodes, prev_action=a.sb3_prev_action)
    except KeyboardInterrupt as err:  # SIGINT, or SIGTERM as Interrupted: keep the curve so far as a stopped run
        ignore_until_exit()
        stopped, extra = err, {"eval": math.nan, "config": _config_of(sets), "stopped": str(err) or "SIGINT"}
    w.close()
    res = {"task": a.task, "env_id": env_id(a.task), "method": a.worker, "variant": a.variant, "seed": a.seed,
           "total": a.total, "steps": w.curve[-1][0] if w.curve else 0, "mmer": mmer(w.curve),
           "final": w.curve[-1][1] if w.curve else math.nan, "wall_s": round(time.time() - t0, 1),
           "versions": versions, "date": time.strftime("%Y-%m-%d"), **extra}
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    print(f"{base}: MMER {res['mmer']:.3f} in {res['wall_s']:.0f} s" + (f", stopped by {extra['stopped']}" if stopped
                                                                        else ""), file=sys.stderr)
    return exit_code(stopped) if stopped is not None else 0


def _read_curve(path: str) -> tuple[list[tuple[int, float]], list[int]]:
    """(``[(global_step, mean_return_last100)]``, episodes finished by each point) of a run's CSV."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return [(int(r["global_step"]), float(r["mean_return_last100"])) for r in rows], [int(r["episodes"]) for r in rows]


def mmer_full_window(curve: list[tuple[int, float]], episodes: list[int], window: int = 100) -> float:
    """MMER over only the points where at least ``window`` episodes had finished, so the window is full (NaN
    if none). The plain :func:`mmer` also counts the first points, where the mean is over the first few
    episodes and its max is mostly noise (on BattleshipEasy the max is often the mean of the first 8)."""
    return mmer([c for c, n in zip(curve, episodes) if n >= window])


def summarise(out: str, tasks: list[str] | None = None, columns: list[str] | None = None,
              record: tuple[str, str, dict[str, str]] | None = None) -> dict:
    """Collect every finished run under ``out`` into ``{(task, method[__variant]): {seed: result}}`` as a
    JSON-able dict keyed ``"task|method"``; writes ``summary.json`` (every folder) and ``table.md`` /
    ``table_full_window.md`` (the folders named in ``columns``, in that order; None: every folder); returns
    ``{"summary": ..., "runs": ...}`` (``runs`` restricted to ``columns`` too, for :func:`plot`).
    ``record``: ``(name, base, {task: folder})``, a column ``name`` made of the folder ``base``'s runs but, on the
    tasks named, those of another folder (a per-task setting); those tasks' entries name it (``"source"``)."""
    runs: dict[str, dict[str, dict]] = {}
    for path in sorted(glob.glob(os.path.join(out, "*", "*__seed*.json"))):
        r = json.load(open(path))
        if tasks and r["task"] not in tasks:
            continue
        key = f"{r['task']}|{os.path.basename(os.path.dirname(path))}"
        r["curve"], episodes = _read_curve(path[:-5] + ".csv")
        r["mmer_full"] = mmer_full_window(r["curve"], episodes)
        runs.setdefault(key, {})[str(r["seed"])] = r
    if record is not None:
        name, base, per_task = record
        for t in sorted({k.split("|")[0] for k in runs}):
            src = per_task.get(t, base)
            if f"{t}|{src}" in runs:
                runs[f"{t}|{name}"] = {s: dict(r, source=src) if src != base else r
                                       for s, r in runs[f"{t}|{src}"].items()}
    summary = {}
    for key, per in runs.items():
        seeds = sorted(per, key=int)
        summary[key] = {"seeds": seeds}
        for name, suffix in (("mmer", ""), ("mmer_full", "_full")):
            vals = [per[s][name] for s in seeds]
            mu = sum(vals) / len(vals)
            sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
            summary[key].update({name: dict(zip(seeds, vals)), "mean" + suffix: mu, "std" + suffix: sd,
                                 "spread" + suffix: max(vals) - min(vals)})
        summary[key].update({"steps": min(p["steps"] for p in per.values()),
                             "eval": {s: per[s].get("eval") for s in seeds},
                             "versions": next(iter(per.values()))["versions"],
                             "wall_s": [per[s]["wall_s"] for s in seeds]})
        if "source" in next(iter(per.values())):
            summary[key]["source"] = next(iter(per.values()))["source"]
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table(summary, columns=columns))
    with open(os.path.join(out, "table_full_window.md"), "w") as f:
        f.write(table(summary, full_window=True, columns=columns))
    if columns:
        runs = {k: v for k, v in runs.items() if k.split("|")[1] in columns}
    return {"summary": summary, "runs": runs}


def _fmt(v: float) -> str:
    return "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else (
        f"{v:.0f}" if abs(v) >= 10 else f"{v:.3f}")


def bar(task: str, lstm: float) -> tuple[float, str]:
    """Issue 24's per-task bar against the LSTM's mean MMER ``lstm``: ``(threshold, label)``, the LSTM + 0.05, or
    0.99 where the LSTM is already within 0.05 of POPGym's maximum return of 1 (label ``">= 0.99"``). Only
    POPGym tasks have one (returns in [-1, 1]); for any other task ``(nan, "-")``."""
    if env_id(task) != f"popgym-{task}-v0" and not task.startswith("popgym-"):
        return math.nan, "-"
    if lstm >= 0.95:
        return 0.99, ">= 0.99"
    return lstm + 0.05, f"{lstm + 0.05:.3f}"


def table(summary: dict, full_window: bool = False, columns: list[str] | None = None) -> str:
    """Markdown: one row per task, one MMER column per method (mean +- std (n seeds, steps)), per-seed values,
    and, where sb3 ran, issue 24's bar (:func:`bar`) and each method's difference to sb3 (``*`` where its mean
    meets the bar); a last row gives each method's mean difference to sb3 over the tasks where both ran and how
    many bars it met. ``full_window``: the MMER of :func:`mmer_full_window` instead (only points with 100
    finished episodes). ``columns``: the method folders to show, in that order (None: every one)."""
    sfx = "_full" if full_window else ""
    tasks = sorted({k.split("|")[0] for k in summary}, key=lambda t: (TASKS.index(t) if t in TASKS else 99, t))
    methods = columns or sorted({k.split("|")[1] for k in summary}, key=lambda m: (m.startswith("sb3"), m != "mamba", m))
    tasks = [t for t in tasks if any(f"{t}|{m}" in summary for m in methods)]
    ref_on = "sb3" in methods
    others = [m for m in methods if m != "sb3"] if ref_on else []

    def row(cells: list[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    lines = [row(["task"] + [f"{m} MMER" for m in methods] + ["per seed"] + (["bar"] if ref_on else [])
                 + [f"{m} - sb3" for m in others])]
    lines.append("|---" * (2 + len(methods) + (1 if ref_on else 0) + len(others)) + "|")
    diffs_of: dict[str, list[float]] = {m: [] for m in others}
    met_of: dict[str, list[bool]] = {m: [] for m in others}
    for t in tasks:
        cells, seeds, diffs = [], [], []
        ref = summary.get(f"{t}|sb3")
        thr, label = bar(t, ref["mean" + sfx]) if ref else (math.nan, "-")
        for m in methods:
            s = summary.get(f"{t}|{m}")
            if s is None:
                cells.append("-")
                if m in diffs_of:
                    diffs.append("-")
                continue
            cells.append(f"{_fmt(s['mean' + sfx])} ± {_fmt(s['std' + sfx])} ({len(s['seeds'])}, {s['steps'] // 1000}k)"
                         + (f" from {s['source']}" if s.get("source") else ""))
            seeds.append(f"{m}: " + " / ".join(_fmt(v) for v in s["mmer" + sfx].values()))
            if m not in diffs_of:
                continue
            if not ref:
                diffs.append("-")
                continue
            d = s["mean" + sfx] - ref["mean" + sfx]
            met = not math.isnan(thr) and s["mean" + sfx] >= thr
            diffs_of[m].append(d)
            if not math.isnan(thr):
                met_of[m].append(met)
            diffs.append(f"{d:+.3f}" + (" *" if met else ""))
        lines.append(row([t] + cells + ["; ".join(seeds)] + ([label] if ref_on else []) + diffs))
    if any(diffs_of.values()):
        tail = [f"{sum(ds) / len(ds):+.3f} over {len(ds)}, bars {sum(met_of[m])} of {len(met_of[m])}" if ds else "-"
                for m, ds in diffs_of.items()]
        lines.append(row(["mean of (method - sb3)"] + [""] * (len(methods) + 2) + tail))
    return "\n".join(lines) + "\n"


def plot(runs: dict, path: str) -> None:
    """One PNG: a panel per task, env steps on x, mean over seeds of the last-100 mean return with a
    min..max band, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = sorted({k.split("|")[0] for k in runs}, key=lambda t: (TASKS.index(t) if t in TASKS else 99, t))
    cols = min(4, len(tasks))
    rows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, t in zip(axes.flat, tasks):
        for key in sorted(k for k in runs if k.split("|")[0] == t):
            m = key.split("|")[1]
            curves = [dict(r["curve"]) for r in runs[key].values()]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            if not steps:
                continue
            ys = np.array([[c[s] for s in steps] for c in curves], dtype=float)
            keep = ~np.isnan(ys).any(axis=0)  # before the first finished episode there is no mean
            x, ys = np.asarray(steps)[keep], ys[:, keep]
            (line,) = ax.plot(x, ys.mean(axis=0), label=f"{m} ({len(curves)} seeds)")
            ax.fill_between(x, ys.min(axis=0), ys.max(axis=0), alpha=0.2, color=line.get_color())
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("env steps")
        ax.set_ylabel("mean return, last 100 episodes")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --set names the harness itself takes (see the module docstring), not PPOConfig fields
HARNESS_SETS = ("adv_norm_batch", "gae_lambda_value", "obs_norm_clip",
                "head_hidden", "time_obs", "obs_norm_freeze_step", "reward_head", "reward_head_q",
                "action_set") + tuple(f + "_end" for f in SCHEDULED)


def _check_runs(ap: argparse.ArgumentParser, a: argparse.Namespace, sets: dict) -> None:
    """Stop with one line (argparse's error, exit 2) on what every run would fail on: --total < 1, a task that is
    not an env id, or a --set that PPOConfig refuses (an unknown field or a bad value)."""
    if a.total < 1:
        ap.error(f"--total must be >= 1 env steps, got {a.total}")
    import gymnasium as gym

    from mamba_rl.agents.config import PPOConfig
    from mamba_rl.envs.registry import check_env_id

    for task in a.tasks:
        try:
            check_env_id(env_id(task))
        except (gym.error.Error, ImportError) as e:
            ap.error(f"--tasks: {task!r}: {e}")
    if "mamba" in a.methods:
        try:  # an unknown field or a bad value: PPOConfig's ValueError names the field and what it expects
            PPOConfig(**{k: v for k, v in sets.items() if k not in HARNESS_SETS})
        except ValueError as e:
            ap.error(f"--set: {e}")


def _stop_workers(procs: list, signum: int, wait_s: float = 120.0) -> None:
    """Pass ``signum`` on to the workers still running and wait for each (it writes its JSON and exits); one that
    has not exited after ``wait_s`` seconds is killed."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)
    deadline = time.time() + wait_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), help="POPGym names (AutoencodeEasy) or full env ids")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", default=["mamba", "sb3"], choices=METHODS)
    ap.add_argument("--total", type=int, default=200_000, help="env steps per run")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at once (one process each)")
    ap.add_argument("--variant", default=None, help="name of the mamba configuration given by --set")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a PPOConfig field of the mamba runs (repeatable; needs --variant; sb3 always runs its defaults)")
    ap.add_argument("--sb3-prev-action", action="store_true",
                    help="sb3 observes (obs, previous action) through POPGym's PreviousAction wrapper (folder sb3__prev)")
    ap.add_argument("--eval-episodes", type=int, default=0, help="deterministic episodes of the final mamba policy")
    ap.add_argument("--nice", type=int, default=0, help="niceness of the runs")
    ap.add_argument("--rerun", action="store_true", help="run again even where a finished run exists")
    ap.add_argument("--summarise-only", action="store_true")
    ap.add_argument("--columns", nargs="+", default=None, metavar="FOLDER",
                    help="the run folders (mamba, mamba__VARIANT, sb3, ...) that table.md and curves.png show, in "
                         "that order (default: every folder; summary.json always holds every one)")
    ap.add_argument("--record-column", nargs="+", default=None, metavar="ARG",
                    help="NAME BASE [TASK=FOLDER ...]: a column NAME of the folder BASE's runs, each TASK's from "
                         "FOLDER instead (a per-task setting; the table says which); name it in --columns to show it")
    ap.add_argument("--out", default=os.path.join(HERE, "popgym"))
    ap.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--task", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        sets = parse_sets(a.set)  # a malformed --set fails here, before any run starts
    except ValueError as e:
        ap.error(str(e))
    if a.set and not a.variant and not a.worker:
        ap.error("--set needs --variant NAME (the folder mamba__NAME keeps that configuration's runs apart)")
    if a.worker:
        return worker(a)
    if a.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {a.jobs}")
    record = None
    if a.record_column:  # its form before any run starts; its folders after them (this call may make them)
        if len(a.record_column) < 2 or any(x.count("=") != 1 for x in a.record_column[2:]):
            ap.error(f"--record-column: expected NAME BASE [TASK=FOLDER ...], got {a.record_column}")
        name, base, *pairs = a.record_column
        record = (name, base, dict(x.split("=") for x in pairs))
    if not a.summarise_only:
        _check_runs(ap, a, sets)
    os.makedirs(a.out, exist_ok=True)
    jobs = []
    if not a.summarise_only:
        for method in a.methods:
            # sb3's folder: sb3, sb3__prev (--sb3-prev-action), sb3__VARIANT / sb3__VARIANT_prev (with --set)
            variant = a.variant if method == "mamba" else "_".join(
                v for v in ((a.variant if a.set else None), "prev" if a.sb3_prev_action else None) if v) or None
            sets = a.set
            for task in a.tasks:
                for seed in a.seeds:
                    done = os.path.join(run_dir(a.out, method, variant), f"{file_name(task)}__seed{seed}.json")
                    if not a.rerun and os.path.exists(done):
                        prev = json.load(open(done))
                        if prev["total"] == a.total and "stopped" not in prev:  # a stopped run runs again
                            continue
                    cmd = [sys.executable, os.path.abspath(__file__), "--worker", method, "--task", task, "--seed",
                           str(seed), "--total", str(a.total), "--out", a.out, "--eval-episodes",
                           str(a.eval_episodes)]
                    if variant:
                        cmd += ["--variant", variant]
                    if method == "sb3" and a.sb3_prev_action:
                        cmd += ["--sb3-prev-action"]
                    for kv in sets:
                        cmd += ["--set", kv]
                    if a.nice:
                        cmd = ["nice", "-n", str(a.nice)] + cmd
                    jobs.append(cmd)
    from mamba_rl.agents.interrupts import exit_code, ignore_until_exit, terminate_as_interrupt

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    running, t0, failed = [], time.time(), 0
    # Each worker runs in a session of its own, so a signal meant for the harness (Ctrl-C, `timeout`, a scheduler's
    # SIGTERM) reaches the harness alone, which passes it on to the running workers and waits for their JSONs.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # restored when main returns
    terminate_as_interrupt()
    try:
        with open(os.path.join(a.out, "runs.log"), "a") as log:
            while jobs or running:
                while jobs and len(running) < a.jobs:
                    running.append(subprocess.Popen(jobs.pop(0), env=env, stdout=log, stderr=log, cwd=ROOT,
                                                    start_new_session=True))
                time.sleep(0.5)
                still = []
                for p in running:
                    rc = p.poll()
                    if rc is None:
                        still.append(p)
                    elif rc != 0:
                        failed += 1
                        what = "stopped" if rc in (128 + signal.SIGINT, 128 + signal.SIGTERM) else "failed"
                        print(f"popgym: run {what} (rc {rc}): {' '.join(p.args)}", file=sys.stderr)
                running = still
    except KeyboardInterrupt as err:
        ignore_until_exit()
        _stop_workers(running, getattr(err, "signum", signal.SIGINT))
        print(f"popgym: stopped by {err or 'SIGINT'}: {len(running)} running runs stopped (their JSONs say so), "
              f"{len(jobs)} not started", file=sys.stderr)
        return exit_code(err)
    finally:
        for sig, h in handlers.items():
            if h is not None:
                signal.signal(sig, h)
    present = sorted(d for d in os.listdir(a.out) if os.path.isdir(os.path.join(a.out, d))) \
        if os.path.isdir(a.out) else []
    if record is not None:
        missing = [f for f in [record[1], *record[2].values()] if f not in present]
        if missing:
            ap.error(f"--record-column: no run folder {missing} under {a.out}; there are {present}")
        present.append(record[0])
    if a.columns:
        missing = [c for c in a.columns if c not in present]
        if missing:
            ap.error(f"--columns: no run folder {missing} under {a.out}; there are {present}")
    res = summarise(a.out, columns=a.columns, record=record)  # every finished run in the folder, not this call's only
    if res["runs"]:
        plot(res["runs"], os.path.join(a.out, "curves.png"))
    print(table(res["summary"], columns=a.columns), end="")
    print(f"popgym: {time.time() - t0:.0f} s, {failed} failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
