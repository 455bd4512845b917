// Selective scan backward: see scan_common.cuh for the layout.
#pragma once
#include "scan_common.cuh"

namespace mrl {

// Sum 8 values over the lanes of a warp that share lane % G (the other channels of the warp), transposed:
// each lane ends with ONE sum; *idx says which of the 8 it is. Lanes whose bits 1..G-1 in the "plain add"
// levels duplicate a sum report dup = true.
template <int G>
__device__ __forceinline__ float transpose_reduce8(const float (&v)[8], int lane, int& idx, bool& dup) {
  float w[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) w[k] = v[k];
  int cnt = 8;
  idx = 0;
  dup = false;
#pragma unroll
  for (int o = 16; o >= G; o >>= 1) {
    const int hb = (lane & o) ? 1 : 0;
    if (cnt > 1) {
      const int half = cnt / 2;
#pragma unroll
      for (int k = 0; k < half; ++k) {
        const float send = hb ? w[k] : w[k + half];
        const float keep = hb ? w[k + half] : w[k];
        w[k] = keep + __shfl_xor_sync(0xffffffffu, send, o);
      }
      idx = idx * 2 + hb;
      cnt = half;
    } else {
      w[0] += __shfl_xor_sync(0xffffffffu, w[0], o);
      dup = dup || hb;
    }
  }
  return w[0];
}

// Workspace layout (floats): pBC [ntiles][B][T][2N] | pPar [B][D*N + 2*D] (dA_log | dD | ddt_bias)
template <int N>
struct ScanBwdSmem {
  static constexpr int CPB = ScanGeom<N>::CPB, TC = SCAN_TC, NW = ScanGeom<N>::NW;
  float x[TC][CPB], dl[TC][CPB], sig[TC][CPB], sz[TC][CPB], dsz[TC][CPB], g[TC][CPB];
  float odx[TC][CPB], oddt[TC][CPB], oyp[TC][CPB];
  __align__(16) float Bv[TC][N];
  __align__(16) float Cv[TC][N];
  float red[TC][NW][2 * N];
  bool st[TC];
};

template <typename T, int N>
__global__ void __launch_bounds__(SCAN_THREADS) scan_bwd_kernel(ScanBwdParams q) {
  using Gm = ScanGeom<N>;
  using SM = ScanBwdSmem<N>;
  constexpr int G = Gm::G, CPB = Gm::CPB, EA = Gm::EA, EB = Gm::EB, TC = SCAN_TC, NW = Gm::NW, NP = SCAN_NPT;
  __shared__ SM sm;
  const ScanFwdParams& p = q.f;
  const int tid = threadIdx.x;
  const int gi = tid % G, cl = tid / G;
  const int lane = tid % 32, warp = tid / 32;
  const int d0 = blockIdx.x * CPB;
  const bool act = d0 + cl < p.D;
  const int d = act ? d0 + cl : p.D - 1;
  const int b = blockIdx.y, tile = blockIdx.x, ntiles = gridDim.x;
  const int T_ = p.T, D = p.D, B = p.B;
  float A[NP], A2[NP];
#pragma unroll
  for (int j = 0; j < NP; ++j) {
    A[j] = -expf(p.A_log[d * N + gi * NP + j]);
    A2[j] = A[j] * 1.4426950408889634f;
  }
  const float Dd = p.Dskip[d];
  const int64_t bd = (int64_t)b * D + d;
  const int nC = (T_ + TC - 1) / TC;
  float* pBC = q.ws;
  float* pPar = pBC + (int64_t)ntiles * B * T_ * 2 * N + (int64_t)b * (D * N + 2 * D);

  ScanChunkRegs<T, N, true> r;
  float4 pck;
  auto prefetch = [&](int c) {
    pck = *reinterpret_cast<const float4*>(p.ckpt + (((int64_t)b * nC + c) * D + d) * N + gi * NP);
    r.load(p, q.dout, q.g_sb, q.g_st, b, d0, c, tid);
  };
  auto commit = [&]() {
#pragma unroll
    for (int k = 0; k < EA; ++k) {
      const int e = tid + k * SCAN_THREADS, i = e / CPB, ch = e % CPB;
      const int dd = min(d0 + ch, D - 1);
      const float dr = to_f(r.dt[k]) + p.dt_bias[dd];
      const float zf = to_f(r.z[k]);
      const float sgz = sigmoidf_(zf);
      sm.x[i][ch] = to_f(r.x[k]);
      sm.dl[i][ch] = softplusf_(dr);
      sm.sig[i][ch] = dsoftplusf_(dr);
      sm.sz[i][ch] = zf * sgz;
      sm.dsz[i][ch] = sgz * (1.f + zf * (1.f - sgz));
      sm.g[i][ch] = to_f(r.g[k]);
    }
#pragma unroll
    for (int k = 0; k < EB; ++k) {
      const int e = tid + k * SCAN_THREADS;
      sm.Bv[e / N][e % N] = to_f(r.Bv[k]);
      sm.Cv[e / N][e % N] = to_f(r.Cv[k]);
    }
    if (tid < TC) sm.st[tid] = r.st;
  };

  float hc[NP], dAacc[NP];
#pragma unroll
  for (int j = 0; j < NP; ++j) {
    hc[j] = (q.dfinal && act) ? q.dfinal[bd * N + gi * NP + j] : 0.f;  // d loss / d s_t from the future
    dAacc[j] = 0.f;
  }
  float dDacc = 0.f, ddbacc = 0.f;
  prefetch(nC - 1);
  for (int c = nC - 1; c >= 0; --c) {
    const int t0 = c * TC;
    const int len = min(TC, T_ - t0);
    commit();
    const float4 se4 = pck;  // this chunk's checkpoint, loaded with the chunk's inputs
    __syncthreads();
    if (c > 0) prefetch(c - 1);
    const float s_enter[NP] = {se4.x, se4.y, se4.z, se4.w};
    float S[TC][NP];
    {
      float s[NP] = {s_enter[0], s_enter[1], s_enter[2], s_enter[3]};
      auto rstep = [&](const int i) {
        const float dl = sm.dl[i][cl];
        const float dx_ = dl * sm.x[i][cl];
        const float4 Bv = *reinterpret_cast<const float4*>(&sm.Bv[i][gi * NP]);
        const float bx[NP] = {Bv.x, Bv.y, Bv.z, Bv.w};
        const bool st = sm.st[i];
#pragma unroll
        for (int j = 0; j < NP; ++j) s[j] = fmaf(ex2f_(dl * A2[j]), st ? 0.f : s[j], dx_ * bx[j]);
      };
      if (len == TC) {
#pragma unroll
        for (int i = 0; i < TC; ++i) {
          rstep(i);
#pragma unroll
          for (int j = 0; j < NP; ++j) S[i][j] = s[j];
        }
      } else {
#pragma unroll
        for (int i = 0; i < TC; ++i) {
          if (i < len) rstep(i);
#pragma unroll
          for (int j = 0; j < NP; ++j) S[i][j] = s[j];
        }
      }
    }
    const float am = act ? 1.f : 0.f;
    auto bstep = [&](const int i) {
      const float xv = sm.x[i][cl], dl = sm.dl[i][cl];
      const float4 Bv = *reinterpret_cast<const float4*>(&sm.Bv[i][gi * NP]);
      const float4 Cv = *reinterpret_cast<const float4*>(&sm.Cv[i][gi * NP]);
      const float bx[NP] = {Bv.x, Bv.y, Bv.z, Bv.w}, cx[NP] = {Cv.x, Cv.y, Cv.z, Cv.w};
      const bool st = sm.st[i];
      const float g = sm.g[i][cl] * sm.sz[i][cl];            // d loss / d y_pre
      float ys = 0.f, ddel = 0.f, dxp = 0.f;
      float v8[8];
#pragma unroll
      for (int j = 0; j < NP; ++j) {
        const float a = ex2f_(dl * A2[j]);
        const float sp = st ? 0.f : (i > 0 ? S[i > 0 ? i - 1 : 0][j] : s_enter[j]);
        const float h = fmaf(g, cx[j], hc[j]);               // d loss / d s_t
        ys = fmaf(S[i][j], cx[j], ys);
        v8[j] = am * h * dl * xv;                            // dB
        v8[NP + j] = am * g * S[i][j];                       // dC
        const float spa = sp * a;
        ddel = fmaf(h, fmaf(spa, A[j], xv * bx[j]), ddel);
        dxp = fmaf(h * dl, bx[j], dxp);
        dAacc[j] = fmaf(h * spa, dl, dAacc[j]);
        hc[j] = st ? 0.f : h * a;
      }
      ys = group_sum<G>(ys);
      ddel = group_sum<G>(ddel);
      dxp = group_sum<G>(dxp);
      const float ddt = ddel * sm.sig[i][cl];
      sm.odx[i][cl] = fmaf(g, Dd, dxp);   // every lane of the group writes the same values
      sm.oddt[i][cl] = ddt;
      sm.oyp[i][cl] = fmaf(Dd, xv, ys);
      dDacc = fmaf(g * am, xv, dDacc);
      ddbacc = fmaf(ddt, am, ddbacc);
      int idx; bool dup;
      const float r = transpose_reduce8<G>(v8, lane, idx, dup);
      sm.red[i][warp][(idx >= NP ? N : 0) + gi * NP + (idx % NP)] = r;  // duplicates write equal values
    };
    if (len == TC) {
#pragma unroll
      for (int i = TC - 1; i >= 0; --i) bstep(i);
    } else {
#pragma unroll
      for (int i = TC - 1; i >= 0; --i)
        if (i < len) bstep(i);
    }
    __syncthreads();
    for (int idx = tid; idx < len * 2 * N; idx += SCAN_THREADS) {
      const int i = idx / (2 * N), j = idx % (2 * N);
      float acc = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) acc += sm.red[i][w][j];
      pBC[(((int64_t)tile * B + b) * T_ + t0 + i) * 2 * N + j] = acc;
    }
    {
      T* dxb = reinterpret_cast<T*>(q.dx) + (int64_t)b * T_ * D;
      T* ddtb = reinterpret_cast<T*>(q.ddt) + (int64_t)b * T_ * D;
      T* dzb = reinterpret_cast<T*>(q.dz) + b * q.dz_sb;
#pragma unroll
      for (int k = 0; k < EA; ++k) {
        const int e = tid + k * SCAN_THREADS, i = e / CPB, ch = e % CPB;
        if (i < len && d0 + ch < D) {
          const int64_t o = (int64_t)(t0 + i) * D + d0 + ch;
          dxb[o] = from_f<T>(sm.odx[i][ch]);
          ddtb[o] = from_f<T>(sm.oddt[i][ch]);
          dzb[(int64_t)(t0 + i) * q.dz_st + d0 + ch] = from_f<T>(sm.g[i][ch] * sm.oyp[i][ch] * sm.dsz[i][ch]);
        }
      }
    }
    __syncthreads();
  }
  if (act) {
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      if (q.dinit) q.dinit[bd * N + gi * NP + j] = hc[j];
      pPar[d * N + gi * NP + j] = dAacc[j] * A[j];   // d/dA_log = d/dA * A
    }
    if (gi == 0) { pPar[D * N + d] = dDacc; pPar[D * N + D + d] = ddbacc; }
  }
}

template <typename T, int N>
const char* scan_bwd_tn(const ScanBwdParams& q, cudaStream_t s) {
  constexpr int CPB = ScanGeom<N>::CPB;
  dim3 grid((q.f.D + CPB - 1) / CPB, q.f.B);
  scan_bwd_kernel<T, N><<<grid, SCAN_THREADS, 0, s>>>(q);
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
