"""Mutation audit of Memory Mosaics v2's CUDA-selected paths that the CPU can still run (issue #39):
which kernel reads (`uses_flex`, `flex_masks`, `ContextualMemory.read`), which scan compiles
(`_compiles_scan`, `memory_inputs_plan`), the read dtype (`read_dtype`), flex_attention's mask taking a
new delay without recompiling, and the generation cache's static path (`StaticDecoder`,
`_static_decoder`, `_graphs_fit`) and document starts (`_doc_starts`).

Each test pins a rule stated in a docstring of owai/models/memory_mosaics_v2.py or in
docs/decisions.md ("Issue #39: v2 on GPUs", "decoding steps as CUDA graphs"); its expected values come
from that rule, or from the uncached / dynamic-cache forward the rule says the path equals, never from
the path's own output. Several choose a kernel without changing the function, so the equality tests
of tests/test_memory_mosaics_v2.py cannot tell them apart: these tests ask which path ran."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_memory_mosaics_v2 import WIDE, packed_positions, stepped_logits, tiny_model

from owai.models import memory_mosaics_v2 as v2
from owai.models.memory_mosaics_v2 import MemoryMosaicsV2Cache, MemoryMosaicsV2Config

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a torch.device("cuda") needs no GPU to exist
T_FLEX = 40  # one length for the compiled flex reads, so that this file compiles flex_attention once


def test_uses_flex_only_for_reads_from_position_0_with_flex_or_auto_on_cuda():
    """`uses_flex`'s docstring: reads from position 0 go through flex_attention for attn_impl "flex",
    or "auto" on CUDA; cached steps (past > 0) read through SDPA either way, and "sdpa" never uses
    flex. (flex_attention has no CPU backward, so "auto" choosing it on the CPU would break training;
    "auto" not choosing it on CUDA would silently lose the kernel issue #39 is about.)"""
    want = {("flex", "cpu"): True, ("flex", "cuda"): True, ("auto", "cuda"): True,
            ("auto", "cpu"): False, ("sdpa", "cpu"): False, ("sdpa", "cuda"): False}
    for (impl, device), reads_flex in want.items():
        cfg = MemoryMosaicsV2Config(**{**WIDE, "attn_impl": impl})
        assert v2.uses_flex(cfg, torch.device(device), 0) is reads_flex, (impl, device)
        assert v2.uses_flex(cfg, torch.device(device), 7) is False, (impl, device)  # a cached continuation


def test_flex_reads_run_where_decisions_md_says(monkeypatch):
    """decisions.md, "flex_attention for reads from position 0": with attn_impl flex the short-term
    memory always reads through flex_attention, the long-term memory only with documents (without
    them it stays one causal SDPA on delay-shifted tensors); "sdpa" and cached steps never do. The
    equality tests compare flex with SDPA, so a path that silently fell back to SDPA would pass them:
    this counts the flex reads per forward (2 layers)."""
    calls = []
    real = v2._flex_read
    monkeypatch.setattr(v2, "_flex_read", lambda *args: calls.append(1) or real(*args))
    model = tiny_model(**{**WIDE, "attn_impl": "flex"}).float()
    ids = torch.randint(0, 50, (2, T_FLEX + 1), generator=torch.Generator().manual_seed(0))
    pos = packed_positions([[15, 25], [40]])
    with torch.no_grad():
        for position_ids, want in ((None, 2), (pos, 4)):  # short only; short and long
            calls.clear()
            model(input_ids=ids[:, :T_FLEX], position_ids=position_ids)
            assert len(calls) == want, (position_ids is not None, len(calls))
        assert set(v2.flex_masks(model.config, None, 2, T_FLEX, 20, CPU)) == {"short"}
        model.config.attn_impl = "sdpa"
        calls.clear()
        model(input_ids=ids[:, :T_FLEX], position_ids=pos)
        assert calls == []
        model.config.attn_impl = "flex"
        cache = MemoryMosaicsV2Cache()
        model(input_ids=ids[:, :T_FLEX], past_key_values=cache, use_cache=True)  # the prefill reads through flex
        calls.clear()
        model(input_ids=ids[:, T_FLEX:], past_key_values=cache, use_cache=True)  # past = T_FLEX: SDPA
        assert calls == []


def test_a_new_delay_reuses_the_compiled_flex_read():
    """decisions.md: the mask's lo, hi and document starts enter the mask_mod as tensors, "so a new
    delay m or new documents do not recompile". Two delays of the long-term memory's flex mask (with
    documents, where it reads through flex) go through the one compiled flex_attention with dynamo's
    recompilation an error; a delay captured as a Python int would recompile per delay."""
    torch.manual_seed(0)
    B, H, T, hs = 2, WIDE["n_head"], T_FLEX, WIDE["n_embd"] // WIDE["n_head"]  # the shapes of the test above
    q, keys = torch.randn(B, H, T, hs), F.normalize(torch.randn(B, H, T, hs), dim=-1)
    values = torch.randn(B, H, T - 1, hs)
    doc_start = torch.tensor([[0] * 15 + [15] * 25, [0] * 40])
    with torch.no_grad():
        first = v2._flex_read(q, keys, values, v2.flex_block_mask(doc_start, B, T, 3, None, CPU))  # may compile
        with torch._dynamo.config.patch(error_on_recompile=True):
            second = v2._flex_read(q, keys, values, v2.flex_block_mask(doc_start, B, T, 9, None, CPU))
    assert not torch.equal(first, second)  # the delay did change the read


def test_compiles_scan_where_its_docstring_says(monkeypatch):
    """`_compiles_scan`: the key scan and a decoding step's arithmetic run compiled for scan_impl
    "compiled" anywhere, for "auto" or "triton" on CUDA only, "chunked" never, and never inside an
    outer torch.compile (the plain function is traced into that graph)."""
    for impl, device, want in (("compiled", CPU, True), ("compiled", CUDA, True), ("auto", CUDA, True),
                               ("triton", CUDA, True), ("auto", CPU, False), ("triton", CPU, False),
                               ("chunked", CUDA, False), ("chunked", CPU, False)):
        cfg = MemoryMosaicsV2Config(**{**WIDE, "scan_impl": impl})
        assert v2._compiles_scan(cfg, device) is want, (impl, device.type)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for impl in ("compiled", "auto"):
        assert v2._compiles_scan(MemoryMosaicsV2Config(**{**WIDE, "scan_impl": impl}), CUDA) is False


@pytest.mark.parametrize("T", [1, 8, 9, 70, 100, 288, 4097])
def test_memory_inputs_plan_where_and_with_which_chunk(monkeypatch, T):
    """`memory_inputs_plan`'s docstring: "auto" compiles on CUDA when T > scan_chunk (training,
    prefill), never for decoding steps nor on the CPU; "compiled" everywhere; "chunked" never. A
    compiled chunked scan's chunk is at least ceil(sqrt(T)) (one level of recursion: inductor
    miscompiles three), so chunk^2 >= T; an eager one keeps scan_chunk. Inside an outer torch.compile
    nothing compiles on its own, and the traced scan takes the wide chunk too."""
    chunk = 8  # WIDE's scan_chunk
    wide = max(chunk, math.ceil(math.sqrt(T)))  # the smallest chunk with chunk^2 >= T, at least scan_chunk
    cases = {("auto", CUDA): T > chunk, ("auto", CPU): False, ("compiled", CPU): True, ("compiled", CUDA): True,
             ("chunked", CUDA): False}
    for (impl, device), compiles in cases.items():
        cfg = MemoryMosaicsV2Config(**{**WIDE, "scan_impl": impl})
        assert v2.memory_inputs_plan(cfg, device, T) == (compiles, wide if compiles else chunk, "chunked"), (impl, device.type)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for impl in ("auto", "chunked", "compiled"):
        cfg = MemoryMosaicsV2Config(**{**WIDE, "scan_impl": impl})
        assert v2.memory_inputs_plan(cfg, CPU, T) == (False, wide, "chunked"), impl


def test_the_triton_scan_is_compiled_around_on_cuda_only():
    """`memory_inputs_plan`: scan_impl "triton" runs owai's kernel; the elementwise work around it
    compiles with it on CUDA, and on the CPU (Triton's interpreter, tests/conftest.py) nothing is
    compiled."""
    from owai.models import key_scan_triton

    cfg = MemoryMosaicsV2Config(**{**WIDE, "scan_impl": "triton"})
    try:
        key_scan_triton.require(CPU)
    except Exception as err:  # noqa: BLE001 - no triton, or not interpreting
        pytest.skip(f"no Triton interpreter here: {err}")
    assert v2.memory_inputs_plan(cfg, CPU, 300) == (False, 8, "triton")


def test_read_dtype_is_the_autocast_dtype_on_cuda_and_float32_or_wider_on_cpu():
    """`ContextualMemory.read_dtype`'s docstring (decisions.md, "Read dtype"): on CUDA the autocast
    dtype, else the weights' (bf16 evaluation: flash/flex kernels, half the cache); on the CPU float32
    or wider whatever the weights. CUDA's autocast state is a per-thread flag that a CPU build holds
    too, so it is set (and restored) here without a GPU."""
    memory = tiny_model().layers[0].short  # float64
    assert memory.read_dtype(CPU) == torch.float64 and memory.read_dtype(CUDA) == torch.float64
    memory.to(torch.bfloat16)
    assert memory.read_dtype(CPU) == torch.float32 and memory.read_dtype(CUDA) == torch.bfloat16
    memory.float()
    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    try:
        torch.set_autocast_enabled("cuda", True)
        for autocast in (torch.bfloat16, torch.float16):
            torch.set_autocast_dtype("cuda", autocast)
            assert memory.read_dtype(CUDA) == autocast
            assert memory.read_dtype(CPU) == torch.float32  # CUDA's autocast is not the CPU's
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", dtype)
    assert memory.read_dtype(CUDA) == torch.float32


def test_static_decoding_at_a_delay_other_than_the_evaluation_one_equals_the_full_forward():
    """decisions.md, "decoding steps as CUDA graphs": a StaticDecoder serves steps at the evaluation
    delay only (its step reads at long_delay_eval). Steps at another delay, with static_decoding on,
    keep the dynamic cache and give the uncached forward's logits at that delay."""
    model = tiny_model(static_decoding="on")  # long_delay_eval = 3
    ids = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(input_ids=ids, long_delay=6).logits
        assert not torch.allclose(full, model(input_ids=ids).logits, atol=1e-6)  # the delay matters here
        cache = MemoryMosaicsV2Cache()
        cache.capacity = 21
        parts = [model(input_ids=ids[:, :8], past_key_values=cache, use_cache=True, long_delay=6).logits]
        parts += [model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True, long_delay=6).logits
                  for t in range(8, 20)]
    assert cache.decoder is None
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-7, rtol=1e-7)


def _textbook_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """softmax(q k^T scale + mask) v written out, as a kernel that does not special-case a row whose
    keys are all masked: there it gives NaN (exp(-inf) / 0), not 0."""
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return torch.softmax(scores, dim=-1) @ v


def test_static_steps_with_nothing_readable_give_0_whatever_the_attention_kernel(monkeypatch):
    """A read with nothing readable gives 0 (eq 4.2's empty sum; decisions.md, "Empty rows give 0").
    The CPU's SDPA kernels already return 0 for a row whose keys are all masked, so on the CPU only a
    kernel that does not (the softmax written out, NaN there) shows whether the static step zeroes it
    itself, as it must for CUDA's kernels: right after a 1-token prefill the long-term memory (delay 3)
    has nothing readable for two steps. The static steps stay finite and equal the dynamic cache's,
    which skips those reads."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", _textbook_sdpa)
    model = tiny_model(static_decoding="on")
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(2))
    (off, _), (on, cache) = stepped_logits(model, ids, 1, 13).values()
    assert cache.decoder is not None and torch.isfinite(off).all()
    assert torch.isfinite(on).all()
    torch.testing.assert_close(on, off, atol=1e-12, rtol=1e-12)


def test_graphs_are_only_tried_on_cuda_and_never_again_after_a_failure(monkeypatch):
    """`_graphs_fit` (static_decoding auto): a StaticDecoder only on CUDA, and once building one has
    failed in this process ("graphs-failed"), later generations do not try again (decisions.md: "later
    generations do not try again in that process"). On the CPU, auto generates on the dynamic cache."""
    model = tiny_model()
    monkeypatch.setattr(v2, "_COMPILED", {})
    assert model._graphs_fit(CPU) is False and model._graphs_fit(CUDA) is True
    monkeypatch.setattr(v2, "_COMPILED", {"graphs-failed": True})
    assert model._graphs_fit(CUDA) is False
    monkeypatch.setattr(v2, "_COMPILED", {})
    from owai.models.hf_cache import cache_kwargs

    cache = MemoryMosaicsV2Cache()
    model.generate(input_ids=torch.randint(0, 50, (1, 4)), max_new_tokens=3, do_sample=False, **cache_kwargs(cache))
    assert cache.capacity == 7 and cache.decoder is None


def test_the_attention_mask_decides_what_is_read_even_with_plain_position_ids():
    """`_doc_starts`: with a left-padding attention_mask, "the mask decides what is read, as in HF's
    models: no position reads padding", whatever position_ids say. A caller that passes plain
    positions 0..T-1 with a left-padded row gets, at the real tokens, the row's logits alone."""
    model = tiny_model()
    short, long = torch.randint(1, 50, (1, 6)), torch.randint(1, 50, (1, 10))
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
    mask = (torch.arange(10)[None] >= torch.tensor([[4], [0]])).long()
    with torch.no_grad():
        together = model(input_ids=batch, attention_mask=mask, position_ids=torch.arange(10).expand(2, 10)).logits
        torch.testing.assert_close(together[0, 4:], model(input_ids=short).logits[0], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(together[1], model(input_ids=long).logits[0], atol=1e-10, rtol=1e-10)


def _reads_of(block_mask, B: int, T: int) -> tuple[torch.Tensor, dict]:
    """What flex_attention reads under `block_mask`, from its block lists alone (a key in a full block
    is read, one in a partial block where the mask_mod says so, any other not), evaluated here without
    flex_attention: ((B, T, T) bool, {(b, query block, key block): "full" | "partial" | "both"}). A
    small T: this dense form is the test's, not the model's."""
    blk = v2.FLEX_BLOCK
    reads, kinds = torch.zeros(B, T, T, dtype=torch.bool), {}
    lists = ((block_mask.kv_num_blocks, block_mask.kv_indices, "partial"),
             (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, "full"))
    for b in range(B):
        for qb in range(-(-T // blk)):
            q = torch.arange(qb * blk, min(T, (qb + 1) * blk))
            for counts, indices, kind in lists:
                for kb in indices[b, 0, qb, : int(counts[b, 0, qb])].tolist():
                    kinds[b, qb, kb] = "both" if (b, qb, kb) in kinds else kind
                    kv = torch.arange(kb * blk, min(T, (kb + 1) * blk))
                    ok = (block_mask.mask_mod(torch.tensor(b), torch.tensor(0), q[:, None], kv[None, :]) if kind == "partial"
                          else torch.ones(len(q), len(kv), dtype=torch.bool))
                    reads[b, q[:, None], kv[None, :]] |= ok
    return reads, kinds


@pytest.mark.parametrize("T", [300, 256])
@pytest.mark.parametrize("documents", [False, True])
def test_flex_block_masks_read_exactly_eq_4_2s_sets(T, documents):
    """`flex_block_mask` for lags lo <= t - j (<= hi) and j >= ds_t (eq 4.2: the short-term memory
    1 <= t-j <= h-1, the long-term t-j >= m, both inside the query's document). The keys a query reads
    through the block lists are exactly that set, written out per pair here. And the blocks are
    classed as decisions.md says ("Block masks built by owai from per-block bounds"): a block pair is
    listed once; of two whole blocks, "all readable" is a full block (read with no mask_mod) and
    nothing else is; a key block with no lag in [lo, hi] from the query block, or wholly before every
    query's document start in it, is skipped. Lags on block edges (127, 128, 255, the last block's 43 at T = 300)
    are where a bound one off would skip, or read unmasked, a block it must not."""
    B, blk = 2, v2.FLEX_BLOCK
    if documents:  # row 1: a document from 200 on, so the last query block (256..) starts after key block 0
        lengths = [[130, 41, T - 171], [10, 190, T - 200]]
        ds = torch.stack([torch.cat([torch.full((n,), sum(row[:i])) for i, n in enumerate(row)]) for row in lengths])
    else:
        ds = torch.zeros(B, T, dtype=torch.long)
    t, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    n = -(-T // blk)
    for lo, hi in ((1, 149), (1, 255), (1, 127), (43, None), (127, None), (128, None), (64, None)):
        want = (t - j >= lo) & (j >= ds[:, :, None])
        if hi is not None:
            want = want & (t - j <= hi)
        block_mask = v2.flex_block_mask(ds if documents else None, B, T, lo, hi, CPU)
        # flex_attention's BlockMask format: ceil(T / 128) query blocks, each listing key blocks of the same count
        assert block_mask.kv_num_blocks.shape == block_mask.full_kv_num_blocks.shape == (B, 1, n)
        assert block_mask.kv_indices.shape == block_mask.full_kv_indices.shape == (B, 1, n, n)
        assert block_mask.seq_lengths == (T, T) and block_mask.BLOCK_SIZE == (blk, blk)
        got, kinds = _reads_of(block_mask, B, T)
        assert torch.equal(got, want), (lo, hi, (got != want).nonzero()[:5].tolist())
        for b in range(B):
            for qb in range(n):
                q = slice(qb * blk, min(T, (qb + 1) * blk))
                for kb in range(n):
                    k = slice(kb * blk, min(T, (kb + 1) * blk))
                    kind, pairs = kinds.get((b, qb, kb)), want[b, q, k]
                    lags = (t[q] - j[:, k]).flatten()
                    where = (lo, hi, b, qb, kb, kind)
                    assert kind != "both", where
                    if (qb + 1) * blk <= T and (kb + 1) * blk <= T:  # two whole blocks
                        assert (kind == "full") == bool(pairs.all()), where
                    if not ((lags >= lo) & (lags <= (T if hi is None else hi))).any() or k.stop - 1 < ds[b, q].min():
                        assert kind is None, where


def test_a_left_padded_batch_keeps_the_dynamic_cache_and_reads_no_padding():
    """decisions.md, "When it is used": a StaticDecoder serves one document per row, "a left-padded
    batch keeps the dynamic cache" (the decoder's slots hold no document starts, so its steps would
    read the padding). With static_decoding on, a left-padded batch's cached steps give, at each row's
    real tokens, the row's logits alone (the uncached forward), and no decoder is built."""
    model = tiny_model(static_decoding="on")
    gen = torch.Generator().manual_seed(5)
    short, long, new = (torch.randint(1, 50, shape, generator=gen) for shape in ((1, 6), (1, 10), (2, 6)))
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
    mask = (torch.arange(16)[None] >= torch.tensor([[4], [0]])).long()
    cache = MemoryMosaicsV2Cache()
    cache.capacity = 17
    with torch.no_grad():
        parts = [model(input_ids=batch, attention_mask=mask[:, :10], past_key_values=cache, use_cache=True).logits]
        parts += [model(input_ids=new[:, i:i + 1], attention_mask=mask[:, :11 + i], past_key_values=cache,
                        use_cache=True).logits for i in range(6)]
        stepped = torch.cat(parts, 1)
        alone = [model(input_ids=torch.cat([row, new[i:i + 1]], 1)).logits[0] for i, row in enumerate((short, long))]
    torch.testing.assert_close(stepped[0, 4:], alone[0], atol=1e-7, rtol=1e-7)
    torch.testing.assert_close(stepped[1], alone[1], atol=1e-7, rtol=1e-7)
    assert cache.decoder is None


def test_a_static_decoders_slots_are_the_documented_buffers():
    """decisions.md, "What a graph needs": the long-term memory keeps one slot per position up to the
    generation's length rounded up to 64 (aligned rows for the SDPA kernels' masks), the short-term
    memory a ring of span + 1 slots, position t in slot t mod (span + 1); each slot records the
    position it holds (-1: none). After a prefill of 12 and capacity 70 (short_window 5: span 4)."""
    model = tiny_model(static_decoding="on")
    ids = torch.randint(0, 50, (2, 13), generator=torch.Generator().manual_seed(6))
    cache = MemoryMosaicsV2Cache()
    cache.capacity = 70
    with torch.no_grad():
        model(input_ids=ids[:, :12], past_key_values=cache, use_cache=True)
        model(input_ids=ids[:, 12:], past_key_values=cache, use_cache=True)  # position 12: the decoder is built
    decoder = cache.decoder
    assert decoder.layers[0]["long"]["keys"].shape[2] == 128 and decoder.layers[0]["short"]["keys"].shape[2] == 5
    assert decoder.slot_pos["long"].tolist() == list(range(13)) + [-1] * 115
    assert decoder.slot_pos["short"].tolist() == [10, 11, 12, 8, 9]  # positions 8..12, slot t mod 5


def test_no_graphs_for_a_model_whose_parameters_are_dtensors(tmp_path, monkeypatch):
    """`_graphs_fit`: no CUDA graph for an FSDP-sharded model, whose hooks gather weights with
    collectives that a captured graph would replay on one rank. Sharded parameters are DTensors: one
    (replicated on a one-process gloo group, which is not "multi-rank") is enough to refuse."""
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, Replicate, distribute_tensor

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, not already initialised")
    monkeypatch.setattr(v2, "_COMPILED", {})
    model = tiny_model()
    assert model._graphs_fit(CUDA) is True
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        weight = distribute_tensor(model.lm_head.weight.detach(), DeviceMesh("cpu", [0]), [Replicate()])
        model.lm_head.weight = torch.nn.Parameter(weight)
        assert model._graphs_fit(CUDA) is False
    finally:
        dist.destroy_process_group()
