"""Memory traffic of one Memory Mosaics v2 memory at the small size, measured on the CPU with the
dtypes CUDA gives it (bf16 autocast): what the GPU's memory-bound work scales with, without a GPU;
the kernels a compiled decoding step launches per block, and the bytes it moves; and the bytes a compiled
training block moves.

    python benchmarks/mmv2_bytes.py saved   [--kind short|long] [--scan chunked|compiled]
    python benchmarks/mmv2_bytes.py written [--kind short|long]
    python benchmarks/mmv2_bytes.py kernels [--kind short|long] [--device cuda|triton] [--detail]
    python benchmarks/mmv2_bytes.py launches [--device cuda|triton] [--contexts 4096 32768]
    python benchmarks/mmv2_bytes.py blocks  [--device cuda|triton] [--detail]

`saved`: the bytes autograd keeps for the backward of one memory's forward (distinct storages).
`written`: the bytes every aten op writes in one memory's forward and backward, the reads forced to
bf16 as on CUDA (`ContextualMemory.read_dtype`).
`kernels`: the bytes inductor's kernels read and write for the memory's compiled `memory_inputs`
(the key scan with its elementwise work, one graph as `scan_impl` auto runs it on CUDA), forward
and backward: inductor's own count of each fused kernel's buffers (`GraphLowering.count_bytes`),
taken as it compiles. The CPU's C++ kernels are counted (`--device cuda`: Triton's, which fuse a
little differently; benchmarks/mmv2_gpu.sh runs both). Also
printed: that traffic for all 48 memories of the small model at 4.3 TB/s (an H200's measured
bandwidth), a floor for this work per training step.
`launches`: the kernels one compiled decoding step launches per block, v2's (`static_block`, what
its StaticDecoder captures as a CUDA graph; and, once per step for all blocks, `static_readable_step`)
and the transformer's (transformers' StaticCache step
compiled whole, as `generate` compiles it), read from inductor's generated code: fused kernels and
library calls (matmuls, attention), by kind. At batch 1 a decoding step's kernels are short, so their
number, not only the bytes of the weights, sets a graphed step's time. Then the bytes the step's
kernels move per block, batch 1, into caches sized as `benchmarks/mmv2.py generation` sizes them for
each of `--contexts` (a step reads every slot, so its bytes grow with the cache): its floor at 4.3 TB/s
for 24 blocks, both models, the embedding and the head (the same in both) left out; by inductor's count,
then with each access at the elements it reaches (`reached_bytes`): inductor counts a step's write of
one position as the whole cache read and written, and again for the kernel that advances the position
after it. Small-size blocks (d 2048), bf16 weights, a 256-token prefill; the
transformer's per-layer figure is its step at two layers less its step at one.

`blocks`: the bytes inductor's kernels (fused and library calls) read and write for one compiled
training block of each model (`train.compile`: torch.compile per block), forward and backward, under
bf16 autocast: everything a block moves that the other does not, the weights' casts included. On the
CPU v2's reads take the SDPA path, whose masked query blocks CUDA's flex kernels do not have.

`--device triton` (kernels, launches, blocks): Triton's kernels for an H200 without a GPU. The graphs are
recorded on the CPU and lowered for CUDA on fake tensors (benchmarks/triton_lowering.py), with CUDA's
reads in both models (flex_attention, whose backward the CPU lacks, is only lowered, never run). The
CPU backend fuses differently (larger fusion thresholds; loops of different lengths fuse), so this is
the count to compare revisions by for the GPU.

`kernels` and `blocks`, on any device: `--detail` prints each kernel's buffers, and a second line gives
the same count with each access at the elements its index reaches (`reached_bytes`): inductor's own
counts a narrow slice of a wide buffer that a kernel broadcasts (a head's gate, read from the columns
of v2's stacked projection) as the whole buffer.

All: d 2048, 16 heads (the small size), batch 2 x 4096 tokens in packed documents, the input not a
leaf (as the RMSNorm output it is in the model: autocast caches the casts of leaves only), long-term
delay 64. To compare revisions, run the same command with PYTHONPATH at a worktree of the other
(docs/results.md, issue #39).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from owai.models.memory_mosaics_v2 import ContextualMemory, MemoryMosaicsV2Config

from _args import ArgumentParser, check_device, positive  # benchmarks/, beside this script
from mmv2 import NEW_TOKENS, generation_cache_length

BATCH, CONTEXT, DELAY = 2, 4096, 64
PREFILL = 256  # decoding: the prompt before the counted step
DOCUMENTS = [[1000, 2000, 1096], [1536, 2560]]  # each row's document lengths, summing to CONTEXT


def doc_starts() -> torch.Tensor:
    """(BATCH, CONTEXT) the position at which each token's document starts."""
    rows = [torch.cat([torch.full((n,), sum(row[:i])) for i, n in enumerate(row)]) for row in DOCUMENTS]
    return torch.stack(rows)


def memory_and_input(kind: str, scan: str, device: str = "cpu") -> tuple[ContextualMemory, torch.Tensor]:
    torch.manual_seed(0)
    config = MemoryMosaicsV2Config(vocab_size=512, n_layer=1, n_embd=2048, n_head=16, ffn_hidden=6144, scan_impl=scan)
    with torch.device(device):
        return ContextualMemory(config, kind), torch.randn(BATCH, CONTEXT, config.n_embd, requires_grad=True)


def saved(kind: str, scan: str) -> None:
    memory, leaf = memory_and_input(kind, scan)
    storages: dict[tuple[int, torch.dtype], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[(tensor.untyped_storage().data_ptr(), tensor.dtype)] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        memory(leaf * 1.0, doc_starts(), DELAY, None, 0)
    print(f"{kind} memory, {scan} scan: {sum(storages.values()) / 2**20:,.0f} MiB saved for the backward "
          f"in {len(storages)} storages")


class _Written(TorchDispatchMode):
    """Counts the bytes of every aten op's outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.bytes += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


def written(kind: str) -> None:
    memory, leaf = memory_and_input(kind, "chunked")
    _cuda_reads()
    with _Written() as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = memory(leaf * 1.0, doc_starts(), DELAY, None, 0)
        forward = counter.bytes
        y.float().sum().backward()
    print(f"{kind} memory: {forward / 2**20:,.0f} MiB written forward, {counter.bytes / 2**20:,.0f} MiB "
          f"forward and backward")


def _cuda_reads() -> None:
    """A memory's reads in bf16, as CUDA's under autocast or with bf16 weights
    (`ContextualMemory.read_dtype`), wherever the graphs are recorded."""
    ContextualMemory.read_dtype = lambda self, device: torch.bfloat16


def kernels(kind: str, device: str, detail: bool = False) -> None:
    run_on = "cpu" if device == "triton" else device
    memory, leaf = memory_and_input(kind, "compiled", run_on)
    _cuda_reads()

    def forward_pass() -> torch.Tensor:
        with torch.autocast(run_on, dtype=torch.bfloat16):
            return memory(leaf * 1.0, doc_starts().to(leaf.device), DELAY, None, 0)

    forward, total, reached = _forward_backward_bytes(forward_pass, device, detail)
    per_step = total * 48 / 4.3e12 * 1e3
    print(f"{kind} memory, compiled memory_inputs, {_where(device)}: inductor's kernels move {forward / 2**20:,.0f} MiB forward, "
          f"{(total - forward) / 2**20:,.0f} MiB backward, {total / 2**20:,.0f} MiB in all "
          f"(x 48 memories at 4.3 TB/s: {per_step:.1f} ms per step)")
    print(reached)


def _where(device: str) -> str:
    return "Triton for an H200, lowered on this CPU" if device == "triton" else device


def _forward_backward_bytes(forward_pass: Callable[[], torch.Tensor], device: str,
                            detail: bool) -> tuple[int, int, str]:
    """forward_pass() and a backward from its output, compiled by inductor (`_compiled_graphs`: on
    `device`, or for "triton" lowered on the CPU, where nothing is run): (forward, forward + backward)
    bytes its kernels move by inductor's count, and a line with the same count, each access at the
    elements it reaches (`reached_bytes`); `detail`: each kernel."""
    with _compiled_graphs(device) as graphs:
        forward_pass().float().sum().backward()
    if detail:
        for graph in graphs:
            print(f"  {'backward' if graph.backward else 'forward'} graph: {graph.bytes / 2**20:,.0f} MiB")
            print("\n".join("    " + row for row in graph.kernels))
    forward, total = (sum(g.bytes for g in graphs if not g.backward), sum(g.bytes for g in graphs))
    reached_forward, reached = (sum(g.reached for g in graphs if not g.backward), sum(g.reached for g in graphs))
    line = (f"    each access at the elements it reaches: {reached_forward / 2**20:,.0f} MiB forward, "
            f"{(reached - reached_forward) / 2**20:,.0f} MiB backward, {reached / 2**20:,.0f} MiB in all")
    return forward, total, line


KERNEL_CALL = re.compile(r"^\s+(?:\w+ = )?(cpp_fused_\w+|triton_\w+(?=\.run)|extern_kernels\.\w+|torch\.ops\.\w+\.\w+|aten\.\w+)[.(]",
                         re.M)


def _generated_launches(source: str) -> list[str]:
    """The kernel launches of inductor's generated wrapper (its `call`), in order: fused kernels as
    "fused", library calls by name (extern_kernels.mm, aten ops)."""
    body = source.split("def call(self, args):", 1)[-1].split("\ndef ", 1)[0].split("\nclass ", 1)[0]
    found = [m.group(1) for m in KERNEL_CALL.finditer(body)]
    return ["fused" if name.startswith(("cpp_fused", "triton_")) else name for name in found
            if not name.endswith(("empty_strided", "empty"))]


@dataclasses.dataclass
class Compiled:
    """One graph inductor compiled: whether it is a backward, its generated source, the bytes its
    kernels move (inductor's `count_bytes`), the same count with each access at the elements it reaches
    and one row per kernel (benchmarks/triton_lowering.py's `reached_bytes` and `kernel_rows`)."""
    backward: bool
    source: str
    bytes: int
    reached: int
    kernels: list[str]


@contextlib.contextmanager
def _compiled_graphs(device: str):
    """Yields a list that gets each graph inductor compiles while open (`Compiled`; filled as the block
    exits): on `device`, or, for "triton", recorded on the CPU and lowered for CUDA
    (benchmarks/triton_lowering.py). Inductor's caches are off: the counts are taken while compiling."""
    from torch._inductor import config as inductor_config

    inductor_config.force_disable_caches = True
    compiled: list[Compiled] = []
    if device == "triton":
        from triton_lowering import capture, lower_for_cuda

        with capture() as graphs:
            yield compiled
        for graph in graphs:
            lowered = lower_for_cuda(graph)
            compiled.append(Compiled(graph.backward, lowered.source, lowered.bytes, lowered.reached, lowered.kernels))
        return
    from torch._inductor import compile_fx
    from torch._inductor.graph import GraphLowering
    from triton_lowering import kernel_rows, reached_bytes

    log = compile_fx.inductor_metrics_log  # inductor counts a graph's bytes only while this log is enabled
    log.setLevel(logging.INFO)
    log.propagate = False  # kept quiet
    sources: list[str] = []
    counts: list[tuple[bool, int, int, list[str]]] = []
    compile_to_module, count_bytes = GraphLowering.compile_to_module, GraphLowering.count_bytes

    def recorded(self):
        module = compile_to_module(self)
        sources.append(Path(module.__file__).read_text())
        return module

    def counted(self):
        result = count_bytes(self)
        counts.append((self.is_backward, result[0], reached_bytes(self), kernel_rows(self)))
        return result

    GraphLowering.compile_to_module, GraphLowering.count_bytes = recorded, counted
    try:
        yield compiled
    finally:
        GraphLowering.compile_to_module, GraphLowering.count_bytes = compile_to_module, count_bytes
    if len(counts) != len(sources):
        raise SystemExit(f"error: inductor counted the bytes of {len(counts)} of its {len(sources)} graphs")
    compiled.extend(Compiled(backward, source, n, reached, rows)
                    for source, (backward, n, reached, rows) in zip(sources, counts))


def _decode_graphs(arch: str, n_layer: int, device: str, capacity: int) -> list[Compiled]:
    """Each graph inductor compiles for `arch`'s decoding steps, after a `PREFILL`-token prefill, into a
    cache of `capacity` positions (the step reads every slot, filled or not, so its kernels and bytes
    depend on the capacity, not on the prefill); device "triton": Triton's, lowered on the CPU."""
    from owai.models.lm import build_lm

    run_on = "cpu" if device == "triton" else device
    if device == "triton":
        _cuda_reads()
    torch._dynamo.reset()  # each capacity compiles its own graphs: a cached one is not given to inductor again
    torch.manual_seed(0)
    size = dict(n_layer=n_layer, n_embd=2048, n_head=16, ffn_hidden=6144, vocab_size=512)
    extra = {"scan_impl": "compiled", "static_decoding": "on"} if arch == "mmv2" else {}
    with torch.device(run_on):
        model = build_lm(arch, **size, **extra).to(torch.bfloat16).eval()
    prefill = torch.randint(0, 512, (1, PREFILL), device=run_on)
    with torch.no_grad():
        if arch == "mmv2":
            from owai.models.hf_cache import output_cache
            from owai.models.memory_mosaics_v2 import StaticDecoder

            cache = output_cache(model(input_ids=prefill, use_cache=True))
            with _compiled_graphs(device) as graphs:  # on CUDA the decoder compiles its step as it
                decoder = StaticDecoder(model, cache, capacity)  # captures it; elsewhere at its first step
                if decoder.graph is None:
                    decoder.step(prefill[:, :1])
        else:
            from transformers import StaticCache

            from owai.models.hf_cache import cache_kwargs

            cache = cache_kwargs(StaticCache(config=model.config, max_cache_len=capacity))
            model(input_ids=prefill, **cache, use_cache=True, cache_position=torch.arange(PREFILL, device=run_on))
            step = torch.compile(model.forward, fullgraph=True, dynamic=False)
            with _compiled_graphs(device) as graphs:
                step(input_ids=prefill[:, :1], **cache, use_cache=True,
                     cache_position=torch.tensor([PREFILL], device=run_on))
    return graphs


def launches(device: str, contexts: list[int]) -> None:
    from collections import Counter

    def summary(calls: list[str]) -> str:
        kinds = Counter(calls)
        return f"{len(calls)} ({', '.join(f'{n} {k}' for k, n in kinds.most_common())})"

    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    for i, context in enumerate(contexts):
        capacity = generation_cache_length(context, NEW_TOKENS)  # as benchmarks/mmv2.py generation sizes it
        v2 = _decode_graphs("mmv2", 1, device, capacity)  # each memory kind's readable slots (once per step), then the block
        if len(v2) != 3:
            raise SystemExit(f"error: expected three compiled graphs for v2's decoding step, got {len(v2)}")
        one, two = (_decode_graphs("transformer", n, device, capacity) for n in (1, 2))
        if i == 0:
            v2_calls = [_generated_launches(graph.source) for graph in v2]
            one_calls, two_calls = (sum((_generated_launches(g.source) for g in graphs), []) for graphs in (one, two))
            layer = list((Counter(two_calls) - Counter(one_calls)).elements())
            print(f"compiled decoding step, {device}, small-size blocks, bf16: kernels launched per block")
            print(f"  memory mosaics v2 (static_block)        {summary(v2_calls[-1])}")
            print(f"  memory mosaics v2, once per step        {summary(sum(v2_calls[:-1], []))}  (static_readable_step, both memories)")
            print(f"  transformer (StaticCache, compiled)     {summary(layer)}")
            print(f"  transformer outside its layers          {summary(list((Counter(one_calls) - Counter(layer)).elements()))}")
            print("bytes the step's kernels move, batch 1; 24 blocks at 4.3 TB/s, without the embedding and the head "
                  "(the same in both)")
        for label, size in (("inductor's count", lambda graph: graph.bytes),
                            ("each access at the elements it reaches", lambda graph: graph.reached)):
            v2_block, v2_once = size(v2[-1]), sum(size(graph) for graph in v2[:-1])
            t_layer = sum(size(g) for g in two) - sum(size(g) for g in one)
            v2_ms, t_ms = (24 * v2_block + v2_once) / 4.3e12 * 1e3, 24 * t_layer / 4.3e12 * 1e3
            print(f"  context {context:6,d} (capacity {capacity:,d}), {label}: v2 {mib(v2_block)} per block + "
                  f"{mib(v2_once)} per step, transformer {mib(t_layer)} per layer; {v2_ms:.2f} against {t_ms:.2f} ms: "
                  f"{v2_ms / t_ms:.2f}x", flush=True)


def blocks(device: str, detail: bool = False) -> None:
    from owai.distributed import Parallel
    from owai.models.lm import blocks as model_blocks
    from owai.models.lm import build_lm
    from owai.models.llama import packed_document_attention

    triton_on_cpu = device == "triton"
    run_on = "cpu" if triton_on_cpu else device
    _cuda_reads()
    starts = doc_starts().to(run_on)
    positions = torch.arange(CONTEXT, device=run_on) - starts  # restarting at each document
    print(f"one compiled training block, small size, batch {BATCH} x {CONTEXT} in packed documents, bf16 autocast, "
          f"{_where(device)}: bytes inductor's kernels move")
    for arch in ("mmv2", "transformer"):
        torch.manual_seed(0)
        extra = {"scan_impl": "compiled"} if arch == "mmv2" else {}
        if triton_on_cpu and arch == "mmv2":
            extra["attn_impl"] = "flex"  # CUDA's reads (attn_impl auto)
        with torch.device(run_on):
            model = build_lm(arch, n_layer=1, n_embd=2048, n_head=16, ffn_hidden=6144, vocab_size=512, **extra).train()
        packed_document_attention(model, torch.device("cuda" if triton_on_cpu else device))
        Parallel(model, blocks=model_blocks(model), compile_blocks=True)
        ids = torch.randint(0, 512, (BATCH, CONTEXT), device=run_on)

        def forward_pass() -> torch.Tensor:
            with torch.autocast(run_on, dtype=torch.bfloat16):
                return model(input_ids=ids, position_ids=positions,
                             **({"long_delay": DELAY} if arch == "mmv2" else {})).logits

        forward, total, reached = _forward_backward_bytes(forward_pass, device, detail)
        print(f"  {arch:12s} {forward / 2**20:7,.0f} MiB forward, {(total - forward) / 2**20:7,.0f} MiB backward, "
              f"{total / 2**20:7,.0f} MiB in all (x 24 blocks at 4.3 TB/s: {total * 24 / 4.3e12 * 1e3:.1f} ms per step)",
              flush=True)
        print(reached, flush=True)
        model = None


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("measure", choices=["saved", "written", "kernels", "launches", "blocks"])
    parser.add_argument("--kind", choices=["short", "long"], default=None,
                        help="which memory (default: short for saved and kernels, long for written)")
    parser.add_argument("--scan", choices=["chunked", "compiled"], default="chunked",
                        help="saved only: the eager chunked scan, or the compiled memory inputs (CUDA's default)")
    parser.add_argument("--device", default="cpu",
                        help="kernels, launches, blocks: cuda counts Triton's kernels, triton counts them without a GPU "
                             "(benchmarks/triton_lowering.py)")
    parser.add_argument("--contexts", type=positive, nargs="+", default=[4096, 32768],
                        help="launches: the contexts whose decoding steps' bytes are counted (the generation benchmark's)")
    parser.add_argument("--detail", action="store_true", help="kernels, blocks: each kernel's buffers")
    args = parser.parse_args()
    check_device(args.device, ("cpu", "cuda", "triton"))
    if args.measure == "saved":
        saved(args.kind or "short", args.scan)
    elif args.measure == "kernels":
        kernels(args.kind or "short", args.device, args.detail)
    elif args.measure == "launches":
        launches(args.device, args.contexts)
    elif args.measure == "blocks":
        blocks(args.device, args.detail)
    else:
        written(args.kind or "long")


if __name__ == "__main__":
    main()
