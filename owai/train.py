"""The one training loop: schedule, optimisation, metrics, progress, checkpoints and resume.

The caller supplies `loss_at(step, micro)`, which draws micro-batch `micro` of update `step`
deterministically (from `runtime.derive_seed(seed, stage, step, micro)`) and returns its loss.
Because batches are a function of the step, a run resumed from its last checkpoint replays exactly
the updates that an uninterrupted run would have made.

The same loop serves the small exact experiments (one micro-batch, float32, one process) and the
language models (gradient accumulation, bf16/fp16 autocast, DDP/FSDP under torchrun through an
`owai.distributed.Parallel`): only the `LoopConfig` changes. Under torchrun every rank runs the loop;
only rank 0 writes metrics and checkpoints.

Non-finite state never passes: after every update the loss and the parameters are checked, and a
NaN or inf stops the stage with `NonFiniteError` before anything of that step is written, so the
stage's newest checkpoint is always finite. Each checkpoint records its identity (the run's
command, recipe, method and config hash, plus the stage and the model's tensor shapes); a resume
refuses a checkpoint of another identity, or one past the stage's schedule.
"""

from __future__ import annotations

import contextlib
import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from owai import distributed
from owai.checkpoint import (
    NonFiniteError,
    all_finite,
    is_sharded,
    latest_checkpoint,
    load_checkpoint,
    load_shards,
    remove_leftovers,
    save_checkpoint,
    save_sharded_checkpoint,
    verify_shard_files,
)
from owai.console import Bar
from owai.errors import OwaiError, one_line
from owai.runs import Run
from owai.runtime import AUTOCAST_DTYPES, derive_seed

if TYPE_CHECKING:
    from owai.distributed import Parallel

PRECISIONS = ("float32", "bfloat16", "float16")


@dataclass
class LoopConfig:
    steps: int
    checkpoint_every: int = 100
    log_every: int = 10
    grad_clip: float = 0.0  # 0 = no clipping
    keep_checkpoints: int = 2
    accumulate: int = 1  # micro-batches per update (gradient accumulation)
    precision: str = "float32"  # autocast dtype; float16 adds a GradScaler
    tokens_per_step: int = 0  # global tokens per update, for the tokens/s metric (0 = not logged)
    flops_per_token: float = 0.0  # training FLOPs per token (3 x forward; owai.plan), for MFU on CUDA (0 = none)
    # checkpoints of the sharded variant (every rank writes its own shards with DCP; owai.checkpoint);
    # None: sharded exactly when `parallel` is fsdp. Either variant resumes on any world size.
    sharded_checkpoints: bool | None = None


def train_loop(
    run: Run,
    stage: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_at: Callable[[int, int], torch.Tensor],
    loop: LoopConfig,
    lr_at: Callable[[int], float] | None = None,
    reset_optimizer_at: Callable[[int], bool] | None = None,
    after_step: Callable[[int], None] | None = None,
    parallel: "Parallel | None" = None,
    companion: Any | None = None,
) -> dict[str, Any]:
    """Train `model` for `loop.steps` updates under `run`, resuming from the stage's checkpoint.

    Optional hooks, both keyed by the step so that a resumed run replays them exactly:
    `reset_optimizer_at(step)` -> True clears the optimizer's state before update `step` (a fresh
    Adam with the same hyper-parameters, e.g. when a penalty switches on); `after_step(done)` runs
    after update `done` (1-based) is applied and logged and before its checkpoint is written, with
    the model in train mode (evaluations it logs with `run.log(stage, done, ...)` are trimmed on
    resume like the loss).

    `companion` (an object with `state_dict()` / `load_state_dict(state)`) holds training state
    outside the model and optimizer that the loss depends on (GroupDRO's group weights, LfF's loss
    averages); it is saved in every checkpoint and restored on resume.

    With `parallel`, the loss function calls `parallel.forward_module` and the logged loss is the
    mean over ranks. Checkpoints hold the full state gathered to rank 0, or, with
    `loop.sharded_checkpoints` (by default for fsdp), each rank's shards (torch.distributed.checkpoint);
    a resume reads either variant, written on any number of ranks, into the model as it is now laid out.

    On resume, the optimizer's hyper-parameters (lr, weight decay, momentum, ... of each param
    group) are the ones `optimizer` was built with, not the checkpoint's: its state (moments) is
    restored, its settings come from the config, so a resume with `--set train.lr=...` takes effect.

    Returns a summary {"final_loss", "steps"}; a stage that already finished is loaded from its
    final checkpoint without training.
    """
    if loop.steps <= 0:
        raise OwaiError(f"{stage}: train.steps must be > 0, got {loop.steps}")
    if loop.accumulate < 1:
        raise OwaiError(f"{stage}: train.accumulate must be >= 1, got {loop.accumulate}")
    if loop.precision not in PRECISIONS:
        raise OwaiError(f"{stage}: precision must be one of {', '.join(PRECISIONS)}, got {loop.precision!r}")
    device = next(model.parameters()).device
    main = distributed.is_main()
    scaler = torch.amp.GradScaler(device.type, enabled=loop.precision == "float16")
    amp_dtype = AUTOCAST_DTYPES.get(loop.precision)

    module = parallel.module if parallel is not None else model
    sharded = loop.sharded_checkpoints if loop.sharded_checkpoints is not None else (
        parallel is not None and parallel.strategy == "fsdp")

    def get_state() -> tuple[dict[str, Any], dict[str, Any]]:
        if parallel is None:
            return model.state_dict(), optimizer.state_dict()
        return parallel.state_dict(optimizer)

    ckpt_dir = run.checkpoints(stage)
    if main:  # what a run killed while saving a checkpoint left: no save is under way yet
        remove_leftovers(ckpt_dir, loop.keep_checkpoints)
    identity = {**run.identity, "stage": stage}
    start, recent = 0, []
    last = latest_checkpoint(ckpt_dir)
    if last is None and main:  # from scratch: what a run killed before this stage's first checkpoint logged goes
        run.trim_metrics(stage, 0)
    if last is not None:
        shards: dict[str, Any] | None = None
        if is_sharded(last):  # read into this run's layout, whatever wrote it
            model_shards, optim_shards = distributed.sharded_state(module, optimizer)
            shards = {"model": model_shards, "optimizer": optim_shards}
            start, state = load_checkpoint(last, expect={**identity, "model": _shapes(model_shards)}, verify_shards=False)
            verify_shard_files(last)
        else:
            expect = dict(identity) if parallel is not None else {**identity, "model": _shapes(model.state_dict())}
            start, state = load_checkpoint(last, expect=expect)
        if start > loop.steps:
            raise OwaiError(f"checkpoint {last} is at step {start}, beyond stage {stage}'s {loop.steps} steps")
        settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        try:
            if shards is not None:
                load_shards(last, shards)
                distributed.load_sharded_state(module, optimizer, shards["model"], shards["optimizer"])
            elif parallel is None:
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
            else:
                parallel.load_state_dict(optimizer, state["model"], state["optimizer"])
            for group, own in zip(optimizer.param_groups, settings, strict=True):
                group.update(own)
            if "scaler" in state:
                scaler.load_state_dict(state["scaler"])
            if companion is not None:
                companion.load_state_dict(state.get("companion", {}))
        except (KeyError, RuntimeError, ValueError) as e:
            raise OwaiError(f"checkpoint {last} does not fit this model: {one_line(e)}") from None
        _restore_rng(state, device)
        recent = list(state["recent_losses"])
        if main:
            run.trim_metrics(stage, start)
        if start >= loop.steps:
            model.eval()  # as a stage that trains to its end leaves it
            return {"final_loss": _mean(recent), "steps": start}

    model.train()
    saved = start  # the step of the stage's newest checkpoint (0: none yet)
    clock, clock_step = time.perf_counter(), start
    with Bar(f"train {stage}", total=loop.steps, completed=start) as bar:
        for step in range(start, loop.steps):
            if lr_at is not None:  # a group's "lr_scale" (e.g. a 10x last-layer lr) multiplies the schedule
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step) * group.get("lr_scale", 1.0)
            if reset_optimizer_at is not None and reset_optimizer_at(step):
                optimizer.state.clear()
            optimizer.zero_grad(set_to_none=True)
            micro_losses = []  # kept on the device: one sync per update, not one per micro-batch
            for micro in range(loop.accumulate):
                skip_sync = micro < loop.accumulate - 1
                with parallel.no_sync(skip_sync) if parallel is not None else contextlib.nullcontext():
                    with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                        loss = loss_at(step, micro)
                    scaler.scale(loss / loop.accumulate).backward()
                micro_losses.append(loss.detach())
            step_loss = 0.0
            for value in torch.stack(micro_losses).double().tolist():  # summed as Python floats, in order
                step_loss += value / loop.accumulate
            if loop.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), loop.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            done = step + 1
            _check_finite(stage, done, step_loss, model, device, saved)
            recent = (recent + [step_loss])[-loop.log_every :]
            if done % loop.log_every == 0 or done == loop.steps:
                mean_loss = distributed.mean_across_ranks(_mean(recent), device)
                elapsed, clock = time.perf_counter() - clock, time.perf_counter()
                speed = _speed(loop, done - clock_step, elapsed, device)
                clock_step = done
                if main:
                    run.log(stage, done, loss=mean_loss, lr=optimizer.param_groups[0]["lr"], **speed)
                bar.update(0, status=f"loss {mean_loss:.4g}")
            if after_step is not None:
                after_step(done)
                model.train()
            if done % loop.checkpoint_every == 0 or done == loop.steps:
                rngs = _rng_states(device)  # a collective: every rank's generators, in rank order
                if sharded:
                    _save_sharded(ckpt_dir, done, module, optimizer, recent, rngs, scaler, companion, loop, identity, main)
                else:
                    model_state, optim_state = get_state()
                    if main:
                        state = {
                            "model": model_state,
                            "optimizer": optim_state,
                            "rng_ranks": rngs,
                            "recent_losses": recent,
                        }
                        if scaler.is_enabled():
                            state["scaler"] = scaler.state_dict()
                        if companion is not None:
                            state["companion"] = companion.state_dict()
                        identity["model"] = _shapes(model_state)
                        save_checkpoint(ckpt_dir, done, state, keep=loop.keep_checkpoints, identity=identity)
                    distributed.barrier()
                saved = done
            bar.update()
    model.eval()
    return {"final_loss": _mean(recent), "steps": loop.steps}


def _save_sharded(ckpt_dir: Any, done: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer, recent: list[float],
                  rngs: list[dict[str, torch.Tensor]], scaler: Any, companion: Any, loop: LoopConfig,
                  identity: dict[str, Any], main: bool) -> None:
    """Checkpoint `done` of the sharded variant: every rank its shards, rank 0 the rest (a collective)."""
    model_shards, optim_shards = distributed.sharded_state(module, optimizer)
    rest: dict[str, Any] = {}
    if main:
        rest = {"rng_ranks": rngs, "recent_losses": recent}
        if scaler.is_enabled():
            rest["scaler"] = scaler.state_dict()
        if companion is not None:
            rest["companion"] = companion.state_dict()
    identity["model"] = _shapes(model_shards)
    save_sharded_checkpoint(ckpt_dir, done, {"model": model_shards, "optimizer": optim_shards}, rest,
                            keep=loop.keep_checkpoints, identity=identity)


class BestWeights:
    """The best-scoring weights of a training stage so far, with their score and step (or epoch).
    Usable as `train_loop`'s companion (or inside one), so a resumed stage keeps the same choice.
    The copy lives on the CPU; ties keep the earlier step."""

    def __init__(self) -> None:
        self.value: float | None = None
        self.step = 0
        self.state: dict[str, torch.Tensor] = {}

    def offer(self, value: float, step: int, model: torch.nn.Module) -> None:
        if self.value is None or value > self.value:  # ties keep the earlier step
            self.value, self.step = value, step
            self.state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "step": self.step, "state": self.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value, self.step, self.state = state["value"], int(state["step"]), dict(state["state"])


def _rng_states(device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Every rank's random-number generators (the CPU's, and the CUDA device's, which draws dropout
    on a GPU), in rank order: a collective. Ranks draw different dropout masks (seeded seed + rank,
    `owai.runtime`), so a checkpoint keeps each rank's state, not rank 0's alone."""
    own = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        own["cuda"] = torch.cuda.get_rng_state(device)
    return distributed.gather_objects(own)


def _restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Each rank's generators as the checkpoint left them, so a resume on as many ranks draws the
    dropout masks an uninterrupted run would. A rank the checkpoint did not have (a resume on more
    ranks) seeds its own stream from the saved states and its rank, distinct from every other
    rank's. A checkpoint written before per-rank states holds rank 0's CPU state alone (`torch_rng`)."""
    saved = state.get("rng_ranks")
    if not saved:
        torch.set_rng_state(state["torch_rng"])
        return
    rank = distributed.world().rank
    if rank >= len(saved):
        torch.manual_seed(derive_seed("resume", len(saved), rank, saved[0]["cpu"].numpy().tobytes().hex()))
        return
    torch.set_rng_state(saved[rank]["cpu"])
    if device.type == "cuda" and "cuda" in saved[rank]:
        torch.cuda.set_rng_state(saved[rank]["cuda"], device)


def _shapes(state: dict[str, Any]) -> dict[str, list[int]]:
    """{name: shape} of a model state dict (recorded in, and compared with, a checkpoint)."""
    return {k: list(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def _check_finite(stage: str, done: int, loss: float, model: torch.nn.Module, device: torch.device, saved: int) -> None:
    """Raise NonFiniteError if update `done` gave a non-finite loss or parameter on any rank
    (every rank agrees, so none waits alone in a collective). One device sync per update."""
    params_ok = all_finite([p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()])
    bad = distributed.mean_across_ranks(float(not (math.isfinite(loss) and params_ok)), device) > 0
    if bad:
        what = f"the loss became {loss:.4g}" if not math.isfinite(loss) else "the parameters became non-finite"
        where = f"the last finite checkpoint is step {saved}" if saved else "no checkpoint yet"
        raise NonFiniteError(f"{stage}: {what} at step {done} (nothing of that step was written; {where})",
                             stage, done, saved)


def _speed(loop: LoopConfig, steps: int, seconds: float, device: torch.device) -> dict[str, float]:
    """Throughput and peak memory since the last log line, for loops that count tokens (timings
    differ between runs, so the exact small experiments leave them out of metrics.jsonl)."""
    if not loop.tokens_per_step:
        return {}
    tokens_per_s = loop.tokens_per_step * steps / max(seconds, 1e-9)
    speed = {"step_s": seconds / max(steps, 1), "tokens_per_s": tokens_per_s, "peak_mem_gb": peak_memory_gb(device)}
    peak = peak_flops(device, loop.precision)
    if loop.flops_per_token and peak:
        speed["mfu"] = tokens_per_s * loop.flops_per_token / (peak * distributed.world().world_size)
    return speed


# dense tensor-core peak FLOP/s per GPU (bf16/fp16; tf32 for float32), by device name, for MFU
PEAK_FLOPS = {"H100": (989e12, 494e12), "H200": (989e12, 494e12), "A100": (312e12, 156e12), "L40S": (362e12, 181e12)}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The GPU's peak FLOP/s at `precision` (None off CUDA or for an unknown GPU: no MFU logged)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, tf32) in PEAK_FLOPS.items():
        if key in name:
            return half if precision in ("bfloat16", "float16") else tf32
    return None


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, else the peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
