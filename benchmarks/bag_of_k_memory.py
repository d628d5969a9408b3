"""Benchmark: peak memory and time of the bag-of-k loss (MM v2, thesis §4.2.5.1), forward + backward.

    python benchmarks/bag_of_k_memory.py                                   # 4096 positions, vocab 50304, k 64
    python benchmarks/bag_of_k_memory.py --positions 1024                  # a size a 2-core CPU runs in about a minute
    python benchmarks/bag_of_k_memory.py --positions 256 --vocab 8192 --k 16   # small enough for the one-hot variant
    python benchmarks/bag_of_k_memory.py --device cuda --dtype bfloat16

Variants, all on random logits h (positions, vocab) with requires_grad and random bags (positions, k):
- custom:   `owai.models.bag_of_k.bag_of_k_loss` (one autograd node, saves only h and the bags,
            closed-form chunked backward);
- autograd: the second (softplus) form in plain autograd, with gathers, as one would write it
            without a custom Function;
- onehot:   the first (log-sigmoid) form in plain autograd with a (positions x k x vocab) one-hot;
            skipped with a message when its estimated size does not fit in half the free memory.

Prints a table, asserts nothing. Each variant runs in a fresh subprocess so that its peak belongs to
it alone: the CUDA allocator peak, or on CPU the peak resident set size (ru_maxrss), minus the
process's size once the inputs exist. The peak includes h.grad (one positions x vocab tensor in h's
dtype), which every variant must produce. "saved" is what autograd keeps between forward and
backward (distinct storages packed by saved_tensors_hooks). Time is the median of --repeats
forward + backward passes after the measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from _args import ArgumentParser, at_least, check_device, positive  # benchmarks/, beside this script

VARIANTS = ("custom", "autograd", "onehot")


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux: KiB


def free_bytes(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def onehot_bytes(positions: int, vocab: int, k: int, elem: int) -> int:
    """Rough peak of the one-hot variant: about five (positions, k, vocab) tensors alive at once."""
    return 5 * positions * k * vocab * elem


def loss_fn(variant: str, eta: float):
    import torch.nn.functional as F

    from owai.models.bag_of_k import bag_of_k_loss

    def custom(h, bags, valid):
        return bag_of_k_loss(h, bags, valid, eta)

    def autograd(h, bags, valid):  # the second form, plain autograd
        v, k = h.shape[-1], bags.shape[-1]
        hf = h[valid].float()  # (n, v)
        hb = hf.gather(1, bags[valid])  # (n, k)
        per = k * F.softplus(hf).sum(-1) + ((eta - 1) * F.softplus(hb) - eta * hb).sum(-1)  # (n,)
        return per.mean() / (k * v)

    def onehot(h, bags, valid):  # the first form, plain autograd, (n, k, v) one-hot
        v = h.shape[-1]
        hf = h[valid].float()  # (n, v)
        hot = F.one_hot(bags[valid], v).float()  # (n, k, v)
        per = -eta * hot * F.logsigmoid(hf)[:, None, :] - (1 - hot) * F.logsigmoid(-hf)[:, None, :]  # (n, k, v)
        return per.sum(-1).mean(-1).mean() / v

    return {"custom": custom, "autograd": autograd, "onehot": onehot}[variant]


def measure(variant: str, positions: int, vocab: int, k: int, eta: float, dtype: str, device: str, repeats: int) -> dict:
    """One variant, in this process."""
    import torch

    torch.manual_seed(0)
    g = torch.Generator(device).manual_seed(0)
    h = torch.randn(positions, vocab, generator=g, device=device, dtype=getattr(torch, dtype)).requires_grad_()
    bags = torch.randint(0, vocab, (positions, k), generator=g, device=device)
    valid = torch.ones(positions, dtype=torch.bool, device=device)
    fn = loss_fn(variant, eta)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = rss_mib()

    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(h, bags, valid)
    loss.backward()
    sync()
    first = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mib()) - base
    value = loss.item()
    del loss
    times = []
    for _ in range(repeats):
        h.grad = None
        sync()
        start = time.perf_counter()
        fn(h, bags, valid).backward()
        sync()
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2] if times else first
    return {"variant": variant, "peak_mib": peak, "saved_mib": sum(saved.values()) / 2**20, "seconds": seconds, "loss": value}


def run_one(args: argparse.Namespace, variant: str) -> dict:
    cmd = [sys.executable, __file__, "--variant", variant, "--positions", str(args.positions), "--vocab", str(args.vocab),
           "--k", str(args.k), "--eta", str(args.eta), "--dtype", args.dtype, "--device", args.device,
           "--repeats", str(args.repeats)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's owai, installed or not
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"variant": variant, "error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=positive, default=4096, help="rows N = batch x T (all valid)")
    parser.add_argument("--vocab", type=positive, default=50304)
    parser.add_argument("--k", type=positive, default=64)
    parser.add_argument("--eta", type=float, default=64000.0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=at_least(0), default=2, help="timed passes after the measured one")
    parser.add_argument("--variant", choices=VARIANTS, help="run one variant in this process and print JSON")
    args = parser.parse_args()
    check_device(args.device)
    if args.variant:
        r = measure(args.variant, args.positions, args.vocab, args.k, args.eta, args.dtype, args.device, args.repeats)
        print(json.dumps(r))
        return 0

    import torch

    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    logits_mib = args.positions * args.vocab * elem / 2**20
    print(f"device {args.device}, {args.positions} positions x vocab {args.vocab}, k {args.k}, eta {args.eta:g}, "
          f"{args.dtype} logits ({logits_mib:.0f} MiB; h.grad is as large)")
    print(f"\n  {'variant':10s} {'peak MiB':>10s} {'saved MiB':>10s} {'time s':>8s} {'loss':>12s}")
    for variant in VARIANTS:
        if variant == "onehot":
            need, free = onehot_bytes(args.positions, args.vocab, args.k, 4), free_bytes(args.device)
            if need > free / 2:
                print(f"  {variant:10s} skipped: needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
                continue
        r = run_one(args, variant)
        if "error" in r:
            print(f"  {variant:10s} failed: {r['error']}")
            continue
        print(f"  {variant:10s} {r['peak_mib']:10.0f} {r['saved_mib']:10.1f} {r['seconds']:8.2f} {r['loss']:12.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
