"""Every invariance penalty against an independent direct computation on a small batch (spec §2).

The references below are written out plainly (explicit loops, closed-form logistic gradients,
per-example autograd) and never call the implementation they check.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from owai.errors import OwaiError
from owai.methods import invariance as inv
from owai.methods.invariance import EnvBatch

DT = torch.float64


def sigmoid(t: float | torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-torch.as_tensor(t, dtype=DT)))


def bce(f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of logits f, written out."""
    total = 0
    for fi, yi in zip(f.reshape(-1), y.reshape(-1)):
        p = sigmoid(fi)
        total = total - (yi * torch.log(p) + (1 - yi) * torch.log(1 - p))
    return total / f.numel()


def data(n_envs: int = 3, n: int = 8, d_in: int = 5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n + e, d_in, generator=gen, dtype=DT) for e in range(n_envs)]  # unequal sizes
    ys = [(torch.rand(n + e, generator=gen) < 0.5).to(DT) for e in range(n_envs)]
    return xs, ys


def logistic(d_in: int = 5, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(d_in, generator=gen, dtype=DT).requires_grad_()
    b = torch.randn((), generator=gen, dtype=DT).requires_grad_()
    return w, b


def closed_form_grad(x, y, w, b):
    """Gradient of the mean BCE of the logistic model x @ w + b w.r.t. (w, b), flattened."""
    r = sigmoid(x @ w + b) - y
    gw = sum(r[i] * x[i] for i in range(len(y))) / len(y)
    gb = r.sum() / len(y)
    return torch.cat([gw, gb.reshape(1)])


def batches(xs, ys, w, b):
    return [EnvBatch(x @ w + b, y) for x, y in zip(xs, ys)]


# --- registry and interface -----------------------------------------------------------------------


def test_registry_names_aliases_and_errors():
    assert set(inv.REGISTRY) == {
        "erm", "irm", "vrex", "sd", "iga", "fish", "fishr", "clove", "rerm", "groupdro", "mmd", "coral",
        "rsc", "lff", "pi",
    }
    for name, cls in inv.REGISTRY.items():
        assert issubclass(cls, inv.Penalty) and cls.name == name
        pen = inv.make_penalty(name)
        assert pen.weight == cls.default_weight and pen.anneal_iters == 0
    assert isinstance(inv.make_penalty("gm"), inv.Fish)
    assert isinstance(inv.make_penalty("irmv1"), inv.IRMv1)
    assert isinstance(inv.make_penalty("dro"), inv.RERM)
    with pytest.raises(OwaiError, match="unknown invariance method 'rsc2'"):
        inv.make_penalty("rsc2")
    for bad in ("1e4", True, [1e4], float("nan"), -1.0):
        with pytest.raises(OwaiError, match="penalty weight"):
            inv.make_penalty("irm", weight=bad)
    with pytest.raises(OwaiError, match="anneal_iters"):
        inv.make_penalty("vrex", anneal_iters=-3)
    with pytest.raises(OwaiError, match="'fishr'"):
        inv.make_penalty("fishr", centered=True)  # the option is spelled `centred`
    with pytest.raises(OwaiError, match="empty"):
        inv.make_penalty("erm").objective([EnvBatch(torch.zeros(0), torch.zeros(0))], 0)


def test_spec_defaults():
    """Weights, anneal values, L2 scopes and minibatches as spec §0/§2 and Tables A.11 state."""
    assert inv.L2 == {"coloredmnist": 0.0011, "inverse-coloredmnist": 1e-4}
    assert {n: c.default_anneal_val for n, c in inv.REGISTRY.items() if n in ("irm", "vrex", "sd", "iga", "fishr", "clove")} == dict.fromkeys(
        ("irm", "vrex", "sd", "iga", "fishr", "clove"), 1.0
    )
    assert inv.Fish.default_anneal_val == 0.0
    assert inv.make_penalty("sd").weight == 100 and inv.make_penalty("fish").weight == 1e-3
    assert inv.CLOvE.minibatch == 512 and inv.make_penalty("clove").width == 0.4
    assert inv.CLOvE.l2_scope == "none" and inv.Fishr.l2_scope == "featurizer" and inv.IRMv1.l2_scope == "all"
    assert inv.make_penalty("fishr").centred is False and inv.make_penalty("irm").unbiased is False
    assert all(not inv.make_penalty(n).reset_optimizer for n in inv.REGISTRY)


def test_l2_scopes():
    feat = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    head = [torch.tensor([4.0]), torch.tensor(0.5)]
    coeff = 0.0011
    all_sq = 1 + 4 + 9 + 16 + 0.25
    assert inv.make_penalty("irm").l2(coeff, feat, head).item() == pytest.approx(coeff * all_sq)
    assert inv.make_penalty("fishr").l2(coeff, feat, head).item() == pytest.approx(coeff * 14)
    assert inv.make_penalty("clove").l2(coeff, feat, head).item() == 0.0


# --- schedule -------------------------------------------------------------------------------------


def test_schedule_weight_divisor_and_reset():
    pen = inv.make_penalty("vrex", weight=1e4, anneal_iters=100)
    assert [pen.weight_at(t) for t in (0, 99, 100, 500)] == [1.0, 1.0, 1e4, 1e4]
    assert [pen.divisor_at(t) for t in (0, 100)] == [1.0, 1e4]
    assert not any(pen.reset_optimizer_at(t) for t in range(200))  # RFC ColoredMNIST keeps Adam's state
    db = inv.make_penalty("vrex", weight=1e4, anneal_iters=100, reset_optimizer=True, divide_by_weight=False)
    assert [t for t in range(200) if db.reset_optimizer_at(t)] == [100]
    assert db.divisor_at(150) == 1.0
    small = inv.make_penalty("irm", weight=0.5)
    assert small.divisor_at(0) == 1.0  # only weights > 1 rescale
    off = inv.make_penalty("irm", weight=1e4, anneal_iters=50, anneal_val=0.0)  # the thesis's "turned off"
    assert off.weight_at(49) == 0.0 and off.weight_at(50) == 1e4
    fish = inv.make_penalty("fish", anneal_iters=10)
    assert fish.weight_at(9) == 0.0
    sd = inv.make_penalty("sd", weight=100, anneal_iters=20)
    assert sd.divisor_at(19) == 1.0 and sd.divisor_at(20) == 100 * 500  # lr_s2_decay after annealing
    assert inv.make_penalty("sd", weight=100).divisor_at(5) == 100  # no /500 without annealing


def test_objective_composition_before_and_after_anneal():
    xs, ys = data(2)
    w, b = logistic()
    pen = inv.make_penalty("vrex", weight=1e4, anneal_iters=3)
    l2 = torch.tensor(0.25, dtype=DT)
    n1, n2 = bce(xs[0] @ w + b, ys[0]), bce(xs[1] @ w + b, ys[1])
    var = (n1 - n2) ** 2 / 2
    before = pen.objective(batches(xs, ys, w, b), step=2, l2=l2)
    after = pen.objective(batches(xs, ys, w, b), step=3, l2=l2)
    assert before.loss.item() == pytest.approx((n1 + n2 + 0.25 + 1.0 * var).item(), rel=1e-12)
    assert after.loss.item() == pytest.approx(((n1 + n2 + 0.25 + 1e4 * var) / 1e4).item(), rel=1e-12)
    assert after.weight == 1e4 and after.divisor == 1e4
    assert after.risk.item() == pytest.approx((n1 + n2).item())
    mean_risk = inv.make_penalty("vrex", weight=2.0, risk_reduction="mean").objective(batches(xs, ys, w, b), 0)
    assert mean_risk.loss.item() == pytest.approx((((n1 + n2) / 2 + 2 * var) / 2).item(), rel=1e-12)


def test_erm_and_rerm():
    xs, ys = data(3)
    w, b = logistic()
    nlls = [bce(x @ w + b, y) for x, y in zip(xs, ys)]
    erm = inv.make_penalty("erm").objective(batches(xs, ys, w, b), step=7, l2=0.5)
    pooled = bce(torch.cat([x @ w + b for x in xs]), torch.cat(ys))  # RFC erm_train: one mean over the pooled batch
    assert erm.loss.item() == pytest.approx(pooled.item() + 0.5, rel=1e-12)
    assert erm.penalty.item() == 0.0
    summed = inv.make_penalty("erm", risk_reduction="sum").objective(batches(xs, ys, w, b), step=7, l2=0.5)
    assert summed.loss.item() == pytest.approx(sum(n.item() for n in nlls) + 0.5, rel=1e-12)
    with pytest.raises(OwaiError, match="pooled"):
        inv.make_penalty("erm", risk_reduction="max")
    rerm = inv.make_penalty("rerm").objective(batches(xs, ys, w, b), step=0, l2=0.5)
    assert rerm.loss.item() == pytest.approx(max(n.item() for n in nlls) + 0.5, rel=1e-12)
    rerm.loss.backward()
    worst = max(range(3), key=lambda e: nlls[e].item())
    ref = closed_form_grad(xs[worst], ys[worst], w.detach(), b.detach())  # the hard max routes one gradient
    assert torch.allclose(torch.cat([w.grad, b.grad.reshape(1)]), ref)


def test_groupdro_exponentiated_weights_over_steps():
    xs, ys = data(3)
    w, b = logistic()
    pen = inv.make_penalty("groupdro", eta=0.5)
    q = [1 / 3] * 3
    for step in range(3):
        with torch.no_grad():
            w += 0.1  # the losses change between steps
        nlls = [bce(x @ w + b, y).item() for x, y in zip(xs, ys)]
        q = [qi * math.exp(0.5 * li) for qi, li in zip(q, nlls)]
        q = [qi / sum(q) for qi in q]
        out = pen.objective(batches(xs, ys, w, b), step)
        assert out.loss.item() == pytest.approx(sum(qi * li for qi, li in zip(q, nlls)), rel=1e-10)
        assert pen.q.tolist() == pytest.approx(q, rel=1e-10)
    state = pen.state_dict()
    fresh = inv.make_penalty("groupdro", eta=0.5)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.q, pen.q)


# --- IRMv1 ----------------------------------------------------------------------------------------


def test_irm_equals_closed_form_and_its_gradient():
    gen = torch.Generator().manual_seed(3)
    f = [torch.randn(9 + e, generator=gen, dtype=DT).requires_grad_() for e in range(2)]
    y = [(torch.rand(9 + e, generator=gen) < 0.5).to(DT) for e in range(2)]
    pen = inv.make_penalty("irm")
    got = pen.penalty([EnvBatch(fe, ye) for fe, ye in zip(f, y)])
    # d/ds BCE(s f) at s = 1 = mean_i (sigma(f_i) - y_i) f_i
    g = [sum((sigmoid(fe[i]) - ye[i]) * fe[i] for i in range(len(ye))) / len(ye) for fe, ye in zip(f, y)]
    ref = (g[0] ** 2 + g[1] ** 2) / 2
    assert got.item() == pytest.approx(ref.item(), rel=1e-12)
    # second order: the penalty's gradient w.r.t. the logits equals the closed form's
    got_grad = torch.autograd.grad(got, f)
    ref_grad = torch.autograd.grad(ref, f)
    for a, c in zip(got_grad, ref_grad):
        assert torch.allclose(a, c)


def test_irm_unbiased_even_odd_product():
    gen = torch.Generator().manual_seed(4)
    f = [torch.randn(10, generator=gen, dtype=DT) for _ in range(3)]
    y = [(torch.rand(10, generator=gen) < 0.5).to(DT) for _ in range(3)]
    got = inv.make_penalty("irm", unbiased=True).penalty([EnvBatch(fe, ye) for fe, ye in zip(f, y)])

    def g(idx, fe, ye):
        return sum((sigmoid(fe[i]) - ye[i]) * fe[i] for i in idx) / len(idx)

    ref = sum(g(range(0, 10, 2), fe, ye) * g(range(1, 10, 2), fe, ye) for fe, ye in zip(f, y)) / 3
    assert got.item() == pytest.approx(ref.item(), rel=1e-12)


def test_irm_two_logit_cross_entropy():
    gen = torch.Generator().manual_seed(5)
    f = torch.randn(7, 2, generator=gen, dtype=DT)
    y = torch.randint(0, 2, (7,), generator=gen)
    got = inv.make_penalty("irm").penalty([EnvBatch(f, y)])
    # d/ds CE(s f) at s = 1 = mean_i (sum_k softmax_k(f_i) f_ik - f_i,y_i)
    g = 0
    for i in range(7):
        e = torch.exp(f[i])
        g = g + (e / e.sum() * f[i]).sum() - f[i, y[i]]
    assert got.item() == pytest.approx((g / 7).pow(2).item(), rel=1e-12)


# --- vREx, SD -------------------------------------------------------------------------------------


def test_vrex_variances():
    xs, ys = data(3)
    w, b = logistic()
    L = [bce(x @ w + b, y).item() for x, y in zip(xs, ys)]
    two = inv.make_penalty("vrex").penalty(batches(xs[:2], ys[:2], w, b)).item()
    assert two == pytest.approx((L[0] - L[1]) ** 2 / 2, rel=1e-12)
    m = sum(L) / 3
    three = inv.make_penalty("vrex").penalty(batches(xs, ys, w, b)).item()
    assert three == pytest.approx(sum((l - m) ** 2 for l in L) / 2, rel=1e-12)
    biased = inv.make_penalty("vrex", biased=True).penalty(batches(xs, ys, w, b)).item()
    assert biased == pytest.approx(sum((l - m) ** 2 for l in L) / 3, rel=1e-12)
    groups = inv.make_penalty("vrex", divide_by_groups=True).penalty(batches(xs, ys, w, b)).item()
    assert groups == pytest.approx(sum((l - m) ** 2 for l in L) / 2 / 3, rel=1e-12)


def test_sd_squared_logits():
    xs, ys = data(3)
    w, b = logistic()
    got = inv.make_penalty("sd").penalty(batches(xs, ys, w, b)).item()
    ref = 0.0
    for x in xs:
        ref += sum(((x[i] @ w + b) ** 2).item() for i in range(len(x))) / len(x)
    assert got == pytest.approx(ref, rel=1e-12)


# --- IGA and Fish (gradient penalties) ------------------------------------------------------------


def test_iga_equals_closed_form_gradients():
    xs, ys = data(3)
    w, b = logistic()
    got = inv.make_penalty("iga").penalty(batches(xs, ys, w, b), params=[w, b])
    g = [closed_form_grad(x, y, w, b) for x, y in zip(xs, ys)]
    gbar = ((g[0] + g[1] + g[2]) / 3).detach()
    ref = sum(((ge - gbar) ** 2).sum() for ge in g)
    assert got.item() == pytest.approx(ref.item(), rel=1e-10)
    # second order, with the mean gradient treated as a constant
    for a, c in zip(torch.autograd.grad(got, [w, b]), torch.autograd.grad(ref, [w, b])):
        assert torch.allclose(a, c)


def test_fish_gm_equals_minus_pairwise_inner_products():
    xs, ys = data(3)
    w, b = logistic()
    got = inv.make_penalty("fish").penalty(batches(xs, ys, w, b), params=[w, b])
    g = [closed_form_grad(x, y, w, b) for x, y in zip(xs, ys)]
    ref = -(torch.dot(g[0], g[1]) + torch.dot(g[0], g[2]) + torch.dot(g[1], g[2]))
    assert got.item() == pytest.approx(ref.item(), rel=1e-10)
    for a, c in zip(torch.autograd.grad(got, [w, b]), torch.autograd.grad(ref, [w, b])):
        assert torch.allclose(a, c)


def test_gradient_penalties_skip_frozen_parameters():
    xs, ys = data(2)
    w, b = logistic()
    frozen = w.detach()  # a frozen featurizer's weights: requires_grad False
    envs = batches(xs, ys, frozen, b)
    got = inv.make_penalty("iga").penalty(envs, params=[frozen, b])
    gb = [closed_form_grad(x, y, frozen, b)[-1] for x, y in zip(xs, ys)]  # bias part only
    mean = ((gb[0] + gb[1]) / 2).detach()
    assert got.item() == pytest.approx(((gb[0] - mean) ** 2 + (gb[1] - mean) ** 2).item(), rel=1e-10)


def test_fish_is_not_computed_while_off():
    xs, ys = data(2)
    w, b = logistic()
    pen = inv.make_penalty("fish", anneal_iters=5)
    out = pen.objective(batches(xs, ys, w, b), step=0)  # params omitted: would fail if computed
    assert out.penalty.item() == 0.0 and out.weight == 0.0
    with pytest.raises(ValueError, match="params"):
        pen.objective(batches(xs, ys, w, b), step=5)


# --- Fishr ----------------------------------------------------------------------------------------


def _fishr_reference(zs, ys, head: torch.nn.Linear, centred: bool, multiclass: bool):
    """Per-example gradients of the head by autograd, one example at a time."""
    vs = []
    for z, y in zip(zs, ys):
        per_example = []
        for i in range(z.shape[0]):
            out = head(z[i : i + 1])
            loss = F.cross_entropy(out, y[i : i + 1]) if multiclass else bce(out, y[i : i + 1])
            gw, gb = torch.autograd.grad(loss, [head.weight, head.bias], create_graph=True)
            per_example.append(torch.cat([gw, gb[:, None]], dim=1).reshape(-1))  # rows: [w_k, b_k]
        G = torch.stack(per_example)
        if centred:
            G = G - G.mean(dim=0, keepdim=True)
        vs.append((G**2).mean(dim=0))
    vbar = sum(vs) / len(vs)
    return sum(((v - vbar) ** 2).sum() for v in vs)


@pytest.mark.parametrize("centred", [False, True])
@pytest.mark.parametrize("classes", [1, 3])
def test_fishr_equals_per_example_autograd(centred, classes):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(6)
    zs = [torch.randn(6 + e, 4, generator=gen, dtype=DT).requires_grad_() for e in range(3)]
    if classes == 1:
        ys = [(torch.rand(6 + e, generator=gen) < 0.5).to(DT) for e in range(3)]
    else:
        ys = [torch.randint(0, classes, (6 + e,), generator=gen) for e in range(3)]
    head = torch.nn.Linear(4, classes).to(DT)
    pen = inv.make_penalty("fishr", centred=centred)
    got = pen.penalty([EnvBatch(head(z), y, z) for z, y in zip(zs, ys)])
    ref = _fishr_reference(zs, ys, head, centred, classes > 1)
    assert got.item() == pytest.approx(ref.item(), rel=1e-10)
    assert got.item() > 0
    # differentiable into the features (the featurizer) and the head, like the per-example version
    wrt = [*zs, head.weight, head.bias]
    for a, c in zip(torch.autograd.grad(got, wrt), torch.autograd.grad(ref, wrt)):
        assert torch.allclose(a, c)


# --- CLOvE ----------------------------------------------------------------------------------------


def _mmce_reference(conf, correct, width, unbiased=False):
    n = len(conf)
    total = 0
    for i in range(n):
        for j in range(n):
            if unbiased and i == j:
                continue
            k = torch.exp(-torch.abs(conf[i] - conf[j]) / width)
            total = total + (correct[i] - conf[i]) * (correct[j] - conf[j]) * k
    return total / (n * (n - 1) if unbiased else n**2)


@pytest.mark.parametrize("unbiased", [False, True])
def test_clove_binary_mmce(unbiased):
    gen = torch.Generator().manual_seed(7)
    f = [torch.randn(8 + e, generator=gen, dtype=DT).requires_grad_() for e in range(2)]
    y = [(torch.rand(8 + e, generator=gen) < 0.5).to(DT) for e in range(2)]
    got = inv.make_penalty("clove", unbiased=unbiased).penalty([EnvBatch(fe, ye) for fe, ye in zip(f, y)])
    ref = 0
    for fe, ye in zip(f, y):
        conf, correct = [], []
        for i in range(len(ye)):
            p = sigmoid(fe[i])
            pred = 1.0 if fe[i].item() > 0 else 0.0
            conf.append(p if pred == 1.0 else 1 - p)
            correct.append(1.0 if pred == ye[i].item() else 0.0)  # a constant: no gradient
        ref = ref + _mmce_reference(conf, correct, 0.4, unbiased)
    assert got.item() == pytest.approx(ref.item(), rel=1e-12)
    for a, c in zip(torch.autograd.grad(got, f), torch.autograd.grad(ref, f)):
        assert torch.allclose(a, c)


def test_clove_multiclass_and_width():
    gen = torch.Generator().manual_seed(8)
    f = torch.randn(9, 3, generator=gen, dtype=DT)
    y = torch.randint(0, 3, (9,), generator=gen)
    got = inv.make_penalty("clove", width=0.1).penalty([EnvBatch(f, y)])
    conf, correct = [], []
    for i in range(9):
        p = torch.exp(f[i]) / torch.exp(f[i]).sum()
        k = int(torch.argmax(p))
        conf.append(p[k])
        correct.append(1.0 if k == int(y[i]) else 0.0)
    assert got.item() == pytest.approx(_mmce_reference(conf, correct, 0.1).item(), rel=1e-12)


def test_clove_calibrated_batch_is_zero():
    # every prediction has confidence 0.8 and 8 of 10 are right: perfectly calibrated
    f = torch.full((10,), math.log(0.8 / 0.2), dtype=DT)
    y = torch.tensor([1.0] * 8 + [0.0] * 2, dtype=DT)
    assert abs(inv.make_penalty("clove").penalty([EnvBatch(f, y)]).item()) < 1e-15
    wrong = torch.tensor([1.0] * 3 + [0.0] * 7, dtype=DT)  # overconfident
    assert inv.make_penalty("clove").penalty([EnvBatch(f, wrong)]).item() == pytest.approx((0.3 - 0.8) ** 2)


# --- MMD, CORAL -----------------------------------------------------------------------------------


def _feature_envs(n_envs=3, d=3, seed=9):
    gen = torch.Generator().manual_seed(seed)
    zs = [torch.randn(5 + e, d, generator=gen, dtype=DT) + e for e in range(n_envs)]
    return [EnvBatch(torch.zeros(len(z), dtype=DT), torch.zeros(len(z), dtype=DT), z) for z in zs], zs


def test_mmd_gaussian_kernels():
    envs, zs = _feature_envs()
    gammas = [1e-3, 1e-2, 1e-1, 1, 10, 100, 1000]

    def k(a, c):
        d2 = sum((a[t] - c[t]) ** 2 for t in range(len(a)))
        return sum(math.exp(-g * d2) for g in gammas)

    def mean_k(A, B):
        return sum(k(a.tolist(), c.tolist()) for a in A for c in B) / (len(A) * len(B))

    pairs = [mean_k(A, A) + mean_k(B, B) - 2 * mean_k(A, B) for A, B in itertools.combinations(zs, 2)]
    got = inv.make_penalty("mmd").penalty(envs).item()
    assert got == pytest.approx(sum(pairs) / len(pairs), rel=1e-9)


def test_coral_mean_and_covariance():
    envs, zs = _feature_envs(d=2)

    def stats(Z):
        n = len(Z)
        mu = [sum(Z[i][a] for i in range(n)) / n for a in range(2)]
        cov = [[sum((Z[i][a] - mu[a]) * (Z[i][c] - mu[c]) for i in range(n)) / (n - 1) for c in range(2)] for a in range(2)]
        return mu, cov

    pairs = []
    for A, B in itertools.combinations([z.tolist() for z in zs], 2):
        (ma, ca), (mb, cb) = stats(A), stats(B)
        pairs.append(sum((ma[a] - mb[a]) ** 2 for a in range(2)) / 2
                     + sum((ca[a][c] - cb[a][c]) ** 2 for a in range(2) for c in range(2)) / 4)
    got = inv.make_penalty("coral").penalty(envs).item()
    assert got == pytest.approx(sum(pairs) / len(pairs), rel=1e-10)


# --- RSC, LfF, PI -------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """numpy's default (linear interpolation) percentile, written out."""
    s = sorted(values)
    pos = q / 100 * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def test_rsc_masks_and_loss():
    gen = torch.Generator().manual_seed(10)
    torch.manual_seed(0)
    head = torch.nn.Linear(5, 2).to(DT)
    zs = [torch.randn(5 + e, 5, generator=gen, dtype=DT).requires_grad_() for e in range(2)]
    ys = [torch.randint(0, 2, (5 + e,), generator=gen) for e in range(2)]
    envs = [EnvBatch(head(z), y, z) for z, y in zip(zs, ys)]
    f, b = 0.75, 0.5  # both percentiles land exactly on a value: checks the strict `<`
    pen = inv.make_penalty("rsc", f=f, b=b, anneal_iters=3)
    # before annealing: plain cross-entropy over the concatenated environments
    z_all, y_all = torch.cat(zs), torch.cat(ys)
    ce = F.cross_entropy(head(z_all), y_all)
    assert pen.objective(envs, 2, head=head).loss.item() == pytest.approx(ce.item(), rel=1e-12)

    got = pen.objective(envs, 3, head=head).loss
    W = head.weight.detach()
    rows = []
    changes = []
    for i in range(len(y_all)):
        g = W[y_all[i]].tolist()  # d(logit_y)/dz for a linear head
        thr = percentile(g, (1 - f) * 100)
        mask_f = [1.0 if gk < thr else 0.0 for gk in g]
        z = z_all[i].detach()
        p = torch.softmax(head(z), 0)[y_all[i]]
        p_muted = torch.softmax(head(z * torch.tensor(mask_f, dtype=DT)), 0)[y_all[i]]
        rows.append(mask_f)
        changes.append((p - p_muted).item())
    thr_b = percentile(changes, (1 - b) * 100)
    ref = 0
    n_kept_all = 0
    for i in range(len(y_all)):
        keep_all = changes[i] < thr_b
        n_kept_all += keep_all
        mask = torch.tensor([1.0 if (m or keep_all) else 0.0 for m in rows[i]], dtype=DT)
        ref = ref - torch.log_softmax(head(z_all[i] * mask), 0)[y_all[i]]
    ref = ref / len(y_all)
    assert 0 < n_kept_all < len(y_all) and 0 < sum(map(sum, rows)) < 5 * len(y_all)  # non-trivial masks
    assert got.item() == pytest.approx(ref.item(), rel=1e-12)
    wrt = [*zs, head.weight]
    for a, c in zip(torch.autograd.grad(got, wrt), torch.autograd.grad(ref, wrt)):
        assert torch.allclose(a, c)


def test_lff_ema_weights_and_gce():
    gen = torch.Generator().manual_seed(11)
    q, alpha = 0.3, 0.7
    pen = inv.make_penalty("lff", weight=q, anneal_iters=1)
    y = [torch.randint(0, 2, (4 + e,), generator=gen) for e in range(2)]
    y_all = torch.cat(y)
    n = len(y_all)
    d0 = [torch.randn(4 + e, 2, generator=gen, dtype=DT) for e in range(2)]
    pre = pen.objective([EnvBatch(d, t) for d, t in zip(d0, y)], step=0)
    assert pre.loss.item() == pytest.approx(F.cross_entropy(torch.cat(d0), y_all).item(), rel=1e-12)

    def ce(logits, i):
        return -torch.log_softmax(logits[i], 0)[y_all[i]]

    ema_b, ema_d = [0.0] * n, [0.0] * n
    for step in (1, 2):
        lb_env = [torch.randn(4 + e, 2, generator=gen, dtype=DT).requires_grad_() for e in range(2)]
        ld_env = [torch.randn(4 + e, 2, generator=gen, dtype=DT).requires_grad_() for e in range(2)]
        got = pen.objective([EnvBatch(d, t) for d, t in zip(ld_env, y)], step,
                            biased=[EnvBatch(bb, t) for bb, t in zip(lb_env, y)]).loss
        lb, ld = torch.cat(lb_env), torch.cat(ld_env)
        for i in range(n):
            if step == 1:  # the first update takes the raw loss
                ema_b[i], ema_d[i] = ce(lb, i).item(), ce(ld, i).item()
            else:
                ema_b[i] = alpha * ema_b[i] + (1 - alpha) * ce(lb, i).item()
                ema_d[i] = alpha * ema_d[i] + (1 - alpha) * ce(ld, i).item()
        ref = 0
        for i in range(n):
            same = [k for k in range(n) if y_all[k] == y_all[i]]
            nb = ema_b[i] / max(ema_b[k] for k in same)
            nd = ema_d[i] / max(ema_d[k] for k in same)
            w = nb / (nb + nd + 1e-8)
            p_y = torch.softmax(lb[i], 0)[y_all[i]].item()
            ref = ref + ce(lb, i) * (p_y**q * q) / n + w * ce(ld, i) / n
        assert got.item() == pytest.approx(ref.item(), rel=1e-12)
        wrt = [*lb_env, *ld_env]
        for a, c in zip(torch.autograd.grad(got, wrt), torch.autograd.grad(ref, wrt)):
            assert torch.allclose(a, c)
    state = pen.state_dict()
    assert state["ema_b"].tolist() == pytest.approx(ema_b)


def test_pi_groups_own_and_cross():
    ys = [torch.tensor([1, 0, 1, 1]), torch.tensor([0, 0, 1])]
    preds = [[torch.tensor([1, 1, 1, 1]), torch.tensor([0, 0, 1])],   # model 1 on env 1, env 2
             [torch.tensor([0, 0, 0, 0]), torch.tensor([1, 0, 0])]]   # model 2 on env 1, env 2
    own = inv.pi_groups(ys, preds)
    assert [(name, e, m.tolist()) for name, e, m in own] == [
        ("model1-env1-correct", 0, [True, False, True, True]),
        ("model1-env1-incorrect", 0, [False, True, False, False]),
        ("model2-env2-correct", 1, [False, True, False]),
        ("model2-env2-incorrect", 1, [True, False, True]),
    ]
    cross = inv.make_penalty("pi", cross=True).groups(ys, preds)
    # model 1 is right on all of env 2: its empty "incorrect" group is dropped
    assert [(name, e, m.tolist()) for name, e, m in cross] == [
        ("model1-env2-correct", 1, [True, True, True]),
        ("model2-env1-correct", 0, [False, True, False, False]),
        ("model2-env1-incorrect", 0, [True, False, True, True]),
    ]
    pen = inv.make_penalty("pi")
    assert isinstance(pen, inv.RERM) and pen.steps1 is None and not pen.cross and pen.stopping == "fixed"


@pytest.mark.parametrize("options, fragment", [
    ({"stopping": "early"}, "pi stopping must be 'fixed' or 'validation'"),
    ({"val_every": 0}, "pi val_every must be an int >= 1"),
    ({"stopping": "validation", "holdout": 0.0}, "needs a hold-out"),
    ({"steps1": 2.5}, "pi steps1 must be an int >= 1"),
    ({"stage_data": "grey"}, "pi stage_data must be 'coloured' or 'gray'"),
])
def test_pi_bad_options_are_user_errors(options, fragment):
    with pytest.raises(OwaiError, match=fragment):
        inv.make_penalty("pi", **options)


# --- every method through a training step of the ColoredMNIST model shape -------------------------


@pytest.mark.parametrize("name", sorted(inv.REGISTRY))
@pytest.mark.parametrize("frozen", [False, True])
def test_one_adam_step_per_method(name, frozen):
    import copy

    torch.manual_seed(0)
    two_logits = name in ("rsc", "lff")
    featurizer = torch.nn.Sequential(torch.nn.Linear(392, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU())
    head = torch.nn.Linear(16, 2 if two_logits else 1)
    biased = copy.deepcopy(torch.nn.Sequential(featurizer, head))
    if frozen:
        featurizer.requires_grad_(False)
    trainable = [p for p in [*featurizer.parameters(), *head.parameters()] if p.requires_grad]
    opt = torch.optim.Adam(trainable + list(biased.parameters()), lr=5e-4)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.rand(32, 392, generator=gen) for _ in range(2)]
    ys = [(torch.rand(32, generator=gen) < 0.5).float() for _ in range(2)]
    if two_logits:
        ys = [y.long() for y in ys]
    pen = inv.make_penalty(name, anneal_iters=1)
    before = [p.detach().clone() for p in featurizer.parameters()]
    for step in range(2):
        zs = [featurizer(x) for x in xs]
        envs = [EnvBatch(head(z), y, z) for z, y in zip(zs, ys)]
        out = pen.objective(envs, step, params=trainable,
                            l2=pen.l2(0.0011, featurizer.parameters(), head.parameters()),
                            head=head, biased=[EnvBatch(biased(x), y) for x, y in zip(xs, ys)])
        opt.zero_grad()
        out.loss.backward()
        assert math.isfinite(out.loss.item()) and all(torch.isfinite(p.grad).all() for p in trainable)
        opt.step()
    after = list(featurizer.parameters())
    assert all(torch.equal(a, c) for a, c in zip(before, after)) == frozen
