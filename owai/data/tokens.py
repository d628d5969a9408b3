"""Token shards on disk and random windows over them (the reference's `prepare.py` + `StoriesDataset`).

`prepare_tokens(source, tokenizer)` tokenizes the train and val documents of a text source, appends
the eot id after every document (as tiktoken `encode_ordinary` + EOT in the reference), and writes
one flat memory-mappable file per split:

    <cache>/tokens/<source>-<source fingerprint>/tokenizer-<tokenizer fingerprint>-eot<eot id>/
        train.bin  val.bin   raw ids, uint16 when vocab_size <= 65535, else uint32
        meta.json            tokenizer, vocab_size, eot_id, dtype, n_tokens, n_documents, ...

`<cache>` is `cache_dir`, else `$OWAI_CACHE`, else `~/.cache/owai`. The directory is built under a
temporary name and renamed into place when complete, so a reader sees a whole cache or none; a
complete cache (meta.json matching, file sizes matching n_tokens) is reused as is, and the
temporary directories of processes killed while building it are removed when it is built or reused
(`owai.io.remove_dead_builds`). Processes building the same cache at once each build their own
directory; the first renamed into place is the one every process uses.

`TokenWindows` samples `(x, y)` batches as the reference does: offsets drawn uniformly over
`len(data) - block_size - 2` positions (its `RandomSampler` over `StoriesDataset`), `x = data[i:i+T]`,
`y = data[i+1:i+T+1]`; windows cross document boundaries; no mask, no BOS.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from owai import console
from owai.data.text import (
    SPLITS,
    ByteTokenizer,
    TextSource,
    Tokenizer,
    cache_root,
    canonical_split,
    lazy_texts,
    load_tokenizer,
    open_source,
    slug,
)
from owai.errors import OwaiError
from owai.io import atomic_write_json, build_lock, cannot_write, folder_to_build, remove_dead_builds

FORMAT_VERSION = 1
DOCS_PER_BATCH = 512  # documents per encode_batch call / worker task


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65535), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


@dataclass(frozen=True)
class PreparedTokens:
    """A finished token cache: where it is, its tokenizer and its meta.json content."""

    root: Path
    tokenizer: Tokenizer
    meta: dict[str, Any]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eot_id(self) -> int:
        return int(self.meta["eot_id"])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    @property
    def n_tokens(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.meta["n_tokens"].items()}

    def path(self, split: str) -> Path:
        """The `.bin` file of `split` (train or val)."""
        return self.root / f"{canonical_split(split)}.bin"

    def windows(self, split: str, block_size: int) -> TokenWindows:
        """A `TokenWindows` reader over `split`."""
        return TokenWindows(self.path(split), self.dtype, block_size)


def prepare_tokens(source: str | os.PathLike[str] | TextSource, tokenizer: str | Tokenizer,
                   cache_dir: str | Path | None = None, workers: int | None = None, *, text_field: str = "text",
                   **source_kwargs: Any) -> PreparedTokens:
    """Tokenize `source` (train and val) with `tokenizer` into a cached directory; reuse it when complete.

    `workers` > 1 encodes document batches in that many processes; None or 1 encodes in this process
    with the tokenizer's own (Rust, multi-threaded) `encode_batch`. `source_kwargs` (`config_name`,
    `revision`, `streaming`) go to `open_source`."""
    src = open_source(source, text_field, cache_dir, **source_kwargs)
    tok = _resolve_tokenizer(tokenizer, src, cache_dir)
    final, expect = _cache_dir(src, tok, cache_dir)
    meta = read_complete_meta(final, expect)
    if meta is None:
        with build_lock(final):  # one process builds it; the others wait and read it
            meta = read_complete_meta(final, expect)
            if meta is None:
                meta = _build(src, tok, final, expect, workers)
    remove_dead_builds(final, "tmp", "old")  # a process killed building it while another finished it: cleaned on reuse too
    return PreparedTokens(final, tok, meta)


def _cache_dir(src: TextSource, tok: Tokenizer, cache_dir: str | Path | None) -> tuple[Path, dict[str, Any]]:
    """Where the tokens of `src` by `tok` are cached, and the meta.json values a complete cache has."""
    # the tokens depend on the tokenizer's mapping (its fingerprint, a hash of its content) and the eot
    # id written after each document, not on its name: a saved model's tokenizer.json (named by its
    # path) reuses the tokens its training run cached under `bpe-2048` (mosaic-eval re-tokenized the
    # corpus for every saved model before)
    final = (cache_root(cache_dir) / "tokens" / f"{slug(src.name)}-{src.fingerprint}"
             / f"tokenizer-{tok.fingerprint}-eot{int(tok.eot_id)}")
    return final, {"format_version": FORMAT_VERSION, "source_fingerprint": src.fingerprint,
                   "tokenizer_fingerprint": tok.fingerprint, "eot_id": int(tok.eot_id)}


def tokens_cached(src: TextSource, tokenizer: Tokenizer, cache_dir: str | Path | None = None) -> bool:
    """Whether `prepare_tokens(src, tokenizer)` would reuse a complete cache (and so read no text: a
    hub corpus then needs neither the hub nor the Hugging Face datasets cache)."""
    return read_complete_meta(*_cache_dir(src, tokenizer, cache_dir)) is not None


def _resolve_tokenizer(tokenizer: str | Tokenizer, src: TextSource, cache_dir: str | Path | None) -> Tokenizer:
    """A Tokenizer object; bpe-N is trained on the train split only when not cached yet."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    return load_tokenizer(tokenizer, cache_dir, lazy_texts(src, "train"), corpus_fingerprint=src.fingerprint)


def read_complete_meta(root: Path, expect: dict[str, Any]) -> dict[str, Any] | None:
    """meta.json of `root` if the cache there is complete and matches `expect`, else None."""
    try:
        meta = json.loads((root / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if any(meta.get(k) != v for k, v in expect.items()):
        return None
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        file = root / f"{split}.bin"
        if not file.is_file() or file.stat().st_size != int(meta["n_tokens"][split]) * itemsize:
            return None
    return meta


def _build(src: TextSource, tok: Tokenizer, final: Path, expect: dict[str, Any],
           workers: int | None) -> dict[str, Any]:
    """Write every split into a temporary sibling directory, then rename it to `final`."""
    tmp = folder_to_build(final)
    try:
        dtype = token_dtype(tok.vocab_size)
        counts = {split: _write_split(src, split, tok, tmp / f"{split}.bin", dtype, workers) for split in SPLITS}
        meta = {**expect, "source": src.name, "val_rule": src.val_rule, "tokenizer": tok.name,
                "vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "dtype": dtype.name,
                "n_tokens": {s: c[0] for s, c in counts.items()},
                "n_documents": {s: c[1] for s, c in counts.items()}}
        atomic_write_json(tmp / "meta.json", meta)
        meta = _install(tmp, final, expect, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    console.info(f"token cache {final}: train {meta['n_tokens']['train']:,} tokens, val {meta['n_tokens']['val']:,}")
    return meta


def _install(tmp: Path, final: Path, expect: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Rename `tmp` to `final` and return the installed meta; a complete `final` written meanwhile
    by another process wins, an incomplete or stale one is moved out of the way first.

    The rename is tried first and `final` looked at only when it is refused: a look before it could
    find `final` missing or stale just before another process installs a complete one, which would
    then be moved away (and deleted) while that process reads it. Another process may move the same
    stale `final` away first; and one it moved away that turns out complete is put back."""
    for _ in range(3):
        try:
            os.rename(tmp, final)  # atomic; refused while `final` is a folder with files in it (or a file)
            return meta
        except OSError:
            pass
        theirs = read_complete_meta(final, expect)
        if theirs is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            return theirs
        trash = folder_to_build(final, "old")
        try:
            os.rename(final, trash / "old")
        except FileNotFoundError:  # another process moved it away first
            pass
        else:
            if read_complete_meta(trash / "old", expect) is not None:  # installed between our look and the move
                try:
                    os.rename(trash / "old", final)
                except OSError:  # a third one is in place now: it serves as well
                    pass
        shutil.rmtree(trash, ignore_errors=True)
    raise OwaiError(f"cannot install token cache {final} (another process keeps replacing it)")


def _write_split(src: TextSource, split: str, tok: Tokenizer, path: Path, dtype: np.dtype,
                 workers: int | None) -> tuple[int, int]:
    """Stream `split` through the tokenizer into `path`; returns (n_tokens, n_documents)."""
    console.info(f"tokenizing {src.name} ({split}) with {tok.name}")
    n_tokens = n_docs = 0
    try:
        with open(path, "wb") as f:
            for ids, docs in _encoded_batches(src.texts(split), tok, workers):
                if ids.size and int(ids.max()) >= tok.vocab_size:
                    raise OwaiError(f"tokenizer {tok.name} produced id {int(ids.max())} >= vocab_size {tok.vocab_size}")
                f.write(ids.astype(dtype, copy=False).tobytes())
                n_tokens += int(ids.size)
                n_docs += docs
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # a full or read-only cache (the folder being built is removed by the caller)
        raise cannot_write(f"token cache {path}", e) from None
    if n_tokens == 0:
        raise OwaiError(f"source {src.name} has no {split} documents ({src.val_rule}); "
                        "add documents or a validation file")
    return n_tokens, n_docs


def document_batches(texts: Iterable[str], size: int = DOCS_PER_BATCH) -> Iterator[list[str]]:
    """`texts` in lists of `size` documents (the last one shorter), in order."""
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def encode_documents(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Concatenated ids of `texts` with the eot id after each document (int64)."""
    if isinstance(tok, ByteTokenizer):  # fast path: UTF-8 bytes are the ids
        encoded = [t.encode("utf-8") for t in texts]
        ids = np.frombuffer(b"\0".join(encoded) + b"\0", dtype=np.uint8).astype(np.int64)
        ids[np.cumsum([len(e) + 1 for e in encoded]) - 1] = tok.eot_id
        return ids
    flat: list[int] = []
    for ids in tok.encode_batch(texts):
        flat.extend(ids)
        flat.append(tok.eot_id)
    return np.asarray(flat, dtype=np.int64)


def _encoded_batches(texts: Iterable[str], tok: Tokenizer,
                     workers: int | None) -> Iterator[tuple[np.ndarray, int]]:
    """(ids, n_docs) per batch of documents, in order; a process pool when workers > 1."""
    if workers is None or workers <= 1 or isinstance(tok, ByteTokenizer):
        for batch in document_batches(texts):
            yield encode_documents(tok, batch), len(batch)
        return
    # Not fork: this process runs torch's threads, and forking a threaded process can deadlock the child
    # (Python 3.12+ warns; 3.14 stops forking by default), or crash it on macOS. A fork server starts
    # clean, imports this module once, and forks the workers from itself; the tokenizer is pickled.
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])
    else:
        context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_worker_init, initargs=(tok,)) as pool:
        for ids, n in pool.imap(_worker_encode, document_batches(texts), chunksize=1):
            yield ids, n


_WORKER_TOKENIZER: Tokenizer | None = None


def _worker_init(tok: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the pool is the parallelism
    _WORKER_TOKENIZER = tok


def _worker_encode(texts: list[str]) -> tuple[np.ndarray, int]:
    assert _WORKER_TOKENIZER is not None
    return encode_documents(_WORKER_TOKENIZER, texts), len(texts)


class TokenWindows:
    """Random and sequential (x, y) windows over one memory-mapped split."""

    def __init__(self, bin_path: str | Path, dtype: np.dtype | str, block_size: int) -> None:
        self.path, self.block_size = Path(bin_path), int(block_size)
        if not self.path.is_file():
            raise OwaiError(f"token file not found: {self.path}")
        n = self.path.stat().st_size // np.dtype(dtype).itemsize
        if self.block_size < 1 or n < self.block_size + 1:
            raise OwaiError(f"{self.path.name} has {n:,} tokens, fewer than block_size + 1 = "
                            f"{self.block_size + 1:,}; use a smaller block_size or more data")
        self.data = np.memmap(self.path, dtype=np.dtype(dtype), mode="r", shape=(n,))

    @property
    def n_tokens(self) -> int:
        return int(len(self.data))

    @property
    def n_offsets(self) -> int:
        """Number of start offsets: len - T - 2 as the reference (at least 1 on tiny splits)."""
        return max(1, self.n_tokens - self.block_size - 2)

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 (B, T): offsets i ~ U{0..n_offsets-1} from `generator`; y is x shifted by one."""
        starts = torch.randint(self.n_offsets, (batch_size,), generator=generator).numpy()
        return self._windows(starts, self.block_size)

    def sequential(self, block_size: int | None = None, max_windows: int | None = None,
                   batch_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Non-overlapping windows from offset 0 (stride T), `batch_size` at a time, for evaluation."""
        T = int(block_size or self.block_size)
        if self.n_tokens < T + 1:
            raise OwaiError(f"{self.path.name} has {self.n_tokens:,} tokens, fewer than block_size + 1 = {T + 1:,}")
        total = (self.n_tokens - 1) // T
        total = total if max_windows is None else min(total, int(max_windows))
        for first in range(0, total, batch_size):
            starts = np.arange(first, min(first + batch_size, total), dtype=np.int64) * T
            yield self._windows(starts, T)

    def with_block_size(self, block_size: int) -> TokenWindows:
        """The same split with another window length (e.g. 3x the training context)."""
        return TokenWindows(self.path, self.data.dtype, block_size)

    def _windows(self, starts: np.ndarray, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + np.arange(T + 1, dtype=np.int64)[None, :]
        rows = torch.from_numpy(np.asarray(self.data[idx], dtype=np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def __repr__(self) -> str:
        return f"TokenWindows({self.path}, n_tokens={self.n_tokens}, block_size={self.block_size})"
