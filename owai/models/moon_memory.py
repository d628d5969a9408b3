"""The three-moons memory network (thesis Fig 3.4): one layer of Nh associative memories.

Keys and values live in C^3 (Nh=1, one 6-real-dim memory) or C^1 each (Nh=3, three 2-real-dim
memories). Three complex 3x3 matrices W_phi (keys), W_psi (values) and W_z (output) are the only
parameters: 3 x 3 x 2 x 3 = 54 reals. Memory unit (thesis eq 4.1, fixed beta):

    k_t = W_phi x_t          v_t = W_psi x_{t+1}        (the value peeks one step ahead)
    y_t = sum_{j<t} softmax_j(beta <k_t, k_j>) v_j      (y_0 = 0: nothing stored yet)
    z_t = W_z y_t            predicts x_{t+1}

Keys are not normalised and are also the queries. <a, b> is the real dot product of the encoded
vectors, i.e. Re sum conj(a) b. The analytic solution W_phi = W_psi = W_z = I is exact once a
memory has seen a full period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MoonMemoryConfig:
    n_moons: int = 3  # complex input dimension
    n_heads: int = 1  # 1 (one C^3 memory) or 3 (three C^1 memories)
    beta: float = 50.0  # fixed kernel bandwidth

    def __post_init__(self) -> None:
        if self.n_heads < 1 or self.n_moons % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide n_moons={self.n_moons}")


class ComplexLinear(nn.Module):
    """y = W x for a complex n x n matrix W = r - i s, acting on real-encoded vectors.

    Stored as the real and imaginary parts (r, s), so the parameter count is the complex one
    (2 n^2). The real 2n x 2n matrix has 2x2 blocks [[r, s], [-s, r]]; the reference keeps a raw
    real matrix and projects it onto exactly this subspace on every forward.
    """

    J = torch.tensor([[0.0, 1.0], [-1.0, 0.0]])

    def __init__(self, n: int) -> None:
        super().__init__()
        # reference init: a raw real block [[a, b], [c, d]] ~ U(+-1/sqrt(2n)), projected: r=(a+d)/2, s=(b-c)/2
        bound = 1 / math.sqrt(2 * n)
        a, b, c, d = (torch.empty(n, n).uniform_(-bound, bound) for _ in range(4))
        self.r = nn.Parameter((a + d) / 2)  # (n, n)
        self.s = nn.Parameter((b - c) / 2)  # (n, n)

    def real_matrix(self) -> torch.Tensor:
        """(2n, 2n) real matrix with blocks [[r, s], [-s, r]]."""
        eye = torch.eye(2, dtype=self.r.dtype, device=self.r.device)
        return torch.kron(self.r, eye) + torch.kron(self.s, self.J.to(self.r))

    def complex_matrix(self) -> torch.Tensor:
        """(n, n) complex matrix W with y = W z for z_j = x[2j] + i x[2j+1]."""
        return torch.complex(self.r, -self.s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., 2n) -> (..., 2n)
        return x @ self.real_matrix().T

    @torch.no_grad()
    def set_identity(self) -> None:
        self.r.copy_(torch.eye(self.r.shape[0]))
        self.s.zero_()


class MoonMemory(nn.Module):
    def __init__(self, config: MoonMemoryConfig) -> None:
        super().__init__()
        self.config = config
        self.key = ComplexLinear(config.n_moons)  # W_phi
        self.value = ComplexLinear(config.n_moons)  # W_psi
        self.out = ComplexLinear(config.n_moons)  # W_z

    @property
    def head_dim(self) -> int:
        return 2 * self.config.n_moons // self.config.n_heads

    def _heads(self, t: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, H, T, hd)
        B, T, _ = t.shape
        return t.view(B, T, self.config.n_heads, self.head_dim).transpose(1, 2)

    def _merge(self, t: torch.Tensor) -> torch.Tensor:  # (B, H, T, hd) -> (B, T, D)
        B, H, T, hd = t.shape
        return t.transpose(1, 2).reshape(B, T, H * hd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, 2n) -> z (B, T, 2n), z_t predicting x_{t+1}."""
        B, T, D = x.shape
        k = self._heads(self.key(x))  # (B, H, T, hd); queries are the keys
        v = self.value(x)  # (B, T, D): W_psi x_t
        v = self._heads(torch.cat([v[:, 1:], v.new_zeros(B, 1, D)], dim=1))  # v_j = W_psi x_{j+1}, last = 0
        # position t reads j < t. Shift by one: queries 1..T-1 against keys 0..T-2 under an ordinary
        # causal mask, so no T x T mask is built and SDPA's fused kernels apply.
        y = F.scaled_dot_product_attention(
            k[:, :, 1:], k[:, :, :-1], v[:, :, :-1], is_causal=True, scale=self.config.beta
        )  # (B, H, T-1, hd)
        y = torch.cat([y.new_zeros(B, y.shape[1], 1, self.head_dim), y], dim=2)  # y_0 = 0
        return self.out(self._merge(y))

    @torch.no_grad()
    def rollout(
        self, seq: torch.Tensor, taus: torch.Tensor, n_gen: int, zero_recent_values: bool = False
    ) -> torch.Tensor:
        """Autoregressive predictions after the prompt seq[:, :tau], for every tau in `taus` at once.

        seq (B, L, D) true observations; taus (N,) prompt lengths (1 <= tau <= L).
        Returns (B, N, n_gen, D): out[:, i, g] predicts seq[:, taus[i] + g]. Each prediction is fed
        back as the next input, and the memory grows by the pair (key of the input, value of the
        prediction), exactly what a full forward over prompt + predictions computes.

        zero_recent_values=True mimics the reference's cached generation, which stores value 0 for
        the last prompt pair and every generated pair (memory_mosaics spec 4.3).
        """
        B, L, D = seq.shape
        N, beta = len(taus), self.config.beta
        K = self._heads(self.key(seq))  # (B, H, L, hd)
        v = self.value(seq)
        V = self._heads(torch.cat([v[:, 1:], v.new_zeros(B, 1, D)], dim=1))  # (B, H, L, hd)
        in_prompt = torch.arange(L, device=seq.device)[None, :] <= (taus[:, None] - 2)  # (N, L): pair j stored
        bias = torch.zeros(N, L, device=seq.device).masked_fill(~in_prompt, -math.inf)  # (N, L)
        current = seq[:, taus - 1]  # (B, N, D): the last prompt observation
        tail_k: list[torch.Tensor] = []  # pairs stored during the rollout, each (B, H, N, hd)
        tail_v: list[torch.Tensor] = []
        preds = []
        for _ in range(n_gen):
            q = self._heads(self.key(current))  # (B, H, N, hd)
            scores = beta * (q @ K.transpose(-1, -2)) + bias  # (B, H, N, L)
            if tail_k:
                tail = beta * (q.unsqueeze(-2) * torch.stack(tail_k, dim=-2)).sum(-1)  # (B, H, N, g)
                scores = torch.cat([scores, tail], dim=-1)
            p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty memory reads 0
            y = p[..., :L] @ V  # (B, H, N, hd)
            if tail_v:
                y = y + (p[..., L:].unsqueeze(-1) * torch.stack(tail_v, dim=-2)).sum(-2)
            z = self.out(self._merge(y))  # (B, N, D)
            preds.append(z)
            tail_k.append(q)
            tail_v.append(torch.zeros_like(q) if zero_recent_values else self._heads(self.value(z)))
            current = z
        return torch.stack(preds, dim=2)


def clipped_mse(pred: torch.Tensor, target: torch.Tensor, clip: float = 0.5) -> torch.Tensor:
    """mean(clip(pred - target, -clip, clip)^2): coordinates off by more than `clip` get no
    gradient, so predictions made from a nearly empty memory are not fitted (thesis App. B.1)."""
    return (pred - target).clamp(-clip, clip).square().mean()
