"""Mutants of the shared run machinery that no test caught, now caught: io.py (atomic writes),
checkpoint.py (what a checkpoint holds, what reaches the disk before its rename), train.py
(accumulation, clipping, a killed stage resuming to the same result, BestWeights' ties), runs.py
(exclusive run directories, atomic status / results / metrics, resume history) and claims.py
(tolerances and comparisons at their bounds, aggregates, the schema of `close`).

Each test names the rule it pins; all run in a second or two on a CPU."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from owai import claims as C
from owai.checkpoint import STATE, TENSORS, load_checkpoint, save_checkpoint
from owai.errors import OwaiError
from owai.io import atomic_write_bytes, remove_write_temporaries
from owai.runs import Run, config_hash, new_unique_dir
from owai.train import BestWeights, LoopConfig, train_loop

# --- io.py: atomic writes ------------------------------------------------------------------------------

def _record_disk_events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Every fsync (by the inode of the descriptor it flushes) and rename / replace (by destination), in order."""
    events: list[tuple[str, Any]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        events.append(("rename", str(dst)))
        real_rename(src, dst, *args, **kwargs)

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        events.append(("rename", str(dst)))
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    return events


def _fsynced(events: list[tuple[str, Any]]) -> set[int]:
    return {ino for kind, ino in events if kind == "fsync"}


def test_an_atomic_write_is_on_the_disk_before_its_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`replacing` fsyncs the temporary file before renaming it over the target: without it a power
    cut after the rename can leave an empty or half-written results.json where the old one was
    (the rename reaches the disk before the data). Pins the fsync in `io.replacing`."""
    events = _record_disk_events(monkeypatch)
    path = tmp_path / "results.json"
    atomic_write_bytes(path, b"{}\n")
    committed = events.index(("rename", str(path)))
    assert path.stat().st_ino in _fsynced(events[:committed])


def test_an_atomic_write_leaves_a_reader_of_the_old_file_its_whole_contents(tmp_path: Path) -> None:
    """A reader sees the old file or the new one, never a mix: the new contents go to a new file
    renamed over the old, so a reader that opened the old file still reads all of it. A write in
    place (truncate, then write) would hand that reader the new bytes, or none."""
    path = tmp_path / "status.json"
    path.write_bytes(b'{"status": "running"}\n')
    with open(path, "rb") as reader:
        atomic_write_bytes(path, b'{"status": "complete"}\n')
        assert reader.read() == b'{"status": "running"}\n'
    assert path.read_bytes() == b'{"status": "complete"}\n'


def test_a_resume_removes_only_owais_own_temporaries(tmp_path: Path) -> None:
    """`remove_write_temporaries` (a resume, before it writes) removes what killed writes left
    (`.NAME.write-HOST-PID-XXXX.tmp`, hidden) and nothing else: a user's own `notes.tmp` in the run
    directory is not owai's to delete."""
    (tmp_path / ".results.json.write-host-123-abcd.tmp").write_text("half")
    (tmp_path / "notes.tmp").write_text("mine")
    remove_write_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp"]


# --- checkpoint.py ---------------------------------------------------------------------------------------

def test_a_checkpoint_is_on_the_disk_before_its_rename_and_the_rename_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint is committed by renaming its folder: tensors.safetensors and state.json are
    fsynced before the rename (state.json names the tensors' sha256; a power cut must not leave a
    committed checkpoint whose files are empty), and the folder holding it after (the rename itself).
    Pins the three fsyncs of `checkpoint._commit`."""
    events = _record_disk_events(monkeypatch)
    directory = tmp_path / "checkpoints" / "s"
    final = save_checkpoint(directory, 3, {"w": torch.ones(2)})
    committed = events.index(("rename", str(final)))
    before, after = _fsynced(events[:committed]), _fsynced(events[committed + 1:])
    assert (final / TENSORS).stat().st_ino in before
    assert (final / STATE).stat().st_ino in before
    assert directory.stat().st_ino in after


def test_a_checkpoint_gives_back_the_structure_it_was_given(tmp_path: Path) -> None:
    """What a checkpoint holds comes back as it was saved: tuples as tuples (optimizer betas, a
    companion's pairs), lists as lists, integer dict keys as integers (optimizer state is keyed by
    parameter index), None and booleans as themselves, tensors bit for bit."""
    state = {"pair": (1, 2.5, "x"), "list": [1, (2, 3)], "by_index": {0: torch.arange(3.0), 7: None},
             "flag": True, "nothing": None, "nested": {"t": (torch.tensor([1.5]), [torch.zeros(2, 2)])}}
    _, back = load_checkpoint(save_checkpoint(tmp_path, 1, state))
    assert type(back["pair"]) is tuple and back["pair"] == (1, 2.5, "x")
    assert type(back["list"]) is list and type(back["list"][1]) is tuple and back["list"][1] == (2, 3)
    assert list(back["by_index"]) == [0, 7] and torch.equal(back["by_index"][0], torch.arange(3.0))
    assert back["by_index"][7] is None and back["flag"] is True and back["nothing"] is None
    assert type(back["nested"]["t"]) is tuple and torch.equal(back["nested"]["t"][0], torch.tensor([1.5]))


def test_saving_a_step_again_replaces_that_checkpoint(tmp_path: Path) -> None:
    """`save_checkpoint` of a step that already has a checkpoint (the same stage saved again, e.g.
    regbench's best epoch) replaces it whole, instead of failing on the folder already there."""
    save_checkpoint(tmp_path, 5, {"w": torch.zeros(2)})
    path = save_checkpoint(tmp_path, 5, {"w": torch.ones(2)})
    step, state = load_checkpoint(path)
    assert step == 5 and torch.equal(state["w"], torch.ones(2))


# --- train.py --------------------------------------------------------------------------------------------

class Killed(Exception):
    """Stands for a SIGKILL: raised in the loss of a chosen update, after the checkpoints before it."""


def _stage(run_dir: Path, loop: LoopConfig, seed: int = 0, kill_at: int | None = None) -> tuple[dict[str, Any], torch.nn.Module, Run]:
    """Train stage "s" of a small dropout network with Adam under `run_dir`, in a "process" whose
    initial weights and random stream come from `seed`; `kill_at`: the 0-based update that is killed."""
    run_dir.mkdir(exist_ok=True)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)

    def loss_at(step: int, micro: int) -> torch.Tensor:
        if step == kill_at:
            raise Killed
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1000 * step + micro))
        return model(x).pow(2).mean()

    run = Run(run_dir)
    return train_loop(run, "s", model, opt, loss_at, loop), model, run


def test_a_killed_stage_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    """A killed run resumes from its last checkpoint to the same result: weights, every metrics line
    and the returned loss equal the uninterrupted run's, although the resuming process starts from
    other weights and another random stream. The checkpoint must hold the optimizer's moments, the
    random generators (the dropout masks) and the recent losses (the first log line after the resume
    averages losses from before the kill: log_every 3, checkpoints every 2, killed in update 5)."""
    loop = LoopConfig(steps=6, checkpoint_every=2, log_every=3)
    ref, ref_model, ref_run = _stage(tmp_path / "ref", loop)
    with pytest.raises(Killed):
        _stage(tmp_path / "cut", loop, kill_at=4)
    got, model, run = _stage(tmp_path / "cut", loop, seed=1)
    assert got == ref
    assert run.metrics() == ref_run.metrics() and [r["step"] for r in run.metrics()] == [3, 6]
    for (name, a), (_, b) in zip(model.state_dict().items(), ref_model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def _overflowing_stage(run_dir: Path, kill_at: int | None = None) -> torch.Tensor:
    """A float16 stage whose first update overflows at GradScaler's initial scale (65536) and is
    skipped, halving the scale; at 32768 every later update fits (gradient 1e34 x scale < float32 max)."""
    run_dir.mkdir(exist_ok=True)
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-34)

    def loss_at(step: int, micro: int) -> torch.Tensor:
        if step == kill_at:
            raise Killed
        return (model.weight * 1e34).sum()

    train_loop(Run(run_dir), "s", model, opt, loss_at, LoopConfig(steps=4, checkpoint_every=2, precision="float16"))
    return model.weight.detach().clone()


def test_a_float16_stage_resumes_with_its_loss_scale(tmp_path: Path) -> None:
    """A float16 stage's checkpoint holds the GradScaler's state: resumed at the initial scale, the
    update after the checkpoint overflows and is skipped where the uninterrupted run applied it."""
    ref = _overflowing_stage(tmp_path / "ref")
    with pytest.raises(Killed):
        _overflowing_stage(tmp_path / "cut", kill_at=2)
    assert torch.equal(_overflowing_stage(tmp_path / "cut"), ref)
    assert not torch.equal(ref, torch.ones(1, 2))  # the run did move


def _one_update(tmp_path: Path, loop: LoopConfig, losses: Any) -> torch.Tensor:
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    train_loop(Run(tmp_path), "s", model, torch.optim.SGD(model.parameters(), lr=1.0),
               lambda step, micro: losses(model, micro), loop)
    return model.weight.detach().clone()


def test_accumulated_micro_batches_make_the_mean_gradient(tmp_path: Path) -> None:
    """Gradient accumulation: an update of `accumulate` micro-batches follows the mean of their
    gradients (one batch of all of them), not the sum: with SGD at lr 1, micro-batch gradients 1 and
    3 move the weight by 2."""
    weight = _one_update(tmp_path, LoopConfig(steps=1, accumulate=2),
                         lambda model, micro: model.weight.sum() * (1.0, 3.0)[micro])
    assert torch.equal(weight, torch.full((1, 2), -1.0))


@pytest.mark.parametrize("clip, moved", [(5.0, [3.0, 4.0]), (100.0, [30.0, 40.0]), (0.0, [30.0, 40.0])])
def test_gradient_clipping_bounds_the_norm_of_each_update(tmp_path: Path, clip: float, moved: list[float]) -> None:
    """train.grad_clip > 0 rescales the gradient to that norm when it is larger (a gradient of norm
    50 clipped at 5 moves the weight by a tenth of it); a larger clip, or 0 (none), leaves it."""
    weight = _one_update(tmp_path, LoopConfig(steps=1, grad_clip=clip),
                         lambda model, micro: (model.weight * torch.tensor([[30.0, 40.0]])).sum())
    assert weight.flatten().tolist() == pytest.approx([1.0 - m for m in moved], rel=1e-5)


def test_best_weights_keep_the_earlier_step_on_a_tie() -> None:
    """`BestWeights` (a stage's best epoch, regbench's checkpoints/best): a later step that only ties
    the best score does not replace it, as documented."""
    model = torch.nn.Linear(2, 1)
    best = BestWeights()
    best.offer(0.5, 1, model)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    best.offer(0.5, 2, model)
    assert best.step == 1 and torch.equal(best.state["weight"], first["weight"])
    best.offer(0.6, 3, model)
    assert best.step == 3 and torch.equal(best.state["weight"], model.weight)


# --- runs.py -----------------------------------------------------------------------------------------------

def test_a_run_directory_is_never_reused(tmp_path: Path) -> None:
    """Run directories are made exclusively: a second run of the same recipe, config and second gets
    `-1`, and a sweep point's directory that already exists (even empty) is refused, not filled."""
    first, second = new_unique_dir(tmp_path, "20260101-000000-abcd"), new_unique_dir(tmp_path, "20260101-000000-abcd")
    assert first != second and second.name == "20260101-000000-abcd-1"
    (tmp_path / "point").mkdir()
    with pytest.raises(OwaiError, match="already exists; continue it with --resume"):
        Run.create_at(tmp_path / "point", {"recipe": "r", "params": {}})
    assert list((tmp_path / "point").iterdir()) == []


def test_the_config_hash_does_not_depend_on_key_order() -> None:
    """A checkpoint's identity holds the config's hash: the same settings in another key order (a
    config.yaml read back, a dict built another way) are the same config, so a resume is not refused."""
    assert config_hash({"a": 1, "b": {"x": 1, "y": 2}}) == config_hash({"b": {"y": 2, "x": 1}, "a": 1})


def test_resuming_a_stage_from_scratch_keeps_the_other_stages_metrics(tmp_path: Path) -> None:
    """`trim_metrics(stage, step)` drops only that stage's lines past `step`: a stage that starts
    again from scratch (train_loop trims it to 0) leaves the finished stages' metrics alone."""
    run = Run(tmp_path)
    for stage, steps in (("a", 3), ("b", 2)):
        for step in range(1, steps + 1):
            run.log(stage, step, loss=float(step))
    run.trim_metrics("b", 0)
    assert [(r["stage"], r["step"]) for r in run.metrics()] == [("a", 1), ("a", 2), ("a", 3)]


def test_each_resumes_overrides_are_kept_in_the_history(tmp_path: Path) -> None:
    """config_history.jsonl records every resume that changed settings, oldest first: a second
    resume adds its line to the first's."""
    run = Run(tmp_path)
    run.record_overrides(["train.lr=0.1"], {"s": 2})
    run.record_overrides(["train.lr=0.01"], {"s": 4})
    assert [e["overrides"] for e in run.config_history()] == [["train.lr=0.1"], ["train.lr=0.01"]]


@pytest.mark.parametrize("writer, name", [
    (lambda run, i: run.set_status(("running", "complete")[i]), "status.json"),
    (lambda run, i: run.write_results({"recipe": "r", "rows": [{"metric": "m", "measured": i}]}), "results.json"),
    (lambda run, i: run.trim_metrics("s", 2 - i), "metrics.jsonl"),
    (lambda run, i: run.record_overrides([f"train.lr={i}"], {}), "config_history.jsonl"),
])
def test_the_run_files_a_reader_may_see_are_replaced_whole(tmp_path: Path, writer: Any, name: str) -> None:
    """status.json, results.json, metrics.jsonl's trim and config_history.jsonl are written to a new
    file renamed into place: a reader (`owai report` during a run) that opened the old one reads it
    whole, never a truncated or half-new file."""
    run = Run(tmp_path)
    for step in (1, 2):
        run.log("s", step, loss=0.5)
    writer(run, 0)
    old = (tmp_path / name).read_bytes()
    with open(tmp_path / name, "rb") as reader:
        writer(run, 1)
        assert reader.read() == old
    assert (tmp_path / name).read_bytes() != old


# --- claims.py -----------------------------------------------------------------------------------------

def _verdict(spec: dict[str, Any], record: dict[str, Any]) -> C.Verdict:
    return C.judge({"id": "c", "text": "t", **spec}, [record])


@pytest.mark.parametrize("spec, record, expected", [
    # close: |metric - target| <= tol, the bound included (1.5 - 1.0 is exactly 0.5)
    ({"kind": "close", "metric": "a", "target": 1.0, "tol": 0.5}, {"a": 1.5}, C.HOLDS),
    ({"kind": "close", "metric": "a", "target": 1.0, "tol": 0.5}, {"a": 1.75}, C.MISSES),
    # close, relative: rel * |target|, also for a negative target (within 10% of -2.0)
    ({"kind": "close", "metric": "a", "target": -2.0, "rel": 0.1}, {"a": -2.125}, C.HOLDS),
    ({"kind": "close", "metric": "a", "target": -2.0, "rel": 0.1}, {"a": -2.5}, C.MISSES),
    # direction: `to` - `from` above min_change; a change of exactly min_change, or none, is no rise
    ({"kind": "direction", "from": "a", "to": "b", "direction": "up", "min_change": 0.5}, {"a": 1.0, "b": 1.5}, C.MISSES),
    ({"kind": "direction", "from": "a", "to": "b", "direction": "up"}, {"a": 1.0, "b": 1.0}, C.MISSES),
    ({"kind": "direction", "from": "a", "to": "b", "direction": "down"}, {"a": 1.0, "b": 1.0}, C.MISSES),
    # compare: <= and >= include equality, < and > do not
    ({"kind": "compare", "left": "a", "op": "<=", "right": 2.0}, {"a": 2.0}, C.HOLDS),
    ({"kind": "compare", "left": "a", "op": "<", "right": 2.0}, {"a": 2.0}, C.MISSES),
    ({"kind": "compare", "left": "a", "op": ">", "right": 2.0}, {"a": 2.0}, C.MISSES),
])
def test_claims_are_judged_exactly_as_written_at_their_bounds(spec: dict[str, Any], record: dict[str, Any], expected: str) -> None:
    """Claims are judged exactly as written: a tolerance includes its bound, a relative tolerance is
    of |target|, a direction needs a change beyond min_change, and each op is itself at equality."""
    v = _verdict(spec, record)
    assert v.verdict == expected, v.detail


def test_the_mean_aggregate_is_the_mean_of_the_measured_members() -> None:
    """`{mean: [...]}` is the arithmetic mean of the members measured (an unmeasured one is left out,
    not counted as 0), as its number in the verdict shows."""
    spec = {"kind": "compare", "left": {"mean": ["a", "b", "c"]}, "op": ">", "right": 0.55}
    v = _verdict(spec, {"a": 0.5, "b": 0.75})
    assert v.numbers["mean(a, b, c)"] == 0.625 and v.verdict == C.HOLDS
    assert _verdict({**spec, "right": 0.7}, {"a": 0.5, "b": 0.75}).verdict == C.MISSES


def test_a_close_claim_with_both_tolerances_is_refused() -> None:
    """A `close` claim gives exactly one of tol (absolute) or rel (relative): with both, which one it
    is judged by would be a guess, so the recipe is refused when it loads."""
    spec = {"id": "x", "text": "t", "kind": "close", "metric": "a", "target": 1, "tol": 0.1, "rel": 0.1}
    with pytest.raises(OwaiError, match="give exactly one of tol"):
        C.check_claims([spec], "r", ["cpu"])
