"""Execute a recipe: resolve its config, create or resume a run, call the method, write results.

This is the one path from the CLI (`owai moons`, `owai recipes run`, sweep points) to a method.

A resume continues the run's own config (config.yaml), refuses a run of another command, and may
change only the method's `resume_overrides` (optimisation settings such as train.lr), recorded in
config_history.jsonl. Non-finite training state or metrics end the run as `failed`, never `complete`.
"""

from __future__ import annotations

import copy
import datetime as dt
import gc
import math
import shlex
from pathlib import Path
from typing import Any

from owai import console, distributed, trackers
from owai.checkpoint import CorruptCheckpoint, NonFiniteError, latest_checkpoint, list_checkpoints, load_checkpoint, recorded_identity
from owai.config import apply_overrides, build, override_leaves, parse_override, to_dict
from owai.errors import CannotRunHere, OwaiError, PeerFailed, Terminated
from owai.recipes import Recipe, load, recorded_name, thesis_for
from owai.runs import OUT, Run, config_hash, ensure_writable, environment, is_sweep_dir


def resolve(recipe: Recipe, preset: str | None, overrides: list[str],
            missing_ok: bool = False, validate: bool = True, refuse_unread: bool = False) -> tuple[Any, dict[str, Any]]:
    """Build the typed config (defaults <- params <- preset <- --set) and its serialisable form.
    With `missing_ok` a valid config that cannot run here (CannotRunHere: an input not on this
    machine, or a model too large for it) resolves, with the reason under "missing" (for `owai
    recipes show` and a sweep's plan, which name it after every setting); a run never passes it. Without
    `validate` only the types are checked (a dry run that plans, but never runs, the config). With
    `refuse_unread` an override that the run never reads is refused (`refuse_unused`), before the
    inputs are looked for."""
    preset = preset or recipe.default_preset
    schema = recipe.method_class().Config
    params = apply_overrides(schema, recipe.params_for(preset), overrides)
    cfg = build(schema, params, path="params")
    trackers.require(cfg.runtime.tracker)
    if refuse_unread:
        refuse_unused(recipe, [cfg], overrides)
    missing = None
    try:
        if validate:
            recipe.method_class().validate(cfg)
    except CannotRunHere as e:
        if not missing_ok:
            raise
        missing = str(e)
    resolved = {
        "recipe": recipe.id,
        "recipe_source": recipe.source,
        "method": recipe.method,
        "preset": preset,
        "overrides": list(overrides),
        "params": to_dict(cfg),
    }
    if missing:
        resolved["missing"] = missing
    return cfg, resolved


def refuse_unused(recipe: Recipe, cfgs: list[Any], overrides: list[str], sweep: bool = False) -> None:
    """One-line refusal of an override that none of the runs `cfgs` reads (`Method.unused_settings`):
    a new run's own settings, or (`sweep`) a sweep's base settings against all its points. A key is
    unread where it, or a section above it, is named; a mapping (`--set 'penalty={weight: 3}'`) is
    read key by key. A sweep point's grid values are not checked: a grid may cross a setting with
    another that turns it off (init rand beside erm, each with its anneal lengths)."""
    method = recipe.method_class()
    found = [method.unused_settings(cfg) for cfg in cfgs]
    if not found or not any(found):
        return

    def why_unread(key: str, unused: dict[str, str]) -> str | None:
        for setting, why in unused.items():
            if key == setting or key.startswith(setting + "."):
                return why
        return None

    for text in overrides:
        for key, _ in override_leaves(text):
            reasons = [why_unread(key, unused) for unused in found]
            if all(reasons):
                if not sweep:
                    raise OwaiError(f"{key} is unused here: {reasons[0]}")
                distinct = list(dict.fromkeys(reasons))
                raise OwaiError(f"{key} is unused in every point of the sweep: {distinct[0]}"
                                + (f" (and {len(distinct) - 1} more reasons)" if len(distinct) > 1 else ""))


def command_line(recipe: Recipe, preset: str, overrides: list[str]) -> str:
    """The command that repeats the run, as results.json and `owai report` print it (shell-quoted: an
    override such as `models=["/a b"]` reaches the parser as recorded): the method's command with
    `--recipe ID` unless the command already names the recipe (twobits, three-moons, the recall
    recipe), since most commands serve several recipes and without it would run their default one.
    `owai recipes run RECIPE --single` (the generic one run) where the method's command cannot make
    this run from its recipe, preset and overrides (`Method.one_run_command` false: the command runs
    a whole study or chain, or takes its inputs otherwise) or the recipe is a file (RECIPE its path,
    as `_recipe_argument` names it: `--recipe ID` would not load it, and a command that names its
    own recipe would refuse a second one)."""
    method = recipe.method_class()
    name = _recipe_argument(recipe)
    if method.one_run_command and name == recipe.id:
        words = method.cli.split()
        words += [] if recipe.id in words else ["--recipe", recipe.id]
    else:
        words = ["owai", "recipes", "run", name, "--single"]
    return shlex.join([*words, "--preset", preset, *(w for o in overrides for w in ("--set", o))])


def run_identity(recipe: Recipe, params: dict[str, Any]) -> dict[str, Any]:
    """What every checkpoint of a run records and a resume must match: the command, recipe and
    method, and a hash of the params without the method's `resume_overrides` (which a resume may
    change; config_history.jsonl records when)."""
    cls = recipe.method_class()
    fixed = copy.deepcopy(params)
    for key in cls.resume_overrides:
        *parents, leaf = key.split(".")
        node: Any = fixed
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return {"command": cls.cli, "recipe": recipe.id, "method": recipe.method, "config_hash": config_hash(fixed)}


def verify_checkpoints(run: Run, identity: dict[str, Any]) -> dict[str, int]:
    """Check every stage's newest checkpoint (checksum, finite tensors and, where it records one,
    its identity: this run's, its own stage) before a resume writes anything. Returns {stage: step}."""
    found = {}
    root = run.path / "checkpoints"
    for stage_dir in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        last = latest_checkpoint(stage_dir)
        if last is not None:
            try:
                recorded = recorded_identity(last)  # train_loop refuses a stage checkpoint without one
                load_checkpoint(last, expect=None if recorded is None else {**identity, "stage": stage_dir.name})
            except CorruptCheckpoint as e:  # e.g. a power cut before its tensors reached the disk
                earlier = list_checkpoints(stage_dir)[:-1]
                if earlier:
                    raise OwaiError(f"{e}; remove {last} to resume from the checkpoint before it, {earlier[-1].name}") from None
                raise
            found[stage_dir.name] = int(last.name[5:])
    return found


def effective_config(run: Run, recipe: Recipe, resolved: dict[str, Any]) -> dict[str, Any]:
    """config.yaml's resolved config with the settings later resumes changed (config_history.jsonl),
    listed under "resume_overrides"."""
    changes = [o for entry in run.config_history() for o in entry["overrides"]]
    if not changes:
        return resolved
    check_resume_overrides(recipe, changes)
    params = apply_overrides(recipe.method_class().Config, resolved["params"], changes)
    return {**resolved, "params": params, "resume_overrides": changes}


def check_resume_overrides(recipe: Recipe, overrides: list[str]) -> None:
    """Each `--set` given with --resume must name one of the method's `resume_overrides`."""
    allowed = recipe.method_class().resume_overrides
    for text in overrides:
        key = ".".join(parse_override(text)[0])
        if key not in allowed:
            can = f"only {', '.join(allowed)} can" if allowed else "no setting can"
            raise OwaiError(f"--set {key}: {can} change when resuming a {recipe.method} run")


def nonfinite_metrics(measured: dict[str, Any]) -> list[str]:
    """Names of measured numbers that are NaN or infinite (in lists too, e.g. name[2])."""
    bad: list[str] = []

    def visit(name: str, value: Any) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            bad.append(name)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(f"{name}[{i}]", v)
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(f"{name}.{k}", v)

    for name, value in measured.items():
        visit(name, value)
    return bad


def resume_hint(run: Run) -> str:
    """How to continue an unfinished run: a plain resume, or, for a run that failed on non-finite
    training state, a resume with a lower learning rate of the stage that failed (`Method.lr_override`)."""
    plain = f"resume it with --resume {run.path}"
    try:
        resolved = run.read_config()
        recipe = load(recorded_name(resolved["recipe"], resolved.get("recipe_source")))
        resolved = effective_config(run, recipe, resolved)
    except OwaiError:
        return plain
    command = f"owai recipes run {_recipe_argument(recipe)} --resume {run.path}"
    nonfinite = run.status_info().get("nonfinite") if run.status() == "failed" else None
    if not isinstance(nonfinite, dict):
        return f"resume it with `{command}`"
    if "metrics" in nonfinite:
        return "its evaluation gave non-finite metrics; start a new run with other settings"
    allowed = recipe.method_class().resume_overrides
    if is_sweep_dir(run.path.parent.parent):
        return "a sweep point keeps its grid's settings: sweep again with a lower learning rate"
    key = recipe.method_class().lr_override(str(nonfinite.get("stage", "")))
    if not allowed or key is None:
        return f"{recipe.method} settings cannot change on resume: start a new run with a lower learning rate"
    value: Any = resolved["params"]
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    lower = f"{value / 10:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "VALUE"
    return (f"continue it from its last finite checkpoint with other optimisation settings "
            f"({', '.join(allowed)}): `{command} --set {key}={lower}`")


def _recipe_argument(recipe: Recipe) -> str:
    """How a command line names `recipe`: its id when that loads this very recipe, else its file."""
    try:
        return recipe.id if load(recipe.id).source == recipe.source else recipe.source
    except OwaiError:
        return recipe.source


def execute(
    recipe_name: str | None = None,
    preset: str | None = None,
    overrides: list[str] | None = None,
    out: Path | None = None,
    resume: Path | None = None,
    run_dir: Path | None = None,
    methods: tuple[str, ...] | None = None,
) -> tuple[Run, dict[str, Any]]:
    """Run a recipe (or resume a run directory) to completion; returns (run, results).

    `run_dir` puts a new run at exactly that (not yet existing) directory instead of
    out/<recipe>/<time>-<hash>/ (sweep points use it). With `resume`, `overrides` may change only
    the method's `resume_overrides`, and the run must be of one of `methods` (the invoking
    command's) or, if `recipe_name` is given, of that recipe's method."""
    overrides, out = list(overrides or []), Path(out) if out is not None else OUT
    if distributed.launched_by_torchrun():
        run = _agree_on_run(recipe_name, preset, overrides, out, resume, run_dir, methods)
    else:
        run = _prepare(recipe_name, preset, overrides, out, resume, run_dir, methods)
    run.writes = distributed.is_main()
    resolved = run.read_config()
    recipe = load(recorded_name(resolved["recipe"], resolved.get("recipe_source")))
    resolved = effective_config(run, recipe, resolved)
    cfg = build(recipe.method_class().Config, resolved["params"], path=f"{run.path}/config.yaml params")
    if resume is not None:
        results = run.results()
        if results is not None:
            if run.status() != "complete":  # killed after its results were written, or status.json lost
                run.set_status("complete")
            console.info(f"{run.path} is already complete")
            return run, results
        console.info(f"resuming {run.path}")
        run.set_status("running")  # not the killed attempt's interrupted / failed while it runs again
    return _run_method(recipe, cfg, resolved, run)


def _prepare(
    recipe_name: str | None, preset: str | None, overrides: list[str], out: Path, resume: Path | None,
    run_dir: Path | None, methods: tuple[str, ...] | None = None,
) -> Run:
    """Create the run directory of a new run (everything validated first), or open and verify the
    one being resumed. The method then reads its config back from config.yaml either way."""
    if resume is not None:
        return _prepare_resume(resume, recipe_name, preset, overrides, methods)
    if recipe_name is None:
        raise OwaiError("no recipe given")
    recipe = load(recipe_name)
    if not recipe.implemented:
        raise OwaiError(f"recipe {recipe.id!r} needs method {recipe.method!r}, which is not implemented yet")
    # a sweep's point (run_dir) was checked with its sweep: its grid values may be unread
    cfg, resolved = resolve(recipe, preset, overrides, refuse_unread=run_dir is None)
    from owai.runtime import select_device  # this machine runs it: a device it lacks is refused here

    select_device(cfg.runtime.device)
    ensure_writable(out if run_dir is None else Path(run_dir).parent)
    run = Run.create(out, recipe.id, resolved) if run_dir is None else Run.create_at(run_dir, resolved)
    console.info(f"run directory: {run.path}")
    return run


def recorded_recipe(run: Run, resolved: dict[str, Any], methods: tuple[str, ...] | None = None) -> Recipe:
    """The recipe of run directory `run` (`resolved`: its config.yaml). With `methods` (those of the
    command resuming it), it must be a recipe of one of them, else one line naming the command that does."""
    recipe = load(recorded_name(resolved["recipe"], resolved.get("recipe_source")))
    if methods is not None and recipe.method not in methods:
        raise OwaiError(f"{run.path} is a run of `{recipe.method_class().cli}` (recipe {recipe.id}), not of this "
                        f"command; resume it with `owai recipes run {_recipe_argument(recipe)} --resume {run.path}`")
    return recipe


def _prepare_resume(
    resume: Path, recipe_name: str | None, preset: str | None, overrides: list[str], methods: tuple[str, ...] | None
) -> Run:
    """Open the run being resumed and check, before anything is written: that it is a run of this
    command, that the `--set` overrides are resumable settings with valid values, and that every
    stage's newest checkpoint is intact, finite and this run's. Records the overrides."""
    if preset:
        raise OwaiError("--resume takes its config from the run directory; drop --preset")
    run = Run.open(resume)
    resolved = run.read_config()
    trackers.require(resolved.get("params", {}).get("runtime", {}).get("tracker", "none"))
    if methods is None and recipe_name is not None:
        methods = (load(recipe_name).method,)
    recipe = recorded_recipe(run, resolved, methods)
    if run.results() is not None:  # written atomically, as a run's last step: the run is complete
        if overrides:
            raise OwaiError(f"{run.path} is already complete; --set with --resume changes only an unfinished run")
        return run
    resolved = effective_config(run, recipe, resolved)
    schema = recipe.method_class().Config
    if overrides:
        if is_sweep_dir(run.path.parent.parent):
            raise OwaiError(f"{run.path} is a sweep point, whose settings are its grid's; --set with --resume applies to single runs")
        check_resume_overrides(recipe, overrides)
    # the config the resume will run, checked here: a value edited into config.yaml is named, not
    # taken for a checkpoint of another config
    params = apply_overrides(schema, resolved["params"], overrides) if overrides else resolved["params"]
    recipe.method_class().validate(build(schema, params, path="params" if overrides else f"{run.path}/config.yaml params"))
    checkpoints = verify_checkpoints(run, run_identity(recipe, resolved["params"]))
    run.remove_write_temporaries()
    run.clear_rank_errors()  # the stopped attempt's: status.json says `running` again too
    if overrides:
        run.record_overrides(overrides, checkpoints)
    return run


def _agree_on_run(
    recipe_name: str | None, preset: str | None, overrides: list[str], out: Path, resume: Path | None,
    run_dir: Path | None, methods: tuple[str, ...] | None = None,
) -> Run:
    """Under torchrun: rank 0 creates (or opens) the run directory and tells the other ranks where
    it is, or the one-line error that stopped it; every rank then runs the method."""
    distributed.init()
    if not distributed.is_main():
        console.configure(quiet=True)  # one progress display and one report: rank 0's
    message: tuple[str | None, str | None] | None = None
    if distributed.is_main():
        try:
            message = (str(_prepare(recipe_name, preset, overrides, out, resume, run_dir, methods).path), None)
        except OwaiError as e:
            message = (None, str(e))
    path, error = distributed.broadcast_object(message)
    if error is not None:
        raise OwaiError(error)
    return Run.open(Path(path))


def _run_method(recipe: Recipe, cfg: Any, resolved: dict[str, Any], run: Run) -> tuple[Run, dict[str, Any]]:
    """Set up the runtime, run the method, write results.json and the final status."""
    import torch

    from owai import runtime

    # the run's threads, determinism and subnormal flushing for its own duration: the process's own come
    # back after it, for the next run in this process (a sweep's points, chained stages) or the caller
    with runtime.applied(cfg.runtime, cfg.seed + distributed.world().rank) as (device, run.dtype):
        run.device = distributed.device_for(device)
        run.identity = run_identity(recipe, resolved["params"])
        run.write_env(environment(str(run.device), cfg.runtime.dtype, cfg.seed))
        method = recipe.method_class()()
        world = distributed.world()
        try:
            if run.writes:
                run.tracker = trackers.open_tracker(cfg.runtime.tracker, run.path, resolved)
            outcome = method.run(cfg, run)
            bad = nonfinite_metrics(outcome.measured)
            if run.tracker is not None and not bad:  # the numbers results.json gets, beside the metrics lines the run
                run.tracker.log(trackers.RESULTS_STAGE, 0, outcome.measured)  # logged (an evaluation logs none)
        except NonFiniteError as e:
            run.record_failure(e, world.rank, world.world_size,
                               nonfinite={"stage": e.stage, "step": e.step, "checkpoint": e.checkpoint})
            raise NonFiniteError(f"{e}; {resume_hint(run)}", e.stage, e.step, e.checkpoint) from None
        except BaseException as e:  # Ctrl-C, a stop signal, a SLURM job's timeout (submitit exits it to requeue it): interrupted
            cause = run.record_failure(e, world.rank, world.world_size)  # status.json (rank 0) or error.rankR.json (another rank)
            if cause is not None:  # rank 0 lost its peers or was stopped after one failed: say why (another rank's
                # error), not gloo's closed connection or torchrun's SIGTERM
                how = f"was stopped by {e.args[0]}" if isinstance(e, Terminated) else "lost contact with it"
                raise PeerFailed(f"{cause}; rank 0 {how}") from None
            raise
        finally:
            if run.tracker is not None:
                run.tracker.close()
                run.tracker = None
            # The run's models and optimizer states, freed now rather than at the cyclic collector's next
            # full pass: a figure's text drawn during the run (matplotlib's mathtext, whose pyparsing keeps
            # exceptions that hold the stack's frames) leaves them in reference cycles, and the next run in
            # this process (an in-process sweep's point, a chained stage) would build its own beside them
            # in GPU memory, which Python's collector does not see. On a CPU they wait for that pass
            # (bounded, never accumulating); a full collection costs about 0.3 s a run.
            if torch.cuda.is_initialized():
                gc.collect()
    if bad:
        error = f"non-finite metrics ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''}); {run.path} is failed and has no results.json"
        run.set_status("failed", error=error, nonfinite={"metrics": bad})
        raise OwaiError(error)
    results = assemble(recipe, resolved, outcome.measured, outcome.details, run)
    if resolved.get("resume_overrides"):
        results["config_history"] = run.config_history()
    run.write_results(results)
    run.set_status("complete")
    return run, results


def assemble(
    recipe: Recipe, resolved: dict[str, Any], measured: dict[str, Any], details: dict[str, Any], run: Run
) -> dict[str, Any]:
    """The one results format: measured numbers beside the thesis's, matched by metric name (and,
    for a number the thesis reports per setting, by the run's params; see `thesis_for`), and the
    recipe's claims judged on them (`owai.claims`)."""
    from owai.claims import judge_all, run_records

    numbers = {name: thesis_for(recipe, name, resolved["params"]) for name in recipe.thesis}
    names = list(measured) + [k for k, n in numbers.items() if n is not None and k not in measured]
    rows = []
    for name in names:
        thesis = numbers.get(name)
        rows.append(
            {
                "metric": name,
                "measured": measured.get(name),
                "thesis": thesis.value if thesis else None,
                "thesis_claim": thesis.claim if thesis else "",
                "ref": thesis.ref if thesis else "",
            }
        )
    return {
        "recipe": recipe.id,
        "title": recipe.title,
        "reproduces": recipe.references,
        "preset": resolved["preset"],
        "command": command_line(recipe, resolved["preset"], resolved["overrides"]),
        "seed": resolved["params"].get("seed"),  # the run's own (a copied results.json names it)
        "run_dir": str(run.path),
        "finished": dt.datetime.now().isoformat(timespec="seconds"),
        "rows": rows,
        "claims": judge_all(recipe.claims, run_records({"rows": rows}, resolved["params"]), resolved["preset"]),
        "details": details,
    }
