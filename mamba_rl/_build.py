"""Compile and load the CUDA extension (csrc/) with torch.utils.cpp_extension + ninja, cached.

The build is keyed by a hash of the sources, the torch and CUDA versions and the target archs, so a
changed kernel or a new torch rebuilds and anything else reuses the cached module.

Build directory: ``$MAMBA_RL_BUILD_DIR`` if set, else ``<repo>/.build`` when the package sits in a
writable checkout (git-ignored), else ``~/.cache/mamba_rl``; inside it one folder per key.

Targets: sm_90 machine code plus compute_90 PTX (newer GPUs JIT the PTX); override with
``MAMBA_RL_CUDA_ARCH`` (e.g. ``"80;90"``). Each .cu file is torch-free and small, and each dtype is its
own file, so ninja compiles them in parallel (``MAX_JOBS`` caps the jobs).

Ahead of time: ``python -m mamba_rl.build``.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

__all__ = ["load_extension", "source_files", "build_dir", "build_key"]

_PKG = Path(__file__).resolve().parent
_EXT = None


def _csrc_dir() -> Path:
    for cand in (_PKG.parent / "csrc", _PKG / "csrc"):
        if (cand / "binding.cpp").exists():
            return cand
    raise FileNotFoundError("mamba_rl: CUDA sources (csrc/binding.cpp) not found next to the package")


def source_files() -> list[Path]:
    """The compiled sources: every .cu file and binding.cpp (headers enter the hash only)."""
    d = _csrc_dir()
    return sorted(d.glob("*.cu")) + [d / "binding.cpp"]


def _archs() -> list[str]:
    spec = os.environ.get("MAMBA_RL_CUDA_ARCH", "90")
    return [a.strip().replace(".", "") for a in spec.replace(",", ";").split(";") if a.strip()]


def _arch_flags() -> list[str]:
    archs = _archs()
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")  # PTX for newer GPUs
    return flags


_CUDA_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xptxas=-O3"]


def build_key() -> str:
    """Hash of the sources + headers, torch / CUDA versions, archs and flags."""
    import torch
    h = hashlib.sha256()
    d = _csrc_dir()
    for f in sorted(list(d.glob("*.cu")) + list(d.glob("*.cuh")) + list(d.glob("*.h")) + [d / "binding.cpp"]):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(torch.__version__.encode())
    h.update(str(torch.version.cuda).encode())
    h.update(" ".join(_arch_flags() + _CUDA_FLAGS).encode())
    h.update(sys.version.split()[0].encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    env = os.environ.get("MAMBA_RL_BUILD_DIR")
    if env:
        root = Path(env)
    else:
        repo = _PKG.parent
        root = repo / ".build" if (repo / ".git").exists() and os.access(repo, os.W_OK) else \
            Path.home() / ".cache" / "mamba_rl"
    return root / build_key()


def load_extension(verbose: bool = False):
    """Build (first use; ~tens of seconds) or load the cached extension module. Raises on failure."""
    global _EXT
    if _EXT is not None:
        return _EXT
    import torch
    from torch.utils.cpp_extension import load
    if not torch.cuda.is_available():
        raise RuntimeError("mamba_rl CUDA extension: CUDA is not available")
    key = build_key()
    bdir = build_dir()
    bdir.mkdir(parents=True, exist_ok=True)
    name = f"mamba_rl_cuda_{key}"
    cached = any(bdir.glob(f"{name}*.so"))
    t0 = time.time()
    if not cached:
        print(f"mamba_rl: building the CUDA extension in {bdir} (one time, ~30-60 s) ...", file=sys.stderr, flush=True)
    _EXT = load(name=name, sources=[str(s) for s in source_files()], build_directory=str(bdir),
                extra_cuda_cflags=_CUDA_FLAGS + _arch_flags(), extra_cflags=["-O2"],
                extra_include_paths=[str(_csrc_dir())], verbose=verbose)
    if not cached:
        print(f"mamba_rl: CUDA extension built in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    return _EXT
