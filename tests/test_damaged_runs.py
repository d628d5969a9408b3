"""Damaged run directories: what `owai report` and `--resume` do with a run whose files were
truncated, replaced by a folder or a broken symlink, or hold another JSON value (one `error:` line,
exit 2, nothing written; or the run resumes correctly), and the writers and readers behind them."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from conftest import TINY_MOONS, as_if_killed, as_sets, cli_in_process, save_tiny_gpt2
from owai.checkpoint import load_checkpoint, save_checkpoint
from owai.errors import OwaiError
from owai.io import atomic_write_json
from owai.runs import Run

STAGE = "heads3-r0"  # the tiny three-moons run's one training stage


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny three-moons run: checkpoints at steps 4 and 6 (the newest two of 2, 4, 6), a metrics line at each step 2, 4, 6."""
    out = tmp_path_factory.mktemp("runs")
    from owai.cli import main

    try:
        main(["moons", *as_sets([*TINY_MOONS, "train.log_every=2"]), "--quiet", "--out", str(out)])
    except SystemExit as e:
        assert not e.code, e.code
    finally:
        from owai import console

        console.configure()
    return next((out / "three-moons").iterdir())


def copy_of(run: Path, tmp_path: Path, killed: bool = False) -> Path:
    """A copy of `run`; `killed`: left as a kill after its last checkpoint leaves it (no results, running)."""
    path = tmp_path / "run"
    shutil.copytree(run, path, symlinks=True)
    if killed:
        as_if_killed(path)
    return path


def snapshot(root: Path) -> dict[str, object]:
    """Every entry under `root` with its kind, size and modification time: what a refusal must leave alone."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = ("link", os.readlink(p)) if p.is_symlink() else (
                "dir" if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns))
    return out


def assert_refused(code: int, err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err and "internal error" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def make_folder(path: Path) -> None:
    path.unlink() if path.is_file() or path.is_symlink() else shutil.rmtree(path)
    path.mkdir()


def make_file(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    path.write_text("not a folder\n")


def make_broken_link(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    path.symlink_to("/nonexistent/owai-damaged")


def make_device_link(path: Path) -> None:
    path.unlink()
    path.symlink_to(os.devnull)


# -- results.json -----------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["[]\n", "null\n", '"text"\n', '{"recipe": "three-moons"}\n',
                                     '{"recipe": "three-moons", "rows": [1, 2]}\n', "\x00\x80garbage"])
@pytest.mark.parametrize("form", [[], ["--markdown"], ["--json"]])
def test_report_of_a_results_json_that_is_no_results_file(finished_run, tmp_path, capsys, content, form):
    """A results.json holding another JSON value was a TypeError (a list) or 'no results.json yet' (null)."""
    run = copy_of(finished_run, tmp_path)
    (run / "results.json").write_text(content)
    code, out, err = cli_in_process(["report", str(run), *form], capsys)
    assert_refused(code, err, "results.json is corrupt")
    assert out == ""


@pytest.mark.parametrize("damage", [make_folder, make_broken_link])
def test_report_and_resume_of_a_results_json_that_is_no_file(finished_run, tmp_path, capsys, damage):
    """A folder where results.json belongs was an IsADirectoryError; a broken symlink read as 'not yet written'."""
    run = copy_of(finished_run, tmp_path)
    damage(run / "results.json")
    before = snapshot(run)
    code, _, err = cli_in_process(["report", str(run)], capsys)
    assert_refused(code, err, "results.json")
    code, _, err = cli_in_process(["moons", "--resume", str(run), "--quiet"], capsys)
    assert_refused(code, err, "results.json is", "not a file")
    assert snapshot(run) == before


def test_results_of_a_sweep_point_that_is_a_list_is_corrupt(finished_run, tmp_path):
    """sweep.summarise counts a point whose Run.results() raises as corrupt; it raised AttributeError
    (a list), and null counted as a complete point that measured nothing."""
    run = copy_of(finished_run, tmp_path)
    for content in ("[]", "null"):
        (run / "results.json").write_text(content)
        with pytest.raises(OwaiError, match="results.json is corrupt"):
            Run(run).results()


# -- what a resume writes into: refused before anything is written ------------------------------


DAMAGED_LAYOUTS = [
    ("status.json", make_folder, "status.json is a folder, not a file"),
    ("status.json", make_device_link, "status.json is a special file, not a file"),
    ("metrics.jsonl", make_folder, "metrics.jsonl is a folder, not a file"),
    ("env.json", make_folder, "env.json is a folder, not a file"),
    ("config_history.jsonl", make_folder, "config_history.jsonl is a folder, not a file"),
    ("checkpoints", make_file, "checkpoints is a file, not a folder"),
    ("checkpoints", make_broken_link, "checkpoints is a broken symlink, not a folder"),
    (f"checkpoints/{STAGE}", make_file, f"{STAGE} is a file, not a folder"),
    (f"checkpoints/{STAGE}", make_broken_link, f"{STAGE} is a broken symlink, not a folder"),
    (f"checkpoints/{STAGE}/step-000006", make_file, "step-000006 is a file, not a folder"),
    (f"checkpoints/{STAGE}/step-000006", make_broken_link, "step-000006 is a broken symlink, not a folder"),
    ("figures", make_file, "figures is a file, not a folder"),
    ("models/arch", make_file, "arch is a file, not a folder"),
]


@pytest.mark.parametrize("entry, damage, message", DAMAGED_LAYOUTS, ids=[f"{e}-{d.__name__}" for e, d, _ in DAMAGED_LAYOUTS])
def test_resume_refuses_a_damaged_layout_before_writing(finished_run, tmp_path, capsys, entry, damage, message):
    """Each was a traceback (IsADirectoryError, NotADirectoryError, FileExistsError) from the resumed
    run's writers, some after it had rewritten results.json and env.json; a checkpoint folder that
    had become a file was skipped, the stage resumed from the one before, then crashed saving over it;
    a models/<arch> that is a file or a broken symlink crashed mosaic-train saving the model at the end."""
    run = copy_of(finished_run, tmp_path, killed=True)
    if entry in ("config_history.jsonl", "models/arch"):  # what a resumed run or a language-model stage writes
        (run / entry).parent.mkdir(exist_ok=True)
        (run / entry).write_text("")
    damage(run / entry)
    before = snapshot(run)
    code, _, err = cli_in_process(["moons", "--resume", str(run), "--quiet"], capsys)
    assert_refused(code, err, message)
    assert snapshot(run) == before


@pytest.mark.parametrize("content", ['{"owai_version": "0', "[]", "null", "\x00\x80", '{"resumed": 3}'])
def test_resume_refuses_an_unreadable_env_json_before_writing(finished_run, tmp_path, capsys, content):
    """Run.write_env parsed env.json unguarded: a JSONDecodeError / AttributeError traceback."""
    run = copy_of(finished_run, tmp_path, killed=True)
    (run / "env.json").write_text(content)
    before = snapshot(run)
    code, _, err = cli_in_process(["moons", "--resume", str(run), "--quiet"], capsys)
    assert_refused(code, err, "env.json", "remove it to resume")
    assert snapshot(run) == before


def test_report_ignores_what_only_a_resume_needs(finished_run, tmp_path, capsys):
    """report reads config.yaml and results.json: a damaged status.json or env.json does not stop it."""
    run = copy_of(finished_run, tmp_path)
    make_folder(run / "status.json")
    (run / "env.json").write_text("[]")
    code, out, err = cli_in_process(["report", str(run), "--markdown"], capsys)
    assert code == 0, err
    assert "| heads3.val.accurate_from |" in out


# -- damaged but harmless: the run resumes -------------------------------------------------------


@pytest.mark.parametrize("content", ["[]", "null", '{"status": 3}'])
def test_resume_with_a_status_json_of_another_value(finished_run, tmp_path, capsys, content):
    """Run.status indexed the parsed value: a TypeError traceback for a list or null."""
    run = copy_of(finished_run, tmp_path, killed=True)
    (run / "status.json").write_text(content)
    assert Run(run).status() == "unknown"
    code, _, err = cli_in_process(["moons", "--resume", str(run), "--quiet"], capsys)
    assert code == 0, err
    assert Run(run).status() == "complete" and Run(run).results() is not None


@pytest.mark.parametrize("status", [None, "running"])
def test_resume_of_a_run_with_results_but_no_complete_status_only_repairs_the_status(finished_run, tmp_path, capsys, status):
    """Killed between writing results.json and status.json, or status.json lost: the run is complete
    (results.json is its last, atomic write); --resume evaluated it again."""
    run = copy_of(finished_run, tmp_path)
    if status is None:
        (run / "status.json").unlink()
    else:
        (run / "status.json").write_text(json.dumps({"status": status}))
    before = {k: v for k, v in snapshot(run).items() if k != "status.json"}
    code, _, err = cli_in_process(["moons", "--resume", str(run)], capsys)
    assert code == 0, err
    assert "is already complete" in err
    assert Run(run).status() == "complete"
    assert {k: v for k, v in snapshot(run).items() if k != "status.json"} == before


def test_resume_names_a_bad_value_edited_into_config_yaml(finished_run, tmp_path, capsys):
    """Not 'the checkpoint was written under another config' (the hash differs), but the value."""
    run = copy_of(finished_run, tmp_path, killed=True)
    config = run / "config.yaml"
    original = config.read_text()
    for key, value, message in (("seed", "fast", f"{run}/config.yaml params.seed: expected int, got str 'fast'"),
                                ("train_panel", "9", "eval.train_panel=9 is not an index of data.train_periods")):
        assert len(re.findall(rf"\b{key}: \d+", original)) == 1
        config.write_text(re.sub(rf"\b{key}: \d+", f"{key}: {value}", original))
        before = snapshot(run)
        code, _, err = cli_in_process(["moons", "--resume", str(run)], capsys)
        assert_refused(code, err, message)
        assert "config" not in err.split(message)[-1], err
        assert snapshot(run) == before


def test_resume_skips_damaged_metrics_lines(finished_run, tmp_path, capsys):
    """Bytes that are not UTF-8 were a UnicodeDecodeError, a line holding a list or null an
    AttributeError, a step that is no number a TypeError: the trim after the checkpoint read them all."""
    run = copy_of(finished_run, tmp_path, killed=True)
    good = (run / "metrics.jsonl").read_bytes()
    (run / "metrics.jsonl").write_bytes(good + b"\x00\x80\xff\n[]\nnull\n" + b'{"stage": "%s", "step": "x"}\n' % STAGE.encode()
                                        + b'{"stage": "%s", "st' % STAGE.encode())
    code, _, err = cli_in_process(["moons", "--resume", str(run), "--quiet"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(r, dict) for r in rows)
    assert [r["step"] for r in rows if r.get("stage") == STAGE and isinstance(r["step"], int)] == [2, 4, 6]


def test_resume_without_checkpoints_does_not_log_twice(finished_run, tmp_path, capsys):
    """A stage resumed from no checkpoint (a kill before its first one, or checkpoints removed) starts
    from scratch; the metrics the first attempt logged stayed, so every step was in metrics.jsonl twice."""
    run = copy_of(finished_run, tmp_path, killed=True)
    shutil.rmtree(run / "checkpoints" / STAGE)
    code, _, err = cli_in_process(["moons", "--resume", str(run), "--quiet"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    counts = Counter((r["stage"], r["step"]) for r in rows)
    assert counts and max(counts.values()) == 1, counts
    assert sorted(step for stage, step in counts if stage == STAGE) == [2, 4, 6]


def test_resume_remakes_a_removed_figures_folder(finished_run, tmp_path, capsys):
    """A killed run whose figures/ is gone: the resumed run writes its figures again (the atomic
    writer could not make its temporary file there)."""
    run = copy_of(finished_run, tmp_path, killed=True)
    shutil.rmtree(run / "figures")
    code, _, err = cli_in_process(["moons", "--resume", str(run), "--quiet"], capsys)
    assert code == 0, err
    assert (run / "figures" / "fig3.6-three-heads.png").is_file()


# -- sweep directories and sweep points ---------------------------------------------------------


def test_report_of_a_sweep_without_its_sweep_json_says_so(finished_run, tmp_path, capsys):
    """A sweep directory whose sweep.json is gone was called 'not a run directory: config.yaml is missing'."""
    sweep = tmp_path / "sweep"
    shutil.copytree(finished_run, sweep / "points" / "seed=0")
    code, _, err = cli_in_process(["report", str(sweep)], capsys)
    assert_refused(code, err, "a sweep directory whose sweep.json is missing")


def test_a_run_directory_cannot_be_made_at_a_broken_symlink(tmp_path):
    """A sweep point's folder that is a broken symlink was 'already exists; continue it with --resume'."""
    point = tmp_path / "points" / "p"
    point.parent.mkdir()
    point.symlink_to("/nonexistent/owai-point")
    with pytest.raises(OwaiError, match="it is a broken symlink"):
        Run.create_at(point, {"recipe": "three-moons", "params": {}})


# -- the writers and readers underneath ------------------------------------------------------------


@pytest.mark.parametrize("where", ["a-folder", "no-parent"])
def test_atomic_write_failure_is_one_owai_error(tmp_path, where):
    """A summary.json / bonsai.json / status.json that is a folder made os.replace raise IsADirectoryError
    (an internal error, after the sweep had run); now one OwaiError naming the file, nothing left behind."""
    target = tmp_path / "summary.json" if where == "a-folder" else tmp_path / "gone" / "summary.json"
    if where == "a-folder":
        target.mkdir()
    with pytest.raises(OwaiError, match=re.escape(f"cannot write {target}")):
        atomic_write_json(target, {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == (["summary.json"] if where == "a-folder" else [])


def _checkpoint(tmp_path: Path) -> Path:
    import torch

    return save_checkpoint(tmp_path / "ckpt", 3, {"w": torch.ones(2)})


@pytest.mark.parametrize("damage", ["state-folder", "state-loop", "step-file", "step-broken-link"])
def test_load_checkpoint_of_damaged_entries(tmp_path, damage):
    """state.json as a folder (IsADirectoryError) or a symlink loop (OSError), and the checkpoint folder
    as a file, were tracebacks; now one OwaiError naming the checkpoint."""
    path = _checkpoint(tmp_path)
    if damage == "state-folder":
        make_folder(path / "state.json")
    elif damage == "state-loop":
        (path / "state.json").unlink()
        (path / "state.json").symlink_to("state.json")
    elif damage == "step-file":
        make_file(path)
    else:
        make_broken_link(path)
    with pytest.raises(OwaiError, match=re.escape(f"checkpoint {path}")):
        load_checkpoint(path)


# -- saved models (mosaic-train's models/<arch>/, eval posloss and mosaic-eval) -----------------


@pytest.fixture
def saved_model(tmp_path: Path) -> Path:
    model = save_tiny_gpt2(tmp_path / "model")
    (model / "tokenizer.json").write_text('{"version": "1.0"}')
    spec = json.loads((model / "owai_tokenizer.json").read_text())
    (model / "owai_tokenizer.json").write_text(json.dumps({**spec, "file": "tokenizer.json"}))
    return model


MODEL_DAMAGES = [
    ("config.json", "[]", "config.json is corrupt: not a JSON object"),
    ("config.json", "null", "config.json is corrupt: not a JSON object"),
    ("generation_config.json", "null", "generation_config.json is corrupt: not a JSON object"),
    ("owai_tokenizer.json", "[]", "owai_tokenizer.json is corrupt: not a JSON object"),
    ("owai_tokenizer.json", None, "owai_tokenizer.json is a folder, not a file"),
    ("tokenizer.json", "", "tokenizer.json is corrupt: not JSON"),
    ("tokenizer.json", "{\"trunc", "tokenizer.json is corrupt: not JSON"),
    ("tokenizer.json", "missing", "names the model's tokenizer"),
]


@pytest.mark.parametrize("name, content, message", MODEL_DAMAGES, ids=[f"{n}-{c!r}" for n, c, _ in MODEL_DAMAGES])
@pytest.mark.parametrize("command", [["eval", "posloss"], ["mosaic-eval"]])
def test_eval_of_a_damaged_saved_model_is_refused_before_a_run(saved_model, tmp_path, capsys, name, content, message, command):
    """A config.json, generation_config.json or owai_tokenizer.json holding a list or null was an
    AttributeError / TypeError traceback; a corrupt tokenizer.json was found only after the run directory
    existed; a missing one silently evaluated the model with another tokenizer of the same name."""
    path = saved_model / name
    if content is None:
        make_folder(path)
    elif content == "missing":
        path.unlink()
    else:
        path.write_text(content)
    out = tmp_path / "out"
    code, _, err = cli_in_process([*command, str(saved_model), "--set", "runtime.device=cpu", "--out", str(out), "--quiet"], capsys)
    assert_refused(code, err, message)
    assert not out.exists()


def test_eval_of_a_run_model_without_its_tokenizer_spec_is_refused(saved_model, tmp_path, capsys):
    """A mosaic-train run's models/<arch>/ whose owai_tokenizer.json is gone was evaluated with the
    command's default tokenizer (bpe-2048 of the evaluation corpus): other numbers, no word of it."""
    run = tmp_path / "run"
    (run / "models").mkdir(parents=True)
    (run / "config.yaml").write_text("recipe: table4.2-pretrain\nparams: {}\n")
    model = shutil.move(saved_model, run / "models" / "gpt")
    (Path(model) / "owai_tokenizer.json").unlink()
    for target in (run, Path(model)):
        code, _, err = cli_in_process(["eval", "posloss", str(target), "--out", str(tmp_path / "out"), "--quiet"], capsys)
        assert_refused(code, err, "owai_tokenizer.json is missing")
    assert not (tmp_path / "out").exists()


# -- the file system around a run: the cache and --out --------------------------------------------


@pytest.mark.parametrize("where", ["under-a-file", "broken-link"])
def test_a_cache_that_cannot_be_made_is_refused_before_a_run(saved_model, tmp_path, capsys, monkeypatch, where):
    """OWAI_CACHE under a file (or /proc, /sys) passed the check (it is not an existing file), and the
    tokenizer or token cache writer failed inside the run: an internal error and a failed run directory."""
    if where == "under-a-file":
        (tmp_path / "afile").write_text("x")
        cache = tmp_path / "afile" / "cache"
    else:
        cache = tmp_path / "cache"
        cache.symlink_to(tmp_path / "gone")
    monkeypatch.setenv("OWAI_CACHE", str(cache))
    out = tmp_path / "out"
    code, _, err = cli_in_process(["eval", "posloss", str(saved_model), "--out", str(out), "--quiet"], capsys)
    assert_refused(code, err, f"the cache {cache} ($OWAI_CACHE) cannot be made")
    assert not out.exists()


def test_a_cache_to_be_made_is_probed_without_a_trace(tmp_path, capsys, monkeypatch):
    """The check makes a missing cache folder (and parents) to see that it can, then removes them."""
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "new" / "deeper" / "cache"))
    code, _, err = cli_in_process(["recipes", "list", "--quiet"], capsys)
    assert code == 0, err
    assert not (tmp_path / "new").exists()


def test_one_folder_check_for_run_folders_and_the_cache(tmp_path, capsys):
    """check_folder makes a missing folder to see that it can (then removes it): /proc refuses what
    permission bits allow; a file on the path is named."""
    from owai.io import check_folder

    check_folder(tmp_path / "a" / "b", "the test folder")
    assert list(tmp_path.iterdir()) == []
    if Path("/proc/self").is_dir():
        with pytest.raises(OwaiError, match=r"^the test folder cannot be made \(.+\): use another$"):
            check_folder(Path("/proc/owai-probe/x"), "the test folder", "use another")
    (tmp_path / "f").write_text("")
    with pytest.raises(OwaiError, match="^the test folder is not a folder$"):
        check_folder(tmp_path / "f", "the test folder")
    with pytest.raises(OwaiError, match=f"^the test folder cannot be made: {tmp_path / 'f'} is not a folder$"):
        check_folder(tmp_path / "f" / "g", "the test folder")
    if Path("/proc/self").is_dir():
        code, _, err = cli_in_process(["moons", *as_sets(TINY_MOONS), "--out", "/proc/owai-runs", "--quiet"], capsys)
        assert_refused(code, err, "the run folder /proc/owai-runs cannot be made (")


def test_out_that_is_a_broken_symlink_is_named(tmp_path, capsys):
    """--out (or the default runs/) as a dangling symlink was 'cannot create run directory under
    runs/<recipe>: File exists'."""
    out = tmp_path / "runs"
    out.symlink_to(tmp_path / "gone")
    code, _, err = cli_in_process(["moons", *as_sets(TINY_MOONS), "--out", str(out), "--quiet"], capsys)
    assert_refused(code, err, f"{out} is a broken symlink")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
