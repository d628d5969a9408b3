"""owai's loads of transformers models never turn on hub kernels.

transformers 5.25 made `use_kernels` default to on in `from_pretrained`: on CUDA it swaps the Llama
baseline's RMSNorm and rotary embedding (and other decorated layers) for kernels downloaded from the
hub at load time, and without the `kernels` package the load fails. Each of owai's three loading
paths (a saved run, a hub id for the evaluations, a Hugging Face image backbone) passes
`use_kernels=False`, so a model evaluates with the code it trained with on every transformers from
5.4 on (docs/decisions.md, "transformers 5.25's hub kernels"). A spy on
`PreTrainedModel.from_pretrained` records what each path asked for.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from owai.models.lm import build_lm, load_pretrained

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The `use_kernels` of every from_pretrained call ("unset" where a caller left the default)."""
    calls: list[object] = []
    original = PreTrainedModel.from_pretrained.__func__  # type: ignore[attr-defined]

    def spy(cls, *args, **kwargs):
        calls.append(kwargs.get("use_kernels", "unset"))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(spy))
    return calls


def saved_transformer(root: Path) -> Path:
    """A tiny Llama baseline (the model whose layers transformers 5.25 would kernelize) on disk."""
    torch.manual_seed(0)
    model = build_lm("transformer", n_layer=1, n_embd=32, n_head=2, ffn_hidden=64, vocab_size=97)
    model.save_pretrained(root / "model")
    return root / "model"


def test_a_saved_run_loads_without_hub_kernels(tmp_path: Path, asked: list[object]) -> None:
    model = load_pretrained(saved_transformer(tmp_path))
    assert asked == [False]
    assert not getattr(model, "use_kernels", False)


def test_a_hub_id_for_the_evaluations_loads_without_hub_kernels(tmp_path: Path, asked: list[object]) -> None:
    from transformers import PreTrainedTokenizerFast

    from owai.data import text
    from owai.evals.causal_lm import _from_hub

    backend = text.train_bpe(["a small corpus of words for a tokenizer"] * 20, 97)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(tmp_path / "tok")
    # a local directory stands in for the hub id: the same from_pretrained call, no network
    loaded = _from_hub(str(saved_transformer(tmp_path)), str(tmp_path / "tok"), torch.device("cpu"), "auto")
    assert asked == [False]
    assert not getattr(loaded.model, "use_kernels", False)


def test_an_image_backbone_loads_without_hub_kernels(tmp_path: Path, asked: list[object]) -> None:
    from transformers import RegNetConfig, RegNetModel

    from owai.models.hf_vision import HFImageBackbone

    torch.manual_seed(0)
    RegNetModel(RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8,
                             layer_type="y")).save_pretrained(tmp_path / "regnet")
    HFImageBackbone(str(tmp_path / "regnet"))
    assert asked == [False]
