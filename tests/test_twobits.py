"""TwoBits (thesis App. A.8, Figure A.2): exact distribution, penalties, stars, recipe end to end."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from owai.data.twobits import TRAINING_ENVIRONMENTS, joint_probabilities, sample, validate_environments
from owai.errors import OwaiError
from owai.methods import method_class
from owai.methods.twobits import (
    TwoBitsConfig,
    check,
    env_risks,
    erm_solution,
    grid_axis,
    invariant_solution,
    irm_gradients_autograd,
    irm_gradients_closed_form,
    landscapes,
    path_climb,
    penalty_function,
    point_psi,
    radius_below,
    representation,
)
from conftest import cli_in_process

ENVS = [list(e) for e in TRAINING_ENVIRONMENTS]
POINTS = [(0.0, 0.0), (0.3, -0.7), (1.2, 0.5), (-0.9, 1.1), (0.9459, 0.3846)]


# --- data ---------------------------------------------------------------------------------------------


def test_joint_probabilities_are_distributions_with_the_right_marginals():
    probs = joint_probabilities([[0.1, 0.1], [0.1, 0.3], [0.25, 0.6]])
    assert probs.shape == (3, 4, 2)
    torch.testing.assert_close(probs.sum(dim=(1, 2)), torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(probs.sum(dim=1), torch.full((3, 2), 0.5, dtype=torch.float64))  # P(Y = +-1)
    # P(X1 = Y) = 1 - alpha: patterns 0, 1 have x1 = +1 (label index 0), patterns 2, 3 x1 = -1 (index 1)
    x1_agrees = probs[:, 0:2, 0].sum(1) + probs[:, 2:4, 1].sum(1)
    torch.testing.assert_close(x1_agrees, torch.tensor([0.9, 0.9, 0.75], dtype=torch.float64))
    # P(X2 = Y) = 1 - beta: patterns 0, 2 have x2 = +1
    x2_agrees = probs[:, [0, 2], 0].sum(1) + probs[:, [1, 3], 1].sum(1)
    torch.testing.assert_close(x2_agrees, torch.tensor([0.9, 0.7, 0.4], dtype=torch.float64))


@pytest.mark.parametrize("env", [(0.1, 0.1), (0.1, 0.3), (0.35, 0.8)])
def test_samples_match_the_exact_distribution(env):
    n = 200_000
    x, y = sample(env, n, torch.Generator().manual_seed(7))
    assert x.shape == (n, 2) and y.shape == (n,)
    assert set(x.unique().tolist()) == {-1.0, 1.0} and set(y.unique().tolist()) == {-1.0, 1.0}
    for column, flip in ((0, env[0]), (1, env[1])):
        accuracy = (x[:, column] == y).double().mean().item()
        assert abs(accuracy - (1 - flip)) < 4.5 * math.sqrt(flip * (1 - flip) / n)
    exact = joint_probabilities([env])[0]  # (4, 2)
    for k, (x1, x2) in enumerate([(1, 1), (1, -1), (-1, 1), (-1, -1)]):
        for j, label in enumerate((1, -1)):
            freq = ((x[:, 0] == x1) & (x[:, 1] == x2) & (y == label)).double().mean().item()
            p = exact[k, j].item()
            assert abs(freq - p) < 4.5 * math.sqrt(p * (1 - p) / n) + 1e-12


def test_sampling_is_reproducible_with_a_generator():
    a = sample((0.1, 0.3), 50, torch.Generator().manual_seed(3))
    b = sample((0.1, 0.3), 50, torch.Generator().manual_seed(3))
    c = sample((0.1, 0.3), 50, torch.Generator().manual_seed(4))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize(
    "envs, match",
    [
        ([], "at least one"),
        ([[0.1, 1.2]], r"beta = 1.2 is not a probability"),
        ([[-0.1, 0.2]], r"alpha = -0.1 is not a probability"),
        ([[0.1, float("nan")]], "not a probability"),
        ([[0.1, 0.2, 0.3]], "must be a pair"),
    ],
)
def test_bad_environments_are_one_line_errors(envs, match):
    with pytest.raises(OwaiError, match=match) as info:
        validate_environments(envs)
    assert "\n" not in str(info.value)
    with pytest.raises(OwaiError):
        joint_probabilities(envs)


# --- penalties against an independent brute force -----------------------------------------------------


def brute_force_risk(env: tuple[float, float], a: float, b: float, w: float = 1.0) -> float:
    """E[(w Psi(X) - Y)^2] by enumerating (y, flip1, flip2) with Python floats."""
    alpha, beta = env
    psi = {(1, 1): a, (-1, -1): -a, (1, -1): b, (-1, 1): -b}
    total = 0.0
    for y, f1, f2 in itertools.product((1, -1), (1, -1), (1, -1)):
        p = 0.5 * (alpha if f1 == -1 else 1 - alpha) * (beta if f2 == -1 else 1 - beta)
        total += p * (w * psi[(y * f1, y * f2)] - y) ** 2
    return total


class TinyModel(torch.nn.Module):
    """A symmetric 'network' Psi(x) = a (x1 + x2)/2 + b (x1 - x2)/2 with an IRM scalar head w."""

    def __init__(self, a: float, b: float) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a, dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.tensor(b, dtype=torch.float64))
        self.w = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * (self.a * (x[:, 0] + x[:, 1]) / 2 + self.b * (x[:, 0] - x[:, 1]) / 2)


def tiny_model_irm_gradient(env: tuple[float, float], a: float, b: float) -> float:
    """dR/dw at w = 1 by autograd through TinyModel on the 8 weighted (x, y) outcomes."""
    alpha, beta = env
    xs, ys, ps = [], [], []
    for y, f1, f2 in itertools.product((1, -1), (1, -1), (1, -1)):
        xs.append([y * f1, y * f2])
        ys.append(y)
        ps.append(0.5 * (alpha if f1 == -1 else 1 - alpha) * (beta if f2 == -1 else 1 - beta))
    model = TinyModel(a, b)
    x = torch.tensor(xs, dtype=torch.float64)
    risk = (torch.tensor(ps, dtype=torch.float64) * (model(x) - torch.tensor(ys, dtype=torch.float64)) ** 2).sum()
    (grad,) = torch.autograd.grad(risk, model.w)
    return grad.item()


@pytest.mark.parametrize("a, b", POINTS)
def test_penalties_equal_a_direct_computation(a, b):
    cfg = TwoBitsConfig()
    probs = joint_probabilities(ENVS)
    psi = point_psi(a, b)
    risks = [brute_force_risk(tuple(env), a, b) for env in ENVS]
    torch.testing.assert_close(env_risks(psi, probs)[:, 0], torch.tensor(risks, dtype=torch.float64))

    # IRMv1: autograd through a tiny model, and a central finite difference of the brute force
    grads = [tiny_model_irm_gradient(tuple(env), a, b) for env in ENVS]
    h = 1e-6
    fd = [(brute_force_risk(tuple(e), a, b, 1 + h) - brute_force_risk(tuple(e), a, b, 1 - h)) / (2 * h) for e in ENVS]
    assert grads == pytest.approx(fd, abs=1e-7)
    irm = penalty_function("irmv1", cfg)(psi, probs).item()
    assert irm == pytest.approx(sum(g * g for g in grads), rel=1e-12, abs=1e-15)

    vrex = penalty_function("vrex", cfg)(psi, probs).item()
    assert vrex == pytest.approx((risks[0] - risks[1]) ** 2 / 2, rel=1e-12, abs=1e-15)

    # SD: E_e[Psi^2] = P_e(X1 = X2) a^2 + P_e(X1 != X2) b^2, summed over environments
    same = [(1 - al) * (1 - be) + al * be for al, be in ENVS]
    sd = penalty_function("sd", cfg)(psi, probs).item()
    assert sd == pytest.approx(sum(q * a * a + (1 - q) * b * b for q in same), rel=1e-12, abs=1e-15)


def test_autograd_and_closed_form_irm_gradients_agree_on_a_grid():
    cfg = TwoBitsConfig()
    cfg.grid.resolution = 41
    axis = grid_axis(cfg)
    bb, aa = torch.meshgrid(axis, axis, indexing="ij")
    psi = representation(aa.reshape(-1), bb.reshape(-1))  # (1681, 4)
    probs = joint_probabilities([[0.1, 0.1], [0.1, 0.3], [0.2, 0.45]])
    auto = irm_gradients_autograd(psi, probs)
    assert auto.shape == (3, 41 * 41)
    torch.testing.assert_close(auto, irm_gradients_closed_form(psi, probs), rtol=1e-12, atol=1e-12)
    assert auto.abs().max() > 1.0  # not trivially zero


def test_reductions_scale_as_documented():
    probs = joint_probabilities(ENVS)
    psi = point_psi(0.4, -0.6)
    base, alt = TwoBitsConfig(), TwoBitsConfig(irm_reduction="mean", vrex_variance="biased", sd_reduction="mean")
    for name in ("irmv1", "vrex", "sd"):  # two environments: mean = sum / 2, biased = unbiased / 2
        assert penalty_function(name, alt)(psi, probs).item() == pytest.approx(penalty_function(name, base)(psi, probs).item() / 2)


# --- stars, grid and measurements ---------------------------------------------------------------------


def test_stars_sit_where_the_docstring_says():
    probs = joint_probabilities(ENVS)
    assert erm_solution(probs) == pytest.approx((1.4 / 1.48, 0.2 / 0.52))
    assert invariant_solution(probs) == pytest.approx((0.8, 0.8))
    # the ERM star is a stationary point of the pooled risk (numerical gradient ~ 0)
    a, b = erm_solution(probs)
    pooled = lambda a_, b_: sum(brute_force_risk(tuple(e), a_, b_) for e in ENVS) / 2  # noqa: E731
    h = 1e-6
    assert (pooled(a + h, b) - pooled(a - h, b)) / (2 * h) == pytest.approx(0, abs=1e-8)
    assert (pooled(a, b + h) - pooled(a, b - h)) / (2 * h) == pytest.approx(0, abs=1e-8)
    # the invariant star is the best X1-only predictor: pooled risk minimal on the line a = b
    k = invariant_solution(probs)[0]
    assert pooled(k, k) < min(pooled(k + 0.01, k + 0.01), pooled(k - 0.01, k - 0.01))


def test_invariant_star_has_zero_irm_and_vrex_penalty_and_erm_does_not():
    cfg = TwoBitsConfig()
    probs = joint_probabilities(ENVS)
    inv, erm = point_psi(*invariant_solution(probs)), point_psi(*erm_solution(probs))
    for name in ("irmv1", "vrex"):
        fn = penalty_function(name, cfg)
        assert fn(inv, probs).item() == pytest.approx(0.0, abs=1e-20)
        assert fn(erm, probs).item() > 1e-5
    # with alpha changing across environments, X1 alone is no longer invariant
    shifted = joint_probabilities([[0.1, 0.1], [0.2, 0.3]])
    assert penalty_function("irmv1", cfg)(point_psi(*invariant_solution(shifted)), shifted).item() > 1e-4


def test_erm_star_risk_is_the_minimum_over_the_grid():
    cfg = TwoBitsConfig()
    cfg.grid.resolution = 151
    probs = joint_probabilities(ENVS)
    risk = landscapes(cfg, probs)["erm_risk"]  # rows b, columns a
    axis = grid_axis(cfg)
    row, col = divmod(int(risk.argmin()), risk.shape[1])
    a, b = erm_solution(probs)
    step = float(axis[1] - axis[0])
    assert abs(axis[col].item() - a) <= step / 2 + 1e-12 and abs(axis[row].item() - b) <= step / 2 + 1e-12
    star_risk = env_risks(point_psi(a, b), probs).mean().item()
    assert star_risk <= risk.min().item()


def test_landscape_orientation_rows_are_b_and_columns_are_a():
    cfg = TwoBitsConfig(penalties=["sd"])
    cfg.grid.resolution = 5  # axis -1.5, -0.75, 0, 0.75, 1.5
    maps = landscapes(cfg, joint_probabilities(ENVS))
    probs = joint_probabilities(ENVS)
    expected = penalty_function("sd", cfg)(point_psi(1.5, -0.75), probs).item()  # a = axis[4], b = axis[1]
    assert maps["sd"][1, 4].item() == pytest.approx(expected)
    assert maps["sd"][4, 1].item() != pytest.approx(expected)


def test_path_climb_and_radius_on_known_functions():
    probs = joint_probabilities(ENVS)
    bump = lambda psi, _probs: psi[:, 0] * (1 - psi[:, 0])  # noqa: E731 - a(1 - a): 0 at both ends, 1/4 at a = 1/2
    out = path_climb(bump, probs, (0.0, 0.3), (1.0, -0.2), 101)
    assert out["climb"] == pytest.approx(0.25) and out["argmax_t"] == pytest.approx(0.5)
    slope = lambda psi, _probs: psi[:, 0]  # noqa: E731 - monotone: no climb
    assert path_climb(slope, probs, (0.0, 0.0), (1.0, 0.0), 11)["climb"] == 0.0
    # SD = 1.48 a^2 + 0.52 b^2 (sums over the two environments): first reaches L along the a axis
    sd = penalty_function("sd", TwoBitsConfig())
    level = 0.5
    assert radius_below(sd, probs, level, 1.5) == pytest.approx(math.sqrt(level / 1.48), abs=2e-3)
    assert radius_below(sd, probs, 1e6, 1.5) is None


def test_config_checks():
    for edit, match in [
        (lambda c: setattr(c, "environments", [[0.1, 0.1]]), "at least 2"),
        (lambda c: setattr(c, "environments", [[0.1, 0.1], [1.5, 0.3]]), "alpha = 1.5"),
        (lambda c: setattr(c.grid, "extent", [1.0, -1.0]), "low < high"),
        (lambda c: setattr(c.grid, "resolution", 1), "resolution"),
        (lambda c: setattr(c, "penalties", ["sd", "sd"]), "distinct"),
        (lambda c: setattr(c, "init_scale", -1.0), "init_scale"),
        (lambda c: setattr(c, "path_points", 1), "path_points"),
    ]:
        cfg = TwoBitsConfig()
        edit(cfg)
        with pytest.raises(OwaiError, match=match):
            check(cfg)
    check(TwoBitsConfig())
    assert method_class("twobits").Config is TwoBitsConfig


# --- end to end -----------------------------------------------------------------------------------------


def test_recipe_runs_end_to_end_and_writes_the_figure(tmp_path):
    from owai.experiment import execute

    run, results = execute("figA.2-twobits", "cpu", [], tmp_path, None)
    figure = run.path / "figures" / "figA.2-twobits.png"
    assert figure.is_file() and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {r["metric"]: r for r in results["rows"]}
    for name in ("irmv1", "vrex", "sd"):
        for metric in ("at_erm", "at_invariant", "at_init", "path_climb", "init_below_erm", "radius_below_erm"):
            assert f"{name}.{metric}" in rows
    assert rows["irmv1.path_climb"]["thesis_claim"]
    assert rows["vrex.at_invariant"]["measured"] == pytest.approx(0.0, abs=1e-20)
    assert rows["sd.at_invariant"]["measured"] == pytest.approx(1.28)  # E[Psi^2] = 0.64 per environment
    assert rows["irmv1.path_climb"]["measured"] > 0  # IRMv1 rises between ERM and invariant
    assert rows["sd.path_climb"]["measured"] == 0.0  # SD is convex: its maximum is an endpoint
    stars = results["details"]["stars"]
    assert stars["erm"]["a"] == pytest.approx(1.4 / 1.48) and stars["invariant"]["b"] == pytest.approx(0.8)
    assert results["command"] == "owai bonsai --recipe figA.2-twobits --preset cpu"


def test_figure_off_writes_no_png(tmp_path):
    from owai.experiment import execute

    run, _ = execute("figA.2-twobits", "cpu", ["figure=false", "grid.resolution=11"], tmp_path, None)
    assert not (run.path / "figures" / "figA.2-twobits.png").exists()


def test_cli_bonsai_recipe_runs_twobits(tmp_path: Path, capsys):
    code, out, _ = cli_in_process(["bonsai", "--help"], capsys)
    if code != 0 or "--recipe" not in out:
        pytest.skip("owai bonsai has no --recipe option yet")
    code, _, err = cli_in_process(["bonsai", "--recipe", "figA.2-twobits", "--out", str(tmp_path), "-q"], capsys)
    assert code == 0, err
    pngs = list(tmp_path.glob("figA.2-twobits/*/figures/figA.2-twobits.png"))
    assert len(pngs) == 1
    code, _, err = cli_in_process(["bonsai", "--recipe", "figA.2-twobits", "--out", str(tmp_path), "--set",
                                   "environments=[[0.1,2.0],[0.1,0.3]]"], capsys)
    assert code == 2 and "Traceback" not in err and "beta = 2.0" in err, err
