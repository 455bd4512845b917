// backbone_step cluster2-kernel instantiation for __half GEMM weights.
#include "step_cluster2.cuh"
namespace mrl {
const char* backbone_step_cluster2_f16(const StepParams& p, int R, cudaStream_t s) {
  return stepc2_launch_t<__half>(p, R, s);
}
}  // namespace mrl
