"""The language-model zoo: one entry point for the trainer and the evaluations.

    model = build_lm("gpt", n_layer=12, position="learned")     # or "mm" (Memory Mosaics)
    optimizer = adamw(model, lr=5e-3, betas=(0.9, 0.95), weight_decay=0.1)

Every architecture is a Hugging Face `PreTrainedModel` causal LM (forward with labels,
`generate`, `save_pretrained`). Importing this module imports the model modules, which register
their `model_type` with `AutoConfig` / `AutoModelForCausalLM`, so a saved run directory loads with
`AutoModelForCausalLM.from_pretrained(path)` and no `trust_remote_code`.
Adding a sequence model is one line in `owai.models.zoo.ARCHITECTURES`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Callable, Literal

import torch
from transformers import PretrainedConfig, PreTrainedModel

import owai.models.gpt  # noqa: F401  (registers owai_gpt with the Auto classes)
import owai.models.llama  # noqa: F401  (the transformer baseline: transformers' own Llama, model_type "llama")
import owai.models.lstm  # noqa: F401  (registers owai_lstm with the Auto classes)
import owai.models.memory_mosaics  # noqa: F401  (registers owai_memory_mosaics with the Auto classes)
import owai.models.memory_mosaics_v2  # noqa: F401  (registers owai_memory_mosaics_v2 with the Auto classes)
from owai.errors import OwaiError, did_you_mean, one_line
from owai.models.zoo import ARCHITECTURES, SIZED


def _classes(arch: str) -> tuple[Callable[..., PretrainedConfig], Callable[[PretrainedConfig], PreTrainedModel]]:
    if arch not in ARCHITECTURES:
        raise OwaiError(f"unknown language model {arch!r}; known: {', '.join(sorted(ARCHITECTURES))}")
    module_name, config_name, model_name = ARCHITECTURES[arch]
    module = importlib.import_module(module_name)
    return getattr(module, config_name), getattr(module, model_name)


def config_keys(config_class: type[PretrainedConfig] | Callable[..., PretrainedConfig]) -> set[str]:
    """The constructor arguments of a config class (dataclass fields in transformers 5, else `__init__`),
    or of a config factory function: its named parameters, plus its `extra_keys` attribute if any
    (the settings its **kwargs pass on, e.g. `owai.models.llama.llama_config`)."""
    if not isinstance(config_class, type):
        params = inspect.signature(config_class).parameters.values()
        keys = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        return keys | set(getattr(config_class, "extra_keys", ()))
    keys = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    params = inspect.signature(config_class.__init__).parameters.values()
    keys |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    return keys


def lm_config(arch: str, **config_kwargs) -> PretrainedConfig:
    """The config of `arch` with `config_kwargs` overriding its defaults; unknown keys raise OwaiError."""
    config_class, _ = _classes(arch)
    known = config_keys(config_class)
    for key in config_kwargs:
        if key not in known:
            raise OwaiError(f"unknown {arch} model setting {key!r}{did_you_mean(key, known)}")
    if not isinstance(config_class, type):  # a factory: its arguments without defaults are required
        params = inspect.signature(config_class).parameters.values()
        missing = [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                   and p.name not in config_kwargs]
        if missing:
            raise OwaiError(f"the {arch} model needs the setting{'s' * (len(missing) > 1)} {', '.join(missing)}")
    return config_class(**config_kwargs)


def build_lm(arch: str, **config_kwargs) -> PreTrainedModel:
    """A freshly initialised causal LM: `build_lm("gpt", n_layer=4)`, `build_lm("mm", ...)`."""
    _, model_class = _classes(arch)
    return model_class(lm_config(arch, **config_kwargs))


def build_sized_lm(arch: str, size: str, vocab_size: int | None = None, meta: bool = False, **overrides) -> PreTrainedModel:
    """A chapter-4 architecture at a thesis size (`owai.models.sizes.SIZES`), `overrides` on top; on
    the meta device with `meta` (shapes only, no memory: how Table 4.2's counts and the memory plan
    are computed for a 9.9B model on a laptop)."""
    from owai.models.sizes import size_settings

    if arch not in SIZED:
        raise OwaiError(f"model sizes apply to {', '.join(SIZED)}, not {arch!r}")
    kwargs = {**size_settings(size, vocab_size), **overrides}
    if meta:
        with torch.device("meta"):
            return build_lm(arch, **kwargs)
    return build_lm(arch, **kwargs)


def decay_param_groups(model: torch.nn.Module, weight_decay: float,
                       scope: Literal["matrices", "all"] = "matrices") -> list[dict]:
    """AdamW parameter groups: weight decay on tensors with >= 2 dims, none on the rest.

    Decayed: matrices, embeddings (tied lm_head included, counted once) and Memory Mosaics'
    3-D persistent-memory slots. Not decayed: LayerNorm weights, biases, per-head scalars.
    scope="all": one group, every parameter decayed (seq_icl's RegBench training).
    Frozen parameters (requires_grad False) are left out.
    """
    decay, no_decay = [], []
    for _, param in model.named_parameters():  # named_parameters yields a shared (tied) tensor once
        if param.requires_grad:
            (decay if scope == "all" or param.dim() >= 2 else no_decay).append(param)
    if scope == "all":
        return [{"params": decay, "weight_decay": weight_decay}]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def adamw(model: torch.nn.Module, lr: float, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
          scope: Literal["matrices", "all"] = "matrices") -> torch.optim.AdamW:
    """AdamW as owai trains its language models: `decay_param_groups`' groups, and on CUDA torch's
    fused kernel (one launch over every parameter, as nanoGPT and torchtitan use; the multi-tensor
    default took ~40 ms of a 2B model's training step on an H200, docs/results.md). Off CUDA,
    torch's default implementation, so CPU runs keep their numbers."""
    cuda = any(p.device.type == "cuda" for p in model.parameters())
    return torch.optim.AdamW(decay_param_groups(model, weight_decay, scope=scope), lr=lr, betas=betas, fused=cuda or None)


def context_limit(model: PreTrainedModel) -> int | None:
    """The longest context the model accepts: block_size for a learned-position GPT, else None (any length)."""
    config = model.config
    if getattr(config, "model_type", None) == "owai_gpt" and config.position == "learned":
        return int(config.block_size)
    return None


def check_vocab(model: PreTrainedModel, tokenizer_vocab_size: int) -> None:
    """OwaiError unless every token id of the tokenizer has a row in the model's embedding."""
    rows = model.get_input_embeddings().weight.shape[0]
    if tokenizer_vocab_size > rows:
        raise OwaiError(
            f"the tokenizer has {tokenizer_vocab_size} tokens but the model's embedding has only {rows} rows "
            f"(set vocab_size >= {tokenizer_vocab_size})"
        )


WEIGHTS = "model.safetensors"  # save_pretrained's weights: one file, or shards named by the index
WEIGHTS_INDEX = "model.safetensors.index.json"
LEGACY_WEIGHTS = "pytorch_model.bin"  # older Hugging Face directories (read with weights_only)


def check_saved_weights(directory) -> None:
    """Before a run loads it: a save_pretrained directory holds its weights, and each .safetensors
    file's header reads and covers the file (cheap at any size). A missing, truncated or corrupt file
    is one OwaiError naming it."""
    import json
    from pathlib import Path

    from owai.io import check_safetensors

    directory = Path(directory)
    index = directory / WEIGHTS_INDEX
    if (directory / WEIGHTS).is_file():
        files = [directory / WEIGHTS]
    elif index.is_file():
        try:
            files = [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise OwaiError(f"{index} is not a weights index (unreadable, or no weight_map)") from None
    elif (directory / LEGACY_WEIGHTS).is_file():
        return
    else:
        raise OwaiError(f"{directory} holds no weights ({WEIGHTS}, {WEIGHTS_INDEX} or {LEGACY_WEIGHTS})")
    for path in files:
        check_safetensors(path)


def load_pretrained(path) -> PreTrainedModel:
    """A saved model directory (save_pretrained) back as its owai class, through the Auto classes;
    its weights are checked first (`check_saved_weights`), so a bad file is one line naming it.

    Every owai load of a transformers model passes `use_kernels=False`: transformers 5.25 turned
    hub kernels on by default in `from_pretrained`, which on CUDA swaps layers (the Llama
    baseline's RMSNorm and rotary embedding) for kernels downloaded from the hub at load time.
    A model then evaluates with the code it trained with, and nothing but weights is fetched
    (docs/decisions.md, "transformers 5.25's hub kernels")."""
    from transformers import AutoModelForCausalLM

    check_saved_weights(path)
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), use_kernels=False)
    except (OSError, ValueError, KeyError, RuntimeError) as err:  # RuntimeError: weights that do not fit config.json
        raise OwaiError(f"cannot load the model in {path}: {one_line(err)}") from None


def blocks(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The repeated blocks (the model's `_no_split_modules` classes): FSDP shards each one."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]
