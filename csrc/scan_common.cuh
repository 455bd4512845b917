// Selective scan (Mamba-1 S6) with fused softplus(dt + bias), D skip, SiLU(z) gate and per-row resets.
// Thread layout: G = N / 4 consecutive lanes own one (b, d) channel, 4 states each (float4 loads of B and
// C, few shuffles per state); a block holds CPB = 128 / G channels of one row b. Time advances in chunks of
// SCAN_TC steps: the block stages a chunk's inputs in shared memory with coalesced loads (the next chunk's
// loads are issued before the current chunk is computed, so memory latency is paid once per chunk), and
// per-(t, channel) terms (softplus, SiLU, sigmoid) are computed once by the staging thread.
// The forward stores the state entering every chunk (ckpt); the backward walks the chunks in reverse,
// recomputes the chunk's states into registers from its checkpoint, then runs the adjoint recurrence.
// dB/dC (sums over channels) are reduced in the warp (transpose-reduce), then over warps in shared memory,
// then over channel tiles by a second, fixed-order kernel, as are dA_log, dD and ddt_bias (sums over
// rows): no float atomics, so results are bit-reproducible.
// This header: the constants, the geometry and the chunk staging that scan_fwd.cuh and scan_bwd.cuh share.
#pragma once
#include "common.cuh"

namespace mrl {

constexpr int SCAN_THREADS = 128;
constexpr int SCAN_TC = 16;
constexpr int SCAN_NPT = 4;  // states per thread

__device__ __forceinline__ float ex2f_(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}

template <int N>
struct ScanGeom {
  static constexpr int G = N / SCAN_NPT;                       // lanes per channel
  static constexpr int CPB = SCAN_THREADS / G;                 // channels per block
  static constexpr int EA = SCAN_TC * CPB / SCAN_THREADS;      // staged [TC][CPB] elements per thread
  static constexpr int EB = SCAN_TC * N / SCAN_THREADS;        // staged [TC][N] elements per thread (per array)
  static constexpr int NW = SCAN_THREADS / 32;
  static_assert(EA >= 1 && EB >= 1, "scan geometry");
};

template <typename T>
__device__ __forceinline__ T ldraw(const void* base, int64_t off) {
  return __ldg(reinterpret_cast<const T*>(base) + off);
}

// The inputs of one chunk of SCAN_TC steps of one block (CPB channels of row b), held in registers. Loads are
// coalesced (consecutive threads read consecutive channels / states) and issued for chunk c+1 before chunk c
// is computed, so memory latency is paid once per chunk. GRAD adds the output gradient (backward).
// The registers hold the raw activation dtype T; commit() converts (to_f) when it stages the chunk in shared
// memory. Converting at load time (as v2/v3 did) put a cvt that waits on each bf16/f16 load right behind
// the prefetch, so the warp stalled on the next chunk's memory latency before computing the current chunk:
// the bf16 scan ran 2.0x the f32 one (4 x 4096: 4.6 ms vs 2.3 ms forward, 8.6 vs 4.5 ms backward).
template <typename T, int N, bool GRAD>
struct ScanChunkRegs {
  static constexpr int EA = ScanGeom<N>::EA, EB = ScanGeom<N>::EB, CPB = ScanGeom<N>::CPB;
  T x[EA], dt[EA], z[EA], g[GRAD ? EA : 1], Bv[EB], Cv[EB];
  bool st = false;  // held by threads tid < SCAN_TC: the episode start of step t0 + tid
  __device__ __forceinline__ void load(const ScanFwdParams& p, const void* dout, int64_t g_sb, int64_t g_st,
                                       int b, int d0, int c, int tid) {
    const int t0 = c * SCAN_TC, T_ = p.T, D = p.D;
    const T zero = from_f<T>(0.f);
#pragma unroll
    for (int k = 0; k < EA; ++k) {
      const int e = tid + k * SCAN_THREADS, i = e / CPB, ch = e % CPB;
      const int t = t0 + i, dd = min(d0 + ch, D - 1);
      const bool ok = t < T_;
      x[k] = ok ? ldraw<T>(p.x, b * p.x_sb + (int64_t)t * p.x_st + dd) : zero;
      dt[k] = ok ? ldraw<T>(p.dt, b * p.dt_sb + (int64_t)t * p.dt_st + dd) : zero;
      z[k] = ok ? ldraw<T>(p.z, b * p.z_sb + (int64_t)t * p.z_st + dd) : zero;
      if constexpr (GRAD) g[k] = ok ? ldraw<T>(dout, b * g_sb + (int64_t)t * g_st + dd) : zero;
    }
#pragma unroll
    for (int k = 0; k < EB; ++k) {
      const int e = tid + k * SCAN_THREADS, i = e / N, nn = e % N, t = t0 + i;
      const bool ok = t < T_;
      Bv[k] = ok ? ldraw<T>(p.Bm, b * p.B_sb + (int64_t)t * p.B_st + nn) : zero;
      Cv[k] = ok ? ldraw<T>(p.Cm, b * p.C_sb + (int64_t)t * p.C_st + nn) : zero;
    }
    if (tid < SCAN_TC) st = (p.starts && t0 + tid < T_) ? p.starts[(int64_t)b * T_ + t0 + tid] : false;
  }
};

}  // namespace mrl
