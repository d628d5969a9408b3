"""The benchmark scripts' bad input is one `error:` line and exit 2, as owai's own (benchmarks/_args.py),
and gpu_check.py's JSON names the machine it ran on, written after each verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


@pytest.mark.parametrize("script, args, message", [
    # each was a traceback, a StatisticsError, "0 checks" with exit 0, or figures of nothing
    ("mmv2.py", ["throughput", "--size", "bogus"], "argument --size: invalid choice: 'bogus'"),
    ("mmv2.py", ["throughput", "--rounds", "0"], "argument --rounds: expected an integer >= 1, got 0"),
    ("mmv2.py", ["throughput", "--device", "cuda"], "--device cuda: torch"),
    ("lm_throughput.py", ["--paired-steps", "-1"], "argument --paired-steps: expected an integer >= 0, got -1"),
    ("bag_of_k_memory.py", ["--positions", "0"], "argument --positions: expected an integer >= 1, got 0"),
    ("mmv2_paired.py", ["--before", "HEAD", "--context", "4", "--numerics"], "--context must be at least 40, got 4"),
    ("gpu_check.py", ["--only", "arch,bogus"], "--only bogus: choose from arch, speed, fsdp, e2e, pytest"),
    ("gpu_check.py", ["--device", "cpu", "--archs", "lstm,bogus"], "--archs bogus: choose from"),
    ("gpu_check.py", ["--device", "cuda"], "--device cuda: torch"),
    ("bonsai_cpu.py", ["--workers", "0"], "argument --workers: expected an integer >= 1, got 0"),
    ("data_scale.py", ["--only", "tar,bogus"], "--only bogus: choose from tar, windows, paths, samplers, camelyon"),
])
def test_bad_input_is_one_error_line_and_exit_2(script: str, args: list[str], message: str, tmp_path: Path) -> None:
    done = _run(script, *args, cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], \
        (done.returncode, done.stderr[-2000:])
    assert not any(tmp_path.iterdir())


def test_gpu_checks_json_names_the_device_and_holds_each_verdict(tmp_path: Path) -> None:
    """The JSON's "device" was the last check's name (the loop variable reused), and the file was
    written only at the end, so a call cut at its time limit returned none of it."""
    out = tmp_path / "gpu.json"
    done = _run("gpu_check.py", "--device", "cpu", "--only", "arch", "--archs", "lstm", "--json-out", str(out),
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["device"] == "cpu" and [v["check"] for v in record["verdicts"]] == ["arch:lstm"]
    assert record["verdicts"][0]["status"] == "PASS"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.json"]  # no partial file left


def test_the_lstms_flops_are_its_multiplying_parameters() -> None:
    """gpu_check's MFU for the LSTM (no attention, no heads for the plan): 2 x the parameters that
    multiply, where it counted the untied input embedding's lookup too (1.41x at 12 x 768)."""
    import torch

    from owai.models.lm import build_lm
    from owai.plan import multiplying_parameters

    with torch.device("meta"):
        untied = build_lm("lstm", vocab_size=1000, n_layer=2, n_embd=64)
        tied = build_lm("lstm", vocab_size=1000, n_layer=2, n_embd=64, tie_word_embeddings=True, head_bias=False)
    total = sum(p.numel() for p in untied.parameters())
    assert multiplying_parameters(untied) == total - 1000 * 64
    assert multiplying_parameters(tied) == sum(p.numel() for p in tied.parameters())
