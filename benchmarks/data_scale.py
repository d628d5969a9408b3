"""Benchmark: the data pipeline at the paper's scale, on generated data (CPU only; docs/results.md).

    python benchmarks/data_scale.py [--only tar,windows,paths,samplers,camelyon] [--scale 1.0] [--dir DIR]

Prints, per check, the measured figures and what they mean at the paper's size:
  tar       reading a .tar.gz of documents stored out of name order (sotu.tar.gz is), 1,000 and 4,000
            members (O(N^2) before the fix: 1.7 s and 25 s on the quiet 2-core machine)
  windows   TokenWindows random batches over a 10^9-token uint16 file (2 GB, written once under
            --dir), and offsets past 2^31 on a sparse 2.5 x 10^9-token file
  paths     private memory of forked DataLoader workers reading ImageNet's 1.28M file names as a list
            of Path, a list of str, and owai's `Strings`
  samplers  ms per step of Camelyon17's StandardSampler at 302k / 1.28M examples
  camelyon  peak RSS and time of reading a 455,954-row metadata.csv (+ empty patch files)
--scale multiplies the generated sizes (0.1 for a quick look). Generated files stay under --dir
(default: a temporary directory, removed at the end).
"""

from __future__ import annotations

import csv
import io
import os
import random
import resource
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from _args import ArgumentParser, fail

CHECKS = ("tar", "windows", "paths", "samplers", "camelyon")


def rss_mb() -> float:
    """This process's peak RSS (since `reset_peak`, where Linux allows it)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def check_tar(work: Path, scale: float) -> None:
    from owai.data.text import read_file

    for n in (int(1000 * scale), int(4000 * scale)):
        names = [f"d/doc{i:07d}.txt" for i in range(max(n, 2))]
        random.Random(0).shuffle(names)
        path = work / f"docs-{n}.tar.gz"
        with tarfile.open(path, "w:gz") as archive:
            for name in names:
                data = ((name + " ") * 300).encode()
                member = tarfile.TarInfo(name)
                member.size = len(data)
                archive.addfile(member, io.BytesIO(data))
        t0 = time.perf_counter()
        count = sum(1 for _ in read_file(path))
        print(f"tar: {count} members out of name order read in {time.perf_counter() - t0:.2f} s")


def check_windows(work: Path, scale: float) -> None:
    import numpy as np
    import torch

    from owai.data.tokens import TokenWindows

    n = int(1e9 * scale)
    path = work / f"tokens-{n}.bin"
    if not path.is_file():
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            for _ in range(10):
                f.write(rng.integers(0, 50257, n // 10, dtype=np.uint16).tobytes())
    windows = TokenWindows(path, np.uint16, 4096)
    for rows in (8, 64, 512):
        gen = torch.Generator().manual_seed(0)
        windows.batch(rows, gen)
        t0 = time.perf_counter()
        for _ in range(10):
            windows.batch(rows, gen)
        dt = (time.perf_counter() - t0) / 10
        print(f"windows: {n:,} tokens, {rows} x 4096 a batch: {dt * 1e3:.1f} ms ({rows * 4096 / dt / 1e6:.0f}M tokens/s)")
    sparse = work / "sparse.bin"
    with open(sparse, "wb") as f:
        f.truncate(2_500_000_000 * 2)
    big = TokenWindows(sparse, np.uint16, 4096)
    x, _ = big.batch(4, torch.Generator().manual_seed(0))
    print(f"windows: 2.5e9-token file: {big.n_offsets:,} offsets (> 2^31: {big.n_offsets > 2 ** 31}), batch {tuple(x.shape)}")
    sparse.unlink()


def _private_mb(pid: int) -> float:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("Private_Dirty", "Private_Clean"))) / 1024


def check_paths(scale: float) -> None:
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Dataset

    from owai.data.images import Paths

    if not Path("/proc/self/smaps_rollup").is_file():
        print("paths: skipped (needs Linux's /proc/PID/smaps_rollup)")
        return
    n = int(1_281_167 * scale)
    names = [f"train/n{i % 1000:08d}/n{i % 1000:08d}_{i:08d}.JPEG" for i in range(n)]
    makers = (("list of Path", lambda: [Path(s) for s in names]), ("list of str", lambda: list(names)),
              ("Strings", lambda: Paths(names)))
    for kind, make in makers:  # one table alive at a time (a forked worker's gc touches every live object)
        table = make()

        class Reads(Dataset):
            def __len__(self) -> int:
                return 32

            def __getitem__(self, step: int) -> torch.Tensor:
                picks = np.random.default_rng(step).integers(0, n, n // 32)
                total = sum(len(str(table[int(i)])) for i in picks)
                return torch.tensor([total, os.getpid()])

        pids = set()
        loader = DataLoader(Reads(), batch_size=None, num_workers=2, persistent_workers=True,
                            multiprocessing_context="fork")
        for _ in range(2):
            pids.update(int(b[1]) for b in loader)
        sizes = [_private_mb(pid) for pid in sorted(pids)]
        del loader, table
        print(f"paths: {n:,} names as {kind}: {', '.join(f'{s:.0f}' for s in sizes)} MB private per worker")


def check_samplers() -> None:
    from owai.data.camelyon17 import StandardSampler

    for n in (302_436, 1_281_167):
        sampler = StandardSampler(n, 32, 0, "train")
        sampler.positions(0)
        t0 = time.perf_counter()
        for step in range(1, 201):
            sampler.positions(step)
        print(f"samplers: StandardSampler over {n:,}: {(time.perf_counter() - t0) / 200 * 1e3:.3f} ms a step")


def check_camelyon(work: Path, scale: float) -> None:
    from owai.data.camelyon17 import Camelyon17

    n = int(455_954 * scale)
    base = work / "camelyon" / "camelyon17_v1.0"
    if not (base / "metadata.csv").is_file():
        base.mkdir(parents=True, exist_ok=True)
        rows = []
        for i in range(n):
            c, node = i % 5, i % 5
            p, x, y = 10 * c + (i // 5) % 10, 100 * (i // 50), 7 * (i % 50)
            rows.append([i, f"{p:03d}", node, x, y, i % 2, 10 * c + node, c, int(i % 10 == 0)])
            folder = base / "patches" / f"patient_{p:03d}_node_{node}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"patch_patient_{p:03d}_node_{node}_x_{x}_y_{y}.png").touch()
        with open(base / "metadata.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["", "patient", "node", "x_coord", "y_coord", "tumor", "slide", "center", "split"])
            writer.writerows(rows)
        del rows
    import gc

    gc.collect()
    reset_peak()
    before = rss_mb()
    t0 = time.perf_counter()
    data = Camelyon17(work / "camelyon")
    print(f"camelyon: metadata of {len(data):,} patches read in {time.perf_counter() - t0:.1f} s, "
          f"peak RSS {rss_mb():.0f} MB (before {before:.0f} MB)")


def main() -> int:
    parser = ArgumentParser(prog="data_scale.py", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the generated sizes")
    parser.add_argument("--dir", default="", help="where to generate the data (kept)")
    args = parser.parse_args()
    only = [c for c in args.only.split(",") if c]
    bad = [c for c in only if c not in CHECKS]
    if bad:
        fail(f"--only {','.join(bad)}: choose from {', '.join(CHECKS)}")
    if not 0 < args.scale <= 10:
        fail(f"--scale must be in (0, 10], got {args.scale}")
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="owai-data-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        for check in only:
            if check == "tar":
                check_tar(work, args.scale)
            elif check == "windows":
                check_windows(work, args.scale)
            elif check == "paths":
                check_paths(args.scale)
            elif check == "samplers":
                check_samplers()
            else:
                check_camelyon(work, args.scale)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
