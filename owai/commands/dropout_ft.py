"""`owai dropout-ft`: very-large dropout fine-tuning against ensembles and weight averaging (thesis §2.4).

    owai dropout-ft                                          Table 2.8's cpu preset (RotatedMNIST domains)
    owai dropout-ft -p paper --dataset pacs --data-root ~/data     (~/data/domainbed/PACS/; --root is an alias)
    owai dropout-ft --recipe table2.11-dropout-rate --test-domain 0,1 --workers 2
    owai dropout-ft -p paper --dataset pacs --data-root ~/data --executor slurm --gpus-per-node 1
    owai dropout-ft --resume runs/table2.8-dropout/sweep-...   finish a killed study (finished points are skipped)

The recipe's grid (test domains x dropout x lr x weight decay x seeds) runs through the sweep
facility; then the study selects hyper-parameters by IID validation per test domain and variant,
combines the final networks of the grid's runs (Ens-multi, WA-multi) and writes dropout_ft.md,
dropout_ft.json and figures/dropout_ft.png into the sweep directory. `--executor slurm` (with
`owai sweep`'s SLURM options) runs the grid's points as one submitit job array and waits for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from owai import console
from owai.commands._common import (DATA_ROOT_HELP, Json, Launch, Out, Preset, Quiet, Sets, csv_values, data_root_sets, open_study,
                                  options, run_study, set_str, study_recipe)

RECIPE = "table2.8-dropout"


@options
def dropout_ft(
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="A dropout-ft recipe id (table2.8-dropout, table2.9-last-lr, ...) or file.")] = RECIPE,
    dataset: Annotated[Optional[str], typer.Option(
        "--dataset", "-d", help="pacs, vlcs, office_home, terra_incognita, imagefolder or rotated-mnist (comma-separated: several).")] = None,
    data_root: Annotated[Optional[Path], typer.Option("--data-root", "--root", help=DATA_ROOT_HELP + " --root is an alias.", show_default=False)] = None,
    test_domain: Annotated[Optional[str], typer.Option("--test-domain", "-t", help="Comma-separated held-out domain indices.")] = None,
    dropout: Annotated[Optional[str], typer.Option("--dropout", help="Comma-separated dropout rates on the penultimate features.")] = None,
    backbone: Annotated[Optional[str], typer.Option("--backbone", help="resnet50, vit_l_16, resnet18, ...")] = None,
    weights: Annotated[Optional[str], typer.Option("--weights", help="IMAGENET1K_V1 (ResNet #1), IMAGENET1K_V2 (ResNet #2), a file, or '' (scratch).")] = None,
    preset: Preset = None,
    sets: Sets = None,
    grid: Annotated[Optional[list[str]], typer.Option("--grid", "-g", help="Replace a grid key's values: --grid train.lr=1e-3,5e-4 (repeatable).")] = None,
    seeds: Annotated[Optional[str], typer.Option("--seeds", help="Comma-separated seeds (default: the recipe's).")] = None,
    launch: Launch = Launch(),
    out: Out = None,
    resume: Annotated[Optional[Path], typer.Option("--resume", help="Continue a dropout-ft sweep directory (skips finished points).")] = None,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Very-large dropout fine-tuning (Tables 2.8-2.12, Fig 2.10/2.11): DomainBed grid, IID selection, ensembles and weight averages."""
    from owai import sweep as sweeps
    from owai.methods.dropout_ft import study_device, study_table, write_study

    console.configure(quiet, as_json)
    runs_on = launch.runs_on()
    if resume is not None:
        given = any(v is not None for v in (dataset, data_root, test_domain, dropout, backbone, weights, preset, sets, grid, seeds))
        plan = open_study(resume, "dropout_ft", "a dropout-ft study", given or recipe != RECIPE, out)
    else:
        rec = study_recipe(recipe, "dropout_ft")
        extra_sets = [*(sets or [])]
        no_pretrain = pretrain_off(rec, preset, dataset, weights, extra_sets)
        if no_pretrain:
            extra_sets.append("pretrain.steps=0")
        extra_sets += data_root_sets(data_root)
        if backbone is not None:
            extra_sets.append(set_str("model.backbone", backbone))
        if weights is not None:
            extra_sets.append(set_str("model.weights", weights))  # quoted: a path may hold a quote or ' #'
        extra_grid = [*(grid or [])]
        for key, text, option in (("data.dataset", dataset, "--dataset"), ("data.test_domain", test_domain, "--test-domain"),
                                  ("model.dropout", dropout, "--dropout")):
            if text is not None:
                extra_grid.append(f"{key}={','.join(csv_values(text, option))}")
        plan = sweeps.create(recipe, preset, extra_sets, extra_grid, sweeps.parse_seeds(seeds) if seeds is not None else None, out,
                             executor=runs_on[0], user_sets=list(sets or []))
        if no_pretrain:  # said once the study is valid: bad input stays one line on stderr
            console.info("pretrain stage off: a real dataset or --weights replaces the preset's offline pre-training "
                         f"(the backbone starts from model.weights={weights if weights is not None else ''!r})")
    run_study(plan, runs_on, lambda sweep, summary: write_study(sweep, summary, study_device(summary)), study_table, "dropout_ft.md",
              f"owai dropout-ft --resume {plan.path}", quiet, as_json)


def pretrain_off(rec: Any, preset: str | None, dataset: str | None, weights: str | None, sets: list[str]) -> bool:
    """Whether to switch off the preset's `pretrain` stage (the offline stand-in for ImageNet
    pre-training on rotated-mnist): when --dataset names only other datasets, or --weights is given,
    and no --set chooses pretrain.steps itself."""
    from owai.config import parse_override
    from owai.sweep import sub_grids

    if any(parse_override(text)[0] == ["pretrain", "steps"] for text in sets):
        return False
    if not rec.params_for(preset or rec.default_preset).get("pretrain", {}).get("steps", 0):
        return False
    if rec.sweep and any("pretrain.steps" in sub for sub in sub_grids(rec.sweep.grid_for(preset or rec.default_preset))):
        return False  # the study sweeps the stage's length itself (table2.12): its points say what they need
    other_data = dataset is not None and "rotated-mnist" not in csv_values(dataset, "--dataset")
    return other_data or weights is not None


def register(app: typer.Typer) -> None:
    app.command("dropout-ft")(dropout_ft)
