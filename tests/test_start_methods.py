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
        return DataLoader(dataset, **{**kwargs, "num_workers": 0, "prefetch_factor": None, "persistent_workers": False})

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
        if isinstance(dl.batch_sampler, images._PassBatches):  # an evaluation pass's batches (EvalPasses)
            again = DataLoader(dataset, batch_sampler=list(dl.batch_sampler), collate_fn=collate, worker_init_fn=init)
        else:
            again = DataLoader(dataset, batch_size=dl.batch_size, sampler=list(dl.sampler), collate_fn=collate,
                               worker_init_fn=init)
        assert _same(list(again), batches), type(dl.dataset).__name__
    assert len(made) == len(runs)


class _WhoReads(torch.utils.data.Dataset):
    """Example i as (i, the pid of the process that read it)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[int, int]:
        import os

        return i, os.getpid()


def _by_reader(items: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [i for i, _ in items], [pid for _, pid in items]


def test_evaluation_passes_start_their_workers_once():
    """A run's evaluation passes (27 in a Camelyon17 run) go through one set of workers, started at
    the first pass: a worker start is seconds under spawn (macOS). Each pass gives its indices'
    batches in order, as without workers; a pass cut short does not disturb the next."""
    import os

    passes = images.EvalPasses(_WhoReads(), 3, 2, _by_reader)
    readers: set[int] = set()
    for indices in (torch.arange(10), torch.tensor([39, 5, 7, 1, 20]), torch.arange(30, 40)):
        batches = list(passes(indices))
        assert [i for ids, _ in batches for i in ids] == indices.tolist() and [len(ids) for ids, _ in batches][0] == 3
        readers.update(pid for _, pids in batches for pid in pids)
    cut = passes(torch.arange(20))
    next(cut)  # a pass left after its first batch
    assert [i for ids, _ in passes(torch.tensor([3, 2, 1])) for i in ids] == [3, 2, 1]
    assert len(readers) == 2 and os.getpid() not in readers  # the same two workers for every pass
    inline = images.EvalPasses(_WhoReads(), 4, 0, _by_reader)
    assert {pid for _, pids in inline(torch.arange(8)) for pid in pids} == {os.getpid()}


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
    from owai.data.images import EvalPasses
    from probe_items import Who
    passes = EvalPasses(Who(), 2, 2, list)
    readers = [{pid for batch in passes(torch.arange(4)) for pid in batch} for _ in range(3)]
    print("RESULT", same, all(preloaded), any(preloaded), readers[0] == readers[1] == readers[2] and len(readers[0]) == 2)

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


class Who(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return os.getpid()
"""


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_loader_workers_under_spawn_and_forkserver(method, tmp_path):
    """For real, in a process of that start method: two workers give the step and evaluation batches
    of no workers, under forkserver the workers find the dataset's module imported by the server
    (a spawned worker imports it itself), and evaluation passes reuse their workers."""
    (tmp_path / "script.py").write_text(textwrap.dedent(_SCRIPT))
    (tmp_path / "probe_items.py").write_text(textwrap.dedent(_ITEMS))
    done = subprocess.run([sys.executable, str(tmp_path / "script.py"), method], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT")).split()
    assert result[1] == "True"  # same batches
    assert result[2:4] == (["True", "True"] if method == "forkserver" else ["False", "False"])
    assert result[4] == "True"  # three evaluation passes through the same two workers (EvalPasses)
