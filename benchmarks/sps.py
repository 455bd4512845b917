"""End-to-end throughput (SPS) of the main job, next to its physical limit and to sb3-contrib, in ONE process.

For each env count (default 16 and 64) on CartPole-v1 it measures:

* ``raw_env_sps``: the same gymnasium vector env (mamba_rl.envs.make_vec_env: SyncVectorEnv,
  NextStep autoreset, RecordEpisodeStatistics, NormalizeReward) stepped with pre-drawn random
  actions - the loop's physical limit;
* ``agent_sps``: RecurrentPPO training (rollout + PPO update, the default CleanRL-like config,
  d_model 128, 3 layers, f32), steps / wall time over the measured updates (the first update,
  which captures the CUDA graphs and warms up, is excluded); ``agent_rollout_sps`` counts the
  rollout time only;
* ``sb3_sps`` (when ``sb3_contrib`` imports): sb3-contrib RecurrentPPO, MlpLstmPolicy with
  LSTM 128, same env count and n_steps 128, on the same device, timed after a warm-up learn.

Ratios: ``agent_vs_sb3`` = agent_sps / sb3_sps (target >= 30), ``agent_fraction_of_raw`` =
agent_sps / raw_env_sps (target >= 0.5) (the project's targets).

Usage:
    python benchmarks/sps.py                       # cuda if available, 16 and 64 envs
    python benchmarks/sps.py --device cpu --updates 2 --num-steps 16 --envs 4   # quick CPU check
Writes JSON to ``$OUT/sps.json`` when OUT is set (and to --json if given); prints it too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch


def raw_env_sps(num_envs: int, steps: int, seed: int = 0) -> float:
    """Env steps per second of make_vec_env('CartPole-v1', num_envs) with pre-drawn random actions."""
    from mamba_rl.envs import make_vec_env

    envs = make_vec_env("CartPole-v1", num_envs, seed=seed, normalize_reward=True)
    envs.reset(seed=seed)
    rng = np.random.default_rng(seed)
    n_iter = max(1, steps // num_envs)
    actions = rng.integers(0, 2, size=(n_iter, num_envs))
    for a in actions[: min(100, n_iter)]:  # warm-up
        envs.step(a)
    t0 = time.perf_counter()
    for a in actions:
        envs.step(a)
    dt = time.perf_counter() - t0
    envs.close()
    return n_iter * num_envs / dt


def agent_sps(num_envs: int, updates: int, num_steps: int, device: str, dtype: str, seed: int = 0) -> dict:
    """RecurrentPPO training SPS over ``updates`` updates after one warm-up update."""
    import tempfile

    from mamba_rl.agents import PPOConfig, RecurrentPPO

    tmp = tempfile.mkdtemp(prefix="mamba_rl_sps_")
    cfg = PPOConfig(env_id="CartPole-v1", num_envs=num_envs, num_steps=num_steps, device=device, dtype=dtype,
                    seed=seed, total_timesteps=(updates + 1) * num_envs * num_steps, track=False,
                    checkpoint_every=0, checkpoint_dir=tmp, runs_dir=tmp)
    agent = RecurrentPPO(config=cfg)
    agent.learn(total_timesteps=num_envs * num_steps)  # warm-up update (graph capture happened in __init__)
    agent.config = cfg  # restore the full horizon (lr annealing as in a real run)
    if agent.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    agent.learn()
    if agent.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    hist = agent.history[1:]
    steps = len(hist) * num_envs * num_steps
    rollout_s = sum(h["perf/rollout_ms"] for h in hist) / 1e3
    update_s = sum(h["perf/update_ms"] for h in hist) / 1e3
    out = {"agent_sps": steps / dt, "agent_rollout_sps": steps / rollout_s, "agent_updates": len(hist),
           "agent_rollout_ms_per_update": 1e3 * rollout_s / len(hist),
           "agent_update_ms_per_update": 1e3 * update_s / len(hist),
           "backend": agent.net.backend, "cuda_graphs": bool(agent._graphs)}
    agent.close()
    return out


def sb3_sps(num_envs: int, updates: int, num_steps: int, device: str, seed: int = 0):
    """sb3-contrib RecurrentPPO (MlpLstmPolicy, LSTM 128) SPS, or None when sb3_contrib is missing."""
    try:
        from sb3_contrib import RecurrentPPO as SB3RecurrentPPO
        from stable_baselines3.common.env_util import make_vec_env as sb3_make_vec_env
    except ImportError:
        return None
    env = sb3_make_vec_env("CartPole-v1", n_envs=num_envs, seed=seed)
    model = SB3RecurrentPPO("MlpLstmPolicy", env, n_steps=num_steps, batch_size=num_envs * num_steps // 4,
                            n_epochs=4, learning_rate=2.5e-4, policy_kwargs=dict(lstm_hidden_size=128),
                            device=device, seed=seed, verbose=0)
    model.learn(total_timesteps=num_envs * num_steps)  # warm-up
    total = updates * num_envs * num_steps
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.learn(total_timesteps=total, reset_num_timesteps=False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    env.close()
    return total / dt


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="f32")
    p.add_argument("--envs", type=int, nargs="+", default=[16, 64], help="env counts")
    p.add_argument("--updates", type=int, default=10, help="measured PPO updates per env count")
    p.add_argument("--num-steps", type=int, default=128)
    p.add_argument("--raw-steps", type=int, default=200_000, help="env steps for the raw env rate")
    p.add_argument("--no-sb3", action="store_true", help="skip sb3-contrib even if installed")
    p.add_argument("--json", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device

    results = []
    for n in a.envs:
        row = {"num_envs": n, "num_steps": a.num_steps}
        row["raw_env_sps"] = raw_env_sps(n, a.raw_steps)
        row.update(agent_sps(n, a.updates, a.num_steps, device, a.dtype))
        row["sb3_sps"] = None if a.no_sb3 else sb3_sps(n, max(1, a.updates // 2), a.num_steps, device)
        row["agent_fraction_of_raw"] = row["agent_sps"] / row["raw_env_sps"]
        row["agent_vs_sb3"] = row["agent_sps"] / row["sb3_sps"] if row["sb3_sps"] else None
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    report = {
        "benchmark": "CartPole-v1 end-to-end SPS (RecurrentPPO on the Mamba backbone vs raw env vs sb3-contrib)",
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
        "torch": torch.__version__, "python": platform.python_version(), "dtype": a.dtype,
        "model": {"d_model": 128, "n_layers": 3, "d_state": 16}, "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    paths = [a.json] if a.json else []
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], "sps.json"))
    for path in paths:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
