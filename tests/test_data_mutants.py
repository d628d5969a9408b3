"""Surviving mutants of the data chapter 3 and 4 train on, now caught: the BOS/EOS defaults of packed
documents, the shuffle buffer's size, the document order and separators of token files (worker pool,
UTF-8 bytes), the vocabulary bound of token ids, and the three moons' time grid.

Every expected value comes from a rule written out in the module docstrings (owai.data.packing,
owai.data.tokens, owai.data.moons) or from the formula itself, never from owai's own output."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import owai.data.tokens as tokens_module
from owai.data.moons import sample_sequences
from owai.data.packing import PackedStream, default_special_ids
from owai.data.text import ByteTokenizer, Tokenizer, load_tokenizer, open_source
from owai.data.tokens import encode_documents, prepare_tokens
from owai.errors import OwaiError
from test_packing import write_jsonl  # the corpus files the packing tests write

WORDS = ("the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "big", "red")


def word_tokenizer_dir(root: Path, specials: list[str], template: list[str], eos: str, bos: str | None) -> Path:
    """A WordLevel tokenizer directory: `specials` first in the vocabulary, a post-processor that puts
    `template` (special tokens) before the text, and a tokenizer_config.json naming `eos` (and `bos`)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, processors

    vocab = {"[UNK]": 0}
    for token in (*specials, *WORDS):
        vocab.setdefault(token, len(vocab))
    backend = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(list(specials))
    if template:
        lead = " ".join(template)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{lead} $A", pair=f"{lead} $A {lead} $B",
            special_tokens=[(t, vocab[t]) for t in dict.fromkeys(template)])
    folder = root / "tok"
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
    if bos is not None:
        config["bos_token"] = bos
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_a_bos_equal_to_the_eos_is_dropped(tmp_path: Path) -> None:
    """packing docstring: "a BOS equal to the EOS is dropped (GPT-2 style: `<|endoftext|>` alone
    separates documents, never doubled)". A tokenizer whose post-processor prepends its own EOS (as
    GPT-2-style configs with bos_token == eos_token do) must give `doc <eos> doc <eos>`, not
    `<eos> doc <eos> <eos> doc <eos>` (mutant: the `bos == eos` test removed)."""
    folder = word_tokenizer_dir(tmp_path, ["<|endoftext|>"], ["<|endoftext|>"], "<|endoftext|>", "<|endoftext|>")
    tok = load_tokenizer(str(folder))
    eos = tok.backend.token_to_id("<|endoftext|>")
    assert tok.eot_id == eos
    assert default_special_ids(tok) == (None, eos)
    source = write_jsonl(tmp_path / "d.jsonl", ["the cat", "a dog ran"] * 3)
    stream = PackedStream(source, tok, 8)
    assert (stream.bos_id, stream.eos_id) == (None, eos)
    texts = list(open_source(source).texts("train"))
    expect = [i for t in texts for i in tok.encode(t) + [eos]]  # doc <eos> doc <eos> ...
    got = stream.next_batch(1)["input_ids"][0].tolist()
    assert got == expect[:8]


def test_bos_is_the_single_leading_special_token_only(tmp_path: Path) -> None:
    """packing docstring, BOS rule (1): "the single special token the tokenizer's own post-processor puts
    in front of a sequence"; with two leading special tokens rule (1) does not apply, and without a
    `<|begin_of_text|>` in the vocabulary (rule 2) there is no BOS. Mutant: any number of leading
    specials accepted (the first taken as the BOS)."""
    folder = word_tokenizer_dir(tmp_path, ["<s>", "<lang>", "</s>"], ["<s>", "<lang>"], "</s>", "<s>")
    tok = load_tokenizer(str(folder))
    assert tok.backend.encode("the cat").ids[:2] == [tok.backend.token_to_id("<s>"), tok.backend.token_to_id("<lang>")]
    assert default_special_ids(tok) == (None, tok.backend.token_to_id("</s>"))


def shuffled_order(shuffle_buffer: int, seed: int, n_docs: int) -> list[int]:
    """The order in which a bytes-tokenized PackedStream emits documents `d000`, `d001`, ... in its
    first epoch (read back from the stream: documents are separated by the EOS 256)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        source = write_jsonl(Path(tmp) / "d.jsonl", [f"d{i:03d}" for i in range(n_docs)])
        n_train = len(list(open_source(source).texts("train")))
        stream = PackedStream(source, "bytes", 50, shuffle_buffer=shuffle_buffer, seed=seed)
        flat: list[int] = []
        while flat.count(256) < n_train:
            flat += stream.next_batch(1)["input_ids"][0].tolist()
    docs = bytes(t for t in flat if t != 256).decode().split("d")[1:]
    return [int(d) for d in docs[:n_train]]


def test_shuffle_buffer_holds_exactly_n_documents() -> None:
    """packing docstring, shuffle buffer: "fill a pool of N, emit a uniformly chosen one, refill". A pool
    of 1 is no shuffle at all (the source order); with a pool of N the k-th document emitted
    (0-based) is among the first k + N documents read. Mutant: the pool filled to N + 1."""
    n_docs = 60
    one = shuffled_order(1, seed=0, n_docs=n_docs)
    assert one == sorted(one)  # pool of 1: the source's own order
    for seed in (0, 1, 2):
        order = shuffled_order(3, seed=seed, n_docs=n_docs)
        source_rank = {d: r for r, d in enumerate(sorted(order))}  # position in the source's train order
        assert sorted(order) == one
        assert order != one  # it does shuffle
        assert all(source_rank[d] <= k + 3 - 1 for k, d in enumerate(order))


def test_token_file_keeps_document_order_with_worker_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tokens docstring: one flat file per split, the eot id after every document, in the source's
    order, whatever `workers` (a process pool encodes batches of documents). The first batch is made
    much slower to encode than the others, so a pool that hands results back as they finish
    (mutant: `imap_unordered`) writes them out of order."""
    folder = word_tokenizer_dir(tmp_path, ["<|endoftext|>"], [], "<|endoftext|>", None)
    tok = load_tokenizer(str(folder))
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, size=400_000))] + [" ".join(rng.choice(WORDS, size=5)) for _ in range(119)]
    source = write_jsonl(tmp_path / "docs.jsonl", docs)
    real = tokens_module.document_batches
    monkeypatch.setattr(tokens_module, "document_batches", lambda texts, size=None: real(texts, 1))
    prepared = prepare_tokens(source, tok, tmp_path / "cache", workers=2)
    for split in ("train", "val"):
        expect = [i for t in open_source(source).texts(split) for i in tok.encode(t) + [tok.eot_id]]
        got = np.fromfile(prepared.path(split), dtype=prepared.dtype).tolist()
        assert got == expect, split


def test_bytes_fast_path_puts_the_eot_after_every_documents_utf8_bytes() -> None:
    """tokens docstring / ByteTokenizer: ids are the UTF-8 bytes of a document, then the eot id (256).
    Multi-byte characters count as several bytes; mutant: separators placed by character count."""
    tok = ByteTokenizer()
    texts = ["é", "naïve ok", "a"]
    expect = [b for t in texts for b in (*t.encode("utf-8"), 256)]
    assert encode_documents(tok, texts).tolist() == expect
    assert expect[:3] == [0xC3, 0xA9, 256]


class _OffByOne(Tokenizer):
    """A broken tokenizer: every text becomes the id `vocab_size` (one past the last valid id)."""

    name = "off-by-one"
    vocab_size = 10
    eot_id = 9
    fingerprint = "off-by-one-v1"

    def encode(self, text: str) -> list[int]:
        return [self.vocab_size]


def test_token_ids_must_be_below_the_vocabulary_size(tmp_path: Path) -> None:
    """Valid ids are 0..vocab_size-1 (the dtype rule of the tokens docstring sizes the file by it): an id
    equal to vocab_size is refused, not written. Mutant: `> vocab_size` instead of `>=`."""
    source = write_jsonl(tmp_path / "d.jsonl", ["x"] * 20)
    with pytest.raises(OwaiError, match="produced id 10 >= vocab_size 10"):
        prepare_tokens(source, _OffByOne(), tmp_path / "cache")


def test_moon_sequences_start_on_the_time_grid_at_zero() -> None:
    """moons: observation t of a sequence started at grid point s is at time (s + t) * dt, angle
    2 pi time / p_k + phase, encoded [sin, cos] per moon. With grid_size = 2 * block_size + 2 the
    reference's start range has one point, s = 0, so observation t is at time t * dt exactly.
    Mutant: the grid shifted by one step (time (s + t + 1) * dt)."""
    block, dt, phase, periods = 10, 0.0225, 0.3, (1.0, 2.0, 3.0)
    seq = sample_sequences([periods], 2, 5, dt, torch.Generator().manual_seed(0), phase=phase,
                           grid_size=2 * block + 2, block_size=block)
    expect = torch.tensor([[v for p in periods for v in (math.sin(2 * math.pi * t * dt / p + phase),
                                                          math.cos(2 * math.pi * t * dt / p + phase))]
                           for t in range(5)])
    assert seq.shape == (2, 5, 6)
    for row in seq:
        assert torch.allclose(row, expect, atol=1e-6)
