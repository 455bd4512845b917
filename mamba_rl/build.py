"""Ahead-of-time build of the kernels: ``python -m mamba_rl.build [--kind cuda|cpu|all] [--verbose]``.

Compiles ``csrc/`` into the cache that :func:`mamba_rl.ops.extension.load_extension` reads (its module
docstring gives the location and ``MAMBA_RL_BUILD_DIR``), and prints where each went and how long it took.
``all`` (the default) builds the CPU kernels, and the CUDA kernels when CUDA is available.
"""
from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mamba_rl.build", description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("cuda", "cpu", "all"), default="all", help="which kernels to build")
    ap.add_argument("--verbose", action="store_true", help="show the ninja / compiler command lines")
    args = ap.parse_args(argv)
    import torch
    from .ops.extension import build_dir, load_extension
    kinds = ["cpu", "cuda"] if args.kind == "all" else [args.kind]
    if args.kind == "all" and not torch.cuda.is_available():
        kinds = ["cpu"]
    rc = 0
    for kind in kinds:
        t0 = time.time()
        try:
            load_extension(kind, verbose=args.verbose, retry=True)
        except Exception as e:  # one line, non-zero exit
            print(f"mamba_rl.build: {kind} failed: {e}", file=sys.stderr)
            rc = 1
            continue
        print(f"mamba_rl.build: {kind} kernels ready in {build_dir(kind)} ({time.time() - t0:.1f} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
