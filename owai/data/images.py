"""Image-folder helpers shared by the image datasets (DomainBed, Camelyon17, the classification sets).

Below `domainbed.py`, `camelyon17.py` and `classification.py`, which all list image folders the same
way, turn images into normalised tensors (`eval_transform`, by `STYLES`) and read batches through
DataLoaders that leave torch's global random stream alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler

from owai.errors import OwaiError
from owai.models.vision import IMAGENET_MEAN, IMAGENET_STD  # one definition: the weights that read these images share it

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)  # TH A.1 and A.3.3 (the CIFAR trainings)
CIFAR_STD = (0.2023, 0.1994, 0.2010)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
BILINEAR = Image.Resampling.BILINEAR
BICUBIC = Image.Resampling.BICUBIC

# How images become tensors: DomainBed's transforms (every recipe's default), or those the thesis
# names for a family of datasets: "cifar" (TH A.1, which A.2.1 reuses for CIFAR), "imagenet" (TH
# A.2.1 after He et al. 2016: ImageNet, iNat18), "fewshot" (TH A.4.2 after Chen et al. 2019: CUB,
# miniImageNet) and "vit" (RRL's fine-tuning of the 384-px ViTs of Figure 2.4, VISSL's tricks_384).
# The training side is `owai.data.domainbed.train_transform`.
STYLES = ("domainbed", "cifar", "imagenet", "fewshot", "vit")


class Strings(Sequence[str]):
    """N strings (an image dataset's file paths) in one NumPy byte array plus offsets, read back one at a
    time: no Python object per string. A DataLoader worker forked from the training process that
    reads a list of str or Path objects writes each object's reference count, which copies its memory
    page into the worker (copy-on-write); over an epoch every worker ends up with its own copy of the
    whole list (ImageNet's 1.28M relative Path objects: 255 MB per worker, 129 MB as str; 18 MB here:
    benchmarks/data_scale.py). Names that are not UTF-8 round-trip (os.fsencode / os.fsdecode)."""

    def __init__(self, items: Iterable[str | os.PathLike[str]] = ()) -> None:
        encoded = [os.fsencode(item) for item in items]
        self._offsets = np.zeros(len(encoded) + 1, dtype=np.int64)  # (N+1,): item i is blob[o[i]:o[i+1]]
        np.cumsum([len(e) for e in encoded], out=self._offsets[1:])
        self._blob = np.frombuffer(b"".join(encoded), dtype=np.uint8)  # (total bytes,)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def _item(self, i: int) -> str:
        return os.fsdecode(self._blob[self._offsets[i]:self._offsets[i + 1]].tobytes())

    def _index(self, index: Any) -> int:
        """`index` as a list takes it (negative from the end), or IndexError."""
        i = int(index)
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} outside 0..{len(self) - 1}")
        return i % len(self)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.take(range(len(self))[index])
        return self._item(self._index(index))

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    def take(self, indices: Iterable[int]) -> Strings:
        """The items at `indices`, in that order, as a table of the same kind."""
        out = type(self).__new__(type(self))
        out.__dict__.update(self.__dict__)  # a subclass's own fields
        Strings.__init__(out, [self._item(self._index(i)) for i in indices])
        return out

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Sequence) and not isinstance(other, (str, bytes)) and len(other) == len(self)
                and all(a == b for a, b in zip(self, other)))  # as a list: never equal to a string

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} items)"


class Paths(Strings):
    """`Strings` whose items are `Path`s (an image list of `owai.data.classification`)."""

    def __getitem__(self, index: Any) -> Any:
        item = super().__getitem__(index)
        return item if isinstance(item, Strings) else Path(item)


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


def check_style(style: str) -> None:
    """A one-line OwaiError for a style that is not one of STYLES."""
    if style not in STYLES:
        raise OwaiError(f"unknown image transform style {style!r} (one of {', '.join(STYLES)})")


def normalisation(style: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) the images of `style` are normalised with: CIFAR's for "cifar", else ImageNet's
    (a Hugging Face checkpoint, as the ViTs under "vit", trades them for its own: owai.models.hf_vision)."""
    check_style(style)
    return (CIFAR_MEAN, CIFAR_STD) if style == "cifar" else (IMAGENET_MEAN, IMAGENET_STD)


# each style's (mean, std) as float32 arrays, made once: `to_tensor` runs once per image
_STATS = {style: tuple(np.asarray(v, dtype=np.float32) for v in normalisation(style)) for style in STYLES}


def to_tensor(image: Image.Image, style: str = "domainbed") -> torch.Tensor:
    """RGB PIL image -> float32 (3, H, W), normalised as `normalisation(style)` says. Computed in
    NumPy: per-image torch ops would go through intra-op thread pools, which cost far more than the
    arithmetic at this size."""
    mean, std = _STATS[style]
    x = (np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0 - mean) / std
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))


def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack of CPU tensors through NumPy (single-threaded; see `to_tensor`)."""
    return torch.from_numpy(np.stack([t.numpy() for t in tensors]))


def resize_shorter(image: Image.Image, side: int, resample: Image.Resampling) -> Image.Image:
    """torchvision's Resize(side): the shorter side becomes `side`, the longer int(side * long / short)."""
    w, h = image.size
    size = (side, int(side * h / w)) if w <= h else (int(side * w / h), side)
    return image if size == (w, h) else image.resize(size, resample)


def center_crop(image: Image.Image, size: int) -> Image.Image:
    """torchvision's CenterCrop(size) of an image at least `size` on each side."""
    w, h = image.size
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return image.crop((left, top, left + size, top + size))


def eval_transform(image: Image.Image, size: int, style: str = "domainbed") -> torch.Tensor:
    """float32 (3, size, size) for evaluation, by style (see STYLES):
    - domainbed: Resize((size, size)) bilinear;
    - cifar (TH A.1): Resize(36) bicubic, CenterCrop(32); at other sizes Resize(int(size x 8/7)), as RRL's
      code (256 at 224 px);
    - imagenet (He et al. 2016): Resize(256) bilinear, CenterCrop(224), at other sizes in the same ratio;
    - fewshot (Chen et al. 2019): Resize((int(1.15 size), int(1.15 size))) bilinear, CenterCrop(size);
    - vit (RRL's vit384px): Resize(size) bicubic, CenterCrop(size);
    then to tensor and normalise (`to_tensor`)."""
    check_style(style)
    image = image.convert("RGB")
    if style == "domainbed":
        return to_tensor(image if image.size == (size, size) else image.resize((size, size), BILINEAR))
    if style == "cifar":
        image = resize_shorter(image, int(size * 8 / 7), BICUBIC)  # 36 at 32 px, 256 at 224 px (RRL's datasets.py)
    elif style == "imagenet":
        image = resize_shorter(image, round(size * 256 / 224), BILINEAR)
    elif style == "vit":
        image = resize_shorter(image, size, BICUBIC)
    else:
        side = int(size * 1.15)
        image = image.resize((side, side), BILINEAR)
    return to_tensor(center_crop(image, size), style)


def loader(dataset: Dataset, workers: int, pin_memory: bool, persistent: bool = False, **kwargs: Any) -> DataLoader:
    """A DataLoader with its own generator: every iterator a DataLoader starts draws a worker base
    seed from its generator, which by default is torch's global one, so starting loaders (for an
    evaluation, or on resume) would shift the training's dropout masks. The batches themselves are
    keyed by step and do not use this seed. `persistent`: the workers outlive each pass (`iter`) and
    serve the next, for a loader iterated many times (`EvalPasses`)."""
    if workers < 0:
        raise OwaiError(f"data loader workers must be >= 0, got {workers}")
    if workers:
        _preload_fork_server(dataset, kwargs.get("multiprocessing_context"))
    return DataLoader(dataset, num_workers=workers, pin_memory=pin_memory, persistent_workers=persistent and workers > 0,
                      prefetch_factor=4 if workers else None, generator=torch.Generator().manual_seed(0), **kwargs)


class _PassBatches(Sampler):
    """The current pass's batches of example indices (an `EvalPasses` sets them before each pass)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class EvalPasses:
    """Evaluation passes over any examples of one dataset, through one set of worker processes that
    is started at the first pass and serves every later one (`persistent`). A run evaluates many times
    (a Camelyon17 run: 27 passes), and a loader per pass starts its workers each time: under `spawn`
    (macOS's default) each worker is a fresh interpreter that imports torch, seconds a start. Without
    workers each pass reads in this process. `examples[i]` is example i; `collate` stacks a batch.
    One pass at a time: a new pass ends the one before."""

    def __init__(self, examples: Dataset, batch_size: int, workers: int, collate: Callable[[list[Any]], Any],
                 pin_memory: bool = False) -> None:
        if batch_size < 1:
            raise OwaiError(f"evaluation batch size must be >= 1, got {batch_size}")
        self.batch_size, self.batches = batch_size, _PassBatches()
        self._made = (examples, workers, pin_memory, collate)
        self.loader = self._new_loader()
        self._iterator: Iterator[Any] | None = None  # the loader's, the same one every pass while its workers live

    def _new_loader(self) -> DataLoader:
        examples, workers, pin_memory, collate = self._made
        return loader(examples, workers, pin_memory, persistent=True, batch_sampler=self.batches, collate_fn=collate)

    def __call__(self, indices: torch.Tensor) -> Iterator[Any]:
        """The batches of `indices`' examples, in order."""
        ids = [int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()]
        self.batches.batches = [ids[k:k + self.batch_size] for k in range(0, len(ids), self.batch_size)]
        self._iterator = iter(self.loader)
        return self._iterator

    def close(self) -> None:
        """End the workers now (`end_workers`), not when this object is garbage-collected; a later pass
        starts new ones. `with EvalPasses(...) as passes:` closes it when the block ends, however it ends."""
        if self._iterator is not None:
            end_workers(self._iterator)
            self._iterator = None
            self.loader = self._new_loader()  # the old one would hand out its persistent iterator, now ended

    def __enter__(self) -> EvalPasses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ending_workers(iterator: Iterator[Any]) -> Iterator[Any]:
    """One pass of a loader's `iterator`, its workers ended (`end_workers`) when the pass is done, is
    left (the generator closed) or fails: bad data met by a worker raises through the iterator, and the
    exception's traceback then holds the iterator, so its workers would live as long as the caller
    keeps the exception; a one-pass loader with persistent workers would keep them after the pass."""
    try:
        yield from iterator
    finally:
        end_workers(iterator)


def end_workers(iterator: Iterator[Any] | None) -> None:
    """Stop a DataLoader iterator's worker processes now, as its own `__del__` does when it is
    garbage-collected. A run that fails keeps its streams referenced by its frames, which the
    exception's traceback holds for as long as the caller keeps the exception (a notebook's last
    traceback, pytest's report of a failed test): their workers, a process each with its pipes and
    shared memory, lived that long too. Nothing for an iterator without workers, or None."""
    shutdown = getattr(iterator, "_shutdown_workers", None)  # torch's multi-process iterator's; idempotent
    if shutdown is not None:
        shutdown()


def _preload_fork_server(dataset: Dataset, context: Any = None) -> None:
    """Under the `forkserver` start method (Python 3.14's default on Linux), have the fork server import
    torch, this module and the dataset's module before it forks the first worker. Otherwise every
    worker imports them afresh each time a loader starts (a training stream, and every evaluation
    pass): 4.9 s per start against 0.1 s by fork on 2 busy cores, so a Camelyon17 run's 27 evaluation
    passes cost minutes; preloaded, the first start pays the server's imports (2.4 s) and the next
    0.1 s. "__main__" is the default list's own entry, kept. The server reads the list when it
    starts: once it runs, this is a no-op (the tokenizer pool's server, owai.data.tokens preloaded,
    already holds torch). `spawn` (macOS's default) starts each worker from a fresh interpreter and
    has nothing to preload; `fork` copies this process."""
    import multiprocessing

    method = context if isinstance(context, str) else (context or multiprocessing).get_start_method()
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(["__main__", __name__, type(dataset).__module__])


def step_loader(batches: Dataset, start: int, workers: int = 0,
                pin_memory: bool = False) -> Iterator[tuple[torch.Tensor, ...]]:
    """The batches of steps start, start + 1, ..., len(batches) - 1 of a dataset indexed by step
    (each item a whole batch); workers build whole steps."""
    if not 0 <= start <= len(batches):  # type: ignore[arg-type]
        raise OwaiError(f"start step {start} outside 0..{len(batches)}")  # type: ignore[arg-type]
    return iter(loader(batches, workers, pin_memory, batch_size=None, sampler=range(start, len(batches))))  # type: ignore[arg-type]


class StepStream:
    """Training batches by step through worker processes (`step_loader`): `at(step)` returns update
    `step`'s first two items ((x, y), or Camelyon17's (x, positions)). The loader restarts whenever a
    step is not the next one (a resume), so the batches are a function of the step alone, and it has
    its own generator, so starting it does not consume torch's global RNG. With `device`, the items
    come on it (pinned and copied without blocking on CUDA; x channels-last where asked)."""

    def __init__(self, batches: Dataset, workers: int, device: torch.device | None = None,
                 channels_last: bool = False) -> None:
        self.batches, self.workers, self.device, self.channels_last = batches, workers, device, channels_last
        self.next_step, self.iterator = -1, None

    def close(self) -> None:
        """End the loader's workers now (`end_workers`); a later `at` starts the loader again. `with
        StepStream(...) as stream:` closes it when the block ends, a failure included."""
        iterator, self.iterator, self.next_step = self.iterator, None, -1
        end_workers(iterator)

    def __enter__(self) -> StepStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step != self.next_step or self.iterator is None:
            pin = self.device is not None and self.device.type == "cuda"
            self.iterator = iter(step_loader(self.batches, step, self.workers, pin))
        x, y, _ = next(self.iterator)
        self.next_step = step + 1
        if self.device is None:
            return x, y
        x = x.to(self.device, non_blocking=True)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(self.device, non_blocking=True)
