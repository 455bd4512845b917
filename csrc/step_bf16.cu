// backbone_step instantiation for __nv_bfloat16 GEMM weights.
#include "step.cuh"
namespace mrl {
const char* backbone_step_bf16(const StepParams& p, int R, cudaStream_t s) { return step_launch_t<__nv_bfloat16>(p, R, s); }
}  // namespace mrl
