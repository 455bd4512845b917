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

template <typename C>
__global__ void __launch_bounds__(256) adamw_kernel(AdamWParams p) {
  const double* h = p.hyper;
  const double* sc = p.scalars;
  if (sc[5] > 0.0 && h[6] > 0.0) {  // overflow step: nothing changes (but the gradient is consumed)
    if (p.zero_grad)
      for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.P; i += (int64_t)gridDim.x * blockDim.x)
        p.grad[i] = 0.f;
    return;
  }
  const float decay = (float)(1.0 - h[0] * h[4]);
  const float w1 = (float)(1.0 - h[1]);
  const float b2 = (float)h[2], w2 = (float)(1.0 - h[2]), eps = (float)h[3];
  const float step_size = (float)(h[0] / sc[1]);
  const float bc2_sqrt = (float)sqrt(sc[2]);
  const float inv = (float)sc[6], clip = (float)sc[4];
  C* comp = reinterpret_cast<C*>(p.compute);
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.P; i += (int64_t)gridDim.x * blockDim.x) {
    const float g = (p.grad[i] * inv) * clip;
    if (p.zero_grad) p.grad[i] = 0.f;
    float w = p.param[i];
    if (i < p.n_decay) w *= decay;
    float m = p.exp_avg[i];
    const float diff = g - m;
    m = (fabsf(w1) < 0.5f) ? m + w1 * diff : g - diff * (1.f - w1);  // torch.lerp
    float v = p.exp_avg_sq[i] * b2;
    v = v + w2 * g * g;
    const float denom = sqrtf(v) / bc2_sqrt + eps;
    w = w + (-step_size) * (m / denom);
    p.param[i] = w;
    p.exp_avg[i] = m;
    p.exp_avg_sq[i] = v;
    if (comp) comp[i] = from_f<C>(w);
  }
}

const char* adamw_step(const AdamWParams& p, cudaStream_t s) {
  int64_t nb = (p.P + 255) / 256;
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
