"""Surviving mutants of the dataset loaders and splits (a mutation audit of owai.data's Colored MNIST,
DomainBed, Camelyon17, MNIST, image transforms, RegBench, recall episodes, linear tasks and the
few-shot protocol), now caught.

Every expected value comes from a rule written in the module docstrings or docs/decisions.md, from
the official code's formula (WILDS, DomainBed, torchvision, Chen et al. 2019, seq_icl), or from the
file format itself, never from owai's own output. Each test is a few seconds at most.
"""

from __future__ import annotations

import csv
import gzip

import numpy as np
import pytest
import torch
from camelyon_tree import make_camelyon
from domainbed_tree import make_tree
from PIL import Image
from test_recall import filler, toy_encode  # the recall suite's word-level tokenizer and filler tokens

from owai.data import colored_mnist as cm
from owai.data import mnist as mn
from owai.data.camelyon17 import Camelyon17, StandardSampler, UniformGroupSampler
from owai.data.classification import read_cub
from owai.data.domainbed import (
    ImageFolderDomains,
    StepBatches,
    color_jitter,
    ssl_transform,
    train_transform,
)
from owai.data.images import center_crop, eval_transform, normalisation
from owai.data.linear_tasks import random_orthonormal
from owai.data.recall import SEMANTIC_LABELS, Pieces, recall_episode, training_episode
from owai.data.regbench import RegBenchConfig, make_regbench
from owai.evals.fewshot import sample_episodes
from owai.runtime import generator

# the literal statistics of the official code: torchvision's / WILDS's ImageNet Normalize, and the
# CIFAR numbers of TH A.1 (docs/decisions.md's transform table)
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
CIFAR = ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))


def pixels(x: torch.Tensor, stats: tuple[tuple[float, ...], tuple[float, ...]] = IMAGENET) -> np.ndarray:
    """(3, H, W) normalised -> (H, W, 3) pixel values 0..255 (float, unrounded)."""
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in stats)
    return ((x * std + mean) * 255).permute(1, 2, 0).numpy()


# ------------------------------------------------------------------------------------- Colored MNIST

def test_colored_mnist_environment_slots_have_their_own_generators() -> None:
    """colored_mnist docstring (rng="owai"): the shuffle is randperm with generator(seed,
    "coloredmnist", "shuffle") and each slot train1, train2, test1..test3 has its own generator
    generator(seed, "coloredmnist", slot), label-noise draws first, then colour draws. Mutant: every
    slot drawing from one key, so the three test environments got identical label noise."""
    rng = np.random.default_rng(0)
    n, seed = 60, 7
    images = torch.from_numpy(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
    digits = torch.from_numpy(rng.integers(0, 10, n))
    data = cm.build_colored_mnist(images, digits, "coloredmnist", seed, split="t10k")
    pool = torch.tensor([i for i in range(n) if i % 5 != 4])  # t10k rule: image i is a test image iff i % 5 == 4
    perm = torch.randperm(len(pool), generator=generator(seed, "coloredmnist", "shuffle"))
    assert torch.equal(data.train_indices, pool[perm])
    envs = {f"train{k + 1}": e for k, e in enumerate(data.train)} | {f"test{k + 1}": e for k, e in enumerate(data.test)}
    flips = {"train1": 0.1, "train2": 0.2, "test1": 0.9, "test2": 0.1, "test3": 0.5}
    for slot, env in envs.items():
        gen = generator(seed, "coloredmnist", slot)
        m = len(env)
        y = (env.digit < 5).long() ^ (torch.rand(m, generator=gen) < 0.25).long()
        color = y ^ (torch.rand(m, generator=gen) < flips[slot]).long()
        assert torch.equal(env.y.long(), y), slot
        assert torch.equal(env.color, color), slot
    assert not torch.equal(data.test[0].y, data.test[1].y)  # independent label noise per test environment


# ------------------------------------------------------------------------------------------ DomainBed

def test_step_batches_depend_on_the_seed(tmp_path) -> None:
    """domainbed docstring: the examples of training step t from domain d are keyed by (seed, "batch",
    t, d). Two seeds are two trials and must draw different examples. Mutant: the seed left out of
    the key (every seed trains on the same batches)."""
    ds = ImageFolderDomains(make_tree(tmp_path / "tree", per_class=6, size=8, pattern="code"))
    idx = [torch.arange(ds.size(0)), torch.arange(ds.size(1))]

    def batches(seed: int) -> list[torch.Tensor]:
        sb = StepBatches(ds, [0, 1], idx, batch_per_domain=4, size=8, augment=False, seed=seed, steps=4)
        return [sb[t][0] for t in range(4)]

    a, again, b = batches(0), batches(0), batches(1)
    assert all(torch.equal(x, y) for x, y in zip(a, again))
    assert not all(torch.equal(x, y) for x, y in zip(a, b))


def test_domainbed_random_grayscale_rate_is_one_tenth() -> None:
    """DomainBed's training transform ends with RandomGrayscale(p=0.1). 2 000 draws put the rate
    within 0.075..0.125 (about 3.7 standard deviations). Mutant: p = 0.2 passed the old 0.03..0.2 band."""
    colourful = Image.new("RGB", (8, 8), (220, 40, 40))
    n = 2000
    gray = 0
    for s in range(n):
        x = pixels(train_transform(colourful, 8, True, generator("gray-rate", s))).round()
        gray += bool((x[..., 0] == x[..., 1]).all() and (x[..., 1] == x[..., 2]).all())
    assert 0.075 < gray / n < 0.125, gray / n


def test_domainbed_color_jitter_brightness_range_is_0_3() -> None:
    """DomainBed's ColorJitter(0.3, 0.3, 0.3, 0.3): brightness factor uniform in [0.7, 1.3]. On a
    constant gray image contrast, saturation and hue change nothing, so the output is the gray
    value times the brightness factor: 100 -> 70..130, and 400 draws reach both ends. Mutant: 0.4."""
    image = Image.new("RGB", (4, 4), (100, 100, 100))
    values = []
    for s in range(400):
        out = np.asarray(color_jitter(image, generator("jitter", s)), dtype=np.int64)
        assert (out == out[0, 0, 0]).all()
        values.append(int(out[0, 0, 0]))
    assert 69 <= min(values) < 76 and 124 < max(values) <= 131, (min(values), max(values))


def test_simsiam_view_random_grayscale_rate_is_one_fifth() -> None:
    """ssl_transform (SimSiam's CIFAR view, TH A.3.3): RandomGrayscale(p=0.2); the jitter's saturation
    factor stays >= 0.6, so only that step makes a red image gray. 2 000 draws put the rate within
    0.165..0.235 (about 3.9 standard deviations). Mutant: p = 0.1."""
    colourful = Image.new("RGB", (8, 8), (220, 40, 40))
    n = 2000
    gray = 0
    for s in range(n):
        x = pixels(ssl_transform(colourful, 8, generator("ssl-gray", s))).round()
        gray += bool((x[..., 0] == x[..., 1]).all() and (x[..., 1] == x[..., 2]).all())
    assert 0.165 < gray / n < 0.235, gray / n


def test_ssl_views_are_keyed_as_documented(tmp_path) -> None:
    """StepBatches docstring: with views = V > 1, view 0 of example j is augmented with generator(seed,
    "augment", step, domain, j), the single-view key, and view v > 0 with generator(seed, "augment",
    step, domain, j, v). Mutant: view 0 keyed with a trailing 0 (another stream than documented)."""
    ds = ImageFolderDomains(make_tree(tmp_path / "tree", per_class=1, size=8))
    sb = StepBatches(ds, [0, 1], [torch.tensor([0]), torch.tensor([0])], batch_per_domain=2, size=8, augment=True,
                     seed=3, steps=2, views=2)
    x, _, _ = sb[1]
    assert x.shape == (8, 3, 8, 8)
    k = 0
    for v in range(2):
        for d in range(2):
            for j in range(2):
                gen = generator(3, "augment", 1, d, j, *([v] if v else []))
                assert torch.equal(x[k], ssl_transform(ds.image(d, 0), 8, gen)), (v, d, j)
                k += 1


@pytest.mark.parametrize("style, scale", [("domainbed", (0.7, 1.0)), ("cifar", (0.8, 1.0)), ("imagenet", (0.08, 1.0)),
                                          ("fewshot", (0.08, 1.0)), ("vit", (0.08, 1.0))])
def test_training_crop_scale_of_each_style(style: str, scale: tuple[float, float], monkeypatch: pytest.MonkeyPatch) -> None:
    """train_transform's RandomResizedCrop scale by style: DomainBed's (0.7, 1.0), TH A.1's (0.8, 1.0)
    for CIFAR, torchvision's default (0.08, 1.0) otherwise. Mutant: the DomainBed style cropping with
    (0.08, 1.0) (its jitter hides the crop from the older pixel-coordinate test)."""
    import owai.data.domainbed as db

    seen = []
    real = db.random_resized_crop_params

    def recording(width, height, gen, scale=db.CROP_SCALE, ratio=db.CROP_RATIO):
        seen.append((tuple(scale), tuple(ratio)))
        return real(width, height, gen, scale=scale, ratio=ratio)

    monkeypatch.setattr(db, "random_resized_crop_params", recording)
    train_transform(Image.new("RGB", (10, 10), (1, 2, 3)), 8, True, generator(0), style)
    assert seen == [(scale, (3 / 4, 4 / 3))]


# ----------------------------------------------------------------------------------------- Camelyon17

def _rewrite_split(root, centres_to_one: set[int]) -> None:
    """Set metadata.csv's `split` column to 1 on every other row of the given centres (the raw
    WILDS metadata holds split 0 and 1 rows in the OOD centres too)."""
    path = root / "camelyon17_v1.0" / "metadata.csv"
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = rows[0]
    c, s = head.index("center"), head.index("split")
    for k, row in enumerate(rows[1:]):
        if int(row[c]) in centres_to_one and k % 2:
            row[s] = "1"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)


def test_camelyon_val_and_test_are_whole_hospitals(tmp_path) -> None:
    """WILDS camelyon17_dataset.py: every patch of centre 1 is `val` and every patch of centre 2 is
    `test`, whatever its `split` column (WILDS overwrites it); only centres 0, 3, 4 are split by it.
    Mutant: val keeping only centre 1's split-0 rows (the test tree had no split-1 rows there)."""
    root = make_camelyon(tmp_path / "data", train_per_center=4, id_val_per_center=2, eval_per_center=6, size=8)
    _rewrite_split(root, {1, 2})
    data = Camelyon17(root, image_size=8)
    assert torch.equal(data.split("val"), (data.centers == 1).nonzero().reshape(-1))
    assert torch.equal(data.split("test"), (data.centers == 2).nonzero().reshape(-1))
    assert data.split("val").numel() == data.split("test").numel() == 6


def test_camelyon_fraction_subset_follows_its_seed(tmp_path) -> None:
    """camelyon17 docstring: `fraction` keeps a permutation keyed by `fraction_seed` (WILDS's --frac
    draws from the seeded global RNG). Mutant: the seed left out (every seed the same subset)."""
    root = make_camelyon(tmp_path / "data", train_per_center=8, id_val_per_center=2, eval_per_center=4, size=8)
    a, again, b = (Camelyon17(root, fraction=0.5, fraction_seed=s, image_size=8).split("train") for s in (0, 0, 1))
    assert torch.equal(a, again) and not torch.equal(a, b)


def test_camelyon_fraction_keeps_wilds_count(tmp_path) -> None:
    """WILDS's get_subset(frac) keeps int(np.round(n * frac)) patches of each split (owai at least 1):
    12 training patches at 0.3 keep 4 (3.6 rounded), the 6 of centre 1 keep 2 (1.8). Before, owai
    truncated (3 and 1; at the recipes' 0.005, id_val 167 and val 174 where WILDS keeps 168 and 175)."""
    root = make_camelyon(tmp_path / "data", train_per_center=4, id_val_per_center=2, eval_per_center=6, size=8)
    whole = Camelyon17(root, image_size=8)
    part = Camelyon17(root, fraction=0.3, image_size=8)
    for name in ("train", "id_val", "val", "test"):
        n = whole.split(name).numel()
        assert part.split(name).numel() == max(1, int(np.round(n * 0.3))), name
    assert (part.split("train").numel(), part.split("val").numel()) == (4, 2)


def test_camelyon_standard_sampler_reshuffles_every_epoch_per_stage() -> None:
    """camelyon17 docstring: StandardSampler's epoch e is a permutation keyed by (seed, stage, e), WILDS's
    shuffling loader. Mutants: one permutation reused every epoch; the stage left out of the key."""
    s = StandardSampler(40, 8, seed=0, stage="round0")
    epoch0 = torch.cat([s.positions(t) for t in range(5)])
    epoch1 = torch.cat([s.positions(t) for t in range(5, 10)])
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist()) == list(range(40))
    assert not torch.equal(epoch0, epoch1)
    other = StandardSampler(40, 8, seed=0, stage="round1")
    assert not torch.equal(epoch0, torch.cat([other.positions(t) for t in range(5)]))
    fresh = StandardSampler(40, 8, seed=0, stage="round0")  # a resume at step 7
    assert torch.equal(fresh.positions(7), s.positions(7))


def test_camelyon_uniform_group_sampler_is_keyed_by_step() -> None:
    """camelyon17 docstring: UniformGroupSampler draws are keyed by (seed, stage, step). Mutant: the
    step left out (every step the same batch)."""
    groups = torch.tensor([0] * 30 + [1] * 30)
    s = UniformGroupSampler(groups, 8, seed=0, stage="round1")
    assert not torch.equal(s.positions(0), s.positions(1))
    assert torch.equal(UniformGroupSampler(groups, 8, seed=0, stage="round1").positions(3), s.positions(3))


def test_camelyon_patches_are_imagenet_normalised(tmp_path) -> None:
    """camelyon17 docstring (WILDS image_base): ToTensor and ImageNet normalisation, mean (0.485,
    0.456, 0.406), std (0.229, 0.224, 0.225). Mutant: CIFAR statistics."""
    root = make_camelyon(tmp_path / "data", train_per_center=2, id_val_per_center=1, eval_per_center=2, size=8)
    data = Camelyon17(root, image_size=8)
    i = int(data.split("test")[0])
    raw = np.asarray(Image.open(data.path(i)).convert("RGB"), dtype=np.float64)
    np.testing.assert_allclose(pixels(data.tensor(i)), raw, atol=1e-3)


# ------------------------------------------------------------------------------------ image transforms

def test_normalisation_statistics_are_the_documented_numbers() -> None:
    """docs/decisions.md: CIFAR's (0.4914, 0.4822, 0.4465) / (0.2023, 0.1994, 0.2010) for the cifar
    style, ImageNet's for the others. Mutant: the other CIFAR std often quoted (0.2470, 0.2435, 0.2616)."""
    assert normalisation("cifar") == CIFAR
    for style in ("domainbed", "imagenet", "fewshot", "vit"):
        assert normalisation(style) == IMAGENET


def test_domainbed_evaluation_resize_is_bilinear() -> None:
    """DomainBed's eval transform is Resize((size, size)) with torchvision's default, bilinear.
    Mutant: bicubic."""
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (23, 31, 3), dtype=np.uint8))
    want = np.asarray(image.resize((12, 12), Image.Resampling.BILINEAR), dtype=np.float64)
    np.testing.assert_allclose(pixels(eval_transform(image, 12)), want, atol=1e-3)


def test_fewshot_evaluation_resizes_to_1_15_size_then_crops() -> None:
    """Chen et al. 2019's test transform: Resize([int(1.15 s), int(1.15 s)]) then CenterCrop(s): at
    s = 224 that is 257 x 257, 16 pixels cut off the top and left. Mutant: 1.14 (255 x 255)."""
    rng = np.random.default_rng(1)
    image = Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8))
    big = np.asarray(image.resize((257, 257), Image.Resampling.BILINEAR), dtype=np.float64)
    top = round((257 - 224) / 2.0)
    want = big[top:top + 224, top:top + 224]
    np.testing.assert_allclose(pixels(eval_transform(image, 224, "fewshot")), want, atol=1e-3)


def test_center_crop_rounds_as_torchvision() -> None:
    """torchvision's CenterCrop: top = int(round((h - size) / 2.0)), likewise left; a 35-pixel side cut
    to 32 starts at round(1.5) = 2. Mutant: floor division (1)."""
    cols = np.tile(np.arange(35, dtype=np.uint8), (35, 1))
    image = Image.fromarray(np.stack([cols, cols.T, cols], axis=-1))
    out = np.asarray(center_crop(image, 32))
    assert out.shape == (32, 32, 3) and int(out[0, 0, 0]) == 2 and int(out[0, 0, 1]) == 2


# ------------------------------------------------------------------------------------ classification

def test_cub_classes_follow_their_ids_not_the_file_order(tmp_path) -> None:
    """classification docstring: class k is the k-th class id (classes.txt's ids, sorted), which Chen
    et al.'s split rule (class index i % 4) reads. A classes.txt listed out of order must not change
    the labels. Mutant: classes taken in the file's line order."""
    from test_classification_data import make_cub

    base = make_cub(tmp_path)
    lines = (base / "classes.txt").read_text().splitlines()
    (base / "classes.txt").write_text("\n".join(reversed(lines)) + "\n")
    data = read_cub(base, "all")
    assert data.classes == [f"{c + 1:03d}.Bird_{c}" for c in range(8)]
    assert data.labels.tolist() == [c for c in range(8) for _ in range(3)]


# ------------------------------------------------------------------------------------------------ MNIST

def test_mnist_images_are_the_idx_bytes_row_major_beside_their_labels() -> None:
    """The IDX format: images after a 16-byte header, 784 bytes each, row-major; labels after an
    8-byte header. Image i must be bytes 16 + 784 i ... of the file and label i byte 8 + i (MNIST's
    t10k starts 7, 2, 1, 0, 4). Mutants: the images transposed; the images in another order than
    their labels."""
    folder = mn.PACKAGED_DIR
    raw_images = gzip.decompress((folder / "t10k-images-idx3-ubyte.gz").read_bytes())
    raw_labels = gzip.decompress((folder / "t10k-labels-idx1-ubyte.gz").read_bytes())
    data = mn.load_mnist_idx(folder, "test")
    assert data.labels[:5].tolist() == [7, 2, 1, 0, 4]
    for i in (0, 1, 2, 4321, 9999):
        want = np.frombuffer(raw_images, np.uint8, 784, 16 + 784 * i).reshape(28, 28)
        assert np.array_equal(data.images[i].numpy(), want), i
        assert int(data.labels[i]) == raw_labels[8 + i]


# --------------------------------------------------------------------------------------------- RegBench

def test_regbench_vocabulary_is_seq_icls() -> None:
    """regbench docstring: `.` = 0, letters a..r = 1..18, `|` = 19 at vocab_size 20 (vocab_size - 2
    letters from `a`). Mutant: the letters b..s."""
    cfg = RegBenchConfig()
    assert "".join(cfg.symbols) == ".abcdefghijklmnopqr|"
    assert cfg.letter_ids == tuple(range(1, 19))


def test_regbench_sequences_hold_10_to_19_strings() -> None:
    """seq_icl: each sequence has randint(10, 20) strings (upper bound exclusive) joined by `|`, on
    every split. 300 sequences reach both ends. Mutant: up to 20 strings (the 30 sequences of the
    older test never drew 20)."""
    data = make_regbench(num_examples=150, num_test_examples=150, seed=2)
    counts = [int((s == data.config.sep_id).sum()) + 1
              for split in (data.train, data.val, data.test) for s in split.sequences]
    assert min(counts) == 10 and max(counts) == 19


def test_regbench_draws_train_then_test_then_val(monkeypatch: pytest.MonkeyPatch) -> None:
    """regbench docstring: the master RNG draws the sequences of train, then test, then val (seq_icl's
    order), so the same seed gives seq_icl's test sequences. Mutant: val drawn before test."""
    import owai.data.regbench as rb

    made: list[np.ndarray] = []
    real = rb._sequence

    def recording(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(rb, "_sequence", recording)
    data = make_regbench(num_examples=6, num_test_examples=6, seed=0)
    expected = [*data.train.sequences, *data.test.sequences, *data.val.sequences]
    assert len(made) == len(expected) == 12
    assert all(a is b for a, b in zip(made, expected))


# --------------------------------------------------------------------------------------- recall episodes

def test_training_mixture_covers_every_shot_count_fact_count_and_label_kind() -> None:
    """recall.training_episode: shots uniform in 1..max_shots, labels semantic or anonymous (each half
    the time), facts 1..max_facts. Mutants: shots never max_shots; labels always semantic."""
    pieces, tokens = Pieces(toy_encode), filler(2000)
    semantic = {pieces.word(w) for w in SEMANTIC_LABELS}
    anonymous = {pieces.word(f"class_{j}") for j in range(2)}
    rng = np.random.default_rng(0)
    shots, kinds, facts = set(), set(), set()
    for _ in range(120):
        ep = training_episode(rng, pieces, tokens, 400, 0.5, max_facts=3, max_shots=3, classes=2, items_per_class=4)
        answers = {q.answer for q in ep.queries}
        if ep.queries[0].group in ("seen", "unseen"):
            shots.add(len(ep.spans) // 2)  # one span per demonstration, shots per class
            kinds.add("semantic" if answers <= semantic else "anonymous" if answers <= anonymous else "?")
        else:
            facts.add(len(ep.queries))
    assert shots == {1, 2, 3} and kinds == {"semantic", "anonymous"} and facts == {1, 2, 3}


def test_recall_facts_stay_inside_a_narrow_bucket() -> None:
    """recall docstring: a fact of bucket `mid` sits at a distance in [window, train_length) from its
    answer. With window 100 and training length 102 only 100 and 101 qualify. Mutant: the range's
    upper end one past (distance 99, a `near` fact asked for as `mid`; wide buckets almost never
    drew it)."""
    pieces, tokens = Pieces(toy_encode), filler(1000)
    distances = set()
    for seed in range(40):
        ep = recall_episode(np.random.default_rng(seed), pieces, tokens, 300, ["mid"], window=100, train_length=102)
        (q,) = ep.queries
        assert q.group == "mid" and q.distance in (100, 101), q.distance
        distances.add(q.distance)
    assert distances == {100, 101}


def test_fact_values_cover_every_two_digit_number() -> None:
    """recall.Pieces: a value has `value_digits` digits, n_values = 9 x 10^(d-1) of them (chance recall
    1 / n_values): 10..99 at two digits. Mutant: 99 never drawn."""
    pieces = Pieces(toy_encode, value_digits=2)
    rng = np.random.default_rng(0)
    values = {int(pieces.value(rng)) for _ in range(3000)}
    assert values == set(range(10, 100)) and pieces.n_values == 90


# ----------------------------------------------------------------------------------------- linear tasks

def test_random_orthonormal_is_haar_not_lapacks_sign_convention() -> None:
    """linear_tasks.random_orthonormal: QR's Q with its columns multiplied by sign(diag(R)) (Mezzadri
    2007), so the matrix is Haar-distributed: each entry is symmetric about 0. Without the correction
    LAPACK's Householder QR makes Q[0, 0] negative every time. Mutant: the correction removed."""
    rng = np.random.default_rng(0)
    diag = np.array([np.diag(random_orthonormal(4, rng)) for _ in range(400)])  # (400, 4)
    positive = (diag > 0).mean(axis=0)
    assert ((positive > 0.4) & (positive < 0.6)).all(), positive


# ---------------------------------------------------------------------------------------------- few-shot

def test_fewshot_support_and_query_are_a_random_draw_of_the_class() -> None:
    """evals.fewshot: per class a random permutation of its examples, the first n_shot as support and
    the next n_query as query. Over 40 episodes each class shows more than its first n_shot + n_query
    examples, in both roles. Mutant: no permutation (always the class's first examples)."""
    labels = np.repeat(np.arange(5), 30)
    episodes = sample_episodes(labels, n_way=5, n_shot=1, n_query=5, n_episodes=40, seed=0)
    used_support = {int(i) for e in episodes for i in e.support.reshape(-1)}
    used_query = {int(i) for e in episodes for i in e.query.reshape(-1)}
    assert len(used_support) > 5 * 6 and len(used_query) > 5 * 6
    for e in episodes:
        assert not set(e.support.reshape(-1).tolist()) & set(e.query.reshape(-1).tolist())
