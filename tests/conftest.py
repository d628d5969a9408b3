"""Shared test helpers: a tiny three-moons config, `--set` lists, the CLI's own parse of a command
line (`parse_owai`), and CLI runners (in a subprocess,
in this process with pytest's captured output, or as a torchrun job). Also which runs see CUDA: only `-m gpu` (cuda_hidden)."""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest

# The tests' own cache: never the user's ~/.cache/owai (a stale tokenizer or token cache there would
# hide what a fresh machine does), one per test process, removed at exit. Tests that need a
# particular cache (`no_data`, the chains) point OWAI_CACHE elsewhere themselves.
_TEST_CACHE = tempfile.mkdtemp(prefix="owai-test-cache-")
atexit.register(shutil.rmtree, _TEST_CACHE, ignore_errors=True)
os.environ["OWAI_CACHE"] = _TEST_CACHE

# Off a terminal, as CI runs: no inherited terminal size (pytest-xdist's workers set COLUMNS=80 and
# LINES=24, which owai's console honours and would wrap its tables and long paths at 80 columns).
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)

# Under pytest-xdist (`-n N`, as pyproject's addopts ask) the workers share the cores: each process,
# and every `owai` subprocess it starts, gets cores / N intra-op threads instead of all of them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))

import torch  # noqa: E402  (after OMP_NUM_THREADS; importing torch does not look for CUDA yet)


def cuda_hidden(markexpr: str) -> bool:
    """Whether a run with this `-m` expression hides CUDA from its tests: every run that selects a test
    not marked `gpu` (the default run, `-m slow`, none), so that on a GPU machine they run as on the
    CPU machines where their expected values were taken, and an `owai` they start picks the CPU.
    `-m gpu` alone sees the GPU."""
    if not markexpr.strip():
        return True
    try:
        from _pytest.mark.expression import Expression  # pytest's own -m parser (not public API)

        selects = Expression.compile(markexpr).evaluate
        return any(selects(lambda name, *_, marks=marks, **__: name in marks) for marks in ((), ("slow",)))
    except Exception:  # the parser moved: by the words
        return "gpu" not in markexpr.replace("(", " ").replace(")", " ").split()


def pytest_configure(config: pytest.Config) -> None:
    """Hide CUDA as `cuda_hidden` says, before anything asks for it (xdist's workers and the `owai`
    processes the tests start inherit the environment). Then Triton kernels (v2's scan_impl triton)
    run on CPU tensors in Triton's interpreter, which must be chosen before triton is first imported
    (torch._dynamo imports it)."""
    if cuda_hidden(config.option.markexpr or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked `gpu` skips where the run has no CUDA, missing or hidden (cuda_hidden)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: `pytest -m gpu` runs the gpu tests with the GPU visible "
                                   "(other runs hide it: tests/conftest.py)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)

# The real data: $OWAI_DATA when it is set (as .ci/run does), else the shared/data beside the
# repository (CI clones the repo with shared/ next to it), which the tests then name in $OWAI_DATA.
# owai itself never looks there. Tests that need real data skip with a reason when it is absent.
SHARED_DATA = (Path(os.environ["OWAI_DATA"]) if os.environ.get("OWAI_DATA")
               else Path(__file__).resolve().parents[1].parent / "shared" / "data")
if SHARED_DATA.is_dir():
    os.environ.setdefault("OWAI_DATA", str(SHARED_DATA))
DATA_VARIABLES = ("OWAI_DATA", "OWAI_MNIST_DIR", "OWAI_BABISTORIES", "OWAI_MNIST_MIRROR")

# Three moons shrunk to seconds; still the full code path (train loop, checkpoints, eval, figures).
TINY_MOONS = [
    "train.steps=6",
    "train.batch_size=2",
    "train.checkpoint_every=2",
    "train.selection_sequences=2",
    "data.block_size=60",
    "eval.n_sequences=2",
    "eval.n_gen=3",
    "eval.tau_stride=10",
    "model.heads=[3]",
]


def run_owai(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real `owai` entry point in a subprocess (what a user runs)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OWAI_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "owai", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env
    )


NATIVE_CRASHES = (6, 7, 11)  # SIGABRT, SIGBUS, SIGSEGV


def torchrun(
    nproc: int, args: list[str], *, before_retry: Callable[[], None] | None = None, cwd: Path | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc_per_node=NPROC ARGS`: gloo ranks of one
    thread each, with Python's fault handler on (a native crash prints every thread's Python stack).

    A job whose rank crashed natively (SIGABRT, SIGBUS, SIGSEGV) runs once more, after `before_retry`
    has removed what the first attempt wrote, and the test gets a warning with the first attempt's
    output. Such a crash was a native abort inside gloo: one CI run in about seventy had one, and none
    of 240 local jobs did (docs/decisions.md). A rank's Python error, another signal (SIGKILL from
    the out-of-memory killer), a wrong result or a second crash is never retried: they fail the test."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env.pop("OWAI_DEBUG", None)
    # torchrun's own log folder, which it would otherwise leave behind as a `torchelastic_*` folder in
    # the system's temporary directory on every launch.
    with tempfile.TemporaryDirectory(prefix="owai-torchrun-") as logs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               f"--log-dir={logs}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
        signal = rank_signal(proc)
        if signal not in NATIVE_CRASHES or before_retry is None:
            return proc
        warnings.warn(f"torchrun: a rank died of signal {signal}; running the job once more. Its output:\n"
                      f"{proc.stderr[-6000:]}", stacklevel=2)
        before_retry()
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def rank_signal(proc: subprocess.CompletedProcess) -> int | None:
    """The signal that killed the first failed rank of a torchrun job (torchrun's "Root Cause"
    report, e.g. `exitcode  : -6 (pid: 123)` for SIGABRT), or None (success, or a rank that exited
    with an error code of its own)."""
    if proc.returncode == 0:
        return None
    found = re.search(r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*(-?\d+)", proc.stderr, re.S)
    return -int(found.group(1)) if found and int(found.group(1)) < 0 else None


def as_if_killed(run: Path, *lost: Path) -> None:
    """Leave a finished run directory as a kill would have: the `lost` checkpoint / model folders
    gone, no results.json, status "running" (what `--resume` picks up)."""
    for path in lost:
        shutil.rmtree(path)
    (run / "results.json").unlink()
    (run / "status.json").write_text(json.dumps({"status": "running"}))


def as_sets(settings: list[str]) -> list[str]:
    """["a=1", "b=2"] -> ["--set", "a=1", "--set", "b=2"]."""
    return [arg for s in settings for arg in ("--set", s)]


@functools.lru_cache(maxsize=None)
def owai_command() -> object:
    """The `owai` command as the CLI's Click parser sees it (built once: building it takes a while)."""
    import typer

    from owai.cli import app

    return typer.main.get_command(app)


def parse_owai(words: list[str]) -> tuple[object, dict]:
    """Parse `owai WORDS` with the CLI's own parser, as running it would, down to the subcommand they
    name: (that command, its parsed parameters); nothing runs. An unknown command or option, a missing
    required option or argument or a bad value raises the CLI's UsageError. A bare group (`owai eval`)
    is not an error: running it prints its help.

    A group is told by its subcommands (`resolve_command`), not by class: Typer >= 0.26 parses with its
    own copy of Click, whose groups are no `click.Group` (an isinstance test never descends)."""
    cmd = owai_command()
    if not words:
        return cmd, {}
    ctx = cmd.make_context("owai", list(words))
    while hasattr(cmd, "resolve_command"):
        protected = getattr(ctx, "_protected_args", None)  # Click >= 8.2 (and Typer's copy); older: protected_args
        args = [*(protected if protected is not None else getattr(ctx, "protected_args", [])), *ctx.args]
        if not args:
            break
        name, sub, args = cmd.resolve_command(ctx, args)
        assert sub is not None, f"owai {' '.join(words)}: no command {name!r}"
        if not args and getattr(sub, "no_args_is_help", False):
            return sub, {}
        ctx = sub.make_context(name, list(args), parent=ctx)
        cmd = sub
    return cmd, ctx.params


class Undecodable(torch.utils.data.Dataset):
    """A dataset whose items fail in a loader's worker: item 1 as a corrupt image does (owai's own
    error, naming the file), item 0 with a plain ValueError."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int):
        from owai.errors import OwaiError

        if i == 1:
            raise OwaiError("cannot decode image sketch/dog/dog_0.png: broken data stream\n  see docs: here")
        raise ValueError("bad value")


def cli_in_process(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run `owai ARGS` in this process: (exit code, stdout, stderr). `main` puts back the output mode
    after it (a command's --quiet would otherwise silence the libraries for the rest of the process)."""
    from owai.cli import main

    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def tiny_moons() -> list[str]:
    return list(TINY_MOONS)


@pytest.fixture
def no_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A clean machine: no data variable set and an empty cache (returned)."""
    for name in DATA_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    cache = tmp_path / "empty-cache"
    monkeypatch.setenv("OWAI_CACHE", str(cache))
    return cache


@pytest.fixture
def behind_a_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that reaches the internet only through HTTPS_PROXY (nothing bypassed): a direct TCP
    connection (`owai.hub._connect`, behind the hub's and the download hosts' probes) fails the test."""
    def connect(host: str, port: int) -> str:
        raise AssertionError("no direct connection behind a proxy")

    monkeypatch.setattr("owai.hub._connect", connect)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)


@pytest.fixture
def shared_data(monkeypatch: pytest.MonkeyPatch) -> Path:
    """$OWAI_DATA pointed at ../shared/data (skips where it is absent)."""
    if not (SHARED_DATA / "mnist").is_dir():
        pytest.skip(f"real data not present ($OWAI_DATA or ../shared/data: {SHARED_DATA})")
    monkeypatch.setenv("OWAI_DATA", str(SHARED_DATA))
    return SHARED_DATA


@pytest.fixture
def default_float64() -> Any:
    """torch's default dtype float64 for the test (the official code's parity runs)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(default)


@pytest.fixture
def float64(monkeypatch: pytest.MonkeyPatch, default_float64: None) -> None:
    """ColoredMNIST's environments in float64 too: owai's and RFC's runs in float64. In float32, Adam
    turns summation-order rounding in near-zero gradients into differences of up to 1e-4 after 30 steps
    (measured): a bound that loose would let real differences through."""
    import owai.methods.coloredmnist as owai_cmnist

    load = owai_cmnist.load_data

    def load_float64(*args, **kwargs):
        data = load(*args, **kwargs)
        for env in data.train + data.test:
            env.x, env.y = env.x.double(), env.y.double()
        return data

    monkeypatch.setattr(owai_cmnist, "load_data", load_float64)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is as fast, and spinning threads crawl on a shared CPU."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def draw_weights(model: Any, std: float, vector_value: Callable[[str], float]) -> None:
    """A suite model's weights drawn by the test itself, from one seeded generator in the
    architecture's parameter order: normal(0, std) for every matrix (embeddings, projections), each
    vector (norm weights, biases) filled with `vector_value(name)`. transformers' own initialisation
    changed between releases (5.4-5.14 drew a GPT-2 whose greedy bytes are not UTF-8), and a suite's
    model must be the same under every release pyproject allows."""
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, std, generator=generator)
            else:
                param.fill_(vector_value(name))


def save_char_llama(path: Path) -> Path:
    """A random Llama (max_position_embeddings 64) with a character tokenizer whose BOS `<s>` (1) and
    EOS `</s>` (2) differ and that adds the BOS as Llama's tokenizers do, saved with save_pretrained:
    the harness adapter's stand-in for a hub Llama."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {chr(i): i - 29 for i in range(32, 127)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="</s>").save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, initializer_range=0.2)
    model = LlamaForCausalLM(config)
    draw_weights(model, config.initializer_range, lambda name: 1.0)  # RMSNorm weights at 1 (Llama has no biases)
    model.save_pretrained(path)
    return path


def save_tiny_gpt2(path: Path, *, vocab: int = 257, positions: int = 1024, n_embd: int = 32, n_layer: int = 2) -> Path:
    """A random GPT-2 over owai's byte tokenizer (vocab 257, end-of-text 256) saved with save_pretrained,
    recording its tokenizer (owai_tokenizer.json) as mosaic-train's model directories do: the chapter-4
    suites' stand-in for a trained causal LM."""
    import json

    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=n_embd, n_layer=n_layer, n_head=2,
                        bos_token_id=256, eos_token_id=256)
    model = GPT2LMHeadModel(config)
    # GPT-2's scheme: LayerNorms start at the identity, biases at 0
    draw_weights(model, 0.02, lambda name: 1.0 if name.split(".")[-2].startswith("ln") and name.endswith("weight") else 0.0)
    model.save_pretrained(path)
    (path / "owai_tokenizer.json").write_text(json.dumps({"name": "bytes"}))
    return path
