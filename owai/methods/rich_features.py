"""Rich representations: Cat_n, Distill_n, linear probing, fine-tuning, few-shot (thesis §2.1-2.2, App.
A.1-A.4; spec rich_features.md §6, §8). One method, `owai rich-features`, whose `stage` is either:

* `pretrain`: ONE network (`model.backbone`, an `owai.models.vision` backbone) trained by ERM on the base
  classes (`data.base`, `data.base_classes`) with the run's `seed`, through `owai.train.train_loop`
  (stage `pretrain`: checkpoints, resume). Its final weights (a torchvision-keyed state dict, base-class
  head included) go to `<cache>/pretrained/<backbone>-<key>.safetensors`, the cache `dropout-ft`'s
  pre-training uses, keyed by the pre-training settings and the seed (`pretrain_key`); a network already
  there is not trained again. n networks that differ only by seed = a sweep over seeds (the recipe's
  `sweep.seeds`), so 10 ImageNet ResNet50s are one SLURM array. Measured: the base-class test accuracy,
  and with `pretrain.transfer_probe` (Table 2.1) a linear probe of this network on `data.target`.
  `model.joint` = k trains k backbones as one network (Table 2.2's baseline; its sub-networks alone,
  Table A.1); `pretrain.snapshots` also keeps the weights at given epochs (Cat5-s / Distill5-s).
* evaluation stages of n pretrained networks (`probe.networks`: pretrain run or sweep directories; else
  the cache entries of `probe.seeds`, default 0..n-1, under this config's pre-training settings, or the
  snapshots `probe.snapshots` of one run), one or
  several joined by commas and run in this order in one run:
  - `distill`: Distill_n, a student with n heads fitting the networks' softened logits (§6.5);
  - `probe`: linear probes `ProbeHead` (BN1d -> Linear; SGD Nesterov, the step schedule of §6.2 in
    epochs, or `probe.schedule: cosine`; no weight decay on BN) on frozen features: one per network
    (their mean = `single.acc`, the last = `single.last.acc`; the first is Cat_1), one per Cat_k, k in
    `probe.sizes` (the first k networks), catsub_k (the mean of the first k per-network probes' logits)
    and the student's (`distill{n}.acc`);
  - `finetune`: normal fine-tuning of Cat_n under one Linear head (§6.3), and of the Distill_n student
    when `distill` ran before it (`ft.distill{n}.acc`, Table A.3's Distill5 row);
  - `two-stage`: each network fine-tuned alone, then `two_stage_head` over their frozen concatenation,
    initialised as their logit-average ensemble (§6.4);
  - `fewshot`: Chen et al.'s episodes on the target's test split for every network, Cat_k and the student,
    linear and cosine heads (§6.6).
  Every training is its own resumable `train_loop` stage (`distill`, `probe-net{i}`, `probe-cat{k}`,
  `probe-distill`, `finetune-cat{n}`, `finetune-distill{n}`, `ft-net{i}`, `two-stage-head{n}`) whose batches are a function of
  (seed, stage, step), so a killed run resumes to the same result; with `probe.augment` the probes
  train together on fresh crops as one stage, `probe-crops` (RRL's linear evaluation). The frozen
  features the probes, the two-stage head and the episodes read are extracted once per run into `<run>/features/`
  (`extract`: .npy files read memory-mapped, so ImageNet's features under Cat_n need disk, not
  memory), kept for a resume until their last reader is done, and all removed when the run completes.

Accuracies are measured on the target's test split after the last epoch. The reference script reports
the best epoch on the test set (spec §6.2); owai does not select on the test set. The probe's
weight-decay grid of §6.2 is a sweep over `probe.weight_decay`, not searched inside a run.

Datasets: `mnist` (the official files found by the data-root rule; 60k train / 10k test), `mnist-t10k`
(the packaged 10k test file split 80/20 by a keyed permutation: no download), `digits` (scikit-learn's
8x8 digits, split the same way), and the readers of `owai.data.classification` (cifar10, cifar100,
imagenet, inat18, cub, miniimagenet; SPLITS maps each role to the reader's split). Base and target
classes of the same label space (the three digit sets share one) must be disjoint (a transfer task) or,
on the same dataset, the same (an in-distribution probe, Table 2.2's ImageNet column): `check_class_split`.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import functools
import hashlib
import io
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from owai import console
from owai.config import MAX_NETWORKS, BaseConfig, check_count
from owai.errors import DataMissing, OwaiError, one_line
from owai.methods import Method, Outcome
from owai.optim import step_schedule, warmup_cosine_schedule
from owai.runs import Run

DIGIT_SETS = ("mnist", "mnist-t10k", "digits")  # one label space: the digits "0".."9"
KEYED_SPLITS = ("mnist-t10k", "digits")  # one file split 80/20 by data.split_seed (`_keyed_split`)
DATASETS = (*DIGIT_SETS, "cifar10", "cifar100", "imagenet", "inat18", "cub", "miniimagenet")
# the reader's split for each role: "train" (pre-training / the probe's training images), "test" (the
# target's evaluation images; the few-shot datasets' novel classes) and "base-test" (pre-training's
# in-distribution accuracy). Chen et al.'s few-shot splits hold no base-class test images, so
# pre-training on CUB / miniImageNet reports its accuracy on the base training images.
SPLITS = {
    "imagenet": {"test": "val", "base-test": "val"},
    "inat18": {"test": "val", "base-test": "val"},
    "cub": {"train": "base", "test": "novel", "base-test": "base"},
    "miniimagenet": {"train": "base", "test": "novel", "base-test": "base"},
}
DIGITS = [str(i) for i in range(10)]
# data.transforms "thesis": each dataset's transform style (`owai.data.images.STYLES`)
TRANSFORM_STYLES = {"cifar10": "cifar", "cifar100": "cifar", "imagenet": "imagenet", "inat18": "imagenet",
                    "cub": "fewshot", "miniimagenet": "fewshot"}
EVAL_STAGES = ("distill", "probe", "finetune", "two-stage", "fewshot")  # run in this order when chained
STAGES = ("pretrain", *EVAL_STAGES)
VERSION = 1  # of the pre-training cache key
TRANSFORMS_VERSION = 2  # of the evaluation transforms features are extracted with (2: CIFAR's int(size x 8/7))


@dataclass
class DataConfig:
    root: str = ""  # data root (or the dataset's own folder); "" = $OWAI_DATA, then the cache
    base: str = "imagenet"  # pre-training data (one of DATASETS)
    base_classes: list[str] = field(default_factory=list)  # [] = every class of `base`
    target: str = "cifar100"  # the probe's transfer task
    target_classes: list[str] = field(default_factory=list)  # [] = every class of `target`
    image_size: int = 224
    augment: bool = True  # random training transforms (pre-training, fine-tuning, distillation); false: the eval transform
    # "domainbed": DomainBed's transforms for every dataset. "thesis": each dataset's as the thesis
    # trained it (TRANSFORM_STYLES): CIFAR's of TH A.1 (also for CIFAR targets, A.2.1), He et al.'s
    # for ImageNet and iNat18 (A.2.1), Chen et al.'s for CUB and miniImageNet (A.4.2); the digits keep DomainBed's.
    # "vit": RRL's for its 384-px ViTs (Figure 2.4) on every dataset but the digits
    transforms: Literal["domainbed", "thesis", "vit"] = "domainbed"
    limit_per_class: int = 0  # keep at most this many images per class of every split (0 = all; tests)
    # keep this fraction of every target class's training images (keyed by split_seed, at least one
    # per class): Table A.4's CIFAR10 (1 %) and CIFAR100 (10 %) probes
    target_fraction: float = 1.0
    split_seed: int = 0  # mnist-t10k / digits: the keyed 80/20 train/test split
    workers: int = 4  # loader processes (0 = in the training process)
    eval_batch_size: int = 256


@dataclass
class ModelConfig:
    backbone: str = "resnet50"  # an owai.models.vision backbone, trained from scratch by `pretrain`
    joint: int = 1  # > 1: `pretrain` trains this many backbones jointly as one network (Table 2.2's 2xresnet50)


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
    optimizer: Literal["sgd", "adam"] = "sgd"  # adam: the few-shot baselines' (Chen et al.: lr 1e-3, batch 16)
    # the base-class head trained with the network: "linear" (Baseline), or "cosine", Chen et al.'s
    # cosine classifier (Baseline++, TH A.4.2 / Fig. 2.5: scale 2 up to 200 classes, a learnt norm per
    # class); supervised single networks only. Distill_n's student heads take their teachers' kinds
    head: Literal["linear", "cosine"] = "linear"
    checkpoint_every: int = 1000  # updates
    log_every: int = 50
    precision: Literal["auto", "float32", "bfloat16"] = "auto"  # auto = bfloat16 autocast on CUDA (every stage)
    transfer_probe: bool = False  # Table 2.1: also probe this one network on data.target (`transfer.acc`)
    # "simsiam": self-supervised pre-training (TH A.3.3, Table A.4) on the base images, labels unused:
    # two SimSiam views per image, the backbone under a projector and a predictor; the cache keeps the
    # backbone's features only (no class head)
    objective: Literal["supervised", "simsiam"] = "supervised"
    schedule: Literal["step", "cosine"] = "step"  # cosine: lr (1 + cos(pi t / T)) / 2 (SimSiam); step: milestones
    ssl_dim: int = 2048  # SimSiam projection / prediction width
    ssl_pred_dim: int = 512  # SimSiam predictor bottleneck
    ssl_proj_layers: int = 3  # SimSiam projector depth (Chen & He use 2 for CIFAR)
    ssl_hidden_dim: int = 0  # SimSiam projector's hidden width; 0 = the backbone's (Chen & He's ImageNet code), CIFAR 2048
    # how training batches are drawn: "replacement" (DomainBed's infinite loader, the default) or
    # "epochs" (each epoch a fresh permutation, the last incomplete batch dropped: the reference
    # SimSiam CIFAR code's and torchvision-style loaders')
    sampling: Literal["replacement", "epochs"] = "replacement"
    # Cat5-s / Distill5-s (TH A.4, Table A.7): also keep the weights at these epochs (cache entries
    # <backbone>-<key>-e<epoch>); the final network does not depend on them
    snapshots: list[float] = field(default_factory=list)


@dataclass
class ProbeConfig:
    """Spec §6.2: BN1d (affine) -> Linear, weights N(0, 0.01^2); SGD Nesterov, momentum 0.9, lr 0.01,
    x0.1 at epochs 8, 16, 24, 28 epochs, batch 256, no weight decay on the BN parameters."""

    n: int = 10  # networks concatenated (Cat_n)
    seeds: list[int] = field(default_factory=list)  # the networks' seeds in the cache ([] = 0..n-1)
    networks: list[str] = field(default_factory=list)  # pretrain run or sweep directories (replace seeds)
    snapshots: list[float] = field(default_factory=list)  # the n networks = these epochs' snapshots of one run (seeds[0])
    # the n networks = checkpoints trained elsewhere, features only (no heads: distill.target=features):
    # "PATH" (a .pth / .safetensors / .pth.tar file of model.backbone, e.g. SwAV's; "module." prefixes
    # and heads dropped), "BACKBONE:PATH" (of another owai backbone, e.g. resnet50_w2:swav_RN50w2.pth),
    # or "hf:ID" (a Hugging Face image model by hub id or local directory, e.g. SEER's
    # hf:facebook/regnet-y-320-seer, ViT hf:google/vit-base-patch16-224-in21k). Their feature widths
    # may differ (SEER's Cat_n joins RegNets of several sizes)
    weights: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 10])  # Cat_k reported, k <= n
    catsub: bool = True
    # Table 2.2's baselines, probed beside Cat_k: "wide{k}" (the backbone with every channel x k, e.g.
    # resnet18_w2) and "joint{k}" (k backbones trained jointly, model.joint=k), each the cache entry of
    # this config's pre-training at the first network's seed (pretrain it with --set model.joint=k / backbone)
    baselines: list[str] = field(default_factory=list)
    epochs: int = 28
    # "step": lr x gamma at each of `milestones` (§6.2); "cosine": lr (1 + cos(pi e / epochs)) / 2 at
    # (fractional) epoch e, milestones unused (Table 2.1: the probe shares the pre-training's cosine)
    schedule: Literal["step", "cosine"] = "step"
    milestones: list[int] = field(default_factory=lambda: [8, 16, 24])
    gamma: float = 0.1
    lr: float = 0.01
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 1e-4  # on the Linear only (wd_skip_bn); the thesis searches a grid
    batchnorm: bool = True  # BN1d before the Linear (§6.2); Table 2.1's probe is a plain Linear (§8)
    batch_size: int = 256
    # true: every probe trains on freshly augmented crops of its training images (the frozen networks
    # run on each batch, as RRL's linear evaluation does; the heads of one run share the batches);
    # false: on features extracted once with the evaluation transform (kept on disk: far faster)
    augment: bool = False
    checkpoint_every: int = 500  # updates
    log_every: int = 50


@dataclass
class FinetuneConfig:
    """Spec §6.3 normal fine-tuning ("[init]cat"): every backbone trains, concatenated, under one Linear
    head (PyTorch's default init, no BN); SGD momentum 0.9, cosine from lr to min_lr, no weight decay on
    BN. Spec §6.4 two-stage ("[2ft]cat"): each network fine-tuned alone (the same settings), then the
    frozen concatenation under `two_stage_head` (= the logit-average ensemble) trained for head_epochs
    at head_lr, Nesterov, the same weight decay (or head_weight_decay). TH A.3's self-supervised
    networks on ImageNet use a step schedule instead (milestones, gamma) and, for SwAV, a larger
    learning rate for the new classifier (classifier_lr_scale x lr, so that a resume that lowers lr
    after a NaN lowers the classifier's too)."""

    epochs: float = 100.0
    batch_size: int = 256
    lr: float = 0.01
    min_lr: float = 1e-7
    milestones: list[float] = field(default_factory=list)  # epochs where lr is multiplied by gamma; [] = cosine to min_lr
    gamma: float = 0.1
    classifier_lr_scale: float = 1.0  # the new Linear head's lr over lr (SwAV on ImageNet: 20, i.e. 0.2 against 0.01)
    momentum: float = 0.9
    weight_decay: float = 1e-4
    head_epochs: float = 1.0  # TH; the script's 2 is a discrepancy (spec §6.4)
    head_lr: float = 1e-3  # CIFAR; iNat18 1e-5
    head_weight_decay: float | None = None  # the two-stage head's (SwAV on ImageNet: 0); None = weight_decay
    # micro-batches per update of the networks' fine-tuning (batch_size images in `accumulate` passes of
    # batch_size / accumulate): a memory setting (Figure 2.4's batch of 512 ViT images at 384 px does not
    # fit one GPU's memory in one pass); each micro-batch is its own BatchNorm batch (ViTs have none)
    accumulate: int = 1
    checkpoint_every: int = 500
    log_every: int = 50


@dataclass
class DistillConfig:
    """Spec §6.5 / TH Eq. A.1: one student backbone with n heads, head i fitting teacher i's softened
    logits (KL at tau, times tau^2, summed over heads) on the base classes' training images. Distill5:
    SGD momentum 0.9, batch 2048, wd 0, lr warm-up 0.1 -> 0.8 over 5 epochs, x0.2 at 210 and 240, 270
    epochs. alpha < 1 mixes in cross-entropy on the labels (TH Eq. A.4, few-shot). target "features"
    is the self-supervised variant (TH A.3.3): head i regresses network i's features, loss
    sum_i (1 - cos) (`feature_distill_loss`); it needs no class heads (SimSiam, probe.weights).
    optimizer adam is the few-shot students' (TH A.4.3 keeps A.4.2's Adam, lr 1e-3, batch 16): lr
    after the warm-up and milestones as with SGD (none: constant), momentum unused."""

    target: Literal["logits", "features"] = "logits"
    optimizer: Literal["sgd", "adam"] = "sgd"
    tau: float = 10.0
    alpha: float = 1.0
    epochs: float = 270.0
    batch_size: int = 2048
    lr: float = 0.8
    warmup_epochs: float = 5.0
    warmup_lr: float = 0.1
    milestones: list[float] = field(default_factory=lambda: [210.0, 240.0])
    gamma: float = 0.2
    momentum: float = 0.9
    weight_decay: float = 0.0
    # micro-batches per update: batch_size images per update in `accumulate` forward/backward passes of
    # batch_size / accumulate (each its own BatchNorm batch, as one GPU's share of a multi-GPU batch)
    accumulate: int = 1
    checkpoint_every: int = 500
    log_every: int = 50


@dataclass
class FewshotConfig:
    """Chen et al. 2019's protocol (spec §6.6, TH A.4) on the target's test split (its novel classes):
    `episodes` episodes of `ways`-way k-shot with `queries` queries per class for each k in `shots`; a
    fresh linear or cosine head per episode on frozen features (SGD momentum 0.9, dampening 0.9, wd 1e-3,
    batch 4, 100 epochs, lr 0.1 per TH, 0.01 in Chen et al.'s code)."""

    shots: list[int] = field(default_factory=lambda: [1, 5])
    ways: int = 5
    queries: int = 15
    episodes: int = 600
    heads: list[str] = field(default_factory=lambda: ["linear", "cosine"])
    lr: float = 0.1
    epochs: int = 100
    batch_size: int = 4
    weight_decay: float = 1e-3
    seed: int | None = None  # of the episodes (the same for every representation of a run); None = the run's seed


@dataclass
class Config(BaseConfig):
    # "pretrain" (one network), or evaluation stages of n pretrained networks, alone or chained with
    # commas in any order (run as distill, probe, finetune, two-stage, fewshot): e.g. "probe,fewshot"
    stage: str = "pretrain"
    # what `owai rich-features --recipe ID` runs when no --stage is given, in order: "pretrain" (the
    # networks the later steps read from the cache, Table 2.2's baselines included; without a later
    # step, the recipe's own sweep) and evaluation stages joined by commas, one run each. [] = `stage`
    # alone. Finished networks are reused through the cache (`plan_chain`)
    chain: list[str] = field(default_factory=list)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    fewshot: FewshotConfig = field(default_factory=FewshotConfig)


def stages_of(stage: str) -> list[str]:
    """The stages named by `stage` ("pretrain", or a comma-separated chain of EVAL_STAGES), in run order."""
    names = [x.strip() for x in str(stage).split(",") if x.strip()]
    unknown = [x for x in names if x not in STAGES]
    if not names or unknown:
        raise OwaiError(f"stage {stage!r}: choose pretrain, or evaluation stages joined by commas from "
                        f"{', '.join(EVAL_STAGES)}")
    if len(set(names)) != len(names):
        raise OwaiError(f"stage {stage!r} names a stage twice")
    if "pretrain" in names and len(names) > 1:
        raise OwaiError("stage pretrain runs alone (one network per run; n networks = a sweep over seeds)")
    return [x for x in STAGES if x in names]


class RichFeatures(Method):
    Config = Config
    cli = "owai rich-features"
    one_run_command = False  # its subcommand runs the recipe's study, sweep or chain
    resume_overrides = ("pretrain.lr", "probe.lr", "finetune.lr", "distill.lr")

    @classmethod
    def lr_override(cls, stage: str) -> str | None:
        """Each training stage's own learning rate: ft-net{i} fine-tunes at finetune.lr; the two-stage
        head's finetune.head_lr cannot change on resume (None)."""
        if stage.startswith("ft-"):
            return "finetune.lr"
        if stage.startswith("two-stage"):
            return None
        return super().lr_override(stage)

    @staticmethod
    def validate(cfg: Config) -> None:
        check_settings(cfg)
        check_networks(cfg)

    def run(self, cfg: Config, run: Run) -> Outcome:
        if stages_of(cfg.stage) == ["pretrain"]:
            return run_pretrain(cfg, run)
        return run_chain(cfg, run)


def check_settings(cfg: Config) -> None:
    """Every check of `validate` but the pretrained networks' presence: settings, data and few-shot
    episodes (a chain validates its evaluation steps with this before their networks exist)."""
    from owai.models.rich import HEAD_KINDS
    from owai.models.vision import BACKBONES, native_image_size

    d, m, p, q = cfg.data, cfg.model, cfg.pretrain, cfg.probe
    for name in (d.base, d.target):
        if name not in DATASETS:
            raise OwaiError(f"data.base / data.target {name!r}: choose one of {', '.join(DATASETS)}")
    if m.backbone not in BACKBONES:
        raise OwaiError(f"unknown backbone {m.backbone!r}; known: {', '.join(sorted(BACKBONES))}")
    # probe.weights name their own models, which take data.image_size (a ViT file's grid is resized to it);
    # distill's student is still a model.backbone that owai builds
    native = native_image_size(m.backbone)
    if native and native != d.image_size and not (q.weights and cfg.stage != "pretrain" and "distill" not in cfg.stage):
        raise OwaiError(f"{m.backbone} is built for {native} px images: set data.image_size={native}")
    if isinstance(m.joint, bool) or m.joint < 1:
        raise OwaiError(f"model.joint must be >= 1 (backbones trained as one network), got {m.joint}")
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
    # one label space: the probe's classes must be new ones or exactly pre-training's (an
    # in-distribution probe), unless pre-training never saw a label (SimSiam) or happened elsewhere
    # (probe.weights: SwAV, SEER, ViT ImageNet-21k -> ImageNet)
    if p.objective == "supervised" and not (q.weights and cfg.stage != "pretrain"):
        check_class_split(d.base, d.base_classes, d.target, d.target_classes)
    if not (p.epochs > 0 and p.batch_size >= 1 and p.lr > 0 and p.weight_decay >= 0 and 0 <= p.momentum < 1
            and p.gamma > 0 and p.checkpoint_every >= 1 and p.log_every >= 1):
        raise OwaiError("pretrain: need epochs > 0, batch_size >= 1, lr > 0, weight_decay >= 0, 0 <= momentum < 1, "
                        "gamma > 0, checkpoint_every >= 1, log_every >= 1")
    if not 0 < d.target_fraction <= 1:
        raise OwaiError(f"data.target_fraction must be in (0, 1], got {d.target_fraction}")
    for name in ("ssl_dim", "ssl_pred_dim", "ssl_proj_layers", "ssl_hidden_dim"):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "ssl_hidden_dim" else 1):
            raise OwaiError(f"pretrain.{name} must be an integer >= {0 if name == 'ssl_hidden_dim' else 1}, got {v!r}")
    if p.head == "cosine" and (p.objective != "supervised" or m.joint != 1):
        raise OwaiError("pretrain.head=cosine is a supervised single network's head (Baseline++): "
                        "not with pretrain.objective=simsiam or model.joint > 1")
    if p.objective == "simsiam" and cfg.stage == "pretrain" and (p.batch_size < 2 or p.snapshots):
        raise OwaiError("pretrain.objective=simsiam needs batch_size >= 2 (BatchNorm in the projector) and no snapshots")
    if any(not 0 < e <= p.epochs for e in p.snapshots) or len(set(p.snapshots)) != len(p.snapshots):
        raise OwaiError(f"pretrain.snapshots {p.snapshots}: give distinct epochs in (0, pretrain.epochs={p.epochs}]")
    if q.snapshots and (q.networks or len(q.snapshots) != q.n or len(set(q.snapshots)) != q.n):
        raise OwaiError(f"probe.snapshots {q.snapshots}: give probe.n={q.n} distinct epochs of one pretrain run "
                        "(its cache entries; not with probe.networks)")
    from owai.runtime import planned_device

    _precision(cfg, planned_device(cfg.runtime.device))  # bf16 autocast off CUDA: refused here, not in the run
    check_count("probe.n", q.n, 1, MAX_NETWORKS)
    bad = [k for k in q.sizes if not 1 <= k <= q.n]
    if not q.sizes or bad or len(set(q.sizes)) != len(q.sizes):
        raise OwaiError(f"probe.sizes {q.sizes}: give distinct sizes k in 1..probe.n={q.n} (Cat_k = the first k networks)")
    if not (q.epochs >= 1 and q.batch_size >= 2 and q.lr > 0 and q.weight_decay >= 0 and 0 <= q.momentum < 1
            and q.gamma > 0 and q.checkpoint_every >= 1 and q.log_every >= 1):
        raise OwaiError("probe: need epochs >= 1, batch_size >= 2 (BatchNorm1d), lr > 0, weight_decay >= 0, "
                        "0 <= momentum < 1, gamma > 0, checkpoint_every >= 1, log_every >= 1")
    if sum(bool(x) for x in (q.seeds or q.snapshots, q.networks, q.weights)) > 1:
        raise OwaiError("give one source of networks: probe.seeds / probe.snapshots (cache entries), "
                        "probe.networks (run directories) or probe.weights (checkpoint files)")
    if q.snapshots and len(q.seeds) > 1:
        raise OwaiError(f"probe.snapshots are of one pretrain run: give one seed, not {q.seeds}")
    if q.seeds and len(q.seeds) != q.n and not q.snapshots:
        raise OwaiError(f"probe.n={q.n} but {len(q.seeds)} seeds given ({q.seeds})")
    if len(set(q.seeds)) != len(q.seeds):
        raise OwaiError(f"probe.seeds {q.seeds} has duplicates: Cat_n's networks differ by seed")
    stages = stages_of(cfg.stage)
    f, s, k = cfg.finetune, cfg.distill, cfg.fewshot
    if not (f.epochs > 0 and f.batch_size >= 1 and f.lr > 0 and 0 <= f.min_lr <= f.lr and 0 <= f.momentum < 1
            and f.weight_decay >= 0 and f.head_epochs > 0 and f.head_lr > 0 and f.checkpoint_every >= 1
            and f.log_every >= 1 and 0 < f.gamma <= 1 and f.classifier_lr_scale > 0
            and (f.head_weight_decay is None or f.head_weight_decay >= 0)):
        raise OwaiError("finetune: need epochs > 0, batch_size >= 1, lr > 0, 0 <= min_lr <= lr, 0 <= momentum < 1, "
                        "weight_decay >= 0, head_epochs > 0, head_lr > 0, checkpoint_every >= 1, log_every >= 1, "
                        "0 < gamma <= 1, classifier_lr_scale > 0, head_weight_decay >= 0")
    if list(f.milestones) != sorted(set(f.milestones)) or any(not 0 < m < f.epochs for m in f.milestones):
        raise OwaiError(f"finetune.milestones {f.milestones}: increasing epochs between 0 and finetune.epochs ({f.epochs:g})")
    if not (s.tau > 0 and 0 <= s.alpha <= 1 and s.epochs > 0 and s.batch_size >= 1 and s.lr > 0
            and s.warmup_epochs >= 0 and s.warmup_lr > 0 and s.gamma > 0 and 0 <= s.momentum < 1
            and s.weight_decay >= 0 and s.checkpoint_every >= 1 and s.log_every >= 1):
        raise OwaiError("distill: need tau > 0, 0 <= alpha <= 1, epochs > 0, batch_size >= 1, lr > 0, warmup_epochs >= 0, "
                        "warmup_lr > 0, gamma > 0, 0 <= momentum < 1, weight_decay >= 0, checkpoint_every >= 1, log_every >= 1")
    for name, section in (("distill", s), ("finetune", f)):  # micro_batches cuts the batch in equal parts
        if isinstance(section.accumulate, bool) or section.accumulate < 1 or section.batch_size % section.accumulate:
            raise OwaiError(f"{name}.accumulate {section.accumulate}: a divisor of {name}.batch_size "
                            f"{section.batch_size}, >= 1")
    if not k.heads or any(h not in HEAD_KINDS for h in k.heads):
        raise OwaiError(f"fewshot.heads {k.heads}: choose from {', '.join(HEAD_KINDS)}")
    if not k.shots or any(isinstance(x, bool) or x < 1 for x in k.shots) or len(set(k.shots)) != len(k.shots):
        raise OwaiError(f"fewshot.shots {k.shots}: give distinct shot counts >= 1")
    if not (k.ways >= 2 and k.queries >= 1 and k.episodes >= 1 and k.lr > 0 and k.epochs >= 1
            and k.batch_size >= 1 and k.weight_decay >= 0 and (k.seed is None or k.seed >= 0)):
        raise OwaiError("fewshot: need ways >= 2, queries >= 1, episodes >= 1, lr > 0, epochs >= 1, batch_size >= 1, "
                        "weight_decay >= 0, seed >= 0")
    for step in cfg.chain:
        stages_of(step)  # each a stage or a comma-joined chain of evaluation stages
    if len(set(cfg.chain)) != len(cfg.chain) or any(x.strip() == "pretrain" for x in cfg.chain[1:]):
        raise OwaiError(f"chain {cfg.chain}: give each step once, pretrain (if any) first")
    if stages == ["pretrain"]:
        check_data(d.base, d.root)
        if p.transfer_probe:
            check_data(d.target, d.root)
        return
    check_data(d.target, d.root)
    if "distill" in stages:
        check_data(d.base, d.root)
    if "distill" in stages and s.target == "features" and s.alpha != 1:
        raise OwaiError("distill.target=features has no labels term: leave distill.alpha at 1")
    if "probe" in stages:
        for name in cfg.probe.baselines:
            baseline_config(cfg, name)
    if "fewshot" in stages:
        check_episodes(cfg)


def check_networks(cfg: Config) -> None:
    """The evaluation stages' networks: present, finished and fitting (`find_networks`), the baselines
    in the cache, and base-class heads where distill needs them. One line each, before any run directory."""
    stages = stages_of(cfg.stage)
    if stages == ["pretrain"]:
        return
    d, s = cfg.data, cfg.distill
    nets = find_networks(cfg)  # missing, unfinished, mismatched or overlapping networks: one line, nothing written
    if "probe" in stages:
        for name in cfg.probe.baselines:
            baseline_network(cfg, name)
    if "distill" in stages and s.target == "logits" and any(net.external or not net.n_classes for net in nets):
        raise OwaiError("distill.target=logits needs the networks' base-class heads; these are features only "
                        "(probe.weights or self-supervised): set distill.target=features (TH A.3.3)")
    n_base = base_class_count(cfg)
    for net in nets if "distill" in stages and n_base and s.target == "logits" else []:
        if net.n_classes and net.n_classes != n_base:
            raise OwaiError(f"{net.label} has a {net.n_classes}-class head; distill reads data.base {d.base} with "
                            f"{n_base} classes (set data.base / data.base_classes as in pre-training)")


# -- the recipe's chain -------------------------------------------------------------------------


@dataclass
class ChainStep:
    """One step of `owai rich-features --recipe ID` without --stage: a sweep of pretrain runs, or one
    run of evaluation stages."""

    stage: str  # "pretrain", or evaluation stages joined by commas (run order)
    what: str  # for messages: "4 networks (seeds 0, 1, 2, 3)", "baselines wide2, joint2", "probe"
    sets: list[str]  # the sweep's or run's --set overrides (stage included)
    seeds: list[int] | None = None  # pretrain: the sweep's seeds (None: the recipe's)
    grid: Any = None  # pretrain: the sweep's grid (None: the recipe's)
    entries: list[Path] = field(default_factory=list)  # pretrain: the cache files its points write

    @property
    def cached(self) -> bool:
        """A pretrain step whose every network (and snapshot) is already in the cache: skipped."""
        return bool(self.entries) and all(path.is_file() for path in self.entries)

    def command(self, recipe: str, preset: str) -> str:
        """The equivalent `--stage` command line (for messages and --dry-run)."""
        words = ["owai rich-features", f"--stage {self.stage}", f"-r {recipe}", f"-p {preset}"]
        if self.seeds is not None:
            words.append("--seeds " + ",".join(map(str, self.seeds)))
        words += [f"--set {x}" for x in self.sets if not x.startswith("stage=")]
        cells = [f"{k}={v}" for sub in self.grid for k, vs in sub.items() for v in vs] if isinstance(self.grid, list) else []
        return "; ".join(" ".join([*words, f"--set {cell}"]) for cell in cells) if cells else " ".join(words)


def chain_steps(cfg: Config) -> list[str]:
    """The recipe's chain (Config.chain, else its `stage` alone), each step in run order."""
    return [",".join(stages_of(step)) for step in (cfg.chain or [cfg.stage])]


def cached_seeds(cfg: Config) -> list[int]:
    """The seeds of the networks an evaluation config reads from the cache ([] when it reads run
    directories or checkpoint files)."""
    q = cfg.probe
    if q.networks or q.weights:
        return []
    if q.snapshots:
        return [(q.seeds or [0])[0]]
    return list(q.seeds or range(q.n))


def cache_entries(cfg: Config) -> list[Path]:
    """The cache files the pretrain run of `cfg` (its seed) writes: the final weights and its snapshots."""
    return [weights_path(cfg, cfg.seed), *(snapshot_path(cfg, cfg.seed, e) for e in cfg.pretrain.snapshots)]


def plan_chain(recipe: str, preset: str | None, sets: list[str], seeds: list[int] | None = None) -> list[ChainStep]:
    """The steps that run recipe `recipe` from an empty cache with one command, each validated as
    far as it can be before the earlier steps ran: every pretrain sweep point fully (`sweep.plan`),
    an evaluation step's settings, data and episodes (`check_settings`) and, when no pretrain step
    makes them, its networks (`check_networks`). Nothing is written.

    A pretrain step trains the networks the evaluation steps read from the cache (their seeds,
    `cached_seeds`; Table 2.2's baselines `probe.baselines` as a second sweep at the first seed);
    before any evaluation step reads the cache it is skipped, and with no evaluation step it is the
    recipe's own sweep (grid and seeds; `seeds` replaces them). With evaluation steps, `seeds` are
    the networks': probe.seeds (and probe.n)."""
    from owai import sweep as sweeps
    from owai.experiment import resolve
    from owai.recipes import load

    rec = load(recipe)
    base, resolved = resolve(rec, preset, sets, validate=False)
    preset = resolved["preset"]
    chain = chain_steps(base)
    evals = [step for step in chain if step != "pretrain"]
    if seeds is not None and evals:  # n = the seeds' count unless given (--n): then check_settings compares them
        given_n = any(s.split("=", 1)[0].strip() == "probe.n" for s in sets)
        sets = [*sets, f"probe.seeds={list(seeds)}", *([] if given_n else [f"probe.n={len(seeds)}"])]
    configs = {step: resolve(rec, preset, [*sets, f"stage={step}"], validate=False)[0] for step in evals}

    def sweep_step(what: str, step_seeds: list[int] | None, grid: Any) -> ChainStep:
        step_sets = [*sets, "stage=pretrain"]
        points = sweeps.plan(rec, preset, step_sets, None, step_seeds, grid)  # validates every point
        entries = [path for point in points
                   for path in cache_entries(resolve(rec, preset, point.overrides, validate=False)[0])]
        return ChainStep("pretrain", what, step_sets, step_seeds, grid, entries)

    steps: list[ChainStep] = []
    for step in chain:
        if step == "pretrain":
            if not evals:
                steps.append(sweep_step("networks (the recipe's sweep)", seeds, None))
                continue
            needed = sorted({s for cfg in configs.values() for s in cached_seeds(cfg)})
            if needed:
                steps.append(sweep_step(f"{len(needed)} network(s), seeds {', '.join(map(str, needed))}", needed, {}))
            grids: dict[int, list[dict[str, list[Any]]]] = {}
            names: dict[int, list[str]] = {}
            for cfg in configs.values():
                for name in cfg.probe.baselines if "probe" in stages_of(cfg.stage) else []:
                    _, how, seed = baseline_config(cfg, name)
                    key, value = how.split("=", 1)
                    if name not in names.setdefault(seed, []):
                        names[seed].append(name)
                        grids.setdefault(seed, []).append({key: [int(value) if key == "model.joint" else value]})
            for seed, grid in grids.items():
                steps.append(sweep_step(f"baselines {', '.join(names[seed])} (seed {seed})", [seed], grid))
            continue
        cfg = configs[step]
        check_settings(cfg)
        if not any(s.stage == "pretrain" for s in steps) or not cached_seeds(cfg):
            check_networks(cfg)
        steps.append(ChainStep(step, step, [*sets, f"stage={step}"]))
    return steps


# -- data ---------------------------------------------------------------------------------------


def base_class_count(cfg: Config) -> int:
    """The number of pre-training classes the config names (0 when only the data can tell)."""
    d = cfg.data
    return len(d.base_classes) if d.base_classes else (10 if d.base in DIGIT_SETS else 0)


def head_classes(cfg: Config) -> int:
    """The width of the cached networks' base-class heads: base_class_count, or 0 when self-supervised
    pre-training gave them none."""
    return base_class_count(cfg) if cfg.pretrain.objective == "supervised" else 0


def _same_labels(a: str, b: str) -> bool:
    """Whether base and target classes come from one label space and must be checked for overlap. CUB and
    miniImageNet's base and novel splits are disjoint class sets by construction (SPLITS)."""
    if a == b and SPLITS.get(a, {}).get("train") == "base":
        return False
    return a == b or (a in DIGIT_SETS and b in DIGIT_SETS)


def check_class_split(base: str, base_classes: list[str], target: str, target_classes: list[str]) -> bool:
    """The probe's classes against pre-training's when they share one label space: the same dataset
    with the same classes is an in-distribution probe (Table 2.2's ImageNet column: ImageNet's own
    classes, probed on its validation images; returns True); otherwise the target's classes must be
    new ones (disjoint: a transfer task), and a partial overlap is refused (OwaiError)."""
    from owai.data.classification import disjoint_split

    for what, classes in (("base", base_classes), ("target", target_classes)):
        if len(set(map(str, classes))) != len(classes):
            raise OwaiError(f"data.{what}_classes has duplicates: {classes}")
    if not _same_labels(base, target):
        return False
    if in_distribution(base, base_classes, target, target_classes):
        return True
    both = (base_classes or _all_classes(base), target_classes or _all_classes(target))
    try:
        disjoint_split(*both)
    except OwaiError as e:
        raise OwaiError(f"{e}: a transfer probe needs new classes, an in-distribution probe the same dataset and "
                        "the same classes") from None
    return False


def in_distribution(base: str, base_classes: list[str], target: str, target_classes: list[str]) -> bool:
    """Whether the probe's task is pre-training's own: one label space, the same dataset, the same classes."""
    return (_same_labels(base, target) and base == target
            and _class_set(base, base_classes) == _class_set(target, target_classes))


def _class_set(name: str, classes: list[str]) -> frozenset[str] | None:
    """`classes` as a set, [] read as every class of `name` (the digits' ten; None: a dataset's all)."""
    if classes:
        return frozenset(map(str, classes))
    return frozenset(DIGITS) if name in DIGIT_SETS else None


def _all_classes(name: str) -> list[str]:
    if name in DIGIT_SETS:
        return list(DIGITS)
    raise OwaiError(f"data.base and data.target are both {name}: list data.base_classes and data.target_classes "
                    "(disjoint class sets), or leave both empty for an in-distribution probe")


def check_data(name: str, root: str) -> None:
    """A one-line DataMissing (naming the fetch command or the manual step) when `name` is not here."""
    if name == "mnist":
        from owai.data.mnist import check_mnist_dir, mnist_dir

        for split in ("train", "test"):
            try:
                folder = mnist_dir(split, root or None)
            except DataMissing as e:
                raise DataMissing(f"{e} (or data.base / data.target = mnist-t10k: the packaged test file only)") from None
            check_mnist_dir(folder, split)  # a truncated or corrupt file: one line, before the sweep's points
    elif name in ("cifar10", "cifar100"):  # a corrupt or truncated batch file: one line before any run directory
        from owai.data import registry
        from owai.data.classification import read_cifar

        folder = registry.require(name, root or None)
        for split in ("train", "test"):
            read_cifar(folder, name, split)
    elif name not in ("mnist-t10k", "digits"):
        from owai.data import registry

        registry.require(name, root or None)


def check_episodes(cfg: Config) -> None:
    """One line before any run directory when the target's test split cannot give the episodes: fewer
    classes than fewshot.ways, or a class with fewer images than the largest shot + queries."""
    k = cfg.fewshot
    data = load_split(cfg, cfg.data.target, "test", cfg.data.target_classes)
    counts = torch.bincount(data.labels, minlength=len(data.classes))
    if len(data.classes) < k.ways:
        raise OwaiError(f"fewshot.ways={k.ways} but {cfg.data.target} test has {len(data.classes)} classes")
    need = max(k.shots) + k.queries
    small = [(c, int(n)) for c, n in zip(data.classes, counts) if n < need]
    if small:
        c, n = small[0]
        raise OwaiError(f"{max(k.shots)}-shot episodes with {k.queries} queries need {need} images per class; "
                        f"{cfg.data.target} test class {c!r} has {n} ({len(small)} classes too small)")


def _keyed_split(n: int, split: str, seed: int) -> torch.Tensor:
    """The train (80 %) or test (20 %) indices of a set without an official split, keyed by `seed`."""
    from owai.runtime import generator

    order = torch.randperm(n, generator=generator(seed, "rich-split", n))
    cut = (4 * n) // 5
    return order[:cut] if split == "train" else order[cut:]


def load_split(cfg: Config, name: str, split: Literal["train", "test", "base-test"], classes: list[str],
               fraction: float = 1.0) -> Any:
    """`split` (a role, see SPLITS) of dataset `name` restricted to `classes` (relabelled 0..k-1 in that order; [] = all), at
    most `data.limit_per_class` images per class, then `fraction` of each class's images (at least one; keyed by
    data.split_seed): an `owai.data.classification.ClassificationData`."""
    from owai.data import classification as cl

    d = cfg.data
    if name == "mnist":
        from owai.data.mnist import load_mnist

        m = load_mnist("train" if split == "train" else "test", root=d.root or None)
        data = cl.ClassificationData(m.images, m.labels, list(DIGITS), f"MNIST {split}")
    elif name in ("mnist-t10k", "digits"):
        if name == "digits":
            full = cl.load_digits()
        else:
            from owai.data.mnist import PACKAGED_DIR, load_mnist_idx

            m = load_mnist_idx(PACKAGED_DIR, "test")
            full = cl.ClassificationData(m.images, m.labels, list(DIGITS), "MNIST t10k (packaged)")
        data = cl._subset(full, _keyed_split(len(full), "train" if split == "train" else "test", d.split_seed))
    else:
        data = cl.load(name, SPLITS.get(name, {}).get(split, "train" if split == "train" else "test"), d.root or None)
    if classes:
        data = cl.select_classes(data, classes)
    if d.limit_per_class:
        data = _per_class(data, [d.limit_per_class] * len(data.classes), d.split_seed, "rich-limit", name, split)
    if fraction < 1:
        counts = torch.bincount(data.labels, minlength=len(data.classes)).tolist()
        quota = [max(1, math.ceil(fraction * c)) if c else 0 for c in counts]
        data = _per_class(data, quota, d.split_seed, "rich-fraction", name, split)
    if len(data) == 0:
        raise OwaiError(f"{name} {split} has no images of classes {classes or 'all'}")
    if d.transforms != "domainbed":
        data = dataclasses.replace(data, style=style_of(cfg, name))
    return data


def style_of(cfg: Config, name: str) -> str:
    """How dataset `name`'s images become tensors under this config (`owai.data.images.STYLES`)."""
    if name not in TRANSFORM_STYLES or cfg.data.transforms == "domainbed":
        return "domainbed"  # the digits keep DomainBed's in every mode
    return "vit" if cfg.data.transforms == "vit" else TRANSFORM_STYLES[name]


def _per_class(data: Any, quota: list[int], seed: int, *key: str) -> Any:
    """The first quota[c] images of each class c in a permutation keyed by (seed, *key), in index order."""
    from owai.data import classification as cl
    from owai.runtime import generator

    order = torch.randperm(len(data), generator=generator(seed, *key))
    keep, count = [], [0] * len(data.classes)
    for i in order.tolist():
        y = int(data.labels[i])
        if count[y] < quota[y]:
            count[y] += 1
            keep.append(i)
    return cl._subset(data, torch.tensor(sorted(keep), dtype=torch.int64))


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


def _batches(cfg: Config, data: Any, description: str = "evaluate") -> Any:
    """Eval-transformed (x, y) batches of every example of `data`, in order, with progress on stderr
    (a line every 30 s off a terminal: extracting a wide network's features takes minutes on a CPU)."""
    from owai.data.domainbed import eval_batches

    batches = eval_batches(OneDomain(data), 0, torch.arange(len(data)), cfg.data.image_size, cfg.data.eval_batch_size,
                           cfg.data.workers, torch.cuda.is_available(), style=data.style)
    return console.track(batches, math.ceil(len(data) / cfg.data.eval_batch_size), f"{description} {len(data)} images")


def _precision(cfg: Config, device: torch.device) -> str:
    from owai.runtime import training_precision

    return training_precision(cfg.pretrain.precision, device, "pretrain.precision")


# -- pretrain -----------------------------------------------------------------------------------


def pretrain_key(cfg: Config, seed: int) -> str:
    """The cache key of the network `pretrain` trains at `seed`: every setting it depends on."""
    from owai.config import to_dict

    d = cfg.data
    what = {"method": "rich_features", "version": VERSION, "backbone": cfg.model.backbone, "seed": seed,
            # bookkeeping is left out, and the defaults of settings added later (optimizer, objective,
            # schedule, head, ssl_*) too, so keys written before they existed stay valid
            "pretrain": {k: v for k, v in to_dict(cfg.pretrain).items()
                         if k not in ("checkpoint_every", "log_every", "transfer_probe", "snapshots")
                         and (k, v) not in (("optimizer", "sgd"), ("objective", "supervised"), ("schedule", "step"),
                                            ("head", "linear"), ("ssl_hidden_dim", 0), ("sampling", "replacement"))
                         and not (k.startswith("ssl_") and cfg.pretrain.objective == "supervised")},
            "base": d.base, "base_classes": d.base_classes, "root": d.root, "image_size": d.image_size,
            "augment": d.augment, "limit_per_class": d.limit_per_class, "split_seed": d.split_seed}
    if cfg.pretrain.objective == "simsiam":  # 2: BatchNorm per view (before, over both views together)
        what["ssl_version"] = 2
    # the base images' style where it changes what pre-training sees (SimSiam's views differ only in
    # CIFAR's statistics); left out at DomainBed's, so keys written before the setting stay valid
    style = style_of(cfg, d.base)
    if style != "domainbed" and (cfg.pretrain.objective == "supervised" or style == "cifar"):
        what["transforms"] = style
    if cfg.model.joint != 1:
        what["joint"] = cfg.model.joint
    if cfg.pretrain.precision == "auto":  # keyed as what it resolves to where that is bf16 (on CUDA), so a
        # CPU run never takes a network trained under CUDA autocast; float32 keys written before stay valid
        from owai.runtime import auto_precision, select_device

        resolved = auto_precision("auto", select_device(cfg.runtime.device))
        if resolved != "float32":
            what["pretrain"]["precision"] = resolved
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def weights_path(cfg: Config, seed: int) -> Path:
    """`<cache>/pretrained/<backbone>-<key>.safetensors` (the cache of dropout-ft's pre-training)."""
    from owai.io import cache_root

    return cache_root() / "pretrained" / f"{cfg.model.backbone}-{pretrain_key(cfg, seed)}.safetensors"


def snapshot_path(cfg: Config, seed: int, epoch: float) -> Path:
    """The cache entry of the network `pretrain` trains at `seed`, as it was after `epoch` epochs."""
    final = weights_path(cfg, seed)
    return final.with_name(f"{final.stem}-e{epoch:g}{final.suffix}")


def build_network(backbone: str, n_classes: int, seed: int, state: dict[str, torch.Tensor] | None = None,
                  joint: int = 1, head: str = "linear") -> torch.nn.Module:
    """An owai.models.vision backbone with an `n_classes` head (`head`: linear, or Baseline++'s cosine
    classifier), initialised from (seed, backbone); with joint > 1 a JointNetwork of `joint` such
    backbones (keyed also by their index) under one linear head."""
    from owai.models.rich import JointNetwork, class_head, strip_head
    from owai.models.vision import build_backbone, replace_head
    from owai.runtime import derive_seed

    with torch.random.fork_rng(devices=[]):
        if joint == 1:
            torch.manual_seed(derive_seed(seed, "pretrain-init", backbone))
            net = build_backbone(backbone, num_classes=n_classes)
            if head != "linear":  # after the backbone's own init: its weights do not depend on the head
                replace_head(net, class_head(head, net.feature_dim, n_classes))
        else:
            parts = []
            for i in range(joint):
                torch.manual_seed(derive_seed(seed, "pretrain-init", backbone, "joint", i))
                parts.append(strip_head(build_backbone(backbone, num_classes=n_classes)))
            torch.manual_seed(derive_seed(seed, "pretrain-init", backbone, "joint-head"))
            net = JointNetwork(parts, n_classes)
    if state is not None:
        try:
            net.load_state_dict(state)
        except RuntimeError as e:
            raise OwaiError(f"pretrained weights do not fit {backbone}: {one_line(e)}") from None
    return net


def run_pretrain(cfg: Config, run: Run) -> Outcome:
    """Stage `pretrain`: one network on the base classes (or its cache entry), then its base test accuracy
    (supervised), or SimSiam on the base images (pretrain.objective=simsiam: no labels, no head; the
    measure is its final loss, `pretrain.ssl_loss`, and its transfer probe)."""
    from owai.data.domainbed import StepBatches
    from owai.data.images import StepStream
    from owai.io import build_lock, read_cache_entry, write_cache_entry
    from owai.train import LoopConfig, train_loop

    d, p, device = cfg.data, cfg.pretrain, run.device
    ssl = p.objective == "simsiam"
    train_set = load_split(cfg, d.base, "train", d.base_classes)
    test_set = load_split(cfg, d.base, "base-test", d.base_classes)
    classes = train_set.classes
    path = weights_path(cfg, cfg.seed)
    # updates per epoch: N / B drawn with replacement, or N // B passes without (the last batch dropped)
    per_epoch = len(train_set) / p.batch_size if p.sampling == "replacement" else len(train_set) // p.batch_size
    steps = max(1, round(p.epochs * per_epoch))
    snaps = {max(1, round(e * per_epoch)): snapshot_path(cfg, cfg.seed, e) for e in p.snapshots}  # step -> file
    summary: dict[str, Any] = {}
    # one process trains a seed's network: a chain's or a sweep's workers that need the same entry wait for it
    with build_lock(path, ready=lambda: path.is_file() and all(f.is_file() for f in snaps.values())):
        state = read_cache_entry(path, lambda tensors, _: tensors)
        cached = state is not None
        if cached:
            console.info(f"network seed {cfg.seed}: cached at {path}")
        if state is not None and not all(f.is_file() for f in snaps.values()):
            state, cached = None, False  # trained again (deterministically) for the snapshots it lacks
        if state is None:
            from owai.models.rich import SimSiam, simsiam_loss, strip_head

            net = build_network(cfg.model.backbone, len(classes), cfg.seed, joint=cfg.model.joint, head=p.head)
            if ssl:
                net = SimSiam(strip_head(net), p.ssl_dim, p.ssl_pred_dim, p.ssl_proj_layers,
                              hidden_dim=p.ssl_hidden_dim or None)
            net = net.to(device)
            batches = StepBatches(OneDomain(train_set), [0], [torch.arange(len(train_set))], p.batch_size, d.image_size,
                                  d.augment, cfg.seed, steps, views=2 if ssl else 1, style=train_set.style,
                                  sampling=p.sampling)
            stream = StepStream(batches, d.workers, device)
            optimizer = (torch.optim.Adam(net.parameters(), lr=p.lr, weight_decay=p.weight_decay) if p.optimizer == "adam"
                         else torch.optim.SGD(net.parameters(), lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay))
            lr_at = (warmup_cosine_schedule(p.lr, 0, steps, 0.0) if p.schedule == "cosine"  # lr (1 + cos(pi t / T)) / 2
                     else step_schedule(p.lr, p.gamma, [round(m * per_epoch) for m in p.milestones]))

            def loss_at(step: int, micro: int) -> torch.Tensor:
                x, y = stream.at(step)
                if ssl:
                    return simsiam_loss(*net(x))  # x: the two views stacked, (2B, 3, S, S)
                return F.cross_entropy(net(x), y)

            loop = LoopConfig(steps=steps, checkpoint_every=min(p.checkpoint_every, steps), log_every=min(p.log_every, steps),
                              precision=_precision(cfg, device))
            def snapshot(done: int) -> None:  # before the step's checkpoint: a resumed run has every earlier one
                if done in snaps:
                    write_cache_entry(snaps[done], net.state_dict())

            with stream:  # its workers end with the stage, failed or not
                summary = train_loop(run, "pretrain", net, optimizer, loss_at, loop, lr_at=lr_at, after_step=snapshot)
            kept = net.backbone if ssl else net  # SimSiam: the backbone's features only (no projector, no head)
            state = {k: v.detach().cpu().contiguous() for k, v in kept.state_dict().items()}
            write_cache_entry(path, state)
    net = network_from_state(cfg.model.backbone, state, cfg.seed, cfg.model.joint, str(path)).to(device).eval()
    details = {"weights": str(path), "cached": cached, "seed": cfg.seed, "key": pretrain_key(cfg, cfg.seed),
               "objective": p.objective, "snapshots": {f"{e:g}": str(snapshot_path(cfg, cfg.seed, e)) for e in p.snapshots},
               "classes": [] if ssl else classes, "steps": steps, "feature_dim": int(net.feature_dim),
               "split_sizes": {"train": len(train_set), "test": len(test_set)}}
    measured: dict[str, Any] = {}
    if ssl:  # no labels, no head: the SimSiam loss (-1 at best), when this run trained it
        if "final_loss" in summary:
            measured["pretrain.ssl_loss"] = summary["final_loss"]
    else:
        correct = 0
        with torch.no_grad():
            for x, y in _batches(cfg, test_set):
                correct += int((net(x.to(device)).argmax(1).cpu() == y).sum())
        measured["pretrain.base_acc"] = correct / len(test_set)
        console.info(f"network seed {cfg.seed}: base test accuracy {measured['pretrain.base_acc']:.4f}")
    if cfg.model.joint > 1:  # Table A.1 (training accuracy): each sub-network alone under its block of the joint head
        measured.update(joint_sub_accuracies(cfg, net, joint_train_subset(train_set, cfg.seed), device, "train_acc"))
        measured.update(joint_sub_accuracies(cfg, net, test_set, device, "base_acc"))
    if p.transfer_probe:  # Table 2.1: this network's features, linearly probed on the target task
        target_train = load_split(cfg, d.target, "train", d.target_classes, d.target_fraction)
        target_test = load_split(cfg, d.target, "test", d.target_classes)
        measured["transfer.acc"] = probe_network(cfg, run, "transfer-probe", net, str(path), target_train, target_test)
        details["transfer_split_sizes"] = {"train": len(target_train), "test": len(target_test)}
        console.info(f"network seed {cfg.seed}: transfer to {d.target} {measured['transfer.acc']:.4f}")
        drop_features(run)
    return Outcome(measured, details)


JOINT_TRAIN_IMAGES = 10_000  # Table A.1's training accuracy is measured on at most this many training images


def joint_train_subset(train_set: Any, seed: int) -> Any:
    """The training images Table A.1's sub-network accuracies are measured on: all of them up to
    JOINT_TRAIN_IMAGES, else that many drawn by a permutation keyed by (seed, "joint-train-acc") (in
    index order). ImageNet's 1.28M would cost a third of a training epoch per network; 10 000 images
    give a standard error of at most half a point, against sub-networks 20 to 70 points apart."""
    from owai.data import classification as cl
    from owai.runtime import generator

    if len(train_set) <= JOINT_TRAIN_IMAGES:
        return train_set
    keep = torch.randperm(len(train_set), generator=generator(seed, "joint-train-acc"))[:JOINT_TRAIN_IMAGES]
    return cl._subset(train_set, keep.sort().values)


@torch.no_grad()
def joint_sub_accuracies(cfg: Config, net: torch.nn.Module, data: Any, device: torch.device,
                         name: str) -> dict[str, float]:
    """`joint.sub{i}.<name>`: the accuracy on `data` (eval mode, the evaluation transform) of sub-network
    i of a JointNetwork alone, its features through its own block of the head, W[:, block_i] z_i + b (TH
    Table A.1: one sub-network dominates). run_pretrain measures it on training images (`train_acc`,
    what Table A.1 reports) and on the base test split (`base_acc`)."""
    cat, fc = net.features, net.fc
    net.eval()
    blocks = torch.split(fc.weight, list(cat.dims), dim=1)  # n x (C, d_i)
    correct = [0] * len(blocks)
    for x, y in _batches(cfg, data):
        for i, (z, w) in enumerate(zip(cat.per_network(x.to(device)), blocks)):
            correct[i] += int(((z @ w.T + fc.bias).argmax(1).cpu() == y).sum())
    return {f"joint.sub{i}.{name}": c / len(data) for i, c in enumerate(correct)}


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
    joint: int = 1  # backbones trained jointly as this one network (model.joint)
    external: bool = False  # a checkpoint file from elsewhere (probe.weights): features only, no head


def external_features(backbone: str, path: Path, image_size: int | None = None) -> dict[str, torch.Tensor]:
    """The feature weights of `backbone` in checkpoint file `path` (.pth read with weights_only, or
    .safetensors), checked as `check_external_features` checks them: keys under owai's names
    (`vision.checkpoint_keys`), those outside the backbone's features (its own head, SSL projection
    heads, prototypes) dropped. A ViT's position grid of another size is resized once to `image_size`
    (`vision.resize_position_grid`, as a Hugging Face ViT's and as RRL's Figure 2.4 do)."""
    from owai.models.vision import (POSITION_KEY, _read_state_dict, checkpoint_keys, feature_shapes, position_grid,
                                    resize_position_grid)

    own = feature_shapes(backbone, image_size or 0)
    state = checkpoint_keys(_read_state_dict(path))
    _check_external(backbone, own, {k: tuple(v.shape) for k, v in state.items()}, path)
    if POSITION_KEY in own and tuple(state[POSITION_KEY].shape) != own[POSITION_KEY]:  # (1, 1 + g*g, D) -> (1, 1 + G*G, D)
        state[POSITION_KEY] = resize_position_grid(state[POSITION_KEY], 1, position_grid(own))
    # only BatchNorm counters can be absent here (files older than the counter): 0, as a fresh one
    return {k: state[k] if k in state else torch.zeros((), dtype=torch.long) for k in own}


def check_external_features(backbone: str, path: Path, image_size: int | None = None) -> None:
    """Before a run: checkpoint file `path` holds `backbone`'s feature weights, read from its header
    alone (`vision.weight_shapes`: a .safetensors header, a memory-mapped .pth). Every feature key is
    there with its shape (owai's, torchvision's or timm's names; a DataParallel `module.` prefix; the
    older official spellings), the BatchNorm counters excepted; a ViT's position grid may be of any
    square size (resized to `image_size` when loaded); a timm ViT's image statistics are in the
    config.json beside it (`vision.timm_statistics`). One-line OwaiError otherwise."""
    from owai.models.vision import checkpoint_keys, feature_shapes, timm_statistics, weight_shapes

    _check_external(backbone, feature_shapes(backbone, image_size or 0), checkpoint_keys(weight_shapes(path)), path)
    timm_statistics(path)  # a timm ViT's image statistics are found beside it


def _check_external(backbone: str, own: dict[str, tuple[int, ...]], got: dict[str, tuple[int, ...]], path: Path) -> None:
    """Raise unless checkpoint shapes `got` (owai's key names) hold every feature key of `own` with
    its shape; BatchNorm counters may be absent (older files), a ViT's grid of another square size
    is resized when loaded."""
    from owai.models.vision import POSITION_KEY, position_grid

    missing = [k for k in own if k not in got and not k.endswith("num_batches_tracked")]
    if missing:
        raise OwaiError(f"{path} is not a {backbone}: missing {len(missing)} feature keys ({', '.join(missing[:3])} ...)")
    resizable = POSITION_KEY in own and position_grid(got) and got[POSITION_KEY][2] == own[POSITION_KEY][2]
    bad = [k for k in own if k in got and tuple(got[k]) != own[k] and not (k == POSITION_KEY and resizable)]
    if bad:
        raise OwaiError(f"{path} is not a {backbone}: {bad[0]} has shape {tuple(got[bad[0]])}, expected {own[bad[0]]}")


def _pretrain_runs(path: Path) -> list[Path]:
    """A pretrain run directory, or every point of a pretrain sweep directory (in seed order)."""
    from owai.sweep import is_sweep_dir, open_sweep, point_status

    if not path.is_dir():
        raise DataMissing(f"probe.networks: {path} is not a directory (a pretrain run or sweep directory)")
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
    if results is None:  # written as a run's last step
        raise OwaiError(f"{path} is not finished; resume it with `owai rich-features --stage pretrain --resume {path}`")
    details = results.get("details", {})
    last = latest_checkpoint(run.checkpoints("pretrain"))
    final = last is not None and int(last.name[5:]) == int(details.get("steps", -1))
    weights = Path(details["weights"]) if details.get("weights") else None
    if not final and (weights is None or not weights.is_file()):
        raise OwaiError(f"{path} has neither its final checkpoint nor its cached weights ({weights})")
    net = Network(int(params["seed"]), str(path), params["model"]["backbone"], len(details.get("classes", [])),
                  last if final else None, weights, int(params["model"].get("joint", 1)))
    return net, params


def find_networks(cfg: Config) -> list[Network]:
    """The probe's n networks, checked: their number is probe.n, they exist and are finished, have
    equal feature widths and distinct seeds, were pre-trained at data.image_size, and their base
    classes are new to the probe or exactly its own (`check_class_split`). Every failure is one line,
    before any run directory."""
    from owai.models.vision import BACKBONES

    d, q = cfg.data, cfg.probe
    nets: list[Network] = []
    if q.weights:
        if len(q.weights) != q.n:
            raise OwaiError(f"probe.n={q.n} but {len(q.weights)} checkpoint files given in probe.weights")
        for i, text in enumerate(q.weights):
            backbone, path = weight_entry(str(text), cfg.model.backbone)
            if path is None:  # a Hugging Face model: its config is checked here, its weights when loaded
                from owai.models.hf_vision import check_hf_source

                check_hf_source(backbone, d.image_size)
            elif not path.is_file():
                raise OwaiError(f"probe.weights: checkpoint file not found: {path}")
            else:  # readable, and the backbone's keys and shapes, from the file's header
                check_external_features(backbone, path, d.image_size)
            nets.append(Network(i, str(path or backbone), backbone, 0, None, path, 1, external=True))
    elif q.networks:
        paths = [p for text in q.networks for p in _pretrain_runs(Path(text).expanduser())]
        if len(paths) != q.n:
            raise OwaiError(f"probe.n={q.n} but {len(paths)} pretrained networks given ({', '.join(q.networks)})")
        for path in paths:
            net, params = _network_of_run(cfg, path)
            base = params["data"]
            if base["image_size"] != d.image_size:
                raise OwaiError(f"{path} was pre-trained at {base['image_size']} px, the probe reads {d.image_size} px "
                                f"(set data.image_size={base['image_size']})")
            trained_with = base.get("transforms", "domainbed")  # a mode that changes how its base images looked
            if trained_with != d.transforms and TRANSFORM_STYLES.get(base["base"], "domainbed") != "domainbed":
                raise OwaiError(f"{path} was pre-trained with data.transforms={trained_with}, this run reads images with "
                                f"{d.transforms} (set data.transforms={trained_with})")
            if params["pretrain"].get("objective", "supervised") == "supervised":
                try:
                    same_task = check_class_split(base["base"], base["base_classes"], d.target, d.target_classes)
                except OwaiError as e:
                    raise OwaiError(f"{path}: {e}") from None
                # the keyed 80/20 split of mnist-t10k / digits: another seed's test images were its training images
                if same_task and base["base"] in KEYED_SPLITS and base.get("split_seed", 0) != d.split_seed:
                    raise OwaiError(f"{path} was pre-trained on the split of data.split_seed={base.get('split_seed', 0)}; "
                                    f"an in-distribution probe must test on that split's test images "
                                    f"(set data.split_seed={base.get('split_seed', 0)})")
            nets.append(net)
    elif q.snapshots:  # Cat_n-s: n snapshots of one run, one seed
        seed = (q.seeds or [0])[0]
        n_classes = head_classes(cfg)
        for epoch in q.snapshots:
            path = snapshot_path(cfg, seed, epoch)
            if not path.is_file():
                raise DataMissing(f"the snapshot of network seed {seed} at epoch {epoch:g} is not in the cache ({path}); "
                                  f"run `owai rich-features --stage pretrain --seeds {seed} --set "
                                  f"pretrain.snapshots=[{', '.join(f'{e:g}' for e in q.snapshots)}]` with the same settings")
            nets.append(Network(seed, f"seed {seed} epoch {epoch:g} ({path})", cfg.model.backbone, n_classes, None, path,
                                cfg.model.joint))
    else:
        seeds = q.seeds or list(range(q.n))
        n_classes = head_classes(cfg)
        for seed in seeds:
            path = weights_path(cfg, seed)
            if not path.is_file():
                raise DataMissing(f"pretrained network seed {seed} is not in the cache ({path}); run "
                                f"`owai rich-features --stage pretrain` with the same settings first, or give "
                                "probe.networks (run directories)")
            nets.append(Network(seed, str(path), cfg.model.backbone, n_classes, None, path, cfg.model.joint))
    seeds = [n.seed for n in nets]
    if len(set(seeds)) != len(seeds) and not q.snapshots and not q.weights:
        raise OwaiError(f"the networks' seeds {seeds} repeat: Cat_n concatenates n networks that differ by seed")
    widths = {}
    for net in nets:
        if net.backbone not in BACKBONES and not net.backbone.startswith("hf:"):
            raise OwaiError(f"{net.label}: unknown backbone {net.backbone!r}")
        widths[net.label] = _feature_dim(net.backbone) * net.joint
    # Cat_n of networks that differ only by seed have one width; checkpoints from elsewhere may mix
    # sizes (SEER's Cat_n), but one student's heads regress one width
    if len(set(widths.values())) != 1 and (not q.weights or "distill" in stages_of(cfg.stage)):
        shown = ", ".join(f"{w} ({label})" for label, w in list(widths.items())[:4])
        why = ("distill's heads need equal widths" if q.weights else "Cat_n's networks differ only by seed")
        raise OwaiError(f"the backbones have different feature sizes: {shown}; {why}")
    return nets


def weight_entry(text: str, default: str) -> tuple[str, Path | None]:
    """(backbone, file) of a probe.weights entry: "PATH" -> (default, PATH); "BACKBONE:PATH" -> (BACKBONE,
    PATH) when BACKBONE is an owai.models.vision name; "hf:ID" -> ("hf:ID", None), a Hugging Face model."""
    from owai.models.vision import BACKBONES

    if text.startswith("hf:"):
        if not text[3:].strip():
            raise OwaiError("probe.weights: 'hf:' needs a hub id or a local directory after it")
        return text, None
    name, sep, rest = text.partition(":")
    if sep and name in BACKBONES:
        return name, Path(rest).expanduser()
    return default, Path(text).expanduser()


def _feature_dim(backbone: str) -> int:
    """The backbone's feature width (an owai backbone's from its meta-device build; a Hugging Face
    model's from its config)."""
    if backbone.startswith("hf:"):
        from owai.models.hf_vision import hf_feature_dim

        return hf_feature_dim(backbone[3:])
    from owai.models.vision import meta_backbone

    return int(meta_backbone(backbone).feature_dim)


def load_network(net: Network, style: str = "domainbed", image_size: int | None = None) -> torch.nn.Module:
    """The network's backbone (torchvision keys, its base-class head) with its pretrained weights.
    `style`: how the images it will read are normalised (a Hugging Face model, or a timm ViT file, undoes
    it and applies its checkpoint's own preprocessing; owai's and torchvision's networks read the images
    as they come); `image_size`: their size (a Hugging Face model with a position grid is rebuilt for it,
    `HFImageBackbone`; a ViT file's grid is resized to it, `external_features`)."""
    from owai.checkpoint import load_checkpoint
    from owai.io import read_safetensors

    if net.external and net.backbone.startswith("hf:"):  # a Hugging Face image model, features only
        from owai.data.images import normalisation
        from owai.models.hf_vision import HFImageBackbone

        mean, std = normalisation(style)
        return HFImageBackbone(net.backbone[3:], image_size=image_size, input_mean=mean, input_std=std)
    if net.external:  # features only, under a placeholder 1-class head (every stage strips or replaces it)
        from owai.data.images import normalisation
        from owai.models.rich import strip_head
        from owai.models.vision import build_backbone, feed_own_statistics, size_kwargs

        model = strip_head(build_backbone(net.backbone, num_classes=1, **size_kwargs(net.backbone, image_size)))
        model.load_state_dict(external_features(net.backbone, net.weights, image_size))
        feed_own_statistics(model, net.weights, normalisation(style))  # a timm ViT (0.5 / 0.5), as an hf: model is
        return model
    if net.checkpoint is not None:
        _, state = load_checkpoint(net.checkpoint)
        weights = state["model"]
    else:
        weights = read_safetensors(net.weights)  # a corrupt cache entry: one line naming it
    return network_from_state(net.backbone, weights, net.seed, net.joint, net.label)


HEAD_PREFIXES = ("fc.", "classifier.", "heads.head.")  # where the base-class head is: ResNet / joint, DenseNet, ViT


def base_head(state: dict[str, torch.Tensor]) -> tuple[str, int] | None:
    """The base-class head stored in a network's state dict: (kind, classes), kind "linear" or
    "cosine" (Baseline++); None for features only (SimSiam, checkpoints from elsewhere)."""
    from owai.models.rich import head_kind

    for prefix in HEAD_PREFIXES:
        kind = head_kind(state, prefix)
        if kind is not None:
            return kind, int(state[prefix + ("direction" if kind == "cosine" else "weight")].shape[0])
    return None


def network_from_state(backbone: str, state: dict[str, torch.Tensor], seed: int, joint: int, label: str) -> torch.nn.Module:
    """A pretrained network from its state dict: with its base-class head when the state has one
    (supervised; linear or cosine), else its features only (SimSiam), the head stripped."""
    from owai.models.rich import strip_head

    head = base_head(state)
    if head is not None:
        return build_network(backbone, head[1], seed, state, joint, head=head[0])
    model = strip_head(build_network(backbone, 1, seed, joint=joint))
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise OwaiError(f"{label}: the weights do not fit {backbone}: {one_line(e)}") from None
    return model


WIDE = {"resnet18": "resnet18_w{k}", "resnet18_cifar": "resnet18_cifar_w{k}",  # model.backbone -> its wide variants
        "resnet50": "resnet50_w{k}"}


def baseline_config(cfg: Config, name: str) -> tuple[Config, str, int]:
    """Baseline `name` ("wide{k}" or "joint{k}"): (this config with the wide backbone or model.joint=k,
    the override that pretrains it, the seed it is pretrained at: the first network's)."""
    import dataclasses
    import re

    from owai.models.vision import BACKBONES

    found = re.fullmatch(r"(wide|joint)([2-9]|[1-9][0-9]+)", name)
    if not found:
        raise OwaiError(f"probe.baselines: {name!r} is not wide<k> or joint<k> (k >= 2)")
    kind, k = found.group(1), int(found.group(2))
    model = cfg.model
    if kind == "wide":
        backbone = WIDE.get(model.backbone, "").format(k=k)
        if backbone not in BACKBONES:
            raise OwaiError(f"probe.baselines: {model.backbone} has no {k}x wide variant (known: "
                            f"{', '.join(b for b in BACKBONES if '_w' in b)})")
        model, how = dataclasses.replace(model, backbone=backbone), f"model.backbone={backbone}"
    else:
        model, how = dataclasses.replace(model, joint=k), f"model.joint={k}"
    return dataclasses.replace(cfg, model=model), how, (cfg.probe.seeds or [0])[0]


def baseline_network(cfg: Config, name: str) -> Network:
    """Baseline `name` ("wide{k}" or "joint{k}") as a Network: the cache entry of this config's
    pre-training with the wide backbone or model.joint=k, at the first network's seed."""
    variant, how, seed = baseline_config(cfg, name)
    model = variant.model
    path = weights_path(variant, seed)
    if not path.is_file():
        raise DataMissing(f"baseline {name} (seed {seed}) is not in the cache ({path}); run `owai rich-features "
                          f"--stage pretrain --seeds {seed} --set {how}` with the same settings first (or run the "
                          "whole recipe without --stage)")
    return Network(seed, f"{name} ({path})", model.backbone, head_classes(cfg), None, path, model.joint)


def run_baseline_probes(cfg: Config, run: Run, train_set: Any, test_set: Any, measured: dict[str, Any]) -> None:
    """Table 2.2's wide / jointly trained baselines under the same linear probe: `{name}.acc`."""
    for name in cfg.probe.baselines:
        baseline = baseline_network(cfg, name)
        net = load_network(baseline, train_set.style, cfg.data.image_size).to(run.device)
        measured[f"{name}.acc"] = probe_network(cfg, run, f"probe-{name}", net, baseline.label, train_set, test_set)


def probe_network(cfg: Config, run: Run, stage: str, net: torch.nn.Module, origin: str, train_set: Any,
                  test_set: Any) -> float:
    """The test accuracy of a linear probe (stage `stage`) on one network's frozen features (its head
    removed): Table 2.1's transfer probe and Table 2.2's baselines. `origin`: where the network is from."""
    from owai.models.rich import ConcatFeatures, strip_head

    frozen = ConcatFeatures([strip_head(net)], frozen=True)
    stores = [feature_store(run, f"{stage}-train"), feature_store(run, f"{stage}-test")]
    if cfg.probe.augment:
        head = fit_probes_on_crops(cfg, run, stage, frozen, {stage: [0]}, train_set, len(train_set.classes),
                                   run.device)[stage]
    else:
        z_train, y_train = extract(cfg, frozen, train_set, run.device, stores[0], [origin])
        head = fit_probe(cfg, run, stage, z_train, y_train, len(train_set.classes), run.device)
    z_test, y_test = extract(cfg, frozen, test_set, run.device, stores[1], [origin])
    accuracy = _acc(_logits(head, z_test, run.device), y_test)
    for store in stores:  # no longer needed: the next baseline's features take their place on disk
        drop_store(store)
    return accuracy


# -- probe: features and heads ------------------------------------------------------------------


FEATURES = "features"  # the run directory's folder of extracted features, removed when the run completes


def feature_store(run: Run, name: str) -> Path:
    """Where the features `name` of this run are kept while it runs: <run>/features/<name>."""
    return run.path / FEATURES / name


@torch.no_grad()
def extract(cfg: Config, cat: Any, data: Any, device: torch.device, store: Path,
            origin: list[str]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The n feature blocks [(N, d_i)] (float32, CPU) of every example of `data`, and its labels.

    The blocks are written as they are computed to `<store>.net{i}.npy` and returned memory-mapped, so
    that features larger than memory (ImageNet's 1.28M images under Cat5 of SwAV or SEER: 50-100 GB)
    are read from disk a batch at a time, and a resumed run reads the features its killed attempt
    finished and still kept (each store is deleted after its last reader, `drop_store`) instead of
    computing them again. The labels file, written last, marks them complete, and beside it `origin`
    (the networks' labels: cache files named by their pre-training key, run directories) says which
    networks made them: features of other networks are extracted again."""
    import numpy as np

    from owai.io import atomic_write_bytes, atomic_write_text

    labels_path = store.with_name(f"{store.name}.labels.npy")
    origin_path = store.with_name(f"{store.name}.origin.json")
    paths = [store.with_name(f"{store.name}.net{i}.npy") for i in range(len(cat.backbones))]
    # what made them: the networks, and how the images were read (a resume across a change of the
    # transforms, e.g. CIFAR's 224-px resize, extracts them again)
    made_by = {"networks": list(origin), "images": len(data), "style": getattr(data, "style", "domainbed"),
               "image_size": cfg.data.image_size, "transforms": TRANSFORMS_VERSION}
    if labels_path.is_file() and all(p.is_file() for p in paths) and _read_origin(origin_path) == made_by:
        return [_mapped(p) for p in paths], torch.from_numpy(np.load(labels_path))
    drop_store(store)  # an incomplete set, or another's: its disk is freed before the new one is reserved
    store.parent.mkdir(parents=True, exist_ok=True)
    partial = [p.with_name(p.name + ".partial") for p in paths]
    arrays: list[Any] = []
    labels, row = [], 0
    try:
        for x, y in _batches(cfg, data, "features of"):
            for i, z in enumerate(cat.per_network(x.to(device))):
                if len(arrays) == i:  # the widths are known from the first batch
                    arrays.append(_feature_file(partial[i], len(data), z.shape[1]))
                arrays[i][row:row + len(z)] = z.float().cpu().numpy()
            labels.append(y)
            row += len(y)
    except OwaiError:  # no room: the blocks reserved so far are freed too
        arrays.clear()
        drop_store(store)
        raise
    if row != len(data):
        raise OwaiError(f"feature extraction read {row} of {len(data)} images")
    for i in range(len(arrays)):
        arrays[i].flush()
    arrays.clear()
    for tmp, path in zip(partial, paths):
        tmp.replace(path)
    y_all = torch.cat(labels)
    buffer = io.BytesIO()
    np.save(buffer, y_all.numpy())
    atomic_write_text(origin_path, json.dumps(made_by))
    atomic_write_bytes(labels_path, buffer.getvalue())
    return [_mapped(p) for p in paths], y_all


NO_ROOM = (errno.ENOSPC, errno.EDQUOT)  # a full disk, a full quota


def _feature_file(path: Path, rows: int, width: int) -> Any:
    """A (rows, width) float32 .npy file mapped for writing, its disk space reserved before any
    feature is written: a full disk is then one error line here, not a SIGBUS when a page of a
    sparse file cannot be written. A file system that cannot reserve space is written unreserved."""
    import numpy as np

    try:
        array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, width))
        _reserve(path)
    except OSError as e:
        if e.errno not in NO_ROOM:
            raise
        path.unlink(missing_ok=True)
        raise OwaiError(f"no room for {rows} x {width} features ({rows * width * 4 / 2**30:.3g} GiB) in "
                        f"{path.parent}: {e.strerror}") from None
    return array


def _reserve(path: Path) -> None:
    """Reserve a file's blocks (posix_fallocate) where the platform and its file system can; one that
    cannot (EOPNOTSUPP, EINVAL, ENOSYS) leaves the file sparse, written as it comes. Other errors
    (no room, an I/O error) are raised."""
    import os

    if not hasattr(os, "posix_fallocate"):
        return
    with open(path, "r+b") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise


def _read_origin(path: Path) -> Any:
    """The networks recorded as having made a store's features; None if the file is absent or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def drop_store(store: Path) -> None:
    """Remove one store's files (its blocks, partial blocks, labels and origin)."""
    for path in store.parent.glob(f"{store.name}.*"):
        path.unlink(missing_ok=True)


def drop_features(run: Run) -> None:
    """Remove the run's extracted features once every measurement is made (ImageNet's are tens of GB);
    a run killed before keeps them for its resume."""
    import shutil

    shutil.rmtree(run.path / FEATURES, ignore_errors=True)


def _mapped(path: Path) -> torch.Tensor:
    """A float32 .npy file as a (N, d) CPU tensor backed by the file, mapped read-only: a private
    (copy-on-write) mapping would be counted against memory in full and fail for a block larger than
    RAM. Nothing writes to it: every use gathers rows into new tensors."""
    import warnings

    import numpy as np

    array = np.load(path, mmap_mode="r")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def gather(blocks: list[torch.Tensor], idx: torch.Tensor | slice) -> torch.Tensor:
    """Rows `idx` of the concatenation of feature blocks [(N, d_i)]: (B, sum d_i), without ever
    concatenating every row (Cat_n of ImageNet's features does not fit in memory)."""
    return torch.cat([b[idx] for b in blocks], 1)


def probe_batch(step: int, per_epoch: int, size: int, n: int, seed: int, stage: str) -> torch.Tensor:
    """The example indices of update `step`: epoch step // per_epoch's keyed permutation, sliced."""
    from owai.runtime import generator

    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(n, generator=generator(seed, "probe-batch", stage, epoch))
    return order[k * size : (k + 1) * size]


def train_head(run: Run, stage: str, head: torch.nn.Module, groups: list[dict], blocks: list[torch.Tensor],
               y: torch.Tensor, *, epochs: float, batch_size: int, lr_at_epoch: Any, momentum: float, nesterov: bool,
               seed: int, checkpoint_every: int, log_every: int, device: torch.device) -> torch.nn.Module:
    """Train `head` on fixed features (the concatenation of `blocks`, each (N, d_i) on the CPU, possibly
    memory-mapped) through train_loop as stage `stage` (resumable): SGD over keyed per-epoch
    permutations (`probe_batch`), each batch's rows gathered and moved to `device`, the last incomplete
    batch dropped (BN1d needs >= 2), lr = lr_at_epoch(epoch) with the epoch counted in fractions."""
    from owai.train import LoopConfig, train_loop

    optimizer = torch.optim.SGD(groups, lr=lr_at_epoch(0.0), momentum=momentum, nesterov=nesterov)
    n = len(y)
    size, per_epoch, steps = epoch_steps(n, batch_size, epochs)

    def loss_at(step: int, micro: int) -> torch.Tensor:
        idx = probe_batch(step, per_epoch, size, n, seed, stage)
        return F.cross_entropy(head(gather(blocks, idx).to(device)), y[idx].to(device))

    loop = LoopConfig(steps=steps, checkpoint_every=min(checkpoint_every, steps), log_every=min(log_every, steps))
    train_loop(run, stage, head, optimizer, loss_at, loop, lr_at=lambda s: lr_at_epoch(s / per_epoch))
    return head.eval()


def epoch_steps(n: int, batch_size: int, epochs: float) -> tuple[int, int, int]:
    """(batch size, updates per epoch, updates) of `epochs` passes over `n` examples, the last
    incomplete batch of each pass dropped (BN1d needs >= 2)."""
    size = min(batch_size, n)
    per_epoch = max(1, n // size)
    return size, per_epoch, max(1, round(epochs * per_epoch))


def probe_lr(q: ProbeConfig) -> Callable[[float], float]:
    """The probe's learning rate at a (fractional) epoch: lr x gamma^(milestones passed) (step), or
    lr (1 + cos(pi epoch / epochs)) / 2 (cosine, as the pre-training's `pretrain.schedule: cosine`)."""
    if q.schedule == "cosine":
        return warmup_cosine_schedule(q.lr, 0, q.epochs, 0.0)  # no warm-up, down to 0 at the last epoch
    return step_schedule(q.lr, q.gamma, q.milestones)


def probe_head(cfg: Config, width: int, n_classes: int, name: str) -> torch.nn.Module:
    """A ProbeHead (§6.2) on `width` features, its Linear initialised by the key (seed, "probe-init", name)."""
    from owai.models.rich import ProbeHead
    from owai.runtime import generator

    return ProbeHead(width, n_classes, bn=cfg.probe.batchnorm, generator=generator(cfg.seed, "probe-init", name))


def fit_probe(cfg: Config, run: Run, stage: str, blocks: list[torch.Tensor], y: torch.Tensor, n_classes: int,
              device: torch.device) -> torch.nn.Module:
    """A ProbeHead on the concatenated feature blocks [(N, d_i)] with the probe's settings (§6.2), as
    stage `stage` (resumable)."""
    q = cfg.probe
    head = probe_head(cfg, sum(cat_dims(blocks)), n_classes, stage).to(device)
    return train_head(run, stage, head, head.param_groups(q.weight_decay), blocks, y, epochs=q.epochs,
                      batch_size=q.batch_size, momentum=q.momentum, nesterov=q.nesterov, seed=cfg.seed,
                      lr_at_epoch=probe_lr(q),
                      checkpoint_every=q.checkpoint_every, log_every=q.log_every, device=device)


def fit_probes_on_crops(cfg: Config, run: Run, stage: str, frozen: Any, specs: dict[str, list[int]], train_set: Any,
                        n_classes: int, device: torch.device) -> dict[str, torch.nn.Module]:
    """The probes `specs` (name -> the blocks of `frozen` it reads) trained together as one resumable
    stage on freshly augmented crops (`probe.augment`, RRL's linear evaluation): each update draws the
    next batch of an epoch's keyed permutation (last incomplete batch dropped), augments every image
    (the dataset's training transform, keyed by step), runs the frozen networks once and gives every
    head its blocks. Each head has its own parameters, and SGD's update of a parameter reads only its
    own gradient and momentum, so training them together on the sum of their losses is training each
    alone on the same batches. Heads and schedule are fit_probe's; the logged loss is the heads' sum."""
    from owai.data.domainbed import StepBatches
    from owai.data.images import StepStream
    from owai.runtime import derive_seed
    from owai.train import LoopConfig, train_loop

    q, d = cfg.probe, cfg.data
    frozen = frozen.to(device)
    heads = torch.nn.ModuleDict({name: probe_head(cfg, sum(frozen.dims[b] for b in blocks), n_classes, name)
                                 for name, blocks in specs.items()}).to(device)
    groups = [g for head in heads.values() for g in head.param_groups(q.weight_decay)]
    optimizer = torch.optim.SGD(groups, lr=q.lr, momentum=q.momentum, nesterov=q.nesterov)
    n = len(train_set)
    size, per_epoch, steps = epoch_steps(n, q.batch_size, q.epochs)
    batches = StepBatches(OneDomain(train_set), [0], [torch.arange(n)], size, d.image_size, True,
                          derive_seed(cfg.seed, "probe-crops", stage), steps, style=train_set.style, sampling="epochs")
    stream = StepStream(batches, d.workers, device)

    def loss_at(step: int, micro: int) -> torch.Tensor:
        x, y = stream.at(step)
        blocks = frozen.per_network(x)  # eval mode, no gradient: the networks stay as they are
        return sum(F.cross_entropy(heads[name](torch.cat([blocks[b] for b in specs[name]], 1).float()), y)
                   for name in specs)

    lr_at_epoch = probe_lr(q)
    loop = LoopConfig(steps=steps, checkpoint_every=min(q.checkpoint_every, steps), log_every=min(q.log_every, steps))
    with stream:  # its workers end with the stage, failed or not
        train_loop(run, stage, heads, optimizer, loss_at, loop, lr_at=lambda s: lr_at_epoch(s / per_epoch))
    return {name: head.eval() for name, head in heads.items()}


@torch.no_grad()
def _logits(head: torch.nn.Module, blocks: list[torch.Tensor], device: torch.device, chunk: int = 8192) -> torch.Tensor:
    """The head's logits (N, C) (float32, CPU) on the concatenated feature blocks, `chunk` rows at a time."""
    head.eval()
    n = len(blocks[0])
    return torch.cat([head(gather(blocks, slice(i, i + chunk)).to(device)).float().cpu() for i in range(0, n, chunk)])


def _acc(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(1) == y).float().mean())


@torch.no_grad()
def predict(cfg: Config, model: torch.nn.Module, data: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (N, C) float32 CPU, labels (N,)) of `model` in eval mode on every example of `data`."""
    model.eval()
    logits, labels = [], []
    for x, y in _batches(cfg, data):
        logits.append(model(x.to(device)).float().cpu())
        labels.append(y)
    return torch.cat(logits), torch.cat(labels)


def _decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Optimizer groups: weight decay on every parameter but those of BatchNorm layers (wd_skip_bn)."""
    bn = {id(p) for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for p in m.parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if id(p) not in bn], "weight_decay": weight_decay},
              {"params": [p for p in params if id(p) in bn], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def run_chain(cfg: Config, run: Run) -> Outcome:
    """The evaluation stages of n pretrained networks, in order: distill (a Distill_n student), probe
    (Cat_k / per-network / catsub / student linear probes), finetune (normal fine-tuning of Cat_n),
    two-stage (per-network fine-tuning, then the ensemble-initialised head), fewshot (episodes on frozen
    features). Each training is its own resumable train_loop stage."""
    from owai.models.rich import ConcatFeatures

    stages = stages_of(cfg.stage)
    d, device = cfg.data, run.device
    nets = find_networks(cfg)
    train_set = load_split(cfg, d.target, "train", d.target_classes, d.target_fraction)
    test_set = load_split(cfg, d.target, "test", d.target_classes)
    console.info(f"{cfg.stage}: {len(nets)} networks (seeds {[n.seed for n in nets]}), target {d.target} "
                 f"{len(train_set)} train / {len(test_set)} test images, {len(train_set.classes)} classes")
    measured: dict[str, Any] = {}
    details: dict[str, Any] = {"stages": stages, "networks": [n.label for n in nets], "seeds": [n.seed for n in nets],
                               "classes": train_set.classes, "split_sizes": {"train": len(train_set), "test": len(test_set)}}
    student = run_distill(cfg, run, nets, measured, details) if "distill" in stages else None
    if "probe" in stages or "fewshot" in stages:
        cat = ConcatFeatures(network_backbones(nets, test_set.style, d.image_size), frozen=True).to(device)
        origin = [n.label for n in nets]
        z_test, y_test = extract(cfg, cat, test_set, device, feature_store(run, "test"), origin)
        if student is not None:  # the last block = the student, distilled from `origin` in this run
            frozen_student = ConcatFeatures([student], frozen=True).to(device)
            taught = [*origin, "Distill_n student"]
            z_test.append(extract(cfg, frozen_student, test_set, device, feature_store(run, "student-test"), taught)[0][0])
        if "probe" in stages:
            specs = probe_specs(len(nets), cfg.probe.sizes, student is not None)
            n_classes = len(train_set.classes)
            if cfg.probe.augment:
                frozen = ConcatFeatures([*cat.backbones, *([student] if student is not None else [])], frozen=True)
                heads = fit_probes_on_crops(cfg, run, "probe-crops", frozen, specs, train_set, n_classes, device)
            else:
                z_train, y_train = extract(cfg, cat, train_set, device, feature_store(run, "train"), origin)
                if student is not None:
                    z_train.append(extract(cfg, frozen_student, train_set, device, feature_store(run, "student-train"),
                                           taught)[0][0])
                heads = {name: fit_probe(cfg, run, name, [z_train[b] for b in blocks], y_train, n_classes, device)
                         for name, blocks in specs.items()}
                del z_train
            run_probes(cfg, heads, z_test, y_test, len(nets), student is not None, measured, details)
            for name in ("train", "student-train"):  # the baselines' features take their place on disk
                drop_store(feature_store(run, name))
            run_baseline_probes(cfg, run, train_set, test_set, measured)
            if not cfg.probe.weights:  # owai's own networks: their parameter counts are known
                plot_probes(run, cfg, nets, measured)
        del cat
        if "fewshot" in stages:
            run_fewshot(cfg, z_test, y_test, len(nets), student is not None, measured, details)
    if "finetune" in stages:
        backbones = network_backbones(nets, train_set.style, d.image_size)
        model = finetune_model(cfg, run, f"finetune-cat{len(nets)}", backbones, train_set)
        logits, y = predict(cfg, model, test_set, device)
        measured[f"ft.cat{len(nets)}.acc"] = _acc(logits, y)
        del model, backbones
        if student is not None:  # Table A.3's Distill_n row: the student fine-tuned as one network is
            tunable = copy.deepcopy(student).requires_grad_(True)  # the probes' copy stays frozen
            model = finetune_model(cfg, run, f"finetune-distill{len(nets)}", [tunable], train_set)
            logits, y = predict(cfg, model, test_set, device)
            measured[f"ft.distill{len(nets)}.acc"] = _acc(logits, y)
            del model, tunable
    if "two-stage" in stages:
        run_two_stage(cfg, run, nets, train_set, test_set, measured, details)
    drop_features(run)
    return Outcome(measured, details)


def probe_specs(n: int, sizes: list[int], with_student: bool) -> dict[str, list[int]]:
    """The probes of stage probe, each the feature blocks it reads: one per network (`probe-net{i}`),
    one per Cat_k with k > 1 (the first k blocks), and the Distill_n student's (block n)."""
    specs = {f"probe-net{i}": [i] for i in range(n)}
    specs.update({f"probe-cat{k}": list(range(k)) for k in sorted(sizes) if k > 1})
    if with_student:
        specs["probe-distill"] = [n]
    return specs


def run_probes(cfg: Config, heads: dict[str, torch.nn.Module], z_test: list[torch.Tensor], y_test: torch.Tensor,
               n: int, with_student: bool, measured: dict[str, Any], details: dict[str, Any]) -> None:
    """Stage probe's measurements, from the trained `heads` (`probe_specs`): one probe per network
    (`single.acc` = their mean, `single.last.acc` the n-th alone; the first is Cat_1), one per Cat_k,
    catsub_k (the mean of the first k per-network probes' logits) and the Distill_n student's probe."""
    from owai.models.rich import catsub_logits

    q, device = cfg.probe, next(iter(heads.values())).linear.weight.device
    per_net = [heads[f"probe-net{i}"] for i in range(n)]
    net_logits = [_logits(h, [z_test[i]], device) for i, h in enumerate(per_net)]
    for k in sorted(q.sizes):
        if k == 1:
            logits = net_logits[0]
        else:
            logits = _logits(heads[f"probe-cat{k}"], z_test[:k], device)
        measured[f"cat{k}.acc"] = _acc(logits, y_test)
        if q.catsub and k > 1:
            with torch.no_grad():
                sub = catsub_logits([h.cpu() for h in per_net[:k]], [z.cpu() for z in z_test[:k]])
            measured[f"catsub{k}.acc"] = _acc(sub, y_test)
    singles = [_acc(lg, y_test) for lg in net_logits]
    measured["single.acc"] = statistics.fmean(singles)
    measured["single.last.acc"] = singles[-1]  # the n-th network alone: Fig 2.4's ViT-L/16, the larger one
    details["single_acc"] = singles
    details["feature_dims"] = cat_dims(z_test)  # the n networks' widths, then the student's
    if with_student:
        measured[f"distill{n}.acc"] = _acc(_logits(heads["probe-distill"], [z_test[n]], device), y_test)


@functools.lru_cache(maxsize=None)
def feature_params(backbone: str) -> int:
    """Parameters of `backbone` without its classification head: the inference architecture under a
    probe, as Table 2.2 counts it (resnet50: 23.5M). Counted on a meta-device copy of its own, so the
    shared `vision.meta_backbone` keeps its head."""
    from owai.models.rich import strip_head
    from owai.models.vision import build_backbone

    with torch.device("meta"):
        return sum(p.numel() for p in strip_head(build_backbone(backbone, num_classes=1)).parameters())


def plot_probes(run: Run, cfg: Config, nets: list[Network], measured: dict[str, Any]) -> None:
    """Figure 2.1's top row for this run's target: probe accuracy against the parameters of the
    inference architecture, for Cat_k (the first k networks) and catsub_k, and beside them the wide
    networks (k times every channel) and k networks trained jointly, each a point of Table 2.2's
    baselines; the curves start at one network where the run probed Cat_1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(k for k in cfg.probe.sizes if f"cat{k}.acc" in measured)
    params = [feature_params(n.backbone) * n.joint / 1e6 for n in nets]  # the networks' own, in order
    cat_x = {k: sum(params[:k]) for k in sizes}
    start = [(cat_x[1], 100 * measured["cat1.acc"])] if 1 in sizes else []
    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    ax.plot([cat_x[k] for k in sizes], [100 * measured[f"cat{k}.acc"] for k in sizes], "o-", color="tab:blue",
            label="cat")
    subs = [(cat_x[k], 100 * measured[f"catsub{k}.acc"]) for k in sizes if f"catsub{k}.acc" in measured]
    if subs:
        ax.plot(*zip(*(start + subs)), "o--", color="tab:blue", label="catsub")
    for kind, colour in (("wide", "tab:red"), ("joint", "tab:gray")):
        points = sorted((_baseline_params(cfg, name), 100 * measured[f"{name}.acc"]) for name in cfg.probe.baselines
                        if name.startswith(kind) and f"{name}.acc" in measured)
        if points:
            ax.plot(*zip(*(start + points)), "s-", color=colour, label=kind)
    ax.set_xscale("log")
    ticks: list[float] = []
    for x in sorted({x for line in ax.get_lines() for x in line.get_xdata()}):
        if not ticks or x > 1.05 * ticks[-1]:  # one label where two sizes nearly coincide (Cat4, wide2)
            ticks.append(x)
    ax.set_xticks(ticks, [f"{x:.3g}" for x in ticks])
    ax.minorticks_off()
    ax.set_xlabel("parameters of the inference architecture (M)")
    ax.set_ylabel("linear probing accuracy (%)")
    d = cfg.data
    same = in_distribution(d.base, d.base_classes, d.target, d.target_classes)
    ax.set_title(f"{d.base} -> {d.target}" + (" (in distribution)" if same else ""))
    ax.legend()
    run.save_figure(fig, "probe")


def _baseline_params(cfg: Config, name: str) -> float:
    """Baseline `name`'s inference parameters in millions: its backbone (the wide one) times model.joint."""
    model = baseline_config(cfg, name)[0].model
    return feature_params(model.backbone) * model.joint / 1e6


def cat_dims(blocks: list[torch.Tensor]) -> list[int]:
    return [int(b.shape[1]) for b in blocks]


# -- fine-tuning ---------------------------------------------------------------------------------


def network_backbones(nets: list[Network], style: str, image_size: int) -> list[torch.nn.Module]:
    """The pretrained networks as feature extractors for images of `style` and `image_size` (their
    base-class heads removed)."""
    from owai.models.rich import strip_head

    return [strip_head(load_network(n, style, image_size)) for n in nets]


def micro_batches(stream: Any, accumulate: int) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) of micro-batch `micro` of update `step` (train_loop's `loss_at` arguments): the update's
    batch read from `stream` once and cut into `accumulate` equal parts (distill.accumulate,
    finetune.accumulate; check_settings makes it divide the batch)."""
    current: dict[str, Any] = {}

    def at(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        if current.get("step") != step:  # the update's whole batch, read once for its micro-batches
            current.update(step=step, batch=stream.at(step))
        x, y = current["batch"]
        size = x.shape[0] // accumulate
        return x[micro * size:(micro + 1) * size], y[micro * size:(micro + 1) * size]

    return at


def finetune_model(cfg: Config, run: Run, stage: str, backbones: list[torch.nn.Module], train_set: Any) -> torch.nn.Module:
    """Normal fine-tuning (§6.3) of the concatenation of `backbones` (one: ordinary fine-tuning) under a
    new Linear head on the target's training images, as train_loop stage `stage`. Returns
    Sequential(ConcatFeatures, Linear) in eval mode."""
    from owai.data.domainbed import StepBatches
    from owai.data.images import StepStream
    from owai.models.rich import ConcatFeatures
    from owai.runtime import derive_seed
    from owai.train import LoopConfig, train_loop

    d, f, device = cfg.data, cfg.finetune, run.device
    cat = ConcatFeatures(backbones, frozen=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, "finetune-head", stage))
        head = torch.nn.Linear(cat.out_dim, len(train_set.classes))  # PyTorch's default init (§6.3)
    model = torch.nn.Sequential(cat, head).to(device)
    per_epoch = len(train_set) / f.batch_size
    steps = max(1, round(f.epochs * per_epoch))
    batches = StepBatches(OneDomain(train_set), [0], [torch.arange(len(train_set))], f.batch_size, d.image_size,
                          d.augment, derive_seed(cfg.seed, "finetune-batches", stage), steps, style=train_set.style)
    stream = StepStream(batches, d.workers, device)
    if f.classifier_lr_scale == 1.0:
        groups = _decay_groups(model, f.weight_decay)
    else:  # the new head at the schedule's lr times lr_scale (owai.train)
        groups = _decay_groups(cat, f.weight_decay) + [{"params": list(head.parameters()), "weight_decay": f.weight_decay,
                                                        "lr_scale": f.classifier_lr_scale}]
    optimizer = torch.optim.SGD(groups, lr=f.lr, momentum=f.momentum)

    batch_at = micro_batches(stream, f.accumulate)

    def loss_at(step: int, micro: int) -> torch.Tensor:
        x, y = batch_at(step, micro)
        return F.cross_entropy(model(x), y)

    if f.milestones:  # lr x gamma^(milestones passed), the milestones in epochs
        by_epoch = step_schedule(f.lr, f.gamma, f.milestones)

        def schedule(step: int) -> float:
            return by_epoch(step / per_epoch)
    else:  # cosine from lr to min_lr over the steps
        schedule = warmup_cosine_schedule(f.lr, 0, steps, f.min_lr)

    loop = LoopConfig(steps=steps, checkpoint_every=min(f.checkpoint_every, steps), log_every=min(f.log_every, steps),
                      precision=_precision(cfg, device), accumulate=f.accumulate)
    with stream:  # its workers end with the stage, failed or not
        train_loop(run, stage, model, optimizer, loss_at, loop, lr_at=schedule)
    return model.eval()


def run_two_stage(cfg: Config, run: Run, nets: list[Network], train_set: Any, test_set: Any,
                  measured: dict[str, Any], details: dict[str, Any]) -> None:
    """Stage two-stage (§6.4): fine-tune each network alone (`ft.single.acc` = their mean,
    `ft.single.last.acc` the n-th's), freeze them, concatenate, and train `two_stage_head`
    (initialised as their logit-average ensemble: `ft.ensemble.acc`
    is its accuracy before training) for head_epochs on the frozen features of the training images (the
    evaluation transform: features are extracted once)."""
    from owai.models.rich import ConcatFeatures, two_stage_head

    f, device, n = cfg.finetune, run.device, len(nets)
    tuned = [finetune_model(cfg, run, f"ft-net{i}", network_backbones([net], train_set.style, cfg.data.image_size),
                            train_set) for i, net in enumerate(nets)]
    singles = []
    for model in tuned:
        logits, y_test = predict(cfg, model, test_set, device)
        singles.append(_acc(logits, y_test))
    measured["ft.single.acc"] = statistics.fmean(singles)
    measured["ft.single.last.acc"] = singles[-1]  # the n-th network fine-tuned alone (Fig 2.4: ViT-L/16)
    details["ft_single_acc"] = singles
    cat = ConcatFeatures([m[0].backbones[0] for m in tuned], frozen=True).to(device)
    tuned_from = [*(n.label for n in nets), "fine-tuned"]
    z_train, y_train = extract(cfg, cat, train_set, device, feature_store(run, "two-stage-train"), tuned_from)
    z_test, y_test = extract(cfg, cat, test_set, device, feature_store(run, "two-stage-test"), tuned_from)
    head = two_stage_head([m[1] for m in tuned]).to(device)
    measured["ft.ensemble.acc"] = _acc(_logits(head, z_test, device), y_test)
    head.train()
    decay = f.weight_decay if f.head_weight_decay is None else f.head_weight_decay
    trained = train_head(run, f"two-stage-head{n}", head, [{"params": list(head.parameters()), "weight_decay": decay}],
                         z_train, y_train, epochs=f.head_epochs, batch_size=f.batch_size,
                         lr_at_epoch=lambda e: f.head_lr, momentum=f.momentum, nesterov=True, seed=cfg.seed,
                         checkpoint_every=f.checkpoint_every, log_every=f.log_every, device=device)
    measured[f"two_stage.cat{n}.acc"] = _acc(_logits(trained, z_test, device), y_test)
    for name in ("two-stage-train", "two-stage-test"):
        drop_store(feature_store(run, name))


# -- Distill_n -----------------------------------------------------------------------------------


def run_distill(cfg: Config, run: Run, nets: list[Network], measured: dict[str, Any],
                details: dict[str, Any]) -> torch.nn.Module:
    """Stage distill (§6.5): a student of the same architecture with n heads, head i fitting network i's
    softened logits on the base classes' training images; measured on the base test split by the mean of
    its heads' logits (`distill{n}.base_acc`, beside the teachers' ensemble `teachers.base_acc`). With
    distill.target=features (self-supervised networks, TH A.3.3) head i regresses network i's features
    (1 - cos) and there is no base accuracy. Returns the student's backbone (features, no heads), frozen."""
    from owai.data.domainbed import StepBatches
    from owai.data.images import StepStream
    from owai.models.rich import MultiHeadStudent, distill_loss, feature_distill_loss, strip_head
    from owai.runtime import derive_seed
    from owai.train import LoopConfig, train_loop

    d, s, device, n = cfg.data, cfg.distill, run.device, len(nets)
    on_features = s.target == "features"
    base_train = load_split(cfg, d.base, "train", d.base_classes)
    base_test = load_split(cfg, d.base, "base-test", d.base_classes)
    n_classes = len(base_train.classes)
    teachers = [load_network(net, base_train.style, d.image_size).to(device).eval().requires_grad_(False)
                for net in nets]
    if on_features:
        teachers = [strip_head(t) for t in teachers]
        n_out = int(teachers[0].feature_dim)  # equal for every network (find_networks)
    else:
        n_out = n_classes
        for net, teacher in zip(nets, teachers):
            width = base_head(teacher.state_dict())[1]
            if width != n_classes:
                raise OwaiError(f"{net.label} has a {width}-class head; distill reads data.base "
                                f"{d.base} with {n_classes} classes (set data.base / data.base_classes as in pre-training)")
    # head i of teacher i's kind (Baseline++ teachers: cosine heads); features: linear regressions
    kinds = ["linear"] * n if on_features else [base_head(t.state_dict())[0] for t in teachers]
    backbone = strip_head(build_network(cfg.model.backbone, n_classes, derive_seed(cfg.seed, "distill-student")))
    student = MultiHeadStudent(backbone, n, n_out, heads=kinds).to(device)
    per_epoch = len(base_train) / s.batch_size
    steps = max(1, round(s.epochs * per_epoch))
    batches = StepBatches(OneDomain(base_train), [0], [torch.arange(len(base_train))], s.batch_size, d.image_size,
                          d.augment, derive_seed(cfg.seed, "distill-batches"), steps, style=base_train.style)
    stream = StepStream(batches, d.workers, device)
    optimizer = (torch.optim.Adam(student.parameters(), lr=s.lr, weight_decay=s.weight_decay) if s.optimizer == "adam"
                 else torch.optim.SGD(student.parameters(), lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay))
    lr_at = step_schedule(s.lr, s.gamma, [m * per_epoch for m in s.milestones], warmup=s.warmup_epochs * per_epoch,
                          warmup_lr=s.warmup_lr)

    batch_at = micro_batches(stream, s.accumulate)

    def loss_at(step: int, micro: int) -> torch.Tensor:
        x, y = batch_at(step, micro)
        with torch.no_grad():
            targets = [t(x) for t in teachers]  # n x (B, C) logits, or n x (B, d) features
        if on_features:
            return feature_distill_loss(student(x), targets)
        return distill_loss(student(x), targets, s.tau, labels=y, alpha=s.alpha)

    loop = LoopConfig(steps=steps, checkpoint_every=min(s.checkpoint_every, steps), log_every=min(s.log_every, steps),
                      precision=_precision(cfg, device), accumulate=s.accumulate)
    with stream:  # its workers end with the stage, failed or not
        summary = train_loop(run, "distill", student, optimizer, loss_at, loop, lr_at=lr_at)
    student.eval()
    details["distill"] = {"steps": steps, "base_train": len(base_train), "base_test": len(base_test),
                          "target": s.target, "final_loss": summary["final_loss"]}
    if on_features:
        return student.backbone.requires_grad_(False)
    with torch.no_grad():
        mean_heads = _Averaged(lambda x: torch.stack(student(x)).mean(0))
        ensemble = _Averaged(lambda x: torch.stack([t(x) for t in teachers]).mean(0))
        logits, y = predict(cfg, mean_heads, base_test, device)
        measured[f"distill{n}.base_acc"] = _acc(logits, y)
        logits, y = predict(cfg, ensemble, base_test, device)
        measured["teachers.base_acc"] = _acc(logits, y)
    return student.backbone.requires_grad_(False)


class _Averaged(torch.nn.Module):
    """A function of the images as a module (for `predict`)."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


# -- few-shot ------------------------------------------------------------------------------------


def episode_seed(cfg: Config) -> int:
    """The seed of the few-shot episodes and their heads' SGD: `fewshot.seed`, else the run's `seed`
    (a study over seeds draws other episodes; within a run every representation meets the same)."""
    return cfg.seed if cfg.fewshot.seed is None else cfg.fewshot.seed


def run_fewshot(cfg: Config, z_test: list[torch.Tensor], y_test: torch.Tensor, n: int, with_student: bool,
                measured: dict[str, Any], details: dict[str, Any]) -> None:
    """Stage fewshot (§6.6): the same episodes (keyed by `episode_seed`) for every representation: each
    network alone (`fewshot.single.*` = their mean, the supervised baseline), Cat_k for k in probe.sizes
    (k > 1) and the Distill_n student. Metrics fewshot.{rep}.{head}.{k}shot (mean query accuracy);
    details hold the 95 % intervals."""
    from owai.evals.fewshot import episode_accuracies, mean_ci95, sample_episodes

    k = cfg.fewshot
    reps: dict[str, list[torch.Tensor]] = {f"net{i}": [z_test[i]] for i in range(n)}
    for size in sorted(cfg.probe.sizes):
        if size > 1:
            reps[f"cat{size}"] = z_test[:size]
    if with_student:
        reps[f"distill{n}"] = [z_test[n]]
    table: dict[str, Any] = {}
    seed = episode_seed(cfg)
    details["fewshot_seed"] = seed
    for shot in k.shots:
        episodes = sample_episodes(y_test, k.ways, shot, k.queries, k.episodes, seed)
        for head in k.heads:
            singles = []
            for name, blocks in reps.items():
                accs = episode_accuracies(torch.cat(blocks, 1), episodes, head=head, lr=k.lr, epochs=k.epochs,
                                          batch_size=k.batch_size, weight_decay=k.weight_decay, seed=seed)
                mean, ci = mean_ci95(accs)
                table[f"{name}.{head}.{shot}shot"] = {"mean": mean, "ci95": ci}
                if name.startswith("net"):
                    singles.append(mean)
                else:
                    measured[f"fewshot.{name}.{head}.{shot}shot"] = mean
            measured[f"fewshot.single.{head}.{shot}shot"] = statistics.fmean(singles)
    details["fewshot"] = table
