"""Benchmark: wall time of a ColoredMNIST study's cpu preset end to end (issue #4: Table 2.4's cpu
preset in <= 45 minutes on the 2-core development machine), and the table it measures.

    python benchmarks/bonsai_cpu.py [--out DIR] [--workers N] [--recipe table2.4-coloredmnist | table2.5-pi]

Runs `owai bonsai --study` with an empty cache (`$OWAI_CACHE` inside --out), so building the Bonsai
representation is part of the time. Prints the seconds against the target, then the selected worst
test accuracy per (dataset, method, init) beside the thesis's number, and checks Table 2.4's pattern:
ERM below the oracle (colour), the invariant methods from random init weak, Bonsai-cf near the
oracle; or, with `--recipe table2.5-pi`, Table 2.5's: PI works on ColoredMNIST and fails on
InverseColoredMNIST. The sweep directory stays under --out, so a killed benchmark finishes with
`owai bonsai --resume SWEEP_DIR`.
"""

from __future__ import annotations

import statistics
import sys

from _study import timed_study

TARGET_S = 45 * 60
INVARIANT = ("irm", "vrex", "sd", "iga", "fishr", "clove")


def pattern(rows: list[dict]) -> list[tuple[str, bool, str]]:
    """Table 2.4's three claims, as (claim, holds, numbers)."""
    cell = {(r["dataset"], r["method"], r["init"]): r["mean"] for r in rows if r.get("anneal") is None}
    oracle = cell.get(("coloredmnist-gray", "erm", "rand"))
    erm = cell.get(("coloredmnist", "erm", "rand"))
    rand = [cell[("coloredmnist", m, "rand")] for m in INVARIANT if ("coloredmnist", m, "rand") in cell]
    cf = [cell[("coloredmnist", m, "bonsai-cf")] for m in INVARIANT if ("coloredmnist", m, "bonsai-cf") in cell]
    if oracle is None or erm is None or not rand or not cf:
        return []
    return [
        ("ERM relies on colour (worst test far below the oracle)", erm < oracle - 0.2,
         f"ERM {100 * erm:.1f} vs oracle {100 * oracle:.1f}"),
        ("invariant methods from random init are weak (mean well below the oracle)",
         statistics.fmean(rand) < oracle - 0.1, f"mean {100 * statistics.fmean(rand):.1f} over {len(rand)} methods"),
        ("Bonsai-cf brings every invariant method close to the oracle (within 5 points)",
         min(cf) > oracle - 0.05, f"min {100 * min(cf):.1f}, mean {100 * statistics.fmean(cf):.1f} over {len(cf)} methods"),
    ]


def pattern_pi(rows: list[dict]) -> list[tuple[str, bool, str]]:
    """Table 2.5's two claims: PI works on ColoredMNIST and fails on InverseColoredMNIST, where the
    invariant methods on frozen Bonsai do not."""
    cell = {(r["dataset"], r["method"], r["init"]): r["mean"] for r in rows}
    out = []
    for dataset, works in (("coloredmnist", True), ("inverse-coloredmnist", False)):
        pi = cell.get((dataset, "pi", "rand"))
        cf = [cell[(dataset, m, "bonsai-cf")] for m in INVARIANT if (dataset, m, "bonsai-cf") in cell]
        erm = cell.get((dataset, "erm", "bonsai-cf"))
        if pi is None or not cf or erm is None:
            continue
        numbers = f"PI {100 * pi:.1f}, Bonsai-cf {100 * min(cf):.1f}-{100 * max(cf):.1f}, ERM-cf {100 * erm:.1f}"
        if works:
            out.append((f"PI works on {dataset} (within 5 points of the best Bonsai-cf method)",
                        pi > max(cf) - 0.05, numbers))
        else:
            out.append((f"PI fails on {dataset} (below ERM and every Bonsai-cf method)",
                        pi < min(cf + [erm]), numbers))
    return out


PATTERNS = {"table2.4-coloredmnist": pattern, "table2.5-pi": pattern_pi}


def main() -> int:
    done = timed_study(__doc__.splitlines()[0], ["bonsai", "--study"], "table2.4-coloredmnist", TARGET_S, empty_cache=True)
    if done is None:
        return 1
    args, seconds, report = done
    print(f"{'dataset':22s} {'method':9s} {'init':10s} {'measured %':>11s} {'thesis %':>9s}  chosen")
    for r in report["rows"]:
        if r.get("anneal") is not None:
            continue
        thesis = f"{100 * r['thesis']:9.1f}" if r.get("thesis") is not None else f"{'-':>9s}"
        chosen = ", ".join(f"{k}={v}" for k, v in r["searched"].items())
        print(f"{r['dataset']:22s} {r['method']:9s} {r['init']:10s} {100 * r['mean']:11.1f} {thesis}  {chosen} step {r['step']}")
    for claim, holds, numbers in PATTERNS.get(args.recipe, lambda rows: [])(report["rows"]):
        print(f"{'holds ' if holds else 'FAILS '} {claim}: {numbers}")
    return 0 if seconds <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
