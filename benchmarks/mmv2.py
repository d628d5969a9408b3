"""Benchmark: Memory Mosaics v2 against the Llama transformer at the same size (issue #22's targets).

    python benchmarks/mmv2.py memory                  # peak memory of a forward at 8k and 32k tokens, batch 1
    python benchmarks/mmv2.py throughput              # training tokens/s, v2 and transformer, rounds interleaved
    python benchmarks/mmv2.py throughput --compile    # the same with torch.compile per block (train.compile)
    python benchmarks/mmv2.py generation              # cached generation time per token at growing contexts
    python benchmarks/mmv2.py all --device cuda       # the same on a GPU (bf16)

Prints figures, asserts nothing. Targets: forward memory growing at most 4.5x from 8k to 32k
tokens (linear is 4x: nothing T x T); v2 training at least 0.8x the transformer's tokens/s at the
same size; time per generated token flat in the context length. The bag-of-k loss's memory is
`benchmarks/bag_of_k_memory.py`.

Each memory measurement runs in a fresh subprocess, so the peak (CUDA allocator peak, or the peak
resident set size on CPU minus the size after building the model and its input) belongs to one
length only. Sizes are owai.models.sizes' (tiny by default: 4 layers, d 256; vocabulary 4096 as in
the cpu preset of recipe table4.2-pretrain).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def build(arch: str, size: str, vocab: int, device: str, **extra):
    import torch

    from owai.models.lm import build_sized_lm

    torch.manual_seed(0)
    return build_sized_lm(arch, size, vocab_size=vocab, **extra).to(device)


def forward_memory(arch: str, size: str, vocab: int, length: int, device: str) -> dict:
    """One forward of `length` tokens (batch 1, no gradient, last position's logits only)."""
    import torch

    model = build(arch, size, vocab, device).eval()
    x = torch.randint(0, vocab, (1, length), device=device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**30
    else:
        base = rss_gb()
    start = time.perf_counter()
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        model(input_ids=x, logits_to_keep=1)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else rss_gb()
    return {"arch": arch, "length": length, "peak_gb": peak - base, "seconds": seconds}


def in_subprocess(fn: str, **kwargs) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import mmv2; "
            f"print(json.dumps(mmv2.{fn}(**{kwargs!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory(args) -> None:
    print(f"forward peak memory, batch 1, {args.size} models, {args.device} (no gradient, last logits only)")
    for arch in args.archs:
        rows = [in_subprocess("forward_memory", arch=arch, size=args.size, vocab=args.vocab, length=n, device=args.device)
                for n in args.lengths]
        for r in rows:
            print(f"  {arch:12s} T={r['length']:6d}  peak {r['peak_gb'] * 1024:8.1f} MiB  {r['seconds']:6.1f} s")
        print(f"  {arch:12s} growth {args.lengths[0]} -> {args.lengths[-1]} tokens: "
              f"{rows[-1]['peak_gb'] / max(rows[0]['peak_gb'], 1e-9):.2f}x (linear: {args.lengths[-1] / args.lengths[0]:.1f}x)")


def train_step_seconds(model, x, delay: bool) -> float:
    import torch
    import torch.nn.functional as F

    start = time.perf_counter()
    extra = {"long_delay": 128} if delay else {}
    logits = model(input_ids=x, **extra).logits
    F.cross_entropy(logits.float()[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
    model.optimizer.step()
    model.optimizer.zero_grad(set_to_none=True)
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def throughput(args) -> None:
    """Training steps of v2 and the transformer alternating in one process (the machine's load
    changes both alike), after one warm-up step each; median seconds per step per architecture."""
    import torch

    from owai.distributed import Parallel
    from owai.models.lm import blocks

    models = {}
    for arch in ("mmv2", "transformer"):
        model = build(arch, args.size, args.vocab, args.device).train()
        model.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if args.compile:  # the trainer's train.compile: torch.compile per block
            Parallel(model, blocks=blocks(model), compile_blocks=True)
        models[arch] = model
    x = torch.randint(0, args.vocab, (args.batch, args.context), device=args.device)
    times: dict[str, list[float]] = {a: [] for a in models}
    with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
        for arch, model in models.items():
            for _ in range(2 if args.compile else 1):  # warm-up (and compilation)
                train_step_seconds(model, x, arch == "mmv2")
        for _ in range(args.rounds):
            for arch, model in models.items():
                times[arch].append(train_step_seconds(model, x, arch == "mmv2"))
    tokens = args.batch * args.context
    print(f"training tokens/s, {args.size} models, batch {args.batch} x {args.context}, {args.device}, "
          f"{'compiled blocks' if args.compile else 'eager'}, {args.rounds} interleaved rounds (median)")
    speed = {a: tokens / statistics.median(t) for a, t in times.items()}
    for arch, model in models.items():
        print(f"  {arch:12s} {sum(p.numel() for p in model.parameters()) / 1e6:6.2f}M parameters  "
              f"{speed[arch]:9.0f} tokens/s  (step {statistics.median(times[arch]):.3f} s)")
    print(f"  ratio v2 / transformer: {speed['mmv2'] / speed['transformer']:.2f}x")


def generation(args) -> None:
    """Prefill a context of n tokens, then time `--new` single-token steps with the cache."""
    import torch

    from owai.models.hf_cache import cache_kwargs, output_cache

    print(f"cached generation, {args.size} models, batch 1, {args.device}: seconds per new token after n context tokens")
    for arch in args.archs:
        model = build(arch, args.size, args.vocab, args.device).eval()
        for n in args.contexts:
            x = torch.randint(0, args.vocab, (1, n), device=args.device)
            with torch.no_grad(), torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
                out = model(input_ids=x, use_cache=True, logits_to_keep=1)
                cache, token = output_cache(out), out.logits[:, -1:].argmax(-1)
                start = time.perf_counter()
                for _ in range(args.new):
                    out = model(input_ids=token, use_cache=True, **cache_kwargs(cache))
                    token = out.logits[:, -1:].argmax(-1)
                if args.device == "cuda":
                    torch.cuda.synchronize()
            per = (time.perf_counter() - start) / args.new
            print(f"  {arch:12s} n={n:6d}  {per * 1000:7.2f} ms/token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["memory", "throughput", "generation", "all"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--archs", nargs="+", default=["mmv2", "transformer"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="throughput: torch.compile each block (train.compile)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    for what in (["memory", "throughput", "generation"] if args.what == "all" else [args.what]):
        globals()[what](args)


if __name__ == "__main__":
    main()
