// causal_conv1d instantiation for __half (built in parallel with the other dtypes).
#include "conv.cuh"
namespace mrl {
const char* conv_fwd_f16(const ConvFwdParams& p, cudaStream_t s) { return conv_fwd_t<__half>(p, s); }
const char* conv_bwd_f16(const ConvBwdParams& p, cudaStream_t s) { return conv_bwd_main_t<__half>(p, s); }
}  // namespace mrl
