"""MNIST IDX reading and the ColoredMNIST / InverseColoredMNIST construction (spec §1)."""

from __future__ import annotations

import gzip
import math
import shutil
from pathlib import Path

import pytest
import torch

from owai.data import colored_mnist as cm
from owai.data import mnist as mn
from owai.errors import OwaiError

SHARED = mn.default_mnist_dir()
needs_mnist = pytest.mark.skipif(
    SHARED is None or not (SHARED / "t10k-images-idx3-ubyte.gz").is_file(), reason="shared MNIST test split not present"
)


@pytest.fixture(scope="module")
def t10k() -> mn.MNIST:
    if SHARED is None:
        pytest.skip("shared MNIST test split not present")
    return mn.load_mnist_idx(SHARED, "test")


def one_line_error(excinfo: pytest.ExceptionInfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


# --- IDX reader -----------------------------------------------------------------------------------


@needs_mnist
def test_reads_shared_test_split(t10k):
    assert t10k.images.shape == (10000, 28, 28) and t10k.images.dtype == torch.uint8
    assert t10k.labels.shape == (10000,) and t10k.labels.dtype == torch.int64
    assert sorted(t10k.labels.unique().tolist()) == list(range(10))
    assert t10k.labels[:5].tolist() == [7, 2, 1, 0, 4]  # the well-known first t10k digits
    assert int(t10k.images.max()) == 255 and int(t10k.images.min()) == 0
    # every class has roughly a tenth of the images
    counts = torch.bincount(t10k.labels, minlength=10)
    assert int(counts.min()) > 850 and int(counts.max()) < 1150


@needs_mnist
def test_raw_and_gzip_agree_and_md5(tmp_path, t10k):
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (tmp_path / name).write_bytes(gzip.decompress((SHARED / f"{name}.gz").read_bytes()))
    raw = mn.load_mnist_idx(tmp_path, "test")
    assert torch.equal(raw.images, t10k.images) and torch.equal(raw.labels, t10k.labels)
    # the shared files are the official ones, compressed and raw
    mn.load_mnist_idx(SHARED, "test", check_md5=True)
    mn.load_mnist_idx(tmp_path, "test", check_md5=True)
    labels = gzip.decompress((SHARED / "t10k-labels-idx1-ubyte.gz").read_bytes())
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(  # a re-labelled raw copy is not
        labels[:-1] + bytes([(labels[-1] + 1) % 10]))
    with pytest.raises(OwaiError) as exc:
        mn.load_mnist_idx(tmp_path, "test", check_md5=True)
    assert "md5" in one_line_error(exc)


def _copy_t10k(tmp_path: Path) -> Path:
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        shutil.copy(SHARED / name, tmp_path / name)
        (tmp_path / name).chmod(0o644)
    return tmp_path


@needs_mnist
def test_truncated_gzip_is_a_one_line_error(tmp_path):
    d = _copy_t10k(tmp_path)
    path = d / "t10k-images-idx3-ubyte.gz"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(OwaiError) as exc:
        mn.load_mnist_idx(d, "test")
    assert "t10k-images-idx3-ubyte.gz" in one_line_error(exc)


@needs_mnist
def test_truncated_payload_bad_magic_and_md5_mismatch(tmp_path):
    d = _copy_t10k(tmp_path)
    path = d / "t10k-images-idx3-ubyte.gz"
    payload = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(payload[:-100], compresslevel=1))
    with pytest.raises(OwaiError) as exc:
        mn.load_mnist_idx(d, "test")
    assert "truncated" in one_line_error(exc) and str(path) in str(exc.value)
    with pytest.raises(OwaiError) as exc:  # a re-compressed file of other content is not the official one
        mn.load_mnist_idx(d, "test", check_md5=True)
    assert "md5" in one_line_error(exc)

    path.write_bytes(gzip.compress(b"\x00\x00\x08\x01" + payload[4:], compresslevel=1))  # labels magic on an images file
    with pytest.raises(OwaiError) as exc:
        mn.load_mnist_idx(d, "test")
    assert "magic" in one_line_error(exc) and "t10k-images" in str(exc.value)


@needs_mnist
def test_count_mismatch_and_bad_label(tmp_path):
    d = _copy_t10k(tmp_path)
    lab = d / "t10k-labels-idx1-ubyte.gz"
    payload = bytearray(gzip.decompress(lab.read_bytes()))
    short = bytes(payload[:4]) + (9999).to_bytes(4, "big") + bytes(payload[8:-1])
    lab.write_bytes(gzip.compress(short, compresslevel=1))
    with pytest.raises(OwaiError) as exc:
        mn.load_mnist_idx(d, "test")
    assert "9999 labels" in one_line_error(exc)
    payload[8] = 12
    lab.write_bytes(gzip.compress(bytes(payload), compresslevel=1))
    with pytest.raises(OwaiError) as exc:
        mn.load_mnist_idx(d, "test")
    assert "outside 0..9" in one_line_error(exc)


def test_missing_directory_and_files(tmp_path, monkeypatch):
    with pytest.raises(OwaiError) as exc:
        mn.load_mnist_idx(tmp_path / "nope", "test")
    assert "does not exist" in one_line_error(exc)
    with pytest.raises(OwaiError) as exc:
        mn.load_mnist_idx(tmp_path, "train")
    assert "train-images-idx3-ubyte" in one_line_error(exc)
    with pytest.raises(OwaiError):
        mn.load_mnist_idx(tmp_path, "validation")
    with pytest.raises(OwaiError) as exc:
        mn.load_mnist("test", root=tmp_path / "elsewhere")  # an explicit root is authoritative
    msg = one_line_error(exc)
    assert "elsewhere" in msg and "owai data fetch mnist" in msg


def test_hub_path_without_network(monkeypatch, no_data):
    """The `ylecun/mnist` path, with `datasets.load_dataset` replaced (no network in tests)."""
    import datasets
    from PIL import Image

    calls = []

    def fake_load(hub_id, split):
        calls.append((hub_id, split))
        imgs = [Image.fromarray(torch.full((28, 28), 10 * k, dtype=torch.uint8).numpy()) for k in range(3)]
        return {"image": imgs, "label": [3, 1, 4]}

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    got = mn.load_mnist("train", hub_id="ylecun/mnist")
    assert calls == [("ylecun/mnist", "train")]
    assert got.images.shape == (3, 28, 28) and got.images.dtype == torch.uint8
    assert got.images[2, 5, 5].item() == 20 and got.labels.tolist() == [3, 1, 4] and got.source == "hf:ylecun/mnist"

    def offline(hub_id, split):
        raise ConnectionError("Couldn't reach 'ylecun/mnist' on the Hub\n(LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(OwaiError) as exc:
        mn.load_mnist("test", hub_id="ylecun/mnist")
    assert "Couldn't reach" in one_line_error(exc)


@needs_mnist
def test_explicit_directory_wins_over_hub_id(monkeypatch, t10k):
    """A recipe naming the hub (the paper presets) runs from a local copy given as data.root."""
    import datasets

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub must not be asked when a directory is given")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    got = mn.load_mnist("test", root=SHARED, hub_id="ylecun/mnist")
    assert torch.equal(got.labels, t10k.labels) and got.source == str(SHARED)


def test_default_dir_is_the_data_root_else_the_packaged_copy(monkeypatch, no_data, tmp_path):
    """No data anywhere: the test split comes from the package, the training split is an error
    naming the fetch command; $OWAI_DATA/mnist wins once it holds the files."""
    assert mn.default_mnist_dir() == mn.PACKAGED_DIR
    with pytest.raises(OwaiError) as exc:
        mn.mnist_dir("train")
    assert "owai data fetch mnist" in one_line_error(exc)
    (tmp_path / "data" / "mnist").mkdir(parents=True)
    for f in mn.PACKAGED_DIR.glob("t10k-*"):
        shutil.copy(f, tmp_path / "data" / "mnist" / f.name)
    monkeypatch.setenv("OWAI_DATA", str(tmp_path / "data"))
    assert mn.default_mnist_dir() == tmp_path / "data" / "mnist"


def test_packaged_copy_is_the_official_test_split():
    import hashlib

    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        digest = hashlib.md5((mn.PACKAGED_DIR / name).read_bytes()).hexdigest()  # noqa: S324
        assert digest == mn.OFFICIAL_MD5[name]
    data = mn.load_mnist("test", root=mn.PACKAGED_DIR)
    assert len(data) == 10_000 and tuple(data.images.shape[1:]) == (28, 28)


# --- ColoredMNIST on the offline t10k split -------------------------------------------------------


def _sigma_tol(p: float, n: int) -> float:
    """5 binomial standard deviations: a rate test that a correct builder fails ~never."""
    return 5 * math.sqrt(p * (1 - p) / n)


def _check_rates(data: cm.ColoredMNIST) -> None:
    noise = data.variant.label_noise
    flips = list(data.variant.train_flips) + list(cm.TEST_FLIPS)
    for env, flip in zip(data.train + data.test, flips):
        n = len(env)
        clean = (env.digit < 5).float()
        label_agree = float((env.y == clean).float().mean())
        color_agree = float((env.color.float() == env.y).float().mean())
        assert abs(label_agree - (1 - noise)) < _sigma_tol(noise, n), (env.name, label_agree)
        assert abs(color_agree - (1 - flip)) < _sigma_tol(flip, n), (env.name, color_agree)
        assert env.color_flip == flip and env.label_noise == noise


@needs_mnist
@pytest.mark.parametrize("name", ["coloredmnist", "inverse-coloredmnist", "coloredmnist-gray", "coloredmnist01gray"])
def test_t10k_shapes_sizes_and_rates(t10k, name):
    data = cm.build_colored_mnist(t10k.images, t10k.labels, name, seed=0, split="t10k")
    assert [e.name for e in data.train] == ["train1", "train2"]
    assert [e.name for e in data.test] == ["test1", "test2", "test3"]
    assert [len(e) for e in data.train] == [4000, 4000]
    assert [len(e) for e in data.test] == [2000, 2000, 2000]
    for env in data.train + data.test:
        assert env.x.shape == (len(env), 2, 14, 14) and env.x.dtype == torch.float32
        assert env.y.dtype == torch.float32 and set(env.y.unique().tolist()) <= {0.0, 1.0}
        assert env.flat().shape == (len(env), 392)
        assert float(env.x.min()) >= 0 and float(env.x.max()) <= 1
    _check_rates(data)


@needs_mnist
def test_spec_rate_table_pooled_over_seeds(t10k):
    """Spec §10.4: label-digit 0.75 / colour-label 0.9, 0.8 (train), 0.1, 0.9, 0.5 (test), each +-1 %
    (pooled over 4 seeds: 32 000 training and 8 000 test draws per environment slot)."""
    for name, label_rate, color_rates in (
        ("coloredmnist", 0.75, (0.9, 0.8, 0.1, 0.9, 0.5)),
        ("inverse-coloredmnist", 0.9, (0.8, 0.75, 0.1, 0.9, 0.5)),
    ):
        envs_by_seed = [cm.build_colored_mnist(t10k.images, t10k.labels, name, s, "t10k") for s in range(4)]
        for slot in range(5):
            envs = [(d.train + d.test)[slot] for d in envs_by_seed]
            y = torch.cat([e.y for e in envs])
            digit = torch.cat([e.digit for e in envs])
            color = torch.cat([e.color for e in envs]).float()
            assert abs(float((y == (digit < 5).float()).float().mean()) - label_rate) < 0.01
            assert abs(float((color == y).float().mean()) - color_rates[slot]) < 0.015


@needs_mnist
def test_pixels_come_from_the_indexed_images(t10k):
    data = cm.build_colored_mnist(t10k.images, t10k.labels, "coloredmnist", seed=3, split="t10k")
    small = t10k.images[:, ::2, ::2].float() / 255
    env1, env2 = data.train
    for env, idx in ((env1, data.train_indices[0::2]), (env2, data.train_indices[1::2]), (data.test[0], data.test_indices)):
        rows = torch.arange(len(env))
        assert torch.equal(env.x[rows, env.color], small[idx])  # the digit sits in channel `color`
        assert float(env.x[rows, 1 - env.color].abs().sum()) == 0.0  # the other channel is zero
        assert torch.equal(env.digit, t10k.labels[idx])


@needs_mnist
def test_train_and_test_images_are_disjoint(t10k):
    for seed in (0, 1):
        data = cm.build_colored_mnist(t10k.images, t10k.labels, "coloredmnist", seed=seed, split="t10k")
        train = set(data.train_indices.tolist())
        test = set(data.test_indices.tolist())
        assert not train & test and len(train) == 8000 and len(test) == 2000
        assert train | test == set(range(10000))
        assert test == {i for i in range(10000) if i % 5 == 4}  # the documented rule, seed-free
        # by content too: no 28x28 training image equals a test image
        tr = {bytes(t10k.images[i].numpy()) for i in train}
        assert not any(bytes(t10k.images[i].numpy()) in tr for i in test)


@needs_mnist
def test_train_size_keeps_the_first_shuffled_training_images(t10k):
    full = cm.build_colored_mnist(t10k.images, t10k.labels, "coloredmnist", seed=4, split="t10k")
    part = cm.build_colored_mnist(t10k.images, t10k.labels, "coloredmnist", seed=4, split="t10k", train_size=1000)
    assert [len(e) for e in part.train] == [500, 500] and [len(e) for e in part.test] == [2000] * 3
    assert torch.equal(part.train_indices, full.train_indices[:1000])
    assert torch.equal(part.train[0].digit, t10k.labels[full.train_indices[:1000:2]])
    for a, b in zip(part.test, full.test):  # the test environments do not change
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    for bad in (1, 8001, 2.5, True):
        with pytest.raises(OwaiError) as err:
            cm.build_colored_mnist(t10k.images, t10k.labels, "coloredmnist", seed=4, split="t10k", train_size=bad)
        assert "train_size must be an integer from 2 to the 8000 training images" in one_line_error(err)


@needs_mnist
def test_deterministic_per_seed(t10k):
    a = cm.build_colored_mnist(t10k.images, t10k.labels, "coloredmnist", seed=5, split="t10k")
    b = cm.build_colored_mnist(t10k.images, t10k.labels, "coloredmnist", seed=5, split="t10k")
    c = cm.build_colored_mnist(t10k.images, t10k.labels, "coloredmnist", seed=6, split="t10k")
    for ea, eb, ec in zip(a.train + a.test, b.train + b.test, c.train + c.test):
        assert torch.equal(ea.x, eb.x) and torch.equal(ea.y, eb.y)
        assert not torch.equal(ea.y, ec.y)
    assert torch.equal(a.train_indices, b.train_indices)
    assert not torch.equal(a.train_indices, c.train_indices)
    assert torch.equal(a.test_indices, c.test_indices)


@needs_mnist
def test_gray_variants(t10k):
    col = cm.build_colored_mnist(t10k.images, t10k.labels, "coloredmnist", seed=2, split="t10k")
    gray = cm.build_colored_mnist(t10k.images, t10k.labels, "coloredmnist-gray", seed=2, split="t10k")
    pure = cm.build_colored_mnist(t10k.images, t10k.labels, "coloredmnist-gray", seed=2, split="t10k", grayscale=True)
    for ec, eg, ep in zip(col.train, gray.train, pure.train):
        # same seed: same images and labels as the coloured variant, colour now uninformative
        assert torch.equal(ec.y, eg.y) and torch.equal(ec.digit, eg.digit)
        assert abs(float((eg.color.float() == eg.y).float().mean()) - 0.5) < _sigma_tol(0.5, len(eg))
        rows = torch.arange(len(eg))
        assert float(eg.x[rows, 1 - eg.color].abs().sum()) == 0.0  # RFC's gray still zeroes a channel
        # the grayscale option: identical channels, same labels
        assert torch.equal(ep.x[:, 0], ep.x[:, 1]) and torch.equal(ep.y, eg.y)
        assert torch.equal(ep.x[:, 0], eg.x.sum(dim=1))


@needs_mnist
def test_worst_accuracy_of_a_colour_predictor(t10k):
    data = cm.build_colored_mnist(t10k.images, t10k.labels, "coloredmnist", seed=0, split="t10k")

    def by_colour(x: torch.Tensor) -> torch.Tensor:
        return x[:, 1].sum(dim=(1, 2)) - x[:, 0].sum(dim=(1, 2))  # logit > 0 iff channel 1 is lit

    worst, accs = cm.worst_accuracy(by_colour, data.test)
    assert worst == min(accs)
    for acc, flip in zip(accs, cm.TEST_FLIPS):
        assert abs(acc - (1 - flip)) < _sigma_tol(flip, 2000)
    assert accs.index(worst) == 0  # the flip-0.9 environment


@needs_mnist
def test_load_colored_mnist_offline(t10k):
    data = cm.load_colored_mnist("inverse-coloredmnist", seed=1, mnist_split="test", root=SHARED)
    assert data.split == "t10k" and data.variant.label_noise == 0.1 and data.source == str(SHARED)
    ref = cm.build_colored_mnist(t10k.images, t10k.labels, "coloredmnist01", seed=1, split="t10k")
    assert torch.equal(data.train[0].x, ref.train[0].x)
    with pytest.raises(OwaiError) as exc:  # the paper's split needs the 60k training files
        cm.load_colored_mnist("coloredmnist", mnist_split="train", root=mn.PACKAGED_DIR)
    assert "owai data fetch mnist" in one_line_error(exc)


# --- the paper's 60k split, on synthetic images ---------------------------------------------------


def test_paper_split_on_synthetic_60k():
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (60000, 28, 28), dtype=torch.uint8, generator=gen)
    labels = torch.randint(0, 10, (60000,), generator=gen)
    before = images.clone()
    for rng in ("owai", "rfc"):
        data = cm.build_colored_mnist(images, labels, "coloredmnist", seed=0, split="paper", rng=rng)
        assert [len(e) for e in data.train] == [25000, 25000]
        assert [len(e) for e in data.test] == [10000, 10000, 10000]
        assert torch.equal(data.test_indices, torch.arange(50000, 60000))  # last 10k, unshuffled
        assert sorted(data.train_indices.tolist()) == list(range(50000))
        assert not torch.equal(data.train_indices, torch.arange(50000))  # shuffled
        _check_rates(data)
        again = cm.build_colored_mnist(images, labels, "coloredmnist", seed=0, split="paper", rng=rng)
        assert torch.equal(again.train[1].y, data.train[1].y) and torch.equal(again.test[2].x, data.test[2].x)
    assert torch.equal(images, before)  # the input is never shuffled in place
    import numpy as np

    rfc = cm.build_colored_mnist(images, labels, "coloredmnist", seed=7, split="paper", rng="rfc")
    assert torch.equal(rfc.train_indices, torch.from_numpy(np.random.RandomState(7).permutation(50000)))
    g = torch.Generator().manual_seed(7)  # train1 consumes the shared stream first: noise, then colour
    noise = torch.rand(25000, generator=g) < 0.25
    assert torch.equal(rfc.train[0].y.long(), (rfc.train[0].digit < 5).long() ^ noise.long())


def test_bad_inputs_are_one_line_errors():
    images = torch.zeros(3, 28, 28, dtype=torch.uint8)
    labels = torch.zeros(3, dtype=torch.long)
    with pytest.raises(OwaiError) as exc:
        cm.build_colored_mnist(images, labels, "coloredmnist", split="t10k")
    one_line_error(exc)
    with pytest.raises(OwaiError) as exc:
        cm.build_colored_mnist(images, labels, "coloredmnist", split="paper")
    assert "60000" in one_line_error(exc)
    with pytest.raises(OwaiError) as exc:
        cm.build_colored_mnist(images, labels, "purplemnist", split="t10k")
    assert "unknown ColoredMNIST variant" in one_line_error(exc)
    with pytest.raises(OwaiError):
        cm.build_colored_mnist(images, labels, "coloredmnist", split="val")
    with pytest.raises(OwaiError) as exc:
        cm.make_environment(images[:0], labels[:0], 0.25, 0.1, torch.Generator(), "train1")
    assert "empty" in one_line_error(exc)


def test_variant_family_selects_the_reference_hyper_parameters():
    """A gray oracle and an RFC alias take their coloured problem's L2 and Bonsai/PI step counts."""
    from owai.data.colored_mnist import variant
    from owai.methods.bonsai import BonsaiConfig, steps_for
    from owai.methods.coloredmnist import PI_STEPS1, dataset_l2

    assert variant("coloredmnist-gray").family == "coloredmnist"
    assert variant("coloredmnist01gray").family == "inverse-coloredmnist"
    assert dataset_l2("coloredmnist-gray") == dataset_l2("coloredmnist") == 0.0011
    assert dataset_l2("inverse-coloredmnist-gray") == dataset_l2("inverse-coloredmnist") == 1e-4
    assert steps_for("inverse-coloredmnist-gray", BonsaiConfig()) == (151, 401, 501)
    assert steps_for("coloredmnist", BonsaiConfig()) == (51, 501, 501)
    assert PI_STEPS1[variant("inverse-coloredmnist").family] == 151


@needs_mnist
def test_a_mirrors_recompressed_copy_passes_the_md5_check_as_in_fetch(tmp_path):
    """The official content, gzipped again by a mirror (other bytes, same content): `owai data fetch`
    and `verify` accept it (registry.check_md5), so reading with check_md5 does too."""
    d = _copy_t10k(tmp_path)
    path = d / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes()), compresslevel=1))
    assert mn.load_mnist_idx(d, "test", check_md5=True).images.shape == (10_000, 28, 28)
