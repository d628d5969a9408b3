"""ColoredMNIST / InverseColoredMNIST invariant learning (thesis §2.3.3, Table 2.4; spec §0-§2).

One run = one restart: the data (`owai.data.colored_mnist`, seeded by `seed`) and the MLP's initial
weights (`owai.models.mlp`) both depend on `seed`, as RFC's restart `r` seeds both; the thesis's 10
restarts are the sweep's seeds (`owai sweep table2.4-coloredmnist --seeds 0,...,9`).

Training (spec §0), through `owai.train.train_loop` (stage `train`):

* full batch: every step uses all examples of both training environments (CLOvE: a random
  `minibatch` = 512 examples per environment, drawn from `generator(seed, "minibatch", step)`);
* `torch.optim.Adam(lr)` without weight decay; explicit L2 `l2 * sum ||p||^2` on the parameters the
  penalty regularises (`Penalty.l2_scope`); `l2` defaults to the reference's value per dataset
  (0.0011 ColoredMNIST, 1e-4 InverseColoredMNIST);
* the penalty objective of `owai.methods.invariance` (`make_penalty`): w_t = anneal_val before
  `anneal_iters`, the penalty weight afterwards, the whole loss divided by w_t when w_t > 1;
* `init: rand` = the penalty from step 0 (anneal_iters 0); `init: erm` = RFC's "ERM init": the
  anneal phase of `penalty.anneal_iters` steps at weight `anneal_val` (1 by default, as the
  reference's code; the thesis's "penalty off" is `penalty.anneal_val=0`). The Adam state is kept
  when the penalty switches on (RFC ColoredMNIST); `penalty.reset_optimizer=true` clears it
  (DomainBed/WILDS), through the loop's `reset_optimizer_at` hook.
* `init: bonsai | bonsai-cf` (spec §3.1): the Bonsai representation is built first in stages
  `bonsai.round<k>` and `bonsai.synthesis` (`owai.methods.bonsai`, settings under `bonsai.*`;
  reloaded from those stages on resume); the downstream MLP starts from its featurizer and the
  average of the synthesis heads, and the penalty runs from step 0 (anneal 0, as the reference).
  `bonsai` trains everything; `bonsai-cf` freezes the featurizer (no gradient, not in the
  optimizer, not in the L2 term) and trains the head alone on features computed once (cached).
  The representation is built with the dataset's L2 (`bonsai.l2`), whatever `train.l2` the
  downstream run has, so the ERM rows' L2 grid shares one representation per seed.

Evaluation: after update 1 + `train.eval_every` * i (the reference's step index 20 i: it logs step `s`
after update s + 1; the thesis's early-stopping grid, Table A.12: 20 i for most methods) and after the
last update, the training accuracy (both environments pooled) and the three
test environments' accuracies (colour flips 0.9, 0.1, 0.5) are logged to metrics.jsonl. Reported:

* `train_acc`, `test_acc.flip0.9|0.1|0.5` and `worst_test_acc` (their minimum, the thesis's metric) at
  the last step;
* `peek.worst_test_acc` / `peek.step`: the best worst-test accuracy over the evaluations on Table
  A.12's early-stopping grid (`a12_window`; every evaluation where the table has no grid) ("peeking
  at test", TH A.9). The thesis picks one (configuration, epoch) for the *mean over 10 restarts*; the
  per-restart peek is an upper bound of that choice. The cross-restart selection is the study's
  (`owai bonsai --study`, `write_study` below): per (dataset, method, init) the searched setting and
  evaluation step with the best mean over restarts, reported as mean ± std at that point, the steps
  limited to Table A.12's grid k i, i <= 24 (`a12_window`);
* `<method>.<init>.worst_test_acc` (= the peek value; `inverse.` in front on InverseColoredMNIST) and
  `[inverse.]oracle.worst_test_acc` for ERM from rand on a gray variant (`table_metric`): the names of
  the recipes' table rows.

Methods: every penalty of the registry.

* one logit, the environments' batches (erm, irm, vrex, sd, iga, fish, fishr, clove, rerm, mmd,
  coral) and `groupdro` (its group weights q persist across steps and are checkpointed with the
  model through the loop's `companion`);
* `rsc` and `lff` (the anneal study, Fig 2.7; 2 logits, cross-entropy): RSC masks the head's input
  (the `head` goes to the objective); LfF trains a biased copy beside the model, both with Adam's
  coupled weight decay l2, at lr x 0.01 and with a fresh Adam state from `anneal_iters` on, the
  copy taken from the ERM-pretrained model at that step; its loss averages are the companion state;
* `pi` (Table 2.5; spec §2.11, init rand only): per training environment a model trained by ERM
  on 90 % of it (stages `pi.env<k>`, 51 steps, 151 on Inverse; with `penalty.options: {stopping:
  validation}` each ends at its best step on the held-out 10 %), whose predictions split the
  environments into correct/incorrect groups; the run's model then minimises the hard max over
  those groups for `train.steps` (701 in the paper preset). `details.pi` records the groups, the
  final model's accuracy on each (`group_acc`; every evaluation logs them too) and, per stage
  model, its accuracy where the colour agrees / disagrees with the label;
  `stage_data: gray` (a diagnostic) trains the stage models on the gray variant instead.

`init: perfect` (Fig 2.8 top): the model is first trained by ERM on the dataset's gray variant for
`perfect.steps` (80) steps (stage `perfect`), then the penalty runs from step 0.
"""

from __future__ import annotations

import copy
import json
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from owai import console
from owai.config import BaseConfig
from owai.data.colored_mnist import ColoredMNIST, accuracy, load_colored_mnist, training_pool_size, variant
from owai.data.mnist import check_mnist_dir, mnist_dir
from owai.errors import DataMissing, OwaiError
from owai.methods import Method, Outcome
from owai.methods.bonsai import BonsaiConfig, cached_representation, check_config, fresh_mlp, init_from, train_phase
from owai.methods.invariance import ALIASES, L2, PI, REGISTRY, EnvBatch, LfF, Penalty, make_penalty
from owai.models.mlp import ColoredMNISTMLP
from owai.runs import Run
from owai.runtime import generator
from owai.train import LoopConfig, train_loop
from owai.values import md_row

Dataset = Literal["coloredmnist", "coloredmnist-gray", "inverse-coloredmnist", "inverse-coloredmnist-gray"]
Init = Literal["rand", "erm", "bonsai", "bonsai-cf", "perfect"]
SUPPORTED = tuple(REGISTRY)
INITS_OF = {"rsc": ("rand", "erm"), "lff": ("rand", "erm"), "pi": ("rand",)}  # methods with fewer inits
PI_STEPS1 = {"coloredmnist": 51, "inverse-coloredmnist": 151}  # PI's stage-1 steps (spec §2.11)
# table rows are named <prefix><method>.<init>.worst_test_acc; the gray variants give the oracle rows
TABLE_PREFIX = {"coloredmnist": "", "inverse-coloredmnist": "inverse."}


@dataclass
class DataConfig:
    # offline: the documented t10k rule (4 000 + 4 000 training, 3 x 2 000 test images; a deviation
    # from the paper); paper: the thesis's 50k/10k split of the 60k MNIST training set.
    split: Literal["offline", "paper"] = "offline"
    root: str = ""  # data root (or MNIST IDX dir); "" = the data-root rule ($OWAI_DATA/mnist, cache), else the packaged test split
    hub_id: str = ""  # paper split from the Hugging Face hub (e.g. ylecun/mnist) when root is ""
    rng: Literal["owai", "rfc"] = "owai"
    grayscale: bool = False
    train_size: int = 0  # 0: the whole training pool; N: its first N shuffled images (a diagnostic)


@dataclass
class PenaltyConfig:
    weight: float | None = None  # lambda; None = the method's default (1e4 IRM/vREx/IGA/Fishr/CLOvE, 100 SD)
    anneal_iters: int = 100  # ERM-init steps (used with init=erm; init=rand forces 0)
    anneal_val: float | None = None  # weight during the anneal phase; None = the method's (1, 0 for fish)
    divide_by_weight: bool = True
    reset_optimizer: bool = False  # clear the Adam state when the penalty switches on (RFC: no)
    options: dict[str, Any] = field(default_factory=dict)  # method options, e.g. {unbiased: true}


@dataclass
class ModelConfig:
    hidden: int = 390


@dataclass
class TrainConfig:
    steps: int = 1001  # the anneal study / Rand / ERM columns (spec §1 step counts)
    lr: float = 5e-4
    l2: float | None = None  # None = 0.0011 (ColoredMNIST) or 1e-4 (InverseColoredMNIST)
    eval_every: int = 20  # Table A.12's early-stopping grid (20 i; CLOvE 30 i)
    checkpoint_every: int = 100
    log_every: int = 10


@dataclass
class PerfectInitConfig:
    steps: int = 80  # ERM steps on the gray variant (the reference script's effective --steps)
    l2: float | None = None  # None = train.l2's value (0.0011 ColoredMNIST)


@dataclass
class ColoredMNISTConfig(BaseConfig):
    dataset: Dataset = "coloredmnist"
    method: str = "irm"
    init: Init = "rand"
    data: DataConfig = field(default_factory=DataConfig)
    penalty: PenaltyConfig = field(default_factory=PenaltyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    bonsai: BonsaiConfig = field(default_factory=BonsaiConfig)  # init=bonsai|bonsai-cf only
    perfect: PerfectInitConfig = field(default_factory=PerfectInitConfig)  # init=perfect only


class ColoredMNISTInvariance(Method):
    Config = ColoredMNISTConfig
    cli = "owai bonsai"

    @staticmethod
    def unused_settings(cfg: ColoredMNISTConfig) -> dict[str, str]:
        """The settings of the initialisations this run does not use (`init`)."""
        unused = {}
        if cfg.init != "erm":
            for key in ("anneal_iters", "anneal_val"):
                unused[f"penalty.{key}"] = f"a setting of the ERM phase of --init erm; --init {cfg.init} has none (its penalty starts at step 0)"
        if cfg.init not in ("bonsai", "bonsai-cf"):
            unused["bonsai"] = f"settings of --init bonsai / bonsai-cf; this run's is --init {cfg.init}"
        elif cfg.bonsai.stopping == "fixed":
            for key in ("val_fraction", "val_every"):
                unused[f"bonsai.{key}"] = "a setting of bonsai.stopping: validation; this run's phases run for fixed step counts"
        if cfg.init != "perfect":
            unused["perfect"] = f"settings of --init perfect; this run's is --init {cfg.init}"
        return unused

    @staticmethod
    def validate(cfg: ColoredMNISTConfig) -> None:
        check(cfg)

    def run(self, cfg: ColoredMNISTConfig, run: Run) -> Outcome:
        data = load_data(cfg)
        device = run.device
        pen = build_penalty(cfg)
        l2 = l2_coefficient(cfg)
        two_logits = pen.n_logits == 2
        train = [(e.x.to(device), (e.y_long if two_logits else e.y).to(device)) for e in data.train]
        test = [(e.x.to(device), (e.y_long if two_logits else e.y).to(device)) for e in data.test]
        details: dict[str, Any] = {}
        t = cfg.train
        rep = None
        if cfg.init in ("bonsai", "bonsai-cf"):
            rep = cached_representation(run, data, cfg.dataset, cfg.bonsai, seed=cfg.seed, hidden=cfg.model.hidden,
                                        lr=t.lr, l2=bonsai_l2(cfg), device=device, checkpoint_every=t.checkpoint_every,
                                        log_every=t.log_every, data_key=data_key(cfg.data))
            details.update(bonsai=rep.details, frozen_featurizer=cfg.init == "bonsai-cf")
        model = fresh_mlp((cfg.seed, "init"), cfg.model.hidden, pen.n_logits, device)
        if rep is not None:
            init_from(model, rep)
        if cfg.init == "perfect":
            details["perfect"] = perfect_init(cfg, run, model, l2, device)
            details["perfect"]["worst_test_acc"] = evaluate(model, train, test)["worst_test_acc"]  # Fig 2.8's star
        loss_groups = train
        group_names: list[str] = []  # PI's groups, whose training accuracy each evaluation records
        if isinstance(pen, PI):
            agrees = [(e.color == e.y.long()).to(device) for e in data.train]  # the digit's channel = label's
            loss_groups, details["pi"] = pi_groups_for(cfg, run, pen, train, l2, device, agrees)
            group_names = list(details["pi"]["groups"])
            model = fresh_mlp((cfg.seed, "init"), cfg.model.hidden, 1, device)  # the final model's init, as every run
        frozen = cfg.init == "bonsai-cf"
        if frozen:
            model.freeze_featurizer()
            with torch.no_grad():  # the cache: the head's inputs, computed once
                train = [(model.featurizer(x), y) for x, y in train]
                test = [(model.featurizer(x), y) for x, y in test]
                loss_groups = train
        stage = "train"
        featurize = (lambda z: z) if frozen else model.featurizer
        trained: nn.Module = model
        predict = model.head if frozen else model
        lr_at = reset_at = None
        companion = pen if type(pen).state_dict is not Penalty.state_dict else None
        if isinstance(pen, LfF):  # a biased copy trained beside the model (spec §2.9)
            trained = nn.ModuleDict({"debiased": model, "biased": copy.deepcopy(model)})
            optimizer = torch.optim.Adam(trained.parameters(), lr=t.lr, weight_decay=l2)
            lr_at = lambda step: t.lr * (pen.lr_factor if step >= pen.anneal_iters else 1.0)  # noqa: E731
            reset_at = lambda step: step == pen.anneal_iters  # noqa: E731  (both models: fresh Adam at lr/100)
        else:
            optimizer = torch.optim.Adam(model.trainable_parameters(), lr=t.lr)
            reset_at = pen.reset_optimizer_at
        params = model.trainable_parameters()

        def batches(net: nn.Module, step: int) -> list[EnvBatch]:
            out = []
            for k, (x, y) in enumerate(loss_groups):
                if pen.minibatch is not None and pen.minibatch < len(y):
                    idx = torch.randperm(len(y), generator=generator(cfg.seed, "minibatch", stage, step, k))
                    idx = idx[: pen.minibatch].to(device)
                    x, y = x[idx], y[idx]
                z = featurize(x) if net is model else net.featurizer(x)
                out.append(EnvBatch(net.head(z), y, z))
            return out

        def loss_at(step: int, micro: int = 0) -> torch.Tensor:
            biased = None
            if isinstance(pen, LfF) and step >= pen.anneal_iters:
                if step == pen.anneal_iters:  # the biased model starts as the ERM-pretrained one
                    trained["biased"].load_state_dict(model.state_dict())
                biased = batches(trained["biased"], step)
            reg = pen.l2(l2, [] if frozen else model.featurizer.parameters(), model.head.parameters())
            return pen.objective(batches(model, step), step, params=params, l2=reg, head=model.head, biased=biased).loss

        def scores() -> dict[str, float]:
            out = evaluate(predict, train, test)
            out.update(group_accuracies(predict, loss_groups, group_names))
            return out

        def after_step(done: int) -> None:
            if (done - 1) % t.eval_every == 0 or done == t.steps:  # the reference's step index (done - 1) = 20 i
                run.log(stage, done, **scores())

        loop = LoopConfig(t.steps, checkpoint_every=t.checkpoint_every, log_every=t.log_every)
        summary = train_loop(run, stage, trained, optimizer, loss_at, loop, lr_at=lr_at, reset_optimizer_at=reset_at,
                             after_step=after_step, companion=companion)
        final = scores()
        if group_names:
            details["pi"]["group_acc"] = {n: round(final.pop(f"group_acc.{n}"), 4) for n in group_names}
        curve = evaluation_curve(run, stage)
        return Outcome(measured=headline(cfg, final, curve), details={
            "final_loss": summary["final_loss"],
            "penalty": {"name": pen.name, "weight": pen.weight, "anneal_iters": pen.anneal_iters,
                        "anneal_val": pen.anneal_val, "reset_optimizer": pen.reset_optimizer},
            "l2": l2,
            "data": {"split": data.split, "source": data.source, "train_sizes": [len(e) for e in data.train],
                     "test_sizes": [len(e) for e in data.test]},
            "curve": curve,
            **details,
        })


def evaluation_curve(run: Run, stage: str) -> list[dict[str, Any]]:
    """The stage's evaluations in step order, one per step."""
    by_step = {r["step"]: r for r in run.metrics() if r.get("stage") == stage and "worst_test_acc" in r}
    return [{"step": s, "train_acc": r["train_acc"], "worst_test_acc": r["worst_test_acc"]}
            for s, r in sorted(by_step.items())]


def _train_erm(cfg: ColoredMNISTConfig, run: Run, stage: str, model: ColoredMNISTMLP, data: list, steps: int,
               l2: float, validate: Any = None, val_every: int = 10) -> dict[str, Any]:
    """Full-batch ERM with explicit L2 on `data`'s batches: PI's stage models and the perfect init
    (with `validate`, the phase keeps its best-scoring weights; `bonsai.train_phase`)."""
    t = cfg.train
    return train_phase(run, stage, model, steps, t.lr, l2, make_penalty("erm"),
                       lambda: [EnvBatch(model(x), y) for x, y in data], t.checkpoint_every, t.log_every,
                       validate=validate, val_every=val_every)


def gray_variant(cfg: ColoredMNISTConfig) -> ColoredMNIST:
    """The run's dataset with colour carrying no label information (same seed: same images and
    uniform draws, so the same labels where the label noise is equal)."""
    return load_data(cfg, f"{cfg.dataset.removesuffix('-gray')}-gray")


def perfect_init(cfg: ColoredMNISTConfig, run: Run, model: ColoredMNISTMLP, l2: float, device: str) -> dict[str, Any]:
    """Fig 2.8 (top): the "perfect initialisation", ERM on the dataset's gray variant (colour carries
    no label information) for `perfect.steps` steps (80, the reference script's effective value),
    trained in stage `perfect` on the downstream model itself."""
    gray = gray_variant(cfg)
    pooled = [(torch.cat([e.x for e in gray.train]).to(device), torch.cat([e.y for e in gray.train]).to(device))]
    _train_erm(cfg, run, "perfect", model, pooled, cfg.perfect.steps, cfg.perfect.l2 if cfg.perfect.l2 is not None else l2)
    return {"steps": cfg.perfect.steps, "dataset": gray.variant.name}


def pi_groups_for(cfg: ColoredMNISTConfig, run: Run, pen: PI, train: list, l2: float, device: str,
                  colour_agrees: list[torch.Tensor]) -> tuple[list, dict[str, Any]]:
    """PI's stages 1-2 (spec §2.11): per training environment i a fresh model trained by ERM on a
    random 90 % of environment i for `steps1` steps (stage `pi.env<i>`); their predictions split the
    environments into correct/incorrect groups (`pi_groups`: own environment, or cross with
    `cross: true`). With `stopping: validation` each stage model keeps the weights with the best
    accuracy on its environment's held-out part. Returns the groups as (x, y) batches for the RERM
    stage, and what they were: the groups' sizes and, per stage model, its step, hold-out accuracy
    and accuracy on its environment where the colour agrees / disagrees with the label
    (`colour_agrees`), which says which feature the model relies on."""
    steps1 = pen.steps1 if pen.steps1 else PI_STEPS1[variant(cfg.dataset).family]
    fit_on = train
    if pen.stage_data == "gray":  # the diagnostic: shape-only stage models (same images and labels)
        gray = gray_variant(cfg)
        fit_on = [(e.x.to(device), e.y.to(device)) for e in gray.train]
        if any(not torch.equal(g[1], t[1]) for g, t in zip(fit_on, train)):
            raise OwaiError(f"pi stage_data 'gray': {gray.variant.name} does not share {cfg.dataset}'s labels")
    preds, stages = [], []
    for i, (x, y) in enumerate(train):
        order = torch.randperm(len(y), generator=generator(cfg.seed, "pi", "holdout", i)).to(device)
        n_fit = len(y) - int(round(pen.holdout * len(y)))
        keep, held = order[:n_fit], order[n_fit:]
        if pen.stopping == "validation" and len(held) == 0:
            raise OwaiError(f"pi stopping 'validation': environment {i + 1} has no held-out examples "
                            f"({len(y)} examples, holdout {pen.holdout})")
        x_fit = fit_on[i][0]  # (the gray diagnostic validates on gray images too)
        validate = (lambda m, x_h=x_fit[held], y_h=y[held]: accuracy(m(x_h), y_h)) if pen.stopping == "validation" else None
        model = fresh_mlp((cfg.seed, "pi", i), cfg.model.hidden, 1, device)
        phase = _train_erm(cfg, run, f"pi.env{i + 1}", model, [(x_fit[keep], y[keep])], steps1, l2,
                           validate=validate, val_every=pen.val_every)
        with torch.no_grad():
            preds.append([(model(xj).reshape(-1) > 0).long() for xj, _ in train])
            right, agrees = preds[i][i] == y.reshape(-1).long(), colour_agrees[i]
        stages.append({"steps": phase.get("best_step", steps1),
                       "holdout_acc": round(float(right[held].float().mean()), 4) if len(held) else None,
                       "acc_colour_agrees": round(float(right[agrees].float().mean()), 4),
                       "acc_colour_disagrees": round(float(right[~agrees].float().mean()), 4)})
    groups = pen.groups([y for _, y in train], preds)
    batches = [(train[j][0][mask], train[j][1][mask]) for _, j, mask in groups]
    info = {"steps1": steps1, "cross": pen.cross, "stopping": pen.stopping, "stage_data": pen.stage_data,
            "groups": {name: int(mask.sum()) for name, _, mask in groups}, "stage_models": stages}
    return batches, info


def check(cfg: ColoredMNISTConfig) -> None:
    """Reject impossible or not-yet-implemented settings before any run directory exists."""
    key = ALIASES.get(cfg.method, cfg.method)
    if key not in REGISTRY:
        raise OwaiError(f"unknown invariance method {cfg.method!r} (known: {', '.join(SUPPORTED)})")
    if cfg.init not in INITS_OF.get(key, (cfg.init,)):
        raise OwaiError(f"method {key!r} runs with init {' or '.join(INITS_OF[key])}, not {cfg.init!r}")
    if cfg.perfect.steps < 1:
        raise OwaiError(f"perfect.steps must be >= 1, got {cfg.perfect.steps}")
    t, p = cfg.train, cfg.penalty
    for name, value in [("train.steps", t.steps), ("train.eval_every", t.eval_every), ("model.hidden", cfg.model.hidden),
                        ("train.checkpoint_every", t.checkpoint_every), ("train.log_every", t.log_every)]:
        if value < 1:
            raise OwaiError(f"{name} must be >= 1, got {value}")
    if cfg.init == "erm" and key != "erm":
        if p.anneal_iters < 1:
            raise OwaiError("init=erm needs penalty.anneal_iters >= 1 ERM steps (init=rand is anneal 0)")
        if p.anneal_iters >= t.steps:
            raise OwaiError(f"penalty.anneal_iters={p.anneal_iters} leaves no penalty step in train.steps={t.steps}")
    pool = training_pool_size(mnist_file(cfg.data))
    if cfg.data.train_size < 0 or cfg.data.train_size == 1 or cfg.data.train_size > pool:
        raise OwaiError(f"data.train_size must be 0 (every training image) or from 2 to the {pool} training "
                        f"images of split {cfg.data.split!r}, got {cfg.data.train_size}")
    check_mnist(cfg.data)
    check_config(cfg.bonsai)
    build_penalty(cfg)  # bad weights / options are one-line errors now


def check_mnist(data: DataConfig) -> None:
    """The MNIST file of `data` can be read: found by the data-root rule, or (a hub id and no local
    copy) the hub answers; else one line naming `owai data fetch mnist`, before any run directory."""
    if data.root or not data.hub_id:
        try:
            folder = mnist_dir(mnist_file(data), data.root or None)
        except DataMissing as e:  # the thesis's split: say that the packaged split needs no download
            raise DataMissing(f"{e} (or --preset tiny: the packaged 10k test split)") from None
        check_mnist_dir(folder, mnist_file(data))  # the official files by md5, any other copy decoded: a bad file is one line here
        return
    from owai.data.mnist import split_files
    from owai.data.registry import locate, missing_message
    from owai.hub import hub_unreachable

    if locate("mnist", None, split_files(mnist_file(data))) is None:
        problem = hub_unreachable()
        if problem:
            raise DataMissing(f"{missing_message('mnist')} (hub id {data.hub_id!r}: {problem})")


def anneal_iters(cfg: ColoredMNISTConfig) -> int:
    return cfg.penalty.anneal_iters if cfg.init == "erm" else 0


def build_penalty(cfg: ColoredMNISTConfig) -> Penalty:
    p = cfg.penalty
    options = dict(p.options)
    for reserved in ("weight", "anneal_iters", "anneal_val", "divide_by_weight", "reset_optimizer"):
        if reserved in options:
            raise OwaiError(f"penalty.options.{reserved}: set penalty.{reserved} instead")
    if p.weight is not None:
        options["weight"] = p.weight
    if p.anneal_val is not None:
        options["anneal_val"] = p.anneal_val
    return make_penalty(cfg.method, anneal_iters=anneal_iters(cfg), divide_by_weight=p.divide_by_weight,
                        reset_optimizer=p.reset_optimizer, **options)


def dataset_l2(dataset: str) -> float:
    """The reference's L2 for a dataset (0.0011 ColoredMNIST; 1e-4 InverseColoredMNIST)."""
    return L2[variant(dataset).family]


def l2_coefficient(cfg: ColoredMNISTConfig) -> float:
    """The downstream run's L2: `train.l2`, else the dataset's."""
    return cfg.train.l2 if cfg.train.l2 is not None else dataset_l2(cfg.dataset)


def bonsai_l2(cfg: ColoredMNISTConfig) -> float:
    """The Bonsai representation's L2: `bonsai.l2`, else the dataset's (not `train.l2`)."""
    return cfg.bonsai.l2 if cfg.bonsai.l2 is not None else dataset_l2(cfg.dataset)


def data_key(data: DataConfig) -> dict[str, Any]:
    """The data settings a cached Bonsai representation depends on (`train_size` 0 left out, so
    the representations cached before the option existed keep their keys)."""
    key = dataclasses.asdict(data)
    if not key["train_size"]:
        del key["train_size"]
    return key


def mnist_file(data: DataConfig) -> Literal["train", "test"]:
    """The MNIST file a split reads: the offline split uses the test file."""
    return "test" if data.split == "offline" else "train"


def load_data(cfg: ColoredMNISTConfig, dataset: str | None = None) -> ColoredMNIST:
    """The run's data (`dataset`: another variant on the same images, e.g. the gray oracle)."""
    d = cfg.data  # no root: load_mnist follows the data-root rule (owai.data.mnist.mnist_dir)
    return load_colored_mnist(dataset or cfg.dataset, cfg.seed, mnist_file(d), root=d.root or None,
                              hub_id=d.hub_id or None, rng=d.rng, grayscale=d.grayscale, train_size=d.train_size or None)


@torch.no_grad()
def evaluate(model: torch.nn.Module, train: list, test: list) -> dict[str, float]:
    """Pooled training accuracy, each test environment's accuracy and the worst of them (`model`
    maps the lists' inputs to logits: the MLP on images, or the head on cached features)."""
    model.eval()
    correct = sum(accuracy(model(x), y) * len(y) for x, y in train)
    out = {"train_acc": correct / sum(len(y) for _, y in train)}
    accs = [accuracy(model(x), y) for x, y in test]
    out.update({f"test_acc.flip{flip}": a for flip, a in zip(("0.9", "0.1", "0.5"), accs)})
    out["worst_test_acc"] = min(accs)
    return out


@torch.no_grad()
def group_accuracies(model: torch.nn.Module, groups: list, names: list[str]) -> dict[str, float]:
    """`group_acc.<name>`: the model's accuracy on each named training group (PI's RERM stage), so
    a run shows whether it fits a small group far beyond what shape allows (no names: nothing)."""
    if not names:
        return {}
    model.eval()
    return {f"group_acc.{n}": accuracy(model(x), y) for n, (x, y) in zip(names, groups, strict=True)}


def headline(cfg: ColoredMNISTConfig, final: dict[str, float], curve: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers set beside the thesis (names match the recipe's thesis keys)."""
    measured: dict[str, Any] = {k: round(v, 4) for k, v in final.items()}
    method = ALIASES.get(cfg.method, cfg.method)
    record = {"dataset": cfg.dataset, "method": method, "init": cfg.init, "curve": {r["step"]: r for r in curve}}
    on_grid = list(a12_window(record)["curve"].values()) or curve  # the study's rule, one restart
    best = max(on_grid, key=lambda r: r["worst_test_acc"]) if on_grid else {"step": cfg.train.steps, **final}
    measured["peek.worst_test_acc"] = round(best["worst_test_acc"], 4)
    measured["peek.step"] = best["step"]
    measured[table_metric(cfg.dataset, method, cfg.init)] = measured["peek.worst_test_acc"]
    return measured


def table_metric(dataset: str, method: str, init: str) -> str:
    """The name of a (dataset, method, init) row beside the thesis: `<method>.<init>.worst_test_acc`
    on ColoredMNIST, `inverse.` in front on InverseColoredMNIST, `[inverse.]oracle.worst_test_acc`
    for ERM on a gray variant (other runs on gray data: `<dataset>.<method>.<init>...`)."""
    prefix = TABLE_PREFIX[variant(dataset).family]
    if dataset.endswith("-gray"):
        return f"{prefix}oracle.worst_test_acc" if (method, init) == ("erm", "rand") else f"{dataset}.{method}.{init}.worst_test_acc"
    return f"{prefix}{method}.{init}.worst_test_acc"


# --- the study: the thesis's selection across restarts (TH A.9) --------------------------------------
STUDY_NAME = "bonsai"
GROUP_KEYS = ("dataset", "method", "init")  # a table cell; every other grid key is searched


def _point_records(sweep: Any) -> list[dict[str, Any]]:
    """Every finished point: its (dataset, method, init), searched settings, seed and curve."""
    from owai.sweep import read_point

    records = []
    for p in sweep.points:
        status, results, _ = read_point(sweep, p)
        if status != "complete" or results is None:
            continue
        params = Run(sweep.point_dir(p)).read_config()["params"]
        curve = results.get("details", {}).get("curve") or []
        searched = {k: v for k, v in sorted(p.grid.items()) if k not in GROUP_KEYS and k != "seed"}
        steps = {c["step"]: c["worst_test_acc"] for c in curve}
        records.append({"dataset": params["dataset"], "method": ALIASES.get(params["method"], params["method"]),
                        "init": params["init"], "searched": searched, "seed": p.seed, "params": params,
                        "curve": steps, "last": (max(steps), steps[max(steps)]) if steps else None,
                        "start": results.get("details", {}).get("perfect", {}).get("worst_test_acc")})
    return records


def select_across_restarts(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """TH A.9's protocol: for every searched setting and every evaluated step, the mean over restarts of
    the worst-test accuracy; the best (setting, step) wins (ties: the earlier); reported as mean ± std
    (numpy's population std, as the reference prints) over the restarts at that point."""
    import numpy as np

    by_setting: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_setting.setdefault(json.dumps(r["searched"], sort_keys=True, default=str), []).append(r)
    best = None
    for key, runs in by_setting.items():
        steps = sorted(set.intersection(*(set(r["curve"]) for r in runs)))
        for step in steps:
            values = [r["curve"][step] for r in runs]
            mean = float(np.mean(values))
            if best is None or mean > best["mean"]:
                best = {"mean": mean, "std": float(np.std(values)), "n": len(values), "step": step,
                        "searched": json.loads(key), "values": values, "seeds": [r["seed"] for r in runs]}
    return best


A12_LAST_INDEX = 24  # TH Table A.12: early-stopping epochs k * i with i in [0, 24]
A12_EVERY = {  # Table A.12's multiplier k per initialisation column and method (ColoredMNIST)
    "rand": {"irm": 20, "vrex": 20, "iga": 20, "clove": 30, "fishr": 20, "sd": 20, "rsc": 1, "lff": 20, "fish": 20},
    "bonsai": {"irm": 2, "vrex": 2, "iga": 1, "clove": 1, "fishr": 1, "sd": 1},
    "bonsai-cf": {"irm": 125, "vrex": 20, "iga": 20, "clove": 20, "fishr": 20, "sd": 20},
}
A12_EVERY["erm"] = A12_EVERY["rand"]  # one "Rand/ERM" column


def a12_window(record: dict[str, Any], last_index: int = A12_LAST_INDEX) -> dict[str, Any]:
    """The record with its curve cut to Table A.12's early-stopping grid: the evaluations at steps
    1 + k * i with i <= last_index, k the table's multiplier for the record's (init, method). An
    evaluation off that grid (a run evaluated more often than k) or after it is dropped. The table
    covers its penalised methods from Rand/ERM/Bonsai init on ColoredMNIST only, so ERM, PI, init
    perfect and InverseColoredMNIST are left whole (docs/decisions.md, "Selection window")."""
    every = A12_EVERY.get(record["init"], {}).get(record["method"])
    if every is None or variant(record["dataset"]).family != "coloredmnist":
        return record
    on_grid = {s: v for s, v in record["curve"].items() if (s - 1) % every == 0 and s <= 1 + every * last_index}
    return {**record, "curve": on_grid}


def study_rows(sweep: Any, window: Literal["all", "a12"] = "a12") -> list[dict[str, Any]]:
    """One row per (dataset, method, init[, anneal]) of the sweep's finished points, with the thesis's
    number (`select_rows`). `window` "a12" (the default, the thesis's protocol) selects only among the
    steps of Table A.12's early-stopping grid (`a12_window`); "all" among every evaluated step, for
    comparison (docs/decisions.md)."""
    from owai.recipes import load, recorded_name, thesis_for

    recipe = load(recorded_name(sweep.recipe, sweep.recipe_source))
    records = _point_records(sweep)
    if window == "a12":
        records = [a12_window(r) for r in records]
    return select_rows(records, lambda metric, params: thesis_for(recipe, metric, params))


def start_and_last(runs: list[dict[str, Any]], searched: dict[str, Any]) -> dict[str, Any]:
    """Fig 2.8's drift, over the restarts of the selected setting: `start_acc`, the mean accuracy of the
    initialisation itself (init perfect's blue star; None for other inits), and `last_acc` at
    `last_step`, the mean at the runs' last evaluated step (their whole curve, not the selection
    window; None when the restarts end at different steps)."""
    import numpy as np

    chosen = [r for r in runs if r["searched"] == searched]
    starts = [r["start"] for r in chosen if r.get("start") is not None]
    lasts = [r["last"] for r in chosen if r.get("last") is not None]
    same = bool(lasts) and len(lasts) == len(chosen) and len({step for step, _ in lasts}) == 1
    return {"start_acc": float(np.mean(starts)) if starts and len(starts) == len(chosen) else None,
            "last_acc": float(np.mean([acc for _, acc in lasts])) if same else None,
            "last_step": lasts[0][0] if same else None}


def select_rows(records: list[dict[str, Any]], thesis_of: Any = lambda metric, params: None) -> list[dict[str, Any]]:
    """One row per (dataset, method, init): the selected mean ± std (`select_across_restarts`), the
    selected setting's initial and last accuracies (`start_and_last`) and the thesis's number
    (`thesis_of(metric, params)`, an object with .value/.ref, or None). When the grid
    searches penalty.anneal_iters for init erm (Fig 2.7), one more row per pre-training length with
    `anneal` set, also when the grid holds a single length (the cpu preset's 100), so that claims can
    name the length (`where: {anneal: 100}`)."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        cells.setdefault((r["dataset"], r["method"], r["init"]), []).append(r)
    rows = []
    for (dataset, method, init), runs in cells.items():
        metric = table_metric(dataset, method, init)
        thesis = thesis_of(metric, runs[0]["params"])
        chosen = select_across_restarts(runs)
        if chosen is None:
            continue
        rows.append({"dataset": dataset, "method": method, "init": init, "anneal": None, "metric": metric,
                     **chosen, **start_and_last(runs, chosen["searched"]),
                     "thesis": thesis.value if thesis else None, "ref": thesis.ref if thesis else ""})
        anneals = sorted({r["searched"].get("penalty.anneal_iters") for r in runs} - {None})
        if init == "erm":
            for a in anneals:
                sub = select_across_restarts([r for r in runs if r["searched"].get("penalty.anneal_iters") == a])
                if sub is not None:
                    rows.append({"dataset": dataset, "method": method, "init": init, "anneal": a, "metric": metric,
                                 **sub, "thesis": None, "ref": ""})
    return rows


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    text = f"{100 * row['mean']:.1f} ± {100 * row['std']:.1f}"
    return text + (f" ({100 * row['thesis']:.1f})" if row.get("thesis") is not None else "")


def study_markdown(rows: list[dict[str, Any]], title: str, command: str) -> str:
    """Methods x initialisations per dataset: measured mean ± std over restarts (thesis), then the
    chosen settings and step of every cell."""
    lines = [f"### {title}", "", f"Command: `{command}`", "",
             "Worst-of-three test accuracy (%), mean ± population std over restarts at the (setting, step) with "
             "the best mean (test peeking, TH A.9); penalised ColoredMNIST cells only at the steps of Table A.12's "
             "early-stopping grid (k i, i <= 24). The thesis's number in brackets.", ""]
    table = [r for r in rows if r["anneal"] is None]
    for dataset in dict.fromkeys(r["dataset"] for r in table):
        inits = list(dict.fromkeys(r["init"] for r in table if r["dataset"] == dataset))
        lines += [f"**{dataset}**", "", "| method | " + " | ".join(inits) + " |", "|---" * (len(inits) + 1) + "|"]
        for method in dict.fromkeys(r["method"] for r in table if r["dataset"] == dataset):
            cells = {r["init"]: r for r in table if r["dataset"] == dataset and r["method"] == method}
            lines.append(md_row([method, *(_cell(cells.get(i)) for i in inits)]))
        lines.append("")
    lines += ["| dataset | method | init | anneal | chosen settings | step | n |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        settings = ", ".join(f"{k}={v}" for k, v in r["searched"].items()) or "-"
        lines.append(md_row([r["dataset"], r["method"], r["init"], "" if r["anneal"] is None else r["anneal"], settings,
                             r["step"], r["n"]]))
    return "\n".join(lines) + "\n"


def study_table(rows: list[dict[str, Any]], title: str) -> Any:
    columns = ("dataset", "method", "init", "worst test acc % (thesis)", "chosen", "n")
    cells = [[r["dataset"], r["method"], r["init"], _cell(r),
              f"{', '.join(f'{k}={v}' for k, v in r['searched'].items())} step {r['step']}".strip(), r["n"]]
             for r in rows if r["anneal"] is None]
    return console.text_table(title, columns, cells, left=columns)


def plot_study(sweep: Any, rows: list[dict[str, Any]], label: str) -> Any:
    """Fig 2.7 when the grid varies the ERM pre-training length (selected accuracy per length and
    method); Fig 2.8 when the initialisations are `perfect` / `bonsai-cf` (mean test curve of the
    selected setting per method); otherwise the table as grouped bars with the thesis's numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    table = [r for r in rows if r["anneal"] is None]
    inits = list(dict.fromkeys(r["init"] for r in table))
    if any(r["anneal"] is not None for r in rows):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for method in dict.fromkeys(r["method"] for r in rows if r["anneal"] is not None):
            pts = [(r["anneal"], r["mean"]) for r in rows if r["method"] == method and r["anneal"] is not None]
            pts += [(0, r["mean"]) for r in table if r["method"] == method and r["init"] == "rand"]
            pts.sort()
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=method)
        ax.set_xlabel("ERM pre-training steps (epochs)")
        ax.set_ylabel("worst test accuracy (%), selected")
        ax.set_title(f"Fig 2.7: {label}")
        ax.legend(fontsize=8, ncol=3)
    elif inits and set(inits) <= {"perfect", "bonsai-cf", "bonsai"}:
        records = _point_records(sweep)
        fig, axes = plt.subplots(1, len(inits), figsize=(6 * len(inits), 4.5), squeeze=False)
        for ax, init in zip(axes[0], inits):
            for r in (r for r in table if r["init"] == init):
                runs = [x for x in records if (x["dataset"], x["method"], x["init"]) == (r["dataset"], r["method"], init)
                        and x["searched"] == r["searched"]]
                steps = sorted(set.intersection(*(set(x["curve"]) for x in runs)))
                ax.plot(steps, [100 * np.mean([x["curve"][s] for x in runs]) for s in steps], label=r["method"])
                starts = [x["start"] for x in runs if x.get("start") is not None]
                if init == "perfect" and starts:  # the accuracy of the perfect initialisation itself
                    ax.plot([0], [100 * np.mean(starts)], "b*", markersize=12)
            ax.set_xlabel("training steps (epochs)")
            ax.set_ylabel("worst test accuracy (%)")
            ax.set_title(f"Fig 2.8: from {'a perfect initialisation' if init == 'perfect' else 'frozen Bonsai' if init == 'bonsai-cf' else 'Bonsai'}")
            ax.legend(fontsize=8)
        fig.suptitle(label)
    else:
        methods = list(dict.fromkeys(r["method"] for r in table))
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(methods)), 4.5))
        width = 0.8 / max(len(inits) * len({r['dataset'] for r in table}), 1)
        series = list(dict.fromkeys((r["dataset"], r["init"]) for r in table))
        for i, (dataset, init) in enumerate(series):
            cells = {r["method"]: r for r in table if (r["dataset"], r["init"]) == (dataset, init)}
            xs = [m + i * width for m in range(len(methods))]
            means = [100 * cells[m]["mean"] if m in cells else np.nan for m in methods]
            stds = [100 * cells[m]["std"] if m in cells else 0 for m in methods]
            ax.bar(xs, means, width, yerr=stds, label=f"{dataset} {init}" if len(series) > len(inits) else init)
            thesis = [100 * cells[m]["thesis"] if m in cells and cells[m]["thesis"] is not None else np.nan for m in methods]
            ax.plot(xs, thesis, "k_", markersize=12)
        ax.set_xticks([m + width * (len(series) - 1) / 2 for m in range(len(methods))], methods)
        ax.set_ylabel("worst test accuracy (%); black: thesis")
        ax.set_title(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def write_study(sweep: Any, summary: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """bonsai.json, bonsai.md and figures/bonsai.png in the sweep directory (atomically)."""
    from owai.sweep import write_study_files

    rows = study_rows(sweep)
    title = f"{sweep.recipe} [{sweep.preset}]: worst test accuracy, selected across restarts"
    command = f"owai bonsai --resume {sweep.path}"
    figure = write_study_files(sweep, STUDY_NAME, title, rows, study_markdown(rows, title, command),
                               plot_study(sweep, rows, f"{sweep.recipe} [{sweep.preset}]"))
    return rows, {"title": title, "figure": str(figure), "table": str(sweep.path / f"{STUDY_NAME}.md")}
