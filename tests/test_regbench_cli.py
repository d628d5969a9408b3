"""`owai eval regbench`: the grid search as a sweep, selection by validation loss, the report and
figure, resume, the paper preset's full grid, and one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from owai import sweep as sweeps
from owai.cli import main
from owai.runs import Run
from conftest import as_sets
from conftest import cli_in_process as cli

TINY = [
    "data.num_test_examples=16", "data.max_len_per_example=8", "data.min_num_in_context_examples=4",
    "data.max_num_in_context_examples=7", "train.epochs=3", "train.batch_size=8", "eval.batch_size=8",
]


def sets(*extra: str) -> list[str]:
    return as_sets([*TINY, *extra])



@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mm and the n-gram at 2 training sizes; the mm cell searches 2 learning rates."""
    out = tmp_path_factory.mktemp("regbench")
    args = ["eval", "regbench", "--model", "mm,ngram", "--train-size", "16,24", *sets(),
            "--grid", "model.n_embd=16", "--grid", "train.lr=3e-3,1e-2", "--out", str(out), "-q"]
    try:
        main(args)
    except SystemExit as e:
        assert not e.code, e
    (path,) = sorted((out / "fig3.10-regbench").glob("sweep-*"))
    return path


def test_study_selects_the_lowest_validation_loss_per_model_and_size(study: Path):
    plan = sweeps.open_sweep(study)
    # mm: 2 sizes x 2 lr; ngram: 2 sizes
    assert len(plan.points) == 6 and {p.grid["arch"] for p in plan.points} == {"mm", "ngram"}
    report = json.loads((study / "regbench.json").read_text())
    rows = {(r["arch"], r["num_examples"]): r for r in report["rows"]}
    assert set(rows) == {("mm", 16), ("mm", 24), ("ngram", 16), ("ngram", 24)}
    for size in (16, 24):
        cells = {}
        for p in plan.points:
            if p.grid["arch"] == "mm" and p.grid["data.num_examples"] == size:
                m = {r["metric"]: r["measured"] for r in Run(plan.point_dir(p)).results()["rows"]}
                cells[p.grid["train.lr"]] = m
        best_lr = min(cells, key=lambda lr: cells[lr]["val_loss"])
        row = rows[("mm", size)]
        assert row["val_loss"] == pytest.approx(cells[best_lr]["val_loss"])
        assert row["accuracy"] == pytest.approx(cells[best_lr]["accuracy"]) and f"lr={best_lr}" in row["selected"]
        assert row["tvd_half"] == pytest.approx(row["tvd"] / 2) and row["candidates"] == 2
    assert (study / "figures" / "regbench.png").stat().st_size > 10_000
    md = (study / "regbench.md").read_text()
    assert "| Memory Mosaic | 16 |" in md and "3-gram" in md


def test_resume_skips_finished_points(study: Path, capsys: pytest.CaptureFixture[str]):
    before = (study / "regbench.json").read_text()
    mtimes = {p: p.stat().st_mtime for p in study.glob("points/*/results.json")}
    code, out, err = cli(["eval", "regbench", "--resume", str(study), "--json"], capsys)
    assert code == 0, err
    assert {p: p.stat().st_mtime for p in study.glob("points/*/results.json")} == mtimes
    assert json.loads(out)["rows"] == json.loads(before)["rows"]


def test_paper_preset_is_the_thesis_grid_at_every_size():
    points = sweeps.plan("fig3.10-regbench", "paper")
    sizes = {100, 500, 1000, 2500, 40000}
    by_arch: dict[str, list] = {}
    for p in points:
        by_arch.setdefault(p.grid["arch"], []).append(p)
    for arch in ("mm", "transformer"):
        cells = by_arch[arch]
        assert len(cells) == 3 * 3 * 3 * 2 * len(sizes)  # depth x heads x dim x wd, per size
        assert {p.grid["model.n_layer"] for p in cells} == {2, 4, 8}
        assert {p.grid["model.n_head"] for p in cells} == {2, 4, 8}
        assert {p.grid["model.n_embd"] for p in cells} == {64, 128, 256}
        assert {p.grid["train.weight_decay"] for p in cells} == {0.01, 0.1}
        assert {p.grid["data.num_examples"] for p in cells} == sizes
    assert {p.grid["data.num_examples"] for p in by_arch["ngram"]} == sizes


def test_cpu_preset_covers_mm_transformer_and_ngram_at_100_and_500():
    points = sweeps.plan("fig3.10-regbench", "cpu")
    assert {(p.grid["arch"], p.grid["data.num_examples"]) for p in points} == {
        (a, n) for a in ("mm", "transformer", "ngram") for n in (100, 500)}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--train-size", "0"], "--train-size 0: the number of training automata must be between 1 and 1,000,000"),
        (["--train-size", "ten"], "--train-size 'ten'"),
        (["--model", "lstm", "--grid", "model.n_head=2,4"], "the lstm model has no setting 'n_head'"),
        (["--grid", "model.n_experts=2,4"], "unknown key 'n_experts'"),
        (["--positions", "first"], "--positions 'first': choose one of all, last-string"),
        (["--model", "rnn"], "unknown RegBench model 'rnn'"),
        (["--recipe", "three-moons"], "not regbench"),
    ],
)
def test_bad_input_is_a_one_line_error(args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    code, out, err = cli(["eval", "regbench", *args, "--out", str(tmp_path)], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_model_and_size_options_restrict_the_recipe_grid():
    from owai.commands.eval import regbench_grid
    from owai.recipes import load

    grids = load("fig3.10-regbench").sweep.for_preset("cpu")[0]
    out = regbench_grid(grids, "mm", ["mm", "lstm"], None)
    assert [g["arch"] for g in out] == [["mm"], ["lstm"]]
    assert out[0]["train.lr"] == grids[0]["train.lr"]  # mm keeps its searched values
    assert out[1] == {"arch": ["lstm"], "data.num_examples": [100, 500]}  # not searched: defaults, recipe sizes
    out = regbench_grid(grids, "mm", None, [250])
    assert [g["arch"] for g in out] == [["mm"], ["transformer"], ["ngram"]]
    assert "train.grad_clip" not in out[1]  # the family's own clipping (grad_clip_of)
    assert all(g["data.num_examples"] == [250] for g in out)


def test_rows_are_labelled_by_the_grids_size_beside_the_automata_trained_on():
    """seq_icl scales 100 training automata with 1000 test automata down to 90 but labels the run
    by its config's 100 (its notebook groups by dataset.num_examples): so does owai's study, with the
    90 beside it, and the thesis's numbers and claims at 100 stay reachable."""
    from owai.methods.regbench import STUDY_METRICS, study_markdown, study_rows

    metrics = [{"metric": m, "mean": 0.5, "n": 1, "thesis": None} for m in STUDY_METRICS if m != "num_examples"]
    metrics.append({"metric": "num_examples", "mean": 90.0, "n": 1, "thesis": None})
    summary = {"grid": [{"arch": ["transformer"], "data.num_examples": [100]}],
               "selection": {"per": ["arch", "data.num_examples"],
                             "groups": [{"key": {"arch": "transformer", "data.num_examples": 100}, "grid": {},
                                         "metrics": metrics, "cell": 0, "candidates": 1}]}}
    (row,) = study_rows(summary)
    assert (row["num_examples"], row["trained_on"]) == (100, 90)
    assert "| Transformer | 100 (90 trained) |" in study_markdown([row], "t", "c")


def test_each_family_clips_as_its_official_config():
    """MemoryMosaics' ICLL mm.yaml clips gradients at 1; seq_icl's trainer does not clip (0)."""
    from owai.methods.regbench import Config, grad_clip_of

    cfg = Config()
    assert grad_clip_of(cfg) == 1.0
    for arch in ("transformer", "lstm"):
        cfg.arch = arch
        assert grad_clip_of(cfg) == 0.0
    cfg.train.grad_clip = 0.5
    assert grad_clip_of(cfg) == 0.5


def test_rows_show_the_best_test_numbers_over_the_cells_beside_the_validation_selected_cell():
    """seq_icl's notebook picks each point on the test set, accuracy (max) and L1 (min) apart: the
    study keeps owai's validation-selected cell and shows those two beside it, each possibly from a
    different cell, and never from another group."""
    from owai.methods.regbench import study_markdown, study_rows
    from owai.recipes import Selection
    from owai.sweep import select_cells

    def cell(lr: float, size: int, val: float, acc: float, tvd: float) -> dict:
        values = {"val_loss": val, "accuracy": acc, "tvd": tvd}
        return {"grid": {"arch": "mm", "data.num_examples": size, "train.lr": lr}, "label": f"lr={lr} n={size}",
                "metrics": [{"metric": k, "mean": v, "n": 1, "thesis": None} for k, v in values.items()]}

    groups = [cell(1e-3, 100, 0.9, 0.60, 0.30), cell(1e-4, 100, 1.0, 0.70, 0.40), cell(1e-5, 100, 1.1, 0.50, 0.20),
              cell(1e-3, 500, 0.5, 0.95, 0.05), cell(1e-4, 500, 0.6, 0.90, 0.10)]
    per = ["arch", "data.num_examples"]
    summary = {"grid": {"arch": ["mm"], "data.num_examples": [100, 500], "train.lr": [1e-3, 1e-4, 1e-5]},
               "groups": groups, "selection": select_cells(groups, Selection(metric="val_loss", mode="min", per=per))}
    small, large = study_rows(summary)
    assert (small["accuracy"], small["tvd"]) == (0.60, 0.30)  # the validation-selected cell
    assert (small["accuracy_on_test"], small["tvd_on_test"]) == (0.70, 0.20)  # two different cells
    assert (large["accuracy_on_test"], large["tvd_on_test"]) == (0.95, 0.05)  # its own group only
    assert "| 0.7 / 0.2 |" in study_markdown([small, large], "t", "c")
