"""owai beside the official code, run side by side on the same weights and data.

- Memory Mosaics v1: the Library's `StackAssoMem` (regular, and eft with its CUDA kernel as the
  formula it computes) and nanoMosaics' `MemoryMosaic` (facebookresearch/MemoryMosaics), loaded with
  one random official-format state dict, against owai's model built from it by
  `convert_official_state_dict`: logits in float64, and gradients but for eft's. Also the
  RegBench plug-in (ICLL/) against the model `owai eval regbench` builds for `mm`.
- The transformer baselines: the Library's baselines.py GPT (the thesis's BabiStories baseline),
  nanoMosaics' gpt_model.py and seq_icl's RegBench transformer (`lm_simple`) against owai's GPT,
  logits and gradients in float64; the RegBench transformer's dropouts against seq_icl's yaml.
- The invariance trainers: RFC's ColoredMNIST trainers (TjuJianyu/RFC, `coloredmnist/train.py`) from
  owai's initial weights on owai's ColoredMNIST environments, against `owai bonsai`'s whole training
  run (`execute`), 30 full-batch Adam steps across the anneal step, in float64: the final weights. PI.py
  (a script: its three stages written out with the clone's own pieces) against `owai bonsai`'s PI run,
  and RFC's Bonsai (its trainers, the scripts' glue written out) against `owai bonsai --init bonsai`.
  RFC's ColoredMNIST construction against owai's `rng="rfc"` (MNIST's training file from $OWAI_DATA).
  RFC's Camelyon17 objectives (ERM, IRM, vREx; GroupDRO of the discovery rounds) against owai's.
- Three Moons (MemoryMosaics/ThreeMoons, MLX): the reference's data against owai's; its
  `ContextMemory` against owai's `MoonMemory` (outputs and gradients); its training loop from owai's
  initial weights on owai's batches against `owai moons`'s whole run; and its two generation routines
  against owai's two error curves, on owai's trained weights. Float64, as far as MLX's float64 goes.
- RegBench (berlino/seq_icl): its data module against `make_regbench`, token for token; and its
  logged `dfa_accuracy`, `model_dfa_diff` and 3-gram numbers, computed by its own code on owai's
  automata, against owai's RegBench metrics.
- The weight-decay groups and learning-rate schedules of nanoMosaics and the Library, and the Library's
  training windows, against owai's; the Library's and nanoMosaics' training loops (model, optimizer,
  schedule, clipping, accumulation) from one random state dict on owai's batches, against `owai
  mosaic-train`'s whole run.

The reference code is not part of owai and is never copied into it: set $OWAI_REFERENCE_CODE to a
folder holding the clones `MemoryMosaics/`, `RFC/` and `seq_icl/`; without them these tests skip, and
the Three Moons and RegBench ones also skip without MLX or pythomata (`pip install 'mlx[cpu]'
pythomata`), RFC's Fishr without BackPACK, its Camelyon17 objectives without WILDS and seq_icl's
transformer without einops (`pip install --no-deps backpack-for-pytorch einops unfoldNd wilds`). The
reference modules are imported from there for the test only, and removed from `sys.modules` afterwards.
"""

from __future__ import annotations

import ast
import contextlib
import gzip
import importlib
import importlib.util
import math
import os
import pickle
import sys
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import owai.methods.coloredmnist as owai_cmnist
import owai.methods.three_moons as owai_moons
from owai.checkpoint import latest_checkpoint, load_checkpoint
from owai.data.moons import lcm_periods, sample_sequences, time_step
from owai.data.regbench import RegBenchConfig as RegBenchDataConfig
from owai.data.regbench import make_regbench, minimize
from owai.data.tokens import TokenWindows
from owai.evals.regbench import exact_distributions, ngram_backoff_probs, regbench_metrics
from owai.experiment import execute, resolve
from owai.methods.bonsai import fresh_mlp
from owai.methods.regbench import Config as RegBenchConfig
from owai.methods.regbench import build_model as build_regbench_model
from owai.methods.regbench import max_input_length as regbench_max_input_length
from owai.methods.regbench import zoo_settings as regbench_zoo_settings
from owai.models.lm import decay_param_groups
from owai.models.memory_mosaics import MemoryMosaicsForCausalLM
from owai.models.memory_mosaics_convert import convert_official_state_dict
from owai.models.moon_memory import MoonMemory, MoonMemoryConfig, clipped_mse
from owai.optim import warmup_cosine_schedule
from owai.recipes import load
from owai.runtime import generator
from naive_memory_mosaics import random_official_state_dict
from test_moon_memory import moons

CLONES = {
    "MemoryMosaics": "git clone https://github.com/facebookresearch/MemoryMosaics (tested at 1fff63b)",
    "RFC": "git clone https://github.com/TjuJianyu/RFC (tested at de4a5a4)",
    "seq_icl": "git clone https://github.com/berlino/seq_icl (tested at 9b9223d)",
}


def clone(name: str) -> Path:
    """The reference clone `name` under $OWAI_REFERENCE_CODE, or skip with how to get it."""
    root = os.environ.get("OWAI_REFERENCE_CODE", "")
    path = Path(root) / name
    if not root or not path.is_dir():
        pytest.skip(f"needs the official code at $OWAI_REFERENCE_CODE/{name}: {CLONES[name]}")
    return path.resolve()


@contextlib.contextmanager
def imported_from(folder: Path, *names: str, stubs: tuple[str, ...] = ()) -> Iterator[list[types.ModuleType]]:
    """Import `names` from `folder`, with `stubs` (modules the reference imports at its top but the
    compared code never calls: torchvision, BackPACK) as empty stand-ins. Afterwards sys.path is as it
    was, and the clone's own modules and the stand-ins are gone from sys.modules (the torch modules
    they pulled in stay), so no reference module stays importable after the test."""

    class Stub(types.ModuleType):
        def __getattr__(self, attr: str) -> types.ModuleType:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Stub(attr)

    replaced = {name: sys.modules[name] for name in stubs if name in sys.modules}
    sys.path.insert(0, str(folder))
    try:
        for stub in stubs:
            sys.modules[stub] = Stub(stub)
        yield [importlib.import_module(n) for n in names]
    finally:
        sys.path.remove(str(folder))

        def from_clone(module: types.ModuleType) -> bool:  # its file, or a namespace package's folders
            places = [getattr(module, "__file__", None) or "/"]
            try:
                places += [p for p in getattr(module, "__path__", None) or () if isinstance(p, str)]
            except TypeError:  # torch.classes has a __path__ that cannot be iterated
                pass
            return any(Path(p).resolve().is_relative_to(folder) for p in places)

        # the clone's modules only (torch's lazy imports stay), all found before any goes: a namespace
        # package's __path__ is recomputed from its parent's entry
        for key in [k for k, m in list(sys.modules.items()) if k in stubs or from_clone(m)]:
            del sys.modules[key]
        sys.modules.update(replaced)


def test_reference_modules_do_not_stay_imported():
    folder = clone("MemoryMosaics") / "nanoMosaics"
    before = sys.modules.get("torchvision")
    with imported_from(folder, "mosaic_model", stubs=("torchvision",)) as (nano,):
        assert sys.modules["mosaic_model"] is nano and sys.modules["torchvision"] is not before
    assert "mosaic_model" not in sys.modules and sys.modules.get("torchvision") is before
    with imported_from(clone("MemoryMosaics") / "ICLL", "src.models.sequence") as (package,):
        assert not getattr(package, "__file__", None)  # a namespace package: known by its folders only
    assert not any(name == "src" or name.startswith("src.") for name in sys.modules)
    assert "torch.nn.functional" in sys.modules  # what the clone's import pulled in from torch stays


def _weights_gap(trained: dict[str, torch.Tensor], initial: dict[str, torch.Tensor],
                 theirs: dict[str, torch.Tensor]) -> tuple[str, float, float]:
    """After two runs from the same `initial` weights: the key where owai's `trained` and the
    reference's `theirs` differ most, that difference, and the least any compared tensor moved (a
    tensor that never moves would make the comparison vacuous)."""
    errors = {key: float((trained[key] - w).abs().max()) for key, w in theirs.items()}
    least_moved = min(float((trained[key] - initial[key]).abs().max()) for key in theirs)
    worst = max(errors, key=errors.get)
    return worst, errors[worst], least_moved


def _assert_same_weights(label: str, trained: dict[str, torch.Tensor], initial: dict[str, torch.Tensor],
                         theirs: dict[str, torch.Tensor], *, moved: float, bound: float = 1e-9,
                         moving: typing.Container[str] | None = None) -> None:
    """Print the parity line of two runs from `initial` and assert that owai's `trained` is within
    `bound` of the reference's `theirs`, every tensor (or every key in `moving`) having moved by more
    than `moved`."""
    worst, err, least_moved = _weights_gap(trained, initial, theirs)
    if moving is not None:
        least_moved = _weights_gap(trained, initial, {k: v for k, v in theirs.items() if k in moving})[2]
    print(f"parity {label}: max |weight diff| {err:.1e} ({worst}); each tensor moved >= {least_moved:.1e}")
    assert least_moved > moved, label
    assert err <= bound, f"{label}: owai and the reference differ by {err:.2e} in {worst}"


# ------------------------------------------------------------------ Memory Mosaics v1

V, C, H, LAYERS, P, T = 61, 32, 4, 2, 24, 256  # T: the reference models' block size (they go no further)
IDS, TARGETS = (torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(seed)) for seed in (0, 1))


def _owai_model(sd: dict[str, torch.Tensor], source: str, **overrides) -> MemoryMosaicsForCausalLM:
    cfg, osd = convert_official_state_dict(sd, source, leaky_chunk=16, **overrides)
    model = MemoryMosaicsForCausalLM(cfg)
    model.load_state_dict(osd, strict=True)
    return model.double().eval()


def _same_gradients(owai_model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Every owai parameter is some reference parameter (same values, reshaped): their gradients
    must agree."""
    ref = dict(reference.named_parameters())
    for name, p in owai_model.named_parameters():
        twin = next((r for r in ref.values() if r.numel() == p.numel()
                     and torch.equal(r.detach().reshape(p.shape), p.detach())), None)
        assert twin is not None, f"{name}: no reference parameter holds its values"
        scale = float(p.grad.abs().max())
        assert scale > 0, name
        err = float((twin.grad.reshape(p.shape) - p.grad).abs().max())
        assert err <= 1e-9 * scale, f"{name}: gradient differs by {err:.2e} (scale {scale:.2e})"


def _agree(case: str, want: torch.Tensor, model: torch.nn.Module, reference: torch.nn.Module,
           sharp_bound: float | None = None, ids: torch.Tensor = IDS, targets: torch.Tensor = TARGETS) -> None:
    """owai's logits on `ids` equal the reference's `want` to 1e-10, and so do the gradients of a
    cross-entropy loss on `targets`; with a head past the clamp (`sharp_bound`), the logits to that
    bound only."""
    got = model(ids).logits
    assert got.shape == want.shape == (*ids.shape, model.config.vocab_size)
    err = float((want - got).detach().abs().max())
    print(f"parity {case}: max |logit diff| {err:.1e} (logits up to {float(want.detach().abs().max()):.2f})")
    assert err <= (sharp_bound or 1e-10), err
    if sharp_bound is None:
        F.cross_entropy(want.flatten(0, 1), targets.flatten()).backward()
        F.cross_entropy(got.flatten(0, 1), targets.flatten()).backward()
        _same_gradients(model, reference)


# sharp=True puts head 0's bandwidth exponent past the Library's clamp (5): scores of e^10 x a cosine,
# where the reference's own float64 rounding reaches ~1e-7 (docs/decisions.md, the converter).
@pytest.mark.parametrize("bias, pre_ln, attn_only, sharp", [
    (False, True, False, False), (True, True, False, False), (False, False, False, False),
    (True, False, True, False), (False, True, False, True),
])
def test_library_model_equals_owai(bias, pre_ln, attn_only, sharp):
    with imported_from(clone("MemoryMosaics") / "Library", "memory_mosaics.models.memory_mosaics") as (library,):
        sd = random_official_state_dict("library", V=V, C=C, H=H, L=LAYERS, P=P, bias=bias, attn_only=attn_only,
                                        sharp=sharp)
        reference = library.StackAssoMem(V, n_head=H, n_embd=C, n_layer=LAYERS, block_size=T, ic_dropout=0.0,
                                         hd_dropout=0.0, bias=bias, pmem_size=P, pre_ln=pre_ln, attn_only=attn_only,
                                         config=SimpleNamespace(skip_tokens=0))
    reference.load_state_dict(sd, strict=True)
    reference = reference.double().eval()
    model = _owai_model(sd, "library", norm_eps=0.0, pre_ln=pre_ln)  # the Library's unit norms have no epsilon
    want = reference(IDS, logits_only=True)
    _agree(f"library bias={bias} pre_ln={pre_ln} attn_only={attn_only} sharp={sharp}", want, model, reference,
           sharp_bound=1e-6 if sharp else None)


@pytest.mark.parametrize("bias, sharp", [(False, False), (True, False), (False, True)])
def test_nanomosaics_model_equals_owai(bias, sharp):
    with imported_from(clone("MemoryMosaics") / "nanoMosaics", "mosaic_model") as (nano,):
        sd = random_official_state_dict("nano", V=V, C=C, H=H, L=LAYERS, P=P, bias=bias, sharp=sharp)
        reference = nano.MemoryMosaic(nano.MemoryMosaicConfig(block_size=T, vocab_size=V, n_layer=LAYERS, n_head=H,
                                                              n_embd=C, pmem_size=P, bias=bias))
    # the masks and leaky-average tables are buffers sized by block_size: the reference builds its own
    weights = {k: v for k, v in sd.items() if "v_featurizer" in k or not k.endswith((".coef", ".attn.bias"))}
    result = reference.load_state_dict(weights, strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith((".coef", ".attn.bias")) for k in result.missing_keys), result.missing_keys
    reference = reference.double().eval()
    model = _owai_model(sd, "nano")
    want, _ = reference(IDS, targets=TARGETS)  # with targets it returns every position's logits
    _agree(f"nanoMosaics bias={bias} sharp={sharp}", want, model, reference, sharp_bound=1e-8 if sharp else None)


def wkv_forward(B: int, T: int, C: int, w: torch.Tensor, u: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
    """The eft model's CUDA kernel (Library/memory_mosaics/models/cuda/wkv_cuda.cu, `kernel_forward`,
    RWKV-v4's) as the formula it computes, after `WKV.forward`'s w = -|w|, u = |u|:
    y_t = (sum_{i<t} e^{(t-1-i) w + k_i} v_i + e^{u + k_t} v_t) / (the same sums without v),
    per batch row and channel, as a softmax over i. Its backward is autograd's; the kernel's own
    backward scales the rate's gradient (docs/decisions.md), so only forwards are compared."""
    w, u = -w.abs(), u.abs()
    t = torch.arange(T)
    lag = (t[:, None] - 1 - t[None, :]).to(v.dtype)  # (T query, T past): t - 1 - i
    past = (t[None, :] < t[:, None])[None, :, :, None]  # (1, T, T, 1)
    now = (t[None, :] == t[:, None])[None, :, :, None]
    score = torch.where(past, lag[None, :, :, None] * w + k[:, None], torch.where(now, u + k[:, None], -math.inf))
    return torch.einsum("btic,bic->btc", torch.softmax(score, dim=2), v)  # (B, T, C)


@pytest.mark.parametrize("bias, pre_ln, attn_only", [(False, True, False), (True, False, False), (True, True, True)])
def test_library_eft_model_equals_owai(bias, pre_ln, attn_only, monkeypatch):
    """The Library's eft model (memory_mosaics_eft.py, which train_memory_mosaics.py imports by
    default) against owai's, through the converter's eft path: logits in float64. Its leaky average
    is a CUDA kernel built with nvcc at construction, so the kernel is replaced by the formula it
    computes (`wkv_forward`) and the build is skipped; everything around it is the clone's: the
    Linear inside the leaky average, the shared w = u rate, the low-rank value featurizer, the
    squared bandwidth of the persistent memory. The clone's module reads `x.dtype` as one of the
    kernel's float modes, so float64 is given its fp32 mode (the kernel's float path)."""
    with imported_from(clone("MemoryMosaics") / "Library", "memory_mosaics.models.memory_mosaics_eft",
                       "memory_mosaics.models.feature_extractor") as (eft, extractor):
        on_cpu = {"zeros": lambda *size, device=None, **kw: torch.zeros(*size, **kw), "float32": torch.float64}
        monkeypatch.setattr(extractor, "torch", SimpleNamespace(**{**vars(torch), **on_cpu}))
        monkeypatch.setattr(extractor, "subprocess", SimpleNamespace(
            PIPE=None, run=lambda *a, **kw: SimpleNamespace(stdout=b"version 0\n\nrelease 0\n\n")))
        monkeypatch.setattr(extractor, "wkv_cuda", "built")  # skip torch.utils.cpp_extension.load
        monkeypatch.setattr(extractor, "RUN_CUDA", wkv_forward)
        sd = random_official_state_dict("library", variant="eft", V=V, C=C, H=H, L=LAYERS, P=P, bias=bias,
                                        attn_only=attn_only, sharp=False)
        reference = eft.StackAssoMem(V, n_head=H, n_embd=C, n_layer=LAYERS, block_size=T, ic_dropout=0.0,
                                     hd_dropout=0.0, bias=bias, pmem_size=P, pre_ln=pre_ln, attn_only=attn_only,
                                     config=SimpleNamespace(skip_tokens=0))
        reference.load_state_dict(sd, strict=True)
        reference = reference.double().eval()
        want = reference(IDS, logits_only=True)
    model = _owai_model(sd, "library", norm_eps=0.0, pre_ln=pre_ln)
    got = model(IDS).logits
    err = float((want - got).detach().abs().max())
    print(f"parity library eft bias={bias} pre_ln={pre_ln} attn_only={attn_only}: max |logit diff| {err:.1e} "
          f"(logits up to {float(want.detach().abs().max()):.2f})")
    assert want.shape == got.shape == (3, T, V) and err <= 1e-10, err


@pytest.mark.parametrize("source", ["nano", "library"])
@pytest.mark.parametrize("bias", [False, True])
def test_reference_weight_decay_groups_equal_owai(source, bias, capsys):
    """The references' `configure_optimizers` against owai's `decay_param_groups`, on one converted model.
    nanoMosaics decays every tensor but those with < 2 dims or a trailing (1, 1); the Library (the
    thesis's training code) every tensor but those with < 2 dims or "time_" or "gate" in the name;
    owai what has >= 2 dims on its own shapes. All must pick the same weights: each owai parameter's
    reference twins (same values) sit in its group."""
    folder = clone("MemoryMosaics") / ("nanoMosaics" if source == "nano" else "Library")
    module = "mosaic_model" if source == "nano" else "memory_mosaics.models.memory_mosaics"
    with imported_from(folder, module) as (code,):
        sd = random_official_state_dict(source, V=V, C=C, H=H, L=LAYERS, P=P, bias=bias)
        if source == "nano":
            reference = code.MemoryMosaic(code.MemoryMosaicConfig(block_size=T, vocab_size=V, n_layer=LAYERS, n_head=H,
                                                                  n_embd=C, pmem_size=P, bias=bias))
            reference.load_state_dict({k: v for k, v in sd.items() if "v_featurizer" in k
                                       or not k.endswith((".coef", ".attn.bias"))}, strict=False)
        else:
            reference = code.StackAssoMem(V, n_head=H, n_embd=C, n_layer=LAYERS, block_size=T, ic_dropout=0.0,
                                          hd_dropout=0.0, bias=bias, pmem_size=P, config=SimpleNamespace(skip_tokens=0))
            reference.load_state_dict(sd, strict=True)
        theirs = reference.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cpu").param_groups
    capsys.readouterr()  # its group counts, printed
    overrides = {} if source == "nano" else {"norm_eps": 0.0}
    ours = decay_param_groups(_owai_model(sd, source, **overrides), 0.1)
    assert [g["weight_decay"] for g in theirs] == [g["weight_decay"] for g in ours] == [0.1, 0.0]
    for decays, group in zip((True, False), ours):
        for p in group["params"]:
            twins = [i for i, g in enumerate(theirs) for r in g["params"]
                     if r.numel() == p.numel() and torch.equal(r.detach().double().reshape(p.shape), p.detach())]
            assert twins and set(twins) == {0 if decays else 1}, (tuple(p.shape), decays, twins)
    count = [sum(p.numel() for p in g["params"]) for g in theirs], [sum(p.numel() for p in g["params"]) for g in ours]
    assert count[0] == count[1], count


def reference_schedule(source: str, peak: float, warmup: int, decay_steps: int, floor: float) -> Callable[[int], float]:
    """The learning rate at update k of a Memory Mosaics training script: nanoMosaics' `get_lr`
    (train.py, which reads the script's globals) or the Library's `get_cosine_lr` (utils.py), run
    alone from its file."""
    if source == "nanoMosaics":
        return reference_definitions(clone("MemoryMosaics") / "nanoMosaics" / "train.py", ("get_lr",), {
            "math": math, "learning_rate": peak, "warmup_iters": warmup, "lr_decay_iters": decay_steps,
            "min_lr": floor})["get_lr"]
    ns = reference_definitions(clone("MemoryMosaics") / "Library" / "utils.py", ("get_cosine_lr",), {"math": math})
    return lambda k: ns["get_cosine_lr"](k, peak, floor, decay_steps, warmup)


@pytest.mark.parametrize("source", ["nanoMosaics", "Library"])
def test_reference_lr_schedule_equals_owai(source):
    """The references' cosine schedule against `warmup_cosine_schedule`, which `owai mosaic-train` calls
    with the update's 0-based index, as both training scripts call theirs with iter_num: warmup from 0,
    the cosine, and min_lr past the decay. nanoMosaics' `get_lr` lives in train.py, which trains at
    import, and the Library's `get_cosine_lr` in utils.py, which starts logging and distributed
    helpers: the function alone is run."""
    peak, warmup, decay_steps, floor = 6e-4, 20, 100, 6e-5
    theirs = reference_schedule(source, peak, warmup, decay_steps, floor)
    ours = warmup_cosine_schedule(peak, warmup, decay_steps, floor)
    lrs = [(theirs(k), ours(k)) for k in range(130)]
    assert lrs[0] == (0.0, 0.0) and lrs[20][0] == peak and lrs[129][0] == floor
    assert all(a == b for a, b in lrs)  # the same float operations in the same order


def test_library_stories_dataset_equals_owai_token_windows(tmp_path):
    """The Library's training windows (`StoriesDataset`: a uint16 memmap of train.bin, x = data[i:i+T],
    y = data[i+1:i+T+1], over len - T - 2 offsets) against owai's `TokenWindows` on the same file: as many
    offsets, and the same window at each offset owai's evaluation reads. For training both draw offsets
    uniformly with replacement (the Library's RandomSampler(replacement=True), owai's keyed
    torch.randint), through the same window code."""
    tokens = np.random.default_rng(0).integers(0, 50257, size=5000, dtype=np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    with imported_from(clone("MemoryMosaics") / "Library", "memory_mosaics.data.dataset") as (dataset,):
        theirs = dataset.StoriesDataset(str(tmp_path), block_size=T, split="train")
    ours = TokenWindows(tmp_path / "train.bin", np.uint16, T)
    assert len(theirs) == ours.n_offsets == 5000 - T - 2
    windows = list(ours.sequential())  # offsets 0, T, 2T, ...: the evaluation windows
    assert len(windows) == (5000 - 1) // T
    for k, (x, y) in enumerate(windows):
        want_x, want_y = theirs[k * T]
        assert torch.equal(x[0], want_x) and torch.equal(y[0], want_y), k


LM_STEPS = 20
LM_C, LM_H, LM_P, LM_T = 32, 2, 24, 32  # one-layer Memory Mosaics: width, heads, persistent memory, context


def official_lm_builder(source: str, build: Callable, official: dict[str, torch.Tensor],
                        inits: list[dict[str, torch.Tensor]]) -> Callable:
    """A stand-in for owai's `build_lm` that builds owai's model (with `source`'s matching config
    overrides) holding one random official state dict, which it puts in `official`, and its initial
    weights, which it appends to `inits`."""
    matching = LM_REFERENCES[source][4]

    def from_official(arch: str, **kwargs):
        model = build(arch, **kwargs, **matching)
        official.update(random_official_state_dict(source, V=kwargs["vocab_size"], C=LM_C, H=LM_H, L=1, P=LM_P,
                                                   sharp=False))
        model.load_state_dict(convert_official_state_dict(official, source, leaky_chunk=16)[1], strict=True)
        inits.append({k: v.clone() for k, v in model.state_dict().items()})
        return model

    return from_official


def lm_settings(source: str) -> list[str]:
    """`owai mosaic-train`'s settings of the training-loop parity run against `source`'s loop
    (tests/test_official_model_golden.py runs owai's side with the same)."""
    _, _, model_settings, accumulate, _, clip = LM_REFERENCES[source]
    return ["archs=[mm]", "data.source=owai-stories:1500", "data.tokenizer=bpe-512", f"data.block_size={LM_T}",
            "model.n_layer=1", f"model.n_embd={LM_C}", f"model.n_head={LM_H}", f"model.pmem_size={LM_P}",
            "model.dropout=0.0", *model_settings, f"train.steps={LM_STEPS}", "train.batch_size=8",
            f"train.accumulate={accumulate}", "train.lr=5e-3", "train.warmup=5", "train.min_lr=1e-4",
            f"train.grad_clip={clip}", "train.eval_every=1000", "train.eval_batches=1", "train.checkpoint_every=1000",
            "eval.posloss_windows=8", "eval.val_batches=1", "eval.attention_sequences=2", "eval.continuations=false"]


def float32_cross_entropy(logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Cross-entropy on float32 logits: owai's training loss, and the references' under autocast."""
    return F.cross_entropy(logits.float(), *args, **kwargs)


# source: (folder, module, owai model settings, micro-batches per update, owai's config overrides to match,
#          a gradient clip that binds on some updates and not on others)
LM_REFERENCES = {
    # the paper preset's Mosaic: the Library's init and logit scale; unit norms without epsilon
    "library": ("Library", "memory_mosaics.models.memory_mosaics", ["model.init=library", "model.logit_scale=inv_sqrt_dim"],
                1, {"norm_eps": 0.0}, 0.4),
    # the cpu preset's Mosaic: nanoMosaics' init, no logit scale, its key clamp; nanoGPT's accumulation
    "nano": ("nanoMosaics", "mosaic_model", ["model.init=nano", "model.logit_scale=none"], 2, {"key_clamp": "nano"},
             2.5),
}


@pytest.mark.parametrize("source", ["library", "nano"])
def test_reference_training_loop_equals_owai_mosaic_train(source, tmp_path, monkeypatch, default_float64):
    """`owai mosaic-train`'s whole run of a Memory Mosaic against a reference's training loop,
    written out because both scripts train at import: the Library's train_memory_mosaics.py (one
    micro-step) and nanoMosaics' train.py (nanoGPT's loop, here with 2 micro-steps of loss / 2).
    From one random official state dict, on owai's batches, in float64, with the reference's model,
    `configure_optimizers` and schedule (`get_cosine_lr`, `get_lr`), and its order of loss,
    backward, clipping, AdamW step and zero_grad. The final weights must agree. Clipping binds on
    some updates, so its place in the step is compared too. The Library's model is the
    regular one: the eft one's CUDA backward scales the leaky rate's gradient, which owai does not
    copy."""
    import owai.methods.language_model as owai_lm
    import owai.models.lm as owai_models

    folder, module, _, accumulate, _, clip = LM_REFERENCES[source]
    folder = clone("MemoryMosaics") / folder
    C, H, P, T_LM = LM_C, LM_H, LM_P, LM_T
    batches: list[tuple[torch.Tensor, torch.Tensor]] = []
    official: dict[str, torch.Tensor] = {}
    inits: list[dict[str, torch.Tensor]] = []
    draw = owai_lm.global_batch

    def recorded(*args, **kwargs):
        batches.append(draw(*args, **kwargs))
        return batches[-1]

    monkeypatch.setattr(owai_lm, "global_batch", recorded)
    monkeypatch.setattr(owai_models, "build_lm", official_lm_builder(source, owai_models.build_lm, official, inits))
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    settings = lm_settings(source)
    run, _ = execute("fig3.8-depth", "cpu", settings, out=tmp_path / "runs")
    cfg, _ = resolve(load("fig3.8-depth"), "cpu", settings)
    _, state = load_checkpoint(latest_checkpoint(run.path / "checkpoints" / "mm"))
    trained = state["model"]
    assert len(inits) == 1 and len(batches) == LM_STEPS * accumulate
    assert all(x.dtype == torch.int64 for x, _ in batches)

    t, V_LM = cfg.train, inits[0]["model.wte.weight"].shape[0]
    schedule = reference_schedule(folder.name, t.lr, t.warmup, t.steps, t.min_lr)
    with imported_from(folder, module) as (code,):
        if source == "library":
            reference = code.StackAssoMem(V_LM, n_head=H, n_embd=C, n_layer=1, block_size=T_LM, ic_dropout=0.0,
                                          hd_dropout=0.0, bias=False, pmem_size=P, pre_ln=True,
                                          config=SimpleNamespace(skip_tokens=0))
            reference.load_state_dict(official, strict=True)
        else:  # its masks and leaky-average tables are buffers sized by block_size: it builds its own
            reference = code.MemoryMosaic(code.MemoryMosaicConfig(block_size=T_LM, vocab_size=V_LM, n_layer=1, n_head=H,
                                                                  n_embd=C, pmem_size=P, bias=False))
            reference.load_state_dict({k: v for k, v in official.items() if "v_featurizer" in k
                                       or not k.endswith((".coef", ".attn.bias"))}, strict=False)
        # owai takes its loss on float32 logits, as the references' loss is under their autocast
        # (cross-entropy is on autocast's float32 list): the reference's loss too, so float64 compares the rest
        monkeypatch.setattr(code, "F", SimpleNamespace(**{**vars(F), "cross_entropy": float32_cross_entropy}))
    reference = reference.double().train()
    optimizer = reference.configure_optimizers(t.weight_decay, t.lr, tuple(t.betas), "cpu")
    norms, micro_batches = [], iter(batches)
    for iter_num in range(LM_STEPS):  # the scripts' loop, without autocast (their ctx on CPU)
        lr = schedule(iter_num)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for _ in range(accumulate):
            x, y = next(micro_batches)
            _, loss = reference(x, y)
            (loss / accumulate).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(f"parity {source} training loop: gradient norm above the clip {clip} on "
          f"{sum(n > clip for n in norms)} of {len(norms)} updates")
    assert min(norms) < clip < max(norms), norms  # clipping binds on some updates, not on all
    _, theirs = convert_official_state_dict({k: v.detach() for k, v in reference.state_dict().items()}, source,
                                            leaky_chunk=16)
    _assert_same_weights(f"{source} training loop vs owai mosaic-train", trained, inits[0], theirs, moved=1e-3,
                         bound=1e-10)


def test_regbench_plugin_equals_owai_regbench_mm(monkeypatch):
    """The Memory Mosaics RegBench plug-in (ICLL/src/models/sequence/mm.py, sized by
    configs/experiment/dfa/mm.yaml) against the model `owai eval regbench` builds for `mm` by default:
    one random Library state dict in both, logits in float64 at the data's longest input."""
    import yaml

    folder = clone("MemoryMosaics")
    sizes = yaml.safe_load((folder / "ICLL" / "configs" / "experiment" / "dfa" / "mm.yaml").read_text())
    half, plugin_model = sizes["n_halfembd"], sizes["model"]
    # the yaml's own expressions: n_embd = 2 n_halfembd, pmem_size = 7 n_halfembd (3.5 C)
    C, H, L, P = 2 * half, plugin_model["n_head"], plugin_model["n_layer"], 7 * half
    cfg = RegBenchConfig()
    settings = regbench_zoo_settings(cfg)
    assert (settings["n_embd"], settings["n_head"], settings["n_layer"]) == (C, H, L)
    assert settings["ic_dropout"] == plugin_model["ic_dropout"] and settings["hd_dropout"] == plugin_model["hd_dropout"]
    V = cfg.data.vocab_size
    sd = random_official_state_dict("library", V=V, C=C, H=H, L=L, P=P, bias=False, sharp=False)
    with imported_from(folder / "Library", "memory_mosaics.models.memory_mosaics") as (library,):
        # the plug-in moves itself to CUDA in its constructor; here it stays on the CPU
        to = library.StackAssoMem.to
        monkeypatch.setattr(library.StackAssoMem, "to",
                            lambda self, *a, **k: self if a[:1] == ("cuda",) else to(self, *a, **k))
        with imported_from(folder / "ICLL", "src.models.sequence.mm") as (plugin_module,):
            plugin = plugin_module.StackAssoMem(V, n_head=H, n_embd=C, n_layer=L, block_size=plugin_model["block_size"],
                                                pmem_size=P, ic_dropout=plugin_model["ic_dropout"],
                                                hd_dropout=plugin_model["hd_dropout"])
    plugin.load_state_dict(sd, strict=True)
    plugin = plugin.double().eval()
    _, weights = convert_official_state_dict(sd, "library", leaky_chunk=16)
    model = build_regbench_model(cfg, torch.device("cpu"))
    model.load_state_dict(weights, strict=True)  # the same shapes: pmem 3.5 C, the value kernel, tied embeddings
    model = model.double().eval()
    T = regbench_max_input_length(cfg.data)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))
    want, got = plugin(ids)[0].logits, model(ids).logits
    err = float((want - got).detach().abs().max())
    print(f"parity ICLL plug-in / owai regbench mm: {T} tokens, max |logit diff| {err:.1e} "
          f"(logits up to {float(want.detach().abs().max()):.2f})")
    # owai's unit norms add 1e-10 where the Library's add nothing (docs/decisions.md, the converter)
    assert err <= 1e-7


# ------------------------------------------------------------------ the transformer baselines


def _randomised(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """`model` in float64 with every weight redrawn: N(0, 1/sqrt(fan-in)) matrices, 1 + 0.1 N for
    LayerNorm gains, 0.1 N for biases and embeddings' rows, so that no term hides behind a zero
    init (the baselines' biases start at 0)."""
    g = torch.Generator().manual_seed(seed)
    model = model.double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            draw = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if p.dim() == 2:
                p.copy_(draw / math.sqrt(p.shape[1]))
            else:
                p.copy_(draw * 0.1 + (1.0 if "ln" in name or "norm" in name else 0.0))
    return model


def _same_on_regbench_inputs(label: str, cfg: RegBenchConfig, reference: torch.nn.Module,
                             model: torch.nn.Module) -> None:
    """A seq_icl model (its forward returns (output with .logits, ...)) and owai's RegBench model on 2
    random sequences of the data's longest input: the same logits and gradients."""
    T_R, V_R = regbench_max_input_length(cfg.data), model.config.vocab_size
    ids = torch.randint(0, V_R, (2, T_R), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, V_R, (2, T_R), generator=torch.Generator().manual_seed(1))
    want = reference(ids)[0].logits
    _agree(f"{label}, {T_R} tokens", want, model, reference, ids=ids, targets=targets)


@pytest.mark.parametrize("source, bias", [("Library", False), ("Library", True), ("nanoMosaics", False)])
def test_gpt_baseline_equals_owai_gpt(source, bias):
    """The thesis's BabiStories baseline (the Library's baseline/baselines.py, nanoGPT of early 2023
    with GELU's tanh approximation) against owai's GPT with its defaults, and nanoMosaics'
    gpt_model.py (today's nanoGPT, exact GELU) against owai's `activation="gelu"`. One randomised
    state dict, loaded with nanoGPT's names into both; logits and every gradient in float64."""
    from types import SimpleNamespace as Namespace

    from owai.models.gpt import GPTConfig, GPTForCausalLM

    folder = clone("MemoryMosaics") / source
    chosen = {} if source == "Library" else {"activation": "gelu"}  # the Library's baseline is owai's default
    model = _randomised(GPTForCausalLM(GPTConfig(vocab_size=V, n_layer=LAYERS, n_embd=C, n_head=H, block_size=T,
                                                 dropout=0.0, bias=bias, **chosen))).eval()
    activation = model.config.activation
    module = "baseline.baselines" if source == "Library" else "gpt_model"
    with imported_from(folder, module) as (code,):
        if source == "Library":
            reference = code.GPT(Namespace(vocab_size=V, block_size=T, n_layer=LAYERS, n_head=H, n_embd=C, dropout=0.0,
                                           bias=bias))
        else:
            reference = code.GPT(code.GPTConfig(vocab_size=V, block_size=T, n_layer=LAYERS, n_head=H, n_embd=C,
                                                dropout=0.0, bias=bias))
    reference = reference.double().eval()  # before loading: float32 parameters would round the weights
    reference.load_state_dict(model.state_dict(), strict=True)
    want, _ = reference(IDS, targets=TARGETS)  # with targets: every position's logits
    _agree(f"{source} GPT / owai gpt ({activation}, bias={bias})", want, model, reference)


def test_seq_icl_transformer_equals_owai_regbench_transformer():
    """seq_icl's RegBench transformer (`lm_simple`, src/models/sequence/simple_lm.py, configured by
    configs/experiment/dfa/transformer.yaml) against the model `owai eval regbench` builds for
    `transformer`: its dropouts against the yaml's, then one randomised state dict in both, logits
    and every gradient in float64 at the data's longest input. simple_lm.py imports torchvision and
    seq_icl's Hydra helpers at its top, so its definitions are run from the file
    (`reference_definitions`), with StochasticDepth (rate 0 here) as the identity."""
    import yaml
    from functools import partial
    from collections import namedtuple

    root = clone("seq_icl")
    rearrange = pytest.importorskip("einops", reason="seq_icl's simple_lm.py needs einops: pip install einops").rearrange
    spec = yaml.safe_load((root / "configs" / "experiment" / "dfa" / "transformer.yaml").read_text())["model"]
    assert spec["_name_"] == "lm_simple" and spec["layer"]["_name_"] == "transformer"
    assert spec["d_inner"] == "${eval:4 * ${.d_model}}"  # the FFN width owai's GPT has: 4 C
    cfg = RegBenchConfig(arch="transformer")
    cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd = 2, spec["attn_cfg"]["num_heads"], 32
    model = build_regbench_model(cfg, torch.device("cpu"))
    block = model.transformer.h[0]
    assert model.transformer.drop.p == spec["embed_dropout"] and block.attn.dropout == spec["attn_cfg"]["dropout"]
    assert block.attn.resid_dropout.p == block.mlp.dropout.p == spec["resid_dropout"]
    model = _randomised(model).eval()

    class StochasticDepth(torch.nn.Identity):  # torchvision's, at rate 0
        def __init__(self, p: float, mode: str) -> None:
            assert p == 0.0
            super().__init__()

    ns = {"math": math, "partial": partial, "namedtuple": namedtuple, "torch": torch, "nn": torch.nn, "F": F,
          "rearrange": rearrange, "StochasticDepth": StochasticDepth}
    names = ("LinearResidual", "SelfAttention", "MHA", "GPT2Embeddings", "Mlp", "Block", "create_mixer_cls",
             "create_mlp_cls", "create_block", "_init_weights", "LMBackbone", "SimpleLMHeadModel")
    ns = reference_definitions(root / "src" / "models" / "sequence" / "simple_lm.py", names, ns)
    C_R, L_R, V_R = model.config.n_embd, model.config.n_layer, model.config.vocab_size
    reference = ns["SimpleLMHeadModel"](
        d_model=C_R, n_layer=L_R, d_inner=4 * C_R, vocab_size=V_R, attn_layer_idx=list(range(L_R)),
        attn_cfg=dict(spec["attn_cfg"]), max_position_embeddings=model.config.block_size,
        resid_dropout=spec["resid_dropout"], embed_dropout=spec["embed_dropout"])
    names = {"transformer.wte.weight": "backbone.embeddings.word_embeddings.weight",
             "transformer.wpe.weight": "backbone.embeddings.position_embeddings.weight",
             "transformer.ln_f.weight": "backbone.ln_f.weight", "transformer.ln_f.bias": "backbone.ln_f.bias"}
    for i in range(L_R):
        for ours, theirs in (("ln_1", "norm1"), ("attn.c_attn", "mixer.Wqkv"), ("attn.c_proj", "mixer.out_proj"),
                             ("ln_2", "norm2"), ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
            for part in ("weight", "bias"):
                names[f"transformer.h.{i}.{ours}.{part}"] = f"backbone.layers.{i}.{theirs}.{part}"
    state = model.state_dict()
    weights = {theirs: state[ours] for ours, theirs in names.items()}
    weights["lm_head.weight"] = state["lm_head.weight"]
    reference = reference.double().eval()
    reference.load_state_dict(weights, strict=True)
    _same_on_regbench_inputs("seq_icl lm_simple / owai regbench transformer", cfg, reference, model)


# seq_icl's LSTMLayer gives its 1-layer nn.LSTM dropout 0.1, which torch ignores with a warning
@pytest.mark.filterwarnings("ignore:dropout option adds dropout after all but last recurrent layer")
def test_seq_icl_lstm_equals_owai_regbench_lstm():
    """seq_icl's RegBench LSTM (`lm_simple_noffn` with `LSTMLayer`, configured by
    configs/experiment/dfa/lstm.yaml) against the model `owai eval regbench` builds for `lstm`, one
    randomised state dict, logits and gradients in float64. Its forward feeds every outer layer the
    embeddings and keeps the last layer's output, so with the yaml's two outer layers only the
    last one (and no dropout) reaches the logits: that one gets owai's weights. Its `instantiate`
    (Hydra's, through seq_icl's registry) is replaced by what it does with the yaml's `layer`."""
    import functools
    import yaml
    from collections import namedtuple

    root = clone("seq_icl")
    spec = yaml.safe_load((root / "configs" / "experiment" / "dfa" / "lstm.yaml").read_text())["model"]
    assert spec["_name_"] == "lm_simple_noffn" and spec["layer"] == {"_name_": "lstm", "n_layer": 1, "reinit": True}
    cfg = RegBenchConfig(arch="lstm")
    cfg.model.n_embd = spec["d_model"]
    model = _randomised(build_regbench_model(cfg, torch.device("cpu"))).eval()
    assert model.config.n_layer == spec["layer"]["n_layer"] and model.lm_head.weight is model.wte.weight

    ns = reference_definitions(root / "src" / "models" / "sequence" / "rnn" / "lstm.py", ("LSTMLayer",),
                               {"torch": torch, "nn": torch.nn, "np": np})
    layer = {k: v for k, v in spec["layer"].items() if k != "_name_"}

    def instantiate(registry, config, partial=False, **kwargs):  # src.utils.config.instantiate, here
        assert config["_name_"] == "lstm" and partial
        return functools.partial(ns["LSTMLayer"], **layer, **kwargs)

    ns.update({"math": math, "torch": torch, "nn": torch.nn, "F": F, "namedtuple": namedtuple,
               "partial": functools.partial, "instantiate": instantiate, "registry": SimpleNamespace(layer=None)})
    ns = reference_definitions(root / "src" / "models" / "sequence" / "simple_lm.py",
                               ("GPT2Embeddings", "SimpleLMHeadModelNoFFN"), ns)
    V_R = model.config.vocab_size
    reference = ns["SimpleLMHeadModelNoFFN"](d_model=spec["d_model"], vocab_size=V_R, layer=spec["layer"],
                                             n_layer=spec["n_layer"], embed_dropout=spec["embed_dropout"])
    reference = reference.double().eval()
    theirs = reference.state_dict()
    last = f"mixer.{spec['n_layer'] - 1}.lstm."
    weights = {"embeddings.word_embeddings.weight": model.wte.weight, "lm_head.weight": model.wte.weight}
    weights.update({last + name: p for name, p in model.lstm.named_parameters()})
    reference.load_state_dict({**theirs, **{k: v.detach() for k, v in weights.items()}}, strict=True)
    _same_on_regbench_inputs("seq_icl lm_simple_noffn LSTM / owai regbench lstm", cfg, reference, model)


# ------------------------------------------------------------------ RFC's ColoredMNIST trainers

RECIPE = "table2.4-coloredmnist"
STEPS, ANNEAL = 30, 10  # 10 steps at the anneal weight, then 20 with the penalty on (and the loss / lambda)
# 1,000 training images (500 per environment, of the tiny preset's 8,000) keep the float64 full-batch runs
# short; tests/test_official_model_golden.py runs owai's side of these tests with the same settings
RFC_SETTINGS = ["data.train_size=1000", "train.eval_every=1000", "train.checkpoint_every=1000", "train.log_every=1000"]


def trainer_settings(method: str) -> list[str]:
    """`owai bonsai`'s settings of the parity run against RFC's trainer for `method`."""
    return [f"method={method}", "init=erm", f"penalty.anneal_iters={ANNEAL}", f"train.steps={STEPS}", *RFC_SETTINGS,
            *TRAINERS[method][2]]


PI_STEPS1 = 10  # PI's stage-1 steps per environment
PI_SETTINGS = ["dataset=coloredmnist", f"train.steps={STEPS}", f"penalty.options={{steps1: {PI_STEPS1}}}", *RFC_SETTINGS]
BONSAI_STEPS = (10, 10, 10)  # ERM, RERM and synthesis steps of the Bonsai parity runs


def bonsai_settings(init: str) -> list[str]:
    """`owai bonsai --init bonsai[-cf] --method vrex`'s settings of the parity run against RFC's Bonsai."""
    erm, rerm, synthesis = BONSAI_STEPS
    return ["method=vrex", f"init={init}", f"train.steps={STEPS}", "bonsai.stopping=fixed", f"bonsai.erm_steps={erm}",
            f"bonsai.rerm_steps={rerm}", f"bonsai.synthesis_steps={synthesis}", *RFC_SETTINGS]


# every compared tensor moves at least this far (1e-4 to 1e-3 on 1,000 images), far above the 1e-9 bound
MOVED = 5e-5
RFC_STUBS = ("torchvision", "torchvision.datasets", "torchvision.datasets.folder", "torchvision.transforms",
             "torchvision.transforms.functional", "fast_data_loader", "backpack", "backpack.extensions",
             *(m for m in ("PIL", "tqdm") if importlib.util.find_spec(m) is None))
# owai's method -> (RFC's trainer, its keyword arguments, owai settings that make the two runs comparable)
TRAINERS = {
    "erm": ("erm_train", {}, []),
    "irm": ("irm_train", {}, []),
    "vrex": ("vrex_train", {}, []),
    "iga": ("iga_train", {}, []),
    "sd": ("sd_train", {"hparams": {"lr_s2_decay": 500}}, []),
    "fish": ("gm_train", {}, []),
    "rerm": ("dro_train", {}, []),
    "fishr": ("fishr_train", {}, []),
    # RFC's CLOvE steps on the last 512-example minibatch of a reshuffled epoch, owai on one random
    # 512-example minibatch: with 500 images per environment (RFC_SETTINGS) both take the whole environment
    "clove": ("clove_train", {"hparams": {"batch_size": 500}}, []),
    "rsc": ("rsc_train", {"hparams": {"rsc_f_drop_factor": 0.995, "rsc_b_drop_factor": 0.98}}, []),
    # lff_train refuses freeze_featurizer=False, yet trains the featurizer either way
    "lff": ("lff_train", {"freeze_featurizer": True}, []),
}
TWO_LOGITS = ("rsc", "lff")


def backpack_for_fishr(monkeypatch: pytest.MonkeyPatch) -> None:
    """RFC's Fishr takes per-example head gradients from BackPACK, or skip. RFC calls
    `loss.backward(inputs=<head parameters>, create_graph=True)`. BackPACK >= 1.4 computes nothing
    there, since module backward hooks do not fire when `inputs` leaves out the module's input
    (f-dangel/backpack#233), and RFC and DomainBed pinned 1.3.0, which does not import under torch
    2.x. So `inputs` is dropped for the run. Its only effect in RFC is that the featurizer's .grad
    fills too, and RFC's optimizer.zero_grad() clears it before every step's backward."""
    pytest.importorskip("backpack", reason="RFC's Fishr needs BackPACK: pip install --no-deps "
                        "backpack-for-pytorch einops unfoldNd (tested with 1.7.1; its torchvision "
                        "requirement would pull another torch)")
    backward = torch.Tensor.backward

    def backward_without_inputs(self, *args, **kwargs):
        kwargs.pop("inputs", None)
        return backward(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", backward_without_inputs)


@pytest.fixture
def cuda_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """RFC's code calls `.cuda()` on its tensors (scalars, labels, images): here it returns the tensor."""
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)


def _rfc_model(rfc_models, weights: dict, hidden: int, n_targets: int, fishr: bool = False):
    """RFC's MLP and TopMLP holding owai-format `weights` (featurizer.lin1/lin2, head)."""
    mlp, top = rfc_models.MLP(hidden_dim=hidden), rfc_models.TopMLP(hidden_dim=hidden, n_targets=n_targets, fishr=fishr)
    with torch.no_grad():
        for name, layer in _rfc_layers(mlp, top).items():
            layer.weight.copy_(weights[f"{name}.weight"])
            layer.bias.copy_(weights[f"{name}.bias"])
    return mlp, top


def _rfc_layers(mlp, top) -> dict:
    return {"featurizer.lin1": mlp._main[0], "featurizer.lin2": mlp._main[2], "head": top.lin1}


def _rfc_weights(mlp, top) -> dict[str, torch.Tensor]:
    """An RFC (MLP, TopMLP) pair's weights under owai's names."""
    return {f"{name}.{part}": getattr(layer, part).detach().clone() for name, layer in _rfc_layers(mlp, top).items()
            for part in ("weight", "bias")}


def _rfc_envs(environments, two_logits: bool = False) -> list[dict]:
    """owai's ColoredMNIST environments as RFC's dicts: flat images, labels (n, 1) float or (n,) long."""
    return [{"images": e.x.reshape(len(e.x), -1), "labels": e.y.long() if two_logits else e.y.reshape(-1, 1)}
            for e in environments]


@pytest.mark.parametrize("method", list(TRAINERS))
def test_rfc_trainer_equals_owai_bonsai(method, tmp_path, monkeypatch, float64, cuda_on_cpu):
    rfc_code = clone("RFC") / "coloredmnist"
    trainer_name, kwargs, _ = TRAINERS[method]
    settings = trainer_settings(method)
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    run, results = execute(RECIPE, "tiny", settings, out=tmp_path / "runs")
    cfg, _ = resolve(load(RECIPE), "tiny", settings)
    details = results["details"]
    pen = details["penalty"]
    assert pen["anneal_iters"] == ANNEAL < STEPS
    two_logits = method in TWO_LOGITS
    initial = fresh_mlp((cfg.seed, "init"), cfg.model.hidden, 2 if two_logits else 1, "cpu").state_dict()
    _, state = load_checkpoint(latest_checkpoint(run.path / "checkpoints" / "train"))
    trained = state["model"]
    if method == "lff":  # the run trains a biased copy beside the model: keep the model ("debiased")
        trained = {k.removeprefix("debiased."): v for k, v in trained.items() if k.startswith("debiased.")}

    data = owai_cmnist.load_data(cfg)
    envs, test_envs = _rfc_envs(data.train, two_logits), _rfc_envs(data.test, two_logits)
    stubs = RFC_STUBS
    if method == "fishr":
        backpack_for_fishr(monkeypatch)
        stubs = tuple(s for s in RFC_STUBS if s.split(".")[0] != "backpack")
    with imported_from(rfc_code, "train", "models", "utils", stubs=stubs) as (rfc, rfc_models, rfc_utils):
        mlp, top = _rfc_model(rfc_models, initial, cfg.model.hidden, 2 if two_logits else 1, fishr=method == "fishr")
    # gm_train reads its schedule from a module-level `flags` (RFC's argparse namespace)
    rfc.flags = SimpleNamespace(l2_regularizer_weight=details["l2"], penalty_weight=pen["weight"],
                                penalty_anneal_iters=pen["anneal_iters"], anneal_val=pen["anneal_val"])
    lossf = F.cross_entropy if two_logits else rfc_utils.mean_nll
    getattr(rfc, trainer_name)(mlp, top, STEPS, envs, test_envs, lossf, pen["anneal_iters"], pen["weight"],
                               pen["anneal_val"], cfg.train.lr, details["l2"], verbose=False, eval_steps=1000,
                               **kwargs)
    _assert_same_weights(f"RFC {trainer_name} / owai {method}", trained, initial, _rfc_weights(mlp, top), moved=MOVED)


def rfc_pi(rfc_models, rfc_utils, envs: list[dict], fit: list[torch.Tensor], stage_inits: list[dict],
           final_init: dict, hidden: int, lr: float, l2: float, steps1: int, steps3: int) -> list[tuple]:
    """RFC's predict-then-interpolate (coloredmnist/PI.py). PI.py is a script that trains at import,
    so its three stages are written out here, as it runs them, with its own MLP, TopMLP, mean_nll and
    correct_pred. The initial weights and each environment's 90 % (`fit`; PI.py shuffles with numpy's
    global RNG) come from owai's run. Returns the (mlp, top) of the stage models and the final model."""
    def model_from(weights: dict) -> torch.nn.Module:  # PI.py's n_top_layers=2: TopMLP has one layer anyway
        return torch.nn.Sequential(*_rfc_model(rfc_models, weights, hidden, 1))

    def step(model, optimizer, loss) -> None:
        weight_norm = 0
        for w in model.parameters():
            weight_norm += w.norm().pow(2)
        loss = loss + l2 * weight_norm
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    models = []  # stage 1: one model per environment, on 90 % of it
    for env, keep, weights in zip(envs, fit, stage_inits):
        x, y = env["images"][keep], env["labels"][keep]
        model = model_from(weights)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        for _ in range(steps1):
            step(model, optimizer, rfc_utils.mean_nll(model(x), y))
        models.append(model)
    created = []  # stage 2: each model splits its own environment into correct / incorrect
    for env, model in zip(envs, models):
        x, y = env["images"], env["labels"]
        model.eval()
        correct, incorrect = rfc_utils.correct_pred(model(x), y)
        created += [(x[correct], y[correct]), (x[incorrect], y[incorrect])]
    model = model_from(final_init)  # stage 3: the hard max over the groups
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps3):
        losses = torch.stack([rfc_utils.mean_nll(model(x), y) for x, y in created])
        step(model, optimizer, losses[torch.argmax(losses)])
    return [(m[0], m[1]) for m in (*models, model)]


def test_rfc_pi_equals_owai_pi(tmp_path, monkeypatch, float64, cuda_on_cpu):
    """`owai bonsai --method pi` (table2.5-pi on ColoredMNIST, init rand) against RFC's PI.py from the same
    initial weights and hold-outs: 10 stage-1 steps per environment, then 30 RERM steps. The weights of
    both stage models and of the final model (the groups alone could hide a stage-1 difference)."""
    rfc_code = clone("RFC") / "coloredmnist"
    steps1, settings = PI_STEPS1, PI_SETTINGS
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    run, results = execute("table2.5-pi", "tiny", settings, out=tmp_path / "runs")
    cfg, _ = resolve(load("table2.5-pi"), "tiny", settings)
    details = results["details"]
    assert details["pi"]["steps1"] == steps1 and len(details["pi"]["groups"]) == 4  # no group is empty
    data = owai_cmnist.load_data(cfg)
    envs = _rfc_envs(data.train)
    fit = []
    for i, e in enumerate(data.train):  # owai's hold-out draw (pi_groups_for): the first 90 % of a keyed order
        order = torch.randperm(len(e.y), generator=generator(cfg.seed, "pi", "holdout", i))
        fit.append(order[: len(e.y) - int(round(0.1 * len(e.y)))])
    stage_inits = [fresh_mlp((cfg.seed, "pi", i), cfg.model.hidden, 1, "cpu").state_dict() for i in range(len(envs))]
    initial = fresh_mlp((cfg.seed, "init"), cfg.model.hidden, 1, "cpu").state_dict()
    with imported_from(rfc_code, "models", "utils", stubs=RFC_STUBS) as (rfc_models, rfc_utils):
        models = rfc_pi(rfc_models, rfc_utils, envs, fit, stage_inits, initial, cfg.model.hidden, cfg.train.lr,
                        details["l2"], steps1, STEPS)
    stages = [f"pi.env{i + 1}" for i in range(len(envs))] + ["train"]
    for stage, start, model in zip(stages, [*stage_inits, initial], models):
        _, state = load_checkpoint(latest_checkpoint(run.path / "checkpoints" / stage))
        _assert_same_weights(f"RFC PI.py / owai pi, {stage}", state["model"], start, _rfc_weights(*model), moved=MOVED)
    print(f"parity RFC PI.py / owai pi: groups {details['pi']['groups']}")


def rfc_bonsai(rfc, rfc_models, rfc_utils, envs: list[dict], test_envs: list[dict], init: dict, init_heads: dict,
               balance: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], hidden: int, lr: float, l2: float,
               steps: tuple[int, int, int]) -> list[tuple]:
    """RFC's Bonsai for ColoredMNIST as coloredmnist_rfc.sh chains it: round 0 (run_exp.py --methods erm),
    round 1 (--methods dro, groups from round 0), the synthesis (run_exp_syn.py, groups and pseudo-labels
    from both rounds) and the averaged head. The trainers are the clone's erm_train, dro_train and
    syn_train. run_exp.py and run_exp_syn.py are scripts, so their glue is written out here: the
    correct/incorrect groups, the pseudo-labels, the balance trick's resampling and the head average.
    `balance(n_agree, n_disagree)` gives the positions run_exp_syn.py draws with np.random.choice.
    Returns the (mlp, top) of both rounds and of the synthesis, then the averaged head's weights."""
    x = torch.cat([env["images"] for env in envs])
    y = torch.cat([env["labels"] for env in envs])
    erm_steps, rerm_steps, syn_steps = steps
    args = (rfc_utils.mean_nll, 0, 0.0, 1, lr, l2)  # lossf, no anneal, weight 0, anneal_val 1
    out, groups, pseudolabels = [], [], []
    for k, n_steps in enumerate((erm_steps, rerm_steps)):
        mlp, top = _rfc_model(rfc_models, init, hidden, 1)
        if k == 0:
            rfc.erm_train(mlp, top, n_steps, envs, test_envs, *args, verbose=False, eval_steps=10**9)
        else:  # run_exp.py with --group_dirs: one environment per value of round 0's group
            group = groups[0]
            split = [{"images": x[group == v], "labels": y[group == v]} for v in np.unique(group)]
            rfc.dro_train(mlp, top, n_steps, split, test_envs, *args, verbose=False, eval_steps=10**9)
        with torch.no_grad():  # run_exp.py's end: group = correct, pseudo-label = the prediction
            group, _ = rfc_utils.correct_pred(top(mlp(x)), y)
        pseudo = np.copy(y.numpy().flatten())
        pseudo[~group] = 1 - pseudo[~group]
        groups.append(group)
        pseudolabels.append(pseudo)
        out.append((mlp, top))
    n_groups = len(groups)  # run_exp_syn.py
    votes = np.array(groups).T.astype(int)
    agree = (votes.sum(axis=1) == n_groups) | (votes.sum(axis=1) == 0)
    pseudolabel = torch.tensor(np.array(pseudolabels).T, dtype=x.dtype)  # FloatTensor there: 0/1 either way
    posidx, negidx = balance(int(agree.sum()), int((~agree).sum()))
    xs = torch.cat([x[agree][posidx], x[~agree][negidx]])
    ys = torch.cat([pseudolabel[agree][posidx], pseudolabel[~agree][negidx]])
    mlp, top = _rfc_model(rfc_models, init_heads, hidden, n_groups)
    rfc.syn_train(mlp, top, syn_steps, [{"images": xs, "labels": ys}], test_envs, *args, verbose=False,
                  eval_steps=10**9, hparams={"ntasks": n_groups})
    out.append((mlp, top))
    weight, bias = top.lin1.weight.detach()[:1].clone(), top.lin1.bias.detach()[:1].clone()
    for i in range(1, n_groups):
        weight += top.lin1.weight.detach()[i:i + 1]
        bias += top.lin1.bias.detach()[i:i + 1]
    out.append((weight / n_groups, bias / n_groups))
    return out


@pytest.mark.parametrize("init", ["bonsai", "bonsai-cf"])
def test_rfc_bonsai_equals_owai_bonsai(init, tmp_path, monkeypatch, float64, cuda_on_cpu):
    """`owai bonsai --init bonsai[-cf] --method vrex` (table2.4, ColoredMNIST) against RFC's Bonsai scripts
    and then its vrex_train from the Bonsai representation (with freeze_featurizer for -cf, where owai
    trains the head on cached features): the same initial weights and resampling draws; 10 steps per
    Bonsai phase, 30 vREx steps. Each phase's weights and the downstream model's."""
    rfc_code = clone("RFC") / "coloredmnist"
    steps = BONSAI_STEPS
    frozen = init == "bonsai-cf"
    settings = bonsai_settings(init)
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    run, results = execute(RECIPE, "tiny", settings, out=tmp_path / "runs")
    cfg, _ = resolve(load(RECIPE), "tiny", settings)
    details = results["details"]
    pen = details["penalty"]
    assert pen["anneal_iters"] == 0 and details["bonsai"]["synthesis_steps"] == steps[2]
    data = owai_cmnist.load_data(cfg)
    envs, test_envs = _rfc_envs(data.train), _rfc_envs(data.test)
    n = sum(len(e.y) for e in data.train)

    def balance(n_agree: int, n_disagree: int) -> tuple[torch.Tensor, torch.Tensor]:
        # owai's draws (balanced_indices, generator(seed, "bonsai", "balance")): n/2 uniform positions in
        # each side, with replacement, as np.random.choice(np.arange(side), n // 2, replace=True) draws them
        gen = generator(cfg.seed, "bonsai", "balance")
        return torch.randint(n_agree, (n // 2,), generator=gen), torch.randint(n_disagree, (n - n // 2,), generator=gen)

    initial = fresh_mlp((cfg.seed, "init"), cfg.model.hidden, 1, "cpu").state_dict()
    init_heads = fresh_mlp((cfg.seed, "init"), cfg.model.hidden, 2, "cpu").state_dict()
    with imported_from(rfc_code, "train", "models", "utils", stubs=RFC_STUBS) as (rfc, rfc_models, rfc_utils):
        *phases, (head_weight, head_bias) = rfc_bonsai(
            rfc, rfc_models, rfc_utils, envs, test_envs, initial, init_heads, balance, cfg.model.hidden, cfg.train.lr,
            owai_cmnist.bonsai_l2(cfg), steps)
        mlp, top = _rfc_model(rfc_models, {**_rfc_weights(*phases[-1]), "head.weight": head_weight,
                                           "head.bias": head_bias}, cfg.model.hidden, 1)
        bonsai_start = _rfc_weights(mlp, top)
        rfc.vrex_train(mlp, top, STEPS, envs, test_envs, rfc_utils.mean_nll, pen["anneal_iters"], pen["weight"],
                       pen["anneal_val"], cfg.train.lr, details["l2"], freeze_featurizer=frozen, verbose=False,
                       eval_steps=1000)
    stages = {"bonsai.round0": (initial, phases[0]), "bonsai.round1": (initial, phases[1]),
              "bonsai.synthesis": (init_heads, phases[2]), "train": (bonsai_start, (mlp, top))}
    for stage, (start, model) in stages.items():
        _, state = load_checkpoint(latest_checkpoint(run.path / "checkpoints" / stage))
        theirs = _rfc_weights(*model)
        moving = None
        if frozen and stage == "train":  # the featurizer stays the synthesis's: only the head's movement counts
            moving = {k for k in theirs if k.startswith("head.")}
            _, synthesis = load_checkpoint(latest_checkpoint(run.path / "checkpoints" / "bonsai.synthesis"))
            assert all(torch.equal(state["model"][k], synthesis["model"][k]) for k in theirs if k not in moving)
        _assert_same_weights(f"RFC Bonsai / owai {init}, {stage}", state["model"], start, theirs, moved=1e-4,
                             moving=moving)
    print(f"parity RFC Bonsai / owai {init}: agreement {details['bonsai']['agree_fraction']}")


def wilds(*modules: str) -> list[types.ModuleType]:
    """WILDS's `modules`, or skip: RFC's Camelyon17 algorithms are WILDS code."""
    reason = "needs WILDS for RFC's Camelyon17 algorithms: pip install --no-deps wilds (tested with 2.0.0)"
    return [pytest.importorskip(f"wilds.{m}", reason=reason) for m in modules]


CAMELYON_ANNEAL = 2  # the objectives' anneal step: compared before it (weight 0) and at it


def camelyon_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The objectives' batch: 2 logits for 2 hospitals x 16 patches in the group loader's order (one
    hospital's 16, then the other's), their labels and hospitals."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(32, 2, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (32,), generator=gen)
    return logits, y, torch.tensor([3] * 16 + [0] * 16)


def group_dro_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The GroupDRO round's 5 steps of random batches: logits, labels and groups of 4 (group 3 never
    in training; odd steps miss group 2)."""
    gen = torch.Generator().manual_seed(11)
    for step in range(5):
        logits = torch.randn(32, 2, generator=gen, dtype=torch.float64) * 3
        y = torch.randint(0, 2, (32,), generator=gen)
        yield logits, y, torch.randint(0, 3 if step % 2 == 0 else 2, (32,), generator=gen)


# owai's Camelyon17 downstream method -> RFC's algorithm class (src/algorithms/<name>.py)
RFC_CAMELYON = {"erm": "ERM", "irm": "IRM", "vrex": "VREX"}


@pytest.mark.parametrize("weight", [0.5, 100.0])
@pytest.mark.parametrize("method", list(RFC_CAMELYON))
def test_rfc_camelyon17_objectives_equal_owai(method, weight):
    """RFC's Camelyon17 algorithms (src/algorithms: WILDS subclasses whose modules import torchvision
    through the model zoo) run alone: their `objective` (and IRM's `irm_penalty`) with WILDS's
    `split_into_groups` and RFC's own `initialize_loss("cross_entropy")`, on a stand-in `self`. Against
    owai's `make_downstream_penalty` on the same group-loader batch (2 hospitals x 16 patches, 2 logits),
    split by hospital as owai's downstream loop splits it: the loss and its gradient before the anneal
    step (weight 0) and after it (the weight; the loss divided by it when it is above 1). RFC's CLOvE is
    left out: owai implements the intended max-softmax MMCE (docs/decisions.md, Camelyon17)."""
    from owai.methods.camelyon17 import Config as CamelyonConfig
    from owai.methods.camelyon17 import PenaltyConfig, make_downstream_penalty
    from owai.methods.invariance import EnvBatch

    wilds_utils, wilds_loss = wilds("common.utils", "common.metrics.loss")
    src = clone("RFC") / "src"
    cls = RFC_CAMELYON[method]
    ns = {"torch": torch, "autograd": torch.autograd, "nn": torch.nn, "ElementwiseLoss": wilds_loss.ElementwiseLoss,
          "split_into_groups": wilds_utils.split_into_groups}
    reference_definitions(src / "losses.py", ("initialize_loss",), ns)
    reference_definitions(src / "algorithms" / f"{cls}.py",
                          (f"{cls}.objective", *(("IRM.irm_penalty",) if method == "irm" else ())), ns)
    anneal = CAMELYON_ANNEAL
    penalty = make_downstream_penalty(CamelyonConfig(method=method, penalty=PenaltyConfig(weight=weight,
                                                                                          anneal_iters=anneal)))
    logits, y, g = camelyon_batch()
    for step in (0, anneal):
        reference = SimpleNamespace(loss=ns["initialize_loss"]("cross_entropy", None), is_training=True,
                                    use_unlabeled_y=False, update_count=step, irm_lambda=weight,
                                    irm_penalty_anneal_iters=anneal, save_metric_for_logging=lambda *a: None,
                                    scale=torch.tensor(1.0, dtype=torch.float64).requires_grad_())
        reference.irm_penalty = lambda losses, self=reference: ns["irm_penalty"](self, losses)
        theirs_in = logits.clone().requires_grad_()
        theirs = ns["objective"](reference, {"y_pred": theirs_in, "y_true": y, "g": g})
        ours_in = logits.clone().requires_grad_()
        envs = [EnvBatch(ours_in[g == h], y[g == h]) for h in g.unique_consecutive().tolist()]
        ours = penalty.objective(envs, step).loss
        theirs.backward()
        ours.backward()
        print(f"parity RFC Camelyon17 {cls}.objective / owai {method} (weight {weight}, step {step}): "
              f"loss {theirs.item():.6f} / {ours.item():.6f}")
        assert ours.item() == pytest.approx(theirs.item(), rel=1e-12, abs=1e-15)
        torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-10, atol=1e-14)


def _scatter_mean(src: torch.Tensor, index: torch.Tensor, dim_size: int, reduce: str = "mean") -> torch.Tensor:
    """torch_scatter's `scatter(..., reduce="mean")` for 1-D inputs (an empty slot gives 0), which WILDS's
    `avg_over_groups` imports: torch_scatter is a compiled extension with no wheel for this torch."""
    assert reduce == "mean" and src.ndim == 1
    return src.new_zeros(dim_size).scatter_reduce(0, index, src, "mean", include_self=False)


def test_rfc_camelyon17_group_dro_equals_owai_rounds(monkeypatch):
    """A discovery round's GroupDRO (RFC's src/algorithms/groupDRO.py) against owai's `group_dro_loss`,
    over 5 steps of random batches: 4 groups, one never in training (its weight stays 0 in RFC, owai
    leaves it out), and batches that miss a training group (loss 0 there, as WILDS's
    `compute_group_wise` gives). RFC's `objective` runs as it is, with WILDS's loss; its `_update`
    first moves the group weights (two lines, written out here, since the rest of `_update` is WILDS's
    training step). The loss and its gradient at every step, so the weights' history is compared too."""
    monkeypatch.setitem(sys.modules, "torch_scatter", SimpleNamespace(scatter=_scatter_mean))
    from owai.methods.camelyon17 import group_dro_loss
    from owai.methods.invariance import make_penalty

    (wilds_loss,) = wilds("common.metrics.loss")
    src = clone("RFC") / "src"
    ns = {"torch": torch, "nn": torch.nn, "ElementwiseLoss": wilds_loss.ElementwiseLoss}
    reference_definitions(src / "losses.py", ("initialize_loss",), ns)
    reference_definitions(src / "algorithms" / "groupDRO.py", ("GroupDRO.objective",), ns)
    eta, n_groups, in_train = 0.01, 4, torch.tensor([True, True, True, False])
    weights = in_train.double() / in_train.sum()  # GroupDRO.__init__: uniform over the groups in train
    reference = SimpleNamespace(loss=ns["initialize_loss"]("cross_entropy", None), group_weights=weights,
                                grouper=SimpleNamespace(n_groups=n_groups))
    penalty = make_penalty("groupdro", eta=eta)
    for step, (logits, y, g) in enumerate(group_dro_batches()):
        theirs_in, ours_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        results = {"y_pred": theirs_in, "y_true": y, "g": g}
        group_losses, _, _ = reference.loss.compute_group_wise(theirs_in, y, g, n_groups, return_dict=False)
        reference.group_weights = reference.group_weights * torch.exp(eta * group_losses.data)  # GroupDRO._update
        reference.group_weights = reference.group_weights / reference.group_weights.sum()
        theirs = ns["objective"](reference, results)
        ours = group_dro_loss(penalty, ours_in, y, g, torch.nonzero(in_train).reshape(-1))
        theirs.backward()
        ours.backward()
        print(f"parity RFC Camelyon17 GroupDRO / owai round loss, step {step}: {theirs.item():.6f} / {ours.item():.6f}")
        assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
        torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(penalty.q, reference.group_weights[in_train], rtol=1e-12, atol=0)


# owai variant -> RFC's coloredmnist(label_noise_rate, trenv1, trenv2) (run_exp.py's dataset keys)
RFC_DATASETS = {"coloredmnist": (0.25, 0.1, 0.2), "coloredmnist-gray": (0.25, 0.5, 0.5),
                "inverse-coloredmnist": (0.1, 0.2, 0.25)}


@pytest.mark.parametrize("name", list(RFC_DATASETS))
def test_rfc_coloredmnist_equals_owai_rng_rfc(name, shared_data, cuda_on_cpu):
    """RFC's `coloredmnist()` (mydatasets.py) on MNIST's 60 000 training images, after run_exp.py's
    `np.random.seed(restart); torch.manual_seed(restart)`, against owai's paper split with
    `rng="rfc"`: the same five environments, image for image and label for label."""
    from owai.data.colored_mnist import load_colored_mnist
    from owai.data.mnist import load_mnist

    rfc_code = clone("RFC") / "coloredmnist"
    mnist = load_mnist("train")  # from $OWAI_DATA
    seed = 3
    ours = load_colored_mnist(name, seed=seed, mnist_split="train", rng="rfc")
    reader = SimpleNamespace(data=mnist.images.clone(), targets=mnist.labels.clone())  # RFC shuffles them in place
    numpy_state = np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]), imported_from(rfc_code, "mydatasets", stubs=RFC_STUBS) as (rfc_data,):
            rfc_data.datasets = SimpleNamespace(MNIST=lambda *args, **kwargs: reader)
            np.random.seed(seed)
            torch.manual_seed(seed)
            envs, test_envs = rfc_data.coloredmnist(*RFC_DATASETS[name])
    finally:
        np.random.set_state(numpy_state)
    assert [len(e["labels"]) for e in envs + test_envs] == [25_000, 25_000, 10_000, 10_000, 10_000]
    for k, (theirs, env) in enumerate(zip(envs + test_envs, ours.train + ours.test)):
        assert torch.equal(theirs["images"], env.x), f"environment {k}: images"
        assert torch.equal(theirs["labels"].reshape(-1).long(), env.y.reshape(-1).long()), f"environment {k}: labels"
    print(f"parity RFC coloredmnist{RFC_DATASETS[name]} / owai {name} (rng rfc, seed {seed}): 5 environments identical")


# ------------------------------------------------------------------ Three Moons (MLX)

MOON_STEPS, MOON_BATCH = 30, 4


def moon_settings(heads: int) -> list[str]:
    """`owai moons`'s settings of the training-and-curves parity run with `heads` heads."""
    return [f"model.heads=[{heads}]", f"train.steps={MOON_STEPS}", f"train.batch_size={MOON_BATCH}",
            "train.selection_sequences=3", "eval.n_sequences=2", "eval.chunk=2", "eval.tau_stride=97",
            "train.checkpoint_every=1000", "train.log_every=1000"]
# the reference's ContextMemory settings (ThreeMoons/train_planets-{1head,3heads}.py, which differ only
# in n_head and h_dim)
MOON_REFERENCE = dict(input_dim=6, bias=False, block_size=800, v_shift=1, v_ban=0, complex=True, norm_keys=False,
                      scale_keys=False, norm_vals=False, attn_scale=50, out_proj=True, out_sum=False, emb=False)
MOON_MAPS = {"k_lin": "key", "v_lin": "value", "out_proj": "out"}  # reference module -> owai ComplexLinear


def mlx() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """mlx.core, mlx.nn and mlx.optimizers, or skip: the Three Moons reference is MLX code."""
    reason = ("needs MLX for the Three Moons reference: pip install 'mlx[cpu]' (tested with 0.32.4, whose Adam "
              "is 0.9's; the reference pins 0.9, which has no Linux build)")
    modules = ("mlx.core", "mlx.nn", "mlx.optimizers")
    return tuple(pytest.importorskip(m, reason=reason) for m in modules)  # type: ignore[return-value]


def context_memory(reference: types.ModuleType, heads: int, weights: dict[str, torch.Tensor]):
    """The reference's ContextMemory holding owai's weights, in float64 (owai's real 6x6 matrices
    [[r, s], [-s, r]] already lie in the subspace that its `complexify` projects onto)."""
    mx, _, _ = mlx()
    model = reference.ContextMemory(SimpleNamespace(n_head=heads, h_dim=6 // heads, **MOON_REFERENCE))
    owai_model = MoonMemory(MoonMemoryConfig(n_heads=heads))
    owai_model.load_state_dict(weights)
    for name, owai_name in MOON_MAPS.items():
        matrix = getattr(owai_model, owai_name).real_matrix().detach().double().numpy()
        getattr(model, name).weight = mx.array(matrix, dtype=mx.float64)
    return model


def from_mlx(array) -> torch.Tensor:
    return torch.from_numpy(np.array(array))


def complex_parts(matrix: torch.Tensor) -> dict[str, torch.Tensor]:
    """owai's (r, s) from a real 6x6 matrix (or its gradient) whose 2x2 blocks are [[r, s], [-s, r]]."""
    return {"r": matrix[0::2, 0::2], "s": matrix[0::2, 1::2]}


def reference_loss(mx: types.ModuleType):
    """The reference script's `loss_fn` (train_planets-*.py): the clipped MSE over every position."""
    def loss_fn(model, x, y):
        yhat, _, _ = model(x)
        return mx.clip(yhat - y, a_min=-0.5, a_max=0.5).square().mean()
    return loss_fn


def test_planets_dataset_equals_owai_moons_data(monkeypatch):
    """The period split, the time step and the sequences of `owai moons`'s recipe against the reference's
    PlanetsDataset (train_planets-*.py's settings: block 800, 3 periods per block, observer "sun")."""
    folder = clone("MemoryMosaics") / "ThreeMoons"
    mlx()  # planets.py imports mlx.core
    with imported_from(folder, "planets") as (planets,):
        train, val = (planets.PlanetsDataset(block_size=800, split=split, min_periods_in_block_size=3, observer="sun")
                      for split in ("train", "val"))
    data = resolve(load("three-moons"), "cpu", [])[0].data
    train_sets, val_sets = ([tuple(p) for p in sets] for sets in (data.train_periods, data.val_periods))
    assert [tuple(p) for p in val.all_periods] == val_sets
    ref_train = [tuple(p) for p in train.all_periods]
    # numpy's unstable argsort may order the lcm ties differently on another CPU (docs/decisions.md)
    assert [lcm_periods(p) for p in ref_train] == [lcm_periods(p) for p in train_sets]
    assert ref_train[5] == train_sets[5]  # the training panel of Figures 3.5 and 3.6
    print(f"parity planets: training split in the same order as owai's: {ref_train == train_sets}")
    dt = time_step(train_sets + val_sets, data.block_size, data.min_periods_in_block)
    assert train.linspace[1] - train.linspace[0] == pytest.approx(dt, rel=1e-12)

    draws = []  # owai's two torch.randint calls: the period set and the start of each sequence
    randint = torch.randint
    monkeypatch.setattr(torch, "randint", lambda *a, **k: draws.append((a, randint(*a, **k))) or draws[-1][1])
    seqs = sample_sequences(train_sets, 16, data.block_size + 1, dt, torch.Generator().manual_seed(0), data.phase,
                            block_size=data.block_size)
    monkeypatch.setattr(torch, "randint", randint)
    (_, choice), ((high, _), start) = draws
    train.all_periods = [list(p) for p in train_sets]  # the split is compared above: here, the sequences
    ranges = []
    for i in range(16):
        monkeypatch.setattr(np.random, "randint", lambda lo, hi, s=int(start[i]): ranges.append((lo, hi)) or s)
        x, y, _, _ = train.get(int(choice[i]))
        assert float(abs(from_mlx(x) - seqs[i, :800]).max()) <= 1e-6
        assert float(abs(from_mlx(y) - seqs[i, 1:]).max()) <= 1e-6
    assert set(ranges) == {(0, high)}  # the same range of starts


@pytest.mark.parametrize("heads", [1, 3])
def test_context_memory_equals_owai_moon_memory(heads, default_float64):
    mx, nn, _ = mlx()
    with imported_from(clone("MemoryMosaics") / "ThreeMoons", "model") as (reference,):
        torch.manual_seed(heads)
        owai_model = MoonMemory(MoonMemoryConfig(n_heads=heads))
        model = context_memory(reference, heads, owai_model.state_dict())
    seq = moons(4, 801, seed=1).double()
    x, y = (mx.array(t.numpy(), dtype=mx.float64) for t in (seq[:, :-1], seq[:, 1:]))
    want, _, _ = model(x)
    got = owai_model(seq[:, :-1])
    err = float(abs(from_mlx(want) - got.detach()).max())
    loss, grads = nn.value_and_grad(model, reference_loss(mx))(model, x, y)
    owai_loss = clipped_mse(got, seq[:, 1:])
    owai_loss.backward()
    # the reference's gradient is on its raw 6x6 entries: r and s fill two cells of each 2x2 block
    worst = 0.0
    for name, owai_name in MOON_MAPS.items():
        g = from_mlx(grads[name]["weight"])
        assert torch.equal(g[1::2, 1::2], g[0::2, 0::2]) and torch.equal(g[1::2, 0::2], -g[0::2, 1::2])
        for part, theirs in complex_parts(g).items():
            mine = getattr(getattr(owai_model, owai_name), part).grad
            worst = max(worst, float(abs(mine - 2 * theirs).max() / mine.abs().max()))
    print(f"parity ContextMemory / owai MoonMemory heads={heads}: max |output diff| {err:.1e}, "
          f"max relative gradient diff {worst:.1e}")
    # MLX's float64 exp is accurate to ~1e-7 (relative), not to float64's 1e-16
    assert err <= 1e-6 and worst <= 1e-6
    assert abs(loss.item() - owai_loss.item()) <= 1e-9


@pytest.mark.parametrize("heads", [1, 3])
def test_reference_training_and_metrics_equal_owai_moons(heads, tmp_path, monkeypatch, default_float64):
    """`owai moons`'s whole run against the reference's training loop (its script's loop, written out:
    the script trains at import) on owai's batches from owai's initial weights, and both error curves
    against the reference's generation routines on owai's trained weights."""
    mx, nn, optim = mlx()
    batches, inits = [], []
    sample = owai_moons.sample_sequences

    def recorded(*args, **kwargs):
        batches.append(sample(*args, **kwargs).double())
        return batches[-1]

    class Recorded(MoonMemory):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            inits.append({k: v.clone() for k, v in self.state_dict().items()})

    monkeypatch.setattr(owai_moons, "sample_sequences", recorded)
    monkeypatch.setattr(owai_moons, "MoonMemory", Recorded)
    settings = moon_settings(heads)
    run, results = execute("three-moons", "cpu", settings, out=tmp_path / "runs")
    cfg, _ = resolve(load("three-moons"), "cpu", settings)
    _, state = load_checkpoint(latest_checkpoint(run.path / "checkpoints" / f"heads{heads}-r0"))
    trained = state["model"]
    steps = [b for b in batches if len(b) == MOON_BATCH]
    panels = [b for b in batches if len(b) == 2]
    assert len(inits) == 1 and len(steps) == MOON_STEPS and len(panels) == 2

    with imported_from(clone("MemoryMosaics") / "ThreeMoons", "model") as (reference,):
        model = context_memory(reference, heads, inits[0])
        check = context_memory(reference, heads, trained)
    t = cfg.train
    optimizer = optim.AdamW(learning_rate=optim.linear_schedule(t.lr, t.lr_end, t.steps), betas=(0.9, 0.999),
                            weight_decay=0)
    loss_and_grad = nn.value_and_grad(model, reference_loss(mx))
    for batch in steps:
        x = mx.array(batch.numpy(), dtype=mx.float64)
        _, grads = loss_and_grad(model, x[:, :-1], x[:, 1:])
        optimizer.update(model, grads)
        mx.eval(model.parameters())
    theirs = {f"{owai_name}.{part}": w for name, owai_name in MOON_MAPS.items()
              for part, w in complex_parts(from_mlx(reference.complexify(getattr(model, name).weight))).items()}
    _assert_same_weights(f"Three Moons training heads={heads}", trained, inits[0], theirs, moved=0.05, bound=1e-5)

    curves = results["details"]["variants"][f"heads{heads}"]["curves"]
    n_gen, diffs = cfg.eval.n_gen, {"reference": [], "exact": []}
    for panel, seq in zip(("train", "val"), panels):
        x, y = mx.array(seq[:, :-1].numpy(), dtype=mx.float64), seq[:, 1:]
        for tau, cached, exact in zip(curves["tau"], curves[panel]["reference"], curves[panel]["exact"]):
            if tau > 800 - n_gen - 1:  # plotctx's last context length
                continue
            window = slice(tau - 1, tau - 1 + n_gen)
            # plotctx: gend[t] predicts y[t] = x[t + 1], and is compared with y[t - 1]
            gend = from_mlx(check.generate(x[:, :tau], n_gen))
            shifted = slice(tau, tau + n_gen)
            diffs["reference"].append(abs(float((y[:, window] - gend[:, shifted]).abs().mean()) - cached))
            # generate_nocache stores every value from the fed-back input: out[t] predicts y[t]
            out = from_mlx(check.generate_nocache(x[:, :tau], n_gen))
            diffs["exact"].append(abs(float((y[:, window] - out[:, window]).abs().mean()) - exact))
    print(f"parity Three Moons curves heads={heads}: {len(diffs['exact'])} contexts, max |error diff| "
          f"{max(diffs['reference']):.1e} (reference metric vs generate), "
          f"{max(diffs['exact']):.1e} (exact vs generate_nocache)")
    assert len(diffs["exact"]) == 16 and max(diffs["reference"] + diffs["exact"]) <= 1e-5


# ------------------------------------------------------------------ RegBench scoring (seq_icl)


def reference_definitions(path: Path, names: tuple[str, ...], namespace: dict) -> dict:
    """Run the named top-level definitions of a reference file (or `Class.method`, as a plain function)
    verbatim in `namespace`. For files whose imports pull in a whole training stack: seq_icl's eval.py
    imports Lightning, Hydra and wandb, and its dfa.py the package of every dataset (torchvision)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = node
        if isinstance(node, ast.ClassDef):
            found.update({f"{node.name}.{f.name}": f for f in node.body if isinstance(f, ast.FunctionDef)})
    for name in names:
        exec(compile(ast.Module(body=[found[name]], type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def pythomata() -> types.ModuleType:
    """pythomata (seq_icl's DFA is a pythomata SimpleDFA), or skip."""
    return pytest.importorskip("pythomata", reason="needs pythomata for seq_icl's DFA: pip install pythomata")


def seq_icl_scoring() -> dict:
    """seq_icl's DFA and Vocab (src/dataloaders/dfa.py), `get_dfa_probs` (analyze.py), its n-gram
    (ngram.py) and the Lightning module's two scoring methods (eval.py): `_get_dfa_accuracy` gives
    `dfa_accuracy`, `_writes_to_file` gives `model_dfa_diff` and the n-gram's numbers."""
    root = clone("seq_icl")
    ns = {"np": np, "torch": torch, "os": os, "gzip": gzip, "pickle": pickle, "Tuple": typing.Tuple,
          "Dict": typing.Dict, "SimpleDFA": pythomata().SimpleDFA}
    reference_definitions(root / "src" / "dataloaders" / "dfa.py", ("DFA", "Vocab"), ns)
    reference_definitions(root / "analyze.py", ("get_uniform_probs", "get_dfa_probs"), ns)
    with imported_from(root, "ngram") as (ngram,):
        ns["predict_with_n_gram_back_off"] = ngram.predict_with_n_gram_back_off
    methods = ("SequenceLightningModule._get_dfa_accuracy", "SequenceLightningModule._writes_to_file")
    return reference_definitions(root / "eval.py", methods, ns)


def regbench_scoring_batch(sharp: bool) -> tuple:
    """The scoring parity test's batch: 8 of make_regbench(20, 16, seed 8)'s test automata (89 n-gram
    rows that sum to < 1), their inputs, labels and automata, and random logits (`sharp`: +3 on the
    legal symbols, so the accuracy is neither near 0 nor near 1)."""
    data = make_regbench(num_examples=20, num_test_examples=16, seed=8)
    inputs, labels, pfas = data.test.batch(range(8))
    true = exact_distributions(inputs, pfas)
    logits = torch.randn(*true.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    if sharp:
        logits += 3.0 * torch.from_numpy(true > 0)
    return data, inputs, labels, pfas, logits


@pytest.mark.parametrize("sharp", [False, True])
def test_seq_icl_scores_equal_owai_regbench_metrics(sharp, tmp_path, monkeypatch):
    """One batch of owai's RegBench test automata, scored by seq_icl's own code and by owai: the model's
    `dfa_accuracy` and `model_dfa_diff` (owai's accuracy and "tvd"), and the in-context 3-gram's L1 to the
    automaton and its accuracy. `sharp` puts most of each row's mass on legal symbols, so the accuracy is
    neither near 0 nor near 1."""
    ref = seq_icl_scoring()
    data, inputs, labels, pfas, logits = regbench_scoring_batch(sharp)
    cfg = data.config
    vocab = ref["Vocab"](cfg.vocab_size - 2, special_vocabs={"seperator": "|", "noop": "."})
    assert vocab.vocab == list(cfg.symbols)  # the same ids: "." 0, letters 1-18, "|" 19
    dfas = [ref["DFA"](pfa.num_states, tuple(vocab.non_special_vocab),
                       tuple({vocab.get_vocab(sym): nxt for sym, nxt in row} for row in pfa.transitions),
                       np.random.default_rng(0)) for pfa in pfas]
    module = SimpleNamespace(task=SimpleNamespace(dataset=SimpleNamespace(vocab=vocab)), current_epoch=0)
    y = torch.from_numpy(labels)
    batch = (torch.from_numpy(inputs), y)
    _, dfa_accuracy = ref["_get_dfa_accuracy"](module, logits, y, batch, dfas)
    monkeypatch.chdir(tmp_path)  # _writes_to_file writes its generations/ there
    _, model_dfa_diff, dfa_ngram_diff, _, ngram_accuracy = ref["_writes_to_file"](module, "test", logits, y, batch,
                                                                                   dfas, ngram=3)
    mine = regbench_metrics(logits, inputs, pfas, from_logits=True)
    ngram_probs = ngram_backoff_probs(inputs, cfg.vocab_size, cfg.sep_id)
    ngram = regbench_metrics(ngram_probs, inputs, pfas)
    # seq_icl's n-gram sums its counts in set order, so which of two tied symbols wins its argmax depends
    # on the process's hash seed: the accuracies may differ by the positions where a legal and an illegal
    # symbol tie for the maximum
    top = ngram_probs >= ngram_probs.max(axis=-1, keepdims=True) - 1e-9
    legal = exact_distributions(inputs, pfas) > 0
    ties = int(((top & legal).any(-1) & (top & ~legal).any(-1) & (inputs != 0)).sum())
    print(f"parity seq_icl sharp={sharp}: dfa_accuracy {dfa_accuracy:.4f} / owai {mine['accuracy']:.4f}, "
          f"model_dfa_diff {model_dfa_diff:.4f} / {mine['tvd']:.4f}, 3-gram L1 {dfa_ngram_diff:.4f} / "
          f"{ngram['tvd']:.4f}, 3-gram accuracy {ngram_accuracy:.4f} / {ngram['accuracy']:.4f} "
          f"({ties} legal-illegal ties)")
    assert 0.05 < dfa_accuracy < 0.95 if sharp else dfa_accuracy < 0.5
    assert mine["accuracy"] == pytest.approx(dfa_accuracy, abs=1e-12)
    assert mine["tvd"] == pytest.approx(model_dfa_diff, rel=1e-9)
    assert ngram["tvd"] == pytest.approx(dfa_ngram_diff, rel=1e-9)
    assert abs(ngram["accuracy"] - ngram_accuracy) * ngram["num_accuracy_positions"] <= ties


class _InsertionOrderedSet(dict):
    """A `set` for seq_icl's generator that iterates in insertion order. Like its set, it never merges
    two DFAs: they hash by their table but compare by identity."""

    def __init__(self, items=()):
        super().__init__(dict.fromkeys(items))

    def add(self, item) -> None:
        self[item] = None


def seq_icl_generator() -> type:
    """seq_icl's `ICLDFADataModule` (src/dataloaders/dfa.py), with the two orders that depend on the
    process's PYTHONHASHSEED there fixed to owai's, and nothing else changed:
    - its `set` of candidate DFAs iterates in hash order, and its shuffle then acts on that order; here
      the set iterates in insertion order (owai shuffles the candidates as drawn);
    - pythomata's `minimize().trim()` leaves each state's outgoing symbols in an order that comes from
      iterating a set of strings, and `DFA.sample` picks by index in that order; here they are sorted
      (owai's order, by id)."""
    root = clone("seq_icl")
    ns = {"np": np, "torch": torch, "Tuple": typing.Tuple, "Dict": typing.Dict, "SimpleDFA": pythomata().SimpleDFA,
          "Dataset": torch.utils.data.Dataset, "DataLoader": torch.utils.data.DataLoader,
          "SequenceDataset": type("SequenceDataset", (), {})}
    source = root / "src" / "dataloaders" / "dfa.py"
    reference_definitions(source, ("DFA", "RandomDFASampler", "Vocab", "Tokenizer", "SimpleDataset"), ns)
    trim = ns["DFA"]._trim

    def trim_then_sort_symbols(self):
        trim(self)
        table = self.dfa._transition_function
        for state in table:
            table[state] = dict(sorted(table[state].items()))
        return self

    ns["DFA"]._trim = trim_then_sort_symbols
    return reference_definitions(source, ("ICLDFADataModule",), dict(ns, set=_InsertionOrderedSet))["ICLDFADataModule"]


def _language(dfa, vocab) -> tuple:
    """A seq_icl DFA's automaton as owai's canonical minimised table (start state first)."""
    table, start = dfa.dfa._transition_function, dfa.dfa._initial_state
    states = [start, *sorted(s for s in table if s != start)]
    index = {s: i for i, s in enumerate(states)}
    return minimize([{vocab.get_id(a): index[t] for a, t in table.get(s, {}).items()} for s in states])


# (training automata, held-out automata): the cpu preset's first size; 2,000 candidates of which two
# repeat a language (seq_icl keeps both); too few candidates (10 x 30 < 305), so both scale the split
# sizes down, to an odd held-out count
@pytest.mark.parametrize("num_examples, num_test_examples", [(100, 500), (1000, 1000), (30, 275)])
def test_seq_icl_generator_equals_owai_regbench(num_examples, num_test_examples):
    """seq_icl's RegBench data module against `make_regbench`, with the same settings and seed: the
    same automata in the same splits, and the same padded inputs and labels, token for token."""
    generator = seq_icl_generator()
    settings = dict(num_examples=num_examples, num_test_examples=num_test_examples, seed=0)
    cfg = RegBenchDataConfig(**settings)  # the other settings: seq_icl's icl_dfa.yaml defaults
    module = generator(vocab_size=cfg.vocab_size, max_num_nodes=cfg.max_num_nodes,
                       max_num_in_context_examples=cfg.max_num_in_context_examples,
                       min_num_in_context_examples=cfg.min_num_in_context_examples,
                       max_outgoing_edges=cfg.max_outgoing_edges, max_len_per_example=cfg.max_len_per_example,
                       input_seq_len=4096, **settings)
    module.setup()
    data = make_regbench(cfg)
    assert (module.num_examples, module.num_test_examples) == (data.num_examples, data.num_test_examples)
    for name in ("train", "test", "val"):
        theirs, ours = module.dataset[name], getattr(data, name)
        inputs, labels, pfas = ours.torch_batch()
        assert [_language(dfa, module.vocab) for dfa in theirs.dfas] == [p.transitions for p in pfas], name
        assert theirs.inputs.shape == inputs.shape and torch.equal(theirs.inputs, inputs), name
        assert torch.equal(theirs.targets, labels), name
    print(f"parity seq_icl ICLDFADataModule / owai make_regbench ({num_examples}, {num_test_examples}): "
          f"{data.num_examples} / {len(data.test)} / {len(data.val)} automata, {data.num_unique} languages among "
          f"{data.num_candidates} candidates, {sum(len(s) for s in data.train.sequences)} training tokens: identical")
    if num_examples == 1000:
        assert data.num_unique < data.num_candidates  # the case keeps repeated languages, as seq_icl does
