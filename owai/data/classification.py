"""Labelled image classification sets for the rich-feature experiments (issue #24; thesis ch. 2).

One small type, `ClassificationData(images, labels, classes)`: `images` is a uint8 tensor (N, H, W)
or (N, H, W, 3) for the small sets held in memory (CIFAR, scikit-learn's digits), or a list of image
paths for the image folders (decoded lazily with PIL by `image(i)`); `labels` int64 (N,) in
0..len(classes)-1.

Readers (each by path, `read_*`; `load(name, split, root)` finds the folder by the data-root rule of
`owai.data.registry`, so a missing dataset is one line naming `owai data fetch NAME` or its manual
step):

* CIFAR-10 / CIFAR-100, the official python version (`cifar-10-batches-py/data_batch_1..5,
  test_batch, batches.meta`; `cifar-100-python/train, test, meta`, fine labels). The pickles are read
  by `CifarUnpickler`, which resolves only the three numpy names an array needs and refuses any other
  global before it is called, so a tampered file executes nothing. Shapes (N x 3072 uint8) and label
  ranges are checked; a corrupt or truncated file is one line naming it. Also from the Hugging Face
  hub (`uoft-cs/cifar10`, `uoft-cs/cifar100`) through `datasets.load_dataset`.
* ImageNet-style folders `root/{train,val}/<class>/<image>` (classes: the sorted folders of train/).
* CUB-200-2011, official layout (images.txt, image_class_labels.txt, train_test_split.txt,
  classes.txt, images/). Splits: "all"; "train"/"test" = the official image split
  (train_test_split.txt: 5 994 / 5 794 images over all 200 classes); "base"/"val"/"novel" = the
  few-shot class split of Chen et al. 2019 (`chen_class_split`: class index i, in classes.txt order,
  is base when i % 2 == 0, val when i % 4 == 1, novel when i % 4 == 3: 100 / 50 / 50 classes).
* miniImageNet, Ravi & Larochelle's layout: images/ and train.csv, val.csv, test.csv (columns
  filename,label; 64 / 16 / 20 classes; Chen et al.'s base / val / novel).
* iNaturalist 2018: train2018.json / val2018.json (COCO style: images[].file_name relative to the
  dataset folder, annotations[].category_id; classes = the sorted category ids).
* scikit-learn's bundled 8x8 digits (`load_digits`, no download).

A class subset (`select_classes`) relabels its examples 0..k-1 in the order the classes are given;
`disjoint_split` refuses base/target class sets that overlap (stand-in transfer tasks).
"""

from __future__ import annotations

import csv
import json
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from owai.data import registry
from owai.data.images import Paths, check_style, image_files, visible_dirs
from owai.errors import OwaiError, one_line

# -------------------------------------------------------------------------------------------- the type


@dataclass(frozen=True)
class ClassificationData:
    """`images`: uint8 (N, H, W) / (N, H, W, 3) tensor, or N image paths; `labels`: int64 (N,) indexing
    `classes`; `source`: where it was read from (for messages); `style`: how its images become
    tensors (`owai.data.images.STYLES`; subsets keep it)."""

    images: torch.Tensor | Sequence[Path]  # a list of paths is kept as `Paths` (one array, no object per path)
    labels: torch.Tensor
    classes: list[str]
    source: str = ""
    style: str = "domainbed"

    def __post_init__(self) -> None:
        where = self.source or "classification data"
        if not isinstance(self.images, (torch.Tensor, Paths)):  # DataLoader workers would each copy a list
            object.__setattr__(self, "images", Paths(self.images))
        if isinstance(self.images, torch.Tensor):
            if self.images.dtype != torch.uint8 or self.images.dim() not in (3, 4) or (
                    self.images.dim() == 4 and self.images.shape[-1] != 3):
                raise OwaiError(f"{where}: images must be uint8 (N, H, W) or (N, H, W, 3), got "
                                f"{self.images.dtype} {tuple(self.images.shape)}")
        if self.labels.dtype != torch.int64 or self.labels.dim() != 1:
            raise OwaiError(f"{where}: labels must be int64 (N,), got {self.labels.dtype} {tuple(self.labels.shape)}")
        if len(self.images) != self.labels.shape[0]:
            raise OwaiError(f"{where}: {len(self.images)} images but {self.labels.shape[0]} labels")
        check_style(self.style)
        if len(set(self.classes)) != len(self.classes):
            raise OwaiError(f"{where}: duplicate class names")
        if self.labels.numel() and (int(self.labels.min()) < 0 or int(self.labels.max()) >= len(self.classes)):
            raise OwaiError(f"{where}: a label outside 0..{len(self.classes) - 1}")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def image(self, index: int) -> Image.Image:
        """Example `index` as an RGB PIL image (a path is decoded now; a bad file is one line naming it)."""
        if isinstance(self.images, torch.Tensor):
            return Image.fromarray(self.images[index].numpy()).convert("RGB")
        path = self.images[index]
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except Exception as exc:  # noqa: BLE001 - any decode failure of a user's file
            raise OwaiError(f"cannot decode image {path}: {exc}") from None


def _subset(data: ClassificationData, keep: torch.Tensor, labels: torch.Tensor | None = None,
            classes: list[str] | None = None) -> ClassificationData:
    """The examples at indices `keep` (optionally relabelled over new `classes`)."""
    idx = keep.tolist()
    images = data.images[keep] if isinstance(data.images, torch.Tensor) else data.images.take(idx)
    return ClassificationData(images, data.labels[keep] if labels is None else labels,
                              data.classes if classes is None else classes, data.source, data.style)


def select_classes(data: ClassificationData, classes: Sequence[str]) -> ClassificationData:
    """The examples of `classes` (names of `data.classes`), relabelled 0..k-1 in the given order."""
    classes = [str(c) for c in classes]
    unknown = [c for c in classes if c not in data.classes]
    if unknown:
        raise OwaiError(f"unknown class(es) {', '.join(map(repr, unknown[:5]))} in {data.source or 'the data'} "
                        f"(it has {len(data.classes)}: {', '.join(data.classes[:5])}{', ...' if len(data.classes) > 5 else ''})")
    if len(set(classes)) != len(classes):
        raise OwaiError(f"class list {classes} has duplicates")
    new_label = torch.full((len(data.classes),), -1, dtype=torch.int64)
    for k, name in enumerate(classes):
        new_label[data.classes.index(name)] = k
    mapped = new_label[data.labels]
    keep = torch.nonzero(mapped >= 0).flatten()
    return _subset(data, keep, mapped[keep], classes)


def disjoint_split(base_classes: Sequence[str], target_classes: Sequence[str]) -> tuple[list[str], list[str]]:
    """(base, target) as lists, refusing empty, duplicated or overlapping class sets."""
    base, target = [str(c) for c in base_classes], [str(c) for c in target_classes]
    for what, names in (("base", base), ("target", target)):
        if not names:
            raise OwaiError(f"class split: the {what} class set is empty")
        if len(set(names)) != len(names):
            raise OwaiError(f"class split: the {what} classes have duplicates")
    both = [c for c in base if c in set(target)]
    if both:
        raise OwaiError(f"class split overlaps: {', '.join(map(repr, both[:10]))}{' ...' if len(both) > 10 else ''} "
                        f"in both the base and the target classes")
    return base, target


# ---------------------------------------------------------------------------------------------- CIFAR


@dataclass(frozen=True)
class CifarLayout:
    """The official python version of one CIFAR set."""

    title: str
    folder: str  # the folder the tarball extracts to
    train: tuple[str, ...]
    test: tuple[str, ...]
    meta: str
    label_key: str
    names_key: str
    n_classes: int
    hub_id: str
    hub_label: str  # the label column of the hub copy

    @property
    def files(self) -> tuple[str, ...]:
        return (self.meta, *self.train, *self.test)


CIFAR = {
    "cifar10": CifarLayout("CIFAR-10", "cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)),
                           ("test_batch",), "batches.meta", "labels", "label_names", 10, "uoft-cs/cifar10", "label"),
    "cifar100": CifarLayout("CIFAR-100", "cifar-100-python", ("train",), ("test",), "meta", "fine_labels",
                            "fine_label_names", 100, "uoft-cs/cifar100", "fine_label"),
}
CIFAR_PIXELS = 3 * 32 * 32
CIFAR_URLS = ("https://www.cs.toronto.edu/~kriz/",)  # the official CIFAR page (Krizhevsky)
# the python versions' tarballs and the md5 published beside them on that page
CIFAR_ARCHIVES = {
    "cifar10": ("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),
    "cifar100": ("cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),
}


def _reconstruct():
    try:
        from numpy._core.multiarray import _reconstruct as fn  # numpy >= 2
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct as fn
    return fn


# The only globals the official pickles reference (a numpy array and its dtype), resolved here: the
# names in a file are looked up in this table, never imported.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct(),  # written by numpy 1.x / Python 2
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct(),  # written by numpy 2.x
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class CifarUnpickler(pickle.Unpickler):
    """An unpickler for the official CIFAR batches: any global other than the numpy array
    reconstruction is refused (one-line `OwaiError`) before anything is called."""

    def __init__(self, file, path: Path | str):
        super().__init__(file, encoding="latin1")  # the files come from Python 2 (str = latin-1 bytes)
        self.path = path

    def find_class(self, module: str, name: str):
        found = _ALLOWED_GLOBALS.get((module, name))
        if found is None:
            raise OwaiError(f"{self.path} is not a CIFAR batch: it references {module}.{name}")
        return found

    def persistent_load(self, pid):
        raise OwaiError(f"{self.path} is not a CIFAR batch: it references a persistent id")


def load_cifar_batch(path: str | Path) -> dict[str, object]:
    """One official CIFAR pickle as a dict with str keys, read by `CifarUnpickler`."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            obj = CifarUnpickler(f, path).load()
    except OwaiError:
        raise
    except OSError as exc:
        raise OwaiError(f"cannot read CIFAR file {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - truncated/corrupt pickles raise many types
        raise OwaiError(f"CIFAR file {path} is corrupt or truncated ({one_line(exc)})") from None
    if not isinstance(obj, dict):
        raise OwaiError(f"CIFAR file {path} holds a {type(obj).__name__}, expected a dict")
    return {(k.decode("latin1") if isinstance(k, bytes) else str(k)): v for k, v in obj.items()}


def _field(batch: dict[str, object], key: str, path: Path) -> object:
    if key not in batch:
        raise OwaiError(f"CIFAR file {path} has no {key!r} entry (keys: {', '.join(sorted(batch))})")
    return batch[key]


def _cifar_part(path: Path, layout: CifarLayout) -> tuple[np.ndarray, np.ndarray]:
    batch = load_cifar_batch(path)
    data = _field(batch, "data", path)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != CIFAR_PIXELS:
        shape = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise OwaiError(f"CIFAR file {path} has data {shape}, expected uint8 N x {CIFAR_PIXELS}")
    raw = _field(batch, layout.label_key, path)
    try:
        labels = np.asarray(raw, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise OwaiError(f"CIFAR file {path}: {layout.label_key} is not a list of integers") from None
    if labels.shape != (data.shape[0],):
        raise OwaiError(f"CIFAR file {path} has {data.shape[0]} images but {labels.size} {layout.label_key}")
    if labels.size and (labels.min() < 0 or labels.max() >= layout.n_classes):
        raise OwaiError(f"CIFAR file {path} has a label outside 0..{layout.n_classes - 1}")
    return data, labels


def _cifar_layout(name: str) -> CifarLayout:
    if name not in CIFAR:
        raise OwaiError(f"unknown CIFAR set {name!r} (known: {', '.join(CIFAR)})")
    return CIFAR[name]


def cifar_folder(folder: str | Path, name: str) -> Path:
    """The folder holding the pickles: `folder/cifar-10-batches-py` (etc.) if present, else `folder`."""
    folder = Path(folder).expanduser()
    inner = folder / _cifar_layout(name).folder
    return inner if inner.is_dir() else folder


def read_cifar(folder: str | Path, name: str = "cifar10", split: str = "train") -> ClassificationData:
    """CIFAR `name` ("cifar10" / "cifar100") `split` ("train" / "test") from the official python
    pickles in `folder` (the extracted folder or one holding it): images uint8 (N, 32, 32, 3)."""
    layout = _cifar_layout(name)
    if split not in ("train", "test"):
        raise OwaiError(f"unknown {layout.title} split {split!r} (known: train, test)")
    base = cifar_folder(folder, name)
    if not base.is_dir():
        raise OwaiError(f"{layout.title} folder {base} does not exist")
    missing = [f for f in layout.files if not (base / f).is_file()]
    if missing:
        raise OwaiError(f"{layout.title} folder {base} lacks {', '.join(missing)} (the official python version, "
                        f"{layout.folder}/)")
    meta_path = base / layout.meta
    names = _field(load_cifar_batch(meta_path), layout.names_key, meta_path)
    if not isinstance(names, (list, tuple)) or len(names) != layout.n_classes:
        raise OwaiError(f"CIFAR file {meta_path}: {layout.names_key} should list {layout.n_classes} class names")
    classes = [n.decode("latin1") if isinstance(n, bytes) else str(n) for n in names]
    parts = [_cifar_part(base / f, layout) for f in (layout.train if split == "train" else layout.test)]
    data = np.concatenate([p[0] for p in parts])
    images = np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))  # rows are R, G, B planes
    labels = np.concatenate([p[1] for p in parts])
    return ClassificationData(torch.from_numpy(images), torch.from_numpy(labels), classes, f"{base} ({split})")


def load_cifar_hub(name: str = "cifar10", split: str = "train", hub_id: str | None = None) -> ClassificationData:
    """CIFAR `name` `split` from the Hugging Face hub (`uoft-cs/cifar10` / `uoft-cs/cifar100`: columns
    img and label / fine_label) through `datasets.load_dataset` (network or a populated HF cache)."""
    layout = _cifar_layout(name)
    hub_id = hub_id or layout.hub_id
    from owai.hub import load_dataset

    ds = load_dataset(hub_id, split=split, what=f"{hub_id!r} split {split!r}")
    features = ds.features
    if "img" not in features or layout.hub_label not in features:
        raise OwaiError(f"{hub_id!r} has columns {', '.join(features)}, expected img and {layout.hub_label}")
    classes = [str(n) for n in features[layout.hub_label].names]
    images = np.stack([np.asarray(im.convert("RGB"), dtype=np.uint8) for im in ds["img"]])
    labels = np.asarray(ds[layout.hub_label], dtype=np.int64)
    if images.shape[1:] != (32, 32, 3) or images.shape[0] != labels.shape[0] or len(classes) != layout.n_classes:
        raise OwaiError(f"{hub_id!r} split {split!r} has images {images.shape}, {labels.shape[0]} labels and "
                        f"{len(classes)} classes; expected N x 32 x 32 x 3 and {layout.n_classes} classes")
    return ClassificationData(torch.from_numpy(images), torch.from_numpy(labels), classes, f"hf:{hub_id} ({split})")


# -------------------------------------------------------------------------------------- image folders


def read_image_folder(folder: str | Path, split: str = "train") -> ClassificationData:
    """`folder/<split>/<class>/<image>` (ImageNet style). Classes are the sorted class folders of
    `folder/train` (of `folder/<split>` when there is no train/), and `split` must have exactly those."""
    folder = Path(folder).expanduser()
    split_dir = folder / split
    if not split_dir.is_dir():
        raise OwaiError(f"image folder {split_dir} does not exist (expected {folder}/{split}/<class>/<image>)")
    reference = folder / "train" if (folder / "train").is_dir() else split_dir
    classes = visible_dirs(reference)
    if not classes:
        raise OwaiError(f"image folder {reference} has no class folders")
    if reference != split_dir:
        found = visible_dirs(split_dir)
        if found != classes:
            missing, extra = sorted(set(classes) - set(found)), sorted(set(found) - set(classes))
            raise OwaiError(f"{split_dir} has different class folders than {reference}: missing {missing[:5]}"
                            f"{' ...' if len(missing) > 5 else ''}, extra {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    paths: list[Path] = []
    labels: list[int] = []
    for k, cls in enumerate(classes):
        files = image_files(split_dir / cls)
        paths += files
        labels += [k] * len(files)
    if not paths:
        raise OwaiError(f"image folder {split_dir} has no images")
    return ClassificationData(paths, torch.tensor(labels, dtype=torch.int64), classes, f"{split_dir}")


def _check_files(paths: list[Path], what: str) -> None:
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise OwaiError(f"{what}: {len(missing)} image file(s) listed but missing, e.g. {missing[0]}")


# ------------------------------------------------------------------------------------------------ CUB

CUB_FILES = ("images.txt", "image_class_labels.txt", "train_test_split.txt", "classes.txt", "images")
CUB_SPLITS = ("all", "train", "test", "base", "val", "novel")
FEWSHOT_RULE = {"base": (2, 0), "val": (4, 1), "novel": (4, 3)}  # split: (modulus, remainder) of the class index


def chen_class_split(classes: Sequence[str]) -> dict[str, list[str]]:
    """Chen et al. 2019's few-shot class split: class i (in the given order) is base when i % 2 == 0,
    val when i % 4 == 1, novel when i % 4 == 3 (CUB: 100 / 50 / 50)."""
    return {split: [c for i, c in enumerate(classes) if i % mod == rem] for split, (mod, rem) in FEWSHOT_RULE.items()}


def _id_table(path: Path) -> dict[int, str]:
    """A CUB `<id> <value>` file as {id: value}."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise OwaiError(f"cannot read CUB file {path}: {exc}") from None
    table: dict[int, str] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.split(maxsplit=1)
        if len(fields) != 2 or not fields[0].isdigit():
            raise OwaiError(f"CUB file {path} line {n}: expected '<id> <value>', got {line[:60]!r}")
        key = int(fields[0])
        if key in table:
            raise OwaiError(f"CUB file {path} line {n}: id {key} appears twice")
        table[key] = fields[1].strip()
    if not table:
        raise OwaiError(f"CUB file {path} is empty")
    return table


def cub_folder(folder: str | Path) -> Path:
    """`folder/CUB_200_2011` if present, else `folder`."""
    folder = Path(folder).expanduser()
    return folder / "CUB_200_2011" if (folder / "CUB_200_2011").is_dir() else folder


def read_cub(folder: str | Path, split: str = "all") -> ClassificationData:
    """CUB-200-2011 `split` (see the module docstring) from its official layout. "all", "train" and
    "test" are labelled over the 200 classes; "base", "val" and "novel" over their own classes (0..k-1)."""
    if split not in CUB_SPLITS:
        raise OwaiError(f"unknown CUB split {split!r} (known: {', '.join(CUB_SPLITS)})")
    base = cub_folder(folder)
    missing = [f for f in CUB_FILES if not (base / f).exists()]
    if missing:
        raise OwaiError(f"CUB-200-2011 folder {base} lacks {', '.join(missing)} (extract CUB_200_2011.tgz there)")
    class_names = _id_table(base / "classes.txt")
    images = _id_table(base / "images.txt")
    image_class = _id_table(base / "image_class_labels.txt")
    is_train = _id_table(base / "train_test_split.txt")
    for name, table in (("image_class_labels.txt", image_class), ("train_test_split.txt", is_train)):
        if set(table) != set(images):
            raise OwaiError(f"CUB file {base / name} lists other image ids than images.txt")
    class_ids = sorted(class_names)
    index = {cid: k for k, cid in enumerate(class_ids)}
    classes = [class_names[cid] for cid in class_ids]
    ids = sorted(images)
    labels, train = [], []
    for i in ids:
        cid, flag = image_class[i], is_train[i]
        if not cid.isdigit() or int(cid) not in index:
            raise OwaiError(f"CUB file {base / 'image_class_labels.txt'}: image {i} has class {cid!r}, not in classes.txt")
        if flag not in ("0", "1"):
            raise OwaiError(f"CUB file {base / 'train_test_split.txt'}: image {i} has flag {flag!r}, expected 0 or 1")
        labels.append(index[int(cid)])
        train.append(flag == "1")
    paths = [base / "images" / images[i] for i in ids]
    _check_files(paths, f"CUB-200-2011 folder {base}")
    data = ClassificationData(paths, torch.tensor(labels, dtype=torch.int64), classes, f"{base} ({split})")
    if split in ("train", "test"):
        mask = torch.tensor(train) if split == "train" else ~torch.tensor(train)
        return _subset(data, torch.nonzero(mask).flatten())
    if split in FEWSHOT_RULE:
        return select_classes(data, chen_class_split(classes)[split])
    return data


# ---------------------------------------------------------------------------------------- miniImageNet

MINI_SPLITS = {"train": "train", "val": "val", "test": "test", "base": "train", "novel": "test"}


def read_miniimagenet(folder: str | Path, split: str = "train") -> ClassificationData:
    """miniImageNet `split` (train / val / test; Chen et al.'s base / val / novel) from Ravi & Larochelle's
    `<split>.csv` (header filename,label) and `images/<filename>`; classes: the split's sorted labels."""
    if split not in MINI_SPLITS:
        raise OwaiError(f"unknown miniImageNet split {split!r} (known: {', '.join(MINI_SPLITS)})")
    folder = Path(folder).expanduser()
    csv_path, images_dir = folder / f"{MINI_SPLITS[split]}.csv", folder / "images"
    missing = [p.name for p in (csv_path, images_dir) if not p.exists()]
    if missing:
        raise OwaiError(f"miniImageNet folder {folder} lacks {', '.join(missing)} (Ravi & Larochelle's layout: images/, "
                        f"train.csv, val.csv, test.csv)")
    try:
        with open(csv_path, newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise OwaiError(f"cannot read miniImageNet file {csv_path}: {exc}") from None
    if not rows or [c.strip() for c in rows[0]] != ["filename", "label"]:
        raise OwaiError(f"miniImageNet file {csv_path} must start with the header 'filename,label'")
    files, names = [], []
    for n, row in enumerate(rows[1:], 2):
        if not row:
            continue
        if len(row) != 2 or not row[0].strip() or not row[1].strip():
            raise OwaiError(f"miniImageNet file {csv_path} line {n}: expected 'filename,label', got {','.join(row)[:60]!r}")
        files.append(row[0].strip())
        names.append(row[1].strip())
    if not files:
        raise OwaiError(f"miniImageNet file {csv_path} lists no images")
    if len(set(files)) != len(files):
        raise OwaiError(f"miniImageNet file {csv_path} lists an image twice")
    classes = sorted(set(names))
    index = {c: k for k, c in enumerate(classes)}
    paths = [images_dir / f for f in files]
    _check_files(paths, f"miniImageNet {csv_path}")
    return ClassificationData(paths, torch.tensor([index[c] for c in names], dtype=torch.int64), classes,
                              f"{csv_path}")


# ------------------------------------------------------------------------------------------- iNat 2018

INAT_SPLITS = ("train", "val")


def read_inat18(folder: str | Path, split: str = "train") -> ClassificationData:
    """iNaturalist 2018 `split` (train / val) from `<split>2018.json` (COCO style): one annotation per
    image; classes: the file's categories (sorted by id, named by their name), else categories.json."""
    if split not in INAT_SPLITS:
        raise OwaiError(f"unknown iNat18 split {split!r} (known: {', '.join(INAT_SPLITS)})")
    folder = Path(folder).expanduser()
    path = folder / f"{split}2018.json"
    meta = _read_json(path)
    images, annotations = meta.get("images"), meta.get("annotations")
    if not isinstance(images, list) or not isinstance(annotations, list) or not images:
        raise OwaiError(f"iNat18 file {path} needs non-empty 'images' and 'annotations' lists")
    categories = meta.get("categories")
    if not categories:
        if not (folder / "categories.json").is_file():
            raise OwaiError(f"iNat18 file {path} has no 'categories' and {folder / 'categories.json'} is missing")
        categories = _read_json(folder / "categories.json")
    try:
        named = {int(c["id"]): str(c.get("name", c["id"])) for c in categories}
        category = {int(a["image_id"]): int(a["category_id"]) for a in annotations}
        files = [(int(im["id"]), str(im["file_name"])) for im in images]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise OwaiError(f"iNat18 file {path} is not in the COCO format of the official release ({type(exc).__name__}: {exc})") from None
    if len(category) != len(annotations):
        raise OwaiError(f"iNat18 file {path}: an image has more than one annotation")
    ids = sorted(named)
    index = {cid: k for k, cid in enumerate(ids)}
    labels = []
    for image_id, name in files:
        if image_id not in category:
            raise OwaiError(f"iNat18 file {path}: image {image_id} ({name}) has no annotation")
        if category[image_id] not in index:
            raise OwaiError(f"iNat18 file {path}: image {image_id} has unknown category {category[image_id]}")
        labels.append(index[category[image_id]])
    top = folder / Path(files[0][1]).parts[0]
    if not top.exists():
        raise OwaiError(f"iNat18 images folder {top} is missing (extract train_val2018.tar.gz into {folder})")
    names = [named[cid] for cid in ids]
    if len(set(names)) != len(names):
        names = [str(cid) for cid in ids]
    return ClassificationData([folder / name for _, name in files], torch.tensor(labels, dtype=torch.int64), names,
                              f"{path}")


def _read_json(path: Path):
    if not path.is_file():
        raise OwaiError(f"iNat18 file {path} is missing")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise OwaiError(f"iNat18 file {path} is unreadable ({exc})") from None


# --------------------------------------------------------------------------------------------- digits


def load_digits() -> ClassificationData:
    """scikit-learn's bundled 8x8 digits (1 797 images, classes "0".."9"): pixel values 0..16 scaled to
    uint8 0..255 (round(v * 255 / 16)), images (N, 8, 8)."""
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    images = np.round(np.asarray(bunch.images, dtype=np.float64) * (255.0 / 16.0)).astype(np.uint8)
    return ClassificationData(torch.from_numpy(images), torch.from_numpy(np.asarray(bunch.target, dtype=np.int64)),
                              [str(n) for n in bunch.target_names], "sklearn.datasets.load_digits")


# ------------------------------------------------------------------------------------------ catalogue

GATED = "licence-gated, owai cannot download it"
IMAGENET_STEP = (f"ImageNet (ILSVRC2012) is {GATED}: accept the terms at https://image-net.org/download.php, "
                 "extract ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar as train/<wnid>/*.JPEG and val/<wnid>/*.JPEG "
                 "(validation images sorted into class folders) under $OWAI_DATA/imagenet/, or pass --data-root")
INAT18_STEP = (f"iNaturalist 2018 is {GATED}: download train_val2018.tar.gz, train2018.json.tar.gz and val2018.json.tar.gz "
               "(https://github.com/visipedia/inat_comp/tree/master/2018, under its terms) and extract them into "
               "$OWAI_DATA/inat18/ (train_val2018/, train2018.json, val2018.json), or pass --data-root")
CUB_STEP = (f"CUB-200-2011 is {GATED} (non-commercial research use): download CUB_200_2011.tgz from "
            "https://www.vision.caltech.edu/datasets/cub_200_2011/ (https://data.caltech.edu/records/65de6-vp158) and "
            "extract it into $OWAI_DATA/cub/ (CUB_200_2011/images.txt, classes.txt, ...), or pass --data-root")
MINI_STEP = ("miniImageNet is built from ImageNet, which is licence-gated: put its 60 000 images, at ImageNet's own resolution "
             "(as Chen et al.'s file lists read them; not the 84 x 84 copies), in $OWAI_DATA/miniimagenet/images/ "
             "and Ravi & Larochelle's train.csv, val.csv, test.csv (https://github.com/twitter/meta-learning-lstm, "
             "data/miniImagenet) beside them, or pass --data-root")


def _cifar_entry(name: str, size: str) -> registry.Dataset:
    """A CIFAR set: the official tarball (published md5), checked by reading every pickle."""
    layout = CIFAR[name]
    archive, md5 = CIFAR_ARCHIVES[name]

    def check(folder: Path) -> str:
        sizes = [len(read_cifar(folder, name, split)) for split in ("train", "test")]
        return f"{cifar_folder(folder, name).name}: {sizes[0]} train + {sizes[1]} test images, shapes and labels ok"

    return registry.Dataset(name, f"{layout.title} (python version)", name, size,
                            tuple(f"{layout.folder}/{f}|{f}" for f in layout.files), urls=CIFAR_URLS, archive=archive,
                            archive_md5=md5, hf_id=layout.hub_id,
                            note="the official python pickles, read without executing code", check=check)


@registry.register
def catalogue_entries() -> list[registry.Dataset]:
    """The classification sets in the data catalogue: CIFAR (downloadable) and the licence-gated ones."""
    return [
        _cifar_entry("cifar10", "170 MB"),
        _cifar_entry("cifar100", "169 MB"),
        registry.Dataset("imagenet", "ImageNet ILSVRC2012 (1.28M train + 50k val, class folders)", "imagenet", "~150 GB",
                         ("train", "val"), manual=IMAGENET_STEP, aliases=("ilsvrc2012", "imagenet1k")),
        registry.Dataset("inat18", "iNaturalist 2018 (437k train + 24k val, 8 142 classes)", "inat18", "~120 GB",
                         ("train2018.json", "val2018.json"), manual=INAT18_STEP, aliases=("inaturalist2018", "inat2018")),
        registry.Dataset("cub", "CUB-200-2011 (11 788 images, 200 bird classes)", "cub", "1.1 GB",
                         tuple(f"CUB_200_2011/{f}|{f}" for f in CUB_FILES), manual=CUB_STEP,
                         aliases=("cub200", "cub_200_2011")),
        registry.Dataset("miniimagenet", "miniImageNet (Ravi & Larochelle split: 64 / 16 / 20 classes x 600 images)",
                         "miniimagenet", "~3 GB", ("images", "train.csv", "val.csv", "test.csv"), manual=MINI_STEP,
                         aliases=("mini_imagenet",),
                         note="the few-shot protocol of Chen et al. 2019: base = train.csv, val = val.csv, novel = test.csv"),
        # the in-context classification sets of `owai eval icl` (owai.evals.longicl; the sha256 are of
        # owai's reference copies: the official rows in the official order)
        registry.Dataset("banking77", "BANKING77 (13,083 banking queries, 77 intents; in-context classification)",
                         "icl/banking77", "1.1 MB", tuple(BANKING77_SHA256), sha256=BANKING77_SHA256,
                         hf_id="PolyAI/banking77", ids=("legacy-datasets/banking77",),
                         manual="copy train.csv, test.csv and categories.json of banking_data/ in "
                                "github.com/PolyAI-LDN/task-specific-datasets to $OWAI_DATA/icl/banking77 (or `owai eval "
                                "icl --set data=hf` reads the hub id)"),
        registry.Dataset("goemotions", "GoEmotions (54,263 Reddit comments, 28 emotions; in-context classification)",
                         "icl/goemotions", "4.4 MB", tuple(GOEMOTIONS_SHA256), sha256=GOEMOTIONS_SHA256,
                         hf_id="google-research-datasets/go_emotions", aliases=("goemotion",), ids=("go_emotions",),
                         manual="copy train.tsv, dev.tsv and test.tsv of github.com/google-research/google-research "
                                "goemotions/data, and its emotions.txt as labels.txt, to $OWAI_DATA/icl/goemotions (or "
                                "`owai eval icl --set data=hf` reads the hub id)"),
        registry.Dataset("tacred", "TACRED as LongICLBench processed it (41 relations)", "icl/tacred", "~10 MB",
                         ("train_tacred.json", "test_tacred.json"),
                         manual="TACRED is licence-gated (LDC2018T24): put LongICLBench's processed train_tacred.json and "
                                "test_tacred.json in $OWAI_DATA/icl/tacred"),
    ]


BANKING77_SHA256 = {"train.csv": "b06e26ac675513959a63135f11b94ea7786ed02da65db93a5650d8838cbc664b",
                    "test.csv": "d12d6e3bc4c3103966ae786dc435913c0c563dfa328f5a3646d0e62cfeeb474d",
                    "categories.json": "53261da888122daf2d120d925458631d9619e15d82e56052e7a42e535ce32b63"}
GOEMOTIONS_SHA256 = {"train.tsv": "1c254a142be5c00e80d819b9ae1bbd36d94b2eeb8f4b1271846508d57e57d9c5",
                     "dev.tsv": "575489c079c9de1097062a01738f998590d6b7ead66dd1c9fd1d2ba01fd8bc62",
                     "test.tsv": "0587b2dd8b27b97352adbfc3fb083d46005c8946657fdc2b1ca8b1cc7f1f8be4",
                     "labels.txt": "45c3ef86782d2a4d7fedcd6d8c111aa0d0e94720689bd164fac94fefb4495a89"}


# ----------------------------------------------------------------------------------------------- load

READERS = {"imagenet": read_image_folder, "cub": read_cub, "miniimagenet": read_miniimagenet, "inat18": read_inat18}


def load(name: str, split: str = "train", root: str | Path | None = None, hub_id: str | None = None) -> ClassificationData:
    """Dataset `name` (a registry name or alias, or "digits") `split`, found by the data-root rule
    (`root` = an explicit data root or the dataset's own folder). CIFAR with `hub_id` and no `root`:
    a local copy if one is found, else the hub."""
    if name == "digits":
        return load_digits()
    name = registry.dataset(name).name
    if name in CIFAR:
        if root is None and hub_id:
            local = registry.locate(name)
            return read_cifar(local, name, split) if local is not None else load_cifar_hub(name, split, hub_id)
        return read_cifar(registry.require(name, root), name, split)
    if name not in READERS:
        raise OwaiError(f"{name} is not a classification dataset (known: {', '.join([*CIFAR, *READERS, 'digits'])})")
    return READERS[name](registry.require(name, root), split)
