"""Rich representations: Cat_n linear probing (thesis §2.2, Table 2.2; spec rich_features.md §6.1, §6.2).

The first slice of `owai rich-features` (issue #24): two stages of one method, chosen by `stage`.

* `pretrain` trains ONE network (`model.backbone`, an `owai.models.vision` backbone) by ERM on the
  base classes (`data.base`, `data.base_classes`) with the run's `seed`, through `owai.train.train_loop`
  (stage `pretrain`: checkpoints, resume). Its final weights (a torchvision-keyed state dict, base-class
  head included) go to `<cache>/pretrained/<backbone>-<key>.safetensors`, the cache `dropout-ft`'s
  pre-training uses, keyed by the pre-training settings and the seed (`pretrain_key`); a network already
  there is not trained again. n networks that differ only by seed = a sweep over seeds (the recipe's
  `sweep.seeds`), so 10 ImageNet ResNet50s are one SLURM array. Measured: the base-class test accuracy.
* `probe` loads n pretrained networks (`probe.networks`: pretrain run directories or pretrain sweep
  directories; else the cache entries of `probe.seeds`, default 0..n-1, under this config's pre-training
  settings), builds `ConcatFeatures(frozen=True)`, extracts the target task's features once, and trains
  linear probes `ProbeHead` (BN1d -> Linear; SGD Nesterov, momentum 0.9, the step schedule of §6.2 in
  epochs, no weight decay on BN): one per network (their mean = `single.acc`; the first is Cat_1) and one
  per Cat_k, k in `probe.sizes` (the first k networks). `catsub{k}.acc` averages the logits of the first
  k per-network probes (`catsub_logits`). Every probe is its own resumable `train_loop` stage
  (`probe-net{i}`, `probe-cat{k}`) whose batches are a function of (seed, stage, epoch, step), so a killed
  probe resumes to the same result.

Accuracies are measured on the target's test split after the last epoch. The reference script reports
the best epoch on the test set (spec §6.2); owai does not select on the test set. The weight-decay grid
of §6.2 is not searched here yet (`probe.weight_decay` is one value).

Datasets: `mnist` (the official files found by the data-root rule; 60k train / 10k test), `mnist-t10k`
(the packaged 10k test file split 80/20 by a keyed permutation: no download), `digits` (scikit-learn's
8x8 digits, split the same way), and the readers of `owai.data.classification` (cifar10, cifar100,
imagenet, inat18). Base and target classes of the same label space (the three digit sets share one)
must be disjoint (`disjoint_split`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from owai import console
from owai.config import BaseConfig
from owai.errors import DataMissing, OwaiError
from owai.methods import Method, Outcome
from owai.runs import Run

DIGIT_SETS = ("mnist", "mnist-t10k", "digits")  # one label space: the digits "0".."9"
DATASETS = (*DIGIT_SETS, "cifar10", "cifar100", "imagenet", "inat18")
TEST_SPLIT = {"imagenet": "val", "inat18": "val"}  # the split a dataset is evaluated on
DIGITS = [str(i) for i in range(10)]
STAGES = ("pretrain", "probe")
VERSION = 1  # of the pre-training cache key


@dataclass
class DataConfig:
    root: str = ""  # data root (or the dataset's own folder); "" = $OWAI_DATA, then the cache
    base: str = "imagenet"  # pre-training data (one of DATASETS)
    base_classes: list[str] = field(default_factory=list)  # [] = every class of `base`
    target: str = "cifar100"  # the probe's transfer task
    target_classes: list[str] = field(default_factory=list)  # [] = every class of `target`
    image_size: int = 224
    augment: bool = True  # pre-training: DomainBed's training transform (RandomResizedCrop, flip, jitter)
    limit_per_class: int = 0  # keep at most this many images per class of every split (0 = all; tests)
    split_seed: int = 0  # mnist-t10k / digits: the keyed 80/20 train/test split
    workers: int = 4  # loader processes (0 = in the training process)
    eval_batch_size: int = 256


@dataclass
class ModelConfig:
    backbone: str = "resnet50"  # an owai.models.vision backbone, trained from scratch by `pretrain`


@dataclass
class PretrainConfig:
    """TH A.2.1 / spec §6.1: SGD momentum 0.9, lr 0.1, batch 256, weight decay 1e-4 (BN included),
    90 epochs, x0.1 at epochs 30 and 60. Epochs may be fractional (steps = round(epochs * N / batch))."""

    epochs: float = 90.0
    batch_size: int = 256
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-4
    milestones: list[float] = field(default_factory=lambda: [30.0, 60.0])  # in epochs
    gamma: float = 0.1
    checkpoint_every: int = 1000  # updates
    log_every: int = 50
    precision: Literal["auto", "float32", "bfloat16"] = "auto"  # auto = bfloat16 autocast on CUDA


@dataclass
class ProbeConfig:
    """Spec §6.2: BN1d (affine) -> Linear, weights N(0, 0.01^2); SGD Nesterov, momentum 0.9, lr 0.01,
    x0.1 at epochs 8, 16, 24, 28 epochs, batch 256, no weight decay on the BN parameters."""

    n: int = 10  # networks concatenated (Cat_n)
    seeds: list[int] = field(default_factory=list)  # the networks' seeds in the cache ([] = 0..n-1)
    networks: list[str] = field(default_factory=list)  # pretrain run or sweep directories (replace seeds)
    sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 10])  # Cat_k reported, k <= n
    catsub: bool = True
    epochs: int = 28
    milestones: list[int] = field(default_factory=lambda: [8, 16, 24])
    gamma: float = 0.1
    lr: float = 0.01
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 1e-4  # on the Linear only (wd_skip_bn); the thesis searches a grid
    batch_size: int = 256
    checkpoint_every: int = 500  # updates
    log_every: int = 50


@dataclass
class Config(BaseConfig):
    stage: Literal["pretrain", "probe"] = "pretrain"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)


class RichFeatures(Method):
    Config = Config
    cli = "owai rich-features"
    resume_overrides = ("pretrain.lr", "probe.lr")

    @staticmethod
    def validate(cfg: Config) -> None:
        from owai.data.classification import disjoint_split
        from owai.models.vision import BACKBONES

        d, m, p, q = cfg.data, cfg.model, cfg.pretrain, cfg.probe
        for name in (d.base, d.target):
            if name not in DATASETS:
                raise OwaiError(f"data.base / data.target {name!r}: choose one of {', '.join(DATASETS)}")
        if m.backbone not in BACKBONES:
            raise OwaiError(f"unknown backbone {m.backbone!r}; known: {', '.join(sorted(BACKBONES))}")
        for name in ("image_size", "eval_batch_size"):
            if getattr(d, name) < 1:
                raise OwaiError(f"data.{name} must be >= 1, got {getattr(d, name)}")
        if d.workers < 0 or d.limit_per_class < 0:
            raise OwaiError("data.workers and data.limit_per_class must be >= 0")
        for what, name, classes in (("base", d.base, d.base_classes), ("target", d.target, d.target_classes)):
            if name in DIGIT_SETS:
                unknown = [c for c in classes if c not in DIGITS]
                if unknown:
                    raise OwaiError(f"data.{what}_classes: {name} has classes 0-9, not {', '.join(map(repr, unknown))}")
        if _same_labels(d.base, d.target):  # one label space: the probe's classes must be new ones
            disjoint_split(d.base_classes or _all_classes(d.base), d.target_classes or _all_classes(d.target))
        if not (p.epochs > 0 and p.batch_size >= 1 and p.lr > 0 and p.weight_decay >= 0 and 0 <= p.momentum < 1
                and p.gamma > 0 and p.checkpoint_every >= 1 and p.log_every >= 1):
            raise OwaiError("pretrain: need epochs > 0, batch_size >= 1, lr > 0, weight_decay >= 0, 0 <= momentum < 1, "
                            "gamma > 0, checkpoint_every >= 1, log_every >= 1")
        if q.n < 1:
            raise OwaiError(f"probe.n must be >= 1, got {q.n}")
        bad = [k for k in q.sizes if not 1 <= k <= q.n]
        if not q.sizes or bad or len(set(q.sizes)) != len(q.sizes):
            raise OwaiError(f"probe.sizes {q.sizes}: give distinct sizes k in 1..probe.n={q.n} (Cat_k = the first k networks)")
        if not (q.epochs >= 1 and q.batch_size >= 2 and q.lr > 0 and q.weight_decay >= 0 and 0 <= q.momentum < 1
                and q.gamma > 0 and q.checkpoint_every >= 1 and q.log_every >= 1):
            raise OwaiError("probe: need epochs >= 1, batch_size >= 2 (BatchNorm1d), lr > 0, weight_decay >= 0, "
                            "0 <= momentum < 1, gamma > 0, checkpoint_every >= 1, log_every >= 1")
        if q.seeds and q.networks:
            raise OwaiError("give probe.networks (run directories) or probe.seeds (cache entries), not both")
        if q.seeds and len(q.seeds) != q.n:
            raise OwaiError(f"probe.n={q.n} but {len(q.seeds)} seeds given ({q.seeds})")
        if len(set(q.seeds)) != len(q.seeds):
            raise OwaiError(f"probe.seeds {q.seeds} has duplicates: Cat_n's networks differ by seed")
        stage_data = [d.base] if cfg.stage == "pretrain" else [d.target]
        for name in stage_data:
            check_data(name, d.root)
        if cfg.stage == "probe":
            find_networks(cfg)  # missing, unfinished, mismatched or overlapping networks: one line, nothing written

    def run(self, cfg: Config, run: Run) -> Outcome:
        if cfg.stage == "pretrain":
            return run_pretrain(cfg, run)
        return run_probe(cfg, run)


# -- data ---------------------------------------------------------------------------------------


def _same_labels(a: str, b: str) -> bool:
    return a == b or (a in DIGIT_SETS and b in DIGIT_SETS)


def _all_classes(name: str) -> list[str]:
    if name in DIGIT_SETS:
        return list(DIGITS)
    raise OwaiError(f"data.base and data.target are both {name}: list data.base_classes and data.target_classes "
                    "(disjoint class sets)")


def check_data(name: str, root: str) -> None:
    """A one-line DataMissing (naming the fetch command or the manual step) when `name` is not here."""
    if name == "mnist":
        from owai.data.mnist import mnist_dir

        for split in ("train", "test"):
            try:
                mnist_dir(split, root or None)
            except DataMissing as e:
                raise DataMissing(f"{e} (or data.base / data.target = mnist-t10k: the packaged test file only)") from None
    elif name not in ("mnist-t10k", "digits"):
        from owai.data import registry

        registry.require(name, root or None)


def _keyed_split(n: int, split: str, seed: int) -> torch.Tensor:
    """The train (80 %) or test (20 %) indices of a set without an official split, keyed by `seed`."""
    from owai.runtime import generator

    order = torch.randperm(n, generator=generator(seed, "rich-split", n))
    cut = (4 * n) // 5
    return order[:cut] if split == "train" else order[cut:]


def load_split(cfg: Config, name: str, split: Literal["train", "test"], classes: list[str]) -> Any:
    """`split` of dataset `name` restricted to `classes` (relabelled 0..k-1 in that order; [] = all), at
    most `data.limit_per_class` images per class: an `owai.data.classification.ClassificationData`."""
    from owai.data import classification as cl

    d = cfg.data
    if name == "mnist":
        from owai.data.mnist import load_mnist

        m = load_mnist(split, root=d.root or None)
        data = cl.ClassificationData(m.images, m.labels, list(DIGITS), f"MNIST {split}")
    elif name in ("mnist-t10k", "digits"):
        if name == "digits":
            full = cl.load_digits()
        else:
            from owai.data.mnist import PACKAGED_DIR, load_mnist_idx

            m = load_mnist_idx(PACKAGED_DIR, "test")
            full = cl.ClassificationData(m.images, m.labels, list(DIGITS), "MNIST t10k (packaged)")
        data = cl._subset(full, _keyed_split(len(full), split, d.split_seed))
    else:
        data = cl.load(name, TEST_SPLIT.get(name, "test") if split == "test" else "train", d.root or None)
    if classes:
        data = cl.select_classes(data, classes)
    if d.limit_per_class:
        from owai.runtime import generator

        order = torch.randperm(len(data), generator=generator(d.split_seed, "rich-limit", name, split))
        keep, count = [], [0] * len(data.classes)
        for i in order.tolist():
            y = int(data.labels[i])
            if count[y] < d.limit_per_class:
                count[y] += 1
                keep.append(i)
        data = cl._subset(data, torch.tensor(sorted(keep), dtype=torch.int64))
    if len(data) == 0:
        raise OwaiError(f"{name} {split} has no images of classes {classes or 'all'}")
    return data


class OneDomain:
    """A ClassificationData seen as the one-domain dataset `owai.data.domainbed`'s StepBatches and eval
    batches read (image(0, i) as RGB, labels(0))."""

    def __init__(self, data: Any) -> None:
        self.data, self.name, self.domains, self.classes, self.skipped = data, data.source, ["all"], data.classes, 0

    def size(self, domain: int) -> int:
        return len(self.data)

    def labels(self, domain: int) -> torch.Tensor:
        return self.data.labels

    def image(self, domain: int, index: int) -> Any:
        return self.data.image(index)


def _batches(cfg: Config, data: Any) -> Any:
    """Eval-transformed (x, y) batches of every example of `data`, in order."""
    from owai.data.domainbed import eval_batches

    return eval_batches(OneDomain(data), 0, torch.arange(len(data)), cfg.data.image_size, cfg.data.eval_batch_size,
                        cfg.data.workers, torch.cuda.is_available())


def _precision(cfg: Config, device: torch.device) -> str:
    from owai.runtime import auto_precision

    return auto_precision(cfg.pretrain.precision, device)


# -- pretrain -----------------------------------------------------------------------------------


def pretrain_key(cfg: Config, seed: int) -> str:
    """The cache key of the network `pretrain` trains at `seed`: every setting it depends on."""
    from owai.config import to_dict

    d = cfg.data
    what = {"method": "rich_features", "version": VERSION, "backbone": cfg.model.backbone, "seed": seed,
            "pretrain": {k: v for k, v in to_dict(cfg.pretrain).items() if k not in ("checkpoint_every", "log_every")},
            "base": d.base, "base_classes": d.base_classes, "root": d.root, "image_size": d.image_size,
            "augment": d.augment, "limit_per_class": d.limit_per_class, "split_seed": d.split_seed}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def weights_path(cfg: Config, seed: int) -> Path:
    """`<cache>/pretrained/<backbone>-<key>.safetensors` (the cache of dropout-ft's pre-training)."""
    from owai.io import cache_root

    return cache_root() / "pretrained" / f"{cfg.model.backbone}-{pretrain_key(cfg, seed)}.safetensors"


def build_network(backbone: str, n_classes: int, seed: int, state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """An owai.models.vision backbone with an `n_classes` head, initialised from (seed, backbone)."""
    from owai.models.vision import build_backbone
    from owai.runtime import derive_seed

    rng = torch.get_rng_state()
    torch.manual_seed(derive_seed(seed, "pretrain-init", backbone))
    net = build_backbone(backbone, num_classes=n_classes)
    torch.set_rng_state(rng)
    if state is not None:
        try:
            net.load_state_dict(state)
        except RuntimeError as e:
            raise OwaiError(f"pretrained weights do not fit {backbone}: {str(e).splitlines()[0]}") from None
    return net


def run_pretrain(cfg: Config, run: Run) -> Outcome:
    """Stage `pretrain`: one network on the base classes (or its cache entry), then its base test accuracy."""
    from safetensors.torch import load_file, save

    from owai.data.domainbed import StepBatches
    from owai.io import atomic_write_bytes
    from owai.methods.dropout_ft import _StepStream
    from owai.train import LoopConfig, train_loop

    d, p, device = cfg.data, cfg.pretrain, run.device
    train_set = load_split(cfg, d.base, "train", d.base_classes)
    test_set = load_split(cfg, d.base, "test", d.base_classes)
    classes = train_set.classes
    path = weights_path(cfg, cfg.seed)
    state, cached = None, False
    if path.is_file():
        try:
            state, cached = load_file(str(path)), True
            console.info(f"network seed {cfg.seed}: cached at {path}")
        except Exception:  # noqa: BLE001 - a corrupt cache entry is rebuilt
            console.info(f"rebuilding the corrupt cache entry {path}")
    per_epoch = len(train_set) / p.batch_size
    steps = max(1, round(p.epochs * per_epoch))
    if state is None:
        net = build_network(cfg.model.backbone, len(classes), cfg.seed).to(device)
        batches = StepBatches(OneDomain(train_set), [0], [torch.arange(len(train_set))], p.batch_size, d.image_size,
                              d.augment, cfg.seed, steps)
        stream = _StepStream(batches, d.workers, device)
        optimizer = torch.optim.SGD(net.parameters(), lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)
        marks = [round(m * per_epoch) for m in p.milestones]

        def loss_at(step: int, micro: int) -> torch.Tensor:
            x, y = stream.at(step)
            return F.cross_entropy(net(x), y)

        loop = LoopConfig(steps=steps, checkpoint_every=min(p.checkpoint_every, steps), log_every=min(p.log_every, steps),
                          precision=_precision(cfg, device))
        train_loop(run, "pretrain", net, optimizer, loss_at, loop,
                   lr_at=lambda s: p.lr * p.gamma ** sum(s >= m for m in marks))
        state = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, save(state))
    net = build_network(cfg.model.backbone, len(classes), cfg.seed, state).to(device).eval()
    correct = 0
    with torch.no_grad():
        for x, y in _batches(cfg, test_set):
            correct += int((net(x.to(device)).argmax(1).cpu() == y).sum())
    acc = correct / len(test_set)
    console.info(f"network seed {cfg.seed}: base test accuracy {acc:.4f}")
    details = {"weights": str(path), "cached": cached, "seed": cfg.seed, "key": pretrain_key(cfg, cfg.seed),
               "classes": classes, "steps": steps, "feature_dim": int(net.feature_dim),
               "split_sizes": {"train": len(train_set), "test": len(test_set)}}
    return Outcome({"pretrain.base_acc": acc}, details)


# -- probe: the networks ------------------------------------------------------------------------


@dataclass
class Network:
    """One pretrained network the probe reads: where its weights are and what it was trained on."""

    seed: int
    label: str  # for messages: the run directory or the cache file
    backbone: str
    n_classes: int  # of its base-class head
    checkpoint: Path | None  # the pretrain run's final checkpoint (preferred), else
    weights: Path | None  # the cache file


def _pretrain_runs(path: Path) -> list[Path]:
    """A pretrain run directory, or every point of a pretrain sweep directory (in seed order)."""
    from owai.sweep import is_sweep_dir, open_sweep, point_status

    if not is_sweep_dir(path):
        return [path]
    sweep = open_sweep(path)
    pending = [p.label for p in sweep.points if point_status(sweep, p) != "complete"]
    if pending:
        raise OwaiError(f"pretrain sweep {path} has unfinished points ({', '.join(pending[:3])}); finish it with "
                        f"`owai rich-features --stage pretrain --resume {path}`")
    return [sweep.point_dir(p) for p in sorted(sweep.points, key=lambda p: p.seed)]


def _network_of_run(cfg: Config, path: Path) -> tuple[Network, dict[str, Any]]:
    """The finished pretrain run at `path` as a Network, with its resolved params."""
    from owai.checkpoint import latest_checkpoint

    run = Run.open(path)
    resolved = run.read_config()
    params = resolved["params"]
    if resolved.get("method") != "rich_features" or params.get("stage") != "pretrain":
        raise OwaiError(f"{path} is not a rich-features pretrain run")
    results = run.results()
    if run.status() != "complete" or results is None:
        raise OwaiError(f"{path} is not finished; resume it with `owai rich-features --stage pretrain --resume {path}`")
    details = results.get("details", {})
    last = latest_checkpoint(run.checkpoints("pretrain"))
    final = last is not None and int(last.name[5:]) == int(details.get("steps", -1))
    weights = Path(details["weights"]) if details.get("weights") else None
    if not final and (weights is None or not weights.is_file()):
        raise OwaiError(f"{path} has neither its final checkpoint nor its cached weights ({weights})")
    net = Network(int(params["seed"]), str(path), params["model"]["backbone"], len(details.get("classes", [])),
                  last if final else None, weights)
    return net, params


def find_networks(cfg: Config) -> list[Network]:
    """The probe's n networks, checked: their number is probe.n, they exist and are finished, have
    equal feature widths and distinct seeds, were pre-trained at data.image_size, and their base
    classes do not overlap the target classes. Every failure is one line, before any run directory."""
    from owai.data.classification import disjoint_split
    from owai.models.vision import BACKBONES

    d, q = cfg.data, cfg.probe
    nets: list[Network] = []
    if q.networks:
        paths = [p for text in q.networks for p in _pretrain_runs(Path(text).expanduser())]
        if len(paths) != q.n:
            raise OwaiError(f"probe.n={q.n} but {len(paths)} pretrained networks given ({', '.join(q.networks)})")
        for path in paths:
            net, params = _network_of_run(cfg, path)
            base = params["data"]
            if base["image_size"] != d.image_size:
                raise OwaiError(f"{path} was pre-trained at {base['image_size']} px, the probe reads {d.image_size} px "
                                f"(set data.image_size={base['image_size']})")
            if _same_labels(base["base"], d.target):
                try:
                    disjoint_split(base["base_classes"] or _all_classes(base["base"]),
                                   d.target_classes or _all_classes(d.target))
                except OwaiError as e:
                    raise OwaiError(f"{path}: {e}") from None
            nets.append(net)
    else:
        seeds = q.seeds or list(range(q.n))
        n_classes = len(d.base_classes) if d.base_classes else (10 if d.base in DIGIT_SETS else 0)
        for seed in seeds:
            path = weights_path(cfg, seed)
            if not path.is_file():
                raise DataMissing(f"pretrained network seed {seed} is not in the cache ({path}); run "
                                f"`owai rich-features --stage pretrain` with the same settings first, or give "
                                "probe.networks (run directories)")
            nets.append(Network(seed, str(path), cfg.model.backbone, n_classes, None, path))
    seeds = [n.seed for n in nets]
    if len(set(seeds)) != len(seeds):
        raise OwaiError(f"the networks' seeds {seeds} repeat: Cat_n concatenates n networks that differ by seed")
    widths = {}
    for net in nets:
        if net.backbone not in BACKBONES:
            raise OwaiError(f"{net.label}: unknown backbone {net.backbone!r}")
        widths[net.label] = _feature_dim(net.backbone)
    if len(set(widths.values())) != 1:
        shown = ", ".join(f"{w} ({label})" for label, w in list(widths.items())[:4])
        raise OwaiError(f"the backbones have different feature sizes: {shown}; Cat_n's networks differ only by seed")
    return nets


@functools.lru_cache(maxsize=None)
def _feature_dim(backbone: str) -> int:
    """The backbone's feature width (built once per name)."""
    from owai.models.vision import build_backbone

    return int(build_backbone(backbone, num_classes=1).feature_dim)


def load_network(net: Network) -> torch.nn.Module:
    """The network's backbone (torchvision keys, its base-class head) with its pretrained weights."""
    from safetensors.torch import load_file

    from owai.checkpoint import load_checkpoint

    if net.checkpoint is not None:
        _, state = load_checkpoint(net.checkpoint)
        weights = state["model"]
    else:
        try:
            weights = load_file(str(net.weights))
        except Exception as e:  # noqa: BLE001 - a corrupt cache entry
            raise OwaiError(f"cannot read pretrained weights {net.weights}: {type(e).__name__}") from None
    head = next((v.shape[0] for k, v in weights.items() if k == "fc.weight"), net.n_classes or 1)
    return build_network(net.backbone, int(head), net.seed, weights)


# -- probe: features and heads ------------------------------------------------------------------


@torch.no_grad()
def extract(cfg: Config, cat: Any, data: Any, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The n feature blocks [(N, d_i)] (float32, CPU) of every example of `data`, and its labels."""
    blocks: list[list[torch.Tensor]] = [[] for _ in cat.backbones]
    labels = []
    for x, y in _batches(cfg, data):
        for i, z in enumerate(cat.per_network(x.to(device))):
            blocks[i].append(z.float().cpu())
        labels.append(y)
    return [torch.cat(b) for b in blocks], torch.cat(labels)


def probe_batch(step: int, per_epoch: int, size: int, n: int, seed: int, stage: str) -> torch.Tensor:
    """The example indices of update `step`: epoch step // per_epoch's keyed permutation, sliced."""
    from owai.runtime import generator

    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(n, generator=generator(seed, "probe-batch", stage, epoch))
    return order[k * size : (k + 1) * size]


def fit_probe(cfg: Config, run: Run, stage: str, z: torch.Tensor, y: torch.Tensor, n_classes: int,
              device: torch.device) -> torch.nn.Module:
    """A ProbeHead on features `z` (N, D), trained through train_loop as stage `stage` (resumable)."""
    from owai.models.rich import ProbeHead
    from owai.runtime import generator
    from owai.train import LoopConfig, train_loop

    q = cfg.probe
    head = ProbeHead(z.shape[1], n_classes, generator=generator(cfg.seed, "probe-init", stage)).to(device)
    optimizer = torch.optim.SGD(head.param_groups(q.weight_decay), lr=q.lr, momentum=q.momentum, nesterov=q.nesterov)
    size = min(q.batch_size, len(z))
    per_epoch = max(1, len(z) // size)  # the last incomplete batch is dropped (BN1d needs >= 2 examples)
    steps = q.epochs * per_epoch
    z, y = z.to(device), y.to(device)

    def loss_at(step: int, micro: int) -> torch.Tensor:
        idx = probe_batch(step, per_epoch, size, len(z), cfg.seed, stage).to(device)
        return F.cross_entropy(head(z[idx]), y[idx])

    loop = LoopConfig(steps=steps, checkpoint_every=min(q.checkpoint_every, steps), log_every=min(q.log_every, steps))
    train_loop(run, stage, head, optimizer, loss_at, loop,
               lr_at=lambda s: q.lr * q.gamma ** sum(s >= m * per_epoch for m in q.milestones))
    return head.eval()


@torch.no_grad()
def _logits(head: torch.nn.Module, z: torch.Tensor, device: torch.device) -> torch.Tensor:
    return head.eval()(z.to(device)).float().cpu()


def _acc(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(1) == y).float().mean())


def run_probe(cfg: Config, run: Run) -> Outcome:
    """Stage `probe`: Cat_k and per-network linear probes on frozen features, catsub averages."""
    from owai.models.rich import ConcatFeatures, catsub_logits, strip_head

    d, q, device = cfg.data, cfg.probe, run.device
    nets = find_networks(cfg)
    train_set = load_split(cfg, d.target, "train", d.target_classes)
    test_set = load_split(cfg, d.target, "test", d.target_classes)
    n_classes = len(train_set.classes)
    console.info(f"probe: {len(nets)} networks (seeds {[n.seed for n in nets]}), target {d.target} "
                 f"{len(train_set)} train / {len(test_set)} test images, {n_classes} classes")
    cat = ConcatFeatures([strip_head(load_network(n)) for n in nets], frozen=True).to(device)
    z_train, y_train = extract(cfg, cat, train_set, device)
    z_test, y_test = extract(cfg, cat, test_set, device)
    del cat
    per_net = [fit_probe(cfg, run, f"probe-net{i}", z_train[i], y_train, n_classes, device) for i in range(len(nets))]
    net_logits = [_logits(h, z_test[i], device) for i, h in enumerate(per_net)]
    measured: dict[str, Any] = {}
    for k in sorted(q.sizes):
        if k == 1:
            logits = net_logits[0]
        else:
            head = fit_probe(cfg, run, f"probe-cat{k}", torch.cat(z_train[:k], 1), y_train, n_classes, device)
            logits = _logits(head, torch.cat(z_test[:k], 1), device)
        measured[f"cat{k}.acc"] = _acc(logits, y_test)
        if q.catsub and k > 1:
            with torch.no_grad():
                sub = catsub_logits([h.cpu() for h in per_net[:k]], [z.cpu() for z in z_test[:k]])
            measured[f"catsub{k}.acc"] = _acc(sub, y_test)
    singles = [_acc(lg, y_test) for lg in net_logits]
    measured["single.acc"] = statistics.fmean(singles)
    details = {"networks": [n.label for n in nets], "seeds": [n.seed for n in nets], "single_acc": singles,
               "feature_dims": list(cat_dims(z_train)), "classes": train_set.classes,
               "split_sizes": {"train": len(train_set), "test": len(test_set)}}
    return Outcome(measured, details)


def cat_dims(blocks: list[torch.Tensor]) -> list[int]:
    return [int(b.shape[1]) for b in blocks]
