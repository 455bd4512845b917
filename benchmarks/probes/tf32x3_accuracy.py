"""Accuracy (and on a GPU, time) of split-precision TF32 GEMMs ("3xTF32") at the default model's GEMM shapes.

TF32 keeps float32's exponent and 10 of its 23 mantissa bits; Hopper's tensor cores multiply TF32 inputs and
accumulate in float32. Splitting each float32 input into hi = tf32(x) and lo = tf32(x - hi) and adding
hi*hi + hi*lo + lo*hi (the lo*lo term is below float32's rounding) would give about float32's accuracy from three
TF32 products; the same sum is one GEMM over a 3x longer K: [A_hi, A_lo, A_hi] @ [B_hi; B_hi; B_lo]. Each form's
largest error is given relative to the largest |entry| of the float64 product, beside a plain float32 GEMM's.
Fresh normal inputs; B scaled by 1/sqrt(K). Measured on an H100 (benchmarks/NOTES.md, twenty-fourth session): the
CPU emulation's float32-level errors do not hold on the tensor cores (the one-GEMM form 1.9-3.6e-6 against
float32's 1-7e-7), and cuBLAS's TF32 forms are at most 1.2x faster than its float32 at these shapes.

- ``--device cpu`` (default) emulates TF32: inputs rounded as ``cvt.rna.tf32.f32`` does (to nearest, ties away
  from zero), products formed in float32 (a product of two TF32 values is exact in float32).
- ``--device cuda`` runs cuBLAS: float32 with TF32 off (SIMT), and the TF32 forms with TF32 on (tensor cores; the
  hi / lo split is this script's rounding, cuBLAS then takes the values as they are), and times each form's GEMMs
  (CUDA events, median of 50 calls; the split itself, which a producing kernel would write, is not timed).

    python benchmarks/probes/tf32x3_accuracy.py [--device cuda] [--seed 0]

Shapes (M x K x N): in_proj 8192 x 128 x 512, x_proj 8192 x 256 x 40, dt_proj 8192 x 8 x 256, out_proj
8192 x 256 x 128 (64 x 128 tokens), and a weight gradient 512 x 8192 x 128 (K over the tokens).
"""
from __future__ import annotations

import argparse

import torch

SHAPES = ((8192, 128, 512), (8192, 256, 40), (8192, 8, 256), (8192, 256, 128), (512, 8192, 128))


def tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest TF32 value (10 mantissa bits, ties away from zero), as float32. Finite inputs."""
    i = x.contiguous().view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32)


def _median_us(fn, iters: int = 50) -> float:
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def run(M: int, K: int, N: int, gen: torch.Generator, device: str) -> dict[str, tuple[float, float]]:
    """{form: (largest |error| / largest |float64 product|, median µs or NaN on the CPU)} for a float32 GEMM, one
    TF32 product, 3xTF32 as three products and as one GEMM over 3K."""
    a = torch.randn(M, K, generator=gen).to(device)
    b = (torch.randn(K, N, generator=gen) / K ** 0.5).to(device)
    ref = a.double() @ b.double()
    scale = ref.abs().max().item()
    ah, bh = tf32(a), tf32(b)
    al, bl = tf32(a - ah), tf32(b - bh)
    a3, b3 = torch.cat([ah, al, ah], 1), torch.cat([bh, bh, bl], 0)
    forms = {
        "float32": (False, lambda: a @ b),
        "1xTF32": (True, lambda: ah @ bh),
        "3xTF32": (True, lambda: ah @ bh + (ah @ bl + al @ bh)),
        "3xTF32 one GEMM": (True, lambda: a3 @ b3),
    }
    out = {}
    cuda = device == "cuda"
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, (use_tf32, fn) in forms.items():
            if cuda:
                torch.backends.cuda.matmul.allow_tf32 = use_tf32
            err = (fn().double() - ref).abs().max().item() / scale
            out[name] = (err, _median_us(fn) if cuda else float("nan"))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tf32x3_accuracy: --device cuda needs a GPU")
    gen = torch.Generator().manual_seed(a.seed)
    for M, K, N in SHAPES:
        r = run(M, K, N, gen, a.device)
        print(f"{M} x {K} x {N}: " + ", ".join(
            f"{k} {e:.2e}" + (f" {t:.1f} us" if t == t else "") for k, (e, t) in r.items()))


if __name__ == "__main__":
    main()
