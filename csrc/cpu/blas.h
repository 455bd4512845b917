// Row-major float32 GEMM with the weight transposed (y = x W^T, a linear layer), straight into BLAS.
//
// The one-token step runs 13 small GEMMs per call (B = 8 rows: each a few microseconds of arithmetic), so
// ATen's per-call cost (dispatch, a transposed view per weight, shape and stride checks) was a measurable
// share of it. Where torch's CPU library exports the Fortran BLAS entry sgemm_ (MKL on x86-64 builds,
// OpenBLAS on others) this calls it directly, with the same arguments at::mm passes it for these operands
// (so the same results); elsewhere it falls back to at::mm_out / addmm_ on views of the same memory.
#pragma once
#include <cstdint>

namespace mrl_cpu {

// C[rows, out] = beta * C + X[rows, in] @ W[out, in]^T. X rows have stride ldx, C rows stride ldc, W is
// contiguous; beta is 0 (C is overwritten, never read) or 1 (accumulate).
void linear_nt(const float* X, int64_t ldx, const float* W, int64_t in, int64_t out, float* C, int64_t ldc,
               int64_t rows, float beta);

// C[rows, out] (contiguous) = bias[out] + X[rows, in] (contiguous) @ W[out, in]^T: a linear layer with bias.
void linear_bias_nt(const float* X, const float* W, const float* bias, int64_t in, int64_t out, float* C,
                    int64_t rows);

}  // namespace mrl_cpu
