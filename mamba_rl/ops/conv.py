"""Causal depthwise conv1d + SiLU with per-row episode resets (Mamba-1's short convolution).

Layout is channels-last, ``x`` of shape [B, T, D] (D = d_inner). For each row b, channel d and step t::

    out[b, t, d] = SiLU(bias[d] + sum_{k=0}^{K-1} weight[d, k] * win[b, t - (K-1) + k, d])

where ``win`` is ``x`` extended to the left by the carried window ``conv_state[b, d, :]`` (oldest first),
and every entry of the window that lies before the latest episode start in ``[0, t]`` of row b is zero.
This is PyTorch's ``conv1d(groups=D, padding=K-1)`` truncated to the first T outputs (mamba_ssm's
``causal_conv1d_fn``), with resets.

The returned ``final_state[b, d, j]`` is the window the next call starts from: the last K-1 inputs of row
b, oldest first, zeroed before the latest start.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import cuda_op_available, check_tensor

__all__ = ["causal_conv1d", "causal_conv1d_ref"]


def _validate(x, weight, bias, conv_state, episode_starts):
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: x must be [B, T, D], got shape {tuple(x.shape)}")
    B, T, D = x.shape
    check_tensor("causal_conv1d: weight", weight, shape=(D, None), device=x.device)
    K = weight.shape[1]
    check_tensor("causal_conv1d: bias", bias, shape=(D,), device=x.device)
    if conv_state is not None:
        check_tensor("causal_conv1d: conv_state", conv_state, shape=(B, D, K - 1), device=x.device)
    if episode_starts is not None:
        check_tensor("causal_conv1d: episode_starts", episode_starts, shape=(B, T), dtype=torch.bool,
                     device=x.device)
    return B, T, D, K


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      conv_state: torch.Tensor | None = None,
                      episode_starts: torch.Tensor | None = None):
    """Pure-torch reference (float64-capable, differentiable by autograd).

    Args:
        x: [B, T, D] float (any float dtype; math runs in ``weight.dtype`` promoted with x).
        weight: [D, K] float, K = d_conv.
        bias: [D] float.
        conv_state: [B, D, K-1] float or None (zeros).
        episode_starts: [B, T] bool or None (no resets).
    Returns:
        (out [B, T, D] in x.dtype, final_state [B, D, K-1] in float32 or float64 (the wider of x and weight)).
    Raises:
        ValueError: on a shape, dtype or device mismatch.
    """
    B, T, D, K = _validate(x, weight, bias, conv_state, episode_starts)
    cdt = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
    xf = x.to(cdt)
    if conv_state is None:
        prev = xf.new_zeros(B, K - 1, D)
    else:
        prev = conv_state.to(cdt).transpose(1, 2)  # [B, K-1, D]
    win = torch.cat([prev, xf], dim=1)  # [B, T+K-1, D]; position p of win is time p-(K-1)
    # valid[b, t, k]: the tap win[t+k] (time t-(K-1)+k) belongs to the episode of step t.
    if episode_starts is not None and K > 1:
        # last_start[b, t] = index of the latest start in [0, t], or -inf (K) when none.
        idx = torch.arange(T, device=x.device).expand(B, T)
        marked = torch.where(episode_starts, idx, torch.full_like(idx, -(K + T)))
        last_start = torch.cummax(marked, dim=1).values  # [B, T]
        tap_time = idx.unsqueeze(-1) - (K - 1) + torch.arange(K, device=x.device)  # [B, T, K]
        valid = tap_time >= last_start.unsqueeze(-1)
    else:
        valid = None
    taps = win.unfold(1, K, 1)  # [B, T, D, K]
    if valid is not None:  # select, not multiply: a NaN of the old episode must not leak
        taps = torch.where(valid.unsqueeze(2), taps, torch.zeros((), dtype=cdt, device=x.device))
    pre = (taps * weight.to(cdt)).sum(-1) + bias.to(cdt)
    out = F.silu(pre).to(x.dtype)
    # final window: the last K-1 entries of win, zeroed before the latest start of each row.
    final = win[:, T:, :]  # [B, K-1, D], times T-(K-1) .. T-1
    if episode_starts is not None and K > 1:
        ft = torch.arange(T - (K - 1), T, device=x.device)  # [K-1]
        keep = ft.unsqueeze(0) >= last_start[:, -1:]  # [B, K-1]
        final = torch.where(keep.unsqueeze(-1), final, torch.zeros((), dtype=cdt, device=x.device))
    return out, final.transpose(1, 2).contiguous()


def causal_conv1d(x, weight, bias, conv_state=None, episode_starts=None):
    """Causal depthwise conv1d + SiLU with resets; the CUDA kernel when available, else the reference.

    Shapes, dtypes and semantics are those of :func:`causal_conv1d_ref`. Differentiable w.r.t. x,
    weight, bias and conv_state.
    """
    if cuda_op_available(x):
        from . import _cuda_autograd
        _validate(x, weight, bias, conv_state, episode_starts)
        return _cuda_autograd.causal_conv1d(x, weight, bias, conv_state, episode_starts)
    return causal_conv1d_ref(x, weight, bias, conv_state, episode_starts)
