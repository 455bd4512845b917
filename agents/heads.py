"""Actor and critic heads on backbone features, and the action distributions they produce.

Heads are single linear layers with CleanRL's orthogonal initialisation (actor gain 0.01,
critic gain 1, zero bias), as in CleanRL's ``ppo_atari_lstm.py``.

Action spaces:

* ``Discrete(n)``: categorical over n logits.
* ``MultiDiscrete(nvec)``: independent categoricals, log-probs and entropies summed.
* ``Box``: diagonal Gaussian, state-independent learned log-std (init 0), as CleanRL's
  ``ppo_continuous_action.py``; actions are clipped to the bounds only when sent to the env.

Sampling uses an explicit ``torch.Generator`` so that runs and resumed runs are reproducible.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from mamba_rl.envs import MAX_JOINT_ACTIONS, UnsupportedActionSpace

__all__ = ["ActionDist", "ActorHead", "CriticHead", "UnsupportedActionSpace", "action_dim", "action_input_dim",
           "action_set_size"]


def _check_action_space(space: spaces.Space) -> None:
    if isinstance(space, spaces.MultiDiscrete) and space.nvec.ndim != 1:
        raise UnsupportedActionSpace(f"MultiDiscrete action spaces must be 1-D, got nvec shape {space.nvec.shape}")
    if isinstance(space, spaces.MultiDiscrete) and (space.nvec.size == 0 or (space.nvec < 1).any()):
        raise UnsupportedActionSpace(f"MultiDiscrete action spaces need at least one component and every nvec "
                                     f">= 1, got nvec {space.nvec.tolist()}")
    if isinstance(space, spaces.Discrete) and int(space.n) < 1:
        raise UnsupportedActionSpace(f"Discrete action spaces need n >= 1, got n = {int(space.n)}")
    if not isinstance(space, (spaces.Discrete, spaces.MultiDiscrete, spaces.Box)):
        raise UnsupportedActionSpace(
            f"unsupported action space {space!r}; expected Discrete, MultiDiscrete or Box"
        )


def action_dim(space: spaces.Space) -> int:
    """Entries of one stored action: 1 (Discrete), len(nvec) (MultiDiscrete), prod(shape) (Box)."""
    _check_action_space(space)
    if isinstance(space, spaces.Discrete):
        return 1
    if isinstance(space, spaces.MultiDiscrete):
        return int(space.nvec.shape[0])
    return int(np.prod(space.shape))


def action_input_dim(space: spaces.Space) -> int:
    """Width of the previous-action input: n (one-hot), sum(nvec) (one-hots), prod(shape) (Box)."""
    _check_action_space(space)
    if isinstance(space, spaces.Discrete):
        return int(space.n)
    if isinstance(space, spaces.MultiDiscrete):
        return int(space.nvec.sum())
    return int(np.prod(space.shape))


def action_set_size(space: spaces.Space) -> int:
    """Outputs of the action-set head (``PPOConfig.action_set_coef``): n for Discrete(n), prod(nvec) (the joint
    actions) for a 1-D MultiDiscrete.

    Raises:
        ValueError: a Box action space (no set of actions to keep), or more than
            ``mamba_rl.envs.MAX_JOINT_ACTIONS`` joint actions.
    """
    _check_action_space(space)
    if isinstance(space, spaces.Box):
        raise ValueError(f"PPOConfig.action_set_coef: the action-set loss needs a Discrete or MultiDiscrete action "
                         f"space, got {' '.join(repr(space).split())}; use action_set_coef 0")
    k = int(space.n) if isinstance(space, spaces.Discrete) else int(np.prod(space.nvec))
    if k > MAX_JOINT_ACTIONS:
        raise ValueError(f"PPOConfig.action_set_coef: the action-set loss keeps one logit per joint action: expected "
                         f"at most {MAX_JOINT_ACTIONS}, got {k} for {' '.join(repr(space).split())}; use "
                         f"action_set_coef 0")
    return k


def _layer_init(layer: nn.Linear, gain: float, generator: torch.Generator | None) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, gain, generator=generator)
    nn.init.zeros_(layer.bias)
    return layer


class ActionDist:
    """A batch of action distributions (categorical / multi-categorical / diagonal Gaussian).

    All methods work on any leading shape ``S`` of the features the head was applied to.
    Stored actions have shape ``S + [action_dim]``: long for discrete spaces (zero-based: the
    space's ``start`` is added only for the env), float32 for Box.
    """

    def __init__(self, kind: str, params: tuple[torch.Tensor, ...], splits: tuple[int, ...] = ()):
        self.kind = kind
        self.params = params
        self.splits = splits
        self._logp_cache: list[torch.Tensor] | None = None

    def _logps(self) -> list[torch.Tensor]:
        """Log-softmax of each categorical, computed once per distribution (sampling, log_prob and
        entropy share it: one kernel less per use in the rollout graph and the update)."""
        if self._logp_cache is None:
            (logits,) = self.params
            if self.kind == "categorical":
                self._logp_cache = [torch.log_softmax(logits, dim=-1)]
            else:
                self._logp_cache = [torch.log_softmax(p, dim=-1) for p in torch.split(logits, list(self.splits), -1)]
        return self._logp_cache

    def log_prob(self, actions: torch.Tensor) -> torch.Tensor:
        """Log-probability [S] of ``actions`` [S, action_dim]."""
        if self.kind == "gaussian":
            mean, log_std = self.params
            z = (actions - mean) / log_std.exp()
            return (-0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        out = None
        for i, logp in enumerate(self._logps()):
            lp = logp.gather(-1, actions[..., i : i + 1].long()).squeeze(-1)
            out = lp if out is None else out + lp
        return out

    def log_prob_numpy(self, actions: np.ndarray) -> np.ndarray:
        """:meth:`log_prob` of CPU distributions for numpy actions [S, action_dim] (as :meth:`sample` gave
        them): float32 [S]. Categoricals index their log-softmax in numpy (the same floats as ``gather``, without
        four torch ops per rollout step); a Gaussian runs :meth:`log_prob`."""
        if self.kind == "gaussian" or self.params[0].device.type != "cpu":
            lp = self.log_prob(torch.as_tensor(actions, device=self.params[0].device))
            return (lp.detach() if lp.requires_grad else lp).cpu().numpy()
        logps = self._logps()
        rows = np.arange(actions.shape[0])
        out = None
        for i, logp in enumerate(logps):
            lp = (logp.detach() if logp.requires_grad else logp).numpy()[rows, actions[:, i]]  # no op in a rollout
            out = lp if out is None else out + lp
        return out

    def entropy(self) -> torch.Tensor:
        """Entropy [S] (nats)."""
        if self.kind == "gaussian":
            _, log_std = self.params
            return (log_std + 0.5 * math.log(2 * math.pi * math.e)).sum(-1)
        out = 0
        for logp in self._logps():
            out = out - (logp.exp() * logp).sum(-1)
        return out

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """One action [S, action_dim] per distribution: Gumbel-max for categoricals
        (argmax(logp + G), G = -log(-log U), U ~ Uniform[0, 1)), mean + std * N(0, 1) for a Gaussian.

        Draws from ``generator`` (None: the default generator of the params' device). No host sync and
        no allocation from host data, so a CUDA graph can capture it (torch's philox RNG advances per
        replay); the rollout calls this same function eagerly on the CPU and captured on CUDA."""
        if self.kind == "gaussian":
            mean, log_std = self.params
            noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
            return mean + log_std.exp() * noise
        outs = []
        for logp in self._logps():
            u = torch.rand(logp.shape, generator=generator, device=logp.device, dtype=logp.dtype)
            # e = log(Exponential(1)) = -Gumbel(0, 1); in place: fewer kernels, the same values as logp + G
            e = u.clamp_min_(1e-20).log_().neg_().clamp_min_(1e-20).log_()
            outs.append((logp - e).argmax(-1))
        return outs[0].unsqueeze(-1) if len(outs) == 1 else torch.stack(outs, dim=-1)

    def mode(self) -> torch.Tensor:
        """The most likely action [S, action_dim] (the mean for a Gaussian)."""
        if self.kind == "gaussian":
            return self.params[0]
        return torch.stack([logp.argmax(-1) for logp in self._logps()], dim=-1)


class ActorHead(nn.Module):
    """Policy head: features [..., d_model] f32 -> :class:`ActionDist`.

    Args:
        d_model: feature width.
        action_space: Discrete, MultiDiscrete (1-D) or Box.
        generator: RNG for the orthogonal init (None: torch's global RNG).

    Raises:
        TypeError: any other action space.
    """

    def __init__(self, d_model: int, action_space: spaces.Space, generator: torch.Generator | None = None):
        super().__init__()
        _check_action_space(action_space)
        self.action_space = action_space
        if isinstance(action_space, spaces.Discrete):
            self.kind, out, self.splits = "categorical", int(action_space.n), ()
        elif isinstance(action_space, spaces.MultiDiscrete):
            self.kind = "multicategorical"
            self.splits = tuple(int(n) for n in action_space.nvec)
            out = sum(self.splits)
        else:
            self.kind, out, self.splits = "gaussian", int(np.prod(action_space.shape)), ()
            self.log_std = nn.Parameter(torch.zeros(out))
        self.linear = _layer_init(nn.Linear(d_model, out), 0.01, generator)

    def log_std_floor(self, min_std: float) -> torch.Tensor | None:
        """The Gaussian's lowest ``log_std`` [action_dim] float32 for :attr:`PPOConfig.min_action_std`:
        ``log(min_std * (high - low) / 2)`` per action dimension (``log(min_std)`` where a bound is infinite;
        -inf for ``min_std`` 0). None for discrete actions."""
        if self.kind != "gaussian":
            return None
        low = np.asarray(self.action_space.low, dtype=np.float64).reshape(-1)
        high = np.asarray(self.action_space.high, dtype=np.float64).reshape(-1)
        half = np.where(np.isfinite(low) & np.isfinite(high), (high - low) / 2.0, 1.0)
        with np.errstate(divide="ignore"):
            floor = np.log(min_std * half)
        return torch.as_tensor(floor, dtype=torch.float32, device=self.log_std.device)

    @property
    def out_dim(self) -> int:
        """Width of the raw output: logits (sum of them for MultiDiscrete) or the Gaussian mean."""
        return self.linear.out_features

    def dist(self, raw: torch.Tensor, log_std: torch.Tensor | None = None) -> ActionDist:
        """The distribution of raw outputs ``raw`` [..., out_dim] (from ``self.linear``), on raw's device.

        ``log_std`` [action_dim] (Gaussian only) defaults to the parameter; pass a copy to build
        the distribution on another device (the rollout samples on the CPU).
        """
        if self.kind == "gaussian":
            ls = self.log_std if log_std is None else log_std
            return ActionDist("gaussian", (raw, ls.expand_as(raw)))
        return ActionDist(self.kind, (raw,), self.splits)

    def forward(self, features: torch.Tensor) -> ActionDist:
        return self.dist(self.linear(features))


class CriticHead(nn.Module):
    """Value head: features [..., d_model] f32 -> values [...] f32."""

    def __init__(self, d_model: int, generator: torch.Generator | None = None):
        super().__init__()
        self.linear = _layer_init(nn.Linear(d_model, 1), 1.0, generator)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features).squeeze(-1)
