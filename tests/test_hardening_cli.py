"""Malformed invocations a new user types (issue #26): each fails before anything is written, with
one `error:` line on stderr, exit code 2, no traceback, and no directory left under --out.

Every case stops in validation (no training starts), so the table runs in-process and cheaply.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY_MOONS, as_sets, cli_in_process
from domainbed_tree import make_tree

PACS_DOMAINS = ("art_painting", "cartoon", "photo", "sketch")


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Generated inputs: image trees (clean, corrupt, zero-byte, truncated, mismatched classes), a
    DomainBed PACS tree, bad weights files and bad corpora."""
    tmp = tmp_path_factory.mktemp("inputs")
    tree = dict(per_class=2, size=12)
    made = {
        "clean": make_tree(tmp / "clean", **tree),
        "corrupt": make_tree(tmp / "corrupt", corrupt=1, **tree),
        "zero": make_tree(tmp / "zero", **tree),
        "truncated": make_tree(tmp / "truncated", **tree),
        "mismatched": make_tree(tmp / "mismatched", **tree),
        "pacs": tmp / "pacs",
    }
    make_tree(tmp / "pacs" / "PACS", domains=PACS_DOMAINS, **tree)
    (made["zero"] / "d1" / "a" / "img000.png").write_bytes(b"")
    _truncate(made["truncated"] / "d2" / "b" / "img001.jpg")
    shutil.move(made["mismatched"] / "d2" / "b", made["mismatched"] / "d2" / "c")
    made["random_pth"] = tmp / "random.pth"
    made["random_pth"].write_bytes(b"\x80\x02not a checkpoint" * 50)
    made["pickled_pth"] = tmp / "pickled.pth"
    torch.save({"loader": print}, made["pickled_pth"])  # a pickle holding a Python global, not only tensors
    made["empty_txt"] = tmp / "empty.txt"
    made["empty_txt"].write_text("")
    made["blank_txt"] = tmp / "blank.txt"
    made["blank_txt"].write_text("  \n\n\t\n")
    return made


TINY_DFT = ["--set", "data.image_size=16", "--set", "model.backbone=resnet18"]

# (case id, argv with {name} placeholders for `inputs`, a fragment of the error line)
CASES = [
    ("dft-test-domain-99", ["dropout-ft", "--test-domain", "99", "-p", "tiny"], "data.test_domain 99"),  # tiny: packaged data
    ("dft-pacs-test-domain-7", ["dropout-ft", "--dataset", "pacs", "--root", "{pacs}", "--test-domain", "7"], "pacs has 4 domains"),
    ("dft-corrupt-image", ["dropout-ft", "--dataset", "imagefolder", "--root", "{corrupt}"], "unreadable image"),
    ("dft-zero-byte-image", ["dropout-ft", "--dataset", "imagefolder", "--root", "{zero}"], "unreadable image"),
    ("dft-truncated-image", ["dropout-ft", "--dataset", "imagefolder", "--root", "{truncated}"], "img001.jpg"),
    ("dft-mismatched-classes", ["dropout-ft", "--dataset", "imagefolder", "--root", "{mismatched}"], "different class folders"),
    ("dft-missing-root", ["dropout-ft", "--dataset", "imagefolder", "--root", "{clean}/nowhere"], "nowhere"),
    ("dft-corrupt-weights", ["dropout-ft", "--weights", "{random_pth}", *TINY_DFT], "cannot read weights file"),
    ("dft-pickled-weights", ["dropout-ft", "--weights", "{pickled_pth}", *TINY_DFT], "tensors only"),
    ("dft-missing-weights", ["dropout-ft", "--weights", "{clean}/none.pth", *TINY_DFT], "no such file"),
    ("dft-pretrain-with-set-dataset", ["dropout-ft", "--set", "data.dataset=pacs", "--set", "data.root={pacs}"],
     "--set pretrain.steps=0"),
    ("dft-seeds-empty", ["dropout-ft", "--seeds", ""], "--seeds ''"),
    ("dft-huge-batch", ["dropout-ft", "--set", "data.batch_per_domain=100000000000"], "GiB"),
    ("lm-empty-corpus", ["mosaic-train", "--dataset", "{empty_txt}"], "no text"),
    ("lm-blank-corpus", ["mosaic-train", "--dataset", "{blank_txt}"], "no text"),
    ("lm-bpe-0", ["mosaic-train", "--tokenizer", "bpe-0"], "bpe-0"),
    ("lm-huge-context", ["mosaic-train", "--context", "100000000"], "--context"),
    ("lm-huge-context-set", ["mosaic-train", "--set", "data.block_size=100000000"], "data.block_size"),
    ("lm-unknown-tokenizer-offline", ["mosaic-train", "--tokenizer", "nobody-owai/no-such-tokenizer"], "HF_HUB_OFFLINE"),
    ("moons-huge-batch-int", ["moons", "--set", "train.batch_size=10000000000"], "train.batch_size"),
    ("moons-huge-batch-float", ["moons", "--set", "train.batch_size=1e10"], "train.batch_size"),
    ("moons-recipe-of-other-method", ["moons", "--recipe", "fig3.8-depth"], "not three_moons"),
    ("moons-recipe-and-study-disagree", ["moons", "linear", "--recipe", "three-moons"], "disagree"),
    ("sweep-seeds-empty", ["sweep", "three-moons", "--seeds", ""], "--seeds ''"),
    ("sweep-recipe-disagree", ["sweep", "three-moons", "--recipe", "linear-disentanglement"], "disagree"),
    ("bonsai-seeds-empty", ["bonsai", "--study", "--seeds", ""], "--seeds ''"),
    ("bonsai-seeds-empty-no-study", ["bonsai", "--seeds", ""], "need --study"),
    ("regbench-seeds-empty", ["eval", "regbench", "--seeds", ""], "--seeds ''"),
    ("mosaic-eval-no-models", ["mosaic-eval"], "--resume RUN_DIR"),
    ("mosaic-eval-models-and-resume", ["mosaic-eval", "{clean}", "--resume", "{clean}"], "drop MODEL_DIR"),
    ("posloss-resume-not-a-run", ["eval", "posloss", "--resume", "{clean}"], "error"),
    ("recipes-run-no-recipe", ["recipes", "run"], "name a RECIPE"),
]


@pytest.mark.parametrize("case,argv,fragment", CASES, ids=[c[0] for c in CASES])
def test_malformed_invocation_fails_cleanly(case: str, argv: list[str], fragment: str, inputs: dict[str, Path],
                                            tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    args = [a.format(**{k: str(v) for k, v in inputs.items()}) for a in argv] + ["--out", str(out)]
    code, stdout, stderr = cli_in_process(args, capsys)
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in stderr + stdout and "weights_only=False" not in stderr
    assert not out.exists(), sorted(out.rglob("*"))


def test_unknown_tokenizer_fails_fast_when_the_hub_is_unreachable(tmp_path: Path, capsys, monkeypatch) -> None:
    """No offline flag, and the hub endpoint refuses connections: one line within seconds, not a
    minute of retries."""
    from owai import hub

    for name in (*hub.OFFLINE_VARIABLES, "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    # an earlier test of this worker may have imported huggingface_hub under HF_HUB_OFFLINE=1, which
    # it reads once at import (the cause of this test's failures in some test distributions)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    start = time.monotonic()
    code, _, stderr = cli_in_process(["mosaic-train", "--tokenizer", "nobody-owai/no-such-tokenizer",
                                      "--out", str(tmp_path / "out")], capsys)
    assert time.monotonic() - start < 30  # retries take a minute; generous for a loaded machine
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and "unreachable" in stderr, stderr
    assert not (tmp_path / "out").exists()


def test_dropout_ft_on_own_data_switches_the_offline_pretraining_off(inputs, tmp_path, capsys, monkeypatch) -> None:
    """Item 4: `--dataset pacs --root DIR` (and `--weights FILE`) with the default preset plans a
    study with pretrain.steps=0 instead of failing on the preset's rotated-mnist pre-training."""
    import owai.commands.dropout_ft as command

    plans = []
    monkeypatch.setattr(command, "run_study", lambda plan, *args: plans.append(plan))
    code, _, stderr = cli_in_process(["dropout-ft", "--dataset", "pacs", "--root", str(inputs["pacs"]),
                                      "--out", str(tmp_path / "out"), "-q"], capsys)
    assert code == 0, stderr
    points = plans[0].points
    assert points and all(p.grid["data.dataset"] == "pacs" for p in points)
    assert "pretrain.steps=0" in plans[0].sets and all("pretrain.steps=0" in p.overrides for p in points)

    weights = tmp_path / "r18.safetensors"
    from safetensors.torch import save_file

    from owai.models.vision import build_backbone

    save_file(build_backbone("resnet18", num_classes=1000).state_dict(), str(weights))
    code, _, stderr = cli_in_process(["dropout-ft", "--weights", str(weights), "--out", str(tmp_path / "out2"), "-q"], capsys)
    assert code == 0, stderr
    assert "pretrain.steps=0" in plans[1].sets


def test_an_unreadable_image_can_be_skipped_on_request(inputs) -> None:
    from owai.data.domainbed import open_image_dataset

    assert open_image_dataset("imagefolder", inputs["truncated"], skip_unreadable=True).skipped == 1


def test_boolean_flags_show_no_type_in_help(capsys) -> None:
    for command in (["moons"], ["dropout-ft"], ["sweep"], ["eval", "posloss"]):
        code, stdout, _ = cli_in_process([*command, "--help"], capsys)
        assert code == 0 and "--quiet" in stdout and "--json" in stdout
        assert "<bool>" not in stdout, command


def test_every_command_has_quiet_and_json() -> None:
    import typer.main

    from owai.cli import app

    def leaves(command, path):
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                yield from leaves(sub, [*path, name])
        else:
            yield " ".join(path), command

    found = dict(leaves(typer.main.get_command(app), []))
    assert {"moons", "sweep", "report", "recipes run", "eval posloss"} <= set(found)
    for name, command in found.items():
        options = {o for p in command.params for o in getattr(p, "opts", [])}
        assert {"--quiet", "--json"} <= options, name


def test_command_lists_print_each_summary_on_one_row(capsys, monkeypatch) -> None:
    """In rich markup mode Typer kept a docstring's source line breaks in a group's command list, so
    `owai --help` printed wrapped summaries as ragged rows (report, sweep, mosaic-train, ...)."""
    import inspect

    import typer.main

    from owai.cli import app

    monkeypatch.setenv("COLUMNS", "400")  # wide enough that no summary wraps
    root = typer.main.get_command(app)
    for path in ([], ["eval"], ["recipes"], ["data"]):
        group = root
        for name in path:
            group = group.commands[name]
        code, stdout, _ = cli_in_process([*path, "--help"], capsys)
        assert code == 0
        for name, command in group.commands.items():
            summary = " ".join(inspect.cleandoc(command.short_help or command.help or "").split("\n\n")[0].split())
            assert summary, (path, name)
            rows = [line for line in stdout.splitlines() if f" {name} " in line]
            assert any(summary in row for row in rows), (path, name, summary)


@pytest.mark.parametrize("width", [100, 300])
def test_recipes_list_never_cuts_an_id_or_a_command_word(width, capsys, monkeypatch) -> None:
    """`owai recipes list` on a 100-column terminal printed ids and commands cut short with "…"
    (fig2.10-dropout…, linear-disentan…): the two cells a user copies."""
    import json

    from owai import console

    code, stdout, _ = cli_in_process(["recipes", "list", "--json"], capsys)
    assert code == 0
    rows = json.loads(stdout)
    monkeypatch.setenv("COLUMNS", str(width))
    monkeypatch.setattr(console.stdout, "width", width)
    code, stdout, _ = cli_in_process(["recipes", "list"], capsys)
    assert code == 0 and "…" not in stdout
    lines = stdout.splitlines()
    assert max(len(line) for line in lines) <= width
    cells = [cell.strip() for line in lines for cell in line.split("│")]
    for row in rows:
        assert row["id"] in cells, row["id"]
        for word in row["command"].split():
            assert any(word in cell.split() for cell in cells), (row["id"], word)
        if width == 300:
            assert row["command"] in cells, row["command"]


@pytest.mark.parametrize("width", [60, 100, 300])
def test_report_tables_keep_metric_names_whole(width, capsys, monkeypatch) -> None:
    """The measured-vs-thesis table cut long metric names with "…" on a 100-column terminal
    (heads1.train.accurate_from_over_l…); a name is what claims, --grid and select refer to."""
    from owai import console
    from owai.report import table

    metrics = [f"heads{h}.{panel}.accurate_from_over_lcm_{i}" for h in (1, 3) for panel in ("train", "val") for i in range(3)]
    claim = "sharp transition after lcm(p1,p2,p3) observations of the held-out period set, as the figure shows"
    results = {"recipe": "three-moons", "reproduces": "Figure 3.5 (sec 3.3)", "preset": "cpu",
               "rows": [{"metric": m, "measured": 3.06, "thesis": 222.2, "thesis_claim": claim, "ref": "Figure 3.5"}
                        for m in metrics]}
    monkeypatch.setattr(console.stdout, "width", width)
    console.stdout.print(table(results))
    lines = capsys.readouterr().out.splitlines()
    assert "…" not in "\n".join(lines) and max(len(line) for line in lines) <= width
    cells = [cell.strip() for line in lines for cell in line.split("│")]
    if width >= 100:  # room for the longest name beside the other columns
        assert all(m in cells for m in metrics)
    else:  # too narrow for that: folded, never cut
        names = "".join(line.split("│")[1].strip() for line in lines if line.startswith("│"))
        assert names == "".join(metrics)


def test_every_run_command_has_quiet_recipe_and_resume(capsys) -> None:
    for command in (["moons"], ["mosaic-train"], ["dropout-ft"], ["bonsai"], ["sweep"], ["eval", "regbench"],
                    ["recipes", "run"]):
        _, stdout, _ = cli_in_process([*command, "--help"], capsys)
        for option in ("--quiet", "--recipe", "--resume"):
            assert option in stdout, (command, option)
    for command in (["mosaic-eval"], ["eval", "posloss"]):
        _, stdout, _ = cli_in_process([*command, "--help"], capsys)
        assert "--quiet" in stdout and "--resume" in stdout, command


def test_moons_recipe_option_runs_the_named_study(tmp_path, capsys) -> None:
    code, stdout, stderr = cli_in_process(["moons", "--recipe", "three-moons", *as_sets(TINY_MOONS),
                                           "--out", str(tmp_path), "--json"], capsys)
    assert code == 0, stderr
    assert '"recipe": "three-moons"' in stdout


def test_recipe_file_may_be_named_other_than_its_id(tmp_path) -> None:
    from owai import recipes

    mine = tmp_path / "my-study.yaml"
    mine.write_text((recipes.recipe_dir() / "three-moons.yaml").read_text())
    assert recipes.load(str(mine)).id == "three-moons"


def test_tables_are_not_cut_at_80_columns_off_a_terminal(capsys) -> None:
    from rich.table import Table

    from owai import console

    console.configure()
    table = Table()
    for i in range(6):
        table.add_column(f"column-{i}")
    table.add_row(*[f"value-{i}-" + "x" * 20 for i in range(6)])
    console.stdout.print(table)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "value-0" in line)
    assert "value-5-" + "x" * 20 in row and len(row) > 80


@pytest.mark.parametrize("quiet,as_json,expect_lines", [(False, False, True), (True, False, False), (False, True, True)])
def test_progress_lines_off_a_terminal(quiet, as_json, expect_lines, capsys, monkeypatch) -> None:
    from owai import console

    monkeypatch.setenv("OWAI_PROGRESS_SECONDS", "0")
    console.configure(quiet, as_json)
    try:
        with console.Bar("train mm", total=3) as bar:
            for _ in range(3):
                bar.update(status="loss 1.5")
    finally:
        console.configure()
    out, err = capsys.readouterr()
    assert out == ""  # progress never goes to stdout (under --json it holds the one JSON document)
    lines = err.strip().splitlines()
    if expect_lines:
        assert lines[0].startswith("train mm: 1/3 (33%), loss 1.5, elapsed 0:00:0")
        assert lines[-1].startswith("train mm: 3/3 (100%)")
    else:
        assert lines == []


def test_size_check_names_the_sizes_and_the_memory() -> None:
    from owai.config import check_sizes
    from owai.errors import OwaiError
    from owai.methods.language_model import Config

    cfg = Config()
    check_sizes(cfg, limit=1 << 34)  # the thesis's GPT2-small settings fit in 16 GiB
    with pytest.raises(OwaiError, match=r"train.batch_size=8, data.block_size=512, model.n_embd=768 need at least .* GiB"):
        check_sizes(cfg, limit=1 << 20)


def test_weights_error_never_suggests_unsafe_loading(inputs) -> None:
    from owai.errors import OwaiError
    from owai.models.vision import check_weights

    for name in ("pickled_pth", "random_pth"):
        with pytest.raises(OwaiError) as err:
            check_weights("resnet18", str(inputs[name]))
        assert "weights_only" not in str(err.value) and len(str(err.value).splitlines()) == 1
