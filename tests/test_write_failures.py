"""Writes that fail (a full disk, a read-only folder, a file where a folder goes, a name too long)
end in one `error:` line naming what could not be written, and a later run or resume does not trust
what they left half-done (a filesystem audit found internal errors and tracebacks in these places)."""

from __future__ import annotations

import errno

import pytest
import torch

from conftest import TINY_MOONS, as_sets, cli_in_process
from owai.errors import OwaiError


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_checkpoint_that_cannot_be_written_is_one_line_naming_it(tmp_path, monkeypatch) -> None:
    import owai.checkpoint as checkpoint

    state = {"w": torch.ones(3), "step": 1}
    checkpoint.save_checkpoint(tmp_path, 1, state)
    monkeypatch.setattr(checkpoint, "save_file", no_space)
    with pytest.raises(OwaiError, match=r"^cannot write checkpoint .*step-000002: No space left on device$"):
        checkpoint.save_checkpoint(tmp_path, 2, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]  # no temporary folder left

    class SafetensorError(Exception):  # safetensors' own error type, raised for its I/O failures
        pass

    def serializing(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(checkpoint, "save_file", serializing)
    with pytest.raises(OwaiError, match=r"^cannot write checkpoint .*step-000002: No space left on device \(os error 28\)$"):
        checkpoint.save_checkpoint(tmp_path, 2, state)


def test_a_run_whose_metrics_cannot_be_appended_fails_in_one_line_and_resumes(tmp_path, monkeypatch, capsys) -> None:
    """metrics.jsonl unwritable mid-run: one line naming it, exit 2; a resume finishes the run."""
    from owai.runs import Run

    out, appended, real_open = tmp_path / "runs", {"n": 0}, open

    def open_failing(file, mode="r", *args, **kwargs):  # the third metrics line meets a full disk
        if str(file).endswith("metrics.jsonl") and "a" in mode:
            appended["n"] += 1
            if appended["n"] == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", open_failing)
    code, _, err = cli_in_process(["moons", *as_sets([*TINY_MOONS, "train.log_every=1"]), "-o", str(out), "-q"], capsys)
    monkeypatch.undo()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "cannot write" in err and "metrics.jsonl: No space left on device" in err
    (run_dir,) = (out / "three-moons").iterdir()
    assert Run(run_dir).status() == "failed"
    code, _, err = cli_in_process(["moons", "--resume", str(run_dir), "-q"], capsys)
    assert code == 0 and Run(run_dir).status() == "complete", err


def test_cache_writers_name_the_entry_they_cannot_write(tmp_path) -> None:
    from owai.io import check_folder, folder_to_build, write_cache_entry

    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache's folder goes")
    with pytest.raises(OwaiError, match=r"^cannot write cache entry .*bonsai/x\.safetensors: Not a directory$"):
        write_cache_entry(blocker / "bonsai" / "x.safetensors", {"t": torch.zeros(2)})
    with pytest.raises(OwaiError, match=r"^cannot write .*mnist: Not a directory$"):
        folder_to_build(blocker / "data" / "mnist", "fetch")
    with pytest.raises(OwaiError, match="cannot be made: File name too long"):
        check_folder(tmp_path / ("a" * 300), "the run folder")


def test_a_damaged_cached_tokenizer_is_trained_again(tmp_path, capsys) -> None:
    from owai.data.text import load_tokenizer

    texts = [f"document {i} about memory mosaics and predictive disentanglement" for i in range(200)]
    first = load_tokenizer("bpe-300", cache_dir=tmp_path, training_texts=texts)
    (cached,) = (tmp_path / "tokenizers").glob("bpe-300-*/tokenizer.json")
    cached.write_text(cached.read_text()[:3000])  # cut, as a full disk leaves it
    again = load_tokenizer("bpe-300", cache_dir=tmp_path, training_texts=texts)
    assert again.encode(texts[7]) == first.encode(texts[7])
    assert "damaged tokenizer cache entry" in capsys.readouterr().err
    load_tokenizer("bpe-300", cache_dir=tmp_path, training_texts=texts)  # the rebuilt entry reads back
    assert "damaged" not in capsys.readouterr().err


def test_a_corrupt_newest_checkpoint_says_how_to_resume_from_the_one_before(tmp_path, capsys) -> None:
    out = tmp_path / "runs"
    sets = list(TINY_MOONS)  # checkpoints every 2 steps, the newest two kept
    code, _, err = cli_in_process(["moons", *as_sets(sets), "-o", str(out), "-q"], capsys)
    assert code == 0, err
    (run_dir,) = (out / "three-moons").iterdir()
    stage = next(p for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
    steps = sorted(stage.iterdir())
    assert len(steps) >= 2
    (steps[-1] / "tensors.safetensors").write_bytes(b"cut")
    from owai.runs import Run

    Run(run_dir).set_status("interrupted")
    (run_dir / "results.json").unlink()  # killed before it finished
    code, _, err = cli_in_process(["moons", "--resume", str(run_dir), "-q"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "is corrupt" in err and f"remove {steps[-1]} to resume from the checkpoint before it, {steps[-2].name}" in err


def test_a_fetch_that_cannot_write_here_names_the_file_not_the_mirror(shared_data, tmp_path, monkeypatch) -> None:
    """Disk full while downloading: the local file is named (the error used to blame the mirror's URL,
    and the next mirror was tried for nothing)."""
    from owai.data import registry

    tried = []

    def full_disk(url, dest, *args, **kwargs):
        tried.append(url)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(registry, "download", full_disk)
    mirror = (shared_data / "tokenizers" / "gpt2").as_uri() + "/"
    with pytest.raises(OwaiError, match=r"^cannot write .*encoder\.json: No space left on device$"):
        registry.fetch("gpt2", root=tmp_path / "data", base_url=mirror)
    assert len(tried) == 1 and not list((tmp_path / "data").rglob("*.json"))
