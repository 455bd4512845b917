"""torch.autograd.Function wrappers over the CUDA extension (csrc/), one per op.

Same arguments and returns as the ``*_ref`` twins in conv.py / scan.py / norm.py. Everything runs on the
current torch stream with outputs from torch's caching allocator and no host sync, so the ops can be
captured in CUDA graphs. Inputs the kernels do not take (float64, a float16 weight, a non-unit last
stride) fall back to the reference or are converted here.
"""
from __future__ import annotations

import torch

from ._dispatch import extension

__all__ = ["causal_conv1d", "selective_scan", "rms_norm"]

_ACT = (torch.float32, torch.bfloat16, torch.float16)


def _ext():
    e = extension()
    if e is None:
        raise RuntimeError("mamba_rl CUDA extension is not available")
    return e


def _f32c(t):
    return None if t is None else t.to(torch.float32).contiguous()


def _act(t, dtype):
    """Activation in the kernel's dtype with unit last-dim stride (row strides are kept)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.size(-1) > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def _bool_c(t):
    return None if t is None else t.to(torch.bool).contiguous()


# ---------------------------------------------------------------- causal conv1d
class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, conv_state, episode_starts):
        w, b, init = _f32c(weight), _f32c(bias), _f32c(conv_state)
        out, final = _ext().conv_fwd(x, w, b, init, episode_starts)
        ctx.save_for_backward(x, w, b, init, episode_starts)
        ctx.wdtype, ctx.bdtype = weight.dtype, bias.dtype
        ctx.sdtype = None if conv_state is None else conv_state.dtype
        return out, final

    @staticmethod
    def backward(ctx, dout, dfinal):
        x, w, b, init, starts = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(x)
        dout = _act(dout, x.dtype)
        dfinal = None if dfinal is None else dfinal.to(torch.float32).contiguous()
        need_dinit = init is not None and ctx.needs_input_grad[3]
        dx, dw, db, dinit = _ext().conv_bwd(x, w, b, init, starts, dout, dfinal, need_dinit)
        return (dx, dw.to(ctx.wdtype), db.to(ctx.bdtype),
                dinit.to(ctx.sdtype) if need_dinit else None, None)


def causal_conv1d(x, weight, bias, conv_state=None, episode_starts=None):
    """CUDA causal depthwise conv1d + SiLU (see :func:`mamba_rl.ops.conv.causal_conv1d_ref`)."""
    if x.dtype not in _ACT or weight.dtype == torch.float64:
        from .conv import causal_conv1d_ref
        return causal_conv1d_ref(x, weight, bias, conv_state, episode_starts)
    return _CausalConv1d.apply(_act(x, x.dtype), weight, bias, conv_state, _bool_c(episode_starts))


# ---------------------------------------------------------------- selective scan
class _SelectiveScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A_log, Bm, Cm, D, z, dt_bias, ssm_state, episode_starts):
        ty = x.dtype
        dt, Bm, Cm, z = _act(dt, ty), _act(Bm, ty), _act(Cm, ty), _act(z, ty)
        A32, D32, db32, init = _f32c(A_log), _f32c(D), _f32c(dt_bias), _f32c(ssm_state)
        need = any(ctx.needs_input_grad)  # grad mode is off inside forward; this says if bwd can run
        y, final, ckpt = _ext().scan_fwd(x, dt, A32, Bm, Cm, D32, z, db32, init, episode_starts, need)
        ctx.save_for_backward(x, dt, A32, Bm, Cm, D32, z, db32, init, episode_starts)
        ctx.ckpt = ckpt
        ctx.dtypes = (dt.dtype, A_log.dtype, Bm.dtype, Cm.dtype, D.dtype, z.dtype, dt_bias.dtype,
                      None if ssm_state is None else ssm_state.dtype)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A32, Bm, Cm, D32, z, db32, init, starts = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        dy = _act(dy, x.dtype)
        dfinal = None if dfinal is None else dfinal.to(torch.float32).contiguous()
        need_dinit = init is not None and ctx.needs_input_grad[8]
        dx, ddt, dA, dB, dC, dD, dz, ddb, dinit = _ext().scan_bwd(
            x, dt, A32, Bm, Cm, D32, z, db32, init, starts, ctx.ckpt, dy, dfinal, need_dinit)
        ctx.ckpt = None
        t = ctx.dtypes
        return (dx, ddt, dA.to(t[1]), dB, dC, dD.to(t[4]), dz, ddb.to(t[6]),
                dinit.to(t[7]) if need_dinit else None, None)


def selective_scan(x, dt, A_log, Bm, Cm, D, z, dt_bias, ssm_state=None, episode_starts=None):
    """CUDA selective scan (see :func:`mamba_rl.ops.scan.selective_scan_ref`)."""
    if x.dtype not in _ACT or A_log.dtype == torch.float64 or A_log.shape[1] not in (8, 16):
        from .scan import selective_scan_ref
        return selective_scan_ref(x, dt, A_log, Bm, Cm, D, z, dt_bias, ssm_state, episode_starts)
    return _SelectiveScan.apply(_act(x, x.dtype), dt, A_log, Bm, Cm, D, z, dt_bias, ssm_state,
                                _bool_c(episode_starts))


# ---------------------------------------------------------------- RMSNorm
class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype):
        xc = x.contiguous()
        w32 = _f32c(weight)
        out, rstd = _ext().rmsnorm_fwd(xc, w32, float(eps), out_dtype)
        ctx.save_for_backward(xc, rstd, w32)
        ctx.wdtype = weight.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        x, rstd, w32 = ctx.saved_tensors
        if dy.dtype not in _ACT:
            dy = dy.float()
        dw = torch.zeros_like(w32)
        dx = _ext().rmsnorm_bwd(dy.contiguous(), x, rstd, w32, dw, None)
        return dx, dw.to(ctx.wdtype), None, None


def rms_norm(x, weight, eps=1e-5, out_dtype=None):
    """CUDA RMSNorm (see :func:`mamba_rl.ops.norm.rms_norm_ref`): float32 x, any activation out_dtype."""
    out_dtype = out_dtype or x.dtype
    if x.dtype != torch.float32 or out_dtype not in _ACT or x.shape[-1] > 512 or weight.dtype == torch.float64:
        from .norm import rms_norm_ref
        return rms_norm_ref(x, weight, eps, out_dtype)
    return _RMSNorm.apply(x, weight, eps, out_dtype)
