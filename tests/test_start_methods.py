"""Image loaders under the start methods other than Linux's `fork`: `spawn` (macOS's default) and
`forkserver` (Python 3.14's default on Linux). A worker then gets the dataset and the collate function
pickled, not inherited, and a fork server should already hold the modules a worker needs
(owai.data.images `loader`, docs/decisions.md "Loader workers under spawn and forkserver")."""

from __future__ import annotations

import multiprocessing
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from camelyon_tree import make_camelyon
from domainbed_tree import make_tree
from torch.utils.data import DataLoader

from owai.data import camelyon17, domainbed, images
from owai.data.classification import ClassificationData
from owai.methods.rich_features import OneDomain


def _tensor_domains() -> domainbed.TensorDomains:
    gen = torch.Generator().manual_seed(0)
    ims = [torch.randint(0, 256, (12, 8, 8), dtype=torch.uint8, generator=gen) for _ in range(3)]
    return domainbed.TensorDomains("t", ["a", "b", "c"], ["0", "1"], ims, [torch.arange(12) % 2 for _ in range(3)])


def _same(a: list, b: list) -> bool:
    """Batches (tensors or tuples of tensors) equal one by one."""
    def parts(x):  # noqa: ANN001, ANN202
        return x if isinstance(x, (tuple, list)) else (x,)
    return len(a) == len(b) and all(len(parts(x)) == len(parts(y)) and all(torch.equal(p, q) for p, q in zip(parts(x), parts(y)))
                                    for x, y in zip(a, b))


def test_every_image_loader_reaches_a_worker_by_pickle(tmp_path, monkeypatch):
    """What a spawn or forkserver worker receives (the dataset, the collate and init functions) pickles
    and gives the batches the loader gives in-process, for each dataset family: in-memory domains
    (RotatedMNIST's kind), image folders (DomainBed, path tables), classification sets seen as one
    domain with two SSL views (rich features), Camelyon17 (group sampler, cached patches)."""
    made: list[DataLoader] = []

    def capture(dataset, **kwargs):  # noqa: ANN001, ANN003, ANN202 - the loader a worker would serve
        made.append(DataLoader(dataset, **kwargs))
        return DataLoader(dataset, **{**kwargs, "num_workers": 0, "prefetch_factor": None})

    monkeypatch.setattr(images, "DataLoader", capture)
    tensors = _tensor_domains()
    folders = domainbed.open_image_dataset("imagefolder", make_tree(tmp_path / "tree", per_class=3, size=12))
    digits = OneDomain(ClassificationData(tensors.images(0), tensors.labels(0), ["0", "1"], "digits"))
    cam = camelyon17.Camelyon17(make_camelyon(tmp_path / "cam", train_per_center=4, id_val_per_center=1, eval_per_center=3),
                                image_size=8, cache_images=True)
    train = cam.split("train")
    runs = [
        lambda: images.step_loader(domainbed.StepBatches(tensors, [0, 1], [torch.arange(12)] * 2, 3, 8, True, 0, 4), 1, 2),
        lambda: domainbed.eval_batches(tensors, 2, torch.arange(12), 8, 5, 2),
        lambda: images.step_loader(domainbed.StepBatches(folders, [0, 1], [torch.arange(folders.size(i)) for i in (0, 1)],
                                                         2, 8, True, 0, 3), 0, 2),
        lambda: domainbed.eval_batches(folders, 2, torch.arange(folders.size(2)), 8, 4, 2, style="cifar"),
        lambda: images.step_loader(domainbed.StepBatches(digits, [0], [torch.arange(12)], 4, 8, True, 0, 3, views=2,
                                                         sampling="epochs"), 0, 2),
        lambda: images.step_loader(camelyon17.ImageBatches(
            cam, train, camelyon17.GroupSampler(cam.centers[train], 4, 2, seed=0, stage="x"), 3), 0, 2),
        lambda: camelyon17.eval_batches(cam, cam.split("test"), 2, 2),
    ]
    for run in runs:
        batches = list(run())  # in-process, which also fills Camelyon17's patch cache before the pickle
        dl = made[-1]
        assert dl.num_workers == 2
        dataset, collate, init = pickle.loads(pickle.dumps((dl.dataset, dl.collate_fn, dl.worker_init_fn)))
        again = DataLoader(dataset, batch_size=dl.batch_size, sampler=list(dl.sampler), collate_fn=collate,
                           worker_init_fn=init)
        assert _same(list(again), batches), type(dl.dataset).__name__
    assert len(made) == len(runs)


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_a_fork_server_preloads_the_loader_modules(method, monkeypatch):
    """Under forkserver the server imports torch and the dataset's module once, so a worker does not
    import them each time a loader starts (seconds per evaluation pass); the other methods and a
    loader without workers leave the preload list alone."""
    preloads: list[list[str]] = []
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: method)
    monkeypatch.setattr(multiprocessing, "set_forkserver_preload", preloads.append)
    tensors = _tensor_domains()
    batches = domainbed.StepBatches(tensors, [0], [torch.arange(12)], 3, 8, False, 0, 2)
    images.loader(batches, 0, False, batch_size=None)
    assert preloads == []
    images.loader(batches, 2, False, batch_size=None)
    images.loader(batches, 2, False, batch_size=None, multiprocessing_context="forkserver")
    expected = ["__main__", "owai.data.images", "owai.data.domainbed"]
    assert preloads == ([expected] * 2 if method == "forkserver" else [expected])


_SCRIPT = """
import multiprocessing, os, sys
import torch
from owai.data import domainbed
from owai.data.images import loader, step_loader

def main():
    multiprocessing.set_start_method(sys.argv[1], force=True)
    from probe_items import Items  # not at the top: the fork server runs this script's top (its "__main__")
    preloaded = [bool(x) for x in loader(Items(), 2, False, batch_size=None)]  # the first start: the server's
    gen = torch.Generator().manual_seed(0)
    ims = [torch.randint(0, 256, (12, 8, 8), dtype=torch.uint8, generator=gen) for _ in range(2)]
    data = domainbed.TensorDomains("t", ["a", "b"], ["0", "1"], ims, [torch.arange(12) % 2] * 2)
    batches = domainbed.StepBatches(data, [0, 1], [torch.arange(12)] * 2, 3, 8, True, 0, 5)
    ref, got = list(step_loader(batches, 1, 0)), list(step_loader(batches, 1, 2))
    same = len(ref) == len(got) and all(torch.equal(a, b) for r, g in zip(ref, got) for a, b in zip(r, g))
    ev0 = list(domainbed.eval_batches(data, 1, torch.arange(12), 8, 5, 0))
    ev2 = list(domainbed.eval_batches(data, 1, torch.arange(12), 8, 5, 2))
    same = same and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ev0, ev2))
    print("RESULT", same, all(preloaded), any(preloaded))

if __name__ == "__main__":
    main()
"""

_ITEMS = """
import os
from torch.utils.data import Dataset
IMPORTED_IN = os.getpid()

class Items(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return IMPORTED_IN != os.getpid()  # True: a fork server imported this module, not the worker
"""


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_loader_workers_under_spawn_and_forkserver(method, tmp_path):
    """For real, in a process of that start method: two workers give the step and evaluation batches
    of no workers, and under forkserver the workers find the dataset's module imported by the server
    (a spawned worker imports it itself)."""
    (tmp_path / "script.py").write_text(textwrap.dedent(_SCRIPT))
    (tmp_path / "probe_items.py").write_text(textwrap.dedent(_ITEMS))
    done = subprocess.run([sys.executable, str(tmp_path / "script.py"), method], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT")).split()
    assert result[1] == "True"  # same batches
    assert result[2:] == (["True", "True"] if method == "forkserver" else ["False", "False"])
