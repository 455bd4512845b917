#!/usr/bin/env bash
# Fetch, on this (networked) machine, the pure-Python wheels the device lacks into .whl/ (gitignored): the device
# has torch, numpy and pytest but no gymnasium, popgym, sb3 or xdist, and cannot reach an index. Carry them with
# run(carry=[".whl"]); scripts/gpu_check.sh and the other device scripts install them into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --dest .whl --python-version "${PYVER:-3.12}" --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform any \
  gymnasium farama-notifications cloudpickle popgym sb3-contrib stable-baselines3 pytest-timeout pytest-xdist execnet
ls .whl
