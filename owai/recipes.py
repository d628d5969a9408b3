"""Recipes: one YAML file per thesis table or figure, validated on load.

A recipe names what it reproduces, the method that runs it, the method's parameters, scale
presets (at least `cpu`, the default, and `paper`, the thesis's own settings), the thesis's
reported numbers (optionally per setting, `when`), and optionally a sweep (grid, seeds, per-preset
grids and seeds, and a selection of the best grid cell per group). Recipes ship inside the package
(`owai.recipe_files`, the repository's `recipes/` folder); a path to any YAML file works too.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from owai.claims import check_claims
from owai.config import apply_overrides, build, load_yaml, merge
from owai.errors import OwaiError, did_you_mean
from owai.methods import Method, is_registered, method_class

REQUIRED_PRESETS = ("cpu", "paper")

# A sweep grid: one cartesian product {path: values}, or a list of them (the union of their products).
Grid = dict[str, list[Any]] | list[dict[str, list[Any]]]


@dataclasses.dataclass
class Reference:
    """A thesis figure/table the recipe reproduces."""

    ref: str  # e.g. "Figure 3.5"
    section: str  # e.g. "3.3"


@dataclasses.dataclass
class ThesisNumber:
    """A number (or a claim, where the thesis prints none) reported by the thesis."""

    ref: str
    value: float | None = None
    claim: str = ""
    # dotted param path -> value: the number holds only for runs with these settings (empty: any run)
    when: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class SweepPreset:
    """One preset's own sweep grid and/or seeds (None: the sweep's defaults)."""

    grid: Grid | None = None
    seeds: list[int] | None = None


@dataclasses.dataclass
class Selection:
    """Pick the best grid cell per group: the groups are the `per` keys' values, the other grid
    keys are searched, and a cell's score is the mean over its seeds of a measured metric."""

    metric: str  # a name in the method's Outcome.measured, e.g. "val_loss"
    mode: Literal["min", "max"] = "min"
    per: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SweepSpec:
    """A grid over dotted parameter paths (a dict, or a list of dicts for a union), crossed with
    seeds; a preset may bring its own grid and seeds."""

    grid: Grid = dataclasses.field(default_factory=dict)
    seeds: list[int] = dataclasses.field(default_factory=lambda: [0])
    presets: dict[str, SweepPreset] = dataclasses.field(default_factory=dict)
    select: Selection | None = None

    def grid_for(self, preset: str) -> Grid:
        """The grid a sweep at `preset` starts from, as written (dict or list)."""
        own = self.presets.get(preset)
        return own.grid if own is not None and own.grid is not None else self.grid

    def for_preset(self, name: str) -> tuple[list[dict[str, list[Any]]], list[int]]:
        """(sub-grids, seeds) of a sweep at preset `name`: its own entries, else the defaults."""
        own = self.presets.get(name)
        seeds = own.seeds if own is not None and own.seeds is not None else self.seeds
        return sub_grids(self.grid_for(name)), list(seeds)


def sub_grids(grid: Grid) -> list[dict[str, list[Any]]]:
    """A grid as a list of cartesian products (a dict is a list of one); copies, safe to edit."""
    return [{k: list(v) for k, v in g.items()} for g in ([grid] if isinstance(grid, dict) else grid)]


@dataclasses.dataclass
class Recipe:
    id: str
    title: str
    reproduces: list[Reference]
    method: str
    description: str = ""
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    presets: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    default_preset: str = "cpu"
    thesis: dict[str, ThesisNumber | list[ThesisNumber]] = dataclasses.field(default_factory=dict)
    sweep: SweepSpec | None = None
    # the thesis's claims as predicates over the measured numbers (owai/claims.py; checked on load)
    claims: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    source: str = ""  # where the recipe was loaded from (filled by the loader)

    @property
    def implemented(self) -> bool:
        return is_registered(self.method)

    @property
    def references(self) -> str:
        """The thesis items the recipe reproduces, each run of items from one section named once:
        "Figure 4.6, Table 4.6 (sec 4.2.3.3), Table C.1 (sec C.1)"."""
        groups: list[tuple[str, list[str]]] = []
        for r in self.reproduces:
            if groups and groups[-1][0] == r.section:
                groups[-1][1].append(r.ref)
            else:
                groups.append((r.section, [r.ref]))
        return ", ".join(f"{', '.join(refs)} (sec {section})" for section, refs in groups)

    def method_class(self) -> type[Method]:
        return method_class(self.method)

    def params_for(self, preset: str | None) -> dict[str, Any]:
        """The recipe's params with one preset applied (not yet validated against the schema)."""
        name = preset or self.default_preset
        if name not in self.presets:
            raise OwaiError(f"recipe {self.id!r} has no preset {name!r} (presets: {', '.join(self.presets)})")
        return merge(self.params, self.presets[name] or {})


def _lookup(params: dict[str, Any], path: str) -> tuple[bool, Any]:
    node: Any = params
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def thesis_for(recipe: Recipe, metric: str, params: dict[str, Any]) -> ThesisNumber | None:
    """The thesis number for `metric` in a run with resolved (nested) `params`: the first
    alternative whose `when` settings all match; None if none does."""
    entry = recipe.thesis.get(metric)
    for number in entry if isinstance(entry, list) else [entry] if entry is not None else []:
        if all(_lookup(params, path) == (True, value) for path, value in number.when.items()):
            return number
    return None


def recipe_dir() -> Path:
    return Path(str(resources.files("owai.recipe_files")))


def available() -> dict[str, Path]:
    """Recipe id -> packaged file."""
    return {p.stem: p for p in sorted(recipe_dir().glob("*.yaml"))}


def load(name: str) -> Recipe:
    """Load a recipe by id (packaged) or by path to a YAML file, and validate it."""
    path = Path(name)
    known = available()
    if name.endswith((".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            what = "is a folder, not a file" if path.is_dir() else "does not exist"
            raise OwaiError(f"recipe file {name} {what}")
    elif name in known:  # a folder of that name (e.g. runs made with `-o .`) does not hide the recipe
        path = known[name]
    elif path.is_dir():
        raise OwaiError(f"recipe {name} is a folder, not a recipe id or YAML file (known: {', '.join(known) or 'none'})")
    else:
        raise OwaiError(f"unknown recipe {name!r}{did_you_mean(name, known)} (known: {', '.join(known) or 'none'})")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise OwaiError(f"cannot read recipe {path}: {getattr(e, 'strerror', None) or e}") from None
    recipe = parse(text, str(path))
    if recipe.id != path.stem and path.resolve().parent == recipe_dir().resolve():
        # packaged recipes are found by file name, so theirs must be their id; a user's file given
        # by path may be named anything (its id names the run directories: OUT/<id>/...)
        raise OwaiError(f"recipe {path}: id {recipe.id!r} does not match the file name; rename it to {recipe.id}.yaml")
    return recipe


def recorded_name(recipe_id: str, source: str | None) -> str:
    """What to load for a recipe recorded in a run/sweep: its file if it still exists (a user's own
    recipe), else its id (packaged recipes move with the installation)."""
    return source if source and Path(source).is_file() else recipe_id


def recipe_claims(recipe_id: str, source: str | None = None) -> list[dict[str, Any]]:
    """The claims of a recipe recorded in a run (empty if the recipe is gone)."""
    try:
        return load(recorded_name(recipe_id, source)).claims
    except OwaiError:
        return []


def parse(text: str, source: str) -> Recipe:
    """The recipe that YAML `text` (from file `source`) holds, checked; a copy of the one parsed before
    from the same text. Reading and checking a recipe takes ~50 ms (its presets built against the
    method's schema), and a study or a chain of stages loads its recipe many times in one process."""
    return copy.deepcopy(_parsed(text, source))


@functools.lru_cache(maxsize=128)
def _parsed(text: str, source: str) -> Recipe:
    try:
        data = load_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise OwaiError(f"recipe {source} is not valid YAML: {problem}{where}") from None
    if not isinstance(data, dict):
        raise OwaiError(f"recipe {source}: expected a mapping at top level, got {type(data).__name__}")
    recipe = build(Recipe, data, path=f"recipe {Path(source).stem}")
    recipe.source = source
    validate(recipe)
    return recipe


def validate(recipe: Recipe) -> None:
    """Structural checks beyond types; params and presets are checked against the method schema."""
    where = f"recipe {recipe.id}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", recipe.id):
        # it names the run directories (OUT/<id>/...): a '/' or '..' would put them outside OUT
        raise OwaiError(f"recipe id {recipe.id!r} must be a plain name (letters, digits, '.', '_', '-'; no '/' or leading '.')")
    if not recipe.reproduces:
        raise OwaiError(f"{where}: 'reproduces' must name at least one table or figure")
    for name in REQUIRED_PRESETS:
        if name not in recipe.presets:
            raise OwaiError(f"{where}: missing required preset {name!r}")
    if recipe.default_preset not in recipe.presets:
        raise OwaiError(f"{where}: default_preset {recipe.default_preset!r} is not a preset")
    for metric, entry in recipe.thesis.items():
        if entry == []:
            raise OwaiError(f"{where}: thesis {metric!r} is an empty list")
    if recipe.sweep is not None:
        _validate_sweep(recipe, where)
    check_claims(recipe.claims, recipe.id, list(recipe.presets))
    if not recipe.implemented:
        return
    schema = recipe.method_class().Config
    build(schema, recipe.params, path=f"{where} params")
    for name in recipe.presets:
        build(schema, recipe.params_for(name), path=f"{where} preset {name}")
    for metric, entry in recipe.thesis.items():
        for number in entry if isinstance(entry, list) else [entry]:
            for key in number.when:
                check_path(schema, key, f"{where}: thesis {metric} when {key}")
    if recipe.sweep is not None:
        spec = recipe.sweep
        grids = [spec.grid] + [p.grid for p in spec.presets.values() if p.grid is not None]
        for key in dict.fromkeys(k for g in grids for sub in sub_grids(g) for k in sub):
            check_path(schema, key, f"{where}: sweep grid {key}")


def check_path(schema: type, key: str, where: str) -> None:
    """A dotted path must name a parameter of the method's schema."""
    try:
        apply_overrides(schema, {}, [f"{key}=0"])
    except OwaiError as e:
        raise OwaiError(f"{where}: {str(e).split(': ', 1)[-1]}") from None


def _validate_sweep(recipe: Recipe, where: str) -> None:
    """Preset names, empty grids and value lists, and the selection's group keys."""
    spec = recipe.sweep
    assert spec is not None
    for name, own in spec.presets.items():
        if name not in recipe.presets:
            raise OwaiError(f"{where}: sweep preset {name!r} is not a preset (presets: {', '.join(recipe.presets)})")
        if own.seeds is not None and not own.seeds:
            raise OwaiError(f"{where}: sweep preset {name} has no seeds")
    if not spec.seeds:
        raise OwaiError(f"{where}: sweep has no seeds")
    labelled = [("sweep grid", spec.grid)] + [(f"sweep preset {n} grid", p.grid) for n, p in spec.presets.items()
                                              if p.grid is not None]
    for label, grid in labelled:
        if grid == []:
            raise OwaiError(f"{where}: {label} is an empty list (no points)")
        for sub in sub_grids(grid):
            for key, values in sub.items():
                if not values:
                    raise OwaiError(f"{where}: {label} {key!r} has no values")
    if spec.select is not None:
        per = spec.select.per
        if len(set(per)) != len(per):
            raise OwaiError(f"{where}: sweep select.per repeats a key")
        for name in recipe.presets:
            for sub in spec.for_preset(name)[0]:
                missing = [k for k in per if k not in sub]
                if missing:
                    raise OwaiError(f"{where}: sweep select.per key {missing[0]!r} is missing from a sub-grid of the "
                                    f"{name} preset's sweep grid")


def dump(recipe: Recipe) -> str:
    data = dataclasses.asdict(recipe)
    data.pop("source")
    return yaml.safe_dump(data, sort_keys=False)
