"""`owai recipes run ID` runs the command `owai recipes list` prints for the recipe (forty-third
session: it made one run of the recipe's parameters, so a study recipe ran one point of its grid and a
rich-features recipe one network of its chain, and no claim was judged); `--single` and `--resume`
make one run."""

from __future__ import annotations

import pytest

from conftest import cli_in_process, parse_owai
from owai import cli, recipes
from owai.commands._common import RunOptions


@pytest.mark.parametrize("rid", sorted(recipes.available()))
def test_the_delegated_command_is_the_listed_one_and_parses(rid):
    recipe = recipes.load(rid)
    if not recipe.implemented:
        pytest.skip(f"{rid} is not implemented")
    argv = cli.delegated_run(rid, RunOptions(preset=recipe.default_preset, sets=["seed=3"], tracker="tensorboard",
                                             quiet=True))
    listed = cli.recipe_command(recipe)
    if listed[1:3] == ["recipes", "run"] or any(w.endswith("...") for w in listed):
        assert argv is None  # recipes run is the command itself (the recall recipe), or needs models (mosaic-eval)
        return
    assert argv[:len(listed) - 1] == listed[1:]
    _, params = parse_owai(argv)
    assert params.get("recipe") == rid and params.get("preset") == recipe.default_preset
    # list(): Click keeps a repeated option as a tuple, Typer >= 0.29 as a list; owai is handed a list either way
    assert list(params.get("sets") or ()) == ["seed=3", "runtime.tracker=tensorboard"] and params.get("quiet") is True


@pytest.fixture
def subcommands(monkeypatch) -> list[list[str]]:
    """The arguments of every subcommand `recipes run` hands the recipe to (which then does nothing)."""
    calls: list[list[str]] = []
    monkeypatch.setattr(cli, "run_subcommand", lambda argv: calls.append(list(argv)) or 0)
    return calls


def test_a_study_recipe_runs_its_study(subcommands, capsys, tmp_path):
    code, _, err = cli_in_process(["recipes", "run", "fig2.11-scratch", "-p", "cpu", "-s", "seed=3", "-o", str(tmp_path), "-q"],
                                  capsys)
    assert code == 0, err
    assert subcommands == [["dropout-ft", "--recipe", "fig2.11-scratch", "--preset", "cpu", "--set", "seed=3",
                                "--out", str(tmp_path), "--quiet"]]


def test_a_recipe_file_is_passed_on_as_a_file(subcommands, capsys, tmp_path):
    path = recipes.available()["table2.4-coloredmnist"]
    code, _, err = cli_in_process(["recipes", "run", str(path), "-q"], capsys)
    assert code == 0, err
    assert subcommands[0][:4] == ["bonsai", "--recipe", str(path), "--study"]


def test_single_and_resume_make_one_run_without_a_subcommand(subcommands, capsys, tmp_path):
    code, _, err = cli_in_process(["recipes", "run", "fig2.11-scratch", "--single", "-p", "nope"], capsys)
    assert code == 2 and "has no preset 'nope'" in err and err.count("\n") == 1, err
    code, _, err = cli_in_process(["recipes", "run", "fig2.11-scratch", "--resume", str(tmp_path / "missing")], capsys)
    assert code == 2 and err.startswith("error:"), err
    assert subcommands == []


def test_the_subcommand_refuses_bad_input_in_one_line(capsys):
    code, _, err = cli_in_process(["recipes", "run", "fig2.11-scratch", "-p", "nope"], capsys)
    assert code == 2 and "nope" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("rid", ["fig2.11-scratch", "tableA.2-resnet152", "fig3.10-regbench", "fig3.9-posloss"])
def test_a_run_records_a_command_that_makes_that_one_run(rid):
    """A point of a study (dropout-ft, regbench) or a step of a chain (rich-features) records
    `recipes run ID --single`: the method's own command would run the whole study or chain."""
    from owai.experiment import command_line

    recipe = recipes.load(rid)
    line = command_line(recipe, "cpu", ["seed=3"])
    single = not recipe.method_class().one_run_command
    assert single == (rid != "fig3.9-posloss")
    assert line.startswith(f"owai recipes run {rid} --single --preset cpu") if single else "--single" not in line
    _, params = parse_owai(line.split()[1:])
    assert params.get("single", False) is single
