// backbone_step cluster2-kernel instantiation for float GEMM weights.
#include "step_cluster2.cuh"
namespace mrl {
const char* backbone_step_cluster2_f32(const StepParams& p, int R, cudaStream_t s) {
  return stepc2_launch_t<float>(p, R, s);
}
bool backbone_step_cluster2_ok(const StepParams& p) { return stepc2_supported(p); }
size_t backbone_step_cluster2_smem(const StepParams& p, int R) { return stepc2_smem_bytes(p, R); }
}  // namespace mrl
