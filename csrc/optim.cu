// Flat-arena optimizer kernels: global grad norm / overflow / bias corrections (one launch, last block
// finishes), AdamW with a decay boundary and the compute-dtype copy (one launch).
// Everything is read from device buffers (hyper, scalars, loss_scale): graph replays see new values.
#include "common.cuh"

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

__global__ void __launch_bounds__(GS_THREADS) grad_stats_kernel(GradStatsParams p) {
  __shared__ double sh[GS_THREADS / 32];
  __shared__ bool is_last;
  const float inv = 1.f / p.loss_scale[0];
  const double invd = 1.0 / (double)p.loss_scale[0];
  double acc = 0.0, bad = 0.0;
  for (int64_t i = (int64_t)blockIdx.x * GS_THREADS + threadIdx.x; i < p.P; i += (int64_t)gridDim.x * GS_THREADS) {
    const float g = p.grad[i];
    if (!isfinite(g)) bad = 1.0;
    const double gd = (double)g * invd;
    acc = fma(gd, gd, acc);
  }
  (void)inv;
  acc = block_sum_d(acc, sh);
  bad = block_sum_d(bad, sh);
  if (threadIdx.x == 0) {
    p.ws[blockIdx.x] = acc;
    p.ws[gridDim.x + blockIdx.x] = bad;
    __threadfence();
    const unsigned int done = atomicAdd(p.counter, 1u);
    is_last = (done == gridDim.x - 1);
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  double sq = 0.0, nbad = 0.0;
  for (int i = threadIdx.x; i < (int)gridDim.x; i += GS_THREADS) {
    sq += ((volatile double*)p.ws)[i];
    nbad += ((volatile double*)p.ws)[gridDim.x + i];
  }
  sq = block_sum_d(sq, sh);
  nbad = block_sum_d(nbad, sh);
  if (threadIdx.x == 0) {
    *p.counter = 0u;  // ready for the next launch / graph replay
    const double* h = p.hyper;
    double* s = p.scalars;
    if (p.extra_sq) sq += (double)p.extra_sq[0];
    const double norm = sqrt(sq);
    double clip = h[5] / (norm + 1e-6);
    clip = clip < 1.0 ? clip : 1.0;
    if (norm != norm) clip = norm;  // NaN propagates like torch.clamp
    const bool found = nbad > 0.0;
    const bool skip = found && h[6] > 0.0;
    const double step = s[0] + (skip ? 0.0 : 1.0);
    const double t = step < 1073741824.0 ? step : 1073741824.0;
    if (!skip) {
      s[1] = 1.0 - pow(h[1], t);
      s[2] = 1.0 - pow(h[2], t);
    }
    s[0] = step;
    s[3] = norm;
    s[4] = clip;
    s[5] = found ? 1.0 : 0.0;
    s[6] = invd;
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

template <typename C>
__global__ void __launch_bounds__(256) adamw_kernel(AdamWParams p) {
  const double* h = p.hyper;
  const double* sc = p.scalars;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
  if (sc[5] > 0.0 && h[6] > 0.0) {  // overflow step: nothing changes (but the gradient is consumed)
    if (p.zero_grad)
      for (int64_t i = tid; i < p.P; i += stride) p.grad[i] = 0.f;
    return;
  }
  AdamWConsts k;
  k.decay = (float)(1.0 - h[0] * h[4]);
  k.w1 = (float)(1.0 - h[1]);
  k.b2 = (float)h[2]; k.w2 = (float)(1.0 - h[2]); k.eps = (float)h[3];
  k.step_size = (float)(h[0] / sc[1]);
  k.bc2_sqrt = (float)sqrt(sc[2]);
  k.inv = (float)sc[6]; k.clip = (float)sc[4];
  C* comp = reinterpret_cast<C*>(p.compute);
  // 4 elements per thread with 16-byte loads where every arena allows it (the same arithmetic per element: the
  // same bits); one element per thread loaded four at a time made the kernel wait on memory (ncu, 16 x 64)
  const bool vec = ((reinterpret_cast<uintptr_t>(p.grad) | reinterpret_cast<uintptr_t>(p.param) |
                     reinterpret_cast<uintptr_t>(p.exp_avg) | reinterpret_cast<uintptr_t>(p.exp_avg_sq)) % 16 == 0) &&
                   reinterpret_cast<uintptr_t>(comp) % (4 * sizeof(C)) == 0;
  const int64_t n4 = vec ? p.P / 4 : 0;
  for (int64_t q = tid; q < n4; q += stride) {
    const float4 g4 = reinterpret_cast<const float4*>(p.grad)[q];
    const float4 w4 = reinterpret_cast<const float4*>(p.param)[q];
    const float4 m4 = reinterpret_cast<const float4*>(p.exp_avg)[q];
    const float4 v4 = reinterpret_cast<const float4*>(p.exp_avg_sq)[q];
    if (p.zero_grad) reinterpret_cast<float4*>(p.grad)[q] = make_float4(0.f, 0.f, 0.f, 0.f);
    const float g[4] = {g4.x, g4.y, g4.z, g4.w};
    float w[4] = {w4.x, w4.y, w4.z, w4.w}, m[4] = {m4.x, m4.y, m4.z, m4.w}, v[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
    for (int c = 0; c < 4; ++c) adamw_elem(k, g[c], 4 * q + c < p.n_decay, w[c], m[c], v[c]);
    reinterpret_cast<float4*>(p.param)[q] = make_float4(w[0], w[1], w[2], w[3]);
    reinterpret_cast<float4*>(p.exp_avg)[q] = make_float4(m[0], m[1], m[2], m[3]);
    reinterpret_cast<float4*>(p.exp_avg_sq)[q] = make_float4(v[0], v[1], v[2], v[3]);
    if (comp) Comp4<C>::store(comp, q, w);
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

}  // namespace mrl
