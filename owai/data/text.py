"""Text sources and tokenizers for the language-model experiments (thesis §3.5, App. B.2/B.3).

Sources (`open_source` / `load_texts`), each giving a `train` and a `val` split of documents:

* `"babistories"`, `"tinystories"`, `"wikipedia"`: corpora of the data catalogue
  (`owai.data.registry`), read from the local copy the data-root rule finds (`--data-root`,
  $OWAI_DATA/text/<name>, the cache; BabiStories also $OWAI_BABISTORIES = the `BabiStories/data`
  directory of a MemoryMosaics clone, 7z parts); without one, tinystories and wikipedia fall back to
  their hub ids and babistories is a one-line error with the manual step. A relative path that does
  not exist here is looked up under the data root too.
* `"owai-stories"`: the embedded seeded corpus (`owai.data.stories`, 20k/500 stories);
  `"owai-stories:N"` uses N training stories and max(1, N // 40) validation stories.
* A Hugging Face dataset id, optionally `id:config` (`roneneldan/TinyStories`,
  `wikipedia:20220301.simple`); `hf:` forces the hub. Read with `datasets.load_dataset`
  (streaming by default); needs network access or a populated Hugging Face cache.
* A local path: a file or a directory (searched recursively, hidden names skipped).
  - `.txt`: plain text. Documents are separated by lines holding only `<|endoftext|>` when the
    first 64 KiB contain such a line (TinyStoriesV2 files), otherwise by blank lines; newlines
    inside a document are kept. A `.txt` whose first five non-empty lines are each a complete
    JSON string (BabiStories `traindataset.txt`) is read as JSON lines instead.
  - `.jsonl` / `.json`: one JSON value per line (a string is the document itself, as in
    BabiStories; an object gives `obj[text_field]`); a `.json` file starting with `[` is one
    array of such values.
  - `.parquet`: the `text_field` column, streamed in record batches with pyarrow.
  - `.7z` / `.7z.001` (+ `.002` ...): a 7-Zip archive (BabiStories `data/traindataset.txt.7z`),
    extracted once with py7zr into the cache (`<cache>/extracted/`), members read as above. An
    archive is skipped when the extracted file sits beside it.
  - `.gz` after any of the text suffixes is decompressed on the fly.
  Directory files are assigned to splits by name: a name part (split on `-_. `) starting with
  `train` is training data, one starting with `val` (val, valid, validation, valdataset) is
  validation data, else one starting with `test` serves as validation data.

Validation split: the source's own when it has one; otherwise every 100th document of the single
stream (0-based index i with i % 100 == 99) is held out, in the source's own order, and the other
99% form `train` (deterministic, needs no shuffling or counting).

Tokenizers (`load_tokenizer`): `"gpt2"` (or any hub id / local tokenizer directory /
tokenizer.json) through `transformers`, `"bytes"` (256 byte ids + eot 256), and `"bpe-N"`, a
byte-level BPE trained with `tokenizers` on the corpus and cached by (corpus fingerprint, N).
Every tokenizer encodes text the way tiktoken's `encode_ordinary` does: a literal
`<|endoftext|>` in a document is ordinary text, never the eot id.

Every user error is an `OwaiError` with a one-line message.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import itertools
import json
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from owai.data import registry, stories
from owai.errors import DataMissing, OwaiError, not_utf8, one_line
from owai.hub import hub_unreachable
from owai.io import (atomic_write_json, atomic_write_text, build_lock, cache_root, cannot_write, folder_to_build,  # cache_root: tokens.py
                     remove_dead_builds)  # uses it from here

SPLITS = ("train", "val")
SPLIT_ALIASES = {"train": "train", "val": "val", "valid": "val", "validation": "val"}
HELD_OUT_EVERY = 100  # without a validation split, document i goes to val iff i % 100 == 99
HUB_VAL_SPLITS = ("validation", "valid", "val", "test")
EOT_TEXT = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
BPE_TRAIN_MAX_CHARS = 50_000_000  # bpe-N learns its merges from the first 50M characters of train
SOURCE_FORMAT = 1  # bump when reading rules change (keys caches)


# --- small helpers ---------------------------------------------------------------------------


def digest(*parts: Any) -> str:
    """A short stable hash of JSON-serialisable parts (cache keys)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def slug(text: str) -> str:
    """A filesystem-safe short name for `text` (cache directory names)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")[-48:] or "x"


def canonical_split(split: str) -> str:
    """`train` or `val` (accepting `valid`/`validation`); anything else is a user error."""
    if split not in SPLIT_ALIASES:
        raise OwaiError(f"unknown split {split!r} (expected train or val)")
    return SPLIT_ALIASES[split]


def _kept(i: int, split: str, every: int) -> bool:
    """The documented held-out rule of a source without a validation split: record i (0-based) is
    validation iff every `every`-th (default HELD_OUT_EVERY); whether it belongs to `split`."""
    return (i % every == every - 1) == (split == "val")


Position = dict[str, Any]  # where a source's reading stands after a document: plain JSON data


# --- sources ---------------------------------------------------------------------------------


class TextSource:
    """A corpus with `train` and `val` document streams, a content fingerprint and a val rule."""

    name: str
    fingerprint: str
    val_rule: str

    def texts(self, split: str) -> Iterator[str]:
        """Stream the documents of `split` (train or val), in a fixed order."""
        raise NotImplementedError

    def texts_from(self, split: str, position: Position | None = None) -> Iterator[tuple[str, Position | None]]:
        """The documents of `split` as `texts` gives them, each with the position after it, from
        `position` (one this method gave; None: the first document). A resumed stream (owai.data.packing)
        starts there instead of reading again every document before it. A source that cannot seek
        gives None positions, and its reader skips documents by count."""
        if position is not None:
            raise OwaiError(f"source {self.name} cannot resume from a position")
        return ((text, None) for text in self.texts(split))


class StorySource(TextSource):
    """The embedded seeded corpus (`owai.data.stories`)."""

    def __init__(self, name: str, n_train: int, n_val: int) -> None:
        self.name, self.n_train, self.n_val = name, n_train, n_val
        self.fingerprint = digest("owai-stories", stories.GENERATOR_VERSION, n_train, n_val,
                                  stories.TRAIN_SEED, stories.VAL_SEED)
        self.val_rule = f"generated: {n_val} stories from seed {stories.VAL_SEED}"

    def texts(self, split: str) -> Iterator[str]:
        if canonical_split(split) == "train":
            return stories.iter_stories(self.n_train, stories.TRAIN_SEED)
        return stories.iter_stories(self.n_val, stories.VAL_SEED)


HUB_DATASET_HINT = ("; it is not a local path either: check the id/config and network access, or use owai-stories "
                    "or a local path")


class HubSource(TextSource):
    """A Hugging Face dataset, read with `datasets.load_dataset` (streaming by default)."""

    def __init__(self, hub_id: str, config: str | None, text_field: str, revision: str | None = None,
                 streaming: bool = True, val_every: int = HELD_OUT_EVERY) -> None:
        self.hub_id, self.config, self.text_field = hub_id, config, text_field
        self.revision, self.streaming, self.val_every = revision, streaming, val_every
        self.name = hub_id + (f":{config}" if config else "")
        self.fingerprint = digest("hf", hub_id, config, revision, text_field, SOURCE_FORMAT,
                                  *([val_every] if val_every != HELD_OUT_EVERY else []))
        self.val_rule = f"the dataset's validation split (else every {val_every}th train document)"
        self._splits: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        """All splits of the dataset (a network call the first time); errors become OwaiError."""
        if self._splits is None:
            from owai.hub import load_dataset

            loaded = load_dataset(self.hub_id, self.config, revision=self.revision, streaming=self.streaming,
                                  what=f"dataset {self.name!r}", hint=HUB_DATASET_HINT)
            self._splits = dict(loaded)
        return self._splits

    def check_readable(self, cached_elsewhere: Callable[[], bool] | None = None) -> None:
        """Before a run directory exists: where the hub cannot be reached (offline mode, no
        connection), the dataset must be in the local Hugging Face datasets cache, else one
        DataMissing line. The source itself is lazy (`_load`), so without this check the same error
        came only inside the run, leaving a failed run directory behind. `cached_elsewhere()`: the
        run reads no text because another cache holds what it needs (owai's token cache)."""
        if Path(self.hub_id).expanduser().exists():
            return  # a local dataset folder read through `datasets` (owai.hub.load_dataset asks no hub)
        problem = hub_unreachable()
        if not problem or (cached_elsewhere is not None and cached_elsewhere()):
            return
        import importlib.util

        if importlib.util.find_spec("datasets") is None:
            raise DataMissing(f"loading dataset {self.name!r} needs the `datasets` package: pip install datasets")
        from owai.hub import dataset_cached

        if not dataset_cached(self.hub_id, self.config, revision=self.revision):
            raise DataMissing(f"cannot load dataset {self.name!r} from the Hugging Face hub (not in the local Hugging "
                              f"Face datasets cache; read from the local cache only: {problem}){HUB_DATASET_HINT}")

    def _pick(self, split: str) -> tuple[Any, bool]:
        """(hub split, whether to apply the held-out rule to it) for our `split`."""
        splits = self._load()
        if "train" not in splits:
            raise OwaiError(f"Hugging Face dataset {self.name!r} has no train split (it has {sorted(splits)})")
        if split == "val":
            for name in HUB_VAL_SPLITS:
                if name in splits:
                    self.val_rule = f"the dataset's {name!r} split"
                    return splits[name], False
        hold_out = all(name not in splits for name in HUB_VAL_SPLITS)
        if hold_out:
            self.val_rule = f"held out: every {self.val_every}th train document (no validation split)"
        return splits["train"], hold_out

    def texts(self, split: str) -> Iterator[str]:
        return (text for text, _ in self.texts_from(split))

    def texts_from(self, split: str, position: Position | None = None) -> Iterator[tuple[str, Position | None]]:
        """As `texts`, each document with the position after it: the records read and the streamed
        dataset's own state (`datasets.IterableDataset.state_dict`), which a resume loads into a copy of
        the split, so it reads on from that shard and row instead of from the corpus's first document
        (at the thesis's scale, terabytes again on every rank). A split read whole (streaming off) has
        no such state: its positions are None."""
        split = canonical_split(split)
        data, hold_out = self._pick(split)
        records = 0
        if position is not None:
            import pickle

            # a copy, so that the split itself still starts at its first record (the next epoch); pickled, as
            # a DataLoader worker receives it: `copy.deepcopy` of a streamed split fails outside the main thread
            # (the prefetch thread of owai.data.packing), since huggingface_hub keeps one HfFileSystem per
            # thread and adding this thread's to its instance cache changes the dict deepcopy walks
            data = pickle.loads(pickle.dumps(data))
            try:
                data.load_state_dict(position["hub"])
                records = int(position["records"])
            except Exception as exc:  # noqa: BLE001 - a state of another datasets release or dataset
                raise OwaiError(f"Hugging Face dataset {self.name!r}: cannot resume its stream from the saved "
                                f"position ({one_line(exc)})") from None
        return self._positioned(data, split, hold_out, records)

    def _positioned(self, data: Any, split: str, hold_out: bool, records: int) -> Iterator[tuple[str, Position | None]]:
        """`texts_from`'s documents of split `data` (the held-out rule applied when `hold_out`), after
        `records` records already read."""
        seekable = hasattr(data, "state_dict")
        for text in self._records(data):
            records += 1
            if not hold_out or _kept(records - 1, split, self.val_every):
                yield text, ({"records": records, "hub": data.state_dict()} if seekable else None)

    def _records(self, data: Iterable[dict[str, Any]]) -> Iterator[str]:
        try:
            for record in data:
                if self.text_field not in record:
                    raise OwaiError(f"Hugging Face dataset {self.name!r} has no field {self.text_field!r} "
                                    f"(fields: {', '.join(sorted(record))}); set text_field")
                yield _as_text(record[self.text_field], f"Hugging Face dataset {self.name!r}")
        except OwaiError:
            raise
        except Exception as exc:
            raise OwaiError(f"reading Hugging Face dataset {self.name!r} failed ({one_line(exc)})") from None


class LocalSource(TextSource):
    """Files on disk: one file, or a directory of split files (see the module docstring)."""

    def __init__(self, path: Path, text_field: str, cache_dir: str | Path | None, val_every: int = HELD_OUT_EVERY) -> None:
        self.path, self.text_field, self.cache_dir, self.val_every = path, text_field, cache_dir, val_every
        self.name = str(path)
        self.files = _split_files(path)
        stats = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in _all_parts(self.files)]
        self.fingerprint = digest("local", str(path.resolve()), text_field, stats, SOURCE_FORMAT,
                                  *([val_every] if val_every != HELD_OUT_EVERY else []))
        if self.files["val"]:
            self.val_rule = "validation files: " + ", ".join(f.name for f in self.files["val"])
        else:
            self.val_rule = f"held out: every {val_every}th document (index % {val_every} == {val_every - 1})"

    def texts(self, split: str) -> Iterator[str]:
        return (text for text, _ in self.texts_from(split))

    def texts_from(self, split: str, position: Position | None = None) -> Iterator[tuple[str, Position | None]]:
        """As `texts`, each document with the position after it: its file, the documents read in that
        file, and the records read in all. A resume opens that file and skips only its documents before
        the position: the files before it are not read again (a corpus of many parquet or jsonl parts)."""
        split = canonical_split(split)
        files = self.files[split] if self.files["val"] else self.files["train"]
        hold_out = not self.files["val"]
        first, in_file, records = 0, 0, 0
        if position is not None:
            first, in_file, records = int(position["file"]), int(position["in_file"]), int(position["records"])
            if not 0 <= first < len(files):
                raise OwaiError(f"source {self.name} ({split}) has {len(files)} files, and the stream's saved position "
                                f"is in file {first + 1}: the data changed since it was saved")
        return self._positioned(files, split, hold_out, first, in_file, records)

    def _positioned(self, files: list[Path], split: str, hold_out: bool, first: int, in_file: int,
                    records: int) -> Iterator[tuple[str, Position | None]]:
        """`texts_from`'s documents of `files` from file `first`, after `in_file` of its documents and
        `records` in all (the held-out rule applied when `hold_out`)."""
        for index in range(first, len(files)):
            docs = read_file(files[index], self.text_field, self.cache_dir)
            done = 0
            if index == first and in_file:
                done = sum(1 for _ in itertools.islice(docs, in_file))
                if done < in_file:
                    raise OwaiError(f"{files[index]} has {done} documents, fewer than the {in_file} the stream's "
                                    "saved position says were read: the data changed since it was saved")
            for text in docs:
                done += 1
                records += 1
                if not hold_out or _kept(records - 1, split, self.val_every):
                    yield text, {"file": index, "in_file": done, "records": records}

    def check_nonempty(self) -> None:
        """Raise unless the training files hold a non-blank document (read up to the first one;
        7z archives are skipped here: they are checked when extracted)."""
        plain = [f for f in self.files["train"] if _suffix(f) != ".7z"]
        if len(plain) != len(self.files["train"]):
            return
        for file in plain:
            if any(text.strip() for text in read_file(file, self.text_field, self.cache_dir)):
                return
        raise OwaiError(f"dataset {self.path}: no text in its training files (empty or blank)")


# Corpora of the data catalogue (owai.data.registry) that a source may name: a local copy found by
# the data-root rule wins; otherwise the hub id (None: no hub copy, the corpus must be local).
NAMED_CORPORA = {"babistories": None, "tinystories": "roneneldan/TinyStories", "wikipedia": "wikipedia"}
TINYSTORIES_FILES = ("TinyStoriesV2-GPT4-train.txt", "TinyStoriesV2-GPT4-valid.txt")


@registry.register
def catalogue_entries() -> list[registry.Dataset]:
    """The text corpora in the data catalogue (BabiStories by hand; the others from the hub)."""
    return [
        registry.Dataset("babistories", "BabiStories (Memory Mosaics)", "text/babistories", "0.6 GB", (),
                         manual="BabiStories: clone https://github.com/facebookresearch/MemoryMosaics and copy its "
                                "BabiStories/data folder to $OWAI_DATA/text/babistories (or pass --data-root)",
                         legacy_env=BABISTORIES_ENV),
        registry.Dataset("tinystories", "TinyStories V2 (GPT-4 stories)", "text/tinystories", "2.2 GB", TINYSTORIES_FILES,
                         hf_id=NAMED_CORPORA["tinystories"], hf_patterns=TINYSTORIES_FILES),
        registry.Dataset("wikipedia", "Simple English Wikipedia (20231101.simple)", "text/wikipedia", "0.3 GB",
                         (registry.MANIFEST,), hf_id="wikimedia/wikipedia", hf_patterns=("20231101.simple/*",),
                         note="the thesis's 20220301.simple dump is hub id `wikipedia` (legacy-datasets/wikipedia), "
                              "read through `datasets`"),
        registry.Dataset("sotu", "State of the Union addresses, 1790-2021 (233 .txt files in one tar.gz)", "text", "3.7 MB",
                         ("sotu.tar.gz",), sha256={"sotu.tar.gz": SOTU_SHA256}, ids=("text/sotu.tar.gz",),
                         manual="put the tarball of the 233 addresses (one YEAR_name_party.txt each, public domain) at "
                                "$OWAI_DATA/text/sotu.tar.gz (or under --data-root)",
                         note="table4.2-pretrain's cpu corpus (data.source=text/sotu.tar.gz); the sha256 is owai's reference copy's"),
        registry.Dataset("paul_graham_essays", "Paul Graham essays (RULER's essay haystack: 49 of its list)",
                         "text/paul_graham_essays", "0.7 MB", (), tree_sha256=ESSAYS_TREE_SHA256, tree_glob="*.txt",
                         aliases=("essays",), ids=("text/paul_graham_essays",),
                         manual="RULER's scripts/data/synthetic/json/download_paulgraham_essay.py fetches them; put the "
                                ".txt essays in $OWAI_DATA/text/paul_graham_essays (or give --haystack-dir DIR)",
                         note="eval ruler's essay haystack (haystack_dir); the tree sha256 is of the 49 essays of owai's reference copy"),
        registry.Dataset("squad", "SQuAD v2 dev (RULER qa_1)", "text/squad", "4.4 MB", ("dev-v2.0.json",),
                         hf_id=SQUAD_HUB_ID, ids=("squad_v2",),
                         manual="eval ruler reads the hub id (squad=hf) through `datasets`; or put the official "
                                "dev-v2.0.json (rajpurkar.github.io/SQuAD-explorer) here and give --set squad=text/squad/dev-v2.0.json"),
        registry.Dataset("hotpotqa", "HotpotQA dev, distractor setting (RULER qa_2)", "text/hotpotqa", "44 MB",
                         ("hotpot_dev_distractor_v1.json",), hf_id=HOTPOTQA_HUB_ID, ids=("hotpot_qa",),
                         manual="eval ruler reads the hub id (hotpotqa=hf) through `datasets`; or put the official "
                                "hotpot_dev_distractor_v1.json (hotpotqa.github.io) here and give --set hotpotqa=PATH"),
        registry.Dataset("fineweb-edu", "FineWeb-Edu (chapter 4's pre-training corpus)", "text/fineweb-edu", "streamed",
                         (), hf_id="HuggingFaceFW/fineweb-edu",
                         manual="streamed from the hub by `owai mosaic-train` (data.source=HuggingFaceFW/fineweb-edu); a "
                                "local copy (parquet or jsonl files) is given as --dataset DIR"),
        registry.Dataset("gpt2", "GPT-2 BPE tokenizer (encoder.json + vocab.bpe, 50,257 tokens)", "tokenizers/gpt2", "1.5 MB",
                         ("encoder.json", "vocab.bpe"), sha256=GPT2_SHA256, urls=(GPT2_URL,), kind="tokenizer",
                         ids=("openai-community/gpt2",),
                         note="tokenizer=tokenizers/gpt2 reads this folder; tokenizer=gpt2 the hub id (Hugging Face cache)"),
        registry.Dataset("llama3-tokenizer", "Llama-3 tokenizer (Meta-Llama-3-8B, 128,256 tokens)", "tokenizers/llama3", "9 MB",
                         ("tokenizer.json",), hf_id="meta-llama/Meta-Llama-3-8B", kind="tokenizer",
                         manual="gated: accept Meta's licence at huggingface.co/meta-llama/Meta-Llama-3-8B and log in "
                                "(`hf auth login`); chapter 4's paper presets read it from the Hugging Face cache, or give "
                                "--tokenizer DIR (a folder with its tokenizer.json)"),
    ]


SOTU_SHA256 = "4fe4773bd3be7f59bb6e880408e692d5704c7cd5fe8a9b3be31f0080cd1b9431"
ESSAYS_TREE_SHA256 = "c7b87e82f1e8ce4663435ed6f0e4e98cfa47fbe46712bbb11f09aa32ff27ea48"  # registry.tree_digest of the 49 .txt
SQUAD_HUB_ID, HOTPOTQA_HUB_ID = "rajpurkar/squad_v2", "hotpotqa/hotpot_qa"  # = owai.evals.ruler's (test_data_roots checks)
# GPT-2's files as OpenAI publishes them (the sha256 tiktoken checks too)
GPT2_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
GPT2_SHA256 = {"encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
               "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"}


def resolve_source(source: str, data_root: str | Path | None = None) -> str:
    """A source spec after the data-root rule: a catalogue corpus name (babistories, tinystories,
    wikipedia) becomes its local folder (explicit `data_root`, $OWAI_BABISTORIES, $OWAI_DATA/text/...,
    the cache), else its hub id, else (babistories) a one-line error with the manual step; a relative
    path that does not exist here is looked up under the data root ($OWAI_DATA, the cache)."""
    if source in NAMED_CORPORA:
        folder = registry.locate(source, data_root)
        if folder is not None and registry.dataset(source).present(folder):
            return str(folder)
        if NAMED_CORPORA[source] is None or data_root:
            raise DataMissing(registry.missing_message(source, data_root))
        return NAMED_CORPORA[source]
    if source.startswith(("hf:", "owai-stories")) or Path(source).expanduser().exists():
        return source
    found = registry.find_relative(source, data_root)
    return str(found) if found is not None else source


def open_source(source: str | os.PathLike[str] | TextSource, text_field: str = "text",
                cache_dir: str | Path | None = None, *, config_name: str | None = None,
                revision: str | None = None, streaming: bool = True, data_root: str | Path | None = None,
                val_every: int = HELD_OUT_EVERY) -> TextSource:
    """Resolve a source (see the module docstring) to a `TextSource`; path errors are raised here.

    `config_name` is the hub dataset config (same as writing `id:config`); `revision` and
    `streaming` go to `datasets.load_dataset`; `data_root` is the explicit data root of the
    data-root rule (`resolve_source`); `val_every` the held-out rule's period for sources without a
    validation split (every `val_every`-th document is validation)."""
    if isinstance(val_every, bool) or not isinstance(val_every, int) or val_every < 2:
        raise OwaiError(f"the held-out period must be an integer >= 2, got {val_every!r}")
    if isinstance(source, TextSource):
        return source
    if isinstance(source, str):
        name, source = source, resolve_source(source, data_root)
        if config_name and name in NAMED_CORPORA and source != NAMED_CORPORA[name]:
            source = _local_config(name, Path(source), config_name)
    if isinstance(source, os.PathLike):
        path = Path(source).expanduser()
        if not path.exists():
            raise DataMissing(f"dataset path not found: {path}")
        return LocalSource(path, text_field, cache_dir, val_every)
    if source == "owai-stories" or source.startswith("owai-stories:"):
        return _story_source(source)
    if source.startswith("hf:"):
        return _hub_source(source[3:], text_field, config_name, revision, streaming, val_every)
    path = Path(source).expanduser()
    if path.exists():
        return LocalSource(path, text_field, cache_dir, val_every)
    missing = registry.missing_relative(source, data_root)  # a catalogue file under the data root (text/sotu.tar.gz)
    if missing:
        raise DataMissing(missing)
    if _looks_like_hub_id(source):
        return _hub_source(source, text_field, config_name, revision, streaming, val_every)
    raise DataMissing(f"dataset path not found: {source}")


def _local_config(name: str, folder: Path, config_name: str) -> str:
    """The `config_name` part of a catalogue corpus's local copy (its sub-folder, as `owai data
    fetch` lays out hub configs): a copy of another dump is refused rather than read in its place
    (Fig 3.9 names the 20220301 dump of Wikipedia; `owai data fetch wikipedia` gets 20231101)."""
    if (folder / config_name).is_dir():
        return str(folder / config_name)
    held = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")) if folder.is_dir() else []
    raise DataMissing(f"{name} config {config_name!r} is not in the local copy {folder} (it holds "
                      f"{', '.join(held) or 'no config folders'}); set the config it holds, or read the hub's with "
                      f"source hf:{NAMED_CORPORA[name] or name}")


def load_texts(source: str | os.PathLike[str] | TextSource, split: str, text_field: str = "text",
               cache_dir: str | Path | None = None, **kwargs: Any) -> Iterator[str]:
    """Stream the documents of `split` ("train" or "val") of `source`; resolution errors raise now."""
    return open_source(source, text_field, cache_dir, **kwargs).texts(canonical_split(split))


def lazy_texts(src: TextSource, split: str) -> Iterator[str]:
    """`src.texts(split)`, opened on first use (a cached run never touches the hub or the files)."""
    yield from src.texts(split)


BABISTORIES_ENV = "OWAI_BABISTORIES"  # legacy alias: the BabiStories folder (owai.data.registry)


def _story_source(source: str) -> StorySource:
    if source == "owai-stories":
        return StorySource(source, stories.DEFAULT_TRAIN_STORIES, stories.DEFAULT_VAL_STORIES)
    size = source.split(":", 1)[1]
    if not size.isdigit() or int(size) < 1:
        raise OwaiError(f"bad source {source!r}: expected owai-stories or owai-stories:N with N >= 1")
    return StorySource(source, int(size), max(1, int(size) // 40))


def _hub_source(spec: str, text_field: str, config_name: str | None, revision: str | None,
                streaming: bool, val_every: int = HELD_OUT_EVERY) -> HubSource:
    hub_id, _, config = spec.partition(":")
    if not hub_id:
        raise OwaiError(f"bad Hugging Face dataset id {spec!r}")
    return HubSource(hub_id, config_name or config or None, text_field, revision, streaming, val_every)


def _looks_like_hub_id(source: str) -> bool:
    """`name`, `owner/name` or either with `:config`, and no file suffix or path prefix: an id the hub
    itself accepts (`_hub_accepts`)."""
    if source.startswith((".", "/", "~")) or _suffix(Path(source.partition(":")[0])):
        return False
    return (re.fullmatch(r"[\w.-]+(/[\w.-]+)?(:[\w.+-]+)?", source) is not None
            and _hub_accepts(source.partition(":")[0]))


def _hub_accepts(hub_id: str) -> bool:
    """Whether `hub_id` is a Hugging Face repository id by the hub client's own rules (1-96 letters,
    digits, '-', '_', '.'; no '--' or '..'; at most one '/'): a name it rejects (bpe--5, a..b) is
    refused in one line instead of reaching the client, which raises its own validation error."""
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:  # no hub client: nothing reads the hub either
        return True
    try:
        validate_repo_id(hub_id)
    except HFValidationError:
        return False
    return True


# --- local files -----------------------------------------------------------------------------

SPLIT_WORDS = (("train", "train"), ("val", "val"), ("test", "test"))


def _suffix(path: Path) -> str:
    """The format suffix that matters: .txt/.jsonl/.json/.parquet/.7z (through .gz and .7z.NNN)."""
    name = path.name.lower()
    if re.search(r"\.7z(\.\d+)?$", name):
        return ".7z"
    if name.endswith((".tar", ".tar.gz", ".tgz")):
        return ".tar"
    if name.endswith(".gz"):
        name = name[:-3]
    return next((s for s in TEXT_SUFFIXES if name.endswith(s)), "")


def _split_of(path: Path) -> str | None:
    """train / val / test from the file name's parts, or None."""
    parts = re.split(r"[-_. ]+", path.name.lower())
    for word, split in SPLIT_WORDS:
        if any(part.startswith(word) for part in parts):
            return split
    return None


def _data_files(directory: Path) -> list[Path]:
    """Readable data files under `directory` (recursive, sorted; hidden names, extra 7z parts and
    archives already extracted beside themselves are skipped)."""
    found = []
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file() or not _suffix(path):
            continue
        if _suffix(path) == ".7z":
            if not re.search(r"\.7z(\.0*1)?$", path.name.lower()):
                continue  # .7z.002 and later parts are read through the first one
            if (path.parent / re.sub(r"\.7z(\.\d+)?$", "", path.name, flags=re.I)).is_file():
                continue  # the extracted file sits beside the archive: read that instead
        found.append(path)
    return found


def _split_files(path: Path) -> dict[str, list[Path]]:
    """{"train": [...], "val": [...]}; val is empty when the held-out rule applies."""
    if path.is_file():
        if not _suffix(path):
            raise OwaiError(f"unsupported dataset file {path} (expected .txt, .jsonl, .json, .parquet, .7z or .tar[.gz])")
        return {"train": [path], "val": []}
    files = _data_files(path)
    if not files:
        raise OwaiError(f"no dataset files in {path} (expected .txt, .jsonl, .json, .parquet, .7z or .tar[.gz] files)")
    by_split: dict[str | None, list[Path]] = {"train": [], "val": [], "test": [], None: []}
    for file in files:
        by_split[_split_of(file)].append(file)
    if not by_split["train"] and not by_split["val"] and not by_split["test"]:
        return {"train": files, "val": []}  # one unsplit corpus: held-out rule
    if not by_split["train"]:
        raise OwaiError(f"no training files in {path}: found {', '.join(f.name for f in files)} "
                        "(name files train*/val*, e.g. train.jsonl and val.jsonl)")
    return {"train": by_split["train"], "val": by_split["val"] or by_split["test"]}


def _all_parts(files: dict[str, list[Path]]) -> list[Path]:
    """Every file a source reads, 7z volumes included (for the fingerprint)."""
    out = []
    for path in files["train"] + files["val"]:
        out.extend(_volumes(path) if _suffix(path) == ".7z" else [path])
    return out


def read_file(path: Path, text_field: str = "text", cache_dir: str | Path | None = None) -> Iterator[str]:
    """Stream the documents of one data file (format from its suffix; see the module docstring)."""
    kind = _suffix(path)
    if kind == ".parquet":
        return _read_parquet(path, text_field)
    if kind == ".7z":
        return _read_7z(path, text_field, cache_dir)
    if kind == ".tar":
        return _read_tar(path, text_field)
    if kind in (".jsonl", ".json"):
        return _read_json(path, text_field)
    return _read_txt(path, text_field)


def _open_text(path: Path) -> TextIO:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    return opener(path, "rt", encoding="utf-8")  # type: ignore[operator]


def read_utf8(path: Path) -> str:
    """A whole text file, strictly UTF-8: a file in another encoding (or binary) is refused in one line."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise not_utf8(path) from None
    except OSError as exc:
        raise OwaiError(f"{path}: cannot read ({one_line(exc)})") from None


def _guard(path: Path, read: Callable[[], Iterator[str]]) -> Iterator[str]:
    """Turn decoding/IO failures while streaming `path` into one-line OwaiErrors naming it."""
    try:
        yield from read()
    except OwaiError:
        raise
    except UnicodeDecodeError:
        raise not_utf8(path) from None
    except (OSError, EOFError, ValueError, tarfile.TarError) as exc:  # TarError: an archive cut inside a member
        raise OwaiError(f"{path}: cannot read ({one_line(exc)})") from None


def _as_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise OwaiError(f"{where}: expected a text string, got {type(value).__name__}")
    return value


def _json_doc(value: Any, text_field: str, where: str) -> str:
    """A document from one JSON value: the string itself, or `value[text_field]`."""
    if isinstance(value, dict):
        if text_field not in value:
            raise OwaiError(f"{where}: no field {text_field!r} (fields: {', '.join(sorted(value))[:120]}); set text_field")
        return _as_text(value[text_field], where)
    return _as_text(value, where)


def _read_json(path: Path, text_field: str) -> Iterator[str]:
    def read() -> Iterator[str]:
        with _open_text(path) as f:
            head = f.read(4096).lstrip()
            f.seek(0)
            if head.startswith("["):
                yield from _json_array(path, f, text_field)
            else:
                yield from _json_lines(path, f, text_field)
    return _guard(path, read)


def _json_array(path: Path, f: TextIO, text_field: str) -> Iterator[str]:
    try:
        values = json.load(f)
    except json.JSONDecodeError as exc:
        raise OwaiError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    for i, value in enumerate(values):
        yield _json_doc(value, text_field, f"{path}[{i}]")


def _json_lines(path: Path, lines: Iterable[str], text_field: str) -> Iterator[str]:
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise OwaiError(f"{path}:{lineno}: not a JSON line ({exc.msg}); expected one JSON string or "
                            "object per line") from None
        yield _json_doc(value, text_field, f"{path}:{lineno}")


def _txt_mode(path: Path) -> str:
    """"json" (BabiStories lines), "eot" (<|endoftext|> separators) or "blank" (blank lines)."""
    with _open_text(path) as f:
        head = f.read(1 << 16)
    lines = head.splitlines()
    if len(head) == 1 << 16:
        lines = lines[:-1]  # the last one may be cut
    first = [ln for ln in lines if ln.strip()][:5]
    if first and all(_is_json_string(ln) for ln in first):
        return "json"
    return "eot" if any(ln.strip() == EOT_TEXT for ln in lines) else "blank"


def _is_json_string(line: str) -> bool:
    line = line.strip()
    if not (line.startswith('"') and line.endswith('"')):
        return False
    try:
        return isinstance(json.loads(line), str)
    except json.JSONDecodeError:
        return False


def _read_txt(path: Path, text_field: str) -> Iterator[str]:
    def read() -> Iterator[str]:
        mode = _txt_mode(path)
        with _open_text(path) as f:
            if mode == "json":
                yield from _json_lines(path, f, text_field)
                return
            yield from _txt_documents(f, mode)
    return _guard(path, read)


def _txt_documents(f: TextIO, mode: str) -> Iterator[str]:
    """Split plain text into documents at `<|endoftext|>` lines or at blank lines."""
    doc: list[str] = []
    for line in f:
        line = line.rstrip("\n")
        boundary = line.strip() == EOT_TEXT if mode == "eot" else not line.strip()
        if boundary:
            text = "\n".join(doc).strip("\n")
            if text.strip():
                yield text
            doc = []
        else:
            doc.append(line)
    text = "\n".join(doc).strip("\n")
    if text.strip():
        yield text


def _read_tar(path: Path, text_field: str) -> Iterator[str]:
    """A tar archive (.tar, .tar.gz, .tgz) of documents, members in name order: a `.txt` member is ONE
    document (whole file: archives such as the State of the Union addresses hold one text per
    file), `.jsonl` / `.json` members are read as JSON lines; other members are skipped."""
    def read() -> Iterator[str]:
        try:
            archive = tarfile.open(path, "r:*")
        except (tarfile.TarError, OSError) as exc:
            raise OwaiError(f"{path} is not a readable tar archive ({one_line(exc)})") from None
        spool = None
        try:
            stored = [m for m in archive.getmembers() if m.isfile()]
            members = sorted(stored, key=lambda m: m.name)
            if members != stored and not isinstance(archive.fileobj, io.BufferedReader):
                # A compressed archive seeks backwards by decompressing again from its start, so members
                # read in name order rather than stored order cost O(N^2) (4,000 generated documents:
                # 25 s, docs/results.md). Decompressed once into an unnamed temporary file (nothing is left
                # behind by a killed process), the archive is read with real seeks instead.
                spool = tempfile.TemporaryFile()
                archive.fileobj.seek(0)
                shutil.copyfileobj(archive.fileobj, spool, 1 << 20)
                archive.close()
                spool.seek(0)
                archive = tarfile.open(fileobj=spool, mode="r:")
                members = sorted((m for m in archive.getmembers() if m.isfile()), key=lambda m: m.name)
            yield from _tar_documents(path, archive, members, text_field)
        finally:
            archive.close()
            if spool is not None:
                spool.close()
    return _guard(path, read)


def _tar_documents(path: Path, archive: tarfile.TarFile, members: list[tarfile.TarInfo],
                   text_field: str) -> Iterator[str]:
    """The documents of `members` of an open `archive` (see `_read_tar`), in the given order."""
    for member in members:
        kind = _suffix(Path(member.name))
        if kind not in (".txt", ".jsonl", ".json") or Path(member.name).name.startswith("."):
            continue
        raw = archive.extractfile(member)
        try:
            text = raw.read().decode("utf-8") if raw is not None else ""
        except UnicodeDecodeError:
            raise not_utf8(Path(f"{path}:{member.name}")) from None  # the archive and its member
        if kind == ".txt":
            if text.strip():
                yield text.strip("\n")
        else:
            yield from _json_lines(path, io.StringIO(text), text_field)


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    def read() -> Iterator[str]:
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow.ArrowInvalid for a non-parquet file
            raise OwaiError(f"{path}: not a parquet file ({one_line(exc)})") from None
        names = table.schema_arrow.names
        if text_field not in names:
            raise OwaiError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}); set text_field")
        for batch in table.iter_batches(batch_size=1024, columns=[text_field]):
            for value in batch.column(0).to_pylist():
                yield _as_text(value, f"{path} column {text_field!r}")
    return _guard(path, read)


# --- 7z archives (BabiStories) ----------------------------------------------------------------


def _volumes(archive: Path) -> list[Path]:
    """The archive's files: itself, or all `name.7z.NNN` parts in order."""
    match = re.search(r"\.7z\.(\d+)$", archive.name, flags=re.I)
    if not match:
        return [archive]
    stem = archive.name[: match.start(1) - 1]  # "name.7z"
    parts = [p for p in archive.parent.iterdir() if re.fullmatch(re.escape(stem) + r"\.\d+", p.name)]
    return sorted(parts, key=lambda p: int(p.name.rsplit(".", 1)[1]))


class _Concatenated(io.RawIOBase):
    """Read-only, seekable view of several files one after the other (multi-volume 7z)."""

    def __init__(self, paths: list[Path]) -> None:
        self._files = [open(p, "rb") for p in paths]  # noqa: SIM115 (closed in close())
        self._starts = [0]
        for p in paths:
            self._starts.append(self._starts[-1] + p.stat().st_size)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._starts[-1]}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view) and self._pos < self._starts[-1]:
            i = max(k for k in range(len(self._files)) if self._starts[k] <= self._pos)
            self._files[i].seek(self._pos - self._starts[i])
            n = self._files[i].readinto(view[done: done + min(len(view) - done, self._starts[i + 1] - self._pos)])
            if not n:
                break
            done += n
            self._pos += n
        return done

    def close(self) -> None:
        for f in self._files:
            f.close()
        super().close()


def extract_7z(archive: Path, cache_dir: str | Path | None = None) -> Path:
    """Extract a (multi-volume) 7z archive once into `<cache>/extracted/`; returns the directory."""
    volumes = _volumes(archive)
    key = digest([[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in volumes])
    final = cache_root(cache_dir) / "extracted" / f"{slug(archive.name)}-{key}"
    if final.is_dir():
        remove_dead_builds(final)  # a process killed extracting it while another finished it
        return final
    try:
        import py7zr
    except ImportError:
        raise OwaiError(f"reading {archive} needs py7zr: pip install py7zr") from None
    tmp = folder_to_build(final)
    try:
        with _Concatenated(volumes) as raw, py7zr.SevenZipFile(io.BufferedReader(raw), mode="r") as z:
            z.extractall(path=tmp)
        _publish_dir(tmp, final)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OwaiError(f"{archive}: cannot extract 7z archive ({one_line(exc)})") from None
    return final


def _publish_dir(tmp: Path, final: Path) -> None:
    """Rename a finished temporary directory into place; if another process won the race, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _read_7z(archive: Path, text_field: str, cache_dir: str | Path | None) -> Iterator[str]:
    """Documents of every member of the archive (members without a known suffix read as .txt)."""
    def read() -> Iterator[str]:
        root = extract_7z(archive, cache_dir)
        for member in sorted(p for p in root.rglob("*") if p.is_file()):
            yield from read_file(member, text_field, cache_dir)
    return read()


# --- tokenizers ------------------------------------------------------------------------------


class Tokenizer:
    """What the data layer needs from a tokenizer; `fingerprint` identifies its exact mapping."""

    name: str
    vocab_size: int
    eot_id: int
    fingerprint: str
    bos_id: int | None = None  # the beginning-of-sequence token of a transformers tokenizer, if it has one

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no eot, no special-token parsing: like tiktoken encode_ordinary)."""
        raise NotImplementedError

    def encode_as_transformers(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` as transformers' `tokenizer.encode` gives them (what lm-evaluation-harness's
        HFLM scores): a special token's string inside the text is that token, and with
        `add_special_tokens` the tokenizer's own additions (a Llama tokenizer's BOS) are made. Here:
        EOT_TEXT is the eot token, nothing is added."""
        parts = [self.encode(part) for part in text.split(EOT_TEXT)]
        return [i for k, part in enumerate(parts) for i in ([self.eot_id] if k else []) + part]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` over a list (parallel where the backend allows)."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; the eot id renders as `<|endoftext|>`. `skip_special` drops special tokens
        (the eot, a BOS) as transformers' `decode(..., skip_special_tokens=True)` does: how the
        evaluation suites' official code reads a model's answer."""
        raise NotImplementedError

    def count(self, text: str) -> int:
        """Number of tokens of `text` (what prompt fitting measures)."""
        return len(self.encode(text))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


def count_each(tokenizer: Any, texts: list[str]) -> list[int]:
    """The token counts of `texts` by any tokenizer with `count(text)`: one parallel batch where it also
    has `count_many(texts)` (a Rust tokenizer's), else one by one. The one adapter RULER's builders
    and the evaluated models' prompt budgets count through."""
    many = getattr(tokenizer, "count_many", None)
    counts = list(many(texts)) if many is not None else [tokenizer.count(t) for t in texts]
    if len(counts) != len(texts):
        raise OwaiError(f"the tokenizer counted {len(counts)} of {len(texts)} texts")
    return counts


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 and eot 256 (vocab 257): no training, no download."""

    name = "bytes"
    vocab_size = 257
    eot_id = 256
    fingerprint = "bytes-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        out, chunk = [], bytearray()
        for i in ids:
            if int(i) == self.eot_id:
                out.append(chunk.decode("utf-8", errors="replace") + ("" if skip_special else EOT_TEXT))
                chunk = bytearray()
            elif 0 <= int(i) < 256:  # ids past the vocabulary (a model's padded embedding rows) decode to
                chunk.append(int(i))  # nothing, as Hugging Face tokenizers skip ids they do not have
        return "".join(out) + chunk.decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (GPT-2 from the hub, a local tokenizer, or a trained bpe-N)."""

    def __init__(self, name: str, backend: Any, eot_id: int, bos_id: int | None = None,
                 model_max_length: int | None = None) -> None:
        self.name, self.backend, self.eot_id = name, backend, int(eot_id)
        self.bos_id = None if bos_id is None else int(bos_id)
        # transformers' tokenizer_config.json `model_max_length` (None: unset, or no transformers tokenizer)
        self.model_max_length = model_max_length
        backend.encode_special_tokens = True  # "<|endoftext|>" inside a document is plain text
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self.fingerprint = hashlib.sha256(backend.to_str().encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def count(self, text: str) -> int:
        return len(self.backend.encode(text, add_special_tokens=False))  # no list of ids made

    def count_many(self, texts: list[str]) -> list[int]:
        """`count` of each text, the batch encoded in parallel (Rust threads): what RULER's builders
        and the in-context prompts' budget checks use to count long prompts a batch at a time."""
        return [len(e) for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def encode_as_transformers(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._parsing_backend.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def _parsing_backend(self) -> Any:
        """A copy of the backend that reads special-token strings as special tokens (transformers' default)."""
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_str(self.backend.to_str())
        backend.encode_special_tokens = False
        return backend

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "json": self.backend.to_str(), "eot_id": self.eot_id, "bos_id": self.bos_id}

    def __setstate__(self, state: dict[str, Any]) -> None:
        from tokenizers import Tokenizer as Backend

        self.__init__(state["name"], Backend.from_str(state["json"]), state["eot_id"],  # type: ignore[misc]
                      state.get("bos_id"))


def load_tokenizer(name: str, cache_dir: str | Path | None = None, training_texts: Iterable[str] | None = None,
                   *, corpus_fingerprint: str | None = None, source: str | os.PathLike[str] | TextSource | None = None,
                   text_field: str = "text", **source_kwargs: Any) -> Tokenizer:
    """`bytes`, `bpe-N` (trained on `training_texts`, cached by corpus fingerprint and N), or a hub
    id / local tokenizer directory / tokenizer.json for `transformers` (e.g. `gpt2`).

    For bpe-N, `source=` (with `text_field`, `config_name`, ...) instead of `training_texts` trains on
    that source's train split and keys the cache by its fingerprint, as `prepare_tokens` does."""
    if name == "bytes":
        return ByteTokenizer()
    match = re.fullmatch(r"bpe-(\d+)", name)
    if match:
        if source is not None and training_texts is None:
            src = open_source(source, text_field, cache_dir, **source_kwargs)
            training_texts, corpus_fingerprint = lazy_texts(src, "train"), corpus_fingerprint or src.fingerprint
        return _bpe(int(match.group(1)), cache_root(cache_dir), training_texts, corpus_fingerprint)
    name = resolve_tokenizer(name, source_kwargs.get("data_root"))
    path = Path(name).expanduser()
    if path.is_file():
        return _from_tokenizer_json(name, path)
    if path.is_dir() and _bpe_files(path) is not None:
        return _from_bpe_files(name, path)
    return _from_transformers(name, path)


TOKENIZER_SPEC = "owai_tokenizer.json"  # beside a saved model's weights: which tokenizer it was trained with


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    """The tokenizer beside the weights: tokenizer.json (tokenizers format) when it has one, and
    owai_tokenizer.json naming it, so mosaic-eval needs neither the hub nor the training corpus."""
    spec: dict[str, Any] = {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id}
    if tokenizer.bos_id is not None:
        spec["bos_id"] = tokenizer.bos_id
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        atomic_write_text(directory / "tokenizer.json", backend.to_str())
        spec["file"] = "tokenizer.json"
    atomic_write_json(directory / TOKENIZER_SPEC, spec)


def read_tokenizer_spec(path: Path) -> dict[str, Any]:
    """The owai_tokenizer.json of a saved model directory ({} when it has none)."""
    spec = path / TOKENIZER_SPEC
    if not spec.is_file():
        return {}
    try:
        return json.loads(spec.read_text())
    except ValueError:
        raise OwaiError(f"{spec} is corrupt") from None


def tokenizer_for(path: Path, default: str) -> str:
    """The tokenizer a saved model was trained with: the one its owai_tokenizer.json names (see
    save_tokenizer), else the folder's own when transformers saved one there (tokenizer_config.json,
    as `save_pretrained` writes) or it holds GPT-2's BPE files, else `default`."""
    spec = read_tokenizer_spec(path)
    if spec.get("file") and (path / spec["file"]).is_file():
        return str(path / spec["file"])
    if "name" in spec:
        return spec["name"]
    if (path / "tokenizer_config.json").is_file() or _bpe_files(path) is not None:
        return str(path)
    return default


def _bpe_files(folder: Path) -> tuple[Path, Path] | None:
    """GPT-2's original byte-level BPE files (encoder.json + vocab.bpe, or vocab.json + merges.txt)
    in a folder that holds no transformers tokenizer (no tokenizer.json / tokenizer_config.json)."""
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
        return None
    pairs = (("encoder.json", "vocab.bpe"), ("vocab.json", "merges.txt"))
    for vocab, merges in pairs:
        if (folder / vocab).is_file() and (folder / merges).is_file():
            return folder / vocab, folder / merges
    for vocab, merges in pairs:  # no whole pair: one half of one says which file is missing
        if (folder / vocab).is_file() != (folder / merges).is_file():
            missing = merges if (folder / vocab).is_file() else vocab
            raise OwaiError(f"tokenizer folder {folder}: {missing} is missing (GPT-2's BPE needs {vocab} and {merges})")
    return None


def _from_bpe_files(name: str, folder: Path) -> HFTokenizer:
    """GPT-2's BPE from its original files, through `tokenizers` (transformers 5 would silently build an
    empty tokenizer from `vocab_file=`)."""
    from tokenizers import ByteLevelBPETokenizer

    vocab, merges = _bpe_files(folder)  # type: ignore[misc]
    try:
        tok = ByteLevelBPETokenizer(str(vocab), str(merges))
    except Exception as exc:  # noqa: BLE001 - a corrupt file is a user error
        raise OwaiError(f"cannot read the BPE tokenizer in {folder} ({one_line(exc)})") from None
    tok.add_special_tokens([EOT_TEXT])
    backend = tok._tokenizer  # the `tokenizers.Tokenizer` inside the implementation wrapper
    eot = backend.token_to_id(EOT_TEXT)
    if not backend.encode("The grass is green.").ids:
        raise OwaiError(f"the BPE tokenizer in {folder} turns text into no tokens (an empty vocabulary?)")
    return HFTokenizer(name, backend, eot)


BPE_MIN_VOCAB, BPE_MAX_VOCAB = 258, 1 << 20


def looks_under_data_root(spec: str) -> bool:
    """Whether `resolve_source` / `resolve_tokenizer` may look a corpus or tokenizer spec up under a
    data root: a catalogue name, a hub id or a relative path; not bytes, bpe-N, owai-stories, an `hf:`
    id, nor an absolute or `~` path (`--data-root` is refused where no input of a run is looked up)."""
    return not registry.generated(spec) and not (spec.startswith(("hf:", "owai-stories", "~")) or Path(spec).is_absolute())


def check_named(source: str, tokenizer: str) -> None:
    """A run's corpus (data.source) and tokenizer (data.tokenizer) must be named: a blank name would
    be read as the current directory (its text files as the corpus, a run directory for nothing)."""
    if not str(source).strip():
        raise OwaiError("data.source is empty: give a corpus (owai-stories, a hub id or a path)")
    if not str(tokenizer).strip():
        raise OwaiError("data.tokenizer is empty: give bytes, bpe-N, gpt2 or a tokenizer directory")


def resolve_tokenizer(name: str, data_root: str | Path | None = None) -> str:
    """A tokenizer name after the data-root rule: a relative path that does not exist here but does
    under the data root (`data_root`, $OWAI_DATA, the cache), e.g. `tokenizers/gpt2`, becomes that path."""
    if name == "bytes" or re.fullmatch(r"bpe-(\d+)", name) or Path(name).expanduser().exists():
        return name
    found = registry.find_relative(name, data_root)
    return str(found) if found is not None else name


def check_tokenizer(name: str, data_root: str | Path | None = None) -> None:
    """Fail fast (one line, no network wait) on a tokenizer name that cannot load: a bpe-N outside
    its range, or a hub id that is neither in the local Hugging Face cache nor reachable (offline
    mode, or no connection to the hub within HUB_PROBE_TIMEOUT seconds), or local tokenizer files
    that do not read. Called before a run exists."""
    name = resolve_tokenizer(name, data_root)
    if name == "bytes":
        return
    match = re.fullmatch(r"bpe-(\d+)", name)
    if match:
        vocab = int(match.group(1))
        if not BPE_MIN_VOCAB <= vocab <= BPE_MAX_VOCAB:
            raise OwaiError(f"tokenizer bpe-{vocab}: vocabulary size must be between {BPE_MIN_VOCAB} and {BPE_MAX_VOCAB}")
        return
    path = Path(name).expanduser()
    if path.exists():  # local files: read them now (a cut vocab.bpe, an encoder.json that is not JSON, a
        load_tokenizer(name)  # folder holding no tokenizer), not in the run directory
        return
    missing = registry.missing_relative(name, data_root)  # a data-root folder (tokenizers/gpt2), not a hub id
    if missing:
        raise DataMissing(missing)
    if not _looks_like_hub_id(name) or ":" in name:
        raise OwaiError(f"tokenizer {name!r}: no such file or directory, and not a Hugging Face hub id "
                        "(use bytes, bpe-N, a tokenizer directory or tokenizer.json, or a hub id such as gpt2)")
    if _hub_cached(name):
        return
    problem = hub_unreachable()
    if problem:
        raise DataMissing(f"tokenizer {name!r} is not in the local Hugging Face cache and {problem}; "
                          "use tokenizer=bytes or bpe-N offline")


def _hub_cached(name: str) -> bool:
    """Whether the local Hugging Face cache holds tokenizer files of hub id `name`."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return any(isinstance(try_to_load_from_cache(name, f), str) for f in ("tokenizer.json", "tokenizer_config.json"))


def _quiet_hub() -> None:
    """Silence the hub clients' warnings and retry messages: a failure is reported as one OwaiError."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for module in ("huggingface_hub.utils.logging", "transformers.utils.logging"):
        try:
            import importlib

            importlib.import_module(module).set_verbosity_error()
        except (ImportError, AttributeError):
            pass


def _from_tokenizer_json(name: str, path: Path) -> HFTokenizer:
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_file(str(path))
    except Exception as exc:
        raise OwaiError(f"{path}: not a tokenizer.json file ({one_line(exc)})") from None
    spec = read_tokenizer_spec(path.parent)
    if spec.get("file") == path.name and isinstance(spec.get("eot_id"), int):  # a saved model's own tokenizer
        return HFTokenizer(name, backend, spec["eot_id"], spec.get("bos_id"))  # (Llama-3's eot: <|end_of_text|>)
    eot = backend.token_to_id(EOT_TEXT)
    if eot is None:
        raise OwaiError(f"{path}: the tokenizer has no {EOT_TEXT} token to separate documents")
    return HFTokenizer(name, backend, eot)


def _from_transformers(name: str, path: Path) -> HFTokenizer:
    """AutoTokenizer.from_pretrained(name): a local directory, the HF cache or the hub."""
    if not path.is_dir():
        check_tokenizer(name)  # cached, or the hub answers: no minute of retries on a dead network
    _quiet_hub()
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else name,
                                            local_files_only=not path.is_dir() and _hub_cached(name))
    except Exception as exc:
        where = f"local directory {path}" if path.is_dir() else "the Hugging Face hub"
        error = OwaiError if path.is_dir() else DataMissing  # not on this machine, nor to be had from the hub
        raise error(f"cannot fetch tokenizer {name!r} from {where} ({one_line(exc)}); "
                        "use tokenizer=bytes or bpe-N offline") from None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise OwaiError(f"tokenizer {name!r} has no fast (tokenizers) backend; use a fast tokenizer, bytes or bpe-N")
    eot = tok.eos_token_id if tok.eos_token_id is not None else backend.token_to_id(EOT_TEXT)
    if eot is None:
        raise OwaiError(f"tokenizer {name!r} has no end-of-text token to separate documents")
    length = getattr(tok, "model_max_length", None)
    # transformers marks an unset length with a huge integer (int(1e30)): no length then
    known = isinstance(length, int) and not isinstance(length, bool) and 0 < length < int(1e30)
    return HFTokenizer(name, backend, eot, tok.bos_token_id, int(length) if known else None)


def _bpe(vocab: int, root: Path, texts: Iterable[str] | None, fingerprint: str | None) -> HFTokenizer:
    """Load the cached bpe-N for this corpus, or train and cache it (tokenizer.json, atomic)."""
    if not BPE_MIN_VOCAB <= vocab <= BPE_MAX_VOCAB:
        raise OwaiError(f"bpe-{vocab}: vocabulary size must be between {BPE_MIN_VOCAB} and {BPE_MAX_VOCAB}")
    capped = None
    if fingerprint is None:
        if texts is None:
            raise OwaiError(f"tokenizer bpe-{vocab} is trained on the corpus: pass training texts")
        capped = _cap_chars(texts, BPE_TRAIN_MAX_CHARS)
        fingerprint = digest(capped)
    path = root / "tokenizers" / f"bpe-{vocab}-{digest(fingerprint, vocab, BPE_TRAIN_MAX_CHARS)}" / "tokenizer.json"
    backend = _cached_bpe(path)
    if backend is None:
        if capped is None and texts is None:
            raise OwaiError(f"tokenizer bpe-{vocab} for this corpus is not cached yet: pass training texts")
        try:
            with build_lock(path.parent):  # one process trains it; the others wait and read it
                backend = _cached_bpe(path, say=False)  # said above, if damaged
                if backend is None:
                    backend = train_bpe(capped if capped is not None else _cap_chars(texts, BPE_TRAIN_MAX_CHARS), vocab)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    atomic_write_text(path, backend.to_str())
        except OSError as e:  # a read-only or full cache, a file where its folder goes
            raise cannot_write(f"tokenizer cache {path.parent}", e) from None
    return HFTokenizer(f"bpe-{vocab}", backend, backend.token_to_id(EOT_TEXT))


def _cached_bpe(path: Path, say: bool = True) -> Any:
    """The trained tokenizer cached at `path`, or None: not there, or damaged (a cut write, a full
    disk; said when `say`), then trained again, as every cache entry is rebuilt rather than trusted."""
    from tokenizers import Tokenizer as Backend

    if not path.is_file():
        return None
    try:
        return Backend.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own Exception
        if say:
            from owai import console

            console.info(f"{path}: damaged tokenizer cache entry ({one_line(exc, 80)}), not used")
        return None


def _cap_chars(texts: Iterable[str], max_chars: int) -> list[str]:
    """The leading documents of `texts` up to `max_chars` characters in total (at least one)."""
    out, total = [], 0
    for text in texts:
        if out and total + len(text) > max_chars:
            break
        out.append(text)
        total += len(text)
    return out


def train_bpe(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE (GPT-2 style pre-tokenisation) with `<|endoftext|>` as id 0; deterministic."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if not any(texts):
        raise OwaiError(f"cannot train bpe-{vocab_size}: the training split is empty")
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return backend
