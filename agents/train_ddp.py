"""``mamba-rl train`` data-parallel: the ``--nproc`` launcher and the per-rank body under torchrun.

``mamba-rl train --nproc 2 --num-envs 64`` runs ``torchrun --standalone --nproc-per-node 2 -m mamba_rl train
--num-envs 64`` (64 envs per rank). Each rank joins the group from torchrun's environment
(:func:`mamba_rl.agents.distributed.init_from_env`, called by the CLI) and runs :func:`train_rank`.
Multi-node: call torchrun yourself with its rendezvous flags (README, "Data-parallel training").
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, ContextManager, Sequence

__all__ = ["exit_rank", "launch", "train_rank"]


def launch(nproc: int, cli_argv: Sequence[str]) -> int:
    """``mamba-rl train --nproc N ARGS`` = ``torchrun --standalone --nproc-per-node N -m mamba_rl train ARGS``
    (``cli_argv``: the command line after ``mamba-rl``, ``--nproc`` dropped here). Returns the exit code:
    0, 130 on Ctrl-C (rank 0 saved ``interrupted``), 1 when a rank failed (torchrun printed its error)."""
    from torch.distributed import run as torchrun

    argv, skip = [], False
    for a in cli_argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            argv.append(a)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        torchrun.main(["--standalone", "--nproc-per-node", str(nproc), "-m", "mamba_rl", *argv])
    except (KeyboardInterrupt, SignalException):  # torchrun passed the signal on as SIGTERM; rank 0 saved
        return 130
    except Exception as err:  # torchrun's ChildFailedError has already printed the failing rank's traceback
        print(f"mamba-rl train: error: a rank failed ({type(err).__name__})", file=sys.stderr)
        return 1
    return 0


def train_rank(resume: str | None, overrides: dict[str, Any], progress: bool,
               checkpoint_input: Callable[[], ContextManager[None]]) -> int:
    """One rank of ``torchrun -m mamba_rl train`` (the process group is initialised, the config validated):
    build or resume the agent, learn, destroy the group. Rank 0 prints, logs and checkpoints.
    ``checkpoint_input``: the CLI's context that turns a refused checkpoint into its one-line error; it
    covers the load alone, so an error while training keeps its traceback and ends the rank with a non-2
    exit code. Returns the exit code (130 on Ctrl-C)."""
    import torch.distributed as dist

    from mamba_rl.agents import RecurrentPPO

    try:
        with checkpoint_input():
            agent = (RecurrentPPO.load(resume, restore_envs=False, **overrides) if resume
                     else RecurrentPPO(**overrides))
        lead = agent.rank == 0
        c = agent.config
        if lead:
            W = agent.world_size
            print(f"run {agent.run_name}: {c.env_id}, {c.backbone.layer}, {W} ranks x {c.num_envs} envs, device "
                  f"{agent.device}, dtype {c.dtype}, backend {agent.policy.net.backend}, process group "
                  f"{dist.get_backend()}; "
                  f"{agent.num_updates} updates of {W}x{c.num_envs}x{c.num_steps} = "
                  f"{agent.num_updates * W * c.batch_size:,} env steps", file=sys.stderr)
        start, start_step = time.perf_counter(), agent.global_step
        try:
            agent.learn(progress=lead and progress)
        except KeyboardInterrupt:
            if lead:
                ckpt = agent.interrupted_checkpoint
                why = ("the interrupted checkpoint could not be written (see above)" if agent.stop_save_error
                       else "the run stopped before its training loop began")
                print(f"\ninterrupted after update {agent.update}; " + (
                    f"checkpoint: {ckpt}" if ckpt is not None else f"nothing was saved: {why}"), file=sys.stderr)
            agent.close()
            return 130
        if lead:
            recent = list(agent.recent_returns)
            if recent:
                print(f"mean return of rank 0's last {len(recent)} episodes: {sum(recent) / len(recent):.2f}",
                      file=sys.stderr)
            print(f"done: {agent.global_step:,} env steps ({agent.global_step - start_step:,} in this session, all "
                  f"ranks) in {time.perf_counter() - start:.0f} s", file=sys.stderr)
            print(f"checkpoint: {agent.checkpoint_root / 'final'}")
        agent.close()
        try:  # no rank tears its pairs down while a peer is still inside the last collective
            dist.barrier()
        except KeyboardInterrupt:  # this rank had finished (rank 0 saved final); a peer had not
            print(f"\nrank {agent.rank}: interrupted while waiting for the other ranks to finish; this rank had "
                  f"finished" + (f" and saved {agent.checkpoint_root / 'final'}" if lead else ""), file=sys.stderr)
            return 130
        return 0
    finally:
        dist.destroy_process_group()


def exit_rank(code: int) -> None:
    """End a torchrun rank's process (``python -m mamba_rl`` with ``WORLD_SIZE`` > 1) with exit code ``code``
    after :func:`train_rank` returned: flush stdout / stderr and leave without interpreter finalisation.

    gloo's worker threads can drop the last reference to a tensor while the interpreter finalises; that
    needs the GIL, the thread is ended with pthread_exit through a noexcept frame, and the process aborts
    ("terminate called without an active exception", SIGABRT), which torchrun reports as a failed rank
    after a run that finished and saved. Everything the run writes is closed by then (``agent.close()``)."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
