#!/usr/bin/env bash
# One device call for learning sweeps: install carried wheels, build the CUDA kernels once, run
# benchmarks/learning/sweep.py with the given arguments, and pack every CSV + the summary into $OUT.
# Usage on the device: scripts/device_sweep.sh NAME [sweep.py args...]
set -uo pipefail
cd "$(dirname "$0")/.."
NAME=$1; shift
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAMBA_RL_BUILD_DIR=${MAMBA_RL_BUILD_DIR:-$PWD/.build}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/pip.log" 2>&1 || echo "editable install failed"
python3 -m mamba_rl.build --kind all || exit 1
python3 benchmarks/learning/sweep.py --out "/tmp/$NAME" "$@" 2>&1 | tee "$OUT/$NAME.md"
tar -czf "$OUT/$NAME.tgz" -C /tmp "$NAME"
