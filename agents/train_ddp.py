"""``mamba-rl train`` data-parallel: the ``--nproc`` launcher and the per-rank body under torchrun.

``mamba-rl train --nproc 2 --num-envs 64`` runs ``torchrun --standalone --nproc-per-node 2 -m mamba_rl train
--num-envs 64`` (64 envs per rank). Each rank joins the group from torchrun's environment
(:func:`mamba_rl.agents.distributed.init_from_env`, called by the CLI) and runs :func:`train_rank`.
Multi-node: call torchrun yourself with its rendezvous flags (README, "Data-parallel training").
"""

from __future__ import annotations

import sys
from typing import Any, Callable, ContextManager, Sequence

__all__ = ["launch", "train_rank"]


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
        if lead:
            c = agent.config
            print(f"run {agent.run_name}: {c.env_id}, {agent.world_size} ranks x {c.num_envs} envs, device "
                  f"{agent.device}, backend {dist.get_backend()}; {agent.num_updates} updates of "
                  f"{agent.world_size * c.batch_size} env steps", file=sys.stderr)
        try:
            agent.learn(progress=lead and progress)
        except KeyboardInterrupt:
            if lead:
                ckpt = agent.interrupted_checkpoint
                print(f"\ninterrupted after update {agent.update}; " + (
                    f"checkpoint: {ckpt}" if ckpt is not None else "nothing was saved (see above)"), file=sys.stderr)
            agent.close()
            return 130
        if lead:
            print(f"checkpoint: {agent.checkpoint_root / 'final'}")
        agent.close()
        return 0
    finally:
        dist.destroy_process_group()
