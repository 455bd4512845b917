"""PEP 562 lazy exports for a package's ``__init__``: each public name is imported from its submodule on first
use, so importing the package (or the CLI's ``--help``) does not pay for torch or gymnasium."""
from __future__ import annotations

import __future__
import importlib
from typing import Callable


def lazy_exports(package: str, exports: dict[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """(``__getattr__``, ``__dir__``) for ``package`` whose ``exports`` map a public name to the relative
    submodule that defines it; a resolved name is cached in ``namespace`` (the package's globals).

    Raises (from ``__getattr__``): AttributeError naming the package for a name it does not export."""

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(exports[name], package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:  # without this helper and a ``from __future__ import annotations`` of the package
        names = set(namespace) | set(exports)
        return sorted(n for n in names if namespace.get(n) not in (lazy_exports, __future__.annotations))

    return __getattr__, __dir__
