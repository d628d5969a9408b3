"""MNIST from a local IDX directory or from the Hugging Face hub (`ylecun/mnist`).

Local layout: a directory holding `{prefix}-images-idx3-ubyte[.gz]` and
`{prefix}-labels-idx1-ubyte[.gz]` with prefix `train` (60 000 images) or `t10k` (the 10 000-image
test split). Every file is validated before use: the IDX magic number (2051 for images, 2049 for
labels), the header's dimensions (28x28 images), the payload size against the header, matching
image/label counts and labels in 0..9. A missing, truncated or corrupt file raises `OwaiError` with a
one-line message naming the file. `check_md5=True` additionally compares a file with the published
digest of the official distribution (`registry.check_md5`, as fetch and verify do: a mirror's
re-compressed `.gz` passes when its content has the raw file's digest).

Where MNIST comes from (`mnist_dir`): the data-root rule of `owai.data.registry` (an explicit
root, `$OWAI_MNIST_DIR` (legacy alias), `$OWAI_DATA/mnist`, `<cache>/data/mnist`; `owai data fetch
mnist` downloads the official files there). When none holds it, the test split falls back to the
copy of the 10k test split that ships inside the package (`owai/data/mnist_t10k`), so the offline
test presets run anywhere; the 60k training split has no fallback and its absence is a one-line
error naming `owai data fetch mnist`. An explicit `root` wins over a hub id, so the paper presets
(which name `ylecun/mnist`) also run from a local copy of the 60k training set.
`check_md5` knows the official digests of the raw files too.

The hub path (`load_mnist(split, hub_id="ylecun/mnist")`) goes through `datasets.load_dataset`; it
needs network access or a populated Hugging Face cache and is not exercised by the tests.
"""

from __future__ import annotations

import gzip
import hashlib
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from owai.data import registry
from owai.data.registry import MNIST_MIRRORS, Dataset, locate, register, require
from owai.errors import OwaiError

ENV_VAR = "OWAI_MNIST_DIR"  # legacy alias of the data-root rule (owai.data.registry)
HUB_ID = "ylecun/mnist"
IMAGES_MAGIC = 2051  # 0x00000803: unsigned byte, 3 dimensions
LABELS_MAGIC = 2049  # 0x00000801: unsigned byte, 1 dimension
SPLITS = {"train": ("train", 60_000), "test": ("t10k", 10_000)}
# md5 of the official files (yann.lecun.com distribution, as mirrored by torchvision et al.)
OFFICIAL_MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    # the same files uncompressed (e.g. the raw IDX copies that some packages ship)
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}


@dataclass(frozen=True)
class MNIST:
    """One MNIST split: `images` uint8 (N, 28, 28), `labels` int64 (N,) in 0..9."""

    images: torch.Tensor
    labels: torch.Tensor
    split: str
    source: str

    def __len__(self) -> int:
        return int(self.labels.shape[0])


PACKAGED_DIR = Path(__file__).resolve().parent / "mnist_t10k"  # the test split, shipped with owai


@register
def catalogue_entries() -> list[Dataset]:
    """MNIST in the data catalogue: the four official gzip files (raw IDX copies count too)."""
    gz = {k: v for k, v in OFFICIAL_MD5.items() if k.endswith(".gz")}
    raw = {k: v for k, v in OFFICIAL_MD5.items() if not k.endswith(".gz")}
    required = tuple(f"{name}|{name[:-3]}" for name in gz)
    return [Dataset("mnist", "MNIST (60k train + 10k test, IDX)", "mnist", "11.6 MB", required, md5=gz, content_md5=raw,
                    urls=MNIST_MIRRORS, hf_id=HUB_ID, legacy_env=ENV_VAR,
                    ids=("coloredmnist", "inverse-coloredmnist", "rotated-mnist", "mnist-train"),  # sets built from it
                    note="without it, offline test presets use the 10k test split packaged in owai/data/mnist_t10k")]


def split_files(split: str) -> tuple[str, ...]:
    """The registry's `required` entries for one split (gzip or raw IDX)."""
    prefix = SPLITS[split][0]
    return tuple(f"{prefix}-{kind}.gz|{prefix}-{kind}" for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"))


def mnist_dir(split: str = "test", root: str | Path | None = None) -> Path:
    """The IDX directory holding `split` by the data-root rule (`root` = an explicit data root or
    MNIST folder); else, for the test split only, the packaged copy; else a one-line error."""
    if split not in SPLITS:
        raise OwaiError(f"unknown MNIST split {split!r} (known: {', '.join(SPLITS)})")
    if root:
        return require("mnist", root, split_files(split))
    found = locate("mnist", None, split_files(split))
    if found is not None:
        return found
    if split == "test" and PACKAGED_DIR.is_dir():
        return PACKAGED_DIR
    return require("mnist", None, split_files(split))  # raises: not found, run `owai data fetch mnist`


def default_mnist_dir() -> Path | None:
    """The directory the test split is read from when no root is given (see `mnist_dir`)."""
    try:
        return mnist_dir("test")
    except OwaiError:
        return None


def _read_bytes(path: Path, check_md5: bool) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise OwaiError(f"cannot read MNIST file {path}: {exc.strerror or exc}") from None
    if check_md5 and path.name in OFFICIAL_MD5:
        registry.check_md5(path, OFFICIAL_MD5, "mnist")  # as `owai data fetch / verify` check it (a mirror's re-compressed .gz too)
    if path.suffix == ".gz":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise OwaiError(f"MNIST file {path} is not a valid gzip file ({exc})") from None
    return raw


def read_idx(path: str | Path, magic: int, check_md5: bool = False) -> np.ndarray:
    """Read one IDX file (raw or .gz) of unsigned bytes, checking magic number and size."""
    path = Path(path)
    data = _read_bytes(path, check_md5)
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(data) < 4:
        raise OwaiError(f"MNIST file {path} is truncated ({len(data)} bytes)")
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise OwaiError(f"MNIST file {path} has IDX magic {found:#010x}, expected {magic:#010x}")
    if len(data) < header:
        raise OwaiError(f"MNIST file {path} is truncated inside its header ({len(data)} bytes)")
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = header + int(np.prod(dims, dtype=np.int64))
    if len(data) != expected:
        raise OwaiError(
            f"MNIST file {path} has {len(data)} bytes, its header {dims} needs {expected}"
            + (" (truncated)" if len(data) < expected else " (trailing data)")
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _find(root: Path, prefix: str, kind: str) -> Path:
    stem = f"{prefix}-{kind}"
    candidates = [root / f"{stem}.gz", root / stem, root / f"{stem.replace('-idx', '.idx')}.gz",
                  root / stem.replace("-idx", ".idx")]
    for path in candidates:
        if path.is_file():
            return path
    raise OwaiError(f"MNIST file {root / stem}[.gz] not found; run `owai data fetch mnist` (or give a complete IDX directory)")


def check_mnist_dir(root: str | Path, split: str) -> None:
    """Before a run: the split's two files are readable MNIST. The official files are recognised by
    their md5 (milliseconds); any other copy is decoded, so a truncated or corrupt file is one line
    naming it before any run or sweep directory exists."""
    root = Path(root).expanduser()
    prefix, _ = SPLITS[split]
    paths = [_find(root, prefix, kind) for kind in ("images-idx3-ubyte", "labels-idx1-ubyte")]
    if all(p.name in OFFICIAL_MD5 and hashlib.md5(p.read_bytes()).hexdigest() == OFFICIAL_MD5[p.name]  # noqa: S324
           for p in paths):
        return
    load_mnist_idx(root, split)


def load_mnist_idx(root: str | Path, split: str = "test", check_md5: bool = False) -> MNIST:
    """Read split 'train' (60k) or 'test' (t10k, 10k) from an IDX directory."""
    if split not in SPLITS:
        raise OwaiError(f"unknown MNIST split {split!r} (known: {', '.join(SPLITS)})")
    root = Path(root).expanduser()
    if not root.is_dir():
        raise OwaiError(f"MNIST directory {root} does not exist")
    prefix, _ = SPLITS[split]
    img_path = _find(root, prefix, "images-idx3-ubyte")
    lab_path = _find(root, prefix, "labels-idx1-ubyte")
    images = read_idx(img_path, IMAGES_MAGIC, check_md5)
    labels = read_idx(lab_path, LABELS_MAGIC, check_md5)
    if images.shape[1:] != (28, 28):
        raise OwaiError(f"MNIST file {img_path} holds {images.shape[1]}x{images.shape[2]} images, expected 28x28")
    if images.shape[0] != labels.shape[0]:
        raise OwaiError(f"MNIST file {img_path} has {images.shape[0]} images but {lab_path} {labels.shape[0]} labels")
    if labels.size and labels.max() > 9:
        raise OwaiError(f"MNIST file {lab_path} has a label {int(labels.max())} outside 0..9")
    return MNIST(
        images=torch.from_numpy(images.copy()),
        labels=torch.from_numpy(labels.astype(np.int64)),
        split=split,
        source=str(root),
    )


def load_mnist_hub(split: str = "train", hub_id: str = HUB_ID) -> MNIST:
    """Read a split of `ylecun/mnist` (columns `image`, `label`) through `datasets`."""
    if split not in SPLITS:
        raise OwaiError(f"unknown MNIST split {split!r} (known: {', '.join(SPLITS)})")
    from owai.hub import load_dataset

    ds = load_dataset(hub_id, split=split, what=f"MNIST {hub_id!r} split {split!r}")
    images = np.stack([np.asarray(im, dtype=np.uint8) for im in ds["image"]])
    labels = np.asarray(ds["label"], dtype=np.int64)
    if images.shape[1:] != (28, 28) or images.shape[0] != labels.shape[0]:
        raise OwaiError(f"MNIST {hub_id!r} split {split!r} has unexpected shape {images.shape}")
    return MNIST(torch.from_numpy(images), torch.from_numpy(labels), split=split, source=f"hf:{hub_id}")


def load_mnist(split: str = "test", root: str | Path | None = None, hub_id: str | None = None,
               check_md5: bool = False) -> MNIST:
    """MNIST `split` from the explicit data root `root` (an IDX directory, or a root holding
    mnist/) if given; else a local copy found by the data-root rule; else from `hub_id`; else (test
    split) the packaged copy. Nothing at all is a one-line error naming `owai data fetch mnist`."""
    if root is None and hub_id:
        local = locate("mnist", None, split_files(split)) if split in SPLITS else None
        if local is None:
            return load_mnist_hub(split, hub_id)
        root = local
    return load_mnist_idx(mnist_dir(split, root) if root is not None else mnist_dir(split), split, check_md5)
