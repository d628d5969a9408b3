"""Non-finite state never passes silently (issue #26, item 1).

A training step that produces NaN/inf stops the run as `failed` before anything of that step is
written; a NaN checkpoint is never written or loaded, even with a re-written checksum; NaN metrics
make the run failed, not complete; and a run that failed on NaN continues from its last finite
checkpoint with `--resume RUN --set <optimisation key>=...`, recorded in config_history.jsonl.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_MOONS, cli_in_process
from safetensors.torch import load_file, save_file

from owai.checkpoint import NonFiniteError, list_checkpoints
from owai.errors import OwaiError
from owai.experiment import execute
from owai.runs import Run
from owai.train import LoopConfig, train_loop

# lr moves linearly from train.lr to train.lr_end: ending at 1.5e3 makes the tiny three-moons run
# blow up right after its step-2 checkpoint, at step 3 or 4. The exact step depends on the float
# arithmetic of the installed torch / numpy (1e3 blew up at step 4 in the older environment CI reused
# and at step 5, past the step-4 checkpoint, in a fresh one of 2026-11-26), so the tests read it from
# the run (deterministic within one install: batches are keyed by the step).
BLOWS_UP = [*TINY_MOONS, "train.lr_end=1.5e3", "train.log_every=1"]


def blow_up(run: Path) -> tuple[int, int]:
    """(the step that went non-finite, the stage's last finite checkpoint) of the failed run."""
    nonfinite = json.loads((run / "status.json").read_text())["nonfinite"]
    return nonfinite["step"], nonfinite["checkpoint"]


def one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory) -> Path:
    """A tiny three-moons run that failed on NaN after its step-2 checkpoint."""
    out = tmp_path_factory.mktemp("runs")
    with pytest.raises(NonFiniteError, match=r"heads3-r0: the (loss|parameters) became .* at step [34]"):
        execute("three-moons", None, BLOWS_UP, out=out)
    run = next((out / "three-moons").iterdir())
    step, checkpoint = blow_up(run)
    assert checkpoint == 2  # the resume tests continue from before the learning rate grew
    return run


@pytest.fixture
def run_dir(failed_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(failed_run, copy)
    return copy


def test_nan_step_marks_the_run_failed_and_writes_no_checkpoint(failed_run: Path):
    status = json.loads((failed_run / "status.json").read_text())
    assert status["status"] == "failed"
    step, checkpoint = blow_up(failed_run)
    assert status["nonfinite"] == {"stage": "heads3-r0", "step": step, "checkpoint": checkpoint}
    names = [p.name for p in list_checkpoints(failed_run / "checkpoints" / "heads3-r0")]
    assert names[-1] == f"step-{checkpoint:06d}"  # nothing of the non-finite step was written
    assert not (failed_run / "results.json").exists()


def test_report_suggests_a_resume_with_a_lower_learning_rate(failed_run: Path, capsys):
    code, _, err = cli_in_process(["report", str(failed_run)], capsys)
    one_line_error(code, err, "status: failed", f"--resume {failed_run} --set train.lr=0.001", "train.lr_end")


def test_resume_with_lower_lr_continues_from_the_last_finite_checkpoint(run_dir: Path, capsys):
    config_before = (run_dir / "config.yaml").read_text()
    _, checkpoint = blow_up(run_dir)
    code, _, err = cli_in_process(["moons", "--resume", str(run_dir), "--set", "train.lr_end=1e-5", "--quiet"], capsys)
    assert code == 0, err
    assert Run(run_dir).status() == "complete"
    assert (run_dir / "config.yaml").read_text() == config_before  # the original settings stay
    (entry,) = Run(run_dir).config_history()
    assert entry["overrides"] == ["train.lr_end=1e-5"] and entry["time"]
    assert entry["checkpoints"] == {"heads3-r0": checkpoint}
    results = json.loads((run_dir / "results.json").read_text())
    assert results["config_history"] == [entry]
    losses = [r for r in Run(run_dir).metrics() if r["stage"] == "heads3-r0" and "loss" in r]
    assert [r["step"] for r in losses] == [1, 2, 3, 4, 5, 6]  # steps past the checkpoint re-logged once
    assert all(math.isfinite(r["loss"]) for r in losses)
    assert losses[-1]["lr"] < 1e-2  # the new schedule: decaying towards 1e-5, not rising to 1e3


def test_resume_refuses_settings_outside_the_whitelist(run_dir: Path, capsys):
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    code, _, err = cli_in_process(["moons", "--resume", str(run_dir), "--set", "model.beta=3"], capsys)
    one_line_error(code, err, "--set model.beta", "only train.lr, train.lr_end can change")
    code, _, err = cli_in_process(["moons", "--resume", str(run_dir), "--set", "train.lr=fast"], capsys)
    one_line_error(code, err, "train.lr", "expected float")
    code, _, err = cli_in_process(["moons", "--resume", str(run_dir), "--preset", "paper"], capsys)
    one_line_error(code, err, "drop --preset")
    assert before == {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}  # nothing written
    assert not (run_dir / "config_history.jsonl").exists()


def test_nan_checkpoint_with_rewritten_checksum_is_refused(run_dir: Path, capsys):
    """The audit's case: NaN weights and a matching sha256 resumed to `complete`."""
    ckpt = run_dir / "checkpoints" / "heads3-r0" / f"step-{blow_up(run_dir)[1]:06d}"
    tensors = load_file(str(ckpt / "tensors.safetensors"))
    key = next(k for k in tensors if k.startswith("state/model/"))
    tensors[key] = torch.full_like(tensors[key], math.nan)
    save_file(tensors, str(ckpt / "tensors.safetensors"))
    meta = json.loads((ckpt / "state.json").read_text())
    meta["sha256"] = hashlib.sha256((ckpt / "tensors.safetensors").read_bytes()).hexdigest()
    (ckpt / "state.json").write_text(json.dumps(meta))
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    code, _, err = cli_in_process(["moons", "--resume", str(run_dir), "--set", "train.lr_end=1e-5"], capsys)
    one_line_error(code, err, "holds non-finite values", key)
    assert before == {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    assert not (run_dir / "results.json").exists()


def test_nan_metrics_make_the_run_failed_not_complete(tmp_path: Path, monkeypatch):
    from owai.methods import Outcome
    from owai.methods.three_moons import ThreeMoons

    def nan_outcome(self, cfg, run):  # what NaN weights gave in the audit
        return Outcome(measured={"heads1.val.accurate_from": 1.0, "heads1.disentanglement": math.nan})

    monkeypatch.setattr(ThreeMoons, "run", nan_outcome)
    with pytest.raises(OwaiError, match=r"non-finite metrics \(heads1.disentanglement\)"):
        execute("three-moons", None, TINY_MOONS, out=tmp_path)
    run = Run(next((tmp_path / "three-moons").iterdir()))
    assert run.status() == "failed" and run.results() is None
    assert run.status_info()["nonfinite"] == {"metrics": ["heads1.disentanglement"]}


def _linear_run(tmp_path: Path) -> tuple[Run, torch.nn.Linear]:
    torch.manual_seed(0)
    return Run(tmp_path), torch.nn.Linear(3, 1)


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
    return model(x).pow(2).mean()


def test_train_loop_stops_on_a_nan_loss_before_writing_that_step(tmp_path: Path):
    run, model = _linear_run(tmp_path)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_at(step: int, micro: int = 0) -> torch.Tensor:
        return _loss(model, step) * (math.nan if step == 2 else 1.0)

    with pytest.raises(NonFiniteError, match=r"s: the loss became nan at step 3 .*last finite checkpoint is step 2") as e:
        train_loop(run, "s", model, opt, loss_at, LoopConfig(steps=5, checkpoint_every=1, log_every=1))
    assert (e.value.stage, e.value.step, e.value.checkpoint) == ("s", 3, 2)
    assert [p.name for p in list_checkpoints(run.checkpoints("s"))] == ["step-000001", "step-000002"]
    assert [r["step"] for r in run.metrics()] == [1, 2]


def test_train_loop_stops_when_the_update_makes_parameters_non_finite(tmp_path: Path):
    run, model = _linear_run(tmp_path)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lr_at = lambda step: math.inf if step == 1 else 0.1  # noqa: E731 - a finite loss, then an inf update
    with pytest.raises(NonFiniteError, match="the parameters became non-finite at step 2"):
        train_loop(run, "s", model, opt, lambda s, m=0: _loss(model, s), LoopConfig(steps=3, checkpoint_every=1), lr_at)
    assert [p.name for p in list_checkpoints(run.checkpoints("s"))] == ["step-000001"]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None])
def test_the_finite_check_finds_one_bad_value_among_many_parameters(bad):
    """`_check_finite` reads every parameter once (`all_finite`: aminmax here, a multi-tensor inf norm on
    CUDA): one NaN or inf anywhere fails it; large finite values (whose 2-norm would overflow) and empty
    parameters do not."""
    from owai.train import _check_finite

    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(5)))
    model.append(torch.nn.Linear(0, 8, bias=False))  # an empty weight, as a shard can be
    with torch.no_grad():
        model[1].weight.fill_(1e30)
        if bad is not None:
            model[3].bias[5] = bad
    if bad is None:
        _check_finite("s", 2, 0.5, model, torch.device("cpu"), 1)
        return
    with pytest.raises(NonFiniteError, match="the parameters became non-finite at step 2"):
        _check_finite("s", 2, 0.5, model, torch.device("cpu"), 1)


def _finite_cases(device: str) -> list[tuple[list[torch.Tensor], bool]]:
    on = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    return [
        (on(torch.tensor([1.0, -math.inf], dtype=torch.bfloat16), torch.ones(3)), False),
        (on(torch.tensor([2.0, math.nan]), torch.ones(3, dtype=torch.bfloat16)), False),
        (on(torch.full((4,), 1e300, dtype=torch.float64), torch.ones(3, dtype=torch.bfloat16)), True),
        (on(torch.full((4,), 3e38), torch.empty(0)), True),
        (on(torch.empty(0)), True),
    ]


def test_all_finite_across_dtypes():
    """`all_finite` (the trainer's check and the checkpoints'): bf16 and float32 and float64 together; a
    float64 value too large for float32 is finite."""
    from owai.checkpoint import all_finite

    for tensors, finite in _finite_cases("cpu"):
        assert all_finite(tensors) is finite, tensors


@pytest.mark.gpu
def test_all_finite_across_dtypes_on_cuda():
    """The same on CUDA, where `all_finite` takes one multi-tensor inf norm (NaN propagating)."""
    from owai.checkpoint import all_finite

    for tensors, finite in _finite_cases("cuda"):
        assert all_finite(tensors) is finite, tensors


def test_accumulated_micro_batches_log_their_mean_loss_with_one_sync_per_update(tmp_path: Path, monkeypatch):
    """With train.accumulate, each micro-batch's loss stays on the device and the update's loss is read
    once: the logged loss is the micro-batches' mean as Python floats summed in order (as when each was
    read on its own), and `Tensor.item` / `tolist` run a fixed number of times per update, not once per
    micro-batch (a sync each on a GPU)."""
    run, model = _linear_run(tmp_path)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every update sees the same model
    losses = [torch.tensor(v) for v in (0.1, 0.7, 0.30000001, 1e-8)]
    expected = 0.0
    for value in losses:
        expected += value.item() / len(losses)
    reads = []
    for name in ("item", "tolist"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _o=original, _n=name: reads.append(_n) or _o(self))

    def loss_at(step: int, micro: int) -> torch.Tensor:
        return model(torch.zeros(1, 3)).sum() * 0 + losses[micro]

    train_loop(run, "s", model, opt, loss_at, LoopConfig(steps=2, accumulate=len(losses), log_every=1, checkpoint_every=2))
    assert [row["loss"] for row in run.metrics()] == [expected, expected]
    assert len(reads) <= 2 * 2, reads  # per update: the losses once, and the finiteness check's one read


def test_resumed_stage_takes_its_optimizer_settings_from_the_config(tmp_path: Path):
    """A resume builds the optimizer from the (possibly overridden) config; the checkpoint gives
    its state, not its lr, so `--set train.lr=...` takes effect even without an lr schedule."""
    run, model = _linear_run(tmp_path)
    loop = LoopConfig(steps=4, checkpoint_every=2, log_every=1)
    train_loop(run, "s", model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), lambda s, m=0: _loss(model, s),
               LoopConfig(steps=2, checkpoint_every=2))
    frozen = [p.detach().clone() for p in model.parameters()]
    fresh = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(fresh.parameters(), lr=0.0, momentum=0.9)  # "--set train.lr=0"
    train_loop(run, "s", fresh, opt, lambda s, m=0: _loss(fresh, s), loop)
    assert opt.param_groups[0]["lr"] == 0.0 and opt.state[fresh.weight]["momentum_buffer"] is not None
    for a, b in zip(fresh.parameters(), frozen):
        assert torch.equal(a, b)  # lr 0: steps 3 and 4 moved nothing


def test_save_checkpoint_refuses_non_finite_tensors(tmp_path: Path):
    from owai.checkpoint import save_checkpoint

    with pytest.raises(NonFiniteError, match="state/model/w holds non-finite values"):
        save_checkpoint(tmp_path / "s", 3, {"model": {"w": torch.tensor([1.0, math.inf])}})
    assert not (tmp_path / "s").exists()
    save_checkpoint(tmp_path / "s", 3, {"model": {"n": torch.tensor([1, 2])}, "loss": 0.5})  # ints: fine
