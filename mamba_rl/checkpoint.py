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
import tempfile

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint", "FORMAT_VERSION", "CheckpointError"]

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
        the path written. The write is atomic: a crash leaves the old file or none, never half a file.
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
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=folder)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={_KEY: meta_json})
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
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
