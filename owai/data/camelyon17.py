"""Camelyon17-WILDS (v1.0) read from its on-disk layout, with step-keyed training batches.

The `wilds` package needs torchvision (which does not import with the CPU torch), so this module
reads the release directly. Layout (WILDS `camelyon17_dataset.py`):

    <root>/camelyon17_v1.0/metadata.csv      (or <root>/metadata.csv when root is that folder)
    <root>/camelyon17_v1.0/patches/patient_<PPP>_node_<N>/patch_patient_<PPP>_node_<N>_x_<X>_y_<Y>.png

`metadata.csv` has an unnamed index column and the columns patient (zero-padded, read as text),
node, x_coord, y_coord, tumor (the label: tumour in the central 32x32 region), slide, center and
split. WILDS's official split scheme: centre 1 is the OOD validation set `val`, centre 2 the test
set `test`, and the other centres (0, 3, 4) are `train` where split == 0 and `id_val` (held-out
patches of the training hospitals) where split == 1.

Transform: the patches are 96x96 RGB; WILDS's `image_base` = (resize, identity at 96) ToTensor and
ImageNet normalisation, no augmentation (`owai.data.images.eval_transform`).

Training batches are a function of (seed, stage, step), never of a running RNG stream, so a resumed
stage replays exactly the batches of an uninterrupted one:

* `StandardSampler`: WILDS's standard loader, one keyed permutation per epoch, `batch_size` per step;
* `GroupSampler`: WILDS's group loader (`n_groups_per_batch` distinct groups drawn uniformly among the
  groups present, `batch_size / n_groups_per_batch` examples of each, without replacement inside the
  batch unless the group is smaller);
* `UniformGroupSampler`: WILDS's `uniform_over_groups` standard loader (GroupDRO): every example of a
  batch independently draws a group uniformly, then an example of that group (with replacement).

Samplers return indices only, so the same batches can index images (`ImageBatches`, through a
DataLoader with a private generator) or cached features.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from owai.data.images import EvalPasses, Strings, ending_workers, eval_transform, stack
from owai.data.registry import Dataset as CatalogueEntry
from owai.data.registry import register, require
from owai.errors import OwaiError, not_utf8, one_line
from owai.runtime import generator

VERSION_DIR = "camelyon17_v1.0"
# WILDS 2.0's CodaLab bundle of camelyon17 v1.0 (a 10.66 GB archive.tar.gz holding camelyon17_v1.0/)
DOWNLOAD_URL = "https://worksheets.codalab.org/rest/bundles/0xe45e15f39fb54e9d9e919556af67aabe/contents/blob/"
COLUMNS = ("patient", "node", "x_coord", "y_coord", "tumor", "slide", "center", "split")
SPLITS = ("train", "id_val", "val", "test")
VAL_CENTER, TEST_CENTER = 1, 2
TRAIN_CENTERS = (0, 3, 4)


def data_dir(root: str | Path) -> Path:
    """The folder holding metadata.csv: <root>/camelyon17_v1.0, or root itself."""
    root = Path(root).expanduser()
    for candidate in (root / VERSION_DIR, root):
        if (candidate / "metadata.csv").is_file():
            return candidate
    raise OwaiError(f"Camelyon root {root} has no metadata.csv (expected {root / VERSION_DIR / 'metadata.csv'}; "
                    f"run `owai data fetch camelyon17`, or download {DOWNLOAD_URL})")


def find_root(root: str | Path | None = None) -> Path:
    """The Camelyon17 folder by the data-root rule (`owai.data.registry`): the explicit `root` (a
    folder holding camelyon17/ or camelyon17_v1.0/, or that folder), else $OWAI_DATA/camelyon17, else
    <cache>/data/camelyon17; missing is one line naming `owai data fetch camelyon17`."""
    return data_dir(require("camelyon17", root or None))


BY_HAND = "download it by hand and extract it into the data root's camelyon17/ folder"


def download(root: str | Path) -> Path:
    """Download and extract the WILDS camelyon17 v1.0 archive into `root` (user machines with a
    network). WILDS publishes no checksum; the archive must hold only plain files and folders
    inside `root` (each member is checked before it is written, in one streaming pass)."""
    import tarfile
    import urllib.error

    from owai.io import download

    root = Path(root).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    archive = root / "camelyon17_v1.0.tar.gz"
    try:
        download(DOWNLOAD_URL, archive)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise OwaiError(f"cannot download Camelyon17 from {DOWNLOAD_URL} ({getattr(e, 'reason', None) or e}); {BY_HAND}") from None
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                parts = Path(member.name).parts
                if not (member.isfile() or member.isdir()) or Path(member.name).is_absolute() or ".." in parts:
                    raise OwaiError(f"{DOWNLOAD_URL}: member {member.name!r} is not a plain file or folder inside the "
                                    "archive; refused")
                tar.extract(member, root, filter="data")
    except (tarfile.TarError, EOFError, OSError) as e:
        raise OwaiError(f"{DOWNLOAD_URL} is not a readable tar.gz archive ({one_line(e, None)}); {BY_HAND}") from None
    archive.unlink()
    return data_dir(root)


def _check(folder: Path) -> str:
    """`owai data verify camelyon17`: WILDS publishes no checksum, so read metadata.csv and every split."""
    return f"metadata.csv: {len(Camelyon17(data_dir(folder)))} patches, every split present"


@register
def catalogue_entries() -> list[CatalogueEntry]:
    """Camelyon17-WILDS in the data catalogue: downloaded from CodaLab, checked by reading it."""
    return [CatalogueEntry("camelyon17", "Camelyon17-WILDS v1.0 (455 954 patches)", "camelyon17", "10.7 GB",
                           (f"{VERSION_DIR}/metadata.csv|metadata.csv",), urls=(DOWNLOAD_URL,),
                           note="the WILDS release from CodaLab; also `wilds.get_dataset('camelyon17', root_dir=DIR, download=True)`",
                           check=_check, download=download)]


def _int(value: str, line: int, column: str, path: Path) -> int:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        raise OwaiError(f"{path} line {line}: column {column!r} is not an integer ({value!r})") from None


class Camelyon17:
    """The metadata and patches of one Camelyon17-WILDS release; example i is row i of metadata.csv.

    `fraction` < 1 keeps the first `fraction` of a permutation of every split, keyed by
    `fraction_seed` (WILDS's `--frac`, which uses numpy's global RNG). Every patch of a kept split
    must exist (checked at load by listing the patch folders), so a missing file is reported before
    training starts. `cache_images` keeps decoded patches in memory (small subsets only)."""

    def __init__(self, root: str | Path, fraction: float = 1.0, fraction_seed: int = 0, image_size: int = 96,
                 cache_images: bool = False) -> None:
        if not 0 < fraction <= 1:
            raise OwaiError(f"Camelyon17 fraction must be in (0, 1], got {fraction}")
        self.dir = data_dir(root)
        self.image_size, self.cache_images = image_size, cache_images
        self._cache: dict[int, np.ndarray] = {}
        path = self.dir / "metadata.csv"
        try:
            with open(path, newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
                if missing:
                    raise OwaiError(f"{path} lacks column(s) {', '.join(missing)} (has {', '.join(reader.fieldnames or [])})")
                files, ints = self._read_rows(reader, path)
        except UnicodeDecodeError as e:
            raise not_utf8(path, e) from None
        self.files = Strings(files)  # 455k paths: no Python object each (DataLoader workers would copy them)
        self.labels = torch.tensor(ints["tumor"], dtype=torch.int64)  # (n,)
        self.slides = torch.tensor(ints["slide"], dtype=torch.int64)
        self.centers = torch.tensor(ints["center"], dtype=torch.int64)
        raw_split = torch.tensor(ints["split"], dtype=torch.int64)
        if self.labels.numel() and not bool(((self.labels == 0) | (self.labels == 1)).all()):
            raise OwaiError(f"{path}: column 'tumor' must be 0 or 1")
        if self.centers.numel() and not bool(((self.centers >= 0) & (self.centers <= 4)).all()):
            raise OwaiError(f"{path}: column 'center' must be a hospital 0-4")  # the five hospitals of WILDS
        if raw_split.numel() and not bool(((raw_split == 0) | (raw_split == 1)).all()):
            raise OwaiError(f"{path}: column 'split' must be 0 (train) or 1 (in-distribution validation)")
        self._splits: dict[str, torch.Tensor] = {}
        in_train_centers = (self.centers != VAL_CENTER) & (self.centers != TEST_CENTER)
        masks = {"train": in_train_centers & (raw_split == 0), "id_val": in_train_centers & (raw_split == 1),
                 "val": self.centers == VAL_CENTER, "test": self.centers == TEST_CENTER}
        for name, mask in masks.items():
            idx = mask.nonzero().reshape(-1)
            if fraction < 1:
                # WILDS's count, int(np.round(n * frac)) (round half to even, as Python's round), at least 1
                keep = max(1, round(idx.numel() * fraction)) if idx.numel() else 0
                idx = idx[torch.randperm(idx.numel(), generator=generator(fraction_seed, "camelyon17-frac", name))[:keep]]
                idx = idx.sort().values
            if idx.numel() == 0:
                raise OwaiError(f"Camelyon17 split {name!r} is empty in {path} "
                                f"({'centre ' + str(VAL_CENTER if name == 'val' else TEST_CENTER) if name in ('val', 'test') else 'centres 0, 3, 4 with split ' + ('0' if name == 'train' else '1')})")
            self._splits[name] = idx
        self._check_files(files)

    @staticmethod
    def _read_rows(reader: csv.DictReader, path: Path) -> tuple[list[str], dict[str, list[int]]]:
        """(patch paths, the integer columns) of metadata.csv's rows, read one row at a time (a list of
        every row's dict first held about 400 MB at once for the 455k patches)."""
        files: list[str] = []
        ints: dict[str, list[int]] = {c: [] for c in ("tumor", "slide", "center", "split")}
        for line, row in enumerate(reader, start=2):
            if None in row.values() or None in row:  # csv.DictReader fills a short row with None, keys a long one's rest None
                fields = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None) or [])
                raise OwaiError(f"{path} line {line}: {fields} fields, the header has {len(reader.fieldnames or [])}")
            patient, node = row["patient"].strip(), _int(row["node"], line, "node", path)
            x, y = _int(row["x_coord"], line, "x_coord", path), _int(row["y_coord"], line, "y_coord", path)
            folder = f"patient_{patient}_node_{node}"
            files.append(f"{folder}/patch_{folder}_x_{x}_y_{y}.png")
            for c in ints:
                ints[c].append(_int(row[c], line, c, path))
        return files, ints

    def _check_files(self, files: list[str]) -> None:
        """Every patch (`files`: self.files as a list) of the kept splits exists (one directory listing
        per patient/node folder)."""
        listing: dict[str, set[str]] = {}
        for name in SPLITS:
            for i in self._splits[name].tolist():
                folder, file = files[i].split("/")
                if folder not in listing:
                    try:
                        listing[folder] = set(os.listdir(self.dir / "patches" / folder))
                    except OSError:
                        listing[folder] = set()
                if file not in listing[folder]:
                    raise OwaiError(f"Camelyon17 patch {self.dir / 'patches' / files[i]} is missing "
                                    f"(metadata.csv row {i}, split {name})")

    def __len__(self) -> int:
        return len(self.files)

    def split(self, name: str) -> torch.Tensor:
        """Example indices (int64, sorted) of split `name` in `SPLITS`."""
        if name not in self._splits:
            raise OwaiError(f"unknown Camelyon17 split {name!r} (known: {', '.join(SPLITS)})")
        return self._splits[name]

    def path(self, index: int) -> Path:
        return self.dir / "patches" / self.files[index]

    def image(self, index: int) -> Image.Image:
        path = self.path(index)
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except FileNotFoundError:
            raise OwaiError(f"Camelyon17 patch {path} is missing") from None
        except Exception as exc:  # noqa: BLE001 - any decode failure of a user's file
            raise OwaiError(f"cannot decode Camelyon17 patch {path}: {exc}") from None

    def tensor(self, index: int) -> torch.Tensor:
        """Example `index` as float32 (3, image_size, image_size), ImageNet-normalised."""
        if not self.cache_images:
            return eval_transform(self.image(index), self.image_size)
        if index not in self._cache:
            self._cache[index] = eval_transform(self.image(index), self.image_size).numpy()
        return torch.from_numpy(self._cache[index])

    def batch(self, indices: torch.Tensor) -> torch.Tensor:
        """float32 (len(indices), 3, S, S)."""
        return stack([self.tensor(int(i)) for i in indices.tolist()])


# ------------------------------------------------------------------------------------------ samplers

class StandardSampler:
    """WILDS's standard (shuffling) loader: epoch e is a permutation of the `n` positions keyed by
    (seed, stage, e); step t reads its `batch_size` positions t mod steps_per_epoch. Positions index
    the caller's example list."""

    def __init__(self, n: int, batch_size: int, seed: int, stage: str) -> None:
        if n < 1 or batch_size < 1:
            raise OwaiError(f"StandardSampler needs n >= 1 and batch_size >= 1 (got {n}, {batch_size})")
        self.n, self.batch_size, self.seed, self.stage = n, batch_size, seed, stage
        self.steps_per_epoch = max(1, n // batch_size)
        self._epoch, self._perm = -1, torch.zeros(0, dtype=torch.int64)  # the last epoch's permutation

    def positions(self, step: int) -> torch.Tensor:
        epoch, b = divmod(int(step), self.steps_per_epoch)
        if epoch != self._epoch:  # drawn once per epoch, not per step (302k patches: 6 ms a step)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=generator(self.seed, self.stage, "epoch", epoch))
        perm = self._perm
        if self.n < self.batch_size:  # fewer examples than a batch: the whole permutation
            return perm.clone()
        return perm[b * self.batch_size : (b + 1) * self.batch_size].clone()  # not a view of the kept permutation


class GroupSampler:
    """WILDS's group loader: `n_groups_per_batch` distinct groups drawn uniformly among those present
    in `groups` (int64 (n,)), then `batch_size // n_groups_per_batch` positions of each, without
    replacement unless the group is smaller; keyed by (seed, stage, step). Returns positions grouped
    by group, group by group."""

    def __init__(self, groups: torch.Tensor, batch_size: int, n_groups_per_batch: int, seed: int, stage: str,
                 steps_per_epoch: int | None = None) -> None:
        groups = torch.as_tensor(groups, dtype=torch.int64)
        self.present = groups.unique()
        if groups.numel() == 0:
            raise OwaiError("GroupSampler: no examples")
        if not 1 <= n_groups_per_batch <= self.present.numel():
            raise OwaiError(f"GroupSampler: n_groups_per_batch {n_groups_per_batch} but {self.present.numel()} group(s) "
                            f"present ({', '.join(map(str, self.present.tolist()))})")
        if batch_size % n_groups_per_batch:
            raise OwaiError(f"batch size {batch_size} is not a multiple of n_groups_per_batch {n_groups_per_batch}")
        self.members = [(groups == g).nonzero().reshape(-1) for g in self.present.tolist()]
        self.groups, self.n_groups, self.per_group = groups, n_groups_per_batch, batch_size // n_groups_per_batch
        self.seed, self.stage = seed, stage
        self.steps_per_epoch = steps_per_epoch or max(1, groups.numel() // batch_size)

    def positions(self, step: int) -> torch.Tensor:
        gen = generator(self.seed, self.stage, "groups", int(step))
        chosen = torch.randperm(len(self.members), generator=gen)[: self.n_groups]
        parts = []
        for g in chosen.tolist():
            members = self.members[g]
            if members.numel() <= self.per_group:
                parts.append(members[torch.randint(members.numel(), (self.per_group,), generator=gen)])
            else:
                parts.append(members[torch.randperm(members.numel(), generator=gen)[: self.per_group]])
        return torch.cat(parts)


class UniformGroupSampler:
    """WILDS's `uniform_over_groups` standard loader (GroupDRO): each of the `batch_size` draws picks
    a group uniformly among those present, then a member uniformly (with replacement); keyed by
    (seed, stage, step). `steps_per_epoch` defaults to n // batch_size."""

    def __init__(self, groups: torch.Tensor, batch_size: int, seed: int, stage: str,
                 steps_per_epoch: int | None = None) -> None:
        groups = torch.as_tensor(groups, dtype=torch.int64)
        if groups.numel() == 0:
            raise OwaiError("UniformGroupSampler: no examples")
        self.present = groups.unique()
        self.members = [(groups == g).nonzero().reshape(-1) for g in self.present.tolist()]
        self.batch_size, self.seed, self.stage = batch_size, seed, stage
        self.steps_per_epoch = steps_per_epoch or max(1, groups.numel() // batch_size)

    def positions(self, step: int) -> torch.Tensor:
        gen = generator(self.seed, self.stage, "uniform-groups", int(step))
        which = torch.randint(len(self.members), (self.batch_size,), generator=gen)
        return torch.stack([self.members[g][torch.randint(self.members[g].numel(), (1,), generator=gen)[0]]
                            for g in which.tolist()])


class ImageBatches(Dataset):
    """Item `step` = (x float32 (B, 3, S, S), positions int64 (B,)) of the sampler's step; the
    positions index `examples` (dataset indices). A function of the step (resume-exact)."""

    def __init__(self, data: Camelyon17, examples: torch.Tensor, sampler: object, steps: int) -> None:
        self.data, self.examples, self.sampler, self.steps = data, examples, sampler, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        positions = self.sampler.positions(int(step))  # type: ignore[attr-defined]
        return self.data.batch(self.examples[positions]), positions, torch.zeros(0)


class _Examples(Dataset):
    """Example i of the release, any split (the evaluation passes pick the indices)."""

    def __init__(self, data: Camelyon17) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data.tensor(int(index))


def eval_passes(data: Camelyon17, batch_size: int, workers: int = 0) -> EvalPasses:
    """The run's evaluation passes: `passes(indices)` gives x batches (float32 (<=batch_size, 3, S, S))
    of `indices`, in order, every pass through the same `workers` processes."""
    return EvalPasses(_Examples(data), batch_size, workers, stack)


def eval_batches(data: Camelyon17, indices: torch.Tensor, batch_size: int, workers: int = 0) -> Iterator[torch.Tensor]:
    """x batches (float32 (<=batch_size, 3, S, S)) of `indices`, in order: one pass, its workers ended after it."""
    return ending_workers(eval_passes(data, batch_size, workers)(indices))


# ------------------------------------------------------------------------------------------- metrics

@dataclass
class Metrics:
    acc: float  # WILDS acc_avg
    acc_wg: float  # worst accuracy over the slides present


def evaluate(pred: torch.Tensor, labels: torch.Tensor, slides: torch.Tensor) -> Metrics:
    """acc_avg and the worst-slide accuracy (WILDS's Camelyon17 eval groups by slide)."""
    correct = (pred.reshape(-1) == labels.reshape(-1)).float()
    per_slide = [float(correct[slides == s].mean()) for s in slides.unique().tolist()]
    return Metrics(float(correct.mean()) if correct.numel() else float("nan"), min(per_slide) if per_slide else float("nan"))
