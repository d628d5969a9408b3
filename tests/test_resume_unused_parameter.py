"""A parameter that has not received a gradient yet has no optimizer state (torch's optimizers
create it at the first step that reads its gradient), so a checkpoint lacks it: e.g. Memory Mosaics
v2's long-term memory, which reads nothing while data.block_size <= model.short_window, or whose
first gradient comes at the first long enough delay. Resuming must work in every checkpoint layout
and continue exactly as the uninterrupted run does, also when that first gradient comes after the
checkpoint (torch's state-dict loader had given such a parameter one zero-gradient step of state)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from owai.distributed import Parallel
from owai.runs import Run
from owai.train import LoopConfig, train_loop


class Stop(Exception):
    pass


class LateUse(torch.nn.Module):
    """Two linear maps; the loss reads the second only from update `late_from` on."""

    def __init__(self) -> None:
        super().__init__()
        self.early = torch.nn.Linear(4, 4)
        self.late = torch.nn.Linear(4, 4)


def train(run_dir: Path, layout: str, late_from: int, stop_after: int = 0) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """Train (or resume) 6 updates, checkpointing every 2; returns the logged losses and the weights."""
    torch.manual_seed(0)
    model = LateUse()
    parallel = Parallel(model, "ddp") if layout != "plain" else None
    module = parallel.module if parallel is not None else model
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    run_dir.mkdir(exist_ok=True)
    run = Run(run_dir)
    run.identity = {"command": "test"}
    data = torch.randn(6, 8, 4, generator=torch.Generator().manual_seed(1))

    def loss_at(step: int, micro: int) -> torch.Tensor:
        out = model.early(data[step])
        return (out + model.late(data[step]) if step >= late_from else out).square().mean()

    def after_step(done: int) -> None:
        if done == stop_after:
            raise Stop

    loop = LoopConfig(steps=6, checkpoint_every=2, log_every=1, sharded_checkpoints=layout == "sharded")
    try:
        train_loop(run, "stage", module, optimizer, loss_at, loop, after_step=after_step, parallel=parallel)
    except Stop:
        pass
    losses = {r["step"]: r["loss"] for r in run.metrics() if "loss" in r}
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("late_from", [3, 99], ids=["first-gradient-after-the-checkpoint", "never-trained"])
@pytest.mark.parametrize("layout", ["plain", "parallel", "sharded"])
def test_a_parameter_without_optimizer_state_resumes_exactly(tmp_path: Path, layout: str, late_from: int):
    reference_losses, reference = train(tmp_path / "reference", layout, late_from)
    train(tmp_path / "killed", layout, late_from, stop_after=3)  # the checkpoint of step 2 is the newest
    losses, weights = train(tmp_path / "killed", layout, late_from)
    assert losses == reference_losses
    assert set(weights) == set(reference)
    for name in reference:
        assert torch.equal(weights[name], reference[name]), name
