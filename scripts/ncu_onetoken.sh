#!/usr/bin/env bash
# One device call: Nsight Compute's per-instruction stall sampling of the one-token cluster kernels, run alone by
# benchmarks/probes/cluster2_probe.cu (no torch), one launch per configuration (the 5th: caches warm, states
# written). CONFIGS is a comma list of "B R kernel" (kernel 2 = cluster2, 3 = cluster3). For each: the ncu details
# (duration, occupancy, warp states) and benchmarks/probes/ncu_regions.py's summary of the source page; the raw
# source CSVs are packed into $OUT/ncu_onetoken.tgz with the summaries.
# SAMPLING is ncu's --warp-sampling-interval (auto; 0 samples every 32 cycles: short kernels at B = 1 need it).
# Usage on the device: [CONFIGS="256 32 3,1 1 2,16 2 2"] [SAMPLING=0] scripts/ncu_onetoken.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
. scripts/ncu_summary.sh  # sets NCU and the work directory W
nvcc -arch=sm_90 -O3 -std=c++17 -lineinfo -o "$W/probe" benchmarks/probes/cluster2_probe.cu || exit 1
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SourceCounters"
for c in $(echo "${CONFIGS:-256 32 3,1 1 2,16 2 2}" | tr ' ,' '_ '); do
  read -r B R K <<< "${c//_/ }"
  name=$([ "$K" = 3 ] && echo cluster3 || echo cluster2)
  timeout 200 "$NCU" --clock-control none -k regex:"$name" --launch-skip 4 --launch-count 1 \
    --warp-sampling-interval "${SAMPLING:-auto}" $S -o "$W/rep_$c" \
    "$W/probe" "$B" "$R" "$K" > "$W/ncu_$c.log" 2>&1 || { echo "ncu failed for $c"; tail -5 "$W/ncu_$c.log"; }
  ncu_summary "$W" "$c" "$B $R $K ($name)" 30
done
rm -f "$W/probe" "$W"/rep_*
tar czf "$OUT/ncu_onetoken.tgz" -C "$W" . && rm -rf "$W"
