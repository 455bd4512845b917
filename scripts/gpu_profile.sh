#!/usr/bin/env bash
# One device call: build, then Nsight Compute over the kernels of eager training steps (benchmarks/step_once.py:
# the default model at 16 x 64 unless SHAPE="B T"; STEPS of them, default 1) whose names match KERNELS (a regex;
# default: the scan backward, the grouped weight gradients, x_proj / dt_proj, the norm backward); SKIP / COUNT are
# ncu's --launch-skip / --launch-count over the matched launches (default 0 / 100).
# Usage on the device: [DTYPE=bf16] [COOP=7] [KERNELS=regex] [SHAPE="16 64"] scripts/gpu_profile.sh ; text to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export MAMBA_RL_BUILD_DIR=${MAMBA_RL_BUILD_DIR:-$PWD/.build} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m mamba_rl.build --kind cuda > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
read -r B T <<< "${SHAPE:-16 64}"
K=${KERNELS:-"scan_bwd|wgrad_kernel|xdt_|norm_bwd_kernel"}
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats"
S="$S --section MemoryWorkloadAnalysis --section SourceCounters"
timeout ${NCU_TIMEOUT:-400} "$NCU" --clock-control none -k regex:"$K" --launch-skip ${SKIP:-0} --launch-count ${COUNT:-100} $S \
  python3 benchmarks/step_once.py --dtype "${DTYPE:-bf16}" --batch "$B" --seq-len "$T" --steps "${STEPS:-1}" \
  --coop "${COOP:-7}" \
  > "$OUT/ncu_step.txt" 2>&1
echo "ncu rc=$?"
grep -E "^  [a-zA-Z_].*\(|Duration|Warp Cycles Per Issued|Registers Per|Waves Per SM|Achieved Occupancy" "$OUT/ncu_step.txt" | head -80
