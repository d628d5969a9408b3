"""Image-folder helpers shared by the image datasets (DomainBed, Camelyon17, the classification sets).

Below `domainbed.py`, `camelyon17.py` and `classification.py`, which all list image folders the same
way, turn images into ImageNet-normalised tensors and read batches through DataLoaders that leave
torch's global random stream alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from owai.errors import OwaiError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
BILINEAR = Image.Resampling.BILINEAR
_MEAN = np.asarray(IMAGENET_MEAN, dtype=np.float32)
_STD = np.asarray(IMAGENET_STD, dtype=np.float32)


def visible_dirs(path: Path) -> list[str]:
    """The sorted names of the sub-directories of `path`, hidden ones (".name") left out."""
    return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))


def image_files(class_dir: Path) -> list[Path]:
    """Files below `class_dir` (recursively) with an image extension, in sorted path order."""
    found = []
    for dirpath, dirnames, filenames in os.walk(class_dir, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [Path(dirpath) / f for f in filenames
                  if not f.startswith(".") and f.lower().endswith(IMAGE_EXTENSIONS)]
    return sorted(found)


def to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> float32 (3, H, W), ImageNet-normalised. Computed in NumPy: per-image torch ops
    would go through intra-op thread pools, which cost far more than the arithmetic at this size."""
    x = (np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0 - _MEAN) / _STD
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))


def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack of CPU tensors through NumPy (single-threaded; see `to_tensor`)."""
    return torch.from_numpy(np.stack([t.numpy() for t in tensors]))


def eval_transform(image: Image.Image, size: int) -> torch.Tensor:
    """DomainBed's eval transform: Resize((size, size)) bilinear, to tensor, normalise."""
    image = image.convert("RGB")
    if image.size != (size, size):
        image = image.resize((size, size), BILINEAR)
    return to_tensor(image)


def loader(dataset: Dataset, workers: int, pin_memory: bool, **kwargs: Any) -> DataLoader:
    """A DataLoader with its own generator: every iterator a DataLoader starts draws a worker base
    seed from its generator, which by default is torch's global one, so starting loaders (for an
    evaluation, or on resume) would shift the training's dropout masks. The batches themselves are
    keyed by step and do not use this seed."""
    if workers < 0:
        raise OwaiError(f"data loader workers must be >= 0, got {workers}")
    return DataLoader(dataset, num_workers=workers, pin_memory=pin_memory, persistent_workers=False,
                      prefetch_factor=4 if workers else None, generator=torch.Generator().manual_seed(0), **kwargs)


def step_loader(batches: Dataset, start: int, workers: int = 0,
                pin_memory: bool = False) -> Iterator[tuple[torch.Tensor, ...]]:
    """The batches of steps start, start + 1, ..., len(batches) - 1 of a dataset indexed by step
    (each item a whole batch); workers build whole steps."""
    if not 0 <= start <= len(batches):  # type: ignore[arg-type]
        raise OwaiError(f"start step {start} outside 0..{len(batches)}")  # type: ignore[arg-type]
    return iter(loader(batches, workers, pin_memory, batch_size=None, sampler=range(start, len(batches))))  # type: ignore[arg-type]
