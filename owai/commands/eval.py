"""`owai eval`: evaluations of trained models and benchmarks, one subcommand each.

    owai eval posloss MODEL_DIR... [--dataset wikipedia --config-name 20220301.simple]
        per-position loss (Fig 3.9) and validation loss; the same as `owai mosaic-eval MODEL_DIR... --posloss-only`
    owai eval regbench [--model mm,transformer] [--train-size 100,500] [--positions all|last-string]
        RegBench (Fig 3.10, Table B.3): the recipe's grid search as a sweep, the cell with the lowest
        validation loss per model and size, its test accuracy and "TVD" beside the thesis's, the figure

    owai eval ruler --ctx 32k --model RUN_DIR|HF_ID|reference:oracle [--tasks qa_1,qa_2] [--n 500]
        RULER (Tables 4.4, 4.5, C.1): multi-document QA and synthetic recall, prompts fitted per length
    owai eval harness --model RUN_DIR|HF_ID [--tasks arc_easy,hellaswag,...] [--limit N]
        lm-evaluation-harness (Tables 4.1-4.3): the thesis's 19 benchmarks (pip install 'owai[eval]')
    owai eval icl --model RUN_DIR|HF_ID|reference:knn [--task banking77] [--shots 1,2,4,8] [--labels both]
        in-context classification (Figs 4.6-4.9, Table 4.6): LongICLBench's tasks, best of four prompt strategies

`owai eval posloss` takes `--data-root` (named corpora, relative paths); `owai eval regbench` (and
`owai moons`) generate their data, so they have no data flag. `--resume RUN_DIR` finishes a killed
evaluation with its recorded settings (ruler, harness, icl: only what the model had not answered;
posloss: only the batches not yet logged) or study
(regbench: its unfinished points).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from owai import console
from owai.commands._common import (ConfigName, Context, DataRoot, EvalDataset, EvalRunOptions, Json, Launch, Models, Out, Preset,
                                  Quiet, Sets, csv_values, open_study, options, refuse_blank, run_eval, run_study, set_str,
                                  study_recipe)
from owai.config import MAX_DOCUMENTS, MAX_EXAMPLES, MAX_SAMPLES, MAX_SHOTS
from owai.errors import OwaiError

eval_app = typer.Typer(help="Evaluate models: per-position loss (posloss), RegBench in-context language learning (regbench), in-context classification (icl), RULER long-context recall (ruler), lm-evaluation-harness benchmarks (harness).",
                       no_args_is_help=True)

REGBENCH_RECIPE = "fig3.10-regbench"


@eval_app.command("posloss")
@options
def posloss(
    models: Models = None,
    dataset: EvalDataset = None,
    config_name: ConfigName = None,
    context: Context = None,
    data_root: DataRoot = None,
    opts: EvalRunOptions = EvalRunOptions(),
) -> None:
    """Average loss at each position of the context window (Fig 3.9), for saved language models."""
    run_eval(models, dataset, config_name, context, opts.resume is None, opts, data_root)


def _train_sizes(text: str) -> list[int]:
    sizes = []
    for item in csv_values(text, "--train-size"):
        try:
            size = int(item)
        except ValueError:
            raise OwaiError(f"--train-size {item!r}: expected a number of training automata") from None
        if not 1 <= size <= MAX_EXAMPLES:
            raise OwaiError(f"--train-size {size}: the number of training automata must be between 1 and {MAX_EXAMPLES:,}")
        sizes.append(size)
    return sizes


def regbench_grid(sub_grids: list[dict[str, list[Any]]], default_arch: str, models: list[str] | None,
                  sizes: list[int] | None) -> list[dict[str, list[Any]]]:
    """The recipe's sub-grids restricted to `models` (a model the recipe does not search gets one
    cell at its defaults) with `data.num_examples` set to `sizes`."""
    grids = []
    for grid in sub_grids:
        archs = grid.get("arch", [default_arch])
        keep = [a for a in archs if models is None or a in models]
        if keep:
            grids.append({**grid, "arch": keep})
    covered = {a for g in grids for a in g["arch"]}
    recipe_sizes = list(dict.fromkeys(n for g in sub_grids for n in g.get("data.num_examples", [])))
    for model in models or []:
        if model not in covered:  # at the recipe's training sizes
            grids.append({"arch": [model], **({"data.num_examples": recipe_sizes} if recipe_sizes else {})})
    if sizes is not None:
        grids = [{**g, "data.num_examples": list(sizes)} for g in grids]
    return grids


@eval_app.command("regbench")
@options
def regbench(
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m", help="Comma-separated models: mm, transformer, lstm, ngram (default: the recipe's).")] = None,
    train_size: Annotated[Optional[str], typer.Option(
        "--train-size", "-n", help="Comma-separated numbers of training automata, e.g. 100,500 (default: the recipe's).")] = None,
    positions: Annotated[Optional[str], typer.Option(
        "--positions", help="Test positions: all (the published figures) or last-string (the thesis's wording).")] = None,
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="fig3.10-regbench, tableB.3-regbench-iid, or a RegBench recipe file.")] = REGBENCH_RECIPE,
    preset: Preset = None,
    sets: Sets = None,
    grid: Annotated[Optional[list[str]], typer.Option(
        "--grid", "-g", help="Replace a searched parameter's values: --grid train.weight_decay=0.01,0.1 (repeatable).")] = None,
    seeds: Annotated[Optional[str], typer.Option("--seeds", help="Comma-separated training seeds (default: the recipe's).")] = None,
    launch: Launch = Launch(),
    out: Out = None,
    resume: Annotated[Optional[Path], typer.Option("--resume", help="Continue a RegBench sweep directory (skips finished points).")] = None,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """RegBench (Fig 3.10, Table B.3): train each model over the recipe's grid, select by validation loss, test on held-out automata (regbench.md also shows the best test numbers over the grid, as seq_icl's notebook reads a sweep)."""
    from owai import sweep as sweeps
    from owai.evals.regbench import POSITIONS
    from owai.methods.regbench import sequence_model, study_table, write_study

    console.configure(quiet, as_json)
    runs_on = launch.runs_on()
    if resume is not None:
        given = any(v is not None for v in (model, train_size, positions, preset, sets, grid, seeds))
        plan = open_study(resume, "regbench", "a RegBench study", given or recipe != REGBENCH_RECIPE, out)
    else:
        rec = study_recipe(recipe, "regbench")
        if positions is not None and positions not in POSITIONS:
            raise OwaiError(f"--positions {positions!r}: choose one of {', '.join(POSITIONS)}")
        models = csv_values(model, "--model") if model is not None else None
        for m in models or []:
            sequence_model(m)
        preset_name = preset or rec.default_preset
        default_arch = rec.params_for(preset_name).get("arch", "mm")  # an unknown preset fails here
        base = rec.sweep.for_preset(preset_name)[0] if rec.sweep else [{}]
        sizes = _train_sizes(train_size) if train_size is not None else None
        study = regbench_grid(base, default_arch, models, sizes)
        per = list(rec.sweep.select.per) if rec.sweep and rec.sweep.select else ["arch"]
        if sizes is not None and "data.num_examples" not in per:
            per.append("data.num_examples")  # never select across training sizes
        extra = [set_str("eval.positions", positions)] if positions is not None else []
        plan = sweeps.create(recipe, preset, [*(sets or []), *extra], grid or [],
                             sweeps.parse_seeds(seeds) if seeds is not None else None, out, grid=study,
                             select={"metric": "val_loss", "mode": "min", "per": per}, executor=runs_on[0])
    run_study(plan, runs_on, write_study, study_table, "regbench.md", f"owai eval regbench --resume {plan.path}",
              quiet, as_json)


HARNESS_RECIPE = "table4.1-harness"


@eval_app.command("harness")
@options
def harness(
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m", help="A run or save_pretrained directory, a Hugging Face id, reference:oracle, or hflm:ID (the harness's own HFLM).")] = None,
    tasks: Annotated[Optional[str], typer.Option("--tasks", help="Comma-separated harness tasks (default: the preset's; cpu: owai_mc_smoke, owai_gen_smoke; -p paper: the thesis's 19; race_middle and the two smoke tasks ship with owai).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=0, max=MAX_DOCUMENTS, help="Documents per task (0 = all).")] = None,
    num_fewshot: Annotated[Optional[int], typer.Option("--num-fewshot", min=0, max=MAX_SHOTS, help="Shots for every task (default: each task's own).")] = None,
    tokenizer: Annotated[Optional[str], typer.Option("--tokenizer", help="Override the model's tokenizer (hub id or tokenizer.json).")] = None,
    ablate: Annotated[Optional[str], typer.Option("--ablate", help="Switch a part off at inference: long_term_memory (Tables 4.2, 4.3).")] = None,
    confirm_run_unsafe_code: Annotated[bool, typer.Option(
        "--confirm-run-unsafe-code", help="Run tasks that execute the model's generated code (lm-eval's unsafe_code tasks: humaneval_plus and mbpp in -p paper), unsandboxed on this machine, with HF_ALLOW_CODE_EVAL=1; without it they are refused.")] = False,
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="table4.1-harness or a harness recipe file.")] = HARNESS_RECIPE,
    opts: EvalRunOptions = EvalRunOptions(),
) -> None:
    """lm-evaluation-harness (Tables 4.1-4.3): the thesis's 19 benchmarks, each task's main metric (0-1), persistent / new-knowledge averages. Under torchrun (torchrun --nproc_per_node W -m owai eval harness ...) every rank loads the whole model and answers a share of every task's documents; rank 0 writes the one run directory, with one process's numbers."""
    extra = option_sets(opts.sets, {"model": model, "tokenizer": tokenizer, "limit": limit, "num_fewshot": num_fewshot,
                                    "confirm_run_unsafe_code": True if confirm_run_unsafe_code else None},
                        {"tasks": (tasks, "--tasks"), "ablate": (ablate, "--ablate")})
    run_evaluation(opts, recipe, HARNESS_RECIPE, extra, "harness")


def run_evaluation(opts: EvalRunOptions, recipe: str, default: str, extra: list[str], method: str) -> None:
    """Run the evaluation recipe with the options' overrides `extra`, or (--resume) finish the run
    RUN_DIR with its recorded settings, which then must be all it is given (`default`: the command's
    own recipe, left as it is)."""
    if opts.resume is not None:
        resume_alone(recipe, default, opts.preset, opts.sets, extra)
        opts.run(None, opts.sets, methods=(method,))
        return
    opts.run(recipe, extra, methods=(method,))


def resume_alone(recipe: str, default: str, preset: str | None, sets: list[str] | None, extra: list[str]) -> None:
    """An evaluation resumed takes its settings from RUN_DIR: no option may set one (`extra`: the
    overrides the command's options make, beyond the user's `sets`)."""
    if extra != list(sets or []) or preset is not None or recipe != default:
        raise OwaiError("--resume takes the run's settings from RUN_DIR/config.yaml; drop the other options")


def option_sets(sets: list[str] | None, values: dict[str, Any], lists: dict[str, tuple[str | None, str]]) -> list[str]:
    """`--set` overrides for the options given: KEY=VALUE for `values` (a str quoted: a path or id stays the
    string given; a number or bool as it is), KEY=["a", "b"] for each comma-separated option in `lists`
    (quoted: "4k" and "2048" are both strings), after the user's. A blank string is refused: the config reads
    "" as its default (the recipe's data, the model's own tokenizer), which the option was given to replace."""
    for key, value in values.items():
        if isinstance(value, str):
            refuse_blank(f"--{key.replace('_', '-')}", value)
    extra = list(sets or [])
    extra += [set_str(key, value) if isinstance(value, str) else f"{key}={json.dumps(value)}"
              for key, value in values.items() if value is not None]
    extra += [f"{key}={json.dumps(csv_values(value, flag))}" for key, (value, flag) in lists.items() if value is not None]
    return extra


RULER_RECIPE = "table4.4-ruler"


@eval_app.command("ruler")
@options
def ruler(
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m", help="A run or save_pretrained directory, a Hugging Face id, or reference:oracle / reference:null / reference:slot:K.")] = None,
    ctx: Annotated[Optional[str], typer.Option("--ctx", help="Comma-separated context lengths: 4k, 8k, 16k, 32k, 64k, 128k or a number of tokens (at most 1024k).")] = None,
    tasks: Annotated[Optional[str], typer.Option("--tasks", help="Comma-separated tasks: qa_1, qa_2 (the thesis's), niah_*, vt, cwe, fwe.")] = None,
    n: Annotated[Optional[int], typer.Option("--n", "--samples", min=1, max=MAX_SAMPLES, help="Samples per task and length (RULER: 500); under torchrun write --samples (torchrun reads --n as its own option).")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="The haystacks' seed (RULER: 42).")] = None,
    tokenizer: Annotated[Optional[str], typer.Option("--tokenizer", help="Override the model's tokenizer (reference models fit prompts with reference_tokenizer, GPT-2's by default).")] = None,
    haystack_dir: Annotated[Optional[str], typer.Option("--haystack-dir", help="The essay haystack: a folder of .txt essays (read by niah_single_2/3, niah_multikey_1, niah_multivalue and niah_multiquery; refused as unused when no such task runs).")] = None,
    ablate: Annotated[Optional[str], typer.Option("--ablate", help="Switch a part off at inference: long_term_memory (Table C.1).")] = None,
    allow_overflow: Annotated[bool, typer.Option("--allow-overflow", help="Count prompts longer than the model takes as overflows (the thesis's x) instead of refusing to start.")] = False,
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="table4.4-ruler or a RULER recipe file.")] = RULER_RECIPE,
    opts: EvalRunOptions = EvalRunOptions(),
) -> None:
    """RULER (Tables 4.4, 4.5, 4.7, 4.8, C.1, C.2): multi-document QA (SQuAD, HotpotQA) and synthetic recall at each context length, prompts fitted with the model's tokenizer."""
    extra = option_sets(opts.sets, {"model": model, "tokenizer": tokenizer, "haystack_dir": haystack_dir, "n": n, "seed": seed,
                                    "allow_overflow": True if allow_overflow else None},
                        {"ctx": (ctx, "--ctx"), "tasks": (tasks, "--tasks"), "ablate": (ablate, "--ablate")})
    run_evaluation(opts, recipe, RULER_RECIPE, extra, "ruler")


ICL_RECIPE = "fig4.6-icl"


@eval_app.command("icl")
@options
def icl(
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m", help="A run or save_pretrained directory, a Hugging Face id, or reference:knn / reference:last.")] = None,
    task: Annotated[Optional[str], typer.Option("--task", help="banking77, goemotion, tacred or synthetic (default: the recipe's).")] = None,
    shots: Annotated[Optional[str], typer.Option("--shots", help="Comma-separated shot counts, e.g. 1,2,4,8 (one demonstration per class each).")] = None,
    labels: Annotated[Optional[str], typer.Option("--labels", help="semantic, anonymous or both (comma-separated).")] = None,
    n: Annotated[Optional[int], typer.Option("--n", "--queries", min=1, max=MAX_SAMPLES, help="Number of queries (LongICLBench: 500); under torchrun write --queries (torchrun reads --n as its own option).")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="The task's folder or a root holding icl/<task>; hf = the hub ids.")] = None,
    tokenizer: Annotated[Optional[str], typer.Option("--tokenizer", help="Override the model's tokenizer (hub id or tokenizer.json).")] = None,
    allow_overflow: Annotated[bool, typer.Option("--allow-overflow", help="Count prompts longer than the model takes as overflows instead of refusing to start.")] = False,
    prefix_cache: Annotated[Optional[bool], typer.Option("--prefix-cache/--no-prefix-cache", help="Prefill each prompt set's shared demonstrations once and continue every query from a copy of their cache (default; the same answers), or prefill every prompt whole.")] = None,
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="fig4.6-icl or an ICL recipe file.")] = ICL_RECIPE,
    opts: EvalRunOptions = EvalRunOptions(),
) -> None:
    """In-context classification (Figs 4.6-4.9, Table 4.6): LongICLBench's banking77 / goemotion / tacred, semantic and anonymous labels, four prompt strategies."""
    # numbers (a non-number stays a string, which the method's check names)
    shot_list = [int(s) if s.lstrip("-").isdigit() else s for s in csv_values(shots, "--shots")] if shots is not None else None
    if labels is not None and labels != "both" and "both" in csv_values(labels, "--labels"):
        raise OwaiError(f"--labels {labels!r}: both means semantic and anonymous; give it alone")
    extra = option_sets(opts.sets, {"model": model, "task": task, "shots": shot_list, "n_queries": n, "data": data,
                                    "tokenizer": tokenizer, "allow_overflow": True if allow_overflow else None,
                                    "prefix_cache": prefix_cache},
                        {"labels": ("semantic,anonymous" if labels == "both" else labels, "--labels")})
    run_evaluation(opts, recipe, ICL_RECIPE, extra, "icl")


def register(app: typer.Typer) -> None:
    app.add_typer(eval_app, name="eval")
