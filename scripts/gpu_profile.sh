#!/usr/bin/env bash
# One device call: build, then Nsight Compute over the kernels of eager training steps (benchmarks/step_once.py:
# the default model at 16 x 64 unless SHAPE="B T"; STEPS of them, default 1) whose names match KERNELS (a regex;
# default: the scan backward, the grouped weight gradients, x_proj / dt_proj, the norm backward); SKIP / COUNT are
# ncu's --launch-skip / --launch-count over the matched launches (default 0 / 100).
# Writes the report ($OUT/ncu_step.ncu-rep), its details (ncu_step.txt) and each kernel's five largest warp stall
# reasons (ncu_step_stalls.txt: cycles a warp waits per issued instruction, WarpStateStats).
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
  -o "$OUT/ncu_step" python3 benchmarks/step_once.py --dtype "${DTYPE:-bf16}" --batch "$B" --seq-len "$T" \
  --steps "${STEPS:-1}" --coop "${COOP:-7}" > "$OUT/ncu_step.log" 2>&1
echo "ncu rc=$?"; tail -3 "$OUT/ncu_step.log"
"$NCU" --import "$OUT/ncu_step.ncu-rep" --print-summary none > "$OUT/ncu_step.txt" 2>&1
grep -E "^  [a-zA-Z_].*\(|Duration|Warp Cycles Per Issued|Registers Per|Waves Per SM|Achieved Occupancy" "$OUT/ncu_step.txt" | head -80
# each kernel's warp stall reasons (cycles a warp waits per issued instruction, WarpStateStats), largest first:
# where "no_instruction" is large, the kernel's code is fetched cold (the thirty-ninth session's grouped launch)
"$NCU" --import "$OUT/ncu_step.ncu-rep" --page raw --csv > "$OUT/ncu_step_raw.csv" 2>/dev/null
python3 - "$OUT/ncu_step_raw.csv" <<'PY' | tee "$OUT/ncu_step_stalls.txt"
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
if len(rows) < 3:
    sys.exit("no raw rows")
head = rows[0]
name = head.index("Kernel Name") if "Kernel Name" in head else None
cols = [i for i, h in enumerate(head) if "issue_stalled" in h and h.endswith("per_issue_active.ratio")]
for r in rows[2:]:  # row 1: units
    vals = []
    for i in cols:
        try:
            vals.append((float(r[i].replace(",", "")), head[i].split("issue_stalled_")[1].split("_per_issue")[0]))
        except (ValueError, IndexError):
            pass
    vals.sort(reverse=True)
    total = sum(v for v, _ in vals) or 1.0
    label = (r[name] if name is not None else "?")[:60]
    print(f"{label:60s} " + " ".join(f"{n}={v:.1f}({100 * v / total:.0f}%)" for v, n in vals[:5]))
PY
