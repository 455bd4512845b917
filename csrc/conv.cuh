// Causal depthwise conv1d + SiLU with per-row episode resets, forward and backward (templates).
// One thread per (b, d, chunk of CONV_LC steps); the window of the last K inputs lives in registers.
// A start at time s zeroes every window entry older than s, which is exactly "taps before the latest
// start in (tau, t] are zero" since such an entry stays invalid for every later output.
#pragma once
#include <cooperative_groups.h>
#include "common.cuh"

namespace mrl {

constexpr int CONV_LC = 16;       // steps per thread
constexpr int CONV_THREADS = 128; // channels per block

// xv[j] = input at time tau0 + j (the carried window for tau < 0, 0 past T), for j < W. The raw dtype-T
// loads are all issued into xr first and converted afterwards: converting each load as it arrives (as
// before) made nvcc reuse one register per load, serialising the loads of bf16 / f16 windows.
// IN (an interior window, every tau in [0, T)): no bounds tests, the same values.
template <typename T, int W, bool IN = false>
__device__ __forceinline__ void load_window(T (&xr)[W], float (&xv)[W], const T* __restrict__ xb, int64_t x_st,
                                            const float* initbd, int tau0, int T_, int K) {
  const T zero = from_f<T>(0.f);
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const int tau = tau0 + j;
    xr[j] = (IN || (tau >= 0 && tau < T_)) ? xb[(int64_t)tau * x_st] : zero;
  }
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const int tau = tau0 + j;
    xv[j] = (!IN && tau < 0) ? (initbd ? initbd[K - 1 + tau] : 0.f) : to_f(xr[j]);
  }
}

// sv[j] = the episode start flag of time tau0 + j (false outside [0, T) or without starts), for j < W.
template <int W>
__device__ __forceinline__ void load_starts(bool (&sv)[W], const bool* sb, int tau0, int T_) {
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const int tau = tau0 + j;
    sv[j] = (sb && tau >= 0 && tau < T_) ? sb[tau] : false;
  }
}

// Is chunk c = blockIdx.y of row blockIdx.z interior: c >= 1, its last time t0 + last before T, and no episode
// start among the W times t0 - K + 1 .. t0 - K + W of its window? The same answer for the whole block.
template <int K, int W>
__device__ __forceinline__ bool conv_chunk_interior(const bool* starts, int T_, int last) {
  const int c = blockIdx.y, t0 = c * CONV_LC;
  if (c < 1 || t0 + last >= T_) return false;
  if (!starts) return true;
  const bool* sb = starts + (int64_t)blockIdx.z * T_ + t0 - (K - 1);
  bool any = false;
#pragma unroll
  for (int j = 0; j < W; ++j) any = any | sb[j];
  return !any;
}

// One thread per (b, d, chunk of CONV_LC steps). Every input the chunk needs is loaded into registers
// first (fully unrolled, so all loads are in flight together), then the chunk is computed.
// Tap validity: the tap at time tau of output t is used iff no episode start lies in (tau, t].
// IN: an interior chunk (conv_fwd_kernel's test): its window lies in [0, T) without an episode start, and the
// chunk does not hold T - 1 (the final window). The tests drop out; the same FMAs, the same bits.
template <typename T, int K, bool IN>
__device__ __forceinline__ void conv_fwd_body(const ConvFwdParams& p) {
  constexpr int LC = CONV_LC, W = LC + K - 1;  // register window: times t0-K+1 .. t0+LC-1
  const int d = blockIdx.x * CONV_THREADS + threadIdx.x;
  const int c = blockIdx.y, b = blockIdx.z;
  if (d >= p.D) return;
  const int T_ = p.T, D = p.D;
  const int t0 = c * LC;
  const T* __restrict__ xb = reinterpret_cast<const T*>(p.x) + b * p.x_sb + d;
  const float* initbd = p.init ? p.init + ((int64_t)b * D + d) * (K - 1) : nullptr;
  const bool* sb = p.starts ? p.starts + (int64_t)b * T_ : nullptr;
  float xv[W];
  bool sv[W];
  {  // raw loads first (all in flight), conversions after: see load_window
    T xr[W];
    load_window<T, W, IN>(xr, xv, xb, p.x_st, initbd, t0 - (K - 1), T_, K);
  }
  if constexpr (IN) {
#pragma unroll
    for (int j = 0; j < W; ++j) sv[j] = false;
  } else {
    load_starts<W>(sv, sb, t0 - (K - 1), T_);
  }
  float w[K];
#pragma unroll
  for (int k = 0; k < K; ++k) w[k] = p.w[d * K + k];
  const float bias = p.bias[d];
  T* ob = reinterpret_cast<T*>(p.out) + ((int64_t)b * T_) * D + d;
#pragma unroll
  for (int i = 0; i < LC; ++i) {
    const int t = t0 + i;
    if (IN || t < T_) {
      float pre = bias;
      bool valid = true;
#pragma unroll
      for (int k = K - 1; k >= 0; --k) {  // tap time t-K+1+k, register index i+k
        if (valid) pre = fmaf(w[k], xv[i + k], pre);
        if (sv[i + k]) valid = false;
      }
      ob[(int64_t)t * D] = from_f<T>(siluf_(pre));
    }
  }
  if (!IN && t0 + LC >= T_) {  // this chunk holds T-1: write the final window
    float* fb = p.final_state + ((int64_t)b * D + d) * (K - 1);
    bool valid = true;
    for (int j = K - 2; j >= 0; --j) {
      const int tau = T_ - K + 1 + j;
      float v = tau < 0 ? (initbd ? initbd[K - 1 + tau] : 0.f) : to_f(xb[(int64_t)tau * p.x_st]);
      fb[j] = valid ? v : 0.f;
      if (tau >= 0 && sb && sb[tau]) valid = false;
    }
  }
}

// One thread per (b, d, chunk of CONV_LC steps): the interior body where chunk blockIdx.y of row blockIdx.z is
// interior (c >= 1, t0 + LC < T, no episode start at its window's times t0 - K + 1 .. t0 + LC - 1; the same for
// the whole block), else the general one.
template <typename T, int K>
__global__ void __launch_bounds__(CONV_THREADS) conv_fwd_kernel(ConvFwdParams p) {
  if (conv_chunk_interior<K, CONV_LC + K - 1>(p.starts, p.T, CONV_LC)) conv_fwd_body<T, K, true>(p);
  else conv_fwd_body<T, K, false>(p);
}

// Partials layout: row b * nC + c of ws holds (K + 1) * D floats, dweight's D * K first in its [D][K] order
// (column d * K + k), then dbias's D: the column sums of the rows are dweight flattened and dbias.
// IN: an interior chunk (conv_bwd_body's test): every time it touches lies in [0, T), no episode start among
// them, neither the carried window nor dfinal / dinit. The bounds and reset tests then drop out at compile
// time and the same FMAs run in the same order: the same bits as the general body.
template <typename T, int K, bool IN>
__device__ __forceinline__ void conv_bwd_body_t(const ConvBwdParams& p) {
  constexpr int LC = CONV_LC, WX = LC + 2 * (K - 1), WP = LC + K - 1;
  // xv/sv index j <-> time t0-K+1+j (j < WX); dp index m <-> time t0+m (m < WP)
  const int d = blockIdx.x * CONV_THREADS + threadIdx.x;
  const int c = blockIdx.y, b = blockIdx.z;
  if (d >= p.D) return;
  const int T_ = p.T, D = p.D;
  const int nC = gridDim.y;
  const int t0 = c * LC;
  const T* __restrict__ xb = reinterpret_cast<const T*>(p.x) + b * p.x_sb + d;
  const T* __restrict__ gb = reinterpret_cast<const T*>(p.dout) + b * p.g_sb + d;
  const float* initbd = p.init ? p.init + ((int64_t)b * D + d) * (K - 1) : nullptr;
  const bool* sb = p.starts ? p.starts + (int64_t)b * T_ : nullptr;
  float xv[WX], gv[WP];
  bool sv[WX];
  {
    T xr[WX], gr[WP];
    const T zero = from_f<T>(0.f);
#pragma unroll
    for (int m = 0; m < WP; ++m) gr[m] = (IN || t0 + m < T_) ? gb[(int64_t)(t0 + m) * p.g_st] : zero;
    load_window<T, WX, IN>(xr, xv, xb, p.x_st, initbd, t0 - (K - 1), T_, K);
#pragma unroll
    for (int m = 0; m < WP; ++m) gv[m] = to_f(gr[m]);
  }
  if constexpr (IN) {
#pragma unroll
    for (int j = 0; j < WX; ++j) sv[j] = false;
  } else {
    load_starts<WX>(sv, sb, t0 - (K - 1), T_);
  }
  float w[K];
#pragma unroll
  for (int k = 0; k < K; ++k) w[k] = p.w[d * K + k];
  const float bias = p.bias[d];
  float dp[WP], dW[K + 1];
#pragma unroll
  for (int k = 0; k <= K; ++k) dW[k] = 0.f;
#pragma unroll
  for (int m = 0; m < WP; ++m) {
    const int t = t0 + m;
    float pre = bias;
    bool valid = true;
    float tap[K];
#pragma unroll
    for (int k = K - 1; k >= 0; --k) {
      tap[k] = valid ? xv[m + k] : 0.f;
      pre = fmaf(w[k], tap[k], pre);
      if (sv[m + k]) valid = false;
    }
    const float sg = sigmoidf_(pre);
    dp[m] = (IN || t < T_) ? gv[m] * sg * (1.f + pre * (1.f - sg)) : 0.f;
    if (m < LC && (IN || t < T_)) {
#pragma unroll
      for (int k = 0; k < K; ++k) dW[k] = fmaf(dp[m], tap[k], dW[k]);
      dW[K] += dp[m];
    }
  }
  const float* dfb = p.dfinal ? p.dfinal + ((int64_t)b * D + d) * (K - 1) : nullptr;
  // dx of time tau = t0 + i: outputs t = tau + q (tap k = K-1-q) while no start in (tau, t]
  auto dx_at = [&](const int i) -> float {
    const int tau = t0 + i;
    float acc = 0.f;
    bool valid = true;
#pragma unroll
    for (int q = 0; q < K; ++q) {
      const int t = tau + q;
      if (q > 0 && sv[i + q + K - 1]) valid = false;
      if (valid && (IN || (t >= 0 && t < T_))) acc = fmaf(w[K - 1 - q], dp[(i + q) < 0 ? 0 : (i + q)], acc);
    }
    if (!IN && dfb && tau >= T_ - K + 1) {
      bool vf = true;
#pragma unroll
      for (int q = 1; q < K - 1; ++q)
        if (tau + q <= T_ - 1 && sv[i + q + K - 1]) vf = false;
      if (vf) acc += dfb[tau - (T_ - K + 1)];
    }
    return acc;
  };
  T* dxb = reinterpret_cast<T*>(p.dx) + b * p.dx_sb + d;
#pragma unroll
  for (int i = 0; i < LC; ++i)
    if (IN || t0 + i < T_) dxb[(int64_t)(t0 + i) * p.dx_st] = from_f<T>(dx_at(i));
  if (!IN && c == 0 && p.dinit) {
    float* dib = p.dinit + ((int64_t)b * D + d) * (K - 1);
#pragma unroll
    for (int j = 0; j < K - 1; ++j) dib[j] = dx_at(j - (K - 1));
  }
  float* wsb = p.ws + (int64_t)(b * nC + c) * (K + 1) * D;
#pragma unroll
  for (int k = 0; k < K; ++k) wsb[(int64_t)d * K + k] = dW[k];
  wsb[(int64_t)K * D + d] = dW[K];
}

// The backward of chunk blockIdx.y of row blockIdx.z: the interior body where the chunk is interior (c >= 1, its
// last time t0 + LC + K - 2 before T, no episode start at its times t0 - K + 1 .. t0 + LC + K - 2; the same for
// the whole block), else the general one. At 64 x 1024 all but the last of 64 chunks of a row without resets.
// 16-bit activations only: in float32 the interior body takes 143 registers (the general one 121), so 3 blocks
// per SM instead of 4, and the step at 64 x 1024 f32 measured 2.8 % slower with it (H100, benchmarks/NOTES.md);
// bf16 keeps 125 registers and gains 5.4 %.
template <typename T, int K>
__device__ __forceinline__ void conv_bwd_body(const ConvBwdParams& p) {
  if constexpr (sizeof(T) < 4) {  // float32 never instantiates the interior body
    if (conv_chunk_interior<K, CONV_LC + 2 * (K - 1)>(p.starts, p.T, CONV_LC + K - 2)) {
      conv_bwd_body_t<T, K, true>(p);
      return;
    }
  }
  conv_bwd_body_t<T, K, false>(p);
}

template <typename T>
const char* conv_fwd_t(const ConvFwdParams& p, cudaStream_t s) {
  dim3 grid((p.D + CONV_THREADS - 1) / CONV_THREADS, (p.T + CONV_LC - 1) / CONV_LC, p.B);
  switch (p.K) {
    case 2: conv_fwd_kernel<T, 2><<<grid, CONV_THREADS, 0, s>>>(p); break;
    case 3: conv_fwd_kernel<T, 3><<<grid, CONV_THREADS, 0, s>>>(p); break;
    case 4: conv_fwd_kernel<T, 4><<<grid, CONV_THREADS, 0, s>>>(p); break;
    default: return "causal_conv1d: d_conv must be 2, 3 or 4";
  }
  MRL_LAUNCH_CHECK();
  return nullptr;
}

// The weight-gradient partials summed over the (b, chunk) rows into dw [D][K] and dbias [D] (or added).
struct ConvWGradOut {
  float* dw; float* dbias; int D, K; bool acc;
  __device__ void operator()(int j, float v) const {
    float* dst = j < D * K ? dw + j : dbias + (j - D * K);
    *dst = acc ? *dst + v : v;
  }
};

template <typename T, int K>
__global__ void __launch_bounds__(CONV_THREADS) conv_bwd_kernel(ConvBwdParams p) {
  conv_bwd_body<T, K>(p);
}
// The backward and its weight-gradient sums in one cooperative launch (the grid is co-resident): a grid
// barrier between them, the sums by every thread of the grid in colsum_kernel's order (the same bits).
template <typename T, int K>
__global__ void __launch_bounds__(CONV_THREADS) conv_bwd_coop_kernel(ConvBwdParams p) {
  conv_bwd_body<T, K>(p);
  cooperative_groups::this_grid().sync();
  const int64_t blk = ((int64_t)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  colsum_grid(p.ws, p.B * (int)gridDim.y, (p.K + 1) * p.D, ConvWGradOut{p.dw, p.dbias, p.D, p.K, p.accumulate},
              blk * CONV_THREADS + threadIdx.x, (int64_t)gridDim.x * gridDim.y * gridDim.z * CONV_THREADS);
}

template <typename T, int K>
const char* conv_bwd_tk(const ConvBwdParams& p, cudaStream_t s) {
  const dim3 grid((p.D + CONV_THREADS - 1) / CONV_THREADS, (p.T + CONV_LC - 1) / CONV_LC, p.B);
  if (p.partials_only) {  // the caller sums the partials (the grouped weight-gradient launch)
    conv_bwd_kernel<T, K><<<grid, CONV_THREADS, 0, s>>>(p);
    MRL_LAUNCH_CHECK();
    return nullptr;
  }
  const void* coop = (const void*)conv_bwd_coop_kernel<T, K>;
  if (coop_fits(COOP_CONV_BWD, coop, CONV_THREADS, 0, grid)) {
    ConvBwdParams a = p;
    void* args[] = {&a};
    const cudaError_t e = cudaLaunchCooperativeKernel(coop, grid, dim3(CONV_THREADS), args, 0, s);
    return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
  }
  conv_bwd_kernel<T, K><<<grid, CONV_THREADS, 0, s>>>(p);
  MRL_LAUNCH_CHECK();
  launch_colsum(p.ws, p.B * (int)grid.y, (p.K + 1) * p.D, ConvWGradOut{p.dw, p.dbias, p.D, p.K, p.accumulate}, s);
  MRL_LAUNCH_CHECK();
  return nullptr;
}

// The backward with its weight-gradient sums (one cooperative launch where it fits, else two launches), or
// with its partials only (p.partials_only: one launch).
template <typename T>
const char* conv_bwd_main_t(const ConvBwdParams& p, cudaStream_t s) {
  switch (p.K) {
    case 2: return conv_bwd_tk<T, 2>(p, s);
    case 3: return conv_bwd_tk<T, 3>(p, s);
    case 4: return conv_bwd_tk<T, 4>(p, s);
  }
  return "causal_conv1d: d_conv must be 2, 3 or 4";
}

}  // namespace mrl
