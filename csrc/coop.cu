// Cooperative single launches: a kernel whose passes are separated by grid barriers instead of separate
// launches (the scan's local / main / reduction passes, the conv backward and its weight-gradient sums, the
// optimizer's statistics and AdamW).
#include "common.cuh"

namespace mrl {

// The current device's SM count, asked once per device (132 where the query fails).
int sm_count() {
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

static int g_coop = COOP_ALL;
void set_coop(int mask) { g_coop = mask & COOP_ALL; }

int64_t coop_capacity(const void* kernel, int threads, int smem) {
  // co-resident blocks per SM of each kernel (a handful of instantiations), and the device's SM count and
  // cooperative-launch attribute, asked once per device so that an eager step pays no driver queries (a failed
  // query is not cached: asked again next time)
  struct Entry { const void* fn; int threads, smem, per_sm; };
  static Entry cache[64][32] = {};
  static int sms[64] = {};  // 0: not asked; -1: no cooperative launch
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) { (void)cudaGetLastError(); return 0; }
  if (sms[dev] == 0) {
    int c = 0, n = 0;
    if (cudaDeviceGetAttribute(&c, cudaDevAttrCooperativeLaunch, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    sms[dev] = (c && n > 0) ? n : -1;
  }
  if (sms[dev] < 0) return 0;
  int per_sm = -1, slot = -1;
  for (int i = 0; i < 32; ++i) {
    const Entry& e = cache[dev][i];
    if (e.fn == kernel && e.threads == threads && e.smem == smem) { per_sm = e.per_sm; break; }
    if (e.fn == nullptr) { slot = i; break; }
  }
  if (per_sm < 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    if (slot >= 0) cache[dev][slot] = {kernel, threads, smem, per_sm};
  }
  return (int64_t)per_sm * sms[dev];
}

bool coop_fits(int which, const void* kernel, int threads, int smem, dim3 grid) {
  return (g_coop & which) != 0 && (int64_t)grid.x * grid.y * grid.z <= coop_capacity(kernel, threads, smem);
}

}  // namespace mrl
