"""One-token step of the backbone for acting: the kernel call (CUDA or CPU, one launch / call for every
layer) and its pure-torch twin, a dedicated one-token recurrence (no sequence machinery).

Contract (both): ``backbone_step(x_t, weights, conv_state, ssm_state, episode_starts, cfg) -> feat``
    x_t [B, input_dim] float32 (float64 for the reference); weights: name -> tensor with the HF /
    mamba_ssm names (the GEMM weights ``input_proj.weight/bias``, ``in_proj``, ``x_proj``, ``dt_proj``,
    ``out_proj`` may be in the compute dtype, everything else float32; ``conv1d.weight`` is
    [d_inner, 1, d_conv]); conv_state [L, B, d_inner, d_conv-1] and ssm_state [L, B, d_inner, d_state]
    float32, updated in place; episode_starts [B] bool or None (rows with True are zeroed before
    consuming x_t). Returns feat [B, d_model] float32.

One layer, for a row whose window ``w = [conv_state, xi]`` (oldest first) and state ``s`` (Gu & Dao 2023,
Algorithm 2 with T = 1, as mamba_ssm's ``Mamba.step``)::

    u = RMSNorm(h);  xi, z = split(u @ in_proj.T);  xc = SiLU(sum_k w[:, k] * conv_w[:, k] + conv_b)
    dt_r, B, C = split(xc @ x_proj.T);  dt = softplus(dt_r @ dt_proj.T + dt_bias);  A = -exp(A_log)
    s = exp(dt * A) * s + (dt * xc) B;  y = (s C + D * xc) * SiLU(z);  h = h + y @ out_proj.T

The kernel path allocates only its output, runs on the current stream and never syncs (CUDA graphs can
capture it); it reads the weights in place, so optimizer updates are seen at the next step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .norm import rms_norm_ref

__all__ = ["backbone_step", "backbone_step_packed", "pack_step_weights", "backbone_step_ref", "layer_step_ref",
           "LAYER_KEYS"]

STEP_KERNELS = ("auto", "rows", "cluster", "cluster_normpass", "cluster2", "cluster3")

LAYER_KEYS = ("norm.weight", "mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias",
              "mixer.x_proj.weight", "mixer.dt_proj.weight", "mixer.dt_proj.bias", "mixer.A_log", "mixer.D",
              "mixer.out_proj.weight")


def layer_step_ref(h: torch.Tensor, w, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                   episode_starts: torch.Tensor | None, eps: float) -> torch.Tensor:
    """One token through one residual Mamba block (the module docstring's math); states in place.

    Args:
        h: [B, d_model] residual stream (float32 or float64).
        w: callable, ``w(key)`` -> the layer's tensor for a key of :data:`LAYER_KEYS`.
        conv_state: [B, d_inner, d_conv-1], ssm_state: [B, d_inner, d_state]; written in place.
        episode_starts: [B] bool or None; True rows start from a zero window and state.
        eps: RMSNorm epsilon.
    Returns:
        the new residual stream [B, d_model] in h's dtype.
    """
    rdt = h.dtype
    cdt = w("mixer.in_proj.weight").dtype
    di, n = ssm_state.shape[1], ssm_state.shape[2]
    if episode_starts is not None:  # select, not multiply: a NaN of the old episode must not leak
        keep = ~episode_starts.view(-1, 1, 1)
        conv_state.copy_(torch.where(keep, conv_state, torch.zeros((), dtype=conv_state.dtype, device=h.device)))
        ssm_state.copy_(torch.where(keep, ssm_state, torch.zeros((), dtype=ssm_state.dtype, device=h.device)))
    sdt = torch.promote_types(ssm_state.dtype, torch.promote_types(rdt, torch.float32))
    u = rms_norm_ref(h, w("norm.weight"), eps, cdt)
    xz = F.linear(u, w("mixer.in_proj.weight"))
    xi, z = xz[:, :di].to(sdt), xz[:, di:].to(sdt)
    win = torch.cat([conv_state.to(sdt), xi.unsqueeze(-1)], dim=-1)  # [B, di, K]
    cw = w("mixer.conv1d.weight").reshape(di, -1).to(sdt)
    xc = F.silu((win * cw).sum(-1) + w("mixer.conv1d.bias").to(sdt))
    if conv_state.shape[-1] > 0:
        conv_state.copy_(win[:, :, 1:])
    r = w("mixer.dt_proj.weight").shape[1]
    dbc = F.linear(xc.to(cdt), w("mixer.x_proj.weight"))
    dt = F.softplus(F.linear(dbc[:, :r], w("mixer.dt_proj.weight")).to(sdt) + w("mixer.dt_proj.bias").to(sdt))
    Bm, Cm = dbc[:, r:r + n].to(sdt), dbc[:, r + n:].to(sdt)
    A = -torch.exp(w("mixer.A_log").to(sdt))  # [di, n]
    s = torch.exp(dt.unsqueeze(-1) * A) * ssm_state.to(sdt) + (dt * xc).unsqueeze(-1) * Bm.unsqueeze(1)
    ssm_state.copy_(s)
    y = ((s * Cm.unsqueeze(1)).sum(-1) + w("mixer.D").to(sdt) * xc) * F.silu(z)
    return h + F.linear(y.to(cdt), w("mixer.out_proj.weight")).to(rdt)


def backbone_step_ref(x_t, weights, conv_state, ssm_state, episode_starts, cfg):
    """Pure-torch one-token step through every layer (float32 or float64); states updated in place."""
    eps = float(cfg.rms_norm_eps)
    wi = weights["input_proj.weight"]
    rdt = torch.promote_types(x_t.dtype, torch.float32)
    h = F.linear(x_t.to(wi.dtype), wi, weights["input_proj.bias"]).to(rdt)
    for i in range(conv_state.shape[0]):
        h = layer_step_ref(h, lambda k: weights[f"layers.{i}.{k}"], conv_state[i], ssm_state[i],
                           episode_starts, eps)
    return rms_norm_ref(h, weights["norm_f.weight"], eps, rdt)


def _f32(t):
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def pack_step_weights(weights: dict, n_layers: int, d_inner: int) -> tuple:
    """The kernels' argument layout of ``weights`` (views, no copies when the dtypes already fit): build it
    once and pass it to :func:`backbone_step_packed` on every token (in-place weight updates are seen)."""
    wdt = weights["input_proj.weight"].dtype
    gemm = lambda t: t if t.dtype == wdt and t.is_contiguous() else t.to(wdt).contiguous()  # noqa: E731
    layers = []
    for i in range(n_layers):
        t = [weights[f"layers.{i}.{k}"] for k in LAYER_KEYS]
        layers.append([_f32(t[0]), gemm(t[1]), _f32(t[2]).reshape(d_inner, -1), _f32(t[3]), gemm(t[4]), gemm(t[5]),
                       _f32(t[6]), _f32(t[7]), _f32(t[8]), gemm(t[9])])
    return (weights["input_proj.weight"].contiguous(), gemm(weights["input_proj.bias"]), _f32(weights["norm_f.weight"]),
            layers)


def backbone_step_packed(ext, x_t, packed: tuple, conv_state, ssm_state, episode_starts, eps: float,
                         kernel: str = "auto", rows_per_block: int = 0):
    """:func:`backbone_step` with the weights already packed by :func:`pack_step_weights`."""
    if kernel not in STEP_KERNELS:
        raise ValueError(f"backbone_step: kernel must be one of {STEP_KERNELS}, got {kernel!r}")
    if isinstance(rows_per_block, bool) or not isinstance(rows_per_block, int) or rows_per_block < 0:
        raise ValueError(f"backbone_step: rows_per_block must be an int >= 0, got {rows_per_block!r}")
    starts = None if episode_starts is None else episode_starts.reshape(-1).to(torch.bool).contiguous()
    # The binding's last argument: 0 = auto, R > 0 = one block per R rows, -R = cluster kernel with R rows,
    # -R - 16 = the cluster kernel with its RMSNorm as a separate pass (the same bits), -R - 32 = cluster2,
    # -R - 64 = cluster3.
    r = max(rows_per_block, 1)
    code = {"auto": 0, "rows": r, "cluster": -r, "cluster_normpass": -r - 16, "cluster2": -r - 32,
            "cluster3": -r - 64}[kernel]
    inp_w, inp_b, normf, layers = packed
    return ext.backbone_step(_f32(x_t), inp_w, inp_b, normf, layers, conv_state, ssm_state, starts, float(eps),
                             int(code))


def backbone_step(ext, x_t, weights, conv_state, ssm_state, episode_starts, cfg, kernel: str = "auto",
                  rows_per_block: int = 0):
    """The extension's one-call step through every layer (same contract as :func:`backbone_step_ref`).

    Args:
        ext: the CUDA or CPU extension (:func:`mamba_rl.ops.extension.kernels_for`); the CUDA kernel takes
            d_state 8 or 16 and d_conv 4.
        kernel: CUDA only. "auto" (measured choice), "rows" (one block per ``rows_per_block`` rows, every
            layer in one block), "cluster" (a thread-block cluster of 8 blocks splits d_inner, partial
            sums exchanged through distributed shared memory, ``rows_per_block`` rows per cluster; every warp
            forms each layer's RMSNorm as in_proj reads it), "cluster_normpass" (the same kernel with the norm as
            a pass behind a block barrier, as before: the same bits, kept for timing the two in one process) or
            "cluster2" (d_model 128 / d_inner 256 only; ``rows_per_block`` 1, 2, 4, 8 or 16 rows per cluster of 8
            blocks: each projection's weights read coalesced in their own layout by lane groups and each row summed
            over its group by a fixed shuffle tree; the x_proj / out_proj sums over a block's channels pushed into
            every block of the cluster (st.async into distributed shared memory, completing on the receiver's
            mbarrier: no cluster barrier per exchange) and added there in rank order; every weight prefetched into
            registers one layer ahead; "auto" picks it for B <= 32 with the fewest rows per cluster that keep <= 8
            clusters, where its shared memory fits the device) or "cluster3" (cluster2's shapes; ``rows_per_block``
            8, 16, 24 or 32 rows per cluster, for large B: each projection a product over the rows with a thread per
            output and slice of its reduction, out_proj's sums reduce-scattered to the block that owns 16 columns of
            the residual, which adds them and sends its columns to every block; "auto" picks it for 32 < B <= 512:
            8 rows a cluster up to B = 64, 16 up to 128, 32 up to 256, 16 above).
    Raises:
        ValueError: an unknown ``kernel`` or a negative ``rows_per_block``.
        RuntimeError: a forced kernel that cannot take the shapes (e.g. "cluster2" at another d_model).
    """
    packed = pack_step_weights(weights, conv_state.shape[0], conv_state.shape[2])
    return backbone_step_packed(ext, x_t, packed, conv_state, ssm_state, episode_starts, cfg.rms_norm_eps, kernel,
                                rows_per_block)
