"""How a torchrun job ends: owai's ranks leave their process group after a successful command, and
the tests' torchrun runner retries a native crash of a rank once, and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import cli_in_process, rank_signal, torchrun
from owai import distributed


@pytest.fixture
def shutdowns(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(distributed, "shutdown", lambda: calls.append(1))
    return calls


def test_a_successful_command_leaves_the_process_group(shutdowns: list[int], capsys: pytest.CaptureFixture[str]):
    code, out, _ = cli_in_process(["recipes", "list", "--json"], capsys)
    assert code == 0 and out.startswith("[")
    assert shutdowns == [1]


def test_a_failed_command_leaves_it_to_torchrun(shutdowns: list[int], capsys: pytest.CaptureFixture[str]):
    """After an error the rank exits non-zero at once: a collective teardown could wait for a peer
    that is still training."""
    code, _, err = cli_in_process(["recipes", "show", "fig9.9"], capsys)
    assert code == 2 and err.startswith("error:")
    assert shutdowns == []


def script(tmp_path: Path, body: str) -> Path:
    """A torchrun entry point: rank 0 runs `body`, the other ranks exit 0."""
    path = tmp_path / "job.py"
    path.write_text("import os, sys\nif os.environ['RANK'] == '0':\n" + "".join(f"    {line}\n" for line in body.splitlines()))
    return path


def test_a_rank_killed_by_a_signal_is_run_once_more(tmp_path: Path):
    marker = tmp_path / "attempted"
    job = script(tmp_path, f"if not os.path.exists({str(marker)!r}):\n    open({str(marker)!r}, 'w').close()\n    os.abort()")
    resets: list[int] = []
    with pytest.warns(UserWarning, match="died of signal 6"):
        proc = torchrun(2, [str(job)], before_retry=lambda: resets.append(1), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert resets == [1]


def test_a_second_crash_fails(tmp_path: Path):
    job = script(tmp_path, "os.abort()")
    with pytest.warns(UserWarning, match="died of signal 6"):
        proc = torchrun(2, [str(job)], before_retry=lambda: None, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and rank_signal(proc) == 6


def test_a_python_error_is_not_retried(tmp_path: Path):
    job = script(tmp_path, "sys.exit('a bug in the rank')")
    resets: list[int] = []
    proc = torchrun(2, [str(job)], before_retry=lambda: resets.append(1), cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and rank_signal(proc) is None
    assert resets == []


def test_a_failed_teardown_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """A peer that vanished before the last barrier: one line and a non-zero exit, no traceback."""
    def gone() -> None:
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(distributed, "shutdown", gone)
    code, _, err = cli_in_process(["recipes", "list", "--json"], capsys)
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines() == ["internal error: RuntimeError: Connection closed by peer (set OWAI_DEBUG=1 for the traceback)"]


def test_a_rank_killed_from_outside_is_not_retried(tmp_path: Path):
    """SIGKILL (the out-of-memory killer's) is not a native crash: retrying would hide the pressure."""
    job = script(tmp_path, "import signal\nos.kill(os.getpid(), signal.SIGKILL)")
    resets: list[int] = []
    proc = torchrun(2, [str(job)], before_retry=lambda: resets.append(1), cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and rank_signal(proc) == 9
    assert resets == []
