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
  void* dx; int64_t dx_sb, dx_st;         // [B, T, D] x dtype, may be a strided view
  float* dinit;                           // [B, D, K-1] or nullptr
  float* dw;                              // [D, K]
  float* dbias;                           // [D]
  bool accumulate;                        // add into dw / dbias instead of writing
  float* ws;                              // workspace: conv_bwd_workspace() floats
  int B, T, D, K;
  bool partials_only;                     // leave the weight gradient as ws's partials (no column sums)
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
  float* ws;                             // forward workspace: scan_fwd_workspace() floats
  int B, T, D, N;
  int nseg, seg_len;                     // time split (set by scan_fwd / scan_bwd, not by the caller)
};
struct ScanBwdParams {
  ScanFwdParams f;                       // the forward's inputs (out/final_state unused); ckpt required
  const void* dout; int64_t g_sb, g_st;  // [B, T, D]
  const float* dfinal;                   // [B, D, N] or nullptr
  void* dx; void* ddt;                   // [B, T, D] contiguous
  void* dz; int64_t dz_sb, dz_st;        // [B, T, D], may be a strided view (e.g. half of a dxz buffer)
  void* dB; void* dC;                    // [B, T, N], rows (b, t) dBC_st elements apart, unit last stride
  int64_t dBC_st;                        // N (contiguous), or R + 2N: columns of a [B*T, R + 2N] buffer
  float* dA_log; float* dD; float* ddt_bias;  // [D, N], [D], [D]
  bool accumulate;                       // add into dA_log / dD / ddt_bias instead of writing
  float* dinit;                          // [B, D, N] or nullptr
  float* ws;                             // workspace: scan_bwd_workspace() floats
  // Set by scan_bwd, not by the caller: the build (blocks per SM: SCAN_BWD_MINB 3, SCAN_BWD_MINB_WIDE 4 or
  // SCAN_BWD_MINB_PAIR 2, scan_common.cuh / scan_bwd.cuh) and the channel tiles of the dB / dC partials.
  int build, bc_tiles;
};
int scan_chunk();                        // checkpoint interval (steps)
int64_t scan_fwd_workspace(int B, int T, int D, int N);
int64_t scan_bwd_workspace(int B, int T, int D, int N);
// Number of time segments the forward (bwd = false) or backward kernel uses for this shape on the current
// device; scan_set_segments(n > 0) forces n (clamped to [1, number of chunks]), 0 restores the automatic
// choice (a tuning/testing knob: results depend on the split in the last bits).
int scan_segments(int B, int T, int D, int N, bool bwd);
void scan_set_segments(int n);
// The backward's build: 3, or at d_state 16 4 or 2 (the pair build) blocks per SM, with the split sized for it;
// 0 = automatic (tuning).
void scan_set_bwd_blocks(int n);
// Which kernels run their passes as one cooperative launch where the grid is co-resident (a mask of COOP_*;
// a cleared bit: the separate launches, the same bits; a tuning / testing knob; coop.cu).
enum : int { COOP_SCAN_FWD = 1, COOP_SCAN_BWD = 2, COOP_CONV_BWD = 4, COOP_ALL = 7 };
void set_coop(int mask);
const char* scan_fwd(int dtype, const ScanFwdParams& p, cudaStream_t s);
const char* scan_bwd(int dtype, const ScanBwdParams& p, cudaStream_t s);

}  // namespace mrl

namespace mrl {
// ---------------- optimizer (flat f32 arenas; see mamba_rl/ops/optim.py for the contract) ----------------
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
  float* param; float* grad; float* exp_avg; float* exp_avg_sq;
  const double* hyper; const double* scalars;
  int64_t P, n_decay;
  void* compute; int compute_dtype;  // kBF16 / kF16 / kF32, or compute == nullptr
  bool zero_grad = false;            // write grad[i] = 0 once read (also on a skipped step): saves a memset
};
const char* adamw_step(const AdamWParams& p, cudaStream_t s);
// grad_stats then adamw_step in one cooperative launch, the same bits (optim.cu); only where optim_step_fits
bool optim_step_fits(int64_t P, int compute_dtype);
const char* optim_step(const GradStatsParams& gs, const AdamWParams& p, cudaStream_t s);
}  // namespace mrl

namespace mrl {
// ---------------- one-token backbone step (all layers, one launch) ----------------
constexpr int STEP_MAX_LAYERS = 16;
struct StepLayer {
  const float* norm_w;            // [dm]
  const void* in_w;               // [2*D, dm]      (weight dtype)
  const float* conv_w;            // [D, K]
  const float* conv_b;            // [D]
  const void* x_w;                // [rank + 2N, D] (weight dtype)
  const void* dt_w;               // [D, rank]      (weight dtype)
  const float* dt_b;              // [D]
  const float* A_log;             // [D, N]
  const float* Dp;                // [D]
  const void* out_w;              // [dm, D]        (weight dtype)
};
struct StepParams {
  const float* x;                 // [B, in_dim]
  const void* inp_w;              // [dm, in_dim]   (weight dtype)
  const void* inp_b;              // [dm]           (weight dtype)
  const float* normf_w;           // [dm]
  float* conv_state;              // [L, B, D, K-1]
  float* ssm_state;               // [L, B, D, N]
  const bool* starts;             // [B] or nullptr
  float* out;                     // [B, dm]
  int B, in_dim, dm, D, N, K, rank, L;
  float eps;
  StepLayer layer[STEP_MAX_LAYERS];
};
// rows_per_block: 0 = choose from B
const char* backbone_step(int wdtype, const StepParams& p, int rows_per_block, cudaStream_t s);
// The rows_per_block code backbone_step uses for R (R == 0: the automatic choice); *err set on failure.
int backbone_step_rows(const StepParams& p, int R, const char** err);
}  // namespace mrl

namespace mrl {
// ---------------- RMSNorm (rows of C, float32 input) ----------------
struct NormFwdParams {
  const float* x; int64_t rows; int C;   // [rows, C] contiguous
  const float* w;                        // [C]
  float eps;
  void* out; int out_dtype;              // [rows, C]
  float* rstd;                           // [rows]
  float* x_copy = nullptr;               // [rows, C] float32 copy of x, or nullptr (the fused node's next
                                         //   residual buffer: saves the copy an out-of-place addmm makes)
  // Input projection prologue (in_x != nullptr; x is then unused): x[row] = in_x[row] @ in_w^T + in_b, computed
  // in float32 and written to h_out. in_x [rows, in_dim] contiguous, in_w [C, in_dim], in_b [C], all float32;
  // in_dim * C <= NORM_IN_MAX_WEIGHTS (in_w is staged in shared memory).
  const float* in_x = nullptr; const float* in_w = nullptr; const float* in_b = nullptr; int in_dim = 0;
  float* h_out = nullptr;                // [rows, C]
};
constexpr int NORM_IN_MAX_WEIGHTS = 12288;  // 48 KB of float32: the static shared-memory limit
struct NormBwdParams {
  const void* dy; int dy_dtype;          // [rows, C]
  const float* x; const float* rstd; const float* w;
  int64_t rows; int C;
  float* dx;                             // [rows, C] = rstd * (g - xhat * mean(g * xhat)) (+ dx_acc), g = dy * w
  const float* dx_acc;                   // [rows, C] or nullptr (may alias dx)
  float* dw_acc;                         // [C]: += sum_rows dy * xhat
  float* ws;                             // [norm_bwd_blocks(rows, C) * C]
  unsigned int* counter;                 // self-resetting
  void* dx_c = nullptr;                  // [rows, C] copy of dx in dxc_dtype (kBF16 / kF16: the next GEMM's
  int dxc_dtype = kBF16;                 //   input, saving a cast pass), or nullptr
  // The forward in the same pass (fwd_out != nullptr; rstd is then an output): rstd = rsqrt(mean(x^2) + eps) and
  // fwd_out = x * rstd * w (float32), the bits of norm_fwd; dw_assign: dw_acc = sum (not +=).
  float* fwd_out = nullptr; float* fwd_rstd = nullptr; float eps = 0.f; int dw_assign = 0;
  // partials_only: ws receives the blocks' dw partials (a [norm_bwd_blocks(rows, C), C] buffer of the caller's,
  // whose column sums are dL/dw) and nothing sums them (dw_acc and counter unused).
  int partials_only = 0;
};
int norm_bwd_blocks(int64_t rows, int C);
const char* norm_fwd(const NormFwdParams& p, cudaStream_t s);
// Whether the input projection prologue may keep in_w in registers where in_dim <= 32 and C <= 128 (true, the
// default) or must read it from shared memory for every FMA (false: the same bits; a testing knob; norm.cu).
void norm_set_inreg(bool on);
const char* norm_bwd(const NormBwdParams& p, cudaStream_t s);
}  // namespace mrl

namespace mrl {
// ---------------- small GEMMs of the fused training step (csrc/wgrad.cu, csrc/xdt.cu) ----------------
// Grouped weight gradients: for each job, C[M, N] += A^T B with A [K, M] (row stride lda) and B [K, N]
// (row stride ldb; b == nullptr: B is a column of ones, N must be 1 -> column sums of A, e.g. a bias grad).
// One launch for every job; f32 accumulation (FFMA, or tensor cores for bf16 / f16 jobs with 16-byte row loads);
// K split into fixed slices whose partials the last slice of a tile sums in slice order (deterministic for a
// given plan; the plan depends only on the shapes, dtypes and operand layouts).
constexpr int WGRAD_MAX_JOBS = 24;
struct WGradJob {
  const void* a; int64_t lda; int a_dtype;
  const void* b; int64_t ldb; int b_dtype;
  float* c; int64_t ldc;
  int M, N; int64_t K;
  // set by wgrad_plan:
  int tiles_n, tiles, splits, item0, tile0; int64_t slice;
  int a_vec, b_vec;  // 16-byte row loads possible (alignment, row stride and width): see wgrad_plan
  int path;  // 0: FFMA; 1: tensor cores (both operands bf16, or both f16, with 16-byte row loads); 2: column sums
};
struct WGradParams {
  WGradJob job[WGRAD_MAX_JOBS];
  int n_jobs, n_items, n_tiles;
  int smem_bytes;          // set by wgrad_plan: dynamic shared memory of the launch (the largest path's staging)
  float* ws;               // wgrad_plan()'s floats: one BM x BN partial per work item of a split tile
  unsigned int* counters;  // [n_tiles], zero on entry; the kernel leaves them zero
};
// Fills the plan fields for sm_count SMs; returns the workspace floats needed (0 when no tile is split).
// force_slice > 0: that K slice for every job (benchmarks); use_mma: the tensor-core path for the jobs that
// allow it (needs compute capability >= 8.0; false: every job on the FFMA path, for comparisons).
int64_t wgrad_plan(WGradParams& p, int sm_count, int64_t force_slice = 0, bool use_mma = true);
const char* wgrad(const WGradParams& p, cudaStream_t s);

// x_proj + dt_proj of one layer, forward: dbc[r, :] = xc[r, :] @ Wx^T (rounded to the dtype),
// dt[r, :] = dbc[r, :R] @ Wdt^T (rounded); rows r < rows, all tensors in one dtype, contiguous rows.
struct XdtFwdParams {
  const void* xc;          // [rows, D]
  const void* wx;          // [E, D], E = R + 2N
  const void* wdt;         // [D, R]
  void* dbc;               // [rows, E]
  void* dt;                // [rows, D]
  int64_t rows; int D, E, R;
  // conv_on: the block first computes its rows of xc as causal_conv1d + SiLU (conv: the conv_fwd contract, rows =
  // B * T, conv.out = xc, the final windows written by the block holding each row's t = T - 1), the same values
  // conv_fwd writes; xc is then an output.
  int conv_on = 0;
  ConvFwdParams conv{};
};
// Backward: ddbc[r, :R] = ddt[r, :] @ Wdt (rounded), ddbc[r, R:R+N] = dB[r], ddbc[r, R+N:] = dC[r];
// dxc[r, :] = dxc[r, :] + ddbc[r, :] @ Wx (in place, rounded once).
struct XdtBwdParams {
  const void* ddt;         // [rows, D]
  const void* dB; const void* dC;  // [rows, N] each
  const void* wx; const void* wdt;
  void* ddbc;              // [rows, E]
  void* dxc;               // [rows, D], read and written
  int64_t rows; int D, E, R, N;
};
int xdt_smem_ok(int E, int D);  // 1 when x_proj.weight [E, D] fits the kernels' shared memory
const char* xdt_fwd(int dtype, const XdtFwdParams& p, cudaStream_t s);
const char* xdt_bwd(int dtype, const XdtBwdParams& p, cudaStream_t s);
}  // namespace mrl

namespace mrl {
// ---------------- Mamba-3 SISO mixer core (mamba3.cu; the contract of cpu/mamba3.cpp, float32) ----------------
struct M3Params {
  const float* zxbc; int64_t z_sb, z_st;  // [B, T, Dp] in_proj output, unit last stride, Dp = 2 H P + 2N + 3H + R
  const float* dt_bias;                   // [H]
  const float* B_bias; const float* C_bias;  // [H, N]
  const float* B_w; const float* C_w;     // [N]
  const float* Dskip;                     // [H]
  const float* out_w;                     // [H P] gated-RMSNorm weight or nullptr (y * SiLU(z))
  const float* carry0;                    // [B, H, R + N + P] or nullptr
  const float* ssm0;                      // [B, H P, N] or nullptr
  const bool* starts;                     // [B, T] or nullptr
  float eps, A_floor;
  bool heavy_tail;
  int B, T, H, P, N, R;
  float* y;                               // [B, T, H P] contiguous
  float* carry_f; float* ssm_f;           // final state (may alias carry0 / ssm0: the one-token step)
  float* ckpt;                            // [B, nC, H, m3_ckpt_len] or nullptr, nC = ceil(T / m3_chunk())
};
struct M3BwdParams {
  const float* ckpt; const float* dy;     // dy [B, T, H P] contiguous
  const float* dcarry; const float* dssm; // or nullptr
  float* dzxbc;                           // [B, T, Dp] contiguous, every element written
  float *ddt_bias, *dB_bias, *dC_bias, *dB_w, *dC_w, *dD, *dout_w;  // added into; dout_w iff out_w
  float* ws;                              // workspace: m3_bwd_workspace() floats
  float *shared, *part_h, *part_bt;       // set by m3_bwd (views of ws)
};
int m3_chunk();
int m3_ckpt_len(int P, int N, int R);
int64_t m3_bwd_workspace(int B, int T, int H, int P, int N, int R);
const char* m3_supported(int P, int N, int R);  // nullptr or why the kernels do not take these sizes
const char* m3_fwd(const M3Params& p, cudaStream_t s);
const char* m3_bwd(const M3Params& p, M3BwdParams g, cudaStream_t s);
}  // namespace mrl
