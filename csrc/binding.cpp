// The one torch-facing file: checks every shape/dtype/device with a message, allocates outputs through
// torch's caching allocator, and enqueues the torch-free launchers on the current torch stream.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <array>
#include <optional>
#include <limits>
#include <tuple>
#include "binding_common.h"
#include "ops.h"

using at::Tensor;
using OptT = std::optional<Tensor>;
using mrl_binding::new_empty;
using mrl_binding::ptr_or_null;
using mrl_binding::set_poison;
using mrl_binding::shape_str;

namespace {

int dtype_code(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return mrl::kF32;
    case at::kBFloat16: return mrl::kBF16;
    case at::kHalf: return mrl::kF16;
    default: MRL_CHECK(false, name, ": expected float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return -1;
}

void check_cuda(const Tensor& t, const char* name, const Tensor& ref) {
  MRL_CHECK(t.is_cuda(), name, ": expected a CUDA tensor, got device ", t.device());
  MRL_CHECK(t.device() == ref.device(), name, ": expected device ", ref.device(), ", got ", t.device());
}

// [B, T, C] activation with unit last-dim stride (row strides are free).
void check_act(const Tensor& t, const char* name, const Tensor& ref, int64_t B, int64_t T, int64_t C,
               at::ScalarType dt) {
  check_cuda(t, name, ref);
  MRL_CHECK(t.dim() == 3 && t.size(0) == B && t.size(1) == T && t.size(2) == C, name, ": expected shape [",
              B, ", ", T, ", ", C, "], got ", shape_str(t));
  MRL_CHECK(t.scalar_type() == dt, name, ": expected dtype ", dt, " (same as x), got ", t.scalar_type());
  MRL_CHECK(C <= 1 || t.stride(2) == 1, name, ": last dim must have stride 1, got strides ", t.strides());
}

void check_f32(const Tensor& t, const char* name, const Tensor& ref, at::IntArrayRef shape) {
  check_cuda(t, name, ref);
  MRL_CHECK(t.scalar_type() == at::kFloat, name, ": expected float32, got ", t.scalar_type());
  MRL_CHECK(t.sizes() == shape, name, ": expected shape ", shape, ", got ", shape_str(t));
  MRL_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

void check_starts(const OptT& s, const Tensor& ref, int64_t B, int64_t T) {
  if (!s) return;
  check_cuda(*s, "episode_starts", ref);
  MRL_CHECK(s->scalar_type() == at::kBool, "episode_starts: expected bool, got ", s->scalar_type());
  MRL_CHECK(s->dim() == 2 && s->size(0) == B && s->size(1) == T, "episode_starts: expected shape [", B, ", ", T,
              "], got ", shape_str(*s));
  MRL_CHECK(s->is_contiguous(), "episode_starts: expected a contiguous tensor");
}

// A launcher's error string (a failed launch or attribute call) -> RuntimeError; argument errors are
// ValueErrors raised by MRL_CHECK before anything is launched.
void raise_if(const char* err) { MRL_RAISE_IF(err); }

// ---------------- causal conv1d ----------------
// The checks shared by the conv forward and backward; returns {B, T, D, K, dtype code}.
std::array<int64_t, 5> conv_check(const Tensor& x, const Tensor& w, const Tensor& bias, const OptT& init,
                                  const OptT& starts) {
  MRL_CHECK(x.dim() == 3, "causal_conv1d: x must be [B, T, D], got ", shape_str(x));
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  MRL_CHECK(T >= 1 && B >= 1 && D >= 1, "causal_conv1d: empty x ", shape_str(x));
  const int dt = dtype_code(x, "causal_conv1d: x");
  check_act(x, "causal_conv1d: x", x, B, T, D, x.scalar_type());
  MRL_CHECK(w.dim() == 2 && w.size(0) == D, "causal_conv1d: weight must be [D, K], got ", shape_str(w));
  const int64_t K = w.size(1);
  check_f32(w, "causal_conv1d: weight", x, {D, K});
  check_f32(bias, "causal_conv1d: bias", x, {D});
  if (init) check_f32(*init, "causal_conv1d: conv_state", x, {B, D, K - 1});
  check_starts(starts, x, B, T);
  return {B, T, D, K, dt};
}

std::vector<Tensor> conv_fwd(const Tensor& x, const Tensor& w, const Tensor& bias, const OptT& init,
                             const OptT& starts, const OptT& final_out) {
  const auto [B, T, D, K, dt] = conv_check(x, w, bias, init, starts);
  if (final_out) check_f32(*final_out, "causal_conv1d: final_out", x, {B, D, K - 1});
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = new_empty({B, T, D}, x.options());
  auto fin = final_out ? *final_out : new_empty({B, D, K - 1}, x.options().dtype(at::kFloat));
  mrl::ConvFwdParams p{x.data_ptr(), x.stride(0), x.stride(1), w.data_ptr<float>(), bias.data_ptr<float>(),
                       ptr_or_null<float>(init), ptr_or_null<bool>(starts), out.data_ptr(), fin.data_ptr<float>(),
                       (int)B, (int)T, (int)D, (int)K};
  raise_if(mrl::conv_fwd(dt, p, c10::cuda::getCurrentCUDAStream().stream()));
  return {out, fin};
}

std::vector<Tensor> conv_bwd(const Tensor& x, const Tensor& w, const Tensor& bias, const OptT& init,
                             const OptT& starts, const Tensor& dout, const OptT& dfinal, bool need_dinit,
                             const OptT& dx_out, const OptT& dw_acc, const OptT& db_acc, bool partials) {
  const auto [B, T, D, K, dt] = conv_check(x, w, bias, init, starts);
  check_act(dout, "causal_conv1d: grad_out", x, B, T, D, x.scalar_type());
  if (dfinal) check_f32(*dfinal, "causal_conv1d: grad_final_state", x, {B, D, K - 1});
  const c10::cuda::CUDAGuard guard(x.device());
  auto f32 = x.options().dtype(at::kFloat);
  if (dx_out) check_act(*dx_out, "causal_conv1d: dx_out", x, B, T, D, x.scalar_type());
  MRL_CHECK(dw_acc.has_value() == db_acc.has_value(), "causal_conv1d: give both dw_acc and db_acc or neither");
  MRL_CHECK(!(partials && dw_acc), "causal_conv1d: partials=True returns the weight gradient's partials, so it "
            "takes no dw_acc / db_acc; got both");
  if (dw_acc) {
    check_f32(*dw_acc, "causal_conv1d: dw_acc", x, {D, K});
    check_f32(*db_acc, "causal_conv1d: db_acc", x, {D});
  }
  auto dx = dx_out ? *dx_out : new_empty({B, T, D}, x.options());
  // the partials: a row per (b, chunk of 16 steps), dweight's D * K columns ([D][K] order), then dbias's D
  auto ws = new_empty({mrl::conv_bwd_workspace((int)B, (int)T, (int)D, (int)K) / ((K + 1) * D), (K + 1) * D}, f32);
  auto dw = partials ? ws.narrow(1, 0, D * K) : dw_acc ? *dw_acc : new_empty({D, K}, f32);
  auto db = partials ? ws.narrow(1, D * K, D) : db_acc ? *db_acc : new_empty({D}, f32);
  Tensor dinit = need_dinit ? new_empty({B, D, K - 1}, f32) : Tensor();
  mrl::ConvBwdParams p{x.data_ptr(), x.stride(0), x.stride(1), w.data_ptr<float>(), bias.data_ptr<float>(),
                       ptr_or_null<float>(init), ptr_or_null<bool>(starts), dout.data_ptr(), dout.stride(0),
                       dout.stride(1), ptr_or_null<float>(dfinal), dx.data_ptr(), dx.stride(0), dx.stride(1),
                       need_dinit ? dinit.data_ptr<float>() : nullptr, dw.data_ptr<float>(), db.data_ptr<float>(),
                       dw_acc.has_value(), ws.data_ptr<float>(), (int)B, (int)T, (int)D, (int)K, partials};
  raise_if(mrl::conv_bwd(dt, p, c10::cuda::getCurrentCUDAStream().stream()));
  return {dx, dw, db, dinit};
}

// ---------------- selective scan ----------------
struct ScanShapes { int64_t B, T, D, N; int dt; };

ScanShapes scan_check(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& Bm, const Tensor& Cm,
                      const Tensor& Dp, const Tensor& z, const Tensor& dt_bias, const OptT& init, const OptT& starts) {
  MRL_CHECK(x.dim() == 3, "selective_scan: x must be [B, T, D], got ", shape_str(x));
  ScanShapes s{x.size(0), x.size(1), x.size(2), 0, dtype_code(x, "selective_scan: x")};
  MRL_CHECK(s.T >= 1 && s.B >= 1 && s.D >= 1, "selective_scan: empty x ", shape_str(x));
  const auto ty = x.scalar_type();
  check_act(x, "selective_scan: x", x, s.B, s.T, s.D, ty);
  check_act(dt, "selective_scan: dt", x, s.B, s.T, s.D, ty);
  MRL_CHECK(A_log.dim() == 2 && A_log.size(0) == s.D, "selective_scan: A_log must be [D, N], got ", shape_str(A_log));
  s.N = A_log.size(1);
  MRL_CHECK(s.N == 8 || s.N == 16, "selective_scan: d_state must be 8 or 16 in the CUDA kernel, got ", s.N);
  check_f32(A_log, "selective_scan: A_log", x, {s.D, s.N});
  check_act(Bm, "selective_scan: Bm", x, s.B, s.T, s.N, ty);
  check_act(Cm, "selective_scan: Cm", x, s.B, s.T, s.N, ty);
  check_f32(Dp, "selective_scan: D", x, {s.D});
  check_act(z, "selective_scan: z", x, s.B, s.T, s.D, ty);
  check_f32(dt_bias, "selective_scan: dt_bias", x, {s.D});
  if (init) check_f32(*init, "selective_scan: ssm_state", x, {s.B, s.D, s.N});
  check_starts(starts, x, s.B, s.T);
  return s;
}

mrl::ScanFwdParams scan_params(const ScanShapes& s, const Tensor& x, const Tensor& dt, const Tensor& A_log,
                               const Tensor& Bm, const Tensor& Cm, const Tensor& Dp, const Tensor& z,
                               const Tensor& dt_bias, const OptT& init, const OptT& starts) {
  mrl::ScanFwdParams p{};
  p.x = x.data_ptr(); p.x_sb = x.stride(0); p.x_st = x.stride(1);
  p.dt = dt.data_ptr(); p.dt_sb = dt.stride(0); p.dt_st = dt.stride(1);
  p.Bm = Bm.data_ptr(); p.B_sb = Bm.stride(0); p.B_st = Bm.stride(1);
  p.Cm = Cm.data_ptr(); p.C_sb = Cm.stride(0); p.C_st = Cm.stride(1);
  p.z = z.data_ptr(); p.z_sb = z.stride(0); p.z_st = z.stride(1);
  p.A_log = A_log.data_ptr<float>(); p.Dskip = Dp.data_ptr<float>(); p.dt_bias = dt_bias.data_ptr<float>();
  p.init = ptr_or_null<float>(init); p.starts = ptr_or_null<bool>(starts);
  p.B = (int)s.B; p.T = (int)s.T; p.D = (int)s.D; p.N = (int)s.N;
  return p;
}

std::vector<Tensor> scan_fwd(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& Bm,
                             const Tensor& Cm, const Tensor& Dp, const Tensor& z, const Tensor& dt_bias,
                             const OptT& init, const OptT& starts, bool need_ckpt, const OptT& final_out) {
  auto s = scan_check(x, dt, A_log, Bm, Cm, Dp, z, dt_bias, init, starts);
  if (final_out) {
    check_f32(*final_out, "selective_scan: final_out", x, {s.B, s.D, s.N});
    MRL_CHECK(!init || final_out->data_ptr() != init->data_ptr(), "selective_scan: final_out must not be the "
              "initial state (it is read while the final state is written)");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto f32 = x.options().dtype(at::kFloat);
  auto out = new_empty({s.B, s.T, s.D}, x.options());
  auto fin = final_out ? *final_out : new_empty({s.B, s.D, s.N}, f32);
  const int64_t nC = (s.T + mrl::scan_chunk() - 1) / mrl::scan_chunk();
  Tensor ckpt = need_ckpt ? new_empty({s.B, nC, s.D, s.N}, f32) : Tensor();
  auto ws = new_empty({mrl::scan_fwd_workspace((int)s.B, (int)s.T, (int)s.D, (int)s.N)}, f32);
  auto p = scan_params(s, x, dt, A_log, Bm, Cm, Dp, z, dt_bias, init, starts);
  p.out = out.data_ptr(); p.final_state = fin.data_ptr<float>(); p.ws = ws.data_ptr<float>();
  p.ckpt = need_ckpt ? ckpt.data_ptr<float>() : nullptr;
  raise_if(mrl::scan_fwd(s.dt, p, c10::cuda::getCurrentCUDAStream().stream()));
  return {out, fin, ckpt};
}

std::vector<Tensor> scan_bwd(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& Bm,
                             const Tensor& Cm, const Tensor& Dp, const Tensor& z, const Tensor& dt_bias,
                             const OptT& init, const OptT& starts, const Tensor& ckpt, const Tensor& dout,
                             const OptT& dfinal, bool need_dinit, const OptT& dz_out,
                             const std::optional<std::vector<Tensor>>& acc, const OptT& dbc_out) {
  auto s = scan_check(x, dt, A_log, Bm, Cm, Dp, z, dt_bias, init, starts);
  const int64_t nC = (s.T + mrl::scan_chunk() - 1) / mrl::scan_chunk();
  check_f32(ckpt, "selective_scan: checkpoints", x, {s.B, nC, s.D, s.N});
  check_act(dout, "selective_scan: grad_out", x, s.B, s.T, s.D, x.scalar_type());
  if (dfinal) check_f32(*dfinal, "selective_scan: grad_final_state", x, {s.B, s.D, s.N});
  const c10::cuda::CUDAGuard guard(x.device());
  auto f32 = x.options().dtype(at::kFloat);
  mrl::ScanBwdParams q{};
  q.f = scan_params(s, x, dt, A_log, Bm, Cm, Dp, z, dt_bias, init, starts);
  q.f.ckpt = ckpt.data_ptr<float>();
  auto dx = new_empty({s.B, s.T, s.D}, x.options());
  auto ddt = new_empty({s.B, s.T, s.D}, x.options());
  if (dz_out) check_act(*dz_out, "selective_scan: dz_out", x, s.B, s.T, s.D, x.scalar_type());
  if (acc) {
    MRL_CHECK(acc->size() == 3, "selective_scan: acc must be [dA_log_acc, dD_acc, ddt_bias_acc]");
    check_f32((*acc)[0], "selective_scan: dA_log_acc", x, {s.D, s.N});
    check_f32((*acc)[1], "selective_scan: dD_acc", x, {s.D});
    check_f32((*acc)[2], "selective_scan: ddt_bias_acc", x, {s.D});
  }
  Tensor dB, dC;
  if (dbc_out) {  // the reduction writes dB / dC straight into their columns: no concatenation after
    check_cuda(*dbc_out, "selective_scan: dbc_out", x);
    MRL_CHECK(dbc_out->scalar_type() == x.scalar_type(), "selective_scan: dbc_out: expected dtype ", x.scalar_type(),
              " (same as x), got ", dbc_out->scalar_type());
    std::tie(dB, dC) = mrl_binding::dbc_out_views(*dbc_out, s.B, s.T, s.N);
  } else {
    dB = new_empty({s.B, s.T, s.N}, x.options());
    dC = new_empty({s.B, s.T, s.N}, x.options());
  }
  auto dz = dz_out ? *dz_out : new_empty({s.B, s.T, s.D}, x.options());
  auto dA = acc ? (*acc)[0] : new_empty({s.D, s.N}, f32);
  auto dD = acc ? (*acc)[1] : new_empty({s.D}, f32);
  auto ddb = acc ? (*acc)[2] : new_empty({s.D}, f32);
  Tensor dinit = need_dinit ? new_empty({s.B, s.D, s.N}, f32) : Tensor();
  auto ws = new_empty({mrl::scan_bwd_workspace((int)s.B, (int)s.T, (int)s.D, (int)s.N)}, f32);
  q.dout = dout.data_ptr(); q.g_sb = dout.stride(0); q.g_st = dout.stride(1);
  q.dfinal = ptr_or_null<float>(dfinal);
  q.dx = dx.data_ptr(); q.ddt = ddt.data_ptr(); q.dB = dB.data_ptr(); q.dC = dC.data_ptr();
  q.dBC_st = dbc_out ? dbc_out->stride(0) : s.N;  // dB / dC rows: a buffer row, or N (contiguous)
  q.dz = dz.data_ptr(); q.dz_sb = dz.stride(0); q.dz_st = dz.stride(1); q.accumulate = acc.has_value();
  q.dA_log = dA.data_ptr<float>(); q.dD = dD.data_ptr<float>(); q.ddt_bias = ddb.data_ptr<float>();
  q.dinit = need_dinit ? dinit.data_ptr<float>() : nullptr;
  q.ws = ws.data_ptr<float>();
  raise_if(mrl::scan_bwd(s.dt, q, c10::cuda::getCurrentCUDAStream().stream()));
  return {dx, ddt, dA, dB, dC, dD, dz, ddb, dinit};
}


// ---------------- optimizer ----------------
void check_vec(const Tensor& t, const char* name, at::ScalarType ty, int64_t n, const Tensor& ref) {
  check_cuda(t, name, ref);
  MRL_CHECK(t.scalar_type() == ty, name, ": expected dtype ", ty, ", got ", t.scalar_type());
  MRL_CHECK(t.numel() == n, name, ": expected ", n, " elements, got shape ", shape_str(t));
  MRL_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

// grad_stats' checked parameters; `ws` receives the partial-sum workspace the params point into.
mrl::GradStatsParams grad_stats_build(const Tensor& grad, const OptT& extra_sq, const Tensor& loss_scale,
                                      const Tensor& hyper, Tensor& scalars, Tensor& counter, Tensor& ws) {
  MRL_CHECK(grad.dim() == 1, "grad_stats: grad must be a flat [P] arena, got ", shape_str(grad));
  const int64_t P = grad.numel();
  check_vec(grad, "grad_stats: grad", at::kFloat, P, grad);
  if (extra_sq) check_vec(*extra_sq, "grad_stats: extra_grad_sq", at::kFloat, 1, grad);
  check_vec(loss_scale, "grad_stats: loss_scale", at::kFloat, 1, grad);
  check_vec(hyper, "grad_stats: hyper", at::kDouble, 8, grad);
  check_vec(scalars, "grad_stats: scalars", at::kDouble, 8, grad);
  check_vec(counter, "grad_stats: counter", at::kInt, 1, grad);
  ws = new_empty({2 * (int64_t)mrl::grad_stats_blocks(P)}, grad.options().dtype(at::kDouble));
  return mrl::GradStatsParams{grad.data_ptr<float>(), P, ptr_or_null<float>(extra_sq), loss_scale.data_ptr<float>(),
                              hyper.data_ptr<double>(), scalars.data_ptr<double>(), ws.data_ptr<double>(),
                              reinterpret_cast<unsigned int*>(counter.data_ptr<int>())};
}

void grad_stats(const Tensor& grad, const OptT& extra_sq, const Tensor& loss_scale, const Tensor& hyper,
                Tensor& scalars, Tensor& counter) {
  const c10::cuda::CUDAGuard guard(grad.device());
  Tensor ws;
  const mrl::GradStatsParams p = grad_stats_build(grad, extra_sq, loss_scale, hyper, scalars, counter, ws);
  raise_if(mrl::grad_stats(p, c10::cuda::getCurrentCUDAStream().stream()));
}

mrl::AdamWParams adamw_build(Tensor& param, Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const Tensor& hyper,
                             const Tensor& scalars, int64_t n_decay, const OptT& compute, bool zero_grad) {
  MRL_CHECK(param.dim() == 1, "adamw_step: param must be a flat [P] arena, got ", shape_str(param));
  const int64_t P = param.numel();
  check_vec(param, "adamw_step: param", at::kFloat, P, param);
  check_vec(grad, "adamw_step: grad", at::kFloat, P, param);
  check_vec(exp_avg, "adamw_step: exp_avg", at::kFloat, P, param);
  check_vec(exp_avg_sq, "adamw_step: exp_avg_sq", at::kFloat, P, param);
  check_vec(hyper, "adamw_step: hyper", at::kDouble, 8, param);
  check_vec(scalars, "adamw_step: scalars", at::kDouble, 8, param);
  MRL_CHECK(n_decay >= 0 && n_decay <= P, "adamw_step: n_decay must be in [0, ", P, "], got ", n_decay);
  int cdt = mrl::kF32;
  if (compute) {
    check_cuda(*compute, "adamw_step: compute", param);
    cdt = dtype_code(*compute, "adamw_step: compute");
    MRL_CHECK(compute->numel() == P && compute->is_contiguous(), "adamw_step: compute must be a contiguous [",
                P, "] arena, got ", shape_str(*compute));
  }
  return mrl::AdamWParams{param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                          exp_avg_sq.data_ptr<float>(), hyper.data_ptr<double>(), scalars.data_ptr<double>(), P,
                          n_decay, compute ? compute->data_ptr() : nullptr, cdt, zero_grad};
}

void adamw_step(Tensor& param, Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const Tensor& hyper,
                const Tensor& scalars, int64_t n_decay, const OptT& compute, bool zero_grad) {
  const c10::cuda::CUDAGuard guard(param.device());
  const mrl::AdamWParams p = adamw_build(param, grad, exp_avg, exp_avg_sq, hyper, scalars, n_decay, compute, zero_grad);
  raise_if(mrl::adamw_step(p, c10::cuda::getCurrentCUDAStream().stream()));
}

// grad_stats then adamw_step: one cooperative launch where it fits (and `fused`), else the two launches; the
// same bits either way. Returns whether the fused launch ran.
bool optim_step(Tensor& param, Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const OptT& extra_sq,
                const Tensor& loss_scale, const Tensor& hyper, Tensor& scalars, Tensor& counter, int64_t n_decay,
                const OptT& compute, bool zero_grad, bool fused) {
  const c10::cuda::CUDAGuard guard(param.device());
  const mrl::AdamWParams a = adamw_build(param, grad, exp_avg, exp_avg_sq, hyper, scalars, n_decay, compute, zero_grad);
  Tensor ws;
  const mrl::GradStatsParams g = grad_stats_build(grad, extra_sq, loss_scale, hyper, scalars, counter, ws);
  const cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
  if (fused && mrl::optim_step_fits(a.P, a.compute ? a.compute_dtype : mrl::kF32)) {
    raise_if(mrl::optim_step(g, a, s));
    return true;
  }
  raise_if(mrl::grad_stats(g, s));
  raise_if(mrl::adamw_step(a, s));
  return false;
}


// ---------------- one-token backbone step ----------------
struct StepBuilt { mrl::StepParams p; int wcode; int64_t B, in_dim, dm; };

// Every check of the one-token step's arguments; the parameter block without x / starts / out.
StepBuilt step_build(const Tensor& x, const Tensor& inp_w, const Tensor& inp_b, const Tensor& normf_w,
                     const std::vector<std::vector<Tensor>>& layers, Tensor& conv_state, Tensor& ssm_state,
                     const OptT& starts, double eps) {
  MRL_CHECK(x.dim() == 2, "backbone_step: x_t must be [B, input_dim], got ", shape_str(x));
  const int64_t B = x.size(0), in_dim = x.size(1);
  check_f32(x, "backbone_step: x_t", x, {B, in_dim});
  MRL_CHECK(inp_w.dim() == 2 && inp_w.size(1) == in_dim, "backbone_step: input_proj.weight must be [d_model, ",
              in_dim, "], got ", shape_str(inp_w));
  const int64_t dm = inp_w.size(0);
  const auto wt = inp_w.scalar_type();
  const int wcode = dtype_code(inp_w, "backbone_step: input_proj.weight");
  auto check_w = [&](const Tensor& t, const char* name, at::IntArrayRef shape) {
    check_cuda(t, name, x);
    MRL_CHECK(t.scalar_type() == wt, name, ": expected the GEMM weight dtype ", wt, ", got ", t.scalar_type());
    MRL_CHECK(t.sizes() == shape, name, ": expected shape ", shape, ", got ", shape_str(t));
    MRL_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
  };
  check_w(inp_w, "backbone_step: input_proj.weight", {dm, in_dim});
  check_w(inp_b, "backbone_step: input_proj.bias", {dm});
  check_f32(normf_w, "backbone_step: norm_f.weight", x, {dm});
  const int64_t L = (int64_t)layers.size();
  MRL_CHECK(L >= 1 && L <= mrl::STEP_MAX_LAYERS, "backbone_step: n_layers must be in [1, 16], got ", L);
  MRL_CHECK(conv_state.dim() == 4 && conv_state.size(0) == L && conv_state.size(1) == B,
              "backbone_step: conv_state must be [", L, ", ", B, ", d_inner, d_conv-1], got ", shape_str(conv_state));
  const int64_t D = conv_state.size(2), K = conv_state.size(3) + 1;
  check_f32(conv_state, "backbone_step: conv_state", x, {L, B, D, K - 1});
  MRL_CHECK(ssm_state.dim() == 4, "backbone_step: ssm_state must be [L, B, d_inner, d_state], got ", shape_str(ssm_state));
  const int64_t N = ssm_state.size(3);
  check_f32(ssm_state, "backbone_step: ssm_state", x, {L, B, D, N});
  MRL_CHECK(N == 8 || N == 16, "backbone_step: d_state must be 8 or 16, got ", N);
  MRL_CHECK(K == 4, "backbone_step: d_conv must be 4, got ", K);
  if (starts) {
    check_cuda(*starts, "backbone_step: episode_starts", x);
    MRL_CHECK(starts->scalar_type() == at::kBool && starts->numel() == B && starts->is_contiguous(),
                "backbone_step: episode_starts must be a contiguous [", B, "] bool tensor, got ", shape_str(*starts),
                " ", starts->scalar_type());
  }
  mrl::StepParams p{};
  int64_t rank = -1;
  for (int64_t l = 0; l < L; ++l) {
    const auto& t = layers[l];
    MRL_CHECK(t.size() == 10, "backbone_step: layer ", l, " needs 10 tensors, got ", t.size());
    if (rank < 0) rank = t[5].dim() == 2 ? t[5].size(1) : -1;
    MRL_CHECK(rank >= 1, "backbone_step: dt_proj.weight must be [d_inner, dt_rank]");
    check_f32(t[0], "backbone_step: norm.weight", x, {dm});
    check_w(t[1], "backbone_step: in_proj.weight", {2 * D, dm});
    check_f32(t[2], "backbone_step: conv1d.weight (as [d_inner, d_conv])", x, {D, K});
    check_f32(t[3], "backbone_step: conv1d.bias", x, {D});
    check_w(t[4], "backbone_step: x_proj.weight", {rank + 2 * N, D});
    check_w(t[5], "backbone_step: dt_proj.weight", {D, rank});
    check_f32(t[6], "backbone_step: dt_proj.bias", x, {D});
    check_f32(t[7], "backbone_step: A_log", x, {D, N});
    check_f32(t[8], "backbone_step: D", x, {D});
    check_w(t[9], "backbone_step: out_proj.weight", {dm, D});
    p.layer[l] = mrl::StepLayer{t[0].data_ptr<float>(), t[1].data_ptr(), t[2].data_ptr<float>(), t[3].data_ptr<float>(),
                                t[4].data_ptr(), t[5].data_ptr(), t[6].data_ptr<float>(), t[7].data_ptr<float>(),
                                t[8].data_ptr<float>(), t[9].data_ptr()};
  }
  p.inp_w = inp_w.data_ptr(); p.inp_b = inp_b.data_ptr();
  p.normf_w = normf_w.data_ptr<float>(); p.conv_state = conv_state.data_ptr<float>();
  p.ssm_state = ssm_state.data_ptr<float>();
  p.B = (int)B; p.in_dim = (int)in_dim; p.dm = (int)dm; p.D = (int)D; p.N = (int)N; p.K = (int)K;
  p.rank = (int)rank; p.L = (int)L; p.eps = (float)eps;
  return StepBuilt{p, wcode, B, in_dim, dm};
}

Tensor backbone_step(const Tensor& x, const Tensor& inp_w, const Tensor& inp_b, const Tensor& normf_w,
                     const std::vector<std::vector<Tensor>>& layers, Tensor& conv_state, Tensor& ssm_state,
                     const OptT& starts, double eps, int64_t rows_per_block) {
  StepBuilt sb = step_build(x, inp_w, inp_b, normf_w, layers, conv_state, ssm_state, starts, eps);
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = new_empty({sb.B, sb.dm}, x.options());
  sb.p.x = x.data_ptr<float>(); sb.p.starts = ptr_or_null<bool>(starts); sb.p.out = out.data_ptr<float>();
  raise_if(mrl::backbone_step(sb.wcode, sb.p, (int)rows_per_block, c10::cuda::getCurrentCUDAStream().stream()));
  return out;
}

// The one-token step with every argument checked once (backbone_step_prepare): a call then checks only the
// per-token tensors (x_t, starts, out) and launches the kernel, without the ~30 weight checks of a full call.
// It holds references to the weights and states it points at (their storage cannot be freed under it); the
// caller re-prepares when a buffer is replaced (the Stepper's pointer guard).
struct PreparedStep {
  mrl::StepParams p;
  int wcode, rows;
  int64_t B, in_dim, dm;
  c10::Device device;
  std::vector<Tensor> keep;

  // x [B, in_dim] float32 contiguous, starts [B] bool contiguous or None, out [B, d_model] float32 contiguous,
  // all on the prepared device; False (nothing launched) when any of them does not fit, so the caller can take
  // the checked path for its error message.
  bool launch(const Tensor& x, const OptT& starts, Tensor& out) {
    if (!x.defined() || x.device() != device || x.scalar_type() != at::kFloat || x.dim() != 2 || x.size(0) != B ||
        x.size(1) != in_dim || !x.is_contiguous())
      return false;
    if (!out.defined() || out.device() != device || out.scalar_type() != at::kFloat || out.dim() != 2 ||
        out.size(0) != B || out.size(1) != dm || !out.is_contiguous())
      return false;
    if (starts && (starts->device() != device || starts->scalar_type() != at::kBool || starts->numel() != B ||
                   !starts->is_contiguous()))
      return false;
    const c10::cuda::CUDAGuard guard(device);
    mrl::StepParams q = p;
    q.x = x.data_ptr<float>();
    q.starts = starts ? starts->data_ptr<bool>() : nullptr;
    q.out = out.data_ptr<float>();
    raise_if(mrl::backbone_step(wcode, q, rows, c10::cuda::getCurrentCUDAStream().stream()));
    return true;
  }
};

PreparedStep backbone_step_prepare(const Tensor& x, const Tensor& inp_w, const Tensor& inp_b, const Tensor& normf_w,
                                   const std::vector<std::vector<Tensor>>& layers, Tensor& conv_state,
                                   Tensor& ssm_state, double eps, int64_t rows_per_block) {
  StepBuilt sb = step_build(x, inp_w, inp_b, normf_w, layers, conv_state, ssm_state, std::nullopt, eps);
  const c10::cuda::CUDAGuard guard(x.device());
  const char* err = nullptr;
  const int R = mrl::backbone_step_rows(sb.p, (int)rows_per_block, &err);
  raise_if(err);
  std::vector<Tensor> keep{inp_w, inp_b, normf_w, conv_state, ssm_state};
  for (const auto& l : layers) keep.insert(keep.end(), l.begin(), l.end());
  return PreparedStep{sb.p, sb.wcode, R, sb.B, sb.in_dim, sb.dm, x.device(), std::move(keep)};
}


// A captured CUDA graph launched straight from C++: cudaGraphLaunch on the current stream of the graph's device,
// with the buffers the graph reads held here and their data pointers compared with the captured ones first. It
// skips what torch.cuda.CUDAGraph.replay adds around the same cudaGraphLaunch (its Python wrapper, the GIL
// release, the device guard, the RNG generators' replay prologue), ~1-2 µs of host time on the one-token step,
// where the host's time is on the step's critical path (benchmarks/NOTES.md, thirty-first session). So it is
// only for graphs that draw no random numbers: their philox offsets would not advance (GraphSet's launcher).
// It holds the torch graph object, so the cudaGraphExec_t it launches lives as long as it does.
struct GraphLauncher {
  py::object graph;  // the torch.cuda.CUDAGraph that owns exec
  cudaGraphExec_t exec;
  c10::DeviceIndex device;
  std::vector<Tensor> bufs;  // undefined where the owner's buffer is None
  std::vector<const void*> ptrs;

  // RuntimeError where a held buffer's storage was replaced in place (`.data = ...`, `set_`)
  void check() const {
    for (size_t i = 0; i < bufs.size(); ++i)
      TORCH_CHECK(!bufs[i].defined() || bufs[i].data_ptr() == ptrs[i],
                  mrl_binding::cat("graph launch: buffer ", (int64_t)i, " captured by the CUDA graph has moved (its "
                                   "storage was replaced in place); capture the graph again"));
  }

  void launch() const {
    check();
    const c10::cuda::CUDAGuard guard(device);
    const cudaError_t e = cudaGraphLaunch(exec, c10::cuda::getCurrentCUDAStream(device).stream());
    TORCH_CHECK(e == cudaSuccess, mrl_binding::cat("graph launch: cudaGraphLaunch failed: ", cudaGetErrorString(e)));
  }
};

// graph: a torch.cuda.CUDAGraph after its capture; exec: its raw_cuda_graph_exec(); buffers: the tensors (or None)
// whose storage the graph reads, all on CUDA device `device`.
GraphLauncher graph_launcher(py::object graph, int64_t exec, int64_t device, const std::vector<OptT>& buffers) {
  MRL_CHECK(exec != 0, "graph_launcher: expected an instantiated graph (raw_cuda_graph_exec() != 0), got 0");
  MRL_CHECK(device >= 0 && device < (int64_t)c10::cuda::device_count(), "graph_launcher: expected a CUDA device "
            "index in [0, ", (int64_t)c10::cuda::device_count(), "), got ", device);
  GraphLauncher g{std::move(graph), reinterpret_cast<cudaGraphExec_t>(exec), (c10::DeviceIndex)device, {}, {}};
  for (size_t i = 0; i < buffers.size(); ++i) {
    const OptT& b = buffers[i];
    if (b && b->defined()) {
      MRL_CHECK(b->is_cuda() && b->device().index() == device, "graph_launcher: buffer ", (int64_t)i,
                ": expected a tensor on cuda:", device, ", got ", b->device());
      g.bufs.push_back(*b);
      g.ptrs.push_back(b->data_ptr());
    } else {
      g.bufs.emplace_back();
      g.ptrs.push_back(nullptr);
    }
  }
  return g;
}

// ---------------- RMSNorm ----------------
// Self-resetting counters for the kernels whose last block finishes a reduction: one slot per op kind and
// device, zeroed once (from torch's allocator, so a first use inside a graph capture is fine too).
unsigned int* counter_slot(const Tensor& ref, int slot) {
  static std::vector<Tensor> pool(64);
  const int dev = ref.get_device();
  MRL_CHECK(dev >= 0 && dev < 64, "counter_slot: bad device");
  if (!pool[dev].defined()) pool[dev] = at::zeros({64}, ref.options().dtype(at::kInt));
  return reinterpret_cast<unsigned int*>(pool[dev].data_ptr<int>()) + slot;
}

std::vector<Tensor> rmsnorm_fwd(const Tensor& x, const Tensor& w, double eps, at::ScalarType out_dtype,
                                const OptT& x_copy) {
  MRL_CHECK(x.dim() >= 1, "rms_norm: x must have a channel dim");
  const int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  check_cuda(x, "rms_norm: x", x);
  MRL_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "rms_norm: x must be contiguous float32, got ",
              x.scalar_type(), " strides ", x.strides());
  check_f32(w, "rms_norm: weight", x, {C});
  MRL_CHECK(C >= 1 && C <= 1024, "rms_norm: channels must be in [1, 1024], got ", C);
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = new_empty(x.sizes(), x.options().dtype(out_dtype));
  const int odt = dtype_code(out, "rms_norm: out_dtype");
  std::vector<int64_t> rshape(x.sizes().begin(), x.sizes().end());
  rshape.back() = 1;
  auto rstd = new_empty(rshape, x.options());
  mrl::NormFwdParams p{x.data_ptr<float>(), rows, (int)C, w.data_ptr<float>(), (float)eps, out.data_ptr(), odt,
                       rstd.data_ptr<float>()};
  if (x_copy) {
    check_cuda(*x_copy, "rms_norm: x_copy", x);
    MRL_CHECK(x_copy->scalar_type() == at::kFloat && x_copy->sizes() == x.sizes() && x_copy->is_contiguous(),
              "rms_norm: x_copy must be a contiguous float32 tensor shaped like x ", shape_str(x), ", got ",
              shape_str(*x_copy), " ", x_copy->scalar_type());
    MRL_CHECK(x_copy->data_ptr() != x.data_ptr(), "rms_norm: x_copy must not be x");
    p.x_copy = x_copy->data_ptr<float>();
  }
  if (rows) raise_if(mrl::norm_fwd(p, c10::cuda::getCurrentCUDAStream().stream()));
  return {out, rstd};
}

// The input projection and the first RMSNorm in one pass: h = x @ in_w^T + in_b (float32) -> (h, RMSNorm(h) in
// out_dtype, rstd). x [rows, in_dim] contiguous float32; optional x_copy receives a second copy of h.
std::vector<Tensor> input_rmsnorm_fwd(const Tensor& x, const Tensor& in_w, const Tensor& in_b, const Tensor& w,
                                      double eps, at::ScalarType out_dtype, const OptT& x_copy) {
  check_cuda(x, "input_rms_norm: x", x);
  MRL_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "input_rms_norm: x must be a "
            "contiguous float32 [rows, in_dim] tensor, got ", shape_str(x), " ", x.scalar_type());
  MRL_CHECK(in_w.dim() == 2, "input_rms_norm: in_w must be [C, in_dim], got ", shape_str(in_w));
  const int64_t rows = x.size(0), I = x.size(1), C = in_w.size(0);
  check_f32(in_w, "input_rms_norm: in_w", x, {C, I});
  check_f32(in_b, "input_rms_norm: in_b", x, {C});
  check_f32(w, "input_rms_norm: weight", x, {C});
  MRL_CHECK(C >= 1 && C <= 1024, "input_rms_norm: channels must be in [1, 1024], got ", C);
  MRL_CHECK(I >= 1 && I * C <= mrl::NORM_IN_MAX_WEIGHTS, "input_rms_norm: in_dim * C must be in [1, ",
            mrl::NORM_IN_MAX_WEIGHTS, "], got ", I, " * ", C);
  const c10::cuda::CUDAGuard guard(x.device());
  auto h = new_empty({rows, C}, x.options());
  auto out = new_empty({rows, C}, x.options().dtype(out_dtype));
  const int odt = dtype_code(out, "input_rms_norm: out_dtype");
  auto rstd = new_empty({rows, 1}, x.options());
  mrl::NormFwdParams p{nullptr, rows, (int)C, w.data_ptr<float>(), (float)eps, out.data_ptr(), odt,
                       rstd.data_ptr<float>()};
  p.in_x = x.data_ptr<float>();
  p.in_w = in_w.data_ptr<float>();
  p.in_b = in_b.data_ptr<float>();
  p.in_dim = (int)I;
  p.h_out = h.data_ptr<float>();
  if (x_copy) {
    check_cuda(*x_copy, "input_rms_norm: x_copy", x);
    MRL_CHECK(x_copy->scalar_type() == at::kFloat && x_copy->sizes() == h.sizes() && x_copy->is_contiguous(),
              "input_rms_norm: x_copy must be a contiguous float32 [", rows, ", ", C, "] tensor, got ",
              shape_str(*x_copy), " ", x_copy->scalar_type());
    p.x_copy = x_copy->data_ptr<float>();
  }
  if (rows) raise_if(mrl::norm_fwd(p, c10::cuda::getCurrentCUDAStream().stream()));
  return {h, out, rstd};
}

// fwd: {out, rstd} of the forward computed in the same pass (rmsnorm_fwd_bwd; dw_acc then assigned), or nullptr.
Tensor rmsnorm_bwd_impl(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& w, const OptT& dw_acc,
                        const OptT& dx_acc, const OptT& dx_c, const Tensor* fwd_out, double eps,
                        const OptT& dw_partials) {
  const int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  check_cuda(x, "rms_norm: x", x);
  MRL_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "rms_norm: x must be contiguous float32");
  check_cuda(dy, "rms_norm: grad_out", x);
  const int gdt = dtype_code(dy, "rms_norm: grad_out");
  MRL_CHECK(dy.numel() == x.numel() && dy.size(-1) == C && dy.is_contiguous(), "rms_norm: grad_out must be a "
              "contiguous tensor shaped like x ", shape_str(x), ", got ", shape_str(dy));
  check_cuda(rstd, "rms_norm: rstd", x);
  MRL_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() == rows && rstd.is_contiguous(),
              "rms_norm: rstd must be contiguous float32 with ", rows, " elements, got ", shape_str(rstd));
  check_f32(w, "rms_norm: weight", x, {C});
  MRL_CHECK(dw_acc.has_value() != dw_partials.has_value(), "rms_norm: expected exactly one of dw_acc (dL/dw summed "
            "into it) and dw_partials (its per-block partials), got ", dw_acc ? "both" : "neither");
  const int64_t nb = mrl::norm_bwd_blocks(rows, (int)C);
  if (dw_acc) {
    check_cuda(*dw_acc, "rms_norm: dw_acc", x);
    MRL_CHECK(dw_acc->scalar_type() == at::kFloat && dw_acc->numel() == C && dw_acc->is_contiguous(),
              "rms_norm: dw_acc must be a contiguous float32 [", C, "] tensor, got ", shape_str(*dw_acc));
  } else {
    check_cuda(*dw_partials, "rms_norm: dw_partials", x);
    MRL_CHECK(dw_partials->scalar_type() == at::kFloat && dw_partials->dim() == 2 && dw_partials->size(0) == nb &&
              dw_partials->size(1) == C && dw_partials->is_contiguous(), "rms_norm: dw_partials must be a contiguous "
              "float32 [norm_bwd_blocks(rows, C) = ", nb, ", ", C, "] tensor, got ", shape_str(*dw_partials), " (",
              dw_partials->scalar_type(), ")");
  }
  if (dx_acc) {
    check_cuda(*dx_acc, "rms_norm: dh_acc", x);
    MRL_CHECK(dx_acc->scalar_type() == at::kFloat && dx_acc->numel() == x.numel() && dx_acc->is_contiguous(),
                "rms_norm: dh_acc must be contiguous float32 shaped like x, got ", shape_str(*dx_acc));
  }
  MRL_CHECK(C >= 1 && C <= 512, "rms_norm backward: channels must be in [1, 512], got ", C);
  int dxc_code = -1;
  if (dx_c) {
    check_cuda(*dx_c, "rms_norm: dx_c", x);
    dxc_code = dtype_code(*dx_c, "rms_norm: dx_c");
    MRL_CHECK(dxc_code != mrl::kF32, "rms_norm: dx_c: expected bfloat16 or float16 (the float32 dx is the "
              "return value), got ", dx_c->scalar_type());
    MRL_CHECK(dx_c->numel() == x.numel() && dx_c->is_contiguous(), "rms_norm: dx_c: expected a contiguous tensor "
              "shaped like x ", shape_str(x), ", got ", shape_str(*dx_c));
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto dx = new_empty(x.sizes(), x.options());
  if (!rows) return dx;
  auto ws = dw_partials ? *dw_partials : new_empty({nb * C}, x.options());
  mrl::NormBwdParams p{dy.data_ptr(), gdt, x.data_ptr<float>(), rstd.data_ptr<float>(), w.data_ptr<float>(), rows,
                       (int)C, dx.data_ptr<float>(), ptr_or_null<float>(dx_acc),
                       dw_acc ? dw_acc->data_ptr<float>() : nullptr,
                       ws.data_ptr<float>(), counter_slot(x, 0)};
  p.partials_only = dw_partials ? 1 : 0;
  if (dx_c) {
    p.dx_c = dx_c->data_ptr();
    p.dxc_dtype = dxc_code;
  }
  if (fwd_out) {
    p.fwd_out = fwd_out->data_ptr<float>();
    p.fwd_rstd = rstd.data_ptr<float>();
    p.eps = (float)eps;
    p.dw_assign = 1;
  }
  raise_if(mrl::norm_bwd(p, c10::cuda::getCurrentCUDAStream().stream()));
  return dx;
}

Tensor rmsnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& w, const OptT& dw_acc,
                   const OptT& dx_acc, const OptT& dx_c, const OptT& dw_partials) {
  return rmsnorm_bwd_impl(dy, x, rstd, w, dw_acc, dx_acc, dx_c, nullptr, 0.0, dw_partials);
}

// RMSNorm forward and backward in one pass, for a caller that knows dL/dout before the forward: x [..., C]
// contiguous float32 -> (out float32, rstd [..., 1], dx float32); dw_out [C] = sum_rows dy * xhat (assigned), or
// its per-block partials into dw_partials (rmsnorm_bwd's).
std::vector<Tensor> rmsnorm_fwd_bwd(const Tensor& x, const Tensor& w, double eps, const Tensor& dy,
                                    const OptT& dw_out, const OptT& dx_c, const OptT& dw_partials) {
  MRL_CHECK(x.dim() >= 1, "rms_norm: x must have a channel dim");
  check_cuda(x, "rms_norm: x", x);
  MRL_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "rms_norm: x must be contiguous float32");
  std::vector<int64_t> rshape(x.sizes().begin(), x.sizes().end());
  rshape.back() = 1;
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = new_empty(x.sizes(), x.options());
  auto rstd = new_empty(rshape, x.options());
  auto dx = rmsnorm_bwd_impl(dy, x, rstd, w, dw_out, OptT(), dx_c, &out, eps, dw_partials);
  return {out, rstd, dx};
}


// ---------------- small GEMMs of the fused training step (wgrad.cu, xdt.cu) ----------------
// An attribute of ref's device, read once per device (slot: which of the cached attributes; fallback where the
// driver reports <= 0).
int device_attr(const Tensor& ref, cudaDeviceAttr attr, int slot, int fallback) {
  static std::vector<std::array<int, 2>> cache(64, {0, 0});
  const int dev = ref.get_device();
  MRL_CHECK(dev >= 0 && dev < 64, "device_attr: bad device ", dev);
  int& v = cache[dev][slot];
  if (!v) {
    int n = 0;
    cudaError_t e = cudaDeviceGetAttribute(&n, attr, dev);
    MRL_RAISE_IF(e == cudaSuccess ? nullptr : cudaGetErrorString(e));
    v = n > 0 ? n : fallback;
  }
  return v;
}
int sm_count(const Tensor& ref) { return device_attr(ref, cudaDevAttrMultiProcessorCount, 0, 132); }
int cc_major(const Tensor& ref) { return device_attr(ref, cudaDevAttrComputeCapabilityMajor, 1, 0); }

// Tile counters of the grouped weight-gradient kernel: zero once, left zero by every launch.
constexpr int64_t WGRAD_COUNTERS = 1 << 16;
unsigned int* wgrad_counters(const Tensor& ref) {
  static std::vector<Tensor> pool(64);
  const int dev = ref.get_device();
  MRL_CHECK(dev >= 0 && dev < 64, "wgrad: bad device");
  if (!pool[dev].defined()) pool[dev] = at::zeros({WGRAD_COUNTERS}, ref.options().dtype(at::kInt));
  return reinterpret_cast<unsigned int*>(pool[dev].data_ptr<int>());
}

// A 2-D operand with unit column stride (row stride free), in a float dtype.
void check_mat(const Tensor& t, const char* name, const Tensor& ref, int64_t rows) {
  check_cuda(t, name, ref);
  MRL_CHECK(t.dim() == 2, name, ": expected a 2-D tensor, got shape ", shape_str(t));
  MRL_CHECK(t.size(0) == rows, name, ": expected ", rows, " rows (K), got shape ", shape_str(t));
  MRL_CHECK(t.size(1) <= 1 || t.stride(1) == 1, name, ": the last dim must have stride 1, got strides ",
            t.strides());
  MRL_CHECK(t.size(1) > 0 && t.stride(0) >= t.size(1), name, ": rows must not overlap, got shape ", shape_str(t),
            " strides ", t.strides());
}

// jobs: [(a [K, M], b [K, N] or None, c [M, N] float32)]: c += a^T b (b None: c [M] or [M, 1] += column
// sums of a). One launch for every job.
void wgrad_grouped(const std::vector<std::tuple<Tensor, OptT, Tensor>>& jobs, int64_t slice, bool tensor_cores) {
  const int64_t nj = (int64_t)jobs.size();
  MRL_CHECK(nj >= 1 && nj <= mrl::WGRAD_MAX_JOBS, "wgrad_grouped: expected 1..", mrl::WGRAD_MAX_JOBS,
            " jobs, got ", nj);
  const Tensor& ref = std::get<0>(jobs[0]);
  mrl::WGradParams p{};
  p.n_jobs = (int)nj;
  for (int64_t j = 0; j < nj; ++j) {
    const Tensor& a = std::get<0>(jobs[j]);
    const OptT& b = std::get<1>(jobs[j]);
    const Tensor& c = std::get<2>(jobs[j]);
    MRL_CHECK(a.dim() == 2, "wgrad_grouped: job ", j, ": a must be [K, M], got ", shape_str(a));
    const int64_t K = a.size(0), M = a.size(1);
    check_mat(a, "wgrad_grouped: a", ref, K);
    const int adt = dtype_code(a, "wgrad_grouped: a");
    int64_t N = 1;
    int bdt = mrl::kF32;
    if (b) {
      check_mat(*b, "wgrad_grouped: b", ref, K);
      N = b->size(1);
      bdt = dtype_code(*b, "wgrad_grouped: b");
    }
    check_cuda(c, "wgrad_grouped: c", ref);
    MRL_CHECK(c.scalar_type() == at::kFloat, "wgrad_grouped: job ", j, ": c: expected float32, got ", c.scalar_type());
    const bool c_ok = b ? (c.dim() == 2 && c.size(0) == M && c.size(1) == N)
                        : ((c.dim() == 1 && c.size(0) == M) || (c.dim() == 2 && c.size(0) == M && c.size(1) == 1));
    MRL_CHECK(c_ok, "wgrad_grouped: job ", j, ": c: expected shape [", M, ", ", N, "], got ", shape_str(c));
    const int64_t ldc = c.dim() == 2 ? c.stride(0) : 1;
    MRL_CHECK(c.dim() == 1 ? c.stride(0) == 1 : (N <= 1 || c.stride(1) == 1) && ldc >= N,
              "wgrad_grouped: job ", j, ": c must have unit column stride, got strides ", c.strides());
    MRL_CHECK(M <= std::numeric_limits<int>::max() / 2 && N <= std::numeric_limits<int>::max() / 2,
              "wgrad_grouped: job ", j, ": M, N too large");
    p.job[j] = mrl::WGradJob{a.data_ptr(), a.stride(0), adt, b ? b->data_ptr() : nullptr, b ? b->stride(0) : 0, bdt,
                             c.data_ptr<float>(), c.dim() == 2 ? ldc : 1, (int)M, (int)N, K, 0, 0, 0, 0, 0, 0};
  }
  const c10::cuda::CUDAGuard guard(ref.device());
  MRL_CHECK(slice >= 0, "wgrad_grouped: slice: expected 0 (the plan's choice) or a K-slice length > 0, got ", slice);
  // tensor cores (mma.sync bf16 / f16) from compute capability 8.0
  const bool mma = tensor_cores && cc_major(ref) >= 8;
  const int64_t ws_floats = mrl::wgrad_plan(p, sm_count(ref), slice, mma);
  MRL_CHECK(p.n_tiles <= WGRAD_COUNTERS, "wgrad_grouped: ", p.n_tiles, " output tiles, at most ", WGRAD_COUNTERS);
  Tensor ws;
  if (ws_floats > 0) {
    ws = new_empty({ws_floats}, ref.options().dtype(at::kFloat));
    p.ws = ws.data_ptr<float>();
  }
  p.counters = wgrad_counters(ref);
  raise_if(mrl::wgrad(p, c10::cuda::getCurrentCUDAStream().stream()));
}

void check_rows(const Tensor& t, const char* name, const Tensor& ref, int64_t rows, int64_t cols) {
  check_cuda(t, name, ref);
  MRL_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, ": expected shape [", rows, ", ", cols,
            "], got ", shape_str(t));
  MRL_CHECK(t.scalar_type() == ref.scalar_type(), name, ": expected dtype ", ref.scalar_type(), ", got ",
            t.scalar_type());
  MRL_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

// The checks of xdt_fwd's weights against xc [rows, D] (ref: xc, or the conv input with xc's dtype and device);
// returns the params with dbc [rows, E] and dt [rows, D] allocated into dbc / dto.
mrl::XdtFwdParams xdt_fwd_params(const Tensor& ref, int64_t rows, int64_t D, const Tensor& wx, const Tensor& wdt,
                                 Tensor& dbc, Tensor& dto) {
  MRL_CHECK(wx.dim() == 2 && wdt.dim() == 2, "xdt_fwd: x_proj.weight [E, d_inner] and dt_proj.weight [d_inner, R] "
            "expected, got ", shape_str(wx), " and ", shape_str(wdt));
  const int64_t E = wx.size(0), R = wdt.size(1);
  check_rows(wx, "xdt_fwd: x_proj.weight", ref, E, D);
  check_rows(wdt, "xdt_fwd: dt_proj.weight", ref, D, R);
  MRL_CHECK(R >= 1 && R <= E, "xdt_fwd: dt_rank must be in [1, ", E, "], got ", R);
  MRL_CHECK(mrl::xdt_smem_ok((int)E, (int)D), "xdt_fwd: x_proj.weight [", E, ", ", D, "] exceeds the kernel's "
            "shared memory");
  dbc = new_empty({rows, E}, ref.options());
  dto = new_empty({rows, D}, ref.options());
  return mrl::XdtFwdParams{nullptr, wx.data_ptr(), wdt.data_ptr(), dbc.data_ptr(), dto.data_ptr(), rows, (int)D,
                           (int)E, (int)R};
}

// xc [rows, D], wx [E, D], wdt [D, R] -> (dbc [rows, E], dt [rows, D]), one dtype.
std::vector<Tensor> xdt_fwd(const Tensor& xc, const Tensor& wx, const Tensor& wdt) {
  MRL_CHECK(xc.dim() == 2, "xdt_fwd: xc must be [rows, d_inner], got ", shape_str(xc));
  const int dt = dtype_code(xc, "xdt_fwd: xc");
  const int64_t rows = xc.size(0), D = xc.size(1);
  check_rows(xc, "xdt_fwd: xc", xc, rows, D);
  const c10::cuda::CUDAGuard guard(xc.device());
  Tensor dbc, dto;
  auto p = xdt_fwd_params(xc, rows, D, wx, wdt, dbc, dto);
  p.xc = xc.data_ptr();
  raise_if(mrl::xdt_fwd(dt, p, c10::cuda::getCurrentCUDAStream().stream()));
  return {dbc, dto};
}

// conv_fwd then xdt_fwd in one launch: x [B, T, D] (the conv input; last-dim stride 1), the conv's weight, bias,
// initial window, starts and final_out as conv_fwd, wx / wdt as xdt_fwd -> (xc [B, T, D], dbc [B*T, E],
// dt [B*T, D], final window [B, D, K-1]): the same values as the two calls.
std::vector<Tensor> conv_xdt_fwd(const Tensor& x, const Tensor& w, const Tensor& bias, const OptT& init,
                                 const OptT& starts, const OptT& final_out, const Tensor& wx, const Tensor& wdt) {
  const auto [B, T, D, K, dt] = conv_check(x, w, bias, init, starts);
  MRL_CHECK(K >= 2 && K <= 4, "causal_conv1d: d_conv must be 2, 3 or 4, got ", K);
  if (final_out) check_f32(*final_out, "causal_conv1d: final_out", x, {B, D, K - 1});
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor dbc, dto;
  auto p = xdt_fwd_params(x, B * T, D, wx, wdt, dbc, dto);
  auto out = new_empty({B, T, D}, x.options());
  auto fin = final_out ? *final_out : new_empty({B, D, K - 1}, x.options().dtype(at::kFloat));
  p.xc = out.data_ptr();
  p.conv_on = 1;
  p.conv = mrl::ConvFwdParams{x.data_ptr(), x.stride(0), x.stride(1), w.data_ptr<float>(), bias.data_ptr<float>(),
                              ptr_or_null<float>(init), ptr_or_null<bool>(starts), out.data_ptr(),
                              fin.data_ptr<float>(), (int)B, (int)T, (int)D, (int)K};
  raise_if(mrl::xdt_fwd(dt, p, c10::cuda::getCurrentCUDAStream().stream()));
  return {out, dbc, dto, fin};
}

// ddt [rows, D], dB / dC [rows, N], wx [E, D], wdt [D, R], dxc [rows, D] (+= in place) -> ddbc [rows, E].
Tensor xdt_bwd(const Tensor& ddt, const Tensor& dB, const Tensor& dC, const Tensor& wx, const Tensor& wdt,
               Tensor& dxc) {
  MRL_CHECK(ddt.dim() == 2, "xdt_bwd: ddt must be [rows, d_inner], got ", shape_str(ddt));
  const int dt = dtype_code(ddt, "xdt_bwd: ddt");
  const int64_t rows = ddt.size(0), D = ddt.size(1);
  MRL_CHECK(wx.dim() == 2 && wdt.dim() == 2 && dB.dim() == 2, "xdt_bwd: 2-D dB, x_proj.weight and dt_proj.weight "
            "expected, got ", shape_str(dB), ", ", shape_str(wx), ", ", shape_str(wdt));
  const int64_t E = wx.size(0), R = wdt.size(1), N = dB.size(1);
  check_rows(ddt, "xdt_bwd: ddt", ddt, rows, D);
  check_rows(dB, "xdt_bwd: dB", ddt, rows, N);
  check_rows(dC, "xdt_bwd: dC", ddt, rows, N);
  check_rows(wx, "xdt_bwd: x_proj.weight", ddt, E, D);
  check_rows(wdt, "xdt_bwd: dt_proj.weight", ddt, D, R);
  check_rows(dxc, "xdt_bwd: dxc", ddt, rows, D);
  MRL_CHECK(R >= 1 && R + 2 * N == E, "xdt_bwd: x_proj.weight rows must be dt_rank + 2 d_state = ", R + 2 * N,
            ", got ", E);
  MRL_CHECK(mrl::xdt_smem_ok((int)E, (int)D), "xdt_bwd: x_proj.weight [", E, ", ", D, "] exceeds the kernel's "
            "shared memory");
  const c10::cuda::CUDAGuard guard(ddt.device());
  auto ddbc = new_empty({rows, E}, ddt.options());
  mrl::XdtBwdParams p{ddt.data_ptr(), dB.data_ptr(), dC.data_ptr(), wx.data_ptr(), wdt.data_ptr(), ddbc.data_ptr(),
                      dxc.data_ptr(), rows, (int)D, (int)E, (int)R, (int)N};
  raise_if(mrl::xdt_bwd(dt, p, c10::cuda::getCurrentCUDAStream().stream()));
  return ddbc;
}
// ---------------- Mamba-3 SISO mixer core (mamba3.cu; the CPU binding's m3_fwd / m3_bwd contract) ----------------
struct M3Sizes { int64_t B, T, Dp, H, P, N, R, di; };

M3Sizes m3_check(const Tensor& zxbc, int64_t headdim, const Tensor& dt_bias, const Tensor& B_bias,
                 const Tensor& C_bias, const Tensor& B_w, const Tensor& C_w, const Tensor& Dp, const OptT& out_w,
                 const OptT& carry0, const OptT& ssm0, const OptT& starts, double eps, double A_floor) {
  check_cuda(zxbc, "mamba3: zxbc", zxbc);
  MRL_CHECK(zxbc.dim() == 3 && zxbc.size(0) >= 1 && zxbc.size(1) >= 1, "mamba3: zxbc: expected shape [B, T, "
            "2 d_inner + 2 d_state + 3 nheads + R] with B, T >= 1, got ", shape_str(zxbc));
  MRL_CHECK(headdim >= 1, "mamba3: headdim: expected an int >= 1, got ", headdim);
  MRL_CHECK(dt_bias.dim() == 1 && dt_bias.size(0) >= 1, "mamba3: dt_bias: expected shape [nheads], got ",
            shape_str(dt_bias));
  MRL_CHECK(B_w.dim() == 1, "mamba3: B_norm.weight: expected shape [d_state], got ", shape_str(B_w));
  M3Sizes s{zxbc.size(0), zxbc.size(1), zxbc.size(2), dt_bias.size(0), headdim, B_w.size(0), 0, 0};
  s.di = s.H * s.P;
  s.R = s.Dp - 2 * s.di - 2 * s.N - 3 * s.H;
  MRL_CHECK(s.R >= 1 && 2 * s.R <= s.N, "mamba3: zxbc: expected a last dim of 2 d_inner + 2 d_state + 3 nheads + R "
            "= ", 2 * s.di + 2 * s.N + 3 * s.H, " + R with 1 <= R <= d_state / 2 = ", s.N / 2, ", got ", s.Dp);
  const char* why = mrl::m3_supported((int)s.P, (int)s.N, (int)s.R);
  MRL_CHECK(why == nullptr, why ? why : "", " (headdim ", s.P, ", d_state ", s.N, ")");
  check_act(zxbc, "mamba3: zxbc", zxbc, s.B, s.T, s.Dp, at::kFloat);
  check_f32(dt_bias, "mamba3: dt_bias", zxbc, {s.H});
  check_f32(B_bias, "mamba3: B_bias (as [nheads, d_state])", zxbc, {s.H, s.N});
  check_f32(C_bias, "mamba3: C_bias (as [nheads, d_state])", zxbc, {s.H, s.N});
  check_f32(B_w, "mamba3: B_norm.weight", zxbc, {s.N});
  check_f32(C_w, "mamba3: C_norm.weight", zxbc, {s.N});
  check_f32(Dp, "mamba3: D", zxbc, {s.H});
  if (out_w) check_f32(*out_w, "mamba3: norm.weight", zxbc, {s.di});
  if (carry0) check_f32(*carry0, "mamba3: carry ([angle | k | v])", zxbc, {s.B, s.H, s.R + s.N + s.P});
  if (ssm0) check_f32(*ssm0, "mamba3: ssm_state", zxbc, {s.B, s.di, s.N});
  check_starts(starts, zxbc, s.B, s.T);
  MRL_CHECK(eps > 0.0, "mamba3: eps: expected a value > 0, got ", eps);
  MRL_CHECK(A_floor > 0.0, "mamba3: A_floor: expected a value > 0, got ", A_floor);
  return s;
}

mrl::M3Params m3_params(const M3Sizes& s, const Tensor& zxbc, const Tensor& dt_bias, const Tensor& B_bias,
                        const Tensor& C_bias, const Tensor& B_w, const Tensor& C_w, const Tensor& Dp,
                        const OptT& out_w, const OptT& carry0, const OptT& ssm0, const OptT& starts, double eps,
                        double A_floor, bool heavy_tail) {
  mrl::M3Params a{};
  a.zxbc = zxbc.data_ptr<float>(); a.z_sb = zxbc.stride(0); a.z_st = zxbc.stride(1);
  a.dt_bias = dt_bias.data_ptr<float>(); a.B_bias = B_bias.data_ptr<float>(); a.C_bias = C_bias.data_ptr<float>();
  a.B_w = B_w.data_ptr<float>(); a.C_w = C_w.data_ptr<float>(); a.Dskip = Dp.data_ptr<float>();
  a.out_w = ptr_or_null<float>(out_w);
  a.carry0 = ptr_or_null<float>(carry0); a.ssm0 = ptr_or_null<float>(ssm0); a.starts = ptr_or_null<bool>(starts);
  a.eps = (float)eps; a.A_floor = (float)A_floor; a.heavy_tail = heavy_tail;
  a.B = (int)s.B; a.T = (int)s.T; a.H = (int)s.H; a.P = (int)s.P; a.N = (int)s.N; a.R = (int)s.R;
  return a;
}

int64_t m3_nchunks(int64_t T) { return (T + mrl::m3_chunk() - 1) / mrl::m3_chunk(); }

std::vector<Tensor> m3_fwd(const Tensor& zxbc, int64_t headdim, const Tensor& dt_bias, const Tensor& B_bias,
                           const Tensor& C_bias, const Tensor& B_w, const Tensor& C_w, const Tensor& Dp,
                           const OptT& out_w, const OptT& carry0, const OptT& ssm0, const OptT& starts, double eps,
                           double A_floor, bool heavy_tail, bool need_ckpt) {
  const auto s = m3_check(zxbc, headdim, dt_bias, B_bias, C_bias, B_w, C_w, Dp, out_w, carry0, ssm0, starts, eps,
                          A_floor);
  const c10::cuda::CUDAGuard guard(zxbc.device());
  auto f32 = zxbc.options();
  auto y = new_empty({s.B, s.T, s.di}, f32);
  auto carry_f = new_empty({s.B, s.H, s.R + s.N + s.P}, f32);
  auto ssm_f = new_empty({s.B, s.di, s.N}, f32);
  Tensor ckpt = need_ckpt ? new_empty({s.B, m3_nchunks(s.T), s.H, mrl::m3_ckpt_len((int)s.P, (int)s.N, (int)s.R)}, f32)
                          : Tensor();
  auto a = m3_params(s, zxbc, dt_bias, B_bias, C_bias, B_w, C_w, Dp, out_w, carry0, ssm0, starts, eps, A_floor,
                     heavy_tail);
  a.y = y.data_ptr<float>(); a.carry_f = carry_f.data_ptr<float>(); a.ssm_f = ssm_f.data_ptr<float>();
  a.ckpt = need_ckpt ? ckpt.data_ptr<float>() : nullptr;
  raise_if(mrl::m3_fwd(a, c10::cuda::getCurrentCUDAStream().stream()));
  return {y, carry_f, ssm_f, ckpt};
}

// One token, the state advanced in place: zxbc [B, Dp], carry [B, H, R + N + P], ssm [B, H P, N],
// starts [B] or None -> y [B, H P]. Allocates only y; no sync (CUDA-graph capturable).
Tensor m3_step(const Tensor& zxbc, int64_t headdim, const Tensor& dt_bias, const Tensor& B_bias, const Tensor& C_bias,
               const Tensor& B_w, const Tensor& C_w, const Tensor& Dp, const OptT& out_w, Tensor& carry, Tensor& ssm,
               const OptT& starts, double eps, double A_floor, bool heavy_tail) {
  MRL_CHECK(zxbc.dim() == 2, "mamba3_step: zxbc: expected shape [B, Dp], got ", shape_str(zxbc));
  OptT st;
  if (starts) {
    MRL_CHECK(starts->numel() == zxbc.size(0), "mamba3_step: episode_starts: expected ", zxbc.size(0),
              " elements, got shape ", shape_str(*starts));
    st = starts->view({zxbc.size(0), 1});
  }
  const Tensor z3 = zxbc.unsqueeze(1);
  const auto s = m3_check(z3, headdim, dt_bias, B_bias, C_bias, B_w, C_w, Dp, out_w, carry, ssm, st, eps, A_floor);
  const c10::cuda::CUDAGuard guard(zxbc.device());
  auto y = new_empty({s.B, s.di}, zxbc.options());
  auto a = m3_params(s, z3, dt_bias, B_bias, C_bias, B_w, C_w, Dp, out_w, carry, ssm, st, eps, A_floor, heavy_tail);
  a.y = y.data_ptr<float>(); a.carry_f = carry.data_ptr<float>(); a.ssm_f = ssm.data_ptr<float>(); a.ckpt = nullptr;
  raise_if(mrl::m3_fwd(a, c10::cuda::getCurrentCUDAStream().stream()));
  return y;
}

std::vector<Tensor> m3_bwd(const Tensor& zxbc, int64_t headdim, const Tensor& dt_bias, const Tensor& B_bias,
                           const Tensor& C_bias, const Tensor& B_w, const Tensor& C_w, const Tensor& Dp,
                           const OptT& out_w, const OptT& carry0, const OptT& ssm0, const OptT& starts, double eps,
                           double A_floor, bool heavy_tail, const Tensor& ckpt, const Tensor& dy, const OptT& dcarry,
                           const OptT& dssm, const OptT& dzxbc_out, const std::optional<std::vector<Tensor>>& acc) {
  const auto s = m3_check(zxbc, headdim, dt_bias, B_bias, C_bias, B_w, C_w, Dp, out_w, carry0, ssm0, starts, eps,
                          A_floor);
  check_f32(ckpt, "mamba3: ckpt", zxbc, {s.B, m3_nchunks(s.T), s.H, mrl::m3_ckpt_len((int)s.P, (int)s.N, (int)s.R)});
  check_f32(dy, "mamba3: grad_y", zxbc, {s.B, s.T, s.di});
  if (dcarry) check_f32(*dcarry, "mamba3: grad_final_carry", zxbc, {s.B, s.H, s.R + s.N + s.P});
  if (dssm) check_f32(*dssm, "mamba3: grad_final_ssm", zxbc, {s.B, s.di, s.N});
  if (dzxbc_out) check_f32(*dzxbc_out, "mamba3: dzxbc_out", zxbc, {s.B, s.T, s.Dp});
  const size_t n_acc = out_w ? 7 : 6;
  if (acc) {
    MRL_CHECK(acc->size() == n_acc, "mamba3: acc: expected ", (int64_t)n_acc, " tensors, got ", (int64_t)acc->size());
    check_f32((*acc)[0], "mamba3: ddt_bias_acc", zxbc, {s.H});
    check_f32((*acc)[1], "mamba3: dB_bias_acc (as [nheads, d_state])", zxbc, {s.H, s.N});
    check_f32((*acc)[2], "mamba3: dC_bias_acc (as [nheads, d_state])", zxbc, {s.H, s.N});
    check_f32((*acc)[3], "mamba3: dB_norm_w_acc", zxbc, {s.N});
    check_f32((*acc)[4], "mamba3: dC_norm_w_acc", zxbc, {s.N});
    check_f32((*acc)[5], "mamba3: dD_acc", zxbc, {s.H});
    if (out_w) check_f32((*acc)[6], "mamba3: dnorm_w_acc", zxbc, {s.di});
  }
  const c10::cuda::CUDAGuard guard(zxbc.device());
  auto f32 = zxbc.options();
  std::vector<Tensor> g(n_acc);
  if (acc) {
    g = *acc;
  } else {
    g[0] = at::zeros({s.H}, f32); g[1] = at::zeros({s.H, s.N}, f32); g[2] = at::zeros({s.H, s.N}, f32);
    g[3] = at::zeros({s.N}, f32); g[4] = at::zeros({s.N}, f32); g[5] = at::zeros({s.H}, f32);
    if (out_w) g[6] = at::zeros({s.di}, f32);
  }
  auto dz = dzxbc_out ? *dzxbc_out : new_empty({s.B, s.T, s.Dp}, f32);
  auto ws = new_empty({mrl::m3_bwd_workspace((int)s.B, (int)s.T, (int)s.H, (int)s.P, (int)s.N, (int)s.R)}, f32);
  auto a = m3_params(s, zxbc, dt_bias, B_bias, C_bias, B_w, C_w, Dp, out_w, carry0, ssm0, starts, eps, A_floor,
                     heavy_tail);
  mrl::M3BwdParams b{};
  b.ckpt = ckpt.data_ptr<float>(); b.dy = dy.data_ptr<float>();
  b.dcarry = ptr_or_null<float>(dcarry); b.dssm = ptr_or_null<float>(dssm);
  b.dzxbc = dz.data_ptr<float>();
  b.ddt_bias = g[0].data_ptr<float>(); b.dB_bias = g[1].data_ptr<float>(); b.dC_bias = g[2].data_ptr<float>();
  b.dB_w = g[3].data_ptr<float>(); b.dC_w = g[4].data_ptr<float>(); b.dD = g[5].data_ptr<float>();
  b.dout_w = out_w ? g[6].data_ptr<float>() : nullptr;
  b.ws = ws.data_ptr<float>();
  raise_if(mrl::m3_bwd(a, b, c10::cuda::getCurrentCUDAStream().stream()));
  std::vector<Tensor> out{dz};
  for (auto& t : g) out.push_back(t);
  if (!out_w) out.push_back(Tensor());
  return out;
}
// ---------------- end of the Mamba-3 block ----------------

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mamba_rl CUDA kernels (csrc/; driven by mamba_rl/ops/*.py and mamba_rl/model/fused.py)";
  m.def("conv_fwd", &conv_fwd, "causal conv1d + SiLU forward -> (out, final_state); optional final_out [B, D, K-1] "
        "float32 (e.g. a layer's slice of a stacked state) receives the final state", py::arg("x"), py::arg("weight"),
        py::arg("bias"), py::arg("init"), py::arg("starts"), py::arg("final_out") = py::none());
  m.def("conv_bwd", &conv_bwd, "causal conv1d + SiLU backward -> (dx, dweight, dbias, dinit); optional strided "
        "dx_out and dw_acc/db_acc (added into); partials=True: dweight [B * ceil(T / 16), D * K] and dbias "
        "[B * ceil(T / 16), D], float32 views of one workspace whose column sums are dweight flattened ([D][K] "
        "order) and dbias (one launch, no sums)", py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("init"),
        py::arg("starts"), py::arg("dout"), py::arg("dfinal"), py::arg("need_dinit"), py::arg("dx_out") = py::none(),
        py::arg("dw_acc") = py::none(), py::arg("db_acc") = py::none(), py::arg("partials") = false);
  m.def("scan_fwd", &scan_fwd, "selective scan forward -> (y, final_state, checkpoints); optional final_out "
        "[B, D, N] float32 (e.g. a layer's slice of a stacked state) receives the final state", py::arg("x"),
        py::arg("dt"), py::arg("A_log"), py::arg("Bm"), py::arg("Cm"), py::arg("D"), py::arg("z"),
        py::arg("dt_bias"), py::arg("init"), py::arg("starts"), py::arg("need_ckpt"),
        py::arg("final_out") = py::none());
  m.def("scan_bwd", &scan_bwd, "selective scan backward -> (dx, ddt, dA_log, dB, dC, dD, dz, ddt_bias, dinit); "
        "optional strided dz_out and acc=[dA_log, dD, ddt_bias] (added into); optional dbc_out [B*T, dt_rank + 2N] "
        "(x's dtype, unit column stride, row stride >= dt_rank + 2N): dB / dC are written into its last 2N columns "
        "(the others untouched) and returned as [B, T, N] views of them, the same bits; ValueError naming the "
        "expected and received value for a bad shape, stride, dtype or device", py::arg("x"), py::arg("dt"),
        py::arg("A_log"), py::arg("Bm"), py::arg("Cm"), py::arg("D"), py::arg("z"), py::arg("dt_bias"),
        py::arg("init"), py::arg("starts"), py::arg("ckpt"), py::arg("dout"), py::arg("dfinal"),
        py::arg("need_dinit"), py::arg("dz_out") = py::none(), py::arg("acc") = py::none(),
        py::arg("dbc_out") = py::none());
  m.def("grad_stats", &grad_stats, "global grad norm, clip coef, overflow flag, bias corrections (in place)");
  m.def("adamw_step", &adamw_step, "flat-arena AdamW with decay boundary and compute copy (in place); zero_grad: "
        "grad is zeroed once read", py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("hyper"), py::arg("scalars"), py::arg("n_decay"), py::arg("compute"), py::arg("zero_grad") = false);
  m.def("optim_step", &optim_step, "grad_stats then adamw_step (one cooperative launch where it fits; the same bits); "
        "returns whether the fused launch ran",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("extra_sq"),
        py::arg("loss_scale"), py::arg("hyper"), py::arg("scalars"), py::arg("counter"), py::arg("n_decay"),
        py::arg("compute"), py::arg("zero_grad"), py::arg("fused") = true);
  m.def("backbone_step", &backbone_step, "one token through the whole backbone (one launch); states in place");
  py::class_<PreparedStep>(m, "PreparedStep", "one-token step with its weights and states checked and bound once")
      .def("launch", &PreparedStep::launch, "launch on x_t [B, in_dim] f32 (starts [B] bool or None) into out "
           "[B, d_model] f32; False (nothing launched) when an argument does not fit", py::arg("x"),
           py::arg("starts"), py::arg("out"))
      .def_readonly("rows_per_block", &PreparedStep::rows);
  m.def("backbone_step_prepare", &backbone_step_prepare, "check and bind the one-token step's weights and states "
        "once (x gives B, input_dim and the device) -> PreparedStep");
  py::class_<GraphLauncher>(m, "GraphLauncher", "a captured CUDA graph launched from C++ with its buffers' pointers "
                            "checked (graphs that draw no random numbers)")
      .def("check", &GraphLauncher::check, "RuntimeError when a held buffer's data pointer changed")
      .def("launch", &GraphLauncher::launch, "check the buffers' data pointers, then cudaGraphLaunch on the current "
           "stream; RuntimeError when a buffer moved or the launch fails");
  m.def("graph_launcher", &graph_launcher, "GraphLauncher for a captured torch.cuda.CUDAGraph", py::arg("graph"),
        py::arg("exec"), py::arg("device"), py::arg("buffers"));
  m.def("conv_xdt_fwd", &conv_xdt_fwd, "causal conv1d + SiLU, then x_proj and dt_proj, in one launch -> (xc, dbc, dt, "
        "final conv window): the values of conv_fwd then xdt_fwd", py::arg("x"), py::arg("w"), py::arg("bias"),
        py::arg("init"), py::arg("starts"), py::arg("final_out"), py::arg("wx"), py::arg("wdt"));
  m.def("rmsnorm_fwd", &rmsnorm_fwd, "RMSNorm forward -> (out in out_dtype, rstd [..., 1]); optional x_copy (float32, "
        "shaped like x) receives a copy of x in the same pass", py::arg("x"), py::arg("w"), py::arg("eps"),
        py::arg("out_dtype"), py::arg("x_copy") = py::none());
  m.def("input_rmsnorm_fwd", &input_rmsnorm_fwd, "the input projection and RMSNorm in one pass -> (h = x @ in_w^T + "
        "in_b float32, RMSNorm(h) in out_dtype, rstd [rows, 1]); optional x_copy receives a copy of h",
        py::arg("x"), py::arg("in_w"), py::arg("in_b"), py::arg("w"), py::arg("eps"), py::arg("out_dtype"),
        py::arg("x_copy") = py::none());
  m.def("rmsnorm_fwd_bwd", &rmsnorm_fwd_bwd, "RMSNorm forward and backward in one pass -> (out float32, rstd [..., 1], "
        "dx); dw_out [C] = dL/dw (assigned), or dw_partials as rmsnorm_bwd's; optional dx_c receives a bf16 / f16 "
        "copy of dx", py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("dy"), py::arg("dw_out"),
        py::arg("dx_c") = py::none(), py::arg("dw_partials") = py::none());
  m.def("rmsnorm_bwd", &rmsnorm_bwd, "RMSNorm backward -> dx (+ dh_acc); adds dL/dw into dw_acc, or (dw_acc None) "
        "writes its per-block partials into dw_partials, float32 [norm_bwd_blocks(rows, C), C], whose column sums "
        "are dL/dw; optional dx_c (bf16/f16, written with dx cast)", py::arg("dy"), py::arg("x"), py::arg("rstd"),
        py::arg("w"), py::arg("dw_acc"), py::arg("dx_acc"), py::arg("dx_c") = py::none(),
        py::arg("dw_partials") = py::none());
  m.def("norm_bwd_blocks", &mrl::norm_bwd_blocks, "the RMSNorm backward's grid for rows x C (its dw_partials' rows)",
        py::arg("rows"), py::arg("C"));
  m.def("wgrad_grouped", &wgrad_grouped, "grouped weight gradients, one launch: for each (a [K, M], b [K, N] or "
        "None, c [M, N] float32) c += a^T b (None: column sums of a); slice > 0 forces the K-slice length "
        "(benchmarks; 0: the plan's choice); tensor_cores=False keeps bf16 / f16 jobs on the FFMA path "
        "(comparisons)", py::arg("jobs"), py::arg("slice") = 0, py::arg("tensor_cores") = true);
  m.def("xdt_fwd", &xdt_fwd, "x_proj + dt_proj forward of one layer -> (dbc [rows, E], dt [rows, d_inner])");
  m.def("xdt_bwd", &xdt_bwd, "x_proj + dt_proj backward of one layer -> ddbc [rows, E]; dxc += ddbc @ x_proj.weight "
        "in place");
  m.def("set_poison", &set_poison, "fill every output/workspace with NaN on allocation (tests)");
  m.def("scan_chunk", &mrl::scan_chunk, "checkpoint interval of the scan backward");
  m.def("scan_segments", &mrl::scan_segments, "time segments of the scan's two-level split for (B, T, D, N, bwd)");
  m.def("scan_set_segments", &mrl::scan_set_segments, "force the scan's segment count (0: automatic; tests)");
  m.def("norm_set_inreg", &mrl::norm_set_inreg, "whether input_rmsnorm_fwd may keep the input projection's weights "
        "in registers where in_dim <= 32 and d_model <= 128 (True, the default) or must read them from shared "
        "memory (False: the same bits; tests)", py::arg("on"));
  m.def("scan_set_bwd_blocks", [](int64_t n) {
          MRL_CHECK(n == 0 || n == 2 || n == 3 || n == 4,
                    "scan_set_bwd_blocks: expected 0 (automatic), 2, 3 or 4, got ", n);
          mrl::scan_set_bwd_blocks((int)n);
        }, "force the scan backward's build: 3, or at d_state 16 4 or 2 (the pair build: 8 states a thread) "
           "blocks per SM, its split sized for it; 0: automatic");
  m.def("set_coop", [](int64_t mask) {
          MRL_CHECK(mask >= 0 && mask <= mrl::COOP_ALL, "set_coop: expected a mask in 0..", (int)mrl::COOP_ALL,
                    " (1 scan forward, 2 scan backward, 4 conv backward), got ", mask);
          mrl::set_coop((int)mask);
        }, "which kernels may run their passes as one cooperative launch: a mask of 1 (scan forward), 2 (scan "
        "backward), 4 (conv backward); 7 (all) is the default, 0 none (the same bits; tests, benchmarks); ValueError "
        "outside 0..7");
  // Mamba-3 (mamba3.cu)
  m.def("m3_fwd", &m3_fwd, "Mamba-3 SISO mixer core forward -> [y, final carry, final ssm, ckpt or None]",
        py::arg("zxbc"), py::arg("headdim"), py::arg("dt_bias"), py::arg("B_bias"), py::arg("C_bias"),
        py::arg("B_norm_w"), py::arg("C_norm_w"), py::arg("D"), py::arg("norm_w"), py::arg("carry"), py::arg("ssm"),
        py::arg("starts"), py::arg("eps"), py::arg("A_floor"), py::arg("heavy_tail"), py::arg("need_ckpt"));
  m.def("m3_bwd", &m3_bwd, "Mamba-3 SISO mixer core backward -> [dzxbc, ddt_bias, dB_bias, dC_bias, dB_norm_w, "
        "dC_norm_w, dD, dnorm_w or None]", py::arg("zxbc"), py::arg("headdim"), py::arg("dt_bias"), py::arg("B_bias"),
        py::arg("C_bias"), py::arg("B_norm_w"), py::arg("C_norm_w"), py::arg("D"), py::arg("norm_w"), py::arg("carry"),
        py::arg("ssm"), py::arg("starts"), py::arg("eps"), py::arg("A_floor"), py::arg("heavy_tail"), py::arg("ckpt"),
        py::arg("dy"), py::arg("dcarry"), py::arg("dssm"), py::arg("dzxbc_out") = py::none(),
        py::arg("acc") = py::none());
  m.def("m3_step", &m3_step, "Mamba-3 mixer core for one token, carry / ssm advanced in place -> y [B, d_inner]",
        py::arg("zxbc"), py::arg("headdim"), py::arg("dt_bias"), py::arg("B_bias"), py::arg("C_bias"),
        py::arg("B_norm_w"), py::arg("C_norm_w"), py::arg("D"), py::arg("norm_w"), py::arg("carry"), py::arg("ssm"),
        py::arg("starts"), py::arg("eps"), py::arg("A_floor"), py::arg("heavy_tail"));
  m.def("m3_chunk", &mrl::m3_chunk, "checkpoint interval of the Mamba-3 backward (steps)");
}
