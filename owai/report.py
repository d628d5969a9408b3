"""Measured-vs-thesis tables for a run's results.json (Rich and Markdown), and the recipe's claims
judged on a run or a sweep/study directory (holds / misses / n/a, with the numbers behind them), or
on several runs of one recipe: each run's own claims, then the recipe's cross-run claims
(`across: runs`, owai/claims.py) judged on all of them (`runs_document`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from owai import console
from owai.values import fmt, md_row, thesis_text


def _thesis(row: dict[str, Any]) -> str:
    return thesis_text(row.get("thesis"), row.get("thesis_claim"))


def table(results: dict[str, Any]) -> Table:
    title = f"{results['recipe']}: {results.get('reproduces', '')} [{results.get('preset', '')}]"
    t = Table(title=escape(title))
    t.add_column("metric", style="bold")
    t.add_column("measured", justify="right")
    t.add_column("thesis")
    t.add_column("ref")
    for row in results["rows"]:
        t.add_row(escape(row["metric"]), escape(fmt(row["measured"])), escape(_thesis(row)), escape(row.get("ref") or ""))
    return console.fit_table(t, whole=(0,))  # the metric names: what claims, --grid and select name


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"### {results['recipe']}: {results.get('reproduces', '')}",
        "",
        f"Command: `{results.get('command', '')}`  ",
        f"Run: `{results.get('run_dir', '')}`",
        "",
        "| metric | measured | thesis | ref |",
        "|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(md_row([row["metric"], fmt(row["measured"]), _thesis(row), row.get("ref") or ""]))
    return "\n".join(lines) + "\n"


# --- claims (owai/claims.py) -------------------------------------------------------------------

def run_results(run_dir: Path) -> dict[str, Any]:
    """A finished run's results.json, or an OwaiError that says what is wrong: not a run directory,
    no results.json yet (with what stopped the run and how to resume it), or one that names no recipe."""
    from owai.errors import OwaiError
    from owai.experiment import resume_hint
    from owai.runs import Run

    run = Run.open(run_dir, check_layout=False)  # report reads config.yaml and results.json only
    results = run.results()
    if results is None:  # what stopped it, too: under torchrun the rank whose error stopped the job
        cause = run.failure()
        raise OwaiError(f"{run_dir} has no results.json yet (status: {run.status()}{f'; {cause}' if cause else ''}); {resume_hint(run)}")
    if "recipe" not in results:  # the tables and the claims are the recipe's
        raise OwaiError(f"{Path(run_dir) / 'results.json'} is corrupt: it names no recipe; remove it and resume the run to write it again")
    return results


def _run_config(run_dir: Path) -> dict[str, Any]:
    """The run's config.yaml (its params and recipe_source), or empty params where it is unreadable."""
    from owai.errors import OwaiError
    from owai.runs import Run

    try:
        return Run(run_dir).read_config()
    except OwaiError:
        return {"params": {}, "recipe_source": None}


def run_claims(run_dir: Path, results: dict[str, Any], config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The recipe's claims judged on a single run, now (so runs written before a claim existed, or
    before claims were recorded, are judged too); the run's recorded verdicts if its recipe is gone.
    `config`: the run's config.yaml where the caller has read it already. Cross-run claims are left
    out (`runs_document` judges them)."""
    from owai.claims import judge_all, run_records
    from owai.recipes import recipe_claims

    config = _run_config(run_dir) if config is None else config
    claims = recipe_claims(results["recipe"], config.get("recipe_source"))
    if not claims:
        return list(results.get("claims") or [])
    return judge_all(claims, run_records(results, config.get("params")), results.get("preset"))


def runs_document(run_dirs: list[Path]) -> dict[str, Any]:
    """Several finished runs of one recipe as one JSON document, what `owai report RUN_DIR RUN_DIR ...
    --json` prints: `recipe`, `runs` (each run's own document, as `owai report RUN_DIR --json` prints
    it: its results and its claims) and `claims_across` (the recipe's cross-run claims judged on the
    records of all the runs, `owai.claims.judge_across`). Refused, as an OwaiError before anything
    is printed: a sweep directory among them, a run without results.json, a directory given twice,
    runs of different recipes."""
    from owai.claims import judge_across, run_records
    from owai.errors import OwaiError
    from owai.recipes import recipe_claims
    from owai.runs import is_sweep_dir

    opened: list[tuple[Path, dict[str, Any]]] = []
    for run_dir in run_dirs:
        if is_sweep_dir(run_dir):
            raise OwaiError(f"{run_dir} is a sweep directory: report it alone (owai report {run_dir}); "
                            "a report of several directories takes runs")
        opened.append((Path(run_dir), run_results(run_dir)))
    seen: dict[Path, Path] = {}
    for run_dir, _ in opened:
        same = seen.setdefault(run_dir.resolve(), run_dir)
        if same is not run_dir:
            raise OwaiError(f"{run_dir} is given twice" + (f" (also as {same})" if str(same) != str(run_dir) else ""))
    first_dir, first = opened[0]
    for run_dir, results in opened[1:]:
        if results["recipe"] != first["recipe"]:
            raise OwaiError(f"{run_dir} is a run of {results['recipe']}, {first_dir} of {first['recipe']}: "
                            "a report across runs compares runs of one recipe")
    runs, judged, configs = [], [], []
    for run_dir, results in opened:
        configs.append(_run_config(run_dir))
        runs.append({**results, "claims": run_claims(run_dir, results, configs[-1])})
        judged.append((run_records(results, configs[-1].get("params")), results.get("preset")))
    claims = recipe_claims(first["recipe"], configs[0].get("recipe_source"))
    return {"recipe": first["recipe"], "runs": runs, "claims_across": judge_across(claims, judged)}


def sweep_claims(sweep_dir: Path, summary: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """(verdicts, source of the numbers) of a sweep directory: on its study's rows if it has a
    study (bonsai.json, regbench.json, ...), else on its summary's cells."""
    from owai.claims import judge_all, sweep_records
    from owai.recipes import recipe_claims
    from owai.sweep import open_sweep

    plan = open_sweep(sweep_dir)
    records, source = sweep_records(Path(sweep_dir), summary)
    return judge_all(recipe_claims(plan.recipe, plan.recipe_source), records, plan.preset), source


def sweep_document(sweep_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """A sweep directory as JSON, the one shape `owai report SWEEP_DIR --json` and `owai sweep --json`
    print: its summary, the recipe's claims judged on it (`sweep_claims`), where their numbers come
    from, and its study's file (<stem>.json: the study's rows and title) or None for a plain sweep."""
    from owai.claims import study_file
    from owai.runs import read_json_object

    verdicts, source = sweep_claims(sweep_dir, summary)
    path = study_file(Path(sweep_dir))
    return {**summary, "claims": verdicts, "claims_source": source,
            "study": read_json_object(path) if path is not None else None}


def study_table_file(sweep_dir: Path) -> Path | None:
    """The study's Markdown table (<stem>.md beside its <stem>.json), if the sweep directory has one."""
    from owai.claims import study_file

    path = study_file(Path(sweep_dir))
    table = path.with_suffix(".md") if path is not None else None
    return table if table is not None and table.is_file() else None


def _numbers(verdict: dict[str, Any]) -> str:
    return ", ".join(f"{k} = {fmt(v)}" for k, v in verdict["numbers"].items())


VERDICT_STYLE = {"holds": "green", "misses": "red", "n/a": "yellow"}


def claims_table(verdicts: list[dict[str, Any]], title: str = "thesis claims") -> Table:
    """One row per claim: the verdict, the claim's text, the comparison made and its numbers."""
    t = Table(title=escape(title))
    t.add_column("verdict", no_wrap=True)
    t.add_column("claim")
    t.add_column("check")
    t.add_column("numbers")
    for v in verdicts:
        style = VERDICT_STYLE.get(v["verdict"], "")
        t.add_row(f"[{style}]{v['verdict']}[/{style}]", escape(f"{v['text']} ({v['id']})"), escape(v["detail"]),
                  escape(_numbers(v)))
    return console.fit_table(t, whole=(0,))


def claims_markdown(verdicts: list[dict[str, Any]]) -> str:
    lines = ["", "| verdict | claim | check | numbers |", "|---|---|---|---|"]
    for v in verdicts:
        lines.append(md_row([v["verdict"], f"{v['text']} ({v['id']})", v["detail"], _numbers(v)]))
    return "\n".join(lines) + "\n"


def latest_verdicts(root: Path) -> dict[str, dict[str, Any]]:
    """Recipe id -> {"dir", "claims"} of the newest finished run or sweep under `root` (by the
    time its results.json / summary.json was written); a sweep's points count as the sweep."""
    import json

    from owai import sweep
    from owai.errors import OwaiError

    newest: dict[str, tuple[float, Path, str]] = {}
    found = sorted([*Path(root).rglob("results.json"), *Path(root).rglob(sweep.SUMMARY)])
    for path in found:
        if path.name == "results.json" and not (path.parent.parent.name == sweep.POINTS
                                                 and sweep.is_sweep_dir(path.parent.parent.parent)):
            kind = "run"
        elif path.name == sweep.SUMMARY and sweep.is_sweep_dir(path.parent):
            kind = "sweep"
        else:
            continue
        try:
            recipe = json.loads(path.read_text())["recipe"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        when = path.stat().st_mtime
        if recipe not in newest or when > newest[recipe][0]:
            newest[recipe] = (when, path.parent, kind)
    out = {}
    for recipe, (_, directory, kind) in newest.items():
        try:
            if kind == "run":
                results = json.loads((directory / "results.json").read_text())
                verdicts = run_claims(directory, results)
            else:
                verdicts = sweep_claims(directory, json.loads((directory / sweep.SUMMARY).read_text()))[0]
        except (OSError, ValueError, KeyError, OwaiError):
            continue
        out[recipe] = {"dir": str(directory), "claims": verdicts}
    return out
