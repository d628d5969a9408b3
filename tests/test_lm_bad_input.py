"""Bad input to the language-model commands (`owai data stats`, `owai mosaic-train`, `owai mosaic-eval`)
refused in one line before any run directory exists: hub datasets this machine cannot read,
model.init_from for every architecture, --size with a non-chapter-4 --dry-run; and evaluation
batches that a huge count cannot turn into an out-of-memory."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
import torch

from conftest import as_sets, cli_in_process

TINY = ["data.source=owai-stories:300", "data.tokenizer=bytes", "data.block_size=32", "model.n_layer=1", "model.n_embd=32",
        "model.n_head=2", "train.steps=2", "train.batch_size=4", "train.warmup=1", "train.eval_batches=2",
        "eval.posloss_windows=4", "eval.val_batches=2", "eval.attention_sequences=2", "eval.continuations=false"]
UNCACHED = "not in the local Hugging Face datasets cache; read from the local cache only: Hugging Face offline mode is set"
STORIES = [f"Story {i}: Mia found a red ball and gave it to Tom." for i in range(200)]


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Offline mode, an empty owai cache and an empty Hugging Face datasets cache (returned)."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "owai-cache"))
    hf_cache = tmp_path / "hf-datasets"
    hf_cache.mkdir()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(hf_cache))
    return hf_cache


def cache_hub_dataset(hf_cache: Path, repo: str, texts: list[str]) -> None:
    """`repo` as `datasets` keeps a hub dataset it has prepared, which it reads offline:
    <cache>/<owner>___<name>/default/<version>/<hash>/ holding <name>-train.arrow and dataset_info.json."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    owner, name = repo.split("/")
    work = hf_cache.parent / "hub-build"
    work.mkdir()
    pq.write_table(pa.table({"text": texts}), work / "train.parquet")
    builder = Parquet(cache_dir=str(work / "cache"), dataset_name=name, data_files={"train": str(work / "train.parquet")},
                      hash="0123abcd")
    builder.download_and_prepare()
    config_dir = Path(builder.cache_dir).parent.parent  # <name>/default-<data files hash>: the hub's is "default"
    shutil.move(str(config_dir), hf_cache / f"{owner}___{name}" / "default")


def assert_refused(code: int, err: str, out: Path, match: str) -> None:
    assert code == 2, err
    assert match in err and err.strip().count("\n") == 0 and "Traceback" not in err, err
    assert not out.exists() or not any(out.iterdir())  # refused before any run directory exists


# -- 1. hub datasets while the hub cannot be reached ---------------------------------------------


@pytest.mark.parametrize("args", [
    ["data", "stats", "nobody/nonexistent-dataset", "--tokenizer", "bytes"],
    ["data", "stats", "tinystories", "--tokenizer", "bytes"],  # the catalogue name, not on this machine: its hub id
    ["mosaic-train", "--dataset", "nobody/nonexistent-dataset", *as_sets(TINY[1:])],
    ["mosaic-train", *as_sets(TINY), "--set", "eval.source=nobody/nonexistent-dataset"],
])
def test_uncached_hub_dataset_offline_is_refused_before_the_run(args, offline, tmp_path, capsys, monkeypatch):
    for name in ("OWAI_DATA", "OWAI_BABISTORIES"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "runs"
    code, _, err = cli_in_process([*args, "-o", str(out)], capsys)
    assert_refused(code, err, out, UNCACHED)


def test_mosaic_eval_of_an_uncached_hub_dataset_offline_is_refused(offline, tmp_path, capsys):
    from conftest import save_tiny_gpt2

    model = save_tiny_gpt2(tmp_path / "model", positions=64)
    capsys.readouterr()  # transformers' progress bar while saving it
    out = tmp_path / "runs"
    for command in (["mosaic-eval"], ["eval", "posloss"]):
        code, _, err = cli_in_process([*command, str(model), "--context", "32", "--dataset", "nobody/x", "-o", str(out)], capsys)
        assert_refused(code, err, out, "cannot load dataset 'nobody/x' from the Hugging Face hub (" + UNCACHED)


def test_hub_dataset_in_the_local_cache_runs_offline(offline, tmp_path, capsys):
    cache_hub_dataset(offline, "nobody/tiny_stories", STORIES)
    code, _, err = cli_in_process(["data", "stats", "nobody/tiny_stories", "--tokenizer", "bytes", "--set", "figure=false",
                                   "-q", "-o", str(tmp_path / "runs")], capsys)
    assert code == 0, err
    assert list((tmp_path / "runs").glob("*/*/results.json"))


def test_a_cached_dataset_read_by_streaming_counts_as_cached(offline):
    """A harness task may read its dataset with `streaming: True` (its dataset_kwargs); the cache check
    asks for the builder, which takes no such argument, so a cached dataset must still count."""
    from owai.hub import dataset_cached

    cache_hub_dataset(offline, "nobody/tiny_stories", STORIES)
    assert dataset_cached("nobody/tiny_stories", streaming=True)
    assert not dataset_cached("nobody/absent", streaming=True)


def test_hub_corpus_in_owais_token_cache_needs_no_hub_offline(offline, tmp_path):
    """mosaic-train reads a prepared corpus from owai's token cache: then neither the hub nor the
    Hugging Face datasets cache is needed, and the check lets it through."""
    from owai.data.tokens import prepare_tokens
    from owai.errors import DataMissing
    from owai.methods.language_model import Config, _check_common_inputs

    cache_hub_dataset(offline, "nobody/tiny_stories", STORIES)
    cfg = Config()
    cfg.data.source, cfg.data.tokenizer = "nobody/tiny_stories", "bytes"
    _check_common_inputs(cfg)  # in the Hugging Face datasets cache
    prepare_tokens(cfg.data.source, "bytes")
    shutil.rmtree(offline / "nobody___tiny_stories")
    _check_common_inputs(cfg)  # in owai's token cache
    cfg.data.tokenizer = "bpe-300"  # no bpe-300 trained on it, so no tokens of it either
    with pytest.raises(DataMissing, match=UNCACHED):
        _check_common_inputs(cfg)


def test_local_dataset_still_runs_offline(offline, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(STORIES), encoding="utf-8")
    code, _, err = cli_in_process(["data", "stats", str(corpus), "--tokenizer", "bytes", "--set", "figure=false", "-q",
                                   "-o", str(tmp_path / "runs")], capsys)
    assert code == 0, err


@pytest.mark.parametrize("args, match", [
    (["data", "stats", "owai-stories", "--tokenizer", ""], "data.tokenizer is empty"),  # made a run directory, then failed
    (["data", "stats", "", "--tokenizer", "bytes"], "data.source is empty"),  # read the current directory
    (["data", "stats", "owai-stories", "--tokenizer", "bytes", "--truncate", "4,,8"], "--truncate '4,,8': an empty value between commas"),
    (["data", "stats", "owai-stories", "--tokenizer", "tokdir"], "cannot fetch tokenizer 'tokdir' from local directory"),  # in the run
])
def test_data_stats_refuses_blank_names_lost_values_and_tokenizer_folders_holding_none(args, match, tmp_path, capsys, monkeypatch):
    """Found by the forty-fourth session's fuzzing: each of these ran, or failed inside a run directory."""
    monkeypatch.chdir(tmp_path)  # "" named the current directory: nothing there to read
    (tmp_path / "tokdir").mkdir()  # a folder that holds no tokenizer
    out = tmp_path / "runs"
    code, _, err = cli_in_process([*args, "-o", str(out)], capsys)
    assert_refused(code, err, out, match)


# -- 2. model.init_from, every architecture -------------------------------------------------------


@pytest.mark.parametrize("arch", ["mm", "gpt"])
@pytest.mark.parametrize("init_from, match", [("/nonexistent/model", "model path not found"),
                                              ("plain.txt", "holds no saved model")])
def test_bad_init_from_is_refused_before_the_run(arch, init_from, match, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    (tmp_path / "plain.txt").write_text("not a model\n")
    path = init_from if init_from.startswith("/") else str(tmp_path / init_from)
    out = tmp_path / "runs"
    code, _, err = cli_in_process(["mosaic-train", "--arch", arch, *as_sets(TINY), "--set", f"model.init_from={path}",
                                   "-o", str(out)], capsys)
    assert_refused(code, err, out, match)


def test_init_from_of_another_architecture_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    from conftest import save_tiny_gpt2

    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    gpt2 = save_tiny_gpt2(tmp_path / "gpt2")
    capsys.readouterr()
    out = tmp_path / "runs"
    code, _, err = cli_in_process(["mosaic-train", "--arch", "mm", *as_sets(TINY), "--set", f"model.init_from={gpt2}",
                                   "-o", str(out)], capsys)
    assert_refused(code, err, out, "does not fit this model: model_type is")


# -- 3. evaluation batches are drawn as they are read ------------------------------------------------


class CountingWindows:
    """A stand-in for TokenWindows that counts its draws and refuses to be drained up front."""

    def __init__(self) -> None:
        self.draws = 0

    def batch(self, size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        self.draws += 1
        if self.draws > 100:
            raise AssertionError("evaluation batches drawn up front")
        x = torch.randint(0, 1000, (size, 4), generator=gen)
        return x, x + 1


def test_a_huge_evaluation_batch_count_holds_no_batches_in_memory():
    from owai.methods.language_model import eval_batches

    windows = CountingWindows()
    batches = eval_batches(windows, 10**9, 2, 7, "val")  # a list of them ran out of memory
    assert len(batches) == 10**9 and windows.draws == 0
    first = list(itertools.islice(batches, 3))
    again = list(itertools.islice(batches, 3))
    assert windows.draws == 6
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))  # every pass draws the same batches


def test_lazy_evaluation_batches_equal_the_keyed_draws():
    from owai.methods.language_model import eval_batches
    from owai.runtime import generator

    windows = CountingWindows()
    lazy = [x for x, _ in eval_batches(windows, 5, 3, 11, "final-val")]
    keyed = [torch.randint(0, 1000, (3, 4), generator=generator(11, "final-val", i)) for i in range(5)]
    assert len(lazy) == 5 and all(torch.equal(a, b) for a, b in zip(lazy, keyed))


# -- 5. --size with a non-chapter-4 architecture in a dry run ------------------------------------------


def test_dry_run_with_size_and_a_chapter3_arch_says_size_does_not_apply(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    code, _, err = cli_in_process(["mosaic-train", "--size", "tiny", "--arch", "mm", "--dry-run"], capsys)
    assert code == 2 and err.strip().count("\n") == 0, err
    assert "--size (model.size=tiny) applies to mmv2, transformer, not mm" in err and "give --size" not in err
