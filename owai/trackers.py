"""Experiment trackers: TensorBoard and Weights & Biases, off by default.

A tracker mirrors what `Run.log` writes to metrics.jsonl, which stays the source of truth (reports,
resume and claims read only metrics.jsonl). Only the process that writes the run directory (rank 0
under torchrun) opens one. Choose it with `--tracker NAME` or the config key `runtime.tracker`; each
needs its optional extra (`pip install 'owai[tensorboard]'` / `'owai[wandb]'`), checked before the
run directory exists.

A run that completes also mirrors its measured numbers (results.json's, the finite real ones) as the
stage "results" at step 0, "results/<metric>": an evaluation, which logs no metrics lines, has
those alone.

    tensorboard   event files under <run>/tensorboard/, one scalar tag "<stage>/<metric>" per number
    wandb         a W&B run named after the run directory, its config the resolved params; mode and
                  project from the usual WANDB_* variables (WANDB_MODE=offline works without network)
"""

from __future__ import annotations

import importlib.util
import math
import numbers
from pathlib import Path
from typing import Any, Protocol

from owai.errors import OwaiError

TRACKERS = ("none", "tensorboard", "wandb")
RESULTS_STAGE = "results"  # the stage under which a tracker mirrors a run's measured numbers (results.json)
# tracker -> (module that must import, the extra that installs it)
_NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


class Tracker(Protocol):
    def log(self, stage: str, step: int, values: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def require(name: str) -> None:
    """One-line error unless tracker `name` is known and its package is installed."""
    if name not in TRACKERS:
        raise OwaiError(f"unknown tracker {name!r}; choose one of {', '.join(TRACKERS)}")
    if name == "none":
        return
    module, extra = _NEEDS[name]
    if importlib.util.find_spec(module) is None:
        raise OwaiError(f"tracker {name!r} needs the {module} package: pip install 'owai[{extra}]'")


def scalars(values: dict[str, Any]) -> dict[str, float]:
    """The finite real numbers among a metrics line's values (bools and strings are not metrics)."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))}


class TensorBoardTracker:
    """Scalars to <run>/tensorboard/ through torch's SummaryWriter (TensorBoard's own event format)."""

    def __init__(self, run_path: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_path) / "tensorboard"))

    def log(self, stage: str, step: int, values: dict[str, Any]) -> None:
        for key, value in scalars(values).items():
            self.writer.add_scalar(f"{stage}/{key}", value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """One W&B run per owai run; resumed runs continue the same W&B run (id = the directory's name)."""

    def __init__(self, run_path: Path, config: dict[str, Any]) -> None:
        import wandb

        run_path = Path(run_path)
        self.wandb = wandb
        self.run = wandb.init(project=config.get("recipe", "owai"), name=run_path.name,
                              id=f"{run_path.parent.name}-{run_path.name}".replace("/", "-")[:128],
                              dir=str(run_path), config=config, resume="allow")

    def log(self, stage: str, step: int, values: dict[str, Any]) -> None:
        self.run.log({f"{stage}/{k}": v for k, v in scalars(values).items()} | {f"{stage}/step": step})

    def close(self) -> None:
        self.run.finish()


def open_tracker(name: str, run_path: Path, config: dict[str, Any]) -> Tracker | None:
    """The tracker `name` for the run at `run_path` (None for "none")."""
    require(name)
    if name == "tensorboard":
        return TensorBoardTracker(run_path)
    if name == "wandb":
        return WandbTracker(run_path, config)
    return None
