// selective_scan instantiation for __nv_bfloat16 (built in parallel with the other dtypes).
#include "scan_fwd.cuh"
#include "scan_bwd.cuh"
namespace mrl {
const char* scan_fwd_bf16(const ScanFwdParams& p, cudaStream_t s) { return scan_fwd_t<__nv_bfloat16>(p, s); }
const char* scan_bwd_bf16(const ScanBwdParams& q, cudaStream_t s) { return scan_bwd_t<__nv_bfloat16>(q, s); }
}  // namespace mrl
