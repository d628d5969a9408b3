"""`owai rich-features`: rich representations from networks that differ only by seed (thesis §2.1-2.2, A.1-A.4).

    owai rich-features                                       Table 2.2 in one command: its networks, baselines, probe
    owai rich-features -r tableA.8-fewshot                   any recipe's whole chain (networks reused from the cache)
    owai rich-features -r tableA.8-fewshot --dry-run         the chain's steps, validated, as --stage commands
    owai rich-features --stage pretrain                      Table 2.2's cpu preset: 4 ResNet-18s on MNIST 0-4
    owai rich-features --stage probe                         Cat_1/2/4 probes on MNIST 5-9 (the cached networks)
    owai rich-features --stage probe --networks SWEEP_DIR    the networks of a pretrain sweep (or run directories)
    owai rich-features --stage finetune,two-stage -r tableA.3-finetune      normal vs two-stage fine-tuning
    owai rich-features --stage distill,probe,fewshot -r tableA.8-fewshot    Distill_n, probes, 1/5-shot episodes
    owai rich-features --stage pretrain -r table2.1-weight-decay            weight decay 0 vs 5e-4, with transfer
    owai rich-features --stage pretrain -r tableA.4-simsiam                 SimSiam networks (self-supervised)
    owai rich-features --stage distill,probe -r tableA.4-simsiam            their Cat_n, and Distill_n on their features
    owai rich-features --stage probe,finetune,two-stage -r tableA.6-seer -p paper   SEER RegNets from the hub (hf:ID)
    owai rich-features --stage pretrain -p paper --data-root ~/data --executor slurm --gpus-per-node 1
    owai rich-features --stage pretrain --resume SWEEP_DIR   finish a killed pretrain sweep (finished networks are skipped)
    owai rich-features --stage probe --resume RUN_DIR        finish a killed evaluation run (same result as uninterrupted)

Without --stage the recipe's chain runs (`chain:` in its params, `plan_chain`): a pretrain sweep of
the networks its evaluation stages read (and of Table 2.2's wide / joint baselines), skipped when
they are all in the cache, then each evaluation run. Every step is validated before the first runs.
`pretrain` runs the recipe's seeds (and grid) as a sweep (one point = one network, cached in
<cache>/pretrained/); the evaluation stages (distill, probe, finetune, two-stage, fewshot; several
joined by commas) are one run that loads n of them (results.json: cat{k}.acc, single.acc,
distill{n}.acc, ft.cat{n}.acc, ft.distill{n}.acc, two_stage.cat{n}.acc, fewshot.{rep}.{head}.{k}shot, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from owai import console
from owai.config import MAX_NETWORKS
from owai.commands._common import (DataRoot, Json, Launch, Out, Preset, Quiet, Sets, csv_values, data_root_sets, open_study,
                                  options, quoted_list, resumable_dir, run_recipe, run_sweep, set_str, study_recipe)

RECIPE = "table2.2-cat-probe"
METHOD = "rich_features"


@options
def rich_features(
    stage: Annotated[Optional[str], typer.Option("--stage", help="pretrain (n networks, a sweep over seeds), or evaluation stages of n pretrained networks, alone or joined by commas: distill, probe, finetune, two-stage, fewshot. Without it: the recipe's whole chain (its networks and baselines, reused from the cache, then its evaluation stages).", show_default=False)] = None,
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="A rich-features recipe id (table2.1-weight-decay, table2.2-cat-probe, tableA.1-joint, tableA.2-resnet152, tableA.3-finetune, tableA.4-simsiam, tableA.5-swav, tableA.6-seer, tableA.7-snapshots, tableA.8-fewshot, tableA.9-fewshot-sota, fig2.4-vit) or file.")] = RECIPE,
    data_root: DataRoot = None,
    seeds: Annotated[Optional[str], typer.Option("--seeds", help="The networks' seeds, comma-separated (pretrain: the sweep's; evaluation stages: the cached networks to load; without --stage: the networks the chain trains and loads).")] = None,
    networks: Annotated[Optional[str], typer.Option("--networks", help="evaluation stages: comma-separated pretrain run or sweep directories (instead of the cache).")] = None,
    n: Annotated[Optional[int], typer.Option("--n", min=1, max=MAX_NETWORKS, help="evaluation stages: the number of networks n (must match the networks given).")] = None,
    preset: Preset = None,
    sets: Sets = None,
    launch: Launch = Launch(),
    out: Out = None,
    resume: Annotated[Optional[Path], typer.Option("--resume", help="pretrain: a sweep directory (skips finished networks); evaluation stages: a run directory (without --stage: either).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate every step (the recipe's chain, or --stage) and print them as --stage commands; run nothing.")] = False,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Rich representations (Tables 2.1, 2.2, A.1-A.9, Fig 2.4): pretrain n networks that differ by seed, then probe, distill, fine-tune or few-shot them. Without --stage, the recipe's whole chain."""
    from owai.methods.rich_features import stages_of

    console.configure(quiet, as_json)
    if dry_run and resume is not None:
        raise _error("--dry-run plans a new run; drop --resume")
    if stage is None and resume is not None:
        from owai.runs import is_sweep_dir

        stage = "pretrain" if is_sweep_dir(resume) else _recorded_stage(resume)  # the rest is read from the directory
    if stage is None or dry_run:
        _chain(recipe, stage, preset, _eval_sets(sets, data_root, networks, n, None), seeds, out, launch, dry_run, quiet, as_json)
        return
    if stages_of(stage) == ["pretrain"]:
        if networks is not None or n is not None:
            raise _error("--networks and --n are options of the evaluation stages (probe, distill, ...)")
        _pretrain(recipe, preset, sets, data_root, seeds, out, resume, quiet, as_json, launch.runs_on())
        return
    if launch.spreads:
        raise _error(f"--stage {stage} is one run: --executor and --workers apply to --stage pretrain")
    launch.runs_on()
    if resume is not None:
        if any(v is not None for v in (data_root, seeds, networks, n, preset)) or recipe != RECIPE:
            raise _error("--resume takes the run's settings from RUN_DIR/config.yaml; drop the other options")
        _check_resumed_stage(resume, stage)
        run_recipe(None, None, sets, out, resume, quiet, as_json, methods=(METHOD,))
        return
    study_recipe(recipe, METHOD)
    extra = [*_eval_sets(sets, data_root, networks, n, seeds), set_str("stage", stage)]
    run_recipe(recipe, preset, extra, out, None, quiet, as_json, methods=(METHOD,))


def _eval_sets(sets: list[str] | None, data_root: Path | None, networks: str | None, n: int | None,
               seeds: str | None) -> list[str]:
    """The --set overrides of an evaluation run: the user's, the data root, --networks, --n, --seeds."""
    extra = [*(sets or []), *data_root_sets(data_root)]
    if networks is not None:
        dirs = [str(Path(p).expanduser().resolve()) for p in csv_values(networks, "--networks")]
        extra.append("probe.networks=" + quoted_list(dirs))  # double-quoted: a path may hold a quote or ' #'
    if seeds is not None:
        from owai import sweep as sweeps

        chosen = sweeps.parse_seeds(seeds)
        extra.append(f"probe.seeds={chosen}")
        if n is None:
            extra.append(f"probe.n={len(chosen)}")
    if n is not None:
        extra.append(f"probe.n={n}")
    return extra


def _chain(recipe: str, stage: str | None, preset: str | None, extra: list[str], seeds: str | None, out: Path | None,
           launch: Launch, dry_run: bool, quiet: bool, as_json: bool) -> None:
    """The recipe's chain (or the one --stage, with --dry-run): every step validated first, then the
    pretrain sweeps whose networks are not all cached, then the evaluation runs, the last one printed."""
    from owai import sweep as sweeps
    from owai.methods.rich_features import plan_chain

    rec = study_recipe(recipe, METHOD)
    if stage is not None:
        from owai.methods.rich_features import stages_of

        extra = [*extra, f"chain=['{','.join(stages_of(stage))}']"]
    steps = plan_chain(recipe, preset, extra, sweeps.parse_seeds(seeds) if seeds is not None else None)
    preset_name = preset or rec.default_preset
    if all(s.stage == "pretrain" for s in steps) and any(x.startswith(("probe.networks=", "probe.n=")) for x in extra):
        raise _error("--networks and --n are options of the evaluation stages (probe, distill, ...)")
    if launch.spreads and not any(s.stage == "pretrain" for s in steps):
        raise _error("--executor and --workers apply to pretrain sweeps; this chain has none")
    runs_on = launch.runs_on()  # also for a dry run: it refuses what the run would
    if dry_run:
        rows = [{"stage": s.stage, "what": s.what, "cached": s.cached, "command": s.command(rec.id, preset_name)}
                for s in steps]
        if as_json:
            console.emit_json(rows)
        elif not quiet:
            for i, row in enumerate(rows, 1):
                note = " (in the cache: skipped)" if row["cached"] else ""
                console.stdout.print(f"{i}. {row['what']}{note}: {row['command']}", markup=False, soft_wrap=True)
        return
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        if step.stage != "pretrain":
            console.info(f"step {i + 1}/{len(steps)}: {step.what}")
            run_recipe(recipe, preset, step.sets, out, None, quiet, as_json, methods=(METHOD,))
            continue
        if step.cached:
            console.info(f"step {i + 1}/{len(steps)}: {step.what}: in the cache, skipped")
            continue
        plan = sweeps.create(recipe, preset, step.sets, [], step.seeds, out, grid=step.grid, executor=runs_on[0])
        rerun = f"owai rich-features --stage pretrain --resume {plan.path}, then this command again"
        if last:
            run_sweep(plan, runs_on, rerun, quiet, as_json, "networks")
            continue
        console.info(f"step {i + 1}/{len(steps)}: {step.what}: sweep directory {plan.path}")
        sweeps.raise_on_failures(sweeps.write_summary(plan, sweeps.run(plan, *runs_on)), rerun)


def _recorded_stage(resume: Path) -> str:
    """The --stage of the evaluation run RUN_DIR (its config.yaml's); RUN_DIR must be a rich-features run."""
    from owai.experiment import recorded_recipe
    from owai.runs import Run

    resumable_dir(resume, "run")
    run = Run.open(resume)
    resolved = run.read_config()
    recorded_recipe(run, resolved, (METHOD,))  # another command's run: said so, not as its missing stage
    return str(resolved.get("params", {}).get("stage", ""))


def _check_resumed_stage(resume: Path, stage: str) -> None:
    """--stage must name the stages of the run being resumed (its config.yaml's): a resume never
    changes what a run computes, and a --stage that would be ignored is refused."""
    from owai.methods.rich_features import stages_of

    recorded = _recorded_stage(resume)
    if stages_of(stage) != stages_of(recorded):
        raise _error(f"--stage {stage}: {resume} is a run of --stage {recorded}; resume it with --stage {recorded} "
                     "(or start a new run for the other stages)")


def _error(message: str) -> Exception:
    from owai.errors import OwaiError

    return OwaiError(message)


def _pretrain(recipe: str, preset: str | None, sets: list[str] | None, data_root: Path | None, seeds: str | None,
              out: Path | None, resume: Path | None, quiet: bool, as_json: bool, runs_on: tuple) -> None:
    """The recipe's seeds as one sweep of pretrain runs (or the rest of a killed one), then its summary."""
    from owai import sweep as sweeps

    if resume is not None:
        given = any(v is not None for v in (preset, sets, data_root, seeds)) or recipe != RECIPE
        plan = open_study(resume, METHOD, "a rich-features pretrain sweep", given, out)
    else:
        study_recipe(recipe, METHOD)
        extra = [*(sets or []), "stage=pretrain", *data_root_sets(data_root)]
        plan = sweeps.create(recipe, preset, extra, [], sweeps.parse_seeds(seeds) if seeds is not None else None, out,
                             executor=runs_on[0])
    run_sweep(plan, runs_on, f"owai rich-features --stage pretrain --resume {plan.path}", quiet, as_json, "networks",
              f"probe them: owai rich-features --stage probe --networks {plan.path}")


def register(app: typer.Typer) -> None:
    app.command("rich-features")(rich_features)
