// One-token backbone step on thread-block clusters for many rows ("cluster3": R = 8, 16 or 32 rows a cluster of 8
// blocks, for B >= 64). Block q owns channels [32q, 32q + 32) of d_inner (= 256) as in cluster2, and also the
// d_model columns [16q, 16q + 16) of the residual stream. What differs from cluster2 (step_cluster2.cuh), which
// walks its rows in turn through shuffle trees and gives every block every row's out_proj sums:
// - each projection is a product over the rows with a thread per (output, slice of the reduction): the thread's
//   weights sit in its registers, the rows' inputs are read from shared memory (the 4 or 2 lanes of an output read
//   one row's adjacent 16-byte words; the 8 or 16 outputs of a warp read the same ones), and one small shuffle tree
//   per 4 (2) rows sums the slices;
// - out_proj is a reduce-scatter: a block's sums for columns [16q, 16q + 16) go to block q only (warp w's outputs
//   are block w's columns), block q adds the 8 blocks' sums in rank order into its columns of the residual and
//   pushes those (16-byte st.async) into every block, which then holds the whole residual again and forms each
//   row's RMSNorm itself. So the out exchange moves R x 128 floats a block in and out, not 8 R x 128 in, and
//   shared memory takes R = 32 (B = 256 in 8 clusters: one wave on an H100, which holds 15 clusters of 8);
// - the input projection: block q computes its 16 columns of every row and pushes them the same way.
// The x_proj sums are pushed into every block as in cluster2. Per-channel phases (conv, state update) and the
// norm are cluster2's functions. Deterministic: the result depends on the shape only.
#pragma once
#include "step_cluster2.cuh"

namespace mrl {

constexpr int SC3_COLS = SC2_DM / SC2_CL;  // d_model columns a block owns (16)
constexpr int SC3_DSP = 40;                // padded row of xcs / zs / ys: 4 rows of 8 outputs hit 32 banks

// A thread's weights of one layer as 16-byte words of CPL elements. in_proj: output t / 4 (xi channel d0 + t / 4
// for t / 4 < 32, else z channel d0 + t / 4 - 32), slice s = t % 4 holding columns CPL (s + 4k) + [0, CPL), k < KI.
// x_proj: output t / 4 (zero past rank + 2 d_state), channels d0 + CPL (s + 4k) + [0, CPL), k < KX. out_proj:
// output t / 2, slice s = t % 2, channels d0 + CPL (s + 2k) + [0, CPL), k < KO.
template <typename WT>
struct Sc3Proj {
  static constexpr int CPL = 16 / (int)sizeof(WT);
  static constexpr int KI = SC2_DM / 4 / CPL, KX = SC2_DS / 4 / CPL, KO = SC2_DS / 2 / CPL;
  uint4 wi[KI], wx[KX], wo[KO];
  float nw[4];
};

// acc + the CPL products of a 16-byte weight word with x[0..CPL), in element order
template <typename WT>
__device__ __forceinline__ float sc3_dot_acc(const uint4& w, const float* x, float acc) {
  const uint32_t w4[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int e = 0; e < 16 / (int)sizeof(WT); ++e) acc = fmaf(welem<WT>(w4, e), x[e], acc);
  return acc;
}

// v into the same 16-byte aligned shared-memory slot of all 8 blocks of the cluster, 16 bytes on each mbarrier
__device__ __forceinline__ void sc3_push4_all(uint32_t slot, float4 v, uint32_t bar) {
#pragma unroll
  for (int k = 0; k < SC2_CL; ++k)
    asm volatile("st.async.weak.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
                 :: "r"(sc2_mapa(slot, k)), "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)),
                    "r"(__float_as_uint(v.z)), "r"(__float_as_uint(v.w)), "r"(sc2_mapa(bar, k)) : "memory");
}

template <typename WT, int R, int N>
__global__ void __cluster_dims__(SC2_CL, 1, 1) __launch_bounds__(SC2_THREADS, 1)
backbone_step_cluster3_kernel(StepParams p) {
  namespace cg = cooperative_groups;
  using PW = Sc3Proj<WT>;
  constexpr int DM = SC2_DM, DS = SC2_DS, NXP = SC2_NXP, W = SC2_W, CPL = PW::CPL, COLS = SC3_COLS, S = SC3_DSP;
  constexpr int KI = PW::KI, KX = PW::KX, KO = PW::KO;
  constexpr int RW = R / W;  // rows per thread in the per-channel phases (rows warp, warp + 8, ...)
  static_assert(R % 4 == 0 && R % W == 0 && R * 4 <= SC2_THREADS, "cluster3: R must be 8, 16 or 32");
  const int rank = (int)cg::this_cluster().block_rank();
  const int b0 = (int)(blockIdx.x / SC2_CL) * R;
  const int D = p.D, rk = p.rank, L = p.L, B = p.B, in_dim = p.in_dim;
  const int nx = rk + 2 * N;
  const int d0 = rank * DS, c0 = rank * COLS;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int dch = d0 + lane;  // this thread's channel in the per-channel phases
  extern __shared__ float4 sm4[];
  float* h = reinterpret_cast<float*>(sm4);  // [R][DM] residual stream (every block all of it)
  float* u = h + R * DM;                     // [R][DM] the layer's normalised input
  float* xcs = u + R * DM;                   // [R][S] in_proj's xi, then the conv output
  float* zs = xcs + R * S;                   // [R][S] gate input z
  float* ys = zs + R * S;                    // [R][S] gated SSM output
  float* dbc = ys + R * S;                   // [R][NXP] x_proj outputs (summed over the cluster)
  float* gx = dbc + R * NXP;                 // [CL][R][NXP] every block's x_proj sums, pushed here
  float* go = gx + SC2_CL * R * NXP;         // [CL][R][COLS] every block's out_proj sums of this block's columns
  uint64_t* bars = reinterpret_cast<uint64_t*>(go + SC2_CL * R * COLS);  // x, out and residual exchanges
  float* xin = reinterpret_cast<float*>(bars + 4);  // [R][in_dim]
  const uint32_t bar_x = sc2_saddr(bars), bar_o = sc2_saddr(bars + 1), bar_h = sc2_saddr(bars + 2);
  const uint32_t bytes_x = SC2_CL * R * nx * 4, bytes_o = SC2_CL * R * COLS * 4, bytes_h = R * DM * 4;
  // the mbarriers armed (the residual's for the input projection's exchange) and visible to the cluster before
  // any block pushes
  if (tid == 0) {
    sc2_bar_init(bar_x);
    sc2_bar_init(bar_o);
    sc2_bar_init(bar_h);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    sc2_bar_arm(bar_x, bytes_x);
    sc2_bar_arm(bar_o, bytes_o);
    sc2_bar_arm(bar_h, bytes_h);
  }
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");  // waited on before the first push

  bool rowact[RW], rowst[RW];
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    const int b = b0 + warp + W * i;
    rowact[i] = b < B;
    rowst[i] = rowact[i] && p.starts ? p.starts[b] : false;
  }
  // the projections' roles of this thread (see Sc3Proj)
  const int oi = tid >> 2, si = tid & 3, ox = tid >> 2, oo = tid >> 1, so = tid & 1;
  const int wrow_i = oi < DS ? d0 + oi : D + d0 + oi - DS;  // in_proj weight row

  PW pw;
  Sc2Chan<WT, N, RW> ch;
  auto load_in = [&](int l) {
    const WT* w = reinterpret_cast<const WT*>(p.layer[l].in_w) + (int64_t)wrow_i * DM;
#pragma unroll
    for (int k = 0; k < KI; ++k) pw.wi[k] = __ldg(reinterpret_cast<const uint4*>(w + CPL * (si + 4 * k)));
  };
  auto load_xp = [&](int l) {
    const WT* w = reinterpret_cast<const WT*>(p.layer[l].x_w) + (int64_t)ox * D + d0;
#pragma unroll
    for (int k = 0; k < KX; ++k)
      pw.wx[k] = ox < nx ? __ldg(reinterpret_cast<const uint4*>(w + CPL * (si + 4 * k))) : make_uint4(0, 0, 0, 0);
  };
  auto load_out = [&](int l) {
    const WT* w = reinterpret_cast<const WT*>(p.layer[l].out_w) + (int64_t)oo * D + d0;
#pragma unroll
    for (int k = 0; k < KO; ++k) pw.wo[k] = __ldg(reinterpret_cast<const uint4*>(w + CPL * (so + 2 * k)));
  };
  auto load_norm = [&](int l) {  // the RMSNorm weight applied after layer l-1 (norm_f after the last)
    const float* nw = l < L ? p.layer[l].norm_w : p.normf_w;
#pragma unroll
    for (int i = 0; i < 4; ++i) pw.nw[i] = __ldg(nw + lane + 32 * i);
  };
  auto load_chan = [&](int l) { sc2_load_chan<WT, N, RW, W, R>(p, l, b0, warp, dch, rowact, rowst, ch); };
  // this block's columns of the residual into every block (rows tid / 4, columns c0 + 4 (tid % 4) + [0, 4))
  auto push_cols = [&](float4 v) {
    sc3_push4_all(sc2_saddr(h + (tid >> 2) * DM + c0 + 4 * (tid & 3)), v, bar_h);
  };

  // ---- prologue: the rows' inputs staged, layer 0's weights in flight, this block's 16 columns of the input
  // projection (bias + x W^T, in input order) pushed to every block
  for (int i = tid; i < R * in_dim; i += SC2_THREADS) {
    const int r = i / in_dim, b = b0 + r;
    xin[i] = b < B ? p.x[(int64_t)b * in_dim + (i - r * in_dim)] : 0.f;
  }
  load_in(0); load_chan(0); load_xp(0); load_out(0); load_norm(0);
  __syncthreads();
  {
    const WT* iw = reinterpret_cast<const WT*>(p.inp_w);
    const WT* ib = reinterpret_cast<const WT*>(p.inp_b);
    for (int i = tid; i < R * COLS; i += SC2_THREADS) {
      const int r = i / COLS, j = c0 + (i - r * COLS);
      const WT* wr = iw + (int64_t)j * in_dim;
      const float* xr = xin + r * in_dim;
      float acc = to_f(ib[j]);
      for (int k = 0; k < in_dim; ++k) acc = fmaf(to_f(wr[k]), xr[k], acc);
      h[r * DM + j] = acc;
    }
  }
  __syncthreads();
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
  if (tid < R * 4) push_cols(*reinterpret_cast<const float4*>(h + (tid >> 2) * DM + c0 + 4 * (tid & 3)));
  sc2_bar_wait(bar_h, 0);
  if (tid == 0) sc2_bar_arm(bar_h, bytes_h);
  sc2_norm_rows<RW, W, R>(p, h, u, pw.nw, b0, warp, lane, rank, false);
  load_norm(1);
  __syncthreads();

  for (int l = 0; l < L; ++l) {
    // ---- in_proj: output oi of every row, 4 rows at a time, the 4 slices summed by a shuffle tree
#pragma unroll 1
    for (int c = 0; c < R; c += 4) {
      float a[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float* ur = u + (c + j) * DM;
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < KI; ++k) {
          float uv[CPL];
          sc2_lds(ur + CPL * (si + 4 * k), uv);
          acc = sc3_dot_acc<WT>(pw.wi[k], uv, acc);
        }
        a[j] = acc;
      }
      const float v = sc2_group_sums<4, 4>(a, lane);  // row c + si
      (oi < DS ? xcs : zs)[(c + si) * S + (oi & (DS - 1))] = v;
    }
    __syncthreads();
    // ---- conv step (the thread's channel, rows warp + 8i); xcs goes from xi to the conv output
    sc2_conv_rows<WT, N, RW, W, R, S>(p, l, b0, warp, lane, dch, rowact, ch, xcs, zs);
    __syncthreads();
    // ---- x_proj over the block's 32 channels, pushed into slot `rank` of every block's gx
#pragma unroll 1
    for (int c = 0; c < R; c += 4) {
      float a[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float* xr = xcs + (c + j) * S;
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < KX; ++k) {
          float xv[CPL];
          sc2_lds(xr + CPL * (si + 4 * k), xv);
          acc = sc3_dot_acc<WT>(pw.wx[k], xv, acc);
        }
        a[j] = acc;
      }
      const float v = sc2_group_sums<4, 4>(a, lane);  // row c + si
      if (ox < nx) sc2_push_all(sc2_saddr(gx + (rank * R + c + si) * NXP + ox), v, bar_x);
    }
    if (l + 1 < L) load_xp(l + 1);
    if (l + 1 < L) load_in(l + 1);
    // while the cluster's sums are in flight: the state-update rates -exp(A_log) of this thread's channel
#pragma unroll
    for (int n = 0; n < N; ++n) ch.Al[n] = -expf(ch.Al[n]);
    sc2_bar_wait(bar_x, l & 1);
    if (tid == 0 && l + 1 < L) sc2_bar_arm(bar_x, bytes_x);  // the next layer's phase
    for (int t = tid; t < R * nx; t += SC2_THREADS) {
      const int r = t / nx, o = t - r * nx;
      float a = 0.f;
#pragma unroll
      for (int q = 0; q < SC2_CL; ++q) a += gx[(q * R + r) * NXP + o];
      dbc[r * NXP + o] = a;
    }
    __syncthreads();
    // ---- dt_proj + softplus + state update + D skip + gate (the thread's channel and rows)
    sc2_state_rows<WT, N, RW, W, R, S, NXP>(p, l, b0, warp, lane, dch, rowact, ch, xcs, zs, dbc, ys);
    if (l + 1 < L) load_chan(l + 1);
    __syncthreads();
    // ---- out_proj over the block's 32 channels: output oo's sums go to block oo / 16 = warp (reduce-scatter)
    {
      const uint32_t dst = sc2_mapa(sc2_saddr(go + rank * R * COLS + (oo & (COLS - 1))), warp);
      const uint32_t dbar = sc2_mapa(bar_o, warp);
#pragma unroll 1
      for (int c = 0; c < R; c += 2) {
        float a[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float* yr = ys + (c + j) * S;
          float acc = 0.f;
#pragma unroll
          for (int k = 0; k < KO; ++k) {
            float yv[CPL];
            sc2_lds(yr + CPL * (so + 2 * k), yv);
            acc = sc3_dot_acc<WT>(pw.wo[k], yv, acc);
          }
          a[j] = acc;
        }
        const float v = sc2_group_sums<2, 2>(a, lane);  // row c + so
        sc2_push(dst + 4 * COLS * (c + so), v, dbar);
      }
    }
    if (l + 1 < L) load_out(l + 1);
    // ---- this block's columns of the residual: + the 8 blocks' sums in rank order, pushed to every block
    if (tid < R * 4) {
      sc2_bar_wait(bar_o, l & 1);
      if (tid == 0 && l + 1 < L) sc2_bar_arm(bar_o, bytes_o);
      const int r = tid >> 2, c4 = 4 * (tid & 3);
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int q = 0; q < SC2_CL; ++q) {
        const float4 g = *reinterpret_cast<const float4*>(go + (q * R + r) * COLS + c4);
        a.x += g.x; a.y += g.y; a.z += g.z; a.w += g.w;
      }
      const float4 hv = *reinterpret_cast<const float4*>(h + r * DM + c0 + c4);
      push_cols(make_float4(hv.x + a.x, hv.y + a.y, hv.z + a.z, hv.w + a.w));
    }
    sc2_bar_wait(bar_h, (l + 1) & 1);
    if (tid == 0 && l + 1 < L) sc2_bar_arm(bar_h, bytes_h);
    // ---- the next RMSNorm (warp per row) from the whole residual, or the output after the last layer
    sc2_norm_rows<RW, W, R>(p, h, u, pw.nw, b0, warp, lane, rank, l + 1 == L);
    if (l + 2 <= L) load_norm(l + 2);
    __syncthreads();
  }
  // no cluster barrier before exit: no block reads another's shared memory, and every push into this block's
  // shared memory has landed (every thread waited for the last residual exchange, which follows the others)
}

inline size_t stepc3_smem_bytes(const StepParams& p, int R) {
  // h, u, xcs / zs / ys, dbc, gx, go, the three mbarriers (8 floats), xin
  return sizeof(float) * ((size_t)R * (2 * SC2_DM + 3 * SC3_DSP + SC2_NXP + SC2_CL * (SC2_NXP + SC3_COLS) + p.in_dim) + 8);
}

// what the kernel takes: cluster2's shapes (d_model 128, d_inner 256, d_conv 4, d_state 8 / 16, dt_rank <= 16,
// 16-byte aligned weights and states)
inline bool stepc3_supported(const StepParams& p) { return stepc2_supported(p); }

template <typename WT, int R, int N>
const char* stepc3_launch_rn(const StepParams& p, cudaStream_t s) {
  static int optin[64] = {0};
  static size_t opened[64] = {0};
  const size_t smem = stepc3_smem_bytes(p, R);
  auto kern = backbone_step_cluster3_kernel<WT, R, N>;
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
    return "backbone_step: cluster3 needs more shared memory per block than the device allows (fewer rows per "
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
const char* stepc3_launch_t(const StepParams& p, int R, cudaStream_t s) {
#define MRL_STEPC3_CASE(RR)                                                                 \
  if (R == RR) return p.N == 16 ? stepc3_launch_rn<WT, RR, 16>(p, s) : stepc3_launch_rn<WT, RR, 8>(p, s);
  MRL_STEPC3_CASE(8) MRL_STEPC3_CASE(16) MRL_STEPC3_CASE(32)
#undef MRL_STEPC3_CASE
  return "backbone_step: cluster3 rows_per_cluster must be 8, 16 or 32";
}

}  // namespace mrl
