// backbone_step instantiation for __half GEMM weights.
#include "step.cuh"
namespace mrl {
const char* backbone_step_f16(const StepParams& p, int R, cudaStream_t s) { return step_launch_t<__half>(p, R, s); }
}  // namespace mrl
