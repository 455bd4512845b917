// One-token backbone step for acting, CPU: every layer in one C++ call.
//
// Per layer (h is the float32 residual stream [B, d_model]):
//   u  = RMSNorm(h) * norm.weight                       (kernels' rmsnorm_fwd)
//   xz = u @ in_proj.weight^T            [B, 2D]        (linear_nt: BLAS sgemm, blas.h)
//   xc = SiLU(conv1d.bias + sum_k w[:, k] * window_k)   (conv window = conv_state[l] + this token)
//   dbc = xc @ x_proj.weight^T           [B, R + 2N]    (linear_nt)
//   dt = dbc[:, :R] @ dt_proj.weight^T   [B, D]         (linear_nt)
//   s = exp(delta A) s + delta xc B,  y = (s . C + D xc) * SiLU(z),  delta = softplus(dt + dt_proj.bias)
//   h += y @ out_proj.weight^T                          (linear_nt, accumulating)
// then RMSNorm(h) * norm_f.weight. Rows with episode_starts[b] get their conv window and SSM state zeroed
// (assigned) before the token is consumed. The conv and SSM updates are the T = 1 case of conv.cpp /
// scan.cpp; here the carried SSM state is kept in its [B, D, N] layout, so the per-channel recurrence is
// vectorised over d_state, while softplus / SiLU are vectorised over channels.
#include "step.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "blas.h"
#include "kernels.h"

namespace mrl_cpu {
namespace {

inline int num_blocks(int D) { return (D + kLanes - 1) / kLanes; }

// Pre-activations of one block of channels: p_j = bias + sum_k w[d, k] win_k with win = (state[d, 0..K-2]
// or zeros at a start, x[d]); the state becomes the last K-1 window entries. KK > 0 fixes K at compile
// time (fully unrolled for the usual d_conv 4); KK = 0 is the general case. The SiLU over the block is
// vectorised by the caller.
template <int KK>
MRL_NOINLINE void conv_block(float* __restrict p, float* __restrict st, const float* __restrict x,
                             const float* __restrict w, const float* __restrict bias, int nd, int Kdyn, bool reset) {
  const int K = KK > 0 ? KK : Kdyn, S = K - 1;
  for (int j = 0; j < nd; ++j) {
    float* sj = st + (int64_t)j * S;
    const float* wj = w + (int64_t)j * K;
    float acc = bias[j] + wj[S] * x[j];
    // at a start the old window reads as zeros (the old episode's values, NaN or not, are never read), but the
    // taps still multiply them, so a NaN / inf weight reaches the output as in the sequence kernel and the
    // reference (w * 0)
    for (int k = 0; k < S; ++k) acc += wj[k] * (reset ? 0.0f : sj[k]);
    for (int k = 0; k + 1 < S; ++k) sj[k] = reset ? 0.0f : sj[k + 1];
    if (S > 0) sj[S - 1] = x[j];
    p[j] = acc;
  }
  for (int j = nd; j < kLanes; ++j) p[j] = 0.0f;
}

// xc[b, d] = SiLU(bias + sum_k w[d, k] win_k) for every (b, d); conv state [B, D, K-1] in place. x rows
// have stride ldx (a view of xz).
void conv_step(const float* x, int64_t ldx, const float* w, const float* bias, float* state, const bool* starts,
               float* xc, int B, int D, int K, int nthreads) {
  const int nblk = num_blocks(D);
  const int64_t ntask = (int64_t)B * nblk;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, ntask));
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    alignas(64) float p[kLanes], o[kLanes];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < ntask; ++task) {
      const int b = (int)(task / nblk), d0 = (int)(task % nblk) * kLanes, nd = std::min(kLanes, D - d0);
      float* st = state + ((int64_t)b * D + d0) * (K - 1);
      const bool reset = starts && starts[b];
      if (K == 4)
        conv_block<4>(p, st, x + (int64_t)b * ldx + d0, w + (int64_t)d0 * K, bias + d0, nd, K, reset);
      else
        conv_block<0>(p, st, x + (int64_t)b * ldx + d0, w + (int64_t)d0 * K, bias + d0, nd, K, reset);
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) o[j] = p[j] * sigmoid_f(p[j]);
      store_lanes(xc + (int64_t)b * D + d0, o, nd);
    }
  }
}

// The carried states of one block: for each of its nd channels (state row s_d of N contiguous floats),
// s_d = exp(delta_d A_d) s_d + dx_d B (s_d := 0 first when reset), acc_d = s_d . C. NN > 0 fixes N at
// compile time (no loop control or remainder per channel for the usual d_state 16 / 8); NN = 0 is the
// general case. Out of line: see MRL_NOINLINE in kernels.h.
template <int NN>
MRL_NOINLINE void state_block(float* __restrict state, const float* __restrict A, const float* __restrict delta,
                              const float* __restrict dx, const float* __restrict Bp, const float* __restrict Cp,
                              float* __restrict acc, int nd, int Ndyn, bool reset) {
  const int N = NN > 0 ? NN : Ndyn;
  for (int j = 0; j < nd; ++j) {
    float* s = state + (int64_t)j * N;
    const float* a = A + (int64_t)j * N;
    const float dl = delta[j], dxj = dx[j];
    float sum = 0.0f;
    if (reset) {  // select: the old episode's state (NaN or not) is never read; its decay still multiplies the
                  // zero state, so a NaN A reaches the output as in the sequence kernel and the reference
#pragma omp simd reduction(+ : sum)
      for (int n = 0; n < N; ++n) {
        const float v = exp_neg_f(dl * a[n]) * 0.0f + dxj * Bp[n];
        s[n] = v;
        sum += v * Cp[n];
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int n = 0; n < N; ++n) {
        const float v = exp_neg_f(dl * a[n]) * s[n] + dxj * Bp[n];
        s[n] = v;
        sum += v * Cp[n];
      }
    }
    acc[j] = sum;
  }
  for (int j = nd; j < kLanes; ++j) acc[j] = 0.0f;
}

// One selective-scan step for every (b, d); state [B, D, N] in place, A = -exp(A_log) precomputed [D, N].
// Bm / Cm / z rows have strides ldbc / ldbc / ldz (views of dbc and xz).
void scan_step(const float* xc, const float* dt, const float* Bm, const float* Cm, int64_t ldbc, const float* z,
               int64_t ldz, const float* A, const float* Dp, const float* dt_b, float* state, const bool* starts,
               float* y, int B, int D, int N, int nthreads) {
  const int nblk = num_blocks(D);
  const int64_t ntask = (int64_t)B * nblk;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, ntask));
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    alignas(64) float xv[kLanes], dtv[kLanes], bias[kLanes], zv[kLanes], Dv[kLanes], delta[kLanes], dx[kLanes],
        acc[kLanes], o[kLanes];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < ntask; ++task) {
      const int b = (int)(task / nblk), d0 = (int)(task % nblk) * kLanes, nd = std::min(kLanes, D - d0);
      load_lanes(xv, xc + (int64_t)b * D + d0, nd);
      load_lanes(dtv, dt + (int64_t)b * D + d0, nd);
      load_lanes(bias, dt_b + d0, nd);
      load_lanes(zv, z + (int64_t)b * ldz + d0, nd);
      load_lanes(Dv, Dp + d0, nd);
      lanes_delta(delta, nullptr, dx, dtv, bias, xv);
      float* sb = state + ((int64_t)b * D + d0) * N;
      const float* Ab = A + (int64_t)d0 * N;
      const float *Bb = Bm + (int64_t)b * ldbc, *Cb = Cm + (int64_t)b * ldbc;
      const bool reset = starts && starts[b];
      if (N == 16)
        state_block<16>(sb, Ab, delta, dx, Bb, Cb, acc, nd, N, reset);
      else if (N == 8)
        state_block<8>(sb, Ab, delta, dx, Bb, Cb, acc, nd, N, reset);
      else
        state_block<0>(sb, Ab, delta, dx, Bb, Cb, acc, nd, N, reset);
      lanes_gate(o, acc, Dv, xv, zv);
      store_lanes(y + (int64_t)b * D + d0, o, nd);
    }
  }
}

}  // namespace

at::Tensor backbone_step(const at::Tensor& x, const at::Tensor& inp_w, const at::Tensor& inp_b,
                         const at::Tensor& normf_w, const std::vector<std::vector<at::Tensor>>& layers,
                         at::Tensor& conv_state, at::Tensor& ssm_state, const bool* starts, float eps,
                         int nthreads) {
  const int B = (int)x.size(0), dm = (int)inp_w.size(0), L = (int)layers.size();
  const int D = (int)conv_state.size(2), K = (int)conv_state.size(3) + 1, N = (int)ssm_state.size(3);
  const int R = (int)layers[0][5].size(1);
  const int in_dim = (int)x.size(1);
  const auto opt = x.options();
  at::Tensor h = at::empty({B, dm}, opt);  // [B, dm] residual stream
  float* ph = h.data_ptr<float>();
  linear_bias_nt(x.data_ptr<float>(), inp_w.data_ptr<float>(), inp_b.data_ptr<float>(), in_dim, dm, ph, B);
  at::Tensor u = at::empty({B, dm}, opt), rstd = at::empty({B}, opt);
  at::Tensor xz = at::empty({B, 2 * D}, opt), xc = at::empty({B, D}, opt);
  at::Tensor dbc = at::empty({B, R + 2 * N}, opt), dt = at::empty({B, D}, opt), y = at::empty({B, D}, opt);
  float *pu = u.data_ptr<float>(), *pxz = xz.data_ptr<float>(), *pxc = xc.data_ptr<float>();
  float *pdbc = dbc.data_ptr<float>(), *pdt = dt.data_ptr<float>(), *py = y.data_ptr<float>();
  std::vector<float> A((size_t)D * N);
  const int64_t cs_l = (int64_t)B * D * (K - 1), ss_l = (int64_t)B * D * N;
  for (int l = 0; l < L; ++l) {
    const auto& t = layers[l];
    rmsnorm_fwd(ph, B, dm, t[0].data_ptr<float>(), eps, pu, rstd.data_ptr<float>(), nthreads);
    linear_nt(pu, dm, t[1].data_ptr<float>(), dm, 2 * D, pxz, 2 * D, B, 0.0f);
    conv_step(pxz, 2 * D, t[2].data_ptr<float>(), t[3].data_ptr<float>(), conv_state.data_ptr<float>() + l * cs_l,
              starts, pxc, B, D, K, nthreads);
    linear_nt(pxc, D, t[4].data_ptr<float>(), D, R + 2 * N, pdbc, R + 2 * N, B, 0.0f);
    linear_nt(pdbc, R + 2 * N, t[5].data_ptr<float>(), R, D, pdt, D, B, 0.0f);
    const float* alog = t[7].data_ptr<float>();
#pragma omp simd
    for (int64_t i = 0; i < (int64_t)D * N; ++i) A[i] = -exp_f(alog[i]);
    scan_step(pxc, pdt, pdbc + R, pdbc + R + N, R + 2 * N, pxz + D, 2 * D, A.data(), t[8].data_ptr<float>(),
              t[6].data_ptr<float>(), ssm_state.data_ptr<float>() + l * ss_l, starts, py, B, D, N, nthreads);
    linear_nt(py, D, t[9].data_ptr<float>(), D, dm, ph, dm, B, 1.0f);
  }
  at::Tensor out = at::empty({B, dm}, opt);
  rmsnorm_fwd(ph, B, dm, normf_w.data_ptr<float>(), eps, out.data_ptr<float>(), rstd.data_ptr<float>(), nthreads);
  return out;
}

}  // namespace mrl_cpu
