"""MambaBackbone: input projection, N residual Mamba-1 blocks and a final RMSNorm over one flat arena.

The model is Gu & Dao 2023 (arXiv:2312.00752) as built by mamba_ssm's ``Mamba`` mixer inside pre-norm
residual blocks (ARCHITECTURE.md section 2). Parameter names follow HF / mamba_ssm, so a familiar state
dict maps one to one. Every ``nn.Parameter`` is a view into one contiguous master tensor (the arena) and
every ``.grad`` is a view into one flat gradient arena, so the optimizer is one pass over one tensor.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import MambaConfig
from .ops import causal_conv1d, causal_conv1d_ref, rms_norm, rms_norm_ref, selective_scan, selective_scan_ref
from .ops._dispatch import check_tensor, extension, extension_error
from .state import RecurrentState

__all__ = ["MambaBackbone", "RecurrentState"]

_GEMM_PARAMS = ("in_proj.weight", "x_proj.weight", "dt_proj.weight", "out_proj.weight")
_NO_DECAY_SUFFIXES = (".A_log", ".D", ".dt_proj.bias", ".norm.weight")


def is_no_decay(name: str) -> bool:
    """True for the parameters the "reference" no-decay group exempts: A_log, D, dt_proj.bias, norms."""
    return name == "norm_f.weight" or name.endswith(_NO_DECAY_SUFFIXES)


class _UseCompute(torch.autograd.Function):
    """Forward: the low-precision compute copy of a master weight (no copy made).
    Backward: the gradient cast to the master dtype, accumulated into the master's ``.grad``."""

    @staticmethod
    def forward(ctx, master, compute):
        ctx.master_dtype = master.dtype
        return compute.detach()

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.master_dtype), None


def _layout(cfg: MambaConfig, input_dim: int):
    """[(name, shape)] in model order."""
    d, di, n, k, r = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.d_conv, cfg.dt_rank_value
    out = [("input_proj.weight", (d, input_dim)), ("input_proj.bias", (d,))]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out += [(p + "norm.weight", (d,)),
                (p + "mixer.in_proj.weight", (2 * di, d)),
                (p + "mixer.conv1d.weight", (di, 1, k)),
                (p + "mixer.conv1d.bias", (di,)),
                (p + "mixer.x_proj.weight", (r + 2 * n, di)),
                (p + "mixer.dt_proj.weight", (di, r)),
                (p + "mixer.dt_proj.bias", (di,)),
                (p + "mixer.A_log", (di, n)),
                (p + "mixer.D", (di,)),
                (p + "mixer.out_proj.weight", (d, di))]
    out.append(("norm_f.weight", (d,)))
    return out


def _init_value(name, shape, cfg: MambaConfig, gen: torch.Generator) -> torch.Tensor:
    """mamba_ssm initialisation (Mamba.__init__ + MixerModel._init_weights with prenorm rescaling)."""
    def uniform(bound):
        return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound

    leaf = name.split(".")[-2:] if name.count(".") else [name]
    key = ".".join(leaf)
    if key.endswith("norm.weight") or name == "norm_f.weight":
        return torch.ones(shape, dtype=torch.float64)
    if key == "mixer.A_log":
        return torch.log(torch.arange(1, shape[1] + 1, dtype=torch.float64)).expand(shape).clone()
    if key == "mixer.D":
        return torch.ones(shape, dtype=torch.float64)
    if key == "dt_proj.weight":
        return uniform(cfg.dt_rank_value ** -0.5)
    if key == "dt_proj.bias":
        dt_min, dt_max = 1e-3, 1e-1
        dt = torch.exp(torch.rand(shape, generator=gen, dtype=torch.float64)
                       * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=1e-4)
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if key == "conv1d.weight" or key == "conv1d.bias":
        return uniform(1.0 / math.sqrt(cfg.d_conv))  # nn.Conv1d default: fan_in = 1 * d_conv
    # nn.Linear default (kaiming_uniform with a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    fan_in = shape[1] if len(shape) == 2 else None
    if key == "input_proj.bias":
        fan_in = None
    if fan_in is None:  # input_proj.bias: bound from the weight's fan_in, stored on cfg by caller
        raise KeyError(name)
    w = uniform(1.0 / math.sqrt(fan_in))
    if key == "out_proj.weight":
        w = w / math.sqrt(cfg.n_layers)  # mamba_ssm rescale_prenorm_residual, one residual per layer
    return w


class MambaBackbone(nn.Module):
    """Mamba-1 backbone ``x [B, T, input_dim] -> features [B, T, d_model]`` with RL reset semantics.

    Args:
        cfg: a :class:`MambaConfig`.
        input_dim: size of the last dim of x (>= 1).
        device: where the arena lives ("cpu", "cuda", torch.device).
        seed: seed of the initialisation (a CPU torch.Generator, so equal on every device).
        backend: "reference" (pure torch: CPU or GPU, float32 or float64), "cuda" (extension kernels;
            raises RuntimeError naming the cause when they cannot load), or "auto" (cuda on a CUDA device
            when the extension loads, else reference).
        dtype: master dtype, torch.float32 (default) or torch.float64 (reference backend only; for
            gradient checks).

    Raises:
        ValueError: bad input_dim, dtype, backend, or an input of the wrong shape/dtype/device in forward.
    """

    def __init__(self, cfg: MambaConfig, input_dim: int, device=None, seed: int | None = 0,
                 backend: str = "auto", dtype: torch.dtype = torch.float32):
        super().__init__()
        if not isinstance(cfg, MambaConfig):
            raise ValueError(f"MambaBackbone: cfg must be a MambaConfig, got {type(cfg).__name__}")
        if isinstance(input_dim, bool) or not isinstance(input_dim, int) or input_dim < 1:
            raise ValueError(f"MambaBackbone: input_dim must be an int >= 1, got {input_dim!r}")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"MambaBackbone: dtype must be torch.float32 or torch.float64, got {dtype}")
        if backend not in ("auto", "cuda", "reference"):
            raise ValueError(f"MambaBackbone: backend must be 'auto', 'cuda' or 'reference', got {backend!r}")
        self.cfg = cfg
        self.input_dim = input_dim
        self._requested_backend = backend
        self._layout = _layout(cfg, input_dim)
        # Arena order: the decay group first, then the "reference" no-decay group, so that one boundary
        # index (n_decay) gives per-tensor weight decay in the flat optimizer.
        ordered = [e for e in self._layout if not is_no_decay(e[0])] + [e for e in self._layout if is_no_decay(e[0])]
        self._offsets = {}
        off = 0
        for name, shape in ordered:
            n = math.prod(shape)
            self._offsets[name] = (off, shape)
            off += n
        self.numel_total = off
        self.n_decay = sum(math.prod(s) for nm, s in ordered if not is_no_decay(nm))

        gen = torch.Generator().manual_seed(0 if seed is None else int(seed))
        init = torch.empty(off, dtype=torch.float64)
        for name, shape in self._layout:  # draw in model order: the init does not depend on arena order
            o, _ = self._offsets[name]
            if name == "input_proj.bias":
                v = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(input_dim)
            else:
                v = _init_value(name, shape, cfg, gen)
            init[o:o + math.prod(shape)] = v.reshape(-1)
        arena = init.to(dtype=dtype, device=device)

        # Module tree with the HF / mamba_ssm names; parameters are registered below as arena views.
        self.input_proj = nn.Module()
        self.layers = nn.ModuleList()
        for _ in range(cfg.n_layers):
            blk = nn.Module()
            blk.norm = nn.Module()
            blk.mixer = nn.Module()
            for sub in ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj"):
                setattr(blk.mixer, sub, nn.Module())
            self.layers.append(blk)
        self.norm_f = nn.Module()
        for name, shape in self._layout:
            mod_path, pname = name.rsplit(".", 1)
            mod = self.get_submodule(mod_path)
            mod.register_parameter(pname, nn.Parameter(torch.empty(0, dtype=dtype, device=device)))
        self.compute_dtype = dtype
        self.compute_arena = None
        self._bind_arena(arena)
        self.backend = self._resolve_backend(backend)

    # ----------------------------------------------------------------------------------------- arena
    def _bind_arena(self, arena: torch.Tensor):
        """Point every Parameter (and .grad) at views of ``arena`` and a fresh zero grad arena."""
        self.arena = arena
        self.grad_arena = torch.zeros_like(arena)
        for name, _ in self._layout:
            p = self.get_parameter(name)
            p.data = self.arena_view(arena, name)
            p.grad = self.arena_view(self.grad_arena, name)
        if self.compute_arena is not None:
            self.compute_arena = arena.to(self.compute_arena.dtype)

    def __setstate__(self, state):
        # deepcopy / pickle copy the arena and each Parameter separately: re-point the Parameters at the
        # copied arena (their values are equal) and the grads at a copied grad arena.
        super().__setstate__(state)
        grads = self.grad_arena.clone()
        compute = self.compute_arena
        self._bind_arena(self.arena)
        self.grad_arena.copy_(grads)
        if compute is not None:
            self.compute_arena = compute

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` into the arena (in place; ``assign=True`` is refused, since it
        would detach the Parameters from the arena), then refresh the compute copy."""
        if assign:
            raise ValueError("MambaBackbone.load_state_dict: assign=True would detach the parameters from the "
                             "arena; load in place (assign=False)")
        out = super().load_state_dict(state_dict, strict=strict)
        self.refresh_compute()
        return out

    def arena_view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """The view of parameter ``name`` inside a flat tensor laid out like the arena."""
        o, shape = self._offsets[name]
        return flat[o:o + math.prod(shape)].view(shape)

    def attach_grads(self):
        """Re-point every ``.grad`` at the grad arena (after a ``zero_grad(set_to_none=True)`` elsewhere)."""
        for name, _ in self._layout:
            p = self.get_parameter(name)
            v = self.arena_view(self.grad_arena, name)
            if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                if p.grad is not None:
                    v.copy_(p.grad)
                p.grad = v

    def zero_grad(self, set_to_none: bool = False):
        """Zero the flat gradient arena (grads stay views into it; ``set_to_none`` is ignored)."""
        self.attach_grads()
        self.grad_arena.zero_()

    def _apply(self, fn, recurse=True):
        # .to(device) / .double() etc.: move the arena once and re-bind the views, keeping the
        # Parameter objects (so optimizers holding them stay valid).
        new = fn(self.arena)
        if new.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"MambaBackbone: master dtype must stay float32 or float64, got {new.dtype}")
        self._bind_arena(new)
        self.compute_dtype = new.dtype if self.compute_arena is None else self.compute_dtype
        self.backend = self._resolve_backend(self._requested_backend)
        return self

    def set_compute_dtype(self, dtype: torch.dtype):
        """Keep a low-precision copy of the arena (bf16/f16) that the GEMMs read; float32 drops it.

        The copy is refreshed by :meth:`refresh_compute` (the trainer's AdamW writes it in the same pass).
        """
        if dtype in (torch.float32, torch.float64) or dtype == self.arena.dtype:
            self.compute_arena = None
            self.compute_dtype = self.arena.dtype
        elif dtype in (torch.bfloat16, torch.float16):
            self.compute_arena = self.arena.detach().to(dtype)
            self.compute_dtype = dtype
        else:
            raise ValueError(f"set_compute_dtype: expected float32, bfloat16 or float16, got {dtype}")

    @torch.no_grad()
    def refresh_compute(self):
        """Copy the master arena into the compute arena (no-op without one)."""
        if self.compute_arena is not None:
            self.compute_arena.copy_(self.arena)

    # --------------------------------------------------------------------------------------- backend
    def _resolve_backend(self, backend: str) -> str:
        dev = self.arena.device
        if backend == "reference":
            return "reference"
        if backend == "cuda":
            if dev.type != "cuda":
                raise ValueError(f"MambaBackbone: backend='cuda' needs a CUDA device, got {dev}")
            if self.arena.dtype != torch.float32:
                raise ValueError(f"MambaBackbone: backend='cuda' needs float32 masters, got {self.arena.dtype}")
            if extension() is None:
                raise RuntimeError(f"MambaBackbone: the CUDA extension could not load: {extension_error()!r}")
            return "cuda"
        if dev.type == "cuda" and self.arena.dtype == torch.float32 and extension() is not None:
            return "cuda"
        return "reference"

    def _ops(self):
        if self.backend == "cuda":
            return causal_conv1d, selective_scan, rms_norm
        return causal_conv1d_ref, selective_scan_ref, rms_norm_ref

    def weight(self, name: str) -> torch.Tensor:
        """Parameter ``name`` as the GEMMs read it: the compute copy when one exists (grad flows to the master)."""
        mod, pname = name.rsplit(".", 1)
        m = self.get_submodule(mod)
        p = getattr(m, pname)  # not get_parameter: torch.func.functional_call swaps in plain tensors
        if self.compute_arena is None:
            return p
        if p is not m._parameters.get(pname) or p.data_ptr() != self.arena_view(self.arena, name).data_ptr():
            return p.to(self.compute_dtype)  # a swapped-in tensor (functional_call): cast it, not our copy
        return _UseCompute.apply(p, self.arena_view(self.compute_arena, name))

    def step_weights(self) -> dict:
        """name -> tensor for the one-token engine: GEMM weights in the compute dtype, the rest master."""
        out = {}
        for name, _ in self._layout:
            gemm = name.endswith(_GEMM_PARAMS) or name.startswith("input_proj.")
            if gemm and self.compute_arena is not None:
                out[name] = self.arena_view(self.compute_arena, name)
            else:
                out[name] = self.get_parameter(name).detach()
        return out

    # --------------------------------------------------------------------------------------- forward
    @property
    def device(self) -> torch.device:
        return self.arena.device

    def initial_state(self, batch: int) -> RecurrentState:
        """All-zero :class:`RecurrentState` for ``batch`` rows, in the master dtype, on the arena's device."""
        c = self.cfg
        return RecurrentState.zeros(c.n_layers, batch, c.d_inner, c.d_conv, c.d_state, device=self.device,
                                    dtype=self.arena.dtype)

    def check_inputs(self, x, initial_state=None, episode_starts=None, *, where="MambaBackbone.forward"):
        """Validate forward inputs; raise ValueError naming the expected and received shape/dtype/device."""
        check_tensor(f"{where}: x", x, shape=(None, None, self.input_dim), device=self.device, floating=True)
        B, T = x.shape[:2]
        if T < 1:
            raise ValueError(f"{where}: x must hold at least one step, got T = {T} (shape {list(x.shape)})")
        if episode_starts is not None:
            check_tensor(f"{where}: episode_starts", episode_starts, shape=(B, T), dtype=torch.bool,
                         device=self.device)
        if initial_state is not None:
            if not isinstance(initial_state, RecurrentState):
                raise ValueError(f"{where}: initial_state must be a RecurrentState, got "
                                 f"{type(initial_state).__name__}")
            c = self.cfg
            check_tensor(f"{where}: initial_state.conv", initial_state.conv,
                         shape=(c.n_layers, B, c.d_inner, c.d_conv - 1), device=self.device, floating=True)
            check_tensor(f"{where}: initial_state.ssm", initial_state.ssm,
                         shape=(c.n_layers, B, c.d_inner, c.d_state), device=self.device, floating=True)

    def forward(self, x: torch.Tensor, initial_state: RecurrentState | None = None,
                episode_starts: torch.Tensor | None = None):
        """Run the backbone over a sequence.

        Args:
            x: [B, T, input_dim] float tensor on the arena's device (float32, or float64 in float64 mode).
            initial_state: a :class:`RecurrentState` for B rows, or None for zeros. Gradients flow into it
                only if its tensors require grad (truncated BPTT otherwise).
            episode_starts: [B, T] bool or None. True at (b, t): x[b, t] is the first observation of a new
                episode, so row b's conv window and SSM state are zero before step t.
        Returns:
            (features [B, T, d_model] in the master dtype, final_state :class:`RecurrentState`).
        Raises:
            ValueError: on a wrong shape, dtype or device (message gives expected vs received).
        """
        self.check_inputs(x, initial_state, episode_starts)
        if self._use_fused(initial_state):
            return self._forward_fused(x, initial_state, episode_starts)
        conv, scan, norm = self._ops()
        c = self.cfg
        di, n, r, eps = c.d_inner, c.d_state, c.dt_rank_value, c.rms_norm_eps
        rdt, cdt = self.arena.dtype, self.compute_dtype
        h = F.linear(x.to(cdt), self.weight("input_proj.weight"), self.weight("input_proj.bias")).to(rdt)
        conv_f, ssm_f = [], []
        for i, layer in enumerate(self.layers):
            mx = layer.mixer
            u = norm(h, layer.norm.weight, eps, cdt)
            xz = F.linear(u, self.weight(f"layers.{i}.mixer.in_proj.weight"))
            xi, z = xz.split(di, dim=-1)
            cs = None if initial_state is None else initial_state.conv[i]
            ss = None if initial_state is None else initial_state.ssm[i]
            xc, cf = conv(xi, mx.conv1d.weight.view(di, -1), mx.conv1d.bias, cs, episode_starts)
            dbc = F.linear(xc, self.weight(f"layers.{i}.mixer.x_proj.weight"))
            dt_r, Bm, Cm = dbc.split([r, n, n], dim=-1)
            dt = F.linear(dt_r, self.weight(f"layers.{i}.mixer.dt_proj.weight"))
            y, sf = scan(xc, dt, mx.A_log, Bm, Cm, mx.D, z, mx.dt_proj.bias, ss, episode_starts)
            h = h + F.linear(y, self.weight(f"layers.{i}.mixer.out_proj.weight")).to(rdt)
            conv_f.append(cf)
            ssm_f.append(sf)
        feat = norm(h, self.norm_f.weight, eps, rdt)
        return feat, RecurrentState(torch.stack(conv_f), torch.stack(ssm_f))

    def _use_fused(self, initial_state) -> bool:
        """The cuda backend runs the whole backbone as one node with a hand-written backward, unless a
        gradient into the initial state is asked for (then the per-op autograd path serves)."""
        if self.backend != "cuda" or self.cfg.d_state not in (8, 16):
            return False
        return initial_state is None or not (initial_state.conv.requires_grad or initial_state.ssm.requires_grad)

    def _forward_fused(self, x, initial_state, episode_starts):
        from .fused import fused_backbone
        B, T = x.shape[:2]
        if initial_state is None:
            initial_state = self.initial_state(B)
        conv0 = initial_state.conv.to(torch.float32).contiguous()
        ssm0 = initial_state.ssm.to(torch.float32).contiguous()
        if episode_starts is None:
            episode_starts = torch.zeros(B, T, dtype=torch.bool, device=x.device)
        feat, conv_f, ssm_f = fused_backbone(self, x, conv0, ssm0, episode_starts.contiguous())
        return feat, RecurrentState(conv_f, ssm_f)

    def stepper(self, batch: int):
        """A one-token inference engine for ``batch`` envs that shares this module's weights (no copy)."""
        from .stepper import Stepper
        return Stepper(self, batch)

    def extra_repr(self) -> str:
        return f"cfg={self.cfg}, input_dim={self.input_dim}, backend={self.backend!r}, params={self.numel_total}"
