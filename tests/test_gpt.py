"""The GPT baseline (owai.models.gpt) and the language-model zoo (owai.models.lm)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from owai.errors import OwaiError
from owai.models.gpt import GPTConfig, GPTForCausalLM, alibi_slopes, apply_rope, rope_cos_sin
from owai.models.lm import adamw, build_lm, check_vocab, context_limit, decay_param_groups, lm_config

V = 61


def tiny(position: str = "learned", **kw) -> GPTForCausalLM:
    # a large init std gives peaked, position-dependent logits, so generation is not a constant token
    cfg = dict(vocab_size=V, n_layer=2, n_embd=32, n_head=4, block_size=16, position=position, initializer_range=0.2)
    torch.manual_seed(0)
    return GPTForCausalLM(GPTConfig(**{**cfg, **kw})).eval()


@pytest.mark.parametrize(("bias", "expected"), [(False, 123_980_544), (True, 124_082_688)])
def test_gpt2_small_parameter_count(bias, expected):
    with torch.device("meta"):
        model = GPTForCausalLM(GPTConfig(bias=bias))  # n_layer 12, C 768, H 12, block 512, vocab 50304
    assert model.num_parameters() == expected
    assert model.lm_head.weight is model.transformer.wte.weight


def test_init_scales():
    model = build_lm("gpt", n_layer=4, n_embd=128, n_head=4, vocab_size=512, block_size=64)
    block = model.transformer.h[0]
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    for proj in (block.attn.c_proj, block.mlp.c_proj):
        assert proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.05)
    assert torch.equal(block.ln_1.weight, torch.ones(128))


@pytest.mark.parametrize("position", ["learned", "rope", "alibi", "none"])
def test_causality(position):
    model = tiny(position)
    x = torch.randint(0, V, (2, 12))
    y = x.clone()
    y[:, 7] = (x[:, 7] + 1) % V
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    assert torch.allclose(a[:, :7], b[:, :7], atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_context_length():
    x = torch.randint(0, V, (1, 40))  # block_size 16
    for position in ("rope", "alibi", "none"):
        assert tiny(position)(x).logits.shape == (1, 40, V)
    learned = tiny("learned")
    assert learned(x[:, :16]).logits.shape == (1, 16, V)
    with pytest.raises(OwaiError, match=r"context of 40 tokens .* \(block_size=16\)"):
        learned(x)
    assert context_limit(learned) == 16 and context_limit(tiny("alibi")) is None


def test_labels_are_shifted():
    model = tiny()
    x = torch.randint(0, V, (2, 10))
    labels = x.clone()
    labels[0, 3] = -100
    out = model(x, labels=labels)
    logits, targets = out.logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1)
    assert torch.allclose(out.loss, F.cross_entropy(logits, targets, ignore_index=-100))


def naive_last_row(model: GPTForCausalLM, x: torch.Tensor) -> torch.Tensor:
    """Reference: explicit full T x T attention per layer (own q/k/v, masks, rope, alibi), last row kept."""
    cfg = model.config
    B, T = x.shape
    H, hs = cfg.n_head, cfg.n_embd // cfg.n_head
    pos = torch.arange(T)
    h = model.transformer.wte(x)
    if cfg.position == "learned":
        h = h + model.transformer.wpe(pos)
    rows = []
    for block in model.transformer.h:
        q, k, v = block.attn.c_attn(block.ln_1(h)).split(cfg.n_embd, dim=2)
        q, k, v = (t.view(B, T, H, hs).transpose(1, 2) for t in (q, k, v))
        if cfg.position == "rope":
            cos, sin = rope_cos_sin(pos[None], hs, cfg.rope_theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scores = q @ k.transpose(-2, -1) / math.sqrt(hs)  # (B, H, T, T)
        if cfg.position == "alibi":
            slopes = torch.tensor(alibi_slopes(H))
            scores = scores - slopes[:, None, None] * (pos[:, None] - pos[None, :]).clamp(min=0)
        scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        att = scores.softmax(-1)
        rows.append(att[:, :, -1])
        y = (att @ v).transpose(1, 2).reshape(B, T, cfg.n_embd)
        h = h + block.attn.c_proj(y)
        h = h + block.mlp(block.ln_2(h))
    return torch.stack(rows)


@pytest.mark.parametrize("position", ["learned", "rope", "alibi"])
def test_last_token_attention_matches_naive(position):
    model = tiny(position, n_head=3, n_embd=24)  # 3 heads: the non-power-of-two ALiBi slopes
    x = torch.randint(0, V, (2, 11))
    with torch.no_grad():
        got, ref = model.last_token_attention(x), naive_last_row(model, x)
    assert got.shape == (2, 2, 3, 11)
    assert torch.allclose(got, ref, atol=1e-5)
    assert torch.allclose(got.sum(-1), torch.ones(2, 2, 3), atol=1e-5)


def test_alibi_slopes():
    assert alibi_slopes(8) == [2.0**-i for i in range(1, 9)]
    assert alibi_slopes(12)[8:] == pytest.approx([2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5])


def test_activation_is_the_thesis_baselines_tanh_gelu_unless_asked():
    """The thesis's baselines (the Library's baselines.py `new_gelu`, seq_icl's lm_simple) use GELU's
    tanh approximation; `activation="gelu"` is the exact one (nanoGPT today, nanoMosaics)."""
    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    new_gelu = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    assert GPTConfig().activation == "gelu_tanh"
    tanh_mlp, exact_mlp = (GPTForCausalLM(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=V, activation=a))
                           .transformer.h[0].mlp.gelu.double() for a in ("gelu_tanh", "gelu"))
    assert torch.allclose(tanh_mlp(x), new_gelu, rtol=0, atol=1e-15)
    assert torch.allclose(exact_mlp(x), F.gelu(x), rtol=0, atol=0)
    assert (tanh_mlp(x) - exact_mlp(x)).abs().max() > 1e-4  # the two differ
    with pytest.raises(OwaiError, match="unknown activation 'relu'"):
        GPTConfig(activation="relu")


def test_a_config_saved_before_activation_existed_loads_with_exact_gelu(tmp_path):
    import json

    model = tiny()
    model.save_pretrained(tmp_path)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.activation == "gelu_tanh"
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["activation"]  # what owai wrote before the field
    (tmp_path / "config.json").write_text(json.dumps(saved))
    old = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert old.config.activation == "gelu" and old.transformer.h[0].mlp.gelu.approximate == "none"


def test_branch_dropouts_default_to_dropout_and_can_be_set_apart():
    """One rate everywhere by default (the BabiStories baseline); RegBench's transformer (seq_icl's
    lm_simple) drops embeddings and attention weights but not the residual branches."""
    def rates(**kw):
        model = GPTForCausalLM(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=V, dropout=0.1, **kw))
        block = model.transformer.h[0]
        return model.transformer.drop.p, block.attn.dropout, block.attn.resid_dropout.p, block.mlp.dropout.p

    assert rates() == (0.1, 0.1, 0.1, 0.1)
    assert rates(resid_dropout=0.0) == (0.1, 0.1, 0.0, 0.0)
    assert rates(attn_dropout=0.2) == (0.1, 0.2, 0.1, 0.1)
    with pytest.raises(OwaiError, match="resid_dropout must be in"):
        GPTConfig(resid_dropout=1.0)


def test_save_load_roundtrip(tmp_path):
    model = tiny("rope")
    x = torch.randint(0, V, (2, 9))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # no trust_remote_code
    assert type(loaded) is GPTForCausalLM and loaded.config.position == "rope"
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_untied_save_load_roundtrip(tmp_path):
    model = tiny(tie_word_embeddings=False)
    assert model.lm_head.weight is not model.transformer.wte.weight
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, V, (1, 8))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


@pytest.mark.parametrize("position", ["learned", "alibi"])
@pytest.mark.parametrize("num_beams", [1, 2])
def test_generate_with_cache_equals_without(position, num_beams):
    model = tiny(position)
    prompt = torch.randint(0, V, (2, 4))
    kw = dict(max_new_tokens=10, do_sample=False, num_beams=num_beams, pad_token_id=0)
    cached = model.generate(prompt, **kw)
    uncached = model.generate(prompt, use_cache=False, **kw)
    assert cached.shape == (2, 14)
    assert torch.equal(cached, uncached)
    assert len(set(cached[0, 4:].tolist())) > 1  # not a degenerate constant continuation


def test_cached_chunks_equal_one_pass():
    from transformers import DynamicCache

    for position in ("learned", "rope", "alibi"):
        model = tiny(position)
        x = torch.randint(0, V, (2, 12))
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            parts = [model(x[:, a:b], past_key_values=cache).logits for a, b in ((0, 5), (5, 6), (6, 12))]
            assert cache.get_seq_length() == 12
            assert torch.allclose(torch.cat(parts, 1), model(x).logits, atol=1e-5)


def test_decay_param_groups_gpt():
    model = build_lm("gpt", n_layer=2, n_embd=32, n_head=4, vocab_size=V, block_size=16, bias=True)
    decay, no_decay = decay_param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decay_names = {names[id(p)] for p in decay["params"]}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    every = decay["params"] + no_decay["params"]
    assert len(every) == len({id(p) for p in every}) == len(list(model.parameters()))  # each exactly once
    assert "transformer.wte.weight" in decay_names and "transformer.wpe.weight" in decay_names
    assert "transformer.h.0.attn.c_attn.weight" in decay_names
    assert {"transformer.ln_f.weight", "transformer.h.0.ln_1.weight", "transformer.h.1.mlp.c_fc.bias"} <= no_decay_names
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])


def test_decay_param_groups_memory_mosaics():
    pytest.importorskip("owai.models.memory_mosaics")
    from transformers import AutoConfig

    assert AutoConfig.for_model("owai_memory_mosaics").model_type == "owai_memory_mosaics"
    with torch.device("meta"):
        model = build_lm("mm")
    decay, no_decay = decay_param_groups(model, 0.1)
    every = decay["params"] + no_decay["params"]
    assert len(every) == len({id(p) for p in every}) == len(list(model.parameters()))
    assert any(p.dim() == 4 or p.dim() == 3 for p in decay["params"])  # persistent-memory slots decay
    assert all(p.dim() < 2 for p in no_decay["params"]) and no_decay["params"]


def test_adamw_takes_the_decay_groups_and_is_not_fused_off_cuda():
    """`adamw` is the trainer's optimizer: decay_param_groups' groups with the given hyper-parameters,
    torch's default implementation off CUDA (CPU runs keep their numbers; on CUDA: the gpu test below)."""
    model = build_lm("gpt", n_layer=2, n_embd=32, n_head=4, vocab_size=V, block_size=16, bias=True)
    optimizer = adamw(model, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    want = decay_param_groups(model, 0.1)
    assert [[id(p) for p in g["params"]] for g in optimizer.param_groups] == [[id(p) for p in g["params"]] for g in want]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert optimizer.defaults["lr"] == 3e-4 and optimizer.defaults["betas"] == (0.9, 0.95)
    assert not optimizer.defaults["fused"]
    assert len(adamw(model, lr=1e-3, weight_decay=0.1, scope="all").param_groups) == 1


@pytest.mark.gpu
def test_adamw_is_fused_on_cuda():
    """On CUDA `adamw` takes torch's fused kernel (one launch over every parameter)."""
    model = build_lm("gpt", n_layer=2, n_embd=32, n_head=4, vocab_size=V, block_size=16, bias=True).cuda()
    optimizer = adamw(model, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    assert optimizer.defaults["fused"] is True
    model(torch.randint(0, V, (2, 16), device="cuda")).logits.float().sum().backward()
    optimizer.step()  # the fused kernel takes every group's parameters


def test_build_lm_errors():
    with pytest.raises(OwaiError, match=r"unknown language model 'llama'; known: gpt, lstm, mm"):
        build_lm("llama")
    with pytest.raises(OwaiError, match=r"unknown gpt model setting 'n_layers' \(did you mean 'n_layer'\?\)"):
        build_lm("gpt", n_layers=2)
    with pytest.raises(OwaiError, match="n_embd=30 is not divisible by n_head=4"):
        lm_config("gpt", n_embd=30, n_head=4)
    with pytest.raises(OwaiError, match="unknown position 'sinusoidal'"):
        lm_config("gpt", position="sinusoidal")
    with pytest.raises(OwaiError, match="n_layer must be a positive integer"):
        lm_config("gpt", n_layer=0)
    assert lm_config("gpt", n_layer=3).n_layer == 3


def test_check_vocab():
    model = tiny()
    check_vocab(model, V)
    with pytest.raises(OwaiError, match=f"the tokenizer has 50257 tokens .* only {V} rows"):
        check_vocab(model, 50257)
