"""Trim an EnvPool wheel to its classic-control and toy-text tasks, to carry it to a machine without internet.

EnvPool's wheel is ~53 MB compressed, most of it MuJoCo, VizDoom, Atari, Box2D and the other families'
compiled modules. The trimmed wheel drops those binaries and registers only the kept families
(``envpool/entry.py`` rewritten to import their registrations alone), so it imports and runs the
classic-control and toy-text tasks (``CartPole-v1``, ``Pendulum-v1``, ``MountainCarContinuous-v0``,
``Acrobot-v1``, ...) and ``envpool.list_all_envs()`` lists only those.

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \\
        -d /tmp/ep envpool==1.2.5 dm-env==1.6 dm-tree==0.1.10 optree==0.20.0 wrapt==2.5.2 attrs==26.1.0 \\
        absl-py==2.5.1 typing-extensions
    python benchmarks/envpool_lite.py /tmp/ep/envpool-1.2.5-cp312-*.whl .whl/
    cp /tmp/ep/{dm_env,dm_tree,optree,wrapt,attrs,absl_py,typing_extensions}-*.whl .whl/

The trimmed wheel keeps its file name (pip needs the name's tags) and a RECORD without the removed files.
"""

from __future__ import annotations

import argparse
import os
import sys
import zipfile

KEEP_FAMILIES = ("classic_control", "toy_text")


def _removed(name: str) -> bool:
    """True for a compiled module or binary of an EnvPool family other than ``KEEP_FAMILIES``."""
    parts = name.split("/")
    if len(parts) < 3 or parts[0] != "envpool" or parts[1] in KEEP_FAMILIES or parts[1] == "python":
        return False
    return name.endswith(".so") or "/bin/" in name or ".so." in name


def trim(wheel: str, out_dir: str) -> str:
    """Write ``out_dir/<wheel's file name>`` without the other families' binaries; returns its path.

    Raises:
        ValueError: ``wheel`` is not an EnvPool wheel.
    """
    base = os.path.basename(wheel)
    if not (base.startswith("envpool-") and base.endswith(".whl")):
        raise ValueError(f"expected an envpool-*.whl file, got {wheel!r}")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, base)
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        dropped = {i.filename for i in src.infolist() if _removed(i.filename)}
        for info in src.infolist():
            if info.filename in dropped:
                continue
            data = src.read(info.filename)
            if info.filename == "envpool/entry.py":
                data = ("\"\"\"Entry point of the kept families' registration (trimmed by mamba_rl's "
                        "benchmarks/envpool_lite.py).\"\"\"\n\n"
                        + "".join(f"import envpool.{f}.registration  # noqa: F401\n" for f in KEEP_FAMILIES)).encode()
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                lines = [f"{x.split(',')[0]},," if x.startswith("envpool/entry.py,") else x for x in lines]
                data = ("\n".join(x for x in lines if x.split(",")[0] not in dropped) + "\n").encode()
            dst.writestr(info, data)
    print(f"{out}: {os.path.getsize(out) / 2**20:.1f} MiB ({len(dropped)} files of other families removed; "
          f"source {os.path.getsize(wheel) / 2**20:.1f} MiB)")
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: ``envpool_lite.py WHEEL OUT_DIR``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheel")
    p.add_argument("out_dir")
    a = p.parse_args(argv)
    trim(a.wheel, a.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
