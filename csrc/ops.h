// Torch-free launcher declarations shared by the .cu files and the binding (binding.cpp).
// Every launcher enqueues on `stream` and returns nullptr on success or a static error string.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace mrl {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// ---------------- causal depthwise conv1d + SiLU ----------------
struct ConvFwdParams {
  const void* x; int64_t x_sb, x_st;   // [B, T, D], last-dim stride 1
  const float* w;                      // [D, K]
  const float* bias;                   // [D]
  const float* init;                   // [B, D, K-1] or nullptr (zeros)
  const bool* starts;                  // [B, T] or nullptr
  void* out;                           // [B, T, D] contiguous, x dtype
  float* final_state;                  // [B, D, K-1]
  int B, T, D, K;
};
struct ConvBwdParams {
  const void* x; int64_t x_sb, x_st;
  const float* w; const float* bias; const float* init; const bool* starts;
  const void* dout; int64_t g_sb, g_st;   // [B, T, D] x dtype
  const float* dfinal;                    // [B, D, K-1] or nullptr
  void* dx;                               // [B, T, D] contiguous, x dtype
  float* dinit;                           // [B, D, K-1] or nullptr
  float* dw;                              // [D, K]
  float* dbias;                           // [D]
  float* ws;                              // workspace: conv_bwd_workspace() floats
  int B, T, D, K;
};
int64_t conv_bwd_workspace(int B, int T, int D, int K);
const char* conv_fwd(int dtype, const ConvFwdParams& p, cudaStream_t s);
const char* conv_bwd(int dtype, const ConvBwdParams& p, cudaStream_t s);

// ---------------- selective scan ----------------
struct ScanFwdParams {
  const void* x; int64_t x_sb, x_st;     // [B, T, D]
  const void* dt; int64_t dt_sb, dt_st;  // [B, T, D]
  const void* Bm; int64_t B_sb, B_st;    // [B, T, N]
  const void* Cm; int64_t C_sb, C_st;    // [B, T, N]
  const void* z; int64_t z_sb, z_st;     // [B, T, D]
  const float* A_log;                    // [D, N]
  const float* Dskip;                    // [D]
  const float* dt_bias;                  // [D]
  const float* init;                     // [B, D, N] or nullptr
  const bool* starts;                    // [B, T] or nullptr
  void* out;                             // [B, T, D] contiguous
  float* final_state;                    // [B, D, N]
  float* ckpt;                           // [B, nchunks, D, N] or nullptr (no backward)
  int B, T, D, N;
};
struct ScanBwdParams {
  ScanFwdParams f;                       // the forward's inputs (out/final_state unused); ckpt required
  const void* dout; int64_t g_sb, g_st;  // [B, T, D]
  const float* dfinal;                   // [B, D, N] or nullptr
  void* dx; void* ddt; void* dz;         // [B, T, D] contiguous
  void* dB; void* dC;                    // [B, T, N] contiguous
  float* dA_log; float* dD; float* ddt_bias;  // [D, N], [D], [D]
  float* dinit;                          // [B, D, N] or nullptr
  float* ws;                             // workspace: scan_bwd_workspace() floats
};
int scan_chunk();                        // checkpoint interval (steps)
int64_t scan_bwd_workspace(int B, int T, int D, int N);
const char* scan_fwd(int dtype, const ScanFwdParams& p, cudaStream_t s);
const char* scan_bwd(int dtype, const ScanBwdParams& p, cudaStream_t s);

}  // namespace mrl

namespace mrl {
// ---------------- optimizer (flat f32 arenas; see mamba_rl/optim.py for the contract) ----------------
struct GradStatsParams {
  const float* grad; int64_t P;
  const float* extra_sq;  // 0-d / [1] float32 or nullptr (cast by the binding)
  const float* loss_scale;  // [1]
  const double* hyper;      // [8]
  double* scalars;          // [8]
  double* ws;               // [2 * grad_stats_blocks(P)]
  unsigned int* counter;    // self-resetting, zero on entry
};
int grad_stats_blocks(int64_t P);
const char* grad_stats(const GradStatsParams& p, cudaStream_t s);

struct AdamWParams {
  float* param; const float* grad; float* exp_avg; float* exp_avg_sq;
  const double* hyper; const double* scalars;
  int64_t P, n_decay;
  void* compute; int compute_dtype;  // kBF16 / kF16 / kF32, or compute == nullptr
};
const char* adamw_step(const AdamWParams& p, cudaStream_t s);

// grad = found_inf ? 0 : grad * inv_scale  (select, so an inf never turns into NaN)
const char* unscale_grad(float* grad, int64_t P, const double* scalars, cudaStream_t s);
}  // namespace mrl
