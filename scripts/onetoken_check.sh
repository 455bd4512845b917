#!/usr/bin/env bash
# One device call for the one-token step's kernels: build, the step and stepper cuda tests, every kernel alone per
# batch size (benchmarks/probes/step_kernels.py), phase stamps of the cluster kernels (benchmarks/probes/
# cluster2_probe.cu built with -DMRL_SC2_PROBE), and bench's one-token rows with their peers. Optionally an A/B of
# the cluster kernels against REV (a git revision or a `git archive -o x.tar <rev> csrc` tarball, see
# scripts/cluster2_ab.sh). Everything lands in $OUT as one tarball plus a short summary on stdout.
# Usage on the device: [REV=...] [STAMPS="256 32 3,64 8 3,1 1 2"] scripts/onetoken_check.sh
# (a STAMPS entry is "B R kernel", kernel 2 = cluster2, 3 = cluster3)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
W=$(mktemp -d)
export MAMBA_RL_BUILD_DIR=${MAMBA_RL_BUILD_DIR:-$PWD/.build}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$W/pip.log" 2>&1 || echo "editable install failed"
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
(python3 -m mamba_rl.build --kind cuda >"$W/build.log" 2>&1; echo "build rc=$? in $(( $(date +%s) - t0 )) s" >>"$W/build.log") &
nvcc -arch=sm_90 -O3 -std=c++17 -DMRL_SC2_PROBE -o "$W/stamps" benchmarks/probes/cluster2_probe.cu &
if [ -n "${REV:-}" ]; then
  OUT=$W REV=$REV ROUNDS=${ROUNDS:-2} SHAPES=${SHAPES:-"1 1,16 2,32 4,64 8 3,128 16 3,256 32 3"} \
    timeout 300 bash scripts/cluster2_ab.sh 2>&1 | tail -12
fi
wait
tail -1 "$W/build.log"
for s in $(echo "${STAMPS:-256 32 3,64 8 3,1 1 2}" | tr ' ,' '_ '); do
  echo "== stamps ${s//_/ }" >>"$W/stamps.txt"
  timeout 60 "$W/stamps" ${s//_/ } >>"$W/stamps.txt" 2>&1
done
timeout 240 python3 -m pytest -m cuda -q -n 8 -p no:cacheprovider --timeout=120 tests/ops/test_cuda_step.py \
  tests/model/test_stepper.py tests/train/test_trainer_cuda.py -k "step or Step" 2>&1 | tail -2
timeout 150 python3 benchmarks/probes/step_kernels.py >"$W/step_kernels.txt" 2>&1
grep -E "^(float32|bfloat16) " "$W/step_kernels.txt" | awk '{print $1, $2, $3}'
timeout 200 python3 benchmarks/bench.py --only infer --no-mamba3 --no-step-kernels --out "$W/infer.json" 2>&1 | tail -5
rm -f "$W/stamps"
tar czf "$OUT/onetoken_check.tgz" -C "$W" . && rm -rf "$W"
