"""Atomic file writes (a reader sees the old file or the new one, never half of one), the one safe
reader of .safetensors files (weights, and the cache's entries), and the cache root."""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import yaml

from owai.values import finite_json

T = TypeVar("T")


def umask() -> int:
    """The process umask (read without changing it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def replacing(path: Path) -> Iterator[Any]:
    """A binary file that becomes `path` when the block ends without an error: written to a temporary
    file beside it (named so that `remove_dead_builds` knows it), fsynced, then renamed over `path`
    (mode as open() gives); on any error, or an interrupt, the temporary file is removed and `path`
    is as it was. OSErrors are raised as they come (callers word them)."""
    fd, tmp = tempfile.mkstemp(prefix=f"{_build_prefix(path, 'write')}{os.getpid()}-", suffix=".tmp", dir=Path(path).parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes 0600 files; results are meant to be shared
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_problem(error: BaseException) -> str:
    """What went wrong in a failed write, in a few words: the OS's reason (No space left on device,
    Read-only file system, ...) or a library's message with its own prefix removed."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = " ".join(str(error).split()) or type(error).__name__
    for prefix in ("Error while serializing: ", "I/O error: "):  # safetensors' SafetensorError
        text = text.removeprefix(prefix)
    return text


def cannot_write(what: str | Path, error: BaseException) -> Exception:
    """The one-line OwaiError of a write that failed: "cannot write WHAT: REASON"."""
    from owai.errors import OwaiError

    return OwaiError(f"cannot write {what}: {write_problem(error)}")


def is_write_failure(error: BaseException) -> bool:
    """An OSError, or safetensors' SafetensorError (its I/O errors are not OSErrors)."""
    return isinstance(error, OSError) or type(error).__name__ == "SafetensorError"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` through `replacing`. A write that fails (no such folder, no room, a
    folder where the file goes) leaves `path` as it was and is one OwaiError naming it: every owai
    writer goes through here."""
    path = Path(path)
    remove_dead_builds(path, "write")  # what writes of `path` killed on this host left (a shared cache has no resume)
    try:
        with replacing(path) as f:
            f.write(data)
    except OSError as e:
        raise cannot_write(path, e) from None


DOWNLOAD_TIMEOUT = 60.0  # seconds without data before a download is given up


def download(url: str, dest: Path, timeout: float = DOWNLOAD_TIMEOUT) -> None:
    """Stream `url` into `dest` through `replacing` (a cut download never looks like the file);
    `timeout`: seconds without data. Raises what urllib and the file system raise (URLError, OSError,
    ValueError): callers word the one-line error."""
    import urllib.request

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with replacing(dest) as out, urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - callers' URLs
        shutil.copyfileobj(response, out, 1 << 20)


def file_digest(path: Path, algorithm: str) -> str:
    """Hex digest of a file (md5, sha256, ...), read in 1 MiB blocks."""
    import hashlib

    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def folder_to_build(final: Path, kind: str = "tmp") -> Path:
    """A new, empty folder beside `final` in which to build it before renaming it into place (a reader
    sees all of `final` or nothing), named `.NAME.KIND-HOST-PID-XXXXXXXX`, with the mode mkdir gives
    (0777 less the umask). The folders of this KIND that processes of this host were killed in while
    building `final` are removed first (`remove_dead_builds`)."""
    final = Path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_builds(final, kind)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_build_prefix(final, kind)}{os.getpid()}-", dir=final.parent))
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700 folders: renamed into a shared cache, only their owner could read them
    except OSError as e:  # a read-only or full folder, a file where the folder goes
        raise cannot_write(final, e) from None
    return tmp


def remove_dead_builds(final: Path, *kinds: str) -> None:
    """Remove the `folder_to_build` folders of `final` (of each KIND, default tmp) that processes of
    this host were killed in: nothing else cleans them from a shared cache, and each can be as large
    as `final`. Also where `final` is found complete and reused: the process that finished it may not
    be the one that was killed. Those of live processes (another process building `final` now), of
    other hosts sharing the folder, and older unnamed ones stay. KIND "write" is
    `atomic_write_bytes`'s temporary files, removed the same way."""
    final = Path(final)
    for kind in kinds or ("tmp",):
        owner = _build_prefix(final, kind)
        for path in final.parent.glob(glob.escape(owner) + "*"):
            pid = path.name[len(owner):].split("-", 1)[0]
            if not pid.isdigit() or _process_alive(int(pid)) or path.is_symlink():
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif kind == "write" and path.is_file():
                path.unlink(missing_ok=True)


@contextmanager
def build_lock(final: Path, ready: Callable[[], bool] | None = None, wait: bool = True) -> Iterator[bool]:
    """Hold the lock of the cache entry `final` while looking for it again and, when it is missing,
    building it: the workers of a sweep (or the jobs of a SLURM array) that need the same tokenizer,
    token cache or pre-trained network build it once, and the others wait, then find it built.
    Without it each built its own copy, and the atomic rename kept one: the same result, at the
    cost of N builds. `ready()` true (the entry is there) takes no lock: readers do not queue.

    The lock is `flock` on `.NAME.lock` beside `final`, which its holder removes when it is done
    (a waiter that then holds the lock of a removed file tries again). The kernel releases a killed
    holder's lock, so a kill never blocks the next build. Where the file system has no locks, or the
    folder cannot be written, every process builds, as before. No process waits for a lock while it
    holds another it waited for (a sweep point's lock, held while the point runs and takes cache
    locks, is only ever tried, never waited for), so processes cannot wait on each other in a circle.
    A forked child closes its copies of the lock descriptors (`_close_held_locks_in_child`). The lock
    reaches across machines where the shared file system implements flock across them (NFS does;
    Lustre only with its `flock` mount option).

    `wait=False` does not wait: it yields False when another process holds the lock (a sweep point
    that another process is running), True otherwise."""
    from owai import console

    final = Path(final)
    path = final.parent / f".{final.name}.lock"
    fd: int | None = None
    if ready is None or not ready():
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # a folder that cannot be made: the build says so
            pass
        else:
            fd = _locked(path, final, console.info, wait)
    if fd == _HELD_ELSEWHERE:
        yield False
        return
    if fd is not None:
        _HELD.add(fd)
    try:
        yield True
    finally:
        if fd is not None:
            _HELD.discard(fd)
            try:
                path.unlink()
            except OSError:
                pass
            os.close(fd)  # releases the lock


_HELD_ELSEWHERE = -1  # `_locked` without waiting, when another process holds the lock
_HELD: set[int] = set()  # this process's lock descriptors (`build_lock`)


def _close_held_locks_in_child() -> None:
    """In a forked child (a DataLoader's worker): close the copies of the parent's lock descriptors,
    so that a lock is released when its holder dies, not when its last forked worker notices."""
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_locks_in_child)


def _locked(path: Path, final: Path, say: Callable[[str], Any], wait: bool = True) -> int | None:
    """An open descriptor of the lock file `path`, locked exclusively; None where locks are not
    available (the file system has none, or the folder is read-only); with `wait=False`,
    _HELD_ELSEWHERE when another process holds it."""
    import fcntl

    waited = False
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666 & ~umask())
        except PermissionError:  # another user's lock file: flock needs no write access
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                return None
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    os.close(fd)
                    return _HELD_ELSEWHERE
                if not waited:
                    say(f"waiting for another process to finish building {final}")
                    waited = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:  # its holder removed it while this process waited for it
            same = False
        except OSError:  # no locks on this file system (or a stale NFS handle): no lock
            os.close(fd)
            return None
        if same:  # not a lock file its holder removed while this process waited for it
            return fd
        os.close(fd)


def _build_prefix(final: Path, kind: str) -> str:
    """The name of `final`'s build folders of KIND made on this host, up to the process id."""
    return f".{final.name}.{kind}-{socket.gethostname()}-"


def _process_alive(pid: int) -> bool:
    """Whether process `pid` of this host exists (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists
        return True
    return True


def is_write_temporary(path: Path) -> bool:
    """Whether `path` is named as `atomic_write_bytes`'s temporary files are (`.NAME.write-HOST-PID-XXXXXXXX.tmp`,
    or `.NAME.XXXXXXXX.tmp` before they carried the writer's host and process id):
    what a process killed in the middle of a write leaves beside the file, never a result."""
    name = Path(path).name
    return name.startswith(".") and name.endswith(".tmp")


def remove_write_temporaries(folder: Path) -> None:
    """Remove the temporary files (`is_write_temporary`) that writes killed in `folder` left there. Only
    where no write is under way (a resume, before it writes); one that cannot be removed is left."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        if is_write_temporary(path) and path.is_file() and not path.is_symlink():
            try:
                path.unlink()
            except OSError:  # harmless where it is: nothing reads it
                pass


def share_files(folder: Path) -> None:
    """Give every file under `folder` the mode open() gives (0666 less the umask): writers that make
    0600 files through temporary files (Hugging Face's save_pretrained) leave results only their
    owner can read, unlike every other file of a run."""
    mode = 0o666 & ~umask()
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    """`obj` as strict JSON at `path` (a NaN or infinite number as null: `values.finite_json`)."""
    atomic_write_text(path, json.dumps(finite_json(obj), indent=2, default=_jsonable) + "\n")


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


def check_cache_root() -> Path:
    """The cache root, refused in one line when it is not a folder (OWAI_CACHE naming a file) or does
    not exist and cannot be made (under a file, /proc or /sys, a broken symlink): checked once, before
    any command writes anything, where the cache's writers would fail inside a run. A cache that
    exists is not written to here (a read-only one holding prepared data serves)."""
    root = cache_root()
    check_folder(root, f"the cache {root}" + (f" (${CACHE_ENV})" if os.environ.get(CACHE_ENV) else ""),
                 f"point {CACHE_ENV} at a folder you can write", writable=False)
    return root


def check_folder(folder: Path, what: str, remedy: str = "", writable: bool = True) -> None:
    """Refuse in one line (`what`, the problem, then the `remedy`) a folder that cannot take new files:
    one on whose path a file or a broken symlink stands, one that exists but is not writable (with
    `writable`), or a missing one that cannot be made. That is tried by making it, with its missing
    parents, and removing them again: permission bits miss a read-only mount or /proc. Nothing stays."""
    from owai.errors import OwaiError

    folder = Path(folder)

    def refuse(problem: str) -> OwaiError:
        return OwaiError(f"{what} {problem}" + (f": {remedy}" if remedy else ""))

    nearest = folder
    try:
        folder.exists()
    except OSError as e:  # a name longer than the file system takes (ENAMETOOLONG)
        raise refuse(f"cannot be made: {e.strerror or e}") from None
    while not nearest.exists():
        if nearest.is_symlink():  # dangling (or a loop): mkdir would stop at it with "File exists"
            raise refuse(f"cannot be made: {nearest} is a broken symlink")
        nearest = nearest.parent
    if not nearest.is_dir():
        raise refuse(f"cannot be made: {nearest} is not a folder" if nearest != folder else "is not a folder")
    if nearest == folder:
        if writable and not os.access(folder, os.W_OK | os.X_OK):
            raise refuse("is not writable")
        return
    missing = [p for p in [folder, *folder.parents] if not os.path.lexists(p)]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise refuse(f"cannot be made ({e.strerror or type(e).__name__})") from None
    finally:
        for made in missing:
            if not os.path.lexists(made):  # mkdir stopped before it
                continue
            try:
                made.rmdir()
            except OSError:  # filled meanwhile by another process: keep it (and its parents)
                break


def _safetensors_problem(path: Path, error: BaseException) -> Exception:
    from owai.errors import OwaiError

    if isinstance(error, OSError):
        return OwaiError(f"{path}: cannot read the weights file ({error.strerror or type(error).__name__})")
    reason = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return OwaiError(f"{path}: corrupt or truncated safetensors file ({reason[:200]})")


def check_safetensors(path: str | Path) -> list[str]:
    """The tensor names of a .safetensors file, reading only its header (cheap at any size): a missing,
    truncated or corrupt file is one OwaiError naming it. The check before a run loads weights."""
    return list(safetensors_shapes(path))


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in a .safetensors file, from its header alone (no tensor is read; the
    header's offsets must cover the file, so a truncated one fails): a missing, truncated or corrupt
    file is one OwaiError naming it."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, a header that is not JSON: a bad file
        raise _safetensors_problem(path, e) from None


def read_safetensors(path: str | Path, device: str = "cpu") -> dict[str, Any]:
    """Every tensor of a .safetensors file (safetensors only: no pickle, no code); a missing, truncated
    or corrupt file is one OwaiError naming it. The one reader of weights files in owai."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        return load_file(str(path), device=device)
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, a header that is not JSON: a bad file
        raise _safetensors_problem(path, e) from None


def write_cache_entry(path: str | Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
    """Write a cache entry atomically: `tensors` (moved to the CPU, contiguous) and string `metadata`
    as one .safetensors file, which `read_cache_entry` reads back."""
    from safetensors.torch import save

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only or full cache, a file where the folder goes
        raise cannot_write(f"cache entry {path}", e) from None
    flat = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    atomic_write_bytes(path, save(flat, metadata=metadata))


def read_cache_entry(path: str | Path, parse: Callable[[dict[str, Any], dict[str, str]], T]) -> T | None:
    """`parse(tensors, metadata)` of a cache entry (a .safetensors file of owai's cache), or None when
    there is none. An entry that cannot be read or parsed (a damaged disk, a file of an older owai) is
    None too, said in one info line: a cache entry is derived data, rebuilt rather than trusted."""
    from safetensors import safe_open

    from owai import console

    path = Path(path)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata() or {}
        return parse(tensors, metadata)
    except Exception:  # noqa: BLE001 - SafetensorError, OSError, a missing tensor or metadata field: rebuilt
        console.info(f"rebuilding the unreadable cache entry {path}")
        return None
