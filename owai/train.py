"""The one training loop: schedule, optimisation, metrics, progress, checkpoints and resume.

The caller supplies `loss_at(step)`, which draws the batch for `step` deterministically (from
`runtime.derive_seed(seed, stage, step)`) and returns the loss. Because batches are a function of
the step, a run resumed from its last checkpoint replays exactly the updates that an
uninterrupted run would have made.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from owai.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from owai.console import Bar
from owai.errors import OwaiError
from owai.runs import Run


@dataclass
class LoopConfig:
    steps: int
    checkpoint_every: int = 100
    log_every: int = 10
    grad_clip: float = 0.0  # 0 = no clipping
    keep_checkpoints: int = 2


def train_loop(
    run: Run,
    stage: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_at: Callable[[int], torch.Tensor],
    loop: LoopConfig,
    lr_at: Callable[[int], float] | None = None,
    reset_optimizer_at: Callable[[int], bool] | None = None,
    after_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Train `model` for `loop.steps` updates under `run`, resuming from the stage's checkpoint.

    Optional hooks, both keyed by the step so that a resumed run replays them exactly:
    `reset_optimizer_at(step)` -> True clears the optimizer's state before update `step` (a fresh
    Adam with the same hyper-parameters, e.g. when a penalty switches on); `after_step(done)` runs
    after update `done` (1-based) is applied and logged and before its checkpoint is written, with
    the model in train mode (evaluations it logs with `run.log(stage, done, ...)` are trimmed on
    resume like the loss).

    Returns a summary {"final_loss", "steps"}; a stage that already finished is loaded from its
    final checkpoint without training.
    """
    if loop.steps <= 0:
        raise OwaiError(f"{stage}: train.steps must be > 0, got {loop.steps}")
    ckpt_dir = run.checkpoints(stage)
    start, recent = 0, []
    last = latest_checkpoint(ckpt_dir)
    if last is not None:
        start, state = load_checkpoint(last)
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        except (KeyError, RuntimeError, ValueError) as e:
            raise OwaiError(f"checkpoint {last} does not fit this model: {str(e).splitlines()[0]}") from None
        torch.set_rng_state(state["torch_rng"])
        recent = list(state["recent_losses"])
        run.trim_metrics(stage, start)
        if start >= loop.steps:
            return {"final_loss": _mean(recent), "steps": start}

    model.train()
    with Bar(f"train {stage}", total=loop.steps, completed=start) as bar:
        for step in range(start, loop.steps):
            if lr_at is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step)
            if reset_optimizer_at is not None and reset_optimizer_at(step):
                optimizer.state.clear()
            loss = loss_at(step)
            if not torch.isfinite(loss):
                raise OwaiError(f"{stage}: loss became {loss.item()} at step {step}; lower the learning rate")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if loop.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), loop.grad_clip)
            optimizer.step()
            done = step + 1
            recent = (recent + [loss.item()])[-loop.log_every :]
            if done % loop.log_every == 0 or done == loop.steps:
                run.log(stage, done, loss=_mean(recent), lr=optimizer.param_groups[0]["lr"])
                bar.update(0, status=f"loss {_mean(recent):.4g}")
            if after_step is not None:
                after_step(done)
                model.train()
            if done % loop.checkpoint_every == 0 or done == loop.steps:
                save_checkpoint(
                    ckpt_dir,
                    done,
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "torch_rng": torch.get_rng_state(),
                        "recent_losses": recent,
                    },
                    keep=loop.keep_checkpoints,
                )
            bar.update()
    model.eval()
    return {"final_loss": _mean(recent), "steps": loop.steps}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
