"""CUDA twins of mamba_rl.optim's ``grad_stats_ref`` / ``adamw_step_ref`` (same names without ``_ref``,
same signatures, same semantics), plus the select-based f16 unscale.

One launch each, reading lr, betas, eps, weight decay, the clip coefficient, the inverse loss scale and
the bias corrections from the device buffers ``hyper`` / ``scalars``, so a captured graph follows a
learning-rate schedule without recapture. ``grad_stats`` finishes its reduction in the last block to
finish (a self-resetting counter per device), in a fixed order: bit-reproducible.
"""
from __future__ import annotations

import torch

from ._dispatch import extension

__all__ = ["grad_stats", "adamw_step", "unscale_grad"]

_COUNTERS: dict = {}


def _ext():
    e = extension()
    if e is None:
        raise RuntimeError("mamba_rl CUDA extension is not available")
    return e


def _counter(device) -> torch.Tensor:
    key = torch.device(device)
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=key)
    return c


def grad_stats(grad, extra_grad_sq, loss_scale, hyper, scalars):
    """See :func:`mamba_rl.optim.grad_stats_ref`; writes ``scalars`` in place, no host sync."""
    extra = None
    if extra_grad_sq is not None:
        extra = extra_grad_sq.reshape(1)
        if extra.dtype != torch.float32:
            extra = extra.float()
    _ext().grad_stats(grad, extra, loss_scale.reshape(1), hyper, scalars, _counter(grad.device))


def adamw_step(param, grad, exp_avg, exp_avg_sq, hyper, scalars, n_decay, compute=None):
    """See :func:`mamba_rl.optim.adamw_step_ref`; updates param / moments / compute in place."""
    _ext().adamw_step(param, grad, exp_avg, exp_avg_sq, hyper, scalars, int(n_decay), compute)


def unscale_grad(grad, scalars):
    """``grad = 0 if found_inf else grad * inv_scale`` (a select: inf never becomes NaN), in place."""
    _ext().unscale_grad(grad, scalars)
