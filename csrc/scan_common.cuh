// Selective scan (Mamba-1 S6) with fused softplus(dt + bias), D skip, SiLU(z) gate and per-row resets.
// Thread layout: G = N / 4 consecutive lanes own one (b, d) channel, 4 states each (float4 loads of B and
// C, few shuffles per state); a block holds CPB = 128 / G channels of one row b. (The backward's pair build
// at d_state 16: G = 2 lanes a channel, 8 states each; scan_bwd.cuh.) Time advances in chunks of
// SCAN_TC steps: the block stages a chunk's inputs in shared memory with coalesced loads (the next chunk's
// loads are issued before the current chunk is computed, so memory latency is paid once per chunk), and
// per-(t, channel) terms (softplus, SiLU, sigmoid) are computed once by the staging thread.
//
// Two-level scan over T (parallel over time as well as over channels). The recurrence
// s_t = a_t * (start_t ? 0 : s_{t-1}) + b_t (a_t = exp(dt_t A), b_t = dt_t x_t B_t) is linear, so T is cut
// into nseg segments of seg_len chunks (blockIdx.z), chosen from B * D so that the grid fills the SMs
// (scan_split in scan.cu). A "local" kernel runs every segment from a zero state and stores its end state
// and the product P of its decays (P = 0 once a reset is crossed); the main kernel's block for segment k
// combines the earlier segments' (P, end state) in a fixed order (s = P == 0 ? e : P * s + e: a reset
// still clears inf/NaN) and re-runs its segment from the true entering state. The backward's adjoint
// recurrence (reverse time, lambda_{t-1} = start_t ? 0 : a_t * (lambda_t + C_t g_t)) is linear with the
// same P, and is split the same way. With nseg = 1 no local kernel runs.
//
// The forward stores the state entering every chunk (ckpt); the backward walks its segment's chunks in
// reverse, recomputes each chunk's states from its checkpoint into shared memory, then runs the adjoint
// recurrence. dB/dC (sums over channels) are reduced in the warp (transpose-reduce), then over warps in
// shared memory, then over channel tiles in a fixed order (scan_bwd_reduce), as are dA_log, dD and ddt_bias
// (sums over rows and segments): no float atomics, so results are bit-reproducible for a given shape.
// Where the grid is co-resident, each direction is one cooperative launch with grid barriers between the
// local pass, the main pass and (backward) the reductions; otherwise they are separate launches. The same
// code in the same order either way, so the same bits (coop_fits, set_coop in common.cuh).
// Steps past T in the last chunk are padded (dt = 0 -> decay 1, zero input, zero gradient), so every chunk
// runs one code path.
// This header: the constants, the geometry and the chunk staging that scan_fwd.cuh and scan_bwd.cuh share.
#pragma once
#include <type_traits>
#include <cooperative_groups.h>
#include "common.cuh"

namespace mrl {


constexpr int SCAN_THREADS = 128;
constexpr int SCAN_TC = 16;
constexpr int SCAN_NPT = 4;       // states per thread
// Blocks per SM the kernels are built for (launch bounds: registers; the backward also by shared memory);
// scan_split() sizes the grid with the same numbers. d_state 8 stages twice the channels per block (more
// registers), so its forward targets 3.
constexpr int scan_fwd_minb(int N) { return N == 8 ? 3 : 4; }
constexpr int SCAN_BWD_MINB = 3;
// The backward also has a 4-blocks-per-SM build at d_state 16 (128 registers without spills; its ~54 KB of
// shared memory fits 4 times). It runs where one segment's grid overfills 3 blocks per SM (B * tiles >
// 3 * SMs, e.g. 64 x 128 at d_model 128: 512 blocks, one wave instead of 1.3): there the 3-block build's
// second, partial wave cost more than its extra registers save. Below that the grid is split over T
// (more blocks of shorter segments) and the 167-register build, with more independent work per thread, is
// faster per block (measured: one segment at 4 x 4096, 1.31 ms against 1.85 ms).
constexpr int SCAN_BWD_MINB_WIDE = 4;
// The backward's pair build at d_state 16: 8 states a thread, 2 blocks per SM (scan_bwd.cuh).
constexpr int SCAN_PAIR_NP = 8;
constexpr int SCAN_BWD_MINB_PAIR = 2;

__device__ __forceinline__ float ex2f_(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}

// The staging's gate terms without branches, so that the compiler interleaves a thread's staged elements (ncu,
// thirty-third session: with softplus behind its `> 20` branch and SiLU's IEEE division, each element was a chain
// of branch regions, ~28 % of the forward's and ~24 % of the pair backward's stall samples at 64 x 1024).
// sigmoid by __fdividef: ~2 ulp, no slow path (1 / inf = 0, so a large negative input gives 0, as expf's does).
__device__ __forceinline__ float sigmoid_fast_(float v) { return __fdividef(1.f, 1.f + expf(-v)); }
// An empty asm that the compiler must assume reads and rewrites v: the value is computed on every path instead of
// behind a branch (nvcc otherwise branches around log1pf for each staged element).
__device__ __forceinline__ float keep_(float v) {
  asm volatile("" : "+f"(v));
  return v;
}
// softplusf_ (torch's threshold 20) with its bits, computed for every element: log1pf(expf(min(v, 20))), and v
// above the threshold (min written as a select that keeps a NaN a NaN).
__device__ __forceinline__ float softplus_nb_(float v) {
  const float l = keep_(log1pf(expf(v > 20.f ? 20.f : v)));
  return v > 20.f ? v : l;
}

// Does the backward run its reductions inside its cooperative launch? Only where they are at most ~4 dB / dC sums per
// thread of its grid (grid_threads): beyond that the reduction kernel's own, larger grid is faster (the cooperative
// grid walks them serially; at 16 x 2048 that is ~21 per thread). scan_bwd_tn and scan_bwd_config share it.
__host__ __device__ __forceinline__ bool scan_bwd_small_reduce(int64_t B, int64_t T, int N, int64_t grid_threads) {
  return B * T * 2 * N <= 4 * grid_threads;
}

// NP: states per thread (SCAN_NPT; the backward's pair build takes 8 at d_state 16, scan_bwd.cuh).
template <int N, int NP = SCAN_NPT>
struct ScanGeom {
  static constexpr int G = N / NP;                             // lanes per channel
  static constexpr int CPB = SCAN_THREADS / G;                 // channels per block
  static constexpr int EA = SCAN_TC * CPB / SCAN_THREADS;      // staged [TC][CPB] elements per thread
  static constexpr int EB = SCAN_TC * N / SCAN_THREADS;        // staged [TC][N] elements per thread (per array)
  static constexpr int NW = SCAN_THREADS / 32;
  static_assert(EA >= 1 && EB >= 1, "scan geometry");
};

// The chunks [cb, ce) of segment k (blockIdx.z) of a scan of T steps.
struct ScanSeg {
  int nC, cb, ce;
  __device__ __forceinline__ ScanSeg(int T, int seg_len, int k) {
    nC = (T + SCAN_TC - 1) / SCAN_TC;
    cb = k * seg_len;
    ce = min(nC, cb + seg_len);
  }
};

// [B][nseg][D][N] float arrays of per-segment results (end state / adjoint, decay product): one float4.
__device__ __forceinline__ float4 seg_ld(const float* base, int b, int nseg, int k, int D, int d, int N, int gi) {
  return *reinterpret_cast<const float4*>(base + ((((int64_t)b * nseg + k) * D + d) * N + gi * SCAN_NPT));
}
__device__ __forceinline__ void seg_st(float* base, int b, int nseg, int k, int D, int d, int N, int gi, float4 v) {
  *reinterpret_cast<float4*>(base + ((((int64_t)b * nseg + k) * D + d) * N + gi * SCAN_NPT)) = v;
}
// A float4 into 4 consecutive floats of a register array (v points into it at a compile-time offset).
__device__ __forceinline__ void put4(float* v, float4 w) { v[0] = w.x; v[1] = w.y; v[2] = w.z; v[3] = w.w; }
// NP consecutive floats of shared memory (16-byte aligned) into registers, as NP / 4 float4 loads.
template <int NP>
__device__ __forceinline__ void ld_states(float (&v)[NP], const float* src) {
#pragma unroll
  for (int h = 0; h < NP / SCAN_NPT; ++h) put4(&v[4 * h], reinterpret_cast<const float4*>(src)[h]);
}
// s <- P * s + e, where P == 0 (a reset inside the segment) selects e, so a reset clears inf/NaN.
__device__ __forceinline__ void seg_combine(float (&s)[SCAN_NPT], float4 P, float4 e) {
  const float p4[SCAN_NPT] = {P.x, P.y, P.z, P.w}, e4[SCAN_NPT] = {e.x, e.y, e.z, e.w};
#pragma unroll
  for (int j = 0; j < SCAN_NPT; ++j) s[j] = p4[j] == 0.f ? e4[j] : fmaf(p4[j], s[j], e4[j]);
}

// Does a chunk have an episode start? `st` is the chunk's SCAN_TC staged flags, 16-byte aligned, read as words.
// A block scans one batch row, so the answer is the same for every thread: a chunk without a start (the common
// case) runs its loop specialised on "no start" (HasStart = false), without the reset selects. A select whose
// flag is false passes its value through, so both loops give the same bits.
__device__ __forceinline__ bool chunk_has_start(const bool* st) {
  static_assert(SCAN_TC % 16 == 0, "chunk_has_start reads the flags 16 at a time");
  unsigned any = 0;
#pragma unroll
  for (int k = 0; k < SCAN_TC / 16; ++k) {
    const uint4 w = reinterpret_cast<const uint4*>(st)[k];
    any |= w.x | w.y | w.z | w.w;
  }
  return any != 0;
}
template <bool V>
using HasStart = std::integral_constant<bool, V>;
// f(HasStart<true>{}) where `has` (chunk_has_start), else f(HasStart<false>{}): f is a chunk's step loop, and
// reads a step's flag as `decltype(has_start)::value && st[i]`.
template <typename F>
__device__ __forceinline__ void by_chunk_start(bool has, F&& f) {
  if (has) f(HasStart<true>{}); else f(HasStart<false>{});
}

// A staged element as float: the loaded value, or 0 for a step past T (ok = false): a padded step has decay 1,
// no input and a zero gradient. Selecting after the conversion gives the bits of converting a zero.
template <typename T>
__device__ __forceinline__ float pad_f(T v, bool ok) { return ok ? to_f(v) : 0.f; }

// softplus's bias dt_bias[d] of this thread's staged channel: the staging threads' elements tid + k * SCAN_THREADS
// all fall in channel tid % CPB (CPB divides SCAN_THREADS), so one load serves a chunk's elements (clamped like the
// loads' columns: a padding channel past D stages channel D - 1).
template <int CPB>
__device__ __forceinline__ float scan_dt_bias(const ScanFwdParams& p, int d0, int tid) {
  static_assert(SCAN_THREADS % CPB == 0, "scan geometry");
  return p.dt_bias[min(d0 + tid % CPB, p.D - 1)];
}

// Which arrays a chunk load reads (dt and the episode starts always).
enum : int { SL_X = 1, SL_Z = 2, SL_G = 4, SL_B = 8, SL_C = 16 };

// The inputs of one chunk of SCAN_TC steps of one block (CPB channels of row b), held in registers. Loads are
// coalesced (consecutive threads read consecutive channels / states) and issued for chunk c+1 before chunk c
// is computed, so memory latency is paid once per chunk. M (SL_* bits) selects the arrays; GRAD (SL_G) is the
// output gradient (backward). Steps past T are zeroed when staged (pad_f).
// The registers hold the raw activation dtype T, as loaded; commit() converts them (pad_f) when it stages the
// chunk in shared memory, and zeroes the steps past T there. Any use of a loaded register right behind the
// prefetch makes the warp wait for the next chunk's memory latency before it computes the current chunk:
// converting at load time (as v2/v3 did) ran the bf16 scan at 2.0x the f32 one (4 x 4096: 4.6 ms vs 2.3 ms
// forward, 8.6 vs 4.5 ms backward), and zeroing the padded steps at load time (a select on every loaded value,
// up to the twenty-second session) held the backward's warps on those selects for ~5 % of its samples (ncu
// source counters at 64 x 1024 bf16).
template <typename T, int N, int M, int NP = SCAN_NPT>
struct ScanChunkRegs {
  static constexpr int EA = ScanGeom<N, NP>::EA, EB = ScanGeom<N, NP>::EB, CPB = ScanGeom<N, NP>::CPB;
  T x[(M & SL_X) ? EA : 1], dt[EA], z[(M & SL_Z) ? EA : 1], g[(M & SL_G) ? EA : 1];
  T Bv[(M & SL_B) ? EB : 1], Cv[(M & SL_C) ? EB : 1];
  bool st = false;  // held by threads tid < SCAN_TC: the episode start of step t0 + tid
  // Element k of the [TC][CPB] arrays is step tid / CPB + k * (SCAN_THREADS / CPB) of channel tid % CPB (CPB
  // divides SCAN_THREADS); of the [TC][N] arrays, step (tid + k * SCAN_THREADS) / N, state tid % N: the element
  // (tid + k * SCAN_THREADS) of the staged [TC][CPB] / [TC][N] array. Steps past T read step T - 1 (a valid
  // address: the loads are unconditional, no branch around each one); commit() zeroes them (pad_f).
  __device__ __forceinline__ void load(const ScanFwdParams& p, const void* dout, int64_t g_sb, int64_t g_st,
                                       int b, int d0, int c, int tid) {
    static_assert(SCAN_THREADS % CPB == 0 && SCAN_THREADS % N == 0, "scan geometry");
    constexpr int DI = SCAN_THREADS / CPB, DN = SCAN_THREADS / N;
    const int t0 = c * SCAN_TC, T_ = p.T;
    const int dd = min(d0 + tid % CPB, p.D - 1);
    // element (t, column) of an array with row stride sb and step stride st; tc is t clamped into [0, T)
    auto at = [&](const void* base, int64_t sb, int64_t st, int col, int64_t tc) {
      return __ldg(reinterpret_cast<const T*>(base) + (b * sb + col + tc * st));
    };
#pragma unroll
    for (int k = 0; k < EA; ++k) {
      const int t = t0 + tid / CPB + k * DI;
      const int64_t tc = t < T_ ? t : T_ - 1;
      if constexpr ((M & SL_X) != 0) x[k] = at(p.x, p.x_sb, p.x_st, dd, tc);
      dt[k] = at(p.dt, p.dt_sb, p.dt_st, dd, tc);
      if constexpr ((M & SL_Z) != 0) z[k] = at(p.z, p.z_sb, p.z_st, dd, tc);
      if constexpr ((M & SL_G) != 0) g[k] = at(dout, g_sb, g_st, dd, tc);
    }
    const int nn = tid % N;
#pragma unroll
    for (int k = 0; k < EB; ++k) {
      const int t = t0 + tid / N + k * DN;
      const int64_t tc = t < T_ ? t : T_ - 1;
      if constexpr ((M & SL_B) != 0) Bv[k] = at(p.Bm, p.B_sb, p.B_st, nn, tc);
      if constexpr ((M & SL_C) != 0) Cv[k] = at(p.Cm, p.C_sb, p.C_st, nn, tc);
    }
    st = false;
    if (tid < SCAN_TC && p.starts && t0 + tid < T_) st = p.starts[(int64_t)b * T_ + t0 + tid];
  }
};

}  // namespace mrl
