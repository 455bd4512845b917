"""RMSNorm (Zhang & Sennrich 2019), as in mamba_ssm's ``RMSNorm``: ``x * rsqrt(mean(x^2) + eps) * weight``."""
from __future__ import annotations

import torch

from ._dispatch import cuda_op_available

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


def rms_norm(x, weight, eps=1e-5, out_dtype=None):
    """RMSNorm; the CUDA kernel when available, else :func:`rms_norm_ref` (same contract)."""
    if cuda_op_available(x):
        from . import _cuda_autograd
        if hasattr(_cuda_autograd, "rms_norm"):
            return _cuda_autograd.rms_norm(x, weight, eps, out_dtype)
    return rms_norm_ref(x, weight, eps, out_dtype)
