"""`owai bonsai`: invariant learning and Bonsai rich representations (thesis §2.3, App. A.8).

    owai bonsai                                        IRMv1 from random init on ColoredMNIST (one run, cpu preset)
    owai bonsai --method vrex --init erm               vREx after the ERM-init (anneal) phase
    owai bonsai --dataset inverse-coloredmnist --method pi
    owai bonsai --study                                Table 2.4: the recipe's grid x seeds, cross-seed selection
    owai bonsai --study --method irm,vrex --init rand,bonsai-cf --seeds 0,1
    owai bonsai --recipe fig2.7-anneal --study         any bonsai recipe (fig2.8-init, table2.5-pi, figA.2-twobits, ...)
    owai bonsai --dataset camelyon17 --study --data-root ~/data      (finds ~/data/camelyon17/, see `owai data list`)
    owai bonsai --study -p paper --executor slurm --cpus-per-task 2    Table 2.4's 2 600 points as a SLURM job array
    owai bonsai --resume runs/table2.4-coloredmnist/sweep-...   finish a killed study (finished points are skipped)

Without `--study` one run executes (one restart of one method/init); `--dataset/--method/--init` are
`--set` overrides of the recipe. With `--study` the recipe's sweep runs through the sweep facility
(comma-separated `--method/--init/--dataset` restrict its grid to those values; `--workers` or
`--executor slurm` spread its points), then the method's study selects hyper-parameters and epochs
across seeds as the thesis does and writes <stem>.md, <stem>.json and figures/<stem>.png into the
sweep directory. The default recipe follows the
dataset: table2.4-coloredmnist, table2.5-pi (inverse-coloredmnist), table2.6-camelyon17.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Annotated, Optional

import typer

from owai import console
from owai.commands._common import (DataRoot, Json, Launch, Out, Preset, Quiet, Sets, csv_values, data_root_sets, options,
                                  refuse_out_with_resume, run_recipe, run_study, set_str, study_recipe)
from owai.errors import OwaiError

METHODS = ("coloredmnist", "camelyon17", "twobits")  # the methods `owai bonsai` runs
RECIPE_FOR = {"coloredmnist": "table2.4-coloredmnist", "coloredmnist-gray": "table2.4-coloredmnist",
              "inverse-coloredmnist": "table2.5-pi", "inverse-coloredmnist-gray": "table2.5-pi",
              "camelyon17": "table2.6-camelyon17"}


def _study_functions(method: str):
    """(write_study, study_table) of a method module that has a study."""
    from owai.methods import REGISTRY

    module = importlib.import_module(REGISTRY[method].split(":")[0])
    if not hasattr(module, "write_study"):
        raise OwaiError(f"method {method!r} has no study; run it without --study")
    return module.write_study, module.study_table


@options
def bonsai(
    recipe: Annotated[Optional[str], typer.Option("--recipe", "-r", help="A bonsai recipe id (table2.4-coloredmnist, table2.5-pi, fig2.7-anneal, fig2.8-init, table2.6-camelyon17, figA.2-twobits, ...) or file.")] = None,
    dataset: Annotated[Optional[str], typer.Option("--dataset", "-d", help="coloredmnist (Table 2.4), inverse-coloredmnist (Table 2.5), their -gray oracles, or camelyon17 (Table 2.6); comma-separated with --study.")] = None,
    method: Annotated[Optional[str], typer.Option("--method", "-m", help="erm, irm, vrex, sd, iga, fish, fishr, clove, rsc, lff, groupdro, pi, rerm, mmd, coral (Camelyon17: erm, irm, vrex, clove); comma-separated with --study.")] = None,
    init: Annotated[Optional[str], typer.Option("--init", "-i", help="rand (from scratch: ColoredMNIST's penalty from step 0, Camelyon17's after penalty.anneal_iters ERM steps, Table 2.6's ERM rows), erm (ColoredMNIST: after penalty.anneal_iters ERM steps; Camelyon17: from round 0's trained network), bonsai, bonsai-cf (Bonsai, featurizer frozen), perfect (Fig 2.8, ColoredMNIST only); Camelyon17 also erm-cf, cat-cf, distill-cf (Table 2.3, --set networks=N), none; comma-separated with --study.")] = None,
    study: Annotated[bool, typer.Option("--study", help="Run the recipe's grid x seeds and write the selected table and figure.")] = False,
    grid: Annotated[Optional[list[str]], typer.Option("--grid", "-g", help="With --study: replace a grid key's values, --grid penalty.weight=1e3,1e4 (repeatable).")] = None,
    seeds: Annotated[Optional[str], typer.Option("--seeds", help="With --study: comma-separated seeds (default: the recipe's).")] = None,
    launch: Launch = Launch(),
    preset: Preset = None,
    sets: Sets = None,
    data_root: DataRoot = None,
    out: Out = None,
    resume: Annotated[Optional[Path], typer.Option("--resume", help="Continue a killed run directory, or a study's sweep directory.")] = None,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Invariant learning and Bonsai (sec 2.3): one run, or with --study a thesis table with its selection protocol."""
    from owai import sweep as sweeps

    console.configure(quiet, as_json)
    chosen = {"dataset": dataset, "method": method, "init": init}
    runs_on = launch.runs_on()
    spread = launch.spreads  # options for a study's points only
    if resume is not None:
        if recipe or any(chosen.values()) or grid or seeds is not None or preset or sets or data_root is not None:
            raise OwaiError("--resume takes its config from the run or sweep directory; drop the other options")
        refuse_out_with_resume(out)
        if sweeps.is_sweep_dir(resume):
            plan = sweeps.open_sweep(resume)
            write, table = _study_functions(study_recipe(plan.recipe, METHODS, plan.recipe_source).method)
            run_study(plan, runs_on, write, table, f"{plan.recipe}.md", f"owai bonsai --resume {plan.path}", quiet, as_json)
        else:
            if spread or study:
                raise OwaiError("--study/--workers/--executor are for a study; a run directory resumes as the one run it is")
            run_recipe(None, None, None, out, resume, quiet, as_json, methods=METHODS)
        return
    first_dataset = csv_values(dataset, "--dataset")[0] if dataset else None
    if recipe is None:
        if first_dataset is not None and first_dataset not in RECIPE_FOR:
            raise OwaiError(f"--dataset {first_dataset!r}: choose from {', '.join(RECIPE_FOR)}")
        recipe = RECIPE_FOR[first_dataset or "coloredmnist"]
    rec = study_recipe(recipe, METHODS)
    rec_method = rec.method
    if rec_method != "coloredmnist" and dataset is not None and rec_method != first_dataset:
        raise OwaiError(f"--dataset {dataset!r} does not apply to recipe {recipe!r} (method {rec_method})")
    if rec_method == "camelyon17":
        chosen["dataset"] = None  # the recipe names its dataset
    from owai.config import to_dict

    fields = to_dict(rec.method_class().Config())
    for key, value in chosen.items():
        if value is not None and key not in fields:
            raise OwaiError(f"--{key} does not apply to recipe {recipe!r} (method {rec_method})")
    sets = [*data_root_sets(data_root, recipe), *(sets or [])]
    if not study:
        if grid or seeds is not None or spread:
            raise OwaiError("--grid/--seeds/--workers/--executor need --study")
        overrides = []
        for key, value in chosen.items():
            if value is not None:
                if len(csv_values(value, f"--{key}")) > 1:
                    raise OwaiError(f"--{key} {value!r}: one value per run (several need --study)")
                overrides.append(set_str(key, value))  # a name stays a string (see set_str)
        run_recipe(recipe, preset, overrides + list(sets or []) or None, out, None, quiet, as_json)
        return
    wanted = {key: csv_values(value, f"--{key}") for key, value in chosen.items() if value is not None}
    write, table = _study_functions(rec_method)
    plan = sweeps.create(recipe, preset, list(sets or []), list(grid or []), sweeps.parse_seeds(seeds) if seeds is not None else None,
                         out, grid=restricted_grid(recipe, preset, wanted) if wanted else None, executor=runs_on[0])
    run_study(plan, runs_on, write, table, f"{plan.recipe}.md", f"owai bonsai --resume {plan.path}", quiet, as_json)


def restricted_grid(recipe: str, preset: str | None, wanted: dict[str, list[str]]) -> list[dict[str, list]]:
    """The recipe's (preset's) sweep grid cut to the wanted datasets/methods/inits: a sub-grid keeps
    the wanted values it has and is dropped when none is left; a sub-grid without the key takes the
    wanted values. (`--grid` would instead set the key in every sub-grid, repeating points.)"""
    from owai.recipes import load, sub_grids

    rec = load(recipe)
    kept = []
    for sub in sub_grids(rec.sweep.grid_for(preset or rec.default_preset)) if rec.sweep else [{}]:
        for key, values in wanted.items():
            sub[key] = [v for v in sub[key] if str(v) in values] if key in sub else list(values)
        if all(sub.values()) and sub not in kept:
            kept.append(sub)
    if not kept:
        raise OwaiError(f"recipe {rec.id!r} has no sweep point with " + " ".join(f"--{k} {','.join(v)}" for k, v in wanted.items()))
    return kept


def register(app: typer.Typer) -> None:
    app.command("bonsai")(bonsai)
