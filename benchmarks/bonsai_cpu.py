"""Benchmark: wall time of a ColoredMNIST study's cpu preset end to end (issue #4: Table 2.4's cpu
preset in <= 60 minutes (issue #25: on the 50k paper split) on the 2-core development machine), and the table it measures.

    python benchmarks/bonsai_cpu.py [--out DIR] [--workers N] [--recipe table2.4-coloredmnist | table2.5-pi]

Runs `owai bonsai --study` with an empty cache (`$OWAI_CACHE` inside --out), so building the Bonsai
representation is part of the time. Prints the seconds against the target, then the selected worst
test accuracy per (dataset, method, init) beside the thesis's number, and checks the recipe's
claims (its `claims:`, judged by owai.claims): Table 2.4's ERM below the oracle (colour), the
invariant methods from random init weak, Bonsai-cf near the oracle; or, with `--recipe
table2.5-pi`, Table 2.5's: PI works on ColoredMNIST and fails on InverseColoredMNIST. The sweep
directory stays under --out, so a killed benchmark finishes with `owai bonsai --resume SWEEP_DIR`.
"""

from __future__ import annotations

import sys

from _study import timed_study

TARGET_S = 60 * 60
INVARIANT = ("irm", "vrex", "sd", "iga", "fishr", "clove")


def recipe_pattern(recipe: str, rows: list[dict]) -> list[tuple[str, bool, str]]:
    """The recipe's claims (`claims:` in its YAML, judged by owai.claims) on a study's rows, as
    (claim, holds, numbers); claims the rows cannot decide (a cell missing) are left out."""
    from owai.claims import HOLDS, NA, judge_all, study_records
    from owai.recipes import load
    from owai.report import fmt

    verdicts = judge_all(load(recipe).claims, study_records(rows))
    return [(v["text"], v["verdict"] == HOLDS,
             f"{v['detail']} ({', '.join(f'{k} = {fmt(x)}' for k, x in v['numbers'].items())})")
            for v in verdicts if v["verdict"] != NA]


def pattern(rows: list[dict]) -> list[tuple[str, bool, str]]:
    """Table 2.4's claims (recipe table2.4-coloredmnist): ERM below the oracle, the invariant methods
    from random init weak, Bonsai-cf near the oracle."""
    return recipe_pattern("table2.4-coloredmnist", rows)


def pattern_pi(rows: list[dict]) -> list[tuple[str, bool, str]]:
    """Table 2.5's claims (recipe table2.5-pi): PI works on ColoredMNIST and fails on
    InverseColoredMNIST, where the invariant methods on frozen Bonsai do not."""
    return recipe_pattern("table2.5-pi", rows)


PATTERNS = {"table2.4-coloredmnist": pattern, "table2.5-pi": pattern_pi}


def main() -> int:
    done = timed_study(__doc__.splitlines()[0], ["bonsai", "--study"], "table2.4-coloredmnist", TARGET_S, empty_cache=True)
    args, seconds, report = done
    print(f"{'dataset':22s} {'method':9s} {'init':10s} {'measured %':>11s} {'thesis %':>9s}  chosen")
    for r in report["rows"]:
        if r.get("anneal") is not None:
            continue
        thesis = f"{100 * r['thesis']:9.1f}" if r.get("thesis") is not None else f"{'-':>9s}"
        chosen = ", ".join(f"{k}={v}" for k, v in r["searched"].items())
        print(f"{r['dataset']:22s} {r['method']:9s} {r['init']:10s} {100 * r['mean']:11.1f} {thesis}  {chosen} step {r['step']}")
    for claim, holds, numbers in recipe_pattern(args.recipe, report["rows"]):
        print(f"{'holds ' if holds else 'FAILS '} {claim}: {numbers}")
    return 0 if seconds <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
