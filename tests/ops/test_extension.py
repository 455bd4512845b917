"""The extension loader's failure path: a failed CPU kernel build names the compiler's first error line and
the matching fix, writes the whole output to a log the warning names, and is not retried with the same key."""
import os
import stat
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from mamba_rl.ops import extension as ext_mod

ERROR_LINE = "scan.cpp:12:5: error: 'strong_ordering' in namespace 'std' does not name a type"


@pytest.fixture
def failing_compiler(tmp_path, monkeypatch):
    """$CXX = a script that answers --version like GCC and fails every compile with ERROR_LINE; each compile
    appends a line to calls.txt. A fresh build folder; the loader's in-process caches cleared."""
    calls = tmp_path / "calls.txt"
    cxx = tmp_path / "fake-c++"
    cxx.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$1" in -v|--version|-dumpversion) echo "gcc version 12.2.0 (fake)"; exit 0;; esac
        echo compile >> {calls}
        echo "In file included from scan.cpp:1:" >&2
        echo "{ERROR_LINE}" >&2
        exit 1
        """))
    cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("MAMBA_RL_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.delenv("MAMBA_RL_DISABLE_CPU", raising=False)
    monkeypatch.setattr(ext_mod, "_LOADED", {})
    monkeypatch.setattr(ext_mod, "_ERRORS", {})
    yield calls


def _compiles(calls):
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_failed_build_names_first_error_and_fix_and_is_not_retried(failing_compiler):
    with pytest.raises(ext_mod.BuildError) as info:
        ext_mod.load_extension("cpu")
    err = info.value
    assert err.cause == f"the build failed: {ERROR_LINE}"
    assert "C++20" in err.fix and "GCC >= 10" in err.fix
    assert err.log is not None and ERROR_LINE in err.log.read_text()
    n = _compiles(failing_compiler)
    assert n >= 1
    # a second load with the same key raises from the record at once, compiling nothing
    with pytest.raises(ext_mod.BuildError, match="not retried") as again:
        ext_mod.load_extension("cpu")
    assert ERROR_LINE in again.value.cause and again.value.fix == err.fix
    assert _compiles(failing_compiler) == n
    # `python -m mamba_rl.build` retries (a fresh process, as a user runs it) and exits 1 with the cause
    out = subprocess.run([sys.executable, "-m", "mamba_rl.build", "--kind", "cpu"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1 and ERROR_LINE in out.stderr, out.stderr[-2000:]
    assert _compiles(failing_compiler) > n


def test_fallback_warning_carries_first_error_line_fix_and_log(failing_compiler):
    from mamba_rl import MambaBackbone, MambaConfig
    from mamba_rl.model import backbone as backbone_mod

    backbone_mod._WARNED.discard("cpu")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        net = MambaBackbone(MambaConfig(d_model=16, n_layers=1), input_dim=3)
    assert net.backend == "reference"
    msgs = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    msg = msgs[0]
    assert ERROR_LINE in msg and "Fix: the compiler lacks the C++ standard" in msg
    assert msg.count("Fix:") == 1 and "build.log" in msg
    assert os.path.exists(msg.split("Full build log: ")[1].rstrip("."))


@pytest.mark.parametrize("output, fix", [
    ("x.cpp:1:10: fatal error: omp.h: No such file or directory", "OpenMP"),
    ("x.cpp:1:10: fatal error: Python.h: No such file or directory", "Python headers"),
    ("c++: fatal error: Killed signal terminated program cc1plus", "MAX_JOBS=1"),
    ("x.cpp:3:1: error: expected ';' before '}' token", "build log"),
    ("ninja: fatal: posix_spawn: Resource temporarily unavailable", "ran out of processes"),
])
def test_diagnosis_picks_first_error_and_matching_fix(output, fix):
    # the logged command line carries -std=c++20 (torch's flag): it must not be read as a C++20 problem
    text = (f"Error building extension 'm':\n[1/3] c++ -std=c++20 -c x.cpp\nFAILED: x.o\n{output}\n"
            f"ninja: build stopped: subcommand failed.")
    first, got = ext_mod.diagnose_build_output(text)
    assert first == output and fix in got


def test_torch_chooses_the_cxx_standard():
    """Our flags carry no -std: torch's cpp_extension sets the standard its headers need (C++20 from 2.12)."""
    assert not any(f.startswith("-std") for f in ext_mod._cpu_flags() + ext_mod._CUDA_FLAGS)
    major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if (major, minor) >= (2, 12):
        from torch.utils import cpp_extension
        assert "c++20" in open(cpp_extension.__file__).read()


def test_loading_the_cpu_kernels_prints_no_cuda_home_notice():
    """A CUDA build of torch on a machine without a GPU logs "No CUDA runtime is found, using CUDA_HOME=..." when
    torch.utils.cpp_extension is imported; the CPU kernels never use CUDA_HOME, so the loader hides it."""
    code = "from mamba_rl.ops.extension import extension; extension('cpu')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "No CUDA runtime is found" not in out.stderr
