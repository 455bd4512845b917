#!/usr/bin/env bash
# One device call: Nsight Compute's stall sampling per SASS instruction of the selective-scan kernels at one
# shape, launched alone by benchmarks/scan_kernels.py --once (one eager forward and backward; the extension must be
# built first: python3 -m mamba_rl.build --kind cuda). KERNELS is a comma list of kernel-name regexes, one ncu run
# (first matching launch) each; SHAPE BxT (d_inner 256, d_state 16); DTYPE bfloat16 / float32. For each: the ncu
# details (duration, occupancy, warp states, issue) and benchmarks/probes/ncu_regions.py's regions summary; the
# raw source CSVs are packed into $OUT/ncu_scan.tgz with the summaries.
# Usage on the device: [SHAPE=64x1024] [DTYPE=bfloat16] [KERNELS="scan_bwd_pair,scan_fwd_kernel"] scripts/ncu_scan.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
. scripts/ncu_summary.sh  # sets NCU and the work directory W
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SourceCounters \
--section ComputeWorkloadAnalysis --section InstructionStats"
for k in $(echo "${KERNELS:-scan_bwd_pair,scan_fwd_kernel}" | tr ',' ' '); do
  timeout ${NCU_TIMEOUT:-200} "$NCU" --clock-control none -k regex:"$k" --launch-count 1 $S -o "$W/rep_$k" \
    python3 benchmarks/scan_kernels.py --once --shape "${SHAPE:-64x1024}" --dtype "${DTYPE:-bfloat16}" \
    > "$W/ncu_$k.log" 2>&1 || { echo "ncu failed for $k"; tail -20 "$W/ncu_$k.log"; continue; }
  ncu_summary "$W" "$k" "$k at ${SHAPE:-64x1024} ${DTYPE:-bfloat16}" 25
done
rm -f "$W"/rep_*
tar czf "$OUT/ncu_scan.tgz" -C "$W" . && rm -rf "$W"
