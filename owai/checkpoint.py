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
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from owai.errors import OwaiError
from owai.io import umask

FORMAT = "owai-checkpoint-v1"
TENSORS = "tensors.safetensors"
STATE = "state.json"


class NonFiniteError(OwaiError):
    """Training state (loss, parameters, a checkpoint's tensors) holds NaN or inf.

    `stage`, `step` and `checkpoint` (the step of the stage's newest finite checkpoint, 0 if none)
    say where, so the run can be marked failed with what a resume needs."""

    def __init__(self, message: str, stage: str = "", step: int = 0, checkpoint: int = 0) -> None:
        super().__init__(message)
        self.stage, self.step, self.checkpoint = stage, step, checkpoint


def nonfinite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The keys of floating-point tensors holding NaN or inf, in order."""
    return [k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step-{step:06d}-", dir=directory))
    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700 directories
    try:
        save_file(tensors, str(tmp / TENSORS))
        os.chmod(tmp / TENSORS, 0o666 & ~umask())
        meta: dict[str, Any] = {"format": FORMAT, "step": step, "sha256": _sha256(tmp / TENSORS), "state": skeleton}
        if identity is not None:
            meta["identity"] = identity
        with open(tmp / STATE, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # re-saving the same step (e.g. the final one after a resume)
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


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


def _read_meta(path: Path) -> dict[str, Any]:
    """state.json of checkpoint `path`, checked to be an owai checkpoint whose step is its name's."""
    try:
        meta = json.loads((path / STATE).read_text())
    except FileNotFoundError:
        raise OwaiError(f"checkpoint {path} is incomplete: {STATE} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OwaiError(f"checkpoint {path} is corrupt: {STATE} is not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise OwaiError(f"checkpoint {path} is not an {FORMAT} checkpoint")
    named = path.name[5:] if path.name.startswith("step-") else ""
    if named.isdigit() and meta.get("step") != int(named):
        raise OwaiError(f"checkpoint {path} is corrupt: its {STATE} says step {meta.get('step')!r}")
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


def load_checkpoint(path: Path, expect: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """Verify and load a checkpoint directory; returns (step, state). Corruption, a non-finite
    tensor or (with `expect`) an identity other than `expect` is an OwaiError."""
    path = Path(path)
    meta = _read_meta(path)
    if expect is not None:
        check_identity(path, meta.get("identity") if isinstance(meta.get("identity"), dict) else None, expect)
    tensor_file = path / TENSORS
    if not tensor_file.is_file():
        raise OwaiError(f"checkpoint {path} is incomplete: {TENSORS} is missing")
    if _sha256(tensor_file) != meta.get("sha256"):
        raise OwaiError(f"checkpoint {path} is corrupt: {TENSORS} does not match its sha256")
    try:
        tensors = load_file(str(tensor_file))
    except (SafetensorError, OSError) as e:
        raise OwaiError(f"checkpoint {path} is corrupt: {e}") from None
    bad = nonfinite_tensors(tensors)
    if bad:
        raise NonFiniteError(f"checkpoint {path} holds non-finite values ({bad[0]}); it cannot be resumed",
                             path.parent.name, int(meta["step"]) if isinstance(meta.get("step"), int) else 0)
    try:
        return int(meta["step"]), _join(meta["state"], tensors)
    except (KeyError, TypeError, ValueError) as e:
        raise OwaiError(f"checkpoint {path} is corrupt: bad structure ({e})") from None
