"""Checkpoints: tensors in safetensors, metadata in JSON, written atomically (temp file + rename). No pickle.

A checkpoint is one safetensors file whose header metadata holds one JSON document (key ``mamba_rl``):
format version, the MambaConfig, input_dim, the optimizer hyperparameters and step, the loss-scaler state,
and the caller's ``extra``. Tensors: ``master`` (the flat float32 weight arena), ``exp_avg``,
``exp_avg_sq`` (AdamW moments), ``state_conv`` / ``state_ssm`` (the trainer's carried recurrent state),
plus any tensors the caller passes in ``extra_tensors`` (prefixed ``extra/``).

Integrity: the metadata holds ``sha256``, name -> SHA-256 of each tensor's raw bytes (little-endian, C
order), verified on read (a checkpoint written before digests existed has none and still loads). Master
weights and AdamW moments must be finite, on save (nothing is written) and on load.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint", "validate_trainer_state", "FORMAT_VERSION",
           "CheckpointError", "fsync_path", "remove_stale_temporaries", "tensor_sha256"]

FORMAT_VERSION = 1
_KEY = "mamba_rl"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read (truncated, corrupt, wrong format) or does not fit the trainer."""


_FINITE = ("master", "exp_avg", "exp_avg_sq")  # tensors that must hold only finite values


def tensor_sha256(t: torch.Tensor) -> str:
    """Hex SHA-256 of a tensor's raw bytes (CPU copy, contiguous, native little-endian element layout)."""
    b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(b)).hexdigest()


def _check_finite(tensors: dict, where: str) -> None:
    for k in _FINITE:
        t = tensors.get(k)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise CheckpointError(f"{where}: tensor {k!r} holds {bad} non-finite values (NaN/inf) of "
                                      f"{t.numel()}; expected finite values")


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
        CheckpointError (a ValueError): the master weights or AdamW moments hold NaN/inf; nothing is written
            and a file already at ``path`` is left as it was.
    """
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"save_checkpoint: extra must be a JSON-able dict, got {type(extra).__name__}")
    for k, v in (extra_tensors or {}).items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise ValueError(f"save_checkpoint: extra_tensors must map str -> torch.Tensor, got {k!r} -> "
                             f"{type(v).__name__}")
    sd = trainer.state_dict()
    _check_finite(sd["tensors"], f"save_checkpoint: refusing to write {os.fspath(path)!r}")
    tensors = {k: v.contiguous() for k, v in sd["tensors"].items()}
    for k, v in (extra_tensors or {}).items():
        tensors[f"extra/{k}"] = v.detach().cpu().contiguous()
    meta = dict(sd["meta"], format_version=FORMAT_VERSION, extra=extra or {},
                sha256={k: tensor_sha256(v) for k, v in tensors.items()})
    try:
        meta_json = json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"save_checkpoint: extra must be JSON-serialisable: {e}") from e
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
    _verify_digests(path, meta, tensors)
    return meta, tensors


def _verify_digests(path: str, meta: dict, tensors: dict) -> None:
    """Check ``meta["sha256"]`` (when present: older checkpoints have none) against every tensor."""
    if "sha256" not in meta:
        return
    digests = meta["sha256"]
    if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
        raise CheckpointError(f"checkpoint {path!r}: metadata 'sha256' must map tensor names to hex digests, "
                              f"got {type(digests).__name__}")
    if set(digests) != set(tensors):
        raise CheckpointError(f"checkpoint {path!r}: the tensors {sorted(tensors)} do not match the ones the save "
                              f"recorded {sorted(digests)} (missing {sorted(set(digests) - set(tensors))}, "
                              f"unexpected {sorted(set(tensors) - set(digests))})")
    for k, t in tensors.items():
        got = tensor_sha256(t)
        if got != digests[k]:
            raise CheckpointError(f"checkpoint {path!r}: tensor {k!r} is corrupt: SHA-256 of its bytes is "
                                  f"{got[:16]}..., the save recorded {digests[k][:16]}...")


def load_checkpoint(path, trainer=None) -> dict:
    """Read ``path`` and, when ``trainer`` is given, load it in place (graphs stay valid).

    Returns:
        the metadata dict (config, step, lr, ..., ``extra``) with ``extra_tensors`` (name -> CPU tensor).
    Raises:
        CheckpointError: unreadable or corrupt file (a tensor whose SHA-256 differs from the recorded one),
            non-finite master weights or moments, out-of-range optimizer / scaler metadata, or a config /
            input_dim / tensor shape that does not fit the trainer; the trainer is left unchanged then.
    """
    meta, tensors = read_checkpoint(path)
    if trainer is not None:
        core = {k: v for k, v in tensors.items() if not k.startswith("extra/")}
        try:
            trainer.load_state_dict({"meta": meta, "tensors": core})
        except CheckpointError as e:
            raise CheckpointError(f"checkpoint {os.fspath(path)!r}: {e}") from e
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {os.fspath(path)!r} does not fit this trainer: {e}") from e
    meta = dict(meta)
    meta["extra_tensors"] = {k[len("extra/"):]: v for k, v in tensors.items() if k.startswith("extra/")}
    return meta


def _is_num(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float))


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
        ValueError: naming what does not fit (config, input_dim, a tensor's shape or dtype) with the expected
            and the received value.
        CheckpointError (a ValueError): a counter, bias correction or scaler field out of its range (step an
            int in [0, 2**53], bias corrections in (0, 1], lr finite >= 0, scale finite > 0, growth_tracker
            an int >= 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval an int >= 1), or
            non-finite master weights / AdamW moments; the message names the field, expected and received.
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
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= 2 ** 53:
        raise CheckpointError(f"{where}: step must be an int in [0, 2**53] (exact in the float64 counter), "
                              f"got {step!r}")
    for k, v in (("bias_correction1", bc1), ("bias_correction2", bc2)):
        if not _is_num(v) or not 0 < v <= 1:
            raise CheckpointError(f"{where}: {k} (1 - beta**step, 1 before the first step) must be a number in "
                                  f"(0, 1], got {v!r}")
    if not _is_num(lr) or not 0 <= lr < math.inf:
        raise CheckpointError(f"{where}: lr must be a finite number >= 0, got {lr!r}")
    sc_keys = ("scale", "growth_tracker", "growth_factor", "backoff_factor", "growth_interval")
    if not isinstance(sc, dict) or any(k not in sc or not _is_num(sc[k]) for k in sc_keys):
        raise CheckpointError(f"{where}: scaler must be a dict with numeric {list(sc_keys)}, got {sc!r}")
    ranges = {"scale": ("a finite number > 0", lambda v: 0 < v < math.inf),
              "growth_tracker": ("an int >= 0", lambda v: isinstance(v, int) and v >= 0),
              "growth_factor": ("a finite number > 1", lambda v: 1 < v < math.inf),
              "backoff_factor": ("a number in (0, 1)", lambda v: 0 < v < 1),
              "growth_interval": ("an int >= 1", lambda v: isinstance(v, int) and v >= 1)}
    for k, (want_, ok) in ranges.items():
        if not ok(sc[k]):
            raise CheckpointError(f"{where}: scaler {k} must be {want_}, got {sc[k]!r}")
    want = {"master": trainer.net.arena, "exp_avg": trainer.exp_avg, "exp_avg_sq": trainer.exp_avg_sq}
    for k, t in want.items():
        v = tens.get(k)
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(t.shape) or v.dtype != torch.float32:
            got = "nothing" if v is None else f"shape {list(v.shape)} dtype {v.dtype}" \
                if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"{where}: tensor {k!r} expected shape {list(t.shape)} dtype torch.float32, got {got}")
    _check_finite(tens, where)
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
