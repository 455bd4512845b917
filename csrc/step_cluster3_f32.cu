// backbone_step cluster3-kernel instantiation for float GEMM weights.
#include "step_cluster3.cuh"
namespace mrl {
const char* backbone_step_cluster3_f32(const StepParams& p, int R, cudaStream_t s) {
  return stepc3_launch_t<float>(p, R, s);
}
bool backbone_step_cluster3_ok(const StepParams& p) { return stepc3_supported(p); }
size_t backbone_step_cluster3_smem(const StepParams& p, int R) { return stepc3_smem_bytes(p, R); }
// the float32 build's answer stands for every weight dtype: the three share the block shape and shared memory
int backbone_step_cluster3_max_clusters(const StepParams& p, int R) { return stepc3_max_clusters_t<float>(p, R); }
}  // namespace mrl
