// One-token backbone step on thread-block clusters, second design ("cluster2"): a cluster of 8 blocks owns R
// rows (R = 1..16); block q owns channels [32q, 32q + 32) of d_inner (= 256; d_model = 128). Every projection
// maps lanes to outputs and warps to slices of the reduction, so no sum is a shuffle chain: each warp writes
// its partial sums to shared memory and one fixed-order pass adds the 8 warps (then the 8 blocks of the cluster
// through distributed shared memory, in rank order). Every weight a thread uses sits in its registers, loaded
// right after the same weights' use in the layer before (layer 0's at the start, with the input projection), so
// no phase waits on an L2 round trip. Each layer's RMSNorm is folded into the previous layer's residual update
// (the warp that owns a row has all of it). Deterministic: the result depends on the shape only.
#pragma once
#include <cooperative_groups.h>
#include "step.cuh"

namespace mrl {

constexpr int SC2_CL = 8;
constexpr int SC2_THREADS = 256;
constexpr int SC2_W = SC2_THREADS / 32;  // warps
constexpr int SC2_DM = 128;              // d_model
constexpr int SC2_DS = 32;               // channels per block (d_inner = 256)
constexpr int SC2_KW = SC2_DM / SC2_W;   // in_proj columns per warp
constexpr int SC2_NXP = 64;              // padded row of the x_proj outputs (rank + 2 d_state <= 48)

// element i of packed weights (WT in little-endian 32-bit words), converted at the point of use
template <typename WT> __device__ __forceinline__ float welem(const uint32_t* w, int i);
template <> __device__ __forceinline__ float welem<float>(const uint32_t* w, int i) { return __uint_as_float(w[i]); }
template <> __device__ __forceinline__ float welem<__nv_bfloat16>(const uint32_t* w, int i) {
  return __uint_as_float((i & 1) ? (w[i >> 1] & 0xffff0000u) : (w[i >> 1] << 16));
}
template <> __device__ __forceinline__ float welem<__half>(const uint32_t* w, int i) {
  return __half2float(__ushort_as_half((unsigned short)((i & 1) ? (w[i >> 1] >> 16) : (w[i >> 1] & 0xffffu))));
}

// NW words from a 4 * NW-byte aligned address (16-byte loads where NW allows)
template <int NW>
__device__ __forceinline__ void ld_words(const void* p, uint32_t (&w)[NW]) {
  if constexpr (NW % 4 == 0) {
#pragma unroll
    for (int v = 0; v < NW / 4; ++v) {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(p) + v);
      w[4 * v] = q.x; w[4 * v + 1] = q.y; w[4 * v + 2] = q.z; w[4 * v + 3] = q.w;
    }
  } else if constexpr (NW == 2) {
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = q.x; w[1] = q.y;
  } else {
#pragma unroll
    for (int v = 0; v < NW; ++v) w[v] = __ldg(reinterpret_cast<const unsigned int*>(p) + v);
  }
}

// A thread's weights of one layer: in_proj (rows d0+lane of xi and of z, this warp's 16 columns), x_proj (outputs
// lane and lane+32, this warp's 4 channels), out_proj (outputs lane+32i, this warp's 4 channels), and the next
// RMSNorm weight at columns lane+32i.
template <typename WT>
struct Sc2Proj {
  static constexpr int IW = SC2_KW * (int)sizeof(WT) / 4;  // words per in_proj slice
  static constexpr int CW = 4 * (int)sizeof(WT) / 4;       // words per 4-channel slice
  uint32_t wx[IW], wz[IW], xp0[CW], xp1[CW], wo[4][CW];
  float nw[4];
};

// A thread's channel (d0 + lane) parameters of one layer and its rows' states.
template <typename WT, int N, int RW>
struct Sc2Chan {
  float cw[4], cb, dtb, Dp, Al[N];
  WT wdt[16];
  float cs[RW][3], ss[RW][N];
};

template <typename WT, int R, int N>
__global__ void __cluster_dims__(SC2_CL, 1, 1) __launch_bounds__(SC2_THREADS, 1)
backbone_step_cluster2_kernel(StepParams p) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  constexpr int DM = SC2_DM, DS = SC2_DS, KW = SC2_KW, NXP = SC2_NXP, W = SC2_W;
  constexpr int RW = (R + W - 1) / W;  // rows per thread in the per-channel phases (rows warp, warp + 8, ...)
  const int rank = (int)cluster.block_rank();
  const int b0 = (int)(blockIdx.x / SC2_CL) * R;
  const int D = p.D, rk = p.rank, L = p.L, B = p.B;
  const int nx = rk + 2 * N;
  const int d0 = rank * DS;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int dch = d0 + lane;  // this thread's channel in the per-channel phases
  extern __shared__ float4 sm4[];
  float* h = reinterpret_cast<float*>(sm4);  // [R][DM] residual stream (the same in every block)
  float* u = h + R * DM;                     // [R][DM] the layer's normalised input
  float* wp = u + R * DM;                    // [W][R][DM] per-warp partial sums
  float* xcs = wp + W * R * DM;              // [R][DS] conv output
  float* zs = xcs + R * DS;                  // [R][DS] gate input
  float* ys = zs + R * DS;                   // [R][DS] gated SSM output
  float* dbc = ys + R * DS;                  // [R][NXP] x_proj outputs (summed over the cluster)
  float* part_x = dbc + R * NXP;             // [R][NXP] this block's x_proj sums, read by the cluster
  float* part_o = part_x + R * NXP;          // [R][DM]  this block's out_proj sums, read by the cluster
  float* xin = part_o + R * DM;              // [R][in_dim]

  bool rowact[RW], rowst[RW];
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    const int r = warp + W * i, b = b0 + r;
    rowact[i] = r < R && b < B;
    rowst[i] = rowact[i] && p.starts ? p.starts[b] : false;
  }

  Sc2Proj<WT> pw;
  Sc2Chan<WT, N, RW> ch;
  auto load_in = [&](int l) {
    const WT* w = reinterpret_cast<const WT*>(p.layer[l].in_w);
    ld_words(w + (int64_t)dch * DM + warp * KW, pw.wx);
    ld_words(w + (int64_t)(D + dch) * DM + warp * KW, pw.wz);
  };
  auto load_xp = [&](int l) {
    const WT* w = reinterpret_cast<const WT*>(p.layer[l].x_w) + d0 + 4 * warp;
#pragma unroll
    for (int c = 0; c < Sc2Proj<WT>::CW; ++c) pw.xp0[c] = pw.xp1[c] = 0u;
    if (lane < nx) ld_words(w + (int64_t)lane * D, pw.xp0);
    if (lane + 32 < nx) ld_words(w + (int64_t)(lane + 32) * D, pw.xp1);
  };
  auto load_out = [&](int l) {
    const WT* w = reinterpret_cast<const WT*>(p.layer[l].out_w) + d0 + 4 * warp;
#pragma unroll
    for (int i = 0; i < 4; ++i) ld_words(w + (int64_t)(lane + 32 * i) * D, pw.wo[i]);
  };
  auto load_norm = [&](int l) {  // the RMSNorm weight applied after layer l-1 (norm_f after the last)
    const float* nw = l < L ? p.layer[l].norm_w : p.normf_w;
#pragma unroll
    for (int i = 0; i < 4; ++i) pw.nw[i] = __ldg(nw + lane + 32 * i);
  };
  auto load_chan = [&](int l) {
    if (warp >= R) return;  // no rows in the per-channel phases
    const StepLayer& ly = p.layer[l];
    const float4 c4 = __ldg(reinterpret_cast<const float4*>(ly.conv_w) + dch);
    ch.cw[0] = c4.x; ch.cw[1] = c4.y; ch.cw[2] = c4.z; ch.cw[3] = c4.w;
    ch.cb = __ldg(ly.conv_b + dch); ch.dtb = __ldg(ly.dt_b + dch); ch.Dp = __ldg(ly.Dp + dch);
#pragma unroll
    for (int n = 0; n < N; n += 4) {
      const float4 a4 = __ldg(reinterpret_cast<const float4*>(ly.A_log + (int64_t)dch * N + n));
      ch.Al[n] = a4.x; ch.Al[n + 1] = a4.y; ch.Al[n + 2] = a4.z; ch.Al[n + 3] = a4.w;
    }
    const WT* wd = reinterpret_cast<const WT*>(ly.dt_w) + (int64_t)dch * rk;
#pragma unroll
    for (int k = 0; k < 16; ++k) ch.wdt[k] = k < rk ? wd[k] : from_f<WT>(0.f);
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      if (!rowact[i]) continue;
      const int64_t row = (int64_t)l * B + b0 + warp + W * i;
      const float* cs = p.conv_state + (row * D + dch) * 3;
      const float* ss = p.ssm_state + (row * D + dch) * N;
#pragma unroll
      for (int k = 0; k < 3; ++k) ch.cs[i][k] = rowst[i] ? 0.f : cs[k];
#pragma unroll
      for (int n = 0; n < N; n += 4) {
        const float4 s4 = rowst[i] ? make_float4(0.f, 0.f, 0.f, 0.f) : *reinterpret_cast<const float4*>(ss + n);
        ch.ss[i][n] = s4.x; ch.ss[i][n + 1] = s4.y; ch.ss[i][n + 2] = s4.z; ch.ss[i][n + 3] = s4.w;
      }
    }
  };
  // every weight of layer 0 in flight while the input projection runs
  load_in(0); load_chan(0); load_xp(0); load_out(0); load_norm(0);

  input_proj_rows<WT, R, SC2_THREADS>(p, b0, B, DM, xin, h);
  // u = RMSNorm(h) for layer 0: warp per row
  auto norm_rows = [&](bool last) {
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      const int r = warp + W * i;
      if (r >= R) continue;
      float hv[4], ssq = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) { hv[q] = h[r * DM + lane + 32 * q]; ssq = fmaf(hv[q], hv[q], ssq); }
      ssq = group_sum<32>(ssq);
      const float rs = rsqrtf(ssq / DM + p.eps);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int j = lane + 32 * q;
        const float v = hv[q] * rs * pw.nw[q];
        if (!last) {
          u[r * DM + j] = v;
        } else if (j / (DM / SC2_CL) == rank && b0 + r < B) {  // block q writes its 16 columns
          p.out[(int64_t)(b0 + r) * DM + j] = v;
        }
      }
    }
  };
  norm_rows(false);
  load_norm(1);
  __syncthreads();

  for (int l = 0; l < L; ++l) {
    // ---- in_proj: partial sums of this warp's 16 columns for the block's 32 xi and 32 z channels
#pragma unroll 1
    for (int r = 0; r < R; ++r) {
      float ax = 0.f, az = 0.f;
      const float4* ur = reinterpret_cast<const float4*>(u + r * DM + warp * KW);
#pragma unroll
      for (int v = 0; v < KW / 4; ++v) {
        const float4 x4 = ur[v];
        const float xv[4] = {x4.x, x4.y, x4.z, x4.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          ax = fmaf(welem<WT>(pw.wx, 4 * v + e), xv[e], ax);
          az = fmaf(welem<WT>(pw.wz, 4 * v + e), xv[e], az);
        }
      }
      wp[(warp * R + r) * 64 + lane] = ax;
      wp[(warp * R + r) * 64 + 32 + lane] = az;
    }
    if (l + 1 < L) load_in(l + 1);
    __syncthreads();
    // ---- conv step (the thread's channel, rows warp + 8i): xi and z summed over the 8 warps in order
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      const int r = warp + W * i;
      if (r >= R) continue;
      float xc = 0.f, zv = 0.f;
      if (rowact[i]) {
        float xi = 0.f;
#pragma unroll
        for (int q = 0; q < W; ++q) {
          xi += wp[(q * R + r) * 64 + lane];
          zv += wp[(q * R + r) * 64 + 32 + lane];
        }
        float pre = ch.cb;
#pragma unroll
        for (int k = 0; k < 3; ++k) pre = fmaf(ch.cw[k], ch.cs[i][k], pre);
        pre = fmaf(ch.cw[3], xi, pre);
        float* cs = p.conv_state + (((int64_t)l * B + b0 + r) * D + dch) * 3;
        cs[0] = ch.cs[i][1]; cs[1] = ch.cs[i][2]; cs[2] = xi;
        xc = siluf_(pre);
      }
      xcs[r * DS + lane] = xc;
      zs[r * DS + lane] = zv;
    }
    __syncthreads();
    // ---- x_proj partials: outputs lane and lane + 32 over this warp's 4 channels
    const bool o1 = lane + 32 < nx;
#pragma unroll 1
    for (int r = 0; r < R; ++r) {
      const float4 x4 = *reinterpret_cast<const float4*>(xcs + r * DS + 4 * warp);
      const float xv[4] = {x4.x, x4.y, x4.z, x4.w};
      float a0 = 0.f, a1 = 0.f;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        a0 = fmaf(welem<WT>(pw.xp0, c), xv[c], a0);
        a1 = fmaf(welem<WT>(pw.xp1, c), xv[c], a1);
      }
      if (lane < nx) wp[(warp * R + r) * 64 + lane] = a0;
      if (o1) wp[(warp * R + r) * 64 + 32 + lane] = a1;
    }
    if (l + 1 < L) load_xp(l + 1);
    __syncthreads();
    for (int t = tid; t < R * nx; t += SC2_THREADS) {
      const int r = t / nx, o = t - r * nx;
      float a = 0.f;
#pragma unroll
      for (int q = 0; q < W; ++q) a += wp[(q * R + r) * 64 + o];
      part_x[r * NXP + o] = a;
    }
    cluster.sync();
    for (int t = tid; t < R * nx; t += SC2_THREADS) {
      const int r = t / nx, o = t - r * nx;
      float a = 0.f;
#pragma unroll
      for (int q = 0; q < SC2_CL; ++q) a += cluster.map_shared_rank(part_x, q)[r * NXP + o];
      dbc[r * NXP + o] = a;
    }
    __syncthreads();
    // ---- dt_proj + softplus + state update + D skip + gate (the thread's channel and rows)
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      const int r = warp + W * i;
      if (r >= R) continue;
      float yv = 0.f;
      if (rowact[i]) {
        const float* dr_in = dbc + r * NXP;
        float dr = ch.dtb;
#pragma unroll
        for (int k = 0; k < 16; ++k)
          if (k < rk) dr = fmaf(to_f(ch.wdt[k]), dr_in[k], dr);
        const float delta = softplusf_(dr);
        const float xc = xcs[r * DS + lane];
        const float* Bv = dr_in + rk;
        const float* Cv = Bv + N;
        const float dx = delta * xc;
        float acc = 0.f;
#pragma unroll
        for (int n = 0; n < N; ++n) {
          ch.ss[i][n] = fmaf(expf(-expf(ch.Al[n]) * delta), ch.ss[i][n], dx * Bv[n]);
          acc = fmaf(ch.ss[i][n], Cv[n], acc);
        }
        float* ss = p.ssm_state + (((int64_t)l * B + b0 + r) * D + dch) * N;
#pragma unroll
        for (int n = 0; n < N; n += 4)
          *reinterpret_cast<float4*>(ss + n) = make_float4(ch.ss[i][n], ch.ss[i][n + 1], ch.ss[i][n + 2], ch.ss[i][n + 3]);
        yv = fmaf(ch.Dp, xc, acc) * siluf_(zs[r * DS + lane]);
      }
      ys[r * DS + lane] = yv;
    }
    if (l + 1 < L) load_chan(l + 1);
    __syncthreads();
    // ---- out_proj partials: outputs lane + 32i over this warp's 4 channels
#pragma unroll 1
    for (int r = 0; r < R; ++r) {
      const float4 y4 = *reinterpret_cast<const float4*>(ys + r * DS + 4 * warp);
      const float yv[4] = {y4.x, y4.y, y4.z, y4.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float a = 0.f;
#pragma unroll
        for (int c = 0; c < 4; ++c) a = fmaf(welem<WT>(pw.wo[q], c), yv[c], a);
        wp[(warp * R + r) * DM + lane + 32 * q] = a;
      }
    }
    if (l + 1 < L) load_out(l + 1);
    __syncthreads();
    for (int t = tid; t < R * DM; t += SC2_THREADS) {
      float a = 0.f;
#pragma unroll
      for (int q = 0; q < W; ++q) a += wp[q * R * DM + t];
      part_o[t] = a;
    }
    cluster.sync();
    // ---- residual update from the cluster's sums (rank order), then the next RMSNorm (warp per row)
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      const int r = warp + W * i;
      if (r >= R) continue;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int t = r * DM + lane + 32 * q;
        float a = 0.f;
#pragma unroll
        for (int k = 0; k < SC2_CL; ++k) a += cluster.map_shared_rank(part_o, k)[t];
        h[t] += a;
      }
    }
    __syncwarp();
    norm_rows(l + 1 == L);
    if (l + 2 <= L) load_norm(l + 2);
    __syncthreads();
  }
  cluster.sync();  // no block may exit while another still reads its shared memory
}

inline size_t stepc2_smem_bytes(const StepParams& p, int R) {
  return sizeof(float) * (size_t)R * (2 * SC2_DM + SC2_W * SC2_DM + 3 * SC2_DS + 2 * SC2_NXP + SC2_DM + p.in_dim);
}

// what the kernel takes: d_model 128, d_inner 256, d_conv 4, d_state 8 / 16, dt_rank <= 16, and every weight and
// state 16-byte aligned (its vector loads)
inline bool stepc2_supported(const StepParams& p) {
  if (!(p.dm == SC2_DM && p.D == SC2_CL * SC2_DS && p.K == 4 && (p.N == 16 || p.N == 8) && p.rank <= 16))
    return false;
  auto al = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) == 0; };
  if (!al(p.ssm_state)) return false;
  for (int l = 0; l < p.L; ++l) {
    const StepLayer& ly = p.layer[l];
    if (!al(ly.in_w) || !al(ly.x_w) || !al(ly.out_w) || !al(ly.conv_w) || !al(ly.A_log))
      return false;
  }
  return true;
}

template <typename WT, int R, int N>
const char* stepc2_launch_rn(const StepParams& p, cudaStream_t s) {
  // the device's opt-in shared memory and the size this kernel was opened to, per device: asked once, not on
  // every token (the launch is on the acting path)
  static int optin[64] = {0};
  static size_t opened[64] = {0};
  const size_t smem = stepc2_smem_bytes(p, R);
  auto kern = backbone_step_cluster2_kernel<WT, R, N>;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  if (dev < 0 || dev >= 64) return "backbone_step: device ordinal >= 64";
  if (optin[dev] == 0) {
    int v = 0;
    e = cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e != cudaSuccess) return cudaGetErrorString(e);
    optin[dev] = v;
  }
  if (smem > (size_t)optin[dev])
    return "backbone_step: cluster2 needs more shared memory per block than the device allows (fewer rows per "
           "cluster or a smaller input_dim)";
  if (smem > 48 * 1024 && smem > opened[dev]) {
    e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return cudaGetErrorString(e);
    opened[dev] = smem;
  }
  const int clusters = (p.B + R - 1) / R;
  kern<<<clusters * SC2_CL, SC2_THREADS, smem, s>>>(p);
  MRL_LAUNCH_CHECK();
  return nullptr;
}

template <typename WT>
const char* stepc2_launch_t(const StepParams& p, int R, cudaStream_t s) {
#define MRL_STEPC2_CASE(RR)                                                                 \
  if (R == RR) return p.N == 16 ? stepc2_launch_rn<WT, RR, 16>(p, s) : stepc2_launch_rn<WT, RR, 8>(p, s);
  MRL_STEPC2_CASE(1) MRL_STEPC2_CASE(2) MRL_STEPC2_CASE(4) MRL_STEPC2_CASE(8) MRL_STEPC2_CASE(16)
#undef MRL_STEPC2_CASE
  return "backbone_step: cluster2 rows_per_cluster must be 1, 2, 4, 8 or 16";
}

}  // namespace mrl
