"""Chapter 4's task claims at a laptop's scale: in-context recall and classification (issue #38).

`RecallPretraining` (`owai recipes run table4.4-recall`) is the chapter-4 LM pre-training of
`owai.methods.language_model` (same models, sizes, training loop, data, saved models) on a mixture
of real text and episodes (`owai.data.recall`): a share `episodes.fraction` of every batch's rows
are recall or in-context classification episodes planted in the training split's text, the rest
plain text windows. Both architectures see the same rows. Then, for each trained model, on
episodes planted in the validation split's text (the same episodes for every model):

    recall        exact-match recall at each of `recall.lengths` (1x, 4x, 8x the training
                  context), per distance bucket (near < 256 = v2's short-term window <= mid <
                  training length <= far), and again with v2's long-term memory off (Table C.1)
    in-context    accuracy per label kind (semantic, anonymous) and number of demonstrations per
                  class at each length (Figs 4.6-4.9, Table 4.6)

Metrics, each length named by its multiple of the training context (`scale`: 512 -> "1x", 4096 ->
"8x" at block 512): `{arch}.recall.{scale}` (all queries), `{arch}.recall.{scale}.{bucket}`,
`{arch}.recall_no_ltm...`, `{arch}.icl.{labels}.{scale}.{shots}shot`, `{arch}.val_loss` (text),
`recall.chance`, `icl.chance`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from owai import console, distributed
from owai.errors import OwaiError
from owai.methods import Outcome
from owai.methods.language_model import (ARCH_LABELS, Config as LMConfig, LanguageModelPretraining, LMData, check_memory,
                                         eval_batches, mean_loss, parallel_model, prepare_data, save_model, train_model)
from owai.runs import Run
from owai.runtime import derive_seed, generator

LABEL_KINDS = ("semantic", "anonymous")


@dataclass
class EpisodeConfig:
    """The training mixture and the episodes' shape (owai.data.recall)."""

    fraction: float = 0.5  # share of each batch's rows that are episodes (the rest: text windows)
    icl_share: float = 0.5  # of the episodes, the share of in-context classification (the rest: recall)
    max_facts: int = 8  # recall: 1..max_facts facts per training episode
    value_digits: int = 2  # recall: values of this many digits (chance 1 / (9 x 10^(digits-1)))
    window: int = 256  # the `near` bucket's bound: v2's short-term window
    classes: int = 4  # in-context classification: classes per episode (chance 1 / classes)
    items_per_class: int = 8  # invented items per class
    max_shots: int = 8  # training: 1..max_shots demonstrations per class
    queries_per_class: int = 1  # training: classification queries per class (distinct items; evaluation asks one)


@dataclass
class RecallEvalConfig:
    lengths: list[int] = field(default_factory=lambda: [512, 2048, 4096])  # 1x, 4x, 8x the training context
    episodes: int = 16  # recall episodes per length
    queries_per_bucket: int = 2  # facts per distance bucket in each recall episode
    shots: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # demonstrations per class
    icl_episodes: int = 8  # classification episodes per (labels, length, shots)
    batch_size: int = 4
    without_long_term: bool = True  # mmv2: recall again with the long-term memory off (Table C.1)
    val_batches: int = 8  # text validation-loss batches
    probe_episodes: int = 8  # at each training evaluation, recall and accuracy at 1x on this many episodes (0: none)


@dataclass
class Config(LMConfig):
    episodes: EpisodeConfig = field(default_factory=EpisodeConfig)
    recall: RecallEvalConfig = field(default_factory=RecallEvalConfig)


class RecallPretraining(LanguageModelPretraining):
    Config = Config
    cli = "owai recipes run table4.4-recall"

    @staticmethod
    def validate(cfg: Config) -> None:
        LanguageModelPretraining.validate(cfg)
        e, r = cfg.episodes, cfg.recall
        for name in ("max_facts", "window", "items_per_class", "max_shots", "queries_per_class"):
            if getattr(e, name) < 1:
                raise OwaiError(f"episodes.{name} must be >= 1, got {getattr(e, name)}")
        if e.classes < 2:
            raise OwaiError(f"episodes.classes must be >= 2, got {e.classes}")
        if not e.window < cfg.data.block_size:
            raise OwaiError(f"episodes.window ({e.window}) must be below data.block_size ({cfg.data.block_size})")
        for name in ("episodes", "queries_per_bucket", "icl_episodes", "batch_size", "val_batches"):
            if getattr(r, name) < 1:
                raise OwaiError(f"recall.{name} must be >= 1, got {getattr(r, name)}")
        if not r.lengths or min(r.lengths) < cfg.data.block_size:
            raise OwaiError(f"recall.lengths must be contexts of >= data.block_size ({cfg.data.block_size}), got {r.lengths}")
        if not r.shots or min(r.shots) < 1:
            raise OwaiError(f"recall.shots must be numbers of demonstrations >= 1, got {r.shots}")
        if cfg.data.documents:
            raise OwaiError("data.documents must be false: an episode's facts and queries would fall in different documents")
        if cfg.data.stream:
            raise OwaiError("data.stream is not supported by the recall mixture (it plants episodes in token windows)")
        # every episode shape the run will build, on a stand-in tokenizer of one token per 3 characters
        # (a small BPE's rate), so settings that cannot fit fail here, before any run directory; the run
        # builds them again with the real tokenizer before training
        _episode_shapes(cfg, lambda text: list(range(-(-len(text) // 3))), np.zeros(max(r.lengths), dtype=np.int64))

    def run(self, cfg: Config, run: Run) -> Outcome:
        from owai.data.recall import Pieces

        check_memory(cfg)
        data = prepare_data(cfg.data, cfg.eval, run, cfg.seed)
        pieces = Pieces(data.tokenizer.encode, cfg.episodes.value_digits)
        device = run.device
        _episode_shapes(cfg, data.tokenizer.encode, data.train.with_block_size(max(cfg.recall.lengths)).data[:max(cfg.recall.lengths)])
        suite = evaluation_episodes(cfg, data, pieces)
        measured: dict[str, Any] = {"recall.chance": 1 / pieces.n_values, "icl.chance": 1 / cfg.episodes.classes}
        details: dict[str, Any] = {"tokenizer": data.tokenizer.name, "train_tokens": data.train.n_tokens,
                                   "episodes": {k: len(v) for k, v in suite.items()}}
        for arch in cfg.archs:
            parallel = parallel_model(cfg, arch, data.tokenizer.vocab_size, device)
            details[f"{arch}.parameters"] = sum(p.numel() for p in parallel.module.parameters())
            console.info(f"{ARCH_LABELS.get(arch, arch)}: {details[f'{arch}.parameters']:,} parameters")
            summary = train_model(cfg, run, arch, parallel, data, device, batches=mixture(cfg, data, pieces),
                                  probe=lambda model: learning_probe(cfg, model, suite, device))
            save_model(run, arch, parallel, data)
            model = parallel.module.eval()
            details[f"{arch}.final_step_loss"] = summary["final_loss"]  # training mode, the last steps (as mosaic-train)
            ev = evaluate(cfg, model, data, suite, device)
            measured.update({f"{arch}.{k}": v for k, v in ev.measured.items()})
            details.update({f"{arch}.{k}": v for k, v in ev.details.items()})
            # each model's scores in metrics.jsonl as soon as they exist (a long cpu run shows its first model early);
            # a resume evaluates a model again: its row replaces the one logged before the kill
            step = summary.get("steps", 0)
            run.trim_metrics(f"{arch}-eval", step - 1)
            run.log(f"{arch}-eval", step, **{k: v for k, v in ev.measured.items()})
        if distributed.is_main():
            plot(run, cfg, measured)
        return Outcome(measured, details)


def scale(length: int, block: int) -> str:
    """A length as the metrics name it: its multiple of the training context ("4x"), else the length."""
    return f"{length // block}x" if length % block == 0 else str(length)


# -- episodes -----------------------------------------------------------------------------------


def eval_buckets(cfg: Config, length: int) -> list[str]:
    """The distance buckets a recall episode of `length` tokens holds, queries_per_bucket each:
    near and mid always; far (past the training length) when the episode is at least twice it."""
    names = ["near", "mid"] + (["far"] if length >= 2 * cfg.data.block_size else [])
    return [n for n in names for _ in range(cfg.recall.queries_per_bucket)]


def _episode_shapes(cfg: Config, encode: Callable[[str], list[int]], filler: np.ndarray) -> None:
    """Build the largest episode of each kind once (validation of the settings)."""
    from owai.data.recall import Pieces, icl_episode, recall_episode

    e, r = cfg.episodes, cfg.recall
    pieces = Pieces(encode, e.value_digits)
    rng = np.random.default_rng(0)
    block = cfg.data.block_size
    try:
        if e.fraction > 0 and e.icl_share < 1:
            recall_episode(rng, pieces, filler, block + 1, None, e.max_facts, e.window, block)
        if e.fraction > 0 and e.icl_share > 0:
            icl_episode(rng, pieces, filler, block + 1, e.max_shots, "anonymous", e.classes, e.items_per_class,
                        e.classes * e.queries_per_class)
        for length in r.lengths:
            recall_episode(rng, pieces, filler, length, eval_buckets(cfg, length), 0, e.window, block)
            icl_episode(rng, pieces, filler, length, max(r.shots), "anonymous", e.classes, e.items_per_class, e.classes)
    except OwaiError as err:
        raise OwaiError(f"episodes do not fit: {err}") from None


def mixture(cfg: Config, data: LMData, pieces: Any) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of the training batch of (step, micro): text windows, then episodes planted
    in other windows of the training split; all keyed by (seed, step, micro), the same for every
    architecture and on resume."""
    from owai.data.recall import training_episode

    e, block = cfg.episodes, cfg.data.block_size
    world = distributed.world()
    rows = cfg.train.batch_size * world.world_size
    n_episodes = int(round(rows * e.fraction))

    def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = []
        if rows - n_episodes:
            x, y = data.train.batch(rows - n_episodes, generator(cfg.seed, "batch", step, micro))
            parts.append(torch.cat([x, y[:, -1:]], 1))
        if n_episodes:
            fx, fy = data.train.batch(n_episodes, generator(cfg.seed, "filler", step, micro))
            filler = torch.cat([fx, fy[:, -1:]], 1).numpy()
            rng = np.random.default_rng(derive_seed(cfg.seed, "episodes", step, micro))
            episodes = [training_episode(rng, pieces, filler[i], block + 1, e.icl_share, e.max_facts, e.max_shots, e.classes,
                                         e.items_per_class, e.queries_per_class).tokens for i in range(n_episodes)]
            parts.append(torch.from_numpy(np.stack(episodes)))
        full = torch.cat(parts, 0)
        mine = full[world.rank * cfg.train.batch_size:(world.rank + 1) * cfg.train.batch_size]
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()

    return batch


def evaluation_episodes(cfg: Config, data: LMData, pieces: Any) -> dict[str, list[Any]]:
    """The fixed evaluation episodes, planted in the validation split's text: "recall/{L}" and
    "icl/{labels}/{L}/{shots}" -> episodes (the same for every architecture)."""
    from owai.data.recall import icl_episode, recall_episode

    e, r, block = cfg.episodes, cfg.recall, cfg.data.block_size
    suite: dict[str, list[Any]] = {}

    def filler(length: int, *key: object) -> np.ndarray:
        return data.val.with_block_size(length).batch(1, generator(cfg.seed, "recall-filler", length, *key))[0][0].numpy()

    for length in r.lengths:
        rng = np.random.default_rng(derive_seed(cfg.seed, "recall-eval", length))
        suite[f"recall/{length}"] = [recall_episode(rng, pieces, filler(length, "recall", i), length, eval_buckets(cfg, length),
                                                    0, e.window, block) for i in range(r.episodes)]
        for labels in LABEL_KINDS:
            for shots in r.shots:
                rng = np.random.default_rng(derive_seed(cfg.seed, "icl-eval", labels, length, shots))
                suite[f"icl/{labels}/{length}/{shots}"] = [
                    icl_episode(rng, pieces, filler(length, "icl", labels, shots, i), length, shots, labels, e.classes,
                                e.items_per_class, e.classes) for i in range(r.icl_episodes)]
    return suite


# -- evaluation ---------------------------------------------------------------------------------


def evaluate(cfg: Config, model: torch.nn.Module, data: LMData, suite: dict[str, list[Any]], device: torch.device) -> Outcome:
    """Recall by length and bucket (and without the long-term memory), classification accuracy by
    labels, length and shots, and the text validation loss, of one trained model."""
    from owai.evals.recall import accuracy_by_group, score

    r = cfg.recall
    # batches of the global training batch's rows (train.batch_size is per rank): the same batches,
    # split among the ranks, whatever the number of processes
    rows = cfg.train.batch_size * distributed.world().world_size
    measured: dict[str, Any] = {"val_loss": mean_loss(model, eval_batches(data.val, r.val_batches, rows, 0, "final-val"), device)}
    details: dict[str, Any] = {}
    ablations = [""]
    if r.without_long_term and getattr(model.config, "long_term_memory", False):
        ablations.append("_no_ltm")
    for suffix in ablations:
        if suffix:
            model.config.long_term_memory = False  # the evaluation's ablation: weights untouched
        try:
            for length in r.lengths:
                episodes = suite[f"recall/{length}"]
                correct = score(model, episodes, device, max(1, r.batch_size * cfg.data.block_size // length))
                for group, (acc, n) in accuracy_by_group(episodes, correct).items():
                    name = f"recall{suffix}.{scale(length, cfg.data.block_size)}" + ("" if group == "all" else f".{group}")
                    measured[name] = acc
                    details[f"{name}.n"] = n
                details[f"recall{suffix}.{scale(length, cfg.data.block_size)}.queries"] = [
                    {"distance": q.distance, "bucket": q.group, "correct": ok}
                    for ep, marks in zip(episodes, correct) for q, ok in zip(ep.queries, marks)]
        finally:
            if suffix:
                model.config.long_term_memory = True
    for key, episodes in suite.items():
        if not key.startswith("icl/"):
            continue
        _, labels, length, shots = key.split("/")
        correct = score(model, episodes, device, max(1, r.batch_size * cfg.data.block_size // int(length)))
        groups = accuracy_by_group(episodes, correct)
        name = f"icl.{labels}.{scale(int(length), cfg.data.block_size)}.{shots}shot"
        measured[name] = groups["all"][0]
        details[name] = {g: {"acc": a, "n": n} for g, (a, n) in groups.items()}
    return Outcome(measured, details)


def learning_probe(cfg: Config, model: torch.nn.Module, suite: dict[str, list[Any]], device: torch.device) -> dict[str, float]:
    """At each training evaluation: recall and classification (the most shots, anonymous labels) at
    the training length, on the first `recall.probe_episodes` evaluation episodes (a learning curve
    in metrics.jsonl: when, if ever, the tasks are learnt)."""
    from owai.evals.recall import accuracy_by_group, score

    r, block = cfg.recall, cfg.data.block_size
    out: dict[str, float] = {}
    if not r.probe_episodes or block not in r.lengths:
        return out
    for name, key in (("recall_1x", f"recall/{block}"), ("icl_anonymous_1x", f"icl/anonymous/{block}/{max(r.shots)}")):
        episodes = suite[key][:r.probe_episodes]
        out[name] = accuracy_by_group(episodes, score(model, episodes, device, r.batch_size))["all"][0]
    return out


def plot(run: Run, cfg: Config, measured: dict[str, Any]) -> None:
    """Recall against the distance bucket (v2 without long-term memory dotted) and accuracy against
    shots for each label kind; one line per model and length (1x / 4x / 8x)."""
    import matplotlib.pyplot as plt

    r, block = cfg.recall, cfg.data.block_size
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    styles = ["-", "--", "-."]
    colors = {"mmv2": "tab:blue", "transformer": "tab:orange"}
    for arch in cfg.archs:
        for k, length in enumerate(r.lengths):
            for suffix, marker in (("", "o"), ("_no_ltm", "x")):
                xs = [b for b in ("near", "mid", "far") if f"{arch}.recall{suffix}.{scale(length, block)}.{b}" in measured]
                if not xs:
                    continue
                label = f"{ARCH_LABELS.get(arch, arch)}{' without long-term memory' if suffix else ''}, {scale(length, block)}"
                axes[0].plot(xs, [measured[f"{arch}.recall{suffix}.{scale(length, block)}.{b}"] for b in xs], styles[k % 3] if not suffix else ":",
                             marker=marker, color=colors.get(arch), alpha=1 - 0.25 * k, label=label)
            for ax, labels in zip(axes[1:], LABEL_KINDS):
                ys = [measured.get(f"{arch}.icl.{labels}.{scale(length, block)}.{s}shot") for s in r.shots]
                ax.plot(r.shots, ys, styles[k % 3], marker="o", color=colors.get(arch), alpha=1 - 0.25 * k,
                        label=f"{ARCH_LABELS.get(arch, arch)}, {scale(length, block)}")
    axes[0].axhline(measured["recall.chance"], color="grey", linewidth=0.8)
    axes[0].set_title(f"recall by distance (near < {cfg.episodes.window} <= mid < {block} <= far)")
    axes[0].set_ylabel("exact-match recall")
    for ax, labels in zip(axes[1:], LABEL_KINDS):
        ax.axhline(measured["icl.chance"], color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(r.shots, [str(n) for n in r.shots])
        ax.set_xlabel("demonstrations per class")
        ax.set_title(f"in-context classification, {labels} labels")
    axes[1].set_ylabel("accuracy")
    for ax in axes:
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=6)
    run.save_figure(fig, "recall")
