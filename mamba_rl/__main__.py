"""``python -m mamba_rl`` = the ``mamba-rl`` command (see :mod:`mamba_rl.cli`)."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
