// RMSNorm (Zhang & Sennrich 2019) as in mamba_ssm: out = x * rsqrt(mean(x^2) + eps) * w, CPU.
// Rows are independent (OpenMP over rows); the sum of squares is accumulated in double so a row of
// thousands of channels keeps float32 accuracy. The backward's dw reduction over rows goes through
// per-thread partials summed in thread order.
#include "kernels.h"

#include <algorithm>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace mrl_cpu {

void rmsnorm_fwd(const float* x, int64_t rows, int C, const float* w, float eps, float* out, float* rstd,
                 int nthreads) {
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, rows));
#pragma omp parallel for num_threads(nt) if (nt > 1 && rows * C >= 4096) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * C;
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int c = 0; c < C; ++c) ss += (double)xr[c] * xr[c];
    const float rs = (float)(1.0 / std::sqrt(ss / C + (double)eps));
    rstd[r] = rs;
    float* o = out + r * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) o[c] = xr[c] * rs * w[c];
  }
}

void rmsnorm_bwd(const float* dy, const float* x, const float* rstd, const float* w, int64_t rows, int C,
                 float* dx, const float* dx_acc, float* dw_acc, int nthreads) {
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, rows));
  const bool par = nt > 1 && rows * C >= 4096;
  const int used = par ? nt : 1;
  std::vector<float> part((size_t)used * C, 0.0f);
#pragma omp parallel num_threads(used) if (par)
  {
    int me = 0;
#ifdef _OPENMP
    me = omp_get_thread_num();
#endif
    float* pw = part.data() + (size_t)me * C;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * C;
      const float* gr = dy + r * C;
      const float rs = rstd[r];
      float m = 0.0f;
#pragma omp simd reduction(+ : m)
      for (int c = 0; c < C; ++c) {
        const float xh = xr[c] * rs;
        m += gr[c] * w[c] * xh;
        pw[c] += gr[c] * xh;
      }
      m /= (float)C;
      float* o = dx + r * C;
      const float* acc = dx_acc ? dx_acc + r * C : nullptr;
#pragma omp simd
      for (int c = 0; c < C; ++c) {
        const float xh = xr[c] * rs;
        const float v = rs * (gr[c] * w[c] - xh * m);
        o[c] = acc ? v + acc[c] : v;
      }
    }
  }
  for (int q = 0; q < used; ++q)
    for (int c = 0; c < C; ++c) dw_acc[c] += part[(size_t)q * C + c];
}

}  // namespace mrl_cpu
