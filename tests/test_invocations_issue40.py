"""Malformed invocations of the chapter 2.2 and chapter 4 commands (issue #40): each is refused with exit
code 2 and one `error:` line on stderr naming the problem, no traceback, and nothing written under
--out (no run directory, no sweep directory).

The table holds the issue's unclean invocations (its --dry-run cases are tested with the plan) and a
case below and above the bound of every size-like flag. The fixtures are built here: a tiny saved
model, copies of it with a truncated, a corrupt or no weights file, a haystack folder of invalid
UTF-8, an MNIST folder with a truncated gzip file, a file where a folder belongs, and an unfinished
rich-features probe run. Every case stops in validation, so the table runs in-process, seconds each.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from conftest import SHARED_DATA, cli_in_process, run_owai, save_tiny_gpt2
from test_chapter4_training import corpus

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The inputs the cases name (module docstring)."""
    tmp = tmp_path_factory.mktemp("issue40")
    good = save_tiny_gpt2(tmp / "good", n_layer=1, n_embd=16)
    made = {"good": good}
    for name, spoil in (("truncated", lambda b: b[: len(b) // 2]), ("corrupt", lambda b: b"\xff" * 8 + b[8:])):
        shutil.copytree(good, tmp / name)
        weights = tmp / name / "model.safetensors"
        weights.write_bytes(spoil(weights.read_bytes()))
        made[name] = tmp / name
    shutil.copytree(good, tmp / "noweights")
    (tmp / "noweights" / "model.safetensors").unlink()
    made["noweights"] = tmp / "noweights"
    made["corpus"] = corpus(tmp / "corpus.jsonl")  # what the mosaic-train cases read besides the input they spoil
    made["badhay"] = tmp / "badhay"
    made["badhay"].mkdir()
    (made["badhay"] / "essay.txt").write_bytes(b"An essay \xff\xfe\x80 in no encoding at all. " * 200)
    made["afile"] = tmp / "a-file"
    made["afile"].write_text("not a folder\n")
    mnist = tmp / "badmnist" / "mnist"
    mnist.mkdir(parents=True)
    source = SHARED_DATA / "mnist"
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        if (source / f"{name}.gz").is_file():
            shutil.copy(source / f"{name}.gz", mnist)
        else:  # a stand-in: the case needs only one corrupt file; the others are never read
            (mnist / f"{name}.gz").write_bytes(b"")
    (mnist / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b\x08\x00" + b"\x00" * 500)  # a gzip header, then junk
    made["badmnist"] = tmp / "badmnist"
    made["probe_run"] = _probe_run(tmp / "runs")
    return made


def _probe_run(out: Path) -> Path:
    """An unfinished rich-features run of --stage probe (config.yaml written, nothing run)."""
    from owai.experiment import resolve
    from owai.recipes import load
    from owai.runs import Run

    _, resolved = resolve(load("table2.2-cat-probe"), None, ["stage=probe"], validate=False)
    return Run.create(out, "table2.2-cat-probe", resolved).path


RULER = ["eval", "ruler", "--tasks", "niah_single_1", "--ctx", "1k", "--n", "1"]
# the inputs a run reads besides the one a case spoils, generated (the real GPT-2 BPE, the State of the
# Union corpus): each case reaches its own check on a machine without the real data. niah_single_1 hides
# its needle in noise: it reads no essay haystack (--haystack-dir would be refused as unused)
RULER_INPUTS: list[str] = []
RULER_REFERENCE = [*RULER_INPUTS, "--set", "reference_tokenizer=bytes"]  # a reference model's prompts: fitted with bytes
TINY_INPUTS = ["--set", "data.source={corpus}"]
ICL = ["eval", "icl", "--task", "synthetic", "--shots", "1", "--n", "2"]
HARNESS = ["eval", "harness", "--tasks", "owai_mc_smoke", "--limit", "1"]
TINY = ["mosaic-train", "--size", "tiny"]

# (case id, argv with {name} placeholders for `inputs`, a fragment of the error line, environment)
CASES: list[tuple[str, list[str], str, dict[str, str]]] = [
    # parse errors: the CLI library's usage box becomes one line naming the option
    ("mosaic-context-not-a-number", ["mosaic-train", "--context", "3q"], "--context", {}),
    ("mosaic-unknown-flag", ["mosaic-train", "--nosuchflag"], "--nosuchflag", {}),
    ("rf-n-0", ["rich-features", "--stage", "probe", "--n", "0"], "--n", {}),
    ("rf-workers-0", ["rich-features", "--stage", "pretrain", "--workers", "0"], "--workers", {}),
    ("rf-executor-nope", ["rich-features", "--stage", "pretrain", "--executor", "nope"], "--executor", {}),
    ("ruler-n-0", ["eval", "ruler", "--n", "0"], "--n", {}),
    ("icl-n-0", ["eval", "icl", "--n", "0"], "--n", {}),
    ("harness-limit-negative", ["eval", "harness", "--limit", "-1"], "--limit", {}),
    ("harness-fewshot-not-a-number", ["eval", "harness", "--num-fewshot", "x"], "--num-fewshot", {}),
    ("data-verify-no-name", ["data", "verify"], "Missing argument 'name'", {}),
    ("data-fetch-no-name", ["data", "fetch"], "Missing argument 'name'", {}),
    ("recipes-show-set-no-value", ["recipes", "show", "table2.2-cat-probe", "--set"], "--set", {}),
    # corrupt, truncated or missing weights: one line naming the file, before any run directory
    ("ruler-truncated-weights", [*RULER, *RULER_INPUTS, "--model", "{truncated}"], "truncated/model.safetensors", {}),
    ("ruler-corrupt-weights", [*RULER, *RULER_INPUTS, "--model", "{corrupt}"], "corrupt/model.safetensors", {}),
    ("icl-truncated-weights", [*ICL, "--model", "{truncated}"], "truncated/model.safetensors", {}),
    ("icl-corrupt-weights", [*ICL, "--model", "{corrupt}"], "corrupt/model.safetensors", {}),
    ("harness-truncated-weights", [*HARNESS, "--model", "{truncated}"], "truncated/model.safetensors", {}),
    ("harness-corrupt-weights", [*HARNESS, "--model", "{corrupt}"], "corrupt/model.safetensors", {}),
    ("init-from-truncated", [*TINY, *TINY_INPUTS, "--set", "model.init_from={truncated}"], "truncated/model.safetensors", {}),
    ("init-from-corrupt", [*TINY, *TINY_INPUTS, "--set", "model.init_from={corrupt}"], "corrupt/model.safetensors", {}),
    ("ruler-no-weights", [*RULER, *RULER_INPUTS, "--model", "{noweights}"], "no weights", {}),
    ("icl-no-weights", [*ICL, "--model", "{noweights}"], "no weights", {}),
    ("harness-no-weights", [*HARNESS, "--model", "{noweights}"], "no weights", {}),
    ("init-from-no-weights", [*TINY, *TINY_INPUTS, "--set", "model.init_from={noweights}"], "no weights", {}),
    ("mosaic-eval-truncated-weights", ["mosaic-eval", "{truncated}", "--set", "eval.continuations=false"],
     "truncated/model.safetensors", {}),
    ("posloss-no-weights", ["eval", "posloss", "{noweights}"], "no weights", {}),
    # a file where a folder belongs
    ("cache-a-file-mosaic", ["mosaic-train"], "OWAI_CACHE", {"OWAI_CACHE": "{afile}"}),
    ("cache-a-file-rich-features", ["rich-features", "--stage", "pretrain"], "OWAI_CACHE", {"OWAI_CACHE": "{afile}"}),
    ("cache-a-file-ruler", [*RULER, "--model", "reference:oracle"], "OWAI_CACHE", {"OWAI_CACHE": "{afile}"}),
    ("cache-a-file-data-fetch", ["data", "fetch", "mnist"], "OWAI_CACHE", {"OWAI_CACHE": "{afile}"}),
    ("data-fetch-root-a-file", ["data", "fetch", "mnist", "--data-root", "{afile}"], "a-file", {}),
    # inputs checked before the sweep, not point by point
    ("rf-pretrain-corrupt-mnist", ["rich-features", "--stage", "pretrain", "--data-root", "{badmnist}"],
     "train-images-idx3-ubyte.gz", {}),
    # silently accepted before
    ("ruler-reference-tokenizer", [*RULER, *RULER_REFERENCE, "--model", "reference:oracle", "--tokenizer", "/nonexistent"], "--tokenizer", {}),
    ("icl-reference-tokenizer", [*ICL, "--model", "reference:knn", "--tokenizer", "/nonexistent"], "--tokenizer", {}),
    ("harness-reference-tokenizer", [*HARNESS, "--model", "reference:oracle", "--tokenizer", "/nonexistent"],
     "--tokenizer", {}),
    ("harness-model-tokenizer-missing", [*HARNESS, "--model", "{good}", "--tokenizer", "/nonexistent"], "/nonexistent", {}),
    ("ruler-haystack-not-utf8", ["eval", "ruler", "--tasks", "niah_single_2", "--ctx", "1k", "--n", "1",
                                 "--model", "reference:oracle", "--haystack-dir", "{badhay}", "--set", "reference_tokenizer=bytes"],
     "not UTF-8", {}),
    ("report-markdown-and-json", ["report", "{probe_run}", "--markdown", "--json"], "--markdown", {}),
    ("rf-resume-other-stage", ["rich-features", "--stage", "distill", "--resume", "{probe_run}"], "probe", {}),
    ("rf-resume-run-as-pretrain", ["rich-features", "--stage", "pretrain", "--resume", "{probe_run}"], "error", {}),
    # no bound on the context length
    ("ruler-ctx-10000000k", [*RULER[:-4], "--ctx", "10000000k", "--n", "1", "--model", "reference:oracle"], "1024k", {}),
    # misleading message
    ("lr-negative", ["mosaic-train", "--set", "train.lr=-1"], "train.lr must be > 0", {}),
]

# every size-like flag: below its least value (where that is not a parse error above) and above its largest
BOUNDS: list[tuple[str, list[str], str, dict[str, str]]] = [
    ("ruler-ctx-0", [*RULER[:-4], "--ctx", "0", "--n", "1", "--model", "reference:oracle"], "positive", {}),
    ("ruler-ctx-over", [*RULER[:-4], "--ctx", "1048577", "--n", "1", "--model", "reference:oracle"], "1024k", {}),
    ("ruler-set-ctx-over", [*RULER[:-4], "--set", "ctx=[2048k]", "--model", "reference:oracle"], "1024k", {}),
    ("ruler-n-over", ["eval", "ruler", "--n", "100001", "--model", "reference:oracle"], "100000", {}),
    ("ruler-set-n-over", ["eval", "ruler", "--set", "n=100001", "--model", "reference:oracle"], "100,000", {}),
    ("ruler-max-tokens-over", [*RULER, "--model", "reference:oracle", "--set", "max_tokens=1048577"], "1,048,576", {}),
    ("icl-n-over", ["eval", "icl", "--n", "100001"], "100000", {}),
    ("icl-set-n-over", ["eval", "icl", "--set", "n_queries=100001"], "100,000", {}),
    ("icl-shots-0", [*ICL[:-4], "--shots", "0"], "shot", {}),
    ("icl-shots-over", [*ICL[:-4], "--shots", "1,1025"], "1,024", {}),
    ("harness-limit-over", ["eval", "harness", "--limit", "1000001"], "1000000", {}),
    ("harness-set-limit-over", [*HARNESS[:-2], "--model", "reference:oracle", "--set", "limit=1000001"], "1,000,000", {}),
    ("harness-fewshot-over", ["eval", "harness", "--num-fewshot", "1025"], "1024", {}),
    ("harness-fewshot-negative", ["eval", "harness", "--num-fewshot", "-1"], "--num-fewshot", {}),
    ("mosaic-context-1", ["mosaic-train", "--context", "1"], "--context", {}),
    ("mosaic-context-over", ["mosaic-train", "--context", "1048577"], "1048576", {}),
    ("mosaic-set-context-over", ["mosaic-train", "--set", "data.block_size=1048577"], "1,048,576", {}),
    ("mosaic-depth-0", ["mosaic-train", "--depth", "0"], "--depth", {}),
    ("mosaic-depth-over", ["mosaic-train", "--depth", "1025"], "1024", {}),
    ("mosaic-set-depth-over", ["mosaic-train", "--set", "model.n_layer=1025"], "1,024", {}),
    ("mosaic-eval-context-over", ["mosaic-eval", "{good}", "--context", "1048577"], "1048576", {}),
    ("posloss-context-0", ["eval", "posloss", "{good}", "--context", "0"], "--context", {}),
    ("rf-n-over", ["rich-features", "--stage", "probe", "--n", "1025"], "1024", {}),
    ("rf-set-n-over", ["rich-features", "--stage", "probe", "--set", "probe.n=1025"], "1,024", {}),
    ("rf-workers-over", ["rich-features", "--stage", "pretrain", "--workers", "1025"], "1024", {}),
    ("regbench-train-size-over", ["eval", "regbench", "--train-size", "1000001"], "1,000,000", {}),
]


def _fill(text: str, inputs: dict[str, Path]) -> str:
    return text.format(**{k: str(v) for k, v in inputs.items()})


@pytest.mark.parametrize("case,argv,fragment,env", CASES + BOUNDS, ids=[c[0] for c in CASES + BOUNDS])
def test_each_malformed_invocation_is_one_line_and_writes_nothing(case: str, argv: list[str], fragment: str,
                                                                   env: dict[str, str], inputs: dict[str, Path],
                                                                   tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    if SHARED_DATA.is_dir():
        monkeypatch.setenv("OWAI_DATA", str(SHARED_DATA))
    for key, value in env.items():
        monkeypatch.setenv(key, _fill(value, inputs))
    out = tmp_path / "out"
    args = [_fill(a, inputs) for a in argv]
    if args[0] not in ("data", "report", "recipes"):  # the commands that write run directories
        args += ["--out", str(out)]
    before = sorted(inputs["probe_run"].parent.rglob("*"))
    code, stdout, stderr = cli_in_process(args, capsys)
    lines = stderr.strip().splitlines()
    assert code == 2, (code, stderr)
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in stderr + stdout and "internal error" not in stderr
    assert not out.exists(), sorted(out.rglob("*"))
    assert sorted(inputs["probe_run"].parent.rglob("*")) == before  # a refused resume writes nothing either


def test_parse_errors_go_through_the_console_script_too() -> None:
    """`python -m owai` (the console script's `main`): a usage error is one line, exit 2; --help,
    --version and no arguments print help, exit 0."""
    proc = run_owai("eval", "ruler", "--n", "0")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("error:") and "--n" in proc.stderr
    for args in ([], ["--help"], ["eval"], ["eval", "ruler", "--help"], ["--version"]):
        proc = run_owai(*args)
        assert proc.returncode == 0, (args, proc.stderr)
        assert proc.stdout.strip() and not proc.stderr.strip(), (args, proc.stderr)


def test_an_interrupted_command_exits_130(monkeypatch, capsys) -> None:
    import owai.commands.data as data

    real, calls = data.console.configure, []

    def interrupted(*args, **kwargs):  # Ctrl-C inside the command; main's restore of the mode runs normally
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(data.console, "configure", interrupted)
    code, _, stderr = cli_in_process(["data", "list"], capsys)
    assert code == 130 and len(stderr.strip().splitlines()) == 1, stderr


def test_an_internal_error_is_one_line_through_the_console_script(monkeypatch, capsys) -> None:
    """The last line of defence: an unexpected exception is one `internal error:` line, exit 1, no
    traceback (each `except` of `main` must resolve under the installed Typer for that)."""
    import owai.cli
    import owai.data.registry as registry

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(registry, "status", broken)  # what `owai data list` reads
    monkeypatch.delenv("OWAI_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_:
        owai.cli.main(["data", "list"])
    stderr = capsys.readouterr().err
    assert exit_.value.code == 1 and stderr.strip().splitlines() == [stderr.strip()], stderr
    assert stderr.startswith("internal error: RuntimeError: boom") and "Traceback" not in stderr


def test_saved_model_weights_are_readable_by_all(tmp_path: Path) -> None:
    """models/<arch>/model.safetensors is written 0644 (as the umask gives) like every other file of a run."""
    from types import SimpleNamespace

    from transformers import GPT2Config, GPT2LMHeadModel

    from owai.data.text import load_tokenizer
    from owai.methods.language_model import save_model

    model = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=16, n_embd=8, n_layer=1, n_head=2))
    run = SimpleNamespace(path=tmp_path)
    parallel = SimpleNamespace(module=model, sharded=False, strategy="none")
    old = os.umask(0o022)
    try:
        target = save_model(run, "gpt", parallel, SimpleNamespace(tokenizer=load_tokenizer("bytes")))
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in target.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
