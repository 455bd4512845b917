"""The Mamba-3 backbone on the kernel backends: one autograd node, hand-written backward into the grad arena.

The Mamba-3 twin of :mod:`mamba_rl.model.fused` (same design, same helpers): per layer the GEMMs (in_proj,
out_proj, with the residual add fused into the out_proj GEMM) run in torch, and everything between them (the
split of the in_proj output, dt / A / trapezoid coefficients, the B / C RMSNorms and biases, the rotary
angles, the exponential-trapezoidal scan with episode resets, the D skip and the gate or gated RMSNorm) is
one extension call, ``m3_fwd``, whose backward ``m3_bwd`` writes dL/d(in_proj output) and adds the small
parameter gradients straight into the flat gradient arena. The math is
:func:`mamba_rl.ops.mamba3_ref.mamba3_scan_ref` inside :class:`mamba_rl.model.mamba3.Mamba3Block`; the parity
tests compare the two (``tests/model/test_mamba3_cpu.py``).

The "cpu" backend (csrc/cpu/mamba3.cpp, float32) and the "cuda" backend (csrc/mamba3.cu: a float32 core,
the GEMMs in the compute dtype, float32 / bf16 / f16) have these kernels;
:func:`mamba_rl.ops.capability.kernel_support` ("m3_sequence") says where the node runs.
"""
from __future__ import annotations

import torch

from .fused import _acc_mm, _norm_bwd, _norm_flags, _norm_fwd, _residual_mm, _views

__all__ = ["fused_m3_backbone", "m3_core_kw", "m3_core_params"]

CORE_KEYS = ("mixer.dt_bias", "mixer.B_bias", "mixer.C_bias", "mixer.B_norm.weight", "mixer.C_norm.weight",
             "mixer.D")


def m3_core_params(views: dict, i: int, cfg) -> list:
    """The core's parameter tensors of layer ``i`` from a {name: view} dict of one arena (masters or grads):
    [dt_bias [H], B_bias [H, N], C_bias [H, N], B_norm.weight [N], C_norm.weight [N], D [H]] plus
    ``mixer.norm.weight`` [d_inner] under ``is_outproj_norm``; B_bias / C_bias viewed as [H, N]."""
    p = f"layers.{i}."
    H, N = cfg.nheads, cfg.d_state
    out = [views[p + k] for k in CORE_KEYS]
    out[1], out[2] = out[1].view(H, N), out[2].view(H, N)
    if cfg.is_outproj_norm:
        out.append(views[p + "mixer.norm.weight"])
    return out


def m3_core_kw(cfg) -> dict:
    """The core's scalar keyword arguments (``eps``, ``A_floor``, ``heavy_tail``) for ``cfg``, as every
    ``m3_fwd`` / ``m3_bwd`` / ``m3_step`` call takes them."""
    return dict(eps=float(cfg.rms_norm_eps), A_floor=float(cfg.A_floor), heavy_tail=cfg.A_activation == "heavy_tail")


class _M3Backbone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, net, carry0, ssm0, starts):
        ext = net.kernels
        c = net.cfg
        B, T, _ = x.shape
        BT, di, eps = B * T, c.d_inner, c.rms_norm_eps
        cdt = net.compute_dtype  # the GEMMs' dtype; the core is float32
        low = cdt != torch.float32
        W = net.arena if net.compute_arena is None else net.compute_arena
        vw, vm = _views(net, W), _views(net, net.arena)
        nf_ok, nb_ok, nff_ok = _norm_flags(net, cdt)
        kw = m3_core_kw(c)
        need = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]  # a backward can run: keep checkpoints
        x2 = x.reshape(BT, -1).to(cdt)
        h = torch.addmm(vw["input_proj.bias"], x2, vw["input_proj.weight"].t()).float()
        saved, carry_f, ssm_f = [], [], []
        for i in range(c.n_layers):
            p = f"layers.{i}."
            u, rstd = _norm_fwd(ext, nf_ok, h, vm[p + "norm.weight"], eps, cdt)
            zxbc = torch.mm(u, vw[p + "mixer.in_proj.weight"].t())  # [BT, Dp] in cdt
            zf = zxbc.float() if low else zxbc
            prm = m3_core_params(vm, i, c)
            y, cf, sf, ckpt = ext.m3_fwd(zf.view(B, T, -1), c.headdim, *prm[:6],
                                         prm[6] if c.is_outproj_norm else None, carry0[i], ssm0[i], starts,
                                         need_ckpt=need, **kw)
            yc = y.view(BT, di).to(cdt) if low else y.view(BT, di)
            h_in = h
            h = _residual_mm(h_in, yc, vw[p + "mixer.out_proj.weight"].t())
            saved.append((h_in, u, rstd, zf, yc, ckpt))
            carry_f.append(cf)
            ssm_f.append(sf)
        feat, rstd_f = _norm_fwd(ext, nff_ok, h, vm["norm_f.weight"], eps, torch.float32)
        ctx.net, ctx.saved, ctx.shape = net, saved, (B, T)
        ctx.h_last, ctx.rstd_f, ctx.x2 = h, rstd_f, x2
        ctx.carry0, ctx.ssm0, ctx.starts = carry0, ssm0, starts
        ctx.x_dtype = x.dtype
        ctx.norm_bwd_ok = nb_ok
        return feat.view(B, T, -1), torch.stack(carry_f), torch.stack(ssm_f)

    @staticmethod
    def backward(ctx, dfeat, dcarry_final, dssm_final):
        net = ctx.net
        ext = net.kernels
        c = net.cfg
        B, T = ctx.shape
        BT = B * T
        cdt = net.compute_dtype
        low = cdt != torch.float32
        W = net.arena if net.compute_arena is None else net.compute_arena
        vw, vm, vg = _views(net, W), _views(net, net.arena), _views(net, net.grad_arena)
        nb_ok = ctx.norm_bwd_ok
        kw = m3_core_kw(c)
        f32 = torch.float32
        dh, dh_c = _norm_bwd(ext, nb_ok, dfeat.reshape(BT, -1).contiguous(), ctx.h_last, ctx.rstd_f,
                             vm["norm_f.weight"], vg["norm_f.weight"], None, cdt)
        for i in reversed(range(c.n_layers)):
            p = f"layers.{i}."
            h_in, u, rstd, zf, yc, ckpt = ctx.saved[i]
            dout = dh if dh_c is None else dh_c
            _acc_mm(vg[p + "mixer.out_proj.weight"], dout.t(), yc)
            dy = torch.mm(dout, vw[p + "mixer.out_proj.weight"])  # [BT, d_inner]
            dy = dy.float() if low else dy
            prm = m3_core_params(vm, i, c)
            dcf = None if dcarry_final is None else dcarry_final[i].to(f32).contiguous()
            dsf = None if dssm_final is None else dssm_final[i].to(f32).contiguous()
            dz = torch.empty_like(zf)
            ext.m3_bwd(zf.view(B, T, -1), c.headdim, *prm[:6], prm[6] if c.is_outproj_norm else None,
                       ctx.carry0[i], ctx.ssm0[i], ctx.starts, ckpt=ckpt, dy=dy.view(B, T, -1), dcarry=dcf,
                       dssm=dsf, dzxbc_out=dz.view(B, T, -1), acc=m3_core_params(vg, i, c), **kw)
            dzc = dz.to(cdt) if low else dz
            _acc_mm(vg[p + "mixer.in_proj.weight"], dzc.t(), u)
            du = torch.mm(dzc, vw[p + "mixer.in_proj.weight"])
            du = du.float() if low else du
            dh, dh_c = _norm_bwd(ext, nb_ok, du, h_in, rstd, vm[p + "norm.weight"], vg[p + "norm.weight"], dh, cdt)
        if dh_c is None:
            dh_c = dh
        _acc_mm(vg["input_proj.weight"], dh_c.t(), ctx.x2)
        vg["input_proj.bias"].add_(dh.sum(0))
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.mm(dh_c, vw["input_proj.weight"]).view(B, T, -1).to(ctx.x_dtype)
        return dx, None, None, None, None, None


def fused_m3_backbone(net, x, carry0, ssm0, starts):
    """(features [B, T, d_model] f32, final carry [L, B, H, R + N + P], final ssm [L, B, d_inner, N]) of a
    :class:`~mamba_rl.model.mamba3.Mamba3Backbone` on a kernel backend.

    ``carry0`` / ``ssm0``: float32 contiguous [L, B, ...] initial state (zeros for none); ``starts``: a
    contiguous [B, T] bool tensor. The backward adds every parameter gradient to ``net.grad_arena`` and
    returns the gradient of x when x requires grad; gradients of the final state flow back through the
    sequence; no gradient flows into the initial state (the backbone runs the reference when one is asked for).
    """
    anchor = None  # see fused.fused_backbone: a fresh zero-size leaf per call makes the output require grad
    if torch.is_grad_enabled() and net.norm_f.weight.requires_grad:
        anchor = torch.empty(0, device=x.device, requires_grad=True)
    return _M3Backbone.apply(x, anchor, net, carry0, ssm0, starts)
