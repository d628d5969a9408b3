"""Benchmark: wall time of `owai eval regbench --preset cpu` end to end (issue #5: <= 30 minutes on
the 2-core development machine), and the table it measures.

    python benchmarks/regbench_cpu.py [--out DIR] [--workers N]

Prints the seconds, the target, and the selected cells' test accuracy / "TVD" (L1) / TVD (L1/2)
beside the thesis's Figure 3.10 numbers. The sweep directory is kept under --out (default: a
temporary directory), so a killed benchmark can be finished with `owai eval regbench --resume`.
"""

from __future__ import annotations

import sys

from _study import timed_study

TARGET_S = 30 * 60


def main() -> int:
    done = timed_study(__doc__.splitlines()[0], ["eval", "regbench"], "fig3.10-regbench", TARGET_S)
    _, seconds, report = done
    print(f"{'model':14s} {'automata':>8s} {'accuracy':>9s} {'thesis':>7s} {'L1':>7s} {'thesis':>7s} {'L1/2':>7s} {'val loss':>8s}  selected")

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    for r in report["rows"]:
        print(f"{r['arch']:14s} {r['num_examples'] or '-':>8} {num(r['accuracy']):>9s} {num(r['thesis_accuracy']):>7s} "
              f"{num(r['tvd']):>7s} {num(r['thesis_tvd']):>7s} {num(r['tvd_half']):>7s} {num(r['val_loss']):>8s}  {r['selected']}")
    return 0 if seconds <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
