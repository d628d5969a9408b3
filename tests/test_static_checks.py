"""Static checks over the project's Python: ruff's pyflakes rules (F) find undefined names, unused
imports and variables and redefinitions before any test reaches the line (a benchmark's closure over
a deleted name was one). Deliberate side-effect imports carry `# noqa: F401`, which ruff honours."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_code_passes_the_pyflakes_rules() -> None:
    pytest.importorskip("ruff", reason="ruff comes with the test extra: pip install -e '.[test]'")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F", "--no-cache", "--output-format", "concise",
                           "owai", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_import_of_an_owai_name_finds_it() -> None:
    """owai imports most of its own names inside functions (the layers stay light to import), where a
    moved or renamed name fails only when that function first runs (a `StepStream` import left
    behind by a merge broke rich-features' pre-training). Every `from owai.x import name` in owai/,
    at any depth, must name something module owai.x has or a submodule of it."""
    import ast
    import importlib

    missing = []
    for path in sorted((ROOT / "owai").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "owai"):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ModuleNotFoundError:
                        missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}")
    assert not missing, "\n".join(missing)
