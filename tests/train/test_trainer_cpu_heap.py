"""The heap policy a cpu-backend MambaTrainer sets (``_retain_cpu_heap`` / the extension's ``retain_heap``): the
memory a training step frees stays in the process for the next step instead of being trimmed and faulted back in
(benchmarks/NOTES.md, 2026-12-04 night: up to ~1,000 minor faults per [2, 128] step at 2 threads before)."""
import platform
import resource

import pytest
import torch

from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer
from mamba_rl.train import trainer as trainer_mod
from tests.helpers import needs_cpu_kernels

pytestmark = needs_cpu_kernels()


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_retain_heap_checks_its_arguments():
    net = MambaBackbone(MambaConfig(d_model=8, n_layers=1, d_state=4), 3, backend="cpu", seed=0)
    k = net.kernels
    with pytest.raises(ValueError, match=r"retain_heap: mmap_threshold: expected 0 to 32 MiB"):
        k.retain_heap(64 << 20, 1 << 20)
    with pytest.raises(ValueError, match=r"retain_heap: trim_threshold: expected 0 to"):
        k.retain_heap(1 << 20, -1)


@pytest.mark.skipif(not _glibc(), reason="the policy is glibc's mallopt")
def test_a_cpu_trainer_sets_the_policy_and_warm_steps_do_not_fault_pages_back_in():
    cfg = MambaConfig()  # the default model: ~6 MB of activations per [2, 128] step
    net = MambaBackbone(cfg, 5, backend="cpu", seed=0)
    tr = MambaTrainer(net, batch=2, seq_len=128, lr=1e-4, max_grad_norm=0.5)
    if trainer_mod.os.environ.get("MAMBA_RL_RETAIN_HEAP", "1") == "0":
        pytest.skip("MAMBA_RL_RETAIN_HEAP=0")
    assert trainer_mod._HEAP_RETAINED == [True]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 128, 5, generator=g)
    d = torch.randn(2, 128, cfg.d_model, generator=g) * 1e-3
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for _ in range(10):
            tr.step(x, d)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        n = 20
        for _ in range(n):
            tr.step(x, d)
        per_step = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / n
    finally:
        torch.set_num_threads(old)
    assert per_step < 50, per_step  # ~0 with the policy; 100-1,000 when the heap top is trimmed every step
