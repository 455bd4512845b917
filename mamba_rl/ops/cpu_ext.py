"""Compile and load the CPU kernels (``csrc/cpu/*.cpp``) with ``torch.utils.cpp_extension.load``, cached.

The module exposes the CUDA binding's kernel functions with the same Python signatures (see
``csrc/cpu/binding.cpp``): ``conv_fwd``, ``conv_bwd``, ``scan_fwd``, ``scan_bwd``, ``rmsnorm_fwd``,
``rmsnorm_bwd``, ``backbone_step``, plus ``scan_chunk`` and ``set_poison``. float32 only; C++17 over ATen,
OpenMP over (row, channel block), ``torch.set_num_threads`` sets their thread count (as for torch's
own ops; on cores shared with other busy processes, fewer threads than cores avoids stalls at every
OpenMP barrier).

Cache: one folder per build key, ``<root>/mamba_rl_cpu_<key>``, where the key hashes the sources and
headers, the torch and Python versions, the compiler flags and (because of ``-march=native``) the host CPU
model and feature flags; a changed kernel, a new torch or another CPU rebuilds, anything else reuses the
cached module. ``<root>`` follows :mod:`mamba_rl._build`: ``$MAMBA_RL_BUILD_DIR`` if set, else
``<repo>/.build`` when the package sits in a writable git checkout (git-ignored), else
``~/.cache/mamba_rl``.

The first build takes ~30 s on 2 cores and prints one line to stderr; later loads are silent.
Environment: ``MAMBA_RL_CPU_MARCH`` (default ``native``; empty for the compiler's default target),
``MAMBA_RL_NO_CPU_EXT=1`` makes :func:`cpu_extension` return None (forces the pure-torch reference).
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import time
from pathlib import Path

__all__ = ["load_cpu_extension", "cpu_extension", "cpu_extension_error", "cpu_source_files", "cpu_build_dir",
           "cpu_build_key"]

_PKG = Path(__file__).resolve().parent.parent  # the mamba_rl package directory
_EXT = None
_ERR: BaseException | None = None

_FIX = ("install a C++ compiler with OpenMP (Debian/Ubuntu: `apt-get install g++` or `build-essential`; "
        "Fedora: `dnf install gcc-c++`; conda: `conda install -c conda-forge gxx`) or point $CXX at one")


def _cpu_src_dir() -> Path:
    for cand in (_PKG.parent / "csrc" / "cpu", _PKG / "csrc" / "cpu"):  # checkout, installed package data
        if (cand / "binding.cpp").exists():
            return cand
    raise FileNotFoundError("mamba_rl: CPU kernel sources (csrc/cpu/binding.cpp) not found next to the package "
                            f"(looked in {_PKG.parent / 'csrc' / 'cpu'} and {_PKG / 'csrc' / 'cpu'})")


def cpu_source_files() -> list[Path]:
    """The compiled sources: every ``csrc/cpu/*.cpp`` (headers enter the hash only)."""
    return sorted(_cpu_src_dir().glob("*.cpp"))


def _march() -> str:
    return os.environ.get("MAMBA_RL_CPU_MARCH", "native").strip()


def _cflags() -> list[str]:
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast", "-DNDEBUG"]
    if _march():
        flags.append(f"-march={_march()}")
    return flags


_LDFLAGS = ["-fopenmp"]


def _host_cpu() -> str:
    """CPU model + feature flags (what -march=native resolves from), for the build key."""
    model = flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key == "model name" and not model:
                    model = line.split(":", 1)[1].strip()
                elif key in ("flags", "Features") and not flags:
                    flags = line.split(":", 1)[1].strip()
                if model and flags:
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{model or platform.processor()}|{flags}"


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def cpu_build_key() -> str:
    """Hash of the sources + headers, torch and Python versions, flags, compiler and host CPU."""
    import torch
    h = hashlib.sha256()
    d = _cpu_src_dir()
    for f in sorted(list(d.glob("*.cpp")) + list(d.glob("*.h"))):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(torch.__version__.encode())
    h.update(sys.version.split()[0].encode())
    h.update(" ".join(_cflags() + _LDFLAGS).encode())
    h.update(_compiler().encode())
    if _march() == "native":
        h.update(_host_cpu().encode())
    return h.hexdigest()[:16]


def _build_root() -> Path:
    env = os.environ.get("MAMBA_RL_BUILD_DIR")
    if env:
        return Path(env)
    repo = _PKG.parent
    if (repo / ".git").exists() and os.access(repo, os.W_OK):
        return repo / ".build"
    return Path.home() / ".cache" / "mamba_rl"


def cpu_build_dir() -> Path:
    """``<root>/mamba_rl_cpu_<key>``: the build folder (and module name) of this configuration."""
    return _build_root() / f"mamba_rl_cpu_{cpu_build_key()}"


def _check_toolchain():
    from torch.utils.cpp_extension import is_ninja_available
    cxx = _compiler()
    if shutil.which(cxx) is None:
        raise RuntimeError(f"mamba_rl CPU kernels: no C++ compiler found (looked for {cxx!r} on PATH); {_FIX}")
    if not is_ninja_available():
        raise RuntimeError("mamba_rl CPU kernels: torch.utils.cpp_extension needs ninja, which was not found; "
                           "install it with `pip install ninja`")


def load_cpu_extension(verbose: bool = False):
    """Build (first use, ~30 s on 2 cores) or load the cached CPU kernel module. Raises on failure.

    The error names the cause: no compiler (with the install command to fix it), no ninja, or the
    compiler's own output when the build fails.
    """
    global _EXT
    if _EXT is not None:
        return _EXT
    from torch.utils.cpp_extension import load
    _check_toolchain()
    bdir = cpu_build_dir()
    bdir.mkdir(parents=True, exist_ok=True)
    name = bdir.name
    cached = any(bdir.glob(f"{name}*.so"))
    t0 = time.time()
    if not cached:
        print(f"mamba_rl: building the CPU kernels in {bdir} (one time, ~30 s) ...", file=sys.stderr, flush=True)
    try:
        _EXT = load(name=name, sources=[str(s) for s in cpu_source_files()], build_directory=str(bdir),
                    extra_cflags=_cflags(), extra_ldflags=_LDFLAGS, extra_include_paths=[str(_cpu_src_dir())],
                    with_cuda=False, verbose=verbose)
    except Exception as e:
        if shutil.which(_compiler()) is None:  # e.g. CXX vanished between the check and the build
            raise RuntimeError(f"mamba_rl CPU kernels: no C++ compiler found; {_FIX}") from e
        raise RuntimeError(f"mamba_rl CPU kernels: the build in {bdir} failed ({type(e).__name__}: {e}); "
                           "rerun with load_cpu_extension(verbose=True) to see the compiler output") from e
    if verbose and not cached:
        print(f"mamba_rl: CPU kernels built in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    return _EXT


def cpu_extension():
    """The CPU kernel module (built on first use), or None when it cannot be built; the failure is
    remembered (see :func:`cpu_extension_error`) so it is tried once per process."""
    global _ERR
    if _EXT is None and _ERR is None:
        if os.environ.get("MAMBA_RL_NO_CPU_EXT", "") not in ("", "0"):
            _ERR = RuntimeError("mamba_rl CPU kernels: disabled by MAMBA_RL_NO_CPU_EXT")
        else:
            try:
                load_cpu_extension()
            except Exception as e:  # surfaced by cpu_extension_error() and the caller's fallback warning
                _ERR = e
    return _EXT


def cpu_extension_error() -> BaseException | None:
    """The exception that prevented loading the CPU kernels, or None (after trying to load them)."""
    cpu_extension()
    return _ERR
