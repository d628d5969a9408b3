"""An LSTM language model: the recurrent baseline of the RegBench comparison (thesis Fig 3.10, Table B.3).

    token embedding -> dropout -> n_layer stacked LSTM(n_embd) -> dropout -> linear head

By default torch's initialisation and an untied head with a bias. seq_icl's RegBench LSTM
(`lm_simple_noffn` with its `LSTMLayer`) is, as it computes: embedding -> one LSTM with Keras's
initialisation (Xavier input weights, orthogonal recurrent weights, zero biases but a forget-gate
bias of 1) -> the embedding matrix as the head, no bias, no dropout in effect; `init="keras"`,
`tie_word_embeddings=True`, `head_bias=False` give it (owai.methods.regbench sets them).

The same interface as the other zoo models (a Hugging Face `PreTrainedModel` causal LM: forward
with labels, save_pretrained / from_pretrained through the Auto classes), so the RegBench method
treats it like the Memory Mosaic and the transformer. `generate` decodes with an `LSTMCache` (the
recurrent state after the last token); a 2-D attention_mask whose ones are contiguous per row (left
or right padding) runs each row over its own tokens only, from a zero state, so a left-padded row
generates what it generates alone. Importing this module registers `owai_lstm` with `AutoConfig` /
`AutoModelForCausalLM`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from owai.errors import OwaiError
from owai.models.hf_cache import (UNREAD_OUTPUTS, StateCache, causal_lm_loss, forward_cache, own_generation_cache,
                                   refuse_unread_inputs, with_cache)


class LSTMConfig(PretrainedConfig):
    """Hyper-parameters of the LSTM LM. `n_embd` is both the embedding and the hidden size."""

    model_type = "owai_lstm"
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer"}

    vocab_size: int = 20
    n_layer: int = 1
    n_embd: int = 128
    dropout: float = 0.0
    tie_word_embeddings: bool = False  # True: the head is the embedding matrix (seq_icl's)
    head_bias: bool = True
    init: str = "torch"  # torch: its LSTM / Linear defaults; keras: seq_icl's LSTMLayer._reinitialize

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        for name in ("vocab_size", "n_layer", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OwaiError(f"lstm config: {name} must be a positive integer, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise OwaiError(f"lstm config: dropout must be in [0, 1), got {self.dropout!r}")
        if self.init not in ("torch", "keras"):
            raise OwaiError(f"lstm config: init must be torch or keras, got {self.init!r}")


class LSTMCache(StateCache):
    """The LSTM's state after the last token seen: one layer entry {"h", "c"}, each (B, n_layer, C)."""

    recurrent = True


def _token_spans(attention_mask: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) mask of 1/0 -> first real position and number of real tokens per row (B,), (B,).
    OwaiError unless each row's ones are one contiguous, non-empty run (left or right padding)."""
    if attention_mask.dim() != 2 or attention_mask.shape[1] != T:
        raise OwaiError(f"lstm: attention_mask must be 2-D (batch, {T}) of 1/0, got shape {tuple(attention_mask.shape)}")
    keep = attention_mask.bool()
    length = keep.sum(-1)
    start = keep.long().argmax(-1)  # the first 1
    pos = torch.arange(T, device=keep.device)
    inside = (pos >= start[:, None]) & (pos < (start + length)[:, None])
    if bool((length == 0).any()) or not torch.equal(inside, keep):
        raise OwaiError("lstm: attention_mask rows must be one run of ones (left or right padding), none empty")
    return start, length


class LSTMForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LSTMConfig
    main_input_name = "input_ids"
    _no_split_modules = ["LSTM"]
    # {target: source}: with tie_word_embeddings the head is the token embedding (not saved; re-tied on load)
    _tied_weights_keys = {"lm_head.weight": "wte.weight"}

    def __init__(self, config: LSTMConfig) -> None:
        super().__init__(config)
        C = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, C)
        self.drop = nn.Dropout(config.dropout)
        # dropout between stacked layers (torch applies it to every layer's output but the last)
        self.lstm = nn.LSTM(C, C, num_layers=config.n_layer, batch_first=True,
                            dropout=config.dropout if config.n_layer > 1 else 0.0)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=config.head_bias)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Embedding N(0, 1) and torch's own LSTM/Linear defaults (uniform +-1/sqrt(C)), as torch's
        reference LSTM language model uses them; the forget-gate bias starts at 1 (Jozefowicz et al.).
        init="keras": Xavier-uniform input weights, orthogonal recurrent weights, zero biases but
        the forget gate's input bias at 1, as seq_icl's LSTMLayer reinitialises them."""
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight)
        elif isinstance(module, nn.LSTM):
            module.reset_parameters()
            C = module.hidden_size
            for name, param in module.named_parameters():
                if self.config.init == "keras":
                    if name.startswith("weight_ih"):
                        nn.init.xavier_uniform_(param)
                    elif name.startswith("weight_hh"):
                        nn.init.orthogonal_(param)
                    else:
                        param.zero_()
                if name.startswith("bias_ih"):  # gates (input, forget, cell, output)
                    param[C : 2 * C].fill_(1.0)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, embeddings: nn.Embedding) -> None:
        self.wte = embeddings

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, head: nn.Linear) -> None:
        self.lm_head = head

    def forward(self, input_ids: torch.LongTensor | None = None, labels: torch.LongTensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: LSTMCache | None = None,
                use_cache: bool | None = None, return_dict: bool = True,
                past_key_values: LSTMCache | None = None, **kwargs) -> CausalLMOutputWithPast | tuple:
        """input_ids (B, T) -> logits (B, T, V); labels as in the other zoo models (the same tokens,
        shifted here so position t predicts labels[t+1]; -100 ignored).

        attention_mask (B, past+T): padded positions are skipped (their hidden outputs are zeros);
        with a cache the new T columns must be ones. cache (or `past_key_values`):
        the state to continue from, updated in place and returned; use_cache=True alone starts one.
        """
        refuse_unread_inputs("lstm", input_ids, kwargs, UNREAD_OUTPUTS + ("logits_to_keep",))
        B, T = input_ids.shape
        cache = forward_cache(cache, past_key_values, use_cache, LSTMCache, LSTMCache, "lstm")
        past = cache.get_seq_length() if cache is not None else 0
        state = None
        if past:
            layer = cache.layers[0]
            if layer["h"].shape[0] != B:
                raise OwaiError("lstm: batch size differs from the cache's")
            state = (layer["h"].transpose(0, 1).contiguous(), layer["c"].transpose(0, 1).contiguous())

        x = self.drop(self.wte(input_ids))  # (B, T, C)
        padded = attention_mask is not None and not bool(attention_mask.all())
        if padded and past:
            if attention_mask.dim() != 2 or attention_mask.shape[1] != past + T or not bool(attention_mask[:, past:].all()):
                raise OwaiError(f"lstm: with a cache, attention_mask must be (batch, {past + T}) with its last {T} columns 1")
            padded = False  # the padding is in the cached past: the state already skipped it
        if padded:
            h, state = self._run_spans(x, *_token_spans(attention_mask, T))
        else:
            h, state = self.lstm(x, state)  # (B, T, C)
        logits = self.lm_head(self.drop(h))  # (B, T, V)
        if cache is not None:
            cache.layers = [{"h": state[0].transpose(0, 1), "c": state[1].transpose(0, 1)}]
            cache.seen_tokens = past + T
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels)
        out_cache = cache if use_cache else None
        if not return_dict:
            return tuple(v for v in (loss, logits, out_cache) if v is not None)
        return with_cache(CausalLMOutputWithPast, out_cache, loss=loss, logits=logits)

    def _run_spans(self, x: torch.Tensor, start: torch.Tensor, length: torch.Tensor):
        """The LSTM over each row's tokens start..start+length-1 only, from a zero state.
        x (B, T, C) -> outputs (B, T, C) (zeros at padded positions) and the state (h, c)
        after each row's last real token."""
        B, T, C = x.shape
        pos = torch.arange(T, device=x.device)
        gather = (start[:, None] + pos).clamp(max=T - 1)[..., None].expand(B, T, C)  # real tokens first
        packed = pack_padded_sequence(x.gather(1, gather), length.cpu(), batch_first=True, enforce_sorted=False)
        out, state = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=T)  # (B, T, C), zeros past each length
        back = (pos - start[:, None]).clamp(0, T - 1)[..., None].expand(B, T, C)  # position t <- row token t - start
        inside = (pos >= start[:, None]) & (pos < (start + length)[:, None])
        return torch.where(inside[..., None], out.gather(1, back), torch.zeros((), dtype=out.dtype)), state

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """HF generate hook: an LSTMCache instead of a DynamicCache."""
        own_generation_cache(generation_config, model_kwargs, LSTMCache, "lstm")


AutoConfig.register(LSTMConfig.model_type, LSTMConfig, exist_ok=True)
AutoModelForCausalLM.register(LSTMConfig, LSTMForCausalLM, exist_ok=True)
