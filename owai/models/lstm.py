"""An LSTM language model: the recurrent baseline of the RegBench comparison (thesis Fig 3.10, Table B.3).

    token embedding -> dropout -> n_layer stacked LSTM(n_embd) -> dropout -> linear head

The same interface as the other zoo models (a Hugging Face `PreTrainedModel` causal LM: forward
with labels, save_pretrained / from_pretrained through the Auto classes), so the RegBench method
treats it like the Memory Mosaic and the transformer. Importing this module registers
`owai_lstm` with `AutoConfig` / `AutoModelForCausalLM`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from owai.errors import OwaiError


class LSTMConfig(PretrainedConfig):
    """Hyper-parameters of the LSTM LM. `n_embd` is both the embedding and the hidden size."""

    model_type = "owai_lstm"
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer"}

    vocab_size: int = 20
    n_layer: int = 1
    n_embd: int = 128
    dropout: float = 0.0
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        for name in ("vocab_size", "n_layer", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OwaiError(f"lstm config: {name} must be a positive integer, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise OwaiError(f"lstm config: dropout must be in [0, 1), got {self.dropout!r}")


class LSTMForCausalLM(PreTrainedModel):
    config_class = LSTMConfig
    main_input_name = "input_ids"
    _no_split_modules = ["LSTM"]

    def __init__(self, config: LSTMConfig) -> None:
        super().__init__(config)
        C = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, C)
        self.drop = nn.Dropout(config.dropout)
        # dropout between stacked layers (torch applies it to every layer's output but the last)
        self.lstm = nn.LSTM(C, C, num_layers=config.n_layer, batch_first=True,
                            dropout=config.dropout if config.n_layer > 1 else 0.0)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=True)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Embedding N(0, 1) and torch's own LSTM/Linear defaults (uniform +-1/sqrt(C)), as torch's
        reference LSTM language model uses them; the forget-gate bias starts at 1 (Jozefowicz et al.)."""
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight)
        elif isinstance(module, nn.LSTM):
            module.reset_parameters()
            C = module.hidden_size
            for name, param in module.named_parameters():
                if name.startswith("bias_ih"):  # gates (input, forget, cell, output)
                    param[C : 2 * C].fill_(1.0)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.LongTensor, labels: torch.LongTensor | None = None,
                return_dict: bool = True, **kwargs) -> CausalLMOutput | tuple:
        """input_ids (B, T) -> logits (B, T, V); labels as in the other zoo models (the same tokens,
        shifted here so position t predicts labels[t+1]; -100 ignored)."""
        x = self.drop(self.wte(input_ids))  # (B, T, C)
        h, _ = self.lstm(x)  # (B, T, C)
        logits = self.lm_head(self.drop(h))  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        if not return_dict:
            return (loss, logits) if loss is not None else (logits,)
        return CausalLMOutput(loss=loss, logits=logits)


AutoConfig.register(LSTMConfig.model_type, LSTMConfig, exist_ok=True)
AutoModelForCausalLM.register(LSTMConfig, LSTMForCausalLM, exist_ok=True)
