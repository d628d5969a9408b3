"""Checks of the image backbones and rich-representation blocks that a mutation audit found unpinned:
owai.models.vision, owai.models.rich, owai.models.hf_vision.

The existing tests pin torchvision's key names, shapes and parameter counts, which a wrong forward
(a stride on the wrong convolution, a missing ReLU, max- instead of average-pooling) keeps intact.
Here the ResNet and DenseNet forwards are compared with torchvision's forward written out in
`torch.nn.functional` from the model's own tensors (torchvision/models/resnet.py, densenet.py; the ViT's
is test_named_weights' timm comparison), and the settings that change no shape (init, attention heads,
LayerNorm eps, frozen parameters, optimizer groups, a checkpoint's preprocessing) are checked against the
docstrings and the official code; no expected value comes from owai's own output. Tiny networks and
inputs only: the whole file runs in seconds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from owai.models.vision import (
    BasicBlock,
    Bottleneck,
    DenseNet,
    ResNet,
    build_backbone,
    features,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: spinning threads crawl on a shared CPU


def _randomise_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BatchNorm / LayerNorm affine parameters and BN running statistics, so that every
    normalisation matters in eval mode; returns the model in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
                m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))
    return model.eval()


def _bn(x: Tensor, s: dict[str, Tensor], p: str) -> Tensor:
    """Eval-mode BatchNorm2d from the state dict's tensors under prefix `p` (eps 1e-5, PyTorch's default)."""
    return F.batch_norm(x, s[p + "running_mean"], s[p + "running_var"], s[p + "weight"], s[p + "bias"],
                        training=False, eps=1e-5)


def _resnet_reference(s: dict[str, Tensor], x: Tensor, stem: str = "imagenet") -> Tensor:
    """torchvision's ResNet.forward up to the pooled features, from the state dict `s`: conv1 (7x7/2, pad 3;
    the CIFAR stem 3x3/1, pad 1, and no max-pool) - bn1 - relu - maxpool 3x3/2 pad 1 - layer1..4 (stride
    1, 2, 2, 2 on each stage's first block) - adaptive AVERAGE pool. BasicBlock: relu(bn1(conv1 3x3/s)) -
    bn2(conv2 3x3/1); Bottleneck (v1.5): relu(bn1(conv1 1x1/1)) - relu(bn2(conv2 3x3/s)) - bn3(conv3 1x1);
    the shortcut downsample = BN(conv 1x1/s) when present; the block's output relu(out + identity)."""
    if stem == "cifar":
        x = F.relu(_bn(F.conv2d(x, s["conv1.weight"], stride=1, padding=1), s, "bn1."))
    else:
        x = F.relu(_bn(F.conv2d(x, s["conv1.weight"], stride=2, padding=3), s, "bn1."))
        x = F.max_pool2d(x, 3, 2, 1)
    for stage in range(1, 5):
        j = 0
        while f"layer{stage}.{j}.conv1.weight" in s:
            p = f"layer{stage}.{j}."
            stride = 2 if stage > 1 and j == 0 else 1
            identity = x
            if p + "downsample.0.weight" in s:
                identity = _bn(F.conv2d(x, s[p + "downsample.0.weight"], stride=stride), s, p + "downsample.1.")
            if p + "conv3.weight" in s:  # Bottleneck, the stride on the 3x3
                out = F.relu(_bn(F.conv2d(x, s[p + "conv1.weight"]), s, p + "bn1."))
                out = F.relu(_bn(F.conv2d(out, s[p + "conv2.weight"], stride=stride, padding=1), s, p + "bn2."))
                out = _bn(F.conv2d(out, s[p + "conv3.weight"]), s, p + "bn3.")
            else:  # BasicBlock, the stride on the first 3x3
                out = F.relu(_bn(F.conv2d(x, s[p + "conv1.weight"], stride=stride, padding=1), s, p + "bn1."))
                out = _bn(F.conv2d(out, s[p + "conv2.weight"], padding=1), s, p + "bn2.")
            x = F.relu(out + identity)
            j += 1
    return F.adaptive_avg_pool2d(x, 1).flatten(1)


@pytest.mark.parametrize(("block", "stem", "size"), [(Bottleneck, "imagenet", 64), (BasicBlock, "imagenet", 64),
                                                     (BasicBlock, "cifar", 16)])
def test_resnet_features_are_torchvisions_forward(block, stem, size):
    """A ResNet's features are torchvision's function of its tensors: ResNet-50's v1.5 Bottleneck (the
    stride on the 3x3, not the 1x1 of v1), a ReLU after every residual add, the strided 1x1 + BN shortcut,
    global average pooling, and the CIFAR stem (3x3/1, no max-pool). Official checkpoints loading with
    strict=True is worth nothing if the function they compute differs; key and shape checks cannot see it."""
    torch.manual_seed(0)
    model = _randomise_norms(ResNet(block, (2, 1, 1, 1), num_classes=3, stem=stem))
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = _resnet_reference(model.state_dict(), x, stem)
        torch.testing.assert_close(features(model, x), expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model(x), F.linear(expected, model.fc.weight, model.fc.bias), rtol=1e-4, atol=1e-5)


def test_a_fresh_resnet_is_initialised_as_torchvisions_default():
    """torchvision's ResNet(zero_init_residual=False), the default of every official builder: every
    BatchNorm's weight 1 and bias 0 (no zero-initialised last BN of a residual branch), convolutions
    kaiming_normal_(fan_out, relu), so a block's output is not the identity at initialisation."""
    torch.manual_seed(0)
    for name in ("resnet18", "resnet50"):
        model = build_backbone(name, 3)
        for mod_name, m in model.named_modules():
            if isinstance(m, nn.BatchNorm2d):
                assert torch.equal(m.weight, torch.ones_like(m.weight)), mod_name
                assert torch.equal(m.bias, torch.zeros_like(m.bias)), mod_name
    w = build_backbone("resnet50", 3).conv1.weight  # (64, 3, 7, 7): fan_out 64 * 49, fan_in 3 * 49
    assert abs(w.std().item() - (2.0 / (64 * 49)) ** 0.5) < 0.05 * (2.0 / (64 * 49)) ** 0.5


# name: (feature width, conv1 kernel and stride, max-pool) from each builder's docstring; ViTs: (width,
# patch, layers, heads) as torchvision's vit_b_16 / vit_l_16 and vit_mini_4's docstring give them
CNNS = {
    "resnet18": (512, 7, 2, True), "resnet50": (2048, 7, 2, True), "resnet152": (2048, 7, 2, True),
    "resnet18_w2": (1024, 7, 2, True), "resnet18_w4": (2048, 7, 2, True),
    "resnet18_cifar": (512, 3, 1, False), "resnet18_cifar_w2": (1024, 3, 1, False),
    "resnet18_cifar_w4": (2048, 3, 1, False), "resnet50_w2": (4096, 7, 2, True), "resnet50_w4": (8192, 7, 2, True),
    "resnet50_w5": (10240, 7, 2, True), "wide_resnet50_2": (2048, 7, 2, True), "wide_resnet50_4": (2048, 7, 2, True),
}
VITS = {"vit_b_16": (768, 16, 12, 12), "vit_l_16": (1024, 16, 24, 16), "vit_mini_4": (128, 4, 4, 4)}


def test_every_registry_entry_builds_its_documented_network():
    """Each name of the BACKBONES registry builds the network its builder's docstring describes: the
    feature width, the stem (CIFAR: conv1 3x3/1 and no max-pool; ImageNet: 7x7/2 and a max-pool), and for
    a ViT its patch, depth and number of attention heads (ViT-B/16: 12 heads, ViT-L/16: 16, which leave
    every shape unchanged, so no key or shape check sees a wrong one)."""
    from owai.models.vision import BACKBONES

    assert set(BACKBONES) == set(CNNS) | set(VITS) | {"densenet121"}
    with torch.device("meta"):
        for name, (dim, kernel, stride, pool) in CNNS.items():
            net = build_backbone(name, 1)
            assert net.feature_dim == dim and net.fc.in_features == dim, name
            assert net.conv1.kernel_size == (kernel, kernel) and net.conv1.stride == (stride, stride), name
            assert isinstance(net.maxpool, nn.MaxPool2d) == pool, name
        assert build_backbone("densenet121", 1).feature_dim == 1024
        for name, (dim, patch, layers, heads) in VITS.items():
            net = build_backbone(name, 1)
            blocks = list(net.encoder.layers)
            assert (net.feature_dim, net.patch_size, len(blocks)) == (dim, patch, layers), name
            assert all(b.self_attention.num_heads == heads and b.self_attention.batch_first for b in blocks), name


def test_every_vit_layer_norm_has_torchvisions_eps():
    """torchvision's VisionTransformer builds every LayerNorm (ln_1, ln_2 of each block and the encoder's
    final ln) as partial(nn.LayerNorm, eps=1e-6), as do timm's ViTs and the original JAX code; PyTorch's
    default 1e-5 changes the function an official checkpoint computes. The final LayerNorm reads the
    residual stream at its largest, where a wrong eps stays within the feature tolerance of
    test_named_weights' timm comparison: hence this check of the modules themselves."""
    with torch.device("meta"):
        for name in VITS:
            norms = [m for m in build_backbone(name, 1).modules() if isinstance(m, nn.LayerNorm)]
            assert len(norms) == 2 * VITS[name][2] + 1, name
            assert all(m.eps == 1e-6 for m in norms), name


def _densenet_reference(s: dict[str, Tensor], x: Tensor, blocks: tuple[int, ...]) -> Tensor:
    """torchvision's DenseNet.forward up to the pooled features: conv0 7x7/2 pad 3 - norm0 - relu -
    maxpool 3x3/2 pad 1; dense layer = conv2(relu(norm2(conv1(relu(norm1(cat(inputs))))))), 3x3 pad 1,
    concatenated to its input; transition = avg_pool2d(conv(relu(norm(x))), 2, 2); then norm5, ReLU,
    adaptive average pool."""
    f = "features."
    x = F.max_pool2d(F.relu(_bn(F.conv2d(x, s[f + "conv0.weight"], stride=2, padding=3), s, f + "norm0.")), 3, 2, 1)
    for i, n in enumerate(blocks, 1):
        feats = [x]
        for j in range(1, n + 1):
            p = f"{f}denseblock{i}.denselayer{j}."
            h = F.conv2d(F.relu(_bn(torch.cat(feats, 1), s, p + "norm1.")), s[p + "conv1.weight"])
            feats.append(F.conv2d(F.relu(_bn(h, s, p + "norm2.")), s[p + "conv2.weight"], padding=1))
        x = torch.cat(feats, 1)
        if i < len(blocks):
            p = f"{f}transition{i}."
            x = F.avg_pool2d(F.conv2d(F.relu(_bn(x, s, p + "norm.")), s[p + "conv.weight"]), 2, 2)
    x = F.relu(_bn(x, s, f"{f}norm{len(blocks) + 1}."))
    return F.adaptive_avg_pool2d(x, 1).flatten(1)


def test_densenet_features_are_torchvisions_forward():
    """DenseNet-BC's features are torchvision's function of its tensors: BN-ReLU-1x1-BN-ReLU-3x3 dense
    layers, transitions that AVERAGE-pool 2x2 after a BN-ReLU-1x1 that halves the channels, and the final
    norm5 followed by a ReLU before the global average pool (torchvision's forward applies F.relu there)."""
    torch.manual_seed(0)
    blocks = (2, 3, 2)
    model = _randomise_norms(DenseNet(growth_rate=4, block_config=blocks, num_init_features=8, bn_size=2,
                                      num_classes=3))
    assert model.feature_dim == ((8 + 2 * 4) // 2 + 3 * 4) // 2 + 2 * 4  # transitions halve the channels
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(features(model, x), _densenet_reference(model.state_dict(), x, blocks),
                                   rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------- owai.models.rich


def _tiny_backbone(seed: int, d_out: int = 4) -> nn.Module:
    """(B, 3, 2, 2) images -> (B, d_out) features through a Linear and a BatchNorm1d."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, d_out), nn.BatchNorm1d(d_out))
    net.feature_dim = d_out
    return net


def test_frozen_cat_backbones_do_not_require_gradients():
    """ConcatFeatures(frozen=True)'s docstring: the backbones' parameters get requires_grad=False (not only
    no_grad features), so an optimizer built over the whole model, or a weight-decay step, never sees them
    as trainable; the unfrozen Cat_n ("[init]cat" fine-tuning) keeps every parameter trainable."""
    from owai.models.rich import ConcatFeatures

    frozen = ConcatFeatures([_tiny_backbone(0), _tiny_backbone(1)], frozen=True)
    assert not any(p.requires_grad for p in frozen.parameters())
    trainable = ConcatFeatures([_tiny_backbone(2), _tiny_backbone(3)])
    assert all(p.requires_grad for p in trainable.parameters())


def test_probe_weight_decay_applies_to_the_linear_only():
    """ProbeHead.param_groups (`wd_skip_bn`, spec §6.2): the decayed group holds the Linear's weight and
    bias and nothing else; the BN's affine parameters sit in the undecayed group only (a parameter in
    both would be decayed, and torch.optim refuses a parameter listed twice)."""
    from owai.models.rich import ProbeHead

    probe = ProbeHead(6, 3)
    decayed, free = probe.param_groups(1e-3)
    assert {id(p) for p in decayed["params"]} == {id(probe.linear.weight), id(probe.linear.bias)}
    assert {id(p) for p in free["params"]} == {id(probe.bn.weight), id(probe.bn.bias)}
    torch.optim.SGD(probe.param_groups(1e-3), lr=0.1)  # every parameter in exactly one group


def test_feature_distillation_sends_no_gradient_to_the_teachers():
    """feature_distill_loss's docstring: teacher_features[i] = phi_i(x) is detached (the teachers are
    fixed, TH A.3.3); only the student's outputs receive a gradient."""
    from owai.models.rich import feature_distill_loss

    g = torch.Generator().manual_seed(0)
    s = torch.randn(4, 3, generator=g, requires_grad=True)
    t = torch.randn(4, 3, generator=g, requires_grad=True)
    feature_distill_loss([s], [t]).backward()
    assert s.grad is not None and s.grad.abs().sum() > 0
    assert t.grad is None


def test_simsiam_heads_are_chen_and_hes():
    """SimSiam's docstring (Chen & He 2021's code): projector blocks Linear (no bias) -> BN -> ReLU, its
    last block Linear (no bias) -> BN WITHOUT affine parameters and no ReLU; predictor Linear (no bias)
    -> BN -> ReLU -> Linear (with bias)."""
    from owai.models.rich import SimSiam

    net = SimSiam(_tiny_backbone(0, d_out=6), dim=10, pred_dim=4, proj_layers=3)
    kinds = [type(m) for m in net.projector]
    assert kinds == [nn.Linear, nn.BatchNorm1d, nn.ReLU] * 2 + [nn.Linear, nn.BatchNorm1d]
    assert all(m.bias is None for m in net.projector if isinstance(m, nn.Linear))
    assert [m.affine for m in net.projector if isinstance(m, nn.BatchNorm1d)] == [True, True, False]
    assert [type(m) for m in net.predictor] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    assert net.predictor[0].bias is None and net.predictor[3].bias is not None and net.predictor[1].affine


# ---------------------------------------------------------------------------- owai.models.hf_vision


@pytest.mark.parametrize(("processor", "to_model"), [
    # transformers' image processors: x = pixels255 * rescale_factor (if do_rescale), then (x - mean) / std
    # (if do_normalize); owai's images are pixels in [0, 1] normalised with ImageNet's statistics
    ({"do_rescale": False, "image_mean": [127.5] * 3, "image_std": [127.5] * 3}, lambda p: (255.0 * p - 127.5) / 127.5),
    ({"rescale_factor": 1 / 127.5, "image_mean": [1.0] * 3, "image_std": [1.0] * 3}, lambda p: p * 255.0 / 127.5 - 1.0),
    ({"do_normalize": False}, lambda p: p),
], ids=["no-rescale", "rescale-to-2", "no-normalize"])
def test_hf_backbone_feeds_the_checkpoint_its_own_preprocessing(tmp_path, processor, to_model):
    """HFImageBackbone's docstring: a checkpoint always sees its own preprocessing. Pixels p in [0, 1]
    reach it as its preprocessor_config.json makes them from 8-bit pixels 255 p: times rescale_factor
    (1 / 255 by default; 1 without do_rescale), minus image_mean, over image_std (neither without
    do_normalize). With the default 1 / 255 the gain 255 * rescale is 1, so only these configurations show
    whether the gain and the do_normalize switch are applied."""
    import json

    from transformers import AutoModel, ViTConfig, ViTModel
    from transformers.utils import logging as tlog

    from owai.models.hf_vision import HFImageBackbone

    torch.manual_seed(0)
    bar = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    try:
        ViTModel(ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                           image_size=16, patch_size=8)).save_pretrained(tmp_path)
        raw = AutoModel.from_pretrained(str(tmp_path), local_files_only=True).eval()
    finally:
        if bar:
            tlog.enable_progress_bar()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(processor))
    backbone = HFImageBackbone(str(tmp_path)).eval()
    pixels = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)  # ImageNet's statistics
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.no_grad():
        got = backbone((pixels - mean) / std)
        expected = raw(pixel_values=to_model(pixels)).last_hidden_state[:, 0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_a_dinov2_backbone_trains_every_parameter_it_keeps_trainable(tmp_path):
    """HFImageBackbone's docstring: mask tokens (never used: no masking is asked for) get
    requires_grad=False, so every trainable parameter receives a gradient (DDP refuses unused ones).
    DINOv2's embeddings always hold a mask_token (ViT's only with use_mask_token), so a DINOv2 checkpoint
    is where this shows."""
    from transformers import Dinov2Config, Dinov2Model

    from owai.models.hf_vision import HFImageBackbone

    torch.manual_seed(0)
    Dinov2Model(Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2,
                             image_size=16, patch_size=8)).save_pretrained(tmp_path)
    backbone = HFImageBackbone(str(tmp_path))
    assert backbone.training and any(n.endswith("mask_token") for n, _ in backbone.named_parameters())
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    backbone(x).sum().backward()
    trainable = [(n, p) for n, p in backbone.named_parameters() if p.requires_grad]
    assert trainable and [n for n, p in trainable if p.grad is None] == []
