#!/usr/bin/env bash
# A/B of git revisions' training step in one device call, with the whole cuda suite on the last one.
#
# Here (a machine with git): scripts/ab_call.sh prepare REV [REV ...]
#   writes each revision's source tree to .whl/trees/<i>_<rev> (git archive; gitignored, carried with
#   run(carry=[".whl"])) and fetches the wheels the device lacks (scripts/fetch_wheels.sh) if .whl has none.
# On the device: [BUDGET=540] [RESERVE=150] [ROWS="128x16x64 ..."] [F32_ROWS="..."] [SUITE=1] [SCAN_SHAPES="16x64 ..."] \
#   [SCAN_BWD_BLOCKS="0,3"] [WGRAD_ROWS="1024 ..."] [TIMELINE="f32:128x16x64 ..."] [AB_CONFIGS="..."] scripts/ab_call.sh run
#   builds every tree's CUDA kernels in parallel (each into its own TREE/.build), runs the cuda-marked tests on the
#   last tree (SUITE=0 skips them; it may take all but RESERVE seconds of the budget), then, as BUDGET seconds allow:
#   benchmarks/ab_trees.py over the trees (bf16 on ROWS, 2 rounds; f32 on F32_ROWS, 1 round),
#   benchmarks/scan_kernels.py on every tree (SCAN_SHAPES, bf16; the backward's builds SCAN_BWD_BLOCKS side by side
#   where given), benchmarks/wgrad_kernel.py on every tree (the step's grouped weight-gradient launch alone at each
#   of WGRAD_ROWS rows, f32 and bf16),
#   benchmarks/timeline.py on the last tree for each DTYPE:DMxBxT in TIMELINE and,
#   where AB_CONFIGS holds its arguments (e.g. "--rows 128x64x128 --dtypes bf16 --configs base bwd3 --rounds 2"),
#   benchmarks/ab_configs.py on the last tree.
#   Everything goes to $OUT/r and is packed into $OUT/r.tgz (the device returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
R=$PWD; W=$R/.whl; TREES=$W/trees
case "${1:-}" in
  prepare)
    shift
    [ $# -ge 1 ] || { echo "usage: scripts/ab_call.sh prepare REV [REV ...]"; exit 2; }
    for rev in "$@"; do
      git rev-parse --verify -q "$rev^{commit}" >/dev/null || { echo "ab_call: not a git revision: $rev"; exit 2; }
    done
    rm -rf "$TREES"; mkdir -p "$TREES"
    i=0
    for rev in "$@"; do
      name=${i}_$(git rev-parse --short "$rev^{commit}")
      mkdir -p "$TREES/$name"
      git archive "$rev" README.md pyproject.toml mamba_rl csrc agents envs tests scripts benchmarks/bench.py \
        benchmarks/ab_trees.py benchmarks/ab_configs.py benchmarks/scan_kernels.py benchmarks/timeline.py \
        benchmarks/wgrad_kernel.py benchmarks/step_once.py \
        | tar x -C "$TREES/$name" || exit 1
      echo "$rev -> .whl/trees/$name"
      i=$((i + 1))
    done
    ls "$W"/*.whl >/dev/null 2>&1 || bash scripts/fetch_wheels.sh
    du -sh "$W"
    exit 0 ;;
  run) ;;
  *) echo "usage: scripts/ab_call.sh prepare REV [REV ...] | run"; exit 2 ;;
esac

OUT=${OUT:-$R/gpu_out}; O=$OUT/r; mkdir -p "$O"
BUDGET=${BUDGET:-540}; T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
log() { echo "$* at $(($(date +%s) - T0)) s" | tee -a "$O/steps.txt"; }
trap 'tar czf "$OUT/r.tgz" -C "$OUT" r' EXIT
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$W"/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
mapfile -t T < <(ls -d "$TREES"/*/ 2>/dev/null | sed 's:/$::')
[ ${#T[@]} -ge 1 ] || { echo "no trees under .whl/trees: run 'scripts/ab_call.sh prepare REV ...' first"; exit 2; }
LAST=${T[${#T[@]} - 1]}
{ nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; date -u; printf '%s\n' "${T[@]}"; } > "$O/gpu.txt"
b0=$(date +%s)
for t in "${T[@]}"; do
  (cd "$t" && MAMBA_RL_BUILD_DIR=$t/.build PYTHONPATH=$t:/tmp/site python3 -m mamba_rl.build --kind cuda \
     > "$O/build_$(basename "$t").log" 2>&1; echo "rc=$? wall=$(($(date +%s) - b0)) s (${#T[@]} builds in parallel)" \
     >> "$O/build_$(basename "$t").log") &
done
(cd "$LAST" && MAMBA_RL_BUILD_DIR=$LAST/.build PYTHONPATH=$LAST:/tmp/site python3 -m mamba_rl.build --kind cpu \
   > "$O/build_cpu.log" 2>&1) &
wait
log "builds done"
if [ "${SUITE:-1}" = 1 ]; then
  (cd "$LAST" && python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$O/pip.log" 2>&1
   MAMBA_RL_BUILD_DIR=$LAST/.build timeout $(($(left) - ${RESERVE:-150})) python3 -m pytest -m cuda -q -rfE \
     --timeout=120 -p no:cacheprovider -n 8 tests > "$O/pytest.log" 2>&1; echo "pytest rc=$?" >> "$O/steps.txt")
  log "suite"; grep -E "passed|failed|error" "$O/pytest.log" | tail -2 >> "$O/steps.txt"
fi
if [ ${#T[@]} -ge 2 ] && [ "$(left)" -gt 60 ]; then
  timeout $(($(left) - 5)) python3 "$LAST/benchmarks/ab_trees.py" --trees "${T[@]}" \
    --rows ${ROWS:-128x16x64 128x64x128 128x256x32 128x16x512 128x64x1024} --dtype bf16 --rounds 2 \
    --out "$O/ab_bf16.json" > "$O/ab_bf16.log" 2>&1
  log "ab bf16"
fi
if [ ${#T[@]} -ge 2 ] && [ -n "${F32_ROWS-128x16x64 128x64x1024}" ] && [ "$(left)" -gt 60 ]; then
  timeout $(($(left) - 5)) python3 "$LAST/benchmarks/ab_trees.py" --trees "${T[@]}" \
    --rows ${F32_ROWS-128x16x64 128x64x1024} --dtype f32 --rounds 1 --out "$O/ab_f32.json" > "$O/ab_f32.log" 2>&1
  log "ab f32"
fi
shapes=(); for s in ${SCAN_SHAPES-}; do shapes+=(--shape "$s"); done
for t in "${T[@]}"; do
  [ -n "${SCAN_SHAPES-}" ] && [ "$(left)" -gt 40 ] || break
  MAMBA_RL_BUILD_DIR=$t/.build timeout $(($(left) - 5)) python3 "$t/benchmarks/scan_kernels.py" --tree "$t" \
    --label "$(basename "$t")" --dtype bfloat16 "${shapes[@]}" ${SCAN_BWD_BLOCKS:+--bwd-blocks "$SCAN_BWD_BLOCKS"} \
    --out "$O/scan_$(basename "$t").json" > "$O/scan_$(basename "$t").log" 2>&1
  log "scan $(basename "$t")"
done
for t in "${T[@]}"; do  # the grouped weight-gradient launch alone, the step's jobs (a tree without the script: skipped)
  [ -n "${WGRAD_ROWS-}" ] && [ -f "$t/benchmarks/wgrad_kernel.py" ] && [ "$(left)" -gt 30 ] || continue
  MAMBA_RL_BUILD_DIR=$t/.build PYTHONPATH=$t:/tmp/site timeout $(( $(left) < 60 ? $(left) - 5 : 40 )) python3 \
    "$t/benchmarks/wgrad_kernel.py" --source step --rows $WGRAD_ROWS --dtypes f32 bf16 --no-torch \
    > "$O/wgrad_$(basename "$t").log" 2>&1
  log "wgrad $(basename "$t")"
done
for spec in ${TIMELINE-}; do  # DTYPE:DMxBxT, one replay's kernels on the last tree (benchmarks/timeline.py)
  [ "$(left)" -gt 30 ] || break
  dt=${spec%%:*}; sh=${spec#*:}
  MAMBA_RL_BUILD_DIR=$LAST/.build PYTHONPATH=$LAST:/tmp/site timeout $(($(left) - 5)) python3 \
    "$LAST/benchmarks/timeline.py" --dtype "$dt" --shape "$sh" --out "$O/timeline_${dt}_$sh.json" \
    > "$O/timeline_${dt}_$sh.log" 2>&1
  log "timeline $spec"
done
if [ -n "${AB_CONFIGS-}" ] && [ "$(left)" -gt 40 ]; then  # configurations of the last tree in one process
  MAMBA_RL_BUILD_DIR=$LAST/.build PYTHONPATH=$LAST:/tmp/site timeout $(($(left) - 5)) \
    python3 "$LAST/benchmarks/ab_configs.py" $AB_CONFIGS --out "$O/ab_configs.json" > "$O/ab_configs.log" 2>&1
  log "ab_configs"
fi
log "end"
