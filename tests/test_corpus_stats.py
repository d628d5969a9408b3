"""`owai data stats` (method corpus_stats, recipe tableB.1-babistories): Table B.1's columns and
Figure 4.4's length distributions, measured on corpora whose statistics are known by construction."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from owai.errors import OwaiError
from owai.methods.corpus_stats import histogram, split_statistics

from conftest import cli_in_process, run_owai

TRAIN = ["Once upon a time, Mia found a red ball.", "Tom said \"hi\" to the cat.\nThe cat ran away.", "é" * 700]
VAL = ["A dog sat.", "The sun was warm and the grass was green."]


def babistories(root: Path) -> Path:
    """A BabiStories-shaped copy (the reference's JSON-string lines) under root/text/babistories."""
    folder = root / "text" / "babistories"
    folder.mkdir(parents=True)
    for name, stories in (("traindataset.txt", TRAIN), ("valdataset.txt", VAL)):
        (folder / name).write_text("".join(json.dumps(s) + "\n" for s in stories), encoding="utf-8")
    return folder


def test_split_statistics_count_a_separator_per_document_as_the_reference_bin():
    lengths = np.array([3, 10, 600])
    stats = split_statistics(lengths, chars=100, truncate=[8, 512])
    assert stats["documents"] == 3 and stats["text_tokens"] == 613 and stats["tokens"] == 616
    assert stats["chars_per_document"] == pytest.approx(33.33) and stats["max_tokens"] == 600
    assert stats["over_8"] == pytest.approx(2 / 3) and stats["over_512"] == pytest.approx(1 / 3)


def test_histogram_piles_truncated_documents_in_the_last_bin():
    h = histogram(np.array([1, 2, 50, 4000, 9000]), context=100, bins=10)
    assert len(h["edges"]) == 11 and h["edges"][-1] == 100
    assert sum(h["share"]) == pytest.approx(1.0)
    assert h["share"][-1] == pytest.approx(2 / 5)  # 4000 and 9000 cut at 100
    assert h["share"][0] == pytest.approx(2 / 5)


def test_paper_preset_on_a_babistories_copy_counts_bytes_exactly(tmp_path):
    from owai.experiment import execute

    babistories(tmp_path / "data")
    run, results = execute("tableB.1-babistories", "paper",
                           [f"data.root={tmp_path / 'data'}", "data.tokenizer=bytes", "truncate=[16,1024]"], tmp_path / "runs", None)
    rows = {r["metric"]: r for r in results["rows"]}
    utf8 = [len(s.encode("utf-8")) for s in TRAIN]
    assert rows["train.documents"]["measured"] == 3 and rows["val.documents"]["measured"] == 2
    assert rows["train.text_tokens"]["measured"] == sum(utf8)
    assert rows["train.tokens"]["measured"] == sum(utf8) + 3  # one separator per story, as train.bin
    assert rows["train.chars_per_document"]["measured"] == pytest.approx(round(sum(map(len, TRAIN)) / 3, 2))
    assert rows["train.over_1024"]["measured"] == pytest.approx(1 / 3)  # the 700 "é" are 1400 bytes
    assert rows["train.tokens"]["thesis"] is None and rows["val.chars_per_document"]["thesis"] == 889  # bytes
    verdicts = {c["id"]: c["verdict"] for c in results["claims"]}
    assert verdicts["train-tokens"] == "misses" and verdicts["val-like-train"] == "misses"
    assert (run.path / "figures" / "lengths.png").read_bytes()[:4] == b"\x89PNG"
    hist = results["details"]["histograms"]["train"]["16"]
    assert sum(hist["share"]) == pytest.approx(1.0) and hist["share"][-1] == pytest.approx(1.0)  # every story is over 16 bytes


def test_cpu_preset_thesis_numbers_only_for_babistories(tmp_path):
    from owai.experiment import execute

    _, results = execute("tableB.1-babistories", "cpu", ["data.tokenizer=bytes", "data.max_documents=40", "figure=false"],
                         tmp_path, None)
    rows = {r["metric"]: r for r in results["rows"]}
    assert rows["train.documents"]["measured"] == 40 and rows["val.documents"]["measured"] == 40
    assert rows["train.tokens"]["thesis"] is None
    verdicts = {c["id"]: c["verdict"] for c in results["claims"]}
    assert verdicts["val-like-train"] == "holds" and verdicts["train-tokens"] == "n/a"  # a paper-preset claim


@pytest.mark.parametrize("sets, match", [
    (["truncate=[]"], "truncate must be distinct positive"),
    (["truncate=[0]"], "truncate must be distinct positive"),
    (["splits=[test]"], "splits must be distinct names"),
    (["data.max_documents=-1"], "max_documents must be >= 0"),
    (["data.source=/no/such/corpus"], "not found"),
])
def test_bad_settings_fail_before_a_run_directory(tmp_path, sets, match):
    from owai.experiment import execute

    with pytest.raises(OwaiError, match=match):
        execute("tableB.1-babistories", "cpu", ["data.tokenizer=bytes", *sets], tmp_path, None)
    assert not any(tmp_path.iterdir())


def test_cli_data_stats_runs_and_refuses_bad_input(tmp_path, capsys):
    babistories(tmp_path / "data")
    proc = run_owai("data", "stats", "babistories", "--tokenizer", "bytes", "--truncate", "64,1024", "--data-root",
                    str(tmp_path / "data"), "--out", str(tmp_path / "runs"), "--json")
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    rows = {r["metric"]: r for r in results["rows"]}
    assert rows["val.documents"]["measured"] == 2 and rows["val.chars_per_document"]["thesis"] == 889
    assert rows["val.tokens"]["thesis"] is None  # Table B.1 counts GPT-2 tokens, not bytes
    assert "train.over_64" in rows and "train.over_1024" in rows
    for args, match in ((["--truncate", "4k"], "--truncate '4k'"), (["--recipe", "figA.2-twobits"], "not corpus_stats"),
                        (["/no/such/corpus"], "not found")):
        # in process (an `owai` subprocess costs seconds of imports; the run above is the console script)
        code, _, err = cli_in_process(["data", "stats", *args, "--tokenizer", "bytes", "--out", str(tmp_path / "bad")], capsys)
        assert code == 2 and "Traceback" not in err and match in err and err.strip().count("\n") == 0, err
        assert not (tmp_path / "bad").exists()


def test_table_b1_token_counts_apply_to_gpt2_tokens_of_babistories_only():
    from owai import recipes

    r = recipes.load("tableB.1-babistories")
    for tokenizer in ("tokenizers/gpt2", "gpt2"):
        params = {"data": {"source": "babistories", "tokenizer": tokenizer}}
        assert recipes.thesis_for(r, "train.tokens", params).value == 474704907
        assert recipes.thesis_for(r, "val.tokens", params).value == 4749107
    assert recipes.thesis_for(r, "train.tokens", {"data": {"source": "babistories", "tokenizer": "bytes"}}) is None
    assert recipes.thesis_for(r, "train.chars_per_document", {"data": {"source": "babistories", "tokenizer": "bytes"}}).value == 888
    assert recipes.thesis_for(r, "train.tokens", {"data": {"source": "owai-stories", "tokenizer": "gpt2"}}) is None


def test_a_split_without_documents_fails_before_a_run_directory(tmp_path):
    from owai.experiment import execute

    corpus = tmp_path / "small.jsonl"  # 50 documents: the held-out rule (every 100th) leaves val empty
    corpus.write_text("".join(json.dumps({"text": f"story {i}"}) + "\n" for i in range(50)), encoding="utf-8")
    with pytest.raises(OwaiError, match="has no val documents"):
        execute("tableB.1-babistories", "cpu", ["data.tokenizer=bytes", f"data.source={corpus}"], tmp_path / "runs", None)
    assert not (tmp_path / "runs").exists()
    _, results = execute("tableB.1-babistories", "cpu", ["data.tokenizer=bytes", f"data.source={corpus}", "splits=[train]",
                                                         "figure=false"], tmp_path / "runs", None)
    assert {r["metric"]: r["measured"] for r in results["rows"]}["train.documents"] == 50
