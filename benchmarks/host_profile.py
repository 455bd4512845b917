"""Host-side profile of the default CPU main job (issue 21): CPU time per rollout step and per minibatch.

The default ``mamba-rl train`` agent (RecurrentPPO on mamba_rl/CartPoleNoVel-v1, 8 envs x 128 steps, cpu
backend) runs a warm-up update, then ``--updates`` updates, timed in CPU time of this thread
(``time.thread_time``: a machine shared with other processes inflates wall time, not this). Reported:

* rollout: CPU ms per rollout step, and the share of it inside ``Stepper.step`` (the C++ one-token step)
  and inside ``envs.step`` (the gymnasium vector env and its wrappers);
* update: CPU ms per minibatch, split into the backbone forward (``trainer.forward_body``), the backbone
  backprop (``trainer.backprop_body``) and optimizer (``trainer.optimizer_body``), and the rest (gather,
  heads, PPO loss, autograd over the heads, head Adam, metrics row): the host overhead of a minibatch;
* ``sha256``: a hash of the backbone arena, the heads and both optimizers' state after the timed updates
  (a fixed-seed run: equal hashes before and after a refactor mean the same training run).

``--cprofile N`` prints the N top functions by cumulative time of one rollout and one update;
``--torch-profile`` prints torch.profiler's operator table of one rollout and one update.

Usage: ``OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/host_profile.py [--updates 5] [--cprofile 40]
[--torch-profile] [--repeat 3]``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from bitident import weights_hash  # noqa: E402  (the same hash as scripts/bitident.py)


class _Timer:
    """Wrap ``obj.name`` to accumulate this thread's CPU time spent inside it."""

    def __init__(self, obj, name: str):
        self.obj, self.name, self.total, self.calls = obj, name, 0.0, 0
        self.orig = getattr(obj, name)

        def timed(*args, **kwargs):
            c0 = time.thread_time()
            try:
                return self.orig(*args, **kwargs)
            finally:
                self.total += time.thread_time() - c0
                self.calls += 1
        setattr(obj, name, timed)

    def reset(self) -> None:
        self.total, self.calls = 0.0, 0

    def remove(self) -> None:
        setattr(self.obj, self.name, self.orig)


def build(tmp: str, updates: int, **overrides):
    from mamba_rl.agents import PPOConfig, RecurrentPPO
    cfg = PPOConfig(device="cpu", track=False, checkpoint_every=0, checkpoint_dir=tmp, runs_dir=tmp,
                    total_timesteps=(updates + 1) * 8 * 128, **overrides)
    agent = RecurrentPPO(config=cfg)
    agent.learn(total_timesteps=8 * 128)  # warm-up update (kernel load, first allocations)
    return agent


def timed_updates(agent, updates: int) -> dict:
    c = agent.config
    timers = {"stepper": _Timer(agent.stepper, "step"), "env": _Timer(agent.envs, "step"),
              "forward": _Timer(agent.trainer, "forward_body"), "backprop": _Timer(agent.trainer, "backprop_body"),
              "optimizer": _Timer(agent.trainer, "optimizer_body")}
    roll = upd = 0.0
    w0 = time.perf_counter()
    try:
        for _ in range(updates):
            agent._set_lr(c.learning_rate)  # a constant lr: the warm-up learn() call ended the anneal's plan
            c0 = time.thread_time()
            agent.collect_rollout()
            c1 = time.thread_time()
            agent.update_policy()
            c2 = time.thread_time()
            agent.update += 1
            roll += c1 - c0
            upd += c2 - c1
    finally:
        wall = time.perf_counter() - w0
        for t in timers.values():
            t.remove()
    steps, mbs = updates * c.num_steps, updates * c.update_epochs * c.num_minibatches
    ms = {k: t.total * 1e3 for k, t in timers.items()}
    backbone = ms["forward"] + ms["backprop"] + ms["optimizer"]
    return {"rollout_step_ms": roll * 1e3 / steps, "stepper_ms": ms["stepper"] / steps, "env_ms": ms["env"] / steps,
            "rollout_host_ms": (roll * 1e3 - ms["stepper"] - ms["env"]) / steps,
            "minibatch_ms": upd * 1e3 / mbs, "mb_forward_ms": ms["forward"] / mbs,
            "mb_backward_opt_ms": (ms["backprop"] + ms["optimizer"]) / mbs,
            "mb_host_ms": (upd * 1e3 - backbone) / mbs, "update_ms": upd * 1e3 / updates,
            "rollout_ms": roll * 1e3 / updates, "wall_ms": wall * 1e3 / updates,
            "cpu_sps": c.num_envs * steps / (roll + upd)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=1, help="fresh agents timed one after the other")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the N top functions (cumtime)")
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--backend", default="auto")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeat):
            agent = build(tmp, a.updates, backend=a.backend)
            res = timed_updates(agent, a.updates)
            print(f"[{r}] rollout {res['rollout_step_ms']:.3f} ms/step (stepper {res['stepper_ms']:.3f}, env "
                  f"{res['env_ms']:.3f}, rest {res['rollout_host_ms']:.3f}) | minibatch {res['minibatch_ms']:.2f} ms "
                  f"(forward {res['mb_forward_ms']:.2f}, backward+opt {res['mb_backward_opt_ms']:.2f}, rest "
                  f"{res['mb_host_ms']:.2f}) | update {res['update_ms']:.0f} ms, rollout {res['rollout_ms']:.0f} ms"
                  f" | wall {res['wall_ms']:.0f} ms/update, CPU-time SPS {res['cpu_sps']:.0f} | sha256 {weights_hash(agent)[:16]}", flush=True)
            if a.cprofile:
                for what, fn in (("rollout", agent.collect_rollout), ("update", agent.update_policy)):
                    pr = cProfile.Profile(time.thread_time)
                    pr.enable()
                    fn()
                    pr.disable()
                    s = io.StringIO()
                    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.cprofile)
                    print(f"---- cProfile, one {what} (tottime, thread CPU time)\n{s.getvalue()}")
            if a.torch_profile:
                from torch.profiler import ProfilerActivity, profile
                for what, fn in (("rollout", agent.collect_rollout), ("update", agent.update_policy)):
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        fn()
                    print(f"---- torch.profiler, one {what}\n"
                          + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
