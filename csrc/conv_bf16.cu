// causal_conv1d instantiation for __nv_bfloat16 (built in parallel with the other dtypes).
#include "conv.cuh"
namespace mrl {
const char* conv_fwd_bf16(const ConvFwdParams& p, cudaStream_t s) { return conv_fwd_t<__nv_bfloat16>(p, s); }
const char* conv_bwd_bf16(const ConvBwdParams& p, cudaStream_t s) { return conv_bwd_main_t<__nv_bfloat16>(p, s); }
}  // namespace mrl
