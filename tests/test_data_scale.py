"""Data-pipeline defects that only show at the paper's scale (an audit on generated data; the figures
are in benchmarks/data_scale.py and docs/results.md). Each test checks the mechanism on a small
input, without timing anything."""

from __future__ import annotations

import gzip
import io
import random
import tarfile
from pathlib import Path

import pytest
import torch


def _tar_gz(path: Path, names: list[str]) -> None:
    with tarfile.open(path, "w:gz") as archive:
        for name in names:
            data = f"the text of {name}\n".encode()
            member = tarfile.TarInfo(name)
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))


def test_a_compressed_tar_in_no_name_order_is_decompressed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Members are documents in name order; a .tar.gz stores them in the order `tar` met them
    (sotu.tar.gz: not sorted). Each backward seek in a gzip stream decompresses it again from the
    start, so reading N members out of stored order cost O(N^2) (SOTU: 7.6 s per pass; 4,000
    members: 41 s). Now at most one rewind, and the same documents in the same order."""
    names = [f"d/doc{i:04d}.txt" for i in range(200)]
    random.Random(0).shuffle(names)
    archive = tmp_path / "docs.tar.gz"
    _tar_gz(archive, names)
    backward = []
    seek = gzip.GzipFile.seek

    def counting_seek(self: gzip.GzipFile, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET and offset < self.tell():
            backward.append(offset)
        return seek(self, offset, whence)

    monkeypatch.setattr(gzip.GzipFile, "seek", counting_seek)
    from owai.data.text import read_file

    docs = list(read_file(archive))
    assert docs == [f"the text of {name}" for name in sorted(names)]
    assert len(backward) <= 1, f"{len(backward)} backward seeks in the gzip stream (each decompresses it again)"


def _python_objects(root: object, limit: int = 10_000) -> int:
    """Python objects reachable from `root` (types, modules and functions not followed)."""
    import gc
    import types

    seen, todo = {id(root)}, [root]
    while todo and len(seen) < limit:
        for ref in gc.get_referents(todo.pop()):
            if id(ref) in seen or isinstance(ref, (type, types.ModuleType, types.FunctionType)):
                continue
            seen.add(id(ref))
            todo.append(ref)
    return len(seen)


def test_image_lists_hold_no_python_object_per_file(tmp_path: Path) -> None:
    """A forked DataLoader worker that reads a list of str / Path objects writes their reference counts
    and so copies the list's memory pages: over an epoch every worker holds its own copy (ImageNet's
    1.28M Paths: 440 MB per worker; Camelyon17's 455k str: ~50 MB). The path lists of the image
    datasets are `Strings` arrays instead: a constant number of objects, whatever the file count."""
    from camelyon_tree import make_camelyon
    from domainbed_tree import make_tree
    from owai.data import classification as cl
    from owai.data.camelyon17 import Camelyon17
    from owai.data.domainbed import ImageFolderDomains

    per_class = 30
    domains = ImageFolderDomains(make_tree(tmp_path / "db", per_class=per_class, size=8))
    assert domains.size(0) == 2 * per_class and _python_objects(domains._files[0]) < 20
    assert domains.path(0, 1) == domains.root / "d0" / "a" / sorted(p.name for p in (domains.root / "d0" / "a").iterdir())[1]

    camelyon = Camelyon17(make_camelyon(tmp_path / "c", train_per_center=40, size=8))
    assert len(camelyon) > 100 and _python_objects(camelyon.files) < 20
    assert camelyon.files[0] == "patient_000_node_0/patch_patient_000_node_0_x_0_y_0.png"

    paths = [tmp_path / "img" / f"{i:04d}.png" for i in range(500)]
    data = cl.ClassificationData(paths, torch.zeros(500, dtype=torch.int64), ["only"], "generated")
    assert _python_objects(data.images) < 20 and list(data.images) == paths and data.images[7] == paths[7]
    part = cl._subset(data, torch.tensor([9, 3, 499]))
    assert list(part.images) == [paths[9], paths[3], paths[499]] and all(isinstance(p, Path) for p in part.images)


def test_strings_round_trip_every_name() -> None:
    from owai.data.images import Paths, Strings

    names = ["a/b.png", "", "é/ü.jpg", "bad\udcff.png", "x" * 300]  # the surrogate: a file name that is not UTF-8
    table = Strings(names)
    assert list(table) == names and len(table) == 5 and table[-1] == names[-1] and table == names
    assert list(table[1:4]) == names[1:4] and list(table.take([4, 0])) == [names[4], names[0]]
    with pytest.raises(IndexError):
        table[5]
    with pytest.raises(IndexError):  # as a list's items: an index past the end is not wrapped round
        table.take([0, 5])
    assert Strings(["a", "b"]) != "ab" and Strings(["a", "b"]) == ("a", "b")  # a list is never equal to a str
    assert list(Strings()) == [] and Paths(["a/b"])[0] == Path("a/b") and Paths(names).take([2])[0] == Path(names[2])


def test_epoch_samplers_draw_one_permutation_per_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Camelyon17's standard sampler and StepBatches' sampling="epochs" drew a full randperm(n) at every
    step to use B of it: O(n) a step (302k Camelyon17 patches: 6 ms; ImageNet's 1.28M: 25 ms, as much
    as decoding the batch). Now once per epoch, and every step's positions are unchanged (a fresh
    sampler, as after a resume, gives the same ones)."""
    from owai.data.camelyon17 import StandardSampler
    from owai.data.domainbed import StepBatches, TensorDomains

    calls = []
    randperm = torch.randperm

    def counting(n: int, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(n)
        return randperm(n, *args, **kwargs)

    n, batch = 50, 8  # 6 steps an epoch
    sampler = StandardSampler(n, batch, seed=3, stage="train")
    monkeypatch.setattr(torch, "randperm", counting)
    steps = [sampler.positions(s) for s in range(18)]
    assert len(calls) == 3
    monkeypatch.setattr(torch, "randperm", randperm)
    assert all(torch.equal(p, StandardSampler(n, batch, seed=3, stage="train").positions(s)) for s, p in enumerate(steps))

    images = [torch.zeros(n, 4, 4, dtype=torch.uint8), torch.zeros(n, 4, 4, dtype=torch.uint8)]
    data = TensorDomains("t", ["d0", "d1"], ["a"], images, [torch.zeros(n, dtype=torch.int64)] * 2)
    args = (data, [0, 1], [torch.arange(n), torch.arange(n)], batch, 4, False, 0, 18)
    batches = StepBatches(*args, sampling="epochs")
    calls.clear()
    monkeypatch.setattr(torch, "randperm", counting)
    picks = [batches._picks(s, d, n) for s in range(18) for d in (0, 1)]
    assert len(calls) == 2 * 3  # per domain and epoch
    monkeypatch.setattr(torch, "randperm", randperm)
    fresh = [StepBatches(*args, sampling="epochs")._picks(s, d, n) for s in range(18) for d in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(picks, fresh))
