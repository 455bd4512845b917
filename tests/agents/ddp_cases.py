"""Workers of the data-parallel tests (tests/agents/test_ddp.py), one function per spawned rank.

Each worker joins the group through :func:`mamba_rl.agents.distributed.init_from_env` (the env vars
torchrun would set) and writes what it saw to ``out/rank{r}.pt`` for the parent to compare.
"""

from __future__ import annotations

import os

import torch

TINY = dict(env_id="CartPole-v1", num_envs=4, num_steps=16, num_minibatches=2, update_epochs=2, d_model=16,
            n_layers=2, d_state=4, seed=7, total_timesteps=10_000, checkpoint_every=0)


def fake_rollout(agent, total_envs: int, offset: int, seed: int) -> None:
    """Fill ``agent.buffer`` with rows ``offset..offset+num_envs`` of a fixed rollout of ``total_envs`` envs
    (the same tensors whatever the split), so an update is compared on identical data."""
    b, c = agent.buffer, agent.config
    g = torch.Generator().manual_seed(seed)
    n, t = total_envs, c.num_steps
    rows = slice(offset, offset + c.num_envs)
    full = {
        "inputs": torch.randn(n, t, agent.policy.input_dim, generator=g),
        "episode_starts": torch.rand(n, t, generator=g) < 0.1,
        "actions": torch.randint(0, 2, (n, t, 1), generator=g),
        "logprobs": torch.log(torch.full((n, t), 0.5)) + 0.1 * torch.randn(n, t, generator=g),
        "values": torch.randn(n, t, generator=g),
        "advantages": torch.randn(n, t, generator=g) + 0.3,
        "returns": torch.randn(n, t, generator=g),
        "valid": torch.rand(n, t, generator=g) > 0.15,
    }
    for k, v in full.items():
        dst = getattr(b, k)
        dst.copy_(v[rows].to(dst.dtype))
    st = b.initial_state
    for buf in (st.conv, st.ssm):
        full_state = torch.randn((buf.shape[0], n) + tuple(buf.shape[2:]), generator=g)
        buf.copy_(full_state[:, rows].to(buf.dtype))
    if b.aux:  # the two-horizon critic's columns (drawn after the others, which stay as they were)
        aux = {"aux_values": torch.randn(n, t, generator=g),
               "aux_advantages": (torch.randn(n, t, generator=g) * 0.3 + 0.1) * full["valid"],
               "aux_returns": torch.randn(n, t, generator=g)}
        for k, v in aux.items():
            getattr(b, k).copy_(v[rows])


def flat_state(agent) -> torch.Tensor:
    """Backbone weights + AdamW moments + head weights as one flat float32 tensor."""
    tr = agent.trainer
    parts = [agent.policy.net.arena, tr.exp_avg, tr.exp_avg_sq] + [p.detach().reshape(-1) for p in agent.policy.heads.parameters()]
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in parts])


def _join(rank: int, world: int, port: int, device: str, timeout_s: float = 120, backend: str | None = None,
          local_rank: int | None = None) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank if local_rank is None else local_rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from mamba_rl.agents.distributed import init_from_env

    assert init_from_env(device, timeout_s=timeout_s, backend=backend)


def _leave() -> None:
    """End a rank that finished its work: meet the other ranks, destroy the group, and leave the process
    without interpreter finalisation. A rank that tears down while its peer is still inside the last
    collective, or a gloo worker thread that drops the last reference to a tensor while the interpreter is
    finalising (it then needs the GIL and is ended with pthread_exit through a noexcept frame), aborts the
    process with "terminate called without an active exception" (seen in CI in a rank that had written its
    results). The results are on disk before this is called; an exception in the body skips it and ends the
    rank with its traceback through torch.multiprocessing as before."""
    import sys

    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def update_worker(rank: int, world: int, port: int, out: str, device: str, updates: int, extra: dict | None = None) -> None:
    """``updates`` PPO updates on fixed rollouts; checks bit-identical state across ranks after each. ``extra``:
    more PPOConfig fields (e.g. the two-horizon critic's)."""
    import torch.distributed as dist

    from mamba_rl.agents import PPOConfig, RecurrentPPO

    _join(rank, world, port, device)
    try:
        agent = RecurrentPPO(config=PPOConfig(**TINY, device=device, runs_dir=os.path.join(out, "runs"),
                                              checkpoint_dir=os.path.join(out, "ckpt"), **(extra or {})))
        init = flat_state(agent)
        metrics, same = [], []
        for u in range(updates):
            fake_rollout(agent, world * agent.config.num_envs, rank * agent.config.num_envs, seed=100 + u)
            metrics.append(agent.update_policy())
            same.append(agent.dp.check_identical(flat_state(agent).to(agent.device)))
        torch.save({"init": init, "final": flat_state(agent), "metrics": metrics, "same": same},
                   os.path.join(out, f"rank{rank}.pt"))
        agent.close()
        _leave()
    finally:
        dist.destroy_process_group()


def learn_worker(rank: int, world: int, port: int, out: str, device: str, resume: str | None,
                 total: int) -> None:
    """``learn`` to ``total`` env steps (all ranks), from scratch or from the checkpoint ``resume``."""
    import torch.distributed as dist

    from mamba_rl.agents import PPOConfig, RecurrentPPO

    _join(rank, world, port, device)
    try:
        kw = dict(runs_dir=os.path.join(out, "runs"), checkpoint_dir=os.path.join(out, "ckpt"),
                  total_timesteps=total, device=device)
        if resume is None:
            agent = RecurrentPPO(config=PPOConfig(**dict(TINY, **kw)))
        else:
            agent = RecurrentPPO.load(resume, **kw)
        start = flat_state(agent)
        agent.learn()
        same = agent.dp.check_identical(flat_state(agent).to(agent.device))
        torch.save({"start": start, "final": flat_state(agent), "same": same, "update": agent.update,
                    "global_step": agent.global_step, "run": agent.run_name,
                    "root": str(agent.checkpoint_root)}, os.path.join(out, f"learn{rank}.pt"))
        agent.close()
        _leave()
    finally:
        dist.destroy_process_group()


def hang_worker(rank: int, world: int, port: int, out: str, hang_s: float) -> None:
    """Rank 1 hangs (sleeps ``hang_s``) instead of joining an all-reduce; rank 0 records the error it gets
    and after how long (the group timeout is 3 s)."""
    import time

    import torch.distributed as dist

    _join(rank, world, port, "cpu", timeout_s=3)
    if rank == 1:
        time.sleep(hang_s)
        os._exit(0)
    t0 = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1))
        err = None
    except Exception as e:  # noqa: BLE001 - the test looks at what it was
        err = f"{type(e).__name__}: {e}"
    torch.save({"err": err, "dt": time.perf_counter() - t0}, os.path.join(out, "hang.pt"))
    os._exit(0)


def mismatch_worker(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 asks for other num_envs than rank 0: both must refuse with a ValueError at start."""
    from mamba_rl.agents import PPOConfig, RecurrentPPO

    _join(rank, world, port, "cpu", timeout_s=30)
    try:
        RecurrentPPO(config=PPOConfig(**dict(TINY, num_envs=4 if rank == 0 else 2), device="cpu",
                                      runs_dir=os.path.join(out, "runs"), checkpoint_dir=os.path.join(out, "ckpt")))
        err = None
    except ValueError as e:
        err = str(e)
    torch.save({"err": err}, os.path.join(out, f"mismatch{rank}.pt"))
    _leave()  # both ranks raised after the config exchange and meet once more before the teardown


def normalize_obs_worker(rank: int, world: int, port: int, out: str) -> None:
    """``learn`` 2 updates with ``normalize_obs`` (and the default NormalizeReward); records every raw batch
    each rank fed its observation statistics and the statistics every rank ends with."""
    import gymnasium as gym
    import numpy as np
    import torch.distributed as dist

    from mamba_rl.agents import PPOConfig, RecurrentPPO
    from mamba_rl.envs import find_vector_wrapper

    _join(rank, world, port, "cpu")
    try:
        cfg = PPOConfig(**dict(TINY, total_timesteps=2 * world * 64, normalize_obs=True), device="cpu",
                        runs_dir=os.path.join(out, "runs"), checkpoint_dir=os.path.join(out, "ckpt"), track=False)
        agent = RecurrentPPO(config=cfg)
        rms = find_vector_wrapper(agent.envs, gym.wrappers.vector.NormalizeObservation).obs_rms
        batches, update = [], rms.update

        def record(x):
            batches.append(np.array(x))  # as given (float32: gymnasium takes its batch moments in it)
            update(x)
        rms.update = record
        agent.learn()
        ret = find_vector_wrapper(agent.envs, gym.wrappers.vector.NormalizeReward).return_rms
        torch.save({"mean": np.array(rms.mean), "var": np.array(rms.var), "count": float(rms.count),
                    "batches": batches, "ret": (float(ret.mean), float(ret.var), float(ret.count))},
                   os.path.join(out, f"norm{rank}.pt"))
        agent.close()
        _leave()
    finally:
        dist.destroy_process_group()


BUGGY_ENV_ID = "mamba_rl_test/BuggyCartPole-v1"
BUG_AT_STEP = 12  # env steps per sub-env: inside the second rollout (8 steps each)


def make_buggy_cartpole(**kwargs):
    """CartPole whose step raises ValueError at step ``BUG_AT_STEP``: a deliberate bug mid-training."""
    import gymnasium as gym

    class BuggyCartPole(gym.Wrapper):
        steps = 0

        def step(self, action):
            self.steps += 1
            if self.steps == BUG_AT_STEP:
                raise ValueError(f"deliberate bug at env step {self.steps}")
            return self.env.step(action)

    return BuggyCartPole(gym.make("CartPole-v1", **kwargs))


def register_buggy_env() -> None:
    """Register ``BUGGY_ENV_ID`` (idempotent). Runs when this module is imported, so the id also works as
    ``tests.agents.ddp_cases:mamba_rl_test/BuggyCartPole-v1`` in a subprocess (module:EnvId)."""
    import gymnasium as gym

    if BUGGY_ENV_ID not in gym.registry:
        gym.register(BUGGY_ENV_ID, entry_point=make_buggy_cartpole, max_episode_steps=500)


register_buggy_env()


def cli_bug_worker(rank: int, world: int, port: int, out: str) -> None:
    """``mamba-rl train`` on one rank of a gloo job (as under torchrun) whose env raises ValueError mid-training:
    records whether ``main`` returned (and what) or raised, with the traceback, and the CLI's stderr."""
    import contextlib
    import io
    import traceback

    from mamba_rl.agents.cli import main

    register_buggy_env()
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    argv = ["train", "--env-id", BUGGY_ENV_ID, "--num-envs", "2", "--num-steps", "8", "--num-minibatches", "1",
            "--update-epochs", "1", "--d-model", "8", "--n-layers", "1", "--d-state", "2", "--device", "cpu",
            "--total-timesteps", str(4 * world * 2 * 8), "--seed", "3", "--no-track", "--no-progress",
            "--checkpoint-dir", os.path.join(out, f"ckpt{rank}"), "--runs-dir", os.path.join(out, "runs")]
    stderr = io.StringIO()
    result = {"returned": None, "raised": None, "traceback": None}
    with contextlib.redirect_stderr(stderr):
        try:
            result["returned"] = main(argv)
        except Exception as err:  # noqa: BLE001 - the test looks at what it was
            result["raised"] = type(err).__name__
            result["traceback"] = traceback.format_exc()
    result["stderr"] = stderr.getvalue()
    torch.save(result, os.path.join(out, f"bug{rank}.pt"))
    os._exit(0)  # main destroyed the group; no interpreter finalisation (see _leave)


def split_graph_worker(rank: int, world: int, port: int, out: str) -> None:
    """Every rank on the one GPU (gloo over CUDA tensors): 2 updates with the captured three-phase minibatch
    and 2 with eager minibatches, from the same seed on the same fixed rollouts; records both states."""
    import torch.distributed as dist

    from mamba_rl.agents import PPOConfig, RecurrentPPO

    _join(rank, world, port, "cuda", backend="gloo", local_rank=0)
    try:
        res = {}
        for graphs in (True, False):
            agent = RecurrentPPO(config=PPOConfig(**TINY, device="cuda", cuda_graphs=graphs,
                                                  runs_dir=os.path.join(out, f"runs{graphs}"),
                                                  checkpoint_dir=os.path.join(out, f"ckpt{graphs}")))
            up = agent.updater
            res[graphs] = {"captured": "gather" in up._graphs, "capture_error": up.capture_error, "metrics": []}
            for u in range(2):
                fake_rollout(agent, world * agent.config.num_envs, rank * agent.config.num_envs, seed=100 + u)
                res[graphs]["metrics"].append(agent.update_policy())
            res[graphs]["final"] = flat_state(agent)
            agent.close()
        torch.save(res, os.path.join(out, f"split{rank}.pt"))
        _leave()
    finally:
        dist.destroy_process_group()


def captured_hang_worker(rank: int, world: int, port: int, out: str, hang_s: float) -> None:
    """Both ranks build a graph-captured agent (gloo over CUDA tensors, one GPU); rank 1 then hangs instead
    of updating. Rank 0's update must end in an error within the group timeout (10 s), not hang."""
    import time

    from mamba_rl.agents import PPOConfig, RecurrentPPO

    _join(rank, world, port, "cuda", timeout_s=10, backend="gloo", local_rank=0)
    agent = RecurrentPPO(config=PPOConfig(**TINY, device="cuda", runs_dir=os.path.join(out, f"runs{rank}"),
                                          checkpoint_dir=os.path.join(out, f"ckpt{rank}")))
    captured = "gather" in agent.updater._graphs
    if rank == 1:
        time.sleep(hang_s)
        os._exit(0)
    fake_rollout(agent, world * agent.config.num_envs, 0, seed=100)
    t0 = time.perf_counter()
    try:
        agent.update_policy()
        err = None
    except Exception as e:  # noqa: BLE001 - the test looks at what it was
        err = f"{type(e).__name__}: {e}"
    torch.save({"err": err, "dt": time.perf_counter() - t0, "captured": captured}, os.path.join(out, "chang.pt"))
    os._exit(0)
