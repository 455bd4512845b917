#!/usr/bin/env bash
# CI build check (no GPU needed): nvcc compiles every csrc/*.cu for sm_90 (compile only), and g++ checks the
# binding's syntax against the installed torch headers. Any build break exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$NVCC" ] || { echo "ci_compile: nvcc not found (set NVCC)"; exit 2; }
CUDA_HOME=${CUDA_HOME:-$(for d in "$(dirname "$(dirname "$(readlink -f "$NVCC")")")" /usr/local/cuda; do [ -f "$d/include/cuda_runtime_api.h" ] && echo "$d" && break; done)}
[ -n "$CUDA_HOME" ] || { echo "ci_compile: CUDA headers not found (set CUDA_HOME)"; exit 2; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
jobs=$(nproc 2>/dev/null || echo 2)
echo "ci_compile: nvcc $("$NVCC" --version | grep -o 'release [0-9.]*') -> sm_90, $jobs jobs, CUDA_HOME=$CUDA_HOME"
ls csrc/*.cu | xargs -P "$jobs" -I{} sh -c \
  '"$0" -c -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90 -Icsrc "$1" -o "$2/$(basename "$1").o" || { echo "FAILED: $1"; exit 255; }' \
  "$NVCC" {} "$tmp"
# torch CPU wheels ship the c10/cuda headers but not the generated cuda_cmake_macros.h: shim it.
mkdir -p "$tmp/shim/c10/cuda/impl"; echo '#pragma once' > "$tmp/shim/c10/cuda/impl/cuda_cmake_macros.h"
incs=$(python3 -c "from torch.utils.cpp_extension import include_paths; import sysconfig; print(' '.join(['-isystem '+p for p in include_paths()]+['-isystem '+sysconfig.get_paths()['include']]))")
CXXSTD=$(python3 -c "import torch; v=tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); print('c++20' if v>=(2,12) else 'c++17')")
g++ -std=$CXXSTD -fsyntax-only -Wall $incs -isystem "$CUDA_HOME/include" -idirafter "$tmp/shim" -Icsrc \
  -DTORCH_EXTENSION_NAME=mamba_rl_cuda csrc/binding.cpp
echo "ci_compile: OK ($(ls csrc/*.cu | wc -l) .cu files + binding.cpp)"
