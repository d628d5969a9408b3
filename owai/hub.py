"""The Hugging Face hub: whether it can be reached, and datasets loaded from it; and whether another
download host (download.pytorch.org, for torchvision's weights) can be.

Without a network the hub clients retry for 20-30 s before they fail. owai asks once per process
(offline mode, or one TCP connection within HUB_PROBE_TIMEOUT seconds), and where the hub cannot be
reached it reads only the local caches: a cached copy still loads, and a missing one is one error
line at once, naming why the hub was not asked. `host_unreachable(url)` asks the same of any host
(no offline variable: the Hugging Face ones are about the hub alone).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from owai.errors import DataMissing, one_line

HUB_PROBE_TIMEOUT = 3.0  # seconds to reach the hub before it is declared unreachable
_TRUE = ("1", "ON", "YES", "TRUE")
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")  # any of them keeps owai local


def offline_mode() -> str:
    """The offline variable the user set ("" if none), also when it was set after huggingface_hub
    read it at import."""
    for name in OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().upper() in _TRUE:
            return name
    try:
        from huggingface_hub import constants
    except ImportError:
        return ""
    return "HF_HUB_OFFLINE" if getattr(constants, "HF_HUB_OFFLINE", False) else ""


def hub_unreachable() -> str:
    """Why the hub cannot be asked ("" when it can): offline mode, or no TCP connection in time. Behind
    an HTTP(S) proxy the hub clients go through the proxy, so no direct connection is tried."""
    variable = offline_mode()
    if variable:
        return f"Hugging Face offline mode is set ({variable})"
    target = _direct(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return "" if target is None else _probe(*target)


def host_unreachable(url: str) -> str:
    """Why the host of `url` cannot be reached ("" when it can): no TCP connection within
    HUB_PROBE_TIMEOUT seconds, asked once per process and host. Behind an HTTP(S) proxy that carries
    the URL nothing is tried and "" is returned: the download goes through the proxy."""
    target = _direct(url)
    if target is None:
        return ""
    reason = _connect(*target)
    return f"{target[0]} is unreachable ({reason})" if reason else ""


def _direct(url: str) -> tuple[str, int] | None:
    """(host, port) to try a direct connection to for `url`; None when a proxy carries it."""
    from urllib.parse import urlparse
    from urllib.request import getproxies, proxy_bypass

    endpoint = urlparse(url)
    host = endpoint.hostname or "huggingface.co"
    proxies = getproxies()
    if (proxies.get(endpoint.scheme or "https") or proxies.get("all")) and not proxy_bypass(host):
        return None
    return host, endpoint.port or (80 if endpoint.scheme == "http" else 443)


def _probe(host: str, port: int) -> str:
    """Why the hub at host:port cannot be reached ("" when it can; `_connect` asks once per process)."""
    reason = _connect(host, port)
    return f"the hub ({host}) is unreachable ({reason})" if reason else ""


@functools.lru_cache(maxsize=8)
def _connect(host: str, port: int) -> str:
    """One TCP connection attempt per process and host (a sweep validates many points): "" when it
    connects, else why not in one line."""
    import socket

    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT).close()
    except OSError as exc:
        return one_line(exc, 80)
    return ""


@contextlib.contextmanager
def cache_only() -> Iterator[None]:
    """`datasets` and huggingface_hub in offline mode for the duration (they read the variable at
    import, so their module flags are set), restored afterwards. A release without those flags is
    left as it is: it then retries as it would."""
    flags: list[tuple[Any, str, Any]] = []
    for module_name, names in (("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
                               ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))):
        try:
            import importlib

            module = importlib.import_module(module_name)
        except ImportError:
            continue
        flags += [(module, name, getattr(module, name)) for name in names if hasattr(module, name)]
    try:
        for module, name, _ in flags:
            setattr(module, name, True)
        yield
    finally:
        for module, name, value in flags:
            setattr(module, name, value)


def dataset_cached(path: str, name: str | None = None, **kwargs: Any) -> bool:
    """Whether `datasets` opens hub dataset `path` (config `name`) from its local cache alone: the
    builder `datasets.load_dataset` starts from, resolved under `cache_only`. Reads no data; its
    "using the latest cached version" warnings are silenced (this runs before a run starts).
    `streaming` is a way of reading, not of building: the builder refuses it, so it is not passed."""
    import datasets

    kwargs.pop("streaming", None)
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()
    try:
        with cache_only():
            datasets.load_dataset_builder(path, name, **kwargs)
    except Exception:  # noqa: BLE001 - not cached: ConnectionError, FileNotFoundError, ValueError, ...
        return False
    finally:
        datasets.logging.set_verbosity(verbosity)
    return True


def load_dataset(path: str, *args: Any, what: str, hint: str = "", **kwargs: Any) -> Any:
    """`datasets.load_dataset(path, *args, **kwargs)`, from the local caches alone when the hub cannot
    be reached. Any failure is a DataMissing line: "cannot load {what} from the Hugging Face hub
    (why){hint}"."""
    try:
        import datasets
    except ImportError:
        raise DataMissing(f"loading {what} needs the `datasets` package: pip install datasets") from None
    problem = "" if Path(path).expanduser().exists() else hub_unreachable()
    try:
        with cache_only() if problem else contextlib.nullcontext():
            return datasets.load_dataset(path, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the hub raises many types (ConnectionError, HfHubHTTPError, ...)
        why = one_line(exc, 200) + (f"; read from the local cache only: {problem}" if problem else "")
        raise DataMissing(f"cannot load {what} from the Hugging Face hub ({why}){hint}") from None
