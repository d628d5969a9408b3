"""Sweeps: a grid over recipe parameters crossed with seeds, every point an ordinary run directory.

    OUT/<recipe>/sweep-<YYYYmmdd-HHMMSS>-<hash>/
        sweep.json          the plan: recipe, preset, base --sets, grid, seeds, select, points (id, overrides)
        points/<point-id>/  one normal run directory per point (config.yaml, results.json, ...)
        summary.json        per grid cell, mean ± std over seeds of every numeric metric; with a
                            selection, the best cell per group
        slurm/              submitit's job files (--executor slurm / submitit-debug)

A grid is a dict {path: values} (one cartesian product) or a list of such dicts (the union of their
products, like sklearn's ParameterGrid); a recipe preset may bring its own grid and seeds. A
selection (`select: {metric, mode, per}`) picks, per group of the `per` keys' values, the cell whose
mean metric over seeds is best (ties: the first cell in grid order).

A point is its base `--set`s, then its grid values, then `seed=S`, run through the one recipe path
(`owai.experiment.execute`). It is complete once its results.json exists; a point directory with a
config.yaml but no results is resumed from its checkpoints; anything else starts fresh. So running
a sweep again (`owai sweep --resume SWEEP_DIR`) only does the unfinished work.

Executors: `local` runs points in this process (workers=1) or in spawned worker processes;
`slurm` submits one job array through submitit; `submitit-debug` is submitit's in-process cluster
(the same code path as slurm, testable without a cluster).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import os
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from owai import console
from owai.config import build, coerce, load_yaml, override_leaves, parse_override
from owai.errors import CannotRunHere, OwaiError, Terminated, one_line, release_frames, stop_on_termination
from owai.io import atomic_write_json, build_lock, is_write_temporary, remove_write_temporaries
from owai.recipes import Grid, Recipe, Selection, check_path, load, recipe_claims, recorded_name, sub_grids
from owai.runs import CONFIG, OUT, RESULTS, SWEEP, Run, config_hash, ensure_writable, is_sweep_dir, new_unique_dir, timestamp
from owai.values import fmt, md_row, numeric, thesis_text

SUMMARY = "summary.json"
POINTS = "points"
EXECUTORS = ("local", "slurm", "submitit-debug")
STD = "sample standard deviation over seeds (n - 1 denominator); null when n < 2"
SLURM_TIMEOUT_MIN = 240  # submitit's own default (5 minutes) kills real runs


@dataclasses.dataclass
class Point:
    """One run of a sweep: its grid values, its seed and the `--set` overrides that make it."""

    id: str  # directory name under points/: readable key=value text plus a hash of the overrides
    label: str  # e.g. "train.lr=0.01 seed=1"
    grid: dict[str, Any]
    seed: int
    overrides: list[str]


@dataclasses.dataclass
class Sweep:
    path: Path
    recipe: str
    recipe_source: str
    preset: str
    sets: list[str]
    grid: Grid  # as written: a dict, or a list of dicts (a union)
    seeds: list[int]
    points: list[Point]
    created: str = ""
    select: Selection | None = None

    def point_dir(self, point: Point) -> Path:
        return self.path / POINTS / point.id

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("path")
        return {"kind": "owai-sweep", "version": 1, **data}


@dataclasses.dataclass
class SlurmOptions:
    """submitit parameters for --executor slurm (None = the cluster's default)."""

    partition: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    timeout_min: int | None = None
    mem_gb: float | None = None
    array_parallelism: int | None = None  # None: every point at once


# --- parsing the CLI's --grid and --seeds -------------------------------------------------------


def value_text(value: Any) -> str:
    """A value as `--set` text that parses back to the same value (JSON is YAML)."""
    return json.dumps(value)


def _short(value: Any) -> str:
    if isinstance(value, str) and re.fullmatch(r"[\w.+-]+", value):
        return value
    return json.dumps(value, separators=(",", ":"))


def parse_grid(texts: list[str]) -> dict[str, list[Any]]:
    """`--grid key.path=v1,v2,...` -> {key.path: [v1, v2, ...]}; values read like `--set` values
    (YAML: 1e-3 is a float, [1,3] a list, so `model.heads=[1],[3]` is two values)."""
    grid: dict[str, list[Any]] = {}
    for text in texts:
        if "=" not in text:
            raise OwaiError(f"--grid {text!r}: expected KEY.PATH=V1,V2,...")
        key, raw = (s.strip() for s in text.split("=", 1))
        if not key or any(not p for p in key.split(".")):
            raise OwaiError(f"--grid {text!r}: empty key in path")
        if not raw:
            raise OwaiError(f"--grid {text!r}: no values")
        try:
            values = load_yaml(f"[{raw}]")
        except yaml.YAMLError:
            if any(not v.strip() for v in raw.split(",")):  # "lr=," or "lr=1,,2": an empty value, not a repeat
                raise OwaiError(f"--grid {text!r}: an empty value between commas") from None
            values = [parse_override(f"{key}={v}")[1] for v in raw.split(",")]
        if not isinstance(values, list) or not values:
            raise OwaiError(f"--grid {text!r}: expected comma-separated values")
        if key in grid:
            raise OwaiError(f"--grid {key} is given twice; list all its values in one --grid")
        grid[key] = values
    return grid


def parse_seeds(text: str) -> list[int]:
    """`--seeds 0,1,2` -> [0, 1, 2]."""
    parts = text.strip().strip(",").split(",")  # a trailing comma is allowed, as in --grid
    if any(not s.strip() for s in parts) and any(s.strip() for s in parts):
        raise OwaiError(f"--seeds {text!r}: an empty value between commas")
    try:
        seeds = [int(s) for s in parts if s.strip()]
    except ValueError:
        raise OwaiError(f"--seeds {text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if not seeds:
        raise OwaiError(f"--seeds {text!r}: no seeds")
    if len(set(seeds)) != len(seeds):
        raise OwaiError(f"--seeds {text!r}: a seed is repeated")
    return seeds


# --- planning -----------------------------------------------------------------------------------


def _is_seed(text: str) -> bool:
    return parse_override(text)[0] == ["seed"]


def _apply_grid_overrides(subs: list[dict[str, list[Any]]], overrides: dict[str, list[Any]]) -> None:
    """`--grid key=...` replaces the key's values in every sub-grid that has it; a key that no
    sub-grid has is added to every one (for a dict grid: replace or add, as dict.update)."""
    for key, values in overrides.items():
        has = [s for s in subs if key in s] or subs
        for sub in has:
            sub[key] = list(values)


def _refuse_sets_the_grid_overrules(sets: list[str], subs: list[dict[str, list[Any]]],
                                    restated: dict[str, list[Any]]) -> None:
    """A base `--set` of a key that every sub-grid of the recipe's grid sweeps, to values other than
    the one set: each point's grid value wins over it, so the value asked for would never run (in a
    union grid, the sub-grids without the key take the `--set`, and a group's fixed value is the
    recipe's: docs/decisions.md). One line that says so, and how to change the grid's values instead.
    A key that `--grid` restates is checked against those values instead."""
    for text in sets:
        for key, leaf in override_leaves(text):
            if key in restated:
                if leaf not in restated[key]:
                    raise OwaiError(f"--set {key}={value_text(leaf)} and --grid {key}="
                                    f"{','.join(value_text(v) for v in restated[key])}: the grid's values win; give one")
                continue
            if subs and all(key in sub for sub in subs) and any(v != leaf for sub in subs for v in sub[key]):
                shown = ", ".join(dict.fromkeys(value_text(v) for sub in subs for v in sub[key]))
                raise OwaiError(f"--set {key}: the recipe's sweep grid sets {key} in every point ({shown}), which wins "
                                f"over --set; give the values as a grid instead: --grid {key}=... (owai sweep, "
                                "bonsai --study, dropout-ft)")


def _check_grid_key(schema: type, key: str, values: list[Any]) -> None:
    """A grid key is a schema path (not the seed) with distinct values that survive `--set` text."""
    if key == "seed":
        raise OwaiError("--grid seed=...: choose seeds with --seeds")
    check_path(schema, key, f"--grid {key}")
    if not values:
        raise OwaiError(f"--grid {key}: no values")
    texts = [value_text(v) for v in values]
    if len(set(texts)) != len(texts):
        raise OwaiError(f"--grid {key}: a value is repeated")
    for v, t in zip(values, texts):
        if parse_override(f"{key}={t}")[1] != v:
            raise OwaiError(f"--grid {key}: value {v!r} cannot be written as a --set value")


def _selection(select: Selection | dict[str, Any] | None, recipe: Recipe) -> Selection | None:
    if select is None:
        return recipe.sweep.select if recipe.sweep else None
    return select if isinstance(select, Selection) else build(Selection, select, path="select")


@dataclasses.dataclass
class _Design:
    """What planning decided: the preset, the grid (as written), seeds, points and selection."""

    preset: str
    grid: Grid  # as written
    seeds: list[int]
    points: list[Point]
    select: Selection | None
    devices: set[str]  # the points' runtime.device settings


def _design(
    recipe: Recipe, preset: str | None, sets: list[str], grid_overrides: list[str] | dict[str, list[Any]],
    seeds: list[int] | None, grid: Grid | None = None, select: Selection | dict[str, Any] | None = None,
    user_sets: list[str] | None = None,
) -> _Design:
    """The sweep's preset, grid, seeds, points and selection, every point validated against the
    method schema. Settings first, what this machine lacks last (CannotRunHere: an input that a point
    reads, or the memory a model needs), so a typo is not hidden behind a download. `user_sets`: the
    `--set`s the user gave (default: all of `sets`), which the recipe's grid must not overrule."""
    from owai.experiment import refuse_unused, resolve

    if not recipe.implemented:
        raise OwaiError(f"recipe {recipe.id!r} needs method {recipe.method!r}, which is not implemented yet")
    if any(_is_seed(s) for s in sets):
        raise OwaiError("a sweep sets the seed itself: choose seeds with --seeds, not --set seed=...")
    cfg, resolved = resolve(recipe, preset, sets, missing_ok=True)  # the base --sets, checked once
    # what this machine lacks, raised once every setting has been checked: the points' own (a sweep
    # never runs its base config, whose dataset the grid may replace in every point)
    missing: str | None = None
    preset_name = resolved["preset"]
    spec = recipe.sweep
    written = coerce(Grid, grid, "grid") if grid is not None else (spec.grid_for(preset_name) if spec else {})
    if written == []:
        raise OwaiError("the sweep grid is an empty list: it has no points")
    subs = sub_grids(written)
    overrides = grid_overrides if isinstance(grid_overrides, dict) else parse_grid(grid_overrides)
    if grid is None:  # a grid a command builds itself (rich-features' baselines) wins over the base, as meant
        _refuse_sets_the_grid_overrules(sets if user_sets is None else user_sets, subs, overrides)
    _apply_grid_overrides(subs, overrides)
    schema = recipe.method_class().Config
    for sub in subs:
        for key, values in sub.items():
            _check_grid_key(schema, key, values)
    seeds = list(seeds) if seeds is not None else (spec.for_preset(preset_name)[1] if spec else [cfg.seed])
    if not seeds or len(set(seeds)) != len(seeds):
        raise OwaiError(f"sweep seeds must be distinct and non-empty, got {seeds}")
    selection = _selection(select, recipe)
    for key in selection.per if selection else []:
        if any(key not in sub for sub in subs):
            raise OwaiError(f"select.per {key!r} is not a key of every sub-grid of the sweep grid")

    points, seen, devices, point_cfgs = [], set(), set(), []
    for sub in subs:
        cells: list[dict[str, Any]] = [{}]
        for key, values in sub.items():
            cells = [{**c, key: v} for c in cells for v in values]
        for cell in cells:
            for seed in seeds:
                own = [f"{k}={value_text(v)}" for k, v in cell.items()] + [f"seed={seed}"]
                label = " ".join([*(f"{k}={_short(v)}" for k, v in cell.items()), f"seed={seed}"])
                same = json.dumps(sorted(own))  # one point, whatever the sub-grid's key order
                if same in seen:
                    raise OwaiError(f"sweep point {label} is in the grid twice (two sub-grids reach it)")
                seen.add(same)
                slug = "_".join([*(f"{k.rsplit('.', 1)[-1]}={_short(v)}" for k, v in cell.items()), f"seed={seed}"])
                slug = re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9.=+-]", "_", slug)).strip("_")[:60]
                digest = hashlib.sha256(json.dumps(own).encode()).hexdigest()[:8]
                point = Point(id=f"{slug}-{digest}", label=label, grid=cell, seed=seed, overrides=[*sets, *own])
                try:
                    point_cfg, point_resolved = resolve(recipe, preset, point.overrides, missing_ok=True)
                except OwaiError as e:
                    raise OwaiError(f"sweep point {label}: {e}") from None
                devices.add(point_cfg.runtime.device)
                point_cfgs.append(point_cfg)
                if missing is None and "missing" in point_resolved:
                    missing = f"sweep point {label}: {point_resolved['missing']}"
                points.append(point)
    refuse_unused(recipe, point_cfgs, sets, sweep=True)  # a base --set that no point reads
    if missing is not None:
        raise CannotRunHere(missing)
    final: Grid = subs[0] if isinstance(written, dict) else subs
    return _Design(preset_name, final, seeds, points, selection, devices)


def plan(
    recipe: Recipe | str, preset: str | None = None, sets: list[str] | None = None,
    grid_overrides: list[str] | dict[str, list[Any]] | None = None, seeds: list[int] | None = None,
    grid: Grid | None = None, select: Selection | dict[str, Any] | None = None, user_sets: list[str] | None = None,
) -> list[Point]:
    """The sweep's points: the grid (`grid`, else the preset's sweep grid, else the recipe's)
    updated by `--grid`, crossed with the seeds (`--seeds`, else the preset's or recipe's sweep
    seeds, else its configured seed). Raises OwaiError, before anything runs, if any point's
    overrides do not fit the method's schema (or `select`'s group keys are not grid keys)."""
    recipe = load(recipe) if isinstance(recipe, str) else recipe
    return _design(recipe, preset, list(sets or []), grid_overrides or [], seeds, grid, select, user_sets).points


def create(
    recipe_name: str, preset: str | None = None, sets: list[str] | None = None,
    grid_overrides: list[str] | dict[str, list[Any]] | None = None, seeds: list[int] | None = None,
    out: Path | None = None, grid: Grid | None = None, select: Selection | dict[str, Any] | None = None,
    executor: str = "local", user_sets: list[str] | None = None,
) -> Sweep:
    """Plan a sweep, then make its directory and write sweep.json (nothing is created on error).
    `grid` and `select` replace the recipe's (preset's) sweep grid and selection. With the local
    executor the points run on this machine, so a runtime.device it lacks is refused here."""
    recipe = load(recipe_name)
    sets = list(sets or [])
    d = _design(recipe, preset, sets, grid_overrides or [], seeds, grid, select, user_sets)
    if executor == "local":
        from owai.runtime import select_device

        for device in sorted(d.devices):
            select_device(device)
    out = Path(out) if out is not None else OUT
    ensure_writable(out)
    parent = out / recipe.id
    spec = {"recipe": recipe.id, "preset": d.preset, "sets": sets, "grid": d.grid, "seeds": d.seeds}
    if d.select is not None:  # sweeps without a selection keep the hash they always had
        spec["select"] = dataclasses.asdict(d.select)
    try:
        path = new_unique_dir(parent, f"sweep-{timestamp()}-{config_hash(spec)}")  # never reused
        (path / POINTS).mkdir()
        sweep = Sweep(path, recipe.id, recipe.source, d.preset, sets, d.grid, d.seeds, d.points,
                      created=dt.datetime.now().isoformat(timespec="seconds"), select=d.select)
        atomic_write_json(path / SWEEP, sweep.to_json())
    except OSError as e:
        raise OwaiError(f"cannot create sweep directory under {parent}: {e.strerror or e}") from None
    return sweep


def open_sweep(path: Path) -> Sweep:
    """Load a sweep directory's plan (for --resume and report)."""
    path = Path(path)
    if not path.is_dir():
        raise OwaiError(f"sweep directory {path} does not exist")
    if not is_sweep_dir(path):
        raise OwaiError(f"{path} is not a sweep directory: {SWEEP} is missing")
    try:
        data = json.loads((path / SWEEP).read_text())
        grid = data["grid"]
        return Sweep(
            path=path, recipe=data["recipe"], recipe_source=data.get("recipe_source", ""), preset=data["preset"],
            sets=list(data["sets"]), grid=dict(grid) if isinstance(grid, dict) else [dict(g) for g in grid],
            seeds=list(data["seeds"]), points=[Point(**p) for p in data["points"]], created=data.get("created", ""),
            select=Selection(**data["select"]) if data.get("select") else None,  # older sweeps: no key
        )
    except (OSError, ValueError, KeyError, TypeError):
        raise OwaiError(f"{path / SWEEP} is corrupt") from None


# --- running ------------------------------------------------------------------------------------


def point_status(sweep: Sweep, point: Point) -> str:
    """complete (results.json exists) | pending (no run yet) | the run's own status (running,
    failed, interrupted, ...; `incomplete` if it says complete but its results.json is gone or
    damaged: `run_point` then moves the damaged file aside and resumes the point)."""
    return read_point(sweep, point)[0]


def read_point(sweep: Sweep, point: Point) -> tuple[str, dict[str, Any] | None, str | None]:
    """The point's status (`point_status`), with its results when complete, or why its results.json
    did not read: one parse of the file for both."""
    path = sweep.point_dir(point)
    if (path / RESULTS).is_file():
        results, problem = _read_results(path)
        return ("complete" if problem is None else "incomplete"), results, problem
    if not (path / CONFIG).is_file():
        return "pending", None, None
    status = Run(path).status()
    return ("incomplete" if status == "complete" else status), None, None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _task(sweep: Sweep, point: Point, threads: int = 0) -> dict[str, Any]:
    """What a worker needs to run one point (plain data: it crosses process boundaries)."""
    source = recorded_name(sweep.recipe, sweep.recipe_source)
    return {"id": point.id, "dir": str(sweep.point_dir(point)), "recipe": source, "preset": sweep.preset,
            "overrides": list(point.overrides), "threads": threads}


def run_point(task: dict[str, Any]) -> dict[str, Any]:
    """Run (or resume) one point quietly; never raises for a failed run, returns its outcome.

    This is the function local workers and submitit jobs execute."""
    from owai.experiment import execute

    saved = (console.state.quiet, console.state.json)
    console.configure(quiet=True)
    started = time.time()
    outcome: dict[str, Any] = {"id": task["id"], "status": "failed", "error": None}
    path = Path(task["dir"])
    # one process runs a point at a time: a --resume while the jobs (or orphaned workers) of an
    # earlier invocation still run leaves their points to them, rather than running them twice
    with build_lock(path, wait=False) as mine:
        try:
            if not mine:
                outcome["status"] = "running"
                raise OwaiError("another process is running this point (an earlier invocation's job or worker); "
                                "resume the sweep when it has finished")
            if task.get("threads"):
                import torch

                torch.set_num_threads(task["threads"])  # runtime.threads, when set, still wins
            if path.exists() and not path.is_dir():
                raise OwaiError(f"{path} is a file where this point's run directory belongs; remove it to rerun this point")
            if (path / RESULTS).is_file() and not _damaged_results(path):
                pass
            elif (path / CONFIG).is_file():
                execute(resume=path)
            else:
                if path.exists():  # made, but killed before its config was written: nothing to keep
                    # (a kill while config.yaml was written leaves only that write's temporary file)
                    if any(p.is_file() and not is_write_temporary(p) for p in path.rglob("*")):
                        raise OwaiError(f"{path} holds files but no {CONFIG}; remove it to rerun this point")
                    shutil.rmtree(path)
                execute(task["recipe"], task["preset"], task["overrides"], run_dir=path)
            outcome["status"] = "complete"
        except Exception as e:  # noqa: BLE001 - a failed point is recorded; the sweep goes on
            outcome["error"] = one_line(e, None)
            release_frames(e)  # the failed run's model and loader workers go now, before the worker's next point
        finally:
            console.configure(*saved)
    outcome["seconds"] = round(time.time() - started, 2)
    return outcome


def _damaged_results(path: Path) -> bool:
    """Whether the point's results.json does not read as an owai results file (a damaged disk: owai
    writes it atomically). It is then moved aside to results.json.damaged, so that the point resumes
    and writes it again, where a sweep's --resume would otherwise find the same file every time."""
    if _read_results(path)[1] is None:
        return False
    os.replace(path / RESULTS, path / f"{RESULTS}.damaged")
    return True


def _read_results(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A point's results.json read as an owai results file: (results, None), or (None, why not)."""
    try:
        return Run(path).results(), None
    except OwaiError as e:
        return None, str(e)


class PointJob:
    """`run_point` as a submitit job that SLURM requeues when its time runs out.

    submitit signals a job (USR2) shortly before its `--timeout-min`; for a callable with a
    `checkpoint` method it then requeues the job (at most three timeouts per point, submitit's
    default) instead of failing it. The killed run is marked interrupted, and the requeued job's
    `run_point` resumes it from its last checkpoint, as `owai sweep --resume` would. (A preempted job
    is requeued by submitit either way.)"""

    def __call__(self, task: dict[str, Any]) -> dict[str, Any]:
        return run_point(task)

    def checkpoint(self, task: dict[str, Any]) -> Any:
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, task)  # the same point again: it resumes from its run directory


def check_executor(executor: str, workers: int = 1) -> None:
    """Fail before a sweep directory is made if the executor cannot run here."""
    if executor not in EXECUTORS:
        raise OwaiError(f"unknown executor {executor!r} (known: {', '.join(EXECUTORS)})")
    if workers < 1:
        raise OwaiError(f"--workers must be >= 1, got {workers}")
    if workers > 1 and executor != "local":
        raise OwaiError("--workers is for --executor local; SLURM jobs run side by side (--array-parallelism)")
    if executor == "slurm":
        missing = [tool for tool in ("sbatch", "srun") if shutil.which(tool) is None]
        if missing:
            raise OwaiError(f"--executor slurm needs SLURM, but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                            "not on PATH (use --executor local)")
    if executor != "local":
        import importlib.util

        if importlib.util.find_spec("submitit") is None:
            raise OwaiError(f"--executor {executor} needs submitit: pip install submitit")


def run(
    sweep: Sweep, executor: str = "local", workers: int = 1, slurm: SlurmOptions | None = None
) -> list[dict[str, Any]]:
    """Run every unfinished point; returns this invocation's outcomes [{id, status, error, seconds}]."""
    check_executor(executor, workers)
    remove_write_temporaries(sweep.path)  # what a killed write of summary.json left (its points: their resumes)
    todo = [p for p in sweep.points if point_status(sweep, p) != "complete"]
    done = len(sweep.points) - len(todo)
    if done:
        console.info(f"{done} of {len(sweep.points)} points already complete; running the other {len(todo)}")
    if not todo:
        return []
    if executor == "local":
        return _run_local(sweep, todo, workers)
    return _run_submitit(sweep, todo, executor, slurm or SlurmOptions())


def _run_local(sweep: Sweep, todo: list[Point], workers: int) -> list[dict[str, Any]]:
    description = f"sweep {sweep.recipe}"
    if workers == 1:
        return [run_point(_task(sweep, p)) for p in console.track(todo, total=len(todo), description=description)]
    threads = max(1, _cpus() // workers)
    with console.Bar(description, total=len(todo)) as bar:
        return pooled([_task(sweep, p, threads) for p in todo], workers, bar.update)


def pooled(tasks: list[dict[str, Any]], workers: int, done: Callable[[], Any],
           run: Callable[..., dict[str, Any]] = run_point) -> list[dict[str, Any]]:
    """`run(task)` for each task, each in a spawned process of its own, at most `workers` at once
    (`done()` after each). A process per point, not a pool of workers: a point whose process dies
    (the out-of-memory killer) fails alone, where Python's pool fails every point in flight or
    waiting; and on Ctrl-C or SIGTERM this process stops every point it started (a pool's workers
    would go on taking points). Each process gets a free slot's GPU (`_worker_devices`)."""
    import multiprocessing
    from multiprocessing.connection import wait

    n = min(workers, len(tasks))
    context = multiprocessing.get_context("spawn")
    devices = _worker_devices(n)
    free, pending = list(range(n)), list(tasks)
    running: dict[int, tuple[Any, dict[str, Any], Any]] = {}  # slot -> (process, task, its outcome's pipe)
    outcomes: list[dict[str, Any]] = []
    try:
        while pending or running:
            while pending and free:
                slot, task = free.pop(0), pending.pop(0)
                receive, send = context.Pipe(duplex=False)
                process = context.Process(target=_point_process, args=(run, task, devices[slot], os.getpid(), send),
                                          daemon=False)
                process.start()
                send.close()
                running[slot] = (process, task, receive)
            ready = wait([c for _, _, c in running.values()] + [p.sentinel for p, _, _ in running.values()])
            for slot, (process, task, receive) in list(running.items()):
                if receive not in ready and process.sentinel not in ready:
                    continue
                try:
                    outcome = receive.recv() if receive.poll() else None
                except (EOFError, OSError):
                    outcome = None
                process.join()
                receive.close()
                if outcome is None:
                    outcome = {"id": task["id"], "status": "failed", "error": _died(process.exitcode)}
                outcomes.append(outcome)
                del running[slot]
                free.append(slot)
                done()
    except BaseException:
        _stop(process for process, _, _ in running.values())
        raise
    return outcomes


def _died(exitcode: int | None) -> str:
    """Why a point's process ended without an outcome: stopped by SIGTERM or SIGHUP (its run marked
    interrupted: exit 128 + the signal), else killed (-N: signal N; SIGKILL is the out-of-memory killer's)."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if exitcode in (128 + sig, -sig):
            return f"its process was stopped by {sig.name} (exit code {exitcode}); --resume runs the point again"
    return f"its process died (exit code {exitcode}: killed, e.g. out of memory)"


def _point_process(run: Callable[..., dict[str, Any]], task: dict[str, Any], device: str | None, parent: int,
                   send: Any) -> None:
    """One point in its own process (`pooled`): its GPU, its end with its parent's (Linux's parent-death
    signal: a sweep killed by SIGKILL leaves no point running that a later --resume also runs), no
    Ctrl-C of its own (the parent stops it), then its outcome back through `send`."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = device
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the point lock still keeps a second runner out
        pass
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)
    try:
        with stop_on_termination():  # `_stop`'s SIGTERM: the point's run stops as interrupted
            outcome = run(task)
    except Terminated as e:
        sys.exit(128 + e.signum)  # the parent, which sent it, says why
    send.send(outcome)
    send.close()


def _stop(processes: Any) -> None:
    """SIGTERM each point process, then SIGKILL those still running after 10 s."""
    processes = list(processes)
    for process in processes:
        process.terminate()
    deadline = time.time() + 10
    for process in processes:
        process.join(max(0.0, deadline - time.time()))
        if process.is_alive():
            process.kill()
            process.join()


def _worker_devices(workers: int) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES of each of `pooled`'s slots: the visible GPUs dealt out in turn (one slot
    per GPU when there are as many), so that `--workers 4` on four GPUs does not put every point on the
    first; None (unchanged) with one GPU or none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        try:
            import torch

            devices = [str(i) for i in range(torch.cuda.device_count())]
        except Exception:  # noqa: BLE001 - no CUDA build, no driver: no GPUs to deal out
            devices = []
    if len(devices) < 2:
        return [None] * workers
    return [devices[i % len(devices)] for i in range(workers)]


def _run_submitit(sweep: Sweep, todo: list[Point], executor: str, opts: SlurmOptions) -> list[dict[str, Any]]:
    import submitit

    cluster = "slurm" if executor == "slurm" else "debug"
    try:
        ex = submitit.AutoExecutor(folder=sweep.path / "slurm", cluster=cluster)
    except RuntimeError as e:  # e.g. no srun: not a SLURM node
        raise OwaiError(f"--executor {executor}: {one_line(e, None)}") from None
    params = {
        "name": f"owai-{sweep.recipe}",
        "timeout_min": opts.timeout_min or SLURM_TIMEOUT_MIN,
        "cpus_per_task": opts.cpus_per_task,
        "gpus_per_node": opts.gpus_per_node,
        "mem_gb": opts.mem_gb,
        "slurm_partition": opts.partition,
    }
    ex.update_parameters(**{k: v for k, v in params.items() if v is not None})
    chunk = max_array_size() if cluster == "slurm" else len(todo)
    ex.update_parameters(slurm_array_parallelism=min(opts.array_parallelism or len(todo), chunk))
    threads = (opts.cpus_per_task or 0) if cluster == "slurm" else 0  # debug runs in this process
    tasks = [_task(sweep, p, threads) for p in todo]
    jobs: list[Any] = []

    with stop_on_termination():  # SIGTERM / SIGHUP (a closed terminal, a killed login job): as Ctrl-C
        try:
            for start in range(0, len(tasks), chunk):  # SLURM refuses an array larger than its MaxArraySize
                jobs += ex.map_array(PointJob(), tasks[start:start + chunk])
        except Exception as e:  # noqa: BLE001 - sbatch refused: a user-facing problem
            _cancel(jobs, cluster)
            raise OwaiError(f"submitting {len(todo)} jobs failed: {one_line(e, None)}") from None
        except BaseException:  # interrupted between two arrays: none of them stays queued
            _cancel(jobs, cluster)
            raise
        return _wait_for(sweep, jobs, todo, cluster)


def _wait_for(sweep: Sweep, jobs: list[Any], todo: list[Point], cluster: str) -> list[dict[str, Any]]:
    """The outcomes of the submitted `jobs` (one per point of `todo`), as they finish; an interruption
    cancels them all."""
    import submitit

    arrays = _array_ids(jobs)
    if cluster == "slurm":
        console.info(f"submitted job array{'s' if len(arrays) > 1 else ''} {', '.join(arrays)} ({len(jobs)} points); waiting")
    point_of = {id(job): p for job, p in zip(jobs, todo)}
    outcomes = []
    try:
        if cluster == "slurm":
            finished = _as_finished(jobs, poll=10, grace=LOST_JOB_GRACE_S, queued=_queued_job_ids)
        else:
            finished = ((job, None) for job in submitit.helpers.as_completed(jobs, poll_frequency=0.1))
        for job, lost in console.track(finished, total=len(jobs), description=f"sweep {sweep.recipe}"):
            if lost is not None:
                outcomes.append({"id": point_of[id(job)].id, "status": "failed", "error": lost})
                continue
            try:
                outcomes.append(job.result())
            except Exception as e:  # noqa: BLE001 - the job died (timeout, preemption, node failure)
                error = f"job {job.job_id}: {one_line(e, None)}"
                outcomes.append({"id": point_of[id(job)].id, "status": "failed", "error": error})
    except KeyboardInterrupt:
        _cancel(jobs, cluster)  # no job should keep writing a point that a later --resume reruns
        raise
    return outcomes


LOST_JOB_GRACE_S = 120.0  # out of the queue this long without a result file: the job is gone


def _as_finished(jobs: list[Any], poll: float, grace: float,
                 queued: Callable[[], set[str] | None]) -> Iterator[tuple[Any, str | None]]:
    """Each submitit job as it finishes, as (job, None); or as (job, why) when it left SLURM's queue
    without writing a result and submitit cannot tell, because its state stays UNKNOWN (no `sacct`,
    or accounting off) or PREEMPTED (a cluster that cancels preempted jobs instead of requeueing
    them). Such a job (killed out of memory, say) would otherwise keep the sweep waiting for ever.
    It counts as gone after `grace` seconds outside `queued()`'s job ids (the result file of a job
    that just ended may take a while to show on a shared file system); `queued()` is None when the
    queue cannot be read, and then only submitit decides."""
    pending = list(jobs)
    missing_since: dict[int, float] = {}
    while pending:
        waiting = []
        for job in pending:
            if job.done():
                yield job, None
            else:
                waiting.append(job)
        undecided = [job for job in waiting if str(job.state).upper() in ("UNKNOWN", "PREEMPTED")]
        in_queue = queued() if undecided else None
        now = time.monotonic()
        for job in waiting:
            if in_queue is None or job not in undecided or str(job.job_id) in in_queue:
                missing_since.pop(id(job), None)
            else:
                missing_since.setdefault(id(job), now)
        pending = []
        for job in waiting:
            if id(job) in missing_since and now - missing_since[id(job)] >= grace and not job.done(force_check=True):
                yield job, (f"job {job.job_id} left the SLURM queue without a result (state {job.state}: killed, out "
                            f"of memory, or preempted and not requeued); its log: {job.paths.stderr}")
            else:
                pending.append(job)
        if pending:
            time.sleep(poll)


def _queued_job_ids() -> set[str] | None:
    """The ids of this user's jobs in SLURM's queue, one per array task (ARRAY_TASK, as submitit
    names them), or None when `squeue` cannot be read."""
    import getpass
    import subprocess

    try:
        done = subprocess.run(["squeue", "-h", "-r", "-o", "%i", "-u", getpass.getuser()], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.SubprocessError, KeyError):  # KeyError: getuser without a passwd entry
        return None
    if done.returncode != 0:
        return None
    return {line.strip() for line in done.stdout.splitlines() if line.strip()}


def max_array_size() -> int:
    """The most tasks one SLURM job array may have: the cluster's MaxArraySize (`scontrol show
    config`), or SLURM's default, 1001, when it does not say."""
    import subprocess

    try:
        text = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 1001
    match = re.search(r"^MaxArraySize\s*=\s*(\d+)", text, re.MULTILINE)
    return max(1, int(match.group(1))) if match else 1001


def _array_ids(jobs: list[Any]) -> list[str]:
    """The SLURM job arrays of `jobs` (submitit's job ids are ARRAY_TASK)."""
    return sorted({str(job.job_id).split("_")[0] for job in jobs})


def _cancel(jobs: list[Any], cluster: str) -> None:
    """Cancel every job: on SLURM one `scancel` per array (all its tasks at once, so a second Ctrl-C
    cannot leave some running); submitit's debug jobs one by one."""
    import subprocess

    if cluster != "slurm":
        for job in jobs:
            job.cancel(check=False)
        return
    arrays = _array_ids(jobs)
    if arrays:
        try:
            subprocess.run(["scancel", *arrays], capture_output=True, check=False, timeout=60)
        except (OSError, subprocess.SubprocessError):
            console.info(f"could not cancel job array(s) {', '.join(arrays)}: scancel them by hand")


# --- summary ------------------------------------------------------------------------------------


def _cell_label(grid: dict[str, Any]) -> str:
    return " ".join(f"{k}={_short(v)}" for k, v in grid.items()) or "all"


def _stored_errors(sweep: Sweep) -> dict[str, str]:
    try:
        data = json.loads((sweep.path / SUMMARY).read_text())
        # a point left to another process (`run_point`) is not failed by that
        return {p["id"]: p["error"] for p in data["points"] if p.get("error") and p.get("status") != "running"}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def summarise(sweep: Sweep, outcomes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Group points by grid cell (seeds pooled); per numeric metric: mean, sample std, n; and,
    when the sweep has a selection, the best cell per group (`select_cells`)."""
    stored = _stored_errors(sweep)  # errors of points that never got a run directory
    errors = {o["id"]: o["error"] for o in outcomes or [] if o.get("error")}
    elsewhere = {o["id"] for o in outcomes or [] if o.get("status") == "running"}  # left to another process
    points, cells = [], {}
    for p in sweep.points:
        path = sweep.point_dir(p)
        status, results, damage = read_point(sweep, p)
        error = None
        if damage is not None:  # `owai sweep --resume` moves it aside and reruns the point
            status, error = "corrupt", f"{damage} (or resume the sweep: the point is run again)"
        elif status not in ("complete", "pending"):
            try:
                error = json.loads((path / "status.json").read_text()).get("error")
            except (OSError, ValueError, AttributeError):
                pass
        if status != "complete":
            error = errors.get(p.id) or error or (stored.get(p.id) if status == "pending" else None)
            if p.id in elsewhere:
                status = "running"
            elif error and status in ("pending", "running", "unknown"):
                status = "failed"
        points.append({"id": p.id, "label": p.label, "grid": p.grid, "seed": p.seed, "status": status,
                       "error": error, "run_dir": str(path)})
        key = json.dumps(sorted(p.grid.items()))  # the point's own cell, from whichever sub-grid
        cell = cells.setdefault(key, {"grid": p.grid, "label": _cell_label(p.grid), "points": 0, "seeds": [],
                                      "values": {}, "rows": {}})
        cell["points"] += 1
        if results is None:
            continue
        cell["seeds"].append(p.seed)
        for row in results.get("rows", []):
            value = numeric(row.get("measured"))
            if value is not None:
                cell["values"].setdefault(row["metric"], []).append(value)
                cell["rows"].setdefault(row["metric"], row)
    groups = []
    for cell in cells.values():
        metrics = []
        for name, values in cell["values"].items():
            row = cell["rows"][name]
            metrics.append({
                "metric": name,
                "mean": statistics.fmean(values),
                "std": statistics.stdev(values) if len(values) > 1 else None,
                "n": len(values),
                "values": values,
                "thesis": row.get("thesis"),
                "thesis_claim": row.get("thesis_claim") or "",
                "ref": row.get("ref") or "",
            })
        groups.append({"grid": cell["grid"], "label": cell["label"], "points": cell["points"],
                       "complete": len(cell["seeds"]), "seeds": cell["seeds"], "metrics": metrics})
    counts: dict[str, int] = {"points": len(points)}
    for p in points:
        counts[p["status"]] = counts.get(p["status"], 0) + 1
    return {
        "sweep_dir": str(sweep.path),
        "recipe": sweep.recipe,
        "preset": sweep.preset,
        "sets": sweep.sets,
        "grid": sweep.grid,
        "seeds": sweep.seeds,
        "std": STD,
        "counts": counts,
        "groups": groups,
        "selection": select_cells(groups, sweep.select) if sweep.select else None,
        "points": points,
    }


def select_cells(groups: list[dict[str, Any]], select: Selection) -> dict[str, Any]:
    """The best cell per group of `select.per` values (groups in order of their first cell).

    A cell is a candidate when some complete point measured a finite value of the metric; its score
    is the mean over those seeds; the best score wins (min or max), ties go to the first cell."""
    chosen: dict[str, dict[str, Any]] = {}
    for cell in groups:
        key = {k: cell["grid"].get(k) for k in select.per}
        group = chosen.setdefault(json.dumps(list(key.values())), {
            "key": key, "label": _cell_label(key), "cell": None, "grid": None, "score": None, "candidates": 0,
            "metrics": []})
        metric = next((m for m in cell["metrics"] if m["metric"] == select.metric), None)
        if metric is None:
            continue
        group["candidates"] += 1
        score, best = metric["mean"], group["score"]
        if best is None or (score < best if select.mode == "min" else score > best):
            group.update(cell=cell["label"], grid=cell["grid"], score=score, metrics=cell["metrics"])
    return {"metric": select.metric, "mode": select.mode, "per": list(select.per), "groups": list(chosen.values())}


def write_summary(sweep: Sweep, outcomes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    summary = summarise(sweep, outcomes)
    atomic_write_json(sweep.path / SUMMARY, summary)
    return summary


def write_study_files(sweep: Sweep, stem: str, title: str, rows: list[dict[str, Any]], markdown: str,
                      figure: Any) -> Path:
    """A study's outputs in the sweep directory, atomically: <stem>.json (the rows and the recipe's
    claims judged on them), <stem>.md and figures/<stem>.png; returns the figure's path."""
    from owai.claims import judge_all, study_records
    from owai.io import atomic_write_figure, atomic_write_text

    claims = judge_all(recipe_claims(sweep.recipe, sweep.recipe_source), study_records(rows), sweep.preset)
    atomic_write_json(sweep.path / f"{stem}.json", {"recipe": sweep.recipe, "preset": sweep.preset, "title": title,
                                                    "sweep_dir": str(sweep.path), "rows": rows, "claims": claims})
    atomic_write_text(sweep.path / f"{stem}.md", markdown)
    path = sweep.path / "figures" / f"{stem}.png"
    path.parent.mkdir(exist_ok=True)
    atomic_write_figure(path, figure)
    return path


def failures(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Points that ran and did not finish (pending and still-running points are not failures)."""
    return [p for p in summary["points"] if p["status"] not in ("complete", "pending", "running")]


def raise_on_failures(summary: dict[str, Any], rerun: str) -> None:
    """Print one stderr line per failed point, then raise one OwaiError that says how to rerun them."""
    failed = failures(summary)
    elsewhere = [p for p in summary["points"] if p["status"] == "running" and p.get("error")]  # run_point left them
    for p in elsewhere:
        console.stderr.print(f"running elsewhere: {p['label']}: {p['error']}", markup=False, soft_wrap=True)
    for p in failed:
        console.stderr.print(f"failed: {p['label']}: {p['error'] or p['status']}", markup=False, soft_wrap=True)
    if failed:
        raise OwaiError(f"{len(failed)} of {len(summary['points'])} sweep points failed; rerun them with {rerun}")
    if elsewhere:
        raise OwaiError(f"{len(elsewhere)} of {len(summary['points'])} sweep points are running in another process; "
                        f"finish them with {rerun} once it is done")


def _mean_std(m: dict[str, Any]) -> str:

    return fmt(m["mean"]) if m["std"] is None else f"{fmt(m['mean'])} ± {fmt(m['std'])}"


def _thesis(m: dict[str, Any]) -> str:
    """A metric's thesis cell, as a run's table shows it: the number and its claim."""
    return thesis_text(m.get("thesis"), m.get("thesis_claim"))


def _title(summary: dict[str, Any]) -> str:
    c = summary["counts"]
    return (f"{summary['recipe']} sweep [{summary['preset']}]: {c.get('complete', 0)}/{c['points']} points complete, "
            f"mean ± sample std over seeds")


def _selection_title(selection: dict[str, Any]) -> str:
    per = ", ".join(selection["per"]) or "the whole grid"
    return f"selected cells: best {selection['metric']} ({selection['mode']}, mean over seeds) per {per}"


def _searched(selection: dict[str, Any], group: dict[str, Any]) -> str:
    """The chosen cell's values of the searched keys (the group's own keys are its label)."""
    if group["grid"] is None:
        return "(no candidates)"
    searched = {k: v for k, v in group["grid"].items() if k not in selection["per"]}
    return _cell_label(searched) if searched else "(single cell)"


def table(summary: dict[str, Any]) -> Any:
    """The summary as a Rich table: one section per grid cell, headed by its grid values; with a
    selection, a second table (the chosen cell per group) is rendered below it."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table


    has_grid = any(sub_grids(summary["grid"]))
    t = Table(title=escape(_title(summary)))
    t.add_column("grid cell / metric" if has_grid else "metric", no_wrap=True)
    t.add_column("mean ± std", justify="right", no_wrap=True)
    t.add_column("n", justify="right")
    t.add_column("thesis")
    t.add_column("ref")
    for i, group in enumerate(summary["groups"]):
        if i:
            t.add_section()
        if has_grid:
            t.add_row(f"[bold]{escape(group['label'])}[/bold]", "", "", "", "")
        if not group["metrics"]:
            t.add_row("  (no complete points)", "-", "0", "-", "")
        for m in group["metrics"]:
            name = f"  {m['metric']}" if has_grid else f"[bold]{escape(m['metric'])}[/bold]"
            t.add_row(name if not has_grid else escape(name), escape(_mean_std(m)), str(m["n"]), escape(_thesis(m)),
                      escape(m["ref"]))
    failed = failures(summary)
    if failed:
        t.caption = escape("failed: " + "; ".join(f"{p['label']}: {p['error'] or p['status']}" for p in failed))
    console.fit_table(t, whole=(0,))  # the grid cells and metric names
    selection = summary.get("selection")
    if not selection:
        return t
    s = Table(title=escape(_selection_title(selection)))
    s.add_column("group / chosen cell / metric", no_wrap=True)
    s.add_column("mean ± std", justify="right", no_wrap=True)
    s.add_column("n", justify="right")
    s.add_column("thesis")
    for i, group in enumerate(selection["groups"]):
        if i:
            s.add_section()
        s.add_row(f"[bold]{escape(group['label'])}[/bold]", "", "", "")
        score = f", {selection['metric']} {fmt(group['score'])} (best of {group['candidates']})" if group["grid"] else ""
        s.add_row(escape(f"  → {_searched(selection, group)}{score}"), "", "", "")
        for m in group["metrics"]:
            s.add_row(escape(f"    {m['metric']}"), escape(_mean_std(m)), str(m["n"]), escape(_thesis(m)))
    return Group(t, console.fit_table(s, whole=(0,)))


def markdown(summary: dict[str, Any]) -> str:

    lines = [f"### {_title(summary)}", "", f"Sweep: `{summary['sweep_dir']}`  ",
             f"Std: {summary['std']}", "", "| grid | metric | mean ± std | n | thesis | ref |", "|---|---|---|---|---|---|"]
    for group in summary["groups"]:
        for m in group["metrics"]:
            lines.append(md_row([group["label"], m["metric"], _mean_std(m), m["n"], _thesis(m), m["ref"]]))
    selection = summary.get("selection")
    if selection:
        lines += ["", f"#### {_selection_title(selection)}", "",
                  "| group | chosen cell | score | candidates | metric | mean ± std | n | thesis |",
                  "|---|---|---|---|---|---|---|---|"]
        for group in selection["groups"]:
            head = [group["label"], _searched(selection, group), fmt(group["score"]), group["candidates"]]
            for i, m in enumerate(group["metrics"] or [None]):
                head = head if i == 0 else ["", "", "", ""]  # the group's values once, on its first row
                lines.append(md_row(head + (["-", "-", 0, "-"] if m is None else
                                            [m["metric"], _mean_std(m), m["n"], _thesis(m)])))
    failed = failures(summary)
    if failed:
        lines += ["", "Failed points:", ""] + [f"- `{p['label']}`: {p['error'] or p['status']}" for p in failed]
    return "\n".join(lines) + "\n"
