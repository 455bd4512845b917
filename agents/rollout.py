"""Rollout storage, the carried rollout state and the per-step loop of recurrent PPO.

Under gymnasium's NextStep autoreset (see :mod:`mamba_rl.agents.gae`), column t of row n of a
:class:`RolloutBuffer` (batch-first, [num_envs, num_steps, ...]) holds:

* ``inputs[n, t]``: the backbone input at step t: the (flattened, possibly normalised) obs,
  followed by the previous action encoding and previous reward when those options are on
  (zeros at an episode start). ``obs`` is the observation slice of it.
* ``episode_starts[n, t]``: obs_t is the first observation of an episode (the state is reset
  before consuming it, in the stepper and in the trainer).
* ``valid[n, t]``: False at the NextStep reset step (obs_t is the final obs of the previous
  episode, the env ignores the action): no advantage, no loss.
* ``actions``, ``logprobs``, ``values``: what the policy did at t and V(obs_t).
* ``advantages``, ``returns``: the main critic's GAE (:mod:`mamba_rl.agents.gae`).
* with the two-horizon critic (``PPOConfig.aux_gamma``) also ``aux_values`` (the aux head's V(obs_t)),
  ``aux_advantages`` and ``aux_returns`` (its GAE at aux_gamma / aux_gae_lambda); the update mixes the two
  advantages into the policy's (:func:`~mamba_rl.agents.gae.combine_advantages`). None without it.
* ``rewards``, ``terminations``, ``truncations``: what the env returned for that step.
* ``initial_state``: the stepper state at the start of the rollout (before step 0), i.e. the
  state the update feeds the trainer for column 0.

:func:`collect_rollout` is the one per-step loop of every device. Between rollouts it carries a
:class:`RolloutCarry` (next obs, starts, dones, previous action and reward as CPU tensors; the
recurrent state stays in the stepper) and builds each step's backbone input on the host
(:class:`~mamba_rl.agents.policy.HostStager`), so that per env step the device sees one staged input
and gives back one action. The acting itself is an :class:`Actor`: :class:`EagerActor` here (CPU, or
CUDA without graphs: backbone and heads on the device, sampling and storage on the host) or
:class:`~mamba_rl.agents.device_actor.GraphActor` (CUDA: one graph replay per step, device storage).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode

from mamba_rl import RecurrentState, Stepper
from mamba_rl.envs import EnvGuard, find_vector_wrapper, finished_episode_arrays, flatten_vec_obs

from .gae import compute_gae
from .policy import HostStager, Policy

__all__ = ["RolloutBuffer", "RolloutCarry", "RolloutResult", "Actor", "EagerActor", "collect_rollout",
           "adopt_vec_env", "check_parts", "check_aux", "split_state", "join_state"]

Episode = tuple[int, float, int]  # (global step at its end, return, length)


class RolloutBuffer:
    """Fixed-size rollout storage (see the module doc for the meaning of every field).

    Args:
        num_envs: N. num_steps: T. input_dim: width of the backbone input. obs_dim: width of
            the observation part (the first ``obs_dim`` columns of ``inputs``).
        action_dim: entries per stored action. discrete_actions: store actions as int64 (else float32).
        initial_state: a RecurrentState of batch N whose buffers are cloned as ``initial_state``
            (it stays on their device, the backbone's).
        storage_device: where the per-step tensors live: the backbone's device for the graph actor,
            the CPU for the eager actor (which writes them from the host).
        aux: also store the two-horizon critic's ``aux_values``, ``aux_advantages``, ``aux_returns``.

    Attributes: ``inputs`` [N, T, input_dim] f32, ``actions`` [N, T, action_dim] int64/f32,
    ``logprobs``, ``values``, ``rewards``, ``advantages``, ``returns`` [N, T] f32, ``terminations``,
    ``truncations``, ``episode_starts``, ``valid`` [N, T] bool, ``initial_state``; ``aux_values``,
    ``aux_advantages``, ``aux_returns`` [N, T] f32 with ``aux``, else None.
    """

    def __init__(self, num_envs: int, num_steps: int, input_dim: int, obs_dim: int, action_dim: int,
                 discrete_actions: bool, initial_state: RecurrentState, storage_device: torch.device,
                 aux: bool = False):
        n, t = num_envs, num_steps
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
        self.initial_state = initial_state.clone()
        self.advantages = torch.zeros(n, t, **f32)
        self.returns = torch.zeros(n, t, **f32)
        self.aux = bool(aux)
        self.aux_values = torch.zeros(n, t, **f32) if aux else None
        self.aux_advantages = torch.zeros(n, t, **f32) if aux else None
        self.aux_returns = torch.zeros(n, t, **f32) if aux else None

    @property
    def obs(self) -> torch.Tensor:
        """[N, T, obs_dim] view of the observations inside ``inputs``."""
        return self.inputs[..., : self.obs_dim]


@dataclass
class RolloutCarry:
    """What one rollout hands the next, per env (the env side of sb3-contrib's ``RNNStates``; the
    recurrent state itself stays in the stepper's buffers). CPU tensors; checkpoints save them.

    Attributes:
        next_obs: [N, obs_dim] float32, the observation the next step acts on.
        next_start: [N] bool, ``next_obs`` is the first observation of an episode.
        next_done: [N] bool, the last step ended an episode (the next step is the NextStep reset step).
        prev_action: [N, action_dim] int64 (discrete) / float32 (Box), stored form.
        prev_reward: [N] float32.
        episode_step: [N] int64, the in-episode step of ``next_obs`` (0: an episode's first observation), the
            time encoding's input (:func:`mamba_rl.agents.policy.time_features`).
        started: the envs have been reset (False: the next rollout resets them first).
    """

    next_obs: torch.Tensor
    next_start: torch.Tensor
    next_done: torch.Tensor
    prev_action: torch.Tensor
    prev_reward: torch.Tensor
    episode_step: torch.Tensor
    started: bool = False

    # the tensor fields, in the order and under the names checkpoints store them (carry/<name>)
    TENSORS = ("next_obs", "next_start", "next_done", "prev_action", "prev_reward", "episode_step")

    @classmethod
    def zeros(cls, num_envs: int, obs_dim: int, action_dim: int, discrete_actions: bool) -> RolloutCarry:
        """The carry of envs not reset yet (``started`` False): zero obs, every env at an episode start."""
        return cls(*_episode_start(torch.zeros(num_envs, obs_dim), action_dim, discrete_actions), started=False)

    def restart(self, next_obs: torch.Tensor, action_dim: int, discrete_actions: bool) -> None:
        """Every env at the start of an episode whose first observation is ``next_obs`` [N, obs_dim]."""
        (self.next_obs, self.next_start, self.next_done, self.prev_action, self.prev_reward,
         self.episode_step) = _episode_start(next_obs, action_dim, discrete_actions)
        self.started = True


def _episode_start(next_obs: torch.Tensor, action_dim: int, discrete_actions: bool) -> tuple[torch.Tensor, ...]:
    """The carry's tensors with every env at an episode start: (next_obs, starts, dones, prev action, reward,
    in-episode step)."""
    n = next_obs.shape[0]
    return (next_obs, torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool),
            torch.zeros(n, action_dim, dtype=torch.int64 if discrete_actions else torch.float32), torch.zeros(n),
            torch.zeros(n, dtype=torch.int64))


@dataclass
class RolloutResult:
    """What :func:`collect_rollout` reports.

    Attributes:
        episodes: the finished episodes as (global step at their end, return, length), in order.
        rollout_ms: wall time of the rollout [ms]. env_ms: the env.step share of it [ms].
    """

    episodes: list[Episode] = field(default_factory=list)
    rollout_ms: float = 0.0
    env_ms: float = 0.0


class Actor(Protocol):
    """What :func:`collect_rollout` needs of an actor (:class:`EagerActor`, ``GraphActor``).

    An actor may also have ``parts`` (row ranges, :mod:`mamba_rl.envs.parts`), ``stagers`` (one per part) and
    ``act(t, part)``: with more than one part the loop acts on one part while the others' envs step."""

    stager: HostStager  # the [N, input_dim + 1] stage the loop writes each step's input into
    stepper: Stepper  # carries the recurrent state (reset with the envs)
    env_arrays: tuple[np.ndarray, ...]  # [N, T] rewards, terminations, truncations, valid the loop fills

    def begin(self) -> None:
        """Rollout start: store the stepper state as the buffer's initial state, refresh the heads."""

    def act(self, t: int) -> np.ndarray:
        """Act on the staged input of step ``t``; store it; return the stored-form actions [N, action_dim]."""

    def finish(self) -> None:
        """Bootstrap V(next obs) from the staged input without advancing the state, then GAE into the buffer."""


class EagerActor:
    """Acting without graphs (CPU, or CUDA with ``cuda_graphs=False``): the staged input goes to the device
    in one copy (from a pinned stage on CUDA), the stepper and one fused head GEMM run there, the outputs come
    back in one copy (into a pinned buffer on CUDA, valid until the next step), and
    sampling (``generator``), log-probs and storage happen on the host, in a CPU :class:`RolloutBuffer`.

    With ``parts`` (row ranges of an env stack that steps in parts, :mod:`mamba_rl.envs.parts`) each part has
    its own stepper (a contiguous state, copied from ``stepper``'s rows at :meth:`begin` and back at
    :meth:`finish`) and :meth:`act` takes the part: the rollout acts on one part while the others' envs step
    (on the CPU the policy's thread and EnvPool's threads then work at once).

    Args:
        policy: the policy (heads, input layout). stepper: its stepper of batch N (the rollout's state).
        buffer: the CPU buffer of N envs to fill. generator: the CPU sampling generator.
        gamma, gae_lambda: GAE's discount and lambda.
        parts: None (all N rows at once) or consecutive non-empty row slices covering ``[0, N)``.
        aux_gamma, aux_gae_lambda: the two-horizon critic's GAE discount and lambda (``PPOConfig.aux_gamma``):
            given exactly when the policy has an aux critic and the buffer stores its values (None: neither).

    Raises:
        ValueError: ``parts`` that are not consecutive non-empty row slices covering the N rows; an
            ``aux_gamma`` without an aux critic or an aux buffer, or an aux critic without ``aux_gamma``.
    """

    def __init__(self, policy: Policy, stepper: Stepper, buffer: RolloutBuffer, generator: torch.Generator,
                 gamma: float, gae_lambda: float, parts: tuple[slice, ...] | None = None,
                 aux_gamma: float | None = None, aux_gae_lambda: float = 0.65):
        self.policy, self.stepper, self.buffer, self.generator = policy, stepper, buffer, generator
        self.gamma, self.gae_lambda = gamma, gae_lambda
        self.aux_gamma, self.aux_gae_lambda = check_aux(policy, buffer, aux_gamma, aux_gae_lambda, "EagerActor")
        n, d = buffer.num_envs, policy.input_dim
        self.parts = check_parts(parts, n, "EagerActor")
        cuda = policy.device.type == "cuda"
        self.stage_t = torch.zeros(n, d + 1, pin_memory=cuda)
        self.stager = HostStager(policy, self.stage_t.numpy())
        self.stagers = tuple(HostStager(policy, self.stage_t.numpy()[r]) for r in self.parts)
        # CUDA: the heads' outputs come back into one pinned buffer (an async copy and a stream sync per step,
        # no pageable allocation); on the CPU they are used where they are
        self.out_pin = torch.zeros(n, policy.actor.out_dim + policy.value_heads, pin_memory=True) if cuda else None
        b = buffer
        self.env_arrays = (b.rewards.numpy(), b.terminations.numpy(), b.truncations.numpy(), b.valid.numpy())
        # the host writes the CPU buffer through numpy views (a numpy column write is ~1 us, a torch one ~4 us)
        self._np = {k: getattr(b, k).numpy() for k in ("inputs", "episode_starts", "values", "actions", "logprobs")
                    + (("aux_values",) if self.aux_gamma is not None else ())}
        # the CPU: the stepper reads a contiguous copy of the staged input and the start flags, both written in
        # place each step (no allocation, no torch op); CUDA copies the whole stage to the device instead
        self._x = None if cuda else torch.zeros(n, d)
        self._starts = None if cuda else torch.zeros(n, dtype=torch.bool)
        self.part_steppers = (stepper,) if len(self.parts) == 1 else tuple(
            policy.net.stepper(batch=r.stop - r.start) for r in self.parts)

    def begin(self) -> None:
        """Rollout start: store the stepper state as the update's initial state, refresh the fused heads."""
        self.buffer.initial_state.copy_(self.stepper.state)
        split_state(self.stepper.state, self.parts, [s.state for s in self.part_steppers])
        self.w, self.bias = self.policy.fused_heads()
        self.log_std = self.policy.host_log_std()

    def _heads(self, rows: slice, stepper: Stepper) -> torch.Tensor:
        """[rows, P + V] actor raw outputs | value (| aux value) of the staged ``rows`` (advances ``stepper``)."""
        d = self.policy.input_dim
        if self._x is not None:  # the CPU: the stage's input and start columns into the stepper's inputs
            stage, x, starts = self.stager.stage[rows], self._x[rows], self._starts[rows]
            np.copyto(x.numpy(), stage[:, :d])
            np.greater(stage[:, d], 0.5, out=starts.numpy())
            feat = stepper.step(x, episode_starts=starts)
        else:
            dev = self.stage_t[rows].to(self.policy.device, non_blocking=True)
            feat = stepper.step(dev[:, :d].contiguous(), episode_starts=dev[:, d] > 0.5)
        out = torch.addmm(self.bias, feat, self.w)  # [rows, P + V]: actor raw outputs | value (| aux value)
        if self.out_pin is None:
            return out
        pin = self.out_pin[rows]
        pin.copy_(out, non_blocking=True)
        torch.cuda.current_stream(self.policy.device).synchronize()
        return pin

    def act(self, t: int, part: int = 0) -> np.ndarray:
        """One step of part ``part``'s rows from their staged input; returns their stored-form actions
        [rows, action_dim]."""
        actor, d, b = self.policy.actor, self.policy.input_dim, self._np
        rows = self.parts[part]
        out = self._heads(rows, self.part_steppers[part])
        p_dim = actor.out_dim
        dist = actor.dist(out[:, :p_dim], self.log_std)
        action = dist.sample(self.generator)
        stage, act = self.stager.stage[rows], action.numpy()
        b["inputs"][rows, t] = stage[:, :d]
        np.greater(stage[:, d], 0.5, out=b["episode_starts"][rows, t])
        b["values"][rows, t] = out.numpy()[:, p_dim]
        if self.aux_gamma is not None:
            b["aux_values"][rows, t] = out.numpy()[:, p_dim + 1]
        b["actions"][rows, t] = act
        b["logprobs"][rows, t] = dist.log_prob_numpy(act)
        return act

    def finish(self) -> None:
        """V(next obs) with the carried state, without advancing it (exact V(final obs) after a done), then GAE
        (and the aux critic's GAE at its own discount and lambda)."""
        buf, p_dim = self.buffer, self.policy.actor.out_dim
        join_state(self.stepper.state, self.parts, [s.state for s in self.part_steppers])
        saved = self.stepper.get_state()
        out = self._heads(slice(None), self.stepper)
        next_value = out[:, p_dim].clone()
        aux_next = out[:, p_dim + 1].clone() if self.aux_gamma is not None else None
        self.stepper.load_state(saved)
        buf.advantages, buf.returns = compute_gae(buf.rewards, buf.values, buf.terminations, buf.truncations,
                                                  buf.valid, next_value, self.gamma, self.gae_lambda)
        if aux_next is not None:
            buf.aux_advantages, buf.aux_returns = compute_gae(buf.rewards, buf.aux_values, buf.terminations,
                                                              buf.truncations, buf.valid, aux_next, self.aux_gamma,
                                                              self.aux_gae_lambda)


def check_aux(policy: Policy, buffer: RolloutBuffer, aux_gamma: float | None, aux_gae_lambda: float,
              who: str) -> tuple[float | None, float]:
    """(aux_gamma, aux_gae_lambda) of an actor after checking that the policy's aux critic, the buffer's aux
    storage and ``aux_gamma`` agree (all present or all absent; both numbers in [0, 1]).

    Raises:
        ValueError: naming ``who``, what was expected and what was given.
    """
    want = aux_gamma is not None
    if (policy.aux_critic is not None) != want or buffer.aux != want:
        raise ValueError(f"{who}: aux_gamma {aux_gamma!r} needs a policy with an aux critic and a RolloutBuffer with "
                         f"aux=True (None: neither); got aux critic {policy.aux_critic is not None}, buffer aux "
                         f"{buffer.aux}")
    if want and not (0.0 <= aux_gamma <= 1.0 and 0.0 <= aux_gae_lambda <= 1.0):
        raise ValueError(f"{who}: aux_gamma and aux_gae_lambda must be in [0, 1], got {aux_gamma!r}, "
                         f"{aux_gae_lambda!r}")
    return aux_gamma, aux_gae_lambda


def split_state(state: RecurrentState, parts: tuple[slice, ...], part_states: list[RecurrentState]) -> None:
    """Copy the rows ``parts[i]`` of ``state`` into ``part_states[i]`` (nothing with one part: it is ``state``)."""
    if len(parts) > 1:
        for rows, part in zip(parts, part_states):
            part.copy_(state.index(rows))


def join_state(state: RecurrentState, parts: tuple[slice, ...], part_states: list[RecurrentState]) -> None:
    """Copy ``part_states[i]`` back into the rows ``parts[i]`` of ``state`` (nothing with one part)."""
    if len(parts) > 1:
        for rows, part in zip(parts, part_states):
            state.index(rows).copy_(part)


def check_parts(parts: tuple[slice, ...] | None, n: int, who: str) -> tuple[slice, ...]:
    """``parts`` as a tuple of consecutive non-empty ``slice(start, stop)`` covering ``[0, n)`` (None: one part).

    Raises:
        ValueError: anything else, naming ``who``.
    """
    if parts is None:
        return (slice(0, n),)
    parts = tuple(parts)
    ok = bool(parts) and all(isinstance(r, slice) and r.step in (None, 1) and isinstance(r.start, int)
                             and isinstance(r.stop, int) and r.stop > r.start for r in parts)
    if not ok or parts[0].start != 0 or parts[-1].stop != n or any(a.stop != b.start for a, b in zip(parts, parts[1:])):
        raise ValueError(f"{who}: expected parts as consecutive non-empty row slices covering [0, {n}), got {parts!r}")
    return parts


def adopt_vec_env(envs: gym.vector.VectorEnv, num_envs: int, nonfinite: str = "raise") -> gym.vector.VectorEnv:
    """Check that a caller-built vector env fits a rollout of ``num_envs`` envs; flatten its observations.

    Returns:
        ``envs``, wrapped in :class:`mamba_rl.envs.FlattenVecObs` when its observations are not a 1-D
        float32 Box, then in an :class:`mamba_rl.envs.EnvGuard` with ``nonfinite`` unless it holds one
        already (outermost: wrappers of the caller's, such as a normalisation, see the values before the
        guard does).

    Raises:
        ValueError: not a VectorEnv, another sub-env count, or an autoreset mode other than NextStep
            (the rollout's reset-step and GAE semantics assume it).
    """
    if not isinstance(envs, gym.vector.VectorEnv):
        raise ValueError(f"env must be an env id or a gymnasium.vector.VectorEnv, got {type(envs).__name__}")
    if envs.num_envs != num_envs:
        raise ValueError(f"the vector env has {envs.num_envs} sub-envs but config.num_envs is "
                         f"{num_envs}; pass num_envs={envs.num_envs}")
    mode = envs.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
    if mode != AutoresetMode.NEXT_STEP:
        raise ValueError(f"RecurrentPPO needs NextStep autoreset (gymnasium's default), got {mode}")
    envs = flatten_vec_obs(envs)
    if find_vector_wrapper(envs, EnvGuard) is None:
        envs = EnvGuard(envs, nonfinite)
    return envs


def collect_rollout(envs: gym.vector.VectorEnv, actor: Actor, carry: RolloutCarry, num_steps: int,
                    memoryless: bool, env_seed: int, advance: Callable[[], int]) -> RolloutResult:
    """Run ``num_steps`` steps of every env with ``actor``, which fills its buffer (GAE included).

    Per step, the host only stages the input (:class:`~mamba_rl.agents.policy.HostStager`), lets the
    actor act, steps the envs and records rewards / dones in numpy (whole-array operations, no per-env
    Python; rows of time-major scratch, copied into the actor's [N, T] arrays after the last step); it reads
    the infos only when an episode ended. With an actor of several ``parts`` (and an env stack that steps in
    those parts, :mod:`mamba_rl.envs.parts`) each step goes part by part: receive the part's previous step,
    stage, act and send it, so that the other parts' envs step while this one acts; the last step's parts are
    received before the bootstrap. Same per-env semantics; the episodes of a step come in sub-env order. Semantics of docs/architecture.md, "Agent loop": NextStep autoreset (the reset step
    is marked invalid), previous action/reward zeroed at starts, the carry kept across rollouts.

    Args:
        envs: the vector env of N sub-envs (NextStep autoreset, RecordEpisodeStatistics).
        actor: acts and stores (its stager and env arrays have N rows, T >= ``num_steps`` columns).
        carry: the state carried from the previous rollout; replaced in place at the end. When
            ``carry.started`` is False the envs are reset first (seed ``env_seed``: sub-env i gets
            ``env_seed + i``) and the stepper state zeroed.
        num_steps: T. memoryless: every step is an episode start (ablation).
        advance: called once per env step; counts the step's env steps and returns the new global step
            (the step an episode finishing there is logged at).

    Returns:
        :class:`RolloutResult`.
    """
    n = envs.num_envs
    if not carry.started:
        obs, _ = envs.reset(seed=env_seed)
        carry.restart(torch.as_tensor(np.asarray(obs, dtype=np.float32).reshape(n, -1)), carry.prev_action.shape[1],
                      carry.prev_action.dtype == torch.int64)
        actor.stepper.reset()
    t0 = time.perf_counter()
    stager = actor.stager
    next_obs = carry.next_obs.numpy().copy()
    next_start = carry.next_start.numpy().copy()
    next_done = carry.next_done.numpy().copy()
    prev_action = carry.prev_action.numpy().copy()
    prev_reward = carry.prev_reward.numpy().copy()
    episode_step = carry.episode_step.numpy().astype(np.int64)  # a copy
    out = actor.env_arrays  # [N, T] rewards, terminations, truncations, valid (batch-first)
    # written per step into time-major scratch [T, N] of the same dtypes (a contiguous row per step: a column
    # of an [N, T] array touches N cache lines) and copied into the actor's arrays once, after the loop
    rewards, terms, truncs, valid = (np.empty((num_steps, n), dtype=a.dtype) for a in out)
    result = RolloutResult()
    ep_steps: list[np.ndarray] = []  # per step with finished episodes: the global step, once per episode
    ep_parts: list[tuple[np.ndarray, np.ndarray]] = []  # and their (returns float64, lengths int64)
    env_s = 0.0
    global_step = 0

    def record(t: int, rows: slice, obs, reward, term, trunc, info) -> None:
        """What the env returned for step t of the sub-envs ``rows``."""
        rewards[t, rows] = reward
        terms[t, rows] = term
        truncs[t, rows] = trunc
        # the obs after a reset step is the first obs of the next episode
        next_start[rows] = next_done[rows]
        episode_step[rows] = np.where(next_start[rows], 0, episode_step[rows] + 1)
        next_done[rows] = np.logical_or(term, trunc)
        prev_reward[rows] = reward
        next_obs[rows] = np.reshape(obs, next_obs[rows].shape)
        if "_episode" in info:  # arrays now, tuples once after the loop (no per-episode Python per step)
            ep_rets, ep_lens = finished_episode_arrays(info)
            ep_steps.append(np.full(ep_rets.shape[0], global_step, dtype=np.int64))
            ep_parts.append((ep_rets, ep_lens))

    parts = getattr(actor, "parts", None)
    actor.begin()
    if parts is None or len(parts) == 1:
        everything = slice(None)
        for t in range(num_steps):
            stager.build(next_obs, prev_action, prev_reward, next_start | memoryless, episode_step)
            valid[t] = ~next_done
            np.copyto(prev_action, actor.act(t))
            e0 = time.perf_counter()
            step = envs.step(stager.to_env(prev_action))
            env_s += time.perf_counter() - e0
            global_step = advance()
            record(t, everything, *step)
    else:  # act on one part while the other parts' envs step (mamba_rl.envs.parts)
        stagers = actor.stagers
        sent = [False] * len(parts)
        try:
            for t in range(num_steps + 1):
                for h, rows in enumerate(parts):
                    if t:  # the step t - 1 of this part, sent below one step ago
                        e0 = time.perf_counter()
                        sent[h] = False
                        step = envs.recv_part(h)
                        env_s += time.perf_counter() - e0
                        if h == 0:
                            global_step = advance()
                        record(t - 1, rows, *step)
                    if t == num_steps:
                        continue
                    stagers[h].build(next_obs[rows], prev_action[rows], prev_reward[rows],
                                     next_start[rows] | memoryless, episode_step[rows])
                    valid[t, rows] = ~next_done[rows]
                    prev_action[rows] = actor.act(t, h)
                    e0 = time.perf_counter()
                    envs.send_part(h, stagers[h].to_env(prev_action[rows]))
                    sent[h] = True
                    env_s += time.perf_counter() - e0
        except BaseException:
            # an interrupted rollout (Ctrl-C, an env error) leaves no step sent and unreceived: the envs stay
            # usable for the next rollout, as after an interrupted whole step of the plain loop
            for h in range(len(parts)):
                if sent[h]:
                    try:
                        envs.recv_part(h)
                    except Exception:  # noqa: BLE001 - the error being raised is the one to report
                        pass
            raise
    for dst, src in zip(out, (rewards, terms, truncs, valid)):
        dst[:, :num_steps] = src.T
    if ep_steps:
        result.episodes = list(zip(np.concatenate(ep_steps).tolist(),
                                   np.concatenate([r for r, _ in ep_parts]).tolist(),
                                   np.concatenate([x for _, x in ep_parts]).tolist()))
    stager.build(next_obs, prev_action, prev_reward, next_start | memoryless, episode_step)
    actor.finish()
    carry.next_obs = torch.from_numpy(np.asarray(next_obs, dtype=np.float32).reshape(n, -1).copy())
    carry.next_start = torch.from_numpy(np.asarray(next_start, dtype=bool).copy())
    carry.next_done = torch.from_numpy(next_done.copy())
    carry.prev_action = torch.from_numpy(prev_action)
    carry.prev_reward = torch.from_numpy(prev_reward)
    carry.episode_step = torch.from_numpy(episode_step)
    result.rollout_ms, result.env_ms = (time.perf_counter() - t0) * 1e3, env_s * 1e3
    return result
