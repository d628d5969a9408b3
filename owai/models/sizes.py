"""The model sizes of thesis chapter 4 (Table 4.2), shared by Memory Mosaics v2 and its Llama baseline.

Both architectures read the same {n_layer, n_embd, n_head, ffn_hidden, vocab_size} entry, so "the
same size" means the same blocks and the same persistent memory (the SwiGLU FFN). "tiny" is the
CPU size of the cpu presets; its vocabulary is the tokenizer's (None: the caller passes it).
"""

from __future__ import annotations

from owai.errors import OwaiError

LLAMA3_VOCAB = 128256

SIZES: dict[str, dict[str, int | None]] = {
    "tiny": {"n_layer": 4, "n_embd": 256, "n_head": 4, "ffn_hidden": 768, "vocab_size": None},
    "small": {"n_layer": 24, "n_embd": 2048, "n_head": 16, "ffn_hidden": 6144, "vocab_size": LLAMA3_VOCAB},
    "large": {"n_layer": 32, "n_embd": 4096, "n_head": 32, "ffn_hidden": 14336, "vocab_size": LLAMA3_VOCAB},
}


def size_settings(size: str, vocab_size: int | None = None) -> dict[str, int]:
    """The settings of `size`; `vocab_size` (required for "tiny") replaces the table's."""
    if size not in SIZES:
        raise OwaiError(f"unknown model size {size!r}; known: {', '.join(SIZES)}")
    settings = dict(SIZES[size])
    if vocab_size is not None:
        settings["vocab_size"] = vocab_size
    if settings["vocab_size"] is None:
        raise OwaiError(f"model size {size!r} takes the tokenizer's vocabulary: pass vocab_size")
    return settings  # type: ignore[return-value]
