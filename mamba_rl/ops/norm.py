"""RMSNorm (Zhang & Sennrich 2019), as in mamba_ssm's ``RMSNorm``: ``x * rsqrt(mean(x^2) + eps) * weight``."""
from __future__ import annotations

import torch

from .capability import kernel_support
from .checks import f32c
from .extension import kernels_for

__all__ = ["rms_norm", "rms_norm_ref"]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm over the last dim. x [..., C] float, weight [C]; math in float32 (float64 when x is).

    Returns a tensor of ``out_dtype`` (default x.dtype).
    """
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight must have shape [{x.shape[-1]}], got {list(weight.shape)}")
    cdt = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
    xf = x.to(cdt)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(cdt)
    return y.to(out_dtype or x.dtype)


class _RMSNormKernel(torch.autograd.Function):
    """The extension's rmsnorm_fwd / rmsnorm_bwd as one autograd node (float32 x, any kernel out dtype)."""

    @staticmethod
    def forward(ctx, ext, x, weight, eps, out_dtype):
        xc = x.contiguous()
        w32 = f32c(weight)
        out, rstd = ext.rmsnorm_fwd(xc, w32, float(eps), out_dtype)
        ctx.save_for_backward(xc, rstd, w32)
        ctx.ext, ctx.wdtype = ext, weight.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        x, rstd, w32 = ctx.saved_tensors
        if dy.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            dy = dy.float()
        dw = torch.zeros_like(w32)
        dx = ctx.ext.rmsnorm_bwd(dy.contiguous(), x, rstd, w32, dw, None)
        return None, dx, dw.to(ctx.wdtype), None, None


def rms_norm(x, weight, eps=1e-5, out_dtype=None):
    """RMSNorm with the :func:`rms_norm_ref` contract: the CUDA or CPU kernel for float32 x when
    :func:`~mamba_rl.ops.capability.kernel_support` takes the channels and the output dtype (forward, and
    the backward too when a gradient may be asked for: CUDA at most 1024 / 512 channels), else the
    reference."""
    out_dtype = out_dtype or x.dtype
    ext = kernels_for(x, weight)
    if ext is None or x.dtype != torch.float32 or x.dim() < 1:
        return rms_norm_ref(x, weight, eps, out_dtype)
    kind, C = x.device.type, x.shape[-1]
    ok = kernel_support(kind, "rms_norm_fwd", d_model=C, dtype=x.dtype, out_dtype=out_dtype)
    if ok and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        ok = kernel_support(kind, "rms_norm_bwd", d_model=C, dtype=x.dtype)
    if not ok:
        return rms_norm_ref(x, weight, eps, out_dtype)
    return _RMSNormKernel.apply(ext, x, weight, eps, out_dtype)
