"""Bonsai (= RFC) rich representation for ColoredMNIST (thesis §2.3, Alg. 1-2; spec §3.1).

The pipeline, as RFC's `coloredmnist_rfc.sh` runs it, on the *pooled* training set (environment 1
then environment 2; the environments themselves are discarded):

1. **Round 0 (ERM)**, stage `bonsai.round0`: a fresh MLP+head trained by ERM on the pooled set,
   full batch, for `erm_steps` (51 ColoredMNIST, 151 Inverse). Afterwards
   `correct_0 = 1[pred = y]` and `pseudo_0 = pred`.
2. **Round k >= 1 (RERM)**, stage `bonsai.round<k>`: a fresh MLP+head trained with the `rerm`
   penalty (hard max over groups) on the 2k groups {incorrect_j, correct_j} of every earlier round
   j < k (`round_groups`; an example belongs to k of them), for `rerm_steps` (501 / 401). Then
   `correct_k`, `pseudo_k` as above.
3. **Synthesis**, stage `bonsai.synthesis`: the agreement mask A = all rounds right or all wrong
   (`agreement_mask`); the balance trick draws N/2 examples with replacement from A and N/2 from
   not-A (`balanced_indices`) into one fixed training set of N; a fresh MLP with a K-output head is
   trained for `synthesis_steps` (501) on `(1/K) sum_k BCE(head_k, pseudo_k) + l2 ||theta||^2`
   (the `erm` penalty with one batch per head and `risk_reduction="mean"`).
4. The representation is the synthesis featurizer; the downstream head is **the average of the K
   heads** (`average_heads`).

Stopping (`bonsai.stopping`): "fixed" runs every phase for its step count, as the reference's
scripts do. "validation" holds out a keyed 10 % of the pooled set (never trained on), scores each
phase on it every `val_every` steps and keeps the phase's best weights: round 0 by accuracy, RERM
rounds by their worst group's accuracy (the earlier rounds' groups restricted to the hold-out), the
synthesis by the heads' mean pseudo-label accuracy. TH A.9.2 says the reference's step counts were
chosen "to maximise IID validation performance in each round"; this applies that rule per restart.
The best weights so far are the phase's `train_loop` companion, so a resumed phase keeps its choice.

The representation is expensive (about a thousand full-batch steps) and the same for every downstream
method of one restart, so `cached_representation` keeps it in `<cache>/bonsai/<key>.safetensors`
(`owai.io.cache_root()`; the key hashes every setting it depends on: dataset, seed, data settings,
steps, width, lr, l2); a study's Bonsai and Bonsai-cf points of one seed build it once.

Every phase is a stage of `owai.train.train_loop` with Adam(lr) and the explicit L2 of spec §0, so a
killed run resumes inside the phase it was in, and a finished phase is reloaded from its final
checkpoint (its predictions are recomputed from the reloaded weights, which is deterministic).
Every model starts from the same seed (`derive_seed(seed, "init")`, the downstream model's), so,
as in the reference, the rounds, the synthesis model and a `rand` run share their initial
featurizer weights for one restart. The resampling uses `generator(seed, "bonsai", "balance")`
instead of the reference's numpy state.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from owai.data.colored_mnist import ColoredMNIST, variant
from owai.errors import OwaiError
from owai.methods.invariance import EnvBatch, make_penalty
from owai.models.mlp import ColoredMNISTMLP, MLPConfig
from owai.runs import Run
from owai.runtime import derive_seed, generator
from owai.train import BestWeights, LoopConfig, train_loop

# spec §3.1 step counts: (round 0 ERM, rounds >= 1 RERM, synthesis)
STEPS = {"coloredmnist": (51, 501, 501), "inverse-coloredmnist": (151, 401, 501)}


@dataclass
class BonsaiConfig:
    rounds: int = 2  # discovery rounds: round 0 = ERM, rounds 1.. = RERM (the thesis's 2-Bonsai)
    erm_steps: int | None = None  # None = 51 (ColoredMNIST) / 151 (Inverse)
    rerm_steps: int | None = None  # None = 501 / 401
    synthesis_steps: int | None = None  # None = 501
    # L2 of every Bonsai phase. None = the dataset's reference value (0.0011; 1e-4 on Inverse),
    # whatever `train.l2` the downstream run uses: the reference builds the representation once and
    # the thesis's ERM rows search their L2 grid downstream of it (Table A.12).
    l2: float | None = None
    # "fixed": every phase runs its step count (the reference's scripts). "validation": a keyed
    # `val_fraction` of the pooled training set is held out, each phase is evaluated on it every
    # `val_every` steps and keeps its best weights (TH A.9.2: the step counts were "chosen to maximise
    # IID validation performance in each round"): round 0 by accuracy, RERM rounds by worst-group
    # accuracy over the earlier rounds' groups, the synthesis by the heads' mean pseudo-label accuracy.
    stopping: Literal["fixed", "validation"] = "fixed"
    val_fraction: float = 0.1
    val_every: int = 10


@dataclass
class Representation:
    """What the synthesis leaves: the featurizer's state and the averaged head."""

    featurizer: dict[str, torch.Tensor]
    head_weight: torch.Tensor  # (1, hidden) = mean of the K heads' weights
    head_bias: torch.Tensor  # (1,)
    heads_weight: torch.Tensor  # (K, hidden), the synthesis heads
    heads_bias: torch.Tensor  # (K,)
    details: dict[str, Any] = field(default_factory=dict)


def steps_for(dataset: str, cfg: BonsaiConfig) -> tuple[int, int, int]:
    erm, rerm, syn = STEPS[variant(dataset).family]
    return (cfg.erm_steps if cfg.erm_steps is not None else erm,
            cfg.rerm_steps if cfg.rerm_steps is not None else rerm,
            cfg.synthesis_steps if cfg.synthesis_steps is not None else syn)


def check_config(cfg: BonsaiConfig) -> None:
    if cfg.rounds < 1:
        raise OwaiError(f"bonsai.rounds must be >= 1, got {cfg.rounds}")
    for name in ("erm_steps", "rerm_steps", "synthesis_steps"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise OwaiError(f"bonsai.{name} must be >= 1, got {value}")
    if not 0 < cfg.val_fraction < 1:
        raise OwaiError(f"bonsai.val_fraction must be in (0, 1), got {cfg.val_fraction}")
    if cfg.val_every < 1:
        raise OwaiError(f"bonsai.val_every must be >= 1, got {cfg.val_every}")


# --- the pieces -------------------------------------------------------------------------------------
def round_groups(corrects: list[torch.Tensor]) -> list[torch.Tensor]:
    """The 2k RERM groups of round k from the correctness vectors of rounds 0..k-1: for each earlier
    round j, [incorrect_j, correct_j] as boolean masks over the pooled training set."""
    groups = []
    for correct in corrects:
        correct = correct.bool()
        groups += [~correct, correct]
    return groups


def agreement_mask(corrects: list[torch.Tensor]) -> torch.Tensor:
    """A = every round right or every round wrong (<=> every round predicts the same label)."""
    n_right = torch.stack([c.bool() for c in corrects]).sum(0)
    return (n_right == len(corrects)) | (n_right == 0)


def balanced_indices(agree: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The balance trick: N/2 indices drawn with replacement from A, N - N/2 from not-A (N = len).
    If one side is empty, all N are drawn from the other (nothing to balance)."""
    n = len(agree)
    sides = [torch.nonzero(agree).reshape(-1), torch.nonzero(~agree).reshape(-1)]
    sides = [s for s in sides if len(s)]
    counts = [n // 2, n - n // 2] if len(sides) == 2 else [n]
    return torch.cat([s[torch.randint(len(s), (c,), generator=gen)] for s, c in zip(sides, counts)])


def average_heads(weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The downstream head: w = mean_k w_k (1, d), b = mean_k b_k (1,)."""
    return weight.mean(0, keepdim=True), bias.mean(0, keepdim=True)


# --- the pipeline -----------------------------------------------------------------------------------
def fresh_mlp(seed_parts: tuple, hidden: int, n_targets: int, device: str) -> ColoredMNISTMLP:
    """A new MLP whose initial weights are a function of `seed_parts` (torch's global seed is set)."""
    torch.manual_seed(derive_seed(*seed_parts))
    return ColoredMNISTMLP(MLPConfig(hidden=hidden, n_targets=n_targets)).to(device)


def train_phase(run: Run, stage: str, model: ColoredMNISTMLP, steps: int, lr: float, l2: float, pen: Any,
           batches: Any, checkpoint_every: int, log_every: int,
           validate: Any = None, val_every: int = 10) -> dict[str, Any]:
    """One full-batch phase (Adam, the penalty's objective with explicit L2) through the shared loop
    (also PI's stage models and the perfect initialisation in `owai.methods.coloredmnist`). With `validate` (model -> score), the phase is scored every
    `val_every` steps and at its end, and finishes with its best-scoring weights."""
    params = model.trainable_parameters()
    optimizer = torch.optim.Adam(params, lr=lr)
    best = BestWeights() if validate is not None else None

    def loss_at(step: int, micro: int = 0) -> torch.Tensor:
        reg = pen.l2(l2, model.featurizer.parameters(), model.head.parameters())
        return pen.objective(batches(), step, params=params, l2=reg).loss

    def after_step(done: int) -> None:
        if done % val_every == 0 or done == steps:
            with torch.no_grad():
                score = float(validate(model))
            run.log(stage, done, val_score=score)
            best.offer(score, done, model)

    loop = LoopConfig(steps, checkpoint_every=min(checkpoint_every, steps), log_every=min(log_every, steps))
    train_loop(run, stage, model, optimizer, loss_at, loop, after_step=after_step if best else None, companion=best)
    if best is None:
        return {"steps": steps}
    model.load_state_dict(best.state)
    return {"steps": steps, "best_step": best.step, "val_score": round(best.value, 4)}


def build_representation(run: Run, data: ColoredMNIST, dataset: str, cfg: BonsaiConfig, *, seed: int,
                         hidden: int, lr: float, l2: float, device: str, checkpoint_every: int = 100,
                         log_every: int = 10) -> Representation:
    """Run (or reload from the run's stages) the discovery rounds and the synthesis."""
    erm_steps, rerm_steps, syn_steps = steps_for(dataset, cfg)
    x = torch.cat([e.x for e in data.train]).to(device)
    y = torch.cat([e.y for e in data.train]).to(device)
    n = len(y)
    fit = torch.ones(n, dtype=torch.bool, device=device)  # the examples the phases train on
    if cfg.stopping == "validation":  # a keyed hold-out of the pooled set scores every phase
        held = torch.randperm(n, generator=generator(seed, "bonsai", "validation"))[: max(1, round(cfg.val_fraction * n))]
        fit[held.to(device)] = False
    val = ~fit

    def accuracy_on(model: ColoredMNISTMLP, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((model(x[mask]).reshape(-1) > 0).to(y.dtype) == target[mask]).float().mean()

    corrects, pseudos, rounds = [], [], []
    for k in range(cfg.rounds):
        model = fresh_mlp((seed, "init"), hidden, 1, device)
        if k == 0:
            pen, steps = make_penalty("erm"), erm_steps
            masks = [fit]

            def score(model: ColoredMNISTMLP) -> torch.Tensor:
                return accuracy_on(model, val, y)
        else:
            pen, steps = make_penalty("rerm"), rerm_steps
            groups = round_groups(corrects)
            masks = [m & fit for m in groups if (m & fit).any()]  # an empty group has no loss
            val_groups = [m & val for m in groups if (m & val).any()]

            def score(model: ColoredMNISTMLP, val_groups=val_groups) -> torch.Tensor:  # worst-group accuracy
                return torch.stack([accuracy_on(model, m, y) for m in val_groups]).min()

        def batches(model=model, masks=masks):
            logits = model(x)
            return [EnvBatch(logits[m], y[m]) for m in masks]

        phase = train_phase(run, f"bonsai.round{k}", model, steps, lr, l2, pen, batches, checkpoint_every, log_every,
                       validate=score if cfg.stopping == "validation" else None, val_every=cfg.val_every)
        with torch.no_grad():
            pred = (model(x).reshape(-1) > 0).to(y.dtype)
        corrects.append(pred == y)
        pseudos.append(pred)
        rounds.append({"round": k, **phase, "train_acc": round(float(corrects[-1][fit].float().mean()), 4)})

    agree = agreement_mask(corrects)
    fit_idx = torch.nonzero(fit).reshape(-1)
    idx = fit_idx[balanced_indices(agree[fit], generator(seed, "bonsai", "balance")).to(device)]
    targets_all = torch.stack(pseudos, 1)  # (n, K)
    xs, targets = x[idx], targets_all[idx]
    K = cfg.rounds
    model = fresh_mlp((seed, "init"), hidden, K, device)

    def syn_batches():
        logits = model(xs)
        return [EnvBatch(logits[:, k], targets[:, k]) for k in range(K)]

    def syn_score(model: ColoredMNISTMLP) -> torch.Tensor:  # the heads' mean pseudo-label accuracy
        return ((model(x[val]) > 0).to(y.dtype) == targets_all[val]).float().mean()

    phase = train_phase(run, "bonsai.synthesis", model, syn_steps, lr, l2, make_penalty("erm", risk_reduction="mean"),
                   syn_batches, checkpoint_every, log_every,
                   validate=syn_score if cfg.stopping == "validation" else None, val_every=cfg.val_every)
    w, b = model.head.weight.detach().clone(), model.head.bias.detach().clone()
    hw, hb = average_heads(w, b)
    details = {"rounds": rounds, "synthesis": phase, "synthesis_steps": syn_steps, "stopping": cfg.stopping,
               "agree_fraction": round(float(agree[fit].float().mean()), 4)}
    return Representation(
        featurizer={k: v.detach().clone() for k, v in model.featurizer.state_dict().items()},
        head_weight=hw, head_bias=hb, heads_weight=w, heads_bias=b, details=details,
    )


def init_from(model: ColoredMNISTMLP, rep: Representation) -> None:
    """Load the Bonsai featurizer and the averaged head into a one-logit downstream model."""
    model.featurizer.load_state_dict(rep.featurizer)
    with torch.no_grad():
        model.head.weight.copy_(rep.head_weight)
        model.head.bias.copy_(rep.head_bias)


def representation_key(dataset: str, cfg: BonsaiConfig, **settings: Any) -> str:
    """A hash of everything the representation depends on (cache file name)."""
    erm, rerm, syn = steps_for(dataset, cfg)
    spec = {"dataset": dataset, "rounds": cfg.rounds, "steps": [erm, rerm, syn], **settings, "format": 1}
    if cfg.stopping != "fixed":  # (fixed-step representations keep the keys they always had)
        spec["stopping"] = {"rule": cfg.stopping, "val_fraction": cfg.val_fraction, "val_every": cfg.val_every}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached_representation(run: Run, data: ColoredMNIST, dataset: str, cfg: BonsaiConfig, *, seed: int, hidden: int,
                          lr: float, l2: float, device: str, checkpoint_every: int = 100, log_every: int = 10,
                          data_key: dict[str, Any] | None = None) -> Representation:
    """`build_representation`, through the cache: a hit loads the tensors, a miss builds the
    representation in the run's stages and writes the cache file atomically."""
    from owai.io import build_lock, cache_root, read_cache_entry, write_cache_entry

    key = representation_key(dataset, cfg, seed=seed, hidden=hidden, lr=lr, l2=l2, data=data_key or {})
    path = cache_root() / "bonsai" / f"{dataset}-seed{seed}-{key}.safetensors"

    def representation(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> dict[str, Any]:
        """The entry's fields, on the CPU (a device's error is not a damaged entry)."""
        fields = ("head_weight", "head_bias", "heads_weight", "heads_bias")
        return dict(featurizer={k.removeprefix("featurizer."): v for k, v in tensors.items() if k.startswith("featurizer.")},
                    **{name: tensors[name] for name in fields}, details={**json.loads(meta["details"]), "cache": str(path)})

    with build_lock(path, ready=path.is_file):  # a study's workers build a seed's representation once
        entry = read_cache_entry(path, representation)
        if entry is not None:
            on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
            on_device["featurizer"] = {k: v.to(device) for k, v in entry["featurizer"].items()}
            return Representation(**on_device)
        rep = build_representation(run, data, dataset, cfg, seed=seed, hidden=hidden, lr=lr, l2=l2, device=device,
                                   checkpoint_every=checkpoint_every, log_every=log_every)
        tensors = {f"featurizer.{k}": v for k, v in rep.featurizer.items()}
        tensors.update(head_weight=rep.head_weight, head_bias=rep.head_bias, heads_weight=rep.heads_weight,
                       heads_bias=rep.heads_bias)
        write_cache_entry(path, tensors, {"details": json.dumps(rep.details)})
    rep.details["cache"] = str(path)
    return rep
