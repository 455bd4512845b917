// Flat-arena optimizer kernels on the CPU: the global gradient norm / overflow flag / bias corrections
// (grad_stats) and AdamW over the whole arena with a decay boundary (adamw_step). The same math, order of
// operations and float32/float64 roundings as the CUDA kernels in ../optim.cu (and so as
// torch.optim.AdamW's single-tensor step and clip_grad_norm_), reading every hyperparameter from the
// float64 hyper / scalars buffers whose layout mamba_rl/ops/optim.py documents:
//   hyper   = [lr, beta1, beta2, eps, weight_decay, max_grad_norm, skip_on_overflow, 0]
//   scalars = [step, bias_correction1, bias_correction2, grad_norm, clip_coef, found_inf, inv_scale, loss_scale]
//
// grad_stats: the arena is cut into fixed blocks of kStatBlock elements (independent of the thread count);
// each block's sum of squares is accumulated in double (vectorised over lanes), the block sums are added
// in block order: the result is bit-reproducible for any number of threads. found_inf is the sum being
// non-finite (see block_sumsq).
// adamw_step: one pass (OpenMP over fixed chunks, each vectorised), param / exp_avg / exp_avg_sq in place,
// and the float32 compute copy in the same pass when one is given. A step with found_inf and
// skip_on_overflow set writes nothing (the caller's compute copy is unchanged too). zero_grad zeroes each
// gradient element in the same pass once it is read (as the CUDA kernel does; on a skipped step the arena is
// zeroed alone): the separate grad.zero_() it replaces was a serial memset of the whole arena on the
// calling thread (the OpenMP team waiting), and a second pass over 1.4 MB at the default size.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace mrl_cpu {
namespace {
constexpr int64_t kStatBlock = 8192;
constexpr int64_t kAdamChunk = 16384;

// Sum of squares of one block, in double. A finite float squares to at most ~1.2e77, so the double sum of
// any block of finite values is finite: the sum is non-finite exactly when some element is inf or NaN,
// which gives the overflow flag without a second reduction (and keeps the loop one simple vector FMA).
MRL_REASSOC double block_sumsq(const float* g, int64_t n) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) {
    const double d = (double)g[i];
    acc += d * d;
  }
  return acc;
}
}  // namespace

void grad_stats(const float* grad, int64_t P, const float* extra_sq, float loss_scale, const double* h,
                double* s, int nthreads) {
  const double invd = 1.0 / (double)loss_scale;
  const int64_t nb = (P + kStatBlock - 1) / kStatBlock;
  std::vector<double> sq((size_t)std::max<int64_t>(nb, 1), 0.0);
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, nb));
#pragma omp parallel for num_threads(nt) if (nt > 1 && P >= 4 * kStatBlock) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t o = b * kStatBlock;
    sq[(size_t)b] = block_sumsq(grad + o, std::min(kStatBlock, P - o));
  }
  double raw = 0.0;
  for (int64_t b = 0; b < nb; ++b) raw += sq[(size_t)b];
  const bool found = !std::isfinite(raw);
  // the unscaled sum: sum (g * inv)^2 = inv^2 sum g^2 (exact when the loss scale is a power of two, as the
  // scaler's always is)
  double total = raw * invd * invd;
  if (extra_sq) total += (double)extra_sq[0];
  const double norm = std::sqrt(total);
  double clip = h[5] / (norm + 1e-6);
  clip = clip < 1.0 ? clip : 1.0;
  if (norm != norm) clip = norm;  // NaN propagates like torch.clamp
  const bool skip = found && h[6] > 0.0;
  const double step = s[0] + (skip ? 0.0 : 1.0);
  const double t = step < 1073741824.0 ? step : 1073741824.0;  // MAX_STEP_EXPONENT
  if (!skip) {
    s[1] = 1.0 - std::pow(h[1], t);
    s[2] = 1.0 - std::pow(h[2], t);
  }
  s[0] = step;
  s[3] = norm;
  s[4] = clip;
  s[5] = found ? 1.0 : 0.0;
  s[6] = invd;
}

namespace {
struct AdamConsts {
  float decay, w1, b2, w2, eps, step_size, bc2_sqrt, inv, clip;
};

// One contiguous range [o, o + n) of one weight-decay group (decay or not: a compile-time branch).
template <bool kDecay, bool kZero>
void adam_range(float* __restrict p, float* __restrict g_in, float* __restrict m_io,
                float* __restrict v_io, float* __restrict comp, int64_t n, const AdamConsts& c) {
  const bool near = std::fabs(c.w1) < 0.5f;  // torch.lerp's two forms (weight < 0.5 or not)
  const float omw = 1.0f - c.w1;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = (g_in[i] * c.inv) * c.clip;
    if (kZero) g_in[i] = 0.0f;
    float w = p[i];
    if (kDecay) w *= c.decay;
    float m = m_io[i];
    const float diff = g - m;
    m = near ? m + c.w1 * diff : g - diff * omw;
    float v = v_io[i] * c.b2;
    v = v + c.w2 * g * g;
    const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
    w = w + (-c.step_size) * (m / denom);
    p[i] = w;
    m_io[i] = m;
    v_io[i] = v;
    if (comp) comp[i] = w;
  }
}
template <bool kZero>
void adam_chunk(float* param, float* grad, float* exp_avg, float* exp_avg_sq, float* compute, int64_t lo,
                int64_t mid, int64_t hi, const AdamConsts& c) {
  if (mid > lo)
    adam_range<true, kZero>(param + lo, grad + lo, exp_avg + lo, exp_avg_sq + lo, compute ? compute + lo : nullptr,
                            mid - lo, c);
  if (hi > mid)
    adam_range<false, kZero>(param + mid, grad + mid, exp_avg + mid, exp_avg_sq + mid,
                             compute ? compute + mid : nullptr, hi - mid, c);
}
}  // namespace

void adamw_step(float* param, float* grad, float* exp_avg, float* exp_avg_sq, float* compute, int64_t P,
                int64_t n_decay, const double* h, const double* s, int nthreads, bool zero_grad) {
  const int64_t nch = (P + kAdamChunk - 1) / kAdamChunk;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, nch));
  if (s[5] > 0.0 && h[6] > 0.0) {  // an overflow step the scaler skips: nothing changes but the zeroed grad
    if (zero_grad) {
#pragma omp parallel for num_threads(nt) if (nt > 1 && P >= 4 * kAdamChunk) schedule(static)
      for (int64_t ch = 0; ch < nch; ++ch) {
        const int64_t lo = ch * kAdamChunk, hi = std::min(P, lo + kAdamChunk);
        std::fill(grad + lo, grad + hi, 0.0f);
      }
    }
    return;
  }
  AdamConsts c;
  c.decay = (float)(1.0 - h[0] * h[4]);
  c.w1 = (float)(1.0 - h[1]);
  c.b2 = (float)h[2];
  c.w2 = (float)(1.0 - h[2]);
  c.eps = (float)h[3];
  c.step_size = (float)(h[0] / s[1]);
  c.bc2_sqrt = (float)std::sqrt(s[2]);
  c.inv = (float)s[6];
  c.clip = (float)s[4];
  n_decay = std::max<int64_t>(0, std::min(n_decay, P));
#pragma omp parallel for num_threads(nt) if (nt > 1 && P >= 4 * kAdamChunk) schedule(static)
  for (int64_t ch = 0; ch < nch; ++ch) {
    const int64_t lo = ch * kAdamChunk, hi = std::min(P, lo + kAdamChunk);
    const int64_t mid = std::max(lo, std::min(hi, n_decay));  // [lo, mid) decayed, [mid, hi) not
    if (zero_grad)
      adam_chunk<true>(param, grad, exp_avg, exp_avg_sq, compute, lo, mid, hi, c);
    else
      adam_chunk<false>(param, grad, exp_avg, exp_avg_sq, compute, lo, mid, hi, c);
  }
}

}  // namespace mrl_cpu
