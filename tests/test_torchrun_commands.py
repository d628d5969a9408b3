"""Each command under `torchrun` (2 gloo ranks on the CPU): the language-model commands run
data-parallel; every other command is refused before any directory exists, and an error that every
rank reaches is one `error:` line (rank 0's), the rank exiting with owai's code, not a gloo abort."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_MOONS, as_sets, cli_in_process, torchrun

NOT_DATA_PARALLEL = "runs in one process, not under torchrun"
SWEEP_REFUSED = "this command runs each run in one process (a sweep's points side by side"


def error_lines(stderr: str) -> list[str]:
    """owai's own error lines among the ranks' output and torchrun's report."""
    return [line for line in stderr.splitlines() if line.startswith(("error:", "internal error:"))]


def root_cause_exitcode(stderr: str) -> int | None:
    """The exit code torchrun reports for the job's first failed rank (negative: a signal)."""
    found = re.search(r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*(-?\d+)", stderr, re.S)
    return int(found.group(1)) if found else None


def owai_torchrun(tmp_path: Path, args: list[str]) -> tuple[int, str]:
    out = tmp_path / "runs"
    proc = torchrun(2, ["-m", "owai", *args, "-o", str(out)], cwd=tmp_path, timeout=300,
                    before_retry=lambda: shutil.rmtree(out, ignore_errors=True))
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["moons", *as_sets(TINY_MOONS)], NOT_DATA_PARALLEL),  # it used to run on both ranks, every rank repeating it
    (["sweep", "three-moons", "--seeds", "1,2", *as_sets(TINY_MOONS)], SWEEP_REFUSED),  # two sweep directories
    (["rich-features", "--stage", "probe", "-p", "tiny", "--seeds", "0,1"], SWEEP_REFUSED),  # both ranks wrote one feature store
])
def test_a_command_that_is_not_data_parallel_is_refused_once(args: list[str], message: str, tmp_path: Path):
    code, stderr = owai_torchrun(tmp_path, args)
    assert code != 0
    lines = error_lines(stderr)
    assert len(lines) == 1 and message in lines[0], stderr[-3000:]
    assert root_cause_exitcode(stderr) == 2, stderr[-3000:]  # rank 0 said it and exited first, with owai's code
    assert not (tmp_path / "runs").exists()


def test_bad_input_of_a_data_parallel_run_is_one_line_and_a_clean_exit(tmp_path: Path):
    """Checked by rank 0 after the ranks joined their process group, then broadcast: every rank
    raises it. Rank 0 ends with exit code 2 (its shutdown beside a live peer used to abort in gloo
    about one time in two); the other rank, stopped by torchrun, prints nothing."""
    code, stderr = owai_torchrun(tmp_path, ["mosaic-train", "--set", "data.source=owai-stories:1500", "--set", "train.lr=-1"])
    assert code != 0
    assert error_lines(stderr) == ["error: params.train.lr must be > 0, got -1.0"], stderr[-3000:]
    assert root_cause_exitcode(stderr) == 2 and "terminate called" not in stderr, stderr[-3000:]
    assert not (tmp_path / "runs").exists()


@pytest.fixture
def rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as rank 0 of a 2-process torchrun job (the process group not joined yet)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")


@pytest.mark.parametrize("args, message", [
    (["bonsai", "--study", "-p", "tiny"], SWEEP_REFUSED),
    (["dropout-ft", "-p", "tiny"], SWEEP_REFUSED),
    (["eval", "regbench", "--model", "ngram"], SWEEP_REFUSED),
    (["rich-features", "--stage", "pretrain", "-p", "tiny"], SWEEP_REFUSED),
    (["bonsai", "-p", "tiny"], SWEEP_REFUSED),
    (["moons", "linear"], "`owai moons linear` " + NOT_DATA_PARALLEL),
    (["recipes", "run", "three-moons"], NOT_DATA_PARALLEL),
    (["data", "stats"], "`owai data stats` " + NOT_DATA_PARALLEL),
])
def test_every_other_command_refuses_torchrun_before_any_directory(rank: None, args: list[str], message: str,
                                                                  tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    code, _, err = cli_in_process([*args, "-o", str(tmp_path / "runs")], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


def test_a_resumed_run_of_a_one_process_method_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch):
    code, _, err = cli_in_process(["moons", "-q", "-o", str(tmp_path), *as_sets(TINY_MOONS)], capsys)
    assert code == 0, err
    (run_dir,) = (tmp_path / "three-moons").iterdir()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, _, err = cli_in_process(["moons", "--resume", str(run_dir)], capsys)
    assert code == 2 and "`owai moons three-moons` " + NOT_DATA_PARALLEL in err, err


def test_the_dry_run_plan_is_printed_by_rank_0_alone(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    import owai.methods.language_model as lm

    monkeypatch.setattr(lm, "dry_run_plan", lambda cfg: {"models": [], "missing": None, "lines": ["the plan"]})
    monkeypatch.setenv("WORLD_SIZE", "2")
    printed = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        code, out, err = cli_in_process(["mosaic-train", "--size", "tiny", "--dry-run"], capsys)
        assert code == 0, err
        printed[rank] = out
    assert printed == {"0": "the plan\n", "1": ""}


def test_only_another_rank_waits_before_printing_an_error(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]):
    """When rank 0 fails too, torchrun stops the others while they wait: one line for the job. Each
    rank on its own: rank 0 prints at once, rank 1 waits OTHER_RANK_ERROR_DELAY_S first (counting the
    two ranks' waits together could not tell which one waited)."""
    import owai.cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, waits in (("0", 0), ("1", 1)):
        slept: list[float] = []
        monkeypatch.setattr(owai.cli.time, "sleep", slept.append)
        monkeypatch.setenv("RANK", rank)
        code, _, err = cli_in_process(["recipes", "show", "fig9.9"], capsys)
        assert code == 2 and err.startswith("error:" if rank == "0" else "error: rank 1: "), err
        assert slept == [owai.cli.OTHER_RANK_ERROR_DELAY_S] * waits


def test_python_m_owai_cli_runs_the_command():
    """`torchrun -m owai.cli ...` (like `python -m owai.cli`) ran nothing and exited 0: the module had no main guard."""
    proc = subprocess.run([sys.executable, "-m", "owai.cli", "moons", "--bogus"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: No such option: --bogus"), proc.stderr


@pytest.mark.slow  # two torchrun jobs (a minute); `pytest -m slow`
def test_ruler_and_icl_share_their_prompts_out_over_the_ranks_to_one_process_results(
        shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """`owai eval ruler|icl` under torchrun: the batches go to the ranks in turn, rank 0 logs every
    answer in the one answers.jsonl and writes the one run directory, and the results are one
    process's. A run killed in one process resumes on two ranks to the same results."""
    import json

    from owai.evals import ruler
    from owai.evals.answers import AnswerLog

    commands = {
        "table4.4-ruler": ["eval", "ruler", "-q", "--model", "reference:oracle", "--tasks", "niah_single_1,vt",
                           "--ctx", "1024", "--samples", "5"],
        "fig4.6-icl": ["eval", "icl", "-q", "--model", "reference:knn", "--task", "synthetic", "--shots", "1,2",
                       "--queries", "3", "--labels", "semantic", "--set", "synthetic_classes=4"],
    }
    for recipe, args in commands.items():
        code, _, err = cli_in_process([*args, "-o", str(tmp_path / "one")], capsys)
        assert code == 0, err
        (one,) = (tmp_path / "one" / recipe).iterdir()
        code, stderr = owai_torchrun(tmp_path, args)
        assert code == 0, stderr[-3000:]
        (two,) = (tmp_path / "runs" / recipe).iterdir()
        for name in ("results.json",):
            a, b = (json.loads((d / name).read_text()) for d in (one, two))
            assert a["rows"] == b["rows"] and a["details"] == b["details"], recipe
        assert sorted(p.name for p in two.glob("answers*")) == ["answers.jsonl"]
        assert dict(AnswerLog(one / "answers.jsonl")._answers) == dict(AnswerLog(two / "answers.jsonl")._answers)

    # killed at its 7th answer in one process, resumed on two ranks
    real, calls = ruler.OracleReader.generate, []

    def generate(self, prompt, max_new_tokens=32):
        if len(calls) == 6:
            raise KeyboardInterrupt
        calls.append(prompt)
        return real(self, prompt, max_new_tokens)

    monkeypatch.setattr(ruler.OracleReader, "generate", generate)
    code, _, err = cli_in_process([*commands["table4.4-ruler"], "-o", str(tmp_path / "killed")], capsys)
    assert code == 130, err
    (killed,) = (tmp_path / "killed" / "table4.4-ruler").iterdir()
    assert len(AnswerLog(killed / "answers.jsonl")) == 6 + 1  # and the first task's finished cell
    proc = torchrun(2, ["-m", "owai", "eval", "ruler", "-q", "--resume", str(killed)], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (one,) = (tmp_path / "one" / "table4.4-ruler").iterdir()
    a, b = (json.loads((d / "results.json").read_text()) for d in (one, killed))
    assert a["rows"] == b["rows"] and a["details"] == b["details"]
    assert len(AnswerLog(killed / "answers.jsonl")) == 10 + 2 and not list(killed.glob("answers.rank*"))
