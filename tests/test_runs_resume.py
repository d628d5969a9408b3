"""Run directories, results, report, --json/--quiet, and SIGKILL + --resume equality."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY_MOONS, cli_in_process, run_owai
from owai import runs

SETS = sum((["--set", s] for s in TINY_MOONS), [])


def test_moons_run_directory_layout_and_report(tmp_path, capsys):
    out = tmp_path / "runs"
    proc = run_owai("moons", *SETS, "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)  # --json: stdout is exactly one JSON document
    run_dir = Path(results["run_dir"])
    assert run_dir.parent == out / "three-moons"
    for name in ("config.yaml", "env.json", "metrics.jsonl", "results.json", "status.json"):
        assert (run_dir / name).is_file(), name
    for fig in ("fig3.6-three-heads", "figB.1-matrices"):
        assert (run_dir / "figures" / f"{fig}.png").stat().st_size > 1000
    env = json.loads((run_dir / "env.json").read_text())
    assert env["seed"] == 100 and env["device"] == "cpu" and env["torch"].startswith("2.")
    # the processor and torch's kernels for it, on which a CPU run's float32 numbers depend
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["cpu"] == runs.cpu_model()
    assert json.loads((run_dir / "status.json").read_text())["status"] == "complete"
    rows = {r["metric"]: r for r in results["rows"]}
    assert rows["heads3.val.accurate_from"]["thesis"] == 133.3
    assert "heads3.disentanglement" in rows and rows["heads3.disentanglement"]["measured"] is not None
    steps = [m["step"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    assert steps == sorted(steps) and steps[-1] == 6

    # in process from here (an `owai` subprocess costs seconds of imports; the run above is the console script)
    code, md, _ = cli_in_process(["report", str(run_dir), "--markdown"], capsys)
    assert code == 0 and "| heads3.val.accurate_from |" in md and "133.3" in md
    code, table, _ = cli_in_process(["report", str(run_dir)], capsys)
    assert code == 0 and "heads3.disentanglement" in table


def test_runs_never_overwrite(tmp_path, capsys):
    out = tmp_path / "runs"
    for _ in range(2):
        assert cli_in_process(["moons", *SETS, "--quiet", "--out", str(out)], capsys)[0] == 0
    assert len(list((out / "three-moons").iterdir())) == 2


def test_quiet_prints_nothing_on_success(tmp_path):
    proc = run_owai("moons", *SETS, "--quiet", "--out", str(tmp_path))
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""


def _results_without_times(run_dir: Path) -> dict:
    res = json.loads((run_dir / "results.json").read_text())
    for key in ("run_dir", "finished"):
        res.pop(key)
    return res


def _close(a: object, b: object, rel: float = 1e-6) -> bool:
    """Equal structures, floats within `rel`: a resumed process may differ from an uninterrupted one
    in the last bit of a float32 reduction (MKL's results can depend on memory alignment), while
    any real resume bug moves the numbers far more."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], rel) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)
    return a == b


def test_close_compares_structures_and_floats():
    assert _close({"a": [1, 0.5, {"b": "x"}]}, {"a": [1, 0.5 * (1 + 1e-8), {"b": "x"}]})
    assert not _close({"a": [1, 0.5]}, {"a": [1, 0.5001]})
    assert not _close({"a": 1}, {"a": 1, "b": 2}) and not _close([1, 2], [1, 2, 3]) and not _close("x", "y")


@pytest.mark.slow  # a full end-to-end path (tens of seconds); `pytest -m slow`
def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    """Kill a training run with SIGKILL mid-way; --resume must end with the same numbers."""
    sets = [
        "train.steps=120", "train.batch_size=16", "train.checkpoint_every=10", "train.selection_sequences=4",
        "data.block_size=400", "eval.n_sequences=4", "eval.n_gen=5", "eval.tau_stride=20", "model.heads=[3]",
    ]
    args = sum((["--set", s] for s in sets), [])
    reference = run_owai("moons", *args, "--quiet", "--out", str(tmp_path / "full"))
    assert reference.returncode == 0, reference.stderr
    full_dir = next((tmp_path / "full" / "three-moons").iterdir())

    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "owai", "moons", *args, "--quiet", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600  # generous: CI machines can be loaded
    while time.time() < deadline and proc.poll() is None:
        ckpts = list(out.glob("three-moons/*/checkpoints/heads3-r0/step-*"))
        if any(int(p.name[5:]) >= 30 for p in ckpts):
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    run_dir = next((out / "three-moons").iterdir())
    steps = [int(p.name[5:]) for p in (run_dir / "checkpoints" / "heads3-r0").glob("step-*")]
    assert steps and max(steps) < 120, "the run finished before it could be killed"
    assert not (run_dir / "results.json").exists()
    assert json.loads((run_dir / "status.json").read_text())["status"] == "running"

    resumed = run_owai("moons", "--resume", str(run_dir), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert _close(_results_without_times(run_dir), _results_without_times(full_dir))
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reference_log = [json.loads(line) for line in (full_dir / "metrics.jsonl").read_text().splitlines()]
    assert _close(logged, reference_log)  # metrics past the checkpoint were trimmed, then re-logged
    env = json.loads((run_dir / "env.json").read_text())
    assert len(env["resumed"]) == 1 and env["resumed"][0]["cpu_capability"] == env["cpu_capability"]

    again = run_owai("moons", "--resume", str(run_dir))
    assert again.returncode == 0 and "already complete" in again.stderr  # an info line: stderr


def test_cpu_model_reads_the_processors_name(tmp_path, monkeypatch):
    """env.json's cpu: the "model name" line of /proc/cpuinfo, else platform.processor(), else None."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\nflags\t: fpu\n")
    assert runs.cpu_model(info) == "AMD EPYC 9654 96-Core Processor"
    info.write_text("processor\t: 0\nCPU part\t: 0xd0c\n")  # an Arm kernel's: no model name
    monkeypatch.setattr(runs.platform, "processor", lambda: "aarch64")
    assert runs.cpu_model(info) == "aarch64" == runs.cpu_model(tmp_path / "absent")
    monkeypatch.setattr(runs.platform, "processor", lambda: "")
    assert runs.cpu_model(info) is None
