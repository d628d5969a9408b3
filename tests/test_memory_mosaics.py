"""Memory Mosaics v1 LM: exact parameter count, equations vs a naive dense implementation fed with
official-format state dicts (Library regular/eft and nanoMosaics), causality, O(T) leaky scan,
HF save/load and generate with the custom cache, last-row attention, config and converter errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from owai.errors import OwaiError
from owai.models.memory_mosaics import (
    MemoryMosaicsCache,
    MemoryMosaicsConfig,
    MemoryMosaicsForCausalLM,
    leaky_average,
)
from owai.models.memory_mosaics_convert import convert_official_state_dict, load_official_checkpoint
from naive_memory_mosaics import NaiveMemoryMosaics, random_official_state_dict

TINY = dict(vocab_size=61, n_layer=2, n_embd=32, n_head=4, pmem_size=24, leaky_chunk=16, ic_dropout=0.0, hd_dropout=0.0)


def _ids(B: int, T: int, seed: int = 0, V: int = 61) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _converted(source: str, dtype=torch.float32, overrides: dict | None = None,
               **sd_kwargs) -> tuple[MemoryMosaicsForCausalLM, dict]:
    """A tiny owai model loaded from a random official-format state dict (random per-head scalars)."""
    sd = random_official_state_dict(source, **sd_kwargs)
    overrides = dict(leaky_chunk=16, **(overrides or {}))
    if source == "library":
        overrides["norm_eps"] = 0.0  # the Library has no epsilon: match it exactly for the float64 checks
    cfg, osd = convert_official_state_dict(sd, source, **overrides)
    model = MemoryMosaicsForCausalLM(cfg)
    model.load_state_dict(osd, strict=True)
    return model.to(dtype).eval(), sd


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one intra-op thread (conftest)


@pytest.fixture(scope="module")
def tiny_model() -> MemoryMosaicsForCausalLM:
    torch.manual_seed(0)
    return MemoryMosaicsForCausalLM(MemoryMosaicsConfig(**TINY)).eval()


# ------------------------------------------------------------------ size, parameter layout, init


def test_parameter_count_gpt2_small_is_exact():
    with torch.device("meta"):  # shapes only
        model = MemoryMosaicsForCausalLM(MemoryMosaicsConfig())
    assert model.config.pmem_size == 2688
    assert model.num_parameters() == 123_588_336
    assert sum(p.numel() for p in model.parameters()) == 123_588_336
    assert sum(p.numel() for p in model.model.h[0].parameters()) == 7_079_508


def test_per_head_scalars_are_1d_and_matrices_are_not(tiny_model):
    H = tiny_model.config.n_head
    names = ("leak", "scale", "mix", "out_scale")
    scalars = {n: p for n, p in tiny_model.named_parameters() if n.rsplit(".", 1)[1] in names}
    assert len(scalars) == 7 * tiny_model.config.n_layer
    assert all(p.dim() == 1 and p.shape == (H,) for p in scalars.values())
    low_dim = {n for n, p in tiny_model.named_parameters() if p.dim() < 2}
    assert low_dim == set(scalars) | {n for n in low_dim if ".ln_" in n or n.startswith("model.ln_f")}
    pm = tiny_model.model.h[0].pmem
    assert pm.mem_k.shape == pm.mem_v.shape == (1, H, 24, 8)  # decayed like in the reference


@pytest.mark.parametrize("init", ["library", "nano"])
def test_init_follows_the_reference(init):
    torch.manual_seed(0)
    cfg = MemoryMosaicsConfig(vocab_size=2000, n_layer=4, n_embd=64, n_head=4, init=init)
    m = MemoryMosaicsForCausalLM(cfg)
    C, L, H = 64, 4, 4
    blk = m.model.h[0]
    want = {
        "library": dict(emb=1 / math.sqrt(C), lin=1 / math.sqrt(C), proj=1 / math.sqrt(C * L)),
        "nano": dict(emb=0.02, lin=0.02, proj=0.02 / math.sqrt(2 * L)),
    }[init]
    assert m.lm_head.weight is m.model.wte.weight
    assert m.model.wte.weight.std().item() == pytest.approx(want["emb"], rel=0.05)
    assert blk.ctx.key.proj.weight.std().item() == pytest.approx(want["lin"], rel=0.1)
    assert blk.pmem.c_proj.weight.std().item() == pytest.approx(want["proj"], rel=0.1)
    assert blk.pmem.mem_k.std().item() == pytest.approx(1 / math.sqrt(C // H), rel=0.1)
    torch.testing.assert_close(blk.ctx.key.leak.data, torch.linspace(0.5, 5, H) / 10)
    assert torch.all(blk.pmem.key.scale == 0.1) and torch.all(blk.ctx.value.scale == -0.05)
    assert torch.all(blk.pmem.out_scale == -0.05)
    assert 0 <= blk.ctx.value.mix.min() and blk.ctx.value.mix.max() < 1


# ------------------------------------------------------------------ equations vs the naive model


CASES = [
    ("library", dict(variant="regular"), None),
    ("library", dict(variant="eft"), None),
    ("library", dict(variant="regular", bias=True, tied=False, count=2), None),
    ("library", dict(variant="regular", attn_only=True), None),
    ("nano", dict(), None),
    ("nano", dict(bias=True, count=2), None),
    ("nano", dict(), 2.0),  # a low clamp: nano clamps the whole (squared) exponent, not each side
]


@pytest.mark.parametrize("source,kw,clamp", CASES)
def test_matches_naive_float64_beyond_training_length(source, kw, clamp):
    """Exact equations (float64): random official weights incl. random per-head scalars, one head past
    the key-scale clamp; T = 512 (training length) and 1100 (beyond it), leaky chunk 16.

    Per position the error is the largest over the vocabulary. Its median must be float64's (< 1e-11:
    a wrong epsilon or scale moves every position by more). Its max may be larger: the Library's unit
    norms have no epsilon, and at a few positions of T = 1100 the float64 reference itself moves by up
    to 1.4e-8 when its weights move by 1e-15 relative (docs/decisions.md)."""
    overrides = {} if clamp is None else dict(key_scale_max_exp=clamp)
    model, sd = _converted(source, torch.float64, overrides, **kw)
    naive = NaiveMemoryMosaics(sd, source) if clamp is None else NaiveMemoryMosaics(sd, source, nano_clamp=clamp)
    for T, B in ((512, 2), (1100, 1)) if clamp is None else ((300, 1),):
        ids = _ids(B, T, seed=T)
        got = model(ids).logits
        want = naive.logits(ids)
        assert got.shape == (B, T, 61)
        per_position = (got - want).abs().amax(-1).flatten()
        assert per_position.median().item() < 1e-11
        assert per_position.max().item() < 1e-7


def test_matches_naive_post_ln():
    sd = random_official_state_dict("library", seed=3)
    cfg, osd = convert_official_state_dict(sd, norm_eps=0.0, pre_ln=False)
    model = MemoryMosaicsForCausalLM(cfg).double().eval()
    model.load_state_dict(osd)
    ids = _ids(2, 200)
    assert (model(ids).logits - NaiveMemoryMosaics(sd, "library", pre_ln=False).logits(ids)).abs().max() < 1e-8


@pytest.mark.parametrize("source", ["library", "nano"])
def test_matches_naive_float32(source):
    """The fp32 path, init-like bandwidths (sharp heads are ill-conditioned in fp32 by nature)."""
    model, sd = _converted(source, sharp=False, bandwidth_max=0.15, seed=1)
    naive = NaiveMemoryMosaics(sd, source)
    for T, B in ((512, 2), (1100, 1)):
        ids = _ids(B, T, seed=T)
        torch.testing.assert_close(model(ids).logits.double(), naive.logits(ids), atol=1e-5, rtol=1e-5)


def test_last_token_attention_matches_naive():
    model, sd = _converted("library", torch.float64, seed=2)
    ids = _ids(2, 300)
    rows = model.last_token_attention(ids)
    L, H = model.config.n_layer, model.config.n_head
    assert rows.shape == (L, 2, H, 300)
    torch.testing.assert_close(rows.sum(-1), torch.ones(L, 2, H, dtype=rows.dtype))
    assert torch.all(rows[..., -1] == 0)
    torch.testing.assert_close(rows, NaiveMemoryMosaics(sd, "library").last_token_attention(ids), atol=1e-9, rtol=0)
    assert torch.all(model.last_token_attention(ids[:, :1]) == 0)  # a lone token has no memory


# ------------------------------------------------------------------ structural properties


def test_position_zero_output_is_exactly_zero():
    torch.manual_seed(0)
    model = MemoryMosaicsForCausalLM(MemoryMosaicsConfig(**{**TINY, "bias": True, "ic_dropout": 0.1}))
    seen = []
    hooks = [b.ctx.c_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
             for b in model.model.h]
    for mode in (model.eval, model.train):
        mode()
        model(_ids(3, 40))
    for h in hooks:
        h.remove()
    assert len(seen) == 2 * model.config.n_layer
    for y in seen:  # (B, T, C): the memory read-out before c_proj
        assert torch.all(y[:, 0] == 0)
        assert torch.all(y[:, 1:].abs().sum(-1) > 0)


def test_causality_next_token_never_changes_the_past():
    model, _ = _converted("library", seed=4)
    ids = _ids(1, 150, seed=1)
    base = model(ids).logits
    for t in (0, 15, 16, 17, 70, 148):  # around leaky-chunk edges too
        changed = ids.clone()
        changed[0, t + 1] = (changed[0, t + 1] + 1) % 61
        out = model(changed).logits
        assert torch.equal(out[:, : t + 1], base[:, : t + 1])
        assert not torch.allclose(out[:, t + 1], base[:, t + 1])


def _dense_leaky(x, beta, state=None):
    T = x.shape[2]
    t = torch.arange(T, dtype=x.dtype)
    lag = t[:, None] - t[None, :]
    A = torch.where(lag >= 0, torch.exp(-beta[:, None, None] * lag.clamp(min=0)), torch.zeros((), dtype=x.dtype))
    out = torch.einsum("hij,bhjd->bhid", A, x)
    if state is not None:
        out = out + torch.exp(-beta[:, None] * (t + 1))[None, :, :, None] * state[:, :, None, :]
    return out


@pytest.mark.parametrize("chunk", [2, 3, 16, 64])
def test_chunked_leaky_average_equals_dense(chunk):
    g = torch.Generator().manual_seed(chunk)
    beta = torch.tensor([0.0, 0.03, 0.5, 5.0, 80.0], dtype=torch.float64)  # cumsum ... nearly no memory
    for T in (1, 5, 64, 100, 257):
        x = torch.randn(2, 5, T, 3, generator=g, dtype=torch.float64)
        state = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
        tol = dict(atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(leaky_average(x, beta, None, chunk), _dense_leaky(x, beta), **tol)
        torch.testing.assert_close(leaky_average(x, beta, state, chunk), _dense_leaky(x, beta, state), **tol)
        if T > 1:  # carrying the state across a split is the same as one pass
            first = leaky_average(x[:, :, :2], beta, None, chunk)
            rest = leaky_average(x[:, :, 2:], beta, first[:, :, -1], chunk)
            torch.testing.assert_close(torch.cat([first, rest], 2), _dense_leaky(x, beta), **tol)


def test_loss_follows_hf_convention(tiny_model):
    ids = _ids(2, 20)
    labels = ids.clone()
    labels[0, 5] = -100
    out = tiny_model(ids, labels=labels)
    want = F.cross_entropy(out.logits[:, :-1].reshape(-1, 61), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, want)


# ------------------------------------------------------------------ HF integration


@pytest.mark.parametrize("extra", [{}, dict(bias=True, tie_word_embeddings=False, pmem_count=2, init="nano",
                                            logit_scale="none", pre_ln=False, key_clamp="nano")])
def test_save_pretrained_round_trip(tmp_path, extra):
    torch.manual_seed(0)
    model = MemoryMosaicsForCausalLM(MemoryMosaicsConfig(**{**TINY, **extra})).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # no trust_remote_code
    assert type(loaded) is MemoryMosaicsForCausalLM
    drop_path = lambda d: {k: v for k, v in d.items() if k != "_name_or_path"}  # noqa: E731
    assert drop_path(loaded.config.to_dict()) == drop_path(model.config.to_dict())
    assert (loaded.lm_head.weight is loaded.model.wte.weight) == model.config.tie_word_embeddings
    ids = _ids(2, 50)
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_cached_decoding_equals_full_forward():
    model, _ = _converted("nano", torch.float64, seed=5)  # float64: compare the algebra, not the rounding
    ids = _ids(2, 60)
    full = model(ids).logits
    cache = MemoryMosaicsCache()
    parts = [model(ids[:, :1], past_key_values=cache, use_cache=True).logits,  # a lone first token
             model(ids[:, 1:23], past_key_values=cache).logits]  # several tokens after a cache
    parts += [model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(23, 60)]
    assert cache.get_seq_length() == 60 and len(cache) == model.config.n_layer
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-9, rtol=1e-9)


def test_generate_with_cache_equals_without(tiny_model):
    prompt = _ids(2, 7, seed=3)
    for kwargs in (dict(), dict(num_beams=2)):
        with_cache = tiny_model.generate(prompt, max_new_tokens=20, do_sample=False, **kwargs)
        without = tiny_model.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=False, **kwargs)
        assert with_cache.shape == (2, 27)
        assert torch.equal(with_cache, without)


def test_padded_attention_mask_is_refused(tiny_model):
    ids = _ids(2, 10)
    tiny_model(ids, attention_mask=torch.ones_like(ids))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(OwaiError, match="padded attention_mask"):
        tiny_model(ids, attention_mask=mask)


# ------------------------------------------------------------------ errors and the converter


@pytest.mark.parametrize("bad", [dict(n_embd=30, n_head=4), dict(n_layer=0), dict(vocab_size=-1), dict(init="xavier"),
                                 dict(logit_scale="sqrt"), dict(leaky_chunk=1), dict(hd_dropout=1.5),
                                 dict(key_clamp="none"), dict(leaky_init=(1.0,))])
def test_bad_config_raises_owai_error(bad):
    with pytest.raises(OwaiError):
        MemoryMosaicsConfig(**{**TINY, **bad})


def test_converter_unwraps_checkpoints_and_rejects_bad_keys(tmp_path):
    sd = random_official_state_dict("library", variant="eft")
    prefixed = {"module._orig_mod." + k: v for k, v in sd.items()}
    cfg, osd = convert_official_state_dict({"model": prefixed, "iter_num": 3})
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.pmem_size, cfg.vocab_size) == (2, 32, 4, 24, 61)
    assert (cfg.logit_scale, cfg.init, cfg.key_scale_max_exp) == ("inv_sqrt_dim", "library", 5.0)
    ncfg, _ = convert_official_state_dict(random_official_state_dict("nano"))
    assert (ncfg.logit_scale, ncfg.init, ncfg.key_clamp) == ("none", "nano", "nano")
    assert ncfg.key_scale_max_exp == pytest.approx(math.log(2**16 - 1))

    with pytest.raises(OwaiError, match="unexpected"):
        convert_official_state_dict({**sd, "blocks.0.attn.mystery": torch.zeros(3)})
    missing = dict(sd)
    del missing["blocks.1.pmem.value_beta"]
    with pytest.raises(OwaiError, match="missing key"):
        convert_official_state_dict(missing)
    with pytest.raises(OwaiError):
        convert_official_state_dict({"foo.weight": torch.zeros(2)})

    path = tmp_path / "ckpt.pt"
    args = {"pre_ln": False, "ic_dropout": 0.0, "block_size": 512}  # what Library's train script stores
    torch.save({"model": sd, "model_args": args, "iter_num": 1}, path)
    model = load_official_checkpoint(path)
    assert model.config.pre_ln is False and not model.training
    ids = _ids(1, 40)
    want = NaiveMemoryMosaics(sd, "library", pre_ln=False).logits(ids)
    torch.testing.assert_close(model(ids).logits.double(), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(OwaiError):
        load_official_checkpoint(tmp_path / "nope.pt")


def test_contextual_dropout_is_its_own_setting():
    """contextual_dropout 0 (the Library's eft model): with no persistent memory and no residual
    dropout, a training-mode forward is the eval-mode one; left unset it follows ic_dropout."""
    ids = _ids(2, 24)
    settings = dict(TINY, attn_only=True, ic_dropout=0.5, hd_dropout=0.0)
    torch.manual_seed(0)
    eft = MemoryMosaicsForCausalLM(MemoryMosaicsConfig(**settings, contextual_dropout=0.0))
    reference = eft.eval()(ids).logits
    assert torch.equal(eft.train()(ids).logits, reference)
    torch.manual_seed(0)
    regular = MemoryMosaicsForCausalLM(MemoryMosaicsConfig(**settings))
    assert torch.equal(regular.eval()(ids).logits, reference)  # the same weights
    assert not torch.allclose(regular.train()(ids).logits, reference)
    with pytest.raises(OwaiError, match="contextual_dropout must be in"):
        MemoryMosaicsConfig(**TINY, contextual_dropout=1.0)
