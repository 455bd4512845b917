#!/usr/bin/env bash
# One device call: A/B of the one-token cluster kernel (csrc/step_cluster2.cuh) between this working tree and a git
# revision, with benchmarks/probes/cluster2_probe.cu (no Python, no torch). Both probes are built from this tree's
# probe source against each tree's csrc/, then run alternately, ROUNDS times per shape. Prints, per B / R, the
# per-launch time in a 20-launch graph of each build (µs) and whether their outputs and SSM states have the same
# FNV hash (same bits); with STAMPS="B R ..." it also writes this tree's phase stamps (-DMRL_SC2_PROBE).
# A shape is "B R" (cluster2) or "B R 3" (cluster3: the old tree must have it).
# Usage on the device: REV=<git rev or csrc tarball> [SHAPES="1 1,8 1,16 2,64 4,256 16"] [ROUNDS=2] [STAMPS="256 16"] \
#   scripts/cluster2_ab.sh ; the full probe output goes to $OUT/cluster2_ab.txt (and $OUT/cluster2_stamps.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
REV=${REV:?set REV to the git revision to compare with}
W=$(mktemp -d)
mkdir -p "$W/old/benchmarks/probes"
# REV: a git revision, or a tarball of csrc/ made here with `git archive -o old.tar <rev> csrc` (the device's copy
# of the repository may not hold this machine's newest commits)
if [ -f "$REV" ]; then tar xf "$REV" -C "$W/old"; else git archive "$REV" csrc | tar x -C "$W/old"; fi \
  && [ -d "$W/old/csrc" ] || { echo "cluster2_ab: cannot read csrc at $REV"; exit 2; }
cp benchmarks/probes/cluster2_probe.cu "$W/old/benchmarks/probes/"
F="-arch=sm_90 -O3 -std=c++17"
nvcc $F -o "$W/new" benchmarks/probes/cluster2_probe.cu &
nvcc $F -o "$W/old.bin" "$W/old/benchmarks/probes/cluster2_probe.cu" &
[ -n "${STAMPS:-}" ] && nvcc $F -DMRL_SC2_PROBE -o "$W/stamps" benchmarks/probes/cluster2_probe.cu &
wait
[ -x "$W/new" ] && [ -x "$W/old.bin" ] || { echo "cluster2_ab: a probe did not build"; exit 1; }
IFS=, read -ra SH <<< "${SHAPES:-1 1,8 1,16 2,64 4,256 16}"
: > "$OUT/cluster2_ab.txt"
for s in "${SH[@]}"; do
  read -r B R KER <<< "$s"
  for ((i = 0; i < ${ROUNDS:-2}; ++i)); do
    for v in old new; do
      bin="$W/new"; [ $v = old ] && bin="$W/old.bin"
      echo "== $v $B $R ${KER:-2}" >> "$OUT/cluster2_ab.txt"
      "$bin" "$B" "$R" "${KER:-2}" >> "$OUT/cluster2_ab.txt" 2>&1
    done
  done
done
python3 - "$OUT/cluster2_ab.txt" "$REV" <<'EOF'
import re, sys
per, fnv, who = {}, {}, None
for line in open(sys.argv[1]):
    m = re.match(r"== (old|new) (\d+) (\d+) (\d+)", line)
    if m:
        who = (m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)))
        continue
    if line.startswith("== "):
        who = None
        continue
    m = re.search(r"per launch in a 20-launch graph ([0-9.]+) us", line)
    if m and who:
        per.setdefault(who, []).append(float(m.group(1)))
    m = re.search(r"fnv ([0-9a-f]+)", line)
    if m and who:
        fnv.setdefault(who, set()).add(m.group(1))
print(f"| B (R, kernel) | {sys.argv[2]} µs | this tree µs | change | same bits |")
print("|---|---|---|---|---|")
for (v, B, R, K) in sorted({k for k in per if k[0] == "old"}, key=lambda k: (k[3], k[1], k[2])):
    o, n = per.get(("old", B, R, K), []), per.get(("new", B, R, K), [])
    if not o or not n:
        continue
    ch = 100 * (min(n) / min(o) - 1)
    same = fnv.get(("old", B, R, K)) == fnv.get(("new", B, R, K))
    print(f"| {B} ({R}, cluster{K}) | {', '.join(f'{x:.2f}' for x in o)} | {', '.join(f'{x:.2f}' for x in n)} | {ch:+.1f} % | {same} |")
EOF
if [ -n "${STAMPS:-}" ]; then
  : > "$OUT/cluster2_stamps.txt"
  IFS=, read -ra ST <<< "$STAMPS"
  for s in "${ST[@]}"; do echo "== stamps $s" >> "$OUT/cluster2_stamps.txt"; "$W/stamps" $s >> "$OUT/cluster2_stamps.txt" 2>&1; done
fi
rm -rf "$W"
