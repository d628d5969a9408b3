"""owai sweep: grids x seeds as run directories, resume, executors, the mean ± std summary."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from pathlib import Path

import pytest

from owai import sweep as sweeps
from owai.cli import main
from owai.errors import OwaiError
from owai.runs import Run
from conftest import Undecodable, as_sets
from conftest import cli_in_process as cli

TINY = [
    "train.steps=4", "train.batch_size=2", "train.checkpoint_every=2",
    "train.selection_sequences=2", "data.block_size=60", "eval.n_sequences=2", "eval.n_gen=3",
    "eval.tau_stride=10", "model.heads=[3]",
]


def sets(*extra: str) -> list[str]:
    return as_sets([*TINY, *extra])



def sweep_dirs(out: Path) -> list[Path]:
    return sorted((out / "three-moons").glob("sweep-*"))


@pytest.fixture(scope="module")
def grid_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2 (train.lr) x 2 (seeds) sweep, run in-process (workers=1)."""
    out = tmp_path_factory.mktemp("sweep")
    main_args = ["sweep", "three-moons", *sets(), "--grid", "train.lr=0.01,0.02", "--seeds", "1,2", "--out", str(out), "-q"]
    try:
        main(main_args)
    except SystemExit as e:
        assert not e.code, e
    (path,) = sweep_dirs(out)
    return path


def test_grid_sweep_makes_run_dirs_and_summary(grid_sweep: Path) -> None:
    plan = json.loads((grid_sweep / "sweep.json").read_text())
    assert plan["recipe"] == "three-moons" and plan["grid"] == {"train.lr": [0.01, 0.02]} and plan["seeds"] == [1, 2]
    assert len(plan["points"]) == 4
    for p in plan["points"]:
        run = Run.open(grid_sweep / "points" / p["id"])  # a normal run directory
        assert run.status() == "complete" and run.results() is not None
        params = run.read_config()["params"]
        assert params["seed"] == p["seed"] and params["train"]["lr"] == p["grid"]["train.lr"]
        assert params["train"]["steps"] == 4 and p["overrides"][: len(TINY)] == TINY

    summary = json.loads((grid_sweep / "summary.json").read_text())
    assert summary["counts"] == {"points": 4, "complete": 4}
    assert [g["grid"] for g in summary["groups"]] == [{"train.lr": 0.01}, {"train.lr": 0.02}]
    for group in summary["groups"]:
        # expected from the points' own results.json
        values: dict[str, list[float]] = {}
        for p in plan["points"]:
            if p["grid"] == group["grid"]:
                for row in Run(grid_sweep / "points" / p["id"]).results()["rows"]:
                    if isinstance(row["measured"], (int, float)):
                        values.setdefault(row["metric"], []).append(float(row["measured"]))
        assert group["complete"] == 2 and sorted(group["seeds"]) == [1, 2]
        got = {m["metric"]: m for m in group["metrics"]}
        assert set(got) == set(values) and "heads3.disentanglement" in got
        assert "heads3.train.transitions" not in got  # lists are not summarised
        for name, vals in values.items():
            assert got[name]["n"] == 2
            assert got[name]["mean"] == pytest.approx(statistics.fmean(vals))
            assert got[name]["std"] == pytest.approx(abs(vals[0] - vals[1]) / math.sqrt(2))  # sample std, n=2
        assert got["heads3.disentanglement"]["thesis"] == 1.0


def test_summary_statistics_by_hand(tmp_path: Path) -> None:
    """mean ± sample std per grid cell, booleans as fractions, n and thesis carried."""
    plan = sweeps.create("three-moons", None, TINY, ["train.lr=0.01,0.02"], [1, 2, 3], tmp_path)
    measured = {0.01: [1.0, 3.0, 5.0], 0.02: [2.0, 2.0, 2.0]}
    for p in plan.points:
        run = Run.create_at(plan.point_dir(p), {"recipe": "three-moons", "params": {}})
        value = measured[p.grid["train.lr"]][p.seed - 1]
        run.write_results({"rows": [
            {"metric": "m", "measured": value, "thesis": 2.5, "thesis_claim": "", "ref": "Fig X"},
            {"metric": "ok", "measured": value > 2, "thesis": None, "thesis_claim": "", "ref": ""},
            {"metric": "curve", "measured": [1, 2], "thesis": None, "thesis_claim": "", "ref": ""},
        ]})
    summary = sweeps.summarise(plan)
    first, second = ({m["metric"]: m for m in g["metrics"]} for g in summary["groups"])
    assert (first["m"]["mean"], first["m"]["std"], first["m"]["n"]) == (3.0, 2.0, 3)  # sqrt((4+0+4)/2)
    assert first["m"]["thesis"] == 2.5 and first["m"]["ref"] == "Fig X"
    assert first["ok"]["mean"] == pytest.approx(2 / 3)
    assert (second["m"]["mean"], second["m"]["std"]) == (2.0, 0.0)
    assert "curve" not in first
    assert "± 2" in sweeps.markdown(summary)


def test_resume_runs_only_unfinished_points(grid_sweep: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    path = tmp_path / "copy"
    shutil.copytree(grid_sweep, path)
    ids = [p["id"] for p in json.loads((path / "sweep.json").read_text())["points"]]
    gone, partial, kept = ids[0], ids[1], ids[2:]
    shutil.rmtree(path / "points" / gone)  # never started
    (path / "points" / partial / "results.json").unlink()  # killed after training: resume it
    before = {i: (path / "points" / i / "results.json").stat().st_mtime_ns for i in kept}

    calls: list[str] = []
    real = sweeps.run_point
    monkeypatch.setattr(sweeps, "run_point", lambda task: calls.append(task["id"]) or real(task))
    code, out, err = cli(["sweep", "--resume", str(path), "--json"], capsys)
    assert code == 0, err
    assert sorted(calls) == sorted([gone, partial])
    assert {i: (path / "points" / i / "results.json").stat().st_mtime_ns for i in kept} == before
    assert json.loads(out)["counts"] == {"points": 4, "complete": 4}
    env = json.loads((path / "points" / partial / "env.json").read_text())
    assert len(env["resumed"]) == 1  # continued, not restarted

    calls.clear()  # nothing left to do
    assert cli(["sweep", "--resume", str(path), "-q"], capsys)[0] == 0 and calls == []
    code, _, err = cli(["sweep", "three-moons", "--resume", str(path)], capsys)
    assert code == 2 and "--resume" in err


def test_a_point_whose_folder_is_a_file_fails_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "p0").write_text("not a run")
    outcome = sweeps.run_point({"id": "p0", "dir": str(tmp_path / "p0")})
    assert outcome["status"] == "failed"
    assert outcome["error"] == f"{tmp_path / 'p0'} is a file where this point's run directory belongs; remove it to rerun this point"
    assert (tmp_path / "p0").read_text() == "not a run"


def test_a_point_failed_in_a_loader_worker_leaves_no_worker_to_the_next_point(tmp_path: Path, monkeypatch) -> None:
    """A worker runs its points one after another in one process. An error re-raised from a loader
    worker is in a reference cycle with the frames it came through, so the failed run's model and
    loader workers stayed until a garbage collection (where torch's shutdown waited 5 s per worker);
    the point's error path releases them."""
    import gc
    import multiprocessing

    import torch

    def execute(*_args, **_kwargs):  # the point's run, reading its data through a worker that fails
        model = torch.nn.Linear(4, 4)  # noqa: F841 - what the failed run's frame holds
        next(iter(torch.utils.data.DataLoader(torch.utils.data.Subset(Undecodable(), [1, 1]), num_workers=2,
                                              collate_fn=lambda batch: batch)))

    monkeypatch.setattr("owai.experiment.execute", execute)
    before = set(multiprocessing.active_children())
    gc.disable()  # released by the point's error path, not by a collection
    try:
        outcome = sweeps.run_point({"id": "p0", "dir": str(tmp_path / "p0"), "recipe": "three-moons", "preset": "cpu",
                                    "overrides": []})
        left = set(multiprocessing.active_children()) - before
    finally:
        gc.enable()
    assert outcome["status"] == "failed" and outcome["error"].startswith("cannot decode image"), outcome
    assert not left, f"the failed point's loader workers outlived it: {left}"


def test_report_renders_a_sweep(grid_sweep: Path, capsys) -> None:
    code, out, _ = cli(["report", str(grid_sweep)], capsys)
    assert code == 0 and "train.lr=0.01" in out and "±" in out and "heads3.disentanglement" in out
    code, out, _ = cli(["report", str(grid_sweep), "--markdown"], capsys)
    assert code == 0 and out.startswith("### three-moons sweep [cpu]") and "| train.lr=0.02 | heads3" in out
    code, out, _ = cli(["report", str(grid_sweep), "--json"], capsys)
    assert code == 0 and len(json.loads(out)["groups"]) == 2


def test_bad_grid_fails_before_anything_is_created(tmp_path: Path, capsys) -> None:
    out = tmp_path / "runs"
    code, _, err = cli(["sweep", "three-moons", *sets(), "--grid", "train.nope=1,2", "--out", str(out)], capsys)
    assert code == 2 and "train.nope" in err and "unknown key 'nope'" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli(["sweep", "three-moons", *sets(), "--grid", "train.lr=fast,slow", "--out", str(out)], capsys)
    assert code == 2 and "expected float" in err
    assert not out.exists()
    with pytest.raises(OwaiError, match="--seeds"):
        sweeps.plan("three-moons", None, [*TINY, "seed=3"])
    with pytest.raises(OwaiError, match="given twice"):
        sweeps.parse_grid(["train.lr=1,2", "train.lr=3"])


def test_a_note_on_the_config_is_said_once_per_command_not_once_per_point(capsys) -> None:
    """fig3.8-depth's cpu preset reads the learned-position GPT's attention at 3 x block_size, which its
    config check notes it skips; a sweep checks the base config and then every point's."""
    from owai import console

    for _ in range(2):  # and again in the next command
        console.configure()
        points = sweeps.plan("fig3.8-depth", "cpu", grid_overrides=["model.n_layer=1,2"], seeds=[1])
        err = capsys.readouterr().err
        assert len(points) == 2 and err.count("cannot run beyond block_size") == 1, err


def test_plan_parses_grid_and_seeds() -> None:
    assert sweeps.parse_grid(["model.heads=[1],[3]", "train.lr=1e-3,1e-2"]) == {
        "model.heads": [[1], [3]], "train.lr": [0.001, 0.01]}
    assert sweeps.parse_seeds("0, 1,2") == [0, 1, 2]
    with pytest.raises(OwaiError):
        sweeps.parse_seeds("1,x")
    points = sweeps.plan("three-moons", None, TINY, ["model.heads=[1],[3]"], None)
    assert len(points) == 2 * 5  # the recipe's sweep seeds
    assert points[0].overrides[-2:] == ["model.heads=[1]", "seed=100"]
    assert len({p.id for p in points}) == 10
    assert [p.id for p in points] == [p.id for p in sweeps.plan("three-moons", None, TINY, ["model.heads=[1],[3]"])]


def test_impossible_grid_value_fails_before_anything_runs(tmp_path: Path, capsys) -> None:
    # eval.n_gen=100 does not fit data.block_size=60: rejected while planning, nothing created
    code, _, err = cli(["sweep", "three-moons", *sets(), "--grid", "eval.n_gen=3,100", "--seeds", "1",
                        "--out", str(tmp_path), "-q"], capsys)
    assert code == 2 and "too short for eval.n_gen=100" in err
    assert not any(tmp_path.iterdir())


def test_failed_point_is_recorded_and_sweep_goes_on(tmp_path: Path, capsys, monkeypatch) -> None:
    from owai.methods.three_moons import ThreeMoons

    original = ThreeMoons.run

    def flaky(self, cfg, run):  # a point that fails at run time (workers=1 runs in this process)
        if cfg.eval.n_gen == 4:
            raise RuntimeError("simulated crash")
        return original(self, cfg, run)

    monkeypatch.setattr(ThreeMoons, "run", flaky)
    code, _, err = cli(["sweep", "three-moons", *sets(), "--grid", "eval.n_gen=3,4", "--seeds", "1",
                        "--out", str(tmp_path), "-q"], capsys)
    assert code == 2 and "1 of 2 sweep points failed" in err
    summary = json.loads((sweep_dirs(tmp_path)[0] / "summary.json").read_text())
    assert summary["counts"] == {"points": 2, "complete": 1, "failed": 1}
    failed = [p for p in summary["points"] if p["status"] == "failed"]
    assert "simulated crash" in failed[0]["error"]


def test_local_workers(tmp_path: Path, capsys) -> None:
    code, out, err = cli(["sweep", "three-moons", *sets(), "--seeds", "1,2", "--workers", "2",
                          "--out", str(tmp_path), "--json"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["counts"] == {"points": 2, "complete": 2}
    expected = max(1, sweeps._cpus() // 2)
    for p in summary["points"]:
        assert json.loads((Path(p["run_dir"]) / "env.json").read_text())["torch_threads"] == expected


def test_submitit_debug_executor(tmp_path: Path, capsys) -> None:
    code, out, err = cli(["sweep", "three-moons", *sets(), "--seeds", "1,2", "--executor", "submitit-debug",
                          "--out", str(tmp_path), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["counts"] == {"points": 2, "complete": 2}
    (path,) = sweep_dirs(tmp_path)
    assert any((path / "slurm").iterdir())  # submitit's job logs
    code, _, err = cli(["sweep", "three-moons", "--partition", "gpu", "--out", str(tmp_path)], capsys)
    assert code == 2 and "--executor slurm" in err


def test_create_at_is_exclusive(tmp_path: Path) -> None:
    Run.create_at(tmp_path / "a" / "b", {"recipe": "x", "params": {}})
    assert (tmp_path / "a" / "b" / "config.yaml").is_file()
    with pytest.raises(OwaiError, match="already exists"):
        Run.create_at(tmp_path / "a" / "b", {"recipe": "x", "params": {}})


def test_slurm_executor_wiring(tmp_path: Path, capsys, monkeypatch) -> None:
    """--executor slurm: submitit parameters from the CLI, one array job per unfinished point; a job
    that dies (e.g. a timeout) is a failed point. (A fake AutoExecutor: there is no SLURM here.)"""
    import submitit

    made: list = []

    class FakeJob:
        def __init__(self, fn, task, i: int) -> None:
            self.job_id, self.task, self.fn = f"4242_{i}", task, fn

        def done(self) -> bool:
            return True

        def result(self):
            if self.task["id"].startswith("seed=2"):
                raise submitit.core.utils.UncompletedJobError(f"Job {self.job_id} timed out")
            return self.fn(self.task)

        def cancel(self, check: bool = True) -> None:
            pass

    class FakeExecutor:
        def __init__(self, folder, cluster=None) -> None:
            self.folder, self.cluster, self.params, self.tasks = Path(folder), cluster, {}, []
            made.append(self)

        def update_parameters(self, **params) -> None:
            self.params.update(params)

        def map_array(self, fn, tasks):
            tasks = list(tasks)
            self.arrays.append(len(tasks))
            self.tasks += tasks
            jobs = [FakeJob(fn, t, i) for i, t in enumerate(tasks)]
            for job in jobs:
                job.job_id = f"{4241 + len(self.arrays)}_{job.job_id.split('_')[1]}"  # one array id per array
            return jobs

    FakeExecutor.arrays = []
    monkeypatch.setattr(submitit, "AutoExecutor", FakeExecutor)
    monkeypatch.setattr(sweeps.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(sweeps, "max_array_size", lambda: 1)  # one task per array: two arrays
    code, out, err = cli(["sweep", "three-moons", *sets(), "--seeds", "1,2", "--executor", "slurm", "--partition", "gpu",
                          "--gpus-per-node", "1", "--cpus-per-task", "1", "--timeout-min", "30", "--mem-gb", "2",
                          "--out", str(tmp_path), "--json"], capsys)
    assert code == 2 and "1 of 2 sweep points failed" in err and "timed out" in err
    (ex,) = made
    (path,) = sweep_dirs(tmp_path)
    assert ex.cluster == "slurm" and ex.folder == path / "slurm"
    assert ex.params == {"name": "owai-three-moons", "timeout_min": 30, "cpus_per_task": 1, "gpus_per_node": 1,
                         "mem_gb": 2.0, "slurm_partition": "gpu", "slurm_array_parallelism": 1}
    assert FakeExecutor.arrays == [1, 1]  # no array larger than the cluster's MaxArraySize
    assert "submitted job arrays 4242, 4243 (2 points)" in err
    assert [t["threads"] for t in ex.tasks] == [1, 1]
    assert json.loads(out)["counts"] == {"points": 2, "complete": 1, "failed": 1}


# --- union grids, per-preset grids and seeds, selection -------------------------------------------


def moons_recipe(tmp_path: Path, sweep: dict) -> str:
    """three-moons with its own `sweep:` section, as a recipe file (its id is its file stem)."""
    import yaml

    from owai import recipes

    data = yaml.safe_load((recipes.recipe_dir() / "three-moons.yaml").read_text())
    data["sweep"] = sweep
    path = tmp_path / "three-moons.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


UNION = [{"train.lr": [0.01, 0.02], "eval.n_gen": [3]}, {"model.beta": [40.0]}]


def test_union_grid_is_the_union_of_its_products(tmp_path: Path) -> None:
    recipe = moons_recipe(tmp_path, {"grid": UNION, "seeds": [1]})
    points = sweeps.plan(recipe, None, TINY)
    assert [p.grid for p in points] == [{"train.lr": 0.01, "eval.n_gen": 3}, {"train.lr": 0.02, "eval.n_gen": 3},
                                        {"model.beta": 40.0}]
    assert [p.label for p in points] == ["train.lr=0.01 eval.n_gen=3 seed=1", "train.lr=0.02 eval.n_gen=3 seed=1",
                                         "model.beta=40.0 seed=1"]
    assert points[2].overrides == [*TINY, "model.beta=40.0", "seed=1"] and len({p.id for p in points}) == 3

    plan = sweeps.create(recipe, None, TINY, out=tmp_path / "runs")
    assert json.loads((plan.path / "sweep.json").read_text())["grid"] == UNION  # stored as written
    again = sweeps.open_sweep(plan.path)
    assert again.grid == UNION and again.select is None and [p.grid for p in again.points] == [p.grid for p in points]
    assert sweeps.sub_grids({"a": [1]}) == [{"a": [1]}] and sweeps.sub_grids(UNION) == UNION


def test_union_grid_point_reached_twice_is_an_error(tmp_path: Path) -> None:
    recipe = moons_recipe(tmp_path, {"grid": [{"train.lr": [0.01, 0.02]}, {"train.lr": [0.02]}], "seeds": [1]})
    with pytest.raises(OwaiError, match=r"sweep point train.lr=0.02 seed=1 is in the grid twice"):
        sweeps.plan(recipe, None, TINY)
    reordered = [{"train.lr": [0.01], "eval.n_gen": [3]}, {"eval.n_gen": [3], "train.lr": [0.01]}]
    with pytest.raises(OwaiError, match="twice"):
        sweeps.plan("three-moons", None, TINY, grid=reordered, seeds=[1])
    # a point a sub-grid makes but the method rejects: the usual one-line point error
    with pytest.raises(OwaiError, match=r"^sweep point eval.n_gen=100 seed=1: .*too short"):
        sweeps.plan("three-moons", None, TINY, grid=[{"train.lr": [0.01]}, {"eval.n_gen": [100]}], seeds=[1])


def test_grid_overrides_on_a_union_replace_or_add(tmp_path: Path) -> None:
    recipe = moons_recipe(tmp_path, {"grid": UNION, "seeds": [1]})
    replaced = sweeps.plan(recipe, None, TINY, ["train.lr=0.05"])  # only the sub-grid that has the key
    assert [p.grid for p in replaced] == [{"train.lr": 0.05, "eval.n_gen": 3}, {"model.beta": 40.0}]
    added = sweeps.plan(recipe, None, TINY, ["train.clip=0.5,0.25"])  # no sub-grid has it: added to every one
    assert [p.grid for p in added] == [
        {"train.lr": 0.01, "eval.n_gen": 3, "train.clip": 0.5}, {"train.lr": 0.01, "eval.n_gen": 3, "train.clip": 0.25},
        {"train.lr": 0.02, "eval.n_gen": 3, "train.clip": 0.5}, {"train.lr": 0.02, "eval.n_gen": 3, "train.clip": 0.25},
        {"model.beta": 40.0, "train.clip": 0.5}, {"model.beta": 40.0, "train.clip": 0.25}]
    # `grid=` replaces the recipe's grid before --grid applies; the stored grid keeps its form
    plan = sweeps.create(recipe, None, TINY, ["model.beta=30.0"], out=tmp_path / "runs", grid={"model.beta": [40.0]})
    assert plan.grid == {"model.beta": [30.0]} and [p.grid for p in plan.points] == [{"model.beta": 30.0}]
    for bad, message in [(["train.lr=1,1"], "a value is repeated"), (["seed=1,2"], "choose seeds with --seeds"),
                         (["train.nope=1"], "unknown key 'nope' in train")]:
        with pytest.raises(OwaiError, match=message):
            sweeps.plan(recipe, None, TINY, bad)
    with pytest.raises(OwaiError, match=r"^grid\[0\].train.lr: expected list\[Any\], got float 0.01$"):
        sweeps.plan(recipe, None, TINY, grid=[{"train.lr": 0.01}])


def test_preset_grid_and_seeds(tmp_path: Path) -> None:
    recipe = moons_recipe(tmp_path, {
        "grid": {"train.lr": [0.01, 0.02]}, "seeds": [1, 2],
        "presets": {"cpu": {"grid": [{"model.beta": [40.0]}, {"eval.n_gen": [3]}], "seeds": [7]}}})
    cpu = sweeps.plan(recipe, "cpu", TINY)
    assert [(p.grid, p.seed) for p in cpu] == [({"model.beta": 40.0}, 7), ({"eval.n_gen": 3}, 7)]
    paper = sweeps.plan(recipe, "paper", TINY)
    assert [(p.grid, p.seed) for p in paper] == [({"train.lr": lr}, s) for lr in (0.01, 0.02) for s in (1, 2)]
    assert [p.seed for p in sweeps.plan(recipe, "cpu", TINY, seeds=[3])] == [3, 3]  # --seeds still wins
    assert sweeps.plan(recipe, None, TINY)[0].grid == {"model.beta": 40.0}  # default preset: cpu

    from owai.recipes import load

    spec = load(recipe).sweep
    assert spec.for_preset("cpu") == ([{"model.beta": [40.0]}, {"eval.n_gen": [3]}], [7])
    assert spec.for_preset("paper") == ([{"train.lr": [0.01, 0.02]}], [1, 2])
    seeds_only = moons_recipe(tmp_path, {"grid": {"train.lr": [0.01]}, "seeds": [1], "presets": {"paper": {"seeds": [5]}}})
    assert load(seeds_only).sweep.for_preset("paper") == ([{"train.lr": [0.01]}], [5])


SELECT_GRID = {"model.beta": [40.0, 50.0, 60.0], "train.lr": [0.01, 0.02, 0.03]}
VAL_LOSS = {  # (beta, lr) -> val_loss per seed 1, 2; absent: the metric is not measured; "todo": no results yet
    (40.0, 0.01): [3.0, 1.0], (40.0, 0.02): [1.0, 3.0], (40.0, 0.03): [5.0, 7.0],  # min: a tie, the first wins
    (50.0, 0.02): [4.0, float("nan")], (50.0, 0.03): [1.0, "todo"],  # non-finite / incomplete seeds are left out
}


def faked_selection_sweep(tmp_path: Path, select: dict | None) -> sweeps.Sweep:
    recipe = moons_recipe(tmp_path, {"grid": SELECT_GRID, "seeds": [1, 2],
                                     **({"select": select} if select else {})})
    plan = sweeps.create(recipe, None, TINY, out=tmp_path / "runs")
    for p in plan.points:
        value = VAL_LOSS.get((p.grid["model.beta"], p.grid["train.lr"]), [None, None])[p.seed - 1]
        if value == "todo":
            continue
        rows = [{"metric": "acc", "measured": p.grid["train.lr"], "thesis": 0.9, "thesis_claim": "", "ref": "Fig X"}]
        if value is not None:
            rows.append({"metric": "val_loss", "measured": value, "thesis": None, "thesis_claim": "", "ref": ""})
        Run.create_at(plan.point_dir(p), {"recipe": "three-moons", "params": {}}).write_results({"rows": rows})
    return plan


def test_selection_picks_the_best_cell_per_group(tmp_path: Path) -> None:
    import dataclasses

    plan = faked_selection_sweep(tmp_path, {"metric": "val_loss", "per": ["model.beta"]})
    assert json.loads((plan.path / "sweep.json").read_text())["select"] == {
        "metric": "val_loss", "mode": "min", "per": ["model.beta"]}
    selection = sweeps.summarise(sweeps.open_sweep(plan.path))["selection"]
    assert (selection["metric"], selection["mode"], selection["per"]) == ("val_loss", "min", ["model.beta"])
    g40, g50, g60 = selection["groups"]
    assert g40["key"] == {"model.beta": 40.0} and g40["label"] == "model.beta=40.0"
    assert (g40["cell"], g40["grid"], g40["score"], g40["candidates"]) == (
        "model.beta=40.0 train.lr=0.01", {"model.beta": 40.0, "train.lr": 0.01}, 2.0, 3)
    metrics = {m["metric"]: m for m in g40["metrics"]}
    assert metrics["val_loss"]["values"] == [3.0, 1.0] and metrics["acc"]["mean"] == 0.01
    assert metrics["acc"]["thesis"] == 0.9 and metrics["val_loss"]["std"] == pytest.approx(math.sqrt(2))
    assert (g50["cell"], g50["score"], g50["candidates"]) == ("model.beta=50.0 train.lr=0.03", 1.0, 2)
    assert (g60["cell"], g60["grid"], g60["score"], g60["candidates"], g60["metrics"]) == (None, None, None, 0, [])

    best = sweeps.summarise(dataclasses.replace(plan, select=sweeps.Selection("val_loss", "max", ["model.beta"])))
    g40, g50, g60 = best["selection"]["groups"]
    assert (g40["cell"], g40["score"]) == ("model.beta=40.0 train.lr=0.03", 6.0)
    assert (g50["cell"], g50["score"]) == ("model.beta=50.0 train.lr=0.02", 4.0)  # nan seed left out
    overall = sweeps.summarise(dataclasses.replace(plan, select=sweeps.Selection("val_loss", "min", [])))
    (whole,) = overall["selection"]["groups"]
    assert (whole["key"], whole["label"], whole["cell"], whole["candidates"]) == (
        {}, "all", "model.beta=50.0 train.lr=0.03", 5)  # one group: the whole grid

    summary = sweeps.summarise(plan)
    text = sweeps.markdown(summary)
    assert "#### selected cells: best val_loss (min, mean over seeds) per model.beta" in text
    assert "| model.beta=40.0 | train.lr=0.01 | 2 | 3 | acc | 0.01 ± 0 | 2 | 0.9 |\n| | | | | val_loss | 2 ± 1.414 | 2 | - |" in text
    assert "| model.beta=60.0 | (no candidates) | - | 0 | - | - | 0 | - |" in text
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(sweeps.table(summary))
    shown = console.export_text()
    assert "→ train.lr=0.01, val_loss 2 (best of 3)" in shown and "→ (no candidates)" in shown


def test_selection_from_create_and_old_sweep_files(tmp_path: Path) -> None:
    plan = faked_selection_sweep(tmp_path, None)
    assert sweeps.summarise(plan)["selection"] is None and "selected" not in sweeps.markdown(sweeps.summarise(plan))
    data = json.loads((plan.path / "sweep.json").read_text())
    del data["select"]  # a sweep.json written before selections existed
    (plan.path / "sweep.json").write_text(json.dumps(data))
    assert sweeps.open_sweep(plan.path).select is None
    chosen = sweeps.create(moons_recipe(tmp_path, {"grid": SELECT_GRID, "seeds": [1]}), None, TINY, out=tmp_path / "b",
                           select={"metric": "val_loss", "mode": "max", "per": ["train.lr"]})
    assert sweeps.open_sweep(chosen.path).select == sweeps.Selection("val_loss", "max", ["train.lr"])
    with pytest.raises(OwaiError, match="select.per 'train.clip' is not a key of every sub-grid"):
        sweeps.plan("three-moons", None, TINY, grid=SELECT_GRID, select={"metric": "m", "per": ["train.clip"]})
    with pytest.raises(OwaiError, match="select.mode: expected one of 'min' | 'max'"):
        sweeps.plan("three-moons", None, TINY, grid=SELECT_GRID, select={"metric": "m", "mode": "best"})


def test_union_sweep_with_selection_on_the_cli(tmp_path: Path, capsys) -> None:
    recipe = moons_recipe(tmp_path, {"grid": [{"train.lr": [0.01, 0.02]}, {"model.beta": [40.0]}], "seeds": [1],
                                     "select": {"metric": "heads3.disentanglement", "mode": "max"}})
    code, out, err = cli(["sweep", recipe, *sets(), "--out", str(tmp_path / "runs")], capsys)
    assert code == 0, err
    assert "train.lr=0.02" in out and "model.beta=40.0" in out and "selected cells: best heads3.disentanglement" in out
    summary = json.loads(next((tmp_path / "runs" / "three-moons").glob("sweep-*/summary.json")).read_text())
    assert [g["grid"] for g in summary["groups"]] == [{"train.lr": 0.01}, {"train.lr": 0.02}, {"model.beta": 40.0}]
    (group,) = summary["selection"]["groups"]
    scores = [next(m["mean"] for m in g["metrics"] if m["metric"] == "heads3.disentanglement") for g in summary["groups"]]
    assert group["candidates"] == 3 and group["score"] == max(scores)
    assert group["grid"] == summary["groups"][scores.index(max(scores))]["grid"]


@pytest.mark.parametrize("args, named", [
    (["--dropout", "1.5"], "model.dropout=1.5"),  # a range, checked where the config is built
    (["--test-domain", "99"], "data.test_domain 99: rotated-mnist has 4 domains"),  # the method's validate
])
def test_a_bad_grid_value_is_named_before_the_missing_data(no_data, tmp_path, capsys, args, named):
    """On a machine without the data a study reads, a bad value in its grid is the error, not the
    download: settings first, inputs last (owai.sweep._design). Without the bad value, the
    missing data is the error, as before."""
    out = tmp_path / "runs"
    code, _, err = cli(["dropout-ft", *args, "--out", str(out)], capsys)
    assert code == 2 and named in err and "not found" not in err, err
    code, _, err = cli(["dropout-ft", "--out", str(out)], capsys)
    assert code == 2 and "MNIST" in err and "not found" in err and "owai data fetch mnist" in err, err
    assert not out.exists()


# --- executors: a point run once, a worker that dies, GPUs, SLURM's array size --------------------


def test_a_point_another_process_is_running_is_left_to_it(tmp_path: Path, capsys) -> None:
    """A --resume while an earlier invocation's job or worker still runs a point (its lock held) does
    not run that point beside it: the point is reported running, the others complete."""
    import fcntl
    import os

    code, _, err = cli(["sweep", "three-moons", *sets(), "--seeds", "1,2", "--out", str(tmp_path), "-q"], capsys)
    assert code == 0, err
    (path,) = sweep_dirs(tmp_path)
    busy = next(p for p in (path / "points").iterdir() if p.name.startswith("seed=2"))
    shutil.rmtree(busy)  # as if killed before its config was written
    lock = os.open(busy.parent / f".{busy.name}.lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)  # another process runs it now
    try:
        code, _, err = cli(["sweep", "--resume", str(path), "-q"], capsys)
    finally:
        os.close(lock)
    assert code == 2 and "another process is running this point" in err
    assert not busy.exists()  # not started beside the other process
    summary = json.loads((path / "summary.json").read_text())
    assert summary["counts"] == {"points": 2, "complete": 1, "running": 1}
    code, _, err = cli(["sweep", "--resume", str(path), "-q"], capsys)  # once it has let go
    assert code == 0, err
    assert (busy / "results.json").is_file()
    assert not list((path / "points").glob(".*.lock"))


def _dies_on_seed_2(task: dict) -> dict:
    """A point function for `pooled`: the seed-2 point kills its own process (as the out-of-memory
    killer would); the others complete."""
    import os
    import signal

    if task["id"].endswith("seed=2"):
        os.kill(os.getpid(), signal.SIGKILL)
    return {"id": task["id"], "status": "complete", "error": None, "pid": os.getpid()}


def test_a_worker_that_dies_fails_only_its_own_point() -> None:
    """Python's pool fails every point in flight when one worker dies; owai runs those again, and
    then one pool each, so only the point that kills its worker is failed."""
    tasks = [{"id": f"lr={lr} seed={s}"} for lr in (1, 2) for s in (1, 2, 3)]
    done: list[int] = []
    outcomes = sweeps.pooled(tasks, 2, lambda: done.append(1), run=_dies_on_seed_2)
    status = {o["id"]: o["status"] for o in outcomes}
    assert status == {t["id"]: "failed" if t["id"].endswith("seed=2") else "complete" for t in tasks}
    assert len(outcomes) == len(tasks) == len(done)
    assert all("process died" in o["error"] for o in outcomes if o["status"] == "failed")


def _waits_for_sigterm(task: dict) -> dict:
    """A point function for `pooled`: says its pid, then runs until a signal stops it, and notes
    whether it stopped as an interrupted run does (the `except KeyboardInterrupt` of experiment.py)."""
    import os
    import time

    folder = Path(task["dir"])
    (folder / "pid").write_text(str(os.getpid()))
    try:
        time.sleep(60)
    except KeyboardInterrupt as e:
        (folder / "interrupted").write_text(type(e).__name__)
        raise
    return {"id": task["id"], "status": "complete", "error": None}


def test_a_point_stopped_by_sigterm_ends_as_an_interrupted_run(tmp_path: Path) -> None:
    """`_stop` (a sweep's Ctrl-C or SIGTERM) sends each point process SIGTERM: it killed the point at
    once, its status.json left `running`; the point's run now stops as interrupted, exit 143."""
    import os
    import signal
    import threading

    def terminate_when_started() -> None:
        deadline = time.time() + 60
        while not (tmp_path / "pid").exists() and time.time() < deadline:
            time.sleep(0.05)
        os.kill(int((tmp_path / "pid").read_text()), signal.SIGTERM)

    threading.Thread(target=terminate_when_started, daemon=True).start()
    (outcome,) = sweeps.pooled([{"id": "p", "dir": str(tmp_path)}], 1, lambda: None, run=_waits_for_sigterm)
    assert outcome == {"id": "p", "status": "failed", "error": "its process was stopped by SIGTERM (exit code 143); --resume runs the point again"}, outcome
    assert (tmp_path / "interrupted").read_text() == "Terminated"


def test_local_workers_are_dealt_the_visible_gpus(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert sweeps._worker_devices(4) == ["0", "1", "2", "0"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert sweeps._worker_devices(2) == ["5", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # one GPU: shared, as before
    assert sweeps._worker_devices(3) == [None, None, None]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hidden (the tests' default): no GPU
    assert sweeps._worker_devices(2) == [None, None]


def test_slurm_needs_srun_and_submitit_before_any_directory(tmp_path: Path, capsys, monkeypatch) -> None:
    import importlib.util

    monkeypatch.setattr(sweeps.shutil, "which", lambda name: "/usr/bin/sbatch" if name == "sbatch" else None)
    code, _, err = cli(["sweep", "three-moons", "--executor", "slurm", "--out", str(tmp_path)], capsys)
    assert code == 2 and "srun is not on PATH" in err and err.count("\n") == 1
    monkeypatch.setattr(sweeps.shutil, "which", lambda name: f"/usr/bin/{name}")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "submitit" else real(name, *a))
    code, _, err = cli(["sweep", "three-moons", "--executor", "slurm", "--out", str(tmp_path)], capsys)
    assert code == 2 and "needs submitit" in err
    assert not (tmp_path / "three-moons").exists()


def test_max_array_size_reads_the_clusters_limit(monkeypatch) -> None:
    import subprocess

    def scontrol(args, **kw):
        return subprocess.CompletedProcess(args, 0, stdout="AccountingStorageType   = x\nMaxArraySize            = 40\n")

    monkeypatch.setattr(subprocess, "run", scontrol)
    assert sweeps.max_array_size() == 40
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: (_ for _ in ()).throw(FileNotFoundError("scontrol")))
    assert sweeps.max_array_size() == 1001  # SLURM's default


def test_an_interrupted_slurm_sweep_cancels_each_array_once(monkeypatch) -> None:
    import subprocess
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: calls.append(list(args)))
    jobs = [SimpleNamespace(job_id=i) for i in ("4242_0", "4242_1", "4243_0")]
    sweeps._cancel(jobs, "slurm")
    assert calls == [["scancel", "4242", "4243"]]


# --- SLURM time limits: the job is requeued and its point resumes ----------------------------------


def test_a_slurm_job_is_checkpointable_and_requeues_its_own_point() -> None:
    """submitit requeues a job at its time limit only when its callable has `checkpoint`; the
    resubmission is the same point, which `run_point` resumes from its run directory."""
    import pickle

    task = {"id": "p0", "dir": "/x/p0", "recipe": "three-moons", "preset": "cpu", "overrides": [], "threads": 0}
    job = sweeps.PointJob()
    again = job.checkpoint(task)
    assert again.function is job and again.args == (task,) and again.kwargs == {}
    assert isinstance(pickle.loads(pickle.dumps(again.function)), sweeps.PointJob)  # what submitit stores


def test_a_run_that_submitit_exits_is_interrupted_not_failed(tmp_path: Path, capsys, monkeypatch) -> None:
    """submitit ends a timed-out job with sys.exit after requeueing it: the run is `interrupted` (and
    resumable), as after Ctrl-C, not `failed`."""
    from owai.methods import three_moons

    def exit_mid_run(*args, **kwargs):
        raise SystemExit(-1)

    monkeypatch.setattr(three_moons, "train_loop", exit_mid_run)
    with pytest.raises(SystemExit):
        from owai.experiment import execute

        execute("three-moons", "cpu", TINY, run_dir=tmp_path / "run")
    assert Run(tmp_path / "run").status() == "interrupted"


@pytest.mark.slow
def test_a_timed_out_job_is_requeued_and_resumes_its_point(tmp_path: Path) -> None:
    """A real submitit job (its local executor: the same signal handling as on SLURM) gets the
    time-limit signal after its first checkpoint; submitit requeues it, and the point resumes and ends
    as an uninterrupted run of it."""
    import os
    import signal
    import time

    import submitit

    overrides = [*TINY[:-1], "train.steps=300", "train.checkpoint_every=10"]
    task = {"id": "p0", "dir": str(tmp_path / "p0"), "recipe": "three-moons", "preset": "cpu",
            "overrides": overrides, "threads": 1}
    ex = submitit.LocalExecutor(folder=tmp_path / "slurm")
    ex.update_parameters(timeout_min=30)
    job = ex.submit(sweeps.PointJob(), task)
    stage = tmp_path / "p0" / "checkpoints" / "heads3-r0"
    deadline = time.time() + 240
    while not (stage.is_dir() and any(p.name.startswith("step-") for p in stage.iterdir())):
        assert time.time() < deadline and not job.done(), job.stderr()
        time.sleep(0.05)
    # USR2 to the job's task, as SLURM sends before the time limit (submitit's local controller, the
    # job's own process, would not pass it on); the job has run past submitit's margin: a timeout
    controller = job._process.pid
    (task_pid,) = map(int, Path(f"/proc/{controller}/task/{controller}/children").read_text().split())
    os.kill(task_pid, signal.SIGUSR2)
    outcome = job.result()
    assert outcome["status"] == "complete", outcome
    log = job.stdout()
    assert log.count("Starting with JobEnvironment") == 2, log  # requeued once
    env = json.loads((tmp_path / "p0" / "env.json").read_text())
    assert len(env["resumed"]) == 1  # continued from its checkpoint, not restarted

    uninterrupted = sweeps.run_point({**task, "id": "p1", "dir": str(tmp_path / "p1")})
    assert uninterrupted["status"] == "complete"
    rows = [{r["metric"]: r["measured"] for r in json.loads((tmp_path / d / "results.json").read_text())["rows"]}
            for d in ("p0", "p1")]
    assert rows[0] == rows[1]


# --- SLURM jobs that vanish without a result -----------------------------------------------------


class _FakeJob:
    """A submitit job as `_as_finished` sees it: done after `polls` checks, in SLURM state `state`."""

    def __init__(self, job_id: str, state: str, polls: int) -> None:
        from types import SimpleNamespace

        self.job_id, self.state, self.polls = job_id, state, polls
        self.paths = SimpleNamespace(stderr=f"/sweep/slurm/{job_id}_0_log.err")

    def done(self, force_check: bool = False) -> bool:
        self.polls -= 1
        return self.polls < 0

    def result(self) -> dict:
        return {"id": self.job_id, "status": "complete"}


def test_a_job_that_left_the_queue_without_a_result_fails_its_point(monkeypatch) -> None:
    """Without `sacct` (state UNKNOWN) or after a preemption that cancels (PREEMPTED), submitit would
    wait for ever on a job killed before it wrote its result: once it has been out of `squeue` for
    the grace period it fails its point, naming its log. A job still queued, one whose state sacct
    knows, and every job when squeue cannot be read are left to submitit."""
    monkeypatch.setattr(sweeps.time, "sleep", lambda s: None)
    jobs = {"finishes": _FakeJob("7_0", "UNKNOWN", polls=0), "killed": _FakeJob("7_1", "UNKNOWN", polls=99),
            "preempted": _FakeJob("7_2", "PREEMPTED", polls=99), "queued": _FakeJob("7_3", "UNKNOWN", polls=3),
            "running": _FakeJob("7_4", "RUNNING", polls=4)}
    order = [(job.job_id, why) for job, why in sweeps._as_finished(list(jobs.values()), poll=0, grace=0,
                                                                    queued=lambda: {"7_3"})]
    assert [i for i, _ in order] == ["7_0", "7_1", "7_2", "7_3", "7_4"]
    assert [why is None for _, why in order] == [True, False, False, True, True]
    assert "left the SLURM queue without a result (state UNKNOWN" in order[1][1]
    assert order[1][1].endswith("its log: /sweep/slurm/7_1_0_log.err")
    assert "(state PREEMPTED" in order[2][1]

    unreadable = [_FakeJob("8_0", "UNKNOWN", polls=5)]
    assert [why for _, why in sweeps._as_finished(unreadable, poll=0, grace=0, queued=lambda: None)] == [None]

    clock = iter(range(0, 1000, 10))  # 10 s a poll: gone only after 120 s out of the queue
    monkeypatch.setattr(sweeps.time, "monotonic", lambda: next(clock))
    late = _FakeJob("9_0", "UNKNOWN", polls=10**6)
    checks = []
    out = sweeps._as_finished([late], poll=10, grace=120, queued=lambda: checks.append(1) or set())
    assert next(out)[1] is not None and len(checks) == 13


def test_a_sweep_records_the_lost_job_as_a_failed_point(tmp_path: Path, monkeypatch) -> None:
    from types import SimpleNamespace

    monkeypatch.setattr(sweeps.time, "sleep", lambda s: None)
    monkeypatch.setattr(sweeps, "LOST_JOB_GRACE_S", 0)
    monkeypatch.setattr(sweeps, "_queued_job_ids", lambda: set())
    todo = [SimpleNamespace(id="a"), SimpleNamespace(id="b")]
    jobs = [_FakeJob("5_0", "COMPLETED", polls=0), _FakeJob("5_1", "UNKNOWN", polls=99)]
    outcomes = sweeps._wait_for(SimpleNamespace(recipe="three-moons"), jobs, todo, "slurm")
    assert outcomes[0] == {"id": "5_0", "status": "complete"}
    assert outcomes[1]["id"] == "b" and outcomes[1]["status"] == "failed"
    assert outcomes[1]["error"].startswith("job 5_1 left the SLURM queue without a result")


def test_the_queue_is_read_per_array_task_or_not_at_all(monkeypatch) -> None:
    import subprocess
    from types import SimpleNamespace

    seen = []

    def squeue(args, **kw):
        seen.append(args)
        return SimpleNamespace(returncode=0, stdout="7_3\n7_4\n\n12\n")

    monkeypatch.setattr(subprocess, "run", squeue)
    assert sweeps._queued_job_ids() == {"7_3", "7_4", "12"}
    assert seen[0][:5] == ["squeue", "-h", "-r", "-o", "%i"]  # -r: one line per array task, not 7_[3-4]
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: SimpleNamespace(returncode=1, stdout=""))
    assert sweeps._queued_job_ids() is None

    def missing(args, **kw):
        raise FileNotFoundError("squeue")

    monkeypatch.setattr(subprocess, "run", missing)
    assert sweeps._queued_job_ids() is None


def test_a_point_whose_results_file_is_damaged_is_resumed_and_writes_it_again(tmp_path: Path, capsys) -> None:
    """A damaged results.json (owai writes it atomically: a damaged disk) is moved aside to
    results.json.damaged and the point resumes; a sweep's --resume failed on the same file each time."""
    plan = sweeps.create("three-moons", "cpu", TINY, [], [0], tmp_path)
    code, _, err = cli(["sweep", "--resume", str(plan.path), "-q"], capsys)
    assert code == 0, err
    (point,) = (plan.path / "points").iterdir()
    good = json.loads((point / "results.json").read_text())
    (point / "results.json").write_text('{"rows": [')
    (row,) = sweeps.summarise(sweeps.open_sweep(plan.path))["points"]  # what `owai report SWEEP` shows meanwhile
    assert row["status"] == "corrupt" and "results.json is corrupt: not JSON" in row["error"]
    code, _, err = cli(["sweep", "--resume", str(plan.path), "-q"], capsys)
    assert code == 0, err
    assert json.loads((point / "results.json").read_text())["rows"] == good["rows"]
    assert (point / "results.json.damaged").read_text() == '{"rows": ['


def test_a_set_that_every_point_of_the_grid_overrules_is_refused(tmp_path: Path) -> None:
    """Each point's grid value won over a base --set of the same key, silently: `owai dropout-ft --set
    model.dropout=0.5` ran 0.0 and 0.9. Refused now, unless --grid restates the key's values, the grid
    holds only the value set, or a sub-grid without the key takes the --set (a union grid)."""
    def recipe_with(name: str, grid) -> str:  # each its own file (moons_recipe writes three-moons.yaml)
        (tmp_path / name).mkdir()
        return moons_recipe(tmp_path / name, {"grid": grid, "seeds": [1]})

    recipe = recipe_with("lr", {"train.lr": [0.01, 0.02]})
    with pytest.raises(OwaiError, match=r"--set train.lr: the recipe's sweep grid sets train.lr in every point \(0.01, 0.02\)"):
        sweeps.plan(recipe, None, [*TINY, "train.lr=0.5"])
    with pytest.raises(OwaiError, match="--set model.beta: the recipe's sweep grid sets"):  # a mapping's key too
        sweeps.plan(recipe_with("beta", {"model.beta": [4.0, 8.0]}), None,
                    [*TINY, "model={beta: 2.0}"])
    assert [p.grid for p in sweeps.plan(recipe, None, [*TINY, "train.lr=0.5"], ["train.lr=0.5,0.6"])] == [
        {"train.lr": 0.5}, {"train.lr": 0.6}]
    with pytest.raises(OwaiError, match=r"--set train.lr=0.5 and --grid train.lr=0.1,0.2: the grid's values win"):
        sweeps.plan(recipe, None, [*TINY, "train.lr=0.5"], ["train.lr=0.1,0.2"])
    # a --set a command adds itself (user_sets: what the user typed), and a grid a command builds, are not the user's
    assert len(sweeps.plan(recipe, None, [*TINY, "train.lr=0.5"], user_sets=[])) == 2
    assert len(sweeps.plan(recipe, None, [*TINY, "train.lr=0.5"], grid={"train.lr": [0.1, 0.2]})) == 2
    assert len(sweeps.plan(recipe_with("one", {"train.lr": [0.01]}), None, [*TINY, "train.lr=0.01"])) == 1
    union = recipe_with("union", [{"train.lr": [0.01]}, {"model.beta": [40.0]}])
    assert len(sweeps.plan(union, None, [*TINY, "train.lr=0.5"])) == 2


def test_a_study_names_the_data_its_points_read_not_the_base_configs(tmp_path: Path, capsys) -> None:
    """`owai dropout-ft -p paper --dataset pacs --data-root DIR` (README) said VLCS was missing: the
    base config's dataset, which no point reads."""
    (tmp_path / "data").mkdir()
    code, _, err = cli(["dropout-ft", "-p", "paper", "--dataset", "pacs", "--data-root", str(tmp_path / "data"),
                        "--out", str(tmp_path / "runs"), "-q"], capsys)
    assert code == 2 and "DomainBed PACS not found" in err and "VLCS" not in err, err
    assert not (tmp_path / "runs").exists()
