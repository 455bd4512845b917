"""The small GEMMs of the fused training step as CUDA kernels, with float64 reference twins.

- :func:`wgrad_grouped`: every weight gradient of a backward, ``c += a^T b`` per job, in one launch
  (csrc/wgrad.cu). Through torch each float32 ``addmm_`` with K = B*T rows is two kernels on the H200
  (cuBLASLt picks split-K and adds a reduce kernel); here the K split is a fixed function of the shapes and
  the last slice of each output tile sums the partials in slice order: deterministic, one launch for all.
- :func:`xdt_fwd` / :func:`xdt_bwd`: a layer's x_proj and dt_proj (Gu & Dao 2023, the selective
  parameters ``dt, B, C = split(x @ W_x^T)``, ``dt = dt @ W_dt^T``) and their input gradient, one launch each
  way (csrc/xdt.cu) instead of 2 (forward) and 3-4 (backward: mm, cat, addmm and a split-K reduce).

All accumulate in float32 and round each output once to the operands' dtype; the ``*_ref`` twins compute
in float64 (the parity tests compare the two).
"""
from __future__ import annotations

import torch

__all__ = ["wgrad_grouped", "wgrad_grouped_ref", "xdt_fwd", "xdt_fwd_ref", "xdt_bwd", "xdt_bwd_ref",
           "WGRAD_MAX_JOBS"]

WGRAD_MAX_JOBS = 24  # csrc/ops.h


def wgrad_grouped_ref(jobs) -> None:
    """Reference of :func:`wgrad_grouped` on the same ``jobs`` (any device): per job ``c += a^T b`` (``b``
    None: ``c += a.sum(0)``), in place: the product in float64, rounded to ``c``'s dtype, then added."""
    for a, b, c in jobs:
        a64 = a.double()
        if b is None:
            c.add_(a64.sum(0).reshape(c.shape).to(c.dtype))
        else:
            c.add_((a64.t() @ b.double()).to(c.dtype))


def wgrad_grouped(ext, jobs) -> None:
    """``c += a^T b`` for every job, in one CUDA launch (``csrc/wgrad.cu``), float32 accumulation: float32 jobs on
    FFMA tiles; bf16 / f16 jobs whose operands allow 16-byte row loads (aligned base, row stride and width multiples
    of 8 elements) on tensor cores (``mma.sync``, compute capability >= 8.0); column sums a thread per column. K is
    cut into slices fixed by the shapes and summed in slice order, so the same jobs give the same bits every call.

    Args:
        ext: the CUDA extension (``mamba_rl.ops.extension.extension("cuda")``).
        jobs: 1..:data:`WGRAD_MAX_JOBS` tuples ``(a, b, c)``: ``a`` [K, M] and ``b`` [K, N] (float32, bfloat16 or
            float16, any row stride, unit column stride, the same K per job), ``c`` [M, N] float32 with unit
            column stride (e.g. a view into the gradient arena). ``b`` None: ``c`` [M] or [M, 1] gets the
            column sums of ``a`` (a bias gradient).
    Raises:
        ValueError: a shape, dtype, stride or device that does not fit (naming the job and the operand).
    """
    ext.wgrad_grouped([(a, b, c) for a, b, c in jobs])


def xdt_fwd_ref(xc, wx, wdt):
    """Reference of :func:`xdt_fwd` (same arguments and returns, any device): ``dbc = xc @ wx^T`` and
    ``dt = dbc[:, :dt_rank] @ wdt^T`` in float64, each rounded to xc's dtype (dt from the rounded dbc, as the
    kernel does)."""
    R = wdt.shape[1]
    dbc = (xc.double() @ wx.double().t()).to(xc.dtype)
    dt = (dbc[:, :R].double() @ wdt.double().t()).to(xc.dtype)
    return dbc, dt


def xdt_fwd(ext, xc, wx, wdt):
    """x_proj and dt_proj of one layer in one launch.

    Args:
        ext: the CUDA extension.
        xc: [rows, d_inner] (the conv output), float32 / bfloat16 / float16, contiguous.
        wx: x_proj.weight [dt_rank + 2 d_state, d_inner], wdt: dt_proj.weight [d_inner, dt_rank], xc's dtype.
    Returns:
        (dbc [rows, dt_rank + 2 d_state], dt [rows, d_inner]) in xc's dtype: ``dbc = xc @ wx^T``,
        ``dt = dbc[:, :dt_rank] @ wdt^T`` (the pre-softplus dt, without dt_proj.bias: the scan adds it).
    Raises:
        ValueError: mismatched shapes or dtypes, non-contiguous operands.
    """
    return ext.xdt_fwd(xc, wx, wdt)


def xdt_bwd_ref(ddt, dB, dC, wx, wdt, dxc):
    """Reference of :func:`xdt_bwd` (same arguments, any device), out of place: (ddbc [rows, dt_rank + 2 d_state],
    dxc_new [rows, d_inner]) with ``ddbc = [ddt @ wdt, dB, dC]`` and ``dxc_new = dxc + ddbc @ wx``, in float64,
    each rounded to ddt's dtype (dxc_new from the rounded ddbc); ``dxc`` is left unchanged."""
    ddbc = torch.cat([(ddt.double() @ wdt.double()).to(ddt.dtype), dB, dC], dim=1)
    return ddbc, (dxc.double() + ddbc.double() @ wx.double()).to(ddt.dtype)


def xdt_bwd(ext, ddt, dB, dC, wx, wdt, dxc):
    """Gradient through :func:`xdt_fwd` in one launch: ddbc = [ddt @ wdt, dB, dC]; ``dxc += ddbc @ wx`` in place.

    Args:
        ext: the CUDA extension.
        ddt: [rows, d_inner] (dL/d pre-softplus dt), dB, dC: [rows, d_state], dxc: [rows, d_inner] (the
            scan's dL/dxc, updated in place), all contiguous in one dtype; wx, wdt as in :func:`xdt_fwd`.
    Returns:
        ddbc [rows, dt_rank + 2 d_state] in ddt's dtype (the x_proj output gradient, for x_proj's dW).
    Raises:
        ValueError: mismatched shapes or dtypes, non-contiguous operands.
    """
    return ext.xdt_bwd(ddt, dB, dC, wx, wdt, dxc)
