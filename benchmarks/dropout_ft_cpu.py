"""Benchmark: wall time of `owai dropout-ft --preset cpu` end to end (issue #6: Table 2.8's cpu preset
in <= 30 minutes on the 2-core development machine), and the table it measures.

    python benchmarks/dropout_ft_cpu.py [--out DIR] [--workers N] [--recipe table2.8-dropout]

Runs with an empty weights cache (`$OWAI_CACHE` pointed inside --out), so the pre-training stage is
part of the time. Prints the seconds, the target, and the OOD accuracy per test domain and averaged
for ERM, VL-dropout and the ensembles / weight averages. The sweep directory is kept under --out
(default: a temporary directory), so a killed benchmark can be finished with `owai dropout-ft --resume`.
"""

from __future__ import annotations

import sys

from _study import timed_study

TARGET_S = 30 * 60


def main() -> int:
    done = timed_study(__doc__.splitlines()[0], ["dropout-ft"], "table2.8-dropout", TARGET_S, empty_cache=True)
    _, seconds, report = done
    domains = list(dict.fromkeys(d for r in report["rows"] for d in r["ood"]))
    print(f"{'method':28s} " + " ".join(f"{d:>7s}" for d in domains) + f" {'avg':>7s}   (OOD accuracy %, IID selection)")
    for r in report["rows"]:
        cells = " ".join(f"{100 * r['ood'][d]:7.1f}" if d in r["ood"] else f"{'-':>7s}" for d in domains)
        print(f"{r['label']:28s} {cells} {100 * r['avg']:7.1f}")
    return 0 if seconds <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
