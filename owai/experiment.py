"""Execute a recipe: resolve its config, create or resume a run, call the method, write results.

This is the one path from the CLI (`owai moons`, `owai recipes run`, sweep points) to a method.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from owai import console, distributed
from owai.checkpoint import latest_checkpoint, load_checkpoint
from owai.config import apply_overrides, build, to_dict
from owai.errors import OwaiError
from owai.recipes import Recipe, load, recorded_name, thesis_for
from owai.runs import Run, ensure_writable, environment


def resolve(recipe: Recipe, preset: str | None, overrides: list[str]) -> tuple[Any, dict[str, Any]]:
    """Build the typed config (defaults <- params <- preset <- --set) and its serialisable form."""
    preset = preset or recipe.default_preset
    schema = recipe.method_class().Config
    params = apply_overrides(schema, recipe.params_for(preset), overrides)
    cfg = build(schema, params, path="params")
    recipe.method_class().validate(cfg)
    resolved = {
        "recipe": recipe.id,
        "recipe_source": recipe.source,
        "method": recipe.method,
        "preset": preset,
        "overrides": list(overrides),
        "params": to_dict(cfg),
    }
    return cfg, resolved


def command_line(recipe: Recipe, preset: str, overrides: list[str]) -> str:
    cli = recipe.method_class().cli
    return " ".join([cli, f"--preset {preset}", *(f"--set {o}" for o in overrides)])


def verify_checkpoints(run: Run) -> None:
    """Check every stage's newest checkpoint before a resume writes anything."""
    root = run.path / "checkpoints"
    for stage_dir in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        last = latest_checkpoint(stage_dir)
        if last is not None:
            load_checkpoint(last)


def execute(
    recipe_name: str | None = None,
    preset: str | None = None,
    overrides: list[str] | None = None,
    out: Path = Path("runs"),
    resume: Path | None = None,
    run_dir: Path | None = None,
) -> tuple[Run, dict[str, Any]]:
    """Run a recipe (or resume a run directory) to completion; returns (run, results).

    `run_dir` puts a new run at exactly that (not yet existing) directory instead of
    out/<recipe>/<time>-<hash>/ (sweep points use it)."""
    overrides = list(overrides or [])
    if distributed.launched_by_torchrun():
        run = _agree_on_run(recipe_name, preset, overrides, out, resume, run_dir)
    else:
        run = _prepare(recipe_name, preset, overrides, out, resume, run_dir)
    run.writes = distributed.is_main()
    resolved = run.read_config()
    recipe = load(recorded_name(resolved["recipe"], resolved.get("recipe_source")))
    cfg = build(recipe.method_class().Config, resolved["params"], path=f"{run.path}/config.yaml params")
    if resume is not None:
        if run.status() == "complete" and run.results() is not None:
            console.info(f"[green]{run.path} is already complete[/green]")
            return run, run.results()  # type: ignore[return-value]
        console.info(f"resuming {run.path}")
    return _run_method(recipe, cfg, resolved, run)


def _prepare(
    recipe_name: str | None, preset: str | None, overrides: list[str], out: Path, resume: Path | None, run_dir: Path | None
) -> Run:
    """Create the run directory of a new run (everything validated first), or open and verify the
    one being resumed. The method then reads its config back from config.yaml either way."""
    if resume is not None:
        if overrides or preset:
            raise OwaiError("--resume takes its config from the run directory; drop --preset/--set")
        run = Run.open(resume)
        if not (run.status() == "complete" and run.results() is not None):
            verify_checkpoints(run)
        return run
    if recipe_name is None:
        raise OwaiError("no recipe given")
    recipe = load(recipe_name)
    if not recipe.implemented:
        raise OwaiError(f"recipe {recipe.id!r} needs method {recipe.method!r}, which is not implemented yet")
    _, resolved = resolve(recipe, preset, overrides)
    ensure_writable(out if run_dir is None else Path(run_dir).parent)
    run = Run.create(out, recipe.id, resolved) if run_dir is None else Run.create_at(run_dir, resolved)
    console.info(f"run directory: {run.path}")
    return run


def _agree_on_run(
    recipe_name: str | None, preset: str | None, overrides: list[str], out: Path, resume: Path | None, run_dir: Path | None
) -> Run:
    """Under torchrun: rank 0 creates (or opens) the run directory and tells the other ranks where
    it is, or the one-line error that stopped it; every rank then runs the method."""
    distributed.init()
    if not distributed.is_main():
        console.configure(quiet=True)  # one progress display and one report: rank 0's
    message: tuple[str | None, str | None] | None = None
    if distributed.is_main():
        try:
            message = (str(_prepare(recipe_name, preset, overrides, out, resume, run_dir).path), None)
        except OwaiError as e:
            message = (None, str(e))
    path, error = distributed.broadcast_object(message)
    if error is not None:
        raise OwaiError(error)
    return Run.open(Path(path))


def _run_method(recipe: Recipe, cfg: Any, resolved: dict[str, Any], run: Run) -> tuple[Run, dict[str, Any]]:
    """Set up the runtime, run the method, write results.json and the final status."""
    from owai import runtime

    device, run.dtype = runtime.setup(cfg.runtime, cfg.seed + distributed.world().rank)
    run.device = distributed.device_for(device)
    run.write_env(environment(str(run.device), cfg.runtime.dtype, cfg.seed))
    method = recipe.method_class()()
    try:
        outcome = method.run(cfg, run)
    except KeyboardInterrupt:
        run.set_status("interrupted")
        raise
    except BaseException as e:
        run.set_status("failed", error=f"{type(e).__name__}: {e}")
        raise
    results = assemble(recipe, resolved, outcome.measured, outcome.details, run)
    run.write_results(results)
    run.set_status("complete")
    return run, results


def assemble(
    recipe: Recipe, resolved: dict[str, Any], measured: dict[str, Any], details: dict[str, Any], run: Run
) -> dict[str, Any]:
    """The one results format: measured numbers beside the thesis's, matched by metric name (and,
    for a number the thesis reports per setting, by the run's params; see `thesis_for`)."""
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
        "run_dir": str(run.path),
        "finished": dt.datetime.now().isoformat(timespec="seconds"),
        "rows": rows,
        "details": details,
    }
