// Causal depthwise conv1d + SiLU with per-row episode resets, forward and backward (templates).
// One thread per (b, d, chunk of CONV_LC steps); the window of the last K inputs lives in registers.
// A start at time s zeroes every window entry older than s, which is exactly "taps before the latest
// start in (tau, t] are zero" since such an entry stays invalid for every later output.
#pragma once
#include "common.cuh"

namespace mrl {

constexpr int CONV_LC = 16;       // steps per thread
constexpr int CONV_THREADS = 128; // channels per block

template <typename T, int K>
__device__ __forceinline__ void conv_load_window(const T* xb, int64_t st, const float* initbd, const bool* sb,
                                                 int t0, float (&win)[K], float (&vm)[K]) {
  // Before the first push, win[k] holds time t0-K+k (k = 1..K-1); win[0] is shifted out by that push.
  win[0] = 0.f; vm[0] = 0.f;
#pragma unroll
  for (int k = 1; k < K; ++k) {
    int tau = t0 - K + k;
    float v;
    if (tau >= 0) v = to_f(xb[tau * st]);
    else v = initbd ? initbd[K - 1 + tau] : 0.f;
    win[k] = v; vm[k] = 1.f;
  }
  if (sb) {
    // a start at time s in [t0-K+2, t0-1] (s >= 0) invalidates the entries older than s.
#pragma unroll
    for (int k = 2; k < K; ++k) {
      int s = t0 - K + k;
      if (s >= 0 && sb[s]) {
#pragma unroll
        for (int j = 1; j < k; ++j) { win[j] = 0.f; vm[j] = 0.f; }
      }
    }
  }
}

template <typename T, int K>
__device__ __forceinline__ void conv_push(float (&win)[K], float (&vm)[K], float v, bool start) {
#pragma unroll
  for (int k = 0; k < K - 1; ++k) { win[k] = start ? 0.f : win[k + 1]; vm[k] = start ? 0.f : vm[k + 1]; }
  win[K - 1] = v; vm[K - 1] = 1.f;
}

template <typename T, int K>
__global__ void __launch_bounds__(CONV_THREADS) conv_fwd_kernel(ConvFwdParams p) {
  const int d = blockIdx.x * CONV_THREADS + threadIdx.x;
  const int c = blockIdx.y, b = blockIdx.z;
  if (d >= p.D) return;
  const int T_ = p.T;
  const int t0 = c * CONV_LC, t1 = min(t0 + CONV_LC, T_);
  const T* xb = reinterpret_cast<const T*>(p.x) + b * p.x_sb + d;
  const float* initbd = p.init ? p.init + ((int64_t)b * p.D + d) * (K - 1) : nullptr;
  const bool* sb = p.starts ? p.starts + (int64_t)b * T_ : nullptr;
  float w[K];
#pragma unroll
  for (int k = 0; k < K; ++k) w[k] = p.w[d * K + k];
  const float bias = p.bias[d];
  float win[K], vm[K];
  conv_load_window<T, K>(xb, p.x_st, initbd, sb, t0, win, vm);
  T* ob = reinterpret_cast<T*>(p.out) + ((int64_t)b * T_) * p.D + d;
  for (int t = t0; t < t1; ++t) {
    conv_push<T, K>(win, vm, to_f(xb[t * p.x_st]), sb ? sb[t] : false);
    float pre = bias;
#pragma unroll
    for (int k = 0; k < K; ++k) pre = fmaf(w[k], win[k], pre);
    ob[(int64_t)t * p.D] = from_f<T>(siluf_(pre));
  }
  if (t1 == T_) {
    float* fb = p.final_state + ((int64_t)b * p.D + d) * (K - 1);
#pragma unroll
    for (int j = 0; j < K - 1; ++j) fb[j] = win[j + 1];
  }
}

// Partials layout: ws[(b * nC + c) * (K+1) + k][d], k = K is the bias.
template <typename T, int K>
__global__ void __launch_bounds__(CONV_THREADS) conv_bwd_kernel(ConvBwdParams p) {
  const int d = blockIdx.x * CONV_THREADS + threadIdx.x;
  const int c = blockIdx.y, b = blockIdx.z;
  if (d >= p.D) return;
  const int T_ = p.T, D = p.D;
  const int nC = gridDim.y;
  const int t0 = c * CONV_LC, t1 = min(t0 + CONV_LC, T_);
  const int tE = min(t1 + K - 2, T_ - 1);
  const T* xb = reinterpret_cast<const T*>(p.x) + b * p.x_sb + d;
  const T* gb = reinterpret_cast<const T*>(p.dout) + b * p.g_sb + d;
  const float* initbd = p.init ? p.init + ((int64_t)b * D + d) * (K - 1) : nullptr;
  const bool* sb = p.starts ? p.starts + (int64_t)b * T_ : nullptr;
  T* dxb = reinterpret_cast<T*>(p.dx) + ((int64_t)b * T_) * D + d;
  float* dib = p.dinit ? p.dinit + ((int64_t)b * D + d) * (K - 1) : nullptr;
  float w[K];
#pragma unroll
  for (int k = 0; k < K; ++k) w[k] = p.w[d * K + k];
  const float bias = p.bias[d];
  float win[K], vm[K], pend[K], dW[K + 1];
#pragma unroll
  for (int k = 0; k <= K; ++k) dW[k] = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) pend[k] = 0.f;
  conv_load_window<T, K>(xb, p.x_st, initbd, sb, t0, win, vm);
  for (int t = t0; t <= tE; ++t) {
    // shift pending: pend[k] is the dx accumulator of time t-K+1+k
#pragma unroll
    for (int k = 0; k < K - 1; ++k) pend[k] = pend[k + 1];
    pend[K - 1] = 0.f;
    conv_push<T, K>(win, vm, to_f(xb[t * p.x_st]), sb ? sb[t] : false);
    float pre = bias;
#pragma unroll
    for (int k = 0; k < K; ++k) pre = fmaf(w[k], win[k], pre);
    const float sg = sigmoidf_(pre);
    const float dpre = to_f(gb[t * p.g_st]) * sg * (1.f + pre * (1.f - sg));
    if (t < t1) {
#pragma unroll
      for (int k = 0; k < K; ++k) dW[k] = fmaf(dpre, win[k], dW[k]);
      dW[K] += dpre;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) pend[k] = fmaf(w[k] * vm[k], dpre, pend[k]);
    if (t == T_ - 1 && p.dfinal) {
      const float* dfb = p.dfinal + ((int64_t)b * D + d) * (K - 1);
#pragma unroll
      for (int k = 1; k < K; ++k) pend[k] = fmaf(dfb[k - 1], vm[k], pend[k]);
    }
    // time t-K+1 is complete
    const int tau = t - K + 1;
    if (tau >= t0 && tau < t1) dxb[(int64_t)tau * D] = from_f<T>(pend[0]);
    else if (tau < 0 && c == 0 && dib) dib[K - 1 + tau] = pend[0];
  }
  if (tE == T_ - 1) {
    // flush the times T-K+1 .. T-1 still pending
#pragma unroll
    for (int k = 1; k < K; ++k) {
      const int tau = T_ - K + k;
      if (tau >= t0 && tau < t1) dxb[(int64_t)tau * D] = from_f<T>(pend[k]);
      else if (tau < 0 && c == 0 && dib) dib[K - 1 + tau] = pend[k];
    }
  }
  float* wsb = p.ws + ((int64_t)(b * nC + c) * (K + 1)) * D + d;
#pragma unroll
  for (int k = 0; k <= K; ++k) wsb[(int64_t)k * D] = dW[k];
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

template <typename T>
const char* conv_bwd_main_t(const ConvBwdParams& p, cudaStream_t s) {
  dim3 grid((p.D + CONV_THREADS - 1) / CONV_THREADS, (p.T + CONV_LC - 1) / CONV_LC, p.B);
  switch (p.K) {
    case 2: conv_bwd_kernel<T, 2><<<grid, CONV_THREADS, 0, s>>>(p); break;
    case 3: conv_bwd_kernel<T, 3><<<grid, CONV_THREADS, 0, s>>>(p); break;
    case 4: conv_bwd_kernel<T, 4><<<grid, CONV_THREADS, 0, s>>>(p); break;
    default: return "causal_conv1d: d_conv must be 2, 3 or 4";
  }
  MRL_LAUNCH_CHECK();
  return nullptr;
}

}  // namespace mrl
