"""TwoBits (Kamath et al. 2021; thesis App. A.8): two binary features of a binary label.

    Y  ~ Rademacher(0.5)
    X1 = Y * Rademacher(alpha_e)      (flips the label's sign with probability alpha_e)
    X2 = Y * Rademacher(beta_e)       (flips it with probability beta_e)

where Rademacher(p) is -1 with probability p and +1 otherwise, the two flips independent given Y.
Everything lives on 4 input patterns x 2 labels, so the distribution is given exactly
(`joint_probabilities`) and expectations need no sampling; `sample` draws examples for users who
want them (and for the test that checks the two against each other).

The thesis's training environments are (alpha_e, beta_e) in {(0.1, 0.1), (0.1, 0.3)}: X1's relation
to Y is the same in both (invariant), X2's changes (spurious, though more predictive in env 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from owai.errors import OwaiError

# The thesis's two training environments (alpha_e, beta_e).
TRAINING_ENVIRONMENTS: tuple[tuple[float, float], ...] = ((0.1, 0.1), (0.1, 0.3))

# The 4 input patterns (x1, x2), in this fixed order everywhere: (4, 2). The order puts the
# symmetric pairs x and -x at indices (0, 3) and (1, 2).
PATTERNS = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
# The labels, in the order of the last axis of `joint_probabilities`: (2,)
LABELS = torch.tensor([1.0, -1.0], dtype=torch.float64)


def validate_environments(environments: Sequence[Sequence[float]], name: str = "environments") -> list[tuple[float, float]]:
    """The environments as (alpha, beta) pairs, or a one-line OwaiError: at least one environment,
    each exactly two finite probabilities in [0, 1]."""
    if len(environments) == 0:
        raise OwaiError(f"{name} must list at least one (alpha, beta) environment, got none")
    out = []
    for i, env in enumerate(environments):
        if len(env) != 2:
            raise OwaiError(f"{name}[{i}] must be a pair [alpha, beta], got {list(env)}")
        alpha, beta = (float(v) for v in env)
        for label, p in (("alpha", alpha), ("beta", beta)):
            if not (math.isfinite(p) and 0.0 <= p <= 1.0):
                raise OwaiError(f"{name}[{i}]: {label} = {p} is not a probability in [0, 1]")
        out.append((alpha, beta))
    return out


def joint_probabilities(environments: Sequence[Sequence[float]]) -> torch.Tensor:
    """P_e(X = pattern, Y = label) for every environment: (E, 4, 2), float64, each [e] sums to 1.

    P(x1, x2, y) = 1/2 * P(X1 = x1 | y) * P(X2 = x2 | y), with P(X1 = y | y) = 1 - alpha and
    P(X1 = -y | y) = alpha (likewise for X2 with beta)."""
    envs = validate_environments(environments)
    alpha = torch.tensor([a for a, _ in envs], dtype=torch.float64)[:, None, None]  # (E, 1, 1)
    beta = torch.tensor([b for _, b in envs], dtype=torch.float64)[:, None, None]
    agree1 = PATTERNS[None, :, 0, None] * LABELS[None, None, :] > 0  # (1, 4, 2): X1 == Y
    agree2 = PATTERNS[None, :, 1, None] * LABELS[None, None, :] > 0
    p1 = torch.where(agree1, 1.0 - alpha, alpha)  # (E, 4, 2)
    p2 = torch.where(agree2, 1.0 - beta, beta)
    return 0.5 * p1 * p2


def sample(environment: Sequence[float], n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n examples of one environment: x (n, 2) and y (n,), float64 in {-1, +1}."""
    ((alpha, beta),) = validate_environments([environment], "environment")
    if n < 0:
        raise OwaiError(f"the number of samples must be >= 0, got {n}")
    u = torch.rand(3, n, generator=generator, dtype=torch.float64)  # (3, n): label, flip 1, flip 2
    y = torch.where(u[0] < 0.5, 1.0, -1.0).to(torch.float64)
    x1 = y * torch.where(u[1] < alpha, -1.0, 1.0)
    x2 = y * torch.where(u[2] < beta, -1.0, 1.0)
    return torch.stack([x1, x2], dim=1), y
