"""Agent checkpoints: one safetensors file plus JSON metadata; the env pickle is read only on request.

A checkpoint is a folder holding:

* ``agent.safetensors``: one :func:`mamba_rl.save_checkpoint` file: backbone weights, AdamW moments,
  step and scaler; heads, head Adam moments, RNG states and the carried rollout state (stepper
  state, next obs, starts, dones, previous action/reward) as extra tensors; PPOConfig, counters,
  numpy RNG state and observation/reward normalisation statistics as JSON metadata.
* ``envs.pkl``: the vector env mid-episode (SyncVectorEnv stacks that pickle, no video), so that a
  resumed run can continue the very same trajectories. It is a pickle, so it is never read unless
  asked for (``RecurrentPPO.load(restore_envs=True)``, ``mamba-rl train --resume PATH --resume-envs``),
  for checkpoints you trust. Everything else is safetensors + JSON.

Data-parallel runs (:mod:`mamba_rl.agents.distributed`): rank 0 writes the checkpoint; its carry and
RNG states are rank 0's. It resumes on any world size: weights, both optimizers, counters and the
minibatch RNG load on every rank; the per-rank envs, carry and sampling RNGs are re-created (the
envs are rebuilt and reset with each rank's seeds), never restored.

:func:`save_agent` and :func:`restore_agent` take the agent's parts (config, run, progress, policy,
trainer, head optimizer, sampling RNGs, stepper, rollout carry, envs) as typed arguments; the agent
(``ppo.py``, above this module) builds itself and hands them over.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from mamba_rl import MambaTrainer, Stepper, load_checkpoint, read_checkpoint, save_checkpoint
from mamba_rl.envs import find_vector_wrapper

from .config import PPOConfig
from .policy import Policy
from .rollout import RolloutCarry
from .runs import Progress, Run, adopt_run

__all__ = ["CHECKPOINT_FORMAT", "Rngs", "checkpoint_file", "read_agent_config", "save_agent", "restore_agent",
           "load_envs"]

CHECKPOINT_FORMAT = "mamba_rl.agents.RecurrentPPO/1"


@dataclass
class Rngs:
    """The generators of a run that checkpoints save: ``sample`` (the eager rollout's CPU sampling
    generator) and ``minibatch`` (numpy, the minibatch order). torch's global CPU generator and, on
    CUDA, the device's (the graph rollout samples with it) are saved with them."""

    sample: torch.Generator
    minibatch: np.random.Generator
_NORMS = (("obs_rms", gym.wrappers.vector.NormalizeObservation, "obs_rms"),
          ("return_rms", gym.wrappers.vector.NormalizeReward, "return_rms"))


def checkpoint_file(path: str | Path) -> Path:
    """``path/agent.safetensors`` for a folder, ``path`` itself for a file.

    Raises:
        FileNotFoundError: neither exists.
    """
    path = Path(path)
    f = path / "agent.safetensors" if path.is_dir() else path
    if not f.is_file():
        raise FileNotFoundError(f"no RecurrentPPO checkpoint at {path} (expected a folder holding "
                                f"agent.safetensors, or that file)")
    return f


def read_agent_config(path: str | Path, **overrides: Any) -> tuple[Path, PPOConfig]:
    """(the checkpoint file, its PPOConfig with ``overrides`` applied).

    Raises:
        FileNotFoundError: no checkpoint there. ValueError / mamba_rl.CheckpointError:
        not a RecurrentPPO checkpoint.
    """
    ckpt = checkpoint_file(path)
    meta, _ = read_checkpoint(ckpt)
    extra = meta.get("extra", {})
    if extra.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{ckpt}: expected checkpoint format {CHECKPOINT_FORMAT!r}, got {extra.get('format')!r}")
    config = PPOConfig.from_dict(extra["ppo_config"])
    if overrides:
        config = config.replace(**overrides)
    return ckpt, config


def load_envs(env_file: Path) -> gym.vector.VectorEnv:
    """Unpickle a saved vector env (trusted checkpoints only)."""
    with open(env_file, "rb") as f:
        return pickle.load(f)


def _rms(envs: gym.vector.VectorEnv, wrapper: type, attr: str) -> dict[str, Any] | None:
    w = find_vector_wrapper(envs, wrapper)
    if w is None:
        return None
    rms = getattr(w, attr)
    return {"mean": np.asarray(rms.mean).tolist(), "var": np.asarray(rms.var).tolist(), "count": float(rms.count)}


def _extra_tensors(policy: Policy, head_optimizer: torch.optim.Optimizer, rngs: Rngs, stepper: Stepper,
                   carry: RolloutCarry) -> dict[str, torch.Tensor]:
    t: dict[str, torch.Tensor] = {f"heads/{k}": v for k, v in policy.heads.state_dict().items()}
    for idx, st in head_optimizer.state_dict()["state"].items():
        for key, v in st.items():
            t[f"head_optimizer/{idx}/{key}"] = torch.as_tensor(v)
    t["rng/sample_generator"] = rngs.sample.get_state()
    t["rng/torch"] = torch.get_rng_state()
    if policy.device.type == "cuda":  # the graph-captured rollout samples with the device's generator
        t["rng/cuda"] = torch.cuda.get_rng_state(policy.device)
    t["carry/stepper_conv"] = stepper.state.conv
    t["carry/stepper_ssm"] = stepper.state.ssm
    for name in RolloutCarry.TENSORS:
        t[f"carry/{name}"] = getattr(carry, name)
    return t


def save_agent(path: str | Path, *, config: PPOConfig, run: Run, progress: Progress, policy: Policy,
               trainer: MambaTrainer, head_optimizer: torch.optim.Optimizer, rngs: Rngs, stepper: Stepper,
               carry: RolloutCarry, envs: gym.vector.VectorEnv,
               world_size: int = 1) -> tuple[Path, Exception | None]:
    """Write an agent, given as its parts, into the folder ``path`` (see the module doc).

    Args:
        world_size: ranks of the run (informative: a checkpoint loads on any world size).

    Returns:
        (``path`` as a Path, the error that kept the envs from being pickled, or None).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    opt_sd = head_optimizer.state_dict()
    extra = {"format": CHECKPOINT_FORMAT, "ppo_config": config.to_dict(), "run_name": run.name,
             "global_step": progress.global_step, "update": progress.update, "input_dim": policy.input_dim,
             "obs_dim": policy.obs_dim, "obs_rms": _rms(envs, *_NORMS[0][1:]),
             "return_rms": _rms(envs, *_NORMS[1][1:]), "env_started": carry.started,
             "np_rng": rngs.minibatch.bit_generator.state,
             "head_optimizer_param_groups": opt_sd["param_groups"],
             "head_optimizer_state_keys": {str(k): sorted(v) for k, v in opt_sd["state"].items()},
             "recent_returns": [float(r) for r in progress.recent_returns],
             "world_size": world_size}
    save_checkpoint(str(path / "agent.safetensors"), trainer, extra=extra,
                    extra_tensors=_extra_tensors(policy, head_optimizer, rngs, stepper, carry))
    env_file = path / "envs.pkl"
    if carry.started and isinstance(envs.unwrapped, gym.vector.SyncVectorEnv) and not config.capture_video:
        try:
            blob = pickle.dumps(envs)
        except Exception as err:  # lambdas in wrappers (e.g. FlattenObservation), third-party envs
            return path, err
        with open(path / "envs.pkl.tmp", "wb") as f:
            f.write(blob)
        os.replace(path / "envs.pkl.tmp", env_file)
    elif env_file.exists():
        env_file.unlink()
    return path, None


def restore_agent(ckpt: Path, *, run: Run, progress: Progress, policy: Policy, trainer: MambaTrainer,
                  head_optimizer: torch.optim.Optimizer, rngs: Rngs, stepper: Stepper, carry: RolloutCarry,
                  envs: gym.vector.VectorEnv, restore_carry: bool) -> None:
    """Load the checkpoint file ``ckpt`` into a freshly built agent's parts (built from its config), in place.

    Args:
        restore_carry: ``envs`` are the checkpoint's own (unpickled): also restore the stepper state and
            the rollout carry. Otherwise the envs are fresh: restore their normalisation statistics.

    Raises:
        mamba_rl.CheckpointError: a checkpoint that does not fit the agent.
    """
    meta = load_checkpoint(ckpt, trainer)
    extra = meta["extra"]
    dev = policy.device
    t = {k: v.to(dev) for k, v in meta["extra_tensors"].items()}
    policy.heads.load_state_dict({k[len("heads/"):]: v for k, v in t.items() if k.startswith("heads/")})
    opt_state = {int(idx): {key: t[f"head_optimizer/{idx}/{key}"] for key in keys}
                 for idx, keys in extra["head_optimizer_state_keys"].items()}
    for st in opt_state.values():
        if "step" in st:
            st["step"] = st["step"].cpu()
    head_optimizer.load_state_dict({"state": opt_state, "param_groups": extra["head_optimizer_param_groups"]})
    rngs.sample.set_state(meta["extra_tensors"]["rng/sample_generator"])
    torch.set_rng_state(meta["extra_tensors"]["rng/torch"])
    if dev.type == "cuda" and "rng/cuda" in meta["extra_tensors"]:
        torch.cuda.set_rng_state(meta["extra_tensors"]["rng/cuda"], dev)
    rngs.minibatch.bit_generator.state = extra["np_rng"]
    adopt_run(run, extra["run_name"])  # a resumed run writes into its own folders, on purpose
    progress.global_step = int(extra["global_step"])
    progress.update = int(extra["update"])
    progress.recent_returns.extend(extra.get("recent_returns", []))
    if restore_carry:
        stepper.state.conv.copy_(t["carry/stepper_conv"])
        stepper.state.ssm.copy_(t["carry/stepper_ssm"])
        for name in RolloutCarry.TENSORS:
            setattr(carry, name, t[f"carry/{name}"].cpu().clone())  # host-side, like the rollout
        carry.started = bool(extra["env_started"])
        return
    for key, wrapper, attr in _NORMS:
        w = find_vector_wrapper(envs, wrapper)
        if w is not None and extra.get(key) is not None:
            rms = getattr(w, attr)
            rms.mean = np.asarray(extra[key]["mean"], dtype=np.float64).reshape(np.shape(rms.mean))
            rms.var = np.asarray(extra[key]["var"], dtype=np.float64).reshape(np.shape(rms.var))
            rms.count = extra[key]["count"]
