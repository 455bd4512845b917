"""Rollout storage for recurrent PPO, batch-first ([num_envs, num_steps, ...]) on the agent's device.

Under gymnasium's NextStep autoreset (see :mod:`mamba_rl.agents.gae`), column t of row n holds:

* ``inputs[n, t]``: the backbone input at step t: the (flattened, possibly normalised) obs,
  followed by the previous action encoding and previous reward when those options are on
  (zeros at an episode start). ``obs`` is the observation slice of it.
* ``episode_starts[n, t]``: obs_t is the first observation of an episode (the state is reset
  before consuming it, in the stepper and in the trainer).
* ``valid[n, t]``: False at the NextStep reset step (obs_t is the final obs of the previous
  episode, the env ignores the action): no advantage, no loss.
* ``actions``, ``logprobs``, ``values``: what the policy did at t and V(obs_t).
* ``rewards``, ``terminations``, ``truncations``: what the env returned for that step.
* ``initial_state``: the stepper state at the start of the rollout (before step 0), i.e. the
  state the update feeds the trainer for column 0.

:func:`collect_rollout` is the one per-step loop of every device. It keeps the carry (next obs,
starts, dones, previous action and reward) in numpy and builds the backbone input on the host
(:class:`HostStager`), so that per env step the device sees one staged input and gives back one
action. The acting itself is an *actor*: :class:`EagerActor` here (CPU, or CUDA without graphs:
backbone and heads on the device, sampling on the host) or
:class:`~mamba_rl.agents.device_actor.GraphActor` (CUDA: one graph replay per step, device storage).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from gymnasium import spaces

from mamba_rl.envs import finished_episodes

from .gae import compute_gae

__all__ = ["RolloutBuffer", "HostStager", "EagerActor", "collect_rollout"]


class RolloutBuffer:
    """Fixed-size rollout storage.

    Args:
        num_envs: N. num_steps: T. input_dim: width of the backbone input. obs_dim: width of
        the observation part (the first ``obs_dim`` columns of ``inputs``).
        action_dim: entries per stored action. discrete_actions: store actions as int64.
        initial_state: a RecurrentState of batch N whose buffers are cloned as storage.
        device: the backbone's device (``initial_state`` lives there).
        storage_device: where the per-step tensors live (default ``device``). RecurrentPPO keeps
            them on the CPU during the rollout and moves them once per update (:meth:`to_device`).
    """

    def __init__(self, num_envs: int, num_steps: int, input_dim: int, obs_dim: int, action_dim: int,
                 discrete_actions: bool, initial_state, device: torch.device,
                 storage_device: torch.device | None = None):
        n, t = num_envs, num_steps
        storage_device = device if storage_device is None else storage_device
        self.device = torch.device(device)
        f32 = dict(dtype=torch.float32, device=storage_device)
        b = dict(dtype=torch.bool, device=storage_device)
        self.num_envs, self.num_steps, self.obs_dim = n, t, obs_dim
        self.inputs = torch.zeros(n, t, input_dim, **f32)
        self.actions = torch.zeros(n, t, action_dim, dtype=torch.int64 if discrete_actions else torch.float32,
                                   device=storage_device)
        self.logprobs = torch.zeros(n, t, **f32)
        self.values = torch.zeros(n, t, **f32)
        self.rewards = torch.zeros(n, t, **f32)
        self.terminations = torch.zeros(n, t, **b)
        self.truncations = torch.zeros(n, t, **b)
        self.episode_starts = torch.zeros(n, t, **b)
        self.valid = torch.zeros(n, t, **b)
        self.initial_state = initial_state.clone()  # on the backbone's device
        self.advantages = torch.zeros(n, t, **f32)
        self.returns = torch.zeros(n, t, **f32)

    _FIELDS = ("inputs", "actions", "logprobs", "values", "rewards", "terminations", "truncations",
               "episode_starts", "valid", "advantages", "returns")

    def to_device(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Every per-step tensor on ``device`` (one copy each; no copy when already there)."""
        return {k: getattr(self, k).to(device, non_blocking=True) for k in self._FIELDS}

    @property
    def obs(self) -> torch.Tensor:
        """[N, T, obs_dim] view of the observations inside ``inputs``."""
        return self.inputs[..., : self.obs_dim]


class HostStager:
    """Backbone inputs and env actions in numpy, written into a caller's staging array.

    ``stage`` [N, input_dim + 1] float32 (pinned on CUDA) receives per step the backbone input of
    :meth:`mamba_rl.agents.policy.Policy.build_input` (obs, previous action encoding, previous reward;
    both zero at an episode start) and, in its last column, the episode-start flag (1.0 / 0.0).

    Args:
        policy: the :class:`~mamba_rl.agents.policy.Policy` (input layout, action space).
        stage: the [N, input_dim + 1] float32 numpy array to write.
    Raises:
        ValueError: a stage of the wrong shape or dtype.
    """

    def __init__(self, policy: Any, stage: np.ndarray):
        n, d = stage.shape[0], policy.input_dim
        if stage.shape != (n, d + 1) or stage.dtype != np.float32:
            raise ValueError(f"HostStager: stage must be float32 [N, {d + 1}], got {stage.dtype} {stage.shape}")
        self.policy, self.stage, self.n = policy, stage, n
        self.space = space = policy.action_space
        self.obs_dim = policy.obs_dim
        self.rows = np.arange(n)
        col = self.obs_dim
        self.act_cols = self.reward_col = None
        if policy.use_prev_action:
            from .heads import action_input_dim
            self.act_cols = slice(col, col + action_input_dim(space))
            col += action_input_dim(space)
        if policy.use_prev_reward:
            self.reward_col = col
        self.start = 0
        if isinstance(space, spaces.Discrete):
            self.start = int(space.start)
        elif isinstance(space, spaces.MultiDiscrete):
            self.start = np.asarray(space.start).reshape(1, -1)
            self.offsets = np.concatenate([[0], np.cumsum(space.nvec)[:-1]]).reshape(1, -1)
        else:
            self.low = np.asarray(space.low, np.float32).reshape(1, -1)
            self.high = np.asarray(space.high, np.float32).reshape(1, -1)

    def build(self, obs: np.ndarray, prev_action: np.ndarray, prev_reward: np.ndarray, start: np.ndarray) -> None:
        """Write the input of obs [N, ...], prev_action [N, action_dim] (stored form), prev_reward [N]
        and start [N] bool into ``stage``."""
        x, n = self.stage, self.n
        x[:, : self.obs_dim] = np.reshape(obs, (n, self.obs_dim))
        keep = ~start
        if self.act_cols is not None:
            blk = x[:, self.act_cols]
            if isinstance(self.space, spaces.Discrete):
                blk.fill(0.0)
                blk[self.rows, prev_action[:, 0]] = keep
            elif isinstance(self.space, spaces.MultiDiscrete):
                blk.fill(0.0)
                blk[self.rows[:, None], prev_action + self.offsets] = keep[:, None]
            else:
                np.clip(prev_action, self.low, self.high, out=blk)
                blk *= keep[:, None]
        if self.reward_col is not None:
            x[:, self.reward_col] = prev_reward * keep
        x[:, -1] = start

    def to_env(self, action: np.ndarray) -> np.ndarray:
        """Stored actions [N, action_dim] -> env actions (``start`` added, Box clipped to its bounds)."""
        if isinstance(self.space, spaces.Discrete):
            return action[:, 0] + self.start
        if isinstance(self.space, spaces.MultiDiscrete):
            return action + self.start
        a = np.clip(action, self.low, self.high).astype(self.space.dtype)
        return a.reshape((self.n,) + self.space.shape)


class EagerActor:
    """Acting without graphs (CPU, or CUDA with ``cuda_graphs=False``): the staged input goes to the device
    in one copy, the stepper and one fused head GEMM run there, the outputs come back in one copy, and
    sampling (the agent's ``sample_generator``), log-probs and storage happen on the host, in the
    agent's CPU :class:`RolloutBuffer`."""

    def __init__(self, agent: Any):
        self.agent, p = agent, agent.policy
        self.stage_t = torch.zeros(agent.config.num_envs, p.input_dim + 1, pin_memory=agent.device.type == "cuda")
        self.stager = HostStager(p, self.stage_t.numpy())
        b = agent.buffer
        self.env_arrays = (b.rewards.numpy(), b.terminations.numpy(), b.truncations.numpy(), b.valid.numpy())

    def begin(self) -> None:
        a = self.agent
        a.buffer.initial_state.copy_(a.stepper.state)
        self.w, self.bias = a.policy.fused_heads()
        self.log_std = a.policy.host_log_std()

    def _heads(self) -> torch.Tensor:
        a, d = self.agent, self.agent.policy.input_dim
        dev = self.stage_t.to(a.device, non_blocking=True)
        starts = dev[:, d] > 0.5
        feat = a.stepper.step(dev[:, :d].contiguous(), episode_starts=starts)
        return torch.addmm(self.bias, feat, self.w).cpu()  # [N, P + 1]: actor raw outputs | value

    def act(self, t: int) -> np.ndarray:
        """One step from the staged input; returns the stored-form actions [N, action_dim]."""
        a, buf = self.agent, self.agent.buffer
        actor, d = a.policy.actor, a.policy.input_dim
        out = self._heads()
        p_dim = actor.out_dim
        dist = actor.dist(out[:, :p_dim], self.log_std)
        action = dist.sample(a.sample_generator)
        buf.inputs[:, t] = self.stage_t[:, :d]
        buf.episode_starts[:, t] = self.stage_t[:, d] > 0.5
        buf.values[:, t] = out[:, p_dim]
        buf.actions[:, t] = action
        buf.logprobs[:, t] = dist.log_prob(action)
        return action.numpy()

    def finish(self) -> None:
        """V(next obs) with the carried state, without advancing it (exact V(final obs) after a done), then GAE."""
        a, buf, c = self.agent, self.agent.buffer, self.agent.config
        saved = a.stepper.get_state()
        next_value = self._heads()[:, -1].clone()
        a.stepper.load_state(saved)
        buf.advantages, buf.returns = compute_gae(buf.rewards, buf.values, buf.terminations, buf.truncations,
                                                  buf.valid, next_value, c.gamma, c.gae_lambda)


def collect_rollout(agent: Any, actor: Any) -> tuple[list[tuple[int, float, int]], float, float]:
    """Run ``num_steps`` steps of every env with ``actor`` and fill ``agent.buffer`` (GAE included).

    Per step, the host only stages the input (:class:`HostStager`), lets the actor act, steps the envs
    and records rewards / dones in numpy; it reads the infos only when an episode ended. Semantics of
    docs/architecture.md, "Agent loop": NextStep autoreset (the reset step is marked invalid), previous
    action/reward zeroed at starts, the carry kept across rollouts (as CPU tensors on the agent, which
    checkpoints save).

    Returns:
        (episodes as (global_step, return, length), rollout wall time [ms], env.step time [ms]).
    """
    c, n = agent.config, agent.config.num_envs
    if not agent.env_started:
        agent._reset_envs()
    t0 = time.perf_counter()
    stager = actor.stager
    next_obs = agent.next_obs.numpy()
    next_start = agent.next_start.numpy().copy()
    next_done = agent.next_done.numpy().copy()
    prev_action = agent.prev_action.numpy().copy()
    prev_reward = agent.prev_reward.numpy().copy()
    rewards, terms, truncs, valid = actor.env_arrays
    episodes: list[tuple[int, float, int]] = []
    env_s = 0.0
    actor.begin()
    for t in range(c.num_steps):
        start = next_start | c.memoryless
        stager.build(next_obs, prev_action, prev_reward, start)
        valid[:, t] = ~next_done
        action = actor.act(t)
        np.copyto(prev_action, action)
        e0 = time.perf_counter()
        obs, reward, term, trunc, info = agent.envs.step(stager.to_env(prev_action))
        env_s += time.perf_counter() - e0
        agent.global_step += n * getattr(agent, "world_size", 1)  # all ranks together
        rewards[:, t] = reward
        terms[:, t] = term
        truncs[:, t] = trunc
        # the obs after a reset step is the first obs of the next episode
        next_start = next_done
        next_done = np.logical_or(term, trunc)
        prev_reward = np.asarray(reward, dtype=np.float32).copy()
        next_obs = obs
        if "_episode" in info:
            for ret, length in finished_episodes(info):
                episodes.append((agent.global_step, ret, length))
                agent.recent_returns.append(ret)
    stager.build(next_obs, prev_action, prev_reward, next_start | c.memoryless)
    actor.finish()
    agent.next_obs = torch.from_numpy(np.asarray(next_obs, dtype=np.float32).reshape(n, -1).copy())
    agent.next_start = torch.from_numpy(np.asarray(next_start, dtype=bool).copy())
    agent.next_done = torch.from_numpy(next_done.copy())
    agent.prev_action = torch.from_numpy(prev_action)
    agent.prev_reward = torch.from_numpy(prev_reward)
    return episodes, (time.perf_counter() - t0) * 1e3, env_s * 1e3
