"""Accuracy of split-precision TF32 GEMMs ("3xTF32") at the default model's GEMM shapes, emulated on the CPU.

TF32 keeps float32's exponent and 10 of its 23 mantissa bits; Hopper's tensor cores multiply TF32 inputs and
accumulate in float32. Splitting each float32 input into hi = tf32(x) and lo = tf32(x - hi) and adding
hi*hi + hi*lo + lo*hi (the lo*lo term is below float32's rounding) gives about float32's accuracy from three TF32
products; the same sum is one GEMM over a 3x longer K: [A_hi, A_lo, A_hi] @ [B_hi; B_hi; B_lo]. This probe
rounds to TF32 as ``cvt.rna.tf32.f32`` does (to nearest, ties away from zero), forms the products in float32 (a
product of two TF32 values is exact in float32) and compares each form's largest error, relative to the largest
|entry| of the float64 product, with a plain float32 GEMM's. Fresh normal inputs; B scaled by 1/sqrt(K).

    python benchmarks/probes/tf32x3_accuracy.py [--seed 0]

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


def errors(M: int, K: int, N: int, gen: torch.Generator) -> dict[str, float]:
    """Largest |error| / largest |float64 product| of a float32 GEMM, one TF32 product, 3xTF32 as three products
    and as one GEMM over 3K."""
    a = torch.randn(M, K, generator=gen)
    b = torch.randn(K, N, generator=gen) / K ** 0.5
    ref = a.double() @ b.double()
    scale = ref.abs().max().item()
    ah, bh = tf32(a), tf32(b)
    al, bl = tf32(a - ah), tf32(b - bh)
    forms = {
        "float32": a @ b,
        "1xTF32": ah @ bh,
        "3xTF32": ah @ bh + (ah @ bl + al @ bh),
        "3xTF32, one GEMM": torch.cat([ah, al, ah], 1) @ torch.cat([bh, bh, bl], 0),
    }
    return {k: (v.double() - ref).abs().max().item() / scale for k, v in forms.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(a.seed)
    for M, K, N in SHAPES:
        e = errors(M, K, N, gen)
        print(f"{M} x {K} x {N}: " + ", ".join(f"{k} {v:.2e}" for k, v in e.items()))


if __name__ == "__main__":
    main()
