// Standalone probe of the one-token cluster kernels (csrc/step_cluster2.cuh, csrc/step_cluster3.cuh), no Python or
// torch: random f32 weights and states at the default model (d_model 128, 3 layers, d_state 16, dt_rank 8,
// input_dim 32), the kernel captured alone in CUDA graphs.
//   nvcc -arch=sm_90 -O3 -std=c++17 -o cluster2_probe benchmarks/probes/cluster2_probe.cu
//   ./cluster2_probe B R [kernel]   (2: cluster2, R = rows per cluster 1, 2, 4, 8 or 16; 3: cluster3, R = 8, 16
//                                    or 32; default 2)
// prints: whether two launches from the same state give the same bits (and a hash of them, to compare builds); a 1-launch graph replayed back to back
// (median of 7 rounds of 1000); the per-launch time in a 20-launch graph; one replay with events around it,
// synchronised (bench.py's method without Python), beside an empty 8-block cluster kernel the same way.
// Built with -DMRL_SC2_PROBE it prints instead the clock64() stamps of every warp at each phase end of cluster 0
// (SC2_STAMP in the kernel): cycles since the block's first stamp, min..max over the 8 warps, per block; and per
// cluster, from the global nanosecond timer, when its blocks started and ended (the waves). Either build first
// prints how many of the kernel's clusters the device holds at once (cudaOccupancyMaxActiveClusters).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <utility>
#include <vector>
#include "../../csrc/step_cluster3.cuh"
using namespace mrl;

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__);           \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)
#define CKL(x)                                                         \
  do {                                                                 \
    const char* m_ = (x);                                              \
    if (m_) { printf("launch failed: %s (line %d)\n", m_, __LINE__); exit(1); } \
  } while (0)

static std::mt19937 rng(1234);
static float* dev_rand(size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> U(lo, hi);
  std::vector<float> h(n);
  for (auto& v : h) v = U(rng);
  float* d;
  CK(cudaMalloc(&d, n * 4));
  CK(cudaMemcpy(d, h.data(), n * 4, cudaMemcpyHostToDevice));
  return d;
}

typedef const char* (*LaunchFn)(const StepParams&, cudaStream_t);
#ifndef MRL_SC2_PROBE
__global__ void __cluster_dims__(8, 1, 1) empty_cluster_kernel() {}
static const char* launch_empty(const StepParams& p, cudaStream_t s) {
  empty_cluster_kernel<<<8, 256, 0, s>>>();
  return cudaGetLastError() == cudaSuccess ? nullptr : "empty kernel";
}
#endif

int main(int argc, char** argv) {
  const int B = argc > 1 ? atoi(argv[1]) : 1, R = argc > 2 ? atoi(argv[2]) : 1;
  const int KER = argc > 3 ? atoi(argv[3]) : 2;  // which cluster kernel
  const int L = 3, dm = 128, D = 256, N = 16, K = 4, rk = 8, in_dim = 32;
  // the launcher and the kernel of each kernel and rows-per-cluster setting (f32, d_state 16)
#define MRL_PROBE_R(KK, RR) KER == KK && R == RR                                                         \
      ? std::make_pair((LaunchFn)stepc##KK##_launch_rn<float, RR, 16>,                                \
                       (const void*)backbone_step_cluster##KK##_kernel<float, RR, 16>)
  const auto [fn, kf] = MRL_PROBE_R(2, 1) : MRL_PROBE_R(2, 2) : MRL_PROBE_R(2, 4) : MRL_PROBE_R(2, 8)
                      : MRL_PROBE_R(2, 16) : MRL_PROBE_R(3, 8) : MRL_PROBE_R(3, 16) : MRL_PROBE_R(3, 24)
                      : MRL_PROBE_R(3, 32)
                      : std::make_pair((LaunchFn) nullptr, (const void*)nullptr);
#undef MRL_PROBE_R
  if (B < 1 || !fn) {
    printf("usage: %s B R [kernel] (B >= 1; kernel 2: R in 1 2 4 8 16, 3: R in 8 16 24 32), got %d %d %d\n", argv[0], B, R,
           KER);
    return 2;
  }
  StepParams p;
  memset(&p, 0, sizeof(p));
  p.B = B; p.in_dim = in_dim; p.dm = dm; p.D = D; p.N = N; p.K = K; p.rank = rk; p.L = L; p.eps = 1e-5f;
  p.x = dev_rand((size_t)B * in_dim, -1, 1);
  p.inp_w = dev_rand((size_t)dm * in_dim, -0.18f, 0.18f);
  p.inp_b = dev_rand(dm, -0.1f, 0.1f);
  p.normf_w = dev_rand(dm, 0.8f, 1.2f);
  const size_t cs_n = (size_t)L * B * D * 3, ss_n = (size_t)L * B * D * N;
  float *cs0 = dev_rand(cs_n, -1, 1), *ss0 = dev_rand(ss_n, -1, 1), *cs, *ss, *out;
  CK(cudaMalloc(&cs, cs_n * 4)); CK(cudaMalloc(&ss, ss_n * 4)); CK(cudaMalloc(&out, (size_t)B * dm * 4));
  p.conv_state = cs; p.ssm_state = ss; p.out = out;
  bool* starts;
  CK(cudaMalloc(&starts, B));
  std::vector<char> sv(B);
  for (int b = 0; b < B; ++b) sv[b] = b % 3 == 1;
  CK(cudaMemcpy(starts, sv.data(), B, cudaMemcpyHostToDevice));
  p.starts = starts;
  for (int l = 0; l < L; ++l) {
    StepLayer& ly = p.layer[l];
    ly.norm_w = dev_rand(dm, 0.8f, 1.2f);
    ly.in_w = dev_rand((size_t)2 * D * dm, -0.088f, 0.088f);
    ly.conv_w = dev_rand((size_t)D * K, -0.5f, 0.5f);
    ly.conv_b = dev_rand(D, -0.2f, 0.2f);
    ly.x_w = dev_rand((size_t)(rk + 2 * N) * D, -0.0625f, 0.0625f);
    ly.dt_w = dev_rand((size_t)D * rk, -0.35f, 0.35f);
    ly.dt_b = dev_rand(D, -6.f, -2.f);
    std::vector<float> al((size_t)D * N);
    for (int d = 0; d < D; ++d)
      for (int n = 0; n < N; ++n) al[(size_t)d * N + n] = logf(n + 1.f);
    float* a;
    CK(cudaMalloc(&a, al.size() * 4));
    CK(cudaMemcpy(a, al.data(), al.size() * 4, cudaMemcpyHostToDevice));
    ly.A_log = a;
    ly.Dp = dev_rand(D, 0.5f, 1.5f);
    ly.out_w = dev_rand((size_t)dm * D, -0.0625f, 0.0625f);
  }
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
#ifdef MRL_SC2_PROBE
  const int blocks = (B + R - 1) / R * SC2_CL;
  long long* pb;
  CK(cudaMalloc(&pb, (size_t)blocks * SC2_W * 64 * 8));
  CK(cudaMemcpyToSymbol(sc2_probe_buf, &pb, sizeof(pb)));
#endif
  {  // how many clusters of this kernel the device holds at once (one wave or more)
    const size_t smem = KER == 3 ? stepc3_smem_bytes(p, R) : stepc2_smem_bytes(p, R);
    CK(cudaFuncSetAttribute(kf, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((B + R - 1) / R * SC2_CL);
    cfg.blockDim = dim3(SC2_THREADS);
    cfg.dynamicSmemBytes = smem;
    int nc = 0;
    CK(cudaOccupancyMaxActiveClusters(&nc, kf, &cfg));
    printf("B=%d R=%d: %d clusters, at most %d active at once (%zu B of shared memory a block)\n", B, R,
           (B + R - 1) / R, nc, smem);
  }
  // the same 6 steps from the same states twice: the same bits
  std::vector<float> o[2];
  for (int v = 0; v < 2; ++v) {
    CK(cudaMemcpy(cs, cs0, cs_n * 4, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(ss, ss0, ss_n * 4, cudaMemcpyDeviceToDevice));
    for (int t = 0; t < 6; ++t) CKL(fn(p, s));
    CK(cudaStreamSynchronize(s));
    o[v].resize((size_t)B * dm + ss_n);
    CK(cudaMemcpy(o[v].data(), out, (size_t)B * dm * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(o[v].data() + (size_t)B * dm, ss, ss_n * 4, cudaMemcpyDeviceToHost));
  }
  bool finite = true;
  for (float v : o[0]) finite = finite && std::isfinite(v);
  uint64_t fnv = 1469598103934665603ull;  // FNV-1a of the output and SSM states: compares builds bit for bit
  for (size_t i = 0; i < o[0].size() * 4; ++i) fnv = (fnv ^ reinterpret_cast<const unsigned char*>(o[0].data())[i]) * 1099511628211ull;
  printf("B=%d R=%d: same bits twice %d, finite %d, fnv %016llx\n", B, R,
         (int)!memcmp(o[0].data(), o[1].data(), o[0].size() * 4), (int)finite, (unsigned long long)fnv);
#ifdef MRL_SC2_PROBE
  CKL(fn(p, s));
  CK(cudaStreamSynchronize(s));
  std::vector<long long> st((size_t)blocks * SC2_W * 64);
  CK(cudaMemcpy(st.data(), pb, st.size() * 8, cudaMemcpyDeviceToHost));
  printf("stamps of cluster 0 (point: per block, cycles since the block's stamp 0, min..max over warps)\n");
  for (int k = 1; k < 64; ++k) {
    // points 2 + 18 l + [0, 18) per layer l; the prologue's 56 (layer 0's loads issued), 57 (input projection
    // done), 58 (first norm done), 59 (block barrier passed; 1: cluster barrier passed); 63 at exit
    if (k >= 2 + 18 * L && k != 63 && (k < 56 || k > 59)) continue;
    printf("pt %2d:", k);
    for (int bk = 0; bk < SC2_CL; ++bk) {
      const long long base = st[(size_t)bk * SC2_W * 64];
      long long lo = 1LL << 62, hi = -(1LL << 62);
      for (int w = 0; w < SC2_W; ++w) {
        const long long t = st[((size_t)bk * SC2_W + w) * 64 + k] - base;
        lo = std::min(lo, t); hi = std::max(hi, t);
      }
      printf(" %6lld..%-6lld", lo, hi);
    }
    printf("\n");
  }
  // the global timer of warp 0 at each block's start (61) and end (62), ns from the first start: the waves
  long long g0 = 1LL << 62;
  for (int bk = 0; bk < blocks; ++bk) g0 = std::min(g0, st[(size_t)bk * SC2_W * 64 + 61]);
  printf("global timer, per cluster: first block start .. last block start / first end .. last end (ns)\n");
  for (int c = 0; c < blocks / SC2_CL; ++c) {
    long long s0 = 1LL << 62, s1 = 0, e0 = 1LL << 62, e1 = 0;
    for (int bk = c * SC2_CL; bk < (c + 1) * SC2_CL; ++bk) {
      const long long a = st[(size_t)bk * SC2_W * 64 + 61] - g0, z = st[(size_t)bk * SC2_W * 64 + 62] - g0;
      s0 = std::min(s0, a); s1 = std::max(s1, a); e0 = std::min(e0, z); e1 = std::max(e1, z);
    }
    printf("  cluster %2d: start %6lld..%-6lld end %6lld..%-6lld\n", c, s0, s1, e0, e1);
  }
#else
  auto capture = [&](LaunchFn f, int n) {
    cudaGraph_t g;
    cudaGraphExec_t e;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < n; ++i) CKL(f(p, s));
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&e, g, 0));
    return e;
  };
  cudaGraphExec_t g1 = capture(fn, 1), g20 = capture(fn, 20), ge = capture(launch_empty, 1);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  auto median = [](std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  std::vector<float> t1, t20;
  for (int round = 0; round < 7; ++round) {
    float ms;
    for (int i = 0; i < 50; ++i) CK(cudaGraphLaunch(g1, s));
    CK(cudaEventRecord(e0, s));
    for (int i = 0; i < 1000; ++i) CK(cudaGraphLaunch(g1, s));
    CK(cudaEventRecord(e1, s)); CK(cudaEventSynchronize(e1)); CK(cudaEventElapsedTime(&ms, e0, e1));
    t1.push_back(ms);  // ms per 1000 = us per replay
    CK(cudaEventRecord(e0, s));
    for (int i = 0; i < 50; ++i) CK(cudaGraphLaunch(g20, s));
    CK(cudaEventRecord(e1, s)); CK(cudaEventSynchronize(e1)); CK(cudaEventElapsedTime(&ms, e0, e1));
    t20.push_back(ms);  // ms per 1000 launches
  }
  auto isolated = [&](cudaGraphExec_t g) {
    std::vector<float> ts;
    for (int i = 0; i < 400; ++i) {
      float ms;
      CK(cudaEventRecord(e0, s)); CK(cudaGraphLaunch(g, s)); CK(cudaEventRecord(e1, s));
      CK(cudaEventSynchronize(e1)); CK(cudaEventElapsedTime(&ms, e0, e1));
      ts.push_back(ms * 1000.f);
    }
    return median(ts);
  };
  printf("B=%d R=%d: graph of 1 launch back to back %.2f us, per launch in a 20-launch graph %.2f us, isolated "
         "replay %.2f us (empty cluster kernel %.2f us)\n", B, R, median(t1), median(t20), isolated(g1), isolated(ge));
#endif
  CK(cudaGetLastError());
  return 0;
}
