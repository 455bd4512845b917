#!/usr/bin/env bash
# One device call (H200, ~4 minutes): the main job at scale on one GPU.
# 1. install the carried wheels (.whl: gymnasium, EnvPool trimmed by benchmarks/envpool_lite.py and its needs,
#    stable-baselines3 + sb3-contrib) and the package, build the CUDA kernels;
# 2. benchmarks/sps.py in one process: CartPole-v1, EnvPool and gymnasium rows at 16-4096 envs (bare library env,
#    our env and the agent), sb3-contrib at 16 and 64 envs, EnvPool bf16 rows at 1024 and 4096;
# 3. CartPoleNoVel-v1 learning: today's default (8 envs, gymnasium) next to EnvPool with 64 envs, all runs at
#    once (one process and one torch thread each), each stopped at a mean return of 475 over 100 episodes.
# Usage on the device: scripts/h200_scale.sh ; logs, JSON and the learning CSVs go to $OUT (or ./gpu_out).
# Env knobs: SPS_TIMEOUT (s, default 125), SWEEP_TIMEOUT (s, default 50; 0 skips the learning runs), SPS_ARGS,
# SWEEP_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAMBA_RL_BUILD_DIR=${MAMBA_RL_BUILD_DIR:-$PWD/.build}
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >"$OUT/pip.log" 2>&1 || { echo "wheel install failed:"; tail -5 "$OUT/pip.log"; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/pip.log" 2>&1 \
  || echo "editable install failed (see pip.log)"
python3 -c "import torch, numpy, gymnasium, envpool, sb3_contrib; print('torch', torch.__version__, torch.cuda.get_device_name(0),
'numpy', numpy.__version__, 'gymnasium', gymnasium.__version__, 'envpool', envpool.__version__, 'sb3-contrib', sb3_contrib.__version__)"
nproc; uptime
python3 -m mamba_rl.build --kind cuda >"$OUT/build.log" 2>&1 || { echo "build failed:"; tail -20 "$OUT/build.log"; exit 1; }
echo "setup done at $(( $(date +%s) - t0 )) s"
timeout "${SPS_TIMEOUT:-125}" python3 benchmarks/sps.py --envs 16 64 256 1024 4096 --env-backend envpool gymnasium \
  --profile-backend envpool --raw-steps 30000 --env-rounds 3 --min-iters 10 --bf16-envs 1024 4096 \
  --out "$OUT/sps.json" ${SPS_ARGS:-} >"$OUT/sps.log" 2>&1
echo "sps rc=$? at $(( $(date +%s) - t0 )) s"
grep '^|' "$OUT/sps.log" || tail -30 "$OUT/sps.log"
if [ "${SWEEP_TIMEOUT:-50}" -eq 0 ]; then echo "done at $(( $(date +%s) - t0 )) s (no learning runs)"; exit 0; fi
timeout "${SWEEP_TIMEOUT:-50}" python3 benchmarks/learning/sweep.py --env mamba_rl/CartPoleNoVel-v1 --seeds 1 2 \
  --total 100000 --device cuda --threshold 475 --stop-at 475 --eval-episodes 10 --parallel 4 \
  --timeout $(( ${SWEEP_TIMEOUT:-50} - 6 )) --variant default \
  --variant "envpool64:env_backend='envpool',num_envs=64,total_timesteps=3000000" \
  --out /tmp/learn_h200 ${SWEEP_ARGS:-} >"$OUT/learn.md" 2>&1
echo "learning rc=$? at $(( $(date +%s) - t0 )) s"; cat "$OUT/learn.md"
tar -czf "$OUT/learn_h200.tgz" -C /tmp learn_h200 2>/dev/null
echo "done at $(( $(date +%s) - t0 )) s"
