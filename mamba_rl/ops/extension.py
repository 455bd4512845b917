"""The one place that compiles and loads the kernel extensions, and says which one serves a tensor.

Two extensions, both built with ``torch.utils.cpp_extension`` (ninja) on first use and cached:

- ``cuda``: ``csrc/*.cu`` + ``csrc/binding.cpp``; sm_90 machine code plus compute_90 PTX (newer GPUs JIT
  the PTX), override with ``MAMBA_RL_CUDA_ARCH`` (e.g. ``"80;90"``). Each .cu file is torch-free and each
  dtype its own file, so ninja compiles them in parallel (``MAX_JOBS`` caps the jobs).
- ``cpu``: ``csrc/cpu/*.cpp`` (ATen + OpenMP), the same Python functions as the CUDA binding; built with
  ``-march=native`` (``MAMBA_RL_CPU_MARCH`` overrides, empty for the compiler default), so the key includes
  the host CPU model and flags. ``MAMBA_RL_DISABLE_CPU=1`` forces the reference. The kernels follow
  ``torch.set_num_threads`` (on oversubscribed cores every OpenMP barrier stalls: give each process its own).

A build is keyed by a hash of its sources and headers, the torch / CUDA / Python versions, the flags and
(for CUDA) the archs: a changed kernel or a new torch rebuilds, anything else reuses the cached module.
Build directory: ``$MAMBA_RL_BUILD_DIR`` if set, else ``<repo>/.build`` when the package sits in a
writable checkout (git-ignored), else ``~/.cache/mamba_rl``; inside it one folder per key.
Ahead of time: ``python -m mamba_rl.build``. Installing the package compiles nothing.

A failed build is remembered: its folder keeps ``build.log`` (the compiler's whole output) and
``FAILED.json`` (the first error line and the fix that matches it), and later loads with the same key (same
sources, torch, flags and compiler) raise :class:`BuildError` from that record at once instead of compiling
again. ``python -m mamba_rl.build`` (or deleting the folder) retries.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

__all__ = ["kernels_for", "extension", "load_extension", "extension_error", "fallback_message", "BuildError",
           "source_files", "build_dir", "build_key"]

_PKG = Path(__file__).resolve().parent.parent
# No -std flag: torch.utils.cpp_extension sets the C++ standard its own headers need (C++17 up to torch 2.11,
# C++20 from 2.12 on); a flag of ours after torch's would override it and break the build on newer torch.
_CUDA_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-Xptxas=-O3"]
_LOADED: dict[str, object] = {}
_ERRORS: dict[str, BaseException] = {}
_COMPILER_IDS: dict[str, str] = {}


def _csrc_dir() -> Path:
    for cand in (_PKG.parent / "csrc", _PKG / "csrc"):
        if (cand / "binding.cpp").exists():
            return cand
    raise FileNotFoundError("mamba_rl: kernel sources (csrc/binding.cpp) not found next to the package")


def _archs() -> list[str]:
    spec = os.environ.get("MAMBA_RL_CUDA_ARCH", "90")
    return [a.strip().replace(".", "") for a in spec.replace(",", ";").split(";") if a.strip()]


def _arch_flags() -> list[str]:
    archs = _archs()
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")  # PTX for newer GPUs
    return flags


def _march() -> str:
    return os.environ.get("MAMBA_RL_CPU_MARCH", "native").strip()


def _cpu_flags() -> list[str]:
    """-O3 with OpenMP; math flags that let GCC vectorise exp/SiLU loops; ``-march=$MAMBA_RL_CPU_MARCH``
    (default native; empty for the compiler's default target)."""
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast",
             "-DNDEBUG"]
    return flags + ([f"-march={_march()}"] if _march() else [])


def _host_cpu() -> str:
    """CPU model and feature flags (what -march=native resolves from), for the build key."""
    model = flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = val.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = val.strip()
                if model and flags:
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{model or platform.processor()}|{flags}"


def _compiler_id() -> str:
    """``$CXX --version``'s first line (part of the CPU build key: a new compiler retries a failed build)."""
    cxx = os.environ.get("CXX", "c++")
    if cxx not in _COMPILER_IDS:
        try:
            out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
            text = (out.stdout or out.stderr).strip()
            _COMPILER_IDS[cxx] = f"{cxx}|{text.splitlines()[0] if text else ''}"
        except (OSError, subprocess.SubprocessError):
            return f"{cxx}|missing"
    return _COMPILER_IDS[cxx]


def source_files(kind: str = "cuda") -> list[Path]:
    """The compiled sources of extension ``kind`` ("cuda" or "cpu"); headers enter the hash only."""
    d = _csrc_dir()
    if kind == "cuda":
        return sorted(d.glob("*.cu")) + [d / "binding.cpp"]
    if kind == "cpu":
        return sorted((d / "cpu").glob("*.cpp"))
    raise ValueError(f"source_files: kind must be 'cuda' or 'cpu', got {kind!r}")


def _hashed_files(kind: str) -> list[Path]:
    d = _csrc_dir()
    if kind == "cuda":
        return sorted(list(d.glob("*.cu")) + list(d.glob("*.cuh")) + list(d.glob("*.h")) + [d / "binding.cpp"])
    # the CPU sources include headers shared with the CUDA binding too (binding_common.h)
    return sorted(list((d / "cpu").glob("*.cpp")) + list((d / "cpu").glob("*.h")) + list(d.glob("*.h")))


def build_key(kind: str = "cuda") -> str:
    """Hash of the sources and headers, torch / CUDA / Python versions, archs and flags."""
    h = hashlib.sha256(kind.encode())
    for f in _hashed_files(kind):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(torch.__version__.encode())
    h.update(sys.version.split()[0].encode())
    if kind == "cuda":
        h.update(str(torch.version.cuda).encode())
        h.update(" ".join(_arch_flags() + _CUDA_FLAGS).encode())
    else:
        h.update(" ".join(_cpu_flags()).encode())
        h.update(_compiler_id().encode())
        if _march() == "native":
            h.update(_host_cpu().encode())
    return h.hexdigest()[:16]


def build_dir(kind: str = "cuda") -> Path:
    """The cache folder of extension ``kind`` for the current sources (see the module docstring)."""
    env = os.environ.get("MAMBA_RL_BUILD_DIR")
    if env:
        root = Path(env)
    else:
        repo = _PKG.parent
        root = repo / ".build" if (repo / ".git").exists() and os.access(repo, os.W_OK) else \
            Path.home() / ".cache" / "mamba_rl"
    return root / build_key(kind)


class BuildError(RuntimeError):
    """A kernel extension that could not be built or loaded.

    Attributes:
        kind: "cuda" or "cpu".
        cause: one line: what went wrong (for a failed compile, the compiler's first error line).
        fix: one sentence: what to do about it.
        log: the file holding the whole build output, or None.
    """

    def __init__(self, kind: str, cause: str, fix: str, log: Path | None = None):
        self.kind, self.cause, self.fix, self.log = kind, cause, fix, log
        where = f" (full build log: {log})" if log else ""
        super().__init__(f"mamba_rl {kind} kernels: {cause}{where}; fix: {fix}")


# (pattern in the build output, fix); the first that matches the output wins
_FIXES: list[tuple[str, str]] = [
    # error text only: the logged command lines carry -std=c++NN too
    (r"strong_ordering|'requires' does not name|'concept' does not name|requires C\+\+20|C\+\+20 or later|"
     r"is only available with -std=c\+\+20",
     "the compiler lacks the C++ standard the installed torch's headers need (torch >= 2.12 needs C++20: GCC >= 10 "
     "or clang >= 12); install a newer compiler (point $CXX at it) or a torch release this package supports"),
    (r"omp\.h", "install OpenMP for the compiler (GCC ships it: `apt-get install g++`; clang: libomp-dev)"),
    (r"Python\.h", "install the Python headers (e.g. `apt-get install python3-dev`)"),
    (r"No space left", "free disk space in the build folder, or set MAMBA_RL_BUILD_DIR to a disk with room"),
    (r"Permission denied", "make the build folder writable, or set MAMBA_RL_BUILD_DIR to one that is"),
    (r"Resource temporarily unavailable|posix_spawn|fork: retry",
     "the machine ran out of processes or memory for the build: retry with one job, "
     "`MAX_JOBS=1 python -m mamba_rl.build`"),
    (r"Killed|out of memory|virtual memory exhausted|internal compiler error|signal 9",
     "the compiler ran out of memory or crashed: retry with one job, `MAX_JOBS=1 python -m mamba_rl.build`"),
    (r"nvcc|cuda_runtime|CUDA_HOME", "check that nvcc and the CUDA toolkit match torch's CUDA version "
     "(torch.version.cuda) and that CUDA_HOME points at it"),
]


def diagnose_build_output(output: str) -> tuple[str, str]:
    """(first error line, matching fix) of a failed build's output (compiler, ninja and torch lines)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    first = next((ln for ln in lines if (re.search(r"\b(fatal )?error\b\s*:", ln) and not ln.startswith("ninja:"))
                  or ln.startswith("ninja: fatal:")), None) or next((ln for ln in lines if "error" in ln.lower() and not ln.startswith(("ninja:", "FAILED:"))),
                               lines[-1] if lines else "no output")
    fix = next((f for pat, f in _FIXES if re.search(pat, output)),
               "read the build log; `python -m mamba_rl.build --verbose` retries and shows the command lines")
    return first[:300], fix


def _failure_record(bdir: Path) -> Path:
    return bdir / "FAILED.json"


def _cpp_extension():
    """``torch.utils.cpp_extension``, imported without its "No CUDA runtime is found, using CUDA_HOME=..." log
    line on a machine without a GPU (a CUDA build of torch prints it at import; the CPU kernels never use
    CUDA_HOME, so it only alarms a new user)."""
    import logging

    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    if not torch.cuda.is_available():
        log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        log.setLevel(level)
    return cpp_extension


def check_cpu_toolchain() -> None:
    """Raise :class:`BuildError` naming what the CPU kernels' build lacks (``$CXX`` or c++, ninja) and the fix."""
    is_ninja_available = _cpp_extension().is_ninja_available
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise BuildError("cpu", f"no C++ compiler found (looked for {cxx!r} on PATH)",
                         "install a C++ compiler with OpenMP (e.g. `apt-get install g++` or build-essential)")
    if not is_ninja_available():
        raise BuildError("cpu", "ninja was not found", "`pip install ninja`")


def load_extension(kind: str = "cuda", verbose: bool = False, retry: bool = False):
    """Build (first use; tens of seconds) or load the cached extension ``kind``.

    Args:
        kind: "cuda" or "cpu".
        verbose: show ninja's command lines and the compiler's output while building.
        retry: build again even when this key's last build failed (``python -m mamba_rl.build`` does).

    Raises:
        BuildError: CUDA is unavailable (kind "cuda"), the toolchain is missing, or the build failed now or
            before with the same key (its ``cause`` is the compiler's first error line, ``fix`` the matching
            remedy, ``log`` the file with the whole output).
    """
    if kind in _LOADED:
        return _LOADED[kind]
    load = _cpp_extension().load
    if kind == "cuda" and not torch.cuda.is_available():
        raise BuildError("cuda", "CUDA is not available", "run on a machine with an NVIDIA GPU and a CUDA build of torch")
    if kind == "cpu":
        check_cpu_toolchain()
    srcs = source_files(kind)
    if not srcs:
        raise BuildError(kind, f"no sources found under {_csrc_dir()}", "reinstall the package")
    key = build_key(kind)
    bdir = build_dir(kind)
    bdir.mkdir(parents=True, exist_ok=True)
    record, log = _failure_record(bdir), bdir / "build.log"
    if record.exists() and not retry:
        try:
            rec = json.loads(record.read_text())
            raise BuildError(kind, f"{rec['cause']} (an earlier build with these sources, torch and compiler "
                                   f"failed; not retried: `python -m mamba_rl.build` retries)", rec["fix"], log)
        except (OSError, ValueError, KeyError):
            pass  # an unreadable record: build again
    record.unlink(missing_ok=True)
    name = f"mamba_rl_{kind}_{key}"
    cached = any(bdir.glob(f"{name}*.so"))
    t0 = time.time()
    if not cached:
        print(f"mamba_rl: building the {kind.upper()} kernels in {bdir} (one time, ~30-90 s) ...",
              file=sys.stderr, flush=True)
    try:
        if kind == "cuda":
            mod = load(name=name, sources=[str(s) for s in srcs], build_directory=str(bdir),
                       extra_cuda_cflags=_CUDA_FLAGS + _arch_flags(), extra_cflags=["-O2"],
                       extra_include_paths=[str(_csrc_dir())], verbose=verbose)
        else:
            mod = load(name=name, sources=[str(s) for s in srcs], build_directory=str(bdir),
                       extra_cflags=_cpu_flags(), extra_ldflags=["-fopenmp"],
                       extra_include_paths=[str(_csrc_dir() / "cpu")], with_cuda=False, verbose=verbose)
    except Exception as e:
        output = f"{type(e).__name__}: {e}"
        cause, fix = diagnose_build_output(output)
        try:
            log.write_text(output)
            record.write_text(json.dumps({"cause": cause, "fix": fix, "torch": torch.__version__,
                                          "compiler": _compiler_id() if kind == "cpu" else str(torch.version.cuda)}))
        except OSError:
            log = None
        if not cached:
            print(f"mamba_rl: the {kind.upper()} kernels failed to build: {cause}", file=sys.stderr, flush=True)
        raise BuildError(kind, f"the build failed: {cause}", fix, log) from e
    if not cached:
        print(f"mamba_rl: {kind.upper()} kernels built in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    _LOADED[kind] = mod
    return mod


def _try(kind: str):
    if kind in _LOADED:
        return _LOADED[kind]
    if kind in _ERRORS:
        return None
    if os.environ.get(f"MAMBA_RL_DISABLE_{kind.upper()}") == "1":
        _ERRORS[kind] = BuildError(kind, f"disabled by MAMBA_RL_DISABLE_{kind.upper()}=1",
                                   f"unset MAMBA_RL_DISABLE_{kind.upper()}")
        return None
    try:
        return load_extension(kind)
    except Exception as e:  # surfaced by backend="cuda"/"cpu" and by extension_error()
        _ERRORS[kind] = e
        return None


def extension_error(kind: str = "cuda") -> BaseException | None:
    """The exception that kept extension ``kind`` from loading, or None (loads it if not tried yet)."""
    _try(kind)
    return _ERRORS.get(kind)


def fallback_message(kind: str = "cpu") -> str:
    """The one warning shown when ``auto`` falls back to the reference because extension ``kind`` is
    unavailable: the cause (a compile's first error line), the fix, and the build log's path."""
    err = extension_error(kind)
    if isinstance(err, BuildError):
        where = f" Full build log: {err.log}." if err.log else ""
        return (f"mamba_rl: the {kind.upper()} kernels are unavailable ({err.cause}); running the much slower "
                f"pure-PyTorch reference. Fix: {err.fix}.{where}")
    return (f"mamba_rl: the {kind.upper()} kernels are unavailable ({err}); running the much slower pure-PyTorch "
            f"reference.")


def extension(kind: str = "cuda"):
    """The loaded extension ``kind`` ("cuda" or "cpu"), or None when it cannot be built or loaded."""
    if kind == "cuda" and not torch.cuda.is_available():
        _ERRORS.setdefault("cuda", BuildError("cuda", "CUDA is not available",
                                              "run on a machine with an NVIDIA GPU and a CUDA build of torch"))
        return None
    return _try(kind)


_ACT_DTYPES = {"cuda": (torch.float32, torch.bfloat16, torch.float16), "cpu": (torch.float32,)}


def kernels_for(x: torch.Tensor, *params: torch.Tensor | None):
    """The extension whose kernels take ``x`` (CUDA or CPU), or None: then the caller runs the reference.

    None when the extension is unavailable, when ``x``'s dtype is not a kernel activation dtype (CUDA:
    float32 / bfloat16 / float16; CPU: float32), or when any of ``params`` is float64 (the oracle path).
    """
    kind = "cuda" if x.is_cuda else "cpu" if x.device.type == "cpu" else None
    if kind is None or x.dtype not in _ACT_DTYPES[kind]:
        return None
    if any(p is not None and p.dtype == torch.float64 for p in params):
        return None
    return extension(kind)
