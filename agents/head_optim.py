"""Adam for the actor/critic heads over one flat device arena, steppable inside a CUDA graph.

:class:`FlatHeadAdam` is a ``torch.optim.Adam`` (Kingma & Ba 2015, torch's single-tensor order of
operations, no weight decay) whose parameters, first and second moments live in three flat float32
tensors, so one step is a dozen kernels over the whole head whatever the number of parameters. The
step reads everything from device tensors (the learning rate, the global clip factor, the skip flag of
an f16 overflow), so it needs no host sync and a captured PPO minibatch can include it. A skipped step
changes nothing (parameters, moments and step count are selected back), unlike a zeroed gradient,
which would still move the moments.

On the CPU (not capturable) :meth:`FlatHeadAdam.host_step` is the step instead: ``torch.optim.Adam``'s
single-tensor arithmetic (bias corrections in float64 on the host) over the whole arena, bit for bit the
per-parameter step, in about ten ops and without the optimizer wrapper's per-step Python.

It stays a ``torch.optim.Adam`` for checkpoints: ``state_dict`` / ``load_state_dict`` have the usual
per-parameter ``step`` / ``exp_avg`` / ``exp_avg_sq`` format, and a loaded state is copied into the
arena (whose addresses a captured graph holds).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

__all__ = ["FlatHeadAdam"]


class FlatHeadAdam(torch.optim.Adam):
    """Adam over ``params`` re-homed into one flat arena (each ``p.data`` becomes a view of it).

    Args:
        params: the head parameters (float32, one device).
        lr, betas, eps: as ``torch.optim.Adam`` (weight decay 0). ``lr`` seeds the param group and
            ``lr_t``; change both with :meth:`set_lr`.

    Attributes:
        param_arena, exp_avg, exp_avg_sq: flat float32 [P]. step_t: float32 [1], the shared step count.
        lr_t: float64 0-d device tensor, the learning rate a captured step reads (:meth:`set_lr`).

    Raises:
        ValueError: no parameters, mixed devices or a non-float32 parameter.
    """

    def __init__(self, params: Iterable[nn.Parameter], lr: float, eps: float = 1e-8,
                 betas: tuple[float, float] = (0.9, 0.999)):
        params = list(params)
        if not params:
            raise ValueError("FlatHeadAdam: no parameters")
        dev = params[0].device
        for p in params:
            if p.device != dev or p.dtype != torch.float32:
                raise ValueError(f"FlatHeadAdam: parameters must be float32 on one device, got {p.dtype} on "
                                 f"{p.device} next to {dev}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, capturable=dev.type == "cuda")
        sizes = [p.numel() for p in params]
        self.param_arena = torch.empty(sum(sizes), device=dev)
        self.exp_avg = torch.zeros_like(self.param_arena)
        self.exp_avg_sq = torch.zeros_like(self.param_arena)
        self.step_t = torch.zeros(1, device=dev)
        self.lr_t = torch.full((), float(lr), dtype=torch.float64, device=dev)
        self._params, self._views = params, []
        off = 0
        with torch.no_grad():
            for p, n in zip(params, sizes):
                view = self.param_arena[off:off + n].view_as(p)
                view.copy_(p)
                p.data = view  # the module keeps its Parameter objects; their storage is the arena
                self._views.append((off, n))
                off += n
        self._bind_state()

    def _slice(self, flat: torch.Tensor, i: int, p: torch.Tensor) -> torch.Tensor:
        off, n = self._views[i]
        return flat[off:off + n].view_as(p)

    def _bind_state(self) -> None:
        for i, p in enumerate(self._params):
            self.state[p] = {"step": self.step_t.view(()), "exp_avg": self._slice(self.exp_avg, i, p),
                             "exp_avg_sq": self._slice(self.exp_avg_sq, i, p)}

    def set_lr(self, lr: float) -> None:
        """Set the learning rate: the param group's and ``lr_t`` (a device write, no sync; a captured
        step follows it)."""
        for g in self.param_groups:
            g["lr"] = lr
        self.lr_t.fill_(lr)

    def flat_grad(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The per-parameter gradients (in parameter order) as one flat [P] tensor (one kernel)."""
        return torch.cat([g.reshape(-1) for g in grads])

    @torch.no_grad()
    def flat_step(self, grad: torch.Tensor, lr: torch.Tensor, clip: torch.Tensor, skip: torch.Tensor) -> None:
        """One Adam step from the flat gradient ``grad`` [P] times ``clip``, unless ``skip``.

        Args:
            grad: [P] float32 (:meth:`flat_grad`). lr: 0-d device tensor (float32/64), the learning rate.
            clip: 0-d device tensor, the global clip factor of this step (may be NaN/0 when ``skip``).
            skip: 0-d bool device tensor; True leaves parameters, moments and step count unchanged.
        """
        g = torch.where(skip, torch.zeros((), device=grad.device), grad * clip.float())
        (beta1, beta2), eps = self.defaults["betas"], self.defaults["eps"]
        step = self.step_t + 1.0
        m = self.exp_avg.lerp(g, 1.0 - beta1)
        v = self.exp_avg_sq * beta2 + (1.0 - beta2) * g * g
        bc1 = 1.0 - torch.pow(beta1, step)
        bc2_sqrt = (1.0 - torch.pow(beta2, step)).sqrt()
        step_size = lr.float() / bc1
        p = self.param_arena - step_size * m / (v.sqrt() / bc2_sqrt + eps)
        self.param_arena.copy_(torch.where(skip, self.param_arena, p))
        self.exp_avg.copy_(torch.where(skip, self.exp_avg, m))
        self.exp_avg_sq.copy_(torch.where(skip, self.exp_avg_sq, v))
        self.step_t.copy_(torch.where(skip, self.step_t, step))

    @torch.no_grad()
    def host_step(self, grad: torch.Tensor, clip: torch.Tensor | None = None) -> None:
        """One Adam step from the flat gradient ``grad`` [P] (times ``clip`` when given), with the learning
        rate of the param group and the bias corrections computed on the host in float64: the arithmetic of
        ``torch.optim.Adam``'s single-tensor step on a non-capturable device, op for op, over the whole
        arena at once (each element goes through the same float32 operations as in the per-parameter
        step, so the parameters and moments come out bit for bit equal; ``tests/agents`` pins it). The
        CPU step: about ten ops whatever the number of head parameters, and no optimizer-wrapper overhead.

        Args:
            grad: [P] float32 on the arena's device (:meth:`flat_grad`, or a buffer laid out like the arena).
            clip: None, or a 0-d float32 tensor, the global clip factor (the gradient is ``grad * clip``).

        Raises:
            RuntimeError: a capturable (CUDA) optimizer; use :meth:`flat_step` there.
            ValueError: ``grad`` is not float32 [P].
        """
        if self.defaults["capturable"]:
            raise RuntimeError("FlatHeadAdam.host_step reads the step count on the host; a capturable (CUDA) "
                               "optimizer steps with flat_step")
        if grad.shape != self.param_arena.shape or grad.dtype != torch.float32:
            raise ValueError(f"FlatHeadAdam.host_step: grad must be float32 {list(self.param_arena.shape)}, got "
                             f"{grad.dtype} {list(grad.shape)}")
        group = self.param_groups[0]
        lr, (beta1, beta2), eps = float(group["lr"]), group["betas"], group["eps"]
        g = grad if clip is None else grad * clip
        self.step_t += 1
        self.exp_avg.lerp_(g, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step = self.step_t.item()
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2 ** 0.5
        denom = (self.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        self.param_arena.addcdiv_(self.exp_avg, denom, value=-step_size)

    def step(self, closure=None):  # noqa: D102 - the module's parameters' .grad, lr of the param group
        if closure is not None:
            raise ValueError("FlatHeadAdam.step: closures are not supported")
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        if not self.defaults["capturable"]:  # the CPU: torch.optim.Adam's arithmetic, bit for bit
            self.host_step(self.flat_grad(grads))
            return
        dev = self.param_arena.device
        self.flat_step(self.flat_grad(grads), torch.tensor(self.param_groups[0]["lr"], device=dev),
                       torch.ones((), device=dev), torch.zeros((), dtype=torch.bool, device=dev))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim.Adam.load_state_dict``, then the loaded moments and step copied into the arena
        (a missing state, as in a checkpoint saved before any step, means zeros)."""
        super().load_state_dict(state_dict)
        with torch.no_grad():
            self.lr_t.fill_(self.param_groups[0]["lr"])
            steps = []
            for i, p in enumerate(self._params):
                st = self.state.get(p, {})
                for key, flat in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                    dst = self._slice(flat, i, p)
                    dst.copy_(st[key]) if key in st else dst.zero_()
                steps.append(float(st["step"]) if "step" in st else 0.0)
            if len(set(steps)) > 1:
                raise ValueError(f"FlatHeadAdam: the head parameters have different step counts {steps}")
            self.step_t.fill_(steps[0])
        self._bind_state()
