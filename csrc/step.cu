// backbone_step: weight-dtype dispatch.
#include "ops.h"
namespace mrl {
const char* backbone_step_f32(const StepParams&, int, cudaStream_t);
const char* backbone_step_bf16(const StepParams&, int, cudaStream_t);
const char* backbone_step_f16(const StepParams&, int, cudaStream_t);
const char* backbone_step_cluster_f32(const StepParams&, int, bool, cudaStream_t);
const char* backbone_step_cluster_bf16(const StepParams&, int, bool, cudaStream_t);
const char* backbone_step_cluster_f16(const StepParams&, int, bool, cudaStream_t);
bool backbone_step_cluster_ok(const StepParams& p);
const char* backbone_step_cluster2_f32(const StepParams&, int, cudaStream_t);
const char* backbone_step_cluster2_bf16(const StepParams&, int, cudaStream_t);
const char* backbone_step_cluster2_f16(const StepParams&, int, cudaStream_t);
bool backbone_step_cluster2_ok(const StepParams& p);
size_t backbone_step_cluster2_smem(const StepParams& p, int R);
const char* backbone_step_cluster3_f32(const StepParams&, int, cudaStream_t);
const char* backbone_step_cluster3_bf16(const StepParams&, int, cudaStream_t);
const char* backbone_step_cluster3_f16(const StepParams&, int, cudaStream_t);
bool backbone_step_cluster3_ok(const StepParams& p);
size_t backbone_step_cluster3_smem(const StepParams& p, int R);
int backbone_step_cluster3_max_clusters(const StepParams& p, int R);

// Dynamic shared memory of the one-block kernel for R rows (mirrors step_smem_bytes in step.cuh and
// mamba_rl/ops/capability.py step_smem_bytes).
static size_t rows_smem(const StepParams& p, int R) {
  return sizeof(float) * (size_t)R * (2 * p.dm + 3 * p.D + (p.rank + 2 * p.N) + p.in_dim);
}

// rows_per_block R: > 0 the one-block-per-R-rows kernel; -8..-1 the cluster kernel with -R rows per cluster;
// -48..-33 the second cluster kernel (step_cluster2.cuh) with -R - 32 rows; -96..-65 the third (step_cluster3.cuh,
// rows in parallel) with -R - 64 rows;
// -24..-17 the cluster kernel with -R - 16 rows and its RMSNorm as a pass behind a block barrier (the variant
// before the fused norm: the same bits, kept for the comparison in one process); 0 = automatic (the second cluster
// kernel up to B = 32, else the cluster kernel up to 32, the third cluster kernel up to 512, where each applies;
// else the measured R, halved until R rows fit the device's opt-in shared memory per block).
int backbone_step_rows(const StepParams& p, int R, const char** err) {
  *err = nullptr;
  if (R != 0) return R;
  int dev = 0, optin = 48 * 1024;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess) {
    *err = cudaGetErrorString(e);
    return 0;
  }
  // measured on H100 (benchmarks/NOTES.md, fourteenth session): the second cluster kernel wins up to B = 16 with
  // at most 8 clusters (B = 1: 30 us vs 35, B = 16 with 2 rows per cluster: 34 us vs 38; 16 clusters of 8 blocks
  // do not fit the GPCs at once: 51 us), and loses from B = 256 (156 us vs 68 for one block per 2 rows); and up to
  // B = 32 (twenty-sixth session, kernel alone, f32 / bf16 weights: 18.3 / 16.7 us with 4 rows a cluster, against
  // 34.6 / 61.5 for the cluster kernel with 2)
  if (p.B <= 32 && backbone_step_cluster2_ok(p)) {
    int rc = 1;
    while ((p.B + rc - 1) / rc > 8) rc *= 2;
    if (backbone_step_cluster2_smem(p, rc) <= (size_t)optin) return -rc - 32;
  }
  // measured on H200 (benchmarks/NOTES.md): the cluster kernel wins for small batches, one block per
  // 1-2 rows for large ones
  if (backbone_step_cluster_ok(p) && p.B <= 32) return p.B <= 16 ? -1 : -2;
  // the third cluster kernel up to B = 512: the rows a cluster that give the fewest waves x the time of one
  // wave, waves = ceil(clusters / the clusters the device runs at once). One wave's time per rows a cluster,
  // kernel alone, f32 weights (H200, benchmarks/NOTES.md, twenty-eighth session; bf16 within 4 %): 8 rows 19.6 us,
  // 16 31.5, 24 43.6, 32 51.7. So B = 64 takes 8 rows, 128 16, 256 24 (11 clusters: 43.6 us against 51.7 with 32
  // and 57.0 with 8 in two waves), 384 32 (12 clusters; 24 rows need 16, two waves: 83 us), 512 24 (22 clusters,
  // two waves: 86.3 us against 93.4 with 16 and 102.5 with 32); one block per 1-4 rows: 61-121 us there.
  if (p.B <= 512 && backbone_step_cluster3_ok(p)) {
    static const int rows[4] = {8, 16, 24, 32};
    static const float wave_us[4] = {19.6f, 31.5f, 43.6f, 51.7f};
    int best = 0;
    float best_us = 0.f;
    for (int i = 0; i < 4; ++i) {
      if (backbone_step_cluster3_smem(p, rows[i]) > (size_t)optin) continue;
      const int at_once = backbone_step_cluster3_max_clusters(p, rows[i]);
      if (at_once < 1) continue;
      const int clusters = (p.B + rows[i] - 1) / rows[i];
      const float us = (float)((clusters + at_once - 1) / at_once) * wave_us[i];
      if (best == 0 || us < best_us) best = rows[i], best_us = us;
    }
    if (best) return -best - 64;
  }
  R = p.B <= 132 ? 1 : (p.B <= 264 ? 2 : 4);
  while (R > 1 && rows_smem(p, R) > (size_t)optin) R /= 2;
  if (rows_smem(p, R) > (size_t)optin) {
    *err = "backbone_step: one row's activations exceed the shared memory per block";
    return 0;
  }
  return R;
}

// the launcher of weight dtype `wdtype` among one kernel's three instantiations, with R rows
using StepLaunch = const char* (*)(const StepParams&, int, cudaStream_t);
static const char* by_dtype(int wdtype, StepLaunch f32, StepLaunch bf16, StepLaunch f16, const StepParams& p, int R,
                            cudaStream_t s) {
  switch (wdtype) {
    case kF32: return f32(p, R, s);
    case kBF16: return bf16(p, R, s);
    case kF16: return f16(p, R, s);
  }
  return "backbone_step: unsupported weight dtype";
}

const char* backbone_step(int wdtype, const StepParams& p, int R, cudaStream_t s) {
  if (p.L < 1 || p.L > STEP_MAX_LAYERS) return "backbone_step: n_layers must be in [1, 16]";
  if (R == 0) {
    const char* err = nullptr;
    R = backbone_step_rows(p, 0, &err);
    if (err) return err;
  }
  if (R <= -65) {
    if (!backbone_step_cluster3_ok(p))
      return "backbone_step: the cluster3 kernel needs d_model 128, d_inner 256, d_conv 4, d_state 8/16, dt_rank <= 16 "
             "and 16-byte aligned weights";
    return by_dtype(wdtype, backbone_step_cluster3_f32, backbone_step_cluster3_bf16, backbone_step_cluster3_f16, p,
                    -R - 64, s);
  }
  if (R <= -33) {
    if (!backbone_step_cluster2_ok(p))
      return "backbone_step: the cluster2 kernel needs d_model 128, d_inner 256, d_conv 4, d_state 8/16, dt_rank <= 16 "
             "and 16-byte aligned weights";
    return by_dtype(wdtype, backbone_step_cluster2_f32, backbone_step_cluster2_bf16, backbone_step_cluster2_f16, p,
                    -R - 32, s);
  }
  if (R < 0) {
    if (!backbone_step_cluster_ok(p)) return "backbone_step: the cluster kernel needs d_inner 256, d_conv 4, d_state 8/16";
    const bool fused_norm = R >= -8;
    const int rows = fused_norm ? -R : -R - 16;
    switch (wdtype) {
      case kF32: return backbone_step_cluster_f32(p, rows, fused_norm, s);
      case kBF16: return backbone_step_cluster_bf16(p, rows, fused_norm, s);
      case kF16: return backbone_step_cluster_f16(p, rows, fused_norm, s);
    }
    return "backbone_step: unsupported weight dtype";
  }
  return by_dtype(wdtype, backbone_step_f32, backbone_step_bf16, backbone_step_f16, p, R, s);
}
}  // namespace mrl
