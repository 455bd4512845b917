"""Checkpoints: tensors in safetensors, metadata in JSON, written atomically (temp file + rename). No pickle.

A checkpoint is one safetensors file whose header metadata holds one JSON document (key ``mamba_rl``):
format version, the MambaConfig, input_dim, the optimizer hyperparameters and step, the loss-scaler state,
and the caller's ``extra``. Tensors: ``master`` (the flat float32 weight arena), ``exp_avg``,
``exp_avg_sq`` (AdamW moments), ``state_conv`` / ``state_ssm`` (the trainer's carried recurrent state),
plus any tensors the caller passes in ``extra_tensors`` (prefixed ``extra/``).

Integrity: the metadata holds ``sha256``, name -> SHA-256 of each tensor's raw bytes (little-endian, C
order), verified on read (a checkpoint written before digests existed has none and still loads). Master
weights, AdamW moments and the carried state must be finite, and ``exp_avg_sq`` (AdamW's second moment) >= 0,
on save (nothing is written) and on load (nothing is loaded); one min/max pass per tensor.

Settings: a load validates every stored field (range and type) before anything is written. By default
(``settings="checkpoint"``) it applies the stored AdamW hyperparameters (lr, betas, eps, weight_decay,
max_grad_norm) and refuses a checkpoint whose ``dtype`` or ``no_decay`` differs from the trainer's (they are
fixed when a trainer is built); ``settings="trainer"`` keeps every setting of the trainer (see
:func:`validate_trainer_state`).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint", "validate_trainer_state", "FORMAT_VERSION",
           "CheckpointError", "fsync_path", "is_save_temporary", "remove_stale_temporaries", "tensor_sha256"]

FORMAT_VERSION = 1
_KEY = "mamba_rl"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read (truncated, corrupt, wrong format) or does not fit the trainer."""


_FINITE = ("master", "exp_avg", "exp_avg_sq", "state_conv", "state_ssm")  # tensors that must hold only finite values
_NON_NEGATIVE = ("exp_avg_sq",)  # ... and also no negative value (AdamW's second moment: sqrt of it next step)
SETTINGS = ("checkpoint", "trainer")  # the choices of load_checkpoint's / load_state_dict's ``settings``


def tensor_sha256(t: torch.Tensor) -> str:
    """Hex SHA-256 of a tensor's raw bytes (CPU copy, contiguous, native little-endian element layout)."""
    b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(b)).hexdigest()


def _check_values(tensors: dict, where: str) -> None:
    """Refuse the non-finite values of ``_FINITE`` tensors and the negative ones of ``_NON_NEGATIVE`` tensors,
    naming the tensor. One ``aminmax`` pass per tensor (NaN propagates into both); the values are counted
    only to word the error.

    Raises:
        CheckpointError: a tensor holds NaN / inf, or ``exp_avg_sq`` a value < 0.
    """
    for k in _FINITE:
        t = tensors.get(k)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
            continue
        lo, hi = (float(v) for v in torch.aminmax(t.detach()))
        if math.isfinite(lo) and math.isfinite(hi):
            if k in _NON_NEGATIVE and lo < 0:
                bad = int((t < 0).sum())
                raise CheckpointError(f"{where}: tensor {k!r} holds {bad} negative values of {t.numel()} (min {lo!r}); "
                                      f"expected finite values >= 0 (AdamW's second moment)")
            continue
        bad = int((~torch.isfinite(t)).sum())
        want = "finite values >= 0 (AdamW's second moment)" if k in _NON_NEGATIVE else "finite values"
        raise CheckpointError(f"{where}: tensor {k!r} holds {bad} non-finite values (NaN/inf) of "
                              f"{t.numel()}; expected {want}")


def _path_arg(path, where: str) -> str:
    """``os.fspath(path)`` as a str, or a ValueError naming the argument, the expected and the received."""
    if isinstance(path, (str, bytes, os.PathLike)):
        try:
            p = os.fsdecode(os.fspath(path))
        except TypeError:  # a PathLike whose __fspath__ returns something else
            p = None
        if isinstance(p, str) and p:
            return p
    raise ValueError(f"{where}: path must be a non-empty file path (str, bytes or os.PathLike), got {path!r} "
                     f"({type(path).__name__})")


def save_checkpoint(path, trainer, extra: dict | None = None, extra_tensors: dict | None = None) -> str:
    """Write ``trainer`` (weights, AdamW m and v, step, scaler, config, settings, carried state) to ``path``.

    Args:
        path: file path (str, bytes or os.PathLike; ``.safetensors`` suggested); parent folders are created.
        trainer: a :class:`~mamba_rl.MambaTrainer`.
        extra: JSON-able dict stored in the metadata (e.g. the agent's counters and config).
        extra_tensors: name -> dense (strided) tensor with data, of any device, dtype and strides, stored
            beside the trainer's (e.g. head weights, RNG states) as a contiguous CPU copy, so tensors that
            share memory (views of one buffer) are stored as independent tensors.
    Returns:
        the path written (a str). The write is atomic: a crash leaves the old file or none, never half a file
        (temp file ``.tmp-<name>-*`` in the same folder, fsync, rename, fsync of the folder); the
        temporaries a killed save left behind are removed by the next save of the same file. The file
        is created with mode 0o666 minus the umask, like any file the user writes. A save that fails for
        any reason leaves a file already at ``path`` as it was.
    Raises:
        TypeError: ``trainer`` is not a :class:`~mamba_rl.MambaTrainer`.
        ValueError: ``path`` is not a non-empty str / bytes / os.PathLike; ``extra`` is not a
            JSON-serialisable dict (NaN and inf are refused), or ``extra_tensors`` is not a str -> tensor dict,
            or holds a sparse or meta tensor.
        IsADirectoryError: ``path`` is an existing folder (checked before anything is written).
        NotADirectoryError: a part of ``path``'s folder exists and is not a folder.
        CheckpointError (a ValueError): the master weights, AdamW moments or carried state hold NaN/inf, or
            ``exp_avg_sq`` a negative value; nothing is written and a file already at ``path`` is left as it was.
        OSError: the write itself failed (disk full, permissions); the previous file is left as it was.
    """
    where = "save_checkpoint"
    path = _path_arg(path, where)
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"{where}: extra must be a JSON-able dict, got {type(extra).__name__}")
    if extra_tensors is not None and not isinstance(extra_tensors, dict):
        raise ValueError(f"{where}: extra_tensors must be a dict str -> torch.Tensor, got "
                         f"{type(extra_tensors).__name__}")
    for k, v in (extra_tensors or {}).items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise ValueError(f"{where}: extra_tensors must map str -> torch.Tensor, got {k!r} -> "
                             f"{type(v).__name__}")
        if v.layout != torch.strided or v.is_meta:
            got = "a meta tensor" if v.is_meta else f"layout {v.layout} (store its .to_dense())"
            raise ValueError(f"{where}: extra_tensors[{k!r}]: expected a dense (strided) tensor with data, got {got}")
    from .trainer import MambaTrainer  # (trainer imports this module)
    if not isinstance(trainer, MambaTrainer):
        raise TypeError(f"{where}: trainer must be a MambaTrainer, got {type(trainer).__name__}")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{where}: path must be a file path (the checkpoint file to write), got {path!r}, "
                                f"an existing folder")
    sd = trainer.state_dict()
    _check_values(sd["tensors"], f"{where}: refusing to write {path!r}")
    tensors = {k: v.contiguous() for k, v in sd["tensors"].items()}
    for k, v in (extra_tensors or {}).items():
        # a fresh contiguous CPU copy each: safetensors refuses tensors that share memory (views of one buffer)
        c = torch.empty(v.shape, dtype=v.dtype)
        c.copy_(v.detach())
        tensors[f"extra/{k}"] = c
    meta = dict(sd["meta"], format_version=FORMAT_VERSION, extra=extra or {},
                sha256={k: tensor_sha256(v) for k, v in tensors.items()})
    try:
        meta_json = json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: extra must be JSON-serialisable: {e}") from e
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise NotADirectoryError(f"{where}: path {path!r} needs the folder {folder!r}, but a part of it exists and "
                                 f"is not a folder ({e})") from e
    prefix = f".tmp-{os.path.basename(path)}-"
    remove_stale_temporaries(folder, prefix, ".safetensors")  # what a killed save of this file left behind
    tmp = _create_temp(folder, prefix, ".safetensors")
    try:
        mode = os.stat(tmp).st_mode & 0o777  # 0o666 minus the umask, from the exclusive create
        try:
            save_file(tensors, tmp, metadata={_KEY: meta_json})
        except SafetensorError as e:  # safetensors reports a failed write (e.g. a full disk) as its own error
            raise OSError(f"{where}: could not write {path!r}: {e}") from e
        os.chmod(tmp, mode)  # safetensors >= 0.6 makes its files 0o600 whatever the umask
        fsync_path(tmp)
        try:
            os.replace(tmp, path)
        except IsADirectoryError as e:  # a folder made at ``path`` since the check above
            raise IsADirectoryError(f"{where}: path must be a file path (the checkpoint file to write), got "
                                    f"{path!r}, an existing folder") from e
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


def is_save_temporary(entry: str, prefix: str, suffix: str = "") -> bool:
    """Whether the folder entry ``entry`` is exactly ``prefix``, the 12 hex digits one save draws
    (``_create_temp``), and ``suffix``: that save's temporary, and not one of a sibling whose name begins with
    the same name and a dash (``ckpt`` and ``ckpt-best``: ``.tmp-ckpt-`` begins both of theirs)."""
    return re.fullmatch(re.escape(prefix) + "[0-9a-f]{12}" + re.escape(suffix), entry) is not None


def remove_stale_temporaries(folder, prefix: str, suffix: str = "") -> list[str]:
    """Remove the files and folders of ``folder`` named ``prefix`` + 12 hex digits + ``suffix``
    (:func:`is_save_temporary`: the temporaries of a save that was killed before its rename) and return their
    paths. Call it only where no other save into ``folder`` with the same prefix can be running (the name of
    the target is part of the prefix)."""
    import shutil

    removed = []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return removed
    for name in names:
        if not is_save_temporary(name, prefix, suffix):
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

    Args:
        path: the checkpoint file (str, bytes or os.PathLike).
    Returns:
        (the JSON metadata: config, step, settings, scaler, ``extra`` (a dict), ``sha256``, ...;
        name -> CPU tensor of every stored tensor, the caller's under ``extra/<name>``).
    Raises:
        ValueError: ``path`` is not a non-empty str / bytes / os.PathLike.
        CheckpointError: missing, truncated or corrupt file (a tensor whose SHA-256 differs from the recorded
            one), not a mamba_rl checkpoint, or an ``extra`` that is not a JSON object.
    """
    path = _path_arg(path, "read_checkpoint")
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} is a folder; expected a checkpoint file")
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
    if not isinstance(meta.get("extra", {}), dict):
        raise CheckpointError(f"checkpoint {path!r}: metadata 'extra' (the caller's dict) must be a JSON object, "
                              f"got {meta['extra']!r}")
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


def load_checkpoint(path, trainer=None, settings: str = "checkpoint") -> dict:
    """Read ``path`` and, when ``trainer`` is given, load it in place (graphs stay valid).

    Args:
        path: the checkpoint file (str, bytes or os.PathLike).
        trainer: a :class:`~mamba_rl.MambaTrainer` to load into, or None to only read.
        settings: "checkpoint" (default): the stored AdamW hyperparameters (lr, betas, eps, weight_decay,
            max_grad_norm) replace the trainer's, so the run resumes bit-identically whatever the trainer was
            built with, and a stored ``dtype`` / ``no_decay`` that differs from the trainer's is refused (they
            are fixed when a trainer is built). "trainer": the trainer keeps all of its settings (lr included;
            another dtype or no_decay is accepted: e.g. a run resumed with deliberately changed settings).
            Either way every stored field is validated, and a stored batch / seq_len may differ from the
            trainer's (the carried state loads only when the batch matches). See
            :func:`validate_trainer_state`.
    Returns:
        the metadata dict (config, step, lr, ..., ``extra``) with ``extra_tensors`` (name -> CPU tensor).
    Raises:
        ValueError: ``path`` is not a non-empty str / bytes / os.PathLike, or ``settings`` is not one of
            "checkpoint", "trainer".
        CheckpointError: unreadable or corrupt file (a tensor whose SHA-256 differs from the recorded one),
            non-finite master weights, moments or carried state, a negative ``exp_avg_sq``, out-of-range or
            mistyped metadata (optimizer settings, counters, scaler, batch, seq_len, dtype, no_decay,
            ``extra``), a dtype / no_decay that differs from the trainer's (``settings="checkpoint"``), or a
            config / input_dim / tensor shape or dtype that does not fit the trainer; the trainer is left
            unchanged (bit-identical) then.
    """
    if settings not in SETTINGS:
        raise ValueError(f"load_checkpoint: settings must be one of {list(SETTINGS)}, got {settings!r}")
    path = _path_arg(path, "load_checkpoint")
    meta, tensors = read_checkpoint(path)
    if trainer is not None:
        core = {k: v for k, v in tensors.items() if not k.startswith("extra/")}
        try:
            sd = {"meta": meta, "tensors": core}
            if settings == "checkpoint":  # the plain call: a subclass's load_state_dict(sd) keeps working
                trainer.load_state_dict(sd)
            else:
                trainer.load_state_dict(sd, settings=settings)
        except CheckpointError as e:
            raise CheckpointError(f"checkpoint {path!r}: {e}") from e
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {path!r} does not fit this trainer: {e}") from e
    meta = dict(meta)
    meta["extra_tensors"] = {k[len("extra/"):]: v for k, v in tensors.items() if k.startswith("extra/")}
    return meta


def _is_num(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float))


def _is_finite_num(v) -> bool:
    return _is_num(v) and math.isfinite(v)


def _is_int(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, int)


@dataclass
class TrainerLoadPlan:
    """What :func:`validate_trainer_state` found valid in a trainer state dict (nothing written yet).

    ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``max_grad_norm`` are the values to apply; each is None
    when the trainer keeps its own (``settings="trainer"``, or a field the state dict does not hold).
    ``max_grad_norm`` is ``math.inf`` for a stored None (no clip)."""

    step: int
    bias_correction1: float
    bias_correction2: float
    lr: float | None
    scaler: dict
    load_state: bool  # the carried state fits this trainer's batch (another batch: weights load, state stays)
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    max_grad_norm: float | None = None


_NO_VALUE = object()


def _check_settings(meta: dict, where: str) -> dict:
    """Validate the stored trainer settings (those present; an older or hand-made state dict may lack some)
    and return them as name -> value (betas a tuple of floats, max_grad_norm ``math.inf`` for None).

    Raises:
        CheckpointError: a field of the wrong type or out of its range, naming field, expected and received.
    """
    from .trainer import DTYPES  # trainer imports this module

    out = {}
    v = meta.get("betas", _NO_VALUE)
    if v is not _NO_VALUE:
        if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_finite_num(b) and 0 <= b < 1 for b in v)):
            raise CheckpointError(f"{where}: betas must be a pair [beta1, beta2] of finite numbers in [0, 1), "
                                  f"got {v!r}")
        out["betas"] = (float(v[0]), float(v[1]))
    for k, want, ok in (("eps", "a finite number > 0", lambda x: x > 0),
                        ("weight_decay", "a finite number >= 0", lambda x: x >= 0)):
        v = meta.get(k, _NO_VALUE)
        if v is not _NO_VALUE:
            if not (_is_finite_num(v) and ok(v)):
                raise CheckpointError(f"{where}: {k} must be {want}, got {v!r}")
            out[k] = float(v)
    v = meta.get("max_grad_norm", _NO_VALUE)
    if v is not _NO_VALUE:
        if v is not None and not (_is_finite_num(v) and v > 0):
            raise CheckpointError(f"{where}: max_grad_norm must be null (no clip) or a finite number > 0, got {v!r}")
        out["max_grad_norm"] = math.inf if v is None else float(v)
    for k in ("batch", "seq_len"):
        v = meta.get(k, _NO_VALUE)
        if v is not _NO_VALUE and not (_is_int(v) and v >= 1):
            raise CheckpointError(f"{where}: {k} must be an int >= 1, got {v!r}")
    v = meta.get("dtype", _NO_VALUE)
    if v is not _NO_VALUE:
        if not (isinstance(v, str) and v in DTYPES):
            raise CheckpointError(f"{where}: dtype must be one of {sorted(DTYPES)}, got {v!r}")
        out["dtype"] = v
    v = meta.get("no_decay", _NO_VALUE)
    if v is not _NO_VALUE:
        if v not in ("reference", None):
            raise CheckpointError(f"{where}: no_decay must be \"reference\" or null, got {v!r}")
        out["no_decay"] = v
    return out


def validate_trainer_state(trainer, sd: dict, settings: str = "checkpoint") -> TrainerLoadPlan:
    """Check a :meth:`MambaTrainer.state_dict` against ``trainer`` without writing anything.

    Args:
        trainer: the :class:`~mamba_rl.MambaTrainer` it is meant for.
        sd: ``{"meta": dict, "tensors": dict}``: tensors ``master``, ``exp_avg``, ``exp_avg_sq`` (float32,
            the shape of the trainer's arena) and optionally both of ``state_conv`` / ``state_ssm`` (4-d,
            the dtype of the trainer's state, any batch); meta as :meth:`MambaTrainer.state_dict` writes it
            (``betas``, ``eps``, ``weight_decay``, ``max_grad_norm``, ``batch``, ``seq_len``, ``dtype``,
            ``no_decay`` may be absent: the trainer's own are kept then).
        settings: "checkpoint": the plan carries the stored lr, betas, eps, weight_decay and max_grad_norm
            to apply, and a stored dtype / no_decay must equal the trainer's. "trainer": the plan applies
            none of them and another dtype / no_decay is accepted. Stored batch / seq_len may differ either
            way (the carried state loads only when the batch matches).
    Returns:
        a :class:`TrainerLoadPlan`.
    Raises:
        ValueError: ``settings`` is not "checkpoint" or "trainer"; or naming what does not fit (config,
            input_dim, a tensor's shape or dtype) with the expected and the received value.
        CheckpointError (a ValueError): a field out of its range or of the wrong type (step an int in
            [0, 2**53], bias corrections in (0, 1], lr finite >= 0, betas a pair of finite numbers in [0, 1),
            eps finite > 0, weight_decay finite >= 0, max_grad_norm null or finite > 0, batch / seq_len ints
            >= 1, dtype one of "f32", "tf32", "bf16", "f16", no_decay "reference" or null, scale finite > 0,
            growth_tracker an int >= 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval an int
            >= 1); a dtype / no_decay that differs from the trainer's (``settings="checkpoint"``), naming the
            field, the checkpoint's and the trainer's value; non-finite master weights, AdamW moments or
            carried state, or a negative ``exp_avg_sq``, naming the tensor.
    """
    where = "MambaTrainer.load_state_dict"
    if settings not in SETTINGS:
        raise ValueError(f"{where}: settings must be one of {list(SETTINGS)}, got {settings!r}")
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
    stored = _check_settings(meta, where)
    if settings == "checkpoint":
        for k, t_val in (("dtype", trainer.dtype), ("no_decay", trainer.no_decay)):
            if k in stored and stored[k] != t_val:
                raise CheckpointError(
                    f"{where}: {k} differs: the checkpoint's is {stored[k]!r}, this trainer's is {t_val!r} (fixed "
                    f"when a trainer is built: build it with {k}={stored[k]!r}, or load with settings='trainer' to "
                    f"keep this trainer's settings)")
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
        for k, v, mine_t in (("state_conv", sc_, trainer.state.conv), ("state_ssm", ss_, trainer.state.ssm)):
            if v.dtype != mine_t.dtype:
                raise ValueError(f"{where}: tensor {k!r} expected dtype {mine_t.dtype} (the carried state's), "
                                 f"got {v.dtype}")
        load_state = sc_.shape[1] == trainer.batch  # another batch size: the weights load, our state stays
    _check_values(tens, where)  # last: the one pass over every tensor's values
    plan = TrainerLoadPlan(step, float(bc1), float(bc2), float(lr), sc, load_state)
    if settings == "checkpoint":
        plan.betas, plan.eps = stored.get("betas"), stored.get("eps")
        plan.weight_decay, plan.max_grad_norm = stored.get("weight_decay"), stored.get("max_grad_norm")
    else:
        plan.lr = None
    return plan
