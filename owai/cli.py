"""The `owai` command: core commands (recipes, report) plus one subcommand per thesis method.

Method subcommands live in `owai.commands.<name>` and are discovered at start-up, so only the
implemented ones appear in --help. Every user error is one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import pkgutil
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from owai import __version__, console
from owai.commands._common import Json, Preset, Quiet, RecipeOption, RunOptions, Sets, one_recipe, options
from owai.errors import (
    OwaiError, PeerFailed, Termination, one_line, release_frames, stop_on_termination, termination_deferred, user_message,
)

try:  # Typer >= 0.26 parses with its own copy of Click (pyproject asks >= 0.27)
    from typer._click import exceptions as click
except ImportError:  # pragma: no cover - an older Typer on the real Click
    from click import exceptions as click  # type: ignore[no-redef]


def _flag_type_hidden() -> None:
    """Show flags (--quiet, --json, --help, ...) as bare switches in --help: Typer's rich help
    prints a type column for every option, `<bool>` for flags, which reads as if they took a value."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "owai_flags_bare", False):  # another Typer: keep its rendering
        return

    def display_type_rich(self: TyperOption, ctx: object) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.owai_flags_bare = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flag_type_hidden()

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
    from owai.io import check_cache_root

    check_cache_root()  # every command: a cache that cannot hold anything is one line, before any run directory


def recipe_command(r: Any) -> list[str]:
    """The words of the command that runs recipe `r` (`owai recipes list` prints it; `owai recipes run`
    runs it): the method's command with `--recipe ID` where the command takes one (its positional
    alias dropped), `--study` for a recipe with a sweep where the command has one, and a placeholder
    for an input the user must give (mosaic-eval's MODELS...)."""
    group = typer.main.get_command(app)
    words = r.method_class().cli.split()[1:]
    cmd, depth = group, 0
    while depth < len(words) and hasattr(cmd, "commands") and words[depth] in cmd.commands:
        cmd, depth = cmd.commands[words[depth]], depth + 1
    options = {o for p in getattr(cmd, "params", []) for o in getattr(p, "opts", [])}
    rest = words[depth:]
    if "--recipe" in options and "--recipe" not in rest:
        rest = (rest[1:] if rest and not rest[0].startswith("-") else rest) + ["--recipe", r.id]
    if "--study" in options and r.sweep is not None and "--study" not in rest:
        rest.append("--study")
    inputs = [p for p in getattr(cmd, "params", []) if p.param_type_name == "argument" and p.nargs == -1]
    rest += [f"{(p.metavar or p.name.upper())}..." for p in inputs]  # what the user must give (mosaic-eval's models)
    return ["owai", *words[:depth], *rest]


@recipes_app.command("list")
def recipes_list(
    runs: Annotated[Optional[Path], typer.Option("--runs", help="Also show the claims' verdict of each recipe's newest run or sweep under this directory (e.g. runs/).")] = None,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """List recipes: id, thesis reference, presets, the command that runs it (or "not implemented"),
    the number of its claims and, with --runs DIR, their verdict on its newest run under DIR."""
    from owai import recipes
    from owai.claims import summary_counts
    from owai.report import latest_verdicts

    console.configure(quiet, as_json)
    if runs is not None and not runs.is_dir():
        raise OwaiError(f"--runs {runs}: no such directory")
    loaded = [recipes.load(name) for name in recipes.available()]

    last = latest_verdicts(runs) if runs is not None else {}
    rows = []
    for r in loaded:
        row = {"id": r.id, "reproduces": r.references, "presets": list(r.presets), "default": r.default_preset,
               "implemented": r.implemented, "command": " ".join(recipe_command(r)) if r.implemented else "", "claims": len(r.claims)}
        if runs is not None:
            row["last_run"] = last.get(r.id)
        rows.append(row)
    if as_json:
        console.emit_json(rows)
        return
    table = Table(title="owai recipes")
    for col in ["id", "reproduces", "presets", "command", "claims"] + (["last verdict"] if runs is not None else []):
        table.add_column(col)
    for row in rows:
        presets = ", ".join(f"[bold]{p}[/bold]" if p == row["default"] else p for p in row["presets"])
        command = escape(row["command"]) if row["implemented"] else "[dim]not implemented[/dim]"
        cells = [row["id"], row["reproduces"], presets, command, str(row["claims"])]
        if runs is not None:
            found = row["last_run"]
            cells.append("-" if found is None else escape(f"{summary_counts(found['claims'])} ({found['dir']})"))
        table.add_row(*cells)
    console.stdout.print(console.fit_table(table, whole=(0, 3)))  # the id and the command: what a user copies


@recipes_app.command("show")
def recipes_show(
    recipe: Annotated[Optional[str], typer.Argument(help="Recipe id or path to a recipe YAML file.", show_default=False)] = None,
    recipe_option: RecipeOption = None,
    preset: Preset = None,
    sets: Sets = None,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Show a recipe (its claims included) and its resolved parameters: at the default preset, or at
    --preset with --set applied."""
    recipe = one_recipe(recipe, recipe_option)
    if recipe is None:
        raise OwaiError("name a RECIPE to show (`owai recipes list` lists them)")
    import yaml

    from owai import recipes
    from owai.experiment import resolve

    console.configure(quiet, as_json)
    r = recipes.load(recipe)
    resolved = resolve(r, preset, sets or [], missing_ok=True)[1] if r.implemented else None
    if as_json:
        console.emit_json({"recipe": yaml.safe_load(recipes.dump(r)), "resolved": resolved})
        return
    console.stdout.print(recipes.dump(r), markup=False)
    if resolved is not None:
        console.stdout.print(f"# resolved params (preset {resolved['preset']}):", markup=False)
        console.stdout.print(yaml.safe_dump(resolved["params"], sort_keys=False), markup=False)
        if "missing" in resolved:
            console.stdout.print(f"# not runnable on this machine yet: {resolved['missing']}", markup=False)


@recipes_app.command("run")
@options
def recipes_run(
    recipe: Annotated[Optional[str], typer.Argument(help="Recipe id or path to a recipe YAML file.", show_default=False)] = None,
    recipe_option: RecipeOption = None,
    single: Annotated[bool, typer.Option("--single", help="One run of the recipe's parameters at the preset (a study's base point, a chain's first step), not its table.")] = False,
    opts: RunOptions = RunOptions(),
) -> None:
    """Run any recipe as the command `owai recipes list` prints for it (its method's subcommand with
    --recipe: a study recipe's study, a rich-features recipe's chain), with these options; --single
    (and --resume RUN_DIR) one run."""
    recipe = one_recipe(recipe, recipe_option)
    if recipe is None and opts.resume is None:
        raise OwaiError("name a RECIPE to run (or --resume RUN_DIR)")
    if recipe is not None and opts.resume is None and not single:
        argv = delegated_run(recipe, opts)
        if argv is not None:
            code = run_subcommand(argv)
            if code:
                raise typer.Exit(code)
            return
    opts.run(recipe, opts.sets)


def run_subcommand(argv: list[str]) -> int | None:
    """`owai ARGV` inside this command (its exit code): the same parser, and errors reach `main`'s one
    error path."""
    return app(args=argv, prog_name="owai", standalone_mode=False)


def delegated_run(recipe: str, opts: RunOptions) -> list[str] | None:
    """The arguments of the subcommand that runs `recipe` as `owai recipes list` prints it, with the
    options of `owai recipes run` given on (the recipe as the user named it: an id or a file; --tracker
    as its --set), or None where `recipes run` itself is that command (a method without a subcommand of
    its own) or the command needs inputs `recipes run` does not take (mosaic-eval's models).
    Without it, `recipes run` of a study or chain recipe made one run of the recipe's parameters: one
    point of fig2.11-scratch's grid, one network of tableA.2-resnet152's chain, no claim judged."""
    from owai import recipes

    words = recipe_command(recipes.load(recipe))[1:]
    if words[:2] == ["recipes", "run"] or any(w.endswith("...") for w in words):
        return None
    at = words.index("--recipe") + 1 if "--recipe" in words else None
    if at is not None:
        words[at] = recipe
    sets = opts.with_tracker(opts.sets) or []
    words += ["--preset", opts.preset] if opts.preset is not None else []
    words += [w for s in sets for w in ("--set", s)]
    words += ["--out", str(opts.out)] if opts.out is not None else []
    words += ["--quiet"] if opts.quiet else []
    words += ["--json"] if opts.as_json else []
    return words


@app.command("report")
def report(
    run_dir: Annotated[list[Path], typer.Argument(
        help="A run directory (or a sweep directory); or several runs of one recipe (e.g. one per model "
             "that names its thesis row), each reported, then the recipe's claims across the runs.")],
    markdown: Annotated[bool, typer.Option("--markdown", help="Print a Markdown table instead.")] = False,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Print a run's measured numbers beside the thesis's (a sweep's: mean ± std over seeds), then
    the recipe's claims judged on them: holds, misses or n/a (not measured), with the numbers.

    Several run directories of one recipe (chapter 4's models are evaluated one per run): each run
    as above, then "claims across the runs", the thesis's comparisons between models (v2 against the
    transformer, with against without long-term memory, ...) judged on the runs that name their rows
    (--set row=...). --json prints one document: recipe, runs (each run's own document) and
    claims_across."""
    from owai.report import runs_document

    if markdown and as_json:
        raise OwaiError("--markdown and --json are two output formats: give one of them")
    console.configure(quiet, as_json)
    if len(run_dir) > 1:  # several runs of one recipe (the argument keeps its name: `Missing argument 'run_dir'`)
        _report_runs(runs_document(run_dir), run_dir, markdown, as_json)
        return
    _report_one(run_dir[0], markdown, as_json)


def _report_one(run_dir: Path, markdown: bool, as_json: bool) -> None:
    """`owai report` of one run or one sweep directory."""
    from owai import sweep
    from owai.claims import summary_counts
    from owai.data.text import read_utf8
    from owai.report import claims_markdown, claims_table, run_claims, run_results, study_table_file, sweep_document
    from owai.report import markdown as to_markdown
    from owai.report import table

    if sweep.is_sweep_dir(run_dir):
        document = sweep_document(run_dir, sweep.summarise(sweep.open_sweep(run_dir)))
        verdicts, source, study = document["claims"], document["claims_source"], study_table_file(run_dir)
        if as_json:
            console.emit_json(document)
        elif markdown:  # a study's own table (its selection, the thesis beside it) after the points' summary
            sys.stdout.write(sweep.markdown(document) + ("\n" + read_utf8(study) if study is not None else "")
                             + (claims_markdown(verdicts) if verdicts else ""))
        else:
            console.stdout.print(sweep.table(document))
            if study is not None:
                console.stdout.print(f"study table: {study}", markup=False)
            if verdicts:
                console.stdout.print(claims_table(verdicts, f"thesis claims on {source}: {summary_counts(verdicts)}"))
        return
    results = run_results(run_dir)
    verdicts = run_claims(run_dir, results)
    if as_json:
        console.emit_json({**results, "claims": verdicts})
    elif markdown:
        sys.stdout.write(to_markdown(results) + (claims_markdown(verdicts) if verdicts else ""))
    else:
        console.stdout.print(table(results))
        if verdicts:
            console.stdout.print(claims_table(verdicts, f"thesis claims: {summary_counts(verdicts)}"))


def _report_runs(document: dict[str, Any], run_dirs: list[Path], markdown: bool, as_json: bool) -> None:
    """`owai report` of several runs: each run's table and claims as a single run's report prints
    them, one after the other, then the recipe's claims across the runs."""
    from owai.claims import summary_counts
    from owai.report import claims_markdown, claims_table
    from owai.report import markdown as to_markdown
    from owai.report import table

    across = document["claims_across"]
    title = f"claims across the {len(run_dirs)} runs: {summary_counts(across)}"
    if as_json:
        console.emit_json(document)
        return
    if markdown:
        parts = [to_markdown(run) + (claims_markdown(run["claims"]) if run["claims"] else "") for run in document["runs"]]
        end = claims_markdown(across) if across else "\nThe recipe states no claim across runs.\n"
        sys.stdout.write("\n".join(parts) + f"\n### {title}\n" + end)
        return
    for i, (run_dir, run) in enumerate(zip(run_dirs, document["runs"]), 1):
        console.stdout.print(f"run {i} of {len(run_dirs)}: {run_dir}", markup=False)
        console.stdout.print(table(run))
        if run["claims"]:
            console.stdout.print(claims_table(run["claims"], f"thesis claims: {summary_counts(run['claims'])}"))
    if across:
        console.stdout.print(claims_table(across, title))
    else:
        console.stdout.print(f"{document['recipe']} states no claim across runs", markup=False)


def _register_commands() -> None:
    import owai.commands

    for info in sorted(pkgutil.iter_modules(owai.commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"owai.commands.{info.name}").register(app)


_register_commands()


def _summaries_on_one_line(typer_app: typer.Typer) -> None:
    """Give each command whose summary (its docstring's first paragraph) wraps in the source that
    summary on one line as its short help: in rich markup mode Typer keeps the source's line breaks in
    a group's command list, so a wrapped docstring printed as ragged rows in `owai --help`."""
    for info in typer_app.registered_commands:
        summary = inspect.cleandoc(info.help or (info.callback.__doc__ if info.callback else None) or "").split("\n\n")[0]
        if info.short_help is None and "\n" in summary:
            info.short_help = " ".join(summary.split())
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _summaries_on_one_line(group.typer_instance)


_summaries_on_one_line(app)


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point (`owai` and `python -m owai`): the one error path. A user error (an
    OwaiError, or a usage error of the command line: a missing or unknown option, a bad value) is one
    `error:` line on stderr and exit code 2, never a traceback or the CLI library's usage box; --help,
    --version and a bare command group print help (exit 0); Ctrl-C exits 130, SIGTERM 143 and SIGHUP
    129 (a run stops as on Ctrl-C: status.json `interrupted`, resumable). A torchrun job's
    ranks leave their process group after a successful command (`owai.distributed.shutdown`). Called
    in-process with `argv` (tests, notebooks), it puts back the caller's output mode afterwards: a
    command's --quiet or --json does not outlive it."""
    if argv is None:
        _main(None)
        return
    mode = (console.state.quiet, console.state.json)
    try:
        _main(argv)
    finally:
        console.configure(*mode)


def _main(argv: Optional[list[str]]) -> None:
    """`main`'s body: the command, its error path and its exit code."""
    termination = Termination()
    try:
        with stop_on_termination() as termination:  # SIGTERM / SIGHUP: a run stops as on Ctrl-C, marked interrupted
            code = app(args=sys.argv[1:] if argv is None else list(argv), prog_name="owai", standalone_mode=False)
        if not code and "torch.distributed" in sys.modules:  # a torchrun job's ranks leave their process group together
            from owai import distributed

            distributed.shutdown()
    except click.NoArgsIsHelpError:
        code = 0  # the help is printed already
    except click.ClickException as e:  # usage errors (UsageError, BadParameter, NoSuchOption, ...) included
        _fail(usage_message(e), 2, own=True)
    except PeerFailed as e:  # another rank's failure, seen from rank 0: that rank gives torchrun its error
        _fail(user_message(e), e.exit_code, symptom=True)
    except OwaiError as e:
        _fail(user_message(e), e.exit_code, own=True)
    except (typer.Abort, KeyboardInterrupt):  # typer.Abort: Click's Abort under every Typer (its own copy has none)
        _interrupted(termination)
    except Exception as e:  # noqa: BLE001 - the last line of defence against tracebacks
        if os.environ.get("OWAI_DEBUG"):
            raise
        rank = _wait_for_rank0()
        _for_torchrun(one_line(e), e)
        with termination_deferred():  # see _fail
            console.stderr.print(f"internal error: {_rank_words(rank)}{type(e).__name__}: {e} (set OWAI_DEBUG=1 for the traceback)",
                                 markup=False, soft_wrap=True)
            _exit(1)
    if code == 130:  # Typer turns Ctrl-C (and so a Terminated) into Exit(130)
        _interrupted(termination)
    if isinstance(code, int) and not isinstance(code, bool) and code:  # typer.Exit(code) / ctx.exit(code)
        sys.exit(code)
    if argv is None:  # the process's command is done: a Ctrl-C during the interpreter's shutdown would
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # print a traceback from its atexit handlers


def usage_message(error: click.ClickException) -> str:
    """A Click error as one line: its message (which names the option or argument and the problem),
    then where the command's help is."""
    text = " ".join(error.format_message().split())
    ctx = getattr(error, "ctx", None)
    if isinstance(error, click.UsageError) and ctx is not None:
        text = f"{text.rstrip('.')} (see `{ctx.command_path} --help`)"
    return text


# Under torchrun every rank runs the same command line, so an error that every rank reaches (bad
# input, a refusal, the one rank 0 broadcast while setting up the run) would print once per rank.
# Rank 0 prints at once; another rank waits this long first: when rank 0 fails too, torchrun stops
# the other ranks as soon as it exits, so the line is printed once, and an error of that rank alone
# is still printed, this much later.
OTHER_RANK_ERROR_DELAY_S = 5.0


def _wait_for_rank0() -> int:
    """Before a torchrun job's rank other than 0 prints an error (see OTHER_RANK_ERROR_DELAY_S).
    Returns this process's rank, torchrun's environment's (the process group may not be joined yet;
    0 outside torchrun)."""
    if "WORLD_SIZE" not in os.environ:  # not under torchrun: owai.distributed (and torch) stay unimported
        return 0
    from owai.distributed import launch_rank

    rank = launch_rank()
    if rank != 0:
        try:
            time.sleep(OTHER_RANK_ERROR_DELAY_S)
        except KeyboardInterrupt:  # a second Ctrl-C: print now
            pass
    return rank


def _rank_words(rank: int) -> str:
    """What an error line of a torchrun job's rank other than 0 starts with: which rank says it (the
    ranks' lines are interleaved in the job's output, and rank 0's is the job's)."""
    return f"rank {rank}: " if rank else ""


def _for_torchrun(message: str, error: BaseException | None = None) -> None:
    """Give torchrun this rank's error line for its closing report (`distributed.record_for_torchrun`),
    unless `error` is the rank losing its peers (`distributed.lost_peer`: a symptom of another rank's
    failure, which torchrun would otherwise take for the root cause). Only under torchrun."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:  # outside torchrun torch stays unimported
        return
    from owai import distributed

    if error is None or not distributed.lost_peer(error):
        distributed.record_for_torchrun(message)


def _interrupted(termination: Termination) -> None:
    """Ctrl-C: "interrupted", exit 130; SIGTERM / SIGHUP: which signal stopped the command, exit
    128 + its number, as a shell reports a process that signal ended."""
    if termination.signum is None:
        _fail("interrupted", 130)
    _fail(f"stopped by {signal.Signals(termination.signum).name}", 128 + termination.signum)


# torchrun polls its ranks every 0.1 s (--monitor-interval) and takes the earliest failure it sees as
# the job's root cause (ties: the lowest rank). Rank 0, having lost contact with a rank that failed,
# ends this much later, so that torchrun sees the failed rank end first (a rank killed by SIGKILL leaves
# no error file, and its failure and rank 0's would tie in the same poll).
SYMPTOM_DELAY_S = 1.0


def _fail(message: str, code: int, own: bool = False, symptom: bool = False) -> None:
    """Print `message` as the command's one `error:` line and exit with `code`. `own`: an error of
    this process's own (not a stop), which a torchrun job's rank also gives torchrun's report.
    `symptom`: another rank's failure as rank 0 saw it (`PeerFailed`), said after SYMPTOM_DELAY_S."""
    rank = _wait_for_rank0()
    if own:  # after the wait: a rank that torchrun stops meanwhile (rank 0 failed too) leaves torchrun no file
        _for_torchrun(message)
    # the line is printed whole: torchrun's SIGTERM (sent to rank 0 the moment another rank has ended)
    # would otherwise kill the rank before it, the command's stop-signal handler being gone by now
    with termination_deferred():
        if symptom:
            with contextlib.suppress(KeyboardInterrupt):  # a Ctrl-C: print now
                time.sleep(SYMPTOM_DELAY_S)
        console.stderr.print(f"[red]error:[/red] {escape(_rank_words(rank) + message)}", highlight=False, soft_wrap=True)
        _exit(code)


def _exit(code: int) -> None:
    """Exit after an error: `sys.exit(code)`, except in a rank that joined a torchrun job's process
    group. Such a rank leaves the group without tearing it down (a collective teardown could wait
    for a peer that is still working), and Python's shutdown beside a live peer then aborted in
    gloo's destructors about one time in two ("terminate called without an active exception",
    SIGABRT instead of the exit code): it flushes its output and ends at once, as torchrun then
    ends the other ranks."""
    release_frames(sys.exc_info()[1])  # an in-process caller gets what the command held back now
    # torch.distributed is looked up, never imported: a Ctrl-C can stop torch's own import half-way,
    # and importing it again then fails inside torch ("duplicate registrations for aten...")
    dist = sys.modules.get("torch.distributed")
    try:
        joined = dist is not None and dist.is_available() and dist.is_initialized()
    except Exception:  # half-initialised by that interrupted import: no process group was joined
        joined = False
    if joined:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":  # `python -m owai.cli ...` (e.g. `torchrun -m owai.cli ...`) is `python -m owai ...`
    main()
