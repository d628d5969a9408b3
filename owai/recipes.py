"""Recipes: one YAML file per thesis table or figure, validated on load.

A recipe names what it reproduces, the method that runs it, the method's parameters, scale
presets (at least `cpu`, the default, and `paper`, the thesis's own settings), the thesis's
reported numbers, and optionally a sweep (grid and seeds). Recipes ship inside the package
(`owai.recipe_files`, the repository's `recipes/` folder); a path to any YAML file works too.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from owai.config import build, load_yaml, merge
from owai.errors import OwaiError
from owai.methods import Method, is_registered, method_class

REQUIRED_PRESETS = ("cpu", "paper")


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


@dataclasses.dataclass
class SweepSpec:
    """A grid over dotted parameter paths, crossed with seeds."""

    grid: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    seeds: list[int] = dataclasses.field(default_factory=lambda: [0])


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
    thesis: dict[str, ThesisNumber] = dataclasses.field(default_factory=dict)
    sweep: SweepSpec | None = None
    source: str = ""  # where the recipe was loaded from (filled by the loader)

    @property
    def implemented(self) -> bool:
        return is_registered(self.method)

    @property
    def references(self) -> str:
        return ", ".join(f"{r.ref} (sec {r.section})" for r in self.reproduces)

    def method_class(self) -> type[Method]:
        return method_class(self.method)

    def params_for(self, preset: str | None) -> dict[str, Any]:
        """The recipe's params with one preset applied (not yet validated against the schema)."""
        name = preset or self.default_preset
        if name not in self.presets:
            raise OwaiError(f"recipe {self.id!r} has no preset {name!r} (presets: {', '.join(self.presets)})")
        return merge(self.params, self.presets[name] or {})


def recipe_dir() -> Path:
    return Path(str(resources.files("owai.recipe_files")))


def available() -> dict[str, Path]:
    """Recipe id -> packaged file."""
    return {p.stem: p for p in sorted(recipe_dir().glob("*.yaml"))}


def load(name: str) -> Recipe:
    """Load a recipe by id (packaged) or by path to a YAML file, and validate it."""
    path = Path(name)
    if name.endswith((".yaml", ".yml")) or path.exists():
        if not path.is_file():
            raise OwaiError(f"recipe file {name} does not exist")
    else:
        known = available()
        if name not in known:
            raise OwaiError(f"unknown recipe {name!r} (known: {', '.join(known) or 'none'})")
        path = known[name]
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise OwaiError(f"cannot read recipe {path}: {getattr(e, 'strerror', None) or e}") from None
    recipe = parse(text, str(path))
    if recipe.id != path.stem:
        raise OwaiError(f"recipe {path}: id {recipe.id!r} does not match the file name")
    return recipe


def recorded_name(recipe_id: str, source: str | None) -> str:
    """What to load for a recipe recorded in a run/sweep: its file if it still exists (a user's own
    recipe), else its id (packaged recipes move with the installation)."""
    return source if source and Path(source).is_file() else recipe_id


def parse(text: str, source: str) -> Recipe:
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
    if not recipe.reproduces:
        raise OwaiError(f"{where}: 'reproduces' must name at least one table or figure")
    for name in REQUIRED_PRESETS:
        if name not in recipe.presets:
            raise OwaiError(f"{where}: missing required preset {name!r}")
    if recipe.default_preset not in recipe.presets:
        raise OwaiError(f"{where}: default_preset {recipe.default_preset!r} is not a preset")
    if not recipe.implemented:
        return
    schema = recipe.method_class().Config
    build(schema, recipe.params, path=f"{where} params")
    for name in recipe.presets:
        build(schema, recipe.params_for(name), path=f"{where} preset {name}")
    if recipe.sweep is not None:
        from owai.config import apply_overrides

        for key, values in recipe.sweep.grid.items():
            if not values:
                raise OwaiError(f"{where}: sweep grid {key!r} has no values")
            apply_overrides(schema, {}, [f"{key}=0"])  # the path must exist


def dump(recipe: Recipe) -> str:
    data = dataclasses.asdict(recipe)
    data.pop("source")
    return yaml.safe_dump(data, sort_keys=False)
