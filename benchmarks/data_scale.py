"""Benchmark: the data pipeline at the paper's scale, on generated data (CPU only; docs/results.md).

    python benchmarks/data_scale.py [--only tar,windows,paths,samplers,camelyon,prefetch] [--scale 1.0] [--dir DIR]

Prints, per check, the measured figures and what they mean at the paper's size:
  tar       reading a .tar.gz of documents stored out of name order (sotu.tar.gz is), 1,000 and 4,000
            members (O(N^2) before the fix: 1.7 s and 25 s on the quiet 2-core machine)
  windows   TokenWindows random batches over a 10^9-token uint16 file (2 GB, written once under
            --dir), and offsets past 2^31 on a sparse 2.5 x 10^9-token file
  paths     private memory of forked DataLoader workers reading ImageNet's 1.28M file names as a list
            of Path, a list of str, and owai's `Strings`
  samplers  ms per step of Camelyon17's StandardSampler at 302k / 1.28M examples
  camelyon  peak RSS and time of reading a 455,954-row metadata.csv (+ empty patch files)
  prefetch  the time a training step waits for its packed-stream batch (owai.data.packing) with the
            stream read in the loop (`data.prefetch=0`) and through the prefetch thread (the default
            depth), for a step that waits as on a GPU (the main thread idle, GIL released), one that
            spends a quarter of it in Python (holding the GIL, as kernel launches do), and one that
            computes on this CPU (torch matrix products, a fixed amount of work), the data's share
            set to 10 % of the step as measured for `paper-small`; and whether the batches are identical.
            GPT-2's tokenizer from $OWAI_DATA/tokenizers/gpt2 (else `bytes`), 1024-token rows, 4 per
            rank, 8 ranks' worth tokenized (every rank tokenizes the global batch); 3 rounds, the depths
            alternating, medians
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
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from _args import ArgumentParser, fail

CHECKS = ("tar", "windows", "paths", "samplers", "camelyon", "prefetch")


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
            def __init__(self, table) -> None:
                self.table = table

            def __len__(self) -> int:
                return 32

            def __getitem__(self, step: int) -> torch.Tensor:
                picks = np.random.default_rng(step).integers(0, n, n // 32)
                total = sum(len(str(self.table[int(i)])) for i in picks)
                return torch.tensor([total, os.getpid()])

        pids = set()
        loader = DataLoader(Reads(table), batch_size=None, num_workers=2, persistent_workers=True,
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


def _prefetch_corpus(work: Path, scale: float) -> Path:
    """A jsonl corpus of generated English-like documents of 200-1,500 words (about 15 MB at scale 1)."""
    import json

    path = work / f"prefetch-docs-{scale:g}.jsonl"
    if not path.is_file():
        words = ("the of and to in a is that for it as was with be by on not he this are or his from at which "
                 "but have an they you were her she there one all we their been has when who will more no if out "
                 "so said what up its about into than them can only other new some could time these two may then "
                 "first any like now my such make over our even most me state after also made many did must before "
                 "back see through way where get much go well your know should down work year because come people").split()
        rng = random.Random(0)
        with open(path, "w") as f:
            for _ in range(max(50, int(3000 * scale))):
                text = " ".join(rng.choice(words) for _ in range(rng.randint(200, 1500)))
                f.write(json.dumps({"text": text[0].upper() + text[1:] + "."}) + "\n")
    return path


def _products(n: int) -> None:
    """CPU work of a fixed size: torch matrix products on all of torch's threads (a CPU training step)."""
    import torch

    a = torch.ones(384, 384)
    for _ in range(n):
        a = torch.mm(a, a).clamp_(max=1.0)


def _python(n: int) -> None:
    """Python work of a fixed size, holding the GIL (a training step's Python: module calls, kernel launches)."""
    total = 0
    for i in range(n * 1000):
        total += i


def _sized(work: Any, seconds: float) -> int:
    """The size n for which `work(n)` takes about `seconds` here (the median of five timings)."""
    n = 8
    work(n)  # a warm-up (thread pools start, caches fill)
    typical = statistics.median(_timed(work, n) for _ in range(5))
    return max(1, round(n * seconds / typical))


def _timed(work: Any, n: int) -> float:
    t0 = time.perf_counter()
    work(n)
    return time.perf_counter() - t0


def check_prefetch(work: Path, scale: float) -> None:
    import hashlib

    from owai.data.packing import PREFETCH_DEPTH, PackedStream, Prefetcher
    from owai.data.text import load_tokenizer
    from owai.errors import OwaiError

    corpus = _prefetch_corpus(work, scale)
    try:
        tokenizer = load_tokenizer("tokenizers/gpt2")
    except OwaiError:
        tokenizer = load_tokenizer("bytes")
    T, B, W = 1024, 4, 8
    steps = max(8, int(15 * scale))

    def stream() -> PackedStream:
        return PackedStream(corpus, tokenizer, T, rank=0, world_size=W)

    alone = stream()
    alone.next_batch(B)
    data_s = _timed(lambda n: [alone.next_batch(B) for _ in range(n)], 10) / 10  # a mean: documents come 64 at a time
    model_s = 9 * data_s  # the data is 10 % of a step read in the loop (paper-small: ~0.35 s of ~3.7 s)
    launch = _sized(_python, model_s / 4)
    products = _sized(_products, model_s)
    print(f"prefetch: tokenizer {tokenizer.name}, {B * W} rows x {T} tokens tokenized a step: "
          f"{data_s * 1e3:.0f} ms alone ({B * W * T / data_s / 1e6:.2f}M tokens/s); model step {model_s * 1e3:.0f} ms")
    steps_of = {
        "GPU (CPU idle)": lambda: time.sleep(model_s),
        "GPU (1/4 of it Python)": lambda: (_python(launch), time.sleep(model_s * 3 / 4)),
        "CPU (torch on every core)": lambda: _products(products),
    }
    for kind, compute in steps_of.items():
        digests: dict[int, set[str]] = {0: set(), PREFETCH_DEPTH: set()}
        figures: dict[int, list[tuple[float, float]]] = {0: [], PREFETCH_DEPTH: []}
        for _ in range(3):  # rounds, the two depths alternating (paired: the machine's load drifts)
            for depth in (0, PREFETCH_DEPTH):
                digest = hashlib.sha256()
                with Prefetcher(stream(), B, depth) as batches:
                    batches.next_batch()  # the first batch (the thread's start) is not counted
                    compute()
                    batches.wait_s, t0 = 0.0, time.perf_counter()
                    for _ in range(steps):
                        digest.update(batches.next_batch()["input_ids"].numpy().tobytes())
                        compute()
                    figures[depth].append((batches.wait_s / steps, (time.perf_counter() - t0) / steps))
                digests[depth].add(digest.hexdigest())
        for depth, rows in figures.items():
            wait_s = statistics.median(w for w, _ in rows)
            step_s = statistics.median(s for _, s in rows)
            print(f"prefetch: {kind} step, depth {depth}: waits {wait_s * 1e3:.1f} ms a step for data "
                  f"({wait_s / step_s:.1%} of the step), {step_s * 1e3:.0f} ms a step (medians of 3 rounds of {steps} steps; "
                  f"steps {', '.join(f'{s * 1e3:.0f}' for _, s in rows)} ms)")
        same = len(digests[0]) == 1 and digests[0] == digests[PREFETCH_DEPTH]
        print(f"prefetch: {kind}: batches identical with and without the thread: {same}")


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
            elif check == "prefetch":
                check_prefetch(work, args.scale)
            else:
                check_camelyon(work, args.scale)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
