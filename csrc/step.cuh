// One-token inference through the whole backbone in ONE launch. Rows (envs) are independent, so a block
// owns R rows for every layer: the residual stream stays in shared memory, weights stream from L2 with
// 16-byte loads (warp per output row, several rows in flight), and the conv window / SSM state of the
// block's rows are updated in place. Resets zero a row's window and state before its token is consumed.
#pragma once
#include "common.cuh"
#include <type_traits>

namespace mrl {

constexpr int STEP_THREADS = 512;
constexpr int STEP_WARPS = STEP_THREADS / 32;

template <typename WT> struct Vec16;
template <> struct Vec16<float> { static constexpr int n = 4; };
template <> struct Vec16<__nv_bfloat16> { static constexpr int n = 8; };
template <> struct Vec16<__half> { static constexpr int n = 8; };

template <typename WT>
__device__ __forceinline__ void load16(const WT* p, float (&v)[Vec16<WT>::n]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const WT* e = reinterpret_cast<const WT*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec16<WT>::n; ++i) v[i] = to_f(e[i]);
}

// out[r][j] (+)= sum_k W[j][k] * in[r][k], j < rows, for R rows held in shared memory.
// in: [R][in_ld] floats, out: [R][out_ld] floats. Warp per output row, RB rows in flight.
// NORM: `in` holds the un-normalised rows h and the input is the RMSNorm (h[c] * rs[r]) * nw[c], formed as it is
// read (the same products, in the same order, as rms_rows_w writes them into shared memory).
template <typename WT, int R, bool ADD, int NWARPS = STEP_WARPS, bool NORM = false>
__device__ void gemv_rows(const WT* __restrict__ W, int rows, int cols, const float* in, int in_ld, float* out,
                          int out_ld, const float* rs = nullptr, const float* nw = nullptr) {
  constexpr int V = Vec16<WT>::n;
  constexpr int RB = 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool vec = ((reinterpret_cast<uintptr_t>(W) & 15) == 0) && (cols % V == 0);
  for (int j0 = warp * RB; j0 < rows; j0 += NWARPS * RB) {
    float acc[RB][R];
#pragma unroll
    for (int q = 0; q < RB; ++q)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[q][r] = 0.f;
    if (vec) {
      for (int c = lane * V; c < cols; c += 32 * V) {
        float w[RB][V];
#pragma unroll
        for (int q = 0; q < RB; ++q) {
          const int j = min(j0 + q, rows - 1);
          load16<WT>(W + (int64_t)j * cols + c, w[q]);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float xv[V];
#pragma unroll
          for (int i = 0; i < V; ++i) xv[i] = NORM ? in[r * in_ld + c + i] * rs[r] * nw[c + i] : in[r * in_ld + c + i];
#pragma unroll
          for (int q = 0; q < RB; ++q)
#pragma unroll
            for (int i = 0; i < V; ++i) acc[q][r] = fmaf(w[q][i], xv[i], acc[q][r]);
        }
      }
    } else {
      for (int c = lane; c < cols; c += 32) {
#pragma unroll
        for (int q = 0; q < RB; ++q) {
          const int j = min(j0 + q, rows - 1);
          const float wv = to_f(W[(int64_t)j * cols + c]);
#pragma unroll
          for (int r = 0; r < R; ++r)
            acc[q][r] = fmaf(wv, NORM ? in[r * in_ld + c] * rs[r] * nw[c] : in[r * in_ld + c], acc[q][r]);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < RB; ++q)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float v = group_sum<32>(acc[q][r]);
        if (lane == 0 && j0 + q < rows) {
          if (ADD) out[r * out_ld + j0 + q] += v; else out[r * out_ld + j0 + q] = v;
        }
      }
  }
}

// rs[r] = rsqrt(mean(h[r]^2) + eps) for every row, in the calling warp (the sum in rms_rows_w's order)
template <int R>
__device__ __forceinline__ void rms_scales(const float* h, int dm, float eps, float (&rs)[R]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float ss = 0.f;
    for (int c = lane; c < dm; c += 32) { const float v = h[r * dm + c]; ss = fmaf(v, v, ss); }
    ss = group_sum<32>(ss);
    rs[r] = rsqrtf(ss / dm + eps);
  }
}

// u[r][:] = h[r][:] * rsqrt(mean(h^2) + eps) * w   (warp r handles row r), for a block of NWARPS warps
template <int R, int NWARPS>
__device__ void rms_rows_w(const float* h, float* u, int dm, const float* w, float eps) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < R; r += NWARPS) {
    float ss = 0.f;
    for (int c = lane; c < dm; c += 32) { const float v = h[r * dm + c]; ss = fmaf(v, v, ss); }
    ss = group_sum<32>(ss);
    const float rs = rsqrtf(ss / dm + eps);
    for (int c = lane; c < dm; c += 32) u[r * dm + c] = h[r * dm + c] * rs * w[c];
  }
}

template <typename WT, int R, bool ADD>
__device__ __forceinline__ void gemv_smem(const WT* __restrict__ W, int rows, int cols, const float* in, int in_ld,
                                          float* out, int out_ld) {
  gemv_rows<WT, R, ADD, STEP_WARPS>(W, rows, cols, in, in_ld, out, out_ld);
}

// u[r][:] = h[r][:] * rsqrt(mean(h^2) + eps) * w   (warp r handles row r)
template <int R>
__device__ void rms_rows(const float* h, float* u, int dm, const float* w, float eps) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < R; r += STEP_WARPS) {
    float ss = 0.f;
    for (int c = lane; c < dm; c += 32) { const float v = h[r * dm + c]; ss = fmaf(v, v, ss); }
    ss = group_sum<32>(ss);
    const float rs = rsqrtf(ss / dm + eps);
    for (int c = lane; c < dm; c += 32) u[r * dm + c] = h[r * dm + c] * rs * w[c];
  }
}

// element i of packed weights (WT in little-endian 32-bit words), converted at the point of use
template <typename WT> __device__ __forceinline__ float welem(const uint32_t* w, int i);
template <> __device__ __forceinline__ float welem<float>(const uint32_t* w, int i) { return __uint_as_float(w[i]); }
template <> __device__ __forceinline__ float welem<__nv_bfloat16>(const uint32_t* w, int i) {
  return __uint_as_float((i & 1) ? (w[i >> 1] & 0xffff0000u) : (w[i >> 1] << 16));
}
template <> __device__ __forceinline__ float welem<__half>(const uint32_t* w, int i) {
  return __half2float(__ushort_as_half((unsigned short)((i & 1) ? (w[i >> 1] >> 16) : (w[i >> 1] & 0xffffu))));
}

// The rows' input projection, for a block of NT threads: xin[r][:] = x[b0 + r] (zeros past B), then
// h[r][j] = inp_b[j] + sum_k inp_w[j][k] * xin[r][k] (thread per (r, j), small fan-in); barriers after each.
// Where the rows are 16-byte aligned, a thread's weight row is read in 16-byte words, up to 8 in flight before
// its first FMA; the FMA chain is the same, in the same order, either way (the same bits).
// A caller's mid() runs after the thread's first x element, its first output's bias and the first 8 weight words
// are issued and before any of them is used: it issues its own loads there (cluster2: layer 0's weights) without
// queueing the input projection's behind them. Without mid() the loads stay where they are used (the rows and
// cluster kernels: no registers held across).
struct StepNoMid {
  __device__ void operator()() const {}
};
template <typename WT, int R, int NT, typename Mid = StepNoMid>
__device__ __forceinline__ void input_proj_rows(const StepParams& p, int b0, int B, int dm, float* xin, float* h,
                                                Mid mid = Mid()) {
  const int tid = threadIdx.x, in_dim = p.in_dim;
  const WT* W = reinterpret_cast<const WT*>(p.inp_w);
  const WT* bias = reinterpret_cast<const WT*>(p.inp_b);
  constexpr int E = 16 / (int)sizeof(WT);  // elements per 16-byte word
  const bool vec = in_dim % E == 0 && (reinterpret_cast<uintptr_t>(W) & 15) == 0;
  auto x_at = [&](int i) {
    const int r = i / in_dim, b = b0 + r;
    return b < B ? p.x[(int64_t)b * in_dim + (i - r * in_dim)] : 0.f;
  };
  constexpr bool early = !std::is_same<Mid, StepNoMid>::value;
  // in flight before mid(): the thread's first x element, its first output's bias and first 8 weight words
  const bool first = tid < R * dm;
  const int j0 = tid % dm;
  float x0 = 0.f;
  WT b0w = from_f<WT>(0.f);
  uint4 q0[8];
  if (early) {
    if (tid < R * in_dim) x0 = x_at(tid);
    if (first) b0w = bias[j0];
    if (vec && first) {
#pragma unroll
      for (int c = 0; c < 8; ++c)
        if (c < in_dim / E) q0[c] = __ldg(reinterpret_cast<const uint4*>(W + (int64_t)j0 * in_dim) + c);
    }
    mid();
    if (tid < R * in_dim) xin[tid] = x0;
  }
  for (int i = early ? tid + NT : tid; i < R * in_dim; i += NT) xin[i] = x_at(i);
  __syncthreads();
  const int nch = in_dim / E;
  for (int i = tid; i < R * dm; i += NT) {
    const int r = i / dm, j = i - r * dm;
    const float* xr = xin + r * in_dim;
    const WT* wr = W + (int64_t)j * in_dim;
    float acc = to_f(early && i == tid ? b0w : bias[j]);
    if (vec) {
      for (int c0 = 0; c0 < nch; c0 += 8) {
        uint4 q[8];
        if (early && i == tid && c0 == 0) {
#pragma unroll
          for (int c = 0; c < 8; ++c) q[c] = q0[c];
        } else {
#pragma unroll
          for (int c = 0; c < 8; ++c)
            if (c0 + c < nch) q[c] = __ldg(reinterpret_cast<const uint4*>(wr) + c0 + c);
        }
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          if (c0 + c >= nch) break;
          const uint32_t w4[4] = {q[c].x, q[c].y, q[c].z, q[c].w};
#pragma unroll
          for (int e = 0; e < E; ++e) acc = fmaf(welem<WT>(w4, e), xr[(c0 + c) * E + e], acc);
        }
      }
    } else {
      for (int k = 0; k < in_dim; ++k) acc = fmaf(to_f(wr[k]), xr[k], acc);
    }
    h[i] = acc;
  }
  __syncthreads();
}

template <typename WT, int R, int N, int K>
__global__ void __launch_bounds__(STEP_THREADS) backbone_step_kernel(StepParams p) {
  extern __shared__ float sm[];
  const int dm = p.dm, D = p.D, rk = p.rank, L = p.L, B = p.B;
  const int nx = rk + 2 * N;
  float* h = sm;                 // [R][dm]
  float* u = h + R * dm;         // [R][dm]
  float* xz = u + R * dm;        // [R][2D]   (xi is overwritten by xc)
  float* dbc = xz + R * 2 * D;   // [R][nx]
  float* y = dbc + R * nx;       // [R][D]
  float* xin = y + R * D;        // [R][in_dim]
  const int b0 = blockIdx.x * R;
  const int tid = threadIdx.x;

  input_proj_rows<WT, R, STEP_THREADS>(p, b0, B, dm, xin, h);
  for (int l = 0; l < L; ++l) {
    const StepLayer& ly = p.layer[l];
    rms_rows<R>(h, u, dm, ly.norm_w, p.eps);
    __syncthreads();
    gemv_smem<WT, R, false>(reinterpret_cast<const WT*>(ly.in_w), 2 * D, dm, u, dm, xz, 2 * D);
    __syncthreads();
    // conv step: thread per (r, d)
    for (int i = tid; i < R * D; i += STEP_THREADS) {
      const int r = i / D, d = i - r * D, b = b0 + r;
      if (b >= B) { xz[r * 2 * D + d] = 0.f; continue; }
      const bool st = p.starts ? p.starts[b] : false;
      float* cs = p.conv_state + (((int64_t)l * B + b) * D + d) * (K - 1);
      float win[K];
#pragma unroll
      for (int k = 0; k < K - 1; ++k) win[k] = st ? 0.f : cs[k];
      win[K - 1] = xz[r * 2 * D + d];
      float pre = ly.conv_b[d];
#pragma unroll
      for (int k = 0; k < K; ++k) pre = fmaf(ly.conv_w[d * K + k], win[k], pre);
#pragma unroll
      for (int k = 0; k < K - 1; ++k) cs[k] = win[k + 1];
      xz[r * 2 * D + d] = siluf_(pre);
    }
    __syncthreads();
    // x_proj over xc (the first D entries of each xz row)
    gemv_smem<WT, R, false>(reinterpret_cast<const WT*>(ly.x_w), nx, D, xz, 2 * D, dbc, nx);
    __syncthreads();
    // dt_proj + softplus + scan step + D skip + gate: thread per (r, d)
    {
      const WT* Wdt = reinterpret_cast<const WT*>(ly.dt_w);
      for (int i = tid; i < R * D; i += STEP_THREADS) {
        const int r = i / D, d = i - r * D, b = b0 + r;
        if (b >= B) { y[i] = 0.f; continue; }
        const bool st = p.starts ? p.starts[b] : false;
        float dr = ly.dt_b[d];
        for (int k = 0; k < rk; ++k) dr = fmaf(to_f(Wdt[(int64_t)d * rk + k]), dbc[r * nx + k], dr);
        const float delta = softplusf_(dr);
        const float xc = xz[r * 2 * D + d];
        const float zv = xz[r * 2 * D + D + d];
        float* ss = p.ssm_state + (((int64_t)l * B + b) * D + d) * N;
        const float* Bv = dbc + r * nx + rk;
        const float* Cv = Bv + N;
        float acc = 0.f;
#pragma unroll
        for (int n4 = 0; n4 < N; n4 += 4) {
          float4 s4 = st ? make_float4(0.f, 0.f, 0.f, 0.f) : *reinterpret_cast<const float4*>(ss + n4);
          float sv[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int n = n4 + e;
            const float A = -expf(ly.A_log[d * N + n]);
            sv[e] = fmaf(expf(delta * A), sv[e], delta * xc * Bv[n]);
            acc = fmaf(sv[e], Cv[n], acc);
          }
          *reinterpret_cast<float4*>(ss + n4) = make_float4(sv[0], sv[1], sv[2], sv[3]);
        }
        y[i] = fmaf(ly.Dp[d], xc, acc) * siluf_(zv);
      }
    }
    __syncthreads();
    gemv_smem<WT, R, true>(reinterpret_cast<const WT*>(ly.out_w), dm, D, y, D, h, dm);
    __syncthreads();
  }
  rms_rows<R>(h, u, dm, p.normf_w, p.eps);
  __syncthreads();
  for (int i = tid; i < R * dm; i += STEP_THREADS) {
    const int r = i / dm, b = b0 + r;
    if (b < B) p.out[(int64_t)b * dm + (i - r * dm)] = u[i];
  }
}

inline size_t step_smem_bytes(const StepParams& p, int R) {
  return sizeof(float) * (size_t)R * (2 * p.dm + 2 * p.D + (p.rank + 2 * p.N) + p.D + p.in_dim);
}

template <typename WT, int R, int N>
const char* step_launch_rn(const StepParams& p, cudaStream_t s) {
  if (p.K != 4) return "backbone_step: d_conv must be 4";
  const size_t smem = step_smem_bytes(p, R);
  auto kern = backbone_step_kernel<WT, R, N, 4>;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return cudaGetErrorString(e);
  }
  kern<<<(p.B + R - 1) / R, STEP_THREADS, smem, s>>>(p);
  MRL_LAUNCH_CHECK();
  return nullptr;
}

template <typename WT>
const char* step_launch_t(const StepParams& p, int R, cudaStream_t s) {
  if (R <= 0) R = p.B <= 132 ? 1 : (p.B <= 264 ? 2 : 4);  // (callers pass R > 0 here; see step.cu)
#define MRL_STEP_CASE(RR)                                                     \
  if (R == RR) {                                                              \
    if (p.N == 16) return step_launch_rn<WT, RR, 16>(p, s);                   \
    if (p.N == 8) return step_launch_rn<WT, RR, 8>(p, s);                     \
    return "backbone_step: d_state must be 8 or 16";                          \
  }
  MRL_STEP_CASE(1) MRL_STEP_CASE(2) MRL_STEP_CASE(4) MRL_STEP_CASE(8)
#undef MRL_STEP_CASE
  return "backbone_step: rows_per_block must be 0, 1, 2, 4 or 8";
}

}  // namespace mrl
