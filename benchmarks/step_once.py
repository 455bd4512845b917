"""A few eager training steps of the default model on the CUDA backend, for a kernel profiler (Nsight Compute's
``ncu -k <kernel> --launch-skip N``): d_model 128, 3 layers, input_dim 32, fresh random inputs and d_temporal.

    python3 benchmarks/step_once.py [--dtype bf16] [--batch 16] [--seq-len 64] [--steps 3] [--coop 7]

``--coop`` sets the extension's ``set_coop`` mask first (0: every scan / conv pass as its own launch).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["f32", "tf32", "bf16", "f16"], default="bf16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--coop", type=int, default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_once: needs a GPU")
    from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer
    net = MambaBackbone(MambaConfig(d_model=a.d_model, n_layers=3), 32, device="cuda", seed=0, backend="cuda")
    if a.coop is not None:
        net.kernels.set_coop(a.coop)
    tr = MambaTrainer(net, batch=a.batch, seq_len=a.seq_len, dtype=a.dtype, lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(0)
    tr.x_buf.copy_(torch.randn(a.batch, a.seq_len, 32, device="cuda", generator=g))
    tr.d_buf.copy_(torch.randn(a.batch, a.seq_len, a.d_model, device="cuda", generator=g))
    for _ in range(a.steps):
        tr.step(None, None)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
