"""Rules of owai's model code that the other tests left unpinned (a mutation audit: each test here
fails on a small, plausible change of the code that every other default test let through).

Each test states the rule it pins from the thesis's definitions or the module's own contract,
computed independently of the code under test where it can be (brute-force counts, one-hot reads,
transformers' own rotary embedding), so that the model and its reference cannot share a mistake.
All are CPU, tiny and fast."""

from __future__ import annotations

import math

import pytest
import torch

from test_memory_mosaics_v2 import TINY as V2_TINY  # the v2 suite's tiny model, its scalars and gates random
from test_memory_mosaics_v2 import tiny_model as _v2

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one intra-op thread (conftest)


# ---------------------------------------------------------------------------------- helpers


def _v1(**overrides):
    from owai.models.memory_mosaics import MemoryMosaicsConfig, MemoryMosaicsForCausalLM

    settings = dict(vocab_size=61, n_layer=2, n_embd=32, n_head=4, pmem_size=24, leaky_chunk=4, ic_dropout=0.0,
                    hd_dropout=0.0)
    torch.manual_seed(0)
    return MemoryMosaicsForCausalLM(MemoryMosaicsConfig(**{**settings, **overrides})).double().eval()


def _ids(B: int, T: int, V: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ Memory Mosaics v1


def test_v1_leaky_lambdas_are_the_coefficients_the_keys_use():
    """Fig B.7 relates each head's attention width to lambda_h = exp(-beta_h), beta_h = 10 |p_h|, the
    leaky-average coefficient of the contextual keys: S_1 = lambda S_0 + k~_1. `leaky_lambdas` must
    report the coefficient the key extractor really applies (read here from the keys themselves,
    with W_phi the identity: x_0 = e_1 and x_1 = e_2 in every head give k_1 ~ (lambda, 1, 0, ...))."""
    model = _v1()
    H, hs = model.config.n_head, model.config.head_size
    with torch.no_grad():
        for block in model.model.h:
            block.ctx.key.leak.copy_(torch.tensor([-0.02, 0.03, -0.08, 0.12], dtype=torch.float64))
            block.ctx.key.proj.weight.copy_(torch.eye(model.config.n_embd, dtype=torch.float64))
    x = torch.zeros(1, 2, H * hs, dtype=torch.float64)
    x[0, 0, 0::hs] = 1.0  # e_1 of every head at t = 0
    x[0, 1, 1::hs] = 1.0  # e_2 of every head at t = 1
    keys, _ = model.model.h[0].ctx.key(x, power=1)  # (1, H, 2, hs)
    from_keys = keys[0, :, 1, 0] / keys[0, :, 1, 1]  # lambda_h per head
    reported = model.leaky_lambdas()  # (n_layer, H)
    assert reported.shape == (model.config.n_layer, H)
    torch.testing.assert_close(reported[0].double(), from_keys, rtol=1e-6, atol=0)
    assert from_keys.min() < 0.5  # scales that a missing x10 would move far


def test_v1_several_tokens_after_a_longer_cache_equal_the_full_forward():
    """A cached continuation of several tokens after a prefill of more than one token (the prefix
    cache's case): query past+i reads keys j <= past+i-1, SDPA's causal mask aligned to the
    bottom-right corner of the (T x past+T-1) scores. The existing cache test's only multi-token
    continuation follows a one-token prefill, where that matrix is square."""
    from owai.models.memory_mosaics import MemoryMosaicsCache

    model = _v1()
    ids = _ids(2, 30, 61, seed=1)
    full = model(ids).logits
    cache = MemoryMosaicsCache()
    parts = [model(ids[:, :6], past_key_values=cache, use_cache=True).logits,
             model(ids[:, 6:13], past_key_values=cache).logits,  # 7 queries, 12 keys
             model(ids[:, 13:14], past_key_values=cache).logits,
             model(ids[:, 14:30], past_key_values=cache).logits]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-10, rtol=1e-10)


# ------------------------------------------------------------------ Memory Mosaics v2: windows


@pytest.mark.parametrize("edges", [("open", "inclusive"), ("closed", "strict")])
@pytest.mark.parametrize("documents", [False, True])
def test_v2_memories_read_exactly_the_thesis_windows(edges, documents):
    """Eq 4.2's read sets, written out from the thesis, not from config.short_span / long_lag (which
    the naive model of tests/test_memory_mosaics_v2.py shares with the model): with h = 5 and m = 3,
    the short-term memory reads lags 1..h-1 (open; 1..h closed) and the long-term memory lags >= m
    (inclusive; >= m+1 strict), both within the query's document. With zero queries the softmax is
    uniform, and one-hot values make the read's support the read set itself."""
    short_edge, long_edge = edges
    model = _v2(n_embd=32, short_edge=short_edge, long_edge=long_edge)
    h, m = 5, 3
    B, H, T, hs = 1, model.config.n_head, 14, model.config.head_size
    starts = [0] * 6 + [6] * 8 if documents else [0] * T
    doc_start = torch.tensor([starts]) if documents else None
    q = torch.zeros(B, H, T, hs, dtype=torch.float64)
    keys = torch.nn.functional.normalize(torch.randn(B, H, T, hs, dtype=torch.float64), dim=-1)
    values = torch.eye(hs, dtype=torch.float64)[: T - 1].expand(B, H, T - 1, hs)  # value j = e_j
    short_max = h - 1 if short_edge == "open" else h
    long_min = m if long_edge == "inclusive" else m + 1
    for block in model.layers:
        for kind, memory in (("short", block.short), ("long", block.long)):
            y = memory.read(q, keys, values, 0, 0, doc_start, m)  # (B, H, T, hs)
            for t in range(T):
                lags = [t - j for j in range(starts[t], t)]
                want = sorted(t - lag for lag in lags if (1 <= lag <= short_max if kind == "short" else lag >= long_min))
                got = sorted(int(j) for j in torch.nonzero(y[0, 0, t] > 1e-12).flatten())
                assert got == want, (kind, t, got, want)
                if want:
                    torch.testing.assert_close(y[0, :, t, want], torch.full((H, len(want)), 1 / len(want),
                                                                             dtype=torch.float64))


def test_v2_training_draws_every_long_term_delay_of_its_range():
    """m ~ U[m_min, m_max], both ends included (Table 4.2's training: U[64, 256]): in training mode
    with no long_delay given, the draws cover the whole inclusive range and nothing else. (The
    existing test draws its own numbers with torch.randint and never reads the model's.)"""
    model = _v2(long_delay_train=(3, 4)).train()
    seen = []
    hook = model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[2]))
    torch.manual_seed(0)
    ids = _ids(1, 8, 50)
    for _ in range(40):
        model(input_ids=ids)
    hook.remove()
    assert set(seen) == {3, 4}


def test_v2_a_cached_continuation_stays_in_the_prefills_last_document():
    """Documents across a cache: after a prefill of packed documents, tokens given with no position_ids
    continue the last document (the cache's doc_start), so each new token reads nothing of the
    earlier documents and the cached logits equal the full forward with position_ids."""
    from owai.models.memory_mosaics_v2 import MemoryMosaicsV2Cache

    model = _v2()
    ids = _ids(1, 20, 50, seed=2)
    pos = torch.cat([torch.arange(7), torch.arange(13)])[None]  # documents [0, 7) and [7, 20)
    full = model(input_ids=ids, position_ids=pos).logits
    cache = MemoryMosaicsV2Cache()
    with torch.no_grad():
        parts = [model(input_ids=ids[:, :10], position_ids=pos[:, :10], past_key_values=cache, use_cache=True).logits]
        parts += [model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(10, 14)]
        parts += [model(input_ids=ids[:, 14:20], past_key_values=cache, use_cache=True).logits]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-10, rtol=1e-10)


def test_v2_a_left_padded_forward_with_only_an_attention_mask_equals_each_row_alone():
    """With an attention_mask and no position_ids, positions count from each row's first unmasked
    token (HF's convention), so the padding is a document of its own that no real token reads: a
    left-padded row's logits at its real tokens are the row's logits alone."""
    model = _v2()
    short, long = _ids(1, 6, 50, seed=3), _ids(1, 10, 50, seed=4)
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
    mask = (torch.arange(10)[None] >= torch.tensor([[4], [0]])).long()
    together = model(input_ids=batch, attention_mask=mask).logits
    torch.testing.assert_close(together[0, 4:], model(input_ids=short).logits[0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(together[1], model(input_ids=long).logits[0], atol=1e-10, rtol=1e-10)


def test_v2_bandwidth_starts_at_the_configured_beta1_alpha_beta0():
    """The bandwidth beta = beta1 n^alpha + beta0 starts at the config's beta1 = e^2, alpha = 0.05,
    beta0 = 1e-3 (docs/decisions.md): checked at n = 1, where alpha does not show, and at n = 100
    and 10^4, where it does."""
    from owai.models.memory_mosaics_v2 import (MemoryMosaicsV2Config, MemoryMosaicsV2ForCausalLM,
                                               bandwidth_of, bandwidth_parameters)

    torch.manual_seed(0)
    model = MemoryMosaicsV2ForCausalLM(MemoryMosaicsV2Config(**V2_TINY))
    for memory in (model.layers[0].short, model.layers[1].long):
        beta1, alpha, beta0 = bandwidth_parameters(memory.beta1_log, memory.alpha_raw, memory.beta0_raw)
        torch.testing.assert_close(beta1, torch.full_like(beta1, math.exp(2)), rtol=1e-6, atol=0)
        torch.testing.assert_close(alpha, torch.full_like(alpha, 0.05), rtol=1e-6, atol=0)
        torch.testing.assert_close(beta0, torch.full_like(beta0, 1e-3), rtol=1e-5, atol=0)
        n = torch.tensor([[1, 100, 10_000]])
        want = torch.tensor([math.exp(2) * float(k) ** 0.05 + 1e-3 for k in (1, 100, 10_000)])
        torch.testing.assert_close(bandwidth_of(n, memory.beta1_log, memory.alpha_raw, memory.beta0_raw)[0],
                                   want.expand(memory.beta1_log.shape[0], 3), rtol=1e-6, atol=0)


def test_v2_loss_with_a_bag_of_k_head_is_next_token_plus_alpha_bag():
    """Sec 4.2.5.1: L = L_next + alpha L_bag, alpha = bag_weight (0.3), the bags of labels respecting
    the documents of position_ids. (tests/test_bag_of_k.py checks L_bag alone, never the sum the model
    trains on.)"""
    from owai.models.bag_of_k import bag_of_k_loss, bag_targets
    from owai.models.hf_cache import causal_lm_loss

    model = _v2(bag_of_k=3, bag_weight=0.3)
    ids = _ids(2, 16, 50, seed=5)
    pos = torch.cat([torch.arange(9), torch.arange(7)])[None].expand(2, 16)
    out = model(input_ids=ids, labels=ids, position_ids=pos)
    bags, valid = bag_targets(ids, 3, pos)
    want = causal_lm_loss(out.logits, ids) + 0.3 * bag_of_k_loss(out.bag_logits, bags, valid, model.config.bag_eta)
    torch.testing.assert_close(out.loss, want, rtol=1e-12, atol=0)
    assert bag_of_k_loss(out.bag_logits, bags, valid, model.config.bag_eta) > 0.1  # the term is there to see


# ------------------------------------------------------------------ GPT: RoPE


def test_gpt_rope_is_the_rotate_half_rope_of_llama_with_base_10000():
    """App. B's RoPE GPT: rotary positions in the GPT-NeoX / Llama rotate-half layout with the RoPE
    paper's base 10,000, as transformers' own Llama computes them (independent code): the same
    rotated queries at every position, for the default base and another."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from owai.models.gpt import GPTConfig, apply_rope, rope_cos_sin

    assert GPTConfig(position="rope").rope_theta == 10000.0
    hs, T = 16, 40
    q = torch.randn(2, 3, T, hs, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(5, 5 + T)[None]
    for theta in (10000.0, 500000.0):
        cfg = LlamaConfig(hidden_size=48, num_attention_heads=3, head_dim=hs,
                          rope_parameters={"rope_type": "default", "rope_theta": theta})
        cos, sin = LlamaRotaryEmbedding(cfg)(q.float(), positions)
        want, _ = apply_rotary_pos_emb(q, q, cos.double(), sin.double())
        got = apply_rope(q, *rope_cos_sin(positions, hs, theta))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ LSTM: dropout placement


def test_lstm_dropout_on_the_embeddings_and_before_the_head():
    """token embedding -> dropout -> LSTM -> dropout -> linear head (module docstring): in training
    mode the LSTM reads the embeddings dropped out and scaled by 1/(1-p), the head reads the LSTM's
    outputs likewise; in evaluation mode both read them unchanged."""
    from owai.models.lstm import LSTMConfig, LSTMForCausalLM

    torch.manual_seed(0)
    model = LSTMForCausalLM(LSTMConfig(vocab_size=20, n_layer=1, n_embd=16, dropout=0.5))
    seen = {}
    hooks = [model.wte.register_forward_hook(lambda m, a, out: seen.__setitem__("emb", out.detach())),
             model.lstm.register_forward_hook(lambda m, a, out: seen.update(lstm_in=a[0].detach(), lstm_out=out[0].detach())),
             model.lm_head.register_forward_pre_hook(lambda m, a: seen.__setitem__("head_in", a[0].detach()))]
    ids = _ids(2, 12, 20)
    for training in (True, False):
        model.train(training)
        model(input_ids=ids)
        for before, after in (("emb", "lstm_in"), ("lstm_out", "head_in")):
            a, b = seen[before], seen[after]
            if not training:
                assert torch.equal(a, b), (before, after)
                continue
            kept = b != 0
            assert 0.3 < kept.float().mean() < 0.7, (before, after)  # p = 0.5
            torch.testing.assert_close(b[kept], 2 * a[kept])
    for hook in hooks:
        hook.remove()


# ------------------------------------------------------------------ plan.py: FLOPs and memory


def _brute_force_pairs(arch: str, cfg, context: int) -> float:
    """Mean over query positions t < context of the (key, value) pairs a query reads per layer, by
    enumerating the read sets: v2 short-term lags 1..span, long-term lags >= its smallest lag; v1
    keys j <= t-1; causal attention keys j <= t."""
    total = 0
    for t in range(context):
        if arch == "mmv2":
            span = cfg.short_window - 1 if cfg.short_edge == "open" else cfg.short_window
            lag = cfg.long_delay_eval if cfg.long_edge == "inclusive" else cfg.long_delay_eval + 1
            total += sum(1 for j in range(t) if t - j <= span)
            if cfg.long_term_memory:
                total += sum(1 for j in range(t + 1) if t - j >= lag)
        elif arch == "mm":
            total += t
        else:
            total += t + 1
    return total / context


@pytest.mark.parametrize("context", [4, 9, 40])
@pytest.mark.parametrize("settings", [{}, {"short_edge": "closed", "long_edge": "strict"}, {"long_term_memory": False}])
def test_plan_readable_pairs_count_the_read_sets(settings, context):
    """plan.readable_pairs, the pairs term of Table 4.2's FLOPs, against a brute-force count of the read
    sets at contexts shorter and longer than the short-term window (Table 4.2's context 256 equals the
    large model's window, where a wrong window bound does not show)."""
    from owai.models.memory_mosaics import MemoryMosaicsConfig
    from owai.models.memory_mosaics_v2 import MemoryMosaicsV2Config
    from owai.plan import readable_pairs

    cfg = MemoryMosaicsV2Config(**{**V2_TINY, "short_window": 6, "long_delay_eval": 4, **settings})
    assert readable_pairs(cfg, context) == pytest.approx(_brute_force_pairs("mmv2", cfg, context), rel=1e-12)
    if not settings:
        v1 = MemoryMosaicsConfig(vocab_size=61, n_layer=1, n_embd=8, n_head=2)
        assert readable_pairs(v1, context) == pytest.approx(_brute_force_pairs("mm", v1, context), rel=1e-12)
        from owai.models.llama import size_config

        llama = size_config("tiny", vocab_size=64)
        assert readable_pairs(llama, context) == pytest.approx(_brute_force_pairs("transformer", llama, context), rel=1e-12)


def test_plan_flops_grow_by_four_l_d_per_pair_read():
    """FLOPs per token = 2 x multiplying parameters + 4 x layers x d x pairs read (plan.py's docstring,
    the convention of Table 4.2): the difference between two contexts is the attention term alone,
    4 L d (pairs(c2) - pairs(c1)), counted by brute force. (Table 4.2's one decimal at 18.9B cannot
    see that term: halving it leaves 18.9B.)"""
    from owai.models.memory_mosaics_v2 import MemoryMosaicsV2Config, MemoryMosaicsV2ForCausalLM
    from owai.plan import forward_flops_per_token, multiplying_parameters

    cfg = MemoryMosaicsV2Config(**{**V2_TINY, "short_window": 6, "long_delay_eval": 4})
    with torch.device("meta"):
        model = MemoryMosaicsV2ForCausalLM(cfg)
    L, d = cfg.n_layer, cfg.n_embd
    for context in (3, 12, 50):
        want = 2 * multiplying_parameters(model) + 4 * L * d * _brute_force_pairs("mmv2", cfg, context)
        assert forward_flops_per_token(model, context) == pytest.approx(want, rel=1e-12)
    grown = forward_flops_per_token(model, 50) - forward_flops_per_token(model, 12)
    assert grown == pytest.approx(4 * L * d * (_brute_force_pairs("mmv2", cfg, 50) - _brute_force_pairs("mmv2", cfg, 12)))


@pytest.mark.parametrize("strategy, world", [("single", 1), ("ddp", 4), ("fsdp", 4)])
def test_plan_memory_is_fp32_weights_gradients_and_two_adam_moments(strategy, world):
    """plan.py's docstring: fp32 master weights (4 bytes each), fp32 gradients (4), AdamW's two fp32
    moments (8), each divided by the world size under FSDP only."""
    from owai.models.memory_mosaics_v2 import MemoryMosaicsV2Config, MemoryMosaicsV2ForCausalLM
    from owai.plan import memory_plan

    with torch.device("meta"):
        model = MemoryMosaicsV2ForCausalLM(MemoryMosaicsV2Config(**V2_TINY))
    n = sum(p.numel() for p in model.parameters())
    shard = world if strategy == "fsdp" else 1
    plan = memory_plan(model, world, strategy, micro_batch=2, seq_len=32, activation_checkpointing=False)
    assert (plan.params_bytes, plan.grads_bytes, plan.optimizer_bytes) == (4 * n / shard, 4 * n / shard, 8 * n / shard)


def test_plan_ranks_needed_is_the_fewest_fsdp_ranks_whose_plan_fits():
    """ranks_needed answers with the same margin as MemoryPlan.fits: at that many FSDP ranks the plan
    fits a rank of that size, at one rank fewer it does not."""
    from owai.models.memory_mosaics_v2 import MemoryMosaicsV2Config, MemoryMosaicsV2ForCausalLM
    from owai.plan import memory_plan, ranks_needed

    with torch.device("meta"):
        model = MemoryMosaicsV2ForCausalLM(MemoryMosaicsV2Config(**V2_TINY))
    args = dict(micro_batch=1, seq_len=16, activation_checkpointing=True)
    base = memory_plan(model, 1, "single", **args)
    state = base.params_bytes + base.grads_bytes + base.optimizer_bytes
    checked = 0
    for factor in (1.05, 1.2, 1.6, 2.5, 4.0, 7.0, 11.0):
        per_rank = (base.activation_bytes + state / factor) / 0.9 * 1.02
        ranks = ranks_needed(base, per_rank)
        assert ranks is not None
        fits = memory_plan(model, ranks, "fsdp", capacity=(per_rank, "test"), **args).fits
        assert fits, (factor, ranks)
        if ranks > 1:
            assert not memory_plan(model, ranks - 1, "fsdp", capacity=(per_rank, "test"), **args).fits, (factor, ranks)
            checked += 1
    assert checked >= 4
