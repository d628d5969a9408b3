"""A language-model corpus measured: Table B.1's statistics and Figure 4.4's length distributions.

Table B.1 (thesis App. B.2) gives, per split of BabiStories, the number of stories, the number of
GPT-2 tokens and the average number of characters per story; a reader checks a copy of the corpus
(and the tokenizer read beside it) against them before training chapter 3's models on it. Figure
4.4 (sec 4.2.2) draws the length distribution of chapter 4's training documents, each cut at the
training context, so that documents longer than the context pile up in a peak at its end.

Per split (`train`, `val`: the source's own split rule, `owai.data.text.open_source`) the method
streams the documents once, encodes them in batches and measures:

    {split}.documents             documents the source yields (owai.data.text's document rules)
    {split}.tokens                tokens with one end-of-text separator after every document: the
                                  length of the reference's train.bin / val.bin (prepare.py appends
                                  tiktoken's eot_token to every story), which is what Table B.1 counts
    {split}.text_tokens           the same without the separators
    {split}.chars_per_document    mean characters (Python str length) per document
    {split}.tokens_per_document   mean tokens (without separator) per document
    {split}.median_tokens, {split}.max_tokens
    {split}.over_{T}              share of documents longer than the context T (each of `truncate`):
                                  the height of Figure 4.4's peak at T

`data.max_documents` > 0 reads only the first documents of each split (a streamed hub corpus such
as FineWeb-Edu has far more than a figure needs). The figure is `figures/lengths.png`: one panel per
context T, the share of documents per length bin with every length cut at T.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import itertools
from typing import Any, Iterator

import numpy as np

from owai import console
from owai.config import BaseConfig
from owai.errors import OwaiError
from owai.methods import Method, Outcome
from owai.runs import Run

SPLIT_NAMES = ("train", "val")


@dataclass
class CorpusDataConfig:
    source: str = "owai-stories"  # the embedded corpus, a catalogue name (babistories), a hub id, or a local path
    tokenizer: str = "tokenizers/gpt2"  # Table B.1 counts GPT-2 tokens; bytes, bpe-N, a hub id or a tokenizer dir
    text_field: str = "text"
    root: str = ""  # explicit data root for named corpora and relative paths (--data-root); "" = $OWAI_DATA, the cache
    val_every: int = 100  # without a validation split, every val_every-th document is validation
    max_documents: int = 0  # > 0: only the first documents of each split


@dataclass
class CorpusStatsConfig(BaseConfig):
    data: CorpusDataConfig = field(default_factory=CorpusDataConfig)
    splits: list[str] = field(default_factory=lambda: list(SPLIT_NAMES))
    truncate: list[int] = field(default_factory=lambda: [512])  # Figure 4.4's training contexts
    bins: int = 64  # length bins per panel of the figure
    batch_documents: int = 512  # documents per encode_batch call
    figure: bool = True


class CorpusStatistics(Method):
    Config = CorpusStatsConfig
    cli = "owai data stats"

    @staticmethod
    def validate(cfg: CorpusStatsConfig) -> None:
        check(cfg)

    def run(self, cfg: CorpusStatsConfig, run: Run) -> Outcome:
        from owai.data.text import load_tokenizer, open_source

        source = open_source(cfg.data.source, cfg.data.text_field, data_root=cfg.data.root or None,
                             val_every=cfg.data.val_every)
        tokenizer = load_tokenizer(cfg.data.tokenizer, source=source, data_root=cfg.data.root or None)
        measured: dict[str, Any] = {}
        lengths: dict[str, np.ndarray] = {}
        for split in cfg.splits:
            text_lengths, chars = measure_split(source.texts(split), tokenizer, cfg.batch_documents,
                                                cfg.data.max_documents, f"{split} documents")
            if text_lengths.size == 0:
                raise OwaiError(f"source {source.name} has no {split} documents ({source.val_rule})")
            lengths[split] = text_lengths
            measured.update({f"{split}.{k}": v for k, v in split_statistics(text_lengths, chars, cfg.truncate).items()})
        details = {
            "source": source.name, "val_rule": source.val_rule, "tokenizer": tokenizer.name,
            "histograms": {split: {str(t): histogram(v, t, cfg.bins) for t in cfg.truncate} for split, v in lengths.items()},
        }
        if cfg.figure:
            plot_lengths(run, lengths, cfg.truncate, cfg.bins, f"{source.name} ({tokenizer.name})")
        return Outcome(measured, details)


def check(cfg: CorpusStatsConfig) -> None:
    """Settings a run cannot start with, and the tokenizer and corpus it reads, before any run directory."""
    from owai.data.text import HubSource, LocalSource, check_named, check_tokenizer, open_source

    check_named(cfg.data.source, cfg.data.tokenizer)
    if not cfg.splits or len(set(cfg.splits)) != len(cfg.splits) or any(s not in SPLIT_NAMES for s in cfg.splits):
        raise OwaiError(f"splits must be distinct names among {', '.join(SPLIT_NAMES)}, got {cfg.splits}")
    if not cfg.truncate or any(t < 1 for t in cfg.truncate) or len(set(cfg.truncate)) != len(cfg.truncate):
        raise OwaiError(f"truncate must be distinct positive contexts (tokens), got {cfg.truncate}")
    for name, value in (("bins", cfg.bins), ("batch_documents", cfg.batch_documents)):
        if value < 1:
            raise OwaiError(f"{name} must be >= 1, got {value}")
    if cfg.data.max_documents < 0:
        raise OwaiError(f"data.max_documents must be >= 0 (0: all), got {cfg.data.max_documents}")
    check_tokenizer(cfg.data.tokenizer, cfg.data.root or None)
    source = open_source(cfg.data.source, cfg.data.text_field, data_root=cfg.data.root or None,
                         val_every=cfg.data.val_every)
    if isinstance(source, HubSource):
        source.check_readable()  # the hub unreachable and no local copy: one line now, not a failed run directory
    if isinstance(source, LocalSource):
        source.check_nonempty()
        for split in cfg.splits:  # e.g. a corpus under val_every documents has no held-out ones
            if next(iter(source.texts(split)), None) is None:
                raise OwaiError(f"source {source.name} has no {split} documents ({source.val_rule}); "
                                f"drop the split (--set splits=[train]) or add documents")


def measure_split(texts: Iterator[str], tokenizer: Any, batch_documents: int, limit: int,
                  description: str) -> tuple[np.ndarray, int]:
    """Token lengths (N,) of the documents of one split (no separator) and their total characters."""
    from owai.data.tokens import document_batches

    parts: list[np.ndarray] = []
    chars = 0
    with console.Bar(description, total=limit or None) as bar:  # None: a count not known in advance
        for batch in document_batches(itertools.islice(texts, limit or None), batch_documents):
            chars += sum(len(t) for t in batch)
            parts.append(np.fromiter((len(ids) for ids in tokenizer.encode_batch(batch)), dtype=np.int64, count=len(batch)))
            bar.update(len(batch))
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)), chars


def split_statistics(text_lengths: np.ndarray, chars: int, truncate: list[int]) -> dict[str, Any]:
    """Table B.1's columns and the length summary of one split (see the module docstring)."""
    n = int(text_lengths.size)
    stats: dict[str, Any] = {
        "documents": n,
        "tokens": int(text_lengths.sum()) + n,  # one separator after every document, as the reference's .bin
        "text_tokens": int(text_lengths.sum()),
        "chars_per_document": round(chars / n, 2),
        "tokens_per_document": round(float(text_lengths.mean()), 2),
        "median_tokens": float(np.median(text_lengths)),
        "max_tokens": int(text_lengths.max()),
    }
    stats.update({f"over_{t}": round(float((text_lengths > t).mean()), 6) for t in truncate})
    return stats


def histogram(text_lengths: np.ndarray, context: int, bins: int) -> dict[str, list[float]]:
    """Share of documents per length bin over [0, context], every length cut at `context`: the
    documents the context truncates land in the last bin (with those just shorter than it), which
    makes Figure 4.4's peak."""
    edges = np.linspace(0, context, min(bins, context) + 1)
    counts, _ = np.histogram(np.minimum(text_lengths, context), bins=edges)
    return {"edges": edges.tolist(), "share": (counts / max(1, text_lengths.size)).tolist()}


def plot_lengths(run: Run, lengths: dict[str, np.ndarray], truncate: list[int], bins: int, title: str) -> None:
    """figures/lengths.png: one panel per context, a line per split (Figure 4.4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(truncate), figsize=(4.5 * len(truncate), 3.4), squeeze=False)
    for ax, context in zip(axes[0], truncate):
        for split, values in lengths.items():
            h = histogram(values, context, bins)
            ax.stairs(h["share"], h["edges"], label=f"{split} ({values.size:,} documents)")
        ax.set_yscale("log")
        ax.set_xlabel(f"document length in tokens, cut at {context:,}")
        ax.set_ylabel("share of documents")
        ax.set_title(f"context {context:,}", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    run.save_figure(fig, "lengths")
