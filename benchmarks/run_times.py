"""Benchmark: wall time of the three-moons `cpu` preset (both variants) and of the Figure 3.1
`cpu` preset, end to end through the CLI, as a user runs them.

    python benchmarks/moons_cpu.py            # prints seconds per recipe and the targets
Targets (issue #2, 2-core machine): three moons <= 300 s, Figure 3.1 <= 180 s.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

TARGETS = {"three-moons": ("moons", 300.0), "linear-disentanglement": ("moons linear", 180.0)}


def main() -> int:
    failed = False
    for recipe, (command, target) in TARGETS.items():
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "owai", *command.split(), "--quiet", "--out", out])
            seconds = time.perf_counter() - start
        ok = proc.returncode == 0 and seconds <= target
        failed |= not ok
        print(f"{recipe:26s} cpu preset: {seconds:7.1f} s   target <= {target:.0f} s   {'ok' if ok else 'MISSED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
