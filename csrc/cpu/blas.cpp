// See blas.h.
#include "blas.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <climits>

// The Fortran BLAS entry point, resolved at load time from the library that provides it (torch's CPU
// library exports it where torch was built with a BLAS); weak, so a torch without it still loads.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace mrl_cpu {

void linear_nt(const float* X, int64_t ldx, const float* W, int64_t in, int64_t out, float* C, int64_t ldc,
               int64_t rows, float beta) {
  if (sgemm_ != nullptr && rows <= INT_MAX && in <= INT_MAX && out <= INT_MAX && ldx <= INT_MAX &&
      ldc <= INT_MAX && rows > 0 && in > 0 && out > 0) {
    // column-major view: C^T [out, rows] = W [out, in] (W^T stored, so 'T') @ X^T [in, rows] ('N')
    const int m = (int)out, n = (int)rows, k = (int)in, lda = (int)in, ldb = (int)ldx, lc = (int)ldc;
    const float alpha = 1.0f;
    sgemm_("T", "N", &m, &n, &k, &alpha, W, &lda, X, &ldb, &beta, C, &lc);
    return;
  }
  const auto opt = at::TensorOptions().dtype(at::kFloat);
  at::Tensor x = at::from_blob(const_cast<float*>(X), {rows, in}, {ldx, 1}, opt);
  at::Tensor w = at::from_blob(const_cast<float*>(W), {out, in}, opt);
  at::Tensor c = at::from_blob(C, {rows, out}, {ldc, 1}, opt);
  if (beta == 0.0f)
    at::mm_out(c, x, w.t());
  else
    c.addmm_(x, w.t());
}

void linear_bias_nt(const float* X, const float* W, const float* bias, int64_t in, int64_t out, float* C,
                    int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) std::copy(bias, bias + out, C + r * out);
  linear_nt(X, in, W, in, out, C, out, rows, 1.0f);
}

}  // namespace mrl_cpu
