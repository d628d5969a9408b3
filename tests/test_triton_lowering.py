"""benchmarks/triton_lowering.py: inductor's Triton kernels for one CUDA GPU, lowered on the CPU, and
what they show of Memory Mosaics v2's compiled memory inputs on a GPU (issue #39)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from owai.models.memory_mosaics_v2 import ContextualMemory, MemoryMosaicsV2Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
pytest.importorskip("triton")
import triton_lowering  # noqa: E402


@pytest.fixture(autouse=True)
def _nondeterministic_lowering():
    """Inductor lowers scatters (a decoding step's slot writes) as library fallbacks under
    torch.use_deterministic_algorithms, which an owai run turns on for its process (runtime.deterministic)
    and a test in the same worker may have left on. These tests count the kernels of the default mode,
    as benchmarks/mmv2.py runs it."""
    mode, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)


def _lowered_graphs(run) -> list:
    """run() under `capture`, each recorded graph lowered for CUDA; skips where this torch lacks the internals."""
    try:
        with triton_lowering.capture() as graphs:
            run()
        return [(graph, triton_lowering.lower_for_cuda(graph)) for graph in graphs]
    except triton_lowering.TritonLoweringUnavailable as err:
        pytest.skip(str(err))


def test_a_pointwise_kernel_moves_its_input_and_output_once():
    x = torch.randn(256, 1024, dtype=torch.bfloat16)
    (graph, lowered), = _lowered_graphs(lambda: torch.compile(lambda t: t * 2 + 1, fullgraph=True)(x))
    assert graph.inference and not graph.backward
    assert lowered.bytes == 2 * x.numel() * x.element_size()  # read once, written once: one fused kernel
    assert lowered.source.count("@triton.jit") == 1
    assert lowered.written == [(torch.bfloat16, (256, 1024))]


def test_a_broadcast_slice_counts_as_its_buffer_for_inductor_and_as_itself_when_reached():
    """Inductor's count takes each access at the kernel's whole iteration space, capped at the buffer:
    one column of a wide buffer, broadcast along the rows, counts as the whole buffer.
    `reached_bytes` counts it at the elements its index reaches."""
    x, w = torch.randn(256, 1024, dtype=torch.bfloat16), torch.randn(256, 1024, dtype=torch.bfloat16)
    (_, lowered), = _lowered_graphs(lambda: torch.compile(lambda a, b: a * b[:, :1], fullgraph=True)(x, w))
    size = x.numel() * x.element_size()
    assert lowered.bytes == 3 * size  # x read, w counted whole, the product written
    assert lowered.reached == 2 * size + 256 * w.element_size()  # w's first column only


def test_a_slot_write_into_a_cache_counts_as_the_whole_cache_for_inductor_and_as_its_row_when_reached():
    """A decoding step writes one position into caches that hold every position (graph inputs it
    mutates): inductor counts each cache whole, read and written, and again for the scalar kernel that
    advances the position, which must wait for the writes (an ordering dependency). `reached_bytes`
    counts the rows written, and nothing for the ordering. The attention read of both caches, a library
    call, keeps its count."""
    keys, values = (torch.zeros(1, 4, 4096, 64, dtype=torch.bfloat16) for _ in range(2))
    row, position = torch.randn(1, 4, 1, 64, dtype=torch.bfloat16), torch.tensor(7)

    def step(keys: torch.Tensor, values: torch.Tensor, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        keys.index_copy_(2, position[None], row)
        values.index_copy_(2, position[None], row * 2)
        readable = (torch.arange(4096) <= position)[None, None, None]
        read = torch.nn.functional.scaled_dot_product_attention(row, keys, values, attn_mask=readable)
        position.add_(1)
        return read

    (_, lowered), = _lowered_graphs(lambda: torch.compile(step, fullgraph=True)(keys, values, row, position))
    caches = 2 * keys.numel() * keys.element_size()
    assert lowered.bytes > 3 * caches  # written (read and written, whole), the ordering, the attention read
    assert caches <= lowered.reached < caches + 2**16  # the attention read, and a row per cache


def test_the_capture_runs_nothing_and_gives_the_shapes():
    x = torch.randn(64, 32, requires_grad=True)
    captured = []

    def run():
        y = torch.compile(lambda t: (t.exp() * 3).sum(-1))(x)
        captured.append(y)
        y.sum().backward()

    graphs = _lowered_graphs(run)
    assert [g.backward for g, _ in graphs] == [False, True]
    assert captured[0].shape == (64,) and torch.equal(captured[0], torch.zeros(64))  # zeros: nothing was run
    assert x.grad.shape == x.shape and torch.equal(x.grad, torch.zeros_like(x))


# slow (8-16 s each, cold, on the 2-core machine; docs/decisions.md, fifty-seventh session): what a GPU's
# kernels would store and launch is a speed property, which `bash benchmarks/mmv2_gpu.sh` measures on the
# GPU (its bytes and launches steps) and `python benchmarks/mmv2_bytes.py ... --device triton` prints here
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["short", "long"])
def test_compiled_memory_inputs_store_no_float32_rows_on_a_gpu(kind, monkeypatch):
    """On a GPU a float32 tensor as wide as a memory's rows, stored by one kernel for another to read,
    is the traffic the written-out backwards avoid (docs/results.md, issue #39). Lowered for Triton, whose
    fusion differs from the CPU backend's (loops of R and R - 1 positions do not fuse; a right pad is a
    stored concatenation), the compiled `memory_inputs` of either memory stores none, forward or backward."""
    monkeypatch.setattr(ContextualMemory, "read_dtype", lambda self, device: torch.bfloat16)  # CUDA's reads
    torch.manual_seed(0)
    config = MemoryMosaicsV2Config(vocab_size=64, n_layer=1, n_embd=128, n_head=4, ffn_hidden=256, scan_impl="compiled")
    memory = ContextualMemory(config, kind)
    B, T, H, hs = 2, 256, config.n_head, config.n_embd // config.n_head
    x = torch.randn(B, T, config.n_embd, requires_grad=True)
    doc_start = torch.tensor([[0] * 100 + [100] * 156, [0] * T])

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = memory(x * 1.0, doc_start, 8, None, 0)
        y.float().sum().backward()

    graphs = _lowered_graphs(run)
    assert [g.backward for g, _ in graphs] == [False, True]  # memory_inputs, one graph each way
    rows = {(B, H, n, hs) for n in (T - 1, T, T + 1)} | {(B, T, H, hs), (B, T, H * hs)}
    for graph, lowered in graphs:
        stored = [shape for dtype, shape in lowered.written if dtype == torch.float32 and shape in rows]
        assert stored == [], f"{'backward' if graph.backward else 'forward'} stores float32 rows {stored}"
        assert any(dtype == torch.bfloat16 and shape in rows for dtype, shape in lowered.written)
    # What the kernels move, in bf16 row tensors (B, H, T, hs), with torch 2.13: forward 13.9, backward
    # 20.9. Before the values' backward took one loop over the R positions it was 32.1; with a right pad
    # that inductor stores as a concatenation (F.pad(x, (0, 0, 0, 1)) in `_pad_end`), 26.1.
    row_bytes = B * H * T * hs * 2
    forward, backward = (lowered.bytes / row_bytes for _, lowered in graphs)
    assert forward < 15 and backward < 22, (forward, backward)


# slow: a speed property, as the store test above
@pytest.mark.slow
def test_a_static_decoding_block_launches_what_the_transformers_layer_does_plus_its_second_read(monkeypatch):
    """A StaticDecoder's compiled block (`static_block`, what its CUDA graph replays per block and
    token), lowered for Triton: the two memories' masks over their slots are computed once per step
    for all blocks (`static_readable_step`), as an additive mask, so a block launches 16 kernels at the
    small size (`python benchmarks/mmv2_bytes.py launches --device triton`; the transformer's layer:
    15). Computed in each block, as before, they made 21: two masks, two conversions of them for
    SDPA, and one more where the two reads are zeroed."""
    import mmv2_bytes

    from owai.models.hf_cache import output_cache
    from owai.models.memory_mosaics_v2 import MemoryMosaicsV2ForCausalLM, StaticDecoder

    monkeypatch.setattr(ContextualMemory, "read_dtype", lambda self, device: torch.bfloat16)  # CUDA's reads
    torch.manual_seed(0)
    config = MemoryMosaicsV2Config(vocab_size=64, n_layer=2, n_embd=128, n_head=4, ffn_hidden=256, scan_impl="compiled",
                                   static_decoding="on")
    model = MemoryMosaicsV2ForCausalLM(config).to(torch.bfloat16).eval()
    prefill = torch.randint(0, 64, (1, 40))
    with torch.no_grad():
        cache = output_cache(model(input_ids=prefill, use_cache=True))

        def run():
            StaticDecoder(model, cache, 64).step(prefill[:, :1])

        graphs = _lowered_graphs(run)
    launches = [mmv2_bytes._generated_launches(lowered.source) for _, lowered in graphs]
    block = launches[-1]  # after each memory kind's readable slots: one graph for both blocks
    assert len(block) <= 16 and block.count("extern_kernels.mm") == 5, block
    assert len(launches) == 3 and sum(len(step) for step in launches[:-1]) <= 4, launches


# slow: a speed property, as the store test above
@pytest.mark.slow
def test_a_compiled_blocks_reads_reach_o_proj_without_a_copy(monkeypatch):
    """flex_attention's output takes the layout of its queries. Compiled, for a flex read,
    `memory_inputs` stores them as (B, T, H, hs), so each memory's read is already o_proj's (B T, d)
    rows; stored as (B, H, T, hs) they made Triton copy every read once more, forward (64 MiB per
    memory at the small size, `python benchmarks/mmv2_bytes.py blocks --device triton --detail`)."""
    from owai.distributed import Parallel
    from owai.models.lm import blocks, build_lm

    monkeypatch.setattr(ContextualMemory, "read_dtype", lambda self, device: torch.bfloat16)  # CUDA's reads
    torch.manual_seed(0)
    B, T, H, hs = 2, 256, 4, 32
    model = build_lm("mmv2", n_layer=1, n_embd=H * hs, n_head=H, ffn_hidden=256, vocab_size=64, scan_impl="compiled",
                     attn_impl="flex").train()
    Parallel(model, blocks=blocks(model), compile_blocks=True)
    ids = torch.randint(0, 64, (B, T))
    positions = torch.arange(T) - torch.tensor([[0] * 100 + [100] * 156, [0] * T])  # two documents in row 0

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids, position_ids=positions, long_delay=8).logits
        logits.float().sum().backward()

    forward = [lowered for graph, lowered in _lowered_graphs(run) if not graph.backward]
    assert forward
    read, rows = (torch.bfloat16, (B, H, T, hs)), (torch.bfloat16, (B, T, H, hs))
    copies = [k for lowered in forward for k in lowered.buffers if k == ([read], [rows])]
    row_writers = [k for lowered in forward for k in lowered.buffers if read in k[1]]  # the shapes are the model's
    assert len(row_writers) >= 2 and copies == [], (len(row_writers), len(copies))


@pytest.mark.slow
def test_launches_compiles_v2s_decoding_graphs_again_at_each_context():
    """`mmv2_bytes.py launches` counts v2's three decoding graphs at each context in one process; at the
    second, dynamo answered one of them from its cache and the step stopped with "expected three
    compiled graphs" (mmv2_gpu.sh's 32k row on the GPU). Two capacities, on the CPU backend."""
    import mmv2_bytes

    for capacity in (mmv2_bytes.PREFILL + 34, mmv2_bytes.PREFILL + 66):
        graphs = mmv2_bytes._decode_graphs("mmv2", 1, "cpu", capacity)
        assert len(graphs) == 3, (capacity, len(graphs))
