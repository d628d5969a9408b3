"""The one checkpoint format: safetensors for tensors, JSON for the rest, committed atomically.

A checkpoint is a directory `step-000123/` holding
  tensors.safetensors   every tensor of the state (model, optimizer, RNG), flat keys
  state.json            the state's structure with tensors replaced by references, the step,
                        and the sha256 of tensors.safetensors
It is written under a temporary name and renamed into place, so a killed process leaves either a
whole checkpoint or none. Loading verifies the checksum before anything is used, and tensors are
read with safetensors (no pickle).
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


def save_checkpoint(directory: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write `state` as checkpoint `directory/step-XXXXXX`, atomically; keep the newest `keep`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step-{step:06d}-", dir=directory))
    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700 directories
    try:
        tensors: dict[str, torch.Tensor] = {}
        skeleton = _split(state, "state", tensors)
        save_file(tensors, str(tmp / TENSORS))
        os.chmod(tmp / TENSORS, 0o666 & ~umask())
        meta = {"format": FORMAT, "step": step, "sha256": _sha256(tmp / TENSORS), "state": skeleton}
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


def load_checkpoint(path: Path) -> tuple[int, dict[str, Any]]:
    """Verify and load a checkpoint directory; returns (step, state). Corruption is an OwaiError."""
    path = Path(path)
    try:
        meta = json.loads((path / STATE).read_text())
    except FileNotFoundError:
        raise OwaiError(f"checkpoint {path} is incomplete: {STATE} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OwaiError(f"checkpoint {path} is corrupt: {STATE} is not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise OwaiError(f"checkpoint {path} is not an {FORMAT} checkpoint")
    tensor_file = path / TENSORS
    if not tensor_file.is_file():
        raise OwaiError(f"checkpoint {path} is incomplete: {TENSORS} is missing")
    if _sha256(tensor_file) != meta.get("sha256"):
        raise OwaiError(f"checkpoint {path} is corrupt: {TENSORS} does not match its sha256")
    try:
        tensors = load_file(str(tensor_file))
    except (SafetensorError, OSError) as e:
        raise OwaiError(f"checkpoint {path} is corrupt: {e}") from None
    try:
        return int(meta["step"]), _join(meta["state"], tensors)
    except (KeyError, TypeError, ValueError) as e:
        raise OwaiError(f"checkpoint {path} is corrupt: bad structure ({e})") from None
