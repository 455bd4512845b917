"""GPU acting: one CUDA graph replay per env step, rollout storage on the device.

Per step (:meth:`GraphActor.act`) the host has written the backbone input and the episode-start flag
into a pinned staging buffer (:class:`~mamba_rl.agents.policy.HostStager`); then ONE graph replay

1. copies the stage to the device (captured from the pinned buffer),
2. runs the backbone step (the stepper's body, on the stepper's live state),
3. the heads as one GEMM, samples the action on the device (Gumbel-max / Gaussian,
   :meth:`~mamba_rl.agents.heads.ActionDist.sample` with torch's philox RNG, which a graph replays
   with a fresh offset each time), its log-prob and the value (and the aux critic's value with the
   two-horizon critic, ``PPOConfig.aux_gamma``),
4. writes the stage and [action | log-prob | value (| aux value)] into device storage at column ``t`` (a
   device step counter, advanced inside the graph),
5. copies the action into a pinned host buffer;

and the host waits on one event before reading the action. Rewards and done flags stay in pinned host
arrays until the rollout ends; then one more replay (:meth:`GraphActor.finish`) copies them over,
computes V(next obs) with the carried state without advancing it (the stepper's state is saved and
restored inside the graph: exact V(final obs) after a done, as the eager path), runs GAE
(:func:`~mamba_rl.agents.gae.compute_gae_parallel`; with the aux critic a second GAE of its values at
aux_gamma / aux_gae_lambda) and fills the device :class:`~mamba_rl.agents.rollout.RolloutBuffer`. If this torch/driver cannot capture host copies
(probed once), they run as async copies right before / after the replay instead.

With ``parts`` (row ranges of an env stack that steps in parts, :mod:`mamba_rl.envs.parts`) there is one act
graph per part, each on its own rows (its own contiguous recurrent state, copied from the stepper's rows at
:meth:`GraphActor.begin` and back at the start of the finish graph; its own step counter), so that the rollout
acts on one half while the other half's envs step.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from mamba_rl import Stepper
from mamba_rl.graphs import GraphSet, capture_restoring, snapshot

from .gae import compute_gae_parallel, gae_discount_matrix
from .policy import HostStager, Policy
from .rollout import RolloutBuffer, check_aux, check_parts, join_state, split_state

__all__ = ["GraphActor", "host_copies_capturable"]

_PROBED: dict = {}


def host_copies_capturable(device: torch.device) -> bool:
    """Whether a CUDA graph on ``device`` can capture pinned host->device and device->host copies
    (checked once per device by capturing, replaying and comparing a tiny graph)."""
    key = str(device)
    if key not in _PROBED:
        try:
            src = torch.zeros(4, pin_memory=True)
            dst = torch.zeros(4, pin_memory=True)
            d = torch.zeros(4, device=device)
            g = torch.cuda.CUDAGraph()
            torch.cuda.synchronize(device)
            with torch.cuda.graph(g):
                d.copy_(src, non_blocking=True)
                d.mul_(2.0)
                dst.copy_(d, non_blocking=True)
            src.copy_(torch.arange(4.0))
            g.replay()
            torch.cuda.synchronize(device)
            _PROBED[key] = bool(torch.equal(dst, torch.arange(4.0) * 2))
        except Exception:  # any capture error: fall back to copies around the replay
            torch.cuda.synchronize(device)
            _PROBED[key] = False
    return _PROBED[key]


class GraphActor:
    """One-graph-per-step acting for a CUDA rollout (see the module doc); captures its graphs when built.

    Args:
        policy: the CUDA policy (heads, input layout). stepper: its stepper of batch N (the rollout's state).
        buffer: the device :class:`~mamba_rl.agents.rollout.RolloutBuffer` of N envs x T steps to fill.
        gamma, gae_lambda: GAE's discount and lambda (baked into the finish graph).
        capture_copies: capture the host copies in the graphs (None: :func:`host_copies_capturable`).
        parts: None (one act graph over all N rows), or the row ranges of the parts (``slice`` objects, in order,
            non-empty, covering ``[0, N)``): one act graph per part, :meth:`act` with ``part``.
        aux_gamma, aux_gae_lambda: the two-horizon critic's GAE discount and lambda (baked into the finish
            graph), given exactly when the policy has an aux critic and the buffer stores its values (None: off).

    Attributes:
        parts: the row ranges (one: ``(slice(0, N),)``). stager: the [N] stage's
            :class:`~mamba_rl.agents.policy.HostStager`; stagers: one per part, over its rows of the same stage.

    Raises:
        ValueError: a policy that is not on a CUDA device, a buffer that does not live there, parts that are
            not consecutive non-empty row ranges covering the N rows, or an ``aux_gamma`` that disagrees with the
            policy's aux critic or the buffer's aux storage.
    """

    def __init__(self, policy: Policy, stepper: Stepper, buffer: RolloutBuffer, gamma: float, gae_lambda: float,
                 capture_copies: bool | None = None, parts: tuple[slice, ...] | None = None,
                 aux_gamma: float | None = None, aux_gae_lambda: float = 0.65):
        dev = policy.device
        if dev.type != "cuda":
            raise ValueError(f"GraphActor: expected a policy on a CUDA device, got {dev}")
        if buffer.inputs.device.type != "cuda":
            raise ValueError(f"GraphActor: expected a RolloutBuffer stored on {dev}, got {buffer.inputs.device}")
        self.policy, self.stepper, self.buffer = policy, stepper, buffer
        self.gamma, self.gae_lambda = gamma, gae_lambda
        self.aux_gamma, self.aux_gae_lambda = check_aux(policy, buffer, aux_gamma, aux_gae_lambda, "GraphActor")
        self.v = policy.value_heads  # value columns after the actor's: 1, or 2 with the aux critic
        n, t = buffer.num_envs, buffer.num_steps
        self.n, self.t_len, self.d, self.a, self.p_dim = n, t, policy.input_dim, policy.action_dim, policy.actor.out_dim
        self.parts = check_parts(parts, n, "GraphActor")
        act_dtype = torch.int64 if policy.discrete_actions else torch.float32
        # host side (pinned)
        self.stage_t = torch.zeros(n, self.d + 1, pin_memory=True)
        self.stager = HostStager(policy, self.stage_t.numpy())
        self.stagers = tuple(HostStager(policy, self.stage_t.numpy()[r]) for r in self.parts)
        self.act_pin = torch.zeros(n, self.a, dtype=act_dtype, pin_memory=True)
        self.act_np = self.act_pin.numpy()
        self.res_pin = torch.zeros(4, n, t, pin_memory=True)  # reward | terminated | truncated | valid
        self.env_arrays = tuple(self.res_pin.numpy())
        # device side
        self.dstage = torch.zeros(n, self.d + 1, device=dev)
        self.res_dev = torch.zeros(4, n, t, device=dev)
        # per step: input | start | action | logprob | value (| aux value)
        self.hist = torch.zeros(n, t, self.d + self.a + 2 + self.v, device=dev)
        self.t_idx = torch.zeros(len(self.parts), dtype=torch.int64, device=dev)  # per part
        self.act_dev = torch.zeros(n, self.a, dtype=act_dtype, device=dev)
        self.w_cat = torch.zeros(self.p_dim + self.v, policy.net.cfg.d_model, device=dev)
        self.b_cat = torch.zeros(self.p_dim + self.v, device=dev)
        self.saved = stepper.state.clone()
        # the states the act graphs advance: the stepper's own (one part), or one contiguous state per part
        self.part_states = (stepper.state,) if len(self.parts) == 1 else tuple(
            policy.net.initial_state(r.stop - r.start) for r in self.parts)
        self._own_states = self.part_states if len(self.parts) > 1 else ()
        self.discount = gae_discount_matrix(t, gamma, gae_lambda, dev)
        self.aux_discount = (gae_discount_matrix(t, self.aux_gamma, self.aux_gae_lambda, dev)
                             if self.aux_gamma is not None else None)
        self.event = torch.cuda.Event()
        self.copies_in_graph = host_copies_capturable(dev) if capture_copies is None else capture_copies
        net, st, heads = policy.net, stepper.state, policy.heads
        self._graphs = GraphSet("GraphActor", lambda: (net.arena, net.compute_arena, st.conv, st.ssm, self.dstage,
                                                       self.hist, self.t_idx, self.res_dev,
                                                       self.w_cat, self.b_cat, self.saved.conv, self.saved.ssm,
                                                       *(x for ps in self._own_states for x in (ps.conv, ps.ssm)),
                                                       *heads.parameters()))
        self._capture()

    # ------------------------------------------------------------------------------------ bodies
    def _heads(self, dstage: torch.Tensor, state) -> torch.Tensor:
        """[rows, P + V] actor raw outputs | value (| aux value) of the staged rows ``dstage`` (advances ``state``)."""
        d = self.d
        feat = self.policy.net.step(dstage[:, :d], state, dstage[:, d] > 0.5)
        return torch.addmm(self.b_cat, feat, self.w_cat.t())

    def _act_body(self, part: int) -> None:
        rows, t_idx = self.parts[part], self.t_idx[part:part + 1]
        dstage = self.dstage[rows]
        if self.copies_in_graph:
            dstage.copy_(self.stage_t[rows], non_blocking=True)
        out = self._heads(dstage, self.part_states[part])
        dist = self.policy.actor.dist(out[:, : self.p_dim])
        action = dist.sample()
        row = torch.cat([dstage, action, dist.log_prob(action).unsqueeze(1), out[:, self.p_dim:]], dim=1)
        self.hist[rows].index_copy_(1, t_idx, row.unsqueeze(1))  # one kernel: cat promotes the action to float
        t_idx.add_(1)
        if self.copies_in_graph:
            self.act_pin[rows].copy_(action, non_blocking=True)
        else:
            self.act_dev[rows].copy_(action)

    def _finish_body(self) -> None:
        buf, d, a = self.buffer, self.d, self.a
        state = self.stepper.state
        join_state(state, self.parts, self.part_states)  # the parts' states back into the stepper's rows
        if self.copies_in_graph:
            self.dstage.copy_(self.stage_t, non_blocking=True)
            self.res_dev.copy_(self.res_pin, non_blocking=True)
        self.saved.copy_(state)
        out = self._heads(self.dstage, state)
        next_value = out[:, self.p_dim]
        state.copy_(self.saved)
        rewards, flags = self.res_dev[0], self.res_dev[1:] > 0.5
        h = self.hist
        values = h[..., d + a + 2]
        adv, ret = compute_gae_parallel(rewards, values, flags[0], flags[1], flags[2], next_value, self.gamma,
                                        self.gae_lambda, self.discount, check=False)
        if self.aux_gamma is not None:  # the aux critic: its own values, bootstrap, discount and lambda
            aux_values = h[..., d + a + 3]
            aux_adv, aux_ret = compute_gae_parallel(rewards, aux_values, flags[0], flags[1], flags[2],
                                                    out[:, self.p_dim + 1], self.aux_gamma, self.aux_gae_lambda,
                                                    self.aux_discount, check=False)
            buf.aux_values.copy_(aux_values)
            buf.aux_advantages.copy_(aux_adv)
            buf.aux_returns.copy_(aux_ret)
        buf.inputs.copy_(h[..., :d])
        buf.episode_starts.copy_(h[..., d] > 0.5)
        buf.actions.copy_(h[..., d + 1:d + 1 + a])
        buf.logprobs.copy_(h[..., d + 1 + a])
        buf.values.copy_(values)
        buf.rewards.copy_(rewards)
        buf.terminations.copy_(flags[0])
        buf.truncations.copy_(flags[1])
        buf.valid.copy_(flags[2])
        buf.advantages.copy_(adv)
        buf.returns.copy_(ret)
        self.t_idx.zero_()

    def _capture(self) -> None:
        """Capture the act and finish bodies; the state, storage and step counter are restored after."""
        state = self.stepper.state
        bodies = {f"act{h}": functools.partial(self._act_body, h) for h in range(len(self.parts))}
        with torch.no_grad():
            capture_restoring(self._graphs, {**bodies, "finish": self._finish_body},
                              snapshot((state.conv, state.ssm, self.hist, self.t_idx,
                                        *(x for ps in self._own_states for x in (ps.conv, ps.ssm)))), warmup=2)

    def _sync(self) -> None:
        self.event.record()
        self.event.synchronize()

    # ------------------------------------------------------------------------------------ the loop API
    def begin(self) -> None:
        """Rollout start: store the stepper state as the update's initial state, refresh the fused heads."""
        self._graphs.check()  # once per rollout; the per-step replays skip the pointer guard
        p = self.policy
        with torch.no_grad():
            self.t_idx.zero_()  # also after an interrupted rollout
            self.buffer.initial_state.copy_(self.stepper.state)
            split_state(self.stepper.state, self.parts, self.part_states)
            lin = p.fused_linears()  # actor, critic (, aux critic)
            torch.cat([x.weight for x in lin], out=self.w_cat)
            torch.cat([x.bias for x in lin], out=self.b_cat)

    @torch.no_grad()
    def act(self, t: int, part: int = 0) -> np.ndarray:
        """One replay for step ``t`` of part ``part``'s rows from their staged input; returns their actions
        [rows, action_dim] (a view of the pinned buffer, valid until the part's next call)."""
        rows = self.parts[part]
        if not self.copies_in_graph:
            self.dstage[rows].copy_(self.stage_t[rows], non_blocking=True)
        self._graphs[f"act{part}"].replay()  # the pointer guard ran in begin()
        if not self.copies_in_graph:
            self.act_pin[rows].copy_(self.act_dev[rows], non_blocking=True)
        self._sync()
        return self.act_np[rows]

    @torch.no_grad()
    def finish(self) -> None:
        """Bootstrap value, GAE and the device buffer: one replay and one event sync."""
        if not self.copies_in_graph:
            self.dstage.copy_(self.stage_t, non_blocking=True)
            self.res_dev.copy_(self.res_pin, non_blocking=True)
        self._graphs["finish"].replay()
        self._sync()  # the host rewrites the pinned stage and results next: let the copies finish
