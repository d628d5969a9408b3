"""Benchmark: wall time of the README's short commands, end to end through the CLI, as a user runs
them (fresh output directory, empty `$OWAI_CACHE`), with the machine's core count.

    python benchmarks/run_times.py                 # every command below
    python benchmarks/run_times.py --only moons    # one of them

The README and `--help` state these times as measured here; the long studies have their own
benchmarks: `bonsai_cpu.py` (Table 2.4/2.5 studies), `dropout_ft_cpu.py` (Table 2.8), and
`regbench_cpu.py` (Fig 3.10). Targets: three moons <= 300 s and Figure 3.1 <= 180 s (issue #2).
The `bonsai` line runs the tiny preset (the packaged MNIST test split, no download); the cpu and
paper presets read the 60k MNIST training file (the data-root rule: `$OWAI_DATA` or `owai data fetch mnist`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from _args import ArgumentParser  # benchmarks/, beside this script

# name: (owai arguments, target seconds or None)
COMMANDS: dict[str, tuple[list[str], float | None]] = {
    "moons": (["moons"], 300.0),
    "moons-linear": (["moons", "linear"], 180.0),
    "mosaic-train": (["mosaic-train"], None),
    "bonsai-one-restart": (["bonsai", "-p", "tiny", "--method", "vrex", "--init", "bonsai-cf"], None),
    "twobits": (["bonsai", "--recipe", "figA.2-twobits"], None),
}


def main() -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(COMMANDS), action="append", help="run only these (repeatable)")
    parser.add_argument("--out", help="keep the run directories here (for `owai report`); default: a temporary directory")
    args = parser.parse_args()
    print(f"cores: {os.cpu_count()}  torch threads: default")
    failed = False
    for name in args.only or list(COMMANDS):
        owai_args, target = COMMANDS[name]
        with tempfile.TemporaryDirectory() as scratch:
            env = {**os.environ, "OWAI_CACHE": os.path.join(scratch, "cache")}  # an empty cache for each command
            runs = os.path.join(args.out or scratch, "runs")
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "owai", *owai_args, "--quiet", "--out", runs], env=env)
            seconds = time.perf_counter() - start
        ok = proc.returncode == 0 and (target is None or seconds <= target)
        failed |= not ok
        goal = f"target <= {target:.0f} s" if target else "no target"
        print(f"owai {' '.join(owai_args):45s} {seconds:7.1f} s  {goal:18s} {'ok' if ok else 'MISSED' if proc.returncode == 0 else f'exit {proc.returncode}'}",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
