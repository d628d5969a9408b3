"""RegBench in-context language learning (thesis sec 3.5, Fig 3.10, Table B.3; Akyurek et al. 2024).

One run = one sequence model at one grid point and one training-set size, trained and tested the
way seq_icl does it (shared/specs/evals.md sec 3.3):

    data     `owai.data.regbench`: one sequence of 10-19 strings per random PFA; disjoint train,
             val and test automata (or, `data.iid`, new sequences of the training automata)
    train    AdamW (betas 0.9/0.999, decay on every parameter) at batch 32 for 200 epochs, linear
             warmup from 1e-6 over 20 epochs, timm cosine to 0.1 x lr, gradients clipped at 1.0 for
             the Memory Mosaic (its ICLL config) and not for seq_icl's models (`grad_clip_of`), through the
             shared loop `owai.train.train_loop` (checkpoints, resume)
    select   after every epoch the validation loss (mean over non-separator targets); the best
             epoch's weights are kept (checkpoints/best) and tested: "epochs in {1..200}"
    test     accuracy and the L1 "TVD" (+ tvd_half = L1/2) against the exact PFA distributions,
             `eval.positions` all (the published figures) or last-string (the thesis wording)

The architectures (`arch`) come from the shared zoo: `mm` (Memory Mosaics v1 as the Memory
Mosaics repo plugs it into seq_icl), `transformer` (GPT2 with learned positions, seq_icl's
`lm_simple` settings), `lstm` (seq_icl's `lm_simple_noffn` LSTM as it computes), and `ngram`, the
in-context 3-gram with backoff, which is not trained. The grid search over sizes and
hyper-parameters, with selection by validation loss, is a sweep (`owai eval regbench`, `owai sweep
fig3.10-regbench`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from owai import console
from owai.config import BaseConfig
from owai.data.regbench import IGNORE_INDEX, RegBenchConfig, RegBenchData, RegBenchSplit
from owai.errors import OwaiError
from owai.methods import Method, Outcome
from owai.runs import Run
from owai.runtime import generator


@dataclass(frozen=True)
class SequenceModel:
    """How RegBench builds one architecture: the zoo entry and its seq_icl defaults."""

    label: str
    zoo: str | None  # owai.models.zoo.ARCHITECTURES key; None = nothing to train (the n-gram)
    defaults: dict[str, Any]  # zoo config settings for RegBench (overridden by `model.*`)
    settings: tuple[str, ...]  # the `model.*` keys it accepts


# Adding a sequence model: register it in owai.models.zoo.ARCHITECTURES, then add one entry here.
SEQUENCE_MODELS: dict[str, SequenceModel] = {
    # ICLL/configs/experiment/dfa/mm.yaml: n_embd 128, 8 heads, 2 layers, pmem 3.5 C, dropout 0.05,
    # the Library's init and logits / sqrt(C)
    "mm": SequenceModel(
        "Memory Mosaic", "mm",
        dict(n_layer=2, n_head=8, n_embd=128, ic_dropout=0.05, hd_dropout=0.05, bias=False, init="library", logit_scale="inv_sqrt_dim"),
        ("n_layer", "n_head", "n_embd", "dropout", "init", "logit_scale"),
    ),
    # seq_icl lm_simple + MHA: learned absolute positions, 4x FFN with tanh GELU, biases, dropout 0.1 on
    # the embeddings and attention weights, none on the residual branches (resid_dropout 0)
    "transformer": SequenceModel(
        "Transformer", "gpt", dict(n_layer=2, n_head=8, n_embd=128, dropout=0.1, resid_dropout=0.0, bias=True,
                                   position="learned"),
        ("n_layer", "n_head", "n_embd", "dropout"),
    ),
    # seq_icl lm_simple_noffn + LSTMLayer, as it computes: one LSTM on the embeddings (its forward feeds
    # every layer the embeddings and keeps the last, so its embedding dropout never reaches the output),
    # Keras's init, the embedding matrix as the head
    "lstm": SequenceModel("LSTM", "lstm", dict(n_layer=1, n_embd=128, dropout=0.0, tie_word_embeddings=True,
                                               head_bias=False, init="keras"), ("n_layer", "n_embd", "dropout")),
    "ngram": SequenceModel("3-gram", None, {}, ()),
}


@dataclass
class ModelConfig:
    """Settings of the chosen architecture; None keeps its RegBench default (SEQUENCE_MODELS)."""

    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    dropout: float | None = None  # MM: ic_dropout = hd_dropout
    init: Literal["library", "nano"] | None = None  # MM only
    logit_scale: Literal["inv_sqrt_dim", "none"] | None = None  # MM only


@dataclass
class TrainConfig:
    epochs: int = 200
    batch_size: int = 32
    lr: float = 5e-4
    min_lr_ratio: float = 0.1  # cosine floor = min_lr_ratio x lr
    warmup_epochs: int | None = None  # None = ceil(epochs / 10), the reference's
    warmup_lr: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.1
    # all: every parameter, as seq_icl's Lightning module (one AdamW group; its dfa configs set no
    # optimizer_param_grouping); matrices: tensors with >= 2 dims only (nanoGPT's rule)
    decay_scope: Literal["all", "matrices"] = "all"
    # None: each family's official setting, clipping at 1 for the Memory Mosaic (MemoryMosaics'
    # ICLL mm.yaml) and none for the others (seq_icl's trainer: gradient_clip_val 0); 0 = no clipping
    grad_clip: float | None = None
    eval_every: int = 1  # epochs between validations (and best-checkpoint updates)
    checkpoint_every: int = 10  # epochs between resumable checkpoints
    log_every: int = 10  # updates between loss log lines


@dataclass
class EvalConfig:
    positions: Literal["all", "last-string"] = "all"  # "all" = the published figures
    batch_size: int = 32
    ngram_order: int = 3


@dataclass
class Config(BaseConfig):
    seed: int = 0
    arch: str = "mm"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: RegBenchConfig = field(default_factory=lambda: RegBenchConfig(num_test_examples=1000))
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def grad_clip_of(cfg: Config) -> float:
    """The gradient-norm clip of this run: train.grad_clip, else its family's official one (1.0 for
    the Memory Mosaic's ICLL plug-in, 0 = none for seq_icl's models)."""
    if cfg.train.grad_clip is not None:
        return cfg.train.grad_clip
    return 1.0 if cfg.arch == "mm" else 0.0


def sequence_model(arch: str) -> SequenceModel:
    if arch not in SEQUENCE_MODELS:
        raise OwaiError(f"unknown RegBench model {arch!r} (known: {', '.join(SEQUENCE_MODELS)})")
    return SEQUENCE_MODELS[arch]


def max_input_length(data: RegBenchConfig) -> int:
    """The longest possible model input: max strings x max length + separators, minus the last token."""
    strings = data.max_num_in_context_examples - 1
    return strings * (data.max_len_per_example - 1) + (strings - 1) - 1


def zoo_settings(cfg: Config) -> dict[str, Any]:
    """The zoo config of `cfg.arch`: RegBench defaults <- `model.*` <- the vocabulary and context."""
    spec = sequence_model(cfg.arch)
    kw = dict(spec.defaults)
    for key in spec.settings:
        value = getattr(cfg.model, key)
        if value is None:
            continue
        if key == "dropout" and cfg.arch == "mm":
            kw.update(ic_dropout=value, hd_dropout=value)
        else:
            kw[key] = value
    kw["vocab_size"] = cfg.data.vocab_size
    if spec.zoo == "gpt":
        kw["block_size"] = max_input_length(cfg.data)  # the learned position table covers any sequence
    return kw


class RegBench(Method):
    Config = Config
    cli = "owai eval regbench"
    one_run_command = False  # its subcommand runs the recipe's study, sweep or chain
    resume_overrides = ("train.lr", "train.grad_clip", "train.weight_decay")

    @staticmethod
    def unused_settings(cfg: Config) -> dict[str, str]:
        """The training settings of the in-context n-gram (nothing to train), and its order for the
        trained models. (A `model.*` setting the architecture lacks is refused by `validate`.)"""
        if cfg.arch == "ngram":
            return {"train": "settings of the trained models (--model mm / transformer / lstm); --model ngram, the "
                             "in-context n-gram, trains nothing"}
        return {"eval.ngram_order": f"the order of --model ngram, the in-context n-gram; this run's is --model {cfg.arch}"}

    @staticmethod
    def validate(cfg: Config) -> None:
        from owai import distributed

        if distributed.launched_by_torchrun():
            raise OwaiError("a RegBench run is one small model on one device; run grid points side by side with "
                            "owai sweep --workers N or --executor slurm, not torchrun")
        spec = sequence_model(cfg.arch)
        for key in (f.name for f in dataclasses.fields(ModelConfig)):
            if getattr(cfg.model, key) is not None and key not in spec.settings:
                has = ", ".join(spec.settings) or "none: it has no hyper-parameters"
                raise OwaiError(f"model.{key}: the {cfg.arch} model has no setting {key!r} (its settings: {has})")
        t = cfg.train
        for name in ("epochs", "batch_size", "eval_every", "checkpoint_every", "log_every"):
            if getattr(t, name) < 1:
                raise OwaiError(f"train.{name} must be >= 1, got {getattr(t, name)}")
        if not t.lr > 0 or not 0 < t.min_lr_ratio <= 1 or t.warmup_lr < 0 or len(t.betas) != 2:
            raise OwaiError("train: need lr > 0, 0 < min_lr_ratio <= 1, warmup_lr >= 0 and a pair of betas")
        if t.warmup_epochs is not None and not 0 <= t.warmup_epochs <= t.epochs:
            raise OwaiError(f"train.warmup_epochs must be in [0, train.epochs], got {t.warmup_epochs}")
        if cfg.eval.batch_size < 1 or cfg.eval.ngram_order < 1:
            raise OwaiError("eval.batch_size and eval.ngram_order must be >= 1")
        if not cfg.data.iid and cfg.data.num_test_examples < 2:
            raise OwaiError("data.num_test_examples must be >= 2 (half test, half validation automata)")
        if spec.zoo is not None:
            from owai.models.lm import lm_config

            lm_config(spec.zoo, **zoo_settings(cfg))  # sizes that do not fit (n_embd % n_head) fail here

    def run(self, cfg: Config, run: Run) -> Outcome:
        from owai.data.regbench import make_regbench
        from owai.evals.regbench import ngram_backoff_probs

        data = make_regbench(cfg.data)
        details: dict[str, Any] = {
            "arch": cfg.arch,
            "num_test_examples": data.num_test_examples,
            "train_sequences": len(data.train), "val_sequences": len(data.val), "test_sequences": len(data.test),
            "train_tokens": int(sum(len(s) - 1 for s in data.train.sequences)),
        }
        if data.num_examples != cfg.data.num_examples:
            console.info(f"only {data.num_candidates} candidate automata ({data.num_unique} languages): splits scaled "
                         f"to {data.num_examples} train / {data.num_test_examples} test+val, as seq_icl scales them")
        spec = sequence_model(cfg.arch)
        if spec.zoo is None:  # the in-context n-gram: nothing to train
            def predict(x: torch.Tensor) -> np.ndarray:
                return ngram_backoff_probs(x, cfg.data.vocab_size, cfg.data.sep_id, n=cfg.eval.ngram_order)

            measured = {"val_loss": split_loss(predict, data.val, cfg.eval.batch_size)}
            measured.update(test_metrics(predict, data.test, cfg.eval))
            measured["num_examples"] = data.num_examples
            return Outcome(measured, details)

        device = run.device
        model = build_model(cfg, device)
        details["parameters"] = model.num_parameters()
        console.info(f"{spec.label}: {model.num_parameters():,} parameters")
        best = train(cfg, run, model, data, device)
        model.load_state_dict(best["model"])
        model.eval()

        def predict(x: torch.Tensor) -> np.ndarray:
            with torch.no_grad():
                return torch.softmax(model(input_ids=x.to(device)).logits.float(), dim=-1).cpu().numpy()

        measured = {"val_loss": best["val_loss"], "selected_epoch": best["epoch"]}
        measured.update(test_metrics(predict, data.test, cfg.eval))
        measured["test_loss"] = split_loss(predict, data.test, cfg.eval.batch_size)
        measured["parameters"] = model.num_parameters()
        measured["num_examples"] = data.num_examples  # training automata (after any scale-down)
        return Outcome(measured, details)


# -- model and training -------------------------------------------------------------------------


def build_model(cfg: Config, device: torch.device) -> torch.nn.Module:
    from owai.models.lm import build_lm

    rng = torch.get_rng_state()
    torch.manual_seed(generator(cfg.seed, "init", cfg.arch).initial_seed())
    model = build_lm(sequence_model(cfg.arch).zoo, **zoo_settings(cfg))
    torch.set_rng_state(rng)
    return model.to(device)


def steps_per_epoch(cfg: Config, n_train: int) -> int:
    return math.ceil(n_train / cfg.train.batch_size)


def epoch_batch(split: RegBenchSplit, cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch `step` of the run: the epoch's shuffle (keyed by seed and epoch) cut into batches of
    `batch_size`, the last one smaller (Lightning's drop_last=False), padded to its longest input."""
    per_epoch = steps_per_epoch(cfg, len(split))
    epoch, i = divmod(step, per_epoch)
    order = torch.randperm(len(split), generator=generator(cfg.seed, "epoch", epoch))
    idx = order[i * cfg.train.batch_size : (i + 1) * cfg.train.batch_size].tolist()
    x, y, _ = split.torch_batch(idx)
    return x, y


def train(cfg: Config, run: Run, model: torch.nn.Module, data: RegBenchData, device: torch.device) -> dict[str, Any]:
    """Train through the shared loop; validate after every `eval_every` epochs and keep the best
    epoch's weights in checkpoints/best (resumable). Returns {"model", "val_loss", "epoch"}."""
    from owai.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from owai.evals.lm import validation_loss
    from owai.models.lm import adamw
    from owai.optim import warmup_cosine_schedule
    from owai.train import LoopConfig, train_loop

    t = cfg.train
    per_epoch = steps_per_epoch(cfg, len(data.train))
    total = per_epoch * t.epochs
    warmup_epochs = math.ceil(t.epochs / 10) if t.warmup_epochs is None else t.warmup_epochs
    lr_at = warmup_cosine_schedule(t.lr, per_epoch * warmup_epochs, total, t.min_lr_ratio * t.lr,
                                   start_lr=t.warmup_lr, cosine_after_warmup=False)
    optimizer = adamw(model, lr=t.lr, betas=(t.betas[0], t.betas[1]), weight_decay=t.weight_decay, scope=t.decay_scope)

    def loss_at(step: int, micro: int) -> torch.Tensor:
        x, y = epoch_batch(data.train, cfg, step)
        logits = model(input_ids=x.to(device)).logits
        return F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(), ignore_index=IGNORE_INDEX)

    val_batches = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y, _ in _batches(data.val, cfg.eval.batch_size)]
    best_dir = run.checkpoints("best")
    last = latest_checkpoint(best_dir)
    best: dict[str, Any] = {"val_loss": math.inf, "epoch": 0}
    if last is not None:  # a resumed run: epochs replayed after its checkpoint give the same losses
        _, stored = load_checkpoint(last)
        best = {"val_loss": stored["val_loss"], "epoch": stored["epoch"]}

    def after_step(done: int) -> None:
        epoch, rest = divmod(done, per_epoch)
        if rest or (epoch % t.eval_every and epoch != t.epochs):
            return
        val = validation_loss(model, val_batches, device)
        run.log("train", done, epoch=epoch, val_loss=val)
        if val < best["val_loss"]:
            best.update(val_loss=val, epoch=epoch)
            state = {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, "val_loss": val, "epoch": epoch}
            save_checkpoint(best_dir, epoch, state, keep=1)

    loop = LoopConfig(steps=total, checkpoint_every=min(per_epoch * t.checkpoint_every, total),
                      log_every=min(t.log_every, total), grad_clip=grad_clip_of(cfg))
    train_loop(run, "train", model, optimizer, loss_at, loop, lr_at=lr_at, after_step=after_step)
    last = latest_checkpoint(best_dir)
    if last is None:
        raise OwaiError("regbench: the validation loss was never finite; lower train.lr")
    _, stored = load_checkpoint(last)
    return {"model": stored["model"], "val_loss": float(stored["val_loss"]), "epoch": int(stored["epoch"])}


# -- evaluation ---------------------------------------------------------------------------------


def _batches(split: RegBenchSplit, batch_size: int):
    for i in range(0, len(split), batch_size):
        yield split.batch(range(i, min(i + batch_size, len(split))))


def test_metrics(predict, split: RegBenchSplit, ev: EvalConfig) -> dict[str, float]:
    """accuracy, "tvd" (= L1) and tvd_half over every counted position of the split (pooled)."""
    from owai.evals.regbench import regbench_metrics

    acc = tvd = 0.0
    n_acc = n_tvd = 0
    for x, _, pfas in _batches(split, ev.batch_size):
        m = regbench_metrics(predict(torch.from_numpy(x)), x, pfas, positions=ev.positions)
        if m["num_accuracy_positions"]:
            acc += m["accuracy"] * m["num_accuracy_positions"]
            n_acc += m["num_accuracy_positions"]
        if m["num_tvd_positions"]:
            tvd += m["tvd"] * m["num_tvd_positions"]
            n_tvd += m["num_tvd_positions"]
    l1 = tvd / max(n_tvd, 1)
    return {"accuracy": acc / max(n_acc, 1), "tvd": l1, "tvd_half": l1 / 2}


NGRAM_PROB_FLOOR = 1e-6  # the n-gram gives probability 0 to symbols unseen in context


def split_loss(predict, split: RegBenchSplit, batch_size: int) -> float:
    """Mean cross-entropy over the non-separator targets of a split, from predicted probabilities
    (floored at NGRAM_PROB_FLOOR, which only matters for the n-gram)."""
    total, count = 0.0, 0
    for x, y, _ in _batches(split, batch_size):
        p = np.asarray(predict(torch.from_numpy(x)), dtype=np.float64)
        keep = y != IGNORE_INDEX
        picked = np.take_along_axis(p, np.where(keep, y, 0)[..., None], axis=-1)[..., 0]
        total += float(-np.log(np.maximum(picked[keep], NGRAM_PROB_FLOOR)).sum())
        count += int(keep.sum())
    return total / max(count, 1)


# -- the study: selected cells of a sweep, the thesis's numbers beside them, Fig 3.10 -------------

STUDY_NAME = "regbench"  # regbench.json, regbench.md, figures/regbench.png
STUDY_METRICS = ("accuracy", "tvd", "tvd_half", "val_loss", "selected_epoch", "parameters")


def test_selected(summary: dict[str, Any], per: list[str]) -> dict[str, dict[str, Any]]:
    """seq_icl's notebook's reading of a sweep: per group of `per` values, the best test accuracy and,
    separately, the best test L1 over the grid's cells (each may come from a different cell). It
    selects on the test set, so it is optimistic; owai's rows select on validation loss and show
    this beside them, to set published numbers read that way beside owai's. Keyed as
    `select_cells`'s groups (the `per` values, JSON)."""
    import json

    from owai.recipes import Selection
    from owai.sweep import select_cells

    best: dict[str, dict[str, Any]] = {}
    for metric, mode in (("accuracy", "max"), ("tvd", "min")):
        picked = select_cells(summary.get("groups") or [], Selection(metric=metric, mode=mode, per=per))
        for group in picked["groups"]:
            best.setdefault(json.dumps(list(group["key"].values())), {})[metric] = group["score"]
    return best


def study_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (architecture, training size): the grid cell selected by validation loss, its
    test numbers (mean over seeds), the best test numbers over the cells (`test_selected`) and the
    thesis's numbers for that architecture and size."""
    import json

    from owai.recipes import sub_grids

    selection = summary.get("selection")
    if not selection:
        raise OwaiError("this sweep has no selection (sweep.select in the recipe); it is not a RegBench study")
    searched = {k for g in sub_grids(summary["grid"]) for k, v in g.items() if len(v) > 1 and k not in selection["per"]}
    on_test = test_selected(summary, selection["per"])
    rows = []
    for group in selection["groups"]:
        metrics = {m["metric"]: m for m in group["metrics"]}
        key, cell = group["key"], group["grid"] or {}
        row: dict[str, Any] = {
            "arch": key.get("arch") or cell.get("arch", "?"),
            # the grid's size, as seq_icl's notebook labels a run by dataset.num_examples; the automata it
            # trained on after seq_icl's scale-down (100 with 1000 test automata: 90) beside it
            "num_examples": _count(key.get("data.num_examples", cell.get("data.num_examples"))
                                   if "data.num_examples" in {**cell, **key} else
                                   metrics["num_examples"]["mean"] if "num_examples" in metrics else None),
            "trained_on": _count(metrics["num_examples"]["mean"]) if "num_examples" in metrics else None,
            "cell": group["cell"],
            "selected": " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in cell.items() if k in searched),
            "candidates": group["candidates"],
            "seeds": metrics["accuracy"]["n"] if "accuracy" in metrics else 0,
        }
        for name in STUDY_METRICS:
            row[name] = metrics[name]["mean"] if name in metrics else None
        row["selected_epoch"], row["parameters"] = _count(row["selected_epoch"]), _count(row["parameters"])
        for name in ("accuracy", "tvd"):
            row[f"thesis_{name}"] = metrics[name]["thesis"] if name in metrics else None
            row[f"{name}_on_test"] = on_test.get(json.dumps(list(group["key"].values())), {}).get(name)
        rows.append(row)
    return rows


def _count(value: Any) -> Any:
    """A mean over seeds of an integer count prints as an integer when it is one."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _label(arch: str) -> str:
    return SEQUENCE_MODELS[arch].label if arch in SEQUENCE_MODELS else arch


def _automata(row: dict[str, Any]) -> str:
    """The row's training size, and the automata it trained on where seq_icl's scale-down changed it."""
    from owai.values import fmt

    size, trained = row.get("num_examples"), row.get("trained_on")
    return fmt(size) + (f" ({fmt(trained)} trained)" if trained is not None and trained != size else "")


def study_markdown(rows: list[dict[str, Any]], title: str, command: str) -> str:
    from owai.values import fmt, md_row

    lines = [f"### {title}", "", f"Command: `{command}`", "",
             "| model | train automata | accuracy | thesis | \"TVD\" (L1) | thesis | TVD (L1/2) | val loss | epoch | params | selected "
             "| best on test: accuracy / L1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(md_row([
            _label(r["arch"]), _automata(r), fmt(r["accuracy"]), fmt(r["thesis_accuracy"]), fmt(r["tvd"]),
            fmt(r["thesis_tvd"]), fmt(r["tvd_half"]), fmt(r["val_loss"]), fmt(r["selected_epoch"]),
            fmt(r["parameters"]), r["selected"] or "-", f"{fmt(r.get('accuracy_on_test'))} / {fmt(r.get('tvd_on_test'))}"]))
    lines += ["", "Each row's cell is selected by validation loss; \"best on test\" is the best test accuracy and, "
              "separately, the best test L1 over the searched cells, as seq_icl's results notebook reads a sweep "
              "(optimistic: selected on the test set)."]
    return "\n".join(lines) + "\n"


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


def study_table(rows: list[dict[str, Any]], title: str) -> Any:
    cells = [[_label(r["arch"]), _automata(r), _num(r["accuracy"]), _num(r["thesis_accuracy"]), _num(r["tvd"]),
              _num(r["thesis_tvd"]), _num(r["tvd_half"]), _num(r["val_loss"]), r["selected"] or ("-" if r["cell"] is None else "")]
             for r in rows]
    return console.text_table(title, ("model", "automata", "accuracy", "thesis", '"TVD" L1', "thesis", "TVD", "val loss", "selected"),
                              cells, left=("model", "selected"))


def plot_study(rows: list[dict[str, Any]], title: str) -> Any:
    """Fig 3.10's format: accuracy and "TVD" (L1) against the number of training automata (log x),
    one line per architecture; the thesis's numbers dashed with open markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    for i, arch in enumerate(archs):
        mine = sorted((r for r in rows if r["arch"] == arch and r["num_examples"] is not None), key=lambda r: r["num_examples"])
        color = f"C{i}"
        for ax, metric in zip(axes, ("accuracy", "tvd")):
            pts = [(r["num_examples"], r[metric]) for r in mine if r[metric] is not None]
            if pts:
                ax.plot(*zip(*pts), "o-", color=color, label=f"{_label(arch)} (owai)")
            ref = [(r["num_examples"], r[f"thesis_{metric}"]) for r in mine if r[f"thesis_{metric}"] is not None]
            if ref:
                ax.plot(*zip(*ref), "o--", color=color, mfc="none", label=f"{_label(arch)} (thesis)")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    sizes = sorted({r["num_examples"] for r in rows if r["num_examples"] is not None})
    for ax, name in zip(axes, ("accuracy", '"TVD" (L1 distance)')):
        ax.set_xscale("log")
        ax.set_xticks(sizes)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("# train environments")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def write_study(sweep: Any, summary: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """regbench.json, regbench.md and figures/regbench.png in the sweep directory (atomically)."""
    from owai.sweep import write_study_files

    rows = study_rows(summary)
    title = f"{sweep.recipe} [{sweep.preset}]: cell selected by min validation loss per model and size"
    command = f"owai eval regbench --resume {sweep.path}"
    figure = write_study_files(sweep, STUDY_NAME, title, rows, study_markdown(rows, title, command),
                               plot_study(rows, f"{sweep.recipe} [{sweep.preset}]"))
    return rows, {"title": title, "figure": str(figure)}
