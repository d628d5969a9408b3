"""Mutation audit of the text sources, the embedded stories and the data catalogue.

Each test below pins one documented rule of owai/data/text.py, owai/data/stories.py or
owai/data/registry.py that a small, plausible change of the code left unnoticed by the rest of the
suite (the lookup order of relative paths, manifest entries, split naming, `.gz` suffixes, the
held-out rule of hub sources, the stories' seeds and names, ...). Expected values come from the
modules' docstrings and the file formats, never from owai's own output.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from owai.data import registry, stories, text
from owai.data.text import load_texts, open_source
from owai.errors import OwaiError

DOCS = [f"Document number {i}. It has a line.\nAnd a second line." for i in range(160)]


def _jsonl(path: Path, docs: list[str], field: str | None = "text") -> Path:
    path.write_text("".join(json.dumps(d if field is None else {"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return path


# --- registry.py --------------------------------------------------------------------------------


def test_verify_refuses_a_manifest_entry_whose_file_is_missing(tmp_path: Path) -> None:
    """registry's docstring: downloads without published checksums record the sha256 of each file
    in owai-manifest.json, "which `verify` checks later". A file the manifest lists but the copy no
    longer holds is a damaged copy: `verify` must refuse it (one line), not pass it over."""
    folder = tmp_path / "wikipedia"
    folder.mkdir()
    (folder / "kept.parquet").write_bytes(b"kept")
    sha = hashlib.sha256(b"kept").hexdigest()
    manifest = {"sha256": {"kept.parquet": sha, "lost.parquet": sha}}
    (folder / registry.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(OwaiError) as e:
        registry.verify("wikipedia", folder)
    assert "lost.parquet" in str(e.value) and "\n" not in str(e.value)


def test_a_relative_path_is_found_under_owai_data_before_the_cache(no_data: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`find_relative`'s docstring and the one lookup rule: "under the explicit root, else under
    $OWAI_DATA, else the cache". With the same relative file in both $OWAI_DATA and the cache, the
    $OWAI_DATA copy is the one read."""
    env = tmp_path / "env"
    for base in (env, no_data / "data"):
        (base / "text").mkdir(parents=True)
        (base / "text" / "essays.txt").write_text("One essay.\n")
    monkeypatch.setenv("OWAI_DATA", str(env))
    assert registry.find_relative("text/essays.txt") == env / "text" / "essays.txt"


def test_a_fetch_onto_an_incomplete_copy_replaces_its_stale_files(tmp_path: Path) -> None:
    """`_publish` onto a folder that already holds an (incomplete, possibly cut) earlier copy merges
    the new files in with `_merge_into`, whose docstring says "Move everything under `source` into
    `folder`, file by file (each replace is atomic)": the freshly verified file replaces the stale
    one of the same name, and the earlier copy's other files stay."""
    final = tmp_path / "data" / "set"
    final.mkdir(parents=True)
    (final / "readme").write_text("cut short")
    (final / "older").write_text("kept")

    def fill(tmp: Path) -> None:
        (tmp / "readme").write_text("the whole verified file")

    assert registry._publish(final, fill, lambda _: None) == final
    assert (final / "readme").read_text() == "the whole verified file"
    assert (final / "older").read_text() == "kept"
    assert sorted(p.name for p in final.parent.iterdir()) == ["set"]  # no build folder left


def test_data_list_marks_a_copy_that_fails_its_checksum(tmp_path: Path, no_data: Path) -> None:
    """`status` (the rows of `owai data list`) verifies the small datasets with published checksums;
    a copy whose files do not have GPT-2's published sha256 (text.GPT2_SHA256) is found but must
    not be listed as verified: its row says FAILED."""
    gpt2 = tmp_path / registry.dataset("gpt2").subfolder
    gpt2.mkdir(parents=True)
    for name in registry.dataset("gpt2").required:
        (gpt2 / name).write_text("{}")
    row = next(r for r in registry.status(tmp_path) if r["name"] == "gpt2")
    assert (row["found"], row["verified"]) == ("yes", "FAILED")


# --- text.py: local files -----------------------------------------------------------------------


def test_gz_after_a_text_suffix_is_a_data_file_of_that_format(tmp_path: Path) -> None:
    """text.py's docstring: "`.gz` after any of the text suffixes is decompressed on the fly". A
    directory of train.jsonl.gz / val.jsonl.gz files (JSON objects) is read as JSON lines, each
    document the object's text field, and their split names are honoured."""
    for name, docs in (("train.jsonl.gz", DOCS[:6]), ("val.jsonl.gz", DOCS[6:8])):
        with gzip.open(tmp_path / name, "wt", encoding="utf-8") as f:
            f.write("".join(json.dumps({"text": d, "n": 1}) + "\n" for d in docs))
    assert list(load_texts(tmp_path, "train")) == DOCS[:6]
    assert list(load_texts(tmp_path, "val")) == DOCS[6:8]


def test_a_txt_is_json_lines_only_when_its_first_five_lines_are_json_strings(tmp_path: Path) -> None:
    """text.py's docstring: a `.txt` "whose first five non-empty lines are each a complete JSON
    string" is read as JSON lines; otherwise blank lines separate documents. A story whose first
    line is a quoted exclamation is plain text: one document, its two lines kept."""
    path = tmp_path / "plain.txt"
    path.write_text('"Run!"\nThe dog ran home.\n\nAnother story.\n')
    assert list(text.read_file(path)) == ['"Run!"\nThe dog ran home.', "Another story."]


def test_val_files_are_the_validation_split_before_test_files(tmp_path: Path) -> None:
    """text.py's docstring: a file name part starting with `val` is validation data, "else one
    starting with `test` serves as validation data". With val and test files both present, the
    validation split is the val file's documents."""
    _jsonl(tmp_path / "train.jsonl", DOCS[:5])
    _jsonl(tmp_path / "val.jsonl", DOCS[5:7])
    _jsonl(tmp_path / "test.jsonl", DOCS[7:9])
    assert list(load_texts(tmp_path, "val")) == DOCS[5:7]
    assert list(load_texts(tmp_path, "train")) == DOCS[:5]


def test_hidden_files_and_folders_of_a_corpus_directory_are_skipped(tmp_path: Path) -> None:
    """text.py's docstring: a directory is "searched recursively, hidden names skipped". An editor's
    hidden backup of the training file and a hidden folder of old data add no documents."""
    _jsonl(tmp_path / "train.jsonl", DOCS[:4])
    _jsonl(tmp_path / "val.jsonl", DOCS[4:5])
    _jsonl(tmp_path / ".train.jsonl.swp.jsonl", DOCS[10:20])
    (tmp_path / ".old").mkdir()
    _jsonl(tmp_path / ".old" / "train.jsonl", DOCS[20:30])
    assert list(load_texts(tmp_path, "train")) == DOCS[:4]


def test_a_txt_member_of_a_tar_is_one_whole_document(tmp_path: Path) -> None:
    """`_read_tar`'s docstring: "a `.txt` member is ONE document (whole file: archives such as the
    State of the Union addresses hold one text per file)". Blank lines inside a member are
    paragraph breaks, not document boundaries."""
    members = {"b.txt": "Second address.\n", "a.txt": "Fellow citizens.\n\nA second paragraph.\n"}
    archive = tmp_path / "speeches.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, body in members.items():
            data = body.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert list(text.read_file(archive)) == ["Fellow citizens.\n\nA second paragraph.", "Second address."]


def test_parquet_reads_the_text_field_column_wherever_it_stands(tmp_path: Path) -> None:
    """text.py's docstring: "`.parquet`: the `text_field` column". A table whose first column is an
    id and whose text column is named `story` gives the story column's strings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(5)), "story": DOCS[:5]}), tmp_path / "t.parquet")
    assert list(text.read_file(tmp_path / "t.parquet", "story")) == DOCS[:5]


def test_a_held_out_period_of_one_is_refused(tmp_path: Path) -> None:
    """`_kept`'s rule makes document i validation iff i % every == every - 1; with every = 1 that is
    every document, so the training split of a corpus without a validation split would be empty.
    `open_source` must refuse the period in one line rather than train on nothing."""
    path = _jsonl(tmp_path / "all.jsonl", DOCS[:10])
    with pytest.raises(OwaiError) as e:
        open_source(str(path), val_every=1)
    assert "\n" not in str(e.value)


def test_valid_is_an_alias_of_val(tmp_path: Path) -> None:
    """`canonical_split`'s docstring: `train` or `val`, "accepting `valid`/`validation`"."""
    _jsonl(tmp_path / "train.jsonl", DOCS[:3])
    _jsonl(tmp_path / "val.jsonl", DOCS[3:5])
    assert list(load_texts(tmp_path, "valid")) == list(load_texts(tmp_path, "validation")) == DOCS[3:5]


def test_bpe_training_text_cap_keeps_at_least_one_document() -> None:
    """`_cap_chars`' docstring: the leading documents up to `max_chars` characters "(at least one)":
    a first document longer than the cap is still kept, so bpe-N never trains on nothing."""
    assert text._cap_chars(["abcdefgh", "ij"], 3) == ["abcdefgh"]
    assert text._cap_chars(["ab", "cd", "ef"], 4) == ["ab", "cd"]


def test_a_tgz_archive_is_read_as_a_tar(tmp_path: Path) -> None:
    """`_read_tar`'s docstring: "A tar archive (.tar, .tar.gz, .tgz)": a .tgz is a gzipped tar and
    its .txt members are documents in name order."""
    archive = tmp_path / "docs.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, body in (("2.txt", "Two."), ("1.txt", "One.")):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body.encode()))
    assert list(text.read_file(archive)) == ["One.", "Two."]
    assert list(load_texts(archive, "train")) == ["One.", "Two."]  # no document is the 100th: none held out


def test_a_corpus_of_blank_training_files_is_refused(tmp_path: Path) -> None:
    """`LocalSource.check_nonempty`'s docstring: "Raise unless the training files hold a non-blank
    document". Training files holding only blank lines are refused in one line."""
    (tmp_path / "train.txt").write_text("\n\n   \n")
    (tmp_path / "val.txt").write_text("A validation story.\n")
    source = open_source(str(tmp_path))
    with pytest.raises(OwaiError) as e:
        source.check_nonempty()
    assert "\n" not in str(e.value)


def test_a_text_field_that_is_not_a_string_is_refused(tmp_path: Path) -> None:
    """text.py's docstring: a JSON line is a document when it is a string, or an object whose
    `text_field` gives it; a null or a number is no document (it would become the text "None" or
    "7"), and "every user error is an OwaiError with a one-line message"."""
    path = tmp_path / "nulls.jsonl"
    path.write_text(json.dumps({"text": "A story."}) + "\n" + json.dumps({"text": None}) + "\n")
    with pytest.raises(OwaiError) as e:
        list(text.read_file(path))
    assert f"{path}:2" in str(e.value) and "\n" not in str(e.value)
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text("7\n")
    with pytest.raises(OwaiError):
        list(text.read_file(numbers))


def test_eot_separators_are_lines_holding_only_the_marker(tmp_path: Path) -> None:
    """text.py's docstring: "Documents are separated by lines holding only `<|endoftext|>`"; a
    marker inside a line of text is ordinary text of that document (tiktoken's encode_ordinary)."""
    path = tmp_path / "stories.txt"
    path.write_text("First story mentions <|endoftext|> in a sentence.\n<|endoftext|>\nSecond story.\n<|endoftext|>\n")
    assert list(text.read_file(path)) == ["First story mentions <|endoftext|> in a sentence.", "Second story."]


# --- text.py: hub sources (the `datasets` code path on local parquet folders) ---------------------


def test_a_hub_dataset_with_a_validation_split_keeps_all_of_train(tmp_path: Path) -> None:
    """text.py's docstring: "Validation split: the source's own when it has one; otherwise every
    100th document ... is held out". A hub dataset with a validation split loses no training
    document to the held-out rule (150 train documents: document 99 stays in train)."""
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    hub = tmp_path / "hub"
    hub.mkdir()
    pq.write_table(pa.table({"text": DOCS[:150]}), hub / "train.parquet")
    pq.write_table(pa.table({"text": DOCS[150:152]}), hub / "validation.parquet")
    source = open_source(f"hf:{hub}")
    assert list(source.texts("train")) == DOCS[:150]
    assert list(source.texts("val")) == DOCS[150:152]


def test_a_hub_datasets_validation_split_wins_over_its_test_split(tmp_path: Path) -> None:
    """The source's own validation split is its validation data (text.py's docstring); a test split
    serves only where there is none (as for local files: "else one starting with `test`")."""
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    hub = tmp_path / "hub"
    hub.mkdir()
    pq.write_table(pa.table({"text": DOCS[:5]}), hub / "train.parquet")
    pq.write_table(pa.table({"text": DOCS[5:7]}), hub / "validation.parquet")
    pq.write_table(pa.table({"text": DOCS[7:9]}), hub / "test.parquet")
    assert list(open_source(f"hf:{hub}").texts("val")) == DOCS[5:7]


def test_a_hub_dataset_without_validation_holds_out_document_99(tmp_path: Path) -> None:
    """text.py's docstring: without a validation split "every 100th document of the single stream
    (0-based index i with i % 100 == 99) is held out". A hub dataset of 150 train documents has
    validation [document 99] and the 149 others as train, in order."""
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    hub = tmp_path / "hub"
    hub.mkdir()
    pq.write_table(pa.table({"text": DOCS[:150]}), hub / "train.parquet")
    source = open_source(f"hf:{hub}")
    assert list(source.texts("val")) == [DOCS[99]]
    assert list(source.texts("train")) == DOCS[:99] + DOCS[100:150]


def test_a_hub_dataset_is_read_from_its_text_field(tmp_path: Path) -> None:
    """`open_source(..., text_field=...)` names the record field holding the document, for hub
    datasets as for local files (HubSource's `text_field`): a dataset whose text is in `story`."""
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    hub = tmp_path / "hub"
    hub.mkdir()
    pq.write_table(pa.table({"story": DOCS[:3], "id": [0, 1, 2]}), hub / "train.parquet")
    pq.write_table(pa.table({"story": DOCS[3:4], "id": [3]}), hub / "validation.parquet")
    assert list(open_source(f"hf:{hub}", text_field="story").texts("train")) == DOCS[:3]


# --- text.py: the embedded corpus as a source ---------------------------------------------------


def test_story_source_validation_is_its_own_seed_and_never_in_train() -> None:
    """text.py's docstring: `owai-stories:N` uses N training stories and max(1, N // 40) validation
    stories; stories.default_story_splits: "(train, val) drawn from two fixed seeds, so val never
    shares a stream". The source's val split is VAL_SEED's stories and shares none with train."""
    source = open_source("owai-stories:200")
    train, val = list(source.texts("train")), list(source.texts("val"))
    assert train == stories.generate_stories(200, stories.TRAIN_SEED)
    assert val == stories.generate_stories(5, stories.VAL_SEED)
    assert not set(val) & set(train)


def test_story_sources_of_different_sizes_have_different_fingerprints() -> None:
    """A source's fingerprint identifies its content (it keys the token caches): owai-stories:40 and
    owai-stories:41 (the same single validation story, 40 vs 41 training stories) are different
    corpora and must not share a fingerprint."""
    a, b = open_source("owai-stories:40"), open_source("owai-stories:41")
    assert list(a.texts("val")) == list(b.texts("val"))
    assert a.fingerprint != b.fingerprint


def test_a_small_story_source_has_one_validation_story() -> None:
    """text.py's docstring: `owai-stories:N` uses "max(1, N // 40) validation stories": N = 10 still
    has one validation story (10 // 40 = 0)."""
    assert len(list(open_source("owai-stories:10").texts("val"))) == 1


def test_the_default_story_source_has_the_default_sizes() -> None:
    """text.py's docstring: "`owai-stories`: the embedded seeded corpus (`owai.data.stories`,
    20k/500 stories)": 20,000 training and 500 validation stories (stories.DEFAULT_*)."""
    source = open_source("owai-stories")
    assert (source.n_train, source.n_val) == (20_000, 500)
    assert sum(1 for _ in source.texts("val")) == 500


# --- stories.py ---------------------------------------------------------------------------------


def test_stories_are_the_same_in_processes_with_different_hash_seeds() -> None:
    """stories.py's docstring: "Deterministic across runs and platforms: only random.Random(seed) is
    used, and nothing iterates a set or a dict of strings in hash order". Two interpreters with
    different PYTHONHASHSEED values generate the same stories (stories.py is loaded by path: it
    imports only the standard library)."""
    code = ("import importlib.util, sys, hashlib; spec = importlib.util.spec_from_file_location('s', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); sys.modules['s'] = m; spec.loader.exec_module(m); "
            "print(hashlib.sha256('\\x00'.join(m.generate_stories(60, 3)).encode()).hexdigest())")
    digests = set()
    for hash_seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code, stories.__file__], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
        digests.add(out)
    assert len(digests) == 1


def test_a_storys_friend_and_pet_never_share_the_heros_name() -> None:
    """`_first_name`'s docstring: "never equal to a name in `avoid`" (the friend avoids the hero's
    name), and `_cast` redraws a pet named like either: in-context copying needs the cast's names
    to be distinct."""
    for record in stories.iter_story_records(20_000, 4):
        assert record.friend != record.hero
        assert record.pet not in (record.hero, record.friend)


def test_invented_names_are_rare() -> None:
    """stories.py: invented names are made "from syllables, so they are rare as unigrams" ("rare by
    design", `invented_name`). Of 3,000 invented names at least 99 % are distinct."""
    rng = random.Random(7)
    names = [stories.invented_name(rng) for _ in range(3000)]
    assert len(set(names)) >= 0.99 * len(names)


def test_pronouns_agree_with_each_characters_gender() -> None:
    """`_Character.pronouns`' docstring: he/him/his or she/her/her, as fields {he} {him} {his} {kid}
    (+ capitals), with prefix "f" for the friend ({fhe}, {Fhe})."""
    girl = stories._Character("Ada", True).pronouns("")
    assert {k: girl[k] for k in ("he", "him", "his", "kid", "He", "His")} == {
        "he": "she", "him": "her", "his": "her", "kid": "girl", "He": "She", "His": "Her"}
    boy = stories._Character("Ben", False).pronouns("f")
    assert {k: boy[k] for k in ("fhe", "fhim", "fhis", "fkid", "Fhe")} == {
        "fhe": "he", "fhim": "him", "fhis": "his", "fkid": "boy", "Fhe": "He"}


def test_every_story_has_three_paragraphs() -> None:
    """stories.py: a story is "opening, introductions (shuffled), a plot, an ending; 3 paragraphs",
    and paragraphs are "joined by \\n": every story holds exactly two newlines."""
    assert all(story.count("\n") == 2 and "\n\n" not in story for story in stories.generate_stories(500, 12))
