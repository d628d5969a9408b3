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
