// One-token backbone step on the CPU (declared for binding.cpp, which validates every tensor first).
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

namespace mrl_cpu {

// Runs x_t [B, in_dim] through input_proj, every Mamba layer and norm_f; conv_state [L, B, D, K-1] and
// ssm_state [L, B, D, N] are updated in place; starts is [B] bool or nullptr. layers[l] holds the 10
// tensors (norm.weight, in_proj.weight, conv1d.weight as [D, K], conv1d.bias, x_proj.weight,
// dt_proj.weight, dt_proj.bias, A_log, D, out_proj.weight), all contiguous float32. Returns [B, d_model].
at::Tensor backbone_step(const at::Tensor& x, const at::Tensor& inp_w, const at::Tensor& inp_b,
                         const at::Tensor& normf_w, const std::vector<std::vector<at::Tensor>>& layers,
                         at::Tensor& conv_state, at::Tensor& ssm_state, const bool* starts, float eps,
                         int nthreads);

}  // namespace mrl_cpu
