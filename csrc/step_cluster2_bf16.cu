// backbone_step cluster2-kernel instantiation for __nv_bfloat16 GEMM weights.
#include "step_cluster2.cuh"
namespace mrl {
const char* backbone_step_cluster2_bf16(const StepParams& p, int R, cudaStream_t s) {
  return stepc2_launch_t<__nv_bfloat16>(p, R, s);
}
}  // namespace mrl
