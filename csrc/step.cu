// backbone_step: weight-dtype dispatch.
#include "ops.h"
namespace mrl {
const char* backbone_step_f32(const StepParams&, int, cudaStream_t);
const char* backbone_step_bf16(const StepParams&, int, cudaStream_t);
const char* backbone_step_f16(const StepParams&, int, cudaStream_t);
const char* backbone_step(int wdtype, const StepParams& p, int R, cudaStream_t s) {
  if (p.L > STEP_MAX_LAYERS) return "backbone_step: at most 16 layers";
  switch (wdtype) {
    case kF32: return backbone_step_f32(p, R, s);
    case kBF16: return backbone_step_bf16(p, R, s);
    case kF16: return backbone_step_f16(p, R, s);
  }
  return "backbone_step: unsupported weight dtype";
}
}  // namespace mrl
