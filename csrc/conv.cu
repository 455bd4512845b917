// causal_conv1d: dtype dispatch and the deterministic weight-gradient reduction.
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

struct ConvWGradOut {
  float* dw; float* dbias; int D, K; bool acc;
  __device__ void operator()(int j, float v) const {
    int k = j / D, d = j - k * D;
    float* dst = k < K ? dw + d * K + k : dbias + d;
    *dst = acc ? *dst + v : v;
  }
};

const char* conv_bwd(int dtype, const ConvBwdParams& p, cudaStream_t s) {
  const char* err = nullptr;
  switch (dtype) {
    case kF32: err = conv_bwd_f32(p, s); break;
    case kBF16: err = conv_bwd_bf16(p, s); break;
    case kF16: err = conv_bwd_f16(p, s); break;
    default: return "causal_conv1d: unsupported dtype";
  }
  if (err) return err;
  const int P = p.B * ((p.T + CONV_LC - 1) / CONV_LC);
  launch_colsum(p.ws, P, (p.K + 1) * p.D, ConvWGradOut{p.dw, p.dbias, p.D, p.K, p.accumulate}, s);
  MRL_LAUNCH_CHECK();
  return nullptr;
}
}  // namespace mrl
