// One-token backbone step on thread-block clusters, second design ("cluster2"): a cluster of 8 blocks owns R
// rows (R = 1..16); block q owns channels [32q, 32q + 32) of d_inner (= 256; d_model = 128). Every projection
// reads its weights in their own layout, coalesced: the lanes of a group read consecutive 16-byte words of one
// weight row (a whole in_proj row per warp in f32, the block's 32 columns of an x_proj / out_proj row per 8 lanes),
// each lane holds the products of several rows, and one transpose-reduce of shuffles per projection sums each
// row over its group (sc2_group_sums). The x_proj and out_proj sums over the block's channels are pushed into
// every block of the cluster (st.async into distributed shared memory, completing on the receiver's mbarrier),
// and each block adds the 8 blocks' sums in rank order. Every weight a thread uses sits in its registers, loaded
// after the same weights' use in the layer before (layer 0's at the start, with the input projection; in_proj's
// after the x_proj pushes rather than before them), so no phase waits on an L2 round trip. The per-row loops of
// the three projections are unrolled by 4, so independent rows' shuffle chains can overlap; the arithmetic per
// row is the same, so the same bits (both measured 1-2.5 % faster: benchmarks/NOTES.md, twenty-fifth session).
// Each layer's RMSNorm is folded into the previous layer's residual update (the warp that owns a row has all of
// it). Below 8 rows a cluster a row's state update is spread over the 8 / R warps, each its share of the states
// (sc2_state_spread; 0.8-3.5 % faster at B = 1-32, benchmarks/NOTES.md, twenty-sixth session). Deterministic: the
// result depends on the shape only.
#pragma once
#include <cooperative_groups.h>
#include "step.cuh"

namespace mrl {

constexpr int SC2_CL = 8;
constexpr int SC2_THREADS = 256;
constexpr int SC2_W = SC2_THREADS / 32;  // warps
constexpr int SC2_DM = 128;              // d_model
constexpr int SC2_DS = 32;               // channels per block (d_inner = 256)
constexpr int SC2_NXP = 64;              // padded row of the x_proj outputs (rank + 2 d_state <= 48)

// A thread's weights of one layer, as 16-byte words of CPL = 16 / sizeof(WT) elements, and the next RMSNorm
// weight at columns lane + 32i. in_proj: warp w owns the rows of xi channels 4w..4w+3 (slots 0-3) and z channels
// 4w..4w+3 (slots 4-7); LI = 128 / CPL lanes read one row (columns CPL (lane % LI) + [0, CPL)), so the thread holds
// the slots k RI + lane / LI, k < NI. x_proj: warp w owns outputs 8w + j (j < 8; zero past rank + 2 d_state),
// out_proj outputs 16w..16w+15; LO = 32 / CPL lanes read the block's 32 columns of one row.
template <typename WT>
struct Sc2Proj {
  static constexpr int CPL = 16 / (int)sizeof(WT);
  static constexpr int LI = SC2_DM / CPL, RI = 32 / LI, NI = 8 / RI;  // in_proj: lanes per row, rows per load, loads
  static constexpr int LO = SC2_DS / CPL, RO = 32 / LO;               // x_proj / out_proj: lanes per row, rows per load
  static constexpr int NX = 8 / RO, NO = 16 / RO;                     // loads of x_proj, of out_proj
  uint4 wi[NI], wx[NX], wo[NO];
  float nw[4];
};

// v[k] (k < V) of every lane, each summed over its aligned group of S lanes (V <= S, powers of 2) by a
// transpose-reduce: log2(V) levels that halve the values a lane carries (the lane with the level's bit set keeps
// the upper half), then plain butterfly levels. Returns the group's sum of v[k] for k = (lane % S) / (S / V),
// the same in the S / V lanes that hold it (IEEE addition commutes). A fixed tree: deterministic.
template <int V, int S>
__device__ __forceinline__ float sc2_group_sums(float (&v)[V], int lane) {
  static_assert(V >= 1 && V <= S && S <= 32 && (V & (V - 1)) == 0 && (S & (S - 1)) == 0, "sc2_group_sums");
  int n = V;
#pragma unroll
  for (int o = S / 2; o >= 1; o /= 2) {
    if (n > 1) {
      const bool up = lane & o;
#pragma unroll
      for (int i = 0; i < V / 2; ++i) {
        if (i >= n / 2) break;
        const float send = up ? v[i] : v[i + n / 2];
        const float keep = up ? v[i + n / 2] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
      }
      n /= 2;
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
    }
  }
  return v[0];
}

// the CPL floats of a 16-byte weight word times x[0..CPL), summed in element order from 0
template <typename WT>
__device__ __forceinline__ float sc2_dot(const uint4& w, const float* x) {
  const uint32_t w4[4] = {w.x, w.y, w.z, w.w};
  float a = 0.f;
#pragma unroll
  for (int e = 0; e < 16 / (int)sizeof(WT); ++e) a = fmaf(welem<WT>(w4, e), x[e], a);
  return a;
}

// x[0..M) from 16-byte aligned shared memory
template <int M>
__device__ __forceinline__ void sc2_lds(const float* q, float (&x)[M]) {
#pragma unroll
  for (int i = 0; i < M; i += 4) {
    const float4 a = *reinterpret_cast<const float4*>(q + i);
    x[i] = a.x; x[i + 1] = a.y; x[i + 2] = a.z; x[i + 3] = a.w;
  }
}

// A thread's channel (d0 + lane) parameters of one layer and its rows' states: all N states of each row, or NS < N
// of them where a row's state update is spread over several warps (sc2_state_spread).
template <typename WT, int N, int RW, int NS = N>
struct Sc2Chan {
  float cw[4], cb, dtb, Dp, Al[NS];  // Al: A_log as loaded, -exp(A_log) from the x_proj exchange on
  WT wdt[16];
  float cs[RW][3], ss[RW][NS];
};

// The cluster's two exchanges per layer are pushes: each block sends its partial sums into every block's shared memory
// with st.async, which completes bytes on the receiving block's mbarrier (PTX ISA 8.1, sm_90), and each block
// waits on its own mbarrier. No cluster barrier per exchange, so no release fence waits for the block's global
// state stores or weight loads still in flight, and no block waits for the slowest block of the cluster to arrive
// anywhere but where it needs that block's sums.
__device__ __forceinline__ uint32_t sc2_saddr(const void* q) { return (uint32_t)__cvta_generic_to_shared(q); }
__device__ __forceinline__ uint32_t sc2_mapa(uint32_t a, int rank) {
  uint32_t o;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(o) : "r"(a), "r"(rank));
  return o;
}
__device__ __forceinline__ void sc2_push(uint32_t dst, float v, uint32_t bar) {
  asm volatile("st.async.weak.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
               :: "r"(dst), "r"(__float_as_uint(v)), "r"(bar) : "memory");
}
// v into the same shared-memory slot of all 8 blocks of the cluster, each completing 4 bytes on its mbarrier
__device__ __forceinline__ void sc2_push_all(uint32_t slot, float v, uint32_t bar) {
#pragma unroll
  for (int k = 0; k < SC2_CL; ++k) sc2_push(sc2_mapa(slot, k), v, sc2_mapa(bar, k));
}
__device__ __forceinline__ void sc2_bar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
}
// one arrival (the barrier's only one per phase) that also expects `bytes` of st.async data in this phase
__device__ __forceinline__ void sc2_bar_arm(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
// The wait acquires at CTA scope, as CUTLASS's cluster transaction barriers do for the TMA multicast writes that
// other blocks make into a block's shared memory: the exchanged data lives in this block's shared memory (no cache
// to make coherent), and no block reads global memory that another block of the launch wrote. A cluster-scope
// acquire compiles to an L1 invalidation (CCTL.IVALL) that first waits for every global load the block has in
// flight, the next layer's weight prefetches among them: ~7 % of the stall samples at 32 rows a cluster (ncu,
// benchmarks/NOTES.md, twenty-seventh session).
__device__ __forceinline__ void sc2_bar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred P1;\n\tSC2_WAIT:\n\t"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 P1, [%0], %1;\n\t"
      "@P1 bra SC2_DONE;\n\tbra SC2_WAIT;\n\tSC2_DONE:\n\t}" :: "r"(bar), "r"(parity) : "memory");
}

// The per-channel phases shared by the cluster kernels (cluster2 and cluster3): the thread owns channel dch = d0 + lane
// of its block and the rows warp + W i (i < RW) of the cluster's R; xcs / zs / ys rows are `S` floats apart. Spread
// (NS < N, R < W, RW = 1): warp w owns states [(w / R) NS, (w / R) NS + NS) of row w % R instead, so the W / R warps
// of a row share its state update; the conv stays with warp r < R.

// M floats of `src` into dst, or zeros where `zero` (16-byte loads where M allows: src then 16-byte aligned)
template <int M>
__device__ __forceinline__ void sc2_ld(float (&dst)[M], const float* src, bool zero) {
  if constexpr (M % 4 == 0) {
#pragma unroll
    for (int n = 0; n < M; n += 4) {
      const float4 v = zero ? make_float4(0.f, 0.f, 0.f, 0.f) : *reinterpret_cast<const float4*>(src + n);
      dst[n] = v.x; dst[n + 1] = v.y; dst[n + 2] = v.z; dst[n + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int n = 0; n < M; ++n) dst[n] = zero ? 0.f : src[n];
  }
}
template <int M>
__device__ __forceinline__ void sc2_st(float* dst, const float (&src)[M]) {
  if constexpr (M % 4 == 0) {
#pragma unroll
    for (int n = 0; n < M; n += 4)
      *reinterpret_cast<float4*>(dst + n) = make_float4(src[n], src[n + 1], src[n + 2], src[n + 3]);
  } else {
#pragma unroll
    for (int n = 0; n < M; ++n) dst[n] = src[n];
  }
}

// channel dch's parameters of layer l and its rows' conv and SSM states as stored (sc2_zero_started zeroes a
// row's where it starts an episode, at the conv step: a zero chosen here would make the warp wait for the episode
// flags' load before issuing these, one memory round trip more in the prologue)
template <typename WT, int N, int RW, int W, int R, int NS = N>
__device__ __forceinline__ void sc2_load_chan(const StepParams& p, int l, int b0, int warp, int dch,
                                              const bool (&rowact)[RW], Sc2Chan<WT, N, RW, NS>& ch) {
  constexpr bool spread = NS < N;
  if (!spread && warp >= R) return;  // no rows in the per-channel phases
  const StepLayer& ly = p.layer[l];
  const int rk = p.rank, B = p.B, D = p.D, n0 = spread ? warp / R * NS : 0;
  const float4 c4 = __ldg(reinterpret_cast<const float4*>(ly.conv_w) + dch);
  ch.cw[0] = c4.x; ch.cw[1] = c4.y; ch.cw[2] = c4.z; ch.cw[3] = c4.w;
  ch.cb = __ldg(ly.conv_b + dch); ch.dtb = __ldg(ly.dt_b + dch); ch.Dp = __ldg(ly.Dp + dch);
  sc2_ld<NS>(ch.Al, ly.A_log + (int64_t)dch * N + n0, false);
  const WT* wd = reinterpret_cast<const WT*>(ly.dt_w) + (int64_t)dch * rk;
#pragma unroll
  for (int k = 0; k < 16; ++k) ch.wdt[k] = k < rk ? wd[k] : from_f<WT>(0.f);
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    if (!rowact[i]) continue;
    const int r = spread ? warp % R : warp + W * i;
    const int64_t row = (int64_t)l * B + b0 + r;
    if (r == warp + W * i) {  // the conv's owner
      const float* cs = p.conv_state + (row * D + dch) * 3;
#pragma unroll
      for (int k = 0; k < 3; ++k) ch.cs[i][k] = cs[k];
    }
    sc2_ld<NS>(ch.ss[i], p.ssm_state + (row * D + dch) * N + n0, false);
  }
}

// the conv and SSM states of the rows that start an episode set to zero (before the layer's conv step)
template <typename WT, int N, int RW, int NS>
__device__ __forceinline__ void sc2_zero_started(const bool (&rowst)[RW], Sc2Chan<WT, N, RW, NS>& ch) {
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    if (!rowst[i]) continue;
#pragma unroll
    for (int k = 0; k < 3; ++k) ch.cs[i][k] = 0.f;
#pragma unroll
    for (int n = 0; n < NS; ++n) ch.ss[i][n] = 0.f;
  }
}

// conv step of layer l: xcs goes from in_proj's xi to the conv output (zero on inactive rows, as zs), the conv
// state shifts in global memory
template <typename WT, int N, int RW, int W, int R, int S, int NS = N>
__device__ __forceinline__ void sc2_conv_rows(const StepParams& p, int l, int b0, int warp, int lane, int dch,
                                              const bool (&rowact)[RW], Sc2Chan<WT, N, RW, NS>& ch, float* xcs,
                                              float* zs) {
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    const int r = warp + W * i;
    if (r >= R) continue;
    float xc = 0.f, zv = 0.f;
    if (rowact[i]) {
      const float xi = xcs[r * S + lane];
      zv = zs[r * S + lane];
      float pre = ch.cb;
#pragma unroll
      for (int k = 0; k < 3; ++k) pre = fmaf(ch.cw[k], ch.cs[i][k], pre);
      pre = fmaf(ch.cw[3], xi, pre);
      float* cs = p.conv_state + (((int64_t)l * p.B + b0 + r) * p.D + dch) * 3;
      cs[0] = ch.cs[i][1]; cs[1] = ch.cs[i][2]; cs[2] = xi;
      xc = siluf_(pre);
    }
    xcs[r * S + lane] = xc;
    zs[r * S + lane] = zv;
  }
}

// delta = softplus(dt_proj(x_proj's dt part dr_in[0..rk)) + dt bias) of the thread's channel, in k order
template <typename Chan>
__device__ __forceinline__ float sc2_delta(const Chan& ch, const float* dr_in, int rk) {
  float dr = ch.dtb;
#pragma unroll
  for (int k = 0; k < 16; ++k)
    if (k < rk) dr = fmaf(to_f(ch.wdt[k]), dr_in[k], dr);
  return softplusf_(dr);
}

// dt_proj + softplus + state update + D skip + gate of layer l from the cluster's x_proj sums dbc (rows NXP apart):
// ys = y * silu(z); the SSM state written back. ch.Al holds -exp(A_log) by now.
template <typename WT, int N, int RW, int W, int R, int S, int NXP>
__device__ __forceinline__ void sc2_state_rows(const StepParams& p, int l, int b0, int warp, int lane, int dch,
                                               const bool (&rowact)[RW], Sc2Chan<WT, N, RW>& ch, const float* xcs,
                                               const float* zs, const float* dbc, float* ys) {
  const int rk = p.rank;
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    const int r = warp + W * i;
    if (r >= R) continue;
    float yv = 0.f;
    if (rowact[i]) {
      const float* dr_in = dbc + r * NXP;
      const float delta = sc2_delta(ch, dr_in, rk);
      const float xc = xcs[r * S + lane];
      const float* Bv = dr_in + rk;
      const float* Cv = Bv + N;
      const float dx = delta * xc;
      float acc = 0.f;
#pragma unroll
      for (int n = 0; n < N; ++n) {
        ch.ss[i][n] = fmaf(expf(ch.Al[n] * delta), ch.ss[i][n], dx * Bv[n]);
        acc = fmaf(ch.ss[i][n], Cv[n], acc);
      }
      sc2_st<N>(p.ssm_state + (((int64_t)l * p.B + b0 + r) * p.D + dch) * N, ch.ss[i]);
      yv = fmaf(ch.Dp, xc, acc) * siluf_(zs[r * S + lane]);
    }
    ys[r * S + lane] = yv;
  }
}

// The state update spread over the W / R warps of each row (R < W): dt_proj + softplus (each warp of the row the
// same), then this warp's NS states; its part of y (the sum over its states of C h) into ypart [W][32]. The SSM
// state written back. sc2_state_finish adds the parts (after a block barrier).
template <typename WT, int N, int NS, int W, int R, int S, int NXP>
__device__ __forceinline__ void sc2_state_spread(const StepParams& p, int l, int b0, int warp, int lane, int dch,
                                                 bool act, Sc2Chan<WT, N, 1, NS>& ch, const float* xcs,
                                                 const float* dbc, float* ypart) {
  const int r = warp % R, n0 = warp / R * NS, rk = p.rank;
  float acc = 0.f;
  if (act) {
    const float* dr_in = dbc + r * NXP;
    const float delta = sc2_delta(ch, dr_in, rk);
    const float* Bv = dr_in + rk + n0;
    const float* Cv = dr_in + rk + N + n0;
    const float dx = delta * xcs[r * S + lane];
#pragma unroll
    for (int n = 0; n < NS; ++n) {
      ch.ss[0][n] = fmaf(expf(ch.Al[n] * delta), ch.ss[0][n], dx * Bv[n]);
      acc = fmaf(ch.ss[0][n], Cv[n], acc);
    }
    sc2_st<NS>(p.ssm_state + (((int64_t)l * p.B + b0 + r) * p.D + dch) * N + n0, ch.ss[0]);
  }
  ypart[warp * 32 + lane] = acc;
}

// The gate silu(z) and the input x of row `warp` (< R) for sc2_state_finish, read and formed before the block
// barrier that precedes it (off the phase's critical path; the same operations as before)
struct Sc2Gate {
  float xc, gz;
};
template <int R, int S>
__device__ __forceinline__ Sc2Gate sc2_state_gate(int warp, int lane, bool act, const float* xcs, const float* zs) {
  Sc2Gate g{0.f, 0.f};
  if (warp < R && act) {
    g.xc = xcs[warp * S + lane];
    g.gz = siluf_(zs[warp * S + lane]);
  }
  return g;
}

// y of row `warp` (< R): its W / R parts in warp order, then the D skip and gate: ys = (y + D x) * silu(z)
template <int W, int R, int S>
__device__ __forceinline__ void sc2_state_finish(int warp, int lane, bool act, float Dp, Sc2Gate g,
                                                 const float* ypart, float* ys) {
  if (warp >= R) return;
  float yv = 0.f;
  if (act) {
    float y = 0.f;
#pragma unroll
    for (int j = 0; j < W / R; ++j) y += ypart[(warp + R * j) * 32 + lane];
    yv = fmaf(Dp, g.xc, y) * g.gz;
  }
  ys[warp * S + lane] = yv;
}

// u = RMSNorm(h) * nw for the rows warp + W i (a warp per row, columns lane + 32 q); after the last layer (`last`)
// the block of rank q writes its 16 columns of the output instead
template <int RW, int W, int R>
__device__ __forceinline__ void sc2_norm_rows(const StepParams& p, const float* h, float* u, const float (&nw)[4],
                                              int b0, int warp, int lane, int rank, bool last) {
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    const int r = warp + W * i;
    if (r >= R) continue;
    float hv[4], ssq = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) { hv[q] = h[r * SC2_DM + lane + 32 * q]; ssq = fmaf(hv[q], hv[q], ssq); }
    ssq = group_sum<32>(ssq);
    const float rs = rsqrtf(ssq / SC2_DM + p.eps);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int j = lane + 32 * q;
      const float v = hv[q] * rs * nw[q];
      if (!last) {
        u[r * SC2_DM + j] = v;
      } else if (j / (SC2_DM / SC2_CL) == rank && b0 + r < p.B) {  // block q writes its 16 columns
        p.out[(int64_t)(b0 + r) * SC2_DM + j] = v;
      }
    }
  }
}

#ifdef MRL_SC2_PROBE
// timing probe (benchmarks only): lane 0 of every warp stamps clock64() at each phase end into shared memory,
// copied to sc2_probe_buf[block][warp][64] at exit
__device__ long long* sc2_probe_buf;
#define SC2_STAMP(k) \
  do { if (lane == 0) stp[warp * 64 + (k)] = clock64(); } while (0)
// the global nanosecond timer (comparable across SMs: where the blocks start and end, the waves)
#define SC2_GSTAMP(k)                                                              \
  do {                                                                             \
    if (lane == 0) {                                                               \
      unsigned long long g_;                                                       \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g_));                      \
      stp[warp * 64 + (k)] = (long long)g_;                                        \
    }                                                                              \
  } while (0)
// at the kernel's end: the last stamps, and the block's stamps copied out
#define SC2_PROBE_END()                                                                                       \
  do {                                                                                                        \
    SC2_STAMP(63);                                                                                            \
    SC2_GSTAMP(62);                                                                                           \
    __syncthreads();                                                                                          \
    for (int i = tid; i < W * 64; i += SC2_THREADS) sc2_probe_buf[(int64_t)blockIdx.x * W * 64 + i] = stp[i]; \
  } while (0)
#else
#define SC2_STAMP(k) do {} while (0)
#define SC2_GSTAMP(k) do {} while (0)
#define SC2_PROBE_END() do {} while (0)
#endif

template <typename WT, int R, int N>
__global__ void __cluster_dims__(SC2_CL, 1, 1) __launch_bounds__(SC2_THREADS, 1)
backbone_step_cluster2_kernel(StepParams p) {
  namespace cg = cooperative_groups;
  using PW = Sc2Proj<WT>;
  constexpr int DM = SC2_DM, DS = SC2_DS, NXP = SC2_NXP, W = SC2_W, CPL = PW::CPL;
  constexpr int LI = PW::LI, RI = PW::RI, NI = PW::NI, LO = PW::LO, RO = PW::RO, NX = PW::NX, NO = PW::NO;
  constexpr int RW = (R + W - 1) / W;  // rows per thread in the per-channel phases (rows warp, warp + 8, ...)
  constexpr int G = R < W ? W / R : 1;  // warps sharing a row's state update (sc2_state_spread where > 1)
  constexpr int NS = N / G;             // states a thread updates
  const int rank = (int)cg::this_cluster().block_rank();
  const int b0 = (int)(blockIdx.x / SC2_CL) * R;
  const int D = p.D, rk = p.rank, L = p.L, B = p.B;
  const int nx = rk + 2 * N;
  const int d0 = rank * DS;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int dch = d0 + lane;  // this thread's channel in the per-channel phases
  extern __shared__ float4 sm4[];
  float* h = reinterpret_cast<float*>(sm4);  // [R][DM] residual stream (the same in every block)
  float* u = h + R * DM;                     // [R][DM] the layer's normalised input
  float* xcs = u + R * DM;                   // [R][DS] in_proj's xi, then the conv output
  float* zs = xcs + R * DS;                  // [R][DS] gate input z
  float* ys = zs + R * DS;                   // [R][DS] gated SSM output
  float* dbc = ys + R * DS;                  // [R][NXP] x_proj outputs (summed over the cluster)
  float* gx = dbc + R * NXP;                 // [CL][R][NXP] every block's x_proj sums, pushed here
  float* go = gx + SC2_CL * R * NXP;         // [CL][R][DM] every block's out_proj sums, pushed here
  float* ypart = go + SC2_CL * R * DM;       // [W][32] the spread state update's parts of y
  uint64_t* bars = reinterpret_cast<uint64_t*>(ypart + W * 32);  // the x and out exchanges' mbarriers
#ifdef MRL_SC2_PROBE
  long long* stp = reinterpret_cast<long long*>(bars + 2);  // [W][64]
  float* xin = reinterpret_cast<float*>(stp + W * 64);
  SC2_STAMP(0);
  SC2_GSTAMP(61);
#else
  float* xin = reinterpret_cast<float*>(bars + 2);  // [R][in_dim]
#endif
  const uint32_t bar_x = sc2_saddr(bars), bar_o = sc2_saddr(bars + 1);
  const uint32_t bytes_x = SC2_CL * R * nx * 4, bytes_o = SC2_CL * R * DM * 4;
  // the mbarriers, armed for layer 0's exchanges and visible to the cluster before any block pushes
  if (tid == 0) {
    sc2_bar_init(bar_x);
    sc2_bar_init(bar_o);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    sc2_bar_arm(bar_x, bytes_x);
    sc2_bar_arm(bar_o, bytes_o);
  }
  // relaxed: fence.mbarrier_init orders the inits (as CUTLASS's fence_barrier_init + cluster_arrive_relaxed); a
  // release arrive adds a GPU-scope MEMBAR at the kernel's start
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");  // waited on before the first push

  bool rowact[RW], rowst[RW];
#pragma unroll
  for (int i = 0; i < RW; ++i) {  // spread: every warp's row is warp % R
    const int r = G > 1 ? warp % R : warp + W * i, b = b0 + r;
    rowact[i] = r < R && b < B;
    rowst[i] = rowact[i] && p.starts ? p.starts[b] : false;
  }

  // what each lane of a projection reads and where its group's sum lands
  const int ci = CPL * (lane % LI), co = CPL * (lane % LO);  // first column read (in_proj; x_proj / out_proj)
  const int si = (lane % LI) / (LI / NI) * RI + lane / LI;   // in_proj slot whose sum this lane ends with
  const int sx = (lane % LO) / (LO / NX) * RO + lane / LO;   // x_proj j (output 8 warp + j)
  const int so = (lane % LO) / (LO / NO) * RO + lane / LO;   // out_proj output 16 warp + so
  const bool wi_lane = lane % (LI / NI) == 0, wx_lane = lane % (LO / NX) == 0, wo_lane = lane % (LO / NO) == 0;

  PW pw;
  Sc2Chan<WT, N, RW, NS> ch;
  auto load_in = [&](int l) {
    const WT* w = reinterpret_cast<const WT*>(p.layer[l].in_w);
#pragma unroll
    for (int k = 0; k < NI; ++k) {
      const int slot = k * RI + lane / LI;
      const int row = (slot < 4 ? d0 : D + d0 - 4) + 4 * warp + slot;
      pw.wi[k] = __ldg(reinterpret_cast<const uint4*>(w + (int64_t)row * DM + ci));
    }
  };
  auto load_xp = [&](int l) {
    const WT* w = reinterpret_cast<const WT*>(p.layer[l].x_w);
#pragma unroll
    for (int k = 0; k < NX; ++k) {
      const int o = 8 * warp + k * RO + lane / LO;
      pw.wx[k] = o < nx ? __ldg(reinterpret_cast<const uint4*>(w + (int64_t)o * D + d0 + co)) : make_uint4(0, 0, 0, 0);
    }
  };
  auto load_out = [&](int l) {
    const WT* w = reinterpret_cast<const WT*>(p.layer[l].out_w);
#pragma unroll
    for (int k = 0; k < NO; ++k) {
      const int o = 16 * warp + k * RO + lane / LO;
      pw.wo[k] = __ldg(reinterpret_cast<const uint4*>(w + (int64_t)o * D + d0 + co));
    }
  };
  auto load_norm = [&](int l) {  // the RMSNorm weight applied after layer l-1 (norm_f after the last)
    const float* nw = l < L ? p.layer[l].norm_w : p.normf_w;
#pragma unroll
    for (int i = 0; i < 4; ++i) pw.nw[i] = __ldg(nw + lane + 32 * i);
  };
  auto load_chan = [&](int l) { sc2_load_chan<WT, N, RW, W, R, NS>(p, l, b0, warp, dch, rowact, ch); };
  // every block the whole input projection (each needs whole rows), with every weight of layer 0 in flight
  // behind its first loads
  input_proj_rows<WT, R, SC2_THREADS>(p, b0, B, DM, xin, h, [&] {
    load_in(0); load_chan(0); load_xp(0); load_out(0); load_norm(0);
    SC2_STAMP(56);
  });
  SC2_STAMP(57);
  // u = RMSNorm(h) for layer 0: warp per row
  auto norm_rows = [&](bool last) { sc2_norm_rows<RW, W, R>(p, h, u, pw.nw, b0, warp, lane, rank, last); };
  norm_rows(false);
  load_norm(1);
  SC2_STAMP(58);
  __syncthreads();
  SC2_STAMP(59);
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
  SC2_STAMP(1);

  for (int l = 0; l < L; ++l) {
    // ---- in_proj: this warp's 4 xi and 4 z channels, each row summed over its LI lanes
#pragma unroll 4
    for (int r = 0; r < R; ++r) {
      float uv[CPL], a[NI];
      sc2_lds(u + r * DM + ci, uv);
#pragma unroll
      for (int k = 0; k < NI; ++k) a[k] = sc2_dot<WT>(pw.wi[k], uv);
      const float v = sc2_group_sums<NI, LI>(a, lane);
      if (wi_lane) (si < 4 ? xcs : zs)[r * DS + 4 * warp + (si & 3)] = v;
    }
    SC2_STAMP(2 + 18 * l);
    __syncthreads();
    SC2_STAMP(3 + 18 * l);
    // ---- conv step (the thread's channel, rows warp + 8i); xcs goes from xi to the conv output
    sc2_zero_started(rowst, ch);
    sc2_conv_rows<WT, N, RW, W, R, DS, NS>(p, l, b0, warp, lane, dch, rowact, ch, xcs, zs);
    SC2_STAMP(4 + 18 * l);
    __syncthreads();
    SC2_STAMP(5 + 18 * l);
    // ---- x_proj over the block's 32 channels (outputs 8 warp + j), pushed into slot `rank` of every block's gx
#pragma unroll 4
    for (int r = 0; r < R; ++r) {
      float xv[CPL], a[NX];
      sc2_lds(xcs + r * DS + co, xv);
#pragma unroll
      for (int k = 0; k < NX; ++k) a[k] = sc2_dot<WT>(pw.wx[k], xv);
      const float v = sc2_group_sums<NX, LO>(a, lane);
      const int o = 8 * warp + sx;
      if (wx_lane && o < nx) sc2_push_all(sc2_saddr(gx + (rank * R + r) * NXP + o), v, bar_x);
    }
    if (l + 1 < L) load_xp(l + 1);
    if (l + 1 < L) load_in(l + 1);  // after the x_proj pushes: not queued ahead of them
    SC2_STAMP(6 + 18 * l);
    SC2_STAMP(7 + 18 * l);
    SC2_STAMP(8 + 18 * l);
    // while the cluster's sums are in flight: the state-update rates -exp(A_log) of this thread's channel
    if (G > 1 || warp < R) {
#pragma unroll
      for (int n = 0; n < NS; ++n) ch.Al[n] = -expf(ch.Al[n]);
    }
    sc2_bar_wait(bar_x, l & 1);
    SC2_STAMP(9 + 18 * l);
    if (tid == 0 && l + 1 < L) sc2_bar_arm(bar_x, bytes_x);  // the next layer's phase
    for (int t = tid; t < R * nx; t += SC2_THREADS) {
      const int r = t / nx, o = t - r * nx;
      float a = 0.f;
#pragma unroll
      for (int q = 0; q < SC2_CL; ++q) a += gx[(q * R + r) * NXP + o];
      dbc[r * NXP + o] = a;
    }
    SC2_STAMP(10 + 18 * l);
    __syncthreads();
    SC2_STAMP(11 + 18 * l);
    // ---- dt_proj + softplus + state update + D skip + gate (the thread's channel and rows)
    if constexpr (G > 1) {
      const Sc2Gate gate = sc2_state_gate<R, DS>(warp, lane, rowact[0], xcs, zs);
      sc2_state_spread<WT, N, NS, W, R, DS, NXP>(p, l, b0, warp, lane, dch, rowact[0], ch, xcs, dbc, ypart);
      __syncthreads();
      sc2_state_finish<W, R, DS>(warp, lane, rowact[0], ch.Dp, gate, ypart, ys);
    } else {
      sc2_state_rows<WT, N, RW, W, R, DS, NXP>(p, l, b0, warp, lane, dch, rowact, ch, xcs, zs, dbc, ys);
    }
    if (l + 1 < L) load_chan(l + 1);
    SC2_STAMP(12 + 18 * l);
    __syncthreads();
    SC2_STAMP(13 + 18 * l);
    // ---- out_proj over the block's 32 channels (outputs 16 warp + [0, 16)), pushed into every block's go
#pragma unroll 4
    for (int r = 0; r < R; ++r) {
      float yv[CPL], a[NO];
      sc2_lds(ys + r * DS + co, yv);
#pragma unroll
      for (int k = 0; k < NO; ++k) a[k] = sc2_dot<WT>(pw.wo[k], yv);
      const float v = sc2_group_sums<NO, LO>(a, lane);
      if (wo_lane) sc2_push_all(sc2_saddr(go + (rank * R + r) * DM + 16 * warp + so), v, bar_o);
    }
    if (l + 1 < L) load_out(l + 1);
    SC2_STAMP(14 + 18 * l);
    SC2_STAMP(15 + 18 * l);
    SC2_STAMP(16 + 18 * l);
    if (warp < R || tid == 0) sc2_bar_wait(bar_o, l & 1);  // the rows' owners, and the thread that re-arms
    if (tid == 0 && l + 1 < L) sc2_bar_arm(bar_o, bytes_o);
    SC2_STAMP(17 + 18 * l);
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
        for (int k = 0; k < SC2_CL; ++k) a += go[k * R * DM + t];
        h[t] += a;
      }
    }
    __syncwarp();
    norm_rows(l + 1 == L);
    if (l + 2 <= L) load_norm(l + 2);
    SC2_STAMP(18 + 18 * l);
    __syncthreads();
    SC2_STAMP(19 + 18 * l);
  }
  // no cluster barrier before exit: no block reads another's shared memory, and every push into this block's
  // shared memory has landed (the rows' owners waited for the last one)
  SC2_PROBE_END();
}

// bytes of a cluster kernel's dynamic shared memory of `floats` floats, plus the probe build's phase stamps
inline size_t sc2_smem_bytes_of(size_t floats) {
#ifdef MRL_SC2_PROBE
  floats += 2 * SC2_W * 64;
#endif
  return sizeof(float) * floats;
}

inline size_t stepc2_smem_bytes(const StepParams& p, int R) {
  // h, u, xcs / zs / ys, dbc, gx, go, ypart, the two mbarriers (4 floats), xin
  return sc2_smem_bytes_of((size_t)R * (2 * SC2_DM + 3 * SC2_DS + SC2_NXP + SC2_CL * (SC2_NXP + SC2_DM) +
                                        p.in_dim) + SC2_W * 32 + 4);
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

// Launch `kern` (a cluster kernel of 8-block clusters, one per R rows) over B rows with `smem` bytes of dynamic
// shared memory. The device's opt-in shared memory and the size the kernel was opened to are kept per device in
// the caller's (per-kernel) arrays: asked once, not on every token (the launch is on the acting path).
template <typename K>
const char* sc2_launch(K kern, const StepParams& p, int R, size_t smem, int (&optin)[64], size_t (&opened)[64],
                       const char* name, cudaStream_t s) {
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
  if (smem > (size_t)optin[dev]) return name;
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

template <typename WT, int R, int N>
const char* stepc2_launch_rn(const StepParams& p, cudaStream_t s) {
  static int optin[64] = {0};
  static size_t opened[64] = {0};
  return sc2_launch(backbone_step_cluster2_kernel<WT, R, N>, p, R, stepc2_smem_bytes(p, R), optin, opened,
                    "backbone_step: cluster2 needs more shared memory per block than the device allows (fewer rows "
                    "per cluster or a smaller input_dim)", s);
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
