"""The thesis's image transforms per dataset family (`owai.data.images.STYLES`): CIFAR's (TH A.1),
He et al.'s for ImageNet and iNat18 (TH A.2.1), Chen et al.'s for the few-shot sets (TH A.4.2), and
rich-features' `data.transforms: thesis`, which the paper presets of chapter 2's tables select."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from owai.data.domainbed import StepBatches, image_jitter, train_transform
from owai.data.images import (
    CIFAR_MEAN,
    CIFAR_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    STYLES,
    center_crop,
    eval_transform,
    resize_shorter,
)
from owai.errors import OwaiError
from owai.runtime import generator

COLOUR = (200, 100, 50)


def normalised(colour: tuple[int, int, int], style: str) -> torch.Tensor:
    mean, std = (CIFAR_MEAN, CIFAR_STD) if style == "cifar" else (IMAGENET_MEAN, IMAGENET_STD)
    return ((torch.tensor(colour) / 255 - torch.tensor(mean)) / torch.tensor(std)).view(3, 1, 1)


def _unnormalised(x: torch.Tensor, style: str) -> torch.Tensor:
    """Pixel values in [0, 255] back from a tensor of `style`."""
    mean, std = normalised((0, 0, 0), style), normalised((255, 255, 255), style) - normalised((0, 0, 0), style)
    return (x - mean) / std * 255


def coordinates(width: int, height: int) -> Image.Image:
    """An image whose red channel is the column and green channel the row of each pixel."""
    x = np.zeros((height, width, 3), dtype=np.uint8)
    x[..., 0] = np.arange(width)[None, :]
    x[..., 1] = np.arange(height)[:, None]
    return Image.fromarray(x)


@pytest.mark.parametrize("style", STYLES)
def test_each_style_normalises_with_its_own_statistics(style: str) -> None:
    """A constant image stays constant through resizing and crops: what is left is the normalisation,
    CIFAR's mean and std for the CIFAR style, ImageNet's for the others."""
    x = eval_transform(Image.new("RGB", (40, 30), COLOUR), 24, style)
    assert x.shape == (3, 24, 24) and x.dtype == torch.float32
    assert torch.allclose(x, normalised(COLOUR, style).expand(3, 24, 24), atol=1e-5)


def test_resize_and_center_crop_follow_torchvision() -> None:
    """Resize(side) scales the shorter side to `side` and the longer to int(side * long / short);
    CenterCrop rounds the offsets of the centred box."""
    assert resize_shorter(Image.new("RGB", (40, 60)), 32, Image.Resampling.BILINEAR).size == (32, 48)
    assert resize_shorter(Image.new("RGB", (61, 40)), 32, Image.Resampling.BILINEAR).size == (48, 32)
    crop = np.asarray(center_crop(coordinates(32, 48), 28))
    assert crop.shape == (28, 28, 3)
    assert (int(crop[0, 0, 0]), int(crop[0, 0, 1])) == (2, 10)  # left (32 - 28) / 2, top (48 - 28) / 2


@pytest.mark.parametrize("style, resized", [("cifar", 36), ("imagenet", 37), ("fewshot", 36)])
def test_evaluation_resizes_then_crops_the_centre(style: str, resized: int) -> None:
    """At 32 px: CIFAR's Resize(36) + CenterCrop(32); He et al.'s 256 / 224 ratio (Resize(37)); Chen et
    al.'s 1.15 x size square (36 x 36). The centre crop then drops (resized - 32) / 2 pixels a side."""
    image = coordinates(32, 32)
    red = _unnormalised(eval_transform(image, 32, style), style)[0]
    scale = 32 / resized  # one resized pixel, in source pixels
    left = round((resized - 32) / 2)
    assert red[16, 0].item() == pytest.approx((left + 0.5) * scale - 0.5, abs=0.6)
    assert red[16, 31].item() == pytest.approx((left + 31.5) * scale - 0.5, abs=0.6)


def test_training_transforms_by_style() -> None:
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8))
    for style in STYLES:
        a, b = (train_transform(image, 24, True, generator(0, "t"), style) for _ in range(2))
        assert a.shape == (3, 24, 24) and torch.equal(a, b), style
        assert torch.equal(train_transform(image, 24, False, generator(0, "t"), style), eval_transform(image, 24, style))
    # crop, resampling and flip keep a constant image constant: CIFAR's and He et al.'s carry no colour change
    flat = Image.new("RGB", (40, 30), COLOUR)
    for style in ("cifar", "imagenet"):
        x = train_transform(flat, 24, True, generator(1, "t"), style)
        assert torch.allclose(x, normalised(COLOUR, style).expand(3, 24, 24), atol=1e-4), style
    assert not torch.allclose(train_transform(flat, 24, True, generator(1, "t"), "fewshot"),
                              normalised(COLOUR, "fewshot").expand(3, 24, 24), atol=1e-2)  # ImageJitter


def test_image_jitter_is_chen_et_al_s() -> None:
    """Brightness, contrast and colour in that order, each by 1 + strength * (2u - 1), u ~ U[0, 1)."""
    gray = Image.new("RGB", (4, 4), (100, 100, 100))
    assert np.array_equal(np.asarray(image_jitter(gray, generator(0, "j"), 0.0)), np.asarray(gray))
    factors = []
    for s in range(200):
        u = torch.rand(3, generator=generator(s, "j")).tolist()
        out = np.asarray(image_jitter(gray, generator(s, "j")))
        assert int(out[0, 0, 0]) == pytest.approx(min(255, 100 * (1 + 0.4 * (2 * u[0] - 1))), abs=1)  # brightness first
        factors.append(int(out[0, 0, 0]) / 100)
    assert 0.6 <= min(factors) < 0.7 and 1.3 < max(factors) <= 1.41


def test_unknown_style_is_refused() -> None:
    with pytest.raises(OwaiError, match="unknown image transform style 'bogus'"):
        eval_transform(Image.new("RGB", (8, 8)), 8, "bogus")


class _OneImage:
    name, domains, classes = "one", ["all"], ["a"]

    def size(self, domain: int) -> int:
        return 1

    def labels(self, domain: int) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.int64)

    def image(self, domain: int, index: int) -> Image.Image:
        return Image.new("RGB", (40, 30), COLOUR)


@pytest.mark.parametrize("views", [1, 2])
def test_step_batches_use_their_style(views: int) -> None:
    """Training batches (and SimSiam's views, whose jitter keeps a gray image gray) are normalised as
    their style says."""
    data = _OneImage()
    if views == 2:
        data.image = lambda domain, index: Image.new("RGB", (40, 30), (120, 120, 120))  # type: ignore[method-assign]
    batches = StepBatches(data, [0], [torch.zeros(1, dtype=torch.int64)], 2, 16, True, 0, 1, views=views, style="cifar")
    x, _, _ = batches[0]
    assert x.shape == (2 * views, 3, 16, 16)
    if views == 1:
        assert torch.allclose(x, normalised(COLOUR, "cifar").expand_as(x), atol=1e-4)
    else:  # a gray pixel v normalises to (v/255 - mean_c) / std_c: its channels tell the statistics apart
        v = x[:, :, 0, 0] * torch.tensor(CIFAR_STD) + torch.tensor(CIFAR_MEAN)
        assert torch.allclose(v, v[:, :1].expand_as(v), atol=1e-4)


def test_rich_features_thesis_transforms_by_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_classification_data import make_cifar10

    from owai.experiment import resolve
    from owai.methods.rich_features import load_split, pretrain_key
    from owai.recipes import load

    make_cifar10(tmp_path)
    monkeypatch.setenv("OWAI_DATA", str(tmp_path))
    local = ["stage=pretrain", "data.base=cifar10", "data.target=cifar10", "data.base_classes=[cat,dog]",
             "data.target_classes=[ship,truck]", "data.limit_per_class=1"]
    default = resolve(load("table2.1-weight-decay"), "cpu", local)[0]
    thesis = resolve(load("table2.1-weight-decay"), "cpu", [*local, "data.transforms=thesis"])[0]
    assert load_split(default, "cifar10", "train", []).style == "domainbed"
    cifar = load_split(thesis, "cifar10", "train", ["cat", "dog"])  # kept through the class subset and the limit
    assert cifar.style == "cifar" and len(cifar) == 2
    assert load_split(thesis, "mnist-t10k", "train", []).style == "domainbed"  # the digits keep DomainBed's
    # the pre-trained network's cache key: unchanged at the default, its own under the thesis's transforms
    digits = ["stage=pretrain", "data.base=mnist-t10k", "data.target=mnist-t10k"]
    assert (pretrain_key(resolve(load("table2.1-weight-decay"), "cpu", [*digits, "data.transforms=thesis"])[0], 0)
            == pretrain_key(resolve(load("table2.1-weight-decay"), "cpu", digits)[0], 0))
    assert pretrain_key(default, 0) != pretrain_key(thesis, 0)


def test_chapter_2_paper_presets_use_the_thesis_transforms() -> None:
    """Every rich-features recipe's paper preset; fig2.4-vit's takes RRL's ViT transforms (its
    checkpoints keep their own normalisation; docs/decisions.md)."""
    from owai.experiment import resolve
    from owai.recipes import available, load

    checked = 0
    for recipe in map(load, available()):
        if recipe.method != "rich_features" or "paper" not in recipe.presets:
            continue
        cfg = resolve(recipe, "paper", [], missing_ok=True)[0]
        assert cfg.data.transforms == ("vit" if recipe.id == "fig2.4-vit" else "thesis"), recipe.id
        checked += 1
    assert checked == 12


def test_every_rich_features_stage_reads_its_datasets_style(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Pre-training, distillation, probes, fine-tuning, the two-stage head and the few-shot episodes
    all transform their images in the style of the dataset they read. The packaged digits stand in
    for a CIFAR set here (TRANSFORM_STYLES patched), and every transform call is recorded."""
    from conftest import as_sets, cli_in_process
    from test_rich_features_stages import CHAIN, FEWSHOT, TINY

    from owai.data import domainbed
    from owai.methods import rich_features

    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(rich_features.TRANSFORM_STYLES, "mnist-t10k", "cifar")
    seen: list[tuple[str, str]] = []
    for name in ("train_transform", "eval_transform"):
        original = getattr(domainbed, name)

        def recording(*args, _original=original, _name=name, **kwargs):
            seen.append((_name, args[-1] if isinstance(args[-1], str) else kwargs.get("style", "domainbed")))
            return _original(*args, **kwargs)

        monkeypatch.setattr(domainbed, name, recording)
    common = ["-r", FEWSHOT, "-p", "cpu", "--seeds", "0,1", *as_sets([*TINY, "data.transforms=thesis"]), "-q"]
    for stage in ("pretrain", CHAIN):
        code, _, err = cli_in_process(["rich-features", "--stage", stage, *common, "-o", str(tmp_path / stage)], capsys)
        assert code == 0, err
    assert {name for name, _ in seen} == {"train_transform", "eval_transform"}
    assert {style for _, style in seen} == {"cifar"}, sorted(set(seen))


@pytest.mark.parametrize("style, smallest", [("cifar", 0.75), ("imagenet", 0.0)])
def test_training_crops_cover_the_style_s_area_fractions(style: str, smallest: float) -> None:
    """CIFAR's crops keep at least 80 % of the image (TH A.1); He et al.'s go down to 8 %."""
    image = coordinates(100, 100)
    areas = []
    for s in range(40):
        red, green = _unnormalised(train_transform(image, 100, True, generator(s, "crop"), style), style)[:2]
        width = abs(red[50, -1] - red[50, 0]).item() + 1
        height = abs(green[-1, 50] - green[0, 50]).item() + 1
        areas.append(width * height / 100**2)
    assert min(areas) > smallest
    if style == "imagenet":
        assert min(areas) < 0.5  # the wide scale range is used


def test_cifar_images_are_resized_bicubically() -> None:
    """A bicubic resize overshoots at a sharp edge (values beyond both sides); a bilinear one cannot."""
    step = np.full((32, 32, 3), 50, dtype=np.uint8)
    step[:, 16:] = 200
    image = Image.fromarray(step)
    cifar = _unnormalised(eval_transform(image, 32, "cifar"), "cifar")[0]
    imagenet = _unnormalised(eval_transform(image, 32, "imagenet"), "imagenet")[0]
    assert cifar.min() < 49 and cifar.max() > 201
    assert imagenet.min() > 49 and imagenet.max() < 201


def test_cifar_style_at_224_px_resizes_to_256() -> None:
    """RRL's CIFAR evaluation at 224 px: Resize(int(224 * 8 / 7)) = 256 bicubic, CenterCrop(224)
    (36 at 32 px, as TH A.1)."""
    from owai.data.images import BICUBIC, center_crop, resize_shorter, to_tensor

    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    expected = to_tensor(center_crop(resize_shorter(image, 256, BICUBIC), 224), "cifar")
    assert torch.equal(eval_transform(image, 224, "cifar"), expected)


def test_vit_style_is_rrls_vit384px() -> None:
    """RRL's ViT fine-tuning (vit384px): Resize(size) bicubic + CenterCrop(size) to evaluate;
    RandomResizedCrop(size) bicubic at torchvision's default scale + flip to train."""
    from owai.data.images import BICUBIC, center_crop, resize_shorter, to_tensor

    image = Image.fromarray(np.random.default_rng(2).integers(0, 256, (30, 40, 3), dtype=np.uint8))
    expected = to_tensor(center_crop(resize_shorter(image, 24, BICUBIC), 24), "vit")
    assert torch.equal(eval_transform(image, 24, "vit"), expected)
    a, b = (train_transform(image, 24, True, generator(0, "t"), "vit") for _ in range(2))
    assert torch.equal(a, b) and a.shape == (3, 24, 24)  # keyed by its generator
    assert not torch.equal(a, train_transform(image, 24, True, generator(1, "t"), "vit"))


def test_rich_features_vit_transforms_keep_the_digits_domainbed() -> None:
    from owai.methods.rich_features import Config, style_of

    cfg = Config()
    cfg.data.transforms = "vit"
    assert style_of(cfg, "imagenet") == "vit" and style_of(cfg, "cifar100") == "vit"
    assert style_of(cfg, "mnist") == "domainbed"
    cfg.data.transforms = "thesis"
    assert style_of(cfg, "imagenet") == "imagenet" and style_of(cfg, "cifar100") == "cifar"
