"""Damaged or malformed data files are one OwaiError naming the file, never an internal error or a
silently smaller dataset (cases an audit of damaged copies found)."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from owai.errors import OwaiError


def test_icl_files_that_are_not_utf8_or_have_no_queries(shared_data: Path, tmp_path: Path) -> None:
    from owai.evals import longicl
    from owai.methods.icl_eval import Config, load_task

    banking = tmp_path / "banking77"
    shutil.copytree(shared_data / "icl" / "banking77", banking)
    lines = (banking / "test.csv").read_bytes().splitlines(keepends=True)
    (banking / "test.csv").write_bytes(b"".join(lines[:5]) + b"\xff\xfe" + b"".join(lines[5:20]))
    with pytest.raises(OwaiError, match=r"^longicl: .*banking77/test\.csv: not UTF-8 text \(byte \d+"):
        longicl.load_banking77(banking)
    (banking / "test.csv").write_bytes(lines[0])  # the header alone
    with pytest.raises(OwaiError, match=r"^longicl: banking77's query pool is empty"):
        load_task(Config(task="banking77", data=str(banking)))

    goemotions = tmp_path / "goemotions"
    shutil.copytree(shared_data / "icl" / "goemotions", goemotions)
    (goemotions / "labels.txt").write_bytes(b"\xffadmiration\n" + (goemotions / "labels.txt").read_bytes())
    with pytest.raises(OwaiError, match=r"^longicl: .*labels\.txt: not UTF-8 text"):
        longicl.load_goemotions(goemotions)


def test_a_tar_cut_inside_a_member_is_one_line(tmp_path: Path) -> None:
    from owai.data.text import open_source

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for i in range(4):
            data = (f"document {i} " * 400).encode()
            member = tarfile.TarInfo(f"doc{i}.txt")
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    whole = buffer.getvalue()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole[: 2 * 5120 + 512 + 1000])  # inside the third member's text (512-byte header + 4,608 of data each)
    with pytest.raises(OwaiError, match=r"cut\.tar: cannot read"):
        list(open_source(str(cut)).texts("train"))


def test_camelyon17_metadata_out_of_range_or_not_utf8(tmp_path: Path) -> None:
    from camelyon_tree import make_camelyon
    from owai.data.camelyon17 import Camelyon17

    root = make_camelyon(tmp_path / "c", train_per_center=2, id_val_per_center=1, eval_per_center=2, size=8)
    metadata = root / "camelyon17_v1.0" / "metadata.csv"
    good = metadata.read_text()
    header, first, *rest = good.splitlines()
    columns = header.split(",")

    def with_value(column: str, value: str) -> str:
        cells = first.split(",")
        cells[columns.index(column)] = value
        return "\n".join([header, ",".join(cells), *rest]) + "\n"

    for column, value, message in (("center", "9", "column 'center' must be a hospital 0-4"),
                                   ("split", "7", r"column 'split' must be 0 \(train\) or 1")):
        metadata.write_text(with_value(column, value))
        with pytest.raises(OwaiError, match=message):
            Camelyon17(root)
    metadata.write_bytes(b"\xff" + good.encode())
    with pytest.raises(OwaiError, match=r"metadata\.csv: not UTF-8 text"):
        Camelyon17(root)


def test_qa_files_with_wrongly_typed_entries(tmp_path: Path) -> None:
    from owai.evals import ruler

    squad = tmp_path / "squad.json"
    squad.write_text(json.dumps({"data": [{"paragraphs": [{"context": "c", "qas": ["oops"]}]}]}))
    with pytest.raises(OwaiError, match="is not a SQuAD v2.0 file"):
        ruler.read_squad(squad)
    hotpot = tmp_path / "hotpot.json"
    hotpot.write_text(json.dumps([{"question": "q", "answer": ["a", "b"], "context": [["t", ["s."]]]}]))
    with pytest.raises(OwaiError, match=r"is not a HotpotQA file \(TypeError: an answer is not a string\)"):
        ruler.read_hotpotqa(hotpot)


def test_a_domain_too_small_to_hold_out_from(tmp_path: Path) -> None:
    from owai.data.domainbed import split_domain

    inside, held_out = split_domain(10, 0.2, 0, 1)
    assert len(inside) == 8 and len(held_out) == 2
    with pytest.raises(OwaiError, match=r"^domain 3 has 4 examples: too few to hold out 0\.2 of them"):
        split_domain(4, 0.2, 0, 3)


def test_a_saved_model_whose_weights_do_not_fit_its_config(tmp_path: Path) -> None:
    from conftest import save_tiny_gpt2
    from owai.models.lm import load_pretrained

    model = save_tiny_gpt2(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["n_embd"] *= 2
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(OwaiError, match=r"^cannot load the model in .*/m: "):
        load_pretrained(model)


def test_a_damaged_local_tokenizer_is_refused_before_the_run_exists(shared_data: Path, tmp_path: Path, capsys) -> None:
    """`data stats -t DIR` with an encoder.json that is not JSON: one line before any run directory
    (it used to fail inside the run, whose directory stayed)."""
    from conftest import cli_in_process

    tokenizer = tmp_path / "tok"
    shutil.copytree(shared_data / "tokenizers" / "gpt2", tokenizer)
    (tokenizer / "encoder.json").write_text("{bad")
    code, _, err = cli_in_process(["data", "stats", str(shared_data / "text" / "sotu.tar.gz"), "-t", str(tokenizer),
                                   "-o", str(tmp_path / "runs"), "-q"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"cannot read the BPE tokenizer in {tokenizer}" in err, err
    assert not (tmp_path / "runs").exists()


def test_messages_name_the_member_the_row_and_the_empty_essays(tmp_path: Path) -> None:
    from camelyon_tree import make_camelyon
    from owai.data.camelyon17 import Camelyon17
    from owai.data.text import open_source
    from owai.errors import DataMissing
    from owai.evals.ruler import read_essays

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in (("a.txt", b"fine text"), ("b.txt", b"\xff\xfe latin")):
            member = tarfile.TarInfo(name)
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    (tmp_path / "two.tar.gz").write_bytes(buffer.getvalue())
    with pytest.raises(OwaiError, match=r"two\.tar\.gz:b\.txt: not UTF-8 text"):
        list(open_source(str(tmp_path / "two.tar.gz")).texts("train"))

    root = make_camelyon(tmp_path / "c", train_per_center=2, id_val_per_center=1, eval_per_center=2, size=8)
    metadata = root / "camelyon17_v1.0" / "metadata.csv"
    header, first, *rest = metadata.read_text().splitlines()
    metadata.write_text("\n".join([header, ",".join(first.split(",")[:3]), *rest]) + "\n")
    with pytest.raises(OwaiError, match=r"metadata\.csv line 2: 3 fields, the header has \d+"):
        Camelyon17(root)
    width = len(header.split(","))
    metadata.write_text("\n".join([header, first + ",1,2,3", *rest]) + "\n")
    with pytest.raises(OwaiError, match=rf"metadata\.csv line 2: {width + 3} fields, the header has {width}$"):
        Camelyon17(root)

    essays = tmp_path / "essays"
    essays.mkdir()
    (essays / "one.txt").write_text("  \n")
    with pytest.raises(DataMissing, match=r"its 1 \.txt file\(s\) hold no text"):
        read_essays(essays)


def test_a_bpe_folder_missing_one_of_its_two_files_says_which(shared_data: Path, tmp_path: Path) -> None:
    from owai.data.text import load_tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(shared_data / "tokenizers" / "gpt2" / "encoder.json", folder)
    with pytest.raises(OwaiError, match=r"^tokenizer folder .*/tok: vocab\.bpe is missing"):
        load_tokenizer(str(folder))
    (folder / "encoder.json").rename(folder / "vocab.json")  # the other naming, whole, beside a stray half
    shutil.copy(shared_data / "tokenizers" / "gpt2" / "vocab.bpe", folder / "merges.txt")
    shutil.copy(shared_data / "tokenizers" / "gpt2" / "encoder.json", folder)
    assert load_tokenizer(str(folder)).vocab_size == 50257


def test_the_data_root_is_unused_only_where_nothing_is_looked_up_under_it() -> None:
    from owai.methods.language_model import DataConfig, EvalConfig, data_root_unused

    embedded, no_eval = DataConfig(source="owai-stories"), EvalConfig()
    assert set(data_root_unused(embedded, no_eval, "bpe-512")) == {"data.root"}
    assert set(data_root_unused(embedded, no_eval, "/abs/tokenizer")) == {"data.root"}
    assert data_root_unused(embedded, no_eval, "tokenizers/gpt2") == {}  # a relative tokenizer is looked up
    assert data_root_unused(embedded, no_eval, "gpt2") == {}  # a catalogue name or hub id: looked up first
    assert data_root_unused(DataConfig(source="babistories"), no_eval, "bytes") == {}
    assert data_root_unused(embedded, EvalConfig(source="text/sotu.tar.gz"), "bytes") == {}
