// One-token Mamba-3 backbone step for acting, CPU: every layer in one C++ call (the Mamba-3 twin of
// step.cpp). Per layer (h: the float32 residual stream [B, d_model]):
//   u = RMSNorm(h) norm.weight;  zxbc = u @ in_proj.weight^T (linear_nt, blas.h);  y = the mixer core of mamba3.cpp
//   with T = 1, the carried state updated in place;  h += y @ out_proj.weight^T (linear_nt, accumulating)
// then RMSNorm(h) norm_f.weight. The core is the very function the sequence forward runs; T steps differ from
// the sequence forward only by the GEMMs' rounding (MKL blocks a [B, d] product differently from a [B T, d]
// one), about 1e-7 relative.
#include <ATen/ops/empty.h>

#include "blas.h"
#include "kernels.h"
#include "mamba3_step.h"

namespace mrl_cpu {

at::Tensor m3_backbone_step(const at::Tensor& x, const at::Tensor& inp_w, const at::Tensor& inp_b,
                            const at::Tensor& normf_w, const std::vector<std::vector<at::Tensor>>& layers,
                            at::Tensor& carry, at::Tensor& ssm, const bool* starts, float eps, int headdim,
                            float A_floor, bool heavy_tail, int nthreads) {
  const int B = (int)x.size(0), dm = (int)inp_w.size(0), L = (int)layers.size();
  const int H = (int)carry.size(2), P = headdim, N = (int)ssm.size(3), di = H * P;
  const int R = (int)carry.size(3) - N - P, Dp = 2 * di + 2 * N + 3 * H + R;
  const auto opt = x.options();
  at::Tensor h = at::empty({B, dm}, opt);  // [B, dm] residual stream
  linear_bias_nt(x.data_ptr<float>(), inp_w.data_ptr<float>(), inp_b.data_ptr<float>(), x.size(1), dm,
                 h.data_ptr<float>(), B);
  at::Tensor u = at::empty({B, dm}, opt), rstd = at::empty({B}, opt);
  at::Tensor zxbc = at::empty({B, Dp}, opt), y = at::empty({B, di}, opt);
  const int64_t c_l = (int64_t)B * H * (R + N + P), s_l = (int64_t)B * di * N;
  for (int l = 0; l < L; ++l) {
    const auto& t = layers[l];
    rmsnorm_fwd(h.data_ptr<float>(), B, dm, t[0].data_ptr<float>(), eps, u.data_ptr<float>(),
                rstd.data_ptr<float>(), nthreads);
    linear_nt(u.data_ptr<float>(), dm, t[1].data_ptr<float>(), dm, Dp, zxbc.data_ptr<float>(), Dp, B, 0.0f);
    M3Args a{};
    a.zxbc = zxbc.data_ptr<float>(); a.z_sb = Dp; a.z_st = Dp;
    a.dt_bias = t[2].data_ptr<float>(); a.B_bias = t[3].data_ptr<float>(); a.C_bias = t[4].data_ptr<float>();
    a.B_w = t[5].data_ptr<float>(); a.C_w = t[6].data_ptr<float>(); a.Dskip = t[7].data_ptr<float>();
    a.out_w = t.size() > 9 ? t[9].data_ptr<float>() : nullptr;
    float* cl = carry.data_ptr<float>() + l * c_l;
    float* sl = ssm.data_ptr<float>() + l * s_l;
    a.carry0 = cl; a.ssm0 = sl; a.starts = starts;
    a.eps = eps; a.A_floor = A_floor; a.heavy_tail = heavy_tail;
    a.B = B; a.T = 1; a.H = H; a.P = P; a.N = N; a.R = R; a.nthreads = nthreads;
    m3_fwd(a, y.data_ptr<float>(), cl, sl, nullptr);
    linear_nt(y.data_ptr<float>(), di, t[8].data_ptr<float>(), di, dm, h.data_ptr<float>(), dm, B, 1.0f);
  }
  at::Tensor out = at::empty({B, dm}, opt);
  rmsnorm_fwd(h.data_ptr<float>(), B, dm, normf_w.data_ptr<float>(), eps, out.data_ptr<float>(),
              rstd.data_ptr<float>(), nthreads);
  return out;
}

}  // namespace mrl_cpu
