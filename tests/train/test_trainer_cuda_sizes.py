"""Wide models on the cuda backend (d_model >= 640 once ended the process with SIGSEGV): each d_model
trains eagerly and graph-captured in its own subprocess, which must exit 0 after its float64-parity checks
(tests/train/size_worker.py). Also: a trainer captures after its backbone was used through autograd, and a
20-layer backbone (above the one-token kernel's 16) steps and trains."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("d_model", [640, 768, 1024, 2048, 4096])
def test_wide_model_trains_in_a_subprocess(d_model):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "tests.train.size_worker", str(d_model)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"d_model {d_model}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert "OK" in r.stdout


@pytest.mark.parametrize("B,T,dtype", [(5, 33, "bf16"), (8, 64, "bf16"), (16, 64, "f32")])
def test_capture_after_autograd_use(B, T, dtype):
    cfg = MambaConfig(d_model=64, n_layers=3)
    g = torch.Generator().manual_seed(B * T)
    xs = [torch.randn(B, T, 6, generator=g).cuda() for _ in range(4)]
    ds = [torch.randn(B, T, 64, generator=g).cuda() for _ in range(4)]
    nets, alive = [], []
    for _ in range(2):
        net = MambaBackbone(cfg, 6, device="cuda", seed=0, backend="cuda")
        y, _ = net(xs[0])
        y.sum().backward()
        nets.append(net)
        alive.append(y)  # the autograd graph of that use stays alive during the capture (the case that crashed)
    graph = MambaTrainer(nets[0], B, T, dtype=dtype, lr=1e-3, max_grad_norm=1.0)
    eager = MambaTrainer(nets[1], B, T, dtype=dtype, lr=1e-3, max_grad_norm=1.0)
    graph.capture_graph()
    for x, d in zip(xs, ds):
        assert graph.step(x, d).graph_replayed
        eager.step(x, d)
    assert torch.equal(nets[0].arena, nets[1].arena)
    del alive


def test_twenty_layers_step_and_train():
    cfg = MambaConfig(d_model=32, n_layers=20)
    net = MambaBackbone(cfg, 5, device="cuda", seed=0, backend="cuda")
    s = net.kernel_support("step")
    assert not s.ok and "20" in s.reason
    assert net.kernel_support("sequence")
    g = torch.Generator().manual_seed(20)
    x = torch.randn(3, 4, 5, generator=g).cuda()
    with torch.no_grad():
        yf, _ = net(x)
    st = net.stepper(batch=3)
    for t in range(4):
        ys = st.step(x[:, t])
        assert torch.allclose(ys, yf[:, t], rtol=1e-4, atol=1e-5)
    st.capture_graph()
    st.reset()
    assert torch.allclose(st.step(x[:, 0]), yf[:, 0], rtol=1e-4, atol=1e-5)
    tr = MambaTrainer(net, 3, 4, dtype="bf16", lr=1e-3)
    tr.capture_graph()
    for _ in range(2):
        assert tr.step(x, torch.randn(3, 4, 32, generator=g).cuda()).graph_replayed
    assert torch.isfinite(net.arena).all()
