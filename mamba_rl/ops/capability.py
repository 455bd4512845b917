"""Which kernel takes which configuration: the one predicate every dispatch point asks.

:func:`kernel_support` answers ``(ok, reason)`` for one op of one kernel backend ("cuda" or "cpu") and one
configuration; ``reason`` says, when ``ok`` is False, which limit the configuration passes (expected vs
received), so a caller can fall back to a slower path that works instead of letting a kernel fail. The limits
are those of the kernels in ``csrc/`` (each number below is checked there too, with the same message):

- ``rms_norm_fwd``: CUDA at most 1024 channels (one warp per row, 32 columns per lane in registers); CPU any.
  Output dtype float32 / bfloat16 / float16 on CUDA, float32 on the CPU.
- ``rms_norm_bwd``: CUDA at most 512 channels (each lane holds its 16 columns' dw partials in
  registers); CPU any.
- ``conv``: CUDA d_conv 2, 3 or 4 (the window is unrolled at compile time); CPU any.
- ``scan``: CUDA d_state 8 or 16 (4 states per thread, N / 4 lanes per channel); CPU any.
- ``sequence``: the whole-backbone node of :mod:`mamba_rl.model.fused` (conv and scan as above; the norms
  fall back to torch ops inside the node where their kernel does not take d_model); CPU: float32 compute only.
- ``step``: the one-token kernel. CUDA: d_state 8 or 16, d_conv 4, at most ``STEP_MAX_LAYERS`` = 16 layers
  (the per-layer pointers travel in the kernel's parameter block), float32 states, and one row's residual
  stream and activations, ``4 * (2 d_model + 3 d_inner + dt_rank + 2 d_state + input_dim)`` bytes, within the
  device's opt-in shared memory per block. CPU: float32 states and compute.
- ``m3_sequence`` / ``m3_step``: the Mamba-3 (``layer="Mamba3"``) whole-backbone node of
  :mod:`mamba_rl.model.fused_m3` and its one-token step. CPU: float32 compute, d_state at most
  ``M3_MAX_STATE`` = 256 (the core keeps a head's B and C in stack buffers of that size). CUDA (csrc/mamba3.cu;
  float32 core, the GEMMs in float32 / bf16 / f16): d_state a power of two in [2, 32] (a channel's state
  entries share one warp segment) and headdim * d_state at most 1024 (one thread per state entry of a head).

The op-independent condition, that the module's parameters are its arena's own views (not tensors swapped in
by ``torch.func.functional_call``), is :meth:`~mamba_rl.model.arena.ArenaModule.params_are_arena`; the
backbone asks both (:meth:`~mamba_rl.model.backbone.MambaBackbone.kernel_support`).

The ``sequence`` node's backward adds every parameter gradient straight into the flat gradient arena (the
parameters' ``.grad``), outside autograd. :func:`autograd_support` says when that would differ from what
autograd computes (frozen parameters, parameter hooks), so the backbone runs the reference math instead.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Support", "kernel_support", "autograd_support", "OPS", "CUDA_NORM_FWD_MAX", "CUDA_NORM_BWD_MAX", "CUDA_CONV_K",
           "CUDA_SCAN_N", "STEP_MAX_LAYERS", "M3_MAX_STATE"]

OPS = ("rms_norm_fwd", "rms_norm_bwd", "conv", "scan", "sequence", "step", "m3_sequence", "m3_step")
M3_MAX_STATE = 256
CUDA_NORM_FWD_MAX = 1024
CUDA_NORM_BWD_MAX = 512
CUDA_CONV_K = (2, 3, 4)
CUDA_SCAN_N = (8, 16)
STEP_MAX_LAYERS = 16
_KERNEL_ACT = {"cuda": (torch.float32, torch.bfloat16, torch.float16), "cpu": (torch.float32,)}
_SMEM_OPTIN: dict[int, int] = {}


class Support(NamedTuple):
    """``ok``: the kernel takes the configuration; ``reason``: why not ("" when ok). Truthy iff ok."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


_OK = Support(True, "")


def _no(msg: str) -> Support:
    return Support(False, msg)


def _smem_optin(device) -> int:
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SMEM_OPTIN:
        props = torch.cuda.get_device_properties(idx)
        _SMEM_OPTIN[idx] = int(getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024)
    return _SMEM_OPTIN[idx]


def step_smem_bytes(d_model: int, d_inner: int, dt_rank: int, d_state: int, input_dim: int, rows: int = 1) -> int:
    """Dynamic shared memory of the CUDA one-token kernel for ``rows`` rows per block (csrc/step.cuh)."""
    return 4 * rows * (2 * d_model + 3 * d_inner + dt_rank + 2 * d_state + input_dim)


def kernel_support(backend: str, op: str, *, d_model: int | None = None, d_inner: int | None = None,
                   d_state: int | None = None, d_conv: int | None = None, n_layers: int | None = None,
                   dt_rank: int | None = None, input_dim: int | None = None, dtype: torch.dtype | None = None,
                   out_dtype: torch.dtype | None = None, device=None, headdim: int | None = None) -> Support:
    """Does the ``backend`` kernel of ``op`` take this configuration?

    Args:
        backend: "cuda" or "cpu" (anything else, e.g. "reference", is never a kernel: ok False).
        op: one of :data:`OPS` (module docstring).
        d_model, d_inner, d_state, d_conv, n_layers, dt_rank, input_dim: the sizes the op depends on (the
            ones an op does not use are ignored; a needed one left None raises ValueError).
        dtype: the activation / compute dtype (GEMM dtype for ``sequence`` and ``step``; None: float32).
        out_dtype: ``rms_norm_fwd``'s output dtype (None: ``dtype``).
        device: the CUDA device (for the shared-memory limit of ``step``; None: the current one).
        headdim: Mamba-3's channels per head (``m3_sequence`` / ``m3_step`` on CUDA).
    Returns:
        :class:`Support` (ok, reason).
    Raises:
        ValueError: an unknown op, or a size the op needs is missing.
    """
    if op not in OPS:
        raise ValueError(f"kernel_support: op must be one of {OPS}, got {op!r}")
    if backend not in ("cuda", "cpu"):
        return _no(f"backend {backend!r} has no kernels")
    dtype = torch.float32 if dtype is None else dtype

    def need(name, v):
        if v is None:
            raise ValueError(f"kernel_support: op {op!r} needs {name}")
        return v

    cuda = backend == "cuda"
    if op in ("rms_norm_fwd", "rms_norm_bwd"):
        C = need("d_model", d_model)
        odt = dtype if out_dtype is None else out_dtype
        if odt not in _KERNEL_ACT[backend]:
            return _no(f"{op}: the {backend} kernel writes {_KERNEL_ACT[backend]}, got out_dtype {odt}")
        lim = CUDA_NORM_FWD_MAX if op == "rms_norm_fwd" else CUDA_NORM_BWD_MAX
        if cuda and not 1 <= C <= lim:
            return _no(f"{op}: the CUDA kernel takes 1..{lim} channels, got {C}")
        return _OK
    if dtype not in _KERNEL_ACT[backend]:
        return _no(f"{op}: the {backend} kernels compute in {_KERNEL_ACT[backend]}, got {dtype}")
    if op == "conv":
        K = need("d_conv", d_conv)
        if cuda and K not in CUDA_CONV_K:
            return _no(f"conv: the CUDA kernel takes d_conv in {CUDA_CONV_K}, got {K}")
        return _OK
    if op == "scan":
        N = need("d_state", d_state)
        if cuda and N not in CUDA_SCAN_N:
            return _no(f"scan: the CUDA kernel takes d_state in {CUDA_SCAN_N}, got {N}")
        return _OK
    if op in ("m3_sequence", "m3_step"):
        N = need("d_state", d_state)
        if cuda:
            P = need("headdim", headdim)
            if N < 2 or N > 32 or N & (N - 1):
                return _no(f"{op}: the CUDA kernels take d_state a power of two in [2, 32], got {N}")
            if P * N > 1024:
                return _no(f"{op}: the CUDA kernels take headdim * d_state <= 1024, got {P} * {N} = {P * N}")
            return _OK
        if N > M3_MAX_STATE:
            return _no(f"{op}: the CPU kernels take d_state <= {M3_MAX_STATE}, got {N}")
        return _OK
    if op == "sequence":
        for sub, kw in (("conv", dict(d_conv=need("d_conv", d_conv))), ("scan", dict(d_state=need("d_state", d_state)))):
            s = kernel_support(backend, sub, dtype=dtype, **kw)
            if not s:
                return _no(f"sequence: {s.reason}")
        return _OK
    # op == "step"
    N, K, L = need("d_state", d_state), need("d_conv", d_conv), need("n_layers", n_layers)
    if not cuda:
        return _OK
    if N not in CUDA_SCAN_N:
        return _no(f"step: the CUDA kernel takes d_state in {CUDA_SCAN_N}, got {N}")
    if K != 4:
        return _no(f"step: the CUDA kernel takes d_conv 4, got {K}")
    if not 1 <= L <= STEP_MAX_LAYERS:
        return _no(f"step: the CUDA kernel takes 1..{STEP_MAX_LAYERS} layers, got {L}")
    smem = step_smem_bytes(need("d_model", d_model), need("d_inner", d_inner), need("dt_rank", dt_rank), N,
                           need("input_dim", input_dim))
    lim = _smem_optin(device)
    if smem > lim:
        return _no(f"step: one row needs {smem} bytes of shared memory, the device allows {lim} per block")
    return _OK


def autograd_support(named_params, *, inputs_require_grad: bool = False, grad_enabled: bool | None = None) -> Support:
    """Can the fused ``sequence`` node stand in for autograd here?

    Its backward writes the gradients of *all* parameters into ``.grad`` (the flat gradient arena) and
    creates no autograd edge to any parameter. That equals autograd when grad mode is off, or when every
    parameter requires grad and none has a hook, or when no parameter requires grad and no input (x, the
    initial state) does either (then nothing is differentiated).

    Args:
        named_params: iterable of (name, parameter) pairs (the module's registered parameters).
        inputs_require_grad: whether x or the initial state requires grad.
        grad_enabled: grad mode (None: ``torch.is_grad_enabled()``).
    Returns:
        :class:`Support`; ``reason`` names the first parameter that is frozen or has a hook.
    """
    if not (torch.is_grad_enabled() if grad_enabled is None else grad_enabled):
        return _OK
    frozen = None
    n_frozen = n_total = 0
    for name, p in named_params:
        n_total += 1
        if not p.requires_grad:
            n_frozen += 1
            frozen = frozen or name
        elif p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
            return _no(f"sequence: parameter {name!r} has a gradient hook; the fused node does not call parameter "
                       f"hooks, so the reference math runs")
    if n_frozen == 0 or (n_frozen == n_total and not inputs_require_grad):
        return _OK
    return _no(f"sequence: parameter {frozen!r} has requires_grad=False ({n_frozen} of {n_total} frozen, grad mode "
               f"on); the fused node writes every parameter's gradient, so the reference math runs")
