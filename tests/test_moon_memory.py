"""The three-moons memory unit: parameter count, complex maps, attention math, rollouts."""

from __future__ import annotations

import math

import pytest
import torch

from owai.data.moons import TRAIN_PERIODS, VAL_PERIODS, sample_sequences, time_step
from owai.models.moon_memory import ComplexLinear, MoonMemory, MoonMemoryConfig, clipped_mse
from owai.optim import MLXAdamW, linear_schedule


def naive_forward(model: MoonMemory, x: torch.Tensor) -> torch.Tensor:
    """Direct transcription of the memory unit: y_t = sum_{j<t} softmax(beta k_t.k_j) W_psi x_{j+1}."""
    B, T, D = x.shape
    H, hd, beta = model.config.n_heads, model.head_dim, model.config.beta
    Wk, Wv, Wz = (lin.real_matrix().double() for lin in (model.key, model.value, model.out))
    x = x.double()
    z = torch.zeros(B, T, D, dtype=torch.float64)
    for b in range(B):
        for t in range(1, T):
            y = torch.zeros(D, dtype=torch.float64)
            for h in range(H):
                sl = slice(h * hd, (h + 1) * hd)
                kt = (Wk @ x[b, t])[sl]
                scores = torch.stack([beta * kt @ (Wk @ x[b, j])[sl] for j in range(t)])
                p = torch.softmax(scores, 0)
                vals = torch.stack([(Wv @ x[b, j + 1])[sl] for j in range(t)])
                y[sl] = p @ vals
            z[b, t] = Wz @ y
    return z


def moons(n: int, length: int, seed: int = 0, periods=TRAIN_PERIODS) -> torch.Tensor:
    dt = time_step(TRAIN_PERIODS + VAL_PERIODS, 800, 3)
    return sample_sequences(periods, n, length, dt, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("heads", [1, 3])
def test_54_real_parameters(heads):
    model = MoonMemory(MoonMemoryConfig(n_heads=heads))
    assert sum(p.numel() for p in model.parameters()) == 3 * 3 * 2 * 3 == 54


def test_complex_linear_is_complex_matrix_product():
    torch.manual_seed(0)
    lin = ComplexLinear(3)
    x = torch.randn(5, 6)
    z = torch.complex(x[:, 0::2], x[:, 1::2])  # z_j = x[2j] + i x[2j+1]
    w = lin.complex_matrix()
    expected = z @ w.T
    got = lin(x)
    torch.testing.assert_close(got[:, 0::2], expected.real)
    torch.testing.assert_close(got[:, 1::2], expected.imag)
    # every 2x2 block of the real matrix has the complex form [[r, s], [-s, r]]
    m = lin.real_matrix()
    torch.testing.assert_close(m[0::2, 0::2], m[1::2, 1::2])
    torch.testing.assert_close(m[0::2, 1::2], -m[1::2, 0::2])


@pytest.mark.parametrize("heads", [1, 3])
def test_forward_matches_naive_memory_unit(heads):
    torch.manual_seed(1)
    model = MoonMemory(MoonMemoryConfig(n_heads=heads, beta=5.0))
    x = moons(2, 12)
    torch.testing.assert_close(model(x).double(), naive_forward(model, x), atol=1e-5, rtol=1e-4)


def test_position_zero_reads_nothing_and_causality():
    torch.manual_seed(2)
    model = MoonMemory(MoonMemoryConfig(n_heads=3))
    x = moons(2, 30)
    z = model(x)
    assert torch.all(z[:, 0] == 0)
    x2 = x.clone()
    x2[:, 17:] += torch.randn_like(x2[:, 17:])
    z2 = model(x2)
    torch.testing.assert_close(z[:, :17], z2[:, :17])  # z_t depends on x_0..x_t only
    assert not torch.allclose(z[:, 17:], z2[:, 17:])


def naive_rollout(model: MoonMemory, seq: torch.Tensor, tau: int, n_gen: int, zero_recent: bool) -> torch.Tensor:
    """Generate by re-running the full forward (exact), or with the reference's zero-value cache."""
    if not zero_recent:
        inp, preds = seq[:, :tau], []
        for _ in range(n_gen):
            z = model(inp)[:, -1]
            preds.append(z)
            inp = torch.cat([inp, z[:, None]], 1)
        return torch.stack(preds, 1)
    # reference cache: pairs j <= tau-2 hold W_psi x_{j+1}; later pairs hold value 0
    H, hd, beta = model.config.n_heads, model.head_dim, model.config.beta
    keys = [model.key(seq[:, j]) for j in range(tau)]
    vals = [model.value(seq[:, j + 1]) for j in range(tau - 1)] + [torch.zeros_like(seq[:, 0])]
    cur, preds = seq[:, tau - 1], []
    for g in range(n_gen):
        q = model.key(cur)
        n_mem = tau - 1 + g
        y = torch.zeros_like(cur)
        for h in range(H):
            sl = slice(h * hd, (h + 1) * hd)
            if n_mem == 0:
                continue
            s = torch.stack([beta * (q[:, sl] * keys[j][:, sl]).sum(-1) for j in range(n_mem)], -1)
            p = torch.softmax(s, -1)
            y[:, sl] = torch.einsum("bj,jbd->bd", p, torch.stack([vals[j][:, sl] for j in range(n_mem)]))
        z = model.out(y)
        preds.append(z)
        keys.append(model.key(z))
        vals.append(torch.zeros_like(z))
        cur = z
    return torch.stack(preds, 1)


@pytest.mark.parametrize("zero_recent", [False, True])
@pytest.mark.parametrize("heads", [1, 3])
def test_batched_rollout_matches_step_by_step_generation(heads, zero_recent):
    torch.manual_seed(3)
    model = MoonMemory(MoonMemoryConfig(n_heads=heads, beta=8.0))
    seq = moons(2, 40, seed=4)
    taus = torch.tensor([1, 2, 5, 13, 30])
    with torch.no_grad():
        batched = model.rollout(seq, taus, 6, zero_recent_values=zero_recent)  # (B, N, G, D)
        for i, tau in enumerate(taus.tolist()):
            expected = naive_rollout(model, seq, tau, 6, zero_recent)
            torch.testing.assert_close(batched[:, i], expected, atol=1e-5, rtol=1e-4)


def test_rollout_first_prediction_equals_training_forward():
    torch.manual_seed(5)
    model = MoonMemory(MoonMemoryConfig(n_heads=3))
    seq = moons(3, 50)
    taus = torch.arange(1, 50)
    with torch.no_grad():
        first = model.rollout(seq, taus, 1)[:, :, 0]  # prediction after prompt seq[:, :tau]
        torch.testing.assert_close(first, model(seq)[:, taus - 1], atol=1e-5, rtol=1e-4)


def test_clipped_mse_value_and_gradient():
    pred = torch.tensor([0.1, 0.7, -2.0], requires_grad=True)
    target = torch.zeros(3)
    loss = clipped_mse(pred, target, clip=0.5)
    assert loss.item() == pytest.approx((0.01 + 0.25 + 0.25) / 3)
    loss.backward()
    assert pred.grad.tolist() == pytest.approx([2 * 0.1 / 3, 0.0, 0.0])  # no gradient beyond the clip


def test_mlx_adam_has_no_bias_correction():
    p = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
    opt = MLXAdamW([p], lr=0.01)
    p.grad = torch.tensor([0.5, -2.0])
    opt.step()
    # m = 0.1 g, v = 0.001 g^2 -> step = lr * 0.1 |g| / sqrt(0.001) |g| = lr * 3.162...
    step = 0.01 * 0.1 / math.sqrt(0.001)
    assert p.tolist() == pytest.approx([1.0 - step, -1.0 + step], rel=1e-5)
    torch_p = torch.nn.Parameter(torch.tensor([1.0]))
    torch_opt = torch.optim.Adam([torch_p], lr=0.01)
    torch_p.grad = torch.tensor([0.5])
    torch_opt.step()
    assert 1.0 - torch_p.item() == pytest.approx(0.01, rel=1e-4)  # torch's first step is ~3x smaller


def test_linear_schedule_matches_mlx():
    lr = linear_schedule(1e-2, 5e-6, 500)
    assert lr(0) == 1e-2
    assert lr(250) == pytest.approx((1e-2 + 5e-6) / 2)
    assert lr(500) == pytest.approx(5e-6)
    assert lr(900) == pytest.approx(5e-6)
