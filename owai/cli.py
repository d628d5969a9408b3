"""The `owai` command: core commands (recipes, report) plus one subcommand per thesis method.

Method subcommands live in `owai.commands.<name>` and are discovered at start-up, so only the
implemented ones appear in --help. Every user error is one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from owai import __version__, console
from owai.commands._common import Json, Out, Preset, Quiet, Resume, Sets, run_recipe
from owai.errors import OwaiError

app = typer.Typer(
    name="owai",
    help="AI for the Open-World (J. Zhang, NYU 2025): the thesis's learning principles, reproducible.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
recipes_app = typer.Typer(help="List, show and run the thesis recipes (one per table or figure).", no_args_is_help=True)
app.add_typer(recipes_app, name="recipes")


def _version(value: bool) -> None:
    if value:
        console.stdout.print(f"owai {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    """AI for the Open-World (J. Zhang, NYU 2025): the thesis's learning principles, reproducible."""


@recipes_app.command("list")
def recipes_list(quiet: Quiet = False, as_json: Json = False) -> None:
    """List recipes: id, thesis reference, presets, implemented status."""
    from rich.table import Table

    from owai import recipes

    console.configure(quiet, as_json)
    loaded = [recipes.load(name) for name in recipes.available()]
    rows = [
        {"id": r.id, "reproduces": r.references, "presets": list(r.presets), "default": r.default_preset,
         "implemented": r.implemented, "command": r.method_class().cli if r.implemented else ""}
        for r in loaded
    ]
    if as_json:
        console.emit_json(rows)
        return
    table = Table(title="owai recipes")
    for col in ("id", "reproduces", "presets", "implemented", "command"):
        table.add_column(col)
    for row in rows:
        presets = ", ".join(f"[bold]{p}[/bold]" if p == row["default"] else p for p in row["presets"])
        table.add_row(row["id"], row["reproduces"], presets, "yes" if row["implemented"] else "no", row["command"])
    console.stdout.print(table)


@recipes_app.command("show")
def recipes_show(
    recipe: Annotated[str, typer.Argument(help="Recipe id or path to a recipe YAML file.")],
    preset: Preset = None,
    sets: Sets = None,
    as_json: Json = False,
) -> None:
    """Show a recipe and, with --preset/--set, the fully resolved parameters."""
    import yaml

    from owai import recipes
    from owai.experiment import resolve

    console.configure(False, as_json)
    r = recipes.load(recipe)
    resolved = resolve(r, preset, sets or [])[1] if r.implemented else None
    if as_json:
        console.emit_json({"recipe": yaml.safe_load(recipes.dump(r)), "resolved": resolved})
        return
    console.stdout.print(recipes.dump(r), markup=False)
    if resolved is not None:
        console.stdout.print(f"# resolved params (preset {resolved['preset']}):", markup=False)
        console.stdout.print(yaml.safe_dump(resolved["params"], sort_keys=False), markup=False)


@recipes_app.command("run")
def recipes_run(
    recipe: Annotated[str, typer.Argument(help="Recipe id or path to a recipe YAML file.")],
    preset: Preset = None,
    sets: Sets = None,
    out: Out = Path("runs"),
    resume: Resume = None,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Run any recipe (the same path as its method's subcommand)."""
    run_recipe(recipe, preset, sets, out, resume, quiet, as_json)


@app.command("report")
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (or a sweep directory).")],
    markdown: Annotated[bool, typer.Option("--markdown", help="Print a Markdown table instead.")] = False,
    as_json: Json = False,
) -> None:
    """Print a run's measured numbers beside the thesis's (a sweep's: mean ± std over seeds)."""
    from owai import sweep
    from owai.report import markdown as to_markdown
    from owai.report import table
    from owai.runs import Run

    console.configure(False, as_json)
    if sweep.is_sweep_dir(run_dir):
        summary = sweep.summarise(sweep.open_sweep(run_dir))
        if as_json:
            console.emit_json(summary)
        elif markdown:
            sys.stdout.write(sweep.markdown(summary))
        else:
            console.stdout.print(sweep.table(summary))
        return
    results = Run.open(run_dir).results()
    if results is None:
        raise OwaiError(f"{run_dir} has no results.json yet (status: {Run(run_dir).status()}); resume it with --resume")
    if as_json:
        console.emit_json(results)
    elif markdown:
        sys.stdout.write(to_markdown(results))
    else:
        console.stdout.print(table(results))


def _register_commands() -> None:
    import owai.commands

    for info in sorted(pkgutil.iter_modules(owai.commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"owai.commands.{info.name}").register(app)


_register_commands()


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point: user errors become one line and exit code 2, never a traceback.

    Typer's standalone mode handles usage errors (exit 2), --help and Ctrl-C itself.
    """
    try:
        app(args=argv)
    except OwaiError as e:
        console.stderr.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 - the last line of defence against tracebacks
        if os.environ.get("OWAI_DEBUG"):
            raise
        console.stderr.print(f"internal error: {type(e).__name__}: {e} (set OWAI_DEBUG=1 for the traceback)", markup=False, soft_wrap=True)
        sys.exit(1)
