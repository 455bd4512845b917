"""MambaBlock: one pre-norm residual Mamba-1 block (Gu & Dao 2023, arXiv:2312.00752; mamba_ssm's ``Block``
around a ``Mamba`` mixer), with its two views: :meth:`MambaBlock.forward` over a sequence and
:meth:`MambaBlock.step` for one token. Both read the same parameters and give the same result: T calls of
``step`` equal one ``forward`` over T (features and final state), for any reset pattern.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.step import layer_step_ref

__all__ = ["MambaBlock"]

WeightFn = Callable[[str], torch.Tensor]


class MambaBlock(nn.Module):
    """Parameters (registered by the owning arena as views, HF / mamba_ssm names): ``norm.weight`` [d_model],
    ``mixer.in_proj.weight`` [2 d_inner, d_model], ``mixer.conv1d.weight`` [d_inner, 1, d_conv],
    ``mixer.conv1d.bias`` [d_inner], ``mixer.x_proj.weight`` [dt_rank + 2 d_state, d_inner],
    ``mixer.dt_proj.weight`` [d_inner, dt_rank], ``mixer.dt_proj.bias`` [d_inner], ``mixer.A_log``
    [d_inner, d_state], ``mixer.D`` [d_inner], ``mixer.out_proj.weight`` [d_model, d_inner].

    The math reads the GEMM weights through ``w(key)`` (the arena's compute copy under bf16/f16), the
    others as float32 masters.
    """

    def __init__(self):
        super().__init__()
        self.norm = nn.Module()
        self.mixer = nn.Module()
        for sub in ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj"):
            setattr(self.mixer, sub, nn.Module())

    def forward(self, h: torch.Tensor, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None,
                episode_starts: torch.Tensor | None, w: WeightFn, ops, eps: float, cdt: torch.dtype):
        """The block over a sequence.

        Args:
            h: [B, T, d_model] residual stream (master dtype).
            conv_state: [B, d_inner, d_conv-1] or None (zeros); ssm_state: [B, d_inner, d_state] or None.
            episode_starts: [B, T] bool or None.
            w: ``w(key)`` -> the GEMM weight ``key`` (e.g. ``"mixer.in_proj.weight"``) as the GEMMs read it.
            ops: ``(causal_conv1d, selective_scan, rms_norm)``, the references or the kernel dispatchers.
            eps: RMSNorm epsilon. cdt: the GEMM (compute) dtype.
        Returns:
            (h + mixer(norm(h)) [B, T, d_model], final conv window, final SSM state).
        """
        conv, scan, norm = ops
        mx = self.mixer
        di = mx.D.shape[0]
        n = mx.A_log.shape[1]
        r = mx.dt_proj.weight.shape[1]
        u = norm(h, self.norm.weight, eps, cdt)
        xz = F.linear(u, w("mixer.in_proj.weight"))
        xi, z = xz.split(di, dim=-1)
        xc, conv_f = conv(xi, mx.conv1d.weight.view(di, -1), mx.conv1d.bias, conv_state, episode_starts)
        dt_r, Bm, Cm = F.linear(xc, w("mixer.x_proj.weight")).split([r, n, n], dim=-1)
        dt = F.linear(dt_r, w("mixer.dt_proj.weight"))
        y, ssm_f = scan(xc, dt, mx.A_log, Bm, Cm, mx.D, z, mx.dt_proj.bias, ssm_state, episode_starts)
        return h + F.linear(y, w("mixer.out_proj.weight")).to(h.dtype), conv_f, ssm_f

    @torch.no_grad()
    def step(self, h: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
             episode_starts: torch.Tensor | None, w: WeightFn, eps: float) -> torch.Tensor:
        """The block for one token: h [B, d_model] -> [B, d_model]; ``conv_state`` [B, d_inner, d_conv-1] and
        ``ssm_state`` [B, d_inner, d_state] advance in place; rows with ``episode_starts`` [B] True start
        from zeros. ``w`` is as in :meth:`forward` for the GEMM weights; the math is
        :func:`mamba_rl.ops.step.layer_step_ref`."""
        params = {"norm.weight": self.norm.weight, "mixer.conv1d.weight": self.mixer.conv1d.weight,
                  "mixer.conv1d.bias": self.mixer.conv1d.bias, "mixer.dt_proj.bias": self.mixer.dt_proj.bias,
                  "mixer.A_log": self.mixer.A_log, "mixer.D": self.mixer.D}
        return layer_step_ref(h, lambda k: params[k].detach() if k in params else w(k), conv_state, ssm_state,
                              episode_starts, eps)
