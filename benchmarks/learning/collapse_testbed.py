"""A deterministic CPU testbed for the late collapse of a converged policy (benchmarks/learning/README.md,
2026-12-06): PositionOnlyCartPoleEasy, seed 1, 64 envs x 128 steps, 3M-step schedule, one torch thread, the
defaults of that day but ``prev_reward`` (off, as it was then). The run holds a return of 1.0 from 0.3M steps;
at update 261 (2.14M steps) one failed episode takes the critic's explained variance to -3, approx_kl grows over
six updates and the return falls to 0.16 by update 271.

Two modes:

* ``--train OUT``: the run from scratch with a checkpoint every 25 updates, up to ``--until`` (default 300);
* ``--resume CKPT``: that run resumed from a checkpoint (its envs restored, so bit for bit the same run) with
  ``--set FIELD=VALUE`` PPOConfig overrides (e.g. ``max_minibatch_kl=0.05``), up to ``--until``.

Each prints one line per update (update, env steps, mean return of the last 100 episodes, entropy, approx_kl,
explained variance) and writes them as JSON (``--json``).

Usage::

    python benchmarks/learning/collapse_testbed.py --train /tmp/tb
    python benchmarks/learning/collapse_testbed.py --resume /tmp/tb/<run>/update_000250 --until 285 \\
        --set max_minibatch_kl=0.05 --json g05.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from collections import deque

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]  # this folder holds popgym.py

TASK = "popgym-PositionOnlyCartPoleEasy-v0"


def _parse_sets(items: list[str]) -> dict:
    """popgym.py's ``--set NAME=VALUE`` parser (Python literals, else strings), loaded from this folder by path."""
    spec = importlib.util.spec_from_file_location("popgym_harness", os.path.join(HERE, "popgym.py"))
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    return harness.parse_sets(items)


def _agent(args, sets: dict):
    """The testbed's agent: a fresh run (``--train``) or the checkpoint resumed with its envs (``--resume``)."""
    from mamba_rl.agents import RecurrentPPO

    if args.train:
        # prev_reward False: the recorded run predates that default (--set prev_reward=True for the new one)
        kw = dict(seed=1, total_timesteps=3_000_000, num_envs=64, num_steps=128, device="cpu", threads=1,
                  track=False, checkpoint_every=25, checkpoint_dir=args.train, runs_dir=args.train,
                  prev_reward=False)
        return RecurrentPPO(TASK, **{**kw, **sets})
    return RecurrentPPO.load(args.resume, restore_envs=True, track=False, checkpoint_every=0, **sets)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--train", metavar="OUT", help="train from scratch, checkpoints under OUT")
    mode.add_argument("--resume", metavar="CKPT", help="resume from this checkpoint folder")
    ap.add_argument("--until", type=int, default=300, help="the last update to run (default 300)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a PPOConfig override")
    ap.add_argument("--json", help="write the per-update rows here")
    args = ap.parse_args(argv)
    try:
        sets = _parse_sets(args.set)
    except ValueError as e:
        ap.error(str(e))

    from mamba_rl import CheckpointError

    if args.json:  # fail now, not after a 20-minute run
        try:
            open(args.json, "a").close()
        except OSError as e:
            ap.error(f"--json {args.json}: {e.strerror}")
    try:
        agent = _agent(args, sets)
    except (ValueError, TypeError, FileNotFoundError, CheckpointError) as e:
        ap.error(str(e))
    if not agent.update < args.until <= agent.num_updates:
        agent.close()
        ap.error(f"--until {args.until}: expected an update after the run's {agent.update} and at most its last, "
                 f"{agent.num_updates}")
    last, rows = deque(maxlen=100), []

    class _Done(Exception):
        pass

    def callback(agent, m):
        last.extend(r for _, r, _ in agent.last_episodes)
        row = (int(m["update"]), int(m["global_step"]), sum(last) / len(last) if last else math.nan,
               float(m["losses/entropy"]), float(m["losses/approx_kl"]), float(m["losses/explained_variance"]))
        rows.append(row)
        print(*(round(x, 4) if isinstance(x, float) else x for x in row), flush=True)
        if row[0] >= args.until:
            raise _Done

    try:
        agent.learn(callback=callback)
    except _Done:
        pass
    finally:
        agent.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
