"""Options and the run-and-report path shared by the method subcommands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

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
