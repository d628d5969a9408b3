"""The test suite runs under both launchers a user types: `python -m pytest` (the README's; the current
folder goes on sys.path) and the bare `pytest` command (it does not). tests/ is not a package:
pytest puts the folder itself on sys.path, so test files import their helpers by bare module name
(`from conftest import ...`, `from test_language_model import ...`). `from tests.X import ...`
only worked under `python -m pytest`, run from the checkout, and imported X a second time under a
second name. The real data is found in one place, conftest's SHARED_DATA ($OWAI_DATA first)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _imports(path: Path) -> list[str]:
    """The modules a file imports, at any depth ("from a.b import c" gives "a.b")."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


def test_no_test_file_imports_through_a_tests_package():
    assert not (TESTS / "__init__.py").exists()
    offenders = [f"{path.name}: {name}" for path in sorted(TESTS.rglob("*.py")) for name in _imports(path)
                 if name == "tests" or name.startswith("tests.")]
    assert offenders == []


def test_only_conftest_builds_the_shared_data_path():
    offenders = [path.name for path in sorted(TESTS.rglob("*.py"))
                 if path.name not in ("conftest.py", Path(__file__).name) and '/ "shared"' in path.read_text()]
    assert offenders == []


def test_the_bare_pytest_command_collects_tests_that_import_other_test_files(tmp_path):
    """test_recall imports test_chapter4_training, which imports test_language_model and conftest:
    collected by pytest's own entry point from a folder outside the checkout, with the checkout's
    root off sys.path, as `pytest` run anywhere does."""
    launcher = ("import sys, pytest; from pathlib import Path; "
                f"sys.path[:] = [p for p in sys.path if Path(p or '.').resolve() != Path({str(ROOT)!r})]; "
                "sys.exit(pytest.main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", launcher, "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", str(TESTS / "test_recall.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "test_recall.py::" in done.stdout
