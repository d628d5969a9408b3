"""Imports inside owai/ point down (docs/architecture.md): no module imports itself through others
(no circle), and each imports only modules of its own layer or of the layers below.

The graph is read with `ast`, so every import counts: at module level, inside functions and
methods, and under `if TYPE_CHECKING:`. `from a.b import c` is an import of the module `a.b.c` when
there is one, else of `a.b`. A package's `__init__` that runs before its submodules is Python's
import machinery, not an import the submodule writes, so it is not an edge of the graph.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

import owai

OWAI = Path(owai.__file__).resolve().parent  # the package the tests import: the checkout's, or an installed one

# The layers, top to bottom. "pkg.*" names a package and everything in it; a plain name, one module
# (an exact name wins over a package pattern, a longer pattern over a shorter one).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("cli", ("owai.cli", "owai.__main__")),
    ("commands", ("owai.commands.*",)),
    ("methods", ("owai.methods.*",)),
    ("results", ("owai.report", "owai.sweep", "owai.experiment")),
    ("evals / data / train", ("owai.evals.*", "owai.data.*", "owai.train")),
    ("records", ("owai.checkpoint", "owai.runs", "owai.recipes", "owai.claims",
                 "owai.methods")),  # owai.methods itself: the Method interface and the registry of names
    ("models / config / distributed", ("owai.models.*", "owai.config", "owai.distributed", "owai.runtime",
                                       "owai.optim", "owai.plan")),
    ("io / errors", ("owai.io", "owai.errors", "owai.hub", "owai.console", "owai.values", "owai.trackers", "owai",
                     "owai.recipe_files")),  # the recipes/ folder, installed as a package of data files
]

Graph = dict[str, dict[str, int]]  # module -> {imported module: first line importing it}


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package at `root`, by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(root: Path) -> Graph:
    """Which modules of the package each of its modules imports (anywhere in its code), and where."""
    mods = modules(root)

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: Graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                targets = [known(f"{base}.{alias.name}") if f"{base}.{alias.name}" in mods else known(base)
                           for alias in node.names]
            for target in targets:
                if target is not None and target != name:
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[name] = edges
    return graph


def knots(graph: Graph) -> list[set[str]]:
    """The groups of modules that import each other, directly or through others (Tarjan's strongly
    connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups, key=min)


def circles(graph: Graph) -> list[list[str]]:
    """One circle (a, b, ..., a) through each knot: the shortest from its first module back to it."""
    return [_circle_in(graph, group) for group in knots(graph)]


def _circle_in(graph: Graph, group: set[str]) -> list[str]:
    """The shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    return paths[node] + [start]
                if nxt in group and nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"no circle in {group}")


def layer_of(module: str) -> int | None:
    """The index (0 = top) of the module's layer in LAYERS, or None when no layer names it."""
    exact = [i for i, (_, names) in enumerate(LAYERS) if module in names]
    if exact:
        return exact[0]
    best: tuple[int, int] | None = None
    for i, (_, names) in enumerate(LAYERS):
        for pattern in names:
            package = pattern.removesuffix(".*")
            if pattern.endswith(".*") and (module == package or module.startswith(package + ".")):
                if best is None or len(package) > best[0]:
                    best = (len(package), i)
    return None if best is None else best[1]


def upward_imports(graph: Graph) -> list[str]:
    """Each import from a lower layer into a higher one, as `a:LINE -> b (layer x -> layer y)`."""
    found = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            src, dst = layer_of(module), layer_of(target)
            if src is not None and dst is not None and dst < src:
                found.append(f"{module}:{line} -> {target} ({LAYERS[src][0]} -> {LAYERS[dst][0]})")
    return found


def _describe(graph: Graph, knot: set[str]) -> str:
    circle = _circle_in(graph, knot)
    path = " -> ".join(f"{a}:{graph[a][b]}" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"
    return f"{path}  (the knot: {', '.join(sorted(knot))})"


def owai_graph() -> Graph:
    """owai's graph, checked to be the whole package (a wrong root would give an empty graph, which
    has no circle and no upward import)."""
    graph = import_graph(OWAI)
    assert {"owai.cli", "owai.commands.moons", "owai.models.memory_mosaics_v2", "owai.io"} <= set(graph), OWAI
    return graph


def test_no_import_circles() -> None:
    graph = owai_graph()
    found = knots(graph)
    assert not found, "imports in a circle (module:line of each import):\n" + "\n".join(_describe(graph, k) for k in found)


def test_every_module_has_a_layer_and_imports_point_down() -> None:
    graph = owai_graph()
    unplaced = [m for m in graph if layer_of(m) is None]
    assert not unplaced, f"modules without a layer (add them to LAYERS and docs/architecture.md): {unplaced}"
    up = upward_imports(graph)
    assert not up, "imports from a lower layer up to a higher one:\n" + "\n".join(up)


PLANTS = {
    "function level": ("owai/errors.py", "\n\ndef _planted() -> None:\n    from owai import cli  # noqa: F401\n"),
    "module level": ("owai/runs.py", "\nimport owai.sweep  # noqa: E402,F401\n"),
}


@pytest.mark.parametrize("where", sorted(PLANTS))
def test_a_planted_circle_is_caught(tmp_path: Path, where: str) -> None:
    """The checks fail on a copy of owai/ with one import into a higher module added."""
    shutil.copytree(OWAI, tmp_path / "owai", ignore=lambda _, names: [n for n in names if not (n.endswith(".py") or "." not in n)])
    path, text = PLANTS[where]
    with open(tmp_path / path, "a") as f:
        f.write(text)
    graph = import_graph(tmp_path / "owai")
    planted = path.removesuffix(".py").replace("/", ".")
    found = circles(graph)
    assert len(found) == 1 and planted in found[0], found
    assert any(line.startswith(f"{planted}:") for line in upward_imports(graph))
