"""Language-model data layer: embedded stories, text sources, tokenizers, token shards, windows."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from owai.data import stories, text, tokens
from owai.data.stories import default_story_splits, generate_stories, iter_story_records
from owai.data.text import Tokenizer, load_texts, load_tokenizer, open_source
from owai.data.tokens import TokenWindows, prepare_tokens, token_dtype
from owai.errors import OwaiError

DOCS = generate_stories(240, seed=5)


def one_line_error(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert isinstance(excinfo.value, OwaiError) and message and "\n" not in message, message
    return message


def write_jsonl(path: Path, docs: list[str], field: str | None = None) -> Path:
    lines = [json.dumps(d if field is None else {field: d, "id": i}) for i, d in enumerate(docs)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


# --- the embedded corpus ------------------------------------------------------------------------


def test_stories_are_deterministic_and_repeat_their_cast() -> None:
    assert generate_stories(50, 1) == generate_stories(50, 1)
    assert generate_stories(50, 1) != generate_stories(50, 2)
    records = list(iter_story_records(400, 11))
    assert [r.text for r in records] == generate_stories(400, 11)
    repeated = [r.text.count(r.hero) >= 3 and r.text.count(r.friend) >= 2 and r.obj in r.text for r in records]
    assert sum(repeated) / len(records) > 0.95
    heroes = [r.hero for r in records]
    assert len(set(heroes)) > 300  # a large pool: names are not memorisable unigrams
    invented = [h for h in heroes if h not in stories.GIRL_NAMES + stories.BOY_NAMES]
    assert 0.35 < len(invented) / len(heroes) < 0.65 and len(set(invented)) > 0.9 * len(invented)
    assert len(stories.GIRL_NAMES) + len(stories.BOY_NAMES) >= 200 and len(stories.OBJECTS) >= 50
    assert len({r.text.split(".")[0] for r in records}) > 350  # openings vary


def test_default_splits_have_their_sizes_and_are_disjoint() -> None:
    train, val = default_story_splits()
    assert (len(train), len(val)) == (stories.DEFAULT_TRAIN_STORIES, stories.DEFAULT_VAL_STORIES)
    assert 5e6 < sum(map(len, train)) < 3e7
    assert not set(val[:100]) & set(train)


# --- local and hub sources ----------------------------------------------------------------------


def test_txt_formats(tmp_path: Path) -> None:
    docs = ["First story.\nIt has two lines.", "Second story.", "Third."]
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n".join(docs) + "\n\n\n")
    eot = tmp_path / "eot.txt"
    eot.write_text("Para one.\n\nPara two.\n<|endoftext|>\nNext story.\n<|endoftext|>\n")
    babi = tmp_path / "babi.txt"  # BabiStories: one JSON-encoded story per line
    write_jsonl(babi, docs)
    assert list(text.read_file(blank)) == docs
    assert list(text.read_file(eot)) == ["Para one.\n\nPara two.", "Next story."]
    assert list(text.read_file(babi)) == docs


def test_json_jsonl_parquet_and_gzip(tmp_path: Path) -> None:
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = DOCS[:7]
    assert list(text.read_file(write_jsonl(tmp_path / "a.jsonl", docs, "story"), "story")) == docs
    assert list(text.read_file(write_jsonl(tmp_path / "b.jsonl", docs))) == docs
    array = tmp_path / "c.json"
    array.write_text(json.dumps([{"text": d} for d in docs]))
    assert list(text.read_file(array)) == docs
    pq.write_table(pa.table({"text": docs, "n": list(range(7))}), tmp_path / "d.parquet")
    assert list(text.read_file(tmp_path / "d.parquet")) == docs
    with gzip.open(tmp_path / "e.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(d) for d in docs))
    assert list(text.read_file(tmp_path / "e.jsonl.gz")) == docs


def test_directory_splits(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", DOCS[:10])
    write_jsonl(tmp_path / "validation.jsonl", DOCS[10:12])
    assert list(load_texts(tmp_path, "train")) == DOCS[:10]
    assert list(load_texts(str(tmp_path), "validation")) == DOCS[10:12]
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "TinyStoriesV2-GPT4-train.txt").write_text("A.\n<|endoftext|>\nB.\n<|endoftext|>\n")
    (tiny / "TinyStoriesV2-GPT4-test.txt").write_text("C.\n<|endoftext|>\n")
    assert list(load_texts(tiny, "train")) == ["A.", "B."] and list(load_texts(tiny, "val")) == ["C."]


def test_held_out_rule_without_validation_split(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "all.jsonl", DOCS[:230])
    source = open_source(str(tmp_path / "all.jsonl"))
    val, train = list(source.texts("val")), list(source.texts("train"))
    assert val == [DOCS[99], DOCS[199]] and len(train) == 228 and not set(val) & set(train)
    assert "every 100th" in source.val_rule


def _make_7z(archive: Path, members: dict[str, str]) -> None:
    py7zr = pytest.importorskip("py7zr")
    with py7zr.SevenZipFile(archive, "w") as z:
        for name, content in members.items():
            z.writestr(content, name)


def test_babistories_7z_single_and_multivolume(tmp_path: Path, cache: Path) -> None:
    data = tmp_path / "BabiStories" / "data"
    data.mkdir(parents=True)
    train_lines = "\n".join(json.dumps(d) for d in DOCS[:30]) + "\n"
    _make_7z(data / "traindataset.txt.7z", {"traindataset.txt": train_lines})
    whole = tmp_path / "val.7z"
    _make_7z(whole, {"valdataset.txt": "\n".join(json.dumps(d) for d in DOCS[30:33]) + "\n"})
    raw = whole.read_bytes()
    for k, lo in enumerate(range(0, len(raw), 100), 1):  # 7z -v100b style volumes
        (data / f"valdataset.txt.7z.{k:03d}").write_bytes(raw[lo:lo + 100])
    assert k >= 2
    assert list(load_texts(data, "train", cache_dir=cache)) == DOCS[:30]
    assert list(load_texts(data, "val", cache_dir=cache)) == DOCS[30:33]
    extracted = sorted((cache / "extracted").iterdir())
    assert len(extracted) == 2 and all(not p.name.startswith(".") for p in extracted)
    assert list(load_texts(data, "val", cache_dir=cache)) == DOCS[30:33]  # reuses the extraction
    assert sorted((cache / "extracted").iterdir()) == extracted
    (data / "traindataset.txt").write_text(train_lines)  # extracted beside the archive: read once
    assert list(load_texts(data, "train", cache_dir=cache)) == DOCS[:30]


def test_source_errors_are_one_line(tmp_path: Path, cache: Path) -> None:
    with pytest.raises(OwaiError) as e:
        load_texts(str(tmp_path / "nope.jsonl"), "train")
    assert one_line_error(e).startswith("dataset path not found:")
    with pytest.raises(OwaiError) as e:
        load_texts("./missing_dir", "train")
    assert one_line_error(e).startswith("dataset path not found:")
    with pytest.raises(OwaiError) as e:  # a catalogue file named relative to the data root: the catalogue's line
        load_texts("text/sotu.tar.gz", "train", data_root=tmp_path / "empty")
    assert one_line_error(e).startswith(f"State of the Union addresses, 1790-2021 (233 .txt files in one tar.gz) not found in {tmp_path / 'empty'}; ")
    assert "$OWAI_DATA/text/sotu.tar.gz" in one_line_error(e)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"ok"\nnot json at all\n')
    with pytest.raises(OwaiError) as e:
        list(load_texts(bad, "train"))
    assert f"{bad}:2" in one_line_error(e)
    fake = tmp_path / "fake.parquet"
    fake.write_text("hello")
    with pytest.raises(OwaiError) as e:
        list(load_texts(fake, "train"))
    assert "not a parquet file" in one_line_error(e)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(bytes(range(128, 256)) * 10)
    with pytest.raises(OwaiError) as e:
        list(load_texts(binary, "train"))
    assert "not UTF-8" in one_line_error(e)
    write_jsonl(tmp_path / "obj.jsonl", ["x"], field="story")
    with pytest.raises(OwaiError) as e:
        list(load_texts(tmp_path / "obj.jsonl", "train"))
    assert "no field 'text'" in one_line_error(e)
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(OwaiError) as e:
        load_texts(tmp_path / "table.csv", "train")
    assert "unsupported" in one_line_error(e)
    broken = tmp_path / "broken.7z"
    broken.write_bytes(b"7z but not really")
    with pytest.raises(OwaiError) as e:
        list(load_texts(broken, "train", cache_dir=cache))
    assert "broken.7z" in one_line_error(e)
    with pytest.raises(OwaiError) as e:
        load_texts("owai-stories", "dev")
    one_line_error(e)
    with pytest.raises(OwaiError) as e:
        load_texts("owai-stories:lots", "train")
    one_line_error(e)


def test_hub_source_code_path_on_local_data(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    hub = tmp_path / "hub"
    hub.mkdir()
    pq.write_table(pa.table({"text": DOCS[:5]}), hub / "train.parquet")
    pq.write_table(pa.table({"text": DOCS[5:7]}), hub / "test.parquet")
    source = open_source(f"hf:{hub}")
    assert isinstance(source, text.HubSource)
    assert list(source.texts("train")) == DOCS[:5] and list(source.texts("val")) == DOCS[5:7]
    only_train = tmp_path / "only_train"
    only_train.mkdir()
    pq.write_table(pa.table({"text": DOCS[:150]}), only_train / "train.parquet")
    prepared = prepare_tokens(f"hf:{only_train}", "bytes", cache)
    assert prepared.meta["n_documents"] == {"train": 149, "val": 1} and "held out" in prepared.meta["val_rule"]

    def offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Couldn't reach 'roneneldan/TinyStories' on the Hub\n(LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert prepare_tokens(f"hf:{only_train}", "bytes", cache).root == prepared.root  # cached: no hub call
    source = open_source("roneneldan/TinyStories")
    assert isinstance(source, text.HubSource)
    with pytest.raises(OwaiError) as e:
        list(source.texts("train"))
    assert "roneneldan/TinyStories" in one_line_error(e)
    wiki = open_source("wikipedia:20220301.simple")
    assert (wiki.hub_id, wiki.config) == ("wikipedia", "20220301.simple")
    assert open_source("wikipedia", config_name="20220301.simple").fingerprint == wiki.fingerprint


# --- tokenizers --------------------------------------------------------------------------------

SAMPLE = 'Zorbel gave the lantern to Mira. Mira smiled at Zorbel. "Ünïcode ☃!" <|endoftext|> ok'


def test_bytes_tokenizer_round_trip() -> None:
    tok = load_tokenizer("bytes")
    assert (tok.vocab_size, tok.eot_id) == (257, 256)
    ids = tok.encode(SAMPLE)
    assert max(ids) < 256 and tok.decode(ids) == SAMPLE
    assert tok.encode_batch([SAMPLE, "a"]) == [ids, [97]]
    assert tok.decode([104, 105, 256, 104]) == "hi<|endoftext|>h"


def test_bpe_tokenizer_trained_cached_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    texts = DOCS[:150]
    tok = load_tokenizer("bpe-600", tmp_path / "a", texts)
    assert tok.name == "bpe-600" and tok.vocab_size == 600 and tok.eot_id == 0
    for sample in (SAMPLE, texts[0]):
        assert tok.decode(tok.encode(sample)) == sample
    assert tok.eot_id not in tok.encode(SAMPLE)  # a literal <|endoftext|> is ordinary text
    assert len(tok.encode(texts[0])) < len(texts[0].encode()) / 2
    assert load_tokenizer("bpe-600", tmp_path / "b", texts).fingerprint == tok.fingerprint
    assert len(list((tmp_path / "a" / "tokenizers").rglob("tokenizer.json"))) == 1
    monkeypatch.setattr(text, "train_bpe", lambda *a: pytest.fail("retrained a cached tokenizer"))
    assert load_tokenizer("bpe-600", tmp_path / "a", texts).fingerprint == tok.fingerprint
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(SAMPLE) == tok.encode(SAMPLE)
    with pytest.raises(OwaiError) as e:
        load_tokenizer("bpe-600", tmp_path / "c", corpus_fingerprint="unseen")
    one_line_error(e)
    with pytest.raises(OwaiError) as e:
        load_tokenizer("bpe-100", tmp_path / "c", texts)
    one_line_error(e)


def test_local_tokenizer_directory_and_json(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    backend = text.train_bpe(DOCS[:60], 400)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(tmp_path / "tok")
    for name in (str(tmp_path / "tok"), str(tmp_path / "tok" / "tokenizer.json")):
        tok = load_tokenizer(name)
        assert tok.eot_id == backend.token_to_id("<|endoftext|>") and tok.vocab_size == backend.get_vocab_size()
        assert tok.decode(tok.encode(SAMPLE)) == SAMPLE


def test_gpt2_tokenizer_from_its_bpe_files(shared_data: Path) -> None:
    """The real GPT-2 tokenizer (encoder.json + vocab.bpe under the data root, `tokenizers/gpt2`):
    50,257 tokens, <|endoftext|> = 50256, and the hub's ids for a known sentence."""
    tok = load_tokenizer("tokenizers/gpt2")
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's ids (tiktoken's gpt2, the hub's tokenizer)
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE and 50256 not in tok.encode(SAMPLE)


def test_gpt2_hub_tokenizer_offline_fails_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection.")

    import owai.data.text as text

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    monkeypatch.setattr(text, "_hub_cached", lambda name: False)
    monkeypatch.setattr(text, "hub_unreachable", lambda: "")  # the probe passes, the download fails
    with pytest.raises(OwaiError) as e:
        load_tokenizer("gpt2")
    message = one_line_error(e)
    assert "cannot fetch tokenizer 'gpt2' from the Hugging Face hub" in message
    assert "use tokenizer=bytes or bpe-N offline" in message
    monkeypatch.setattr(text, "hub_unreachable", lambda: "the hub (huggingface.co) is unreachable (test)")
    with pytest.raises(OwaiError, match="not in the local Hugging Face cache and the hub .* is unreachable"):
        load_tokenizer("gpt2")  # no connection: fails at once, before transformers is asked


def test_check_tokenizer_fails_fast() -> None:
    from owai.data.text import check_tokenizer

    check_tokenizer("bytes")
    check_tokenizer("bpe-4096")
    for name, fragment in (("bpe-0", "between 258"), ("bpe-99999999", "between 258"), ("./no/such/dir", "no such file")):
        with pytest.raises(OwaiError, match=fragment):
            check_tokenizer(name)


def test_a_missing_data_root_tokenizer_says_how_to_fetch_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tokenizers/gpt2` (RULER's reference tokenizer) is a folder under the data root, not a hub id:
    when it is nowhere, the error names where it was looked for and `owai data fetch gpt2`, not the hub."""
    from owai.data.text import check_tokenizer, resolve_tokenizer

    data, work = tmp_path / "data", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("OWAI_DATA", str(data))
    monkeypatch.chdir(work)
    for name in ("tokenizers/gpt2", "tokenizers/gpt2/"):
        with pytest.raises(OwaiError) as e:
            check_tokenizer(name)
        message = one_line_error(e)
        assert f"not found in $OWAI_DATA ({data / 'tokenizers' / 'gpt2'}: $OWAI_DATA={data} does not exist)" in message
        assert "owai data fetch gpt2" in message
        assert "Hugging Face" not in message
    (data / "tokenizers" / "gpt2").mkdir(parents=True)
    assert resolve_tokenizer("tokenizers/gpt2") == str(data / "tokenizers" / "gpt2")
    with pytest.raises(OwaiError, match="cannot fetch tokenizer"):  # found, and read: an empty folder holds none
        check_tokenizer("tokenizers/gpt2")


# --- token shards ------------------------------------------------------------------------------


def _split_dir(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", DOCS[:200])
    write_jsonl(data / "val.jsonl", DOCS[200:220])
    return data


def test_prepare_bytes_layout_and_meta(tmp_path: Path, cache: Path) -> None:
    data = _split_dir(tmp_path)
    prepared = prepare_tokens(str(data), "bytes", cache)
    expected = np.concatenate([np.append(np.frombuffer(d.encode(), np.uint8), 256) for d in DOCS[:200]])
    stored = np.fromfile(prepared.path("train"), dtype=np.uint16)
    assert prepared.dtype == np.uint16 and np.array_equal(stored, expected)
    assert (stored == 256).sum() == 200 and stored[-1] == 256  # one eot after every document
    meta = json.loads((prepared.root / "meta.json").read_text())
    assert meta == prepared.meta
    assert {k: meta[k] for k in ("tokenizer", "vocab_size", "eot_id", "dtype", "format_version")} == {
        "tokenizer": "bytes", "vocab_size": 257, "eot_id": 256, "dtype": "uint16", "format_version": 1}
    assert meta["n_tokens"] == {"train": len(expected), "val": sum(len(d.encode()) + 1 for d in DOCS[200:220])}
    assert meta["n_documents"] == {"train": 200, "val": 20}
    assert meta["source_fingerprint"] and "val.jsonl" in meta["val_rule"]
    assert prepared.root.is_relative_to(cache / "tokens")


def test_prepare_is_idempotent_and_atomic(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _split_dir(tmp_path)
    first = prepare_tokens(str(data), "bytes", cache)
    stamp = first.path("train").stat().st_mtime_ns
    monkeypatch.setattr(tokens, "_build", lambda *a: pytest.fail("rebuilt a complete cache"))
    again = prepare_tokens(str(data), "bytes", cache)
    assert again.root == first.root and again.path("train").stat().st_mtime_ns == stamp
    monkeypatch.undo()
    # a leftover temporary directory (killed run) and a half-written cache are never used; a rebuild
    # removes the folders of this host's processes that are gone, and keeps a live one's, another
    # host's and an old unnamed one
    import socket
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    host = socket.gethostname()
    folders = {name: first.root.parent / f".{first.root.name}.tmp-{name}"
               for name in ("dead", f"{host}-{gone}-x1", f"{host}-{os.getpid()}-x2", f"elsewhere-{gone}-x3")}
    for folder in folders.values():
        folder.mkdir()
        (folder / "train.bin").write_bytes(b"\0\0")
    with open(first.path("val"), "r+b") as f:
        f.truncate(10)
    rebuilt = prepare_tokens(str(data), "bytes", cache)
    assert rebuilt.path("val").stat().st_size == 2 * rebuilt.n_tokens["val"]
    assert {name for name, folder in folders.items() if folder.is_dir()} == {"dead", f"{host}-{os.getpid()}-x2", f"elsewhere-{gone}-x3"}
    # a crash while writing leaves no cache directory behind
    other = tmp_path / "other.jsonl"
    write_jsonl(other, DOCS[:150])
    real = tokens._write_split

    def crash(src, split, *args):  # noqa: ANN001, ANN202
        if split == "val":
            raise KeyboardInterrupt
        return real(src, split, *args)

    monkeypatch.setattr(tokens, "_write_split", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_tokens(str(other), "bytes", cache)
    source_dir = next(p for p in (cache / "tokens").iterdir() if p.name.startswith(text.slug(str(other))))
    assert list(source_dir.iterdir()) == []


def test_prepare_bpe_workers_and_stories(tmp_path: Path, cache: Path) -> None:
    one = prepare_tokens("owai-stories:400", "bpe-512", cache, workers=1)
    assert one.tokenizer.vocab_size == 512 and one.meta["n_documents"] == {"train": 400, "val": 10}
    train = np.fromfile(one.path("train"), dtype=np.uint16)
    assert (train == one.eot_id).sum() == 400 and train[-1] == one.eot_id
    first_doc = train[: int(np.argmax(train == one.eot_id))]
    assert one.tokenizer.decode(first_doc.tolist()) == generate_stories(1, stories.TRAIN_SEED)[0]
    two = prepare_tokens("owai-stories:400", one.tokenizer, tmp_path / "cache2", workers=2)
    assert np.array_equal(np.fromfile(two.path("train"), dtype=np.uint16), train)
    same = load_tokenizer("bpe-512", cache, source="owai-stories:400")  # the cached tokenizer, by source
    assert same.fingerprint == one.tokenizer.fingerprint


class _WideTokenizer(Tokenizer):
    """Bytes shifted past 65535, to exercise the uint32 rule."""

    name, vocab_size, eot_id, fingerprint = "wide", 70_000, 69_999, "wide-v1"

    def encode(self, s: str) -> list[int]:
        return [66_000 + b for b in s.encode()]

    def decode(self, ids) -> str:  # noqa: ANN001
        return bytes(i - 66_000 for i in ids if i != self.eot_id).decode()


def test_dtype_rule_and_empty_validation(tmp_path: Path, cache: Path) -> None:
    assert token_dtype(257) == np.uint16 and token_dtype(50257) == np.uint16
    assert token_dtype(65535) == np.uint16 and token_dtype(65536) == np.uint32
    prepared = prepare_tokens(str(_split_dir(tmp_path)), _WideTokenizer(), cache)
    assert prepared.dtype == np.uint32 and prepared.meta["dtype"] == "uint32"
    stored = np.fromfile(prepared.path("val"), dtype=np.uint32)
    assert stored.max() == 69_999 and prepared.windows("val", 8).batch(2, torch.Generator())[0].max() >= 66_000
    few = tmp_path / "few.jsonl"
    write_jsonl(few, DOCS[:50])
    with pytest.raises(OwaiError) as e:
        prepare_tokens(str(few), "bytes", cache)
    assert "no val documents" in one_line_error(e)


# --- windows -----------------------------------------------------------------------------------


def _bin(tmp_path: Path, n: int, dtype: type = np.uint16) -> Path:
    path = tmp_path / "split.bin"
    np.arange(n, dtype=dtype).tofile(path)
    return path


def test_windows_batches(tmp_path: Path) -> None:
    windows = TokenWindows(_bin(tmp_path, 1000), np.uint16, block_size=32)
    assert windows.n_tokens == 1000 and windows.n_offsets == 1000 - 32 - 2
    x, y = windows.batch(16, torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (16, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # data[i] == i, so y = data[i+1 : i+T+1]
    offsets = torch.randint(1000 - 32 - 2, (16,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(x[:, 0], offsets)  # the reference's uniform offsets over len - T - 2
    again, _ = windows.batch(16, torch.Generator().manual_seed(3))
    other, _ = windows.batch(16, torch.Generator().manual_seed(4))
    assert torch.equal(x, again) and not torch.equal(x, other)
    g = torch.Generator().manual_seed(0)
    many = torch.cat([windows.batch(64, g)[0][:, 0] for _ in range(50)])
    assert int(many.min()) >= 0 and int(many.max()) <= 1000 - 32 - 3


def test_windows_sequential_and_short_split(tmp_path: Path) -> None:
    windows = TokenWindows(_bin(tmp_path, 100), "uint16", block_size=10)
    chunks = list(windows.sequential(10, batch_size=4))
    xs = torch.cat([x for x, _ in chunks])
    assert xs.shape == (9, 10) and torch.equal(xs.flatten(), torch.arange(90))
    assert all(torch.equal(y, x + 1) for x, y in chunks)
    assert len(list(windows.sequential(10, max_windows=3))) == 3
    longer = windows.with_block_size(30)
    assert longer.batch(2, torch.Generator())[0].shape == (2, 30) and len(list(longer.sequential())) == 3
    tiny = TokenWindows(_bin(tmp_path, 11), np.uint16, block_size=10)  # exactly one window
    x, y = tiny.batch(3, torch.Generator())
    assert torch.equal(x[0], torch.arange(10)) and torch.equal(y[0], torch.arange(1, 11))
    with pytest.raises(OwaiError) as e:
        TokenWindows(_bin(tmp_path, 50), np.uint16, block_size=64)
    message = one_line_error(e)
    assert "50 tokens" in message and "65" in message
    with pytest.raises(OwaiError) as e:
        TokenWindows(_bin(tmp_path, 0), np.uint16, block_size=64)
    assert "0 tokens" in one_line_error(e)


def test_cache_root_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "c"))
    assert text.cache_root() == tmp_path / "c"
    monkeypatch.delenv("OWAI_CACHE")
    assert text.cache_root() == Path.home() / ".cache" / "owai"
    assert text.cache_root(tmp_path) == tmp_path
    assert os.fspath(text.cache_root("~/x")).startswith(os.path.expanduser("~"))


def test_the_byte_tokenizer_decodes_ids_past_its_vocabulary_to_nothing() -> None:
    """A model's embedding is padded past the 257 byte ids (to a multiple of 64): a sampled padded
    id was a ValueError ("byte must be in range(0, 256)") at the end of a bytes-tokenizer run."""
    from owai.data.text import load_tokenizer

    tok = load_tokenizer("bytes")
    ids = tok.encode("ab")
    assert tok.decode([*ids, 300, 319, tok.eot_id, *ids]) == "ab<|endoftext|>ab"
    assert tok.decode([*ids, 300], skip_special=True) == "ab"


def test_a_local_copy_of_another_dump_is_not_read_for_the_named_config(tmp_path: Path) -> None:
    """Fig 3.9 names Wikipedia's 20220301.simple dump; `owai data fetch wikipedia` gets 20231101.simple.
    With that copy in the data root, the named config must not be read from it silently."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "text" / "wikipedia"
    (folder / "20231101.simple").mkdir(parents=True)
    (folder / "owai-manifest.json").write_text("{}")
    pq.write_table(pa.table({"text": DOCS[:20]}), folder / "20231101.simple" / "train.parquet")
    with pytest.raises(OwaiError) as e:
        open_source("wikipedia", config_name="20220301.simple", data_root=tmp_path)
    message = one_line_error(e)
    assert "'20220301.simple' is not in the local copy" in message and "holds 20231101.simple" in message
    assert "hf:wikipedia" in message
    held = open_source("wikipedia", config_name="20231101.simple", data_root=tmp_path)
    assert isinstance(held, text.LocalSource) and list(held.texts("train"))[:2] == DOCS[:2]
    assert isinstance(open_source("wikipedia", data_root=tmp_path), text.LocalSource)  # no config: the copy


@pytest.mark.parametrize("spec, looked_up", [
    ("babistories", True), ("text/sotu.tar.gz", True), ("gpt2", True), ("tokenizers/gpt2", True),
    ("bytes", False), ("bpe-2048", False), ("owai-stories", False), ("owai-stories:200", False),
    ("hf:roneneldan/TinyStories", False), ("/abs/corpus", False), ("~/corpus", False), ("", False),
])
def test_which_specs_the_data_root_rule_can_reach(spec: str, looked_up: bool) -> None:
    """The one rule behind mosaic-train's refusal of an unused --data-root (`data_root_unused`)."""
    from owai.data.text import looks_under_data_root

    assert looks_under_data_root(spec) is looked_up


def test_the_token_cache_is_keyed_by_the_tokenizer_content_not_its_name(tmp_path: Path) -> None:
    """A saved model's tokenizer.json (named by its path) reuses the tokens cached under the name its
    training run gave the same tokenizer (mosaic-eval tokenized the corpus again for every saved
    model); another eot id is another cache."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    backend = Backend(WordLevel({"a": 0, "b": 1, text.EOT_TEXT: 2, "[UNK]": 3}, unk_token="[UNK]"))
    trained = text.HFTokenizer("bpe-2048", backend, 2)
    saved = text.HFTokenizer(str(tmp_path / "runs" / "x" / "models" / "gpt" / "tokenizer.json"), backend, 2)
    other_eot = text.HFTokenizer("bpe-2048", backend, 1)
    src = open_source("stories")
    folder = {name: tokens._cache_dir(src, tok, tmp_path)[0] for name, tok in
              (("trained", trained), ("saved", saved), ("other", other_eot))}
    assert folder["trained"] == folder["saved"] != folder["other"]
