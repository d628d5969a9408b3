"""`owai eval ruler` (thesis sec 4.2.3.2, Tables 4.4, 4.5, C.1): the reference readers through the
command on generated SQuAD / HotpotQA files and RULER's synthetic tasks, a saved causal LM with
overflow past its length, the thesis rows, and the one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SHARED_DATA, cli_in_process, save_tiny_gpt2
from test_ruler import essay_hotpot, essay_squad, write_json

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qa_files(tmp_path_factory) -> dict[str, Path]:
    """SQuAD v2 and HotpotQA dev files of real English sentences, in the official formats."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data not present")
    from owai.evals import ruler as R

    root = tmp_path_factory.mktemp("qa")
    gpt2 = R.gpt2_tokenizer(SHARED_DATA / "tokenizers" / "gpt2")
    return {"squad": write_json(root / "dev-v2.0.json", essay_squad(SHARED_DATA, gpt2)),
            "hotpotqa": write_json(root / "hotpot_dev_distractor_v1.json", essay_hotpot(SHARED_DATA, gpt2))}


def _ruler(args: list[str], capsys) -> tuple[int, str, str]:
    return cli_in_process(["eval", "ruler", *args, "-q"], capsys)


def _rows(out: Path) -> dict[str, dict]:
    run_dir = next((out / "table4.4-ruler").iterdir())
    return {r["metric"]: r for r in json.loads((run_dir / "results.json").read_text())["rows"]}


def test_the_cpu_preset_oracle_scores_100_on_every_synthetic_task(shared_data, tmp_path, capsys) -> None:
    rc, _, err = _ruler(["--n", "5", "-o", str(tmp_path)], capsys)
    assert rc == 0, err
    rows = _rows(tmp_path)
    assert len(rows) == 12 and all(r["measured"] == 100.0 for r in rows.values())


@pytest.mark.parametrize(("model", "expected"), [("reference:oracle", 100.0), ("reference:null", 0.0)])
def test_qa_references_score_what_they_must_beside_the_thesis_row(qa_files, shared_data, tmp_path, capsys, model,
                                                                  expected) -> None:
    rc, _, err = _ruler(["-p", "paper", "--model", model, "--ctx", "4k", "--n", "4",
                         "--set", f"squad={qa_files['squad']}", "--set", f"hotpotqa={qa_files['hotpotqa']}",
                         "--set", "row=mmv2-large", "-o", str(tmp_path)], capsys)
    assert rc == 0, err
    rows = _rows(tmp_path)
    assert rows["qa_1.4k.score"]["measured"] == rows["qa_2.4k.score"]["measured"] == expected
    assert rows["qa.4k.score"]["measured"] == expected
    assert rows["qa.4k.score"]["thesis"] == 59.3  # Table 4.4, MMv2 large at 4k


def test_a_saved_causal_lm_overflows_past_its_length_and_is_scored_within_it(shared_data, tmp_path, capsys) -> None:
    model_dir = save_tiny_gpt2(tmp_path / "lm")
    capsys.readouterr()  # transformers' progress bars while saving
    args = ["--model", str(model_dir), "--tasks", "niah_single_1", "--ctx", "1024,2048", "--n", "2", "--set", "tokenizer="]
    rc, _, err = _ruler([*args, "-o", str(tmp_path / "runs")], capsys)  # 2048 > its 1024 positions: refused
    assert rc != 0 and "--allow-overflow" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()
    rc, _, err = _ruler([*args, "--allow-overflow", "-o", str(tmp_path / "runs")], capsys)
    assert rc == 0, err
    results = json.loads(next((tmp_path / "runs" / "table4.4-ruler").iterdir()).joinpath("results.json").read_text())
    cells = results["details"]["results"]["niah_single_1"]
    assert cells["1024"]["overflow"] == 0 and cells["1024"]["score"] is not None
    assert cells["2048"]["overflow"] == 2 and cells["2048"]["score"] is None  # 2048 bytes > its 1024 positions
    assert results["details"]["max_tokens"] == 1024


@pytest.mark.parametrize(("args", "message"), [
    (["-p", "paper"], "no model given"),
    (["--model", "reference:oracle", "--tasks", "qa_3"], "tasks ['qa_3']"),
    (["--model", "reference:oracle", "--ctx", "4q"], "4q"),
    (["--model", "reference:oracle", "--set", "reference_tokenizer="], "needs reference_tokenizer"),
    (["--model", "reference:seer"], "RULER reference models are"),
    (["--model", "reference:oracle", "--haystack-dir", "/nonexistent/essays"], "essay haystack"),
    (["-p", "paper", "--model", "reference:oracle", "--set", "squad=/none/dev.json"],
     "QA file"),
    (["--model", "reference:oracle", "--ablate", "long_term_memory"], "nothing to ablate"),
])
def test_bad_input_is_one_line_and_writes_nothing(shared_data, args, message, tmp_path, capsys) -> None:
    rc, _, err = _ruler([*args, "-o", str(tmp_path)], capsys)
    assert rc != 0 and message in err and len(err.strip().splitlines()) == 1, err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("args", "message"), [
    (["--tasks", "niah_single_2"], "download_paulgraham_essay.py fetches them"),
    (["--tasks", "qa_1", "--set", "squad=text/squad/dev-v2.0.json"], "put the official dev-v2.0.json"),
])
def test_a_missing_catalogue_input_says_where_to_get_it(shared_data, args, message, tmp_path, monkeypatch,
                                                         capsys) -> None:
    """The default essay folder, or a QA file named under the data root, that is not there: the
    catalogue's one line for that dataset (where it comes from), not a bare "not found"."""
    root = tmp_path / "data"
    root.mkdir()
    (root / "tokenizers").symlink_to(shared_data / "tokenizers")  # the tokenizer is there, the essays are not
    monkeypatch.setenv("OWAI_DATA", str(root))
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    rc, _, err = _ruler(["--model", "reference:oracle", *args, "-o", str(tmp_path / "runs")], capsys)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


def test_ablating_a_part_the_model_lacks_is_refused_before_the_run(tmp_path, capsys) -> None:
    save_tiny_gpt2(tmp_path / "lm", positions=64, n_embd=16, n_layer=1)
    rc, _, err = _ruler(["--model", str(tmp_path / "lm"), "--tasks", "vt", "--ablate", "long_term_memory",
                         "-o", str(tmp_path / "runs")], capsys)
    assert rc != 0 and "has no long_term_memory" in err
    assert not (tmp_path / "runs").exists()


def test_models_and_data_that_do_not_fit_are_one_line_before_the_run(shared_data, tmp_path, capsys) -> None:
    """A directory that is not a model, a tokenizer with more tokens than the model's embedding, a QA
    file with missing fields, an essay folder with no text: each one line, no run directory."""
    not_a_model = tmp_path / "notes"
    not_a_model.mkdir()
    (not_a_model / "readme.txt").write_text("no model here")
    small_vocab = save_tiny_gpt2(tmp_path / "small-vocab", vocab=100, positions=4096, n_embd=16, n_layer=1)
    broken = write_json(tmp_path / "dev-v2.0.json", {"version": "v2.0", "data": [{"title": "A"}]})  # no paragraphs
    empty = tmp_path / "essays"
    empty.mkdir()
    capsys.readouterr()  # transformers' progress bars while saving
    cases = [
        (["--model", str(not_a_model), "--tasks", "vt"], "holds no saved model"),
        (["--model", str(small_vocab), "--tasks", "vt", "--ctx", "1k"], "not the model's tokenizer"),
        (["--model", "reference:oracle", "--tasks", "qa_1", "--set", f"squad={broken}"], "is not a SQuAD v2.0 file"),
        (["--model", "reference:oracle", "--tasks", "niah_single_2", "--haystack-dir", str(empty)], str(empty)),
    ]
    for args, message in cases:
        out = tmp_path / "runs"
        rc, _, err = _ruler([*args, "-o", str(out)], capsys)
        assert rc != 0 and message in err and len(err.strip().splitlines()) == 1, (args, err)
        assert not out.exists()


def test_synthetic_qa_runs_the_qa_path_offline(shared_data, tmp_path, capsys) -> None:
    """Spec sec 1.11's invented-fact pools through the same readers, fitting and scoring."""
    rc, _, err = _ruler(["--model", "reference:oracle", "--tasks", "qa_1,qa_2", "--ctx", "1k,2k", "--n", "5",
                         "--set", "squad=synthetic", "--set", "hotpotqa=synthetic", "-o", str(tmp_path)], capsys)
    assert rc == 0, err
    rows = _rows(tmp_path)
    assert rows["qa.1k.score"]["measured"] == rows["qa.2k.score"]["measured"] == 100.0
