// Causal depthwise conv1d + SiLU with per-row episode resets (Mamba-1's short convolution), CPU.
//
// One task = (row b, block of kLanes channels). Each task keeps a sliding window W[K][kLanes] of the last K
// inputs (W[K-1] = x[t], W[0] = x[t-K+1]; initially W[1..K-1] = the carried state). At an episode start
// the K-1 older entries are zeroed (assigned, not multiplied), which is exactly "taps before the latest
// start are zero"; the zeros then slide through the window like any input.
//
// Backward: pass 1 (forward in t) rebuilds the window and pre-activation p_t, stores
// dp_t = dout_t * SiLU'(p_t) and accumulates dw[k] += dp_t W_t[k], db += dp_t. Pass 2 (reverse in t)
// carries G[k] = dL/dW_t[k]: G[k] += w[k] dp_t, dx_t = G[K-1], then G slides back one slot (W_t[k] is
// W_{t-1}[k+1]) and is cleared when step t was a start (the reset cut that dependence). After t = 0,
// G[1..K-1] is dL/d(carried state). Weight grads are reduced over rows through per-row partials (fixed
// order: bit-reproducible for a given thread count and input).
#include "kernels.h"

#include <algorithm>
#include <vector>

namespace mrl_cpu {
namespace {

inline int num_blocks(int D) { return (D + kLanes - 1) / kLanes; }

// Window initialisation shared by forward and backward: W[0] = 0, W[1..K-1] = init[b, d0+j, 0..K-2].
void init_window(float* W, const ConvFwdArgs& a, int b, int d0, int nd) {
  const int K = a.K;
  std::fill(W, W + K * kLanes, 0.0f);
  if (!a.init) return;
  for (int k = 1; k < K; ++k)
    for (int j = 0; j < nd; ++j) W[k * kLanes + j] = a.init[((int64_t)b * a.D + d0 + j) * (K - 1) + (k - 1)];
}

// Slide the window one step: drop W[0], append x[b, t, d0 : d0+nd]; zero the K-1 old entries at a start.
inline void advance_window(float* W, const ConvFwdArgs& a, int b, int t, int d0, int nd) {
  const int K = a.K;
  for (int k = 0; k + 1 < K; ++k) {
    float* dst = W + k * kLanes;
    const float* src = dst + kLanes;
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) dst[j] = src[j];
  }
  load_lanes(W + (K - 1) * kLanes, a.x + (int64_t)b * a.x_sb + (int64_t)t * a.x_st + d0, nd);
  if (a.starts && a.starts[(int64_t)b * a.T + t]) std::fill(W, W + (K - 1) * kLanes, 0.0f);
}

// Pre-activation p = bias + sum_k w[k] W[k] for the lanes of one block (wT is w transposed to [K][kLanes]).
inline void window_dot(float* p, const float* W, const float* wT, const float* bias, int K) {
#pragma omp simd
  for (int j = 0; j < kLanes; ++j) p[j] = bias[j];
  for (int k = 0; k < K; ++k) {
    const float* wk = wT + k * kLanes;
    const float* xk = W + k * kLanes;
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) p[j] += wk[j] * xk[j];
  }
}

// o = SiLU(p) over a block (out of line: see MRL_NOINLINE in kernels.h)
MRL_NOINLINE void lanes_silu(float* __restrict o, const float* __restrict p) {
#pragma omp simd
  for (int j = 0; j < kLanes; ++j) o[j] = p[j] * sigmoid_f(p[j]);
}

// dp = go * SiLU'(p), db += dp
MRL_NOINLINE void lanes_dsilu(float* __restrict dp, float* __restrict db, const float* __restrict go,
                              const float* __restrict p) {
#pragma omp simd
  for (int j = 0; j < kLanes; ++j) {
    const float s = sigmoid_f(p[j]);
    dp[j] = go[j] * (s + p[j] * s * (1.0f - s));  // d SiLU(p) / dp
    db[j] += dp[j];
  }
}

void load_weights(float* wT, float* bias, const ConvFwdArgs& a, int d0, int nd) {
  const int K = a.K;
  for (int k = 0; k < K; ++k)
    for (int j = 0; j < kLanes; ++j) wT[k * kLanes + j] = j < nd ? a.w[(int64_t)(d0 + j) * K + k] : 0.0f;
  load_lanes(bias, a.bias + d0, nd);
}

}  // namespace

void conv_fwd(const ConvFwdArgs& a) {
  const int nblk = num_blocks(a.D), K = a.K;
  const int64_t ntask = (int64_t)a.B * nblk;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(a.nthreads, ntask));
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    Scratch64 buf((size_t)2 * K * kLanes);
    float* W = buf.data();
    float* wT = W + K * kLanes;
    alignas(64) float bias[kLanes], p[kLanes], o[kLanes];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < ntask; ++task) {
      const int b = (int)(task / nblk), d0 = (int)(task % nblk) * kLanes, nd = std::min(kLanes, a.D - d0);
      load_weights(wT, bias, a, d0, nd);
      init_window(W, a, b, d0, nd);
      float* out = a.out + (int64_t)b * a.T * a.D + d0;
      for (int t = 0; t < a.T; ++t) {
        advance_window(W, a, b, t, d0, nd);
        window_dot(p, W, wT, bias, K);
        lanes_silu(o, p);
        store_lanes(out + (int64_t)t * a.D, o, nd);
      }
      for (int j = 0; j < nd; ++j)
        for (int k = 1; k < K; ++k)
          a.final_state[((int64_t)b * a.D + d0 + j) * (K - 1) + (k - 1)] = W[k * kLanes + j];
    }
  }
}

void conv_bwd(const ConvBwdArgs& g) {
  const ConvFwdArgs& a = g.f;
  const int nblk = num_blocks(a.D), K = a.K, T = a.T, D = a.D;
  const int64_t ntask = (int64_t)a.B * nblk;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(a.nthreads, ntask));
  // per-row partial weight grads [B][K+1][D] (row K holds the bias grad), reduced below in row order
  std::vector<float> part((size_t)a.B * (K + 1) * D);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    Scratch64 buf((size_t)(3 * K + (int64_t)T) * kLanes);
    float* W = buf.data();
    float* wT = W + K * kLanes;
    float* G = wT + K * kLanes;
    float* DP = G + K * kLanes;  // [T][kLanes] dL/dp_t
    Scratch64 dwbuf((size_t)K * kLanes);
    float* dw = dwbuf.data();
    alignas(64) float bias[kLanes], p[kLanes], go[kLanes], db[kLanes];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < ntask; ++task) {
      const int b = (int)(task / nblk), d0 = (int)(task % nblk) * kLanes, nd = std::min(kLanes, D - d0);
      load_weights(wT, bias, a, d0, nd);
      init_window(W, a, b, d0, nd);
      std::fill(dw, dw + K * kLanes, 0.0f);
      std::fill(db, db + kLanes, 0.0f);
      // pass 1: forward, dp_t and the weight grads
      for (int t = 0; t < T; ++t) {
        advance_window(W, a, b, t, d0, nd);
        window_dot(p, W, wT, bias, K);
        load_lanes(go, g.dout + (int64_t)b * g.g_sb + (int64_t)t * g.g_st + d0, nd);
        float* dp = DP + (int64_t)t * kLanes;
        lanes_dsilu(dp, db, go, p);
        for (int k = 0; k < K; ++k) {
          float* dwk = dw + k * kLanes;
          const float* xk = W + k * kLanes;
#pragma omp simd
          for (int j = 0; j < kLanes; ++j) dwk[j] += dp[j] * xk[j];
        }
      }
      // pass 2: reverse, window gradient -> dx and d(carried state)
      std::fill(G, G + K * kLanes, 0.0f);
      if (g.dfinal)
        for (int k = 1; k < K; ++k)
          for (int j = 0; j < nd; ++j) G[k * kLanes + j] = g.dfinal[((int64_t)b * D + d0 + j) * (K - 1) + (k - 1)];
      for (int t = T - 1; t >= 0; --t) {
        const float* dp = DP + (int64_t)t * kLanes;
        for (int k = 0; k < K; ++k) {
          float* gk = G + k * kLanes;
          const float* wk = wT + k * kLanes;
#pragma omp simd
          for (int j = 0; j < kLanes; ++j) gk[j] += wk[j] * dp[j];
        }
        store_lanes(g.dx + (int64_t)b * g.dx_sb + (int64_t)t * g.dx_st + d0, G + (K - 1) * kLanes, nd);
        const bool reset = a.starts && a.starts[(int64_t)b * T + t];
        for (int k = K - 1; k >= 1; --k) {  // W_t[k-1] is W_{t-1}[k]; nothing flows back across a reset
          float* dst = G + k * kLanes;
          const float* src = G + (k - 1) * kLanes;
#pragma omp simd
          for (int j = 0; j < kLanes; ++j) dst[j] = reset ? 0.0f : src[j];
        }
        std::fill(G, G + kLanes, 0.0f);
      }
      if (g.dinit)
        for (int j = 0; j < nd; ++j)
          for (int k = 1; k < K; ++k) g.dinit[((int64_t)b * D + d0 + j) * (K - 1) + (k - 1)] = G[k * kLanes + j];
      float* pb = part.data() + (size_t)b * (K + 1) * D;
      for (int k = 0; k < K; ++k) store_lanes(pb + (int64_t)k * D + d0, dw + k * kLanes, nd);
      store_lanes(pb + (int64_t)K * D + d0, db, nd);
    }
    // reduce the per-row partials over b (fixed order), write or add into dw [D, K] and dbias [D]
#pragma omp for schedule(static)
    for (int d = 0; d < D; ++d) {
      for (int k = 0; k <= K; ++k) {
        float s = 0.0f;
        for (int b = 0; b < a.B; ++b) s += part[((size_t)b * (K + 1) + k) * D + d];
        float* dst = k < K ? g.dw + (int64_t)d * K + k : g.dbias + d;
        *dst = g.accumulate ? *dst + s : s;
      }
    }
  }
}

}  // namespace mrl_cpu
