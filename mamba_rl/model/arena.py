"""ArenaModule: an ``nn.Module`` whose parameters are views into one flat master tensor (the arena).

Every ``nn.Parameter`` is a view into one contiguous float32 (or float64) tensor and every ``.grad`` a
view into one flat gradient arena, so an optimizer step is one pass over one tensor and a checkpoint is
one tensor. The arena is laid out decay group first, so one boundary index (``n_decay``) gives per-tensor
weight decay. Under bf16/f16 training a low-precision *compute copy* of the arena is kept; the GEMMs read
it through :class:`UseCompute`, whose backward sends the gradient to the float32 master.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn

__all__ = ["ArenaModule", "UseCompute", "arena_key", "cache_hit"]


def arena_key(*arenas: torch.Tensor | None) -> tuple:
    """The key of views cached over flat arenas: per arena (the tensor, its data pointer), or None. Compare two
    with :func:`cache_hit`, not ``==``."""
    return tuple(None if a is None else (a, a.data_ptr()) for a in arenas)


def cache_hit(cached: tuple, key: tuple) -> bool:
    """Whether views built under ``cached`` (:func:`arena_key` then) serve the arenas of ``key``: each arena at
    the address it had then, and the arena cached then still at that address. An in-place move of an arena's
    storage (``share_memory_()``, the Hogwild / torch.multiprocessing idiom) frees its address, and another
    arena allocated later may get it: views of the moved storage must not be handed out for that one."""
    if len(cached) != len(key):
        return False
    for c, k in zip(cached, key):
        if c is None or k is None:
            if c is not k:
                return False
        elif c[1] != k[1] or c[0].data_ptr() != c[1]:
            return False
    return True


class UseCompute(torch.autograd.Function):
    """Forward: the compute copy of a master weight (no copy made). Backward: the gradient cast to the
    master dtype, accumulated into the master's ``.grad``."""

    @staticmethod
    def forward(ctx, master, compute):
        ctx.master_dtype = master.dtype
        return compute.detach()

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.master_dtype), None


class ArenaModule(nn.Module):
    """Base class: registers the parameters of ``layout`` as views of one arena (see the module doc).

    Subclasses build their module tree first (every ``name`` of the layout must resolve to a submodule
    path plus a parameter name), then call :meth:`_init_arena`.
    """

    def _init_arena(self, layout: list[tuple[str, tuple[int, ...]]], values: dict[str, torch.Tensor],
                    no_decay: Callable[[str], bool], device, dtype: torch.dtype):
        self._layout = layout
        ordered = [e for e in layout if not no_decay(e[0])] + [e for e in layout if no_decay(e[0])]
        self._offsets = {}
        off = 0
        for name, shape in ordered:
            self._offsets[name] = (off, shape)
            off += math.prod(shape)
        self.numel_total = off
        self.n_decay = sum(math.prod(s) for nm, s in ordered if not no_decay(nm))
        init = torch.empty(off, dtype=torch.float64)
        for name, shape in layout:
            o, _ = self._offsets[name]
            init[o:o + math.prod(shape)] = values[name].reshape(-1)
        slots = []
        for name, _ in layout:
            mod_path, pname = name.rsplit(".", 1)
            mod = self.get_submodule(mod_path)
            mod.register_parameter(pname, nn.Parameter(torch.empty(0, dtype=dtype, device=device)))
            slots.append((mod._parameters, pname, mod._parameters[pname]))
        self._param_slots = tuple(slots)
        self.compute_dtype = dtype
        self.compute_arena = None
        self._bind_arena(init.to(dtype=dtype, device=device))

    def _bind_arena(self, arena: torch.Tensor):
        """Point every Parameter (and .grad) at views of ``arena`` and a fresh zero grad arena."""
        self.arena = arena
        self.grad_arena = torch.zeros_like(arena)
        views = []
        for name, _ in self._layout:
            p = self.get_parameter(name)
            p.data = self.arena_view(arena, name)
            p.grad = self.arena_view(self.grad_arena, name)
            views.append((p, p.grad))
        # (the grad arena, ((Parameter, its view), ...) in layout order), for attach_grads' identity checks
        self._grad_views = (self.grad_arena, tuple(views))
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
        would detach the Parameters from the arena), then refresh the compute copy.

        Raises:
            ValueError: ``assign=True``.
        """
        if assign:
            raise ValueError(f"{type(self).__name__}.load_state_dict: assign=True would detach the parameters "
                             f"from the arena; load in place (assign=False)")
        out = super().load_state_dict(state_dict, strict=strict)
        self.refresh_compute()
        return out

    def arena_view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """The view of parameter ``name`` inside a flat tensor laid out like the arena."""
        o, shape = self._offsets[name]
        return flat[o:o + math.prod(shape)].view(shape)

    def params_are_arena(self) -> bool:
        """True while every registered parameter is still this module's own Parameter (a view of the arena).

        False inside ``torch.func.functional_call(net, other_params, ...)`` (which swaps plain tensors into
        the modules' ``_parameters``) or after a parameter was replaced by assignment: then the kernel
        backends, which read the arena directly, must not run (the backbone falls back to the reference
        math, which reads the swapped-in tensors). A few µs: one identity check per parameter."""
        for params, name, p in self._param_slots:
            if params.get(name) is not p:
                return False
        return True

    def attach_grads(self):
        """Re-point every ``.grad`` at its view of the grad arena, with torch's accumulation rule: a ``.grad``
        set to None since (``torch.optim.Optimizer.zero_grad()`` and ``nn.Module.zero_grad()`` do so by
        default, ``set_to_none=True``) starts again from zero; one replaced by another tensor is copied in.

        The kernel backends add their gradients to the arena only, so every backward that accumulates into
        the parameters calls this first (the fused node's pre-hook, the trainer); without it a backbone
        trained by a torch optimizer would keep ``.grad`` None after the first ``zero_grad()`` and silently
        stop learning. One identity check per parameter when every ``.grad`` is still attached."""
        arena, views = self._grad_views
        if arena is not self.grad_arena:  # the grad arena was replaced (assigned): the new one's views
            views = tuple((p, self.arena_view(self.grad_arena, name)) for (p, _), (name, _) in zip(views, self._layout))
            self._grad_views = (self.grad_arena, views)
        for p, v in views:
            g = p.grad
            if g is v:
                continue
            if g is None:
                v.zero_()
            elif g.data_ptr() != v.data_ptr():
                v.copy_(g)
            p.grad = v

    def zero_grad(self, set_to_none: bool = False):
        """Zero the flat gradient arena (grads stay views into it; ``set_to_none`` is ignored)."""
        self.attach_grads()
        self.grad_arena.zero_()

    def _apply(self, fn, recurse=True):
        # .to(device) / .double() etc.: move the arena once and re-bind the views, keeping the Parameter
        # objects (so optimizers holding them stay valid).
        # A move the module cannot take raises before anything changes (the old arena stays bound).
        new = fn(self.arena)
        if new.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{type(self).__name__}: master dtype must stay float32 or float64, got {new.dtype}")
        self._check_arena_move(new)
        self._bind_arena(new)
        self.compute_dtype = new.dtype if self.compute_arena is None else self.compute_dtype
        self._arena_moved()
        return self

    def _check_arena_move(self, new: torch.Tensor):
        """Hook for subclasses: raise if the arena cannot move to ``new``'s device and dtype (nothing moved yet)."""

    def _arena_moved(self):
        """Hook for subclasses: the arena changed device or dtype."""

    def set_compute_dtype(self, dtype: torch.dtype):
        """Keep a low-precision copy of the arena (bf16/f16) that the GEMMs read; float32 drops it.

        The copy is refreshed by :meth:`refresh_compute` (the trainer's AdamW writes it in the same pass).

        Raises:
            ValueError: a dtype other than float32, float64, bfloat16 or float16.
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

    def weight(self, name: str) -> torch.Tensor:
        """Parameter ``name`` as the GEMMs read it: the compute copy when one exists (grad flows to the master)."""
        mod, pname = name.rsplit(".", 1)
        m = self.get_submodule(mod)
        p = getattr(m, pname)  # not get_parameter: torch.func.functional_call swaps in plain tensors
        if self.compute_arena is None:
            return p
        if p is not m._parameters.get(pname) or p.data_ptr() != self.arena_view(self.arena, name).data_ptr():
            return p.to(self.compute_dtype)  # a swapped-in tensor (functional_call): cast it, not our copy
        return UseCompute.apply(p, self.arena_view(self.compute_arena, name))
