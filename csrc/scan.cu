// selective_scan: dtype dispatch and the fixed-order reductions of the backward.
#include "scan.cuh"

namespace mrl {
const char* scan_fwd_f32(const ScanFwdParams&, cudaStream_t);
const char* scan_fwd_bf16(const ScanFwdParams&, cudaStream_t);
const char* scan_fwd_f16(const ScanFwdParams&, cudaStream_t);
const char* scan_bwd_f32(const ScanBwdParams&, cudaStream_t);
const char* scan_bwd_bf16(const ScanBwdParams&, cudaStream_t);
const char* scan_bwd_f16(const ScanBwdParams&, cudaStream_t);

int scan_chunk() { return SCAN_TC; }

static int scan_tiles(int D, int N) { const int cpb = SCAN_THREADS / N; return (D + cpb - 1) / cpb; }

int64_t scan_bwd_workspace(int B, int T, int D, int N) {
  return (int64_t)scan_tiles(D, N) * B * T * 2 * N + (int64_t)B * D * N + 2 * (int64_t)B * D;
}

const char* scan_fwd(int dtype, const ScanFwdParams& p, cudaStream_t s) {
  switch (dtype) {
    case kF32: return scan_fwd_f32(p, s);
    case kBF16: return scan_fwd_bf16(p, s);
    case kF16: return scan_fwd_f16(p, s);
  }
  return "selective_scan: unsupported dtype";
}

// dB/dC: sum over channel tiles, one thread per (b, t, j); written in the activation dtype.
template <typename T>
__global__ void scan_bc_reduce(const float* __restrict__ pBC, int ntiles, int64_t M, int N, T* dB, T* dC) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= M) return;
  float acc = 0.f;
  for (int k = 0; k < ntiles; ++k) acc += pBC[(int64_t)k * M + i];
  const int64_t bt = i / (2 * N);
  const int j = (int)(i % (2 * N));
  if (j < N) dB[bt * N + j] = from_f<T>(acc); else dC[bt * N + j - N] = from_f<T>(acc);
}

struct ScanParamGradOut {
  float* dA_log; float* dD; float* ddt_bias; int DN, D;
  __device__ void operator()(int j, float v) const {
    if (j < DN) dA_log[j] = v;
    else if (j < DN + D) dD[j - DN] = v;
    else ddt_bias[j - DN - D] = v;
  }
};

template <typename T>
static void scan_bwd_reduce(const ScanBwdParams& q, cudaStream_t s) {
  const auto& p = q.f;
  const int ntiles = scan_tiles(p.D, p.N);
  const int64_t M = (int64_t)p.B * p.T * 2 * p.N;
  scan_bc_reduce<T><<<(unsigned)((M + 255) / 256), 256, 0, s>>>(q.ws, ntiles, M, p.N, (T*)q.dB, (T*)q.dC);
}

const char* scan_bwd(int dtype, const ScanBwdParams& q, cudaStream_t s) {
  const char* err = nullptr;
  switch (dtype) {
    case kF32: err = scan_bwd_f32(q, s); if (!err) scan_bwd_reduce<float>(q, s); break;
    case kBF16: err = scan_bwd_bf16(q, s); if (!err) scan_bwd_reduce<__nv_bfloat16>(q, s); break;
    case kF16: err = scan_bwd_f16(q, s); if (!err) scan_bwd_reduce<__half>(q, s); break;
    default: return "selective_scan: unsupported dtype";
  }
  if (err) return err;
  MRL_LAUNCH_CHECK();
  const auto& p = q.f;
  const int ntiles = scan_tiles(p.D, p.N);
  const float* pPar = q.ws + (int64_t)ntiles * p.B * p.T * 2 * p.N;
  launch_colsum(pPar, p.B, p.D * p.N + 2 * p.D, ScanParamGradOut{q.dA_log, q.dD, q.ddt_bias, p.D * p.N, p.D}, s);
  MRL_LAUNCH_CHECK();
  return nullptr;
}
}  // namespace mrl
