// Selective scan (Mamba-1 S6) with fused softplus, D skip, SiLU(z) gate and per-row resets, CPU.
//
// Forward: one task = (row b, block of kLanes channels); the state of the block lives in a local
// s[N][kLanes] buffer (d_state-major so every update is a full vector over the channel lanes). Per step:
// delta and SiLU(z) for the lanes, then for each n one vector of exp(delta * A[:, n]) (computed once per
// (t, d, n)), the state update and the C contraction. ckpt[b, c, d, :] saves the state entering step
// c * kScanChunk (before that step's reset), so the backward can restart the recurrence at any chunk.
//
// Backward, per task and chunk, from the last chunk to the first:
//   recompute: rerun the chunk from its checkpoint, keeping s_t and exp(delta_t A) of every step in a
//     kScanChunk x N x kLanes buffer (L2-resident), and everything that needs no reverse-time gradient:
//     dz_t, dq_t = dout_t * SiLU(z_t) (= dL/dy_t), dD, and dC[t, n] = sum_d dq_t s_t[n];
//   reverse: h = dL/ds_t (carried across chunks, seeded with dfinal) gets dq_t C_t[n], then
//     d(delta) += h s_{t-1} e_t A + h x B,  dA += h s_{t-1} e_t delta,  dx += h delta B,
//     dB[t, n] = sum_d h delta x,  and h <- e_t h (0 across a start: select, not multiply).
// With e_t = exp(delta_t A) and s_{t-1} := 0 after a start. dA_log = dA * A (A = -exp(A_log)),
// ddt = d(delta) * sigmoid(dt + dt_bias) = ddt_bias contributions.
//
// Reductions: dB / dC sum over channels, so tasks that share a row but own different channel groups write
// per-group partials that are summed afterwards; dA_log / dD / ddt_bias sum over rows through per-row
// partials. Both are summed in a fixed order (reproducible for a given thread count).
// On AVX-512 machines GCC's -march=native tuning (e.g. rocketlake, icelake) prefers 256-bit vectors; the
// kernels' lane loops are exp/FMA-bound, and full 512-bit vectors run them measurably faster there
// (benchmarks/NOTES.md, CPU section). No effect on a target without AVX-512.
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif
#include "kernels.h"

#include <algorithm>
#include <vector>

namespace mrl_cpu {
namespace {

inline int num_blocks(int D) { return (D + kLanes - 1) / kLanes; }

// A^T for one channel block: At[n][j] = -exp(A_log[d0+j, n]) (0 in the padded lanes).
void load_A(float* At, const float* A_log, int N, int d0, int nd) {
  for (int n = 0; n < N; ++n)
    for (int j = 0; j < kLanes; ++j) At[n * kLanes + j] = j < nd ? -std::exp(A_log[(int64_t)(d0 + j) * N + n]) : 0.0f;
}

// state [.., D, N] (d_state contiguous) <-> s[N][kLanes]
void gather_state(float* s, const float* src, int D, int N, int d0, int nd) {
  for (int n = 0; n < N; ++n)
    for (int j = 0; j < kLanes; ++j) s[n * kLanes + j] = (src && j < nd) ? src[(int64_t)(d0 + j) * N + n] : 0.0f;
  (void)D;
}
void scatter_state(float* dst, const float* s, int N, int d0, int nd) {
  for (int j = 0; j < nd; ++j)
    for (int n = 0; n < N; ++n) dst[(int64_t)(d0 + j) * N + n] = s[n * kLanes + j];
}

inline bool is_start(const ScanFwdArgs& a, int b, int t) { return a.starts && a.starts[(int64_t)b * a.T + t]; }

// ---- per-step lane helpers (vectorised over the kLanes channels of a block; see MRL_NOINLINE) ----

// s[n] = exp(delta A[n]) s[n] + dx B[n];  y = sum_n s[n] C[n].  When E / S are given, also keep
// E[n] = exp(delta A[n]) and S[n] = s[n] for the backward.
MRL_NOINLINE void step_state(float* __restrict s, float* __restrict y, float* __restrict E, float* __restrict S,
                             const float* __restrict At, const float* __restrict delta, const float* __restrict dx,
                             const float* __restrict Bp, const float* __restrict Cp, int N) {
#if defined(__AVX512F__) && MRL_CPU_LANES % 16 == 0
  // the same update with exp_neg_v16 (see kernels.h): kLanes / 16 vectors, held in registers across n;
  // unaligned loads and stores (the forward's state buffer is std::vector storage)
  constexpr int V = kLanes / 16;
  __m512 dv[V], xv[V], acc[V];
  for (int v = 0; v < V; ++v) {
    dv[v] = _mm512_loadu_ps(delta + 16 * v);
    xv[v] = _mm512_loadu_ps(dx + 16 * v);
    acc[v] = _mm512_setzero_ps();
  }
  for (int n = 0; n < N; ++n) {
    const __m512 bn = _mm512_set1_ps(Bp[n]), cn = _mm512_set1_ps(Cp[n]);
    float* sn = s + n * kLanes;
    const float* an = At + n * kLanes;
    for (int v = 0; v < V; ++v) {
      const __m512 e = exp_neg_v16(_mm512_mul_ps(dv[v], _mm512_loadu_ps(an + 16 * v)));
      const __m512 st = _mm512_fmadd_ps(e, _mm512_loadu_ps(sn + 16 * v), _mm512_mul_ps(xv[v], bn));
      _mm512_storeu_ps(sn + 16 * v, st);
      if (E) {
        _mm512_storeu_ps(E + n * kLanes + 16 * v, e);
        _mm512_storeu_ps(S + n * kLanes + 16 * v, st);
      }
      acc[v] = _mm512_fmadd_ps(st, cn, acc[v]);
    }
  }
  for (int v = 0; v < V; ++v) _mm512_storeu_ps(y + 16 * v, acc[v]);
#else
  alignas(64) float acc[kLanes] = {};
  for (int n = 0; n < N; ++n) {
    const float bn = Bp[n], cn = Cp[n];
    float* sn = s + n * kLanes;
    const float* an = At + n * kLanes;
    if (E) {
      float* en = E + n * kLanes;
      float* ssn = S + n * kLanes;
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) {
        const float e = exp_neg_f(delta[j] * an[j]);
        const float v = e * sn[j] + dx[j] * bn;
        en[j] = e;
        sn[j] = v;
        ssn[j] = v;
        acc[j] += v * cn;
      }
    } else {
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) {
        const float v = exp_neg_f(delta[j] * an[j]) * sn[j] + dx[j] * bn;
        sn[j] = v;
        acc[j] += v * cn;
      }
    }
  }
  for (int j = 0; j < kLanes; ++j) y[j] = acc[j];
#endif
}

// Backward of lanes_gate: q = dL/dy = g SiLU(z) (also dL/d(D x)), dz = g (y + D x) SiLU'(z), dD += q x.
MRL_NOINLINE void step_gate_bwd(float* __restrict q, float* __restrict dz, float* __restrict dDacc,
                                const float* __restrict go, const float* __restrict y, const float* __restrict Dv,
                                const float* __restrict xv, const float* __restrict zv) {
#pragma omp simd
  for (int j = 0; j < kLanes; ++j) {
    const float sz = sigmoid_f(zv[j]);
    q[j] = go[j] * zv[j] * sz;
    dz[j] = go[j] * (y[j] + Dv[j] * xv[j]) * sz * (1.0f + zv[j] * (1.0f - sz));
    dDacc[j] += q[j] * xv[j];
  }
}

// dC[n] += sum_j q[j] S[n][j]  (the reduction over channels)
MRL_NOINLINE MRL_REASSOC void step_dC(float* __restrict dc, const float* __restrict q, const float* __restrict S, int N) {
  for (int n = 0; n < N; ++n) {
    const float* sn = S + n * kLanes;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int j = 0; j < kLanes; ++j) acc += q[j] * sn[j];
    dc[n] += acc;
  }
}

// One reverse step. h = dL/ds_t from the future, prev = s_{t-1} (null after a start: no dependence).
//   hv = h + q C[n];  ge = hv prev e  (dL/d(delta A));  d(delta) += ge A + hv x B;  dA += ge delta;
//   dx += hv delta B;  dB[n] += sum_j hv delta x;  h = hv e (0 after a start).
MRL_NOINLINE MRL_REASSOC void step_reverse(float* __restrict h, float* __restrict dA, float* __restrict dd,
                               float* __restrict dxa, float* __restrict db, const float* __restrict E,
                               const float* __restrict prev, const float* __restrict At,
                               const float* __restrict delta, const float* __restrict xv,
                               const float* __restrict q, const float* __restrict Bp, const float* __restrict Cp,
                               int N) {
  alignas(64) float hx[kLanes], ddl[kLanes] = {}, dxl[kLanes] = {};
#pragma omp simd
  for (int j = 0; j < kLanes; ++j) hx[j] = delta[j] * xv[j];
  for (int n = 0; n < N; ++n) {
    const float bn = Bp[n], cn = Cp[n];
    float* hn = h + n * kLanes;
    float* dan = dA + n * kLanes;
    const float* en = E + n * kLanes;
    const float* an = At + n * kLanes;
    float acc = 0.0f;
    if (prev) {
      const float* pn = prev + n * kLanes;
#pragma omp simd reduction(+ : acc)
      for (int j = 0; j < kLanes; ++j) {
        const float hv = hn[j] + q[j] * cn;
        const float ge = hv * pn[j] * en[j];
        ddl[j] += ge * an[j] + hv * xv[j] * bn;
        dan[j] += ge * delta[j];
        dxl[j] += hv * delta[j] * bn;
        acc += hv * hx[j];
        hn[j] = hv * en[j];
      }
    } else {  // step t was an episode start: s_{t-1} was replaced by 0, nothing flows to it
#pragma omp simd reduction(+ : acc)
      for (int j = 0; j < kLanes; ++j) {
        const float hv = hn[j] + q[j] * cn;
        ddl[j] += hv * xv[j] * bn;
        dxl[j] += hv * delta[j] * bn;
        acc += hv * hx[j];
        hn[j] = 0.0f;
      }
    }
    db[n] += acc;
  }
  for (int j = 0; j < kLanes; ++j) {
    dd[j] = ddl[j];
    dxa[j] = dxl[j];
  }
}

}  // namespace

void lanes_delta(float* __restrict delta, float* __restrict dsp, float* __restrict dx, const float* __restrict dtv,
                 const float* __restrict bias, const float* __restrict xv) {
  alignas(64) float sp[kLanes];
#pragma omp simd
  for (int j = 0; j < kLanes; ++j) {
    delta[j] = softplus_f(dtv[j] + bias[j], &sp[j]);
    dx[j] = delta[j] * xv[j];
  }
  if (dsp)
    for (int j = 0; j < kLanes; ++j) dsp[j] = sp[j];
}

void lanes_gate(float* __restrict o, const float* __restrict y, const float* __restrict Dv,
                const float* __restrict xv, const float* __restrict zv) {
#pragma omp simd
  for (int j = 0; j < kLanes; ++j) o[j] = (y[j] + Dv[j] * xv[j]) * (zv[j] * sigmoid_f(zv[j]));
}

void scan_fwd(const ScanFwdArgs& a) {
  const int nblk = num_blocks(a.D), N = a.N, T = a.T, D = a.D;
  const int nC = (T + kScanChunk - 1) / kScanChunk;
  const int64_t ntask = (int64_t)a.B * nblk;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(a.nthreads, ntask));
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    std::vector<float> buf((size_t)2 * N * kLanes);
    float* At = buf.data();
    float* s = At + N * kLanes;
    alignas(64) float bias[kLanes], Dv[kLanes], xv[kLanes], dtv[kLanes], zv[kLanes], delta[kLanes], dx[kLanes],
        y[kLanes], o[kLanes];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < ntask; ++task) {
      const int b = (int)(task / nblk), d0 = (int)(task % nblk) * kLanes, nd = std::min(kLanes, D - d0);
      load_A(At, a.A_log, N, d0, nd);
      load_lanes(bias, a.dt_bias + d0, nd);
      load_lanes(Dv, a.Dskip + d0, nd);
      gather_state(s, a.init ? a.init + (int64_t)b * D * N : nullptr, D, N, d0, nd);
      for (int t = 0; t < T; ++t) {
        if (a.ckpt && t % kScanChunk == 0)
          scatter_state(a.ckpt + ((int64_t)b * nC + t / kScanChunk) * D * N, s, N, d0, nd);
        if (is_start(a, b, t)) std::fill(s, s + N * kLanes, 0.0f);
        load_lanes(xv, a.x + (int64_t)b * a.x_sb + (int64_t)t * a.x_st + d0, nd);
        load_lanes(dtv, a.dt + (int64_t)b * a.dt_sb + (int64_t)t * a.dt_st + d0, nd);
        load_lanes(zv, a.z + (int64_t)b * a.z_sb + (int64_t)t * a.z_st + d0, nd);
        lanes_delta(delta, nullptr, dx, dtv, bias, xv);
        step_state(s, y, nullptr, nullptr, At, delta, dx, a.Bm + (int64_t)b * a.B_sb + (int64_t)t * a.B_st,
                   a.Cm + (int64_t)b * a.C_sb + (int64_t)t * a.C_st, N);
        lanes_gate(o, y, Dv, xv, zv);
        store_lanes(a.out + ((int64_t)b * T + t) * D + d0, o, nd);
      }
      scatter_state(a.final_state + (int64_t)b * D * N, s, N, d0, nd);
    }
  }
}

void scan_bwd(const ScanBwdArgs& g) {
  const ScanFwdArgs& a = g.f;
  const int nblk = num_blocks(a.D), N = a.N, T = a.T, D = a.D, Bsz = a.B;
  const int nC = (T + kScanChunk - 1) / kScanChunk;
  // channel groups per row: enough (row, group) tasks to keep the threads busy; each group writes its own
  // dB / dC partial, so groups > 1 cost a [G, B, T, N] buffer and a reduction.
  const int want = a.nthreads > 1 ? (2 * a.nthreads + Bsz - 1) / Bsz : 1;
  const int G = std::max(1, std::min(nblk, want));
  const int bpg = (nblk + G - 1) / G;  // blocks per group
  const int64_t ntask = (int64_t)Bsz * G;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(a.nthreads, ntask));
  const int64_t BTN = (int64_t)Bsz * T * N;
  std::vector<float> partBC(G > 1 ? (size_t)2 * G * BTN : 0);
  std::vector<float> partP((size_t)Bsz * D * (N + 2));  // per row: dA [D, N], then dD [D], ddt_bias [D]
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int CH = kScanChunk, NL = N * kLanes;
    Scratch64 buf((size_t)2 * CH * NL + 5 * (size_t)NL + 4 * (size_t)CH * kLanes);
    float* S = buf.data();          // [CH][N][L] s_t
    float* E = S + CH * NL;         // [CH][N][L] exp(delta_t A)
    float* At = E + CH * NL;        // [N][L]
    float* s = At + NL;             // [N][L] running state
    float* sin = s + NL;            // [N][L] state entering the chunk
    float* h = sin + NL;            // [N][L] dL/ds
    float* dA = h + NL;             // [N][L] dL/dA accumulator
    float* Dl = dA + NL;            // [CH][L] delta_t
    float* SPl = Dl + CH * kLanes;  // [CH][L] softplus'
    float* Xl = SPl + CH * kLanes;  // [CH][L] x_t
    float* Ql = Xl + CH * kLanes;   // [CH][L] dq_t = dL/dy_t
    alignas(64) float bias[kLanes], Dv[kLanes], zv[kLanes], dtv[kLanes], go[kLanes], y[kLanes], dxv[kLanes],
        tmp[kLanes], dDacc[kLanes], ddbacc[kLanes], dd[kLanes], dxa[kLanes];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < ntask; ++task) {
      const int b = (int)(task / G), grp = (int)(task % G);
      float* dBt = G > 1 ? partBC.data() + ((int64_t)grp * Bsz + b) * T * N : g.dB + (int64_t)b * T * N;
      float* dCt = G > 1 ? partBC.data() + G * BTN + ((int64_t)grp * Bsz + b) * T * N : g.dC + (int64_t)b * T * N;
      std::fill(dBt, dBt + (int64_t)T * N, 0.0f);
      std::fill(dCt, dCt + (int64_t)T * N, 0.0f);
      const int blk_end = std::min(nblk, (grp + 1) * bpg);
      for (int blk = grp * bpg; blk < blk_end; ++blk) {
        const int d0 = blk * kLanes, nd = std::min(kLanes, D - d0);
        load_A(At, a.A_log, N, d0, nd);
        load_lanes(bias, a.dt_bias + d0, nd);
        load_lanes(Dv, a.Dskip + d0, nd);
        gather_state(h, g.dfinal ? g.dfinal + (int64_t)b * D * N : nullptr, D, N, d0, nd);
        std::fill(dA, dA + NL, 0.0f);
        std::fill(dDacc, dDacc + kLanes, 0.0f);
        std::fill(ddbacc, ddbacc + kLanes, 0.0f);
        for (int c = nC - 1; c >= 0; --c) {
          const int t0 = c * CH, len = std::min(CH, T - t0);
          gather_state(sin, a.ckpt + ((int64_t)b * nC + c) * D * N, D, N, d0, nd);
          std::copy(sin, sin + NL, s);
          // ---- recompute the chunk forward; local gradients
          for (int i = 0; i < len; ++i) {
            const int t = t0 + i;
            if (is_start(a, b, t)) std::fill(s, s + NL, 0.0f);
            float* xl = Xl + i * kLanes;
            float* dl = Dl + i * kLanes;
            float* ql = Ql + i * kLanes;
            load_lanes(xl, a.x + (int64_t)b * a.x_sb + (int64_t)t * a.x_st + d0, nd);
            load_lanes(dtv, a.dt + (int64_t)b * a.dt_sb + (int64_t)t * a.dt_st + d0, nd);
            load_lanes(zv, a.z + (int64_t)b * a.z_sb + (int64_t)t * a.z_st + d0, nd);
            load_lanes(go, g.dout + (int64_t)b * g.g_sb + (int64_t)t * g.g_st + d0, nd);
            lanes_delta(dl, SPl + i * kLanes, dxv, dtv, bias, xl);
            step_state(s, y, E + i * NL, S + i * NL, At, dl, dxv, a.Bm + (int64_t)b * a.B_sb + (int64_t)t * a.B_st,
                       a.Cm + (int64_t)b * a.C_sb + (int64_t)t * a.C_st, N);
            step_gate_bwd(ql, tmp, dDacc, go, y, Dv, xl, zv);
            store_lanes(g.dz + (int64_t)b * g.dz_sb + (int64_t)t * g.dz_st + d0, tmp, nd);
            step_dC(dCt + (int64_t)t * N, ql, S + i * NL, N);
          }
          // ---- reverse through the chunk
          for (int i = len - 1; i >= 0; --i) {
            const int t = t0 + i;
            const float* prev = is_start(a, b, t) ? nullptr : (i > 0 ? S + (i - 1) * NL : sin);
            step_reverse(h, dA, dd, dxa, dBt + (int64_t)t * N, E + i * NL, prev, At, Dl + i * kLanes,
                         Xl + i * kLanes, Ql + i * kLanes, a.Bm + (int64_t)b * a.B_sb + (int64_t)t * a.B_st,
                         a.Cm + (int64_t)b * a.C_sb + (int64_t)t * a.C_st, N);
#pragma omp simd
            for (int j = 0; j < kLanes; ++j) {
              dxa[j] += Ql[i * kLanes + j] * Dv[j];
              dd[j] *= SPl[i * kLanes + j];  // ddt = d(delta) * softplus'
              ddbacc[j] += dd[j];
            }
            store_lanes(g.dx + ((int64_t)b * T + t) * D + d0, dxa, nd);
            store_lanes(g.ddt + ((int64_t)b * T + t) * D + d0, dd, nd);
          }
        }
        if (g.dinit) scatter_state(g.dinit + (int64_t)b * D * N, h, N, d0, nd);
        float* pr = partP.data() + (int64_t)b * D * (N + 2);
        for (int j = 0; j < nd; ++j)
          for (int n = 0; n < N; ++n) pr[(int64_t)(d0 + j) * N + n] = dA[n * kLanes + j] * At[n * kLanes + j];
        store_lanes(pr + (int64_t)D * N + d0, dDacc, nd);
        store_lanes(pr + (int64_t)D * (N + 1) + d0, ddbacc, nd);
      }
    }
    // dB / dC: sum the channel-group partials
    if (G > 1) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < BTN; ++i) {
        float sb = 0.0f, sc = 0.0f;
        for (int q = 0; q < G; ++q) {
          sb += partBC[(size_t)q * BTN + i];
          sc += partBC[(size_t)(G + q) * BTN + i];
        }
        g.dB[i] = sb;
        g.dC[i] = sc;
      }
    }
    // dA_log / dD / ddt_bias: sum the per-row partials, write or add
#pragma omp for schedule(static)
    for (int64_t i = 0; i < (int64_t)D * (N + 2); ++i) {
      float sum = 0.0f;
      for (int b = 0; b < Bsz; ++b) sum += partP[(size_t)b * D * (N + 2) + i];
      float* dst = i < (int64_t)D * N ? g.dA_log + i : (i < (int64_t)D * (N + 1) ? g.dD + (i - D * N) : g.ddt_bias + (i - D * (N + 1)));
      *dst = g.accumulate ? *dst + sum : sum;
    }
  }
}

}  // namespace mrl_cpu
