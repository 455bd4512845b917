"""Input checks shared by the ops, the model and the trainer (one error format: expected vs received), and
the argument conversions every kernel wrapper applies."""
from __future__ import annotations

import torch

__all__ = ["check_tensor", "f32c", "act", "bool_c"]


def check_tensor(name: str, t, *, shape=None, dtype=None, device=None, floating: bool | None = None):
    """Raise ValueError naming ``name`` with the expected and received shape / dtype / device.

    ``shape`` is a tuple whose ``None`` entries match any size. ``floating=True`` demands a float dtype.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(s is None or s == g for s, g in zip(shape, t.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if floating and not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point dtype, got {t.dtype}")
    if device is not None and torch.device(t.device) != torch.device(device):
        raise ValueError(f"{name}: expected device {torch.device(device)}, got {t.device}")
    return t


def f32c(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as contiguous float32 (the kernels' parameter and state dtype), None stays None."""
    return None if t is None else t.to(torch.float32).contiguous()


def act(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An activation in the kernel's dtype with unit last-dim stride (row and time strides are kept)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.size(-1) > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def bool_c(t: torch.Tensor | None) -> torch.Tensor | None:
    """``episode_starts`` as a contiguous bool tensor, None stays None."""
    return None if t is None else t.to(torch.bool).contiguous()
