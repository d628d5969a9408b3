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
its width. `load_torchvision_weights` also renames the two legacy key spellings found in the older
official files (DenseNet `norm.1` -> `norm1`, ViT `mlp.linear_1` -> `mlp.0`).
"""

from __future__ import annotations

import functools
import re
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from owai.errors import OwaiError, one_line

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

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, 3, S, S) -> (B, hidden_dim): the class token after the encoder's final LayerNorm."""
        b, _, h, w = x.shape
        if h != self.image_size or w != self.image_size:
            raise OwaiError(f"ViT built for {self.image_size}x{self.image_size} images, got {h}x{w}")
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


def build_backbone(name: str, num_classes: int = 1000, **kwargs: object) -> nn.Module:
    """Construct backbone `name` (randomly initialised) with a `num_classes`-way head."""
    if name not in BACKBONES:
        raise OwaiError(f"unknown backbone {name!r}; known: {', '.join(sorted(BACKBONES))}")
    return BACKBONES[name](num_classes=num_classes, **kwargs)


@functools.lru_cache(maxsize=None)
def meta_backbone(name: str) -> nn.Module:
    """Backbone `name` built once per name on the meta device (shapes and attributes, no memory); shared
    between its callers, so never modified."""
    with torch.device("meta"):
        return build_backbone(name, num_classes=1)


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


def _read_state_dict(path: Path) -> dict[str, Tensor]:
    """Tensors of a local .safetensors or .pth (torch.load, weights_only) file; OwaiError if unreadable."""
    if not path.is_file():
        raise OwaiError(f"weights file not found: {path}")
    try:
        if path.suffix == ".safetensors":
            from owai.io import read_safetensors

            state = read_safetensors(path)
        else:
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


def check_weights(backbone: str, weights: str) -> None:
    """Fail before a run starts on a weights file that cannot load into `backbone` (unreadable,
    corrupt, or of another architecture); weights names and "" are checked when resolved. The
    backbone is built on the meta device (no memory); each (file, size, mtime) is read once."""
    if not weights or weights in WEIGHTS.get(backbone, {}):
        return
    path = Path(weights).expanduser()
    if not path.is_file():
        resolve_weights(backbone, weights)  # raises the no-such-file error
    stat = path.stat()
    _check_weights_file(backbone, str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _check_weights_file(backbone: str, path: str, size: int, mtime_ns: int) -> None:
    with torch.device("meta"):
        model = build_backbone(backbone, num_classes=1000)
    _match_state(model, _read_state_dict(Path(path)), Path(path))


def load_torchvision_weights(model: nn.Module, path: str | Path) -> None:
    """Load a torchvision checkpoint (.pth or .safetensors) into `model`, strictly (keys and shapes)."""
    path = Path(path)
    state = _match_state(model, _read_state_dict(path), path)
    model.load_state_dict(state, strict=True)


def _match_state(model: nn.Module, raw: dict[str, Tensor], path: Path) -> dict[str, Tensor]:
    """`raw` with legacy keys renamed, checked to hold exactly `model`'s keys and shapes."""
    state = {_rename_legacy(k): v for k, v in raw.items()}
    own = model.state_dict()
    for k in own:  # checkpoints older than BatchNorm's counter (e.g. densenet121-a639ec97) lack it
        prefix = k[: -len("num_batches_tracked")]
        if k.endswith(".num_batches_tracked") and k not in state and prefix + "running_mean" in state:
            state[k] = torch.zeros((), dtype=torch.long)
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected[:5])}"
                         f"{' ...' if len(unexpected) > 5 else ''}")
        raise OwaiError(f"{path} does not match {type(model).__name__}: {'; '.join(parts)}")
    bad = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in own.items() if state[k].shape != v.shape]
    if bad:
        raise OwaiError(f"{path}: shape mismatch for {len(bad)} tensors, e.g. {'; '.join(bad[:3])}")
    return state


def resolve_weights(backbone: str, weights: str) -> Path | None:
    """The local file for `weights`: "" = none (random initialisation); a torchvision weights name
    of `backbone` (e.g. IMAGENET1K_V2, the thesis's "ResNet #2") = `<cache>/weights/<file>`,
    downloaded from the official URL the first time; anything else = a path to a .pth/.safetensors file."""
    from owai.io import cache_root

    if not weights:
        return None
    known = WEIGHTS.get(backbone, {})
    if weights in known:
        url = known[weights]
        path = cache_root() / "weights" / url.rsplit("/", 1)[-1]
        if not path.is_file():
            _download(url, path)
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
