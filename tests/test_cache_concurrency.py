"""Several owai processes sharing one cache (a sweep's workers, two users' jobs): the races a
concurrency fuzz pass found, each replayed deterministically by making the other process's move
happen at the unlucky moment. No process may see half an entry, crash, or delete another's."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from owai.data import registry, tokens
from owai.data.stories import generate_stories
from owai.data.tokens import prepare_tokens, read_complete_meta
from owai.io import atomic_write_bytes, folder_to_build, is_write_temporary, umask

DOCS = generate_stories(120, seed=3)


def corpus(tmp_path: Path) -> str:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return str(path)


def dead_pid() -> int:
    """The id of a process of this host that has exited."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def hidden(folder: Path) -> list[str]:
    """The temporary entries (build folders, trash, write temporaries) under `folder`."""
    return sorted(p.name for p in folder.rglob(".*"))


def other_process_installs(final: Path, complete: Path) -> None:
    """What another process finishing the same cache does: its whole folder renamed into place."""
    tmp = final.parent / ".theirs"
    shutil.copytree(complete, tmp)
    (tmp / "theirs").write_text("")  # to tell whose copy is in place
    os.rename(tmp, final)


@pytest.fixture
def complete(tmp_path: Path) -> tuple[str, Path]:
    """A corpus and a complete token cache of it (bytes), built elsewhere, to copy as the other's."""
    source = corpus(tmp_path)
    return source, prepare_tokens(source, "bytes", tmp_path / "elsewhere").root


def make_stale(final: Path, complete: Path) -> None:
    """A `final` that is not a complete cache (an older format's): to be replaced by a build."""
    shutil.copytree(complete, final)
    meta = json.loads((final / "meta.json").read_text())
    (final / "meta.json").write_text(json.dumps({**meta, "format_version": 0}))


def test_a_cache_another_process_completes_after_our_look_is_kept(tmp_path: Path, complete: tuple[str, Path],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes replacing the same stale cache: the other one installs its complete copy just
    after this one looked (and found the stale one). That copy used to be moved away and deleted
    while the other process read it (its train.bin gone: "token file not found")."""
    source, theirs = complete
    cache = tmp_path / "cache"
    final, _ = tokens._cache_dir(tokens.open_source(source), tokens.ByteTokenizer(), cache)
    make_stale(final, theirs)
    real, looks = tokens.read_complete_meta, []

    def look(root: Path, expect: dict) -> dict | None:
        found = real(root, expect)
        looks.append(root)
        if found is None and root == final and len(looks) == 2:  # the look inside the install
            shutil.rmtree(final)  # the other process moves the stale one away and installs its own
            other_process_installs(final, theirs)
        return found

    monkeypatch.setattr(tokens, "read_complete_meta", look)
    prepared = prepare_tokens(source, "bytes", cache)
    assert (final / "theirs").is_file(), "the other process's complete cache was deleted"
    assert prepared.root == final and read_complete_meta(final, {}) == prepared.meta
    assert hidden(cache) == []


def test_a_stale_cache_another_process_moved_away_first(tmp_path: Path, complete: tuple[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes replacing the same stale cache: the other one moves it away between this one's
    look and its move. That used to be a FileNotFoundError (an internal error, exit 1)."""
    source, theirs = complete
    cache = tmp_path / "cache"
    final, _ = tokens._cache_dir(tokens.open_source(source), tokens.ByteTokenizer(), cache)
    make_stale(final, theirs)
    real = tokens.folder_to_build

    def trash_folder(path: Path, kind: str = "tmp") -> Path:
        if kind == "old" and final.exists():
            shutil.rmtree(final)  # the other process got there first
        return real(path, kind)

    monkeypatch.setattr(tokens, "folder_to_build", trash_folder)
    prepared = prepare_tokens(source, "bytes", cache)
    assert read_complete_meta(final, {}) == prepared.meta and prepared.meta["format_version"] == tokens.FORMAT_VERSION
    assert hidden(cache) == []


def test_reuse_removes_the_build_folder_of_a_process_killed_while_another_finished(tmp_path: Path) -> None:
    """A process killed while building a cache that another process then finished: its folder (as
    large as the cache) used to stay until the cache was built again, i.e. for ever. The next
    process that reuses the cache removes it; a live process's folder and another host's stay."""
    source = corpus(tmp_path)
    cache = tmp_path / "cache"
    final = prepare_tokens(source, "bytes", cache).root
    host, gone = socket.gethostname(), dead_pid()
    folders = {name: final.parent / f".{final.name}.{name}"
               for name in (f"tmp-{host}-{gone}-a1", f"old-{host}-{gone}-a2", f"tmp-{host}-{os.getpid()}-a3",
                            f"tmp-elsewhere-{gone}-a4")}
    for folder in folders.values():
        folder.mkdir()
        (folder / "train.bin").write_bytes(b"\0\0")
    prepare_tokens(source, "bytes", cache)
    assert sorted(p.name for p in final.parent.glob(".*")) == sorted(
        folders[n].name for n in (f"tmp-{host}-{os.getpid()}-a3", f"tmp-elsewhere-{gone}-a4"))
    # the same for a dataset fetch that another one finished
    root = tmp_path / "data"
    gpt2 = root / registry.dataset("gpt2").subfolder
    gpt2.mkdir(parents=True)
    for name in registry.dataset("gpt2").required:
        (gpt2 / name).write_text("{}")
    killed = gpt2.parent / f".{gpt2.name}.fetch-{host}-{gone}-b1"
    killed.mkdir()
    assert registry.fetch("gpt2", root=root) == gpt2 and not killed.exists()


def test_cache_folders_are_shared_as_mkdir_makes_them(tmp_path: Path) -> None:
    """Build folders are renamed into the cache as they are: mkdtemp's 0700 left another user of a
    shared cache unable to read a token cache, an extracted archive or a fetched dataset."""
    old = os.umask(0o002)  # a group-shared cache
    try:
        folder = folder_to_build(tmp_path / "cache" / "entry")
        assert folder.stat().st_mode & 0o777 == 0o775 == 0o777 & ~umask()
        final = prepare_tokens(corpus(tmp_path), "bytes", tmp_path / "cache").root
        assert final.stat().st_mode & 0o777 == 0o775
    finally:
        os.umask(old)


def test_a_fetch_that_finishes_after_another_keeps_both_copies_whole(tmp_path: Path) -> None:
    """Two fetches of a dataset with a subfolder (an unpacked archive, a hub snapshot): the second to
    finish used to fail renaming its subfolder onto the first one's (OSError: Directory not empty)."""
    final = tmp_path / "data" / "set"

    def download(tmp: Path, mark: str) -> None:
        (tmp / "batches").mkdir()
        (tmp / "batches" / "data_1").write_text("same bytes")
        (tmp / "readme").write_text("same bytes")
        if mark == "second":  # meanwhile the other fetch finished and installed its copy
            registry._publish(final, lambda t: download(t, "first"), lambda _: None)

    assert registry._publish(final, lambda t: download(t, "second"), lambda _: None) == final
    assert sorted(str(p.relative_to(final)) for p in final.rglob("*")) == ["batches", "batches/data_1", "readme"]
    assert hidden(final.parent) == []


def _prepare(source: str, cache: str, start: Any) -> dict:
    start.wait()
    return prepare_tokens(source, "bytes", cache).meta


def test_two_processes_build_the_same_cache(tmp_path: Path) -> None:
    """Two processes started together on an empty cache (a sweep's workers): both get the same
    complete cache, and nothing temporary is left."""
    source, cache = corpus(tmp_path), tmp_path / "cache"
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(2) as pool:
        start = manager.Event()
        pending = [pool.apply_async(_prepare, (source, str(cache), start)) for _ in range(2)]
        start.set()
        metas = [p.get(timeout=60) for p in pending]
    assert metas[0] == metas[1] == prepare_tokens(source, "bytes", cache).meta
    assert hidden(cache) == []


def test_downloaded_weights_are_shared_as_open_makes_files(tmp_path: Path) -> None:
    """Weights fetched into the cache (`models.vision._download` through `io.download`: a mkstemp
    file, of mode 0600, renamed into place) get the mode open() gives, so other users of a shared
    cache can read them."""
    from owai.io import umask
    from owai.models.vision import _download

    source = tmp_path / "weights.pth"
    source.write_bytes(b"\0" * 64)
    target = tmp_path / "cache" / "weights.pth"
    _download(source.as_uri(), target)
    assert target.read_bytes() == source.read_bytes()
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask()
    assert [p.name for p in target.parent.iterdir()] == ["weights.pth"]


def test_a_write_killed_on_this_host_is_removed_by_the_next_write_of_that_file(tmp_path: Path) -> None:
    """`atomic_write_bytes` names its temporary file by host and process id. A process killed in the
    middle of writing a file of a shared cache (where no resume cleans up) used to leave it there for
    ever; the next write of the same file removes it. A live writer's, another host's, another file's
    and a folder stay."""
    host, gone = socket.gethostname(), dead_pid()
    target = tmp_path / "meta.json"
    left = {name: tmp_path / name for name in (
        f".meta.json.write-{host}-{gone}-k1.tmp",            # killed here: removed
        f".meta.json.write-{host}-{os.getpid()}-k2.tmp",     # writing now (this process): stays
        f".meta.json.write-elsewhere-{gone}-k3.tmp",         # another host's: stays
        f".vocab.json.write-{host}-{gone}-k4.tmp")}          # another file's: stays until it is written
    for path in left.values():
        path.write_text("{")
    atomic_write_bytes(target, b"{}")
    assert target.read_bytes() == b"{}"
    assert sorted(p.name for p in tmp_path.glob(".*")) == sorted(
        name for name in left if "-k1." not in name)
    assert all(is_write_temporary(path) for path in left.values())


def test_a_cache_entry_that_cannot_be_read_or_parsed_is_rebuilt_not_trusted(tmp_path: Path, capsys) -> None:
    """`read_cache_entry` (the Bonsai representations, Camelyon17's rounds, the pre-trained networks of
    dropout-ft and rich-features): a missing, damaged or unparseable entry is None, said in one line."""
    import torch

    from owai import console
    from owai.io import read_cache_entry, write_cache_entry

    path = tmp_path / "cache" / "entry.safetensors"
    assert read_cache_entry(path, lambda t, m: t) is None
    weights = torch.arange(6.0).view(2, 3).t()  # not contiguous: written as it reads
    write_cache_entry(path, {"w": weights}, {"info": json.dumps({"round": 2})})
    tensors, info = read_cache_entry(path, lambda t, m: (t, json.loads(m["info"])))
    assert torch.equal(tensors["w"], weights) and info == {"round": 2}
    assert capsys.readouterr().err == ""
    console.configure()
    assert read_cache_entry(path, lambda t, m: json.loads(m["details"])) is None  # a field it lacks
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    assert read_cache_entry(path, lambda t, m: t) is None
    err = capsys.readouterr().err
    assert err.count(f"rebuilding the unreadable cache entry {path}") == 2 and "Traceback" not in err


def _train_bpe_counted(source: str, cache: str, log: str, start: Any) -> dict:
    """A sweep worker's tokenisation with bpe-300, each tokenizer training and token-cache build
    recorded in `log` (one line per build, with this process's id)."""
    import time

    from owai.data import text

    real_train, real_build = text.train_bpe, tokens._build

    def train_bpe(*a: Any, **kw: Any) -> Any:
        with open(log, "a") as f:
            f.write(f"bpe {os.getpid()}\n")
        time.sleep(1.0)  # a real corpus's training takes minutes: the others arrive while it runs
        return real_train(*a, **kw)

    def build(*a: Any, **kw: Any) -> Any:
        with open(log, "a") as f:
            f.write(f"tokens {os.getpid()}\n")
        time.sleep(1.0)
        return real_build(*a, **kw)

    text.train_bpe, tokens._build = train_bpe, build
    start.wait()
    return prepare_tokens(source, "bpe-300", cache).meta


def test_concurrent_workers_train_a_tokenizer_and_tokenise_a_corpus_once(tmp_path: Path) -> None:
    """Three processes started together on an empty cache (a sweep's workers, `owai.io.build_lock`):
    one trains the bpe tokenizer and one tokenises the corpus, the others wait and read theirs; every
    lock file is gone afterwards."""
    source, cache, log = corpus(tmp_path), tmp_path / "cache", tmp_path / "builds.log"
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(3) as pool:
        start = manager.Event()
        pending = [pool.apply_async(_train_bpe_counted, (source, str(cache), str(log), start)) for _ in range(3)]
        start.set()
        metas = [p.get(timeout=120) for p in pending]
    assert metas[0] == metas[1] == metas[2]
    builds = [line.split()[0] for line in log.read_text().splitlines()]
    assert sorted(builds) == ["bpe", "tokens"]
    assert hidden(cache) == []


def _hold_then(path: str, seconds: float, held: Any, killed: bool) -> None:
    """Take `path`'s build lock, say so, and build it for `seconds` (or be killed while holding it)."""
    import time

    from owai.io import build_lock

    with build_lock(Path(path)):
        held.set()
        if killed:
            os.kill(os.getpid(), 9)
        time.sleep(seconds)
        Path(path).write_text("built by the holder")


def test_a_build_lock_waits_for_its_holder_and_not_for_a_killed_one(tmp_path: Path, capsys) -> None:
    import time

    from owai import console
    from owai.io import build_lock

    final = tmp_path / "entry"
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        held = manager.Event()
        holder = context.Process(target=_hold_then, args=(str(final), 1.0, held, False))
        holder.start()
        assert held.wait(60)
        console.configure()
        with build_lock(final):  # waits for the holder, then finds its entry
            assert final.read_text() == "built by the holder"
        holder.join(60)
        assert "waiting for another process to finish building" in capsys.readouterr().err
        held.clear()
        final.unlink()
        killer = context.Process(target=_hold_then, args=(str(final), 0.0, held, True))
        killer.start()
        assert held.wait(60)
        killer.join(60)
        assert killer.exitcode == -9
        started = time.monotonic()
        with build_lock(final):  # the kernel released the killed holder's lock
            assert not final.exists()
        assert time.monotonic() - started < 5
    assert hidden(tmp_path) == []


def test_a_waiter_that_locked_a_removed_lock_file_waits_for_the_new_holder(tmp_path: Path) -> None:
    """The race `build_lock`'s inode check closes: a waiter queued on the first holder's lock file
    gets its lock only after that file was removed, by which time a third process holds a fresh
    lock file at the same path. The waiter must wait for that one too, not build beside it."""
    import fcntl
    import threading
    import time

    from owai.io import _locked

    path, final = tmp_path / ".entry.lock", tmp_path / "entry"
    first = os.open(path, os.O_CREAT | os.O_RDWR)
    fcntl.flock(first, fcntl.LOCK_EX)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(_locked(path, final, lambda _: None)))
    waiter.start()
    time.sleep(0.5)  # queued on the first lock file
    path.unlink()  # the first holder is done: it removes its lock file ...
    fresh = os.open(path, os.O_CREAT | os.O_RDWR)  # ... a third process makes and locks a new one ...
    fcntl.flock(fresh, fcntl.LOCK_EX)
    os.close(first)  # ... and the first holder releases its lock
    time.sleep(0.5)
    assert waiter.is_alive() and got == []  # waiting for the new holder, not building beside it
    path.unlink()
    os.close(fresh)
    waiter.join(10)
    assert not waiter.is_alive() and got[0] is not None
    assert os.fstat(got[0]).st_ino == os.stat(path).st_ino  # it holds the lock file now at the path
    os.close(got[0])


def _hold_fork_and_die(path: str, held: Any) -> None:
    """Take `path`'s lock, fork a child that lives on (a DataLoader worker), then be SIGKILLed."""
    import time

    from owai.io import build_lock

    with build_lock(Path(path)):
        if os.fork() == 0:  # the child: alive for a while after its parent's death
            time.sleep(5)
            os._exit(0)
        held.set()
        time.sleep(0.2)
        os.kill(os.getpid(), 9)


def test_a_forked_child_does_not_keep_its_dead_parents_lock(tmp_path: Path) -> None:
    """A lock's holder killed while a process it forked still runs (an image run's DataLoader
    workers): the lock is free at once, not when the child notices and exits."""
    from owai.io import build_lock

    final = tmp_path / "point"
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        held = manager.Event()
        holder = context.Process(target=_hold_fork_and_die, args=(str(final), held))
        holder.start()
        assert held.wait(60)
        holder.join(60)
        assert holder.exitcode == -9
        with build_lock(final, wait=False) as mine:
            assert mine  # the forked child (still sleeping) holds no copy of it
