"""Bad input: one line on stderr naming the problem, non-zero exit, no traceback, no half run."""

from __future__ import annotations

import gc
import multiprocessing
import sys
import traceback
from pathlib import Path

import pytest
import torch
import yaml

from conftest import TINY_MOONS, Undecodable, cli_in_process, run_owai
from owai import recipes
from owai.errors import OwaiError


def assert_one_line_error(proc, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout + proc.stderr)  # bad input: exit code 2
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error:"), err
    for fragment in fragments:
        assert fragment in err, err


def no_runs(out: Path) -> bool:
    return not out.exists() or not any(out.rglob("config.yaml"))


def test_unknown_recipe_id(tmp_path):
    proc = run_owai("recipes", "run", "fig9.9", "--out", str(tmp_path / "runs"))
    assert_one_line_error(proc, "unknown recipe 'fig9.9'")
    assert no_runs(tmp_path / "runs")


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("id: broken\nparams: {seed: 1\n")
    proc = run_owai("recipes", "run", str(bad), "--out", str(tmp_path / "runs"))
    assert_one_line_error(proc, "not valid YAML", "line")
    assert no_runs(tmp_path / "runs")


def _recipe_variant(tmp_path: Path, edit) -> Path:
    data = yaml.safe_load((recipes.recipe_dir() / "three-moons.yaml").read_text())
    edit(data)
    path = tmp_path / "three-moons.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_unknown_key_in_recipe(tmp_path):
    path = _recipe_variant(tmp_path, lambda d: d["params"].update(sed=1))
    proc = run_owai("recipes", "run", str(path), "--out", str(tmp_path / "runs"))
    assert_one_line_error(proc, "unknown key 'sed'")
    assert no_runs(tmp_path / "runs")


def test_wrong_type_in_recipe(tmp_path):
    path = _recipe_variant(tmp_path, lambda d: d["presets"]["cpu"]["train"].update(steps="two"))
    proc = run_owai("recipes", "run", str(path), "--out", str(tmp_path / "runs"))
    assert_one_line_error(proc, "train.steps: expected int, got str")
    assert no_runs(tmp_path / "runs")


def test_bad_set_path(tmp_path):
    proc = run_owai("moons", "--set", "train.warmup=10", "--out", str(tmp_path / "runs"))
    assert_one_line_error(proc, "--set 'train.warmup=10'", "unknown key 'warmup' in train")
    assert no_runs(tmp_path / "runs")


def test_impossible_size(tmp_path):
    proc = run_owai("moons", *sum((["--set", s] for s in TINY_MOONS), []), "--set", "eval.n_sequences=0",
                    "--out", str(tmp_path / "runs"))
    assert_one_line_error(proc, "eval.n_sequences must be >= 1")
    assert no_runs(tmp_path / "runs")


def test_unwritable_run_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = run_owai("moons", "--out", str(blocker / "runs"))
    assert_one_line_error(proc, f"the run folder {blocker / 'runs'} cannot be made: {blocker} is not a folder")
    assert blocker.read_text() == "not a directory"


def test_corrupt_checkpoint_given_to_resume(tmp_path):
    out = tmp_path / "runs"
    sets = sum((["--set", s] for s in TINY_MOONS), [])
    proc = run_owai("moons", *sets, "--quiet", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    run_dir = next(out.glob("three-moons/*"))
    # make it look killed mid-way, then corrupt its newest checkpoint
    (run_dir / "results.json").unlink()
    ckpt = sorted((run_dir / "checkpoints" / "heads3-r0").glob("step-*"))[-1]
    tensors = ckpt / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-7] + b"garbage")
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    proc = run_owai("moons", "--resume", str(run_dir))
    assert_one_line_error(proc, "is corrupt", "sha256")
    after = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    assert before == after  # nothing was written
    assert not (run_dir / "results.json").exists()


def test_resume_of_a_non_run_directory(tmp_path):
    proc = run_owai("moons", "--resume", str(tmp_path))
    assert_one_line_error(proc, "is not a run directory")


def test_report_without_results(tmp_path):
    proc = run_owai("report", str(tmp_path / "missing"))
    assert_one_line_error(proc, "does not exist")


def test_unknown_option_is_a_usage_error_not_a_traceback():
    proc = run_owai("moons", "--bogus")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "No such option" in proc.stderr


def test_rich_features_resume_of_another_commands_run_names_that_command(tmp_path, capsys):
    """`rich-features --resume RUN` of another method's run said `stage '': choose pretrain, ...` (it read
    the run's missing stage); it names the command that resumes the run, as every other command does."""
    run = tmp_path / "moons-run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"recipe": "three-moons", "method": "three_moons", "preset": "cpu",
                                                     "overrides": [], "params": {}}))
    for stage in ([], ["--stage", "probe"]):
        code, _, err = cli_in_process(["rich-features", "--resume", str(run), *stage], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "is a run of `owai moons three-moons` (recipe three-moons), not of this command" in err, err


def test_a_run_resume_of_a_sweep_directory_says_it_is_a_sweep(tmp_path, capsys):
    """`--resume SWEEP_DIR` where a run is resumed said "config.yaml is missing (a sweep directory whose
    sweep.json is a file?)"; it names the sweep and the command that continues it."""
    from owai import sweep as sweeps

    sweep_dir = sweeps.create("three-moons", None, [], [], [0], tmp_path / "sweeps").path
    for args in (["recipes", "run"], ["moons"], ["eval", "icl"]):
        code, _, err = cli_in_process([*args, "--resume", str(sweep_dir)], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"a sweep directory, not a run directory; continue it with `owai sweep --resume {sweep_dir}`" in err, err


def test_study_commands_check_their_recipe_and_resume_alone(tmp_path, capsys):
    """dropout-ft and eval regbench: a recipe of another method, --resume with plan options,
    --resume of another method's sweep, and executor options that do not go together are each a
    one-line error."""
    from owai import sweep as sweeps

    moons = sweeps.create("three-moons", None, [], [], [0], tmp_path / "sweeps").path
    cases = [
        (["dropout-ft", "--recipe", "three-moons"], "recipe 'three-moons' runs method 'three_moons', not dropout_ft"),
        (["eval", "regbench", "--recipe", "three-moons"], "runs method 'three_moons', not regbench"),
        (["dropout-ft", "--resume", str(moons), "--dropout", "0.5"], "drop the other options"),
        (["eval", "regbench", "--resume", str(moons), "--model", "mm"], "drop the other options"),
        (["dropout-ft", "--resume", str(moons)], "is a sweep of three-moons, not a dropout-ft study"),
        (["eval", "regbench", "--resume", str(moons)], "is a sweep of three-moons, not a RegBench study"),
        (["dropout-ft", "--mem-gb", "4"], "SLURM options (--partition, --gpus-per-node, ...) need --executor slurm"),
        (["eval", "regbench", "--executor", "submitit-debug", "-w", "2"], "--workers is for --executor local"),
    ]
    for args, message in cases:
        code, _, err = cli_in_process([*args, "--out", str(tmp_path / "runs")], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, (args, err)
    assert no_runs(tmp_path / "runs") and not any((moons / "points").iterdir())


def test_recipes_show_takes_the_recipe_as_every_command_does(capsys):
    code, out, err = cli_in_process(["recipes", "show", "--recipe", "three-moons", "-q", "--json"], capsys)
    assert code == 0 and '"id": "three-moons"' in out, err


def test_run_commands_refuse_another_methods_recipe_and_a_missing_data_root(tmp_path, capsys):
    """mosaic-train and the ruler / harness / icl evaluations started a run of any recipe given with
    -r (a three-moons training under `owai eval ruler -r three-moons`); --data-root, given where no input
    is looked up under it (even naming no folder), was ignored. Each is a one-line error now."""
    models = tmp_path / "no-models"
    models.mkdir()
    cases = [
        (["mosaic-train", "-r", "three-moons"], "recipe 'three-moons' runs method 'three_moons', not lm_pretrain"),
        (["eval", "ruler", "-r", "three-moons", "-m", "reference:oracle"], "runs method 'three_moons', not ruler"),
        (["eval", "harness", "-r", "three-moons"], "runs method 'three_moons', not harness"),
        (["eval", "icl", "-r", "three-moons"], "runs method 'three_moons', not icl"),
        (["mosaic-train", "--data-root", str(tmp_path / "absent")], "data.root is unused here"),
        (["mosaic-train", "--data-root", str(tmp_path)],
         "data.root is unused here: no input of this run is looked up under a data root (--data-root): corpus owai-stories, "
         "tokenizer bpe-2048"),
        (["mosaic-eval", str(models), "--data-root", str(tmp_path)], "data.root is unused here"),
        (["mosaic-eval", str(models), "--set", "seed=3"], "seed is unused here: an evaluation draws nothing"),
        (["eval", "posloss", str(models), "--set", "seed=3"], "seed is unused here: an evaluation draws nothing"),
    ]
    for args, message in cases:
        code, _, err = cli_in_process([*args, "--out", str(tmp_path / "runs")], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, (args, err)
    assert no_runs(tmp_path / "runs")


def test_options_a_command_would_ignore_are_refused(tmp_path, capsys):
    """Each of these was accepted and had no effect (or, for the empty names, read the current
    directory): now one line, exit 2, nothing written."""
    out = ["--out", str(tmp_path / "runs")]
    run = str(tmp_path / "some-run")
    cases = [
        (["moons", "--resume", run, *out], "--out does not apply with --resume"),
        (["mosaic-train", "--resume", run, *out], "--out does not apply with --resume"),
        (["eval", "ruler", "--resume", run, *out], "--out does not apply with --resume"),
        (["sweep", "--resume", run, *out], "--out does not apply with --resume"),
        (["bonsai", "--resume", run, *out], "--out does not apply with --resume"),
        (["mosaic-train", "--resume", run, "-r", "fig3.9-posloss"], "drop --recipe/--size"),
        (["mosaic-train", "--resume", run, "--size", "tiny"], "drop --recipe/--size"),
        (["mosaic-train", "--dataset", "", *out], "data.source is empty"),
        (["mosaic-train", "--tokenizer", "", *out], "data.tokenizer is empty"),
        (["eval", "ruler", "-m", "reference:oracle", "--ctx", "32k,32K", *out], "give each context length once"),
        (["eval", "ruler", "-m", "reference:oracle", "--ctx", "4k,4096", *out], "give each context length once"),
        (["eval", "icl", "--labels", "both,semantic", *out], "both means semantic and anonymous; give it alone"),
        (["bonsai", "-r", "figA.2-twobits", "--method", "irm", *out], "--method does not apply to recipe 'figA.2-twobits'"),
        (["rich-features", "--dry-run", "--partition", "gpu"], "SLURM options (--partition, --gpus-per-node, ...) need --executor slurm"),
        (["rich-features", "--stage", "probe", "--networks", str(tmp_path / "absent"), *out],
         f"probe.networks: {tmp_path / 'absent'} is not a directory"),
        (["recipes", "show"], "name a RECIPE to show"),
    ]
    for args, message in cases:
        code, stdout, err = cli_in_process(args, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err and not stdout, (args, err)
    assert not (tmp_path / "runs").exists() and not any(tmp_path.iterdir())


def test_a_finished_command_ignores_ctrl_c_during_shutdown(monkeypatch, capsys):
    """A Ctrl-C in the moment after a command finished printed a traceback from torch's atexit
    handlers (or killed the process by the signal): the console entry point ignores it then."""
    import signal

    from owai.cli import main

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(sys, "argv", ["owai", "recipes", "list"])
    try:
        main()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    main(["recipes", "list"])  # in-process callers (tests, notebooks) keep their handler
    assert signal.getsignal(signal.SIGINT) is before
    capsys.readouterr()


def test_an_error_exit_after_torchs_import_was_cut_short_is_the_exit_code(monkeypatch):
    """A Ctrl-C while torch is being imported leaves a half-initialised torch.distributed in
    sys.modules; the exit looked it up by importing it again, which failed inside torch and ended
    in a traceback and exit code 1 instead of `error: interrupted` and 130."""
    import types

    from owai import cli

    for name in ("torch", "torch.distributed"):  # as the interrupted import left them: no attributes yet
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    with pytest.raises(SystemExit) as exited:
        cli._exit(130)
    assert exited.value.code == 130


@pytest.mark.parametrize("bad_id", ["../../escaped", "/tmp/absolute", ".hidden", "a/b"])
def test_a_recipe_id_cannot_name_a_folder_outside_out(tmp_path, capsys, bad_id):
    """A user's recipe file names its run directories OUT/<id>/...: an id with '/' or '..' would
    write them elsewhere."""
    path = _recipe_variant(tmp_path, lambda d: d.update(id=bad_id))
    code, _, err = cli_in_process(["recipes", "run", str(path), "--out", str(tmp_path / "out" / "runs")], capsys)
    assert code == 2 and err.startswith("error: recipe id") and "plain name" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["three-moons.yaml"]


def test_paths_with_brackets_are_printed_as_they_are(tmp_path, capsys):
    """Rich markup in a user's path ('[/]', '[bold]') is text, not a style: it once crashed the
    command after its run directory existed."""
    root = tmp_path / "q[/]" / "[bold]x"
    root.mkdir(parents=True)
    code, out, err = cli_in_process(["data", "list", "--data-root", str(root)], capsys)
    assert code == 0, err
    assert "[bold]" in out, out  # as text, not taken as a style
    out_dir = tmp_path / "o[/]"
    code, out, err = cli_in_process(["moons", *sum((["--set", s] for s in TINY_MOONS), []), "--out", str(out_dir)], capsys)
    assert code == 0, err
    (run,) = (out_dir / "three-moons").iterdir()
    assert f"results: {run / 'results.json'}" in out


def test_a_test_set_larger_than_memory_is_refused_before_the_run(tmp_path, capsys):
    code, _, err = cli_in_process(["moons", "linear", "--set", "eval.test_size=1000000000", "--out", str(tmp_path / "runs")],
                                  capsys)
    assert code == 2 and "eval.test_size=1000000000" in err and "lower eval.test_size" in err, err
    assert no_runs(tmp_path / "runs")


def test_study_tables_print_their_preset_in_brackets(capsys):
    """A study table's title ends in "[cpu]" (its preset): Rich dropped it as an unknown style."""
    from owai import console
    from owai.methods import camelyon17, regbench

    row = {"label": "ERM [rand]", "iid": {"mean": 0.5, "std": 0.1, "seeds": 2}, "ood": {}}
    console.stdout.print(camelyon17.study_table([row], "Table 2.6 [cpu]"))
    out = capsys.readouterr().out
    assert "[cpu]" in out and "ERM [rand]" in out, out
    table = regbench.study_table([], "Fig 3.10 [paper]")
    console.stdout.print(table)
    assert "[paper]" in capsys.readouterr().out


@pytest.mark.parametrize("index, expected", [
    (1, "cannot decode image sketch/dog/dog_0.png: broken data stream"),
    (0, "ValueError: bad value"),
])
def test_an_error_in_a_data_loader_worker_keeps_its_own_message(index, expected):
    """torch re-raises a worker's exception as "Caught OwaiError in DataLoader worker process 0." with
    the traceback below; the one-line error kept that first line and lost the file's name."""
    from owai.errors import one_line

    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(Undecodable(), [index]), num_workers=1,
                                         collate_fn=lambda batch: batch)
    with pytest.raises(Exception) as caught:
        next(iter(loader))
    assert one_line(caught.value) == expected
    traceback.clear_frames(caught.tb)  # the worker ends now (left to the garbage collector, torch's shutdown waits 5 s)


def test_a_command_whose_data_loader_worker_fails_says_the_workers_message(monkeypatch, capsys):
    """The command line printed torch's wrapper ("Caught OwaiError in DataLoader worker process 0.")
    and the worker's whole traceback, where the file it could not read is the message."""
    def status(*_args, **_kwargs):  # `owai data list` reading its data through a worker that fails
        return next(iter(torch.utils.data.DataLoader(torch.utils.data.Subset(Undecodable(), [1]), num_workers=1,
                                                     collate_fn=lambda batch: batch)))

    monkeypatch.setattr("owai.data.registry.status", status)
    before = set(multiprocessing.active_children())
    gc.disable()  # what the command leaves is released by its error path, not by a collection
    try:
        code, _, err = cli_in_process(["data", "list"], capsys)
        workers = set(multiprocessing.active_children()) - before
    finally:
        gc.enable()
    assert code == 2 and err.strip().splitlines() == ["error: cannot decode image sketch/dog/dog_0.png: broken data stream"], err
    assert not workers, f"the failed command's loader workers outlived it: {workers}"


def test_release_frames_drops_what_the_chained_errors_frames_held():
    """An error raised `from` another (owai's line for a worker's exception, say) is raised above the
    frames that held the run: those are on the cause's traceback, which must be cleared too."""
    import weakref

    from owai.errors import release_frames

    class Held:
        pass

    refs = []

    def run():
        model = Held()
        refs.append(weakref.ref(model))
        raise ValueError("worker failed")

    try:
        try:
            run()
        except ValueError as cause:
            raise OwaiError("cannot read the data") from cause
    except OwaiError as e:
        error = e  # kept, as a caller in a notebook keeps it
    assert refs[0]() is not None
    release_frames(error)
    assert refs[0]() is None and str(error) == "cannot read the data"


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGHUP"])
def test_a_run_stopped_by_sigterm_is_marked_interrupted(signum, tmp_path, monkeypatch, capsys):
    """SIGTERM (torchrun stopping its ranks, SLURM's cancel or time limit, `kill`) and SIGHUP (a closed
    terminal) ended a run at once, its status.json left `running`: they stop it as Ctrl-C does, marked
    interrupted, one line naming the signal, exit 128 + its number, the handlers restored after."""
    import json
    import os
    import signal

    sig = signal.Signals[signum]
    ignored = signal.signal(sig, signal.SIG_DFL)  # under nohup SIGHUP is ignored, and an ignored signal stays so
    before = signal.getsignal(sig)

    def stopped(self, cfg, run):
        os.kill(os.getpid(), sig)
        raise AssertionError("the signal did not stop the run")

    monkeypatch.setattr("owai.methods.three_moons.ThreeMoons.run", stopped)
    try:
        code, stdout, err = cli_in_process(["moons", "--out", str(tmp_path), *[a for s in TINY_MOONS for a in ("--set", s)]],
                                           capsys)
        after = signal.getsignal(sig)
    finally:
        signal.signal(sig, ignored)
    assert code == 128 + sig and err.strip().splitlines()[-1] == f"error: stopped by {signum}" and not stdout, err
    (status,) = tmp_path.glob("*/*/status.json")
    assert json.loads(status.read_text())["status"] == "interrupted"
    assert after is before


def test_a_signal_inside_a_nested_stop_block_still_names_the_signal(tmp_path, monkeypatch, capsys):
    """A SLURM sweep waits for its jobs inside its own `stop_on_termination` block, within the CLI's:
    the signal was recorded by the inner block alone, and the CLI said `error: interrupted`, exit 130.
    Every open block hears of it; and a `Terminated` pickles (a process may send it back)."""
    import os
    import pickle
    import signal

    from owai.errors import Terminated, stop_on_termination

    def stopped(self, cfg, run):
        with stop_on_termination():
            os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal did not stop the run")

    monkeypatch.setattr("owai.methods.three_moons.ThreeMoons.run", stopped)
    code, _, err = cli_in_process(["moons", "--out", str(tmp_path), *[a for s in TINY_MOONS for a in ("--set", s)]], capsys)
    assert code == 143 and err.strip().splitlines()[-1] == "error: stopped by SIGTERM", err
    again = pickle.loads(pickle.dumps(Terminated(signal.SIGHUP)))
    assert isinstance(again, Terminated) and again.signum == signal.SIGHUP
