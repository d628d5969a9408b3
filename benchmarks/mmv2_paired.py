"""Benchmark: is this checkout's Memory Mosaics v2 training step slower on the CPU than an earlier
revision's? Both run in one process, with steps alternating, so the machine's load changes both alike
(issue #39's "no CPU regression, paired ratio in one run").

    python benchmarks/mmv2_paired.py --before acd097d                       # 8 x 512, 40 rounds
    python benchmarks/mmv2_paired.py --before acd097d --documents           # packed documents
    python benchmarks/mmv2_paired.py --before acd097d --batch 1 --context 4096 --rounds 8
    python benchmarks/mmv2_paired.py --before acd097d --control             # A/A: the revision against itself
    python benchmarks/mmv2_paired.py --before 8c32a6d --scan compiled       # both with scan_impl compiled (CUDA's path)

The earlier revision's `owai` package is extracted with `git archive` into a temporary folder and
renamed `owai_before` (its own imports rewritten to match), so both import side by side. Both tiny
models are built with seed 0 and must start with equal parameters; their first losses are printed.
Each round runs one AdamW step of each on the same batch, the order flipping every round. Prints
the median step of each and the median of the per-round ratios after / before (1.0: as fast; the
`--control` run shows the machine's own spread). Asserts nothing but the equal start.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's owai, before any installed copy


def extract_revision(ref: str, into: Path) -> None:
    """`owai/` of git revision `ref` as the package `owai_before` under `into`."""
    done = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "owai"], capture_output=True)
    if done.returncode != 0:
        print(f"error: git archive of {ref!r} failed: {done.stderr.decode().strip()}", file=sys.stderr)
        raise SystemExit(2)
    archive = done.stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "owai").rename(into / "owai_before")
    for path in (into / "owai_before").rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\b(from|import) owai\b", r"\1 owai_before", text)
        path.write_text(re.sub(r'"owai\.', '"owai_before.', text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the earlier git revision (commit, tag, branch)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--documents", action="store_true", help="packed documents (as benchmarks/mmv2.py throughput)")
    parser.add_argument("--doc-mean", type=int, default=256, help="mean document length with --documents")
    parser.add_argument("--control", action="store_true", help="A/A: both models from --before")
    parser.add_argument("--scan", default="auto", choices=["auto", "chunked", "compiled"],
                        help="both models' scan_impl (auto: the CPU default, eager)")
    args = parser.parse_args()

    import torch

    from mmv2 import packed_positions, train_step_seconds  # benchmarks/mmv2.py, beside this file
    from owai.models.lm import build_sized_lm

    scratch = tempfile.TemporaryDirectory(prefix="owai-before-")
    extract_revision(args.before, Path(scratch.name))
    sys.path.insert(0, scratch.name)
    from owai_before.models.lm import build_sized_lm as build_before

    def make(builder):
        torch.manual_seed(0)
        model = builder("mmv2", "tiny", vocab_size=4096, scan_impl=args.scan).train()
        model.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return model

    models = {"before": make(build_before), "after": make(build_before if args.control else build_sized_lm)}
    first, second = (m.state_dict() for m in models.values())
    if first.keys() != second.keys() or not all(torch.equal(first[k], second[k]) for k in first):
        raise SystemExit("error: the two revisions' models do not start from equal parameters")
    torch.manual_seed(1)
    x = torch.randint(0, 4096, (args.batch, args.context))
    pos = packed_positions(args.batch, args.context, args.doc_mean) if args.documents else None
    docs = f", packed documents (mean {args.doc_mean})" if args.documents else ""
    after = f"{args.before} (A/A control)" if args.control else "this checkout"
    print(f"tiny v2 training steps, batch {args.batch} x {args.context}{docs}, scan_impl {args.scan}, cpu: before = {args.before}, "
          f"after = {after}, {args.rounds} alternating rounds")
    for name, model in models.items():
        with torch.no_grad():
            logits = model(input_ids=x, position_ids=pos, long_delay=128).logits
        loss = torch.nn.functional.cross_entropy(logits.float()[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        print(f"  {name}: first loss {loss.item():.8f}")
        train_step_seconds(model, x, pos, True)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in models}
    ratios = []
    for r in range(args.rounds):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            times[name].append(train_step_seconds(models[name], x, pos, True))
        ratios.append(times["after"][-1] / times["before"][-1])
    for name, seconds in times.items():
        print(f"  {name:6s} median step {statistics.median(seconds):.3f} s "
              f"({args.batch * args.context / statistics.median(seconds):.0f} tokens/s)")
    print(f"  after / before, median of the paired rounds: {statistics.median(ratios):.3f} "
          f"(rounds: {' '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
