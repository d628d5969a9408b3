"""Options and the run-and-report path shared by the method subcommands.

Each shared option is declared once, here, as an `Annotated` type (its flags, help and panel); a
command takes it by naming the type. Options that travel together are an `OptionGroup` (`RunOptions`:
--preset/--set/--out/--resume/--quiet/--json/--tracker; `Launch`: --workers/--executor and the SLURM options),
which a command takes as one parameter and `@options` spreads into its command line; `EvalRunOptions`
is RunOptions with the --set / --resume help of an evaluation command.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import typer

from owai import console
from owai.config import MAX_CONTEXT, MAX_WORKERS


def _preset_named(value: str | None) -> str | None:
    """--preset as given; a blank name is refused: it read as no --preset and ran the recipe's default preset."""
    if value is not None and not value.strip():
        raise typer.BadParameter("a blank preset name; omit --preset for the recipe's default (`owai recipes show RECIPE` lists its presets)")
    return value


Preset = Annotated[Optional[str], typer.Option("--preset", "-p", callback=_preset_named, help="Scale preset of the recipe: cpu (the default), paper (the thesis's settings), and where a recipe has them tiny (a run scale: the data that ships with owai only; not mosaic-train's --size tiny, a model size) and paper variants (paper-cosine, paper-imagenet, ...: `owai recipes show RECIPE` lists them).")]
Sets = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override a parameter: --set KEY.PATH=VALUE, e.g. --set seed=1 (repeatable; `owai recipes show RECIPE` lists the keys).")]
EvalSets = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override an evaluation setting: --set runtime.device=cpu (repeatable; `owai recipes show RECIPE` lists them).")]
Out = Annotated[Optional[Path], typer.Option("--out", "-o", help="Root for results (default: runs): OUT/<recipe>/<time>-<hash>/ for a run, OUT/<recipe>/sweep-<time>-<hash>/ for a sweep or study.", show_default=False)]
Resume = Annotated[Optional[Path], typer.Option("--resume", help="Continue a killed or failed run from its last checkpoint; --set may then change only the settings the method lets a resume change: optimisation settings (learning rates, weight decay, clipping where it has them: `owai report RUN_DIR` names the one to lower; none for the runs without training) and the language models' data.prefetch, which changes no batch.")]
EvalResume = Annotated[Optional[Path], typer.Option("--resume", help="Finish a killed or failed evaluation RUN_DIR with its recorded settings (ruler, icl and harness ask the model only for what it had not answered, posloss and mosaic-eval compute only the batches not yet logged: the results of an uninterrupted run; a complete run is reported as it is). Takes no other settings.", show_default=False)]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or info; errors still print.")]
Json = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout (nothing else).")]
TrackerOption = Annotated[Optional[str], typer.Option(
    "--tracker", help="Mirror the run's metrics to tensorboard or wandb (pip install 'owai\\[tensorboard]' / 'owai\\[wandb]'); "
                      "the same as --set runtime.tracker=NAME.", show_default=False)]
DATA_ROOT_HELP = ("Data root: DIR/<dataset> (mnist/, camelyon17/, domainbed/PACS/, text/babistories/...) or the dataset's own "
                  "folder. Default: $OWAI_MNIST_DIR / $OWAI_BABISTORIES for those datasets, then $OWAI_DATA/<dataset>, then "
                  "the cache (`owai data list` shows what is found).")
DataRoot = Annotated[Optional[Path], typer.Option("--data-root", help=DATA_ROOT_HELP, show_default=False)]


def _double_quoted(text: str) -> str:
    """`text` as a double-quoted YAML scalar (json.dumps would escape non-ASCII characters as UTF-16
    surrogates, which YAML does not read back)."""
    import yaml

    return yaml.safe_dump(text, default_style='"', width=float("inf"), allow_unicode=True).rstrip("\n")


def quoted(value: object) -> str:
    """A string option's value (a path, a hub id, a name) written for a `--set KEY=VALUE` override: --set
    reads VALUE as YAML, so pasted bare a path such as 123, true or `a: b` would change type and one holding
    ` #` would be cut at the comment. Such a value is double-quoted; one YAML reads back as itself stays bare."""
    import yaml

    from owai.config import load_yaml

    text = str(value)
    try:
        if text and text == text.strip() and load_yaml(text) == text:
            return text
    except yaml.YAMLError:
        pass
    return _double_quoted(text)


def quoted_list(values: list[Any]) -> str:
    """String values as a YAML flow list, each one double-quoted (in a flow list a bare ',' would split it)."""
    return "[" + ", ".join(_double_quoted(str(v)) for v in values) + "]"


def set_str(key: str, value: object) -> str:
    """The override `KEY="VALUE"` of a string option (see `quoted`)."""
    return f"{key}={quoted(value)}"


def data_root_sets(data_root: Path | None, recipe: str | None = None) -> list[str]:
    """`--data-root DIR` as the `--set data.root=<absolute DIR>` override of a recipe whose method
    reads data (a recipe that only generates data refuses the flag); [] when not given."""
    from owai.errors import OwaiError

    if data_root is None:
        return []
    if recipe is not None:
        from owai.config import to_dict
        from owai.recipes import load

        rec = load(recipe)
        if "root" not in to_dict(rec.method_class().Config()).get("data", {}):
            raise OwaiError(f"--data-root: recipe {rec.id!r} reads no dataset (it generates its data)")
    return [set_str("data.root", Path(data_root).expanduser().resolve())]


# Where a grid's points run (`owai sweep` and the study commands).
SLURM = "SLURM (--executor slurm)"


class Executor(str, Enum):
    local = "local"
    slurm = "slurm"
    submitit_debug = "submitit-debug"


Workers = Annotated[int, typer.Option("--workers", "-w", min=1, max=MAX_WORKERS, help="Local worker processes (1: run points one by one in this process).")]
ExecutorOption = Annotated[Executor, typer.Option("--executor", "-e", help="local, slurm (via submitit), or submitit-debug (submitit in-process).")]
Partition = Annotated[Optional[str], typer.Option("--partition", help="SLURM partition.", rich_help_panel=SLURM)]
GpusPerNode = Annotated[Optional[int], typer.Option("--gpus-per-node", min=0, help="GPUs per job.", rich_help_panel=SLURM)]
CpusPerTask = Annotated[Optional[int], typer.Option("--cpus-per-task", min=1, help="CPUs per job (also its torch threads).", rich_help_panel=SLURM)]
TimeoutMin = Annotated[Optional[int], typer.Option("--timeout-min", min=1, help="Time limit per job in minutes (default 240); a job that reaches it is requeued and resumes from its last checkpoint, up to three times.", rich_help_panel=SLURM)]
MemGb = Annotated[Optional[float], typer.Option("--mem-gb", min=0, help="Memory per job in GB.", rich_help_panel=SLURM)]
ArrayParallelism = Annotated[Optional[int], typer.Option("--array-parallelism", min=1, help="Jobs running at once per job array (default: all; a sweep larger than the cluster's MaxArraySize goes out as several arrays).", rich_help_panel=SLURM)]


class OptionGroup:
    """Base of a dataclass whose fields are options several commands share, declared once.

    A command takes the group as one parameter (`launch: Launch = Launch()`); `@options` puts the
    group's options in that place of the command's signature, so Typer shows and parses them like
    the command's own, and gives the command their values as one group object."""


Command = TypeVar("Command", bound=Callable[..., Any])


def options(command: Command) -> Command:
    """The command with each `OptionGroup` parameter spread into the group's options (see OptionGroup)."""
    params: list[inspect.Parameter] = []
    groups: dict[str, type] = {}
    # inspect's eval_str, not typing.get_type_hints(command): on Python 3.10 the latter wraps the type of
    # a parameter whose default is None in Optional[...], which hides its Annotated typer.Option from Typer
    for param in inspect.signature(command, eval_str=True).parameters.values():
        kind = param.annotation
        if isinstance(kind, type) and issubclass(kind, OptionGroup):
            groups[param.name] = kind
            types = typing.get_type_hints(kind, include_extras=True)
            params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=types[f.name])
                       for f in dataclasses.fields(kind)]
        else:
            params.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=kind))

    @functools.wraps(command)
    def grouped(**values: Any) -> Any:
        for name, kind in groups.items():
            values[name] = kind(**{f.name: values.pop(f.name) for f in dataclasses.fields(kind)})
        return command(**values)

    grouped.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    grouped.__annotations__ = {p.name: p.annotation for p in params}
    return typing.cast(Command, grouped)


@dataclasses.dataclass(frozen=True)
class Launch(OptionGroup):
    """Where a grid's points run: this process, local worker processes, or a SLURM job array."""

    workers: Workers = 1
    executor: ExecutorOption = Executor.local
    partition: Partition = None
    gpus_per_node: GpusPerNode = None
    cpus_per_task: CpusPerTask = None
    timeout_min: TimeoutMin = None
    mem_gb: MemGb = None
    array_parallelism: ArrayParallelism = None

    @property
    def spreads(self) -> bool:
        """Whether the points leave this process (more workers, or another executor)."""
        return self.workers != 1 or self.executor is not Executor.local

    def runs_on(self) -> tuple[str, int, Any]:
        """The (executor, workers, SlurmOptions) a grid runs with, checked before any directory exists."""
        from owai import sweep as sweeps
        from owai.errors import OwaiError

        # every rank would make its own sweep directory and run every point in it
        refuse_torchrun("this command runs each run in one process (a sweep's points side by side: --workers N or "
                        "--executor slurm), not under torchrun, where every rank would repeat it")
        slurm = sweeps.SlurmOptions(self.partition, self.gpus_per_node, self.cpus_per_task, self.timeout_min, self.mem_gb,
                                    self.array_parallelism)
        if self.executor is Executor.local and any(v is not None for v in vars(slurm).values()):
            raise OwaiError("SLURM options (--partition, --gpus-per-node, ...) need --executor slurm")
        sweeps.check_executor(self.executor.value, self.workers)
        return self.executor.value, self.workers, slurm


def refuse_out_with_resume(out: Path | None) -> None:
    """--out with --resume: the run or sweep continues in its own directory, not under OUT."""
    from owai.errors import OwaiError

    if out is not None:
        raise OwaiError("--out does not apply with --resume: the run continues in the directory given to --resume")


def resumable_dir(path: Path, kind: str) -> None:
    """--resume PATH naming a file: said as such (the run or sweep loader would call it missing); a run's
    --resume naming a sweep directory: said as such (the run loader guessed at a damaged sweep)."""
    from owai.errors import OwaiError
    from owai.runs import is_sweep_dir

    if Path(path).expanduser().is_file():
        raise OwaiError(f"--resume {path}: a file, not a {kind} directory")
    if kind == "run" and is_sweep_dir(Path(path).expanduser()):
        raise OwaiError(f"--resume {path}: a sweep directory, not a run directory; continue it with `owai sweep --resume "
                        f"{path}`, or a study's with its command's --resume")


def refuse_torchrun(message: str) -> None:
    """Under torchrun (WORLD_SIZE > 1), refuse a command that does not run data-parallel with
    `message`, before any directory exists: every rank runs the same command line, so each would
    repeat the whole work and write beside the others. Every rank refuses alike; `owai.cli` prints
    the line once."""
    from owai import distributed
    from owai.errors import OwaiError

    if distributed.launched_by_torchrun():
        raise OwaiError(message)


def refuse_one_process_method(recipe: str | None, resume: Path | None) -> None:
    """`refuse_torchrun` for a run (new: of `recipe`; resumed: of the run directory's recipe) whose
    method does not run data-parallel (`Method.data_parallel`)."""
    from owai import distributed

    if not distributed.launched_by_torchrun():
        return
    from owai.recipes import load, recorded_name
    from owai.runs import Run

    if resume is not None:
        resolved = Run.open(resume).read_config()
        rec = load(recorded_name(resolved["recipe"], resolved.get("recipe_source")))
    elif recipe is not None:
        rec = load(recipe)
    else:
        return  # execute says what is missing
    if not rec.method_class().data_parallel:
        refuse_torchrun(f"`{rec.method_class().cli}` runs in one process, not under torchrun, where every rank would "
                        "repeat it; torchrun runs mosaic-train, mosaic-eval, eval posloss, eval ruler, eval icl and eval harness data-parallel")


def run_recipe(
    recipe: str | None, preset: str | None, sets: list[str] | None, out: Path | None, resume: Path | None, quiet: bool, as_json: bool,
    methods: tuple[str, ...] | None = None,
) -> None:
    """Execute a recipe (or resume a run) and print its measured-vs-thesis table. The recipe, or the
    resumed run's, must be of one of `methods` (the command's) when they are given."""
    from owai.experiment import execute
    from owai.report import table

    console.configure(quiet, as_json)
    if resume is not None:
        refuse_out_with_resume(out)
        resumable_dir(resume, "run")
    elif recipe is not None and methods is not None:
        study_recipe(recipe, methods)  # a command runs its own method's recipes only
    refuse_one_process_method(recipe, resume)
    run, results = execute(recipe, preset, sets or [], out, resume, methods=methods)
    if not run.writes:  # a non-zero torchrun rank: rank 0 reports
        return
    if as_json:
        console.emit_json(results)
    elif not quiet:
        console.stdout.print(table(results))
        console.stdout.print(f"results: {run.path / 'results.json'}", markup=False)


@dataclasses.dataclass(frozen=True)
class RunOptions(OptionGroup):
    """How a run is set up, where it goes and what it prints: --preset, --set, --out, --resume, --quiet, --json,
    --tracker."""

    preset: Preset = None
    sets: Sets = None
    out: Out = None
    resume: Resume = None
    quiet: Quiet = False
    as_json: Json = False
    tracker: TrackerOption = None

    def run(self, recipe: str | None, sets: list[str] | None, methods: tuple[str, ...] | None = None,
            preset: str | None = None) -> None:
        """`run_recipe` with these options, the given `--set` overrides (and --tracker's) and (when
        given) preset."""
        run_recipe(recipe, preset or self.preset, self.with_tracker(sets), self.out, self.resume, self.quiet,
                   self.as_json, methods)

    def with_tracker(self, sets: list[str] | None) -> list[str] | None:
        """`sets` with --tracker's `runtime.tracker` override after them (when given)."""
        if self.tracker is None:
            return sets
        return [*(sets or []), set_str("runtime.tracker", self.tracker)]


@dataclasses.dataclass(frozen=True)
class EvalRunOptions(RunOptions):
    """RunOptions of an evaluation command: its --set and --resume say what they do for an evaluation
    (an evaluation has no optimisation settings, and resuming finishes it with the recorded ones)."""

    sets: EvalSets = None
    resume: EvalResume = None


RecipeOption = Annotated[Optional[str], typer.Option("--recipe", "-r", help="Recipe id or path to a recipe YAML file (the same as RECIPE).")]


def refuse_blank(flag: str, value: str | None) -> None:
    """A string option given as "" (or blanks): refused, where a config reads "" as its default (the
    recipe's data, the model's own tokenizer, the training corpus) and would run as if it were not given."""
    from owai.errors import OwaiError

    if value is not None and not value.strip():
        raise OwaiError(f"{flag} is empty: give a value, or leave the option out")


def one_recipe(positional: str | None, option: str | None) -> str | None:
    """The recipe named by the RECIPE argument or by --recipe (the one spelling every command has)."""
    from owai.errors import OwaiError

    if positional is not None and option is not None and positional != option:
        raise OwaiError(f"RECIPE {positional!r} and --recipe {option!r} disagree; give one of them")
    return positional if positional is not None else option


def csv_values(text: str, option: str) -> list[str]:
    """The distinct values of a comma-separated option; none, a repeat or an empty value between commas
    (`4,,8`: a value lost in typing, as --seeds and --grid say) is a user error. A trailing comma is allowed."""
    from owai.errors import OwaiError

    parts = [t.strip() for t in text.strip().strip(",").split(",")]
    items = [t for t in parts if t]
    if items and len(items) != len(parts):
        raise OwaiError(f"{option} {text!r}: an empty value between commas")
    if not items or len(set(items)) != len(items):
        raise OwaiError(f"{option} {text!r}: give distinct comma-separated values")
    return items


def study_recipe(recipe: str, methods: str | tuple[str, ...], source: str | None = None) -> Any:
    """The recipe a command runs; it must be a recipe of one of the command's `methods`. `source`
    is the recipe source a sweep recorded (`recorded_name`), for a study being resumed."""
    from owai.errors import OwaiError
    from owai.recipes import load, recorded_name

    methods = (methods,) if isinstance(methods, str) else methods
    rec = load(recorded_name(recipe, source) if source is not None else recipe)
    if rec.method not in methods:
        allowed = methods[0] if len(methods) == 1 else f"{', '.join(methods[:-1])} or {methods[-1]}"
        raise OwaiError(f"recipe {rec.id!r} runs method {rec.method!r}, not {allowed}")
    return rec


def open_study(resume: Path, method: str, what: str, other_options: bool, out: Path | None = None) -> Any:
    """The sweep directory a study command resumes; it must be a sweep of `method`, and the plan
    comes from it alone (`other_options`: the command was also given options that set one)."""
    from owai import sweep as sweeps
    from owai.errors import OwaiError
    from owai.recipes import load, recorded_name

    if other_options:
        raise OwaiError("--resume takes its plan from SWEEP_DIR/sweep.json; drop the other options")
    resumable_dir(resume, "sweep")
    plan = sweeps.open_sweep(resume)
    if load(recorded_name(plan.recipe, plan.recipe_source)).method != method:
        raise OwaiError(f"{resume} is a sweep of {plan.recipe}, not {what}")
    refuse_out_with_resume(out)
    return plan


def run_sweep(plan: Any, runs_on: tuple[str, int, Any], rerun: str, quiet: bool, as_json: bool,
              points: str = "points", next_step: str = "") -> None:
    """Run a sweep's unfinished points (`runs_on` from `Launch.runs_on`), write and print its summary
    (or JSON) and `next_step`, then report failed points with how to rerun them (`rerun`)."""
    from owai import sweep as sweeps
    from owai.report import sweep_document

    console.info(f"sweep directory: {plan.path} ({len(plan.points)} {points})")
    summary = sweeps.write_summary(plan, sweeps.run(plan, *runs_on))
    if as_json:  # what `owai report SWEEP_DIR --json` prints: the summary and the claims judged on it
        console.emit_json(sweep_document(plan.path, summary))
    elif not quiet:
        console.stdout.print(sweeps.table(summary))
        console.stdout.print(f"summary: {plan.path / sweeps.SUMMARY}" + (f"\n{next_step}" if next_step else ""), markup=False)
    sweeps.raise_on_failures(summary, rerun)


def run_study(plan: Any, runs_on: tuple[str, int, Any], write_study: Callable[[Any, dict[str, Any]], tuple[list[dict[str, Any]], dict[str, Any]]],
              study_table: Callable[[list[dict[str, Any]], str], Any], table_name: str, rerun: str,
              quiet: bool, as_json: bool) -> None:
    """Run a study's sweep (unfinished points only; `runs_on` from `execution`), summarise it,
    write the study's files, print its table (or JSON), then report failed points with how to
    rerun them."""
    from owai import sweep as sweeps
    from owai.report import sweep_claims

    console.info(f"sweep directory: {plan.path} ({len(plan.points)} points)")
    outcomes = sweeps.run(plan, *runs_on)
    summary = sweeps.write_summary(plan, outcomes)
    failed = sweeps.failures(summary)
    rows, info = write_study(plan, summary)
    if as_json:  # the study's table and the recipe's claims judged on it, as its <stem>.json records them
        claims, source = sweep_claims(plan.path, summary)
        console.emit_json({"recipe": plan.recipe, "preset": plan.preset, "rows": rows, **info, "claims": claims,
                           "claims_source": source, "sweep_dir": str(plan.path), "failed": [p["label"] for p in failed]})
    elif not quiet:
        console.stdout.print(console.fit_table(study_table(rows, info["title"]), whole=(0,)))  # row labels whole
        console.stdout.print(f"table: {info.get('table') or plan.path / table_name}\nfigure: {info['figure']}", markup=False)
    sweeps.raise_on_failures(summary, rerun)


# --- language-model evaluations (owai mosaic-eval, owai eval posloss) ------------------------------

EVAL_RECIPE = "mosaic-eval"
CORPORA = ("owai-stories (embedded), a catalogue corpus (babistories, tinystories, wikipedia, text/sotu.tar.gz: `owai data list`), "
           "a Hugging Face dataset id, or a local txt/json/jsonl/parquet/7z/tar file or directory.")
Dataset = Annotated[Optional[str], typer.Option("--dataset", "-d", help=CORPORA)]
# mosaic-eval / eval posloss: the corpus of the per-position loss; the validation loss reads data.source
EvalDataset = Annotated[Optional[str], typer.Option("--dataset", "-d", help=(
    "Corpus of the per-position loss (eval.source, Fig 3.9; the validation loss reads data.source: "
    "--set data.source=...): " + CORPORA))]
Context = Annotated[Optional[int], typer.Option("--context", min=2, max=MAX_CONTEXT, help="Context length in tokens (data.block_size).")]
Models = Annotated[Optional[list[Path]], typer.Argument(
    help="Model directories (save_pretrained) or mosaic-train run directories (none with --resume).", show_default=False)]
ConfigName = Annotated[Optional[str], typer.Option("--config-name", help="Hub dataset configuration of --dataset, e.g. 20220301.simple.")]


def run_eval(models: list[Path] | None, dataset: str | None, config_name: str | None, context: int | None,
             posloss_only: bool, opts: RunOptions, data_root: Path | None = None) -> None:
    """A new evaluation of `models`, or (--resume) the continuation of an interrupted one."""
    from owai.errors import OwaiError

    if opts.resume is not None:
        given = [flag for flag, value in (("MODEL_DIR", models), ("--dataset", dataset), ("--config-name", config_name),
                                          ("--context", context), ("--posloss-only", posloss_only or None),
                                          ("--data-root", data_root)) if value]
        if given:
            raise OwaiError(f"--resume takes its models and settings from the run directory; drop {'/'.join(given)}")
        opts.run(None, opts.sets, methods=("lm_eval",))
        return
    if not models:
        raise OwaiError("give the model directories to evaluate (MODEL_DIR...), or --resume RUN_DIR")
    refuse_blank("--dataset", dataset)  # "" was dropped: the models' training corpus was evaluated
    refuse_blank("--config-name", config_name)
    opts.run(EVAL_RECIPE, eval_overrides(models, dataset, config_name, context, posloss_only) + data_root_sets(data_root)
            + list(opts.sets or []))


def eval_overrides(models: list[Path], dataset: str | None, config_name: str | None, context: int | None, posloss_only: bool) -> list[str]:
    """The `--set` overrides of the mosaic-eval recipe for these command-line choices."""
    overrides = ["models=" + quoted_list([m.resolve() for m in models])]  # quoted: a path may hold ',' or ' #'
    if dataset:
        overrides.append(set_str("eval.source", dataset))
    if config_name:
        overrides.append(set_str("eval.config_name", config_name))
    if context is not None:
        overrides.append(f"data.block_size={context}")
    if posloss_only:
        overrides += ["eval.attention_multiples=[]", "eval.continuations=false", "eval.train_loss=false"]
    return overrides
