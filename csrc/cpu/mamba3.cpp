// Mamba-3 SISO mixer core, CPU: forward (sequence and, with T = 1 in place, the one-token step) and the
// hand-written backward, with per-row episode resets, initial and final state.
//
// Semantics (mamba_rl/ops/mamba3_ref.py, the float64 reference these kernels are tested against), for row b,
// head h, step t, from the in_proj output row [z | x | Bp | Cp | dd_dt | dd_A | trap | ang]:
//   dt = softplus(dd_dt + dt_bias),  A = min(-f(dd_A), -A_floor),  alpha = exp(A dt),  lam = sigmoid(trap)
//   theta = (theta + pi tanh(ang) dt) mod 2 pi                       [R]
//   k~ = Rot(theta) (RMSNorm(Bp) B_w + B_bias[h]),  q~ = Rot(theta) (RMSNorm(Cp) C_w + C_bias[h])   [N]
//   S = alpha S + (1 - lam) dt alpha v_prev k~_prev^T + lam dt x k~^T  [P, N]
//   y = S q~ + D x, then y SiLU(z) or RMSNorm_P(y) out_w SiLU(z)
// with f(a) = max(a, 0) + 1 / (1 - min(a, 0)) (heavy tail) or softplus(a), and Rot rotating the pairs
// (2i, 2i+1), i < R. An episode start zeroes S, theta, k~_prev, v_prev (a select: old NaNs never leak).
//
// Parallelism: one task = (row b, head h); the heads of a row share Bp / Cp / ang, so the backward writes
// their per-head gradients to a [B, T, H, 2N + R] buffer and a second pass over rows sums them and runs
// the B / C RMSNorm and tanh backward. The state is kept as S[n][p] locally, so each update, the read-out
// and every backward contraction is a loop over the P contiguous channels of a head (GCC vectorises it).
// Parameter gradients go to per-(row, head) / per-row partials summed in row order afterwards: the result
// does not depend on the thread count.
//
// Backward: the forward saves the state entering every kM3Chunk-th step (before that step's reset); per
// task, from the last chunk to the first, the chunk is recomputed from its checkpoint (the same head_step as
// the forward, so the same floats) keeping S_t and the step's vectors, then walked in reverse with
// G = dL/dS_t, and the gradients into the next step's k~_prev / v_prev / theta carried across steps.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace mrl_cpu {
namespace {

constexpr float kPi = 3.14159265358979323846f;
constexpr float kTwoPi = 6.28318530717958647692f;
// The largest d_state: a head's normalised B and C live in stack buffers of this size (the binding's
// kM3MaxState refuses a larger one).
constexpr int kMaxState = 256;

// Per-step values the backward keeps for one head (pointers into the chunk cache).
struct StepCache {
  float* S;      // [N][P] state after the step
  float* kr;     // [N] k~
  float* qr;     // [N] q~
  float* kpu;    // [N] k~_prev as used (0 after a start)
  float* vpu;    // [P] v_prev as used
  float* cs;     // [R] cos theta
  float* sn;     // [R] sin theta
  float* ta;     // [R] pi tanh(ang)
  float* yraw;   // [P] S q~ + D x (before the gate)
  float* sc;     // [kScal] scalars
};
enum { SC_DT, SC_DSP, SC_A, SC_DADD, SC_ALPHA, SC_LAM, SC_CPREV, SC_CCUR, kScal };

inline float sigmoid_s(float v) { return 1.0f / (1.0f + std::exp(-v)); }
// torch's softplus (beta 1, threshold 20) and its derivative
inline float softplus_s(float v, float* d) {
  if (v > 20.0f) { *d = 1.0f; return v; }
  *d = sigmoid_s(v);
  return std::log1p(std::exp(v));
}

inline int row_len(const M3Args& a) { return 2 * a.H * a.P + 2 * a.N + 3 * a.H + a.R; }
inline bool is_start(const M3Args& a, int b, int t) { return a.starts && a.starts[(int64_t)b * a.T + t]; }
inline const float* row_ptr(const M3Args& a, int b, int t) {
  return a.zxbc + (int64_t)b * a.z_sb + (int64_t)t * a.z_st;
}

// RMSNorm of the N entries of v with weight w: out = v rstd w; returns rstd.
inline float norm_n(const float* v, const float* w, int N, float eps, float* out) {
  float ss = 0.0f;
  for (int n = 0; n < N; ++n) ss += v[n] * v[n];
  const float r = 1.0f / std::sqrt(ss / (float)N + eps);
  for (int n = 0; n < N; ++n) out[n] = v[n] * r * w[n];
  return r;
}

// One step of head h. State (S [N][P], th [R], kp [N], vp [P]) advanced in place; the gated output into
// out [P]. c (nullable) receives what the backward needs. Local scratch: kb, qb [N].
void head_step(const M3Args& a, int h, const float* row, bool reset, float* __restrict S, float* __restrict th,
               float* __restrict kp, float* __restrict vp, float* __restrict out, const StepCache* c) {
  const int H = a.H, P = a.P, N = a.N, R = a.R, di = H * P;
  const float* z = row + h * P;
  const float* x = row + di + h * P;
  const float* Bp = row + 2 * di;
  const float* Cp = Bp + N;
  const float* hs = Cp + N;
  const float* ang = hs + 3 * H;
  if (reset) {
    std::fill(S, S + (int64_t)N * P, 0.0f);
    std::fill(th, th + R, 0.0f);
    std::fill(kp, kp + N, 0.0f);
    std::fill(vp, vp + P, 0.0f);
  }
  float dsp;
  const float dt = softplus_s(hs[h] + a.dt_bias[h], &dsp);
  const float dA = hs[H + h];
  float f, fp;
  if (a.heavy_tail) {
    // min(dA, 0) and max(dA, 0) that keep a NaN a NaN, as torch's clamps do (a select on dA < 0 gave 0)
    const float lo = dA > 0.0f ? 0.0f : dA;
    f = (dA < 0.0f ? 0.0f : dA) + 1.0f / (1.0f - lo);
    fp = (dA >= 0.0f ? 1.0f : 0.0f) + (dA <= 0.0f ? 1.0f / ((1.0f - lo) * (1.0f - lo)) : 0.0f);
  } else {
    f = softplus_s(dA, &fp);
  }
  const float negf = -f, cap = -a.A_floor;
  const bool clamped = negf > cap;  // torch.clamp(max=cap): the gradient passes where negf <= cap
  const float A = clamped ? cap : negf;
  const float alpha = std::exp(A * dt);
  const float lam = sigmoid_s(hs[2 * H + h]);
  const float cprev = (1.0f - lam) * dt * alpha, ccur = lam * dt;
  float kb[kMaxState], qb[kMaxState];
  norm_n(Bp, a.B_w, N, a.eps, kb);
  norm_n(Cp, a.C_w, N, a.eps, qb);
  const float* bb = a.B_bias + (int64_t)h * N;
  const float* cb = a.C_bias + (int64_t)h * N;
  for (int n = 0; n < N; ++n) {
    kb[n] += bb[n];
    qb[n] += cb[n];
  }
  float* kr = c ? c->kr : kb;  // rotated in place when nothing is cached
  float* qr = c ? c->qr : qb;
  for (int i = 0; i < R; ++i) {
    const float ta = kPi * std::tanh(ang[i]);
    float t = th[i] + ta * dt;
    t = t - kTwoPi * std::floor(t / kTwoPi);
    th[i] = t;
    const float cs = std::cos(t), sn = std::sin(t);
    const float k0 = kb[2 * i], k1 = kb[2 * i + 1], q0 = qb[2 * i], q1 = qb[2 * i + 1];
    kr[2 * i] = k0 * cs - k1 * sn;
    kr[2 * i + 1] = k0 * sn + k1 * cs;
    qr[2 * i] = q0 * cs - q1 * sn;
    qr[2 * i + 1] = q0 * sn + q1 * cs;
    if (c) {
      c->cs[i] = cs;
      c->sn[i] = sn;
      c->ta[i] = ta;
    }
  }
  if (c)
    for (int n = 2 * R; n < N; ++n) {
      kr[n] = kb[n];
      qr[n] = qb[n];
    }
  float* y = c ? c->yraw : out;
  const float Dh = a.Dskip[h];
#pragma omp simd
  for (int p = 0; p < P; ++p) y[p] = Dh * x[p];
  for (int n = 0; n < N; ++n) {
    const float ck = cprev * kp[n], cc = ccur * kr[n], q = qr[n];
    float* Sn = S + (int64_t)n * P;
#pragma omp simd
    for (int p = 0; p < P; ++p) {
      const float v = alpha * Sn[p] + ck * vp[p] + cc * x[p];
      Sn[p] = v;
      y[p] += v * q;
    }
  }
  if (c) {
    std::copy(S, S + (int64_t)N * P, c->S);
    std::copy(kp, kp + N, c->kpu);
    std::copy(vp, vp + P, c->vpu);
    float* s = c->sc;
    s[SC_DT] = dt; s[SC_DSP] = dsp; s[SC_A] = A; s[SC_DADD] = clamped ? 0.0f : -fp;
    s[SC_ALPHA] = alpha; s[SC_LAM] = lam; s[SC_CPREV] = cprev; s[SC_CCUR] = ccur;
  }
  std::copy(kr, kr + N, kp);
  std::copy(x, x + P, vp);
  if (!out) return;
  // the gate: y SiLU(z), or the per-head gated RMSNorm
  float r = 1.0f;
  if (a.out_w) {
    float ss = 0.0f;
    for (int p = 0; p < P; ++p) ss += y[p] * y[p];
    r = 1.0f / std::sqrt(ss / (float)P + a.eps);
  }
  const float* w = a.out_w ? a.out_w + (int64_t)h * P : nullptr;
  for (int p = 0; p < P; ++p) {
    const float sz = z[p] * sigmoid_s(z[p]);
    out[p] = w ? y[p] * r * w[p] * sz : y[p] * sz;
  }
}

// state (carry [R+N+P] and ssm [P][N] of one (row, head)) -> local (S [N][P], th, kp, vp); null: zeros
void load_state(const float* carry, const float* ssm, int P, int N, int R, float* S, float* th, float* kp,
                float* vp) {
  for (int p = 0; p < P; ++p)
    for (int n = 0; n < N; ++n) S[(int64_t)n * P + p] = ssm ? ssm[(int64_t)p * N + n] : 0.0f;
  for (int i = 0; i < R; ++i) th[i] = carry ? carry[i] : 0.0f;
  for (int n = 0; n < N; ++n) kp[n] = carry ? carry[R + n] : 0.0f;
  for (int p = 0; p < P; ++p) vp[p] = carry ? carry[R + N + p] : 0.0f;
}
void store_state(float* carry, float* ssm, int P, int N, int R, const float* S, const float* th, const float* kp,
                 const float* vp) {
  for (int p = 0; p < P; ++p)
    for (int n = 0; n < N; ++n) ssm[(int64_t)p * N + n] = S[(int64_t)n * P + p];
  std::copy(th, th + R, carry);
  std::copy(kp, kp + N, carry + R);
  std::copy(vp, vp + P, carry + R + N);
}

// Threads for ntask tasks of `work` state updates (P N multiply-adds) in all: one below kMinWork, where an
// OpenMP team's start and barrier (tens of microseconds, far more on a machine whose cores are busy with
// other processes) would cost more than the work itself; the one-token step of a small model is that case.
constexpr int64_t kMinWork = 1 << 15;
inline int threads_for(int nthreads, int64_t ntask, int64_t work) {
  if (work < kMinWork) return 1;
  return (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, ntask));
}

}  // namespace

void m3_fwd(const M3Args& a, float* y, float* carry_f, float* ssm_f, float* ckpt) {
  const int H = a.H, P = a.P, N = a.N, R = a.R, T = a.T, di = H * P;
  const int nC = (T + kM3Chunk - 1) / kM3Chunk, CL = m3_ckpt_len(P, N, R), CW = R + N + P;
  const int64_t ntask = (int64_t)a.B * H;
  const int nt = threads_for(a.nthreads, ntask, ntask * T * (int64_t)(N * P + N + P));
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    std::vector<float> buf((size_t)CL);
    float* S = buf.data();
    float* th = S + (int64_t)N * P;
    float* kp = th + R;
    float* vp = kp + N;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < ntask; ++task) {
      const int b = (int)(task / H), h = (int)(task % H);
      load_state(a.carry0 ? a.carry0 + ((int64_t)b * H + h) * CW : nullptr,
                 a.ssm0 ? a.ssm0 + ((int64_t)b * di + (int64_t)h * P) * N : nullptr, P, N, R, S, th, kp, vp);
      for (int t = 0; t < T; ++t) {
        if (ckpt && t % kM3Chunk == 0)
          std::copy(S, S + CL, ckpt + (((int64_t)b * nC + t / kM3Chunk) * H + h) * CL);
        head_step(a, h, row_ptr(a, b, t), is_start(a, b, t), S, th, kp, vp,
                  y + ((int64_t)b * T + t) * di + (int64_t)h * P, nullptr);
      }
      store_state(carry_f + ((int64_t)b * H + h) * CW, ssm_f + ((int64_t)b * di + (int64_t)h * P) * N, P, N, R,
                  S, th, kp, vp);
    }
  }
}

void m3_bwd(const M3Args& a, const M3BwdArgs& g) {
  const int H = a.H, P = a.P, N = a.N, R = a.R, T = a.T, Bsz = a.B, di = H * P, Dp = row_len(a);
  const int NP = N * P, nC = (T + kM3Chunk - 1) / kM3Chunk, CL = m3_ckpt_len(P, N, R), CW = R + N + P;
  const int SH = 2 * N + R;         // per (row, step, head): d(k~ before rotation), d(q~ ...), d(pi tanh ang)
  const int QH = 2 + 2 * N + P;     // per (row, head) partials: ddt_bias, dD, dB_bias [N], dC_bias [N], dout_w [P]
  std::vector<float> shared((size_t)Bsz * T * H * SH);
  std::vector<float> part_h((size_t)Bsz * H * QH, 0.0f);
  std::vector<float> part_b((size_t)Bsz * 2 * N, 0.0f);  // dB_w, dC_w per row
  const int64_t ntask = (int64_t)Bsz * H;
  const int nt = threads_for(a.nthreads, ntask, 3 * ntask * T * (int64_t)(NP + N + P));
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int CH = kM3Chunk;
    // chunk cache per step: S [NP], kr, qr, kpu [N], vpu, yraw, dyraw [P], cs, sn, ta [R], scalars
    const int per = NP + 3 * N + 3 * P + 3 * R + kScal;
    std::vector<float> cache((size_t)CH * per);
    std::vector<float> loc((size_t)CL * 2 + NP + R + N + P + 4 * N + 4 * P + 2 * R);
    float* S = loc.data();           // running state (CL floats: S, th, kp, vp)
    float* Sin = S + CL;             // state entering the chunk (CL floats)
    float* G = Sin + CL;             // [N][P] dL/dS
    float* gth = G + NP;             // [R]  dL/dtheta from the later steps
    float* gk = gth + R;             // [N]  dL/dk~_t through the next step's k~_prev (and dfinal)
    float* gv = gk + N;              // [P]  dL/dx_t through the next step's v_prev (and dfinal)
    float* gx = gv + P;              // [P]
    float* gkp = gx + P;             // [P]
    float* dxv = gkp + P;            // [P]
    float* dyg = dxv + P;            // [P]
    float* dkr = dyg + P;            // [N]
    float* dqr = dkr + N;            // [N]
    float* gvn = dqr + N;            // [N]
    float* scr = gvn + N;            // [N]
    float* dth = scr + N;            // [R]
    float* dta = dth + R;            // [R]
    auto slot = [&](int i) {
      float* base = cache.data() + (size_t)i * per;
      StepCache c;
      c.S = base; c.kr = base + NP; c.qr = c.kr + N; c.kpu = c.qr + N; c.vpu = c.kpu + N; c.yraw = c.vpu + P;
      c.cs = c.yraw + 2 * P; c.sn = c.cs + R; c.ta = c.sn + R; c.sc = c.ta + R;
      return c;
    };
#pragma omp for schedule(static)
    for (int64_t task = 0; task < ntask; ++task) {
      const int b = (int)(task / H), h = (int)(task % H);
      float* ph = part_h.data() + ((int64_t)b * H + h) * QH;
      const float Dh = a.Dskip[h];
      const float* wo = a.out_w ? a.out_w + (int64_t)h * P : nullptr;
      // dL/d(final state)
      if (g.dssm) {
        const float* src = g.dssm + ((int64_t)b * di + (int64_t)h * P) * N;
        for (int p = 0; p < P; ++p)
          for (int n = 0; n < N; ++n) G[(int64_t)n * P + p] = src[(int64_t)p * N + n];
      } else {
        std::fill(G, G + NP, 0.0f);
      }
      const float* dc = g.dcarry ? g.dcarry + ((int64_t)b * H + h) * CW : nullptr;
      for (int i = 0; i < R; ++i) gth[i] = dc ? dc[i] : 0.0f;
      for (int n = 0; n < N; ++n) gk[n] = dc ? dc[R + n] : 0.0f;
      for (int p = 0; p < P; ++p) gv[p] = dc ? dc[R + N + p] : 0.0f;
      for (int c = nC - 1; c >= 0; --c) {
        const int t0 = c * CH, len = std::min(CH, T - t0);
        const float* ck = g.ckpt + (((int64_t)b * nC + c) * H + h) * CL;
        std::copy(ck, ck + CL, S);
        std::copy(ck, ck + CL, Sin);
        // ---- recompute the chunk; the gate's backward (it needs no later step)
        for (int i = 0; i < len; ++i) {
          const int t = t0 + i;
          const StepCache cs = slot(i);
          const float* row = row_ptr(a, b, t);
          head_step(a, h, row, is_start(a, b, t), S, S + NP, S + NP + R, S + NP + R + N, nullptr, &cs);
          const float* z = row + h * P;
          const float* x = row + di + h * P;
          const float* dy = g.dy + ((int64_t)b * T + t) * di + (int64_t)h * P;
          float* dzo = g.dzxbc + ((int64_t)b * T + t) * Dp + (int64_t)h * P;
          float* dyr = cs.yraw + P;
          const float* yr = cs.yraw;
          if (wo) {
            float ss = 0.0f;
            for (int p = 0; p < P; ++p) ss += yr[p] * yr[p];
            const float r = 1.0f / std::sqrt(ss / (float)P + a.eps);
            float m = 0.0f;
            for (int p = 0; p < P; ++p) {
              const float s = sigmoid_s(z[p]), sz = z[p] * s, yn = yr[p] * r;
              dzo[p] = dy[p] * yn * wo[p] * s * (1.0f + z[p] * (1.0f - s));
              ph[2 + 2 * N + p] += dy[p] * yn * sz;
              dyg[p] = dy[p] * wo[p] * sz;
              m += dyg[p] * yn;
            }
            m /= (float)P;
            for (int p = 0; p < P; ++p) dyr[p] = r * (dyg[p] - yr[p] * r * m);
          } else {
            for (int p = 0; p < P; ++p) {
              const float s = sigmoid_s(z[p]);
              dyr[p] = dy[p] * z[p] * s;
              dzo[p] = dy[p] * yr[p] * s * (1.0f + z[p] * (1.0f - s));
            }
          }
          float dDa = 0.0f;
          for (int p = 0; p < P; ++p) dDa += dyr[p] * x[p];
          ph[1] += dDa;
        }
        // ---- reverse through the chunk
        for (int i = len - 1; i >= 0; --i) {
          const int t = t0 + i;
          const bool reset = is_start(a, b, t);
          const StepCache cs = slot(i);
          const float* row = row_ptr(a, b, t);
          const float* x = row + di + h * P;
          const float* dyr = cs.yraw + P;
          const float* prev = reset ? nullptr : (i > 0 ? slot(i - 1).S : Sin);
          const float* sc = cs.sc;
          const float alpha = sc[SC_ALPHA], ccur = sc[SC_CCUR], cprev = sc[SC_CPREV];
          float dcc = 0.0f, dcp = 0.0f, dal = 0.0f;
          std::fill(gx, gx + P, 0.0f);
          std::fill(gkp, gkp + P, 0.0f);
          for (int n = 0; n < N; ++n) {
            const float q = cs.qr[n], k = cs.kr[n], kpn = cs.kpu[n];
            float* __restrict Gn = G + (int64_t)n * P;
            const float* __restrict St = cs.S + (int64_t)n * P;
            const float* __restrict vpu = cs.vpu;
            float* __restrict gxr = gx;
            float* __restrict gkr = gkp;
            float sq = 0.0f, sx = 0.0f, sv = 0.0f, sa = 0.0f;
            if (prev) {  // two loops, not a branch inside one: GCC vectorises both
              const float* __restrict Pn = prev + (int64_t)n * P;
#pragma omp simd reduction(+ : sq, sx, sv, sa)
              for (int p = 0; p < P; ++p) {
                const float gvv = Gn[p] + q * dyr[p];
                sq += dyr[p] * St[p];
                sx += gvv * x[p];
                sv += gvv * vpu[p];
                sa += gvv * Pn[p];
                gxr[p] += gvv * k;
                gkr[p] += gvv * kpn;
                Gn[p] = gvv * alpha;  // prev is set: no episode start at t
              }
            } else {
#pragma omp simd reduction(+ : sq, sx, sv)
              for (int p = 0; p < P; ++p) {
                const float gvv = Gn[p] + q * dyr[p];
                sq += dyr[p] * St[p];
                sx += gvv * x[p];
                sv += gvv * vpu[p];
                gxr[p] += gvv * k;
                gkr[p] += gvv * kpn;
                // a select, not a product with 0: at an episode start no gradient (a NaN / inf one neither)
                // reaches the previous episode, as in the reference and the CUDA kernel
                Gn[p] = reset ? 0.0f : gvv * alpha;
              }
            }
            dqr[n] = sq;
            dkr[n] = ccur * sx + gk[n];
            dcc += k * sx;
            dcp += kpn * sv;
            dal += sa;
            gvn[n] = reset ? 0.0f : cprev * sv;
          }
          float* drow = g.dzxbc + ((int64_t)b * T + t) * Dp;
          for (int p = 0; p < P; ++p) {
            drow[di + h * P + p] = Dh * dyr[p] + ccur * gx[p] + gv[p];
            gv[p] = reset ? 0.0f : cprev * gkp[p];
          }
          std::copy(gvn, gvn + N, gk);
          // rotation backward: d(pre-rotation k~, q~) = Rot^T d, dtheta
          float* sh = shared.data() + (((int64_t)b * T + t) * H + h) * SH;
          float* dkb = sh;
          float* dqb = sh + N;
          for (int i2 = 0; i2 < R; ++i2) {
            const float c0 = cs.cs[i2], s0 = cs.sn[i2];
            const float a0 = dkr[2 * i2], a1 = dkr[2 * i2 + 1], b0 = dqr[2 * i2], b1 = dqr[2 * i2 + 1];
            dkb[2 * i2] = a0 * c0 + a1 * s0;
            dkb[2 * i2 + 1] = -a0 * s0 + a1 * c0;
            dqb[2 * i2] = b0 * c0 + b1 * s0;
            dqb[2 * i2 + 1] = -b0 * s0 + b1 * c0;
            dth[i2] = -cs.kr[2 * i2 + 1] * a0 + cs.kr[2 * i2] * a1 - cs.qr[2 * i2 + 1] * b0 + cs.qr[2 * i2] * b1;
          }
          for (int n = 2 * R; n < N; ++n) {
            dkb[n] = dkr[n];
            dqb[n] = dqr[n];
          }
          const float dt = sc[SC_DT], lam = sc[SC_LAM], A = sc[SC_A];
          float ddt = 0.0f;
          for (int i2 = 0; i2 < R; ++i2) {
            const float gt = gth[i2] + dth[i2];
            sh[2 * N + i2] = gt * dt;  // d(pi tanh ang)
            ddt += gt * cs.ta[i2];
            gth[i2] = reset ? 0.0f : gt;
          }
          // coefficients: cprev = (1 - lam) dt alpha, ccur = lam dt, alpha = exp(A dt)
          ddt += dcp * (1.0f - lam) * alpha + dcc * lam;
          const float dalpha = dal + dcp * (1.0f - lam) * dt;
          const float dlam = (dcc - dcp * alpha) * dt;
          const float dadt = dalpha * alpha;
          ddt += dadt * A;
          const float dAv = dadt * dt;
          const float dv = ddt * sc[SC_DSP];
          const int o = 2 * di + 2 * N;
          drow[o + h] = dv;
          drow[o + H + h] = dAv * sc[SC_DADD];
          drow[o + 2 * H + h] = dlam * lam * (1.0f - lam);
          ph[0] += dv;
          for (int n = 0; n < N; ++n) {
            ph[2 + n] += dkb[n];
            ph[2 + N + n] += dqb[n];
          }
        }
      }
    }
    // ---- per (row, step): sum the heads' d(k~), d(q~), d(angle term); RMSNorm and tanh backward
#pragma omp for schedule(static)
    for (int b = 0; b < Bsz; ++b) {
      float* pb = part_b.data() + (int64_t)b * 2 * N;
      for (int t = 0; t < T; ++t) {
        const float* row = row_ptr(a, b, t);
        const float* Bp = row + 2 * di;
        const float* Cp = Bp + N;
        const float* ang = Cp + N + 3 * H;
        float* drow = g.dzxbc + ((int64_t)b * T + t) * Dp;
        const float* sh = shared.data() + ((int64_t)b * T + t) * H * SH;
        std::fill(dkr, dkr + N, 0.0f);
        std::fill(dqr, dqr + N, 0.0f);
        std::fill(dta, dta + R, 0.0f);
        for (int h = 0; h < H; ++h) {
          const float* s = sh + (int64_t)h * SH;
          for (int n = 0; n < N; ++n) {
            dkr[n] += s[n];
            dqr[n] += s[N + n];
          }
          for (int i = 0; i < R; ++i) dta[i] += s[2 * N + i];
        }
        for (int side = 0; side < 2; ++side) {
          const float* v = side ? Cp : Bp;
          const float* w = side ? a.C_w : a.B_w;
          const float* d = side ? dqr : dkr;
          float ss = 0.0f;
          for (int n = 0; n < N; ++n) ss += v[n] * v[n];
          const float r = 1.0f / std::sqrt(ss / (float)N + a.eps);
          float m = 0.0f;
          for (int n = 0; n < N; ++n) {
            scr[n] = d[n] * w[n];
            m += scr[n] * v[n] * r;
            pb[side * N + n] += d[n] * v[n] * r;
          }
          m /= (float)N;
          float* out = drow + 2 * di + side * N;
          for (int n = 0; n < N; ++n) out[n] = r * (scr[n] - v[n] * r * m);
        }
        float* dang = drow + 2 * di + 2 * N + 3 * H;
        for (int i = 0; i < R; ++i) {
          const float th = std::tanh(ang[i]);
          dang[i] = dta[i] * kPi * (1.0f - th * th);
        }
      }
    }
  }
  // ---- parameter gradients, summed in row order
  for (int b = 0; b < Bsz; ++b) {
    for (int h = 0; h < H; ++h) {
      const float* ph = part_h.data() + ((int64_t)b * H + h) * QH;
      g.ddt_bias[h] += ph[0];
      g.dD[h] += ph[1];
      for (int n = 0; n < N; ++n) {
        g.dB_bias[(int64_t)h * N + n] += ph[2 + n];
        g.dC_bias[(int64_t)h * N + n] += ph[2 + N + n];
      }
      if (g.dout_w)
        for (int p = 0; p < P; ++p) g.dout_w[(int64_t)h * P + p] += ph[2 + 2 * N + p];
    }
    const float* pb = part_b.data() + (int64_t)b * 2 * N;
    for (int n = 0; n < N; ++n) {
      g.dB_w[n] += pb[n];
      g.dC_w[n] += pb[N + n];
    }
  }
}

}  // namespace mrl_cpu
