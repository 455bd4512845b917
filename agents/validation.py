"""The argument checks of the agent layer: one error format, "NAME must be EXPECTED, got VALUE".

``bool`` is not accepted as an int or a number (``True`` is an ``int`` in Python, never a count here), and
numbers must be finite. ``name`` is what the message calls the value (``"PPOConfig.num_envs"``,
``"--episodes"``, ``"num_episodes"``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

__all__ = ["check_int", "check_real", "check_bool", "check_choice"]


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in [lo, hi] (a missing bound: unbounded).

    Raises:
        ValueError: "NAME must be an int >= LO, got VALUE" (or "in [LO, HI]", "<= HI").
    """
    if lo is not None and hi is not None:
        want = f"an int in [{lo}, {hi}]"
    elif lo is not None:
        want = f"an int >= {lo}"
    elif hi is not None:
        want = f"an int <= {hi}"
    else:
        want = "an int"
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo) or \
            (hi is not None and value > hi):
        raise ValueError(f"{name} must be {want}, got {value!r}")
    return value


def _finite(value: int | float) -> bool:
    """math.isfinite, False for an int too large for a float (where isfinite raises OverflowError)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_real(name: str, value: Any, lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False,
               optional: bool = False) -> float | None:
    """``value`` if it is a finite int or float (not a bool) in [lo, hi] ((lo, hi] with ``lo_open``); None
    passes when ``optional``.

    Raises:
        ValueError: "NAME must be a finite number, got VALUE" or "NAME must be in [LO, HI], got VALUE" ("must be
            >= LO" / "> LO" where HI is infinite).
    """
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise ValueError(f"{name} must be a finite number{' or None' if optional else ''}, got {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        where = (f"{'>' if lo_open else '>='} {lo}" if hi == math.inf else
                 f"in {'(' if lo_open else '['}{lo}, {hi}]")  # no "inf]": inf itself is refused above
        raise ValueError(f"{name} must be {where}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool (numpy's bool too, returned as a Python bool).

    Raises:
        ValueError: "NAME must be a bool (True or False), got VALUE".
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise ValueError(f"{name} must be a bool (True or False), got {value!r}")


def check_bool_or_auto(name: str, value: Any) -> bool | str:
    """``value`` if it is a bool (numpy's bool too, returned as a Python bool) or the string ``"auto"``.

    Raises:
        ValueError: "NAME must be True, False or 'auto', got VALUE".
    """
    if isinstance(value, str) and value == "auto":
        return value
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise ValueError(f"{name} must be True, False or 'auto', got {value!r}")


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value`` if it is one of ``choices``.

    Raises:
        ValueError: "NAME must be one of CHOICES, got VALUE".
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value
