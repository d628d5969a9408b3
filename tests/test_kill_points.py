"""Kills at unlucky points (found by a kill-at-random-points fuzz pass): what a process killed in the
middle of a write leaves behind must neither stop a resume nor stay in the run directory, and a
resumed run must end as the uninterrupted one does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TINY_MOONS, as_if_killed, as_sets, cli_in_process
from owai import sweep as sweeps
from owai.runs import Run
from owai.train import LoopConfig, train_loop

STAGE = "heads3-r0"  # the tiny three-moons run's one training stage


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny three-moons run (checkpoints at steps 4 and 6 of its one stage)."""
    from owai import console
    from owai.cli import main

    out = tmp_path_factory.mktemp("runs")
    try:
        main(["moons", *as_sets(TINY_MOONS), "--quiet", "--out", str(out)])
    except SystemExit as e:
        assert not e.code, e.code
    finally:
        console.configure()
    return next((out / "three-moons").iterdir())


def measured(run: Path) -> dict[str, object]:
    return {r["metric"]: r["measured"] for r in json.loads((run / "results.json").read_text())["rows"]}


def test_resume_removes_the_temporary_checkpoint_a_kill_left(finished_run: Path, tmp_path: Path, capsys) -> None:
    """Killed while saving step 6: step 6 never committed, its temporary folder half written. The resume
    redoes step 6 and removes the temporary (each such kill used to leave one more, each up to a whole
    checkpoint), and ends as the uninterrupted run."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    stage = run / "checkpoints" / STAGE
    as_if_killed(run, stage / "step-000006")
    left = stage / ".tmp-step-000006-k1ll3d"
    left.mkdir()
    (left / "tensors.safetensors").write_bytes(b"\x00" * 100)  # cut off by the kill

    code, _, err = cli_in_process(["moons", "--resume", str(run), "-q"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in stage.iterdir()) == ["step-000004", "step-000006"]
    assert measured(run) == measured(finished_run)


def test_resume_removes_the_temporary_files_of_killed_writes(finished_run: Path, tmp_path: Path, capsys) -> None:
    """Killed between an atomic write's start and its rename (status.json, a figure): the temporary file
    beside it is removed by the resume, before it writes."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    as_if_killed(run)
    left = [run / ".status.json.q8z1x0ab.tmp", run / "figures" / ".figB.1-matrices.png.3kd9s0qe.tmp"]
    for path in left:
        path.write_bytes(b"{\n  \"sta")  # cut off by the kill

    code, _, err = cli_in_process(["moons", "--resume", str(run), "-q"], capsys)
    assert code == 0, err
    assert not any(path.exists() for path in left)
    assert json.loads((run / "status.json").read_text())["status"] == "complete"


def test_resume_prunes_an_old_checkpoint_a_kill_left_half_removed(finished_run: Path, tmp_path: Path, capsys) -> None:
    """Killed while the stage's last save pruned the checkpoints before the newest two: the stage never
    saves again, so the resume removes the half-removed older one itself."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    stage = run / "checkpoints" / STAGE
    as_if_killed(run)
    shutil.copytree(stage / "step-000004", stage / "step-000002")
    (stage / "step-000002" / "state.json").unlink()  # removed before the kill; its tensors not yet

    code, _, err = cli_in_process(["moons", "--resume", str(run), "-q"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in stage.iterdir()) == ["step-000004", "step-000006"]
    assert measured(run) == measured(finished_run)


def test_a_finished_stage_is_returned_in_eval_mode_as_after_training(tmp_path: Path) -> None:
    """train_loop leaves the model in eval mode after training; a resume whose stage had already
    finished (loaded from its final checkpoint) must too, or what the caller evaluates next (dropout,
    batch norm) differs from the uninterrupted run's."""
    run = Run(tmp_path)
    run.identity = {"command": "test"}
    data = torch.randn(4, 8, 4, generator=torch.Generator().manual_seed(0))
    modes = []
    for _ in range(2):  # the run, then a resume of it
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train_loop(run, "stage", model, optimizer, lambda step, micro: model(data[step]).square().mean(),
                   LoopConfig(steps=4, checkpoint_every=2, log_every=1))
        modes.append(model.training)
    assert modes == [False, False]


def test_a_sweep_point_killed_while_writing_its_config_runs_again(tmp_path: Path, capsys) -> None:
    """Killed while its config.yaml was written, a point's directory holds the empty figures/ and
    checkpoints/ and that write's temporary file: nothing to keep, so `--resume` runs the point
    (it used to fail it: "holds files but no config.yaml; remove it"), and removes the temporary file
    that a killed write of the sweep's summary.json left."""
    tiny = [s for s in TINY_MOONS if not s.startswith("train.steps")] + ["train.steps=2"]
    code, _, err = cli_in_process(["sweep", "three-moons", *as_sets(tiny), "--seeds", "1", "--out", str(tmp_path), "-q"], capsys)
    assert code == 0, err
    (sweep,) = (tmp_path / "three-moons").glob("sweep-*")
    (point,) = (sweep / "points").iterdir()
    reference = measured(point)
    shutil.rmtree(point)
    (point / "figures").mkdir(parents=True)
    (point / "checkpoints").mkdir()
    (point / ".config.yaml.x7f3kq2a.tmp").write_text("recipe: three-mo")  # cut off by the kill
    (sweep / ".summary.json.0dk2la9x.tmp").write_text("{")  # and one of the sweep's own writes

    code, out, err = cli_in_process(["sweep", "--resume", str(sweep), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["counts"] == {"points": 1, "complete": 1}
    assert not list(point.glob(".*")) and not list(sweep.glob(".*")) and measured(point) == reference


def test_a_point_folder_with_a_file_of_its_own_is_still_kept(tmp_path: Path) -> None:
    """Only a write's temporary file is taken for a kill's leftover: any other file is kept and named."""
    point = tmp_path / "p0"
    (point / "figures").mkdir(parents=True)
    (point / "notes.txt").write_text("mine")
    outcome = sweeps.run_point({"id": "p0", "dir": str(point)})
    assert outcome["status"] == "failed" and "holds files but no config.yaml" in outcome["error"]
    assert (point / "notes.txt").read_text() == "mine"
