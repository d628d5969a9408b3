"""Very-large dropout fine-tuning on DomainBed (thesis §2.4, Tables 2.8-2.12, Figures 2.10-2.11; spec §5).

One run = one (dataset, test domain, hyper-parameters, seed) point of the DomainBed protocol:

* data (`owai.data.domainbed`): leave-one-domain-out; every domain split by `split_domain` into `in`
  (80 %) and `out` (20 %, the IID validation hold-out), the same split for every seed
  (`data.trial_seed`, DomainBed's convention); training draws `batch_per_domain` (32) examples from
  the `in` split of each training domain per step, augmented as DomainBed does;
* model (`owai.models.vision.FineTuneClassifier`): the pre-trained backbone, `Dropout(model.dropout)`
  on its penultimate representation, a fresh linear head; BatchNorm2d frozen in eval mode;
* optimisation: SGD with momentum 0.9 and coupled weight decay, the featurizer at `train.lr` and the
  head at `train.lr x train.last_lr_factor`, the lr x `gamma` at each milestone (10 001 steps, x0.1 at
  5 000), through the shared `owai.train.train_loop` (resumable);
* evaluation after update 0, every `eval_every` (300) updates and after the last: `iid_acc` = mean
  accuracy on the training domains' `out` splits, `ood_acc` = accuracy on the test domain's `in`
  split (DomainBed's convention), `ood_out_acc` on its `out` split.

Three tracks are evaluated along the run, each selected at its best-IID evaluation:

* `model`: the network itself (ERM when dropout = 0, VL-dropout when 0.9);
* `ens` (Ens-single): from update `average_start` (300) on, the logits of the network at every
  evaluation are summed, and the running sum predicts;
* `swa` (WA-single): a uniform running average of the weights (float buffers included), updated
  after every update from `average_start` on (`average_every: step`, the reference code) or at
  every evaluation (`average_every: eval`, the thesis's wording).

Multi-run ensembles and weight averages (Ens-multi, WA-multi) combine the final weights of the grid's
runs; they are computed by the study (`study_rows`) after the sweep. Offline CPU presets use
`data.dataset: rotated-mnist` (DomainBed's RotatedMNIST built from the packaged MNIST split) with a
`pretrain` stage standing in for ImageNet pre-training (see docs/decisions.md).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterator
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
from owai.runtime import AUTOCAST_DTYPES
from owai.values import md_row

TRACKS = ("model", "swa", "ens")
MULTI = ("wa_multi", "ens_multi")
DOMAINBED_NAMES = ("pacs", "vlcs", "office_home", "terra_incognita")
DATASETS = (*DOMAINBED_NAMES, "imagefolder", "rotated-mnist")


@dataclass
class DataConfig:
    dataset: str = "vlcs"  # pacs | vlcs | office_home | terra_incognita | imagefolder | rotated-mnist
    root: str = ""  # data root (DomainBed's data_dir, $OWAI_DATA-like, or the dataset folder); "" = $OWAI_DATA, cache; rotated-mnist: MNIST
    test_domain: int = 0  # index into the sorted domains: leave-one-domain-out
    holdout_fraction: float = 0.2
    trial_seed: int = 0  # DomainBed: the split is the same for every seed
    image_size: int = 224
    augment: bool = True
    batch_per_domain: int = 32
    workers: int = 4  # loader processes (0 = in the training process)
    eval_batch_size: int = 128
    cache_eval: bool = False  # keep the eval tensors in memory (small datasets evaluated often)
    angles: list[float] = field(default_factory=lambda: [0.0, 15.0, 30.0, 45.0, 60.0, 75.0])  # rotated-mnist
    per_domain: int = 1000  # rotated-mnist: images per domain
    pool: int = 0  # rotated-mnist: upright images held out for the `pretrain` stage
    skip_unreadable: bool = False  # image folders: skip (and count) unreadable image files instead of failing


@dataclass
class ModelConfig:
    backbone: str = "resnet50"
    weights: str = "IMAGENET1K_V2"  # "" = random init, a torchvision weights name, or a file path
    dropout: float = 0.0  # on the penultimate representation only
    freeze_bn: bool = True
    channels_last: bool = True  # on CUDA


@dataclass
class PretrainConfig:
    """A stand-in for ImageNet pre-training on offline data: ERM on the upright `data.pool` images.
    The result is cached by its settings (`<cache>/pretrained/`), so every run of a grid starts from
    the same backbone, as runs starting from one ImageNet checkpoint do."""

    steps: int = 0  # 0 = no pre-training stage
    # rotated-mnist: "pool" = the data.pool upright images set aside from the domains' MNIST file
    # (MNIST's test file); "mnist-train" = all 60 000 upright images of MNIST's training file (other
    # writers than the domains', found by the data-root rule), a stronger stand-in for ImageNet
    source: Literal["pool", "mnist-train"] = "pool"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    batch_size: int = 128
    seed: int = 0


@dataclass
class TrainConfig:
    steps: int = 10001
    lr: float = 1e-3
    weight_decay: float = 1e-4
    momentum: float = 0.9
    last_lr_factor: float = 1.0  # the head's lr = lr x last_lr_factor (Table 2.9: 10)
    milestones: list[int] = field(default_factory=lambda: [5000, 10000])
    gamma: float = 0.1
    eval_every: int = 300
    average_start: int = 300  # first update in the single-run ensemble / weight average
    average_every: Literal["step", "eval"] = "step"
    checkpoint_every: int = 300
    log_every: int = 50
    precision: Literal["auto", "float32", "bfloat16"] = "auto"  # auto = bfloat16 autocast on CUDA


@dataclass
class Config(BaseConfig):
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


class DropoutFineTuning(Method):
    Config = Config
    cli = "owai dropout-ft"
    one_run_command = False  # its subcommand runs the recipe's study, sweep or chain
    resume_overrides = ("train.lr", "train.weight_decay")

    @staticmethod
    def unused_settings(cfg: Config) -> dict[str, str]:
        """RotatedMNIST's settings on another dataset, an image folder's on RotatedMNIST, and the
        pretrain stage's settings when it is off (`pretrain.steps: 0`, the backbone from model.weights)."""
        d = cfg.data
        unused: dict[str, str] = {}
        if d.dataset != "rotated-mnist":
            for key in ("angles", "per_domain", "pool"):
                unused[f"data.{key}"] = f"a setting of --dataset rotated-mnist; this run's is --dataset {d.dataset}"
        else:
            unused["data.skip_unreadable"] = "a setting of the image-folder datasets; --dataset rotated-mnist reads MNIST's file"
        if cfg.pretrain.steps == 0:
            for key in ("source", "lr", "momentum", "weight_decay", "batch_size", "seed"):
                unused[f"pretrain.{key}"] = ("a setting of the pretrain stage (pretrain.steps > 0, the offline stand-in for "
                                             "ImageNet pre-training); this run's pretrain.steps is 0 (the backbone starts "
                                             "from model.weights; `--weights`, and `--dataset` without rotated-mnist, "
                                             "switch the stage off)")
        return unused

    @staticmethod
    def validate(cfg: Config) -> None:
        from owai.models.vision import BACKBONES, native_image_size, weights_image_size

        d, m, p, t = cfg.data, cfg.model, cfg.pretrain, cfg.train
        if d.dataset not in DATASETS:
            raise OwaiError(f"data.dataset {d.dataset!r}: choose one of {', '.join(DATASETS)}")
        if d.dataset != "rotated-mnist":  # (rotated-mnist: the MNIST test split, packaged when nowhere else; a
            from owai.data.domainbed import dataset_root  # sweep's base config is checked with the grid's root)

            dataset_root(d.dataset, d.root)  # missing data: one line naming the download step
        if not 0 < d.holdout_fraction < 1:
            raise OwaiError(f"data.holdout_fraction must be in (0, 1), got {d.holdout_fraction}")
        for name in ("image_size", "batch_per_domain", "eval_batch_size"):
            if getattr(d, name) < 1:
                raise OwaiError(f"data.{name} must be >= 1, got {getattr(d, name)}")
        if d.workers < 0 or d.test_domain < 0:
            raise OwaiError("data.workers and data.test_domain must be >= 0")
        if d.dataset == "rotated-mnist":  # its domains come from the config: checked before any data
            _check_test_domain(d.test_domain, d.dataset, [f"rot{a:g}" for a in d.angles])
        if m.backbone not in BACKBONES:
            raise OwaiError(f"unknown backbone {m.backbone!r}; known: {', '.join(sorted(BACKBONES))}")
        # a ViT's position embeddings: one size, its weights' (torchvision's SWAG E2E ViTs: 384 / 512 px; a
        # file's grid); the pretrain stage builds the initial weights at the architecture's own
        weights = "" if p.steps else m.weights
        native = weights_image_size(m.backbone, weights)
        if native and native != d.image_size:
            took = f" with weights {weights}" if native != native_image_size(m.backbone) else ""
            raise OwaiError(f"{m.backbone}{took} is built for {native} px images: set data.image_size={native}")
        if p.steps < 0:
            raise OwaiError(f"pretrain.steps must be >= 0, got {p.steps}")
        if p.steps and d.dataset != "rotated-mnist":
            raise OwaiError(f"pretrain.steps > 0 (the offline stand-in for ImageNet pre-training) needs data.dataset=rotated-mnist; "
                            f"for data.dataset={d.dataset} add --set pretrain.steps=0")
        if p.steps and p.source == "pool" and d.pool < 1:
            raise OwaiError("pretrain.source=pool needs data.pool > 0 upright images (or pretrain.source=mnist-train)")
        if p.steps and p.source == "mnist-train":
            from owai.data.mnist import mnist_dir

            try:  # missing: one line naming `owai data fetch mnist`
                mnist_dir("train", d.root or None)
            except DataMissing as e:
                raise DataMissing(f"{e} (pretrain.source=mnist-train; or --preset tiny: the packaged test split only)") from None
        if p.steps and m.weights:
            raise OwaiError(f"pretrain.steps > 0 builds the initial weights; set model.weights='' (got {m.weights!r}) "
                            "or --set pretrain.steps=0")
        for name in ("steps", "eval_every", "checkpoint_every", "log_every"):
            if getattr(t, name) < 1:
                raise OwaiError(f"train.{name} must be >= 1, got {getattr(t, name)}")
        if not (t.lr > 0 and t.weight_decay >= 0 and 0 <= t.momentum < 1 and t.last_lr_factor > 0 and t.gamma > 0):
            raise OwaiError("train: need lr > 0, weight_decay >= 0, 0 <= momentum < 1, last_lr_factor > 0, gamma > 0")
        if t.average_start < 0:
            raise OwaiError(f"train.average_start must be >= 0, got {t.average_start}")
        from owai.runtime import planned_device

        _precision(cfg, planned_device(cfg.runtime.device))  # bf16 autocast off CUDA: refused here, not in the run
        # the data and the weights file, before any run directory: a bad test domain, class folders
        # that differ between domains, unreadable images or a corrupt weights file fail here
        if d.dataset != "rotated-mnist":
            _check_test_domain(d.test_domain, d.dataset, image_dataset(cfg).domains)
        if not p.steps:  # named weights: cached, or downloadable when the run starts (else DataMissing)
            from owai.models.vision import check_weights

            check_weights(m.backbone, m.weights)

    def run(self, cfg: Config, run: Run) -> Outcome:
        device = run.device
        data = load_data(cfg)
        console.info(f"{data.name}: domains {', '.join(data.domains)}; test domain {data.domains[cfg.data.test_domain]}; "
                     f"{len(data.classes)} classes" + (f"; {data.skipped} unreadable files skipped" if data.skipped else ""))
        weights = initial_weights(cfg, run, data, device)
        model = build_model(cfg, len(data.classes), weights, device)
        sets = eval_sets(cfg, data)
        tracks = train(cfg, run, model, data, sets, device)
        measured: dict[str, Any] = {}
        for track in TRACKS:
            best = tracks.best.get(track)
            for key in ("iid_acc", "ood_acc", "ood_out_acc", "step"):
                measured[f"{track}.{key}"] = best[key] if best else None
        measured.update({f"final.{k}": v for k, v in tracks.final.items()})
        details = {"domains": data.domains, "test_domain": data.domains[cfg.data.test_domain],
                   "classes": data.classes, "skipped_files": data.skipped,
                   "split_sizes": {s.name: s.size for s in sets}}
        return Outcome(measured, details)


# -- data ---------------------------------------------------------------------------------------


def load_data(cfg: Config) -> Any:
    """The multi-domain dataset of `cfg.data`; checks the test domain exists."""
    from owai.data import domainbed
    from owai.data.mnist import load_mnist

    d = cfg.data
    if d.dataset == "rotated-mnist":
        data = domainbed.RotatedMNIST(load_mnist("test", root=d.root or None), d.angles, d.per_domain, d.pool,
                                      seed=d.trial_seed)
    else:
        data = image_dataset(cfg)
    _check_test_domain(d.test_domain, data.name, data.domains)
    return data


def image_dataset(cfg: Config) -> Any:
    """The image-folder dataset of `cfg.data` (imagefolder or a DomainBed name), indexed once per
    process; unreadable images are an error unless data.skip_unreadable."""
    from owai.data.domainbed import dataset_root, open_image_dataset

    return open_image_dataset(cfg.data.dataset, dataset_root(cfg.data.dataset, cfg.data.root), cfg.data.skip_unreadable)


def splits(cfg: Config, data: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(in, out) indices of every domain (DomainBed's split_dataset, keyed by the trial seed)."""
    from owai.data.domainbed import split_domain

    return [split_domain(data.size(i), cfg.data.holdout_fraction, cfg.data.trial_seed, i) for i in range(len(data.domains))]


def train_domains(cfg: Config, data: Any) -> list[int]:
    return [i for i in range(len(data.domains)) if i != cfg.data.test_domain]


@dataclass
class EvalSet:
    """One evaluated split of one domain: `group` is val (IID), test (OOD, `in` split) or test_out."""

    group: str
    domain: str
    labels: torch.Tensor
    batches: Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]

    @property
    def name(self) -> str:
        return f"{self.group}.{self.domain}"

    @property
    def size(self) -> int:
        return int(self.labels.numel())


def eval_sets(cfg: Config, data: Any) -> list[EvalSet]:
    """The training domains' `out` splits (val), the test domain's `in` (test) and `out` (test_out) splits."""
    from owai.data.domainbed import CachedEval, eval_batches

    d = cfg.data
    parts = splits(cfg, data)
    wanted = [("val", i, parts[i][1]) for i in train_domains(cfg, data)]
    wanted += [("test", d.test_domain, parts[d.test_domain][0]), ("test_out", d.test_domain, parts[d.test_domain][1])]
    sets = []
    for group, i, idx in wanted:
        labels = data.labels(i)[idx]
        if d.cache_eval:
            cached = CachedEval(data, i, idx, d.image_size, d.eval_batch_size)
            batches = cached.batches
        else:
            def batches(i: int = i, idx: torch.Tensor = idx) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
                return eval_batches(data, i, idx, d.image_size, d.eval_batch_size, d.workers, torch.cuda.is_available())
        sets.append(EvalSet(group, data.domains[i], labels, batches))
    return sets


# -- model --------------------------------------------------------------------------------------


def build_model(cfg: Config, num_classes: int, weights: Path | dict[str, torch.Tensor] | None,
                device: torch.device) -> torch.nn.Module:
    """Backbone (+ its initial weights) -> FineTuneClassifier; the head's init is keyed by the seed,
    so the runs of one seed share their initialisation (what multi-run weight averaging assumes)."""
    from owai.models.vision import (
        WEIGHTS,
        FineTuneClassifier,
        build_backbone,
        feed_own_statistics,
        load_torchvision_weights,
        size_kwargs,
    )
    from owai.runtime import derive_seed

    m = cfg.model
    rng = torch.get_rng_state()
    torch.manual_seed(derive_seed(cfg.seed, "init", m.backbone))
    if isinstance(weights, dict):  # the pretrain stage's backbone, with its own (pool-class) head
        head = next(v.shape[0] for k, v in weights.items() if k in ("fc.weight", "classifier.weight", "heads.head.weight"))
        backbone = build_backbone(m.backbone, num_classes=head, **size_kwargs(m.backbone, cfg.data.image_size))
        backbone.load_state_dict(weights)
    else:
        # a ViT at data.image_size, which validation made its weights' (SWAG E2E: 384 / 512)
        backbone = build_backbone(m.backbone, num_classes=1000, **size_kwargs(m.backbone, cfg.data.image_size))
        if weights is not None:  # the features: the head is replaced below (a 21k-class or absent one loads)
            load_torchvision_weights(backbone, weights, features_only=True)
        elif (m.weights and not cfg.pretrain.steps and m.weights not in WEIGHTS.get(m.backbone, {})
              and Path(m.weights).expanduser().is_file()):
            # a trained state loads over this model (the study's ensembles and weight averages): a timm ViT's
            # map to its own image statistics is no tensor of that state, so it is set from the file here
            feed_own_statistics(backbone, m.weights)
    model = FineTuneClassifier(backbone, num_classes, m.dropout, m.freeze_bn)
    torch.set_rng_state(rng)
    model = model.to(device)
    if device.type == "cuda" and m.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def initial_weights(cfg: Config, run: Run, data: Any, device: torch.device) -> Path | dict[str, torch.Tensor] | None:
    """The backbone's starting point: a weights file, nothing (from scratch), or the pretrain stage's
    result (on `data`'s upright pool)."""
    from owai.models.vision import resolve_weights

    if cfg.pretrain.steps == 0:
        return resolve_weights(cfg.model.backbone, cfg.model.weights)
    if cfg.pretrain.source == "mnist-train":
        from owai.data.domainbed import TensorDomains
        from owai.data.mnist import load_mnist

        train = load_mnist("train", root=cfg.data.root or None)
        pool = TensorDomains("mnist_train", ["upright"], data.classes, [train.images], [train.labels])
    else:
        pool = data.pretraining_pool()
    return pretrained_backbone(cfg, run, pool, device)


def pretrain_key(cfg: Config, precision: str = "float32") -> str:
    """The cache key of the pretrain stage's backbone; `precision` is the one it trains in (resolved:
    train.precision), so a float32 run never takes a backbone trained under bf16 autocast."""
    import hashlib

    from owai.config import to_dict

    d = cfg.data
    pretrain = to_dict(cfg.pretrain)
    if pretrain["source"] == "pool":  # the keys cached before `source` existed stay valid
        del pretrain["source"]
    what = {"backbone": cfg.model.backbone, "pretrain": pretrain, "root": d.root, "pool": d.pool,
            "trial_seed": d.trial_seed, "image_size": d.image_size, "augment": d.augment, "version": 1}
    if precision != "float32":  # float32 keys written before the precision was keyed stay valid
        what["precision"] = precision
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def pretrained_backbone(cfg: Config, run: Run, pool: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """ERM on the upright `pool` (stage `pretrain`, resumable), cached under <cache>/pretrained/<key>."""
    from owai.io import build_lock, cache_root, read_cache_entry, write_cache_entry

    path = cache_root() / "pretrained" / f"{cfg.model.backbone}-{pretrain_key(cfg, _precision(cfg, device))}.safetensors"
    with build_lock(path, ready=path.is_file):  # a sweep's workers pre-train a backbone once
        state = read_cache_entry(path, lambda tensors, _: tensors)
        if state is None:
            state = _pretrain(cfg, run, pool, device)
            write_cache_entry(path, state)
        return state


def _pretrain(cfg: Config, run: Run, pool: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """`pretrained_backbone`'s training: its final weights, on the CPU."""
    from owai.data.domainbed import StepBatches
    from owai.data.images import StepStream
    from owai.models.vision import build_backbone
    from owai.runtime import derive_seed
    from owai.train import LoopConfig, train_loop

    d, p = cfg.data, cfg.pretrain
    rng = torch.get_rng_state()
    torch.manual_seed(derive_seed(p.seed, "pretrain-init", cfg.model.backbone))
    net = build_backbone(cfg.model.backbone, num_classes=len(pool.classes)).to(device)
    torch.set_rng_state(rng)
    batches = StepBatches(pool, [0], [torch.arange(pool.size(0))], p.batch_size, d.image_size, d.augment, p.seed, p.steps)
    stream = StepStream(batches, d.workers, device)
    optimizer = torch.optim.SGD(net.parameters(), lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)

    def loss_at(step: int, micro: int) -> torch.Tensor:
        x, y = stream.at(step)
        return F.cross_entropy(net(x), y)

    decay_at = (2 * p.steps) // 3
    loop = LoopConfig(steps=p.steps, checkpoint_every=max(1, min(cfg.train.checkpoint_every, p.steps)),
                      log_every=max(1, min(cfg.train.log_every, p.steps)), precision=_precision(cfg, device))
    with stream:  # its workers end with the stage, failed or not
        train_loop(run, "pretrain", net, optimizer, loss_at, loop, lr_at=lambda s: p.lr * (0.1 if s >= decay_at else 1.0))
    return {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}


def _precision(cfg: Config, device: torch.device) -> str:
    from owai.runtime import training_precision

    return training_precision(cfg.train.precision, device, "train.precision")


# -- evaluation and tracks ----------------------------------------------------------------------


@torch.no_grad()
def predict(model: torch.nn.Module, sets: list[EvalSet], device: torch.device, precision: str) -> dict[str, torch.Tensor]:
    """Logits (float32, CPU) of `model` in eval mode on every set."""
    was_training = model.training
    model.eval()
    amp = AUTOCAST_DTYPES.get(precision)
    out = {}
    for s in sets:
        chunks = []
        for x, _ in s.batches():
            x = x.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                chunks.append(model(x).float().cpu())
        out[s.name] = torch.cat(chunks) if chunks else torch.zeros(0)
    model.train(was_training)
    return out


def accuracies(logits: dict[str, torch.Tensor], sets: list[EvalSet]) -> dict[str, float]:
    """iid_acc (mean over the training domains' out splits, DomainBed's get_score), ood_acc, ood_out_acc."""
    acc = {s.name: float((logits[s.name].argmax(1) == s.labels).float().mean()) for s in sets}
    val = [acc[s.name] for s in sets if s.group == "val"]
    test = next(s for s in sets if s.group == "test")
    test_out = next(s for s in sets if s.group == "test_out")
    return {"iid_acc": statistics.fmean(val), "ood_acc": acc[test.name], "ood_out_acc": acc[test_out.name],
            **{f"acc.{k}": v for k, v in acc.items()}}


def average_into(avg: dict[str, torch.Tensor], state: dict[str, torch.Tensor], n: int) -> None:
    """avg <- (avg * n + state) / (n + 1) for floating-point entries; others take the newest value."""
    for k, v in state.items():
        if v.is_floating_point():
            avg[k].mul_(n / (n + 1)).add_(v.detach().to(avg[k].dtype), alpha=1 / (n + 1))
        else:
            avg[k].copy_(v)


def average_states(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Uniform average of state dicts (weight averaging across runs)."""
    avg = {k: v.detach().clone().float() if v.is_floating_point() else v.clone() for k, v in states[0].items()}
    for n, state in enumerate(states[1:], start=1):
        average_into(avg, state, n)
    return {k: v.to(states[0][k].dtype) for k, v in avg.items()}


@dataclass
class Tracks:
    """The run's ensemble / weight-average companions and the best-IID evaluation of each track."""

    swa: dict[str, torch.Tensor] | None = None
    swa_n: int = 0
    ens: dict[str, torch.Tensor] | None = None
    ens_n: int = 0
    best: dict[str, dict[str, float]] = field(default_factory=dict)
    final: dict[str, float] = field(default_factory=dict)

    device: torch.device | None = None  # where the running average lives (the model's device)

    def state_dict(self) -> dict[str, Any]:
        """Saved with every training checkpoint (`train_loop`'s companion), so a resume is exact."""
        return {"swa": self.swa or {}, "swa_n": self.swa_n, "ens": self.ens or {}, "ens_n": self.ens_n,
                "best": json.dumps(self.best), "final": json.dumps(self.final)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.swa = {k: v.to(self.device) for k, v in state["swa"].items()} or None
        self.swa_n, self.ens, self.ens_n = int(state["swa_n"]), dict(state["ens"]) or None, int(state["ens_n"])
        self.best, self.final = json.loads(state["best"]), json.loads(state["final"])

    def record(self, track: str, step: int, acc: dict[str, float]) -> None:
        """Keep the first evaluation with the highest IID accuracy (DomainBed's selection)."""
        if track not in self.best or acc["iid_acc"] > self.best[track]["iid_acc"]:
            self.best[track] = {"step": step, **{k: acc[k] for k in ("iid_acc", "ood_acc", "ood_out_acc")}}


def lr_schedule(t: TrainConfig) -> Callable[[int], float]:
    """MultiStepLR: lr x gamma^(number of milestones <= update index)."""
    from owai.optim import step_schedule

    return step_schedule(t.lr, t.gamma, t.milestones)


def train(cfg: Config, run: Run, model: torch.nn.Module, data: Any, sets: list[EvalSet], device: torch.device) -> Tracks:
    """Fine-tune through the shared loop, evaluating the three tracks; resumable (the tracks are the
    loop's companion state, saved in every checkpoint)."""
    from owai.data.domainbed import StepBatches
    from owai.data.images import StepStream
    from owai.train import LoopConfig, train_loop

    t, d = cfg.train, cfg.data
    precision = _precision(cfg, device)
    parts = splits(cfg, data)
    domains = train_domains(cfg, data)
    batches = StepBatches(data, domains, [parts[i][0] for i in domains], d.batch_per_domain, d.image_size,
                          d.augment, cfg.seed, t.steps)
    stream = StepStream(batches, d.workers, device, channels_last=device.type == "cuda" and cfg.model.channels_last)
    head = list(model.classifier.parameters())
    head_ids = {id(p) for p in head}
    groups = [{"params": [p for p in model.parameters() if id(p) not in head_ids], "lr_scale": 1.0},
              {"params": head, "lr_scale": t.last_lr_factor}]
    optimizer = torch.optim.SGD(groups, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)

    tracks = Tracks(device=device)
    averaged = _copy_model(model)

    def loss_at(step: int, micro: int) -> torch.Tensor:
        x, y = stream.at(step)
        return F.cross_entropy(model(x), y)

    def evaluate(update: int, done: int) -> None:
        logits = predict(model, sets, device, precision)
        acc = accuracies(logits, sets)
        tracks.record("model", update, acc)
        values = {"update": update, **{f"model.{k}": v for k, v in acc.items() if not k.startswith("acc.")}}
        if update >= t.average_start:
            tracks.ens = {k: v.clone() for k, v in logits.items()} if tracks.ens is None else {
                k: tracks.ens[k] + logits[k] for k in logits}
            tracks.ens_n += 1
            ens_acc = accuracies(tracks.ens, sets)
            tracks.record("ens", update, ens_acc)
            if t.average_every == "eval":
                _update_average(tracks, model)
            averaged.load_state_dict(tracks.swa)
            swa_acc = accuracies(predict(averaged, sets, device, precision), sets)
            tracks.record("swa", update, swa_acc)
            values.update({f"ens.{k}": v for k, v in ens_acc.items() if not k.startswith("acc.")})
            values.update({f"swa.{k}": v for k, v in swa_acc.items() if not k.startswith("acc.")})
        if done == t.steps:
            tracks.final = {k: acc[k] for k in ("iid_acc", "ood_acc", "ood_out_acc")}
        run.log("train", done, **values)
        console.info(f"update {update}: iid {acc['iid_acc']:.4f} ood {acc['ood_acc']:.4f}")

    def after_step(done: int) -> None:
        update = done - 1
        if t.average_every == "step" and update >= t.average_start:
            _update_average(tracks, model)
        if update % t.eval_every == 0 or done == t.steps:
            evaluate(update, done)

    loop = LoopConfig(steps=t.steps, checkpoint_every=min(t.checkpoint_every, t.steps), log_every=min(t.log_every, t.steps),
                      precision=precision)
    with stream:  # its workers end with the stage, failed or not
        train_loop(run, "train", model, optimizer, loss_at, loop, lr_at=lr_schedule(t), after_step=after_step, companion=tracks)
    return tracks


def _copy_model(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    clone = copy.deepcopy(model)
    clone.eval()
    return clone


def _update_average(tracks: Tracks, model: torch.nn.Module) -> None:
    state = model.state_dict()
    if tracks.swa is None:
        tracks.swa = {k: v.detach().clone() for k, v in state.items()}
        tracks.swa_n = 1
    else:
        average_into(tracks.swa, state, tracks.swa_n)
        tracks.swa_n += 1


def final_state(run_dir: Path) -> tuple[Config, dict[str, torch.Tensor]]:
    """(config, final network weights) of a finished run, for the multi-run combinations."""
    from owai.checkpoint import latest_checkpoint, load_checkpoint
    from owai.config import build

    run = Run.open(run_dir)
    cfg = build(Config, run.read_config()["params"])
    last = latest_checkpoint(run.checkpoints("train"))
    if last is None:
        raise OwaiError(f"{run_dir} has no final checkpoint")
    step, state = load_checkpoint(last)
    if step != cfg.train.steps:
        raise OwaiError(f"{run_dir} stopped at step {step} of {cfg.train.steps}")
    return cfg, state["model"]


# -- the study: selection over the grid, multi-run combinations, tables and figures --------------

HP_KEYS = ("train.lr", "train.weight_decay")  # searched per (dataset, test domain, variant), averaged over seeds
STUDY_NAME, MULTI_JSON = "dropout_ft", "multi_run.json"  # dropout_ft.json/.md, figures/dropout_ft.png
TRACK_LABELS = {"model": "", "swa": "+WA-single", "ens": "+Ens-single", "wa_multi": "+WA-multi", "ens_multi": "+Ens-multi"}


def _grid_keys(summary: dict[str, Any]) -> list[str]:
    from owai.recipes import sub_grids

    keys: list[str] = []
    for g in sub_grids(summary["grid"]):
        keys += [k for k in g if k not in keys]
    return keys


def variant_label(key: dict[str, Any]) -> str:
    """A readable name for a grid cell's non-searched settings other than dataset and test domain."""
    names = {"model.dropout": "dropout", "train.last_lr_factor": "last-lr x", "model.weights": "weights",
             "model.backbone": "backbone"}
    parts = [f"{names.get(k, k)} {v if v != '' else 'none'}" for k, v in key.items()
             if k not in ("data.dataset", "data.test_domain")]
    return ", ".join(parts) or "default"


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def multi_run(sweep: Any, summary: dict[str, Any], per: list[str], device: torch.device) -> dict[str, dict[str, Any]]:
    """Ens-multi and WA-multi per (group of `per` values, seed): the final networks of the group's
    grid runs, their logits averaged, or their weights averaged (DiWA). Cached in multi_run.json,
    with the device and precision they were computed in: the study's last step runs where the
    study command runs (a SLURM sweep's submitting machine), and another device computes them
    again rather than take numbers another device gave."""
    from owai.io import atomic_write_json

    cache_path = sweep.path / MULTI_JSON
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    runs: dict[str, list[str]] = {}
    for p in summary["points"]:
        if p["status"] == "complete":
            key = json.dumps([[k, p["grid"].get(k)] for k in per] + [["seed", p["seed"]]])
            runs.setdefault(key, []).append(p["run_dir"])
    out = {}
    for key, dirs in runs.items():
        signature = sorted(dirs)
        if key in cache and cache[key]["runs"] == signature and cache[key].get("device") == device.type:
            out[key] = cache[key]
            continue
        finals = [final_state(Path(d)) for d in signature]
        cfg = finals[0][0]  # the group's runs differ only in lr / weight decay: one dataset serves all
        data = load_data(cfg)
        sets = eval_sets(cfg, data)
        precision = _precision(cfg, device)
        model = build_model(cfg, len(data.classes), None, device)
        logits = []
        for _, state in finals:
            model.load_state_dict(state)
            logits.append(predict(model, sets, device, precision))
        ens = {k: sum(lg[k] for lg in logits) for k in logits[0]}
        model.load_state_dict(average_states([state for _, state in finals]))
        wa = predict(model, sets, device, precision)
        out[key] = {"runs": signature, "device": device.type, "precision": precision,
                    "ens_multi": accuracies(ens, sets), "wa_multi": accuracies(wa, sets)}
        cache[key] = out[key]
        atomic_write_json(cache_path, cache)
    return out


def study_rows(sweep: Any, summary: dict[str, Any], device: torch.device | None = None) -> list[dict[str, Any]]:
    """One row per (dataset, variant, track): OOD accuracy per test domain of the cell selected by
    IID validation (mean over seeds), their average, and the thesis's average."""
    from owai.config import merge
    from owai.recipes import Selection, load, recorded_name, thesis_for
    from owai.sweep import select_cells

    recipe = load(recorded_name(sweep.recipe, sweep.recipe_source))
    keys = _grid_keys(summary)
    per = [k for k in keys if k not in HP_KEYS]
    base = _finished_params(summary)
    names = _domain_names(summary)
    table: dict[str, dict[str, Any]] = {}

    def cell(key: dict[str, Any], track: str) -> dict[str, Any]:
        variant = {k: v for k, v in key.items() if k != "data.test_domain"}
        dataset = variant.pop("data.dataset", None) or base.get("data", {}).get("dataset")
        label = f"{dataset}|{variant_label(variant)}|{track}"
        if label not in table:
            params = merge(base, _nested({**variant, "data.dataset": dataset}))
            thesis = thesis_for(recipe, f"avg_ood_acc.{track}", params)
            table[label] = {"dataset": dataset, "variant": variant_label(variant), "track": track,
                            "label": variant_label(variant) + TRACK_LABELS[track], "ood": {}, "iid": {},
                            "selected": {}, "seeds": {}, "thesis_avg": thesis.value if thesis else None,
                            "thesis_ref": thesis.ref if thesis else ""}
        return table[label]

    def domain_of(key: dict[str, Any]) -> str:
        index = key.get("data.test_domain", base.get("data", {}).get("test_domain"))
        return names.get(index, str(index))

    for track in TRACKS:
        selection = select_cells(summary["groups"], Selection(f"{track}.iid_acc", "max", per))
        for group in selection["groups"]:
            metrics = {m["metric"]: m for m in group["metrics"]}
            if f"{track}.ood_acc" not in metrics:
                continue
            row = cell(group["key"], track)
            domain = domain_of(group["key"])
            row["ood"][domain] = metrics[f"{track}.ood_acc"]["mean"]
            row["iid"][domain] = metrics[f"{track}.iid_acc"]["mean"]
            row["seeds"][domain] = metrics[f"{track}.ood_acc"]["n"]
            row["selected"][domain] = " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in (group["grid"] or {}).items()
                                               if k in HP_KEYS)
    if device is not None:
        pooled: dict[str, dict[str, Any]] = {}  # {"key": the group, "track", "acc": one result per seed}
        for key, result in multi_run(sweep, summary, per, device).items():
            pairs = json.loads(key)
            group_key = {k: v for k, v in pairs if k != "seed"}
            for track in MULTI:
                pooled.setdefault(json.dumps([track, sorted(group_key.items())]), {"key": group_key, "track": track,
                                                                                   "acc": []})["acc"].append(result[track])
        for entry in pooled.values():
            row = cell(entry["key"], entry["track"])
            domain = domain_of(entry["key"])
            row["ood"][domain] = statistics.fmean(a["ood_acc"] for a in entry["acc"])
            row["iid"][domain] = statistics.fmean(a["iid_acc"] for a in entry["acc"])
            row["seeds"][domain] = len(entry["acc"])
            row["selected"][domain] = "all grid runs"
    rows = list(table.values())
    for row in rows:
        row["avg"] = statistics.fmean(row["ood"].values()) if row["ood"] else None
    order = {t: i for i, t in enumerate((*TRACKS, *MULTI))}
    rows.sort(key=lambda r: (r["dataset"], r["variant"], order[r["track"]]))
    return rows


def _finished_params(summary: dict[str, Any]) -> dict[str, Any]:
    """The resolved params of a finished point (the settings that are not in the grid)."""
    for p in summary["points"]:
        if p["status"] == "complete":
            return Run(Path(p["run_dir"])).read_config()["params"]
    return {}


def _domain_names(summary: dict[str, Any]) -> dict[int, str]:
    """test-domain index -> name, from the finished runs' results."""
    names: dict[int, str] = {}
    for p in summary["points"]:
        if p["status"] != "complete":
            continue
        results = Run(Path(p["run_dir"])).results() or {}
        details = results.get("details", {})
        params = Run(Path(p["run_dir"])).read_config()["params"]
        if "test_domain" in details:
            names.setdefault(int(params["data"]["test_domain"]), details["test_domain"])
    return names


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def study_markdown(rows: list[dict[str, Any]], title: str, command: str) -> str:
    lines = [f"# {title}", "", f"Command: `{command}`", "",
             "OOD accuracy (%) on each held-out domain (its `in` split), hyper-parameters selected by IID "
             "validation (mean over seeds); `avg` = mean over test domains; thesis = the thesis's average.", ""]
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        subset = [r for r in rows if r["dataset"] == dataset]
        domains = list(dict.fromkeys(d for r in subset for d in r["ood"]))
        lines += [f"## {dataset}", "", "| method | " + " | ".join(domains) + " | avg | thesis avg | seeds | selected |",
                  "|---|" + "---|" * (len(domains) + 4)]
        for r in subset:
            seeds = ",".join(str(r["seeds"].get(d, 0)) for d in domains)
            chosen = "; ".join(f"{d}: {r['selected'].get(d, '')}" for d in domains)
            lines.append(md_row([r["label"], *(_pct(r["ood"].get(d)) for d in domains), _pct(r["avg"]),
                                 _pct(r["thesis_avg"]), seeds, chosen]))
        lines.append("")
    return "\n".join(lines)


def study_table(rows: list[dict[str, Any]], title: str) -> Any:
    domains = list(dict.fromkeys(d for r in rows for d in r["ood"]))
    cells = [[r["dataset"], r["label"], *(_pct(r["ood"].get(d)) for d in domains), _pct(r["avg"]), _pct(r["thesis_avg"])]
             for r in rows]
    return console.text_table(title, ("dataset", "method", *domains, "avg", "thesis"), cells, left=("dataset", "method"))


BOX_CAP = 200_000  # combinations per box beyond which a seeded sample of this many stands for them


def grid_boxes(summary: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Fig 2.10's boxes: {dataset: {method label: dataset-level OOD accuracies}}. A method is a
    (variant, single-run track). Each value is one choice of (lr, weight decay) cell per test domain,
    the cells' OOD accuracies (mean over seeds) averaged over the test domains: the verylarge_dropout
    README's figure has 6^4 = 1296 of them per method (6 cells, 4 test domains). Beyond BOX_CAP
    combinations a seeded sample of BOX_CAP of them is drawn. A method without results on one of its
    dataset's held-out domains (a sweep still running) has no box: its average would be over other
    domains than its neighbours'."""
    import itertools
    import random

    keys = _grid_keys(summary)
    base = _finished_params(summary).get("data", {})
    cells: dict[tuple[str, str], dict[Any, list[float]]] = {}
    for group in summary["groups"]:
        grid = group["grid"] or {}
        metrics = {m["metric"]: m for m in group["metrics"]}
        variant = variant_label({k: grid.get(k) for k in keys if k not in HP_KEYS and k != "data.test_domain"})
        dataset = str(grid.get("data.dataset", base.get("dataset")))
        domain = grid.get("data.test_domain", base.get("test_domain"))
        for track in TRACKS:
            metric = metrics.get(f"{track}.ood_acc")
            if metric is not None:
                label = variant + TRACK_LABELS[track]
                cells.setdefault((dataset, label), {}).setdefault(domain, []).append(100 * metric["mean"])
    domains: dict[str, set[Any]] = {}
    for (dataset, _), per_domain in cells.items():
        domains.setdefault(dataset, set()).update(per_domain)
    boxes: dict[str, dict[str, list[float]]] = {}
    for (dataset, label), per_domain in cells.items():
        if set(per_domain) != domains[dataset]:
            continue
        choices = list(per_domain.values())
        total = math.prod(len(c) for c in choices)
        if total <= BOX_CAP:
            picks: Any = itertools.product(*choices)
        else:
            rng = random.Random(f"fig2.10:{dataset}:{label}")
            picks = ([rng.choice(c) for c in choices] for _ in range(BOX_CAP))
        boxes.setdefault(dataset, {})[label] = [statistics.fmean(p) for p in picks]
    return boxes


def add_box_quartiles(rows: list[dict[str, Any]], boxes: dict[str, dict[str, list[float]]]) -> None:
    """Fig 2.10's box of each single-run row as `box: {q25, median, q75, n}` (fractions; numpy's linear
    percentiles, as matplotlib's boxplot draws them), so that claims can compare the boxes (TH 2.4.3.3:
    "the bottom of very-large dropout box (25% quartile) outperforms the top of other baseline boxes
    (75% quartile)"). A row without a box (a sweep still running) gets none."""
    import numpy as np

    for row in rows:
        values = boxes.get(str(row["dataset"]), {}).get(row["label"])
        if row["track"] in TRACKS and values:
            q25, median, q75 = (float(v) / 100 for v in np.percentile(values, [25, 50, 75]))
            row["box"] = {"q25": q25, "median": median, "q75": q75, "n": len(values)}


def plot_study(rows: list[dict[str, Any]], boxes: dict[str, dict[str, list[float]]], title: str) -> Any:
    """Fig 2.10: per dataset, one box per method over the hyper-parameter choices (`boxes`, `grid_boxes`),
    the multi-run ensembles and weight averages (one value each) as points; with three or more
    dropout rates, Fig 2.11's average OOD (solid) and IID (dashed) accuracy against the rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r for r in (_rate(row["variant"]) for row in rows) if r is not None})
    datasets = list(boxes) or [""]
    panels = len(datasets) + (1 if len(rates) >= 3 else 0)
    widest = max((len(b) for b in boxes.values()), default=4) + 2  # boxes and multi-run points of a panel
    fig, axes = plt.subplots(1, panels, figsize=(max(6.0, 0.9 * widest) * panels, 4.2), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        methods = boxes.get(dataset, {})
        if methods:
            ax.boxplot(list(methods.values()))
            ax.set_xticks(range(1, len(methods) + 1), list(methods))
        multi = [r for r in rows if r["dataset"] == dataset and r["track"] in MULTI and r["avg"] is not None]
        for k, r in enumerate(multi):
            ax.plot([len(methods) + 1 + k], [100 * r["avg"]], marker="*" if r["track"] == "wa_multi" else "^",
                    markersize=10, color="black", linestyle="none")
        if multi:
            ax.set_xticks(range(1, len(methods) + len(multi) + 1), [*methods, *(r["label"] for r in multi)])
        ax.set_ylabel("OOD accuracy (%), mean over test domains")
        n = max((len(v) for v in methods.values()), default=0)
        ax.set_title(f"{dataset}: {n} hyper-parameter choices per box", fontsize=10)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
    if len(rates) >= 3:
        ax = axes[0][-1]
        for track in (*TRACKS, *MULTI):
            chosen = [r for r in rows if r["track"] == track and r["avg"] is not None and _rate(r["variant"]) is not None]
            if not chosen:
                continue
            points = sorted((_rate(r["variant"]), 100 * r["avg"], 100 * statistics.fmean(r["iid"].values()))
                            for r in chosen)
            line = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{track} OOD")[0]
            ax.plot([p[0] for p in points], [p[2] for p in points], marker="o", linestyle="--",
                    color=line.get_color(), label=f"{track} IID")
        ax.set_xlabel("dropout rate")
        ax.set_ylabel("average accuracy (%)")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _rate(variant: str) -> float | None:
    for part in variant.split(", "):
        if part.startswith("dropout "):
            try:
                return float(part.split(" ", 1)[1])
            except ValueError:
                return None
    return None


def study_device(summary: dict[str, Any]) -> torch.device:
    """Where the study's last step (Ens-multi, WA-multi) runs, in the study command's process: on the
    CPU when the points were asked to run there (runtime.device=cpu), else CUDA where this machine
    has it ('auto'; a SLURM sweep's points may have run on GPUs its submitting machine lacks)."""
    from owai.runtime import select_device

    for p in summary["points"]:
        if p["status"] == "complete":
            name = str(Run.open(Path(p["run_dir"])).read_config()["params"].get("runtime", {}).get("device", "auto"))
            return select_device("auto" if name in ("auto", "cuda") else name)
    return select_device("auto")


def write_study(sweep: Any, summary: dict[str, Any], device: torch.device) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """dropout_ft.json, dropout_ft.md and figures/dropout_ft.png in the sweep directory (atomically)."""
    from owai.sweep import write_study_files

    rows = study_rows(sweep, summary, device)
    boxes = grid_boxes(summary)  # the figure's boxes, and their quartiles in the rows (for the claims)
    add_box_quartiles(rows, boxes)
    title = f"{sweep.recipe} [{sweep.preset}]: OOD accuracy, IID model selection"
    command = f"owai dropout-ft --resume {sweep.path}"
    figure = write_study_files(sweep, STUDY_NAME, title, rows, study_markdown(rows, title, command),
                               plot_study(rows, boxes, f"{sweep.recipe} [{sweep.preset}]"))
    return rows, {"title": title, "figure": str(figure)}


def _check_test_domain(index: int, dataset: str, domains: list[str]) -> None:
    """One line unless data.test_domain `index` names one of `dataset`'s `domains`."""
    if index >= len(domains):
        raise OwaiError(f"data.test_domain {index}: {dataset} has {len(domains)} domains "
                        f"(0-{len(domains) - 1}: {', '.join(domains)})")
