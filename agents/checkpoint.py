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

A folder is written as a whole (:func:`save_agent`): both files go into a new sibling folder
``.tmp-<name>-<random>``, are fsynced, and only then does that folder take the place of ``<name>`` (the
previous one is renamed ``.old-<name>-<random>`` and removed after the swap). A save that is killed
leaves the previous checkpoint as it was; the temporaries it left are removed by the next save of that
folder. ``agent.safetensors`` records the SHA-256 of the ``envs.pkl`` written with it, so a folder whose
two files come from different saves is refused at load (:func:`check_envs_file`). A save refuses
weights or optimizer moments holding NaN / inf (:class:`NonFiniteWeightsError`), and the JSON metadata is
made JSON-safe (a NaN episode return or normalisation statistic is stored as the string "nan").
Both files are created with mode 0o666 minus the umask.

Data-parallel runs (:mod:`mamba_rl.agents.distributed`): rank 0 writes the checkpoint; its carry and
RNG states are rank 0's. It resumes on any world size: weights, both optimizers, counters and the
minibatch RNG load on every rank; the per-rank envs, carry and sampling RNGs are re-created (the
envs are rebuilt and reset with each rank's seeds), never restored.

:func:`save_agent` and :func:`restore_agent` take the agent's parts (config, run, progress, policy,
trainer, head optimizer, sampling RNGs, stepper, rollout carry, envs) as typed arguments; the agent
(``ppo.py``, above this module) builds itself and hands them over.

The two-horizon critic (``PPOConfig.aux_gamma``) adds a head, ``heads/aux_critic.linear.*``, and its head
Adam moments; a checkpoint with it resumes only into a config with an ``aux_gamma`` and one without it only
into a config without (:func:`restore_agent` says so before loading anything; the aux discount itself may
change on resume, as ``gamma`` may). The action-set loss (``PPOConfig.action_set_coef`` > 0) adds the head
``heads/action_set.*`` likewise: its coefficient may change on resume, not whether it is 0. Every other head
whose saved shape differs from the policy's (another action space) is refused the same way, and
``RecurrentPPO.load`` refuses a ``joint_action`` other than the saved one (the same width can mean other actions).
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import secrets
import shutil
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from mamba_rl import MambaTrainer, Stepper, load_checkpoint, read_checkpoint, save_checkpoint
from mamba_rl.train.checkpoint import CheckpointError, fsync_path, is_save_temporary, remove_stale_temporaries
from mamba_rl.envs import find_vector_wrapper

from .config import PPOConfig
from .policy import Policy
from .rollout import RolloutCarry
from .runs import Progress, Run, adopt_run

__all__ = ["CHECKPOINT_FORMAT", "Rngs", "checkpoint_file", "read_agent_meta", "agent_config", "read_agent_config",
           "save_agent", "restore_agent", "load_envs", "check_envs_file", "NonFiniteWeightsError", "json_safe"]

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
_OURS = ("agent.safetensors", "envs.pkl")


class NonFiniteWeightsError(ValueError):
    """A save refused: the agent's weights or optimizer moments hold NaN / inf (nothing was written)."""


def json_safe(x: Any) -> Any:
    """``x`` with every non-finite float replaced by its string ("nan", "inf", "-inf") and numpy scalars /
    arrays turned into Python numbers / lists, so that ``json.dumps(..., allow_nan=False)`` takes it.
    ``float(s)`` and ``np.asarray(..., dtype=float)`` read the strings back."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, np.ndarray):
        return json_safe(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def checkpoint_file(path: str | Path) -> Path:
    """``path/agent.safetensors`` for a folder, ``path`` itself for a ``.safetensors`` file.

    Raises:
        FileNotFoundError: neither exists.
        mamba_rl.CheckpointError: ``path`` is a file of another kind (e.g. the folder's ``envs.pkl``).
    """
    path = Path(path)
    _recover_swap(path)
    f = path / "agent.safetensors" if path.is_dir() else path
    if not f.is_file():
        raise FileNotFoundError(f"no RecurrentPPO checkpoint at {path} (expected a folder holding "
                                f"agent.safetensors, or that file)")
    if f.suffix != ".safetensors":
        raise CheckpointError(f"{path} is not a RecurrentPPO checkpoint: expected its folder or the folder's "
                              f"agent.safetensors, got a {f.suffix or 'suffix-less'} file")
    return f


def read_agent_meta(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(the checkpoint file, its RecurrentPPO metadata: the ``extra`` dict :func:`save_agent` wrote).

    Raises:
        FileNotFoundError: no checkpoint there. ValueError / mamba_rl.CheckpointError:
        not a RecurrentPPO checkpoint.
    """
    ckpt = checkpoint_file(path)
    meta, _ = read_checkpoint(ckpt)
    extra = meta.get("extra", {})
    if extra.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{ckpt}: expected checkpoint format {CHECKPOINT_FORMAT!r}, got {extra.get('format')!r}")
    return ckpt, extra


def agent_config(extra: dict[str, Any], **overrides: Any) -> PPOConfig:
    """The PPOConfig saved in ``extra`` (:func:`read_agent_meta`) with ``overrides`` applied. Raises
    :class:`mamba_rl.CheckpointError` when the saved config itself is refused (a value no run could have saved:
    an edited or damaged file), so that the error names the checkpoint, not a flag the user did not pass."""
    from mamba_rl.train.checkpoint import CheckpointError

    try:
        config = PPOConfig.from_dict(extra["ppo_config"])
    except (ValueError, TypeError) as err:
        why = str(err).replace("PPOConfig.", "")  # a field of the file, not a flag of this command
        raise CheckpointError(f"the checkpoint's saved config is refused: {why}; was the file edited?") from err
    return config.replace(**overrides) if overrides else config


def read_agent_config(path: str | Path, **overrides: Any) -> tuple[Path, PPOConfig]:
    """(the checkpoint file, its PPOConfig with ``overrides`` applied); raises as :func:`read_agent_meta`."""
    ckpt, extra = read_agent_meta(path)
    return ckpt, agent_config(extra, **overrides)


def load_envs(env_file: Path) -> gym.vector.VectorEnv:
    """Unpickle a saved vector env (trusted checkpoints only; check it first with :func:`check_envs_file`)."""
    with open(env_file, "rb") as f:
        return pickle.load(f)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_envs_file(ckpt: Path, env_file: Path) -> None:
    """Refuse an ``envs.pkl`` that was not written by the same save as ``ckpt`` (its agent.safetensors),
    before anything is unpickled. Checkpoints older than this check (no digest recorded) pass.

    Raises:
        mamba_rl.CheckpointError: envs.pkl is not the file that save wrote: damaged (truncated, edited) or
            from another save (a save killed half-way by an older version, files copied by hand).
    """
    from safetensors import safe_open
    import json

    with safe_open(str(ckpt), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("mamba_rl", "{}"))
    extra = meta.get("extra", {})
    if "envs_pkl_sha256" not in extra:
        return
    want, got = extra["envs_pkl_sha256"], _sha256(env_file)
    if want != got:
        what = "no envs.pkl" if want is None else f"an envs.pkl with SHA-256 {want[:12]}..."
        raise CheckpointError(
            f"{env_file}: this envs.pkl (SHA-256 {got[:12]}...) is not the one saved with {ckpt.name} "
            f"(update {extra.get('update')}, global step {extra.get('global_step')}), which recorded {what}: "
            f"the file is damaged (e.g. truncated) or the folder mixes two saves. Refusing to resume the envs "
            f"from it; resume without --resume-envs "
            f"(the envs are rebuilt and reset) or from a complete checkpoint")


def _check_finite(policy: Policy, trainer: MambaTrainer, progress: Progress, path: Path) -> None:
    parts = {"backbone weights": policy.net.arena, "backbone AdamW moments": torch.cat(
        [trainer.exp_avg.reshape(-1), trainer.exp_avg_sq.reshape(-1)])}
    parts["head weights"] = torch.cat([p.detach().reshape(-1) for p in policy.heads.parameters()])
    for name, t in parts.items():
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise NonFiniteWeightsError(
                f"refusing to save {path}: the {name} hold {bad} non-finite values (NaN/inf) of {t.numel()} after "
                f"update {progress.update} (global step {progress.global_step}); expected finite values. Nothing was "
                f"written: a checkpoint already there is left in place")


def _adopt_foreign(old: Path, new: Path) -> None:
    """Move what the user put into a checkpoint folder (e.g. eval videos) from ``old`` into ``new``."""
    for entry in os.listdir(old):
        if entry in _OURS or entry.startswith(".tmp-"):
            continue
        if not (new / entry).exists():
            os.rename(old / entry, new / entry)


def _recover_swap(path: Path) -> None:
    """A save killed between its two renames left ``path`` missing and the previous folder as
    ``.old-<name>-*``: put the newest complete one back. With ``path`` present, the ``.old-*`` folders
    are leftovers: what the user added to them moves into ``path``, the rest is removed."""
    parent, name = path.parent, path.name
    try:
        olds = sorted((parent / e for e in os.listdir(parent) if is_save_temporary(e, f".old-{name}-")),
                      key=lambda p: p.stat().st_mtime, reverse=True)
    except (FileNotFoundError, NotADirectoryError):
        return
    if not olds:
        return
    if not path.exists():
        for old in olds:
            if (old / "agent.safetensors").is_file():
                os.rename(old, path)
                olds.remove(old)
                break
    if path.is_dir():
        for old in olds:
            _adopt_foreign(old, path)
            shutil.rmtree(old, ignore_errors=True)


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
            # a copy: a FlatHeadAdam's per-parameter states are views of its arenas (one shared step count),
            # which safetensors refuses to write as several tensors
            t[f"head_optimizer/{idx}/{key}"] = torch.as_tensor(v).clone()
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
    """Write an agent, given as its parts, into the folder ``path`` as a whole (see the module doc).

    Args:
        world_size: ranks of the run (informative: a checkpoint loads on any world size).

    Returns:
        (``path`` as a Path, the error that kept the envs from being pickled, or None).

    Raises:
        NonFiniteWeightsError: the weights or optimizer moments hold NaN / inf; nothing is written.
        NotADirectoryError: ``path`` exists and is not a folder.
        OSError: the write failed; the previous checkpoint at ``path`` (if any) is left in place.
    """
    path = Path(path)
    _check_finite(policy, trainer, progress, path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"checkpoint path {path} exists and is not a folder")
    parent, name = path.parent, path.name
    parent.mkdir(parents=True, exist_ok=True)
    _recover_swap(path)
    remove_stale_temporaries(parent, f".tmp-{name}-")  # what a killed save of this folder left behind
    blob, err = None, None
    if carry.started and isinstance(envs.unwrapped, gym.vector.SyncVectorEnv) and not config.capture_video:
        try:
            blob = pickle.dumps(envs)
        except Exception as e:  # lambdas in wrappers (e.g. FlattenObservation), third-party envs
            err = e
    opt_sd = head_optimizer.state_dict()
    extra = {"format": CHECKPOINT_FORMAT, "ppo_config": config.to_dict(), "run_name": run.name,
             "global_step": progress.global_step, "update": progress.update, "input_dim": policy.input_dim,
             "obs_dim": policy.obs_dim, "obs_rms": _rms(envs, *_NORMS[0][1:]),
             "return_rms": _rms(envs, *_NORMS[1][1:]), "env_started": carry.started,
             "np_rng": rngs.minibatch.bit_generator.state,
             "head_optimizer_param_groups": opt_sd["param_groups"],
             "head_optimizer_state_keys": {str(k): sorted(v) for k, v in opt_sd["state"].items()},
             "recent_returns": [float(r) for r in progress.recent_returns],
             "world_size": world_size,
             "envs_pkl_sha256": hashlib.sha256(blob).hexdigest() if blob is not None else None}
    if progress.lr_plan is not None:
        extra["lr_plan"] = list(progress.lr_plan)
    tmp = parent / f".tmp-{name}-{secrets.token_hex(6)}"
    os.mkdir(tmp)
    try:
        save_checkpoint(str(tmp / "agent.safetensors"), trainer, extra=json_safe(extra),
                        extra_tensors=_extra_tensors(policy, head_optimizer, rngs, stepper, carry))
        if blob is not None:
            with open(tmp / "envs.pkl", "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
        fsync_path(tmp)
        if path.exists():  # keep the previous folder until the new one is complete, then swap
            old = parent / f".old-{name}-{secrets.token_hex(6)}"
            os.rename(path, old)
            os.rename(tmp, path)
            fsync_path(parent)
            _adopt_foreign(old, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
            fsync_path(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path, err


def _check_layout(ckpt: Path, policy: Policy) -> None:
    """Refuse a checkpoint whose aux critic head (``PPOConfig.aux_gamma``) or action-set head
    (``action_set_coef``) is present where ``policy`` has none, or absent where it has one, whose backbone
    config differs from the policy's (``d_model`` and the rest), whose other heads differ in shape (another
    action space), or whose ``time_encoding`` (input width) differs from the policy's,
    before anything is loaded (read from the file's metadata: the saved config, and the tensors' shapes).

    Raises:
        mamba_rl.CheckpointError: naming the saved and the current setting and the flag to pass.
    """
    import json

    from safetensors import safe_open

    with safe_open(str(ckpt), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("mamba_rl", "{}"))
        saved_aux = any(k.startswith("extra/heads/aux_critic.") for k in f.keys())
        heads = {k[len("extra/heads/"):]: tuple(f.get_slice(k).get_shape()) for k in f.keys()
                 if k.startswith("extra/heads/")}
    saved_gamma = meta.get("extra", {}).get("ppo_config", {}).get("aux_gamma")
    have = policy.aux_critic is not None
    if saved_aux != have:
        if saved_aux:
            why = (f"was saved with the two-horizon critic (aux_gamma {saved_gamma!r}: an aux critic head), but the "
                   f"config to load it into has aux_gamma None; resume with an aux_gamma (--aux-gamma "
                   f"{saved_gamma if saved_gamma is not None else 0.9}), or start a new run without it")
        else:
            why = ("was saved without the two-horizon critic (aux_gamma None: no aux critic head), but the config to "
                   "load it into has an aux_gamma; resume without it (--aux-gamma none), or start a new run with it")
        raise CheckpointError(f"checkpoint {ckpt} {why}")
    saved_set = any(k.startswith("action_set.") for k in heads)
    if saved_set != (policy.action_set is not None):
        coef = meta.get("extra", {}).get("ppo_config", {}).get("action_set_coef", 0.0)
        raise CheckpointError(
            f"checkpoint {ckpt} was saved {'with' if saved_set else 'without'} the action-set head (action_set_coef "
            f"{coef!r}), but the config to load it into has action_set_coef "
            f"{'0' if saved_set else '> 0'}; resume with --action-set-coef {coef if saved_set else 0}, or start a new run")
    saved_net, my_net = meta.get("config") or {}, policy.net.cfg.to_dict()
    other = [k for k in saved_net if k in my_net and saved_net[k] != my_net[k]]
    if other:  # before the heads: a d_model of another size also changes their input width
        raise CheckpointError(
            f"checkpoint {ckpt} holds a backbone with {', '.join(f'{k} {saved_net[k]!r}' for k in other)}, but the "
            f"config to load it into has {', '.join(f'{k} {my_net[k]!r}' for k in other)}; resume without "
            f"{', '.join('--' + k.replace('_', '-') for k in other)} (the checkpoint's backbone is kept), or start "
            f"a new run")
    mine = {k: tuple(v.shape) for k, v in policy.heads.state_dict().items()}
    differ = sorted(k for k in mine if k in heads and heads[k] != mine[k])
    if differ:
        cfg = meta.get("extra", {}).get("ppo_config", {})
        raise CheckpointError(f"checkpoint {ckpt}: its heads {', '.join(f'{k} {list(heads[k])}' for k in differ)} do "
                              f"not fit this policy's ({', '.join(f'{k} {list(mine[k])}' for k in differ)}): another "
                              f"action space (saved with env_id {cfg.get('env_id')!r}); resume with the checkpoint's env")
    saved_k = meta.get("extra", {}).get("ppo_config", {}).get("time_encoding", 0)
    if saved_k != policy.time_encoding:
        raise CheckpointError(f"checkpoint {ckpt} was saved with time_encoding {saved_k} (an input of "
                              f"{2 * saved_k} time columns), but the config to load it into has time_encoding "
                              f"{policy.time_encoding}; resume with --time-encoding {saved_k}")


def restore_agent(ckpt: Path, *, run: Run, progress: Progress, policy: Policy, trainer: MambaTrainer,
                  head_optimizer: torch.optim.Optimizer, rngs: Rngs, stepper: Stepper, carry: RolloutCarry,
                  envs: gym.vector.VectorEnv, restore_carry: bool) -> None:
    """Load the checkpoint file ``ckpt`` into a freshly built agent's parts (built from its config), in place.

    Args:
        restore_carry: ``envs`` are the checkpoint's own (unpickled): also restore the stepper state and
            the rollout carry. Otherwise the envs are fresh: restore their normalisation statistics.

    Raises:
        mamba_rl.CheckpointError: a checkpoint that does not fit the agent, e.g. one saved with the two-horizon
            critic's aux head (or the action-set head) into an agent without one, or the other way round, with
            heads of other shapes, or with another time encoding (nothing is loaded then).
    """
    _check_layout(ckpt, policy)
    # the trainer was built from the checkpoint's config plus the user's overrides (--adam-eps, --max-grad-norm,
    # --dtype, ...): it keeps its own settings (the agent sets the lr every update)
    meta = load_checkpoint(ckpt, trainer, settings="trainer")
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
    progress.recent_returns.extend(float(r) for r in extra.get("recent_returns", []))
    if "lr_plan" in extra:
        progress.lr_plan = tuple(float(v) for v in extra["lr_plan"])
    else:  # older checkpoints: the plan of the saved run (linear from update 1 to its last update)
        saved = PPOConfig.from_dict(extra["ppo_config"])
        world = int(extra.get("world_size", 1))
        progress.lr_plan = (1.0, 1.0, float(-(-saved.total_timesteps // (saved.batch_size * world)) + 1))
    if restore_carry:
        stepper.state.conv.copy_(t["carry/stepper_conv"])
        stepper.state.ssm.copy_(t["carry/stepper_ssm"])
        for name in RolloutCarry.TENSORS:
            if f"carry/{name}" in t:  # host-side, like the rollout
                setattr(carry, name, t[f"carry/{name}"].cpu().clone())
            elif name != "episode_step":  # from before the time encoding (no input reads it there): zeros
                raise KeyError(f"carry/{name}")
        carry.started = bool(extra["env_started"])
        return
    for key, wrapper, attr in _NORMS:
        w = find_vector_wrapper(envs, wrapper)
        if w is not None and extra.get(key) is not None:
            rms = getattr(w, attr)
            rms.mean = np.asarray(extra[key]["mean"], dtype=np.float64).reshape(np.shape(rms.mean))
            rms.var = np.asarray(extra[key]["var"], dtype=np.float64).reshape(np.shape(rms.var))
            rms.count = float(extra[key]["count"])
