"""The GPT baseline of the thesis (chapter 3, App. B): nanoGPT as a Hugging Face causal LM.

The BabiStories baseline (`Library/baseline/baselines.py` in the reference code) is nanoGPT as it
was in early 2023, with GELU's tanh approximation (nanoGPT's `new_gelu`, GPT-2's):

    x_0 = drop(wte[tokens] + wpe[positions])                 learned positions, table of block_size rows
    x   = x + drop(c_proj(attn(LN_1(x))))                    pre-LN, causal softmax attention, H heads
    x   = x + drop(c_proj(GELU_tanh(c_fc(LN_2(x)))))         MLP C -> 4C -> C
    logits = LN_f(x) @ wte^T                                 tied embeddings, no logit scaling

one dropout rate everywhere (0.05), bias False, init N(0, 0.02) with the two residual projections
(attention and MLP `c_proj`) at 0.02/sqrt(2 n_layer). RegBench's transformer (seq_icl's `lm_simple`)
is the same block with biases, dropout on the embeddings and attention weights but not on the
residual branches (`resid_dropout=0`); `activation="gelu"` gives today's nanoGPT (exact GELU, as
nanoMosaics' `gpt_model.py`). App. B Fig B.6 also compares RoPE and ALiBi
GPTs, so `position` selects learned / rope / alibi / none. RoPE, ALiBi and none have no table and
run at any context length; the ALiBi bias is built per call from the actual lengths.

Parameter names follow nanoGPT (`transformer.wte`, `transformer.h.0.attn.c_attn`, ...), so nanoGPT
state dicts load as they are. The model is a `PreTrainedModel` + `GenerationMixin`: `generate()`
(greedy, sampling, beam search) uses a `transformers.DynamicCache`, and `save_pretrained` /
`AutoModelForCausalLM.from_pretrained` round-trip without `trust_remote_code` once this module is
imported (it registers `owai_gpt` with the Auto classes at the bottom).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

try:  # transformers >= 5: init functions that skip tensors already loaded from a checkpoint
    from transformers import initialization as init
except ImportError:  # pragma: no cover - older transformers
    from torch.nn import init

from owai.errors import OwaiError
from owai.models.hf_cache import causal_lm_loss, given_cache, refuse_unread_inputs, with_cache

POSITIONS = ("learned", "rope", "alibi", "none")
ACTIVATIONS = {"gelu_tanh": "tanh", "gelu": "none"}  # name -> nn.GELU(approximate=...)


class GPTConfig(PretrainedConfig):
    """nanoGPT hyper-parameters. Defaults: GPT-2 small, block 512, vocab 50304 (thesis §3 baseline).

    `block_size` is the size of the learned position table; it is ignored for rope / alibi / none.
    Invalid values raise `OwaiError`. (transformers 5 turns this class into a keyword-only dataclass:
    every annotated attribute below is a constructor argument and is saved in config.json.)
    """

    model_type = "owai_gpt"
    attribute_map = {  # the generic names transformers (caches, generate) looks up
        "hidden_size": "n_embd",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
    }

    vocab_size: int = 50304
    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    block_size: int = 512
    position: str = "learned"
    rope_theta: float = 10000.0
    dropout: float = 0.05  # embeddings, and attention weights / residual branches unless set below
    attn_dropout: float | None = None  # None: dropout
    resid_dropout: float | None = None  # None: dropout (the attention's and the MLP's output)
    activation: str = "gelu_tanh"  # the thesis's baselines; "gelu": exact (nanoGPT today, nanoMosaics)
    bias: bool = False
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._check()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """A config.json saved before `activation` existed is a model trained with exact GELU."""
        if config_dict.get("model_type", cls.model_type) == cls.model_type and "activation" not in config_dict:
            config_dict = {**config_dict, "activation": "gelu"}
        return super().from_dict(config_dict, **kwargs)

    def branch_dropout(self, name: str) -> float:
        """The dropout of `attn` (attention weights) or `resid` (residual branches)."""
        value = getattr(self, f"{name}_dropout")
        return self.dropout if value is None else value

    def _check(self) -> None:
        for name in ("vocab_size", "n_layer", "n_embd", "n_head", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OwaiError(f"gpt config: {name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise OwaiError(f"gpt config: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.position not in POSITIONS:
            raise OwaiError(f"gpt config: unknown position {self.position!r}; choose one of {', '.join(POSITIONS)}")
        if self.position == "rope" and (self.n_embd // self.n_head) % 2:
            raise OwaiError(f"gpt config: rope needs an even head size, got n_embd/n_head={self.n_embd // self.n_head}")
        if not self.rope_theta > 0:
            raise OwaiError(f"gpt config: rope_theta must be positive, got {self.rope_theta!r}")
        for name in ("dropout", "attn_dropout", "resid_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise OwaiError(f"gpt config: {name} must be in [0, 1), got {value!r}")
        if self.activation not in ACTIVATIONS:
            raise OwaiError(f"gpt config: unknown activation {self.activation!r}; choose one of {', '.join(ACTIVATIONS)}")


# ----------------------------------------------------------------------------------------------
# positions


def alibi_slopes(n_head: int) -> list[float]:
    """The ALiBi head slopes of Press et al. (2022): a geometric sequence 2^(-8/n), 2^(-16/n), ...

    For a head count that is not a power of two, the slopes of the nearest lower power of two are
    followed by every other slope of the next power of two (the reference / BLOOM recipe).
    """

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_head).is_integer():
        return geometric(n_head)
    m = 2 ** math.floor(math.log2(n_head))
    return geometric(m) + geometric(2 * m)[0::2][: n_head - m]


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Additive ALiBi bias -slope_h (i - j) for keys j <= query i, -inf for future keys.

    slopes (H,), q_pos (Tq,), k_pos (Tk,) -> (1, H, Tq, Tk) float32.
    """
    dist = (q_pos[:, None] - k_pos[None, :]).float()  # (Tq, Tk), > 0 for past keys
    bias = -slopes[:, None, None] * dist.clamp(min=0)  # (H, Tq, Tk)
    return bias.masked_fill(dist < 0, float("-inf"))[None]


def rope_cos_sin(positions: torch.Tensor, head_size: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for integer positions (B or 1, T) -> cos, sin of shape (B or 1, 1, T, hs), float32.

    Rotate-half (GPT-NeoX / Llama) layout: channel c and c + hs/2 form one rotating pair.
    """
    inv_freq = theta ** (-torch.arange(0, head_size, 2, device=positions.device, dtype=torch.float32) / head_size)
    angles = positions[..., None].float() * inv_freq  # (B, T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # (B, 1, T, hs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys x (B, H, T, hs) by the position angles."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# blocks


class CausalSelfAttention(nn.Module):
    """Multi-head causal softmax attention, one fused qkv projection (nanoGPT `c_attn`)."""

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.head_size = config.n_embd // config.n_head
        self.dropout = config.branch_dropout("attn")  # on the attention weights
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True  # init std 0.02/sqrt(2 n_layer)
        self.resid_dropout = nn.Dropout(config.branch_dropout("resid"))

    def qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None):
        """x (B, T, C) -> q, k, v (B, H, T, hs), rotary positions applied to q and k when given."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, self.head_size).transpose(1, 2) for t in (q, k, v))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def forward(self, x, attn_mask=None, is_causal=True, rope=None, cache: Cache | None = None):
        """x (B, T, C) -> (B, T, C). attn_mask: None, bool (True = attend) or additive float (B|1, H|1, T, Tk)."""
        B, T, C = x.shape
        q, k, v = self.qkv(x, rope)
        if cache is not None:  # append this step's keys/values; get all of them back (B, H, Tk, hs)
            k, v = cache.update(k, v, self.layer_idx)
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(q.dtype)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, dropout_p=self.dropout if self.training else 0.0
        )  # (B, H, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """C -> 4C -> GELU (tanh approximation by default) -> C."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate=ACTIVATIONS[config.activation])
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True  # init std 0.02/sqrt(2 n_layer)
        self.dropout = nn.Dropout(config.branch_dropout("resid"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, attn_mask=None, is_causal=True, rope=None, cache=None):
        x = x + self.attn(self.ln_1(x), attn_mask, is_causal, rope, cache)
        return x + self.mlp(self.ln_2(x))


# ----------------------------------------------------------------------------------------------
# the model


class GPTForCausalLM(PreTrainedModel, GenerationMixin):
    """nanoGPT causal LM with the Hugging Face interface (forward with labels, generate, save/load)."""

    config_class = GPTConfig
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    # {target: source}: lm_head.weight is the token embedding (not saved; re-tied on load)
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        C = config.n_embd
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, C),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=nn.LayerNorm(C, eps=config.layer_norm_eps, bias=config.bias),
            )
        )
        if config.position == "learned":
            self.transformer["wpe"] = nn.Embedding(config.block_size, C)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        self.post_init()  # init weights (`_init_weights`) and tie lm_head to wte

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """nanoGPT init: N(0, 0.02), residual projections N(0, 0.02/sqrt(2 n_layer)), biases 0, LN 1."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            if getattr(module, "residual_projection", False):
                std = std / math.sqrt(2 * self.config.n_layer)
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.transformer.wte = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    # -- pieces shared by forward and last_token_attention --------------------------------------

    def _embed(self, input_ids: torch.Tensor, past: int, position_ids: torch.Tensor | None):
        """Token (+ learned position) embedding and the rotary tables.

        input_ids (B, T), `past` cached tokens -> x (B, T, C), rope (cos, sin) or None.
        """
        cfg = self.config
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=input_ids.device)[None]  # (1, T)
        x = self.transformer.wte(input_ids)  # (B, T, C)
        rope = None
        if cfg.position == "learned":
            if past + T > cfg.block_size:
                raise OwaiError(
                    f"context of {past + T} tokens is longer than the model's learned position table "
                    f"(block_size={cfg.block_size})"
                )
            x = x + self.transformer.wpe(position_ids)  # (B|1, T, C) broadcast
        elif cfg.position == "rope":
            rope = rope_cos_sin(position_ids, cfg.n_embd // cfg.n_head, cfg.rope_theta)
        return self.transformer.drop(x), rope

    def _attention_mask(self, B: int, T: int, past: int, attention_mask: torch.Tensor | None, device):
        """The mask passed to every attention layer: (attn_mask, is_causal) for SDPA.

        Queries are positions past..past+T-1, keys 0..past+T-1. Plain causal attention with no
        cache uses SDPA's `is_causal` (no mask tensor, flash kernels); one new token with a cache
        sees every key (no mask). Otherwise an explicit mask is built from the actual lengths:
        bool (True = attend) or, for ALiBi, the additive bias with -inf on the masked keys.
        A 2-D `attention_mask` (B, past+T) of 1/0 hides padded keys; a query always sees itself,
        so no row is fully masked.
        """
        alibi = self.config.position == "alibi"
        if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape != (B, past + T)):
            raise OwaiError(
                f"attention_mask must be 2-D (batch, {past + T}) of 1/0, got shape {tuple(attention_mask.shape)}"
            )
        if attention_mask is not None and not torch.compiler.is_compiling() and bool(attention_mask.all()):
            # no padding (what `generate` passes for one prompt): a mask of ones would cost a (B, 1, T, T)
            # tensor and SDPA's masked kernels, 16 GiB at 128k tokens, where `is_causal` needs none
            attention_mask = None
        if attention_mask is None and not alibi:
            if past == 0:
                return None, True
            if T == 1:
                return None, False
        q_pos = torch.arange(past, past + T, device=device)  # (T,)
        k_pos = torch.arange(past + T, device=device)  # (Tk,)
        if alibi:
            slopes = torch.tensor(alibi_slopes(self.config.n_head), device=device)
            mask = alibi_bias(slopes, q_pos, k_pos)  # (1, H, T, Tk)
        else:
            mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # (1, 1, T, Tk)
        if attention_mask is not None:
            keep = attention_mask.bool()[:, None, None, :] | (k_pos[None, :] == q_pos[:, None])  # (B, 1, T, Tk)
            mask = mask.masked_fill(~keep, float("-inf")) if alibi else mask & keep
        return mask, False

    # -- forward ---------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        return_dict: bool = True,
        logits_to_keep: int = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """input_ids (B, T) -> logits (B, T, V) for every position (or the last `logits_to_keep`).

        labels (B, T): HF convention, the same tokens as input_ids; shifted here so position t
        predicts labels[t+1]; -100 is ignored; loss = mean cross-entropy.
        Cache (`cache`, or its older name `past_key_values`; owai.models.hf_cache): `use_cache`
        defaults to "only if a cache is given" (so training and evaluation never hold keys/values
        they do not need); `use_cache=True` alone starts a new `DynamicCache`. With a cache,
        input_ids are only the new tokens; the cache holds the rest and is updated in place
        (`Cache.update(k, v, layer_idx)`) and returned.
        """
        refuse_unread_inputs("gpt", input_ids, kwargs)
        B, T = input_ids.shape
        cache = given_cache(cache, past_key_values)
        if use_cache is None:
            use_cache = cache is not None
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if cache is not None and not isinstance(cache, Cache):
            raise OwaiError("the cache must be a transformers Cache (e.g. DynamicCache), not a tuple")
        cache = cache if use_cache else None
        past = cache.get_seq_length() if cache is not None else 0

        x, rope = self._embed(input_ids, past, position_ids)  # (B, T, C)
        attn_mask, is_causal = self._attention_mask(B, T, past, attention_mask, input_ids.device)
        for block in self.transformer.h:
            x = block(x, attn_mask, is_causal, rope, cache)
        x = self.transformer.ln_f(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(x)  # (B, T, V)

        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels)

        out = with_cache(CausalLMOutputWithPast, cache, loss=loss, logits=logits)
        return out if return_dict else out.to_tuple()

    @torch.no_grad()
    def last_token_attention(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Softmax attention weights of the LAST query over all T keys (itself included), per layer and head.

        input_ids (B, T) -> (n_layer, B, H, T) float32, rows sum to 1. Only that one row is computed
        (Fig B.5/B.6 plots). Call in eval mode: in training mode the residual stream gets dropout.
        """
        cfg = self.config
        B, T = input_ids.shape
        x, rope = self._embed(input_ids, 0, None)
        attn_mask, is_causal = self._attention_mask(B, T, 0, None, input_ids.device)
        scale = 1.0 / math.sqrt(cfg.n_embd // cfg.n_head)
        if cfg.position == "alibi":  # bias of the last query (position T-1) over keys 0..T-1
            slopes = torch.tensor(alibi_slopes(cfg.n_head), device=input_ids.device)
            last_bias = -slopes[:, None] * (T - 1 - torch.arange(T, device=input_ids.device)).float()  # (H, T)
        rows = []
        for block in self.transformer.h:
            q, k, _ = block.attn.qkv(block.ln_1(x), rope)  # (B, H, T, hs)
            scores = (q[:, :, -1:] @ k.transpose(-2, -1)).squeeze(2).float() * scale  # (B, H, T)
            if cfg.position == "alibi":
                scores = scores + last_bias
            rows.append(scores.softmax(dim=-1))
            x = block(x, attn_mask, is_causal, rope, None)
        return torch.stack(rows)  # (L, B, H, T)


# Register with the Auto classes (exist_ok: re-importing or reloading this module is harmless).
AutoConfig.register(GPTConfig.model_type, GPTConfig, exist_ok=True)
AutoModelForCausalLM.register(GPTConfig, GPTForCausalLM, exist_ok=True)
