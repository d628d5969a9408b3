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
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from owai import console, distributed
from owai.config import MAX_CONTEXT, MAX_LAYERS, BaseConfig, check_count
from owai.errors import CannotRunHere, DataMissing, OwaiError, one_line
from owai.methods import Method, Outcome
from owai.models.zoo import DOCUMENT_MASKED, SIZED
from owai.runs import Run, model_dirs
from owai.runtime import generator

ARCH_LABELS = {"mm": "Memory Mosaic", "gpt": "GPT2 transformer", "gpt-rope": "GPT2 + RoPE", "gpt-alibi": "GPT2 + ALiBi",
               "mmv2": "Memory Mosaics v2", "transformer": "Transformer (Llama)"}
POSITION_VARIANTS = ("learned", "rope", "alibi", "none")


def parse_arch(label: str) -> tuple[str, dict[str, Any]]:
    """An `archs` entry: a zoo architecture ("mm", "gpt"), or "gpt-<position>" for a GPT whose
    position encoding differs from model.position (Fig B.6 compares gpt-rope and gpt-alibi)."""
    from owai.models.zoo import ARCHITECTURES

    if label in ARCHITECTURES:
        return label, {}
    base, _, variant = label.partition("-")
    if base == "gpt" and variant in POSITION_VARIANTS:
        return "gpt", {"position": variant}
    raise OwaiError(f"archs: unknown architecture {label!r} (known: {', '.join(ARCHITECTURES)}, gpt-rope, gpt-alibi, gpt-none)")


@dataclass
class ModelConfig:
    """Shared by every architecture in `archs`; the thesis's GPT2-small setting by default.

    Chapter 4's architectures (mmv2, transformer) take `size` (owai.models.sizes: tiny, small,
    large), else n_layer / n_embd / n_head / ffn_hidden; the fields after `ffn_hidden` are theirs.
    The dimensions hold what the run builds once the config is made (`__post_init__`): a size's, or
    what was given, else GPT2-small's 12 / 768 / 12, so a resolved config never shows one model's
    widths beside another's size (issue #40)."""

    n_layer: int | None = None  # None: the size's, else 12
    n_embd: int | None = None  # None: the size's, else 768
    n_head: int | None = None  # None: the size's, else 12
    dropout: float = 0.05  # MM: ic_dropout = hd_dropout; GPT: its single dropout
    # MM: the contextual memory's attention dropout; None = dropout (Library regular), 0 = the eft
    # model that trained the thesis's BabiStories runs (the paper presets)
    contextual_dropout: float | None = None
    bias: bool = False
    vocab_size: int = 0  # 0 = the tokenizer's vocabulary rounded up to a multiple of 64
    position: Literal["learned", "rope", "alibi", "none"] = "learned"  # GPT only
    pmem_size: int = 0  # MM persistent slots per head; 0 = 3.5 n_embd (GPT2 parameter parity)
    init: Literal["library", "nano"] = "library"  # MM init scheme (docs/decisions.md)
    logit_scale: Literal["inv_sqrt_dim", "none"] = "inv_sqrt_dim"  # MM: Library's logits / sqrt(C), or nano's none
    size: str = ""  # mmv2 / transformer: tiny, small or large (Table 4.2); "" = the fields above and ffn_hidden
    init_from: str = ""  # a saved model directory (models/<arch>) whose weights start training (context extension)
    ffn_hidden: int = 0  # mmv2 / transformer SwiGLU width; 0 = 3 n_embd
    n_kv_head: int = 0  # transformer: key/value heads (GQA); 0 = n_head (MHA, the thesis's)
    rope_theta: float = 500000.0  # transformer (Llama-3)
    long_term_memory: bool = True  # mmv2
    short_window: int = 256  # mmv2 h
    long_delay_train: list[int] = field(default_factory=lambda: [64, 256])  # mmv2 m ~ U[min, max] per update
    long_delay_eval: int = 64  # mmv2 m at inference
    bag_of_k: int = 0  # mmv2: k of the bag-of-k objective (Table 4.8); 0 = next-token loss only
    bag_weight: float = 0.3
    bag_eta: float = 64000.0

    def __post_init__(self) -> None:
        from owai.models.sizes import SIZES

        if not self.size:
            for key, value in GPT2_SMALL.items():
                if getattr(self, key) is None:
                    setattr(self, key, value)
            return
        if self.size not in SIZES:
            raise OwaiError(f"model.size must be one of {', '.join(SIZES)} (or empty), got {self.size!r}")
        if (self.n_layer, self.n_embd, self.n_head, self.ffn_hidden) == (*GPT2_SMALL.values(), 0):
            self.n_layer = self.n_embd = self.n_head = None  # a config written before #40 stored the defaults beside its size
        dims = SIZES[self.size]
        for key in ("n_layer", "n_embd", "n_head", "ffn_hidden"):
            value = getattr(self, key)
            if value is not None and value != dims[key] and not (key == "ffn_hidden" and value == 0):  # ffn_hidden 0: the default
                raise OwaiError(f"model.size={self.size} has {key}={dims[key]}, not model.{key}={value}: drop model.{key}, "
                                f"or set model.size='' and give every width")
            setattr(self, key, dims[key])


# ModelConfig's dimensions without a size (the thesis's GPT2-small setting)
GPT2_SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12}


@dataclass
class DataConfig:
    source: str = "owai-stories"  # the embedded corpus, a hub id, or a local path (txt/jsonl/parquet/7z/dir)
    tokenizer: str = "bpe-4096"  # gpt2 (hub), bytes, bpe-N (trained locally), or a tokenizer dir
    text_field: str = "text"
    block_size: int = 512  # training context
    workers: int = 0  # tokenisation processes; 0 = this process, the tokenizer's own threads on all cores
    root: str = ""  # explicit data root for named corpora and relative paths (--data-root); "" = $OWAI_DATA, the cache
    val_every: int = 100  # without a validation split, every val_every-th document is validation
    documents: bool = False  # document-wise masking: models read nothing across the eot between documents
    stream: bool = False  # read the source as a stream (hub ids: no download first), packed by owai.data.packing
    shuffle_buffer: int = 0  # stream: documents in the seeded shuffle pool (0 = the source's order)
    stream_val_tokens: int = 1000000  # stream: tokens of the validation split kept for the evaluations
    # stream: micro-batches a thread prepares ahead while the model computes (owai.data.packing.Prefetcher);
    # 0 = none; auto: 4 on a GPU, none on a CPU (there the thread would take the cores of torch's own threads)
    prefetch: int | Literal["auto"] = "auto"


@dataclass
class TrainConfig:
    steps: int = 80000
    tokens: int = 0  # > 0: train on this many tokens (steps = tokens / global batch tokens, rounded up)
    batch_size: int = 8  # sequences per micro-batch per process
    accumulate: int = 1  # micro-batches per update; global batch = batch_size x accumulate x ranks
    global_batch: int = 0  # > 0: sequences per update on any number of ranks (accumulate = global_batch / (batch_size x ranks))
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
    activation_checkpointing: bool = False  # recompute each block in the backward pass
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
    # also the loss on as many fixed training windows, in eval mode: Table B.2's training loss (the
    # reference's estimate_loss "train"); off under `owai mosaic-eval --posloss-only`
    train_loss: bool = True
    attention_sequences: int = 5000  # Figs B.5/B.6 average over 5000 validation sequences
    attention_multiples: list[int] = field(default_factory=lambda: [1, 3])  # contexts of k x block_size
    continuations: bool = True
    max_new_tokens: int = 48
    batch_size: int = 8
    lengths: list[int] = field(default_factory=list)  # per-position loss also at these contexts (extrapolation)
    without_long_term: bool = False  # mmv2: every loss again with the long-term memory off (Table C.1)


@dataclass
class Config(BaseConfig):
    seed: int = 1337
    archs: list[str] = field(default_factory=lambda: ["mm", "gpt"])
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def data_root_unused(data: DataConfig, evaluation: EvalConfig, tokenizer: str | None) -> dict[str, str]:
    """{"data.root": why} when no input of the run is looked up under the data root: the corpora are
    the embedded owai-stories, `hf:` ids or absolute paths, and the tokenizer (None: the models' own)
    is bytes, bpe-N or an absolute path (a catalogue name or a relative path would be looked up)."""
    from owai.data.text import looks_under_data_root

    if any(looks_under_data_root(spec) for spec in (data.source, evaluation.source, tokenizer or "")):
        return {}
    named = [f"corpus {data.source}"] + ([f"evaluation corpus {evaluation.source}"] if evaluation.source else [])
    named += [f"tokenizer {tokenizer}"] if tokenizer is not None else []
    return {"data.root": f"no input of this run is looked up under a data root (--data-root): {', '.join(named)}"}


STREAM_SETTINGS = ("data.prefetch", "data.shuffle_buffer", "data.stream_val_tokens")  # read with data.stream only


def evaluation_corpus_unused(evaluation: EvalConfig) -> dict[str, str]:
    """{"eval.config_name": why} when no evaluation corpus (eval.source, --dataset) is named: the
    configuration is that corpus's, and was dropped without one."""
    if evaluation.source:
        return {}
    return {"eval.config_name": "the hub configuration of eval.source (--dataset), and no evaluation corpus is named"}


class LanguageModelPretraining(Method):
    Config = Config
    cli = "owai mosaic-train"
    # data.prefetch changes no batch (only when the next one is read): a GPU run resumed on a CPU, or the
    # reverse, may set it
    resume_overrides = ("train.lr", "train.min_lr", "train.grad_clip", "train.weight_decay", "data.prefetch")
    data_parallel = True

    @staticmethod
    def validate(cfg: Config) -> None:
        validate_run(cfg)

    @staticmethod
    def unused_settings(cfg: Config) -> dict[str, str]:
        """The model fields that no architecture of `archs` reads (`MODEL_FIELD_READERS`), and the stream's
        settings without data.stream."""
        if not cfg.archs or len(set(cfg.archs)) != len(cfg.archs):
            return {}  # `check_settings` refuses the architectures themselves
        families = {parse_arch(label)[0] for label in cfg.archs}
        unused = {f"model.{key}": f"a setting of {' and '.join(readers)}; this run trains {', '.join(cfg.archs)} (archs)"
                  for key, readers in MODEL_FIELD_READERS.items() if not families & set(readers)}
        if "gpt" in families and not any(parse_arch(a) == ("gpt", {}) for a in cfg.archs):
            unused["model.position"] = f"the position encoding of a plain gpt; archs {', '.join(cfg.archs)} name their own"
        if not cfg.data.stream:
            unused |= dict.fromkeys(STREAM_SETTINGS, "a setting of data.stream; this run reads token windows (data.stream=false)")
        return unused | evaluation_corpus_unused(cfg.eval) | data_root_unused(cfg.data, cfg.eval, cfg.data.tokenizer)

    def run(self, cfg: Config, run: Run) -> Outcome:
        check_memory(cfg)  # on the ranks the run actually has
        data = prepare_data(cfg.data, cfg.eval, run, cfg.seed)
        device = run.device
        measured: dict[str, Any] = {}
        details: dict[str, Any] = {"tokenizer": data.tokenizer.name, "val_tokens": data.val.n_tokens,
                                   "train_tokens": "stream" if cfg.data.stream else data.train.n_tokens}
        curves: dict[str, Any] = {}
        for arch in cfg.archs:
            parallel = parallel_model(cfg, arch, data.tokenizer.vocab_size, device)
            count = sum(p.numel() for p in parallel.module.parameters())  # FSDP shards are DTensors of the global shape
            details[f"{arch}.parameters"] = count
            console.info(f"{ARCH_LABELS.get(arch, arch)}: {count:,} parameters")
            summary = train_model(cfg, run, arch, parallel, data, device)
            save_model(run, arch, parallel, data)
            model = parallel.module.eval()  # FSDP: still sharded; the evaluation runs in lockstep on every rank
            details[f"{arch}.final_step_loss"] = summary["final_loss"]  # training mode (dropout on), last steps
            ev = evaluate_model(cfg.eval, run, arch, model, data, device, data.tokenizer.eot_id if cfg.data.documents else None)
            measured.update({f"{arch}.{k}": v for k, v in ev.measured.items()})
            details.update({f"{arch}.{k}": v for k, v in ev.details.items()})
            curves[arch] = [r for r in run.metrics() if r.get("stage") == arch]
        if {"mm", "gpt"} <= set(cfg.archs):
            measured["val_loss_gpt_minus_mm"] = measured["gpt.val_loss"] - measured["mm.val_loss"]
        if distributed.is_main():
            plot_training_curves(run, curves, cfg)
            plot_posloss(run, {a: details.get(f"{a}.posloss") for a in cfg.archs}, cfg.data.block_size)
            if cfg.eval.lengths:
                plot_extrapolation(run, details, cfg)
        return Outcome(measured, details)


# The model fields only some architectures read (`model_kwargs`, `sized_kwargs`); the rest (widths,
# vocabulary, init_from) every architecture reads. A `--set` of one that no architecture of the run
# reads is refused (`Method.unused_settings`).
MODEL_FIELD_READERS: dict[str, tuple[str, ...]] = {
    "dropout": ("mm", "gpt", "lstm"), "bias": ("mm", "gpt"), "position": ("gpt",),
    **dict.fromkeys(("contextual_dropout", "pmem_size", "init", "logit_scale"), ("mm",)),
    "ffn_hidden": SIZED,  # (model.size with other archs: check_settings's own message)
    **dict.fromkeys(("n_kv_head", "rope_theta"), ("transformer",)),
    **dict.fromkeys(("long_term_memory", "short_window", "long_delay_train", "long_delay_eval", "bag_of_k", "bag_weight",
                     "bag_eta"), ("mmv2",)),
}


def validate_run(cfg: Config, *, memory: bool = True) -> None:
    """Every check of a mosaic-train config before a run directory exists, shared by the run and
    `--dry-run`: first the settings themselves, then (with `memory`) whether a rank of this job holds
    each chapter-4 model (the dry run prints that plan instead of refusing), then the inputs on this
    machine (tokenizer, data, model.init_from). A missing input is a DataMissing."""
    check_settings(cfg)
    if memory:
        check_memory(cfg)  # before any data is looked for: a model this machine cannot hold says so first
    check_inputs(cfg)


def check_settings(cfg: Config) -> None:
    """The config's own values (no files, no network): architectures, sizes, training, evaluation."""
    from owai.models.lm import lm_config

    for label in cfg.archs:
        parse_arch(label)
    if not cfg.archs or len(set(cfg.archs)) != len(cfg.archs):
        raise OwaiError("archs: give one or more distinct architectures")
    m = cfg.model
    sized = [a for a in cfg.archs if parse_arch(a)[0] in SIZED]
    if m.size and len(sized) != len(cfg.archs):
        raise OwaiError(f"model.size applies to {', '.join(SIZED)}; archs has {', '.join(a for a in cfg.archs if a not in sized)}")
    crossing = [a for a in cfg.archs if parse_arch(a)[0] not in DOCUMENT_MASKED]
    if cfg.data.documents and crossing:
        raise OwaiError(f"data.documents (document-wise masks) is implemented by {' and '.join(DOCUMENT_MASKED)}; "
                        f"{', '.join(crossing)} would read across documents: train {'it' if len(crossing) == 1 else 'them'} "
                        "with data.documents=false")
    for length in cfg.eval.lengths:
        check_count("eval.lengths", length, 2, MAX_CONTEXT)
    _check_common_settings(cfg)
    for label in sized:  # the architecture's own checks, on its config (no weights)
        lm_config(parse_arch(label)[0], **model_kwargs(cfg, label, _planned_vocab(cfg)))
    t = cfg.train
    for name in ("steps", "batch_size", "accumulate", "eval_every", "eval_batches", "checkpoint_every", "log_every"):
        if getattr(t, name) < 1:
            raise OwaiError(f"train.{name} must be >= 1, got {getattr(t, name)}")
    if t.global_batch < 0:
        raise OwaiError(f"train.global_batch must be >= 0 (0: batch_size x accumulate x ranks), got {t.global_batch}")
    if t.global_batch and t.accumulate != 1:
        raise OwaiError(f"train.global_batch={t.global_batch} sets the accumulation itself; leave train.accumulate at 1 "
                        f"(got {t.accumulate}) or set train.global_batch=0")
    accumulation(t, int(os.environ.get("WORLD_SIZE", "1")))  # this job's ranks (torchrun's), before any directory
    if not 0 < t.min_lr <= t.lr:  # lr > 0: config.check_ranges
        raise OwaiError(f"train.min_lr must be in (0, train.lr={t.lr}], got {t.min_lr}")
    if t.warmup < 0 or len(t.betas) != 2:
        raise OwaiError("train.warmup must be >= 0 and train.betas a pair")
    if t.tokens < 0:
        raise OwaiError(f"train.tokens must be >= 0, got {t.tokens}")
    if cfg.data.prefetch != "auto":
        check_count("data.prefetch", cfg.data.prefetch, 0, 1024)  # batches held in memory: a few MB each at 4096 tokens
    if cfg.data.shuffle_buffer < 0:  # the packed stream refused it only inside the run
        raise OwaiError(f"data.shuffle_buffer must be >= 0 (0: the source's order), got {cfg.data.shuffle_buffer}")
    if cfg.data.stream_val_tokens < 1:  # a validation split of no tokens was read as one window
        raise OwaiError(f"data.stream_val_tokens must be >= 1, got {cfg.data.stream_val_tokens}")
    from owai.runtime import planned_device

    precision_for(t.precision, planned_device(cfg.runtime.device))  # the run's own machine checks the device


def check_inputs(cfg: Config) -> None:
    """What the run reads, on this machine: the tokenizer, the corpus (non-empty), model.init_from."""
    from owai.data.text import LocalSource, check_tokenizer, open_source

    check_tokenizer(cfg.data.tokenizer, cfg.data.root or None)  # a bad bpe-N or an unreachable hub id fails here, at once
    _check_common_inputs(cfg)
    source = open_source(cfg.data.source, cfg.data.text_field, data_root=cfg.data.root or None)
    if isinstance(source, LocalSource):
        source.check_nonempty()  # an empty or blank corpus fails before any run directory
    if cfg.model.init_from:
        from owai.models.lm import lm_config

        for label in cfg.archs:  # every architecture, mm and gpt too: a bad directory is refused before the run, not in it
            config = lm_config(parse_arch(label)[0], **model_kwargs(cfg, label, _planned_vocab(cfg)))
            _check_init_from(Path(cfg.model.init_from), label, config)
    if any(parse_arch(a) == ("gpt", {}) for a in cfg.archs) and cfg.model.position == "learned":
        too_long = [k for k in cfg.eval.attention_multiples if k > 1]
        if too_long:
            console.info(
                f"note: the learned-position GPT cannot run beyond block_size; its attention at {too_long} x block_size is skipped",
                once=True,
            )


def _run_device(cfg: Config) -> torch.device:
    """The device a run of `cfg` trains on (runtime.device; under torchrun this rank's)."""
    from owai.runtime import select_device

    return distributed.device_for(select_device(cfg.runtime.device))


# config fields that fix a chapter-4 model's parameter shapes (owai's and Llama's names)
SHAPE_FIELDS = ("model_type", "n_layer", "n_embd", "n_head", "ffn_hidden", "long_term_memory", "bag_of_k", "num_hidden_layers",
                "hidden_size", "num_attention_heads", "intermediate_size", "num_key_value_heads")


def _check_init_from(directory: Path, label: str, config: Any) -> None:
    """model.init_from must hold a saved model of this architecture and shape (vocabulary: when loaded)."""
    from owai.models.lm import check_saved_weights

    source = init_source(directory, label)
    check_saved_weights(source)  # no weights, or a truncated or corrupt file: one line naming it
    try:
        saved = json.loads((source / "config.json").read_text())
    except (OSError, ValueError):
        raise OwaiError(f"{source / 'config.json'} is not a model config (unreadable or not JSON)") from None
    ours = config.to_dict()
    differ = [k for k in SHAPE_FIELDS if k in ours and saved.get(k) != ours[k]]
    if differ:
        k = differ[0]
        raise OwaiError(f"model.init_from {source} does not fit this model: {k} is {saved.get(k)!r} there, {ours[k]!r} here")


def init_source(directory: Path, label: str) -> Path:
    """The saved model model.init_from names for architecture `label`: a save_pretrained directory
    itself; in a run directory models/<label>, or its only model."""
    found = dict(model_dirs(directory))
    source = found.get(label) or (next(iter(found.values())) if len(found) == 1 else None)
    if source is None:
        raise OwaiError(f"model.init_from {directory} holds {', '.join(found)}, not {label}")
    return source


def _planned_vocab(cfg: Config, tokenizer_vocab: int | None = None) -> int:
    """The tokenizer vocabulary the models are planned for: `tokenizer_vocab` when the tokenizer is
    loaded (the dry run; the run itself builds with its tokenizer), else, before it is (the memory
    check), its size read from the name: bpe-N at most N, bytes 257, otherwise GPT-2's. Only tiny
    and explicit widths use it; small and large have Table 4.2's vocabulary (`model_kwargs`)."""
    import re

    if tokenizer_vocab:
        return tokenizer_vocab
    match = re.fullmatch(r"bpe-(\d+)", cfg.data.tokenizer)
    if match:
        return int(match.group(1))
    return 257 if cfg.data.tokenizer == "bytes" else 50257


def vocab_from_tokenizer(cfg: Config) -> bool:
    """Whether the chapter-4 models' vocabulary is the tokenizer's (tiny, or explicit widths, without
    model.vocab_size), so that a plan must load the tokenizer to size them."""
    from owai.models.sizes import SIZES

    m = cfg.model
    return not m.vocab_size and not (m.size and SIZES[m.size]["vocab_size"])


def training_plans(cfg: Config, world_size: int | None = None, tokenizer_vocab: int | None = None) -> list[Any]:
    """The memory plan (owai.plan) of each chapter-4 architecture of the run, from models built on the
    meta device, for `world_size` ranks (default: this job's), as the run holds them: one process,
    or train.parallel (ddp / fsdp) over several."""
    from owai.models.lm import build_lm
    from owai.plan import device_capacity, memory_plan

    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plans = []
    for label in cfg.archs:
        arch = parse_arch(label)[0]
        if arch not in SIZED:
            continue
        with torch.device("meta"):
            model = build_lm(arch, **model_kwargs(cfg, label, _planned_vocab(cfg, tokenizer_vocab)))
        plan = memory_plan(model, world, cfg.train.parallel if world > 1 else "single", cfg.train.batch_size, cfg.data.block_size,
                           cfg.train.activation_checkpointing, device_capacity(device))
        plan.arch = ARCH_LABELS.get(label, label) + (f" {cfg.model.size}" if cfg.model.size else "")
        plan.model = model
        plans.append(plan)
    return plans


def check_memory(cfg: Config) -> None:
    """Stop in one line when a rank of this job cannot hold the run, its plan printed above it on stderr
    (stdout carries only a command's result: `owai recipes show --json` stays one JSON document)."""
    from owai.plan import GIB, ranks_needed

    for plan in training_plans(cfg):
        if plan.fits:
            continue
        for line in plan.lines():
            console.info(line)
        gpus = ranks_needed(plan, 80 * GIB)
        where = f"e.g. torchrun on >= {gpus} GPUs of 80 GiB with train.parallel=fsdp" if gpus else "more memory per rank"
        raise CannotRunHere(f"{plan.arch} needs {plan.total_bytes / GIB:,.1f} GiB per rank ({plan.strategy_text}) "
                            f"but a rank here has {plan.capacity_bytes / GIB:,.1f} GiB ({plan.capacity_name}): "
                            f"{where} (--dry-run prints the plan)")


def run_tokenizer(data: DataConfig) -> Any:
    """The tokenizer a run of `data` trains with (bpe-N: trained on the corpus once, then cached)."""
    from owai.data.text import load_tokenizer

    return load_tokenizer(data.tokenizer, source=data.source, text_field=data.text_field, data_root=data.root or None)


def dry_run_plan(cfg: Config) -> dict[str, Any]:
    """`owai mosaic-train --dry-run`: the run's own checks (`validate_run`, the memory fit excepted:
    the plan reports it), then each chapter-4 model's plan, sized as the run will build it (the
    tokenizer's vocabulary, loaded as the run loads it, where the size takes it). An input missing
    on this machine refuses the plan when the models' vocabulary depends on it, else is noted.

    Returns {"models": [one record per model], "missing": why a run here would stop or None,
    "lines": the plan as printed}; `--dry-run --json` prints it whole."""
    from owai.plan import GIB, ModelShape, forward_flops_per_token, readable, ranks_needed

    if not any(parse_arch(a)[0] in SIZED for a in cfg.archs):
        if cfg.model.size:  # --size was given: say that it does not apply to these archs, not to give it
            raise OwaiError(f"--size (model.size={cfg.model.size}) applies to {', '.join(SIZED)}, not {', '.join(cfg.archs)}; "
                            "--dry-run plans chapter 4's models: give --arch mmv2 or transformer")
        raise OwaiError("--dry-run plans chapter 4's models (mmv2, transformer); give --size or --arch mmv2/transformer")
    missing = None
    try:
        validate_run(cfg, memory=False)
    except DataMissing as e:
        if vocab_from_tokenizer(cfg):
            raise
        missing = str(e)
    tokenizer_vocab = run_tokenizer(cfg.data).vocab_size if vocab_from_tokenizer(cfg) else None
    device = _run_device(cfg)
    precision = precision_for(cfg.train.precision, device)
    lines: list[str] = []
    models: list[dict[str, Any]] = []
    for plan in training_plans(cfg, tokenizer_vocab=tokenizer_vocab):
        rows = plan.model.get_input_embeddings().weight.shape[0]
        source = f"tokenizer {cfg.data.tokenizer}" if vocab_from_tokenizer(cfg) else (
            "model.vocab_size" if cfg.model.vocab_size else f"size {cfg.model.size}'s")
        shape = ModelShape.of(plan.model.config)
        updates, sequences = total_steps(cfg, plan.world_size), sequences_per_update(cfg.train, plan.world_size)
        micro_batches = accumulation(cfg.train, plan.world_size)
        flops = {ctx: forward_flops_per_token(plan.model, ctx) for ctx in sorted({256, cfg.data.block_size})}
        gpus = ranks_needed(plan, 80 * GIB)
        lines += plan.lines()
        lines.append(f"  model: {shape.n_layer} layers, d {shape.d}, {shape.n_head} heads, FFN {shape.ffn}, vocabulary {rows:,} ({source}); "
                     f"{updates:,} updates of {sequences} sequences ({micro_batches} micro-batches of {cfg.train.batch_size} "
                     f"per rank), precision {precision} on {device.type}")
        lines.append(f"  forward FLOPs per token: {', '.join(f'{readable(f)} at context {ctx}' for ctx, f in flops.items())} "
                     "(training: 3x)")
        lines.append(f"  fits a rank here: {'yes' if plan.fits else 'no'}; with train.parallel=fsdp, ranks of 80 GiB that hold it: "
                     f"{gpus if gpus else 'none (activations alone exceed one)'}")
        models.append({
            "arch": plan.arch, "parameters": plan.parameters, "strategy": plan.strategy, "world_size": plan.world_size,
            "micro_batch": plan.micro_batch, "seq_len": plan.seq_len, "activation_checkpointing": plan.activation_checkpointing,
            "bytes_per_rank": {"parameters": plan.params_bytes, "gradients": plan.grads_bytes, "optimizer": plan.optimizer_bytes,
                               "activations": plan.activation_bytes, "total": plan.total_bytes},
            "capacity_bytes": plan.capacity_bytes, "capacity": plan.capacity_name, "fits": plan.fits,
            "layers": shape.n_layer, "d": shape.d, "heads": shape.n_head, "ffn": shape.ffn, "vocabulary": rows,
            "vocabulary_from": source, "updates": updates, "sequences_per_update": sequences,
            "micro_batches_per_rank": micro_batches, "precision": str(precision), "device": device.type,
            "forward_flops_per_token": {str(ctx): f for ctx, f in flops.items()}, "fsdp_ranks_of_80gib": gpus or None,
        })
    if missing:
        lines.append(f"not on this machine (a run here would stop before starting): {missing}")
    return {"models": models, "missing": missing, "lines": lines}

# -- data ---------------------------------------------------------------------------------------


@dataclass
class LMData:
    tokenizer: Any
    train: Any  # TokenWindows, or with data.stream a function giving a fresh PackedStream
    val: Any
    posloss: Any  # TokenWindows of the per-position-loss data (val unless eval.source is set)


def prepare_data(data: DataConfig, ev: EvalConfig, run: Run | None = None, seed: int = 0) -> LMData:
    """Tokenise the training source (rank 0 first; the other ranks then reuse its cache), or with
    data.stream open it as a packed stream and keep the first tokens of its validation split."""
    from owai.data.tokens import prepare_tokens

    if data.stream:
        return _stream_data(data, run, seed)

    def build() -> LMData:
        tokenizer = run_tokenizer(data)
        prepared = prepare_tokens(data.source, tokenizer, workers=data.workers or None, text_field=data.text_field,
                                  data_root=data.root or None, val_every=data.val_every)
        train, val = prepared.windows("train", data.block_size), prepared.windows("val", data.block_size)
        posloss = val
        if ev.source:
            other = prepare_tokens(ev.source, tokenizer, workers=data.workers or None, text_field=data.text_field, config_name=ev.config_name or None,
                                   data_root=data.root or None, val_every=data.val_every)
            posloss = other.windows("val", data.block_size)
        return LMData(tokenizer, train, val, posloss)

    if distributed.world().world_size == 1:
        return build()
    result = build() if distributed.is_main() else None
    distributed.barrier()
    return result if result is not None else build()


def _stream_data(data: DataConfig, run: Run | None, seed: int) -> LMData:
    """data.stream: training batches come from `owai.data.packing.PackedStream` (any hub id, read as it
    streams, or local files), one per architecture so that each sees the same batches; the first
    `stream_val_tokens` tokens of the validation split are written once (rank 0) to the run directory
    as a token file, which the evaluations read like any other (TokenWindows)."""
    import numpy as np

    from owai.data.packing import PackedStream
    from owai.data.tokens import TokenWindows, token_dtype
    from owai.io import atomic_write_bytes

    if run is None:
        raise OwaiError("data.stream needs a run directory for its validation tokens")
    tokenizer = run_tokenizer(data)
    world = distributed.world()

    def stream(split: str, rank: int = world.rank, world_size: int = world.world_size) -> PackedStream:
        return PackedStream(data.source, tokenizer, data.block_size, text_field=data.text_field, split=split, rank=rank,
                            world_size=world_size, data_root=data.root or None, shuffle_buffer=data.shuffle_buffer if split == "train" else 0,
                            seed=seed)

    path = run.path / "val_tokens.bin"
    dtype = token_dtype(tokenizer.vocab_size)
    if distributed.is_main() and not path.is_file():
        val = stream("val", 0, 1)
        rows = max(1, -(-data.stream_val_tokens // data.block_size))
        ids = val.next_batch(rows)["input_ids"].flatten().numpy().astype(dtype)
        atomic_write_bytes(path, ids.tobytes())
    distributed.barrier()
    windows = TokenWindows(path, np.dtype(dtype), data.block_size)
    return LMData(tokenizer, stream, windows, windows)


def prefetch_depth(data: DataConfig, device: torch.device) -> int:
    """data.prefetch as a number of micro-batches: `auto` is PREFETCH_DEPTH where the model computes on an
    accelerator, and none on a CPU, where the thread's tokenizing takes the cores torch's threads use: on 2
    cores the wait it saved went into slower products, no gain, and up to twice as slow a step on a busy
    machine (benchmarks/data_scale.py --only prefetch; docs/decisions.md)."""
    from owai.data.packing import PREFETCH_DEPTH

    if data.prefetch != "auto":
        return int(data.prefetch)
    return 0 if device.type == "cpu" else PREFETCH_DEPTH


def global_batch(windows: Any, cfg: Config, step: int, micro: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global micro-batch `micro` of update `step`.

    Every rank draws the same global batch (batch_size x world_size windows, keyed by seed, step
    and micro) and keeps its own rows, so 1 process and N processes train on identical data."""
    w = distributed.world()
    x, y = windows.batch(cfg.train.batch_size * w.world_size, generator(cfg.seed, "batch", step, micro))
    rows = slice(w.rank * cfg.train.batch_size, (w.rank + 1) * cfg.train.batch_size)
    return x[rows].to(device, non_blocking=True), y[rows].to(device, non_blocking=True)


def eval_batches(windows: Any, n: int, batch_size: int, seed: int, purpose: str) -> EvalBatches:
    """This process's share of `n` fixed random batches, the same at every evaluation and for every
    architecture: batch i is keyed by (seed, purpose, i), and rank r of W takes batches r, r + W, ...
    With W processes n is rounded up to a multiple of W, so every rank runs as many forward passes
    (FSDP runs them in lockstep); one process takes batches 0 .. n-1, and W processes the same ones
    when W divides n. As in the reference's estimate_loss, whose eval_iters batches are per GPU, the
    ranks split the evaluation; `mean_loss` adds their parts up."""
    w = distributed.world()
    total = math.ceil(n / w.world_size) * w.world_size
    return EvalBatches(windows, range(w.rank, total, w.world_size), batch_size, seed, purpose)


@dataclass(frozen=True)
class EvalBatches:
    """`eval_batches`' batches, drawn as they are read (each pass draws the same ones: batch i is keyed
    by (seed, purpose, i)), so that memory does not grow with their number: a list built up front
    held them all, and a huge train.eval_batches / eval.val_batches ran the process out of memory."""

    windows: Any
    keys: range
    batch_size: int
    seed: int
    purpose: str

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in self.keys:
            yield self.windows.batch(self.batch_size, generator(self.seed, self.purpose, i))


def mean_loss(model: torch.nn.Module, batches: Any, device: torch.device, eot: int | None = None,
              log: Any = None) -> float:
    """The mean next-token loss (eval mode) over every rank's `batches`: summed losses over summed
    targets, so W processes give the number one process gives on the same batches. `log`: an
    `owai.evals.lm.BatchLog` (a resumed evaluation computes only the batches not logged)."""
    from owai.evals.lm import loss_totals

    total, count = distributed.sum_across_ranks(list(loss_totals(model, batches, device, eot, log)), device)
    return total / max(count, 1)


# -- model and training -------------------------------------------------------------------------


def model_kwargs(cfg: Config, label: str, tokenizer_vocab: int) -> dict[str, Any]:
    arch, variant = parse_arch(label)
    m = cfg.model
    vocab = m.vocab_size or 64 * math.ceil(tokenizer_vocab / 64)
    if arch in SIZED:
        return sized_kwargs(m, arch, vocab)
    kw: dict[str, Any] = dict(vocab_size=vocab, n_layer=m.n_layer, n_embd=m.n_embd, n_head=m.n_head, bias=m.bias)
    if arch == "mm":
        kw.update(ic_dropout=m.dropout, hd_dropout=m.dropout, contextual_dropout=m.contextual_dropout, init=m.init, logit_scale=m.logit_scale, pmem_size=m.pmem_size or None)
    elif arch == "gpt":
        kw.update(dropout=m.dropout, position=m.position, block_size=cfg.data.block_size)
    elif arch == "lstm":  # no heads and no bias switch: its own fields
        kw = dict(vocab_size=vocab, n_layer=m.n_layer, n_embd=m.n_embd, dropout=m.dropout)
    kw.update(variant)
    return kw


def sized_kwargs(m: ModelConfig, arch: str, vocab: int) -> dict[str, Any]:
    """Settings of a chapter-4 architecture: a thesis size (its table vocabulary for small / large
    unless model.vocab_size is set), or the explicit widths; then the architecture's own fields."""
    from owai.models.sizes import SIZES, size_settings

    if m.size:
        table_vocab = SIZES[m.size]["vocab_size"] if m.size in SIZES else None
        kw: dict[str, Any] = size_settings(m.size, m.vocab_size or (None if table_vocab else vocab))
    else:
        kw = dict(n_layer=m.n_layer, n_embd=m.n_embd, n_head=m.n_head, ffn_hidden=m.ffn_hidden or 3 * m.n_embd, vocab_size=vocab)
    if arch == "transformer":
        kw.update(n_kv_head=m.n_kv_head or None, rope_theta=m.rope_theta)
    else:
        kw.update(long_term_memory=m.long_term_memory, short_window=m.short_window, long_delay_train=list(m.long_delay_train),
                  long_delay_eval=m.long_delay_eval, bag_of_k=m.bag_of_k, bag_weight=m.bag_weight, bag_eta=m.bag_eta)
    return kw


def accumulation(t: TrainConfig, world_size: int) -> int:
    """Micro-batches per update on `world_size` ranks: train.accumulate, or, when train.global_batch
    is set, global_batch / (batch_size x ranks), so that a recipe's update is the thesis's on any
    number of GPUs (as nanoGPT divides its accumulation by the ranks, torchtitan its global batch)."""
    if t.global_batch <= 0:
        return t.accumulate
    per_pass = t.batch_size * world_size
    if t.global_batch % per_pass:
        raise OwaiError(f"train.global_batch={t.global_batch} is not a multiple of train.batch_size x ranks = "
                        f"{t.batch_size} x {world_size}; change train.batch_size or the number of ranks")
    return t.global_batch // per_pass


def sequences_per_update(t: TrainConfig, world_size: int) -> int:
    """The global batch: sequences per update across the `world_size` ranks."""
    return t.batch_size * accumulation(t, world_size) * world_size


def total_steps(cfg: Config, world_size: int | None = None) -> int:
    """Updates of the run: train.steps, or train.tokens / (global batch x context) rounded up."""
    t = cfg.train
    if t.tokens > 0:
        per_step = sequences_per_update(t, world_size or distributed.world().world_size) * cfg.data.block_size
        return max(1, math.ceil(t.tokens / per_step))
    return t.steps


def build_model(cfg: Config, label: str, tokenizer_vocab: int, device: torch.device) -> torch.nn.Module:
    """The architecture at the configured size; initialised identically on every rank."""
    from owai.models.lm import build_lm, check_vocab

    rng = torch.get_rng_state()
    torch.manual_seed(generator(cfg.seed, "init", label).initial_seed())
    model = build_lm(parse_arch(label)[0], **model_kwargs(cfg, label, tokenizer_vocab))
    torch.set_rng_state(rng)
    check_vocab(model, tokenizer_vocab)
    if cfg.model.init_from:
        load_weights(model, Path(cfg.model.init_from), label)
    return model.to(device)


def parallel_model(cfg: Config, label: str, tokenizer_vocab: int, device: torch.device) -> Any:
    """The architecture as the training loop holds it (`owai.distributed.Parallel`): under torchrun
    with train.parallel=fsdp built on the meta device, sharded per block and materialised shard by
    shard (a 9.9B model never exists whole on one rank; the values equal `build_model`'s), else
    built normally; activation checkpointing, FSDP mixed precision and per-block compilation
    as the config says."""
    from owai.distributed import Parallel
    from owai.models.lm import blocks, build_lm, check_vocab

    t = cfg.train
    precision = precision_for(t.precision, device)
    options = dict(mixed_precision=precision if t.parallel == "fsdp" and precision != "float32" else None,
                   activation_checkpointing=t.activation_checkpointing, compile_blocks=t.compile)
    from owai.models.llama import packed_document_attention

    if t.parallel == "fsdp" and distributed.world().world_size > 1:
        kwargs = model_kwargs(cfg, label, tokenizer_vocab)
        parallel = Parallel.from_meta(lambda: build_lm(parse_arch(label)[0], **kwargs), t.parallel, device=device,
                                      blocks_of=blocks, seed=generator(cfg.seed, "init", label).initial_seed(), **options)
        check_vocab(parallel.module, tokenizer_vocab)
        if cfg.model.init_from:
            load_weights(parallel.module, Path(cfg.model.init_from), label)
        if cfg.data.documents:
            packed_document_attention(parallel.module, device)
        return parallel
    model = build_model(cfg, label, tokenizer_vocab, device)
    if cfg.data.documents:
        packed_document_attention(model, device)
    return Parallel(model, t.parallel, blocks=blocks(model), **options)


def load_weights(model: torch.nn.Module, directory: Path, label: str) -> None:
    """Start from a saved model's weights (the context-extension stage: a 4k model continued at 32k);
    the architecture and sizes must be the same."""
    from owai.models.lm import load_pretrained

    source = init_source(directory, label)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    saved = load_pretrained(source) if distributed.is_main() else None  # rank 0 reads; FSDP ranks get their shards
    if saved is not None and type(saved) is not type(model):
        raise OwaiError(f"model.init_from {source} is a {type(saved).__name__}, not a {type(model).__name__}")
    sharded = distributed.world().world_size > 1
    try:
        set_model_state_dict(model, saved.state_dict() if saved is not None else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=sharded))
    except (RuntimeError, KeyError, ValueError) as err:
        raise OwaiError(f"model.init_from {source} does not fit this model: {one_line(err)}") from None


def precision_for(name: str, device: torch.device) -> str:
    from owai.runtime import training_precision

    return training_precision(name, device, "train.precision")


def train_model(cfg: Config, run: Run, arch: str, parallel: Any, data: LMData, device: torch.device,
                batches: Any = None, probe: Any = None) -> dict[str, Any]:
    """Pre-train one architecture (stage `arch`, held by `parallel`) through the shared training
    loop; returns the loop's summary. `batches(step, micro) -> (x, y)`, this rank's rows, replaces
    the random windows of the training split (a training mixture, e.g. owai.methods.recall's);
    `probe(model) -> {name: number}` adds its numbers to every evaluation line (a learning curve). The trained model stays where it is (`parallel.module`): after
    an FSDP run still sharded, so evaluation runs in lockstep on every rank and save_model gathers
    it one parameter at a time; nothing ever holds a 9.9B model whole on one device."""
    from owai.models.lm import adamw
    from owai.optim import warmup_cosine_schedule
    from owai.plan import forward_flops_per_token
    from owai.train import LoopConfig, train_loop

    t = cfg.train
    model = parallel.module
    optimizer = adamw(model, lr=t.lr, betas=(t.betas[0], t.betas[1]), weight_decay=t.weight_decay)
    forward = parallel.forward_module  # train.compile compiles each block (Parallel)
    world = distributed.world()

    m, v2 = cfg.model, parse_arch(arch)[0] == "mmv2"
    eot = data.tokenizer.eot_id if cfg.data.documents else None
    stream = None  # data.stream: its position (after the last batch the model read) is a checkpoint companion
    if cfg.data.stream:  # batches made ahead by a thread while the model computes (owai.data.packing, "Prefetch")
        from owai.data.packing import Prefetcher

        stream = Prefetcher(data.train("train"), t.batch_size, prefetch_depth(cfg.data, device))

    def loss_at(step: int, micro: int) -> torch.Tensor:
        if stream is not None:  # the next packed rows (the loop asks in order; resume restores the position)
            batch = stream.next_batch(t.batch_size)
            x, y = batch["input_ids"].to(device, non_blocking=True), batch["labels"].to(device, non_blocking=True)
        elif batches is not None:
            x, y = (t.to(device, non_blocking=True) for t in batches(step, micro))
        else:
            x, y = global_batch(data.train, cfg, step, micro, device)
        inputs: dict[str, Any] = {"input_ids": x}
        if eot is not None:  # document-wise masking: positions restart at every document start
            from owai.data.packing import document_positions

            inputs["position_ids"] = (batch["position_ids"].to(device, non_blocking=True) if stream is not None
                                      else document_positions(x, eot))
        if v2:  # one long-term delay per update, the same on every rank and on resume
            lo, hi = m.long_delay_train
            inputs["long_delay"] = int(torch.randint(lo, hi + 1, (1,), generator=generator(cfg.seed, "delay", step)).item())
        out = forward(**inputs)
        loss = F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())
        if v2 and m.bag_of_k:  # L = L_next + alpha L_bag (sec 4.2.5.1)
            from owai.models.bag_of_k import bag_of_k_loss, bag_targets

            bags, valid = bag_targets(x, m.bag_of_k, inputs.get("position_ids"))
            loss = loss + m.bag_weight * bag_of_k_loss(out.bag_logits, bags, valid, m.bag_eta)
        return loss

    val = eval_batches(data.val, t.eval_batches, t.batch_size, cfg.seed, "val")
    train_probe = [] if stream is not None else eval_batches(data.train, t.eval_batches, t.batch_size, cfg.seed, "train-eval")

    steps = total_steps(cfg)
    waited = {"s": 0.0, "updates": 0}  # the stream's wait at the last log line, and updates since

    def after_step(done: int) -> None:
        if stream is not None:  # the loop's data stall: seconds an update waited for its batches (on a GPU, the GPU idle)
            waited["updates"] += 1
            if done % min(t.log_every, steps) == 0 or done == steps:
                run.log(arch, done, data_wait_s=(stream.wait_s - waited["s"]) / waited["updates"])
                waited.update(s=stream.wait_s, updates=0)
        if done % t.eval_every == 0 or done == steps:
            logged = {"val_loss": mean_loss(parallel.module, val, device, eot)}
            if train_probe:  # the reference's "train" estimate: eval mode, no dropout (the Fig 3.8 curve)
                logged["train_eval_loss"] = mean_loss(parallel.module, train_probe, device, eot)
            if probe is not None:
                logged.update(probe(parallel.module))
            run.log(arch, done, **logged)

    loop = LoopConfig(
        steps=steps,
        checkpoint_every=min(t.checkpoint_every, steps),
        log_every=min(t.log_every, steps),
        grad_clip=t.grad_clip,
        accumulate=accumulation(t, world.world_size),
        precision=precision_for(t.precision, device),
        tokens_per_step=sequences_per_update(t, world.world_size) * cfg.data.block_size,
        flops_per_token=3 * forward_flops_per_token(model, cfg.data.block_size) if parse_arch(arch)[0] in SIZED else 0.0,
    )
    lr_at = warmup_cosine_schedule(t.lr, t.warmup, t.decay_steps or steps, t.min_lr)
    try:
        return train_loop(run, arch, model, optimizer, loss_at, loop, lr_at=lr_at, after_step=after_step, parallel=parallel,
                          companion=stream)
    finally:
        if stream is not None:  # also on an error or Ctrl-C / SIGTERM: the thread stops with the stage
            stream.close()


def save_model(run: Run, arch: str, parallel: Any, data: LMData, max_shard_size: str = "5GB") -> Path:
    """models/<arch>/: save_pretrained (safetensors, in files of at most `max_shard_size` with an
    index, as Hugging Face shards large models) + the tokenizer spec, written atomically by rank 0.
    An FSDP model is gathered onto rank 0's CPU one parameter at a time (`full_state_on_rank0`) and
    written through a meta-device twin of the model (its class and config, no weights)."""
    from owai.data.text import save_tokenizer
    from owai.distributed import full_state_on_rank0
    from owai.io import cannot_write, is_write_failure, share_files

    target = run.path / "models" / arch
    sharded = parallel.sharded and parallel.strategy == "fsdp"
    state = full_state_on_rank0(parallel) if sharded else None  # a collective: every rank takes part
    if distributed.is_main():
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        tmp = target.with_name(f".{arch}.tmp")
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            if sharded:
                with torch.device("meta"):
                    twin = AutoModelForCausalLM.from_config(parallel.module.config)
                twin.save_pretrained(tmp, state_dict=state, safe_serialization=True, max_shard_size=max_shard_size)
            else:
                parallel.module.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
            save_tokenizer(data.tokenizer, tmp)
            share_files(tmp)  # save_pretrained writes model.safetensors 0600; every file of a run is 0644
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        except Exception as e:
            if is_write_failure(e):  # no room, a read-only folder: --resume saves it again from the last checkpoint
                raise cannot_write(f"model {target}", e) from None
            raise
    distributed.barrier()
    return target


# -- evaluation ---------------------------------------------------------------------------------


def evaluate_model(ev: EvalConfig, run: Run, label: str, model: torch.nn.Module, data: LMData, device: torch.device,
                   eot: int | None = None) -> Outcome:
    """Validation loss, per-position loss (also at `ev.lengths`, and without the long-term memory when
    asked), attention profiles and continuations of one model. `eot`: read documents apart. One
    progress bar (owai.console) counts every batch of every pass: the evaluation of a large model
    takes minutes.

    Each batch's result goes into the run's answer log (`owai.evals.lm.BatchLog`), and a resumed run
    computes only the batches a kill left (the attention profiles, a few sequences, are computed
    again)."""
    from owai.evals import lm as lme
    from owai.evals.answers import run_log
    from owai.models.lm import context_limit

    answers = run_log(run.path)

    def logged(*scope: Any) -> lme.BatchLog:
        return lme.BatchLog(answers, (label, *scope), device)

    model.eval()
    block = data.val.block_size
    measured: dict[str, Any] = {}
    details: dict[str, Any] = {}
    val = eval_batches(data.val, ev.val_batches, ev.batch_size, 0, "final-val")
    # Table B.2's training loss: as the validation loss, eval mode on fixed training windows (the
    # reference's estimate_loss "train"), not the training steps' loss with dropout on
    measure_train = ev.train_loss and hasattr(data.train, "batch")  # a streamed corpus has no training windows
    train = eval_batches(data.train, ev.val_batches, ev.batch_size, 0, "final-train") if measure_train else []
    ablations = [""]
    if ev.without_long_term and getattr(model.config, "long_term_memory", False):
        ablations.append("_no_ltm")
    limit = context_limit(model)
    extrapolation = [(length, max(1, ev.posloss_windows * block // length), max(1, ev.batch_size * block // length))
                     for length in ev.lengths]  # (window length, windows, batch size)
    attention = [k * block for k in (ev.attention_multiples if hasattr(model, "last_token_attention") else [])
                 if limit is None or k * block <= limit]
    prompts = lme.eldan_li_prompts() if ev.continuations else []
    total = len(train) + len(ablations) * (len(val) + _batch_count(data.posloss, block, ev.posloss_windows, ev.batch_size)
                              + sum(_batch_count(data.posloss, *shape) for shape in extrapolation))
    total += sum(_batch_count(data.val, length, ev.attention_sequences, ev.batch_size) for length in attention) + len(prompts)
    with console.Bar(f"evaluate {label}", total=total) as bar:
        for suffix in ablations:
            if suffix:
                model.config.long_term_memory = False  # the evaluation interface's ablation: weights untouched
            bar.update(0, status=f"validation loss{suffix}")
            measured["val_loss" + suffix] = mean_loss(model, _counted(val, bar), device, eot, logged("val", suffix))
            if train and not suffix:
                bar.update(0, status="training loss")
                measured["train_loss"] = mean_loss(model, _counted(train, bar), device, eot, logged("train"))
            bar.update(0, status=f"per-position loss{suffix}")
            windows = data.posloss.sequential(max_windows=ev.posloss_windows, batch_size=ev.batch_size)
            curve, n = lme.per_position_loss(model, _counted(windows, bar), device, eot, logged("posloss", suffix, block))
            details["posloss" + suffix] = curve
            details["posloss_windows"] = n
            measured["posloss_first50" + suffix] = lme.mean_over(curve, 0, 50)
            measured["posloss_after50" + suffix] = lme.mean_over(curve, 50)
            for length, max_windows, batch_size in extrapolation:  # windows of `length` tokens, the model trained at `block`
                bar.update(0, status=f"per-position loss at {length}{suffix}")
                windows = data.posloss.with_block_size(length).sequential(max_windows=max_windows, batch_size=batch_size)
                curve, n = lme.per_position_loss(model, _counted(windows, bar), device, eot,
                                                 logged("posloss", suffix, length))
                details[f"posloss_{length}{suffix}"] = curve
                details[f"posloss_{length}_windows"] = n
                measured[f"loss_{length}{suffix}"] = lme.mean_over(curve, 0)
                measured[f"loss_{length}_beyond{suffix}"] = lme.mean_over(curve, block)  # positions past the training context
            if suffix:
                model.config.long_term_memory = True
        profiles = {}
        for length in attention:
            bar.update(0, status=f"attention at {length}")
            windows = data.val.with_block_size(length).sequential(max_windows=ev.attention_sequences, batch_size=ev.batch_size)
            profile, n_seq = lme.attention_profile(model, lme.only_inputs(_counted(windows, bar)), device)
            profiles[length] = profile
            details[f"attention_{length}"] = {"sequences": n_seq, "mean_over_heads": profile.mean(1).tolist()}
            for key, value in lme.attention_summary(profile, block).items():  # by multiple of the context
                measured[f"attention_{key}_{length // block}x"] = value
        lambdas = model.leaky_lambdas().tolist() if hasattr(model, "leaky_lambdas") else None
        if lambdas is not None:
            details["leaky_lambda"] = lambdas  # Fig B.7: per layer and head
        if distributed.is_main() and profiles:
            plot_attention(run, label, profiles, block, lambdas)
        if prompts:
            bar.update(0, status="continuations")
            rows = lme.continuations(model, data.tokenizer, prompts, device, ev.max_new_tokens, progress=bar.update,
                                     log=logged("continuations"))
            details["continuations"] = rows
            if distributed.is_main():
                write_continuations(run, label, rows)
    return Outcome(measured, details)


def _batch_count(windows: Any, length: int, max_windows: int, batch_size: int) -> int:
    """How many batches `windows.sequential(length, max_windows, batch_size)` yields (for the bar)."""
    available = max(0, (int(windows.n_tokens) - 1) // length)
    return math.ceil(min(available, max_windows) / batch_size)


def _counted(batches: Any, bar: console.Bar) -> Any:
    """`batches`, advancing `bar` after each one."""
    for batch in batches:
        yield batch
        bar.update()


# -- figures and tables -------------------------------------------------------------------------


def plot_training_curves(run: Run, curves: dict[str, list[dict[str, Any]]], cfg: Config) -> None:
    """Fig 3.8 style: training and validation loss against iterations, one line per architecture."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    # the reference's training curve is its eval-mode estimate on training windows; a streamed corpus
    # has none, and then the training steps' own loss (dropout on) is drawn
    key = "train_eval_loss" if any("train_eval_loss" in r for rows in curves.values() for r in rows) else "loss"
    for arch, rows in curves.items():
        train = [(r["step"], r[key]) for r in rows if key in r]
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        label = f"{ARCH_LABELS.get(arch, arch)} (Nb={cfg.model.n_layer})"
        if train:
            axes[0].plot(*zip(*train), label=label)
        if val:
            axes[1].plot(*zip(*val), marker="o", label=label)
    axes[0].set_title("training loss" + (" (eval mode)" if key == "train_eval_loss" else " (training steps)"))
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


def plot_extrapolation(run: Run, details: dict[str, Any], cfg: Config) -> None:
    """Per-position loss at the evaluation lengths (the Table 4.4 / C.1 question: does the loss stay
    low past the training context?), curves smoothed over 64 positions, one panel per length."""
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = cfg.eval.lengths
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 3.8), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for arch in cfg.archs:
            for suffix, style in (("", "-"), ("_no_ltm", ":")):
                curve = details.get(f"{arch}.posloss_{length}{suffix}")
                if not curve:
                    continue
                width = min(64, len(curve))
                smooth = np.convolve(curve, np.ones(width) / width, mode="valid")
                label = ARCH_LABELS.get(arch, arch) + (" without long-term memory" if suffix else "")
                ax.plot(np.arange(len(smooth)) + width // 2, smooth, style, label=label)
        ax.axvline(cfg.data.block_size, color="grey", linewidth=0.8)
        ax.set_title(f"context {length} (trained at {cfg.data.block_size})")
        ax.set_xlabel("position")
        ax.legend(fontsize=7)
    axes[0, 0].set_ylabel("loss (64-position mean)")
    run.save_figure(fig, "extrapolation")


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
    from owai.values import md_row

    lines = [f"# Continuations, {ARCH_LABELS.get(label, label)}", "", "| prompt | greedy | beam 2 |", "|---|---|---|"]
    for r in rows:
        lines.append(md_row([r["prompt"], r.get("greedy", ""), r.get("beam2", "")]))
    atomic_write_bytes(run.path / f"continuations_{label}.md", ("\n".join(lines) + "\n").encode())


# -- evaluation of saved models -----------------------------------------------------------------


@dataclass
class EvalDataConfig(DataConfig):
    # null: each model as its training run read it (the run's data.documents; false for a model no
    # mosaic-train run saved); true / false: every model so
    documents: bool | None = None  # type: ignore[assignment]


@dataclass
class EvalOnlyConfig(BaseConfig):
    models: list[str] = field(default_factory=list)  # save_pretrained dirs, or run dirs holding models/<arch>/
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


class LanguageModelEvaluation(Method):
    Config = EvalOnlyConfig
    cli = "owai mosaic-eval"
    data_parallel = True
    # its command takes the models as MODEL_DIR arguments and refuses a run without them, so a run's
    # `--set models=[...]` is repeated by `owai recipes run mosaic-eval --single` (`experiment.command_line`)
    one_run_command = False

    @staticmethod
    def unused_settings(cfg: EvalOnlyConfig) -> dict[str, str]:
        # data.tokenizer is read for a model folder that records no tokenizer of its own (`tokenizer_for`);
        # nothing is drawn: the evaluation windows are those of mosaic-train's final evaluation (key 0)
        # data.stream is mosaic-train's training stream: an evaluation of it failed inside its run directory
        stream = dict.fromkeys(("data.stream", *STREAM_SETTINGS), "a setting of mosaic-train's streamed training data; "
                               "an evaluation reads the validation windows of the corpus")
        return ({"seed": "an evaluation draws nothing: its windows are the same for every model and seed, "
                         "as in mosaic-train's final evaluation"} | stream | evaluation_corpus_unused(cfg.eval)
                | data_root_unused(cfg.data, cfg.eval, cfg.data.tokenizer))

    @staticmethod
    def validate(cfg: EvalOnlyConfig) -> None:
        if not cfg.models:
            raise DataMissing("no model given: pass model directories (save_pretrained dirs or mosaic-train run dirs)")
        for path in cfg.models:
            for _, directory in model_dirs(Path(path)):
                check_context(directory, cfg.data.block_size)
                reads_documents(directory, cfg.data.documents)
        _validate_common(cfg)
        from owai.models.lm import check_saved_weights  # transformers' import (seconds) after the quick checks

        for path in cfg.models:
            for _, directory in model_dirs(Path(path)):
                check_saved_weights(directory)  # no weights, or a truncated or corrupt file: one line naming it

    def run(self, cfg: EvalOnlyConfig, run: Run) -> Outcome:
        from owai.data.text import tokenizer_for
        from owai.models.lm import check_vocab, load_pretrained

        measured: dict[str, Any] = {}
        details: dict[str, Any] = {}
        posloss: dict[str, Any] = {}
        for label, path in unique_labels([pair for root in cfg.models for pair in model_dirs(Path(root))]):
            documents = reads_documents(path, cfg.data.documents)
            trained_on = training_data(path).get("source")
            if trained_on is not None and trained_on != cfg.data.source and distributed.is_main():
                console.info(f"{label} was trained on {trained_on}; its validation and training losses here read "
                             f"{cfg.data.source} (--set data.source={trained_on} to read its own)")
            data_cfg = DataConfig(**{**cfg.data.__dict__, "tokenizer": tokenizer_for(path, cfg.data.tokenizer), "documents": documents})
            data = prepare_data(data_cfg, cfg.eval)
            model = load_pretrained(path).to(run.device)
            check_vocab(model, data.tokenizer.vocab_size)
            # documents apart (the eot given), as mosaic-train trained and evaluated this model
            ev = evaluate_model(cfg.eval, run, label, model, data, run.device,
                                data.tokenizer.eot_id if documents else None)
            measured.update({f"{label}.{k}": v for k, v in ev.measured.items()})
            details.update({f"{label}.{k}": v for k, v in ev.details.items()})
            details[f"{label}.documents"] = documents
            posloss[label] = ev.details.get("posloss")
        if distributed.is_main():
            plot_posloss(run, posloss, cfg.data.block_size)
        return Outcome(measured, details)


def reads_documents(directory: Path, documents: bool | None) -> bool:
    """Whether the saved model in `directory` is evaluated documents apart: `documents` when given
    (`data.documents`), else as the mosaic-train run that saved it trained (its config.yaml's
    data.documents; false for a model no owai run saved). Only an architecture with document-wise
    masks (zoo.DOCUMENT_MASKED) can read documents apart: another one's restarted positions would
    still attend across them, so asking that of it is refused."""
    from owai.models.zoo import DOCUMENT_MASKED_TYPES
    from owai.runs import read_json_object

    if documents is None:
        documents = training_data(directory).get("documents", False)
        if not isinstance(documents, bool):
            raise OwaiError(f"{directory.parent.parent / 'config.yaml'}: data.documents is {documents!r}, not true or false")
        return documents
    model_type = read_json_object(directory / "config.json").get("model_type")
    if documents and model_type not in DOCUMENT_MASKED_TYPES:
        raise OwaiError(f"data.documents=true: the model in {directory} ({model_type}) has no document-wise masks "
                        f"(only {' and '.join(DOCUMENT_MASKED)} do); evaluate it with data.documents=false")
    return documents


def training_data(directory: Path) -> dict[str, Any]:
    """The `data` settings of the mosaic-train run that saved model directory `directory` ({} for a
    model no owai run saved)."""
    from owai.runs import saving_run

    run = saving_run(directory)
    data = run.read_config()["params"].get("data") if run is not None else None
    return data if isinstance(data, dict) else {}


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


def _validate_common(cfg: Any) -> None:
    """The checks mosaic-train and mosaic-eval share: their settings, then their inputs."""
    _check_common_settings(cfg)
    _check_common_inputs(cfg)


def _check_common_settings(cfg: Any) -> None:
    from owai.data.text import check_named

    check_count("data.block_size", cfg.data.block_size, 2, MAX_CONTEXT)
    check_named(cfg.data.source, cfg.data.tokenizer)
    ev = cfg.eval
    for name in ("posloss_windows", "val_batches", "attention_sequences", "batch_size", "max_new_tokens"):
        if getattr(ev, name) < 1:
            raise OwaiError(f"eval.{name} must be >= 1, got {getattr(ev, name)}")
    if any(k < 1 for k in ev.attention_multiples):
        raise OwaiError("eval.attention_multiples must be positive integers")
    m = getattr(cfg, "model", None)
    if m is not None:
        check_count("model.n_layer", m.n_layer, 1, MAX_LAYERS)
        if min(m.n_layer, m.n_embd, m.n_head) < 1 or m.n_embd % m.n_head:
            raise OwaiError(f"model: n_embd ({m.n_embd}) must be a positive multiple of n_head ({m.n_head}), n_layer ({m.n_layer}) >= 1")


def _check_common_inputs(cfg: Any) -> None:
    from owai.data.text import open_source

    d = cfg.data
    # a missing path fails here, before any run directory; a hub dataset this machine cannot read too
    source = open_source(d.source, d.text_field, data_root=d.root or None, val_every=d.val_every)
    _check_hub_readable(cfg, source, d.stream)
    if cfg.eval.source:
        other = open_source(cfg.eval.source, d.text_field, config_name=cfg.eval.config_name or None, data_root=d.root or None,
                            val_every=d.val_every)
        _check_hub_readable(cfg, other, False)
    m = getattr(cfg, "model", None)
    if m is not None and m.vocab_size:  # an explicit vocabulary must hold the tokenizer's
        tokenizer = run_tokenizer(cfg.data)
        if tokenizer.vocab_size > m.vocab_size:
            raise OwaiError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {m.vocab_size} "
                f"(set model.vocab_size >= {tokenizer.vocab_size}, or 0 for the tokenizer's size)"
            )


def _check_hub_readable(cfg: Any, source: Any, stream: bool) -> None:
    """A hub dataset the run could not read here (the hub unreachable, no local copy) is one line
    before any run directory (`HubSource.check_readable`). A corpus that owai's token cache already
    holds for every model's tokenizer is read from there (no text, no hub); data.stream reads the
    text itself as it trains."""
    from owai.data.text import HubSource

    if isinstance(source, HubSource):
        source.check_readable(None if stream else lambda: _tokens_cached(cfg, source))


def _tokens_cached(cfg: Any, source: Any) -> bool:
    """Whether `prepare_data` would find the tokens of `source` cached for each tokenizer of the run
    (mosaic-eval: each model's own), loaded as `run_tokenizer` loads them but never trained."""
    from owai.data.text import load_tokenizer, open_source, tokenizer_for
    from owai.data.tokens import tokens_cached

    d = cfg.data
    if hasattr(cfg, "models"):
        names = [tokenizer_for(directory, d.tokenizer) for path in cfg.models for _, directory in model_dirs(Path(path))]
    else:
        names = [d.tokenizer]
    try:
        corpus = open_source(d.source, d.text_field, data_root=d.root or None).fingerprint  # bpe-N's key, as run_tokenizer opens it
        return all(tokens_cached(source, load_tokenizer(name, corpus_fingerprint=corpus, data_root=d.root or None)) for name in names)
    except OwaiError:
        return False
