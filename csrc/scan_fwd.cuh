// Selective scan forward: see scan_common.cuh for the layout. Stores the state entering every chunk (ckpt)
// for the backward.
#pragma once
#include "scan_common.cuh"

namespace mrl {

template <typename T, int N>
__global__ void __launch_bounds__(SCAN_THREADS) scan_fwd_kernel(ScanFwdParams p) {
  using Gm = ScanGeom<N>;
  constexpr int G = Gm::G, CPB = Gm::CPB, EA = Gm::EA, EB = Gm::EB, TC = SCAN_TC, NP = SCAN_NPT;
  __shared__ float sx[TC][CPB], sdl[TC][CPB], sz[TC][CPB], sy[TC][CPB];
  __shared__ __align__(16) float sB[TC][N], sC[TC][N];
  __shared__ bool sst[TC];
  const int tid = threadIdx.x;
  const int gi = tid % G, cl = tid / G;
  const int d0 = blockIdx.x * CPB;
  const int b = blockIdx.y;
  const int T_ = p.T, D = p.D;
  const bool act = d0 + cl < D;
  const int d = act ? d0 + cl : D - 1;
  float A2[NP], s[NP];
  const int64_t bd = (int64_t)b * D + d;
#pragma unroll
  for (int j = 0; j < NP; ++j) {
    A2[j] = -expf(p.A_log[d * N + gi * NP + j]) * 1.4426950408889634f;  // A * log2(e)
    s[j] = (p.init && act) ? p.init[bd * N + gi * NP + j] : 0.f;
  }
  const float Dd = p.Dskip[d];
  const int nC = (T_ + TC - 1) / TC;

  ScanChunkRegs<T, N, false> r;
  auto prefetch = [&](int c) { r.load(p, nullptr, 0, 0, b, d0, c, tid); };
  auto commit = [&]() {
#pragma unroll
    for (int k = 0; k < EA; ++k) {
      const int e = tid + k * SCAN_THREADS, i = e / CPB, ch = e % CPB;
      const int dd = min(d0 + ch, D - 1);
      sx[i][ch] = to_f(r.x[k]);
      sdl[i][ch] = softplusf_(to_f(r.dt[k]) + p.dt_bias[dd]);
      sz[i][ch] = siluf_(to_f(r.z[k]));
    }
#pragma unroll
    for (int k = 0; k < EB; ++k) {
      const int e = tid + k * SCAN_THREADS;
      sB[e / N][e % N] = to_f(r.Bv[k]);
      sC[e / N][e % N] = to_f(r.Cv[k]);
    }
    if (tid < TC) sst[tid] = r.st;
  };

  prefetch(0);
  for (int c = 0; c < nC; ++c) {
    const int t0 = c * TC, len = min(TC, T_ - t0);
    commit();
    __syncthreads();
    if (c + 1 < nC) prefetch(c + 1);
    if (p.ckpt && act) {
      float4* ck = reinterpret_cast<float4*>(p.ckpt + (((int64_t)b * nC + c) * D + d) * N + gi * NP);
      *ck = make_float4(s[0], s[1], s[2], s[3]);
    }
    auto fstep = [&](const int i) {
      const float xv = sx[i][cl], dl = sdl[i][cl];
      const float4 Bv = *reinterpret_cast<const float4*>(&sB[i][gi * NP]);
      const float4 Cv = *reinterpret_cast<const float4*>(&sC[i][gi * NP]);
      const float bx[NP] = {Bv.x, Bv.y, Bv.z, Bv.w}, cx[NP] = {Cv.x, Cv.y, Cv.z, Cv.w};
      const bool st = sst[i];
      const float dx_ = dl * xv;
      float y = 0.f;
#pragma unroll
      for (int j = 0; j < NP; ++j) {
        s[j] = fmaf(ex2f_(dl * A2[j]), st ? 0.f : s[j], dx_ * bx[j]);  // select: a reset clears even inf/NaN
        y = fmaf(s[j], cx[j], y);
      }
      y = group_sum<G>(y);
      sy[i][cl] = fmaf(Dd, xv, y) * sz[i][cl];  // every lane of the group writes the same value
    };
    if (len == TC) {
#pragma unroll
      for (int i = 0; i < TC; ++i) fstep(i);
    } else {
#pragma unroll
      for (int i = 0; i < TC; ++i)
        if (i < len) fstep(i);
    }
    __syncthreads();
    T* ob = reinterpret_cast<T*>(p.out) + (int64_t)b * T_ * D;
#pragma unroll
    for (int k = 0; k < EA; ++k) {
      const int e = tid + k * SCAN_THREADS, i = e / CPB, ch = e % CPB;
      if (i < len && d0 + ch < D) ob[(int64_t)(t0 + i) * D + d0 + ch] = from_f<T>(sy[i][ch]);
    }
  }
  if (act) {
#pragma unroll
    for (int j = 0; j < NP; ++j) p.final_state[bd * N + gi * NP + j] = s[j];
  }
}

template <typename T, int N>
const char* scan_fwd_tn(const ScanFwdParams& p, cudaStream_t s) {
  constexpr int CPB = ScanGeom<N>::CPB;
  dim3 grid((p.D + CPB - 1) / CPB, p.B);
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
