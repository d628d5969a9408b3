"""Resume identity (issue #26, item 3): checkpoints record the command, recipe, method, config hash,
stage and model shapes; `--resume` refuses a run of another command, a checkpoint of another stage
or config, one without an identity, and a step beyond the stage's schedule."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_MOONS, cli_in_process

from owai.checkpoint import save_checkpoint
from owai.errors import OwaiError
from owai.experiment import resolve, run_identity
from owai.models.moon_memory import MoonMemory, MoonMemoryConfig
from owai.optim import MLXAdamW
from owai.recipes import load
from owai.runs import Run
from owai.train import LoopConfig, train_loop


def one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def new_run(out: Path, settings: list[str], run_dir: Path | None = None) -> Run:
    """A three-moons run directory as `owai moons` creates it (config.yaml, status running), with
    the identity its checkpoints get; nothing trained yet."""
    recipe = load("three-moons")
    _, resolved = resolve(recipe, None, settings)
    run = Run.create(out, recipe.id, resolved) if run_dir is None else Run.create_at(run_dir, resolved)
    run.identity = run_identity(recipe, resolved["params"])
    return run


def train_stage(run: Run, stage: str, heads: int, steps: int = 1) -> MoonMemory:
    """`steps` updates of a Nh=`heads` net in `stage`, checkpointed at the end."""
    torch.manual_seed(0)
    model = MoonMemory(MoonMemoryConfig(n_heads=heads))
    x = torch.randn(2, 9, 6, generator=torch.Generator().manual_seed(1))
    train_loop(run, stage, model, MLXAdamW(model.parameters(), lr=1e-2), lambda s, m=0: model(x[:, :-1]).sub(x[:, 1:]).square().mean(),
               LoopConfig(steps=steps, checkpoint_every=steps))
    return model


def files(path: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file()}


def test_resume_refuses_a_run_of_another_command(tmp_path: Path, capsys):
    run = new_run(tmp_path, TINY_MOONS)
    before = files(run.path)
    for args in (["mosaic-train", "--resume", str(run.path)], ["moons", "linear", "--resume", str(run.path)],
                 ["bonsai", "--resume", str(run.path)], ["recipes", "run", "fig3.8-depth", "--resume", str(run.path)]):
        code, out, err = cli_in_process(args, capsys)
        one_line_error(code, err, "is a run of `owai moons three-moons` (recipe three-moons), not of this command",
                       f"owai recipes run three-moons --resume {run.path}")
        assert out == ""
    assert files(run.path) == before and run.status() == "running"


def test_three_head_checkpoint_in_the_one_head_stage_is_refused(tmp_path: Path, capsys):
    run = new_run(tmp_path, [*TINY_MOONS, "model.heads=[1, 3]"])
    train_stage(run, "heads1-r0", 1)
    train_stage(run, "heads3-r0", 3)
    one_head = run.checkpoints("heads1-r0") / "step-000001"
    shutil.rmtree(one_head)
    shutil.copytree(run.checkpoints("heads3-r0") / "step-000001", one_head)  # same tensor shapes
    before = files(run.path)
    capsys.readouterr()  # the progress bars of the training above
    code, _, err = cli_in_process(["moons", "--resume", str(run.path)], capsys)
    one_line_error(code, err, str(one_head), "was written by stage 'heads3-r0', not 'heads1-r0'")
    assert files(run.path) == before
    with pytest.raises(OwaiError, match="stage 'heads3-r0', not 'heads1-r0'"):
        train_stage(run, "heads1-r0", 1)  # the training loop checks too


def test_checkpoint_of_another_config_or_model_is_refused(tmp_path: Path):
    run = new_run(tmp_path / "a", TINY_MOONS)
    train_stage(run, "heads3-r0", 3)
    other = new_run(tmp_path / "b", [*TINY_MOONS, "seed=7"])
    shutil.copytree(run.checkpoints("heads3-r0"), other.checkpoints("heads3-r0"))
    with pytest.raises(OwaiError, match="was written by config_hash"):
        train_stage(other, "heads3-r0", 3)
    (tmp_path / "c").mkdir()
    bare = Run(tmp_path / "c")  # no run identity: the stage and the model shapes still count
    for width in (1, 2):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, width)
        train = lambda: train_loop(bare, "s", model, torch.optim.SGD(model.parameters(), lr=0.1),  # noqa: E731
                                   lambda s, m=0: model.weight.sum(), LoopConfig(steps=2))
        if width == 1:
            train()
        else:
            with pytest.raises(OwaiError, match=r"holds a model of another shape: weight is \[1, 3\] there, \[2, 3\] here"):
                train()


def test_config_hash_allows_the_documented_resume_overrides():
    recipe = load("three-moons")
    base = run_identity(recipe, resolve(recipe, None, TINY_MOONS)[1]["params"])
    lower = run_identity(recipe, resolve(recipe, None, [*TINY_MOONS, "train.lr=1e-4", "train.lr_end=1e-7"])[1]["params"])
    other = run_identity(recipe, resolve(recipe, None, [*TINY_MOONS, "model.beta=3"])[1]["params"])
    assert base == lower
    assert base["config_hash"] != other["config_hash"]
    assert base == {"command": "owai moons three-moons", "recipe": "three-moons", "method": "three_moons",
                    "config_hash": base["config_hash"]}


def test_a_language_models_prefetch_depth_may_change_on_a_resume():
    """data.prefetch changes when a batch is read, not which: a run started on a GPU (auto: the
    thread) resumes with it off (or the reverse) under the same identity; data.block_size does not."""
    recipe = load("table4.2-pretrain")
    params = resolve(recipe, "cpu", ["data.prefetch=0"])[1]["params"]
    assert run_identity(recipe, params) == run_identity(recipe, resolve(recipe, "cpu", ["data.prefetch=4"])[1]["params"])
    assert "data.prefetch" in recipe.method_class().resume_overrides
    other = resolve(recipe, "cpu", ["data.prefetch=0", "data.block_size=64"])[1]["params"]
    assert run_identity(recipe, params) != run_identity(recipe, other)


def test_state_json_step_beyond_the_schedule_is_refused(tmp_path: Path):
    run = Run(tmp_path)
    train_stage(run, "s", 3, steps=2)
    ckpt = run.checkpoints("s") / "step-000002"
    meta = json.loads((ckpt / "state.json").read_text())
    meta["step"] = 9
    (ckpt / "state.json").write_text(json.dumps(meta))
    with pytest.raises(OwaiError, match="corrupt: its state.json says step 9"):
        train_stage(run, "s", 3, steps=2)
    ckpt.rename(run.checkpoints("s") / "step-000009")
    with pytest.raises(OwaiError, match="is at step 9, beyond stage s's 2 steps"):
        train_stage(run, "s", 3, steps=2)


def test_checkpoint_without_identity_is_refused(tmp_path: Path):
    run = Run(tmp_path)
    model = train_stage(run, "s", 3, steps=1)
    shutil.rmtree(run.checkpoints("s"))
    save_checkpoint(run.checkpoints("s"), 1, {"model": model.state_dict()})  # what an older owai wrote
    with pytest.raises(OwaiError, match="records no identity"):
        train_stage(run, "s", 3, steps=2)


def test_resume_of_a_sweep_point_refuses_set(tmp_path: Path, capsys):
    sweep = tmp_path / "sweep"
    run = new_run(tmp_path, TINY_MOONS, run_dir=sweep / "points" / "p0")
    (sweep / "sweep.json").write_text("{}")
    code, _, err = cli_in_process(["moons", "--resume", str(run.path), "--set", "train.lr=1e-3"], capsys)
    one_line_error(code, err, "is a sweep point")


def test_report_of_an_unfinished_run_names_the_resume_command(tmp_path: Path, capsys):
    run = new_run(tmp_path, TINY_MOONS)
    code, _, err = cli_in_process(["report", str(run.path)], capsys)
    one_line_error(code, err, "status: running", f"resume it with `owai recipes run three-moons --resume {run.path}`")
