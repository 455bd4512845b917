"""CUDA graphs of fixed-shape work, with the pointer guard that the trainer and the stepper share.

A captured graph replays kernels on the exact buffers it saw at capture. :class:`GraphSet` captures named
bodies after a warm-up on a side stream, records the data pointers of the buffers the owner lists, and
refuses to replay once any of them moved (a ``.to()``, a replaced arena, a rebound state): replaying then
would read freed memory, so it raises instead (docs/architecture.md, "CUDA graphs").
"""
from __future__ import annotations

import gc
import operator
from typing import Callable, Iterable, Mapping

import torch

__all__ = ["GraphSet", "warm_up", "snapshot", "restore", "capture_restoring"]


def warm_up(body: Callable[[], object], iterations: int) -> None:
    """Run ``body`` ``iterations`` times on a side stream (what torch.cuda.graph asks before a capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iterations):
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def snapshot(tensors: Iterable[torch.Tensor | None]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(tensor, copy)`` pairs of every tensor given (None skipped), for :func:`restore`."""
    return [(t, t.detach().clone()) for t in tensors if t is not None]


def restore(saved: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write every copy of a :func:`snapshot` back into its tensor, in place (addresses unchanged)."""
    with torch.no_grad():
        for t, v in saved:
            t.copy_(v)


def capture_restoring(graphs: "GraphSet", bodies: Mapping[str, Callable[[], object]],
                      saved: list[tuple[torch.Tensor, torch.Tensor]], warmup: int,
                      warmup_body: Callable[[], object] | None = None, mode: str = "global",
                      pools: Mapping[str, object] | None = None) -> dict[str, object]:
    """Warm up, capture and restore: the routine of a graph owner whose bodies change its buffers.

    Synchronises; runs ``warmup_body`` (default: every body in order) ``warmup`` times on a side stream
    (:func:`warm_up`); restores ``saved``; captures each body as graph ``name`` of ``graphs``, in order
    (``mode``: see :meth:`GraphSet.capture`; ``pools[name]``, when given, is the memory pool of that graph,
    e.g. one ``torch.cuda.graph_pool_handle()`` shared by graphs that never run concurrently; the others get
    private pools); synchronises; restores ``saved`` again (capturing runs nothing, but this is exact about
    every buffer) and seals ``graphs``. So the buffers listed in ``saved`` (a :func:`snapshot`) hold after
    the call what they held before it.

    Returns:
        {name: what the body returned during capture} (the graphs' static outputs).

    Raises:
        RuntimeError: from torch when a body cannot be captured (the graphs are cleared then).
    """
    if warmup_body is None:
        def warmup_body() -> None:
            for body in bodies.values():
                body()
    torch.cuda.synchronize()
    warm_up(warmup_body, warmup)
    restore(saved)
    graphs.clear()
    pools = pools or {}
    outputs = {}
    try:
        for name, body in bodies.items():
            outputs[name] = graphs.capture(name, body, pool=pools.get(name), mode=mode)
    except BaseException:
        graphs.clear()
        raise
    torch.cuda.synchronize()
    restore(saved)
    graphs.seal()
    return outputs


class GraphSet:
    """Named CUDA graphs of one owner, guarded by the data pointers of the owner's buffers.

    Args:
        owner: the name used in error messages (e.g. "MambaTrainer").
        buffers: callable returning the tensors (or None) whose storage the graphs read or write.
        launcher: for an owner whose graphs draw no random numbers, a callable returning the CUDA extension's
            ``graph_launcher`` (or None where there is none, e.g. another backend). :meth:`seal` then binds each
            graph to a C++ ``GraphLauncher`` and :meth:`replay` launches it from there: ``cudaGraphLaunch`` on the
            current stream with the captured buffers' data pointers checked in C++ and the Python side checking
            only that the owner's buffers are the same objects. That skips torch's ``CUDAGraph.replay`` wrapper
            and the Python pointer list, ~1-2 µs of host time a replay (benchmarks/NOTES.md, thirty-first
            session), which is on the critical path of a one-token step. Not for graphs that draw random
            numbers: torch's replay advances their philox offsets, this launch does not.
    """

    def __init__(self, owner: str, buffers: Callable[[], tuple], launcher: Callable[[], object] | None = None):
        self.owner = owner
        self._buffers = buffers
        self._graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self._ptrs: list | None = None
        self._launcher = launcher
        self._launch: dict[str, object] = {}  # name -> the extension's GraphLauncher (see launcher)
        self._objs: tuple = ()  # the buffer objects at seal (the launch path's identity check)
        self._device: int | None = None

    def _pointers(self) -> list:
        # a list comprehension: ~0.5 us less per check than a generator into tuple() (the acting path runs it)
        return [None if b is None else b.data_ptr() for b in self._buffers()]

    def capture(self, name: str, body: Callable[[], object], pool=None, mode: str = "global"):
        """Capture ``body`` as graph ``name`` (in memory pool ``pool`` when given) and return its result
        (the graph's static outputs). ``mode``: torch.cuda.graph's ``capture_error_mode`` ("thread_local"
        lets other threads, e.g. NCCL's watchdog, query events meanwhile). Call :meth:`seal` once every
        graph is captured.

        Python's cyclic garbage collector is run before the capture and kept off during it: a collection inside
        the body could destroy a dead owner's CUDA graphs, events or memory pool mid-capture, CUDA calls that
        may invalidate a global-mode capture ("operation failed due to a previous error during capture"; the
        intermittent failures of benchmarks/NOTES.md), and torch.cuda.graph no longer collects by itself."""
        g = torch.cuda.CUDAGraph()
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(g, pool=pool, capture_error_mode=mode):
                out = body()
        finally:
            if was_enabled:
                gc.enable()
        self._graphs[name] = g
        return out

    def seal(self) -> None:
        """Record the buffer pointers the graphs were captured on (and bind the C++ launchers, see ``launcher``).

        Raises:
            whatever binding a launcher raises; the graphs are dropped then (nothing replays half-sealed)."""
        self._ptrs = self._pointers()
        self._device = torch.cuda.current_device() if self._graphs else None  # where capture() captured them
        try:
            self._bind()
        except BaseException:
            self.clear()
            raise

    def _bind(self) -> None:
        # the launchers hold the owner's buffer objects of now (their pointers are the captured ones); without a
        # launcher nothing is held (the pointer guard keeps integers only)
        self._launch, self._objs = {}, ()
        factory = self._launcher() if self._launcher is not None else None
        if factory is None or not self._graphs:
            return
        objs = tuple(self._buffers())
        launch = {}
        for name, g in self._graphs.items():
            exec_handle = getattr(g, "raw_cuda_graph_exec", None)  # torch >= 2.8
            if exec_handle is None:
                return
            launch[name] = factory(g, exec_handle(), self._device, list(objs))
        self._launch, self._objs = launch, objs

    def _same_objects(self) -> bool:
        cur = self._buffers()
        return len(cur) == len(self._objs) and all(map(operator.is_, cur, self._objs))

    def __contains__(self, name: str) -> bool:
        return name in self._graphs

    def __getitem__(self, name: str) -> torch.cuda.CUDAGraph:
        """The raw graph ``name`` (for profiling: its ``replay`` skips the pointer guard)."""
        return self._graphs[name]

    def __bool__(self) -> bool:
        return bool(self._graphs)

    def check(self) -> None:
        """Raise RuntimeError when a captured buffer has moved since :meth:`seal`."""
        if self._launch and self._same_objects():
            # the same objects: only an in-place storage swap can have moved one, which the C++ side sees
            next(iter(self._launch.values())).check()
            return
        if self._ptrs != self._pointers():
            raise RuntimeError(f"{self.owner}: a buffer captured by the CUDA graph has moved (the backbone was "
                               f"moved, its arena or compute copy replaced, or a state rebound after "
                               f"capture_graph); call capture_graph() again")
        if self._launch:  # new objects over the captured storage: the launchers hold (and check) these now
            self._bind()

    def replay(self, name: str, check: bool = True) -> bool:
        """Replay graph ``name``; False when there is none (the caller runs eagerly). ``check=False`` skips
        the pointer guard, for a caller that just ran :meth:`check` itself.

        Raises:
            RuntimeError: a captured buffer moved (see :meth:`check`).
        """
        g = self._graphs.get(name)
        if g is None:
            return False
        fast = self._launch.get(name)
        if fast is None:
            if check:
                self.check()
            g.replay()
            return True
        if check and not self._same_objects():
            self.check()  # a buffer rebound: fine only where it is a new object over the captured storage
            fast = self._launch.get(name)
            if fast is None:  # the re-bind found no launcher: torch's replay (the guard just ran)
                g.replay()
                return True
        fast.launch()  # RuntimeError where a captured buffer's storage was replaced in place
        return True

    def clear(self) -> None:
        """Drop every graph (and the recorded pointers)."""
        self._graphs.clear()
        self._launch = {}
        self._objs = ()
        self._ptrs = None
