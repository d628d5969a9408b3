"""Check Tables 2.4 and 2.5's claims on the rows of saved studies (issue #4).

    python benchmarks/bonsai_claims.py [--window a12|all] STUDY.json [STUDY.json ...]

Each file is the stdout of `owai bonsai --study ... --json`. Their rows are pooled, so a table
measured in several studies (one per column or per method, as on the paper split in
docs/results.md) is checked as a whole. Prints every row beside the thesis's number, then the claims
of recipes table2.4-coloredmnist and table2.5-pi (their `claims:`, judged by owai.claims through
`benchmarks/bonsai_cpu.py`'s `pattern`, `pattern_pi`) that the pooled rows can decide.
Without `--window` the reports' rows count as they are. `--window` selects every cell again from
the report's sweep directory: `a12` (the study's own rule) only at the steps of Table A.12's
early-stopping grid (`owai.methods.coloredmnist.a12_window`), `all` at every evaluated step (the
rule of reports written before the window became the default; docs/decisions.md).
Exits 1 if a claim fails or no claim can be decided; 2 on an unreadable report or sweep directory,
or a cell in two reports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from _args import say_error  # benchmarks/, beside this script
from bonsai_cpu import pattern, pattern_pi


def reselected_rows(report: dict[str, Any], window: str) -> list[dict[str, Any]]:
    """The report's cells selected again from its sweep directory with `window`."""
    from owai.errors import OwaiError
    from owai.methods.coloredmnist import study_rows
    from owai.sweep import open_sweep

    try:
        return study_rows(open_sweep(Path(report["sweep_dir"])), window)
    except OwaiError as err:
        raise ValueError(f"sweep directory {report['sweep_dir']}: {err}") from None


def pooled_rows(paths: list[Path], window: str | None = None) -> list[dict[str, Any]]:
    """The rows of every study report (selected again with `window` if given). Raises
    ValueError on an unreadable report, and on a cell measured in two reports (which one would count?)."""
    rows: dict[tuple, dict[str, Any]] = {}
    for path in paths:
        try:
            report = json.loads(path.read_text())
            found = report["rows"] if window is None else reselected_rows(report, window)
            keyed = [((r["dataset"], r["method"], r["init"], r.get("anneal")), r) for r in found]
            if not all({"mean", "std", "n"} <= r.keys() for _, r in keyed):
                raise ValueError("a row without mean/std/n")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{path}: not an `owai bonsai --study --json` report ({type(err).__name__}: {err})") from None
        for key, row in keyed:
            if key in rows:
                raise ValueError(f"{path}: the cell {'/'.join(str(k) for k in key if k is not None)} is in two reports")
            rows[key] = row
    return list(rows.values())


def main(argv: list[str]) -> int:
    if not argv:
        return say_error("give one or more study reports (bonsai.json), or --help")
    if argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    window = None
    if argv[0] == "--window":
        if len(argv) < 3 or argv[1] not in ("all", "a12"):
            return say_error("--window takes all or a12, then the reports")
        window, argv = argv[1], argv[2:]
    try:
        rows = pooled_rows([Path(a) for a in argv], window)
    except ValueError as err:
        return say_error(str(err))
    for r in rows:
        thesis = f"{100 * r['thesis']:5.1f}" if r.get("thesis") is not None else "    -"
        init = r["init"] if r.get("anneal") is None else f"{r['init']}/{r['anneal']}"  # Fig 2.7: per pre-training length
        print(f"{r['dataset']:22s} {r['method']:6s} {init:10s} {100 * r['mean']:5.1f} ± {100 * r['std']:3.1f}"
              f" (n={r['n']})  thesis {thesis}")
    claims = pattern(rows) + pattern_pi(rows)
    for claim, holds, numbers in claims:
        print(f"{'holds ' if holds else 'FAILS '} {claim}: {numbers}")
    if not claims:
        print("no claim can be decided from these rows (Table 2.4 needs the oracle, ERM, Rand and Bonsai-cf rows;"
              " Table 2.5 PI, ERM-cf and Bonsai-cf)")
    return 0 if claims and all(holds for _, holds, _ in claims) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
