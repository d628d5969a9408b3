"""Benchmark: is this checkout's Memory Mosaics v2 training step slower on the CPU than an earlier
revision's? Both run in one process, with steps alternating, so the machine's load changes both alike
(issue #39's "no CPU regression, paired ratio in one run").

    python benchmarks/mmv2_paired.py --before acd097d                       # 8 x 512, 40 rounds
    python benchmarks/mmv2_paired.py --before acd097d --documents           # packed documents
    python benchmarks/mmv2_paired.py --before acd097d --batch 1 --context 4096 --rounds 8
    python benchmarks/mmv2_paired.py --before acd097d --control             # A/A: the revision against itself
    python benchmarks/mmv2_paired.py --before 8c32a6d --scan compiled       # both with scan_impl compiled (CUDA's path)
    python benchmarks/mmv2_paired.py --before 57d34e2 --numerics --documents # the same function? (no timing)

The earlier revision's `owai` package is extracted with `git archive` into a temporary folder and
renamed `owai_before` (its own imports rewritten to match), so both import side by side. Both tiny
models are built with seed 0 and must start with equal parameters; their first losses are printed.
Each round runs one AdamW step of each on the same batch, the order flipping every round. Prints
the median step of each and the median of the per-round ratios after / before (1.0: as fast; the
`--control` run shows the machine's own spread). Asserts nothing but the equal start.

`--numerics` times nothing: it asks whether a change kept the function. Each revision computes, in
float32 on the same inputs, a training forward's loss and logits and every parameter's gradient, then
in eval mode a prefill of half the context, a continuation of a quarter, and 10 one-token decoding
steps (one document per row; the dynamic cache, as on the CPU). Printed: how many of those tensors
are bit-identical, and the largest difference of each kind, max |after - before| / max |before|.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's owai, before any installed copy

from _args import ArgumentParser, fail, positive  # noqa: E402  (benchmarks/, beside this script)

DECODE_STEPS = 10  # --numerics: the decoding steps after the prefill and the continuation
NUMERICS_MIN_CONTEXT = 4 * DECODE_STEPS  # the steps fit after T/2 + T/4 tokens


def extract_revision(ref: str, into: Path) -> None:
    """`owai/` of git revision `ref` as the package `owai_before` under `into`."""
    done = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "owai"], capture_output=True)
    if done.returncode != 0:
        fail(f"git archive of {ref!r} failed: {done.stderr.decode().strip()}")
    archive = done.stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "owai").rename(into / "owai_before")
    for path in (into / "owai_before").rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\b(from|import) owai\b", r"\1 owai_before", text)
        path.write_text(re.sub(r'"owai\.', '"owai_before.', text))


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the earlier git revision (commit, tag, branch)")
    parser.add_argument("--batch", type=positive, default=8)
    parser.add_argument("--context", type=positive, default=512)
    parser.add_argument("--rounds", type=positive, default=40)
    parser.add_argument("--documents", action="store_true", help="packed documents (as benchmarks/mmv2.py throughput)")
    parser.add_argument("--doc-mean", type=positive, default=256, help="mean document length with --documents")
    parser.add_argument("--control", action="store_true", help="A/A: both models from --before")
    parser.add_argument("--scan", default="auto", choices=["auto", "chunked", "compiled"],
                        help="both models' scan_impl (auto: the CPU default, eager)")
    parser.add_argument("--numerics", action="store_true", help="compare the two revisions' tensors instead of timing")
    args = parser.parse_args()
    if args.numerics and args.context < NUMERICS_MIN_CONTEXT:
        fail(f"--numerics compares a prefill, a continuation and {DECODE_STEPS} decoding steps inside one window: --context must be at least {NUMERICS_MIN_CONTEXT}, got {args.context}")

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
    setting = f"batch {args.batch} x {args.context}{docs}, scan_impl {args.scan}, cpu: before = {args.before}, after = {after}"
    if args.numerics:
        print(f"tiny v2, float32, {setting}")
        compare({name: tensors_of(model, x, pos) for name, model in models.items()})
        return
    print(f"tiny v2 training steps, {setting}, {args.rounds} alternating rounds")
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


def tensors_of(model, x, pos, delay: int = 64, steps: int = DECODE_STEPS) -> dict[str, "torch.Tensor"]:
    """A model's float32 tensors on x (B, T): training loss, logits and gradients; then the logits
    of a prefill (T/2), a continuation (T/4) and `steps` decoding steps, on its own cache."""
    import torch

    cache_class = sys.modules[type(model).__module__].MemoryMosaicsV2Cache  # the revision's own
    model.train()
    out = model(input_ids=x, position_ids=pos, labels=x, long_delay=delay)
    out.loss.backward()
    tensors = {"loss": out.loss.detach(), "logits": out.logits.detach()}
    tensors |= {f"grad {name}": p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.eval()
    T = x.shape[1]
    prefill, continuation = T // 2, T // 4
    cache = cache_class()
    with torch.no_grad():
        tensors["prefill"] = model(input_ids=x[:, :prefill], past_key_values=cache, use_cache=True).logits
        at = prefill + continuation
        tensors["continuation"] = model(input_ids=x[:, prefill:at], past_key_values=cache, use_cache=True).logits
        for t in range(steps):
            tensors[f"step {t}"] = model(input_ids=x[:, at + t:at + t + 1], past_key_values=cache, use_cache=True).logits
    return tensors


def compare(runs: dict[str, dict[str, "torch.Tensor"]]) -> None:
    """Print how many tensors the two revisions share bit for bit, and the largest relative difference
    of each kind (loss and logits, gradients, cached logits)."""
    before, after = runs["before"], runs["after"]
    if before.keys() != after.keys():
        raise SystemExit(f"error: the revisions computed different tensors: {sorted(before.keys() ^ after.keys())}")
    if any(before[k].shape != after[k].shape for k in before):
        raise SystemExit(f"error: tensors of different shapes: {[k for k in before if before[k].shape != after[k].shape]}")
    same = sum(bool((before[k] == after[k]).all()) for k in before)
    print(f"  bit-identical: {same} of {len(before)} tensors")
    kinds = {"training loss and logits": ("loss", "logits"), "gradients": ("grad ",),
             "cached logits (prefill, continuation, steps)": ("prefill", "continuation", "step ")}
    for kind, prefixes in kinds.items():
        worst = max(((after[k] - before[k]).abs().max().item() / max(before[k].abs().max().item(), 1e-30), k)
                    for k in before if k.startswith(prefixes))
        print(f"  {kind}: " + (f"largest difference {worst[0]:.2e} relative ({worst[1]})" if worst[0] else "bit-identical"))


if __name__ == "__main__":
    main()
