// Selective scan backward: see scan_common.cuh for the layout and the two-level split over T.
#pragma once
#include <algorithm>
#include <type_traits>
#include "scan_common.cuh"

namespace mrl {

// The backward's gate terms, free of branches so that the compiler interleaves a thread's staged elements (ncu at
// 64 x 1024, thirty-third session: the pair build's staging was ~14 % of its instructions and ~24 % of its stall
// samples, each element's softplus, its derivative and SiLU's sigmoid a chain of branch regions around two IEEE
// divisions). softplus keeps softplusf_'s bits (the same expf and log1pf: the chunk's recompute uses the forward's
// dl); the sigmoids divide with __fdividef (sigmoid_fast_, scan_common.cuh), which changes only the gradients' last
// bits.
// dl = softplus(dr) (torch's threshold 20) and sig = d softplus / d dr = sigmoid(dr), from one exponential.
__device__ __forceinline__ void softplus_and_grad_(float dr, float& dl, float& sig) {
  const float e = expf(dr > 20.f ? 20.f : dr);  // min(dr, 20) that keeps a NaN a NaN (fminf would return 20)
  dl = dr > 20.f ? dr : log1pf(e);
  sig = dr > 20.f ? 1.f : __fdividef(e, 1.f + e);
}

// The pair build's transpose-reduce of its 16 values (v[2j] = dB, v[2j + 1] = dC of its slot j) over the 16 lanes
// of a warp that share lane % 2, without selects in the first three levels: every lane keeps its lower half and
// sends its upper half, which is right because each lane holds its states in its own order (slot j = state
// j ^ pair_perm(lane), pair_perm below), so that the half a lane sends is the half its partner keeps. The last level
// (dB or dC) selects as transpose_reduce does. Each lane ends with the sum of state pair_perm(lane) of its half,
// dB where lane bit 1 is 0, else dC. Every sum adds the same lanes' values in the same tree (lane bit 4, then 3, 2,
// 1) as transpose_reduce, so the same bits; only which lane ends with which sum differs. (A templated form of
// transpose_reduce ran here before: ptxas left the loop form rolled in the pair build's cooperative kernel.)
__device__ __forceinline__ int pair_perm(int lane) { return (lane >> 2) & 7; }
__device__ __forceinline__ float pair_transpose_reduce(float (&w)[16], int lane) {
#pragma unroll
  for (int k = 0; k < 8; ++k) w[k] += __shfl_xor_sync(0xffffffffu, w[k + 8], 16);
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] += __shfl_xor_sync(0xffffffffu, w[k + 4], 8);
#pragma unroll
  for (int k = 0; k < 2; ++k) w[k] += __shfl_xor_sync(0xffffffffu, w[k + 2], 4);
  const bool hb = (lane & 2) != 0;
  const float send = hb ? w[0] : w[1];
  const float keep = hb ? w[1] : w[0];
  return keep + __shfl_xor_sync(0xffffffffu, send, 2);
}

// v[j] <- v[j ^ m] for a runtime m < NP (NP a power of two), by selects (no indexing of registers by a runtime value).
template <int NP>
__device__ __forceinline__ void xor_permute(float (&v)[NP], int m) {
#pragma unroll
  for (int bit = 1; bit < NP; bit <<= 1) {
    const bool f = (m & bit) != 0;
    float w[NP];
#pragma unroll
    for (int j = 0; j < NP; ++j) w[j] = f ? v[j ^ bit] : v[j];
#pragma unroll
    for (int j = 0; j < NP; ++j) v[j] = w[j];
  }
}

// Workspace layout (floats): pBC [ntiles][B][T][2N] | seg_e [B][nseg][D][N] | seg_P [B][nseg][D][N]
// | pPar [B * nseg][D*N + 2*D] (dA_log | dD | ddt_bias partials of each row and segment).
template <int N>
struct ScanBwdLayout {
  float* pBC; float* seg_e; float* seg_P; float* pPar;
  __host__ __device__ ScanBwdLayout(float* ws, int ntiles, int B, int T, int D, int nseg) {
    pBC = ws;
    seg_e = ws + (int64_t)ntiles * B * T * 2 * N;
    seg_P = seg_e + (int64_t)B * nseg * D * N;
    pPar = seg_P + (int64_t)B * nseg * D * N;
  }
};

// Shared memory of the backward's local pass (static in its own kernel; carved from the main pass's dynamic
// buffer in the cooperative kernel, where the two passes are separated by a grid barrier).
template <int N, int NP = SCAN_NPT>
struct ScanBwdLocalSmem {
  static constexpr int CPB = ScanGeom<N, NP>::CPB, TC = SCAN_TC;
  float dl[TC][CPB], gs[TC][CPB];
  __align__(16) float C[TC][N];
  __align__(16) bool st[TC];  // read as words by chunk_has_start
};

// Local pass of the backward: segment k (1 <= k < nseg) runs the adjoint recurrence in
// reverse from a zero adjoint (the last segment from grad_final_state) and stores the adjoint leaving its
// first step (d loss / d state entering the segment, from inside it) and its decay product. NP states a thread
// (the pair build's local pass takes 8, in its own geometry; the results' layout is the same). NB: softplus without
// a branch (softplus_nb_, the same bits) in the separate local kernel; the cooperative kernels keep the branch (with
// softplus_nb_ their main pass's registers spilled 8-24 bytes, sm_90, CUDA 13.0).
template <typename T, int N, int NP = SCAN_NPT, bool NB = false>
__device__ __forceinline__ void scan_bwd_local_body(const ScanBwdParams& q, const int k, ScanBwdLocalSmem<N, NP>& ls) {
  using Gm = ScanGeom<N, NP>;
  constexpr int G = Gm::G, CPB = Gm::CPB, EA = Gm::EA, EB = Gm::EB, TC = SCAN_TC, H = NP / SCAN_NPT;
  auto& sdl = ls.dl;
  auto& sgs = ls.gs;
  auto& sC = ls.C;
  auto& sst = ls.st;
  const ScanFwdParams& p = q.f;
  const int tid = threadIdx.x, gi = tid % G, cl = tid / G;
  const int d0 = blockIdx.x * CPB, b = blockIdx.y;
  const int T_ = p.T, D = p.D, nz = p.nseg;
  const bool act = d0 + cl < D;
  const int d = act ? d0 + cl : D - 1;
  const ScanSeg sg(T_, p.seg_len, k);
  const int64_t bd = (int64_t)b * D + d;
  float A2[NP], hc[NP], P[NP];
#pragma unroll
  for (int j = 0; j < NP; ++j) {
    A2[j] = -expf(p.A_log[d * N + gi * NP + j]) * 1.4426950408889634f;
    hc[j] = (k == nz - 1 && q.dfinal) ? q.dfinal[bd * N + gi * NP + j] : 0.f;
    P[j] = 1.f;
  }
  ScanChunkRegs<T, N, SL_Z | SL_G | SL_C, NP> r;
  auto commit = [&](int t0) {
    const float dtb = scan_dt_bias<CPB>(p, d0, tid);
#pragma unroll
    for (int e_ = 0; e_ < EA; ++e_) {
      const int e = tid + e_ * SCAN_THREADS, i = e / CPB, ch = e % CPB;
      const bool ok = t0 + i < T_;
      const float zf = pad_f(r.z[e_], ok);
      const float dr = to_f(r.dt[e_]) + dtb;
      sdl[i][ch] = ok ? (NB ? softplus_nb_(dr) : softplusf_(dr)) : 0.f;
      sgs[i][ch] = ok ? to_f(r.g[e_]) * (zf * sigmoid_fast_(zf)) : 0.f;
    }
#pragma unroll
    for (int e_ = 0; e_ < EB; ++e_) {
      const int e = tid + e_ * SCAN_THREADS;
      sC[e / N][e % N] = pad_f(r.Cv[e_], t0 + e / N < T_);
    }
    if (tid < TC) sst[tid] = r.st;
  };
  r.load(p, q.dout, q.g_sb, q.g_st, b, d0, sg.ce - 1, tid);
  for (int c = sg.ce - 1; c >= sg.cb; --c) {
    commit(c * TC);
    __syncthreads();
    if (c > sg.cb) r.load(p, q.dout, q.g_sb, q.g_st, b, d0, c - 1, tid);
    auto steps = [&](auto has_start) {  // the chunk's reverse steps (chunk_has_start: the same bits either way)
#pragma unroll 4
      for (int i = TC - 1; i >= 0; --i) {
        const float dl = sdl[i][cl], gs = sgs[i][cl];
        float cx[NP];
        ld_states<NP>(cx, &sC[i][gi * NP]);
        const bool st = decltype(has_start)::value && sst[i];
#pragma unroll
        for (int j = 0; j < NP; ++j) {
          const float a = ex2f_(dl * A2[j]);
          const float h = fmaf(gs, cx[j], hc[j]);
          hc[j] = st ? 0.f : h * a;
          P[j] = (st ? 0.f : P[j]) * a;
        }
      }
    };
    by_chunk_start(chunk_has_start(sst), steps);
    __syncthreads();
  }
  if (act) {
    const ScanBwdLayout<N> L(q.ws, q.bc_tiles, p.B, T_, D, nz);
#pragma unroll
    for (int h = 0; h < H; ++h) {  // this thread's h-th group of 4 states, as the 4-state layout counts them
      const int q4 = gi * H + h;
      seg_st(L.seg_e, b, nz, k, D, d, N, q4, make_float4(hc[4 * h], hc[4 * h + 1], hc[4 * h + 2], hc[4 * h + 3]));
      seg_st(L.seg_P, b, nz, k, D, d, N, q4, make_float4(P[4 * h], P[4 * h + 1], P[4 * h + 2], P[4 * h + 3]));
    }
  }
}

template <int N>
struct ScanBwdSmem {
  static constexpr int CPB = ScanGeom<N>::CPB, TC = SCAN_TC, NW = ScanGeom<N>::NW;
  float4 S[TC + 1][SCAN_THREADS];  // S[i + 1]: this thread's 4 states after step i; S[0]: entering the chunk
  // The reverse step i writes its outputs dx / ddt / dz over x / dl / gs at [i][channel]: every lane of the
  // channel (one warp) has read them into registers before the group sums that the writing lane waits on.
  float x[TC][CPB], dl[TC][CPB], sig[TC][CPB], gs[TC][CPB], gd[TC][CPB];
  __align__(16) float Bv[TC][N];
  __align__(16) float Cv[TC][N];
  float red[TC][NW][2 * N];
  __align__(16) bool st[TC];  // read as words by chunk_has_start
};

// Stage one chunk of the main pass in shared memory from the registers of its loads (ScanChunkRegs): x,
// softplus(dt + bias) and its derivative, the output gradient's two gate factors, B, C and the episode starts; a
// step past T is staged as padding (decay 1, no input, zero gradient). SM: ScanBwdSmem or ScanBwdPairSmem.
template <int N, int NP, typename SM, typename R>
__device__ __forceinline__ void scan_bwd_stage(SM& sm, const R& r, const ScanFwdParams& p, int t0, int tid, int d0) {
  constexpr int EA = ScanGeom<N, NP>::EA, EB = ScanGeom<N, NP>::EB, CPB = ScanGeom<N, NP>::CPB, TC = SCAN_TC;
  const int T_ = p.T;
  const float dtb = scan_dt_bias<CPB>(p, d0, tid);
#pragma unroll
  for (int e_ = 0; e_ < EA; ++e_) {
    const int e = tid + e_ * SCAN_THREADS, i = e / CPB, ch = e % CPB;
    const bool ok = t0 + i < T_;  // pad: decay 1, no input, zero gradient
    // dr is used under ok only, so to_f would give the same bits; with it ptxas spills 4 bytes in the 4-block
    // build (sm_90, CUDA 13.0); a 4-byte spill there cost +4 % in the twenty-second session (benchmarks/NOTES.md)
    const float dr = pad_f(r.dt[e_], ok) + dtb;
    const float zf = pad_f(r.z[e_], ok);
    const float sgz = sigmoid_fast_(zf);
    const float gv = pad_f(r.g[e_], ok);
    float dl, sig;
    softplus_and_grad_(dr, dl, sig);
    sm.x[i][ch] = pad_f(r.x[e_], ok);
    sm.dl[i][ch] = ok ? dl : 0.f;
    sm.sig[i][ch] = ok ? sig : 0.f;
    sm.gs[i][ch] = gv * (zf * sgz);                          // d loss / d y_pre
    sm.gd[i][ch] = gv * (sgz * (1.f + zf * (1.f - sgz)));    // d loss / d y_pre-gate * SiLU'(z)
  }
#pragma unroll
  for (int e_ = 0; e_ < EB; ++e_) {
    const int e = tid + e_ * SCAN_THREADS;
    const bool ok = t0 + e / N < T_;
    const float bv = pad_f(r.Bv[e_], ok), cv = pad_f(r.Cv[e_], ok);
    if constexpr (NP == SCAN_PAIR_NP) {  // ScanBwdPairSmem: the 4 variants
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        sm.Bv[v][e ^ v] = bv;  // e = i * N + n, N a multiple of 4: (i, n ^ v)
        sm.Cv[v][e ^ v] = cv;
      }
    } else {
      sm.Bv[e / N][e % N] = bv;
      sm.Cv[e / N][e % N] = cv;
    }
  }
  if (tid < TC) sm.st[tid] = r.st;
}

// Write one chunk's dx, ddt and dz (staged over x, dl and gs by the reverse steps) of a main-pass block.
template <typename T, int N, int NP, typename SM>
__device__ __forceinline__ void scan_bwd_store(const ScanBwdParams& q, const SM& sm, int b, int t0, int len, int d0,
                                               int tid) {
  constexpr int EA = ScanGeom<N, NP>::EA, CPB = ScanGeom<N, NP>::CPB;
  const int T_ = q.f.T, D = q.f.D;
  T* dxb = reinterpret_cast<T*>(q.dx) + (int64_t)b * T_ * D;
  T* ddtb = reinterpret_cast<T*>(q.ddt) + (int64_t)b * T_ * D;
  T* dzb = reinterpret_cast<T*>(q.dz) + b * q.dz_sb;
#pragma unroll
  for (int e_ = 0; e_ < EA; ++e_) {
    const int e = tid + e_ * SCAN_THREADS, i = e / CPB, ch = e % CPB;
    if (i < len && d0 + ch < D) {
      const int64_t o = (int64_t)(t0 + i) * D + d0 + ch;
      dxb[o] = from_f<T>(sm.x[i][ch]);
      ddtb[o] = from_f<T>(sm.dl[i][ch]);
      dzb[(int64_t)(t0 + i) * q.dz_st + d0 + ch] = from_f<T>(sm.gs[i][ch]);
    }
  }
}

// ---- The pair build: 8 states a thread at d_state 16 (G = 2 lanes a channel, 64 channels a block) ----
// The same main pass, per thread twice the states of one channel. Per state-step it needs fewer shuffles
// (the channel's three sums over 2 lanes instead of 4; the dB / dC transpose-reduce of 16 values over the
// warp's 16 channels, one sum a lane and no duplicates) and fewer shared-memory wavefronts (the per-channel
// scalars are read once for 8 states, and s_t is carried in registers from the step before: the reverse step
// reads only s_{t-1}), at half the threads: ~98 KB of shared memory a block, so 2 blocks (8 warps) an SM and
// up to 255 registers. Its local pass (nseg > 1) runs 8 states a thread too, in the same geometry (one cooperative
// launch at any split). A new summation order (the states' partial sums), so its own bits; the same bits
// in the cooperative and the separate launches.
template <int N>
struct ScanBwdPairSmem {
  using Gm = ScanGeom<N, SCAN_PAIR_NP>;
  static constexpr int CPB = Gm::CPB, TC = SCAN_TC, NW = Gm::NW, H = SCAN_PAIR_NP / 4;
  float4 S[TC][H][SCAN_THREADS];  // S[i][h]: states 4h..4h+3 of this thread entering step i (after step i - 1)
  float x[TC][CPB], dl[TC][CPB], sig[TC][CPB], gs[TC][CPB], gd[TC][CPB];  // outputs over inputs, as ScanBwdSmem
  // B and C in 4 variants: variant v holds step i's state n at [v][i * N + (n ^ v)] (an order within each group of
  // 4 states), so that a lane reads its own state order (pair_perm) with the float4 loads of the natural one.
  // Variants 1 and 3 start 16 banks after 0 and 2 (BC_PAD): the lanes of a quarter warp read variants v and v ^ 1.
  static constexpr int BC_PAD = 16, BC_LEN = TC * N + BC_PAD;
  __align__(16) float Bv[4][BC_LEN];
  __align__(16) float Cv[4][BC_LEN];
  float red[TC][NW][2 * N];
  __align__(16) bool st[TC];  // read as words by chunk_has_start
};

// The main pass of segment k: the adjoint entering it from the local pass's results (k < nseg - 1), then
// every per-step gradient and the partial sums that scan_bwd_reduce() adds up. NP states a thread: 4
// (ScanBwdSmem; the reverse step reads s_t and s_{t-1} from shared memory), or the pair build's 8
// (ScanBwdPairSmem; s_t carried in registers from the step before).
template <typename T, int N, int NP = SCAN_NPT>
__device__ __forceinline__ void scan_bwd_main_body(const ScanBwdParams& q, const int k) {
  constexpr bool PAIR = NP == SCAN_PAIR_NP;
  using Gm = ScanGeom<N, NP>;
  using SM = std::conditional_t<PAIR, ScanBwdPairSmem<N>, ScanBwdSmem<N>>;
  constexpr int G = Gm::G, CPB = Gm::CPB, TC = SCAN_TC, NW = Gm::NW, H = NP / SCAN_NPT;
  extern __shared__ float4 scan_bwd_smem[];
  SM& sm = *reinterpret_cast<SM*>(scan_bwd_smem);
  const ScanFwdParams& p = q.f;
  const int tid = threadIdx.x;
  const int gi = tid % G, cl = tid / G;
  const int lane = tid % 32, warp = tid / 32;
  const int d0 = blockIdx.x * CPB;
  const bool act = d0 + cl < p.D;
  const int d = act ? d0 + cl : p.D - 1;
  const int b = blockIdx.y, tile = blockIdx.x, ntiles = gridDim.x;
  const int T_ = p.T, D = p.D, B = p.B, nz = p.nseg;
  const ScanSeg sg(T_, p.seg_len, k);
  const int nC = sg.nC;
  // The pair build's slot j holds state j ^ pm of the thread's half (pair_transpose_reduce); 0 in the 4-state builds.
  const int pm = PAIR ? pair_perm(lane) : 0;
  float A[NP], A2[NP];
#pragma unroll
  for (int j = 0; j < NP; ++j) {
    A[j] = -expf(p.A_log[d * N + gi * NP + (j ^ pm)]);
    A2[j] = A[j] * 1.4426950408889634f;
  }
  const float Dd = p.Dskip[d];
  const int64_t bd = (int64_t)b * D + d;
  const ScanBwdLayout<N> L(q.ws, ntiles, B, T_, D, nz);
  float* pBC = L.pBC;
  float* pPar = L.pPar + ((int64_t)b * nz + k) * (D * N + 2 * D);

  ScanChunkRegs<T, N, SL_X | SL_Z | SL_G | SL_B | SL_C, NP> r;
  float4 pck[PAIR ? 1 : H];
  float pcks[PAIR ? NP : 1];  // the pair build's checkpoint, read in its slots' order
  auto prefetch = [&](int c) {
    const float* ck = p.ckpt + (((int64_t)b * nC + c) * D + d) * N + gi * NP;
    if constexpr (PAIR) {
#pragma unroll
      for (int j = 0; j < NP; ++j) pcks[j] = ck[j ^ pm];
    } else {
#pragma unroll
      for (int h = 0; h < H; ++h) pck[h] = reinterpret_cast<const float4*>(ck)[h];
    }
    r.load(p, q.dout, q.g_sb, q.g_st, b, d0, c, tid);
  };
  // B or C of step i in this thread's slots (sm.Bv / sm.Cv)
  auto ld_bc = [&](float (&v)[NP], const auto& arr, int i) {
    if constexpr (PAIR) {
      const float4* row = reinterpret_cast<const float4*>(&arr[pm & 3][i * N + gi * NP]);
      put4(&v[0], row[pm >> 2]);
      put4(&v[4], row[(pm >> 2) ^ 1]);
    } else {
      ld_states<NP>(v, &arr[i][gi * NP]);
    }
  };
  auto commit = [&](int t0) { scan_bwd_stage<N, NP>(sm, r, p, t0, tid, d0); };

  float hc[NP], dAacc[NP];
#pragma unroll
  for (int j = 0; j < NP; ++j) {
    // d loss / d s from the future
    hc[j] = (k == nz - 1 && q.dfinal && act) ? q.dfinal[bd * N + gi * NP + (j ^ pm)] : 0.f;
    dAacc[j] = 0.f;
  }
  if (k < nz - 1) {  // the adjoint entering segment k from later ones: fixed-order combine (local pass)
#pragma unroll
    for (int h = 0; h < H; ++h) {
      const int q4 = gi * H + h;  // this thread's h-th group of 4 states, as the 4-state layout counts them
      const float4 e0 = seg_ld(L.seg_e, b, nz, nz - 1, D, d, N, q4);  // the last segment started from dfinal
      float hh[SCAN_NPT];
      put4(hh, e0);
      for (int j = nz - 2; j > k; --j)
        seg_combine(hh, seg_ld(L.seg_P, b, nz, j, D, d, N, q4), seg_ld(L.seg_e, b, nz, j, D, d, N, q4));
#pragma unroll
      for (int j = 0; j < SCAN_NPT; ++j) hc[4 * h + j] = hh[j];
    }
    if constexpr (PAIR) xor_permute(hc, pm);
  }
  float dDacc = 0.f, ddbacc = 0.f;
  const float am = act ? 1.f : 0.f;
  prefetch(sg.ce - 1);
  for (int c = sg.ce - 1; c >= sg.cb; --c) {
    const int t0 = c * TC;
    const int len = min(TC, T_ - t0);
    commit(t0);
    float s[NP];  // this chunk's checkpoint, loaded with the chunk's inputs; after the recompute, s_t of its last step
    if constexpr (PAIR) {
#pragma unroll
      for (int j = 0; j < NP; ++j) s[j] = pcks[j];
    } else {
#pragma unroll
      for (int h = 0; h < H; ++h) put4(&s[4 * h], pck[h]);
    }
    __syncthreads();
    if (c > sg.cb) prefetch(c - 1);
    if constexpr (!PAIR) sm.S[0][tid] = make_float4(s[0], s[1], s[2], s[3]);
    const bool chunk_st = chunk_has_start(sm.st);
    // Recompute the chunk's states (this thread's own S entries: no barrier needed). ScanBwdSmem: S[i + 1] after
    // step i; ScanBwdPairSmem: S[i][h] entering step i (s_t of the last step stays in s).
    auto recompute = [&](auto has_start) {
#pragma unroll 4
      for (int i = 0; i < TC; ++i) {
        if constexpr (PAIR) {
#pragma unroll
          for (int h = 0; h < H; ++h) sm.S[i][h][tid] = make_float4(s[4 * h], s[4 * h + 1], s[4 * h + 2], s[4 * h + 3]);
        }
        const float dl = sm.dl[i][cl];
        const float dx_ = dl * sm.x[i][cl];
        float bx[NP];
        ld_bc(bx, sm.Bv, i);
        const bool st = decltype(has_start)::value && sm.st[i];
#pragma unroll
        for (int j = 0; j < NP; ++j) s[j] = fmaf(ex2f_(dl * A2[j]), st ? 0.f : s[j], dx_ * bx[j]);
        if constexpr (!PAIR) sm.S[i + 1][tid] = make_float4(s[0], s[1], s[2], s[3]);
      }
    };
    by_chunk_start(chunk_st, recompute);
    auto reverse = [&](auto has_start) {  // the chunk's reverse steps (chunk_has_start: the same bits either way)
#pragma unroll 2
      for (int i = TC - 1; i >= 0; --i) {
        const float xv = sm.x[i][cl], dl = sm.dl[i][cl];
        float bx[NP], cx[NP], spv[NP], sc[NP];
        ld_bc(bx, sm.Bv, i);
        ld_bc(cx, sm.Cv, i);
        if constexpr (PAIR) {
#pragma unroll
          for (int h = 0; h < H; ++h) put4(&spv[4 * h], sm.S[i][h][tid]);
#pragma unroll
          for (int j = 0; j < NP; ++j) sc[j] = s[j];             // s_t, carried
        } else {
          put4(sc, sm.S[i + 1][tid]);
          put4(spv, sm.S[i][tid]);
        }
        const bool st = decltype(has_start)::value && sm.st[i];
        const float g = sm.gs[i][cl];                          // d loss / d y_pre
        // Per state j, with h = d loss / d s_t and a = exp(dl A_j): dB_j = h dl x, dC_j = g s_t, and
        //   d loss / d dl = sum_j h (s_{t-1} a A_j + x B_j) = sum_j (h s_{t-1} a) A_j + x hB,
        //   d loss / d x  = dl hB,  with hB = sum_j h B_j,
        // so h s_{t-1} a (also dA's term) and hB are formed once per state, and the products by x / dl once per
        // step (am: 0 for a padding channel, whose dB / dC partials must be 0).
        const float amdx = am * dl * xv, amg = am * g;
        float ys = 0.f, ddA = 0.f, hB = 0.f;
        float v[2 * NP];
#pragma unroll
        for (int j = 0; j < NP; ++j) {
          const float a = ex2f_(dl * A2[j]);
          const float sp = st ? 0.f : spv[j];
          const float h = fmaf(g, cx[j], hc[j]);               // d loss / d s_t
          ys = fmaf(sc[j], cx[j], ys);
          // dB and dC: the pair build interleaves them (pair_transpose_reduce)
          v[PAIR ? 2 * j : j] = h * amdx;
          v[PAIR ? 2 * j + 1 : NP + j] = amg * sc[j];
          const float ha = h * a;
          const float hsa = ha * sp;
          ddA = fmaf(hsa, A[j], ddA);
          hB = fmaf(h, bx[j], hB);
          dAacc[j] = fmaf(hsa, dl, dAacc[j]);
          hc[j] = st ? 0.f : ha;
          if constexpr (PAIR) s[j] = spv[j];                   // s_t of step i - 1
        }
        ys = group_sum<G>(ys);
        ddA = group_sum<G>(ddA);
        hB = group_sum<G>(hB);
        const float ddel = fmaf(xv, hB, ddA), dxp = dl * hB;
        const float ddt = ddel * sm.sig[i][cl];
        if (gi == 0) {  // outputs over the consumed inputs (see ScanBwdSmem)
          sm.x[i][cl] = fmaf(g, Dd, dxp);
          sm.dl[i][cl] = ddt;
          sm.gs[i][cl] = sm.gd[i][cl] * fmaf(Dd, xv, ys);
        }
        dDacc = fmaf(amg, xv, dDacc);
        ddbacc = fmaf(ddt, am, ddbacc);
        if constexpr (PAIR) {
          sm.red[i][warp][((lane & 2) ? N : 0) + gi * NP + pm] = pair_transpose_reduce(v, lane);
        } else {
          int idx; bool dup;
          const float rr = transpose_reduce<G, 2 * NP>(v, lane, idx, dup);
          sm.red[i][warp][(idx >= NP ? N : 0) + gi * NP + (idx % NP)] = rr;  // duplicates write equal values
        }
      }
    };
    by_chunk_start(chunk_st, reverse);
    __syncthreads();
    for (int idx = tid; idx < len * 2 * N; idx += SCAN_THREADS) {
      const int i = idx / (2 * N), j = idx % (2 * N);
      float acc = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) acc += sm.red[i][w][j];
      pBC[(((int64_t)tile * B + b) * T_ + t0 + i) * 2 * N + j] = acc;
    }
    scan_bwd_store<T, N, NP>(q, sm, b, t0, len, d0, tid);
    __syncthreads();
  }
  if (act) {
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      if (q.dinit && k == 0) q.dinit[bd * N + gi * NP + (j ^ pm)] = hc[j];
      pPar[d * N + gi * NP + (j ^ pm)] = dAacc[j] * A[j];   // d/dA_log = d/dA * A
    }
    if (gi == 0) { pPar[D * N + d] = dDacc; pPar[D * N + D + d] = ddbacc; }
  }
}

// The backward's reductions over its partial sums, by the threads [gtid0 .. gtid0 + nthreads) of a grid
// (gtid = thread id in the grid), in a fixed order, so any grid gives the same bits: dB / dC of every (b, t)
// summed over the ntiles channel tiles in tile order, and dA_log / dD / ddt_bias of every column summed
// over the B * nseg (row, segment) partials as 8 row groups (group g: rows g, g + 8, ...; the 8 group sums
// then added in group order; 8 lanes of a warp per column). Written (or added, q.accumulate) into the outputs;
// dB / dC rows dBC_st apart (the binding's dbc_out: their columns of the x_proj output's gradient), the same sums.
template <typename T, int N>
__device__ __forceinline__ void scan_bwd_reduce(const ScanBwdParams& q, const int ntiles, const int64_t gtid,
                                                const int64_t nthreads) {
  const ScanFwdParams& p = q.f;
  const ScanBwdLayout<N> L(q.ws, ntiles, p.B, p.T, p.D, p.nseg);
  const int64_t Mbc = (int64_t)p.B * p.T * 2 * N;
  for (int64_t i = gtid; i < Mbc; i += nthreads) {
    float a = 0.f;
    for (int k = 0; k < ntiles; ++k) a += L.pBC[(int64_t)k * Mbc + i];
    const int64_t bt = i / (2 * N);
    const int j = (int)(i % (2 * N));
    if (j < N) reinterpret_cast<T*>(q.dB)[bt * q.dBC_st + j] = from_f<T>(a);
    else reinterpret_cast<T*>(q.dC)[bt * q.dBC_st + j - N] = from_f<T>(a);
  }
  const int D = p.D, M = D * N + 2 * D, rows = p.B * p.nseg;
  const int lane = (int)(gtid & 31);
  const int64_t total = (int64_t)M * 8;  // (column, row group) pairs, the 8 groups of a column in one warp
  for (int64_t w0 = gtid - lane; w0 < total; w0 += nthreads) {  // warp-uniform trip count (shuffles below)
    const int64_t idx = w0 + lane;
    const int col = (int)(idx >> 3), rg = lane & 7;
    float a = 0.f;
    if (idx < total)
      for (int r = rg; r < rows; r += 8) a += L.pPar[(int64_t)r * M + col];
    float v = 0.f;
#pragma unroll
    for (int g = 0; g < 8; ++g) v += __shfl_sync(0xffffffffu, a, (lane & ~7) + g);
    if (rg == 0 && idx < total) {
      float* dst = col < D * N ? q.dA_log + col : (col < D * N + D ? q.dD + (col - D * N) : q.ddt_bias + (col - D * N - D));
      *dst = q.accumulate ? *dst + v : v;
    }
  }
}

template <typename T, int N, int NP = SCAN_NPT>
__global__ void __launch_bounds__(SCAN_THREADS, NP == SCAN_NPT ? scan_fwd_minb(N) : SCAN_BWD_MINB)
    scan_bwd_local_kernel(ScanBwdParams q) {
  __shared__ ScanBwdLocalSmem<N, NP> ls;
  scan_bwd_local_body<T, N, NP, true>(q, blockIdx.z + 1, ls);
}
template <typename T, int N, int MINB>
__global__ void __launch_bounds__(SCAN_THREADS, MINB) scan_bwd_kernel(ScanBwdParams q) {
  scan_bwd_main_body<T, N>(q, blockIdx.z);
}
template <typename T, int N>
__global__ void __launch_bounds__(SCAN_THREADS, SCAN_BWD_MINB_PAIR) scan_bwd_pair_kernel(ScanBwdParams q) {
  scan_bwd_main_body<T, N, SCAN_PAIR_NP>(q, blockIdx.z);
}
template <typename T, int N>
__global__ void __launch_bounds__(256) scan_bwd_reduce_kernel(ScanBwdParams q, int ntiles) {
  scan_bwd_reduce<T, N>(q, ntiles, (int64_t)blockIdx.x * blockDim.x + threadIdx.x, (int64_t)gridDim.x * blockDim.x);
}
// The whole backward in one cooperative launch (the grid is co-resident): the local pass (nseg > 1, its shared
// memory carved from the main pass's), a grid barrier, the main pass, a grid barrier, the reductions by every
// thread of the grid. The same operations in the same order as the separate launches, so the same bits.
// PAIR: the pair build's passes (8 states a thread).
template <typename T, int N, int MINB, bool LOCAL, bool PAIR = false>
__global__ void __launch_bounds__(SCAN_THREADS, MINB) scan_bwd_coop_kernel(ScanBwdParams q) {
  constexpr int NP = PAIR ? SCAN_PAIR_NP : SCAN_NPT;
  extern __shared__ float4 scan_bwd_smem[];
  auto grid = cooperative_groups::this_grid();
  const int k = blockIdx.z;
  if (LOCAL && q.f.nseg > 1) {
    if (k >= 1) scan_bwd_local_body<T, N, NP>(q, k, *reinterpret_cast<ScanBwdLocalSmem<N, NP>*>(scan_bwd_smem));
    grid.sync();
  }
  scan_bwd_main_body<T, N, NP>(q, k);
  grid.sync();
  const int64_t blk = ((int64_t)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  scan_bwd_reduce<T, N>(q, gridDim.x, blk * SCAN_THREADS + threadIdx.x,
                        (int64_t)gridDim.x * gridDim.y * gridDim.z * SCAN_THREADS);
}

// The cooperative kernel of a build, or nullptr where it has none for a split (then the separate launches run):
// the 3-blocks-per-SM build and the pair build (with the local pass); at d_state 16 the wide build without a
// split only (no local pass, which keeps its code inside 128 registers).
template <typename T, int N>
const void* scan_bwd_coop_fn(int build, bool split) {
  if constexpr (N == 16) {
    if (build == SCAN_BWD_MINB_WIDE)
      return split ? nullptr : (const void*)scan_bwd_coop_kernel<T, N, SCAN_BWD_MINB_WIDE, false>;
    if (build == SCAN_BWD_MINB_PAIR) return (const void*)scan_bwd_coop_kernel<T, N, SCAN_BWD_MINB_PAIR, true, true>;
  }
  return build == SCAN_BWD_MINB ? (const void*)scan_bwd_coop_kernel<T, N, SCAN_BWD_MINB, true> : nullptr;
}

// The > 48 KB dynamic shared memory opt-in of every main-pass kernel of a dtype and d_state, once per device.
template <typename T, int N>
const char* scan_bwd_reserve_smem() {
  static bool attr_set[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return "selective_scan: no current CUDA device";
  if (attr_set[dev]) return nullptr;
  constexpr int smem = (int)sizeof(ScanBwdSmem<N>);
  static_assert(sizeof(ScanBwdLocalSmem<N>) <= sizeof(ScanBwdSmem<N>), "scan bwd: the local pass's shared memory");
  constexpr int wide_minb = N == 16 ? SCAN_BWD_MINB_WIDE : SCAN_BWD_MINB;  // d_state 8 spills at 128 registers
  static_assert(wide_minb * (smem + 1024) <= 228 * 1024, "scan bwd: shared memory for the target occupancy");
  struct { const void* fn; int bytes; } fns[] = {
      {(const void*)scan_bwd_kernel<T, N, SCAN_BWD_MINB>, smem}, {(const void*)scan_bwd_kernel<T, N, wide_minb>, smem},
      {scan_bwd_coop_fn<T, N>(SCAN_BWD_MINB, true), smem}, {scan_bwd_coop_fn<T, N>(SCAN_BWD_MINB_WIDE, false), smem},
      {nullptr, 0}, {nullptr, 0}};
  if constexpr (N == 16) {
    constexpr int psmem = (int)sizeof(ScanBwdPairSmem<N>);
    static_assert(SCAN_BWD_MINB_PAIR * (psmem + 1024) <= 228 * 1024, "scan bwd: the pair build's shared memory");
    fns[4] = {(const void*)scan_bwd_pair_kernel<T, N>, psmem};
    fns[5] = {scan_bwd_coop_fn<T, N>(SCAN_BWD_MINB_PAIR, false), psmem};
    static_assert(sizeof(ScanBwdLocalSmem<N, SCAN_PAIR_NP>) <= sizeof(ScanBwdPairSmem<N>), "scan bwd: pair local smem");
  }
  for (const auto& f : fns)
    if (f.fn != nullptr &&
        cudaFuncSetAttribute(f.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, f.bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      return "selective_scan: the backward's shared memory cannot be reserved on this device";
    }
  attr_set[dev] = true;
  return nullptr;
}

template <typename T, int N>
const char* scan_bwd_tn(const ScanBwdParams& q0, cudaStream_t s) {
  if (const char* err = scan_bwd_reserve_smem<T, N>()) return err;
  ScanBwdParams q = q0;
  const bool pair = N == 16 && q.build == SCAN_BWD_MINB_PAIR;
  int smem = (int)sizeof(ScanBwdSmem<N>);
  if constexpr (N == 16) if (pair) smem = (int)sizeof(ScanBwdPairSmem<N>);
  const int cpb = pair ? ScanGeom<N, SCAN_PAIR_NP>::CPB : ScanGeom<N>::CPB;
  const int tiles = (q.f.D + cpb - 1) / cpb;
  q.bc_tiles = tiles;
  const dim3 grid(tiles, q.f.B, q.f.nseg);
  // One launch only where the reductions are small (scan_bwd_small_reduce).
  const void* coop = scan_bwd_coop_fn<T, N>(q.build, q.f.nseg > 1);
  const int64_t grid_threads = (int64_t)grid.x * grid.y * grid.z * SCAN_THREADS;
  const bool small_reduce = scan_bwd_small_reduce(q.f.B, q.f.T, N, grid_threads);
  if (coop != nullptr && small_reduce && coop_fits(COOP_SCAN_BWD, coop, SCAN_THREADS, smem, grid)) {
    void* args[] = {&q};
    const cudaError_t e = cudaLaunchCooperativeKernel(coop, grid, dim3(SCAN_THREADS), args, smem, s);
    return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
  }
  if (q.f.nseg > 1) {  // the local pass, in the main pass's geometry
    const dim3 lgrid(tiles, q.f.B, q.f.nseg - 1);
    if (pair) scan_bwd_local_kernel<T, N, (N == 16 ? SCAN_PAIR_NP : SCAN_NPT)><<<lgrid, SCAN_THREADS, 0, s>>>(q);
    else scan_bwd_local_kernel<T, N><<<lgrid, SCAN_THREADS, 0, s>>>(q);
    MRL_LAUNCH_CHECK();
  }
  if constexpr (N == 16) {
    if (pair) scan_bwd_pair_kernel<T, N><<<grid, SCAN_THREADS, smem, s>>>(q);
    else if (q.build == SCAN_BWD_MINB_WIDE)
      scan_bwd_kernel<T, N, SCAN_BWD_MINB_WIDE><<<grid, SCAN_THREADS, smem, s>>>(q);
    else scan_bwd_kernel<T, N, SCAN_BWD_MINB><<<grid, SCAN_THREADS, smem, s>>>(q);
  } else {
    scan_bwd_kernel<T, N, SCAN_BWD_MINB><<<grid, SCAN_THREADS, smem, s>>>(q);
  }
  MRL_LAUNCH_CHECK();
  const int64_t work = std::max<int64_t>((int64_t)q.f.B * q.f.T * 2 * N,
                                         (int64_t)(q.f.D * N + 2 * q.f.D) * 8);
  const int blocks = (int)std::min<int64_t>((work + 255) / 256, 4096);
  scan_bwd_reduce_kernel<T, N><<<blocks, 256, 0, s>>>(q, tiles);
  MRL_LAUNCH_CHECK();
  return nullptr;
}
template <typename T>
const char* scan_bwd_t(const ScanBwdParams& q, cudaStream_t s) {
  switch (q.f.N) {
    case 8: return scan_bwd_tn<T, 8>(q, s);
    case 16: return scan_bwd_tn<T, 16>(q, s);
  }
  return "selective_scan: d_state must be 8 or 16";
}

}  // namespace mrl
