"""Linear disentanglement tasks (thesis sec 3.1, Figure 3.1).

Disentangled representation: X in R^n, X ~ N(0, sigma^2 I). Task i labels a sample
Y = 1[X_i > 0], flipped with probability eps (Y ~ Bernoulli(|1[X_i > 0] - eps|)), so each task
depends on one coordinate and the Bayes accuracy is 1 - eps.

Entangled representation: X' = A X with A a random orthonormal matrix (A A^T = I), so
X' ~ N(0, sigma^2 I) as well and carries the same information, but each task now depends on
every coordinate. The labels are the same.

Samples are rows: a batch X of shape (m, n) is entangled as X A^T.
"""

from __future__ import annotations

import numpy as np


def random_orthonormal(n: int, rng: np.random.Generator) -> np.ndarray:
    """A Haar-random n x n orthonormal matrix: QR of a Gaussian matrix, Q's columns multiplied by
    sign(diag(R)) so that the decomposition is unique and the distribution uniform (Mezzadri 2007)."""
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1.0
    return q * signs


def sample_task(
    m: int, n_features: int, rng: np.random.Generator, task: int = 0, sigma: float = 1.0, noise: float = 0.1
) -> tuple[np.ndarray, np.ndarray]:
    """m samples of the disentangled representation and their labels for task `task`.

    Returns X of shape (m, n_features) float64 and Y of shape (m,) int64 in {0, 1}, with
    Y = 1[X_task > 0] flipped with probability `noise`.
    """
    x = sigma * rng.standard_normal((m, n_features))
    clean = x[:, task] > 0
    flip = rng.random(m) < noise
    return x, (clean ^ flip).astype(np.int64)


def entangle(x: np.ndarray, a: np.ndarray) -> np.ndarray:
    """The entangled representation x' = A x of each row x of `x`."""
    return x @ a.T
