// backbone_step cluster-kernel instantiation for __half GEMM weights.
#include "step_cluster.cuh"
namespace mrl {
const char* backbone_step_cluster_f16(const StepParams& p, int R, bool fused_norm, cudaStream_t s) {
  return stepc_launch_t<__half>(p, R, fused_norm, s);
}
}  // namespace mrl
