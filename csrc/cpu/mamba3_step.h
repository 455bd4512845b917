// One-token Mamba-3 backbone step on the CPU (declared for binding.cpp, which validates every tensor first).
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

namespace mrl_cpu {

// x_t [B, in_dim] through input_proj, every Mamba-3 layer and norm_f; carry [L, B, H, R + N + P] and ssm
// [L, B, H P, N] updated in place; starts [B] bool or nullptr. layers[l] holds (norm.weight, in_proj.weight,
// dt_bias, B_bias as [H, N], C_bias as [H, N], B_norm.weight, C_norm.weight, D, out_proj.weight[,
// mixer.norm.weight]), all contiguous float32. Returns [B, d_model].
at::Tensor m3_backbone_step(const at::Tensor& x, const at::Tensor& inp_w, const at::Tensor& inp_b,
                            const at::Tensor& normf_w, const std::vector<std::vector<at::Tensor>>& layers,
                            at::Tensor& carry, at::Tensor& ssm, const bool* starts, float eps, int headdim,
                            float A_floor, bool heavy_tail, int nthreads);

}  // namespace mrl_cpu
