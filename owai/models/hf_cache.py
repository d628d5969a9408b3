"""The generation cache between owai's language models and transformers' `generate`, in one place.

transformers 5.x renamed the cache argument of `forward` and the cache field of the model outputs
from `past_key_values` to `cache`: newer `generate` passes `cache=...` to the model and reads
`outputs["cache"]`, older releases use `past_key_values`, and the new releases still accept the old
name but log "`past_key_values`/`cache_params` are deprecated" on each use. So owai's models

- accept both keyword arguments in `forward` (`given_cache`),
- answer under the installed release's own field name (`CACHE_FIELD`, `with_cache`), so no
  deprecation message is logged whatever the release,
- and hand `generate` their own state caches (`StateCache`, `own_generation_cache`) under that name.

Code that reads a cache from an output uses `output_cache(out)`, and code that passes one to a model
it did not write (transformers' Llama) passes `**cache_kwargs(cache)`.

What else transformers' callers pass to a `forward` and owai's own models do not compute (input
embeddings, hidden states, attention maps) is refused in one place, `refuse_unread_inputs`: a
`**kwargs` would otherwise swallow it and answer with None or with the ids' logits.

The loss of `forward(labels=...)` is transformers' causal-LM loss for every owai model, in one
place (`causal_lm_loss`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast

from owai.errors import OwaiError

# "cache" on the releases that renamed it, else "past_key_values"
CACHE_FIELD: str = (
    "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
)


UNREAD_OUTPUTS = ("output_hidden_states", "output_attentions")  # asked of an HF model, not returned by owai's


def refuse_unread_inputs(model: str, input_ids: Any, kwargs: dict[str, Any], unread: tuple[str, ...] = UNREAD_OUTPUTS) -> None:
    """One line for an input an owai model's `forward` would otherwise swallow in its `**kwargs`:
    `inputs_embeds` (the models read token ids), and `unread` asked for (hidden states and attention
    maps, which they do not return; `logits_to_keep` where they compute every position's logits)."""
    if input_ids is None or kwargs.get("inputs_embeds") is not None:
        raise OwaiError(f"{model}: forward needs input_ids (inputs_embeds is not supported)")
    asked = [name for name in unread if kwargs.get(name)]
    if asked:
        raise OwaiError(f"{model}: {' and '.join(asked)} not supported (the forward returns logits, loss and cache)")


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy as transformers computes it for `labels`: position t predicts
    labels[t+1], -100 is ignored, and the loss is taken in float32 (bf16 logits under autocast or
    bf16 weights would round it to 3 significant digits). The labels are shifted, not the logits, so
    the (B, T, V) logits are not copied."""
    targets = F.pad(labels, (0, 1), value=-100)[:, 1:].to(logits.device)  # (B, T)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


def given_cache(cache: Any, past_key_values: Any) -> Any:
    """The cache passed to a forward under either name (None if neither); both at once is an error."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise OwaiError("pass the cache once: as `cache` or as `past_key_values`, not both")
    return cache if cache is not None else past_key_values


def forward_cache(cache: Any, past_key_values: Any, use_cache: bool | None, kind: type, make: Callable[[], Any],
                  model: str) -> Any:
    """The cache a forward works with: the one passed (under either name), which must be a `kind`; else
    a new one from `make()` when `use_cache` is True; else None. `use_cache=None` means "when one was
    passed"."""
    cache = given_cache(cache, past_key_values)
    if cache is not None and not isinstance(cache, kind):
        raise OwaiError(f"{model}: the cache must be a {kind.__name__}, got {type(cache).__name__}")
    if use_cache is None:
        use_cache = cache is not None
    return make() if cache is None and use_cache else cache


def with_cache(output_class: type, cache: Any, **fields: Any):
    """`output_class(**fields)` with `cache` under the installed release's field name."""
    return output_class(**fields, **{CACHE_FIELD: cache})


def output_cache(output: Any) -> Any:
    """The cache a model output carries (None if it carries none), read without the deprecated name."""
    return output.get(CACHE_FIELD)


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """`{name: cache}` under the name the installed release's own models take in `forward`."""
    return {CACHE_FIELD: cache}


class StateCache:
    """Incremental-decoding state of a model whose state is not keys and values per layer alone
    (recurrent states, leaky sums): one dict of tensors per layer, batch first, and the number of
    positions seen. Supports what `generate` does to a cache (beam reordering, batch selection and
    repetition). Not a transformers `Cache`: a model hands it to `generate` through
    `own_generation_cache` in its `_prepare_cache_for_generation`."""

    is_compileable = False
    is_croppable = False
    recurrent = False  # True: a recurrent state only, no per-position entries (transformers' "linear" layers)

    def __init__(self) -> None:
        self.layers: list[dict[str, torch.Tensor]] = []
        self.seen_tokens = 0

    @property
    def is_linear(self) -> list[bool]:
        """transformers' per-layer flag (5.x) for a recurrent state, which `generate` never slices by position."""
        return [self.recurrent] * len(self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def __len__(self) -> int:
        return len(self.layers)

    def _apply(self, fn) -> None:
        """Replace every tensor t by fn(t), one layer at a time: each layer's old tensors are freed as
        soon as its new ones exist, so a beam step's reordering (or a batch selection or repeat)
        holds the new cache plus one old layer, not a whole second copy."""
        for i, layer in enumerate(self.layers):
            self.layers[i] = {name: fn(t) for name, t in layer.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: keep batch rows beam_idx."""
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))


def own_generation_cache(generation_config, model_kwargs: dict, cache_class: type, model_name: str) -> None:
    """What a state-cache model's `_prepare_cache_for_generation` does: a `cache_class` cache for
    `generate` (not a DynamicCache) under the release's cache name, unless generation runs without
    one; a cache the caller gave must be one."""
    cache = given_cache(model_kwargs.get("cache"), model_kwargs.get("past_key_values"))
    if cache is not None:
        if not isinstance(cache, cache_class):
            raise OwaiError(f"{model_name}: generate needs a {cache_class.__name__} as its cache, got {type(cache).__name__}")
        return
    if generation_config.use_cache is False:
        return
    model_kwargs[CACHE_FIELD] = cache_class()
