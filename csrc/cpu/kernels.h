// mamba_rl CPU kernels: torch-free declarations shared by the kernel files (conv.cpp, scan.cpp, norm.cpp,
// step.cpp) and the torch-facing binding (binding.cpp), plus the small inline math they all use.
//
// Layout and conventions (the same as the CUDA kernels in ../ops.h):
//   * activations are float32, channels-last [B, T, C] with unit stride along C; the row (b) and time (t)
//     strides are free, so views such as xz[..., :d_inner] of an in_proj output are read in place;
//   * parameter tensors and carried states are contiguous float32;
//   * episode_starts is a contiguous [B, T] bool tensor (or nullptr): a True at (b, t) zeroes the carried
//     conv window / SSM state of row b BEFORE step t is consumed. Zeroing is a select, never a multiply
//     by a 0/1 mask, so a NaN or inf left in an old episode's state cannot leak into the new one;
//   * kernels never fail: every shape, dtype and device check is done by binding.cpp before they run.
//
// Parallelism: OpenMP over (row, channel block) tasks. A channel block is kLanes consecutive channels; the
// inner loops run over those lanes with a compile-time trip count (the tail block of a d_inner that is not
// a multiple of kLanes is padded with inert zeros in local buffers), so GCC turns them into full SIMD
// vectors. Channels, not d_state, are the vector dimension: in the [B, T, D] layout the channels of a step
// are contiguous, the softplus / SiLU / exp work of a step vectorises with them, and the recurrence over
// the d_state entries needs no horizontal sum (only the dB / dC reductions over channels do). The
// one-token step (step.cpp) is the exception: its carried state keeps the API's [B, D, N] layout, so there
// the recurrence of each channel is vectorised over its N contiguous d_state entries.
//
// Threads: nthreads comes from at::get_num_threads(), i.e. torch.set_num_threads, like torch's own ops.
// On a machine whose cores are shared with other busy processes, OpenMP teams as wide as the core count
// stall at every barrier (as torch's do); use fewer threads there.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace mrl_cpu {

// Per-step lane helpers are kept out of line: inlined into the large OpenMP-outlined task bodies, GCC's
// if-conversion gives up on the selects inside exp_f and leaves those loops scalar.
#if defined(__GNUC__)
#define MRL_NOINLINE __attribute__((noinline))
#else
#define MRL_NOINLINE
#endif

#ifndef MRL_CPU_LANES
#define MRL_CPU_LANES 32
#endif
// For the helpers whose inner loops end in a sum over lanes (and use no exp_f rounding trick, which
// reassociation would break): lets GCC finish `omp simd` reductions with a shuffle tree instead of an
// in-order chain of scalar adds.
#if defined(__GNUC__) && !defined(__clang__)
#define MRL_REASSOC __attribute__((optimize("associative-math", "no-signed-zeros", "no-trapping-math")))
#else
#define MRL_REASSOC
#endif

constexpr int kLanes = MRL_CPU_LANES;  // channels per block (32: four AVX2 / two AVX-512 float vectors)
#ifndef MRL_CPU_SCAN_CHUNK
#define MRL_CPU_SCAN_CHUNK 64
#endif
constexpr int kScanChunk = MRL_CPU_SCAN_CHUNK;  // ckpt[b, c] is the state entering step c * kScanChunk

// ------------------------------------------------------------------------------------------------ math
// exp(x) for x <= 0 on 16 AVX-512 lanes (the scan's exp(delta A)): x = k ln2 + r, |r| <= ln2/2, k by
// vrndscaleps, exp(r) by a degree-6 polynomial (relative-error fit, max ~1e-7 relative in float32), and 2^k
// by vscalefps, which also takes the place of exp_neg_f's exponent-field arithmetic: 12 vector operations
// against exp_neg_f's 16, in the loop that dominates the scan. Results below ~1e-38 are denormal or 0 rather
// than flushed; NaN stays NaN (the clamp keeps a NaN x: vmaxps returns its second operand for a NaN).
#if defined(__AVX512F__)
inline __m512 exp_neg_v16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.3843545457348228e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.374121971428394e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.166800156235695e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666431725025177e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.999999403953552e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}
#endif

// Branch-free float32 exp / log1p / softplus / sigmoid that GCC auto-vectorises (std::exp is a libm call
// and does not vectorise without -ffast-math). Max relative error ~2 ulp over the ranges used here.

inline float bits_as_float(int32_t i) { float f; std::memcpy(&f, &i, sizeof f); return f; }

// exp(x), Cephes expf scheme: x = k ln2 + r with |r| <= ln2/2, exp(r) by a degree-7 polynomial, 2^k built
// in the exponent field. exp(x) = 0 for x < -87 (results below ~1e-38 are flushed), +inf above the float
// range, NaN for NaN.
inline float exp_f(float x) {
  constexpr float kLo = -87.0f, kHi = 88.72283f;
  float xc = x < kLo ? kLo : x;
  xc = xc > kHi ? kHi : xc;
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: (v + kMagic) - kMagic rounds v to an integer
  const float kf = (xc * 1.44269504088896341f + kMagic) - kMagic;  // in [-126, 128]
  float r = xc - kf * 0.693359375f;  // ln2 split in a high part exact in float and a low correction
  r = r - kf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t ki = static_cast<int32_t>(kf);
  const float res = p * bits_as_float((ki + 126) << 23) * 2.0f;  // 2^(k-1) * 2: k = 128 stays finite
  const float big = x > kHi ? std::numeric_limits<float>::infinity() : res;
  return x < kLo ? 0.0f : big;
}

// exp(x) for x <= 0 (the scan's exp(delta * A): delta >= 0, A = -exp(A_log) < 0), a cheaper exp_f: no
// overflow handling, and results below ~1e-38 (x < -87) come out as ~1e-38 instead of 0, which is far
// below float resolution next to the other terms of the recurrence. NaN stays NaN.
inline float exp_neg_f(float x) {
  const float xn = x < -87.0f ? -87.0f : x;  // a NaN x fails the compare and stays NaN
  constexpr float kMagic = 12582912.0f;
  const float kf = (xn * 1.44269504088896341f + kMagic) - kMagic;  // in [-126, 0] for x <= 0
  const float r = (xn - kf * 0.693359375f) - kf * -2.12194440e-4f;
  // exp(r), |r| <= ln2/2: Cephes' coefficients, one Horner chain (7 FMAs)
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * bits_as_float((static_cast<int32_t>(kf) + 127) << 23);
}

// log(w) for w in [1, 2] (Cephes logf polynomial on m - 1, m = w or w/2 in [sqrt(1/2), sqrt(2)]).
inline float log_1_2(float w) {
  const bool hi = w > 1.41421356f;
  const float f = (hi ? w * 0.5f : w) - 1.0f;
  const float e = hi ? 1.0f : 0.0f;
  const float z = f * f;
  float p = 7.0376836292e-2f;
  p = p * f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  const float y = f * z * p - 2.12194440e-4f * e - 0.5f * z;
  return f + y + 0.693359375f * e;
}

// softplus(v) = log(1 + e^v) = max(v, 0) + log1p(e^-|v|), and its derivative sigmoid(v) in *dsp.
// log1p(u) for u in (0, 1]: w = 1 + u is rounded, so log1p(u) = log(w) + log(1 + (u - (w - 1)) / w)
// ~= log(w) + (u - (w - 1)) / w, exact to ~1 ulp even for tiny u (the rounding error of w is recovered
// exactly by u - (w - 1)). Same values as torch's F.softplus (beta 1, threshold 20) to float rounding:
// above 20 the log1p term is below half an ulp of v.
inline float softplus_f(float v, float* dsp) {
  const float u = exp_neg_f(-std::fabs(v));  // in (0, 1]
  const float w = 1.0f + u;
  const float inv = 1.0f / w;
  const float l1p = log_1_2(w) + (u - (w - 1.0f)) * inv;
  *dsp = v >= 0.0f ? inv : u * inv;
  return (v > 0.0f ? v : 0.0f) + l1p;
}

// sigmoid(v) = 1 / (1 + e^-v); 0 below -88 (e^-v overflows to inf), 1 above 17.
inline float sigmoid_f(float v) { return 1.0f / (1.0f + exp_f(-v)); }

// ------------------------------------------------------------------------------- lane-block helpers
// Per-thread scratch of n floats starting on a 64-byte boundary. std::vector storage is only 16-byte aligned,
// and where a buffer is a sliding window (stores of one block read back shifted by kLanes floats) a 64-byte
// vector that straddles two cache lines defeats store-to-load forwarding: the thread whose malloc arena
// happened to return a misaligned block ran conv_fwd ~3x slower than the other (perf, 2 threads).
struct Scratch64 {
  explicit Scratch64(size_t n) : raw(n + 16) {}
  float* data() {
    const uintptr_t p = reinterpret_cast<uintptr_t>(raw.data());
    return reinterpret_cast<float*>((p + 63) & ~(uintptr_t)63);
  }
  std::vector<float> raw;
};

// Copy nd <= kLanes floats into a kLanes buffer, zero-padding the tail lanes (inert in every kernel).
inline void load_lanes(float* dst, const float* src, int nd) {
  if (nd == kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) dst[j] = src[j];
  } else {
    for (int j = 0; j < kLanes; ++j) dst[j] = j < nd ? src[j] : 0.0f;
  }
}
inline void store_lanes(float* dst, const float* src, int nd) {
  if (nd == kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) dst[j] = src[j];
  } else {
    for (int j = 0; j < nd; ++j) dst[j] = src[j];
  }
}

// Lane helpers shared by scan.cpp and step.cpp (defined in scan.cpp, out of line on purpose):
// delta = softplus(dt + bias), dsp = softplus'(dt + bias) (skipped when null), dx = delta * x;
void lanes_delta(float* delta, float* dsp, float* dx, const float* dtv, const float* bias, const float* xv);
// out = (y + D x) * SiLU(z)
void lanes_gate(float* o, const float* y, const float* Dv, const float* xv, const float* zv);

// ------------------------------------------------------------------------------------------- conv1d
// out[b,t,d] = SiLU(bias[d] + sum_k w[d,k] * win[b, t-(K-1)+k, d]), win = x extended on the left by the
// carried window init[b, d, :] (oldest first), zero before the latest episode start in [0, t] of row b.
struct ConvFwdArgs {
  const float* x; int64_t x_sb, x_st;  // [B, T, D]
  const float* w;                      // [D, K]
  const float* bias;                   // [D]
  const float* init;                   // [B, D, K-1] or nullptr (zeros)
  const bool* starts;                  // [B, T] or nullptr
  float* out;                          // [B, T, D] contiguous
  float* final_state;                  // [B, D, K-1]: the last K-1 window entries, zeroed before a start
  int B, T, D, K;
  int nthreads;
};
void conv_fwd(const ConvFwdArgs& a);

struct ConvBwdArgs {
  ConvFwdArgs f;                          // out / final_state unused
  const float* dout; int64_t g_sb, g_st;  // [B, T, D]
  const float* dfinal;                    // [B, D, K-1] or nullptr
  float* dx; int64_t dx_sb, dx_st;        // [B, T, D], may be a strided view (written, never read)
  float* dinit;                           // [B, D, K-1] or nullptr (not wanted)
  float* dw;                              // [D, K]
  float* dbias;                           // [D]
  bool accumulate;                        // add into dw / dbias instead of overwriting them
};
void conv_bwd(const ConvBwdArgs& a);

// ------------------------------------------------------------------------------------ selective scan
// Gu & Dao 2023 (Mamba-1 S6), mamba_ssm selective_scan_fn(u, delta, A, B, C, D, z, delta_bias,
// delta_softplus=True) in channels-last layout:
//   delta = softplus(dt + dt_bias[d]);  A[d,n] = -exp(A_log[d,n])
//   s_t[n] = exp(delta A[d,n]) * s_{t-1}[n] + delta * x * Bm[t,n]   (s_{t-1} := 0 at an episode start)
//   y_t   = (sum_n s_t[n] Cm[t,n] + D[d] x) * SiLU(z)
struct ScanFwdArgs {
  const float* x; int64_t x_sb, x_st;     // [B, T, D]
  const float* dt; int64_t dt_sb, dt_st;  // [B, T, D] (before dt_bias and softplus)
  const float* Bm; int64_t B_sb, B_st;    // [B, T, N]
  const float* Cm; int64_t C_sb, C_st;    // [B, T, N]
  const float* z; int64_t z_sb, z_st;     // [B, T, D]
  const float* A_log;                     // [D, N]
  const float* Dskip;                     // [D]
  const float* dt_bias;                   // [D]
  const float* init;                      // [B, D, N] or nullptr (zeros)
  const bool* starts;                     // [B, T] or nullptr
  float* out;                             // [B, T, D] contiguous
  float* final_state;                     // [B, D, N]
  float* ckpt;                            // [B, nC, D, N] (nC = ceil(T / kScanChunk)) or nullptr
  int B, T, D, N;
  int nthreads;
};
void scan_fwd(const ScanFwdArgs& a);

struct ScanBwdArgs {
  ScanFwdArgs f;                          // the forward's inputs; f.ckpt required, f.out/final_state unused
  const float* dout; int64_t g_sb, g_st;  // [B, T, D]
  const float* dfinal;                    // [B, D, N] or nullptr
  float* dx; float* ddt;                  // [B, T, D] contiguous
  float* dz; int64_t dz_sb, dz_st;        // [B, T, D], may be a strided view
  float* dB; float* dC;                   // [B, T, N] contiguous
  float* dA_log; float* dD; float* ddt_bias;  // [D, N], [D], [D]
  bool accumulate;                        // add into dA_log / dD / ddt_bias instead of overwriting them
  float* dinit;                           // [B, D, N] or nullptr
};
void scan_bwd(const ScanBwdArgs& a);

// -------------------------------------------------------------------------------------------- RMSNorm
// out[r, :] = x[r, :] * rstd[r] * w, rstd[r] = 1 / sqrt(mean(x[r, :]^2) + eps); rows contiguous.
void rmsnorm_fwd(const float* x, int64_t rows, int C, const float* w, float eps, float* out, float* rstd,
                 int nthreads);
// dx = rstd * (g - xhat * mean(g * xhat)) (+ dx_acc), g = dy * w, xhat = x * rstd; dw_acc += sum_r dy * xhat.
void rmsnorm_bwd(const float* dy, const float* x, const float* rstd, const float* w, int64_t rows, int C,
                 float* dx, const float* dx_acc, float* dw_acc, int nthreads);

}  // namespace mrl_cpu

namespace mrl_cpu {
// ------------------------------------------------------------------------------------- optimizer (optim.cpp)
// hyper / scalars: float64 [8] (layout in mamba_rl/ops/optim.py). grad_stats writes scalars[0..6] from the
// flat float32 gradient (times 1/loss_scale), the optional head term extra_sq[0] (already unscaled), and
// hyper; adamw_step applies one AdamW step over [0, P) (decay on [0, n_decay)), writing compute[i] = param[i]
// when compute is not null, and nothing at all when scalars[5] (found_inf) and hyper[6] (skip) are set;
// zero_grad: leave grad all zeros (each element is zeroed once read, in the same pass; also on a skipped step).
void grad_stats(const float* grad, int64_t P, const float* extra_sq, float loss_scale, const double* hyper,
                double* scalars, int nthreads);
void adamw_step(float* param, float* grad, float* exp_avg, float* exp_avg_sq, float* compute, int64_t P,
                int64_t n_decay, const double* hyper, const double* scalars, int nthreads, bool zero_grad);
}  // namespace mrl_cpu

namespace mrl_cpu {
// ------------------------------------------------------------------ Mamba-3 SISO mixer core (mamba3.cpp)
// Everything of one Mamba-3 layer between its in_proj and out_proj GEMMs (Lahoti et al. 2026 as mamba_ssm's
// Mamba3 SISO builds it; the math is mamba_rl/ops/mamba3_ref.py and mamba_rl/model/mamba3.py): from the
// in_proj output row [z | x | B | C | dd_dt | dd_A | trap | angles] (sizes di, di, N, N, H, H, H, R;
// di = H P) to the gated output y [di], with the carried state per (row, head): S [P, N], the accumulated
// angle [R], the previous rotated k~ [N] and v [P]. A True episode start zeroes all four before its step.
struct M3Args {
  const float* zxbc; int64_t z_sb, z_st;  // [B, T, Dp], unit last stride, Dp = 2 di + 2N + 3H + R
  const float* dt_bias;                   // [H]
  const float* B_bias; const float* C_bias;  // [H, N]
  const float* B_w; const float* C_w;     // [N] the B / C RMSNorm weights
  const float* Dskip;                     // [H]
  const float* out_w;                     // [di] gated-RMSNorm weight, or nullptr: y * SiLU(z)
  const float* carry0;                    // [B, H, R + N + P] ([angle | k~ | v]) or nullptr (zeros)
  const float* ssm0;                      // [B, H P, N] or nullptr (zeros)
  const bool* starts;                     // [B, T] or nullptr
  float eps, A_floor;
  bool heavy_tail;                        // A activation: heavy tail (true) or softplus
  int B, T, H, P, N, R;
  int nthreads;
};
constexpr int kM3Chunk = 64;  // the backward restarts the recurrence from a checkpoint every kM3Chunk steps
// Floats per (row, chunk, head) of the forward's checkpoint: S [N][P], angle [R], k~ [N], v [P].
inline int m3_ckpt_len(int P, int N, int R) { return N * P + R + N + P; }
// Forward: y [B, T, H P] contiguous, the final state (carry_f like carry0, ssm_f like ssm0), and ckpt
// [B, nC, H, m3_ckpt_len] (nC = ceil(T / kM3Chunk)) unless null. In place is allowed (carry_f == carry0,
// ssm_f == ssm0): each (row, head) reads its state before writing it; the one-token step uses that.
void m3_fwd(const M3Args& a, float* y, float* carry_f, float* ssm_f, float* ckpt);
struct M3BwdArgs {
  const float* ckpt;    // the forward's checkpoint
  const float* dy;      // [B, T, H P] contiguous
  const float* dcarry;  // [B, H, R + N + P] or nullptr
  const float* dssm;    // [B, H P, N] or nullptr
  float* dzxbc;         // [B, T, Dp] contiguous, every element written
  // added into (every parameter gradient of the core): [H], [H, N], [H, N], [N], [N], [H], [di] or nullptr
  float *ddt_bias, *dB_bias, *dC_bias, *dB_w, *dC_w, *dD, *dout_w;
};
void m3_bwd(const M3Args& a, const M3BwdArgs& g);
}  // namespace mrl_cpu
