"""Experiment trackers (issue #35): off by default, TensorBoard event files that TensorBoard's own
reader loads with the numbers of metrics.jsonl, and a one-line error before the run when the
tracker's package is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import as_sets, cli_in_process
from owai import trackers


def _runs(out: Path) -> list[Path]:
    return sorted(p for p in out.glob("*/*") if p.is_dir())


def test_tensorboard_tracker_writes_what_metrics_jsonl_holds(tmp_path, tiny_moons, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "runs"
    code, _, err = cli_in_process(["moons", "-q", "-o", str(out), "--tracker", "tensorboard", *as_sets(tiny_moons)], capsys)
    assert code == 0, err
    (run,) = _runs(out)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["stage"], r["step"], k, v) for r in rows for k, v in r.items()
              if k not in ("stage", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)]
    assert logged, "the tiny run logs metrics"
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for stage, step, key, value in logged:
        assert f"{stage}/{key}" in tags
        points = {e.step: e.value for e in events.Scalars(f"{stage}/{key}")}
        assert points[step] == pytest.approx(value, rel=1e-6)


def test_no_tracker_by_default(tmp_path, tiny_moons, capsys):
    out = tmp_path / "runs"
    code, _, err = cli_in_process(["moons", "-q", "-o", str(out), *as_sets(tiny_moons)], capsys)
    assert code == 0, err
    (run,) = _runs(out)
    assert not (run / "tensorboard").exists() and not (run / "wandb").exists()


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_missing_tracker_package_is_one_line_before_the_run(name, tmp_path, tiny_moons, capsys, monkeypatch):
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda mod, *a: None if mod == name else real(mod, *a))
    out = tmp_path / "runs"
    code, stdout, err = cli_in_process(["moons", "-q", "-o", str(out), "--tracker", name, *as_sets(tiny_moons)], capsys)
    assert code == 2
    lines = [line for line in (stdout + err).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and f"owai[{name}]" in lines[0], lines
    assert not out.exists()


def test_unknown_tracker_is_refused(tmp_path, tiny_moons, capsys):
    out = tmp_path / "runs"
    code, stdout, err = cli_in_process(["moons", "-q", "-o", str(out), "--set", "runtime.tracker=mlflow",
                                        *as_sets(tiny_moons)], capsys)
    assert code == 2 and "runtime.tracker" in err and not out.exists()


def test_scalars_keep_only_finite_real_numbers():
    assert trackers.scalars({"loss": 1.5, "n": 3, "ok": True, "name": "x", "bad": float("nan")}) == {"loss": 1.5, "n": 3.0}


@pytest.mark.parametrize("command", [["eval", "ruler"], ["eval", "harness"], ["eval", "icl"]])
def test_every_evaluation_command_takes_tracker(command, tmp_path, capsys, monkeypatch):
    """--tracker reaches the run's runtime.tracker (refused here, before any run, for a missing package)."""
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda mod, *a: None if mod == "wandb" else real(mod, *a))
    out = tmp_path / "runs"
    code, _, err = cli_in_process([*command, "-q", "-o", str(out), "--tracker", "wandb"], capsys)
    assert code == 2 and "owai[wandb]" in err and not out.exists(), err
