// Mamba-3 SISO mixer core, CUDA: forward (sequence, and with T = 1 in place the one-token step) and the
// hand-written backward, with per-row episode resets, initial and final state. float32 in and out (the
// GEMMs around it may run in bf16 / f16; the caller casts).
//
// The math is the CPU kernel's (cpu/mamba3.cpp, same argument contract, same checkpoint layout idea) and
// mamba_rl/ops/mamba3_ref.py (the float64 reference the tests compare with):
//   dt = softplus(dd_dt + dt_bias), A = min(-f(dd_A), -A_floor), alpha = exp(A dt), lam = sigmoid(trap)
//   theta = (theta + pi tanh(ang) dt) mod 2 pi; k~ = Rot(theta)(RMSNorm(Bp) B_w + B_bias[h]); q~ likewise
//   S = alpha S + (1 - lam) dt alpha v_prev k~_prev^T + lam dt x k~^T;  y = S q~ + D x;  gate / gated norm
// An episode start zeroes S, theta, k~_prev and v_prev before its step (selects, not multiplies).
//
// Layout: one block per (row b, head h); thread tid = p * N + n owns the state entry S[p, n] in a register
// (the block is P N threads rounded up to whole warps; N is a power of two <= 32, so the N entries of a
// channel p sit in one warp segment and the read-out sum over n is a segment shuffle). In the backward warp
// 0 does the per-step vector work of the head (B / C norms, rotation, coefficients, gate) in shared memory;
// the forward does it for a chunk of steps at once, a warp per step (see m3_fwd_kernel).
// Kernels (each a fat pass over the whole sequence):
//   m3_fwd_kernel    sequence forward in chunks of up to 32 steps: the S-independent work of the chunk in
//                    parallel, then a barrier-free recurrence per thread; a checkpoint of (S, theta, k~, v)
//                    every kChunk steps for the backward;
//   m3_bwd_kernel    per (b, h), chunks last to first: recompute the chunk from its checkpoint (S_t kept per
//                    thread in a register array), then reverse with G = dL/dS in registers; per-step
//                    head results go to dzxbc, the heads' shares of the B / C / angle gradients to a
//                    [B, T, H, 2N + R] buffer, per-(b, h) parameter partials to a buffer;
//   m3_rows_kernel   per (b, t): the heads' shares summed, RMSNorm / tanh backward, per-row norm partials;
//   m3_reduce_kernel the parameter gradients summed in a fixed order (no atomics: bit-reproducible, so a
//                    CUDA graph replays the eager numbers exactly) and added into the caller's tensors.
// Not parallel over T: each (b, h) sequence is walked by one block (B H blocks of P N threads).
#include "ops.h"

#include <cstdint>

namespace mrl {
namespace {

constexpr int kChunk = 16;  // checkpoint interval; the backward keeps a chunk's S_t in registers
constexpr float kPi = 3.14159265358979323846f;
constexpr float kTwoPi = 6.28318530717958647692f;
enum { SC_DT, SC_DSP, SC_A, SC_DADD, SC_ALPHA, SC_LAM, SC_CPREV, SC_CCUR, kScal };

__device__ __forceinline__ float sigmoidf_(float v) { return 1.0f / (1.0f + expf(-v)); }
__device__ __forceinline__ float softplus_(float v, float* d) {
  if (v > 20.0f) { *d = 1.0f; return v; }
  *d = sigmoidf_(v);
  return log1pf(expf(v));
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// sum over the N lanes of a segment (N a power of two <= 32, segments aligned)
__device__ __forceinline__ float seg_sum(float v, int N) {
  for (int o = N >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ const float* row_ptr(const M3Params& a, int b, int t) {
  return a.zxbc + (int64_t)b * a.z_sb + (int64_t)t * a.z_st;
}
__device__ __forceinline__ bool is_start(const M3Params& a, int b, int t) {
  return a.starts && a.starts[(int64_t)b * a.T + t];
}

// A = min(-f(dA), -A_floor) with f the heavy tail or softplus; *dadd = dA/d(dA) (0 where clamped)
__device__ __forceinline__ float decay_rate(const M3Params& a, float dA, float* dadd) {
  float f, fp;
  if (a.heavy_tail) {
    // min(dA, 0) and max(dA, 0) that keep a NaN a NaN, as torch's clamps do (fminf / fmaxf return the 0)
    const float lo = dA > 0.0f ? 0.0f : dA;
    f = (dA < 0.0f ? 0.0f : dA) + 1.0f / (1.0f - lo);
    fp = (dA >= 0.0f ? 1.0f : 0.0f) + (dA <= 0.0f ? 1.0f / ((1.0f - lo) * (1.0f - lo)) : 0.0f);
  } else {
    f = softplus_(dA, &fp);
  }
  const float negf = -f, cap = -a.A_floor;
  const bool clamped = negf > cap;
  *dadd = clamped ? 0.0f : -fp;
  return clamped ? cap : negf;
}

// Warp 0, one step of head h: coefficients into sc[kScal], k~ / q~ into kr / qr [N], the angle th [R]
// advanced (zeroed first on a reset), and cos / sin / pi tanh(ang) into cs / sn / ta [R] when given.
// kb / qb [N] are scratch. On a reset kp [N] and vp [P] are zeroed too.
__device__ void head_prep(const M3Params& a, int h, const float* row, bool reset, float* sc, float* kr, float* qr,
                          float* th, float* kp, float* vp, float* kb, float* qb, float* cs, float* sn, float* ta) {
  const int lane = threadIdx.x, H = a.H, P = a.P, N = a.N, R = a.R, di = H * P;
  const float* Bp = row + 2 * di;
  const float* Cp = Bp + N;
  const float* hs = Cp + N;
  const float* ang = hs + 3 * H;
  if (reset) {
    if (lane < N) kp[lane] = 0.0f;
    if (lane < R) th[lane] = 0.0f;
    for (int p = lane; p < P; p += 32) vp[p] = 0.0f;
  }
  const float bv = lane < N ? Bp[lane] : 0.0f, cv = lane < N ? Cp[lane] : 0.0f;
  const float rb = rsqrtf(warp_sum(bv * bv) / (float)N + a.eps);
  const float rc = rsqrtf(warp_sum(cv * cv) / (float)N + a.eps);
  float dt = 0.0f;
  {
    float dsp;
    dt = softplus_(hs[h] + a.dt_bias[h], &dsp);
    if (lane == 0) {
      float dadd;
      const float A = decay_rate(a, hs[H + h], &dadd);
      const float alpha = expf(A * dt);
      const float lam = sigmoidf_(hs[2 * H + h]);
      sc[SC_DT] = dt; sc[SC_DSP] = dsp; sc[SC_A] = A; sc[SC_DADD] = dadd;
      sc[SC_ALPHA] = alpha; sc[SC_LAM] = lam; sc[SC_CPREV] = (1.0f - lam) * dt * alpha; sc[SC_CCUR] = lam * dt;
    }
  }
  if (lane < N) {
    kb[lane] = bv * rb * a.B_w[lane] + a.B_bias[(int64_t)h * N + lane];
    qb[lane] = cv * rc * a.C_w[lane] + a.C_bias[(int64_t)h * N + lane];
  }
  __syncwarp();
  if (lane < R) {
    const float tav = kPi * tanhf(ang[lane]);
    float t = th[lane] + tav * dt;
    t = t - kTwoPi * floorf(t / kTwoPi);
    th[lane] = t;
    float s, c;
    sincosf(t, &s, &c);
    const float k0 = kb[2 * lane], k1 = kb[2 * lane + 1], q0 = qb[2 * lane], q1 = qb[2 * lane + 1];
    kr[2 * lane] = k0 * c - k1 * s;
    kr[2 * lane + 1] = k0 * s + k1 * c;
    qr[2 * lane] = q0 * c - q1 * s;
    qr[2 * lane + 1] = q0 * s + q1 * c;
    if (cs) { cs[lane] = c; sn[lane] = s; ta[lane] = tav; }
  }
  if (lane >= 2 * R && lane < N) {
    kr[lane] = kb[lane];
    qr[lane] = qb[lane];
  }
}

// One warp (lane = its lane): the gate of one step: out[p] = y[p] SiLU(z[p]) or RMSNorm_P(y) w SiLU(z)
__device__ void head_gate(const M3Params& a, int h, int lane, const float* z, const float* y, float* out) {
  const int P = a.P;
  float r = 1.0f;
  const float* w = a.out_w ? a.out_w + (int64_t)h * P : nullptr;
  if (w) {
    float ss = 0.0f;
    for (int p = lane; p < P; p += 32) ss += y[p] * y[p];
    r = rsqrtf(warp_sum(ss) / (float)P + a.eps);
  }
  for (int p = lane; p < P; p += 32) {
    const float sz = z[p] * sigmoidf_(z[p]);
    out[p] = w ? y[p] * r * w[p] * sz : y[p] * sz;
  }
}

// The forward walks T in chunks of L steps (L = fwd_chunk_steps: 32 where the shared memory allows). Per
// chunk: (A) each warp prepares whole steps of the chunk in parallel (dt / alpha / lambda, the normed k / q,
// pi tanh(ang), x), none of which depends on S; (B) R threads advance the angle through the chunk (a prefix
// with resets) and (C) the block rotates every step's k / q; (D) every thread runs the recurrence of its S
// entry through the chunk from shared memory, with no barrier inside (the read-out over n is a segment
// shuffle); (E) each warp gates whole steps. Five barriers per chunk instead of four per step.
enum { FS_ALPHA, FS_CPREV, FS_CCUR, FS_RESET, FS_DT, kFS };
// shared memory of the forward (floats): carries th R, kp N, vp P; per step kr N, qr N, x P, y P, scalars
// kFS, pi tanh(ang) R, the angle after the step R
__host__ __device__ inline int fwd_step_floats(int P, int N, int R) { return 2 * N + 2 * P + kFS + 2 * R; }
__host__ __device__ inline int fwd_smem_floats(int P, int N, int R, int L) {
  return R + N + P + L * fwd_step_floats(P, N, R);
}
inline int fwd_chunk_steps(int P, int N, int R) {
  int L = 32;
  while (L > 1 && sizeof(float) * fwd_smem_floats(P, N, R, L) > 48 * 1024) L >>= 1;
  return L;
}

__global__ void __launch_bounds__(1024) m3_fwd_kernel(M3Params a, int L) {
  extern __shared__ float sm[];
  const int H = a.H, P = a.P, N = a.N, R = a.R, T = a.T, di = H * P, CW = R + N + P;
  const int b = blockIdx.x / H, h = blockIdx.x % H, tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  const int pp = tid / N, nn = tid % N;
  const bool active = tid < P * N;
  const int nC = (T + kChunk - 1) / kChunk, CL = N * P + R + N + P;
  float* cth = sm;
  float* ckp = cth + R;
  float* cvp = ckp + N;
  float* kr = cvp + P;      // [L][N]
  float* qr = kr + L * N;   // [L][N]
  float* xs = qr + L * N;   // [L][P]
  float* ys = xs + L * P;   // [L][P]
  float* sc = ys + L * P;   // [L][kFS]
  float* ta = sc + L * kFS; // [L][R]
  float* tv = ta + L * R;   // [L][R]
  const float* c0 = a.carry0 ? a.carry0 + ((int64_t)b * H + h) * CW : nullptr;
  float S = (active && a.ssm0) ? a.ssm0[((int64_t)b * di + (int64_t)h * P + pp) * N + nn] : 0.0f;
  for (int i = tid; i < CW; i += blockDim.x) {
    const float v = c0 ? c0[i] : 0.0f;
    if (i < R) cth[i] = v; else if (i < R + N) ckp[i - R] = v; else cvp[i - R - N] = v;
  }
  const float Dh = a.Dskip[h];
  for (int t0 = 0; t0 < T; t0 += L) {
    const int Lc = min(L, T - t0);
    __syncthreads();  // the previous chunk's carries and gates are done with the step arrays
    // (A) the steps of the chunk, a warp per step
    for (int j = warp; j < Lc; j += nw) {
      const int t = t0 + j;
      const float* row = row_ptr(a, b, t);
      const float* Bp = row + 2 * di;
      const float* Cp = Bp + N;
      const float* hs = Cp + N;
      const float* ang = hs + 3 * H;
      const float bv = lane < N ? Bp[lane] : 0.0f, cv = lane < N ? Cp[lane] : 0.0f;
      const float rb = rsqrtf(warp_sum(bv * bv) / (float)N + a.eps);
      const float rc = rsqrtf(warp_sum(cv * cv) / (float)N + a.eps);
      float dsp;
      const float dt = softplus_(hs[h] + a.dt_bias[h], &dsp);
      if (lane == 0) {
        float dadd;
        const float A = decay_rate(a, hs[H + h], &dadd);
        const float alpha = expf(A * dt);
        const float lam = sigmoidf_(hs[2 * H + h]);
        float* s = sc + j * kFS;
        s[FS_ALPHA] = alpha; s[FS_CPREV] = (1.0f - lam) * dt * alpha; s[FS_CCUR] = lam * dt;
        s[FS_RESET] = is_start(a, b, t) ? 1.0f : 0.0f; s[FS_DT] = dt;
      }
      if (lane < N) {
        kr[j * N + lane] = bv * rb * a.B_w[lane] + a.B_bias[(int64_t)h * N + lane];
        qr[j * N + lane] = cv * rc * a.C_w[lane] + a.C_bias[(int64_t)h * N + lane];
      }
      if (lane < R) ta[j * R + lane] = kPi * tanhf(ang[lane]);
      for (int p = lane; p < P; p += 32) xs[j * P + p] = row[di + h * P + p];
    }
    __syncthreads();
    // (B) the angle through the chunk: zeroed before a start's step, then advanced by pi tanh(ang) dt mod 2 pi
    if (tid < R) {
      float th = cth[tid];
      for (int j = 0; j < Lc; ++j) {
        if (sc[j * kFS + FS_RESET] != 0.0f) th = 0.0f;
        float t = th + ta[j * R + tid] * sc[j * kFS + FS_DT];
        t = t - kTwoPi * floorf(t / kTwoPi);
        th = t;
        tv[j * R + tid] = t;
      }
    }
    __syncthreads();
    // (C) rotate the first 2R entries of every step's k and q by its angle
    for (int i = tid; i < Lc * R; i += blockDim.x) {
      const int j = i / R, r = i % R;
      float s, c;
      sincosf(tv[i], &s, &c);
      float* k = kr + j * N + 2 * r;
      float* q = qr + j * N + 2 * r;
      const float k0 = k[0], k1 = k[1], q0 = q[0], q1 = q[1];
      k[0] = k0 * c - k1 * s;
      k[1] = k0 * s + k1 * c;
      q[0] = q0 * c - q1 * s;
      q[1] = q0 * s + q1 * c;
    }
    __syncthreads();
    // (D) the recurrence of S[pp, nn] through the chunk (every thread runs it: the shuffles need full warps)
    {
      float kprev = active ? ckp[nn] : 0.0f, vprev = active ? cvp[pp] : 0.0f;
      for (int j = 0; j < Lc; ++j) {
        const int t = t0 + j;
        if (a.ckpt && t % kChunk == 0) {  // the state entering step t
          float* ck = a.ckpt + (((int64_t)b * nC + t / kChunk) * H + h) * CL;
          if (active) ck[nn * P + pp] = S;
          for (int i = tid; i < CW; i += blockDim.x)
            ck[N * P + i] = i < R ? (j ? tv[(j - 1) * R + i] : cth[i])
                          : i < R + N ? (j ? kr[(j - 1) * N + i - R] : ckp[i - R])
                                      : (j ? xs[(j - 1) * P + i - R - N] : cvp[i - R - N]);
        }
        const float* s = sc + j * kFS;
        const bool reset = s[FS_RESET] != 0.0f;
        float prod = 0.0f, xp = 0.0f;
        if (active) {
          const float krn = kr[j * N + nn];
          xp = xs[j * P + pp];
          const float kp = reset ? 0.0f : kprev, vp = reset ? 0.0f : vprev;
          S = (reset ? 0.0f : s[FS_ALPHA] * S) + s[FS_CPREV] * kp * vp + s[FS_CCUR] * krn * xp;
          prod = S * qr[j * N + nn];
          kprev = krn;
          vprev = xp;
        }
        prod = seg_sum(prod, N);
        if (active && nn == 0) ys[j * P + pp] = prod + Dh * xp;
      }
    }
    __syncthreads();
    // (E) the gates, a warp per step; the carries into the next chunk
    for (int j = warp; j < Lc; j += nw)
      head_gate(a, h, lane, row_ptr(a, b, t0 + j) + h * P, ys + j * P, a.y + ((int64_t)b * T + t0 + j) * di + (int64_t)h * P);
    for (int i = tid; i < CW; i += blockDim.x) {
      const int j = Lc - 1;
      if (i < R) cth[i] = tv[j * R + i]; else if (i < R + N) ckp[i - R] = kr[j * N + i - R]; else cvp[i - R - N] = xs[j * P + i - R - N];
    }
  }
  __syncthreads();
  float* cf = a.carry_f + ((int64_t)b * H + h) * CW;
  if (active) a.ssm_f[((int64_t)b * di + (int64_t)h * P + pp) * N + nn] = S;
  for (int i = tid; i < CW; i += blockDim.x) cf[i] = i < R ? cth[i] : (i < R + N ? ckp[i - R] : cvp[i - R - N]);
}

// shared memory of the backward (floats)
__host__ __device__ inline int bwd_smem_floats(int P, int N, int R) {
  return kChunk * (3 * N + 2 * P + 3 * R + kScal)   // chunk cache: kr, qr, kpu | vpu, dyr | cs, sn, ta | sc
         + 3 * P * N                               // reductions over p
         + R + N + P                               // running th, kp, vp
         + R + N + P                               // gth, gk, gv
         + 2 * N + 3 * P + 2 * N + R               // kb, qb, yv, gxs, gkps, dkr, dqr, dth
         + 2 + 2 * N + P;                          // parameter partials: ddt_bias, dD, dB_bias, dC_bias, dout_w
}

__global__ void __launch_bounds__(1024) m3_bwd_kernel(M3Params a, M3BwdParams g) {
  extern __shared__ float sm[];
  const int H = a.H, P = a.P, N = a.N, R = a.R, T = a.T, di = H * P, CW = R + N + P;
  const int Dp = 2 * di + 2 * N + 3 * H + R, SH = 2 * N + R, QH = 2 + 2 * N + P;
  const int b = blockIdx.x / H, h = blockIdx.x % H, tid = threadIdx.x;
  const int pp = tid / N, nn = tid % N, PN = P * N;
  const bool active = tid < PN;
  const int nC = (T + kChunk - 1) / kChunk, CL = PN + R + N + P;
  float* krC = sm;                    // [CH][N]
  float* qrC = krC + kChunk * N;      // [CH][N]
  float* kpuC = qrC + kChunk * N;     // [CH][N]
  float* vpuC = kpuC + kChunk * N;    // [CH][P]
  float* dyrC = vpuC + kChunk * P;    // [CH][P]
  float* csC = dyrC + kChunk * P;     // [CH][R]
  float* snC = csC + kChunk * R;
  float* taC = snC + kChunk * R;
  float* scC = taC + kChunk * R;      // [CH][kScal]
  float* red = scC + kChunk * kScal;  // [3][PN]
  float* th = red + 3 * PN;
  float* kp = th + R;
  float* vp = kp + N;
  float* gth = vp + P;
  float* gk = gth + R;
  float* gv = gk + N;
  float* kb = gv + P;
  float* qb = kb + N;
  float* yv = qb + N;
  float* gxs = yv + P;
  float* gkps = gxs + P;
  float* dkr = gkps + P;
  float* dqr = dkr + N;
  float* dth = dqr + N;
  float* part = dth + R;              // [QH]
  const float Dh = a.Dskip[h];
  const float* wo = a.out_w ? a.out_w + (int64_t)h * P : nullptr;
  float G = (active && g.dssm) ? g.dssm[((int64_t)b * di + (int64_t)h * P + pp) * N + nn] : 0.0f;
  const float* dc = g.dcarry ? g.dcarry + ((int64_t)b * H + h) * CW : nullptr;
  for (int i = tid; i < CW; i += blockDim.x) {
    const float v = dc ? dc[i] : 0.0f;
    if (i < R) gth[i] = v; else if (i < R + N) gk[i - R] = v; else gv[i - R - N] = v;
  }
  for (int i = tid; i < QH; i += blockDim.x) part[i] = 0.0f;
  float Shist[kChunk];
  for (int c = nC - 1; c >= 0; --c) {
    const int t0 = c * kChunk, len = min(kChunk, T - t0);
    const float* ck = g.ckpt + (((int64_t)b * nC + c) * H + h) * CL;
    float S = active ? ck[nn * P + pp] : 0.0f;
    const float Sin = S;
    __syncthreads();
    for (int i = tid; i < CW; i += blockDim.x) {
      const float v = ck[PN + i];
      if (i < R) th[i] = v; else if (i < R + N) kp[i - R] = v; else vp[i - R - N] = v;
    }
    __syncthreads();
    // ---- recompute the chunk; the gate backward (Shist is per-thread local memory, L1-resident)
    for (int i = 0; i < kChunk; ++i) {
      if (i >= len) break;
      const int t = t0 + i;
      const float* row = row_ptr(a, b, t);
      const bool reset = is_start(a, b, t);
      float* sc = scC + i * kScal;
      if (tid < 32) {
        head_prep(a, h, row, reset, sc, krC + i * N, qrC + i * N, th, kp, vp, kb, qb, csC + i * R, snC + i * R,
                  taC + i * R);
        __syncwarp();
        if (tid < N) kpuC[i * N + tid] = kp[tid];
        for (int p = tid; p < P; p += 32) vpuC[i * P + p] = vp[p];
      }
      __syncthreads();
      const float xp = active ? row[di + h * P + pp] : 0.0f;
      float prod = 0.0f;
      if (active) {
        S = (reset ? 0.0f : sc[SC_ALPHA] * S) + sc[SC_CPREV] * kp[nn] * vp[pp] + sc[SC_CCUR] * krC[i * N + nn] * xp;
        prod = S * qrC[i * N + nn];
      }
      Shist[i] = S;
      prod = seg_sum(prod, N);
      if (active && nn == 0) yv[pp] = prod + Dh * xp;
      __syncthreads();
      if (tid < 32) {
        const float* z = row + h * P;
        const float* x = row + di + h * P;
        const float* dy = g.dy + ((int64_t)b * T + t) * di + (int64_t)h * P;
        float* dzo = g.dzxbc + ((int64_t)b * T + t) * Dp + (int64_t)h * P;
        float* dyr = dyrC + i * P;
        if (wo) {
          float ss = 0.0f;
          for (int p = tid; p < P; p += 32) ss += yv[p] * yv[p];
          const float r = rsqrtf(warp_sum(ss) / (float)P + a.eps);
          float m = 0.0f;
          for (int p = tid; p < P; p += 32) {
            const float s = sigmoidf_(z[p]), sz = z[p] * s, yn = yv[p] * r;
            dzo[p] = dy[p] * yn * wo[p] * s * (1.0f + z[p] * (1.0f - s));
            part[2 + 2 * N + p] += dy[p] * yn * sz;
            const float gq = dy[p] * wo[p] * sz;
            dyr[p] = gq;
            m += gq * yn;
          }
          m = warp_sum(m) / (float)P;
          for (int p = tid; p < P; p += 32) dyr[p] = r * (dyr[p] - yv[p] * r * m);
        } else {
          for (int p = tid; p < P; p += 32) {
            const float s = sigmoidf_(z[p]);
            dyr[p] = dy[p] * z[p] * s;
            dzo[p] = dy[p] * yv[p] * s * (1.0f + z[p] * (1.0f - s));
          }
        }
        __syncwarp();
        float dDa = 0.0f;
        for (int p = tid; p < P; p += 32) dDa += dyr[p] * x[p];
        dDa = warp_sum(dDa);
        if (tid == 0) part[1] += dDa;
        if (tid < N) kp[tid] = krC[i * N + tid];
        for (int p = tid; p < P; p += 32) vp[p] = x[p];
      }
      __syncthreads();
    }
    // ---- reverse through the chunk
    for (int i = kChunk - 1; i >= 0; --i) {
      if (i >= len) continue;
      const int t = t0 + i;
      const float* row = row_ptr(a, b, t);
      const bool reset = is_start(a, b, t);
      const float* sc = scC + i * kScal;
      const float alpha = sc[SC_ALPHA], ccur = sc[SC_CCUR], cprev = sc[SC_CPREV];
      const float xp = active ? row[di + h * P + pp] : 0.0f;
      float gx = 0.0f, gkp = 0.0f, sa = 0.0f;
      if (active) {
        const float q = qrC[i * N + nn], k = krC[i * N + nn], kpn = kpuC[i * N + nn];
        const float dyrp = dyrC[i * P + pp], vpp = vpuC[i * P + pp];
        const float Gv = G + q * dyrp;
        const float Sprev = reset ? 0.0f : (i > 0 ? Shist[i - 1] : Sin);
        red[tid] = dyrp * Shist[i];
        red[PN + tid] = Gv * xp;
        red[2 * PN + tid] = Gv * vpp;
        gx = Gv * k;
        gkp = Gv * kpn;
        sa = Gv * Sprev;
        G = reset ? 0.0f : Gv * alpha;
      }
      gx = seg_sum(gx, N);
      gkp = seg_sum(gkp, N);
      sa = seg_sum(sa, N);
      if (active && nn == 0) {
        gxs[pp] = gx;
        gkps[pp] = gkp;
        yv[pp] = sa;  // dL/dalpha share of channel p
      }
      __syncthreads();
      if (tid < 32) {
        const int lane = tid;
        float sq = 0.0f, sx = 0.0f, sv = 0.0f;
        if (lane < N)
          for (int p = 0; p < P; ++p) {
            sq += red[p * N + lane];
            sx += red[PN + p * N + lane];
            sv += red[2 * PN + p * N + lane];
          }
        float dcc = 0.0f, dcp = 0.0f, gkn = 0.0f;
        if (lane < N) {
          const float k = krC[i * N + lane], kpn = kpuC[i * N + lane];
          dqr[lane] = sq;
          dkr[lane] = ccur * sx + gk[lane];
          dcc = k * sx;
          dcp = kpn * sv;
          gkn = reset ? 0.0f : cprev * sv;
        }
        dcc = warp_sum(dcc);
        dcp = warp_sum(dcp);
        float dal = 0.0f;
        for (int p = lane; p < P; p += 32) dal += yv[p];
        dal = warp_sum(dal);
        float* drow = g.dzxbc + ((int64_t)b * T + t) * Dp;
        const float* dyr = dyrC + i * P;
        for (int p = lane; p < P; p += 32) {
          drow[di + h * P + p] = Dh * dyr[p] + ccur * gxs[p] + gv[p];
          gv[p] = reset ? 0.0f : cprev * gkps[p];
        }
        __syncwarp();
        if (lane < N) gk[lane] = gkn;
        // rotation backward
        float* sh = g.shared + (((int64_t)b * T + t) * H + h) * SH;
        const float* kr = krC + i * N;
        const float* qr = qrC + i * N;
        float ddt = 0.0f;
        if (lane < R) {
          const float c0 = csC[i * R + lane], s0 = snC[i * R + lane];
          const float a0 = dkr[2 * lane], a1 = dkr[2 * lane + 1], b0 = dqr[2 * lane], b1 = dqr[2 * lane + 1];
          kb[2 * lane] = a0 * c0 + a1 * s0;
          kb[2 * lane + 1] = -a0 * s0 + a1 * c0;
          qb[2 * lane] = b0 * c0 + b1 * s0;
          qb[2 * lane + 1] = -b0 * s0 + b1 * c0;
          const float dthv = -kr[2 * lane + 1] * a0 + kr[2 * lane] * a1 - qr[2 * lane + 1] * b0 + qr[2 * lane] * b1;
          const float gt = gth[lane] + dthv;
          sh[2 * N + lane] = gt * sc[SC_DT];
          ddt = gt * taC[i * R + lane];
          gth[lane] = reset ? 0.0f : gt;
        }
        if (lane >= 2 * R && lane < N) {
          kb[lane] = dkr[lane];
          qb[lane] = dqr[lane];
        }
        ddt = warp_sum(ddt);
        __syncwarp();
        if (lane < N) {
          sh[lane] = kb[lane];
          sh[N + lane] = qb[lane];
          part[2 + lane] += kb[lane];
          part[2 + N + lane] += qb[lane];
        }
        if (lane == 0) {
          const float lam = sc[SC_LAM], A = sc[SC_A], dt = sc[SC_DT];
          ddt += dcp * (1.0f - lam) * alpha + dcc * lam;
          const float dalpha = dal + dcp * (1.0f - lam) * dt;
          const float dlam = (dcc - dcp * alpha) * dt;
          const float dadt = dalpha * alpha;
          ddt += dadt * A;
          const float dv = ddt * sc[SC_DSP];
          const int o = 2 * di + 2 * N;
          drow[o + h] = dv;
          drow[o + H + h] = dadt * dt * sc[SC_DADD];
          drow[o + 2 * H + h] = dlam * lam * (1.0f - lam);
          part[0] += dv;
        }
      }
      __syncthreads();
    }
  }
  __syncthreads();
  float* ph = g.part_h + ((int64_t)b * H + h) * QH;
  for (int i = tid; i < QH; i += blockDim.x) ph[i] = part[i];
}

// One warp per (b, t) row: the heads' shares summed, the B / C RMSNorm backward and the angle tanh backward
// into dzxbc; the row's dB_w / dC_w shares into part_bt [B T, 2N].
__global__ void m3_rows_kernel(M3Params a, M3BwdParams g) {
  const int H = a.H, P = a.P, N = a.N, R = a.R, T = a.T, di = H * P, Dp = 2 * di + 2 * N + 3 * H + R;
  const int SH = 2 * N + R;
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32;
  const int64_t rowi = (int64_t)blockIdx.x * warps + threadIdx.x / 32;
  if (rowi >= (int64_t)a.B * T) return;
  const int b = (int)(rowi / T), t = (int)(rowi % T);
  const float* row = row_ptr(a, b, t);
  const float* Bp = row + 2 * di;
  const float* Cp = Bp + N;
  const float* ang = Cp + N + 3 * H;
  float* drow = g.dzxbc + rowi * Dp;
  const float* sh = g.shared + rowi * H * SH;
  float dk = 0.0f, dq = 0.0f, dta = 0.0f;
  for (int h = 0; h < H; ++h) {
    const float* s = sh + (int64_t)h * SH;
    if (lane < N) { dk += s[lane]; dq += s[N + lane]; }
    if (lane < R) dta += s[2 * N + lane];
  }
  float* pb = g.part_bt + rowi * 2 * N;
  for (int side = 0; side < 2; ++side) {
    const float v = lane < N ? (side ? Cp[lane] : Bp[lane]) : 0.0f;
    const float w = lane < N ? (side ? a.C_w[lane] : a.B_w[lane]) : 0.0f;
    const float d = side ? dq : dk;
    const float r = rsqrtf(warp_sum(v * v) / (float)N + a.eps);
    const float gq = d * w;
    const float m = warp_sum(gq * v * r) / (float)N;
    if (lane < N) {
      drow[2 * di + side * N + lane] = r * (gq - v * r * m);
      pb[side * N + lane] = d * v * r;
    }
  }
  if (lane < R) {
    const float tv = tanhf(ang[lane]);
    drow[2 * di + 2 * N + 3 * H + lane] = dta * kPi * (1.0f - tv * tv);
  }
}

// The parameter gradients, each summed over rows in a fixed order, added into the caller's tensors.
__global__ void m3_reduce_kernel(M3Params a, M3BwdParams g) {
  const int H = a.H, P = a.P, N = a.N, di = H * P, QH = 2 + 2 * N + P;
  const int64_t BT = (int64_t)a.B * a.T;
  const int nout = 2 * H + 2 * H * N + (g.dout_w ? di : 0) + 2 * N;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= nout) return;
  float s = 0.0f;
  if (j < 2 * H + 2 * H * N + (g.dout_w ? di : 0)) {
    int h, slot;
    float* dst;
    if (j < H) { h = j; slot = 0; dst = g.ddt_bias + h; }
    else if (j < 2 * H) { h = j - H; slot = 1; dst = g.dD + h; }
    else if (j < 2 * H + H * N) { const int k = j - 2 * H; h = k / N; slot = 2 + k % N; dst = g.dB_bias + k; }
    else if (j < 2 * H + 2 * H * N) { const int k = j - 2 * H - H * N; h = k / N; slot = 2 + N + k % N; dst = g.dC_bias + k; }
    else { const int k = j - 2 * H - 2 * H * N; h = k / P; slot = 2 + 2 * N + k % P; dst = g.dout_w + k; }
    for (int b = 0; b < a.B; ++b) s += g.part_h[((int64_t)b * H + h) * QH + slot];
    *dst += s;
  } else {
    const int k = j - (2 * H + 2 * H * N + (g.dout_w ? di : 0));  // 0 .. 2N-1: dB_w then dC_w
    for (int64_t r = 0; r < BT; ++r) s += g.part_bt[r * 2 * N + k];
    if (k < N) g.dB_w[k] += s; else g.dC_w[k - N] += s;
  }
}

inline int block_threads(int P, int N) { return ((P * N + 31) / 32) * 32; }

const char* launch_err(cudaError_t e) { return e == cudaSuccess ? nullptr : cudaGetErrorString(e); }

}  // namespace

int m3_chunk() { return kChunk; }
int m3_ckpt_len(int P, int N, int R) { return N * P + R + N + P; }
int64_t m3_bwd_workspace(int B, int T, int H, int P, int N, int R) {
  return (int64_t)B * T * H * (2 * N + R) + (int64_t)B * H * (2 + 2 * N + P) + (int64_t)B * T * 2 * N;
}
const char* m3_supported(int P, int N, int R) {
  if (N < 2 || N > 32 || (N & (N - 1))) return "mamba3 (CUDA): d_state must be a power of two in [2, 32]";
  if (P * N > 1024) return "mamba3 (CUDA): headdim * d_state must be at most 1024";
  if (R < 1 || 2 * R > N) return "mamba3 (CUDA): the rotary angles must number 1 .. d_state / 2";
  return nullptr;
}

const char* m3_fwd(const M3Params& p, cudaStream_t s) {
  if (const char* e = m3_supported(p.P, p.N, p.R)) return e;
  const int thr = block_threads(p.P, p.N);
  const int L = fwd_chunk_steps(p.P, p.N, p.R);
  const size_t smem = sizeof(float) * fwd_smem_floats(p.P, p.N, p.R, L);
  m3_fwd_kernel<<<p.B * p.H, thr, smem, s>>>(p, L);
  return launch_err(cudaGetLastError());
}

const char* m3_bwd(const M3Params& p, M3BwdParams g, cudaStream_t s) {
  if (const char* e = m3_supported(p.P, p.N, p.R)) return e;
  const int thr = block_threads(p.P, p.N);
  const size_t smem = sizeof(float) * bwd_smem_floats(p.P, p.N, p.R);
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(m3_bwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return cudaGetErrorString(e);
  }
  g.shared = g.ws;
  g.part_h = g.shared + (int64_t)p.B * p.T * p.H * (2 * p.N + p.R);
  g.part_bt = g.part_h + (int64_t)p.B * p.H * (2 + 2 * p.N + p.P);
  m3_bwd_kernel<<<p.B * p.H, thr, smem, s>>>(p, g);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cudaGetErrorString(e);
  const int64_t rows = (int64_t)p.B * p.T;
  const int wpb = 8;
  m3_rows_kernel<<<(unsigned)((rows + wpb - 1) / wpb), 32 * wpb, 0, s>>>(p, g);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cudaGetErrorString(e);
  const int nout = 2 * p.H + 2 * p.H * p.N + (g.dout_w ? p.H * p.P : 0) + 2 * p.N;
  m3_reduce_kernel<<<(nout + 127) / 128, 128, 0, s>>>(p, g);
  return launch_err(cudaGetLastError());
}

}  // namespace mrl
