"""`owai mosaic-train` / `owai mosaic-eval`: Memory Mosaics v1 against GPT2 language models (sec 3.5, App. B).

    owai mosaic-train                                     MM and GPT, depth 1, embedded stories (cpu preset of fig3.8-depth)
    owai mosaic-train --depth 4 --arch mm,gpt             another depth (Figs 3.8/B.4)
    owai mosaic-train --recipe fig3.9-posloss -p paper    12-block models, per-position loss on Simple Wikipedia
    torchrun --nproc_per_node 8 -m owai mosaic-train -p paper     the thesis scale, data-parallel
    owai mosaic-train --size large                        Memory Mosaics v2 large (Table 4.2), recipe table4.2-pretrain
    owai mosaic-train --size large --arch transformer --dry-run    the Llama baseline's memory plan, nothing run
    owai mosaic-train --size tiny --arch mmv2,transformer          both chapter-4 models on CPU (cpu preset)
    owai mosaic-eval runs/fig3.8-depth/<run>              evaluate the run's saved models again
    owai mosaic-eval MODEL_DIR --dataset wikipedia --config-name 20220301.simple

The options are `--set` overrides of the recipe (`--depth` = model.n_layer, `--arch` = archs,
`--dataset` = data.source, `--tokenizer` = data.tokenizer, `--context` = data.block_size,
`--size` = model.size). A size (tiny, small, large) means chapter 4: recipe table4.2-pretrain, its
preset of that size (cpu, paper-small, paper), and Memory Mosaics v2 unless --arch says otherwise.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from owai.commands._common import (ConfigName, Context, DataRoot, Dataset, EvalDataset, EvalRunOptions, Models, RunOptions, data_root_sets,
                                  options, run_eval, set_str)
from owai.config import MAX_LAYERS
from owai.errors import OwaiError

TRAIN_RECIPE = "fig3.8-depth"
CHAPTER4_RECIPE = "table4.2-pretrain"

Tokenizer = Annotated[Optional[str], typer.Option("--tokenizer", help="gpt2 (hub), bytes, bpe-N (trained locally), or a tokenizer directory.")]


def _flow_list(text: str) -> str:
    return "[" + ", ".join(p.strip() for p in text.split(",") if p.strip()) + "]"


@options
def mosaic_train(
    recipe: Annotated[Optional[str], typer.Option("--recipe", "-r", help="fig3.8-depth (default), tableB.2-gpt-search, fig3.9-posloss, figB.5-attention, tableB.4-continuations, or table4.2-pretrain (the default with --size).")] = None,
    arch: Annotated[Optional[str], typer.Option("--arch", "-a", help="Comma-separated: mm, gpt, gpt-rope, gpt-alibi; with --size: mmv2 (default), transformer.")] = None,
    size: Annotated[Optional[str], typer.Option("--size", help="Chapter 4's model size: tiny (about 6M parameters, for a CPU: runs the cpu preset), small (2.0B v2 / 1.8B transformer) or large (9.9B / 8.8B). A model size, unlike --preset tiny (a recipe's run scale).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="With --size (or --arch mmv2 / transformer): check the run as a real run does, then print its plan (parameters, vocabulary, strategy, precision, FLOPs, memory per rank) without training.")] = False,
    depth: Annotated[Optional[int], typer.Option("--depth", min=1, max=MAX_LAYERS, help="Number of blocks Nb (model.n_layer).")] = None,
    dataset: Dataset = None,
    tokenizer: Tokenizer = None,
    context: Context = None,
    data_root: DataRoot = None,
    opts: RunOptions = RunOptions(),
) -> None:
    """Pre-train Memory Mosaics and GPT2 (sec 3.5, App. B), or with --size Memory Mosaics v2 and the Llama
    transformer (ch. 4), on the same batches, then evaluate them."""
    preset, resume = opts.preset, opts.resume
    given = (recipe, size, depth, dataset, tokenizer, context, data_root)
    if resume is not None and (arch or any(v is not None for v in given)):
        raise OwaiError("--resume takes its config from the run directory; drop --recipe/--size/--arch/--depth/--dataset/"
                        "--tokenizer/--context/--data-root")
    if size is not None:
        from owai.models.sizes import SIZES

        if size not in SIZES:
            raise OwaiError(f"--size must be one of {', '.join(SIZES)}, got {size!r}")
        recipe = recipe or CHAPTER4_RECIPE
        preset = preset or {"tiny": "cpu", "small": "paper-small", "large": "paper"}[size]
        arch = arch or "mmv2"
    recipe = recipe or TRAIN_RECIPE
    chosen = [
        set_str("model.size", size) if size is not None else None,
        f"archs={_flow_list(arch)}" if arch else None,
        f"model.n_layer={depth}" if depth is not None else None,
        set_str("data.source", dataset) if dataset is not None else None,  # quoted: a path stays the path given
        set_str("data.tokenizer", tokenizer) if tokenizer is not None else None,
        f"data.block_size={context}" if context is not None else None,
    ]
    overrides = [c for c in chosen if c] + data_root_sets(data_root) + list(opts.sets or [])
    if dry_run:
        if resume is not None:
            raise OwaiError("--dry-run plans a new run; drop --resume")
        print_plan(recipe, preset, overrides, opts.quiet, opts.as_json)
        return
    opts.run(None if resume is not None else recipe, overrides or None, methods=("lm_pretrain",), preset=preset)


def print_plan(recipe_name: str, preset: str | None, overrides: list[str], quiet: bool = False, as_json: bool = False) -> None:
    """--dry-run: the config resolved and checked as a run's is (one-line refusal where the run would
    refuse, the memory fit aside), then each chapter-4 model's plan as the run would build it:
    parameters, vocabulary, strategy, precision, per-rank memory, FLOPs (`language_model.dry_run_plan`);
    as JSON with --json, nothing with --quiet."""
    from owai import console, distributed
    from owai.experiment import resolve
    from owai.methods.language_model import dry_run_plan
    from owai.recipes import load

    console.configure(quiet, as_json)
    recipe = load(recipe_name)
    if recipe.method != "lm_pretrain":
        raise OwaiError(f"--dry-run plans a mosaic-train recipe; {recipe.id} is a {recipe.method} recipe")
    cfg, _ = resolve(recipe, preset, overrides, validate=False, refuse_unread=True)  # dry_run_plan runs the run's own validation
    plan = dry_run_plan(cfg)
    if distributed.launch_rank() != 0:  # under torchrun every rank plans (and refuses) alike; rank 0 prints
        return
    if as_json:
        console.emit_json({"recipe": recipe.id, "preset": preset or recipe.default_preset, **plan})
    elif not quiet:
        for line in plan["lines"]:
            console.stdout.print(line, markup=False, soft_wrap=True)


@options
def mosaic_eval(
    models: Models = None,
    dataset: EvalDataset = None,
    config_name: ConfigName = None,
    context: Context = None,
    posloss_only: Annotated[bool, typer.Option("--posloss-only", help="Only the validation and per-position losses (Fig 3.9): no training loss, attention or continuations.")] = False,
    data_root: DataRoot = None,
    opts: EvalRunOptions = EvalRunOptions(),
) -> None:
    """Evaluate saved language models: validation and per-position loss, attention plots, continuations."""
    run_eval(models, dataset, config_name, context, posloss_only, opts, data_root)


def register(app: typer.Typer) -> None:
    app.command("mosaic-train")(mosaic_train)
    app.command("mosaic-eval")(mosaic_eval)
