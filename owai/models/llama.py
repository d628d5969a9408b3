"""The transformer baseline of thesis ch. 4: the Llama architecture, as transformers' own `LlamaForCausalLM`.

Chapter 4 compares Memory Mosaics v2 with "the transformer baseline = the Llama architecture":
pre-norm RMSNorm blocks, SwiGLU FFN (W_2 (silu(W_1 x) * W_3 x)), RoPE on queries and keys,
multi-head attention (grouped-query attention as an option), no biases, untied input and output
embeddings, Llama-3 vocabulary of 128,256 tokens. This module does not re-implement it: the model
IS `transformers.LlamaForCausalLM` (model_type "llama"), so checkpoints save and load through the
Auto classes with no remote code, and any Llama tool reads them. What lives here is owai's side:

- `size_config(size)`: a thesis size (the table `owai.models.sizes.SIZES`, shared with Memory
  Mosaics v2). "small" (~1.83B parameters)
  and "large" (~8.84B; Table 4.2 reports 8.8B); "tiny" is for CPU tests, its vocabulary the
  tokenizer's (vocab_size None: the caller passes it).
- `llama_config(...)`: owai's names -> a `LlamaConfig`, OwaiError (one line) for impossible values.
  Registered in the zoo as `ARCHITECTURES["transformer"]`, so `build_lm("transformer", n_layer=..,
  n_embd=.., n_head=.., ffn_hidden=.., vocab_size=..)` builds one.
- `transformer_lm(config)`: the model (a plain `LlamaForCausalLM`, see "Cache" below).
- `document_mask(position_ids)`: an explicit packed-document attention mask (see below).
- `packed_document_attention(model, device)`: flex_attention for packed documents on CUDA.

Assumptions (the thesis does not state them; these are Llama-3's):
- rope_theta = 500,000 (Llama-3; Llama-2 used 10,000). rms_norm_eps = 1e-5, init N(0, 0.02)
  (transformers' Llama init: every Linear and the embedding; RMSNorm weights 1).
- MHA by default (num_key_value_heads = num_attention_heads); `n_kv_head` selects GQA.
- bos/eos token ids are None (the tokenizer's business; pass them as extra settings if wanted).

max_position_embeddings: transformers' Llama computes the rotary angles from `position_ids` on
every call (default rope type: no table, no dynamic scaling), so the value limits nothing; it is
metadata that some tools (e.g. serving engines) read as the model's maximal length. The default
is 131,072 (Llama-3.1's); a model "trained at 512" runs at 4096 tokens unchanged (tested).

Packed documents (several documents in one training row, `position_ids` restarting at 0 at every
document start, transformers' packed-sequence convention). transformers (masking_utils.
`_preprocess_mask_arguments` -> `find_packed_sequence_indices` -> `create_causal_mask`) turns
position restarts into a block-diagonal causal mask, for sdpa and eager alike, but ONLY when
`attention_mask is None` and `past_key_values is None`. LlamaModel.forward creates a
`DynamicCache` before building the mask whenever `use_cache` is true, and stock LlamaConfig has
`use_cache=True`: then `model(input_ids=x, position_ids=pos)` silently lets every token attend to
the earlier documents of its row (measured with transformers 5.23: max |logit difference| to the
documents run alone 0.44 for sdpa, 0.65 for eager; 1.5e-7 for both with use_cache=False).
Hence owai's decision:
- `llama_config` sets `use_cache=False` (owai's GPT convention: training and evaluation forwards
  hold no keys/values unless asked with `use_cache=True`), so the trainer's plain call
  `model(input_ids=x, position_ids=pos)` masks across documents, with sdpa and eager (tested);
- `transformer_lm` sets `generation_config.use_cache=True`, so `generate` still decodes with a
  KV cache; save_pretrained writes it to generation_config.json and from_pretrained reads it back;
- a 2-D `attention_mask` (even all ones) also switches the detection off: pass none, or pass
  `attention_mask=document_mask(pos, dtype)`, a ready 4-D additive mask that transformers uses
  as it is (sdpa and eager), whatever the cache setting (e.g. for a foreign Llama checkpoint whose
  config has use_cache=True).
"""

from __future__ import annotations

import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from owai.errors import OwaiError, did_you_mean
from owai.models.sizes import size_settings

DEFAULT_MAX_POSITIONS = 131072  # metadata only: RoPE is computed per call (module docstring)

# Llama settings that owai names itself: the owai name to use instead
_OWAI_NAMES = {
    "num_hidden_layers": "n_layer",
    "hidden_size": "n_embd",
    "num_attention_heads": "n_head",
    "intermediate_size": "ffn_hidden",
    "num_key_value_heads": "n_kv_head",
    "head_dim": "n_embd / n_head",
}
_NOT_SETTINGS = {"transformers_version", "architectures", "id2label", "label2id", "problem_type"}


def _llama_fields() -> frozenset[str]:
    import dataclasses

    return frozenset(f.name for f in dataclasses.fields(LlamaConfig) if not f.name.startswith("_"))


def llama_config(
    n_layer: int,
    n_embd: int,
    n_head: int,
    ffn_hidden: int,
    vocab_size: int,
    n_kv_head: int | None = None,
    rope_theta: float = 500000.0,
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS,
    initializer_range: float = 0.02,
    **extra,
) -> LlamaConfig:
    """A `LlamaConfig` from owai's names: n_layer blocks of width n_embd, n_head query heads,
    n_kv_head key/value heads (None = n_head: MHA; fewer: GQA), SwiGLU hidden width ffn_hidden.

    `extra` passes further LlamaConfig settings (attention_bias, mlp_bias, tie_word_embeddings,
    rms_norm_eps, attention_dropout, bos/eos/pad_token_id, dtype, rope_parameters merged over
    {"rope_type": "default", "rope_theta": rope_theta}, attn_implementation, use_cache).
    Impossible values raise OwaiError with a one-line message.
    """

    def fail(message: str):
        raise OwaiError(f"transformer config: {message}")

    sizes = {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "ffn_hidden": ffn_hidden,
             "vocab_size": vocab_size, "max_position_embeddings": max_position_embeddings}
    if n_kv_head is not None:
        sizes["n_kv_head"] = n_kv_head
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail(f"{name} must be a positive integer, got {value!r}")
    kv = n_head if n_kv_head is None else n_kv_head
    if n_embd % n_head:
        fail(f"n_embd={n_embd} is not divisible by n_head={n_head}")
    if n_head % kv:
        fail(f"n_head={n_head} is not divisible by n_kv_head={kv}")
    if (n_embd // n_head) % 2:
        fail(f"RoPE needs an even head size, got n_embd/n_head={n_embd // n_head}")
    for name, value in (("rope_theta", rope_theta), ("initializer_range", initializer_range)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            fail(f"{name} must be a positive number, got {value!r}")

    known = (_llama_fields() - _NOT_SETTINGS - set(_OWAI_NAMES)) | {"attn_implementation"}
    for key in extra:
        if key in _OWAI_NAMES:
            fail(f"set {_OWAI_NAMES[key]}, not the Llama name {key!r}")
        if key not in known:
            fail(f"unknown setting {key!r}{did_you_mean(key, known | set(_OWAI_NAMES.values()))}")
    rope = {"rope_type": "default", "rope_theta": float(rope_theta), **(extra.pop("rope_parameters", None) or {})}
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if rope["rope_type"] not in {"default", *ROPE_INIT_FUNCTIONS}:
        fail(f"unknown rope_type {rope['rope_type']!r}; known: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    implementations = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if extra.get("attn_implementation") not in (None, *implementations):
        fail(f"unknown attn_implementation {extra['attn_implementation']!r}; known: {', '.join(implementations)}")
    settings = dict(
        vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=ffn_hidden, num_hidden_layers=n_layer,
        num_attention_heads=n_head, num_key_value_heads=kv, head_dim=n_embd // n_head, hidden_act="silu",
        max_position_embeddings=max_position_embeddings, initializer_range=float(initializer_range),
        rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        rope_parameters=rope, use_cache=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    settings.update(extra)
    try:
        return LlamaConfig(**settings)
    except Exception as err:  # huggingface_hub's strict-dataclass type checks, rope validation
        reason = err.__cause__ or err
        first = next((line.strip() for line in str(reason).splitlines() if line.strip()), type(reason).__name__)
        raise OwaiError(f"transformer config: {first}") from None


# lm_config (owai.models.lm) accepts the signature's names and these (Llama's own names for owai's
# settings included, so that llama_config answers them with the owai name to use)
llama_config.extra_keys = (_llama_fields() - _NOT_SETTINGS) | {"attn_implementation"}


def size_config(size: str, vocab_size: int | None = None, **overrides) -> LlamaConfig:
    """`llama_config` of a `SIZES` entry (owai.models.sizes); vocab_size (required for "tiny") and
    other llama_config arguments override the table."""
    return llama_config(**{**size_settings(size, vocab_size), **overrides})


def transformer_lm(config: LlamaConfig) -> LlamaForCausalLM:
    """A freshly initialised `LlamaForCausalLM` whose `generate` decodes with a KV cache although
    its config says use_cache=False (module docstring: packed documents)."""
    model = LlamaForCausalLM(config)
    if model.generation_config is not None:
        model.generation_config.use_cache = True
    return model


def packed_document_attention(model: torch.nn.Module, device: torch.device) -> None:
    """Packed-document training on CUDA: a Llama reads through flex_attention, where transformers
    turns the position restarts into a BlockMask (nothing T x T, fully masked blocks skipped); with
    sdpa it would build a (B, 1, T, T) mask, which rules out the flash kernels. The same kernel as
    Memory Mosaics v2's memory reads (attn_impl auto). Other models and devices: unchanged."""
    if device.type != "cuda" or getattr(getattr(model, "config", None), "model_type", None) != "llama":
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("flex_attention")
    else:  # older transformers
        model.config._attn_implementation = "flex_attention"


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) positions -> (B, T) document index within each row: a new document starts wherever the
    position does not continue the previous one by +1 (transformers' find_packed_sequence_indices)."""
    if position_ids.dim() != 2:
        raise OwaiError(f"position_ids must be (batch, length), got shape {tuple(position_ids.shape)}")
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def document_mask(position_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (B, 1, T, T) additive attention mask of packed documents: 0 where key j <= query i lies in
    the query's document, the dtype's most negative value elsewhere. Pass it as
    `model(input_ids=x, position_ids=pos, attention_mask=document_mask(pos, dtype))`: a 4-D mask
    is used as it is by both the sdpa and eager implementations (use the model's dtype)."""
    doc = document_ids(position_ids)
    length = doc.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=doc.device).tril()
    allowed = (doc[:, :, None] == doc[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=doc.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
