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
"""

from __future__ import annotations

import torch

__all__ = ["RolloutBuffer"]


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
