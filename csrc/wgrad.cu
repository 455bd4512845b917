// Grouped weight-gradient GEMMs of the fused training step: C[M, N] += A^T B for up to WGRAD_MAX_JOBS jobs
// in one launch (every dW of a backward, plus column sums for bias grads), float32 accumulation.
//
// Why: cuBLAS(Lt) picks split-K for these skinny shapes (K = B*T rows, M*N small) and adds a separate
// reduce kernel per GEMM in float32: 2 launches per weight. Here each 64 x 64 output tile's K range is cut
// into fixed slices (chosen from the shapes only, so the same plan and the same bits every call); a slice's
// partial goes to a workspace and the last slice of the tile to finish sums the partials in slice order and
// adds them into C. One launch, deterministic, no atomics on data.
//
// Work item = one (tile, slice): 64 threads, each an 8 x 8 block of the tile (rows tm*4.. and 32+tm*4..,
// columns likewise, so the shared-memory reads of a warp are 4 / 8 distinct float4s: one wavefront each),
// K steps of 16 rows, double-buffered in shared memory, the next step's global loads in flight during the
// FMAs. An operand whose rows allow it is read with 16-byte loads (4 float32 or 8 bf16 / f16 per load);
// anything else (odd widths, row strides or base addresses) element by element. benchmarks/NOTES.md has the
// profile that chose this (the 4 x 4 / 256-thread version it replaced issued 2 instructions of address and
// load code per FMA and waited on shared memory).
//
// bf16 / f16 jobs whose two operands allow 16-byte row loads run on tensor cores instead (same item, same
// 64 threads, same partial / last-slice protocol): K steps of 32 rows copied global -> shared memory with
// cp.async, three stages in flight, fragments by ldmatrix.trans (the operands are K-major), mma.sync m16n8k16
// with float32 accumulation; each of the 2 warps owns 32 rows x 64 columns of the tile. The products of two
// 16-bit values are exact in float32 either way; the sums' order (and so the rounding) differs from the FFMA
// path's. The launch's dynamic shared memory is the largest staging its jobs need (16 KB FFMA, 27 KB tensor cores).
//
// Bias gradients (b = ones) are column sums: a thread per column, one load and add per element (16 rows in
// flight), at most 16 K slices. On the FFMA tiles they cost a full 64 x 64 tile of FMAs per 64 sums and, being
// the launch's last items, ran at its tail alone (benchmarks/NOTES.md: the f32 launch at 1024 rows 61 -> 51 µs).
#include "common.cuh"

#include <algorithm>

namespace mrl {

constexpr int WG_BM = 64, WG_BN = 64, WG_BK = 16, WG_THREADS = 64;
constexpr int WG_TILE = WG_BM * WG_BN;
constexpr int WG_PER = WG_BK * WG_BM / WG_THREADS;  // operand elements per thread per K step (16)
// how a job's operand is read (wgrad_plan): element by element, 16-byte loads of 4 float32 or of 8 bf16 / f16,
// or the all-ones column of a bias gradient (b == nullptr: such a job takes the column-sum path)
enum WgMode : int { kWgScalar = 0, kWgVec32 = 1, kWgVec16 = 2, kWgOnes = 3 };
// which code computes a job's items (WGradJob::path, set by wgrad_plan)
enum WgPath : int { kWgFfma = 0, kWgMma = 1, kWgColsum = 2 };

__device__ __forceinline__ float wg_ld(const void* p, int64_t i, int dt) {
  if (dt == kBF16) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
  if (dt == kF16) return __half2float(reinterpret_cast<const __half*>(p)[i]);
  return reinterpret_cast<const float*>(p)[i];
}

__device__ __forceinline__ void wg_cvt8(float* r, uint4 u, int dt) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (dt == kBF16) {
      const __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&w[i]);
      const float2 f = __bfloat1622float2(h);
      r[2 * i] = f.x; r[2 * i + 1] = f.y;
    } else {
      const __half2 h = *reinterpret_cast<const __half2*>(&w[i]);
      const float2 f = __half22float2(h);
      r[2 * i] = f.x; r[2 * i + 1] = f.y;
    }
  }
}

// One operand's K step: rows [k0, k0 + 16) ∩ [.., ke), columns [c0, c0 + 64) ∩ [.., ncol), as float32 in r
// (zeros outside). The element -> (row, column) map depends on the mode; wg_store writes it back the same way.
__device__ __forceinline__ void wg_load(float (&r)[WG_PER], const void* p, int dt, int mode, int64_t ld, int64_t k0,
                                        int64_t ke, int c0, int ncol, int t) {
  if (mode == kWgVec32) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int kk = i * 4 + (t >> 4), c = (t & 15) * 4;
      const int64_t k = k0 + kk;
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (k < ke && c0 + c < ncol) v = __ldg(reinterpret_cast<const float4*>(reinterpret_cast<const float*>(p) + k * ld + c0 + c));
      r[4 * i] = v.x; r[4 * i + 1] = v.y; r[4 * i + 2] = v.z; r[4 * i + 3] = v.w;
    }
  } else if (mode == kWgVec16) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int e = i * WG_THREADS + t, kk = e >> 3, c = (e & 7) * 8;
      const int64_t k = k0 + kk;
      uint4 u = make_uint4(0u, 0u, 0u, 0u);
      if (k < ke && c0 + c < ncol)
        u = __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(p) + k * ld + c0 + c));
      wg_cvt8(r + 8 * i, u, dt);
    }
  } else {
#pragma unroll
    for (int i = 0; i < WG_PER; ++i) {
      const int e = i * WG_THREADS + t, kk = e >> 6, c = e & 63;
      const int64_t k = k0 + kk;
      const bool in = k < ke && c0 + c < ncol;
      r[i] = in ? wg_ld(p, k * ld + c0 + c, dt) : 0.f;  // (ones columns take the column-sum path, not this one)
    }
  }
}

__device__ __forceinline__ void wg_store(float (*S)[WG_BM], const float (&r)[WG_PER], int mode, int t) {
  if (mode == kWgVec32) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      *reinterpret_cast<float4*>(&S[i * 4 + (t >> 4)][(t & 15) * 4]) = make_float4(r[4 * i], r[4 * i + 1], r[4 * i + 2], r[4 * i + 3]);
  } else if (mode == kWgVec16) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int e = i * WG_THREADS + t, kk = e >> 3, c = (e & 7) * 8;
      *reinterpret_cast<float4*>(&S[kk][c]) = make_float4(r[8 * i], r[8 * i + 1], r[8 * i + 2], r[8 * i + 3]);
      *reinterpret_cast<float4*>(&S[kk][c + 4]) = make_float4(r[8 * i + 4], r[8 * i + 5], r[8 * i + 6], r[8 * i + 7]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < WG_PER; ++i) {
      const int e = i * WG_THREADS + t;
      S[e >> 6][e & 63] = r[i];
    }
  }
}

// row (or column) of the tile held by a thread's i-th accumulator row (column), i < 8
__device__ __forceinline__ int wg_pos(int q, int i) { return (i < 4 ? 0 : 32) + q * 4 + (i & 3); }

// ---- the tensor-core path (bf16 / f16 jobs) ----
constexpr int WM_BK = 32, WM_STAGES = 3;
constexpr int WM_LD = WG_BM + 8;  // 16-bit elements per staged row: 144 bytes, so ldmatrix's 8 rows hit 8 bank groups
constexpr int WG_SMEM_FFMA = 2 * 2 * WG_BK * WG_BM * (int)sizeof(float);
constexpr int WG_SMEM_MMA = WM_STAGES * 2 * WM_BK * WM_LD * (int)sizeof(uint16_t);

__device__ __forceinline__ void wm_cp16(uint16_t* smem, const uint16_t* gmem, bool in) {
#if __CUDA_ARCH__ >= 800
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(in ? 16 : 0));
#endif
}
__device__ __forceinline__ void wm_commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void wm_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
// four 8 x 8 16-bit matrices, each stored as 8 rows of 8 (rows = K), delivered transposed (fragments are M- / N-major)
__device__ __forceinline__ void wm_ldsm_t(uint32_t (&r)[4], const uint16_t* smem) {
#if __CUDA_ARCH__ >= 800
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
#endif
}
template <bool BF16>
__device__ __forceinline__ void wm_mma(float* d, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
  if constexpr (BF16)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// One operand's K step for the tensor cores: rows [k0, k0 + 32) ∩ [.., ke), columns [c0, c0 + 64) ∩ [.., ncol)
// copied as 16-byte chunks (zero-filled outside) into S[32][WM_LD]; 4 chunks per thread.
__device__ __forceinline__ void wm_stage(uint16_t* S, const uint16_t* g, int64_t ld, int64_t k0, int64_t ke, int c0,
                                         int ncol, int t) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = i * WG_THREADS + t, row = e >> 3, c = (e & 7) * 8;
    const int64_t k = k0 + row;
    const bool in = k < ke && c0 + c < ncol;
    wm_cp16(S + row * WM_LD + c, in ? g + k * ld + c0 + c : g, in);
  }
}

// acc[(mb * 8 + nb) * 4 + e]: warp w's rows w*32 + mb*16 + lane/4 (+8 for e >= 2), columns nb*8 + 2*(lane%4) + e%2
template <bool BF16>
__device__ __forceinline__ void wm_main(float (&acc)[64], uint16_t* sm, const WGradJob& jb, int64_t kb, int64_t ke,
                                        int m0, int n0, int t) {
  const uint16_t* ga = reinterpret_cast<const uint16_t*>(jb.a);
  const uint16_t* gb = reinterpret_cast<const uint16_t*>(jb.b);
  const int nsteps = (int)((ke - kb + WM_BK - 1) / WM_BK);
  constexpr int OP = WM_BK * WM_LD;  // one operand's stage
#pragma unroll
  for (int s = 0; s < WM_STAGES - 1; ++s) {
    if (s < nsteps) {
      wm_stage(sm + (2 * s) * OP, ga, jb.lda, kb + s * WM_BK, ke, m0, jb.M, t);
      wm_stage(sm + (2 * s + 1) * OP, gb, jb.ldb, kb + s * WM_BK, ke, n0, jb.N, t);
    }
    wm_commit();  // one group per stage, empty or not: the wait below counts groups
  }
  const int warp = t >> 5, lane = t & 31, q = lane >> 3, r8 = lane & 7;
  for (int step = 0; step < nsteps; ++step) {
    wm_wait<WM_STAGES - 2>();  // this step's group has landed (this thread's copies) ...
    __syncthreads();           // ... every thread's; and every warp is done with the buffer refilled below
    const int nxt = step + WM_STAGES - 1;
    if (nxt < nsteps) {
      const int sb = nxt % WM_STAGES;
      wm_stage(sm + (2 * sb) * OP, ga, jb.lda, kb + (int64_t)nxt * WM_BK, ke, m0, jb.M, t);
      wm_stage(sm + (2 * sb + 1) * OP, gb, jb.ldb, kb + (int64_t)nxt * WM_BK, ke, n0, jb.N, t);
    }
    wm_commit();
    const uint16_t* As = sm + (2 * (step % WM_STAGES)) * OP;
    const uint16_t* Bs = As + OP;
#pragma unroll
    for (int kk = 0; kk < WM_BK; kk += 16) {
      uint32_t af[2][4], bf[4][4];
#pragma unroll
      for (int mb = 0; mb < 2; ++mb)  // a0..a3: (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15)
        wm_ldsm_t(af[mb], As + (kk + (q >> 1) * 8 + r8) * WM_LD + warp * 32 + mb * 16 + (q & 1) * 8);
#pragma unroll
      for (int nq = 0; nq < 4; ++nq)  // b0, b1 of column block 2nq, then of 2nq + 1
        wm_ldsm_t(bf[nq], Bs + (kk + (q & 1) * 8 + r8) * WM_LD + (nq * 2 + (q >> 1)) * 8);
#pragma unroll
      for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
          wm_mma<BF16>(acc + (mb * 8 + nb) * 4, af[mb], bf[nb >> 1][(nb & 1) * 2], bf[nb >> 1][(nb & 1) * 2 + 1]);
    }
  }
  wm_wait<0>();
}

// ---- the FFMA path (any dtypes, any strides) ----
// acc[a * 8 + b]: row wg_pos(tm, a), column wg_pos(tn, b)
__device__ __forceinline__ void wg_ffma_main(float (&acc)[64], float* sm, const WGradJob& jb, int64_t kb, int64_t ke,
                                             int m0, int n0, int t) {
  float (*As)[WG_BK][WG_BM] = reinterpret_cast<float (*)[WG_BK][WG_BM]>(sm);
  float (*Bs)[WG_BK][WG_BN] = reinterpret_cast<float (*)[WG_BK][WG_BN]>(sm + 2 * WG_BK * WG_BM);
  const int tm = t >> 3, tn = t & 7;
  const void* pa = jb.a;
  const void* pb = jb.b;
  const int adt = jb.a_dtype, bdt = jb.b_dtype, amode = jb.a_vec, bmode = jb.b_vec, M = jb.M, N = jb.N;
  const int64_t lda = jb.lda, ldb = jb.ldb;
  float ra[WG_PER], rb[WG_PER];
  wg_load(ra, pa, adt, amode, lda, kb, ke, m0, M, t);
  wg_load(rb, pb, bdt, bmode, ldb, kb, ke, n0, N, t);
  wg_store(As[0], ra, amode, t);
  wg_store(Bs[0], rb, bmode, t);
  __syncthreads();
  int cur = 0;
  for (int64_t k0 = kb; k0 < ke; k0 += WG_BK) {
    const bool more = k0 + WG_BK < ke;
    if (more) {  // the next step's loads in flight during this step's FMAs
      wg_load(ra, pa, adt, amode, lda, k0 + WG_BK, ke, m0, M, t);
      wg_load(rb, pb, bdt, bmode, ldb, k0 + WG_BK, ke, n0, N, t);
    }
#pragma unroll
    for (int kk = 0; kk < WG_BK; ++kk) {
      const float4 a0 = *reinterpret_cast<const float4*>(&As[cur][kk][tm * 4]);
      const float4 a1 = *reinterpret_cast<const float4*>(&As[cur][kk][32 + tm * 4]);
      const float4 b0 = *reinterpret_cast<const float4*>(&Bs[cur][kk][tn * 4]);
      const float4 b1 = *reinterpret_cast<const float4*>(&Bs[cur][kk][32 + tn * 4]);
      const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int a = 0; a < 8; ++a)
#pragma unroll
        for (int b = 0; b < 8; ++b) acc[a * 8 + b] = fmaf(av[a], bv[b], acc[a * 8 + b]);
    }
    if (more) {  // the other buffer: every thread finished reading it before the barrier that ended the last step
      wg_store(As[cur ^ 1], ra, amode, t);
      wg_store(Bs[cur ^ 1], rb, bmode, t);
    }
    __syncthreads();
    cur ^= 1;
  }
}

template <int VW> struct WgVec;
template <> struct WgVec<1> { using T = float; };
template <> struct WgVec<2> { using T = float2; };
template <> struct WgVec<4> { using T = float4; };

// The item's accumulators acc[v * VW + i] (v < NV) sit at row r, column c + i of the tile, (r, c) = pos(v).
// A split tile publishes its partial; the last slice to arrive sums every partial in slice order (the loads of
// several slices in flight where a thread holds few values). Then C += the sums.
template <int VW, int NV, typename Pos>
__device__ __forceinline__ void wg_finish(float (&acc)[64], const WGradParams& p, const WGradJob& jb, int item,
                                          int tile, int m0, int n0, int t, bool* is_last, Pos pos) {
  using V = typename WgVec<VW>::T;
  constexpr int G = NV >= 16 ? 1 : 16 / NV;  // slices loaded at once
  if (jb.splits > 1) {
    float* wsi = p.ws + (int64_t)item * WG_TILE;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      int r, c;
      pos(v, r, c);
      *reinterpret_cast<V*>(wsi + r * WG_BN + c) = *reinterpret_cast<const V*>(&acc[v * VW]);
    }
    unsigned int* cnt = p.counters + jb.tile0 + tile;
    if (!last_block_arrive(cnt, (unsigned)(jb.splits - 1), *is_last)) return;
    const float* ws0 = p.ws + (int64_t)(jb.item0 + tile * jb.splits) * WG_TILE;
#pragma unroll
    for (int i = 0; i < NV * VW; ++i) acc[i] = 0.f;
    for (int s0 = 0; s0 < jb.splits; s0 += G) {
      V v4[G][NV];
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int v = 0; v < NV; ++v) {  // the slices' loads in flight, then their sums in slice order
          int r, c;
          pos(v, r, c);
          if (s0 + g < jb.splits)
            v4[g][v] = __ldcg(reinterpret_cast<const V*>(ws0 + (int64_t)(s0 + g) * WG_TILE + r * WG_BN + c));
        }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if (s0 + g >= jb.splits) break;
#pragma unroll
        for (int v = 0; v < NV; ++v) {
          const float* f = reinterpret_cast<const float*>(&v4[g][v]);
#pragma unroll
          for (int i = 0; i < VW; ++i) acc[v * VW + i] += f[i];
        }
      }
    }
    if (t == 0) *cnt = 0u;  // ready for the next launch / graph replay
  }
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    int r, c;
    pos(v, r, c);
    const int m = m0 + r;
    if (m >= jb.M) continue;
#pragma unroll
    for (int i = 0; i < VW; ++i) {
      const int n = n0 + c + i;
      if (n < jb.N) jb.c[(int64_t)m * jb.ldc + n] += acc[v * VW + i];
    }
  }
}

// ---- the column-sum path (b = ones: a bias gradient) ----
// acc[0]: column m0 + t summed over the slice's rows in order, 16 loads in flight
__device__ __forceinline__ void wg_colsum_main(float (&acc)[64], const WGradJob& jb, int64_t kb, int64_t ke, int m0,
                                               int t) {
  const int m = m0 + t;
  float s = 0.f;
  if (m < jb.M) {
    int64_t k = kb;
    for (; k + 16 <= ke; k += 16) {
      float v[16];
#pragma unroll
      for (int u = 0; u < 16; ++u) v[u] = wg_ld(jb.a, (k + u) * jb.lda + m, jb.a_dtype);
#pragma unroll
      for (int u = 0; u < 16; ++u) s += v[u];
    }
    for (; k < ke; ++k) s += wg_ld(jb.a, k * jb.lda + m, jb.a_dtype);
  }
  acc[0] = s;
}

__global__ void __launch_bounds__(WG_THREADS, 6) wgrad_kernel(const __grid_constant__ WGradParams p) {
  extern __shared__ __align__(16) unsigned char smem[];  // wgrad_plan's smem_bytes: the largest path's staging
  __shared__ bool is_last;
  const int item = blockIdx.x;
  int j = 0;
  while (j + 1 < p.n_jobs && item >= p.job[j + 1].item0) ++j;
  const WGradJob& jb = p.job[j];
  const int local = item - jb.item0;
  const int tile = local / jb.splits, split = local - tile * jb.splits;
  const int m0 = (tile / jb.tiles_n) * WG_BM, n0 = (tile % jb.tiles_n) * WG_BN;
  const int64_t kb = (int64_t)split * jb.slice;
  const int64_t ke = kb + jb.slice < jb.K ? kb + jb.slice : jb.K;
  const int t = threadIdx.x;

  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  if (jb.path == kWgMma) {
    uint16_t* sm = reinterpret_cast<uint16_t*>(smem);
    if (jb.a_dtype == kBF16)
      wm_main<true>(acc, sm, jb, kb, ke, m0, n0, t);
    else
      wm_main<false>(acc, sm, jb, kb, ke, m0, n0, t);
    const int warp = t >> 5, lane = t & 31;
    wg_finish<2, 32>(acc, p, jb, item, tile, m0, n0, t, &is_last, [&](int v, int& r, int& c) {
      const int h = v & 1, nb = (v >> 1) & 7, mb = v >> 4;
      r = warp * 32 + mb * 16 + (lane >> 2) + h * 8;
      c = nb * 8 + (lane & 3) * 2;
    });
  } else if (jb.path == kWgColsum) {
    wg_colsum_main(acc, jb, kb, ke, m0, t);
    wg_finish<1, 1>(acc, p, jb, item, tile, m0, n0, t, &is_last, [&](int, int& r, int& c) { r = t; c = 0; });
  } else {
    wg_ffma_main(acc, reinterpret_cast<float*>(smem), jb, kb, ke, m0, n0, t);
    const int tm = t >> 3, tn = t & 7;
    wg_finish<4, 16>(acc, p, jb, item, tile, m0, n0, t, &is_last, [&](int v, int& r, int& c) {
      r = wg_pos(tm, v >> 1);
      c = (v & 1) * 32 + tn * 4;
    });
  }
}

namespace {
// 16-byte loads of an operand's rows need a 16-byte aligned base, a row stride and a row width (the tile's
// column bound) that are multiples of the elements per load.
int wg_mode(const void* ptr, int64_t ld, int ncol, int dt) {
  if (ptr == nullptr) return kWgOnes;
  const int per = dt == kF32 ? 4 : 8;
  const bool ok = (reinterpret_cast<uintptr_t>(ptr) % 16 == 0) && ld % per == 0 && ncol % per == 0;
  return ok ? (dt == kF32 ? kWgVec32 : kWgVec16) : kWgScalar;
}
}  // namespace

// The K slice of the FFMA or the tensor-core jobs, from the shapes only. Candidates: 128, 256, 512, ... rows and
// the whole K (slices of 64 were slower at every K timed). Cost in K rows of one SM's busiest share: n items of
// `slice` rows each (n = items / SMs, rounded up), where fewer than 4 co-resident items leave the SM's pipes idle
// (a lone FFMA item ran a K row ~4x slower than 7 sharing the SM), plus a fixed cost per item (its prologue,
// operand pipeline fill and partial store) and ~4 rows per partial of a split tile (the last slice's sum). The
// FFMA path's ~5 rows per item were fitted on the H200 (benchmarks/NOTES.md): 128 rows at K = 1024 and 4096,
// 256 at 8192. On tensor cores a K row costs a tenth as much, so the fixed cost weighs ~256 rows: fitted to the
// real step's jobs timed alone on the H100 (forced slices 128 / 256 / 512 at K = 1024: 36.0 / 24.4 / 32.6 µs;
// 256 / 384 / 512 at K = 2048: 43.6 / 38.0 / 38.9), which gives 256 rows at 1024 and 512 at 2048.
int64_t wg_slice(const WGradParams& p, int path, int64_t sms) {
  int64_t kmax = 0;
  for (int j = 0; j < p.n_jobs; ++j)
    if (p.job[j].path == path && p.job[j].K > kmax) kmax = p.job[j].K;
  const int64_t kfull = std::max<int64_t>(WG_BK, ((kmax + WG_BK - 1) / WG_BK) * WG_BK);
  int64_t best = kfull, best_cost = -1;
  for (int64_t sl = 128;; sl *= 2) {
    const int64_t slice = sl < kfull ? sl : kfull;
    int64_t items = 0, splits = 1;
    for (int j = 0; j < p.n_jobs; ++j) {
      if (p.job[j].path != path) continue;
      const int64_t sp = std::max<int64_t>(1, (p.job[j].K + slice - 1) / slice);
      items += (int64_t)p.job[j].tiles * sp;
      splits = std::max(splits, sp);
    }
    const int64_t n = (items + sms - 1) / sms;
    const int64_t per_item = path == kWgMma ? 256 : 5;
    const int64_t cost = slice * std::max<int64_t>(n, 4) + per_item * n + (splits > 1 ? 4 * splits : 0);
    if (best_cost < 0 || cost < best_cost) { best_cost = cost; best = slice; }
    if (slice == kfull) break;
  }
  return best;
}

int64_t wgrad_plan(WGradParams& p, int sm_count, int64_t force_slice, bool use_mma) {
  // Deterministic: the plan depends on the shapes, dtypes and operand layouts only, so the same step gives the
  // same bits every call. Each path gets one K slice for its jobs: FFMA and tensor cores by wg_slice; column sums
  // (one load and add per element, 16 rows in flight) at most 16 slices of >= 64 rows, so that no lone item walks
  // a long K and the last slice's sum is one round of loads.
  int64_t kones = 0;
  p.smem_bytes = WG_SMEM_FFMA;
  for (int j = 0; j < p.n_jobs; ++j) {
    WGradJob& jb = p.job[j];
    jb.tiles_n = (jb.N + WG_BN - 1) / WG_BN;
    jb.tiles = ((jb.M + WG_BM - 1) / WG_BM) * jb.tiles_n;
    jb.a_vec = wg_mode(jb.a, jb.lda, jb.M, jb.a_dtype);
    jb.b_vec = wg_mode(jb.b, jb.ldb, jb.N, jb.b_dtype);
    jb.path = jb.b_vec == kWgOnes ? kWgColsum
              : use_mma && jb.a_vec == kWgVec16 && jb.b_vec == kWgVec16 && jb.a_dtype == jb.b_dtype ? kWgMma
                                                                                                    : kWgFfma;
    if (jb.path == kWgColsum) kones = std::max(kones, jb.K);
    if (jb.path == kWgMma) p.smem_bytes = std::max(p.smem_bytes, WG_SMEM_MMA);
  }
  const int64_t sms = sm_count > 0 ? sm_count : 132;
  int64_t slice[3];
  slice[kWgFfma] = wg_slice(p, kWgFfma, sms);
  slice[kWgMma] = wg_slice(p, kWgMma, sms);
  slice[kWgColsum] = std::max<int64_t>(64, ((kones + 15) / 16 + 15) / 16 * 16);
  if (force_slice > 0) slice[kWgFfma] = slice[kWgMma] = slice[kWgColsum] = ((force_slice + WG_BK - 1) / WG_BK) * WG_BK;
  int64_t items = 0, tiles = 0, ws = 0;
  for (int j = 0; j < p.n_jobs; ++j) {
    WGradJob& jb = p.job[j];
    jb.slice = slice[jb.path];
    const int64_t sp = std::max<int64_t>(1, (jb.K + jb.slice - 1) / jb.slice);
    jb.splits = (int)sp;
    jb.item0 = (int)items;
    jb.tile0 = (int)tiles;
    items += (int64_t)jb.tiles * sp;
    tiles += jb.tiles;
    if (sp > 1) ws = items;  // partials are indexed by item: cover every item up to the last split one
  }
  p.n_items = (int)items;
  p.n_tiles = (int)tiles;
  return ws * WG_TILE;
}

const char* wgrad(const WGradParams& p, cudaStream_t s) {
  if (p.n_jobs < 1 || p.n_jobs > WGRAD_MAX_JOBS) return "wgrad: 1..WGRAD_MAX_JOBS jobs";
  if (p.n_items < 1) return nullptr;
  wgrad_kernel<<<(unsigned)p.n_items, WG_THREADS, p.smem_bytes, s>>>(p);
  MRL_LAUNCH_CHECK();
  return nullptr;
}

}  // namespace mrl
