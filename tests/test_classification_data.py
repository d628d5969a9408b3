"""The classification loaders of the rich-feature experiments (owai.data.classification) and their
catalogue entries, on generated miniature files: CIFAR pickles (and tampered ones, which must be refused
without running anything), image folders, CUB / miniImageNet / iNat18 layouts, the hub path through a
stand-in `datasets`, scikit-learn's digits, class splits, and `owai data fetch cifar10` from a stand-in
download."""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import pickle
import sys
import tarfile
import types
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli_in_process
from PIL import Image

from owai.data import classification as cl
from owai.data import registry
from owai.errors import DataMissing, OwaiError

# ---------------------------------------------------------------------------------------------- CIFAR


def _rows(labels: list[int], start: int) -> np.ndarray:
    """Rows of 3072 bytes: R plane = the example's global index, G plane = 7, B plane = 0..255 repeated."""
    data = np.empty((len(labels), 3, 1024), dtype=np.uint8)
    for k in range(len(labels)):
        data[k, 0], data[k, 1], data[k, 2] = start + k, 7, np.arange(1024) % 256
    return data.reshape(len(labels), 3072)


def _dump(path: Path, obj: dict, py2_names: bool = False) -> None:
    raw = pickle.dumps(obj, protocol=3)
    if py2_names:  # what numpy 1.x / Python 2 wrote: numpy.core.multiarray
        raw = raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        assert b"numpy._core" not in raw
    path.write_bytes(raw)


def make_cifar10(root: Path, per_batch: int = 3, n_test: int = 2, py2_names: bool = False) -> tuple[Path, list[int], list[int]]:
    folder = root / "cifar10" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    key = (lambda k: k.encode()) if py2_names else (lambda k: k)
    _dump(folder / "batches.meta", {key("label_names"): names, key("num_cases_per_batch"): per_batch}, py2_names)
    train = []
    for b in range(5):
        labels = [(b * per_batch + k) % 10 for k in range(per_batch)]
        _dump(folder / f"data_batch_{b + 1}", {key("data"): _rows(labels, len(train)), key("labels"): labels,
                                               key("batch_label"): f"training batch {b + 1} of 5"}, py2_names)
        train += labels
    test = [9 - k for k in range(n_test)]
    _dump(folder / "test_batch", {key("data"): _rows(test, 0), key("labels"): test}, py2_names)
    return folder, train, test


def make_cifar100(root: Path) -> tuple[Path, list[int]]:
    folder = root / "cifar100" / "cifar-100-python"
    folder.mkdir(parents=True)
    _dump(folder / "meta", {"fine_label_names": [f"fine{i:02d}" for i in range(100)],
                            "coarse_label_names": [f"coarse{i:02d}" for i in range(20)]})
    fine = [99, 0, 42, 57]
    for split in ("train", "test"):
        _dump(folder / split, {"data": _rows(fine, 0), "fine_labels": fine, "coarse_labels": [f // 5 for f in fine],
                               "filenames": [f"x{i}.png" for i in range(4)]})
    return folder, fine


@pytest.mark.parametrize("py2_names", [False, True])
def test_cifar10_labels_classes_and_pixel_layout(tmp_path, py2_names):
    folder, train, test = make_cifar10(tmp_path, py2_names=py2_names)
    data = cl.read_cifar(tmp_path / "cifar10", "cifar10", "train")  # the folder holding cifar-10-batches-py
    assert data.images.shape == (15, 32, 32, 3) and data.images.dtype == torch.uint8
    assert data.labels.tolist() == train and data.labels.dtype == torch.int64
    assert data.classes[0] == "airplane" and data.classes[9] == "truck" and len(data.classes) == 10
    # rows are R, G, B planes of 32x32 row-major: pixel (y, x) of channel c is row[c * 1024 + 32 * y + x]
    assert torch.equal(data.images[:, :, :, 0], torch.arange(15, dtype=torch.uint8).view(15, 1, 1).expand(15, 32, 32))
    assert (data.images[:, :, :, 1] == 7).all()
    assert data.images[4, 0, 1, 2] == 1 and data.images[4, 1, 0, 2] == 32 and data.images[4, 31, 31, 2] == 1023 % 256
    assert data.image(3).size == (32, 32) and data.image(3).getpixel((0, 0)) == (3, 7, 0)
    same = cl.read_cifar(folder, "cifar10", "test")  # the batches folder itself
    assert same.labels.tolist() == test and same.images.shape == (2, 32, 32, 3)


def test_cifar100_uses_fine_labels_and_the_registry_root(tmp_path, no_data):
    _, fine = make_cifar100(tmp_path)
    data = cl.load("cifar100", "train", root=tmp_path)  # explicit data root holding cifar100/
    assert data.labels.tolist() == fine and data.classes[42] == "fine42" and len(data.classes) == 100
    assert len(cl.load("cifar100", "test", root=tmp_path / "cifar100")) == 4  # the dataset's own folder


class _Payload:
    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return self.fn, (self.arg,)


@pytest.mark.parametrize("where", ["top", "inside"])
@pytest.mark.parametrize("kind", ["os.system", "builtins.eval"])
def test_a_malicious_pickle_is_refused_without_running_it(tmp_path, kind, where):
    folder, _, _ = make_cifar10(tmp_path)
    marker = tmp_path / "pwned"
    if kind == "os.system":
        payload = _Payload(os.system, f"touch {marker}")
        refs = r"(posix|os|nt)\.system"
    else:
        payload = _Payload(builtins.eval, f"__import__('pathlib').Path({str(marker)!r}).touch()")
        refs = r"builtins\.eval"
    raw = pickle.dumps(payload if where == "top" else {"data": payload, "labels": [0]}, protocol=3)
    (folder / "data_batch_3").write_bytes(raw)
    with pytest.raises(OwaiError, match=rf"data_batch_3 is not a CIFAR batch: it references {refs}$") as err:
        cl.read_cifar(folder, "cifar10", "train")
    assert "\n" not in str(err.value)
    assert not marker.exists(), "the payload ran"
    if kind == "builtins.eval":  # the payload is live: an ordinary unpickler runs it
        pickle.loads(raw)
        assert marker.exists()


def test_only_the_numpy_array_names_are_allowed(tmp_path):
    path = tmp_path / "b"
    path.write_bytes(pickle.dumps({"data": np.zeros((1, 3072), np.uint8), "labels": [0]}, protocol=2))  # _codecs.encode
    with pytest.raises(OwaiError, match="it references _codecs.encode"):
        cl.load_cifar_batch(path)
    path.write_bytes(pickle.dumps({"x": torch.nn.Identity}, protocol=3))
    with pytest.raises(OwaiError, match=r"it references torch\.nn\.modules\.linear\.Identity"):
        cl.load_cifar_batch(path)


def test_truncated_corrupt_and_malformed_batches_are_one_line(tmp_path):
    folder, _, _ = make_cifar10(tmp_path)
    good = (folder / "data_batch_2").read_bytes()
    (folder / "data_batch_2").write_bytes(good[: len(good) // 2])
    with pytest.raises(OwaiError, match=r"CIFAR file .*data_batch_2 is corrupt or truncated") as err:
        cl.read_cifar(folder, "cifar10", "train")
    assert "\n" not in str(err.value)
    (folder / "data_batch_2").write_bytes(b"\x00garbage")
    with pytest.raises(OwaiError, match=r"data_batch_2 is corrupt or truncated"):
        cl.read_cifar(folder, "cifar10", "train")
    _dump(folder / "data_batch_2", {"data": np.zeros((2, 3071), np.uint8), "labels": [0, 1]})
    with pytest.raises(OwaiError, match=r"data_batch_2 has data uint8 \(2, 3071\), expected uint8 N x 3072"):
        cl.read_cifar(folder, "cifar10", "train")
    _dump(folder / "data_batch_2", {"data": np.zeros((2, 3072), np.uint8), "labels": [0, 10]})
    with pytest.raises(OwaiError, match=r"data_batch_2 has a label outside 0..9"):
        cl.read_cifar(folder, "cifar10", "train")
    _dump(folder / "data_batch_2", {"data": np.zeros((2, 3072), np.uint8), "labels": [0]})
    with pytest.raises(OwaiError, match=r"data_batch_2 has 2 images but 1 labels"):
        cl.read_cifar(folder, "cifar10", "train")
    assert len(cl.read_cifar(folder, "cifar10", "test")) == 2  # the test split does not read the training batches
    (folder / "test_batch").unlink()
    with pytest.raises(OwaiError, match=r"lacks test_batch"):
        cl.read_cifar(folder, "cifar10", "test")


def test_a_missing_dataset_names_the_fetch_command_or_the_manual_step(tmp_path, no_data):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataMissing, match=r"owai data fetch cifar10 --data-root"):
        cl.load("cifar10", "train", root=tmp_path / "empty")
    with pytest.raises(DataMissing, match=r"run `owai data fetch cifar100`"):
        cl.load("cifar100", "train")
    for name, step in (("cub", "CUB_200_2011.tgz"), ("imagenet", "image-net.org"), ("inat18", "train2018.json.tar.gz"),
                       ("miniimagenet", "meta-learning-lstm")):
        with pytest.raises(DataMissing, match="licence-gated") as err:
            cl.load(name, "train", root=tmp_path / "empty")
        assert step in str(err.value) and "\n" not in str(err.value)


# -- the hub path, through a stand-in `datasets` -----------------------------------------------------


def _fake_datasets(monkeypatch, columns: dict, names: dict[str, list[str]], calls: list) -> None:
    class FakeDataset:
        features = {col: types.SimpleNamespace(names=names.get(col)) for col in columns}

        def __getitem__(self, col):
            return columns[col]

        def __len__(self):
            return len(columns["img"])

    def load_dataset(hub_id, split):
        calls.append((hub_id, split))
        if hub_id == "nobody/offline":
            raise ConnectionError("Couldn't reach the hub\nsecond line")
        return FakeDataset()

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def test_cifar_from_the_hub_with_a_stand_in_datasets(monkeypatch, no_data):
    imgs = [Image.new("RGB", (32, 32), (k, 2 * k, 3)) for k in range(4)]
    imgs[1] = imgs[1].convert("L")  # a grayscale image comes back as RGB
    calls: list = []
    _fake_datasets(monkeypatch, {"img": imgs, "fine_label": [5, 99, 0, 5], "coarse_label": [1, 19, 0, 1]},
                   {"fine_label": [f"f{i}" for i in range(100)]}, calls)
    data = cl.load("cifar100", "test", hub_id="uoft-cs/cifar100")  # no local copy: the hub
    assert calls == [("uoft-cs/cifar100", "test")]
    assert data.labels.tolist() == [5, 99, 0, 5] and data.classes[99] == "f99"
    assert data.images.shape == (4, 32, 32, 3) and data.images[2, 0, 0].tolist() == [2, 4, 3]
    assert data.images[1, 5, 5].tolist() == [data.images[1, 5, 5, 0].item()] * 3
    with pytest.raises(OwaiError, match=r"has columns img, fine_label, coarse_label, expected img and label"):
        cl.load_cifar_hub("cifar10", "train")
    with pytest.raises(OwaiError, match=r"cannot load 'nobody/offline' split 'train' from the Hugging Face hub "
                                        r"\(ConnectionError: Couldn't reach the hub[;)]") as e:
        cl.load_cifar_hub("cifar10", "train", hub_id="nobody/offline")
    assert "\n" not in str(e.value)


def test_cifar_hub_defaults_and_a_local_copy_wins(monkeypatch, no_data, tmp_path):
    calls: list = []
    _fake_datasets(monkeypatch, {"img": [Image.new("RGB", (32, 32))] * 2, "label": [3, 4]},
                   {"label": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]}, calls)
    data = cl.load_cifar_hub("cifar10", "train")
    assert calls == [("uoft-cs/cifar10", "train")] and data.labels.tolist() == [3, 4] and data.classes[3] == "cat"
    make_cifar10(tmp_path / "d")
    monkeypatch.setenv("OWAI_DATA", str(tmp_path / "d"))
    assert len(cl.load("cifar10", "train", hub_id="uoft-cs/cifar10")) == 15 and len(calls) == 1


# ------------------------------------------------------------------------------------- image folders


def _png(path: Path, colour=(10, 20, 30), size=(6, 5)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


def test_imagenet_style_folders(tmp_path, no_data):
    root = tmp_path / "imagenet"
    for split, n in (("train", 3), ("val", 1)):
        for ci, cls in enumerate(("n02", "n01", "n03")):
            for i in range(n + ci):
                _png(root / split / cls / f"{i}.png", (ci * 50, i, 0))
    (root / "train" / "n01" / "notes.txt").write_text("not an image")
    (root / "train" / ".hidden").mkdir()
    train = cl.load("imagenet", "train", root=tmp_path)
    assert train.classes == ["n01", "n02", "n03"] and train.labels.tolist() == [0] * 4 + [1] * 3 + [2] * 5
    assert all(isinstance(p, Path) for p in train.images) and train.image(3).getpixel((0, 0)) == (50, 3, 0)
    val = cl.read_image_folder(root, "val")
    assert val.labels.tolist() == [0, 0, 1, 2, 2, 2]
    (root / "val" / "n04").mkdir()
    with pytest.raises(OwaiError, match=r"different class folders than .*train: missing \[\], extra \['n04'\]"):
        cl.read_image_folder(root, "val")
    with pytest.raises(OwaiError, match=r"image folder .*test does not exist"):
        cl.read_image_folder(root, "test")
    (root / "train" / "n01" / "0.png").write_bytes(b"not a png")
    with pytest.raises(OwaiError, match=r"cannot decode image .*n01/0.png"):
        cl.read_image_folder(root, "train").image(0)


# ------------------------------------------------------------------------------------------------ CUB


def make_cub(root: Path, n_classes: int = 8, per_class: int = 3) -> Path:
    base = root / "cub" / "CUB_200_2011"
    classes = [f"{c + 1:03d}.Bird_{c}" for c in range(n_classes)]
    images, labels, split = [], [], []
    for c, name in enumerate(classes):
        for i in range(per_class):
            rel = f"{name}/{name}_{i}.jpg"
            _png(base / "images" / rel, (c, i, 0))
            images.append(rel)
            labels.append(c + 1)
            split.append(1 if i < 2 else 0)
    base.mkdir(parents=True, exist_ok=True)
    (base / "classes.txt").write_text("".join(f"{c + 1} {n}\n" for c, n in enumerate(classes)))
    (base / "images.txt").write_text("".join(f"{k + 1} {p}\n" for k, p in enumerate(images)))
    (base / "image_class_labels.txt").write_text("".join(f"{k + 1} {c}\n" for k, c in enumerate(labels)))
    (base / "train_test_split.txt").write_text("".join(f"{k + 1} {s}\n" for k, s in enumerate(split)))
    return base


def test_cub_official_and_few_shot_splits(tmp_path, no_data):
    base = make_cub(tmp_path)
    full = cl.load("cub", "all", root=tmp_path)
    assert len(full) == 24 and len(full.classes) == 8 and full.labels.tolist() == [c for c in range(8) for _ in range(3)]
    assert full.images[4] == base / "images" / "002.Bird_1" / "002.Bird_1_1.jpg"
    train, test = cl.read_cub(base, "train"), cl.read_cub(tmp_path / "cub", "test")
    assert len(train) == 16 and len(test) == 8 and test.classes == full.classes
    assert test.labels.tolist() == list(range(8))
    parts = {s: cl.read_cub(base, s) for s in ("base", "val", "novel")}
    assert parts["base"].classes == [full.classes[i] for i in (0, 2, 4, 6)]
    assert parts["val"].classes == [full.classes[i] for i in (1, 5)]
    assert parts["novel"].classes == [full.classes[i] for i in (3, 7)]
    assert [len(parts[s]) for s in ("base", "val", "novel")] == [12, 6, 6]
    for data in parts.values():  # relabelled 0..k-1, each image still in its own class folder
        assert data.labels.tolist() == [k for k in range(len(data.classes)) for _ in range(3)]
        assert all(p.parent.name == data.classes[y] for p, y in zip(data.images, data.labels.tolist()))
    paths = [set(map(str, parts[s].images)) for s in ("base", "val", "novel")]
    assert not (paths[0] & paths[1] or paths[0] & paths[2] or paths[1] & paths[2])
    assert set().union(*paths) == set(map(str, full.images))


def test_chen_split_of_the_200_cub_classes():
    names = [f"{i + 1:03d}.c" for i in range(200)]
    split = cl.chen_class_split(names)
    assert [len(split[s]) for s in ("base", "val", "novel")] == [100, 50, 50]
    assert split["base"][:2] == ["001.c", "003.c"] and split["val"][:2] == ["002.c", "006.c"]
    assert split["novel"][:2] == ["004.c", "008.c"]
    assert sorted(split["base"] + split["val"] + split["novel"]) == names
    cl.disjoint_split(split["base"], split["novel"])


def test_cub_layout_errors(tmp_path):
    base = make_cub(tmp_path, n_classes=2, per_class=1)
    (base / "images" / "002.Bird_1" / "002.Bird_1_0.jpg").unlink()
    with pytest.raises(OwaiError, match=r"1 image file\(s\) listed but missing, e\.g\. .*002.Bird_1_0.jpg"):
        cl.read_cub(base)
    (base / "image_class_labels.txt").write_text("1 1\n2 3\n")
    with pytest.raises(OwaiError, match=r"image 2 has class '3', not in classes.txt"):
        cl.read_cub(base)
    (base / "train_test_split.txt").write_text("1 1\n")
    with pytest.raises(OwaiError, match=r"train_test_split.txt lists other image ids than images.txt"):
        cl.read_cub(base)
    (base / "classes.txt").unlink()
    with pytest.raises(OwaiError, match=r"CUB-200-2011 folder .* lacks classes.txt"):
        cl.read_cub(base)
    with pytest.raises(OwaiError, match="unknown CUB split 'support'"):
        cl.read_cub(base, "support")


# --------------------------------------------------------------------------------------- miniImageNet


def test_miniimagenet_ravi_larochelle_layout(tmp_path, no_data):
    root = tmp_path / "miniimagenet"
    for split, wnids in (("train", ["n03", "n01"]), ("val", ["n05"]), ("test", ["n07", "n09"])):
        rows = ["filename,label"]
        for w in wnids:
            for i in range(2):
                _png(root / "images" / f"{w}{i:08d}.jpg")
                rows.append(f"{w}{i:08d}.jpg,{w}")
        (root / f"{split}.csv").write_text("\n".join(rows) + "\n")
    train = cl.load("miniimagenet", "base", root=tmp_path)
    assert train.classes == ["n01", "n03"] and train.labels.tolist() == [1, 1, 0, 0]
    assert train.images[0] == root / "images" / "n0300000000.jpg"
    novel = cl.read_miniimagenet(root, "novel")
    assert novel.classes == ["n07", "n09"] and len(novel) == 4
    cl.disjoint_split(train.classes, novel.classes)
    (root / "val.csv").write_text("file,label\nx.jpg,n05\n")
    with pytest.raises(OwaiError, match="must start with the header 'filename,label'"):
        cl.read_miniimagenet(root, "val")
    (root / "val.csv").write_text("filename,label\nmissing.jpg,n05\n")
    with pytest.raises(OwaiError, match=r"listed but missing, e\.g\. .*missing.jpg"):
        cl.read_miniimagenet(root, "val")
    (root / "test.csv").unlink()
    with pytest.raises(OwaiError, match=r"miniImageNet folder .* lacks test.csv"):
        cl.read_miniimagenet(root, "test")


# --------------------------------------------------------------------------------------------- iNat18


def test_inat18_coco_style_json(tmp_path, no_data):
    root = tmp_path / "inat18"
    cats = [{"id": 2, "name": "Aves sp. b", "supercategory": "Aves"}, {"id": 0, "name": "Plantae sp. a"},
            {"id": 5, "name": "Fungi sp. c"}]
    images = [{"id": 10 + k, "file_name": f"train_val2018/S/{c}/{k}.jpg", "width": 6, "height": 5}
              for k, c in enumerate([0, 2, 5, 2])]
    anns = [{"id": k, "image_id": 10 + k, "category_id": c} for k, c in enumerate([0, 2, 5, 2])]
    for im in images:
        _png(root / im["file_name"])
    for split in ("train", "val"):
        (root / f"{split}2018.json").write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    data = cl.load("inat18", "val", root=tmp_path)
    assert data.classes == ["Plantae sp. a", "Aves sp. b", "Fungi sp. c"] and data.labels.tolist() == [0, 1, 2, 1]
    assert data.images[2] == root / "train_val2018/S/5/2.jpg" and data.image(2).size == (6, 5)
    bad = {"images": images, "annotations": anns[:3], "categories": cats}
    (root / "val2018.json").write_text(json.dumps(bad))
    with pytest.raises(OwaiError, match=r"image 13 \(train_val2018/S/2/3.jpg\) has no annotation"):
        cl.read_inat18(root, "val")
    (root / "val2018.json").write_text(json.dumps({"images": images, "annotations": anns}))
    with pytest.raises(OwaiError, match=r"has no 'categories' and .*categories.json is missing"):
        cl.read_inat18(root, "val")
    (root / "val2018.json").write_text('{"images": [')
    with pytest.raises(OwaiError, match=r"val2018.json is unreadable"):
        cl.read_inat18(root, "val")
    (root / "val2018.json").unlink()
    with pytest.raises(DataMissing, match="licence-gated"):
        cl.load("inat18", "val", root=tmp_path)  # the registry's required files


# ------------------------------------------------------------------------------------ digits, splits


def test_digits_and_class_splits():
    from sklearn.datasets import load_digits

    data = cl.load("digits")
    ref = load_digits()
    assert data.images.shape == (1797, 8, 8) and data.images.dtype == torch.uint8 and int(data.images.max()) == 255
    assert data.classes == [str(i) for i in range(10)] and data.labels.tolist() == ref.target.tolist()
    assert torch.equal(data.images, torch.from_numpy(np.round(ref.images * 255 / 16).astype(np.uint8)))
    base, target = cl.disjoint_split(["0", "1", "2", "3", "4"], ["5", "6", "7", "8", "9"])
    sub = cl.select_classes(data, ["3", "1"])
    assert sub.classes == ["3", "1"] and len(sub) == int(((ref.target == 3) | (ref.target == 1)).sum())
    assert sub.labels.tolist() == [0 if t == 3 else 1 for t in ref.target if t in (1, 3)]
    assert torch.equal(sub.images[sub.labels == 0], data.images[torch.from_numpy(ref.target == 3)])
    parts = [cl.select_classes(data, base), cl.select_classes(data, target)]
    assert len(parts[0]) + len(parts[1]) == 1797
    with pytest.raises(OwaiError, match=r"^class split overlaps: '4', '5' in both the base and the target classes$"):
        cl.disjoint_split(["3", "4", "5"], ["5", "6", "4"])
    with pytest.raises(OwaiError, match="class split: the target class set is empty"):
        cl.disjoint_split(["1"], [])
    with pytest.raises(OwaiError, match=r"unknown class\(es\) 'ten'"):
        cl.select_classes(data, ["1", "ten"])
    with pytest.raises(OwaiError, match="has duplicates"):
        cl.select_classes(data, ["1", "1"])


def test_the_type_checks_its_fields():
    with pytest.raises(OwaiError, match=r"a label outside 0..1"):
        cl.ClassificationData(torch.zeros(2, 4, 4, dtype=torch.uint8), torch.tensor([0, 2]), ["a", "b"])
    with pytest.raises(OwaiError, match=r"2 images but 3 labels"):
        cl.ClassificationData([Path("a"), Path("b")], torch.tensor([0, 1, 1]), ["a", "b"])
    with pytest.raises(OwaiError, match=r"images must be uint8"):
        cl.ClassificationData(torch.zeros(2, 4, 4), torch.tensor([0, 1]), ["a", "b"])
    with pytest.raises(OwaiError, match=r"images must be uint8"):
        cl.ClassificationData(torch.zeros(2, 4, 4, 2, dtype=torch.uint8), torch.tensor([0, 1]), ["a", "b"])


# ----------------------------------------------------------------------------------------- the catalogue


def test_catalogue_entries_and_data_list(capsys, no_data):
    sets = registry.catalogue()
    assert {"cifar10", "cifar100", "imagenet", "inat18", "cub", "miniimagenet"} <= set(sets)
    assert sets["cifar10"].archive_md5 == "c58f30108f718f92721af3b95e74349a"
    assert sets["cifar100"].archive_md5 == "eb9058c3a382ffc7106e4002c42a8d85"
    assert sets["cifar10"].urls == ("https://www.cs.toronto.edu/~kriz/",) and sets["cifar100"].hf_id == "uoft-cs/cifar100"
    assert all(sets[n].manual and not sets[n].archive for n in ("imagenet", "inat18", "cub", "miniimagenet"))
    assert registry.dataset("cub200").name == "cub" and registry.dataset("inaturalist2018").name == "inat18"
    code, out, err = cli_in_process(["data", "list", "--json"], capsys)
    assert code == 0, err
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["cifar10"]["found"] == "no" and "`owai data fetch cifar10` (hub: uoft-cs/cifar10)" in rows["cifar10"]["get"]
    assert "licence-gated" in rows["imagenet"]["get"] and rows["cub"]["where"].endswith("cub")
    code, _, err = cli_in_process(["data", "fetch", "miniimagenet"], capsys)
    assert code == 2 and "cannot be downloaded by owai" in err and len(err.strip().splitlines()) == 1


def _cifar_archive(tmp_path: Path) -> bytes:
    make_cifar10(tmp_path / "src")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(tmp_path / "src" / "cifar10" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    return buf.getvalue()


def test_fetch_cifar_checks_the_md5_unpacks_and_verifies(capsys, monkeypatch, no_data, tmp_path):
    archive = _cifar_archive(tmp_path)
    served = {"http://mirror.test/good/cifar-10-python.tar.gz": archive,
              "http://mirror.test/bad/cifar-10-python.tar.gz": archive + b"tampered"}

    def download(url, dest):
        if url not in served:
            raise urllib.error.URLError("not found")
        dest.write_bytes(served[url])

    monkeypatch.setattr(registry, "download", download)
    root = tmp_path / "root"
    with pytest.raises(OwaiError, match=r"bad/cifar-10-python.tar.gz has md5 \w+, expected c58f3010.* \(refused\)"):
        registry.fetch("cifar10", root, "http://mirror.test/missing/,http://mirror.test/bad/")  # the real md5
    assert list(root.iterdir()) == []  # neither the folder nor a temporary file
    monkeypatch.setitem(cl.CIFAR_ARCHIVES, "cifar10", ("cifar-10-python.tar.gz", hashlib.md5(archive).hexdigest()))
    code, out, err = cli_in_process(["data", "fetch", "cifar10", "--data-root", str(root), "--mirror",
                                     "http://mirror.test/missing/,http://mirror.test/good/", "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    folder = root / "cifar10"
    assert report["path"] == str(folder) and sorted(p.name for p in folder.iterdir()) == ["cifar-10-batches-py", registry.MANIFEST]
    assert any("15 train + 2 test images" in line for line in report["verified"])
    assert sum("sha256 ok" in line for line in report["verified"]) == 7
    assert len(cl.load("cifar10", "train", root=root)) == 15
    (folder / "cifar-10-batches-py" / "test_batch").write_bytes(b"corrupted")
    code, _, err = cli_in_process(["data", "verify", "cifar10", "--data-root", str(root)], capsys)
    assert code == 2 and "test_batch has sha256" in err and len(err.strip().splitlines()) == 1


def test_fetch_refuses_an_archive_that_escapes_its_folder(monkeypatch, no_data, tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    archive = buf.getvalue()
    monkeypatch.setattr(registry, "download", lambda url, dest: dest.write_bytes(archive))
    monkeypatch.setitem(cl.CIFAR_ARCHIVES, "cifar10", ("cifar-10-python.tar.gz", hashlib.md5(archive).hexdigest()))
    root = tmp_path / "root"
    with pytest.raises(OwaiError, match="cannot unpack"):
        registry.fetch("cifar10", root, "http://mirror.test/")
    assert not (root / "escaped.txt").exists() and list(root.iterdir()) == []
