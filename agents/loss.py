"""The PPO loss (Schulman et al. 2017, CleanRL's form) over the valid steps of a recurrent minibatch.

Every mean is over the valid steps only (``mask``): the NextStep reset step after a done is not a
transition (see :mod:`mamba_rl.agents.gae`) and carries no loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import PPOConfig
from .heads import ActionDist

__all__ = ["Minibatch", "ppo_loss", "explained_variance", "masked_mean"]


@dataclass(frozen=True)
class Minibatch:
    """The stored rollout data of one minibatch of ``rows`` envs x T steps (the model is sb3-contrib's
    ``RecurrentRolloutBufferSamples``; the backbone inputs, starts and initial state go straight into
    the trainer's buffers instead).

    Attributes:
        actions: [rows, T, action_dim] float32 (stored form; discrete actions as whole numbers).
        logprobs, values, advantages, returns: [rows, T] float32, from the rollout.
        mask: [rows, T] float32, 1.0 at valid steps (0.0 at the NextStep reset step).
    """

    actions: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    mask: torch.Tensor


def masked_mean(x: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is 1; ``count`` = mask.sum() (>= 1)."""
    return (x * mask).sum() / count


def ppo_loss(c: PPOConfig, dist: ActionDist, newvalue: torch.Tensor, mb: Minibatch, count: torch.Tensor,
             adv_norm: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CleanRL's PPO loss on one minibatch, averaged over its valid steps.

    Args:
        c: the config (clip_coef, norm_adv, clip_vloss, ent_coef, vf_coef).
        dist: the actor's distributions [rows, T]. newvalue: critic values [rows, T].
        mb: the minibatch's stored rollout data and valid mask.
        count: number of valid steps (>= 1); data-parallel
            runs pass the count over every rank, so each rank's loss is its share of the global mean.
        adv_norm: (mean, std) 0-d tensors to normalise the advantages with (data-parallel: over every
            rank's minibatch); None computes them from this minibatch.

    Returns:
        (loss, stats): stats holds detached ``pg``, ``v``, ``ent``, ``kl``, ``old_kl``, ``clipfrac``
        and ``logratio`` (the new minus the stored log-probs, for the rollout-parity check).
    """
    mask = mb.mask
    newlogprob = dist.log_prob(mb.actions)
    entropy = dist.entropy()
    logratio = newlogprob - mb.logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        old_approx_kl = masked_mean(-logratio, mask, count)
        approx_kl = masked_mean((ratio - 1) - logratio, mask, count)
        clipfrac = masked_mean(((ratio - 1.0).abs() > c.clip_coef).float(), mask, count)
    mb_adv = mb.advantages
    if c.norm_adv and adv_norm is not None:
        mb_adv = (mb_adv - adv_norm[0]) / (adv_norm[1] + 1e-8)
    elif c.norm_adv:
        mean = masked_mean(mb_adv, mask, count)
        var = ((mb_adv - mean).pow(2) * mask).sum() / (count - 1).clamp_min(1.0)
        mb_adv = (mb_adv - mean) / (var.sqrt() + 1e-8)
    pg_loss = masked_mean(torch.max(-mb_adv * ratio, -mb_adv * ratio.clamp(1 - c.clip_coef, 1 + c.clip_coef)),
                           mask, count)
    if c.clip_vloss:
        v_unclipped = (newvalue - mb.returns).pow(2)
        v_clipped = mb.values + (newvalue - mb.values).clamp(-c.clip_coef, c.clip_coef)
        v_loss = 0.5 * masked_mean(torch.max(v_unclipped, (v_clipped - mb.returns).pow(2)), mask, count)
    else:
        v_loss = 0.5 * masked_mean((newvalue - mb.returns).pow(2), mask, count)
    entropy_loss = masked_mean(entropy, mask, count)
    loss = pg_loss - c.ent_coef * entropy_loss + v_loss * c.vf_coef
    return loss, dict(pg=pg_loss.detach(), v=v_loss.detach(), ent=entropy_loss.detach(), kl=approx_kl,
                      old_kl=old_approx_kl, clipfrac=clipfrac, logratio=logratio.detach())


@torch.no_grad()
def explained_variance(returns: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """1 - Var[returns - values] / Var[returns] over the valid steps (NaN when Var[returns] is 0)."""
    mask = valid.float()
    count = mask.sum().clamp_min(1.0)
    var_y = masked_mean((returns - masked_mean(returns, mask, count)).pow(2), mask, count)
    diff = returns - values
    var_d = masked_mean((diff - masked_mean(diff, mask, count)).pow(2), mask, count)
    return torch.where(var_y == 0, torch.full_like(var_y, float("nan")), 1 - var_d / var_y)
