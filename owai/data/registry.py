"""The datasets owai knows, where it looks for them, and how to fetch and verify them.

The catalogue's entries come from the modules that read the datasets (`register`): mnist,
camelyon17, domainbed, text and classification each declare theirs, and `owai.data` imports them
all before any of its modules runs. This module imports none of them.

One lookup rule for every dataset (`locate`):

1. an explicit root (a command's `--data-root DIR`, or the method's `data.root` setting): the
   dataset is `DIR/<subfolder>` when that exists, else `DIR` itself (DIR may be the dataset's own
   folder). An explicit root is authoritative: nothing else is searched.
2. the dataset's legacy variable, if it has one and it is set (`$OWAI_MNIST_DIR`,
   `$OWAI_BABISTORIES`: the dataset's own folder; kept as aliases);
3. `$OWAI_DATA/<subfolder>`: one root holding every dataset under its subfolder (mnist/,
   camelyon17/, domainbed/PACS/, text/babistories/, ...);
4. the cache, `<cache>/data/<subfolder>` (`$OWAI_CACHE`, default ~/.cache/owai; see owai.io), where
   `owai data fetch` puts what it downloads.

Steps 2-4 take the first location where the dataset is present (its files exist). A dataset found
nowhere is a one-line `OwaiError` naming `owai data fetch NAME`, or the manual step for data that
owai cannot download (the DomainBed image sets, BabiStories, the licence-gated image sets: ImageNet,
iNaturalist 2018, CUB-200-2011, miniImageNet).

Entries cover tokenizers too (GPT-2's BPE files), and the inputs read straight from the hub (a hub
tokenizer, a streamed corpus: `ids` names them; `entry_for` maps any config value to its entry), so
`owai data list` names everything a recipe reads. Files that are fixed have their sha256 here
(`sha256` per file, `tree_sha256` for a folder of many: the digest of its sorted "path sha256" lines),
checked by `verify` and by a fetch from a plain URL.

Fetching writes into a temporary directory beside the destination, verifies every file (published
md5 where there is one), then renames the directory into place: a failed or corrupted download
leaves nothing behind. Downloads without published checksums (Hugging Face snapshots) record the
sha256 of each file in `owai-manifest.json`, which `verify` checks later. An archive (CIFAR's python
tarballs) is checked against its published md5, unpacked (tarfile's "data" filter: nothing outside
the folder, no devices or absolute links), and its files' sha256 go into the same manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from owai.errors import DataMissing, OwaiError, one_line
from owai.io import cache_root, cannot_write, download, file_digest, folder_to_build, remove_dead_builds

DATA_ENV = "OWAI_DATA"
MNIST_MIRROR_ENV = "OWAI_MNIST_MIRROR"  # comma-separated base URLs replacing MNIST_MIRRORS
MANIFEST = "owai-manifest.json"
# Well-known copies of the official MNIST files (yann.lecun.com itself needs a login now).
MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)


@dataclass(frozen=True)
class Dataset:
    """One dataset: its folder under a data root, what must be there, and how to get it."""

    name: str
    title: str
    subfolder: str
    size: str  # download size, for `owai data list`
    required: tuple[str, ...]  # paths (relative to the dataset folder) that must exist; "a|b": either
    md5: dict[str, str] = field(default_factory=dict)  # published checksums of files
    content_md5: dict[str, str] = field(default_factory=dict)  # published checksums of the `md5` files decompressed
    urls: tuple[str, ...] = ()  # base URLs holding the md5 files (downloadable datasets)
    hf_id: str = ""  # Hugging Face dataset id (snapshot-downloadable, or an alternative source)
    hf_patterns: tuple[str, ...] = ()  # files of the hub repository that make up the dataset
    manual: str = ""  # the manual step, for data owai cannot download
    archive: str = ""  # a tarball under `urls` that unpacks into the dataset folder
    archive_md5: str = ""  # its published md5
    legacy_env: str = ""
    aliases: tuple[str, ...] = ()
    note: str = ""
    sha256: dict[str, str] = field(default_factory=dict)  # fixed files: their sha256 (fetched from `urls` when there are urls)
    tree_sha256: str = ""  # a fixed folder of many files: sha256 of its sorted "relative/path sha256" lines
    tree_glob: str = "*"  # which files `tree_sha256` covers
    ids: tuple[str, ...] = ()  # other names a config reads it by: hub ids, paths under a data root, tokenizer names
    kind: str = "dataset"  # or "tokenizer"
    check: Callable[[Path], str] | None = field(default=None, compare=False, repr=False)  # the loader reads a copy: what it found
    download: Callable[[Path], object] | None = field(default=None, compare=False, repr=False)  # its own download into a folder

    def present(self, folder: Path, required: tuple[str, ...] | None = None) -> bool:
        """Whether `folder` holds the dataset's required files (or the given subset)."""
        if not folder.is_dir():
            return False
        return all(any((folder / alt).exists() for alt in item.split("|")) for item in (required or self.required))

    def how_to_get(self) -> str:
        """The one-line instruction for a missing copy."""
        if self.manual:
            return self.manual
        return f"run `owai data fetch {self.name}`"


Entries = Callable[[], list[Dataset]]
_ENTRIES: list[Entries] = []


def register(entries: Entries) -> Entries:
    """Add a loader module's catalogue entries (used as a decorator on a function returning them).

    Each module that reads a dataset declares it here; the registry imports none of them.
    `owai.data` (the package's __init__, which runs before any of its modules) imports every loader,
    so the catalogue is complete wherever the registry is used. The function is called by each
    `catalogue()`, so an entry reflects the module's constants as they are then."""
    if entries not in _ENTRIES:
        _ENTRIES.append(entries)
    return entries


def catalogue() -> dict[str, Dataset]:
    """Every dataset owai reads, by name (in the order owai.data imports the loaders)."""
    return {d.name: d for entries in _ENTRIES for d in entries()}


def dataset(name: str) -> Dataset:
    """The catalogue entry `name` (or an alias); an unknown name is a user error."""
    sets = catalogue()
    for d in sets.values():
        if name == d.name or name in d.aliases:
            return d
    raise OwaiError(f"unknown dataset {name!r} (known: {', '.join(sets)})")


# Inputs owai makes itself (no file to list): generated or packaged data, built tokenizers, "" (unset).
GENERATED = ("", "owai-stories", "bytes", "synthetic", "mnist-t10k", "digits", "hf")


def entry_for(value: str) -> Dataset | None:
    """The catalogue entry a config value reads: a name or alias, a hub id or other id (`ids`), or a
    path under a data root (the entry's folder or a file in it, e.g. text/sotu.tar.gz); None if none."""
    text = str(value).strip()
    text = text[3:] if text.startswith("hf:") else text
    for d in catalogue().values():
        names = {d.name, *d.aliases, *d.ids, d.hf_id} - {""}
        base = text.split(":", 1)[0] if ":" in text and not text.startswith(("/", "~")) else text
        if text in names or base in names:
            return d
        if _names_folder_or_file(d, text):
            return d
    return None


def _names_folder_or_file(d: Dataset, path: str) -> bool:
    """Whether a path relative to a data root is the entry's folder or a file in it (text/sotu.tar.gz)."""
    rel = path.strip().rstrip("/")
    return rel == d.subfolder or any(rel == f"{d.subfolder}/{f}" for f in (*d.required, *d.sha256))


def missing_relative(path: str, root: str | Path | None = None) -> str | None:
    """The one line of `missing_message` for a relative data-root path that names a catalogue entry's
    folder or file (tokenizers/gpt2, text/sotu.tar.gz) and was found nowhere; None for any other path,
    and for a folder that holds other entries' folders too (`text` is sotu's, and every corpus's parent)."""
    sets = catalogue().values()
    shared = {d.subfolder for d in sets if any(o.subfolder.startswith(d.subfolder + "/") for o in sets)}
    for d in sets:
        if _names_folder_or_file(d, str(path)) and str(path).strip().rstrip("/") not in shared:
            return missing_message(d.name, root)
    return None


def generated(value: str) -> bool:
    """Whether a config value names an input owai makes itself (GENERATED, bpe-N, owai-stories:N)."""
    import re

    text = str(value).strip()
    return text in GENERATED or bool(re.fullmatch(r"bpe-\d+|owai-stories:\d+", text))


def cache_data_root() -> Path:
    """Where `owai data fetch` puts datasets by default: `<cache>/data`."""
    return cache_root() / "data"


def explicit_folder(ds: Dataset, root: str | Path) -> Path:
    """The dataset's folder under an explicit root: ROOT/<subfolder> if it exists, else ROOT."""
    root = Path(root).expanduser()
    sub = root / ds.subfolder
    return sub if sub.is_dir() else root


def candidates(ds: Dataset) -> list[tuple[str, Path]]:
    """The implicit places searched, in order: (label, folder)."""
    places = []
    if ds.legacy_env and os.environ.get(ds.legacy_env):
        places.append((f"${ds.legacy_env}", Path(os.environ[ds.legacy_env]).expanduser()))
    if os.environ.get(DATA_ENV):
        places.append((f"${DATA_ENV}", Path(os.environ[DATA_ENV]).expanduser() / ds.subfolder))
    places.append(("cache", cache_data_root() / ds.subfolder))
    return places


def locate(name: str, root: str | Path | None = None, required: tuple[str, ...] | None = None) -> Path | None:
    """The dataset's folder by the lookup rule (module docstring), or None when it is nowhere.
    With an explicit `root` the folder is returned whether or not it is complete (the loader names
    what is missing); `required` narrows what counts as present (e.g. only MNIST's test files)."""
    ds = dataset(name)
    if root:
        return explicit_folder(ds, root)
    for _, folder in candidates(ds):
        if ds.present(folder, required):
            return folder
    return None


def data_env_problem() -> str:
    """"$OWAI_DATA=PATH is a file, not a folder" or "$OWAI_DATA=PATH does not exist" when it is set but
    names no folder, else "": what a missing-data message adds to say why nothing was found there."""
    value = os.environ.get(DATA_ENV)
    if not value or Path(value).expanduser().is_dir():
        return ""
    return f"${DATA_ENV}={value} {'is a file, not a folder' if Path(value).expanduser().exists() else 'does not exist'}"


def missing_message(name: str, root: str | Path | None = None) -> str:
    """One line: where the dataset was looked for and how to get it."""
    ds = dataset(name)
    if root:
        where = str(explicit_folder(ds, root))
    else:
        problem = data_env_problem()
        where = ", ".join(f"{label} ({folder}{f': {problem}' if problem and label == f'${DATA_ENV}' else ''})"
                          for label, folder in candidates(ds))
    fetch = ds.how_to_get()
    if root and not ds.manual:
        fetch = f"run `owai data fetch {ds.name} --data-root {root}`"
    return f"{ds.title} not found in {where}; {fetch}"


def require(name: str, root: str | Path | None = None, required: tuple[str, ...] | None = None) -> Path:
    """`locate`, or the one-line error naming the fetch command (or manual step)."""
    folder = locate(name, root, required)
    if folder is None or (root and not dataset(name).present(folder, required)):
        raise DataMissing(missing_message(name, root))
    return folder


def find_relative(path: str, root: str | Path | None = None) -> Path | None:
    """A relative path looked up under the explicit root, else under $OWAI_DATA, else the cache
    (plain text files and folders named relative to a data root)."""
    rel = Path(path)
    if rel.is_absolute() or path.startswith("~"):
        return None
    bases = [Path(root).expanduser()] if root else [Path(p).expanduser() for p in [os.environ.get(DATA_ENV)] if p] + [cache_data_root()]
    for base in bases:
        if (base / rel).exists():
            return base / rel
    return None


# -- verify ---------------------------------------------------------------------------------------


def verify(name: str, folder: Path) -> list[str]:
    """Check the copy at `folder`; returns what was checked (one line each) or raises `OwaiError`
    with the first problem. Published md5 where known, else the fetch-time manifest, else the layout."""
    ds = dataset(name)
    if not ds.present(folder):
        raise DataMissing(missing_message(name, folder))
    checked = []
    for file in ds.md5:
        path = next(folder / alt for alt in (file, file[:-3]) if (folder / alt).exists())
        checked.append(f"{path.name}: {check_md5(path, {**ds.md5, **ds.content_md5}, name)}")
    for file, expected in ds.sha256.items():
        got = file_digest(folder / file, "sha256")
        if got != expected:
            raise OwaiError(f"{folder / file} has sha256 {got[:16]}..., expected {expected[:16]}...; {_refetch(ds)}")
        checked.append(f"{file}: sha256 ok")
    if ds.tree_sha256:
        got, count = tree_digest(folder, ds.tree_glob)
        if got != ds.tree_sha256:
            raise OwaiError(f"{folder}: its {count} {ds.tree_glob} files have tree sha256 {got[:16]}..., expected "
                            f"{ds.tree_sha256[:16]}... (a file added, missing or changed); {_refetch(ds)}")
        checked.append(f"{count} {ds.tree_glob} files: tree sha256 ok")
    manifest = folder / MANIFEST
    if manifest.is_file():
        checked += _verify_manifest(folder, manifest, name)
    if ds.check is not None:
        checked.append(ds.check(folder))
    if not checked:
        checked.append("layout ok (" + (", ".join(ds.required) or "folder present") + "); no published checksums")
    return checked


def tree_digest(folder: Path, glob: str = "*") -> tuple[str, int]:
    """(sha256 of the sorted "relative/path sha256" lines of the files under `folder` matching `glob`,
    their number): one checksum for a fixed folder of many files."""
    files = sorted(p for p in folder.rglob(glob) if p.is_file() and p.name != MANIFEST)
    lines = "".join(f"{p.relative_to(folder).as_posix()} {file_digest(p, 'sha256')}\n" for p in files)
    return hashlib.sha256(lines.encode()).hexdigest(), len(files)


def _refetch(ds: Dataset) -> str:
    """How to replace a copy that fails its checksum."""
    return f"delete it and run `owai data fetch {ds.name}`" if not ds.manual else f"get a fresh copy: {ds.manual}"


def check_md5(path: Path, published: dict[str, str], name: str) -> str:
    """Compare a file with its published md5; a `.gz` whose bytes differ (re-compressed by a mirror)
    passes when its decompressed content has the published md5 of the raw file. Returns what matched."""
    import gzip
    import zlib

    got = file_digest(path, "md5")
    if got == published[path.name]:
        return f"md5 {got} ok"
    raw = published.get(path.name[:-3]) if path.name.endswith(".gz") else None
    if raw is not None:
        try:
            content = hashlib.md5(gzip.decompress(path.read_bytes())).hexdigest()  # noqa: S324 - published checksum
        except (OSError, EOFError, zlib.error):
            content = "not gzip"
        if content == raw:
            return f"content md5 {content} ok (re-compressed copy)"
    raise OwaiError(f"{path} has md5 {got}, expected {published[path.name]}; delete it and run `owai data fetch {name}`")


def _verify_manifest(folder: Path, manifest: Path, name: str) -> list[str]:
    try:
        entries = json.loads(manifest.read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OwaiError(f"{manifest} is unreadable ({exc})") from None
    out = []
    for rel, expected in sorted(entries.items()):
        path = folder / rel
        if not path.is_file():
            raise OwaiError(f"{path} is missing; run `owai data fetch {name}` again")
        got = file_digest(path, "sha256")
        if got != expected:
            raise OwaiError(f"{path} has sha256 {got[:16]}..., the download had {expected[:16]}...; run `owai data fetch {name}` again")
        out.append(f"{rel}: sha256 ok")
    return out


# -- fetch ----------------------------------------------------------------------------------------


def mirrors(base_url: str | None = None) -> tuple[str, ...]:
    """MNIST base URLs: `base_url`, else $OWAI_MNIST_MIRROR (comma-separated), else MNIST_MIRRORS."""
    text = base_url or os.environ.get(MNIST_MIRROR_ENV, "")
    urls = tuple(u.strip() for u in text.split(",") if u.strip())
    return tuple(u if u.endswith("/") else u + "/" for u in urls) or MNIST_MIRRORS


def fetch(name: str, root: str | Path | None = None, base_url: str | None = None,
          info: Callable[[str], None] = lambda _: None) -> Path:
    """Download dataset `name` into `root/<subfolder>` (default: the cache), verified; returns the folder.
    An existing, complete copy is kept (verify it with `owai data verify`)."""
    ds = dataset(name)
    if base_url and not (ds.archive or ds.md5 or (ds.sha256 and ds.urls)):
        raise OwaiError(f"--mirror is for datasets downloaded from checked URLs (mnist, cifar10, ...); "
                        f"{ds.name} is fetched from its own source")
    base = Path(root).expanduser() if root else cache_data_root()
    final = base / ds.subfolder
    blocked = next((p for p in (final, *final.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:  # before any download: nothing can be saved under a file
        raise OwaiError(f"{'--data-root ' + str(base) if root else 'the cache ' + str(base)}: {blocked} is a file, "
                        "not a folder to fetch into")
    if ds.present(final) and ds.required:
        remove_dead_builds(final, "fetch")  # a fetch killed while another one finished it
        info(f"{ds.title} is already in {final}")
        return final
    if ds.manual:
        raise OwaiError(f"{ds.title} cannot be downloaded by owai; {ds.manual}")
    if ds.download is not None:
        return _publish(final, ds.download, info)
    if ds.archive:
        urls = mirrors(base_url) if base_url else ds.urls
        return _publish(final, lambda tmp: _fetch_archive(ds, tmp, urls, info), info)
    if ds.md5:
        return _publish(final, lambda tmp: _fetch_files(ds, tmp, mirrors(base_url), info), info)
    if ds.sha256 and ds.urls:
        return _publish(final, lambda tmp: _fetch_sha256(ds, tmp, mirrors(base_url) if base_url else ds.urls, info), info)
    if not ds.hf_patterns:
        raise OwaiError(f"{ds.title} is read from the hub (hf:{ds.hf_id}) when used; there is nothing to fetch")
    return _publish(final, lambda tmp: _fetch_hub(ds, tmp, info), info)


def _fetch_sha256(ds: Dataset, tmp: Path, urls: tuple[str, ...], info: Callable[[str], None]) -> None:
    """Each file of `ds.sha256` from the first URL that serves it with that sha256; others are refused."""
    def refused(dest: Path, file: str) -> str | None:
        got, expected = file_digest(dest, "sha256"), ds.sha256[file]
        return None if got == expected else f"has sha256 {got[:16]}..., expected {expected[:16]}..."

    _fetch_checked(ds, tmp, urls, info, tuple(ds.sha256), refused)


def _local_write_failure(exc: BaseException) -> bool:
    """A download that failed writing here (disk full, read-only, no permission), not at the mirror."""
    import errno

    return (isinstance(exc, OSError) and not isinstance(exc, urllib.error.URLError)
            and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM))


def _fetch_checked(ds: Dataset, tmp: Path, urls: tuple[str, ...], info: Callable[[str], None], files: tuple[str, ...],
                   refused: Callable[[Path, str], str | None]) -> None:
    """Each of `files` from the first URL that serves it and passes its check (`refused`: None, or why
    the downloaded copy is refused); a file no URL serves intact is one error naming every attempt."""
    for file in files:
        problems = []
        for url in urls:
            dest = tmp / file
            try:
                info(f"downloading {url}{file}")
                download(url + file, dest)
            except (urllib.error.URLError, OSError, ValueError) as exc:
                dest.unlink(missing_ok=True)
                if _local_write_failure(exc):  # no room or no right to write here: another mirror cannot help
                    raise cannot_write(dest, exc) from None
                problems.append(f"{url}{file}: {getattr(exc, 'reason', None) or exc}")
                continue
            why = refused(dest, file)
            if why is None:
                break
            dest.unlink()
            problems.append(f"{url}{file} {why} (refused)")
        else:
            raise OwaiError(f"cannot fetch {ds.name} file {file}: " + "; ".join(problems))


def _publish(final: Path, fill: Callable[[Path], None], info: Callable[[str], None]) -> Path:
    """Fill a temporary directory beside `final`, then rename it into place (nothing left on failure)."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only or full data root, a file where a folder goes
        raise cannot_write(final.parent, e) from None
    if final.exists() and not final.is_dir():
        raise OwaiError(f"{final} exists and is not a directory")
    tmp = folder_to_build(final, "fetch")
    try:
        fill(tmp)
        try:
            os.rename(tmp, final)  # atomic; refused where `final` is a folder with files in it
        except OSError as e:
            if not final.is_dir():
                raise OwaiError(f"cannot save {final} ({e.strerror or type(e).__name__})") from None
            # An incomplete earlier copy, or one another process fetched meanwhile: keep what it has
            # beside the new files. Looked at after the rename is refused, not before: a copy that
            # appeared between that look and the rename failed the fetch (an internal error).
            _merge_into(tmp, final)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info(f"saved in {final}")
    return final


def _merge_into(source: Path, folder: Path) -> None:
    """Move everything under `source` into `folder`, file by file (each replace is atomic): a folder
    that both have is merged the same way, since a rename refuses a folder onto one with files in it
    (two fetches of a dataset with subfolders, e.g. an unpacked archive, finishing one after the other)."""
    for item in source.iterdir():
        target = folder / item.name
        if item.is_dir() and not item.is_symlink() and target.is_dir() and not target.is_symlink():
            _merge_into(item, target)
        else:
            os.replace(item, target)


def _fetch_files(ds: Dataset, tmp: Path, urls: tuple[str, ...], info: Callable[[str], None]) -> None:
    """Each md5 file from the first mirror that serves it intact; a corrupted file is refused."""
    published = {**ds.md5, **ds.content_md5}

    def refused(dest: Path, file: str) -> str | None:
        try:
            check_md5(dest, published, ds.name)
            return None
        except OwaiError:
            return f"has md5 {file_digest(dest, 'md5')}, expected {ds.md5[file]}"

    _fetch_checked(ds, tmp, urls, info, tuple(ds.md5), refused)


def _fetch_archive(ds: Dataset, tmp: Path, urls: tuple[str, ...], info: Callable[[str], None]) -> None:
    """The archive from the first URL that serves it with its published md5, unpacked into `tmp`
    (then deleted), with a sha256 manifest of the unpacked files for `verify`."""
    import tarfile

    dest, problems = tmp / ds.archive, []
    for url in urls:
        try:
            info(f"downloading {url}{ds.archive}")
            download(url + ds.archive, dest)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            dest.unlink(missing_ok=True)
            problems.append(f"{url}{ds.archive}: {getattr(exc, 'reason', None) or exc}")
            continue
        got = file_digest(dest, "md5")
        if ds.archive_md5 and got != ds.archive_md5:
            dest.unlink()
            problems.append(f"{url}{ds.archive} has md5 {got}, expected {ds.archive_md5} (refused)")
            continue
        break
    else:
        raise OwaiError(f"cannot fetch {ds.name} archive {ds.archive}: " + "; ".join(problems))
    info(f"unpacking {ds.archive}")
    try:
        with tarfile.open(dest) as tar:
            tar.extractall(tmp, filter="data")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise OwaiError(f"cannot unpack {url}{ds.archive}: {exc}") from None
    dest.unlink()
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    digests = {str(p.relative_to(tmp)): file_digest(p, "sha256") for p in files}
    (tmp / MANIFEST).write_text(json.dumps({"archive": url + ds.archive, "md5": got, "sha256": digests}, indent=2))


def _fetch_hub(ds: Dataset, tmp: Path, info: Callable[[str], None]) -> None:
    """A snapshot of the dataset's hub files, with a sha256 manifest for `verify`."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise OwaiError(f"fetching {ds.name} needs huggingface_hub: pip install huggingface_hub") from None
    info(f"downloading {ds.hf_id} ({', '.join(ds.hf_patterns)}) from the Hugging Face hub")
    try:
        snapshot_download(ds.hf_id, repo_type="dataset", allow_patterns=list(ds.hf_patterns), local_dir=tmp)
    except Exception as exc:  # noqa: BLE001 - any hub failure is one line
        raise OwaiError(f"cannot fetch {ds.hf_id} from the Hugging Face hub: {one_line(exc)}") from None
    shutil.rmtree(tmp / ".cache", ignore_errors=True)  # huggingface_hub's download metadata
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    if not files:
        raise OwaiError(f"{ds.hf_id}: no file matches {', '.join(ds.hf_patterns)}")
    digests = {str(p.relative_to(tmp)): file_digest(p, "sha256") for p in files}
    (tmp / MANIFEST).write_text(json.dumps({"hf_id": ds.hf_id, "patterns": list(ds.hf_patterns), "sha256": digests}, indent=2))


# -- list -----------------------------------------------------------------------------------------


def status(root: str | Path | None = None) -> list[dict[str, Any]]:
    """One row per dataset: name, where it is (or was looked for), found or not, size, how to get it."""
    rows = []
    for ds in catalogue().values():
        folder = locate(ds.name, root)
        found = folder is not None and ds.present(folder) and (bool(ds.required) or any(folder.iterdir()))
        where = str(folder) if found else (str(explicit_folder(ds, root)) if root else
                                           " | ".join(str(f) for _, f in candidates(ds)))
        how = ds.how_to_get()
        if ds.hf_id and not ds.manual:
            how += f" (hub: {ds.hf_id})"
        verified = "-"
        if found and (ds.md5 or ds.sha256 or ds.tree_sha256):  # cheap (a few MB each); larger sets: `owai data verify NAME`
            try:
                verify(ds.name, folder)  # type: ignore[arg-type]
                verified = "yes"
            except OwaiError:
                verified = "FAILED"
        rows.append({"name": ds.name, "kind": ds.kind, "found": "yes" if found else "no", "verified": verified,
                     "where": where, "size": ds.size, "get": how, "note": ds.note, "reads": list(ds.ids)})
    return rows
