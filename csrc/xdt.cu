// x_proj and dt_proj of one Mamba layer as one kernel each way (the two small GEMMs between the conv and
// the scan). Forward: dbc = xc @ Wx^T, dt = dbc[:, :R] @ Wdt^T; backward: ddbc = [ddt @ Wdt, dB, dC],
// dxc += ddbc @ Wx. Through torch these are 2 (forward) and 3 (backward: mm, cat, addmm) launches per
// layer, plus cuBLAS's split-K reduce for the skinny ones in float32. Block = XDT_RB rows; float32
// accumulation, each output rounded once to the tensors' dtype (dt from the rounded dbc, as two GEMMs do).
#include "common.cuh"
#include "conv.cuh"

namespace mrl {

constexpr int XDT_RB = 8, XDT_THREADS = 256;  // rows per block (one warp per row in phase 1)
constexpr size_t XDT_SMEM_MAX = 160 * 1024;

// Shared memory of both kernels: x_proj.weight [E][D] as float (staged once per block: phase 1 reads it
// E/8 times per row, from shared memory instead of one dependent global round trip per 4 outputs, which
// made the first version latency-bound at ~25 us per launch), XDT_RB rows of [D] and of [E].
static size_t xdt_smem(int E, int D) { return sizeof(float) * ((size_t)E * D + (size_t)XDT_RB * D + (size_t)XDT_RB * E); }
int xdt_smem_ok(int E, int D) { return xdt_smem(E, D) <= XDT_SMEM_MAX ? 1 : 0; }

// dst[i] = src[i] as float for i < nvalid, 0 for nvalid <= i < n. A thread's loads are all issued before the
// first conversion and shared store (16-byte loads where src, dst and n allow): loading 8 scalars, storing
// them, then loading the next 8 paid one L2 round trip per 8 elements, 5 for x_proj.weight at d_inner 256.
template <typename T>
__device__ __forceinline__ void xdt_stage(float* dst, const T* __restrict__ src, int n, int nvalid) {
  constexpr int V = 16 / sizeof(T), U = 8;  // elements per 16-byte load, loads in flight per round
  if (nvalid == n && n % V == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    const int nv = n / V;
    const uint4* __restrict__ sv = reinterpret_cast<const uint4*>(src);
    for (int i0 = threadIdx.x; i0 < nv; i0 += U * XDT_THREADS) {
      uint4 r[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (i0 + u * XDT_THREADS < nv) r[u] = __ldg(sv + i0 + u * XDT_THREADS);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * XDT_THREADS;
        if (i < nv) {
          T e[V];
          memcpy(e, &r[u], 16);
#pragma unroll
          for (int j = 0; j < V; j += 4)
            *reinterpret_cast<float4*>(dst + (size_t)i * V + j) =
                make_float4(to_f(e[j]), to_f(e[j + 1]), to_f(e[j + 2]), to_f(e[j + 3]));
        }
      }
    }
    return;
  }
  for (int i0 = threadIdx.x; i0 < n; i0 += U * XDT_THREADS) {
    T r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * XDT_THREADS;
      if (i < nvalid) r[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * XDT_THREADS;
      if (i < n) dst[i] = i < nvalid ? to_f(r[u]) : 0.f;
    }
  }
}

// The conv prologue of xdt_fwd_kernel (conv_on): rows r0 .. r0 + nrow - 1 of xc = SiLU(causal_conv1d(x)) written
// to c.out and, as the rounded values, to xs [XDT_RB][D] (rows past nrow zero). Thread per channel; the same
// taps, validity rule and fmaf order as conv_fwd_kernel, so the same bits. A block whose rows lie in one sequence
// loads one register window of XDT_RB + K - 1 inputs per channel; one whose rows cross a sequence boundary loads
// each row's K taps. The block holding t = T - 1 of a sequence writes its final window.
template <typename T, int K>
__device__ __forceinline__ void xdt_conv_rows(const ConvFwdParams& c, float* xs, int64_t r0, int nrow) {
  constexpr int W = XDT_RB + K - 1;
  const int T_ = c.T, D = c.D;
  const T* __restrict__ x = reinterpret_cast<const T*>(c.x);
  T* out = reinterpret_cast<T*>(c.out);
  const int64_t b0 = r0 / T_;
  const int t0 = (int)(r0 - b0 * T_);
  const bool one_seq = t0 + nrow <= T_;
  for (int d = threadIdx.x; d < D; d += XDT_THREADS) {
    float w[K];
#pragma unroll
    for (int k = 0; k < K; ++k) w[k] = c.w[d * K + k];
    const float bias = c.bias[d];
    if (one_seq) {
      const T* __restrict__ xb = x + b0 * c.x_sb + d;
      const float* initbd = c.init ? c.init + (b0 * D + d) * (K - 1) : nullptr;
      const bool* sb = c.starts ? c.starts + b0 * T_ : nullptr;
      float xv[W];
      bool sv[W];
      {
        T xr[W];
        load_window<T, W>(xr, xv, xb, c.x_st, initbd, t0 - (K - 1), T_, K);
      }
      load_starts<W>(sv, sb, t0 - (K - 1), T_);
#pragma unroll
      for (int i = 0; i < XDT_RB; ++i) {
        float v = 0.f;
        if (i < nrow) {
          float pre = bias;
          bool valid = true;
#pragma unroll
          for (int k = K - 1; k >= 0; --k) {
            if (valid) pre = fmaf(w[k], xv[i + k], pre);
            if (sv[i + k]) valid = false;
          }
          const T o = from_f<T>(siluf_(pre));
          out[(r0 + i) * D + d] = o;
          v = to_f(o);
        }
        xs[i * D + d] = v;
      }
    } else {
      for (int i = 0; i < XDT_RB; ++i) {
        float v = 0.f;
        if (i < nrow) {
          const int64_t r = r0 + i, b = r / T_;
          const int t = (int)(r - b * T_);
          const T* __restrict__ xb = x + b * c.x_sb + d;
          const float* initbd = c.init ? c.init + (b * D + d) * (K - 1) : nullptr;
          const bool* sb = c.starts ? c.starts + b * T_ : nullptr;
          float pre = bias;
          bool valid = true;
#pragma unroll
          for (int k = K - 1; k >= 0; --k) {
            const int tau = t - (K - 1) + k;
            if (valid) {
              const float xk = tau < 0 ? (initbd ? initbd[K - 1 + tau] : 0.f) : to_f(xb[(int64_t)tau * c.x_st]);
              pre = fmaf(w[k], xk, pre);
            }
            if (sb && tau >= 0 && sb[tau]) valid = false;
          }
          const T o = from_f<T>(siluf_(pre));
          out[r * D + d] = o;
          v = to_f(o);
        }
        xs[i * D + d] = v;
      }
    }
    for (int i = 0; i < nrow; ++i) {  // final windows: as conv_fwd_kernel's chunk holding T - 1
      const int64_t r = r0 + i, b = r / T_;
      if (r - b * T_ != T_ - 1) continue;
      const T* __restrict__ xb = x + b * c.x_sb + d;
      const float* initbd = c.init ? c.init + (b * D + d) * (K - 1) : nullptr;
      const bool* sb = c.starts ? c.starts + b * T_ : nullptr;
      float* fb = c.final_state + (b * D + d) * (K - 1);
      bool valid = true;
      for (int j = K - 2; j >= 0; --j) {
        const int tau = T_ - K + 1 + j;
        const float v = tau < 0 ? (initbd ? initbd[K - 1 + tau] : 0.f) : to_f(xb[(int64_t)tau * c.x_st]);
        fb[j] = valid ? v : 0.f;
        if (tau >= 0 && sb && sb[tau]) valid = false;
      }
    }
  }
}

// K > 0: xc computed by the conv prologue (xdt_conv_rows<T, K>); K == 0: xc read.
template <typename T, int K>
__global__ void __launch_bounds__(XDT_THREADS) xdt_fwd_kernel(XdtFwdParams p) {
  extern __shared__ float sm[];
  const int D = p.D, E = p.E, R = p.R;
  float* ws = sm;                        // [E][D]
  float* xs = ws + (size_t)E * D;        // [XDT_RB][D]
  float* dbs = xs + (size_t)XDT_RB * D;  // [XDT_RB][E]: the rounded dbc rows
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t r0 = (int64_t)blockIdx.x * XDT_RB;
  const T* __restrict__ xc = reinterpret_cast<const T*>(p.xc);
  const T* __restrict__ wdt = reinterpret_cast<const T*>(p.wdt);
  T* dbc = reinterpret_cast<T*>(p.dbc);
  T* dt = reinterpret_cast<T*>(p.dt);
  xdt_stage<T>(ws, reinterpret_cast<const T*>(p.wx), E * D, E * D);
  {
    const int nrow = (int)(p.rows - r0 < XDT_RB ? p.rows - r0 : XDT_RB);
    if constexpr (K > 0)
      xdt_conv_rows<T, K>(p.conv, xs, r0, nrow);
    else
      xdt_stage<T>(xs, xc + r0 * D, XDT_RB * D, nrow * D);
  }
  __syncthreads();
  // phase 1: warp `warp` computes row r0 + warp of dbc, 8 outputs at a time (independent accumulators), their sums
  // over the warp by one transposed butterfly (transpose_reduce: 9 shuffles for the 8 instead of 40; the same tree
  // of adds as 8 group_sum<32>, so the same bits)
  {
    const int64_t row = r0 + warp;
    const float* xr = xs + warp * D;
    for (int e0 = 0; e0 < E; e0 += 8) {
      float acc[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] = 0.f;
      for (int d = lane; d < D; d += 32) {
        const float x = xr[d];
#pragma unroll
        for (int q = 0; q < 8; ++q)
          if (e0 + q < E) acc[q] = fmaf(x, ws[(e0 + q) * D + d], acc[q]);
      }
      int q;
      bool dup;
      const float v = transpose_reduce<1, 8>(acc, lane, q, dup);  // output e0 + q, in lanes 4q .. 4q + 3
      if (!dup && e0 + q < E) {
        const T vr = from_f<T>(v);
        dbs[warp * E + e0 + q] = to_f(vr);
        if (row < p.rows) dbc[row * E + e0 + q] = vr;
      }
    }
  }
  __syncthreads();
  // phase 2: thread d computes dt[r, d] for the block's rows
  for (int d = threadIdx.x; d < D; d += XDT_THREADS) {
    float acc[XDT_RB];
#pragma unroll
    for (int r = 0; r < XDT_RB; ++r) acc[r] = 0.f;
    for (int k = 0; k < R; ++k) {
      const float w = to_f(wdt[(int64_t)d * R + k]);
#pragma unroll
      for (int r = 0; r < XDT_RB; ++r) acc[r] = fmaf(dbs[r * E + k], w, acc[r]);
    }
#pragma unroll
    for (int r = 0; r < XDT_RB; ++r)
      if (r0 + r < p.rows) dt[(r0 + r) * D + d] = from_f<T>(acc[r]);
  }
}

template <typename T>
__global__ void __launch_bounds__(XDT_THREADS) xdt_bwd_kernel(XdtBwdParams p) {
  extern __shared__ float sm[];
  const int D = p.D, E = p.E, R = p.R, N = p.N;
  float* ws = sm;                                       // [E][D]
  float* ds = ws + (size_t)E * D + (size_t)XDT_RB * D;  // [XDT_RB][E]: the rounded ddbc rows
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t r0 = (int64_t)blockIdx.x * XDT_RB;
  const T* __restrict__ ddt = reinterpret_cast<const T*>(p.ddt);
  const T* __restrict__ dB = reinterpret_cast<const T*>(p.dB);
  const T* __restrict__ dC = reinterpret_cast<const T*>(p.dC);
  const T* __restrict__ wdt = reinterpret_cast<const T*>(p.wdt);
  T* ddbc = reinterpret_cast<T*>(p.ddbc);
  T* dxc = reinterpret_cast<T*>(p.dxc);
  xdt_stage<T>(ws, reinterpret_cast<const T*>(p.wx), E * D, E * D);  // for phase 2
  {  // phase 1: warp `warp` computes ddbc row r0 + warp: R dots over D (8 at a time), then copies dB, dC
    const int64_t row = r0 + warp;
    const bool rok = row < p.rows;
    const T* gr = ddt + row * D;
    for (int k0 = 0; k0 < R; k0 += 8) {
      float acc[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] = 0.f;
      if (rok) {
        for (int d = lane; d < D; d += 32) {
          const float g = to_f(gr[d]);
          const T* wr = wdt + (int64_t)d * R + k0;
#pragma unroll
          for (int q = 0; q < 8; ++q)
            if (k0 + q < R) acc[q] = fmaf(g, to_f(wr[q]), acc[q]);
        }
      }
      int q;
      bool dup;
      const float v = transpose_reduce<1, 8>(acc, lane, q, dup);  // output k0 + q, in lanes 4q .. 4q + 3
      if (!dup && k0 + q < R) {
        const T vr = from_f<T>(v);
        ds[warp * E + k0 + q] = to_f(vr);
        if (rok) ddbc[row * E + k0 + q] = vr;
      }
    }
    for (int i = lane; i < 2 * N; i += 32) {
      T v = from_f<T>(0.f);
      if (rok) v = i < N ? dB[row * N + i] : dC[row * N + (i - N)];
      ds[warp * E + R + i] = to_f(v);
      if (rok) ddbc[row * E + R + i] = v;
    }
  }
  __syncthreads();
  // phase 2: thread d adds ddbc[r, :] @ Wx[:, d] into dxc[r, d]
  for (int d = threadIdx.x; d < D; d += XDT_THREADS) {
    float acc[XDT_RB], old[XDT_RB];
#pragma unroll
    for (int r = 0; r < XDT_RB; ++r) {
      acc[r] = 0.f;
      old[r] = r0 + r < p.rows ? to_f(dxc[(r0 + r) * D + d]) : 0.f;  // issued before the FMAs
    }
    for (int e = 0; e < E; ++e) {
      const float w = ws[e * D + d];
#pragma unroll
      for (int r = 0; r < XDT_RB; ++r) acc[r] = fmaf(ds[r * E + e], w, acc[r]);
    }
#pragma unroll
    for (int r = 0; r < XDT_RB; ++r) {
      const int64_t row = r0 + r;
      if (row < p.rows) dxc[row * D + d] = from_f<T>(old[r] + acc[r]);
    }
  }
}

template <typename K>
static const char* xdt_smem_attr(K kern, size_t smem) {
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return cudaGetErrorString(e);
  }
  return nullptr;
}

template <typename T, int K>
static const char* xdt_fwd_tk(const XdtFwdParams& p, cudaStream_t s) {
  const unsigned nb = (unsigned)((p.rows + XDT_RB - 1) / XDT_RB);
  const size_t smem = xdt_smem(p.E, p.D);
  if (const char* e = xdt_smem_attr(xdt_fwd_kernel<T, K>, smem)) return e;
  xdt_fwd_kernel<T, K><<<nb, XDT_THREADS, smem, s>>>(p);
  MRL_LAUNCH_CHECK();
  return nullptr;
}
template <typename T>
static const char* xdt_fwd_t(const XdtFwdParams& p, cudaStream_t s) {
  if (!p.conv_on) return xdt_fwd_tk<T, 0>(p, s);
  if (p.conv.D != p.D || (int64_t)p.conv.B * p.conv.T != p.rows) return "xdt: the conv's B * T and D must be rows and D";
  switch (p.conv.K) {
    case 2: return xdt_fwd_tk<T, 2>(p, s);
    case 3: return xdt_fwd_tk<T, 3>(p, s);
    case 4: return xdt_fwd_tk<T, 4>(p, s);
  }
  return "causal_conv1d: d_conv must be 2, 3 or 4";
}
template <typename T>
static const char* xdt_bwd_t(const XdtBwdParams& p, cudaStream_t s) {
  const unsigned nb = (unsigned)((p.rows + XDT_RB - 1) / XDT_RB);
  const size_t smem = xdt_smem(p.E, p.D);
  if (const char* e = xdt_smem_attr(xdt_bwd_kernel<T>, smem)) return e;
  xdt_bwd_kernel<T><<<nb, XDT_THREADS, smem, s>>>(p);
  MRL_LAUNCH_CHECK();
  return nullptr;
}

const char* xdt_fwd(int dtype, const XdtFwdParams& p, cudaStream_t s) {
  if (!xdt_smem_ok(p.E, p.D)) return "xdt: x_proj.weight exceeds the kernel's shared memory";
  if (p.rows < 1) return nullptr;
  switch (dtype) {
    case kF32: return xdt_fwd_t<float>(p, s);
    case kBF16: return xdt_fwd_t<__nv_bfloat16>(p, s);
    case kF16: return xdt_fwd_t<__half>(p, s);
  }
  return "xdt: unsupported dtype";
}
const char* xdt_bwd(int dtype, const XdtBwdParams& p, cudaStream_t s) {
  if (!xdt_smem_ok(p.E, p.D)) return "xdt: x_proj.weight exceeds the kernel's shared memory";
  if (p.rows < 1) return nullptr;
  switch (dtype) {
    case kF32: return xdt_bwd_t<float>(p, s);
    case kBF16: return xdt_bwd_t<__nv_bfloat16>(p, s);
    case kF16: return xdt_bwd_t<__half>(p, s);
  }
  return "xdt: unsupported dtype";
}

}  // namespace mrl
