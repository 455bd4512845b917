#!/usr/bin/env bash
# One device call (<= 6 minutes on 2 H200s) for data-parallel PPO: install the provided wheels and
# the package, build the CUDA extension, run the data-parallel tests (NCCL 2-GPU identity + gloo resume), then
# the SPS of 2 ranks x 64 envs against 1 GPU x 64 envs.
# Usage on the 2-GPU device: scripts/gpu_ddp_check.sh ; logs and JSON go to $OUT (or ./gpu_out).
# Env knobs: TEST_K (pytest -k of tests/agents/test_ddp.py, default "nccl": the 2-GPU identity and resume tests),
# TEST_TIMEOUT (s, default 150), BENCH_TIMEOUT (s, default 180), SPS_ARGS (extra sps.py arguments).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
# NVLink multicast stays off on the shared device
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export MAMBA_RL_BUILD_DIR=${MAMBA_RL_BUILD_DIR:-$PWD/.build}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then  # gymnasium, tensorboard, ...
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >"$OUT/pip_wheels.log" 2>&1 \
    || echo "wheel install failed (see pip_wheels.log)"
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/pip.log" 2>&1 \
  || echo "editable install failed (see pip.log)"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), \
'gpus', torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
python3 -m mamba_rl.build --kind cuda 2>&1 | tee "$OUT/build.log"; brc=${PIPESTATUS[0]}
echo "build rc=$brc wall=$(( $(date +%s) - t0 )) s" | tee -a "$OUT/build.log"
[ "$brc" -ne 0 ] && exit "$brc"
t0=$(date +%s)
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -rs tests/agents/test_ddp.py \
  -k "${TEST_K:-nccl}" 2>&1 | tee "$OUT/pytest_ddp.log"
rc=${PIPESTATUS[0]}
echo "pytest rc=$rc wall=$(( $(date +%s) - t0 )) s" | tee -a "$OUT/pytest_ddp.log"
t0=$(date +%s)
timeout "${BENCH_TIMEOUT:-180}" python3 benchmarks/sps.py --nproc 2 --envs 64 --updates 16 --no-sb3 \
  --out "$OUT/sps_ddp.json" ${SPS_ARGS:-} 2>&1 | tee "$OUT/sps_ddp.log"
brc=${PIPESTATUS[0]}
echo "sps rc=$brc wall=$(( $(date +%s) - t0 )) s" | tee -a "$OUT/sps_ddp.log"
[ "$rc" -ne 0 ] && exit "$rc"
exit "$brc"
