"""Data-parallel SPS: N ranks x E envs each against one process with E envs.

``python benchmarks/sps.py --nproc 2 --envs 64 --no-sb3 --out $OUT/sps_ddp.json`` calls :func:`compare`:

1. one process, ``E`` envs (``benchmarks/sps.py``'s ``agent_sps``, on GPU 0 on CUDA);
2. ``torchrun --standalone --nproc-per-node N benchmarks/sps_ddp.py --worker ...``: every rank builds the
   same agent with ``E`` envs (NCCL on CUDA, one GPU per rank; gloo on the CPU), runs one warm-up update,
   then times ``updates`` updates between two barriers; the ranks' SPS are summed (all-reduce).

Reports ``ddp_sps`` (sum over ranks), ``single_sps`` and ``speedup`` = ddp_sps / single_sps (target >= 1.8
for N = 2 at 64 envs per GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch


def worker(a: argparse.Namespace) -> None:
    """One rank under torchrun: warm-up update, then ``a.updates`` timed updates; rank 0 writes JSON."""
    import torch.distributed as dist

    from mamba_rl.agents import PPOConfig, RecurrentPPO
    from mamba_rl.agents.distributed import init_from_env

    assert init_from_env(a.device, timeout_s=300), "sps_ddp.py --worker must run under torchrun with N > 1"
    tmp = tempfile.mkdtemp(prefix="mamba_rl_sps_ddp_")
    try:
        world = dist.get_world_size()
        step = world * a.envs * a.num_steps
        cfg = PPOConfig(env_id="CartPole-v1", num_envs=a.envs, num_steps=a.num_steps, device=a.device,
                        dtype=a.dtype, seed=0, total_timesteps=(a.updates + 1) * step, track=False,
                        checkpoint_every=0, checkpoint_dir=tmp, runs_dir=tmp, d_model=a.d_model, n_layers=a.n_layers)
        agent = RecurrentPPO(config=cfg)
        agent.learn(total_timesteps=step)  # warm-up update
        agent.config = cfg
        dist.barrier()
        t0 = time.perf_counter()
        agent.learn()
        if agent.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        dist.barrier()
        wall = time.perf_counter() - t0
        local = torch.tensor([a.updates * a.envs * a.num_steps / dt], dtype=torch.float64, device=agent.device)
        dist.all_reduce(local)
        if agent.rank == 0:
            hist = agent.history[1:]
            row = {"nproc": world, "envs_per_rank": a.envs, "ddp_sps": float(local), "ddp_wall_s": wall,
                   "ddp_sps_by_wall": a.updates * step / wall, "updates": a.updates,
                   "update_ms_per_update": sum(h["perf/update_ms"] for h in hist) / len(hist),
                   "rollout_ms_per_update": sum(h["perf/rollout_ms"] for h in hist) / len(hist),
                   "backend": dist.get_backend(), "cuda_graphs": agent.config.cuda_graphs and agent.device.type == "cuda",
                   "update_graph": "minibatch" in agent.updater._graphs,
                   "capture_error": agent.updater.capture_error}
            with open(a.result, "w") as f:
                json.dump(row, f)
        agent.close()
    finally:
        dist.destroy_process_group()


def compare(nproc: int, envs: int, updates: int, num_steps: int, device: str, dtype: str, d_model: int,
            n_layers: int, single_sps) -> dict:
    """The DDP row against one process (``single_sps``: benchmarks/sps.py's ``agent_sps``).

    Raises:
        RuntimeError: fewer GPUs than ``nproc`` on CUDA, or the torchrun job failed.
    """
    if device.startswith("cuda") and torch.cuda.device_count() < nproc:
        raise RuntimeError(f"--nproc {nproc} needs {nproc} GPUs, {torch.cuda.device_count()} visible")
    single = single_sps(envs, updates, num_steps, device, dtype, False, d_model, n_layers)
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.abspath(__file__), "--worker", "--result", result, "--envs", str(envs), "--updates", str(updates),
           "--num-steps", str(num_steps), "--device", device, "--dtype", dtype, "--d-model", str(d_model),
           "--n-layers", str(n_layers)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.abspath(__file__))]
                                                      + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run(cmd, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed with exit code {proc.returncode}: {' '.join(cmd)}")
    with open(result) as f:
        row = json.load(f)
    os.unlink(result)
    row.update({"single_sps": single["agent_sps"], "single": single, "speedup": row["ddp_sps"] / single["agent_sps"],
                "speedup_target": f">= {0.9 * nproc:.1f}", "device": device, "num_steps": num_steps,
                "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
                "model": {"d_model": d_model, "n_layers": n_layers}, "torch": torch.__version__})
    return row


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--result", default=None)
    p.add_argument("--envs", type=int, default=64)
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--num-steps", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="f32")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=3)
    return p.parse_args(argv)


if __name__ == "__main__":
    worker(_args())
