"""Run directories: the resolved config, environment facts, metrics, results, figures, checkpoints.

    runs/<recipe>/<YYYYmmdd-HHMMSS>-<confighash>/
        config.yaml       resolved config (recipe, preset, overrides, params), never rewritten
        config_history.jsonl  one line per resume that changed settings (--set): time, overrides
        env.json          owai version/commit, torch, device, seed, ranks, host and its CPU, start time, resumes
        status.json       running | complete | failed | interrupted (+ error; `nonfinite` when NaN/inf
                          stopped it; under torchrun the `rank` whose error stopped the job)
        error.rankR.json  under torchrun, the error that stopped rank R > 0, written by that rank
        metrics.jsonl     one JSON object per logged step: {"stage", "step", ...}
        results.json      measured numbers beside the thesis's (the one results writer)
        figures/*.png
        checkpoints/<stage>/step-XXXXXX/

A run directory is never reused for a different run: creation is exclusive.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from owai import __version__
from owai.errors import DataMissing, OwaiError, Terminated, first_line, one_line, termination_deferred
from owai.trackers import Tracker
from owai.values import finite_json
from owai.io import (atomic_write_bytes, atomic_write_figure, atomic_write_json, atomic_write_yaml, cannot_write, check_folder,
                     remove_write_temporaries)

CONFIG = "config.yaml"
ENV = "env.json"
STATUS = "status.json"
METRICS = "metrics.jsonl"
RESULTS = "results.json"
HISTORY = "config_history.jsonl"
ANSWERS = "answers.jsonl"  # an evaluation's answers so far (owai.evals.answers): what its resume does not ask again
RANK_ERRORS = "error.rank*.json"  # error.rankR.json: what stopped torchrun's rank R > 0 (Run.record_rank_error)
OUT = Path("runs")  # the results root when --out is not given: OUT/<recipe>/...
# status.json's error when rank 0 of a torchrun job lost its peers and no rank recorded an error of its own:
# a rank killed or crashed, or ranks waiting on each other until the collectives' timeout (a hang, which
# `distributed.lost_peer` also is: then no rank stopped, and rank0_error holds the timeout)
NO_RANK_ERROR = ("another rank stopped or hung without recording an error (one killed by a signal, e.g. SIGKILL from "
                 "the out-of-memory killer, or a native crash: torchrun's report names its rank and signal; a hang: "
                 "rank0_error names the timeout)")
SWEEP = "sweep.json"  # a sweep directory's plan (owai.sweep); a run directory has none
# What a run directory holds (see above): a resume writes them again, so one that is there as
# something else (a folder where a file belongs, a broken symlink) is refused before it writes.
RUN_FILES = (CONFIG, ENV, STATUS, METRICS, RESULTS, HISTORY, ANSWERS)
RUN_FOLDERS = ("figures", "checkpoints", "models")


def rank_error_name(rank: int) -> str:
    """The file in a run directory where torchrun's rank `rank` > 0 records its error (`RANK_ERRORS`)."""
    return RANK_ERRORS.replace("*", str(rank))


def is_sweep_dir(path: Path) -> bool:
    """Whether `path` is a sweep directory rather than a run directory."""
    return (Path(path) / SWEEP).is_file()


def entry_kind(path: Path) -> str:
    """What `path` is, in words: "a file", "a folder", "a broken symlink" (dangling or a loop),
    "a special file" (a device, a pipe, or a link to one) or "missing"."""
    path = Path(path)
    if path.is_dir():
        return "a folder"
    if path.is_file():
        return "a file"
    if not os.path.lexists(path):
        return "missing"
    return "a broken symlink" if not path.exists() else "a special file"


def check_entry(path: Path, folder: bool, what: str = "the run directory") -> None:
    """OwaiError unless `path` is absent or what `what` holds there: a folder (`folder`) or a regular file."""
    want = "a folder" if folder else "a file"
    kind = entry_kind(path)
    if kind not in ("missing", want):
        raise OwaiError(f"{path} is {kind}, not {want}: {what} is damaged")


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in file `path`; one that cannot be read, is not JSON or holds another value
    (a list, null) is an OwaiError naming it."""
    try:
        data = json.loads(Path(path).read_bytes())
    except OSError as e:
        raise OwaiError(f"{path} cannot be read ({e.strerror or type(e).__name__})") from None
    except ValueError:
        raise OwaiError(f"{path} is corrupt: not JSON") from None
    if not isinstance(data, dict):
        raise OwaiError(f"{path} is corrupt: not a JSON object")
    return data


# the JSON files of a saved model directory that owai reads (weights: owai.models.lm.check_saved_weights)
MODEL_JSON = ("config.json", "generation_config.json", "owai_tokenizer.json")


def check_saved_model(directory: Path) -> None:
    """Refuse a saved model directory whose JSON files (config.json, generation_config.json, the
    owai_tokenizer.json that names its tokenizer, and the tokenizer file that one names) are damaged:
    each must be a file holding a JSON object. A missing tokenizer file it names, or a run's model
    without its owai_tokenizer.json, is refused too: the model would otherwise be evaluated with
    another tokenizer (the default, or bpe-N trained on the evaluation corpus). Checked before a run exists."""
    read: dict[str, dict[str, Any]] = {}
    for name in MODEL_JSON:
        check_entry(directory / name, folder=False, what=f"the saved model {directory}")
        if (directory / name).is_file():
            read[name] = read_json_object(directory / name)
    spec = directory / "owai_tokenizer.json"
    if not os.path.lexists(spec) and saving_run(directory) is not None:
        # a run's models/<arch>/ always records its tokenizer: without it the default one would be used
        raise OwaiError(f"{spec} is missing: the model saved by run {directory.parent.parent} is damaged (it names the model's tokenizer)")
    named = read.get(spec.name, {}).get("file")
    if named is not None:
        file = directory / str(named)
        if entry_kind(file) != "a file":
            raise OwaiError(f"{spec} names the model's tokenizer {file}, which is {entry_kind(file)}: the saved model is damaged")
        if file.suffix == ".json":
            read_json_object(file)


def model_dirs(path: Path) -> list[tuple[str, Path]]:
    """(label, directory) of each saved model under `path`: a save_pretrained dir or a run dir
    (its models/<arch>/, as language-model training saves them); each checked by `check_saved_model`."""
    if not path.exists():
        raise DataMissing(f"model path not found: {path}")
    if (path / "config.json").is_file():
        found = [path]
    else:
        found = sorted(p for p in (path / "models").glob("*") if (p / "config.json").is_file()) if (path / "models").is_dir() else []
    if not found:
        raise OwaiError(f"{path} holds no saved model (no config.json, no models/<arch>/config.json)")
    for directory in found:
        check_saved_model(directory)
    return [(p.name, p) for p in found]


def saving_run(directory: Path) -> "Run | None":
    """The run that saved model directory `directory` (a run's models/<arch>/, beside its config.yaml),
    or None for a saved model of another origin (a copied folder, a save_pretrained directory)."""
    run_dir = directory.parent.parent
    if directory.parent.name == "models" and (run_dir / CONFIG).is_file():
        return Run(run_dir)
    return None


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


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The processor's name (Linux's /proc/cpuinfo, else what `platform` says), None when unknown.

    Recorded because float32 training on the CPU ends at different weights on different processors'
    kernels: one processor gave a stand-in's accuracy 81.5 with its AVX-512 kernels and 79.75 with
    AVX2 ones, the same code and settings (docs/results.md, Table 2.10)."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    return platform.processor() or None


def environment(device: str, dtype: str, seed: int) -> dict[str, Any]:
    import numpy
    import torch

    from owai import distributed

    facts: dict[str, Any] = {
        "owai_version": __version__,
        "owai_commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "device": device,
        "dtype": dtype,
        "seed": seed,
        # the job's processes (torchrun's ranks): a batch of train.batch_size x train.accumulate
        # sequences per rank is this many times larger per update (train.global_batch aside)
        "world_size": distributed.world().world_size,
        "torch_threads": torch.get_num_threads(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        # which vectorised kernels torch's CPU operators run (AVX512, AVX2, ...; ATEN_CPU_CAPABILITY
        # lowers it): with cpu, what a CPU run's numbers depend on beyond the code and the settings
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
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
            kind = entry_kind(path)
            if kind != "a folder":  # a broken symlink or a file where the run directory goes
                raise OwaiError(f"cannot create run directory {path}: it is {kind}") from None
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
    def open(cls, path: Path, check_layout: bool = True) -> "Run":
        """Open an existing run directory (for --resume and report), its files and folders checked
        by `check_layout` unless `check_layout` is False (report: it reads config.yaml and results.json only)."""
        path = Path(path)
        if path.is_file():
            raise OwaiError(f"{path} is a file, not a run directory")
        if not path.is_dir():
            raise OwaiError(f"run directory {path} does not exist")
        if not (path / CONFIG).is_file():
            kind = entry_kind(path / CONFIG)
            if os.path.lexists(path / SWEEP) or (path / "points").is_dir():
                raise OwaiError(f"{path} is not a run directory: {CONFIG} is {kind} (a sweep directory whose {SWEEP} is {entry_kind(path / SWEEP)}?)")
            raise OwaiError(f"{path} is not a run directory: {CONFIG} is {kind}")
        run = cls(path)
        if check_layout:
            run.check_layout()
        return run

    def check_layout(self) -> None:
        """Refuse a run directory that a resume would trip over half-way (its status never written):
        a file or folder of it that is something else (a folder where results.json belongs, a file
        or a broken symlink where a checkpoint folder belongs) or an unreadable env.json. Checked when
        the run is opened, before anything is written."""
        for name in RUN_FILES:
            check_entry(self.path / name, folder=False)
        for path in sorted(self.path.glob(RANK_ERRORS)):  # removed by the resume
            check_entry(path, folder=False)
        for name in RUN_FOLDERS:
            check_entry(self.path / name, folder=True)
        root = self.path / "checkpoints"
        for stage in sorted(root.iterdir()) if root.is_dir() else []:
            if stage.name.startswith("."):
                continue
            check_entry(stage, folder=True)
            for entry in sorted(stage.iterdir()) if stage.is_dir() else []:
                if entry.name.startswith("step-"):
                    check_entry(entry, folder=True)
        models = self.path / "models"
        for model in sorted(models.iterdir()) if models.is_dir() else []:  # models/<arch>/, saved when a stage ends
            if not model.name.startswith("."):
                check_entry(model, folder=True)
        self.env()

    def remove_write_temporaries(self) -> None:
        """Remove the temporary files that writes killed in this run directory left beside its files and
        figures (a kill between a write's start and its rename): for a resume, before it writes."""
        for folder in (self.path, self.figures):
            remove_write_temporaries(folder)

    # -- files --------------------------------------------------------------------------------
    @property
    def figures(self) -> Path:
        return self.path / "figures"

    def checkpoints(self, stage: str) -> Path:
        return self.path / "checkpoints" / stage

    def read_config(self) -> dict[str, Any]:
        from owai.config import load_yaml

        if not (self.path / CONFIG).is_file():
            raise OwaiError(f"{self.path} is not a run directory: {CONFIG} is {entry_kind(self.path / CONFIG)}")
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
        if not os.path.lexists(path):
            return []
        try:
            entries = [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
        except OSError as e:
            raise OwaiError(f"{path} cannot be read ({e.strerror or type(e).__name__})") from None
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

    def env(self) -> dict[str, Any]:
        """env.json ({} before it is written); an unreadable or corrupt one is an OwaiError naming it."""
        path = self.path / ENV
        if not os.path.lexists(path):
            return {}
        try:
            facts = read_json_object(path)
        except OwaiError as e:
            raise OwaiError(f"{e}; it records the environment the run started in: remove it to resume the run") from None
        if not isinstance(facts.get("resumed", []), list):
            raise OwaiError(f"{path} is corrupt: its resumed is not a list; remove it to resume the run")
        return facts

    def write_env(self, facts: dict[str, Any]) -> None:
        if not self.writes:
            return
        old = self.env()
        if old:  # a resume: keep the original facts, record this start
            old.setdefault("resumed", []).append({k: facts[k] for k in ("started", "host", "cpu", "cpu_capability", "device",
                                                                        "world_size", "argv")})
            facts = old
        atomic_write_json(self.path / ENV, facts)

    def set_status(self, status: str, **extra: Any) -> None:
        if not self.writes:
            return
        atomic_write_json(self.path / STATUS, {"status": status, "time": dt.datetime.now().isoformat(timespec="seconds"), **extra})

    def status(self) -> str:
        """running | complete | failed | interrupted, or "unknown" (status.json missing or unreadable)."""
        status = self.status_info().get("status")
        return status if isinstance(status, str) else "unknown"

    # -- what stopped a run -------------------------------------------------------------------
    def record_failure(self, error: BaseException, rank: int = 0, world_size: int = 1, **extra: Any) -> str | None:
        """Record what stopped the method: `error`, raised on `rank` of a job of `world_size` processes.

        Rank 0 (a single process included) writes status.json: `interrupted` after Ctrl-C or a stop
        signal (`signal` names it), else `failed` with the error (`extra` added). Another rank of a
        torchrun job writes only an error of its own, to its own error.rankR.json
        (`record_rank_error`). Under torchrun, what rank 0 sees of another rank's failure is a symptom:
        a lost peer (gloo's closed connection, an NCCL error: `distributed.lost_peer`) or torchrun's
        SIGTERM. Rank 0 then records the earliest error another rank wrote (status `failed`, that
        `rank`, its `error` and `host`, and rank 0's own under `rank0_error`), or, for a lost peer that
        no rank explained, says so (`NO_RANK_ERROR`), never the symptom as the cause. The write is not
        cut by a stop signal (`termination_deferred`: torchrun sends SIGTERM while rank 0 is writing);
        one that fails is left: the first error is the one to say. Returns, for rank 0 of a torchrun
        job that lost its peers, or that a stop signal ended after another rank recorded its error
        (NCCL: torchrun's SIGTERM while rank 0 waits in a collective), what it recorded as the cause
        (for its own error line), else None."""
        from owai import distributed

        stopped = isinstance(error, (KeyboardInterrupt, SystemExit))
        peer = not stopped and world_size > 1 and distributed.lost_peer(error)
        cause = None
        with termination_deferred(), contextlib.suppress(OwaiError):
            if not self.writes:
                if not (stopped or peer):
                    self.record_rank_error(rank, error)
                return None
            by = {"signal": error.args[0]} if isinstance(error, Terminated) else {}
            own = f"stopped by {by['signal']}" if by else "interrupted" if stopped else f"{type(error).__name__}: {error}"
            recorded = self.rank_errors(world_size) if world_size > 1 and (stopped or peer) else []
            if recorded:
                first = recorded[0]
                cause = f"rank {first['rank']} failed: {first['error']}"
                self.set_status("failed", error=first["error"], rank=first["rank"], host=first.get("host"), rank0_error=own)
            elif stopped:
                self.set_status("interrupted", **by)
            elif peer:
                cause = NO_RANK_ERROR
                self.set_status("failed", error=NO_RANK_ERROR, rank0_error=own, **extra)
            else:
                self.set_status("failed", error=own, **({"rank": 0} if world_size > 1 else {}), **extra)
        return cause if peer or (isinstance(error, Terminated) and cause is not None) else None

    def record_rank_error(self, rank: int, error: BaseException) -> None:
        """Rank `rank` > 0 of a torchrun job records the error that stopped it, itself, in its own
        error.rankR.json (rank, exception type, one-line error, host, time), atomically: only rank 0
        writes status.json, and at that moment rank 0 may be waiting in a collective for this very
        rank, being stopped by torchrun, or on another node. One writer per file, so a shared
        filesystem never holds a mix of two; rank 0 folds the earliest into status.json when it stops
        (`record_failure`), and `failure` reads them where it could not."""
        now = time.time()
        atomic_write_json(self.path / rank_error_name(rank), {
            "rank": rank, "type": type(error).__name__, "error": one_line(error, typed=True),
            "host": socket.gethostname(), "pid": os.getpid(),
            "time": dt.datetime.fromtimestamp(now).isoformat(timespec="milliseconds"), "timestamp": now})

    def rank_errors(self, world_size: int = 0) -> list[dict[str, Any]]:
        """The errors other ranks recorded (error.rankR.json), earliest first (by their clock, then
        rank); files that cannot be read are skipped. With `world_size`, each rank's file is also
        looked up by its name: on a network filesystem a directory listing may lag behind a file
        another host has just created, a lookup by name does not."""
        names = {p.name for p in self.path.glob(RANK_ERRORS)}
        names |= {rank_error_name(r) for r in range(1, world_size)}
        found = []
        for name in names:
            try:
                record = json.loads((self.path / name).read_bytes())
            except (OSError, ValueError):
                continue
            if isinstance(record, dict) and type(record.get("rank")) is int and isinstance(record.get("error"), str):
                found.append(record)

        def order(record: dict[str, Any]) -> tuple[float, int]:
            when = record.get("timestamp")
            return (when if isinstance(when, (int, float)) else math.inf, record["rank"])

        return sorted(found, key=order)

    def clear_rank_errors(self) -> None:
        """Remove the error.rankR.json files (a resume, before it writes: they were the stopped attempt's)."""
        for path in sorted(self.path.glob(RANK_ERRORS)):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                raise OwaiError(f"cannot remove {path} ({e.strerror or type(e).__name__}); the resumed run would report it") from None

    def failure(self) -> str | None:
        """What stopped the run, as one line (`owai report` of an unfinished run): status.json's error
        where rank 0 named the cause (`rank R: ...` under torchrun); else the earliest error a rank
        recorded in error.rankR.json (rank 0 killed before it could write: status `running`; stopped
        by torchrun before that file was there: `interrupted`; a lost peer); else status.json's error
        or the signal that stopped it; None when nothing says."""
        info = self.status_info()
        error = info.get("error") if isinstance(info.get("error"), str) else None
        rank = info.get("rank") if type(info.get("rank")) is int else None
        if info.get("status") == "failed" and error and (rank is not None or "rank0_error" not in info):
            return first_line(error if rank is None else f"rank {rank}: {error}")
        recorded = self.rank_errors()
        if recorded:
            return first_line(f"rank {recorded[0]['rank']}: {recorded[0]['error']}")
        if error:
            return first_line(error)
        return f"stopped by {info['signal']}" if isinstance(info.get("signal"), str) else None

    # -- metrics ------------------------------------------------------------------------------
    def log(self, stage: str, step: int, **values: Any) -> None:
        """Append one metrics line (flushed; a resume trims lines past the checkpoint)."""
        if not self.writes:
            return
        line = _metrics_line({"stage": stage, "step": step, **values})
        try:
            with open(self.path / METRICS, "a") as f:
                f.write(line + "\n")
        except OSError as e:  # a resume trims a partial line: the run can continue from its last checkpoint
            raise cannot_write(self.path / METRICS, e) from None
        if self.tracker is not None:
            self.tracker.log(stage, step, values)

    def metrics(self) -> list[dict[str, Any]]:
        """The logged metrics, one dict per line; lines that are not one (cut by a kill, damaged) are skipped."""
        path = self.path / METRICS
        if not path.exists():
            return []
        try:
            lines = path.read_bytes().splitlines()
        except OSError as e:
            raise OwaiError(f"{path} cannot be read ({e.strerror or type(e).__name__})") from None
        rows = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:  # a line cut by a kill (or not UTF-8)
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def trim_metrics(self, stage: str, step: int) -> None:
        """Drop the metrics a killed run logged for `stage` after its last checkpoint `step` (0: the
        stage starts again from scratch), and lines cut by the kill."""
        if not self.writes or not os.path.lexists(self.path / METRICS):
            return
        rows = [r for r in self.metrics() if not (r.get("stage") == stage and isinstance(r.get("step"), (int, float)) and r["step"] > step)]
        # lines of a run written before metrics were strict JSON may hold NaN: rewritten as `log` writes them
        atomic_write_bytes(self.path / METRICS, "".join(_metrics_line(r) + "\n" for r in rows).encode())

    # -- figures and results ------------------------------------------------------------------
    def save_figure(self, fig: Any, name: str) -> Path:
        """Save a matplotlib figure to figures/<name>.png atomically and close it."""
        import matplotlib.pyplot as plt

        path = self.figures / f"{name}.png"
        if not self.writes:
            plt.close(fig)
        else:
            self.figures.mkdir(exist_ok=True)  # a resumed run whose figures/ was removed
            atomic_write_figure(path, fig)
        return path

    def write_results(self, results: dict[str, Any]) -> Path:
        path = self.path / RESULTS
        if not self.writes:
            return path
        atomic_write_json(path, results)
        return path

    def results(self) -> dict[str, Any] | None:
        """results.json (None before it is written). One that cannot be read or is not an owai
        results file (its rows of metric and measured value, and the recipe's id) is an OwaiError
        naming it: never taken as missing, or as a run that measured nothing."""
        path = self.path / RESULTS
        if not os.path.lexists(path):
            return None
        try:
            results = read_json_object(path)
        except OwaiError as e:
            raise OwaiError(f"{e}; remove it and resume the run to write it again") from None
        rows = results.get("rows")
        if not (isinstance(results.get("recipe", ""), str) and isinstance(rows, list)
                and all(isinstance(r, dict) and isinstance(r.get("metric"), str) and "measured" in r for r in rows)):
            raise OwaiError(f"{path} is corrupt: not an owai results file; remove it and resume the run to write it again")
        return results


def _metrics_line(row: dict[str, Any]) -> str:
    """One metrics.jsonl line, strict JSON (NaN and infinities null), as `Run.log` appends it and
    `Run.trim_metrics` rewrites the kept ones."""
    return json.dumps(finite_json(row), default=float)


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
    check_folder(out, f"the run folder {out}")
