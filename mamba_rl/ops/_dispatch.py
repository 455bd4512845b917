"""Input checks shared by the ops, and the switch between CUDA kernels and pure-torch references."""
from __future__ import annotations

import torch

__all__ = ["check_tensor", "cuda_op_available", "extension"]


def check_tensor(name: str, t, *, shape=None, dtype=None, device=None, floating: bool | None = None):
    """Raise ValueError naming ``name`` with the expected and received shape / dtype / device.

    ``shape`` is a tuple whose ``None`` entries match any size. ``floating=True`` demands a float dtype.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
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


_EXT = None
_EXT_ERR = None


def extension():
    """The compiled CUDA extension (built on first use), or None when CUDA or the build is unavailable."""
    global _EXT, _EXT_ERR
    if _EXT is None and _EXT_ERR is None:
        if not torch.cuda.is_available():
            _EXT_ERR = RuntimeError("CUDA is not available")
        else:
            try:
                from .._build import load_extension
                _EXT = load_extension()
            except Exception as e:  # surfaced by backend="cuda"
                _EXT_ERR = e
    return _EXT


def extension_error():
    """The exception that prevented loading the extension, or None."""
    extension()
    return _EXT_ERR


def cuda_op_available(x: torch.Tensor) -> bool:
    """True when ``x`` is a CUDA tensor and the extension is loaded."""
    return x.is_cuda and extension() is not None
