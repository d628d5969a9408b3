"""Shared glue of the study benchmarks: parse --out/--workers/--recipe, run one `owai ... --json` study
on its cpu preset in a subprocess, time it, and print the time against the target."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _args import ArgumentParser, positive


def timed_study(description: str, command: list[str], default_recipe: str, target_s: float,
                empty_cache: bool = False) -> tuple[argparse.Namespace, float, dict[str, Any]]:
    """(args, seconds, the study's JSON report); a study that fails exits with owai's code (2: bad
    input) after its last line.
    `command` is the owai subcommand (e.g. ["bonsai", "--study"]); with `empty_cache` $OWAI_CACHE
    points inside --out, so cached stages are part of the time."""
    parser = ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=None, help="where the sweep directory goes (default: a temporary one)")
    parser.add_argument("--workers", type=positive, default=1)
    parser.add_argument("--recipe", default=default_recipe)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix=f"owai-{command[0]}-"))
    env = {**os.environ, "OWAI_CACHE": str(out / "cache")} if empty_cache else None
    argv = [sys.executable, "-m", "owai", *command, "--recipe", args.recipe, "--preset", "cpu",
            "--workers", str(args.workers), "--out", str(out), "--json"]
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        print(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}", file=sys.stderr)
        raise SystemExit(proc.returncode)
    report = json.loads(proc.stdout)
    print(f"{args.recipe} cpu preset: {seconds:7.1f} s   target <= {target_s:.0f} s   {'ok' if seconds <= target_s else 'MISSED'}")
    print(f"sweep: {report['sweep_dir']}")
    return args, seconds, report
