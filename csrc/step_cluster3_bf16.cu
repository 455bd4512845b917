// backbone_step cluster3-kernel instantiation for bfloat16 GEMM weights.
#include "step_cluster3.cuh"
namespace mrl {
const char* backbone_step_cluster3_bf16(const StepParams& p, int R, cudaStream_t s) {
  return stepc3_launch_t<__nv_bfloat16>(p, R, s);
}
}  // namespace mrl
