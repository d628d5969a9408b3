"""Benchmark: Memory Mosaics v2 against the Llama transformer at the same size (issue #22's targets).

    python benchmarks/mmv2.py memory                  # peak memory of a forward at 8k and 32k tokens, batch 1
    python benchmarks/mmv2.py throughput              # training tokens/s, v2 and transformer, rounds interleaved
    python benchmarks/mmv2.py throughput --compile    # the same with torch.compile per block (train.compile)
    python benchmarks/mmv2.py throughput --documents  # packed documents (position_ids restarting, mean 1536)
    python benchmarks/mmv2.py generation              # cached generation time per token at growing contexts
    python benchmarks/mmv2.py generation --graphs     # both decoding steps as CUDA graphs (generate), then as above
    python benchmarks/mmv2.py profile --device cuda   # a decoding step's wall vs device-busy time, kernels per step
    python benchmarks/mmv2.py profile --train         # a training step's time by kernel family (matmuls, attention, scan, ...)
    python benchmarks/mmv2.py scan                    # key-scan candidates: eager chunked, compiled (chunk sizes), Triton (CUDA)
    python benchmarks/mmv2.py all --device cuda       # the same on a GPU (bf16)

Issue #39's GPU runs (small size: 2.04B / 1.83B parameters; MFU = tokens/s x 3 x owai.plan.forward_flops_per_token
over the bf16 peak, as the trainer logs it):

    python benchmarks/mmv2.py throughput --device cuda --size small --context 4096 --batch 2 [--documents] [--compile]
    python benchmarks/mmv2.py generation --device cuda --size small --contexts 4096 32768
    python benchmarks/mmv2.py scan --device cuda --context 4096 --batch 2 --size small
    python benchmarks/mmv2.py profile --train --device cuda --size small --context 4096 --batch 2 --documents [--compile]

`--attn sdpa|flex` and `--scan chunked|compiled|triton` pick v2's kernels (default auto: flex and
the compiled scan on CUDA). On CUDA the models train one after the other (two do not fit together);
on CPU their steps alternate.

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
import itertools
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from _args import ArgumentParser, check_device, positive

NEW_TOKENS = 32  # `generation`: the tokens generated after each prompt (--new's default)


def generation_cache_length(prompt: int, new: int) -> int:
    """The cache length `generation` gives a prompt of `prompt` tokens and `new` generated ones (two
    slots of headroom). A static step reads every slot, so its bytes follow this length, and
    `benchmarks/mmv2_bytes.py launches` sizes its caches with it."""
    return prompt + new + 2


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def build(arch: str, size: str, vocab: int, device: str, **extra):
    import torch

    from owai.models.lm import build_sized_lm

    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (a small model is 2B parameters)
        return build_sized_lm(arch, size, vocab_size=vocab, **extra)


def forward_memory(arch: str, size: str, vocab: int, length: int, device: str) -> dict:
    """One forward of `length` tokens (batch 1, no gradient, last position's logits only)."""
    import torch

    model = build(arch, size, vocab, device).eval()
    x = torch.randint(0, model.config.vocab_size, (1, length), device=device)
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


PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s (SXM data sheets)


def peak_flops(device: str) -> float | None:
    import torch

    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def packed_positions(batch: int, context: int, mean: int, seed: int = 0):
    """(batch, context) position_ids of packed documents whose lengths are uniform on
    [mean/4, 7 mean/4] (mean `mean`), the last one cut at the row's end; restarting at 0."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        parts, filled = [], 0
        while filled < context:
            n = min(int(torch.randint(mean // 4, 7 * mean // 4 + 1, (), generator=gen)), context - filled)
            parts.append(torch.arange(n))
            filled += n
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def training_delays(config) -> Iterator[int]:
    """v2's long-term delay for each training step: one per step, uniform over long_delay_train as the
    trainer draws it (seeded), the smallest and the largest first. A compiled block sees a second
    delay at the second step and recompiles once with the delay symbolic, so the warm-up builds the
    graph that every later delay reuses, as in `owai mosaic-train`."""
    lo, hi = config.long_delay_train
    yield lo
    yield hi
    draws = random.Random(0)
    while True:
        yield draws.randint(lo, hi)


def train_step_seconds(model, x, pos, delay: bool) -> float:
    """Seconds for one training step: forward, cross-entropy, backward, the model's optimizer step.
    delay: v2's long-term delay drawn per step (`training_delays`)."""
    import torch
    import torch.nn.functional as F

    if delay and not hasattr(model, "delays"):
        model.delays = training_delays(model.config)
    start = time.perf_counter()
    extra = {"long_delay": next(model.delays)} if delay else {}
    logits = model(input_ids=x, position_ids=pos, **extra).logits
    F.cross_entropy(logits.float()[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
    model.optimizer.step()
    model.optimizer.zero_grad(set_to_none=True)
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def out_of_memory(err: BaseException) -> bool:
    return "out of memory" in str(err).lower() or type(err).__name__ == "OutOfMemoryError"


def release() -> None:
    """Free the GPU memory of a finished model (compiled graphs hold references to it)."""
    import gc

    import torch

    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def train_model(arch: str, args):
    """A model for training steps: the trainer's AdamW (`owai.models.lm.adamw`: fused on CUDA), per-block
    compile if asked, packed-document attention."""
    import torch

    from owai.distributed import Parallel
    from owai.models.lm import adamw, blocks
    from owai.models.llama import packed_document_attention

    extra = {"attn_impl": args.attn, "scan_impl": args.scan} if arch == "mmv2" else {}
    model = build(arch, args.size, args.vocab, args.device, **extra).train()
    if args.documents:
        packed_document_attention(model, torch.device(args.device))
    model.optimizer = adamw(model, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if args.compile:  # the trainer's train.compile: torch.compile per block
        Parallel(model, blocks=blocks(model), compile_blocks=True)
    return model


def training_setting(args):
    """The packed documents' position_ids (or None) and the line describing a training benchmark's
    setting, shared by `throughput` and `profile --train`."""
    pos = packed_positions(args.batch, args.context, args.doc_mean).to(args.device) if args.documents else None
    docs = f", packed documents (mean {args.doc_mean})" if args.documents else ""
    return pos, (f"{args.size} models, batch {args.batch} x {args.context}{docs}, {args.device}, "
                 f"{'compiled blocks' if args.compile else 'eager'}")


def warm_up_steps(args) -> int:
    """Untimed training steps before timing: two when blocks compile (the second step's graph, with
    v2's delay symbolic: `training_delays`)."""
    return 2 if args.compile else 1


def print_failure(arch: str, err: BaseException) -> None:
    """One line for a model that failed (out of memory, a kernel error), with the traceback unless it
    ran out of memory; the benchmark goes on with the next model."""
    if not out_of_memory(err):
        import traceback

        traceback.print_exc()
    print(f"  {arch:12s} failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)


def throughput(args) -> None:
    """Training steps of v2 and the transformer. CPU: both models alternate in one process (the
    machine's load changes both alike); CUDA: one model at a time (two small models and their AdamW
    states do not fit one GPU together). Warm-up steps first; median seconds per step. An
    out-of-memory error is printed and the next model runs."""
    import torch

    tokens = args.batch * args.context
    pos, setting = training_setting(args)
    print(f"training tokens/s, {setting}, {args.rounds} rounds (median), mmv2 attn {args.attn} scan {args.scan}")
    peak = peak_flops(args.device)
    cuda = args.device == "cuda"
    warm = warm_up_steps(args)
    models, times, memory, flops = {}, {a: [] for a in args.archs}, {}, {}

    def report(arch: str, model) -> None:
        from owai.plan import forward_flops_per_token

        n = sum(p.numel() for p in model.parameters())
        speed = tokens / statistics.median(times[arch])
        flops[arch] = forward_flops_per_token(model, args.context)
        # as the trainer logs it (and issue #39's "before" table): 3 x forward FLOPs per token at this context
        mfu = f"  MFU {3 * flops[arch] * speed / peak * 100:5.1f} %" if peak else ""
        mem = f"  peak {memory[arch]:5.1f} GB" if arch in memory else ""
        print(f"  {arch:12s} {n / 1e6:8.2f}M parameters  {speed:9.0f} tokens/s{mfu}{mem}  "
              f"(step {statistics.median(times[arch]):.3f} s)", flush=True)

    with torch.autocast(args.device, dtype=torch.bfloat16, enabled=cuda):
        for arch in args.archs:
            model = None
            try:
                x = torch.randint(0, args.vocab or 4096, (args.batch, args.context), device=args.device)
                model = train_model(arch, args)
                x = x % model.config.vocab_size
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                for _ in range(warm):  # warm-up (and compilation)
                    train_step_seconds(model, x, pos, arch == "mmv2")
                print(f"  {arch}: warm-up {time.perf_counter() - start:.1f} s", flush=True)
                if cuda:  # one model at a time
                    times[arch] = [train_step_seconds(model, x, pos, arch == "mmv2") for _ in range(args.rounds)]
                    memory[arch] = torch.cuda.max_memory_allocated() / 1e9
                    report(arch, model)
                else:
                    models[arch] = (model, x)
            except Exception as err:  # noqa: BLE001  (out of memory, a kernel that fails: print, go on)
                print_failure(arch, err)
            if cuda:  # after the except block: its traceback no longer holds the model's tensors
                model = None
                release()
        for _ in range(args.rounds if not cuda else 0):
            for arch, (model, x) in models.items():
                times[arch].append(train_step_seconds(model, x, pos, arch == "mmv2"))
    for arch, (model, _) in models.items():
        report(arch, model)
    speed = {a: tokens / statistics.median(t) for a, t in times.items() if t}
    if {"mmv2", "transformer"} <= set(speed):
        at_equal_mfu = flops["transformer"] / flops["mmv2"]  # v2 does more FLOPs per token
        print(f"  ratio v2 / transformer: {speed['mmv2'] / speed['transformer']:.2f}x (at equal MFU: {at_equal_mfu:.2f}x, "
              f"v2's forward FLOPs per token being {1 / at_equal_mfu:.3f}x the transformer's)")


def generation(args) -> None:
    """Prefill a context of n tokens, then time `--new` single-token steps with the cache. On CUDA the
    weights are bf16 (the evaluation precision; no autocast). `--graphs`: both models decode through
    `generate` with their whole step replayed as a CUDA graph (`graphed_steps`), then, in the same
    process, with the dynamic cache (`cached_steps`: the figures to compare with should a graph
    fail); else `cached_steps` only."""
    import torch

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    graphs = "graphs" if args.device == "cuda" else "static buffers: no graphs off CUDA"
    timers = [(graphs, graphed_steps), ("dynamic cache", cached_steps)] if args.graphs else [(None, cached_steps)]
    print(f"cached generation{' with CUDA graphs, then the dynamic cache' if args.graphs else ''}, {args.size} models, "
          f"batch 1, {args.device}, {dtype}: time per new token after n context tokens")
    for arch in args.archs:
        extra = {"attn_impl": args.attn, "scan_impl": args.scan} if arch == "mmv2" else {}
        model = build(arch, args.size, args.vocab, args.device, **extra).to(dtype).eval()
        if args.graphs and arch == "mmv2" and args.device != "cuda":
            model.config.static_decoding = "on"  # the StaticDecoder's buffers without a graph
        for n, (label, timed) in itertools.product(args.contexts, timers):
            how = f"  ({label})" if label else ""
            try:
                x = torch.randint(0, model.config.vocab_size, (1, n), device=args.device)
                per = timed(model, arch, x, args)
                print(f"  {arch:12s} n={n:6d}  {per * 1000:7.2f} ms/token{how}", flush=True)
                if timed is graphed_steps and arch == "mmv2" and args.device == "cuda":
                    try:  # a profile that fails leaves the timing above standing
                        note = replay_profile(model.last_decoder)
                    except Exception as err:  # noqa: BLE001
                        note = f"graph replay profile failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
                    print(f"  {arch:12s} n={n:6d}  {note}", flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"  {arch:12s} n={n:6d}  failed{how}: {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)
            finally:
                if args.device == "cuda":
                    torch.cuda.empty_cache()
        del model
        if args.device == "cuda":
            release()


def cached_steps(model, arch: str, x, args) -> float:
    """Seconds per step of `--new` forward calls with the model's cache after a prefill of x (two
    warm-up steps first)."""
    import torch

    from owai.models.hf_cache import cache_kwargs, output_cache

    with torch.no_grad():
        out = model(input_ids=x, use_cache=True, logits_to_keep=1)
        cache, token = output_cache(out), out.logits[:, -1:].argmax(-1)
        for _ in range(2):  # warm-up steps
            out = model(input_ids=token, use_cache=True, **cache_kwargs(cache))
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.new):
            out = model(input_ids=token, use_cache=True, **cache_kwargs(cache))
            token = out.logits[:, -1:].argmax(-1)
        if args.device == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / args.new


def graphed_steps(model, arch: str, x, args) -> float:
    """Seconds per step of greedy `generate` with CUDA-graphed decoding: v2's StaticDecoder
    (static_decoding auto), the transformer's StaticCache with transformers' own compiled decoding
    step (torch.compile "reduce-overhead", which records CUDA graphs). A stopping criterion clocks
    every step after a device sync; the median step counts, so neither the prefill nor the first
    step's capture does. A warm-up call first (compilation); the same cache length in every call, so
    nothing recompiles."""
    import torch
    from transformers import StaticCache, StoppingCriteria, StoppingCriteriaList

    from owai.models.hf_cache import cache_kwargs
    from owai.models.memory_mosaics_v2 import MemoryMosaicsV2Cache

    class Clock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            if args.device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    length = generation_cache_length(x.shape[1], args.new)
    static = StaticCache(config=model.config, max_cache_len=length) if arch != "mmv2" else None
    for _ in range(2):  # a warm-up call (compilation), then the timed one
        if static is not None:
            static.reset()
            cache = static
        else:
            cache = MemoryMosaicsV2Cache()
            cache.capacity = length
        clock = Clock()
        model.generate(x, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0,
                       eos_token_id=None, stopping_criteria=StoppingCriteriaList([clock]), **cache_kwargs(cache))
        if arch == "mmv2" and cache.decoder is None:
            raise RuntimeError("the StaticDecoder was not used")
    if arch == "mmv2":
        model.last_decoder = cache.decoder  # for replay_profile
    return statistics.median(b - a for a, b in zip(clock.times, clock.times[1:]))


def replay_profile(decoder, steps: int = 8) -> str:
    """What one replay of v2's captured decoding step runs: the device's busy ms (its kernels' summed
    time) and the kernels per step, whether the step was compiled, and the wall ms per replay. Busy
    far below wall: launch gaps; kernels per step: what compiling or stacking could still remove.
    (Replays past the generation's end overwrite old slots: the figures, not the state, matter.)"""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    from owai.models.memory_mosaics_v2 import _COMPILED

    if decoder is None or decoder.graph is None:
        return "no captured step to profile"
    step = "compiled" if decoder.compiled and "static-failed" not in _COMPILED else "eager"
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        decoder.graph.replay()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            decoder.graph.replay()
        torch.cuda.synchronize()
    kernels = device_kernels(prof)
    busy = sum(e.self_device_time_total for e in kernels) / 1000 / steps
    launched = sum(e.count for e in kernels) / steps
    return (f"graph replay ({step} step): wall {wall * 1000:.2f} ms, "
            f"device busy {busy:.2f} ms, kernels {launched:.0f} per step")


KERNEL_FAMILIES = (  # (family, marks in a lower-cased kernel or op name), first match wins
    ("key scan (owai's Triton kernel)", ("_scan_kernel", "owai::gated_key_scan")),
    ("matmuls", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm")),
    ("attention (flash, flex)", ("flash", "fmha", "flex", "attention", "triton_tem", "scaled_dot_product")),
    ("optimizer (AdamW)", ("multi_tensor", "foreach", "adam")),
    ("fused by inductor", ("triton_",)),
)


def device_kernels(prof) -> list:
    """The kernels a finished profile saw on the device: its CUDA events less the named ranges (e.g.
    "Optimizer.step#AdamW.step", which spans the optimizer's kernels: counting it too counted those
    kernels twice)."""
    from torch.autograd import DeviceType

    return [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA
            and not (getattr(e, "is_user_annotation", False) or "#" in e.key)]


def kernel_family(name: str) -> str:
    """The family of a CUDA kernel (or, on CPU, an aten op) by its name: where a training step's time goes."""
    lowered = name.lower()
    return next((family for family, marks in KERNEL_FAMILIES if any(m in lowered for m in marks)),
                "other (unfused elementwise, reductions, copies)")


def profile_training(args) -> None:
    """Where a training step's time goes (throughput's step: AdamW, `--compile`, `--documents`,
    `--scan`): wall ms per step (median of 2, without the profiler), then one profiled step: the
    device's busy ms (its kernels' summed time; on CPU the aten ops' self time), kernels per step,
    the time per kernel family and the kernels with the most time. One model at a time."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    cuda = args.device == "cuda"
    tokens = args.batch * args.context
    pos, setting = training_setting(args)
    print(f"training step, {setting}, mmv2 attn {args.attn} scan {args.scan}: where the time goes")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for arch in args.archs:
        model = None
        try:
            model = train_model(arch, args)
            x = torch.randint(0, model.config.vocab_size, (args.batch, args.context), device=args.device)
            with torch.autocast(args.device, dtype=torch.bfloat16, enabled=cuda):
                for _ in range(warm_up_steps(args)):  # warm-up (and compilation)
                    train_step_seconds(model, x, pos, arch == "mmv2")
                wall = statistics.median(train_step_seconds(model, x, pos, arch == "mmv2") for _ in range(2))
                with profiler(activities=activities) as prof:
                    train_step_seconds(model, x, pos, arch == "mmv2")
            if cuda:
                kernels = [(e.key, e.self_device_time_total, e.count) for e in device_kernels(prof)]
            else:
                kernels = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages() if e.key.startswith("aten::")]
            busy = sum(t for _, t, _ in kernels) / 1000
            print(f"  {arch:12s} wall {wall * 1000:8.1f} ms/step ({tokens / wall:7.0f} tokens/s)  "
                  f"{'device busy' if cuda else 'aten self time'} {busy:8.1f} ms  "
                  f"{'kernels' if cuda else 'ops'} {sum(c for *_, c in kernels):6d}/step", flush=True)
            families: dict[str, float] = {}
            for key, t, _ in kernels:
                family = kernel_family(key)
                families[family] = families.get(family, 0.0) + t / 1000
            for family, ms in sorted(families.items(), key=lambda kv: -kv[1]):
                print(f"      {ms:8.1f} ms  {100 * ms / max(busy, 1e-9):5.1f} %  {family}")
            for key, t, count in sorted(kernels, key=lambda k: -k[1])[:12]:
                print(f"      {t / 1000:8.2f} ms  {count:5d}x  {key[:100]}", flush=True)
        except Exception as err:  # noqa: BLE001  (out of memory, a kernel that fails: print, go on)
            print_failure(arch, err)
        model = None
        if cuda:
            release()


def profile(args) -> None:
    """Where a cached decoding step's time goes: wall ms per step (timed without the profiler), the
    device's busy ms per step (its kernels' summed time), kernels launched per step and the kernels
    with the most device time. Wall far above busy means the step is launch-bound (CPU-side).
    `--train`: a training step instead (profile_training)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    from owai.models.hf_cache import cache_kwargs, output_cache

    if args.train:
        return profile_training(args)
    if args.device != "cuda":
        print("profile: CUDA only (kernel times)")
        return
    steps = 8
    print(f"cached decoding steps, {args.size} models, batch 1, bf16 weights: where the time goes ({steps} steps)")
    for arch in args.archs:
        extra = {"attn_impl": args.attn, "scan_impl": args.scan} if arch == "mmv2" else {}
        model = build(arch, args.size, args.vocab, args.device, **extra).to(torch.bfloat16).eval()
        for n in args.contexts:
            x = torch.randint(0, model.config.vocab_size, (1, n), device=args.device)
            with torch.no_grad():
                out = model(input_ids=x, use_cache=True, logits_to_keep=1)
                cache, token = output_cache(out), out.logits[:, -1:].argmax(-1)
                for _ in range(3):
                    out = model(input_ids=token, use_cache=True, **cache_kwargs(cache))
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(steps):
                    out = model(input_ids=token, use_cache=True, **cache_kwargs(cache))
                torch.cuda.synchronize()
                wall = (time.perf_counter() - start) / steps
                with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(steps):
                        out = model(input_ids=token, use_cache=True, **cache_kwargs(cache))
                    torch.cuda.synchronize()
            kernels = device_kernels(prof)
            busy = sum(e.self_device_time_total for e in kernels) / 1000 / steps
            launched = sum(e.count for e in kernels) / steps
            print(f"  {arch:12s} n={n:6d}  wall {wall * 1000:7.2f} ms/step  device busy {busy:7.2f} ms/step  "
                  f"kernels {launched:6.0f}/step", flush=True)
            for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]:
                print(f"      {e.self_device_time_total / 1000 / steps:7.3f} ms  {e.count / steps:5.0f}x  {e.key[:90]}")
            out = cache = None
            torch.cuda.empty_cache()
        del model
        release()


def scan(args) -> None:
    """The key-scan candidates (forward + backward of eq 4.4's gated recurrence, as one memory of
    one layer sees it): the eager chunked scan and the same as one compiled graph, at several
    chunk sizes, and owai's Triton kernel (its own chunking; on CUDA only: on the CPU it would run in
    Triton's interpreter), without and with packed documents. ms per call, median of `--rounds`."""
    import functools

    import torch

    from owai.models import key_scan_triton
    from owai.models.memory_mosaics_v2 import _compiled, gated_key_scan
    from owai.models.sizes import size_settings

    settings = size_settings(args.size, args.vocab or 4096)
    B, H, T = args.batch, settings["n_head"], args.context
    hs = settings["n_embd"] // H
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(B, H, T, hs, generator=gen).to(args.device)
    log_gate = torch.randn(B, H, T, generator=gen).to(args.device)
    log_decay = -torch.randn(B, H, T, generator=gen).abs().to(args.device)
    pos = packed_positions(B, T, args.doc_mean).to(args.device)
    ds = torch.arange(T, device=args.device) - pos
    candidates = [("chunked", gated_key_scan, args.chunks), ("compiled", _compiled("scan"), args.chunks)]
    if args.device == "cuda" and key_scan_triton.available():
        candidates.append(("triton", functools.partial(gated_key_scan, kernel="triton"), [0]))
    print(f"key scan forward+backward, batch {B}, {H} heads, T {T}, head size {hs}, {args.device}: ms per call (median)")
    for docs in (None, ds):
        for name, fn, chunks in candidates:
            for chunk in chunks:
                label = f"{name:9s} {'chunk %3d' % chunk if chunk else 'own chunks':10s} {'documents' if docs is not None else 'one document':13s}"
                try:
                    inputs = [z.clone().requires_grad_(True) for z in (raw, log_gate, log_decay)]
                    seconds = []
                    for i in range(args.rounds + 2):  # 2 warm-up calls (compilation)
                        start = time.perf_counter()
                        rows, _ = fn(*inputs, docs, 0, None, chunk)
                        rows.sum().backward()
                        if args.device == "cuda":
                            torch.cuda.synchronize()
                        if i >= 2:
                            seconds.append(time.perf_counter() - start)
                    print(f"  {label} {statistics.median(seconds) * 1000:8.2f} ms", flush=True)
                except Exception as err:  # noqa: BLE001
                    print(f"  {label} failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}")


def main() -> None:
    from owai.models.sizes import SIZES
    from owai.models.zoo import SIZED

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["memory", "throughput", "generation", "profile", "scan", "all"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--vocab", type=positive, default=None, help="vocabulary (default: 4096 for tiny, the table's otherwise)")
    parser.add_argument("--archs", nargs="+", default=["mmv2", "transformer"], choices=list(SIZED))
    parser.add_argument("--lengths", type=positive, nargs="+", default=[8192, 32768])
    parser.add_argument("--batch", type=positive, default=8)
    parser.add_argument("--context", type=positive, default=512)
    parser.add_argument("--rounds", type=positive, default=5)
    parser.add_argument("--compile", action="store_true", help="throughput: torch.compile each block (train.compile)")
    parser.add_argument("--documents", action="store_true", help="throughput: packed documents (position_ids restarting)")
    parser.add_argument("--doc-mean", type=positive, default=1536, help="mean document length with --documents")
    parser.add_argument("--attn", default="auto", choices=["auto", "sdpa", "flex"], help="mmv2 config attn_impl")
    parser.add_argument("--scan", default="auto", choices=["auto", "chunked", "compiled", "triton"], help="mmv2 config scan_impl")
    parser.add_argument("--chunks", type=positive, nargs="+", default=[16, 32, 64], help="scan: chunk sizes")
    parser.add_argument("--contexts", type=positive, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--new", type=positive, default=NEW_TOKENS)
    parser.add_argument("--graphs", action="store_true", help="generation: both models decode with CUDA graphs, through generate")
    parser.add_argument("--train", action="store_true", help="profile: a training step (as throughput's) instead of decoding steps")
    args = parser.parse_args()
    check_device(args.device)
    if args.vocab is None and args.size == "tiny":
        args.vocab = 4096
    for what in (["memory", "throughput", "generation"] if args.what == "all" else [args.what]):
        globals()[what](args)


if __name__ == "__main__":
    main()
