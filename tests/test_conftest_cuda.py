"""The test runs hide CUDA from every test but the `gpu` ones (tests/conftest.py, `cuda_hidden`): on a
GPU machine the default run must run as on the CPU machines where its expected values were taken,
and `pytest -m gpu` must see the GPU. Checked with the real conftest in a scratch folder, on probe
tests whose process records what it saw, in one process and under pytest-xdist's workers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cuda_hidden

PROBES = '''
import pytest


def test_plain():
    pass


@pytest.mark.slow
def test_slow():
    pass


@pytest.mark.gpu
def test_gpu():  # skips without CUDA (conftest): what it saw is recorded when it is selected
    pass
'''

# What each selected probe's process saw, and a process it starts: recorded when collection ends
# (after -m has deselected), since a gpu probe skips before any fixture of its own could run.
RECORDER = '''
import json, os, subprocess, sys


def pytest_collection_finish(session):
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    seen = {"here": os.environ.get("CUDA_VISIBLE_DEVICES"), "child": child}
    for item in session.items:
        (session.config.rootpath / "seen" / item.name.removeprefix("test_")).write_text(json.dumps(seen))
'''


@pytest.mark.parametrize("markexpr, hidden", [
    ("", True), ("not slow", True), ("slow", True), ("not gpu", True), ("gpu or slow", True),
    ("gpu", False), ("gpu and not slow", False), ("(gpu)", False), ("slow and gpu", False),
])
def test_only_runs_of_gpu_tests_alone_see_cuda(markexpr, hidden):
    assert cuda_hidden(markexpr) is hidden


def _run(folder: Path, *args: str) -> dict[str, dict[str, str]]:
    """pytest on the probes with `args`; what each selected probe's process saw."""
    seen = folder / "seen"
    shutil.rmtree(seen, ignore_errors=True)
    seen.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))  # the recorder
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "probe_recorder", *args],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saw = {p.name: json.loads(p.read_text()) for p in seen.iterdir()}
    if saw.get("gpu", {}).get("here") == "":  # CUDA hidden: the gpu probe skips, saying why (-rs)
        assert "SKIPPED" in proc.stdout and "needs CUDA: `pytest -m gpu`" in proc.stdout, proc.stdout
    return saw


@pytest.mark.slow  # five pytest runs in subprocesses (about 22 s): a guard of conftest.py, in `-m slow`
def test_the_default_run_hides_cuda_and_a_gpu_run_does_not(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_probes.py").write_text(PROBES)
    (tmp_path / "probe_recorder.py").write_text(RECORDER)
    # the project's addopts (-m 'not slow', xdist workers) and markers
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -m 'not slow' -n 2\nmarkers =\n    slow: slow\n    gpu: gpu\n")
    hidden = {"here": "", "child": ""}
    visible = {"here": None, "child": "None"}

    assert _run(tmp_path) == {"plain": hidden, "gpu": hidden}          # the default run, in workers
    assert _run(tmp_path, "-n", "0") == {"plain": hidden, "gpu": hidden}  # in one process
    assert _run(tmp_path, "-m", "slow") == {"slow": hidden}
    assert _run(tmp_path, "-m", "gpu") == {"gpu": visible}             # gpu_check.py and mmv2_gpu.sh
    assert _run(tmp_path, "-o", "addopts=", "-m", "gpu") == {"gpu": visible}
    assert _run(tmp_path, "-o", "addopts=") == {"plain": hidden, "slow": hidden, "gpu": hidden}
