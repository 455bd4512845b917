"""CPU engine benchmark: every figure next to its floor, measured in ONE process on one machine.

CPU speed differs up to ~20x between machines of the same kind, so only ratios measured side by side mean
anything. For the default model (d_model 128, 3 layers, d_state 16, d_conv 4, expand 2) it measures:

* ``step``: the one-token step at B = 8 (``Stepper.step``, the acting path), next to the same GEMMs timed
  alone with torch (``input_proj``, and per layer ``in_proj``, ``x_proj``, ``dt_proj``, ``out_proj``);
* ``train``: a training step over [B = 2, T = 128] (forward + backward with a given d_temporal + AdamW,
  ``MambaTrainer.step``), next to the same GEMMs alone (each linear's forward, its input gradient and its
  weight gradient);
* ``main job``: the default ``mamba-rl train`` (RecurrentPPO on mamba_rl/CartPoleNoVel-v1, 8 envs x 128
  steps) SPS over a few updates, next to sb3-contrib RecurrentPPO (MlpLstmPolicy, LSTM 128, 8 envs,
  n_steps 128, CartPole-v1) over the same number of env steps, and (``--full``) the wall time of the
  default 100k-step run.

Usage: ``python benchmarks/cpu.py [--backend cpu|reference] [--threads N] [--updates K] [--full]
[--json PATH]``. Targets: step and train <= 2x their GEMMs; main job >= 10x sb3-contrib.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import time

import torch
import torch.nn.functional as F


def _median_s(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def _shapes(cfg, input_dim):
    """(in_features, out_features) of every GEMM of the backbone, in order."""
    d, di, n, r = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.dt_rank_value
    out = [(input_dim, d)]
    for _ in range(cfg.n_layers):
        out += [(d, 2 * di), (di, r + 2 * n), (r, di), (di, d)]
    return out


def gemm_floor_s(cfg, input_dim: int, rows: int, backward: bool, iters: int) -> float:
    """Median time of the backbone's GEMMs alone over ``rows`` rows (forward; plus dX and dW if backward)."""
    g = torch.Generator().manual_seed(0)
    mats = []
    for k, m in _shapes(cfg, input_dim):
        x = torch.randn(rows, k, generator=g)
        w = torch.randn(m, k, generator=g)
        dy = torch.randn(rows, m, generator=g)
        mats.append((x, w, dy))

    def run():
        for x, w, dy in mats:
            F.linear(x, w)
            if backward:
                torch.mm(dy, w)
                torch.mm(dy.t(), x)
    return _median_s(run, iters)


def bench_step(cfg, input_dim: int, backend: str, B: int, iters: int) -> dict:
    from mamba_rl import MambaBackbone
    net = MambaBackbone(cfg, input_dim, backend=backend, seed=0)
    st = net.stepper(batch=B)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(64, B, input_dim, generator=g)
    starts = torch.rand(64, B, generator=g) < 0.02
    i = [0]

    def one():
        k = i[0] % 64
        st.step(xs[k], episode_starts=starts[k])
        i[0] += 1
    ours = _median_s(one, iters)
    floor = gemm_floor_s(cfg, input_dim, B, backward=False, iters=iters)
    return {"what": f"one-token step B={B}", "backend": net.backend, "ms": ours * 1e3, "gemm_ms": floor * 1e3,
            "ratio": ours / floor}


def bench_train(cfg, input_dim: int, backend: str, B: int, T: int, iters: int) -> dict:
    from mamba_rl import MambaBackbone, MambaTrainer
    net = MambaBackbone(cfg, input_dim, backend=backend, seed=0)
    tr = MambaTrainer(net, batch=B, seq_len=T, lr=1e-4, max_grad_norm=0.5)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, T, input_dim, generator=g)
    d = torch.randn(B, T, cfg.d_model, generator=g) * 1e-3
    starts = torch.rand(B, T, generator=g) < 0.02
    ours = _median_s(lambda: tr.step(x, d, episode_starts=starts), iters)
    floor = gemm_floor_s(cfg, input_dim, B * T, backward=True, iters=iters)
    return {"what": f"training step {B}x{T} (fwd+bwd+AdamW)", "backend": net.backend, "ms": ours * 1e3,
            "gemm_ms": floor * 1e3, "ratio": ours / floor}


def main_job_sps(updates: int, backend: str) -> dict:
    from mamba_rl.agents import PPOConfig, RecurrentPPO
    tmp = tempfile.mkdtemp(prefix="mamba_rl_cpu_bench_")
    cfg = PPOConfig(device="cpu", backend=backend, track=False, checkpoint_every=0, checkpoint_dir=tmp,
                    runs_dir=tmp, total_timesteps=(updates + 1) * 8 * 128)
    agent = RecurrentPPO(config=cfg)
    agent.learn(total_timesteps=8 * 128)  # warm-up update (kernel build, first allocations)
    s0, t0 = agent.global_step, time.perf_counter()
    agent.learn(total_timesteps=cfg.total_timesteps)
    dt = time.perf_counter() - t0
    steps = agent.global_step - s0
    agent.close()
    return {"env_id": cfg.env_id, "steps": steps, "seconds": dt, "sps": steps / dt, "backend": agent.policy.net.backend}


def sb3_sps(steps: int) -> dict | None:
    try:
        from sb3_contrib import RecurrentPPO as SB3RecurrentPPO
        from stable_baselines3.common.env_util import make_vec_env as sb3_make_vec_env
    except ImportError:
        return None
    env = sb3_make_vec_env("CartPole-v1", n_envs=8, seed=0)
    model = SB3RecurrentPPO("MlpLstmPolicy", env, n_steps=128, batch_size=256, device="cpu", seed=0, verbose=0,
                            policy_kwargs={"lstm_hidden_size": 128})
    model.learn(total_timesteps=1024)  # warm-up
    n0, t0 = model.num_timesteps, time.perf_counter()
    model.learn(total_timesteps=steps, reset_num_timesteps=False)  # `steps` more env steps
    dt = time.perf_counter() - t0
    env.close()
    done = model.num_timesteps - n0
    return {"env_id": "CartPole-v1", "steps": done, "seconds": dt, "sps": done / dt}


def full_run_seconds(backend: str) -> dict:
    from mamba_rl.agents import PPOConfig, RecurrentPPO
    tmp = tempfile.mkdtemp(prefix="mamba_rl_cpu_full_")
    cfg = PPOConfig(device="cpu", backend=backend, track=False, checkpoint_every=0, checkpoint_dir=tmp, runs_dir=tmp)
    t0 = time.perf_counter()
    agent = RecurrentPPO(config=cfg)
    agent.learn()
    dt = time.perf_counter() - t0
    ret = [r for r in agent.recent_returns]
    agent.close()
    return {"total_timesteps": cfg.total_timesteps, "steps": agent.global_step, "seconds": dt,
            "mean_return_last_100": sum(ret) / max(1, len(ret))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu", choices=("cpu", "reference", "auto"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--updates", type=int, default=4, help="measured PPO updates of the main job")
    ap.add_argument("--iters", type=int, default=30, help="timed iterations per micro-benchmark")
    ap.add_argument("--full", action="store_true", help="also time the default 100k-step run")
    ap.add_argument("--no-sb3", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here (default: $OUT/cpu.json if OUT is set)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from mamba_rl import MambaConfig
    cfg = MambaConfig()
    input_dim = 2 + 2 + 1  # CartPoleNoVel: 2 obs + previous action one-hot (2) + previous reward
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": []}
    for row in (bench_step(cfg, input_dim, a.backend, 8, a.iters * 10),
                bench_train(cfg, input_dim, a.backend, 2, 128, a.iters)):
        res["rows"].append(row)
        print(f"{row['what']:40s} {row['backend']:9s} {row['ms']:9.3f} ms   GEMMs alone {row['gemm_ms']:8.3f} ms"
              f"   ratio {row['ratio']:.2f}x", flush=True)
    job = main_job_sps(a.updates, a.backend)
    res["main_job"] = job
    print(f"main job ({job['env_id']}, {job['backend']}): {job['sps']:.0f} SPS over {job['steps']} steps", flush=True)
    if not a.no_sb3:
        sb3 = sb3_sps(job["steps"])
        res["sb3_contrib"] = sb3
        if sb3 is not None:
            res["main_job_vs_sb3"] = job["sps"] / sb3["sps"]
            print(f"sb3-contrib RecurrentPPO LSTM-128 (CartPole-v1): {sb3['sps']:.0f} SPS -> ratio "
                  f"{res['main_job_vs_sb3']:.1f}x", flush=True)
        else:
            print("sb3-contrib not installed: peer skipped (pip install sb3-contrib)", flush=True)
    if a.full:
        full = full_run_seconds(a.backend)
        res["full_default_run"] = full
        print(f"default run: {full['steps']} steps in {full['seconds']:.0f} s "
              f"(mean return of the last 100 episodes {full['mean_return_last_100']:.0f})", flush=True)
    path = a.json or (os.path.join(os.environ["OUT"], "cpu.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
