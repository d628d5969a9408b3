"""What a language-model training run costs before it starts: parameters, FLOPs per token, and the
memory each rank needs (Table 4.2's columns, and `owai mosaic-train --dry-run`'s plan).

Everything is computed from a model built on the meta device (no weights allocated), so the plan
of a 9.9B-parameter model prints on a laptop.

FLOPs per token (forward) = 2 x (parameters that multiply: all but the input embedding's lookup)
+ 4 x layers x d x (mean number of (key, value) pairs a query reads at that context length), the
convention whose numbers match Table 4.2 (16.7B / 18.9B / 15.6B at context 256). Training costs 3x.

Memory per rank (bytes), an estimate for planning, not a measurement (strategy "single": one
process; "ddp" / "fsdp" over the world size):
    parameters   fp32 master weights (4 bytes each), / world size under FSDP
    gradients    fp32, / world size under FSDP (DDP keeps them whole)
    optimizer    AdamW's two fp32 moments, / world size under FSDP
    activations  per micro-batch token and layer: the block input only with activation
                 checkpointing (+ one block's worth, recomputed), else the block's intermediates
                 (counted per architecture below); plus the fp32 logits and their gradient.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

GIB = 2**30

# bf16 values kept per token by one block's backward, in units of d (hidden) and f (FFN hidden):
# norm input and outputs, projections' inputs and outputs, the SwiGLU intermediates. Memory Mosaics
# v2 also keeps two fp32 key/value sets per memory and the key scan's chunk weights (H x chunk fp32).
_TRANSFORMER_D, _FFN_F = 10, 5
_MMV2_D_PER_MEMORY = 12


@dataclass
class ModelShape:
    """The sizes a plan needs, read from any owai / Llama config."""

    arch: str
    n_layer: int
    d: int
    n_head: int
    ffn: int
    vocab: int

    @classmethod
    def of(cls, config) -> "ModelShape":
        get = lambda *names: next(getattr(config, n) for n in names if getattr(config, n, None) is not None)  # noqa: E731
        kind = getattr(config, "model_type", "")
        ffn = getattr(config, "ffn_hidden", None) or getattr(config, "intermediate_size", None) or 4 * get("n_embd", "hidden_size")
        return cls(kind, get("n_layer", "num_hidden_layers"), get("n_embd", "hidden_size"), get("n_head", "num_attention_heads"),
                   ffn, get("vocab_size"))


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def readable(n: float, digits: int = 1) -> str:
    """A count at any scale in words a plan can print: 6.0M, 18.9B, 1.0T (never "0.0B")."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f}{unit}"
    return f"{n:.0f}"


def readable_pairs(config, context: int) -> float:
    """Mean number of (key, value) pairs a query reads per layer (summed over a block's memories)."""
    t = torch.arange(context, dtype=torch.float64)
    if getattr(config, "model_type", "") == "owai_memory_mosaics_v2":
        n = t.clamp(max=config.short_span)  # short-term: min(t, span)
        if config.long_term_memory:
            n = n + (t - config.long_lag(config.long_delay_eval) + 1).clamp(min=0)
        return float(n.mean())
    if getattr(config, "model_type", "") == "owai_memory_mosaics":
        return float(t.mean())  # keys j <= t-1
    return float((t + 1).mean())  # causal attention: keys j <= t


def multiplying_parameters(model: torch.nn.Module) -> int:
    """The parameters that multiply a token's activations: all but the input embedding's lookup (the
    embedding does multiply where the head is tied to it)."""
    multiplying = count_parameters(model)
    if not getattr(model.config, "tie_word_embeddings", False):
        multiplying -= model.get_input_embeddings().weight.numel()
    return multiplying


def forward_flops_per_token(model: torch.nn.Module, context: int) -> float:
    """Forward FLOPs per token at `context` (module docstring)."""
    shape = ModelShape.of(model.config)
    return 2.0 * multiplying_parameters(model) + 4.0 * shape.n_layer * shape.d * readable_pairs(model.config, context)


@dataclass
class MemoryPlan:
    arch: str
    parameters: int
    world_size: int
    strategy: str
    micro_batch: int
    seq_len: int
    activation_checkpointing: bool
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    capacity_bytes: float | None = None
    capacity_name: str = ""
    model: Any = None  # the meta-device model planned (for FLOPs and its config)

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activation_bytes

    @property
    def strategy_text(self) -> str:
        """How the run holds the model: one process, or DDP / FSDP over its ranks."""
        if self.strategy == "single":
            return "1 process"
        return f"{self.strategy} over {self.world_size} ranks"

    @property
    def fits(self) -> bool:
        return self.capacity_bytes is None or self.total_bytes <= 0.9 * self.capacity_bytes

    def lines(self) -> list[str]:
        """The plan as printable lines."""
        g = lambda b: f"{b / GIB:,.1f} GiB" if abs(b) >= GIB / 10 else f"{b / 2**20:,.1f} MiB"  # noqa: E731
        out = [
            f"{self.arch}: {readable(self.parameters, 2)} parameters ({self.parameters:,}), {self.strategy_text}, "
            f"micro-batch {self.micro_batch} x {self.seq_len} tokens, activation checkpointing "
            f"{'on' if self.activation_checkpointing else 'off'}",
            f"  per rank: parameters {g(self.params_bytes)}, gradients {g(self.grads_bytes)}, "
            f"optimizer {g(self.optimizer_bytes)}, activations {g(self.activation_bytes)}",
            f"  total per rank: {g(self.total_bytes)}"
            + (f" of {g(self.capacity_bytes)} ({self.capacity_name})" if self.capacity_bytes else ""),
        ]
        return out


def memory_plan(model: torch.nn.Module, world_size: int, strategy: str, micro_batch: int, seq_len: int,
                activation_checkpointing: bool, capacity: tuple[float, str] | None = None) -> MemoryPlan:
    """The per-rank memory of training `model` (built on the meta device) this way (module docstring)."""
    shape = ModelShape.of(model.config)
    n = count_parameters(model)
    shard = world_size if strategy == "fsdp" else 1
    tokens = micro_batch * seq_len
    if shape.arch == "owai_memory_mosaics_v2":
        memories = 2 if getattr(model.config, "long_term_memory", True) else 1
        chunk = getattr(model.config, "scan_chunk", 64)
        per_layer = 2 * (memories * _MMV2_D_PER_MEMORY * shape.d + 4 * shape.d + _FFN_F * shape.ffn) \
            + memories * 4 * shape.n_head * chunk
    else:
        per_layer = 2 * (_TRANSFORMER_D * shape.d + _FFN_F * shape.ffn)
    if activation_checkpointing:
        block_inputs = 2 * shape.d * shape.n_layer
        activations = tokens * (block_inputs + per_layer)
    else:
        activations = tokens * per_layer * shape.n_layer
    activations += tokens * shape.vocab * 4 * 2  # fp32 logits and their gradient
    return MemoryPlan(shape.arch, n, world_size, strategy, micro_batch, seq_len, activation_checkpointing,
                      params_bytes=4.0 * n / shard, grads_bytes=4.0 * n / shard, optimizer_bytes=8.0 * n / shard,
                      activation_bytes=float(activations),
                      capacity_bytes=capacity[0] if capacity else None, capacity_name=capacity[1] if capacity else "")


def device_capacity(device: torch.device) -> tuple[float, str]:
    """(bytes, description) of the memory one rank has here: the GPU's, else the machine's RAM."""
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        return float(props.total_memory), f"{props.name}"
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        ram = 0
    return float(ram), "CPU RAM"


def ranks_needed(plan: MemoryPlan, per_rank_bytes: float) -> int | None:
    """The fewest FSDP ranks with `per_rank_bytes` each that hold the plan's model (None: none do,
    because activations alone exceed one rank)."""
    sharded = plan.params_bytes + plan.grads_bytes + plan.optimizer_bytes
    sharded *= plan.world_size if plan.strategy == "fsdp" else 1
    room = 0.9 * per_rank_bytes - plan.activation_bytes
    if room <= 0:
        return None
    return max(1, math.ceil(sharded / room))
