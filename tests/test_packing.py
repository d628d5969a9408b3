"""Streaming document packing (owai.data.packing): lossless rows, document positions, rank sharding,
exact resume (also across epochs and world sizes), sources, BOS/EOS rules, empty corpora."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA  # $OWAI_DATA, else the shared/data beside the checkout

from owai.data.packing import NO_TOKEN, PackedStream, Prefetcher, default_special_ids, document_positions
from owai.data.text import HubSource, LocalSource, Tokenizer, load_tokenizer, open_source
from owai.errors import OwaiError

KEYS = ("input_ids", "labels", "position_ids")


# --- fixtures and helpers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def essays() -> Path:
    """The real essay corpus (117 documents, ~147k GPT-2 tokens); skips where shared data is absent."""
    path = SHARED_DATA / "text" / "paul_graham_essays"
    if not path.is_dir():
        pytest.skip(f"{path} not present")
    return path


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """GPT-2 through load_tokenizer, from the original encoder.json + vocab.bpe of the shared folder."""
    folder = SHARED_DATA / "tokenizers" / "gpt2"
    if not folder.is_dir():
        pytest.skip(f"{folder} not present")
    return load_tokenizer(str(folder))


WORDS = "the a cat dog sat on mat and ran far away hello world . ,".split()


def llama_like_dir(root: Path, template: bool) -> Path:
    """A tiny Llama-3-style tokenizer directory: WordLevel, <|begin_of_text|> / <|end_of_text|> specials,
    tokenizer_config.json naming them; with `template` its post-processor prepends <|begin_of_text|>."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    backend = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    if template:
        backend.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", 1)])
    folder = root / ("llama-template" if template else "llama-plain")
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>"}))
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(str(llama_like_dir(tmp_path_factory.mktemp("tok"), template=True)))


def word_docs(n: int, seed: int = 0, blank_every: int = 0) -> list[str]:
    """n documents of 1..40 words (some blank when blank_every > 0), deterministic."""
    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 40)))) for _ in range(n)]
    if blank_every:
        docs = ["  \n " if i % blank_every == 0 else d for i, d in enumerate(docs)]
    return docs


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def reference(texts: list[str], tok: Tokenizer, bos: int | None, eos: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(stream tokens, document-start flags) of one epoch, built independently: [bos]+encode(doc)+[eos]
    for every non-blank document, in order."""
    tokens: list[int] = []
    starts: list[bool] = []
    for text in texts:
        if not text.strip():
            continue
        doc = ([bos] if bos is not None else []) + tok.encode(text) + ([eos] if eos is not None else [])
        tokens += doc
        starts += [True] + [False] * (len(doc) - 1)
    return np.asarray(tokens), np.asarray(starts)


def batches(stream: PackedStream, n: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    return [stream.next_batch(batch_size) for _ in range(n)]


def assert_same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for key in KEYS:
            assert torch.equal(x[key], y[key]), key


def one_line_error(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert isinstance(excinfo.value, OwaiError) and message and "\n" not in message, message
    return message


def json_round_trip(state: dict) -> dict:
    return json.loads(json.dumps(state))


def read_ahead(prefetcher: Prefetcher, rows: int) -> None:
    """Wait (at most 10 s) until the prefetch thread has taken the stream past global row `rows`."""
    import time

    deadline = time.monotonic() + 10
    while prefetcher.stream.rows_emitted <= rows:
        assert time.monotonic() < deadline, "the prefetch thread did not read ahead"
        time.sleep(0.01)


# --- document_positions ----------------------------------------------------------------------------


def test_document_positions_hand_made() -> None:
    eos = 9
    ids = torch.tensor([[5, 6, 9, 7, 8, 9, 4],   # two boundaries
                        [9, 1, 2, 3, 9, 9, 1],   # eos first, consecutive eos
                        [1, 2, 3, 4, 5, 6, 7],   # no eos: 0..T-1
                        [1, 2, 3, 4, 5, 6, 9]])  # eos last: nothing after it
    want = torch.tensor([[0, 1, 2, 0, 1, 2, 0],
                         [0, 0, 1, 2, 3, 0, 0],
                         [0, 1, 2, 3, 4, 5, 6],
                         [0, 1, 2, 3, 4, 5, 6]])
    got = document_positions(ids, eos)
    assert got.dtype == torch.long and torch.equal(got, want)
    assert torch.equal(document_positions(ids[1], eos), want[1])  # (T,) works too
    assert torch.equal(document_positions(torch.tensor([[9]]), eos), torch.tensor([[0]]))
    assert torch.equal(document_positions(torch.full((2, 4), eos), eos), torch.zeros(2, 4, dtype=torch.long))


def test_document_positions_on_token_windows_layout(gpt2: Tokenizer) -> None:
    """Windows over eot-separated documents (the memmapped layout): restart right after every eot."""
    docs = word_docs(20, seed=3)
    flat = np.concatenate([np.asarray(gpt2.encode(d) + [gpt2.eot_id]) for d in docs])
    windows = torch.from_numpy(np.stack([flat[s: s + 32] for s in (0, 5, 17, 40)]))  # (4, 32)
    got = document_positions(windows, gpt2.eot_id)
    for row, pos in zip(windows.tolist(), got.tolist()):
        expect = [0]
        for j in range(1, len(row)):
            expect.append(0 if row[j - 1] == gpt2.eot_id else expect[-1] + 1)
        assert pos == expect


# --- packing ---------------------------------------------------------------------------------------


def test_packing_is_lossless_and_positions_restart(essays: Path, gpt2: Tokenizer) -> None:
    T, B = 512, 4
    stream = PackedStream(essays, gpt2, T)
    assert (stream.bos_id, stream.eos_id) == (None, gpt2.eot_id)  # GPT-2: eos only
    texts = list(open_source(essays).texts("train"))
    ref, starts = reference(texts, gpt2, None, gpt2.eot_id)
    n_batches = len(ref) // (T * B)  # stay inside the first epoch
    out = batches(stream, n_batches, B)
    inputs = torch.cat([b["input_ids"] for b in out]).numpy()  # (R, T)
    labels = torch.cat([b["labels"] for b in out]).numpy()
    positions = torch.cat([b["position_ids"] for b in out]).numpy()
    R = len(inputs)
    assert stream.epoch == 0 and stream.rows_emitted == R
    # inputs tile the stream; labels are the stream shifted by one (rows overlap by one token)
    assert np.array_equal(inputs.reshape(-1), ref[: R * T])
    assert np.array_equal(labels.reshape(-1), ref[1: R * T + 1])
    assert np.array_equal(labels[:-1, -1], inputs[1:, 0])
    # position ids: 0 at every document start and at every row start, +1 elsewhere
    row_starts = starts[: R * T].reshape(R, T)
    expect = np.zeros((R, T), dtype=np.int64)
    for j in range(1, T):
        expect[:, j] = np.where(row_starts[:, j], 0, expect[:, j - 1] + 1)
    assert np.array_equal(positions, expect)
    assert np.array_equal(positions, document_positions(torch.from_numpy(inputs), gpt2.eot_id).numpy())
    assert row_starts[:, 1:].sum() > 100  # most documents start inside a row


def test_llama_style_bos_and_eos_wrap_every_document(tmp_path: Path, llama: Tokenizer) -> None:
    bos, eos = llama.backend.token_to_id("<|begin_of_text|>"), llama.backend.token_to_id("<|end_of_text|>")
    assert default_special_ids(llama) == (bos, eos) and llama.eot_id == eos
    docs = word_docs(40, seed=1)
    source = write_jsonl(tmp_path / "docs.jsonl", docs)
    T = 16
    stream = PackedStream(source, llama, T)
    ref, starts = reference(list(open_source(source).texts("train")), llama, bos, eos)
    R = len(ref) // T - 1
    rows = [stream.next_batch(1) for _ in range(R)]
    inputs = torch.cat([r["input_ids"] for r in rows]).numpy()
    assert np.array_equal(inputs.reshape(-1), ref[: R * T])
    assert inputs[0, 0] == bos
    flat_pos = torch.cat([r["position_ids"] for r in rows]).numpy().reshape(-1)
    assert np.all(flat_pos[starts[: R * T]] == 0)  # a BOS is always position 0
    assert np.array_equal(ref[starts], np.full(starts.sum(), bos))
    # without a template the <|begin_of_text|> vocabulary token is the BOS (rule 2)
    plain = load_tokenizer(str(llama_like_dir(tmp_path, template=False)))
    assert default_special_ids(plain) == (bos, eos)
    # explicit override: no BOS
    no_bos = PackedStream(source, llama, T, bos_id=NO_TOKEN)
    assert no_bos.bos_id is None and no_bos.next_batch(1)["input_ids"][0, 0] != bos
    with pytest.raises(OwaiError) as excinfo:
        PackedStream(source, llama, T, eos_id=10**6)
    assert "outside" in one_line_error(excinfo)


def test_bytes_tokenizer_gets_eos_only(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", ["ab", "c"])
    stream = PackedStream(source, "bytes", 4)
    assert (stream.bos_id, stream.eos_id) == (None, 256)
    batch = stream.next_batch(2)
    # stream: a b EOT c EOT | a b EOT c EOT ... (epoch 2 continues the row)
    assert batch["input_ids"].tolist() == [[97, 98, 256, 99], [256, 97, 98, 256]]
    assert batch["labels"].tolist() == [[98, 256, 99, 256], [97, 98, 256, 99]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [0, 0, 1, 2]]
    assert stream.epoch >= 1


def test_one_process_equals_two_ranks(tmp_path: Path, gpt2: Tokenizer) -> None:
    source = write_jsonl(tmp_path / "docs.jsonl", word_docs(25, seed=2))
    for shuffle in (0, 7):
        single = PackedStream(source, gpt2, 24, shuffle_buffer=shuffle, seed=4)
        ranks = [PackedStream(source, gpt2, 24, rank=r, world_size=2, shuffle_buffer=shuffle, seed=4) for r in (0, 1)]
        for _ in range(12):  # several epochs of this small corpus
            whole = single.next_batch(6)
            parts = [s.next_batch(3) for s in ranks]
            for key in KEYS:
                assert torch.equal(whole[key], torch.cat([p[key] for p in parts])), key
        assert single.epoch >= 2
        assert single.state_dict() == ranks[0].state_dict() == ranks[1].state_dict()
    # iterating is next_batch(1): rank r gets global rows r, r + W, ...
    it = iter(PackedStream(source, gpt2, 24, rank=1, world_size=3))
    rows = PackedStream(source, gpt2, 24).next_batch(9)["input_ids"]  # (9, 24) global rows
    first, second = next(it), next(it)
    assert first["input_ids"].shape == (24,)
    assert torch.equal(first["input_ids"], rows[1]) and torch.equal(second["input_ids"], rows[4])


@pytest.mark.parametrize("shuffle", [0, 5])
def test_resume_reproduces_the_next_batches(tmp_path: Path, gpt2: Tokenizer, shuffle: int) -> None:
    docs = word_docs(50, seed=6, blank_every=11)
    source = write_jsonl(tmp_path / "docs.jsonl", docs)
    T, B, total = 32, 2, 40
    full = batches(PackedStream(source, gpt2, T, shuffle_buffer=shuffle, seed=1), total, B)
    epochs_seen = set()
    for k in (0, 1, 3, 9, 17, 26, 33):  # save points before, at and after epoch boundaries
        first = PackedStream(source, gpt2, T, shuffle_buffer=shuffle, seed=1)
        assert_same(batches(first, k, B), full[:k])
        state = json_round_trip(first.state_dict())
        epochs_seen.add(state["epoch"])
        resumed = PackedStream(source, gpt2, T, shuffle_buffer=shuffle, seed=1)
        resumed.load_state_dict(state)
        assert_same(batches(resumed, total - k, B), full[k:])
    assert len(epochs_seen) >= 3  # the saves fell in several epochs: resume across boundaries works
    # another world size continues the same global rows: W=2 state -> 1 process with the global batch
    pair = [PackedStream(source, gpt2, T, rank=r, world_size=2, shuffle_buffer=shuffle, seed=1) for r in (0, 1)]
    for _ in range(5):
        for s in pair:
            s.next_batch(1)
    single = PackedStream(source, gpt2, T, shuffle_buffer=shuffle, seed=1)
    single.load_state_dict(json_round_trip(pair[1].state_dict()))
    assert_same(batches(single, 3, B), full[5:8])


def test_resume_skips_documents_without_tokenizing(tmp_path: Path, gpt2: Tokenizer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    docs = word_docs(400, seed=8)
    source = write_jsonl(tmp_path / "docs.jsonl", docs)
    first = PackedStream(source, gpt2, 64)
    expect = batches(first, 30, 2)
    resumed = PackedStream(source, gpt2, 64)
    first = PackedStream(source, gpt2, 64)
    batches(first, 25, 2)
    state = json_round_trip(first.state_dict())
    assert state["docs_read"] > 100 and state["carry"]
    encoded: list[str] = []
    original = gpt2.encode_batch
    monkeypatch.setattr(gpt2, "encode_batch", lambda texts: encoded.extend(texts) or original(texts))
    resumed.load_state_dict(state)
    assert_same(batches(resumed, 5, 2), expect[25:])
    train = list(open_source(source).texts("train"))  # (document 99 is held out for val)
    assert encoded and encoded[0] == train[state["docs_read"]]  # the first text encoded is the next unread one
    assert len(encoded) <= len(train) - state["docs_read"]


@pytest.mark.parametrize("kind", ["local", "datasets"])
def test_resume_opens_the_source_at_its_saved_position(tmp_path: Path, kind: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume re-read every document already used (at the thesis's scale terabytes on every rank, a
    hub stream downloading them again): it now opens the source where the state says reading stood,
    a local corpus at the saved file (the files before it unread), a `datasets` stream from its own
    state (here `hf:<dir>`, the streaming json builder over four parts), and gives the uninterrupted
    batches, also with the held-out rule (no val files) and across the epoch's end."""
    from owai.data import text

    folder = tmp_path / "corpus"
    docs = [word_docs(30, seed=20 + i, blank_every=13) for i in range(4)]
    parts = [write_jsonl(folder / f"part-{i}.jsonl", d) for i, d in enumerate(docs)]
    records = [d for part in docs for d in part]  # the train split's records, val's every 100th among them
    source = str(folder) if kind == "local" else f"hf:{folder}"
    T, B, saved, total = 64, 4, 22, 50
    full = batches(PackedStream(source, "bytes", T), total, B)
    first = PackedStream(source, "bytes", T)
    batches(first, saved, B)
    state = json_round_trip(first.state_dict())
    position = state["source_position"]
    assert position["records"] > 60  # past the first two parts
    opened: list[str] = []
    read: list[str] = []
    if kind == "local":
        original = text.read_file
        monkeypatch.setattr(text, "read_file", lambda path, *a, **k: opened.append(Path(path).name) or original(path, *a, **k))
    original_texts_from = type(first.source).texts_from

    def texts_from(self, split, position=None):
        for t, after in original_texts_from(self, split, position):
            read.append(t)
            yield t, after

    monkeypatch.setattr(type(first.source), "texts_from", texts_from)
    resumed = PackedStream(source, "bytes", T)
    resumed.load_state_dict(state)
    assert_same(batches(resumed, total - saved, B), full[saved:])
    assert resumed.epoch >= 1  # the comparison ran on into the next epoch
    assert read[0] == records[position["records"]]  # the first document read is the one after the position
    if kind == "local":
        assert opened[0] == parts[position["file"]].name != parts[0].name
    # a state saved before positions (none in it) still resumes, by skipping the documents read
    old = {k: v for k, v in state.items() if k != "source_position"}
    again = PackedStream(source, "bytes", T)
    again.load_state_dict(old)
    assert_same(batches(again, 5, B), full[saved:saved + 5])
    # the same kill and resume through the prefetch thread (the training loop's reader): the state it
    # saves is the one after the last batch it handed out, though its thread had read further
    with Prefetcher(PackedStream(source, "bytes", T), B, 3) as ahead:
        assert_same(batches(ahead, saved, B), full[:saved])
        read_ahead(ahead, saved * B)
        assert json_round_trip(ahead.state_dict()) == state
    with Prefetcher(PackedStream(source, "bytes", T), B, 3) as resumed_ahead:
        resumed_ahead.load_state_dict(json_round_trip(ahead.state_dict()))
        assert_same(batches(resumed_ahead, total - saved, B), full[saved:])


@pytest.mark.parametrize("shuffle", [0, 5])
def test_prefetched_batches_and_states_are_the_streams_own(tmp_path: Path, gpt2: Tokenizer, shuffle: int) -> None:
    """The prefetch thread's batches are those of the stream read in the loop, bit for bit (rank 1 of 2,
    over several epochs), and its state after each batch is the stream's after that batch, while its
    thread has already read further (a checkpoint must hold the position of what the model consumed)."""
    source = write_jsonl(tmp_path / "docs.jsonl", word_docs(40, seed=3, blank_every=9))

    def stream() -> PackedStream:
        return PackedStream(source, gpt2, 24, rank=1, world_size=2, shuffle_buffer=shuffle, seed=2)

    direct = stream()
    expect = [(direct.next_batch(3), direct.state_dict()) for _ in range(25)]
    assert direct.epoch >= 2
    for depth in (0, 1, 4):
        with Prefetcher(stream(), 3, depth) as ahead:
            for i, (batch, state) in enumerate(expect):
                assert_same([ahead.next_batch(3)], [batch])
                if depth and i in (0, 11, 24):
                    read_ahead(ahead, state["rows"])
                    assert ahead.state_dict() == state
            assert ahead.state_dict() == direct.state_dict()
    # closed, then read again: it goes on from the last batch handed out, not from where its thread was
    ahead = Prefetcher(stream(), 3, 4)
    first = batches(ahead, 5, 3)
    read_ahead(ahead, expect[4][1]["rows"])
    ahead.close()
    assert_same(first + batches(ahead, 5, 3), [b for b, _ in expect[:10]])
    ahead.close()
    # a state loaded while the thread reads ahead: the batches it prepared are dropped, it goes on from the state
    ahead = Prefetcher(stream(), 3, 4)
    batches(ahead, 2, 3)
    state = ahead.state_dict()
    batches(ahead, 3, 3)
    read_ahead(ahead, expect[4][1]["rows"])
    ahead.load_state_dict(state)
    assert_same(batches(ahead, 3, 3), [b for b, _ in expect[2:5]])
    ahead.close()


def _broken_corpus(tmp_path: Path) -> Path:
    """145 good documents (past the first 64 encoded together), then a line that is not JSON, then more."""
    lines = [json.dumps({"text": d}) for d in word_docs(160, seed=4)]
    lines.insert(145, '{"text": "cut off')
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_an_error_in_the_prefetch_thread_is_raised_by_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A corrupt file met by the thread is the same one-line OwaiError the stream read in the loop
    raises, after the same batches; it is raised again by every later call (not a hang, not a batch
    from a stream stopped inside one). Any other exception keeps its traceback through the thread."""
    import traceback

    source = _broken_corpus(tmp_path)
    direct, before = PackedStream(source, "bytes", 16), []
    with pytest.raises(OwaiError) as expected:
        while True:
            before.append(direct.next_batch(2))
    assert "not a JSON line" in one_line_error(expected) and len(before) > 5
    for depth in (0, 3):
        ahead, got = Prefetcher(PackedStream(source, "bytes", 16), 2, depth), []
        with pytest.raises(OwaiError) as raised:
            while True:
                got.append(ahead.next_batch())
                if len(got) == 2:
                    state = ahead.state_dict()
        assert str(raised.value) == str(expected.value)
        assert_same(got, before)
        with pytest.raises(OwaiError) as again:
            ahead.next_batch()
        assert again.value is raised.value
        ahead.load_state_dict(state)  # a state loaded after the error: read again from there
        assert_same([ahead.next_batch()], before[2:3])
        ahead.close()
    stream = PackedStream(write_jsonl(tmp_path / "ok.jsonl", word_docs(200, seed=5)), "bytes", 16)
    calls = []

    def encode_batch(texts: list[str]) -> list[list[int]]:
        calls.append(len(texts))
        if len(calls) == 2:
            raise RuntimeError("the tokenizer broke")
        return [list(t.encode()) for t in texts]

    monkeypatch.setattr(stream.tokenizer, "encode_batch", encode_batch)
    with Prefetcher(stream, 2, 2) as ahead, pytest.raises(RuntimeError, match="the tokenizer broke") as broke:
        while True:
            ahead.next_batch()
    frames = "".join(traceback.format_exception(broke.value))
    assert "_produce" in frames and "encode_batch" in frames  # where the thread raised it


def test_the_prefetch_thread_never_holds_up_the_end_or_a_signal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() ends a thread blocked on its full queue at once; a caller waiting for a slow thread is
    stopped by SIGTERM (`Terminated`, as the CLI turns it into an interrupted run) or Ctrl-C at once,
    and the thread then ends with the batch it was making."""
    import os
    import signal
    import threading
    import time

    from owai.data import packing
    from owai.errors import Terminated, stop_on_termination

    source = write_jsonl(tmp_path / "docs.jsonl", word_docs(100, seed=7))
    ahead = Prefetcher(PackedStream(source, "bytes", 16), 2, 2)
    ahead.next_batch()
    read_ahead(ahead, 2 * 2)  # two more made: the queue is full, the thread waits for room
    time.sleep(0.3)
    assert ahead.stream.rows_emitted <= (1 + 2 + 1) * 2  # the batch handed out, 2 queued, 1 waiting for room: no more
    thread, start = ahead._thread, time.monotonic()
    ahead.close()
    assert thread is not None and not thread.is_alive() and time.monotonic() - start < 2
    release = threading.Event()
    slow = PackedStream(source, "bytes", 16)
    real = slow.next_batch
    monkeypatch.setattr(slow, "next_batch", lambda b: release.wait(60) and real(b))  # a batch that never comes
    monkeypatch.setattr(packing, "PREFETCH_CLOSE_S", 0.2)
    ahead = Prefetcher(slow, 2, 2)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    start = time.monotonic()
    with stop_on_termination(), pytest.raises(Terminated):
        timer.start()
        ahead.next_batch()
    assert time.monotonic() - start < 5
    thread = ahead._thread
    ahead.close()  # the thread is inside its batch: close gives up after PREFETCH_CLOSE_S; the daemon ends with it
    assert thread is not None and thread.daemon and thread.is_alive() and time.monotonic() - start < 5
    with pytest.raises(OwaiError, match="did not stop"):  # a second thread would read the stream beside it
        ahead.next_batch()
    release.set()
    thread.join(5)
    assert not thread.is_alive()


def test_the_wait_for_batches_is_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`wait_s` adds up the seconds `next_batch` waited for its batch (the training loop's data_wait_s):
    three batches of a stream that takes 0.1 s each, asked back to back, wait 0.3 s with a thread or not."""
    import time

    source = write_jsonl(tmp_path / "docs.jsonl", word_docs(30, seed=8))
    for depth in (0, 2):
        stream = PackedStream(source, "bytes", 16)
        real = stream.next_batch
        monkeypatch.setattr(stream, "next_batch", lambda b, real=real: time.sleep(0.1) or real(b))
        with Prefetcher(stream, 2, depth) as ahead:
            assert ahead.wait_s == 0.0
            batches(ahead, 3, 2)
            assert ahead.wait_s >= 0.25, (depth, ahead.wait_s)


def test_state_of_another_stream_is_refused(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", word_docs(5))
    state = PackedStream(source, "bytes", 8).state_dict()
    with pytest.raises(OwaiError) as excinfo:
        PackedStream(source, "bytes", 16).load_state_dict(state)
    assert "seq_len" in one_line_error(excinfo)
    with pytest.raises(OwaiError) as excinfo:
        PackedStream(source, "bytes", 8, shuffle_buffer=3).load_state_dict(state)
    assert "shuffle_buffer" in one_line_error(excinfo)


def test_shuffle_buffer_is_seeded_and_keeps_every_document(tmp_path: Path) -> None:
    docs = [f"doc{i:03d}" for i in range(30)]
    source = write_jsonl(tmp_path / "d.jsonl", docs)
    T = 7  # each document is 6 bytes + EOT = 7 tokens: row k (stride 7) starts at document k

    def order(seed: int) -> list[str]:
        rows = PackedStream(source, "bytes", T, shuffle_buffer=8, seed=seed).next_batch(30)["input_ids"]
        return [bytes(r[:6].tolist()).decode() for r in rows]

    a, b, c = order(0), order(0), order(1)
    assert a == b and a != c and a != docs
    assert sorted(a) == docs  # one epoch: each document exactly once, before the next epoch starts


def test_local_parquet_jsonl_and_datasets_json_builder_agree(tmp_path: Path, gpt2: Tokenizer) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = word_docs(30, seed=9)
    folder = tmp_path / "corpus"
    jsonl = write_jsonl(folder / "train.jsonl", docs)
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), parquet, row_group_size=7)
    streams = {"jsonl": PackedStream(jsonl, gpt2, 20), "parquet": PackedStream(parquet, gpt2, 20),
               # hf:<local dir>: HubSource -> datasets.load_dataset(dir, streaming=True), the json builder
               "datasets": PackedStream(f"hf:{folder}", gpt2, 20)}
    assert isinstance(streams["jsonl"].source, LocalSource) and isinstance(streams["datasets"].source, HubSource)
    out = {name: batches(s, 4, 3) for name, s in streams.items()}
    assert_same(out["jsonl"], out["parquet"])
    assert_same(out["jsonl"], out["datasets"])
    ref, _ = reference(docs, gpt2, None, gpt2.eot_id)
    assert len(ref) > 12 * 20
    assert np.array_equal(torch.cat([b["input_ids"] for b in out["datasets"]]).numpy().reshape(-1), ref[: 12 * 20])
    # resume through the datasets path as well
    state = json_round_trip(streams["datasets"].state_dict())
    again = PackedStream(f"hf:{folder}", gpt2, 20)
    again.load_state_dict(state)
    assert_same(batches(again, 2, 3), batches(streams["jsonl"], 2, 3))


@pytest.mark.parametrize("content", ["", "\n\n", '{"text": ""}\n{"text": "   "}\n{"text": "\\n\\t"}\n'])
def test_empty_or_blank_corpus_is_one_line_error(tmp_path: Path, content: str) -> None:
    source = tmp_path / "empty.jsonl"
    source.write_text(content)
    stream = PackedStream(source, "bytes", 8, shuffle_buffer=2)
    with pytest.raises(OwaiError) as excinfo:
        stream.check()
    assert "has no text" in one_line_error(excinfo)
    with pytest.raises(OwaiError) as excinfo:
        stream.next_batch(1)
    assert "has no text" in one_line_error(excinfo)
    PackedStream(write_jsonl(tmp_path / "ok.jsonl", ["", "x"]), "bytes", 8).check()  # one document is enough


def test_bad_arguments_are_one_line_errors(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", ["x"])
    for kwargs in ({"seq_len": 0}, {"seq_len": 4, "rank": 2, "world_size": 2}, {"seq_len": 4, "shuffle_buffer": -1}):
        with pytest.raises(OwaiError) as excinfo:
            PackedStream(source, "bytes", **kwargs)
        one_line_error(excinfo)
    with pytest.raises(OwaiError) as excinfo:
        PackedStream(tmp_path / "missing.jsonl", "bytes", 4)
    one_line_error(excinfo)


def test_a_changed_source_is_noted_with_where_the_resume_starts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A source changed since its state was saved (files touched) resumes at the saved position, not
    the document count the note used to name (which only a state without a position uses)."""
    import os

    path = write_jsonl(tmp_path / "c" / "part-0.jsonl", word_docs(40, seed=3))
    first = PackedStream(str(path.parent), "bytes", 16)
    batches(first, 3, 2)
    state = json_round_trip(first.state_dict())
    assert state["source_position"] is not None
    os.utime(path, ns=(1, 1))  # touched: another fingerprint
    for saved, where in ((state, "resuming at the saved position"),
                         ({k: v for k, v in state.items() if k != "source_position"}, "resuming at the saved document count")):
        PackedStream(str(path.parent), "bytes", 16).load_state_dict(saved)
        assert where in capsys.readouterr().err
