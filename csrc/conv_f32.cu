// causal_conv1d instantiation for float (built in parallel with the other dtypes).
#include "conv.cuh"
namespace mrl {
const char* conv_fwd_f32(const ConvFwdParams& p, cudaStream_t s) { return conv_fwd_t<float>(p, s); }
const char* conv_bwd_f32(const ConvBwdParams& p, cudaStream_t s) { return conv_bwd_main_t<float>(p, s); }
}  // namespace mrl
