// Grouped weight-gradient GEMMs of the fused training step: C[M, N] += A^T B for up to WGRAD_MAX_JOBS jobs
// in one launch (every dW of a backward, plus column sums for bias grads), float32 accumulation.
//
// Why: cuBLAS(Lt) picks split-K for these skinny shapes (K = B*T rows, M*N small) and adds a separate
// reduce kernel per GEMM in float32: 2 launches per weight. Here each 64 x 64 output tile's K range is cut
// into fixed slices (chosen from the shapes only, so the same plan and the same bits every call); a slice's
// partial goes to a workspace and the last slice of the tile to finish sums the partials in slice order and
// adds them into C. One launch, deterministic, no atomics on data.
#include "common.cuh"

namespace mrl {

constexpr int WG_BM = 64, WG_BN = 64, WG_BK = 32, WG_THREADS = 256;
constexpr int WG_LD = WG_BK * WG_BM / WG_THREADS;  // operand elements each thread loads per K step
constexpr int WG_TILE = WG_BM * WG_BN;

__device__ __forceinline__ float wg_ld(const void* p, int64_t i, int dt) {
  if (dt == kBF16) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
  if (dt == kF16) return __half2float(reinterpret_cast<const __half*>(p)[i]);
  return reinterpret_cast<const float*>(p)[i];
}

__global__ void __launch_bounds__(WG_THREADS, 2) wgrad_kernel(const __grid_constant__ WGradParams p) {
  __shared__ __align__(16) float As[WG_BK][WG_BM];
  __shared__ __align__(16) float Bs[WG_BK][WG_BN];
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
  const int tm = t / 16, tn = t % 16;  // this thread's 4 x 4 outputs: rows tm*4.., cols tn*4..
  const bool ones = jb.b == nullptr;

  float ra[WG_LD], rb[WG_LD];
  auto load = [&](int64_t k0) {
#pragma unroll
    for (int i = 0; i < WG_LD; ++i) {
      const int e = t + WG_THREADS * i;
      const int kk = e / WG_BM, c = e % WG_BM;
      const int64_t k = k0 + kk;
      const bool kin = k < ke;
      ra[i] = (kin && m0 + c < jb.M) ? wg_ld(jb.a, k * jb.lda + m0 + c, jb.a_dtype) : 0.f;
      if (ones) rb[i] = (kin && n0 + c < jb.N) ? 1.f : 0.f;
      else rb[i] = (kin && n0 + c < jb.N) ? wg_ld(jb.b, k * jb.ldb + n0 + c, jb.b_dtype) : 0.f;
    }
  };
  float acc[4][4];
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) acc[a][b] = 0.f;

  load(kb);
  for (int64_t k0 = kb; k0 < ke; k0 += WG_BK) {
    __syncthreads();  // the previous step's compute is done with As / Bs
#pragma unroll
    for (int i = 0; i < WG_LD; ++i) {
      const int e = t + WG_THREADS * i;
      As[e / WG_BM][e % WG_BM] = ra[i];
      Bs[e / WG_BN][e % WG_BN] = rb[i];
    }
    __syncthreads();
    if (k0 + WG_BK < ke) load(k0 + WG_BK);  // next slice step in flight during the FMAs
#pragma unroll
    for (int kk = 0; kk < WG_BK; ++kk) {
      const float4 av = *reinterpret_cast<const float4*>(&As[kk][tm * 4]);
      const float4 bv = *reinterpret_cast<const float4*>(&Bs[kk][tn * 4]);
      const float a4[4] = {av.x, av.y, av.z, av.w}, b4[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) acc[a][b] = fmaf(a4[a], b4[b], acc[a][b]);
    }
  }

  if (jb.splits == 1) {
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int m = m0 + tm * 4 + a;
      if (m >= jb.M) continue;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int n = n0 + tn * 4 + b;
        if (n < jb.N) jb.c[(int64_t)m * jb.ldc + n] += acc[a][b];
      }
    }
    return;
  }
  // split tile: publish this slice's partial, the last slice to arrive sums them in slice order
  float* wsi = p.ws + (int64_t)item * WG_TILE;
#pragma unroll
  for (int a = 0; a < 4; ++a)
    *reinterpret_cast<float4*>(wsi + (tm * 4 + a) * WG_BN + tn * 4) = make_float4(acc[a][0], acc[a][1], acc[a][2], acc[a][3]);
  __threadfence();
  __syncthreads();
  unsigned int* cnt = p.counters + jb.tile0 + tile;
  if (t == 0) is_last = atomicAdd(cnt, 1u) == (unsigned)(jb.splits - 1);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const float* ws0 = p.ws + (int64_t)(jb.item0 + tile * jb.splits) * WG_TILE;
  float sum[4][4];
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) sum[a][b] = 0.f;
  for (int s = 0; s < jb.splits; ++s) {
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(ws0 + (int64_t)s * WG_TILE + (tm * 4 + a) * WG_BN + tn * 4));
      sum[a][0] += v.x; sum[a][1] += v.y; sum[a][2] += v.z; sum[a][3] += v.w;
    }
  }
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int m = m0 + tm * 4 + a;
    if (m >= jb.M) continue;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int n = n0 + tn * 4 + b;
      if (n < jb.N) jb.c[(int64_t)m * jb.ldc + n] += sum[a][b];
    }
  }
  if (t == 0) *cnt = 0u;  // ready for the next launch / graph replay
}

int64_t wgrad_plan(WGradParams& p, int sm_count) {
  // One K-slice length for every job, a multiple of WG_BK, chosen from the shapes only: the smallest
  // estimated time ceil(items / slots) * (slice + overhead), slots = 2 resident blocks per SM (the kernel's
  // register use), overhead ~ one slice epilogue in K rows. Deterministic: the same shapes, the same plan.
  int64_t kmax = 1;
  for (int j = 0; j < p.n_jobs; ++j) {
    WGradJob& jb = p.job[j];
    jb.tiles_n = (jb.N + WG_BN - 1) / WG_BN;
    jb.tiles = ((jb.M + WG_BM - 1) / WG_BM) * jb.tiles_n;
    if (jb.K > kmax) kmax = jb.K;
  }
  const int64_t slots = 2 * (int64_t)(sm_count > 0 ? sm_count : 132);
  const int64_t overhead = 96;
  int64_t best = ((kmax + WG_BK - 1) / WG_BK) * WG_BK, best_cost = -1;
  for (int64_t sl = 128; sl < kmax + WG_BK; sl += (sl < 1024 ? 128 : sl / 4)) {
    const int64_t slice = ((sl + WG_BK - 1) / WG_BK) * WG_BK;
    int64_t items = 0;
    for (int j = 0; j < p.n_jobs; ++j) {
      const int64_t sp = (p.job[j].K + slice - 1) / slice;
      items += (int64_t)p.job[j].tiles * (sp < 1 ? 1 : sp);
    }
    const int64_t cost = ((items + slots - 1) / slots) * (slice + overhead);
    if (best_cost < 0 || cost < best_cost) { best_cost = cost; best = slice; }
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
