// One-token backbone step on thread-block clusters for many rows ("cluster3": R = 8, 16, 24 or 32 rows a cluster of
// 8 blocks, for 32 < B <= 512). Block q owns channels [32q, 32q + 32) of d_inner (= 256) as in cluster2, the d_model
// columns [16q, 16q + 16) of the residual stream and the cluster's rows [q R / 8, (q + 1) R / 8) of the x_proj
// outputs. What differs from cluster2 (step_cluster2.cuh), which walks its rows in turn through shuffle trees and
// gives every block every row's x_proj and out_proj sums:
// - each projection is a product over the rows with a thread per (4 outputs or 1, slice of the reduction): the
//   thread's weights sit in its registers, the rows' inputs are read from shared memory (the lanes of an output
//   group read one row's adjacent 16-byte words, the groups of a warp the same ones), and shuffle trees sum the
//   slices 4 rows at a time (sc2_group_sums: in_proj one over 16 lanes, x_proj one over 4, out_proj one per
//   output over 8). in_proj and out_proj threads own 4 outputs, so every input value a thread reads feeds 4
//   FMAs: per row and thread 2 16-byte loads for 32 FMAs in in_proj, 1 for 16 in out_proj (2 for 8 in x_proj);
// - x_proj is a reduce-scatter and an all-gather: a block pushes its sum over its channels of (row r, output o)
//   to r's owner only (nx scalar st.async a row), the owner adds the 8 blocks' sums in rank order and pushes its
//   rows (16-byte st.async, ceil(nx / 4) words a row) into every block (R / 8 rows x ceil(nx / 4) x 8 a block);
// - out_proj is a reduce-scatter: a block's sums for columns [16q, 16q + 16) go to block q only (warp w's outputs
//   are block w's columns, 4 consecutive columns of a row in one 16-byte st.async: 32 a row), block q adds the 8
//   blocks' sums in rank order into its columns of the residual and pushes those (16-byte st.async, 4 a row) into
//   every block, which then holds the whole residual again and forms each row's RMSNorm itself. So the out
//   exchange moves R x 128 floats a block in and out, not 8 R x 128 in, and shared memory takes R = 32 (B = 256
//   in 8 clusters: one wave on an H100, which holds 15 clusters of 8);
// - the input projection: block q computes its 16 columns of every row and pushes them the same way.
// Per-channel phases (conv, state update) and the norm are cluster2's functions. Deterministic: the result
// depends on the shape only.
#pragma once
#include <type_traits>
#include "step_cluster2.cuh"

namespace mrl {

constexpr int SC3_COLS = SC2_DM / SC2_CL;  // d_model columns a block owns (16)
constexpr int SC3_DSP = 40;                // padded row of xcs / zs / ys: 4 rows of 8 outputs hit 32 banks

// A thread's weights of one layer; 16-byte words hold CPL elements. in_proj: group g = t / 16 owns outputs
// 4g + j (j < 4; output o is xi channel d0 + o for o < 32, else z channel d0 + o - 32), slice s = t % 16 the
// columns CPL (s + 16k) + [0, CPL), k < KI, in wi[KI j + k]. x_proj: output t / 4 (zero past rank + 2 d_state),
// channels d0 + CPL (s + 4k) + [0, CPL), s = t % 4, k < KX. out_proj: warp w's lane group g = lane / 8 owns
// outputs 16w + 4g + j (j < 4), slice s = lane % 8 the channels d0 + 4s + [0, 4), in wo[j] (a 16-byte word in
// f32, 8 bytes in 16-bit types). Weights a thread: 32 in_proj, 16 out_proj (4 x 4), 8 x_proj.
template <typename WT>
struct Sc3Proj {
  static constexpr int CPL = 16 / (int)sizeof(WT);
  static constexpr int KI = SC2_DM / 16 / CPL, KX = SC2_DS / 4 / CPL;
  using OWord = std::conditional_t<sizeof(WT) == 4, uint4, uint2>;  // 4 elements
  uint4 wi[4 * KI], wx[KX];
  OWord wo[4];
  float nw[4];
};

// acc + the products of a weight word's elements (16 / sizeof(WT) or 8 / sizeof(WT)) with x[0..), in element order
template <typename WT>
__device__ __forceinline__ float sc3_dot_acc(const uint4& w, const float* x, float acc) {
  const uint32_t w4[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int e = 0; e < 16 / (int)sizeof(WT); ++e) acc = fmaf(welem<WT>(w4, e), x[e], acc);
  return acc;
}
template <typename WT>
__device__ __forceinline__ float sc3_dot_acc(const uint2& w, const float* x, float acc) {
  const uint32_t w2[2] = {w.x, w.y};
#pragma unroll
  for (int e = 0; e < 8 / (int)sizeof(WT); ++e) acc = fmaf(welem<WT>(w2, e), x[e], acc);
  return acc;
}

// v into a 16-byte aligned shared::cluster address, completing 16 bytes on the mbarrier at `bar` (same block)
__device__ __forceinline__ void sc3_push4(uint32_t dst, float4 v, uint32_t bar) {
  asm volatile("st.async.weak.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
               :: "r"(dst), "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
                  "r"(__float_as_uint(v.w)), "r"(bar) : "memory");
}
// v into the same 16-byte aligned shared-memory slot of all 8 blocks of the cluster, 16 bytes on each mbarrier
__device__ __forceinline__ void sc3_push4_all(uint32_t slot, float4 v, uint32_t bar) {
#pragma unroll
  for (int k = 0; k < SC2_CL; ++k) sc3_push4(sc2_mapa(slot, k), v, sc2_mapa(bar, k));
}

__device__ __forceinline__ float4 sc3_add4(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// The exchanges (st.async into the receivers' shared memory, each completing its bytes on the receiver's
// mbarrier of that buffer) and their buffers' reuse across layers. Each mbarrier is armed for layer l + 1 by tid 0
// right after its wait of layer l. In the chains below, a st.async and the receiver's mbarrier wait link the
// blocks causally (the receiver pushes only what it waited for, or after a block barrier behind that wait), so a
// push of layer l + 1 into block q comes after q's reads of that buffer in layer l and after q's arm for layer
// l + 1 (no byte counted in the wrong phase):
// - gx (x_proj sums, at the rows' owner q): q's summing threads, tid 0 among them, wait, (tid 0) arm, read gx and
//   push the rows into every block's dbc; a block pushes its layer l + 1 sums only after its dbc wait of layer l;
// - dbc (the gathered x_proj outputs, in every block p): p's tid 0 arms after its wait, p reads dbc in the state
//   update, then a __syncthreads, then p's x_proj pushes of layer l + 1, which the owners wait for before they
//   push layer l + 1's rows into p;
// - go (out_proj sums, at the columns' owner q): q's residual threads, tid 0 among them, wait, (tid 0) arm, read
//   go and push their columns into every block's h; a block pushes its layer l + 1 sums after its residual wait;
// - h (residual, in every block p): p's tid 0 arms after its wait, p reads h (its own columns' update, the norm),
//   then a __syncthreads, then p's out_proj pushes of layer l + 1, which the owners wait for before their pushes.
template <typename WT, int R, int N>
__global__ void __cluster_dims__(SC2_CL, 1, 1) __launch_bounds__(SC2_THREADS, 1)
backbone_step_cluster3_kernel(StepParams p) {
  namespace cg = cooperative_groups;
  using PW = Sc3Proj<WT>;
  constexpr int DM = SC2_DM, DS = SC2_DS, NXP = SC2_NXP, W = SC2_W, CPL = PW::CPL, COLS = SC3_COLS, S = SC3_DSP;
  constexpr int KI = PW::KI, KX = PW::KX;
  constexpr int RW = R / W;       // rows per thread in the per-channel phases (rows warp, warp + 8, ...)
  constexpr int RO = R / SC2_CL;  // x_proj rows a block owns
  static_assert(R % 4 == 0 && R % W == 0 && R * 4 <= SC2_THREADS, "cluster3: R must be 8, 16, 24 or 32");
  const int rank = (int)cg::this_cluster().block_rank();
  const int b0 = (int)(blockIdx.x / SC2_CL) * R;
  const int D = p.D, rk = p.rank, L = p.L, B = p.B, in_dim = p.in_dim;
  const int nx = rk + 2 * N, nq = (nx + 3) / 4;  // x_proj outputs, their 16-byte words a row (padded)
  const int d0 = rank * DS, c0 = rank * COLS;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int dch = d0 + lane;  // this thread's channel in the per-channel phases
  extern __shared__ float4 sm4[];
  float* h = reinterpret_cast<float*>(sm4);  // [R][DM] residual stream (every block all of it)
  float* u = h + R * DM;                     // [R][DM] the layer's normalised input
  float* xcs = u + R * DM;                   // [R][S] in_proj's xi, then the conv output
  float* zs = xcs + R * S;                   // [R][S] gate input z
  float* ys = zs + R * S;                    // [R][S] gated SSM output
  float* dbc = ys + R * S;                   // [R][NXP] x_proj outputs (summed over the cluster), pushed here
  float* gx = dbc + R * NXP;                 // [CL][RO][NXP] every block's x_proj sums of this block's rows
  float* go = gx + SC2_CL * RO * NXP;        // [CL][R][COLS] every block's out_proj sums of this block's columns
  uint64_t* bars = reinterpret_cast<uint64_t*>(go + SC2_CL * R * COLS);  // the 4 exchanges' mbarriers
#ifdef MRL_SC2_PROBE
  long long* stp = reinterpret_cast<long long*>(bars + 4);  // [W][64] phase stamps (cluster2's points, below)
  float* xin = reinterpret_cast<float*>(stp + W * 64);
  SC2_STAMP(0);
  SC2_GSTAMP(61);
#else
  float* xin = reinterpret_cast<float*>(bars + 4);  // [R][in_dim]
#endif
  const uint32_t bar_x = sc2_saddr(bars), bar_d = sc2_saddr(bars + 1), bar_o = sc2_saddr(bars + 2),
                 bar_h = sc2_saddr(bars + 3);
  // the bytes each block receives per layer: x_proj sums (8 blocks x RO rows x nx), the gathered x_proj outputs
  // (R rows x nq words), out_proj sums (8 blocks x R rows x COLS), residual (R rows x DM)
  const uint32_t bytes_x = SC2_CL * RO * nx * 4, bytes_d = R * nq * 16, bytes_o = SC2_CL * R * COLS * 4,
                 bytes_h = R * DM * 4;
  // the mbarriers armed (the residual's for the input projection's exchange) and visible to the cluster before
  // any block pushes
  if (tid == 0) {
    sc2_bar_init(bar_x);
    sc2_bar_init(bar_d);
    sc2_bar_init(bar_o);
    sc2_bar_init(bar_h);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    sc2_bar_arm(bar_x, bytes_x);
    sc2_bar_arm(bar_d, bytes_d);
    sc2_bar_arm(bar_o, bytes_o);
    sc2_bar_arm(bar_h, bytes_h);
  }
  // relaxed, as cluster2's; waited on before the first push
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");

  bool rowact[RW], rowst[RW];
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    const int b = b0 + warp + W * i;
    rowact[i] = b < B;
    rowst[i] = rowact[i] && p.starts ? p.starts[b] : false;
  }
  // the projections' roles of this thread (see Sc3Proj)
  const int gi = tid >> 4, si = tid & 15, ox = tid >> 2, sx = tid & 3, go4 = lane >> 3, so = lane & 7;
  const int wrow_i = gi < 8 ? d0 + 4 * gi : D + d0 + 4 * gi - DS;  // in_proj weight row of output 4 gi

  PW pw;
  Sc2Chan<WT, N, RW> ch;
  auto load_in = [&](int l) {
    const WT* w = reinterpret_cast<const WT*>(p.layer[l].in_w) + (int64_t)wrow_i * DM + CPL * si;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int k = 0; k < KI; ++k)
        pw.wi[KI * j + k] = __ldg(reinterpret_cast<const uint4*>(w + j * DM + 16 * CPL * k));
  };
  auto load_xp = [&](int l) {
    const WT* w = reinterpret_cast<const WT*>(p.layer[l].x_w) + (int64_t)ox * D + d0;
#pragma unroll
    for (int k = 0; k < KX; ++k)
      pw.wx[k] = ox < nx ? __ldg(reinterpret_cast<const uint4*>(w + CPL * (sx + 4 * k))) : make_uint4(0, 0, 0, 0);
  };
  auto load_out = [&](int l) {
    using OW = typename PW::OWord;
    const WT* w = reinterpret_cast<const WT*>(p.layer[l].out_w) + (int64_t)(16 * warp + 4 * go4) * D + d0 + 4 * so;
#pragma unroll
    for (int j = 0; j < 4; ++j) pw.wo[j] = __ldg(reinterpret_cast<const OW*>(w + j * D));
  };
  auto load_norm = [&](int l) {  // the RMSNorm weight applied after layer l-1 (norm_f after the last)
    const float* nw = l < L ? p.layer[l].norm_w : p.normf_w;
#pragma unroll
    for (int i = 0; i < 4; ++i) pw.nw[i] = __ldg(nw + lane + 32 * i);
  };
  auto load_chan = [&](int l) { sc2_load_chan<WT, N, RW, W, R>(p, l, b0, warp, dch, rowact, ch); };
  // this block's columns of the residual into every block (rows tid / 4, columns c0 + 4 (tid % 4) + [0, 4))
  auto push_cols = [&](float4 v) {
    sc3_push4_all(sc2_saddr(h + (tid >> 2) * DM + c0 + 4 * (tid & 3)), v, bar_h);
  };

  // ---- prologue: the rows' inputs and this block's 16 rows of the input projection's weight staged in shared
  // memory (the weight in go, free until layer 0's out_proj exchange: no block pushes there before it has every
  // block's columns of the residual, which this block sends after reading go), layer 0's weights in flight; then
  // this block's 16 columns of the input projection (bias + x W^T, in input order) pushed to every block. The
  // weight goes in chunks of kc < 8 R inputs (rows kc + 1 apart: no bank conflicts); the first chunk's loads (2 a
  // thread for in_dim <= 32) are in flight with layer 0's, so the prologue waits about one memory round trip, not
  // one per input.
  constexpr int PE = 2;                                 // first-chunk elements a thread loads early
  const int KC = min(in_dim, SC2_CL * R - 1);           // inputs a chunk (go holds 8 R x 16 floats)
  const WT* iw = reinterpret_cast<const WT*>(p.inp_w) + (int64_t)c0 * in_dim;  // rows c0 .. c0 + 15, contiguous
  float* wsm = go;                                      // [COLS][kc + 1]
  auto stage_at = [&](int e, int k0, int kc) {          // element e of the chunk [k0, k0 + kc): row e / kc
    const int j = e / kc;
    return to_f(iw[(int64_t)j * in_dim + k0 + (e - j * kc)]);
  };
  auto stage_slot = [&](int e, int kc) { return e + e / kc; };  // where element e goes in wsm
  float wv[PE];
#pragma unroll
  for (int m = 0; m < PE; ++m) {
    const int e = tid + SC2_THREADS * m;
    wv[m] = e < COLS * KC ? stage_at(e, 0, KC) : 0.f;
  }
  for (int i = tid; i < R * in_dim; i += SC2_THREADS) {
    const int r = i / in_dim, b = b0 + r;
    xin[i] = b < B ? p.x[(int64_t)b * in_dim + (i - r * in_dim)] : 0.f;
  }
  constexpr int PO = (R * COLS + SC2_THREADS - 1) / SC2_THREADS;  // outputs a thread (row i / COLS, column i % COLS)
  float acc[PO];
#pragma unroll
  for (int m = 0; m < PO; ++m) {
    const int i = tid + SC2_THREADS * m;
    acc[m] = i < R * COLS ? to_f(reinterpret_cast<const WT*>(p.inp_b)[c0 + i % COLS]) : 0.f;
  }
  load_in(0); load_chan(0); load_xp(0); load_out(0); load_norm(0);
#pragma unroll
  for (int m = 0; m < PE; ++m) {
    const int e = tid + SC2_THREADS * m;
    if (e < COLS * KC) wsm[stage_slot(e, KC)] = wv[m];
  }
  for (int k0 = 0; k0 < in_dim; k0 += KC) {
    const int kc = min(KC, in_dim - k0);
    if (k0 > 0) __syncthreads();  // the previous chunk read
    // the chunk's elements not yet staged (the first chunk's first PE a thread are, above)
    for (int e = tid + (k0 == 0 ? SC2_THREADS * PE : 0); e < COLS * kc; e += SC2_THREADS)
      wsm[stage_slot(e, kc)] = stage_at(e, k0, kc);
    __syncthreads();
#pragma unroll
    for (int m = 0; m < PO; ++m) {
      const int i = tid + SC2_THREADS * m;
      if (i >= R * COLS) continue;
      const int r = i / COLS, j = i - r * COLS;
      const float* wr = wsm + j * (kc + 1);
      const float* xr = xin + r * in_dim + k0;
      float a = acc[m];
      for (int k = 0; k < kc; ++k) a = fmaf(wr[k], xr[k], a);
      acc[m] = a;
    }
  }
#pragma unroll
  for (int m = 0; m < PO; ++m) {
    const int i = tid + SC2_THREADS * m;
    if (i < R * COLS) h[(i / COLS) * DM + c0 + i % COLS] = acc[m];
  }
  __syncthreads();
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
  if (tid < R * 4) push_cols(*reinterpret_cast<const float4*>(h + (tid >> 2) * DM + c0 + 4 * (tid & 3)));
  sc2_bar_wait(bar_h, 0);
  if (tid == 0) sc2_bar_arm(bar_h, bytes_h);
  sc2_norm_rows<RW, W, R>(p, h, u, pw.nw, b0, warp, lane, rank, false);
  load_norm(1);
  __syncthreads();
  SC2_STAMP(1);

  for (int l = 0; l < L; ++l) {
    // ---- in_proj: outputs 4 gi + j of every row, 4 rows at a time; a[4 j + i] is (output 4 gi + j, row c + i),
    // the 16 slices summed by one shuffle tree
#pragma unroll 1
    for (int c = 0; c < R; c += 4) {
      float a[16];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float* ur = u + (c + i) * DM + CPL * si;
#pragma unroll
        for (int k = 0; k < KI; ++k) {
          float uv[CPL];
          sc2_lds(ur + 16 * CPL * k, uv);
#pragma unroll
          for (int j = 0; j < 4; ++j) a[4 * j + i] = sc3_dot_acc<WT>(pw.wi[KI * j + k], uv, k ? a[4 * j + i] : 0.f);
        }
      }
      const float v = sc2_group_sums<16, 16>(a, lane);  // output 4 gi + si / 4, row c + si % 4
      (gi < 8 ? xcs : zs)[(c + (si & 3)) * S + 4 * (gi & 7) + (si >> 2)] = v;
    }
    SC2_STAMP(2 + 18 * l);
    __syncthreads();
    SC2_STAMP(3 + 18 * l);
    // ---- conv step (the thread's channel, rows warp + 8i); xcs goes from xi to the conv output
    sc2_zero_started(rowst, ch);
    sc2_conv_rows<WT, N, RW, W, R, S>(p, l, b0, warp, lane, dch, rowact, ch, xcs, zs);
    SC2_STAMP(4 + 18 * l);
    __syncthreads();
    SC2_STAMP(5 + 18 * l);
    // ---- x_proj over the block's 32 channels: (row r, output ox) pushed into slot `rank` of gx at r's owner
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
          sc2_lds(xr + CPL * (sx + 4 * k), xv);
          acc = sc3_dot_acc<WT>(pw.wx[k], xv, acc);
        }
        a[j] = acc;
      }
      const float v = sc2_group_sums<4, 4>(a, lane);  // row c + sx
      const int r = c + sx, q = r / RO;
      if (ox < nx) sc2_push(sc2_mapa(sc2_saddr(gx + (rank * RO + r - q * RO) * NXP + ox), q), v, sc2_mapa(bar_x, q));
    }
    if (l + 1 < L) load_xp(l + 1);
    if (l + 1 < L) load_in(l + 1);
    SC2_STAMP(6 + 18 * l);
    // while the cluster's sums are in flight: the state-update rates -exp(A_log) of this thread's channel
#pragma unroll
    for (int n = 0; n < N; ++n) ch.Al[n] = -expf(ch.Al[n]);
    // ---- this block's x_proj rows: the 8 blocks' sums in rank order, word j4 / 4 of row rank RO + rl, pushed
    // into every block's dbc (the padding past nx, never read, comes along; tid 0 is one of these threads)
    if (tid < RO * nq) {
      sc2_bar_wait(bar_x, l & 1);
      if (tid == 0 && l + 1 < L) sc2_bar_arm(bar_x, bytes_x);  // the next layer's phase
      const int rl = tid / nq, j4 = 4 * (tid - rl * nq);
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int q = 0; q < SC2_CL; ++q) a = sc3_add4(a, *reinterpret_cast<const float4*>(gx + (q * RO + rl) * NXP + j4));
      sc3_push4_all(sc2_saddr(dbc + (rank * RO + rl) * NXP + j4), a, bar_d);
    }
    SC2_STAMP(9 + 18 * l);
    sc2_bar_wait(bar_d, l & 1);
    if (tid == 0 && l + 1 < L) sc2_bar_arm(bar_d, bytes_d);
    SC2_STAMP(11 + 18 * l);
    // ---- dt_proj + softplus + state update + D skip + gate (the thread's channel and rows)
    sc2_state_rows<WT, N, RW, W, R, S, NXP>(p, l, b0, warp, lane, dch, rowact, ch, xcs, zs, dbc, ys);
    if (l + 1 < L) load_chan(l + 1);
    SC2_STAMP(12 + 18 * l);
    __syncthreads();
    SC2_STAMP(13 + 18 * l);
    // ---- out_proj over the block's 32 channels, 4 rows at a time; a[j][i] is (output 16 warp + 4 go4 + j, row
    // c + i), one shuffle tree per output over the 8 slices; lane pairs end with the 4 outputs of row c + so / 2,
    // which the even lane pushes as one 16-byte word to block warp (reduce-scatter)
    {
      const uint32_t dst = sc2_mapa(sc2_saddr(go + rank * R * COLS + 4 * go4), warp);
      const uint32_t dbar = sc2_mapa(bar_o, warp);
#pragma unroll 1
      for (int c = 0; c < R; c += 4) {
        float a[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float yv[4];
          sc2_lds(ys + (c + i) * S + 4 * so, yv);
#pragma unroll
          for (int j = 0; j < 4; ++j) a[j][i] = sc3_dot_acc<WT>(pw.wo[j], yv, 0.f);
        }
        float4 v;
        v.x = sc2_group_sums<4, 8>(a[0], lane);
        v.y = sc2_group_sums<4, 8>(a[1], lane);
        v.z = sc2_group_sums<4, 8>(a[2], lane);
        v.w = sc2_group_sums<4, 8>(a[3], lane);
        if (!(so & 1)) sc3_push4(dst + 4 * COLS * (c + (so >> 1)), v, dbar);
      }
    }
    if (l + 1 < L) load_out(l + 1);
    SC2_STAMP(14 + 18 * l);
    // ---- this block's columns of the residual: + the 8 blocks' sums in rank order, pushed to every block
    if (tid < R * 4) {
      sc2_bar_wait(bar_o, l & 1);
      if (tid == 0 && l + 1 < L) sc2_bar_arm(bar_o, bytes_o);
      const int r = tid >> 2, c4 = 4 * (tid & 3);
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int q = 0; q < SC2_CL; ++q) a = sc3_add4(a, *reinterpret_cast<const float4*>(go + (q * R + r) * COLS + c4));
      push_cols(sc3_add4(*reinterpret_cast<const float4*>(h + r * DM + c0 + c4), a));
    }
    SC2_STAMP(16 + 18 * l);
    sc2_bar_wait(bar_h, (l + 1) & 1);
    if (tid == 0 && l + 1 < L) sc2_bar_arm(bar_h, bytes_h);
    SC2_STAMP(17 + 18 * l);
    // ---- the next RMSNorm (warp per row) from the whole residual, or the output after the last layer
    sc2_norm_rows<RW, W, R>(p, h, u, pw.nw, b0, warp, lane, rank, l + 1 == L);
    if (l + 2 <= L) load_norm(l + 2);
    SC2_STAMP(18 + 18 * l);
    __syncthreads();
    SC2_STAMP(19 + 18 * l);
  }
  // no cluster barrier before exit: no block reads another's shared memory, and every push into this block's
  // shared memory has landed (every thread waited for the last residual exchange, which follows the others)
  SC2_PROBE_END();
}

inline size_t stepc3_smem_bytes(const StepParams& p, int R) {
  // h, u, xcs / zs / ys, dbc, gx (8 x R / 8 rows), go, the four mbarriers (8 floats), xin; the probe's stamps
  return sc2_smem_bytes_of((size_t)R * (2 * SC2_DM + 3 * SC3_DSP + 2 * SC2_NXP + SC2_CL * SC3_COLS + p.in_dim) +
                           8);
}

// what the kernel takes: cluster2's shapes (d_model 128, d_inner 256, d_conv 4, d_state 8 / 16, dt_rank <= 16,
// 16-byte aligned weights and states)
inline bool stepc3_supported(const StepParams& p) { return stepc2_supported(p); }

// The dynamic shared memory this instantiation's attribute allows, per device (raised above the default 48 KB by
// the launch and by the cluster-count query below, never lowered: the query used to set it to its own size, so
// after a query for a small input_dim a launch with a larger one failed with "invalid argument", seen as a
// flaky cluster3 test under pytest-xdist, where one process runs several input_dims).
using Sc3Opened = size_t[64];
template <typename WT, int R, int N>
Sc3Opened& stepc3_opened() {
  static size_t opened[64] = {0};
  return opened;
}

template <typename WT, int R, int N>
const char* stepc3_launch_rn(const StepParams& p, cudaStream_t s) {
  static int optin[64] = {0};
  return sc2_launch(backbone_step_cluster3_kernel<WT, R, N>, p, R, stepc3_smem_bytes(p, R), optin,
                    stepc3_opened<WT, R, N>(),
                    "backbone_step: cluster3 needs more shared memory per block than the device allows (fewer rows "
                    "per cluster or a smaller input_dim)", s);
}

// How many clusters of R rows the device runs at once (cudaOccupancyMaxActiveClusters for this kernel, its
// 8-block clusters and its shared memory; a GPC holds whole clusters, so an H100 / H200 runs 15 of 8 blocks),
// cached per device and shared-memory size (input_dim changes it); 0 where the query fails (e.g. the shared memory
// does not fit).
template <typename WT, int R, int N>
int stepc3_max_clusters_rn(const StepParams& p) {
  static int cached[64] = {0};
  static size_t cached_smem[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  const size_t smem = stepc3_smem_bytes(p, R);
  if (cached[dev] > 0 && cached_smem[dev] == smem) return cached[dev];
  auto kern = backbone_step_cluster3_kernel<WT, R, N>;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(SC2_CL * 64);
  cfg.blockDim = dim3(SC2_THREADS);
  cfg.dynamicSmemBytes = smem;
  int n = 0;
  Sc3Opened& opened = stepc3_opened<WT, R, N>();
  if (smem > 48 * 1024 && smem > opened[dev]) {  // sc2_launch's rule: the attribute only goes up, from 48 KB
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) {
      (void)cudaGetLastError();  // clear the (not sticky) error the failed call left
      return 0;
    }
    opened[dev] = smem;
  }
  if (cudaOccupancyMaxActiveClusters(&n, kern, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  cached_smem[dev] = smem;
  return cached[dev] = n;
}

template <typename WT>
int stepc3_max_clusters_t(const StepParams& p, int R) {
#define MRL_STEPC3_CASE(RR) \
  if (R == RR) return p.N == 16 ? stepc3_max_clusters_rn<WT, RR, 16>(p) : stepc3_max_clusters_rn<WT, RR, 8>(p);
  MRL_STEPC3_CASE(8) MRL_STEPC3_CASE(16) MRL_STEPC3_CASE(24) MRL_STEPC3_CASE(32)
#undef MRL_STEPC3_CASE
  return 0;
}

template <typename WT>
const char* stepc3_launch_t(const StepParams& p, int R, cudaStream_t s) {
#define MRL_STEPC3_CASE(RR)                                                                 \
  if (R == RR) return p.N == 16 ? stepc3_launch_rn<WT, RR, 16>(p, s) : stepc3_launch_rn<WT, RR, 8>(p, s);
  MRL_STEPC3_CASE(8) MRL_STEPC3_CASE(16) MRL_STEPC3_CASE(24) MRL_STEPC3_CASE(32)
#undef MRL_STEPC3_CASE
  return "backbone_step: cluster3 rows_per_cluster must be 8, 16, 24 or 32";
}

}  // namespace mrl
