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

from .capability import kernel_support
from .checks import act, bool_c, check_tensor, f32c
from .extension import kernels_for

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


class _CausalConv1dKernel(torch.autograd.Function):
    """The extension's conv_fwd / conv_bwd (CUDA or CPU, the same contract) as one autograd node."""

    @staticmethod
    def forward(ctx, ext, x, weight, bias, conv_state, episode_starts):
        w, b, init = f32c(weight), f32c(bias), f32c(conv_state)
        out, final = ext.conv_fwd(x, w, b, init, episode_starts)
        ctx.save_for_backward(x, w, b, init, episode_starts)
        ctx.ext = ext
        ctx.wdtype, ctx.bdtype = weight.dtype, bias.dtype
        ctx.sdtype = None if conv_state is None else conv_state.dtype
        return out, final

    @staticmethod
    def backward(ctx, dout, dfinal):
        x, w, b, init, starts = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(x)
        dout = act(dout, x.dtype)
        dfinal = None if dfinal is None else dfinal.to(torch.float32).contiguous()
        need_dinit = init is not None and ctx.needs_input_grad[4]
        dx, dw, db, dinit = ctx.ext.conv_bwd(x, w, b, init, starts, dout, dfinal, need_dinit)
        return (None, dx, dw.to(ctx.wdtype), db.to(ctx.bdtype),
                dinit.to(ctx.sdtype) if need_dinit else None, None)


def causal_conv1d(x, weight, bias, conv_state=None, episode_starts=None):
    """Causal depthwise conv1d + SiLU with resets: the CUDA or CPU kernel when one takes the inputs (see
    :func:`~mamba_rl.ops.extension.kernels_for` and :func:`~mamba_rl.ops.capability.kernel_support` "conv":
    the CUDA kernel takes d_conv 2, 3 or 4), else :func:`causal_conv1d_ref`.

    Shapes, dtypes and semantics are those of :func:`causal_conv1d_ref`. Differentiable w.r.t. x,
    weight, bias and conv_state.
    """
    ext = kernels_for(x, weight)
    if ext is None or weight.dim() != 2 or not kernel_support(x.device.type, "conv", d_conv=weight.shape[1],
                                                              dtype=x.dtype):
        return causal_conv1d_ref(x, weight, bias, conv_state, episode_starts)
    _validate(x, weight, bias, conv_state, episode_starts)
    return _CausalConv1dKernel.apply(ext, act(x, x.dtype), weight, bias, conv_state, bool_c(episode_starts))
