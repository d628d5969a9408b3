"""The language-model zoo's names: each architecture's module, config class and causal-LM class,
as import paths. Importing this imports no model (nor transformers), so listing and validating
recipes stays fast; `owai.models.lm` builds from it. Adding a sequence model is one line here.
"""

from __future__ import annotations

# arch name -> (module, config class or factory, causal-LM class or factory(config))
ARCHITECTURES: dict[str, tuple[str, str, str]] = {
    "mm": ("owai.models.memory_mosaics", "MemoryMosaicsConfig", "MemoryMosaicsForCausalLM"),
    "gpt": ("owai.models.gpt", "GPTConfig", "GPTForCausalLM"),
    "lstm": ("owai.models.lstm", "LSTMConfig", "LSTMForCausalLM"),
    "transformer": ("owai.models.llama", "llama_config", "transformer_lm"),  # LlamaConfig / LlamaForCausalLM
    "mmv2": ("owai.models.memory_mosaics_v2", "MemoryMosaicsV2Config", "MemoryMosaicsV2ForCausalLM"),
}

# the architectures of thesis chapter 4, built at a size of owai.models.sizes.SIZES
SIZED = ("mmv2", "transformer")

# the architectures whose forward reads restarting position_ids as document boundaries (packed
# documents, `data.documents`): the others would attend, or carry their state, across documents
DOCUMENT_MASKED = ("mmv2", "transformer")
# the `model_type` their saved models' config.json records (a test checks it against the config classes)
DOCUMENT_MASKED_TYPES = ("owai_memory_mosaics_v2", "llama")
