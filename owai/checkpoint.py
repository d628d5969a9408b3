"""The one checkpoint format: safetensors for tensors, JSON for the rest, committed atomically.

A checkpoint is a directory `step-000123/` holding
  tensors.safetensors   every tensor of the state (model, optimizer, RNG), flat keys
  state.json            the state's structure with tensors replaced by references, the step,
                        the sha256 of tensors.safetensors and, for a training stage, its
                        identity (command, recipe, method, config hash, stage, model shapes)
It is written under a temporary name and renamed into place, so a killed process leaves either a
whole checkpoint or none. Loading verifies the checksum before anything is used, and tensors are
read with safetensors (no pickle). A checkpoint holding a non-finite floating-point tensor (NaN or
inf weights) is never written and never loaded: resuming from it could only produce garbage that
looks like a result.

The sharded variant (format owai-checkpoint-v2, written by FSDP runs: `save_sharded_checkpoint`)
is the same directory with the model and optimizer state in a torch.distributed.checkpoint (DCP)
directory `dcp/` instead: every rank writes its own shards (`__<rank>_0.distcp`, rank 0 the
`.metadata` index), so nothing is gathered on one rank. tensors.safetensors and state.json hold
the rest of the state as before (RNG, recent losses, scaler, companion: rank 0's), and state.json
also lists the sha256 of every file under dcp/, verified before loading. `load_checkpoint` verifies
and returns that rest; `load_shards` then reads the shards into any layout of the same tensors
(DCP reshards on load: a checkpoint of 8 ranks resumes on 1 process, or on 2, and vice versa).
DCP stores the optimizer's non-tensor settings with pickle; they are read only after the checksums
match. Format v1 checkpoints (the full variant) are written and read exactly as before.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from owai.errors import OwaiError
from owai.io import cannot_write, file_digest, is_write_failure, read_safetensors, umask

FORMAT = "owai-checkpoint-v1"
SHARDED_FORMAT = "owai-checkpoint-v2"  # v1 + the model and optimizer state as DCP shards under dcp/
TENSORS = "tensors.safetensors"
STATE = "state.json"
SHARDS = "dcp"
TEMPORARY_PREFIX = ".tmp-step-"  # a checkpoint being written (both formats), before its rename


class CorruptCheckpoint(OwaiError):
    """A checkpoint whose files do not read back as written (a cut file, a checksum mismatch, a bad
    state.json): `verify_checkpoints` then names the checkpoint before it."""


class NonFiniteError(OwaiError):
    """Training state (loss, parameters, a checkpoint's tensors) holds NaN or inf.

    `stage`, `step` and `checkpoint` (the step of the stage's newest finite checkpoint, 0 if none)
    say where, so the run can be marked failed with what a resume needs."""

    def __init__(self, message: str, stage: str = "", step: int = 0, checkpoint: int = 0) -> None:
        super().__init__(message)
        self.stage, self.step, self.checkpoint = stage, step, checkpoint


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of `tensors` is finite, with one device sync. On CUDA, the largest
    magnitude of them all in multi-tensor kernels (`get_total_norm` with norm inf, NaN propagating):
    one read of each tensor and a few launches, where isfinite and all per tensor took two kernels
    each (1,110 for v2's small model) and a bool copy. Elsewhere each tensor's min and max (`aminmax`,
    one pass; the CPU's foreach kernels loop over the tensors anyway): ten times faster on the CPU than
    isfinite and all (docs/results.md). Empty tensors (a shard can be) have nothing to check.
    The trainer checks every parameter after each update with it; checkpoints check each tensor."""
    tensors = [t.detach() for t in tensors if t.numel()]
    if not tensors:
        return True
    if all(t.is_cuda for t in tensors):
        extremes = torch.nn.utils.get_total_norm(tensors, math.inf, foreach=True)
    else:
        extremes = torch.stack([bound.to(tensors[0].device) for t in tensors for bound in torch.aminmax(t)])
    return bool(torch.isfinite(extremes).all())


def nonfinite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The keys of floating-point tensors holding NaN or inf, in order."""
    return [k for k, t in tensors.items() if t.is_floating_point() and not all_finite([t])]


def _file_sha256(path: Path, name: str) -> str:
    """The sha256 of file `name` of checkpoint `path`; one that cannot be read is an OwaiError naming it."""
    try:
        return file_digest(path / name, "sha256")
    except OSError as e:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {name} cannot be read ({e.strerror or type(e).__name__})") from None


def _split(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace tensors in a nested structure by references; collect them in `tensors`."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {"__dict__": [[k, _split(v, f"{prefix}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_split(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_split(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint {type(obj).__name__} at {prefix}")


def _join(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {k: _join(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(_join(v, tensors) for v in obj["__tuple__"])
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    return obj


def save_checkpoint(
    directory: Path, step: int, state: dict[str, Any], keep: int = 2, identity: dict[str, Any] | None = None
) -> Path:
    """Write `state` as checkpoint `directory/step-XXXXXX`, atomically; keep the newest `keep`.

    `identity` (JSON) records what wrote it, for `load_checkpoint(..., expect=)`. A state with a
    non-finite floating-point tensor raises NonFiniteError and writes nothing."""
    directory = Path(directory)
    final = directory / f"step-{step:06d}"
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(state, "state", tensors)
    bad = nonfinite_tensors(tensors)
    if bad:
        raise NonFiniteError(f"refusing to write checkpoint {final}: {bad[0]} holds non-finite values",
                             directory.name, step)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TEMPORARY_PREFIX}{step:06d}-", dir=directory))
    except OSError as e:
        raise cannot_write(f"checkpoint {final}", e) from None
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700 directories
        _commit(tmp, final, tensors, {"format": FORMAT, "step": step}, skeleton, identity)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_write_failure(e):  # no room, a read-only folder, a name too long: one line naming the checkpoint
            raise cannot_write(f"checkpoint {final}", e) from None
        raise
    _prune(directory, keep)
    return final


def _commit(tmp: Path, final: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any], skeleton: Any,
            identity: dict[str, Any] | None) -> None:
    """Write the tensors and state.json (with the tensors' sha256) into the temporary directory `tmp`,
    then rename it to `final` (replacing a checkpoint of the same step): both formats commit so."""
    save_file(tensors, str(tmp / TENSORS))
    os.chmod(tmp / TENSORS, 0o666 & ~umask())
    _fsync(tmp / TENSORS)  # on the disk before state.json names its sha256 (a power cut cannot leave it half)
    meta = {**meta, "sha256": file_digest(tmp / TENSORS, "sha256"), "state": skeleton}
    if identity is not None:
        meta["identity"] = identity
    with open(tmp / STATE, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # re-saving the same step (e.g. the final one after a resume)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(final.parent)  # the rename itself


def _fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') writes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(directory: Path) -> list[Path]:
    """Committed checkpoints in `directory`, oldest first (temporary ones are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(directory: Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def remove_leftovers(directory: Path, keep: int = 2) -> None:
    """Remove what a process killed while saving a checkpoint in `directory` left there: the temporary
    folder of a save not yet committed, and checkpoints older than the newest `keep` (keep <= 0: all
    kept, as `save_checkpoint`) that it had not finished pruning, whole or half removed. Nothing reads
    them, but each can hold a whole checkpoint, and a stage that had ended never saves again to prune
    them. Call only where no save is under way (a stage's start, on rank 0)."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if path.name.startswith(TEMPORARY_PREFIX) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
    _prune(directory, keep)


def _prune(directory: Path, keep: int) -> None:
    """Remove the checkpoints in `directory` older than the newest `keep` (keep <= 0: keep all)."""
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def _read_meta(path: Path) -> dict[str, Any]:
    """state.json of checkpoint `path`, checked to be an owai checkpoint whose step is its name's."""
    if not path.is_dir():  # a file, or a broken symlink, named like a checkpoint
        raise OwaiError(f"checkpoint {path} is not a folder: the run's checkpoints are damaged")
    try:
        meta = json.loads((path / STATE).read_text())
    except FileNotFoundError:
        raise OwaiError(f"checkpoint {path} is incomplete: {STATE} is missing") from None
    except OSError as e:  # a folder, or a symlink loop, where state.json belongs; unreadable
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {STATE} cannot be read ({e.strerror or type(e).__name__})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {STATE} is not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
    if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, SHARDED_FORMAT):
        raise OwaiError(f"checkpoint {path} is not an {FORMAT} (or sharded {SHARDED_FORMAT}) checkpoint")
    if meta["format"] == SHARDED_FORMAT and not (isinstance(meta.get("shards"), dict) and isinstance(meta["shards"].get("files"), dict)):
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: its {STATE} lists no shard files")
    named = path.name[5:] if path.name.startswith("step-") else ""
    if named.isdigit() and meta.get("step") != int(named):
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: its {STATE} says step {meta.get('step')!r}")
    return meta


def recorded_identity(path: Path) -> dict[str, Any] | None:
    """The identity checkpoint `path` was written with (None: it records none)."""
    identity = _read_meta(Path(path)).get("identity")
    return identity if isinstance(identity, dict) else None


def check_identity(path: Path, recorded: dict[str, Any] | None, expect: dict[str, Any]) -> None:
    """Refuse checkpoint `path` unless its `recorded` identity matches `expect` on every key of
    `expect` ("model": {name: shape} compares the shapes of the model's tensors)."""
    if recorded is None:
        raise OwaiError(f"checkpoint {path} records no identity (written by an older owai); it cannot be resumed safely, start a new run")
    for key, want in expect.items():
        have = recorded.get(key)
        if key == "model" and not isinstance(have, dict):
            raise OwaiError(f"checkpoint {path} records no model shapes; it does not belong to a training stage")
        if key == "model" and isinstance(want, dict):
            names = sorted(set(have) ^ set(want)) or [k for k in want if have[k] != want[k]]
            if names:
                name = names[0]
                raise OwaiError(f"checkpoint {path} holds a model of another shape: {name} is "
                                f"{have.get(name, 'absent')} there, {want.get(name, 'absent')} here")
        elif have != want:
            raise OwaiError(f"checkpoint {path} was written by {key} {have!r}, not {want!r}; it does not belong here")


def is_sharded(path: Path) -> bool:
    """Whether checkpoint `path` is of the sharded variant (its model and optimizer state in dcp/)."""
    return _read_meta(Path(path))["format"] == SHARDED_FORMAT


def load_checkpoint(path: Path, expect: dict[str, Any] | None = None, verify_shards: bool = True) -> tuple[int, dict[str, Any]]:
    """Verify and load a checkpoint directory; returns (step, state). Corruption, a non-finite
    tensor or (with `expect`) an identity other than `expect` is an OwaiError.

    For a sharded checkpoint the state lacks "model" and "optimizer" (read them with `load_shards`);
    the checksums of its shard files are verified here too unless `verify_shards` is False (a
    torchrun job verifies them with `verify_shard_files`, each rank a share)."""
    path = Path(path)
    meta = _read_meta(path)
    if expect is not None:
        check_identity(path, meta.get("identity") if isinstance(meta.get("identity"), dict) else None, expect)
    tensor_file = path / TENSORS
    if not tensor_file.is_file():
        raise OwaiError(f"checkpoint {path} is incomplete: {TENSORS} is missing")
    if _file_sha256(path, TENSORS) != meta.get("sha256"):
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {TENSORS} does not match its sha256")
    if meta["format"] == SHARDED_FORMAT and verify_shards:
        _check_shard_files(path, meta, sorted(meta["shards"]["files"]))
    tensors = read_safetensors(tensor_file)  # unreadable despite its checksum: one line naming the file
    bad = nonfinite_tensors(tensors)
    if bad:
        raise NonFiniteError(f"checkpoint {path} holds non-finite values ({bad[0]}); it cannot be resumed",
                             path.parent.name, int(meta["step"]) if isinstance(meta.get("step"), int) else 0)
    try:
        return int(meta["step"]), _join(meta["state"], tensors)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: bad structure ({e})") from None


# -- the sharded variant ------------------------------------------------------------------------


def _check_shard_files(path: Path, meta: dict[str, Any], names: list[str]) -> None:
    """OwaiError unless each of `names` (files under dcp/) exists and matches its recorded sha256;
    also refuses files under dcp/ that state.json does not list."""
    files = meta["shards"]["files"]
    root = path / SHARDS
    if not root.is_dir():
        raise OwaiError(f"checkpoint {path} is incomplete: {SHARDS}/ is missing")
    for name in names:
        file = root / name
        if not file.is_file():
            raise OwaiError(f"checkpoint {path} is incomplete: {SHARDS}/{name} is missing")
        if _file_sha256(path, f"{SHARDS}/{name}") != files[name]:
            raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {SHARDS}/{name} does not match its sha256")
    extra = sorted(set(_files_under(root)) - set(files))
    if extra:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {SHARDS}/{extra[0]} is not one of its files")


def _files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def verify_shard_files(path: Path) -> None:
    """Verify the shard files of sharded checkpoint `path`, each rank of a torchrun job a share of
    them (a collective: call on every rank; every rank raises the same one-line OwaiError)."""
    from owai import distributed

    path = Path(path)
    w = distributed.world()
    error = None
    try:
        meta = _read_meta(path)
        _check_shard_files(path, meta, sorted(meta["shards"]["files"])[w.rank :: w.world_size])
    except OwaiError as e:
        error = str(e)
    _raise_first(distributed.gather_objects(error))


def _raise_first(errors: list[str | None], make: Callable[[str], OwaiError] = OwaiError) -> None:
    """Raise the first of the ranks' error messages (the same on every rank), if any."""
    first = next((e for e in errors if e), None)
    if first is not None:
        raise make(first)


def _local_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(key, this rank's tensor) for every tensor in a nested state dict (DTensors: the local shard)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _local_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _local_tensors(v, f"{prefix}.{i}")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree.to_local() if hasattr(tree, "to_local") else tree


def _first_nonfinite(tree: Any) -> str | None:
    for key, t in _local_tensors(tree):
        if t.is_floating_point() and not all_finite([t]):
            return key
    return None


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes a single process when no process group exists; that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")
        yield


def _dcp_errors() -> tuple[type[BaseException], ...]:
    """What a DCP save or load raises: its CheckpointException (a BaseException) or anything else."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _dcp_message(e: BaseException) -> str:
    """The first line of what went wrong, also inside DCP's per-rank CheckpointException."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        e = inner[0] if isinstance(inner, tuple) else inner
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def save_sharded_checkpoint(
    directory: Path, step: int, shards: dict[str, Any], state: dict[str, Any], keep: int = 2,
    identity: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint `directory/step-XXXXXX` of the sharded variant, atomically; keep the newest
    `keep`. A collective: every rank calls it with its own `shards` (e.g. {"model": ..., "optimizer":
    ...} from `owai.distributed.sharded_state`, DTensors or whole tensors); `state` (the rest:
    RNG, losses, ...) and `identity` are rank 0's. All ranks write their shards under a temporary
    directory, hash a share of the files, and rank 0 writes state.json and renames the directory
    into place; every rank returns (or raises the same one-line error) after that.
    A non-finite tensor on any rank raises NonFiniteError on every rank and writes nothing."""
    import torch.distributed.checkpoint as dcp

    from owai import distributed

    directory = Path(directory)
    final = directory / f"step-{step:06d}"
    w = distributed.world()
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(state, "state", tensors)
    bad = _first_nonfinite(shards) or (next(iter(nonfinite_tensors(tensors)), None) if w.is_main else None)
    _raise_first([f"refusing to write checkpoint {final}: {b} holds non-finite values" if b else None
                  for b in distributed.gather_objects(bad)], lambda m: NonFiniteError(m, directory.name, step))
    tmp = directory / f"{TEMPORARY_PREFIX}{step:06d}-sharded"
    error = None
    if w.is_main:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            os.chmod(tmp, 0o777 & ~umask())
        except OSError as e:
            error = f"cannot write checkpoint {final}: {e.strerror or e}"
    _raise_first([distributed.broadcast_object(error)])
    try:
        with _quiet_single_process():
            dcp.save(shards, checkpoint_id=str(tmp / SHARDS), no_dist=w.world_size == 1)
        error = None
    except _dcp_errors() as e:  # DCP wraps anything a rank raised; every rank gets it
        error = f"cannot write checkpoint {final}: {_dcp_message(e)}"
    _raise_first(distributed.gather_objects(error))
    names = distributed.broadcast_object(_files_under(tmp / SHARDS) if w.is_main else None)
    mine = {name: file_digest(tmp / SHARDS / name, "sha256") for name in names[w.rank :: w.world_size]}
    for name in mine:  # on the disk before state.json names their sha256
        _fsync(tmp / SHARDS / name)
    files = {k: v for part in distributed.gather_objects(mine) for k, v in part.items()}
    error = None
    if w.is_main:
        try:
            for name in names:
                os.chmod(tmp / SHARDS / name, 0o666 & ~umask())
            _commit(tmp, final, tensors, {"format": SHARDED_FORMAT, "step": step,
                                          "shards": {"dir": SHARDS, "files": dict(sorted(files.items()))}}, skeleton, identity)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it (they wait for the broadcast below)
            if not is_write_failure(e):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            error = str(cannot_write(f"checkpoint {final}", e))
        if error is None:
            _prune(directory, keep)
    _raise_first([distributed.broadcast_object(error)])
    return final


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle, and `pickle.load` (what DCP's reader calls) runs whatever it
    names. This reads it with only the classes DCP writes there: its metadata dataclasses and enums,
    torch.Size and dtypes, layouts, paths. Anything else is refused (a run directory from elsewhere
    is data, not code)."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
              ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
              ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if module in self._MODULES or (module, name) in self._NAMES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)) else None
        if found is None or (module in self._MODULES and not isinstance(found, type)):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        return found


def _check_metadata(path: Path) -> Any:
    """The DCP metadata of sharded checkpoint `path`, read with `_MetadataUnpickler` (before DCP
    reads it with pickle): a one-line OwaiError if it names anything else or is not DCP metadata."""
    file = path / SHARDS / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise OwaiError(f"checkpoint {path} cannot be read safely: {file.name}: {e}") from None
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise OwaiError(f"checkpoint {path} cannot be read safely: {file.name} is not DCP metadata")
    return metadata


def _weights_only_planner() -> Any:
    """DCP's default load planner, except that the non-tensor items (the optimizer's param_groups:
    lr, betas, ...) are read with `torch.load(weights_only=True)`; DCP's own reads them with
    weights_only=False, which runs any code a tampered file names."""
    import io

    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            item = torch.load(value, weights_only=True)  # refuses anything but plain data and tensors
            safe = io.BytesIO()
            torch.save(item, safe)
            safe.seek(0)
            super().load_bytes(read_item, safe)  # DCP's placement of the item, on what was just checked

    return WeightsOnlyLoadPlanner()


def _drop_state_not_saved(metadata: Any, shards: dict[str, Any]) -> None:
    """Remove from `shards["optimizer"]["state"]` the parameters the checkpoint holds no optimizer
    state for. torch's optimizers make a parameter's state at the first step that reads its gradient,
    so one that had none by the checkpoint's step has none saved, while the template
    (`distributed.sharded_state` of a fresh optimizer) initialised one for every parameter. Without
    its entry the optimizer resumes with no state for it, as the uninterrupted run has."""
    state = shards.get("optimizer", {}).get("state") if isinstance(shards.get("optimizer"), dict) else None
    if not isinstance(state, dict):
        return
    saved = metadata.state_dict_metadata  # `_check_metadata`'s: DCP's reader unpickles anything
    with_state = {key[len("optimizer.state."):] for key in saved if key.startswith("optimizer.state.")}
    for name in [n for n in state if not any(key.startswith(f"{n}.") for key in with_state)]:
        del state[name]


def load_shards(path: Path, shards: dict[str, Any]) -> None:
    """Read the shards of sharded checkpoint `path` into `shards` in place (the same structure
    it was saved from, in any layout: e.g. `owai.distributed.sharded_state` of the current model,
    sharded over any number of ranks or whole). A collective under torchrun. Shards that do not
    fit (other names or shapes) or hold non-finite values raise a one-line OwaiError on every rank.
    Verify the files first (`load_checkpoint`, `verify_shard_files`)."""
    import torch.distributed.checkpoint as dcp

    from owai import distributed

    path = Path(path)
    w = distributed.world()
    try:
        _drop_state_not_saved(_check_metadata(path), shards)  # read before DCP's own read, pickle.load
        with _quiet_single_process():
            dcp.load(shards, checkpoint_id=str(path / SHARDS), planner=_weights_only_planner(), no_dist=w.world_size == 1)
        error = None
    except OwaiError as e:
        error = str(e)
    except _dcp_errors() as e:  # DCP wraps anything a rank raised
        error = f"checkpoint {path} does not fit this model: {_dcp_message(e)}"
    _raise_first(distributed.gather_objects(error))
    bad = _first_nonfinite(shards)
    step = int(path.name[5:]) if path.name[5:].isdigit() else 0
    _raise_first([f"checkpoint {path} holds non-finite values ({b}); it cannot be resumed" if b else None
                  for b in distributed.gather_objects(bad)], lambda m: NonFiniteError(m, path.parent.name, step))
