"""End-to-end throughput (SPS) of the main job, next to its physical limit and to sb3-contrib, in ONE process.

For each env backend (``--env-backend``: gymnasium, plus envpool when installed) and env count (default 16,
64, 256 and 1024) on CartPole-v1, one row (``results``) with:

* ``bare_env_sps``: the library's own vector env alone with pre-drawn random actions: gymnasium's
  SyncVectorEnv of ``gym.make`` envs (NextStep autoreset), or ``envpool.make`` in sync mode;
* ``raw_env_sps``: our vector env of the same backend (mamba_rl.envs.make_vec_env: that env under the guard,
  the episode statistics and NormalizeReward; AsyncVectorEnv under ``--async-envs``), the loop's physical
  limit; the two are measured in alternating rounds (``--env-rounds``) so that both see the same machine
  load, and ``raw_over_bare`` is the median of the per-round ratios (target >= 0.8 from 64 envs on);
* ``env_profile``: where one vector step of our env goes, µs per layer of the stack (each layer's own time,
  the sub-envs' per-env wrappers summed over the sub-envs; :func:`env_profile`);
* ``loop_us``: the rollout loop's own host work per vector step without the policy (staging, storing rewards
  and dones, episode bookkeeping; :func:`loop_overhead_us`), the part that should not grow with the env count;
* ``agent_sps``: RecurrentPPO training (rollout + PPO update, the default CleanRL-like config,
  d_model 128, 3 layers, f32 unless overridden) on that backend, steps / wall time over the measured
  updates (the first update, which warms up, is excluded), up to the end of the last update: ``learn()``'s
  final checkpoint save, once per run and growing with the env count (the carried recurrent state), is
  ``final_save_s``, and ``agent_sps_with_final_save`` counts it in;
* ``host_overhead_us``: per vector step, the rollout's wall time minus its env.step time (staging,
  the graph replay and its sync, reading actions, bookkeeping); of it ``act_us``, the actor's ``act`` (the
  stage copy, the policy step's graph replay and the wait for its action) and ``loop_us_in_agent``, the
  rest (the loop's own host work); ``update_ms_per_2048``: the update's wall time per 2,048 env steps;
* ``gae_device_ms`` / ``gae_host_ms``: GAE of one [num_envs, num_steps] rollout, the time-loop-free
  device version (what the GPU rollout runs, inside a graph) against the step loop on the host;
* ``sb3_sps`` (gymnasium rows, when ``sb3_contrib`` imports, up to ``--sb3-max-envs`` envs, 64 by default:
  it runs at ~1-3k SPS, so larger rows would take minutes each): sb3-contrib RecurrentPPO, MlpLstmPolicy
  with LSTM 128, same env count, n_steps 128, on the same device, timed after a warm-up learn, with
  ``--sb3-threads`` torch threads (2 by default; it runs alone, between our rows).

EnvPool rows run once per ``--env-overlap`` mode (PPOConfig.env_overlap; default "auto"; ``env_parts`` in the
row: 2 where the two-halves rollout ran, the table's "halves"). Rows run in the order of ``--env-backend``
(backends outer, env counts inner), then the ``--bf16-envs`` EnvPool rows (``dtype`` bf16); the JSON is
rewritten after every row, so a run cut short keeps its rows.
``must_show`` reads the throughput targets (``targets`` in the JSON) off the rows (:func:`must_show`).

Ratios: ``agent_fraction_of_raw`` = agent_sps / raw_env_sps (target >= 0.5; EnvPool: agent_sps /
bare_env_sps >= 0.6 is ``agent_fraction_of_bare``), ``agent_vs_sb3`` = agent_sps / sb3_sps (target >= 30).

Usage:
    python benchmarks/sps.py --out $OUT/sps.json            # cuda if available, 16 / 64 / 256 / 1024 envs
    python benchmarks/sps.py --device cpu --envs 8 --updates 4 --d-model 64 --n-layers 2 --no-sb3   # CPU check
    python benchmarks/sps.py --env-only --envs 16 64 256 1024     # the env rates and profiles only
    python benchmarks/sps.py --envs 16 64 256 1024 4096 --env-backend envpool gymnasium --profile-backend envpool \
        --raw-steps 30000 --env-rounds 3 --min-iters 10 --bf16-envs 1024 4096 --out $OUT/sps.json   # the full H200 run
    python benchmarks/sps.py --nproc 2 --envs 64 --no-sb3 --out $OUT/sps_ddp.json   # 2 GPUs vs 1 (sps_ddp.py)
Writes JSON to ``--out`` (and ``$OUT/sps.json`` when OUT is set); prints a table and the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------- the env loop alone
def _bare_vec_env(env_id: str, num_envs: int, backend: str):
    """The library's own vector env, nothing of ours: gymnasium's SyncVectorEnv of ``gym.make`` envs (NextStep
    autoreset), or ``envpool.make(env_type="gymnasium")`` in sync mode."""
    import functools

    import gymnasium as gym

    if backend == "envpool":
        import envpool

        return envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, seed=0)
    return gym.vector.SyncVectorEnv([functools.partial(gym.make, env_id)] * num_envs,
                                    autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)


def _our_vec_env(env_id: str, num_envs: int, backend: str, async_envs: bool = False):
    """The agent's vector env: make_vec_env with the default training stack (guard, statistics, NormalizeReward)."""
    from mamba_rl.envs import make_vec_env

    return make_vec_env(env_id, num_envs, seed=0, async_=async_envs, normalize_reward=True, backend=backend)


def _step_rate(envs, actions: np.ndarray) -> float:
    """Env steps per second of ``envs`` stepped with ``actions`` [iters, num_envs] (after a reset)."""
    t0 = time.perf_counter()
    for a in actions:
        envs.step(a)
    return actions.size / (time.perf_counter() - t0)


def env_rates(num_envs: int, steps: int, backend: str = "gymnasium", async_envs: bool = False, rounds: int = 5,
              env_id: str = "CartPole-v1", seed: int = 0, min_iters: int = 20) -> dict:
    """Random-action rates of the bare library vector env and of ours, measured in alternation (``rounds`` rounds
    of ``steps`` env steps each, at least ``min_iters`` vector steps, bare then ours) so that both see the same
    machine load; medians and the median of the per-round ratios ours / bare."""
    bare = _bare_vec_env(env_id, num_envs, backend)
    ours = _our_vec_env(env_id, num_envs, backend, async_envs)
    n_iter = max(min_iters, steps // num_envs)
    actions = np.random.default_rng(seed).integers(0, 2, size=(n_iter, num_envs))
    bare.reset() if backend == "envpool" else bare.reset(seed=seed)  # EnvPool: seeded in envpool.make
    ours.reset(seed=seed)
    _step_rate(bare, actions[:50])  # warm-up
    _step_rate(ours, actions[:50])
    b, o = [], []
    for _ in range(rounds):
        b.append(_step_rate(bare, actions))
        o.append(_step_rate(ours, actions))
    bare.close()
    ours.close()
    return {"bare_env_sps": statistics.median(b), "raw_env_sps": statistics.median(o),
            "raw_over_bare": statistics.median(x / y for x, y in zip(o, b)),
            "raw_over_bare_rounds": [round(x / y, 3) for x, y in zip(o, b)]}


class _Timer:
    """Accumulated wall time of one layer's ``step`` calls (inclusive of the layers below it); ``inner_s``: the
    time of the layers right below it (per-env layers, filled by the probe under it)."""

    def __init__(self, name: str):
        self.name, self.s, self.calls, self.inner_s = name, 0.0, 0, 0.0


def _probe_vector(env, timer: _Timer):
    """A VectorWrapper that adds the time of ``env.step`` to ``timer``."""
    import gymnasium as gym

    class _Probe(gym.vector.VectorWrapper):
        def step(self, actions):
            t0 = time.perf_counter()
            out = self.env.step(actions)
            timer.s += time.perf_counter() - t0
            timer.calls += 1
            return out

    return _Probe(env)


def _probe_env(env, timer: _Timer, parent: _Timer | None = None):
    """A gymnasium Wrapper that adds the time of ``env.step`` to ``timer.s`` (``env``'s inclusive time) and to
    ``parent.inner_s`` (the time below the layer that wraps ``env``)."""
    import gymnasium as gym

    class _Probe(gym.Wrapper):
        def step(self, action):
            t0 = time.perf_counter()
            out = self.env.step(action)
            dt = time.perf_counter() - t0
            timer.s += dt
            timer.calls += 1
            if parent is not None:
                parent.inner_s += dt
            return out

    return _Probe(env)


def env_profile(num_envs: int, steps: int, backend: str = "gymnasium", env_id: str = "CartPole-v1",
                seed: int = 0) -> dict:
    """Where the time of one vector step of our env goes: µs per vector step spent in each layer of the stack
    itself (exclusive of the layers below it), outermost first, down to the sub-envs' own ``step`` and, for a
    SyncVectorEnv, each per-env wrapper ``gym.make`` added (summed over the sub-envs). A timing probe sits below
    every layer; its own cost (~0.2-0.5 µs a call) is charged to the layer above it (``probe_us`` estimates it)."""
    import gymnasium as gym

    envs = _our_vec_env(env_id, num_envs, backend)
    layers, timers = [], []
    w = envs
    while isinstance(w, gym.vector.VectorWrapper):  # a probe below every vector wrapper
        t = _Timer(type(w.env).__name__)
        layers.append(type(w).__name__)
        timers.append(t)
        w.env = _probe_vector(w.env, t)
        w = w.env.env
    base = w
    layers.append(type(base).__name__)
    sub_timers: dict[str, _Timer] = {}  # per-env layer name -> its time summed over the sub-envs
    if isinstance(base, gym.vector.SyncVectorEnv):  # a probe below every per-env wrapper of every sub-env
        whole = sub_timers.setdefault("(whole sub-env)", _Timer("(whole sub-env)"))
        for i, e in enumerate(base.envs):
            t = sub_timers.setdefault(type(e).__name__, _Timer(type(e).__name__))
            base.envs[i] = _probe_env(e, t, whole)
            while isinstance(e, gym.Wrapper):
                inner = e.env
                ti = sub_timers.setdefault(type(inner).__name__, _Timer(type(inner).__name__))
                e.env = _probe_env(inner, ti, sub_timers[type(e).__name__])
                e = inner
    envs.reset(seed=seed)
    n_iter = max(50, steps // num_envs)
    actions = np.random.default_rng(seed).integers(0, 2, size=(n_iter, num_envs))
    for a in actions[:20]:
        envs.step(a)
    for t in timers + list(sub_timers.values()):
        t.s, t.calls, t.inner_s = 0.0, 0, 0.0
    t0 = time.perf_counter()
    for a in actions:
        envs.step(a)
    total = time.perf_counter() - t0
    incl = [total] + [t.s for t in timers]
    names = list(layers)
    below_base = sub_timers["(whole sub-env)"].inner_s if sub_timers else 0.0  # the sub-envs' step, all together
    us = {n: 1e6 * (incl[i] - (incl[i + 1] if i + 1 < len(incl) else below_base)) / n_iter
          for i, n in enumerate(names)}
    for name, t in sub_timers.items():  # exclusive: a layer's time minus the time of the layer it wraps
        if name != "(whole sub-env)":
            us[f"sub-envs: {name}"] = 1e6 * (t.s - t.inner_s) / n_iter
    probe_us = _probe_cost_us()
    envs.close()
    return {"num_envs": num_envs, "env_backend": backend, "us_per_vector_step": 1e6 * total / n_iter,
            "layers_us": {k: round(v, 2) for k, v in us.items()}, "probe_us": round(probe_us, 3)}


def loop_overhead_us(num_envs: int, backend: str = "gymnasium", num_steps: int = 128, rollouts: int = 3,
                     seed: int = 0) -> dict:
    """The rollout loop's own host work per vector step, without the policy: ``collect_rollout`` (staging,
    reading and storing rewards / dones, the episode bookkeeping) of a small CPU agent whose actor returns
    pre-drawn random actions; ``loop_us`` = (rollout time - env.step time) / steps, median over ``rollouts``."""
    from mamba_rl.agents import PPOConfig, RecurrentPPO
    from mamba_rl.agents.rollout import collect_rollout

    tmp = tempfile.mkdtemp(prefix="mamba_rl_loop_")
    # the policy never runs (pre-drawn actions): the reference backend, so that no kernel is built for it
    cfg = PPOConfig(env_id="CartPole-v1", num_envs=num_envs, num_steps=num_steps, num_minibatches=1, device="cpu",
                    backend="reference", total_timesteps=num_envs * num_steps, d_model=8, n_layers=1, d_state=4,
                    track=False, checkpoint_every=0, checkpoint_dir=tmp, runs_dir=tmp, env_backend=backend, seed=seed)
    agent = RecurrentPPO(config=cfg)
    real = agent.actor
    actions = np.random.default_rng(seed).integers(0, 2, size=(num_steps, num_envs, 1))

    class _RandomActor:  # the Actor protocol with no policy behind it
        stager, stepper, env_arrays = real.stager, real.stepper, real.env_arrays

        def begin(self):
            pass

        def act(self, t):
            return actions[t]

        def finish(self):
            pass

    loop = []
    for _ in range(rollouts + 1):
        res = collect_rollout(agent.envs, _RandomActor(), agent.carry, num_steps, False, seed, lambda: 0)
        loop.append(1e3 * (res.rollout_ms - res.env_ms) / num_steps)
    agent.close()
    return {"loop_us": statistics.median(loop[1:]), "loop_us_per_env": statistics.median(loop[1:]) / num_envs}


def _probe_cost_us(calls: int = 20000) -> float:
    """µs one timing probe adds to a step (a probe over a trivial env against the trivial env alone)."""
    import gymnasium as gym

    class _Null(gym.Env):
        observation_space = action_space = gym.spaces.Discrete(2)

        def step(self, action):
            return 0, 0.0, False, False, {}

    env, probed = _Null(), _probe_env(_Null(), _Timer("probe"))
    t0 = time.perf_counter()
    for _ in range(calls):
        env.step(0)
    t1 = time.perf_counter()
    for _ in range(calls):
        probed.step(0)
    t2 = time.perf_counter()
    return 1e6 * ((t2 - t1) - (t1 - t0)) / calls


def agent_sps(num_envs: int, updates: int, num_steps: int, device: str, dtype: str, async_envs: bool,
              d_model: int, n_layers: int, seed: int = 0, env_backend: str = "gymnasium",
              env_overlap: str = "auto") -> dict:
    """RecurrentPPO training SPS and its rollout / update split over ``updates`` updates after one
    warm-up update (graph capture happens in the constructor, outside the timing); ``env_overlap``: PPOConfig's
    (the two-halves rollout, ``env_parts`` in the result says whether it ran)."""
    from mamba_rl.agents import PPOConfig, RecurrentPPO

    tmp = tempfile.mkdtemp(prefix="mamba_rl_sps_")
    cfg = PPOConfig(env_id="CartPole-v1", num_envs=num_envs, num_steps=num_steps, device=device, dtype=dtype,
                    seed=seed, total_timesteps=(updates + 1) * num_envs * num_steps, track=False, async_envs=async_envs,
                    checkpoint_every=0, checkpoint_dir=tmp, runs_dir=tmp, d_model=d_model, n_layers=n_layers,
                    env_backend=env_backend, env_overlap=env_overlap)
    t0 = time.perf_counter()
    agent = RecurrentPPO(config=cfg)
    build_s = time.perf_counter() - t0
    env_ms: list[float] = []
    act_s = [0.0]
    act = agent.actor.act

    def timed_act(t, part=0):  # the policy step as the loop sees it: stage copy, replay, the wait for the action
        a0 = time.perf_counter()
        out = act(t, part)
        act_s[0] += time.perf_counter() - a0
        return out

    agent.actor.act = timed_act
    agent.learn(total_timesteps=num_envs * num_steps)  # warm-up update
    agent.config = cfg  # restore the full horizon (lr annealing as in a real run)
    _sync(device)
    act_s[0] = 0.0
    last = [0.0]

    def after_update(a, m):  # the update's metrics were read back (its one sync): the update is done
        env_ms.append(a.last_env_ms)
        last[0] = time.perf_counter()

    t0 = time.perf_counter()
    agent.learn(callback=after_update)
    _sync(device)
    t_end = time.perf_counter()
    hist = agent.history[1:]
    n = len(hist)
    steps = n * num_envs * num_steps
    rollout_ms = sum(h["perf/rollout_ms"] for h in hist) / n
    update_ms = sum(h["perf/update_ms"] for h in hist) / n
    # learn() ends with a checkpoint save holding every env's recurrent state (~59 KB per env at the default
    # model; learn()'s time beyond its rollouts and updates was 0.25 s at 1024 envs and 0.85 s at 4096 on the
    # H200 host); a run pays it once, not per update, so agent_sps is timed to the end of the last update and
    # the save is reported beside it
    out = {"agent_sps": steps / (last[0] - t0), "agent_sps_with_final_save": steps / (t_end - t0),
           "final_save_s": t_end - last[0],
           "agent_rollout_sps": num_envs * num_steps / (rollout_ms / 1e3),
           "agent_updates": n, "agent_build_s": build_s,
           "rollout_ms_per_update": rollout_ms, "env_ms_per_update": sum(env_ms) / n,
           "host_overhead_us": 1e3 * (rollout_ms - sum(env_ms) / n) / num_steps,
           "act_us": 1e6 * act_s[0] / (n * num_steps),
           "loop_us_in_agent": 1e3 * (rollout_ms - sum(env_ms) / n) / num_steps - 1e6 * act_s[0] / (n * num_steps),
           "update_ms_per_update": update_ms, "update_ms_per_2048": update_ms * 2048 / (num_envs * num_steps),
           "final_losses": {k: hist[-1][k] for k in ("losses/value_loss", "losses/policy_loss", "losses/entropy")},
           "backend": agent.policy.net.backend, "cuda_graphs": agent.config.cuda_graphs and agent.device.type == "cuda",
           "host_copies_in_graph": bool(getattr(agent.actor, "copies_in_graph", False)),
           "env_overlap": env_overlap, "env_parts": len(agent.actor.parts)}
    agent.close()
    return out


def gae_times(num_envs: int, num_steps: int, device: str, reps: int = 20) -> dict:
    """Median ms of one GAE over [num_envs, num_steps]: device (parallel) vs host (step loop, CPU tensors)."""
    from mamba_rl.agents.gae import compute_gae, compute_gae_parallel, gae_discount_matrix

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(num_envs, num_steps, generator=g), torch.randn(num_envs, num_steps, generator=g),
            torch.rand(num_envs, num_steps, generator=g) < 0.02, torch.rand(num_envs, num_steps, generator=g) < 0.01,
            torch.ones(num_envs, num_steps, dtype=torch.bool), torch.randn(num_envs, generator=g)]

    def median_ms(fn, dev):
        ts = []
        for _ in range(reps):
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    dargs = [a.to(device) for a in args]
    disc = gae_discount_matrix(num_steps, 0.99, 0.95, device)
    return {"gae_device_ms": median_ms(lambda: compute_gae_parallel(*dargs, 0.99, 0.95, disc, check=False), device),
            "gae_host_ms": median_ms(lambda: compute_gae(*args, 0.99, 0.95), "cpu")}


def sb3_sps(num_envs: int, updates: int, num_steps: int, device: str, async_envs: bool, seed: int = 0,
            threads: int | None = None):
    """sb3-contrib RecurrentPPO (MlpLstmPolicy, LSTM 128) SPS, or None when sb3_contrib is missing.

    ``threads``: torch CPU threads while it runs (restored after; None: leave torch's setting)."""
    try:
        from sb3_contrib import RecurrentPPO as SB3RecurrentPPO
        from stable_baselines3.common.env_util import make_vec_env as sb3_make_vec_env
        from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv
    except ImportError:
        return None
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _sb3_run(SB3RecurrentPPO, sb3_make_vec_env, SubprocVecEnv if async_envs else DummyVecEnv, num_envs,
                        updates, num_steps, device, seed)
    finally:
        torch.set_num_threads(before)


def _sb3_run(algo, make, vec_env_cls, num_envs: int, updates: int, num_steps: int, device: str, seed: int) -> float:
    """SPS of ``updates`` sb3-contrib updates of ``num_envs`` x ``num_steps`` after one warm-up update."""
    env = make("CartPole-v1", n_envs=num_envs, seed=seed, vec_env_cls=vec_env_cls)
    model = algo("MlpLstmPolicy", env, n_steps=num_steps, batch_size=num_envs * num_steps // 4,
                 n_epochs=4, learning_rate=2.5e-4, policy_kwargs=dict(lstm_hidden_size=128), device=device,
                 seed=seed, verbose=0)
    model.learn(total_timesteps=num_envs * num_steps)  # warm-up
    total = updates * num_envs * num_steps
    _sync(device)
    t0 = time.perf_counter()
    model.learn(total_timesteps=total, reset_num_timesteps=False)
    _sync(device)
    dt = time.perf_counter() - t0
    env.close()
    return total / dt


def _updates_for(num_envs: int, requested: int | None) -> int:
    """Measured updates of a row: ``requested``, else 8 up to 64 envs, 4 up to 256, 2 up to 1024, then 1
    (each is num_envs x num_steps env steps: 1 update of 4096 envs is 524,288)."""
    if requested is not None:
        return requested
    return 8 if num_envs <= 64 else (4 if num_envs <= 256 else (2 if num_envs <= 1024 else 1))


def _fmt(row: dict, key: str, spec: str, missing: str = "-") -> str:
    value = row.get(key)
    return missing if value is None else format(value, spec)


def _table(results: list[dict]) -> str:
    head = ("| backend | envs | bare env SPS | our env SPS | ours/bare | agent SPS | agent/our env | agent/bare |"
            " sb3 SPS | agent/sb3 | host us/step | of it act us | update ms/2048 |")
    lines = [head, "|" + "---|" * 13]
    for r in results:
        backend = r["env_backend"] + (f" {r['dtype']}" if r.get("dtype", "f32") != "f32" else "") + \
            (" halves" if r.get("env_parts", 1) > 1 else "")
        lines.append(" | ".join(["", backend, str(r["num_envs"]), _fmt(r, "bare_env_sps", ",.0f"),
                                 _fmt(r, "raw_env_sps", ",.0f"), _fmt(r, "raw_over_bare", ".2f"),
                                 _fmt(r, "agent_sps", ",.0f"), _fmt(r, "agent_fraction_of_raw", ".2f"),
                                 _fmt(r, "agent_fraction_of_bare", ".2f"),
                                 _fmt(r, "sb3_sps", ",.0f", r.get("sb3_note", "-")),
                                 _fmt(r, "agent_vs_sb3", ".1f") + ("x" if r.get("agent_vs_sb3") else ""),
                                 _fmt(r, "host_overhead_us", ".0f"), _fmt(r, "act_us", ".0f"),
                                 _fmt(r, "update_ms_per_2048", ".2f"), ""]).strip())
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="f32")
    p.add_argument("--envs", type=int, nargs="+", default=[16, 64, 256, 1024], help="env counts (one row each)")
    p.add_argument("--updates", type=int, default=None,
                   help="measured PPO updates per row (default 8 up to 64 envs, 4 up to 256, 2 up to 1024, 1 above)")
    p.add_argument("--num-steps", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=3)
    p.add_argument("--raw-steps", type=int, default=100_000,
                   help="env steps per round of the bare / our env rates (min 20 per env)")
    p.add_argument("--env-rounds", type=int, default=5, help="alternating bare / ours rounds per env rate")
    p.add_argument("--min-iters", type=int, default=20, help="at least this many vector steps per round of a rate")
    p.add_argument("--env-backend", nargs="+", default=None, choices=("gymnasium", "envpool"),
                   help="env backends, one set of rows each (default: gymnasium, plus envpool when installed)")
    p.add_argument("--env-only", action="store_true", help="only the env rates and profiles (no training, no sb3)")
    p.add_argument("--no-profile", action="store_true", help="skip the per-layer profile of a vector step")
    p.add_argument("--profile-backend", nargs="+", default=None, choices=("gymnasium", "envpool"),
                   help="profile (env_profile, loop_us) only these backends' rows (default: every row)")
    p.add_argument("--async-envs", action="store_true", help="gymnasium AsyncVectorEnv (shared memory) everywhere")
    p.add_argument("--no-sb3", action="store_true", help="skip sb3-contrib even if installed")
    p.add_argument("--sb3-max-envs", type=int, default=64, help="skip sb3-contrib above this many envs (too slow)")
    p.add_argument("--sb3-threads", type=int, default=2,
                   help="torch CPU threads while sb3-contrib runs (0: leave torch's default)")
    p.add_argument("--env-overlap", nargs="+", default=["auto"], choices=("auto", "on", "off"),
                   help="EnvPool rows: one row per mode (PPOConfig.env_overlap: the two-halves rollout)")
    p.add_argument("--bf16-envs", type=int, nargs="*", default=[],
                   help="extra EnvPool rows at these env counts with --dtype bf16 (after the others)")
    p.add_argument("--out", "--json", dest="out", default=None, help="write the JSON here")
    p.add_argument("--nproc", type=int, default=1,
                   help="> 1: data-parallel SPS of N ranks x --envs envs (torchrun) next to 1 process (sps_ddp.py)")
    a = p.parse_args(argv)
    if a.env_backend is None:
        from mamba_rl.envs import envpool_available

        a.env_backend = ["gymnasium"] + (["envpool"] if envpool_available() else [])
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    if a.nproc > 1:
        return _ddp(a, device)

    modes = {"gymnasium": ["auto"], "envpool": a.env_overlap}
    rows = [(backend, n, a.dtype, m) for backend in a.env_backend for n in a.envs for m in modes[backend]]
    if "envpool" in a.env_backend:
        rows += [("envpool", n, "bf16", m) for n in a.bf16_envs for m in a.env_overlap]
    results: list[dict] = []
    for backend, n, dtype, overlap in rows:
        results.append(_row(a, backend, n, device, dtype, overlap))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        _write(_report(a, device, results), a.out, "sps.json", quiet=True)  # what is done survives a timeout
    report = _report(a, device, results)
    print(report["table"], file=sys.stderr)
    print(json.dumps(report["must_show"], indent=1), file=sys.stderr)
    _write(report, a.out, "sps.json")
    return report


def _report(a: argparse.Namespace, device: str, results: list[dict]) -> dict:
    """The JSON report of the rows measured so far."""
    return {
        "benchmark": "CartPole-v1 end-to-end SPS (RecurrentPPO on the Mamba backbone vs raw env vs sb3-contrib)",
        "device": device, "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
        "torch": torch.__version__, "python": platform.python_version(), "dtype": a.dtype,
        "numpy": np.__version__, "gymnasium": _version("gymnasium"), "envpool": _version("envpool"),
        "sb3_contrib": _version("sb3_contrib"),
        "model": {"d_model": a.d_model, "n_layers": a.n_layers, "d_state": 16},
        "targets": {"raw_over_bare": "gymnasium: >= 0.8 at 64 envs and above",
                    "agent_sps": "envpool: >= 300,000 at its best env count, >= 0.6 of EnvPool's own rate (bare_env_sps)",
                    "agent_fraction_of_raw": ">= 0.5 at 16 and 64 envs", "agent_vs_sb3": ">= 30 at 16 and 64 envs",
                    "host_overhead_us": "<= 100 at 16 envs", "update_ms_per_2048": "<= 15"},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "args": {k: v for k, v in vars(a).items() if k != "out"},
        "results": results, "table": _table(results), "must_show": must_show(results),
    }


def _row(a: argparse.Namespace, backend: str, n: int, device: str, dtype: str, overlap: str = "auto") -> dict:
    """One row: the env rates (bare library env and ours, alternating), the profile, training SPS, GAE, sb3."""
    row = {"env_backend": backend, "num_envs": n, "num_steps": a.num_steps, "async_envs": a.async_envs, "dtype": dtype}
    row.update(env_rates(n, max(a.raw_steps, a.min_iters * n), backend, a.async_envs, rounds=a.env_rounds,
                         min_iters=a.min_iters))
    first_mode = backend != "envpool" or overlap == a.env_overlap[0]  # one profile per env count
    if not a.no_profile and not a.async_envs and first_mode and \
            (a.profile_backend is None or backend in a.profile_backend):
        row["env_profile"] = env_profile(n, max(a.raw_steps // 2, 20 * n), backend)
        row.update(loop_overhead_us(n, backend, num_steps=32, rollouts=2))
    if a.env_only:
        return row
    row.update(agent_sps(n, _updates_for(n, a.updates), a.num_steps, device, dtype, a.async_envs, a.d_model,
                         a.n_layers, env_backend=backend, env_overlap=overlap))
    row.update(gae_times(n, a.num_steps, device))
    row["sb3_sps"] = None
    if a.no_sb3:
        row["sb3_note"] = "skipped (--no-sb3)"
    elif backend != "gymnasium" or dtype != a.dtype:
        row["sb3_note"] = "gymnasium rows only"
    elif n > a.sb3_max_envs:
        row["sb3_note"] = f"skipped (> {a.sb3_max_envs} envs: too slow)"
    else:
        row["sb3_sps"] = sb3_sps(n, 2, a.num_steps, device, a.async_envs, threads=a.sb3_threads or None)
        row["sb3_threads"] = a.sb3_threads or torch.get_num_threads()
        if row["sb3_sps"] is None:
            row["sb3_note"] = "sb3_contrib not installed"
    row["agent_fraction_of_raw"] = row["agent_sps"] / row["raw_env_sps"]
    row["agent_fraction_of_bare"] = row["agent_sps"] / row["bare_env_sps"]
    row["agent_vs_sb3"] = row["agent_sps"] / row["sb3_sps"] if row["sb3_sps"] else None
    return row


def must_show(results: list[dict]) -> dict:
    """The throughput targets read off the rows: the gymnasium path's ours / bare from 64 envs on (>= 0.8), the
    EnvPool path's best agent SPS (>= 300,000) and its agent / bare there (>= 0.6), and agent / sb3-contrib."""
    out: dict = {}
    gym_rows = [r for r in results if r["env_backend"] == "gymnasium" and r["num_envs"] >= 64]
    if gym_rows:
        out["gymnasium_raw_over_bare_from_64"] = {r["num_envs"]: round(r["raw_over_bare"], 3) for r in gym_rows}
        out["gymnasium_raw_over_bare_met"] = all(r["raw_over_bare"] >= 0.8 for r in gym_rows)
    pool = [r for r in results if r["env_backend"] == "envpool" and r.get("agent_sps")]
    for label, rows in (("envpool", [r for r in pool if r.get("dtype") == "f32"]),
                        ("envpool_bf16", [r for r in pool if r.get("dtype") == "bf16"])):
        if rows:
            best = max(rows, key=lambda r: r["agent_sps"])
            out[label] = {"best_num_envs": best["num_envs"], "env_parts": best.get("env_parts", 1),
                          "agent_sps": round(best["agent_sps"]),
                          "bare_env_sps": round(best["bare_env_sps"]),
                          "agent_over_bare": round(best["agent_sps"] / best["bare_env_sps"], 3),
                          "sps_met": best["agent_sps"] >= 300_000,
                          "ratio_met": best["agent_sps"] / best["bare_env_sps"] >= 0.6}
    sb3 = [r for r in results if r.get("sb3_sps")]
    if sb3:
        out["agent_vs_sb3"] = {r["num_envs"]: {"agent_sps": round(r["agent_sps"]), "sb3_sps": round(r["sb3_sps"]),
                                               "ratio": round(r["agent_vs_sb3"], 1)} for r in sb3}
    return out


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - not installed or no version: say None
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def _ddp(a: argparse.Namespace, device: str) -> dict:
    """``--nproc N``: one row per ``--envs`` value from benchmarks/sps_ddp.py (N ranks vs 1 process)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sps_ddp import compare

    rows = []
    for n in a.envs:
        rows.append(compare(a.nproc, n, a.updates or 8, a.num_steps, device, a.dtype, a.d_model, a.n_layers,
                            agent_sps))
        r = rows[-1]
        print(f"{a.nproc} ranks x {n} envs: {r['ddp_sps']:,.0f} SPS (sum over ranks) vs 1 x {n} envs: "
              f"{r['single_sps']:,.0f} SPS -> {r['speedup']:.2f}x (target {r['speedup_target']})",
              file=sys.stderr, flush=True)
    report = {"benchmark": f"CartPole-v1 data-parallel SPS, {a.nproc} ranks vs 1", "results": rows}
    _write(report, a.out, "sps_ddp.json")
    return report


def _write(report: dict, out: str | None, name: str, quiet: bool = False) -> None:
    text = json.dumps(report, indent=2)
    if not quiet:
        print(text)
    paths = [out] if out else []
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], name))
    for path in dict.fromkeys(os.path.abspath(x) for x in paths):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
