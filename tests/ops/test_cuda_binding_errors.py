"""A bad argument to the CUDA binding raises ValueError naming the expected and received values, as the CPU
binding does (csrc/binding_common.h), instead of ending the process (formatting a message with iostreams
inside the CUDA extension was a SIGSEGV; binding_common.h says why). Each case runs in a subprocess so that
a crash fails the test instead of the test run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = r'''
import torch
from mamba_rl.ops.extension import extension
ext = extension("cuda")
cases = {
    "norm_weight_shape": lambda: ext.rmsnorm_fwd(torch.randn(4, 8, device="cuda"), torch.ones(7, device="cuda"),
                                                 1e-5, torch.float32),
    "norm_too_wide": lambda: ext.rmsnorm_fwd(torch.randn(4, 2048, device="cuda"), torch.ones(2048, device="cuda"),
                                             1e-5, torch.float32),
    "conv_dtype": lambda: ext.conv_fwd(torch.randn(2, 5, 8, device="cuda", dtype=torch.float64),
                                       torch.randn(8, 4, device="cuda"), torch.randn(8, device="cuda"), None, None),
    "adamw_n_decay": lambda: ext.adamw_step(*[torch.zeros(10, device="cuda") for _ in range(4)],
                                            torch.zeros(8, dtype=torch.float64, device="cuda"),
                                            torch.zeros(8, dtype=torch.float64, device="cuda"), 11, None),
    "optim_grad_dtype": lambda: ext.optim_step(*[torch.zeros(10, device="cuda") for _ in range(3)],
                                               torch.zeros(10, device="cuda", dtype=torch.float16), None,
                                               torch.ones(1, device="cuda"),
                                               torch.zeros(8, dtype=torch.float64, device="cuda"),
                                               torch.zeros(8, dtype=torch.float64, device="cuda"),
                                               torch.zeros(1, dtype=torch.int32, device="cuda"), 3, None, True),
}
for name, f in cases.items():
    try:
        f()
        print(name, "NO-ERROR")
    except Exception as e:
        print(name, type(e).__name__, "|", str(e).splitlines()[0][:200])
'''


def test_bad_arguments_raise_value_error():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", SNIPPET], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    lines = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    assert lines["norm_weight_shape"].startswith("ValueError") and "expected shape [8], got [7]" in lines["norm_weight_shape"]
    assert lines["norm_too_wide"].startswith("ValueError") and "2048" in lines["norm_too_wide"]
    assert lines["conv_dtype"].startswith("ValueError") and "Double" in lines["conv_dtype"]
    assert lines["adamw_n_decay"].startswith("ValueError") and "11" in lines["adamw_n_decay"]
    assert lines["optim_grad_dtype"].startswith("ValueError") and "Half" in lines["optim_grad_dtype"]
