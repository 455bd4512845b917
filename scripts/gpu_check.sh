#!/usr/bin/env bash
# One device call: build the extension (cache carried in .build), run every CUDA test, run the benchmark.
# Usage on the device: [BENCH_ARGS=...] scripts/gpu_check.sh [tests|bench|all] ; logs and JSON go to $OUT (or ./gpu_out).
# The wheels the device lacks (gymnasium, popgym, sb3, pytest-xdist): scripts/fetch_wheels.sh here, then carry .whl.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export MAMBA_RL_BUILD_DIR=${MAMBA_RL_BUILD_DIR:-$PWD/.build}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
WHAT=${1:-all}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# the package maps agents/ and envs/ to mamba_rl.agents / mamba_rl.envs: install it editable (no deps, offline)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/pip.log" 2>&1 || echo "editable install failed (see pip.log)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch;print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"
t0=$(date +%s.%N)
# the CPU kernels too (some cuda tests compare with them), built beside the CUDA ones
(python3 -m mamba_rl.build --kind cpu >"$OUT/build_cpu.log" 2>&1) &
python3 -m mamba_rl.build --kind cuda 2>&1 | tee "$OUT/build.log"; brc=${PIPESTATUS[0]}
wait
echo "build rc=$brc wall=$(python3 -c "print(round($(date +%s.%N)-$t0,1))") s" | tee -a "$OUT/build.log"
[ $brc -ne 0 ] && exit $brc
rc=0
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  # 8 workers where pytest-xdist is installed (the whole cuda suite: ~2 min on the H200 host)
  python3 -c "import xdist" 2>/dev/null && XDIST=${XDIST:--n 8} || XDIST=""
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m cuda -q -rfE --timeout=120 --continue-on-collection-errors -p no:cacheprovider $XDIST ${PYTEST_ARGS:-} ${TEST_PATHS:-tests} 2>&1 \
    | tee "$OUT/pytest.log" | grep -v "^tests/.*PASSED" ; rc=${PIPESTATUS[0]}
  echo "pytest rc=$rc"
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  if [ -f benchmarks/bench.py ]; then
    # BENCH_ARGS: e.g. "--no-mamba3 --no-step-kernels --dtypes f32 bf16 --rounds 3" (issue 18's table of record;
    # ~100 s a round on an H100: BENCH_TIMEOUT=480)
    timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench.py ${BENCH_ARGS:-} --out "$OUT/bench.json" 2>&1 \
      | tee "$OUT/bench.log"
  fi
fi
exit $rc
