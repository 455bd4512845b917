// Flat-arena optimizer kernels: global grad norm / overflow / bias corrections (one launch, last block
// finishes), AdamW with a decay boundary and the compute-dtype copy (one launch), and both in one cooperative
// launch (optim_step: the same bits, one launch and one serial tail fewer).
// Everything is read from device buffers (hyper, scalars, loss_scale): graph replays see new values.
#include "common.cuh"

#include <cooperative_groups.h>

namespace mrl {

constexpr int GS_THREADS = 256;

int grad_stats_blocks(int64_t P) {
  int64_t b = (P + GS_THREADS * 8 - 1) / (GS_THREADS * 8);
  return (int)(b < 1 ? 1 : (b > 264 ? 264 : b));
}

__device__ __forceinline__ double block_sum_d(double v, double* sh) {
  // fixed-order tree: deterministic
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  if (l == 0) sh[w] = v;
  __syncthreads();
  double r = 0.0;
  if (threadIdx.x < 32) {
    r = threadIdx.x < blockDim.x / 32 ? sh[threadIdx.x] : 0.0;
    for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
  }
  __syncthreads();
  return r;  // valid in thread 0
}

// The statistics of one step from the summed squares and the non-finite count (the arithmetic both kernels
// use, so the fused launch gives the same bits): torch.nn.utils.clip_grad_norm_'s coefficient, the
// GradScaler's skip, the next bias corrections from the step counter s0 and the previous corrections s1 / s2.
struct GsResult { double step, bc1, bc2, norm, clip, found, invd; bool skip; };
__device__ __forceinline__ GsResult gs_finish(double sq, double nbad, const GradStatsParams& p, double s0, double s1,
                                              double s2) {
  const double* h = p.hyper;
  GsResult r;
  r.invd = 1.0 / (double)p.loss_scale[0];
  if (p.extra_sq) sq += (double)p.extra_sq[0];
  r.norm = sqrt(sq);
  double clip = h[5] / (r.norm + 1e-6);
  clip = clip < 1.0 ? clip : 1.0;
  if (r.norm != r.norm) clip = r.norm;  // NaN propagates like torch.clamp
  r.clip = clip;
  const bool found = nbad > 0.0;
  r.skip = found && h[6] > 0.0;
  r.step = s0 + (r.skip ? 0.0 : 1.0);
  const double t = r.step < 1073741824.0 ? r.step : 1073741824.0;
  r.bc1 = r.skip ? s1 : 1.0 - pow(h[1], t);
  r.bc2 = r.skip ? s2 : 1.0 - pow(h[2], t);
  r.found = found ? 1.0 : 0.0;
  return r;
}

__device__ __forceinline__ void gs_store(const GsResult& r, double* s) {
  s[0] = r.step;
  s[1] = r.bc1;
  s[2] = r.bc2;
  s[3] = r.norm;
  s[4] = r.clip;
  s[5] = r.found;
  s[6] = r.invd;
}

// This block's share of the squared, unscaled gradient sum and of the non-finite count (valid in thread 0).
__device__ __forceinline__ void gs_block_sums(const GradStatsParams& p, double* sh, double& acc, double& bad) {
  const double invd = 1.0 / (double)p.loss_scale[0];
  acc = 0.0; bad = 0.0;
  // 8 loads in flight, then the sums in the same order (a missing element adds fma(0, 0, acc) = acc: the same bits)
  const int64_t stride = (int64_t)gridDim.x * GS_THREADS;
  for (int64_t i0 = (int64_t)blockIdx.x * GS_THREADS + threadIdx.x; i0 < p.P; i0 += 8 * stride) {
    float g[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) g[u] = i0 + u * stride < p.P ? p.grad[i0 + u * stride] : 0.f;
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      if (!isfinite(g[u])) bad = 1.0;
      const double gd = (double)g[u] * invd;
      acc = fma(gd, gd, acc);
    }
  }
  acc = block_sum_d(acc, sh);
  bad = block_sum_d(bad, sh);
}

// The per-block partials summed in a fixed order (every block that calls it gets the same bits; thread 0).
__device__ __forceinline__ void gs_total(const double* ws, double* sh, double& sq, double& nbad) {
  sq = 0.0; nbad = 0.0;
  for (int i = threadIdx.x; i < (int)gridDim.x; i += GS_THREADS) {
    sq += ((volatile const double*)ws)[i];
    nbad += ((volatile const double*)ws)[gridDim.x + i];
  }
  sq = block_sum_d(sq, sh);
  nbad = block_sum_d(nbad, sh);
}

__global__ void __launch_bounds__(GS_THREADS) grad_stats_kernel(GradStatsParams p) {
  __shared__ double sh[GS_THREADS / 32];
  __shared__ bool is_last;
  double acc, bad;
  gs_block_sums(p, sh, acc, bad);
  if (threadIdx.x == 0) {
    p.ws[blockIdx.x] = acc;
    p.ws[gridDim.x + blockIdx.x] = bad;
  }
  if (!last_block_arrive(p.counter, gridDim.x - 1, is_last)) return;
  double sq, nbad;
  gs_total(p.ws, sh, sq, nbad);
  if (threadIdx.x == 0) {
    *p.counter = 0u;  // ready for the next launch / graph replay
    GsResult r = gs_finish(sq, nbad, p, p.scalars[0], p.scalars[1], p.scalars[2]);
    gs_store(r, p.scalars);
  }
}

const char* grad_stats(const GradStatsParams& p, cudaStream_t s) {
  grad_stats_kernel<<<grad_stats_blocks(p.P), GS_THREADS, 0, s>>>(p);
  MRL_LAUNCH_CHECK();
  return nullptr;
}

struct AdamWConsts {
  float decay, w1, b2, w2, eps, step_size, bc2_sqrt, inv, clip;
};

// One element of torch.optim.AdamW (the same operations in the same order as its single-tensor path)
__device__ __forceinline__ void adamw_elem(const AdamWConsts& k, float graw, bool dec, float& w, float& m, float& v) {
  const float g = (graw * k.inv) * k.clip;
  if (dec) w *= k.decay;
  const float diff = g - m;
  m = (fabsf(k.w1) < 0.5f) ? m + k.w1 * diff : g - diff * (1.f - k.w1);  // torch.lerp
  v = v * k.b2;
  v = v + k.w2 * g * g;
  const float denom = sqrtf(v) / k.bc2_sqrt + k.eps;
  w = w + (-k.step_size) * (m / denom);
}

template <typename C> struct Comp4;  // 4 compute-dtype values, one store
template <> struct Comp4<float> {
  static __device__ __forceinline__ void store(float* p, int64_t q, const float (&w)[4]) {
    reinterpret_cast<float4*>(p)[q] = make_float4(w[0], w[1], w[2], w[3]);
  }
};
template <typename C> struct Comp4 {
  static __device__ __forceinline__ void store(C* p, int64_t q, const float (&w)[4]) {
    C h[4] = {from_f<C>(w[0]), from_f<C>(w[1]), from_f<C>(w[2]), from_f<C>(w[3])};
    reinterpret_cast<uint2*>(p)[q] = *reinterpret_cast<const uint2*>(h);
  }
};

// AdamW's float32 constants from the hyper-parameters and this step's statistics (float64, rounded once).
__device__ __forceinline__ AdamWConsts adamw_consts(const double* h, double bc1, double bc2, double invd, double clip) {
  AdamWConsts k;
  k.decay = (float)(1.0 - h[0] * h[4]);
  k.w1 = (float)(1.0 - h[1]);
  k.b2 = (float)h[2]; k.w2 = (float)(1.0 - h[2]); k.eps = (float)h[3];
  k.step_size = (float)(h[0] / bc1);
  k.bc2_sqrt = (float)sqrt(bc2);
  k.inv = (float)invd; k.clip = (float)clip;
  return k;
}

// The update over the arenas, grid-stride from thread `tid`: U groups of 4 elements per round, all their loads
// issued before the first store (16-byte loads where every arena allows it; the tail and unaligned arenas one
// element at a time). The same operations per element either way: the same bits for any grid or U.
template <typename C, int U>
__device__ __forceinline__ void adamw_apply(const AdamWParams& p, const AdamWConsts& k, int64_t tid, int64_t stride) {
  C* comp = reinterpret_cast<C*>(p.compute);
  const bool vec = ((reinterpret_cast<uintptr_t>(p.grad) | reinterpret_cast<uintptr_t>(p.param) |
                     reinterpret_cast<uintptr_t>(p.exp_avg) | reinterpret_cast<uintptr_t>(p.exp_avg_sq)) % 16 == 0) &&
                   reinterpret_cast<uintptr_t>(comp) % (4 * sizeof(C)) == 0;
  const int64_t n4 = vec ? p.P / 4 : 0;
  for (int64_t q0 = tid; q0 < n4; q0 += U * stride) {
    float4 g4[U], w4[U], m4[U], v4[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t q = q0 + u * stride;
      if (q < n4) {
        g4[u] = reinterpret_cast<const float4*>(p.grad)[q];
        w4[u] = reinterpret_cast<const float4*>(p.param)[q];
        m4[u] = reinterpret_cast<const float4*>(p.exp_avg)[q];
        v4[u] = reinterpret_cast<const float4*>(p.exp_avg_sq)[q];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t q = q0 + u * stride;
      if (q >= n4) break;
      if (p.zero_grad) reinterpret_cast<float4*>(p.grad)[q] = make_float4(0.f, 0.f, 0.f, 0.f);
      const float g[4] = {g4[u].x, g4[u].y, g4[u].z, g4[u].w};
      float w[4] = {w4[u].x, w4[u].y, w4[u].z, w4[u].w}, m[4] = {m4[u].x, m4[u].y, m4[u].z, m4[u].w},
            v[4] = {v4[u].x, v4[u].y, v4[u].z, v4[u].w};
#pragma unroll
      for (int c = 0; c < 4; ++c) adamw_elem(k, g[c], 4 * q + c < p.n_decay, w[c], m[c], v[c]);
      reinterpret_cast<float4*>(p.param)[q] = make_float4(w[0], w[1], w[2], w[3]);
      reinterpret_cast<float4*>(p.exp_avg)[q] = make_float4(m[0], m[1], m[2], m[3]);
      reinterpret_cast<float4*>(p.exp_avg_sq)[q] = make_float4(v[0], v[1], v[2], v[3]);
      if (comp) Comp4<C>::store(comp, q, w);
    }
  }
  for (int64_t i = 4 * n4 + tid; i < p.P; i += stride) {
    const float graw = p.grad[i];
    if (p.zero_grad) p.grad[i] = 0.f;
    float w = p.param[i], m = p.exp_avg[i], v = p.exp_avg_sq[i];
    adamw_elem(k, graw, i < p.n_decay, w, m, v);
    p.param[i] = w;
    p.exp_avg[i] = m;
    p.exp_avg_sq[i] = v;
    if (comp) comp[i] = from_f<C>(w);
  }
}

// An overflow step changes nothing (but the gradient is consumed).
__device__ __forceinline__ void adamw_skip(const AdamWParams& p, int64_t tid, int64_t stride) {
  if (p.zero_grad)
    for (int64_t i = tid; i < p.P; i += stride) p.grad[i] = 0.f;
}

template <typename C>
__global__ void __launch_bounds__(256) adamw_kernel(AdamWParams p) {
  const double* h = p.hyper;
  const double* sc = p.scalars;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
  if (sc[5] > 0.0 && h[6] > 0.0) return adamw_skip(p, tid, stride);
  // 4 elements per thread (one element per thread loaded four at a time made the kernel wait on memory: ncu, 16 x 64)
  adamw_apply<C, 1>(p, adamw_consts(h, sc[1], sc[2], sc[6], sc[4]), tid, stride);
}

// grad_stats and AdamW in one cooperative launch on grad_stats' grid: every block writes its partial sums, the
// grid synchronises, every block sums the partials in the same fixed order (the same bits as grad_stats' last
// block), block 0 stores the statistics and every block applies the update with them. The step counter and the
// previous bias corrections are read before the grid barrier (block 0 rewrites them after it). What it saves
// against the two launches: one launch and grad_stats' serial tail (its last block summing alone).
template <typename C>
__global__ void __launch_bounds__(GS_THREADS) optim_step_kernel(GradStatsParams gp, AdamWParams p) {
  __shared__ double sh[GS_THREADS / 32];
  __shared__ GsResult res;
  const double s0 = gp.scalars[0], s1 = gp.scalars[1], s2 = gp.scalars[2];
  double acc, bad;
  gs_block_sums(gp, sh, acc, bad);
  if (threadIdx.x == 0) {
    gp.ws[blockIdx.x] = acc;
    gp.ws[gridDim.x + blockIdx.x] = bad;
  }
  cooperative_groups::this_grid().sync();
  double sq, nbad;
  gs_total(gp.ws, sh, sq, nbad);
  if (threadIdx.x == 0) {
    res = gs_finish(sq, nbad, gp, s0, s1, s2);
    if (blockIdx.x == 0) gs_store(res, gp.scalars);
  }
  __syncthreads();
  const int64_t tid = (int64_t)blockIdx.x * GS_THREADS + threadIdx.x, stride = (int64_t)gridDim.x * GS_THREADS;
  if (res.skip) return adamw_skip(p, tid, stride);
  adamw_apply<C, 2>(p, adamw_consts(p.hyper, res.bc1, res.bc2, res.invd, res.clip), tid, stride);
}

const char* adamw_step(const AdamWParams& p, cudaStream_t s) {
  int64_t nb = (p.P / 4 + 255) / 256;  // 4 elements per thread (the tail, or unaligned arenas: the same threads loop)
  if (nb > 132 * 16) nb = 132 * 16;
  if (nb < 1) nb = 1;
  switch (p.compute ? p.compute_dtype : kF32) {
    case kF32: adamw_kernel<float><<<(unsigned)nb, 256, 0, s>>>(p); break;
    case kBF16: adamw_kernel<__nv_bfloat16><<<(unsigned)nb, 256, 0, s>>>(p); break;
    case kF16: adamw_kernel<__half><<<(unsigned)nb, 256, 0, s>>>(p); break;
    default: return "adamw_step: unsupported compute dtype";
  }
  MRL_LAUNCH_CHECK();
  return nullptr;
}

static void* optim_step_fn(int compute_dtype) {
  switch (compute_dtype) {
    case kF32: return (void*)optim_step_kernel<float>;
    case kBF16: return (void*)optim_step_kernel<__nv_bfloat16>;
    case kF16: return (void*)optim_step_kernel<__half>;
  }
  return nullptr;
}

// Whether the fused launch runs P elements on the current device: grad_stats' grid must be co-resident (a
// cooperative launch) and uncapped (P <= 8 elements per thread of it, so that each thread's share of AdamW is
// at most one round of 2 x 4 elements and the 264-block grid is no slower than AdamW's own).
bool optim_step_fits(int64_t P, int compute_dtype) {
  const int grid = grad_stats_blocks(P);
  void* fn = optim_step_fn(compute_dtype);
  if (fn == nullptr || P > (int64_t)grid * GS_THREADS * 8) return false;
  return coop_capacity(fn, GS_THREADS, 0) >= grid;
}

const char* optim_step(const GradStatsParams& gp, const AdamWParams& p, cudaStream_t s) {
  void* fn = optim_step_fn(p.compute ? p.compute_dtype : kF32);
  if (fn == nullptr) return "optim_step: unsupported compute dtype";
  GradStatsParams g = gp;
  AdamWParams a = p;
  void* args[] = {&g, &a};
  const cudaError_t e = cudaLaunchCooperativeKernel(fn, dim3(grad_stats_blocks(p.P)), dim3(GS_THREADS), args, 0, s);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  return nullptr;
}

}  // namespace mrl
