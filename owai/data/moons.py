"""Three moons (thesis sec 3.3): observations of three moons circling a planet.

Each observation x_t holds three complex numbers e^{i theta_k}, encoded as 6 reals
[sin1, cos1, sin2, cos2, sin3, cos3] (moon k's position on the unit circle). The moon periods are
related by ratios from {0.5, 1, ..., 3.5}; the time step is scaled so that an 800-step sequence
holds `min_periods_in_block` full periods lcm(p1, p2, p3) of the slowest system.

Period sets (docs/decisions.md): the reference keeps the 9 of the C(7,3)=35 triples with the
smallest lcm and holds out the 9th; which 9th depends on numpy's unstable argsort tie-breaking,
so the split is fixed here as the reference's realised one (x86 SIMD sort).
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import reduce

import torch

Triple = tuple[float, float, float]

CANDIDATE_RATIOS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5)
TRAIN_PERIODS: list[Triple] = [
    (0.5, 1.0, 2.0),
    (0.5, 1.0, 1.5),
    (0.5, 1.0, 3.0),
    (0.5, 1.5, 3.0),
    (1.0, 1.5, 3.0),
    (0.5, 1.0, 2.5),
    (1.0, 1.5, 2.0),
    (0.5, 1.5, 2.0),
]
VAL_PERIODS: list[Triple] = [(1.0, 2.0, 3.0)]


def lcm_periods(periods: tuple[float, ...]) -> float:
    """Least common multiple of rational periods: lcm of numerators / gcd of denominators."""
    fracs = [Fraction(p).limit_denominator(1000) for p in periods]
    num = reduce(math.lcm, (f.numerator for f in fracs))
    den = reduce(math.gcd, (f.denominator for f in fracs))
    return num / den


def time_step(period_sets: list[Triple], block_size: int, min_periods_in_block: int) -> float:
    """dt such that `block_size` steps span `min_periods_in_block` x the largest lcm (ref: 0.0225)."""
    return max(lcm_periods(p) for p in period_sets) * min_periods_in_block / block_size


def moon_positions(times: torch.Tensor, periods: torch.Tensor, phase: float) -> torch.Tensor:
    """times (..., T), periods (..., 3) -> observations (..., T, 6) = [sin_k, cos_k] per moon."""
    angle = 2 * math.pi * times[..., :, None] / periods[..., None, :] + phase  # (..., T, 3)
    return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(-2)  # (..., T, 6)


def sample_sequences(
    period_sets: list[Triple],
    n: int,
    length: int,
    dt: float,
    generator: torch.Generator,
    phase: float = 0.3,
    grid_size: int = 10_000,
    block_size: int = 800,
) -> torch.Tensor:
    """n sequences of `length` observations, each from a period set drawn uniformly from
    `period_sets` and a random start on the reference's time grid. Returns (n, length, 6)."""
    choice = torch.randint(len(period_sets), (n,), generator=generator)
    periods = torch.tensor(period_sets, dtype=torch.float64)[choice]  # (n, 3)
    start = torch.randint(grid_size - 2 * block_size - 1, (n,), generator=generator)  # reference range
    times = (start[:, None] + torch.arange(length)[None, :]).double() * dt  # (n, length)
    return moon_positions(times, periods, phase).float()
