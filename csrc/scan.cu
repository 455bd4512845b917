// selective_scan: dtype dispatch and the fixed-order reductions of the backward.
#include "scan_common.cuh"

namespace mrl {
const char* scan_fwd_f32(const ScanFwdParams&, cudaStream_t);
const char* scan_fwd_bf16(const ScanFwdParams&, cudaStream_t);
const char* scan_fwd_f16(const ScanFwdParams&, cudaStream_t);
const char* scan_bwd_f32(const ScanBwdParams&, cudaStream_t);
const char* scan_bwd_bf16(const ScanBwdParams&, cudaStream_t);
const char* scan_bwd_f16(const ScanBwdParams&, cudaStream_t);

int scan_chunk() { return SCAN_TC; }

static int scan_tiles(int D, int N) { const int cpb = SCAN_THREADS / (N / SCAN_NPT); return (D + cpb - 1) / cpb; }

static int g_forced_segments = 0;  // scan_set_segments(): 0 = automatic
void scan_set_segments(int n) { g_forced_segments = n > 0 ? n : 0; }

static int sm_count() {
  static int cache[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) { (void)cudaGetLastError(); return 132; }
  if (cache[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n < 1) {
      (void)cudaGetLastError();
      n = 132;
    }
    cache[dev] = n;
  }
  return cache[dev];
}

// The time split: nseg segments of seg_len chunks (the last may be shorter, none empty). The grid is
// tiles x B x nseg blocks of which minb fit on an SM: nseg is the largest count that still fits the grid in
// one wave (a second, partial wave would double the time), at least 1, at most the number of chunks.
struct ScanSplit { int nseg, seg_len; };
static ScanSplit scan_split(int B, int T, int D, int N, int minb) {
  const int nC = (T + SCAN_TC - 1) / SCAN_TC;
  const int64_t base = (int64_t)scan_tiles(D, N) * B;
  int64_t want = g_forced_segments > 0 ? g_forced_segments : ((int64_t)sm_count() * minb) / base;
  want = want < 1 ? 1 : (want > nC ? nC : want);
  const int len = (int)((nC + want - 1) / want);
  return {(nC + len - 1) / len, len};
}

int scan_segments(int B, int T, int D, int N, bool bwd) {
  return scan_split(B, T, D, N, bwd ? SCAN_BWD_MINB : scan_fwd_minb(N)).nseg;
}

int64_t scan_fwd_workspace(int B, int T, int D, int N) {
  const ScanSplit sp = scan_split(B, T, D, N, scan_fwd_minb(N));
  return sp.nseg > 1 ? 2 * (int64_t)B * sp.nseg * D * N : 4;
}

int64_t scan_bwd_workspace(int B, int T, int D, int N) {
  const ScanSplit sp = scan_split(B, T, D, N, SCAN_BWD_MINB);
  return (int64_t)scan_tiles(D, N) * B * T * 2 * N + 2 * (int64_t)B * sp.nseg * D * N +
         (int64_t)B * sp.nseg * (D * N + 2 * (int64_t)D);
}

const char* scan_fwd(int dtype, const ScanFwdParams& p0, cudaStream_t s) {
  ScanFwdParams p = p0;
  const ScanSplit sp = scan_split(p.B, p.T, p.D, p.N, scan_fwd_minb(p.N));
  p.nseg = sp.nseg; p.seg_len = sp.seg_len;
  switch (dtype) {
    case kF32: return scan_fwd_f32(p, s);
    case kBF16: return scan_fwd_bf16(p, s);
    case kF16: return scan_fwd_f16(p, s);
  }
  return "selective_scan: unsupported dtype";
}

// One finalize launch: blocks [0, nbc) sum dB/dC over channel tiles (thread per (b, t, j)), the others
// sum dA_log / dD / ddt_bias over the B * nseg (row, segment) partials (32 columns x 8 row groups per
// block, fixed order).
template <typename T>
__global__ void __launch_bounds__(256) scan_finalize(const float* __restrict__ pBC, int ntiles, int64_t Mbc, int N,
                                                     T* dB, T* dC, int nbc, const float* __restrict__ pPar, int rows,
                                                     int D, float* dA_log, float* dD, float* ddt_bias, bool acc) {
  if ((int)blockIdx.x < nbc) {
    const int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x;
    if (i >= Mbc) return;
    float a = 0.f;
    for (int k = 0; k < ntiles; ++k) a += pBC[(int64_t)k * Mbc + i];
    const int64_t bt = i / (2 * N);
    const int j = (int)(i % (2 * N));
    if (j < N) dB[bt * N + j] = from_f<T>(a); else dC[bt * N + j - N] = from_f<T>(a);
    return;
  }
  __shared__ float part[8][33];
  const int M = D * N + 2 * D;
  const int col = ((int)blockIdx.x - nbc) * 32 + (threadIdx.x & 31);
  const int rg = threadIdx.x >> 5;
  float a = 0.f;
  if (col < M)
    for (int r = rg; r < rows; r += 8) a += pPar[(int64_t)r * M + col];
  part[rg][threadIdx.x & 31] = a;
  __syncthreads();
  if (rg == 0 && col < M) {
    float v = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) v += part[k][threadIdx.x & 31];
    float* dst = col < D * N ? dA_log + col : (col < D * N + D ? dD + (col - D * N) : ddt_bias + (col - D * N - D));
    *dst = acc ? *dst + v : v;
  }
}

template <typename T>
static void scan_bwd_finalize(const ScanBwdParams& q, cudaStream_t s) {
  const auto& p = q.f;
  const int ntiles = scan_tiles(p.D, p.N);
  const int64_t Mbc = (int64_t)p.B * p.T * 2 * p.N;
  const int nbc = (int)((Mbc + 255) / 256);
  const int M = p.D * p.N + 2 * p.D;
  const float* pPar = q.ws + (int64_t)ntiles * Mbc + 2 * (int64_t)p.B * p.nseg * p.D * p.N;
  scan_finalize<T><<<nbc + (M + 31) / 32, 256, 0, s>>>(q.ws, ntiles, Mbc, p.N, (T*)q.dB, (T*)q.dC, nbc, pPar,
                                                       p.B * p.nseg, p.D, q.dA_log, q.dD, q.ddt_bias,
                                                       q.accumulate);
}

const char* scan_bwd(int dtype, const ScanBwdParams& q0, cudaStream_t s) {
  ScanBwdParams q = q0;
  const ScanSplit sp = scan_split(q.f.B, q.f.T, q.f.D, q.f.N, SCAN_BWD_MINB);
  q.f.nseg = sp.nseg; q.f.seg_len = sp.seg_len;
  // one segment that overfills 3 blocks per SM: the 4-block build (SCAN_BWD_MINB_WIDE; nseg is 1 either way)
  q.wide = q.f.N == 16 && (int64_t)scan_tiles(q.f.D, q.f.N) * q.f.B > (int64_t)SCAN_BWD_MINB * sm_count();
  const char* err = nullptr;
  switch (dtype) {
    case kF32: err = scan_bwd_f32(q, s); if (!err) scan_bwd_finalize<float>(q, s); break;
    case kBF16: err = scan_bwd_bf16(q, s); if (!err) scan_bwd_finalize<__nv_bfloat16>(q, s); break;
    case kF16: err = scan_bwd_f16(q, s); if (!err) scan_bwd_finalize<__half>(q, s); break;
    default: return "selective_scan: unsupported dtype";
  }
  if (err) return err;
  MRL_LAUNCH_CHECK();
  return nullptr;
}
}  // namespace mrl
