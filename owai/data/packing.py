"""Streaming, resumable, rank-sharded document packing (thesis ch. 4: FineWeb-style corpus, Llama-3
tokenizer, 4096-token packed sequences with document-wise attention).

`PackedStream(source, tokenizer, seq_len)` reads documents lazily from anything
`owai.data.text.open_source` accepts (a hub id streams through `HubSource` with
`datasets.load_dataset(..., streaming=True)`; `hf:<local dir>` reads local json/parquet files through
the same `datasets` streaming builders; local files/directories go through `LocalSource`), encodes
each with a tokenizer from `owai.data.text.load_tokenizer`, and packs them:

    stream  = [bos] + ids(doc_0) + [eos] + [bos] + ids(doc_1) + [eos] + ...     (epoch after epoch)
    row k   = stream[k*T : k*T + T + 1]                                          (T = seq_len)
    input_ids[k] = row k [:-1]     labels[k] = row k [1:]                         (T,) each, int64
    position_ids[k][j] = j - (index in row k of the last document start <= j, else 0)

Decisions (and why):

* BOS/EOS. `eos_id=None` is the tokenizer's `eot_id` (what `load_tokenizer` reports: transformers'
  `eos_token` for hub ids and tokenizer directories, e.g. Llama-3's `<|end_of_text|>`; `<|endoftext|>`
  for tokenizer.json files, bpe-N and GPT-2; 256 for bytes): the same separator the memmapped shards of
  `owai.data.tokens` put after every document. `bos_id=None` is (1) the single special token the
  tokenizer's own post-processor puts in front of a sequence (what Hugging Face does with
  `add_special_tokens=True`: Llama-3's `<|begin_of_text|>`), else (2) a `<|begin_of_text|>` token of the
  vocabulary, else none; a BOS equal to the EOS is dropped (GPT-2 style: `<|endoftext|>` alone separates
  documents, never doubled). So Llama-3 gets `<|begin_of_text|> doc <|end_of_text|>`, GPT-2, bpe-N and
  bytes get `doc <|endoftext|>`. An explicit id overrides the rule; `NO_TOKEN` (-1) means none.
* Rows overlap by one token (stride T, T + 1 tokens each, like `TokenWindows.sequential`): every stream
  token is an input exactly once and every next-token transition is a target exactly once; nothing is
  padded or dropped; the tail of a document continues in the next row (also across batches and epochs).
  Labels are not masked at document boundaries (the target at an EOS is the next BOS/first token).
* position_ids restart at 0 at every document start (the BOS; without BOS the token after an EOS) and
  at the first token of every row: a row that starts mid-document cannot attend to the document's
  earlier part (it lies in the previous row), so for a model with document-wise masks it is a new
  context, and positions stay in [0, T) (learned position tables, the RoPE range trained on). They equal
  `document_positions(input_ids, eos_id)` whenever the EOS id is not also used inside documents (never
  with the default ids: special tokens in the text are encoded as plain text).
* Blank documents (`not text.strip()`, or an empty encoding) are skipped but counted as read. A split
  without a single non-blank document is a one-line `OwaiError` ("... has no text"): from `check()`
  (reads up to the first non-blank document, cheap), or at the latest when the first epoch ends.
* End of the stream: cycling. The source is re-opened from its first document, the epoch counter
  (in the state) goes up, and packing continues seamlessly (the first document of epoch e + 1 follows
  the last of epoch e in the same row). The order within an epoch is the source's own, or the shuffle
  buffer's.
* Shuffle buffer (`shuffle_buffer=N > 0`): the classic streaming shuffle of tokenized documents: fill a
  pool of N, emit a uniformly chosen one (seeded `random.Random(seed)`), refill; at the end of an epoch
  the pool is drained before the next epoch starts. The pool (token ids) and the RNG state are part of
  the state dict, so its JSON grows with N x document length.
* Ranks: every rank reads and tokenizes the whole stream (deterministic, no coordination); global row
  i is the i-th row of the single stream. `next_batch(B)` consumes one global batch of B * world_size
  rows and returns rows [rank * B, (rank + 1) * B) of it, so one process with batch B * W sees exactly
  the rows that W processes with batch B see together, in the same order (sharding by documents
  could not give that). The cost is W-fold tokenization, which on a GPU the prefetch thread (below)
  overlaps with the forward/backward pass.
  Iterating the stream (`for row in stream`) is `next_batch(1)` row by row: rank r gets rows r, r + W, ...
* Resume: `state_dict()` is plain JSON data (epoch, documents read in this epoch, global rows emitted,
  the carried-over tokens and their document starts, the shuffle pool and RNG) and identical on every
  rank; it does not depend on rank or world size, so a run may resume with another world size (the
  global row sequence continues). The state also holds the source's position after the last document
  read (`TextSource.texts_from`: a hub stream's own state, a local corpus's file and document), and
  `load_state_dict` re-opens the source there: at the thesis's scale a resume would otherwise read every
  document already used again, terabytes on every rank, and a hub stream would download them again.
  A source without positions (the embedded stories), or a state saved without one, is re-opened at its
  start and the documents already read are skipped without tokenizing them. Then the carry-over is
  restored from the state, so the next batches equal those of an uninterrupted run. A state
  saved with another seq_len, BOS/EOS, tokenizer, split, text field or shuffle setting is refused (one
  line); a changed source fingerprint (files touched, moved) is reported but accepted.
* Prefetch (`Prefetcher(stream, B, depth)`): the training loop reads its batches through a background
  thread that keeps up to `depth` of them ready, so the step waits for data only when the stream is
  slower than the model (every rank tokenizes the whole stream: at `paper-small`'s 4.2M tokens an
  update about 10 % of the update, spent while the GPU idled). A thread, not a DataLoader worker process:
  the tokenizers encode with the GIL released (`tokenizers`' Rust), the state needs no copying between
  processes, and a `datasets` hub stream and its position stay in one process. The batches are the
  stream's own, in its order (bit-identical); its state is the stream's after the last batch handed
  out, not after those prepared ahead (`PackedStream.mark`: a position kept by reference, cheap enough
  to take after every batch), so a checkpoint resumes on the first batch the model has not seen. An
  error in the thread is raised by the next `next_batch` (the same exception and traceback), and again
  by every later call. The thread is a daemon that looks at its stop flag at least every
  PREFETCH_POLL_S, so neither the end of a run nor Ctrl-C / SIGTERM waits on it.
"""

from __future__ import annotations

import itertools
import os
import queue
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from owai import console
from owai.data.text import TextSource, Tokenizer, canonical_split, lazy_texts, load_tokenizer, open_source
from owai.errors import OwaiError

NO_TOKEN = -1  # bos_id / eos_id value meaning "no such token"
BOS_SPELLINGS = ("<|begin_of_text|>",)  # rule (2) of the BOS default (Llama-3's spelling)
ENCODE_CHUNK = 64  # documents per encode_batch call (read ahead; not part of the state)
STATE_FORMAT = 1
STATE_CONFIG = ("seq_len", "bos_id", "eos_id", "split", "text_field", "tokenizer", "shuffle_buffer", "seed")
PREFETCH_DEPTH = 4  # batches a Prefetcher keeps ready by default (a few MB at the paper's sizes)
PREFETCH_POLL_S = 0.1  # how often a waiting prefetch thread or caller looks at the stop flag / the thread
PREFETCH_CLOSE_S = 10.0  # how long `Prefetcher.close` waits for the thread to finish its batch


def default_special_ids(tokenizer: Tokenizer) -> tuple[int | None, int]:
    """(bos_id or None, eos_id) by the documented rule: EOS = `tokenizer.eot_id`; BOS = the single
    special token the tokenizer's post-processor prepends (add_special_tokens=True), else a
    `<|begin_of_text|>` vocabulary token, else None; a BOS equal to the EOS is None."""
    eos = int(tokenizer.eot_id)
    backend = getattr(tokenizer, "backend", None)  # HFTokenizer: a `tokenizers.Tokenizer`
    bos: int | None = None
    if backend is not None:
        encoded = backend.encode("a", add_special_tokens=True)
        lead: list[int] = []
        for token, special in zip(encoded.ids, encoded.special_tokens_mask):
            if not special:
                break
            lead.append(int(token))
        if len(lead) == 1 and len(lead) < len(encoded.ids):  # exactly one special token before the text
            bos = lead[0]
        if bos is None:
            bos = next((int(i) for i in map(backend.token_to_id, BOS_SPELLINGS) if i is not None), None)
    return (None if bos == eos else bos), eos


def document_positions(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Position ids that restart at 0 at index 0 and right after every `eos_id` token.

    For `TokenWindows` batches (documents each followed by the eot id, windows crossing documents):
    input_ids (B, T) or (..., T) int -> (same shape) int64; vectorised (cummax), no loop over T."""
    T = input_ids.shape[-1]
    index = torch.arange(T, device=input_ids.device).expand(input_ids.shape)  # (..., T)
    starts = torch.zeros(input_ids.shape, dtype=torch.long, device=input_ids.device)  # (..., T)
    if T > 1:
        after_eos = input_ids[..., :-1] == eos_id  # (..., T-1): token j+1 starts a document
        starts[..., 1:] = torch.where(after_eos, index[..., 1:], 0)
    return index - starts.cummax(dim=-1).values  # (..., T)


class StreamMark(NamedTuple):
    """A PackedStream's position (`PackedStream.mark`): its counters and its (never mutated) arrays."""

    epoch: int
    docs_read: int
    docs_used: int
    exhausted: bool
    rows: int
    position: Any  # the source's position after the last document read (a fresh object per document)
    buf: np.ndarray  # (n,) carried-over tokens
    pos: np.ndarray  # (n,) their positions within their documents
    pool: tuple[np.ndarray, ...]  # the shuffle pool
    rng: Any  # the shuffle RNG's getstate(), or None without a shuffle buffer


class PackedStream:
    """Documents of `source` tokenized, wrapped in BOS/EOS and packed into rows of `seq_len` (see the
    module docstring); `next_batch(B)` gives this rank's (B, seq_len) slice of each global batch."""

    def __init__(self, source: str | os.PathLike[str] | TextSource, tokenizer: str | Tokenizer, seq_len: int, *,
                 text_field: str = "text", split: str = "train", bos_id: int | None = None,
                 eos_id: int | None = None, rank: int = 0, world_size: int = 1,
                 data_root: str | Path | None = None, config_name: str | None = None,
                 shuffle_buffer: int = 0, seed: int = 0, cache_dir: str | Path | None = None) -> None:
        if int(seq_len) < 1:
            raise OwaiError(f"seq_len must be a positive number of tokens, got {seq_len}")
        if int(world_size) < 1 or not 0 <= int(rank) < int(world_size):
            raise OwaiError(f"rank {rank} is not in a world of size {world_size} (need 0 <= rank < world_size)")
        if int(shuffle_buffer) < 0:
            raise OwaiError(f"shuffle_buffer must be 0 (off) or a number of documents, got {shuffle_buffer}")
        self.seq_len, self.rank, self.world_size = int(seq_len), int(rank), int(world_size)
        self.split, self.text_field = canonical_split(split), text_field
        self.shuffle_buffer, self.seed = int(shuffle_buffer), int(seed)
        self.source = open_source(source, text_field, cache_dir, config_name=config_name, data_root=data_root)
        if isinstance(tokenizer, Tokenizer):
            self.tokenizer = tokenizer
        else:  # bpe-N trains on (or finds its cache for) this source's train split, as prepare_tokens does
            self.tokenizer = load_tokenizer(tokenizer, cache_dir, lazy_texts(self.source, "train"),
                                            corpus_fingerprint=self.source.fingerprint)
        auto_bos, auto_eos = default_special_ids(self.tokenizer)
        self.bos_id = self._special("bos_id", auto_bos if bos_id is None else bos_id)
        self.eos_id = self._special("eos_id", auto_eos if eos_id is None else eos_id)
        self._reset()

    # --- public API --------------------------------------------------------------------------

    def check(self) -> None:
        """Raise the one-line "has no text" OwaiError unless the split holds a non-blank document
        (reads up to the first one with a fresh reader; the stream position is not touched)."""
        n_docs = 0
        for text in self.source.texts(self.split):
            n_docs += 1
            if text.strip() and self.tokenizer.encode(text):
                return
        self._no_text(n_docs)

    def next_batch(self, batch_size_per_rank: int) -> dict[str, torch.Tensor]:
        """Consume one global batch (batch_size_per_rank * world_size rows) and return this rank's rows
        [rank * B, (rank + 1) * B): input_ids, labels, position_ids, each (B, seq_len) int64.

        A source error raised here (OwaiError) may leave the stream inside a batch: resume from a
        saved state rather than calling again."""
        B, T = int(batch_size_per_rank), self.seq_len
        if B < 1:
            raise OwaiError(f"batch size per rank must be at least 1, got {batch_size_per_rank}")
        first, rows, docpos = self.rank * B, [], []
        for i in range(B * self.world_size):
            self._fill(T + 1)  # the same refill on every rank: the state is a function of global rows only
            if first <= i < first + B:
                rows.append(self._buf[: T + 1])  # (T+1,)
                docpos.append(self._pos[:T])  # (T,)
            self._buf, self._pos = self._buf[T:], self._pos[T:]  # the row's last token starts the next row
            self._rows += 1
        tokens = np.stack(rows)  # (B, T+1)
        positions = np.minimum(np.stack(docpos), np.arange(T))  # (B, T): restart at the row start too
        return {"input_ids": torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])),  # (B, T)
                "labels": torch.from_numpy(np.ascontiguousarray(tokens[:, 1:])),  # (B, T)
                "position_ids": torch.from_numpy(np.ascontiguousarray(positions))}  # (B, T)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's rows one at a time (`next_batch(1)`): (seq_len,) tensors; never ends (cycling)."""
        while True:
            yield {k: v[0] for k, v in self.next_batch(1).items()}

    @property
    def epoch(self) -> int:
        """Epochs completed (0 during the first pass over the source)."""
        return self._epoch

    @property
    def rows_emitted(self) -> int:
        """Global rows consumed so far (all ranks' rows)."""
        return self._rows

    def mark(self) -> StreamMark:
        """The stream's position now, for a later `state_dict(mark)`: its counters and references to its
        carry, source position and shuffle pool, which the stream replaces and never changes in place, so
        a mark costs no copy of tokens (a Prefetcher takes one after every batch it prepares)."""
        return StreamMark(self._epoch, self._docs_read, self._docs_used, self._exhausted, self._rows, self._position,
                          self._buf, self._pos, tuple(self._pool), self._rng.getstate() if self.shuffle_buffer else None)

    def state_dict(self, mark: StreamMark | None = None) -> dict[str, Any]:
        """The stream position (now, or at `mark`) as plain JSON-able data (the same on every rank)."""
        m = self.mark() if mark is None else mark
        starts = np.flatnonzero(m.pos == 0)
        state: dict[str, Any] = {
            "format": STATE_FORMAT, **self._config(), "source": self.source.name,
            "source_fingerprint": self.source.fingerprint,
            "epoch": m.epoch, "docs_read": m.docs_read, "docs_used": m.docs_used,
            "exhausted": m.exhausted, "rows": m.rows, "source_position": m.position,
            "carry": m.buf.tolist(), "carry_first_pos": int(m.pos[0]) if len(m.pos) else 0,
            "carry_doc_starts": starts.tolist(),
        }
        if self.shuffle_buffer:
            version, internal, gauss = m.rng
            state["shuffle_docs"] = [doc.tolist() for doc in m.pool]
            state["shuffle_rng"] = [version, list(internal), gauss]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (from `state_dict`, possibly through JSON): the next batches are those
        the saved stream would have given. Refuses a state of a differently configured stream."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise OwaiError(f"not a packed-stream state (format {STATE_FORMAT} expected)")
        mine = self._config()
        for key in STATE_CONFIG:
            if state.get(key) != mine[key]:
                raise OwaiError(f"packed-stream state does not fit this stream: {key} is {state.get(key)!r} "
                                f"in the state, {mine[key]!r} here")
        if state.get("source_fingerprint") != self.source.fingerprint:
            at = "position" if state.get("source_position") is not None else "document count"
            console.info(f"note: source {self.source.name} changed since the stream state was saved "
                         f"(was {state.get('source')}); resuming at the saved {at}")
        self._reset()
        self._epoch, self._rows = int(state["epoch"]), int(state["rows"])
        self._docs_read, self._docs_used = int(state["docs_read"]), int(state["docs_used"])
        self._exhausted = bool(state["exhausted"])
        self._position = state.get("source_position")  # absent in states saved before positions: skip by count
        self._buf = np.asarray(state["carry"], dtype=np.int64)
        self._pos = _positions(len(self._buf), int(state["carry_first_pos"]), state["carry_doc_starts"])
        if self.shuffle_buffer:
            self._pool = [np.asarray(doc, dtype=np.int64) for doc in state["shuffle_docs"]]
            version, internal, gauss = state["shuffle_rng"]
            self._rng.setstate((version, tuple(internal), gauss))

    # --- internals ---------------------------------------------------------------------------

    def _special(self, name: str, value: int | None) -> int | None:
        if value is None or int(value) == NO_TOKEN:
            return None
        if not 0 <= int(value) < self.tokenizer.vocab_size:
            raise OwaiError(f"{name} {value} is outside tokenizer {self.tokenizer.name}'s vocabulary "
                            f"(0..{self.tokenizer.vocab_size - 1}; {NO_TOKEN} for none)")
        return int(value)

    def _config(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "bos_id": self.bos_id, "eos_id": self.eos_id, "split": self.split,
                "text_field": self.text_field, "tokenizer": self.tokenizer.fingerprint,
                "shuffle_buffer": self.shuffle_buffer, "seed": self.seed}

    def _reset(self) -> None:
        self._epoch = self._rows = self._docs_read = self._docs_used = 0
        self._exhausted = False
        self._docs: Iterator[tuple[np.ndarray | None, Any]] | None = None  # this epoch's reader (re-opened on resume)
        self._position: Any = None  # the source's position after the last document read (texts_from)
        self._buf = np.zeros(0, dtype=np.int64)  # (n,) carried-over stream tokens
        self._pos = np.zeros(0, dtype=np.int64)  # (n,) their positions within their documents
        self._pool: list[np.ndarray] = []  # shuffle buffer: wrapped documents
        self._rng = random.Random(self.seed)

    def _no_text(self, n_docs: int) -> None:
        raise OwaiError(f"source {self.source.name} has no text: its {self.split} split holds no non-blank "
                        f"document ({n_docs} read, all empty or blank)")

    def _wrap(self, ids: list[int]) -> np.ndarray:
        """[bos] + ids + [eos] (each only if set) as int64 (n,)."""
        head = [] if self.bos_id is None else [self.bos_id]
        tail = [] if self.eos_id is None else [self.eos_id]
        return np.asarray(head + ids + tail, dtype=np.int64)

    def _documents(self, skip: int, position: Any) -> Iterator[tuple[np.ndarray | None, Any]]:
        """This epoch's source documents after the first `skip`: from the source's `position` after them
        when there is one, else read and skipped (not tokenized). Each as (the wrapped ids, or None for
        a blank document; the source's position after it), encoded ENCODE_CHUNK at a time."""
        texts = self.source.texts_from(self.split, position)
        if position is None:
            skipped = sum(1 for _ in itertools.islice(texts, skip))
            if skipped < skip:
                raise OwaiError(f"source {self.source.name} ({self.split}) has {skipped} documents, fewer than the "
                                f"{skip} the stream state says were read: the data changed since it was saved")
        while chunk := list(itertools.islice(texts, ENCODE_CHUNK)):
            keep = [t for t, _ in chunk if t.strip()]
            encoded = iter(self.tokenizer.encode_batch(keep) if keep else [])
            for text, after in chunk:
                ids = next(encoded) if text.strip() else []
                yield (self._wrap(ids) if ids else None), after

    def _pull(self) -> np.ndarray | None:
        """The next non-blank document of this epoch's source, or None once it is exhausted."""
        if self._exhausted:
            return None
        if self._docs is None:
            self._docs = self._documents(self._docs_read, self._position if self._docs_read else None)
        for doc, self._position in self._docs:
            self._docs_read += 1
            if doc is not None:
                self._docs_used += 1
                return doc
        self._exhausted, self._docs = True, None
        return None

    def _next_doc(self) -> np.ndarray:
        """The next document of the (shuffled, cycling) stream."""
        while True:
            if self.shuffle_buffer:
                while len(self._pool) < self.shuffle_buffer and (doc := self._pull()) is not None:
                    self._pool.append(doc)
                if self._pool:
                    j = self._rng.randrange(len(self._pool))
                    doc, self._pool[j] = self._pool[j], self._pool[-1]
                    self._pool.pop()
                    return doc
            elif (doc := self._pull()) is not None:
                return doc
            if self._docs_used == 0:  # a whole epoch without text: cycling would never end
                self._no_text(self._docs_read)
            self._epoch += 1
            self._docs_read = self._docs_used = 0
            self._exhausted, self._docs, self._position = False, None, None

    def _fill(self, need: int) -> None:
        """Append documents to the carry until it holds at least `need` tokens (one concatenation)."""
        if len(self._buf) >= need:
            return
        tokens, positions, have = [self._buf], [self._pos], len(self._buf)
        while have < need:
            doc = self._next_doc()
            tokens.append(doc)
            positions.append(np.arange(len(doc), dtype=np.int64))
            have += len(doc)
        self._buf, self._pos = np.concatenate(tokens), np.concatenate(positions)

    def __repr__(self) -> str:
        return (f"PackedStream({self.source.name!r}, {self.tokenizer.name!r}, seq_len={self.seq_len}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id}, rank={self.rank}/{self.world_size}, "
                f"epoch={self._epoch}, rows={self._rows})")


def _positions(n: int, first_pos: int, starts: list[int]) -> np.ndarray:
    """(n,) positions within documents of a carry: `first_pos` at index 0, restarting at `starts`."""
    marks = np.full(n, np.iinfo(np.int64).min, dtype=np.int64)  # (n,)
    if n:
        marks[0] = -first_pos
        marks[np.asarray(starts, dtype=np.int64)] = np.asarray(starts, dtype=np.int64)
    return np.arange(n, dtype=np.int64) - np.maximum.accumulate(marks) if n else marks


class _Failed(NamedTuple):
    """What a prefetch thread hands over in place of a batch when making it raised."""

    error: BaseException


class Prefetcher:
    """`stream`'s batches of `batch_size` rows per rank, up to `depth` of them prepared ahead by a
    background thread while the caller computes (see the module docstring, "Prefetch"). `next_batch`,
    `state_dict` and `load_state_dict` stand in for the stream's: the same batches in the same order,
    the state after the last batch handed out. `depth` 0: no thread, each batch made when asked.
    `wait_s` adds up the time `next_batch` spent waiting for its batch (the training loop's data stall).
    `close()` (or leaving a `with` block) stops the thread; it starts again at the next `next_batch`."""

    def __init__(self, stream: PackedStream, batch_size: int, depth: int = PREFETCH_DEPTH) -> None:
        if int(batch_size) < 1:
            raise OwaiError(f"batch size per rank must be at least 1, got {batch_size}")
        if int(depth) < 0:
            raise OwaiError(f"prefetch depth must be 0 (none) or a number of batches, got {depth}")
        self.stream, self.batch_size, self.depth = stream, int(batch_size), int(depth)
        self.wait_s = 0.0
        self._handed = stream.mark()  # the stream's position after the last batch handed out
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready: queue.Queue[Any] = queue.Queue()  # (batch, mark) pairs or a _Failed; each thread its own

    def next_batch(self, batch_size: int | None = None) -> dict[str, torch.Tensor]:
        """The stream's next batch (`PackedStream.next_batch(batch_size)`), from those prepared ahead."""
        if batch_size is not None and int(batch_size) != self.batch_size:
            raise ValueError(f"this Prefetcher makes batches of {self.batch_size} rows, not {batch_size}")
        if self._failure is not None:
            raise self._failure
        start = time.perf_counter()
        try:
            if self.depth == 0:
                try:
                    batch = self.stream.next_batch(self.batch_size)
                except Exception as exc:  # the stream may stop inside a batch: it is not read again
                    self._failure = exc
                    raise
                self._handed = self.stream.mark()
                return batch
            if self._thread is None or self._stop.is_set():  # never started, or closed
                self._start()
            item = self._take()
        finally:
            self.wait_s += time.perf_counter() - start
        if isinstance(item, _Failed):
            self._failure = item.error
            self.close()
            raise item.error
        batch, self._handed = item
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The stream's state after the last batch `next_batch` returned (not after those prepared ahead)."""
        return self.stream.state_dict(self._handed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`: the batches prepared ahead are dropped, the thread restarts from it."""
        self._halt(None)  # the thread must be gone before the stream changes under it
        self.stream.load_state_dict(state)
        self._handed, self._failure = self.stream.mark(), None

    def close(self) -> None:
        """Stop the thread, dropping the batches it prepared (waiting at most PREFETCH_CLOSE_S for the one
        it is making; it is a daemon, so a process never waits on it). A later `next_batch` starts a new
        one at the first batch not handed out."""
        self._halt(PREFETCH_CLOSE_S)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        if self._thread is not None and self._thread.is_alive():  # a closed thread still inside a read
            raise OwaiError("the data thread of the packed stream did not stop: the stream cannot be read again")
        if self.stream.rows_emitted != self._handed.rows:  # a stopped thread prepared batches that were dropped
            self.stream.load_state_dict(self.stream.state_dict(self._handed))
        self._stop = threading.Event()
        self._ready = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._produce, args=(self._stop, self._ready), daemon=True,
                                        name="owai-prefetch")
        self._thread.start()

    def _halt(self, timeout: float | None) -> None:
        """Stop the thread, if one runs, waiting `timeout` seconds at most (None: until it stops)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._thread = None

    def _take(self) -> Any:
        """The next item of the thread: a (batch, mark) pair or a `_Failed`."""
        assert self._thread is not None
        while True:
            try:
                return self._ready.get(timeout=PREFETCH_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._ready.empty():
                    return _Failed(OwaiError("the data thread of the packed stream ended without a batch"))

    def _produce(self, stop: threading.Event, ready: queue.Queue[Any]) -> None:
        """The thread: make batches until `stop`, each handed over with the stream's mark after it."""
        try:
            while not stop.is_set():
                batch = self.stream.next_batch(self.batch_size)
                if not _offer(ready, (batch, self.stream.mark()), stop):
                    return
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the caller, which raises it
            _offer(ready, _Failed(exc), stop)


def _offer(ready: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put `item` in `ready`, waiting for room until `stop`; whether it went in."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=PREFETCH_POLL_S)
            return True
        except queue.Full:
            continue
    return False
