// RMSNorm forward (writes the compute-dtype output and rstd; optionally with the backbone's input projection as
// its prologue, h = x @ W^T + b in float32) and backward (dx, with an optional residual gradient added in the
// same pass, an optional bf16/f16 copy of dx for the next GEMM, and dw accumulated into the gradient arena;
// optionally with the forward in the same pass, for a caller that knows dL/dout first). Warp per row; each lane
// owns the columns lane + 32 k, so the backward's dw partials stay in registers; the last block to finish
// sums the block partials in a fixed order (bit-reproducible for a given device, one launch). The backward's
// grid is at most NORM_BWD_MINB blocks an SM, each warp walking groups of rows by the grid stride, so blocks of
// one SM overlap their loads with each other's math and the partials are one row per block, not per 64 rows.
#include <algorithm>
#include "common.cuh"

namespace mrl {

constexpr int NORM_THREADS = 512;
constexpr int NORM_WARPS = NORM_THREADS / 32;
template <int CPL> struct NormRPW { static constexpr int v = CPL <= 4 ? 4 : (CPL <= 8 ? 2 : 1); };
static int norm_rpw(int C) { return C <= 128 ? 4 : (C <= 256 ? 2 : 1); }

// The backward: blocks of 8 warps, 2 of them an SM (<= 128 registers a thread: 114-127 without spills; at 3
// blocks, <= 80, it spilled 128-336 bytes).
constexpr int NORM_BWD_THREADS = 256;
constexpr int NORM_BWD_WARPS = NORM_BWD_THREADS / 32;
constexpr int NORM_BWD_MINB = 2;

int norm_bwd_blocks(int64_t rows, int C) {
  const int64_t groups = (rows + norm_rpw(C) - 1) / norm_rpw(C);  // a warp's unit of work: rpw rows
  const int64_t need = (groups + NORM_BWD_WARPS - 1) / NORM_BWD_WARPS;
  return (int)std::min<int64_t>(need, (int64_t)NORM_BWD_MINB * sm_count());
}

template <typename T> __device__ __forceinline__ float ld_any(const void* p, int64_t i) {
  return to_f(reinterpret_cast<const T*>(p)[i]);
}

// The input projection's last step: v[k] = acc[k] + in_b[c] for c = lane + 32 k < C (0 past C), stored to h_out.
template <int CPL>
__device__ __forceinline__ void norm_input_bias(const NormFwdParams& p, const float (&acc)[CPL], int64_t row, int lane,
                                                float (&v)[CPL]) {
  float* ho = p.h_out + row * p.C;
#pragma unroll
  for (int k = 0; k < CPL; ++k) {
    const int c = lane + 32 * k;
    v[k] = c < p.C ? acc[k] + p.in_b[c] : 0.f;
    if (c < p.C) ho[c] = v[k];
  }
}

// The input projection prologue: v[k] = (in_x[row] @ in_w^T)[c] + in_b[c] for c = lane + 32 k, in float32, with
// in_w^T staged in shared memory (ws [in_dim][C]) and the row's inputs broadcast from the lanes that loaded them.
template <int CPL>
__device__ __forceinline__ void norm_input_proj(const NormFwdParams& p, const float* ws, int ld, int64_t row, int lane,
                                                float (&v)[CPL]) {
  const int C = p.C, I = p.in_dim;
  float acc[CPL];
#pragma unroll
  for (int k = 0; k < CPL; ++k) acc[k] = 0.f;
  const float* xrow = p.in_x + row * I;
  for (int j0 = 0; j0 < I; j0 += 32) {
    const float xl = j0 + lane < I ? xrow[j0 + lane] : 0.f;
    const int jn = I - j0 < 32 ? I - j0 : 32;
    for (int jj = 0; jj < jn; ++jj) {
      const float xv = __shfl_sync(0xffffffffu, xl, jj);
      const float* wr = ws + (size_t)(j0 + jj) * ld;
#pragma unroll
      for (int k = 0; k < CPL; ++k) {
        const int c = lane + 32 * k;
        if (c < C) acc[k] = fmaf(xv, wr[c], acc[k]);
      }
    }
  }
  norm_input_bias<CPL>(p, acc, row, lane, v);
}

// The input projection's staged weights: in_w^T as [in_dim][ld] floats, ld = C + 1 where that fits the 48 KB
// (the transposing stores of consecutive j then fall in distinct banks; with ld = C all 32 lanes of a warp hit
// one bank), else C.
__host__ __device__ __forceinline__ int norm_in_ld(int in_dim, int C) {
  return (int64_t)in_dim * (C + 1) <= NORM_IN_MAX_WEIGHTS ? C + 1 : C;
}

// The norm of a row v (the lane's columns c = lane + 32 k, 0 past C): the output, x_copy and rstd.
template <typename OT, int CPL>
__device__ __forceinline__ void norm_fwd_tail(const NormFwdParams& p, const float (&v)[CPL], int64_t row, int lane) {
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < CPL; ++k) ss = fmaf(v[k], v[k], ss);
  ss = group_sum<32>(ss);
  const float rs = rsqrtf(ss / p.C + p.eps);
  OT* o = reinterpret_cast<OT*>(p.out) + row * p.C;
#pragma unroll
  for (int k = 0; k < CPL; ++k) {
    const int c = lane + 32 * k;
    if (c < p.C) o[c] = from_f<OT>(v[k] * rs * p.w[c]);
  }
  if (p.x_copy) {
    float* xc = p.x_copy + row * p.C;
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
      const int c = lane + 32 * k;
      if (c < p.C) xc[c] = v[k];
    }
  }
  if (lane == 0) p.rstd[row] = rs;
}

template <typename OT, int CPL>
__device__ __forceinline__ void norm_fwd_row(const NormFwdParams& p, const float* norm_ws, int ld, int64_t row,
                                             int lane) {
  float v[CPL];
  if (p.in_x) {
    norm_input_proj<CPL>(p, norm_ws, ld, row, lane, v);
  } else {
    const float* xr = p.x + row * p.C;
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
      const int c = lane + 32 * k;
      v[k] = c < p.C ? xr[c] : 0.f;
    }
  }
  norm_fwd_tail<OT, CPL>(p, v, row, lane);
}

// Warp per row. With the input projection prologue a block stages in_w^T once and then walks rows
// blockIdx.x * NORM_WARPS + warp, stepping by the grid (norm_fwd_c sizes that grid to the SMs), so the
// staging is paid per block, not per 16 rows; each row's arithmetic is the same either way.
template <typename OT, int CPL>
__global__ void __launch_bounds__(NORM_THREADS) norm_fwd_kernel(NormFwdParams p) {
  extern __shared__ float norm_ws[];  // [in_dim][ld]: in_w^T, only with the input projection prologue
  const int lane = threadIdx.x % 32;
  const int ld = p.in_x ? norm_in_ld(p.in_dim, p.C) : 0;
  if (p.in_x) {
    const int n = p.in_dim * p.C;
    for (int i = threadIdx.x; i < n; i += NORM_THREADS) {  // coalesced reads of in_w [C][in_dim]
      const int c = i / p.in_dim, j = i - c * p.in_dim;
      norm_ws[j * ld + c] = p.in_w[i];
    }
    __syncthreads();
  }
  for (int64_t row = (int64_t)blockIdx.x * NORM_WARPS + threadIdx.x / 32; row < p.rows;
       row += (int64_t)gridDim.x * NORM_WARPS)
    norm_fwd_row<OT, CPL>(p, norm_ws, ld, row, lane);
}

// The first layer's norm with the input projection's weights in registers (in_dim <= IB <= 32 and C <= 128, so
// CPL = 4): each lane reads w[j][k] = in_w[c = lane + 32 k][j] once from the block's staged in_w^T, then a row is
// a shuffle and 4 FMAs an input with no shared-memory loads. norm_fwd_kernel reads ws[j * ld + c] for every FMA and
// was bound by the shared-memory pipe (66 µs at 65,536 rows x 32 inputs, C = 128, against 29 for the later layers'
// norm; ~45 µs of its cycles by count). The same FMAs in the same order as norm_input_proj, so the same bits: the
// bucket's inputs j >= in_dim multiply x = -0 by w = +0, and acc + (-0) is acc for every acc (+0 and -0 included),
// so they change no bit and need no branch; columns c >= C are summed on zero weights and dropped by
// norm_input_bias. Each warp loads its next row's inputs before this row's math, so that latency overlaps it.
// Measured (H100, bf16 step, timeline, thirty-fifth session): 66 -> 44 µs at 64 x 1024; 16 x 64 unchanged.
constexpr int NORM_INREG_THREADS = 128;  // small blocks: at IB = 32 (168 registers) 12 warps fit an SM, 3 blocks
constexpr int NORM_INREG_WARPS = NORM_INREG_THREADS / 32;
constexpr int NORM_INREG_LD = 129;       // the staged rows' stride: a column's consecutive j in distinct banks
template <typename OT, int IB>
__global__ void __launch_bounds__(NORM_INREG_THREADS) norm_fwd_inreg_kernel(NormFwdParams p) {
  constexpr int CPL = 4;
  extern __shared__ float norm_ws[];  // [IB][NORM_INREG_LD]: in_w^T, +0 past in_dim and C (read without tests)
  const int lane = threadIdx.x % 32, I = p.in_dim;
  for (int i = threadIdx.x; i < IB * 32 * CPL; i += NORM_INREG_THREADS) {
    const int c = i / IB, j = i % IB;
    norm_ws[j * NORM_INREG_LD + c] = (j < I && c < p.C) ? p.in_w[c * I + j] : 0.f;
  }
  __syncthreads();
  float w[IB][CPL];
#pragma unroll
  for (int j = 0; j < IB; ++j)
#pragma unroll
    for (int k = 0; k < CPL; ++k) w[j][k] = norm_ws[j * NORM_INREG_LD + lane + 32 * k];
  const int64_t step = (int64_t)gridDim.x * NORM_INREG_WARPS;
  int64_t row = (int64_t)blockIdx.x * NORM_INREG_WARPS + threadIdx.x / 32;
  float xl = (row < p.rows && lane < I) ? p.in_x[row * I + lane] : -0.f;
  for (; row < p.rows; row += step) {
    const int64_t next = row + step;
    const float xn = (next < p.rows && lane < I) ? p.in_x[next * I + lane] : -0.f;
    float acc[CPL], v[CPL];
#pragma unroll
    for (int k = 0; k < CPL; ++k) acc[k] = 0.f;
#pragma unroll
    for (int j = 0; j < IB; ++j) {
      const float xv = __shfl_sync(0xffffffffu, xl, j);
#pragma unroll
      for (int k = 0; k < CPL; ++k) acc[k] = fmaf(xv, w[j][k], acc[k]);
    }
    norm_input_bias<CPL>(p, acc, row, lane, v);
    norm_fwd_tail<OT, CPL>(p, v, row, lane);
    xl = xn;
  }
}

template <typename GT, int CPL>
__global__ void __launch_bounds__(NORM_BWD_THREADS, NORM_BWD_MINB) norm_bwd_kernel(NormBwdParams p) {
  constexpr int NORM_ROWS_PER_WARP = NormRPW<CPL>::v, NW = NORM_BWD_WARPS;
  __shared__ float part[NW][CPL * 32];
  __shared__ bool is_last;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float w[CPL], dw[CPL];
#pragma unroll
  for (int k = 0; k < CPL; ++k) { const int c = lane + 32 * k; w[k] = c < p.C ? p.w[c] : 0.f; dw[k] = 0.f; }
  const int64_t groups = (p.rows + NORM_ROWS_PER_WARP - 1) / NORM_ROWS_PER_WARP;
  for (int64_t grp = (int64_t)blockIdx.x * NW + warp; grp < groups; grp += (int64_t)gridDim.x * NW) {
    const int64_t r0 = grp * NORM_ROWS_PER_WARP;
    // all rows' loads first (one memory latency per warp, not one per row), then the math. The residual
    // gradient too: loaded in the store loop, each row's load waited behind the previous row's stores (dx may
    // alias dx_acc as far as the compiler knows), one memory latency per row.
    float dyv[NORM_ROWS_PER_WARP][CPL], xv[NORM_ROWS_PER_WARP][CPL], av[NORM_ROWS_PER_WARP][CPL],
        rsv[NORM_ROWS_PER_WARP];
    const bool has_acc = p.dx_acc != nullptr;
#pragma unroll
    for (int i = 0; i < NORM_ROWS_PER_WARP; ++i) {
      const int64_t row = r0 + i;
      const bool rok = row < p.rows;
      rsv[i] = (rok && !p.fwd_out) ? p.rstd[row] : 0.f;
#pragma unroll
      for (int k = 0; k < CPL; ++k) {
        const int c = lane + 32 * k;
        const bool ok = rok && c < p.C;
        dyv[i][k] = ok ? ld_any<GT>(p.dy, row * p.C + c) : 0.f;
        xv[i][k] = ok ? p.x[row * p.C + c] : 0.f;
        av[i][k] = (ok && has_acc) ? p.dx_acc[row * p.C + c] : 0.f;
      }
    }
    if (p.fwd_out) {  // the forward first: rstd and the normed rows, as norm_fwd_kernel computes them
#pragma unroll
      for (int i = 0; i < NORM_ROWS_PER_WARP; ++i) {
        const int64_t row = r0 + i;
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < CPL; ++k) ss = fmaf(xv[i][k], xv[i][k], ss);
        ss = group_sum<32>(ss);
        const float rs = rsqrtf(ss / p.C + p.eps);
        rsv[i] = rs;
        if (row < p.rows) {
#pragma unroll
          for (int k = 0; k < CPL; ++k) {
            const int c = lane + 32 * k;
            if (c < p.C) p.fwd_out[row * p.C + c] = xv[i][k] * rs * w[k];
          }
          if (lane == 0) p.fwd_rstd[row] = rs;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < NORM_ROWS_PER_WARP; ++i) {
      const int64_t row = r0 + i;
      const float rs = rsv[i];
      float xh[CPL], g[CPL];
      float dot = 0.f;
#pragma unroll
      for (int k = 0; k < CPL; ++k) {
        xh[k] = xv[i][k] * rs;
        g[k] = dyv[i][k] * w[k];
        dot = fmaf(g[k], xh[k], dot);
        dw[k] = fmaf(dyv[i][k], xh[k], dw[k]);
      }
      dot = group_sum<32>(dot) / p.C;
      if (row < p.rows) {
#pragma unroll
        for (int k = 0; k < CPL; ++k) {
          const int c = lane + 32 * k;
          if (c < p.C) {
            float d = rs * (g[k] - xh[k] * dot);
            if (has_acc) d += av[i][k];
            p.dx[row * p.C + c] = d;
            if (p.dx_c) {  // uniform branch: the low-precision copy the next GEMM reads (saves a cast pass)
              const int64_t o = row * p.C + c;
              if (p.dxc_dtype == kBF16) reinterpret_cast<__nv_bfloat16*>(p.dx_c)[o] = from_f<__nv_bfloat16>(d);
              else reinterpret_cast<__half*>(p.dx_c)[o] = from_f<__half>(d);
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < CPL; ++k) part[warp][lane + 32 * k] = dw[k];
  __syncthreads();
  for (int c = threadIdx.x; c < p.C; c += NORM_BWD_THREADS) {
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < NW; ++q) s += part[q][c];
    p.ws[(int64_t)blockIdx.x * p.C + c] = s;
  }
  if (p.partials_only) return;  // the caller sums the partial rows (the grouped weight-gradient launch)
  // The arena's dw before the counter's atomic, in every block: only the last block writes that slot, and no other
  // kernel does while this one runs, so the read can leave the chain of round trips (stores, fence, atomic, the
  // partials' loads) instead of adding one after it. C <= 512, so a thread holds at most 2 columns.
  constexpr int NPC = 2;
  float prev[NPC];
#pragma unroll
  for (int j = 0; j < NPC; ++j) {
    const int c = threadIdx.x + j * NORM_BWD_THREADS;
    prev[j] = (!p.dw_assign && c < p.C) ? p.dw_acc[c] : 0.f;
  }
  if (!last_block_arrive(p.counter, gridDim.x - 1, is_last)) return;
  // last block: column sums over the block partials; warp w sums partial rows w, w + NW, ... (U in flight: up to
  // 2 x 132 partial rows on an H100, so a lane's serial chain of loads is ~nb / (NW x U) long), then a
  // fixed-order sum over warps.
  constexpr int U = CPL <= 4 ? 8 : 4;
  const int nb = gridDim.x;
  float cs[CPL];
#pragma unroll
  for (int k = 0; k < CPL; ++k) cs[k] = 0.f;
  for (int b0 = warp; b0 < nb; b0 += U * NW) {
    float v[U][CPL];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < CPL; ++k) {
        const int bb = b0 + u * NW, c = lane + 32 * k;
        v[u][k] = (bb < nb && c < p.C) ? __ldcg(p.ws + (int64_t)bb * p.C + c) : 0.f;
      }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < CPL; ++k) cs[k] += v[u][k];
  }
  __syncthreads();  // everyone is done reading part[] from the block-partial phase
#pragma unroll
  for (int k = 0; k < CPL; ++k) part[warp][lane + 32 * k] = cs[k];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < NPC; ++j) {
    const int c = threadIdx.x + j * NORM_BWD_THREADS;
    if (c >= p.C) break;
    float t = 0.f;
#pragma unroll
    for (int q = 0; q < NW; ++q) t += part[q][c];
    p.dw_acc[c] = p.dw_assign ? t : prev[j] + t;
  }
  if (threadIdx.x == 0) *p.counter = 0u;
}

static bool g_norm_inreg = true;  // norm_set_inreg()
void norm_set_inreg(bool on) { g_norm_inreg = on; }

// One wave of blocks (the co-resident count, whatever set_coop says; an SM's worth where that query has no
// answer), each staging in_w once and walking rows by the grid stride.
template <typename OT, int IB>
static void norm_fwd_inreg_launch(const NormFwdParams& p, cudaStream_t s) {
  const auto kern = norm_fwd_inreg_kernel<OT, IB>;
  constexpr int smem = sizeof(float) * IB * NORM_INREG_LD;
  int64_t nb = coop_capacity((const void*)kern, NORM_INREG_THREADS, smem);
  if (nb < 1) nb = sm_count();
  nb = std::min<int64_t>(nb, (p.rows + NORM_INREG_WARPS - 1) / NORM_INREG_WARPS);
  kern<<<(unsigned)nb, NORM_INREG_THREADS, smem, s>>>(p);
}
template <typename OT>
static void norm_fwd_inreg(const NormFwdParams& p, cudaStream_t s) {
  if (p.in_dim <= 8) norm_fwd_inreg_launch<OT, 8>(p, s);
  else if (p.in_dim <= 16) norm_fwd_inreg_launch<OT, 16>(p, s);
  else norm_fwd_inreg_launch<OT, 32>(p, s);
}

template <int CPL>
static const char* norm_fwd_c(const NormFwdParams& p, cudaStream_t s) {
  unsigned nb = (unsigned)((p.rows + NORM_WARPS - 1) / NORM_WARPS);
  if (p.in_x && (p.in_dim < 1 || (int64_t)p.in_dim * p.C > NORM_IN_MAX_WEIGHTS))
    return "rms_norm: the input projection prologue takes 1 <= in_dim and in_dim * C <= 12288";
  // with the prologue: 4 blocks per SM (512 threads at <= 32 registers), each staging the weights once for many rows
  if (p.in_x) nb = std::min(nb, 4u * (unsigned)sm_count());
  const size_t smem = p.in_x ? sizeof(float) * (size_t)p.in_dim * norm_in_ld(p.in_dim, p.C) : 0;
  if constexpr (CPL == 4) {  // C <= 128
    if (p.in_x && p.in_dim <= 32 && g_norm_inreg) {
      switch (p.out_dtype) {
        case kF32: norm_fwd_inreg<float>(p, s); break;
        case kBF16: norm_fwd_inreg<__nv_bfloat16>(p, s); break;
        case kF16: norm_fwd_inreg<__half>(p, s); break;
        default: return "rms_norm: unsupported output dtype";
      }
      MRL_LAUNCH_CHECK();
      return nullptr;
    }
  }
  switch (p.out_dtype) {
    case kF32: norm_fwd_kernel<float, CPL><<<nb, NORM_THREADS, smem, s>>>(p); break;
    case kBF16: norm_fwd_kernel<__nv_bfloat16, CPL><<<nb, NORM_THREADS, smem, s>>>(p); break;
    case kF16: norm_fwd_kernel<__half, CPL><<<nb, NORM_THREADS, smem, s>>>(p); break;
    default: return "rms_norm: unsupported output dtype";
  }
  MRL_LAUNCH_CHECK();
  return nullptr;
}
template <int CPL>
static const char* norm_bwd_c(const NormBwdParams& p, cudaStream_t s) {
  const unsigned nb = (unsigned)norm_bwd_blocks(p.rows, p.C);
  switch (p.dy_dtype) {
    case kF32: norm_bwd_kernel<float, CPL><<<nb, NORM_BWD_THREADS, 0, s>>>(p); break;
    case kBF16: norm_bwd_kernel<__nv_bfloat16, CPL><<<nb, NORM_BWD_THREADS, 0, s>>>(p); break;
    case kF16: norm_bwd_kernel<__half, CPL><<<nb, NORM_BWD_THREADS, 0, s>>>(p); break;
    default: return "rms_norm: unsupported grad dtype";
  }
  MRL_LAUNCH_CHECK();
  return nullptr;
}

const char* norm_fwd(const NormFwdParams& p, cudaStream_t s) {
  if (p.C <= 128) return norm_fwd_c<4>(p, s);
  if (p.C <= 256) return norm_fwd_c<8>(p, s);
  if (p.C <= 512) return norm_fwd_c<16>(p, s);
  if (p.C <= 1024) return norm_fwd_c<32>(p, s);
  return "rms_norm: at most 1024 channels";
}
const char* norm_bwd(const NormBwdParams& p, cudaStream_t s) {
  static_assert(512 <= 2 * NORM_BWD_THREADS, "norm_bwd_kernel's prefetch of dw holds 2 columns a thread");
  if (p.C <= 128) return norm_bwd_c<4>(p, s);
  if (p.C <= 256) return norm_bwd_c<8>(p, s);
  if (p.C <= 512) return norm_bwd_c<16>(p, s);
  return "rms_norm backward: at most 512 channels";
}

}  // namespace mrl
