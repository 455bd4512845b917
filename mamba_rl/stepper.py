"""Stepper: the one-token inference engine used for acting in envs.

T calls of :meth:`Stepper.step` equal one :meth:`MambaBackbone.forward` over T steps (same features, same
final state) for any reset pattern (ARCHITECTURE.md section 3). The stepper reads the backbone's weights in
place (its compute copy under bf16/f16 training), so optimizer updates are seen at the next step.
"""
from __future__ import annotations

import torch

from .ops._dispatch import check_tensor
from .state import RecurrentState

__all__ = ["Stepper"]


class Stepper:
    """Acting engine for ``batch`` envs over a :class:`~mamba_rl.MambaBackbone`.

    Attributes:
        state: the live :class:`RecurrentState` (float32 buffers owned by the stepper; a captured graph
            reads and writes these exact buffers, so use :meth:`load_state` / :meth:`reset`, never rebind).
    """

    def __init__(self, net, batch: int):
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"Stepper: batch must be an int >= 1, got {batch!r}")
        self.net = net
        self.batch = batch
        self.state = net.initial_state(batch)
        self._graph = None
        self.x_buf = None
        self.starts_buf = None
        self._out = None
        self._graph_ptrs = None

    @property
    def device(self) -> torch.device:
        return self.net.device

    def _step_impl(self, x: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
        net = self.net
        if net.backend == "cuda":
            from .ops.step import backbone_step
            return backbone_step(x, net.step_weights(), self.state.conv, self.state.ssm, starts, net.cfg)
        y, final = net(x.unsqueeze(1), self.state, None if starts is None else starts.unsqueeze(1))
        self.state.copy_(final)
        return y[:, 0]

    @torch.no_grad()
    def step(self, x_t: torch.Tensor | None, episode_starts: torch.Tensor | None = None) -> torch.Tensor:
        """Advance every env by one observation.

        Args:
            x_t: [B, input_dim] float (cast to the master dtype), on the backbone's device; or None after
                :meth:`capture_graph` when the caller wrote ``x_buf`` and ``starts_buf`` in place (zero-copy:
                the replay then reads them as they are).
            episode_starts: [B] bool or None. Rows with True are reset (zero conv window and SSM state)
                before x_t is consumed: x_t is the first observation of a new episode.
        Returns:
            features [B, d_model] in the master dtype. Under a captured graph this is the graph's static
            output buffer, overwritten by the next step: clone it to keep it.
        Raises:
            ValueError: wrong shape, dtype or device.
        """
        B, D = self.batch, self.net.input_dim
        if x_t is None:
            if self._graph is None or episode_starts is not None:
                raise ValueError("Stepper.step: x_t=None (zero-copy) needs capture_graph() first, and the starts "
                                 "written into starts_buf rather than passed")
            self._check_graph()
            self._graph.replay()
            return self._out
        check_tensor("Stepper.step: x_t", x_t, shape=(B, D), device=self.device, floating=True)
        if episode_starts is not None:
            check_tensor("Stepper.step: episode_starts", episode_starts, shape=(B,), dtype=torch.bool,
                         device=self.device)
        x_t = x_t.to(self.net.arena.dtype)
        if self.state.ssm.dtype != self.net.arena.dtype and self._graph is None:  # the net changed dtype
            self.state = self.state.to(self.net.arena.dtype)
        if self._graph is not None:
            self._check_graph()
            self.x_buf.copy_(x_t)
            if episode_starts is None:
                self.starts_buf.zero_()
            else:
                self.starts_buf.copy_(episode_starts)
            self._graph.replay()
            return self._out
        return self._step_impl(x_t, episode_starts)

    def _check_graph(self):
        if self._pointers() != self._graph_ptrs:
            raise RuntimeError("Stepper: a buffer captured by the CUDA graph has moved (the backbone was moved, "
                               "its arena or compute copy replaced, or the state rebound after capture_graph); "
                               "call capture_graph() again")

    def _pointers(self):
        n = self.net
        bufs = (n.arena, n.compute_arena, self.state.conv, self.state.ssm)
        return tuple(None if b is None else b.data_ptr() for b in bufs)

    def reset(self, mask: torch.Tensor | None = None):
        """Zero the state of every env, or of the envs where ``mask`` ([B] bool) is True."""
        self.state.zero_(mask)

    def get_state(self) -> RecurrentState:
        """A detached copy of the live state."""
        return self.state.clone()

    def load_state(self, state: RecurrentState):
        """Copy ``state`` into the live buffers (shapes must match)."""
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
        saved = self.state.clone()
        B = self.batch
        self.x_buf = torch.randn(B, self.net.input_dim, device=self.device, dtype=self.net.arena.dtype)
        self.starts_buf = torch.zeros(B, dtype=torch.bool, device=self.device)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(s):
            for _ in range(warmup):
                self._step_impl(self.x_buf, self.starts_buf)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            self._out = self._step_impl(self.x_buf, self.starts_buf)
        self._graph = g
        self._graph_ptrs = self._pointers()
        self.state.copy_(saved)
        return self
