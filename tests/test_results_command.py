"""The command that results.json and `owai report` print for a run repeats that run: parsed by the
CLI's own parser, it names the run's recipe (forty-third session: it named only the method's
command, `owai mosaic-train --preset cpu` for a fig3.9-posloss run, which runs fig3.8-depth)."""

from __future__ import annotations

import shlex

import pytest

from conftest import parse_owai
from owai import recipes
from owai.experiment import command_line


@pytest.mark.parametrize("rid", sorted(recipes.available()))
def test_the_printed_command_runs_the_same_recipe(rid):
    recipe = recipes.load(rid)
    if not recipe.implemented:
        pytest.skip(f"{rid} is not implemented")
    line = command_line(recipe, recipe.default_preset, ["seed=3"])
    words = shlex.split(line)
    assert words[0] == "owai"
    cmd, params = parse_owai(words[1:])
    named = params.get("recipe")
    # mosaic-eval (one recipe, no --recipe option) and `owai recipes run ID` name it by the command
    assert named == rid or (named is None and rid in words), (line, named)
    assert params.get("preset") == recipe.default_preset and "seed=3" in (params.get("sets") or []), (line, params)
