#!/usr/bin/env bash
# One device call (<= 9 minutes on an H200) for the GPU agent loop: install the provided wheels
# and the package, build the extension, run the agent's CUDA tests, then the end-to-end SPS benchmark.
# Usage on the device: scripts/gpu_agent_check.sh ; logs and JSON go to $OUT (or ./gpu_out).
# Env knobs: SPS_ARGS (extra benchmarks/sps.py arguments), TEST_TIMEOUT (s, default 180),
# BENCH_TIMEOUT (s, default 390).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export MAMBA_RL_BUILD_DIR=${MAMBA_RL_BUILD_DIR:-$PWD/.build}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then  # gymnasium, stable-baselines3, sb3-contrib, ...
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >"$OUT/pip_wheels.log" 2>&1 \
    || echo "wheel install failed (see pip_wheels.log)"
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/pip.log" 2>&1 \
  || echo "editable install failed (see pip.log)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, gymnasium; print('torch', torch.__version__, torch.version.cuda, 'gymnasium', gymnasium.__version__)" \
  | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
python3 -m mamba_rl.build --kind cuda 2>&1 | tee "$OUT/build.log"; brc=${PIPESTATUS[0]}
echo "build rc=$brc wall=$(( $(date +%s) - t0 )) s" | tee -a "$OUT/build.log"
[ "$brc" -ne 0 ] && exit "$brc"
timeout "${TEST_TIMEOUT:-180}" python3 -m pytest -m cuda -q -p no:cacheprovider ${TEST_PATHS:-tests/agents} 2>&1 | tee "$OUT/pytest_agents.log"
rc=${PIPESTATUS[0]}
echo "pytest rc=$rc" | tee -a "$OUT/pytest_agents.log"
timeout "${BENCH_TIMEOUT:-390}" python3 benchmarks/sps.py --out "$OUT/sps.json" ${SPS_ARGS:-} 2>&1 | tee "$OUT/sps.log"
brc=${PIPESTATUS[0]}
echo "sps rc=$brc" | tee -a "$OUT/sps.log"
[ "$rc" -ne 0 ] && exit "$rc"
exit "$brc"
