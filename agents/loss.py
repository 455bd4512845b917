"""The PPO loss (Schulman et al. 2017, CleanRL's form) over the valid steps of a recurrent minibatch.

Every mean is over the valid steps only (``mask``): the NextStep reset step after a done is not a
transition (see :mod:`mamba_rl.agents.gae`) and carries no loss.

With the two-horizon critic (``PPOConfig.aux_gamma``) the minibatch also carries the aux critic's stored
values and returns, and the loss adds its value loss, of the main one's form (clipped per ``clip_vloss``,
weighted by ``vf_coef``): ``loss = pg - ent_coef * ent + vf_coef * v + vf_coef * v_aux``. The policy term
reads the minibatch's advantages, which the update has already mixed
(:func:`mamba_rl.agents.gae.combine_advantages`).

With the action-set loss (``PPOConfig.action_set_coef`` C > 0) the minibatch also carries, per step, the set of
actions already taken in its episode (:func:`action_set_targets`), and the loss adds
``C * action_set_loss`` (:func:`action_set_loss`) of the action-set head's logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import PPOConfig
from .heads import ActionDist

__all__ = ["Minibatch", "ppo_loss", "explained_variance", "masked_mean", "categorical_ppo_grads", "HeadGrads",
           "action_set_targets", "action_set_loss"]


@dataclass(frozen=True)
class Minibatch:
    """The stored rollout data of one minibatch of ``rows`` envs x T steps (the model is sb3-contrib's
    ``RecurrentRolloutBufferSamples``; the backbone inputs, starts and initial state go straight into
    the trainer's buffers instead).

    Attributes:
        actions: [rows, T, action_dim] float32 (stored form; discrete actions as whole numbers).
        logprobs, values, advantages, returns: [rows, T] float32, from the rollout (``advantages``: the
            policy's, mixed with the aux critic's when it is on).
        mask: [rows, T] float32, 1.0 at valid steps (0.0 at the NextStep reset step).
        aux_values, aux_returns: [rows, T] float32, the aux critic's stored values and GAE returns (the
            two-horizon critic, ``PPOConfig.aux_gamma``); None without it.
        set_target: [rows, T, K] bool, the actions already taken in each step's episode
            (:func:`action_set_targets`; the action-set loss, ``PPOConfig.action_set_coef``); None without it.
        set_known: [rows, T] float32, 1.0 at the valid steps whose episode began inside the rollout (whose
            set is known); None without the action-set loss.
    """

    actions: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    mask: torch.Tensor
    aux_values: torch.Tensor | None = None
    aux_returns: torch.Tensor | None = None
    set_target: torch.Tensor | None = None
    set_known: torch.Tensor | None = None


def masked_mean(x: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is 1; ``count`` = mask.sum() (>= 1)."""
    return (x * mask).sum() / count


def _minibatch_advantages(mb, mask: torch.Tensor, count: torch.Tensor, c, adv_norm) -> torch.Tensor:
    """The minibatch's advantages [rows, T] float32, normalised when ``c.norm_adv``: by the given global (mean, std)
    ``adv_norm`` (data-parallel), else by the minibatch's own masked mean and unbiased std (CleanRL's)."""
    mb_adv = mb.advantages
    if c.norm_adv and adv_norm is not None:
        mb_adv = (mb_adv - adv_norm[0]) / (adv_norm[1] + 1e-8)
    elif c.norm_adv:
        mean = masked_mean(mb_adv, mask, count)
        var = ((mb_adv - mean).pow(2) * mask).sum() / (count - 1).clamp_min(1.0)
        mb_adv = (mb_adv - mean) / (var.sqrt() + 1e-8)
    return mb_adv


def _value_loss(c: PPOConfig, newvalue: torch.Tensor, values: torch.Tensor, returns: torch.Tensor,
                mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """CleanRL's value loss (0-d): 0.5 * the masked mean of (V - R)^2, or with ``clip_vloss`` of
    max((V - R)^2, (V_old + clamp(V - V_old, -clip, clip) - R)^2)."""
    if c.clip_vloss:
        v_unclipped = (newvalue - returns).pow(2)
        v_clipped = values + (newvalue - values).clamp(-c.clip_coef, c.clip_coef)
        return 0.5 * masked_mean(torch.max(v_unclipped, (v_clipped - returns).pow(2)), mask, count)
    return 0.5 * masked_mean((newvalue - returns).pow(2), mask, count)


def _check_aux(mb: Minibatch, aux_newvalue: torch.Tensor | None, who: str) -> None:
    if (mb.aux_returns is None) != (aux_newvalue is None) or (mb.aux_returns is None) != (mb.aux_values is None):
        raise ValueError(f"{who}: the aux critic's values and the minibatch's aux_values / aux_returns go together "
                         f"(the two-horizon critic, PPOConfig.aux_gamma); got aux values "
                         f"{'given' if aux_newvalue is not None else 'None'}, minibatch aux_values "
                         f"{'given' if mb.aux_values is not None else 'None'}, aux_returns "
                         f"{'given' if mb.aux_returns is not None else 'None'}")


@torch.no_grad()
def action_set_targets(actions: torch.Tensor, starts: torch.Tensor, valid: torch.Tensor,
                       nvec: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The action-set loss's targets of a rollout (``PPOConfig.action_set_coef``): at each step t, the set of
    (joint) actions taken at the valid steps s < t of t's episode.

    Args:
        actions: [N, T, action_dim] stored actions (whole numbers, any real or integer dtype): one column for a
            Discrete space, one per component of a MultiDiscrete one (joint index: row-major, as
            :class:`mamba_rl.envs.JointAction` numbers them). Each in [0, nvec[i]): not checked (that would cost
            a device sync; the rollout's own actions always are).
        starts: [N, T] bool, True at an episode's first step.
        valid: [N, T] float32 (or bool), 1 at the steps that are transitions.
        nvec: the categoricals' sizes: (n,) for Discrete(n), the MultiDiscrete nvec.

    Returns:
        (target [N, T, K] bool, known [N, T] float32), K = prod(nvec): target[i, t, k] is True when joint action
        k was taken at a valid step of t's episode before t (False wherever known is 0); known is 1 at the valid
        steps whose episode began inside the window (an episode carried over from before it has an unknown history
        and no target).
        Capturable (no host sync).

    Raises:
        ValueError: ``starts`` not a bool [N, T] tensor, ``actions`` of another shape than [N, T, len(nvec)], or
            ``valid`` not [N, T].
    """
    if starts.dim() != 2 or starts.dtype != torch.bool:
        raise ValueError(f"action_set_targets: expected starts a bool [N, T] tensor, got {starts.dtype} "
                         f"{tuple(starts.shape)}")
    n, t = starts.shape
    if tuple(actions.shape) != (n, t, len(nvec)) or tuple(valid.shape) != (n, t):
        raise ValueError(f"action_set_targets: expected actions [{n}, {t}, {len(nvec)}] and valid [{n}, {t}] for "
                         f"starts [{n}, {t}], got actions {tuple(actions.shape)} and valid {tuple(valid.shape)}")
    a = actions.long()
    joint = a[..., 0]
    for i in range(1, len(nvec)):
        joint = joint * nvec[i] + a[..., i]
    k = int(np.prod(nvec))
    ok = valid > 0.5
    taken = (joint.unsqueeze(-1) == torch.arange(k, device=joint.device)) & ok.unsqueeze(-1)  # bool [N, T, K]
    # int32 counts (torch's integer cumsum is int64 by default): about 14 bytes per [N, T, K] element in all
    before = torch.zeros(n, t, k, dtype=torch.int32, device=joint.device)
    if t > 1:
        torch.cumsum(taken[:, :-1], 1, dtype=torch.int32, out=before[:, 1:])  # actions taken at s < t
    steps = torch.arange(t, device=starts.device).expand(n, t)
    first = torch.where(starts, steps, torch.full_like(steps, -1)).cummax(1).values  # t's episode's first step
    at_first = before.gather(1, first.clamp_min(0).unsqueeze(-1).expand(-1, -1, k))  # taken before the episode
    known = (first >= 0) & ok
    return before.gt_(at_first).bool() & known.unsqueeze(-1), known.float()


def action_set_loss(logits: torch.Tensor, target: torch.Tensor, known: torch.Tensor,
                    count: torch.Tensor | None = None) -> torch.Tensor:
    """The action-set loss (0-d): binary cross-entropy of the action-set head's ``logits`` [rows, T, K] against
    ``target`` [rows, T, K] (bool or 0/1 float, :func:`action_set_targets`), averaged over the K actions and then
    over the steps where ``known`` [rows, T] is 1. ``count`` (0-d, >= 1): the number of such steps (data-parallel:
    over every rank, so each rank's loss is its share of the global mean); None counts this minibatch's."""
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, target.to(logits.dtype),
                                                               reduction="none").mean(-1)
    return masked_mean(bce, known, known.sum().clamp_min(1.0) if count is None else count)


def ppo_loss(c: PPOConfig, dist: ActionDist, newvalue: torch.Tensor, mb: Minibatch, count: torch.Tensor,
             adv_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
             aux_newvalue: torch.Tensor | None = None, set_logits: torch.Tensor | None = None,
             set_count: torch.Tensor | None = None,
             set_coef: torch.Tensor | float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CleanRL's PPO loss on one minibatch, averaged over its valid steps (Schulman et al. 2017), plus the
    aux critic's value loss with the two-horizon critic and ``action_set_coef`` times the action-set loss with
    the action-set head.

    Args:
        c: the config (clip_coef, norm_adv, clip_vloss, ent_coef, vf_coef).
        dist: the actor's distributions [rows, T]. newvalue: critic values [rows, T].
        mb: the minibatch's stored rollout data and valid mask.
        count: number of valid steps (>= 1); data-parallel
            runs pass the count over every rank, so each rank's loss is its share of the global mean.
        adv_norm: (mean, std) 0-d tensors to normalise the advantages with (data-parallel: over every
            rank's minibatch); None computes them from this minibatch.
        aux_newvalue: the aux critic's values [rows, T] float32 (with ``mb.aux_values`` / ``mb.aux_returns``),
            or None without the two-horizon critic.
        set_logits: the action-set head's logits [rows, T, K] float32 (with ``mb.set_target`` / ``mb.set_known``),
            or None without the action-set loss. set_count: its step count (:func:`action_set_loss`). set_coef: its
            weight (a float or a 0-d tensor; None: ``c.action_set_coef``).

    Returns:
        (loss, stats): stats holds detached ``pg``, ``v``, ``ent``, ``kl``, ``old_kl``, ``clipfrac``
        and ``logratio`` (the new minus the stored log-probs, for the rollout-parity check); with the aux
        critic also ``aux_v`` (its value loss, before ``vf_coef``); with the action-set head ``set`` (its loss,
        before ``action_set_coef``).

    Raises:
        ValueError: ``aux_newvalue`` given without the minibatch's aux columns, or the other way round; the same
            for ``set_logits`` and the minibatch's set columns.
    """
    _check_aux(mb, aux_newvalue, "ppo_loss")
    if (set_logits is None) != (mb.set_target is None) or (mb.set_target is None) != (mb.set_known is None):
        raise ValueError(f"ppo_loss: the action-set head's logits and the minibatch's set_target / set_known go "
                         f"together (PPOConfig.action_set_coef); got logits "
                         f"{'given' if set_logits is not None else 'None'}, set_target "
                         f"{'given' if mb.set_target is not None else 'None'}, set_known "
                         f"{'given' if mb.set_known is not None else 'None'}")
    mask = mb.mask
    newlogprob = dist.log_prob(mb.actions)
    entropy = dist.entropy()
    logratio = newlogprob - mb.logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        old_approx_kl = masked_mean(-logratio, mask, count)
        approx_kl = masked_mean((ratio - 1) - logratio, mask, count)
        clipfrac = masked_mean(((ratio - 1.0).abs() > c.clip_coef).float(), mask, count)
    mb_adv = _minibatch_advantages(mb, mask, count, c, adv_norm)
    pg_loss = masked_mean(torch.max(-mb_adv * ratio, -mb_adv * ratio.clamp(1 - c.clip_coef, 1 + c.clip_coef)),
                           mask, count)
    v_loss = _value_loss(c, newvalue, mb.values, mb.returns, mask, count)
    entropy_loss = masked_mean(entropy, mask, count)
    loss = pg_loss - c.ent_coef * entropy_loss + v_loss * c.vf_coef
    stats = dict(pg=pg_loss.detach(), v=v_loss.detach(), ent=entropy_loss.detach(), kl=approx_kl,
                 old_kl=old_approx_kl, clipfrac=clipfrac, logratio=logratio.detach())
    if aux_newvalue is not None:  # the two-horizon critic: its value loss, of the same form and weight
        aux_v_loss = _value_loss(c, aux_newvalue, mb.aux_values, mb.aux_returns, mask, count)
        loss = loss + aux_v_loss * c.vf_coef
        stats["aux_v"] = aux_v_loss.detach()
    if set_logits is not None:  # the action-set loss (its own mean: over the steps whose set is known)
        set_loss = action_set_loss(set_logits, mb.set_target, mb.set_known, set_count)
        loss = loss + (c.action_set_coef if set_coef is None else set_coef) * set_loss
        stats["set"] = set_loss.detach()
    return loss, stats


@torch.no_grad()
def explained_variance(returns: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """1 - Var[returns - values] / Var[returns] over the valid steps (NaN when Var[returns] is 0)."""
    mask = valid.float()
    count = mask.sum().clamp_min(1.0)
    var_y = masked_mean((returns - masked_mean(returns, mask, count)).pow(2), mask, count)
    diff = returns - values
    var_d = masked_mean((diff - masked_mean(diff, mask, count)).pow(2), mask, count)
    return torch.where(var_y == 0, torch.full_like(var_y, float("nan")), 1 - var_d / var_y)


class HeadGrads:
    """What :func:`categorical_ppo_grads` returns: the PPO loss's gradients and statistics of one minibatch.

    Attributes:
        d_features: [rows * T, d_model] float32, dLoss/dfeatures (written into the caller's ``out`` when given).
        head_grads: the gradients of (actor weight [A, d], actor bias [A], critic weight [1, d], critic bias
            [1]), float32, in that order; with the aux critic then (aux weight [1, d], aux bias [1]).
        stats: detached ``pg``, ``v``, ``ent``, ``kl``, ``old_kl``, ``clipfrac``, ``logratio`` (and ``aux_v``)
            as :func:`ppo_loss` gives them. newvalue: [rows, T] float32 critic values (detached).
        aux_newvalue: [rows, T] float32 aux critic values (detached), None without the aux critic.
    """

    __slots__ = ("d_features", "head_grads", "stats", "newvalue", "aux_newvalue")

    def __init__(self, d_features, head_grads, stats, newvalue, aux_newvalue=None):
        self.d_features, self.head_grads, self.stats, self.newvalue = d_features, head_grads, stats, newvalue
        self.aux_newvalue = aux_newvalue


def _max_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """autograd's backward of ``torch.max(a, b)`` (aten ``max.other``): ties split the gradient in halves."""
    tie = torch.where(a == b, grad / 2, grad)
    return tie.masked_fill(a < b, 0), tie.masked_fill_(a > b, 0)


def _clamp_backward(grad: torch.Tensor, x: torch.Tensor, clamped: torch.Tensor) -> torch.Tensor:
    """autograd's backward of ``clamped = x.clamp(lo, hi)``: the gradient where lo <= x <= hi, else +0.
    ``clamped == x`` is that very condition (inside the bounds, the bounds included, clamp returns x itself;
    outside it returns a bound other than x; NaN compares unequal, as it fails lo <= x), one op for three."""
    return torch.where(clamped == x, grad, 0.0)


class _ValueTerms:
    """One critic's value-loss pieces for the hand-written backward (the main and the aux critic alike):
    ``d_u = V - R`` and its square, and with ``clip_vloss`` CleanRL's clipped branch ``e = V_old + clamp(V - V_old,
    -c, c) - R`` and its square; the same ops, in the same order, as :func:`ppo_loss`'s autograd graph."""

    def __init__(self, newvalue, returns, values, clip: bool, cc: float):
        self.d_u = newvalue - returns
        self.unclipped = self.d_u.pow(2)
        self.clip = clip
        if clip:
            self.q_in = newvalue - values
            self.q = self.q_in.clamp(-cc, cc)
            self.e = values + self.q - returns
            self.clipped = self.e.pow(2)

    def loss_terms(self) -> torch.Tensor:
        """[rows, T] float32: the squared errors the value loss averages."""
        return torch.max(self.unclipped, self.clipped) if self.clip else self.unclipped

    def backward(self, g: torch.Tensor) -> torch.Tensor:
        """dLoss/dV [rows, T] from ``g``, the gradient reaching :meth:`loss_terms`'s elements."""
        if not self.clip:
            return g * (self.d_u * 2.0)
        g_u, g_c = _max_backward(g, self.unclipped, self.clipped)
        return g_u * (self.d_u * 2.0) + _clamp_backward(g_c * (self.e * 2.0), self.q_in, self.q)


@torch.no_grad()
def categorical_ppo_grads(c: PPOConfig, features: torch.Tensor, actor: torch.nn.Linear, critic: torch.nn.Linear,
                          mb: Minibatch, count: torch.Tensor, adv_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
                          out: torch.Tensor | None = None, losses: bool = True,
                          aux_critic: torch.nn.Linear | None = None) -> HeadGrads:
    """:func:`ppo_loss` of a categorical actor and the critic on ``features``, with its gradients written out
    by hand instead of by autograd: the same forward ops as ``actor(features)``, ``critic(features)`` and
    :func:`ppo_loss`, and, in the order autograd's engine runs them, the very backward formulas of its nodes
    (addmm, log_softmax, gather, exp, clamp, max with halved gradients at ties, pow, the masked means), so
    every gradient is bit for bit what ``torch.autograd.grad(loss, [features, *head params])`` gives
    (``tests/agents/test_host_path.py`` compares them over random minibatches with ties and clipped
    ratios). It builds no autograd graph: about half the ops of the forward + backward and none of the
    engine's per-node work, the host cost of a CPU minibatch. With the two-horizon critic (``aux_critic``)
    the aux value loss and its gradients come in too, bit for bit those of :func:`ppo_loss` with
    ``aux_newvalue = aux_critic(features)`` computed after ``critic(features)``.

    Args:
        c: the config (clip_coef, norm_adv, clip_vloss, ent_coef, vf_coef).
        features: [rows, T, d_model] float32, contiguous (the backbone's output).
        actor: the actor head's Linear (d_model -> number of actions). critic: the critic's Linear (-> 1).
        mb: the minibatch (actions [rows, T, 1] as whole numbers). count, adv_norm: as :func:`ppo_loss`.
        out: optional float32 [rows * T, d_model] buffer the feature gradient is written into.
        losses: compute the loss values and KL estimates for the statistics (``pg``, ``v``, ``ent``, ``kl``,
            ``old_kl``, ``aux_v``); False leaves them out of ``stats`` (the gradients need none of them; an update
            reads them from some minibatches only). ``clipfrac`` and ``logratio`` are always there.
        aux_critic: the aux critic's Linear (-> 1) with the two-horizon critic (the minibatch then carries
            ``aux_values`` / ``aux_returns``), else None.

    Returns:
        :class:`HeadGrads`.

    Raises:
        ValueError: features that are not a contiguous float32 [rows, T, d_model] of the heads' width, a
            minibatch of another shape, or an ``aux_critic`` without the minibatch's aux columns (or the
            other way round).
    """
    if features.dim() != 3 or features.dtype != torch.float32 or not features.is_contiguous() \
            or features.shape[2] != actor.in_features or critic.out_features != 1:
        raise ValueError(f"categorical_ppo_grads: features must be contiguous float32 [rows, T, "
                         f"{actor.in_features}] and the critic one output, got {features.dtype} "
                         f"{list(features.shape)} (contiguous={features.is_contiguous()}), critic out "
                         f"{critic.out_features}")
    rows, t_len, d = features.shape
    if mb.mask.shape != (rows, t_len) or mb.actions.shape[:2] != (rows, t_len):
        raise ValueError(f"categorical_ppo_grads: the minibatch must be [{rows}, {t_len}] like the features, got "
                         f"mask {list(mb.mask.shape)}, actions {list(mb.actions.shape)}")
    _check_aux(mb, None if aux_critic is None else features, "categorical_ppo_grads")
    if aux_critic is not None and (aux_critic.out_features != 1 or aux_critic.in_features != d):
        raise ValueError(f"categorical_ppo_grads: the aux critic must map {d} features to 1 value, got "
                         f"{aux_critic.in_features} -> {aux_critic.out_features}")
    n_act = actor.out_features
    wa, ba, wc, bc = actor.weight, actor.bias, critic.weight, critic.bias
    mask = mb.mask
    cc = c.clip_coef
    # ---- forward: F.linear on a contiguous 3-D input is addmm over the rows, viewed back
    y2 = features.view(rows * t_len, d)
    logits = torch.addmm(ba, y2, wa.t()).view(rows, t_len, n_act)
    newvalue = torch.addmm(bc, y2, wc.t()).view(rows, t_len, 1).squeeze(-1)
    aux_newvalue = None if aux_critic is None else \
        torch.addmm(aux_critic.bias, y2, aux_critic.weight.t()).view(rows, t_len, 1).squeeze(-1)
    logp = torch.log_softmax(logits, dim=-1)
    index = mb.actions[..., 0:1].long()
    newlogprob = logp.gather(-1, index).squeeze(-1)
    p = logp.exp()
    entropy = torch.rsub((p * logp).sum(-1), 0)  # ActionDist.entropy: 0 - sum(p log p)
    logratio = newlogprob - mb.logprobs
    ratio = logratio.exp()
    clipfrac = masked_mean(((ratio - 1.0).abs() > cc).float(), mask, count)
    stats = dict(clipfrac=clipfrac, logratio=logratio)
    if losses:
        stats.update(old_kl=masked_mean(-logratio, mask, count), kl=masked_mean((ratio - 1) - logratio, mask, count))
    mb_adv = _minibatch_advantages(mb, mask, count, c, adv_norm)
    neg_adv = -mb_adv
    ratio_c = ratio.clamp(1 - cc, 1 + cc)
    pg_a, pg_b = neg_adv * ratio, neg_adv * ratio_c
    vt = _ValueTerms(newvalue, mb.returns, mb.values, c.clip_vloss, cc)
    # the aux critic's value loss: the same ops on its own columns
    at = _ValueTerms(aux_newvalue, mb.aux_returns, mb.aux_values, c.clip_vloss, cc) if aux_newvalue is not None \
        else None
    if losses:
        stats["pg"] = masked_mean(torch.max(pg_a, pg_b), mask, count)
        stats["v"] = 0.5 * masked_mean(vt.loss_terms(), mask, count)
        stats["ent"] = masked_mean(entropy, mask, count)
        if at is not None:
            stats["aux_v"] = 0.5 * masked_mean(at.loss_terms(), mask, count)
    # ---- backward, node by node (loss = pg - ent_coef * ent + vf_coef * v; d loss = 1). The 0-d factors in
    # float32 numpy scalars (IEEE single, as torch's 0-d float32 ops round them), applied as python floats
    # (exact float32 values, so mask * s rounds as mask * a float32 tensor of s would)
    one, cnt = np.float32(1.0), np.float32(count.item())
    g_pgm = mask * float(one / cnt)
    g_a, g_b = _max_backward(g_pgm, pg_a, pg_b)
    g_ratio = g_a * neg_adv + _clamp_backward(g_b * neg_adv, ratio, ratio_c)
    g_newlogprob = g_ratio * ratio
    g_ent = -one * np.float32(c.ent_coef)
    g_pl = (mask * float(-(g_ent / cnt))).unsqueeze(-1).expand(rows, t_len, n_act)  # rsub's -grad, folded in
    g_p = g_pl * logp
    # logp's three gradients arrive as autograd's engine runs their nodes: p * logp (its logp side), exp, gather
    g_logp = g_pl * p + g_p * p + logp.new_zeros(logp.shape).scatter_add_(-1, index, g_newlogprob.unsqueeze(-1))
    g_logits = torch._log_softmax_backward_data(g_logp, logp, -1, torch.float32).view(rows * t_len, n_act)
    g_vmean = one * np.float32(c.vf_coef) * np.float32(0.5)
    g_vm = mask * float(g_vmean / cnt)
    g_value = vt.backward(g_vm).unsqueeze(-1).view(rows * t_len, 1)
    head_grads = (g_logits.t().mm(y2), g_logits.sum(0, keepdim=True).view(n_act),
                  g_value.t().mm(y2), g_value.sum(0, keepdim=True).view(1))
    if aux_newvalue is None:
        if out is None:
            d_features = torch.add(g_logits.mm(wa), g_value.mm(wc))
        else:
            d_features = torch.add(g_logits.mm(wa), g_value.mm(wc), out=out)
        return HeadGrads(d_features, head_grads, stats, newvalue)
    # the aux value loss enters the loss with the same weight (vf_coef * 0.5 / count) as the main one
    g_aux = at.backward(g_vm).unsqueeze(-1).view(rows * t_len, 1)
    head_grads += (g_aux.t().mm(y2), g_aux.sum(0, keepdim=True).view(1))
    # dLoss/dfeatures in the order autograd's engine accumulates the three heads' contributions
    d_features = torch.add(torch.add(g_aux.mm(aux_critic.weight), g_value.mm(wc)), g_logits.mm(wa), out=out)
    return HeadGrads(d_features, head_grads, stats, newvalue, aux_newvalue)
