"""Benchmark: how long owai's quick commands take from the shell, process start to exit (the
imports are most of it): help, the recipe list, a recipe's resolved settings, the data catalogue.

    python benchmarks/cli_latency.py                # each command 5 times: median and min
    python benchmarks/cli_latency.py --repeat 9

Run it from a checkout; `python -m owai` imports the owai that Python finds first (PYTHONPATH=DIR
times another checkout in the same environment, for a paired comparison).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

from _args import ArgumentParser, positive  # benchmarks/, beside this script

COMMANDS: list[list[str]] = [
    ["--help"],
    ["moons", "--help"],
    ["recipes", "list"],
    ["recipes", "show", "three-moons"],
    ["recipes", "show", "table4.2-pretrain"],
    ["data", "list"],
]


def main() -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=positive, default=5, help="runs of each command (default 5)")
    args = parser.parse_args()
    print(f"cores: {os.cpu_count()}  python {sys.version.split()[0]}  runs per command: {args.repeat}")
    failed = False
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "OWAI_CACHE": os.path.join(scratch, "cache"), "COLUMNS": "120"}
        for owai_args in COMMANDS:
            seconds = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                proc = subprocess.run([sys.executable, "-m", "owai", *owai_args], env=env, cwd=scratch,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                seconds.append(time.perf_counter() - start)
                if proc.returncode != 0:
                    failed = True
                    print(f"owai {' '.join(owai_args)}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
                    break
            else:
                print(f"owai {' '.join(owai_args):36s} median {statistics.median(seconds):6.2f} s   min {min(seconds):6.2f} s",
                      flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
