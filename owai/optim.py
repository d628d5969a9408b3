"""Optimizers that the references use and torch lacks."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class MLXAdamW(torch.optim.Optimizer):
    """AdamW exactly as MLX 0.9 implements it (the Three Moons reference code).

    Unlike torch.optim.AdamW there is no bias correction and eps sits outside the sqrt:
        m <- b1 m + (1-b1) g ;  v <- b2 v + (1-b2) g^2 ;  p <- p (1 - lr wd) - lr m / (sqrt(v) + eps)
    so the first updates are about 3x larger than torch's.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                m, v = state["m"], state["v"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-group["lr"])
        return None


def linear_schedule(start: float, end: float, steps: int):
    """lr at update k (0-based) moves linearly from `start` towards `end` over `steps` updates (MLX's
    `linear_schedule`): start + k (end - start) / steps, held at `end` afterwards."""

    def lr_at(k: int) -> float:
        return start + min(k, steps) * (end - start) / steps

    return lr_at


def step_schedule(lr: float, gamma: float, milestones: Iterable[float], warmup: float = 0.0, warmup_lr: float = 0.0):
    """lr x gamma^(number of milestones <= t): torch's MultiStepLR, where t is whatever the milestones
    count in (updates or fractional epochs) and the lr at a milestone is already multiplied.

    With `warmup` > 0: linear from `warmup_lr` to `lr` over t < warmup first (the distillation's warm-up,
    DeiT's), the milestones still counted from t = 0.
    """
    marks = list(milestones)

    def lr_at(t: float) -> float:
        if t < warmup:
            return warmup_lr + (lr - warmup_lr) * t / warmup
        return lr * gamma ** sum(t >= m for m in marks)

    return lr_at


def warmup_cosine_schedule(
    peak: float, warmup: int, decay_steps: int, min_lr: float, start_lr: float = 0.0, cosine_after_warmup: bool = True
):
    """Linear warmup from `start_lr` over `warmup` updates, cosine from `peak` to `min_lr` at
    update `decay_steps`, then `min_lr`.

    Defaults: the nanoGPT/Memory Mosaics schedule (`get_cosine_lr`; update 0 has lr 0, the cosine
    starts after the warmup). `start_lr=1e-6, cosine_after_warmup=False` is timm's
    `CosineLRScheduler` with `warmup_prefix=False`, which seq_icl (RegBench) uses: the cosine is a
    function of the update count from 0, so it resumes below `peak` after the warmup.
    """

    def lr_at(k: int) -> float:
        if k < warmup:
            return start_lr + (peak - start_lr) * k / warmup
        if k > decay_steps:
            return min_lr
        ratio = (k - warmup) / max(decay_steps - warmup, 1) if cosine_after_warmup else k / max(decay_steps, 1)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - min_lr)

    return lr_at
