"""Atomic file writes (a reader sees the old file or the new one, never half of one) and the cache root."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml


def umask() -> int:
    """The process umask (read without changing it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it (mode as open() gives)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes 0600 files; results are meant to be shared
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=_jsonable) + "\n")


def atomic_write_yaml(path: Path, obj: Any) -> None:
    atomic_write_text(path, yaml.safe_dump(obj, sort_keys=False))


def _jsonable(obj: Any) -> Any:
    """JSON fallback for numpy scalars/arrays and paths."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def atomic_write_figure(path: Path, fig: Any) -> None:
    """Save a matplotlib figure as PNG at `path` atomically (the one figure format), then close it."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


CACHE_ENV = "OWAI_CACHE"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Cache root (token shards, extracted archives, downloaded and pre-trained weights, and under
    `data/` the datasets `owai data fetch` downloads; see owai.data.registry): `cache_dir` if given,
    else `$OWAI_CACHE`, else `~/.cache/owai`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "owai"
