"""Ahead-of-time build of the CUDA extension: ``python -m mamba_rl.build [--verbose]``.

Compiles csrc/ into the cache that :func:`mamba_rl._build.load_extension` reads (see its docstring for
the location and ``MAMBA_RL_BUILD_DIR``), and prints where it went and how long it took.
"""
from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mamba_rl.build", description=__doc__.splitlines()[0])
    ap.add_argument("--verbose", action="store_true", help="show the ninja / nvcc command lines")
    args = ap.parse_args(argv)
    from ._build import build_dir, load_extension
    t0 = time.time()
    try:
        load_extension(verbose=args.verbose)
    except Exception as e:  # one line, non-zero exit
        print(f"mamba_rl.build: failed: {e}", file=sys.stderr)
        return 1
    print(f"mamba_rl.build: extension ready in {build_dir()} ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
