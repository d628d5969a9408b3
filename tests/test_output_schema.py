"""One schema for what runs write and what `owai report` reads: Markdown tables whose cells hold a
`|` keep their columns, a sweep's table shows the thesis's claim beside its number as a run's does,
`owai sweep --json` prints what `owai report SWEEP_DIR --json` prints, a study's report carries
its study table, and every JSON owai writes (files, metrics.jsonl, --json) is strict JSON."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import TINY_MOONS, as_sets, cli_in_process


def _strict(text: str) -> object:
    """`text` parsed as strict JSON: NaN / Infinity (which Python writes and reads) refused."""
    def refuse(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def _columns(line: str) -> int:
    """The cells of one Markdown table row (an escaped `\\|` is inside a cell)."""
    return len(re.findall(r"(?<!\\)\|", line.strip())) - 1


def _tables(markdown: str) -> list[list[str]]:
    """The Markdown tables in `markdown`: each a run of consecutive lines that start with `|`."""
    tables: list[list[str]] = []
    previous = False
    for line in markdown.splitlines():
        row = line.startswith("|")
        if row and not previous:
            tables.append([])
        if row:
            tables[-1].append(line)
        previous = row
    return tables


def _fake_run(root: Path, measured: dict[str, float]) -> Path:
    """A finished three-moons run directory (config.yaml + results.json), without training."""
    path = root / "three-moons" / "20260101-000000-abcd"
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"recipe": "three-moons", "preset": "cpu", "params": {}}))
    rows = [{"metric": k, "measured": v, "thesis": None, "thesis_claim": "a | b" if k.endswith("disentanglement") else "",
             "ref": ""} for k, v in measured.items()]
    (path / "results.json").write_text(json.dumps({"recipe": "three-moons", "preset": "cpu", "reproduces": "", "rows": rows}))
    return path


def test_report_markdown_tables_keep_their_columns(tmp_path, capsys):
    """A `close` claim's check reads `|a - b| <= tol`: unescaped, each `|` split its row into more cells."""
    run = _fake_run(tmp_path, {"heads3.val.accurate_from": 173.0, "heads3.disentanglement": 0.5})
    code, out, err = cli_in_process(["report", str(run), "--markdown"], capsys)
    assert code == 0, err
    assert "not: \\|173 - 133.3\\|" in out  # the check, its bars escaped
    tables = _tables(out)
    assert len(tables) == 2  # measured vs thesis, then the claims
    for table in tables:
        assert {_columns(line) for line in table} == {_columns(table[0])}, table


def _summary(claim: str) -> dict:
    metric = {"metric": "acc", "mean": 0.5, "std": 0.1, "n": 2, "values": [0.4, 0.6], "thesis": 0.9,
              "thesis_claim": claim, "ref": "Table 1"}
    only_claim = {**metric, "metric": "curve", "thesis": None, "thesis_claim": "falls | then rises"}
    return {"sweep_dir": "/s", "recipe": "three-moons", "preset": "cpu", "sets": [], "grid": {"train.lr": [0.1]},
            "seeds": [0, 1], "std": "sample", "counts": {"points": 2, "complete": 2},
            "groups": [{"grid": {"train.lr": 0.1}, "label": "train.lr=0.1", "points": 2, "complete": 2, "seeds": [0, 1],
                        "metrics": [metric, only_claim]}],
            "selection": {"metric": "acc", "mode": "max", "per": [], "groups": [
                {"key": {}, "label": "all", "cell": "train.lr=0.1", "grid": {"train.lr": 0.1}, "score": 0.5,
                 "candidates": 1, "metrics": [metric, only_claim]}]},
            "points": []}


def test_a_sweep_table_shows_the_thesis_claim_as_a_run_table_does():
    from rich.console import Console

    from owai import sweep
    from owai.report import _thesis

    summary = _summary("90 % at lr 0.1")
    text = sweep.markdown(summary)
    assert "| train.lr=0.1 | acc | 0.5 ± 0.1 | 2 | 0.9 (90 % at lr 0.1) | Table 1 |" in text
    assert "| curve | 0.5 ± 0.1 | 2 | falls \\| then rises |" in text  # a claim without a number, as a run shows it
    for table in _tables(text):
        assert {_columns(line) for line in table} == {_columns(table[0])}, table
    assert _thesis({"thesis": 0.9, "thesis_claim": "90 % at lr 0.1"}) == "0.9 (90 % at lr 0.1)"  # the run's cell
    console = Console(width=300, record=True)
    console.print(sweep.table(summary))
    shown = console.export_text()
    assert shown.count("0.9 (90 % at lr 0.1)") == 2 and "falls | then rises" in shown  # the grid and the selection


def test_sweep_json_is_what_report_prints_for_the_sweep(tmp_path, capsys):
    out = tmp_path / "runs"
    code, printed, err = cli_in_process(["sweep", "three-moons", *as_sets(TINY_MOONS), "--seeds", "100", "-o", str(out),
                                         "-q", "--json"], capsys)
    assert code == 0, err
    document = _strict(printed)
    (sweep_dir,) = (out / "three-moons").glob("sweep-*")
    code, reported, err = cli_in_process(["report", str(sweep_dir), "--json"], capsys)
    assert code == 0, err
    again = _strict(reported)
    assert set(document) == set(again) and {"claims", "claims_source", "groups", "study"} <= set(document)
    assert document["claims"] == again["claims"] and document["claims_source"] == "summary.json"
    assert document["study"] is None  # a plain sweep has no study


def test_report_of_a_study_carries_its_table(tmp_path, capsys):
    """`owai report STUDY_DIR` names the study's own table (its selection, the thesis beside it),
    prints it after the summary with --markdown, and holds its file with --json."""
    path = tmp_path / "table2.4-coloredmnist" / "sweep-1"
    path.mkdir(parents=True)
    (path / "sweep.json").write_text(json.dumps({"kind": "owai-sweep", "version": 1, "recipe": "table2.4-coloredmnist",
                                                 "recipe_source": "", "preset": "cpu", "sets": [], "grid": {}, "seeds": [0],
                                                 "points": []}))
    rows = [{"dataset": "coloredmnist", "method": "irm", "init": "rand", "metric": "irm.rand.worst_test_acc", "mean": 0.5,
             "std": 0.0, "n": 1, "thesis": 0.54}]
    (path / "bonsai.json").write_text(json.dumps({"recipe": "table2.4-coloredmnist", "preset": "cpu", "title": "t",
                                                  "sweep_dir": str(path), "rows": rows, "claims": []}))
    (path / "bonsai.md").write_text("# the study\n\n| method | irm |\n|---|---|\n| rand | 50.0 (54.0) |\n")
    code, out, err = cli_in_process(["report", str(path), "--json"], capsys)
    assert code == 0, err
    report = _strict(out)
    assert report["study"]["rows"] == rows and report["claims_source"] == "bonsai.json"
    code, out, err = cli_in_process(["report", str(path), "--markdown"], capsys)
    assert code == 0 and "| rand | 50.0 (54.0) |" in out, err
    code, out, err = cli_in_process(["report", str(path)], capsys)
    assert code == 0 and f"study table: {path / 'bonsai.md'}" in out, err
    (path / "bonsai.md").write_bytes(b"| \xff |\n")  # damaged: one error line, not an internal error
    code, out, err = cli_in_process(["report", str(path), "--markdown"], capsys)
    assert code == 2 and not out and err.strip().splitlines() == [f"error: {path / 'bonsai.md'}: not UTF-8 text (wrong file format?)"], err


def test_json_that_owai_writes_is_strict(tmp_path, capsys):
    """NaN and infinities are not JSON: owai writes them as null in its files, metrics lines and --json."""
    from owai import console
    from owai.io import atomic_write_json
    from owai.runs import Run

    atomic_write_json(tmp_path / "a.json", {"x": math.nan, "y": [1.0, math.inf], "z": np.float32("nan"),
                                            "w": np.array([0.5, -np.inf]), "ok": np.int64(3)})
    assert _strict((tmp_path / "a.json").read_text()) == {"x": None, "y": [1.0, None], "z": None, "w": [0.5, None], "ok": 3}
    run = Run(tmp_path)
    run.log("eval", 2, acc=math.nan, loss=0.25)
    assert [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"stage": "eval", "step": 2, "acc": None, "loss": 0.25}]
    console.emit_json({"mean": -math.inf, "n": 2})
    assert _strict(capsys.readouterr().out) == {"mean": None, "n": 2}


def _scalars(run: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def _measured_numbers(run: Path) -> dict[str, float]:
    rows = json.loads((run / "results.json").read_text())["rows"]
    return {r["metric"]: float(r["measured"]) for r in rows
            if isinstance(r["measured"], (int, float)) and not isinstance(r["measured"], bool)}


def test_a_tracker_mirrors_the_results_beside_the_metrics_lines(tmp_path, capsys):
    """The tracker holds results.json's measured numbers too ("results/<metric>" at step 0)."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "runs"
    code, _, err = cli_in_process(["moons", "-q", "-o", str(out), "--tracker", "tensorboard", *as_sets(TINY_MOONS)], capsys)
    assert code == 0, err
    (run,) = (out / "three-moons").iterdir()
    scalars = _scalars(run)
    numbers = _measured_numbers(run)
    assert numbers
    for metric, value in numbers.items():
        assert scalars[f"results/{metric}"] == {0: pytest.approx(value, rel=1e-6)}


@pytest.mark.slow
def test_an_evaluation_with_a_tracker_mirrors_its_results(tmp_path, capsys):
    """`eval ruler --tracker tensorboard` logs no metrics lines: its tracker held nothing before."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "runs"
    code, _, err = cli_in_process(["eval", "ruler", "-q", "-o", str(out), "--tracker", "tensorboard"], capsys)
    assert code == 0, err
    (run,) = (out / "table4.4-ruler").iterdir()
    numbers = _measured_numbers(run)
    assert numbers and set(_scalars(run)) == {f"results/{m}" for m in numbers}


def test_a_resume_rewrites_older_metrics_lines_as_strict_json(tmp_path):
    """metrics.jsonl of a run written before NaN became null holds `NaN`; a resume's trim rewrote
    the lines it keeps as they were read, so the file stayed unreadable to strict readers."""
    from owai.runs import Run

    (tmp_path / "metrics.jsonl").write_text('{"stage": "eval", "step": 1, "acc": NaN}\n{"stage": "eval", "step": 2, "acc": 0.5}\n')
    Run(tmp_path).trim_metrics("eval", 1)
    assert [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"stage": "eval", "step": 1, "acc": None}]
