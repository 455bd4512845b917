"""One-token backbone step for acting: ``backbone_step`` (CUDA, one launch for every layer) and its
pure-torch twin ``backbone_step_ref`` (the sequence references with T = 1: same semantics as forward).

Contract (both): ``backbone_step(x_t, weights, conv_state, ssm_state, episode_starts, cfg) -> feat``
    x_t [B, input_dim] float32; weights: name -> tensor with the HF / mamba_ssm names (GEMM weights
    ``input_proj.weight/bias``, ``in_proj``, ``x_proj``, ``dt_proj``, ``out_proj`` may be in the compute
    dtype, everything else float32; ``conv1d.weight`` is [d_inner, 1, d_conv]); conv_state
    [L, B, d_inner, d_conv-1] and ssm_state [L, B, d_inner, d_state] float32, updated in place;
    episode_starts [B] bool or None (rows with True are zeroed before consuming x_t).
    Returns feat [B, d_model] float32.

The CUDA path allocates only its output (torch's caching allocator), launches one kernel on the current
stream and never syncs, so it can be captured in a CUDA graph; it reads the weights in place, so optimizer
updates of the shared (compute) weights are seen at the next step without recapture.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["backbone_step", "backbone_step_ref"]

_LAYER_KEYS = ("norm.weight", "mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias",
               "mixer.x_proj.weight", "mixer.dt_proj.weight", "mixer.dt_proj.bias", "mixer.A_log", "mixer.D",
               "mixer.out_proj.weight")


def _eps(cfg):
    return float(getattr(cfg, "rms_norm_eps", 1e-5))


def backbone_step_ref(x_t, weights, conv_state, ssm_state, episode_starts, cfg):
    """Pure-torch one-token step (composes the lead's sequence refs with T = 1); states updated in place."""
    from .conv import causal_conv1d_ref
    from .norm import rms_norm_ref
    from .scan import selective_scan_ref
    L = conv_state.shape[0]
    di, n = conv_state.shape[2], ssm_state.shape[3]
    eps = _eps(cfg)
    starts = None if episode_starts is None else episode_starts.reshape(-1, 1)
    wi = weights["input_proj.weight"]
    rdt = torch.promote_types(x_t.dtype, torch.float32)
    h = F.linear(x_t.to(wi.dtype), wi, weights["input_proj.bias"]).to(rdt).unsqueeze(1)  # [B, 1, dm]
    for i in range(L):
        w = lambda k: weights[f"layers.{i}.{k}"]
        cdt = w("mixer.in_proj.weight").dtype
        u = rms_norm_ref(h, w("norm.weight"), eps, cdt)
        xz = F.linear(u, w("mixer.in_proj.weight"))
        xi, z = xz.split(di, dim=-1)
        xc, cf = causal_conv1d_ref(xi, w("mixer.conv1d.weight").reshape(di, -1), w("mixer.conv1d.bias"),
                                   conv_state[i], starts)
        r = w("mixer.dt_proj.weight").shape[1]
        dbc = F.linear(xc.to(cdt), w("mixer.x_proj.weight"))
        dt_r, Bm, Cm = dbc.split([r, n, n], dim=-1)
        dt = F.linear(dt_r, w("mixer.dt_proj.weight"))
        y, sf = selective_scan_ref(xc, dt, w("mixer.A_log"), Bm, Cm, w("mixer.D"), z, w("mixer.dt_proj.bias"),
                                   ssm_state[i], starts)
        h = h + F.linear(y.to(cdt), w("mixer.out_proj.weight")).to(rdt)
        conv_state[i].copy_(cf)
        ssm_state[i].copy_(sf)
    return rms_norm_ref(h, weights["norm_f.weight"], eps, rdt)[:, 0]


def _f32(t):
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def backbone_step(x_t, weights, conv_state, ssm_state, episode_starts, cfg, rows_per_block: int = 0):
    """CUDA one-token step through every layer in one launch (same contract as :func:`backbone_step_ref`).

    Falls back to the reference for inputs the kernel does not take (non-CUDA, float64, d_state not in
    {8, 16}, d_conv != 4). ``rows_per_block``: 0 = automatic; R > 0 runs one block per R rows (every
    layer in one block); R < 0 runs the thread-block-cluster kernel (8 blocks split d_inner, partial sums
    exchanged through distributed shared memory) with -R rows per cluster.
    """
    from ._dispatch import extension
    ext = extension() if x_t.is_cuda else None
    if (ext is None or x_t.dtype == torch.float64 or conv_state.dtype != torch.float32
            or ssm_state.shape[3] not in (8, 16) or conv_state.shape[3] != 3):
        return backbone_step_ref(x_t, weights, conv_state, ssm_state, episode_starts, cfg)
    L, di = conv_state.shape[0], conv_state.shape[2]
    wdt = weights["input_proj.weight"].dtype
    gemm = lambda t: t if t.dtype == wdt and t.is_contiguous() else t.to(wdt).contiguous()
    layers = []
    for i in range(L):
        t = [weights[f"layers.{i}.{k}"] for k in _LAYER_KEYS]
        layers.append([_f32(t[0]), gemm(t[1]), _f32(t[2]).reshape(di, -1), _f32(t[3]), gemm(t[4]), gemm(t[5]),
                       _f32(t[6]), _f32(t[7]), _f32(t[8]), gemm(t[9])])
    starts = None if episode_starts is None else episode_starts.reshape(-1).to(torch.bool).contiguous()
    return ext.backbone_step(_f32(x_t), weights["input_proj.weight"].contiguous(), gemm(weights["input_proj.bias"]),
                             _f32(weights["norm_f.weight"]), layers, conv_state, ssm_state, starts, _eps(cfg),
                             int(rows_per_block))
