"""Every owai language model decodes the same tokens with and without a generation cache, batched and
left-padded, and `generate` logs no deprecation message (issue #35: transformers 5 renamed the cache
argument to `cache`, and a model that only read `past_key_values` silently decoded without its past)."""

import logging
import warnings

import pytest
import torch
from transformers.utils import logging as hf_logging

from owai.errors import OwaiError
from owai.models.hf_cache import cache_kwargs, output_cache
from owai.models.lm import build_lm

V = 40
TINY = {
    "gpt": dict(n_layer=2, n_embd=32, n_head=4, block_size=32, position="rope", initializer_range=0.2),
    "mm": dict(n_layer=2, n_embd=32, n_head=4, pmem_size=8, leaky_chunk=4, ic_dropout=0.0, hd_dropout=0.0),
    "lstm": dict(n_layer=2, n_embd=32),
    "mmv2": dict(n_layer=2, n_embd=16, n_head=2, ffn_hidden=24, short_window=5, long_delay_eval=3, scan_chunk=4,
                 query_block=3),
    "transformer": dict(n_layer=2, n_embd=32, n_head=4, ffn_hidden=64, initializer_range=0.2),
}
PADDED = ("gpt", "lstm", "mmv2", "transformer")  # Memory Mosaics v1 refuses padded batches
GEN = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)


def tiny(arch: str):
    torch.manual_seed(0)
    model = build_lm(arch, vocab_size=V, **TINY[arch]).eval()
    with torch.no_grad():  # peaked, context-dependent logits: greedy continuations are not one repeated token
        for name, p in model.named_parameters():
            if arch == "mm":  # random (not initial) per-head scalars
                if p.dim() == 1 and "ln" not in name:
                    p.add_(0.3 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.mul_(8**0.5)
    return model


def _prompts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 7-token and a 4-token prompt, the short one left-padded with 3 zeros: (ids, batch, mask)."""
    g = torch.Generator().manual_seed(1)
    long, short = torch.randint(1, V, (1, 7), generator=g), torch.randint(1, V, (1, 4), generator=g)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = (torch.arange(7)[None] >= torch.tensor([[3], [0]])).long()
    return short, batch, mask


@pytest.mark.parametrize("arch", sorted(TINY))
def test_cached_generate_equals_uncached_batched(arch):
    model = tiny(arch)
    prompt = torch.randint(1, V, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cached = model.generate(prompt, attention_mask=torch.ones_like(prompt), **GEN)
        uncached = model.generate(prompt, attention_mask=torch.ones_like(prompt), use_cache=False, **GEN)
    assert cached.shape == (2, 14)
    assert torch.equal(cached, uncached)
    assert len(set(cached[0, 6:].tolist())) > 1 and not torch.equal(cached[0, 6:], cached[1, 6:])


@pytest.mark.parametrize("arch", PADDED)
def test_left_padded_generate_equals_each_prompt_alone(arch):
    model = tiny(arch)
    short, batch, mask = _prompts()
    with torch.no_grad():
        cached = model.generate(batch, attention_mask=mask, **GEN)
        uncached = model.generate(batch, attention_mask=mask, use_cache=False, **GEN)
        alone_short = model.generate(short, attention_mask=torch.ones_like(short), **GEN)
        alone_long = model.generate(batch[1:], attention_mask=mask[1:], **GEN)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[0, 7:], alone_short[0, 4:])
    assert torch.equal(cached[1], alone_long[0])


def test_memory_mosaics_refuses_a_padded_batch():
    _, batch, mask = _prompts()
    with pytest.raises(OwaiError, match="padded attention_mask"):
        tiny("mm").generate(batch, attention_mask=mask, **GEN)


@pytest.mark.parametrize("arch", sorted(TINY))
def test_incremental_forward_with_the_returned_cache_equals_one_pass(arch):
    model = tiny(arch)
    ids = torch.randint(1, V, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        first = model(input_ids=ids[:, :6], use_cache=True)
        rest = model(input_ids=ids[:, 6:], use_cache=True, **cache_kwargs(output_cache(first))).logits
        whole = model(input_ids=ids).logits
    assert output_cache(first) is not None
    assert torch.allclose(torch.cat([first.logits, rest], 1), whole, atol=1e-4, rtol=0)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("arch", sorted(TINY))
def test_generate_logs_and_warns_nothing_deprecated(arch):
    model = tiny(arch)
    _, batch, mask = _prompts()
    if arch == "mm":
        batch, mask = batch[1:], mask[1:]
    hf_logging.warning_once.cache_clear()  # transformers logs each message once per process
    handler = _Records()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            out = model.generate(batch, attention_mask=mask, return_dict_in_generate=True, **GEN)
            model(input_ids=out.sequences[:, -1:], use_cache=True, **cache_kwargs(output_cache(out)))
    finally:
        hf_logger.removeHandler(handler)
    said = handler.messages + [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    assert not [m for m in said if "deprecat" in m.lower()], said


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_a_cache_repeated_along_the_batch_frees_each_layers_old_tensors_first(kind):
    """`copy_cache` repeats a prefix's copy B times for a batch of prompts: the cache's `_apply` replaces
    its tensors a layer at a time, so when a layer's new tensors are made every earlier layer's old ones
    are gone, and the peak is B copies plus one layer, not B + 1 copies (a long prefix's copy is
    gigabytes)."""
    import weakref

    from owai.models.memory_mosaics import MemoryMosaicsCache
    from owai.models.memory_mosaics_v2 import MemoryMosaicsV2Cache

    cache = MemoryMosaicsCache() if kind == "v1" else MemoryMosaicsV2Cache()
    n_layers = 4
    if kind == "v1":
        cache.layers = [{"keys": torch.randn(1, 2, 8, 4), "values": torch.randn(1, 2, 8, 4)} for _ in range(n_layers)]
    else:
        cache.layers = [{"short": {"k": torch.randn(1, 2, 8, 4), "n": torch.tensor(3)},
                         "long": {"k": torch.randn(1, 2, 8, 4)}} for _ in range(n_layers)]
        cache.doc_start = torch.zeros(1, dtype=torch.long)

    def batched(layer) -> list:
        return [t for t in (layer.values() if isinstance(layer, dict) else [layer])
                for t in (batched(t) if isinstance(t, dict) else [t] if t.dim() else [])]

    old = [[weakref.ref(t) for t in batched(layer)] for layer in cache.layers]
    seen: list[int] = []

    def repeat(t: torch.Tensor) -> torch.Tensor:
        layer = next((i for i, refs in enumerate(old) if any(r() is t for r in refs)), None)
        if layer is None:  # v2's document starts, after the layers
            return t.repeat_interleave(3, dim=0)
        alive = [i for i, refs in enumerate(old[:layer]) if any(r() is not None for r in refs)]
        assert alive == [], f"layer {layer}'s copy made while layers {alive}'s old tensors are alive"
        seen.append(layer)
        return t.repeat_interleave(3, dim=0)

    cache._apply(repeat)
    assert sorted(set(seen)) == list(range(n_layers))
    assert all(t.shape[0] == 3 for layer in cache.layers for t in batched(layer))
    if kind == "v2":
        assert cache.doc_start.shape == (3,) and cache.layers[0]["short"]["n"].dim() == 0
