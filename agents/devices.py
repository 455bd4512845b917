"""The one device resolution of the agent layer: ``PPOConfig.device`` / ``backend`` -> a ``torch.device``.

The agent (:class:`~mamba_rl.agents.RecurrentPPO`), the CLI (which checks the request before building
anything, so a wrong one is a one-line usage error) and the data-parallel setup (NCCL or gloo,
:func:`~mamba_rl.agents.distributed.init_from_env`) all resolve through :func:`resolve_device`.
"""

from __future__ import annotations

import torch

__all__ = ["resolve_device"]


def resolve_device(device: str, backend: str = "auto") -> torch.device:
    """The device a config asks for, on this machine.

    Args:
        device: "auto" (CUDA when ``torch.cuda.is_available()``, else the CPU), "cpu", "cuda" or "cuda:N".
        backend: the backbone backend; "cuda" needs a CUDA device.

    Returns:
        ``torch.device("cpu")``, or ``torch.device("cuda", i)`` with an explicit index: N for "cuda:N",
        the current CUDA device for "cuda" / "auto" (under torchrun, the rank's local GPU once
        :func:`~mamba_rl.agents.distributed.init_from_env` has set it).

    Raises:
        ValueError: CUDA asked for (device or backend) but not available, N not below the number of CUDA
            devices, backend "cpu" on a GPU device, or an explicit kernel backend whose extension cannot load
            (built on first use); the message names what was asked and what this machine has.
    """
    available = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if available else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not available:
            raise ValueError(f"device {device!r}: CUDA is not available on this machine (torch {torch.__version__}, "
                             "torch.cuda.is_available() is False); use device 'cpu' or 'auto'")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {device!r}: expected an index below {count}, the CUDA devices of this machine")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    if backend == "cuda" and dev.type != "cuda":
        raise ValueError(f"backend 'cuda' needs a CUDA device, got device {dev} (CUDA available: {available}); "
                         "use backend 'auto', 'cpu' or 'reference' on the CPU")
    if backend == "cpu" and dev.type != "cpu":
        raise ValueError(f"backend 'cpu' needs device 'cpu', got device {dev}; use backend 'auto' or 'cuda' there")
    if backend in ("cpu", "cuda"):
        from mamba_rl.ops.extension import extension, extension_error

        if extension(backend) is None:
            raise ValueError(f"backend {backend!r}: the {backend} kernels could not load "
                             f"({extension_error(backend)}); use backend 'auto' (the reference runs, with one "
                             "warning) or 'reference'")
    return dev
