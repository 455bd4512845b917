// selective_scan instantiation for __half (built in parallel with the other dtypes).
#include "scan_fwd.cuh"
#include "scan_bwd.cuh"
namespace mrl {
const char* scan_fwd_f16(const ScanFwdParams& p, cudaStream_t s) { return scan_fwd_t<__half>(p, s); }
const char* scan_bwd_f16(const ScanBwdParams& q, cudaStream_t s) { return scan_bwd_t<__half>(q, s); }
}  // namespace mrl
