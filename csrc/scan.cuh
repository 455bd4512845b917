// Selective scan (Mamba-1 S6) with fused softplus(dt + bias), D skip, SiLU(z) gate and per-row resets.
// Thread layout: N consecutive lanes own one (b, d) channel, one state each; a block holds
// SCAN_THREADS / N channels of one row b. The forward stores the state entering every SCAN_TC-step
// chunk (ckpt); the backward walks the chunks in reverse, recomputes the chunk's states into registers
// from its checkpoint, then runs the adjoint recurrence. dB/dC (sums over channels) are reduced in the
// block through shared memory, then over channel tiles by a second, fixed-order kernel, as are
// dA_log, dD and ddt_bias (sums over rows): no float atomics, so results are bit-reproducible.
#pragma once
#include "common.cuh"

namespace mrl {

constexpr int SCAN_THREADS = 512;
constexpr int SCAN_TC = 16;

template <typename T>
__device__ __forceinline__ float ldf(const void* base, int64_t off) {
  return to_f(reinterpret_cast<const T*>(base)[off]);
}

template <typename T, int N>
__global__ void __launch_bounds__(SCAN_THREADS) scan_fwd_kernel(ScanFwdParams p) {
  constexpr int CPB = SCAN_THREADS / N;
  const int n = threadIdx.x % N;
  const int d = blockIdx.x * CPB + threadIdx.x / N;
  const int b = blockIdx.y;
  if (d >= p.D) return;  // whole N-lane groups leave together
  const int T_ = p.T, D = p.D;
  const float A = -expf(p.A_log[d * N + n]);
  const float Dd = p.Dskip[d], db = p.dt_bias[d];
  const int64_t bd = (int64_t)b * D + d;
  float s = p.init ? p.init[bd * N + n] : 0.f;
  const bool* sb = p.starts ? p.starts + (int64_t)b * T_ : nullptr;
  const int64_t xo = b * p.x_sb + d, dto = b * p.dt_sb + d, zo = b * p.z_sb + d;
  const int64_t Bo = b * p.B_sb + n, Co = b * p.C_sb + n;
  T* ob = reinterpret_cast<T*>(p.out) + (int64_t)b * T_ * D + d;
  const int nC = (T_ + SCAN_TC - 1) / SCAN_TC;
#pragma unroll 4
  for (int t = 0; t < T_; ++t) {
    if (p.ckpt && (t % SCAN_TC) == 0) p.ckpt[(((int64_t)b * nC + t / SCAN_TC) * D + d) * N + n] = s;
    const float xv = ldf<T>(p.x, xo + t * p.x_st);
    const float dtv = softplusf_(ldf<T>(p.dt, dto + t * p.dt_st) + db);
    const float Bn = ldf<T>(p.Bm, Bo + t * p.B_st);
    const float Cn = ldf<T>(p.Cm, Co + t * p.C_st);
    const bool st = sb ? sb[t] : false;
    s = fmaf(expf(dtv * A), st ? 0.f : s, dtv * xv * Bn);
    const float y = group_sum<N>(s * Cn);
    if (n == 0) {
      const float zv = ldf<T>(p.z, zo + t * p.z_st);
      ob[(int64_t)t * D] = from_f<T>(fmaf(Dd, xv, y) * siluf_(zv));
    }
  }
  p.final_state[bd * N + n] = s;
}

// Workspace layout (floats): pBC [ntiles][B][T][2N] | pPar [B][D*N + 2*D] (dA_log | dD | ddt_bias)
template <typename T, int N>
__global__ void __launch_bounds__(SCAN_THREADS) scan_bwd_kernel(ScanBwdParams q) {
  constexpr int CPB = SCAN_THREADS / N;
  constexpr int NW = SCAN_THREADS / 32;
  constexpr int CPW = 32 / N;  // channels per warp
  __shared__ float red[SCAN_TC][NW][2 * N];
  const ScanFwdParams& p = q.f;
  const int n = threadIdx.x % N;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int d_raw = blockIdx.x * CPB + threadIdx.x / N;
  const bool act = d_raw < p.D;
  const int d = act ? d_raw : p.D - 1;
  const int b = blockIdx.y, tile = blockIdx.x, ntiles = gridDim.x;
  const int T_ = p.T, D = p.D, B = p.B;
  const float A = -expf(p.A_log[d * N + n]);
  const float Dd = p.Dskip[d], db = p.dt_bias[d];
  const int64_t bd = (int64_t)b * D + d;
  const bool* sb = p.starts ? p.starts + (int64_t)b * T_ : nullptr;
  const int64_t xo = b * p.x_sb + d, dto = b * p.dt_sb + d, zo = b * p.z_sb + d, go = b * q.g_sb + d;
  const int64_t Bo = b * p.B_sb + n, Co = b * p.C_sb + n;
  const int64_t oo = (int64_t)b * T_ * D + d;
  const int nC = (T_ + SCAN_TC - 1) / SCAN_TC;
  float* pBC = q.ws;
  float* pPar = pBC + (int64_t)ntiles * B * T_ * 2 * N + (int64_t)b * (D * N + 2 * D);

  float hc = (q.dfinal && act) ? q.dfinal[bd * N + n] : 0.f;  // d loss / d s_t from the future
  float dAacc = 0.f, dDacc = 0.f, ddbacc = 0.f;
  for (int c = nC - 1; c >= 0; --c) {
    const int t0 = c * SCAN_TC;
    const int len = min(SCAN_TC, T_ - t0);
    const float s_enter = p.ckpt[(((int64_t)b * nC + c) * D + d) * N + n];
    float S[SCAN_TC];
    float s = s_enter;
#pragma unroll
    for (int i = 0; i < SCAN_TC; ++i) {
      if (i < len) {
        const int t = t0 + i;
        const float xv = ldf<T>(p.x, xo + t * p.x_st);
        const float dtv = softplusf_(ldf<T>(p.dt, dto + t * p.dt_st) + db);
        const float Bn = ldf<T>(p.Bm, Bo + t * p.B_st);
        const bool st = sb ? sb[t] : false;
        s = fmaf(expf(dtv * A), st ? 0.f : s, dtv * xv * Bn);
      }
      S[i] = s;
    }
#pragma unroll
    for (int i = SCAN_TC - 1; i >= 0; --i) {
      if (i < len) {
        const int t = t0 + i;
        const float xv = ldf<T>(p.x, xo + t * p.x_st);
        const float dr = ldf<T>(p.dt, dto + t * p.dt_st) + db;
        const float dtv = softplusf_(dr);
        const float Bn = ldf<T>(p.Bm, Bo + t * p.B_st);
        const float Cn = ldf<T>(p.Cm, Co + t * p.C_st);
        const float zv = ldf<T>(p.z, zo + t * p.z_st);
        const float gv = ldf<T>(q.dout, go + t * q.g_st);
        const bool st = sb ? sb[t] : false;
        const float a = expf(dtv * A);
        const float sz = sigmoidf_(zv);
        const float ys = group_sum<N>(S[i] * Cn);
        const float ypre = fmaf(Dd, xv, ys);
        const float g = gv * zv * sz;                       // d loss / d y_pre
        const float dzv = gv * ypre * sz * (1.f + zv * (1.f - sz));
        const float h = fmaf(g, Cn, hc);                    // d loss / d s_t
        const float sprev = st ? 0.f : (i > 0 ? S[i > 0 ? i - 1 : 0] : s_enter);
        float dBn = h * dtv * xv;
        float dCn = g * S[i];
        float ddel = h * fmaf(sprev * a, A, xv * Bn);
        float dxp = h * dtv * Bn;
        dAacc = fmaf(h * sprev * a, dtv, dAacc);
        ddel = group_sum<N>(ddel);
        dxp = group_sum<N>(dxp);
        const float ddt = ddel * dsoftplusf_(dr);
        if (n == 0 && act) {
          reinterpret_cast<T*>(q.dx)[oo + (int64_t)t * D] = from_f<T>(fmaf(g, Dd, dxp));
          reinterpret_cast<T*>(q.ddt)[oo + (int64_t)t * D] = from_f<T>(ddt);
          reinterpret_cast<T*>(q.dz)[oo + (int64_t)t * D] = from_f<T>(dzv);
        }
        dDacc = fmaf(g, xv, dDacc);
        ddbacc += ddt;
        hc = st ? 0.f : h * a;
        if (!act) { dBn = 0.f; dCn = 0.f; }
#pragma unroll
        for (int o = N; o < 32; o <<= 1) {
          dBn += __shfl_xor_sync(0xffffffffu, dBn, o);
          dCn += __shfl_xor_sync(0xffffffffu, dCn, o);
        }
        if (lane < N) { red[i][warp][n] = dBn; red[i][warp][N + n] = dCn; }
      }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < len * 2 * N; idx += SCAN_THREADS) {
      const int i = idx / (2 * N), j = idx % (2 * N);
      float acc = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) acc += red[i][w][j];
      pBC[(((int64_t)tile * B + b) * T_ + t0 + i) * 2 * N + j] = acc;
    }
    __syncthreads();
  }
  (void)CPW;
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
