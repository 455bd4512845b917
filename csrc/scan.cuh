// Selective scan (Mamba-1 S6) with fused softplus(dt + bias), D skip, SiLU(z) gate and per-row resets.
// Thread layout: N consecutive lanes own one (b, d) channel, one state each; a block holds CPB = 512 / N
// channels of one row b. Time advances in chunks of SCAN_TC steps: the block stages a chunk's inputs in
// shared memory with coalesced loads (the next chunk's loads are issued before the current chunk is
// computed, so memory latency is paid once per chunk, not per step), and per-(t, channel) transcendental
// terms (softplus, SiLU, sigmoid) are computed once by the staging thread, not by all N lanes.
// The forward stores the state entering every chunk (ckpt); the backward walks the chunks in reverse,
// recomputes the chunk's states into registers from its checkpoint, then runs the adjoint recurrence.
// dB/dC (sums over channels) are reduced in the block through shared memory, then over channel tiles by
// a second, fixed-order kernel, as are dA_log, dD and ddt_bias (sums over rows): no float atomics, so
// results are bit-reproducible.
#pragma once
#include "common.cuh"

namespace mrl {

constexpr int SCAN_THREADS = 512;
constexpr int SCAN_TC = 16;

template <typename T>
__device__ __forceinline__ float ldf(const void* base, int64_t off) {
  return to_f(__ldg(reinterpret_cast<const T*>(base) + off));
}

// Per-thread prefetch registers for one chunk: arrays of [TC][CPB] use EA slots, [TC][N] use EB slots.
template <int N>
struct ScanGeom {
  static constexpr int CPB = SCAN_THREADS / N;
  static constexpr int EA = SCAN_TC * CPB / SCAN_THREADS;               // = TC / N (>= 1)
  static constexpr int EB = (SCAN_TC * N + SCAN_THREADS - 1) / SCAN_THREADS;  // 1
};

template <typename T, int N>
__global__ void __launch_bounds__(SCAN_THREADS) scan_fwd_kernel(ScanFwdParams p) {
  using G = ScanGeom<N>;
  constexpr int CPB = G::CPB, EA = G::EA, TC = SCAN_TC;
  __shared__ float sx[TC][CPB], sdl[TC][CPB], sz[TC][CPB], sy[TC][CPB];
  __shared__ float sB[TC][N], sC[TC][N];
  __shared__ bool sst[TC];
  const int tid = threadIdx.x;
  const int n = tid % N, cl = tid / N;
  const int d0 = blockIdx.x * CPB;
  const int b = blockIdx.y;
  const int T_ = p.T, D = p.D;
  const bool act = d0 + cl < D;
  const int d = act ? d0 + cl : D - 1;
  const float A = -expf(p.A_log[d * N + n]);
  const float Dd = p.Dskip[d];
  const int64_t bd = (int64_t)b * D + d;
  float s = (p.init && act) ? p.init[bd * N + n] : 0.f;
  const int nC = (T_ + TC - 1) / TC;

  float px[EA], pdt[EA], pz[EA], pb, pc;
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
    {
      const int i = tid / N, nn = tid % N, t = t0 + i;  // tid < TC * N covers B; the rest C
      const bool ok = tid < TC * N && t < T_;
      pb = ok ? ldf<T>(p.Bm, b * p.B_sb + (int64_t)t * p.B_st + nn) : 0.f;
      pc = ok ? ldf<T>(p.Cm, b * p.C_sb + (int64_t)t * p.C_st + nn) : 0.f;
      if (tid < TC) pst = (p.starts && t0 + tid < T_) ? p.starts[(int64_t)b * T_ + t0 + tid] : false;
    }
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
    if (tid < TC * N) { sB[tid / N][tid % N] = pb; sC[tid / N][tid % N] = pc; }
    if (tid < TC) sst[tid] = pst;
  };

  prefetch(0);
  for (int c = 0; c < nC; ++c) {
    const int t0 = c * TC, len = min(TC, T_ - t0);
    commit();
    __syncthreads();
    if (c + 1 < nC) prefetch(c + 1);
    if (p.ckpt && act) p.ckpt[(((int64_t)b * nC + c) * D + d) * N + n] = s;
#pragma unroll
    for (int i = 0; i < TC; ++i) {
      if (i < len) {
        const float xv = sx[i][cl], dl = sdl[i][cl];
        s = fmaf(expf(dl * A), sst[i] ? 0.f : s, dl * xv * sB[i][n]);
        const float y = group_sum<N>(s * sC[i][n]);
        if (n == 0) sy[i][cl] = fmaf(Dd, xv, y) * sz[i][cl];
      }
    }
    __syncthreads();
    T* ob = reinterpret_cast<T*>(p.out) + (int64_t)b * T_ * D;
#pragma unroll
    for (int k = 0; k < EA; ++k) {
      const int e = tid + k * SCAN_THREADS, i = e / CPB, ch = e % CPB;
      if (i < len && d0 + ch < D) ob[(int64_t)(t0 + i) * D + d0 + ch] = from_f<T>(sy[i][ch]);
    }
  }
  if (act) p.final_state[bd * N + n] = s;
}

// Workspace layout (floats): pBC [ntiles][B][T][2N] | pPar [B][D*N + 2*D] (dA_log | dD | ddt_bias)
template <int N>
struct ScanBwdSmem {
  static constexpr int CPB = SCAN_THREADS / N, TC = SCAN_TC, NW = SCAN_THREADS / 32;
  float x[TC][CPB], dl[TC][CPB], sig[TC][CPB], sz[TC][CPB], dsz[TC][CPB], g[TC][CPB];
  float odx[TC][CPB], oddt[TC][CPB], oyp[TC][CPB];
  float Bv[TC][N], Cv[TC][N];
  float red[TC][NW][2 * N];
  bool st[TC];
};

template <typename T, int N>
__global__ void __launch_bounds__(SCAN_THREADS) scan_bwd_kernel(ScanBwdParams q) {
  using G = ScanGeom<N>;
  using SM = ScanBwdSmem<N>;
  constexpr int CPB = G::CPB, EA = G::EA, TC = SCAN_TC, NW = SM::NW;
  extern __shared__ __align__(16) unsigned char smraw[];
  SM& sm = *reinterpret_cast<SM*>(smraw);
  const ScanFwdParams& p = q.f;
  const int tid = threadIdx.x;
  const int n = tid % N, cl = tid / N;
  const int lane = tid % 32, warp = tid / 32;
  const int d0 = blockIdx.x * CPB;
  const bool act = d0 + cl < p.D;
  const int d = act ? d0 + cl : p.D - 1;
  const int b = blockIdx.y, tile = blockIdx.x, ntiles = gridDim.x;
  const int T_ = p.T, D = p.D, B = p.B;
  const float A = -expf(p.A_log[d * N + n]);
  const float Dd = p.Dskip[d];
  const int64_t bd = (int64_t)b * D + d;
  const int nC = (T_ + TC - 1) / TC;
  float* pBC = q.ws;
  float* pPar = pBC + (int64_t)ntiles * B * T_ * 2 * N + (int64_t)b * (D * N + 2 * D);

  float px[EA], pdt[EA], pz[EA], pg[EA], pb, pc;
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
      pg[k] = ok ? ldf<T>(q.dout, b * q.g_sb + (int64_t)t * q.g_st + dd) : 0.f;
    }
    {
      const int i = tid / N, nn = tid % N, t = t0 + i;
      const bool ok = tid < TC * N && t < T_;
      pb = ok ? ldf<T>(p.Bm, b * p.B_sb + (int64_t)t * p.B_st + nn) : 0.f;
      pc = ok ? ldf<T>(p.Cm, b * p.C_sb + (int64_t)t * p.C_st + nn) : 0.f;
      if (tid < TC) pst = (p.starts && t0 + tid < T_) ? p.starts[(int64_t)b * T_ + t0 + tid] : false;
    }
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
    if (tid < TC * N) { sm.Bv[tid / N][tid % N] = pb; sm.Cv[tid / N][tid % N] = pc; }
    if (tid < TC) sm.st[tid] = pst;
  };

  float hc = (q.dfinal && act) ? q.dfinal[bd * N + n] : 0.f;  // d loss / d s_t from the future
  float dAacc = 0.f, dDacc = 0.f, ddbacc = 0.f;
  prefetch(nC - 1);
  for (int c = nC - 1; c >= 0; --c) {
    const int t0 = c * TC;
    const int len = min(TC, T_ - t0);
    commit();
    __syncthreads();
    if (c > 0) prefetch(c - 1);
    const float s_enter = p.ckpt[(((int64_t)b * nC + c) * D + d) * N + n];
    float S[TC];
    float s = s_enter;
#pragma unroll
    for (int i = 0; i < TC; ++i) {
      if (i < len) {
        const float dl = sm.dl[i][cl];
        s = fmaf(expf(dl * A), sm.st[i] ? 0.f : s, dl * sm.x[i][cl] * sm.Bv[i][n]);
      }
      S[i] = s;
    }
#pragma unroll
    for (int i = TC - 1; i >= 0; --i) {
      if (i < len) {
        const float xv = sm.x[i][cl], dl = sm.dl[i][cl];
        const float Bn = sm.Bv[i][n], Cn = sm.Cv[i][n];
        const bool st = sm.st[i];
        const float a = expf(dl * A);
        const float ys = group_sum<N>(S[i] * Cn);
        const float g = sm.g[i][cl] * sm.sz[i][cl];          // d loss / d y_pre
        const float h = fmaf(g, Cn, hc);                    // d loss / d s_t
        const float sprev = st ? 0.f : (i > 0 ? S[i > 0 ? i - 1 : 0] : s_enter);
        float dBn = h * dl * xv;
        float dCn = g * S[i];
        float ddel = h * fmaf(sprev * a, A, xv * Bn);
        float dxp = h * dl * Bn;
        dAacc = fmaf(h * sprev * a, dl, dAacc);
        ddel = group_sum<N>(ddel);
        dxp = group_sum<N>(dxp);
        if (n == 0) {
          const float ddt = ddel * sm.sig[i][cl];
          sm.odx[i][cl] = fmaf(g, Dd, dxp);
          sm.oddt[i][cl] = ddt;
          sm.oyp[i][cl] = fmaf(Dd, xv, ys);
          dDacc = fmaf(g, xv, dDacc);
          ddbacc += ddt;
        }
        hc = st ? 0.f : h * a;
        if (!act) { dBn = 0.f; dCn = 0.f; }
#pragma unroll
        for (int o = N; o < 32; o <<= 1) {
          dBn += __shfl_xor_sync(0xffffffffu, dBn, o);
          dCn += __shfl_xor_sync(0xffffffffu, dCn, o);
        }
        if (lane < N) { sm.red[i][warp][n] = dBn; sm.red[i][warp][N + n] = dCn; }
      }
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
    if (q.dinit) q.dinit[bd * N + n] = hc;
    pPar[d * N + n] = dAacc * A;   // d/dA_log = d/dA * A
    if (n == 0) { pPar[D * N + d] = dDacc; pPar[D * N + D + d] = ddbacc; }
  }
}

template <typename T, int N>
const char* scan_fwd_tn(const ScanFwdParams& p, cudaStream_t s) {
  constexpr int CPB = SCAN_THREADS / N;
  dim3 grid((p.D + CPB - 1) / CPB, p.B);
  scan_fwd_kernel<T, N><<<grid, SCAN_THREADS, 0, s>>>(p);
  MRL_LAUNCH_CHECK();
  return nullptr;
}
template <typename T, int N>
const char* scan_bwd_tn(const ScanBwdParams& q, cudaStream_t s) {
  constexpr int CPB = SCAN_THREADS / N;
  const int smem = (int)sizeof(ScanBwdSmem<N>);
  static bool attr_set = false;  // per instantiation; not a stream op, safe during capture
  if (!attr_set) {
    cudaError_t e = cudaFuncSetAttribute(scan_bwd_kernel<T, N>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return cudaGetErrorString(e);
    attr_set = true;
  }
  dim3 grid((q.f.D + CPB - 1) / CPB, q.f.B);
  scan_bwd_kernel<T, N><<<grid, SCAN_THREADS, smem, s>>>(q);
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
