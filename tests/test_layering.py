"""The layering rule of docs/architecture.md ("Layers"): the core (``mamba_rl/``) never imports the agent or
env layer, and the command line's help imports neither torch nor gymnasium."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UPPER = ("mamba_rl.agents", "mamba_rl.envs")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "mamba_rl").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_never_imports_the_agent_layer(path):
    bad = [n for n in _imports(path) if n.startswith(UPPER) or n in ("mamba_rl.agents", "mamba_rl.envs")]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: the core must not reach up (docs/architecture.md)"


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_import_mamba_rl_does_not_import_gymnasium():
    mods = _modules_after("import mamba_rl, mamba_rl.model, mamba_rl.train")
    assert "gymnasium" not in mods and "mamba_rl.agents" not in mods


def test_cli_help_imports_neither_torch_nor_gymnasium():
    mods = _modules_after("import contextlib, io\nfrom mamba_rl.agents.cli import main\n"
                          "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
                          "    main(['train', '--help'])")
    assert "torch" not in mods and "gymnasium" not in mods, sorted(m for m in mods if m.split('.')[0] in ("torch", "gymnasium"))[:5]


PACKAGES = ("mamba_rl", "agents", "envs", "csrc")


@pytest.mark.parametrize("path", sorted(p for d in PACKAGES for p in (ROOT / d).rglob("__init__.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_package_faces_stay_small(path):
    """An ``__init__.py`` re-exports; logic lives in modules (at most 60 lines)."""
    n = len(path.read_text().splitlines())
    assert n <= 60, f"{path.relative_to(ROOT)} has {n} lines; expected <= 60 (move logic into a module)"


@pytest.mark.parametrize("path", sorted(p for d in ("agents", "envs") for p in (ROOT / d).rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_untyped_agent_parameter(path):
    """Collaborators take typed pieces, not the whole agent as ``Any``: no parameter named like the agent is
    annotated ``Any`` (or left unannotated in a public function)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs:
                if "agent" not in arg.arg:
                    continue
                ann = ast.unparse(arg.annotation) if arg.annotation is not None else None
                if ann in (None, "Any", "typing.Any") and not (ann is None and node.name.startswith("_")):
                    bad.append(f"{node.name}({arg.arg}: {ann})")
    assert not bad, f"{path.relative_to(ROOT)}: {bad}"
