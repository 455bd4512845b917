// backbone_step cluster-kernel instantiation for __nv_bfloat16 GEMM weights.
#include "step_cluster.cuh"
namespace mrl {
const char* backbone_step_cluster_bf16(const StepParams& p, int R, cudaStream_t s) { return stepc_launch_t<__nv_bfloat16>(p, R, s); }
}  // namespace mrl
