"""Camelyon17-WILDS: ERM, IRMv1, vREx and CLOvE from random, ERM and Bonsai initialisations
(thesis §2.3.4, Tables 2.6/2.7, Figure 2.9; spec §3.2 and §4).

One run = one seed's pipeline for one downstream point (`init`, `method`, `rounds`, penalty weight):

1. **Discovery rounds** (shared by every downstream point of a seed, cached by their settings):
   round 0 = WILDS ERM (DenseNet-121 from scratch, SGD lr 1e-3, momentum 0.9, wd 0.01, batch 32, 10
   epochs, standard loader); round k >= 1 = soft GroupDRO (the registry's `groupdro`, step 0.01) on
   the training set replicated once per earlier round j, example i's copy j in group
   `(pred_j[i] != y[i]) + 2j` (`round_groups`), batches drawn uniformly over the groups. Each round is
   evaluated every epoch on id_val/val/test; its epoch is chosen by id_val accuracy, and that epoch's
   predictions on every split are the round's pseudo-labels.
2. **Synthesis** (mtERM, cached): DenseNet-121 with a Linear(1024, 2K) head, loss = sum_k
   CE(head_k, pseudo_k) (the registry's `erm` with one batch per head), two groups (`old`: all rounds
   correct vs the rest, the 2-Bonsai scripts; `balance`: rounds agree vs disagree), 16 + 16 batches
   from the group loader, SGD lr 1e-3 momentum 0.9 wd 1e-6, 20 epochs; the epoch is chosen by the
   heads' id_val accuracy against the pseudo-labels. Convert: the downstream head is the average of
   the K two-class heads (`average_heads`), or a random head.
3. **Downstream** (stage `downstream`, 10 epochs, evaluation every epoch): `init` rand (from scratch,
   round 0's initialisation; with a penalty, Table 2.6's "ERM" rows: ERM pre-training is the first
   `penalty.anneal_iters` steps, as in RFC's scripts), erm (round 0's trained network), erm-cf (round 0's featurizer frozen), bonsai (the synthesis network,
   wd 1e-6), bonsai-cf (frozen, wd 0.01); `method` erm/irm/vrex/clove through the penalty registry on
   2 logits with the group loader (2 hospitals x 16): IRMv1 with the unbiased even/odd estimate
   (WILDS), vREx with RFC-Camelyon's division by the number of groups, CLOvE with kernel width 0.1;
   the penalty weight is 0 before `penalty.anneal_iters` and SGD's state is reset there (spec
   appendix #8). `init: rand` with `method: erm` is round 0 itself (WILDS ERM), reused. `init: none`
   runs the discovery rounds only (Table 2.7).
4. **Frozen Cat_n / Distill_n** (Table 2.3, TH A.5; `networks` = n >= 2): n WILDS-ERM networks = round 0
   of n seeds (`network_seed`: network 0 is the run's own round 0, network i >= 1 round 0 of a seed
   derived from the run's; each cached like round 0 under its own seed's key, so Cat5 reuses Cat2's
   networks and erm-cf's round 0). `cat-cf`: the n frozen featurizers' eval-mode features
   concatenated (n x 1024; each network's features cached as erm-cf's are) under a fresh, seeded
   Linear(n x 1024, 2). `distill-cf`: the synthesis above over the n ERM networks' predictions in
   place of the discovery rounds, with `bonsai.distill_groups` (default `balance`, agree vs
   disagree), cached as `distill-<n>-<key>`, converted (averaged or random head, `bonsai.head`) and
   frozen exactly as bonsai-cf. Both then train the downstream head as erm-cf / bonsai-cf do.

Frozen featurizer (spec §3.2): the reference freezes the parameters but leaves BatchNorm in train
mode, so its features move with the batch statistics and cannot be cached. Default here
(`downstream.frozen_bn: eval`): the frozen featurizer is evaluated once in eval mode and its features
cached (`<cache>/camelyon17/.../features-*.safetensors`); only the head trains, and the featurizer
(parameters and buffers) stays bit-identical. `frozen_bn: train` reproduces the reference (full
forward passes, BN batch statistics, running statistics updated).

Measured: `test_acc.iid` / `test_acc.ood` (test acc_avg at the downstream epoch chosen by id_val / by
val accuracy), `id_val_acc.iid`, `val_acc.ood`, `test_acc_wg.*` (worst slide), and per discovery
round `round<k>.test_acc` (its epoch chosen by id_val; Table 2.7's round k+1), plus the synthesis's
pseudo-label accuracies (Table A.14), and for Cat_n / Distill_n `networks.mean_test_acc` (a single
ERM network on average). The study (`write_study`) selects penalty weight and anneal per
(init, rounds, networks, method) by the mean over seeds of id_val (IID tune) or val (OOD tune) accuracy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from owai import console
from owai.io import build_lock
from owai.config import BaseConfig
from owai.errors import OwaiError
from owai.methods import Method, Outcome
from owai.runs import Run
from owai.values import md_row

INITS = ("none", "rand", "erm", "erm-cf", "cat-cf", "distill-cf", "bonsai", "bonsai-cf")  # the study's row order
ENSEMBLE_INITS = ("cat-cf", "distill-cf")  # built from `networks` ERM networks (Table 2.3)
ROUND_INITS = ("none", "bonsai", "bonsai-cf")  # train `rounds` discovery rounds (the others: round 0 at most)
SYNTHESIS_INITS = ("bonsai", "bonsai-cf", "distill-cf")  # start from a synthesis (`bonsai.synthesis_*`, `bonsai.head`)
FROZEN_INITS = ("erm-cf", "cat-cf", "distill-cf", "bonsai-cf")  # a frozen featurizer (`downstream.frozen_bn`)
METHODS = ("erm", "irm", "vrex", "clove")
EVAL_SPLITS = ("id_val", "val", "test")
CACHE_VERSION = 1


@dataclass
class DataConfig:
    root: str = ""  # data root holding camelyon17/ or camelyon17_v1.0/ (or that folder); "" = $OWAI_DATA, the cache
    fraction: float = 1.0  # WILDS --frac: a keyed fraction of every split
    fraction_seed: int = 0
    image_size: int = 96  # 96 = the patches' size (no resize)
    batch_size: int = 32
    n_groups_per_batch: int = 2  # group loader: 2 hospitals x 16
    eval_batch_size: int = 256
    workers: int = 4  # loader processes (0 = in the training process)
    cache_images: bool = False  # keep decoded patches in memory (small fractions only)


@dataclass
class ModelConfig:
    arch: Literal["densenet121", "densenet-tiny"] = "densenet121"  # tiny: tests and the cpu preset


@dataclass
class TrainConfig:
    """Round 0 (WILDS ERM), the GroupDRO rounds and the downstream stage."""

    epochs: int = 10
    lr: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 0.01  # WILDS default; the unfrozen Bonsai downstream uses downstream.weight_decay
    checkpoint_every: int = 1000
    log_every: int = 50


@dataclass
class BonsaiConfig:
    dro_eta: float = 0.01  # WILDS group_dro_step_size
    synthesis_epochs: int = 20
    synthesis_lr: float = 1e-3
    synthesis_weight_decay: float = 1e-6  # TH A.10: 1e-2 destroys the synthesis (Table A.13/A.14)
    group_method: Literal["old", "balance"] = "old"  # old: all correct vs rest (2-Bonsai); balance: agree vs disagree
    distill_groups: Literal["old", "balance"] = "balance"  # the same choice for distill-cf's synthesis (TH A.5: balance)
    head: Literal["average", "random"] = "average"  # Table A.15


@dataclass
class PenaltyConfig:
    weight: float = 0.0  # lambda
    anneal_iters: int = 0  # weight 0 before, optimizer reset at (RFC-Camelyon)
    clove_width: float = 0.1  # 0.2 for the ERM-initialised CLOvE baseline (TH A.10)
    divide_by_weight: bool = True  # loss / lambda when lambda > 1 (spec pitfall 2); WILDS: False


@dataclass
class DownstreamConfig:
    weight_decay: float | None = None  # None: 1e-6 for init bonsai, else train.weight_decay (0.01)
    frozen_bn: Literal["eval", "train"] = "eval"  # eval: cached eval-mode features; train: the reference quirk


@dataclass
class Config(BaseConfig):
    init: Literal["none", "rand", "erm", "erm-cf", "cat-cf", "distill-cf", "bonsai", "bonsai-cf"] = "bonsai-cf"
    method: Literal["erm", "irm", "vrex", "clove"] = "erm"
    rounds: int = 2  # discovery rounds synthesised (2-Bonsai, 3-Bonsai); init none: rounds trained
    # cat-cf / distill-cf: n, the independently seeded ERM networks concatenated (Cat_n) or distilled
    # (Distill_n). Not `rounds`: those are Bonsai's GroupDRO discovery rounds, each depending on the
    # earlier ones; these are n seeds of round 0 alone, and a study names both (Cat5 beside 2-Bonsai-cf).
    networks: int = 2
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    bonsai: BonsaiConfig = field(default_factory=BonsaiConfig)
    penalty: PenaltyConfig = field(default_factory=PenaltyConfig)
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)


class Camelyon17Bonsai(Method):
    Config = Config
    cli = "owai bonsai --dataset camelyon17"

    @staticmethod
    def unused_settings(cfg: Config) -> dict[str, str]:
        """The settings of the stages this run's `init` and `method` skip (`run`), one key each (a
        sweep refuses a base setting only when every point names it). `bonsai.dro_eta` and `train.*`
        are kept wherever round 0 is read: they key its cache entry (`discovery_key`)."""
        init, method = cfg.init, cfg.method
        scratch = init == "rand" and method != "erm"  # no discovery round, no cache: the downstream network from scratch
        reused = init == "rand" and method == "erm"  # round 0 itself (WILDS ERM): no downstream stage
        unused: dict[str, str] = {}
        if init == "none":
            unused["method"] = "the downstream method (--method); --init none trains the discovery rounds only (Table 2.7)"
        if init not in ROUND_INITS:
            unused["rounds"] = (f"the discovery rounds of --init bonsai / bonsai-cf / none; --init {init}"
                                + (f" --method {method} trains from scratch, with none" if scratch else " reads round 0 alone"))
        if init not in ENSEMBLE_INITS:
            unused["networks"] = f"the number of ERM networks of --init cat-cf / distill-cf; this run's is --init {init}"
        if scratch:
            unused["bonsai.dro_eta"] = (f"the GroupDRO step of the discovery rounds; --init rand --method {method} trains "
                                        "from scratch, with none")
        if init not in SYNTHESIS_INITS:
            for key in ("synthesis_epochs", "synthesis_lr", "synthesis_weight_decay", "group_method", "distill_groups", "head"):
                unused[f"bonsai.{key}"] = (f"a setting of the synthesis of --init bonsai / bonsai-cf / distill-cf; this run's "
                                           f"is --init {init}")
        elif init == "distill-cf":
            unused["bonsai.group_method"] = ("the synthesis groups of --init bonsai / bonsai-cf; --init distill-cf's are "
                                             "bonsai.distill_groups")
        else:
            unused["bonsai.distill_groups"] = (f"the synthesis groups of --init distill-cf; --init {init}'s are "
                                               "bonsai.group_method")
        penalty = ("weight", "anneal_iters", "clove_width", "divide_by_weight")
        if init == "none" or reused:
            why = ("--init none trains the discovery rounds only" if init == "none"
                   else "--init rand --method erm is round 0 itself (WILDS ERM), reused")
            unused.update({f"penalty.{key}": f"a setting of the downstream penalty; {why}" for key in penalty})
            unused.update({f"downstream.{key}": f"a setting of the downstream stage; {why}"
                           for key in ("weight_decay", "frozen_bn")})
            unused["data.n_groups_per_batch"] = f"the groups per batch of the synthesis and downstream loaders; {why}"
            return unused
        if method == "erm":
            unused.update({f"penalty.{key}": "a setting of the penalty of --method irm / vrex / clove; --method erm has none"
                           for key in penalty})
        elif method != "clove":
            unused["penalty.clove_width"] = f"the kernel width of --method clove; this run's is --method {method}"
        if init not in FROZEN_INITS:
            unused["downstream.frozen_bn"] = (f"the frozen featurizer's BatchNorm mode of --init erm-cf / cat-cf / distill-cf / "
                                              f"bonsai-cf; --init {init} trains the whole network")
        return unused

    @staticmethod
    def validate(cfg: Config) -> None:
        d, t, b, p = cfg.data, cfg.train, cfg.bonsai, cfg.penalty
        from owai.data.camelyon17 import find_root

        root = find_root(d.root)  # missing data fails before a run directory exists, naming `owai data fetch camelyon17`
        if not 0 < d.fraction <= 1:
            raise OwaiError(f"data.fraction must be in (0, 1], got {d.fraction}")
        from owai.data.camelyon17 import Camelyon17

        # metadata columns, empty splits and missing patches: one line before any run directory
        # (reading metadata.csv and listing the patch folders takes seconds for the full release)
        data = Camelyon17(root, d.fraction, d.fraction_seed, d.image_size)
        for name in ("image_size", "batch_size", "n_groups_per_batch", "eval_batch_size"):
            if getattr(d, name) < 1:
                raise OwaiError(f"data.{name} must be >= 1, got {getattr(d, name)}")
        if d.batch_size % d.n_groups_per_batch:
            raise OwaiError(f"data.batch_size {d.batch_size} must be a multiple of data.n_groups_per_batch {d.n_groups_per_batch}")
        hospitals = int(data.centers[data.split("train")].unique().numel())  # the downstream group loader's groups
        if d.n_groups_per_batch > hospitals:
            raise OwaiError(f"data.n_groups_per_batch {d.n_groups_per_batch}: the training split has {hospitals} "
                            f"hospital(s) at data.fraction {d.fraction:g}")
        if d.workers < 0:
            raise OwaiError(f"data.workers must be >= 0, got {d.workers}")
        if cfg.rounds < 1 or (cfg.init in ("bonsai", "bonsai-cf") and cfg.rounds < 2):
            raise OwaiError(f"rounds must be >= 1 (>= 2 for a Bonsai init), got {cfg.rounds}")
        if cfg.init in ENSEMBLE_INITS and cfg.networks < 2:
            raise OwaiError(f"networks must be >= 2 for init {cfg.init} (n ERM networks; n = 1 is init erm-cf), "
                            f"got {cfg.networks}")
        for name in ("epochs", "checkpoint_every", "log_every"):
            if getattr(t, name) < 1:
                raise OwaiError(f"train.{name} must be >= 1, got {getattr(t, name)}")
        if b.synthesis_epochs < 1:
            raise OwaiError(f"bonsai.synthesis_epochs must be >= 1, got {b.synthesis_epochs}")
        if b.dro_eta < 0:  # learning rates, weight decays, momentum: config.check_ranges
            raise OwaiError(f"bonsai.dro_eta must be >= 0, got {b.dro_eta}")
        if p.weight < 0 or p.anneal_iters < 0 or p.clove_width <= 0:
            raise OwaiError("penalty: need weight >= 0, anneal_iters >= 0, clove_width > 0")

    def run(self, cfg: Config, run: Run) -> Outcome:
        from owai.data.camelyon17 import Camelyon17, eval_passes, find_root

        d = cfg.data
        data = Camelyon17(find_root(d.root), d.fraction, d.fraction_seed, d.image_size, d.cache_images)
        sizes = {s: int(data.split(s).numel()) for s in ("train", *EVAL_SPLITS)}
        console.info(f"Camelyon17 {data.dir}: " + ", ".join(f"{k} {v}" for k, v in sizes.items()))
        with eval_passes(data, d.eval_batch_size, d.workers) as passes:  # its workers end with the run, failed or not
            return self._pipeline(Context(cfg, run, data, run.device, passes), sizes)

    def _pipeline(self, ctx: Context, sizes: dict[str, int]) -> Outcome:
        """The discovery rounds, then the initialisation and downstream method `ctx.cfg` asks for."""
        cfg = ctx.cfg
        measured: dict[str, Any] = {}
        details: dict[str, Any] = {"split_sizes": sizes, "caches": {}, "rounds": {}}
        needed = cfg.rounds if cfg.init in ("none", "bonsai", "bonsai-cf") else 1
        rounds: list[RoundResult] = []
        if cfg.init != "rand" or cfg.method == "erm":
            for k in range(needed):
                rounds.append(discovery_round(ctx, k, rounds))
                r = rounds[-1]
                details["caches"][f"round{k}"] = str(r.cache)
                details["rounds"][f"round{k}"] = {"epoch": r.epoch, "curves": r.curves}
                best = r.curves[r.epoch - 1]
                measured[f"round{k}.test_acc"] = best["test.acc"]
                measured[f"round{k}.id_val_acc"] = best["id_val.acc"]
        if cfg.init == "none":
            return Outcome(measured, details)
        if cfg.init == "rand" and cfg.method == "erm":  # WILDS ERM from scratch = round 0
            curves = rounds[0].curves
            details["downstream"] = {"reused": "round0", "curves": curves}
        else:
            start = initial_network(ctx, rounds, details, measured)
            curves, _ = downstream(ctx, start, details)
            details["downstream"] = {"curves": curves}
        measured.update(selected_metrics(curves))
        return Outcome(measured, details)


# -- context, model, evaluation -----------------------------------------------------------------


@dataclass
class Context:
    cfg: Config
    run: Run
    data: Any  # owai.data.camelyon17.Camelyon17
    device: torch.device
    passes: Any  # owai.data.images.EvalPasses: every evaluation pass of the run through one set of workers

    @property
    def seed(self) -> int:
        return self.cfg.seed


def build_network(cfg: Config, outputs: int, *key: object) -> nn.Module:
    """A DenseNet with an `outputs`-way head, initialised from derive_seed(seed, *key) without
    touching torch's global RNG stream."""
    from owai.models.vision import DenseNet, densenet121
    from owai.runtime import derive_seed

    rng = torch.get_rng_state()
    torch.manual_seed(derive_seed(cfg.seed, "camelyon17-init", *key))
    if cfg.model.arch == "densenet121":
        net = densenet121(num_classes=outputs)
    else:  # two narrow dense blocks: 16 + 2x4x8 -> 40 -> 20 + 2x8 = 36 features
        net = DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16, bn_size=2, num_classes=outputs)
    torch.set_rng_state(rng)
    return net


def head_of(net: nn.Module) -> nn.Linear:
    return net.classifier  # type: ignore[return-value]


@torch.no_grad()
def forward_split(ctx: Context, net: nn.Module, split: str, what: Literal["logits", "features"] = "logits") -> torch.Tensor:
    """Logits (n, C) or features (n, d) of `net` in eval mode on every example of `split` (float32, CPU)."""
    from owai.models.vision import features

    was_training = net.training
    net.eval()
    out = []
    for x in ctx.passes(ctx.data.split(split)):
        x = x.to(ctx.device)
        out.append((net(x) if what == "logits" else features(net, x)).float().cpu())
    net.train(was_training)
    return torch.cat(out)


def split_metrics(ctx: Context, logits: dict[str, torch.Tensor]) -> dict[str, float]:
    """{"<split>.acc", "<split>.acc_wg"} from each split's 2-class logits."""
    from owai.data.camelyon17 import evaluate

    out = {}
    for split, lg in logits.items():
        idx = ctx.data.split(split)
        m = evaluate(lg.argmax(1), ctx.data.labels[idx], ctx.data.slides[idx])
        out[f"{split}.acc"], out[f"{split}.acc_wg"] = m.acc, m.acc_wg
    return out


# -- one training stage: epochs, per-epoch evaluation, best epoch, resume -----------------------


@dataclass
class StageResult:
    curves: list[dict[str, float]]  # one entry per epoch, {"epoch", metrics...}
    epoch: int  # 1-based epoch with the highest `select` value (first of ties)
    best_state: dict[str, torch.Tensor]


def train_stage(ctx: Context, stage: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                loss_at: Callable[[int, int], torch.Tensor], epochs: int, steps_per_epoch: int,
                evaluate: Callable[[], dict[str, float]], select: str,
                reset_optimizer_at: Callable[[int], bool] | None = None, penalty: Any = None) -> StageResult:
    """Train `model` for `epochs` x `steps_per_epoch` updates through `owai.train.train_loop`,
    evaluating after every epoch and keeping the weights of the best `select` epoch. The curves,
    best weights and the penalty's state (GroupDRO's q) are the loop's companion state, saved in
    every checkpoint, so a killed stage resumes exactly; a finished stage reloads."""
    from owai.train import BestWeights, LoopConfig, train_loop

    t = ctx.cfg.train
    steps = epochs * steps_per_epoch
    loop = LoopConfig(steps=steps, checkpoint_every=min(t.checkpoint_every, steps), log_every=min(t.log_every, steps))
    curves: list[dict[str, float]] = []
    best = BestWeights()  # its `step` is the epoch

    class Tracks:
        """The stage's evaluation state beside the model (train_loop's companion)."""

        def state_dict(self) -> dict[str, Any]:
            return {"curves": json.dumps(curves), "best": best.state_dict(),
                    "penalty": penalty.state_dict() if penalty is not None else {}}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            curves[:] = json.loads(state["curves"])
            best.load_state_dict(dict(state["best"]))
            if penalty is not None:
                penalty.load_state_dict(dict(state["penalty"]))

    def after_step(done: int) -> None:
        if done % steps_per_epoch == 0:
            epoch = done // steps_per_epoch
            values = evaluate()
            curves.append({"epoch": epoch, **values})
            ctx.run.log(stage, done, epoch=epoch, **values)
            best.offer(values[select], epoch, model)
            console.info(f"{stage} epoch {epoch}: " + " ".join(f"{k} {v:.4f}" for k, v in values.items()))

    train_loop(ctx.run, stage, model, optimizer, loss_at, loop, reset_optimizer_at=reset_optimizer_at,
               after_step=after_step, companion=Tracks())
    return StageResult(curves, best.step, best.state)


def steps_per_epoch(ctx: Context) -> int:
    """WILDS: len(train) // batch_size batches per epoch (also for the replicated GroupDRO data)."""
    return max(1, int(ctx.data.split("train").numel()) // ctx.cfg.data.batch_size)


# -- caching ------------------------------------------------------------------------------------


def _hash(what: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def discovery_key(ctx: Context) -> dict[str, Any]:
    """What the discovery rounds depend on (round k also on rounds < k, which share these settings)."""
    from owai.config import to_dict

    d = ctx.cfg.data
    return {"data": str(ctx.data.dir.resolve()), "fraction": d.fraction, "fraction_seed": d.fraction_seed,
            "image_size": d.image_size, "batch_size": d.batch_size, "arch": ctx.cfg.model.arch, "seed": ctx.seed,
            "train": {k: v for k, v in to_dict(ctx.cfg.train).items() if k not in ("checkpoint_every", "log_every")},
            "dro_eta": ctx.cfg.bonsai.dro_eta, "version": CACHE_VERSION}


def cache_dir(ctx: Context) -> Path:
    from owai.io import cache_root

    return cache_root() / "camelyon17" / _hash(discovery_key(ctx))


def synthesis_key(ctx: Context, rounds: int, distill: bool = False) -> str:
    """The synthesis's settings (its inputs are the rounds of cache_dir's key); `distill`: Distill_n's,
    over `rounds` ERM networks (network_seed) with bonsai.distill_groups."""
    from owai.config import to_dict

    b = to_dict(ctx.cfg.bonsai)
    what = {"rounds": rounds, **{k: b[k] for k in ("synthesis_epochs", "synthesis_lr", "synthesis_weight_decay",
                                                   "group_method")}, "n_groups": ctx.cfg.data.n_groups_per_batch}
    if distill:
        what.update(group_method=b["distill_groups"], of="erm-networks")
    return _hash(what)


def synthesis_name(ctx: Context, rounds: int, distill: bool = False) -> str:
    """The synthesis's cache entry (and frozen-feature key): synthesis-<K>-<key> or distill-<n>-<key>."""
    return f"{'distill' if distill else 'synthesis'}-{rounds}-{synthesis_key(ctx, rounds, distill)}"


def save_entry(path: Path, tensors: dict[str, torch.Tensor], info: dict[str, Any]) -> None:
    """A cache entry: safetensors with the JSON `info` in its metadata, written atomically."""
    from owai.io import write_cache_entry

    write_cache_entry(path, tensors, {"info": json.dumps(info)})


def load_entry(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """(tensors, info) of a cache entry, None when absent or unreadable (then it is rebuilt)."""
    from owai.io import read_cache_entry

    return read_cache_entry(path, lambda tensors, metadata: (tensors, json.loads(metadata["info"])))


def _prefixed(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}{k}": v for k, v in state.items()}


def _unprefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


# -- discovery rounds ---------------------------------------------------------------------------


@dataclass
class RoundResult:
    state: dict[str, torch.Tensor]  # the network at the chosen epoch
    preds: dict[str, torch.Tensor]  # int64 predictions of that network on every split
    curves: list[dict[str, float]]
    epoch: int
    cache: Path


def round_groups(preds: list[torch.Tensor], y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RFC's replicated GroupDRO data for round len(preds): copy j of example i has group
    (pred_j[i] != y[i]) + 2j. Returns (example index (J*n,), group (J*n,)), copy by copy."""
    n = y.numel()
    examples = torch.arange(n).repeat(len(preds))
    groups = torch.cat([(p.reshape(-1) != y.reshape(-1)).long() + 2 * j for j, p in enumerate(preds)])
    return examples, groups


def discovery_round(ctx: Context, k: int, earlier: list[RoundResult], checkpoints: str | None = None) -> RoundResult:
    """Round k (0: ERM, >= 1: GroupDRO over the earlier rounds' groups), from the cache when present.
    `checkpoints` names the run's stage directory (default `round<k>`; Cat_n's network i: `erm<i>`);
    the batches stay keyed by `round<k>`, so the cached network is the same whichever run trains it."""
    from owai.data.camelyon17 import ImageBatches, StandardSampler, UniformGroupSampler
    from owai.data.images import StepStream
    from owai.methods.invariance import make_penalty

    path = cache_dir(ctx) / f"round{k}.safetensors"
    with build_lock(path, ready=path.is_file):  # a sweep's workers train a round once
        entry = load_entry(path)
        if entry is not None:
            tensors, info = entry
            console.info(f"round {k}: cached {path}")
            return RoundResult(_unprefixed(tensors, "state."), _unprefixed(tensors, "pred."), info["curves"], info["epoch"], path)
        cfg, data, t = ctx.cfg, ctx.data, ctx.cfg.train
        train_idx = data.split("train")
        y = data.labels[train_idx]
        net = build_network(cfg, 2, "round", k).to(ctx.device)
        optimizer = torch.optim.SGD(net.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
        spe = steps_per_epoch(ctx)
        stage = f"round{k}"
        if k == 0:
            examples = train_idx
            sampler: Any = StandardSampler(train_idx.numel(), cfg.data.batch_size, ctx.seed, stage)
            groups = None
            penalty = None
        else:
            copies, groups = round_groups([r.preds["train"] for r in earlier], y)
            examples = train_idx[copies]
            sampler = UniformGroupSampler(groups, cfg.data.batch_size, ctx.seed, stage, steps_per_epoch=spe)
            penalty = make_penalty("groupdro", eta=cfg.bonsai.dro_eta)
            present = groups.unique()  # WILDS: q is uniform over the groups present in train
        stream = StepStream(ImageBatches(data, examples, sampler, spe * t.epochs), cfg.data.workers)
        labels = data.labels[examples]

        def loss_at(step: int, micro: int) -> torch.Tensor:
            x, pos = stream.at(step)
            logits = net(x.to(ctx.device))  # (B, 2)
            target = labels[pos].to(ctx.device)
            if penalty is None:
                return F.cross_entropy(logits, target)
            return group_dro_loss(penalty, logits, target, groups[pos].to(ctx.device), present)

        def evaluate() -> dict[str, float]:
            return split_metrics(ctx, {s: forward_split(ctx, net, s) for s in EVAL_SPLITS})

        with stream:  # its workers end with the stage, failed or not
            result = train_stage(ctx, checkpoints or stage, net, optimizer, loss_at, t.epochs, spe, evaluate, "id_val.acc",
                                 penalty=penalty)
        net.load_state_dict(result.best_state)
        preds = {s: forward_split(ctx, net, s).argmax(1) for s in ("train", *EVAL_SPLITS)}
        save_entry(path, {**_prefixed(result.best_state, "state."), **_prefixed(preds, "pred.")},
                   {"curves": result.curves, "epoch": result.epoch, "key": discovery_key(ctx), "round": k})
        return RoundResult(result.best_state, preds, result.curves, result.epoch, path)


def group_dro_loss(penalty: Any, logits: torch.Tensor, target: torch.Tensor, g: torch.Tensor,
                   present: torch.Tensor) -> torch.Tensor:
    """A discovery round's GroupDRO loss on one batch: the mean cross-entropy of each group `present`
    in the training set, 0 for one absent from the batch (WILDS's `compute_group_wise`), through the
    penalty's q (uniform over `present` at first, updated before it weighs the losses)."""
    losses = F.cross_entropy(logits, target, reduction="none")
    per_group = [losses[g == grp].mean() if bool((g == grp).any()) else losses.new_zeros(()) for grp in present.tolist()]
    return penalty.risk(per_group)


def network_seed(seed: int, i: int) -> int:
    """The seed of ERM network i of Cat_n / Distill_n: network 0 is the run's own round 0 (its seed),
    network i >= 1 is round 0 of derive_seed(seed, "camelyon17-erm-network", i). So Cat_n and
    Distill_n of every n share their first networks, and the runs of different seeds share none (the
    spread over seeds is over independent sets of n networks)."""
    from owai.runtime import derive_seed

    return seed if i == 0 else derive_seed(seed, "camelyon17-erm-network", i)


def network_context(ctx: Context, i: int) -> Context:
    """The run's context with network i's seed: its round 0, cache directory and initialisation."""
    import dataclasses

    return ctx if i == 0 else Context(dataclasses.replace(ctx.cfg, seed=network_seed(ctx.seed, i)), ctx.run, ctx.data,
                                      ctx.device, ctx.passes)


def erm_networks(ctx: Context, round0: RoundResult, details: dict[str, Any],
                 measured: dict[str, Any]) -> list[tuple[Context, RoundResult]]:
    """The `networks` ERM networks of Cat_n / Distill_n, (context, round 0) each: network 0 is the
    run's round 0 (already loaded), network i >= 1 round 0 of its seed, trained in the run's stage
    `erm<i>` unless its seed's cache holds it."""
    out = [(ctx, round0)]
    for i in range(1, ctx.cfg.networks):
        sub = network_context(ctx, i)
        out.append((sub, discovery_round(sub, 0, [], checkpoints=f"erm{i}")))
        details["caches"][f"erm{i}"] = str(out[-1][1].cache)
    accs = [r.curves[r.epoch - 1]["test.acc"] for _, r in out]
    details["networks"] = [{"seed": sub.seed, "epoch": r.epoch, "test_acc": a, "cache": str(r.cache)}
                           for (sub, r), a in zip(out, accs)]
    measured["networks.mean_test_acc"] = statistics.fmean(accs)  # a single ERM network, on average
    return out


# -- synthesis ----------------------------------------------------------------------------------


def synthesis_groups(pseudo: torch.Tensor, y: torch.Tensor, method: str) -> torch.Tensor:
    """Group of every example from the K rounds' predictions `pseudo` (K, n): `old` = 1 where every
    round is correct, 0 otherwise (RFC's 2-Bonsai); `balance` = 1 where the rounds agree (all correct
    or all wrong), 0 where they disagree (TH A.5)."""
    correct = pseudo == y.reshape(1, -1)  # (K, n)
    if method == "old":
        return correct.all(0).long()
    return (correct.all(0) | (~correct).all(0)).long()


def average_heads(weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K two-class heads of a Linear(d, 2K) averaged into one Linear(d, 2):
    weight (2K, d) -> (K, 2, d) -> mean over K; bias (2K,) -> (K, 2) -> mean (spec pitfall 15)."""
    k = weight.shape[0] // 2
    return weight.reshape(k, 2, -1).mean(0), bias.reshape(k, 2).mean(0)


@dataclass
class Synthesis:
    state: dict[str, torch.Tensor]  # the 2K-head network at the chosen epoch
    curves: list[dict[str, float]]
    epoch: int
    pseudo_acc: dict[str, float]  # heads vs pseudo-labels at that epoch (train, id_val)
    cache: Path


def synthesis(ctx: Context, rounds: list[RoundResult], distill: bool = False) -> Synthesis:
    """mtERM over the K rounds' pseudo-labels (cached by the discovery and synthesis settings);
    `distill`: over the K ERM networks of Distill_K instead, with bonsai.distill_groups."""
    from owai.data.camelyon17 import GroupSampler, ImageBatches
    from owai.data.images import StepStream
    from owai.methods.invariance import EnvBatch, make_penalty

    cfg, data, b = ctx.cfg, ctx.data, ctx.cfg.bonsai
    K = len(rounds)
    group_method = b.distill_groups if distill else b.group_method
    path = cache_dir(ctx) / f"{synthesis_name(ctx, K, distill)}.safetensors"
    with build_lock(path, ready=path.is_file):  # a sweep's workers train it once
        entry = load_entry(path)
        if entry is not None:
            tensors, info = entry
            console.info(f"synthesis: cached {path}")
            return Synthesis(_unprefixed(tensors, "state."), info["curves"], info["epoch"], info["pseudo_acc"], path)
        train_idx = data.split("train")
        pseudo = {s: torch.stack([r.preds[s] for r in rounds]) for s in ("train", "id_val")}  # (K, n_s)
        groups = synthesis_groups(pseudo["train"], data.labels[train_idx], group_method)
        n_groups = min(cfg.data.n_groups_per_batch, int(groups.unique().numel()))
        if n_groups < cfg.data.n_groups_per_batch:
            console.info(f"synthesis: only {n_groups} {group_method!r} group(s) present; batches draw from it alone")
        spe = steps_per_epoch(ctx)
        per_batch = cfg.data.batch_size - cfg.data.batch_size % n_groups
        sampler = GroupSampler(groups, per_batch, n_groups, ctx.seed, "synthesis", steps_per_epoch=spe)
        stream = StepStream(ImageBatches(data, train_idx, sampler, spe * b.synthesis_epochs), cfg.data.workers)
        net = build_network(cfg, 2 * K, "synthesis").to(ctx.device)
        optimizer = torch.optim.SGD(net.parameters(), lr=b.synthesis_lr, momentum=cfg.train.momentum,
                                    weight_decay=b.synthesis_weight_decay)
        objective = make_penalty("erm", risk_reduction="sum")  # sum_k CE(head_k, pseudo_k)

        def loss_at(step: int, micro: int) -> torch.Tensor:
            x, pos = stream.at(step)
            logits = net(x.to(ctx.device))  # (B, 2K)
            target = pseudo["train"][:, pos].to(ctx.device)  # (K, B)
            heads = [EnvBatch(logits[:, 2 * k : 2 * k + 2], target[k]) for k in range(K)]
            return objective.objective(heads, step).loss

        def pseudo_accuracy(split: str) -> float:
            logits = forward_split(ctx, net, split)  # (n, 2K)
            pred = logits.reshape(logits.shape[0], K, 2).argmax(2).T  # (K, n)
            return float((pred == pseudo[split]).float().mean())

        def evaluate() -> dict[str, float]:
            return {"id_val.pseudo_acc": pseudo_accuracy("id_val")}

        with stream:  # its workers end with the stage, failed or not
            result = train_stage(ctx, "synthesis", net, optimizer, loss_at, b.synthesis_epochs, spe, evaluate, "id_val.pseudo_acc")
        net.load_state_dict(result.best_state)
        accs = {"train": pseudo_accuracy("train"), "id_val": result.curves[result.epoch - 1]["id_val.pseudo_acc"]}
        save_entry(path, _prefixed(result.best_state, "state."),
                   {"curves": result.curves, "epoch": result.epoch, "pseudo_acc": accs, "rounds": K,
                    "key": discovery_key(ctx), "bonsai": synthesis_key(ctx, K, distill), "distill": distill})
        return Synthesis(result.best_state, result.curves, result.epoch, accs, path)


def convert(ctx: Context, syn: Synthesis, rounds: int) -> dict[str, torch.Tensor]:
    """The synthesis network as a 2-class network: its featurizer with the averaged (or a random) head."""
    state = dict(syn.state)
    if ctx.cfg.bonsai.head == "average":
        state["classifier.weight"], state["classifier.bias"] = average_heads(state["classifier.weight"],
                                                                            state["classifier.bias"])
    else:
        fresh = head_of(build_network(ctx.cfg, 2, "random-head"))
        state["classifier.weight"], state["classifier.bias"] = fresh.weight.detach().clone(), fresh.bias.detach().clone()
    return state


# -- downstream ---------------------------------------------------------------------------------


@dataclass
class Start:
    state: dict[str, torch.Tensor] | None  # None = from scratch (round 0's initialisation)
    frozen: bool
    features_key: str  # what the cached features are of
    network: nn.Module | None = None  # a ready network (Cat_n) in place of a DenseNet loaded with `state`
    features: Callable[[], tuple[dict[str, torch.Tensor], list[str]]] | None = None  # its cached features, caches


class CatNetwork(nn.Module):
    """Cat_n on Camelyon17: n DenseNets' features concatenated, (B, n x d), under one Linear head
    `classifier` (so `head_of` and the frozen downstream treat it as a DenseNet). Written here rather
    than with owai.models.rich.ConcatFeatures, which takes headless backbones and pins BatchNorm in
    eval mode: the reference's frozen-BN quirk (`downstream.frozen_bn: train`) needs train-mode BN."""

    def __init__(self, networks: list[nn.Module], head: nn.Linear) -> None:
        super().__init__()
        self.networks = nn.ModuleList(networks)
        self.classifier = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from owai.models.vision import features

        return self.classifier(torch.cat([features(net, x) for net in self.networks], dim=1))


def fresh_head(cfg: Config, width: int, *key: object) -> nn.Linear:
    """A Linear(width, 2) initialised from derive_seed(seed, "camelyon17-init", *key) (PyTorch's default
    init), leaving torch's global RNG stream untouched."""
    from owai.runtime import derive_seed

    rng = torch.get_rng_state()
    torch.manual_seed(derive_seed(cfg.seed, "camelyon17-init", *key))
    head = nn.Linear(width, 2)
    torch.set_rng_state(rng)
    return head


def cat_features(members: list[tuple[Context, nn.Module]]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Cat_n's eval-mode features on every split, (n_s, sum d_i): each network's features from its own
    cache (`features-round0` under its seed's key, shared with erm-cf), filled block by block into one
    preallocated tensor per split (peak memory: the result plus one network's features)."""
    widths = [head_of(net).in_features for _, net in members]
    out: dict[str, torch.Tensor] = {}
    caches, offset = [], 0
    for (sub, net), width in zip(members, widths):
        feats = cached_features(sub, net, "round0")
        caches.append(str(cache_dir(sub) / "features-round0.safetensors"))
        for split, f in feats.items():
            if split not in out:
                out[split] = torch.empty(f.shape[0], sum(widths), dtype=f.dtype)
            out[split][:, offset : offset + width] = f
        offset += width
        del feats
    return out, caches


def initial_network(ctx: Context, rounds: list[RoundResult], details: dict[str, Any], measured: dict[str, Any]) -> Start:
    init = ctx.cfg.init
    if init == "rand":
        return Start(None, False, "")
    if init in ("erm", "erm-cf"):
        return Start(rounds[0].state, init == "erm-cf", "round0")
    if init == "cat-cf":  # a fresh head: unlike erm-cf (round 0's head) and bonsai-cf (the averaged heads)
        members = []
        for sub, r in erm_networks(ctx, rounds[0], details, measured):
            net = build_network(sub.cfg, 2, "round", 0)
            net.load_state_dict(r.state)
            members.append((sub, net))
        cat = CatNetwork([net for _, net in members], fresh_head(
            ctx.cfg, sum(head_of(net).in_features for _, net in members), "cat-head", len(members)))
        return Start(None, True, f"cat-{len(members)}", network=cat, features=lambda: cat_features(members))
    distill = init == "distill-cf"
    if distill:
        rounds = [r for _, r in erm_networks(ctx, rounds[0], details, measured)]
    syn = synthesis(ctx, rounds, distill)
    details["caches"]["synthesis"] = str(syn.cache)
    details["synthesis"] = {"epoch": syn.epoch, "curves": syn.curves, "pseudo_acc": syn.pseudo_acc}
    measured["synthesis.pseudo_acc.train"] = syn.pseudo_acc["train"]
    measured["synthesis.pseudo_acc.id_val"] = syn.pseudo_acc["id_val"]
    return Start(convert(ctx, syn, len(rounds)), init in ("bonsai-cf", "distill-cf"),
                 synthesis_name(ctx, len(rounds), distill))


def make_downstream_penalty(cfg: Config) -> Any:
    """The registry penalty of `cfg.method` with RFC-Camelyon's schedule and WILDS's options."""
    from owai.methods.invariance import make_penalty

    p = cfg.penalty
    if cfg.method == "erm":
        return make_penalty("erm", risk_reduction="mean")
    extra = {"irm": {"unbiased": True}, "vrex": {"divide_by_groups": True}, "clove": {"width": p.clove_width}}[cfg.method]
    return make_penalty(cfg.method, weight=p.weight, anneal_iters=p.anneal_iters, anneal_val=0.0, reset_optimizer=True,
                        risk_reduction="mean", divide_by_weight=p.divide_by_weight, **extra)


def cached_features(ctx: Context, net: nn.Module, key: str) -> dict[str, torch.Tensor]:
    """Eval-mode features (n, d) of the frozen featurizer on every split, cached beside the rounds."""
    path = cache_dir(ctx) / f"features-{key}.safetensors"
    with build_lock(path, ready=path.is_file):  # a sweep's workers compute them once
        entry = load_entry(path)
        if entry is not None:
            return entry[0]
        feats = {s: forward_split(ctx, net, s, "features") for s in ("train", *EVAL_SPLITS)}
        save_entry(path, feats, {"of": key})
        return feats


def downstream(ctx: Context, start: Start, details: dict[str, Any]) -> tuple[list[dict[str, float]], nn.Module]:
    """Train the downstream point (stage `downstream`); returns its per-epoch curves and the network
    (for a cached frozen featurizer: the untouched featurizer with the trained head)."""
    from owai.data.camelyon17 import GroupSampler, ImageBatches
    from owai.data.images import StepStream
    from owai.methods.invariance import EnvBatch

    cfg, data, t = ctx.cfg, ctx.data, ctx.cfg.train
    net = start.network if start.network is not None else build_network(cfg, 2, "round", 0)
    if start.state is not None:
        net.load_state_dict(start.state)
    net = net.to(ctx.device)
    wd = cfg.downstream.weight_decay
    if wd is None:
        wd = 1e-6 if cfg.init == "bonsai" else t.weight_decay
    train_idx = data.split("train")
    hospitals = data.centers[train_idx]
    spe = steps_per_epoch(ctx)
    sampler = GroupSampler(hospitals, cfg.data.batch_size, cfg.data.n_groups_per_batch, ctx.seed, "downstream",
                           steps_per_epoch=spe)
    labels = data.labels[train_idx]
    penalty = make_downstream_penalty(cfg)
    cached = start.frozen and cfg.downstream.frozen_bn == "eval"
    stream: StepStream | None = None  # cached features are read without one
    details["downstream_setup"] = {"weight_decay": wd, "frozen": start.frozen, "cached_features": cached,
                                   "penalty": cfg.method}
    if cached:
        if start.features is not None:
            feats, paths = start.features()
            details["caches"]["features"] = paths
        else:
            feats = cached_features(ctx, net, start.features_key)
            details["caches"]["features"] = str(cache_dir(ctx) / f"features-{start.features_key}.safetensors")
        head = head_of(net)
        trained: nn.Module = head
        params = list(head.parameters())

        def batch_logits(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            pos = sampler.positions(step)
            return head(feats["train"][pos].to(ctx.device)), pos

        def evaluate() -> dict[str, float]:
            with torch.no_grad():
                return split_metrics(ctx, {s: head(feats[s].to(ctx.device)).cpu() for s in EVAL_SPLITS})
    else:
        stream = StepStream(ImageBatches(data, train_idx, sampler, spe * t.epochs), cfg.data.workers)
        if start.frozen:  # the reference: parameters frozen, BatchNorm still in train mode
            for p in net.parameters():
                p.requires_grad_(False)
            for p in head_of(net).parameters():
                p.requires_grad_(True)
        trained = net
        params = [p for p in net.parameters() if p.requires_grad]

        def batch_logits(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, pos = stream.at(step)
            return net(x.to(ctx.device)), pos

        def evaluate() -> dict[str, float]:
            return split_metrics(ctx, {s: forward_split(ctx, net, s) for s in EVAL_SPLITS})

    optimizer = torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=wd)

    def loss_at(step: int, micro: int) -> torch.Tensor:
        logits, pos = batch_logits(step)  # (B, 2); positions grouped hospital by hospital
        y = labels[pos].to(ctx.device)
        g = hospitals[pos]
        envs = [EnvBatch(logits[(g == h).to(logits.device)], y[(g == h).to(y.device)]) for h in g.unique_consecutive().tolist()]
        return penalty.objective(envs, step).loss

    with stream if stream is not None else contextlib.nullcontext():  # its workers end with the stage, failed or not
        result = train_stage(ctx, "downstream", trained, optimizer, loss_at, t.epochs, spe, evaluate, "id_val.acc",
                             reset_optimizer_at=penalty.reset_optimizer_at, penalty=penalty)
    return result.curves, net


def selected_metrics(curves: list[dict[str, float]]) -> dict[str, float]:
    """The run's numbers at its epoch chosen by id_val (IID tune) and by val (OOD tune)."""
    iid = max(curves, key=lambda c: (c["id_val.acc"], -c["epoch"]))
    ood = max(curves, key=lambda c: (c["val.acc"], -c["epoch"]))
    return {"test_acc.iid": iid["test.acc"], "test_acc.ood": ood["test.acc"], "id_val_acc.iid": iid["id_val.acc"],
            "val_acc.ood": ood["val.acc"], "test_acc_wg.iid": iid["test.acc_wg"], "test_acc_wg.ood": ood["test.acc_wg"],
            "epoch.iid": iid["epoch"], "epoch.ood": ood["epoch"]}


# -- the study: IID / OOD tuning across seeds, per-round table, Figure 2.9 -----------------------

HP_KEYS = ("penalty.weight", "penalty.anneal_iters")  # searched per (init, rounds, method)
ROW_KEYS = ("init", "rounds", "networks", "method")  # a study row's identity; other grid keys label variants


def variant_keys(groups: list[dict[str, Any]], base: dict[str, Any]) -> set[str]:
    """The grid keys (not searched, not a row's identity) that take more than one value among the
    groups of one row: Table A.13's synthesis weight decay, A.15's head. A key one row's grid fixes
    (Table 2.6's CLOvE kernel width 0.2) is a setting, not a variant."""
    seen: dict[tuple[Any, ...], dict[str, set[str]]] = {}
    for group in groups:
        grid = group["grid"] or {}
        full = {**base, **grid}
        identity = tuple(full.get(k) for k in ROW_KEYS)
        for k, v in grid.items():
            if k not in HP_KEYS and k not in ROW_KEYS:
                seen.setdefault(identity, {}).setdefault(k, set()).add(json.dumps(v, sort_keys=True, default=str))
    return {k for keys in seen.values() for k, values in keys.items() if len(values) > 1}


def _variant_order(variant: dict[str, Any]) -> tuple[Any, ...]:
    """Variants sorted by value, numbers as numbers (1e-6 < 1e-4 < 1e-2)."""
    return tuple((k, (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v))) for k, v in sorted(variant.items()))


STUDY_NAME = "camelyon17"
TUNES = {"iid": "id_val_acc.iid", "ood": "val_acc.ood"}  # tuning -> the validation metric it maximises
METHOD_LABELS = {"erm": "ERM", "irm": "IRMv1", "vrex": "vREx", "clove": "CLOvE"}


def init_label(init: str, rounds: Any, networks: Any = None, method: str = "erm") -> str:
    """Table 2.6's name of an initialisation. A penalty from scratch is its "ERM" row: the penalty
    starts after `penalty.anneal_iters` steps of ERM pre-training (TH 2.3.4, RFC's camelyon17_irm.sh);
    `erm`, which starts from round 0's trained network, is not in the thesis's table."""
    if init == "rand":
        return "-" if method == "erm" else "ERM"
    return {"erm": "ERM (round 0)", "erm-cf": "ERM-cf", "bonsai": f"{rounds}-Bonsai", "bonsai-cf": f"{rounds}-Bonsai-cf",
            "cat-cf": f"Cat{networks}", "distill-cf": f"Distill{networks}", "none": "rounds"}.get(init, str(init))


def _point_params(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """run_dir -> resolved params of every complete point."""
    out = {}
    for p in summary.get("points", []):
        if p["status"] == "complete":
            out[p["run_dir"]] = Run(Path(p["run_dir"])).read_config()["params"]
    return out


def _stat(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.pstdev(values) if len(values) > 1 else 0.0)


def study_rows(sweep: Any, summary: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(Table 2.6 rows, Table 2.7 rows). A Table 2.6 row (also Table 2.3's) per (init, rounds, networks,
    method), `networks` only for Cat_n / Distill_n (labels Cat<n>, Distill<n>): for each tuning,
    the grid cell (penalty weight, anneal) with the best mean over seeds of the validation metric,
    and the mean +- std (population, over seeds) of its test accuracy; with the thesis's numbers."""
    from owai.recipes import Selection, load, recorded_name, thesis_for
    from owai.sweep import select_cells

    recipe = load(recorded_name(sweep.recipe, sweep.recipe_source))
    params = _point_params(summary)
    base = next(iter(params.values()), {})
    keys: list[str] = []
    for group in summary["groups"]:
        keys += [k for k in group["grid"] if k not in keys]
    per = [k for k in keys if k not in HP_KEYS]
    varying = variant_keys(summary["groups"], {k: v for k, v in base.items() if k in ROW_KEYS})
    rows: dict[str, dict[str, Any]] = {}
    for tune, metric in TUNES.items():
        selection = select_cells(summary["groups"], Selection(metric, "max", per))
        for group in selection["groups"]:
            if group["grid"] is None:
                continue
            measured = {m["metric"]: m for m in group["metrics"]}
            test = measured.get(f"test_acc.{tune}")
            if test is None:
                continue
            cell = {**base, **{k: v for k, v in group["grid"].items() if "." not in k}}
            for k, v in group["grid"].items():
                if "." in k:
                    section, leaf = k.split(".", 1)
                    cell[section] = {**cell.get(section, {}), leaf: v}
            init, rounds, method = cell.get("init"), cell.get("rounds"), cell.get("method")
            networks = cell.get("networks") if init in ENSEMBLE_INITS else None  # Cat_n / Distill_n's n
            # other settings the grid varies (Table A.13's synthesis weight decay, A.15's head): a row each
            variant = {k: v for k, v in group["grid"].items() if k in varying}
            label = (f"{init}|{rounds if init in ('bonsai', 'bonsai-cf') else ''}|{networks or ''}|{method}|"
                     + json.dumps(variant, sort_keys=True))
            shown = "".join(f" [{k.split('.')[-1]}={v}]" for k, v in sorted(variant.items()))
            row = rows.setdefault(label, {"kind": "table2.6", "init": init, "rounds": rounds, "networks": networks,
                                          "method": method, "variant": variant, **variant,
                                          "label": f"{init_label(init, rounds, networks, method)} / "
                                                   f"{METHOD_LABELS.get(method, method)}{shown}"})
            pseudo = {split: measured[f"synthesis.pseudo_acc.{split}"]["mean"] for split in ("train", "id_val")
                      if f"synthesis.pseudo_acc.{split}" in measured}
            if pseudo:  # Table A.14: the synthesis's accuracy on its pseudo-labels (the same for every head)
                row.setdefault("synthesis_pseudo_acc", pseudo)
            values = test["values"]
            mean, std = _stat(values)
            thesis = thesis_for(recipe, f"test_acc.{tune}", cell)
            row[tune] = {"mean": mean, "std": std, "seeds": len(values), "validation": group["score"],
                         "selected": {k: v for k, v in group["grid"].items() if k in HP_KEYS},
                         "thesis": thesis.value if thesis else None}
    rounds_rows = round_rows(summary, params)
    order = {i: n for n, i in enumerate(INITS)}
    table = sorted(rows.values(), key=lambda r: (order.get(r["init"], 99), r["rounds"] or 0, r["networks"] or 0,
                                                 _variant_order(r["variant"]),
                                                 METHODS.index(r["method"]) if r["method"] in METHODS else 99))
    return table, rounds_rows


def round_rows(summary: dict[str, Any], params: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Table 2.7: each discovery round alone (its epoch chosen by id_val), mean +- std over seeds.
    The rounds of a seed are shared by all its points, so each seed counts once."""
    per_round: dict[int, dict[int, float]] = {}
    for p in summary["points"]:
        if p["status"] != "complete":
            continue
        results = Run(Path(p["run_dir"])).results() or {}
        for row in results.get("rows", []):
            name = row["metric"]
            if name.startswith("round") and name.endswith(".test_acc") and row.get("measured") is not None:
                k = int(name[len("round"):-len(".test_acc")])
                per_round.setdefault(k, {})[p["seed"]] = float(row["measured"])
    out = []
    for k in sorted(per_round):
        mean, std = _stat(list(per_round[k].values()))
        out.append({"kind": "table2.7", "round": k, "label": f"round {k + 1}" + (" (ERM)" if k == 0 else " (GroupDRO)"),
                    "mean": mean, "std": std, "seeds": len(per_round[k])})
    return out


def _pm(entry: dict[str, Any] | None) -> str:
    if not entry or entry.get("mean") is None:
        return "-"
    return f"{100 * entry['mean']:.1f} ± {100 * (entry.get('std') or 0):.1f}"


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def study_markdown(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], title: str, command: str) -> str:
    lines = [f"# {title}", "", f"Command: `{command}`", "",
             "Test accuracy (%) mean ± std over seeds. IID tune: penalty weight and anneal chosen by the mean "
             "id_val accuracy over seeds (each run at its best id_val epoch); OOD tune: by the val (centre 1) "
             "accuracy.", "",
             "| init / method | IID tune | thesis | OOD tune | thesis | seeds | selected (IID; OOD) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        iid, ood = r.get("iid") or {}, r.get("ood") or {}
        chosen = "; ".join(" ".join(f"{k.split('.')[-1]}={v}" for k, v in (e.get("selected") or {}).items()) or "-"
                           for e in (iid, ood))
        lines.append(md_row([r["label"], _pm(iid), _pct(iid.get("thesis")), _pm(ood), _pct(ood.get("thesis")),
                             iid.get("seeds", ood.get("seeds", 0)), chosen]))
    if rounds:
        lines += ["", "## Each discovery round alone (Table 2.7)", "", "| round | test acc | seeds |", "|---|---|---|"]
        lines += [md_row([r["label"], _pm(r), r["seeds"]]) for r in rounds]
    return "\n".join(lines) + "\n"


def study_table(rows: list[dict[str, Any]], title: str) -> Any:
    cells = [[r["label"], _pm(iid), _pct(iid.get("thesis")), _pm(ood), _pct(ood.get("thesis")), iid.get("seeds", ood.get("seeds", 0))]
             for r in rows for iid, ood in [(r.get("iid") or {}, r.get("ood") or {})]]
    return console.text_table(title, ("init / method", "IID tune", "thesis", "OOD tune", "thesis", "seeds"), cells,
                              left=("init / method",))


def plot_study(summary: dict[str, Any], title: str) -> Any:
    """Figure 2.9. Left: OOD test accuracy against the penalty weight for IRMv1/vREx/CLOvE, under
    IID and OOD tuning (the anneal chosen per weight), one line per init. Right: each run's test
    accuracy against its validation accuracy (id_val at the IID epoch, val at the OOD epoch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    lines: dict[tuple[str, str, str], dict[float, tuple[float, float]]] = {}
    params = _point_params(summary)
    base = {k: v for k, v in next(iter(params.values()), {}).items() if k in ROW_KEYS}  # init / rounds set as params
    varying = variant_keys(summary["groups"], base)
    for group in summary["groups"]:
        grid = {**base, **(group["grid"] or {})}
        method = grid.get("method")
        if method not in ("irm", "vrex", "clove") or "penalty.weight" not in grid:
            continue
        m = {x["metric"]: x for x in group["metrics"]}
        init = init_label(grid.get("init", ""), grid.get("rounds", ""), grid.get("networks", ""), method)
        init += "".join(f" [{k.split('.')[-1]}={v}]" for k, v in sorted(grid.items())
                        if k in varying)  # Table A.13 / A.15 variants: a line each
        if float(grid["penalty.weight"]) <= 0:  # lambda 0 (ERM on the group loader) has no place on the log axis
            continue
        for tune, metric in TUNES.items():
            if metric not in m or f"test_acc.{tune}" not in m:
                continue
            key = (METHOD_LABELS[method], init, tune.upper())
            weight = float(grid["penalty.weight"])
            score, test = m[metric]["mean"], m[f"test_acc.{tune}"]["mean"]
            if weight not in lines.setdefault(key, {}) or score > lines[key][weight][0]:
                lines[key][weight] = (score, test)
    for (method, init, tune), points in sorted(lines.items()):
        xs = sorted(points)
        left.plot(xs, [100 * points[x][1] for x in xs], marker="o", linestyle="-" if tune == "IID" else "--",
                  label=f"{method}, {init}, {tune} tune")
    left.set_xscale("log")
    left.set_xlabel("penalty weight")
    left.set_ylabel("test accuracy (%)")
    if lines:
        left.legend(fontsize=6)
    for group in summary["groups"]:
        m = {x["metric"]: x for x in group["metrics"]}
        for tune, metric, marker in (("iid", "id_val_acc.iid", "o"), ("ood", "val_acc.ood", "^")):
            if metric in m and f"test_acc.{tune}" in m:
                right.scatter([100 * v for v in m[metric]["values"]], [100 * v for v in m[f"test_acc.{tune}"]["values"]],
                              marker=marker, s=12, alpha=0.6)
    right.set_xlabel("validation accuracy (%) (o: id_val, ^: val)")
    right.set_ylabel("test accuracy (%)")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_study(sweep: Any, summary: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """camelyon17.json / .md and figures/camelyon17.png in the sweep directory (atomically)."""
    from owai.sweep import write_study_files

    rows, rounds = study_rows(sweep, summary)
    title = f"{sweep.recipe} [{sweep.preset}]: Camelyon17 test accuracy, IID and OOD tuning"
    command = f"owai bonsai --resume {sweep.path}"
    figure = write_study_files(sweep, STUDY_NAME, title, rows + rounds,
                               study_markdown(rows, rounds, title, command), plot_study(summary, title))
    return rows, {"title": title, "figure": str(figure), "table": str(sweep.path / f"{STUDY_NAME}.md"), "rounds": rounds}
