"""Flat-arena AdamW and global-norm clipping driven from device buffers (the scaler is in mamba_rl.train).

Semantics:
- AdamW is ``torch.optim.AdamW`` (Loshchilov & Hutter 2019, decoupled weight decay), in its single-tensor
  order of operations, over one flat float32 arena. Elements ``[0, n_decay)`` are decayed, the rest are the
  no-decay group (the backbone lays the arena out that way).
- Clipping is ``torch.nn.utils.clip_grad_norm_``: one global L2 norm over the backbone's gradients plus a
  caller's squared head-gradient norm (``extra_grad_sq``); coefficient ``min(1, max_norm / (norm + 1e-6))``.
- The loss scaler is ``torch.amp.GradScaler``: gradients arrive multiplied by ``loss_scale``; a step whose
  gradients hold an inf/NaN is skipped (weights, moments and step counter unchanged); the scale is halved
  on such a step and doubled after ``growth_interval`` clean steps (``torch._amp_update_scale_``).

Everything a step reads lives in device tensors (``hyper``, ``scalars``, ``loss_scale``), so a captured
CUDA graph replays with new learning rates and never needs a host sync. The bias corrections are formed in
float64 from a float64 step counter, with the exponent clamped at 2**30 so no overflow occurs past 2**31
steps.

``hyper``   float64 [8] = [lr, beta1, beta2, eps, weight_decay, max_grad_norm (inf: none),
                          skip_on_overflow (1.0 with the f16 scaler), 0]
``scalars`` float64 [8] = [step, bias_correction1, bias_correction2, grad_norm, clip_coef, found_inf,
                          inv_scale, loss_scale]   (loss_scale: the scale after the last step, 1 outside
                          f16; written by the trainer for its metrics, read by no kernel)

On CUDA each of :func:`grad_stats` / :func:`adamw_step` is one launch; the
``grad_stats`` reduction finishes in the last block to finish (a self-resetting counter per device), in a
fixed order: bit-reproducible. :func:`optim_step` runs both as one cooperative launch where the arena fits
(``FUSED``; the same bits as the two launches). On the CPU, when the caller passes the CPU extension (``kernels=``; the
trainer does on the ``cpu`` backend), each is one OpenMP pass in C++ (csrc/cpu/optim.cpp: the CUDA
kernels' math and roundings; the norm summed in fixed blocks, bit-reproducible for any thread count).
Elsewhere the ``*_ref`` twins run (a handful of vectorised torch ops; in float64 for a float64 arena).
"""
from __future__ import annotations

import math

import torch

from .extension import extension

__all__ = ["grad_stats", "grad_stats_ref", "adamw_step", "adamw_step_ref", "optim_step", "make_hyper",
           "STEP", "BC1", "BC2", "GRAD_NORM", "CLIP_COEF", "FOUND_INF", "INV_SCALE", "LOSS_SCALE",
           "MAX_STEP_EXPONENT"]

STEP, BC1, BC2, GRAD_NORM, CLIP_COEF, FOUND_INF, INV_SCALE, LOSS_SCALE = range(8)
MAX_STEP_EXPONENT = 2 ** 30


def make_hyper(lr, betas, eps, weight_decay, max_grad_norm, skip_on_overflow, device) -> torch.Tensor:
    """Build the float64 ``hyper`` buffer; raises ValueError on out-of-range values (naming them)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"AdamW: betas must be a pair (beta1, beta2), got {betas!r}")
    b1, b2 = betas
    for name, v in (("lr", lr), ("beta1", b1), ("beta2", b2), ("eps", eps), ("weight_decay", weight_decay)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"AdamW: {name} must be a number, got {v!r}")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                      or not math.isfinite(max_grad_norm)):
        raise ValueError(f"max_grad_norm must be None or a finite number > 0, got {max_grad_norm!r}")
    for name, v, ok, rng in (("lr", lr, lr >= 0, ">= 0"), ("beta1", b1, 0 <= b1 < 1, "[0, 1)"),
                             ("beta2", b2, 0 <= b2 < 1, "[0, 1)"), ("eps", eps, eps > 0, "> 0"),
                             ("weight_decay", weight_decay, weight_decay >= 0, ">= 0")):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and ok):
            raise ValueError(f"AdamW: {name} must be a finite number {rng}, got {v!r}")
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be None or a number > 0, got {max_grad_norm!r}")
    mgn = math.inf if max_grad_norm is None else float(max_grad_norm)
    return torch.tensor([lr, b1, b2, eps, weight_decay, mgn, 1.0 if skip_on_overflow else 0.0, 0.0],
                        dtype=torch.float64, device=device)


def grad_stats_ref(grad, extra_grad_sq, loss_scale, hyper, scalars):
    """Global norm, clip coefficient, overflow flag and the next bias corrections, in place on ``scalars``.

    Args:
        grad: [P] float32 flat gradient arena (still multiplied by the loss scale).
        extra_grad_sq: 0-d float tensor (a head's squared grad norm, unscaled) or None.
        loss_scale: [1] float32.
        hyper, scalars: float64 [8] buffers (module docstring).
    """
    inv_scale = (1.0 / loss_scale.double()).reshape(())
    g = grad.double() * inv_scale
    found_inf = ~torch.isfinite(grad).all()
    sq = g.square().sum()
    if extra_grad_sq is not None:
        sq = sq + extra_grad_sq.double().reshape(())
    norm = sq.sqrt()
    clip = torch.clamp(hyper[5] / (norm + 1e-6), max=1.0)
    # max_grad_norm None is +inf there: no clipping, a coefficient of 1 also for an infinite norm (inf / inf is
    # NaN); a NaN norm stays NaN (torch.clamp). The kernels' rule (csrc/cpu/optim.cpp, csrc/optim.cu).
    clip = torch.where(torch.isinf(hyper[5]) & ~torch.isnan(norm), torch.ones_like(clip), clip)
    skip = found_inf & (hyper[6] > 0)
    step = scalars[STEP] + (~skip).double()
    t = torch.clamp(step, max=MAX_STEP_EXPONENT)
    scalars[BC1] = torch.where(skip, scalars[BC1], 1.0 - torch.pow(hyper[1], t))
    scalars[BC2] = torch.where(skip, scalars[BC2], 1.0 - torch.pow(hyper[2], t))
    scalars[STEP] = step
    scalars[GRAD_NORM] = norm
    scalars[CLIP_COEF] = clip
    scalars[FOUND_INF] = found_inf.double()
    scalars[INV_SCALE] = inv_scale


def adamw_step_ref(param, grad, exp_avg, exp_avg_sq, hyper, scalars, n_decay, compute=None):
    """One AdamW step over flat float32 arenas, reading lr/betas/eps/wd from ``hyper`` and the clip
    coefficient, inverse loss scale and bias corrections from ``scalars`` (see :func:`grad_stats_ref`).

    Skipped entirely (nothing written) when ``found_inf`` and ``skip_on_overflow`` are both set. Writes the
    compute copy (``compute[i] = param[i]`` cast) in the same step when given.
    """
    skip = (scalars[FOUND_INF] > 0) & (hyper[6] > 0)
    f32 = torch.float32
    # Scalars are formed in float64 and rounded once to float32, as torch does with Python floats.
    decay = (1.0 - hyper[0] * hyper[4]).to(f32)
    w1, b2, w2, eps = (1.0 - hyper[1]).to(f32), hyper[2].to(f32), (1.0 - hyper[2]).to(f32), hyper[3].to(f32)
    neg_step_size = (-(hyper[0] / scalars[BC1])).to(f32)
    bc2_sqrt = torch.sqrt(scalars[BC2]).to(f32)
    g = (grad * scalars[INV_SCALE].to(f32)) * scalars[CLIP_COEF].to(f32)
    p = param.clone()
    p[:n_decay].mul_(decay)
    m = exp_avg.lerp(g, w1)
    v = exp_avg_sq * b2 + w2 * g * g
    denom = v.sqrt() / bc2_sqrt + eps
    p = p + neg_step_size * m / denom
    param.copy_(torch.where(skip, param, p))
    exp_avg.copy_(torch.where(skip, exp_avg, m))
    exp_avg_sq.copy_(torch.where(skip, exp_avg_sq, v))
    if compute is not None:
        compute.copy_(param)


def _cuda_ext(t: torch.Tensor):
    return extension("cuda") if t.is_cuda else None


def _cpu_kernels(kernels, t: torch.Tensor):
    """The CPU extension to run on, or None (the reference): only a float32 CPU arena with ``kernels`` given."""
    if kernels is None or t.device.type != "cpu" or t.dtype != torch.float32:
        return None
    return kernels if hasattr(kernels, "adamw_step") else None


_COUNTERS: dict = {}


def _counter(device) -> torch.Tensor:
    key = torch.device(device)
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=key)
    return c


def _extra_f32(extra_grad_sq):
    """A head's squared grad norm as the [1] float32 tensor the extensions take (None stays None)."""
    if extra_grad_sq is None:
        return None
    extra = extra_grad_sq.reshape(1)
    return extra if extra.dtype == torch.float32 else extra.float()


def grad_stats(grad, extra_grad_sq, loss_scale, hyper, scalars, kernels=None):
    """:func:`grad_stats_ref` semantics; one fused reduction kernel on CUDA. Writes ``scalars``, no sync.

    ``kernels``: the CPU extension (``net.kernels`` of a ``cpu`` backbone) to run the C++ pass on a float32
    CPU arena; None runs the reference there. Ignored on CUDA. Shapes and dtypes as :func:`grad_stats_ref`;
    the C++ pass raises ValueError naming a wrong shape, dtype or device.
    """
    cpu = _cpu_kernels(kernels, grad)
    if cpu is not None:
        cpu.grad_stats(grad, _extra_f32(extra_grad_sq), loss_scale.reshape(1), hyper, scalars)
        return None
    ext = _cuda_ext(grad)
    if ext is None:
        return grad_stats_ref(grad, extra_grad_sq, loss_scale, hyper, scalars)
    ext.grad_stats(grad, _extra_f32(extra_grad_sq), loss_scale.reshape(1), hyper, scalars, _counter(grad.device))


def adamw_step(param, grad, exp_avg, exp_avg_sq, hyper, scalars, n_decay, compute=None, kernels=None,
               zero_grad: bool = False):
    """:func:`adamw_step_ref` semantics; one fused kernel on CUDA (param, moments, compute in place).

    ``kernels``: the CPU extension to run the C++ pass on float32 CPU arenas (param, grad, exp_avg,
    exp_avg_sq: contiguous [P]; compute: [P] float32 written in the same pass, or bf16/f16 cast after it);
    None runs the reference there. Ignored on CUDA. ``zero_grad``: leave ``grad`` all zeros afterwards (also
    on a skipped overflow step); on CUDA the kernel zeroes each element once it has read it, which saves the
    separate memset launch of a ``grad.zero_()``, and the C++ pass on the CPU does the same (one pass over the
    arena instead of two, the zeroing spread over its threads). The C++ pass raises ValueError naming a wrong
    shape, dtype, device or an n_decay outside [0, P].
    """
    cpu = _cpu_kernels(kernels, param)
    if cpu is not None:
        cpu.adamw_step(param, grad, exp_avg, exp_avg_sq, hyper, scalars, int(n_decay), compute, bool(zero_grad))
        return None
    ext = _cuda_ext(param)
    if ext is None:
        adamw_step_ref(param, grad, exp_avg, exp_avg_sq, hyper, scalars, n_decay, compute)
        if zero_grad:
            grad.zero_()
        return None
    ext.adamw_step(param, grad, exp_avg, exp_avg_sq, hyper, scalars, int(n_decay), compute, bool(zero_grad))


# optim_step on CUDA: grad_stats and AdamW as one cooperative launch where the arena fits (grad_stats' grid of
# <= 264 blocks co-resident, <= 8 elements per thread); False: always the two launches (the same bits either way;
# benchmarks/ab_configs.py --configs base optsplit times both in one process).
FUSED = True


def optim_step(param, grad, exp_avg, exp_avg_sq, extra_grad_sq, loss_scale, hyper, scalars, n_decay, compute=None,
               zero_grad: bool = False) -> bool:
    """:func:`grad_stats` then :func:`adamw_step` (their semantics, shapes and dtypes), on CUDA as one launch.

    On CUDA, where :data:`FUSED` is set and the arena fits (P <= 540,672 elements: grad_stats' 264-block grid
    at 8 elements per thread, all blocks co-resident), one cooperative kernel computes every block's partial
    sums, synchronises the grid, sums the partials in grad_stats' fixed order and applies AdamW: the same bits
    as the two launches, without grad_stats' serial last-block tail. Elsewhere (larger arenas, the CPU, float64)
    the two functions run in turn. Returns True where the fused launch ran. Raises ValueError (the CUDA
    binding's checks) naming a wrong shape, dtype or device.
    """
    ext = _cuda_ext(param)
    if ext is None:
        grad_stats(grad, extra_grad_sq, loss_scale, hyper, scalars)
        adamw_step(param, grad, exp_avg, exp_avg_sq, hyper, scalars, n_decay, compute, zero_grad=zero_grad)
        return False
    return ext.optim_step(param, grad, exp_avg, exp_avg_sq, _extra_f32(extra_grad_sq), loss_scale.reshape(1), hyper,
                          scalars,
                          _counter(grad.device), int(n_decay), compute, bool(zero_grad), bool(FUSED))
