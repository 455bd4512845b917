// Selective scan (Mamba-1 S6) with fused softplus(dt + bias), D skip, SiLU(z) gate and per-row resets.
// Thread layout: G = N / 4 consecutive lanes own one (b, d) channel, 4 states each (float4 loads of B and
// C, few shuffles per state); a block holds CPB = 128 / G channels of one row b. Time advances in chunks of
// SCAN_TC steps: the block stages a chunk's inputs in shared memory with coalesced loads (the next chunk's
// loads are issued before the current chunk is computed, so memory latency is paid once per chunk), and
// per-(t, channel) terms (softplus, SiLU, sigmoid) are computed once by the staging thread.
// The forward stores the state entering every chunk (ckpt); the backward walks the chunks in reverse,
// recomputes the chunk's states into registers from its checkpoint, then runs the adjoint recurrence.
// dB/dC (sums over channels) are reduced in the warp (transpose-reduce), then over warps in shared memory,
// then over channel tiles by a second, fixed-order kernel, as are dA_log, dD and ddt_bias (sums over
// rows): no float atomics, so results are bit-reproducible.
#pragma once
#include "common.cuh"

namespace mrl {

constexpr int SCAN_THREADS = 128;
constexpr int SCAN_TC = 16;
constexpr int SCAN_NPT = 4;  // states per thread

template <typename T>
__device__ __forceinline__ float ldf(const void* base, int64_t off) {
  return to_f(__ldg(reinterpret_cast<const T*>(base) + off));
}

__device__ __forceinline__ float ex2f_(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}

template <int N>
struct ScanGeom {
  static constexpr int G = N / SCAN_NPT;                       // lanes per channel
  static constexpr int CPB = SCAN_THREADS / G;                 // channels per block
  static constexpr int EA = SCAN_TC * CPB / SCAN_THREADS;      // staged [TC][CPB] elements per thread
  static constexpr int EB = SCAN_TC * N / SCAN_THREADS;        // staged [TC][N] elements per thread (per array)
  static constexpr int NW = SCAN_THREADS / 32;
  static_assert(EA >= 1 && EB >= 1, "scan geometry");
};

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

  float px[EA], pdt[EA], pz[EA], pb[EB], pc[EB];
  bool pst = false;
  auto prefetch = [&](int c) {
    const int t0 = c * TC;
#pragma unroll
    for (int k = 0; k < EA; ++k) {
      const int e = tid + k * SCAN_THREADS, i = e / CPB, ch = e % CPB;
      const int t = t0 + i, dd = min(d0 + ch, D - 1);
      const bool ok = t < T_;
      px[k] = ok ? ldf<T>(p.x, b * p.x_sb + (int64_t)t * p.x_st + dd) : 0.f;
      pdt[k] = ok ? ldf<T>(p.dt, b * p.dt_sb + (int64_t)t * p.dt_st + dd) : 0.f;
      pz[k] = ok ? ldf<T>(p.z, b * p.z_sb + (int64_t)t * p.z_st + dd) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < EB; ++k) {
      const int e = tid + k * SCAN_THREADS, i = e / N, nn = e % N, t = t0 + i;
      const bool ok = t < T_;
      pb[k] = ok ? ldf<T>(p.Bm, b * p.B_sb + (int64_t)t * p.B_st + nn) : 0.f;
      pc[k] = ok ? ldf<T>(p.Cm, b * p.C_sb + (int64_t)t * p.C_st + nn) : 0.f;
    }
    if (tid < TC) pst = (p.starts && t0 + tid < T_) ? p.starts[(int64_t)b * T_ + t0 + tid] : false;
  };
  auto commit = [&]() {
#pragma unroll
    for (int k = 0; k < EA; ++k) {
      const int e = tid + k * SCAN_THREADS, i = e / CPB, ch = e % CPB;
      const int dd = min(d0 + ch, D - 1);
      sx[i][ch] = px[k];
      sdl[i][ch] = softplusf_(pdt[k] + p.dt_bias[dd]);
      sz[i][ch] = siluf_(pz[k]);
    }
#pragma unroll
    for (int k = 0; k < EB; ++k) {
      const int e = tid + k * SCAN_THREADS;
      sB[e / N][e % N] = pb[k];
      sC[e / N][e % N] = pc[k];
    }
    if (tid < TC) sst[tid] = pst;
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

  float px[EA], pdt[EA], pz[EA], pg[EA], pb[EB], pc[EB];
  float4 pck;
  bool pst = false;
  auto prefetch = [&](int c) {
    const int t0 = c * TC;
    pck = *reinterpret_cast<const float4*>(p.ckpt + (((int64_t)b * nC + c) * D + d) * N + gi * NP);
#pragma unroll
    for (int k = 0; k < EA; ++k) {
      const int e = tid + k * SCAN_THREADS, i = e / CPB, ch = e % CPB;
      const int t = t0 + i, dd = min(d0 + ch, D - 1);
      const bool ok = t < T_;
      px[k] = ok ? ldf<T>(p.x, b * p.x_sb + (int64_t)t * p.x_st + dd) : 0.f;
      pdt[k] = ok ? ldf<T>(p.dt, b * p.dt_sb + (int64_t)t * p.dt_st + dd) : 0.f;
      pz[k] = ok ? ldf<T>(p.z, b * p.z_sb + (int64_t)t * p.z_st + dd) : 0.f;
      pg[k] = ok ? ldf<T>(q.dout, b * q.g_sb + (int64_t)t * q.g_st + dd) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < EB; ++k) {
      const int e = tid + k * SCAN_THREADS, i = e / N, nn = e % N, t = t0 + i;
      const bool ok = t < T_;
      pb[k] = ok ? ldf<T>(p.Bm, b * p.B_sb + (int64_t)t * p.B_st + nn) : 0.f;
      pc[k] = ok ? ldf<T>(p.Cm, b * p.C_sb + (int64_t)t * p.C_st + nn) : 0.f;
    }
    if (tid < TC) pst = (p.starts && t0 + tid < T_) ? p.starts[(int64_t)b * T_ + t0 + tid] : false;
  };
  auto commit = [&]() {
#pragma unroll
    for (int k = 0; k < EA; ++k) {
      const int e = tid + k * SCAN_THREADS, i = e / CPB, ch = e % CPB;
      const int dd = min(d0 + ch, D - 1);
      const float dr = pdt[k] + p.dt_bias[dd];
      const float sgz = sigmoidf_(pz[k]);
      sm.x[i][ch] = px[k];
      sm.dl[i][ch] = softplusf_(dr);
      sm.sig[i][ch] = dsoftplusf_(dr);
      sm.sz[i][ch] = pz[k] * sgz;
      sm.dsz[i][ch] = sgz * (1.f + pz[k] * (1.f - sgz));
      sm.g[i][ch] = pg[k];
    }
#pragma unroll
    for (int k = 0; k < EB; ++k) {
      const int e = tid + k * SCAN_THREADS;
      sm.Bv[e / N][e % N] = pb[k];
      sm.Cv[e / N][e % N] = pc[k];
    }
    if (tid < TC) sm.st[tid] = pst;
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
const char* scan_fwd_tn(const ScanFwdParams& p, cudaStream_t s) {
  constexpr int CPB = ScanGeom<N>::CPB;
  dim3 grid((p.D + CPB - 1) / CPB, p.B);
  scan_fwd_kernel<T, N><<<grid, SCAN_THREADS, 0, s>>>(p);
  MRL_LAUNCH_CHECK();
  return nullptr;
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
const char* scan_fwd_t(const ScanFwdParams& p, cudaStream_t s) {
  switch (p.N) {
    case 8: return scan_fwd_tn<T, 8>(p, s);
    case 16: return scan_fwd_tn<T, 16>(p, s);
  }
  return "selective_scan: d_state must be 8 or 16";
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
