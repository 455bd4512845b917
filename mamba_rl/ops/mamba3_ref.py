"""Mamba-3 SISO recurrence, pure-torch reference (float32 or float64), with per-row episode resets.

The math is the SISO recurrence of Lahoti et al., "Mamba-3: Improved Sequence Modeling using State Space
Principles" (ICLR 2026): exponential-trapezoidal discretisation and data-dependent rotary (complex) state
dynamics, in the form mamba_ssm computes it (``mamba_ssm/ops/triton/mamba3/mamba3_siso_combined.py``,
arguments Q=C, K=B, V=x, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z; its step reference in
``tests/ops/triton/test_mamba3_siso.py``). Written here from those semantics, not copied.

For row b, head h (P = headdim channels p, N = d_state, R = rotary angles) and step t::

    theta[t] = (theta[t-1] + pi * tanh(angles[t]) * dt[t])  mod 2 pi      # accumulated angle [R]
    q~[t]    = Rot(theta[t]) (q[t] + q_bias),  k~[t] = Rot(theta[t]) (k[t] + k_bias)
    lam[t]   = sigmoid(trap[t]),  alpha[t] = exp(adt[t])                  # adt = A * dt <= 0
    S[t]     = alpha[t] S[t-1] + (1 - lam[t]) dt[t] alpha[t] v[t-1] k~[t-1]^T + lam[t] dt[t] v[t] k~[t]^T
    y[t]     = S[t] q~[t] + D v[t]            (times SiLU(z[t]) when z is given)

``Rot(theta)`` rotates the pairs (2i, 2i+1), i < R, of an N-vector by theta_i as a real 2x2 rotation
(``[a, b] -> [a cos - b sin, a sin + b cos]``, mamba_ssm's SISO "pairwise" layout); entries 2R..N-1 are
not rotated. S[t] is [P, N]. The state carried between calls (and zeroed by a reset) is the 4-tuple
``(angle [B, H, R], ssm [B, H, P, N], k [B, H, N], v [B, H, P])``: the accumulated angle, the SSM state,
and the previous step's rotated k~ and its v (the trapezoid's second point). With ``episode_starts[b, t]``
True all four are zero before step t (selects, not multiplies: a NaN of the old episode never leaks), so
the step starts as a fresh sequence: theta = pi tanh(angles) dt, S = lam dt v k~^T.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .checks import check_tensor

__all__ = ["mamba3_scan_ref", "mamba3_step_ref", "rotate_pairs"]

TWO_PI = 2 * math.pi


def rotate_pairs(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (2i, 2i+1), i < R, of the last dim of ``t`` [..., N] by the angles whose cos / sin
    are ``cos`` / ``sin`` [..., R] (2R <= N); the entries from 2R on pass unchanged. Same dtype as ``t``."""
    R = cos.shape[-1]
    pairs = t[..., :2 * R].unflatten(-1, (R, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((rot, t[..., 2 * R:]), dim=-1) if 2 * R < t.shape[-1] else rot


def _core(q, k, v, alpha, c_prev, c_cur, dang, q_bias, k_bias, D, angle, ssm, kp, vp):
    """One step on [B, H, ...] slices (see the module doc). c_prev = (1 - lam) dt alpha, c_cur = lam dt.
    Returns (y before the gate [B, H, P], angle, ssm, k~, v)."""
    angle = angle + dang
    angle = angle - TWO_PI * torch.floor(angle / TWO_PI)  # floor: no gradient, d angle / d angle_prev = 1
    cos, sin = torch.cos(angle), torch.sin(angle)
    qr = rotate_pairs(q + q_bias, cos, sin)
    kr = rotate_pairs(k + k_bias, cos, sin)
    ssm = alpha[..., None, None] * ssm + _inflow(c_prev, vp, kp, c_cur, v, kr)
    y = (ssm * qr.unsqueeze(-2)).sum(-1) + D[:, None] * v
    return y, angle, ssm, kr, v


def _inflow(c_prev, vp, kp, c_cur, v, kr):
    """The trapezoid's two input terms [.., P, N]: c_prev v_{t-1} k~_{t-1}^T + c_cur v_t k~_t^T."""
    return (c_prev[..., None, None] * (vp.unsqueeze(-1) * kp.unsqueeze(-2))
            + c_cur[..., None, None] * (v.unsqueeze(-1) * kr.unsqueeze(-2)))


def _coefs(adt, dt, trap, angles):
    """Elementwise per-step coefficients: alpha, (1-lam) dt alpha, lam dt, the angle increment."""
    lam = torch.sigmoid(trap)
    alpha = torch.exp(adt)
    dang = math.pi * torch.tanh(angles) * dt.unsqueeze(-1)
    return alpha, (1 - lam) * dt * alpha, lam * dt, dang


def _validate(where, q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, state, starts, T_dims):
    lead = v.shape[:T_dims + 1]  # (B,) or (B, T)
    if v.dim() != T_dims + 3:
        raise ValueError(f"{where}: v must be [B{', T' if T_dims else ''}, H, P], got shape {list(v.shape)}")
    H, P = v.shape[-2:]
    dev = v.device
    check_tensor(f"{where}: q", q, shape=(*lead, H, None), device=dev, floating=True)
    N = q.shape[-1]
    check_tensor(f"{where}: k", k, shape=(*lead, H, N), device=dev, floating=True)
    for name, t in (("adt", adt), ("dt", dt), ("trap", trap)):
        check_tensor(f"{where}: {name}", t, shape=(*lead, H), device=dev, floating=True)
    check_tensor(f"{where}: angles", angles, shape=(*lead, H, None), device=dev, floating=True)
    R = angles.shape[-1]
    if not 1 <= R <= N // 2:
        raise ValueError(f"{where}: angles must hold 1 to d_state // 2 = {N // 2} angles per head, got {R}")
    check_tensor(f"{where}: q_bias", q_bias, shape=(H, N), device=dev, floating=True)
    check_tensor(f"{where}: k_bias", k_bias, shape=(H, N), device=dev, floating=True)
    check_tensor(f"{where}: D", D, shape=(H,), device=dev, floating=True)
    if z is not None:
        check_tensor(f"{where}: z", z, shape=(*lead, H, P), device=dev, floating=True)
    Bsz = lead[0]
    if state is not None:
        if not isinstance(state, (tuple, list)) or len(state) != 4:
            raise ValueError(f"{where}: state must be a tuple (angle, ssm, k, v), got {type(state).__name__}")
        for name, t, shp in (("angle", state[0], (Bsz, H, R)), ("ssm", state[1], (Bsz, H, P, N)),
                             ("k", state[2], (Bsz, H, N)), ("v", state[3], (Bsz, H, P))):
            check_tensor(f"{where}: state.{name}", t, shape=shp, device=dev, floating=True)
    if starts is not None:
        check_tensor(f"{where}: episode_starts", starts, shape=lead, dtype=torch.bool, device=dev)
    return Bsz, H, P, N, R


def _zero_state(Bsz, H, P, N, R, dtype, device):
    return (torch.zeros(Bsz, H, R, dtype=dtype, device=device), torch.zeros(Bsz, H, P, N, dtype=dtype, device=device),
            torch.zeros(Bsz, H, N, dtype=dtype, device=device), torch.zeros(Bsz, H, P, dtype=dtype, device=device))


def _math_dtype(*ts):
    dt = torch.float32
    for t in ts:
        dt = torch.promote_types(dt, t.dtype)
    return dt


def mamba3_scan_ref(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z=None, state=None, episode_starts=None):
    """The Mamba-3 SISO recurrence over a sequence, differentiable by autograd (every float input, the
    initial state included): two loops over T (the wrapped angle [B, H, R], then ``S = alpha S + inflow``
    [B, H, P, N]), the rotations, the trapezoid's inflow and the read-out vectorised over T.

    Args:
        q: [B, T, H, N] float, C after its RMSNorm (before ``q_bias``). k: [B, T, H, N], B likewise.
        v: [B, T, H, P] float, x (the values).
        adt: [B, T, H] float, A * dt (<= 0). dt: [B, T, H] float, softplus(dd_dt + dt_bias) (> 0).
        trap: [B, T, H] float, the trapezoid blend before its sigmoid.
        q_bias, k_bias: [H, N] float (C_bias, B_bias).
        angles: [B, T, H, R] float, the raw angle projection (before pi * tanh), 1 <= R <= N // 2.
        D: [H] float skip. z: [B, T, H, P] float gate input or None (no gate).
        state: (angle [B, H, R], ssm [B, H, P, N], k [B, H, N], v [B, H, P]) or None (zeros).
        episode_starts: [B, T] bool or None: True at (b, t) zeroes all four state parts of row b before t.
    Returns:
        (y [B, T, H, P], final state 4-tuple), in float32, or float64 when an input is float64.
    Raises:
        ValueError: a shape, dtype or device mismatch (expected vs received).
    """
    Bsz, H, P, N, R = _validate("mamba3_scan", q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, state,
                                episode_starts, 1)
    T = v.shape[1]
    cdt = _math_dtype(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D,
                      *(() if state is None else state))
    q, k, v, adt, dt, trap, angles = (t.to(cdt) for t in (q, k, v, adt, dt, trap, angles))
    q_bias, k_bias, D = q_bias.to(cdt), k_bias.to(cdt), D.to(cdt)
    st = _zero_state(Bsz, H, P, N, R, cdt, v.device) if state is None else tuple(s.to(cdt) for s in state)
    if T == 0:
        return v.new_zeros(Bsz, 0, H, P, dtype=cdt), st
    alpha, c_prev, c_cur, dang = _coefs(adt, dt, trap, angles)
    a, S, k0, v0 = st
    starts = episode_starts
    zero = torch.zeros((), dtype=cdt, device=v.device)
    # Two short loops over T on small tensors (indexing [:, t] in a loop would scatter each step's gradient
    # into a full-size zero tensor, quadratic in T: unbind once); everything else is vectorised over T.
    # 1. the accumulated angle, reset-aware and wrapped every step exactly as the one-token step does
    thetas = []
    starts_t = None if starts is None else starts.unbind(1)
    for t, inc in enumerate(dang.unbind(1)):
        if starts_t is not None:
            a = torch.where(starts_t[t][:, None, None], zero, a)
        a = a + inc
        a = a - TWO_PI * torch.floor(a / TWO_PI)
        thetas.append(a)
    theta = torch.stack(thetas, dim=1)  # [B, T, H, R]
    cos, sin = torch.cos(theta), torch.sin(theta)
    qr = rotate_pairs(q + q_bias, cos, sin)
    kr = rotate_pairs(k + k_bias, cos, sin)  # [B, T, H, N]
    # 2. the previous step's (k~, v): the carried ones at t = 0, zero at an episode start
    kp = torch.cat((k0.unsqueeze(1), kr[:, :-1]), dim=1)
    vp = torch.cat((v0.unsqueeze(1), v[:, :-1]), dim=1)
    if starts is not None:
        kp = torch.where(starts[:, :, None, None], zero, kp)
        vp = torch.where(starts[:, :, None, None], zero, vp)
    inflow = _inflow(c_prev, vp, kp, c_cur, v, kr)  # [B, T, H, P, N]
    # 3. S_t = alpha_t S_{t-1} + inflow_t, S zeroed before a start (select: an old NaN never leaks)
    Ss = []
    for t, (al, u) in enumerate(zip(alpha.unbind(1), inflow.unbind(1))):
        if starts_t is not None:
            S = torch.where(starts_t[t][:, None, None, None], zero, S)
        S = al[..., None, None] * S + u
        Ss.append(S)
    y = (torch.stack(Ss, dim=1) * qr.unsqueeze(-2)).sum(-1) + D[:, None] * v
    st = (a, S, kr[:, -1], v[:, -1])
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y, tuple(st)


def mamba3_step_ref(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, state, episode_starts=None):
    """One token of :func:`mamba3_scan_ref` (the same arguments without the T dim; ``state`` required).

    Args:
        q, k: [B, H, N]; v: [B, H, P]; adt, dt, trap: [B, H]; angles: [B, H, R]; z: [B, H, P] or None;
        q_bias, k_bias: [H, N]; D: [H]; state: the 4-tuple as in :func:`mamba3_scan_ref`;
        episode_starts: [B] bool or None (rows with True start from a zero state).
    Returns:
        (y [B, H, P], new state 4-tuple): fresh tensors; the caller copies the state where it lives.
    Raises:
        ValueError: a shape, dtype or device mismatch.
    """
    if state is None:
        raise ValueError("mamba3_step: state is required (a tuple angle, ssm, k, v)")
    _validate("mamba3_step", q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, state, episode_starts, 0)
    cdt = _math_dtype(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, *state)
    q, k, v, adt, dt, trap, angles = (t.to(cdt) for t in (q, k, v, adt, dt, trap, angles))
    st = tuple(s.to(cdt) for s in state)
    if episode_starts is not None:
        zero = torch.zeros((), dtype=cdt, device=v.device)
        st = tuple(torch.where(episode_starts.view(-1, *([1] * (s.dim() - 1))), zero, s) for s in st)
    alpha, c_prev, c_cur, dang = _coefs(adt, dt, trap, angles)
    y, *st = _core(q, k, v, alpha, c_prev, c_cur, dang, q_bias.to(cdt), k_bias.to(cdt), D.to(cdt), *st)
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y, tuple(st)
