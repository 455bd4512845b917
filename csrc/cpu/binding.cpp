// The torch-facing file of the CPU kernels: the same Python functions, argument order, defaults and return
// lists as the CUDA binding (../binding.cpp), so mamba_rl/model/fused.py and mamba_rl/ops/*.py can drive
// either one.
//
// It checks every shape / dtype / device (MRL_CHECK of ../binding_common.h, shared with the CUDA binding:
// Python ValueError, message naming the argument, the expected and the received value), allocates outputs
// with torch, and calls the torch-free
// kernels in conv.cpp / scan.cpp / norm.cpp (and step.cpp for the one-token step) with
// nthreads = at::get_num_threads(), so torch.set_num_threads governs them like torch's own ops.
//
// Differences from the CUDA binding: float32 only (activations and weights); any d_state >= 1 and
// d_conv >= 1 (CUDA: 8/16 and 4); any number of layers in backbone_step; rows_per_block is ignored; the
// scan checkpoint interval (scan_chunk()) is the CPU kernel's own, so a ckpt tensor is only valid for the
// backend that produced it. CUDA only: the small-GEMM kernels (wgrad_grouped, xdt_fwd, xdt_bwd), the scan's
// segment control (scan_segments, scan_set_segments), Mamba-3's m3_step, and the optional arguments
// conv_fwd(final_out) and rmsnorm_fwd(x_copy) (adamw_step(zero_grad) is on both: the pass zeroes the
// gradient as it reads it; so is scan_bwd(dbc_out): here dB / dC are copied into it after the kernel).
// CPU only: m3_backbone_step, the whole Mamba-3 one-token step in one call (on CUDA it is torch
// GEMMs around m3_step). Both have backbone_step_prepare; its PreparedStep.launch writes into a given output
// on CUDA (the captured graph's buffer) and returns a new tensor here (x, starts -> features or None).
// This file is argument checking and pybind11 glue: nothing in it is hot. At -O3, GCC spends more time
// optimising pybind11's template instantiations than parsing the torch headers (~19 s vs ~15 s on a
// 2-core machine), and this file is the critical path of the one-time build; O1 keeps that under 10 s.
// The kernels (the other .cpp files) keep -O3.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O1")
#endif
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <limits>
#include <optional>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../binding_common.h"
#include "kernels.h"
#include "step.h"
#include "mamba3_step.h"

using at::Tensor;
using OptT = std::optional<Tensor>;
using mrl_binding::new_empty;
using mrl_binding::ptr_or_null;
using mrl_binding::set_poison;
using mrl_binding::shape_str;

namespace {

int nthreads() { return std::max(1, at::get_num_threads()); }

void check_cpu(const Tensor& t, const char* name) {
  MRL_CHECK(t.defined(), name, ": expected a CPU float32 tensor, got None");
  MRL_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor, got device ", t.device());
}

void check_dtype_f32(const Tensor& t, const char* name) {
  MRL_CHECK(t.scalar_type() == at::kFloat, name, ": expected dtype float32 (the CPU kernels are float32 "
                    "only), got ", t.scalar_type());
}

// [B, T, C] float32 activation with unit last-dim stride (row and time strides are free).
void check_act(const Tensor& t, const char* name, int64_t B, int64_t T, int64_t C) {
  check_cpu(t, name);
  MRL_CHECK(t.dim() == 3 && t.size(0) == B && t.size(1) == T && t.size(2) == C, name, ": expected shape [",
                    B, ", ", T, ", ", C, "], got ", shape_str(t));
  check_dtype_f32(t, name);
  MRL_CHECK(C <= 1 || t.stride(2) == 1, name, ": expected last-dim stride 1, got strides ", t.strides());
  MRL_CHECK(t.stride(0) >= 0 && t.stride(1) >= 0, name, ": expected non-negative strides, got ",
                    t.strides());
}

// contiguous float32 tensor of an exact shape
void check_f32(const Tensor& t, const char* name, at::IntArrayRef shape) {
  check_cpu(t, name);
  check_dtype_f32(t, name);
  MRL_CHECK(t.sizes() == shape, name, ": expected shape ", shape, ", got ", shape_str(t));
  MRL_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor, got strides ", t.strides());
}

void check_starts(const OptT& s, int64_t B, int64_t T) {
  if (!s) return;
  check_cpu(*s, "episode_starts");
  MRL_CHECK(s->scalar_type() == at::kBool, "episode_starts: expected dtype bool, got ", s->scalar_type());
  MRL_CHECK(s->dim() == 2 && s->size(0) == B && s->size(1) == T, "episode_starts: expected shape [", B,
                    ", ", T, "], got ", shape_str(*s));
  MRL_CHECK(s->is_contiguous(), "episode_starts: expected a contiguous tensor");
}

const float* fptr(const Tensor& t) { return t.data_ptr<float>(); }

// ---------------- causal conv1d ----------------
struct ConvShapes { int64_t B, T, D, K; };

ConvShapes conv_check(const Tensor& x, const Tensor& w, const Tensor& bias, const OptT& init, const OptT& starts) {
  check_cpu(x, "causal_conv1d: x");
  MRL_CHECK(x.dim() == 3, "causal_conv1d: x: expected shape [B, T, D], got ", shape_str(x));
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  MRL_CHECK(T >= 1 && B >= 1 && D >= 1, "causal_conv1d: x: expected B, T, D >= 1, got ", shape_str(x));
  check_act(x, "causal_conv1d: x", B, T, D);
  check_cpu(w, "causal_conv1d: weight");
  MRL_CHECK(w.dim() == 2 && w.size(0) == D && w.size(1) >= 1, "causal_conv1d: weight: expected shape [", D,
                    ", d_conv >= 1], got ", shape_str(w));
  const int64_t K = w.size(1);
  check_f32(w, "causal_conv1d: weight", {D, K});
  check_f32(bias, "causal_conv1d: bias", {D});
  if (init) check_f32(*init, "causal_conv1d: conv_state", {B, D, K - 1});
  check_starts(starts, B, T);
  return {B, T, D, K};
}

mrl_cpu::ConvFwdArgs conv_args(const ConvShapes& s, const Tensor& x, const Tensor& w, const Tensor& bias,
                               const OptT& init, const OptT& starts) {
  mrl_cpu::ConvFwdArgs a{};
  a.x = fptr(x); a.x_sb = x.stride(0); a.x_st = x.stride(1);
  a.w = fptr(w); a.bias = fptr(bias); a.init = ptr_or_null<float>(init); a.starts = ptr_or_null<bool>(starts);
  a.B = (int)s.B; a.T = (int)s.T; a.D = (int)s.D; a.K = (int)s.K; a.nthreads = nthreads();
  return a;
}

std::vector<Tensor> conv_fwd(const Tensor& x, const Tensor& w, const Tensor& bias, const OptT& init,
                             const OptT& starts) {
  const auto s = conv_check(x, w, bias, init, starts);
  auto out = new_empty({s.B, s.T, s.D}, x.options());
  auto fin = new_empty({s.B, s.D, s.K - 1}, x.options());
  auto a = conv_args(s, x, w, bias, init, starts);
  a.out = out.data_ptr<float>(); a.final_state = fin.data_ptr<float>();
  mrl_cpu::conv_fwd(a);
  return {out, fin};
}

std::vector<Tensor> conv_bwd(const Tensor& x, const Tensor& w, const Tensor& bias, const OptT& init,
                             const OptT& starts, const Tensor& dout, const OptT& dfinal, bool need_dinit,
                             const OptT& dx_out, const OptT& dw_acc, const OptT& db_acc) {
  const auto s = conv_check(x, w, bias, init, starts);
  check_act(dout, "causal_conv1d: grad_out", s.B, s.T, s.D);
  if (dfinal) check_f32(*dfinal, "causal_conv1d: grad_final_state", {s.B, s.D, s.K - 1});
  if (dx_out) check_act(*dx_out, "causal_conv1d: dx_out", s.B, s.T, s.D);
  MRL_CHECK(dw_acc.has_value() == db_acc.has_value(), "causal_conv1d: give both dw_acc and db_acc or "
                    "neither, got dw_acc=", dw_acc ? "tensor" : "None", ", db_acc=", db_acc ? "tensor" : "None");
  if (dw_acc) {
    check_f32(*dw_acc, "causal_conv1d: dw_acc", {s.D, s.K});
    check_f32(*db_acc, "causal_conv1d: db_acc", {s.D});
  }
  auto f32 = x.options();
  auto dx = dx_out ? *dx_out : new_empty({s.B, s.T, s.D}, f32);
  auto dw = dw_acc ? *dw_acc : new_empty({s.D, s.K}, f32);
  auto db = db_acc ? *db_acc : new_empty({s.D}, f32);
  Tensor dinit = need_dinit ? new_empty({s.B, s.D, s.K - 1}, f32) : Tensor();
  mrl_cpu::ConvBwdArgs g{};
  g.f = conv_args(s, x, w, bias, init, starts);
  g.dout = fptr(dout); g.g_sb = dout.stride(0); g.g_st = dout.stride(1);
  g.dfinal = ptr_or_null<float>(dfinal);
  g.dx = dx.data_ptr<float>(); g.dx_sb = dx.stride(0); g.dx_st = dx.stride(1);
  g.dinit = (need_dinit && dinit.numel()) ? dinit.data_ptr<float>() : nullptr;
  g.dw = dw.data_ptr<float>(); g.dbias = db.data_ptr<float>(); g.accumulate = dw_acc.has_value();
  mrl_cpu::conv_bwd(g);
  return {dx, dw, db, dinit};
}

// ---------------- selective scan ----------------
struct ScanShapes { int64_t B, T, D, N; };

ScanShapes scan_check(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& Bm, const Tensor& Cm,
                      const Tensor& Dp, const Tensor& z, const Tensor& dt_bias, const OptT& init, const OptT& starts) {
  check_cpu(x, "selective_scan: x");
  MRL_CHECK(x.dim() == 3, "selective_scan: x: expected shape [B, T, D], got ", shape_str(x));
  ScanShapes s{x.size(0), x.size(1), x.size(2), 0};
  MRL_CHECK(s.T >= 1 && s.B >= 1 && s.D >= 1, "selective_scan: x: expected B, T, D >= 1, got ", shape_str(x));
  check_act(x, "selective_scan: x", s.B, s.T, s.D);
  check_act(dt, "selective_scan: dt", s.B, s.T, s.D);
  check_cpu(A_log, "selective_scan: A_log");
  MRL_CHECK(A_log.dim() == 2 && A_log.size(0) == s.D && A_log.size(1) >= 1, "selective_scan: A_log: "
                    "expected shape [", s.D, ", d_state >= 1], got ", shape_str(A_log));
  s.N = A_log.size(1);
  check_f32(A_log, "selective_scan: A_log", {s.D, s.N});
  check_act(Bm, "selective_scan: Bm", s.B, s.T, s.N);
  check_act(Cm, "selective_scan: Cm", s.B, s.T, s.N);
  check_f32(Dp, "selective_scan: D", {s.D});
  check_act(z, "selective_scan: z", s.B, s.T, s.D);
  check_f32(dt_bias, "selective_scan: dt_bias", {s.D});
  if (init) check_f32(*init, "selective_scan: ssm_state", {s.B, s.D, s.N});
  check_starts(starts, s.B, s.T);
  return s;
}

int64_t num_chunks(int64_t T) { return (T + mrl_cpu::kScanChunk - 1) / mrl_cpu::kScanChunk; }

mrl_cpu::ScanFwdArgs scan_args(const ScanShapes& s, const Tensor& x, const Tensor& dt, const Tensor& A_log,
                               const Tensor& Bm, const Tensor& Cm, const Tensor& Dp, const Tensor& z,
                               const Tensor& dt_bias, const OptT& init, const OptT& starts) {
  mrl_cpu::ScanFwdArgs a{};
  a.x = fptr(x); a.x_sb = x.stride(0); a.x_st = x.stride(1);
  a.dt = fptr(dt); a.dt_sb = dt.stride(0); a.dt_st = dt.stride(1);
  a.Bm = fptr(Bm); a.B_sb = Bm.stride(0); a.B_st = Bm.stride(1);
  a.Cm = fptr(Cm); a.C_sb = Cm.stride(0); a.C_st = Cm.stride(1);
  a.z = fptr(z); a.z_sb = z.stride(0); a.z_st = z.stride(1);
  a.A_log = fptr(A_log); a.Dskip = fptr(Dp); a.dt_bias = fptr(dt_bias);
  a.init = ptr_or_null<float>(init); a.starts = ptr_or_null<bool>(starts);
  a.B = (int)s.B; a.T = (int)s.T; a.D = (int)s.D; a.N = (int)s.N; a.nthreads = nthreads();
  return a;
}

std::vector<Tensor> scan_fwd(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& Bm,
                             const Tensor& Cm, const Tensor& Dp, const Tensor& z, const Tensor& dt_bias,
                             const OptT& init, const OptT& starts, bool need_ckpt) {
  const auto s = scan_check(x, dt, A_log, Bm, Cm, Dp, z, dt_bias, init, starts);
  auto out = new_empty({s.B, s.T, s.D}, x.options());
  auto fin = new_empty({s.B, s.D, s.N}, x.options());
  Tensor ckpt = need_ckpt ? new_empty({s.B, num_chunks(s.T), s.D, s.N}, x.options()) : Tensor();
  auto a = scan_args(s, x, dt, A_log, Bm, Cm, Dp, z, dt_bias, init, starts);
  a.out = out.data_ptr<float>(); a.final_state = fin.data_ptr<float>();
  a.ckpt = need_ckpt ? ckpt.data_ptr<float>() : nullptr;
  mrl_cpu::scan_fwd(a);
  return {out, fin, ckpt};
}

std::vector<Tensor> scan_bwd(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& Bm,
                             const Tensor& Cm, const Tensor& Dp, const Tensor& z, const Tensor& dt_bias,
                             const OptT& init, const OptT& starts, const OptT& ckpt_opt, const Tensor& dout,
                             const OptT& dfinal, bool need_dinit, const OptT& dz_out,
                             const std::optional<std::vector<Tensor>>& acc, const OptT& dbc_out) {
  const auto s = scan_check(x, dt, A_log, Bm, Cm, Dp, z, dt_bias, init, starts);
  // ckpt is optional in the signature only so that None gets this message instead of pybind's TypeError
  MRL_CHECK(ckpt_opt.has_value() && ckpt_opt->defined(), "selective_scan: checkpoints: expected the ckpt "
                    "of scan_fwd(..., need_ckpt=True), got None");
  const Tensor& ckpt = *ckpt_opt;
  check_f32(ckpt, "selective_scan: checkpoints", {s.B, num_chunks(s.T), s.D, s.N});
  check_act(dout, "selective_scan: grad_out", s.B, s.T, s.D);
  if (dfinal) check_f32(*dfinal, "selective_scan: grad_final_state", {s.B, s.D, s.N});
  if (dz_out) check_act(*dz_out, "selective_scan: dz_out", s.B, s.T, s.D);
  if (acc) {
    MRL_CHECK(acc->size() == 3, "selective_scan: acc: expected [dA_log_acc, dD_acc, ddt_bias_acc], got ",
                      acc->size(), " tensors");
    check_f32((*acc)[0], "selective_scan: dA_log_acc", {s.D, s.N});
    check_f32((*acc)[1], "selective_scan: dD_acc", {s.D});
    check_f32((*acc)[2], "selective_scan: ddt_bias_acc", {s.D});
  }
  std::pair<Tensor, Tensor> bc_views;
  if (dbc_out) {
    check_cpu(*dbc_out, "selective_scan: dbc_out");
    check_dtype_f32(*dbc_out, "selective_scan: dbc_out");
    bc_views = mrl_binding::dbc_out_views(*dbc_out, s.B, s.T, s.N);
  }
  auto f32 = x.options();
  auto dx = new_empty({s.B, s.T, s.D}, f32);
  auto ddt = new_empty({s.B, s.T, s.D}, f32);
  auto dz = dz_out ? *dz_out : new_empty({s.B, s.T, s.D}, f32);
  auto dB = new_empty({s.B, s.T, s.N}, f32);
  auto dC = new_empty({s.B, s.T, s.N}, f32);
  auto dA = acc ? (*acc)[0] : new_empty({s.D, s.N}, f32);
  auto dD = acc ? (*acc)[1] : new_empty({s.D}, f32);
  auto ddb = acc ? (*acc)[2] : new_empty({s.D}, f32);
  Tensor dinit = need_dinit ? new_empty({s.B, s.D, s.N}, f32) : Tensor();
  mrl_cpu::ScanBwdArgs g{};
  g.f = scan_args(s, x, dt, A_log, Bm, Cm, Dp, z, dt_bias, init, starts);
  g.f.ckpt = ckpt.data_ptr<float>();
  g.dout = fptr(dout); g.g_sb = dout.stride(0); g.g_st = dout.stride(1);
  g.dfinal = ptr_or_null<float>(dfinal);
  g.dx = dx.data_ptr<float>(); g.ddt = ddt.data_ptr<float>();
  g.dz = dz.data_ptr<float>(); g.dz_sb = dz.stride(0); g.dz_st = dz.stride(1);
  g.dB = dB.data_ptr<float>(); g.dC = dC.data_ptr<float>();
  g.dA_log = dA.data_ptr<float>(); g.dD = dD.data_ptr<float>(); g.ddt_bias = ddb.data_ptr<float>();
  g.accumulate = acc.has_value();
  g.dinit = need_dinit ? dinit.data_ptr<float>() : nullptr;
  mrl_cpu::scan_bwd(g);
  if (dbc_out) {  // the CUDA contract; the CPU kernel writes contiguous rows, so here a copy
    bc_views.first.copy_(dB);
    bc_views.second.copy_(dC);
    std::tie(dB, dC) = bc_views;
  }
  return {dx, ddt, dA, dB, dC, dD, dz, ddb, dinit};
}

// ---------------- optimizer ----------------
void check_vec(const Tensor& t, const char* name, at::ScalarType ty, int64_t n) {
  check_cpu(t, name);
  MRL_CHECK(t.scalar_type() == ty, name, ": expected dtype ", ty, ", got ", t.scalar_type());
  MRL_CHECK(t.numel() == n, name, ": expected ", n, " elements, got shape ", shape_str(t));
  MRL_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor, got strides ", t.strides());
}

// counter: the CUDA kernel's self-resetting block counter; unused on the CPU (accepted for the same signature).
void grad_stats(const Tensor& grad, const OptT& extra_sq, const Tensor& loss_scale, const Tensor& hyper,
                Tensor& scalars, const OptT& counter) {
  (void)counter;
  check_cpu(grad, "grad_stats: grad");
  MRL_CHECK(grad.dim() == 1, "grad_stats: grad: expected a flat [P] arena, got shape ", shape_str(grad));
  const int64_t P = grad.numel();
  check_vec(grad, "grad_stats: grad", at::kFloat, P);
  if (extra_sq) check_vec(*extra_sq, "grad_stats: extra_grad_sq", at::kFloat, 1);
  check_vec(loss_scale, "grad_stats: loss_scale", at::kFloat, 1);
  check_vec(hyper, "grad_stats: hyper", at::kDouble, 8);
  check_vec(scalars, "grad_stats: scalars", at::kDouble, 8);
  mrl_cpu::grad_stats(grad.data_ptr<float>(), P, ptr_or_null<float>(extra_sq), loss_scale.data_ptr<float>()[0],
                      hyper.data_ptr<double>(), scalars.data_ptr<double>(), nthreads());
}

void adamw_step(Tensor& param, Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const Tensor& hyper,
                const Tensor& scalars, int64_t n_decay, const OptT& compute, bool zero_grad) {
  check_cpu(param, "adamw_step: param");
  MRL_CHECK(param.dim() == 1, "adamw_step: param: expected a flat [P] arena, got shape ", shape_str(param));
  const int64_t P = param.numel();
  check_vec(param, "adamw_step: param", at::kFloat, P);
  check_vec(grad, "adamw_step: grad", at::kFloat, P);
  check_vec(exp_avg, "adamw_step: exp_avg", at::kFloat, P);
  check_vec(exp_avg_sq, "adamw_step: exp_avg_sq", at::kFloat, P);
  check_vec(hyper, "adamw_step: hyper", at::kDouble, 8);
  check_vec(scalars, "adamw_step: scalars", at::kDouble, 8);
  MRL_CHECK(n_decay >= 0 && n_decay <= P, "adamw_step: n_decay: expected a value in [0, ", P, "], got ", n_decay);
  float* comp = nullptr;
  bool cast_after = false;
  if (compute) {
    check_cpu(*compute, "adamw_step: compute");
    const auto ct = compute->scalar_type();
    MRL_CHECK(ct == at::kFloat || ct == at::kBFloat16 || ct == at::kHalf, "adamw_step: compute: expected dtype "
              "float32, bfloat16 or float16, got ", ct);
    MRL_CHECK(compute->numel() == P && compute->is_contiguous(), "adamw_step: compute: expected a contiguous [",
              P, "] arena, got shape ", shape_str(*compute));
    if (ct == at::kFloat) comp = compute->data_ptr<float>();
    else cast_after = true;  // a low-precision copy: one cast pass after the step (the CPU kernels are f32)
  }
  const double* h = hyper.data_ptr<double>();
  const double* s = scalars.data_ptr<double>();
  const bool skipped = s[5] > 0.0 && h[6] > 0.0;  // nothing changes, the compute copy included (grad zeroed)
  mrl_cpu::adamw_step(param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                      exp_avg_sq.data_ptr<float>(), comp, P, n_decay, h, s, nthreads(), zero_grad);
  if (cast_after && !skipped) compute->copy_(param);
}

// ---------------- heap policy ----------------
// glibc only: allocations below mmap_threshold bytes come from the heap, and the heap's free top is handed back
// to the OS only past trim_threshold bytes. A CPU training step allocates and frees ~6 MB of activations
// (torch's outputs, the kernels' scratch); with glibc's dynamic defaults the heap top was trimmed after a step
// and faulted back in (zeroed by the kernel) during the next one, in some processes and not others: up to
// ~1,000 minor faults and ~1-2 ms of system time per [2, 128] step at 2 threads, 0-60 at 1 thread (getrusage).
// Process-wide (mallopt); returns false where it does not apply (not glibc) or glibc refuses a value.
bool retain_heap(int64_t mmap_threshold, int64_t trim_threshold) {
  MRL_CHECK(mmap_threshold >= 0 && mmap_threshold <= 32 * 1024 * 1024, "retain_heap: mmap_threshold: expected "
            "0 to 32 MiB (glibc's maximum), got ", mmap_threshold);
  MRL_CHECK(trim_threshold >= 0 && trim_threshold <= std::numeric_limits<int>::max(), "retain_heap: trim_threshold: "
            "expected 0 to ", std::numeric_limits<int>::max(), ", got ", trim_threshold);
#if defined(__GLIBC__)
  const bool a = mallopt(M_MMAP_THRESHOLD, (int)mmap_threshold) == 1;
  const bool b = mallopt(M_TRIM_THRESHOLD, (int)trim_threshold) == 1;
  return a && b;
#else
  return false;
#endif
}

// ---------------- one-token backbone step ----------------
struct StepIO { int64_t B, dm, L; };

// The checks the one-token steps of both layer kinds share (backbone_step, m3_backbone_step): x_t
// [B, input_dim], input_proj.{weight [d_model, input_dim], bias [d_model]}, norm_f.weight [d_model], at least
// one layer and the optional [B] bool episode_starts. `fn` names the function in every message.
StepIO step_io_check(const std::string& fn, const Tensor& x, const Tensor& inp_w, const Tensor& inp_b,
                     const Tensor& normf_w, size_t n_layers, const OptT& starts) {
  const std::string x_name = fn + ": x_t", w_name = fn + ": input_proj.weight";
  check_cpu(x, x_name.c_str());
  MRL_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(1) >= 1, x_name, ": expected shape [B, input_dim], got ",
            shape_str(x));
  const int64_t B = x.size(0), in_dim = x.size(1);
  check_f32(x, x_name.c_str(), {B, in_dim});
  check_cpu(inp_w, w_name.c_str());
  MRL_CHECK(inp_w.dim() == 2 && inp_w.size(1) == in_dim, w_name, ": expected shape [d_model, ", in_dim, "], got ",
            shape_str(inp_w));
  const int64_t dm = inp_w.size(0);
  check_f32(inp_w, w_name.c_str(), {dm, in_dim});
  check_f32(inp_b, (fn + ": input_proj.bias").c_str(), {dm});
  check_f32(normf_w, (fn + ": norm_f.weight").c_str(), {dm});
  const int64_t L = (int64_t)n_layers;
  MRL_CHECK(L >= 1, fn, ": layers: expected at least 1 layer, got ", L);
  if (starts) {
    check_cpu(*starts, (fn + ": episode_starts").c_str());
    MRL_CHECK(starts->scalar_type() == at::kBool && starts->numel() == B && starts->is_contiguous(), fn,
              ": episode_starts: expected a contiguous [", B, "] bool tensor, got shape ", shape_str(*starts),
              " dtype ", starts->scalar_type());
  }
  return {B, dm, L};
}

// The L Mamba-1 layers of a backbone call, 10 contiguous float32 tensors each (norm.weight, in_proj.weight,
// conv1d.weight as [d_inner, d_conv], conv1d.bias, x_proj.weight, dt_proj.weight, dt_proj.bias, A_log, D,
// out_proj.weight) for d_model dm, d_inner D, d_conv K, d_state N and dt_rank `rank` (-1: layer 0's dt_proj
// gives it); `what` prefixes the tensor names (e.g. "grad " for a list of gradients). Messages name the layer
// past layer 0 ("layer 2 x_proj.weight"). Returns dt_rank.
int64_t mamba_layers_check(const std::string& fn, const std::string& what,
                           const std::vector<std::vector<Tensor>>& layers, int64_t dm, int64_t D, int64_t K,
                           int64_t N, int64_t rank = -1) {
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto& t = layers[l];
    MRL_CHECK(t.size() == 10, fn, ": ", what, "layer ", (int64_t)l, ": expected 10 tensors, got ", (int64_t)t.size());
    const std::string at_l = l ? mrl_binding::cat("layer ", (int64_t)l, " ") : std::string();
    auto name = [&](const char* n) { return fn + ": " + what + at_l + n; };
    if (rank < 0) {
      check_cpu(t[5], name("dt_proj.weight").c_str());
      rank = t[5].dim() == 2 ? t[5].size(1) : -1;
      MRL_CHECK(rank >= 1, name("dt_proj.weight"), ": expected shape [", D, ", dt_rank], got ", shape_str(t[5]));
    }
    check_f32(t[0], name("norm.weight").c_str(), {dm});
    check_f32(t[1], name("in_proj.weight").c_str(), {2 * D, dm});
    check_f32(t[2], name("conv1d.weight (as [d_inner, d_conv])").c_str(), {D, K});
    check_f32(t[3], name("conv1d.bias").c_str(), {D});
    check_f32(t[4], name("x_proj.weight").c_str(), {rank + 2 * N, D});
    check_f32(t[5], name("dt_proj.weight").c_str(), {D, rank});
    check_f32(t[6], name("dt_proj.bias").c_str(), {D});
    check_f32(t[7], name("A_log").c_str(), {D, N});
    check_f32(t[8], name("D").c_str(), {D});
    check_f32(t[9], name("out_proj.weight").c_str(), {dm, D});
  }
  return rank;
}

// Every check of a backbone_step call (shapes, dtypes, devices, contiguity of x_t, the weights and the states).
void backbone_step_check(const Tensor& x, const Tensor& inp_w, const Tensor& inp_b, const Tensor& normf_w,
                         const std::vector<std::vector<Tensor>>& layers, const Tensor& conv_state,
                         const Tensor& ssm_state, const OptT& starts) {
  const auto io = step_io_check("backbone_step", x, inp_w, inp_b, normf_w, layers.size(), starts);
  const int64_t B = io.B, dm = io.dm, L = io.L;
  check_cpu(conv_state, "backbone_step: conv_state");
  MRL_CHECK(conv_state.dim() == 4 && conv_state.size(0) == L && conv_state.size(1) == B &&
                    conv_state.size(2) >= 1, "backbone_step: conv_state: expected shape [", L, ", ", B,
                    ", d_inner, d_conv-1], got ", shape_str(conv_state));
  const int64_t D = conv_state.size(2), K = conv_state.size(3) + 1;
  check_f32(conv_state, "backbone_step: conv_state", {L, B, D, K - 1});
  check_cpu(ssm_state, "backbone_step: ssm_state");
  MRL_CHECK(ssm_state.dim() == 4 && ssm_state.size(3) >= 1, "backbone_step: ssm_state: expected shape [",
                    L, ", ", B, ", ", D, ", d_state], got ", shape_str(ssm_state));
  const int64_t N = ssm_state.size(3);
  check_f32(ssm_state, "backbone_step: ssm_state", {L, B, D, N});
  mamba_layers_check("backbone_step", "", layers, dm, D, K, N);
}

Tensor backbone_step(const Tensor& x, const Tensor& inp_w, const Tensor& inp_b, const Tensor& normf_w,
                     const std::vector<std::vector<Tensor>>& layers, Tensor& conv_state, Tensor& ssm_state,
                     const OptT& starts, double eps, int64_t rows_per_block) {
  (void)rows_per_block;  // a CUDA launch-shape knob; nothing to choose on the CPU
  backbone_step_check(x, inp_w, inp_b, normf_w, layers, conv_state, ssm_state, starts);
  return mrl_cpu::backbone_step(x, inp_w, inp_b, normf_w, layers, conv_state, ssm_state, ptr_or_null<bool>(starts),
                                (float)eps, nthreads());
}

// The one-token step with every argument checked once (backbone_step_prepare, the CPU twin of the CUDA
// binding's PreparedStep): a call then checks only x_t and starts and runs the step, without the ~35 weight
// and state checks and the conversion of the nested weight lists of a full call (~8 of its ~11 us fixed cost
// at B = 1). It holds the weights and states it was given (their storage cannot be freed under it); the
// caller re-prepares when one of them is replaced (Stepper: the packed-weights cache or a state moved).
struct PreparedStep {
  Tensor inp_w, inp_b, normf_w, conv_state, ssm_state;
  std::vector<std::vector<Tensor>> layers;
  float eps;
  int64_t B, in_dim;

  // x [B, in_dim] float32 contiguous CPU, starts [B] bool contiguous CPU or None: the features [B, d_model]
  // (a new tensor), the states advanced in place; None (nothing run) when x or starts does not fit, so the
  // caller can take the checked path for its error message.
  std::optional<Tensor> launch(const Tensor& x, const OptT& starts) {
    if (!x.defined() || !x.device().is_cpu() || x.scalar_type() != at::kFloat || x.dim() != 2 || x.size(0) != B ||
        x.size(1) != in_dim || !x.is_contiguous())
      return std::nullopt;
    if (starts && (!starts->device().is_cpu() || starts->scalar_type() != at::kBool || starts->dim() != 1 ||
                   starts->size(0) != B || !starts->is_contiguous()))
      return std::nullopt;
    return mrl_cpu::backbone_step(x, inp_w, inp_b, normf_w, layers, conv_state, ssm_state,
                                  ptr_or_null<bool>(starts), eps, nthreads());
  }
};

PreparedStep backbone_step_prepare(const Tensor& x, const Tensor& inp_w, const Tensor& inp_b, const Tensor& normf_w,
                                   const std::vector<std::vector<Tensor>>& layers, Tensor& conv_state,
                                   Tensor& ssm_state, double eps, int64_t rows_per_block) {
  (void)rows_per_block;
  backbone_step_check(x, inp_w, inp_b, normf_w, layers, conv_state, ssm_state, std::nullopt);
  return PreparedStep{inp_w, inp_b, normf_w, conv_state, ssm_state, layers, (float)eps, x.size(0), x.size(1)};
}

// ---------------- whole-backbone forward and backward (the training step's Mamba-1 node) ----------------
// backbone_fwd / backbone_bwd run the whole Mamba-1 backbone of mamba_rl/model/fused.py's autograd node in
// one call each way: the same ATen GEMM calls with the same operands, the same kernels with the same
// arguments and the same order, so the same bits as the Python node (scripts/bitident.py). What they remove
// is the Python of that node (~40 calls, views and argument conversions per layer, about 1 ms of a [2, 128]
// step) and the per-kernel argument checks: the weights, gradients and states are checked once per call here.

// What the forward keeps for the backward (one per forward call; autograd holds it in the node's ctx).
struct BackboneSaved {
  int64_t B = 0, T = 0, in_dim = 0, dm = 0, D = 0, K = 0, N = 0, R = 0;
  float eps = 0.0f;
  Tensor x2, h_last, rstd_f, conv0, ssm0, inp_w, normf_w;
  OptT starts;
  std::vector<std::vector<Tensor>> layers;  // the weights it ran with (views of the arena)
  // per layer: residual input, normed input, its rstd, in_proj output [x | z], conv output, x_proj output
  // [dt_low | B | C], dt_proj output, gated scan output, the scan's checkpoints
  std::vector<Tensor> h_in, u, rstd, xz, xc, dbc, dt, y, ckpt;
};

mrl_cpu::ConvFwdArgs conv_args_raw(const Tensor& xi, int64_t B, int64_t T, int64_t D, int64_t K, const Tensor& w,
                                   const Tensor& bias, const float* init, const bool* starts) {
  mrl_cpu::ConvFwdArgs a{};
  a.x = fptr(xi); a.x_sb = xi.stride(0); a.x_st = xi.stride(1);
  a.w = fptr(w); a.bias = fptr(bias); a.init = init; a.starts = starts;
  a.B = (int)B; a.T = (int)T; a.D = (int)D; a.K = (int)K; a.nthreads = nthreads();
  return a;
}

// the scan's inputs of layer l: x = xc, dt, B / C = the columns of dbc after dt_rank, z = the right half of xz
mrl_cpu::ScanFwdArgs scan_args_saved(const BackboneSaved& s, int64_t l) {
  const auto& w = s.layers[l];
  const int64_t E = s.R + 2 * s.N;
  const float* dbc = fptr(s.dbc[l]);
  mrl_cpu::ScanFwdArgs a{};
  a.x = fptr(s.xc[l]); a.x_sb = s.T * s.D; a.x_st = s.D;
  a.dt = fptr(s.dt[l]); a.dt_sb = s.T * s.D; a.dt_st = s.D;
  a.Bm = dbc + s.R; a.B_sb = s.T * E; a.B_st = E;
  a.Cm = dbc + s.R + s.N; a.C_sb = s.T * E; a.C_st = E;
  a.z = fptr(s.xz[l]) + s.D; a.z_sb = s.T * 2 * s.D; a.z_st = 2 * s.D;
  a.A_log = fptr(w[7]); a.Dskip = fptr(w[8]); a.dt_bias = fptr(w[6]);
  a.init = fptr(s.ssm0) + l * s.B * s.D * s.N;
  a.starts = ptr_or_null<bool>(s.starts);
  a.B = (int)s.B; a.T = (int)s.T; a.D = (int)s.D; a.N = (int)s.N; a.nthreads = nthreads();
  return a;
}

// x [B, T, input_dim] float32; inp_w [d_model, input_dim], inp_b and normf_w [d_model]; layers as
// backbone_step's; conv0 [L, B, d_inner, d_conv-1] and ssm0 [L, B, d_inner, d_state] contiguous float32 (the
// initial state; zeros for none); starts [B, T] bool or None. -> (features [B, T, d_model], final conv
// [L, B, d_inner, d_conv-1], final ssm [L, B, d_inner, d_state], the saved activations for backbone_bwd).
// conv_out / ssm_out: contiguous float32 tensors of the final states' shapes (not conv0 / ssm0) to write them
// into (and return) instead of new tensors; None: new tensors.
std::tuple<Tensor, Tensor, Tensor, std::shared_ptr<BackboneSaved>> backbone_fwd(
    const Tensor& x, const Tensor& inp_w, const Tensor& inp_b, const Tensor& normf_w,
    const std::vector<std::vector<Tensor>>& layers, const Tensor& conv0, const Tensor& ssm0, const OptT& starts,
    double eps, const OptT& conv_out, const OptT& ssm_out) {
  const std::string fn = "backbone_fwd";
  check_cpu(x, "backbone_fwd: x");
  MRL_CHECK(x.dim() == 3 && x.size(0) >= 1 && x.size(1) >= 1 && x.size(2) >= 1, "backbone_fwd: x: expected shape "
            "[B, T, input_dim] with B, T, input_dim >= 1, got ", shape_str(x));
  check_dtype_f32(x, "backbone_fwd: x");
  auto s = std::make_shared<BackboneSaved>();
  s->B = x.size(0); s->T = x.size(1); s->in_dim = x.size(2);
  const int64_t B = s->B, T = s->T, BT = B * T;
  check_cpu(inp_w, "backbone_fwd: input_proj.weight");
  MRL_CHECK(inp_w.dim() == 2 && inp_w.size(1) == s->in_dim && inp_w.size(0) >= 1, "backbone_fwd: input_proj.weight: "
            "expected shape [d_model, ", s->in_dim, "], got ", shape_str(inp_w));
  const int64_t dm = s->dm = inp_w.size(0), L = (int64_t)layers.size();
  check_f32(inp_w, "backbone_fwd: input_proj.weight", {dm, s->in_dim});
  check_f32(inp_b, "backbone_fwd: input_proj.bias", {dm});
  check_f32(normf_w, "backbone_fwd: norm_f.weight", {dm});
  MRL_CHECK(L >= 1, "backbone_fwd: layers: expected at least 1 layer, got ", L);
  // d_inner, d_conv and d_state from layer 0's conv1d.weight [D, K] and A_log [D, N]: the weights define the
  // model, the states are checked against it
  MRL_CHECK(layers[0].size() == 10, "backbone_fwd: layer 0: expected 10 tensors, got ", (int64_t)layers[0].size());
  check_cpu(layers[0][2], "backbone_fwd: conv1d.weight");
  check_cpu(layers[0][7], "backbone_fwd: A_log");
  MRL_CHECK(layers[0][2].dim() == 2 && layers[0][2].size(0) >= 1 && layers[0][2].size(1) >= 1, "backbone_fwd: "
            "conv1d.weight (as [d_inner, d_conv]): expected 2 dims >= 1, got ", shape_str(layers[0][2]));
  MRL_CHECK(layers[0][7].dim() == 2 && layers[0][7].size(1) >= 1, "backbone_fwd: A_log: expected shape [d_inner, "
            "d_state], got ", shape_str(layers[0][7]));
  const int64_t D = s->D = layers[0][2].size(0), K = s->K = layers[0][2].size(1), N = s->N = layers[0][7].size(1);
  const int64_t R = s->R = mamba_layers_check(fn, "", layers, dm, D, K, N);
  check_cpu(conv0, "backbone_fwd: conv_state");
  check_dtype_f32(conv0, "backbone_fwd: conv_state");
  MRL_CHECK(conv0.sizes() == at::IntArrayRef({L, B, D, K - 1}) && conv0.is_contiguous(), "backbone_fwd: conv_state: "
            "expected a contiguous [", L, ", ", B, ", ", D, ", ", K - 1, "] tensor, got shape ", shape_str(conv0));
  check_cpu(ssm0, "backbone_fwd: ssm_state");
  check_dtype_f32(ssm0, "backbone_fwd: ssm_state");
  MRL_CHECK(ssm0.sizes() == at::IntArrayRef({L, B, D, N}) && ssm0.is_contiguous(), "backbone_fwd: ssm_state: "
            "expected a contiguous [", L, ", ", B, ", ", D, ", ", N, "] tensor, got shape ", shape_str(ssm0));
  check_starts(starts, B, T);
  MRL_CHECK(eps > 0.0, "backbone_fwd: eps: expected a value > 0, got ", eps);
  s->eps = (float)eps;
  s->x2 = x.reshape({BT, s->in_dim});
  s->conv0 = conv0; s->ssm0 = ssm0; s->starts = starts; s->inp_w = inp_w; s->normf_w = normf_w; s->layers = layers;
  const auto f32 = x.options();
  // the final states into the caller's tensors (the trainer's carried state: no copy after the call), or new ones
  auto out_state = [&](const OptT& o, at::IntArrayRef shape, const Tensor& in, const char* name) -> Tensor {
    if (!o) return new_empty(shape, f32);
    check_cpu(*o, name);
    check_dtype_f32(*o, name);
    MRL_CHECK(o->sizes() == shape && o->is_contiguous(), name, ": expected a contiguous ", shape_str(in),
              " tensor, got shape ", shape_str(*o));
    MRL_CHECK(in.numel() == 0 || o->data_ptr() != in.data_ptr(), name, ": must not be the initial state itself "
              "(the backward reads it)");
    return *o;
  };
  auto conv_f = out_state(conv_out, {L, B, D, K - 1}, conv0, "backbone_fwd: conv_out");
  auto ssm_f = out_state(ssm_out, {L, B, D, N}, ssm0, "backbone_fwd: ssm_out");
  const bool* st = ptr_or_null<bool>(starts);
  const int nt = nthreads();
  const int64_t nC = num_chunks(T);
  Tensor h = at::addmm(inp_b, s->x2, inp_w.t());
  for (int64_t l = 0; l < L; ++l) {
    const auto& w = layers[l];
    auto u = new_empty({BT, dm}, f32), rstd = new_empty({BT, 1}, f32);
    mrl_cpu::rmsnorm_fwd(fptr(h), BT, (int)dm, fptr(w[0]), s->eps, u.data_ptr<float>(), rstd.data_ptr<float>(), nt);
    Tensor xz = at::mm(u, w[1].t());  // [BT, 2D]
    Tensor xi = xz.view({B, T, 2 * D}).narrow(2, 0, D);
    auto xc = new_empty({B, T, D}, f32);
    auto ca = conv_args_raw(xi, B, T, D, K, w[2], w[3], fptr(conv0) + l * B * D * (K - 1), st);
    ca.out = xc.data_ptr<float>();
    ca.final_state = conv_f.data_ptr<float>() + l * B * D * (K - 1);
    mrl_cpu::conv_fwd(ca);
    Tensor dbc = at::mm(xc.view({BT, D}), w[4].t());  // [BT, R + 2N]
    Tensor dt = at::mm(dbc.narrow(1, 0, R), w[5].t());  // [BT, D]
    auto y = new_empty({B, T, D}, f32);
    auto ckpt = new_empty({B, nC, D, N}, f32);
    s->xz.push_back(xz); s->xc.push_back(xc); s->dbc.push_back(dbc); s->dt.push_back(dt);
    auto sa = scan_args_saved(*s, l);
    sa.out = y.data_ptr<float>();
    sa.final_state = ssm_f.data_ptr<float>() + l * B * D * N;
    sa.ckpt = ckpt.data_ptr<float>();
    mrl_cpu::scan_fwd(sa);
    s->h_in.push_back(h); s->u.push_back(u); s->rstd.push_back(rstd); s->y.push_back(y); s->ckpt.push_back(ckpt);
    h = at::addmm(h, y.view({BT, D}), w[9].t());  // the residual add in the GEMM (a new tensor: h_in is saved)
  }
  auto feat = new_empty({BT, dm}, f32), rstd_f = new_empty({BT, 1}, f32);
  mrl_cpu::rmsnorm_fwd(fptr(h), BT, (int)dm, fptr(normf_w), s->eps, feat.data_ptr<float>(), rstd_f.data_ptr<float>(),
                       nt);
  s->h_last = h; s->rstd_f = rstd_f;
  return {feat.view({B, T, dm}), conv_f, ssm_f, s};
}

// The backward of backbone_fwd's call `s`: dfeat [B, T, d_model] float32 or None (zeros), dconv_final / dssm_final
// like the final states or None. The parameter gradients are ADDED into inp_w_g, inp_b_g, normf_g and grads
// (the layers' 10 gradients, shaped like their weights: views of the flat gradient arena). Returns dL/dx
// [B, T, input_dim] when need_dx, else None. No gradient flows into the initial state (truncated BPTT).
Tensor backbone_bwd(const std::shared_ptr<BackboneSaved>& sp, const OptT& dfeat, const OptT& dconv_final,
                    const OptT& dssm_final, Tensor& inp_w_g, Tensor& inp_b_g, Tensor& normf_g,
                    const std::vector<std::vector<Tensor>>& grads, bool need_dx) {
  MRL_CHECK(sp != nullptr, "backbone_bwd: saved: expected the saved state of backbone_fwd, got None");
  const BackboneSaved& s = *sp;
  const int64_t B = s.B, T = s.T, BT = B * T, dm = s.dm, D = s.D, K = s.K, N = s.N, R = s.R;
  const int64_t L = (int64_t)s.layers.size();
  if (dfeat) {
    check_cpu(*dfeat, "backbone_bwd: grad_features");
    check_dtype_f32(*dfeat, "backbone_bwd: grad_features");
    MRL_CHECK(dfeat->sizes() == at::IntArrayRef({B, T, dm}), "backbone_bwd: grad_features: expected shape [", B, ", ",
              T, ", ", dm, "], got ", shape_str(*dfeat));
  }
  if (dconv_final) {
    check_cpu(*dconv_final, "backbone_bwd: grad_final_conv");
    check_dtype_f32(*dconv_final, "backbone_bwd: grad_final_conv");
    MRL_CHECK(dconv_final->sizes() == at::IntArrayRef({L, B, D, K - 1}), "backbone_bwd: grad_final_conv: expected "
              "shape [", L, ", ", B, ", ", D, ", ", K - 1, "], got ", shape_str(*dconv_final));
  }
  if (dssm_final) {
    check_cpu(*dssm_final, "backbone_bwd: grad_final_ssm");
    check_dtype_f32(*dssm_final, "backbone_bwd: grad_final_ssm");
    MRL_CHECK(dssm_final->sizes() == at::IntArrayRef({L, B, D, N}), "backbone_bwd: grad_final_ssm: expected "
              "shape [", L, ", ", B, ", ", D, ", ", N, "], got ", shape_str(*dssm_final));
  }
  check_f32(inp_w_g, "backbone_bwd: grad input_proj.weight", {dm, s.in_dim});
  check_f32(inp_b_g, "backbone_bwd: grad input_proj.bias", {dm});
  check_f32(normf_g, "backbone_bwd: grad norm_f.weight", {dm});
  MRL_CHECK((int64_t)grads.size() == L, "backbone_bwd: grads: expected ", L, " layers, got ", (int64_t)grads.size());
  mamba_layers_check("backbone_bwd", "grad ", grads, dm, D, K, N, R);  // every check before anything is written
  const auto f32 = s.x2.options();
  const bool* st = ptr_or_null<bool>(s.starts);
  const int nt = nthreads();
  const Tensor dfeat2 = dfeat ? dfeat->reshape({BT, dm}).contiguous() : at::zeros({BT, dm}, f32);
  Tensor dh = new_empty({BT, dm}, f32);
  mrl_cpu::rmsnorm_bwd(fptr(dfeat2), fptr(s.h_last), fptr(s.rstd_f), fptr(s.normf_w), BT, (int)dm,
                       dh.data_ptr<float>(), nullptr, normf_g.data_ptr<float>(), nt);
  for (int64_t l = L - 1; l >= 0; --l) {
    const auto& w = s.layers[l];
    const auto& g = grads[l];
    const Tensor& xz = s.xz[l];
    const Tensor yf = s.y[l].view({BT, D});
    g[9].addmm_(dh.t(), yf);
    const Tensor dy = at::mm(dh, w[9]);  // [BT, D]
    const Tensor dfin = dssm_final ? (*dssm_final)[l].contiguous() : Tensor();
    auto dxz = new_empty({BT, 2 * D}, f32);  // [dxi | dz]: the conv writes the left half, the scan the right
    auto dxc = new_empty({B, T, D}, f32), ddt = new_empty({B, T, D}, f32);
    auto dB = new_empty({B, T, N}, f32), dC = new_empty({B, T, N}, f32);
    mrl_cpu::ScanBwdArgs sg{};
    sg.f = scan_args_saved(s, l);
    sg.f.ckpt = const_cast<float*>(fptr(s.ckpt[l]));
    sg.dout = fptr(dy); sg.g_sb = T * D; sg.g_st = D;
    sg.dfinal = dfin.defined() ? fptr(dfin) : nullptr;
    sg.dx = dxc.data_ptr<float>(); sg.ddt = ddt.data_ptr<float>();
    sg.dz = dxz.data_ptr<float>() + D; sg.dz_sb = T * 2 * D; sg.dz_st = 2 * D;
    sg.dB = dB.data_ptr<float>(); sg.dC = dC.data_ptr<float>();
    sg.dA_log = g[7].data_ptr<float>(); sg.dD = g[8].data_ptr<float>(); sg.ddt_bias = g[6].data_ptr<float>();
    sg.accumulate = true;
    sg.dinit = nullptr;
    mrl_cpu::scan_bwd(sg);
    const Tensor ddt2 = ddt.view({BT, D});
    g[5].addmm_(ddt2.t(), s.dbc[l].narrow(1, 0, R));
    // dL/d[dt_low, B, C] assembled in place as the fused node's Python does it (scan_bwd(dbc_out=) copies dB / dC
    // into their columns on the CPU): the dt_proj GEMM into the same column block, so the same bits
    const Tensor ddbc = new_empty({BT, R + 2 * N}, f32);
    Tensor ddt_low = ddbc.narrow(1, 0, R);
    at::mm_out(ddt_low, ddt2, w[5]);
    ddbc.narrow(1, R, N).copy_(dB.view({BT, N}));
    ddbc.narrow(1, R + N, N).copy_(dC.view({BT, N}));
    const Tensor dxc2 = at::addmm(dxc.view({BT, D}), ddbc, w[4]);
    g[4].addmm_(ddbc.t(), s.xc[l].view({BT, D}));
    const Tensor dcf = dconv_final ? (*dconv_final)[l].contiguous() : Tensor();
    mrl_cpu::ConvBwdArgs cg{};
    cg.f = conv_args_raw(xz.view({B, T, 2 * D}).narrow(2, 0, D), B, T, D, K, w[2], w[3],
                         fptr(s.conv0) + l * B * D * (K - 1), st);
    cg.dout = fptr(dxc2); cg.g_sb = T * D; cg.g_st = D;
    cg.dfinal = dcf.defined() ? fptr(dcf) : nullptr;
    cg.dx = dxz.data_ptr<float>(); cg.dx_sb = T * 2 * D; cg.dx_st = 2 * D;
    cg.dinit = nullptr;
    cg.dw = g[2].data_ptr<float>(); cg.dbias = g[3].data_ptr<float>(); cg.accumulate = true;
    mrl_cpu::conv_bwd(cg);
    g[1].addmm_(dxz.t(), s.u[l]);
    const Tensor du = at::mm(dxz, w[1]);  // [BT, dm]
    Tensor dh_in = new_empty({BT, dm}, f32);
    mrl_cpu::rmsnorm_bwd(fptr(du), fptr(s.h_in[l]), fptr(s.rstd[l]), fptr(w[0]), BT, (int)dm,
                         dh_in.data_ptr<float>(), fptr(dh), g[0].data_ptr<float>(), nt);
    dh = dh_in;
  }
  inp_w_g.addmm_(dh.t(), s.x2);
  inp_b_g.add_(at::sum(dh, {0}, false, at::kFloat));
  if (!need_dx) return Tensor();
  return at::mm(dh, s.inp_w).view({B, T, s.in_dim});
}

// ---------------- RMSNorm ----------------
std::vector<Tensor> rmsnorm_fwd(const Tensor& x, const Tensor& w, double eps, at::ScalarType out_dtype) {
  check_cpu(x, "rms_norm: x");
  MRL_CHECK(x.dim() >= 1 && x.size(-1) >= 1, "rms_norm: x: expected [..., C] with C >= 1, got ",
                    shape_str(x));
  check_dtype_f32(x, "rms_norm: x");
  MRL_CHECK(x.is_contiguous(), "rms_norm: x: expected a contiguous tensor, got strides ", x.strides());
  const int64_t C = x.size(-1), rows = x.numel() / C;
  check_f32(w, "rms_norm: weight", {C});
  MRL_CHECK(out_dtype == at::kFloat, "rms_norm: out_dtype: expected float32 (the CPU kernels are float32 "
                    "only), got ", out_dtype);
  auto out = new_empty(x.sizes(), x.options());
  std::vector<int64_t> rshape(x.sizes().begin(), x.sizes().end());
  rshape.back() = 1;
  auto rstd = new_empty(rshape, x.options());
  if (rows)
    mrl_cpu::rmsnorm_fwd(fptr(x), rows, (int)C, fptr(w), (float)eps, out.data_ptr<float>(), rstd.data_ptr<float>(),
                         nthreads());
  return {out, rstd};
}

Tensor rmsnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& w, Tensor& dw_acc,
                   const OptT& dx_acc, const OptT& dx_c) {
  check_cpu(x, "rms_norm: x");
  MRL_CHECK(x.dim() >= 1 && x.size(-1) >= 1, "rms_norm: x: expected [..., C] with C >= 1, got ",
                    shape_str(x));
  check_dtype_f32(x, "rms_norm: x");
  MRL_CHECK(x.is_contiguous(), "rms_norm: x: expected a contiguous tensor, got strides ", x.strides());
  const int64_t C = x.size(-1), rows = x.numel() / C;
  check_cpu(dy, "rms_norm: grad_out");
  check_dtype_f32(dy, "rms_norm: grad_out");
  MRL_CHECK(dy.numel() == x.numel() && dy.size(-1) == C && dy.is_contiguous(), "rms_norm: grad_out: expected "
                    "a contiguous tensor shaped like x ", shape_str(x), ", got ", shape_str(dy));
  check_cpu(rstd, "rms_norm: rstd");
  check_dtype_f32(rstd, "rms_norm: rstd");
  MRL_CHECK(rstd.numel() == rows && rstd.is_contiguous(), "rms_norm: rstd: expected a contiguous tensor "
                    "with ", rows, " elements, got ", shape_str(rstd));
  check_f32(w, "rms_norm: weight", {C});
  check_cpu(dw_acc, "rms_norm: dw_acc");
  check_dtype_f32(dw_acc, "rms_norm: dw_acc");
  MRL_CHECK(dw_acc.numel() == C && dw_acc.is_contiguous(), "rms_norm: dw_acc: expected a contiguous [", C,
                    "] tensor, got ", shape_str(dw_acc));
  if (dx_acc) {
    check_cpu(*dx_acc, "rms_norm: dh_acc");
    check_dtype_f32(*dx_acc, "rms_norm: dh_acc");
    MRL_CHECK(dx_acc->numel() == x.numel() && dx_acc->is_contiguous(), "rms_norm: dh_acc: expected a "
                      "contiguous tensor shaped like x ", shape_str(x), ", got ", shape_str(*dx_acc));
  }
  if (dx_c) {
    check_cpu(*dx_c, "rms_norm: dx_c");
    MRL_CHECK(dx_c->scalar_type() == at::kBFloat16 || dx_c->scalar_type() == at::kHalf, "rms_norm: dx_c: expected "
              "bfloat16 or float16 (the float32 dx is the return value), got ", dx_c->scalar_type());
    MRL_CHECK(dx_c->numel() == x.numel() && dx_c->is_contiguous(), "rms_norm: dx_c: expected a contiguous tensor "
              "shaped like x ", shape_str(x), ", got ", shape_str(*dx_c));
  }
  auto dx = new_empty(x.sizes(), x.options());
  if (rows)
    mrl_cpu::rmsnorm_bwd(fptr(dy), fptr(x), fptr(rstd), fptr(w), rows, (int)C, dx.data_ptr<float>(),
                         ptr_or_null<float>(dx_acc), dw_acc.data_ptr<float>(), nthreads());
  if (dx_c) dx_c->view(dx.sizes()).copy_(dx);  // same contract as CUDA (the CPU path never asks for it)
  return dx;
}

int scan_chunk() { return mrl_cpu::kScanChunk; }

// ---------------- Mamba-3 SISO mixer core and one-token step (mamba3.cpp, mamba3_step.cpp) ----------------
struct M3Shapes { int64_t B, T, Dp, H, P, N, R, di; };
// The largest d_state of the Mamba-3 core: a head's B and C sit in stack buffers of this size (kMaxState of
// mamba3.cpp; mamba_rl.ops.capability.M3_MAX_STATE says the same to the dispatch).
constexpr int64_t kM3MaxState = 256;

// Validates the core's inputs; the sizes come from dt_bias (H), B_norm_w (N), headdim (P) and the row width.
M3Shapes m3_check(const Tensor& zxbc, int64_t headdim, const Tensor& dt_bias, const Tensor& B_bias,
                  const Tensor& C_bias, const Tensor& B_w, const Tensor& C_w, const Tensor& Dp, const OptT& out_w,
                  const OptT& carry0, const OptT& ssm0, const OptT& starts, double eps, double A_floor) {
  check_cpu(zxbc, "mamba3: zxbc");
  MRL_CHECK(zxbc.dim() == 3 && zxbc.size(0) >= 1 && zxbc.size(1) >= 1, "mamba3: zxbc: expected shape [B, T, "
            "2 d_inner + 2 d_state + 3 nheads + R] with B, T >= 1, got ", shape_str(zxbc));
  MRL_CHECK(headdim >= 1, "mamba3: headdim: expected an int >= 1, got ", headdim);
  check_cpu(dt_bias, "mamba3: dt_bias");
  MRL_CHECK(dt_bias.dim() == 1 && dt_bias.size(0) >= 1, "mamba3: dt_bias: expected shape [nheads], got ",
            shape_str(dt_bias));
  check_cpu(B_w, "mamba3: B_norm.weight");
  MRL_CHECK(B_w.dim() == 1 && B_w.size(0) >= 2 && B_w.size(0) <= kM3MaxState, "mamba3: B_norm.weight: expected "
            "shape [d_state] with 2 <= d_state <= ", kM3MaxState, ", got ", shape_str(B_w));
  M3Shapes s{zxbc.size(0), zxbc.size(1), zxbc.size(2), dt_bias.size(0), headdim, B_w.size(0), 0, 0};
  s.di = s.H * s.P;
  s.R = s.Dp - 2 * s.di - 2 * s.N - 3 * s.H;
  MRL_CHECK(s.R >= 1 && 2 * s.R <= s.N, "mamba3: zxbc: expected a last dim of 2 d_inner + 2 d_state + 3 nheads + R "
            "= ", 2 * s.di + 2 * s.N + 3 * s.H, " + R with 1 <= R <= d_state / 2 = ", s.N / 2, " (d_inner = ",
            s.di, ", d_state = ", s.N, ", nheads = ", s.H, "), got ", s.Dp);
  check_act(zxbc, "mamba3: zxbc", s.B, s.T, s.Dp);
  check_f32(dt_bias, "mamba3: dt_bias", {s.H});
  check_f32(B_bias, "mamba3: B_bias (as [nheads, d_state])", {s.H, s.N});
  check_f32(C_bias, "mamba3: C_bias (as [nheads, d_state])", {s.H, s.N});
  check_f32(B_w, "mamba3: B_norm.weight", {s.N});
  check_f32(C_w, "mamba3: C_norm.weight", {s.N});
  check_f32(Dp, "mamba3: D", {s.H});
  if (out_w) check_f32(*out_w, "mamba3: norm.weight", {s.di});
  if (carry0) check_f32(*carry0, "mamba3: carry ([angle | k | v])", {s.B, s.H, s.R + s.N + s.P});
  if (ssm0) check_f32(*ssm0, "mamba3: ssm_state", {s.B, s.di, s.N});
  check_starts(starts, s.B, s.T);
  MRL_CHECK(eps > 0.0, "mamba3: eps: expected a value > 0, got ", eps);
  MRL_CHECK(A_floor > 0.0, "mamba3: A_floor: expected a value > 0, got ", A_floor);
  return s;
}

mrl_cpu::M3Args m3_args(const M3Shapes& s, const Tensor& zxbc, const Tensor& dt_bias, const Tensor& B_bias,
                        const Tensor& C_bias, const Tensor& B_w, const Tensor& C_w, const Tensor& Dp,
                        const OptT& out_w, const OptT& carry0, const OptT& ssm0, const OptT& starts, double eps,
                        double A_floor, bool heavy_tail) {
  mrl_cpu::M3Args a{};
  a.zxbc = fptr(zxbc); a.z_sb = zxbc.stride(0); a.z_st = zxbc.stride(1);
  a.dt_bias = fptr(dt_bias); a.B_bias = fptr(B_bias); a.C_bias = fptr(C_bias);
  a.B_w = fptr(B_w); a.C_w = fptr(C_w); a.Dskip = fptr(Dp); a.out_w = ptr_or_null<float>(out_w);
  a.carry0 = ptr_or_null<float>(carry0); a.ssm0 = ptr_or_null<float>(ssm0); a.starts = ptr_or_null<bool>(starts);
  a.eps = (float)eps; a.A_floor = (float)A_floor; a.heavy_tail = heavy_tail;
  a.B = (int)s.B; a.T = (int)s.T; a.H = (int)s.H; a.P = (int)s.P; a.N = (int)s.N; a.R = (int)s.R;
  a.nthreads = nthreads();
  return a;
}

int64_t m3_num_chunks(int64_t T) { return (T + mrl_cpu::kM3Chunk - 1) / mrl_cpu::kM3Chunk; }

std::vector<Tensor> m3_fwd(const Tensor& zxbc, int64_t headdim, const Tensor& dt_bias, const Tensor& B_bias,
                           const Tensor& C_bias, const Tensor& B_w, const Tensor& C_w, const Tensor& Dp,
                           const OptT& out_w, const OptT& carry0, const OptT& ssm0, const OptT& starts, double eps,
                           double A_floor, bool heavy_tail, bool need_ckpt) {
  const auto s = m3_check(zxbc, headdim, dt_bias, B_bias, C_bias, B_w, C_w, Dp, out_w, carry0, ssm0, starts, eps,
                          A_floor);
  auto f32 = zxbc.options();
  auto y = new_empty({s.B, s.T, s.di}, f32);
  auto carry_f = new_empty({s.B, s.H, s.R + s.N + s.P}, f32);
  auto ssm_f = new_empty({s.B, s.di, s.N}, f32);
  Tensor ckpt = need_ckpt ? new_empty({s.B, m3_num_chunks(s.T), s.H, mrl_cpu::m3_ckpt_len((int)s.P, (int)s.N,
                                                                                         (int)s.R)}, f32)
                          : Tensor();
  auto a = m3_args(s, zxbc, dt_bias, B_bias, C_bias, B_w, C_w, Dp, out_w, carry0, ssm0, starts, eps, A_floor,
                   heavy_tail);
  mrl_cpu::m3_fwd(a, y.data_ptr<float>(), carry_f.data_ptr<float>(), ssm_f.data_ptr<float>(),
                  need_ckpt ? ckpt.data_ptr<float>() : nullptr);
  return {y, carry_f, ssm_f, ckpt};
}

// -> [dzxbc, ddt_bias, dB_bias, dC_bias, dB_norm_w, dC_norm_w, dD, dout_w or None]; with acc (those 6 or 7
// gradients as tensors) the parameter gradients are added into acc and returned.
std::vector<Tensor> m3_bwd(const Tensor& zxbc, int64_t headdim, const Tensor& dt_bias, const Tensor& B_bias,
                           const Tensor& C_bias, const Tensor& B_w, const Tensor& C_w, const Tensor& Dp,
                           const OptT& out_w, const OptT& carry0, const OptT& ssm0, const OptT& starts, double eps,
                           double A_floor, bool heavy_tail, const Tensor& ckpt, const Tensor& dy,
                           const OptT& dcarry, const OptT& dssm, const OptT& dzxbc_out,
                           const std::optional<std::vector<Tensor>>& acc) {
  const auto s = m3_check(zxbc, headdim, dt_bias, B_bias, C_bias, B_w, C_w, Dp, out_w, carry0, ssm0, starts, eps,
                          A_floor);
  check_f32(ckpt, "mamba3: ckpt", {s.B, m3_num_chunks(s.T), s.H,
                                   mrl_cpu::m3_ckpt_len((int)s.P, (int)s.N, (int)s.R)});
  check_f32(dy, "mamba3: grad_y", {s.B, s.T, s.di});
  if (dcarry) check_f32(*dcarry, "mamba3: grad_final_carry", {s.B, s.H, s.R + s.N + s.P});
  if (dssm) check_f32(*dssm, "mamba3: grad_final_ssm", {s.B, s.di, s.N});
  if (dzxbc_out) check_f32(*dzxbc_out, "mamba3: dzxbc_out", {s.B, s.T, s.Dp});
  const size_t n_acc = out_w ? 7 : 6;
  if (acc) {
    MRL_CHECK(acc->size() == n_acc, "mamba3: acc: expected ", (int64_t)n_acc, " tensors [ddt_bias, dB_bias, dC_bias, "
              "dB_norm_w, dC_norm_w, dD", out_w ? ", dnorm_w" : "", "], got ", (int64_t)acc->size());
    check_f32((*acc)[0], "mamba3: ddt_bias_acc", {s.H});
    check_f32((*acc)[1], "mamba3: dB_bias_acc (as [nheads, d_state])", {s.H, s.N});
    check_f32((*acc)[2], "mamba3: dC_bias_acc (as [nheads, d_state])", {s.H, s.N});
    check_f32((*acc)[3], "mamba3: dB_norm_w_acc", {s.N});
    check_f32((*acc)[4], "mamba3: dC_norm_w_acc", {s.N});
    check_f32((*acc)[5], "mamba3: dD_acc", {s.H});
    if (out_w) check_f32((*acc)[6], "mamba3: dnorm_w_acc", {s.di});
  }
  auto f32 = zxbc.options();
  auto zeros = [&](at::IntArrayRef shp) { return at::zeros(shp, f32); };
  std::vector<Tensor> g(n_acc);
  if (acc) {
    g = *acc;
  } else {
    g[0] = zeros({s.H}); g[1] = zeros({s.H, s.N}); g[2] = zeros({s.H, s.N}); g[3] = zeros({s.N});
    g[4] = zeros({s.N}); g[5] = zeros({s.H});
    if (out_w) g[6] = zeros({s.di});
  }
  auto dz = dzxbc_out ? *dzxbc_out : new_empty({s.B, s.T, s.Dp}, f32);
  auto a = m3_args(s, zxbc, dt_bias, B_bias, C_bias, B_w, C_w, Dp, out_w, carry0, ssm0, starts, eps, A_floor,
                   heavy_tail);
  mrl_cpu::M3BwdArgs b{};
  b.ckpt = fptr(ckpt); b.dy = fptr(dy); b.dcarry = ptr_or_null<float>(dcarry); b.dssm = ptr_or_null<float>(dssm);
  b.dzxbc = dz.data_ptr<float>();
  b.ddt_bias = g[0].data_ptr<float>(); b.dB_bias = g[1].data_ptr<float>(); b.dC_bias = g[2].data_ptr<float>();
  b.dB_w = g[3].data_ptr<float>(); b.dC_w = g[4].data_ptr<float>(); b.dD = g[5].data_ptr<float>();
  b.dout_w = out_w ? g[6].data_ptr<float>() : nullptr;
  mrl_cpu::m3_bwd(a, b);
  std::vector<Tensor> out{dz};
  for (auto& t : g) out.push_back(t);
  if (!out_w) out.push_back(Tensor());
  return out;
}

Tensor m3_backbone_step(const Tensor& x, const Tensor& inp_w, const Tensor& inp_b, const Tensor& normf_w,
                        const std::vector<std::vector<Tensor>>& layers, Tensor& carry, Tensor& ssm,
                        const OptT& starts, double eps, int64_t headdim, double A_floor, bool heavy_tail) {
  const auto io = step_io_check("m3_backbone_step", x, inp_w, inp_b, normf_w, layers.size(), starts);
  const int64_t B = io.B, dm = io.dm, L = io.L;
  MRL_CHECK(headdim >= 1, "m3_backbone_step: headdim: expected an int >= 1, got ", headdim);
  check_cpu(carry, "m3_backbone_step: carry");
  check_cpu(ssm, "m3_backbone_step: ssm_state");
  MRL_CHECK(carry.dim() == 4 && carry.size(0) == L && carry.size(1) == B && carry.size(2) >= 1,
            "m3_backbone_step: carry: expected shape [", L, ", ", B, ", nheads, R + d_state + headdim], got ",
            shape_str(carry));
  const int64_t H = carry.size(2), di = H * headdim;
  MRL_CHECK(ssm.dim() == 4 && ssm.size(3) >= 2 && ssm.size(3) <= kM3MaxState, "m3_backbone_step: ssm_state: "
            "expected shape [", L, ", ", B, ", ", di, ", d_state] with 2 <= d_state <= ", kM3MaxState, ", got ",
            shape_str(ssm));
  const int64_t N = ssm.size(3), R = carry.size(3) - N - headdim;
  MRL_CHECK(R >= 1 && 2 * R <= N, "m3_backbone_step: carry: expected a last dim of R + d_state + headdim = R + ",
            N + headdim, " with 1 <= R <= ", N / 2, ", got ", carry.size(3));
  check_f32(carry, "m3_backbone_step: carry", {L, B, H, R + N + headdim});
  check_f32(ssm, "m3_backbone_step: ssm_state", {L, B, di, N});
  const int64_t Dp = 2 * di + 2 * N + 3 * H + R;
  const size_t nt = layers[0].size();
  for (int64_t l = 0; l < L; ++l) {
    const auto& t = layers[l];
    MRL_CHECK((t.size() == 9 || t.size() == 10) && t.size() == nt, "m3_backbone_step: layer ", l, ": expected 9 "
              "tensors (10 with the gated out norm), the same for every layer, got ", (int64_t)t.size());
    check_f32(t[0], "m3_backbone_step: norm.weight", {dm});
    check_f32(t[1], "m3_backbone_step: in_proj.weight", {Dp, dm});
    check_f32(t[2], "m3_backbone_step: dt_bias", {H});
    check_f32(t[3], "m3_backbone_step: B_bias (as [nheads, d_state])", {H, N});
    check_f32(t[4], "m3_backbone_step: C_bias (as [nheads, d_state])", {H, N});
    check_f32(t[5], "m3_backbone_step: B_norm.weight", {N});
    check_f32(t[6], "m3_backbone_step: C_norm.weight", {N});
    check_f32(t[7], "m3_backbone_step: D", {H});
    check_f32(t[8], "m3_backbone_step: out_proj.weight", {dm, di});
    if (t.size() == 10) check_f32(t[9], "m3_backbone_step: mixer.norm.weight", {di});
  }
  MRL_CHECK(eps > 0.0, "m3_backbone_step: eps: expected a value > 0, got ", eps);
  MRL_CHECK(A_floor > 0.0, "m3_backbone_step: A_floor: expected a value > 0, got ", A_floor);
  return mrl_cpu::m3_backbone_step(x, inp_w, inp_b, normf_w, layers, carry, ssm, ptr_or_null<bool>(starts),
                                   (float)eps, (int)headdim, (float)A_floor, heavy_tail, nthreads());
}
// ---------------- end of the Mamba-3 block ----------------

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mamba_rl CPU kernels (csrc/cpu/; loaded by mamba_rl/ops/extension.py): the CUDA binding's functions, "
            "float32, OpenMP";
  m.def("conv_fwd", &conv_fwd, "causal conv1d + SiLU forward -> [out [B,T,D], final_state [B,D,K-1]]");
  m.def("conv_bwd", &conv_bwd, "causal conv1d + SiLU backward -> [dx, dweight, dbias, dinit or None]; optional "
        "strided dx_out (written) and dw_acc/db_acc (added into)", py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("init"), py::arg("starts"), py::arg("dout"), py::arg("dfinal"), py::arg("need_dinit"),
        py::arg("dx_out") = py::none(), py::arg("dw_acc") = py::none(), py::arg("db_acc") = py::none());
  m.def("scan_fwd", &scan_fwd, "selective scan forward -> [y [B,T,D], final_state [B,D,N], ckpt [B,nC,D,N] or "
        "None]; ckpt[b, c] is the state entering step c * scan_chunk()");
  m.def("scan_bwd", &scan_bwd, "selective scan backward -> [dx, ddt, dA_log, dB, dC, dD, dz, ddt_bias, dinit or "
        "None]; optional strided dz_out (written) and acc=[dA_log, dD, ddt_bias] (added into); optional dbc_out "
        "[B*T, dt_rank + 2N] float32 (unit column stride, row stride >= dt_rank + 2N): dB / dC are written into its "
        "last 2N columns (the others untouched) and returned as [B, T, N] views of them (the CUDA contract; copied "
        "here); ValueError naming the expected and received value for a bad shape, stride, dtype or device",
        py::arg("x"),
        py::arg("dt"), py::arg("A_log"), py::arg("Bm"), py::arg("Cm"), py::arg("D"), py::arg("z"),
        py::arg("dt_bias"), py::arg("init"), py::arg("starts"), py::arg("ckpt"), py::arg("dout"), py::arg("dfinal"),
        py::arg("need_dinit"), py::arg("dz_out") = py::none(), py::arg("acc") = py::none(),
        py::arg("dbc_out") = py::none());
  py::class_<PreparedStep>(m, "PreparedStep", "one-token step with its weights and states checked and bound once")
      .def("launch", &PreparedStep::launch, "run on x_t [B, in_dim] f32 (starts [B] bool or None) -> features "
           "[B, d_model], or None (nothing run) when x_t or starts does not fit", py::arg("x"), py::arg("starts"));
  m.def("backbone_step_prepare", &backbone_step_prepare, "check and bind the one-token step's weights and states "
        "once (x gives B and input_dim) -> PreparedStep");
  m.def("backbone_step", &backbone_step, "one token through the whole backbone; conv_state / ssm_state updated in "
        "place -> features [B, d_model] (rows_per_block is ignored on the CPU)");
  py::class_<BackboneSaved, std::shared_ptr<BackboneSaved>>(m, "BackboneSaved", "what backbone_fwd keeps for "
                                                                 "backbone_bwd (opaque)");
  // both release the GIL for the call (a whole forward or backward: other Python threads, e.g. a progress bar,
  // and signal handling run meanwhile, as they do during torch's own GEMMs)
  m.def("backbone_fwd", &backbone_fwd, "the whole Mamba-1 backbone forward of a training step -> (features [B, T, "
        "d_model], final conv, final ssm, saved); conv_out / ssm_out: write the final states there (returned)", py::call_guard<py::gil_scoped_release>(), py::arg("x"),
        py::arg("inp_w"), py::arg("inp_b"), py::arg("normf_w"),
        py::arg("layers"), py::arg("conv0"), py::arg("ssm0"), py::arg("starts"), py::arg("eps"),
        py::arg("conv_out") = py::none(), py::arg("ssm_out") = py::none());
  m.def("backbone_bwd", &backbone_bwd, "backward of backbone_fwd's call: parameter gradients added into the given "
        "gradient views -> dx or None", py::call_guard<py::gil_scoped_release>(), py::arg("saved"), py::arg("dfeat"),
        py::arg("dconv_final"),
        py::arg("dssm_final"), py::arg("inp_w_g"), py::arg("inp_b_g"), py::arg("normf_g"), py::arg("grads"),
        py::arg("need_dx"));
  m.def("rmsnorm_fwd", &rmsnorm_fwd, "RMSNorm forward -> [out (float32), rstd [..., 1]]");
  m.def("rmsnorm_bwd", &rmsnorm_bwd, "RMSNorm backward -> dx (+ dh_acc); adds dL/dw into dw_acc; optional dx_c "
        "(bf16/f16, written with dx cast)", py::arg("dy"), py::arg("x"), py::arg("rstd"), py::arg("w"),
        py::arg("dw_acc"), py::arg("dx_acc"), py::arg("dx_c") = py::none());
  m.def("set_poison", &set_poison, "fill every output/workspace with NaN on allocation (tests)");
  m.def("grad_stats", &grad_stats, "global grad norm, clip coef, overflow flag, bias corrections into scalars "
        "(in place; counter is ignored on the CPU)", py::arg("grad"), py::arg("extra_grad_sq"), py::arg("loss_scale"),
        py::arg("hyper"), py::arg("scalars"), py::arg("counter") = py::none());
  m.def("adamw_step", &adamw_step, "flat-arena AdamW with decay boundary and compute copy (in place); zero_grad "
        "leaves grad all zeros (zeroed in the same pass, also on a skipped step)", py::arg("param"), py::arg("grad"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("hyper"), py::arg("scalars"), py::arg("n_decay"),
        py::arg("compute") = py::none(), py::arg("zero_grad") = false);
  m.def("retain_heap", &retain_heap, "glibc: serve allocations below mmap_threshold bytes from the heap and keep up "
        "to trim_threshold bytes of its free top (process-wide mallopt); False where it does not apply",
        py::arg("mmap_threshold"), py::arg("trim_threshold"));
  m.def("scan_chunk", &scan_chunk, "checkpoint interval of the scan backward (steps)");
  // Mamba-3 (mamba3.cpp, mamba3_step.cpp)
  m.def("m3_fwd", &m3_fwd, "Mamba-3 SISO mixer core forward -> [y [B,T,d_inner], final carry [B,H,R+N+P], final ssm "
        "[B,d_inner,N], ckpt or None]", py::arg("zxbc"), py::arg("headdim"), py::arg("dt_bias"), py::arg("B_bias"),
        py::arg("C_bias"), py::arg("B_norm_w"), py::arg("C_norm_w"), py::arg("D"), py::arg("norm_w"), py::arg("carry"),
        py::arg("ssm"), py::arg("starts"), py::arg("eps"), py::arg("A_floor"), py::arg("heavy_tail"),
        py::arg("need_ckpt"));
  m.def("m3_bwd", &m3_bwd, "Mamba-3 SISO mixer core backward -> [dzxbc, ddt_bias, dB_bias, dC_bias, dB_norm_w, "
        "dC_norm_w, dD, dnorm_w or None]; optional dzxbc_out (written) and acc (added into)", py::arg("zxbc"),
        py::arg("headdim"), py::arg("dt_bias"), py::arg("B_bias"), py::arg("C_bias"), py::arg("B_norm_w"),
        py::arg("C_norm_w"), py::arg("D"), py::arg("norm_w"), py::arg("carry"), py::arg("ssm"), py::arg("starts"),
        py::arg("eps"), py::arg("A_floor"), py::arg("heavy_tail"), py::arg("ckpt"), py::arg("dy"),
        py::arg("dcarry"), py::arg("dssm"), py::arg("dzxbc_out") = py::none(), py::arg("acc") = py::none());
  m.def("m3_backbone_step", &m3_backbone_step, "one token through the whole Mamba-3 backbone; carry / ssm updated "
        "in place -> features [B, d_model]");
  m.def("m3_chunk", []() { return mrl_cpu::kM3Chunk; }, "checkpoint interval of the Mamba-3 backward (steps)");
}
