"""Claims across runs (`across: runs`, owai/claims.py `judge_across`) and `owai report RUN_DIR RUN_DIR
...` (owai/report.py `runs_document`): chapter 4's comparisons between models that are trained and
evaluated in separate runs, each run naming its thesis row (--set row=...)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from owai import claims as C
from owai import recipes
from owai.errors import OwaiError
from conftest import cli_in_process

RULER = "table4.4-ruler"


@functools.lru_cache(maxsize=1)
def cross_run_recipes() -> tuple[str, ...]:
    """Every packaged recipe with a claim across runs (loading them all takes a second or two: once)."""
    return tuple(name for name in sorted(recipes.available()) if any(C.is_across(c) for c in recipes.load(name).claims))


def thesis_records(recipe: recipes.Recipe) -> list[dict[str, Any]]:
    """The thesis's own numbers as runs: one record per setting its `thesis:` entries name (`when`, e.g.
    {row: mmv2-small}), holding that setting's fields and every number the thesis gives for it."""
    by_setting: dict[tuple, dict[str, Any]] = {}
    for metric, entry in recipe.thesis.items():
        for number in entry if isinstance(entry, list) else [entry]:
            if number.value is not None and number.when:
                key = tuple(sorted(number.when.items()))
                by_setting.setdefault(key, dict(number.when))[metric] = number.value
    return list(by_setting.values())


# The recipes whose cross-run claims compare curves the thesis draws without printing their numbers
# (spec evals.md sec 2.7: Figs 4.6-4.9): no thesis number to check them on, so they are n/a here.
FIGURES_ONLY = {"fig4.6-icl"}


def test_the_chapter_4_recipes_claim_across_runs():
    """The recipes whose models the thesis compares run one model per run (a guard: a rule that left
    them all out would make the thesis test below vacuous)."""
    assert set(cross_run_recipes()) == {"table4.1-harness", RULER, "fig4.6-icl"}
    counts = {name: sum(C.is_across(c) for c in recipes.load(name).claims) for name in cross_run_recipes()}
    assert counts == {"table4.1-harness": 12, RULER: 18, "fig4.6-icl": 18}, counts


@pytest.mark.parametrize("name", cross_run_recipes())
def test_cross_run_claims_hold_on_the_thesis_numbers(name):
    """Each cross-run claim, fed the thesis's own rows (one record per row, at the paper preset),
    holds: a claim that asks more than the thesis's table shows, or a thesis number copied wrong, fails
    here. Table 4.1's rows print no 13- / 6-task average: the harness method's own `averages` of the
    row's columns stands in where Tables 4.2 / 4.3 print none."""
    recipe = recipes.load(name)
    records = thesis_records(recipe)
    if name == "table4.1-harness":
        from owai.evals.harness import averages

        records = [{**averages(r), **r} for r in records]
    across = [c for c in recipe.claims if C.is_across(c)]
    assert all("paper" in c.get("presets", ["paper"]) for c in across)  # the runs below are at paper
    verdicts = C.judge_across(recipe.claims, [([r], "paper") for r in records])
    assert [v["id"] for v in verdicts] == [c["id"] for c in across]
    if name in FIGURES_ONLY:
        assert all(v["verdict"] == C.NA and "not measured" in v["detail"] for v in verdicts), verdicts
        return
    failed = [f"{v['id']}: {v['verdict']} ({v['detail']})" for v in verdicts if v["verdict"] != C.HOLDS]
    assert not failed, "\n".join(failed)


def test_a_thesis_row_that_breaks_a_direction_is_not_claimed():
    """Table 4.7's 8T transformer is ahead of v2 at 4k (59.2 against 58.9): the claim is at 32k, where
    the text states it; judged at 4k on the same rows it would miss (the thesis test would catch it)."""
    recipe = recipes.load(RULER)
    spec = next(c for c in recipe.claims if c["id"] == "v2-above-transformer-8t-32k")
    at_4k = json.loads(json.dumps(spec).replace("qa.32k.score", "qa.4k.score"))
    records = thesis_records(recipe)
    assert C.judge_across([at_4k], [([r], "paper") for r in records])[0]["verdict"] == C.MISSES
    assert C.judge_across([spec], [([r], "paper") for r in records])[0]["verdict"] == C.HOLDS


# --- the claims engine -----------------------------------------------------------------------------

def claim(**spec: Any) -> dict[str, Any]:
    return {"id": "c", "text": "t", "kind": "compare", "op": ">", "across": "runs",
            "left": {"metric": "m", "where": {"row": "a"}}, "right": {"metric": "m", "where": {"row": "b"}}, **spec}


def test_single_run_verdicts_leave_cross_run_claims_out():
    single = {"id": "s", "text": "t", "kind": "compare", "left": "m", "op": ">", "right": 0}
    verdicts = C.judge_all([single, claim()], [{"m": 1.0, "row": "a"}])
    assert [v["id"] for v in verdicts] == ["s"]
    assert [v["id"] for v in C.judge_across([single, claim()], [([{"m": 2.0, "row": "a"}], None),
                                                               ([{"m": 1.0, "row": "b"}], None)])] == ["c"]


@pytest.mark.parametrize("runs, verdict, detail", [
    ([({"m": 2.0, "row": "a"}, "paper"), ({"m": 1.0, "row": "b"}, "paper")], C.HOLDS, "2 > 1"),
    ([({"m": 1.0, "row": "a"}, "paper"), ({"m": 2.0, "row": "b"}, "paper")], C.MISSES, "not: 1 > 2"),
    ([({"m": 2.0, "row": "a"}, "paper")], C.NA, "m[row=b] not measured"),
    ([({"m": 2.0, "row": "a"}, "paper"), ({"m": 1.0, "row": "b"}, "paper"), ({"m": 3.0, "row": "b"}, "paper")],
     C.NA, "ambiguous"),
    ([({"m": 2.0, "row": "a"}, "paper"), ({"m": 1.0, "row": "b"}, "cpu")], C.NA, "m[row=b] not measured"),
    ([({"m": 2.0, "row": "a"}, "cpu"), ({"m": 1.0, "row": "b"}, "cpu")], C.NA, "judged on runs at preset paper only"),
])
def test_judge_across_picks_each_row_from_the_runs_at_the_claims_presets(runs, verdict, detail):
    (v,) = C.judge_across([claim(presets=["paper"])], [([r], p) for r, p in runs])
    assert v["verdict"] == verdict and detail in v["detail"], v


@pytest.mark.parametrize("spec, message", [
    ({"across": "sweeps"}, "across must be 'runs'"),
    ({"left": "m"}, "a cross-run claim picks each metric's run: write m as"),
    ({"left": {"metric": "m", "where": {}}}, "write m as"),
    ({"right": {"max": [{"metric": "m", "where": {"row": "b"}}, "n"]}}, "write n as"),
    ({"given": {"left": "g", "op": ">", "right": 0}}, "write g as"),
])
def test_a_cross_run_claim_names_each_metrics_run(spec, message):
    with pytest.raises(OwaiError) as raised:
        C.check_claims([claim(**spec)], "r", ["cpu", "paper"])
    assert str(raised.value).startswith("recipe r: claim c: ") and message in str(raised.value)
    C.check_claims([claim(right=1.5)], "r", ["cpu", "paper"])  # a number needs no run


# --- owai report RUN_DIR RUN_DIR ... --------------------------------------------------------------

def ruler_run(root: Path, name: str, row: str, scores: dict[str, float], preset: str = "paper",
              recipe: str = RULER) -> Path:
    """A finished run directory (config.yaml + results.json) that names its thesis row."""
    path = root / name
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"recipe": recipe, "preset": preset, "params": {"row": row}}))
    rows = [{"metric": f"qa.{k}.score", "measured": v, "thesis": None, "thesis_claim": "", "ref": ""} for k, v in scores.items()]
    (path / "results.json").write_text(json.dumps({"recipe": recipe, "preset": preset, "reproduces": "Table 4.4",
                                                   "run_dir": str(path), "rows": rows}))
    return path


@pytest.fixture
def four_runs(tmp_path) -> list[Path]:
    """v2 and the transformer, small at 4k (v2 ahead) and large fine-tuned at 32k (v2 ahead by less than
    the claimed 10 points at 32k)."""
    return [ruler_run(tmp_path, "v2-small", "mmv2-small", {"4k": 45.0, "32k": 31.7}),
            ruler_run(tmp_path, "tf-small", "transformer-small", {"4k": 39.4}),
            ruler_run(tmp_path, "v2-large-32k", "mmv2-large-32k", {"4k": 58.9, "32k": 53.4}, "paper-32k"),
            ruler_run(tmp_path, "tf-large-32k", "transformer-large-32k", {"4k": 51.2, "32k": 48.0}, "paper-32k")]


def test_report_of_several_runs_judges_the_claims_across_them(four_runs, capsys):
    code, out, err = cli_in_process(["report", *map(str, four_runs), "--json"], capsys)
    assert code == 0, err
    document = json.loads(out)
    assert set(document) == {"recipe", "runs", "claims_across"} and document["recipe"] == RULER
    for run, own in zip(four_runs, document["runs"]):  # each run's document is its single-run report
        code, single, _ = cli_in_process(["report", str(run), "--json"], capsys)
        assert code == 0 and own == json.loads(single)
        assert not {v["id"] for v in own["claims"]} & {v["id"] for v in document["claims_across"]}
    verdicts = {v["id"]: v for v in document["claims_across"]}
    assert len(verdicts) == 18
    assert verdicts["v2-above-transformer-4k-small"]["verdict"] == "holds"
    assert verdicts["v2-above-transformer-4k-small"]["numbers"] == {"qa.4k.score[row=mmv2-small]": 45.0,
                                                                    "qa.4k.score[row=transformer-small]": 39.4}
    assert verdicts["v2-above-transformer-32k-large"]["verdict"] == "misses"  # 53.4 > 48.0 + 10 fails
    assert verdicts["v2-above-transformer-32k-large"]["detail"] == "not: 53.4 > 48 + 10"
    assert verdicts["v2-above-transformer-32k-small"]["verdict"] == "n/a"  # no small 32k run
    assert verdicts["no-ltm-falls-4k"]["detail"] == "qa.4k.score[row=mmv2-large-32k-no-ltm] not measured"

    code, out, err = cli_in_process(["report", *map(str, four_runs)], capsys)
    assert code == 0, err
    assert out.index("run 1 of 4") < out.index("run 4 of 4") < out.index("claims across the 4 runs: 1 holds, 1 misses, 16 n/a")
    code, out, err = cli_in_process(["report", *map(str, four_runs), "--markdown"], capsys)
    assert code == 0, err
    assert out.count("### table4.4-ruler: Table 4.4") == 4 and "### claims across the 4 runs: 1 holds, 1 misses, 16 n/a" in out
    assert "| holds | trained at 4k, v2 small is more accurate than the transformer small at 4k" in out


def test_report_of_one_run_is_unchanged_by_cross_run_claims(four_runs, capsys):
    code, out, err = cli_in_process(["report", str(four_runs[0]), "--json"], capsys)
    assert code == 0, err
    document = json.loads(out)
    assert "claims_across" not in document and "runs" not in document
    assert [v["id"] for v in document["claims"]] == ["oracle-reads-every-needle", "qa-falls-with-context"]
    code, out, _ = cli_in_process(["report", str(four_runs[0])], capsys)
    assert code == 0 and "across" not in out and "run 1 of" not in out


def test_runs_at_a_preset_the_claims_leave_out_are_not_judged(tmp_path, capsys):
    """The cpu preset's oracle runs are no paper-scale model: the cross-run claims ignore them."""
    runs = [ruler_run(tmp_path, "a", "mmv2-small", {"4k": 45.0}, "cpu"),
            ruler_run(tmp_path, "b", "transformer-small", {"4k": 39.4}, "cpu")]
    code, out, err = cli_in_process(["report", *map(str, runs), "--json"], capsys)
    assert code == 0, err
    verdicts = json.loads(out)["claims_across"]
    assert {(v["verdict"], v["detail"]) for v in verdicts} == {("n/a", "judged on runs at preset paper, paper-32k only")}


def test_a_recipe_without_cross_run_claims_says_so(tmp_path, capsys):
    runs = [ruler_run(tmp_path, n, "", {}, "cpu", recipe="three-moons") for n in ("a", "b")]
    code, out, err = cli_in_process(["report", *map(str, runs)], capsys)
    assert code == 0, err
    assert "three-moons states no claim across runs" in out
    code, out, _ = cli_in_process(["report", *map(str, runs), "--json"], capsys)
    assert json.loads(out)["claims_across"] == []


def _listing(root: Path) -> list[tuple[str, float]]:
    return sorted((str(p), p.stat().st_mtime) for p in root.rglob("*"))


@pytest.mark.parametrize("case, message", [
    ("other-recipe", "is a run of three-moons, "),
    ("twice", "is given twice"),
    ("twice-spelt-otherwise", "is given twice (also as "),
    ("unfinished", "has no results.json yet (status: unknown)"),
    ("sweep", "is a sweep directory: report it alone (owai report "),
    ("missing", "does not exist"),
])
def test_report_of_several_runs_refuses_bad_input_in_one_line(four_runs, tmp_path, capsys, case, message):
    runs = [str(four_runs[0]), str(four_runs[1])]
    if case == "other-recipe":
        runs.append(str(ruler_run(tmp_path, "moons", "", {}, "cpu", recipe="three-moons")))
    elif case == "twice":
        runs.append(runs[0])
    elif case == "twice-spelt-otherwise":
        runs.append(str(four_runs[0].parent / ".." / four_runs[0].parent.name / four_runs[0].name))
    elif case == "unfinished":
        (four_runs[2] / "results.json").unlink()
        runs.append(str(four_runs[2]))
    elif case == "sweep":
        sweep = tmp_path / "sweep"
        sweep.mkdir()
        (sweep / "sweep.json").write_text(json.dumps({"kind": "owai-sweep", "version": 1, "recipe": RULER}))
        runs.insert(1, str(sweep))
    else:
        runs.append(str(tmp_path / "nowhere"))
    before = _listing(tmp_path)
    for form in ([], ["--json"], ["--markdown"]):
        code, out, err = cli_in_process(["report", *runs, *form], capsys)
        assert code == 2 and out == "", (out, err)
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert _listing(tmp_path) == before  # nothing written


def test_each_runs_own_claims_are_printed_in_the_text_and_markdown_forms(four_runs, capsys):
    """The text and Markdown forms of a report of several runs print each run as `owai report RUN_DIR`
    prints it: its table, then its own (single-run) claims, before the claims across the runs. The
    --json form is checked against the single-run documents above; these two forms had no check of
    the runs' own claims, so dropping them went unnoticed."""
    own = ["oracle-reads-every-needle", "qa-falls-with-context"]
    code, out, err = cli_in_process(["report", *map(str, four_runs)], capsys)
    assert code == 0, err
    sections = [out.index(f"run {i} of 4") for i in range(1, 5)] + [out.index("claims across the 4 runs")]
    for start, end in zip(sections, sections[1:]):
        assert out[start:end].count("thesis claims: ") == 1, out[start:end]
    code, out, err = cli_in_process(["report", *map(str, four_runs), "--markdown"], capsys)
    assert code == 0, err
    runs_part = out[:out.index("### claims across the 4 runs")]
    for claim_id in own:
        assert runs_part.count(f"({claim_id})") == 4, runs_part


def test_a_multi_run_report_reads_each_runs_config_once(four_runs, monkeypatch):
    """`runs_document` reads each run's config.yaml once and hands it to `run_claims` (commit 0992c9a):
    a config read twice could be read as two different files if a run rewrites it between the reads
    (its own claims judged on one, the claims across runs on the other)."""
    from owai import report
    from owai.runs import Run

    reads: list[str] = []
    real = Run.read_config

    def counted(self):  # noqa: ANN001, ANN202
        reads.append(str(self.path))
        return real(self)

    monkeypatch.setattr(Run, "read_config", counted)
    document = report.runs_document(four_runs)
    assert len(document["runs"]) == 4
    assert sorted(reads) == sorted(str(p) for p in four_runs)


def test_a_results_json_that_names_no_recipe_is_refused_in_one_line(four_runs, capsys):
    """A results.json that is an owai results file but names no recipe (`report.run_results`): the
    tables and the claims are the recipe's, so one run, or one of several, is refused in one line
    that says how to write it again, never reported with no claims."""
    (four_runs[1] / "results.json").write_text(json.dumps({"rows": []}))
    for runs in ([four_runs[1]], four_runs):
        for form in ([], ["--json"], ["--markdown"]):
            code, out, err = cli_in_process(["report", *map(str, runs), *form], capsys)
            assert code == 2 and out == "", (out, err)
            assert err.startswith("error: ") and err.count("\n") == 1, err
            assert "results.json is corrupt: it names no recipe; remove it and resume the run" in err, err


def test_a_recipe_without_cross_run_claims_says_so_in_markdown(tmp_path, capsys):
    """The Markdown form says so too, under the claims-across heading, rather than ending on an empty
    section."""
    runs = [ruler_run(tmp_path, n, "", {}, "cpu", recipe="three-moons") for n in ("a", "b")]
    code, out, err = cli_in_process(["report", *map(str, runs), "--markdown"], capsys)
    assert code == 0, err
    assert "### claims across the 2 runs: " in out
    assert out.rstrip().endswith("The recipe states no claim across runs.")


def test_a_claim_without_presets_is_judged_on_every_run():
    """`presets` narrows the runs a cross-run claim reads; without it every run counts, whatever its
    preset, and no run at all is "not measured", never a preset restriction the claim does not make."""
    (v,) = C.judge_across([claim()], [([{"m": 2.0, "row": "a"}], "cpu"), ([{"m": 1.0, "row": "b"}], "paper")])
    assert v["verdict"] == C.HOLDS and v["detail"] == "2 > 1", v
    (v,) = C.judge_across([claim()], [])
    assert v["verdict"] == C.NA and "not measured" in v["detail"] and "preset" not in v["detail"], v
