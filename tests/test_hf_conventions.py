"""owai's language models as a Hugging Face caller uses them: what a modeling file of transformers
honours is honoured or refused in one line, never swallowed (beam search's cache reorder, the
attention mask beside position_ids, hidden states asked for, resized vocabularies, packed documents)."""

from __future__ import annotations

import pytest
import torch

from owai.errors import OwaiError
from owai.models.lm import build_lm

TINY = {
    "gpt": dict(vocab_size=97, n_layer=2, n_embd=32, n_head=2, block_size=64, dropout=0.0),
    "mm": dict(vocab_size=97, n_layer=2, n_embd=32, n_head=2, ic_dropout=0.0, hd_dropout=0.0),
    "lstm": dict(vocab_size=97, n_layer=2, n_embd=32),
    "mmv2": dict(vocab_size=97, n_layer=2, n_embd=32, n_head=2, ffn_hidden=64, short_window=8, long_delay_train=[4, 8],
                 long_delay_eval=4),
}


def tiny(arch: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_lm(arch, **{**TINY[arch], **overrides}).eval()


def test_v2_beam_search_reads_each_beams_own_memories():
    """The cache's reorder walked tuples and dicts but not its list of layers: beam search reordered
    nothing, and each beam decoded from another beam's memories (owai's `beam2` continuations too)."""
    from owai.models.memory_mosaics_v2 import MemoryMosaicsV2Cache

    model = tiny("mmv2")
    g = torch.Generator().manual_seed(3)
    kw = dict(max_new_tokens=10, num_beams=3, num_return_sequences=2, do_sample=False, pad_token_id=0)
    for rows in (1, 2):
        prompt = torch.randint(1, 97, (rows, 10), generator=g)
        assert torch.equal(model.generate(prompt, **kw), model.generate(prompt, use_cache=False, **kw))
    cache = MemoryMosaicsV2Cache()
    with torch.no_grad():
        model(input_ids=torch.randint(1, 97, (3, 12), generator=g), cache=cache, use_cache=True)
    before = [t.clone() for t in _tensors(cache.layers)]
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    after = _tensors(cache.layers)
    assert before and all(torch.equal(b[[2, 0, 0]], a) for b, a in zip(before, after) if b.dim())
    cache.batch_repeat_interleave(2)
    assert cache.batch_size() == 6


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return [t for v in values for t in _tensors(v)]


def test_v2_honours_the_attention_mask_beside_position_ids():
    """With position_ids given, v2 used the mask only to count positions, so a left-padded row read
    its padding: now a row padded on the left equals the same tokens alone, whatever positions."""
    model = tiny("mmv2")
    tokens = torch.randint(1, 97, (1, 10))
    padded = torch.cat([torch.zeros(1, 6, dtype=torch.long), tokens], 1)
    mask = torch.cat([torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 10, dtype=torch.long)], 1)
    with torch.no_grad():
        alone = model(input_ids=tokens).logits
        for positions in (torch.arange(16)[None], (mask.cumsum(-1) - 1).clamp(min=0)):
            read = model(input_ids=padded, attention_mask=mask, position_ids=positions).logits[:, 6:]
            assert torch.allclose(read, alone, atol=1e-5), positions


def test_a_v2_cache_of_another_batch_is_one_line():
    from owai.models.memory_mosaics_v2 import MemoryMosaicsV2Cache

    model = tiny("mmv2")
    cache = MemoryMosaicsV2Cache()
    with torch.no_grad():
        model(input_ids=torch.randint(1, 97, (1, 6)), cache=cache, use_cache=True)
        with pytest.raises(OwaiError, match=r"batch size 2 differs from the cache's \(1\)"):
            model(input_ids=torch.randint(1, 97, (2, 1)), cache=cache, use_cache=True)


@pytest.mark.parametrize("arch", list(TINY))
@pytest.mark.parametrize("asked", ["output_hidden_states", "output_attentions"])
def test_hidden_states_and_attentions_asked_for_are_refused(arch, asked):
    """They were swallowed by **kwargs and came back as None (in generate's output too)."""
    with pytest.raises(OwaiError, match=f"{asked} not supported"):
        tiny(arch)(input_ids=torch.randint(1, 97, (1, 5)), **{asked: True})


@pytest.mark.parametrize("arch", list(TINY))
def test_input_embeddings_are_refused_alone_or_beside_ids(arch):
    """GPT and the LSTM returned the ids' logits beside inputs_embeds, and alone it was a TypeError."""
    model = tiny(arch)
    embeds = torch.randn(1, 5, 32)
    for kwargs in ({"inputs_embeds": embeds}, {"input_ids": torch.randint(1, 97, (1, 5)), "inputs_embeds": embeds}):
        with pytest.raises(OwaiError, match="inputs_embeds is not supported"):
            model(**kwargs)


@pytest.mark.parametrize("arch", ["lstm"])
def test_logits_to_keep_where_every_position_is_computed_is_refused(arch):
    with pytest.raises(OwaiError, match="logits_to_keep not supported"):
        tiny(arch)(input_ids=torch.randint(1, 97, (1, 5)), logits_to_keep=1)


@pytest.mark.parametrize("arch", ["gpt", "mm", "mmv2"])
def test_generate_computes_only_the_last_positions_logits_of_a_prompt(arch):
    """generate asks for the last position's logits alone (`logits_to_keep=1`) of a model whose forward
    takes it: v1 computed the whole prompt's (T, V) float32 logits, 26 GB for a 128k-token prompt with a
    50k vocabulary, to read one row."""
    model = tiny(arch)
    x = torch.randint(1, 97, (2, 9))
    with torch.no_grad():
        full = model(input_ids=x).logits
        kept = model(input_ids=x, logits_to_keep=3).logits
    assert kept.shape == (2, 3, 97) and torch.allclose(kept, full[:, -3:], atol=1e-6)
    widths = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: widths.append(o.shape[1]))
    model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0)
    hook.remove()
    assert widths and max(widths) == 1


def test_v2_with_a_bag_of_k_head_refuses_a_resized_vocabulary():
    """The bag head kept the old vocabulary: a larger one failed in the loss and on reload, a smaller
    one trained on tokens that no longer exist."""
    bagged = tiny("mmv2", bag_of_k=4)
    with pytest.raises(OwaiError, match="bag-of-k head"):
        bagged.resize_token_embeddings(120)
    with pytest.raises(OwaiError, match="bag-of-k head"):
        bagged.resize_token_embeddings(pad_to_multiple_of=64)  # 97 -> 128
    # a call that keeps the size hands the embeddings back, as HF callers use it
    assert bagged.resize_token_embeddings() is bagged.get_input_embeddings()
    assert bagged.resize_token_embeddings(97).weight.shape[0] == 97
    assert tiny("mmv2").resize_token_embeddings(120).weight.shape[0] == 120


def test_the_lstm_resizes_its_vocabulary():
    """transformers' resize needs set_input_embeddings / set_output_embeddings (NotImplementedError)."""
    model = tiny("lstm")
    model.resize_token_embeddings(120)
    assert model.get_input_embeddings().weight.shape[0] == 120 and model.get_output_embeddings().weight.shape[0] == 120
    assert model(input_ids=torch.tensor([[119, 3]])).logits.shape == (1, 2, 120)


@pytest.mark.parametrize("arch", ["gpt", "mm", "mmv2", "lstm"])
def test_every_model_computes_its_loss_in_float32_from_bf16_logits(arch):
    """transformers' causal-LM loss, one implementation (hf_cache.causal_lm_loss): labels shifted,
    -100 ignored, in float32 (v1's was taken in bf16 from bf16 weights)."""
    model = tiny(arch).to(torch.bfloat16)
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, 5] = -100
    out = model(input_ids=ids, labels=labels)
    expected = torch.nn.functional.cross_entropy(out.logits.float()[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    assert out.loss.dtype == torch.float32 and torch.allclose(out.loss, expected)


@pytest.mark.parametrize("archs", ["gpt", "mm,mmv2", "lstm"])
def test_packed_documents_are_refused_for_models_that_would_read_across_them(archs, tmp_path, capsys):
    """mosaic-train passes restarting position_ids with data.documents; GPT, Memory Mosaics v1 and the
    LSTM ignored them (attention, or state, across documents) and trained."""
    from conftest import cli_in_process

    code, _, err = cli_in_process(["mosaic-train", "-p", "cpu", "--arch", archs, "--set", "data.documents=true",
                                   "--out", str(tmp_path / "runs")], capsys)
    assert code == 2 and "would read across documents" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_gpt_builds_no_mask_for_a_prompt_without_padding(position):
    """generate passes a mask of ones with one prompt: GPT built a (B, 1, T, T) mask from it (16 GiB at
    128k tokens) and left SDPA's causal kernels for its masked ones. A mask without padding is no mask,
    and the continuations are the same."""
    model = tiny("gpt", position=position)
    ones = torch.ones(2, 9, dtype=torch.long)
    assert model._attention_mask(2, 9, 0, ones, "cpu") == (None, True)
    assert model._attention_mask(2, 1, 8, ones, "cpu") == (None, False)
    padded = ones.clone()
    padded[1, :2] = 0
    mask, causal = model._attention_mask(2, 9, 0, padded, "cpu")
    assert mask.shape == (2, 1, 9, 9) and not causal
    with pytest.raises(OwaiError, match="attention_mask must be 2-D"):
        model._attention_mask(2, 9, 0, torch.ones(2, 8), "cpu")
    x = torch.randint(1, 97, (1, 9))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=x, attention_mask=torch.ones_like(x)).logits, model(input_ids=x).logits,
                              atol=1e-6)
