"""Tests that a mutation audit of owai/sweep.py, owai/trackers.py, owai/hub.py, owai/models/hf_cache.py
and owai/commands/data.py found missing: each one fails on a small plausible change of the code that
no other test caught, and passes on the real code.

Every expected value comes from a docstring (the sweep module's layout and STD, `summarise`,
`select_cells`, the trackers' "mirror what metrics.jsonl holds", hub's "asked once per process",
hf_cache's "both at once is an error"), from the official library the code follows (transformers'
own DynamicCache for a cache's batch operations, huggingface_hub's parsing of its offline variable),
or from the file format (one point, one run directory). No test runs a model or a real run: points'
results are written by hand, as tests/test_sweep.py does.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import cli_in_process

from owai import hub, trackers
from owai import sweep as sweeps
from owai.errors import OwaiError
from owai.models import hf_cache
from owai.runs import Run

TINY = [  # tests/test_sweep.py's three-moons settings: plans resolve at once
    "train.steps=4", "train.batch_size=2", "train.checkpoint_every=2",
    "train.selection_sequences=2", "data.block_size=60", "eval.n_sequences=2", "eval.n_gen=3",
    "eval.tau_stride=10", "model.heads=[3]",
]


def _results(plan: sweeps.Sweep, point: sweeps.Point, rows: list[dict]) -> Path:
    """A point's run directory holding `rows` as its results.json (a complete point, no run)."""
    run = Run.create_at(plan.point_dir(point), {"recipe": "three-moons", "params": {}})
    run.write_results({"rows": [{"thesis": None, "thesis_claim": "", "ref": "", **r} for r in rows]})
    return plan.point_dir(point)


# --- sweep.py ------------------------------------------------------------------------------------


def test_run_point_leaves_a_complete_point_as_it_is(tmp_path: Path, monkeypatch) -> None:
    """A point is complete once its results.json exists (the module docstring), and a sweep never
    repeats a finished point. `run` filters complete points out, but `run_point` is also what a
    requeued SLURM job (`PointJob.checkpoint`) or a worker of an earlier invocation executes: it
    must not rerun (or restart) a point whose results are already written."""
    import owai.experiment

    plan = sweeps.create("three-moons", None, TINY, seeds=[1], out=tmp_path / "runs")
    (point,) = plan.points
    path = _results(plan, point, [{"metric": "m", "measured": 1.0}])
    before = (path / "results.json").read_bytes()
    calls: list = []
    monkeypatch.setattr(owai.experiment, "execute", lambda *a, **k: calls.append((a, k)))
    outcome = sweeps.run_point(sweeps._task(plan, point))
    assert outcome["status"] == "complete" and outcome["error"] is None
    assert calls == [] and (path / "results.json").read_bytes() == before


def test_a_cell_with_one_measured_seed_has_no_std(tmp_path: Path) -> None:
    """sweep.STD: the sample standard deviation over seeds, "null when n < 2". A cell whose other
    seed has no results yet has n = 1 and std None, not 0 (a 0 would read as "every seed agreed")."""
    plan = sweeps.create("three-moons", None, TINY, seeds=[1, 2], out=tmp_path / "runs")
    _results(plan, plan.points[0], [{"metric": "m", "measured": 3.0}])
    (group,) = sweeps.summarise(plan)["groups"]
    (m,) = group["metrics"]
    assert (m["mean"], m["n"], m["std"]) == (3.0, 1, None)
    assert "±" not in sweeps.markdown(sweeps.summarise(plan)).split("| m |")[1].splitlines()[0]


def test_a_cells_complete_count_and_seeds_are_the_points_with_results(tmp_path: Path) -> None:
    """summary.json's group: `points` counts every point of the cell, `complete` and `seeds` only
    those whose results.json exists (the module docstring: complete = results.json exists). A point
    not yet run is not a complete seed of its cell."""
    plan = sweeps.create("three-moons", None, TINY, seeds=[1, 2, 3], out=tmp_path / "runs")
    _results(plan, plan.points[1], [{"metric": "m", "measured": 2.0}])  # seed 2 only
    summary = sweeps.summarise(plan)
    (group,) = summary["groups"]
    assert (group["points"], group["complete"], group["seeds"]) == (3, 1, [2])
    assert summary["counts"] == {"points": 3, "complete": 1, "pending": 2}


def test_selection_reads_exactly_the_named_metric_not_a_test_one(tmp_path: Path) -> None:
    """`select.metric` names one measured metric (recipes.Selection); model selection never reads a
    test metric. A results file holding `test.val_loss` before `val_loss` (a name that contains the
    selection's) must still be selected on `val_loss` alone: here by validation the 0.01 cell
    (1.0 < 2.0), where the test numbers would pick 0.02 (0.5 < 9.0)."""
    plan = sweeps.create("three-moons", None, TINY, seeds=[1], out=tmp_path / "runs", grid={"train.lr": [0.01, 0.02]},
                         select={"metric": "val_loss", "mode": "min"})
    numbers = {0.01: (9.0, 1.0), 0.02: (0.5, 2.0)}  # lr -> (test.val_loss, val_loss)
    for p in plan.points:
        test, val = numbers[p.grid["train.lr"]]
        _results(plan, p, [{"metric": "test.val_loss", "measured": test}, {"metric": "val_loss", "measured": val}])
    (group,) = sweeps.summarise(plan)["selection"]["groups"]
    assert (group["grid"], group["score"], group["candidates"]) == ({"train.lr": 0.01}, 1.0, 2)


def test_points_that_differ_only_in_their_seed_get_their_own_directories(tmp_path: Path) -> None:
    """Each point of the grid x seeds is one run directory (points/<point-id>/). A point id's
    readable part is cut at 60 characters, so with long grid values the seed falls out of it: the
    hash must still tell the seeds apart, or two seeds would share (and resume) one directory."""
    grid = {"train.lr": [0.0123456789012345], "model.beta": [40.123456789012], "train.clip": [0.5123456789]}
    points = sweeps.plan("three-moons", None, TINY, grid=grid, seeds=[1, 2])
    assert len(points) == 2 and all("seed=" not in p.id for p in points)  # the readable part lost the seed
    assert len({p.id for p in points}) == 2



def test_points_not_yet_run_are_not_failures(tmp_path: Path) -> None:
    """`failures`: points that ran and did not finish; "pending and still-running points are not
    failures". A sweep read half-way (`owai report SWEEP_DIR`, or summarised before its other points
    ran) lists no failed point for the points that have no run directory yet."""
    plan = sweeps.create("three-moons", None, TINY, seeds=[1, 2], out=tmp_path / "runs")
    _results(plan, plan.points[0], [{"metric": "m", "measured": 1.0}])
    summary = sweeps.summarise(plan)
    assert [p["status"] for p in summary["points"]] == ["complete", "pending"]
    assert sweeps.failures(summary) == [] and "Failed points" not in sweeps.markdown(summary)
    sweeps.raise_on_failures(summary, "--resume X")  # nothing failed: no error


def test_a_point_once_left_to_another_process_is_not_failed_by_that(tmp_path: Path) -> None:
    """summary.json keeps the errors of points that never got a run directory, so a later summary
    still names why they failed; but "a point left to another process (`run_point`) is not failed by
    that" (`_stored_errors`): its "running elsewhere" line is not a failure once the point is simply
    not run yet. A stored error of a point that did fail is kept."""
    plan = sweeps.create("three-moons", None, TINY, seeds=[1, 2], out=tmp_path / "runs")
    left, failed = plan.points
    (plan.path / sweeps.SUMMARY).write_text(json.dumps({"points": [
        {"id": left.id, "status": "running", "error": "another process is running this point"},
        {"id": failed.id, "status": "failed", "error": "its process died (exit code -9: killed, e.g. out of memory)"}]}))
    points = {p["id"]: p for p in sweeps.summarise(plan)["points"]}
    assert (points[left.id]["status"], points[left.id]["error"]) == ("pending", None)
    assert points[failed.id]["status"] == "failed" and "exit code -9" in points[failed.id]["error"]

# --- trackers.py ---------------------------------------------------------------------------------


def test_wandb_tracker_logs_each_metrics_line_at_its_own_step(tmp_path: Path, monkeypatch) -> None:
    """A tracker mirrors exactly what metrics.jsonl holds: one metrics line (stage, step, values)
    is one W&B log of its finite real numbers under "<stage>/<metric>" (TensorBoard's tags) at that
    line's step, nothing else. W&B is replaced by a stand-in module (wandb need not be installed)."""
    logged: list[dict] = []
    inits: list[dict] = []

    class FakeRun:
        def log(self, data):
            logged.append(dict(data))

        def finish(self):
            logged.append({"finished": True})

    fake = types.SimpleNamespace(init=lambda **kw: inits.append(kw) or FakeRun())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run_dir = tmp_path / "three-moons" / "20260101-000000-abcd"
    tracker = trackers.WandbTracker(run_dir, {"recipe": "three-moons"})
    line = {"stage": "heads3-r0", "step": 6, "loss": 0.25, "lr": 1e-3, "ok": True, "note": "x", "bad": float("nan")}
    tracker.log(line["stage"], line["step"], {k: v for k, v in line.items() if k not in ("stage", "step")})
    tracker.close()
    (data, end) = logged
    steps = {k: v for k, v in data.items() if k.endswith("/step")}
    assert steps == {"heads3-r0/step": 6}
    assert {k: v for k, v in data.items() if k not in steps} == {"heads3-r0/loss": 0.25, "heads3-r0/lr": 1e-3}
    assert end == {"finished": True}
    (init,) = inits  # resumed runs continue the same W&B run: a stable id, resume allowed
    assert init["resume"] == "allow" and init["name"] == run_dir.name and run_dir.name in init["id"]


# --- models/hf_cache.py --------------------------------------------------------------------------


def _state_and_dynamic(rows: int) -> tuple[hf_cache.StateCache, object]:
    """A StateCache and transformers' DynamicCache holding the same rows (row i = value i)."""
    from transformers import DynamicCache

    values = torch.arange(float(rows)).view(rows, 1, 1, 1)
    state = hf_cache.StateCache()
    state.layers = [{"h": values.clone(), "c": values.clone() * 10}]
    dynamic = DynamicCache()
    dynamic.update(values.clone(), values.clone() * 10, 0)
    return state, dynamic


def test_state_cache_batch_select_and_repeat_as_transformers_caches() -> None:
    """StateCache supports what `generate` does to a cache (its docstring): batch selection and
    repetition must do what transformers' own DynamicCache does, row for row (repeat_interleave:
    a row's copies next to each other; select: exactly the rows given)."""
    for op, arg in (("batch_select_indices", torch.tensor([0, 2])), ("batch_repeat_interleave", 2),
                    ("reorder_cache", torch.tensor([2, 0, 0]))):
        state, dynamic = _state_and_dynamic(3)
        getattr(state, op)(arg)
        getattr(dynamic, op)(arg)
        assert torch.equal(state.layers[0]["h"], dynamic.layers[0].keys), op
        assert torch.equal(state.layers[0]["c"], dynamic.layers[0].values), op


def test_given_cache_refuses_two_caches_and_forward_cache_makes_one_only_when_asked() -> None:
    """`given_cache`: a cache under either name, "both at once is an error" (unless they are the
    same object). `forward_cache`: use_cache=None means "when one was passed", so a forward given
    no cache and no use_cache returns none; use_cache=True makes one; a passed one is kept."""
    a, b = {}, {}
    assert hf_cache.given_cache(a, None) is a and hf_cache.given_cache(None, b) is b and hf_cache.given_cache(a, a) is a
    with pytest.raises(OwaiError, match="pass the cache once"):
        hf_cache.given_cache(a, b)
    assert hf_cache.forward_cache(None, None, None, dict, dict, "m") is None
    assert hf_cache.forward_cache(None, None, False, dict, dict, "m") is None
    assert hf_cache.forward_cache(None, None, True, dict, dict, "m") == {}
    assert hf_cache.forward_cache(None, a, None, dict, dict, "m") is a



def test_only_a_recurrent_state_cache_reads_as_linear_to_transformers() -> None:
    """`StateCache.is_linear`: transformers' per-layer flag for "a recurrent state, which `generate`
    never slices by position", one per layer, True exactly for a recurrent state (the LSTM's cache)
    and False for caches with per-position entries (Memory Mosaics')."""
    from owai.models.lstm import LSTMCache
    from owai.models.memory_mosaics import MemoryMosaicsCache

    for cls, expected in ((LSTMCache, True), (MemoryMosaicsCache, False), (hf_cache.StateCache, False)):
        cache = cls()
        cache.layers = [{"h": torch.zeros(1, 1)}, {"h": torch.zeros(1, 1)}]
        assert cache.is_linear == [expected, expected], cls.__name__

# --- hub.py --------------------------------------------------------------------------------------


def test_the_hub_probe_connects_once_per_host(monkeypatch) -> None:
    """hub.py: without a network the clients retry for 20-30 s, so owai asks "once per process and
    host" (a sweep validates many points): the second question about a host tries no connection."""
    import socket

    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "no_proxy",
                 "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    attempts: list = []

    def refuse(address, timeout=None):
        attempts.append(address)
        raise OSError("refused in this test")

    monkeypatch.setattr(socket, "create_connection", refuse)
    clear = getattr(hub._connect, "cache_clear", lambda: None)
    clear()
    try:
        first = hub.host_unreachable("https://owai-probe-test.invalid/x")
        second = hub.host_unreachable("https://owai-probe-test.invalid/y")
    finally:
        clear()
    assert first == second == "owai-probe-test.invalid is unreachable (OSError: refused in this test)"
    assert attempts == [("owai-probe-test.invalid", 443)]


@pytest.mark.parametrize("value", ["true", "Yes", "on"])
def test_offline_variables_read_as_huggingface_hub_reads_them(value, monkeypatch) -> None:
    """huggingface_hub reads its offline variables case-insensitively (`constants._is_true`:
    value.upper() in ENV_VARS_TRUE_VALUES); owai's `offline_mode` must agree, or HF_HUB_OFFLINE=true
    leaves the clients offline while owai probes the network and reports the hub reachable."""
    from huggingface_hub import constants

    assert constants._is_true(value)  # the library's own reading
    for name in hub.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", value)
    assert hub.offline_mode() == "HF_DATASETS_OFFLINE"


# --- commands/data.py ----------------------------------------------------------------------------


def test_data_list_table_marks_each_dataset_as_the_catalogue_found_it(capsys, monkeypatch) -> None:
    """`owai data list` prints the catalogue's rows (`registry.status`, also `--json`): a dataset
    whose row says found "no" is shown "no" in the found column, never "yes"."""
    from owai.data import registry

    rows = [{"name": name, "kind": "dataset", "found": found, "verified": "-", "where": "/d", "size": "1 MB",
             "get": "fetch", "note": "", "reads": []} for name, found in (("herecorpus", "yes"), ("gonecorpus", "no"))]
    monkeypatch.setattr(registry, "status", lambda data_root=None: rows)
    monkeypatch.setenv("COLUMNS", "160")
    code, out, err = cli_in_process(["data", "list"], capsys)
    assert code == 0, err
    cells = {}
    for line in out.splitlines():
        parts = [c.strip() for c in line.replace("┃", "│").split("│")]
        for name in ("herecorpus", "gonecorpus"):
            if name in parts:
                cells[name] = parts[parts.index(name) + 1]
    assert cells == {"herecorpus": "yes", "gonecorpus": "no"}, out


def test_a_mirror_without_a_host_is_refused_before_any_folder(tmp_path: Path, capsys) -> None:
    """--mirror takes base URLs, http(s)/ftp with a host or file:// (its help and `_check_mirrors`);
    "https:/example.org/gpt2/" (a slash missing) has no host: one `error:` line, exit 2, and the
    data root is not created (bad input fails before any directory exists)."""
    root = tmp_path / "D"
    code, _, err = cli_in_process(["data", "fetch", "gpt2", "--data-root", str(root), "--mirror",
                                     "https:/example.org/gpt2/"], capsys)
    assert code == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1, err
    assert "not a URL" in err and not root.exists()


def test_data_verify_prints_every_check_it_made(tmp_path: Path, capsys, monkeypatch) -> None:
    """`owai data verify NAME` checks the copy against its checksums and prints the folder, then each
    check (`--json`: the same checks as "verified"): none of them may be left out of the text."""
    from owai.data import registry

    checks = ["encoder.json sha256 ok", "vocab.bpe sha256 ok"]
    monkeypatch.setattr(registry, "require", lambda name, data_root=None: tmp_path)
    monkeypatch.setattr(registry, "verify", lambda name, folder: list(checks))
    code, out, err = cli_in_process(["data", "verify", "gpt2"], capsys)
    assert code == 0, err
    assert out.splitlines() == [f"gpt2: {tmp_path}", *(f"  {c}" for c in checks)]


def test_data_stats_resume_refuses_a_data_root_it_would_ignore(tmp_path: Path, capsys) -> None:
    """`owai data stats --resume RUN` takes its config from the run directory, so any other option,
    --data-root included, is one `error:` line, exit 2, before anything is read or made."""
    code, _, err = cli_in_process(["data", "stats", "--resume", str(tmp_path / "run"), "--data-root",
                                     str(tmp_path / "D")], capsys)
    assert code == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1, err
    assert "--resume takes its config from the run directory" in err
    assert sorted(tmp_path.iterdir()) == []
