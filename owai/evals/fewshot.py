"""Few-shot episodes and their evaluation (Chen et al. 2019 protocol; TH A.4; spec §6.6).

An episode draws n_way distinct novel classes, then per class n_shot support and n_query query
examples without overlap (a random permutation of the class, first n_shot, next n_query). A fresh
head (linear softmax regression, or the cosine head) is fitted on the support features of the
frozen backbone and scored on the query features; the score is the mean accuracy over the
episodes, reported with the reference's 95% interval 1.96 * std / sqrt(n_episodes).

Head fitting follows the reference (spec §6.6): SGD(momentum 0.9, dampening 0.9, weight decay
1e-3), batch 4, 100 epochs over the support set, lr 0.1 (TH A.4.2; Chen et al.'s released code
uses 0.01, hence the `lr` argument). All episodes are fitted at once: the parameters of E episodes
are stacked as (E, C, D) tensors and the loss is the sum over episodes of each episode's mean
cross-entropy, so each slice receives exactly its own episode's gradient and, SGD being elementwise,
follows exactly the trajectory of a separate per-episode fit (tests/test_rich_blocks.py checks it).

Randomness never touches the global RNGs: episodes come from numpy's Generator keyed by `seed`;
the k-th episode's head initialisation and shuffling from a torch Generator keyed by (seed, k).
Accuracies are fractions in [0, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from owai.errors import OwaiError
from owai.models.rich import cosine_logits, default_cosine_scale

HEADS = ("linear", "cosine")


@dataclass(frozen=True)
class Episode:
    """One n_way-way n_shot-shot episode; indices point into the labels it was drawn from. Episode
    label j (what the head predicts) is the class `classes[j]`; row j of support/query is its examples."""

    classes: np.ndarray  # (n_way,) original class ids
    support: np.ndarray  # (n_way, n_shot) example indices
    query: np.ndarray  # (n_way, n_query) example indices


def _positive(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise OwaiError(f"few-shot {name} must be a positive integer, got {v!r}")
    return int(v)


def _labels(labels: np.ndarray | Tensor) -> np.ndarray:
    arr = labels.detach().cpu().numpy() if isinstance(labels, Tensor) else np.asarray(labels)
    if arr.ndim != 1 or arr.size == 0:
        raise OwaiError(f"few-shot labels must be a non-empty 1-D array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise OwaiError(f"few-shot labels must be integer class ids, got dtype {arr.dtype}")
    return arr


def sample_episodes(labels: np.ndarray | Tensor, n_way: int = 5, n_shot: int = 1, n_query: int = 15,
                    n_episodes: int = 600, seed: int = 0) -> list[Episode]:
    """Draw `n_episodes` episodes from the examples' class ids `labels` (N,), deterministically in `seed`.

    Per episode: n_way distinct classes uniformly without replacement; per class a random
    permutation of its examples, the first n_shot as support and the next n_query as query
    (disjoint). Every class must have at least n_shot + n_query examples (the reference's test
    splits do); a class that has not is an error, not skipped.
    """
    arr = _labels(labels)
    n_way, n_shot, n_query, n_episodes = (_positive(k, v) for k, v in
                                          (("n_way", n_way), ("n_shot", n_shot), ("n_query", n_query),
                                           ("n_episodes", n_episodes)))
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise OwaiError(f"few-shot seed must be a non-negative integer, got {seed!r}")
    classes, counts = np.unique(arr, return_counts=True)  # sorted: the draw does not depend on label order
    if len(classes) < n_way:
        raise OwaiError(f"{n_way}-way episodes need {n_way} classes, the labels have {len(classes)}")
    need = n_shot + n_query
    small = classes[counts < need]
    if len(small):
        c = small[0]
        raise OwaiError(f"{n_shot}-shot episodes with {n_query} queries need {need} examples per class; "
                        f"class {c} has {int(counts[classes == c][0])} ({len(small)} classes too small)")
    order = np.argsort(arr, kind="stable")  # examples grouped by class, increasing index within a class
    members = np.split(order, np.cumsum(counts)[:-1])  # members[j]: indices of classes[j]
    rng = np.random.default_rng(int(seed))
    episodes = []
    for _ in range(n_episodes):
        picked = rng.choice(len(classes), size=n_way, replace=False)  # (n_way,) positions in `classes`
        drawn = np.stack([rng.permutation(members[j])[:need] for j in picked])  # (n_way, n_shot + n_query)
        episodes.append(Episode(classes=classes[picked], support=drawn[:, :n_shot], query=drawn[:, n_shot:]))
    return episodes


# ---------------------------------------------------------------------------------- head fitting


def episode_generator(seed: int, k: int) -> torch.Generator:
    """The torch Generator of the k-th episode of an evaluation keyed by `seed`."""
    state = np.random.SeedSequence([int(seed), int(k)]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def init_heads(generators: Sequence[torch.Generator], n_way: int, dim: int, head: str = "linear",
               dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Fresh heads, one per generator, initialised like the reference (nn.Linear's default):
    U(-1/sqrt(D), 1/sqrt(D)) weights; linear: bias from the same law; cosine: gain = row norms.
    Returns (weight (E, C, D), bias (E, C)) or (direction (E, C, D), gain (E, C))."""
    if head not in HEADS:
        raise OwaiError(f"unknown few-shot head {head!r}; known: {', '.join(HEADS)}")
    bound = 1.0 / math.sqrt(dim)
    weights, seconds = [], []
    for g in generators:
        w = torch.empty(n_way, dim, dtype=dtype).uniform_(-bound, bound, generator=g)  # (C, D)
        weights.append(w)
        seconds.append(torch.empty(n_way, dtype=dtype).uniform_(-bound, bound, generator=g)
                       if head == "linear" else w.norm(dim=1))
    return torch.stack(weights), torch.stack(seconds)


def head_logits(z: Tensor, params: tuple[Tensor, Tensor], head: str, scale: float | None = None) -> Tensor:
    """Logits of stacked heads: z (E, B, D), params as `init_heads` -> (E, B, C)."""
    first, second = params
    if head == "linear":
        return z @ first.transpose(1, 2) + second.unsqueeze(1)  # (E, B, C)
    if head == "cosine":
        return cosine_logits(z, first, second, default_cosine_scale(first.shape[1]) if scale is None else scale)
    raise OwaiError(f"unknown few-shot head {head!r}; known: {', '.join(HEADS)}")


def fit_heads(support: Tensor, targets: Tensor, params: tuple[Tensor, Tensor], order: Tensor, *,
              head: str = "linear", lr: float = 0.1, batch_size: int = 4, momentum: float = 0.9,
              dampening: float = 0.9, weight_decay: float = 1e-3, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Fit E heads at once with the reference's SGD; returns the trained (detached) parameters.

    support (E, S, D) features, targets (S,) episode labels shared by every episode, params as
    `init_heads` (not modified), order (E, epochs, S): the visiting order of the support set in each
    epoch (a permutation per episode and epoch). Each epoch walks the order in minibatches of
    `batch_size` (the last one smaller when batch_size does not divide S).
    """
    n_ep, n_support, _ = support.shape
    if order.shape[0] != n_ep or order.shape[2] != n_support or targets.shape != (n_support,):
        raise OwaiError(f"few-shot fit: support {tuple(support.shape)}, targets {tuple(targets.shape)} and "
                        f"order {tuple(order.shape)} do not agree")
    first, second = (p.detach().clone().requires_grad_(True) for p in params)
    opt = torch.optim.SGD([first, second], lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
    z = support.detach()
    with torch.enable_grad():
        for epoch in range(order.shape[1]):
            for start in range(0, n_support, batch_size):
                idx = order[:, epoch, start:start + batch_size]  # (E, b)
                zb = torch.gather(z, 1, idx.unsqueeze(-1).expand(-1, -1, z.shape[2]))  # (E, b, D)
                logits = head_logits(zb, (first, second), head, scale)  # (E, b, C)
                ce = F.cross_entropy(logits.flatten(0, 1), targets[idx].flatten(), reduction="none")  # (E*b,)
                loss = ce.view(n_ep, -1).mean(1).sum()  # sum over episodes of each episode's mean loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
    return first.detach(), second.detach()


def episode_accuracies(features: Tensor | np.ndarray, episodes: Sequence[Episode], *, head: str = "linear",
                       lr: float = 0.1, epochs: int = 100, batch_size: int = 4, momentum: float = 0.9,
                       dampening: float = 0.9, weight_decay: float = 1e-3, scale: float | None = None,
                       seed: int = 0, chunk: int = 100) -> np.ndarray:
    """Query accuracy of a fresh head fitted on each episode's support features: (n_episodes,).

    features (N, D) are the frozen backbone's features of the examples the episodes index. Episodes
    are processed `chunk` at a time (memory only: results do not depend on it).
    """
    z_all = torch.as_tensor(features)
    if z_all.ndim != 2 or not z_all.is_floating_point():
        raise OwaiError(f"few-shot features must be a floating (N, D) array, got {z_all.dtype} {tuple(z_all.shape)}")
    episodes = list(episodes)
    if not episodes:
        raise OwaiError("few-shot evaluation needs at least one episode")
    if head not in HEADS:
        raise OwaiError(f"unknown few-shot head {head!r}; known: {', '.join(HEADS)}")
    epochs, batch_size, chunk = (_positive(k, v) for k, v in
                                 (("epochs", epochs), ("batch_size", batch_size), ("chunk", chunk)))
    shapes = {(e.support.shape, e.query.shape) for e in episodes}
    if len(shapes) != 1:
        raise OwaiError("few-shot episodes must all have the same n_way, n_shot and n_query")
    (n_way, n_shot), (_, n_query) = shapes.pop()
    top = max(max(int(e.support.max()), int(e.query.max())) for e in episodes)
    if top >= len(z_all):
        raise OwaiError(f"few-shot episodes index example {top} but there are {len(z_all)} features")
    y_support = torch.arange(n_way).repeat_interleave(n_shot)  # (S,)
    y_query = torch.arange(n_way).repeat_interleave(n_query)  # (Q,)
    accs = []
    for lo in range(0, len(episodes), chunk):
        part = episodes[lo:lo + chunk]
        support = z_all[torch.as_tensor(np.stack([e.support.reshape(-1) for e in part]))]  # (E, S, D)
        query = z_all[torch.as_tensor(np.stack([e.query.reshape(-1) for e in part]))]  # (E, Q, D)
        gens = [episode_generator(seed, lo + i) for i in range(len(part))]
        params = init_heads(gens, n_way, z_all.shape[1], head, dtype=z_all.dtype)
        order = torch.stack([torch.argsort(torch.rand(epochs, len(y_support), generator=g), dim=1)
                             for g in gens])  # (E, epochs, S)
        trained = fit_heads(support, y_support, params, order, head=head, lr=lr, batch_size=batch_size,
                            momentum=momentum, dampening=dampening, weight_decay=weight_decay, scale=scale)
        with torch.no_grad():
            pred = head_logits(query, trained, head, scale).argmax(-1)  # (E, Q)
        accs.append((pred == y_query).double().mean(1).numpy())
    return np.concatenate(accs)


def mean_ci95(accs: np.ndarray | Sequence[float]) -> tuple[float, float]:
    """(mean, 1.96 * std / sqrt(n)) over episodes, std with ddof=0 as the reference's np.std."""
    a = np.asarray(accs, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise OwaiError(f"need a non-empty 1-D array of accuracies, got shape {a.shape}")
    return float(a.mean()), float(1.96 * a.std() / math.sqrt(a.size))


def episode_accuracy(features: Tensor | np.ndarray, episodes: Sequence[Episode],
                     **kwargs: object) -> tuple[float, float]:
    """Mean query accuracy over the episodes and its 95% interval (see `episode_accuracies`)."""
    return mean_ci95(episode_accuracies(features, episodes, **kwargs))
