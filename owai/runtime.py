"""Seeding, determinism, device and dtype selection: written once, used by every method."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
from collections.abc import Iterator

import numpy as np
import torch

from owai.config import Runtime
from owai.errors import OwaiError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# a training or evaluation precision's autocast dtype (float32: no autocast)
AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts, e.g. derive_seed(seed, "batch", step).

    Data sampling is keyed by (seed, purpose, step) rather than by a running RNG stream, so a
    resumed run draws exactly the batches an uninterrupted run would.
    """
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def generator(*parts: object, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator seeded with derive_seed(*parts)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(*parts))
    return gen


def setup(runtime: Runtime, seed: int) -> tuple[torch.device, torch.dtype]:
    """Apply a Runtime config (runtime.threads >= 0: config.check_ranges): threads, determinism
    (on or off, whatever the process had), seed. Returns (device, dtype). The settings stay for the
    rest of the process; a run applies them for its own duration only (`applied`)."""
    if runtime.threads:
        torch.set_num_threads(runtime.threads)
    _deterministic(runtime.deterministic, warn_only=True)
    if runtime.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.set_flush_denormal(runtime.flush_denormal)
    seed_everything(seed)
    return select_device(runtime.device), DTYPES[runtime.dtype]


@contextlib.contextmanager
def applied(runtime: Runtime, seed: int) -> Iterator[tuple[torch.device, torch.dtype]]:
    """`setup` for the block (a run), then the process's own settings back: its thread count,
    deterministic mode, cuDNN autotuning, subnormal flushing and CUBLAS_WORKSPACE_CONFIG. Runs share a
    process (an in-process sweep's points, a recipe's chained stages, a notebook, the tests): a run
    left deterministic mode on for a later one whose config turns it off, or for the caller's own
    code, and its thread count for a later run of `runtime.threads: 0`. The global random
    generators stay as the run seeded them (`seed_everything`, as any seeded script leaves them)."""
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.benchmark,
             flushes_denormals(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    try:
        yield setup(runtime, seed)
    finally:
        threads, deterministic, warn_only, benchmark, flush, workspace = saved
        torch.set_num_threads(threads)
        _deterministic(deterministic, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark
        torch.set_flush_denormal(flush)
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


def _deterministic(mode: bool, warn_only: bool) -> None:
    """torch.use_deterministic_algorithms(mode, warn_only), called only where it changes something: it
    imports torch's compiler for its own setting (900 modules, 1-5 s the first time), which a run
    without deterministic mode did not pay."""
    if torch.are_deterministic_algorithms_enabled() != mode or (
            mode and torch.is_deterministic_algorithms_warn_only_enabled() != warn_only):
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)


def flushes_denormals() -> bool:
    """Whether this thread flushes subnormal floats to zero (torch.set_flush_denormal, which has no
    getter): 1e-39, a float32 subnormal, multiplied by one reads as zero only then."""
    return torch.tensor([1e-39], dtype=torch.float32).mul(1.0).item() == 0.0


def select_device(name: str) -> torch.device:
    """'auto' picks CUDA when available; asking for CUDA without it is a user error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise OwaiError("runtime.device is 'cuda' but no CUDA device is available")
    return torch.device(name)


def planned_device(name: str) -> torch.device:
    """The device a run with runtime.device=`name` is planned for, where it is checked before it runs:
    'cuda' taken at its word (a SLURM sweep planned on a login node without GPUs runs on GPU nodes;
    the machine that runs it refuses a device it lacks: `experiment._prepare`, and `sweep.create` for
    local points), 'auto' as `select_device` chooses on this machine."""
    return torch.device("cuda" if name == "cuda" else select_device(name).type)


def autocast(device: torch.device, dtype: torch.dtype) -> torch.autocast:
    """Mixed precision context: bf16 autocast when asked for, a no-op for float32."""
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32)


def auto_precision(name: str, device: torch.device) -> str:
    """A config's training precision: "auto" is bfloat16 on CUDA and float32 elsewhere."""
    if name == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return name


def training_precision(name: str, device: torch.device, setting: str) -> str:
    """A training stage's autocast precision (`setting`, e.g. "train.precision"), resolved on `device`
    (auto_precision); bfloat16 or float16 autocast trains on CUDA only. CPU autocast is no stand-in:
    its bf16 convolutions can return garbage weight gradients (oneDNN, a stride-2 convolution on a 1x1
    map, as a ResNet's at 16 px), which a run would report as a non-finite loss to lower the lr for."""
    resolved = auto_precision(name, device)
    if resolved != "float32" and device.type != "cuda":
        raise OwaiError(f"{setting}={name} needs a CUDA device (this run is on {device.type})")
    return resolved
