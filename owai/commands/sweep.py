"""`owai sweep`: a recipe over a parameter grid and seeds, locally or on SLURM, resumable.

    owai sweep three-moons --seeds 100,101,102
    owai sweep three-moons --grid train.lr=1e-2,3e-3 --workers 2
    owai sweep three-moons --executor slurm --partition gpu --gpus-per-node 1 --timeout-min 120
    owai sweep --resume runs/three-moons/sweep-20250101-120000-1a2b3c4d
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from owai import console
from owai.commands._common import Json, Preset, Quiet, Sets
from owai.errors import OwaiError

SLURM = "SLURM (--executor slurm)"


class Executor(str, Enum):
    local = "local"
    slurm = "slurm"
    submitit_debug = "submitit-debug"


def sweep(
    recipe: Annotated[Optional[str], typer.Argument(help="Recipe id or path to a recipe YAML file (omit with --resume).")] = None,
    preset: Preset = None,
    sets: Sets = None,
    grid: Annotated[Optional[list[str]], typer.Option(
        "--grid", "-g", help="Sweep a parameter: --grid train.lr=1e-2,3e-3 (repeatable; replaces that key's values in every "
        "sub-grid of the recipe's grid that has it, else adds the key to every sub-grid).")] = None,
    seeds: Annotated[Optional[str], typer.Option("--seeds", help="Comma-separated seeds, e.g. 0,1,2 (default: the preset's, else the recipe's sweep seeds).")] = None,
    workers: Annotated[int, typer.Option("--workers", "-w", min=1, help="Local worker processes (1: run points one by one in this process).")] = 1,
    executor: Annotated[Executor, typer.Option("--executor", "-e", help="local, slurm (via submitit), or submitit-debug (submitit in-process).")] = Executor.local,
    partition: Annotated[Optional[str], typer.Option("--partition", help="SLURM partition.", rich_help_panel=SLURM)] = None,
    gpus_per_node: Annotated[Optional[int], typer.Option("--gpus-per-node", min=0, help="GPUs per job.", rich_help_panel=SLURM)] = None,
    cpus_per_task: Annotated[Optional[int], typer.Option("--cpus-per-task", min=1, help="CPUs per job (also its torch threads).", rich_help_panel=SLURM)] = None,
    timeout_min: Annotated[Optional[int], typer.Option("--timeout-min", min=1, help="Time limit per job in minutes (default 240).", rich_help_panel=SLURM)] = None,
    mem_gb: Annotated[Optional[float], typer.Option("--mem-gb", min=0, help="Memory per job in GB.", rich_help_panel=SLURM)] = None,
    array_parallelism: Annotated[Optional[int], typer.Option("--array-parallelism", min=1, help="Jobs running at once (default: all).", rich_help_panel=SLURM)] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Root for sweep directories: OUT/<recipe>/sweep-<time>-<hash>/.")] = Path("runs"),
    resume: Annotated[Optional[Path], typer.Option("--resume", help="Continue a sweep directory: run only its unfinished points.")] = None,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Run a recipe over a parameter grid x seeds; every point is a normal run directory. Prints mean ± std over
    seeds (and, when the recipe's sweep has a `select`, the best grid cell per group)."""
    from owai import sweep as sweeps

    console.configure(quiet, as_json)
    slurm = sweeps.SlurmOptions(partition, gpus_per_node, cpus_per_task, timeout_min, mem_gb, array_parallelism)
    if executor is Executor.local and any(v is not None for v in vars(slurm).values()):
        raise OwaiError("SLURM options (--partition, --gpus-per-node, ...) need --executor slurm")
    sweeps.check_executor(executor.value, workers)
    if resume is not None:
        if recipe or preset or sets or grid or seeds:
            raise OwaiError("--resume takes its plan from SWEEP_DIR/sweep.json; drop RECIPE/--preset/--set/--grid/--seeds")
        plan = sweeps.open_sweep(resume)
    else:
        if not recipe:
            raise OwaiError("name a RECIPE to sweep (or --resume SWEEP_DIR)")
        plan = sweeps.create(recipe, preset, sets or [], grid or [], sweeps.parse_seeds(seeds) if seeds else None, out)
    console.info(f"sweep directory: {plan.path} ({len(plan.points)} points)")
    outcomes = sweeps.run(plan, executor.value, workers, slurm)
    summary = sweeps.write_summary(plan, outcomes)
    if as_json:
        console.emit_json(summary)
    elif not quiet:
        console.stdout.print(sweeps.table(summary))
        console.stdout.print(f"summary: {plan.path / sweeps.SUMMARY}")
    sweeps.raise_on_failures(summary, f"--resume {plan.path}")


def register(app: typer.Typer) -> None:
    app.command("sweep")(sweep)
