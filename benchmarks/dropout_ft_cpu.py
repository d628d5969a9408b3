"""Benchmark: wall time of `owai dropout-ft --preset cpu` end to end (issue #6: Table 2.8's cpu preset
in <= 30 minutes on the 2-core development machine), and the table it measures.

    python benchmarks/dropout_ft_cpu.py [--out DIR] [--workers N] [--recipe table2.8-dropout]

Runs with an empty weights cache (`$OWAI_CACHE` pointed inside --out), so the pre-training stage is
part of the time. Prints the seconds, the target, and the OOD accuracy per test domain and averaged
for ERM, VL-dropout and the ensembles / weight averages. The sweep directory is kept under --out
(default: a temporary directory), so a killed benchmark can be finished with `owai dropout-ft --resume`.
"""

from __future__ import annotations

import argparse
import json
import os
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
    parser.add_argument("--recipe", default="table2.8-dropout")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="owai-dropout-ft-"))
    env = {**os.environ, "OWAI_CACHE": str(out / "cache")}
    command = [sys.executable, "-m", "owai", "dropout-ft", "--recipe", args.recipe, "--preset", "cpu",
               "--workers", str(args.workers), "--out", str(out), "--json"]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        print(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
        return 1
    report = json.loads(proc.stdout)
    print(f"{args.recipe} cpu preset: {seconds:7.1f} s   target <= {TARGET_S} s   {'ok' if seconds <= TARGET_S else 'MISSED'}")
    print(f"sweep: {report['sweep_dir']}")
    domains = list(dict.fromkeys(d for r in report["rows"] for d in r["ood"]))
    print(f"{'method':28s} " + " ".join(f"{d:>7s}" for d in domains) + f" {'avg':>7s}   (OOD accuracy %, IID selection)")
    for r in report["rows"]:
        cells = " ".join(f"{100 * r['ood'][d]:7.1f}" if d in r["ood"] else f"{'-':>7s}" for d in domains)
        print(f"{r['label']:28s} {cells} {100 * r['avg']:7.1f}")
    return 0 if seconds <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
