"""`owai sweep`: a recipe over a parameter grid and seeds, locally or on SLURM, resumable.

    owai sweep three-moons --seeds 100,101,102
    owai sweep three-moons --grid train.lr=1e-2,3e-3 --workers 2
    owai sweep three-moons --executor slurm --partition gpu --gpus-per-node 1 --timeout-min 120
    owai sweep --resume runs/three-moons/sweep-20250101-120000-1a2b3c4d
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from owai import console
from owai.commands._common import (Json, Launch, Preset, Quiet, RecipeOption, Sets, one_recipe, options, refuse_out_with_resume,
                                  resumable_dir, run_sweep)
from owai.errors import OwaiError


@options
def sweep(
    recipe: Annotated[Optional[str], typer.Argument(help="Recipe id or path to a recipe YAML file (omit with --resume).")] = None,
    recipe_option: RecipeOption = None,
    preset: Preset = None,
    sets: Sets = None,
    grid: Annotated[Optional[list[str]], typer.Option(
        "--grid", "-g", help="Sweep a parameter: --grid train.lr=1e-2,3e-3 (repeatable; replaces that key's values in every "
        "sub-grid of the recipe's grid that has it, else adds the key to every sub-grid).")] = None,
    seeds: Annotated[Optional[str], typer.Option("--seeds", help="Comma-separated seeds, e.g. 0,1,2 (default: the preset's, else the recipe's sweep seeds, else the run's seed).")] = None,
    launch: Launch = Launch(),
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Root for sweep directories (default: runs): OUT/<recipe>/sweep-<time>-<hash>/.", show_default=False)] = None,
    resume: Annotated[Optional[Path], typer.Option("--resume", help="Continue a sweep directory: run only its unfinished points.")] = None,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Run a recipe over a parameter grid x seeds; every point is a normal run directory. Prints mean ± std over
    seeds (and, when the recipe's sweep has a `select`, the best grid cell per group)."""
    from owai import sweep as sweeps

    console.configure(quiet, as_json)
    recipe = one_recipe(recipe, recipe_option)
    runs_on = launch.runs_on()
    if resume is not None:
        if recipe or preset or sets or grid or seeds is not None:
            raise OwaiError("--resume takes its plan from SWEEP_DIR/sweep.json; drop RECIPE/--preset/--set/--grid/--seeds")
        refuse_out_with_resume(out)
        resumable_dir(resume, "sweep")
        plan = sweeps.open_sweep(resume)
    else:
        if not recipe:
            raise OwaiError("name a RECIPE to sweep (or --resume SWEEP_DIR)")
        plan = sweeps.create(recipe, preset, sets or [], grid or [], sweeps.parse_seeds(seeds) if seeds is not None else None, out,
                             executor=runs_on[0])
    run_sweep(plan, runs_on, f"--resume {plan.path}", quiet, as_json)


def register(app: typer.Typer) -> None:
    app.command("sweep")(sweep)
