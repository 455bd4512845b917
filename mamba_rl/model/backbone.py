"""MambaBackbone: input projection, N residual Mamba-1 blocks and a final RMSNorm over one flat arena.

The model is Gu & Dao 2023 (arXiv:2312.00752) as built by mamba_ssm's ``Mamba`` mixer inside pre-norm
residual blocks (docs/architecture.md, "Model"). Parameter names follow HF / mamba_ssm, so a familiar
state dict maps one to one; the parameters live in one flat arena (:class:`~mamba_rl.model.arena.ArenaModule`).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import MambaConfig
from ..ops import causal_conv1d, causal_conv1d_ref, rms_norm, rms_norm_ref, selective_scan, selective_scan_ref
from ..ops.capability import Support, autograd_support, kernel_support
from ..ops.checks import check_tensor
from ..ops.extension import extension, extension_error, fallback_message
from ..ops.step import backbone_step_packed, pack_step_weights
from .arena import ArenaModule, arena_key, cache_hit
from .block import MambaBlock
from .fused import fused_backbone
from .init import GEMM_PARAMS, init_values, is_no_decay, param_layout
from .state import RecurrentState
from .stepper import Stepper

__all__ = ["MambaBackbone", "BACKENDS"]

BACKENDS = ("auto", "cuda", "cpu", "reference")
_WARNED: set[str] = set()


def _check_device(device) -> None:
    """Raise ValueError for a device this process cannot use: not a device at all, CUDA where no CUDA device
    is available (instead of torch's driver RuntimeError at the first allocation), or a CUDA index past
    ``torch.cuda.device_count()``."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"MambaBackbone: device must be a torch.device or a string such as 'cpu' or 'cuda', "
                         f"got {device!r} ({e})") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"MambaBackbone: device {str(device)!r} asked for, but CUDA is not available here "
                             f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                             f"use device='cpu'")
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"MambaBackbone: device {str(device)!r} asked for, but only {n} CUDA device(s) "
                             f"are visible (indices 0..{n - 1})")


def _guard_fused_backward(net, node) -> None:
    """Pre/post hooks on the fused node (pure Python, nothing on the device in the usual case): a backward
    with grad mode on (``create_graph=True``) raises RuntimeError, since the node has no double backward; a
    backward that does not accumulate into the parameters (``torch.autograd.grad(out, [x])``,
    ``backward(inputs=[x])``) gets x's gradient and leaves ``.grad`` (the gradient arena) as it was; one that does
    first re-attaches any ``.grad`` a ``zero_grad()`` set to None (:meth:`ArenaModule.attach_grads`: it starts
    from zero, as torch's own accumulation would)."""
    anchor = node.next_functions[1][0]  # the zero-size leaf standing for the parameters (fused_backbone)
    will_run = getattr(torch._C, "_will_engine_execute_node", None)
    saved = []

    def pre(grad_outputs):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"MambaBackbone (backend {net.backend!r}): higher-order gradients (create_graph=True) are not "
                f"supported through the fused kernel node; use backend='reference' (or torch.func.functional_call, "
                f"which runs the reference math) for double backward")
        if anchor is None or (will_run is not None and not will_run(anchor)):
            saved.append(net.grad_arena.clone())
        else:
            net.attach_grads()

    def post(grad_inputs, grad_outputs):
        if saved:
            net.grad_arena.copy_(saved.pop())

    node.register_prehook(pre)
    node.register_hook(post)


def check_step_args(who: str, state, episode_starts) -> None:
    """The checks of a backbone's one-token ``step`` (a type and a dtype test): ValueError unless ``state`` is a
    :class:`RecurrentState` and ``episode_starts`` None or a bool tensor."""
    if not isinstance(state, RecurrentState):
        raise ValueError(f"{who}: state must be a RecurrentState (initial_state(batch)), got {type(state).__name__}")
    if episode_starts is not None and (not isinstance(episode_starts, torch.Tensor)
                                       or episode_starts.dtype != torch.bool):
        raise ValueError(f"{who}: episode_starts must be a [B] bool tensor or None, got "
                         f"{getattr(episode_starts, 'dtype', type(episode_starts).__name__)}")


class MambaBackbone(ArenaModule):
    """Mamba-1 backbone ``x [B, T, input_dim] -> features [B, T, d_model]`` with RL reset semantics.

    Args:
        cfg: a :class:`MambaConfig`.
        input_dim: size of the last dim of x (>= 1).
        device: where the arena lives ("cpu", "cuda", torch.device).
        seed: seed of the initialisation (a CPU torch.Generator, so equal on every device).
        backend: "reference" (pure torch: CPU or GPU, float32 or float64), "cuda" (the CUDA kernels),
            "cpu" (the C++/OpenMP kernels), or "auto": cuda on a CUDA device, cpu on the CPU, for float32
            masters when the kernels load, else the reference (on the CPU with one warning naming the cause).
        dtype: master dtype, torch.float32 (default) or torch.float64 (reference backend only; for
            gradient checks).

    Gradients on the kernel backends ("cpu", "cuda"): the whole backbone is one autograd node whose
    ``backward()`` accumulates every parameter gradient into ``.grad`` (views of the flat gradient arena),
    outside autograd. So ``loss.backward()`` gives the reference backend's ``.grad``, and the gradient of x
    flows as usual. Where that would differ, the reference math runs instead: grad mode on with some
    parameters frozen (``requires_grad_(False)``; all frozen is fine when x / the state need no grad),
    a hook on a parameter, a gradient into the initial state, or parameters swapped in
    (``torch.func.functional_call``). ``torch.autograd.grad(out, [x])`` (or ``backward(inputs=[x])``) leaves
    ``.grad`` unchanged. Not supported on the kernel node: ``torch.autograd.grad(out, params)`` (the node has
    no edge to the parameters: torch reports them unused, or None with ``allow_unused=True``) and higher-order
    gradients (``create_graph=True`` raises RuntimeError in backward). For those use backend="reference" or
    ``torch.func.functional_call`` (which runs the reference math on the swapped-in tensors).

    Raises:
        ValueError: bad input_dim, dtype, backend or device (e.g. "cuda" where CUDA is not available), or
            an input of the wrong shape/dtype/device in forward.
        RuntimeError: backend "cuda" or "cpu" asked for but its kernels cannot load (the message says why);
            in backward, ``create_graph=True`` through the kernel node.
    """

    def __new__(cls, cfg=None, *args, **kwargs):
        # checked here so that every layer kind (Mamba3Backbone too) refuses a device it cannot use up front
        _check_device(kwargs["device"] if "device" in kwargs else (args[1] if len(args) > 1 else None))
        # layer="Mamba3" builds the Mamba-3 backbone, a subclass with the same API (mamba_rl/model/mamba3.py)
        if cls is MambaBackbone and isinstance(cfg, MambaConfig) and cfg.layer == "Mamba3":
            from .mamba3 import Mamba3Backbone
            cls = Mamba3Backbone
        return super().__new__(cls)

    def __init__(self, cfg: MambaConfig, input_dim: int, device=None, seed: int | None = 0,
                 backend: str = "auto", dtype: torch.dtype = torch.float32):
        super().__init__()
        if not isinstance(cfg, MambaConfig):
            raise ValueError(f"MambaBackbone: cfg must be a MambaConfig, got {type(cfg).__name__}")
        self._init_common(cfg, input_dim, backend, dtype)
        self.layers = nn.ModuleList([MambaBlock() for _ in range(cfg.n_layers)])
        self.norm_f = nn.Module()
        layout = param_layout(cfg, input_dim)
        self._init_arena(layout, init_values(cfg, input_dim, 0 if seed is None else seed), is_no_decay, device, dtype)
        self.backend = self._resolve_backend(backend)

    def _init_common(self, cfg: MambaConfig, input_dim: int, backend: str, dtype: torch.dtype) -> None:
        """Validate the constructor arguments every layer kind shares and set the shared attributes."""
        if isinstance(input_dim, bool) or not isinstance(input_dim, int) or input_dim < 1:
            raise ValueError(f"MambaBackbone: input_dim must be an int >= 1, got {input_dim!r}")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"MambaBackbone: dtype must be torch.float32 or torch.float64, got {dtype}")
        if backend not in BACKENDS:
            raise ValueError(f"MambaBackbone: backend must be one of {BACKENDS}, got {backend!r}")
        self.cfg = cfg
        self.input_dim = input_dim
        self._requested_backend = backend
        self.input_proj = nn.Module()

    # --------------------------------------------------------------------------------------- backend
    def _check_arena_move(self, new: torch.Tensor):
        # an explicit "cpu" / "cuda" backend refuses float64 or another device before the arena moves
        self._resolve_backend(self._requested_backend, new.device, new.dtype)

    def _arena_moved(self):
        self.backend = self._resolve_backend(self._requested_backend)

    def _resolve_backend(self, backend: str, dev: torch.device | None = None, dt: torch.dtype | None = None) -> str:
        dev = self.arena.device if dev is None else dev
        dt = self.arena.dtype if dt is None else dt
        if backend == "reference":
            return "reference"
        if backend in ("cuda", "cpu"):
            if dev.type != backend:
                raise ValueError(f"MambaBackbone: backend={backend!r} needs a {backend.upper()} device, got {dev}")
            if dt != torch.float32:
                raise ValueError(f"MambaBackbone: backend={backend!r} needs float32 masters, got {dt}")
            if extension(backend) is None:
                raise RuntimeError(f"MambaBackbone: the {backend} kernels could not load: {extension_error(backend)!r}")
            return backend
        if dev.type in ("cuda", "cpu") and dt == torch.float32:
            if extension(dev.type) is not None:
                return dev.type
            if dev.type == "cpu" and "cpu" not in _WARNED:
                _WARNED.add("cpu")
                warnings.warn(fallback_message("cpu"), RuntimeWarning, stacklevel=3)
        return "reference"

    @property
    def kernels(self):
        """The extension module of the backend ("cuda" / "cpu"), or None on the reference backend."""
        return None if self.backend == "reference" else extension(self.backend)

    def _ops(self, reference: bool = False):
        """(conv, scan, norm) of the per-op path: the references, or the dispatchers (each asks
        :func:`mamba_rl.ops.capability.kernel_support` whether its kernel takes the inputs)."""
        if reference or self.backend == "reference":
            return causal_conv1d_ref, selective_scan_ref, rms_norm_ref
        return causal_conv1d, selective_scan, rms_norm

    def step_weights(self) -> dict:
        """name -> tensor for the one-token engine: GEMM weights in the compute dtype, the rest master.

        Views into the arenas, cached while the arenas stay where they are (in-place updates are seen).
        While parameters are swapped in (``torch.func.functional_call``) it returns those tensors, uncached."""
        swapped = not self.params_are_arena()
        key = arena_key(self.arena, self.compute_arena)
        cache = self.__dict__.get("_step_cache")
        if not swapped and cache is not None and cache_hit(cache[0], key):
            return cache[1]
        out = {}
        for name, _ in self._layout:
            gemm = name.endswith(GEMM_PARAMS) or name.startswith("input_proj.")
            mod, pname = name.rsplit(".", 1)
            p = getattr(self.get_submodule(mod), pname).detach()  # getattr: sees swapped-in tensors
            if gemm and self.compute_arena is not None:
                out[name] = p.to(self.compute_dtype) if swapped else self.arena_view(self.compute_arena, name)
            else:
                out[name] = p
        if swapped:
            return out
        packed = pack_step_weights(out, self.cfg.n_layers, self.cfg.d_inner)
        self.__dict__["_step_cache"] = (key, out, packed)
        return out

    def _packed_step_weights(self) -> tuple:
        self.step_weights()
        return self.__dict__["_step_cache"][2]

    # --------------------------------------------------------------------------------------- forward
    @property
    def device(self) -> torch.device:
        return self.arena.device

    def initial_state(self, batch: int) -> RecurrentState:
        """All-zero :class:`RecurrentState` for ``batch`` rows, in the master dtype, on the arena's device."""
        c = self.cfg
        return RecurrentState.zeros(c.n_layers, batch, c.d_inner, c.d_conv, c.d_state, device=self.device,
                                    dtype=self.arena.dtype)

    def _state_layout(self, batch: int) -> tuple[type, str, tuple, tuple]:
        """(state class, what the conv slot holds, conv shape, ssm shape) of this backbone's state."""
        c = self.cfg
        return (RecurrentState, "", (c.n_layers, batch, c.d_inner, c.d_conv - 1),
                (c.n_layers, batch, c.d_inner, c.d_state))

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
            cls, conv_what, conv_shape, ssm_shape = self._state_layout(B)
            if not isinstance(initial_state, RecurrentState):
                raise ValueError(f"{where}: initial_state must be a {cls.__name__}, got "
                                 f"{type(initial_state).__name__}")
            check_tensor(f"{where}: initial_state.conv{conv_what}", initial_state.conv, shape=conv_shape,
                         device=self.device, floating=True)
            check_tensor(f"{where}: initial_state.ssm", initial_state.ssm, shape=ssm_shape, device=self.device,
                         floating=True)

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
            (features [B, T, d_model] in the master dtype, final_state :class:`RecurrentState`). Inside a
            ``torch.autocast`` region the backbone runs with autocast off: its precision is its compute dtype
            (:meth:`set_compute_dtype`), which its kernels take.
        Raises:
            ValueError: on a wrong shape, dtype or device (message gives expected vs received).
        """
        if torch.is_autocast_enabled(self.device.type):
            with torch.autocast(self.device.type, enabled=False):
                return self.forward(x, initial_state, episode_starts)
        self.check_inputs(x, initial_state, episode_starts)
        empty = x.shape[0] == 0  # no rows: nothing for a kernel to do, the reference returns empty tensors
        if not empty and self._use_fused(initial_state, x):
            return self._forward_fused(x, initial_state, episode_starts)
        c = self.cfg
        ops = self._ops(reference=empty or (self.backend != "reference" and (
            not self.params_are_arena() or not self.autograd_support(x, initial_state))))
        rdt, cdt = self.arena.dtype, self.compute_dtype
        h = F.linear(x.to(cdt), self.weight("input_proj.weight"), self.weight("input_proj.bias")).to(rdt)
        conv_f, ssm_f = [], []
        for i, block in enumerate(self.layers):
            cs = None if initial_state is None else initial_state.conv[i]
            ss = None if initial_state is None else initial_state.ssm[i]
            h, cf, sf = block(h, cs, ss, episode_starts, lambda k, i=i: self.weight(f"layers.{i}.{k}"), ops,
                              c.rms_norm_eps, cdt)
            conv_f.append(cf)
            ssm_f.append(sf)
        feat = ops[2](h, self.norm_f.weight, c.rms_norm_eps, rdt)
        return feat, RecurrentState(torch.stack(conv_f), torch.stack(ssm_f))

    def kernel_support(self, op: str) -> Support:
        """(ok, reason): can this backbone run ``op`` ("sequence", "step", "rms_norm_fwd", "rms_norm_bwd",
        "conv", "scan") on its backend's kernels now? The one predicate behind every dispatch of the
        backbone (:func:`mamba_rl.ops.capability.kernel_support` for the sizes, plus: the parameters must
        be the arena's own, not tensors swapped in by ``torch.func.functional_call``)."""
        if self.backend == "reference":
            return Support(False, "the reference backend runs no kernels")
        if not self.params_are_arena():
            return Support(False, "parameters were swapped in (torch.func.functional_call or assignment): "
                                  "the kernels read the arena, so the reference math runs")
        c = self.cfg
        return kernel_support(self.backend, op, d_model=c.d_model, d_inner=c.d_inner, d_state=c.d_state,
                              d_conv=c.d_conv, n_layers=c.n_layers, dt_rank=c.dt_rank_value,
                              input_dim=self.input_dim, dtype=self.compute_dtype, device=self.device)

    def autograd_support(self, x: torch.Tensor | None = None, initial_state: RecurrentState | None = None) -> Support:
        """(ok, reason): would the fused node's backward (every parameter gradient into the gradient arena,
        outside autograd) give what autograd gives for these inputs under the current grad mode?
        :func:`mamba_rl.ops.capability.autograd_support`: not when some parameters are frozen or have hooks.
        When not ok, :meth:`forward` runs the reference math."""
        req = x is not None and x.requires_grad
        if initial_state is not None:
            req = req or initial_state.conv.requires_grad or initial_state.ssm.requires_grad
        named = self.__dict__.get("_named_slots")
        if named is None:  # the registered Parameter objects never change (the arena re-binds their .data)
            named = self.__dict__["_named_slots"] = tuple((n, p) for (n, _), (_, _, p) in zip(self._layout,
                                                                                             self._param_slots))
        return autograd_support(named, inputs_require_grad=req)

    def _use_fused(self, initial_state, x: torch.Tensor | None = None) -> bool:
        """The kernel backends run the whole backbone as one node with a hand-written backward
        (:mod:`mamba_rl.model.fused`) when :meth:`kernel_support` ("sequence") and :meth:`autograd_support`
        say so, unless a gradient into the initial state is asked for (then the per-op autograd path serves)."""
        if not self.kernel_support("sequence") or not self.autograd_support(x, initial_state):
            return False
        return initial_state is None or not (initial_state.conv.requires_grad or initial_state.ssm.requires_grad)

    # the whole-backbone node of this layer kind: (net, x, conv0, ssm0, starts) -> (features, conv_f, ssm_f)
    _fused_node = staticmethod(fused_backbone)

    def _forward_fused(self, x, initial_state, episode_starts):
        """forward on the kernel backends' whole-backbone node (:attr:`_fused_node`): float32 contiguous
        initial state (zeros for None) and starts (all False for None) -> (features, the layer kind's state)."""
        B, T = x.shape[:2]
        if initial_state is None:
            initial_state = self.initial_state(B)
        conv0 = initial_state.conv.to(torch.float32).contiguous()
        ssm0 = initial_state.ssm.to(torch.float32).contiguous()
        if episode_starts is None:
            episode_starts = torch.zeros(B, T, dtype=torch.bool, device=x.device)
        feat, conv_f, ssm_f = self._fused_node(self, x, conv0, ssm0, episode_starts.contiguous())
        if feat.grad_fn is not None:
            _guard_fused_backward(self, feat.grad_fn)
        state_cls = self._state_layout(B)[0]
        return feat, state_cls(conv_f, ssm_f)

    @torch.no_grad()
    def step(self, x_t: torch.Tensor, state: RecurrentState, episode_starts: torch.Tensor | None = None):
        """One token through every layer: x_t [B, input_dim] -> features [B, d_model] (master dtype), with
        ``state`` advanced in place. One extension call where :meth:`kernel_support` ("step") allows it
        (CUDA: d_state 8/16, d_conv 4, at most 16 layers, shared memory; both: float32 state and arena
        parameters); otherwise each block's :meth:`MambaBlock.step` (torch ops, capturable). Shapes and devices
        are not validated here (see :class:`Stepper`); the two checks that are (each a type or dtype test) guard
        against answers that would be silently wrong or a raw AttributeError.

        Raises:
            ValueError: ``state`` not a :class:`RecurrentState`, or ``episode_starts`` not a bool tensor (a uint8
                mask would be inverted bitwise by the torch path and reset the wrong rows).
        """
        check_step_args(type(self).__name__ + ".step", state, episode_starts)
        c = self.cfg
        if state.ssm.dtype == torch.float32 and self.kernel_support("step"):
            return backbone_step_packed(self.kernels, x_t, self._packed_step_weights(), state.conv, state.ssm,
                                        episode_starts, c.rms_norm_eps)
        return self._step_layers(x_t, state, episode_starts)

    def _step_layers(self, x_t: torch.Tensor, state: RecurrentState, episode_starts: torch.Tensor | None):
        """The torch-op one-token step: input_proj, each block's ``step`` on its state slice, norm_f."""
        c = self.cfg
        rdt, cdt = self.arena.dtype, self.compute_dtype
        w = self.step_weights()
        h = F.linear(x_t.to(cdt), w["input_proj.weight"], w["input_proj.bias"]).to(rdt)
        for i, block in enumerate(self.layers):
            h = block.step(h, state.conv[i], state.ssm[i], episode_starts, lambda k, i=i: w[f"layers.{i}.{k}"],
                           c.rms_norm_eps)
        return rms_norm_ref(h, w["norm_f.weight"], c.rms_norm_eps, rdt)

    def stepper(self, batch: int):
        """A one-token inference engine for ``batch`` envs that shares this module's weights (no copy)."""
        return Stepper(self, batch)

    def extra_repr(self) -> str:
        return f"cfg={self.cfg}, input_dim={self.input_dim}, backend={self.backend!r}, params={self.numel_total}"
