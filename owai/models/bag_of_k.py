"""Bag-of-k-future-tokens auxiliary objective of Memory Mosaics v2 (thesis §4.2.5.1, spec §6.3).

A second linear head gives logits h in R^v at every position t. The target is the *bag* (unordered
multiset) of the next k tokens x_{t+1..t+k}. The loss at one position is

    L_bag = (1/k) sum_{i=1..k} (1/v) [ -eta log s(h_{x_i}) - sum_{j != x_i} log(1 - s(h_j)) ]
          = (1/(k v)) [ k sum_{j=1..v} softplus(h_j) + sum_{i=1..k} ((eta-1) softplus(h_{x_i}) - eta h_{x_i}) ]

(s = sigmoid; the second line uses log s(h) = h - softplus(h) and log(1 - s(h)) = -softplus(h)).
The training objective is L = L_next + ALPHA * L_bag with the thesis defaults ALPHA = 0.3,
ETA = 64000, K = 64, L_bag averaged over the valid positions.

Duplicates. The bag is a multiset: a token that occurs c_j times in the next k tokens contributes
c_j positive terms, and in the other k - c_j terms it is a negative. Per logit the optimum is
s(h_j) = eta c_j / (k + c_j (eta - 1)) (about 0.999 for c_j = 1 with the defaults) and s(h_j) -> 0
for tokens outside the bag.

Valid positions (`bag_targets`). A position t is valid iff t+1..t+k all lie inside the sequence and
in the same document as token t: the last k positions of every row, and the last k positions of
every document, have no bag. Documents start where position_ids == 0 (HF's packed-sequence
convention); position_ids=None means one document per row.

Memory. Written with plain autograd, the loss keeps (N, v) intermediates (softplus(h), its
broadcast gradient, the gather's scattered gradient) and, in the log-sigmoid form, a
(N x k x v) one-hot: at N = 4096 positions, k = 64, v = 50304 that is 53 GB in float32.
`BagOfKLoss` is one autograd node that saves only the logits h (N, v, in their own dtype) and the
bag indices (N, k, int64). Its backward is closed form,

    dL/dh_j = (1/(k v)) [ k s(h_j) + c_j ((eta - 1) s(h_j) - eta) ]

computed as k s(h) plus a scatter_add at the bag indices of (eta - 1) s(h_{x_i}) - eta (duplicates
add up to c_j on their own). Forward and backward work over row chunks of at most
`CHUNK_ELEMENTS` logits, accumulating in float32 (float64 for float64 logits) whatever the dtype
of h, so the only full-size tensor besides h is the gradient itself. The N x k x v tensor is never
built.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from owai.errors import OwaiError

ALPHA = 0.3  # weight of L_bag in L = L_next + ALPHA * L_bag
ETA = 64000.0  # weight of the positive terms
K = 64  # bag size: the next K tokens

CHUNK_ELEMENTS = 1 << 22  # logits per chunk (16 MiB of float32 temporaries)


def bag_targets(input_ids: torch.Tensor, k: int, position_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The bag of the next `k` tokens at every position, and which positions have a full bag.

    Returns bags (B, T, k) int64, bags[b, t, i] = input_ids[b, t+1+i] (0 where invalid), and
    valid (B, T) bool: t+1..t+k are inside the row and in the same document as token t.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise OwaiError(f"bag_of_k: k must be a positive integer, got {k!r}")
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise OwaiError(f"bag_of_k: input_ids must be an integer (B, T) tensor, got {input_ids.dtype} {tuple(input_ids.shape)}")
    if position_ids is not None and tuple(position_ids.shape) != tuple(input_ids.shape):
        raise OwaiError(f"bag_of_k: position_ids shape {tuple(position_ids.shape)} != input_ids shape {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    ids = input_ids.long()
    padded = F.pad(ids[:, 1:], (0, k))  # (B, T-1+k): x_{t+1}, ..., then k zeros
    bags = padded.unfold(1, k, 1)  # (B, T, k) view: window t = x_{t+1..t+k}
    t = torch.arange(T, device=ids.device)
    valid = (t + k < T).expand(B, T)  # (B, T) the whole bag inside the row
    if position_ids is not None:
        doc = (position_ids == 0).cumsum(1)  # (B, T) document id, non-decreasing along the row
        # ids are non-decreasing: t and t+k in one document <=> t..t+k all in it
        same = torch.zeros(B, T, dtype=torch.bool, device=ids.device)
        if k < T:
            same[:, : T - k] = doc[:, k:] == doc[:, : T - k]
        valid = valid & same
    bags = bags.masked_fill(~valid.unsqueeze(-1), 0)  # (B, T, k) a fresh tensor, 0 where invalid
    return bags, valid.clone()


def _check_eta(eta: float) -> float:
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not math.isfinite(eta) or eta <= 0:
        raise OwaiError(f"bag_of_k: eta must be a positive finite number, got {eta!r}")
    return float(eta)


class BagOfKLoss(torch.autograd.Function):
    """Sum over rows of the per-position bag-of-k loss; saves only h and the bag indices."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, bags: torch.Tensor, eta: float) -> torch.Tensor:
        # h (N, v) logits, any float dtype; bags (N, k) int64 in [0, v)
        eta = _check_eta(eta)
        if h.dim() != 2 or not h.dtype.is_floating_point:
            raise OwaiError(f"bag_of_k: h must be a floating (N, v) tensor, got {h.dtype} {tuple(h.shape)}")
        if bags.dim() != 2 or bags.dtype != torch.int64:
            raise OwaiError(f"bag_of_k: bags must be an int64 (N, k) tensor, got {bags.dtype} {tuple(bags.shape)}")
        N, v = h.shape
        k = bags.shape[1]
        if bags.shape[0] != N:
            raise OwaiError(f"bag_of_k: h has {N} rows but bags has {bags.shape[0]}")
        if k < 1 or v < 1:
            raise OwaiError(f"bag_of_k: need k >= 1 and v >= 1, got k={k}, v={v}")
        if bags.device != h.device:
            raise OwaiError(f"bag_of_k: bags on {bags.device} but h on {h.device}")
        if bags.numel():
            lo, hi = torch.aminmax(bags)
            if lo.item() < 0 or hi.item() >= v:
                raise OwaiError(f"bag_of_k: bag indices must be in [0, {v}), got [{lo.item()}, {hi.item()}]")
        acc = torch.promote_types(h.dtype, torch.float32)
        total = torch.zeros((), dtype=acc, device=h.device)
        rows = max(1, CHUNK_ELEMENTS // v)
        for s in range(0, N, rows):
            hc = h[s:s + rows].to(acc)  # (n, v)
            hb = hc.gather(1, bags[s:s + rows])  # (n, k) h at the bag tokens
            total += k * F.softplus(hc).sum() + ((eta - 1.0) * F.softplus(hb) - eta * hb).sum()
        ctx.save_for_backward(h, bags)
        ctx.eta = eta
        return total / (k * v)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        h, bags = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        eta = ctx.eta
        N, v = h.shape
        k = bags.shape[1]
        acc = torch.promote_types(h.dtype, torch.float32)
        scale = grad_out.to(acc) / (k * v)  # 0-dim
        grad = torch.empty_like(h, memory_format=torch.contiguous_format)  # (N, v) in h's dtype
        rows = max(1, CHUNK_ELEMENTS // v)
        for s in range(0, N, rows):
            hc = h[s:s + rows].to(acc)  # (n, v)
            bc = bags[s:s + rows]  # (n, k)
            out = grad[s:s + rows]  # (n, v) a view of the result
            g = torch.sigmoid(hc, out=out) if out.dtype == acc else torch.sigmoid(hc)  # (n, v) s(h_j)
            g.mul_(k * scale)  # k s(h_j) / (k v)
            pos = torch.sigmoid(hc.gather(1, bc)).mul_(eta - 1.0).sub_(eta).mul_(scale)  # (n, k)
            g.scatter_add_(1, bc, pos)  # + c_j ((eta-1) s(h_j) - eta) / (k v): duplicates add up
            if g is not out:
                out.copy_(g)
        return grad, None, None


def bag_of_k_loss(h: torch.Tensor, bags: torch.Tensor, valid: torch.Tensor, eta: float = ETA) -> torch.Tensor:
    """Mean of the bag-of-k loss over the valid positions (0.0, with a zero gradient, if none).

    h (B, T, v) or (N, v) logits of the bag head; bags (B, T, k) or (N, k) and valid (B, T) or (N,)
    as returned by `bag_targets`. Returns a 0-dim tensor (float32 for half/bfloat16 logits).
    When some rows are invalid their valid rows of h are gathered first (one (n, v) copy, which is
    what the loss node saves); with all rows valid h is used as is.
    """
    eta = _check_eta(eta)
    if h.dim() not in (2, 3) or not h.dtype.is_floating_point:
        raise OwaiError(f"bag_of_k: h must be a floating (B, T, v) or (N, v) tensor, got {h.dtype} {tuple(h.shape)}")
    lead = tuple(h.shape[:-1])
    if bags.dim() != h.dim() or tuple(bags.shape[:-1]) != lead:
        raise OwaiError(f"bag_of_k: bags shape {tuple(bags.shape)} does not match h shape {tuple(h.shape)}")
    if tuple(valid.shape) != lead or valid.dtype != torch.bool:
        raise OwaiError(f"bag_of_k: valid must be a bool tensor of shape {lead}, got {valid.dtype} {tuple(valid.shape)}")
    if bags.dtype.is_floating_point or bags.dtype == torch.bool:
        raise OwaiError(f"bag_of_k: bags must be an integer tensor, got {bags.dtype}")
    v, k = h.shape[-1], bags.shape[-1]
    if k < 1:
        raise OwaiError("bag_of_k: bags must hold k >= 1 tokens per position")
    h2 = h.reshape(-1, v)  # (N, v), a view when h is contiguous
    bags2 = bags.reshape(-1, k).long()  # (N, k)
    keep = valid.reshape(-1)  # (N,)
    if not bool(keep.all()):
        h2, bags2 = h2[keep], bags2[keep]  # (n, v), (n, k): the valid rows only
    total = BagOfKLoss.apply(h2, bags2, eta)
    return total / max(h2.shape[0], 1)
