"""Issue #40's output and resume rules: `--quiet` prints nothing on success (the libraries' bars,
notices and warnings included); info lines and progress go to stderr, stdout carries the result;
mosaic-train's evaluation phase shows progress and logs no `past_key_values` deprecation; `eval
ruler` and `eval harness` resume a killed run to the results of an uninterrupted one."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest

from conftest import as_if_killed, as_sets, cli_in_process, run_owai, save_tiny_gpt2

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> Path:
    return save_tiny_gpt2(tmp_path_factory.mktemp("tiny-lm"))


def test_eval_icl_quiet_prints_nothing_on_success(tiny_lm, tmp_path) -> None:
    """Without the quiet libraries this printed transformers' "Loading weights" bar."""
    proc = run_owai("eval", "icl", "--quiet", "--model", str(tiny_lm), "--task", "synthetic", "--shots", "1",
                    "--n", "5", "--set", "synthetic_classes=4", "--set", "max_new_tokens=4", "--labels", "semantic",
                    "-o", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
    assert len(list((tmp_path / "fig4.6-icl").glob("*/results.json"))) == 1


def test_eval_harness_quiet_prints_nothing_outside_a_git_repository(tmp_path, monkeypatch) -> None:
    """The harness records the working directory's git commit with `git describe`, whose "fatal: not
    a git repository" reached the terminal under --quiet wherever a user runs owai outside one."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above the run's folder either
    proc = run_owai("eval", "harness", "--quiet", "--model", "reference:oracle", "--tasks", "owai_mc_smoke",
                    "--limit", "2", "-o", str(tmp_path / "runs"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


def test_quiet_silences_the_libraries_and_the_next_mode_restores_them(capsys) -> None:
    import tqdm

    from owai import console

    logger = logging.getLogger("some.library")
    try:
        console.configure(quiet=True)
        with warnings.catch_warnings(record=True) as caught:  # the filters that quiet set are inherited
            warnings.warn("library noise", FutureWarning)
        assert not caught
        assert not logger.isEnabledFor(logging.WARNING) and logger.isEnabledFor(logging.ERROR)
        assert tqdm.tqdm(range(3), disable=False).disable  # every bar, even one that asks to be shown
        assert tqdm.tqdm(range(3), "bar", 3, True, None, None, 0.1, 10.0, None, None, False).disable  # positionally
        console.info("an info line")
    finally:
        console.configure()
    assert logger.isEnabledFor(logging.WARNING)
    assert not tqdm.tqdm(range(3), disable=False).disable
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("library noise", FutureWarning)
    assert len(caught) == 1
    console.info("an info line")
    out, err = capsys.readouterr()
    assert out == "" and err.count("an info line") == 1  # info goes to stderr, and not under --quiet


def test_an_in_process_command_gives_back_the_callers_output_mode(tiny_moons, tmp_path, capsys) -> None:
    """`owai.cli.main([... "--quiet"])` from a notebook or a test left the process quiet (and its
    libraries silenced) for whatever it ran next; main now puts back the mode it was called in."""
    import tqdm

    from owai import console
    from owai.cli import main

    for args in (["moons", *as_sets(tiny_moons), "--quiet", "-o", str(tmp_path / "ok")],
                 ["moons", "--quiet", "--json", "--set", "no.such.key=1", "-o", str(tmp_path / "bad")]):
        try:
            main(args)
        except SystemExit:
            pass
        assert not console.state.quiet and not console.state.json, args
        assert not tqdm.tqdm(range(3), disable=False).disable
        assert logging.getLogger("some.library").isEnabledFor(logging.WARNING)
    capsys.readouterr()


def test_mosaic_train_evaluation_shows_progress_on_stderr_and_no_deprecation(tmp_path, monkeypatch) -> None:
    """The final evaluation (validation and per-position losses, continuations with generate) of
    both chapter-4 models, not quiet: a progress line per batch (OWAI_PROGRESS_SECONDS=0) that
    reaches 100%, info lines on stderr, the results table alone on stdout, and no
    "`past_key_values` ... deprecated" from transformers."""
    from test_chapter4_training import TINY_V2, corpus

    text = corpus(tmp_path / "docs.jsonl", docs=60)
    sets = [s for s in TINY_V2 if not s.startswith(("eval.continuations", "eval.lengths", "eval.without"))]
    sets += ["eval.continuations=true", "eval.max_new_tokens=3", "eval.lengths=[64]", "train.steps=4",
             "train.eval_every=4", "train.checkpoint_every=4"]
    monkeypatch.setenv("OWAI_PROGRESS_SECONDS", "0")
    proc = run_owai("mosaic-train", "-r", "table4.2-pretrain", "-o", str(tmp_path / "runs"), "--dataset", str(text),
                    *[a for s in sets for a in ("--set", s)])
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout + proc.stderr
    assert "deprecated" not in said.lower(), said
    for arch in ("mmv2", "transformer"):
        lines = [line for line in proc.stderr.splitlines() if line.startswith(f"evaluate {arch}: ")]
        assert any("continuations" in line for line in lines), proc.stderr
        done, total = lines[-1].split(": ")[1].split(" ")[0].split("/")
        assert done == total and int(total) > 24, lines[-1]  # 24 Eldan & Li prompts and the loss batches
    assert "run directory:" in proc.stderr and "run directory:" not in proc.stdout
    assert "parameters" not in proc.stdout and "results:" in proc.stdout


def _results(out: Path, recipe: str) -> tuple[Path, dict]:
    run_dir = next((out / recipe).iterdir())
    return run_dir, json.loads((run_dir / "results.json").read_text())


# what the harness records about when it ran
CLOCK = ("date", "start_time", "end_time", "total_evaluation_time_seconds")


def _same_results(whole: dict, resumed: dict) -> None:
    assert resumed["rows"] == whole["rows"]
    assert {k: v for k, v in resumed["details"].items() if k not in CLOCK} == \
        {k: v for k, v in whole["details"].items() if k not in CLOCK}


def test_eval_ruler_resumes_a_killed_run_to_the_same_results(shared_data, tmp_path, capsys) -> None:
    args = ["eval", "ruler", "-q", "--model", "reference:oracle", "--tasks", "qa_1,qa_2,niah_single_1", "--ctx", "1k",
            "--n", "3", "--set", "squad=synthetic", "--set", "hotpotqa=synthetic", "-o", str(tmp_path)]
    rc, _, err = cli_in_process(args, capsys)
    assert rc == 0, err
    run_dir, whole = _results(tmp_path, "table4.4-ruler")
    rc, _, err = cli_in_process(["eval", "ruler", "-q", "--resume", str(run_dir), "--n", "4"], capsys)
    assert rc == 2 and "drop the other options" in err and len(err.strip().splitlines()) == 1
    as_if_killed(run_dir)
    rc, _, err = cli_in_process(["eval", "ruler", "-q", "--resume", str(run_dir)], capsys)
    assert rc == 0, err
    _, resumed = _results(tmp_path, "table4.4-ruler")
    _same_results(whole, resumed)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "complete"
    rc, out, err = cli_in_process(["eval", "icl", "--resume", str(run_dir)], capsys)  # another command's run
    assert rc == 2 and "owai recipes run table4.4-ruler --resume" in err


@pytest.mark.slow  # a full end-to-end path (tens of seconds); `pytest -m slow`
def test_eval_harness_resumes_a_killed_run_to_the_same_results(tiny_lm, tmp_path, capsys, monkeypatch) -> None:
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, _, err = cli_in_process(["eval", "harness", "-q", "--model", str(tiny_lm), "--tasks", "owai_mc_smoke,owai_gen_smoke",
                                 "--limit", "4", "-o", str(tmp_path)], capsys)
    assert rc == 0, err
    run_dir, whole = _results(tmp_path, "table4.1-harness")
    as_if_killed(run_dir)
    rc, _, err = cli_in_process(["eval", "harness", "-q", "--resume", str(run_dir)], capsys)
    assert rc == 0, err
    _, resumed = _results(tmp_path, "table4.1-harness")
    _same_results(whole, resumed)
    assert resumed["details"]["results"]["owai_mc_smoke"]["sample_len"] == 4


@pytest.mark.parametrize("command", [["eval", "ruler"], ["eval", "harness"], ["eval", "icl"], ["eval", "posloss"]])
def test_evaluation_help_shows_evaluation_settings_and_resume(command, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one help line per option
    code, stdout, _ = cli_in_process([*command, "--help"], capsys)
    assert code == 0
    assert "--resume" in stdout and "only for what it had not answered" in stdout
    assert "train.lr" not in stdout and "optimisation" not in stdout  # a training run's --set / --resume help
    assert "--set runtime.device=cpu" in stdout


def test_the_two_tinys_say_which_is_which(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    _, stdout, _ = cli_in_process(["mosaic-train", "--help"], capsys)
    size = next(line for line in stdout.splitlines() if line.lstrip("│ ").startswith("--size"))
    preset = next(line for line in stdout.splitlines() if line.lstrip("│ ").startswith("--preset"))
    assert "model size" in size and "--preset tiny" in size
    assert "run scale" in preset and "--size tiny" in preset
