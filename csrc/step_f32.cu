// backbone_step instantiation for float GEMM weights.
#include "step.cuh"
namespace mrl {
const char* backbone_step_f32(const StepParams& p, int R, cudaStream_t s) { return step_launch_t<float>(p, R, s); }
}  // namespace mrl
