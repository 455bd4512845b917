"""Stepper: the one-token inference engine used for acting in envs.

T calls of :meth:`Stepper.step` equal one :meth:`MambaBackbone.forward` over T steps (same features, same
final state) for any reset pattern (docs/architecture.md, "Reset semantics"). The stepper reads the
backbone's weights in place (its compute copy under bf16/f16 training), so optimizer updates are seen at
the next step.
"""
from __future__ import annotations

import torch

from ..graphs import GraphSet, capture_restoring, snapshot
from ..ops.checks import check_tensor
from .state import RecurrentState

__all__ = ["Stepper"]


class Stepper:
    """Acting engine for ``batch`` envs over a :class:`~mamba_rl.MambaBackbone` (``net.step`` per token).

    Attributes:
        state: the live :class:`RecurrentState` (master-dtype buffers owned by the stepper; a captured graph
            reads and writes these exact buffers, so use :meth:`load_state` / :meth:`reset`, never rebind).
        x_buf, starts_buf: after :meth:`capture_graph`, the static inputs [B, input_dim] / [B] bool that a
            zero-copy ``step(None)`` replays from.

    Raises:
        ValueError: ``batch`` is not an int >= 1.
    """

    def __init__(self, net, batch: int):
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"Stepper: batch must be an int >= 1, got {batch!r}")
        self.net = net
        self.batch = batch
        # The stepper's own buffers are normal tensors even when it is built under torch.inference_mode():
        # reset / load_state write them in place, which torch refuses on inference tensors outside that mode.
        with torch.inference_mode(False):
            self.state = net.initial_state(batch)
        self.x_buf = None
        self.starts_buf = None
        self._starts_zero = False  # starts_buf is known to be all False (skip re-zeroing it)
        self._out = None
        self._fast = None  # after capture_graph: the extension's PreparedStep (step(x)'s direct launch)
        self._cpu_prep = None  # (packed weights, conv, ssm, PreparedStep): the CPU kernel step bound once
        self._cpu_kind = None  # a Mamba-1 backbone on the cpu backend (the bound step applies); set at first use
        # the static input buffers too: the graph reads them where they were at capture
        # The step draws no random numbers, so its graph is launched from C++ on the CUDA backend (GraphSet's
        # launcher: less host time on the acting path's critical path).
        self._graphs = GraphSet("Stepper", lambda: (net.arena, net.compute_arena, self.state.conv, self.state.ssm,
                                                    self.x_buf, self.starts_buf),
                                launcher=lambda: getattr(net.kernels, "graph_launcher", None)
                                if net.backend == "cuda" else None)

    @property
    def device(self) -> torch.device:
        return self.net.device

    def step(self, x_t: torch.Tensor | None, episode_starts: torch.Tensor | None = None) -> torch.Tensor:
        """Advance every env by one observation.

        Args:
            x_t: [B, input_dim] float (cast to the master dtype), on the backbone's device; or None after
                :meth:`capture_graph` when the caller wrote ``x_buf`` and ``starts_buf`` in place (zero-copy:
                the replay then reads them as they are). After :meth:`capture_graph` on the CUDA kernel step, a
                float32 contiguous x_t (and a contiguous bool episode_starts) is read where it lies: the
                captured kernel is launched on it directly (bit-identical to the replay, no input copy).
            episode_starts: [B] bool or None. Rows with True are reset (zero conv window and SSM state)
                before x_t is consumed: x_t is the first observation of a new episode.
        Returns:
            features [B, d_model] in the master dtype. Under a captured graph this is the graph's static
            output buffer, overwritten by the next step: clone it to keep it.
        Raises:
            ValueError: wrong shape, dtype or device.
            RuntimeError: a graph-captured buffer moved since :meth:`capture_graph`.
        """
        if x_t is None:
            if not self._graphs or episode_starts is not None:
                raise ValueError("Stepper.step: x_t=None (zero-copy) needs capture_graph() first, and the starts "
                                 "written into starts_buf rather than passed")
            self._starts_zero = False  # the caller may have written starts_buf
            # the graph's replay: on the static buffers it costs less host time than the direct launch
            # (benchmarks/NOTES.md, nineteenth session)
            self._graphs.replay("step")
            return self._out
        fast = self._fast
        if fast is not None and isinstance(x_t, torch.Tensor) and (
                episode_starts is None or isinstance(episode_starts, torch.Tensor)):
            # The captured graph's one kernel, launched on x_t and episode_starts where they lie (no input copy,
            # no per-weight checks: PreparedStep checked and bound those at capture, and the pointer guard says
            # they did not move). launch() returns False, launching nothing, for anything it does not take (a
            # float64 x_t, a wrong shape or device): the checked path below then casts or raises.
            self._graphs.check()
            if fast.launch(x_t, episode_starts, self._out):
                return self._out
        if fast is None and self.device.type == "cpu" and isinstance(x_t, torch.Tensor) and (
                episode_starts is None or isinstance(episode_starts, torch.Tensor)):
            # The CPU kernel step bound once to the weights and states (_cpu_prepared): x_t and episode_starts
            # that fit it (float32, contiguous, the right shapes) run without the per-call checks of the
            # weights; anything else gets None and the checked path below casts or raises.
            prep = self._cpu_prepared()
            if prep is not None:
                out = prep.launch(x_t, episode_starts)
                if out is not None:
                    return out
        return self._step_checked(x_t, episode_starts)

    @torch.no_grad()
    def _step_checked(self, x_t: torch.Tensor, episode_starts: torch.Tensor | None) -> torch.Tensor:
        """:meth:`step` on the checked path: the inputs checked and cast, then the graph's replay on the static
        buffers or the backbone's step, under no_grad (the paths above it run no torch op autograd could record,
        and skip no_grad's ~1.5-5 µs of host time a call: on the one-token step's critical path)."""
        B, D = self.batch, self.net.input_dim
        check_tensor("Stepper.step: x_t", x_t, shape=(B, D), device=self.device, floating=True)
        if episode_starts is not None:
            check_tensor("Stepper.step: episode_starts", episode_starts, shape=(B,), dtype=torch.bool,
                         device=self.device)
        x_t = x_t.to(self.net.arena.dtype)
        if self._graphs:
            self._graphs.check()
            self.x_buf.copy_(x_t)
            if episode_starts is None:
                if not self._starts_zero:
                    self.starts_buf.zero_()
                    self._starts_zero = True
            else:
                self.starts_buf.copy_(episode_starts)
                self._starts_zero = False
            self._graphs.replay("step", check=False)
            return self._out
        self._follow_net_dtype()
        return self.net.step(x_t, self.state, episode_starts)

    def _follow_net_dtype(self):
        """The live state in the backbone's master dtype, after ``net.double()`` / ``net.float()``."""
        if self.state.ssm.dtype != self.net.arena.dtype:
            with torch.inference_mode(False):  # normal tensors, as in __init__
                self.state = self.state.to(self.net.arena.dtype)

    def _cpu_prepared(self):
        """The CPU extension's PreparedStep bound to the live state and the backbone's current packed weights
        (re-bound when either was replaced), or None where :meth:`MambaBackbone.step` would not run that one
        kernel call: another backend or a subclass's own step (Mamba-3), a float64 state or arena, swapped-in
        parameters (``torch.func.functional_call``), a configuration the kernel does not take."""
        net = self.net
        if self._cpu_kind is None:  # the backend and the backbone's class are fixed for its life
            from .backbone import MambaBackbone  # backbone imports this module
            self._cpu_kind = net.backend == "cpu" and type(net).step is MambaBackbone.step
        if (not self._cpu_kind or not net.params_are_arena() or self.state.ssm.dtype != torch.float32
                or net.arena.dtype != torch.float32):
            return None
        packed = net._packed_step_weights()
        c = self._cpu_prep
        if c is not None and c[0] is packed and c[1] is self.state.conv and c[2] is self.state.ssm:
            return c[3]
        ext = net.kernels
        if not net.kernel_support("step") or not hasattr(ext, "backbone_step_prepare"):
            return None
        x = torch.zeros(self.batch, net.input_dim)
        prep = ext.backbone_step_prepare(x, *packed[:3], packed[3], self.state.conv, self.state.ssm,
                                         float(net.cfg.rms_norm_eps), 0)
        self._cpu_prep = (packed, self.state.conv, self.state.ssm, prep)
        return prep

    def reset(self, mask: torch.Tensor | None = None):
        """Zero the state of every env, or of the envs where ``mask`` ([B] bool) is True."""
        self.state.zero_(mask)

    def get_state(self) -> RecurrentState:
        """A detached copy of the live state."""
        return self.state.clone()

    def load_state(self, state: RecurrentState):
        """Copy ``state`` into the live buffers (shapes must match); a state that requires grad is copied as
        values (the live buffers stay leaves without a graph: the kernels write them in place). No no_grad scope
        otherwise: the agent's acting path calls this every step, and entering one costs host time."""
        if isinstance(state, RecurrentState):  # (anything else: copy_ below raises the ValueError naming it)
            if state.ssm.dtype != self.state.ssm.dtype:
                self._follow_net_dtype()  # a float64 state after net.double() is not rounded to float32 buffers
            if state.conv.requires_grad or state.ssm.requires_grad:
                with torch.no_grad():
                    self.state.copy_(state)
                return
        self.state.copy_(state)

    def capture_graph(self, warmup: int = 3):
        """Capture one step as a CUDA graph; later :meth:`step` calls replay it.

        The graph reads static input buffers, the live state and the backbone's (compute) weights in
        place, so weight updates and :meth:`reset` / :meth:`load_state` need no recapture. Warm-up steps
        run on a copy of the state, which is restored afterwards.

        Raises:
            RuntimeError: when the backbone is not on a CUDA device.
        """
        if self.device.type != "cuda":
            raise RuntimeError(f"Stepper.capture_graph needs a CUDA device, the backbone is on {self.device}")
        self._fast = None
        B = self.batch
        # Normal tensors (as the state, __init__), the graph's output among them, also when captured under
        # torch.inference_mode(): step() returns that buffer, and a caller outside the mode may use it in autograd.
        with torch.inference_mode(False):
            self.x_buf = torch.randn(B, self.net.input_dim, device=self.device, dtype=self.net.arena.dtype)
            self.starts_buf = torch.zeros(B, dtype=torch.bool, device=self.device)
            self._starts_zero = True

            def body():
                with torch.no_grad():
                    return self.net.step(self.x_buf, self.state, self.starts_buf)

            self._out = capture_restoring(self._graphs, {"step": body},
                                          snapshot((self.state.conv, self.state.ssm)), warmup)["step"]
        self._fast = self._prepare_fast()
        return self

    def _prepare_fast(self):
        """The extension's PreparedStep for the public :meth:`step` (the kernel the graph holds, bound to the
        same weights, states and launch configuration), or None where the graph body is not that one kernel
        (the torch-op step, an extension without it)."""
        net = self.net
        ext = net.kernels
        from .backbone import MambaBackbone  # backbone imports this module
        # MambaBackbone.step's kernel branch, exactly (a subclass with its own step, e.g. Mamba-3, is not it)
        if (type(net).step is not MambaBackbone.step or net.backend != "cuda"
                or self.state.ssm.dtype != torch.float32 or not net.kernel_support("step")
                or not hasattr(ext, "backbone_step_prepare")):
            return None
        inp_w, inp_b, normf, layers = net._packed_step_weights()
        return ext.backbone_step_prepare(self.x_buf, inp_w, inp_b, normf, layers, self.state.conv, self.state.ssm,
                                         float(net.cfg.rms_norm_eps), 0)
