"""Bag-of-k-future-tokens loss (MM v2, thesis §4.2.5.1): value and gradient vs a naive one-hot
implementation of the log-sigmoid form, gradcheck, bag targets (row ends, document boundaries), the
per-logit optimum, empty masks, bf16 logits, saved tensors, and argument errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import owai.models.bag_of_k as bok
from owai.errors import OwaiError
from owai.models.bag_of_k import ALPHA, ETA, K, BagOfKLoss, bag_of_k_loss, bag_targets

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one intra-op thread (conftest)


def naive_bag_of_k_loss(h: torch.Tensor, bags: torch.Tensor, valid: torch.Tensor, eta: float) -> torch.Tensor:
    """The thesis's first form, literally: per valid position, per bag slot i, a one-hot over the
    vocabulary; (1/k) sum_i (1/v)[-eta log s(h_{x_i}) - sum_{j != x_i} log(1 - s(h_j))]."""
    v, k = h.shape[-1], bags.shape[-1]
    h, bags, valid = h.reshape(-1, v).double(), bags.reshape(-1, k), valid.reshape(-1)
    losses = []
    for n in range(h.shape[0]):
        if not valid[n]:
            continue
        onehot = F.one_hot(bags[n], v).double()  # (k, v)
        s = torch.sigmoid(h[n])  # (v,)
        per = -eta * onehot * torch.log(s) - (1 - onehot) * torch.log(1 - s)  # (k, v)
        losses.append(per.sum(1).div(v).mean())
    if not losses:
        return h.sum() * 0
    return torch.stack(losses).mean()


def _inputs(B: int, T: int, k: int, v: int, seed: int = 0, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, v, (B, T), generator=g)
    ids[0, 1 : 1 + k] = ids[0, 1]  # a bag made of one token k times
    h = (scale * torch.randn(B, T, v, generator=g, dtype=torch.float64)).requires_grad_()
    bags, valid = bag_targets(ids, k)
    return h, bags, valid


def test_defaults_are_the_thesis_constants():
    assert (ALPHA, ETA, K) == (0.3, 64000.0, 64)


@pytest.mark.parametrize("k,v,eta", [(1, 5, 1.0), (3, 4, 10.0), (5, 7, 0.5), (8, 11, 64000.0), (4, 3, ETA)])
def test_value_and_gradient_match_naive(k, v, eta):
    h, bags, valid = _inputs(2, 12 + k, k, v, seed=k * 100 + v)
    if k > 1:  # some bags hold a token more than once
        assert (bags[valid].unsqueeze(-1) == bags[valid].unsqueeze(-2)).sum() > valid.sum() * k
    got = bag_of_k_loss(h, bags, valid, eta)
    want = naive_bag_of_k_loss(h, bags, valid, eta)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    (g_got,) = torch.autograd.grad(got, h)
    (g_want,) = torch.autograd.grad(want, h)
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-15)
    assert (g_got[~valid] == 0).all()


def test_chunked_rows_match_one_chunk(monkeypatch):
    h, bags, valid = _inputs(3, 20, 4, 9, seed=7)
    one = bag_of_k_loss(h, bags, valid, 64000.0)
    (g_one,) = torch.autograd.grad(one, h)
    monkeypatch.setattr(bok, "CHUNK_ELEMENTS", 2 * 9 + 1)  # two rows per chunk
    many = bag_of_k_loss(h, bags, valid, 64000.0)
    (g_many,) = torch.autograd.grad(many, h)
    torch.testing.assert_close(many, one, rtol=1e-12, atol=0)
    torch.testing.assert_close(g_many, g_one, rtol=1e-12, atol=0)


def test_gradcheck():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    bags = torch.tensor([[0, 0, 3], [4, 1, 2], [2, 2, 2], [1, 4, 0]])
    assert torch.autograd.gradcheck(lambda x: BagOfKLoss.apply(x, bags, 10.0), (h,))
    valid = torch.tensor([True, False, True, True])
    assert torch.autograd.gradcheck(lambda x: bag_of_k_loss(x, bags, valid, 3.0), (h,))


def test_saves_only_logits_and_bags():
    h = torch.randn(6, 10, requires_grad=True)
    bags = torch.randint(0, 10, (6, 4))
    shapes = []

    def pack(t):
        shapes.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        BagOfKLoss.apply(h, bags, ETA)
    assert sorted(shapes, key=str) == sorted([((6, 10), torch.float32), ((6, 4), torch.int64)], key=str)


# ------------------------------------------------------------------ bag targets


def test_bag_targets_hand_computed_and_last_k_invalid():
    ids = torch.tensor([[10, 11, 12, 13, 14], [5, 6, 7, 8, 9]])
    bags, valid = bag_targets(ids, 2)
    assert bags.shape == (2, 5, 2) and bags.dtype == torch.int64 and valid.dtype == torch.bool
    assert bags[0].tolist() == [[11, 12], [12, 13], [13, 14], [0, 0], [0, 0]]
    assert bags[1, :3].tolist() == [[6, 7], [7, 8], [8, 9]]
    assert valid.tolist() == [[True, True, True, False, False]] * 2
    # position_ids=None is one document per row: the same as a single reset at t = 0
    bags2, valid2 = bag_targets(ids, 2, torch.arange(5).expand(2, 5))
    assert torch.equal(bags2, bags) and torch.equal(valid2, valid)


def test_bag_targets_k_at_least_sequence_length():
    ids = torch.tensor([[1, 2, 3]])
    for k in (3, 4):
        bags, valid = bag_targets(ids, k)
        assert bags.shape == (1, 3, k) and not valid.any() and not bags.any()


def test_bag_targets_respect_document_boundaries():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1]])
    bags, valid = bag_targets(ids, 2, pos)
    # row 0: documents t=0..2 and t=3..6; row 1: t=0..4 and t=5..6
    assert valid.tolist() == [[True, False, False, True, True, False, False],
                              [True, True, True, False, False, False, False]]
    assert bags[0].tolist() == [[2, 3], [0, 0], [0, 0], [5, 6], [6, 7], [0, 0], [0, 0]]
    assert bags[1, :3].tolist() == [[9, 10], [10, 11], [11, 12]]
    # a row that starts mid-document (no reset at t = 0) behaves as if it had one
    _, valid_mid = bag_targets(ids[:1], 2, torch.tensor([[7, 8, 9, 0, 1, 2, 3]]))
    assert valid_mid.tolist() == valid[:1].tolist()


def test_bag_targets_match_a_loop():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (3, 30), generator=g)
    pos = torch.stack([torch.arange(30), torch.arange(30) % 7, (torch.arange(30) % 11) * (torch.arange(30) > 4)])
    k = 4
    bags, valid = bag_targets(ids, k, pos)
    doc = (pos == 0).cumsum(1)
    for b in range(3):
        for t in range(30):
            ok = t + k < 30 and all(doc[b, t + i] == doc[b, t] for i in range(1, k + 1))
            assert valid[b, t].item() == ok
            assert bags[b, t].tolist() == (ids[b, t + 1 : t + 1 + k].tolist() if ok else [0] * k)


# ------------------------------------------------------------------ behaviour


def test_optimum_matches_closed_form():
    v, k, eta = 6, 3, 10.0
    bags = torch.tensor([[1, 1, 4]])  # c_1 = 2, c_4 = 1, others 0
    h = torch.zeros(1, v, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([h], lr=1, max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-15,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = BagOfKLoss.apply(h, bags, eta)
        loss.backward()
        return loss

    opt.step(closure)
    s = torch.sigmoid(h.detach())[0]
    c = torch.tensor([0, 2, 0, 0, 1, 0], dtype=torch.float64)
    target = eta * c / (k + c * (eta - 1))
    torch.testing.assert_close(s[c > 0], target[c > 0], rtol=0, atol=1e-3)
    assert (s[c == 0] < 1e-3).all()


def test_no_valid_rows_gives_zero_and_zero_grad():
    h = torch.randn(2, 3, 7, requires_grad=True)
    bags, valid = bag_targets(torch.randint(0, 7, (2, 3)), 3)
    assert not valid.any()
    loss = bag_of_k_loss(h, bags, valid)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.isfinite(h.grad).all() and (h.grad == 0).all()


def test_bf16_logits_close_to_float32():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 97, (2, 40), generator=g)
    bags, valid = bag_targets(ids, 8)
    h32 = torch.randn(2, 40, 97, generator=g)
    hb = h32.bfloat16().requires_grad_()
    loss_b = bag_of_k_loss(hb, bags, valid)
    assert loss_b.dtype == torch.float32
    loss_b.backward()
    assert hb.grad.dtype == torch.bfloat16 and torch.isfinite(hb.grad.float()).all()
    ha = hb.detach().float().requires_grad_()  # the same values in float32: float32 accumulation
    loss_a = bag_of_k_loss(ha, bags, valid)
    loss_a.backward()
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=0)
    torch.testing.assert_close(hb.grad.float(), ha.grad, rtol=1e-2, atol=1e-6)
    torch.testing.assert_close(loss_b, bag_of_k_loss(h32, bags, valid), rtol=1e-2, atol=0)


def test_extreme_logits_stay_finite():
    h = torch.tensor([[-200.0, 0.0, 200.0, 90.0]], requires_grad=True)
    bags = torch.tensor([[0, 2]])
    loss = BagOfKLoss.apply(h, bags, ETA)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(h.grad).all()


# ------------------------------------------------------------------ errors


def test_bad_arguments_raise_owai_error():
    ids = torch.randint(0, 5, (2, 6))
    h = torch.randn(2, 6, 5)
    bags, valid = bag_targets(ids, 2)
    bad = [
        lambda: bag_targets(ids, 0),
        lambda: bag_targets(ids, 2.0),
        lambda: bag_targets(ids[0], 2),
        lambda: bag_targets(ids, 2, torch.zeros(2, 5, dtype=torch.long)),
        lambda: bag_of_k_loss(h, bags, valid, eta=0.0),
        lambda: bag_of_k_loss(h, bags, valid, eta=-1.0),
        lambda: bag_of_k_loss(h, bags, valid, eta=float("nan")),
        lambda: bag_of_k_loss(h[:, :5], bags, valid),
        lambda: bag_of_k_loss(h, bags, valid[:, :5]),
        lambda: bag_of_k_loss(h, bags, valid.long()),
        lambda: bag_of_k_loss(h[0, 0], bags, valid),
        lambda: bag_of_k_loss(h, bags.float(), valid),
        lambda: bag_of_k_loss(h, bags[..., :0], valid),
        lambda: bag_of_k_loss(h, bags + 5, valid),
        lambda: bag_of_k_loss(h, bags - 1, torch.ones_like(valid)),
        lambda: BagOfKLoss.apply(h[0], bags[0][:5], 2.0),
        lambda: BagOfKLoss.apply(h[0], bags[0].int(), 2.0),
    ]
    for i, call in enumerate(bad):
        with pytest.raises(OwaiError) as err:
            call()
        assert "\n" not in str(err.value), i


@pytest.mark.parametrize("h_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_backward_takes_any_gradient_dtype(h_dtype, grad_dtype):
    """Audit for mixed precision (issue #35): the incoming gradient may arrive in another dtype than
    the loss (a bf16 graph downstream, a scaled fp16 loss): the logit gradient keeps h's dtype and
    equals the float32 one."""
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 50, (2, 30), generator=g)
    bags, _ = bag_targets(ids, 4)
    bags = bags.reshape(-1, 4)
    h = torch.randn(60, 50, generator=g).to(h_dtype).requires_grad_()
    out = BagOfKLoss.apply(h, bags, ETA)
    (grad,) = torch.autograd.grad(out, h, torch.tensor(3.0, dtype=grad_dtype))
    assert grad.dtype == h_dtype
    ref = h.detach().float().requires_grad_()
    (want,) = torch.autograd.grad(BagOfKLoss.apply(ref, bags, ETA), ref, torch.tensor(3.0))
    torch.testing.assert_close(grad.float(), want, rtol=1e-2, atol=1e-5)
