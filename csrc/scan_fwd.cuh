// Selective scan forward: see scan_common.cuh for the layout and the two-level split over T. Stores the
// state entering every chunk (ckpt) for the backward.
#pragma once
#include "scan_common.cuh"

namespace mrl {

// Local pass of the forward: segment k (blockIdx.z, k < nseg - 1) from a zero state (segment 0 from the
// initial state). Writes its end state e and decay product P ([B][nseg][D][N] each, at p.ws).
template <typename T, int N>
__device__ __forceinline__ void scan_fwd_local_body(const ScanFwdParams& p, const int k) {
  using Gm = ScanGeom<N>;
  constexpr int G = Gm::G, CPB = Gm::CPB, EA = Gm::EA, EB = Gm::EB, TC = SCAN_TC, NP = SCAN_NPT;
  __shared__ float sdl[TC][CPB], sdx[TC][CPB];
  __shared__ __align__(16) float sB[TC][N];
  __shared__ __align__(16) bool sst[TC];
  const int tid = threadIdx.x, gi = tid % G, cl = tid / G;
  const int d0 = blockIdx.x * CPB, b = blockIdx.y;
  const int T_ = p.T, D = p.D;
  const bool act = d0 + cl < D;
  const int d = act ? d0 + cl : D - 1;
  const ScanSeg sg(T_, p.seg_len, k);
  float A2[NP], s[NP], P[NP];
  const int64_t bd = (int64_t)b * D + d;
#pragma unroll
  for (int j = 0; j < NP; ++j) {
    A2[j] = -expf(p.A_log[d * N + gi * NP + j]) * 1.4426950408889634f;  // A * log2(e)
    s[j] = (k == 0 && p.init) ? p.init[bd * N + gi * NP + j] : 0.f;
    P[j] = 1.f;
  }
  ScanChunkRegs<T, N, SL_X | SL_B> r;
  auto commit = [&](int t0) {
    const float dtb = scan_dt_bias<CPB>(p, d0, tid);
#pragma unroll
    for (int e_ = 0; e_ < EA; ++e_) {
      const int e = tid + e_ * SCAN_THREADS, i = e / CPB, ch = e % CPB;
      const bool ok = t0 + i < T_;
      const float dl = ok ? softplus_nb_(to_f(r.dt[e_]) + dtb) : 0.f;
      sdl[i][ch] = dl;
      sdx[i][ch] = dl * pad_f(r.x[e_], ok);
    }
#pragma unroll
    for (int e_ = 0; e_ < EB; ++e_) {
      const int e = tid + e_ * SCAN_THREADS;
      sB[e / N][e % N] = pad_f(r.Bv[e_], t0 + e / N < T_);
    }
    if (tid < TC) sst[tid] = r.st;
  };
  r.load(p, nullptr, 0, 0, b, d0, sg.cb, tid);
  for (int c = sg.cb; c < sg.ce; ++c) {
    commit(c * TC);
    __syncthreads();
    if (c + 1 < sg.ce) r.load(p, nullptr, 0, 0, b, d0, c + 1, tid);
    auto steps = [&](auto has_start) {  // the chunk's steps (chunk_has_start: the same bits either way)
#pragma unroll 4
      for (int i = 0; i < TC; ++i) {
        const float dl = sdl[i][cl], dx_ = sdx[i][cl];
        const float4 Bv = *reinterpret_cast<const float4*>(&sB[i][gi * NP]);
        const float bx[NP] = {Bv.x, Bv.y, Bv.z, Bv.w};
        const bool st = decltype(has_start)::value && sst[i];
#pragma unroll
        for (int j = 0; j < NP; ++j) {
          const float a = ex2f_(dl * A2[j]);
          s[j] = fmaf(a, st ? 0.f : s[j], dx_ * bx[j]);
          P[j] = (st ? 0.f : P[j]) * a;
        }
      }
    };
    by_chunk_start(chunk_has_start(sst), steps);
    __syncthreads();
  }
  if (act) {
    const int nz = p.nseg;
    seg_st(p.ws, b, nz, k, D, d, N, gi, make_float4(s[0], s[1], s[2], s[3]));
    seg_st(p.ws + (int64_t)p.B * nz * D * N, b, nz, k, D, d, N, gi, make_float4(P[0], P[1], P[2], P[3]));
  }
}

// The main pass of segment k: its entering state from the local pass's results (k > 0), then outputs,
// checkpoints and (last segment) the final state.
template <typename T, int N>
__device__ __forceinline__ void scan_fwd_main_body(const ScanFwdParams& p, const int k) {
  using Gm = ScanGeom<N>;
  constexpr int G = Gm::G, CPB = Gm::CPB, EA = Gm::EA, EB = Gm::EB, TC = SCAN_TC, NP = SCAN_NPT;
  __shared__ float sx[TC][CPB], sdl[TC][CPB], sz[TC][CPB], sy[TC][CPB];
  __shared__ __align__(16) float sB[TC][N], sC[TC][N];
  __shared__ __align__(16) bool sst[TC];
  const int tid = threadIdx.x;
  const int gi = tid % G, cl = tid / G;
  const int d0 = blockIdx.x * CPB;
  const int b = blockIdx.y;
  const int T_ = p.T, D = p.D;
  const bool act = d0 + cl < D;
  const int d = act ? d0 + cl : D - 1;
  const ScanSeg sg(T_, p.seg_len, k);
  const int nC = sg.nC;
  float A2[NP], s[NP];
  const int64_t bd = (int64_t)b * D + d;
#pragma unroll
  for (int j = 0; j < NP; ++j) {
    A2[j] = -expf(p.A_log[d * N + gi * NP + j]) * 1.4426950408889634f;  // A * log2(e)
    s[j] = (k == 0 && p.init) ? p.init[bd * N + gi * NP + j] : 0.f;
  }
  if (k > 0) {  // the state entering segment k: fixed-order combine of segments 0 .. k-1 (local pass)
    const int nz = p.nseg;
    const float* eh = p.ws;
    const float* eP = p.ws + (int64_t)p.B * nz * D * N;
    const float4 e0 = seg_ld(eh, b, nz, 0, D, d, N, gi);  // segment 0 started from the initial state
    s[0] = e0.x; s[1] = e0.y; s[2] = e0.z; s[3] = e0.w;
    for (int j = 1; j < k; ++j) seg_combine(s, seg_ld(eP, b, nz, j, D, d, N, gi), seg_ld(eh, b, nz, j, D, d, N, gi));
  }
  const float Dd = p.Dskip[d];

  ScanChunkRegs<T, N, SL_X | SL_Z | SL_B | SL_C> r;
  auto prefetch = [&](int c) { r.load(p, nullptr, 0, 0, b, d0, c, tid); };
  auto commit = [&](int t0) {
    const float dtb = scan_dt_bias<CPB>(p, d0, tid);
#pragma unroll
    for (int e_ = 0; e_ < EA; ++e_) {
      const int e = tid + e_ * SCAN_THREADS, i = e / CPB, ch = e % CPB;
      const bool ok = t0 + i < T_;
      const float zf = pad_f(r.z[e_], ok);
      sx[i][ch] = pad_f(r.x[e_], ok);
      sdl[i][ch] = ok ? softplus_nb_(to_f(r.dt[e_]) + dtb) : 0.f;  // pad: decay 1, no input
      sz[i][ch] = zf * sigmoid_fast_(zf);  // SiLU(z); its own last bits (siluf_ divides exactly)
    }
#pragma unroll
    for (int e_ = 0; e_ < EB; ++e_) {
      const int e = tid + e_ * SCAN_THREADS;
      const bool ok = t0 + e / N < T_;
      sB[e / N][e % N] = pad_f(r.Bv[e_], ok);
      sC[e / N][e % N] = pad_f(r.Cv[e_], ok);
    }
    if (tid < TC) sst[tid] = r.st;
  };

  prefetch(sg.cb);
  for (int c = sg.cb; c < sg.ce; ++c) {
    const int t0 = c * TC, len = min(TC, T_ - t0);
    commit(t0);
    __syncthreads();
    if (c + 1 < sg.ce) prefetch(c + 1);
    if (p.ckpt && act) {
      float4* ck = reinterpret_cast<float4*>(p.ckpt + (((int64_t)b * nC + c) * D + d) * N + gi * NP);
      *ck = make_float4(s[0], s[1], s[2], s[3]);
    }
    auto steps = [&](auto has_start) {  // the chunk's steps (chunk_has_start: the same bits either way)
#pragma unroll 4
      for (int i = 0; i < TC; ++i) {
        const float xv = sx[i][cl], dl = sdl[i][cl];
        const float4 Bv = *reinterpret_cast<const float4*>(&sB[i][gi * NP]);
        const float4 Cv = *reinterpret_cast<const float4*>(&sC[i][gi * NP]);
        const float bx[NP] = {Bv.x, Bv.y, Bv.z, Bv.w}, cx[NP] = {Cv.x, Cv.y, Cv.z, Cv.w};
        const bool st = decltype(has_start)::value && sst[i];
        const float dx_ = dl * xv;
        float y = 0.f;
#pragma unroll
        for (int j = 0; j < NP; ++j) {
          s[j] = fmaf(ex2f_(dl * A2[j]), st ? 0.f : s[j], dx_ * bx[j]);  // select: a reset clears even inf/NaN
          y = fmaf(s[j], cx[j], y);
        }
        y = group_sum<G>(y);
        if (gi == 0) sy[i][cl] = fmaf(Dd, xv, y) * sz[i][cl];
      }
    };
    by_chunk_start(chunk_has_start(sst), steps);
    __syncthreads();
    T* ob = reinterpret_cast<T*>(p.out) + (int64_t)b * T_ * D;
#pragma unroll
    for (int e_ = 0; e_ < EA; ++e_) {
      const int e = tid + e_ * SCAN_THREADS, i = e / CPB, ch = e % CPB;
      if (i < len && d0 + ch < D) ob[(int64_t)(t0 + i) * D + d0 + ch] = from_f<T>(sy[i][ch]);
    }
  }
  if (act && k == p.nseg - 1) {
#pragma unroll
    for (int j = 0; j < NP; ++j) p.final_state[bd * N + gi * NP + j] = s[j];
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(SCAN_THREADS, scan_fwd_minb(N)) scan_fwd_local_kernel(ScanFwdParams p) {
  scan_fwd_local_body<T, N>(p, blockIdx.z);
}
template <typename T, int N>
__global__ void __launch_bounds__(SCAN_THREADS, scan_fwd_minb(N)) scan_fwd_kernel(ScanFwdParams p) {
  scan_fwd_main_body<T, N>(p, blockIdx.z);
}
// Both passes in one cooperative launch (the grid is co-resident): the local pass, a grid barrier (which also
// orders the local results' stores before the main pass's loads), then the main pass. The same operations in
// the same order as the two launches, so the same bits.
template <typename T, int N>
__global__ void __launch_bounds__(SCAN_THREADS, scan_fwd_minb(N)) scan_fwd_coop_kernel(ScanFwdParams p) {
  const int k = blockIdx.z;
  if (k < p.nseg - 1) scan_fwd_local_body<T, N>(p, k);
  cooperative_groups::this_grid().sync();
  scan_fwd_main_body<T, N>(p, k);
}

template <typename T, int N>
const char* scan_fwd_tn(const ScanFwdParams& p, cudaStream_t s) {
  constexpr int CPB = ScanGeom<N>::CPB;
  const int tiles = (p.D + CPB - 1) / CPB;
  const dim3 grid(tiles, p.B, p.nseg);
  // One launch only for short segments (<= 2 chunks): measured in one process on the H200, 16 x 2048 bf16 (segments
  // of 32 chunks) took 3107-3126 µs a step this way against 3043-3045 with two launches; 16 x 64 (1 chunk) the same.
  if (p.nseg > 1 && p.seg_len <= 2 &&
      coop_fits(COOP_SCAN_FWD, (const void*)scan_fwd_coop_kernel<T, N>, SCAN_THREADS, 0, grid)) {
    ScanFwdParams a = p;
    void* args[] = {&a};
    const cudaError_t e =
        cudaLaunchCooperativeKernel((const void*)scan_fwd_coop_kernel<T, N>, grid, dim3(SCAN_THREADS), args, 0, s);
    return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
  }
  if (p.nseg > 1) {
    scan_fwd_local_kernel<T, N><<<dim3(tiles, p.B, p.nseg - 1), SCAN_THREADS, 0, s>>>(p);
    MRL_LAUNCH_CHECK();
  }
  scan_fwd_kernel<T, N><<<grid, SCAN_THREADS, 0, s>>>(p);
  MRL_LAUNCH_CHECK();
  return nullptr;
}
template <typename T>
const char* scan_fwd_t(const ScanFwdParams& p, cudaStream_t s) {
  switch (p.N) {
    case 8: return scan_fwd_tn<T, 8>(p, s);
    case 16: return scan_fwd_tn<T, 16>(p, s);
  }
  return "selective_scan: d_state must be 8 or 16";
}

}  // namespace mrl
