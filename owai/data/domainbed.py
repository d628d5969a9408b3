"""Multi-domain image datasets, splits, transforms and step-keyed batches (DomainBed protocol).

The data layer of "very-large dropout fine-tuning": DomainBed's image-folder datasets (PACS, VLCS,
OfficeHome, TerraIncognita) and its RotatedMNIST, the in/out split of every domain
(`misc.split_dataset`), its training and evaluation transforms, and minibatches that hold the same
number of examples from every training domain. torchvision is not a dependency: the transforms are
written with PIL, NumPy and torch and follow torchvision's algorithms (noted per function).

Layout: `<root>/<domain>/<class>/<image>`, DomainBed's `MultipleEnvironmentImageFolder`. Domains are
the sorted sub-directories of `root` (or a given list), classes the sorted sub-directories of a domain
and must be the same in every domain; class `k` is the k-th sorted class name. Images are the files
below a class folder (recursively) whose extension is in `IMAGE_EXTENSIONS` (case-insensitive; the
folder helpers of `owai.data.images`), in sorted path order, so example indices are deterministic.
Hidden entries (names starting with ".") are ignored at every level.

Corrupt-image rule: at indexing every image file is opened with PIL and `verify()`ed (a JPEG must
also end with its end-of-image marker, which catches truncated files); a file that fails is
unreadable. `open_image_dataset` (what runs use) makes any unreadable file an error naming it, unless
`skip_unreadable`; then, as `ImageFolderDomains` does by default, it is skipped and counted in
`skipped` (the caller reports the count). A domain left without images is an error. `verify()` checks headers (and PNG checksums) without decoding, so a
file can pass indexing and still fail to decode: `image()` then raises `OwaiError` naming the file
rather than silently substituting another example.

Randomness is keyed, never streamed: the in/out split of domain `d` is DomainBed's own
(`misc.split_dataset` seeded by `misc.seed_hash(trial_seed, d)`), so the held-out images are the
official code's; everything else is keyed through `owai.runtime.generator`: the examples of training step `t` from domain `d` by
`(seed, "batch", t, d)` and the augmentation of its j-th example by `(seed, "augment", t, d, j)`.
A batch is therefore a function of the step: a resumed run, or one with any number of loader
workers, sees exactly the batches of an uninterrupted single-process run.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageEnhance
from torch.utils.data import Dataset

from owai.data import registry
from owai.data.images import (
    BICUBIC, BILINEAR, Strings, check_style, ending_workers, eval_transform, image_files, loader, stack, to_tensor,
    visible_dirs,
)
from owai.errors import DataMissing, OwaiError
from owai.runtime import generator

DOMAINBED = {  # DomainBed's domain folder names per dataset, sorted as DomainBed sorts them
    "pacs": ("art_painting", "cartoon", "photo", "sketch"),
    "vlcs": ("Caltech101", "LabelMe", "SUN09", "VOC2007"),
    "office_home": ("Art", "Clipart", "Product", "Real World"),
    "terra_incognita": ("location_100", "location_38", "location_43", "location_46"),
}
DATASET_DIRS = {"pacs": "PACS", "vlcs": "VLCS", "office_home": "office_home", "terra_incognita": "terra_incognita"}
DOMAINBED_STEP = ("download it with DomainBed (`python -m domainbed.scripts.download --data_dir DIR`) and pass "
                  "--data-root DIR, or put it under $OWAI_DATA/domainbed/")


@registry.register
def catalogue_entries() -> list[registry.Dataset]:
    """The DomainBed image sets in the data catalogue: a manual download, checked by their domain folders."""
    sets = (("pacs", "0.2 GB", ()), ("vlcs", "1.1 GB", ()), ("office_home", "1.2 GB", ("officehome",)),
            ("terra_incognita", "6.0 GB", ("terraincognita",)))
    return [registry.Dataset(name, f"DomainBed {DATASET_DIRS[name]}", f"domainbed/{DATASET_DIRS[name]}", size,
                             tuple(DOMAINBED[name]), manual=f"{DATASET_DIRS[name]}: {DOMAINBED_STEP}", aliases=aliases)
            for name, size, aliases in sets]

CROP_SCALE = (0.7, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
CIFAR_CROP_SCALE = (0.8, 1.0)  # TH A.1
IMAGENET_CROP_SCALE = (0.08, 1.0)  # torchvision's default: He et al. 2016's, and Chen et al. 2019's RandomSizedCrop
JITTER = 0.3  # brightness, contrast, saturation and hue of DomainBed's ColorJitter
FEWSHOT_JITTER = 0.4  # brightness, contrast and colour of Chen et al. 2019's ImageJitter
GRAYSCALE_P = 0.1
FLIP_P = 0.5


class MultiDomainDataset:
    """Images grouped by domain: domain `d` holds `size(d)` examples with `labels(d)` (int64) over
    the shared, sorted `classes`; `image(d, i)` is example i as an RGB PIL image."""

    name: str = ""
    domains: list[str]
    classes: list[str]
    skipped: int = 0

    def size(self, domain: int) -> int:
        return int(self.labels(domain).shape[0])

    def labels(self, domain: int) -> torch.Tensor:
        raise NotImplementedError

    def image(self, domain: int, index: int) -> Image.Image:
        raise NotImplementedError


def _verifies(path: Path) -> bool:
    """Whether PIL identifies and verifies `path`; a JPEG must also end with its EOI marker
    (`verify()` reads only a JPEG's header, so a truncated JPEG would pass it and fail mid-run)."""
    try:
        with Image.open(path) as im:
            fmt = im.format
            im.verify()
        if fmt == "JPEG":
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 1024))
                if b"\xff\xd9" not in f.read():
                    return False
    except Exception:  # noqa: BLE001 - PIL raises many types for a bad file; all mean "unreadable"
        return False
    return True


class ImageFolderDomains(MultiDomainDataset):
    """`root/<domain>/<class>/<file>` (DomainBed's MultipleEnvironmentImageFolder); see the module
    docstring for the listing order and the corrupt-image rule."""

    def __init__(self, root: str | Path, name: str = "imagefolder", domains: list[str] | None = None,
                 skip_unreadable: bool = True):
        root = Path(root).expanduser()
        if not root.exists():
            raise OwaiError(f"dataset root {root} does not exist")
        if not root.is_dir():
            raise OwaiError(f"dataset root {root} is not a directory")
        if domains is None:
            domains = visible_dirs(root)
        else:
            domains = list(domains)
            missing = [d for d in domains if not (root / d).is_dir()]
            if missing:
                raise OwaiError(f"domain folder(s) missing in {root}: {', '.join(missing)}")
            if len(set(domains)) != len(domains):
                raise OwaiError(f"domain list {domains} for {root} has duplicates")
        if len(domains) < 2:
            raise OwaiError(f"dataset root {root} has {len(domains)} domain folder(s), need at least 2")
        classes = visible_dirs(root / domains[0])
        if not classes:
            raise OwaiError(f"domain {domains[0]!r} in {root} has no class folders")
        for domain in domains[1:]:
            other = visible_dirs(root / domain)
            if other != classes:
                missing, extra = sorted(set(classes) - set(other)), sorted(set(other) - set(classes))
                raise OwaiError(
                    f"domain {domain!r} in {root} has different class folders than {domains[0]!r}: "
                    f"missing {missing}, extra {extra}"
                )
        self.name, self.root, self.domains, self.classes = name, root, domains, classes
        self.skipped = 0
        self._files: list[Strings] = []  # paths relative to root, per domain (no object per path: DataLoader workers)
        self._labels: list[torch.Tensor] = []
        unreadable: list[Path] = []
        for domain in domains:
            files, labels, skipped = [], [], 0
            for label, cls in enumerate(classes):
                for path in image_files(root / domain / cls):
                    if _verifies(path):
                        files.append(str(path.relative_to(root)))
                        labels.append(label)
                    else:
                        skipped += 1
                        unreadable.append(path)
            if unreadable and not skip_unreadable:
                continue  # every domain is listed first, so the error counts them all
            if not files:
                raise OwaiError(
                    f"domain {domain!r} in {root} has no readable images"
                    + (f" ({skipped} unreadable file(s) skipped)" if skipped else "")
                )
            self.skipped += skipped
            self._files.append(Strings(files))
            self._labels.append(torch.tensor(labels, dtype=torch.int64))
        if unreadable and not skip_unreadable:
            raise OwaiError(f"{len(unreadable)} unreadable image file(s) (empty, truncated or not an image) under {root}, "
                            f"e.g. {unreadable[0]}; remove them, or skip them with --set data.skip_unreadable=true")

    def labels(self, domain: int) -> torch.Tensor:
        return self._labels[domain]

    def path(self, domain: int, index: int) -> Path:
        """The file of example `index` of `domain`."""
        return self.root / self._files[domain][index]

    def image(self, domain: int, index: int) -> Image.Image:
        path = self.path(domain, index)
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except Exception as exc:  # noqa: BLE001 - any decode failure of a user's file
            raise OwaiError(f"cannot decode image {path}: {exc}") from None


def dataset_root(name: str, root: str | Path | None = None) -> Path:
    """The folder of DomainBed dataset `name` by the data-root rule (`owai.data.registry`): the
    explicit `root` (DomainBed's data_dir holding PACS/..., a root holding domainbed/, or the
    dataset folder itself), else $OWAI_DATA/domainbed/<DIR>, else <cache>/data/domainbed/<DIR>.
    Missing is one line naming the manual download step. "imagefolder" takes `root` as it is."""
    if name not in DOMAINBED:
        if not root:
            raise OwaiError(f"data.root: the directory holding the {name} images is required (--data-root DIR)")
        return Path(root).expanduser()
    if not root:
        return registry.require(name)
    ds = registry.dataset(name)
    folder = registry.explicit_folder(ds, root)
    if (folder / DATASET_DIRS[name]).is_dir():
        folder = folder / DATASET_DIRS[name]
    if not ds.present(folder):
        raise DataMissing(registry.missing_message(name, root))
    return folder


@functools.lru_cache(maxsize=4)
def _indexed(name: str, root: str, skip_unreadable: bool) -> ImageFolderDomains:
    if name == "imagefolder":
        return ImageFolderDomains(root, skip_unreadable=skip_unreadable)
    return domainbed_dataset(name, root, skip_unreadable=skip_unreadable)


def open_image_dataset(name: str, root: str | Path, skip_unreadable: bool = False) -> ImageFolderDomains:
    """Dataset `name` ("imagefolder" or a DomainBed name) at `root`, indexed once per process
    (a config check before a run and the run itself share the index). Reads every file's header:
    an unreadable image is an error unless `skip_unreadable`."""
    return _indexed(name, str(Path(root).expanduser().resolve()), skip_unreadable)


def domainbed_dataset(name: str, root: str | Path, skip_unreadable: bool = True) -> ImageFolderDomains:
    """DomainBed dataset `name` (a key of `DOMAINBED`) from `root/DATASET_DIRS[name]`, or from `root`
    itself when it already holds the domain folders."""
    if name not in DOMAINBED:
        raise OwaiError(f"unknown DomainBed dataset {name!r} (known: {', '.join(DOMAINBED)})")
    root = Path(root).expanduser()
    expected = DOMAINBED[name]
    folder = root / DATASET_DIRS[name]
    if not folder.is_dir() and any((root / d).is_dir() for d in expected):
        folder = root
    if not folder.is_dir():
        raise OwaiError(f"{name} folder {folder} does not exist (expected <root>/{DATASET_DIRS[name]}/<domain>/...)")
    missing = [d for d in expected if not (folder / d).is_dir()]
    if missing:
        raise OwaiError(f"{name} folder {folder} lacks domain folder(s): {', '.join(missing)}")
    return ImageFolderDomains(folder, name=name, domains=list(expected), skip_unreadable=skip_unreadable)


class TensorDomains(MultiDomainDataset):
    """Grayscale uint8 images held in memory, one tensor (n, H, W) per domain; `image()` returns
    them as RGB (gray replicated to 3 channels)."""

    def __init__(self, name: str, domains: list[str], classes: list[str], images: list[torch.Tensor],
                 labels: list[torch.Tensor]):
        self.name, self.domains, self.classes, self.skipped = name, list(domains), list(classes), 0
        self._images = [im.to(torch.uint8).contiguous() for im in images]
        self._labels = [lab.to(torch.int64) for lab in labels]

    def labels(self, domain: int) -> torch.Tensor:
        return self._labels[domain]

    def images(self, domain: int) -> torch.Tensor:
        """All images of `domain`, uint8 (n, H, W)."""
        return self._images[domain]

    def image(self, domain: int, index: int) -> Image.Image:
        return Image.fromarray(self._images[domain][index].numpy()).convert("RGB")


def _rotate(images: torch.Tensor, angle: float) -> torch.Tensor:
    """Rotate uint8 (n, H, W) images `angle` degrees counter-clockwise (PIL bilinear, fill 0)."""
    out = [np.asarray(Image.fromarray(im).rotate(angle, resample=BILINEAR, fillcolor=0))
           for im in images.numpy()]
    return torch.from_numpy(np.stack(out)) if out else images.clone()


class RotatedMNIST(TensorDomains):
    """DomainBed's RotatedMNIST on one MNIST split (object with `.images` uint8 (N, 28, 28) and
    `.labels`): a fixed permutation of the images; its first `pool` images are an upright pretraining
    pool, the rest are dealt round-robin to the domains (`order[pool + i :: len(angles)]`), the first
    `per_domain` of each kept, and domain i rotated by `angles[i]` degrees. `source_indices[i]` are
    the MNIST indices of domain i, `pool_indices` those of the pool."""

    def __init__(self, mnist, angles: list[float], per_domain: int, pool: int = 0, seed: int = 0):
        angles = [float(a) for a in angles]
        n = int(mnist.labels.shape[0])
        if per_domain < 1:
            raise OwaiError(f"RotatedMNIST per_domain must be >= 1, got {per_domain}")
        if len(angles) < 2:
            raise OwaiError(f"RotatedMNIST needs at least 2 angles (domains), got {len(angles)}")
        if pool < 0:
            raise OwaiError(f"RotatedMNIST pool must be >= 0, got {pool}")
        needed = pool + per_domain * len(angles)
        if needed > n:
            raise OwaiError(
                f"RotatedMNIST needs {needed} images (pool {pool} + {len(angles)} domains x {per_domain}), "
                f"the MNIST split has {n}"
            )
        order = torch.randperm(n, generator=generator(seed, "rotated-mnist", "order"))
        self.angles, self.seed = angles, seed
        self.pool_indices = order[:pool]
        self.source_indices = [order[pool + i :: len(angles)][:per_domain] for i in range(len(angles))]
        super().__init__(
            name="rotated_mnist",
            domains=[f"rot{a:g}" for a in angles],
            classes=[str(c) for c in range(10)],
            images=[_rotate(mnist.images[idx], a) for idx, a in zip(self.source_indices, angles)],
            labels=[mnist.labels[idx] for idx in self.source_indices],
        )
        self._pool = (mnist.images[self.pool_indices].clone(), mnist.labels[self.pool_indices].clone())

    def pretraining_pool(self) -> TensorDomains:
        """The `pool` upright images as a one-domain dataset ("upright")."""
        if len(self.pool_indices) == 0:
            raise OwaiError("RotatedMNIST was built with pool=0: there is no pretraining pool")
        images, labels = self._pool
        return TensorDomains("rotated_mnist_pool", ["upright"], self.classes, [images], [labels])


def domainbed_seed(*args: object) -> int:
    """DomainBed's `misc.seed_hash`: the md5 of the arguments' tuple as Python prints it, mod 2**31."""
    return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)


def split_domain(n: int, holdout_fraction: float, trial_seed: int, domain: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DomainBed's split of domain `domain` (its index among all the dataset's domains) of `n`
    examples: (in_idx, out_idx). As `misc.split_dataset(env, int(len(env) * holdout_fraction),
    misc.seed_hash(trial_seed, env_i))`: indices 0..n-1 shuffled by numpy's RandomState seeded with
    that hash; `out` is the first `int(n * holdout_fraction)`, `in` the rest."""
    if not 0.0 <= holdout_fraction < 1.0:
        raise OwaiError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
    if n < 0:
        raise OwaiError(f"cannot split a domain of {n} examples")
    keys = np.arange(n)
    np.random.RandomState(domainbed_seed(int(trial_seed), int(domain))).shuffle(keys)
    perm = torch.from_numpy(keys)
    k = int(n * holdout_fraction)
    if holdout_fraction > 0 and (k == 0 or k == n):  # an empty part: nothing to train on, or to select with
        raise OwaiError(f"domain {domain} has {n} examples: too few to hold out {holdout_fraction:g} of them "
                        "(data.holdout_fraction) and train on the rest")
    return perm[k:].clone(), perm[:k].clone()


# ---------------------------------------------------------------------------------------- transforms

def _uniform(lo: float, hi: float, gen: torch.Generator) -> float:
    return float(torch.empty(1).uniform_(lo, hi, generator=gen))


def random_resized_crop_params(width: int, height: int, gen: torch.Generator,
                               scale: tuple[float, float] = CROP_SCALE,
                               ratio: tuple[float, float] = CROP_RATIO) -> tuple[int, int, int, int]:
    """(top, left, h, w) of torchvision's RandomResizedCrop: 10 tries of a uniform area fraction in
    `scale` and a log-uniform aspect ratio in `ratio`, then the central crop with the nearest
    admissible ratio (the whole image if its ratio is admissible)."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * _uniform(scale[0], scale[1], gen)
        aspect = math.exp(_uniform(log_lo, log_hi, gen))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=gen))
            left = int(torch.randint(0, width - w + 1, (1,), generator=gen))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _adjust_hue(image: Image.Image, shift: float) -> Image.Image:
    """torchvision's PIL adjust_hue: shift H (uint8 in HSV mode) by `shift` of the hue circle."""
    h, s, v = image.convert("HSV").split()
    np_h = (np.asarray(h, dtype=np.int16) + int(shift * 255)) % 256
    return Image.merge("HSV", (Image.fromarray(np_h.astype(np.uint8)), s, v)).convert("RGB")


def color_jitter(image: Image.Image, gen: torch.Generator, strength: float = JITTER,
                 hue_strength: float | None = None) -> Image.Image:
    """torchvision's ColorJitter(strength, strength, strength, hue_strength) (hue_strength None =
    strength): the four ops in a random order, factors uniform in [1 - strength, 1 + strength], hue
    shift uniform in [-hue_strength, hue_strength]."""
    order = torch.randperm(4, generator=gen).tolist()
    lo = max(0.0, 1.0 - strength)
    b, c, s = (_uniform(lo, 1.0 + strength, gen) for _ in range(3))
    h = strength if hue_strength is None else hue_strength
    hue = _uniform(-h, h, gen)
    for op in order:
        if op == 0:
            image = ImageEnhance.Brightness(image).enhance(b)
        elif op == 1:
            image = ImageEnhance.Contrast(image).enhance(c)
        elif op == 2:
            image = ImageEnhance.Color(image).enhance(s)
        else:
            image = _adjust_hue(image, hue)
    return image


def image_jitter(image: Image.Image, gen: torch.Generator, strength: float = FEWSHOT_JITTER) -> Image.Image:
    """Chen et al. 2019's ImageJitter(Brightness, Contrast, Color = strength): the three PIL
    enhancements in that fixed order, each by a factor uniform in [1 - strength, 1 + strength]."""
    factors = torch.rand(3, generator=gen).tolist()
    for enhance, r in zip((ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color), factors):
        image = enhance(image).enhance(strength * (2.0 * r - 1.0) + 1.0).convert("RGB")
    return image


def _flip(image: Image.Image, gen: torch.Generator) -> Image.Image:
    return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if float(torch.rand(1, generator=gen)) < FLIP_P else image


def train_transform(image: Image.Image, size: int, augment: bool, gen: torch.Generator,
                    style: str = "domainbed") -> torch.Tensor:
    """float32 (3, size, size). augment=False: `eval_transform`. augment=True, by style (see
    `owai.data.images.STYLES`), then to tensor and normalise; every random draw comes from `gen`:
    - domainbed: RandomResizedCrop(size, (0.7, 1)), RandomHorizontalFlip, ColorJitter(0.3 x 4),
      RandomGrayscale(0.1);
    - cifar (TH A.1): RandomResizedCrop(size, (0.8, 1), (3/4, 4/3)) bicubic, RandomHorizontalFlip;
    - imagenet (TH A.2.1, He et al. 2016): RandomResizedCrop(size), RandomHorizontalFlip;
    - fewshot (TH A.4.2, Chen et al. 2019): RandomResizedCrop(size), ImageJitter(0.4 x 3),
      RandomHorizontalFlip;
    - vit (RRL's vit384px): RandomResizedCrop(size) bicubic, RandomHorizontalFlip."""
    check_style(style)
    if not augment:
        return eval_transform(image, size, style)
    image = image.convert("RGB")
    scale = {"domainbed": CROP_SCALE, "cifar": CIFAR_CROP_SCALE}.get(style, IMAGENET_CROP_SCALE)
    top, left, h, w = random_resized_crop_params(image.width, image.height, gen, scale=scale)
    image = image.crop((left, top, left + w, top + h)).resize((size, size), BICUBIC if style in ("cifar", "vit") else BILINEAR)
    if style == "fewshot":
        image = image_jitter(image, gen)
    image = _flip(image, gen)
    if style == "domainbed":
        image = color_jitter(image, gen)
        if float(torch.rand(1, generator=gen)) < GRAYSCALE_P:
            image = image.convert("L").convert("RGB")
    return to_tensor(image, style)


SSL_CROP_SCALE = (0.2, 1.0)  # SimSiam (Chen & He 2021) / spec rich_features.md §6.7, Table A.4
SSL_JITTER, SSL_HUE, SSL_JITTER_P, SSL_GRAYSCALE_P = 0.4, 0.1, 0.8, 0.2


def ssl_transform(image: Image.Image, size: int, gen: torch.Generator, style: str = "domainbed") -> torch.Tensor:
    """SimSiam's CIFAR view (TH A.3.3): RandomResizedCrop(size, (0.2, 1)), RandomHorizontalFlip,
    ColorJitter(0.4, 0.4, 0.4, 0.1) with probability 0.8, RandomGrayscale(0.2), to tensor, normalise
    (CIFAR's mean and std for the "cifar" style; no blur: the CIFAR recipe has none). float32 (3,
    size, size); every draw comes from `gen`."""
    check_style(style)
    image = image.convert("RGB")
    top, left, h, w = random_resized_crop_params(image.width, image.height, gen, scale=SSL_CROP_SCALE)
    image = _flip(image.crop((left, top, left + w, top + h)).resize((size, size), BILINEAR), gen)
    if float(torch.rand(1, generator=gen)) < SSL_JITTER_P:
        image = color_jitter(image, gen, SSL_JITTER, SSL_HUE)
    if float(torch.rand(1, generator=gen)) < SSL_GRAYSCALE_P:
        image = image.convert("L").convert("RGB")
    return to_tensor(image, style)


# ------------------------------------------------------------------------------------------ batches

class StepBatches(Dataset):
    """Item `step` = the whole minibatch of training step `step`: `batch_per_domain` examples from
    each training domain, drawn with replacement (DomainBed's InfiniteDataLoader samples with
    RandomSampler(replacement=True)) by generator(seed, "batch", step, domain), each augmented with
    generator(seed, "augment", step, domain, j). A function of the step, so a resumed run replays the
    same batches. Returns x float32 (D*B, 3, size, size), y int64, d int64 (the position k of the
    example's domain in `domains`), domain by domain.

    `views` = V > 1 (self-supervised pairs, SimSiam) gives every example V independent augmentations
    by `ssl_transform` (view v > 0 keyed by generator(seed, "augment", step, domain, j, v)): x is
    (V*D*B, 3, size, size), the V views stacked view by view, and y, d are those of one view.
    `style` picks the transforms (`owai.data.images.STYLES`). `sampling="epochs"` draws each domain's
    examples without replacement instead: step s takes slice s mod E of epoch s // E's permutation
    (keyed by generator(seed, "epoch", epoch, domain)), E = n // batch_per_domain, the last
    incomplete batch dropped (a linear probe's passes over its training set)."""

    def __init__(self, data: MultiDomainDataset, domains: list[int], indices: list[torch.Tensor],
                 batch_per_domain: int, size: int, augment: bool, seed: int, steps: int, views: int = 1,
                 style: str = "domainbed", sampling: str = "replacement"):
        check_style(style)
        if sampling not in ("replacement", "epochs"):
            raise OwaiError(f"StepBatches sampling must be 'replacement' or 'epochs', got {sampling!r}")
        domains = [int(d) for d in domains]
        if not domains:
            raise OwaiError("StepBatches needs at least one training domain")
        if len(indices) != len(domains):
            raise OwaiError(f"StepBatches got {len(domains)} domains but {len(indices)} index sets")
        if batch_per_domain < 1 or size < 1 or steps < 0 or views < 1:
            raise OwaiError(f"StepBatches needs batch_per_domain >= 1, size >= 1, steps >= 0, views >= 1 "
                            f"(got {batch_per_domain}, {size}, {steps}, {views})")
        self.indices = []
        for d, idx in zip(domains, indices):
            if not 0 <= d < len(data.domains):
                raise OwaiError(f"{data.name} has no domain {d} (it has {len(data.domains)})")
            idx = torch.as_tensor(idx, dtype=torch.int64)
            if idx.numel() == 0:
                raise OwaiError(f"{data.name} domain {data.domains[d]!r} has no training examples")
            if int(idx.min()) < 0 or int(idx.max()) >= data.size(d):
                raise OwaiError(f"{data.name} domain {data.domains[d]!r}: an index is outside 0..{data.size(d) - 1}")
            self.indices.append(idx)
        self.data, self.domains, self.batch_per_domain = data, domains, batch_per_domain
        self.size, self.augment, self.seed, self.steps, self.views = size, augment, seed, steps, views
        self.style, self.sampling = style, sampling
        self._orders: dict[int, tuple[int, torch.Tensor]] = {}  # sampling="epochs": domain -> (epoch, its permutation)
        if sampling == "epochs" and any(len(idx) < batch_per_domain for idx in self.indices):
            raise OwaiError(f"StepBatches: a domain has fewer than {batch_per_domain} examples for a batch without replacement")

    def __len__(self) -> int:
        return self.steps

    def _picks(self, step: int, domain: int, n: int) -> torch.Tensor:
        """Positions in the domain's index set of step `step`'s examples."""
        if self.sampling == "replacement":
            return torch.randint(n, (self.batch_per_domain,), generator=generator(self.seed, "batch", step, domain))
        epoch, k = divmod(step, n // self.batch_per_domain)
        cached = self._orders.get(domain)
        if cached is None or cached[0] != epoch:  # drawn once per epoch, not per step (ImageNet: 25 ms a step)
            cached = self._orders[domain] = (epoch, torch.randperm(n, generator=generator(self.seed, "epoch", epoch, domain)))
        order = cached[1]
        return order[k * self.batch_per_domain : (k + 1) * self.batch_per_domain].clone()

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        step = int(step)
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} outside 0..{self.steps - 1}")
        xs: list[list[torch.Tensor]] = [[] for _ in range(self.views)]  # view -> examples
        ys = []
        for domain, idx in zip(self.domains, self.indices):
            chosen = idx[self._picks(step, domain, len(idx))]
            for j, i in enumerate(chosen.tolist()):
                image = self.data.image(domain, i)
                if self.views == 1:
                    gen = generator(self.seed, "augment", step, domain, j)
                    xs[0].append(train_transform(image, self.size, self.augment, gen, self.style))
                    continue
                for v in range(self.views):
                    gen = generator(self.seed, "augment", step, domain, j, *([v] if v else []))
                    xs[v].append(ssl_transform(image, self.size, gen, self.style))
            ys.append(self.data.labels(domain)[chosen])
        d = torch.arange(len(self.domains)).repeat_interleave(self.batch_per_domain)
        return stack([x for view in xs for x in view]), torch.cat(ys), d


class _EvalItems(Dataset):
    def __init__(self, data: MultiDomainDataset, domain: int, indices: torch.Tensor, size: int, style: str):
        check_style(style)
        self.data, self.domain, self.size, self.style = data, domain, size, style
        self.indices = torch.as_tensor(indices, dtype=torch.int64)
        self.labels = data.labels(domain)

    def __len__(self) -> int:
        return int(self.indices.numel())

    def __getitem__(self, k: int) -> tuple[torch.Tensor, int]:
        i = int(self.indices[k])
        return eval_transform(self.data.image(self.domain, i), self.size, self.style), int(self.labels[i])


def _collate_eval(items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return stack([x for x, _ in items]), torch.tensor([y for _, y in items], dtype=torch.int64)


def eval_batches(data: MultiDomainDataset, domain: int, indices: torch.Tensor, size: int, batch_size: int = 256,
                 workers: int = 0, pin_memory: bool = False,
                 style: str = "domainbed") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) batches of the examples `indices` of `domain`, in order, eval transform of `style`; the
    loader's workers end with the pass, a failed one included (`ending_workers`)."""
    if batch_size < 1:
        raise OwaiError(f"eval batch_size must be >= 1, got {batch_size}")
    items = _EvalItems(data, domain, indices, size, style)
    return ending_workers(iter(loader(items, workers, pin_memory, batch_size=batch_size, shuffle=False,
                                      collate_fn=_collate_eval)))


class CachedEval:
    """Eval-transformed tensors of one (domain, indices) computed once and kept in memory
    (x float32 (n, 3, size, size), y int64 (n,)), for small datasets evaluated many times (CPU presets)."""

    def __init__(self, data: MultiDomainDataset, domain: int, indices: torch.Tensor, size: int,
                 batch_size: int = 256):
        parts = list(eval_batches(data, domain, indices, size, batch_size))
        self.batch_size = batch_size
        if parts:
            self.x = torch.from_numpy(np.concatenate([x.numpy() for x, _ in parts]))
            self.y = torch.cat([y for _, y in parts])
        else:
            self.x, self.y = torch.empty(0, 3, size, size), torch.empty(0, dtype=torch.int64)

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for k in range(0, len(self), self.batch_size):
            yield self.x[k : k + self.batch_size], self.y[k : k + self.batch_size]

