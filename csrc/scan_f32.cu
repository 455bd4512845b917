// selective_scan instantiation for float (built in parallel with the other dtypes).
#include "scan_fwd.cuh"
#include "scan_bwd.cuh"
namespace mrl {
const char* scan_fwd_f32(const ScanFwdParams& p, cudaStream_t s) { return scan_fwd_t<float>(p, s); }
const char* scan_bwd_f32(const ScanBwdParams& q, cudaStream_t s) { return scan_bwd_t<float>(q, s); }
}  // namespace mrl
