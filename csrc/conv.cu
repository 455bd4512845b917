// causal_conv1d: dtype dispatch (the kernels and the weight-gradient sums: conv.cuh).
#include "conv.cuh"

namespace mrl {
const char* conv_fwd_f32(const ConvFwdParams&, cudaStream_t);
const char* conv_fwd_bf16(const ConvFwdParams&, cudaStream_t);
const char* conv_fwd_f16(const ConvFwdParams&, cudaStream_t);
const char* conv_bwd_f32(const ConvBwdParams&, cudaStream_t);
const char* conv_bwd_bf16(const ConvBwdParams&, cudaStream_t);
const char* conv_bwd_f16(const ConvBwdParams&, cudaStream_t);

int64_t conv_bwd_workspace(int B, int T, int D, int K) {
  return (int64_t)B * ((T + CONV_LC - 1) / CONV_LC) * (K + 1) * D;
}

const char* conv_fwd(int dtype, const ConvFwdParams& p, cudaStream_t s) {
  switch (dtype) {
    case kF32: return conv_fwd_f32(p, s);
    case kBF16: return conv_fwd_bf16(p, s);
    case kF16: return conv_fwd_f16(p, s);
  }
  return "causal_conv1d: unsupported dtype";
}

const char* conv_bwd(int dtype, const ConvBwdParams& p, cudaStream_t s) {
  switch (dtype) {
    case kF32: return conv_bwd_f32(p, s);
    case kBF16: return conv_bwd_bf16(p, s);
    case kF16: return conv_bwd_f16(p, s);
  }
  return "causal_conv1d: unsupported dtype";
}
}  // namespace mrl
