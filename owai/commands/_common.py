"""Options and the run-and-report path shared by the method subcommands."""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer

from owai import console

Preset = Annotated[Optional[str], typer.Option("--preset", "-p", help="Scale preset (cpu is the default; paper = thesis settings).")]
Sets = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override a parameter: --set train.lr=1e-3 (repeatable).")]
Out = Annotated[Path, typer.Option("--out", "-o", help="Root for run directories: OUT/<recipe>/<time>-<hash>/.")]
Resume = Annotated[Optional[Path], typer.Option("--resume", help="Continue a killed run from its last checkpoint.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or info; errors still print.")]
Json = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout (nothing else).")]


def run_recipe(
    recipe: str | None, preset: str | None, sets: list[str] | None, out: Path, resume: Path | None, quiet: bool, as_json: bool
) -> None:
    """Execute a recipe (or resume a run) and print its measured-vs-thesis table."""
    from owai.experiment import execute
    from owai.report import table

    console.configure(quiet, as_json)
    run, results = execute(recipe, preset, sets or [], out, resume)
    if not run.writes:  # a non-zero torchrun rank: rank 0 reports
        return
    if as_json:
        console.emit_json(results)
    elif not quiet:
        console.stdout.print(table(results))
        console.stdout.print(f"results: {run.path / 'results.json'}")


def csv_values(text: str, option: str) -> list[str]:
    """The distinct values of a comma-separated option; none or a repeat is a user error."""
    from owai.errors import OwaiError

    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or len(set(items)) != len(items):
        raise OwaiError(f"{option} {text!r}: give distinct comma-separated values")
    return items


def study_recipe(recipe: str, methods: str | tuple[str, ...], source: str | None = None) -> Any:
    """The recipe a command runs; it must be a recipe of one of the command's `methods`. `source`
    is the recipe source a sweep recorded (`recorded_name`), for a study being resumed."""
    from owai.errors import OwaiError
    from owai.recipes import load, recorded_name

    methods = (methods,) if isinstance(methods, str) else methods
    rec = load(recorded_name(recipe, source) if source is not None else recipe)
    if rec.method not in methods:
        allowed = methods[0] if len(methods) == 1 else f"{', '.join(methods[:-1])} or {methods[-1]}"
        raise OwaiError(f"recipe {rec.id!r} runs method {rec.method!r}, not {allowed}")
    return rec


def open_study(resume: Path, method: str, what: str, other_options: bool) -> Any:
    """The sweep directory a study command resumes; it must be a sweep of `method`, and the plan
    comes from it alone (`other_options`: the command was also given options that set one)."""
    from owai import sweep as sweeps
    from owai.errors import OwaiError
    from owai.recipes import load, recorded_name

    if other_options:
        raise OwaiError("--resume takes its plan from SWEEP_DIR/sweep.json; drop the other options")
    plan = sweeps.open_sweep(resume)
    if load(recorded_name(plan.recipe, plan.recipe_source)).method != method:
        raise OwaiError(f"{resume} is a sweep of {plan.recipe}, not {what}")
    return plan


def run_study(plan: Any, workers: int, write_study: Callable[[Any, dict[str, Any]], tuple[list[dict[str, Any]], dict[str, Any]]],
              study_table: Callable[[list[dict[str, Any]], str], Any], table_name: str, rerun: str,
              quiet: bool, as_json: bool) -> None:
    """Run a study's sweep (unfinished points only), summarise it, write the study's files, print
    its table (or JSON), then report failed points with how to rerun them."""
    from owai import sweep as sweeps

    console.info(f"sweep directory: {plan.path} ({len(plan.points)} points)")
    outcomes = sweeps.run(plan, "local", workers)
    summary = sweeps.write_summary(plan, outcomes)
    failed = sweeps.failures(summary)
    rows, info = write_study(plan, summary)
    if as_json:
        console.emit_json({"rows": rows, **info, "sweep_dir": str(plan.path), "failed": [p["label"] for p in failed]})
    elif not quiet:
        console.stdout.print(study_table(rows, info["title"]))
        console.stdout.print(f"table: {info.get('table') or plan.path / table_name}\nfigure: {info['figure']}")
    sweeps.raise_on_failures(summary, rerun)
