"""Selective scan (Mamba-1 S6 recurrence) with fused softplus, D skip, SiLU(z) gate and per-row resets.

Follows Gu & Dao 2023 (arXiv:2312.00752), Algorithm 2, as computed by mamba_ssm's
``selective_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True)``, in channels-last layout.
For row b, channel d, state index n and step t::

    dt[t]   = softplus(dt_raw[b, t, d] + dt_bias[d])
    A[d, n] = -exp(A_log[d, n])                      (read fresh from A_log on every call)
    s[t]    = exp(dt[t] * A[d, n]) * s[t-1] + dt[t] * x[b, t, d] * Bm[b, t, n]
    y[b,t,d] = (sum_n s[t][n] * Cm[b, t, n] + D[d] * x[b, t, d]) * SiLU(z[b, t, d])

with ``s[-1] = ssm_state[b, d, :]``, and ``s[t-1] = 0`` when ``episode_starts[b, t]`` is True.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .capability import kernel_support
from .checks import act, bool_c, check_tensor, f32c
from .extension import kernels_for

__all__ = ["selective_scan", "selective_scan_ref"]


def _validate(x, dt, A_log, Bm, Cm, D, z, dt_bias, ssm_state, episode_starts):
    if x.dim() != 3:
        raise ValueError(f"selective_scan: x must be [B, T, D], got shape {tuple(x.shape)}")
    Bsz, T, Di = x.shape
    dev = x.device
    check_tensor("selective_scan: dt", dt, shape=(Bsz, T, Di), device=dev)
    check_tensor("selective_scan: A_log", A_log, shape=(Di, None), device=dev)
    N = A_log.shape[1]
    check_tensor("selective_scan: Bm", Bm, shape=(Bsz, T, N), device=dev)
    check_tensor("selective_scan: Cm", Cm, shape=(Bsz, T, N), device=dev)
    check_tensor("selective_scan: D", D, shape=(Di,), device=dev)
    check_tensor("selective_scan: z", z, shape=(Bsz, T, Di), device=dev)
    check_tensor("selective_scan: dt_bias", dt_bias, shape=(Di,), device=dev)
    if ssm_state is not None:
        check_tensor("selective_scan: ssm_state", ssm_state, shape=(Bsz, Di, N), device=dev)
    if episode_starts is not None:
        check_tensor("selective_scan: episode_starts", episode_starts, shape=(Bsz, T), dtype=torch.bool,
                     device=dev)
    return Bsz, T, Di, N


def selective_scan_ref(x, dt, A_log, Bm, Cm, D, z, dt_bias, ssm_state=None, episode_starts=None):
    """Pure-torch reference: a loop over T of vectorised [B, D, N] updates (differentiable by autograd).

    Args:
        x: [B, T, D] float, the post-conv activations (u in mamba_ssm).
        dt: [B, T, D] float, dt_proj output before bias and softplus.
        A_log: [D, N] float.
        Bm, Cm: [B, T, N] float, input-dependent B and C.
        D: [D] float skip weight.
        z: [B, T, D] float gate input.
        dt_bias: [D] float (dt_proj.bias).
        ssm_state: [B, D, N] float or None (zeros).
        episode_starts: [B, T] bool or None.
    Returns:
        (y [B, T, D] in x.dtype, final_state [B, D, N] in float32, or float64 when the inputs are).
    Raises:
        ValueError: on a shape, dtype or device mismatch.
    """
    Bsz, T, Di, N = _validate(x, dt, A_log, Bm, Cm, D, z, dt_bias, ssm_state, episode_starts)
    cdt = torch.promote_types(torch.promote_types(x.dtype, A_log.dtype), torch.float32)
    xf, zf = x.to(cdt), z.to(cdt)
    delta = F.softplus(dt.to(cdt) + dt_bias.to(cdt))  # [B, T, D]
    A = -torch.exp(A_log.to(cdt))  # [D, N]
    dA = torch.exp(delta.unsqueeze(-1) * A)  # [B, T, D, N]
    dBx = (delta * xf).unsqueeze(-1) * Bm.to(cdt).unsqueeze(2)  # [B, T, D, N]
    Cf = Cm.to(cdt)
    s = x.new_zeros((Bsz, Di, N), dtype=cdt) if ssm_state is None else ssm_state.to(cdt)
    # unbind once along T: indexing [:, t] in the loop would make autograd scatter each step's gradient
    # into a full-size zero tensor (quadratic in T); unbind's backward stacks them once.
    dA_t, dBx_t, C_t = dA.unbind(1), dBx.unbind(1), Cf.unbind(1)
    starts_t = None if episode_starts is None else episode_starts[:, :, None, None].unbind(1)
    zero = torch.zeros((), dtype=cdt, device=x.device)
    ys = []
    for t in range(T):
        if starts_t is not None:  # select, not multiply: a NaN of the old episode must not leak
            s = torch.where(starts_t[t], zero, s)
        s = dA_t[t] * s + dBx_t[t]
        ys.append((s * C_t[t].unsqueeze(1)).sum(-1))
    y = torch.stack(ys, dim=1) if T > 0 else xf.new_zeros(Bsz, 0, Di)
    y = (y + D.to(cdt) * xf) * F.silu(zf)
    return y.to(x.dtype), s


class _SelectiveScanKernel(torch.autograd.Function):
    """The extension's scan_fwd / scan_bwd (CUDA or CPU, the same contract) as one autograd node."""

    @staticmethod
    def forward(ctx, ext, x, dt, A_log, Bm, Cm, D, z, dt_bias, ssm_state, episode_starts):
        ty = x.dtype
        dt, Bm, Cm, z = act(dt, ty), act(Bm, ty), act(Cm, ty), act(z, ty)
        A32, D32, db32, init = f32c(A_log), f32c(D), f32c(dt_bias), f32c(ssm_state)
        need = any(ctx.needs_input_grad)  # grad mode is off inside forward; this says if bwd can run
        y, final, ckpt = ext.scan_fwd(x, dt, A32, Bm, Cm, D32, z, db32, init, episode_starts, need)
        ctx.save_for_backward(x, dt, A32, Bm, Cm, D32, z, db32, init, episode_starts)
        ctx.ext, ctx.ckpt = ext, ckpt
        ctx.dtypes = (dt.dtype, A_log.dtype, Bm.dtype, Cm.dtype, D.dtype, z.dtype, dt_bias.dtype,
                      None if ssm_state is None else ssm_state.dtype)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A32, Bm, Cm, D32, z, db32, init, starts = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        dy = act(dy, x.dtype)
        dfinal = None if dfinal is None else dfinal.to(torch.float32).contiguous()
        need_dinit = init is not None and ctx.needs_input_grad[9]
        dx, ddt, dA, dB, dC, dD, dz, ddb, dinit = ctx.ext.scan_bwd(
            x, dt, A32, Bm, Cm, D32, z, db32, init, starts, ctx.ckpt, dy, dfinal, need_dinit)
        t = ctx.dtypes
        return (None, dx, ddt, dA.to(t[1]), dB, dC, dD.to(t[4]), dz, ddb.to(t[6]),
                dinit.to(t[7]) if need_dinit else None, None)


def selective_scan(x, dt, A_log, Bm, Cm, D, z, dt_bias, ssm_state=None, episode_starts=None):
    """Selective scan with resets: the CUDA or CPU kernel when one takes the inputs
    (:func:`~mamba_rl.ops.capability.kernel_support` "scan": the CUDA kernel only d_state 8 or 16), else
    :func:`selective_scan_ref`.

    Same arguments and returns as :func:`selective_scan_ref`; differentiable w.r.t. every float input.
    The CUDA kernel is a two-level scan: T is cut into segments of whole checkpoint chunks (the count chosen
    from B * d_inner and the GPU's SM count, ``ext.scan_segments``), each segment scanned from zero, the
    segments combined in a fixed order and re-run from their true entering state (forward and the adjoint
    recurrence of the backward alike), so results are deterministic for a given shape and device.
    """
    ext = kernels_for(x, A_log)
    if ext is None or A_log.dim() != 2 or not kernel_support(x.device.type, "scan", d_state=A_log.shape[-1],
                                                             dtype=x.dtype):
        return selective_scan_ref(x, dt, A_log, Bm, Cm, D, z, dt_bias, ssm_state, episode_starts)
    _validate(x, dt, A_log, Bm, Cm, D, z, dt_bias, ssm_state, episode_starts)
    return _SelectiveScanKernel.apply(ext, act(x, x.dtype), dt, A_log, Bm, Cm, D, z, dt_bias, ssm_state,
                                      bool_c(episode_starts))
