// backbone_step cluster-kernel instantiation for float GEMM weights.
#include "step_cluster.cuh"
namespace mrl {
const char* backbone_step_cluster_f32(const StepParams& p, int R, bool fused_norm, cudaStream_t s) {
  return stepc_launch_t<float>(p, R, fused_norm, s);
}
bool backbone_step_cluster_ok(const StepParams& p) { return stepc_supported(p); }
}  // namespace mrl
