"""The kernel backends' whole-backbone forward and hand-written backward (one autograd node).

Same math as :meth:`MambaBackbone.forward` on the reference backend, but the backward is explicit: weight
gradients are accumulated straight into the flat gradient arena (GEMMs with beta=1 into arena views, the
kernels' small reductions added in place), with no per-parameter AccumulateGrad, no split/cat of gradients
in autograd and no cast nodes. That is what keeps a captured training step near the kernel-count floor.

Used by the "cuda" and "cpu" backends (``net.kernels`` is the CUDA or the CPU extension: the same
functions and contracts); the parity tests compare it with the float64 reference.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
import weakref

import torch

from ..ops.capability import kernel_support
from ..ops.step import pack_step_weights
from .arena import arena_key, cache_hit

__all__ = ["fused_backbone", "final_state_into", "grad_known", "cpu_whole_applies", "cpu_whole_forward", "cpu_whole_backward"]

# Per backbone: {(data_ptr, dtype, numel) of a flat arena: {parameter name: its view}}. Building the ~26 views
# of each of the three arenas (weights, masters, grads) on every call was a measurable share of a CPU step
# (slicing + view per parameter, ~1.4 ms of a 2 x 128 step); views of the same storage stay valid as long as
# the arena is updated in place, which is how the trainer, AdamW and load_state_dict use it. A new arena (a
# .to(), a deepcopy) has another address and gets its own entry. The cached views keep their storage alive, but
# an in-place move of that storage (share_memory_(), the Hogwild / torch.multiprocessing idiom) frees the address
# they were cached under, and a later arena (the next gradient arena) may get it: each entry holds the arena it
# was built for, and a hit needs that arena still at the key's address. Weak on the backbone: no reference cycle.
_VIEWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# Per backbone: {compute dtype: (norm fwd ok, norm bwd ok, f32 norm fwd ok)} (kernel_support is pure in the
# config and dtype, both fixed for a backbone's life).
_NORM_OK: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _per_arena(store: "weakref.WeakKeyDictionary", net, flat: torch.Tensor, build):
    """``build()``, cached in ``store`` per backbone and per flat arena (its address, dtype, size, device)."""
    per_net = store.get(net)
    if per_net is None:
        per_net = store[net] = {}
    key = (flat.data_ptr(), flat.dtype, flat.numel(), flat.device)
    hit = per_net.get(key)
    if hit is not None and cache_hit(hit[0], arena_key(flat)):
        return hit[1]
    if len(per_net) >= 8:  # arenas of a net replaced several times: drop the stale entries
        per_net.clear()
    v = build()
    per_net[key] = (arena_key(flat), v)
    return v


def _views(net, flat: torch.Tensor) -> dict:
    """{name: view of ``flat``} for every parameter of ``net`` (cached; see ``_VIEWS``)."""
    return _per_arena(_VIEWS, net, flat, lambda: {name: net.arena_view(flat, name) for name in net._offsets})


# Per backbone: {(data_ptr, dtype, numel, device) of a flat arena: the CPU whole-backbone entry's argument layout
# of its views (pack_step_weights: input_proj.weight, input_proj.bias, norm_f.weight, 10 tensors per layer)}.
_PACKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _packed(net, flat: torch.Tensor) -> tuple:
    """:func:`pack_step_weights` of ``flat``'s views (cached like :func:`_views`; views only, no copies)."""
    return _per_arena(_PACKS, net, flat, lambda: pack_step_weights(_views(net, flat), net.cfg.n_layers,
                                                                   net.cfg.d_inner))


# The CPU extension's whole-backbone entry (backbone_fwd / backbone_bwd): "auto" uses it where it applies, "off"
# runs the node's Python over the same kernels (the same bits; tests and benchmarks compare the two).
CPU_WHOLE = "auto"


def _cpu_whole(ext, net, cdt) -> bool:
    """Does the CPU extension's whole-backbone entry (backbone_fwd / backbone_bwd: the same operations as the
    node below, in one C++ call each way) run this backbone? float32 Mamba-1 on the cpu backend."""
    return (CPU_WHOLE != "off" and net.device.type == "cpu" and cdt == torch.float32
            and net.arena.dtype == torch.float32 and type(net)._fused_node is fused_backbone
            and hasattr(ext, "backbone_fwd"))


def cpu_whole_applies(net) -> bool:
    """Does this backbone's fused node run as the CPU extension's whole-backbone calls (:func:`cpu_whole_forward`
    / :func:`cpu_whole_backward`)? float32 Mamba-1 on the cpu backend."""
    return net.backend == "cpu" and _cpu_whole(net.kernels, net, net.compute_dtype)


def cpu_whole_forward(net, x, conv0, ssm0, starts, conv_out=None, ssm_out=None):
    """The fused node's forward on the CPU as one C++ call (``backbone_fwd``): x [B, T, input_dim], conv0
    [L, B, d_inner, d_conv-1] and ssm0 [L, B, d_inner, d_state] float32 contiguous, starts [B, T] bool contiguous
    -> (features [B, T, d_model], final conv, final ssm, saved: the handle :func:`cpu_whole_backward` takes).
    ``conv_out`` / ``ssm_out``: contiguous float32 tensors shaped like conv0 / ssm0 (other storage) that receive
    the final states and are returned (the trainer's carried state, so no copy follows); None: new tensors.
    Only where :func:`cpu_whole_applies`. Raises ValueError on a wrong shape, dtype or device."""
    inp_w, inp_b, normf, layers = _packed(net, net.arena)
    x = x if x.dtype == torch.float32 else x.to(torch.float32)
    return net.kernels.backbone_fwd(x, inp_w, inp_b, normf, layers, conv0, ssm0, starts,
                                    net.cfg.rms_norm_eps, conv_out, ssm_out)


def cpu_whole_backward(net, saved, dfeat, dconv_final=None, dssm_final=None, need_dx=False):
    """Backward of :func:`cpu_whole_forward` as one C++ call (``backbone_bwd``): every parameter gradient is
    added into ``net.grad_arena``; returns dL/dx [B, T, input_dim] float32 when ``need_dx``, else None.
    dfeat [B, T, d_model] float32 (None: only the final states get gradients, which then must be given)."""
    iw, ib, nf, grads = _packed(net, net.grad_arena)
    return net.kernels.backbone_bwd(saved, dfeat, dconv_final, dssm_final, iw, ib, nf, grads, need_dx)


def _norm_flags(net, cdt):
    """(norm fwd ok in cdt, norm bwd ok, norm fwd ok in float32) for ``net`` (cached)."""
    per_net = _NORM_OK.get(net)
    if per_net is None:
        per_net = _NORM_OK[net] = {}
    f = per_net.get(cdt)
    if f is None:
        f = per_net[cdt] = _norm_ok(net, cdt) + (_norm_ok(net, torch.float32)[0],)
    return f

# The small-GEMM kernels of the CUDA backend (mamba_rl/ops/small_gemm.py): "auto" is the measured choice
# (benchmarks/NOTES.md, the small-shapes "fuse" section), "on" / "off" force them (the benchmark times both in one process).
# WGRAD: every weight gradient of the backward in one grouped launch instead of one (f32: two, with cuBLASLt's
# split-K reduce) per weight. XDT: x_proj + dt_proj (and their backward) as one launch each way per layer.
WGRAD = "auto"
XDT = "auto"
# The grouped launch waits for the operands of several layers; past this many bytes of operands held only
# for it, it runs at the end of the current layer instead (peak memory at long B*T).
WGRAD_HOLD_BYTES = 64 << 20
# WGRAD_STREAM: the weight gradients of the CUDA backward run on a second stream, each as soon as its operands
# exist, beside the input-gradient chain (dy -> scan -> conv -> du -> norm, layer by layer) that every later
# kernel waits on; the stream joins the caller's before the backward returns. "on": always on CUDA; "off": the
# weight gradients run in the chain, in the same order; "auto": on from _WGRAD_STREAM_MIN_ROWS rows (B*T). In
# one process on the H200, two calls (benchmarks/NOTES.md): 2.2-6.1 % faster at 8192 rows (64 x 128, 256 x 32,
# 16 x 512, f32 and bf16), -3 % to +1 % at 16k-64k rows, 2.4 % (f32) / 4.1 % (bf16) slower at 1024 rows (16 x 64).
# cuBLAS weight gradients give the same bits either way (the same GEMMs on the same operands); the grouped
# kernel (WGRAD) launches once per layer on the side stream, once per step in the chain, and picks its K slices
# per launch, so the two differ by float32 rounding.
WGRAD_STREAM = "auto"
_WGRAD_STREAM_MIN_ROWS = 8192
# "auto": the grouped kernel up to this many rows (K = B*T) per GEMM, by compute dtype. float32: the step at
# 1024 rows 410-452 vs 537 us with cuBLAS; the kernel alone (the default model's 14 jobs) 46-51 / 128 / 230 us at
# 1024 / 4096 / 8192 rows vs 103-112 / 203 / 289 us through torch, but the 8192-row step is slower with it (1401 vs
# 1297 us: cuBLAS's weight gradients overlap the chain on the side stream better). bf16 / f16, on its tensor-core
# path: the step at 1024 rows 355-371 vs 365-391 us with the same kernel's FFMA path and 387-389 for the version
# before (cuBLAS's 13 tensor-core GEMMs: 394-398); the kernel alone on a real step's jobs 34 / 41 us at 1024 / 2048
# rows vs 110 / 134 through torch. Not yet timed inside a step above 2048 rows, so "auto" stops there for now
# (benchmarks/NOTES.md, "tensor cores for the bf16 weight gradients").
_WGRAD_MAX_ROWS = {torch.float32: 4096, torch.bfloat16: 2048, torch.float16: 2048}
# The grouped kernel's bf16 / f16 jobs on tensor cores (mma.sync, compute capability >= 8.0) where both operands
# allow 16-byte row loads; False keeps them on its FFMA path (comparisons: bench.py --tc-ab).
WGRAD_TENSOR_CORES = True
# WGRAD_SLICE: the grouped kernel's K slice in rows for every job (0: its plan's choice, csrc/wgrad.cu wg_slice,
# which splits K until the items fill every SM). A longer slice gives fewer, longer items: on the side stream they
# leave more SMs to the chain beside them. Benchmarks set it (benchmarks/ab_configs.py).
WGRAD_SLICE = 0
# CONV_DW: where the grouped launch runs (WGRAD), "grouped" leaves the conv's weight gradient to it as column-sum
# jobs over the conv backward's per-chunk partials (conv_bwd(partials=True): one plain launch, with no grid barrier
# and no sums on the input-gradient chain); "conv" sums them in the conv backward itself (its cooperative launch).
# The two sum the same partials in other orders: float32 rounding apart.
CONV_DW = "grouped"
# NORM_DW: likewise for the RMSNorm backwards' dw (the per-layer norms and the final one): "grouped" hands their
# per-block partials to the grouped launch as column-sum jobs (no last-block sum on the chain: its fence, counter
# and reads of the partials); "norm" sums them in the norm kernel. Float32 rounding apart.
NORM_DW = "grouped"
# CONV_XDT: where the x_proj + dt_proj kernel runs (XDT), it also computes the conv's rows first (conv_xdt_fwd:
# one launch a layer fewer, xc written once and not read back); "off": conv_fwd, then xdt_fwd.
CONV_XDT = "auto"
_XDT_MAX_D_INNER = 1024  # "auto": above this the x_proj GEMM is large enough for cuBLAS
# "auto": x_proj + dt_proj kernels only up to this many rows (B*T): measured faster than cuBLAS at 1024 rows
# (f32 574 vs 591 us a step, bf16 equal) and slower at 8192 (f32 1509 vs 1426, bf16 1107 vs 989)
_XDT_MAX_ROWS = 2048


def _small_gemm_ok(ext, net) -> bool:
    return net.device.type == "cuda" and hasattr(ext, "wgrad_grouped")


def _use_wgrad(ext, net, rows: int, cdt) -> bool:
    if WGRAD == "off" or not _small_gemm_ok(ext, net):
        return False
    return WGRAD == "on" or rows <= _WGRAD_MAX_ROWS.get(cdt, 0)


def _use_xdt(ext, net, rows: int) -> bool:
    if XDT == "off" or not _small_gemm_ok(ext, net):
        return False
    c = net.cfg
    E, D = c.dt_rank_value + 2 * c.d_state, c.d_inner
    if 4 * (E * D + 8 * D + 8 * E) > 160 * 1024:  # csrc/xdt.cu xdt_smem_ok: x_proj.weight staged in smem
        return False
    return XDT == "on" or (c.d_inner <= _XDT_MAX_D_INNER and rows <= _XDT_MAX_ROWS)


_SIDE_STREAMS: dict = {}  # device index -> the weight gradients' second stream (WGRAD_STREAM)


def _side_stream(device: torch.device, rows: int):
    """The second stream of ``device`` for the weight gradients of a backward over ``rows`` = B*T rows, or None
    where they stay in the chain (CPU, WGRAD_STREAM "off", "auto" below _WGRAD_STREAM_MIN_ROWS)."""
    if device.type != "cuda" or WGRAD_STREAM == "off" or (WGRAD_STREAM == "auto" and rows < _WGRAD_STREAM_MIN_ROWS):
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _SIDE_STREAMS.get(idx)
    if s is None:
        s = _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return s


class _WGrads:
    """Collects ``dst += a^T b`` weight-gradient jobs and runs them as one grouped launch (or, where the grouped
    kernel is off, each as its GEMM at once); with a side stream, every launch goes there, ordered after the
    caller's stream's work so far, and :meth:`join` makes the caller's stream wait for all of them. The
    operands of those launches are held until the join: freed earlier, their memory could be handed to a
    later kernel of the caller's stream while the side stream still reads it."""

    def __init__(self, ext, on: bool, side=None):
        self.ext, self.on, self.jobs, self.held, self.tiles = ext, on, [], 0, 0
        self.side, self.keep, self.main = side, [], (torch.cuda.current_stream() if side is not None else None)

    def _run(self, fn, *operands):
        if self.side is None:
            fn()
            return
        self.side.wait_stream(self.main)
        with torch.cuda.stream(self.side):
            fn()
        self.keep.extend(operands)

    def join(self):
        """The caller's stream waits for every weight gradient launched so far (call before the arena is read)."""
        if self.side is not None:
            self.main.wait_stream(self.side)
            self.keep.clear()

    def add(self, dst, a, b):
        """dst (float32 arena view) += a^T @ b (a [K, M], b [K, N] or None for column sums)."""
        if not self.on:
            if b is None and a.is_cuda:  # column sums as a GEMM with a ones row: 11 µs against sum(0)'s 67 at
                # 65536 x 128 float32 (H100). The CPU keeps sum(0), the order of the CPU extension's whole-backbone
                # backward, which must give the same bits.
                self._run(lambda: _acc_mm(dst.view(1, -1), a.new_ones(1, a.shape[0]), a), a)
            elif b is None:
                self._run(lambda: dst.add_(a.sum(0, dtype=torch.float32).view(dst.shape)), a)
            else:
                self._run(lambda: _acc_mm(dst, a.t(), b), a, b)
            return
        tiles = -(-a.shape[1] // 64) * (1 if b is None else -(-b.shape[1] // 64))  # csrc/wgrad.cu: 64 x 64
        if self.tiles + tiles > _WGRAD_MAX_TILES:
            self.flush()
        self.jobs.append((a, b, dst))
        self.tiles += tiles
        self.held += a.numel() * a.element_size() + (0 if b is None else b.numel() * b.element_size())
        if len(self.jobs) == _WGRAD_MAX_JOBS:
            self.flush()

    def flush(self, if_above: int = 0):
        """Launch the collected jobs, if their operands hold at least ``if_above`` bytes (0: always)."""
        if self.jobs and self.held >= if_above:
            jobs = self.jobs
            tc, sl = WGRAD_TENSOR_CORES, WGRAD_SLICE
            self._run(lambda: self.ext.wgrad_grouped(jobs, sl, tc),
                      *[t for job in jobs for t in job[:2] if t is not None])
            self.jobs, self.held, self.tiles = [], 0, 0


_WGRAD_MAX_JOBS = 24  # csrc/ops.h WGRAD_MAX_JOBS
_WGRAD_MAX_TILES = 1 << 16  # csrc/binding.cpp WGRAD_COUNTERS (one tile counter each)

_ADDMM_OUT_DTYPE = None  # probed once: does torch.addmm(..., out_dtype=float32) work for low-precision inputs?


def _out_dtype_ok(device, dtype) -> bool:
    """Does torch.addmm(..., out_dtype=float32) take ``dtype`` inputs here? Probed once, never inside a graph
    capture (the probe syncs): a first use under capture takes the two-kernel path."""
    global _ADDMM_OUT_DTYPE
    if _ADDMM_OUT_DTYPE is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        try:
            probe = torch.zeros(2, 2, device=device)
            x = torch.ones(2, 2, device=device, dtype=dtype)
            torch.addmm(probe, x, x, out_dtype=torch.float32, out=probe)
            _ADDMM_OUT_DTYPE = bool(probe[0, 0].item() == 2.0)
        except (RuntimeError, TypeError):
            _ADDMM_OUT_DTYPE = False
    return _ADDMM_OUT_DTYPE


def _acc_mm(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """dst (float32, in the grad arena) += a @ b, with a and b in the compute dtype, f32 accumulation."""
    if a.dtype == dst.dtype:
        dst.addmm_(a, b)
    elif _out_dtype_ok(dst.device, a.dtype):
        torch.addmm(dst, a, b, out_dtype=torch.float32, out=dst)
    else:
        dst.add_(torch.mm(a, b))


def _residual_mm(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """h (float32 residual stream) + a @ b as a new float32 tensor: one GEMM with h as its C operand (f32
    accumulation, no rounding of a @ b to the compute dtype), or mm + cast + add where torch lacks it."""
    if a.dtype == h.dtype:
        return torch.addmm(h, a, b)
    if _out_dtype_ok(h.device, a.dtype):
        out = torch.empty_like(h)
        return torch.addmm(h, a, b, out_dtype=torch.float32, out=out)
    return h + torch.mm(a, b).float()


def _residual_acc(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """h += a @ b in place (h a float32 copy of the residual stream): :func:`_residual_mm` without the copy of
    h that an out-of-place addmm launches first."""
    if a.dtype == h.dtype:
        return h.addmm_(a, b)
    if _out_dtype_ok(h.device, a.dtype):
        return torch.addmm(h, a, b, out_dtype=torch.float32, out=h)
    return h.add_(torch.mm(a, b).float())


def _norm_fwd(ext, ok, h, w, eps, out_dtype):
    """(RMSNorm(h) in out_dtype, rstd [rows, 1]): the kernel, or torch ops where it does not take d_model."""
    if ok:
        return ext.rmsnorm_fwd(h, w, eps, out_dtype)
    rstd = torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    return (h * rstd * w).to(out_dtype), rstd


def _norm_dw_partials(ext, grouped: bool, x: torch.Tensor):
    """The float32 [blocks, C] buffer for the norm backward's dw partials of x [rows, C] where the grouped
    weight-gradient launch runs (``grouped``) and sums them (NORM_DW "grouped"), else None."""
    if not grouped or NORM_DW != "grouped" or not hasattr(ext, "norm_bwd_blocks"):
        return None
    rows, C = x.shape
    return torch.empty(ext.norm_bwd_blocks(rows, C), C, device=x.device, dtype=torch.float32)


def _norm_bwd(ext, ok, dy, x, rstd, w, dw_acc, dx_acc, cdt, wg=None):
    """(dx (+ dx_acc) float32, dx in the compute dtype ``cdt`` or None for float32) of RMSNorm, with
    sum_rows dy * xhat added into dw_acc: the kernel (which writes the low-precision copy in the same pass,
    the next GEMM's input; where ``wg`` takes them, its per-block dw partials go there as a column-sum job
    instead of its own last-block sum), or torch ops."""
    low = cdt != torch.float32
    if ok:
        dx_c = torch.empty(x.shape, device=x.device, dtype=cdt) if low else None
        part = _norm_dw_partials(ext, wg is not None and wg.on, x)
        if part is None:
            return ext.rmsnorm_bwd(dy, x, rstd, w, dw_acc, dx_acc, dx_c), dx_c
        dx = ext.rmsnorm_bwd(dy, x, rstd, w, None, dx_acc, dx_c, dw_partials=part)
        wg.add(dw_acc, part, None)
        return dx, dx_c
    dyf = dy.float()
    xh = x * rstd
    g = dyf * w
    dx = rstd * (g - xh * (g * xh).mean(-1, keepdim=True))
    if dx_acc is not None:
        dx = dx + dx_acc
    dw_acc.add_((dyf * xh).sum(0))
    return dx, (dx.to(cdt) if low else None)


def _norm_ok(net, out_dtype):
    """(forward ok, backward ok) of the norm kernels for this backbone's d_model."""
    kw = dict(d_model=net.cfg.d_model, dtype=torch.float32)
    return (bool(kernel_support(net.backend, "rms_norm_fwd", out_dtype=out_dtype, **kw)),
            bool(kernel_support(net.backend, "rms_norm_bwd", **kw)))


# Hints from the caller about the next fused CUDA forward of this thread, each consumed by that forward:
# "final" (final_state_into) and "grad" (grad_known)
_HINTS = threading.local()
# FINAL_DIRECT: "auto" honours final_state_into on CUDA; "off" ignores it (the forward's own stacks, which the
# trainer then copies: the version before, for A/Bs)
FINAL_DIRECT = "auto"


@contextlib.contextmanager
def _hint(name: str, value):
    """The hint ``name`` set to ``value`` inside the block (cleared at its end, whether used or not)."""
    setattr(_HINTS, name, value)
    try:
        yield
    finally:
        setattr(_HINTS, name, None)


def _take_hint(name: str):
    """The hint ``name`` (or None), consumed."""
    v = getattr(_HINTS, name, None)
    setattr(_HINTS, name, None)
    return v


def final_state_into(conv: torch.Tensor, ssm: torch.Tensor):
    """Within this block (``with final_state_into(conv, ssm): ...``), the next fused CUDA forward
    (:func:`fused_backbone`) writes its final states straight into ``conv`` [L, B, d_inner, d_conv-1] and ``ssm``
    [L, B, d_inner, d_state] (contiguous float32, on the backbone's device, not overlapping the initial state) and
    returns those tensors, not differentiable: the trainer's carried state, so no copy follows the forward (two
    launches fewer per step). Where the forward cannot (CPU, another layer kind, other shapes), it returns new
    tensors as usual and the caller copies."""
    return _hint("final", (conv, ssm))


def _take_final_into(conv0: torch.Tensor, ssm0: torch.Tensor):
    """The (conv, ssm) of :func:`final_state_into`, consumed, if they fit this forward's initial state; else None."""
    dest = _take_hint("final")
    if dest is None or FINAL_DIRECT == "off":
        return None
    for d, s in zip(dest, (conv0, ssm0)):
        if (d.dtype != torch.float32 or d.shape != s.shape or d.device != s.device or not d.is_contiguous()
                or d.requires_grad):
            return None
        lo, hi = d.data_ptr(), d.data_ptr() + d.numel() * 4
        for o in (conv0, ssm0):
            if lo < o.data_ptr() + o.numel() * 4 and o.data_ptr() < hi:
                return None
    return dest


# INPUT_NORM: "auto" runs the input projection in float32 inside the first layer's norm kernel on CUDA where
# input_dim * d_model <= _INPUT_NORM_MAX_WEIGHTS (csrc/ops.h NORM_IN_MAX_WEIGHTS: its weight staged in shared
# memory): one launch instead of a GEMM (bf16 / f16: and the casts of x and h, three launches). "off": the GEMM.
INPUT_NORM = "auto"
_INPUT_NORM_MAX_WEIGHTS = 12288


# NORM_F_FUSED: "auto" runs the final norm's forward and backward as one kernel where grad_known gave dL/dfeatures;
# "off": two kernels, as before.
NORM_F_FUSED = "auto"


def grad_known(dfeat: torch.Tensor):
    """Within this block (``with grad_known(dfeat): ...``), the next fused CUDA forward is told that its features'
    gradient will be ``dfeat`` [B, T, d_model] (float32, contiguous; the tensor later passed to ``backward``): it
    then runs the final RMSNorm's forward and backward as one kernel and keeps the backward's results. Its backward
    uses them only if it receives this same tensor, unchanged (same storage, shape, strides and version); otherwise
    it computes them as usual. One launch fewer per training step (:meth:`MambaTrainer.step`)."""
    return _hint("grad", dfeat)


def _take_grad_known(B: int, T: int, d_model: int, device):
    """The tensor of :func:`grad_known`, consumed, if it fits features [B, T, d_model] float32 here; else None."""
    g = _take_hint("grad")
    if (g is None or NORM_F_FUSED == "off" or g.dtype != torch.float32 or tuple(g.shape) != (B, T, d_model)
            or g.device != device or not g.is_contiguous() or g.requires_grad):
        return None
    return g


def _same_grad(dfeat, pre) -> bool:
    """Is the backward's dfeat the tensor :func:`grad_known` announced, unchanged since the forward?"""
    g, version = pre[0], pre[1]
    return (dfeat is not None and dfeat.dtype == g.dtype and dfeat.data_ptr() == g.data_ptr()
            and dfeat.shape == g.shape and dfeat.stride() == g.stride() and g._version == version)


# OUT_PROJ_LT: float32 out_proj GEMMs (with the residual add) through cuBLASLt. Through cuBLAS, torch's
# ``addmm_`` at 1024 x 128 x 256 is two kernels on the H200 (benchmarks/NOTES.md, sixteenth session); cuBLASLt
# runs it as one. False: the process's preferred BLAS library, as before.
OUT_PROJ_LT = True


@contextlib.contextmanager
def _blas_lt(on: bool):
    """torch's preferred BLAS library set to cuBLASLt inside the block (when ``on``), restored after."""
    if not on:
        yield
        return
    prev = torch.backends.cuda.preferred_blas_library()
    if prev == torch._C._BlasBackend.Cublaslt:
        yield
        return
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(prev)


class _Backbone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, net, conv0, ssm0, starts):
        ext = net.kernels
        c = net.cfg
        ctx.x_dtype = x.dtype
        ctx.set_materialize_grads(False)  # outputs that get no gradient (the final states) arrive as None
        if _cpu_whole(ext, net, net.compute_dtype):
            feat, conv_f, ssm_f, ctx.cpp = cpu_whole_forward(net, x, conv0, ssm0, starts)
            ctx.net = net
            return feat, conv_f, ssm_f
        ctx.cpp = None
        B, T, _ = x.shape
        BT, di, n, r, eps = B * T, c.d_inner, c.d_state, c.dt_rank_value, c.rms_norm_eps
        cdt = net.compute_dtype
        W = net.arena if net.compute_arena is None else net.compute_arena
        M = net.arena  # float32 masters for the non-GEMM parameters

        vw, vm = _views(net, W), _views(net, M)

        def w(name, src=W):
            return (vm if src is M else vw)[name]

        nf_ok, nb_ok, nff_ok = _norm_flags(net, cdt)
        use_xdt = _use_xdt(ext, net, BT)
        dest = _take_final_into(conv0, ssm0)
        conv_stack = ssm_stack = None
        if _small_gemm_ok(ext, net):  # CUDA: conv_fwd's and scan_fwd's final_out (no stack copy)
            conv_stack, ssm_stack = dest if dest is not None else (torch.empty_like(conv0), torch.empty_like(ssm0))
        out_lt = OUT_PROJ_LT and cdt == torch.float32 and conv_stack is not None
        conv_xdt = use_xdt and CONV_XDT != "off" and conv_stack is not None and hasattr(ext, "conv_xdt_fwd")
        resid_copy = nf_ok and conv_stack is not None  # CUDA norm kernel with x_copy (see the loop)
        # CUDA: the input projection (float32, master weights) inside the first norm kernel, which writes h, its
        # copy (the residual buffer) and the normed rows in one pass; else a GEMM in the compute dtype
        in_norm = (resid_copy and INPUT_NORM != "off" and hasattr(ext, "input_rmsnorm_fwd")
                   and net.input_dim * c.d_model <= _INPUT_NORM_MAX_WEIGHTS)
        if in_norm:
            x2 = x.reshape(BT, -1)
            x2 = (x2 if x2.dtype == torch.float32 else x2.float()).contiguous()
            h_next = torch.empty(BT, c.d_model, device=x.device, dtype=torch.float32)
            h, u0, rstd0 = ext.input_rmsnorm_fwd(x2, w("input_proj.weight", M), w("input_proj.bias", M),
                                                 w("layers.0.norm.weight", M), eps, cdt, x_copy=h_next)
        else:
            x2 = x.reshape(BT, -1).to(cdt)
            h = torch.addmm(w("input_proj.bias"), x2, w("input_proj.weight").t()).float()
        saved = []
        conv_f, ssm_f = [], []
        for i in range(c.n_layers):
            p = f"layers.{i}."
            if i == 0 and in_norm:
                u, rstd = u0, rstd0
            elif resid_copy:  # the norm kernel also copies h into the next residual buffer (then an in-place GEMM)
                h_next = torch.empty_like(h)
                u, rstd = ext.rmsnorm_fwd(h, w(p + "norm.weight", M), eps, cdt, x_copy=h_next)
            else:
                u, rstd = _norm_fwd(ext, nf_ok, h, w(p + "norm.weight", M), eps, cdt)
            xz = torch.mm(u, w(p + "mixer.in_proj.weight").t())  # [BT, 2di]
            xi = xz.view(B, T, 2 * di)[..., :di]
            z = xz.view(B, T, 2 * di)[..., di:]
            cw = w(p + "mixer.conv1d.weight", M).view(di, -1)
            if conv_xdt:  # one launch: the conv's rows, then dbc = xc @ Wx^T, dt = dbc[:, :r] @ Wdt^T
                xc, dbc, dt, cf = ext.conv_xdt_fwd(xi, cw, w(p + "mixer.conv1d.bias", M), conv0[i], starts,
                                                   conv_stack[i], w(p + "mixer.x_proj.weight"),
                                                   w(p + "mixer.dt_proj.weight"))
            else:
                # the final window straight into its slice of the stacked output (CUDA)
                kw = {} if conv_stack is None else {"final_out": conv_stack[i]}
                xc, cf = ext.conv_fwd(xi, cw, w(p + "mixer.conv1d.bias", M), conv0[i], starts, **kw)
                if use_xdt:  # one launch: dbc = xc @ Wx^T, dt = dbc[:, :r] @ Wdt^T
                    dbc, dt = ext.xdt_fwd(xc.view(BT, di), w(p + "mixer.x_proj.weight"),
                                          w(p + "mixer.dt_proj.weight"))
                else:
                    dbc = torch.mm(xc.view(BT, di), w(p + "mixer.x_proj.weight").t())  # [BT, r+2n]
                    dt = torch.mm(dbc[:, :r], w(p + "mixer.dt_proj.weight").t())  # [BT, di]
            dbc3 = dbc.view(B, T, r + 2 * n)
            kw = {} if ssm_stack is None else {"final_out": ssm_stack[i]}
            y, sf, ckpt = ext.scan_fwd(xc, dt.view(B, T, di), w(p + "mixer.A_log", M), dbc3[..., r:r + n],
                                       dbc3[..., r + n:], w(p + "mixer.D", M), z, w(p + "mixer.dt_proj.bias", M),
                                       ssm0[i], starts, True, **kw)
            h_in = h
            w_out = w(p + "mixer.out_proj.weight").t()
            with _blas_lt(out_lt):
                if resid_copy:
                    h = _residual_acc(h_next, y.view(BT, di), w_out)
                else:
                    h = _residual_mm(h_in, y.view(BT, di), w_out)  # residual add fused into the GEMM, h stays f32
            saved.append((h_in, u, rstd, xz, xc, dbc, dt, y, ckpt))
            conv_f.append(cf)
            ssm_f.append(sf)
        gk = _take_grad_known(B, T, c.d_model, x.device) if conv_stack is not None else None
        ctx.pre = None
        if gk is not None and nff_ok and nb_ok and hasattr(ext, "rmsnorm_fwd_bwd"):
            # the final norm's backward now (dL/dfeatures announced): one kernel instead of two; dw kept aside
            # and added to the arena by the backward, which uses all this only if it gets the same gradient
            # (as [blocks, d_model] partials where the backward's grouped launch will sum them, else summed)
            dh_c0 = torch.empty(BT, c.d_model, device=x.device, dtype=cdt) if cdt != torch.float32 else None
            part = _norm_dw_partials(ext, _use_wgrad(ext, net, BT, cdt), h)
            dw_f = torch.empty(c.d_model, device=x.device, dtype=torch.float32) if part is None else part
            feat, rstd_f, dh0 = ext.rmsnorm_fwd_bwd(h, w("norm_f.weight", M), eps, gk.view(BT, -1),
                                                    dw_f if part is None else None, dh_c0, dw_partials=part)
            ctx.pre = (gk, gk._version, dh0, dh_c0, dw_f)
        else:
            feat, rstd_f = _norm_fwd(ext, nff_ok, h, w("norm_f.weight", M), eps, torch.float32)
        ctx.net, ctx.saved, ctx.shape = net, saved, (B, T)
        ctx.h_last, ctx.rstd_f, ctx.x2, ctx.in_f32 = h, rstd_f, x2, in_norm
        ctx.conv0, ctx.ssm0, ctx.starts = conv0, ssm0, starts
        ctx.norm_bwd_ok = nb_ok
        ctx.use_xdt = use_xdt
        if dest is not None and conv_stack is dest[0]:
            ctx.mark_non_differentiable(conv_stack, ssm_stack)
        return (feat.view(B, T, -1), torch.stack(conv_f) if conv_stack is None else conv_stack,
                torch.stack(ssm_f) if ssm_stack is None else ssm_stack)

    @staticmethod
    def backward(ctx, dfeat, dconv_final, dssm_final):
        net = ctx.net
        ext = net.kernels
        if ctx.cpp is not None:
            dx = cpu_whole_backward(net, ctx.cpp, dfeat, dconv_final, dssm_final, ctx.needs_input_grad[0])
            return (None if dx is None else dx.to(ctx.x_dtype)), None, None, None, None, None
        c = net.cfg
        B, T = ctx.shape
        BT, di, n, r = B * T, c.d_inner, c.d_state, c.dt_rank_value
        cdt = net.compute_dtype
        W = net.arena if net.compute_arena is None else net.compute_arena
        M, G = net.arena, net.grad_arena

        vw, vm, vg = _views(net, W), _views(net, M), _views(net, G)

        def w(name, src=W):
            return (vm if src is M else vg if src is G else vw)[name]

        nb_ok = ctx.norm_bwd_ok
        use_xdt = ctx.use_xdt
        side = _side_stream(net.device, BT)
        wg = _WGrads(ext, _use_wgrad(ext, net, BT, cdt), side)
        pre, ctx.pre = ctx.pre, None
        if pre is not None and _same_grad(dfeat, pre):  # the forward's fused norm kernel did this already
            dh, dh_c = pre[2], pre[3]
            wg.add(w("norm_f.weight", G), pre[4].view(-1, c.d_model), None)  # dw [C], or its partials [blocks, C]
        else:
            if dfeat is None:  # only the final states were differentiated
                dfeat = torch.zeros(B, T, c.d_model, device=ctx.h_last.device, dtype=torch.float32)
            dh, dh_c = _norm_bwd(ext, nb_ok, dfeat.reshape(BT, -1).contiguous(), ctx.h_last, ctx.rstd_f,
                                 w("norm_f.weight", M), w("norm_f.weight", G), None, cdt, wg)
        for i in reversed(range(c.n_layers)):
            p = f"layers.{i}."
            h_in, u, rstd, xz, xc, dbc, dt, y, ckpt = ctx.saved[i]
            dout = dh if dh_c is None else dh_c
            yf = y.view(BT, di)
            wg.add(w(p + "mixer.out_proj.weight", G), dout, yf)
            dy = torch.mm(dout, w(p + "mixer.out_proj.weight"))  # [BT, di]
            dbc3 = dbc.view(B, T, r + 2 * n)
            z = xz.view(B, T, 2 * di)[..., di:]
            dfin = None if dssm_final is None else dssm_final[i].contiguous()
            # dL/d[xi, z] is assembled in place: the scan writes dz into the right half, the conv dxi into
            # the left; the small weight grads are accumulated by the kernels straight into the arena.
            dxz = torch.empty(BT, 2 * di, device=dh.device, dtype=xz.dtype)
            dxz3 = dxz.view(B, T, 2 * di)
            # Without the x_proj kernel, ddbc = dL/d[dt_low, B, C] is assembled in place too: the scan writes dB /
            # dC into its right columns, the dt_proj GEMM its left ones (no concatenation pass).
            ddbc = None if use_xdt else torch.empty(BT, r + 2 * n, device=dh.device, dtype=xc.dtype)
            dxc, ddt, _, dB, dC, _, _, _, _ = ext.scan_bwd(
                xc, dt.view(B, T, di), w(p + "mixer.A_log", M), dbc3[..., r:r + n], dbc3[..., r + n:],
                w(p + "mixer.D", M), z, w(p + "mixer.dt_proj.bias", M), ctx.ssm0[i], ctx.starts, ckpt,
                dy.view(B, T, di), dfin, False, dxz3[..., di:],
                [w(p + "mixer.A_log", G), w(p + "mixer.D", G), w(p + "mixer.dt_proj.bias", G)], dbc_out=ddbc)
            ddt2 = ddt.view(BT, di)
            wg.add(w(p + "mixer.dt_proj.weight", G), ddt2, dbc[:, :r])
            if use_xdt:  # one launch: ddbc = [ddt @ Wdt, dB, dC], dxc += ddbc @ Wx (in place)
                ddbc = ext.xdt_bwd(ddt2, dB.view(BT, n), dC.view(BT, n), w(p + "mixer.x_proj.weight"),
                                   w(p + "mixer.dt_proj.weight"), dxc.view(BT, di))
            else:
                # a column block of ddbc as out: cuBLAS / the CPU BLAS take its row stride (no copy back)
                torch.mm(ddt2, w(p + "mixer.dt_proj.weight"), out=ddbc[:, :r])
                dxc = dxc.view(BT, di).addmm_(ddbc, w(p + "mixer.x_proj.weight"))  # in place: no copy of dxc first
            wg.add(w(p + "mixer.x_proj.weight", G), ddbc, xc.view(BT, di))
            xi = xz.view(B, T, 2 * di)[..., :di]
            cw = w(p + "mixer.conv1d.weight", M).view(di, -1)
            dcf = None if dconv_final is None else dconv_final[i].contiguous()
            if wg.on and CONV_DW == "grouped":  # the weight gradient's column sums go with the grouped launch
                _, dwp, dbp, _ = ext.conv_bwd(xi, cw, w(p + "mixer.conv1d.bias", M), ctx.conv0[i], ctx.starts,
                                              dxc.view(B, T, di), dcf, False, dxz3[..., :di], partials=True)
                wg.add(w(p + "mixer.conv1d.weight", G).view(-1), dwp, None)
                wg.add(w(p + "mixer.conv1d.bias", G), dbp, None)
            else:
                ext.conv_bwd(xi, cw, w(p + "mixer.conv1d.bias", M), ctx.conv0[i], ctx.starts, dxc.view(B, T, di),
                             dcf, False, dxz3[..., :di], w(p + "mixer.conv1d.weight", G).view(di, -1),
                             w(p + "mixer.conv1d.bias", G))
            wg.add(w(p + "mixer.in_proj.weight", G), dxz, u)
            du = torch.mm(dxz, w(p + "mixer.in_proj.weight"))
            dh, dh_c = _norm_bwd(ext, nb_ok, du, h_in, rstd, w(p + "norm.weight", M), w(p + "norm.weight", G), dh,
                                 cdt, wg)
            # on a side stream, each layer's grouped launch runs beside the next layers' chain; in the chain, it
            # waits for the end unless its operands grow large (long B*T: peak memory)
            wg.flush(if_above=0 if side is not None else WGRAD_HOLD_BYTES)
        if dh_c is None or ctx.in_f32:  # the input projection ran in float32 (input_rmsnorm_fwd)
            dh_c = dh
        wg.add(w("input_proj.weight", G), dh_c, ctx.x2)
        wg.add(w("input_proj.bias", G), dh, None)
        wg.flush()
        wg.join()
        dx = None
        if ctx.needs_input_grad[0]:
            w_in = w("input_proj.weight", M if ctx.in_f32 else W)
            dx = torch.mm(dh_c, w_in).view(B, T, -1).to(ctx.x_dtype)
        return dx, None, None, None, None, None


def fused_backbone(net, x, conv0, ssm0, starts):
    """(features [B, T, d_model] f32, final conv [L, B, d_inner, d_conv-1], final ssm [L, B, d_inner, d_state]).

    ``conv0``/``ssm0`` are float32 contiguous [L, B, ...] tensors (zeros for no initial state) and ``starts``
    a contiguous [B, T] bool tensor. Gradients of every parameter are added to ``net.grad_arena`` by the
    backward; the gradient of x is returned when x requires grad. No gradient flows into the initial state
    (truncated BPTT).
    """
    # The anchor makes the output require grad (so backward runs) when the parameters do. It is a fresh
    # zero-size leaf per call, not a Parameter: autograd caches a leaf's AccumulateGrad node while any graph
    # through it lives, together with the stream current when that node was made, and at the end of every
    # backward syncs the caller's stream with that stream. A Parameter anchor used once through autograd on
    # the default stream (a user's `y, _ = net(x); y.sum().backward()` with y still alive) thus put an event
    # on the default stream inside the trainer's graph capture and invalidated it.
    anchor = None
    if torch.is_grad_enabled() and net.norm_f.weight.requires_grad:
        anchor = torch.empty(0, device=x.device, requires_grad=True)
    if not (OUT_PROJ_LT and x.device.type == "cuda" and net.compute_dtype == torch.float32):
        return _Backbone.apply(x, anchor, net, conv0, ssm0, starts)
    # _blas_lt: torch warns once per process that the preferred-BLAS setting is "experimental" (from C++; inside
    # the node it surfaces as a Python UserWarning when apply returns). Not the caller's concern: filtered here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*preferred_blas_library.*", category=UserWarning)
        return _Backbone.apply(x, anchor, net, conv0, ssm0, starts)
