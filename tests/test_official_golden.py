"""Digests of the official code's data, recorded once, so that the default run (which has no clone
of the official code) still checks that owai draws the same data in the same random order:

- RegBench: seq_icl's `ICLDFADataModule` (berlino/seq_icl, src/dataloaders/dfa.py, icl_dfa.yaml's
  defaults, seed 0), the automata of each split and their padded inputs and targets;
- Colored MNIST: RFC's `coloredmnist()` (TjuJianyu/RFC, coloredmnist/mydatasets.py) on MNIST's 60,000
  training images after run_exp.py's `np.random.seed(3); torch.manual_seed(3)`, its five environments.

Each digest was computed from the OFFICIAL code's output (not owai's), on 2026-12-01, with the clones
and helpers of tests/test_official_code.py (seq_icl's generator with its two hash-seed-dependent
orders fixed to owai's, as that file does): sha256 over, in order, each tensor's (shape, dtype) text
and bytes (inputs then targets as int64, or images as float32 then labels as int64, environment by
environment), then for RegBench the JSON list of each automaton's canonical minimised table's repr.
tests/test_official_code.py compares the two element by element where the clones are present; a
digest here that stops matching means owai's data changed, and that file says where.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

# (num_examples, num_test_examples) -> split -> (sha256, padded input shape), from seq_icl
REGBENCH = {
    (30, 275): {"train": ("a2d4639b0355783b550c662b28e30113f79c113f131cb6d954910b826c03d541", (29, 504)),
                "test": ("70fa0e5bf033b0cbf4f5ee53416e92c338ffbc69b41377ab117556a8b814ff18", (135, 571)),
                "val": ("8a417f70b0d5276802a10b950faa91c3a723d6d3434b741dc88602bf5148c753", (136, 553))},
    (100, 500): {"train": ("f50ac4b147510c0432e540483dbb1bc28645f032757f850ed0c33fb3ea2b8b0e", (100, 615)),
                 "test": ("09c3d401e74cb5127b8359e0f1631d61ec1a7afa4b1c9feb55e1fe41c8b5825f", (250, 625)),
                 "val": ("588a05fc4a0155a2e896441cf36d3e9f63ea397229cd6f7db6ff7fd977a8ca2f", (250, 588))},
}
# owai's Colored MNIST variant -> sha256 of RFC's five environments (seed 3)
COLORED_MNIST = {
    "coloredmnist": "da5af8b103766b4e172e57f1bc1baaf65590800bc253ca354d3f51c353038bd3",
    "coloredmnist-gray": "fcc714b7dc49daae8dbf6dbe836ff088194cc7ed5730f23f62d585495e1def47",
    "inverse-coloredmnist": "72b9b54965f31e91314eedd473c343103f6aa5b57d38a84cc57e32c44e172fc2",
}


def _add(h: "hashlib._Hash", t: torch.Tensor) -> None:
    t = t.contiguous().cpu()
    h.update(str((tuple(t.shape), str(t.dtype))).encode())
    h.update(t.numpy().tobytes())


@pytest.mark.parametrize("sizes", list(REGBENCH), ids=lambda s: f"{s[0]}-{s[1]}")
def test_regbench_splits_are_seq_icls(sizes):
    """`make_regbench` with seq_icl's settings and seed 0 gives seq_icl's automata, splits, inputs and
    targets (the second size keeps two candidates of one language, as seq_icl does)."""
    from owai.data.regbench import RegBenchConfig, make_regbench

    data = make_regbench(RegBenchConfig(num_examples=sizes[0], num_test_examples=sizes[1], seed=0))
    for split, (digest, shape) in REGBENCH[sizes].items():
        inputs, targets, pfas = getattr(data, split).torch_batch()
        h = hashlib.sha256()
        _add(h, inputs.long())
        _add(h, targets.long())
        h.update(json.dumps([repr(p.transitions) for p in pfas]).encode())
        assert tuple(inputs.shape) == shape, split
        assert h.hexdigest() == digest, f"{split}: owai's RegBench data is no longer seq_icl's"


@pytest.mark.parametrize("name", list(COLORED_MNIST))
def test_colored_mnist_with_rfcs_random_order_is_rfcs(name, shared_data):
    """`load_colored_mnist(..., rng="rfc")` on MNIST's training images gives RFC's five environments
    (two training, three test; 25,000 / 25,000 / 10,000 x 3), image for image and label for label."""
    from owai.data.colored_mnist import load_colored_mnist

    ours = load_colored_mnist(name, seed=3, mnist_split="train", rng="rfc")
    envs = ours.train + ours.test
    assert [len(e.y.reshape(-1)) for e in envs] == [25_000, 25_000, 10_000, 10_000, 10_000]
    h = hashlib.sha256()
    for env in envs:
        _add(h, env.x.float())
        _add(h, env.y.reshape(-1).long())
    assert h.hexdigest() == COLORED_MNIST[name], f"owai's {name} is no longer RFC's"
