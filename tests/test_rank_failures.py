"""When one rank of a torchrun job fails, the run says which rank and its error: the rank writes its
own error.rankR.json, rank 0 folds the earliest into status.json when it stops (a lost peer or
torchrun's SIGTERM is a symptom, never the cause), `owai report` reads both, a resume clears them,
and torchrun's closing report names the rank's error line. The mechanism in one process here; the
real 2-rank gloo jobs (rank 1 raising, rank 1 killed by SIGKILL) are marked slow."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import TINY_MOONS, as_sets, cli_in_process, rank_signal, run_owai, torchrun
from owai import distributed
from owai.errors import Terminated, stop_on_termination, termination_deferred
from owai.runs import NO_RANK_ERROR, Run

# What rank 0 sees on gloo (torch 2.13) when its peer's process ends: a plain RuntimeError
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:38051. This is typically caused by a remote worker crashing. Check the logs of the remote "
               "worker before reporting an error. GLHF!")
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:32684: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application.")


def other_rank(path: Path) -> Run:
    run = Run(path)
    run.writes = False  # as experiment sets it on every rank but 0
    return run


@pytest.mark.parametrize("symptom, rank0_error", [
    (RuntimeError(GLOO_CLOSED), f"RuntimeError: {GLOO_CLOSED}"),  # gloo: the peer's process ended
    (Terminated(signal.SIGTERM), "stopped by SIGTERM"),  # NCCL: waiting in a collective until torchrun's SIGTERM
])
def test_rank_0_names_the_rank_whose_error_stopped_the_job(tmp_path: Path, symptom: BaseException, rank0_error: str):
    assert other_rank(tmp_path).record_failure(ValueError("bad batch\nof rows 3-5"), rank=1, world_size=2) is None
    record = json.loads((tmp_path / "error.rank1.json").read_text())
    assert (record["rank"], record["type"], record["error"]) == (1, "ValueError", "ValueError: bad batch")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.rank1.json"]  # status.json is rank 0's alone

    rank0 = Run(tmp_path)
    cause = rank0.record_failure(symptom, rank=0, world_size=2)
    status = rank0.status_info()
    assert {k: status.get(k) for k in ("status", "rank", "error", "rank0_error")} == {
        "status": "failed", "rank": 1, "error": "ValueError: bad batch", "rank0_error": rank0_error}
    assert rank0.failure() == "rank 1: ValueError: bad batch"
    # the gloo symptom, and torchrun's SIGTERM after rank 1 recorded its error, become rank 0's own
    # error line (PeerFailed) naming rank 1, not "stopped by SIGTERM"
    assert cause == "rank 1 failed: ValueError: bad batch"


@pytest.mark.parametrize("error", [RuntimeError(GLOO_CLOSED), RuntimeError(GLOO_RESET),
                                   dist.DistBackendError("NCCL communicator was aborted on rank 2"),
                                   Terminated(signal.SIGTERM), KeyboardInterrupt()])
def test_another_rank_records_only_an_error_of_its_own(tmp_path: Path, error: BaseException):
    """A lost peer or a stop is what every other rank sees of the one that failed: 63 such files
    beside the cause would bury it."""
    other_rank(tmp_path).record_failure(error, rank=2, world_size=4)
    assert list(tmp_path.iterdir()) == []


def test_a_lost_peer_that_recorded_nothing_is_not_taken_for_the_cause(tmp_path: Path):
    """Rank 1 killed by SIGKILL (the out-of-memory killer) writes nothing: rank 0 does not give its
    closed connection as the cause, and a stop before it learnt anything stays `interrupted`."""
    run = Run(tmp_path)
    assert run.record_failure(RuntimeError(GLOO_RESET), rank=0, world_size=2) == NO_RANK_ERROR
    status = run.status_info()
    assert status["status"] == "failed" and status["error"] == NO_RANK_ERROR and "rank" not in status
    assert status["rank0_error"] == f"RuntimeError: {GLOO_RESET}"
    assert run.failure() == NO_RANK_ERROR
    run.record_failure(Terminated(signal.SIGTERM), rank=0, world_size=2)
    assert {k: run.status_info().get(k) for k in ("status", "signal", "error")} == {"status": "interrupted", "signal": "SIGTERM", "error": None}
    assert run.failure() == "stopped by SIGTERM"


def test_ranks_that_waited_on_each_other_until_the_timeout_are_not_said_to_have_stopped(tmp_path: Path):
    """A hang (ranks in different collectives, each waiting until the timeout) reaches rank 0 as a lost
    peer with no rank file, as a killed rank does: status.json says a rank may have hung, not only that
    one was killed, and keeps the timeout under rank0_error."""
    timeout = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
               "1800000ms for recv operation to complete")
    run = Run(tmp_path)
    assert run.record_failure(RuntimeError(timeout), rank=0, world_size=2) == NO_RANK_ERROR
    status = run.status_info()
    assert "hung" in status["error"] and status["rank0_error"] == f"RuntimeError: {timeout}"
    assert run.failure() == NO_RANK_ERROR  # whole: one line under the report's limit


def test_rank_0s_own_error_is_its_own(tmp_path: Path):
    """Rank 0's own error (every rank's non-finite loss, a checkpoint it cannot write) stays the cause,
    with its rank, even beside another rank's file; one process records no rank."""
    other_rank(tmp_path).record_failure(ValueError("the same step"), rank=1, world_size=2)
    run = Run(tmp_path)
    assert run.record_failure(OSError("disk full"), rank=0, world_size=2) is None
    assert run.failure() == "rank 0: OSError: disk full"
    alone = Run(tmp_path / "alone")
    alone.path.mkdir()
    alone.record_failure(ValueError("one\nprocess"), rank=0, world_size=1)
    assert "rank" not in alone.status_info() and alone.failure() == "ValueError: one"


def test_a_ctrl_c_on_rank_0_stays_an_interruption_beside_another_ranks_error(tmp_path: Path):
    """Ctrl-C is the user's stop, not a symptom of rank 1's failure: no cause line for rank 0 to raise in
    its place (a stop signal's is tested above), while status.json still names rank 1's error."""
    other_rank(tmp_path).record_failure(ValueError("bad batch"), rank=1, world_size=2)
    run = Run(tmp_path)
    assert run.record_failure(KeyboardInterrupt(), rank=0, world_size=2) is None
    assert run.failure() == "rank 1: ValueError: bad batch"


def test_the_earliest_rank_error_is_the_cause_and_damaged_files_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Several ranks recorded errors: the earliest by its clock is the cause, whatever the ranks' order;
    files without a rank and error, or not JSON, are left out; rank 0 looks each rank's file up by name,
    since a network filesystem's listing can lag behind a file another host has just written."""
    for rank, error, when in ((1, "second", 200.0), (2, "first", 100.0)):
        other_rank(tmp_path).record_failure(ValueError(error), rank=rank, world_size=5)
        path = tmp_path / f"error.rank{rank}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "timestamp": when}))
    (tmp_path / "error.rank3.json").write_text(json.dumps({"error": "no rank"}))
    (tmp_path / "error.rank4.json").write_text('{"rank": 4, "error"')
    run = Run(tmp_path)
    assert [r["rank"] for r in run.rank_errors(5)] == [2, 1]
    assert run.failure() == "rank 2: ValueError: first"
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter(()))  # the listing has none of them yet
    assert run.record_failure(RuntimeError(GLOO_CLOSED), rank=0, world_size=5) == "rank 2 failed: ValueError: first"


def test_a_rank_error_written_after_rank_0_lost_it_is_the_cause(tmp_path: Path):
    """Rank 0 lost its peer before rank 1's file was there (status: NO_RANK_ERROR): `owai report` names
    rank 1's error once it is."""
    run = Run(tmp_path)
    assert run.record_failure(RuntimeError(GLOO_RESET), rank=0, world_size=2) == NO_RANK_ERROR
    other_rank(tmp_path).record_failure(ValueError("late"), rank=1, world_size=2)
    assert run.failure() == "rank 1: ValueError: late"


def test_a_stop_signal_waits_until_the_status_is_written():
    """torchrun's SIGTERM while rank 0 writes why the run failed: the write ends, then the stop."""
    before = signal.getsignal(signal.SIGTERM)
    done = []
    with stop_on_termination() as seen:
        with pytest.raises(Terminated):
            with termination_deferred():
                signal.raise_signal(signal.SIGTERM)
                done.append("written")
    assert done == ["written"] and seen.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_stop_while_the_deferral_is_set_up_leaves_no_signal_held(monkeypatch: pytest.MonkeyPatch):
    """A SIGHUP whose handler raises (a `Terminated`) after SIGTERM's deferral is installed but before
    SIGHUP's: SIGTERM's own handler is put back, not left holding every later SIGTERM."""
    import owai.errors

    before = signal.getsignal(signal.SIGTERM)
    install = signal.signal

    def interrupted(sig, handler):
        if sig == signal.SIGHUP:
            raise Terminated(signal.SIGHUP)
        return install(sig, handler)

    # under nohup SIGHUP is ignored, and the blocks leave an ignored signal alone (no handler installed)
    hangup = install(signal.SIGHUP, signal.SIG_DFL)
    try:
        monkeypatch.setattr(owai.errors.signal, "signal", interrupted)
        for block in (termination_deferred, stop_on_termination):
            with pytest.raises(Terminated):
                with block():
                    pass
            assert signal.getsignal(signal.SIGTERM) is before, block.__name__
        monkeypatch.undo()
    finally:
        install(signal.SIGHUP, hangup)


@pytest.fixture
def stopped_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Path:
    """A three-moons run directory (no training: its method fails at once), left as a torchrun job
    leaves it when rank 0 is killed before it writes (NCCL, SIGKILL after torchrun's SIGTERM): status
    `running`, and rank 1's own error in error.rank1.json."""
    def fails(self, cfg, run):
        raise ValueError("first attempt")

    monkeypatch.setattr("owai.methods.three_moons.ThreeMoons.run", fails)
    code, _, err = cli_in_process(["moons", "-q", "-o", str(tmp_path), *as_sets(TINY_MOONS)], capsys)
    assert code == 1 and err.startswith("internal error: ValueError: first attempt"), err
    (path,) = tmp_path.glob("three-moons/*")
    Run(path).set_status("running")
    other_rank(path).record_failure(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), rank=1, world_size=8)
    return path


def test_report_and_resume_of_a_run_whose_rank_failed(stopped_run: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]):
    code, out, err = cli_in_process(["report", str(stopped_run)], capsys)
    assert code == 2 and not out
    assert err.startswith(f"error: {stopped_run} has no results.json yet (status: running; rank 1: RuntimeError: CUDA out of memory."), err

    seen = {}

    def resumed(self, cfg, run):
        seen.update(files=sorted(p.name for p in run.path.glob("error.rank*")), status=run.status())
        raise ValueError("second attempt")

    monkeypatch.setattr("owai.methods.three_moons.ThreeMoons.run", resumed)
    code, _, err = cli_in_process(["moons", "-q", "--resume", str(stopped_run)], capsys)
    assert code == 1 and seen == {"files": [], "status": "running"}, err  # the stopped attempt's error is gone
    code, _, err = cli_in_process(["report", str(stopped_run)], capsys)
    assert "(status: failed; ValueError: second attempt)" in err and "rank 1" not in err, err


def test_a_folder_where_a_rank_error_belongs_is_refused_before_the_resume_writes(stopped_run: Path,
                                                                                 capsys: pytest.CaptureFixture[str]):
    (stopped_run / "error.rank1.json").unlink()
    (stopped_run / "error.rank3.json").mkdir()
    code, _, err = cli_in_process(["moons", "-q", "--resume", str(stopped_run)], capsys)
    assert code == 2 and err.strip() == f"error: {stopped_run / 'error.rank3.json'} is a folder, not a file: the run directory is damaged", err


def test_torchrun_is_given_the_ranks_own_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]):
    """Rank 1's one `error:` line names its rank (the ranks' lines are interleaved), and torchrun's
    closing report, which reads TORCHELASTIC_ERROR_FILE as torch.distributed.elastic's `record` writes
    it, shows that line instead of "To enable traceback see ..."; never a lost peer, a symptom that
    would take the root cause's place."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    import owai.cli

    class Stopped(BaseException):
        """torchrun's SIGTERM, which ends a rank while it waits before printing (rank 0 failed too)."""

    def stopped(seconds: float) -> None:
        raise Stopped

    error_file = tmp_path / "attempt_0" / "1" / "error.json"
    error_file.parent.mkdir(parents=True)
    monkeypatch.setattr(owai.cli.time, "sleep", stopped)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(Stopped):  # an error every rank reaches is rank 0's: this rank gave torchrun nothing
        cli_in_process(["recipes", "show", "fig9.9"], capsys)
    assert not error_file.exists() and capsys.readouterr().err == ""

    monkeypatch.setattr(owai.cli.time, "sleep", lambda seconds: None)
    code, _, err = cli_in_process(["recipes", "show", "fig9.9"], capsys)
    assert code == 2 and err.startswith("error: rank 1: unknown recipe 'fig9.9'") and len(err.strip().splitlines()) == 1, err
    message = err.strip()[len("error: rank 1: "):]
    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=2, error_file=str(error_file))
    assert failure.message["message"] == message
    assert f"traceback : {message}" in ChildFailedError("owai", {1: failure}).format_msg()

    error_file.unlink()
    owai.cli._for_torchrun(f"RuntimeError: {GLOO_CLOSED}", RuntimeError(GLOO_CLOSED))
    assert not error_file.exists()
    assert distributed.lost_peer(RuntimeError(GLOO_CLOSED)) and not distributed.lost_peer(RuntimeError("CUDA out of memory"))


# -- the real thing: 2 gloo ranks of `owai mosaic-train` --------------------------------------------

TINY_LM = ["data.source=owai-stories:1500", "data.tokenizer=bpe-512", "data.block_size=32", "model.n_layer=1",
           "model.n_embd=32", "model.n_head=2", "archs=[gpt]", "train.steps=6", "train.batch_size=2",
           "train.checkpoint_every=2", "eval.continuations=false"]

# torchrun's entry point: owai's CLI, rank 1 failing when it draws update 2's batch
JOB = '''import os, signal, sys
import owai.methods.language_model as lm
from owai.cli import main

mode = sys.argv.pop(1)
drawn = lm.global_batch


def global_batch(windows, cfg, step, micro, device):
    if os.environ["RANK"] == "1" and step == 2:
        if mode == "kill":  # as the out-of-memory killer does
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"bad batch at step {step}")
    return drawn(windows, cfg, step, micro, device)


lm.global_batch = global_batch
main()
'''


def failing_job(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the job under `torchrun --nproc_per_node 2`; (the finished job, its run directory)."""
    job, out = tmp_path / "job.py", tmp_path / "runs"
    job.write_text(JOB)
    proc = torchrun(2, [str(job), mode, "mosaic-train", "-q", "-o", str(out), *as_sets(TINY_LM)], cwd=tmp_path,
                    timeout=300, before_retry=lambda: shutil.rmtree(out, ignore_errors=True))
    assert proc.returncode != 0, proc.stderr[-3000:]
    (run,) = out.glob("*/*")
    return proc, run


def owai_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(("error:", "internal error:"))]


@pytest.mark.slow  # two torchrun jobs' start, rank 1's 5 s before it prints: about 20 s each on 2 cores
def test_a_rank_that_raises_is_named_in_status_and_report(tmp_path: Path):
    proc, run = failing_job(tmp_path, "raise")
    stderr = proc.stderr
    lines = owai_lines(stderr)
    assert "internal error: rank 1: ValueError: bad batch at step 2 (set OWAI_DEBUG=1 for the traceback)" in lines, stderr[-3000:]
    # rank 0: what stopped the job, not gloo's closed connection; or torchrun's SIGTERM, if that came first
    assert len(lines) == 2 and lines[-1] in ("error: rank 1 failed: ValueError: bad batch at step 2; rank 0 lost contact with it",
                                             "error: rank 1 failed: ValueError: bad batch at step 2; rank 0 was stopped by SIGTERM",
                                             "error: stopped by SIGTERM"), stderr[-3000:]  # the last: SIGTERM outside the run
    assert "[rank1]:" not in stderr and "[rank0]:" not in stderr  # no rank's traceback (torch prefixes them so)
    assert "traceback : ValueError: bad batch at step 2" in stderr.split("Root Cause")[-1]  # torchrun's report
    status = json.loads((run / "status.json").read_text())
    assert (status["status"], status["rank"], status["error"]) == ("failed", 1, "ValueError: bad batch at step 2"), status
    assert json.loads((run / "error.rank1.json").read_text())["type"] == "ValueError"
    report = run_owai("report", str(run))
    assert report.returncode == 2 and "(status: failed; rank 1: ValueError: bad batch at step 2)" in report.stderr, report.stderr


@pytest.mark.slow
def test_a_rank_killed_by_sigkill_leaves_no_false_cause(tmp_path: Path):
    """A rank killed by SIGKILL writes nothing: status.json says no rank recorded an error (or that
    torchrun's SIGTERM stopped rank 0), never rank 0's closed connection as the cause; torchrun's
    report names the rank and its signal."""
    proc, run = failing_job(tmp_path, "kill")
    stderr = proc.stderr
    assert rank_signal(proc) == 9, stderr[-3000:]  # torchrun's root cause: the killed rank
    status = json.loads((run / "status.json").read_text())
    assert (status["status"], status.get("error")) in (("failed", NO_RANK_ERROR), ("interrupted", None)), status
    assert "rank" not in status and not list(run.glob("error.rank*"))
    assert owai_lines(stderr) in ([f"error: {NO_RANK_ERROR}; rank 0 lost contact with it"], ["error: stopped by SIGTERM"]), stderr[-3000:]
