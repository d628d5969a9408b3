"""Train a tiny owai GPT through `owai.train.train_loop`, in one process or under torchrun.

Used by tests/test_sharded_checkpoint.py: imported, `train(...)` runs in the test's own process
(world size 1); launched as

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_train_worker.py SPEC.json

every rank runs the jobs listed in SPEC.json ({"out": path, "jobs": [{"kind": ..., ...}]}) in one
gloo process group and rank 0 writes {job name: result} to `out`. Kinds:
    train   `train(**args)`: the per-step losses of a run (FSDP2 via Parallel.from_meta)
    meta    `meta_matches_plain(**args)`: whether the materialised sharded model's full state dict
            equals a normally built model's
    grads   `sharded_grads_after_first_micro_batch()`: whether FSDP holds every gradient sharded
            after the first micro-batch of an accumulation

Batches are a function of the step: the global batch of GLOBAL_BATCH sequences is drawn from a
generator seeded by the step, and each rank keeps its own rows (as owai.methods.language_model's
`global_batch` does), so 1 and 2 processes train on the same data.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

if __name__ == "__main__":  # run as a script by torchrun: make `owai` importable from the repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from owai import distributed  # noqa: E402
from owai.distributed import Parallel  # noqa: E402
from owai.models.lm import adamw, blocks, build_lm  # noqa: E402
from owai.runs import Run  # noqa: E402
from owai.train import LoopConfig, train_loop  # noqa: E402

GPT = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=128, block_size=32, dropout=0.0)
GLOBAL_BATCH = 8
SEED = 1234


class Stop(Exception):
    """Raised after a given step, as if the job had been killed there."""


def build(**overrides: Any) -> torch.nn.Module:
    return build_lm("gpt", **{**GPT, **overrides})


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global micro-batch `micro` of update `step`: each token is 3 t + 1
    (mod V) of the one before, or with probability 0.1 a random one, so there is something to learn."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    vocab, length = GPT["vocab_size"], GPT["block_size"]
    seq = torch.empty(GLOBAL_BATCH, length + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (GLOBAL_BATCH,), generator=g)
    for i in range(length):
        seq[:, i + 1] = (3 * seq[:, i] + 1) % vocab
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=g), seq)
    w = distributed.world()
    per = GLOBAL_BATCH // w.world_size
    rows = seq[w.rank * per : (w.rank + 1) * per]
    return rows[:, :-1], rows[:, 1:]


def train(
    run_dir: str, steps: int = 8, checkpoint_every: int = 4, strategy: str = "fsdp", sharded: bool | None = None,
    activation_checkpointing: bool = False, stop_after: int = 0, model: dict[str, Any] | None = None,
    accumulate: int = 1, mixed_precision: str | None = None, lr: float = 1e-2, seed_per_rank: bool = False,
) -> dict[int, float]:
    """Train (or resume) the stage "gpt" of the run at `run_dir`; returns {step: loss} as logged
    (the mean over ranks). `stop_after` > 0 stops after that update, before its checkpoint.
    `seed_per_rank`: the random stream (dropout's) seeded SEED + rank, as owai.runtime seeds a run."""
    distributed.init()
    if seed_per_rank:
        torch.manual_seed(SEED + distributed.world().rank)
    device = torch.device("cpu")
    parallel = Parallel.from_meta(lambda: build(**(model or {})), strategy, device=device, blocks_of=blocks, seed=SEED,
                                  activation_checkpointing=activation_checkpointing, mixed_precision=mixed_precision)
    optimizer = adamw(parallel.module, lr=lr, weight_decay=0.1)
    path = Path(run_dir)
    if distributed.is_main():
        path.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    run = Run(path)
    run.writes = distributed.is_main()
    run.identity = {"command": "dist-train-worker"}

    def loss_at(step: int, micro: int) -> torch.Tensor:
        x, y = batch(step, micro)
        logits = parallel.forward_module(input_ids=x).logits
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def after_step(done: int) -> None:
        if done == stop_after:
            raise Stop(done)

    loop = LoopConfig(steps=steps, checkpoint_every=checkpoint_every, log_every=1, keep_checkpoints=3,
                      accumulate=accumulate, sharded_checkpoints=sharded)
    try:
        train_loop(run, "gpt", parallel.module, optimizer, loss_at, loop, after_step=after_step, parallel=parallel)
    except Stop:
        pass
    rows = distributed.broadcast_object(run.metrics() if distributed.is_main() else None)
    return {r["step"]: r["loss"] for r in rows if r.get("stage") == "gpt" and "loss" in r}


def meta_matches_plain(activation_checkpointing: bool = False) -> bool:
    """Whether `Parallel.from_meta` (sharded under torchrun) holds exactly the values of
    `torch.manual_seed(SEED); build()`, and leaves the caller's random stream alone."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    distributed.init()
    before = torch.get_rng_state()
    parallel = Parallel.from_meta(build, "fsdp", device=torch.device("cpu"), blocks_of=blocks, seed=SEED,
                                  activation_checkpointing=activation_checkpointing)
    untouched = torch.equal(before, torch.get_rng_state())
    full = get_model_state_dict(parallel.module, options=StateDictOptions(full_state_dict=True))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        plain = build().state_dict()
    same = full.keys() == plain.keys() and all(torch.equal(full[k], plain[k]) for k in plain)
    sharded = all(hasattr(p, "to_local") for p in parallel.module.parameters()) == parallel.fsdp
    return bool(untouched and same and sharded)


def sharded_grads_after_first_micro_batch() -> bool:
    """Whether, after the backward pass of the first of two micro-batches (inside the loop's
    `no_sync`), every parameter of the FSDP model holds its gradient as a shard (a DTensor), i.e.
    the micro-batch was reduce-scattered and no rank keeps the whole model's gradient."""
    distributed.init()
    parallel = Parallel.from_meta(build, "fsdp", device=torch.device("cpu"), blocks_of=blocks, seed=SEED)
    x, y = batch(0, 0)
    with parallel.no_sync(True):
        logits = parallel.forward_module(input_ids=x).logits
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
    return all(p.grad is not None and hasattr(p.grad, "to_local") for p in parallel.module.parameters())


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    distributed.init()
    results: dict[str, Any] = {}
    for job in spec["jobs"]:
        name, kind, args = job["name"], job["kind"], job.get("args", {})
        try:
            if kind == "train":
                results[name] = {str(k): v for k, v in train(**args).items()}
            elif kind == "meta":
                results[name] = meta_matches_plain(**args)
            elif kind == "grads":
                results[name] = sharded_grads_after_first_micro_batch()
            else:
                raise ValueError(f"unknown job kind {kind!r}")
        except Exception as e:  # noqa: BLE001 - reported to the test, which shows the message
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    if distributed.is_main():
        Path(spec["out"]).write_text(json.dumps(results))
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
