#!/usr/bin/env bash
# Build the CPU kernels against an older supported torch (OLD_TORCH, default 2.13.0, a CPU build) in a throwaway
# venv and run the CPU kernel tests there: CI's main run covers the newest torch that pip picks.
set -euo pipefail
cd "$(dirname "$0")/.."
OLD_TORCH=${OLD_TORCH:-2.13.0}
venv=$(mktemp -d)/venv; trap 'rm -rf "$(dirname "$venv")"' EXIT
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch==$OLD_TORCH" numpy ninja pytest safetensors
"$venv/bin/python" -m pip install -q --no-deps -e .
export MAMBA_RL_BUILD_DIR=${MAMBA_RL_BUILD_DIR:-$(dirname "$venv")/build}
"$venv/bin/python" -c "import torch; print('ci_old_torch: torch', torch.__version__)"
"$venv/bin/python" -m mamba_rl.build --kind cpu
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/ops/test_cpu_kernels.py tests/ops/test_extension.py
