"""`owai data list / verify` covers every dataset and tokenizer a recipe reads (issue #40).

The walk resolves every implemented recipe at every preset and reads the config values that name
data (DATA_KEYS); each must be made by owai itself (`registry.generated`) or map to a catalogue
entry that `owai data list` prints (`registry.entry_for`). A recipe that starts reading something
unlisted fails here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from conftest import cli_in_process

# config keys (the last parts of a dotted path) whose values name data or a tokenizer a method reads
DATA_KEYS = {"data.base", "data.target", "data.dataset", "dataset", "data.source", "data.tokenizer", "data.hub_id",
             "eval.source", "pretrain.source", "task", "tokenizer", "reference_tokenizer", "haystack_dir", "squad",
             "hotpotqa"}
QA_KEYS = {"squad", "hotpotqa"}  # eval ruler: "hf" = the hub copy of the entry of that name
SAME_DATA = {("dropout_ft", "pretrain.source", "pool")}  # dropout-ft's pool: the images of its data.dataset
IMPLICIT = {"camelyon17": ["camelyon17"]}  # methods that read a dataset no config value names


def _leaves(node: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{path}.{k}" if path else str(k))]
    if isinstance(node, list):
        return [leaf for v in node for leaf in _leaves(v, path)]
    return [(path, node)]


def _reads(method: str, params: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, value) of every config value that names data."""
    out = []
    for path, value in _leaves(params):
        key = next((k for k in DATA_KEYS if path == k or path.endswith("." + k)), None)
        if key is not None and isinstance(value, str) and (method, key, value) not in SAME_DATA:
            out.append((key, value))
    return out + [("method", name) for name in IMPLICIT.get(method, [])]


def recipe_reads() -> dict[str, set[str]]:
    """Catalogue entry names read by each recipe (every preset); raises on a value with no entry."""
    from owai import recipes
    from owai.config import to_dict
    from owai.data import registry
    from owai.experiment import resolve

    found: dict[str, set[str]] = {}
    for rid in recipes.available():
        rec = recipes.load(rid)
        if not rec.implemented:
            continue
        for preset in [rec.default_preset, *rec.presets]:
            cfg, _ = resolve(rec, preset, [], validate=False)
            for key, value in _reads(rec.method, to_dict(cfg)):
                if registry.generated(value) and not (key in QA_KEYS and value == "hf"):
                    continue
                entry = registry.entry_for(key if key in QA_KEYS and value == "hf" else value)
                assert entry is not None, (f"recipe {rid} (preset {preset}) reads {key}={value!r}, which "
                                           "`owai data list` does not name: add it to the data catalogue")
                found.setdefault(rid, set()).add(entry.name)
    return found


def test_every_recipe_reads_only_listed_data(capsys: pytest.CaptureFixture[str]) -> None:
    reads = recipe_reads()
    code, out, _ = cli_in_process(["data", "list", "--json"], capsys)
    assert code == 0
    listed = {row["name"] for row in json.loads(out)}
    everything = set().union(*reads.values())
    assert everything <= listed
    # the ones issue #40 found missing, each read by a recipe
    assert {"banking77", "gpt2", "sotu", "paul_graham_essays", "squad", "hotpotqa", "mnist",
            "llama3-tokenizer", "fineweb-edu", "babistories", "wikipedia"} <= everything
    assert {"banking77"} <= reads["fig4.6-icl"] and {"paul_graham_essays", "gpt2"} <= reads["table4.4-ruler"]
    assert "sotu" in reads["table4.2-pretrain"]


def test_an_unlisted_input_is_caught() -> None:
    from owai.data import registry

    assert registry.entry_for("text/nosuch.tar.gz") is None and registry.entry_for("someone/else-tok") is None
    assert not registry.generated("text/nosuch.tar.gz")
    assert registry.entry_for("text/sotu.tar.gz").name == "sotu"
    assert registry.entry_for("tokenizers/gpt2").name == "gpt2"
    assert registry.entry_for("hf:PolyAI/banking77").name == "banking77"
    assert registry.entry_for("goemotion").name == "goemotions"
    assert registry.entry_for("wikipedia:20220301.simple").name == "wikipedia"


def test_icl_and_ruler_read_where_the_catalogue_says() -> None:
    """The loaders' own folders and hub ids are the catalogue's (one place to look them up)."""
    from owai.data import registry, text
    from owai.evals import ruler
    from owai.methods import icl_eval

    for task, folder in icl_eval.DATA_FOLDERS.items():
        assert registry.dataset(task).subfolder == folder
    assert (text.SQUAD_HUB_ID, text.HOTPOTQA_HUB_ID) == (ruler.SQUAD_HUB_ID, ruler.HOTPOTQA_HUB_ID)
    assert registry.dataset("squad").hf_id == ruler.SQUAD_HUB_ID


@pytest.mark.parametrize("name, files", [("banking77", 3), ("goemotion", 4), ("gpt2", 2), ("sotu", 1),
                                         ("essays", 1), ("mnist", 4)])
def test_verify_the_real_copies(name: str, files: int, shared_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli_in_process(["data", "verify", name, "--json"], capsys)
    assert code == 0, err
    checked = json.loads(out)["verified"]
    assert len(checked) == files and all(" ok" in line for line in checked)


def test_verify_refuses_a_changed_copy(tmp_path: Path, shared_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bank = tmp_path / "icl" / "banking77"
    shutil.copytree(shared_data / "icl" / "banking77", bank)
    for f in bank.iterdir():
        f.chmod(0o644)
    with open(bank / "test.csv", "a") as f:
        f.write("one more row,card_arrival\n")
    code, _, err = cli_in_process(["data", "verify", "banking77", "--data-root", str(tmp_path)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "test.csv has sha256" in err
    essays = tmp_path / "text" / "paul_graham_essays"
    shutil.copytree(shared_data / "text" / "paul_graham_essays", essays)
    (essays / "extra.txt").write_text("an essay too many\n")
    code, _, err = cli_in_process(["data", "verify", "paul_graham_essays", "--data-root", str(tmp_path)], capsys)
    assert code == 2 and "50 *.txt files have tree sha256" in err


def test_fetch_gpt2_checks_sha256(tmp_path: Path, shared_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`owai data fetch gpt2` from a mirror (here a local one) keeps only files with the known sha256."""
    good = (shared_data / "tokenizers" / "gpt2").as_uri() + "/"
    code, out, err = cli_in_process(["data", "fetch", "gpt2", "--data-root", str(tmp_path / "a"), "--mirror", good,
                                     "--json"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "a" / "tokenizers" / "gpt2").iterdir()) == ["encoder.json", "vocab.bpe"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "encoder.json").write_text("{}")
    code, _, err = cli_in_process(["data", "fetch", "gpt2", "--data-root", str(tmp_path / "b"), "--mirror",
                                   bad.as_uri() + "/"], capsys)
    assert code == 2 and "cannot fetch gpt2 file encoder.json" in err and "(refused)" in err
    assert not (tmp_path / "b" / "tokenizers" / "gpt2").exists()


def test_a_missing_catalogue_path_gets_the_catalogues_line_but_a_shared_parent_does_not(tmp_path, monkeypatch):
    """`missing_relative`: a path naming an entry's folder or file gets that entry's one line; `text`,
    the parent of sotu.tar.gz and of every corpus, names no one dataset."""
    from owai.data import registry

    monkeypatch.setenv("OWAI_DATA", str(tmp_path))
    assert registry.missing_relative("text/sotu.tar.gz").startswith("State of the Union addresses")
    assert registry.missing_relative("icl/banking77/").startswith("BANKING77")
    assert registry.missing_relative("domainbed/PACS").startswith("DomainBed PACS")
    assert registry.missing_relative("text") is None and registry.missing_relative("icl") is None
    assert registry.missing_relative("nowhere/at/all") is None
