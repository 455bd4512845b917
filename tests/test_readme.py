"""Every Python snippet in the README runs as written, on its own (a new user pastes one block at a time)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_python_snippets():
    assert len(BLOCKS) >= 3, f"expected the From Python, backbone API and own-loop snippets, found {len(BLOCKS)}"


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_snippet_runs_alone(i, tmp_path):
    out = subprocess.run([sys.executable, "-c", BLOCKS[i]], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"README snippet {i} failed:\n{BLOCKS[i]}\n{out.stderr[-3000:]}"
