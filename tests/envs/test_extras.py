"""The optional extras in pyproject.toml install what the envs they name need."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python >= 3.11")
def test_the_popgym_extra_installs_mazelib_for_the_labyrinth_tasks():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = [req.split(";")[0].split(">")[0].split("=")[0].split("[")[0].strip() for req in extras["popgym"]]
    assert names == ["popgym", "mazelib"]  # popgym's Labyrinth* envs import mazelib (popgym's "navigation" extra)
