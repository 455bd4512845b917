// selective_scan: dtype dispatch and the fixed-order reductions of the backward.
#include "scan_common.cuh"

namespace mrl {
const char* scan_fwd_f32(const ScanFwdParams&, cudaStream_t);
const char* scan_fwd_bf16(const ScanFwdParams&, cudaStream_t);
const char* scan_fwd_f16(const ScanFwdParams&, cudaStream_t);
const char* scan_bwd_f32(const ScanBwdParams&, cudaStream_t);
const char* scan_bwd_bf16(const ScanBwdParams&, cudaStream_t);
const char* scan_bwd_f16(const ScanBwdParams&, cudaStream_t);

int scan_chunk() { return SCAN_TC; }

// Channel tiles of a block geometry: CPB = SCAN_THREADS / (N / np) channels a block, np states a thread.
static int scan_tiles(int D, int N, int np = SCAN_NPT) {
  const int cpb = SCAN_THREADS / (N / np);
  return (D + cpb - 1) / cpb;
}

static int g_forced_segments = 0;  // scan_set_segments(): 0 = automatic
void scan_set_segments(int n) { g_forced_segments = n > 0 ? n : 0; }

// The time split: nseg segments of seg_len chunks (the last may be shorter, none empty). The grid is
// tiles x B x nseg blocks of which minb fit on an SM: nseg is the largest count that still fits the grid in
// one wave (a second, partial wave would double the time), at least 1, at most the number of chunks.
struct ScanSplit { int nseg, seg_len; };
static ScanSplit scan_split(int B, int T, int D, int N, int minb, int np = SCAN_NPT) {
  const int nC = (T + SCAN_TC - 1) / SCAN_TC;
  const int64_t base = (int64_t)scan_tiles(D, N, np) * B;
  int64_t want = g_forced_segments > 0 ? g_forced_segments : ((int64_t)sm_count() * minb) / base;
  want = want < 1 ? 1 : (want > nC ? nC : want);
  const int len = (int)((nC + want - 1) / want);
  return {(nC + len - 1) / len, len};
}

static int g_bwd_blocks = 0;  // scan_set_bwd_blocks(): 0 = automatic
void scan_set_bwd_blocks(int n) {  // the binding checks n
  g_bwd_blocks = (n == SCAN_BWD_MINB || n == SCAN_BWD_MINB_WIDE || n == SCAN_BWD_MINB_PAIR) ? n : 0;
}

// The backward's build (blocks per SM: the 3-block one, at d_state 16 the 4-block "wide" one or the 2-block
// "pair" one with 8 states a thread, scan_bwd.cuh) and its split. Automatic: where one segment's grid
// overfills 3 blocks per SM (nseg is 1 either way), the pair build for segments of at least
// SCAN_PAIR_MIN_CHUNKS chunks, else the wide build; elsewhere the 3-block build. Measured on an H100, the
// backward alone (benchmarks/NOTES.md, thirty-second session): the pair build -7 % at 64 x 128 and 64 x 1024
// (8 and 64 chunks), +3 % at 256 x 32 (2 chunks), +1 to +6 % where the grid is split (16 x 64, 16 x 512).
// Where the 3-block grid is split over T and runs as separate launches (its reductions too large for the cooperative
// one, scan_bwd_small_reduce), the 4-block build with its own, finer split, also as separate launches (so the same
// launch count): measured on an H100, the backward alone bf16 (thirty-fifth session, benchmarks/NOTES.md), 16 x 512
// 112.8-114.9 -> 108.0-109.7 µs (3 -> 4 segments, two calls), 16 x 2048 412.8 -> 397.0 (3 -> 4), 4 x 4096 230.8 ->
// 215.0 (12 -> 16). Where the 3-block build runs cooperatively (16 x 64) it stays: the 4-block build's cooperative
// kernel with a local pass spills at 128 registers and was slower (16 x 512: 124.4 µs), and its separate launches
// (24.8 against 26.5 µs at 16 x 64) would add two launches a layer. scan_set_bwd_blocks() forces any build.
constexpr int SCAN_PAIR_MIN_CHUNKS = 8;
struct ScanBwdConfig { ScanSplit sp; int build; };
static ScanBwdConfig scan_bwd_config(int B, int T, int D, int N) {
  const bool d16 = N == 16;
  int build = SCAN_BWD_MINB;
  const int64_t tiles_b = (int64_t)scan_tiles(D, N) * B;
  if (d16 && tiles_b > (int64_t)SCAN_BWD_MINB * sm_count()) {
    build = (T + SCAN_TC - 1) / SCAN_TC >= SCAN_PAIR_MIN_CHUNKS ? SCAN_BWD_MINB_PAIR : SCAN_BWD_MINB_WIDE;
  } else if (d16) {
    const ScanSplit s3 = scan_split(B, T, D, N, SCAN_BWD_MINB);
    if (s3.nseg > 1 && !scan_bwd_small_reduce(B, T, N, tiles_b * s3.nseg * SCAN_THREADS)) build = SCAN_BWD_MINB_WIDE;
  }
  if (g_bwd_blocks != 0) build = d16 ? g_bwd_blocks : SCAN_BWD_MINB;
  // the split sized for the build's own tiles and blocks per SM (where the automatic rule takes the wide or the
  // pair build, one segment's grid already overfills the SMs, so nseg is 1 either way)
  const int np = build == SCAN_BWD_MINB_PAIR ? SCAN_PAIR_NP : SCAN_NPT;
  return {scan_split(B, T, D, N, build, np), build};
}

int scan_segments(int B, int T, int D, int N, bool bwd) {
  return bwd ? scan_bwd_config(B, T, D, N).sp.nseg : scan_split(B, T, D, N, scan_fwd_minb(N)).nseg;
}

int64_t scan_fwd_workspace(int B, int T, int D, int N) {
  const ScanSplit sp = scan_split(B, T, D, N, scan_fwd_minb(N));
  return sp.nseg > 1 ? 2 * (int64_t)B * sp.nseg * D * N : 4;
}

int64_t scan_bwd_workspace(int B, int T, int D, int N) {
  const ScanSplit sp = scan_bwd_config(B, T, D, N).sp;
  return (int64_t)scan_tiles(D, N) * B * T * 2 * N + 2 * (int64_t)B * sp.nseg * D * N +
         (int64_t)B * sp.nseg * (D * N + 2 * (int64_t)D);
}

const char* scan_fwd(int dtype, const ScanFwdParams& p0, cudaStream_t s) {
  ScanFwdParams p = p0;
  const ScanSplit sp = scan_split(p.B, p.T, p.D, p.N, scan_fwd_minb(p.N));
  p.nseg = sp.nseg; p.seg_len = sp.seg_len;
  switch (dtype) {
    case kF32: return scan_fwd_f32(p, s);
    case kBF16: return scan_fwd_bf16(p, s);
    case kF16: return scan_fwd_f16(p, s);
  }
  return "selective_scan: unsupported dtype";
}

const char* scan_bwd(int dtype, const ScanBwdParams& q0, cudaStream_t s) {
  ScanBwdParams q = q0;
  const ScanBwdConfig cfg = scan_bwd_config(q.f.B, q.f.T, q.f.D, q.f.N);
  q.f.nseg = cfg.sp.nseg; q.f.seg_len = cfg.sp.seg_len;
  q.build = cfg.build;
  const char* err = nullptr;
  switch (dtype) {
    case kF32: err = scan_bwd_f32(q, s); break;
    case kBF16: err = scan_bwd_bf16(q, s); break;
    case kF16: err = scan_bwd_f16(q, s); break;
    default: return "selective_scan: unsupported dtype";
  }
  if (err) return err;
  MRL_LAUNCH_CHECK();
  return nullptr;
}
}  // namespace mrl
