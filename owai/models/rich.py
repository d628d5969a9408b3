"""Building blocks of rich representations: Cat_n, Distill_n, two-stage fine-tuning, cosine heads.

Thesis §2.2 and App. A.2-A.4 (spec docs: rich_features.md §6). Everything here is a pure module or
function; nothing trains. The pieces and where they are used:

    Cat_n linear probe     ConcatFeatures(backbones, frozen=True) -> ProbeHead (BN1d -> Linear)   §6.2
    joint baseline         JointNetwork: n backbones trained together under one head             A.1
    catsub                 catsub_logits: the mean of n probes, each on one network's features   §6.2
    two-stage fine-tuning  ConcatFeatures(fine-tuned, frozen=True) -> two_stage_head(heads)       §6.4
    Distill_n              MultiHeadStudent (one backbone, n heads) trained with distill_loss     §6.5
                           (self-supervised teachers: heads fit their features, feature_distill_loss)
    SSL pre-training       SimSiam (backbone -> projector -> predictor) with simsiam_loss        A.3.3
    few-shot (Baseline++)  CosineClassifier (Chen et al. 2019 distLinear): episode heads, and     §6.6
                           with class_head the base-class head of pre-training and the student

A backbone is any module mapping a batch of images to (B, d) features. An `owai.models.vision`
backbone becomes one with `strip_head` (its classification head replaced by Identity); its width
is its `feature_dim` attribute, which `ConcatFeatures` and `MultiHeadStudent` read when no
explicit width is given.
"""

from __future__ import annotations

import contextlib
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from owai.errors import OwaiError


def strip_head(model: nn.Module) -> nn.Module:
    """Replace an owai.models.vision backbone's classification head by Identity (in place) and return
    it: its forward is then the (B, feature_dim) penultimate representation. A module that is already
    a feature extractor (a `feature_dim` and no head, e.g. `owai.models.hf_vision.HFImageBackbone`)
    is returned as it is."""
    from owai.models.vision import DenseNet, ResNet, VisionTransformer, _remove_head

    if isinstance(model, JointNetwork):
        model.fc = nn.Identity()
    elif isinstance(model, (ResNet, DenseNet, VisionTransformer)):
        _remove_head(model)
    elif getattr(model, "feature_dim", None) is None:
        raise OwaiError(f"{type(model).__name__} is neither an owai vision backbone nor a feature extractor "
                        "with a feature_dim")
    return model


def _width(module: nn.Module, given: int | None, what: str) -> int:
    """The feature width of `module`: `given`, else its `feature_dim` attribute; OwaiError if neither."""
    dim = given if given is not None else getattr(module, "feature_dim", None)
    if dim is None:
        raise OwaiError(f"{what} ({type(module).__name__}) has no feature_dim attribute: pass its feature width")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise OwaiError(f"{what}: the feature width must be a positive integer, got {dim!r}")
    return dim


def _check_classes(in_dim: int, n_classes: int, what: str) -> None:
    for name, v in (("input width", in_dim), ("number of classes", n_classes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise OwaiError(f"{what}: the {name} must be a positive integer, got {v!r}")


def _modules(items: Sequence[nn.Module], kind: type, what: str, item: str, none: str) -> list:
    """`items` as a non-empty list of `kind` instances; OwaiError naming the first offender."""
    items = list(items)
    if not items:
        raise OwaiError(f"{what} needs at least one {item}, got {none}")
    for i, x in enumerate(items):
        if not isinstance(x, kind):
            raise OwaiError(f"{what} {item} {i} is a {type(x).__name__}, not nn.{kind.__name__}")
    return items


# ------------------------------------------------------------------------------------------- Cat_n


class ConcatFeatures(nn.Module):
    """Cat_n: the concatenation [phi_1(x), ..., phi_n(x)] of n separately trained backbones (TH §2.2).

    With `frozen=True` (linear probing §6.2, the second stage of two-stage fine-tuning §6.4) the
    backbones never train: their parameters get `requires_grad=False`, they stay in eval mode
    whatever `.train()` is called with (BatchNorm running statistics never move), and features are
    computed under `torch.no_grad()`, so a probe trained on top sends no gradient into them. With
    `frozen=False` ("[init]cat" fine-tuning §6.3) the backbones train as ordinary submodules.
    """

    def __init__(self, backbones: Sequence[nn.Module], dims: Sequence[int] | None = None,
                 frozen: bool = False) -> None:
        super().__init__()
        if isinstance(backbones, nn.Module) and not isinstance(backbones, nn.ModuleList):
            raise OwaiError("Cat_n takes a list of backbones, not a single module")
        backbones = _modules(backbones, nn.Module, "Cat_n", "backbone", "n=0")
        if len({id(b) for b in backbones}) != len(backbones):
            raise OwaiError("Cat_n got the same backbone module more than once (its n networks must be distinct)")
        if dims is not None and len(dims) != len(backbones):
            raise OwaiError(f"Cat_n got {len(backbones)} backbones but {len(dims)} feature widths")
        given = list(dims) if dims is not None else [None] * len(backbones)
        self.backbones = nn.ModuleList(backbones)
        self.dims: tuple[int, ...] = tuple(_width(b, d, f"Cat_n backbone {i}")
                                           for i, (b, d) in enumerate(zip(backbones, given)))
        self.out_dim = sum(self.dims)  # = feature_dim of the concatenation
        self.feature_dim = self.out_dim
        self.frozen = bool(frozen)
        if self.frozen:
            self.backbones.requires_grad_(False)
        self.train()

    def train(self, mode: bool = True) -> "ConcatFeatures":
        super().train(mode)
        if self.frozen:
            self.backbones.eval()  # BN running statistics (and dropout) stay fixed
        return self

    def per_network(self, x: Tensor) -> list[Tensor]:
        """The n feature blocks [(B, d_1), ..., (B, d_n)] (for catsub probes)."""
        context = torch.no_grad() if self.frozen else contextlib.nullcontext()
        with context:
            feats = [b(x) for b in self.backbones]  # n x (B, d_i)
        batch = feats[0].shape[0] if feats[0].ndim else None
        for i, (f, d) in enumerate(zip(feats, self.dims)):
            if f.ndim != 2 or f.shape[1] != d or f.shape[0] != batch:
                raise OwaiError(f"Cat_n backbone {i} returned shape {tuple(f.shape)}, expected ({batch}, {d})")
        return feats

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat(self.per_network(x), dim=1)  # (B, sum d_i)

    def split(self, z: Tensor) -> list[Tensor]:
        """Cut a (B, sum d_i) concatenation back into its n (B, d_i) blocks."""
        if z.ndim != 2 or z.shape[1] != self.out_dim:
            raise OwaiError(f"cannot split features of shape {tuple(z.shape)} into widths {list(self.dims)}")
        return list(torch.split(z, list(self.dims), dim=1))


class JointNetwork(nn.Module):
    """n backbones trained jointly as ONE network (Table 2.2's "2xresnet50", TH A.1): their features
    concatenated under one Linear head `fc`, trained end to end by one loss, unlike Cat_n's separately
    trained networks. Its `feature_dim` is the concatenation's; `strip_head` removes `fc`."""

    def __init__(self, backbones: Sequence[nn.Module], n_classes: int) -> None:
        super().__init__()
        self.features = ConcatFeatures(backbones, frozen=False)
        self.feature_dim = self.features.out_dim
        _check_classes(self.feature_dim, n_classes, "joint network")
        self.fc: nn.Module = nn.Linear(self.feature_dim, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.features(x))  # (B, 3, H, W) -> (B, n_classes), or (B, feature_dim) once stripped


class ProbeHead(nn.Module):
    """The linear-probing head (`RegLog`, spec §6.2, TH A.2.1): BatchNorm1d -> Linear.

    The BatchNorm (Goyal et al. 2022) only eases tuning: at inference it is a fixed affine map, so
    BN + Linear is still a linear classifier. The spec's RegLog BN is affine (its parameters are
    the ones `wd_skip_bn` exempts from weight decay), hence `affine=True` by default; `bn=False`
    gives a plain Linear. Linear weights ~ N(0, init_std^2) with init_std = 0.01, bias 0.
    """

    def __init__(self, in_dim: int, n_classes: int, bn: bool = True, affine: bool = True,
                 init_std: float = 0.01, generator: torch.Generator | None = None) -> None:
        super().__init__()
        _check_classes(in_dim, n_classes, "probe head")
        self.bn = nn.BatchNorm1d(in_dim, affine=affine) if bn else nn.Identity()
        self.linear = nn.Linear(in_dim, n_classes)
        nn.init.normal_(self.linear.weight, 0.0, init_std, generator=generator)
        nn.init.zeros_(self.linear.bias)

    def forward(self, z: Tensor) -> Tensor:
        return self.linear(self.bn(z))  # (B, in_dim) -> (B, n_classes)

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Optimizer groups for `wd_skip_bn`: weight decay on the Linear, none on the BN parameters."""
        groups = [{"params": list(self.linear.parameters()), "weight_decay": weight_decay}]
        bn = [p for p in self.bn.parameters()]
        if bn:
            groups.append({"params": bn, "weight_decay": 0.0})
        return groups


def two_stage_head(heads: Sequence[nn.Linear]) -> nn.Linear:
    """The head over Cat_n of n fine-tuned networks, initialised as their logit-average ensemble (§6.4).

    W = [W_1, ..., W_n] / n (concatenated along the input dimension), b = (b_1 + ... + b_n) / n, so
    that W [z_1; ...; z_n] + b = (1/n) sum_i (W_i z_i + b_i). A missing bias counts as 0. The new head
    owns fresh tensors (training it leaves the n heads unchanged). Put no BatchNorm between the
    features and this head: it would break the identity (spec §6.4, pitfall 16).
    """
    heads = _modules(heads, nn.Linear, "two-stage head:", "head", "none")
    classes = [h.out_features for h in heads]
    if len(set(classes)) != 1:
        raise OwaiError(f"two-stage head: the fine-tuned heads have different numbers of classes {classes}")
    n, ref = len(heads), heads[0].weight
    with torch.no_grad():
        weight = torch.cat([h.weight.to(ref) for h in heads], dim=1) / n  # (C, sum d_i)
        bias = sum(h.bias.to(ref) if h.bias is not None else torch.zeros_like(ref[:, 0]) for h in heads) / n  # (C,)
        head = nn.Linear(weight.shape[1], classes[0], device=ref.device, dtype=ref.dtype)
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    return head


def catsub_logits(heads: Sequence[nn.Module], features: Sequence[Tensor]) -> Tensor:
    """catsub (spec §6.2, dashed curves): the mean of n probes' logits, probe i reading only
    network i's features: (1/n) sum_i head_i(z_i). Also "widesub" with blocks of one wide network."""
    heads, features = list(heads), list(features)
    if not heads:
        raise OwaiError("catsub needs at least one head, got none")
    if len(heads) != len(features):
        raise OwaiError(f"catsub got {len(heads)} heads but {len(features)} feature blocks")
    logits = [h(z) for h, z in zip(heads, features)]  # n x (B, C)
    shapes = {tuple(l.shape) for l in logits}
    if len(shapes) != 1:
        raise OwaiError(f"catsub: the probes' logits have different shapes {sorted(shapes)}")
    return torch.stack(logits).mean(0)  # (B, C)


# ----------------------------------------------------------------------------------------- Distill_n


class MultiHeadStudent(nn.Module):
    """Distill_n's student (Fig. 2.6): one backbone Phi with n heads w_i, head i imitating teacher
    network i (spec §6.5). `heads` gives each head's kind (`class_head`): one for all, or one per
    head, so that head i is of teacher i's kind (Baseline++ teachers: cosine). Forward returns the
    n logit tensors [(B, C), ...]."""

    def __init__(self, backbone: nn.Module, n_heads: int, n_classes: int, feature_dim: int | None = None,
                 heads: str | Sequence[str] = "linear") -> None:
        super().__init__()
        if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
            raise OwaiError(f"Distill_n needs at least one head, got n_heads={n_heads!r}")
        kinds = [heads] * n_heads if isinstance(heads, str) else list(heads)
        if len(kinds) != n_heads:
            raise OwaiError(f"Distill_n: {len(kinds)} head kinds for {n_heads} heads")
        dim = _width(backbone, feature_dim, "Distill_n student backbone")
        _check_classes(dim, n_classes, "Distill_n student")
        self.backbone = backbone
        self.feature_dim = dim
        self.heads = nn.ModuleList(class_head(kind, dim, n_classes) for kind in kinds)

    def forward(self, x: Tensor) -> list[Tensor]:
        z = self.backbone(x)  # (B, D), shared by every head
        if z.ndim != 2 or z.shape[1] != self.feature_dim:
            raise OwaiError(f"Distill_n backbone returned shape {tuple(z.shape)}, expected (B, {self.feature_dim})")
        return [h(z) for h in self.heads]  # n x (B, C)


def distill_loss(student_logits: Sequence[Tensor], teacher_logits: Sequence[Tensor], tau: float = 10.0, *,
                 labels: Tensor | None = None, alpha: float = 1.0) -> Tensor:
    """Distill_n objective, TH Eq. A.1 (alpha = 1) / Eq. A.4 (few-shot, alpha < 1), as spec §6.5:

        sum_i [ (1 - alpha) CE(w_i Phi(x), y) + alpha tau^2 KL( s_tau(teacher_i) || s_tau(student_i) ) ]

    KL(teacher || student), both softened at temperature tau (s_tau = softmax(logits / tau)),
    multiplied by tau^2 (keeps gradient magnitudes comparable across tau, Hinton et al. 2015),
    `batchmean` over the batch (sum over classes / B), and **summed** over the n heads. Teacher
    logits are detached: teachers are fixed. student_logits[i], teacher_logits[i]: (B, C).

    Spec/thesis discrepancies (the spec is followed): Eq. A.1 sums over examples x, the code and
    this function average over the batch (a constant factor absorbed by the learning rate); Eq. A.1
    indexes heads i = 0..n, i.e. n + 1 terms, where there are n teachers (a typo: n terms here);
    Eq. A.1 writes the student side as w_i Phi(x) without s_tau, the spec (pitfall 17) softens both.
    """
    student, teacher = list(student_logits), list(teacher_logits)
    if not student:
        raise OwaiError("distill loss needs at least one head, got none")
    if len(student) != len(teacher):
        raise OwaiError(f"distill loss got {len(student)} student heads but {len(teacher)} teachers")
    if not tau > 0:
        raise OwaiError(f"distill temperature tau must be > 0, got {tau}")
    if not 0.0 <= alpha <= 1.0:
        raise OwaiError(f"distill alpha must be in [0, 1], got {alpha}")
    if alpha < 1.0 and labels is None:
        raise OwaiError("distill loss with alpha < 1 needs the labels (cross-entropy term, TH Eq. A.4)")
    total = student[0].new_zeros(())
    for i, (s, t) in enumerate(zip(student, teacher)):
        if s.ndim != 2 or s.shape != t.shape:
            raise OwaiError(f"distill head {i}: student logits {tuple(s.shape)} vs teacher {tuple(t.shape)}, "
                            "expected equal (B, C)")
        log_q = F.log_softmax(s / tau, dim=1)  # (B, C) student, softened
        p = F.softmax(t.detach() / tau, dim=1)  # (B, C) teacher, softened
        kl = F.kl_div(log_q, p, reduction="batchmean")  # sum_c p (log p - log q), averaged over B
        term = alpha * tau**2 * kl
        if alpha < 1.0:
            term = term + (1.0 - alpha) * F.cross_entropy(s, labels)
        total = total + term
    return total


def feature_distill_loss(student_outputs: Sequence[Tensor], teacher_features: Sequence[Tensor]) -> Tensor:
    """Distill_n of self-supervised networks (TH A.3.3, spec §6.5 "SSL variant"): the teachers have no
    class heads (v_i = identity), so head i of the student regresses teacher i's features in direction:

        sum_i mean_x (1 - cos(phi_i(x), w_i Phi(x)))

    student_outputs[i] (B, d_i) = w_i Phi(x); teacher_features[i] (B, d_i) = phi_i(x), detached."""
    student, teacher = list(student_outputs), list(teacher_features)
    if not student:
        raise OwaiError("feature distill loss needs at least one head, got none")
    if len(student) != len(teacher):
        raise OwaiError(f"feature distill loss got {len(student)} student heads but {len(teacher)} teachers")
    total = student[0].new_zeros(())
    for i, (s, t) in enumerate(zip(student, teacher)):
        if s.ndim != 2 or s.shape != t.shape:
            raise OwaiError(f"feature distill head {i}: student {tuple(s.shape)} vs teacher {tuple(t.shape)}, "
                            "expected equal (B, d)")
        total = total + (1.0 - F.cosine_similarity(s, t.detach().to(s.dtype), dim=1)).mean()
    return total


# ------------------------------------------------------------------------------------------ SimSiam


class SimSiam(nn.Module):
    """SimSiam (Chen & He 2021), the self-supervised pre-training of TH Table A.4.

    backbone f (B, 3, S, S) -> (B, d); projector g: `proj_layers` x [Linear (no bias) -> BN -> ReLU]
    with the last block Linear -> BN (no affine, no ReLU), width `dim`, hidden width `hidden_dim`
    (None: d, as Chen & He's ImageNet code; their CIFAR setting is 2048); predictor h:
    Linear(dim, pred_dim, no bias) -> BN -> ReLU -> Linear(pred_dim, dim). Forward on a batch of two
    stacked views (2B, 3, S, S) returns (p, z), each (2B, dim): predictions and projections. Each view
    goes through the network alone, as the reference code calls f(x1) and f(x2): every BatchNorm
    normalises over one view's B images, never over both views together. The backbone alone is the
    representation that is transferred.
    """

    def __init__(self, backbone: nn.Module, dim: int = 2048, pred_dim: int = 512, proj_layers: int = 3,
                 feature_dim: int | None = None, hidden_dim: int | None = None) -> None:
        super().__init__()
        width = _width(backbone, feature_dim, "SimSiam backbone")
        hidden = width if hidden_dim is None else hidden_dim
        for name, v in (("dim", dim), ("pred_dim", pred_dim), ("proj_layers", proj_layers), ("hidden_dim", hidden)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise OwaiError(f"SimSiam {name} must be a positive integer, got {v!r}")
        self.backbone = backbone
        self.feature_dim = width
        layers: list[nn.Module] = []
        fan_in = width
        for _ in range(proj_layers - 1):
            layers += [nn.Linear(fan_in, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True)]
            fan_in = hidden
        layers += [nn.Linear(fan_in, dim, bias=False), nn.BatchNorm1d(dim, affine=False)]
        self.projector = nn.Sequential(*layers)
        self.predictor = nn.Sequential(nn.Linear(dim, pred_dim, bias=False), nn.BatchNorm1d(pred_dim),
                                       nn.ReLU(inplace=True), nn.Linear(pred_dim, dim))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if x.shape[0] % 2:
            raise OwaiError(f"SimSiam takes two stacked views (2B, ...), got a batch of {x.shape[0]}")
        z = [self.projector(self.backbone(view)) for view in x.chunk(2)]  # 2 x (B, dim), BN per view
        p = [self.predictor(zv) for zv in z]
        return torch.cat(p), torch.cat(z)  # (2B, dim) each, view 1 then view 2


def simsiam_loss(p: Tensor, z: Tensor) -> Tensor:
    """SimSiam's symmetrised negative cosine with stop-gradient (Chen & He 2021, Eq. 3-4), for two
    stacked views: p, z (2B, dim) = [view 1; view 2]. L = -(cos(p1, sg(z2)) + cos(p2, sg(z1))) / 2,
    averaged over the batch; its minimum is -1."""
    if p.shape != z.shape or p.ndim != 2 or p.shape[0] % 2:
        raise OwaiError(f"SimSiam loss needs two stacked views of equal shape, got {tuple(p.shape)} and {tuple(z.shape)}")
    p1, p2 = p.chunk(2)
    z1, z2 = z.detach().chunk(2)
    return -0.5 * (F.cosine_similarity(p1, z2, dim=1).mean() + F.cosine_similarity(p2, z1, dim=1).mean())


# ------------------------------------------------------------------------------------- cosine head


def default_cosine_scale(n_classes: int) -> float:
    """The reference's fixed scale: 2 for at most 200 classes, 10 above (Chen et al. `distLinear`)."""
    return 2.0 if n_classes <= 200 else 10.0


def cosine_logits(z: Tensor, direction: Tensor, gain: Tensor, scale: float, eps: float = 1e-5) -> Tensor:
    """h_i = scale * g_i * <u_i, z> / (||u_i|| (||z|| + eps)); batched over leading dimensions.

    z (..., B, D), direction u (..., C, D), gain g (..., C) -> (..., B, C). The eps goes in ||z||
    only, as in the reference; ||u_i|| gets none (weight normalisation computes it exactly).
    """
    z_hat = z / (z.norm(dim=-1, keepdim=True) + eps)  # (..., B, D)
    u_hat = direction / direction.norm(dim=-1, keepdim=True)  # (..., C, D)
    return scale * (z_hat @ u_hat.transpose(-1, -2)) * gain.unsqueeze(-2)  # (..., B, C)


class CosineClassifier(nn.Module):
    """Baseline++'s cosine head (Chen et al. 2019 `distLinear`; TH Eq. A.3; spec §6.6, pitfall 20).

    Weight-normalised rows: a direction u_i (C, D) and a learnable per-class norm g_i (C,), no bias;
    logits = scale * g_i * cos(u_i, z) with ||z|| + 1e-5. The reference fixes scale = 2 when there are
    at most 200 classes (every few-shot head: 5-way; CUB/miniImageNet base classes), 10 otherwise;
    `scale=None` applies that rule. TH Eq. A.3 omits the scale. Initialised like the reference: the
    direction as nn.Linear's default weight, g_i = ||u_i|| (so the initial rows equal that weight).
    """

    def __init__(self, in_dim: int, n_classes: int, scale: float | None = None,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        _check_classes(in_dim, n_classes, "cosine classifier")
        self.scale = float(default_cosine_scale(n_classes) if scale is None else scale)
        if not self.scale > 0:
            raise OwaiError(f"cosine classifier scale must be > 0, got {scale}")
        bound = 1.0 / math.sqrt(in_dim)  # nn.Linear's default kaiming_uniform(a=sqrt(5)) bound
        self.direction = nn.Parameter(torch.empty(n_classes, in_dim).uniform_(-bound, bound, generator=generator))
        self.gain = nn.Parameter(self.direction.detach().norm(dim=1).clone())  # (C,)

    def forward(self, z: Tensor) -> Tensor:
        return cosine_logits(z, self.direction, self.gain, self.scale)  # (B, D) -> (B, C)


HEAD_KINDS = ("linear", "cosine")  # a classifier over features: nn.Linear, or Baseline++'s CosineClassifier


def class_head(kind: str, in_dim: int, n_classes: int) -> nn.Module:
    """A fresh `kind` classifier from (B, in_dim) features to (B, n_classes) logits, initialised from
    the global RNG: "linear" is nn.Linear (Baseline), "cosine" the CosineClassifier (Baseline++,
    Chen et al. 2019: their base-class training uses it too)."""
    if kind == "linear":
        return nn.Linear(in_dim, n_classes)
    if kind == "cosine":
        return CosineClassifier(in_dim, n_classes)
    raise OwaiError(f"head {kind!r}: choose from {', '.join(HEAD_KINDS)}")


def head_kind(state: dict[str, Tensor], prefix: str) -> str | None:
    """The kind of the classifier stored under `prefix` ("fc.", "classifier.", "heads.head.") in a
    state dict: "cosine" (direction, gain), "linear" (weight), None when there is none."""
    if f"{prefix}direction" in state:
        return "cosine"
    return "linear" if f"{prefix}weight" in state else None
