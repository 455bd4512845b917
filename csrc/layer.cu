// One Mamba-1 layer's forward in one launch ("layer_fwd"; the contract in ops.h). At the small shapes of RL
// (16 x 64 tokens) the separate forward kernels (norm, in_proj, conv + x_proj + dt_proj, scan, out_proj) are each
// latency-bound at 3-12 µs for a few µs of work, and each writes its output to global memory for the next to read.
// Here a cluster of LF_CL = 8 blocks owns one batch row for the whole sequence, in tiles of LF_TT steps; block
// `rank` owns the d_inner channels [LF_CH rank, LF_CH (rank + 1)). Per tile, with the intermediates in shared
// memory:
//   1. RMSNorm of the tile's rows (every block, all d_model columns; each block writes 1/8 of u and rstd);
//   2. in_proj for the block's 32 x and 32 z channels (float32 FMA over k = d_model; weights staged once);
//   3. causal conv + SiLU of the block's channels (a halo of d_conv - 1 steps carried across tiles; the taps,
//      reset rule and fmaf order of conv_fwd);
//   4. x_proj: the block's partial sums over its 32 channels, then every block adds the 8 partials through
//      distributed shared memory in rank order (a cluster barrier before and after);
//   5. dt_proj from the rounded dbc, softplus(dt + dt_bias), SiLU(z);
//   6. the selective scan of the block's channels (8 lanes per channel, 2 states each), checkpoints at every
//      scan_chunk() steps, y = (C.s + D x) SiLU(z);
//   7. out_proj: partial sums over the block's channels, the 8 partials added in rank order by the block owning
//      each 16 output columns, plus the residual h.
// Every output is rounded once to the compute dtype where the separate kernels round it (xz, xc, dbc, dt from the
// rounded dbc, y), so the backward reads the same kind of tensors. No atomics: the bits depend only on the shapes.
#include <cooperative_groups.h>
#include "common.cuh"
#include "scan_common.cuh"

namespace mrl {
namespace cg = cooperative_groups;

constexpr int LF_CL = 8, LF_THREADS = 256, LF_TT = 32, LF_DM = 128, LF_DI = 256, LF_N = 16;
constexpr int LF_CH = LF_DI / LF_CL;    // channels per block
constexpr int LF_XZ = 2 * LF_CH;        // in_proj outputs per block (x then z)
constexpr int LF_HALO = 3;              // conv steps carried over a tile boundary (d_conv - 1 <= 3)
constexpr int LF_SU = LF_TT + 2;        // row stride of the transposed normed rows: float2 loads, 2-way stores
constexpr int LF_MAX_R = 16;
constexpr int LF_OC = LF_DM / LF_CL;    // out_proj columns summed by each block
static_assert(LF_TT % SCAN_TC == 0, "a tile holds whole scan chunks");
static_assert(LF_THREADS == LF_CH * 8 && LF_TT * 8 == LF_THREADS, "phase layouts assume 256 threads");

// Shared-memory layout (offsets in floats, each a multiple of 4).
struct LfSmem {
  int winT, woT, wxT, wdt, uT, x, z, xc, dbc, px, dl, y, cw, cb, dtb, dd, st, total;
};
__host__ __device__ inline LfSmem lf_smem(int E, int R) {
  LfSmem s;
  int o = 0;
  auto take = [&](int n) { const int at = o; o += (n + 3) / 4 * 4; return at; };
  s.winT = take(LF_DM * LF_XZ);       // [DM][64] in_proj rows of the block, transposed
  s.woT = take(LF_CH * LF_DM);        // [CH][DM] out_proj columns of the block, transposed
  s.wxT = take(LF_CH * E);            // [CH][E] x_proj columns of the block, transposed
  s.wdt = take(LF_CH * R);            // [R][CH] dt_proj rows of the block, transposed
  const int nu = LF_DM * LF_SU, npo = LF_TT * LF_DM;
  s.uT = take(nu > npo ? nu : npo);   // [DM][SU] normed rows, transposed; then [TT][DM] out_proj partials
  s.x = take((LF_HALO + LF_TT) * LF_CH);  // [HALO + TT][CH] conv input (x half of xz), with the carried halo
  s.z = take(LF_TT * LF_CH);          // [TT][CH] SiLU(z)
  s.xc = take(LF_TT * LF_CH);         // [TT][CH] conv output
  s.dbc = take(LF_TT * E);            // [TT][E] x_proj output (summed over the cluster, rounded)
  s.px = take(LF_TT * E);             // [TT][E] this block's x_proj partials (read by the cluster)
  s.dl = take(LF_TT * LF_CH);         // [TT][CH] softplus(dt + dt_bias)
  s.y = take(LF_TT * LF_CH);          // [TT][CH] gated scan output (rounded)
  s.cw = take(LF_CH * 4);
  s.cb = take(LF_CH);
  s.dtb = take(LF_CH);
  s.dd = take(LF_CH);
  s.st = take(LF_HALO + LF_TT);       // episode starts (0 / 1) with the halo
  s.total = o;
  return s;
}

// dst[k * rows + j] = src(j)[k] for j < rows, k < cols (a transposed copy as float). src(j) is the first of row
// j's cols contiguous elements, 16-byte aligned with cols a multiple of 16 / sizeof(T) where vec (else scalar).
// Lanes take consecutive j; a thread issues all its loads (up to LF_STAGE_U in flight) before storing.
constexpr int LF_STAGE_U = 8;
template <typename T, typename Src>
__device__ __forceinline__ void lf_stage_t(float* dst, int rows, int cols, Src src) {
  constexpr int V = 16 / sizeof(T);
  const int nv = cols / V, n = rows * nv;
  for (int v0 = threadIdx.x; v0 < n; v0 += LF_STAGE_U * LF_THREADS) {
    uint4 r[LF_STAGE_U];
#pragma unroll
    for (int u = 0; u < LF_STAGE_U; ++u) {
      const int v = v0 + u * LF_THREADS;
      if (v < n) r[u] = __ldg(reinterpret_cast<const uint4*>(src(v % rows)) + v / rows);
    }
#pragma unroll
    for (int u = 0; u < LF_STAGE_U; ++u) {
      const int v = v0 + u * LF_THREADS;
      if (v < n) {
        T e[V];
        memcpy(e, &r[u], 16);
        const int j = v % rows, k0 = (v / rows) * V;
#pragma unroll
        for (int q = 0; q < V; ++q) dst[(k0 + q) * rows + j] = to_f(e[q]);
      }
    }
  }
}

template <typename T>
__global__ void __cluster_dims__(LF_CL, 1, 1) __launch_bounds__(LF_THREADS, 2) layer_fwd_kernel(LayerFwdParams p) {
  extern __shared__ __align__(16) float lf_sm[];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();
  const int b = blockIdx.x / LF_CL;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int T_ = p.T, R = p.R, K = p.K, E = R + 2 * LF_N;
  const int c0 = rank * LF_CH;
  const LfSmem L = lf_smem(E, R);
  long long* prof = (p.prof && tid == 0) ? p.prof + (int64_t)blockIdx.x * LF_PROF : nullptr;
  if (prof) prof[0] = clock64();
  float* sWin = lf_sm + L.winT;
  float* sWo = lf_sm + L.woT;
  float* sWx = lf_sm + L.wxT;
  float* sWdt = lf_sm + L.wdt;
  float* sU = lf_sm + L.uT;
  float* sPO = lf_sm + L.uT;  // the normed rows are dead once in_proj has read them
  float* sX = lf_sm + L.x;
  float* sZ = lf_sm + L.z;  // SiLU(z)
  float* sXC = lf_sm + L.xc;
  float* sDBC = lf_sm + L.dbc;
  float* sPX = lf_sm + L.px;
  float* sDL = lf_sm + L.dl;
  float* sY = lf_sm + L.y;
  float* sCW = lf_sm + L.cw;
  float* sCB = lf_sm + L.cb;
  float* sDTB = lf_sm + L.dtb;
  float* sDD = lf_sm + L.dd;
  float* sST = lf_sm + L.st;
  const T* w_in = reinterpret_cast<const T*>(p.w_in);
  const T* w_x = reinterpret_cast<const T*>(p.w_x);
  const T* w_dt = reinterpret_cast<const T*>(p.w_dt);
  const T* w_out = reinterpret_cast<const T*>(p.w_out);

  // ---- once: the block's weights (transposed where a phase reads them along k) and per-channel constants.
  // Lanes take consecutive rows of a weight and consecutive destinations (conflict-free stores); each lane
  // reads 16 bytes of its row at a time, every load of a thread issued before the first store.
  lf_stage_t<T>(sWin, LF_XZ, LF_DM, [&](int j) { return w_in + (int64_t)(j < LF_CH ? c0 + j : LF_DI + c0 + j - LF_CH) * LF_DM; });
  lf_stage_t<T>(sWo, LF_DM, LF_CH, [&](int m) { return w_out + (int64_t)m * LF_DI + c0; });
  lf_stage_t<T>(sWx, E, LF_CH, [&](int e) { return w_x + (int64_t)e * LF_DI + c0; });
  for (int v = tid; v < LF_CH * R; v += LF_THREADS) {
    const int c = v % LF_CH, r = v / LF_CH;
    sWdt[r * LF_CH + c] = to_f(w_dt[(int64_t)(c0 + c) * R + r]);
  }
  for (int v = tid; v < LF_CH * 4; v += LF_THREADS) {
    const int c = v / 4, k = v % 4;
    sCW[v] = k < K ? p.conv_w[(c0 + c) * K + k] : 0.f;
  }
  if (tid < LF_CH) {
    sCB[tid] = p.conv_b[c0 + tid];
    sDTB[tid] = p.dt_bias[c0 + tid];
    sDD[tid] = p.Dskip[c0 + tid];
    // the carried conv window: halo row h holds time h - HALO (the initial window, zeros before it)
    for (int h = 0; h < LF_HALO; ++h) {
      const int tau = h - LF_HALO;
      sX[h * LF_CH + tid] = (tau >= -(K - 1) && p.conv_init)
                                ? p.conv_init[((int64_t)b * LF_DI + c0 + tid) * (K - 1) + (K - 1 + tau)] : 0.f;
    }
  }
  if (tid < LF_HALO) sST[tid] = 0.f;
  float nw[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) nw[q] = p.norm_w[lane + 32 * q];
  // scan layout: channel cl (8 lanes), states n0, n0 + 1
  const int cl = tid >> 3, gi = tid & 7, n0 = gi * 2, d = c0 + cl;
  float A2[2], s[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    A2[j] = -expf(p.A_log[d * LF_N + n0 + j]) * 1.4426950408889634f;  // A * log2(e), as scan_fwd
    s[j] = p.ssm_init ? p.ssm_init[((int64_t)b * LF_DI + d) * LF_N + n0 + j] : 0.f;
  }
  const int nC = (T_ + SCAN_TC - 1) / SCAN_TC;
  const float* rPX[LF_CL];
  const float* rPO[LF_CL];
#pragma unroll
  for (int r = 0; r < LF_CL; ++r) {
    rPX[r] = cluster.map_shared_rank(sPX, r);
    rPO[r] = cluster.map_shared_rank(sPO, r);
  }
  __syncthreads();
  if (prof) prof[1] = clock64();

  for (int t0 = 0; t0 < T_; t0 += LF_TT) {
    const int len = min(LF_TT, T_ - t0);
    const int64_t row0 = (int64_t)b * T_ + t0;
    // ---- 1. RMSNorm (warp w: rows 4w .. 4w+3; lane: columns lane + 32 q), or the given normed rows
    if (tid < LF_TT) sST[LF_HALO + tid] = (tid < len && p.starts && p.starts[row0 + tid]) ? 1.f : 0.f;
    {
      float v[4][4];
      if (!p.u_given) {
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
          const int i = warp * 4 + rr;
#pragma unroll
          for (int q = 0; q < 4; ++q) v[rr][q] = i < len ? p.h[(row0 + i) * LF_DM + lane + 32 * q] : 0.f;
        }
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
          const int i = warp * 4 + rr;
          float ss = 0.f;
#pragma unroll
          for (int q = 0; q < 4; ++q) ss = fmaf(v[rr][q], v[rr][q], ss);
          ss = group_sum<32>(ss);
          const float rs = rsqrtf(ss / LF_DM + p.eps);
          const bool mine = i < len && i % LF_CL == rank;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int c = lane + 32 * q;
            const T o = from_f<T>(v[rr][q] * rs * nw[q]);
            sU[c * LF_SU + i] = i < len ? to_f(o) : 0.f;
            if (mine) reinterpret_cast<T*>(p.u)[(row0 + i) * LF_DM + c] = o;
          }
          if (mine && lane == 0) p.rstd[row0 + i] = rs;
        }
      } else {
        const T* u = reinterpret_cast<const T*>(p.u);
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
          const int i = warp * 4 + rr;
#pragma unroll
          for (int q = 0; q < 4; ++q) v[rr][q] = i < len ? to_f(u[(row0 + i) * LF_DM + lane + 32 * q]) : 0.f;
        }
#pragma unroll
        for (int rr = 0; rr < 4; ++rr)
#pragma unroll
          for (int q = 0; q < 4; ++q) sU[(lane + 32 * q) * LF_SU + warp * 4 + rr] = v[rr][q];
      }
    }
    __syncthreads();
    if (prof && t0 == 0) prof[2] = clock64();
    // ---- 2. in_proj: thread (tr, tc) computes rows 2tr, 2tr+1 x block columns 4tc .. 4tc+3 over k = DM
    {
      const int tr = tid >> 4, tc = tid & 15;
      float acc[2][4];
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[a][q] = 0.f;
#pragma unroll 8
      for (int k = 0; k < LF_DM; ++k) {
        const float2 a = *reinterpret_cast<const float2*>(sU + k * LF_SU + 2 * tr);
        const float4 w = *reinterpret_cast<const float4*>(sWin + k * LF_XZ + 4 * tc);
        acc[0][0] = fmaf(a.x, w.x, acc[0][0]); acc[0][1] = fmaf(a.x, w.y, acc[0][1]);
        acc[0][2] = fmaf(a.x, w.z, acc[0][2]); acc[0][3] = fmaf(a.x, w.w, acc[0][3]);
        acc[1][0] = fmaf(a.y, w.x, acc[1][0]); acc[1][1] = fmaf(a.y, w.y, acc[1][1]);
        acc[1][2] = fmaf(a.y, w.z, acc[1][2]); acc[1][3] = fmaf(a.y, w.w, acc[1][3]);
      }
      T* xz = reinterpret_cast<T*>(p.xz);
#pragma unroll
      for (int a = 0; a < 2; ++a) {
        const int i = 2 * tr + a;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int j = 4 * tc + q;
          const T o = from_f<T>(acc[a][q]);
          if (j < LF_CH) sX[(LF_HALO + i) * LF_CH + j] = to_f(o);
          else sZ[i * LF_CH + j - LF_CH] = siluf_(to_f(o));  // the gate, SiLU of the rounded z (as scan_fwd)
          if (i < len) xz[(row0 + i) * (2 * LF_DI) + (j < LF_CH ? c0 + j : LF_DI + c0 + j - LF_CH)] = o;
        }
      }
    }
    __syncthreads();
    if (prof && t0 == 0) prof[3] = clock64();
    // ---- 3. causal conv + SiLU: channel c = lane, rows 4 warp .. 4 warp + 3 (conv_fwd's taps and order)
    {
      const int c = lane;
      float w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) w[k] = sCW[c * 4 + k];
      const float bias = sCB[c];
      T* xc = reinterpret_cast<T*>(p.xc);
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const int i = warp * 4 + a;
        float pre = bias;
        bool valid = true;
#pragma unroll
        for (int k = 3; k >= 0; --k) {
          if (k < K) {
            const int li = LF_HALO + i - (K - 1) + k;  // tap time t - (K-1) + k
            if (valid) pre = fmaf(w[k], sX[li * LF_CH + c], pre);
            if (sST[li] != 0.f) valid = false;
          }
        }
        const T o = from_f<T>(siluf_(pre));
        sXC[i * LF_CH + c] = i < len ? to_f(o) : 0.f;
        if (i < len) xc[(row0 + i) * LF_DI + c0 + c] = o;
      }
    }
    __syncthreads();
    if (prof && t0 == 0) prof[4] = clock64();
    // the halo for the next tile (and the final window): the last d_conv - 1 times, moved by the thread of
    // each column (all reads before the writes: the source and target rows overlap when len < d_conv - 1)
    if (tid < LF_CH) {
      float hv[LF_HALO];
#pragma unroll
      for (int j = 0; j < LF_HALO; ++j) hv[j] = j < K - 1 ? sX[(LF_HALO + len - (K - 1) + j) * LF_CH + tid] : 0.f;
#pragma unroll
      for (int j = 0; j < LF_HALO; ++j)
        if (j < K - 1) sX[(LF_HALO - (K - 1) + j) * LF_CH + tid] = hv[j];
    } else if (tid == LF_CH) {
      float hs[LF_HALO];
#pragma unroll
      for (int j = 0; j < LF_HALO; ++j) hs[j] = j < K - 1 ? sST[LF_HALO + len - (K - 1) + j] : 0.f;
#pragma unroll
      for (int j = 0; j < LF_HALO; ++j)
        if (j < K - 1) sST[LF_HALO - (K - 1) + j] = hs[j];
    }
    // ---- 4. x_proj partials over the block's channels: row i = tid / 8, outputs e = tid % 8 + 8 q
    {
      const int i = tid >> 3, eg = tid & 7;
      float acc[6];
#pragma unroll
      for (int q = 0; q < 6; ++q) acc[q] = 0.f;
#pragma unroll 4
      for (int c = 0; c < LF_CH; ++c) {
        const float xv = sXC[i * LF_CH + c];
#pragma unroll
        for (int q = 0; q < 6; ++q) {
          const int e = eg + 8 * q;
          if (e < E) acc[q] = fmaf(xv, sWx[c * E + e], acc[q]);
        }
      }
#pragma unroll
      for (int q = 0; q < 6; ++q) {
        const int e = eg + 8 * q;
        if (e < E) sPX[i * E + e] = acc[q];
      }
    }
    cluster.sync();
    if (prof && t0 == 0) prof[5] = clock64();
    // the cluster's sums in rank order -> dbc (rounded); the block owning row i (i % 8) writes it
    {
      const int i = tid >> 3, eg = tid & 7;
      T* dbc = reinterpret_cast<T*>(p.dbc);
      float pv[6][LF_CL];  // every remote load in flight before the first add
#pragma unroll
      for (int q = 0; q < 6; ++q)
#pragma unroll
        for (int r = 0; r < LF_CL; ++r) pv[q][r] = eg + 8 * q < E ? rPX[r][i * E + eg + 8 * q] : 0.f;
#pragma unroll
      for (int q = 0; q < 6; ++q) {
        const int e = eg + 8 * q;
        if (e < E) {
          float v = 0.f;
#pragma unroll
          for (int r = 0; r < LF_CL; ++r) v += pv[q][r];
          const T o = from_f<T>(v);
          sDBC[i * E + e] = to_f(o);
          if (i < len && i % LF_CL == rank) dbc[(row0 + i) * E + e] = o;
        }
      }
    }
    __syncthreads();
    if (prof && t0 == 0) prof[6] = clock64();
    // ---- 5. dt = dbc[:, :R] @ dt_proj^T (rounded), softplus(dt + dt_bias): channel c = lane
    {
      const int c = lane;
      T* dto = reinterpret_cast<T*>(p.dt);
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int r = 0; r < R; ++r) {
        const float w = sWdt[r * LF_CH + c];
#pragma unroll
        for (int a = 0; a < 4; ++a) acc[a] = fmaf(sDBC[(warp + 8 * a) * E + r], w, acc[a]);
      }
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const int i = warp + 8 * a;
        const T o = from_f<T>(acc[a]);
        if (i < len) dto[(row0 + i) * LF_DI + c0 + c] = o;
        sDL[i * LF_CH + c] = i < len ? softplusf_(to_f(o) + sDTB[c]) : 0.f;  // pad: decay 1, no input
      }
    }
    __syncthreads();
    if (prof && t0 == 0) prof[7] = clock64();
    // ---- 6. the scan (scan_fwd's step: s = exp(dl A) (start ? 0 : s) + dl x B, y = C.s + D x, times SiLU(z)),
    // a chunk of SCAN_TC steps at a time: the recurrence first, each lane keeping its 2 states' share of C.s per
    // step (no shuffle inside the recurrence), then one transpose-reduce over the channel's 8 lanes after which
    // lane gi holds the sums of steps 2 gi and 2 gi + 1 (14 shuffles a chunk instead of 3 a step)
    {
      T* yo = reinterpret_cast<T*>(p.y);
      const float Dd = sDD[cl];
#pragma unroll 1
      for (int i0 = 0; i0 < LF_TT; i0 += SCAN_TC) {
        if (p.ckpt && t0 + i0 < T_)
          *reinterpret_cast<float2*>(p.ckpt + (((int64_t)b * nC + (t0 + i0) / SCAN_TC) * LF_DI + d) * LF_N + n0) =
              make_float2(s[0], s[1]);
        float yp[SCAN_TC];
#pragma unroll
        for (int k = 0; k < SCAN_TC; ++k) {
          const int i = i0 + k;
          const float xv = sXC[i * LF_CH + cl], dl = sDL[i * LF_CH + cl];
          const bool st = sST[LF_HALO + i] != 0.f;
          const float dx_ = dl * xv;
          float yv = 0.f;
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            s[j] = fmaf(ex2f_(dl * A2[j]), st ? 0.f : s[j], dx_ * sDBC[i * E + R + n0 + j]);
            yv = fmaf(s[j], sDBC[i * E + R + LF_N + n0 + j], yv);
          }
          yp[k] = yv;
        }
        float v1[8], v2[4], v3[2];
        const bool h4 = gi & 4, h2 = gi & 2, h1 = gi & 1;
#pragma unroll
        for (int k = 0; k < 8; ++k)
          v1[k] = (h4 ? yp[8 + k] : yp[k]) + __shfl_xor_sync(0xffffffffu, h4 ? yp[k] : yp[8 + k], 4);
#pragma unroll
        for (int k = 0; k < 4; ++k)
          v2[k] = (h2 ? v1[4 + k] : v1[k]) + __shfl_xor_sync(0xffffffffu, h2 ? v1[k] : v1[4 + k], 2);
#pragma unroll
        for (int k = 0; k < 2; ++k)
          v3[k] = (h1 ? v2[2 + k] : v2[k]) + __shfl_xor_sync(0xffffffffu, h1 ? v2[k] : v2[2 + k], 1);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int i = i0 + 2 * gi + k;
          const T o = from_f<T>(fmaf(Dd, sXC[i * LF_CH + cl], v3[k]) * sZ[i * LF_CH + cl]);
          sY[i * LF_CH + cl] = to_f(o);
          if (i < len) yo[(row0 + i) * LF_DI + d] = o;
        }
      }
    }
    __syncthreads();
    if (prof && t0 == 0) prof[8] = clock64();
    // ---- 7. out_proj partials: rows 4 warp .. 4 warp + 3, columns 4 lane .. 4 lane + 3, over the block's channels
    {
      float acc[4][4];
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[a][q] = 0.f;
#pragma unroll 4
      for (int c = 0; c < LF_CH; ++c) {
        const float4 w = *reinterpret_cast<const float4*>(sWo + c * LF_DM + 4 * lane);
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          const float yv = sY[(warp * 4 + a) * LF_CH + c];
          acc[a][0] = fmaf(yv, w.x, acc[a][0]); acc[a][1] = fmaf(yv, w.y, acc[a][1]);
          acc[a][2] = fmaf(yv, w.z, acc[a][2]); acc[a][3] = fmaf(yv, w.w, acc[a][3]);
        }
      }
#pragma unroll
      for (int a = 0; a < 4; ++a)
        *reinterpret_cast<float4*>(sPO + (warp * 4 + a) * LF_DM + 4 * lane) =
            make_float4(acc[a][0], acc[a][1], acc[a][2], acc[a][3]);
    }
    cluster.sync();
    if (prof && t0 == 0) prof[9] = clock64();
    // the cluster's sums in rank order plus the residual: this block's 16 columns, row i = tid / 8, 2 columns
    {
      const int i = tid >> 3, m0 = rank * LF_OC + (tid & 7) * 2;
      if (i < len) {
        const float2 hv = *reinterpret_cast<const float2*>(p.h + (row0 + i) * LF_DM + m0);
        float v0 = 0.f, v1 = 0.f;
#pragma unroll
        for (int r = 0; r < LF_CL; ++r) {
          v0 += rPO[r][i * LF_DM + m0];
          v1 += rPO[r][i * LF_DM + m0 + 1];
        }
        *reinterpret_cast<float2*>(p.h_out + (row0 + i) * LF_DM + m0) = make_float2(hv.x + v0, hv.y + v1);
      }
    }
    cluster.sync();  // every block has read the partials before any block overwrites them (and before exit)
    if (prof && t0 == 0) prof[10] = clock64();
  }
  // ---- final states: the SSM state, and the conv window (halo = the last d_conv - 1 times; conv_fwd's rule:
  // entries older than the latest start in the window are zero)
#pragma unroll
  for (int j = 0; j < 2; ++j) p.ssm_final[((int64_t)b * LF_DI + d) * LF_N + n0 + j] = s[j];
  if (tid < LF_CH) {
    float* fb = p.conv_final + ((int64_t)b * LF_DI + c0 + tid) * (K - 1);
    bool valid = true;
    for (int j = K - 2; j >= 0; --j) {
      const int li = LF_HALO - (K - 1) + j;
      fb[j] = valid ? sX[li * LF_CH + tid] : 0.f;
      if (sST[li] != 0.f) valid = false;
    }
  }
  if (prof) prof[11] = clock64();
}

const char* layer_fwd_supported(int DM, int DI, int N, int R, int K) {
  if (DM != LF_DM || DI != LF_DI) return "layer_fwd: needs d_model 128 and d_inner 256";
  if (N != LF_N) return "layer_fwd: needs d_state 16";
  if (R < 1 || R > LF_MAX_R) return "layer_fwd: needs 1 <= dt_rank <= 16";
  if (K < 2 || K > 4) return "layer_fwd: needs d_conv 2, 3 or 4";
  return nullptr;
}

template <typename T>
static const char* layer_fwd_t(const LayerFwdParams& p, cudaStream_t s) {
  const size_t smem = (size_t)lf_smem(p.R + 2 * LF_N, p.R).total * sizeof(float);
  cudaError_t e = cudaFuncSetAttribute(layer_fwd_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  layer_fwd_kernel<T><<<p.B * LF_CL, LF_THREADS, smem, s>>>(p);
  MRL_LAUNCH_CHECK();
  return nullptr;
}

const char* layer_fwd(int dtype, const LayerFwdParams& p, cudaStream_t s) {
  if (const char* why = layer_fwd_supported(p.DM, p.DI, p.N, p.R, p.K)) return why;
  if (p.B < 1 || p.T < 1) return nullptr;
  switch (dtype) {
    case kF32: return layer_fwd_t<float>(p, s);
    case kBF16: return layer_fwd_t<__nv_bfloat16>(p, s);
    case kF16: return layer_fwd_t<__half>(p, s);
  }
  return "layer_fwd: unsupported dtype";
}

}  // namespace mrl
