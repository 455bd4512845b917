// Shared device helpers (torch-free).
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include "ops.h"

namespace mrl {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half(v); }

__device__ __forceinline__ float sigmoidf_(float v) { return 1.f / (1.f + expf(-v)); }
__device__ __forceinline__ float siluf_(float v) { return v * sigmoidf_(v); }
// torch.nn.functional.softplus(beta=1, threshold=20)
__device__ __forceinline__ float softplusf_(float v) { return v > 20.f ? v : log1pf(expf(v)); }

// Sum over groups of G consecutive lanes (G a power of two <= 32); every lane gets its group's sum.
template <int G>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum NV values over the lanes of a warp that share lane % G (the other channels of the warp), transposed:
// each lane ends with ONE sum; *idx says which of the NV it is. Once the NV values are down to one, the remaining
// levels add plainly, and a lane with its bit of such a level set holds a duplicate (dup = true). (The scan
// backward's pair build takes pair_transpose_reduce: the same sums, in the same order.) G = 1, NV = 8: 8 sums over
// the whole warp, sum idx in lanes 4 idx .. 4 idx + 3 (dup for all but 4 idx); every sum adds the lanes in the
// tree of group_sum<32> (lane bit 4, then 3 .. 0), so it has group_sum's bits.
template <int G, int NV>
__device__ __forceinline__ float transpose_reduce(const float (&v)[NV], int lane, int& idx, bool& dup) {
  float w[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) w[k] = v[k];
  int cnt = NV;
  idx = 0;
  dup = false;
#pragma unroll
  for (int o = 16; o >= G; o >>= 1) {
    const int hb = (lane & o) ? 1 : 0;
    if (cnt > 1) {
      const int half = cnt / 2;
#pragma unroll
      for (int k = 0; k < half; ++k) {
        const float send = hb ? w[k] : w[k + half];
        const float keep = hb ? w[k + half] : w[k];
        w[k] = keep + __shfl_xor_sync(0xffffffffu, send, o);
      }
      idx = idx * 2 + hb;
      cnt = half;
    } else {
      w[0] += __shfl_xor_sync(0xffffffffu, w[0], o);
      dup = dup || hb;
    }
  }
  return w[0];
}

// The current device's multiprocessor count (coop.cu; cached per device, 132 where the query fails).
int sm_count();

// Cooperative single launches (coop.cu): whether a grid of `threads`-thread blocks with `smem` bytes of dynamic
// shared memory each is co-resident on the current device (so a cooperative launch with grid barriers can run
// it), false where the device lacks cooperative launch or set_coop() has cleared `which` (a COOP_* bit; the
// separate launches then run, with the same bits: a tuning / testing knob).
bool coop_fits(int which, const void* kernel, int threads, int smem, dim3 grid);
// The co-resident blocks of `kernel` on the current device (0: no cooperative launch there, or a query failed),
// whatever set_coop() says; cached per kernel, block size, shared memory and device.
int64_t coop_capacity(const void* kernel, int threads, int smem);

// The last-block reduction's hand-off (CUDA samples' threadFenceReduction; the fences as CUTLASS's
// GenericBarrier): called by every thread of a block after its stores of partials, true in the one block that
// counts `last` + 1 arrivals at *counter, where every other block's stores are then visible to all its threads.
// A barrier, then thread 0 alone orders the block's stores (fence.acq_rel.gpu, cumulative over what the barrier
// made it observe), counts, and orders the loads after it; __threadfence() in every thread is fence.sc.gpu, a
// heavier fence paid by every warp. `flag` is a __shared__ bool of the caller's.
__device__ __forceinline__ bool last_block_arrive(unsigned int* counter, unsigned int last, bool& flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    const unsigned int n = atomicAdd(counter, 1u);
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    flag = n == last;
  }
  __syncthreads();
  return flag;
}

#define MRL_LAUNCH_CHECK()                                        \
  do {                                                            \
    cudaError_t e__ = cudaGetLastError();                         \
    if (e__ != cudaSuccess) return cudaGetErrorString(e__);       \
  } while (0)

}  // namespace mrl

namespace mrl {
// Deterministic column sums: for j < M, f(j, sum_{p < P} ws[p * M + j]) with a fixed summation order.
// RG row groups: row group r sums rows r, r + RG, ...; then the RG group sums are added in group order.
// RG = 8 for short columns, 32 from COLSUM_LONG rows (a thread's serial chain and the loads in flight per SM
// were what bound long columns: 40 blocks of 8 x 32 threads at 64 x 1024 summed 4,096 rows of 1,280 columns
// in ~70-100 µs); colsum_rg() picks it, so colsum_kernel and colsum_grid give the same bits for one shape.
constexpr int COLSUM_LONG = 512;
__host__ __device__ __forceinline__ int colsum_rg(int P) { return P >= COLSUM_LONG ? 32 : 8; }
// Row group r's partial sum of column j (rows r, r + RG, ...; the order colsum_kernel and colsum_grid share).
template <int RG>
__device__ __forceinline__ float colsum_part(const float* __restrict__ ws, int P, int M, int j, int r) {
  float acc = 0.f;
  int p = r;
  // 16 loads in flight, then the same sums in the same order as the 4-row loop below (bit for bit): a
  // thread's rows are P / RG, and one memory latency per 4 of them made the kernel latency-bound.
  for (; p + 15 * RG < P; p += 16 * RG) {
    float a[16];
#pragma unroll
    for (int u = 0; u < 16; ++u) a[u] = ws[(int64_t)(p + u * RG) * M + j];
#pragma unroll
    for (int u = 0; u < 16; u += 4) acc += (a[u] + a[u + 1]) + (a[u + 2] + a[u + 3]);
  }
  for (; p + 3 * RG < P; p += 4 * RG) {
    float a0 = ws[(int64_t)p * M + j], a1 = ws[(int64_t)(p + RG) * M + j];
    float a2 = ws[(int64_t)(p + 2 * RG) * M + j], a3 = ws[(int64_t)(p + 3 * RG) * M + j];
    acc += (a0 + a1) + (a2 + a3);
  }
  for (; p < P; p += RG) acc += ws[(int64_t)p * M + j];
  return acc;
}

template <typename F, int RG>
__global__ void __launch_bounds__(32 * RG) colsum_kernel(const float* __restrict__ ws, int P, int M, F f) {
  __shared__ float part[RG][33];
  const int j = blockIdx.x * 32 + threadIdx.x;
  const int r = threadIdx.y;
  part[r][threadIdx.x] = j < M ? colsum_part<RG>(ws, P, M, j, r) : 0.f;
  __syncthreads();
  if (r == 0 && j < M) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < RG; ++i) s += part[i][threadIdx.x];
    f(j, s);
  }
}

// The same sums by the threads [gtid .. ) of a grid (gtid = thread id in the grid, nthreads a multiple of 32):
// the RG row groups of a column in RG lanes of one warp, added in group order (the same bits as colsum_kernel).
template <typename F, int RG>
__device__ __forceinline__ void colsum_grid_rg(const float* __restrict__ ws, int P, int M, F f, int64_t gtid,
                                               int64_t nthreads) {
  const int lane = (int)(gtid & 31);
  const int64_t total = (int64_t)M * RG;
  for (int64_t w0 = gtid - lane; w0 < total; w0 += nthreads) {  // warp-uniform trip count (shuffles below)
    const int64_t idx = w0 + lane;
    const int j = (int)(idx / RG), r = lane % RG;
    const float a = idx < total ? colsum_part<RG>(ws, P, M, j, r) : 0.f;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < RG; ++i) s += __shfl_sync(0xffffffffu, a, (lane & ~(RG - 1)) + i);
    if (r == 0 && idx < total) f(j, s);
  }
}
template <typename F>
__device__ __forceinline__ void colsum_grid(const float* __restrict__ ws, int P, int M, F f, int64_t gtid,
                                            int64_t nthreads) {
  if (colsum_rg(P) == 32) colsum_grid_rg<F, 32>(ws, P, M, f, gtid, nthreads);
  else colsum_grid_rg<F, 8>(ws, P, M, f, gtid, nthreads);
}
template <typename F>
inline void launch_colsum(const float* ws, int P, int M, F f, cudaStream_t s) {
  if (colsum_rg(P) == 32) colsum_kernel<F, 32><<<(M + 31) / 32, dim3(32, 32), 0, s>>>(ws, P, M, f);
  else colsum_kernel<F, 8><<<(M + 31) / 32, dim3(32, 8), 0, s>>>(ws, P, M, f);
}
}  // namespace mrl
