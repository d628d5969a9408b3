"""`owai eval`: evaluations of trained models, one subcommand per benchmark.

    owai eval posloss MODEL_DIR... [--dataset wikipedia --config-name 20220301.simple]
        per-position loss (Fig 3.9) and validation loss; the same as `owai mosaic-eval --posloss-only`
"""

from __future__ import annotations

from pathlib import Path
import typer

from owai.commands._common import Json, Out, Preset, Quiet, Sets, run_recipe
from owai.commands.mosaic import EVAL_RECIPE, ConfigName, Context, Dataset, Models, eval_overrides

eval_app = typer.Typer(help="Evaluate trained models: per-position loss (posloss).", no_args_is_help=True)


@eval_app.command("posloss")
def posloss(
    models: Models,
    dataset: Dataset = None,
    config_name: ConfigName = None,
    context: Context = None,
    preset: Preset = None,
    sets: Sets = None,
    out: Out = Path("runs"),
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Average loss at each position of the context window (Fig 3.9), for saved language models."""
    run_recipe(EVAL_RECIPE, preset, eval_overrides(models, dataset, config_name, context, True) + list(sets or []), out, None, quiet, as_json)


def register(app: typer.Typer) -> None:
    app.add_typer(eval_app, name="eval")
