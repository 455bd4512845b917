// backbone_step cluster3-kernel instantiation for float16 GEMM weights.
#include "step_cluster3.cuh"
namespace mrl {
const char* backbone_step_cluster3_f16(const StepParams& p, int R, cudaStream_t s) {
  return stepc3_launch_t<__half>(p, R, s);
}
}  // namespace mrl
