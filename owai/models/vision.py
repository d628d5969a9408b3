"""Image backbones of the thesis (ResNet, Wide ResNet, DenseNet, ViT), checkpoint-compatible with torchvision.

The representation-learning chapters probe features of ImageNet-pretrained networks
("ResNet #1" = torchvision resnet50 IMAGENET1K_V1, "ResNet #2" = IMAGENET1K_V2, DenseNet-121,
ViT-B/16, ViT-L/16, wide ResNets). torchvision does not import on every machine we run on, so the
architectures are written here from their papers, with module names chosen so that `state_dict()`
keys and shapes are exactly torchvision's: the official checkpoint files load with `strict=True`.

    ResNet      conv1 7x7/2 - bn1 - relu - maxpool 3x3/2 - layer1..4 - avgpool - fc
                BasicBlock (18/34): 3x3 - 3x3;  Bottleneck (50+): 1x1 - 3x3 (stride here, "v1.5") - 1x1 (x4)
                wide_resnet50_k: the bottleneck's inner width is k * 64 * 2^i instead of 64 * 2^i
                resnet{18,50}_wk: every channel count x k (the thesis's / SwAV's "resnet50w2", "resnet50w5"; no
                official torchvision weights)
                resnet18_cifar[_wk]: the CIFAR stem, conv1 3x3/1 and no maxpool (He et al.'s CIFAR networks as
                the SimSiam CIFAR code and RRL build them for 32 px images; same keys, conv1 3x3)
    DenseNet    features.{conv0, norm0, relu0, pool0, denseblock1, transition1, ..., denseblock4, norm5}
                - relu - avgpool - classifier; each dense layer BN-ReLU-1x1 (bn_size*growth) -BN-ReLU-3x3 (growth)
    ViT         conv_proj (patch P, stride P) - [class_token; patches] + encoder.pos_embedding
                - encoder.layers.encoder_layer_i (pre-LN, nn.MultiheadAttention, MLP D -> 4D -> D, GELU)
                - encoder.ln - heads.head on the class token

`features(model, x)` is the penultimate representation (pooled / class token), `feature_dim(model)`
its width. Weights files are read under torchvision's names (`checkpoint_keys`): the two legacy
spellings of the older official files (DenseNet `norm.1` -> `norm1`, ViT `mlp.linear_1` -> `mlp.0`) and
timm's ViT names (`blocks.i.attn.qkv` -> `encoder.layers.encoder_layer_i.self_attention.in_proj_weight`,
...; timm's ResNets and DenseNets already use torchvision's) are renamed. Named weights (`WEIGHTS`) are
found in owai's or torch.hub's cache, or downloaded; `check_weights` checks any of them before a run
from file headers alone, and says where a missing one was looked for.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import re
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, TypeVar

import torch
from torch import Tensor, nn

from owai.errors import DataMissing, OwaiError, one_line

# ---------------------------------------------------------------------------------------------- ResNet


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34). Output width = `planes`."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                 base_width: int = 64) -> None:
        super().__init__()
        if base_width != 64:
            raise OwaiError("BasicBlock supports only base_width 64 (wide ResNets use Bottleneck)")
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce - 3x3 (carries the stride) - 1x1 expand (x4), residual. Inner width planes*base_width/64."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                 base_width: int = 64) -> None:
        super().__init__()
        width = planes * base_width // 64
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet (He et al. 2016) with torchvision's module names; `width_per_group` > 64 makes it wide.
    `stem="cifar"`: conv1 3x3 stride 1 and no max-pool, for 32 px images (layer4 at 4 x 4, not 1 x 1)."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: tuple[int, int, int, int],
                 num_classes: int = 1000, width_per_group: int = 64, width: int = 1,
                 stem: str = "imagenet") -> None:
        super().__init__()
        if stem not in ("imagenet", "cifar"):
            raise OwaiError(f"ResNet stem must be 'imagenet' or 'cifar', got {stem!r}")
        base = 64 * width  # `width` > 1 multiplies every channel count (SwAV's / the thesis's "resnet50w2")
        self.inplanes = base
        self.base_width = width_per_group
        if stem == "cifar":
            self.conv1 = nn.Conv2d(3, base, 3, 1, 1, bias=False)
            self.maxpool: nn.Module = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(3, base, 7, 2, 3, bias=False)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.bn1 = nn.BatchNorm2d(base)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_layer(block, base, layers[0], 1)
        self.layer2 = self._make_layer(block, 2 * base, layers[1], 2)
        self.layer3 = self._make_layer(block, 4 * base, layers[2], 2)
        self.layer4 = self._make_layer(block, 8 * base, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = 8 * base * block.expansion
        self.fc = nn.Linear(self.feature_dim, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _make_layer(self, block: type[BasicBlock] | type[Bottleneck], planes: int, blocks: int,
                    stride: int) -> nn.Sequential:
        """`blocks` residual blocks; the first changes stride / width through a 1x1 conv + BN shortcut."""
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride, bias=False),  # key downsample.0
                nn.BatchNorm2d(planes * block.expansion),  # key downsample.1
            )
        layers = [block(self.inplanes, planes, stride, downsample, self.base_width)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, base_width=self.base_width) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, 3, H, W) -> (B, feature_dim): globally average-pooled layer4 output."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))  # (B, 64, H/4, W/4); CIFAR stem (B, 64, H, W)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))  # (B, feature_dim, H/32, W/32)
        return torch.flatten(self.avgpool(x), 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.forward_features(x))  # (B, num_classes)


def resnet18(num_classes: int = 1000) -> ResNet:
    """ResNet-18: BasicBlocks (2, 2, 2, 2), 512-d features, 11.7M parameters."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50 (v1.5, stride in the 3x3): Bottlenecks (3, 4, 6, 3), 2048-d features, 25.6M parameters."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes)


def resnet152(num_classes: int = 1000) -> ResNet:
    """ResNet-152 (v1.5): Bottlenecks (3, 8, 36, 3), 2048-d features, 60.2M parameters (TH Table A.2)."""
    return ResNet(Bottleneck, (3, 8, 36, 3), num_classes)


def resnet18_w2(num_classes: int = 1000) -> ResNet:
    """ResNet-18 with every channel count doubled: 1024-d features (= Cat_2's), 44.7M parameters without the head."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes, width=2)


def resnet18_w4(num_classes: int = 1000) -> ResNet:
    """ResNet-18 with every channel count x4: 2048-d features (= Cat_4's), 178.6M parameters without the head."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes, width=4)


def resnet18_cifar(num_classes: int = 1000) -> ResNet:
    """ResNet-18 with the CIFAR stem (3x3/1 conv1, no max-pool): TH A.1 / A.3.3's CIFAR ResNet-18, 11.2M
    parameters; 512-d features."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes, stem="cifar")


def resnet18_cifar_w2(num_classes: int = 1000) -> ResNet:
    """resnet18_cifar with every channel count doubled (Table A.4's r18w2): 1024-d features."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes, width=2, stem="cifar")


def resnet18_cifar_w4(num_classes: int = 1000) -> ResNet:
    """resnet18_cifar with every channel count x4 (Table A.4's r18w4): 2048-d features."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes, width=4, stem="cifar")


def resnet50_w2(num_classes: int = 1000) -> ResNet:
    """The thesis's "resnet50w2" (Table 2.2, 93.9M without the head): every channel count doubled, 4096-d
    features (SwAV's wide ResNets); not torchvision's wide_resnet50_2, which widens only the bottleneck."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes, width=2)


def resnet50_w4(num_classes: int = 1000) -> ResNet:
    """The thesis's "resnet50w4" (375.4M without the head): every channel count x4, 8192-d features."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes, width=4)


def resnet50_w5(num_classes: int = 1000) -> ResNet:
    """SwAV's "resnet50w5" (586,450,240 = 586.5M parameters without the head): every channel count x5,
    10240-d features."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes, width=5)


def wide_resnet50_2(num_classes: int = 1000) -> ResNet:
    """Wide ResNet-50-2 (Zagoruyko & Komodakis 2016): bottleneck inner width x2, 68.9M parameters."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes, width_per_group=64 * 2)


def wide_resnet50_4(num_classes: int = 1000) -> ResNet:
    """Wide ResNet-50-4: bottleneck inner width x4 (same keys as wide_resnet50_2; no torchvision weights)."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes, width_per_group=64 * 4)


# -------------------------------------------------------------------------------------------- DenseNet


class DenseLayer(nn.Module):
    """BN-ReLU-1x1 conv (bn_size*growth) - BN-ReLU-3x3 conv (growth); its output is concatenated to the input."""

    def __init__(self, in_features: int, growth_rate: int, bn_size: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(in_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(in_features, bn_size * growth_rate, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, 3, 1, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv2(self.relu2(self.norm2(self.conv1(self.relu1(self.norm1(x))))))  # (B, growth, H, W)


class DenseBlock(nn.ModuleDict):
    """`num_layers` dense layers (keys denselayer1..N); layer i sees the input and all earlier outputs."""

    def __init__(self, num_layers: int, in_features: int, growth_rate: int, bn_size: int) -> None:
        super().__init__()
        for i in range(num_layers):
            self[f"denselayer{i + 1}"] = DenseLayer(in_features + i * growth_rate, growth_rate, bn_size)

    def forward(self, x: Tensor) -> Tensor:
        feats = [x]
        for layer in self.values():
            feats.append(layer(torch.cat(feats, 1)))
        return torch.cat(feats, 1)  # (B, in_features + num_layers * growth, H, W)


class Transition(nn.Sequential):
    """BN-ReLU-1x1 conv (halves the channels) - 2x2 average pool (halves the resolution)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(in_features)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(in_features, out_features, 1, bias=False)
        self.pool = nn.AvgPool2d(2, 2)


class DenseNet(nn.Module):
    """DenseNet-BC (Huang et al. 2017) with torchvision's module names."""

    def __init__(self, growth_rate: int = 32, block_config: tuple[int, ...] = (6, 12, 24, 16),
                 num_init_features: int = 64, bn_size: int = 4, num_classes: int = 1000) -> None:
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv0", nn.Conv2d(3, num_init_features, 7, 2, 3, bias=False))
        self.features.add_module("norm0", nn.BatchNorm2d(num_init_features))
        self.features.add_module("relu0", nn.ReLU(inplace=True))
        self.features.add_module("pool0", nn.MaxPool2d(3, 2, 1))
        n = num_init_features
        for i, num_layers in enumerate(block_config):
            self.features.add_module(f"denseblock{i + 1}", DenseBlock(num_layers, n, growth_rate, bn_size))
            n += num_layers * growth_rate
            if i != len(block_config) - 1:
                self.features.add_module(f"transition{i + 1}", Transition(n, n // 2))
                n //= 2
        self.features.add_module(f"norm{len(block_config) + 1}", nn.BatchNorm2d(n))
        self.feature_dim = n
        self.classifier = nn.Linear(n, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, 3, H, W) -> (B, feature_dim): ReLU + global average pool of the last BN output."""
        x = torch.relu(self.features(x))  # (B, feature_dim, H/32, W/32)
        return torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.forward_features(x))  # (B, num_classes)


def densenet121(num_classes: int = 1000) -> DenseNet:
    """DenseNet-121: growth 32, bn_size 4, blocks (6, 12, 24, 16), 1024-d features, 8.0M parameters."""
    return DenseNet(32, (6, 12, 24, 16), 64, 4, num_classes)


# ------------------------------------------------------------------------------------------------- ViT


class EncoderBlock(nn.Module):
    """Pre-LN transformer block: x + MHA(LN(x)), then x + MLP(LN(x)); MLP keys mlp.0 / mlp.3."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, dropout: float = 0.0,
                 attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(dim, num_heads, dropout=attention_dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(  # indices 0 and 3 hold the weights, as in torchvision's MLPBlock
            nn.Linear(dim, mlp_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(mlp_dim, dim), nn.Dropout(dropout),
        )
        for m in (self.mlp[0], self.mlp[3]):
            nn.init.xavier_uniform_(m.weight)
            nn.init.normal_(m.bias, std=1e-6)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln_1(x)  # (B, N, D)
        h, _ = self.self_attention(h, h, h, need_weights=False)
        x = x + self.dropout(h)
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    """Learned position embedding (1, N, D), `num_layers` blocks (encoder_layer_i), final LayerNorm."""

    def __init__(self, seq_length: int, num_layers: int, num_heads: int, dim: int, mlp_dim: int,
                 dropout: float = 0.0, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential()
        for i in range(num_layers):
            self.layers.add_module(f"encoder_layer_{i}",
                                   EncoderBlock(dim, num_heads, mlp_dim, dropout, attention_dropout))
        self.ln = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x: Tensor) -> Tensor:
        return self.ln(self.layers(self.dropout(x + self.pos_embedding)))  # (B, N, D)


class VisionTransformer(nn.Module):
    """ViT (Dosovitskiy et al. 2021) with torchvision's names; the class token's final state is the feature."""

    def __init__(self, image_size: int, patch_size: int, num_layers: int, num_heads: int, hidden_dim: int,
                 mlp_dim: int, num_classes: int = 1000, dropout: float = 0.0,
                 attention_dropout: float = 0.0) -> None:
        super().__init__()
        if image_size % patch_size:
            raise OwaiError(f"image_size {image_size} is not a multiple of the patch size {patch_size}")
        self.image_size, self.patch_size, self.hidden_dim = image_size, patch_size, hidden_dim
        self.feature_dim = hidden_dim
        self.conv_proj = nn.Conv2d(3, hidden_dim, patch_size, patch_size)
        seq_length = (image_size // patch_size) ** 2 + 1  # patches + class token
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
        self.encoder = Encoder(seq_length, num_layers, num_heads, hidden_dim, mlp_dim, dropout, attention_dropout)
        self.heads = nn.Sequential()
        self.heads.add_module("head", nn.Linear(hidden_dim, num_classes))
        fan_in = 3 * patch_size * patch_size
        nn.init.trunc_normal_(self.conv_proj.weight, std=(1.0 / fan_in) ** 0.5)
        nn.init.zeros_(self.conv_proj.bias)
        nn.init.zeros_(self.heads.head.weight)
        nn.init.zeros_(self.heads.head.bias)
        # None, or (1, 3, 1, 1) per-channel maps to the weights' own input statistics (`renormalise`)
        self.register_buffer("input_scale", None, persistent=False)
        self.register_buffer("input_shift", None, persistent=False)

    def renormalise(self, input_mean: tuple[float, ...], input_std: tuple[float, ...],
                    mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        """Images arrive normalised with (input_mean, input_std) and the weights were trained on images
        normalised with (mean, std) (timm's ImageNet-21k ViTs: 0.5 / 0.5): map them, x * scale + shift
        per channel before the patches, an exact affine map (as `hf_vision.HFImageBackbone`'s). Equal
        statistics map nothing. Not in the state dict: the loader sets it from the weights' own."""
        scale = [si / sw for si, sw in zip(input_std, std)]
        shift = [(mi - mw) / sw for mi, mw, sw in zip(input_mean, mean, std)]
        same = all(abs(a - 1) < 1e-9 for a in scale) and all(abs(b) < 1e-9 for b in shift)
        device = self.class_token.device
        self.input_scale = None if same else torch.tensor(scale, device=device).view(1, 3, 1, 1)
        self.input_shift = None if same else torch.tensor(shift, device=device).view(1, 3, 1, 1)

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, 3, S, S) -> (B, hidden_dim): the class token after the encoder's final LayerNorm."""
        b, _, h, w = x.shape
        if h != self.image_size or w != self.image_size:
            raise OwaiError(f"ViT built for {self.image_size}x{self.image_size} images, got {h}x{w}")
        if self.input_scale is not None:
            x = x * self.input_scale + self.input_shift
        x = self.conv_proj(x).flatten(2).transpose(1, 2)  # (B, N-1, D)
        x = torch.cat([self.class_token.expand(b, -1, -1), x], dim=1)  # (B, N, D)
        return self.encoder(x)[:, 0]

    def forward(self, x: Tensor) -> Tensor:
        return self.heads(self.forward_features(x))  # (B, num_classes)


def vit_b_16(num_classes: int = 1000, image_size: int = 224, **kwargs: float) -> VisionTransformer:
    """ViT-B/16: 12 layers, 12 heads, D 768, MLP 3072; 86.6M parameters at 224."""
    return VisionTransformer(image_size, 16, 12, 12, 768, 3072, num_classes, **kwargs)


def vit_l_16(num_classes: int = 1000, image_size: int = 224, **kwargs: float) -> VisionTransformer:
    """ViT-L/16: 24 layers, 16 heads, D 1024, MLP 4096; 304.3M parameters at 224."""
    return VisionTransformer(image_size, 16, 24, 16, 1024, 4096, num_classes, **kwargs)


def vit_mini_4(num_classes: int = 1000, image_size: int = 32, **kwargs: float) -> VisionTransformer:
    """A 4-layer ViT for 32 px images (patch 4, D 128, 4 heads, MLP 512; 0.8M parameters): not a
    published model, the cpu stand-in of TH Fig. 2.4's ImageNet-21k ViT-B/16 and ViT-L/16."""
    return VisionTransformer(image_size, 4, 4, 4, 128, 512, num_classes, **kwargs)


# ---------------------------------------------------------------------------------------------- registry

BACKBONES: dict[str, Callable[..., nn.Module]] = {
    "resnet18": resnet18,
    "resnet50": resnet50,
    "resnet152": resnet152,
    "resnet18_w2": resnet18_w2,
    "resnet18_w4": resnet18_w4,
    "resnet18_cifar": resnet18_cifar,
    "resnet18_cifar_w2": resnet18_cifar_w2,
    "resnet18_cifar_w4": resnet18_cifar_w4,
    "resnet50_w2": resnet50_w2,
    "resnet50_w4": resnet50_w4,
    "resnet50_w5": resnet50_w5,
    "wide_resnet50_2": wide_resnet50_2,
    "wide_resnet50_4": wide_resnet50_4,
    "densenet121": densenet121,
    "vit_b_16": vit_b_16,
    "vit_l_16": vit_l_16,
    "vit_mini_4": vit_mini_4,
}

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # the statistics torchvision's weights, and owai's images, are normalised with
IMAGENET_STD = (0.229, 0.224, 0.225)

_TV = "https://download.pytorch.org/models/"
WEIGHTS: dict[str, dict[str, str]] = {  # torchvision's official checkpoints (ImageNet-1k heads)
    "resnet18": {"IMAGENET1K_V1": _TV + "resnet18-f37072fd.pth"},
    "resnet50": {  # the thesis's "ResNet #1" (V1) and "ResNet #2" (V2)
        "IMAGENET1K_V1": _TV + "resnet50-0676ba61.pth",
        "IMAGENET1K_V2": _TV + "resnet50-11ad3fa6.pth",
    },
    "wide_resnet50_2": {
        "IMAGENET1K_V1": _TV + "wide_resnet50_2-95faca4d.pth",
        "IMAGENET1K_V2": _TV + "wide_resnet50_2-9ba9bcbe.pth",
    },
    "densenet121": {"IMAGENET1K_V1": _TV + "densenet121-a639ec97.pth"},
    "vit_b_16": {
        "IMAGENET1K_V1": _TV + "vit_b_16-c867db91.pth",
        "IMAGENET1K_SWAG_E2E_V1": _TV + "vit_b_16_swag-9ac1b537.pth",  # image_size=384
        "IMAGENET1K_SWAG_LINEAR_V1": _TV + "vit_b_16_lc_swag-4e70ced5.pth",
    },
    "vit_l_16": {
        "IMAGENET1K_V1": _TV + "vit_l_16-852ce7e3.pth",
        "IMAGENET1K_SWAG_E2E_V1": _TV + "vit_l_16_swag-4f3808c9.pth",  # image_size=512
        "IMAGENET1K_SWAG_LINEAR_V1": _TV + "vit_l_16_lc_swag-4d563306.pth",
    },
}


# The image size a named weight was trained at where it is not its architecture's default: torchvision's
# SWAG end-to-end ViTs (their own transforms crop 384 and 512 px; the SWAG_LINEAR ones crop 224, as V1).
WEIGHTS_IMAGE_SIZE: dict[tuple[str, str], int] = {
    ("vit_b_16", "IMAGENET1K_SWAG_E2E_V1"): 384,
    ("vit_l_16", "IMAGENET1K_SWAG_E2E_V1"): 512,
}


def build_backbone(name: str, num_classes: int = 1000, **kwargs: object) -> nn.Module:
    """Construct backbone `name` (randomly initialised) with a `num_classes`-way head."""
    if name not in BACKBONES:
        raise OwaiError(f"unknown backbone {name!r}; known: {', '.join(sorted(BACKBONES))}")
    return BACKBONES[name](num_classes=num_classes, **kwargs)


def size_kwargs(name: str, image_size: int | None) -> dict[str, int]:
    """`build_backbone`'s `image_size` argument for a backbone that takes one (a ViT: its position
    grid), given a size; {} otherwise (convolutional networks take any size)."""
    if not image_size or name not in BACKBONES or "image_size" not in inspect.signature(BACKBONES[name]).parameters:
        return {}
    return {"image_size": int(image_size)}


@functools.lru_cache(maxsize=None)
def meta_backbone(name: str, image_size: int = 0) -> nn.Module:
    """Backbone `name` built once per name (and image size, for a ViT; 0: its default) on the meta device
    (shapes and attributes, no memory); shared between its callers, so never modified."""
    with torch.device("meta"):
        return build_backbone(name, num_classes=1, **size_kwargs(name, image_size))


def native_image_size(name: str) -> int:
    """The one image size a backbone takes (a ViT's position embeddings), 0 when any size goes."""
    return int(getattr(meta_backbone(name), "image_size", 0) or 0)


def _check(model: nn.Module) -> ResNet | DenseNet | VisionTransformer:
    if not isinstance(model, (ResNet, DenseNet, VisionTransformer)):
        raise OwaiError(f"not an owai vision backbone: {type(model).__name__}")
    return model


def feature_dim(model: nn.Module) -> int:
    """Width of the penultimate representation: 512 / 2048 / 1024 (DenseNet-121) / 768 / 1024 (ViT-L)."""
    return _check(model).feature_dim


def features(model: nn.Module, x: Tensor) -> Tensor:
    """(B, 3, H, W) -> (B, feature_dim): the representation the classifier head reads."""
    return _check(model).forward_features(x)


def _head_prefix(model: nn.Module) -> str:
    """Where the classification head's keys are: `fc.` (ResNet), `classifier.` (DenseNet), `heads.` (ViT)."""
    model = _check(model)
    return "fc." if isinstance(model, ResNet) else "classifier." if isinstance(model, DenseNet) else "heads."


def feature_shapes(name: str, image_size: int = 0) -> dict[str, tuple[int, ...]]:
    """The shapes of backbone `name`'s weights without its head (a ViT's at `image_size`; 0: its default)."""
    model = meta_backbone(name, image_size)
    head = _head_prefix(model)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith(head)}


# ------------------------------------------------------------------------------- weights files and names

_LEGACY_DENSENET = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$"
)
_LEGACY_VIT_MLP = re.compile(r"^(.*\.mlp\.)linear_([12])\.(weight|bias)$")


def _rename_legacy(key: str) -> str:
    """Older official files spell `norm.1` (DenseNet) and `mlp.linear_1` (ViT); map to the current names."""
    m = _LEGACY_DENSENET.match(key)
    if m:
        return m.group(1) + m.group(2)
    m = _LEGACY_VIT_MLP.match(key)
    if m:
        return f"{m.group(1)}{0 if m.group(2) == '1' else 3}.{m.group(3)}"
    return key


# timm's VisionTransformer key names -> torchvision's (owai's), for the plain pre-LN ViT with a class
# token that the ImageNet-21k checkpoints of Figure 2.4 are (timm's `*.orig_in21k` and `*.augreg_in21k`,
# converted by timm from google-research/vision_transformer). timm's fused `attn.qkv` stacks q, k, v in
# that order along its output rows, as nn.MultiheadAttention's `in_proj_weight` does, so it is taken as
# it is; its `pos_embed` is (1, 1 + grid^2, D) with the class token first, as `encoder.pos_embedding`.
_LAYER = r"encoder.layers.encoder_layer_\1."
_TIMM_VIT: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(a), b) for a, b in (
    (r"^cls_token$", "class_token"),
    (r"^pos_embed$", "encoder.pos_embedding"),
    (r"^patch_embed\.proj\.(weight|bias)$", r"conv_proj.\1"),
    (r"^blocks\.(\d+)\.norm1\.(weight|bias)$", _LAYER + r"ln_1.\2"),
    (r"^blocks\.(\d+)\.attn\.qkv\.weight$", _LAYER + "self_attention.in_proj_weight"),
    (r"^blocks\.(\d+)\.attn\.qkv\.bias$", _LAYER + "self_attention.in_proj_bias"),
    (r"^blocks\.(\d+)\.attn\.proj\.(weight|bias)$", _LAYER + r"self_attention.out_proj.\2"),
    (r"^blocks\.(\d+)\.norm2\.(weight|bias)$", _LAYER + r"ln_2.\2"),
    (r"^blocks\.(\d+)\.mlp\.fc1\.(weight|bias)$", _LAYER + r"mlp.0.\2"),
    (r"^blocks\.(\d+)\.mlp\.fc2\.(weight|bias)$", _LAYER + r"mlp.3.\2"),
    (r"^norm\.(weight|bias)$", r"encoder.ln.\1"),
    (r"^head\.(weight|bias)$", r"heads.head.\1"),
))
_TIMM_MARK = "patch_embed.proj.weight"  # a timm ViT state dict (torchvision's is conv_proj.weight)

V = TypeVar("V")


def _timm_name(key: str) -> str:
    """torchvision's name of timm ViT key `key`; a key of a variant owai's ViT does not have (layer
    scale `ls1.gamma`, `fc_norm`, register tokens, ...) is kept, so the layout check names it."""
    for pattern, name in _TIMM_VIT:
        if pattern.match(key):
            return pattern.sub(name, key)
    return key


def checkpoint_keys(state: Mapping[str, V]) -> dict[str, V]:
    """`state` under owai's (torchvision's) key names: a DataParallel `module.` prefix removed, a timm
    ViT's names mapped (`_TIMM_VIT`; its `pre_logits` layer, which the ImageNet-21k ViTs' features do not
    pass through and timm's own loader drops, left out), and the older official spellings renamed
    (`_rename_legacy`). The values (tensors or shapes) are kept."""
    plain = {k.removeprefix("module."): v for k, v in state.items()}
    if _TIMM_MARK in plain:
        plain = {_timm_name(k): v for k, v in plain.items() if not k.startswith("pre_logits.")}
    return {_rename_legacy(k): v for k, v in plain.items()}


def timm_statistics(path: str | Path) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """None for a weights file under torchvision's (or owai's) names, whose images are taken as they
    come; for a timm ViT, the (mean, std) its images were normalised with, which the file does not hold:
    the `config.json` timm publishes beside it on the hub (`pretrained_cfg.mean` / `.std`, or the older
    flat file's; the ImageNet-21k ViTs: 0.5 / 0.5). A timm file without one is an OwaiError: feeding it
    ImageNet-normalised images would shift every feature silently."""
    path = Path(path).expanduser()
    if _TIMM_MARK not in {k.removeprefix("module.") for k in weight_shapes(path)}:
        return None
    config = path.parent / "config.json"
    need = (f"{path} holds timm's ViT names: owai reads the image statistics from the config.json timm publishes "
            f"beside it (`hf download timm/MODEL config.json model.safetensors`)")
    try:
        raw = json.loads(config.read_text())
    except FileNotFoundError:
        raise OwaiError(f"{need}; there is none ({config})") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise OwaiError(f"{need}; {config} is not valid JSON ({one_line(e)})") from None
    cfg = raw.get("pretrained_cfg", raw) if isinstance(raw, dict) else {}
    stats = [cfg.get(key) if isinstance(cfg, dict) else None for key in ("mean", "std")]
    if not all(isinstance(v, list) and len(v) == 3 and all(isinstance(c, (int, float)) and not isinstance(c, bool)
                                                         and math.isfinite(c) for c in v) for v in stats) or min(stats[1]) <= 0:
        raise OwaiError(f"{need}; {config} gives no mean and positive std of 3 numbers each")
    return tuple(map(float, stats[0])), tuple(map(float, stats[1]))


def _read_state_dict(path: Path, mmap: bool = False) -> dict[str, Tensor]:
    """Tensors of a local .safetensors or .pth (torch.load, weights_only) file; OwaiError if unreadable.
    `mmap`: a .pth's tensors are mapped, not read (a file in torch's old, non-zip format is read)."""
    if not path.is_file():
        raise OwaiError(f"weights file not found: {path}")
    try:
        if path.suffix == ".safetensors":
            from owai.io import read_safetensors

            state = read_safetensors(path)
        else:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as e:
                if not mmap or "mmap can only be used" not in str(e):
                    raise
                state = torch.load(path, map_location="cpu", weights_only=True)
    except OwaiError:
        raise
    except Exception as e:  # noqa: BLE001 - any decoding failure is a corrupt file to the user
        raise OwaiError(f"cannot read weights file {path}: {_load_problem(e)}") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise OwaiError(f"weights file {path} does not hold a state dict of tensors")
    return state


def _load_problem(e: Exception) -> str:
    """Why a weights file did not load, in one line, never passing on torch's advice to load
    pickles unsafely (weights_only=False): owai loads tensors only."""
    text = str(e)
    if "Unsupported global" in text:
        return "it holds pickled Python objects, not only tensors (owai loads tensors only: save a state_dict or .safetensors)"
    if "weights_only" in text or "Weights only load failed" in text or not text.strip():
        return "corrupt, truncated or not a PyTorch/safetensors weights file"
    first = next(ln.strip() for ln in text.splitlines() if ln.strip())
    return f"{type(e).__name__}: {first[:200]} (corrupt, truncated or not a weights file?)"


def weight_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in weights file `path`, keys as stored, without reading the tensors: a
    .safetensors file's header, a .pth memory-mapped (only its pickle is parsed). Cheap at any size, so
    every check before a run uses it; each (file, size, mtime) is read once per process. OwaiError
    for a missing, unreadable or corrupt file, as the loaders say it."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise OwaiError(f"weights file not found: {path}")
    stat = path.stat()
    return dict(_shapes(str(path.absolute()), stat.st_size, stat.st_mtime_ns))  # not resolved: a cache's link keeps its suffix


@functools.lru_cache(maxsize=32)
def _shapes(path: str, size: int, mtime_ns: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    if path.endswith(".safetensors"):
        from owai.io import safetensors_shapes

        return tuple(safetensors_shapes(path).items())
    return tuple((k, tuple(v.shape)) for k, v in _read_state_dict(Path(path), mmap=True).items())


POSITION_KEY = "encoder.pos_embedding"  # a ViT's position embeddings: (1, 1 + grid^2, D), the class token first


def position_grid(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The side g of the square grid of position embeddings in a ViT checkpoint's shapes (owai's key
    names; POSITION_KEY); 0 when it has none."""
    pos = shapes.get(POSITION_KEY)
    if pos is None or len(pos) != 3 or pos[1] < 2:
        return 0
    g = math.isqrt(pos[1] - 1)
    return g if g * g == pos[1] - 1 else 0


def resize_position_grid(positions: Tensor, prefix: int, size: int) -> Tensor:
    """(1, prefix + g*g, D) position embeddings -> (1, prefix + size*size, D): the class (and
    distillation) tokens' rows kept, the g x g grid zoomed linearly to size x size. This is
    `scipy.ndimage.zoom(grid, (size/g, size/g, 1), order=1)` (the original ViT code's resize, which
    RRL's Figure 2.4 uses): bilinear with the corners aligned."""
    tokens = positions.shape[1] - prefix
    g = math.isqrt(tokens)
    if positions.dim() != 3 or positions.shape[0] != 1 or g * g != tokens:
        raise OwaiError(f"position embeddings of shape {tuple(positions.shape)} hold no square grid after "
                        f"{prefix} prefix token(s)")
    grid = positions[:, prefix:].reshape(1, g, g, -1).permute(0, 3, 1, 2).double()  # (1, D, g, g)
    zoomed = torch.nn.functional.interpolate(grid, size=(size, size), mode="bilinear", align_corners=True)
    zoomed = zoomed.permute(0, 2, 3, 1).reshape(1, size * size, -1).to(positions.dtype)
    return torch.cat([positions[:, :prefix], zoomed], dim=1)


def weights_image_size(backbone: str, weights: str) -> int:
    """The one image size `backbone` takes with `weights` ("" = random initialisation), 0 when any size
    goes (convolutional networks). For a ViT: a named weight's training size (`WEIGHTS_IMAGE_SIZE`,
    else the architecture's), a file's from its position grid (grid x patch, read from the header); the
    architecture's own without weights, or where the file is missing or holds no square grid (the
    weights check then says what is wrong)."""
    native = native_image_size(backbone)
    if not native or not weights:
        return native
    if weights in WEIGHTS.get(backbone, {}):
        return WEIGHTS_IMAGE_SIZE.get((backbone, weights), native)
    path = Path(weights).expanduser()
    if not path.is_file():
        return native
    grid = position_grid(checkpoint_keys(weight_shapes(path)))
    return grid * meta_backbone(backbone).patch_size if grid else native


def weights_locations(backbone: str, weights: str) -> list[Path]:
    """Where named weights `weights` of `backbone` (a `WEIGHTS` name) are looked for, in order: owai's
    cache (`<cache>/weights/`, where owai downloads them) and torch.hub's (`$TORCH_HOME/hub/checkpoints/`,
    where torchvision downloads the very same files, under the same names)."""
    import torch.hub

    from owai.io import cache_root

    name = WEIGHTS[backbone][weights].rsplit("/", 1)[-1]
    places = [cache_root() / "weights" / name, Path(torch.hub.get_dir()).expanduser() / "checkpoints" / name]
    return places[:1] if places[0] == places[1] else places


def check_weights(backbone: str, weights: str) -> int:
    """Fail before a run starts on `weights` (see `resolve_weights`) that cannot load into `backbone`'s
    features (the caller replaces its head), and return the image size they take (`weights_image_size`).

    A named weight is looked for where `resolve_weights` looks (`weights_locations`); found, it is
    checked as a file; not found, the run downloads it, unless download.pytorch.org cannot be reached
    (`hub.host_unreachable`: no connection within seconds; behind a proxy the download is left to
    try): then one DataMissing line naming the weight, the places looked at and what to put where. A
    file must exist, be readable and hold the backbone's feature keys with their shapes (at the image
    size its position grid gives a ViT); only its header is read (`weight_shapes`)."""
    size = weights_image_size(backbone, weights)
    if not weights:
        return size
    known = WEIGHTS.get(backbone, {})
    if weights in known:
        path = _named_file(backbone, weights)
        if path is None:
            from owai.hub import host_unreachable

            why = host_unreachable(known[weights])
            if why:
                places = weights_locations(backbone, weights)
                raise DataMissing(f"weights {weights} of {backbone} are not on this machine (looked for {places[0].name} "
                                  f"in {' and '.join(str(p.parent) for p in places)}) and cannot be downloaded: {why}; "
                                  f"download {known[weights]} into {places[0].parent}")
            return size  # downloaded when the run starts
    else:
        path = Path(weights).expanduser()
        if not path.is_file():
            resolve_weights(backbone, weights)  # raises the no-such-file error
    _check_layout(meta_backbone(backbone, size), checkpoint_keys(weight_shapes(path)), path, features_only=True)
    timm_statistics(path)  # a timm ViT's image statistics are found
    return size


def load_torchvision_weights(model: nn.Module, path: str | Path, features_only: bool = False,
                             input_stats: tuple[tuple[float, ...], tuple[float, ...]] = (IMAGENET_MEAN, IMAGENET_STD)) -> None:
    """Load a torchvision (or timm ViT) checkpoint (.pth or .safetensors) into `model`, strictly (keys
    and shapes); with `features_only` the file's head is ignored and the model keeps its own (a caller
    that replaces the head: a 21k-class or missing head then loads). A timm ViT is fed its own image
    statistics (`timm_statistics`, `VisionTransformer.renormalise`) from the `input_stats` (mean, std)
    its images will be normalised with."""
    path = Path(path)
    state = _match_state(model, _read_state_dict(path), path, features_only)
    model.load_state_dict(state, strict=True)
    feed_own_statistics(model, path, input_stats)


def feed_own_statistics(model: nn.Module, path: str | Path,
                        input_stats: tuple[tuple[float, ...], tuple[float, ...]] = (IMAGENET_MEAN, IMAGENET_STD)) -> None:
    """Map the images `model` reads (normalised with `input_stats`) to the statistics of the weights file
    `path` where it is a timm ViT's (`timm_statistics`, `VisionTransformer.renormalise`); nothing for any
    other file. The map is no tensor of the state dict: a model built without the file and given a
    trained state (dropout-ft's ensembles and weight averages) needs it set again from the file."""
    own = timm_statistics(path)
    if own is not None and isinstance(model, VisionTransformer):
        model.renormalise(*input_stats, *own)


def _match_state(model: nn.Module, raw: dict[str, Tensor], path: Path, features_only: bool = False) -> dict[str, Tensor]:
    """`raw` under owai's key names (`checkpoint_keys`), checked to hold exactly `model`'s keys and
    shapes (`_check_layout`); with `features_only` the head's tensors are the model's own."""
    state = checkpoint_keys(raw)
    if features_only:
        head = _head_prefix(model)
        state = {k: v for k, v in state.items() if not k.startswith(head)}
        state.update({k: v for k, v in model.state_dict().items() if k.startswith(head)})
    for k in _check_layout(model, {k: tuple(v.shape) for k, v in state.items()}, path):
        state[k] = torch.zeros((), dtype=torch.long)
    return state


def _check_layout(model: nn.Module, shapes: Mapping[str, tuple[int, ...]], path: Path,
                  features_only: bool = False) -> list[str]:
    """Raise unless `shapes` (a checkpoint's, under owai's key names) hold exactly `model`'s keys with
    their shapes (without the head's, on both sides, with `features_only`); return the BatchNorm
    counters the checkpoint lacks, which load as 0 (files older than the counter, e.g. densenet121-a639ec97)."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if features_only:
        head = _head_prefix(model)
        own = {k: v for k, v in own.items() if not k.startswith(head)}
        shapes = {k: v for k, v in shapes.items() if not k.startswith(head)}
    counters = [k for k in own if k.endswith(".num_batches_tracked") and k not in shapes
                and k[: -len("num_batches_tracked")] + "running_mean" in shapes]
    missing = [k for k in own if k not in shapes and k not in counters]
    unexpected = [k for k in shapes if k not in own]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected[:5])}"
                         f"{' ...' if len(unexpected) > 5 else ''}")
        raise OwaiError(f"{path} does not match {type(model).__name__}: {'; '.join(parts)}")
    bad = [f"{k} {tuple(shapes[k])} vs {v}" for k, v in own.items() if k in shapes and tuple(shapes[k]) != v]
    if bad:
        raise OwaiError(f"{path}: shape mismatch for {len(bad)} tensors, e.g. {'; '.join(bad[:3])}")
    return counters


def _named_file(backbone: str, weights: str) -> Path | None:
    """The first of `weights_locations` that holds the named weights' file, None when none does."""
    return next((p for p in weights_locations(backbone, weights) if p.is_file()), None)


def resolve_weights(backbone: str, weights: str) -> Path | None:
    """The local file for `weights`: "" = none (random initialisation); a torchvision weights name
    of `backbone` (e.g. IMAGENET1K_V2, the thesis's "ResNet #2") = its file in owai's or torch.hub's
    cache (`weights_locations`), else downloaded from the official URL into owai's; anything else = a
    path to a .pth/.safetensors file (torchvision's keys, or timm's for a ViT)."""
    if not weights:
        return None
    known = WEIGHTS.get(backbone, {})
    if weights in known:
        found = _named_file(backbone, weights)
        if found is not None:
            return found
        path = weights_locations(backbone, weights)[0]
        _download(known[weights], path)
        return path
    path = Path(weights).expanduser()
    if not path.is_file():
        names = ", ".join(known) or "none"
        raise OwaiError(f"weights {weights!r}: no such file, and not a weights name of {backbone} (known: {names})")
    return path


def _download(url: str, path: Path) -> None:
    """Fetch `url` to `path` (`io.download`: atomic, so a partial download never looks like a weights file)."""
    from owai.io import download

    try:
        download(url, path)
    except Exception as e:  # noqa: BLE001 - no network, HTTP errors, disk full: one line for the user
        raise OwaiError(f"cannot download {url} ({one_line(e, 200)}); put the file at {path}") from None


def _remove_head(backbone: nn.Module) -> None:
    """Replace the backbone's ImageNet head by Identity: its weights are neither trained nor decayed."""
    replace_head(backbone, None)


def replace_head(backbone: nn.Module, head: nn.Module | None) -> nn.Module:
    """Put `head` (a module from the (B, feature_dim) features to the logits; None: no head, the
    forward returns the features) where the backbone's classifier is, in place: `fc` (ResNet),
    `classifier` (DenseNet), `heads.head` (ViT). The state dict keys keep that prefix."""
    model = _check(backbone)
    if isinstance(model, ResNet):
        model.fc = nn.Identity() if head is None else head
    elif isinstance(model, DenseNet):
        model.classifier = nn.Identity() if head is None else head
    else:
        model.heads = nn.Sequential() if head is None else nn.Sequential(OrderedDict(head=head))
    return model


class FineTuneClassifier(nn.Module):
    """A pre-trained backbone with a fresh head: features -> Dropout(p) -> Linear (thesis §2.4).

    The dropout acts only on the penultimate representation (2048-d for ResNet-50, the class token
    for ViT) and only in training mode; PyTorch's inverted dropout scales kept units by 1/(1-p).
    With `freeze_bn`, every BatchNorm2d of the backbone stays in eval mode whatever `.train()` is
    called with, so its running statistics never change (its affine parameters still train).
    """

    def __init__(self, backbone: nn.Module, num_classes: int, dropout: float = 0.0, freeze_bn: bool = True) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise OwaiError(f"dropout must be in [0, 1), got {dropout}")
        dim = feature_dim(backbone)
        _remove_head(backbone)
        self.backbone = backbone
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(dim, num_classes))
        self.freeze_bn = freeze_bn
        self.train()

    def train(self, mode: bool = True) -> "FineTuneClassifier":
        super().train(mode)
        if self.freeze_bn:
            for m in self.backbone.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        return self

    def features(self, x: Tensor) -> Tensor:
        return self.backbone.forward_features(x)  # (B, feature_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))  # (B, num_classes)
