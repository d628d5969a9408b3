"""A parameter that has not received a gradient yet has no optimizer state (torch's optimizers
create it at the first step that reads its gradient), so a checkpoint lacks it. Resuming must
still work, in every checkpoint layout, and continue exactly as the uninterrupted run does: e.g.
Memory Mosaics v2's long-term memory reads nothing while data.block_size <= model.short_window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from owai.distributed import Parallel
from owai.runs import Run
from owai.train import LoopConfig, train_loop


class Stop(Exception):
    pass


class PartlyUsed(torch.nn.Module):
    """Two linear maps of which the loss only reads the first."""

    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def train(run_dir: Path, layout: str, stop_after: int = 0) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """Train (or resume) 6 updates, checkpointing every 2; returns the logged losses and the weights."""
    torch.manual_seed(0)
    model = PartlyUsed()
    parallel = Parallel(model, "ddp") if layout != "plain" else None
    module = parallel.module if parallel is not None else model
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    run_dir.mkdir(exist_ok=True)
    run = Run(run_dir)
    run.identity = {"command": "test"}
    data = torch.randn(6, 8, 4, generator=torch.Generator().manual_seed(1))

    def loss_at(step: int, micro: int) -> torch.Tensor:
        forward = parallel.forward_module if parallel is not None else model
        return forward(data[step]).square().mean()

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


@pytest.mark.parametrize("layout", ["plain", "parallel", "sharded"])
def test_a_parameter_without_optimizer_state_resumes(tmp_path: Path, layout: str):
    reference_losses, reference = train(tmp_path / "reference", layout)
    train(tmp_path / "killed", layout, stop_after=3)  # the checkpoint of step 2 is the newest
    losses, weights = train(tmp_path / "killed", layout)
    assert losses == pytest.approx(reference_losses, rel=0, abs=1e-6)
    assert set(weights) == set(reference)
    for name in reference:
        torch.testing.assert_close(weights[name], reference[name], rtol=0, atol=1e-6, msg=name)
