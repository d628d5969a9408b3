"""owai beside the official code, run side by side on the same weights and data.

- Memory Mosaics v1: the Library's `StackAssoMem` and nanoMosaics' `MemoryMosaic`
  (facebookresearch/MemoryMosaics), loaded with one random official-format state dict, against owai's
  model built from it by `convert_official_state_dict`: logits and gradients in float64.
- The invariance trainers: RFC's ColoredMNIST trainers (TjuJianyu/RFC, `coloredmnist/train.py`) from
  owai's initial weights on owai's ColoredMNIST environments, against `owai bonsai`'s whole training
  run (`execute`), 30 full-batch Adam steps across the anneal step, in float64: the final weights.

The reference code is not part of owai and is never copied into it: set $OWAI_REFERENCE_CODE to a
folder holding the clones `MemoryMosaics/` and `RFC/`; without them these tests skip. The reference
modules are imported from there for the test only, and removed from `sys.modules` afterwards.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import owai.methods.coloredmnist as owai_cmnist
from owai.checkpoint import latest_checkpoint, load_checkpoint
from owai.experiment import execute, resolve
from owai.methods.bonsai import fresh_mlp
from owai.models.memory_mosaics import MemoryMosaicsForCausalLM
from owai.models.memory_mosaics_convert import convert_official_state_dict
from owai.recipes import load
from naive_memory_mosaics import random_official_state_dict

CLONES = {
    "MemoryMosaics": "git clone https://github.com/facebookresearch/MemoryMosaics (tested at 1fff63b)",
    "RFC": "git clone https://github.com/TjuJianyu/RFC (tested at de4a5a4)",
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
        for key, module in list(sys.modules.items()):  # the clone's modules only: torch's lazy imports stay
            if key in stubs or folder in Path(getattr(module, "__file__", None) or "/").resolve().parents:
                del sys.modules[key]
        sys.modules.update(replaced)


def test_reference_modules_do_not_stay_imported():
    folder = clone("MemoryMosaics") / "nanoMosaics"
    before = sys.modules.get("torchvision")
    with imported_from(folder, "mosaic_model", stubs=("torchvision",)) as (nano,):
        assert sys.modules["mosaic_model"] is nano and sys.modules["torchvision"] is not before
    assert "mosaic_model" not in sys.modules and sys.modules.get("torchvision") is before
    assert "torch.nn.functional" in sys.modules  # what the clone's import pulled in from torch stays


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


def _agree(case: str, want: torch.Tensor, model: MemoryMosaicsForCausalLM, reference: torch.nn.Module,
           sharp_bound: float | None) -> None:
    """owai's logits on IDS equal the reference's `want` to 1e-10, and so do the gradients of a
    cross-entropy loss; with a head past the clamp (`sharp_bound`), the logits to that bound only."""
    got = model(IDS).logits
    assert got.shape == want.shape == (3, T, V)
    err = float((want - got).detach().abs().max())
    print(f"parity {case}: max |logit diff| {err:.1e}")
    assert err <= (sharp_bound or 1e-10), err
    if sharp_bound is None:
        F.cross_entropy(want.flatten(0, 1), TARGETS.flatten()).backward()
        F.cross_entropy(got.flatten(0, 1), TARGETS.flatten()).backward()
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


# ------------------------------------------------------------------ RFC's ColoredMNIST trainers

RECIPE = "table2.4-coloredmnist"
STEPS, ANNEAL = 30, 10  # 10 steps at the anneal weight, then 20 with the penalty on (and the loss / lambda)
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
    # RFC's CLOvE steps on the last 512-example minibatch of a reshuffled epoch, owai on one random
    # 512-example minibatch: with 500 images per environment both take the whole environment
    "clove": ("clove_train", {"hparams": {"batch_size": 500}}, ["data.train_size=1000"]),
    "rsc": ("rsc_train", {"hparams": {"rsc_f_drop_factor": 0.995, "rsc_b_drop_factor": 0.98}}, []),
    # lff_train refuses freeze_featurizer=False, yet trains the featurizer either way
    "lff": ("lff_train", {"freeze_featurizer": True}, []),
}
TWO_LOGITS = ("rsc", "lff")


@pytest.fixture
def float64(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Both runs in float64. In float32, Adam turns summation-order rounding in near-zero gradients
    into differences of up to 1e-4 after 30 steps (measured): a bound that loose would let real
    differences through."""
    load = owai_cmnist.load_data

    def load_float64(*args, **kwargs):
        data = load(*args, **kwargs)
        for env in data.train + data.test:
            env.x, env.y = env.x.double(), env.y.double()
        return data

    monkeypatch.setattr(owai_cmnist, "load_data", load_float64)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize("method", list(TRAINERS))
def test_rfc_trainer_equals_owai_bonsai(method, tmp_path, monkeypatch, float64):
    rfc_code = clone("RFC") / "coloredmnist"
    trainer_name, kwargs, extra = TRAINERS[method]
    settings = [f"method={method}", "init=erm", f"penalty.anneal_iters={ANNEAL}", f"train.steps={STEPS}",
                "train.eval_every=1000", "train.checkpoint_every=1000", "train.log_every=1000", *extra]
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
    label = (lambda e: e.y.long()) if two_logits else (lambda e: e.y.reshape(-1, 1))
    envs = [{"images": e.x.reshape(len(e.x), -1), "labels": label(e)} for e in data.train]
    test_envs = [{"images": e.x.reshape(len(e.x), -1), "labels": label(e)} for e in data.test]
    with imported_from(rfc_code, "train", "models", "utils", stubs=RFC_STUBS) as (
            rfc, rfc_models, rfc_utils):
        mlp = rfc_models.MLP(cfg.model.hidden)
        top = rfc_models.TopMLP(cfg.model.hidden, n_targets=2 if two_logits else 1)
    ref = {"featurizer.lin1": mlp._main[0], "featurizer.lin2": mlp._main[2], "head": top.lin1}
    with torch.no_grad():
        for name, layer in ref.items():
            layer.weight.copy_(initial[f"{name}.weight"])
            layer.bias.copy_(initial[f"{name}.bias"])
    # gm_train reads its schedule from a module-level `flags` (RFC's argparse namespace)
    rfc.flags = SimpleNamespace(l2_regularizer_weight=details["l2"], penalty_weight=pen["weight"],
                                penalty_anneal_iters=pen["anneal_iters"], anneal_val=pen["anneal_val"])
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)  # its trainers call .cuda() on scalars
    lossf = F.cross_entropy if two_logits else rfc_utils.mean_nll
    getattr(rfc, trainer_name)(mlp, top, STEPS, envs, test_envs, lossf, pen["anneal_iters"], pen["weight"],
                               pen["anneal_val"], cfg.train.lr, details["l2"], verbose=False, eval_steps=1000,
                               **kwargs)
    errors, least_moved = {}, math.inf
    for name, layer in ref.items():
        for part in ("weight", "bias"):
            key = f"{name}.{part}"
            least_moved = min(least_moved, float((trained[key] - initial[key]).abs().max()))
            errors[key] = float((trained[key] - getattr(layer, part).detach()).abs().max())
    worst = max(errors, key=errors.get)
    print(f"parity RFC {trainer_name} / owai {method}: max |weight diff| {errors[worst]:.1e} ({worst}); "
          f"each tensor moved >= {least_moved:.1e}")
    assert least_moved > 1e-3
    assert errors[worst] <= 1e-9, f"{method}: owai and RFC differ by {errors[worst]:.2e} in {worst} after {STEPS} steps"
