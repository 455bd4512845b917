"""One learning-curve run: RecurrentPPO on one env and seed, one CSV row per PPO update.

Usage (from the repo root):
    python benchmarks/learning/run.py --env CartPole-v1 --seed 1 --total 100000 \
        --d-model 64 --n-layers 2 --out benchmarks/learning/data

Any PPOConfig field can be set with ``--set name=value`` (repeatable; Python literals, e.g.
``--set learning_rate=1e-3 --set num_steps=32``) and the run named with ``--variant`` (part of the file
name). ``--device`` picks cpu / cuda (default cpu). ``--stop-at 475`` ends training at the first update whose
mean return of the last 100 episodes reaches 475 (then evaluates).

Writes ``{out}/{env with / -> _}{__variant}__seed{seed}.csv`` with columns
``env_id, variant, seed, update, global_step, episodes, mean_return_update, mean_return_last20,
wall_s`` (mean_return_update: mean return of the episodes that finished during that update's
rollout, NaN if none; mean_return_last20: mean over the last 20 finished episodes).
All other hyperparameters are PPOConfig's defaults (CleanRL's). After training, the final policy is
evaluated deterministically (``--eval-episodes``, memory reset per episode) into ``{same name}.eval.json``.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import tempfile
import time
from collections import deque


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--total", type=int, default=100_000)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--memoryless", action="store_true", help="reset the state every step (baseline)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--variant", default=None, help="name of this configuration (file name suffix)")
    p.add_argument("--eval-episodes", type=int, default=20,
                   help="deterministic evaluation episodes of the final policy (0: none)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a PPOConfig field override (repeatable)")
    p.add_argument("--stop-at", type=float, default=None, metavar="RETURN",
                   help="stop after the first update whose mean return of the last 100 episodes is >= RETURN")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from mamba_rl.agents import RecurrentPPO

    import ast
    overrides = {}
    for item in a.set:
        key, _, val = item.partition("=")
        try:
            overrides[key] = ast.literal_eval(val)
        except (ValueError, SyntaxError):
            overrides[key] = val
    variant = a.variant or ("memoryless" if a.memoryless else "mamba")
    os.makedirs(a.out, exist_ok=True)
    name = a.env.replace("/", "_") + ("" if variant == "mamba" else f"__{variant}")
    path = os.path.join(a.out, f"{name}__seed{a.seed}.csv")
    tmp = tempfile.mkdtemp(prefix="mamba_rl_curve_")
    kwargs = dict(seed=a.seed, total_timesteps=a.total, d_model=a.d_model, n_layers=a.n_layers,
                  memoryless=a.memoryless, device=a.device, track=False, checkpoint_every=0, checkpoint_dir=tmp,
                  runs_dir=tmp)
    kwargs.update(overrides)
    t_build = time.time()
    agent = RecurrentPPO(a.env, **kwargs)
    build_s = time.time() - t_build
    last = deque(maxlen=20)
    last100 = deque(maxlen=100)
    t0 = time.time()
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["env_id", "variant", "seed", "update", "global_step", "episodes", "mean_return_update",
                    "mean_return_last20", "mean_return_last100", "wall_s"])

        def callback(agent, metrics):
            this = [ret for _, ret, _ in agent.last_episodes]
            last.extend(this)
            last100.extend(this)
            mu = sum(this) / len(this) if this else math.nan
            ml = sum(last) / len(last) if last else math.nan
            m100 = sum(last100) / len(last100) if last100 else math.nan
            w.writerow([a.env, variant, a.seed, metrics["update"], metrics["global_step"], len(this),
                        f"{mu:.3f}", f"{ml:.3f}", f"{m100:.3f}", f"{time.time() - t0:.1f}"])
            f.flush()
            if a.stop_at is not None and len(last100) == 100 and m100 >= a.stop_at:
                raise _Reached()

        try:
            agent.learn(callback=callback)
        except _Reached:
            pass
    if a.eval_episodes:
        res = agent.evaluate(num_episodes=a.eval_episodes, deterministic=True)
        import json
        with open(path[:-4] + ".eval.json", "w") as f:
            json.dump({"episodes": a.eval_episodes, "deterministic": True, "mean": res.mean, "std": res.std,
                       "returns": res.returns.tolist()}, f)
    agent.close()
    print(f"{path}: done in {time.time() - t0:.1f} s after a {build_s:.1f} s build", file=sys.stderr)


class _Reached(Exception):
    """Raised by the callback to end training once ``--stop-at`` is reached."""


if __name__ == "__main__":
    main()
