"""Env ids: the lookup ``gymnasium.make`` does, checked up front, and the ids this package offers.

:func:`check_env_id` resolves an id the way ``gymnasium.make`` will (``module:EnvId`` imports ``module``
first; an unversioned id means its latest version; ``popgym-*`` imports popgym), through gymnasium's
public registration API only (``gymnasium.spec``, ``parse_env_id``, ``find_highest_version``), so a typo
fails before any env is built, with gymnasium's own suggestion. :func:`list_env_ids` backs ``mamba-rl envs``.
"""

from __future__ import annotations

import importlib

import gymnasium as gym
from gymnasium.envs.registration import find_highest_version, get_env_id, parse_env_id

from .pomdp import POMDP_ENV_IDS

__all__ = ["check_env_id", "list_env_ids"]


def _import_popgym(env_id: str) -> None:
    try:
        import popgym  # noqa: F401  (registers the popgym-* ids)
    except ImportError as err:
        raise ImportError(
            f"env id {env_id!r} needs the optional 'popgym' package: "
            'pip install -e ".[popgym]"  (or pip install popgym)'
        ) from err


def _unknown(env_id: str, err: gym.error.Error) -> gym.error.Error:
    return type(err)(
        f"unknown env id {env_id!r}: {err} Expected an id that gymnasium.make accepts, such as "
        f"'CartPole-v1', 'module:EnvId', one of {sorted(POMDP_ENV_IDS)} or a 'popgym-*' id "
        "(list them: mamba-rl envs)"
    )


def check_env_id(env_id: str) -> str:
    """Check that ``gymnasium.make(env_id)`` can find ``env_id``, the way it will look it up.

    Accepts every id form gymnasium does: registered ids (``CartPole-v1``, ``mamba_rl/...``),
    ``popgym-*`` ids (imports popgym on first use), ``module:EnvId`` (imports ``module``, which
    registers ``EnvId``, as ``gymnasium.make`` does; the same import happens again in every
    async worker process) and unversioned ids (the latest version).

    Args:
        env_id: the id, ``[module:][namespace/]Name[-vN]``.

    Returns:
        The registered id ``gymnasium.make`` will build (str).

    Raises:
        ImportError: the module of a ``module:EnvId`` id, or popgym for a ``popgym-*`` id, cannot
            be imported.
        gymnasium.error.NameNotFound (or another gymnasium.error.Error): a malformed id, or no such
            id, with gymnasium's suggestion (``Did you mean: `CartPole`?``) when it has one.
    """
    if not isinstance(env_id, str) or env_id.count(":") > 1:
        raise gym.error.NameNotFound(f"malformed env id {env_id!r}; expected '[module:][namespace/]Name[-vN]'")
    module, name = env_id.split(":") if ":" in env_id else (None, env_id)
    if module is not None:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            raise ImportError(f"env id {env_id!r}: {err}. Importing module {module!r} (which should register "
                              f"{name!r}) failed") from err
    if name.startswith("popgym") and name not in gym.registry:
        _import_popgym(env_id)
    try:
        ns, base, version = parse_env_id(name)
        if version is None:  # gymnasium.make takes the latest version of an unversioned id
            latest = find_highest_version(ns, base)
            if latest is not None:
                name = get_env_id(ns, base, latest)
        return gym.spec(name).id
    except gym.error.Error as err:
        raise _unknown(env_id, err) from err


def list_env_ids(everything: bool = False) -> dict[str, list[str]]:
    """The env ids this package offers, by source.

    Args:
        everything: also list every id in gymnasium's registry (key ``"gymnasium"``).

    Returns:
        ``{"mamba_rl": [...the POMDP ids...], "popgym": [...] (only when popgym is installed),
        "gymnasium": [...] (only with ``everything``)}``, each sorted.
    """
    out = {"mamba_rl": sorted(POMDP_ENV_IDS)}
    try:
        import popgym  # noqa: F401
    except ImportError:
        pass
    else:
        out["popgym"] = sorted(i for i in gym.registry if i.startswith("popgym"))
    if everything:
        taken = {i for ids in out.values() for i in ids}
        out["gymnasium"] = sorted(i for i in gym.registry if i not in taken)
    return out
