"""The recurrent policy: Mamba backbone + linear actor/critic heads, and how it acts.

A :class:`Policy` owns the backbone (:class:`mamba_rl.MambaBackbone`), the two heads and the
backbone input format: the (flattened) observation, then, when configured, the previous action
(one-hot for discrete spaces) and the previous reward, both zero at an episode start. Acting is
one backbone step (a stepper of the backbone) followed by both heads, so one step gives both the
action and the value (see docs/architecture.md, "Agent loop"; episode starts reset the memory as
in "Reset semantics").

Actions are sampled on the host with an explicit ``torch.Generator`` (the agent's), as in the
rollout, so that runs and resumed runs are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from mamba_rl import MambaBackbone, MambaConfig, RecurrentState

from .heads import ActionDist, ActorHead, CriticHead, action_dim, action_input_dim, encode_prev_action

__all__ = ["Policy", "PolicyState", "resolve_device"]


def resolve_device(device: str) -> torch.device:
    """"auto" -> cuda when available else cpu; "cuda" without CUDA raises RuntimeError."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but torch.cuda.is_available() is False")
    return dev


@dataclass
class PolicyState:
    """What :meth:`Policy.act` carries between calls for a batch of B envs.

    Attributes:
        recurrent: backbone RecurrentState (conv [L,B,d_inner,d_conv-1], ssm [L,B,d_inner,d_state]).
        prev_action: [B, action_dim] last action returned (int64 or float32).
        prev_reward: [B] float32 last reward passed in.
    """

    recurrent: RecurrentState
    prev_action: torch.Tensor
    prev_reward: torch.Tensor


class Policy:
    """Backbone + heads for one observation width and action space.

    Args:
        backbone: the backbone's :class:`mamba_rl.MambaConfig`.
        obs_dim: width of the flattened observation.
        action_space: the single-env action space (Discrete, MultiDiscrete 1-D, Box).
        device: where the backbone and heads live.
        seed: seeds the backbone init and the heads' orthogonal init.
        backend: backbone backend, "auto" | "cuda" | "reference".
        prev_action, prev_reward: append the previous action / reward to the input.
        memoryless: treat every step as an episode start (ablation baseline).

    Raises:
        TypeError: an unsupported action space.
    """

    def __init__(self, backbone: MambaConfig, obs_dim: int, action_space: spaces.Space, device: torch.device,
                 seed: int, backend: str = "auto", prev_action: bool = False, prev_reward: bool = False,
                 memoryless: bool = False):
        self.obs_dim = int(obs_dim)
        self.action_space = action_space
        self.action_dim = action_dim(action_space)
        self.discrete_actions = not isinstance(action_space, spaces.Box)
        self.use_prev_action, self.use_prev_reward, self.memoryless = prev_action, prev_reward, memoryless
        self.input_dim = self.obs_dim
        if prev_action:
            self.input_dim += action_input_dim(action_space)
        if prev_reward:
            self.input_dim += 1
        self.device = device
        init_gen = torch.Generator().manual_seed(seed)
        self.net = MambaBackbone(backbone, self.input_dim, device=device, seed=seed, backend=backend)
        self.heads = nn.ModuleDict({
            "actor": ActorHead(backbone.d_model, action_space, init_gen),
            "critic": CriticHead(backbone.d_model, init_gen),
        }).to(device)
        self._steppers: dict[int, Any] = {}
        self._act_low = self._act_high = None
        if isinstance(action_space, spaces.Box):
            self._act_low = torch.as_tensor(action_space.low.reshape(-1), dtype=torch.float32)
            self._act_high = torch.as_tensor(action_space.high.reshape(-1), dtype=torch.float32)

    @property
    def actor(self) -> ActorHead:
        return self.heads["actor"]

    @property
    def critic(self) -> CriticHead:
        return self.heads["critic"]

    # ---------------------------------------------------------------- inputs
    def build_input(self, obs: torch.Tensor, prev_action: torch.Tensor, prev_reward: torch.Tensor,
                    episode_starts: torch.Tensor) -> torch.Tensor:
        """Backbone input [B, input_dim] f32 from obs [B, obs_dim], prev_action [B, action_dim],
        prev_reward [B] and episode_starts [B] bool (previous action/reward are zero at starts)."""
        parts = [obs.float()]
        keep = (~episode_starts).float().unsqueeze(-1)
        if self.use_prev_action:
            parts.append(encode_prev_action(self.action_space, prev_action) * keep)
        if self.use_prev_reward:
            parts.append(prev_reward.float().unsqueeze(-1) * keep)
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]

    def to_env_action(self, action: torch.Tensor) -> np.ndarray:
        """Stored actions [B, action_dim] -> env actions (``start`` added, Box clipped to its bounds)."""
        space = self.action_space
        if isinstance(space, spaces.Discrete):
            return (action[:, 0] + int(space.start)).cpu().numpy()
        if isinstance(space, spaces.MultiDiscrete):
            return (action + torch.as_tensor(space.start, device=action.device)).cpu().numpy()
        a = torch.maximum(torch.minimum(action, self._act_high), self._act_low)
        return a.cpu().numpy().astype(space.dtype).reshape((action.shape[0],) + space.shape)

    def host_log_std(self) -> torch.Tensor | None:
        """The Gaussian log-std on the host (actions are sampled there), None for discrete spaces."""
        actor = self.actor
        return actor.log_std.detach().cpu() if actor.kind == "gaussian" else None

    def fused_heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight [d_model, out_dim + 1], bias [out_dim + 1]): both heads as one GEMM, actor outputs
        first and the value last (the rollout applies them with one ``addmm`` per step)."""
        with torch.no_grad():
            w = torch.cat([self.actor.linear.weight, self.critic.linear.weight]).t().contiguous()
            bias = torch.cat([self.actor.linear.bias, self.critic.linear.bias])
        return w, bias

    # ---------------------------------------------------------------- acting
    def initial_state(self, batch: int) -> PolicyState:
        """Zero recurrent state and previous action/reward for ``batch`` envs."""
        return PolicyState(self.net.initial_state(batch),
                           torch.zeros(batch, self.action_dim,
                                       dtype=torch.int64 if self.discrete_actions else torch.float32),
                           torch.zeros(batch))

    def _stepper(self, batch: int):
        stepper = self._steppers.get(batch)
        if stepper is None:
            stepper = self._steppers[batch] = self.net.stepper(batch=batch)
        return stepper

    def _obs(self, obs: np.ndarray) -> tuple[torch.Tensor, bool]:
        x = torch.as_tensor(np.asarray(obs), dtype=torch.float32)
        single = x.dim() == 1
        if single:
            x = x.unsqueeze(0)
        if x.dim() != 2 or x.shape[1] != self.obs_dim:
            raise ValueError(f"predict: obs must be [B, {self.obs_dim}] (or [{self.obs_dim}]), got {tuple(x.shape)}")
        return x, single

    def _features(self, x: torch.Tensor, state: PolicyState, starts: torch.Tensor,
                  prev_reward: torch.Tensor) -> tuple[torch.Tensor, RecurrentState]:
        """One backbone step from ``state``: (features [B, d_model], the new recurrent state)."""
        stepper = self._stepper(x.shape[0])
        stepper.load_state(state.recurrent)
        inp = self.build_input(x, state.prev_action, prev_reward, starts)
        feat = stepper.step(inp.to(self.device), episode_starts=starts.to(self.device))
        return feat, stepper.get_state()

    @torch.no_grad()
    def act(self, obs: np.ndarray, state: PolicyState | None = None, episode_start: np.ndarray | None = None,
            deterministic: bool = False, reward: np.ndarray | None = None,
            generator: torch.Generator | None = None) -> tuple[np.ndarray, PolicyState, np.ndarray]:
        """One backbone step for a batch of observations: the action, the new state and the value.

        Args:
            obs: [B, obs_dim] (or [obs_dim] for one env) observations as the agent's env returns them.
            state: the PolicyState returned by the previous call, or None (fresh zeros).
            episode_start: [B] bool, True where ``obs`` is the first observation of an episode
                (memory reset for those rows). Default: all True when ``state`` is None, else False.
            deterministic: the mode of the action distribution instead of a sample.
            reward: [B] the reward received after the previous action; needed with ``prev_reward``.
            generator: the sampling generator (the agent's, for reproducible runs).

        Returns:
            (env actions: [B] / [B, k] / [B, *shape] numpy, or one action for single-env input;
            the new PolicyState; the critic values V(obs) [B] float32 numpy, from the same step).

        Raises:
            ValueError: wrong obs width, or a missing reward when ``prev_reward`` is on.
        """
        x, single = self._obs(obs)
        b = x.shape[0]
        if state is None:
            state = self.initial_state(b)
            starts = torch.ones(b, dtype=torch.bool)
        else:
            starts = torch.zeros(b, dtype=torch.bool)
        if episode_start is not None:
            starts = torch.as_tensor(np.asarray(episode_start, dtype=bool).reshape(b))
        if self.memoryless:
            starts = torch.ones_like(starts)
        prev_reward = state.prev_reward
        if self.use_prev_reward:
            if reward is None and not bool(starts.all()):
                raise ValueError("predict: this agent uses prev_reward; pass reward= (the last reward, [B])")
            if reward is not None:
                prev_reward = torch.as_tensor(np.asarray(reward, dtype=np.float32).reshape(b))
        feat, recurrent = self._features(x, state, starts, prev_reward)
        dist: ActionDist = self.actor.dist(self.actor.linear(feat).cpu(), self.host_log_std())  # sampled on the host
        value = self.critic(feat).cpu().numpy()
        action = dist.mode() if deterministic else dist.sample(generator)
        new_state = PolicyState(recurrent, action.clone(), prev_reward.clone())
        env_action = self.to_env_action(action)
        return (env_action[0] if single else env_action), new_state, value

    @torch.no_grad()
    def value(self, obs: np.ndarray, state: PolicyState, episode_start: np.ndarray,
              reward: np.ndarray | None = None) -> np.ndarray:
        """Critic value [B] of ``obs`` with ``state`` (the state is not advanced)."""
        x = torch.as_tensor(np.asarray(obs), dtype=torch.float32).reshape(-1, self.obs_dim)
        b = x.shape[0]
        starts = torch.as_tensor(np.asarray(episode_start, dtype=bool).reshape(b))
        if self.memoryless:
            starts = torch.ones_like(starts)
        prev_reward = state.prev_reward if reward is None else torch.as_tensor(
            np.asarray(reward, dtype=np.float32).reshape(b))
        feat, _ = self._features(x, state, starts, prev_reward)
        return self.critic(feat).cpu().numpy()
