"""Shared helpers of the core tests: tiny float64-capable reference models, an oracle that runs each
episode on its own, the reset patterns and the error measures the parity tests share."""
import importlib.util
import math
import os

import torch
import torch.nn.functional as F

from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer, RecurrentState
from mamba_rl.ops import causal_conv1d_ref, rms_norm_ref, selective_scan_ref

F64 = torch.float64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(relpath: str, name: str):
    """The module of a script of the repository (e.g. ``benchmarks/timeline.py``) loaded by path, as ``name``
    (not the script's own name where that would shadow a package, as ``popgym``)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rel(a, b) -> float:
    """||a - b|| / ||b|| in float64 on the CPU (a and b may sit on different devices); a must be finite (a NaN
    never passes a tolerance by accident)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_dbc_out(call, ref, full, c0, R, N, msg=None):
    """The contract of ``scan_bwd(..., dbc_out=buf)`` (CPU and CUDA bindings alike): ``call(buf)`` runs it on the
    column block ``full[:, c0:c0 + R + 2N]``; dB / dC land in the block's last 2N columns with the bits of the plain
    call's ``ref`` and come back as [B, T, N] views of them, every other element of ``full`` keeps its bits (NaN
    stays NaN), and the other outputs equal ``ref``'s. Returns the call's outputs."""
    buf = full[:, c0:c0 + R + 2 * N]
    before = full.clone()
    out = call(buf)
    dB, dC = out[3], out[4]
    rows = full.shape[0]
    assert dB.shape == ref[3].shape and dC.shape == ref[4].shape and dB.shape[-1] == N, msg
    assert dB.data_ptr() == buf[:, R:].data_ptr() and dC.data_ptr() == buf[:, R + N:].data_ptr(), msg
    assert torch.equal(buf[:, R:R + N], ref[3].view(rows, N)), msg
    assert torch.equal(buf[:, R + N:], ref[4].view(rows, N)), msg
    kept = torch.ones(full.shape, dtype=torch.bool, device=full.device)
    kept[:, c0 + R:c0 + R + 2 * N] = False
    bits = {4: torch.int32, 2: torch.int16}[full.element_size()]
    assert torch.equal(full.view(bits)[kept], before.view(bits)[kept]), msg
    for k in (0, 1, 2, 5, 6, 7, 8):
        assert torch.equal(out[k], ref[k]), (msg, k)
    return out


def angle_err(a, b) -> float:
    """Largest circular difference of two angle tensors (the wrap at 2 pi may fall differently in f32)."""
    d = a.detach().double().cpu() - b.detach().double().cpu()
    return (torch.remainder(d + math.pi, 2 * math.pi) - math.pi).abs().max().item()


def loss_and_grads(model, x, s0, starts, w, dtype, device="cpu"):
    """Forward and backward of ``sum(y * wy) + sum(final.conv * wc) + sum(final.ssm * ws)``, ``w = (wy, wc,
    ws)``, with x, the initial state ``s0`` and the weights cast to ``dtype`` on ``device``: the loss reaches
    the features and both parts of the final state. Returns (y detached, final state, dLoss/dx, a copy of the
    model's gradient arena)."""
    wy, wc, ws = (t.to(device=device, dtype=dtype) for t in w)
    xx = x.detach().to(device=device, dtype=dtype).clone().requires_grad_()
    y, fin = model(xx, s0.to(device=device, dtype=dtype), starts.to(device))
    loss = (y * wy).sum() + (fin.conv * wc).sum() + (fin.ssm * ws).sum()
    model.zero_grad()
    loss.backward()
    return y.detach(), fin, xx.grad, model.grad_arena.clone()


RESET_PATTERNS = ("none", "t0", "last", "every", "adjacent", "random")


def starts_for(pattern, B, T, g, clean_row: bool = False):
    """episode_starts [B, T] bool for one of :data:`RESET_PATTERNS`: no start, a start at t = 0, at T - 1, at
    every step, at two adjacent steps in the middle, or each step with probability 0.1 (drawn from ``g``);
    ``clean_row`` keeps the last row of the random pattern free of starts."""
    s = torch.zeros(B, T, dtype=torch.bool)
    if pattern == "t0":
        s[:, 0] = True
    elif pattern == "last":
        s[:, T - 1] = True
    elif pattern == "every":
        s[:] = True
    elif pattern == "adjacent":
        s[:, T // 2: T // 2 + 2] = True
    elif pattern == "random":
        s = torch.rand(B, T, generator=g) < 0.1
        if clean_row:
            s[-1] = False
    elif pattern != "none":
        raise ValueError(f"starts_for: pattern must be one of {RESET_PATTERNS}, got {pattern!r}")
    return s


def needs_cpu_kernels():
    """A skipif mark for tests of the C++ CPU kernels, naming why they cannot load here."""
    import pytest

    from mamba_rl.ops.extension import extension, extension_error

    return pytest.mark.skipif(extension("cpu") is None, reason=f"CPU kernels unavailable: {extension_error('cpu')!r}")
SMALL_CFG = MambaConfig(d_model=8, n_layers=2, d_state=4, d_conv=3, expand=2)
IN = 3


def make_net(cfg=SMALL_CFG, seed=0, dtype=torch.float32, input_dim=IN):
    return MambaBackbone(cfg, input_dim, seed=seed, backend="reference", dtype=dtype)


def make_trainer(dtype="f32", seed=0, batch=2, seq_len=4, cfg=SMALL_CFG, **kw):
    net = make_net(cfg, seed=seed)
    return MambaTrainer(net, batch=batch, seq_len=seq_len, dtype=dtype, **kw)


def rand_state(net, B, gen, scale=0.5):
    s = net.initial_state(B)
    return RecurrentState(torch.randn(s.conv.shape, generator=gen, dtype=s.conv.dtype) * scale,
                          torch.randn(s.ssm.shape, generator=gen, dtype=s.ssm.dtype) * scale)


def per_episode_oracle(net, x, starts, init):
    """Run each row's episodes independently (row by row, segment by segment)."""
    B, T = x.shape[:2]
    feats = torch.zeros(B, T, net.cfg.d_model, dtype=net.arena.dtype)
    finals_c, finals_s = [], []
    for b in range(B):
        cuts = [t for t in range(T) if starts[b, t]]
        bounds = sorted(set([0] + cuts + [T]))
        st = init.index(slice(b, b + 1))
        for s, e in zip(bounds[:-1], bounds[1:]):
            st0 = None if starts[b, s] else st
            y, st = net(x[b:b + 1, s:e], initial_state=st0)
            feats[b, s:e] = y[0]
        finals_c.append(st.conv)
        finals_s.append(st.ssm)
    return feats, RecurrentState(torch.cat(finals_c, 1), torch.cat(finals_s, 1))


def seq_forward_ref(x, w, L, starts, conv0, ssm0, eps=1e-5):
    """The sequence forward in float64 from the per-op references over all T at once."""
    d = {k: v.double() for k, v in w.items()}
    h = F.linear(x.double(), d["input_proj.weight"], d["input_proj.bias"])
    di, N = d["layers.0.mixer.conv1d.weight"].shape[0], d["layers.0.mixer.A_log"].shape[1]
    r = d["layers.0.mixer.dt_proj.weight"].shape[1]
    cf_all, sf_all = [], []
    for i in range(L):
        q = lambda k: d[f"layers.{i}.{k}"]
        u = rms_norm_ref(h, q("norm.weight"), eps)
        xi, z = F.linear(u, q("mixer.in_proj.weight")).split(di, -1)
        xc, cf = causal_conv1d_ref(xi, q("mixer.conv1d.weight").reshape(di, -1), q("mixer.conv1d.bias"),
                                   conv0[i].double(), starts)
        dt_r, Bm, Cm = F.linear(xc, q("mixer.x_proj.weight")).split([r, N, N], -1)
        dt = F.linear(dt_r, q("mixer.dt_proj.weight"))
        y, sf = selective_scan_ref(xc, dt, q("mixer.A_log"), Bm, Cm, q("mixer.D"), z, q("mixer.dt_proj.bias"),
                                   ssm0[i].double(), starts)
        h = h + F.linear(y, q("mixer.out_proj.weight"))
        cf_all.append(cf)
        sf_all.append(sf)
    return rms_norm_ref(h, d["norm_f.weight"], eps), torch.stack(cf_all), torch.stack(sf_all)


def rewrite_checkpoint(src, dst, meta_fn=None, tensors_fn=None, raw_meta=None, keep_digest=None):
    """Copy the checkpoint ``src`` to ``dst`` with its JSON metadata and/or tensors edited in place by
    ``meta_fn(meta)`` / ``tensors_fn(tensors)`` (or the metadata replaced by the string ``raw_meta``).
    ``keep_digest``: keep the tensors' SHA-256 digests; None keeps them unless ``tensors_fn`` edited the
    tensors (a pre-digest file, so the tensor checks rather than the digest are what refuse it)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(src), framework="pt") as f:
        meta = json.loads(f.metadata()["mamba_rl"])
    tensors = load_file(str(src))
    if meta_fn:
        meta_fn(meta)
    if tensors_fn:
        tensors_fn(tensors)
    if not (keep_digest if keep_digest is not None else tensors_fn is None):
        meta.pop("sha256", None)
    save_file(tensors, str(dst), metadata={"mamba_rl": raw_meta if raw_meta is not None else json.dumps(meta)})
    return dst
