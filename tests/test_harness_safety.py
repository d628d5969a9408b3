"""`owai eval harness` runs no code from data or configs (security audit): task YAMLs of `include_path`
folders, and the files they include, are data only (no `!function` / Python tags, no setting that loads
code, no name that replaces a built-in task), their templates render in Jinja's sandbox, and the tasks
lm-eval marks `unsafe_code` (the model's generated code, unsandboxed) run only with the user's
`--confirm-run-unsafe-code`; each refusal is one line, exit 2, before any run directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "table4.1-harness.yaml"
REFUSED_CODE = "owai runs no code from task files"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _no_run(out: Path) -> bool:
    return not out.exists() or not any(out.rglob("config.yaml"))


def _evil_folder(root: Path, marker: Path) -> Path:
    """The auditor's task folder: a YAML whose dataset loader is a function of the .py beside it,
    which writes `marker` when imported."""
    folder = root / "evil_tasks"
    folder.mkdir()
    (folder / "evil.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
                                    "def load(**kwargs):\n    return None\n")
    (folder / "evil.yaml").write_text("task: evil_task\ncustom_dataset: !function evil.load\n"
                                      "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{question}}'\n"
                                      "doc_to_target: answer\ndoc_to_choice: '{{choices}}'\n")
    return folder


def _local_task(folder: Path, name: str, extra: str = "") -> Path:
    """A task on a JSONL beside its YAML (the json builder: no hub, no code), with `extra` YAML lines."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"question": f"{i} + 1 =", "choices": [str(i + 1), str(i + 2)], "answer": 0} for i in range(3)]
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(folder / f'{name}.jsonl'))}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{question}}'\ndoc_to_target: answer\n"
        f"doc_to_choice: '{{{{choices}}}}'\nmetric_list:\n  - metric: acc\n{extra}")
    return folder


def _validate(**changes):
    from owai.methods.harness_eval import Config, Harness

    Harness.validate(Config(**{"model": "reference:oracle", **changes}))


def _refused(message: str, **changes) -> str:
    from owai.errors import OwaiError

    with pytest.raises(OwaiError) as err:
        _validate(**changes)
    text = str(err.value)
    assert message in text and "\n" not in text, text
    return text


# ---------------------------------------------------------------- 1. include_path task files: data only


def test_the_auditors_recipe_with_a_function_tag_runs_nothing(tmp_path, capsys) -> None:
    from conftest import cli_in_process

    marker = tmp_path / "MARKER"
    folder = _evil_folder(tmp_path, marker)
    recipe = tmp_path / "evil.yaml"
    recipe.write_text("id: evil\ntitle: evil\nreproduces:\n  - {ref: \"Table 4.1\", section: \"4.2.3.1\"}\n"
                      "method: harness\nparams:\n  model: \"reference:oracle\"\n  tasks: [evil_task]\n"
                      f"  include_path: [{json.dumps(str(folder))}]\npresets:\n  cpu: {{}}\n  paper: {{}}\n"
                      "default_preset: cpu\n")
    out = tmp_path / "runs"
    code, _, err = cli_in_process(["recipes", "run", str(recipe), "-q", "--out", str(out)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert REFUSED_CODE in err and "evil.yaml" in err and "!function evil.load" in err, err
    assert not marker.exists() and _no_run(out)
    # the same folder through the command's own option
    code, _, err = cli_in_process(["eval", "harness", "-q", "--tasks", "evil_task", "--set",
                                   f"include_path=[{json.dumps(str(folder))}]", "-o", str(out)], capsys)
    assert code == 2 and REFUSED_CODE in err and len(err.strip().splitlines()) == 1, err
    assert not marker.exists() and _no_run(out)


@pytest.mark.slow  # 14 s: a real run first; the scan itself is the first-run test's
def test_a_resumed_run_whose_task_folder_now_holds_code_runs_nothing(tmp_path, capsys) -> None:
    """The recorded config of an unfinished run names its include_path: a `--resume` scans it again."""
    from conftest import as_if_killed, cli_in_process

    folder = _local_task(tmp_path / "tasks", "plain_resumed")
    out = tmp_path / "runs"
    code, _, err = cli_in_process(["eval", "harness", "-q", "--tasks", "plain_resumed", "--limit", "2", "--set",
                                   f"include_path=[{json.dumps(str(folder))}]", "-o", str(out)], capsys)
    assert code == 0, err
    run_dir = next((out / "table4.1-harness").iterdir())
    as_if_killed(run_dir)
    marker = tmp_path / "MARKER"
    (folder / "evil.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
                                    "def docs(dataset):\n    return dataset\n")
    yaml_file = folder / "plain_resumed.yaml"
    yaml_file.write_text(yaml_file.read_text() + "process_docs: !function evil.docs\n")
    code, _, err = cli_in_process(["eval", "harness", "-q", "--resume", str(run_dir)], capsys)
    assert code == 2 and REFUSED_CODE in err and len(err.strip().splitlines()) == 1, err
    assert not marker.exists() and not (run_dir / "results.json").exists()


def test_a_function_tag_reached_through_an_include_chain_is_refused(tmp_path) -> None:
    """lm-eval resolves `include:` relative to the including file's folder (or absolute): a.yaml ->
    sub/b.yaml -> ../../common/base.yml (outside the folder, and not a *.yaml) holds the function."""
    shared = tmp_path / "common"
    shared.mkdir()
    (shared / "base.yml").write_text("output_type: multiple_choice\nprocess_docs: !function helpers.process\n")
    (shared / "helpers.py").write_text("raise SystemExit('imported')\n")
    folder = tmp_path / "tasks"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.yaml").write_text("task: chained_task\ninclude: sub/b.yaml\n")
    (folder / "sub" / "b.yaml").write_text("include: ../../common/base.yml\ntest_split: test\n")
    text = _refused(REFUSED_CODE, tasks=["chained_task"], include_path=[str(folder)])
    assert str(shared / "base.yml") in text and "!function helpers.process" in text
    (folder / "sub" / "b.yaml").write_text(f"include: {json.dumps(str(shared / 'base.yml'))}\n")  # absolute
    assert str(shared / "base.yml") in _refused(REFUSED_CODE, tasks=["chained_task"], include_path=[str(folder)])
    (folder / "sub" / "b.yaml").write_text("include: ../missing.yaml\n")
    _refused("includes ../missing.yaml, which is not a file", tasks=["chained_task"], include_path=[str(folder)])


@pytest.mark.parametrize(("text", "message"), [
    ("task: t\ndoc_to_text: !!python/object/apply:os.system ['touch x']\n", "python/object/apply:os.system"),
    ("task: t\nx: !!python/name:os.system\n", "python/name:os.system"),
    ("task: t\nx: !custom_tag value\n", "!custom_tag value"),
    ("task: t\nmetric_list:\n  - metric: /some/evaluate_script\n", "is not one of lm-eval's registered metrics"),
    ("task: t\nmetric_list:\n  - metric: someone/their_metric\n", "is not one of lm-eval's registered metrics"),
    ("task: t\nmetric_list:\n  - metric: bleu\n    hf_evaluate: true\n", "sets hf_evaluate"),
    ("task: t\ngeneration_kwargs:\n  custom_generate: someone/gen\n  trust_remote_code: true\n", "sets "),
    ("group: g\ntask:\n  - task: arc_easy\n    metric_list:\n      - metric: ./evil\n", "not one of lm-eval's registered"),
    ("task: t\nuse_prompt: prompts.yaml:p\n", "reads prompts from another YAML"),
    ("task: [unclosed\n", "does not read as YAML"),
])
def test_task_file_settings_that_would_load_code_are_refused(tmp_path, text, message) -> None:
    from owai.errors import OwaiError
    from owai.evals import harness

    folder = tmp_path / "tasks"
    (folder / "deep").mkdir(parents=True)
    (folder / "deep" / "t.yml").write_text(text)
    with pytest.raises(OwaiError) as err:
        harness.check_task_files([str(folder)])
    assert message in str(err.value) and str(folder / "deep" / "t.yml") in str(err.value)
    assert "\n" not in str(err.value)


def test_plain_task_files_and_owais_shipped_folder_pass_the_scan(tmp_path) -> None:
    from owai.evals import harness

    folder = _local_task(tmp_path / "tasks", "plain_local", "filter_list:\n  - name: none\n    filter:\n"
                                                          "      - function: take_first\n")
    harness.check_task_files([str(folder)])
    # owai's own task folder uses !function (its loaders, race_utils): installed code, trusted
    assert "!function" in (harness.TASKS_DIR / "race_middle.yaml").read_text()
    harness.check_task_files([str(harness.TASKS_DIR)])
    # so is a file of lm-eval's own task folder that a user's task includes
    theirs = harness.HARNESS_TASKS_DIR / "humaneval" / "humaneval.yaml"
    assert "!function" in theirs.read_text()
    (folder / "mine.yaml").write_text(f"include: {json.dumps(str(theirs))}\ntask: my_humaneval\n")
    harness.check_task_files([str(folder)])


@pytest.mark.parametrize(("yaml_text", "name"), [
    ("task: arc_easy\n", "arc_easy"),            # an lm-eval task
    ("task: owai_mc_smoke\n", "owai_mc_smoke"),  # owai's own
    ("group: mmlu\ntask: [mine]\n", "mmlu"),     # an lm-eval group
    ("task: mine_tagged\ntag: ai2_arc\n", "ai2_arc"),  # a tag would replace lm-eval's tag
])
def test_an_include_path_name_that_shadows_a_built_in_task_is_refused(tmp_path, yaml_text, name) -> None:
    folder = _local_task(tmp_path / "tasks", "mine")
    (folder / "shadow.yaml").write_text(yaml_text + "dataset_path: json\noutput_type: multiple_choice\n")
    text = _refused("a name lm-eval or owai already has", tasks=["mine"], include_path=[str(folder)])
    assert repr(name) in text


def test_owais_own_task_folder_as_include_path_shadows_nothing() -> None:
    from owai.evals import harness

    _validate(tasks=["owai_mc_smoke"], include_path=[str(harness.TASKS_DIR)])


def test_templates_render_in_jinjas_sandbox() -> None:
    from jinja2.exceptions import SecurityError
    from lm_eval import utils

    import owai.evals.harness  # noqa: F401  (installs the sandbox)

    assert utils.apply_template("Q: {{question}}\n{{ choices | join(', ') }}", {"question": "x", "choices": ["a", "b"]}) \
        == "Q: x\na, b"
    assert utils.apply_template("{{ text | regex_replace('a+', 'b') }}", {"text": "caat"}) == "cbt"
    with pytest.raises(SecurityError):
        utils.apply_template("{{ cycler.__init__.__globals__.os.system('true') }}", {})


# ---------------------------------------------------------------- 2. tasks that run the model's code: opt-in only


def test_known_code_tasks_agree_with_lm_evals_unsafe_code_marks() -> None:
    from owai.evals import harness

    index = harness.task_index()
    known = sorted(set(harness.THESIS_TASKS) | set(harness.OWAI_TASKS) | set(harness.MAIN_METRIC))
    assert harness.code_tasks(index, known) == list(harness.UNSAFE_TASKS)
    assert harness.code_tasks(index, ["humaneval", "arc_easy", "mbpp_plus"]) == ["humaneval", "mbpp_plus"]


@pytest.mark.parametrize("tasks", [["arc_easy", "humaneval_plus"], ["humaneval"], ["mbpp_plus"]])
def test_a_code_task_without_the_opt_in_is_refused(tasks) -> None:
    text = _refused("--confirm-run-unsafe-code (--set confirm_run_unsafe_code=true)", tasks=tasks)
    assert tasks[-1] in text and "arc_easy" not in text


def test_code_tasks_reached_through_a_group_or_an_include_are_refused(tmp_path) -> None:
    from owai.evals import harness

    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "group.yaml").write_text("group: my_code_group\ntask: [arc_easy, humaneval]\n")
    _refused("my_code_group's subtask humaneval", tasks=["my_code_group"], include_path=[str(folder)])
    (folder / "inherits.yaml").write_text(
        f"include: {json.dumps(str(harness.HARNESS_TASKS_DIR / 'mbpp' / 'mbpp.yaml'))}\ntask: my_mbpp\n")
    _refused("harness task(s) my_mbpp run the model's generated code", tasks=["my_mbpp"], include_path=[str(folder)])


def test_the_paper_preset_is_refused_without_the_opt_in_before_any_run(tmp_path, capsys) -> None:
    from conftest import cli_in_process

    from owai import recipes

    recipe = recipes.load(str(RECIPE))
    assert "confirm_run_unsafe_code" not in recipe.params
    assert all("confirm_run_unsafe_code" not in p for p in recipe.presets.values())
    assert not set(recipe.params_for("cpu")["tasks"]) & {"humaneval_plus", "mbpp"}  # the default runs as it is
    code, _, err = cli_in_process(["eval", "harness", "-p", "paper", "--model", "reference:oracle", "-q",
                                   "-o", str(tmp_path / "runs")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "humaneval_plus, mbpp" in err and "--confirm-run-unsafe-code" in err, err
    assert _no_run(tmp_path / "runs")


def test_the_opt_in_reaches_lm_eval_with_hf_allow_code_eval(tmp_path, capsys, monkeypatch) -> None:
    """A local task marked unsafe_code (no hub, no code in it): refused without the flag; with it, the
    harness is asked with confirm_run_unsafe_code=True and sees HF_ALLOW_CODE_EVAL=1, for the run only."""
    import lm_eval
    from conftest import cli_in_process

    folder = _local_task(tmp_path / "tasks", "owai_code_local", "unsafe_code: true\n")
    args = ["eval", "harness", "-q", "--tasks", "owai_code_local", "--set", f"include_path=[{json.dumps(str(folder))}]",
            "-o", str(tmp_path / "runs")]
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    seen = []

    def fake_simple_evaluate(**kwargs):
        seen.append((kwargs["confirm_run_unsafe_code"], os.environ.get("HF_ALLOW_CODE_EVAL")))
        return {"results": {"owai_code_local": {"acc,none": 1.0}}}

    monkeypatch.setattr(lm_eval, "simple_evaluate", fake_simple_evaluate)
    code, _, err = cli_in_process(args, capsys)
    assert code == 2 and "owai_code_local run the model's generated code" in err and not seen, err
    assert _no_run(tmp_path / "runs")
    code, _, err = cli_in_process([*args, "--confirm-run-unsafe-code"], capsys)
    assert code == 0, err
    assert seen == [(True, "1")] and "HF_ALLOW_CODE_EVAL" not in os.environ
    run_dir = next((tmp_path / "runs" / "table4.1-harness").iterdir())
    assert "confirm_run_unsafe_code: true" in run_dir.joinpath("config.yaml").read_text()


def test_without_the_opt_in_lm_eval_is_told_not_to_run_code(monkeypatch) -> None:
    import lm_eval

    from owai.evals import harness

    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    seen = []
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: seen.append(
        (kw["confirm_run_unsafe_code"], os.environ.get("HF_ALLOW_CODE_EVAL"))) or {"results": {}})
    harness.evaluate(object(), ["owai_mc_smoke"], manager=object())
    assert seen == [(False, None)]
