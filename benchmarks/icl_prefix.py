"""Benchmark: one in-context prompt set generated with and without the shared prefix's cache.

    python benchmarks/icl_prefix.py                        # CPU: banking77 1-shot (~6k byte tokens), 32 queries, owai's GPT
    python benchmarks/icl_prefix.py --arch mmv2 --batch 1,4
    python benchmarks/icl_prefix.py --device cuda --arch transformer --width 1024 --layers 8 --shots 10 --tokenizer gpt2

`owai eval icl` builds every query of a prompt set (label mode, shot count, strategy) as the same
demonstrations followed by the query; `CausalLM.shared_prefix` prefills the prompts' common token
prefix once and continues every query from a copy of its cache. This times `generate_all` over one
prompt set (the first `--queries` queries, newline-fixed strategy, semantic labels, greedy, the
method's 32 new tokens) for each batch size, without the cache ("whole") and with it ("prefix"), on a
random model of the given architecture (the work is that of a trained one: no end-of-text stops it
early), checks that both give the same answers, and prints seconds, prompt tokens per second and the
peak memory of each measurement: the peak resident set size on CPU, the CUDA allocator's peak on a
GPU, minus the process's after building the model and the prompts (each in a fresh process).
The prompts come from $OWAI_DATA/icl/banking77 when it is there, else from the synthetic task of
the same size (`--task synthetic`). Prints figures, asserts nothing but the answers' equality.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from _args import ArgumentParser, at_least, check_device, fail, positive  # benchmarks/, beside this script

ARCHS = ("gpt", "transformer", "mmv2", "mm")


def model_and_prompts(args: argparse.Namespace):
    """A random CausalLM of `args.arch` and the prompt set's prompts."""
    import torch

    from owai.data.text import load_tokenizer
    from owai.evals import longicl
    from owai.evals.causal_lm import CausalLM
    from owai.methods.icl_eval import Config, load_task
    from owai.models.lm import build_lm

    task = args.task
    if task == "banking77" and not os.environ.get("OWAI_DATA"):
        task = "synthetic"
    data = load_task(Config(task=task, synthetic_classes=77))
    shots = longicl.select_demonstrations(data, args.shots)
    queries = longicl.select_queries(data, args.queries)
    options = longicl.PromptOptions()
    context = longicl.render_context(data, shots, options)
    prompts = [context + longicl.render_query(data, q, options) for q in queries]
    tokenizer = load_tokenizer(args.tokenizer)
    torch.manual_seed(0)
    heads = max(1, args.width // 64)
    shapes = {"gpt": dict(n_head=heads, position="rope"), "mm": dict(n_head=heads, leaky_chunk=64),
              "mmv2": dict(n_head=heads, ffn_hidden=4 * args.width), "transformer": dict(n_head=heads, ffn_hidden=4 * args.width)}
    model = build_lm(args.arch, vocab_size=tokenizer.vocab_size, n_layer=args.layers, n_embd=args.width, **shapes[args.arch])
    lm = CausalLM(model, tokenizer, args.arch, torch.device(args.device), "auto")
    return lm, prompts, data.name


def peak_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(args: argparse.Namespace, batch: int, prefix: bool) -> dict:
    """One prompt set through `generate_all`: seconds, answers, peak memory over the set."""
    import torch

    from owai.evals.causal_lm import generate_all

    lm, prompts, name = model_and_prompts(args)
    lm.batch_size = batch
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = peak_bytes(args.device)
    started = time.perf_counter()
    if prefix:
        with lm.shared_prefix(prompts):
            answers = generate_all(lm, prompts, max_new_tokens=args.new_tokens)
            shared = lm.shared.length
    else:
        answers = generate_all(lm, prompts, max_new_tokens=args.new_tokens)
        shared = 0
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = sum(len(lm.prompt_ids(p)) for p in prompts)
    return {"seconds": seconds, "answers": answers, "peak_gb": (peak_bytes(args.device) - before) / 2**30,
            "tokens": tokens, "shared": shared, "data": name, "longest": max(len(lm.prompt_ids(p)) for p in prompts)}


def main() -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--arch", default="gpt", choices=ARCHS)
    parser.add_argument("--layers", type=positive, default=2)
    parser.add_argument("--width", type=at_least(64), default=128)
    parser.add_argument("--task", default="banking77", choices=("banking77", "synthetic"))
    parser.add_argument("--shots", type=positive, default=1, help="shots of the prompt set (banking77: 77 demonstrations each)")
    parser.add_argument("--queries", type=positive, default=32)
    parser.add_argument("--new-tokens", type=positive, default=32)
    parser.add_argument("--tokenizer", default="bytes", help="bytes (offline) or a tokenizer owai loads (gpt2)")
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes (owai eval icl's batch_size)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_device(args.device)
    if args.one:
        batch, prefix = json.loads(args.one)
        print(json.dumps(measure(args, batch, prefix)))
        return 0
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        fail(f"--batch {args.batch!r}: give comma-separated batch sizes")
    if any(b < 1 for b in batches):
        fail(f"--batch {args.batch!r}: batch sizes are >= 1")
    rows = []
    for batch in batches:
        for prefix in (False, True):
            argv = [a for a in sys.argv[1:]]
            proc = subprocess.run([sys.executable, __file__, *argv, "--one", json.dumps([batch, prefix])],
                                  capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr[-2000:], file=sys.stderr)
                return proc.returncode
            rows.append((batch, prefix, json.loads(proc.stdout.strip().splitlines()[-1])))
    first = rows[0][2]
    print(f"{first['data']}, {args.shots} shot(s), {args.queries} queries, longest prompt {first['longest']} tokens "
          f"({args.tokenizer}), shared prefix {rows[1][2]['shared']} tokens; {args.arch} {args.layers}x{args.width}, "
          f"{args.new_tokens} new tokens, {args.device}")
    print(f"{'batch':>5} {'prefill':>7} {'seconds':>8} {'prompt tok/s':>12} {'peak GB':>8} {'same answers':>12}")
    for batch, prefix, r in rows:
        same = r["answers"] == first["answers"]
        print(f"{batch:5d} {'prefix' if prefix else 'whole':>7} {r['seconds']:8.2f} {r['tokens'] / r['seconds']:12.0f} "
              f"{r['peak_gb']:8.2f} {str(same):>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
