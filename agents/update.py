"""The PPO update (Schulman et al. 2017, CleanRL's recurrent form): epochs of fixed-shape minibatches.

One minibatch step (:meth:`PPOUpdate._minibatch`) is three phases, run eagerly on the CPU and captured as
ONE CUDA graph on the GPU (docs/architecture.md, "Agent loop", step 3):

1. gather (:meth:`PPOUpdate._mb_gather`): the minibatch's envs are row ``k`` of a device permutation
   (``perm``, ``mb_index``), and ``index_select`` writes their inputs, episode starts and stored initial
   state straight into the trainer's static buffers, and their actions / log-probs / values / advantages /
   returns / valid flags (one packed tensor) into a temporary;
2. backprop (:meth:`PPOUpdate._mb_backprop`): ``trainer.forward_body()``, the heads,
   :func:`~mamba_rl.agents.loss.ppo_loss` (advantages normalised per minibatch over its valid steps),
   autograd for dLoss/dfeatures and the head grads, ``trainer.backprop_body()`` (the backbone backward
   into its gradient arena);
3. step (:meth:`PPOUpdate._mb_step`): ``trainer.optimizer_body()``: one global clip over heads + backbone
   (the heads' squared norm goes in ``extra_sq_buf``), AdamW, the f16 scaler; the head optimizer with the
   same clip factor, skipped exactly when the backbone step was skipped (a NaN / inf gradient: an f16
   overflow, or a non-finite loss in any dtype): :class:`~mamba_rl.agents.head_optim.FlatHeadAdam`'s
   device step on CUDA (no sync), its host step on the CPU (where reading the flag costs nothing; a
   ``torch.optim.Adam`` over the heads works too); the step's metrics go to row ``k`` of a device table
   (eagerly, the rollout parity only in an update's first minibatch, the only one read); ``mb_index += 1``.

The host reads the table once per update (one sync), plus once per epoch but the last when ``target_kl`` is set
(the default).

Two-horizon critic (``PPOConfig.aux_gamma``): the packed columns also hold the aux critic's stored values and
returns, the loss adds its value loss (:func:`~mamba_rl.agents.loss.ppo_loss`, the hand-written
:func:`~mamba_rl.agents.loss.categorical_ppo_grads` on the CPU), and the advantage column is the mixed one:
when the rollout is loaded (eagerly, once per update) the main and aux GAE advantages are combined, added in the
reward's units (:func:`~mamba_rl.agents.gae.add_advantages`, ``aux_adv_add``) or mixed with the stds of the whole
rollout (:func:`~mamba_rl.agents.gae.combine_advantages`; data-parallel: of every rank's rollout, one all-reduce
of five sums), before any minibatch reads them.

Action-set loss (``PPOConfig.action_set_coef``): when the rollout is loaded the set of actions already taken in each
step's episode is computed once (:func:`~mamba_rl.agents.loss.action_set_targets`, a bool [N, T, K] buffer the
gather reads like the packed columns), and phase 2 adds the action-set head's loss
(:func:`~mamba_rl.agents.loss.action_set_loss`) through autograd (the hand-written CPU gradients cover the fused
heads only, so the CPU takes autograd's path with it; data-parallel: the count of its steps joins ``stat_buf``).

The body reads the config :meth:`PPOUpdate.run` was given (the agent's current one); a captured graph
holds the loss coefficients it was captured with, so a run with other coefficients recaptures first.

Data-parallel (a :class:`~mamba_rl.agents.distributed.DataParallel`): phase 2 uses the count and advantage
statistics of every rank's minibatch (phase 1 leaves this rank's sums in ``stat_buf``; one all-reduce), and
phase 3 steps with the backbone's gradient arena and the heads' flat gradient summed over the ranks (phase 2
packs both in ``comm``; ONE all-reduce). On CUDA each phase is its own graph and the two all-reduces run
eagerly between the replays: no collective is ever captured (capturing NCCL's all-reduce inside one
minibatch graph hung on 2 H200s, torch 2.11), and the replays are bit-identical to the eager minibatch. The
table is summed over ranks once per update; explained variance stays per rank (rank 0's is logged).
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import torch

from mamba_rl import MambaTrainer
from mamba_rl.graphs import GraphSet, capture_restoring, snapshot
from mamba_rl.ops.optim import CLIP_COEF, FOUND_INF, GRAD_NORM, LOSS_SCALE

from .config import PPOConfig
from .distributed import DataParallel
from .gae import add_advantages, advantage_moments, combine_advantages
from .head_optim import FlatHeadAdam
from .loss import Minibatch, action_set_targets, categorical_ppo_grads, explained_variance, ppo_loss
from .policy import Policy
from .rollout import RolloutBuffer, check_aux
from .tags import ACTION_SET_LOSS, AUX_METRICS, UPDATE_METRICS

__all__ = ["PPOUpdate", "METRIC_NAMES", "AUX_METRIC_NAMES"]

# the fields that fix the update's shapes (fixed for the PPOUpdate's life) and those the minibatch body reads
_LAYOUT = ("num_envs", "num_steps", "num_minibatches", "update_epochs")
_LOSS = ("clip_coef", "clip_vloss", "ent_coef", "vf_coef", "norm_adv", "max_grad_norm")

# per-minibatch metric columns of the device table (aux_v: the aux critic's value loss, 0 without it; set: the
# action-set loss, 0 without it)
# kl_stop: the step was skipped by PPOConfig.max_minibatch_kl; skipped: by a NaN / inf gradient (not a KL stop)
_COLS = ("v", "pg", "ent", "kl", "old_kl", "aux_v", "set", "clipfrac", "kl_stop", "grad_norm", "skipped", "parity")
METRIC_NAMES = UPDATE_METRICS  # the names of what run() returns, in order
AUX_METRIC_NAMES = AUX_METRICS  # and after them with the two-horizon critic


def _kl_limit(limit: float | None) -> float:
    """PPOConfig.max_minibatch_kl as the device limit's value (inf: off)."""
    return math.inf if limit is None else float(limit)


def _flag_nonfinite_heads(grad_arena: torch.Tensor, head_sq: torch.Tensor) -> None:
    """A NaN / inf head gradient (``head_sq``: its squared norm, 0-d) makes the backbone gradient non-finite
    too (one element set to NaN, a select: no sync, capturable), so that the trainer's found_inf check,
    which reads the backbone arena alone, skips the whole step: a non-finite update is never applied
    (the agent sets the trainer's skip-on-overflow flag in every dtype)."""
    grad_arena[:1].add_(torch.where(torch.isfinite(head_sq), 0.0, float("nan")).to(grad_arena.dtype))


class PPOUpdate:
    """PPO epochs over a rollout buffer, one body per minibatch (captured on CUDA).

    Args:
        config: the agent's config: its layout (num_envs, num_steps, num_minibatches, update_epochs)
            fixes the buffers; :meth:`run` takes the then-current config.
        policy: the policy (heads trained here; the backbone is the trainer's).
        trainer: the backbone's :class:`~mamba_rl.MambaTrainer` (batch ``envs_per_minibatch``, T steps),
            set to skip every step with a non-finite gradient (RecurrentPPO sets its skip-on-overflow flag):
            a step it skipped (``found_inf``) skips the heads too.
        head_optimizer: the heads' Adam: a :class:`~mamba_rl.agents.head_optim.FlatHeadAdam` (needed to
            capture) or a ``torch.optim.Adam`` over ``policy.heads``.
        buffer: the rollout buffer the update reads (any device; copied in once per update).
        dp: the data-parallel collectives when this is one rank of several, else None.
        capture: capture the minibatch body as a CUDA graph.

    Raises:
        ValueError: ``capture`` on a non-CUDA policy or with a head optimizer that is not a FlatHeadAdam; a
            config whose ``aux_gamma`` (the two-horizon critic) disagrees with the policy's aux critic or the
            buffer's aux storage; a config whose ``action_set_coef`` (> 0 or 0) disagrees with the policy's
            action-set head.
    """

    def __init__(self, config: PPOConfig, policy: Policy, trainer: MambaTrainer,
                 head_optimizer: torch.optim.Optimizer, buffer: RolloutBuffer, dp: DataParallel | None = None,
                 capture: bool = False):
        c, p = config, policy
        self.flat_heads = isinstance(head_optimizer, FlatHeadAdam)
        # the heads step on the device (FlatHeadAdam.flat_step: no sync, capturable) on CUDA; on the CPU a
        # FlatHeadAdam steps with host-side bias corrections (host_step: torch.optim.Adam's arithmetic)
        self.device_heads = self.flat_heads and bool(head_optimizer.defaults["capturable"])
        self.device = dev = policy.device
        if capture and (dev.type != "cuda" or not self.flat_heads):
            raise ValueError(f"PPOUpdate: capture needs a CUDA policy and a FlatHeadAdam, got device {dev} and "
                             f"{type(head_optimizer).__name__}")
        self._config = config
        self.trainer, self.head_optimizer, self.buffer, self.dp = trainer, head_optimizer, buffer, dp
        self.actor, self.critic, self.aux_critic = p.actor, p.critic, p.aux_critic
        check_aux(p, buffer, c.aux_gamma, c.aux_gae_lambda, "PPOUpdate")  # the two-horizon critic: all or nothing
        self.aux = c.aux_gamma is not None
        self.set_head = p.action_set  # the action-set loss (PPOConfig.action_set_coef): all or nothing
        if (self.set_head is not None) != (c.action_set_coef > 0):
            raise ValueError(f"PPOUpdate: action_set_coef {c.action_set_coef!r} needs a policy "
                             f"{'with' if c.action_set_coef > 0 else 'without'} an action-set head, got one "
                             f"{'with' if self.set_head is not None else 'without'}")
        self.head_params = list(p.heads.parameters())
        # eager CPU minibatches of a categorical actor take the heads' gradients from categorical_ppo_grads
        # (exactly autograd's); CUDA keeps autograd, inside the captured body or not
        lin = [x for layer in p.fused_linears() for x in (layer.weight, layer.bias)]
        self._hand_grads = dev.type == "cpu" and self.actor.kind == "categorical" \
            and len(self.head_params) == len(lin) and all(q is r for q, r in zip(self.head_params, lin))
        sizes = [q.numel() for q in self.head_params]
        self._grad_spans = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
        n, t = c.num_envs, c.num_steps
        self.action_dim = a = p.action_dim
        # packed per-step columns: actions (a) | logprob | value | advantage | return | valid (| aux value | aux
        # return); the advantage is the policy's (mixed with the aux critic's when it is on)
        self.inputs = torch.zeros(n, t, p.input_dim, device=dev)
        self.starts = torch.zeros(n, t, dtype=torch.bool, device=dev)
        self.pack = torch.zeros(n, t, a + (7 if self.aux else 5), device=dev)
        self.init_state = p.net.initial_state(n)
        if self.set_head is not None:  # the rollout's action sets (action_set_targets), computed once per update
            self.set_nvec = self.actor.splits or (self.actor.out_dim,)
            self.set_target = torch.zeros(n, t, self.set_head.out_features, dtype=torch.bool, device=dev)
            self.set_known = torch.zeros(n, t, device=dev)
            # the loss's weight, a device scalar the captured graph reads (run() sets it: no recapture)
            self.set_coef = torch.full((), c.action_set_coef, device=dev)
        else:
            self.set_target = self.set_known = self.set_coef = None
        self.max_steps = c.update_epochs * c.num_minibatches
        # Box actions: the log_std floor of config.min_action_std, applied after every head step (a buffer the
        # captured graph reads, refreshed by run() from the config it is given)
        self.log_std_floor = self.actor.log_std_floor(c.min_action_std)  # on the heads' device; None: discrete
        self._floor_of = c.min_action_std  # the fraction log_std_floor holds
        self.perm = torch.zeros(self.max_steps, c.envs_per_minibatch, dtype=torch.int64, device=dev)
        self._perm_host = torch.zeros(self.max_steps, c.envs_per_minibatch, dtype=torch.int64,
                                      pin_memory=dev.type == "cuda")
        self.mb_index = torch.zeros(1, dtype=torch.int64, device=dev)
        self.table = torch.zeros(self.max_steps, len(_COLS), device=dev)
        # PPOConfig.max_minibatch_kl as a device scalar the captured graph reads (inf: off; refreshed by run()),
        # and the flag that a minibatch of this update exceeded it (every later step of the update is skipped)
        self.kl_limit = torch.full((), _kl_limit(c.max_minibatch_kl), device=dev)
        self._kl_limit_of = c.max_minibatch_kl
        self.kl_stopped = torch.zeros((), dtype=torch.bool, device=dev)
        n_heads = sum(q.numel() for q in self.head_params)
        # data-parallel: [backbone gradient arena | head gradient | approx_kl share], summed over ranks by one
        # all-reduce (every rank then takes the same max_minibatch_kl decision)
        self.comm = torch.zeros(p.net.grad_arena.numel() + n_heads + 1, device=dev) if dp is not None else None
        # data-parallel: this rank's [sum adv, sum adv^2, valid count (, action-set steps)] of the minibatch, summed
        # over ranks
        self.stat_buf = (torch.zeros(3 if self.set_head is None else 4, dtype=torch.float64, device=dev)
                         if dp is not None else None)
        self._graphs = GraphSet("PPOUpdate", self._graph_buffers)
        self._capture = capture
        # the eager CPU body computes what run() reads of a minibatch's metrics row only: the rollout parity in
        # an update's first minibatch, the losses and KL estimates in an epoch's last one (always, when captured)
        self._parity_row = self._loss_row = True
        self._captured_loss: tuple | None = None  # the loss fields of the config the graph was captured with
        self.capture_error: str | None = None  # why a data-parallel capture fell back to eager minibatches
        if capture:
            self._capture_minibatch()

    @staticmethod
    def _fields(config: PPOConfig, names: tuple[str, ...]) -> tuple:
        return tuple(getattr(config, k) for k in names)

    def _capture_minibatch(self) -> None:
        """Capture the body (every rank or none in a data-parallel run; see :meth:`_fallback`)."""
        self._captured_loss = self._fields(self._config, _LOSS)
        if self.dp is None:
            self.capture()
            return
        err = None
        try:
            self.capture()
        except RuntimeError as e:
            err = e
        failed = torch.tensor([float(err is not None)], device=self.device)
        if float(self.dp.sum_(failed)) > 0:  # every rank captures, or none does
            self._fallback(err if err is not None else RuntimeError("another rank's capture failed"))

    # ------------------------------------------------------------------------------------ the body
    def _minibatch(self) -> None:
        """One minibatch step, eagerly (or as the one graph of a single-process run): the three phases, with
        the data-parallel all-reduces between them."""
        self._mb_gather()
        if self.dp is not None:
            self.dp.sum_(self.stat_buf)
        self._mb_backprop()
        if self.dp is not None:
            self.dp.reduce_grads(self.comm)
        self._mb_step()

    def _mb_gather(self) -> None:
        """Phase 1: the minibatch's envs into the trainer's static buffers and ``self._mb``; data-parallel:
        this rank's advantage sums into ``stat_buf`` (summed over the ranks before phase 2)."""
        tr, a = self.trainer, self.action_dim
        rows = self.perm.index_select(0, self.mb_index).view(-1)
        torch.index_select(self.inputs, 0, rows, out=tr.x_buf)
        torch.index_select(self.starts, 0, rows, out=tr.starts_buf)
        torch.index_select(self.init_state.conv, 1, rows, out=tr.state.conv)
        torch.index_select(self.init_state.ssm, 1, rows, out=tr.state.ssm)
        pk = self.pack.index_select(0, rows)
        aux = dict(aux_values=pk[..., a + 5], aux_returns=pk[..., a + 6]) if self.aux else {}
        if self.set_head is not None:
            aux.update(set_target=self.set_target.index_select(0, rows), set_known=self.set_known.index_select(0, rows))
        self._mb = mb = Minibatch(actions=pk[..., :a], logprobs=pk[..., a], values=pk[..., a + 1],
                                  advantages=pk[..., a + 2], returns=pk[..., a + 3], mask=pk[..., a + 4], **aux)
        if self.dp is not None:
            self.stat_buf[:3].copy_(DataParallel.minibatch_sums(mb.advantages, mb.mask))
            if self.set_head is not None:
                self.stat_buf[3:].copy_(mb.set_known.double().sum())

    def _mb_backprop(self) -> None:
        """Phase 2: backbone forward, heads, PPO loss, the heads' gradient and the backbone's backprop into
        its gradient arena; data-parallel: [gradient arena | head gradient] packed into ``comm`` (summed
        over the ranks before phase 3)."""
        c, tr, mb, dp = self._config, self.trainer, self._mb, self.dp
        if dp is not None:  # global count and advantage statistics over every rank's minibatch
            count, mean, std = DataParallel.finish_stats(self.stat_buf[:3])
            adv_norm = (mean, std)
            set_count = self.stat_buf[3].clamp_min(1.0).float() if self.set_head is not None else None
        else:
            count, adv_norm, set_count = mb.mask.sum().clamp_min(1.0), None, None
        feat = tr.forward_body()
        # a hook or a frozen head parameter (requires_grad False) is autograd's to handle: the hand path computes
        # every head gradient and would step a frozen parameter that the autograd path refuses to differentiate
        hand = self._hand_grads and feat.dtype == torch.float32 and feat.is_contiguous() and \
            all(not q._backward_hooks and q.requires_grad for q in self.head_params)
        if hand:  # the CPU: the heads' loss and its gradients by hand, bit for bit autograd's (no graph, half the ops)
            d_out = tr.d_buf.view(-1, tr.d_buf.shape[-1]) if tr.d_buf.dtype == torch.float32 and \
                tr.d_buf.is_contiguous() else None
            hg = categorical_ppo_grads(c, feat.detach(), self.actor.linear, self.critic.linear, mb, count, adv_norm,
                                       out=d_out, losses=self._loss_row or c.max_minibatch_kl is not None,
                                       aux_critic=self.aux_critic.linear if self.aux else None)
            if d_out is None:
                tr.d_buf.copy_(hg.d_features.view_as(tr.d_buf))
            head_grads, st, newvalue, aux_newvalue = hg.head_grads, hg.stats, hg.newvalue, hg.aux_newvalue
            flat = torch.cat([g.reshape(-1) for g in head_grads])
            if dp is None:  # the squared norm as below (x * x is pow(x, 2)'s own kernel; a slice sums as its tensor)
                sq = flat * flat
                tr.extra_sq_buf.copy_(torch.stack([sq[i:j].sum() for i, j in self._grad_spans]).sum())
        else:
            y = feat.detach().float().requires_grad_()
            dist = self.actor(y)
            newvalue = self.critic(y)
            aux_newvalue = self.aux_critic(y) if self.aux else None  # after the critic (categorical_ppo_grads' order)
            set_logits = self.set_head(y) if self.set_head is not None else None
            loss, st = ppo_loss(c, dist, newvalue, mb, count, adv_norm, aux_newvalue, set_logits, set_count,
                                self.set_coef)
            grads = torch.autograd.grad(loss, [y] + self.head_params)
            head_grads = grads[1:]
            tr.d_buf.copy_(grads[0])
            flat = torch.cat([g.reshape(-1) for g in head_grads]) if self.flat_heads or dp is not None else None
            if dp is None:
                if self.device_heads:
                    tr.extra_sq_buf.copy_(flat.square().sum())
                else:
                    tr.extra_sq_buf.copy_(torch.stack([g.pow(2).sum() for g in head_grads]).sum())
        tr.backprop_body()
        if dp is not None:
            nb = tr.net.grad_arena.numel()
            self.comm[:nb].copy_(tr.net.grad_arena)
            self.comm[nb:-1].copy_(flat)
            if "kl" in st:
                self.comm[-1:].copy_(st["kl"])
            else:  # not computed: max_minibatch_kl is off
                self.comm[-1:].zero_()
        # detached: a kept autograd graph would keep the heads' AccumulateGrad nodes (and the stream they
        # were made on) alive into the next capture
        self._phase2 = (flat, head_grads, {k: v.detach() for k, v in st.items()}, newvalue.detach(),
                        aux_newvalue.detach() if aux_newvalue is not None else None)

    def _mb_step(self) -> None:
        """Phase 3: (data-parallel: the summed gradients back from ``comm``) the global clip, AdamW, the
        scaler, the heads' optimizer with the same clip factor, the metrics row; ``mb_index += 1``."""
        c, tr, mb = self._config, self.trainer, self._mb
        flat, head_grads, st, newvalue, aux_newvalue = self._phase2
        arena = tr.net.grad_arena
        kl = st.get("kl")
        if self.dp is not None:  # the heads step with the summed gradient
            nb = arena.numel()
            arena.copy_(self.comm[:nb])
            flat = self.comm[nb:-1]
            kl = self.comm[-1]  # approx_kl of the whole minibatch (every rank's share summed)
            tr.extra_sq_buf.copy_(flat.square().sum())
        # max_minibatch_kl: from the first minibatch whose approx_kl exceeds the limit every step of the update is
        # skipped, through the trainer's non-finite skip (a NaN head norm: weights, moments and the step count
        # stay; the heads skip with it); a select, no sync. Off (an inf limit) it passes everything through.
        stop = self.kl_stopped | (kl > self.kl_limit) if kl is not None else self.kl_stopped
        self.kl_stopped.copy_(stop)
        tr.extra_sq_buf.copy_(torch.where(stop, float("nan"), tr.extra_sq_buf))
        scaler = tr.scaler
        if scaler.enabled:  # a KL stop is no overflow: the f16 loss scale and its growth count stay as they were
            kept = (scaler.scale.clone(), scaler.growth_tracker.clone())
        if self.device.type == "cpu":  # reading the squared norm is free here: flag only a non-finite one
            if not math.isfinite(tr.extra_sq_buf.item()):
                arena[:1].add_(float("nan"))
        else:
            _flag_nonfinite_heads(arena, tr.extra_sq_buf)
        tr.optimizer_body()
        s = tr.scalars
        if scaler.enabled:
            scaler.scale.copy_(torch.where(stop, kept[0], scaler.scale))
            scaler.growth_tracker.copy_(torch.where(stop, kept[1], scaler.growth_tracker))
            s[LOSS_SCALE] = scaler.scale[0]
        skip = s[FOUND_INF] > 0  # the trainer skipped its step (the agent makes it skip every non-finite one)
        if self.device_heads:
            self.head_optimizer.flat_step(flat, self.head_optimizer.lr_t, s[CLIP_COEF], skip)
        elif bool(skip):  # CPU: reading the flag is free; a skipped step skips the heads too
            pass
        elif self.flat_heads:  # one host-side Adam step over the heads' flat arena
            self.head_optimizer.host_step(flat, s[CLIP_COEF].to(flat.dtype) if c.max_grad_norm is not None else None)
        else:
            if flat is not None:  # the summed gradient, back into per-parameter views
                head_grads = torch.split(flat, [p.numel() for p in self.head_params])
            for p, g in zip(self.head_params, head_grads):
                g = g.view_as(p)
                p.grad = g * s[CLIP_COEF].to(g.dtype) if c.max_grad_norm is not None else g
            self.head_optimizer.step()
        if self.log_std_floor is not None:  # the Gaussian's std never below config.min_action_std (a projection)
            self.actor.log_std.data.clamp_(min=self.log_std_floor)
        mask = mb.mask
        with torch.no_grad():
            if self._parity_row:
                parity = torch.maximum((st["logratio"].abs() * mask).max(),
                                       ((newvalue - mb.values).abs() * mask).max())
                if aux_newvalue is not None:  # the aux critic's values too
                    parity = torch.maximum(parity, ((aux_newvalue - mb.aux_values).abs() * mask).max())
            else:  # run() reads the parity of an update's first minibatch only
                parity = st["clipfrac"].new_zeros(())
            zero = st["clipfrac"].new_zeros(())  # losses not computed in this (eager) minibatch: not read
            row = torch.stack([st.get(k, zero) for k in ("v", "pg", "ent", "kl", "old_kl", "aux_v", "set")] +
                              [st["clipfrac"], stop.float(), s[GRAD_NORM].float(), (skip & ~stop).float(), parity])
            self.table.index_copy_(0, self.mb_index, row.unsqueeze(0))
            self.mb_index.add_(1)

    def _replay_minibatch(self) -> bool:
        """Replay the captured minibatch: one graph, or (data-parallel) the three phases' graphs with the two
        all-reduces run eagerly between them. False when nothing is captured."""
        g = self._graphs
        if g.replay("minibatch"):
            return True
        if not g.replay("gather"):
            return False
        self.dp.sum_(self.stat_buf)
        g.replay("backprop", check=False)
        self.dp.reduce_grads(self.comm)
        g.replay("step", check=False)
        return True

    def _head_state(self) -> tuple:
        opt = self.head_optimizer
        return (opt.param_arena, opt.exp_avg, opt.exp_avg_sq, opt.step_t, opt.lr_t) if self.flat_heads else ()

    def _graph_buffers(self) -> tuple:
        return self.trainer.graph_buffers() + self._head_state() + (
            self.comm, self.stat_buf, self.inputs, self.starts, self.pack, self.init_state.conv, self.init_state.ssm, self.perm,
            self.mb_index, self.table, self.log_std_floor, self.kl_limit, self.kl_stopped, self.set_target,
            self.set_known, self.set_coef)

    def capture(self, warmup: int = 3) -> None:
        """Capture the minibatch as CUDA graphs: one graph of :meth:`_minibatch` on one process; with data
        parallelism three (gather, backprop, step), the all-reduces running eagerly between their replays.
        Every buffer the capture changes is restored afterwards.

        Raises:
            RuntimeError: not on CUDA, or the head optimizer is not a :class:`FlatHeadAdam`.
        """
        if self.device.type != "cuda" or not self.flat_heads:
            raise RuntimeError("PPOUpdate.capture needs a CUDA policy whose head optimizer is a FlatHeadAdam")
        saved = self.trainer.snapshot() + snapshot((self.table, self.mb_index, self.kl_stopped) +
                                                   self._head_state()[:4])
        if self.dp is None:
            bodies = {"minibatch": self._minibatch}
        else:  # no collective inside a graph: the all-reduces run eagerly between the phases' graphs
            bodies = {"gather": self._mb_gather, "backprop": self._mb_backprop, "step": self._mb_step}
        # data-parallel: thread-local capture mode, so NCCL's watchdog thread may poll events meanwhile
        capture_restoring(self._graphs, bodies, saved, warmup, warmup_body=self._run_eager_once,
                          mode="thread_local" if self.dp is not None else "global")

    def _fallback(self, err: Exception) -> None:
        """Data-parallel capture failed: run the minibatch body eagerly (same numbers, one launch per
        kernel). Every rank must agree, or their collectives would not match: a rank whose capture
        failed makes every rank fall back (one all-reduce of the failure flags)."""
        self._graphs.clear()
        torch.cuda.synchronize()
        self.capture_error = f"{type(err).__name__}: {err}"
        warnings.warn(f"PPOUpdate: capturing the data-parallel minibatch failed ({self.capture_error}); "
                      "running it eagerly", RuntimeWarning, stacklevel=3)

    def _run_eager_once(self) -> None:
        self.mb_index.zero_()
        self._minibatch()

    # ------------------------------------------------------------------------------------ the update
    def _load_rollout(self) -> None:
        """The buffer into the update's device tensors; with the two-horizon critic the advantage column becomes
        the policy's advantage (:func:`~mamba_rl.agents.gae.add_advantages`, or with ``aux_adv_add=None``
        :func:`~mamba_rl.agents.gae.combine_advantages` with the stds over every rank's rollout)."""
        buf, a = self.buffer, self.action_dim
        with torch.no_grad():
            dev = self.device
            self.inputs.copy_(buf.inputs, non_blocking=True)
            self.starts.copy_(buf.episode_starts, non_blocking=True)
            self.init_state.copy_(buf.initial_state)
            keys = ("logprobs", "values", "advantages", "returns", "valid") + (
                ("aux_values", "aux_returns") if self.aux else ())
            cols = [buf.actions.to(dev, torch.float32, non_blocking=True)] + [
                getattr(buf, k).to(dev, torch.float32, non_blocking=True).unsqueeze(-1) for k in keys]
            torch.cat(cols, dim=-1, out=self.pack)
            if self.aux:
                adv, valid = self.pack[..., a + 2], self.pack[..., a + 4] > 0.5
                aux_adv = buf.aux_advantages.to(dev, torch.float32, non_blocking=True)
                if self._config.aux_adv_add is not None:  # in the reward's units: nothing to share between ranks
                    adv.copy_(add_advantages(adv, aux_adv, valid, self._config.aux_adv_add))
                else:
                    moments = advantage_moments(adv, aux_adv, valid)
                    if self.dp is not None:  # the stds of all ranks' rollouts, as one process with every env
                        self.dp.sum_(moments)
                    adv.copy_(combine_advantages(adv, aux_adv, valid, self._config.aux_adv_weight, moments))
            if self.set_head is not None:
                target, known = action_set_targets(self.pack[..., :a], self.starts, self.pack[..., a + 4],
                                                   self.set_nvec)
                self.set_target.copy_(target)
                self.set_known.copy_(known)
            self.mb_index.zero_()

    def _epoch_stop(self, c: PPOConfig, row: int) -> bool:
        """Whether the update ends after the epoch whose last minibatch is ``row``: its approx_kl (over every
        rank: each holds its share) above ``target_kl``, or a ``max_minibatch_kl`` stop (the same on every
        rank). One device->host read, none when neither is set."""
        if c.target_kl is None and c.max_minibatch_kl is None:
            return False
        kl = self.table[row, _COLS.index("kl")].clone()
        if self.dp is not None:
            self.dp.sum_(kl)
        kl, stopped = torch.stack([kl, self.kl_stopped.float()]).tolist()
        return stopped > 0.5 or (c.target_kl is not None and kl > c.target_kl)

    def run(self, config: PPOConfig, draw_rows: Callable[[], torch.Tensor], set_scale: float = 1.0) -> dict[str, float]:
        """``update_epochs`` x ``num_minibatches`` minibatch steps over the buffer.

        Args:
            config: the agent's current config (its layout must be the one this update was built for;
                other loss coefficients than the captured graph's recapture it first).
            draw_rows: called once at the start of each epoch; returns that epoch's minibatches, int64
                [num_minibatches, envs_per_minibatch], row k the envs of minibatch k (the agent draws a
                permutation of its envs: :func:`mamba_rl.agents.distributed.shard_permutation`).
            set_scale: the action-set loss's weight is ``config.action_set_coef * set_scale`` in this update (the
                agent's ``anneal_action_set``); a device scalar, so a captured update is not recaptured for it.

        Returns:
            the update's metrics as floats, named :data:`METRIC_NAMES`: the losses of the last step,
            clipfrac averaged over all steps, grad_norm averaged over the steps not skipped (0 when all
            were), the loss scale after the update, the number of skipped f16 steps and the rollout
            parity of the first step; with the two-horizon critic then :data:`AUX_METRIC_NAMES` (the aux
            critic's value loss of the last step and its explained variance), and with the action-set loss
            :data:`~mamba_rl.agents.tags.ACTION_SET_LOSS` (the last step's). One device->host read (plus one
            per epoch but the last with ``target_kl``).

        Raises:
            ValueError: a config of another layout (the aux critic's presence included), an ``action_set_coef``
                > 0 for an update built without the action-set head (with it, any weight >= 0 is taken: a
                schedule may end at 0), or rows of the wrong shape.
        """
        if self._fields(config, _LAYOUT) != self._fields(self._config, _LAYOUT):
            want, got = (dict(zip(_LAYOUT, self._fields(x, _LAYOUT))) for x in (self._config, config))
            raise ValueError(f"PPOUpdate.run: expected a config with {want}, got {got}")
        if (config.aux_gamma is not None) != self.aux:
            raise ValueError(f"PPOUpdate.run: this update was built {'with' if self.aux else 'without'} the aux critic "
                             f"(aux_gamma {self._config.aux_gamma!r}); expected a config with aux_gamma "
                             f"{'a number' if self.aux else 'None'}, got {config.aux_gamma!r}")
        if config.action_set_coef > 0 and self.set_head is None:  # with the head, 0 only weighs its loss out
            raise ValueError(f"PPOUpdate.run: this update was built without the action-set head; expected a config "
                             f"with action_set_coef 0, got {config.action_set_coef!r}")
        self._config = c = config
        if self.set_coef is not None:
            self.set_coef.fill_(c.action_set_coef * float(set_scale))
        if self.log_std_floor is not None and c.min_action_std != self._floor_of:
            self.log_std_floor.copy_(self.actor.log_std_floor(c.min_action_std))
            self._floor_of = c.min_action_std
        if c.max_minibatch_kl != self._kl_limit_of:
            self.kl_limit.fill_(_kl_limit(c.max_minibatch_kl))
            self._kl_limit_of = c.max_minibatch_kl
        if self._capture and self._captured_loss != self._fields(config, _LOSS):
            self._capture_minibatch()
        self._load_rollout()
        self.kl_stopped.zero_()
        m = c.num_minibatches
        # the CPU ends the update at a max_minibatch_kl stop (reading the flag is free there); CUDA skips the
        # remaining steps on the device and ends at the next epoch boundary's read
        host_stop = self.device.type == "cpu" and c.max_minibatch_kl is not None
        done = 0
        for epoch in range(c.update_epochs):
            rows = draw_rows()
            if tuple(rows.shape) != (m, c.envs_per_minibatch) or rows.dtype != torch.int64:
                raise ValueError(f"PPOUpdate.run: draw_rows() must give int64 [{m}, {c.envs_per_minibatch}], "
                                 f"got {rows.dtype} {tuple(rows.shape)}")
            self._perm_host[epoch * m:(epoch + 1) * m].copy_(rows)
            self.perm[epoch * m:(epoch + 1) * m].copy_(self._perm_host[epoch * m:(epoch + 1) * m], non_blocking=True)
            for _ in range(m):
                if not self._replay_minibatch():
                    # eager: only the first minibatch's parity and each epoch's last losses / KL are read
                    self._parity_row, self._loss_row = done == 0, done % m == m - 1
                    try:
                        self._minibatch()
                    finally:
                        self._parity_row = self._loss_row = True
                done += 1
                if host_stop and bool(self.kl_stopped):
                    break
            # after the last epoch there is nothing left to stop: no read (the host sync) there
            if epoch + 1 < c.update_epochs and self._epoch_stop(c, done - 1):
                break
        a = self.action_dim
        if self.dp is not None:  # losses are each rank's share of the global mean: sum them (one call)
            self.dp.sum_(self.table[:done])
            self.table[:done, len(_COLS) - 4:].div_(self.dp.world)  # kl_stop .. skipped: equal; parity: mean
        with torch.no_grad():
            valid = self.pack[..., a + 4] > 0.5
            ev = explained_variance(self.pack[..., a + 3], self.pack[..., a + 1], valid)
            tail = [ev.float(), self.trainer.scalars[LOSS_SCALE].float()]
            if self.aux:  # the aux critic's explained variance, of its own returns
                tail.append(explained_variance(self.pack[..., a + 6], self.pack[..., a + 5], valid).float())
            host = torch.cat([self.table[:done].reshape(-1), torch.stack(tail)]).cpu().numpy()  # the one sync
        host, tail = host[:-len(tail)], host[-len(tail):]
        tab = host.reshape(done, len(_COLS))
        col = {k: tab[:, i] for i, k in enumerate(_COLS)}
        ok = (col["skipped"] < 0.5) & (col["kl_stop"] < 0.5)  # the steps taken
        last = tab[-1]
        # every planned step of the update that a max_minibatch_kl stop left untaken: the stopped rows run (CUDA
        # runs the rest of the epoch on the device) and those never run (the CPU ends at the stop, CUDA at the
        # epoch's end), so both count the same
        kl_stopped = col["kl_stop"].sum() + (self.max_steps - done if col["kl_stop"].any() else 0)
        vals = [last[0], last[1], last[2], last[3], last[4], col["clipfrac"].mean(), tail[0],
                col["grad_norm"][ok].mean() if ok.any() else 0.0, tail[1], col["skipped"].sum(),
                kl_stopped, col["parity"][0]]
        out = {k: float(v) for k, v in zip(METRIC_NAMES, vals)}
        if self.aux:  # the aux critic's value loss (the last step's, as value_loss) and explained variance
            out.update(zip(AUX_METRIC_NAMES, (float(last[_COLS.index("aux_v")]), float(tail[2]))))
        if self.set_head is not None:
            out[ACTION_SET_LOSS] = float(last[_COLS.index("set")])
        return out
