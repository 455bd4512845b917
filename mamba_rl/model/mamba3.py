"""Mamba-3 (SISO) backbone beside Mamba-1: ``MambaConfig(layer="Mamba3")``, reference and CPU-kernel backends.

Sources: Lahoti et al., "Mamba-3: Improved Sequence Modeling using State Space Principles" (ICLR 2026),
as built by mamba_ssm's ``Mamba3`` (``mamba_ssm/modules/mamba3.py``, ``is_mimo=False``, state-spaces/mamba
at e9594ce) inside ``MixerModel``'s pre-norm residual blocks (no MLP) and initialised as its
``_init_weights``; the no-decay group follows the Rust seed engine this project grew from (mamba-rs 0.6.8,
``m3_specs``). Written from those semantics, not translated.

Parameterisation followed, per block (u = RMSNorm(h) [.., d_model], d_inner = expand d_model, H = nheads =
d_inner / headdim, P = headdim, N = d_state, R = num_rope_angles = int(N rope_fraction) rounded down to
even, halved; one B/C group, shared by all heads, mamba_ssm's ``ngroups=1``):

1. ``[z, x, B, C, dd_dt, dd_A, trap, angles] = in_proj(u)`` (no bias), sizes [d_inner, d_inner, N, N, H, H,
   H, R] in that order (mamba_ssm's ``zxBCdtAtrap``). No short convolution, no dt projection.
2. **A floor**: ``A = min(-f(dd_A), -A_floor)`` with mamba_ssm's current heavy-tail activation
   ``f(a) = 1 + a`` (a >= 0), ``1 / (1 - a)`` (a < 0) by default (``A_activation="heavy_tail"``), so
   ``A <= -A_floor < 0`` per head and step. ``A_activation="softplus"`` gives ``f = softplus``, the
   paper's code release (mamba_ssm before #962): a slow decay (|A| << 1) then needs dd_A of about
   log(|A|) instead of 1 - 1/|A|, which a long memory learns much sooner.
3. **dt**: ``dt = softplus(dd_dt + dt_bias)`` per head; the **dt range** is the initialisation only:
   ``dt_bias`` = inverse softplus of dt drawn log-uniformly in [dt_min, dt_max], floored at 1e-4 (mamba_ssm
   ``dt_init_floor``); no clamp in the forward (mamba_ssm has none either).
4. **B, C**: ``RMSNorm`` each over N (weights ``B_norm.weight``, ``C_norm.weight`` init 1, eps =
   rms_norm_eps), broadcast to the H heads, plus the **learned per-head biases** ``B_bias``, ``C_bias``
   [H, 1, N] **init 1** (added after the norm, before the rotation).
5. **Rotary angles on B and C**: per head the angle accumulates ``theta_t = theta_{t-1} + pi tanh(angles_t)
   dt_t`` (kept mod 2 pi); ``B`` and ``C`` are rotated by ``theta_t`` as **real 2x2 rotations** of the pairs
   (2i, 2i+1), i < R (a complex-valued state written in reals); the other N - 2R entries are not rotated.
6. **Exponential-trapezoidal discretisation**: ``lam_t = sigmoid(trap_t)``, ``alpha_t = exp(A_t dt_t)``,
   ``S_t = alpha_t S_{t-1} + (1 - lam_t) dt_t alpha_t x_{t-1} B~_{t-1}^T + lam_t dt_t x_t B~_t^T``, the
   data-dependent blend of the previous and the current input's contribution; ``S`` is [P, N] per head.
7. ``y_t = S_t C~_t + D x_t`` (**D skip**, one per head, init 1), then the **gated output**: ``y SiLU(z)``,
   or with ``is_outproj_norm`` the **gated RMSNorm** before out_proj, ``RMSNorm_per_head(y) w SiLU(z)``
   (groups of headdim, weight ``mixer.norm.weight`` [d_inner] init 1, norm before gate, eps = rms_norm_eps).
8. ``h + out_proj(y)`` (no bias; nn.Linear init divided by sqrt(n_layers), mamba_ssm's prenorm rescale).

**Multi-head layout**: x, z, y and S are split as (h p) with p fastest (``d_inner = H * P``); dt, A, trap,
D, dt_bias are per head; the angle projection (R values) is shared by the heads but each head's angle
state differs through its dt.

**The state** of each layer is the SSM state plus the accumulated angle plus the previous step's rotated k
(= B~) and v (= x). :class:`Mamba3State` keeps RecurrentState's two tensors so every consumer (trainer
buffers, the PPO agent's per-minibatch ``index_select``, checkpoints, graph pointer guards) carries it
unchanged: ``ssm`` [n_layers, B, d_inner, N] holds S (view [L, B, H, P, N]); the ``conv`` slot (Mamba-3
has no conv) holds the carry [n_layers, B, H, R + N + P] = [angle | k | v]. At an episode start all of it
is zero before that step (docs/architecture.md, "Reset semantics").

Names (mamba_ssm's, so a state dict maps one to one): ``layers.{i}.norm.weight``, ``layers.{i}.mixer.
{in_proj.weight, dt_bias, B_bias, C_bias, B_norm.weight, C_norm.weight, D, norm.weight (is_outproj_norm
only), out_proj.weight}``, plus ``input_proj.{weight,bias}`` and ``norm_f.weight`` as in Mamba-1.
No-decay group (the seed's M3 set): dt_bias, D, every norm scale and every bias (B_bias, C_bias,
input_proj.bias).

Backends: the pure-torch reference (float32 or float64; bf16/f16 compute copies for the GEMMs under the
trainer; tested on the CPU, its GPU test is marked ``cuda``) and ``"cpu"``: the C++ kernels of
``csrc/cpu/mamba3*.cpp`` (float32) under the one autograd node of :mod:`mamba_rl.model.fused_m3` (hand-written
backward into the gradient arena) and a one-call one-token step; ``"cuda"``: csrc/mamba3.cu (a float32 core,
the GEMMs in the compute dtype) under the same node, and a one-token step of torch GEMMs around the core's
``m3_step`` kernel. ``backend="auto"`` picks the kernels of the masters' device ("cpu" or "cuda") for float32
masters where they built, else the reference, with one warning naming the cause. The
reference math runs instead of the kernels where they cannot stand in (a bf16/f16 compute copy on the CPU,
swapped-in or frozen parameters, a gradient into the initial state), as for Mamba-1.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import MambaConfig
from ..ops.capability import Support, kernel_support
from ..ops.extension import extension, fallback_message
from ..ops.mamba3_ref import mamba3_scan_ref, mamba3_step_ref
from ..ops.norm import rms_norm_ref
from .arena import arena_key, cache_hit
from .backbone import MambaBackbone, check_step_args
from .fused_m3 import fused_m3_backbone, m3_core_kw, m3_core_params
from .state import RecurrentState

__all__ = ["Mamba3Backbone", "Mamba3Block", "Mamba3State", "m3_param_layout", "m3_is_no_decay", "m3_init_values",
           "heavy_tail"]

M3_GEMM_PARAMS = ("in_proj.weight", "out_proj.weight")
_WARNED: set[str] = set()


# ---------------------------------------------------------------------------------------------- state
class Mamba3State(RecurrentState):
    """Recurrent state of a Mamba-3 backbone: RecurrentState's two tensors with Mamba-3 meaning.

    Attributes:
        conv: [n_layers, B, H, R + N + P] the carry [angle | k | v] of every layer (the Mamba-1 name is
            kept so every RecurrentState consumer carries it; Mamba-3 has no conv).
        ssm: [n_layers, B, d_inner, N], the SSM state S of each head, (h p) flattened.
    Both in the master dtype (float32, float64 in float64 mode). The properties below are views.
    """

    @property
    def nheads(self) -> int:
        """H."""
        return self.conv.shape[2]

    @property
    def headdim(self) -> int:
        """P = d_inner / H."""
        return self.ssm.shape[2] // self.conv.shape[2]

    @property
    def n_angles(self) -> int:
        """R, rotary angles per head."""
        return self.conv.shape[3] - self.ssm.shape[3] - self.headdim

    @property
    def angle(self) -> torch.Tensor:
        """[n_layers, B, H, R] accumulated rotary angle, in [0, 2 pi) [radians]."""
        return self.conv[..., :self.n_angles]

    @property
    def k(self) -> torch.Tensor:
        """[n_layers, B, H, N] the previous step's rotated, biased, normed B (k~)."""
        r = self.n_angles
        return self.conv[..., r:r + self.ssm.shape[3]]

    @property
    def v(self) -> torch.Tensor:
        """[n_layers, B, H, P] the previous step's x (v)."""
        return self.conv[..., self.conv.shape[3] - self.headdim:]

    @property
    def ssm_heads(self) -> torch.Tensor:
        """[n_layers, B, H, P, N] view of ``ssm``."""
        return self.ssm.unflatten(2, (self.nheads, self.headdim))

    @staticmethod
    def zeros(n_layers, batch, nheads, headdim, d_state, n_angles, device=None, dtype=torch.float32) -> "Mamba3State":
        """All-zero state."""
        return Mamba3State(torch.zeros(n_layers, batch, nheads, n_angles + d_state + headdim, device=device, dtype=dtype),
                           torch.zeros(n_layers, batch, nheads * headdim, d_state, device=device, dtype=dtype))


def _split_carry(carry: torch.Tensor, ssm: torch.Tensor, R: int, N: int, P: int):
    """One layer's (carry [B, H, R+N+P], ssm [B, H*P, N]) -> the op's (angle, S [B, H, P, N], k, v) views."""
    H = carry.shape[-2]
    return carry[..., :R], ssm.unflatten(-2, (H, P)), carry[..., R:R + N], carry[..., R + N:]


# ---------------------------------------------------------------------------------------------- layout
def m3_param_layout(cfg: MambaConfig, input_dim: int) -> list[tuple[str, tuple[int, ...]]]:
    """[(name, shape)] of every Mamba-3 backbone parameter, in model order (mamba_ssm names and shapes)."""
    d, di, n, H, R = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.nheads, cfg.num_rope_angles
    out = [("input_proj.weight", (d, input_dim)), ("input_proj.bias", (d,))]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out += [(p + "norm.weight", (d,)),
                (p + "mixer.in_proj.weight", (2 * di + 2 * n + 3 * H + R, d)),
                (p + "mixer.dt_bias", (H,)),
                (p + "mixer.B_bias", (H, 1, n)),
                (p + "mixer.C_bias", (H, 1, n)),
                (p + "mixer.B_norm.weight", (n,)),
                (p + "mixer.C_norm.weight", (n,)),
                (p + "mixer.D", (H,))]
        if cfg.is_outproj_norm:
            out.append((p + "mixer.norm.weight", (di,)))
        out.append((p + "mixer.out_proj.weight", (d, di)))
    out.append(("norm_f.weight", (d,)))
    return out


def m3_is_no_decay(name: str) -> bool:
    """The seed's Mamba-3 no-decay group: dt_bias, D, every norm scale and every bias (B_bias, C_bias and
    input_proj.bias included)."""
    return name.endswith(("bias", "norm.weight", "norm_f.weight", ".D"))


def m3_init_values(cfg: MambaConfig, input_dim: int, seed: int) -> dict[str, torch.Tensor]:
    """name -> float64 initial value (mamba_ssm's ``Mamba3.__init__`` + ``_init_weights``), drawn in model
    order from a CPU generator seeded with ``seed``: norms, D, B_bias, C_bias = 1; dt_bias = inverse softplus
    of dt ~ log-uniform [dt_min, dt_max] (floor 1e-4); nn.Linear defaults U(+-1/sqrt(fan_in)) elsewhere,
    out_proj divided by sqrt(n_layers)."""
    gen = torch.Generator().manual_seed(int(seed))
    out = {}
    for name, shape in m3_param_layout(cfg, input_dim):
        def uniform(bound):
            return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound
        last = name.rsplit(".", 1)[-1]
        if name.endswith("weight") and "norm" in name or last in ("D", "B_bias", "C_bias"):
            v = torch.ones(shape, dtype=torch.float64)
        elif last == "dt_bias":
            lo, hi = math.log(cfg.dt_min), math.log(cfg.dt_max)
            dt = torch.exp(torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo).clamp(min=1e-4)
            v = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        elif name == "input_proj.bias":
            v = uniform(1.0 / math.sqrt(input_dim))
        else:
            v = uniform(1.0 / math.sqrt(shape[1]))
            if name.endswith("out_proj.weight"):
                v = v / math.sqrt(cfg.n_layers)
        out[name] = v
    return out


# ---------------------------------------------------------------------------------------------- block
def heavy_tail(a: torch.Tensor) -> torch.Tensor:
    """mamba_ssm's heavy-tail activation of dd_A: 1 + a for a >= 0, 1 / (1 - a) for a < 0 (positive,
    continuous, slope 1 at 0). Written with clamps, not a where, so no inf of the other branch reaches the
    gradient."""
    return a.clamp_min(0) + torch.reciprocal(1 - a.clamp_max(0))


class Mamba3Block(nn.Module):
    """One pre-norm residual Mamba-3 SISO block (module doc, steps 1-8). Parameters are registered by the
    owning arena as views; shapes in :func:`m3_param_layout`. :meth:`forward` (sequence) and :meth:`step`
    (one token) read the same parameters and give the same result for any reset pattern.

    Args:
        cfg: the backbone's :class:`MambaConfig` (layer "Mamba3").
    """

    def __init__(self, cfg: MambaConfig):
        super().__init__()
        self.cfg = cfg
        self.norm = nn.Module()
        self.mixer = nn.Module()
        for sub in ("in_proj", "B_norm", "C_norm", "out_proj") + (("norm",) if cfg.is_outproj_norm else ()):
            setattr(self.mixer, sub, nn.Module())

    def _inputs(self, zxbc: torch.Tensor, eps: float):
        """in_proj output [..., d_in_proj] (master dtype) -> the recurrence's inputs with leading dims kept:
        (q, k [.., H, N], v [.., H, P], adt, dt, trap [.., H], q_bias, k_bias [H, N], angles [.., H, R], D, z)."""
        c, mx = self.cfg, self.mixer
        di, n, H, P, R = c.d_inner, c.d_state, c.nheads, c.headdim, c.num_rope_angles
        z, x, Bp, Cp, dd_dt, dd_A, trap, ang = zxbc.split([di, di, n, n, H, H, H, R], dim=-1)
        f = heavy_tail if c.A_activation == "heavy_tail" else F.softplus
        A = torch.clamp(-f(dd_A), max=-c.A_floor)
        dt = F.softplus(dd_dt + mx.dt_bias)
        lead = zxbc.shape[:-1]
        k = rms_norm_ref(Bp, mx.B_norm.weight, eps).unsqueeze(-2).expand(*lead, H, n)
        q = rms_norm_ref(Cp, mx.C_norm.weight, eps).unsqueeze(-2).expand(*lead, H, n)
        angles = ang.unsqueeze(-2).expand(*lead, H, R)
        z = z.unflatten(-1, (H, P))
        return (q, k, x.unflatten(-1, (H, P)), A * dt, dt, trap, mx.C_bias[:, 0], mx.B_bias[:, 0], angles, mx.D,
                None if c.is_outproj_norm else z), z

    def _output(self, y: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
        """y [.., H, P] (gate applied unless is_outproj_norm) -> [.., d_inner], with the gated RMSNorm."""
        if self.cfg.is_outproj_norm:
            w = self.mixer.norm.weight.view(self.cfg.nheads, self.cfg.headdim)
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * w.to(y.dtype) * F.silu(z.to(y.dtype))
        return y.flatten(-2)

    def forward(self, h: torch.Tensor, carry: torch.Tensor | None, ssm: torch.Tensor | None,
                episode_starts: torch.Tensor | None, w, eps: float, cdt: torch.dtype):
        """The block over a sequence.

        Args:
            h: [B, T, d_model] residual stream (master dtype).
            carry: [B, H, R + N + P] ([angle | k | v]) or None (zeros); ssm: [B, d_inner, N] or None.
            episode_starts: [B, T] bool or None.
            w: ``w(key)`` -> the GEMM weight ``key`` as the GEMMs read it (the compute copy under bf16/f16).
            eps: RMSNorm epsilon. cdt: the GEMM (compute) dtype.
        Returns:
            (h + mixer(norm(h)) [B, T, d_model], final carry [B, H, R+N+P], final ssm [B, d_inner, N]).
        """
        c = self.cfg
        rdt = h.dtype
        u = rms_norm_ref(h, self.norm.weight, eps, cdt)
        zxbc = F.linear(u, w("mixer.in_proj.weight")).to(rdt)
        args, z = self._inputs(zxbc, eps)
        state = None if carry is None else _split_carry(carry, ssm, c.num_rope_angles, c.d_state, c.headdim)
        y, (ang, S, k, v) = mamba3_scan_ref(*args, state=state, episode_starts=episode_starts)
        y = self._output(y, z, eps)
        out = h + F.linear(y.to(cdt), w("mixer.out_proj.weight")).to(rdt)
        return out, torch.cat((ang, k, v), dim=-1).to(rdt), S.flatten(-3, -2).to(rdt)

    @torch.no_grad()
    def step(self, h: torch.Tensor, carry: torch.Tensor, ssm: torch.Tensor, episode_starts: torch.Tensor | None,
             w, eps: float) -> torch.Tensor:
        """The block for one token: h [B, d_model] -> [B, d_model]; ``carry`` [B, H, R+N+P] and ``ssm``
        [B, d_inner, N] advance in place; rows with ``episode_starts`` [B] True start from zeros. ``w`` as
        in :meth:`forward` (GEMM weights); the math is :func:`mamba_rl.ops.mamba3_ref.mamba3_step_ref`."""
        c = self.cfg
        rdt = h.dtype
        cdt = w("mixer.in_proj.weight").dtype
        u = rms_norm_ref(h, self.norm.weight.detach(), eps, cdt)
        zxbc = F.linear(u, w("mixer.in_proj.weight")).to(rdt)
        args, z = self._inputs(zxbc, eps)
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        views = _split_carry(carry, ssm, c.num_rope_angles, c.d_state, c.headdim)
        y, new = mamba3_step_ref(*args, state=views, episode_starts=episode_starts)
        for dst, src in zip(views, new):
            dst.copy_(src)
        y = self._output(y, z, eps)
        return h + F.linear(y.to(cdt), w("mixer.out_proj.weight")).to(rdt)


# ---------------------------------------------------------------------------------------------- backbone
class Mamba3Backbone(MambaBackbone):
    """Mamba-3 SISO backbone ``x [B, T, input_dim] -> features [B, T, d_model]`` with RL reset semantics:
    ``input_proj``, n_layers :class:`Mamba3Block`, ``norm_f``, parameters in one flat arena (decay group
    first, then the no-decay group of :func:`m3_is_no_decay`).

    ``MambaBackbone(cfg, ...)`` with ``cfg.layer == "Mamba3"`` constructs this class (same arguments, same
    API: forward / step / stepper / initial_state / check_inputs), so the trainer and the agent use it
    unchanged. The state is a :class:`Mamba3State`.

    Args:
        cfg: a :class:`MambaConfig` with ``layer="Mamba3"``.
        input_dim, device, seed, dtype: as :class:`MambaBackbone`.
        backend: "reference", "cpu" (the C++ kernels; a CPU device and float32 masters), "cuda" (the CUDA
            kernels; a CUDA device and float32 masters), or "auto" (module doc: the kernels of the masters'
            device, "cpu" or "cuda", where they built and have m3_fwd, for float32 masters; else the reference,
            with one warning per device kind for float32 masters).

    Raises:
        ValueError: bad input_dim, dtype or backend; ``backend="cpu"`` / ``"cuda"`` off its device or with
            float64 masters; an input of the wrong shape/dtype/device in forward.
        RuntimeError: ``backend="cpu"`` / ``"cuda"`` where its kernels could not load (the message says why).
    """

    def __init__(self, cfg: MambaConfig, input_dim: int, device=None, seed: int | None = 0,
                 backend: str = "auto", dtype: torch.dtype = torch.float32):
        nn.Module.__init__(self)
        if not isinstance(cfg, MambaConfig) or cfg.layer != "Mamba3":
            raise ValueError(f"Mamba3Backbone: cfg must be a MambaConfig with layer='Mamba3', got {cfg!r}")
        self._init_common(cfg, input_dim, backend, dtype)
        self.layers = nn.ModuleList([Mamba3Block(cfg) for _ in range(cfg.n_layers)])
        self.norm_f = nn.Module()
        self._init_arena(m3_param_layout(cfg, input_dim), m3_init_values(cfg, input_dim, 0 if seed is None else seed),
                         m3_is_no_decay, device, dtype)
        self.backend = self._resolve_backend(backend)

    def _resolve_backend(self, backend: str, dev: torch.device | None = None, dt: torch.dtype | None = None) -> str:
        if backend != "auto":  # the device, dtype and load checks of every layer kind
            resolved = super()._resolve_backend(backend, dev, dt)
            if resolved != "reference" and not hasattr(extension(resolved), "m3_fwd"):
                raise RuntimeError(f"MambaBackbone: the loaded {resolved} extension has no Mamba-3 kernels (m3_fwd); "
                                   f"rebuild it with `python -m mamba_rl.build --kind {resolved}`")
            return resolved
        dev = self.arena.device if dev is None else dev
        dt = self.arena.dtype if dt is None else dt
        if dev.type in ("cuda", "cpu") and dt == torch.float32:
            ext = extension(dev.type)
            if ext is not None and hasattr(ext, "m3_fwd"):
                return dev.type
            if dev.type not in _WARNED:
                _WARNED.add(dev.type)
                cause = fallback_message(dev.type) if ext is None else (
                    f"MambaBackbone: the loaded {dev.type} extension has no Mamba-3 kernels (m3_fwd); rebuild it "
                    f"with `python -m mamba_rl.build --kind {dev.type}`")
                warnings.warn(cause + " (layer='Mamba3': the pure-PyTorch reference runs)", RuntimeWarning,
                              stacklevel=3)
        return "reference"

    def kernel_support(self, op: str) -> Support:
        """(ok, reason): can this backbone run ``op`` ("sequence": the whole-backbone node of
        :mod:`mamba_rl.model.fused_m3`; "step": the one-token kernel; "rms_norm_fwd" / "rms_norm_bwd") on its
        backend's kernels now? :func:`mamba_rl.ops.capability.kernel_support` ("m3_sequence" / "m3_step")
        plus: the parameters must be the arena's own (not swapped in by ``torch.func.functional_call``).
        "conv" and "scan" (Mamba-1 ops) are never ok."""
        if self.backend == "reference":
            return Support(False, "the reference backend runs no kernels")
        if op in ("conv", "scan"):
            return Support(False, f"{op}: a Mamba-1 op; layer='Mamba3' has no {op}")
        if not self.params_are_arena():
            return Support(False, "parameters were swapped in (torch.func.functional_call or assignment): "
                                  "the kernels read the arena, so the reference math runs")
        c = self.cfg
        return kernel_support(self.backend, {"sequence": "m3_sequence", "step": "m3_step"}.get(op, op),
                              d_model=c.d_model, d_state=c.d_state, n_layers=c.n_layers, dtype=self.compute_dtype,
                              device=self.device, headdim=c.headdim)

    _fused_node = staticmethod(fused_m3_backbone)  # MambaBackbone._forward_fused runs it (carry in the conv slot)

    def _step_cuda(self, x_t: torch.Tensor, state: RecurrentState, episode_starts: torch.Tensor | None):
        """The one-token step on the CUDA backend: per layer the RMSNorm and GEMMs in torch (compute dtype) and
        the mixer core's ``m3_step`` kernel advancing the state in place; no host sync (graph-capturable)."""
        c = self.cfg
        ext, cdt = self.kernels, self.compute_dtype
        w = self.step_weights()
        starts = None if episode_starts is None else episode_starts.reshape(-1).to(torch.bool).contiguous()
        kw = m3_core_kw(c)
        h = F.linear(x_t.to(cdt), w["input_proj.weight"], w["input_proj.bias"]).float()
        for i in range(c.n_layers):
            p = f"layers.{i}."
            u = rms_norm_ref(h, w[p + "norm.weight"], c.rms_norm_eps, cdt)
            zxbc = F.linear(u, w[p + "mixer.in_proj.weight"]).float().contiguous()
            prm = m3_core_params(w, i, c)
            y = ext.m3_step(zxbc, c.headdim, *prm[:6], prm[6] if c.is_outproj_norm else None, state.conv[i],
                            state.ssm[i], starts, **kw)
            h = h + F.linear(y.to(cdt), w[p + "mixer.out_proj.weight"]).float()
        return rms_norm_ref(h, w["norm_f.weight"], c.rms_norm_eps, torch.float32)

    def _packed_step_weights(self) -> tuple:
        """The one-token kernel's argument layout (views of the float32 arena), cached per arena."""
        key = arena_key(self.arena)
        cache = self.__dict__.get("_m3_packed")
        if cache is not None and cache_hit(cache[0], key):
            return cache[1]
        v = {name: self.arena_view(self.arena, name) for name, _ in self._layout}
        layers = []
        for i in range(self.cfg.n_layers):
            p = f"layers.{i}."
            prm = m3_core_params(v, i, self.cfg)
            layers.append([v[p + "norm.weight"], v[p + "mixer.in_proj.weight"], *prm[:6], v[p + "mixer.out_proj.weight"],
                           *prm[6:]])
        packed = (v["input_proj.weight"], v["input_proj.bias"], v["norm_f.weight"], layers)
        self.__dict__["_m3_packed"] = (key, packed)
        return packed

    def step_weights(self) -> dict:
        """name -> tensor for the one-token step: GEMM weights (input_proj, in_proj, out_proj) in the compute
        dtype, the rest master; views into the arenas (in-place updates are seen), cached per arena."""
        key = arena_key(self.arena, self.compute_arena)
        cache = self.__dict__.get("_m3_step_cache")
        if cache is not None and cache_hit(cache[0], key):
            return cache[1]
        out = {}
        for name, _ in self._layout:
            gemm = name.endswith(M3_GEMM_PARAMS) or name.startswith("input_proj.")
            out[name] = (self.arena_view(self.compute_arena, name) if gemm and self.compute_arena is not None
                         else self.get_parameter(name).detach())
        self.__dict__["_m3_step_cache"] = (key, out)
        return out

    def initial_state(self, batch: int) -> Mamba3State:
        """All-zero :class:`Mamba3State` for ``batch`` rows, in the master dtype, on the arena's device."""
        c = self.cfg
        return Mamba3State.zeros(c.n_layers, batch, c.nheads, c.headdim, c.d_state, c.num_rope_angles,
                                 device=self.device, dtype=self.arena.dtype)

    def _state_layout(self, batch: int) -> tuple[type, str, tuple, tuple]:
        c = self.cfg
        return (Mamba3State, " (Mamba-3 carry [angle | k | v])",
                (c.n_layers, batch, c.nheads, c.num_rope_angles + c.d_state + c.headdim),
                (c.n_layers, batch, c.d_inner, c.d_state))

    def forward(self, x: torch.Tensor, initial_state: RecurrentState | None = None,
                episode_starts: torch.Tensor | None = None):
        """Run the backbone over a sequence.

        Args:
            x: [B, T, input_dim] float on the arena's device.
            initial_state: a :class:`Mamba3State` for B rows, or None for zeros. Gradients flow into it
                only if its tensors require grad.
            episode_starts: [B, T] bool or None. True at (b, t): x[b, t] starts a new episode, so row b's
                SSM state, angle, previous k and v are all zero before step t.
        Returns:
            (features [B, T, d_model] in the master dtype, final :class:`Mamba3State`); autocast off inside
            (as :meth:`MambaBackbone.forward`).
        Raises:
            ValueError: on a wrong shape, dtype or device.
        """
        if torch.is_autocast_enabled(self.device.type):
            with torch.autocast(self.device.type, enabled=False):
                return self.forward(x, initial_state, episode_starts)
        self.check_inputs(x, initial_state, episode_starts)
        if x.shape[0] != 0 and self._use_fused(initial_state, x):
            return self._forward_fused(x, initial_state, episode_starts)
        c = self.cfg
        rdt, cdt = self.arena.dtype, self.compute_dtype
        h = F.linear(x.to(cdt), self.weight("input_proj.weight"), self.weight("input_proj.bias")).to(rdt)
        carries, ssms = [], []
        for i, block in enumerate(self.layers):
            cs = None if initial_state is None else initial_state.conv[i]
            ss = None if initial_state is None else initial_state.ssm[i]
            h, cf, sf = block(h, cs, ss, episode_starts, lambda k, i=i: self.weight(f"layers.{i}.{k}"),
                              c.rms_norm_eps, cdt)
            carries.append(cf)
            ssms.append(sf)
        feat = rms_norm_ref(h, self.norm_f.weight, c.rms_norm_eps, rdt)
        return feat, Mamba3State(torch.stack(carries), torch.stack(ssms))

    @torch.no_grad()
    def step(self, x_t: torch.Tensor, state: RecurrentState, episode_starts: torch.Tensor | None = None):
        """One token through every layer: x_t [B, input_dim] -> features [B, d_model] (master dtype), with
        ``state`` (a :class:`Mamba3State`) advanced in place; rows with ``episode_starts`` [B] True start from
        a zero state. Shapes and devices are not validated here (see :class:`~mamba_rl.model.stepper.Stepper`);
        ValueError for a ``state`` that is not a RecurrentState or non-bool ``episode_starts``. One extension call
        (``m3_backbone_step``, the sequence kernel's own core with T = 1) where :meth:`kernel_support` ("step")
        allows it and the state is float32; otherwise each block's :meth:`Mamba3Block.step` (torch ops)."""
        check_step_args(type(self).__name__ + ".step", state, episode_starts)
        if state.ssm.dtype == torch.float32 and self.kernel_support("step"):
            if self.backend == "cuda":
                return self._step_cuda(x_t, state, episode_starts)
            c = self.cfg
            inp_w, inp_b, normf, layers = self._packed_step_weights()
            starts = None if episode_starts is None else episode_starts.reshape(-1).to(torch.bool).contiguous()
            xt = x_t if x_t.dtype == torch.float32 and x_t.is_contiguous() else x_t.float().contiguous()
            return self.kernels.m3_backbone_step(xt, inp_w, inp_b, normf, layers, state.conv, state.ssm, starts,
                                                 float(c.rms_norm_eps), c.headdim, float(c.A_floor),
                                                 c.A_activation == "heavy_tail")
        return self._step_layers(x_t, state, episode_starts)
