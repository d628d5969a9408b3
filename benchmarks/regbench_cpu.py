"""Benchmark: wall time of `owai eval regbench --preset cpu` end to end (issue #5: <= 30 minutes on
the 2-core development machine), and the table it measures.

    python benchmarks/regbench_cpu.py [--out DIR] [--workers N]

Prints the seconds, the target, and the selected cells' test accuracy / "TVD" (L1) / TVD (L1/2)
beside the thesis's Figure 3.10 numbers. The sweep directory is kept under --out (default: a
temporary directory), so a killed benchmark can be finished with `owai eval regbench --resume`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 30 * 60


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where the sweep directory goes (default: a temporary one)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--recipe", default="fig3.10-regbench")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="owai-regbench-"))
    command = [sys.executable, "-m", "owai", "eval", "regbench", "--recipe", args.recipe, "--preset", "cpu",
               "--workers", str(args.workers), "--out", str(out), "--json"]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        print(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
        return 1
    report = json.loads(proc.stdout)
    print(f"{args.recipe} cpu preset: {seconds:7.1f} s   target <= {TARGET_S} s   {'ok' if seconds <= TARGET_S else 'MISSED'}")
    print(f"sweep: {report['sweep_dir']}")
    print(f"{'model':14s} {'automata':>8s} {'accuracy':>9s} {'thesis':>7s} {'L1':>7s} {'thesis':>7s} {'L1/2':>7s} {'val loss':>8s}  selected")

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    for r in report["rows"]:
        print(f"{r['arch']:14s} {r['num_examples'] or '-':>8} {num(r['accuracy']):>9s} {num(r['thesis_accuracy']):>7s} "
              f"{num(r['tvd']):>7s} {num(r['thesis_tvd']):>7s} {num(r['tvd_half']):>7s} {num(r['val_loss']):>8s}  {r['selected']}")
    return 0 if seconds <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
