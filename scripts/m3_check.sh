#!/usr/bin/env bash
# One device call for the Mamba-3 CUDA kernels (csrc/mamba3.cu): build the CUDA and CPU extensions, run the
# Mamba-3 CUDA tests (tests/model/test_mamba3_cuda.py: parity with the float64 reference in f32 / bf16 for
# T in {1, 3, 63, 64, 65, 1000, 2049}, the CPU kernels beside them, step, eager vs graph, poisoning) with their
# measured errors printed, then a short timing of a training step and a one-token step against the reference
# backend on the same GPU. Logs go to $OUT (or ./m3_out).
# Usage on the device, from the repository root: bash scripts/m3_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/m3_out}; mkdir -p "$OUT"
export MAMBA_RL_BUILD_DIR=${MAMBA_RL_BUILD_DIR:-/tmp/mbuild-m3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/pip.log" 2>&1 || echo "editable install failed (see pip.log)"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch;print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
(python3 -m mamba_rl.build --kind cuda 2>&1 | tail -3) | tee "$OUT/build.log"
(python3 -m mamba_rl.build --kind cpu 2>&1 | tail -1) | tee -a "$OUT/build.log"
echo "build wall $(( $(date +%s) - t0 )) s" | tee -a "$OUT/build.log"
timeout ${TEST_TIMEOUT:-420} python3 -m pytest -m cuda -q -s --timeout=300 -p no:cacheprovider \
  tests/model/test_mamba3_cuda.py tests/model/test_mamba3.py 2>&1 | tee "$OUT/pytest.log" \
  | grep -E "^m3 |passed|failed|error|Error|assert" | head -80
rc=${PIPESTATUS[0]}
echo "pytest rc=$rc"
timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/timing.txt"
import time, torch
from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer
cfg = MambaConfig(layer="Mamba3", d_model=128, n_layers=2, d_state=16, expand=2, headdim=32)
B, T = 16, 128
x = torch.randn(B, T, 8, device="cuda"); d = torch.randn(B, T, 128, device="cuda")
s = torch.rand(B, T, device="cuda") < 0.02
res = {}
for be in ("cuda", "reference"):
    tr = MambaTrainer(MambaBackbone(cfg, 8, device="cuda", backend=be), B, T, lr=1e-4)
    for _ in range(3): tr.step(x, d, None, s)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10): tr.step(x, d, None, s)
    torch.cuda.synchronize(); res[be + " train step ms"] = (time.perf_counter() - t) / 10 * 1e3
    st = tr.net.stepper(B); xs = torch.randn(B, 8, device="cuda")
    for _ in range(5): st.step(xs)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(100): st.step(xs)
    torch.cuda.synchronize(); res[be + " eager step us"] = (time.perf_counter() - t) / 100 * 1e6
print("m3 timing (eager, same GPU, d_model 128, 2 layers, d_state 16, headdim 32, B 16, T 128):",
      {k: round(v, 2) for k, v in res.items()})
PY
tar czf "$OUT/m3_logs.tgz" -C "$OUT" pytest.log build.log gpu.txt timing.txt pip.log 2>/dev/null
exit $rc
