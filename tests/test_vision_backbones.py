"""Image backbones (owai.models.vision): torchvision-compatible names, shapes, counts, loading."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from owai.errors import OwaiError
from owai.models.vision import (
    BACKBONES,
    WEIGHTS,
    build_backbone,
    feature_dim,
    features,
    load_torchvision_weights,
)

BN = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def meta(name: str, **kw) -> torch.nn.Module:
    """Build on the meta device: names, shapes and counts without allocating or initialising."""
    with torch.device("meta"):
        return build_backbone(name, **kw)


def shapes(name: str, **kw) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in meta(name, **kw).state_dict().items()}


@pytest.mark.parametrize(
    ("name", "count"),
    [
        ("resnet18", 11_689_512),
        ("resnet50", 25_557_032),
        ("wide_resnet50_2", 68_883_240),
        ("densenet121", 7_978_856),
        ("vit_b_16", 86_567_656),
        ("vit_l_16", 304_326_632),
    ],
)
def test_parameter_counts_match_torchvision(name, count):
    assert sum(p.numel() for p in meta(name).parameters()) == count


def torchvision_resnet18_keys() -> list[str]:
    """torchvision's resnet18 state-dict keys, from its naming rule (stem, 4 stages x 2 BasicBlocks, fc)."""
    keys = ["conv1.weight", *(f"bn1.{b}" for b in BN)]
    for stage in range(1, 5):
        for block in range(2):
            p = f"layer{stage}.{block}."
            keys += [p + "conv1.weight", *(p + f"bn1.{b}" for b in BN)]
            keys += [p + "conv2.weight", *(p + f"bn2.{b}" for b in BN)]
            if stage > 1 and block == 0:  # stride-2 stages change width: 1x1 conv + BN shortcut
                keys += [p + "downsample.0.weight", *(p + f"downsample.1.{b}" for b in BN)]
    return keys + ["fc.weight", "fc.bias"]


def test_resnet18_keys_are_exactly_torchvision():
    assert list(meta("resnet18").state_dict()) == torchvision_resnet18_keys()
    s = shapes("resnet18")
    assert s["layer2.0.downsample.0.weight"] == (128, 64, 1, 1)
    assert s["fc.weight"] == (1000, 512)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("resnet50", {
            "conv1.weight": (64, 3, 7, 7),
            "layer1.0.downsample.0.weight": (256, 64, 1, 1),
            "layer1.0.downsample.1.num_batches_tracked": (),
            "layer4.2.conv3.weight": (2048, 512, 1, 1),
            "layer3.5.bn2.running_var": (256,),
            "fc.weight": (1000, 2048),
        }),
        ("wide_resnet50_2", {
            "layer1.0.conv1.weight": (128, 64, 1, 1),
            "layer4.2.conv2.weight": (1024, 1024, 3, 3),
            "layer4.2.conv3.weight": (2048, 1024, 1, 1),
            "fc.weight": (1000, 2048),
        }),
        ("wide_resnet50_4", {
            "layer1.0.conv1.weight": (256, 64, 1, 1),
            "layer4.2.conv3.weight": (2048, 2048, 1, 1),
        }),
        ("densenet121", {
            "features.conv0.weight": (64, 3, 7, 7),
            "features.norm0.running_mean": (64,),
            "features.denseblock1.denselayer1.norm1.weight": (64,),
            "features.denseblock1.denselayer1.conv1.weight": (128, 64, 1, 1),
            "features.denseblock1.denselayer1.norm2.num_batches_tracked": (),
            "features.denseblock4.denselayer16.conv2.weight": (32, 128, 3, 3),
            "features.transition1.conv.weight": (128, 256, 1, 1),
            "features.transition3.conv.weight": (512, 1024, 1, 1),
            "features.norm5.weight": (1024,),
            "classifier.weight": (1000, 1024),
        }),
        ("vit_b_16", {
            "class_token": (1, 1, 768),
            "conv_proj.weight": (768, 3, 16, 16),
            "conv_proj.bias": (768,),
            "encoder.pos_embedding": (1, 197, 768),
            "encoder.layers.encoder_layer_0.ln_1.weight": (768,),
            "encoder.layers.encoder_layer_11.self_attention.in_proj_weight": (2304, 768),
            "encoder.layers.encoder_layer_11.self_attention.in_proj_bias": (2304,),
            "encoder.layers.encoder_layer_11.self_attention.out_proj.weight": (768, 768),
            "encoder.layers.encoder_layer_11.self_attention.out_proj.bias": (768,),
            "encoder.layers.encoder_layer_11.ln_2.bias": (768,),
            "encoder.layers.encoder_layer_11.mlp.0.weight": (3072, 768),
            "encoder.layers.encoder_layer_11.mlp.3.weight": (768, 3072),
            "encoder.ln.weight": (768,),
            "heads.head.weight": (1000, 768),
        }),
        ("vit_l_16", {
            "encoder.pos_embedding": (1, 197, 1024),
            "encoder.layers.encoder_layer_23.self_attention.in_proj_weight": (3072, 1024),
            "encoder.layers.encoder_layer_23.mlp.3.bias": (1024,),
            "heads.head.bias": (1000,),
        }),
    ],
)
def test_characteristic_keys_and_shapes(name, expected):
    s = shapes(name)
    for key, shape in expected.items():
        assert s.get(key) == shape, key


def test_densenet121_and_vit_key_layout_is_complete():
    s = shapes("densenet121")
    blocks = {k.split(".")[1] for k in s if k.startswith("features.denseblock")}
    assert blocks == {f"denseblock{i}" for i in range(1, 5)}
    for i, n in enumerate((6, 12, 24, 16), 1):
        layers = {k.split(".")[2] for k in s if k.startswith(f"features.denseblock{i}.")}
        assert layers == {f"denselayer{j}" for j in range(1, n + 1)}
    assert not any("transition4" in k for k in s)
    per_layer = sorted(k.split("encoder_layer_0.")[1] for k in shapes("vit_b_16") if ".encoder_layer_0." in k)
    assert per_layer == sorted([
        "ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias",
        "self_attention.in_proj_weight", "self_attention.in_proj_bias",
        "self_attention.out_proj.weight", "self_attention.out_proj.bias",
        "mlp.0.weight", "mlp.0.bias", "mlp.3.weight", "mlp.3.bias",
    ])
    assert [k for k in shapes("vit_b_16") if "encoder_layer" not in k] == [
        "class_token", "conv_proj.weight", "conv_proj.bias", "encoder.pos_embedding",
        "encoder.ln.weight", "encoder.ln.bias", "heads.head.weight", "heads.head.bias",
    ]


def test_head_replacement_keeps_names_and_vit_image_size():
    assert shapes("resnet50", num_classes=7)["fc.weight"] == (7, 2048)
    assert shapes("densenet121", num_classes=7)["classifier.bias"] == (7,)
    s = shapes("vit_b_16", num_classes=7, image_size=32)
    assert s["heads.head.weight"] == (7, 768)
    assert s["encoder.pos_embedding"] == (1, 5, 768)


def test_registry_and_weights_table():
    with pytest.raises(OwaiError, match="known: .*resnet50"):
        build_backbone("resnet51")
    assert set(WEIGHTS) <= set(BACKBONES)
    assert WEIGHTS["resnet50"]["IMAGENET1K_V1"].endswith("resnet50-0676ba61.pth")
    assert WEIGHTS["resnet50"]["IMAGENET1K_V2"].endswith("resnet50-11ad3fa6.pth")


@pytest.mark.parametrize(("name", "dim"), [("resnet18", 512), ("resnet50", 2048), ("densenet121", 1024)])
def test_forward_shapes_cnn(name, dim):
    torch.manual_seed(0)
    model = build_backbone(name, num_classes=10).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert model(x).shape == (1, 10)
        f = features(model, x)
    assert feature_dim(model) == dim
    assert f.shape == (1, dim)
    assert torch.allclose(model.fc(f) if hasattr(model, "fc") else model.classifier(f), model(x), atol=1e-5)


def test_forward_shapes_vit():
    torch.manual_seed(0)
    model = build_backbone("vit_b_16", num_classes=10, image_size=32).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert model(x).shape == (1, 10)
        assert features(model, x).shape == (1, 768)
    assert feature_dim(model) == 768
    with pytest.raises(OwaiError, match="32x32"):
        features(model, torch.randn(1, 3, 48, 48))


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_round_trip_and_errors(tmp_path, suffix):
    torch.manual_seed(0)
    src = build_backbone("resnet18", num_classes=5)
    with torch.no_grad():  # non-trivial BN statistics so that the buffers matter in eval mode
        for m in src.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    src.eval()
    state = {k: v.contiguous() for k, v in src.state_dict().items()}
    path = tmp_path / f"resnet18{suffix}"
    save = (lambda s, p: save_file(s, str(p))) if suffix == ".safetensors" else torch.save
    save(state, path)

    torch.manual_seed(1)
    dst = build_backbone("resnet18", num_classes=5)
    load_torchvision_weights(dst, path)
    dst.eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(dst(x), src(x))

    broken = dict(state)
    del broken["layer3.1.bn2.running_var"]
    bad = tmp_path / f"missing{suffix}"
    save(broken, bad)
    with pytest.raises(OwaiError, match=r"missing keys \(1\): layer3\.1\.bn2\.running_var"):
        load_torchvision_weights(dst, bad)

    extra = {**state, "fc.extra": torch.zeros(1)}
    save(extra, bad)
    with pytest.raises(OwaiError, match="unexpected keys .*fc.extra"):
        load_torchvision_weights(dst, bad)

    wrong = {**state, "fc.weight": torch.zeros(7, 512)}
    save(wrong, bad)
    with pytest.raises(OwaiError, match="shape mismatch .*fc.weight"):
        load_torchvision_weights(dst, bad)

    corrupt = tmp_path / f"corrupt{suffix}"
    corrupt.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(OwaiError, match="cannot read|corrupt or truncated"):
        load_torchvision_weights(dst, corrupt)
    with pytest.raises(OwaiError, match="not found"):
        load_torchvision_weights(dst, tmp_path / f"absent{suffix}")


def test_legacy_key_spellings_load(tmp_path):
    """Old official files: DenseNet `norm.1`, ViT `mlp.linear_1`, and no BatchNorm counters. (The ViT
    is vit_mini_4: ViT-B/16's class and module names, 0.8M parameters instead of 86M to build and save.)"""
    torch.manual_seed(0)
    src = build_backbone("vit_mini_4", num_classes=3, image_size=32)
    legacy = {k.replace("mlp.0.", "mlp.linear_1.").replace("mlp.3.", "mlp.linear_2."): v
              for k, v in src.state_dict().items()}
    torch.save(legacy, tmp_path / "vit.pth")
    dst = build_backbone("vit_mini_4", num_classes=3, image_size=32)
    load_torchvision_weights(dst, tmp_path / "vit.pth")
    assert all(torch.equal(a, b) for a, b in zip(dst.state_dict().values(), src.state_dict().values()))

    torch.manual_seed(0)
    src = build_backbone("densenet121", num_classes=3)
    old = {}
    for k, v in src.state_dict().items():
        if k.endswith("num_batches_tracked"):
            continue  # 2017 files predate BatchNorm's counter
        if ".denselayer" in k:
            for part in ("norm1", "norm2", "conv1", "conv2"):
                k = k.replace(f".{part}.", f".{part[:-1]}.{part[-1]}.")
        old[k] = v
    assert "features.denseblock1.denselayer1.norm.1.weight" in old
    torch.save(old, tmp_path / "densenet.pth")
    dst = build_backbone("densenet121", num_classes=3)
    load_torchvision_weights(dst, tmp_path / "densenet.pth")
    assert all(torch.equal(a, b) for a, b in zip(dst.state_dict().values(), src.state_dict().values()))
