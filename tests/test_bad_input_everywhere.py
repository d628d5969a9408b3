"""Bad input on every command: exit 2, one `error:` line naming the problem, no traceback, and
nothing under --out. The cases of a sweep of bad invocations across the CLI (docs/decisions.md,
"Settings by role, and the run's device"), run in this process so the table stays cheap. (The
harness's unknown task, which imports lm-evaluation-harness's task index, is tests/test_harness.py's.)"""

from __future__ import annotations

import pytest
import torch

from conftest import cli_in_process

NO_OUT = ("report", "data", "recipes show")  # commands without --out

CASES = [
    # bonsai (sec 2.3)
    (["bonsai", "--dataset", "nonexistent"], "--dataset 'nonexistent': choose from"),
    (["bonsai", "--init", "foo"], "params.init: expected one of"),
    (["bonsai", "--recipe", "nope"], "unknown recipe 'nope'"),
    (["bonsai", "--set", "train.lr=.nan"], "params.train.lr must be a finite number, got nan"),
    (["bonsai", "--dataset", "camelyon17", "--set", "data.root=/nonexistent"], "not found in /nonexistent"),
    (["bonsai", "--dataset", "coloredmnist", "--method", "erm,erm"], "give distinct comma-separated values"),
    # dropout-ft (sec 2.4)
    (["dropout-ft", "--dataset", "foo"], "data.dataset 'foo'"),
    (["dropout-ft", "--dropout", "1.5"], "model.dropout must be in [0, 1), got 1.5"),
    (["dropout-ft", "--test-domain", "99"], "rotated-mnist has 4 domains"),
    (["dropout-ft", "--backbone", "foo"], "unknown backbone 'foo'"),
    (["dropout-ft", "--set", "train.momentum=1.0"], "params.train.momentum must be in [0, 1), got 1.0"),
    (["dropout-ft", "--dataset", "pacs", "--data-root", "/nonexistent"], "PACS not found in /nonexistent"),
    # rich-features (sec 2.1-2.2)
    (["rich-features", "--stage", "foo"], "stage 'foo'"),
    (["rich-features", "-r", "nope"], "unknown recipe 'nope'"),
    # moons (ch. 3)
    (["moons", "--preset", "nope"], "has no preset 'nope'"),
    (["moons", "--set", "model.heads=[0]"], "model.heads must be a non-empty subset"),
    (["moons", "--set", "model.heads=[1,1]"], "model.heads must be a non-empty subset"),
    (["moons", "--set", "train.lr=-1"], "params.train.lr must be > 0, got -1.0"),
    (["moons", "--set", "train.steps=0"], "train.steps must be >= 1"),
    (["moons", "--set", "runtime.threads=-2"], "params.runtime.threads must be between 0 and 1,024, got -2"),
    (["moons", "--set", "train=3"], "params.train: expected a mapping"),
    (["moons", "--set", "=3"], "empty key"),
    (["moons", "linear", "--set", "foo=1"], "unknown key 'foo'"),
    (["moons", "--resume", "/nonexistent"], "does not exist"),
    (["moons", "--preset", ""], "a blank preset name"),  # ran the default preset
    (["moons", "--set", "seed=99999999999999999999999"], "params.seed must be a 64-bit integer"),  # torch overflowed in the run
    (["moons", "--set", "runtime.threads=100000"], "params.runtime.threads must be between 0 and 1,024, got 100000"),  # SIGSEGV
    # mosaic-train / mosaic-eval (sec 3.5, ch. 4)
    (["mosaic-train", "--size", "huge"], "--size must be one of tiny, small, large"),
    (["mosaic-train", "--arch", "foo"], "unknown architecture 'foo'"),
    (["mosaic-train", "--size", "tiny", "--set", "train.steps=-1"], "train.steps must be >= 1"),
    (["mosaic-train", "--size", "tiny", "--set", "train.lr=abc"], "params.train.lr: expected float"),
    (["mosaic-train", "--size", "tiny", "--set", "model.n_head=7"], "model.size=tiny has n_head=4"),
    (["mosaic-train", "--size", "tiny", "--set", "data.documents=maybe"], "expected bool"),
    (["mosaic-train", "--size", "tiny", "--set", "data.stream=true", "--set", "data.prefetch=-1"],
     "data.prefetch must be between 0 and 1,024, got -1"),
    (["mosaic-train", "--size", "tiny", "--set", "data.stream=true", "--set", "data.prefetch=soon"],
     "params.data.prefetch: expected int | 'auto', got str 'soon'"),
    (["mosaic-train", "--size", "tiny", "--set", "train.precision=fp8"], "params.train.precision: expected one of"),
    (["mosaic-train", "--size", "tiny", "--set", "data.stream=true", "--set", "data.shuffle_buffer=-1"],
     "data.shuffle_buffer must be >= 0 (0: the source's order), got -1"),  # refused inside the run
    (["mosaic-train", "--size", "tiny", "--set", "data.stream=true", "--set", "data.stream_val_tokens=0"],
     "data.stream_val_tokens must be >= 1, got 0"),  # read as one window
    (["mosaic-train", "--size", "tiny", "--tokenizer", "bpe--5"], "not a Hugging Face hub id"),  # the hub client's HFValidationError
    (["mosaic-train", "--size", "tiny", "--set", "runtime.device=tpu"], "params.runtime.device: expected one of"),
    (["mosaic-train", "--size", "tiny", "--set", "train.batch_size=100000000"], "lower train.batch_size"),
    (["mosaic-train", "--size", "tiny", "--set", "data.source=/nonexistent"], "dataset path not found"),
    (["mosaic-train", "--size", "tiny", "--depth", "0"], "--depth"),
    (["mosaic-eval", "--resume", "/nonexistent"], "does not exist"),
    # eval
    (["eval", "ruler", "--ctx", "32q"], "unknown context length '32q'"),
    (["eval", "ruler", "--ctx", "0"], "context length must be positive"),
    (["eval", "ruler", "--ctx", "2000000"], "more than the largest owai runs"),
    (["eval", "ruler", "--ctx", "4k,4k"], "give distinct comma-separated values"),
    (["eval", "ruler", "--tasks", "nope"], "give distinct tasks from"),
    (["eval", "ruler", "--n", "0"], "--n"),
    (["eval", "icl", "--task", "nope"], "task 'nope'"),
    (["eval", "icl", "--set", "shots=[0]"], "shots must be between 1 and"),
    (["eval", "posloss", "/nonexistent"], "model path not found"),
    (["eval", "regbench", "--model", "foo"], "unknown RegBench model 'foo'"),
    (["eval", "regbench", "--train-size", "-3"], "--train-size -3"),
    (["eval", "regbench", "--positions", "foo"], "--positions 'foo'"),
    # sweeps, recipes, reports, data
    (["sweep", "nonexistent"], "unknown recipe 'nonexistent'"),
    (["sweep", "three-moons", "--seeds", "a,b"], "--seeds 'a,b'"),
    (["sweep", "three-moons", "--seeds", "1,1"], "a seed is repeated"),
    (["sweep", "three-moons", "--seeds", "1,,2"], "an empty value between commas"),
    (["rich-features", "--seeds", "0", "--n", "4", "--dry-run"], "probe.n=4 but 1 seeds given"),
    (["sweep", "three-moons", "--grid", "train.lr=,"], "an empty value between commas"),
    (["sweep", "three-moons", "--workers", "0"], "--workers"),
    (["sweep", "three-moons", "--grid", "train.lr="], "no values"),
    (["sweep", "three-moons", "--grid", "train.lr=-1,0.1"], "params.train.lr must be > 0, got -1.0"),
    (["recipes", "run", "three-moons", "--preset", "nope"], "has no preset 'nope'"),
    (["recipes", "show", "nope"], "unknown recipe 'nope'"),
    (["report", "/nonexistent"], "does not exist"),
    (["report", __file__], "is a file, not a run directory"),
    (["data", "fetch", "nope"], "unknown dataset 'nope'"),
    (["data", "verify", "nope"], "unknown dataset 'nope'"),
]
if not torch.cuda.is_available():
    CASES += [(["moons", "--set", "runtime.device=cuda"], "no CUDA device is available"),
              (["sweep", "three-moons", "--seeds", "0", "--set", "runtime.device=cuda"], "no CUDA device is available")]


@pytest.mark.parametrize("args, fragment", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line_and_leaves_nothing(args, fragment, tmp_path, capsys):
    out = tmp_path / "runs"
    takes_out = not any(" ".join(args).startswith(c) for c in NO_OUT) and "--resume" not in args
    code, stdout, stderr = cli_in_process([*args, *(["--out", str(out)] if takes_out else [])], capsys)
    err = stderr.strip()
    assert code == 2, (code, stdout[-500:], err[-500:])
    assert "Traceback" not in stdout + stderr
    assert len(err.splitlines()) == 1 and err.startswith("error:"), err
    assert fragment in err, err
    assert not out.exists()
