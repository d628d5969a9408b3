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


@pytest.fixture
def executed(monkeypatch) -> list[tuple]:
    """What `owai ...` asks `experiment.execute` to run (recipe, preset, overrides); nothing runs."""
    import owai.experiment

    calls: list[tuple] = []

    def record(recipe, preset, overrides, *args, **kwargs):
        calls.append((recipe, preset, list(overrides)))
        raise KeyboardInterrupt  # stop there: the command line has been parsed and checked

    monkeypatch.setattr(owai.experiment, "execute", record)
    return calls


def _runs(line: str, capsys) -> tuple:
    from conftest import cli_in_process

    return cli_in_process(shlex.split(line)[1:], capsys)


@pytest.mark.parametrize("rid", sorted(recipes.available()))
def test_the_printed_command_makes_the_same_run(rid, executed, capsys, tmp_path):
    """Run (up to `execute`) the recorded command: the same recipe, preset and overrides, by every
    method's command (forty-third session: mosaic-eval's `owai mosaic-eval --preset cpu --set
    models=[...]` refused to start, its command taking the models as MODEL_DIR arguments)."""
    recipe = recipes.load(rid)
    if not recipe.implemented:
        pytest.skip(f"{rid} is not implemented")
    sets = ["seed=3"] if rid != "mosaic-eval" else [f'models=["{tmp_path / "a run"}"]', "seed=3"]
    _runs(command_line(recipe, recipe.default_preset, sets), capsys)
    assert len(executed) == 1, capsys.readouterr()
    name, preset, overrides = executed[0]
    assert recipes.load(name).source == recipe.source and preset == recipe.default_preset and overrides == sets


@pytest.mark.parametrize("rid", ["three-moons", "figA.2-twobits", "fig3.9-posloss", "fig2.11-scratch"])
def test_a_recipe_file_is_named_by_its_path(rid, executed, capsys, tmp_path):
    """A run of a recipe file records the file: `--recipe ID` named no recipe (or a built-in one),
    and twobits / three-moons, whose commands name their own recipe, refused a second one."""
    text = recipes.load(rid).source.read_text() if hasattr(recipes.load(rid).source, "read_text") else None
    path = tmp_path / "my recipe.yaml"
    path.write_text((text or open(recipes.load(rid).source).read()).replace(f"id: {rid}", "id: my-copy", 1))
    recipe = recipes.load(str(path))
    assert recipe.id == "my-copy"
    line = command_line(recipe, recipe.default_preset, ["seed=3"])
    assert str(path) in shlex.split(line), line
    _runs(line, capsys)
    assert len(executed) == 1, capsys.readouterr()
    assert recipes.load(executed[0][0]).source == recipe.source and executed[0][2] == ["seed=3"]
