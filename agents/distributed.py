"""Data-parallel recurrent PPO over ``torch.distributed``.

Every rank runs a whole :class:`~mamba_rl.agents.RecurrentPPO`: its own ``num_envs`` envs (``num_envs``
is per rank; env seeds start at ``seed + rank * num_envs``, so rank r's envs are envs
``r*num_envs .. (r+1)*num_envs - 1`` of one process with ``world * num_envs`` envs), its own rollout,
its own minibatch slice. Weights start identical (same config seed, then broadcast from rank 0) and
stay bit-identical because every rank applies the same optimizer step to the same summed gradient.

Per minibatch step (:class:`~mamba_rl.agents.update.PPOUpdate`; on CUDA its three phases are graphs and
these all-reduces run eagerly between their replays):

1. one all-reduce of [sum adv, sum adv^2, valid count] (float64, :meth:`DataParallel.minibatch_sums`,
   :meth:`DataParallel.finish_stats`):
   advantages are normalised with the *global* minibatch mean/std and every rank's loss is its share
   of the global masked mean (its sums / the global count), so the sum over ranks of the gradients is
   exactly the gradient of the one-process minibatch of ``world * envs_per_minibatch`` envs;
2. after the backbone backward and before the clip: ONE all-reduce (SUM)
   of [backbone gradient arena | heads' flat gradient] (``PPOUpdate.comm``, :meth:`reduce_grads`);
   the global clip, AdamW, the f16 scaler's overflow check and the head Adam then see the same numbers
   on every rank.

Once per update, after the rollout: the envs' running normalisation statistics (``--normalize-obs``'s
NormalizeObservation, NormalizeReward's return statistics) are merged over the ranks
(:class:`RunningStatsSync`, one float64 all-reduce), so every rank normalises with the statistics of all
ranks' samples, as one process with all the envs would.

Once per update: the metric table is summed over ranks (the losses are partial sums of the global
mean), and rank 0 gathers every rank's finished episodes and SPS (:meth:`gather_episodes`). Rank 0
alone writes TensorBoard and checkpoints.

Backends: NCCL on CUDA, gloo on the CPU (:func:`init_from_env`); the code path is the same.
Failures: ``init_process_group(timeout=...)`` bounds every collective; with NCCL,
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` turns a hung or dead peer into an error within that timeout, and
torchrun tears the other ranks down when one exits.
"""

from __future__ import annotations

import datetime
import math
import os
import signal
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist

from .devices import resolve_device

__all__ = ["world_size", "rank", "init_from_env", "DataParallel", "shard_permutation", "RunningStatsSync"]


def world_size() -> int:
    """Ranks of the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def init_from_env(device: str = "auto", timeout_s: float = 600.0, backend: str | None = None) -> bool:
    """Join the job torchrun described in the environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT``), when ``WORLD_SIZE`` > 1 and no group exists yet.

    NCCL when the job runs on CUDA (``device`` "cuda"/"auto" with CUDA present; the current device
    becomes ``cuda:LOCAL_RANK``), gloo otherwise. SIGTERM (torchrun stopping the job, Ctrl-C on the
    launcher) is raised as KeyboardInterrupt so that rank 0 saves its ``interrupted`` checkpoint.

    Args:
        device: the PPOConfig device ("auto" | "cpu" | "cuda[:i]").
        timeout_s: bound on every collective [s]; a peer that hangs or died ends the job with an error.
        backend: "nccl" or "gloo" to choose; None: NCCL on CUDA, gloo otherwise. gloo on CUDA runs every
            rank's collectives through the host (slow), e.g. several ranks sharing one GPU in a test.

    Returns:
        True when this process is (now) one rank of a group of more than one.

    Raises:
        RuntimeError: ``WORLD_SIZE`` not an integer, or > 1 without ``RANK`` / ``MASTER_ADDR`` (not launched
            by torchrun), or more local ranks than visible GPUs.
        ValueError: ``device`` asks for CUDA on a machine without it (:func:`~mamba_rl.agents.devices.resolve_device`),
            ``backend`` is not one of None, "nccl", "gloo" (checked with or without a job), "nccl" without
            CUDA, or ``timeout_s`` is not a finite number > 0.
    """
    # the arguments' own values first, so a bad one is an error on one process as on many
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"init_from_env: backend must be None, 'gloo' or ('nccl' on CUDA), got {backend!r} "
                         f"with device {device!r}")
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s)
            or timeout_s <= 0):
        raise ValueError(f"init_from_env: timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(raw)
    except ValueError:
        raise RuntimeError(f"WORLD_SIZE must be an integer number of ranks (torchrun sets it), got {raw!r}") from None
    if world <= 1:
        return False
    for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise RuntimeError(f"WORLD_SIZE={world} but {key} is not set: launch with torchrun "
                               f"(or mamba-rl train --nproc N)")
    cuda = resolve_device(device).type == "cuda"
    if backend == "nccl" and not cuda:
        raise ValueError(f"init_from_env: backend must be None, 'gloo' or ('nccl' on CUDA), got {backend!r} "
                         f"with device {device!r}")
    backend = backend or ("nccl" if cuda else "gloo")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    kw: dict[str, Any] = {}
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} GPUs are visible")
        torch.cuda.set_device(local)
        if backend == "nccl":
            kw["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    return dist.get_world_size() > 1


def _raise_interrupt(signum: int, frame: Any) -> None:  # noqa: ARG001 - signal handler signature
    raise KeyboardInterrupt(f"signal {signum}")


def shard_permutation(rng: np.random.Generator, num_envs: int, num_minibatches: int, shards: int = 1) -> torch.Tensor:
    """One epoch's minibatch rows [num_minibatches, num_envs // num_minibatches] (int64).

    ``shards`` = 1 is a plain permutation of the envs (what every rank draws for its own envs).
    ``shards`` = W lays a one-process run over W*n envs out as W ranks of n would: one permutation p
    of n is drawn (the same draw a rank makes) and minibatch k is ``[p_k, n + p_k, ..., (W-1)n + p_k]``,
    where p_k is chunk k of p, so minibatch k holds exactly the envs the W ranks' minibatch k hold.

    Args:
        rng: a ``numpy.random.Generator`` (one ``permutation`` call per epoch).

    Raises:
        ValueError: ``num_envs`` not divisible by ``shards``, or its shard by ``num_minibatches``.
    """
    if shards < 1 or num_envs % shards or (num_envs // shards) % num_minibatches:
        raise ValueError(f"shard_permutation: num_envs {num_envs} must split into {shards} shards of a "
                         f"multiple of num_minibatches {num_minibatches}")
    n = num_envs // shards
    p = torch.from_numpy(rng.permutation(n)).view(num_minibatches, n // num_minibatches)
    return torch.cat([p + s * n for s in range(shards)], dim=1)


class DataParallel:
    """The collectives of one agent's data-parallel PPO (default process group).

    Raises:
        RuntimeError: no initialised process group.
    """

    def __init__(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DataParallel: torch.distributed is not initialised (see init_from_env)")
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.backend = dist.get_backend()

    def check_same(self, what: str, value: Any) -> None:
        """Raise ValueError unless ``value`` (picklable, compared with ==) is the same on every rank: ranks
        with different configs would post collectives of different sizes and hang. One all_gather_object."""
        out: list = [None] * self.world
        dist.all_gather_object(out, value)
        bad = [r for r, v in enumerate(out) if v != out[0]]
        if bad:
            raise ValueError(f"data-parallel ranks disagree on {what}: rank 0 has {out[0]!r}, rank {bad[0]} has "
                             f"{out[bad[0]]!r} (every rank must run the same config)")

    @torch.no_grad()
    def broadcast_weights(self, tensors: list[torch.Tensor]) -> None:
        """Copy rank 0's ``tensors`` to every rank (once, at start: the seeds make them equal anyway)."""
        for t in tensors:
            dist.broadcast(t, src=0)

    @staticmethod
    @torch.no_grad()
    def minibatch_sums(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """This rank's [sum adv, sum adv^2, valid count] (float64 [3]) over its valid minibatch steps (``adv``,
        ``mask``: [rows, T] float32, mask 1 at valid steps), to be summed over the ranks and given to
        :meth:`finish_stats`. No collective (graph-capturable)."""
        m = mask.double()
        a = adv.double() * m
        return torch.stack([a.sum(), (a * adv.double()).sum(), m.sum()])

    @staticmethod
    @torch.no_grad()
    def finish_stats(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(count >= 1, mean, unbiased std) as 0-d float32 from :meth:`minibatch_sums` summed over the ranks.
        No collective (graph-capturable)."""
        count = buf[2].clamp_min(1.0)
        mean = buf[0] / count
        var = ((buf[1] - buf[0] * mean) / (count - 1.0).clamp_min(1.0)).clamp_min(0.0)
        return count.float(), mean.float(), var.sqrt().float()

    def reduce_grads(self, *flat: torch.Tensor) -> None:
        """Sum each flat gradient buffer over the ranks, in place (one all-reduce each)."""
        for t in flat:
            dist.all_reduce(t)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (SUM) ``t`` in place and return it."""
        dist.all_reduce(t)
        return t

    def gather_episodes(self, episodes: list, sps: float) -> tuple[list, float]:
        """Every rank's finished episodes (rank order) and the summed SPS: one all_gather_object."""
        out: list = [None] * self.world
        dist.all_gather_object(out, (episodes, float(sps)))
        return [e for eps, _ in out for e in eps], sum(s for _, s in out)

    def check_identical(self, t: torch.Tensor) -> bool:
        """True when ``t`` is bit-identical on every rank (all_gather; for tests and debugging)."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous())
        return all(torch.equal(parts[0], p) for p in parts[1:])


class RunningStatsSync:
    """Merge the running mean / variance statistics of a vector env's normalisation wrappers over the ranks.

    Every rank's ``RunningMeanStd`` (gymnasium: population variance, a prior count of 1e-4) starts an
    update from the same *base* (the statistics after the last merge) and adds its own samples. The merge
    sums each rank's additions to the base's moments about the base mean mu0 (count, count * (mean - mu0),
    count * (var + (mean - mu0)^2)), which is gymnasium's ``update_mean_var_count_from_moments`` applied to
    every rank's samples at once, exactly: ``count = c0 + sum_r (c_r - c0)``, ``mean = mu0 + S1 / count``,
    ``var = S2 / count - (S1 / count)^2``. One all-reduce of a float64 vector per :meth:`sync`.

    Args:
        envs: the vector env; its NormalizeObservation (``obs_rms``) and NormalizeReward (``return_rms``)
            wrappers are found inside it (none: :meth:`sync` does nothing).
    """

    def __init__(self, envs: gym.vector.VectorEnv) -> None:

        from mamba_rl.envs import find_vector_wrapper

        self.stats = []
        for wrapper, attr in ((gym.wrappers.vector.NormalizeObservation, "obs_rms"),
                              (gym.wrappers.vector.NormalizeReward, "return_rms")):
            w = find_vector_wrapper(envs, wrapper)
            if w is not None:
                self.stats.append(getattr(w, attr))
        self.rebase()

    def rebase(self) -> None:
        """Take the current statistics (equal on every rank) as the base of the next merge."""

        self.base = [(np.array(s.mean, dtype=np.float64), np.array(s.var, dtype=np.float64), float(s.count))
                     for s in self.stats]

    @staticmethod
    def _moments(mean, var, count, center):
        """[count, count * (mean - center), count * (var + (mean - center)^2)]: moments about the base mean
        ``center`` (small numbers, so the merge loses no precision to cancellation)."""

        dm = np.asarray(mean, np.float64).reshape(-1) - center
        var = np.asarray(var, np.float64).reshape(-1)
        return np.concatenate([[count], count * dm, count * (var + dm * dm)])

    @torch.no_grad()
    def sync(self, dp: "DataParallel") -> None:
        """All-reduce every rank's additions since the last merge and set the merged statistics on every
        rank (a collective: every rank calls it at the same point)."""

        if not self.stats:
            return
        parts = [self._moments(s.mean, s.var, s.count, b[0].reshape(-1)) - self._moments(*b, b[0].reshape(-1))
                 for s, b in zip(self.stats, self.base)]
        sizes = [p.size for p in parts]
        buf = torch.from_numpy(np.concatenate(parts))
        dev = torch.device("cuda", torch.cuda.current_device()) if dp.backend == "nccl" else torch.device("cpu")
        total = dp.sum_(buf.to(dev)).cpu().numpy()
        off = 0
        for s, b, n in zip(self.stats, self.base, sizes):
            d = total[off:off + n]
            off += n
            m = self._moments(*b, b[0].reshape(-1)) + d
            k = (n - 1) // 2
            count = float(m[0])
            dm = m[1:1 + k] / count
            mean = b[0].reshape(-1) + dm
            var = np.maximum(m[1 + k:] / count - dm * dm, 0.0)
            shape, dtype = np.shape(s.mean), np.asarray(s.mean).dtype  # gymnasium keeps the obs dtype (float32)
            s.mean, s.var, s.count = mean.reshape(shape).astype(dtype), var.reshape(shape).astype(dtype), count
        self.rebase()
