"""Run directories: the resolved config, environment facts, metrics, results, figures, checkpoints.

    runs/<recipe>/<YYYYmmdd-HHMMSS>-<confighash>/
        config.yaml       resolved config (recipe, preset, overrides, params), never rewritten
        config_history.jsonl  one line per resume that changed settings (--set): time, overrides
        env.json          owai version/commit, torch, device, seed, host, start time, resumes
        status.json       running | complete | failed (+ error; `nonfinite` when NaN/inf stopped it)
        metrics.jsonl     one JSON object per logged step: {"stage", "step", ...}
        results.json      measured numbers beside the thesis's (the one results writer)
        figures/*.png
        checkpoints/<stage>/step-XXXXXX/

A run directory is never reused for a different run: creation is exclusive.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from owai import __version__
from owai.errors import DataMissing, OwaiError
from owai.trackers import Tracker
from owai.io import atomic_write_bytes, atomic_write_figure, atomic_write_json, atomic_write_yaml

CONFIG = "config.yaml"
ENV = "env.json"
STATUS = "status.json"
METRICS = "metrics.jsonl"
RESULTS = "results.json"
HISTORY = "config_history.jsonl"
SWEEP = "sweep.json"  # a sweep directory's plan (owai.sweep); a run directory has none


def is_sweep_dir(path: Path) -> bool:
    """Whether `path` is a sweep directory rather than a run directory."""
    return (Path(path) / SWEEP).is_file()


def model_dirs(path: Path) -> list[tuple[str, Path]]:
    """(label, directory) of each saved model under `path`: a save_pretrained dir or a run dir
    (its models/<arch>/, as language-model training saves them)."""
    if not path.exists():
        raise DataMissing(f"model path not found: {path}")
    if (path / "config.json").is_file():
        return [(path.name, path)]
    found = sorted(p for p in (path / "models").glob("*") if (p / "config.json").is_file()) if (path / "models").is_dir() else []
    if not found:
        raise OwaiError(f"{path} holds no saved model (no config.json, no models/<arch>/config.json)")
    return [(p.name, p) for p in found]


def config_hash(resolved: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()[:8]


def git_commit() -> str | None:
    """The owai source commit, when owai runs from a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment(device: str, dtype: str, seed: int) -> dict[str, Any]:
    import numpy
    import torch

    facts: dict[str, Any] = {
        "owai_version": __version__,
        "owai_commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "device": device,
        "dtype": dtype,
        "seed": seed,
        "torch_threads": torch.get_num_threads(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "argv": sys.argv,
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "resumed": [],
    }
    if device.startswith("cuda"):
        facts["cuda_device"] = torch.cuda.get_device_name()
        facts["cuda_version"] = torch.version.cuda
    return facts


class Run:
    """One run directory and the writers for everything in it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        # False on the non-zero ranks of a torchrun job: they read the run directory, only rank 0
        # writes to it (metrics, status, figures, results; train_loop does the same for checkpoints).
        self.writes = True
        # What every checkpoint of this run records and a resume must match (command, recipe,
        # method, config hash; set by owai.experiment); train_loop adds the stage and model shapes.
        self.identity: dict[str, Any] = {}
        # an experiment tracker (owai.trackers) that log() mirrors to; None = metrics.jsonl only
        self.tracker: Tracker | None = None

    # -- creation / opening -------------------------------------------------------------------
    @classmethod
    def create(cls, out: Path, recipe_id: str, resolved: dict[str, Any]) -> "Run":
        """Make a fresh run directory out/<recipe>/<time>-<hash>/ (exclusive: never overwrites)."""
        parent = Path(out) / recipe_id
        try:
            return cls._populate(new_unique_dir(parent, f"{timestamp()}-{config_hash(resolved)}"), resolved)
        except OSError as e:
            raise OwaiError(f"cannot create run directory under {parent}: {e.strerror or e}") from None

    @classmethod
    def create_at(cls, path: Path, resolved: dict[str, Any]) -> "Run":
        """Make a fresh run directory at exactly `path` (a sweep point); exclusive like create()."""
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir()
            return cls._populate(path, resolved)
        except FileExistsError:
            raise OwaiError(f"run directory {path} already exists; continue it with --resume") from None
        except OSError as e:
            raise OwaiError(f"cannot create run directory {path}: {e.strerror or e}") from None

    @classmethod
    def _populate(cls, path: Path, resolved: dict[str, Any]) -> "Run":
        """Fill a just-created (empty) run directory: layout, config.yaml, status running."""
        run = cls(path)
        (path / "figures").mkdir()
        (path / "checkpoints").mkdir()
        atomic_write_yaml(path / CONFIG, resolved)
        run.set_status("running")
        return run

    @classmethod
    def open(cls, path: Path) -> "Run":
        """Open an existing run directory (for --resume and report)."""
        path = Path(path)
        if path.is_file():
            raise OwaiError(f"{path} is a file, not a run directory")
        if not path.is_dir():
            raise OwaiError(f"run directory {path} does not exist")
        if not (path / CONFIG).is_file():
            raise OwaiError(f"{path} is not a run directory: {CONFIG} is missing")
        return cls(path)

    # -- files --------------------------------------------------------------------------------
    @property
    def figures(self) -> Path:
        return self.path / "figures"

    def checkpoints(self, stage: str) -> Path:
        return self.path / "checkpoints" / stage

    def read_config(self) -> dict[str, Any]:
        from owai.config import load_yaml

        try:
            data = load_yaml((self.path / CONFIG).read_text())
        except Exception as e:  # noqa: BLE001 - any parse failure is a corrupt run dir
            raise OwaiError(f"{self.path / CONFIG} is corrupt: {type(e).__name__}") from None
        if not isinstance(data, dict) or "recipe" not in data or "params" not in data:
            raise OwaiError(f"{self.path / CONFIG} is not a resolved owai config")
        return data

    def config_history(self) -> list[dict[str, Any]]:
        """The settings changed by resumes, oldest first: [{"time", "overrides", "checkpoints"}]."""
        path = self.path / HISTORY
        if not path.exists():
            return []
        try:
            entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except ValueError:
            raise OwaiError(f"{path} is corrupt") from None
        if not all(isinstance(e, dict) and isinstance(e.get("overrides"), list) for e in entries):
            raise OwaiError(f"{path} is corrupt")
        return entries

    def record_overrides(self, overrides: list[str], checkpoints: dict[str, int]) -> None:
        """Append one resume's `--set` overrides (and the stage checkpoints it continues from) to
        config_history.jsonl; config.yaml keeps the settings the run started with."""
        if not self.writes:
            return
        entry = {"time": dt.datetime.now().isoformat(timespec="seconds"), "overrides": list(overrides),
                 "checkpoints": checkpoints}
        lines = [json.dumps(e) for e in self.config_history()] + [json.dumps(entry)]
        atomic_write_bytes(self.path / HISTORY, ("\n".join(lines) + "\n").encode())

    def status_info(self) -> dict[str, Any]:
        """status.json as a dict ({} when missing or unreadable)."""
        try:
            info = json.loads((self.path / STATUS).read_text())
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def write_env(self, facts: dict[str, Any]) -> None:
        if not self.writes:
            return
        env_path = self.path / ENV
        if env_path.exists():  # a resume: keep the original facts, record this start
            old = json.loads(env_path.read_text())
            old.setdefault("resumed", []).append({k: facts[k] for k in ("started", "host", "device", "argv")})
            facts = old
        atomic_write_json(env_path, facts)

    def set_status(self, status: str, **extra: Any) -> None:
        if not self.writes:
            return
        atomic_write_json(self.path / STATUS, {"status": status, "time": dt.datetime.now().isoformat(timespec="seconds"), **extra})

    def status(self) -> str:
        try:
            return json.loads((self.path / STATUS).read_text())["status"]
        except (OSError, ValueError, KeyError):
            return "unknown"

    # -- metrics ------------------------------------------------------------------------------
    def log(self, stage: str, step: int, **values: Any) -> None:
        """Append one metrics line (flushed; a resume trims lines past the checkpoint)."""
        if not self.writes:
            return
        line = json.dumps({"stage": stage, "step": step, **values}, default=float)
        with open(self.path / METRICS, "a") as f:
            f.write(line + "\n")
        if self.tracker is not None:
            self.tracker.log(stage, step, values)

    def metrics(self) -> list[dict[str, Any]]:
        path = self.path / METRICS
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line cut by a kill
                continue
        return rows

    def trim_metrics(self, stage: str, step: int) -> None:
        """Drop the metrics a killed run logged for `stage` after its last checkpoint `step`."""
        if not self.writes:
            return
        rows = [r for r in self.metrics() if not (r.get("stage") == stage and r.get("step", 0) > step)]
        atomic_write_bytes(self.path / METRICS, "".join(json.dumps(r) + "\n" for r in rows).encode())

    # -- figures and results ------------------------------------------------------------------
    def save_figure(self, fig: Any, name: str) -> Path:
        """Save a matplotlib figure to figures/<name>.png atomically and close it."""
        import matplotlib.pyplot as plt

        path = self.figures / f"{name}.png"
        if not self.writes:
            plt.close(fig)
        else:
            atomic_write_figure(path, fig)
        return path

    def write_results(self, results: dict[str, Any]) -> Path:
        path = self.path / RESULTS
        if not self.writes:
            return path
        atomic_write_json(path, results)
        return path

    def results(self) -> dict[str, Any] | None:
        path = self.path / RESULTS
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError:
            raise OwaiError(f"{path} is corrupt") from None


def timestamp() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def new_unique_dir(parent: Path, base: str) -> Path:
    """Create and return parent/base, or parent/base-1, -2, ... : never an existing directory."""
    parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1000):
        path = parent / (base if attempt == 0 else f"{base}-{attempt}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise OwaiError(f"cannot create a new directory under {parent}: {base}-* all exist")


def ensure_writable(out: Path) -> None:
    """Fail early, before any work, if run directories cannot be created under `out`."""
    out = Path(out)
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise OwaiError(f"cannot create run directory under {out}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OwaiError(f"cannot create run directory under {out}: {probe} is not writable")
