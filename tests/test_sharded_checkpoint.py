"""Sharded training state: meta-device construction + FSDP2 materialisation, activation
checkpointing, and the sharded checkpoint variant (torch.distributed.checkpoint) resuming across
world sizes. Two-process runs use torchrun with gloo on the CPU (tests/dist_train_worker.py); one
torchrun job runs all of them, the one-process runs happen in this process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import dist_train_worker as worker
from conftest import torchrun

from owai.checkpoint import (
    SHARDED_FORMAT,
    _weights_only_planner,
    NonFiniteError,
    is_sharded,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_shards,
    save_sharded_checkpoint,
)
from owai.distributed import Parallel
from owai.errors import OwaiError
from owai.models.lm import blocks, build_lm

REPO = Path(__file__).resolve().parents[1]
STEPS = 8  # checkpoints every 4 steps


def worker_jobs(nproc: int, spec: dict[str, Any], tmp: Path, fresh_inputs: Callable[[], None]) -> dict[str, Any]:
    """Run the jobs of `spec` in one torchrun job of tests/dist_train_worker.py; returns each job's
    result. `fresh_inputs` (re)makes the run directories the jobs read and change."""
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps({**spec, "out": str(tmp / "out.json")}))
    fresh_inputs()
    proc = torchrun(nproc, [str(REPO / "tests" / "dist_train_worker.py"), str(spec_path)], before_retry=fresh_inputs,
                    cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp / "out.json").read_text())
    fails = {job["name"] for job in spec["jobs"] if job.get("fails")}
    for name, result in results.items():
        failed = isinstance(result, dict) and "error" in result
        assert failed == (name in fails), f"{name}: {result}"
    return {name: r if name in fails or not isinstance(r, dict) else {int(k): v for k, v in r.items()}
            for name, r in results.items()}


def _flip_byte(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted one-process reference (full checkpoints), a one-process sharded run killed
    after step 5, and one torchrun job of 2 ranks: the same training, with activation checkpointing,
    the resume of the one-process run, and the meta-init checks."""
    tmp = tmp_path_factory.mktemp("sharded")
    reference = worker.train(str(tmp / "reference"), steps=STEPS, sharded=False)
    accumulated = worker.train(str(tmp / "reference-accumulated"), steps=STEPS, sharded=False, accumulate=2)
    worker.train(str(tmp / "killed"), steps=STEPS, sharded=True, stop_after=5)
    assert [p.name for p in list_checkpoints(tmp / "killed" / "checkpoints" / "gpt")] == ["step-000004"]

    def fresh_inputs() -> None:
        for name in ("two", "ac", "from-one", "corrupt", "two-accumulated", "dropout", "dropout-killed"):
            shutil.rmtree(tmp / name, ignore_errors=True)
        (tmp / "out.json").unlink(missing_ok=True)
        shutil.copytree(tmp / "killed", tmp / "from-one")
        shutil.copytree(tmp / "killed", tmp / "corrupt")  # rank 1 verifies this file (rank 0 .metadata)
        _flip_byte(tmp / "corrupt" / "checkpoints" / "gpt" / "step-000004" / "dcp" / "__0_0.distcp")

    jobs = [
        {"name": "meta", "kind": "meta"},
        {"name": "meta_ac", "kind": "meta", "args": {"activation_checkpointing": True}},
        {"name": "two", "kind": "train", "args": {"run_dir": str(tmp / "two"), "steps": STEPS}},
        {"name": "ac", "kind": "train", "args": {"run_dir": str(tmp / "ac"), "steps": STEPS, "activation_checkpointing": True}},
        {"name": "two-accumulated", "kind": "train", "args": {"run_dir": str(tmp / "two-accumulated"), "steps": STEPS, "accumulate": 2}},
        {"name": "grads", "kind": "grads"},
        *({"name": name, "kind": "train", "args": {"run_dir": str(tmp / run), "steps": STEPS, "model": {"dropout": 0.2},
                                                   "seed_per_rank": True, **extra}}
          for name, run, extra in [("dropout", "dropout", {}), ("dropout-killed", "dropout-killed", {"stop_after": 5}),
                                   ("dropout-resumed", "dropout-killed", {})]),
        {"name": "resumed", "kind": "train", "args": {"run_dir": str(tmp / "from-one"), "steps": STEPS}},
        {"name": "corrupt", "kind": "train", "args": {"run_dir": str(tmp / "corrupt"), "steps": STEPS}, "fails": True},
    ]
    return {"tmp": tmp, "reference": reference, "reference-accumulated": accumulated,
            **worker_jobs(2, {"jobs": jobs}, tmp, fresh_inputs)}


def assert_losses_equal(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    for step in steps:
        assert got[step] == pytest.approx(want[step], abs=2e-4), (step, got, want)


def test_two_fsdp_ranks_match_one_process(runs: dict[str, Any]):
    assert list(runs["reference"]) == list(range(1, STEPS + 1))
    assert runs["reference"][STEPS] < runs["reference"][1] - 0.3  # it learns
    assert_losses_equal(runs["two"], runs["reference"], range(1, STEPS + 1))
    # one checkpoint format, sharded variant: each rank's shards + rank 0's index, committed atomically
    stage = runs["tmp"] / "two" / "checkpoints" / "gpt"
    assert sorted(p.name for p in stage.iterdir()) == ["step-000004", "step-000008"]
    last = latest_checkpoint(stage)
    assert is_sharded(last)
    assert sorted(p.name for p in (last / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    meta = json.loads((last / "state.json").read_text())
    assert meta["format"] == SHARDED_FORMAT and sorted(meta["shards"]["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert meta["identity"]["model"]["transformer.wte.weight"] == [128, 32]  # whole shapes, not shards
    step, state = load_checkpoint(last, expect={"command": "dist-train-worker", "stage": "gpt"})
    assert step == STEPS and "model" not in state and len(state["recent_losses"]) == 1
    # the full variant is unchanged for one-process runs
    assert not is_sharded(latest_checkpoint(runs["tmp"] / "reference" / "checkpoints" / "gpt"))


def test_two_fsdp_ranks_accumulate_like_one_process_and_keep_gradients_sharded(runs: dict[str, Any]):
    """Gradient accumulation under FSDP (chapter 4's paper presets: 32 micro-batches per update on
    8 GPUs) trains as one process does, and reduce-scatters every micro-batch: FSDP2 without
    gradient sync kept the whole model's unsharded gradient on every rank between micro-batches
    (40 GB for v2 large), which the memory plan does not hold."""
    assert_losses_equal(runs["two-accumulated"], runs["reference-accumulated"], range(1, STEPS + 1))
    assert runs["reference-accumulated"][STEPS] != pytest.approx(runs["reference"][STEPS], abs=1e-3)  # other batches
    assert runs["grads"] is True


def test_a_resume_on_as_many_ranks_draws_each_rank_s_own_dropout(runs: dict[str, Any]):
    """Each rank draws its own dropout masks (seed + rank); a checkpoint keeps every rank's random
    state, so a 2-rank run resumed on 2 ranks replays the uninterrupted run. Only rank 0's state was
    kept, and every rank took it on resume: rank 1 then drew rank 0's masks."""
    assert runs["dropout"][STEPS] != pytest.approx(runs["two"][STEPS], abs=1e-3)  # dropout is on
    assert_losses_equal(runs["dropout-killed"], runs["dropout"], range(1, 6))
    assert_losses_equal(runs["dropout-resumed"], runs["dropout"], range(1, STEPS + 1))


def test_checkpoint_of_two_ranks_resumes_on_one_process(runs: dict[str, Any], tmp_path: Path):
    run = tmp_path / "run"
    shutil.copytree(runs["tmp"] / "two", run)
    shutil.rmtree(run / "checkpoints" / "gpt" / "step-000008")  # as if killed after step 4's checkpoint
    resumed = worker.train(str(run), steps=STEPS)
    assert_losses_equal(resumed, runs["reference"], range(1, STEPS + 1))


def test_checkpoint_of_one_process_resumes_on_two_ranks(runs: dict[str, Any]):
    assert_losses_equal(runs["resumed"], runs["reference"], range(1, STEPS + 1))
    stage = runs["tmp"] / "from-one" / "checkpoints" / "gpt"
    assert [p.name for p in list_checkpoints(stage)] == ["step-000004", "step-000008"]
    assert sorted(p.name for p in (stage / "step-000008" / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_meta_init_equals_the_plain_model(runs: dict[str, Any]):
    assert runs["meta"] is True and runs["meta_ac"] is True  # 2 ranks: the gathered shards
    assert worker.meta_matches_plain() and worker.meta_matches_plain(activation_checkpointing=True)  # 1 process


class Plain(torch.nn.Module):
    """Not a Hugging Face model: default inits, a buffer computed in __init__, a tied weight, inits of
    part of a tensor, and torch.nn.init functions that skip meta tensors (orthogonal_, trunc_normal_)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(2))
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("freq", 1.0 / (100 ** (torch.arange(0, 6, 2).float() / 6)))
        with torch.no_grad():
            self.blocks[0].weight[0].fill_(0.5)
            torch.nn.init.orthogonal_(self.blocks[1].weight)
            torch.nn.init.trunc_normal_(self.blocks[1].weight[:3], std=0.1)


@pytest.mark.parametrize("arch, config", [
    ("mm", dict(n_layer=2, n_embd=32, n_head=2, vocab_size=128, pmem_size=8)),
    ("lstm", dict(n_layer=1, n_embd=16, vocab_size=64)),
    ("plain", {}),
])
def test_meta_init_of_other_models_and_the_random_stream(arch: str, config: dict[str, Any]):
    """Without `seed`, from_meta draws from (and advances) the global stream like a normal build;
    buffers and tied weights come out right too."""
    def build() -> torch.nn.Module:
        return Plain() if arch == "plain" else build_lm(arch, **config)

    torch.manual_seed(7)
    plain = build()
    after_plain = torch.rand(3)
    torch.manual_seed(7)
    parallel = Parallel.from_meta(build, "fsdp", device=torch.device("cpu"), blocks_of=blocks if arch != "plain" else None)
    assert torch.equal(torch.rand(3), after_plain)
    got, want = parallel.module.state_dict(), plain.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert dict(parallel.module.named_buffers()).keys() == dict(plain.named_buffers()).keys()
    assert all(torch.equal(a, b) for a, b in zip(parallel.module.buffers(), plain.buffers(), strict=True))
    assert len(list(parallel.module.parameters())) == len(list(plain.parameters()))  # ties kept
    assert not any(p.is_meta for p in parallel.module.parameters())


def test_activation_checkpointing_gives_the_same_loss_and_gradients(runs: dict[str, Any]):
    assert_losses_equal(runs["ac"], runs["reference"], range(1, STEPS + 1))  # 2 FSDP ranks
    x, y = worker.batch(0, 0)
    grads, losses, calls = [], [], []
    for ac in (False, True):
        model = Parallel.from_meta(worker.build, "fsdp", device=torch.device("cpu"), blocks_of=blocks, seed=worker.SEED,
                                   activation_checkpointing=ac).module
        model.train()
        count = [0]
        model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        loss = torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        losses.append(loss.item())
        calls.append(count[0])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert calls == [1, 2]  # with checkpointing the block's forward runs again in the backward pass
    assert losses[0] == losses[1]
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-7, msg=name)


def one_line_error(run: Path, **train: Any) -> str:
    with pytest.raises(OwaiError) as info:
        worker.train(str(run), steps=STEPS, **train)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("damage, message", [
    (lambda ckpt: _flip_byte(ckpt / "dcp" / "__1_0.distcp"), "is corrupt: dcp/__1_0.distcp does not match its sha256"),
    (lambda ckpt: (ckpt / "dcp" / "__0_0.distcp").unlink(), "is incomplete: dcp/__0_0.distcp is missing"),
    (lambda ckpt: (ckpt / "dcp" / ".metadata").unlink(), "is incomplete: dcp/.metadata is missing"),
    (lambda ckpt: shutil.copy(ckpt / "dcp" / "__0_0.distcp", ckpt / "dcp" / "__2_0.distcp"), "dcp/__2_0.distcp is not one of its files"),
    (lambda ckpt: _flip_byte(ckpt / "tensors.safetensors"), "is corrupt: tensors.safetensors does not match its sha256"),
])
def test_corrupt_sharded_checkpoint_is_a_one_line_error(runs: dict[str, Any], tmp_path: Path, damage, message: str):
    run = tmp_path / "run"
    shutil.copytree(runs["tmp"] / "two", run)
    damage(run / "checkpoints" / "gpt" / "step-000008")
    assert message in one_line_error(run)


def test_corrupt_checkpoint_stops_every_rank_with_the_same_error(runs: dict[str, Any]):
    """The rank that finds the damage tells the others: all raise the same OwaiError (none hangs)."""
    assert runs["corrupt"]["error"].startswith("OwaiError: checkpoint ")
    assert runs["corrupt"]["error"].endswith("is corrupt: dcp/__0_0.distcp does not match its sha256")


def test_sharded_checkpoint_of_another_model_is_a_one_line_error(runs: dict[str, Any], tmp_path: Path):
    run = tmp_path / "run"
    shutil.copytree(runs["tmp"] / "two", run)
    assert "holds a model of another shape: transformer.wte.weight is [128, 32] there, [128, 48] here" in one_line_error(
        run, model={"n_embd": 48})
    assert "holds a model of another shape: transformer.h.2." in one_line_error(run, model={"n_layer": 3})
    # what DCP itself says when the shards do not fit (identity aside): one line too
    from owai.checkpoint import load_shards
    from owai.distributed import sharded_state

    model = worker.build(n_embd=48)
    model_state, optim_state = sharded_state(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(OwaiError, match=r"does not fit this model: Size mismatch .* for model.transformer.wte.weight$"):
        load_shards(run / "checkpoints" / "gpt" / "step-000008", {"model": model_state, "optimizer": optim_state})


def test_sharded_checkpoints_are_pruned_and_never_hold_nonfinite_values(tmp_path: Path):
    worker.train(str(tmp_path / "run"), steps=6, checkpoint_every=2, sharded=True)
    stage = tmp_path / "run" / "checkpoints" / "gpt"
    assert sorted(p.name for p in stage.iterdir()) == ["step-000002", "step-000004", "step-000006"]  # keep 3
    assert latest_checkpoint(stage).name == "step-000006"
    with pytest.raises(NonFiniteError, match=r"refusing to write checkpoint .*step-000007: model.w holds non-finite values"):
        save_sharded_checkpoint(stage, 7, {"model": {"w": torch.tensor([1.0, float("nan")])}}, {"torch_rng": torch.get_rng_state()})
    assert latest_checkpoint(stage).name == "step-000006" and not (stage / "step-000007").exists()


class _Marker:
    """A pickled object whose unpickling writes a file: what a tampered checkpoint could run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "ran"))


def test_a_tampered_sharded_checkpoint_runs_no_code(tmp_path: Path):
    """DCP reads `.metadata` with pickle.load and the optimizer's hyper-parameters with
    torch.load(weights_only=False): a run directory from elsewhere could run code on --resume. owai
    reads the metadata with DCP's classes only and those items weights-only. (The sha256 in
    state.json, rewritten here too, catches corruption, not tampering.)"""
    import hashlib
    import io
    import pickle

    worker.train(str(tmp_path / "run"), steps=2, checkpoint_every=2, sharded=True)
    last = latest_checkpoint(tmp_path / "run" / "checkpoints" / "gpt")
    marker = tmp_path / "ran.txt"
    metadata = last / "dcp" / ".metadata"
    metadata.write_bytes(pickle.dumps(_Marker(marker)))
    state = json.loads((last / "state.json").read_text())
    state["shards"]["files"][".metadata"] = hashlib.sha256(metadata.read_bytes()).hexdigest()
    (last / "state.json").write_text(json.dumps(state))
    load_checkpoint(last)  # the files are as state.json lists them
    with pytest.raises(OwaiError, match=r"cannot be read safely: \.metadata: pathlib\.Path\.write_text is not part of a checkpoint's metadata"):
        load_shards(last, {"model": {"w": torch.zeros(1)}})
    assert not marker.exists()

    planner = _weights_only_planner()
    item = io.BytesIO()
    torch.save(_Marker(marker), item)
    item.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(None, item)
    assert not marker.exists()
