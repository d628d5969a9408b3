"""The DomainBed data layer: image-folder indexing and its error rules, splits, transforms,
step-keyed batches and RotatedMNIST on the real packaged MNIST test split."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from domainbed_tree import code_colour, make_tree
from PIL import Image

from owai.data.domainbed import (
    DATASET_DIRS,
    DOMAINBED,
    CachedEval,
    ImageFolderDomains,
    RotatedMNIST,
    StepBatches,
    _adjust_hue,
    domainbed_dataset,
    eval_batches,
    random_resized_crop_params,
    split_domain,
    train_transform,
)
from owai.data.images import IMAGENET_MEAN, IMAGENET_STD, eval_transform, step_loader
from owai.data.mnist import load_mnist
from owai.errors import OwaiError
from owai.runtime import generator

MEAN = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)


def unnormalise(x: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) normalised -> uint8-valued float (rounded) pixel values."""
    return ((x * STD + MEAN) * 255).round()


@pytest.fixture(scope="module")
def mnist():
    return load_mnist("test")


# ------------------------------------------------------------------------------- ImageFolderDomains

def test_listing_sorted_sizes_and_labels(tmp_path: Path) -> None:
    make_tree(tmp_path, domains=("zeta", "alpha", "mid"), classes=("dog", "cat"), per_class=4)
    (tmp_path / "alpha" / "cat" / "notes.txt").write_text("not an image")
    Image.new("RGB", (8, 8), (1, 2, 3)).save(tmp_path / "mid" / "dog" / "UPPER.PNG")
    ds = ImageFolderDomains(tmp_path, name="toy")
    assert ds.domains == ["alpha", "mid", "zeta"]
    assert ds.classes == ["cat", "dog"]
    assert [ds.size(d) for d in range(3)] == [8, 9, 8]
    assert ds.skipped == 0
    for d, domain in enumerate(ds.domains):
        labels = ds.labels(d)
        assert labels.dtype == torch.int64 and labels.shape == (ds.size(d),)
        paths = [ds.path(d, i) for i in range(ds.size(d))]
        assert paths == sorted(paths)
        for i, path in enumerate(paths):
            assert path.parent.parent.name == domain
            assert ds.classes[int(labels[i])] == path.parent.name
    img = ds.image(0, 3)
    assert img.mode == "RGB"
    with Image.open(ds.path(0, 3)) as ref:
        assert np.array_equal(np.asarray(img), np.asarray(ref.convert("RGB")))
    again = pickle.loads(pickle.dumps(ds))
    assert np.array_equal(np.asarray(again.image(1, 2)), np.asarray(ds.image(1, 2)))
    assert torch.equal(again.labels(2), ds.labels(2))


def test_given_domain_list_keeps_its_order(tmp_path: Path) -> None:
    make_tree(tmp_path, per_class=2)
    ds = ImageFolderDomains(tmp_path, domains=["d2", "d0"])
    assert ds.domains == ["d2", "d0"]
    assert ds.path(0, 0).parent.parent.name == "d2"
    with pytest.raises(OwaiError, match="d9"):
        ImageFolderDomains(tmp_path, domains=["d0", "d9"])


def test_corrupt_files_are_skipped_and_counted(tmp_path: Path) -> None:
    make_tree(tmp_path, per_class=3, corrupt=5)
    ds = ImageFolderDomains(tmp_path)
    assert ds.skipped == 5
    assert [ds.size(d) for d in range(3)] == [6, 6, 6]
    names = {ds.path(d, i).name for d in range(3) for i in range(ds.size(d))}
    assert not any(n.startswith("corrupt") for n in names)


def test_root_errors(tmp_path: Path) -> None:
    with pytest.raises(OwaiError, match="does not exist"):
        ImageFolderDomains(tmp_path / "nowhere")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(OwaiError, match="not a directory"):
        ImageFolderDomains(tmp_path / "file.txt")
    make_tree(tmp_path / "one", domains=("only",), per_class=2)
    with pytest.raises(OwaiError, match="domain"):
        ImageFolderDomains(tmp_path / "one")


def test_domain_without_images(tmp_path: Path) -> None:
    make_tree(tmp_path, domains=("d0", "d1"), per_class=2)
    for cls in ("a", "b"):
        for f in (tmp_path / "d1" / cls).iterdir():
            f.unlink()
    (tmp_path / "d1" / "a" / "bad.jpg").write_bytes(b"garbage")
    with pytest.raises(OwaiError, match=r"'d1'.*no readable images.*1 unreadable"):
        ImageFolderDomains(tmp_path)


def test_mismatching_class_folders(tmp_path: Path) -> None:
    make_tree(tmp_path, per_class=2)
    make_tree(tmp_path / "d1", domains=("c",), classes=("x",), per_class=1)  # d1/c/x/img -> class "c"
    with pytest.raises(OwaiError, match=r"'d1'.*extra \['c'\]"):
        ImageFolderDomains(tmp_path)
    (tmp_path / "d2" / "b").rename(tmp_path / "d2" / "bb")
    with pytest.raises(OwaiError, match=r"missing \['b'\]"):
        ImageFolderDomains(tmp_path, domains=["d0", "d2"])


def test_file_corrupted_after_indexing(tmp_path: Path) -> None:
    make_tree(tmp_path, per_class=2)
    ds = ImageFolderDomains(tmp_path)
    path = ds.path(1, 2)
    path.write_bytes(b"garbage now")
    with pytest.raises(OwaiError, match=path.name):
        ds.image(1, 2)
    ds.image(1, 1)  # the others still decode


# ------------------------------------------------------------------------------------ domainbed_dataset

def test_domainbed_dataset(tmp_path: Path) -> None:
    with pytest.raises(OwaiError, match="pacs.*vlcs.*office_home.*terra_incognita"):
        domainbed_dataset("imagenet", tmp_path)
    make_tree(tmp_path / DATASET_DIRS["office_home"], domains=DOMAINBED["office_home"], per_class=1)
    ds = domainbed_dataset("office_home", tmp_path)
    assert ds.domains == ["Art", "Clipart", "Product", "Real World"] and ds.name == "office_home"
    assert domainbed_dataset("office_home", tmp_path / "office_home").domains == ds.domains  # root holds domains
    make_tree(tmp_path / "PACS", domains=("art_painting", "cartoon", "photo", "extra"), per_class=1)
    with pytest.raises(OwaiError, match="sketch"):
        domainbed_dataset("pacs", tmp_path)
    with pytest.raises(OwaiError, match="VLCS"):
        domainbed_dataset("vlcs", tmp_path)


# ---------------------------------------------------------------------------------------- split_domain

def test_split_domain() -> None:
    n = 103
    ins, out = split_domain(n, 0.2, trial_seed=0, domain=1)
    assert ins.dtype == out.dtype == torch.int64
    assert len(out) == int(0.2 * n) == 20 and len(ins) == n - 20
    assert sorted(torch.cat([ins, out]).tolist()) == list(range(n))
    assert not set(ins.tolist()) & set(out.tolist())
    again = split_domain(n, 0.2, 0, 1)
    assert torch.equal(again[0], ins) and torch.equal(again[1], out)
    assert not torch.equal(split_domain(n, 0.2, 0, 2)[1], out)
    assert not torch.equal(split_domain(n, 0.2, 1, 1)[1], out)
    assert len(split_domain(n, 0.0, 0, 0)[1]) == 0
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(OwaiError, match="holdout_fraction"):
            split_domain(n, bad, 0, 0)


@pytest.mark.parametrize("trial_seed, domain, n, seed, out_head, in_head", [
    # reference values from DomainBed's own misc.split_dataset / misc.seed_hash (verylarge_dropout's
    # copy, run on list(range(n)) as trainv2.py splits each environment), VLCS's domain sizes
    (0, 0, 1415, 894182419, [222, 1032, 864, 859, 1037, 1062], [508, 1125, 317, 633]),
    (0, 3, 3376, 1796103049, [354, 3010, 2738, 1425, 2880, 1429], [2044, 1530, 635, 1159]),
    (1, 2, 2656, 1981683110, [1971, 1833, 2080, 2015, 2032, 615], [2528, 575, 74, 1855]),
])
def test_split_domain_is_domainbeds_own(trial_seed, domain, n, seed, out_head, in_head) -> None:
    from owai.data.domainbed import domainbed_seed

    assert domainbed_seed(trial_seed, domain) == seed
    ins, out = split_domain(n, 0.2, trial_seed, domain)
    assert len(out) == int(n * 0.2) and out[:6].tolist() == out_head and ins[:4].tolist() == in_head


# ------------------------------------------------------------------------------------------ transforms

def test_eval_transform_of_constant_colour() -> None:
    colour = (200, 100, 50)
    x = eval_transform(Image.new("RGB", (30, 20), colour), 16)
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32
    expected = (torch.tensor(colour) / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    assert torch.allclose(x, expected.view(3, 1, 1).expand(3, 16, 16), atol=1e-5)
    gray = eval_transform(Image.new("L", (8, 8), 128), 8)  # non-RGB input is converted
    assert gray.shape == (3, 8, 8)


def test_train_transform_reproducible() -> None:
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8))
    a = train_transform(img, 24, True, generator(0, "t"))
    b = train_transform(img, 24, True, generator(0, "t"))
    c = train_transform(img, 24, True, generator(1, "t"))
    assert a.shape == (3, 24, 24) and a.dtype == torch.float32
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(train_transform(img, 24, False, generator(0, "t")), eval_transform(img, 24))


def test_augment_flip_and_grayscale_rates() -> None:
    colourful = Image.new("RGB", (20, 20), (220, 40, 40))
    halves = Image.new("RGB", (20, 20), (200, 200, 200))
    halves.paste((30, 30, 30), (0, 0, 10, 20))  # gray: jitter keeps "left darker than right" unless flipped
    n, gray, flipped = 300, 0, 0
    for s in range(n):
        x = unnormalise(train_transform(colourful, 20, True, generator("gray", s))[None])[0]
        gray += bool((x[0] == x[1]).all() and (x[1] == x[2]).all())
        x = unnormalise(train_transform(halves, 20, True, generator("flip", s))[None])[0]
        flipped += bool(x[:, :, :3].mean() > x[:, :, -3:].mean())
    assert 0.03 < gray / n < 0.2  # RandomGrayscale(0.1)
    assert 0.35 < flipped / n < 0.65  # RandomHorizontalFlip(0.5)


def test_hue_shift_direction() -> None:
    red = Image.new("RGB", (4, 4), (255, 0, 0))
    r, g, b = np.asarray(_adjust_hue(red, 1 / 3))[0, 0].astype(int)
    assert g > 200 and r < 60 and b < 60  # a third of the hue circle: red -> green
    r, g, b = np.asarray(_adjust_hue(red, -1 / 3))[0, 0].astype(int)
    assert b > 200 and r < 60 and g < 60  # and backwards: red -> blue


def test_random_resized_crop_params() -> None:
    for width, height in ((1000, 800), (300, 500)):
        for s in range(300):
            top, left, h, w = random_resized_crop_params(width, height, generator("crop", width, s))
            assert 0 <= top and top + h <= height and 0 <= left and left + w <= width
            assert 0.7 - 0.005 <= h * w / (width * height) <= 1.0
            assert 3 / 4 - 0.01 <= w / h <= 4 / 3 + 0.01
    # square image: a try with area fraction a and log-uniform ratio r is accepted iff a <= r <= 1/a,
    # with probability p(a) = min(1, -log(a) / log(4/3)); the accepted a has density ~ p(a) on [0.7, 1]
    a = np.linspace(0.7, 1.0, 30001)
    p = np.minimum(1.0, -np.log(a) / np.log(4 / 3))
    expected = (a * p).sum() / p.sum()
    areas = []
    for s in range(2000):
        top, left, h, w = random_resized_crop_params(1000, 1000, generator("square", s))
        areas.append(h * w / 1e6)
    assert abs(np.mean(areas) - expected) < 0.006, (np.mean(areas), expected)
    # fallback: no admissible crop of a very wide/tall image -> central crop at the extreme ratio
    assert random_resized_crop_params(1000, 10, generator(0)) == (0, (1000 - 13) // 2, 10, 13)
    assert random_resized_crop_params(10, 1000, generator(0)) == ((1000 - 13) // 2, 0, 13, 10)


# ------------------------------------------------------------------------------------------- batches

def _code_lookup(ds: ImageFolderDomains) -> dict[tuple[int, int, int], tuple[int, int]]:
    """colour -> (domain, index) for a pattern="code" tree, from the file paths."""
    lookup = {}
    for d in range(len(ds.domains)):
        for i in range(ds.size(d)):
            path = ds.path(d, i)
            di, ci = int(path.parent.parent.name[1:]), ds.classes.index(path.parent.name)
            lookup[code_colour(di, ci, int(path.stem[3:]))] = (d, i)
    return lookup


def test_step_batches_draw_from_the_in_split(tmp_path: Path) -> None:
    make_tree(tmp_path, classes=("a", "b", "c"), per_class=8, pattern="code")
    ds = ImageFolderDomains(tmp_path)
    train = [2, 0]
    splits = {d: split_domain(ds.size(d), 0.5, 0, d) for d in train}
    batches = StepBatches(ds, train, [splits[d][0] for d in train], 32, 20, False, seed=3, steps=5)
    lookup = _code_lookup(ds)
    assert len(batches) == 5
    for step in range(5):
        x, y, d = batches[step]
        assert x.shape == (64, 3, 20, 20) and x.dtype == torch.float32
        assert y.dtype == d.dtype == torch.int64
        assert d.tolist() == [0] * 32 + [1] * 32
        colours = unnormalise(x)[:, :, 0, 0].long().tolist()
        for colour, label, k in zip(colours, y.tolist(), d.tolist()):
            domain, index = lookup[tuple(colour)]
            assert domain == train[k]
            assert index in set(splits[domain][0].tolist())  # never from the out split
            assert label == int(ds.labels(domain)[index])
    x0, y0, _ = batches[1]
    x1, y1, _ = batches[1]
    assert torch.equal(x0, x1) and torch.equal(y0, y1)
    assert not torch.equal(batches[2][0], x0)
    with pytest.raises(IndexError):
        batches[5]


def test_step_loader_workers_and_resume(tmp_path: Path) -> None:
    make_tree(tmp_path, per_class=4, size=24)
    ds = ImageFolderDomains(tmp_path)
    idx = [split_domain(ds.size(d), 0.2, 0, d)[0] for d in (0, 1)]
    batches = StepBatches(ds, [0, 1], idx, 6, 16, True, seed=0, steps=5)
    serial = list(step_loader(batches, 0))
    assert len(serial) == 5
    parallel = list(step_loader(batches, 0, workers=2))
    resumed = list(step_loader(batches, 3))
    assert len(resumed) == 2
    for got, ref in zip(parallel + resumed, serial + serial[3:]):
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert not torch.equal(serial[0][0], serial[1][0])


def test_loaders_leave_the_global_random_stream_alone(tmp_path: Path) -> None:
    """Starting a loader (an evaluation, a resume) must not shift the training's dropout masks."""
    make_tree(tmp_path, per_class=4, size=24)
    ds = ImageFolderDomains(tmp_path)
    idx = [split_domain(ds.size(d), 0.2, 0, d)[0] for d in (0, 1)]
    batches = StepBatches(ds, [0, 1], idx, 2, 16, False, seed=0, steps=2)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    next(iter(step_loader(batches, 0)))
    next(iter(eval_batches(ds, 0, idx[0], 16, batch_size=4)))
    assert torch.equal(torch.rand(3), expected)


def test_augmentation_is_keyed_by_step_domain_and_slot(tmp_path: Path) -> None:
    make_tree(tmp_path, per_class=2, size=24)
    ds = ImageFolderDomains(tmp_path)
    batches = StepBatches(ds, [1], [torch.tensor([3])], 4, 16, True, seed=7, steps=3)  # one usable example
    x0, y0, _ = batches[0]
    x1, _, _ = batches[1]
    assert torch.equal(y0, ds.labels(1)[[3, 3, 3, 3]])
    assert not torch.equal(x0[0], x0[1]) and not torch.equal(x0[0], x1[0])
    expected = train_transform(ds.image(1, 3), 16, True, generator(7, "augment", 1, 1, 2))
    assert torch.equal(x1[2], expected)


def test_step_batches_errors(tmp_path: Path) -> None:
    make_tree(tmp_path, per_class=2)
    ds = ImageFolderDomains(tmp_path)
    with pytest.raises(OwaiError, match="outside"):
        StepBatches(ds, [0], [torch.tensor([0, 4])], 2, 8, False, 0, 1)
    with pytest.raises(OwaiError, match="no training examples"):
        StepBatches(ds, [0], [torch.tensor([], dtype=torch.long)], 2, 8, False, 0, 1)
    with pytest.raises(OwaiError, match="index sets"):
        StepBatches(ds, [0, 1], [torch.tensor([0])], 2, 8, False, 0, 1)


def test_cached_eval_equals_eval_batches(tmp_path: Path) -> None:
    make_tree(tmp_path, per_class=5, size=18)
    ds = ImageFolderDomains(tmp_path)
    _, out = split_domain(ds.size(1), 0.6, 0, 1)
    ref = list(eval_batches(ds, 1, out, 16, batch_size=4))
    assert [len(y) for _, y in ref] == [4, 2]
    assert torch.equal(torch.cat([y for _, y in ref]), ds.labels(1)[out])
    first = eval_transform(ds.image(1, int(out[0])), 16)
    assert torch.equal(ref[0][0][0], first)
    cached = CachedEval(ds, 1, out, 16, batch_size=4)
    got = list(cached.batches())
    assert len(got) == len(ref)
    for (x, y), (rx, ry) in zip(got, ref):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    assert list(cached.batches())[1][1].shape == (2,)  # reusable


# -------------------------------------------------------------------------------------- RotatedMNIST

def test_rotated_mnist(mnist) -> None:
    rm = RotatedMNIST(mnist, [0, 30, 90], per_domain=400, pool=1000, seed=1)
    assert rm.domains == ["rot0", "rot30", "rot90"] and rm.classes == [str(c) for c in range(10)]
    assert [rm.size(d) for d in range(3)] == [400, 400, 400]
    used = [set(s.tolist()) for s in rm.source_indices] + [set(rm.pool_indices.tolist())]
    assert sum(len(u) for u in used) == len(set().union(*used)) == 2200  # all disjoint
    order = torch.randperm(len(mnist), generator=generator(1, "rotated-mnist", "order"))
    assert torch.equal(rm.source_indices[1], order[1001::3][:400])
    for d, src in enumerate(rm.source_indices):
        assert torch.equal(rm.labels(d), mnist.labels[src])
    assert torch.equal(rm.images(0), mnist.images[rm.source_indices[0]])
    orig90 = mnist.images[rm.source_indices[2]].int()
    diff = (rm.images(2).int() - torch.rot90(orig90, 1, dims=(1, 2))).abs()
    wrong = (rm.images(2).int() - torch.rot90(orig90, -1, dims=(1, 2))).abs()
    assert diff.max() <= 1 and wrong.float().mean() > 10  # counter-clockwise, as PIL/torchvision
    orig30 = mnist.images[rm.source_indices[1]].float()
    rot30 = rm.images(1).float()
    assert (rot30 - orig30).abs().mean() > 10
    assert abs(rot30.sum() / orig30.sum() - 1) < 0.1  # bilinear rotation keeps the ink (digits stay inside)
    img = rm.image(2, 7)
    assert img.mode == "RGB" and img.size == (28, 28)
    arr = np.asarray(img)
    assert (arr == rm.images(2)[7].numpy()[:, :, None]).all()
    pool = rm.pretraining_pool()
    assert pool.domains == ["upright"] and pool.size(0) == 1000
    assert torch.equal(pool.images(0), mnist.images[rm.pool_indices])
    assert torch.equal(pool.labels(0), mnist.labels[rm.pool_indices])
    assert not torch.equal(RotatedMNIST(mnist, [0, 15], 50, seed=2).source_indices[0], rm.source_indices[0][:50])


def test_rotated_mnist_errors_and_batches(mnist) -> None:
    with pytest.raises(OwaiError, match="per_domain"):
        RotatedMNIST(mnist, [0, 15], per_domain=0)
    with pytest.raises(OwaiError, match="angles"):
        RotatedMNIST(mnist, [0], per_domain=10)
    with pytest.raises(OwaiError, match="11000"):
        RotatedMNIST(mnist, [0, 15, 30], per_domain=2000, pool=5000)
    rm = RotatedMNIST(mnist, [0, 45], per_domain=30)
    assert rm.domains == ["rot0", "rot45"]
    with pytest.raises(OwaiError, match="pool"):
        rm.pretraining_pool()
    batches = StepBatches(rm, [1], [torch.arange(30)], 8, 28, False, 0, 2)
    x, y, _ = batches[0]
    assert x.shape == (8, 3, 28, 28)
    assert torch.equal(unnormalise(x)[:, 0], unnormalise(x)[:, 2])  # gray replicated to RGB
    assert torch.equal(y, rm.labels(1)[:30][torch.randint(30, (8,), generator=generator(0, "batch", 0, 1))])
    assert pickle.loads(pickle.dumps(rm)).images(1).equal(rm.images(1))
