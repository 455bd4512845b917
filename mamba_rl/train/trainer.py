"""MambaTrainer: owns every piece of training state of a :class:`~mamba_rl.MambaBackbone`.

It holds the float32 master arena (the backbone's), the flat gradient arena, AdamW's moments, the
bf16/f16 compute copy, the dynamic loss scaler, the carried recurrent state, static input buffers and,
after :meth:`MambaTrainer.capture_graph`, CUDA graphs of the fused step, of ``forward`` and of
``backward_step``, all replayed from these same buffers (docs/architecture.md, "Trainer").
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
from dataclasses import dataclass
from operator import attrgetter, is_

import torch

from ..graphs import GraphSet, capture_restoring, restore, snapshot
from ..model import fused
from ..model.backbone import MambaBackbone
from ..model.state import RecurrentState
from ..ops.checks import check_tensor
from ..ops.optim import BC1, BC2, CLIP_COEF, FOUND_INF, GRAD_NORM, LOSS_SCALE, STEP, make_hyper, optim_step
from .checkpoint import validate_trainer_state
from .scaler import LossScaler

__all__ = ["MambaTrainer", "StepMetrics", "DTYPES"]

# compute dtype of the GEMMs; "tf32": float32 operands and outputs, cuBLAS GEMMs on TF32 tensor cores (CUDA only)
DTYPES = {"f32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


# glibc heap policy of a process that trains on the cpu backend (see _retain_cpu_heap); set once per process
_HEAP_RETAINED: list = []
_HEAP_MMAP_THRESHOLD = 32 << 20  # glibc's largest: every activation of a training step comes from the heap
_HEAP_TRIM_THRESHOLD = 256 << 20  # the heap keeps up to this much free memory at its top


def _retain_cpu_heap(kernels) -> None:
    """Once per process, where a trainer runs the cpu backend: glibc keeps the memory a training step frees
    for the next one (``kernels.retain_heap``, process-wide ``mallopt``: allocations below 32 MiB from the
    heap, its free top returned to the OS past 256 MiB). With glibc's dynamic defaults the heap top was
    trimmed after a step and faulted back in during the next in some processes: up to ~1,000 minor faults and
    1-2 ms of system time per [2, 128] step at 2 threads (benchmarks/NOTES.md, 2026-12-04 night).
    ``MAMBA_RL_RETAIN_HEAP=0`` leaves the allocator's settings alone."""
    if _HEAP_RETAINED or os.environ.get("MAMBA_RL_RETAIN_HEAP", "1") == "0" or not hasattr(kernels, "retain_heap"):
        return
    _HEAP_RETAINED.append(bool(kernels.retain_heap(_HEAP_MMAP_THRESHOLD, _HEAP_TRIM_THRESHOLD)))


@contextlib.contextmanager
def _tf32_matmul(on: bool):
    """While the block runs, float32 cuBLAS GEMMs may use TF32 tensor cores (``torch.backends.cuda.matmul.
    allow_tf32``, restored after); nothing when ``on`` is False. The flag is read when a GEMM is launched or
    captured, so a captured graph keeps the choice it was captured with."""
    if not on:
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


# _cpu_direct's per-parameter reads (C getters, mapped over a tuple)
_REQUIRES_GRAD = attrgetter("requires_grad")
_GRAD_HOOKS = attrgetter("_backward_hooks")
_GRAD = attrgetter("grad")
_POST_ACC_HOOKS = (attrgetter("_post_accumulate_grad_hooks") if hasattr(torch.Tensor, "_post_accumulate_grad_hooks")
                   else (lambda p: getattr(p, "_post_accumulate_grad_hooks", None)))


def _module_hooks(net) -> bool:
    """Would ``net(...)`` run any module hook (the net's own or a global one)? torch's Module.__call__ skips
    straight to ``forward`` only when none is registered."""
    from torch.nn.modules import module as m
    return bool(net._forward_hooks or net._forward_pre_hooks or net._backward_hooks or net._backward_pre_hooks
                or m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


@dataclass
class StepMetrics:
    """What one optimizer step reports. Tensor fields are 0-d device tensors: reading them as Python
    numbers (``float(m.grad_norm)``, :meth:`to_dict`) syncs; holding or logging them as tensors does not.

    Attributes:
        step: optimizer steps applied so far (float64; skipped f16 overflow steps are not counted).
        grad_norm: global L2 norm of the unscaled gradients, backbone plus ``extra_grad_sq`` (float64).
        clip_coef: the clip factor applied, min(1, max_grad_norm / (grad_norm + 1e-6)) (float64); multiply a
            head's gradients by it to clip head and backbone as one.
        loss_scale: the loss scale after this step's scaler update (float64; 1 outside f16).
        overflow_skipped: 1.0 if the step was skipped on an inf/NaN gradient (f16, or ``skip_nonfinite``), else
            0.0 (float64).
        graph_replayed: True when the step ran as a CUDA graph replay (a Python bool).
    """

    step: torch.Tensor
    grad_norm: torch.Tensor
    clip_coef: torch.Tensor
    loss_scale: torch.Tensor
    overflow_skipped: torch.Tensor
    graph_replayed: bool

    def to_dict(self) -> dict:
        """Python numbers (one device sync)."""
        return {"step": int(self.step.item()), "grad_norm": float(self.grad_norm.item()),
                "clip_coef": float(self.clip_coef.item()), "loss_scale": float(self.loss_scale.item()),
                "overflow_skipped": bool(self.overflow_skipped.item()), "graph_replayed": self.graph_replayed}


def _in_own_scope(method):
    """``method`` of a :class:`MambaTrainer` run in the trainer's own scope (``_own_scope``: grad on, inference
    mode and autocast off) when the caller's differs; as it is otherwise (no context entered on the usual path)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self._outside_scope():
            with self._own_scope():
                return method(self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return call


class MambaTrainer:
    """Fused training step for a Mamba backbone whose loss gradient arrives as ``d_temporal``.

    Args:
        net: the :class:`MambaBackbone` to train (float32 masters; its arena is updated in place).
        batch, seq_len: the fixed B and T of every call.
        dtype: "f32", "tf32", "bf16" or "f16": the precision of the GEMMs (compute copy of the weights). The
            scan, the states, the norms, the master weights and the moments stay float32. "tf32" (an explicit
            opt-in) keeps float32 weights and activations but lets the cuBLAS GEMMs of the trainer's forward and
            backward run on TF32 tensor cores (10-bit mantissa inputs, float32 accumulation; NVIDIA Ampere and
            later; torch's ``allow_tf32``, set only inside the trainer's calls and restored after), so expect
            float32-vs-float64 differences of ~1e-3 relative instead of ~1e-6; on the CPU it is exactly "f32".
            "f16" turns on the dynamic loss scaler (GradScaler semantics: init 2**16, x2 after
            ``growth_interval`` clean steps, x0.5 and a skipped step on overflow).
        lr, betas, eps, weight_decay: AdamW (torch.optim.AdamW semantics).
        no_decay: "reference" exempts A_log, D, dt_proj.bias and every norm weight from weight decay;
            None decays everything.
        max_grad_norm: global-norm clip (clip_grad_norm_ semantics) or None.
        growth_interval: f16 scaler growth interval (2000).
        skip_nonfinite: skip a step whose gradient norm (backbone plus ``extra_grad_sq``) is NaN / inf
            (weights, moments and the step counter unchanged, ``overflow_skipped`` set) in every dtype, not only
            under the f16 scaler (where it is always on); rows of the carried state that came out non-finite
            keep the state they started from. The RL agent sets it, so one bad minibatch never reaches the
            weights.

    Process-wide effect: the first trainer on the cpu backend sets glibc's heap policy for the whole process
    (``mallopt``: allocations below 32 MiB from the heap, up to 256 MiB of its free top kept), so a step's
    ~6 MB of activations are not handed back to the OS and faulted in again every step; ``MAMBA_RL_RETAIN_HEAP=0``
    leaves the allocator alone (see ``_retain_cpu_heap``).

    Raises:
        ValueError: on bad arguments, or an input of the wrong shape, dtype or device.
    """

    def __init__(self, net: MambaBackbone, batch: int, seq_len: int, dtype: str = "f32", lr: float = 3e-4,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, no_decay="reference",
                 max_grad_norm: float | None = None, growth_interval: int = 2000, skip_nonfinite: bool = False):
        if not isinstance(net, MambaBackbone):
            raise ValueError(f"MambaTrainer: net must be a MambaBackbone, got {type(net).__name__}")
        for name, v in (("batch", batch), ("seq_len", seq_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MambaTrainer: {name} must be an int >= 1, got {v!r}")
        if dtype not in DTYPES:
            raise ValueError(f"MambaTrainer: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if no_decay not in ("reference", None):
            raise ValueError(f"MambaTrainer: no_decay must be 'reference' or None, got {no_decay!r}")
        if net.arena.dtype != torch.float32:
            raise ValueError(f"MambaTrainer: the backbone's master weights must be float32, got {net.arena.dtype}")
        dev = net.device
        if not isinstance(skip_nonfinite, bool):
            raise ValueError(f"MambaTrainer: skip_nonfinite must be a bool, got {skip_nonfinite!r}")
        self.hyper = make_hyper(lr, betas, eps, weight_decay, max_grad_norm, dtype == "f16" or skip_nonfinite,
                                dev)  # validates
        self.net, self.batch, self.seq_len, self.dtype = net, batch, seq_len, dtype
        self.tf32 = dtype == "tf32" and dev.type == "cuda"
        self.skip_nonfinite = skip_nonfinite
        self.no_decay = no_decay
        self.betas, self.eps, self.weight_decay, self.max_grad_norm = tuple(betas), eps, weight_decay, max_grad_norm
        self.lr = float(lr)
        self.device = dev
        net.set_compute_dtype(DTYPES[dtype])
        net.zero_grad()
        self.n_decay = net.n_decay if no_decay == "reference" else net.numel_total
        self.exp_avg = torch.zeros_like(net.arena)
        self.exp_avg_sq = torch.zeros_like(net.arena)
        self.scalars = torch.zeros(8, dtype=torch.float64, device=dev)
        self.scalars[BC1] = 1.0
        self.scalars[BC2] = 1.0
        self.scaler = LossScaler(dev, enabled=(dtype == "f16"), growth_interval=growth_interval)
        self.scalars[LOSS_SCALE] = self.scaler.scale[0]
        self._zero = torch.zeros((), dtype=torch.float64, device=dev)
        # Static buffers: every call copies into these, and captured graphs read them.
        c = net.cfg
        # x_buf [B,T,input_dim] f32, d_buf [B,T,d_model] f32, starts_buf [B,T] bool: public, for zero-copy.
        self.x_buf = torch.zeros(batch, seq_len, net.input_dim, device=dev)
        self.d_buf = torch.zeros(batch, seq_len, c.d_model, device=dev)
        self.starts_buf = torch.zeros(batch, seq_len, dtype=torch.bool, device=dev)
        self.extra_sq_buf = torch.zeros((), dtype=torch.float32, device=dev)
        # the carried state (input of the next call) and what the current forward started from (saved by
        # autograd): conv and ssm of each are views of one flat buffer, so the per-step copy is one launch
        self.state, self._state_flat = self._flat_state(batch)
        self._state_used, self._state_used_flat = self._flat_state(batch)
        # (conv, ssm) of the carried state while they are views of _state_flat (contiguous float32), else None
        self._state_own = (self.state.conv, self.state.ssm) if self._state_flat is not None else None
        self._feat = None
        self._graphs = GraphSet("MambaTrainer", self._graph_buffers)
        # the CPU extension for grad_stats / AdamW (C++ passes) when the backbone runs the cpu backend
        self._cpu_kernels = net.kernels if net.backend == "cpu" and dev.type == "cpu" else None
        if self._cpu_kernels is not None:
            _retain_cpu_heap(self._cpu_kernels)
        # (grad arena, [(param, its grad view)], (the grad views in net._param_slots order)) as last attached
        self._grad_views = None
        self._grads_seen = False  # _cpu_direct saw every .grad as attached (this step only)
        # _cpu_direct: the key of the checks that read only the class, the config and the dtypes, as they last
        # passed (None: not passed yet); the per-parameter checks run on every step
        self._direct_static = None
        self._slots = None  # (net._param_slots, their dicts, names, parameters) for _cpu_direct's checks
        self._extra_sq1 = None  # (extra_sq_buf, its [1] view) for the C++ grad_stats

    def __deepcopy__(self, memo: dict) -> "MambaTrainer":
        """An independent copy (backbone, arenas, moments, state, buffers; their views stay views of the copies).
        The CPU extension module is shared, not copied (a module cannot be). Captured CUDA graphs cannot be.

        Raises:
            RuntimeError: when CUDA graphs are captured.
        """
        if self._graphs._graphs:
            raise RuntimeError("MambaTrainer: a trainer with captured CUDA graphs cannot be deep-copied")
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = v if k == "_cpu_kernels" else copy.deepcopy(v, memo)
        return new

    def __copy__(self) -> "MambaTrainer":
        """A shallow copy (every buffer shared), as ``copy.copy`` made before pickling was refused."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __reduce_ex__(self, protocol):
        raise TypeError("MambaTrainer cannot be pickled (its buffers are views of the backbone's arenas, which "
                        "unpickle separately): save trainer.state_dict() (mamba_rl.train.checkpoint) or deep-copy it")

    def _flat_state(self, batch: int):
        """(zero state for ``batch`` rows whose conv and ssm are views of one buffer, that buffer)."""
        s = self.net.initial_state(batch)
        if s.conv.dtype != s.ssm.dtype or s.conv.device != s.ssm.device:
            return s, None
        nc = s.conv.numel()
        flat = torch.zeros(nc + s.ssm.numel(), dtype=s.ssm.dtype, device=s.ssm.device)
        return type(s)(flat[:nc].view(s.conv.shape), flat[nc:].view(s.ssm.shape)), flat

    # ------------------------------------------------------------------------------------ inputs
    def _load(self, x, initial_state, episode_starts, where):
        B, T, net = self.batch, self.seq_len, self.net
        if x is None:  # zero-copy: the caller wrote x_buf and starts_buf itself
            if episode_starts is not None:
                raise ValueError(f"{where}: with x=None write the starts into trainer.starts_buf, "
                                 f"not episode_starts")
            if initial_state is not None:
                net.check_inputs(self.x_buf, initial_state, None, where=where)
                with torch.no_grad():  # a state with autograd history (net(...)'s) is taken as its values
                    self.state.copy_(initial_state)
            return
        check_tensor(f"{where}: x", x, shape=(B, T, net.input_dim), device=self.device, floating=True)
        if episode_starts is not None:
            check_tensor(f"{where}: episode_starts", episode_starts, shape=(B, T), dtype=torch.bool,
                         device=self.device)
        if initial_state is not None:
            net.check_inputs(x, initial_state, None, where=where)
        self.x_buf.copy_(x)
        if episode_starts is None:
            self.starts_buf.zero_()
        else:
            self.starts_buf.copy_(episode_starts)
        if initial_state is not None:
            with torch.no_grad():  # the carried state never has autograd history (no gradient flows into it)
                self.state.copy_(initial_state)

    def _load_grad(self, d_temporal, extra_grad_sq, where):
        if d_temporal is None:  # zero-copy: the caller wrote d_buf itself
            d_temporal = self.d_buf
        check_tensor(f"{where}: d_temporal", d_temporal, shape=(self.batch, self.seq_len, self.net.cfg.d_model),
                     device=self.device, floating=True)
        if d_temporal is not self.d_buf:
            self.d_buf.copy_(d_temporal)
        if extra_grad_sq is None:
            self.extra_sq_buf.zero_()
        elif isinstance(extra_grad_sq, torch.Tensor):
            # A device scalar is taken as is (checking its value would sync); it must be a float scalar.
            if extra_grad_sq.numel() != 1 or not extra_grad_sq.is_floating_point():
                raise ValueError(f"{where}: extra_grad_sq must be a float scalar tensor, got shape "
                                 f"{list(extra_grad_sq.shape)} dtype {extra_grad_sq.dtype}")
            self.extra_sq_buf.copy_(extra_grad_sq.reshape(()))
        else:
            v = extra_grad_sq
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and v != float("inf")):
                raise ValueError(f"{where}: extra_grad_sq must be a finite number >= 0 (a squared norm), got {v!r}")
            self.extra_sq_buf.fill_(float(v))

    # -------------------------------------------------------------------------------------- bodies
    def _scaled_d(self) -> torch.Tensor:
        """d_buf times the loss scale (f16), or d_buf itself: what the backward starts from."""
        return self.d_buf * self.scaler.scale if self.scaler.enabled else self.d_buf

    def _state_is_own(self) -> bool:
        """Is ``state`` still the trainer's own views of ``_state_flat`` (contiguous float32, not re-bound)?"""
        own, st = self._state_own, self.state
        return own is not None and st.conv is own[0] and st.ssm is own[1]

    def _take_state(self):
        """_state_used <- the carried state (what this forward starts from). One flat copy while ``state`` is
        still the trainer's own views of ``_state_flat``; a ``state`` the caller re-bound is copied from (without
        autograd history: no gradient flows into the carried state)."""
        if self._state_is_own():
            self._state_used_flat.copy_(self._state_flat)  # = self._state_used.copy_(self.state), one launch
        else:
            with torch.no_grad():
                self._state_used.copy_(self.state)

    def _forward_body(self, grad: torch.Tensor | None = None):
        """The forward into ``_feat``; ``grad``: the dL/dfeatures the backward will get (the fused step knows it
        before the forward: ``fused.grad_known``, one launch fewer on CUDA), or None.

        Raises:
            RuntimeError: no parameter of the backbone requires grad (``net.requires_grad_(False)``), before
                anything changes."""
        if not any(p.requires_grad for p in self.net.parameters()):
            raise RuntimeError("MambaTrainer: no parameter of the backbone requires grad (net.requires_grad_(False)?);"
                               " the trainer trains them: call net.requires_grad_(True) first")
        self._take_state()
        st = self.state
        cuda = self.device.type == "cuda"
        # CUDA: the fused forward writes the final states straight into the carried state where it can
        # (fused.final_state_into: two copy launches fewer per step); the copy below then has nothing to do
        into = fused.final_state_into(st.conv, st.ssm) if cuda and self._state_is_own() else contextlib.nullcontext()
        known = fused.grad_known(grad) if cuda and grad is not None else contextlib.nullcontext()
        with _tf32_matmul(self.tf32), into, known:
            feat, final = self.net(self.x_buf, self._state_used, self.starts_buf)
        with torch.no_grad():  # as the direct step: a re-bound state that requires grad is written too
            if final.conv is not st.conv or final.ssm is not st.ssm:
                st.copy_(final.detach())
            if self.skip_nonfinite:
                self._keep_finite_rows()
        self._feat = feat
        return feat

    def _cpu_direct(self) -> bool:
        """Does the fused step run the CPU extension's whole-backbone calls without autograd
        (:meth:`_step_cpu_direct`)? Only where ``net(...)`` would call straight into that node and the autograd
        step would backprop through it into the arena: the cpu backend, float32 Mamba-1
        (:func:`fused.cpu_whole_applies`), the arena's own parameters with none frozen or hooked
        (``net._use_fused``) and the node's output requiring grad (grad mode on, parameters trainable), no
        module hook of the net's or global one and no ``forward`` / ``_forward_fused`` but the class's own, and
        an ``x_buf`` without autograd history. Anything else takes the autograd step, as before.

        Per step this serial Python runs while the OpenMP team waits, after a step has pushed the interpreter's
        data out of the caches (~120 µs there against ~15 µs in a loop), so the checks that read only the
        class, the config and the dtypes (``cpu_whole_applies``, the size check of ``kernel_support``) are
        done again only when their key changes, and the per-parameter ones (``params_are_arena``,
        ``autograd_support``: every parameter the arena's own, requiring grad, without hooks) are one loop."""
        net = self.net
        if self._cpu_kernels is None or not torch.is_grad_enabled() or self.x_buf.requires_grad:
            return False
        cls = type(net)
        if (cls.forward is not MambaBackbone.forward or "forward" in net.__dict__
                or cls._forward_fused is not MambaBackbone._forward_fused or _module_hooks(net)):
            return False
        arena = net.arena
        key = (cls, cls._fused_node, fused.CPU_WHOLE, net.backend, net.compute_dtype, arena.dtype, arena.device)
        if key != self._direct_static:
            if not (net.norm_f.weight.requires_grad and fused.cpu_whole_applies(net)
                    and bool(net._use_fused(None, self.x_buf))):
                return False
            self._direct_static = key
        # = params_are_arena() and autograd_support(...) with norm_f.weight requiring grad (so none frozen), and
        # in the same loop _attach_grads_cpu's check (every .grad still its grad-arena view)
        # (map / attrgetter: the loops run in C, no bytecode per parameter)
        slots = self._slots
        if slots is None or slots[0] is not net._param_slots:
            ps = net._param_slots
            slots = self._slots = (ps, tuple(d for d, _, _ in ps), tuple(n for _, n, _ in ps),
                                   tuple(p for _, _, p in ps))
        _, dicts, names, params = slots
        if (not all(map(is_, map(dict.get, dicts, names), params)) or not all(map(_REQUIRES_GRAD, params))
                or any(map(_GRAD_HOOKS, params)) or any(map(_POST_ACC_HOOKS, params))):
            return False
        seen = self._grad_views
        self._grads_seen = (seen is not None and seen[0] is net.grad_arena
                            and all(map(is_, map(_GRAD, params), seen[2])))
        return True

    def _step_cpu_direct(self):
        """The fused step's forward and backward as the two C++ calls the autograd node makes on the CPU, with
        the same arguments (so the same bits: test), without the node, the engine's pass and the node's hooks
        (~0.6 ms of a 2 x 128 step at 1 thread); then the optimizer as in :meth:`_backward_body`. Like the
        autograd step it ends any pending split ``forward`` (``backward_step`` then asks for a new one). The
        forward writes the final states straight into the carried state (no copy after it)."""
        net = self.net
        self._feat = None
        self._take_state()
        su, st = self._state_used, self.state
        direct = self._state_is_own()  # the forward writes the final states straight into them
        g = self._scaled_d()
        with torch.no_grad():  # the calls make no graph either way; this keeps a re-bound buffer's history out
            if direct:
                _, _, _, saved = fused.cpu_whole_forward(net, self.x_buf, su.conv, su.ssm,
                                                         self.starts_buf.contiguous(), st.conv, st.ssm)
            else:
                _, conv_f, ssm_f, saved = fused.cpu_whole_forward(net, self.x_buf, su.conv, su.ssm,
                                                                  self.starts_buf.contiguous())
                st.conv.copy_(conv_f)
                st.ssm.copy_(ssm_f)
            if self.skip_nonfinite:
                self._keep_finite_rows()
            if not self._grads_seen:  # _cpu_direct found some .grad not its grad-arena view (or never looked)
                self._attach_grads_cpu()
            self._grads_seen = False
            # autograd casts a re-bound d_buf too (no call when it is float32 already)
            fused.cpu_whole_backward(net, saved, g if g.dtype == torch.float32 else g.to(torch.float32))
        self._optimize()

    def _keep_finite_rows(self):
        """Rows of the carried state that came out non-finite (a NaN / inf input, whose step is then skipped)
        keep the state they started from, so one bad batch does not make every later step non-finite too.
        Device ops only (graph-capturable)."""
        parts = ((self.state.conv, self._state_used.conv), (self.state.ssm, self._state_used.ssm))
        bad = None
        for cur, _ in parts:  # [L, B, ...] -> [B]: any non-finite value of the row in any layer
            row_bad = ~torch.isfinite(cur).flatten(2).all(dim=2).all(dim=0)
            bad = row_bad if bad is None else bad | row_bad
        for cur, old in parts:
            cur.copy_(torch.where(bad.view(1, -1, *([1] * (cur.dim() - 2))), old, cur))

    def _backward_body(self, optimizer_step: bool, retain_graph: bool = False):
        self._backprop(retain_graph)
        if optimizer_step:
            self._optimize()

    def _step_body(self):
        """The fused step: forward, backward and optimizer, with dL/dfeatures (d_buf times the loss scale)
        computed first and announced to the forward."""
        g = self._scaled_d()
        self._forward_body(g)
        self._backprop(g=g)
        self._optimize()

    def _backprop(self, retain_graph: bool = False, g: torch.Tensor | None = None):
        """d_buf (times the loss scale; ``g`` when the caller computed it already) back through the last
        forward, into the gradient arena."""
        net = self.net
        g = self._scaled_d() if g is None else g
        if net.device.type == "cpu":
            self._attach_grads_cpu()
        elif not torch.cuda.is_current_stream_capturing():
            net.attach_grads()  # a parent's zero_grad() may have set p.grad = None
        with _tf32_matmul(self.tf32):  # the autograd engine's device thread reads the same global flag
            self._feat.backward(g, retain_graph=retain_graph)

    def _optimize(self):
        """The global clip, AdamW and the scaler over the gradient arena; zeroes the arena."""
        net = self.net
        if self.skip_nonfinite:  # the overflow flag reads the arena: a non-finite or negative extra_grad_sq (a
            # head's; a device scalar is not checked where it is given, that would sync) must skip too:
            # x + sqrt(e) * 0 = x for a finite e >= 0, NaN for e < 0, inf or NaN
            net.grad_arena[:1].add_(self.extra_sq_buf.sqrt() * 0)
        cpu = self._cpu_kernels  # the C++ passes on the cpu backend; None elsewhere (CUDA: unchanged)
        if cpu is not None:
            # what grad_stats / adamw_step(kernels=cpu) call for the trainer's float32 CPU arenas, without their
            # Python (the argument checks there, two reshape views per step: serial time the OpenMP team waits)
            ex = self._extra_sq1  # re-made when the buffer is re-bound or its storage swapped (``.data =``, set_)
            if ex is None or ex[0] is not self.extra_sq_buf or ex[1].data_ptr() != ex[0].data_ptr():
                ex = self._extra_sq1 = (self.extra_sq_buf, self.extra_sq_buf.reshape(1))
            # a float32 buffer's view is cached; any other dtype is cast per step (a cached cast would go stale)
            extra = ex[1] if ex[1].dtype == torch.float32 else ex[1].float()
            scale = self.scaler.scale
            cpu.grad_stats(net.grad_arena, extra, scale if scale.dim() == 1 else scale.reshape(1), self.hyper,
                           self.scalars)
            cpu.adamw_step(net.arena, net.grad_arena, self.exp_avg, self.exp_avg_sq, self.hyper, self.scalars,
                           self.n_decay, net.compute_arena, True)
        else:
            # one cooperative launch on CUDA where the arena fits (ops.optim.optim_step); zero_grad: the kernel
            # zeroes the gradient arena as it reads it (one memset launch fewer)
            optim_step(net.arena, net.grad_arena, self.exp_avg, self.exp_avg_sq, self.extra_sq_buf, self.scaler.scale,
                       self.hyper, self.scalars, self.n_decay, net.compute_arena, zero_grad=True)
        if self.scaler.enabled:
            self.scaler.update(self.scalars[FOUND_INF])
            self.scalars[LOSS_SCALE] = self.scaler.scale[0]

    def _attach_grads_cpu(self):
        """``net.attach_grads()`` only when some ``.grad`` is no longer its grad-arena view (a parent's
        ``zero_grad()`` set it to None, or the arena was re-bound): one identity check per parameter against
        the views attached last (the direct CPU step skips even that when :meth:`_cpu_direct`'s C-level loop saw
        every ``.grad`` attached, ``_grads_seen``)."""
        net, seen = self.net, self._grad_views
        if seen is not None and seen[0] is net.grad_arena and all(p.grad is g for p, g in seen[1]):
            return
        net.attach_grads()
        self._grad_views = (net.grad_arena, [(p, p.grad) for p in net.parameters()],
                            tuple(p.grad for _, _, p in net._param_slots))

    def _metrics(self, replayed: bool) -> StepMetrics:
        s = self.scalars.clone().unbind(0)  # one copy (the metrics never change under later steps), 0-d views
        skipped = s[FOUND_INF] if self.scaler.enabled or self.skip_nonfinite else self._zero
        return StepMetrics(step=s[STEP], grad_norm=s[GRAD_NORM], clip_coef=s[CLIP_COEF], loss_scale=s[LOSS_SCALE],
                           overflow_skipped=skipped, graph_replayed=replayed)

    def _graph_buffers(self):
        n = self.net
        return (n.arena, n.grad_arena, self.exp_avg, self.exp_avg_sq, self.hyper, self.scalars, self.scaler.scale,
                self.x_buf, self.d_buf, self.starts_buf, self.state.conv, self.state.ssm, n.compute_arena)

    def _outside_scope(self) -> bool:
        """Whether the caller's grad mode, inference mode or autocast differ from the scope the trainer runs in."""
        return (not torch.is_grad_enabled() or torch.is_inference_mode_enabled()
                or torch.is_autocast_enabled(self.net.device.type))

    def _own_scope(self) -> contextlib.ExitStack:
        """The scope the trainer's calls run in, whatever the caller's: grad on, inference mode and autocast off."""
        scope = contextlib.ExitStack()
        scope.enter_context(torch.inference_mode(False))
        scope.enter_context(torch.enable_grad())
        scope.enter_context(torch.autocast(self.net.device.type, enabled=False))
        return scope

    # ---------------------------------------------------------------------------------------- API
    @_in_own_scope
    def step(self, x, d_temporal, initial_state: RecurrentState | None = None, episode_starts=None) -> StepMetrics:
        """Fused forward over [B, T], backward with ``d_temporal``, global clip and AdamW.

        Args:
            x: [B, T, input_dim] float on the trainer's device; None when the caller wrote ``x_buf`` and
                ``starts_buf`` in place (zero-copy: the static buffers the graphs read).
            d_temporal: [B, T, d_model] float, dLoss/dfeatures of the caller's loss; None when written
                into ``d_buf`` in place.
            initial_state: the state to start from (its values, copied into ``state``: no gradient flows into
                it, so one with autograd history is fine), or None to continue from the carried state.
            episode_starts: [B, T] bool or None (see :meth:`MambaBackbone.forward`).
        Returns:
            :class:`StepMetrics` (device tensors; no sync). Under ``torch.no_grad()``,
            ``torch.inference_mode()`` (an RL loop's rollout scope) or ``torch.autocast`` it runs as outside
            them: the backward is its own, not the caller's, and the precision its dtype's.
        """
        self._load(x, initial_state, episode_starts, "MambaTrainer.step")
        self._load_grad(d_temporal, None, "MambaTrainer.step")
        if self._cpu_direct():
            self._step_cpu_direct()
            return self._metrics(False)
        if not self._graphs.replay("step"):
            self._step_body()
            self._feat = None
            return self._metrics(False)
        return self._metrics(True)

    @_in_own_scope
    def forward(self, x, initial_state: RecurrentState | None = None, episode_starts=None) -> torch.Tensor:
        """First half of the split step: run the backbone and keep what backward needs.

        Returns:
            features [B, T, d_model] float32, a tensor without autograd history (call
            ``.requires_grad_()`` on it, compute the head loss, backprop, and pass its ``.grad`` to
            :meth:`backward_step`). Under graphs it is a fresh copy of the static output. Under
            ``torch.no_grad()``, ``torch.inference_mode()`` or ``torch.autocast`` it runs as outside them (as
            :meth:`step`).
        """
        self._load(x, initial_state, episode_starts, "MambaTrainer.forward")
        if self._graphs.replay("forward"):
            return self._graph_feat.detach().clone()
        return self._forward_body().detach()

    @_in_own_scope
    def backward_step(self, d_temporal, accumulate: bool = False, extra_grad_sq=None) -> StepMetrics | None:
        """Second half: backprop ``d_temporal`` through the last :meth:`forward`; then, unless
        ``accumulate``, clip one global norm (backbone + ``extra_grad_sq``) and step AdamW.

        Args:
            d_temporal: [B, T, d_model] float.
            accumulate: True adds the gradients to the arena and does not step (gradient accumulation).
            extra_grad_sq: a head's squared gradient norm (0-d tensor or float, >= 0), added to the global norm.
                A float is checked here; a tensor's value is not (that would sync): a negative or non-finite one
                skips the step under ``skip_nonfinite`` and otherwise makes the norm, and so the weights, NaN.
        Returns:
            :class:`StepMetrics` after an optimizer step, None when accumulating.
        Raises:
            RuntimeError: when no :meth:`forward` preceded this call.
        """
        if self._feat is None and "forward" not in self._graphs:
            raise RuntimeError("MambaTrainer.backward_step: call forward() first")
        self._load_grad(d_temporal, extra_grad_sq, "MambaTrainer.backward_step")
        name = "accumulate" if accumulate else "backward_step"
        if self._graphs.replay(name):
            return None if accumulate else self._metrics(True)
        if self._feat is None:
            raise RuntimeError("MambaTrainer.backward_step: call forward() first")
        self._backward_body(not accumulate)
        self._feat = None
        return None if accumulate else self._metrics(False)

    # ------------------------------------------------------------------ hooks for a caller's bigger graph
    def forward_body(self) -> torch.Tensor:
        """The forward of :meth:`forward` without input copies or graphs, for a caller that captures a bigger
        graph (e.g. a whole PPO minibatch): reads ``x_buf``, ``starts_buf`` and the carried ``state`` (write
        them in place first), writes the final state into ``state``, and returns the features
        [B, T, d_model] float32 with autograd history (backprop through them with :meth:`backward_body`)."""
        return self._forward_body()

    def backward_body(self) -> None:
        """The backward of :meth:`backward_step` without input copies or graphs: backprop ``d_buf`` (times
        the loss scale) through the last :meth:`forward_body`, clip one global norm (backbone plus
        ``extra_sq_buf``, a head's squared gradient norm), AdamW, the f16 scaler update; zeroes the gradient
        arena. No host sync; graph-capturable. The step's scalars (clip_coef, found_inf, ...) are in
        ``scalars`` (layout in :mod:`mamba_rl.ops.optim`)."""
        self.backprop_body()
        self._optimize()

    def backprop_body(self) -> None:
        """The first half of :meth:`backward_body`: backprop ``d_buf`` (times the loss scale) through the last
        :meth:`forward_body` into the gradient arena, nothing else. With :meth:`optimizer_body` after it, a
        caller can run work between the two outside a graph (e.g. a data-parallel all-reduce of the arena
        between two captured graphs). Graph-capturable.

        Raises:
            RuntimeError: no :meth:`forward_body` since the last backprop.
        """
        if self._feat is None:
            raise RuntimeError("MambaTrainer.backprop_body: call forward_body() first")
        self._backprop()
        self._feat = None

    def optimizer_body(self) -> None:
        """The second half of :meth:`backward_body`: the global clip (backbone arena
        plus ``extra_sq_buf``), AdamW, the f16 scaler update, and the gradient arena zeroed. No host sync;
        graph-capturable."""
        self._optimize()

    def graph_buffers(self) -> tuple:
        """Every tensor a captured forward/backward body reads or writes (for a caller's pointer guard)."""
        return self._graph_buffers()

    def snapshot(self) -> list:
        """Copies of every buffer a training step changes (restore with :meth:`restore`): lets a caller
        warm up and capture a graph without changing the trainer."""
        return self._snapshot()

    def restore(self, snap: list) -> None:
        """Write back a :meth:`snapshot` in place (buffers keep their addresses)."""
        restore(snap)

    def set_lr(self, lr: float):
        """Set AdamW's learning rate (a device write: captured graphs pick it up without recapture)."""
        if isinstance(lr, bool) or not (isinstance(lr, (int, float)) and lr >= 0 and lr == lr and lr != float("inf")):
            raise ValueError(f"MambaTrainer.set_lr: lr must be a finite number >= 0, got {lr!r}")
        self.lr = float(lr)
        self.hyper[0] = self.lr

    def reset_state(self, mask: torch.Tensor | None = None):
        """Zero the carried state: all rows, or the rows where ``mask`` ([B] bool) is True."""
        self.state.zero_(mask)

    # ------------------------------------------------------------------------------------- graphs
    def capture_graph(self, warmup: int = 3):
        """Capture the fused step, ``forward``, ``backward_step`` (and its accumulate variant) as CUDA graphs.

        Warm-up iterations run on a side stream, then every buffer (weights, moments, step counter,
        scaler, state) is restored, so capturing changes nothing. Later calls copy their inputs into the
        static buffers and replay. lr changes need no recapture.

        Raises:
            RuntimeError: when the trainer is not on a CUDA device.
        """
        if self.device.type != "cuda":
            raise RuntimeError(f"MambaTrainer.capture_graph needs a CUDA device, the trainer is on {self.device}")

        def warm() -> None:
            self._step_body()
            self._feat = None  # the warm-up's activations are not needed by any graph

        # The fused step gets its own pool (it may run between forward and backward_step); forward and
        # the two backward graphs share one.
        pool = torch.cuda.graph_pool_handle()
        capture_restoring(self._graphs, {
            "step": self._step_body,
            "forward": self._forward_body,
            "backward_step": lambda: self._backward_body(True, retain_graph=True),
            "accumulate": lambda: self._backward_body(False, retain_graph=True),
        }, self._snapshot(), warmup, warmup_body=warm,
            pools={"forward": pool, "backward_step": pool, "accumulate": pool})
        # Both backward graphs read the activations that the forward graph saved; keep them alive.
        self._graph_feat = self._feat
        self._feat = None
        return self

    def _snapshot(self):
        n = self.net
        return snapshot((n.arena, n.grad_arena, self.exp_avg, self.exp_avg_sq, self.scalars, self.scaler.scale,
                         self.scaler.growth_tracker, self.state.conv, self.state.ssm, n.compute_arena))

    # ----------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Everything needed to resume bit-identically: tensors (master weights, AdamW moments, carried
        state) and plain metadata (config, step, optimizer hyperparameters, scaler).

        Returns:
            ``{"tensors": {...}, "meta": {...}}``. Tensors (CPU copies, float32): ``master``, ``exp_avg``,
            ``exp_avg_sq`` [P] (P = the arena's size), ``state_conv`` / ``state_ssm`` [L, B, ...] (the carried
            state). Meta (JSON-able): ``config``, ``input_dim``, ``batch``, ``seq_len``, ``dtype``, ``step``,
            ``bias_correction1``, ``bias_correction2``, ``lr``, ``betas``, ``eps``, ``weight_decay``,
            ``no_decay``, ``max_grad_norm``, ``scaler``. :meth:`load_state_dict` applies the optimizer
            hyperparameters and requires the same dtype / no_decay (see there).
        """
        s = self.scalars.detach().cpu()
        return {
            "tensors": {"master": self.net.arena.detach().cpu().clone(),
                        "exp_avg": self.exp_avg.detach().cpu().clone(),
                        "exp_avg_sq": self.exp_avg_sq.detach().cpu().clone(),
                        "state_conv": self.state.conv.detach().cpu().clone(),
                        "state_ssm": self.state.ssm.detach().cpu().clone()},
            "meta": {"config": self.net.cfg.to_dict(), "input_dim": self.net.input_dim,
                     "batch": self.batch, "seq_len": self.seq_len, "dtype": self.dtype,
                     "step": int(s[STEP]), "bias_correction1": float(s[BC1]), "bias_correction2": float(s[BC2]),
                     "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                     "weight_decay": self.weight_decay, "no_decay": self.no_decay,
                     "max_grad_norm": self.max_grad_norm, "scaler": self.scaler.state_dict()},
        }

    def load_state_dict(self, sd: dict, settings: str = "checkpoint"):
        """Load :meth:`state_dict` output in place (buffers keep their addresses: captured graphs stay valid
        and pick up the loaded hyperparameters, which live in the device buffer ``hyper``).

        Every field is validated before anything is written
        (:func:`~mamba_rl.train.checkpoint.validate_trainer_state`), so a refused state dict leaves the
        trainer bit-identical.

        Args:
            sd: ``{"meta": dict, "tensors": dict}`` as :meth:`state_dict` returns it (tensors on any device).
            settings: "checkpoint" (default): lr, betas, eps, weight_decay and max_grad_norm are taken from
                ``sd`` (torch.optim semantics: the run resumes bit-identically whatever this trainer was built
                with; a field ``sd`` lacks keeps this trainer's value), and a ``dtype`` or ``no_decay`` that
                differs from this trainer's is refused (both are fixed when a trainer is built: the compute
                copy, the loss scaler, the decayed range). "trainer": this trainer keeps all of its settings,
                lr included, and may differ in dtype / no_decay (an f16 trainer loading a checkpoint without a
                loss scaler starts its scale from 2**16). Either way a stored ``batch`` / ``seq_len`` may differ:
                the weights, moments, step and scaler load, and the carried state only when the batch matches.
        Raises:
            ValueError: ``settings`` is not "checkpoint" or "trainer"; the config, input_dim, a tensor's shape or
                dtype differs.
            CheckpointError (a ValueError): a field of the wrong type or out of its range, a dtype / no_decay
                mismatch (``settings="checkpoint"``), non-finite weights / moments / carried state or a
                negative ``exp_avg_sq``. Nothing is changed then.
        """
        plan = validate_trainer_state(self, sd, settings)  # everything is checked before anything is written
        tens = sd["tensors"]
        with torch.no_grad():
            for k, t in (("master", self.net.arena), ("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                t.copy_(tens[k])
            if plan.load_state:
                self.state.conv.copy_(tens["state_conv"])
                self.state.ssm.copy_(tens["state_ssm"])
            self.net.refresh_compute()
            self.scalars[STEP] = float(plan.step)
            self.scalars[BC1] = float(plan.bias_correction1)
            self.scalars[BC2] = float(plan.bias_correction2)
            self.scaler.load_state_dict(plan.scaler)
            self.scalars[LOSS_SCALE] = self.scaler.scale[0]
            # the stored AdamW settings (those the plan carries), into the attributes and, through make_hyper's
            # one layout, the device buffer the optimizer (and any captured graph) reads
            if plan.betas is not None:
                self.betas = plan.betas
            if plan.eps is not None:
                self.eps = plan.eps
            if plan.weight_decay is not None:
                self.weight_decay = plan.weight_decay
            if plan.max_grad_norm is not None:
                self.max_grad_norm = None if plan.max_grad_norm == float("inf") else plan.max_grad_norm
            fresh = make_hyper(self.lr, self.betas, self.eps, self.weight_decay, self.max_grad_norm, False,
                               self.hyper.device)
            self.hyper[1:6].copy_(fresh[1:6])  # lr (0) is set_lr's below, the skip flag (6) the trainer's own
        if plan.lr is not None:
            self.set_lr(plan.lr)
