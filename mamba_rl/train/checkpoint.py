"""Checkpoints: tensors in safetensors, metadata in JSON, written atomically (temp file + rename). No pickle.

A checkpoint is one safetensors file whose header metadata holds one JSON document (key ``mamba_rl``):
format version, the MambaConfig, input_dim, the optimizer hyperparameters and step, the loss-scaler state,
and the caller's ``extra``. Tensors: ``master`` (the flat float32 weight arena), ``exp_avg``,
``exp_avg_sq`` (AdamW moments), ``state_conv`` / ``state_ssm`` (the trainer's carried recurrent state),
plus any tensors the caller passes in ``extra_tensors`` (prefixed ``extra/``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint", "validate_trainer_state", "FORMAT_VERSION",
           "CheckpointError", "fsync_path", "remove_stale_temporaries"]

FORMAT_VERSION = 1
_KEY = "mamba_rl"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read (truncated, corrupt, wrong format) or does not fit the trainer."""


def save_checkpoint(path, trainer, extra: dict | None = None, extra_tensors: dict | None = None) -> str:
    """Write ``trainer`` (weights, AdamW m and v, step, scaler, config, carried state) to ``path``.

    Args:
        path: file path (``.safetensors`` suggested); parent folders are created.
        trainer: a :class:`~mamba_rl.MambaTrainer`.
        extra: JSON-able dict stored in the metadata (e.g. the agent's counters and config).
        extra_tensors: name -> tensor stored beside the trainer's (e.g. head weights, RNG states).
    Returns:
        the path written. The write is atomic: a crash leaves the old file or none, never half a file
        (temp file ``.tmp-<name>-*`` in the same folder, fsync, rename, fsync of the folder); the
        temporaries a killed save left behind are removed by the next save of the same file. The file
        is created with mode 0o666 minus the umask, like any file the user writes.
    Raises:
        ValueError: ``extra`` is not a JSON-serialisable dict (NaN and inf are refused), or
            ``extra_tensors`` is not a str -> tensor dict.
    """
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"save_checkpoint: extra must be a JSON-able dict, got {type(extra).__name__}")
    for k, v in (extra_tensors or {}).items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise ValueError(f"save_checkpoint: extra_tensors must map str -> torch.Tensor, got {k!r} -> "
                             f"{type(v).__name__}")
    sd = trainer.state_dict()
    meta = dict(sd["meta"], format_version=FORMAT_VERSION, extra=extra or {})
    try:
        meta_json = json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"save_checkpoint: extra must be JSON-serialisable: {e}") from e
    tensors = {k: v.contiguous() for k, v in sd["tensors"].items()}
    for k, v in (extra_tensors or {}).items():
        tensors[f"extra/{k}"] = v.detach().cpu().contiguous()
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    prefix = f".tmp-{os.path.basename(path)}-"
    remove_stale_temporaries(folder, prefix)  # what a killed save of this file left behind
    tmp = _create_temp(folder, prefix, ".safetensors")
    try:
        mode = os.stat(tmp).st_mode & 0o777  # 0o666 minus the umask, from the exclusive create
        save_file(tensors, tmp, metadata={_KEY: meta_json})
        os.chmod(tmp, mode)  # safetensors >= 0.6 makes its files 0o600 whatever the umask
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(folder)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _create_temp(folder: str, prefix: str, suffix: str) -> str:
    """A new empty file ``folder/prefix<random>suffix`` created exclusively with mode 0o666 minus the
    umask (so the checkpoint follows the umask like any file the user writes; ``tempfile.mkstemp``
    would make it 0o600 whatever the umask)."""
    import secrets

    while True:
        tmp = os.path.join(folder, f"{prefix}{secrets.token_hex(6)}{suffix}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp


def fsync_path(path) -> None:
    """``fsync`` a file or a folder (a folder: so that a rename inside it is durable). Best effort on
    platforms that cannot open a folder (Windows)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else os.O_RDONLY
    try:
        fd = os.open(os.fspath(path), flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_stale_temporaries(folder, prefix: str) -> list[str]:
    """Remove the files and folders named ``prefix*`` in ``folder`` (the temporaries of a save that was
    killed before its rename) and return their paths. Call it only where no other save into ``folder``
    with the same prefix can be running (the name of the target is part of the prefix)."""
    import shutil

    removed = []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        full = os.path.join(folder, name)
        try:
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            else:
                os.unlink(full)
        except FileNotFoundError:
            continue
        removed.append(full)
    return removed
    return path


def read_checkpoint(path) -> tuple[dict, dict]:
    """(metadata dict, tensors dict on CPU) of a checkpoint, without touching any trainer.

    Raises:
        CheckpointError: missing, truncated or corrupt file, or not a mamba_rl checkpoint.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r}: no such file")
    try:
        from safetensors import safe_open
        with safe_open(path, framework="pt") as f:
            header = f.metadata() or {}
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path!r} is truncated or corrupt: {e}") from e
    if _KEY not in header:
        raise CheckpointError(f"checkpoint {path!r} is not a mamba_rl checkpoint (no {_KEY!r} metadata)")
    try:
        meta = json.loads(header[_KEY])
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint {path!r}: metadata is not valid JSON: {e}") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path!r}: metadata must be a JSON object, got {type(meta).__name__}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path!r}: format_version {meta.get('format_version')!r}, "
                              f"expected {FORMAT_VERSION}")
    return meta, tensors


def load_checkpoint(path, trainer=None) -> dict:
    """Read ``path`` and, when ``trainer`` is given, load it in place (graphs stay valid).

    Returns:
        the metadata dict (config, step, lr, ..., ``extra``) with ``extra_tensors`` (name -> CPU tensor).
    Raises:
        CheckpointError: unreadable file, or a config / input_dim / tensor shape that does not fit the
            trainer; the trainer is left unchanged in that case.
    """
    meta, tensors = read_checkpoint(path)
    if trainer is not None:
        core = {k: v for k, v in tensors.items() if not k.startswith("extra/")}
        try:
            trainer.load_state_dict({"meta": meta, "tensors": core})
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {os.fspath(path)!r} does not fit this trainer: {e}") from e
    meta = dict(meta)
    meta["extra_tensors"] = {k[len("extra/"):]: v for k, v in tensors.items() if k.startswith("extra/")}
    return meta


@dataclass
class TrainerLoadPlan:
    """What :func:`validate_trainer_state` found valid in a trainer state dict (nothing written yet)."""

    step: int
    bias_correction1: float
    bias_correction2: float
    lr: float
    scaler: dict
    load_state: bool  # the carried state fits this trainer's batch (another batch: weights load, state stays)


def validate_trainer_state(trainer, sd: dict) -> TrainerLoadPlan:
    """Check a :meth:`MambaTrainer.state_dict` against ``trainer`` without writing anything.

    Raises:
        ValueError: naming what does not fit (config, input_dim, a tensor's shape or dtype, a bad counter,
            the scaler) with the expected and the received value.
    """
    where = "MambaTrainer.load_state_dict"
    if not isinstance(sd, dict) or not isinstance(sd.get("meta"), dict) or not isinstance(sd.get("tensors"), dict):
        raise ValueError(f"{where}: expected {{'meta': dict, 'tensors': dict}}, got {type(sd).__name__}")
    meta, tens = sd["meta"], sd["tensors"]
    need = ("config", "input_dim", "step", "bias_correction1", "bias_correction2", "lr", "scaler")
    missing = [k for k in need if k not in meta]
    if missing:
        raise ValueError(f"{where}: metadata lacks {missing}")
    mine = trainer.net.cfg.to_dict()
    try:  # fields added since the checkpoint was written read as their defaults (e.g. a Mamba-1 config)
        theirs = type(trainer.net.cfg).from_dict(meta["config"]).to_dict()
    except (ValueError, TypeError):
        theirs = meta["config"]
    if theirs != mine or meta["input_dim"] != trainer.net.input_dim:
        raise ValueError(f"{where}: checkpoint is for config {meta['config']} with input_dim "
                         f"{meta['input_dim']}, this trainer has {mine} with input_dim {trainer.net.input_dim}")
    step, bc1, bc2, lr, sc = (meta[k] for k in ("step", "bias_correction1", "bias_correction2", "lr", "scaler"))
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{where}: step must be an int >= 0, got {step!r}")
    for k, v in (("bias_correction1", bc1), ("bias_correction2", bc2), ("lr", lr)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < float("inf")):
            raise ValueError(f"{where}: {k} must be a finite number >= 0, got {v!r}")
    sc_keys = ("scale", "growth_tracker", "growth_factor", "backoff_factor", "growth_interval")
    if not isinstance(sc, dict) or any(k not in sc or isinstance(sc[k], bool) or not isinstance(sc[k], (int, float))
                                       for k in sc_keys):
        raise ValueError(f"{where}: scaler must be a dict with numeric {list(sc_keys)}, got {sc!r}")
    want = {"master": trainer.net.arena, "exp_avg": trainer.exp_avg, "exp_avg_sq": trainer.exp_avg_sq}
    for k, t in want.items():
        v = tens.get(k)
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(t.shape) or v.dtype != torch.float32:
            got = "nothing" if v is None else f"shape {list(v.shape)} dtype {v.dtype}" \
                if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"{where}: tensor {k!r} expected shape {list(t.shape)} dtype torch.float32, got {got}")
    has_state = [k in tens for k in ("state_conv", "state_ssm")]
    if has_state[0] != has_state[1]:
        raise ValueError(f"{where}: the carried state needs both 'state_conv' and 'state_ssm', got only one")
    load_state = False
    if all(has_state):
        sc_, ss_ = tens["state_conv"], tens["state_ssm"]
        mc, ms = trainer.state.conv.shape, trainer.state.ssm.shape  # any batch; the other dims of this config
        ok = (isinstance(sc_, torch.Tensor) and isinstance(ss_, torch.Tensor) and sc_.dim() == 4 and ss_.dim() == 4
              and sc_.shape[1] == ss_.shape[1]
              and tuple(sc_.shape[::2]) + (sc_.shape[3],) == tuple(mc[::2]) + (mc[3],)
              and tuple(ss_.shape[::2]) + (ss_.shape[3],) == tuple(ms[::2]) + (ms[3],))
        if not ok:
            slot = ("conv [L, B, H, R + N + P] (Mamba-3 carry)" if trainer.net.cfg.layer == "Mamba3"
                    else "conv [L, B, d_inner, d_conv-1]")
            raise ValueError(f"{where}: carried state of shapes {list(getattr(sc_, 'shape', []))} / "
                             f"{list(getattr(ss_, 'shape', []))} does not fit {slot} = {list(mc)} / "
                             f"ssm [L, B, d_inner, d_state] = {list(ms)} of this config (B any)")
        load_state = sc_.shape[1] == trainer.batch  # another batch size: the weights load, our state stays
    return TrainerLoadPlan(step, float(bc1), float(bc2), float(lr), sc, load_state)
