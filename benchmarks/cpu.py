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

Timing: ours and its GEMMs alternate in ``--rounds`` rounds (each the median of ``--iters`` calls, wall
time) and each row reports the minimum over rounds of both, so a machine shared with other processes
inflates both columns alike; the CPU time of the calls (``time.thread_time``, less sensitive to other
processes) is reported beside it. The micro rows run at every ``--threads`` count (default 1 and 2). The
main job runs as ``mamba-rl train`` does (its thread policy: 1 thread unless OMP_NUM_THREADS), twice, before
and after the peer; sb3-contrib runs at 1 thread and at torch's default, the faster counts. ``--two-procs``
also runs the main job in two processes at once (each its default thread) against one alone;
``--time-tests`` times the README's test command. The JSON records the date, torch, CPU model and the load
average before and after.

Usage: ``python benchmarks/cpu.py [--backend cpu|reference] [--threads 1 2] [--updates K] [--full]
[--two-procs] [--time-tests] [--json PATH]``. Targets: step and train <= 2x their GEMMs; main job >= 10x
sb3-contrib; two processes at once keep >= 1/2 of the solo SPS; the test command <= 4 minutes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
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


def _round(fn, iters: int) -> tuple[float, float]:
    """(median wall s, median CPU s of this thread: time.thread_time) over ``iters`` calls."""
    wall, cpu = [], []
    for _ in range(iters):
        c0, t0 = time.thread_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    wall.sort()
    cpu.sort()
    return wall[len(wall) // 2], cpu[len(cpu) // 2]


def side_by_side(ours, peer, iters: int, rounds: int) -> dict:
    """Alternate ``ours`` and ``peer`` for ``rounds`` rounds of ``iters`` calls each; min over rounds of the
    per-round medians (wall and CPU time), in seconds."""
    for _ in range(3):
        ours()
        peer()
    best = {"ours": float("inf"), "peer": float("inf"), "ours_cpu": float("inf"), "peer_cpu": float("inf")}
    for _ in range(rounds):
        for k, fn in (("ours", ours), ("peer", peer)):
            w, c = _round(fn, iters)
            best[k] = min(best[k], w)
            best[k + "_cpu"] = min(best[k + "_cpu"], c)
    return best


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _shapes(cfg, input_dim):
    """(in_features, out_features) of every GEMM of the backbone, in order."""
    d, di, n, r = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.dt_rank_value
    out = [(input_dim, d)]
    for _ in range(cfg.n_layers):
        out += [(d, 2 * di), (di, r + 2 * n), (r, di), (di, d)]
    return out


def gemm_floor_fn(cfg, input_dim: int, rows: int, backward: bool):
    """A callable running the backbone's GEMMs alone over ``rows`` rows (forward; plus dX and dW if backward)."""
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
    return run


def gemm_floor_s(cfg, input_dim: int, rows: int, backward: bool, iters: int) -> float:
    """Median time of the backbone's GEMMs alone over ``rows`` rows (forward; plus dX and dW if backward)."""
    return _median_s(gemm_floor_fn(cfg, input_dim, rows, backward), iters)


def _row(what, backend, threads, t) -> dict:
    return {"what": what, "backend": backend, "threads": threads, "ms": t["ours"] * 1e3, "gemm_ms": t["peer"] * 1e3,
            "ratio": t["ours"] / t["peer"], "cpu_ms": t["ours_cpu"] * 1e3, "gemm_cpu_ms": t["peer_cpu"] * 1e3,
            "cpu_ratio": t["ours_cpu"] / t["peer_cpu"]}


def bench_step(cfg, input_dim: int, backend: str, B: int, iters: int, rounds: int = 5) -> dict:
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
    t = side_by_side(one, gemm_floor_fn(cfg, input_dim, B, backward=False), iters, rounds)
    return _row(f"one-token step B={B}", net.backend, torch.get_num_threads(), t)


def bench_train(cfg, input_dim: int, backend: str, B: int, T: int, iters: int, rounds: int = 5) -> dict:
    from mamba_rl import MambaBackbone, MambaTrainer
    net = MambaBackbone(cfg, input_dim, backend=backend, seed=0)
    tr = MambaTrainer(net, batch=B, seq_len=T, lr=1e-4, max_grad_norm=0.5)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, T, input_dim, generator=g)
    d = torch.randn(B, T, cfg.d_model, generator=g) * 1e-3
    starts = torch.rand(B, T, generator=g) < 0.02
    t = side_by_side(lambda: tr.step(x, d, episode_starts=starts), gemm_floor_fn(cfg, input_dim, B * T, True),
                     iters, rounds)
    return _row(f"training step {B}x{T} (fwd+bwd+AdamW)", net.backend, torch.get_num_threads(), t)


def main_job_sps(updates: int, backend: str) -> dict:
    from mamba_rl.agents import PPOConfig, RecurrentPPO
    tmp = tempfile.mkdtemp(prefix="mamba_rl_cpu_bench_")
    cfg = PPOConfig(device="cpu", backend=backend, track=False, checkpoint_every=0, checkpoint_dir=tmp,
                    runs_dir=tmp, total_timesteps=(updates + 1) * 8 * 128)
    agent = RecurrentPPO(config=cfg)  # applies the run's thread policy (1 thread unless OMP_NUM_THREADS)
    agent.learn(total_timesteps=8 * 128)  # warm-up update (kernel build, first allocations)
    s0, t0, c0 = agent.global_step, time.perf_counter(), time.process_time()
    agent.learn(total_timesteps=cfg.total_timesteps)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    steps = agent.global_step - s0
    agent.close()
    return {"env_id": cfg.env_id, "steps": steps, "seconds": dt, "sps": steps / dt, "cpu_seconds": dc,
            "threads": torch.get_num_threads(), "backend": agent.policy.net.backend}


def sb3_sps(steps: int, threads: int | None = None) -> dict | None:
    if threads:
        torch.set_num_threads(threads)
    try:
        from sb3_contrib import RecurrentPPO as SB3RecurrentPPO
        from stable_baselines3.common.env_util import make_vec_env as sb3_make_vec_env
    except ImportError:
        return None
    env = sb3_make_vec_env("CartPole-v1", n_envs=8, seed=0)
    model = SB3RecurrentPPO("MlpLstmPolicy", env, n_steps=128, batch_size=256, device="cpu", seed=0, verbose=0,
                            policy_kwargs={"lstm_hidden_size": 128})
    model.learn(total_timesteps=1024)  # warm-up
    n0, t0, c0 = model.num_timesteps, time.perf_counter(), time.process_time()
    model.learn(total_timesteps=steps, reset_num_timesteps=False)  # `steps` more env steps
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    env.close()
    done = model.num_timesteps - n0
    return {"env_id": "CartPole-v1", "steps": done, "seconds": dt, "sps": done / dt, "cpu_seconds": dc,
            "threads": torch.get_num_threads()}


def two_procs(updates: int, backend: str) -> dict:
    """The main job in one process alone, then in two processes at once (each its default thread policy)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--job-only", "--updates", str(updates), "--backend", backend]

    def launch(n):
        outs = [tempfile.mktemp(suffix=".json") for _ in range(n)]
        procs = [subprocess.Popen(cmd + ["--json", o], stdout=subprocess.DEVNULL) for o in outs]
        for p in procs:
            if p.wait() != 0:
                raise RuntimeError(f"benchmarks/cpu.py --job-only exited with {p.returncode}")
        res = []
        for o in outs:
            with open(o) as f:
                res.append(json.load(f)["main_job"]["sps"])
            os.unlink(o)
        return res
    solo = launch(1)[0]
    pair = launch(2)
    return {"solo_sps": solo, "pair_sps": pair, "pair_over_solo": [p / solo for p in pair]}


def time_tests() -> dict:
    """Wall time of the README's test command (python -m pytest -m "not slow") from the repository root."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pytest", "-m", "not slow", "-q", "-rf", "-p", "no:cacheprovider"],
                       cwd=root, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    lines = (p.stdout or "").strip().splitlines()
    return {"seconds": dt, "returncode": p.returncode, "summary": (lines[-1:] or [""])[0],
            "failed": [ln for ln in lines if ln.startswith("FAILED ")]}


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
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads of the micro rows")
    ap.add_argument("--updates", type=int, default=4, help="measured PPO updates of the main job")
    ap.add_argument("--iters", type=int, default=10, help="calls per round of a micro-benchmark (x10 for the step)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per micro-benchmark")
    ap.add_argument("--full", action="store_true", help="also time the default 100k-step run")
    ap.add_argument("--no-sb3", action="store_true")
    ap.add_argument("--sb3-threads", type=int, nargs="+", default=None,
                    help="torch threads of the sb3-contrib runs (default: 1 and torch's default; the faster counts)")
    ap.add_argument("--two-procs", action="store_true", help="also run the main job in 2 processes at once")
    ap.add_argument("--time-tests", action="store_true", help="also time the README's test command")
    ap.add_argument("--job-only", action="store_true", help=argparse.SUPPRESS)  # two_procs' child
    ap.add_argument("--json", default=None, help="write the results here (default: $OUT/cpu.json if OUT is set)")
    a = ap.parse_args(argv)
    if any(t < 1 for t in a.threads):
        ap.error(f"--threads: expected counts >= 1, got {a.threads}")
    default_threads = torch.get_num_threads()
    from mamba_rl import MambaConfig
    cfg = MambaConfig()
    input_dim = 2 + 2 + 1  # CartPoleNoVel: 2 obs + previous action one-hot (2) + previous reward
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "cpu_model": _cpu_model(), "machine": platform.machine(), "cpus": os.cpu_count(),
           "torch": torch.__version__, "torch_default_threads": default_threads,
           "loadavg_start": list(os.getloadavg()), "rows": []}
    path = a.json or (os.path.join(os.environ["OUT"], "cpu.json") if os.environ.get("OUT") else None)
    if a.job_only:
        res["main_job"] = main_job_sps(a.updates, a.backend)
        with open(path, "w") as f:
            json.dump(res, f)
        return 0
    for nt in a.threads:
        torch.set_num_threads(nt)
        for row in (bench_step(cfg, input_dim, a.backend, 8, a.iters * 10, a.rounds),
                    bench_train(cfg, input_dim, a.backend, 2, 128, a.iters, a.rounds)):
            res["rows"].append(row)
            print(f"{row['what']:38s} {row['backend']:4s} {nt} thr {row['ms']:8.3f} ms  GEMMs alone "
                  f"{row['gemm_ms']:7.3f} ms  ratio {row['ratio']:.2f}x  (CPU time ratio {row['cpu_ratio']:.2f}x)",
                  flush=True)
    jobs = [main_job_sps(a.updates, a.backend)]
    print(f"main job ({jobs[0]['env_id']}, {jobs[0]['backend']}, {jobs[0]['threads']} thread): {jobs[0]['sps']:.0f} SPS "
          f"over {jobs[0]['steps']} steps", flush=True)
    if not a.no_sb3:
        sb3_threads = sorted(set(a.sb3_threads or (1, default_threads)))
        peers = [r for r in (sb3_sps(jobs[0]["steps"], nt) for nt in sb3_threads) if r is not None]
        torch.set_num_threads(default_threads)
        if peers:
            jobs.append(main_job_sps(a.updates, a.backend))  # ours again, after the peer: the load may change
            print(f"main job again: {jobs[1]['sps']:.0f} SPS", flush=True)
            best = max(peers, key=lambda r: r["sps"])
            ours = sum(j["sps"] for j in jobs) / len(jobs)
            res["sb3_contrib_runs"] = peers
            res["sb3_contrib"] = best
            res["main_job_vs_sb3"] = ours / best["sps"]
            print("sb3-contrib RecurrentPPO LSTM-128 (CartPole-v1): " +
                  ", ".join(f"{r['sps']:.0f} SPS at {r['threads']} thr" for r in peers) +
                  f" -> ratio (mean of ours / the faster) {res['main_job_vs_sb3']:.1f}x", flush=True)
        else:
            print("sb3-contrib not installed: peer skipped (pip install sb3-contrib)", flush=True)
    res["main_job"] = jobs[0]
    res["main_job_runs"] = jobs
    if a.two_procs:
        tp = two_procs(a.updates, a.backend)
        res["two_procs"] = tp
        print(f"two processes at once: solo {tp['solo_sps']:.0f} SPS, together "
              + ", ".join(f"{v:.0f}" for v in tp["pair_sps"]) + " SPS ("
              + ", ".join(f"{r:.2f}" for r in tp["pair_over_solo"]) + " of solo)", flush=True)
    if a.full:
        full = full_run_seconds(a.backend)
        res["full_default_run"] = full
        print(f"default run: {full['steps']} steps in {full['seconds']:.0f} s "
              f"(mean return of the last 100 episodes {full['mean_return_last_100']:.0f})", flush=True)
    if a.time_tests:
        tt = time_tests()
        res["test_command"] = tt
        print(f"README test command: {tt['seconds']:.0f} s ({tt['summary']})", flush=True)
    res["loadavg_end"] = list(os.getloadavg())
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
