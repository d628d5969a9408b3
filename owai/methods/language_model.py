"""Language-model pre-training and evaluation: Memory Mosaics v1 against GPT2 (thesis sec 3.5, App. B.2-B.4).

`LanguageModelPretraining` (`owai mosaic-train`) trains each architecture in `archs` on the same
mini-batches in the same order (batches are keyed by (seed, step), not by the architecture), as the
thesis does for Figs 3.8/B.4, then evaluates every trained model:
    validation loss (Fig 3.8, Table B.2), per-position loss (Fig 3.9), the last token's attention
    at the training context and at `attention_multiples` x it (Figs B.5-B.7), and continuations of
    Eldan & Li's 24 prompts, greedy and beam-2 (Tables B.4/B.5).
Each trained model is saved with `save_pretrained` under models/<arch>/ (with its tokenizer
spec), which `owai mosaic-eval` reads back.

`LanguageModelEvaluation` (`owai mosaic-eval`, `owai eval posloss`) runs the same evaluations on
saved models.

Training goes through `owai.train.train_loop` (AdamW with decay groups, warmup + cosine to min_lr,
clipping, accumulation, bf16/fp16 autocast, DDP/FSDP under torchrun, checkpoint/resume).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from owai import console, distributed
from owai.config import BaseConfig
from owai.errors import OwaiError
from owai.methods import Method, Outcome
from owai.runs import Run
from owai.runtime import generator

ARCH_LABELS = {"mm": "Memory Mosaic", "gpt": "GPT2 transformer", "gpt-rope": "GPT2 + RoPE", "gpt-alibi": "GPT2 + ALiBi"}
POSITION_VARIANTS = ("learned", "rope", "alibi", "none")


def parse_arch(label: str) -> tuple[str, dict[str, Any]]:
    """An `archs` entry: a zoo architecture ("mm", "gpt"), or "gpt-<position>" for a GPT whose
    position encoding differs from model.position (Fig B.6 compares gpt-rope and gpt-alibi)."""
    from owai.models.lm import ARCHITECTURES

    if label in ARCHITECTURES:
        return label, {}
    base, _, variant = label.partition("-")
    if base == "gpt" and variant in POSITION_VARIANTS:
        return "gpt", {"position": variant}
    raise OwaiError(f"archs: unknown architecture {label!r} (known: {', '.join(ARCHITECTURES)}, gpt-rope, gpt-alibi, gpt-none)")


@dataclass
class ModelConfig:
    """Shared by every architecture in `archs`; the thesis's GPT2-small setting by default."""

    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    dropout: float = 0.05  # MM: ic_dropout = hd_dropout; GPT: its single dropout
    bias: bool = False
    vocab_size: int = 0  # 0 = the tokenizer's vocabulary rounded up to a multiple of 64
    position: Literal["learned", "rope", "alibi", "none"] = "learned"  # GPT only
    pmem_size: int = 0  # MM persistent slots per head; 0 = 3.5 n_embd (GPT2 parameter parity)
    init: Literal["library", "nano"] = "library"  # MM init scheme (docs/decisions.md)
    logit_scale: Literal["inv_sqrt_dim", "none"] = "inv_sqrt_dim"  # MM: Library's logits / sqrt(C), or nano's none


@dataclass
class DataConfig:
    source: str = "owai-stories"  # the embedded corpus, a hub id, or a local path (txt/jsonl/parquet/7z/dir)
    tokenizer: str = "bpe-4096"  # gpt2 (hub), bytes, bpe-N (trained locally), or a tokenizer dir
    text_field: str = "text"
    block_size: int = 512  # training context
    workers: int = 0  # tokenisation processes; 0 = all cores
    root: str = ""  # explicit data root for named corpora and relative paths (--data-root); "" = $OWAI_DATA, the cache


@dataclass
class TrainConfig:
    steps: int = 80000
    batch_size: int = 8  # sequences per micro-batch per process
    accumulate: int = 1  # micro-batches per update; global batch = batch_size x accumulate x ranks
    lr: float = 5e-3
    min_lr: float = 1e-4
    warmup: int = 2000
    decay_steps: int = 0  # end of the cosine; 0 = steps
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    precision: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    parallel: Literal["ddp", "fsdp"] = "ddp"
    compile: bool = False
    eval_every: int = 2000
    eval_batches: int = 10
    checkpoint_every: int = 1000
    log_every: int = 10


@dataclass
class EvalConfig:
    source: str = ""  # per-position-loss data; "" = the training data's validation split (Fig 3.9: wikipedia)
    config_name: str = ""  # hub dataset configuration, e.g. 20220301.simple
    posloss_windows: int = 256
    val_batches: int = 50  # final validation-loss batches
    attention_sequences: int = 5000  # Figs B.5/B.6 average over 5000 validation sequences
    attention_multiples: list[int] = field(default_factory=lambda: [1, 3])  # contexts of k x block_size
    continuations: bool = True
    max_new_tokens: int = 48
    batch_size: int = 8


@dataclass
class Config(BaseConfig):
    seed: int = 1337
    archs: list[str] = field(default_factory=lambda: ["mm", "gpt"])
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


class LanguageModelPretraining(Method):
    Config = Config
    cli = "owai mosaic-train"
    resume_overrides = ("train.lr", "train.min_lr", "train.grad_clip", "train.weight_decay")

    @staticmethod
    def validate(cfg: Config) -> None:
        for label in cfg.archs:
            parse_arch(label)
        if not cfg.archs or len(set(cfg.archs)) != len(cfg.archs):
            raise OwaiError("archs: give one or more distinct architectures")
        from owai.data.text import LocalSource, check_tokenizer, open_source

        check_tokenizer(cfg.data.tokenizer)  # a bad bpe-N or an unreachable hub id fails here, at once
        _validate_common(cfg)
        source = open_source(cfg.data.source, cfg.data.text_field, data_root=cfg.data.root or None)
        if isinstance(source, LocalSource):
            source.check_nonempty()  # an empty or blank corpus fails before any run directory
        t = cfg.train
        for name in ("steps", "batch_size", "accumulate", "eval_every", "eval_batches", "checkpoint_every", "log_every"):
            if getattr(t, name) < 1:
                raise OwaiError(f"train.{name} must be >= 1, got {getattr(t, name)}")
        if not 0 < t.min_lr <= t.lr:
            raise OwaiError(f"train.min_lr must be in (0, train.lr], got {t.min_lr}")
        if t.warmup < 0 or len(t.betas) != 2:
            raise OwaiError("train.warmup must be >= 0 and train.betas a pair")
        if any(parse_arch(a) == ("gpt", {}) for a in cfg.archs) and cfg.model.position == "learned":
            too_long = [k for k in cfg.eval.attention_multiples if k > 1]
            if too_long:
                console.info(
                    f"note: the learned-position GPT cannot run beyond block_size; its attention at {too_long} x block_size is skipped"
                )

    def run(self, cfg: Config, run: Run) -> Outcome:
        data = prepare_data(cfg.data, cfg.eval)
        device = run.device
        measured: dict[str, Any] = {}
        details: dict[str, Any] = {"tokenizer": data.tokenizer.name, "train_tokens": data.train.n_tokens, "val_tokens": data.val.n_tokens}
        curves: dict[str, Any] = {}
        for arch in cfg.archs:
            model = build_model(cfg, arch, data.tokenizer.vocab_size, device)
            details[f"{arch}.parameters"] = model.num_parameters()
            console.info(f"{ARCH_LABELS.get(arch, arch)}: {model.num_parameters():,} parameters")
            summary, model = train_model(cfg, run, arch, model, data, device)
            save_model(run, arch, model, data)
            measured[f"{arch}.train_loss"] = summary["final_loss"]
            ev = evaluate_model(cfg.eval, run, arch, model, data, device)
            measured.update({f"{arch}.{k}": v for k, v in ev.measured.items()})
            details.update({f"{arch}.{k}": v for k, v in ev.details.items()})
            curves[arch] = [r for r in run.metrics() if r.get("stage") == arch]
        if {"mm", "gpt"} <= set(cfg.archs):
            measured["val_loss_gpt_minus_mm"] = measured["gpt.val_loss"] - measured["mm.val_loss"]
        if distributed.is_main():
            plot_training_curves(run, curves, cfg)
            plot_posloss(run, {a: details.get(f"{a}.posloss") for a in cfg.archs}, cfg.data.block_size)
        return Outcome(measured, details)


# -- data ---------------------------------------------------------------------------------------


@dataclass
class LMData:
    tokenizer: Any
    train: Any  # TokenWindows
    val: Any
    posloss: Any  # TokenWindows of the per-position-loss data (val unless eval.source is set)


def prepare_data(data: DataConfig, ev: EvalConfig) -> LMData:
    """Tokenise the training source (rank 0 first; the other ranks then reuse its cache)."""
    from owai.data.text import load_tokenizer, prepare_tokens

    def build() -> LMData:
        tokenizer = load_tokenizer(data.tokenizer, source=data.source, text_field=data.text_field, data_root=data.root or None)
        prepared = prepare_tokens(data.source, tokenizer, workers=data.workers or None, text_field=data.text_field,
                                  data_root=data.root or None)
        train, val = prepared.windows("train", data.block_size), prepared.windows("val", data.block_size)
        posloss = val
        if ev.source:
            other = prepare_tokens(ev.source, tokenizer, workers=data.workers or None, text_field=data.text_field, config_name=ev.config_name or None,
                                   data_root=data.root or None)
            posloss = other.windows("val", data.block_size)
        return LMData(tokenizer, train, val, posloss)

    if distributed.world().world_size == 1:
        return build()
    result = build() if distributed.is_main() else None
    distributed.barrier()
    return result if result is not None else build()


def global_batch(windows: Any, cfg: Config, step: int, micro: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global micro-batch `micro` of update `step`.

    Every rank draws the same global batch (batch_size x world_size windows, keyed by seed, step
    and micro) and keeps its own rows, so 1 process and N processes train on identical data."""
    w = distributed.world()
    x, y = windows.batch(cfg.train.batch_size * w.world_size, generator(cfg.seed, "batch", step, micro))
    rows = slice(w.rank * cfg.train.batch_size, (w.rank + 1) * cfg.train.batch_size)
    return x[rows].to(device, non_blocking=True), y[rows].to(device, non_blocking=True)


def eval_batches(windows: Any, n: int, batch_size: int, seed: int, purpose: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` fixed random batches (the same at every evaluation, for every architecture)."""
    return [windows.batch(batch_size, generator(seed, purpose, i)) for i in range(n)]


# -- model and training -------------------------------------------------------------------------


def model_kwargs(cfg: Config, label: str, tokenizer_vocab: int) -> dict[str, Any]:
    arch, variant = parse_arch(label)
    m = cfg.model
    vocab = m.vocab_size or 64 * math.ceil(tokenizer_vocab / 64)
    kw: dict[str, Any] = dict(vocab_size=vocab, n_layer=m.n_layer, n_embd=m.n_embd, n_head=m.n_head, bias=m.bias)
    if arch == "mm":
        kw.update(ic_dropout=m.dropout, hd_dropout=m.dropout, init=m.init, logit_scale=m.logit_scale, pmem_size=m.pmem_size or None)
    elif arch == "gpt":
        kw.update(dropout=m.dropout, position=m.position, block_size=cfg.data.block_size)
    kw.update(variant)
    return kw


def build_model(cfg: Config, label: str, tokenizer_vocab: int, device: torch.device) -> torch.nn.Module:
    """The architecture at the configured size; initialised identically on every rank."""
    from owai.models.lm import build_lm, check_vocab

    rng = torch.get_rng_state()
    torch.manual_seed(generator(cfg.seed, "init", label).initial_seed())
    model = build_lm(parse_arch(label)[0], **model_kwargs(cfg, label, tokenizer_vocab))
    torch.set_rng_state(rng)
    check_vocab(model, tokenizer_vocab)
    return model.to(device)


def precision_for(name: str, device: torch.device) -> str:
    from owai.runtime import auto_precision

    if name == "auto":
        return auto_precision(name, device)
    if name != "float32" and device.type != "cuda":
        raise OwaiError(f"train.precision={name} needs a CUDA device (this run is on {device.type})")
    return name


def train_model(
    cfg: Config, run: Run, arch: str, model: torch.nn.Module, data: LMData, device: torch.device
) -> tuple[dict[str, Any], torch.nn.Module]:
    """Pre-train one architecture (stage `arch`) through the shared training loop; returns the
    loop's summary and the trained model as a plain (unsharded) module."""
    from owai.distributed import Parallel, unsharded
    from owai.evals.lm import validation_loss
    from owai.models.lm import blocks, decay_param_groups
    from owai.optim import warmup_cosine_schedule
    from owai.train import LoopConfig, train_loop

    t = cfg.train
    parallel = Parallel(model, t.parallel, blocks=blocks(model))
    groups = decay_param_groups(model, t.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.betas[0], t.betas[1]), fused=device.type == "cuda")
    forward = torch.compile(parallel.forward_module) if t.compile else parallel.forward_module
    world = distributed.world()

    def loss_at(step: int, micro: int) -> torch.Tensor:
        x, y = global_batch(data.train, cfg, step, micro, device)
        logits = forward(input_ids=x).logits
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    val = eval_batches(data.val, t.eval_batches, t.batch_size, cfg.seed, "val")
    train_probe = eval_batches(data.train, t.eval_batches, t.batch_size, cfg.seed, "train-eval")

    def after_step(done: int) -> None:
        if done % t.eval_every == 0 or done == t.steps:
            v = validation_loss(parallel.module, val, device)
            tr = validation_loss(parallel.module, train_probe, device)
            run.log(arch, done, val_loss=distributed.mean_across_ranks(v, device), train_eval_loss=distributed.mean_across_ranks(tr, device))

    loop = LoopConfig(
        steps=t.steps,
        checkpoint_every=min(t.checkpoint_every, t.steps),
        log_every=min(t.log_every, t.steps),
        grad_clip=t.grad_clip,
        accumulate=t.accumulate,
        precision=precision_for(t.precision, device),
        tokens_per_step=t.batch_size * t.accumulate * world.world_size * cfg.data.block_size,
    )
    lr_at = warmup_cosine_schedule(t.lr, t.warmup, t.decay_steps or t.steps, t.min_lr)
    summary = train_loop(run, arch, model, optimizer, loss_at, loop, lr_at=lr_at, after_step=after_step, parallel=parallel)
    return summary, unsharded(parallel, lambda: build_model(cfg, arch, data.tokenizer.vocab_size, device)).eval()


def save_model(run: Run, arch: str, model: torch.nn.Module, data: LMData) -> Path:
    """models/<arch>/: save_pretrained (safetensors) + the tokenizer spec, written atomically."""
    target = run.path / "models" / arch
    if distributed.is_main():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        tmp = target.with_name(f".{arch}.tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(data.tokenizer, tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    distributed.barrier()
    return target


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    """The tokenizer beside the weights: tokenizer.json (tokenizers format) when it has one, and
    owai_tokenizer.json naming it, so mosaic-eval needs neither the hub nor the training corpus."""
    from owai.io import atomic_write_json, atomic_write_text

    spec: dict[str, Any] = {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id}
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        atomic_write_text(directory / "tokenizer.json", backend.to_str())
        spec["file"] = "tokenizer.json"
    atomic_write_json(directory / "owai_tokenizer.json", spec)


def tokenizer_for(path: Path, default: str) -> str:
    """The tokenizer a saved model was trained with (see save_tokenizer), else `default`."""
    spec = read_tokenizer_spec(path)
    if spec.get("file") and (path / spec["file"]).is_file():
        return str(path / spec["file"])
    return spec.get("name", default)


# -- evaluation ---------------------------------------------------------------------------------


def evaluate_model(ev: EvalConfig, run: Run, label: str, model: torch.nn.Module, data: LMData, device: torch.device) -> Outcome:
    """Validation loss, per-position loss, attention profiles and continuations of one model."""
    from owai.evals import lm as lme
    from owai.models.lm import context_limit

    model.eval()
    block = data.val.block_size
    measured: dict[str, Any] = {}
    details: dict[str, Any] = {}
    val = eval_batches(data.val, ev.val_batches, ev.batch_size, 0, "final-val")
    measured["val_loss"] = lme.validation_loss(model, val, device)
    curve, n = lme.per_position_loss(model, data.posloss.sequential(max_windows=ev.posloss_windows, batch_size=ev.batch_size), device)
    details["posloss"] = curve
    details["posloss_windows"] = n
    measured["posloss_first50"] = lme.mean_over(curve, 0, 50)
    measured["posloss_after50"] = lme.mean_over(curve, 50)
    limit = context_limit(model)
    profiles = {}
    for k in ev.attention_multiples:
        length = k * block
        if limit is not None and length > limit:
            continue
        windows = data.val.with_block_size(length).sequential(max_windows=ev.attention_sequences, batch_size=ev.batch_size)
        profile, n_seq = lme.attention_profile(model, lme.only_inputs(windows), device)
        profiles[length] = profile
        details[f"attention_{length}"] = {"sequences": n_seq, "mean_over_heads": profile.mean(1).tolist()}
    lambdas = model.leaky_lambdas().tolist() if hasattr(model, "leaky_lambdas") else None
    if lambdas is not None:
        details["leaky_lambda"] = lambdas  # Fig B.7: per layer and head
    if distributed.is_main() and profiles:
        plot_attention(run, label, profiles, block, lambdas)
    if ev.continuations:
        rows = lme.continuations(model, data.tokenizer, lme.eldan_li_prompts(), device, ev.max_new_tokens)
        details["continuations"] = rows
        if distributed.is_main():
            write_continuations(run, label, rows)
    return Outcome(measured, details)


# -- figures and tables -------------------------------------------------------------------------


def plot_training_curves(run: Run, curves: dict[str, list[dict[str, Any]]], cfg: Config) -> None:
    """Fig 3.8 style: training and validation loss against iterations, one line per architecture."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for arch, rows in curves.items():
        train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        label = f"{ARCH_LABELS.get(arch, arch)} (Nb={cfg.model.n_layer})"
        if train:
            axes[0].plot(*zip(*train), label=label)
        if val:
            axes[1].plot(*zip(*val), marker="o", label=label)
    axes[0].set_title("training loss")
    axes[1].set_title("validation loss")
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.legend()
    axes[0].set_ylabel("loss")
    run.save_figure(fig, "training_curves")


def plot_posloss(run: Run, curves: dict[str, list[float] | None], block: int) -> None:
    """Fig 3.9 style: average loss at each position of the window."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arch, curve in curves.items():
        if curve:
            ax.plot(range(len(curve)), curve, label=ARCH_LABELS.get(arch, arch))
    ax.set_xlabel(f"position in the {block}-token window")
    ax.set_ylabel("average loss")
    ax.set_title("per-position loss")
    ax.legend()
    run.save_figure(fig, "posloss")


def plot_attention(run: Run, label: str, profiles: dict[int, torch.Tensor], block: int, lambdas: list[list[float]] | None = None) -> None:
    """Figs B.5/B.6 style: the last token's attention per head (solid) and head mean (dotted), per
    layer, at each context length; Mosaic heads are labelled with their leaky coefficient (B.7)."""
    import matplotlib.pyplot as plt

    for length, profile in profiles.items():
        n_layer = profile.shape[0]
        fig, axes = plt.subplots(1, n_layer, figsize=(5 * n_layer, 3.5), squeeze=False)
        for layer in range(n_layer):
            ax = axes[0, layer]
            for head in range(profile.shape[1]):
                name = f"head {head}" + (f", λ={lambdas[layer][head]:.2f}" if lambdas else "")
                ax.plot(profile[layer, head].numpy(), linewidth=0.8, label=name if lambdas else None)
            ax.plot(profile[layer].mean(0).numpy(), "k:", linewidth=1.5, label="mean over heads")
            if length > block:
                ax.axvline(length - block, color="grey", linewidth=0.5)
            ax.set_title(f"{ARCH_LABELS.get(label, label)}, layer {layer + 1}, context {length}")
            ax.set_xlabel("position")
            ax.set_yscale("log")
        axes[0, 0].set_ylabel("attention of the last token")
        axes[0, 0].legend(fontsize=7)
        run.save_figure(fig, f"attention_{label}_{length}")


def write_continuations(run: Run, label: str, rows: list[dict[str, str]]) -> None:
    """Tables B.4/B.5: a Markdown table of the prompts and the model's continuations."""
    from owai.io import atomic_write_bytes

    lines = [f"# Continuations, {ARCH_LABELS.get(label, label)}", "", "| prompt | greedy | beam 2 |", "|---|---|---|"]
    for r in rows:
        cells = [r["prompt"], r.get("greedy", ""), r.get("beam2", "")]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    atomic_write_bytes(run.path / f"continuations_{label}.md", ("\n".join(lines) + "\n").encode())


# -- evaluation of saved models -----------------------------------------------------------------


@dataclass
class EvalOnlyConfig(BaseConfig):
    models: list[str] = field(default_factory=list)  # save_pretrained dirs, or run dirs holding models/<arch>/
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


class LanguageModelEvaluation(Method):
    Config = EvalOnlyConfig
    cli = "owai mosaic-eval"

    @staticmethod
    def validate(cfg: EvalOnlyConfig) -> None:
        if not cfg.models:
            raise OwaiError("no model given: pass model directories (save_pretrained dirs or mosaic-train run dirs)")
        for path in cfg.models:
            for _, directory in model_dirs(Path(path)):
                check_context(directory, cfg.data.block_size)
        _validate_common(cfg)

    def run(self, cfg: EvalOnlyConfig, run: Run) -> Outcome:
        from owai.models.lm import check_vocab, load_pretrained

        measured: dict[str, Any] = {}
        details: dict[str, Any] = {}
        posloss: dict[str, Any] = {}
        for label, path in unique_labels([pair for root in cfg.models for pair in model_dirs(Path(root))]):
            data_cfg = DataConfig(**{**cfg.data.__dict__, "tokenizer": tokenizer_for(path, cfg.data.tokenizer)})
            data = prepare_data(data_cfg, cfg.eval)
            model = load_pretrained(path).to(run.device)
            check_vocab(model, data.tokenizer.vocab_size)
            ev = evaluate_model(cfg.eval, run, label, model, data, run.device)
            measured.update({f"{label}.{k}": v for k, v in ev.measured.items()})
            details.update({f"{label}.{k}": v for k, v in ev.details.items()})
            posloss[label] = ev.details.get("posloss")
        if distributed.is_main():
            plot_posloss(run, posloss, cfg.data.block_size)
        return Outcome(measured, details)


def unique_labels(found: list[tuple[str, Path]]) -> list[tuple[str, Path]]:
    """Labels of the models to evaluate, made unique (the "mm" of two runs: "<run>-mm", "<run>-mm")."""
    names = [label for label, _ in found]
    out: list[tuple[str, Path]] = []
    for i, (label, path) in enumerate(found):
        if names.count(label) > 1:
            label = f"{path.parent.parent.name}-{label}" if path.parent.name == "models" else label
        if label in {taken for taken, _ in out}:
            label = f"{label}-{i}"
        out.append((label, path))
    return out


def model_dirs(path: Path) -> list[tuple[str, Path]]:
    """(label, directory) of each saved model under `path`: a save_pretrained dir or a run dir."""
    if not path.exists():
        raise OwaiError(f"model path not found: {path}")
    if (path / "config.json").is_file():
        return [(path.name, path)]
    found = sorted(p for p in (path / "models").glob("*") if (p / "config.json").is_file()) if (path / "models").is_dir() else []
    if not found:
        raise OwaiError(f"{path} holds no saved model (no config.json, no models/<arch>/config.json)")
    return [(p.name, p) for p in found]


def check_context(directory: Path, block_size: int) -> None:
    """A learned-position GPT cannot read windows longer than its position table."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except ValueError:
        raise OwaiError(f"{directory / 'config.json'} is corrupt") from None
    if config.get("model_type") == "owai_gpt" and config.get("position") == "learned" and block_size > config.get("block_size", block_size):
        raise OwaiError(
            f"context of {block_size} tokens is longer than the learned position table of {directory} "
            f"(block_size={config['block_size']}); use a smaller --context"
        )


def read_tokenizer_spec(path: Path) -> dict[str, Any]:
    spec = path / "owai_tokenizer.json"
    if not spec.is_file():
        return {}
    try:
        return json.loads(spec.read_text())
    except ValueError:
        raise OwaiError(f"{spec} is corrupt") from None


def _validate_common(cfg: Any) -> None:
    from owai.data.text import open_source

    open_source(cfg.data.source, cfg.data.text_field, data_root=cfg.data.root or None)  # a missing path fails here, before any run directory
    if cfg.eval.source:
        open_source(cfg.eval.source, cfg.data.text_field, config_name=cfg.eval.config_name or None, data_root=cfg.data.root or None)
    if cfg.data.block_size < 2:
        raise OwaiError(f"data.block_size must be >= 2, got {cfg.data.block_size}")
    ev = cfg.eval
    for name in ("posloss_windows", "val_batches", "attention_sequences", "batch_size", "max_new_tokens"):
        if getattr(ev, name) < 1:
            raise OwaiError(f"eval.{name} must be >= 1, got {getattr(ev, name)}")
    if any(k < 1 for k in ev.attention_multiples):
        raise OwaiError("eval.attention_multiples must be positive integers")
    m = getattr(cfg, "model", None)
    if m is not None:
        if min(m.n_layer, m.n_embd, m.n_head) < 1 or m.n_embd % m.n_head:
            raise OwaiError(f"model: n_embd ({m.n_embd}) must be a positive multiple of n_head ({m.n_head}), n_layer >= 1")
        if not 0 <= m.dropout < 1:
            raise OwaiError(f"model.dropout must be in [0, 1), got {m.dropout}")
        if m.vocab_size:  # an explicit vocabulary must hold the tokenizer's
            from owai.data.text import load_tokenizer

            tokenizer = load_tokenizer(cfg.data.tokenizer, source=cfg.data.source, text_field=cfg.data.text_field,
                                       data_root=cfg.data.root or None)
            if tokenizer.vocab_size > m.vocab_size:
                raise OwaiError(
                    f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {m.vocab_size} "
                    f"(set model.vocab_size >= {tokenizer.vocab_size}, or 0 for the tokenizer's size)"
                )
