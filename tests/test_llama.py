"""The transformer baseline of ch. 4: transformers' LlamaForCausalLM through owai.models.llama and the zoo."""

from __future__ import annotations

import json
import resource

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from owai.errors import OwaiError
from owai.models.hf_cache import cache_kwargs, output_cache
from owai.models.sizes import SIZES
from owai.models.lm import (
    ARCHITECTURES,
    blocks,
    build_lm,
    build_sized_lm,
    context_limit,
    decay_param_groups,
    lm_config,
    load_pretrained,
)
from owai.models.llama import (
    document_ids,
    document_mask,
    llama_config,
    packed_document_attention,
    size_config,
    transformer_lm,
)

V = 97
SMALL = dict(n_layer=2, n_embd=64, n_head=4, ffn_hidden=128, vocab_size=V)


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return build_lm("transformer", **{**SMALL, **overrides}).eval()


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def count_parameters(size: str, arch: str = "transformer", **kw) -> int:
    return build_sized_lm(arch, size, meta=True, **kw).num_parameters()


def test_thesis_sizes_counted_on_the_meta_device():
    before = _peak_rss_mb()
    small, large = count_parameters("small"), count_parameters("large")
    print(f"transformer small: {small:,} parameters; large: {large:,}")
    assert abs(large - 8.84e9) / 8.84e9 < 0.005  # Table 4.2: 8.8B
    assert abs(small - 1.83e9) / 1.83e9 < 0.005
    # Table 4.2: Memory Mosaics v2 large 9.9B, and 8.3B without its long-term memory
    mm_large, mm_no_ltm = count_parameters("large", "mmv2"), count_parameters("large", "mmv2", long_term_memory=False)
    assert round(mm_large / 1e9, 1) == 9.9 and round(mm_no_ltm / 1e9, 1) == 8.3
    # the same blocks: + 2 d^2 per layer (two memories of 3 d^2 against 4 d^2 of attention) + per-head gates
    assert mm_large - large == 32 * (2 * 4096**2 + 2 * (2 * 32 * 4096 + 4 * 32))
    assert mm_large - mm_no_ltm == 32 * (3 * 4096**2 + 2 * 32 * 4096 + 4 * 32)
    # by hand: untied embeddings + per block 4 C^2 attention + 3 C F SwiGLU + 2 RMSNorms, final norm
    for size, total in (("small", small), ("large", large)):
        s = SIZES[size]
        c, f, v = s["n_embd"], s["ffn_hidden"], s["vocab_size"]
        assert total == 2 * v * c + s["n_layer"] * (4 * c * c + 3 * c * f + 2 * c) + c
    assert _peak_rss_mb() - before < 500  # fp32 large would be 35 GB: nothing real was allocated
    with torch.device("meta"):
        model = transformer_lm(size_config("large"))
    assert all(p.is_meta for p in model.parameters())
    assert len(blocks(model)) == 32
    assert SIZES["large"] == {"n_layer": 32, "n_embd": 4096, "n_head": 32, "ffn_hidden": 14336,
                                          "vocab_size": 128256}


def test_config_is_the_llama3_recipe():
    config = size_config("small")
    assert config.model_type == "llama" and type(config).__name__ == "LlamaConfig"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.intermediate_size) == (
        24, 2048, 16, 6144)
    assert config.num_key_value_heads == 16 and config.head_dim == 128 and config.vocab_size == 128256
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.rms_norm_eps == 1e-5
    assert not config.tie_word_embeddings and not config.attention_bias and not config.mlp_bias
    assert config.hidden_act == "silu" and config.use_cache is False
    model = tiny_model()
    assert model.get_input_embeddings().weight.data_ptr() != model.get_output_embeddings().weight.data_ptr()
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    assert context_limit(model) is None


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_documents_do_not_see_each_other(impl):
    model = tiny_model(attn_implementation=impl)
    assert model.config._attn_implementation == impl
    lengths = (5, 9, 4)
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, V, (1, n), generator=gen) for n in lengths]
    x = torch.cat(docs, 1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    assert document_ids(pos).tolist() == [[0] * 5 + [1] * 9 + [2] * 4]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=d).logits for d in docs], 1)
        model.train()  # the trainer's call, in training mode (dropout is 0)
        packed = model(input_ids=x, position_ids=pos).logits
        model.eval()
        assert torch.allclose(packed, alone, atol=1e-5, rtol=0)
        # the explicit 4-D mask works too, even when the call builds a cache (a stock Llama config)
        explicit = model(input_ids=x, position_ids=pos, attention_mask=document_mask(pos), use_cache=True).logits
        assert torch.allclose(explicit, alone, atol=1e-5, rtol=0)
        # the pitfall this guards against: with a cache, transformers' packed detection is off
        leaky = model(input_ids=x, position_ids=pos, use_cache=True).logits
        assert (leaky[:, 5:] - alone[:, 5:]).abs().max() > 1e-3
        assert torch.allclose(leaky[:, :5], alone[:, :5], atol=1e-5, rtol=0)


def _packed(lengths_per_row: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])
    return torch.randint(0, V, pos.shape, generator=gen), pos


def test_packed_documents_through_flex_attention_equal_the_explicit_mask():
    """On CUDA packed-document training reads through flex_attention (a BlockMask from the position
    restarts, nothing T x T); its forward (compiled, on CPU here) equals the explicit 4-D mask's."""
    torch._dynamo.reset()  # static shapes: after other flex_attention shapes in this process torch 2.13's
    # CPU (C++) flex template is compiled with dynamic shapes, which fails to build (cur_kvSplitSize1)
    model = tiny_model()
    x, pos = _packed([[130, 170], [10, 1, 289]])
    packed_document_attention(model, torch.device("cpu"))
    assert model.config._attn_implementation == "sdpa"  # CPU: unchanged
    with torch.no_grad():
        reference = model(input_ids=x, position_ids=pos, attention_mask=document_mask(pos)).logits
        packed_document_attention(model, torch.device("cuda"))  # only switches the implementation
        assert model.config._attn_implementation == "flex_attention"
        flex = model(input_ids=x, position_ids=pos).logits
    assert torch.allclose(flex, reference, atol=1e-5, rtol=0), (flex - reference).abs().max()


@pytest.mark.gpu
def test_gpu_packed_documents_flex_equals_masked_reference():
    """On CUDA under bf16 autocast: loss and gradients with flex_attention and packed position_ids
    equal sdpa with the explicit document mask (bf16 tolerance)."""
    torch.manual_seed(0)
    model = build_lm("transformer", n_layer=2, n_embd=256, n_head=4, ffn_hidden=512, vocab_size=V).cuda().train()
    x, pos = _packed([[1500, 2596], [700, 1, 3395]])
    x, pos = x.cuda(), pos.cuda()
    results = []
    for flex in (False, True):
        model.zero_grad(set_to_none=True)
        kwargs = {"attention_mask": document_mask(pos, torch.bfloat16)} if not flex else {}
        if flex:
            packed_document_attention(model, x.device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=x, position_ids=pos, labels=x, **kwargs)
        out.loss.backward()
        results.append((out.logits.float(), out.loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (a, la, ga), (b, lb, gb) = results
    assert model.config._attn_implementation == "flex_attention"
    assert abs(la - lb) < 1e-2 * abs(la) and (a - b).abs().max() < 0.05 * a.abs().max()
    for name in ga:
        assert (ga[name] - gb[name]).norm() <= 0.05 * ga[name].norm() + 1e-6, name


def test_document_mask_layout():
    pos = torch.tensor([[3, 4, 0, 1, 0]])  # the row starts inside a document
    allowed = document_mask(pos) == 0
    assert allowed.shape == (1, 1, 5, 5)
    assert allowed[0, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                                             [0, 0, 0, 0, 1]]
    with pytest.raises(OwaiError, match="position_ids must be"):
        document_mask(torch.arange(4))


def test_grouped_query_attention():
    mha, gqa = tiny_model(), tiny_model(n_kv_head=2)
    assert gqa.config.num_key_value_heads == 2
    assert gqa.model.layers[0].self_attn.k_proj.weight.shape == (2 * 16, 64)
    # each block's k_proj and v_proj lose (n_head - n_kv_head) * head_dim output rows
    saved = SMALL["n_layer"] * 2 * 64 * (4 - 2) * 16
    assert mha.num_parameters() - gqa.num_parameters() == saved
    assert count_parameters("tiny", vocab_size=V) - count_parameters("tiny", vocab_size=V, n_kv_head=1) == 4 * 2 * 256 * 3 * 64
    with torch.no_grad():
        assert gqa(input_ids=torch.randint(0, V, (2, 7))).logits.shape == (2, 7, V)


def test_greedy_generate_with_cache_matches_full_forwards():
    model = tiny_model(seed=3, initializer_range=0.2)  # larger logits: no near-ties in argmax
    prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=10, do_sample=False, return_dict_in_generate=True,
                             output_logits=True)
        cache = output_cache(out)
        assert cache is not None and cache.get_seq_length() >= 15  # decoded with a cache
        seq = prompt
        for step in range(10):
            logits = model(input_ids=seq).logits[:, -1]
            assert torch.allclose(out.logits[step], logits, atol=1e-5, rtol=0)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out.sequences, seq)
    # an explicit incremental pass: cached logits equal the full forward
    with torch.no_grad():
        full = model(input_ids=seq).logits
        first = model(input_ids=seq[:, :9], use_cache=True)
        rest = model(input_ids=seq[:, 9:], use_cache=True, **cache_kwargs(output_cache(first))).logits
    assert torch.allclose(torch.cat([first.logits, rest], 1), full, atol=1e-5, rtol=0)


def test_runs_eight_times_longer_than_training():
    torch.manual_seed(0)
    model = transformer_lm(size_config("tiny", vocab_size=256, max_position_embeddings=512)).eval()
    x = torch.randint(0, 256, (1, 4096))
    with torch.no_grad():
        long = model(input_ids=x).logits
        short = model(input_ids=x[:, :512]).logits
    assert long.shape == (1, 4096, 256) and torch.isfinite(long).all()
    assert torch.allclose(long[:, :512], short, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(n_layer=0), "n_layer must be a positive integer, got 0"),
        (dict(n_embd=-64), "n_embd must be a positive integer"),
        (dict(vocab_size=None), "vocab_size must be a positive integer, got None"),
        (dict(n_head=True), "n_head must be a positive integer, got True"),
        (dict(n_embd=66, n_head=4), "n_embd=66 is not divisible by n_head=4"),
        (dict(n_kv_head=3), "n_head=4 is not divisible by n_kv_head=3"),
        (dict(n_kv_head=0), "n_kv_head must be a positive integer"),
        (dict(n_embd=36, n_head=4), "RoPE needs an even head size, got n_embd/n_head=9"),
        (dict(rope_theta=0.0), "rope_theta must be a positive number"),
        (dict(hidden_size=128), "set n_embd, not the Llama name 'hidden_size'"),
        (dict(rms_norm_eps="x"), "Field 'rms_norm_eps' expected float"),
        (dict(attn_implementation="fast"), "unknown attn_implementation 'fast'"),
        (dict(rope_parameters={"rope_type": "nope"}), "unknown rope_type 'nope'"),
    ],
)
def test_bad_config_values(settings, message):
    for make in (lambda: llama_config(**{**SMALL, **settings}), lambda: lm_config("transformer", **{**SMALL, **settings})):
        with pytest.raises(OwaiError, match="transformer config: " + message.replace("(", r"\(")) as err:
            make()
        assert "\n" not in str(err.value)


def test_zoo_entry_and_its_errors():
    assert ARCHITECTURES["transformer"][0] == "owai.models.llama"
    model = build_lm("transformer", **SMALL)
    assert isinstance(model, LlamaForCausalLM) and model.generation_config.use_cache is True
    assert lm_config("transformer", **SMALL, attention_dropout=0.1).attention_dropout == 0.1
    for call, message in (
        (lambda: build_lm("transformer", **SMALL, n_layers=2), r"unknown transformer model setting 'n_layers' \(did you mean 'n_layer'\?\)"),
        (lambda: build_lm("transformer", n_layer=2, n_embd=64), "the transformer model needs the settings n_head, ffn_hidden, vocab_size"),
        (lambda: size_config("huge"), "unknown model size .huge.; known: tiny, small, large"),
        (lambda: size_config("tiny"), "pass vocab_size"),
        (lambda: build_lm("llama"), "unknown language model 'llama'; known: gpt, lstm, mm, mmv2, transformer"),
    ):
        with pytest.raises(OwaiError, match=message) as err:
            call()
        assert "\n" not in str(err.value)
    assert build_lm("gpt", n_layer=1, n_embd=32, n_head=4, vocab_size=V).config.model_type == "owai_gpt"


def test_save_and_load_through_the_auto_classes(tmp_path):
    model = tiny_model(seed=5, n_kv_head=2)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "llama" and saved["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in saved
    for loaded in (AutoModelForCausalLM.from_pretrained(tmp_path), load_pretrained(tmp_path)):
        assert type(loaded) is LlamaForCausalLM
        assert loaded.config.num_key_value_heads == 2 and loaded.config.use_cache is False
        assert loaded.generation_config.use_cache is True
        x = torch.randint(0, V, (2, 11))
        with torch.no_grad():
            assert torch.allclose(loaded.eval()(input_ids=x).logits, model(input_ids=x).logits, atol=1e-6, rtol=0)


def test_decay_groups_leave_rmsnorm_weights_undecayed():
    model = tiny_model()
    decay, no_decay = decay_param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    norms = {n for n in names.values() if n.endswith("layernorm.weight") or n == "model.norm.weight"}
    assert no_decay_names == norms and len(norms) == 2 * SMALL["n_layer"] + 1
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate_proj.weight"} <= decay_names
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
