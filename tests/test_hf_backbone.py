"""Hugging Face image backbones (owai.models.hf_vision), resnet50_w5, and SwAV-style checkpoint loading.

Tiny RegNet / ViT checkpoints are built and saved locally (no hub): shapes, widths, the
re-normalisation to the checkpoint's own mean/std, the class token, interpolated position
encodings, gradients, and the one-line errors.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from owai.errors import OwaiError
from owai.models.hf_vision import HFImageBackbone, check_hf_source, hf_source, is_hf_source

pytestmark = pytest.mark.usefixtures("one_thread")

IN_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
IN_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny RegNet (no preprocessor_config.json: ImageNet stats) and ViT (mean/std 0.5) checkpoints."""
    from transformers import RegNetConfig, RegNetModel, ViTConfig, ViTModel
    from transformers.utils import logging as tlog

    root = tmp_path_factory.mktemp("hf")
    bar = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    torch.manual_seed(0)
    regnet = RegNetModel(RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8,
                                      layer_type="y"))
    regnet.save_pretrained(root / "regnet")
    vit = ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                             image_size=32, patch_size=8))  # with its tanh pooler, which the backbone ignores
    vit.save_pretrained(root / "vit")
    (root / "vit" / "preprocessor_config.json").write_text(
        json.dumps({"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_normalize": True}))
    if bar:
        tlog.enable_progress_bar()
    return {"regnet": root / "regnet", "vit": root / "vit"}


def raw_model(path: Path) -> torch.nn.Module:
    """The checkpoint loaded directly with AutoModel, in eval mode."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(path), local_files_only=True).eval()


def imagenet_batch(size: int, b: int = 2) -> torch.Tensor:
    """ImageNet-normalised images of pixels in [0, 1], like owai's data pipeline produces."""
    g = torch.Generator().manual_seed(1)
    return (torch.rand(b, 3, size, size, generator=g) - IN_MEAN) / IN_STD


@pytest.mark.parametrize(("name", "width"), [("regnet", 16), ("vit", 32)])
def test_features_shape_and_width(checkpoints, name, width):
    backbone = HFImageBackbone(str(checkpoints[name]))
    config = json.loads((checkpoints[name] / "config.json").read_text())
    assert backbone.feature_dim == width == (config["hidden_sizes"][-1] if name == "regnet" else config["hidden_size"])
    assert backbone(imagenet_batch(32, b=3)).shape == (3, width)
    assert str(checkpoints[name]) in backbone.describe()


def test_regnet_is_the_pooler_output_with_imagenet_stats(checkpoints):
    backbone = HFImageBackbone(str(checkpoints["regnet"])).eval()
    # no preprocessor_config.json: the checkpoint expects ImageNet normalisation, so the input passes unchanged
    assert torch.allclose(backbone.scale, torch.ones(1, 3, 1, 1))
    assert torch.allclose(backbone.shift, torch.zeros(1, 3, 1, 1))
    assert "scale" not in backbone.state_dict() and "shift" not in backbone.state_dict()
    x = imagenet_batch(32)
    with torch.no_grad():
        expected = raw_model(checkpoints["regnet"])(pixel_values=x).pooler_output  # (B, C, 1, 1)
        got = backbone(x)
    assert expected.shape == (2, 16, 1, 1)
    torch.testing.assert_close(got, expected.flatten(1), rtol=1e-5, atol=1e-6)


def test_vit_is_the_class_token_of_the_renormalised_input(checkpoints):
    backbone = HFImageBackbone(str(checkpoints["vit"])).eval()
    assert not any("pooler" in n for n, _ in backbone.named_parameters())  # built without the tanh pooler
    raw = raw_model(checkpoints["vit"])
    x = imagenet_batch(32)
    x_model = (x * IN_STD + IN_MEAN - 0.5) / 0.5  # pixels in [0, 1] -> the checkpoint's mean/std 0.5
    with torch.no_grad():
        got = backbone(x)
        expected = raw(pixel_values=x_model).last_hidden_state[:, 0]
        unnormalised = raw(pixel_values=x).last_hidden_state[:, 0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, unnormalised, atol=1e-3)  # the re-normalisation matters


def test_input_normalised_with_other_statistics_reaches_the_checkpoint_as_its_own(checkpoints):
    """CIFAR images under rich-features' thesis transforms carry CIFAR's statistics: given them, the
    backbone still feeds the checkpoint its own preprocessing (mean / std 0.5 for this ViT)."""
    from owai.data.images import CIFAR_MEAN, CIFAR_STD

    mean, std = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
    backbone = HFImageBackbone(str(checkpoints["vit"]), input_mean=CIFAR_MEAN, input_std=CIFAR_STD).eval()
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = backbone((pixels - mean) / std)
        expected = raw_model(checkpoints["vit"])(pixel_values=(pixels - 0.5) / 0.5).last_hidden_state[:, 0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_vit_at_another_input_size_interpolates_position_encodings(checkpoints):
    """Images of a size the backbone was not built for: transformers' bicubic interpolation at every
    forward, as the checkpoint itself would do."""
    backbone = HFImageBackbone(str(checkpoints["vit"])).eval()
    x = imagenet_batch(48)
    with torch.no_grad():
        got = backbone(x)
        raw = raw_model(checkpoints["vit"])
        expected = raw(pixel_values=(x * IN_STD + IN_MEAN - 0.5) / 0.5, interpolate_pos_encoding=True)
    assert got.shape == (2, 32)
    torch.testing.assert_close(got, expected.last_hidden_state[:, 0], rtol=1e-4, atol=1e-5)
    with pytest.raises(OwaiError, match="multiple of the patch size 8"):
        HFImageBackbone(str(checkpoints["vit"]), image_size=44)
    with pytest.raises(OwaiError, match="multiple of the patch size 8"):
        check_hf_source(str(checkpoints["vit"]), image_size=44)


def test_the_position_grid_is_resized_as_scipys_linear_zoom():
    """RRL (and the original ViT code) resize a 224-px ViT's grid to 384 px with
    scipy.ndimage.zoom(order=1); resize_position_grid keeps the class / distillation tokens and
    zooms the grid the same way, up and down."""
    ndimage = pytest.importorskip("scipy.ndimage")
    from owai.models.hf_vision import resize_position_grid

    g = torch.Generator().manual_seed(0)
    for prefix, old, new in ((1, 4, 6), (2, 14, 24), (1, 24, 14), (1, 5, 5)):
        positions = torch.randn(1, prefix + old * old, 16, generator=g)
        got = resize_position_grid(positions, prefix, new)
        grid = positions[0, prefix:].reshape(old, old, 16).numpy()
        expected = ndimage.zoom(grid, (new / old, new / old, 1), order=1).reshape(1, new * new, 16)
        assert got.shape == (1, prefix + new * new, 16)
        assert torch.equal(got[:, :prefix], positions[:, :prefix])
        torch.testing.assert_close(got[:, prefix:], torch.from_numpy(expected), rtol=0, atol=1e-6)
    with pytest.raises(OwaiError, match="no square grid"):
        resize_position_grid(torch.zeros(1, 1 + 15, 4), 1, 6)


def test_a_vit_built_for_another_resolution_trains_its_resized_grid(checkpoints):
    """Given image_size, a ViT is rebuilt once for it (RRL's Figure 2.4 at 384 px): the grid is the
    checkpoint's zoomed, every other weight the checkpoint's, the forward at that size reads the new
    grid directly (no interpolation), and fine-tuning sends gradients into the new grid."""
    from transformers import ViTModel

    from owai.models.hf_vision import POSITIONS, resize_position_grid

    backbone = HFImageBackbone(str(checkpoints["vit"]), image_size=48)
    raw = raw_model(checkpoints["vit"])
    state = raw.state_dict()
    assert backbone.model.config.image_size == 48 and backbone.native_size == 48
    positions = backbone.model.state_dict()[POSITIONS]
    assert positions.shape == (1, 1 + 6 * 6, 32)
    assert torch.equal(positions, resize_position_grid(state[POSITIONS], 1, 6))
    assert all(torch.equal(v, state[k]) for k, v in backbone.model.state_dict().items() if k != POSITIONS)
    x = imagenet_batch(48)
    backbone.eval()
    with torch.no_grad():
        reference = ViTModel(backbone.model.config, add_pooling_layer=False).eval()
        reference.load_state_dict({**{k: v for k, v in state.items() if not k.startswith("pooler.")},
                                   POSITIONS: positions})
        expected = reference(pixel_values=(x * IN_STD + IN_MEAN - 0.5) / 0.5).last_hidden_state[:, 0]
        interpolated = raw(pixel_values=(x * IN_STD + IN_MEAN - 0.5) / 0.5,
                           interpolate_pos_encoding=True).last_hidden_state[:, 0]
        got = backbone(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, interpolated, atol=1e-4)  # a different resize than the per-forward one
    backbone.train()
    backbone(x).sum().backward()
    grid = dict(backbone.model.named_parameters())[POSITIONS]
    assert grid.grad is not None and grid.grad.shape == (1, 37, 32) and grid.grad.abs().sum() > 0
    with torch.no_grad():
        assert backbone(imagenet_batch(32)).shape == (2, 32)  # other sizes still interpolate
    regnet = HFImageBackbone(str(checkpoints["regnet"]), image_size=48)  # no position grid: unchanged
    assert all(torch.equal(v, raw_model(checkpoints["regnet"]).state_dict()[k])
               for k, v in regnet.model.state_dict().items())


@pytest.mark.parametrize("name", ["regnet", "vit"])
def test_gradients_reach_every_trainable_parameter(checkpoints, name):
    backbone = HFImageBackbone(str(checkpoints[name]))
    assert backbone.training and backbone.model.training
    backbone(imagenet_batch(32)).sum().backward()
    trainable = [(n, p) for n, p in backbone.named_parameters() if p.requires_grad]
    assert trainable
    assert [n for n, p in trainable if p.grad is None] == []  # no unused parameters (DDP)
    assert any(p.grad.abs().sum() > 0 for _, p in trainable)


def test_missing_config_is_one_line_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    for fn in (HFImageBackbone, check_hf_source):
        with pytest.raises(OwaiError, match="no config.json") as e:
            fn(str(tmp_path))
        assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)


def test_corrupt_weights_are_one_line_error(checkpoints, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((checkpoints["regnet"] / "config.json").read_bytes())
    (bad / "model.safetensors").write_bytes(b"not a safetensors file at all " * 10)
    for fn in (HFImageBackbone, check_hf_source):
        with pytest.raises(OwaiError) as e:
            fn(f"hf:{bad}")
        assert str(bad) in str(e.value) and "\n" not in str(e.value)
    pickled = tmp_path / "pickled"  # a junk pytorch_model.bin: torch.load(weights_only=True) fails
    pickled.mkdir()
    (pickled / "config.json").write_bytes((checkpoints["regnet"] / "config.json").read_bytes())
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x02junk" * 30)
    with pytest.raises(OwaiError, match="corrupt") as e:
        HFImageBackbone(str(pickled))
    assert "\n" not in str(e.value) and "weights_only" not in str(e.value)


def test_checkpoint_of_another_architecture_is_an_error(checkpoints, tmp_path):
    """A RegNet config over ViT weights: the base model's weights are missing, never randomly initialised."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_bytes((checkpoints["regnet"] / "config.json").read_bytes())
    (other / "model.safetensors").write_bytes((checkpoints["vit"] / "model.safetensors").read_bytes())
    with pytest.raises(OwaiError, match="lacks .* weight tensors of the regnet base model"):
        HFImageBackbone(str(other))


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))
    with pytest.raises(OwaiError, match="'bert' is not a supported image backbone"):
        check_hf_source(f"hf:{tmp_path}")


def test_unknown_hub_id_fails_fast_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    for fn in (check_hf_source, HFImageBackbone):
        with pytest.raises(OwaiError, match="not found locally or on the Hugging Face hub") as e:
            fn("hf:owai-no-such-org/no-such-model")
        assert "owai-no-such-org/no-such-model" in str(e.value) and "\n" not in str(e.value)
    assert time.monotonic() - start < 30  # no retries (a loaded machine still answers well within this)


def test_check_passes_local_checkpoints(checkpoints):
    for path in checkpoints.values():
        check_hf_source(f"hf:{path}")


def test_hf_prefix():
    assert is_hf_source("hf:facebook/regnet-y-320-seer") and is_hf_source("hf:/data/vit")
    assert not is_hf_source("/data/swav_800ep.pth") and not is_hf_source("IMAGENET1K_V2")
    assert hf_source("hf:facebook/regnet-y-320-seer") == "facebook/regnet-y-320-seer"
    assert hf_source("hf:/data/vit") == "/data/vit"
    with pytest.raises(OwaiError):
        hf_source("hf:")


def test_resnet50_w5_on_meta():
    from owai.models.vision import BACKBONES, build_backbone, resnet50_w5

    assert "resnet50_w5" in BACKBONES
    with torch.device("meta"):
        model = build_backbone("resnet50_w5", num_classes=1)
    assert model.feature_dim == 10240 and model.fc.in_features == 10240
    count = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("fc."))
    assert count == 586_450_240
    assert "586,450,240" in resnet50_w5.__doc__


def test_swav_style_checkpoint_keeps_exactly_the_backbone(tmp_path):
    """A DataParallel (`module.`) checkpoint with SwAV's projection head and prototypes: only the
    backbone's feature weights come back, with their values."""
    from owai.methods.rich_features import external_features
    from owai.models.rich import strip_head
    from owai.models.vision import build_backbone

    torch.manual_seed(0)
    backbone = strip_head(build_backbone("resnet18", num_classes=1))
    state = {f"module.{k}": v for k, v in backbone.state_dict().items()}
    state["module.projection_head.0.weight"] = torch.randn(16, 512)
    state["module.prototypes.weight"] = torch.randn(8, 16)
    path = tmp_path / "swav_resnet18.pth"
    torch.save(state, path)
    got = external_features("resnet18", path)
    own = backbone.state_dict()
    assert list(got) == list(own)
    assert not any("projection_head" in k or "prototypes" in k or k.startswith("module.") for k in got)
    for k, v in own.items():
        assert torch.equal(got[k], v), k



def test_a_densenet_checkpoint_in_the_older_key_spelling_gives_its_features(tmp_path):
    """densenet121-a639ec97.pth spells `norm.1.weight`: load_torchvision_weights renamed it, the
    features of a checkpoint file (`probe.networks`) refused it as "missing 580 feature keys"."""
    import re

    from owai.methods.rich_features import external_features
    from owai.models.rich import strip_head
    from owai.models.vision import build_backbone

    torch.manual_seed(0)
    own = strip_head(build_backbone("densenet121", num_classes=1)).state_dict()
    # norm1 -> norm.1 (and conv, relu), inside a DataParallel `module.` prefix
    legacy = {re.sub(r"(denselayer\d+\.(?:norm|relu|conv))([12])\.", r"\1.\2.", f"module.{k}"): v for k, v in own.items()}
    assert any(".norm.1.weight" in k for k in legacy)
    path = tmp_path / "densenet121-old.pth"
    torch.save(legacy, path)
    got = external_features("densenet121", path)
    assert list(got) == list(own) and all(torch.equal(got[k], own[k]) for k in own)

# -- through `owai rich-features`: checkpoints from elsewhere as the n networks ------------------

RICH = [
    "data.base=mnist-t10k", "data.target=mnist-t10k", "data.limit_per_class=6", "data.image_size=32",
    "data.eval_batch_size=64", 'data.target_classes=["5","6","7"]',
    "probe.epochs=1", "probe.milestones=[]", "probe.batch_size=8", "probe.checkpoint_every=2", "probe.log_every=2",
    "probe.baselines=[]", "finetune.epochs=0.5", "finetune.batch_size=6", "finetune.checkpoint_every=2",
    "finetune.log_every=2",
]


def _rich(args: list[str], capsys) -> tuple[int, str, str]:
    from conftest import as_sets, cli_in_process

    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "tableA.6-seer.yaml")
    return cli_in_process(["rich-features", "-r", recipe, "-p", "cpu", *as_sets(RICH), *args, "-q"], capsys)


def test_rich_features_probes_and_fine_tunes_hf_checkpoints_of_different_widths(checkpoints, tmp_path, capsys):
    """SEER's Cat_n joins networks of different sizes: a RegNet (16-d) and a ViT (32-d) from local
    Hugging Face directories, and a `BACKBONE:PATH` checkpoint file; probe, finetune and two-stage."""
    from owai.models.vision import build_backbone

    torch.manual_seed(0)
    resnet = build_backbone("resnet18", num_classes=7).state_dict()
    torch.save({f"module.{k}": v for k, v in resnet.items()}, tmp_path / "r18.pth")
    weights = f'["hf:{checkpoints["regnet"]}", "hf:{checkpoints["vit"]}", "resnet18:{tmp_path / "r18.pth"}"]'
    rc, _, err = _rich(["--stage", "probe,finetune,two-stage", "--set", "probe.n=3", "--set", "probe.sizes=[1,2,3]",
                        "--set", f"probe.weights={weights}", "-o", str(tmp_path / "runs")], capsys)
    assert rc == 0, err
    run_dir = next((tmp_path / "runs" / "tableA.6-seer").iterdir())
    results = json.loads((run_dir / "results.json").read_text())
    measured = {r["metric"]: r["measured"] for r in results["rows"]}
    assert {"cat1.acc", "cat2.acc", "cat3.acc", "ft.cat3.acc", "two_stage.cat3.acc"} <= set(measured)
    assert results["details"]["feature_dims"] == [16, 32, 512]


def test_distilling_networks_of_different_widths_is_one_line(checkpoints, tmp_path, capsys):
    weights = f'["hf:{checkpoints["regnet"]}", "hf:{checkpoints["vit"]}"]'
    rc, _, err = _rich(["--stage", "distill,probe", "--set", "probe.n=2", "--set", "probe.sizes=[1,2]",
                        "--set", f"probe.weights={weights}", "-o", str(tmp_path)], capsys)
    assert rc != 0 and "different feature sizes" in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_a_missing_hf_directory_in_probe_weights_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, _, err = _rich(["--stage", "probe", "--set", "probe.n=1", "--set", "probe.sizes=[1]",
                        "--set", f'probe.weights=["hf:{tmp_path / "nowhere"}"]', "-o", str(tmp_path / "runs")], capsys)
    assert rc != 0 and "nowhere" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_an_n_that_does_not_match_the_checkpoints_given_is_one_line(checkpoints, tmp_path, capsys):
    rc, _, err = _rich(["--stage", "probe", "--set", "probe.n=3", "--set", "probe.sizes=[1,2]",
                        "--set", f'probe.weights=["hf:{checkpoints["regnet"]}", "hf:{checkpoints["vit"]}"]',
                        "-o", str(tmp_path)], capsys)
    assert rc != 0 and "probe.n=3 but 2 checkpoint files given" in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())
