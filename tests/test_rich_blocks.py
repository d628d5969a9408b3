"""Building blocks of `owai rich-features` (owai.models.rich, owai.evals.fewshot): Cat_n, probes,
two-stage head, Distill_n loss, cosine head, few-shot episodes and head fitting. Tiny tensors only."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from owai.evals.fewshot import (
    episode_accuracies,
    episode_accuracy,
    fit_heads,
    init_heads,
    mean_ci95,
    sample_episodes,
)
from owai.errors import OwaiError
from owai.models.rich import (
    ConcatFeatures,
    CosineClassifier,
    MultiHeadStudent,
    ProbeHead,
    catsub_logits,
    class_head,
    distill_loss,
    head_kind,
    strip_head,
    two_stage_head,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: spinning threads crawl on a shared CPU


def backbone(seed: int, d_in: int = 12, d_out: int = 4, bn: bool = False) -> nn.Module:
    """A tiny 'image' backbone: (B, 3, 2, 2) -> (B, d_out), optionally with a BatchNorm."""
    torch.manual_seed(seed)
    layers = [nn.Flatten(), nn.Linear(d_in, d_out)] + ([nn.BatchNorm1d(d_out)] if bn else [])
    net = nn.Sequential(*layers)
    net.feature_dim = d_out
    return net


def images(b: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, 3, 2, 2, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------- Cat_n


def test_cat_equals_torch_cat_of_backbone_features():
    nets = [backbone(0, d_out=3), backbone(1, d_out=5), backbone(2, d_out=4)]
    cat = ConcatFeatures(nets)
    x = images()
    z = cat(x)
    assert z.shape == (8, 12) and cat.out_dim == 12 and cat.dims == (3, 5, 4)
    torch.testing.assert_close(z, torch.cat([n(x) for n in nets], dim=1), rtol=0, atol=0)
    for block, n in zip(cat.split(z), nets):
        torch.testing.assert_close(block, n(x), rtol=0, atol=0)


def test_frozen_cat_gets_no_gradient_and_keeps_bn_statistics():
    nets = [backbone(0, bn=True), backbone(1, bn=True)]
    stats = [(n[2].running_mean.clone(), n[2].running_var.clone()) for n in nets]
    cat = ConcatFeatures(nets, frozen=True)
    probe = ProbeHead(cat.out_dim, 3)
    cat.train()  # the wrapper in training mode must still keep frozen backbones in eval mode
    probe.train()
    loss = nn.functional.cross_entropy(probe(cat(images())), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))
    loss.backward()
    for n, (mean, var) in zip(nets, stats):
        assert not n.training
        assert all(p.grad is None for p in n.parameters())
        torch.testing.assert_close(n[2].running_mean, mean, rtol=0, atol=0)
        torch.testing.assert_close(n[2].running_var, var, rtol=0, atol=0)
    assert probe.linear.weight.grad is not None and probe.linear.weight.grad.abs().sum() > 0
    x = images().requires_grad_(True)
    assert cat(x).grad_fn is None  # computed under no_grad: no graph even from an input that wants one


def test_unfrozen_cat_trains_the_backbones():
    """The control: without `frozen` gradients do reach the backbones and BN statistics move."""
    nets = [backbone(0, bn=True), backbone(1, bn=True)]
    before = nets[0][2].running_mean.clone()
    cat = ConcatFeatures(nets)
    cat(images()).sum().backward()
    assert nets[0][1].weight.grad is not None
    assert not torch.equal(nets[0][2].running_mean, before)


def test_cat_on_an_owai_vision_backbone():
    from owai.models.vision import build_backbone

    torch.manual_seed(0)
    net = strip_head(build_backbone("resnet18", num_classes=3))
    cat = ConcatFeatures([net], frozen=True)
    assert cat.dims == (512,)
    assert cat(torch.randn(2, 3, 32, 32)).shape == (2, 512)


def test_cat_errors():
    with pytest.raises(OwaiError, match="n=0"):
        ConcatFeatures([])
    with pytest.raises(OwaiError, match="not a single module"):
        ConcatFeatures(backbone(0))
    net = backbone(0)
    with pytest.raises(OwaiError, match="more than once"):
        ConcatFeatures([net, net])
    with pytest.raises(OwaiError, match="2 backbones but 1"):
        ConcatFeatures([backbone(0), backbone(1)], dims=[4])
    with pytest.raises(OwaiError, match="feature_dim"):
        ConcatFeatures([nn.Sequential(nn.Flatten(), nn.Linear(12, 4))])
    wrong = ConcatFeatures([backbone(0, d_out=4)], dims=[5])
    with pytest.raises(OwaiError, match=r"expected \(8, 5\)"):
        wrong(images())


# ------------------------------------------------------------------------------------------ probes


def test_probe_head_is_bn_then_linear_and_linear_at_inference():
    torch.manual_seed(0)
    probe = ProbeHead(6, 3)
    assert probe.bn.affine and probe.linear.bias.abs().sum() == 0
    assert abs(ProbeHead(2000, 50).linear.weight.std().item() - 0.01) < 5e-4
    probe.train()
    probe(torch.randn(32, 6) * 3 + 1)  # move the running statistics
    with torch.no_grad():
        probe.bn.weight.uniform_(0.5, 2)
        probe.bn.bias.uniform_(-1, 1)
    probe.eval()
    z = torch.randn(5, 6)
    bn = probe.bn
    a = bn.weight / torch.sqrt(bn.running_var + bn.eps)  # (6,) the fixed affine map of eval-mode BN
    expected = (z * a + (bn.bias - bn.running_mean * a)) @ probe.linear.weight.T + probe.linear.bias
    torch.testing.assert_close(probe(z), expected)
    groups = probe.param_groups(5e-4)
    assert groups[0]["weight_decay"] == 5e-4 and groups[1]["weight_decay"] == 0.0
    assert {id(p) for p in groups[1]["params"]} == {id(bn.weight), id(bn.bias)}
    assert not ProbeHead(6, 3, affine=False).param_groups(1e-4)[1:]
    assert isinstance(ProbeHead(6, 3, bn=False).bn, nn.Identity)


def test_two_stage_head_at_init_is_the_logit_average():
    torch.manual_seed(0)
    dims = [4, 6, 5]
    heads = [nn.Linear(d, 7) for d in dims]
    feats = [torch.randn(10, d) for d in dims]
    head = two_stage_head(heads)
    assert (head.in_features, head.out_features) == (15, 7)
    average = torch.stack([h(z) for h, z in zip(heads, feats)]).mean(0)
    torch.testing.assert_close(head(torch.cat(feats, 1)), average, rtol=0, atol=1e-6)
    torch.testing.assert_close(catsub_logits(heads, feats), average, rtol=0, atol=1e-6)
    before = heads[0].weight.clone()
    with torch.no_grad():
        head.weight.add_(1.0)  # the new head owns its tensors
    torch.testing.assert_close(heads[0].weight, before, rtol=0, atol=0)


def test_two_stage_head_over_cat_equals_the_ensemble_of_networks():
    nets = [backbone(0, d_out=3), backbone(1, d_out=5)]
    torch.manual_seed(2)
    heads = [nn.Linear(3, 4), nn.Linear(5, 4)]
    x = images()
    ensemble = (heads[0](nets[0](x)) + heads[1](nets[1](x))) / 2
    cat = ConcatFeatures(nets, frozen=True)
    torch.testing.assert_close(two_stage_head(heads)(cat(x)), ensemble, rtol=0, atol=1e-6)


def test_two_stage_and_catsub_errors():
    with pytest.raises(OwaiError, match="different numbers of classes"):
        two_stage_head([nn.Linear(3, 4), nn.Linear(3, 5)])
    with pytest.raises(OwaiError, match="none"):
        two_stage_head([])
    with pytest.raises(OwaiError, match="not nn.Linear"):
        two_stage_head([nn.Linear(3, 4), nn.Identity()])
    with pytest.raises(OwaiError, match="2 heads but 1"):
        catsub_logits([nn.Linear(3, 4), nn.Linear(3, 4)], [torch.randn(2, 3)])


# --------------------------------------------------------------------------------------- Distill_n


def direct_kl(student: torch.Tensor, teacher: torch.Tensor, tau: float) -> torch.Tensor:
    """tau^2 * mean over the batch of sum_c p_c log(p_c / q_c), p = teacher, q = student at temperature tau."""
    p = torch.exp(teacher / tau) / torch.exp(teacher / tau).sum(1, keepdim=True)
    q = torch.exp(student / tau) / torch.exp(student / tau).sum(1, keepdim=True)
    return tau**2 * (p * torch.log(p / q)).sum(1).mean()


def test_distill_loss_is_the_sum_over_heads_of_tau2_kl_teacher_student():
    g = torch.Generator().manual_seed(0)
    student = [torch.randn(6, 5, generator=g, dtype=torch.float64) * 8 for _ in range(3)]
    teacher = [torch.randn(6, 5, generator=g, dtype=torch.float64) * 8 for _ in range(3)]
    for tau in (10.0, 1.0, 2.5):
        expected = sum(direct_kl(s, t, tau) for s, t in zip(student, teacher))
        torch.testing.assert_close(distill_loss(student, teacher, tau=tau), expected, rtol=1e-12, atol=1e-12)
    assert distill_loss(teacher, teacher).abs() < 1e-12
    # KL(teacher || student), not the reverse
    reverse = sum(direct_kl(t, s, 10.0) for s, t in zip(student, teacher))
    assert not torch.isclose(distill_loss(student, teacher), reverse)


def test_distill_loss_gradients_reach_the_student_only_and_alpha_adds_ce():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(4, 3, generator=g, requires_grad=True)
    t = torch.randn(4, 3, generator=g, requires_grad=True)
    distill_loss([s], [t]).backward()
    assert s.grad is not None and s.grad.abs().sum() > 0 and t.grad is None
    y = torch.tensor([0, 2, 1, 1])
    got = distill_loss([s, s * 2], [t, t], labels=y, alpha=0.8)
    want = sum(0.2 * nn.functional.cross_entropy(a, y) + 0.8 * direct_kl(a, t, 10.0) for a in (s, s * 2))
    torch.testing.assert_close(got, want)


def test_distill_errors():
    a = torch.randn(2, 3)
    with pytest.raises(OwaiError, match="2 student heads but 1"):
        distill_loss([a, a], [a])
    with pytest.raises(OwaiError, match="tau"):
        distill_loss([a], [a], tau=0.0)
    with pytest.raises(OwaiError, match="labels"):
        distill_loss([a], [a], alpha=0.5)
    with pytest.raises(OwaiError, match="expected equal"):
        distill_loss([a], [torch.randn(2, 4)])
    with pytest.raises(OwaiError, match="none"):
        distill_loss([], [])


def test_multi_head_student_shares_one_backbone():
    net = backbone(0, d_out=4)
    student = MultiHeadStudent(net, n_heads=3, n_classes=6)
    x = images()
    out = student(x)
    assert len(out) == 3 and all(o.shape == (8, 6) for o in out)
    z = net(x)
    for o, h in zip(out, student.heads):
        torch.testing.assert_close(o, h(z), rtol=0, atol=0)
    distill_loss(out, [torch.randn(8, 6)] * 3).backward()
    assert net[1].weight.grad is not None
    with pytest.raises(OwaiError, match="at least one head"):
        MultiHeadStudent(net, n_heads=0, n_classes=6)


def test_student_heads_take_their_teachers_kinds():
    """Head i of the kind given for teacher i (Baseline++ teachers: cosine heads), one kind for all, or
    one per head; a list of the wrong length and an unknown kind are errors."""
    net = backbone(0, d_out=4)
    student = MultiHeadStudent(net, n_heads=2, n_classes=6, heads=["cosine", "linear"])
    assert [type(h) for h in student.heads] == [CosineClassifier, nn.Linear]
    assert all(isinstance(h, CosineClassifier) for h in MultiHeadStudent(net, 3, 6, heads="cosine").heads)
    out = student(images())
    assert [o.shape for o in out] == [(8, 6), (8, 6)]
    with pytest.raises(OwaiError, match="2 head kinds for 3 heads"):
        MultiHeadStudent(net, n_heads=3, n_classes=6, heads=["cosine", "linear"])
    with pytest.raises(OwaiError, match="head 'arc': choose from linear, cosine"):
        class_head("arc", 4, 6)


@pytest.mark.parametrize("name, prefix", [("resnet18", "fc."), ("densenet121", "classifier."), ("vit_mini_4", "heads.head.")])
def test_a_backbones_head_is_replaced_in_place_under_its_own_prefix(name, prefix):
    """replace_head puts the cosine head where the backbone's classifier is: the forward gives its logits
    over the backbone's features, and the state dict names it under the classifier's prefix."""
    from owai.models.vision import build_backbone, features, replace_head

    torch.manual_seed(0)
    size = 32
    net = build_backbone(name, num_classes=5).eval()
    assert head_kind(net.state_dict(), prefix) == "linear"
    head = class_head("cosine", net.feature_dim, 5)
    assert replace_head(net, head) is net
    state = net.state_dict()
    assert head_kind(state, prefix) == "cosine" and {prefix + "direction", prefix + "gain"} <= set(state)
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(net(x), head(features(net, x)))
    replace_head(net, None)  # no head: the forward is the features
    assert head_kind(net.state_dict(), prefix) is None
    with torch.no_grad():
        assert net(x).shape == (2, net.feature_dim)


# ------------------------------------------------------------------------------------- cosine head


def test_cosine_classifier_equals_its_formula():
    torch.manual_seed(0)
    head = CosineClassifier(6, 4, scale=3.0)
    with torch.no_grad():
        head.gain.uniform_(0.5, 2.0)
    z = torch.randn(5, 6, dtype=torch.float32)
    u, g = head.direction.detach(), head.gain.detach()
    expected = torch.empty(5, 4)
    for b in range(5):
        for i in range(4):
            cos = torch.dot(u[i], z[b]) / (torch.linalg.norm(u[i]) * (torch.linalg.norm(z[b]) + 1e-5))
            expected[b, i] = 3.0 * g[i] * cos
    torch.testing.assert_close(head(z), expected)
    assert CosineClassifier(6, 5).scale == 2.0 and CosineClassifier(6, 200).scale == 2.0
    assert CosineClassifier(6, 201).scale == 10.0
    fresh = CosineClassifier(6, 4)
    torch.testing.assert_close(fresh.gain, fresh.direction.norm(dim=1))  # initial rows = the plain weight


# ---------------------------------------------------------------------------------------- episodes


def labels_for(n_classes: int = 8, per_class: int = 25, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(n_classes) * 3 + 1, per_class))


@pytest.mark.parametrize("n_shot", [1, 5])
def test_episodes_follow_the_protocol(n_shot):
    labels = labels_for()
    eps = sample_episodes(labels, n_way=5, n_shot=n_shot, n_query=15, n_episodes=40, seed=3)
    assert len(eps) == 40
    for e in eps:
        assert e.classes.shape == (5,) and len(set(e.classes.tolist())) == 5
        assert e.support.shape == (5, n_shot) and e.query.shape == (5, 15)
        for j, c in enumerate(e.classes):
            assert (labels[e.support[j]] == c).all() and (labels[e.query[j]] == c).all()
        every = np.concatenate([e.support.ravel(), e.query.ravel()])
        assert len(np.unique(every)) == every.size  # support and query disjoint, no repeats
    assert len({tuple(e.classes) for e in eps}) > 1


def test_episodes_are_a_function_of_the_seed():
    labels = labels_for()
    a = sample_episodes(labels, n_episodes=10, seed=0)
    b = sample_episodes(torch.as_tensor(labels), n_episodes=10, seed=0)
    c = sample_episodes(labels, n_episodes=10, seed=1)
    same = lambda x, y: all(  # noqa: E731
        np.array_equal(p.classes, q.classes) and np.array_equal(p.support, q.support)
        and np.array_equal(p.query, q.query) for p, q in zip(x, y))
    assert same(a, b)
    assert not same(a, c)
    state = np.random.get_state()[1].copy()
    sample_episodes(labels, n_episodes=3, seed=0)
    assert np.array_equal(np.random.get_state()[1], state)  # the global RNG is untouched


def test_episode_errors():
    labels = labels_for(n_classes=4, per_class=25)
    with pytest.raises(OwaiError, match="5-way episodes need 5 classes, the labels have 4"):
        sample_episodes(labels, n_way=5)
    short = np.concatenate([labels_for(6, 25), np.full(12, 99)])
    with pytest.raises(OwaiError, match="need 20 examples per class; class 99 has 12"):
        sample_episodes(short, n_shot=5, n_query=15)
    with pytest.raises(OwaiError, match="integer class ids"):
        sample_episodes(labels.astype(float))
    with pytest.raises(OwaiError, match="1-D"):
        sample_episodes(labels.reshape(4, 25))
    with pytest.raises(OwaiError, match="n_shot"):
        sample_episodes(labels, n_way=2, n_shot=0)


# ------------------------------------------------------------------------------------ head fitting


@pytest.mark.parametrize("head", ["linear", "cosine"])
def test_stacked_fit_equals_separate_reference_fits(head):
    """fit_heads on E stacked episodes = E separate nn-module fits with torch.optim.SGD (the reference loop)."""
    g = torch.Generator().manual_seed(0)
    n_ep, n_way, n_shot, dim, epochs, bs = 3, 5, 2, 7, 6, 4
    support = torch.randn(n_ep, n_way * n_shot, dim, generator=g, dtype=torch.float64)
    targets = torch.arange(n_way).repeat_interleave(n_shot)
    gens = [torch.Generator().manual_seed(10 + k) for k in range(n_ep)]
    params = init_heads(gens, n_way, dim, head, dtype=torch.float64)
    order = torch.stack([torch.stack([torch.randperm(n_way * n_shot, generator=gk) for _ in range(epochs)])
                         for gk in gens])
    first, second = fit_heads(support, targets, params, order, head=head, lr=0.1, batch_size=bs)
    for k in range(n_ep):
        if head == "linear":
            module = nn.Linear(dim, n_way, dtype=torch.float64)
            module.weight.data.copy_(params[0][k])
            module.bias.data.copy_(params[1][k])
        else:
            module = CosineClassifier(dim, n_way).double()
            module.direction.data.copy_(params[0][k])
            module.gain.data.copy_(params[1][k])
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, dampening=0.9, weight_decay=1e-3)
        for epoch in range(epochs):
            perm = order[k, epoch]
            for start in range(0, n_way * n_shot, bs):
                sel = perm[start:start + bs]
                opt.zero_grad()
                nn.functional.cross_entropy(module(support[k, sel]), targets[sel]).backward()
                opt.step()
        trained = list(module.parameters())
        torch.testing.assert_close(first[k], trained[0].detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(second[k], trained[1].detach(), rtol=1e-10, atol=1e-10)
        assert not torch.equal(first[k], params[0][k])  # it did train


def test_episode_accuracy_separable_and_deterministic():
    n_classes, per_class, dim = 6, 20, 8
    labels = labels_for(n_classes, per_class)
    means = torch.eye(dim)[: n_classes] * 10
    classes = np.unique(labels)
    idx = torch.as_tensor(np.searchsorted(classes, labels))
    g = torch.Generator().manual_seed(0)
    feats = means[idx] + 0.1 * torch.randn(len(labels), dim, generator=g)
    eps = sample_episodes(labels, n_way=5, n_shot=1, n_query=5, n_episodes=6, seed=0)
    for head in ("linear", "cosine"):
        mean, ci = episode_accuracy(feats, eps, head=head, epochs=20)
        assert mean == 1.0 and ci == 0.0
    noise = torch.randn(len(labels), dim, generator=g)
    a = episode_accuracies(noise, eps, epochs=5, seed=4)
    b = episode_accuracies(noise, eps, epochs=5, seed=4, chunk=2)  # chunking does not change results
    np.testing.assert_array_equal(a, b)
    assert a.shape == (6,) and ((a >= 0) & (a <= 1)).all()
    assert not np.array_equal(a, episode_accuracies(noise, eps, epochs=5, seed=5))
    with pytest.raises(OwaiError, match="index example"):
        episode_accuracies(feats[:10], eps)
    with pytest.raises(OwaiError, match="unknown few-shot head"):
        episode_accuracies(feats, eps, head="knn")


def test_mean_ci95_is_the_reference_formula():
    accs = np.array([0.6, 0.8, 1.0, 0.4])
    mean, ci = mean_ci95(accs)
    assert mean == pytest.approx(0.7)
    assert ci == pytest.approx(1.96 * math.sqrt(((accs - 0.7) ** 2).mean()) / 2)
