// Host cost of launching the one-token step's kernel shape: an 8-block cluster of 256 threads that does nothing,
// with the step's 1.4 KB StepParams by value against an 8-byte pointer to the same block in device memory, and
// without the cluster. Per launch: host microseconds (steady_clock around the launch call, median of 2000) and the
// bench's method (events around every launch, median of 1000). No Python.
// nvcc -arch=sm_90 -O3 -std=c++17 -Icsrc -o launch_probe benchmarks/probes/launch_probe.cu && ./launch_probe
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
#include "ops.h"
using mrl::StepParams;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); return 1; } } while (0)

__global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(256, 1) k_byval(StepParams p) {
  if (p.B < 0 && threadIdx.x == 0) p.out[0] = p.eps;
}
__global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(256, 1) k_byptr(const StepParams* p) {
  if (p->B < 0 && threadIdx.x == 0) p->out[0] = p->eps;
}
__global__ void __launch_bounds__(256, 1) k_byval_nocl(StepParams p) {
  if (p.B < 0 && threadIdx.x == 0) p.out[0] = p.eps;
}

template <typename F>
static double host_us(F f) {
  std::vector<double> t;
  for (int i = 0; i < 2000; ++i) {
    if (i % 50 == 0) cudaDeviceSynchronize();
    auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count());
  }
  cudaDeviceSynchronize();
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
template <typename F>
static double event_us(F f, cudaStream_t s) {
  cudaEvent_t a, b;
  cudaEventCreate(&a); cudaEventCreate(&b);
  std::vector<float> t;
  for (int i = 0; i < 1000; ++i) {
    cudaEventRecord(a, s); f(); cudaEventRecord(b, s); cudaEventSynchronize(b);
    float ms = 0; cudaEventElapsedTime(&ms, a, b); t.push_back(ms * 1e3f);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main() {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  StepParams p{};
  p.B = 1; p.eps = 1e-5f;
  float* out; CK(cudaMalloc(&out, 4)); p.out = out;
  StepParams* dp; CK(cudaMalloc(&dp, sizeof(StepParams)));
  CK(cudaMemcpy(dp, &p, sizeof(StepParams), cudaMemcpyHostToDevice));
  auto byval = [&] { k_byval<<<8, 256, 0, s>>>(p); };
  auto byptr = [&] { k_byptr<<<8, 256, 0, s>>>(dp); };
  auto nocl = [&] { k_byval_nocl<<<8, 256, 0, s>>>(p); };
  for (int i = 0; i < 100; ++i) { byval(); byptr(); nocl(); }
  CK(cudaStreamSynchronize(s));
  CK(cudaGetLastError());
  std::printf("{\"param_bytes\": %zu,\n", sizeof(StepParams));
  std::printf(" \"cluster8_byvalue\": {\"host_us\": %.2f, \"event_us\": %.2f},\n", host_us(byval), event_us(byval, s));
  std::printf(" \"cluster8_pointer\": {\"host_us\": %.2f, \"event_us\": %.2f},\n", host_us(byptr), event_us(byptr, s));
  std::printf(" \"nocluster_byvalue\": {\"host_us\": %.2f, \"event_us\": %.2f}}\n", host_us(nocl), event_us(nocl, s));
  CK(cudaGetLastError());
  return 0;
}
