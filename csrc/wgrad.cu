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
#include "common.cuh"

#include <algorithm>

namespace mrl {

constexpr int WG_BM = 64, WG_BN = 64, WG_BK = 16, WG_THREADS = 64;
constexpr int WG_TILE = WG_BM * WG_BN;
constexpr int WG_PER = WG_BK * WG_BM / WG_THREADS;  // operand elements per thread per K step (16)
// how a job's operand is read (wgrad_plan): element by element, 16-byte loads of 4 float32 or of 8 bf16 / f16,
// or the all-ones column of a bias gradient (b == nullptr)
enum WgMode : int { kWgScalar = 0, kWgVec32 = 1, kWgVec16 = 2, kWgOnes = 3 };

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
      r[i] = mode == kWgOnes ? (in ? 1.f : 0.f) : (in ? wg_ld(p, k * ld + c0 + c, dt) : 0.f);
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

__global__ void __launch_bounds__(WG_THREADS, 6) wgrad_kernel(const __grid_constant__ WGradParams p) {
  __shared__ __align__(16) float As[2][WG_BK][WG_BM];
  __shared__ __align__(16) float Bs[2][WG_BK][WG_BN];
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
  const int tm = t >> 3, tn = t & 7;
  const void* pa = jb.a;
  const void* pb = jb.b;
  const int adt = jb.a_dtype, bdt = jb.b_dtype, amode = jb.a_vec, bmode = jb.b_vec, M = jb.M, N = jb.N;
  const int64_t lda = jb.lda, ldb = jb.ldb;

  float acc[8][8];
#pragma unroll
  for (int a = 0; a < 8; ++a)
#pragma unroll
    for (int b = 0; b < 8; ++b) acc[a][b] = 0.f;

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
        for (int b = 0; b < 8; ++b) acc[a][b] = fmaf(av[a], bv[b], acc[a][b]);
    }
    if (more) {  // the other buffer: every thread finished reading it before the barrier that ended the last step
      wg_store(As[cur ^ 1], ra, amode, t);
      wg_store(Bs[cur ^ 1], rb, bmode, t);
    }
    __syncthreads();
    cur ^= 1;
  }

  if (jb.splits > 1) {
    // split tile: publish this slice's partial, the last slice to arrive sums them in slice order
    float* wsi = p.ws + (int64_t)item * WG_TILE;
#pragma unroll
    for (int a = 0; a < 8; ++a) {
      const int r = wg_pos(tm, a);
      *reinterpret_cast<float4*>(wsi + r * WG_BN + tn * 4) = make_float4(acc[a][0], acc[a][1], acc[a][2], acc[a][3]);
      *reinterpret_cast<float4*>(wsi + r * WG_BN + 32 + tn * 4) = make_float4(acc[a][4], acc[a][5], acc[a][6], acc[a][7]);
    }
    __threadfence();
    __syncthreads();
    unsigned int* cnt = p.counters + jb.tile0 + tile;
    if (t == 0) is_last = atomicAdd(cnt, 1u) == (unsigned)(jb.splits - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const float* ws0 = p.ws + (int64_t)(jb.item0 + tile * jb.splits) * WG_TILE;
#pragma unroll
    for (int a = 0; a < 8; ++a)
#pragma unroll
      for (int b = 0; b < 8; ++b) acc[a][b] = 0.f;
    for (int s = 0; s < jb.splits; ++s) {
      float4 v[16];
#pragma unroll
      for (int a = 0; a < 8; ++a) {  // the split's 16 loads in flight, then its sums
        const float* row = ws0 + (int64_t)s * WG_TILE + wg_pos(tm, a) * WG_BN;
        v[2 * a] = __ldcg(reinterpret_cast<const float4*>(row + tn * 4));
        v[2 * a + 1] = __ldcg(reinterpret_cast<const float4*>(row + 32 + tn * 4));
      }
#pragma unroll
      for (int a = 0; a < 8; ++a) {
        acc[a][0] += v[2 * a].x; acc[a][1] += v[2 * a].y; acc[a][2] += v[2 * a].z; acc[a][3] += v[2 * a].w;
        acc[a][4] += v[2 * a + 1].x; acc[a][5] += v[2 * a + 1].y; acc[a][6] += v[2 * a + 1].z; acc[a][7] += v[2 * a + 1].w;
      }
    }
    if (t == 0) *cnt = 0u;  // ready for the next launch / graph replay
  }
#pragma unroll
  for (int a = 0; a < 8; ++a) {
    const int m = m0 + wg_pos(tm, a);
    if (m >= M) continue;
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      const int n = n0 + wg_pos(tn, b);
      if (n < N) jb.c[(int64_t)m * jb.ldc + n] += acc[a][b];
    }
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

int64_t wgrad_plan(WGradParams& p, int sm_count, int64_t force_slice) {
  // One K-slice length for every job, chosen from the shapes only (deterministic: the same shapes, the same
  // plan, the same bits). Candidates: 128, 256, 512, ... rows and the whole K (slices of 64 were slower at every
  // K timed). Cost in K rows of one SM's busiest share: n items of `slice` rows each (n = items / SMs, rounded
  // up), where fewer than 4 co-resident items leave the SM's FMA pipes idle (a lone item ran a K row ~4x slower
  // than 7 sharing the SM), plus ~5 rows per block and ~4 per partial of a split tile (the last slice's sum).
  // Fitted to the kernel timed alone on the H200 (benchmarks/NOTES.md): it picks 128 at K = 1024 and 4096 and
  // 256 at 8192, the fastest measured there.
  int64_t kmax = 1;
  for (int j = 0; j < p.n_jobs; ++j) {
    WGradJob& jb = p.job[j];
    jb.tiles_n = (jb.N + WG_BN - 1) / WG_BN;
    jb.tiles = ((jb.M + WG_BM - 1) / WG_BM) * jb.tiles_n;
    jb.a_vec = wg_mode(jb.a, jb.lda, jb.M, jb.a_dtype);
    jb.b_vec = wg_mode(jb.b, jb.ldb, jb.N, jb.b_dtype);
    if (jb.K > kmax) kmax = jb.K;
  }
  const int64_t sms = sm_count > 0 ? sm_count : 132;
  const int64_t kfull = ((kmax + WG_BK - 1) / WG_BK) * WG_BK;
  int64_t best = kfull, best_cost = -1;
  if (force_slice > 0) {
    best = ((force_slice + WG_BK - 1) / WG_BK) * WG_BK;
  } else {
    for (int64_t sl = 128;; sl *= 2) {
      const int64_t slice = sl < kfull ? sl : kfull;
      int64_t items = 0, splits = 1;
      for (int j = 0; j < p.n_jobs; ++j) {
        const int64_t sp = std::max<int64_t>(1, (p.job[j].K + slice - 1) / slice);
        items += (int64_t)p.job[j].tiles * sp;
        splits = std::max(splits, sp);
      }
      const int64_t n = (items + sms - 1) / sms;
      const int64_t cost = slice * std::max<int64_t>(n, 4) + 5 * n + (splits > 1 ? 4 * splits : 0);
      if (best_cost < 0 || cost < best_cost) { best_cost = cost; best = slice; }
      if (slice == kfull) break;
    }
  }
  int64_t items = 0, tiles = 0, ws = 0;
  for (int j = 0; j < p.n_jobs; ++j) {
    WGradJob& jb = p.job[j];
    jb.slice = best;
    int64_t sp = (jb.K + best - 1) / best;
    if (sp < 1) sp = 1;
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
  wgrad_kernel<<<(unsigned)p.n_items, WG_THREADS, 0, s>>>(p);
  MRL_LAUNCH_CHECK();
  return nullptr;
}

}  // namespace mrl
