"""Bad input to the evaluation commands (and the string options every command pastes into --set):
one `error:` line, exit 2, and no run directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import cli_in_process


def _no_run(out: Path) -> bool:
    return not out.exists() or not any(out.rglob("config.yaml"))


# ---------------------------------------------------------------- 1. string options stay the string given

ODD = ["123", "true", "a: b", "reference:", "x #y", "[1]", "null", "ü 😀", " lead", "a, b", "it's"]


@pytest.mark.parametrize("text", ODD)
def test_a_string_option_reads_back_as_the_string_given(text) -> None:
    from owai.commands._common import quoted, quoted_list, set_str
    from owai.config import parse_override

    assert parse_override(set_str("model", text)) == (["model"], text)
    assert parse_override("models=" + quoted_list([text, "b"]))[1] == [text, "b"]
    assert quoted("gpt2") == "gpt2"  # a plain value stays bare


def test_eval_options_quote_strings_and_keep_numbers() -> None:
    from owai.commands.eval import option_sets
    from owai.config import parse_override

    sets = option_sets(None, {"model": "123", "n": 5, "allow_overflow": True, "haystack_dir": "/d #1"}, {})
    assert [parse_override(s)[1] for s in sets] == ["123", 5, True, "/d #1"]


def test_path_overrides_of_the_other_commands_read_back(tmp_path) -> None:
    from owai.commands._common import data_root_sets
    from owai.commands._common import eval_overrides
    from owai.commands.rich_features import _eval_sets
    from owai.config import parse_override

    odd = tmp_path / "x #y, it's"
    assert parse_override(data_root_sets(odd)[0])[1] == str(odd)
    assert parse_override(eval_overrides([odd], "/c #d", None, None, False)[0])[1] == [str(odd)]
    assert parse_override(eval_overrides([odd], "/c #d", None, None, False)[1])[1] == "/c #d"
    quote = tmp_path / "x #y it's"  # --networks is comma-separated
    networks = [s for s in _eval_sets(None, None, str(quote), None, None) if s.startswith("probe.networks=")]
    assert parse_override(networks[0])[1] == [str(quote)]


@pytest.mark.parametrize(("args", "message"), [
    (["eval", "ruler", "--model", "123"], "123 holds no saved model"),
    (["eval", "harness", "--model", "true"], "true holds no saved model"),
    (["eval", "icl", "--model", "reference:knn", "--tokenizer", "123"], "--tokenizer 123: the reference model"),
    (["eval", "icl", "--model", "reference:"], "reference:: the ICL reference models"),
    (["mosaic-train", "--dataset", "x #y"], "no dataset files in x #y"),
])
def test_path_like_values_reach_the_method_whole(args, message, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    for folder in ("123", "true", "x #y"):
        (tmp_path / folder).mkdir()
    code, _, err = cli_in_process([*args, "-o", str(tmp_path / "runs")], capsys)
    assert code == 2 and message in err and "expected str" not in err, err
    assert _no_run(tmp_path / "runs")


# ---------------------------------------------------------------- 2-3. offline hub datasets before the run

@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_ruler_qa_from_an_uncached_hub_dataset_is_refused_offline(offline, shared_data, tmp_path, capsys) -> None:
    code, _, err = cli_in_process(["eval", "ruler", "--model", "reference:oracle", "--tasks", "qa_1", "--ctx", "4k",
                                   "--n", "1", "--set", "squad=hf:owai-test/not-cached", "-o", str(tmp_path)], capsys)
    assert code == 2 and "--set squad=PATH" in err and err.count("\n") == 1, err
    assert _no_run(tmp_path)


def test_harness_hub_task_not_in_the_cache_is_refused_offline(offline, tmp_path, capsys) -> None:
    pytest.importorskip("lm_eval")
    code, _, err = cli_in_process(["eval", "harness", "--model", "reference:oracle", "--tasks", "hellaswag",
                                   "-o", str(tmp_path)], capsys)
    assert code == 2 and "harness task hellaswag" in err and "Rowan/hellaswag" in err, err
    assert "internal error" not in err and _no_run(tmp_path)


def test_harness_include_path_task_with_local_files_runs_offline(offline, tmp_path, capsys) -> None:
    pytest.importorskip("lm_eval")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rows = [{"question": f"{i} + 1 =", "choices": [str(i + 1), str(i + 2)], "answer": 0} for i in range(3)]
    (tasks / "local.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "local.yaml").write_text(
        "task: owai_local_json\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(tasks / 'local.jsonl'))}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{question}}'\ndoc_to_target: answer\n"
        "doc_to_choice: '{{choices}}'\nmetric_list:\n  - metric: acc\n")
    code, _, err = cli_in_process(["eval", "harness", "-q", "--model", "reference:oracle", "--tasks", "owai_local_json",
                                   "--set", f"include_path=[{json.dumps(str(tasks))}]", "-o", str(tmp_path / "runs")], capsys)
    assert code == 0, err
    results = json.loads(next((tmp_path / "runs" / "table4.1-harness").iterdir()).joinpath("results.json").read_text())
    assert {r["metric"]: r["measured"] for r in results["rows"]}["owai_local_json.acc"] == 1.0


def test_harness_more_shots_than_a_tasks_pool_is_one_line(offline, tmp_path, capsys) -> None:
    """A task's few-shot pool is known once its documents load, inside the run: lm-eval's sampler then
    raised `ValueError: Sample larger than population` (an internal error); it is one `error:` line,
    exit 2, and the run is marked failed with it."""
    pytest.importorskip("lm_eval")
    code, _, err = cli_in_process(["eval", "harness", "-q", "--model", "reference:oracle", "--tasks", "owai_mc_smoke",
                                   "--num-fewshot", "1000", "-o", str(tmp_path / "runs")], capsys)
    assert code == 2 and "internal error" not in err, err
    assert err.strip().splitlines()[-1].startswith("error: --num-fewshot 1000: more examples than the few-shot pool"), err
    (status,) = (tmp_path / "runs").glob("*/*/status.json")
    assert json.loads(status.read_text())["status"] == "failed"


# ---------------------------------------------------------------- 4. RULER lengths no prompt fits

@pytest.mark.parametrize(("args", "message"), [
    (["--ctx", "2"], "context 2 is too short"),
    (["--ctx", "16", "--tasks", "niah_single_1"], "context 16 is too short for niah_single_1"),
    (["--ctx", "64", "--tasks", "vt"], "context 64 is too short for vt"),
    (["--ctx", "64", "--tasks", "cwe"], "context 64 is too short for cwe"),
    (["--ctx", "200", "--tasks", "fwe"], "fwe needs a context of at least 250 tokens"),
])
def test_ruler_length_no_prompt_fits_is_refused(shared_data, args, message, tmp_path, capsys) -> None:
    code, _, err = cli_in_process(["eval", "ruler", "--model", "reference:oracle", *args, "-o", str(tmp_path)], capsys)
    assert code == 2 and message in err, err
    assert _no_run(tmp_path)


@pytest.mark.parametrize("name", ["niah_single_1", "vt", "cwe"])
def test_a_length_is_refused_only_when_none_of_its_samples_fits(shared_data, name) -> None:
    from owai.errors import OwaiError
    from owai.evals import ruler
    from owai.methods.ruler_eval import Config, check_lengths, haystack_folder

    tok = ruler.gpt2_tokenizer(Path(os.environ["OWAI_DATA"]) / "tokenizers" / "gpt2")
    need = ruler.synthetic_task(name).smallest(1000, tok)
    for budget in range(need - 40, need + 40, 4):
        cfg = Config(model="reference:oracle", tasks=[name], ctx=[str(budget)], n=8)
        any_fits = any(s.fits for s in ruler.synthetic_task(name).build(8, budget, tok).samples)
        if any_fits:
            check_lengths(cfg, {}, haystack_folder(cfg.haystack_dir), None)
        else:
            with pytest.raises(OwaiError, match=f"context {budget} is too short for {name}"):
                check_lengths(cfg, {}, haystack_folder(cfg.haystack_dir), None)


# ---------------------------------------------------------------- 5. a model path that does not exist

def test_an_owner_slash_name_stays_a_hub_id_beside_a_folder_of_that_owner(tmp_path, monkeypatch) -> None:
    from owai.evals.causal_lm import looks_like_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "EleutherAI").mkdir()
    assert not looks_like_path("EleutherAI/pythia-160m") and not looks_like_path("gpt2")
    assert looks_like_path("./EleutherAI/pythia-160m") and looks_like_path("a/b/c") and looks_like_path("~/m")


@pytest.mark.parametrize("command", ["icl", "harness", "ruler"])
@pytest.mark.parametrize("model", ["/nonexistent/model", "./nope", "sub/dir/nope"])
def test_a_missing_model_path_is_named_as_one(command, model, tmp_path, monkeypatch, capsys) -> None:
    if command == "harness":
        pytest.importorskip("lm_eval")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    code, _, err = cli_in_process(["eval", command, "--model", model, "-o", str(tmp_path / "runs")], capsys)
    assert code == 2 and f"model path not found: {model}" in err, err
    assert _no_run(tmp_path / "runs")


# ---------------------------------------------------------------- 6. --resume FILE, --mirror that is no URL

@pytest.mark.parametrize(("args", "kind"), [(["sweep"], "sweep"), (["moons"], "run"), (["eval", "ruler"], "run")])
def test_resume_naming_a_file_says_so(args, kind, tmp_path, capsys) -> None:
    file = tmp_path / "results.json"
    file.write_text("{}")
    code, _, err = cli_in_process([*args, "--resume", str(file)], capsys)
    assert code == 2 and f"a file, not a {kind} directory" in err, err


def test_a_mirror_that_is_no_url_is_refused_before_any_folder(tmp_path, capsys) -> None:
    code, _, err = cli_in_process(["data", "fetch", "gpt2", "--data-root", str(tmp_path / "D"), "--mirror", "notaurl"],
                                  capsys)
    assert code == 2 and "--mirror 'notaurl': not a URL" in err, err
    assert not (tmp_path / "D").exists()


# ---------------------------------------------------------------- 7. blank options and settings an evaluation never reads
# (the forty-fourth session's fuzzing: each of these ran, as if the option had not been given, or failed inside its run)

@pytest.mark.parametrize(("args", "message"), [
    (["eval", "icl", "--model", "reference:knn", "--data", ""], "--data is empty"),  # ran on the recipe's data
    (["eval", "ruler", "--model", "reference:oracle", "--haystack-dir", " "], "--haystack-dir is empty"),
    (["mosaic-eval", "{model}", "--dataset", ""], "--dataset is empty"),  # evaluated the training corpus
    (["eval", "posloss", "{model}", "--config-name", "20220301.simple"], "eval.config_name is unused here"),  # dropped
    (["mosaic-eval", "{model}", "--set", "data.stream=true"], "data.stream is unused here"),  # failed in the run
    (["eval", "posloss", "{model}", "--set", "data.prefetch=-1"], "data.prefetch is unused here"),  # ran
])
def test_blank_options_and_unread_settings_are_refused(args, message, tmp_path, monkeypatch, capsys) -> None:
    model = tmp_path / "model"
    model.mkdir()  # refused before the model is read
    monkeypatch.chdir(tmp_path)
    code, _, err = cli_in_process([a.replace("{model}", str(model)) for a in args] + ["-o", str(tmp_path / "runs")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert _no_run(tmp_path / "runs")
