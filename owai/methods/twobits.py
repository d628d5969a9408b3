"""TwoBits penalty landscapes of IRMv1, vREx and SD (thesis App. A.8, Figure A.2).

The TwoBits task (owai/data/twobits.py; Kamath et al. 2021) has 4 input patterns. Following the
thesis and Kamath et al., the model's output Psi is a scalar, the loss is the squared error
(Psi(x) - y)^2, and Psi is symmetric, Psi(-x) = -Psi(x), so any model is a point of the plane

    a = Psi(1, 1) = -Psi(-1, -1)        (x axis of the figure)
    b = Psi(1, -1) = -Psi(-1, 1)        (y axis)

and every quantity below is an exact expectation over the 4 patterns x 2 labels (float64, no
sampling). Per environment e, with a scalar multiplier w of the output (IRMv1's dummy classifier):

    R_e(w) = E_e[(w Psi(X) - Y)^2]
           = q_e a^2 + (1 - q_e) b^2 - 2 (c_e a + d_e b) + 1  at w = 1,
    q_e = P_e(X1 = X2) = (1-alpha)(1-beta) + alpha beta,   c_e = 1 - alpha - beta,   d_e = beta - alpha.

Penalties (spec rich_features.md sec 2, transferred from BCE on a logit to MSE on Psi):

* IRMv1 = sum_e (dR_e/dw at w=1)^2 (`irm_reduction: sum`; Arjovsky et al.'s definition, the one
  Kamath et al. analyse; `mean` = RFC's ColoredMNIST code, half as large with two environments).
  dR_e/dw at 1 = 2 E_e[(Psi - Y) Psi]. The method takes it by autograd through R_e(w)
  (`irm_gradients_autograd`, one multiplier per environment and grid point); the closed form
  (`irm_gradients_closed_form`) is kept to test it.
* vREx = Var_e R_e(1), unbiased (n - 1, `torch.var`, as RFC; = (R_1 - R_2)^2 / 2 for two
  environments) by default, `vrex_variance: biased` for DomainBed's 1/n.
* SD = sum_e E_e[Psi(X)^2] (RFC: squared output averaged over examples, summed over
  environments; `sd_reduction: mean` averages). With MSE the "logit" is Psi itself.

The three stars:

* ERM: the minimiser of the pooled risk (1/E) sum_e R_e(1), environments weighted equally (equal
  sizes), i.e. Psi(x) = E[Y | X = x] under the pooled training distribution. Computed in closed
  form under the symmetry constraint: a = sum_e E_e[Y (1[X=(1,1)] - 1[X=(-1,-1)])] /
  sum_e P_e(X in {(1,1), (-1,-1)}), likewise b with (1,-1), (-1,1). For the thesis's environments:
  a = 1.4 / 1.48 = 0.9459, b = 0.2 / 0.52 = 0.3846.
* Invariant: the best pooled predictor that uses X1 only, Psi(x) = k x1, i.e. a = b = k with
  k = E[Y X1] (pooled) = mean_e (1 - 2 alpha_e) = 0.8. It is truly invariant (zero IRMv1 and
  vREx) when alpha_e is the same in every environment, as in the thesis; otherwise it is just the
  X1-only predictor and the measured penalties say how far from invariant it is.
* Random init: (a, b) ~ N(0, init_scale^2 I) from a generator seeded by (seed, "twobits-init"),
  standing for a network with small random weights (the thesis: "close to zero").

Measured, per penalty P: `P.at_erm`, `P.at_invariant`, `P.at_init` (the penalty at each star);
`P.path_climb` = max of P along the straight segment ERM -> invariant (`path_points` points,
endpoints included) minus the larger endpoint value (> 0: the path climbs over a ridge, the
thesis's claim; <= 0 within rounding: it does not); `P.init_below_erm` (the thesis: every penalty
is low near the origin, so a small random init sits in a low region); `P.radius_below_erm`, the
distance from the origin at which the penalty first reaches its ERM-star value (polar grid, 1501
radii up to the grid's half-width x 360 directions; null if never), the same claim without the
luck of one random draw. IRMv1 and vREx are exactly 0 at the origin (every R_e equals 1 and every
dR_e/dw is 0 there) and SD is 0 only there, so the origin is a trivial minimiser of all three.

Figure A.2 (`figures/figA.2-twobits.png`): one panel per penalty, log-scaled heat map over the
(a, b) grid (values below max * `log_floor` are shown at that floor, since the penalties vanish on
whole curves), the three stars and the ERM -> invariant segment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from owai.config import BaseConfig
from owai.data.twobits import LABELS, TRAINING_ENVIRONMENTS, joint_probabilities, validate_environments
from owai.errors import OwaiError
from owai.methods import Method, Outcome
from owai.runs import Run
from owai.runtime import generator

PenaltyName = Literal["irmv1", "vrex", "sd"]
PENALTY_NAMES: tuple[str, ...] = ("irmv1", "vrex", "sd")
TITLES = {"irmv1": "IRMv1", "vrex": "vREx", "sd": "SD"}
DTYPE = torch.float64


@dataclass
class GridConfig:
    # the same [low, high] range for a = Psi(1,1) and b = Psi(1,-1) (assumption: the thesis's axes
    # are not given; this range holds the three stars and the mirror image -Psi of each)
    extent: list[float] = field(default_factory=lambda: [-1.5, 1.5])
    resolution: int = 201  # grid points per axis


@dataclass
class TwoBitsConfig(BaseConfig):
    environments: list[list[float]] = field(default_factory=lambda: [list(e) for e in TRAINING_ENVIRONMENTS])
    grid: GridConfig = field(default_factory=GridConfig)
    penalties: list[PenaltyName] = field(default_factory=lambda: list(PENALTY_NAMES))
    irm_reduction: Literal["sum", "mean"] = "sum"  # over environments
    vrex_variance: Literal["unbiased", "biased"] = "unbiased"
    sd_reduction: Literal["sum", "mean"] = "sum"  # over environments
    init_scale: float = 0.05  # std of the random-init star's (a, b) (assumption: "small variance")
    path_points: int = 1001  # points on the ERM -> invariant segment
    log_floor: float = 1e-6  # heat-map floor, relative to each panel's maximum
    figure: bool = True


class TwoBitsLandscape(Method):
    Config = TwoBitsConfig
    cli = "owai bonsai --recipe figA.2-twobits"

    @staticmethod
    def unused_settings(cfg: TwoBitsConfig) -> dict[str, str]:
        """Figure A.2's heat-map floor when no figure is drawn."""
        if not cfg.figure:
            return {"log_floor": "the heat-map floor of Figure A.2; this run draws no figure (figure: false)"}
        return {}

    @staticmethod
    def validate(cfg: TwoBitsConfig) -> None:
        check(cfg)

    def run(self, cfg: TwoBitsConfig, run: Run) -> Outcome:
        probs = joint_probabilities(cfg.environments)  # (E, 4, 2)
        stars = solutions(cfg, probs)
        maps = landscapes(cfg, probs)
        measured: dict[str, Any] = {}
        at_stars: dict[str, dict[str, float]] = {}
        paths: dict[str, dict[str, float]] = {}
        for name in cfg.penalties:
            fn = penalty_function(name, cfg)
            values = {star: float(fn(point_psi(*ab), probs)[0]) for star, ab in stars.items()}
            at_stars[name] = values
            climb = path_climb(fn, probs, stars["erm"], stars["invariant"], cfg.path_points)
            paths[name] = {"max": climb["max"], "argmax_t": climb["argmax_t"]}  # t = 0 ERM, 1 invariant
            measured[f"{name}.at_erm"] = _round(values["erm"])
            measured[f"{name}.at_invariant"] = _round(values["invariant"])
            measured[f"{name}.at_init"] = _round(values["init"])
            measured[f"{name}.path_climb"] = _round(climb["climb"])
            measured[f"{name}.init_below_erm"] = values["init"] < values["erm"]
            radius = radius_below(fn, probs, values["erm"], max(abs(v) for v in cfg.grid.extent))
            measured[f"{name}.radius_below_erm"] = None if radius is None else _round(radius)
        risk_at = {star: float(pooled_risk(point_psi(*ab), probs)[0]) for star, ab in stars.items()}
        env_risk_at = {star: env_risks(point_psi(*ab), probs)[:, 0].tolist() for star, ab in stars.items()}
        details: dict[str, Any] = {
            "stars": {star: {"a": a, "b": b} for star, (a, b) in stars.items()},
            "penalty_at_stars": at_stars,
            "path_erm_to_invariant": paths,
            "pooled_risk_at_stars": risk_at,
            "env_risks_at_stars": env_risk_at,
            "grid_max": {name: float(maps[name].max()) for name in cfg.penalties},
            "assumptions": {
                "environments": [list(e) for e in cfg.environments],
                "grid": {"extent": list(cfg.grid.extent), "resolution": cfg.grid.resolution},
                "irm": f"{cfg.irm_reduction} over environments of (dR_e/dw at w=1)^2, MSE, scalar w on Psi",
                "vrex": f"{cfg.vrex_variance} variance of the environment risks",
                "sd": f"{cfg.sd_reduction} over environments of E_e[Psi^2]",
                "erm_star": "pooled MSE minimiser, environments weighted equally",
                "invariant_star": "best pooled MSE predictor using X1 only (a = b)",
                "init_star": f"(a, b) ~ N(0, {cfg.init_scale}^2 I), seed {cfg.seed}",
            },
        }
        if cfg.figure:
            plot(run, cfg, maps, stars)
        return Outcome(measured=measured, details=details)


def check(cfg: TwoBitsConfig) -> None:
    """Reject impossible settings before any run directory exists."""
    envs = validate_environments(cfg.environments)
    if len(envs) < 2:
        raise OwaiError(f"environments: invariance penalties compare environments; give at least 2, got {len(envs)}")
    if len(cfg.grid.extent) != 2 or not cfg.grid.extent[0] < cfg.grid.extent[1]:
        raise OwaiError(f"grid.extent must be [low, high] with low < high, got {cfg.grid.extent}")
    if cfg.grid.resolution < 2:
        raise OwaiError(f"grid.resolution must be >= 2, got {cfg.grid.resolution}")
    if not cfg.penalties or len(set(cfg.penalties)) != len(cfg.penalties):
        raise OwaiError(f"penalties must be a non-empty list of distinct {', '.join(PENALTY_NAMES)}, got {cfg.penalties}")
    if cfg.init_scale < 0:
        raise OwaiError(f"init_scale must be >= 0, got {cfg.init_scale}")
    if cfg.path_points < 2:
        raise OwaiError(f"path_points must be >= 2, got {cfg.path_points}")
    if not 0 < cfg.log_floor < 1:
        raise OwaiError(f"log_floor must be in (0, 1), got {cfg.log_floor}")


# --- representations and risks ---------------------------------------------------------------------


def representation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Psi on the 4 patterns (1,1), (1,-1), (-1,1), (-1,-1) of symmetric models (a, b):
    a, b (...) -> (..., 4) = (a, b, -b, -a)."""
    return torch.stack([a, b, -b, -a], dim=-1)


def point_psi(a: float, b: float) -> torch.Tensor:
    """Psi of one model: (1, 4)."""
    return representation(torch.tensor([a], dtype=DTYPE), torch.tensor([b], dtype=DTYPE))


def env_risks(psi: torch.Tensor, probs: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """R_e(w) = E_e[(w Psi(X) - Y)^2] for every environment and model.

    psi (G, 4), probs (E, 4, 2), w (E, G) or None for w = 1 -> (E, G)."""
    scale = torch.ones(probs.shape[0], psi.shape[0], dtype=psi.dtype) if w is None else w
    pred = scale[:, :, None, None] * psi[None, :, :, None]  # (E, G, 4, 1)
    sq_err = (pred - LABELS.to(psi.dtype)) ** 2  # (E, G, 4, 2)
    return (probs[:, None] * sq_err).sum(dim=(-2, -1))


def pooled_risk(psi: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The ERM objective, environments weighted equally: (G, 4) -> (G,)."""
    return env_risks(psi, probs).mean(dim=0)


def irm_gradients_autograd(psi: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """dR_e/dw at w = 1 by autograd: one multiplier per (environment, model), so the gradient of
    the sum is each risk's own derivative. (G, 4) -> (E, G)."""
    with torch.enable_grad():
        w = torch.ones(probs.shape[0], psi.shape[0], dtype=psi.dtype, requires_grad=True)
        (grad,) = torch.autograd.grad(env_risks(psi.detach(), probs, w).sum(), w)
    return grad


def irm_gradients_closed_form(psi: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """dR_e/dw at w = 1 = 2 E_e[(Psi - Y) Psi]: (G, 4) -> (E, G)."""
    residual_times_psi = (psi[None, :, :, None] - LABELS.to(psi.dtype)) * psi[None, :, :, None]  # (1, G, 4, 2)
    return 2.0 * (probs[:, None] * residual_times_psi).sum(dim=(-2, -1))


def _reduce(per_env: torch.Tensor, how: str) -> torch.Tensor:
    return per_env.sum(dim=0) if how == "sum" else per_env.mean(dim=0)


def penalty_function(name: str, cfg: TwoBitsConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The penalty `name` as a function (psi (G, 4), probs (E, 4, 2)) -> (G,), under cfg's reductions."""
    if name == "irmv1":
        return lambda psi, probs: _reduce(irm_gradients_autograd(psi, probs) ** 2, cfg.irm_reduction)
    if name == "vrex":
        unbiased = cfg.vrex_variance == "unbiased"
        return lambda psi, probs: env_risks(psi, probs).var(dim=0, unbiased=unbiased)
    if name == "sd":
        # E_e[Psi^2]: the label axis of probs sums out to P_e(X = pattern)
        return lambda psi, probs: _reduce((probs.sum(-1)[:, None, :] * psi[None] ** 2).sum(-1), cfg.sd_reduction)
    raise OwaiError(f"unknown penalty {name!r} (known: {', '.join(PENALTY_NAMES)})")


# --- stars, grid, path ------------------------------------------------------------------------------


def erm_solution(probs: torch.Tensor) -> tuple[float, float]:
    """The pooled MSE minimiser among symmetric models: a from patterns (1,1)/(-1,-1), b from
    (1,-1)/(-1,1). Minimising sum p_x (a - y)^2 + p_-x (a + y)^2 gives
    a = (E[Y; x] - E[Y; -x]) / (P(x) + P(-x))."""
    pooled = probs.mean(dim=0)  # (4, 2)
    label_mass = pooled @ LABELS.to(pooled.dtype)  # (4,): E[Y; X = pattern]
    mass = pooled.sum(dim=-1)  # (4,): P(X = pattern)
    a = (label_mass[0] - label_mass[3]) / (mass[0] + mass[3])
    b = (label_mass[1] - label_mass[2]) / (mass[1] + mass[2])
    return float(a), float(b)


def invariant_solution(probs: torch.Tensor) -> tuple[float, float]:
    """The best pooled MSE predictor Psi(x) = k x1 (X1 only): k = E[Y X1] / E[X1^2] = E[Y X1];
    Psi(1,1) = Psi(1,-1) = k."""
    pooled = probs.mean(dim=0)  # (4, 2)
    x1 = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=pooled.dtype)  # X1 of each pattern
    k = float((pooled * x1[:, None] * LABELS.to(pooled.dtype)[None, :]).sum())
    return k, k


def init_point(cfg: TwoBitsConfig) -> tuple[float, float]:
    """A small random initialisation: (a, b) ~ N(0, init_scale^2 I)."""
    gen = generator(cfg.seed, "twobits-init")
    a, b = (cfg.init_scale * torch.randn(2, generator=gen, dtype=DTYPE)).tolist()
    return a, b


def solutions(cfg: TwoBitsConfig, probs: torch.Tensor) -> dict[str, tuple[float, float]]:
    return {"invariant": invariant_solution(probs), "erm": erm_solution(probs), "init": init_point(cfg)}


def grid_axis(cfg: TwoBitsConfig) -> torch.Tensor:
    low, high = cfg.grid.extent
    return torch.linspace(low, high, cfg.grid.resolution, dtype=DTYPE)


def landscapes(cfg: TwoBitsConfig, probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every chosen penalty, and the pooled ERM risk ("erm_risk"), on the grid: each (n, n) with
    rows = b (Psi(1,-1)) and columns = a (Psi(1,1)), both increasing."""
    axis = grid_axis(cfg)  # (n,)
    b_grid, a_grid = torch.meshgrid(axis, axis, indexing="ij")  # (n, n) each
    psi = representation(a_grid.reshape(-1), b_grid.reshape(-1))  # (n*n, 4)
    n = axis.numel()
    maps = {name: penalty_function(name, cfg)(psi, probs).reshape(n, n) for name in cfg.penalties}
    maps["erm_risk"] = pooled_risk(psi, probs).reshape(n, n)
    return maps


def path_climb(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    probs: torch.Tensor,
    start: tuple[float, float],
    end: tuple[float, float],
    points: int,
) -> dict[str, Any]:
    """The penalty along the straight segment start -> end: its values, the maximum, and the climb
    = max - max(endpoints) (0 when the maximum is an endpoint, > 0 over a ridge)."""
    t = torch.linspace(0.0, 1.0, points, dtype=DTYPE)  # (T,)
    a = start[0] + t * (end[0] - start[0])
    b = start[1] + t * (end[1] - start[1])
    values = fn(representation(a, b), probs)  # (T,)
    top = float(values.max())
    return {"t": t, "values": values, "max": top, "argmax_t": float(t[values.argmax()]),
            "climb": top - max(float(values[0]), float(values[-1]))}


def radius_below(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    probs: torch.Tensor,
    level: float,
    r_max: float,
    radii: int = 1501,
    angles: int = 360,
) -> float | None:
    """How far from the origin the penalty stays below `level`: the smallest radius (on a polar
    grid of `radii` radii in [0, r_max] x `angles` directions) at which it reaches `level`; None if
    it stays below within r_max. Measures "the penalties are low near the origin" without
    depending on one random initialisation."""
    r = torch.linspace(0.0, r_max, radii, dtype=DTYPE)  # (R,)
    theta = torch.linspace(0.0, 2 * torch.pi, angles + 1, dtype=DTYPE)[:-1]  # (A,)
    a = (r[:, None] * torch.cos(theta)[None, :]).reshape(-1)  # (R*A,)
    b = (r[:, None] * torch.sin(theta)[None, :]).reshape(-1)
    reached = (fn(representation(a, b), probs) >= level).reshape(radii, angles)  # (R, A)
    rows = reached.any(dim=1).nonzero()
    return None if rows.numel() == 0 else float(r[rows[0, 0]])


def _round(value: float) -> float:
    """6 significant digits: the numbers are exact expectations, printed readably."""
    return float(f"{value:.6g}")


# --- figure -----------------------------------------------------------------------------------------


def plot(run: Run, cfg: TwoBitsConfig, maps: dict[str, torch.Tensor], stars: dict[str, tuple[float, float]]) -> None:
    """Figure A.2: a log-scaled heat map per penalty with the three stars and the ERM -> invariant
    segment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    low, high = cfg.grid.extent
    names = list(cfg.penalties)
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.6), squeeze=False)
    styles = {"invariant": ("tab:green", "Invariant"), "erm": ("tab:red", "ERM"), "init": ("white", "random init")}
    for ax, name in zip(axes[0], names):
        values = maps[name].numpy()
        top = float(values.max())
        vmin = max(top * cfg.log_floor, 1e-300)
        image = ax.imshow(values.clip(min=vmin), origin="lower", extent=(low, high, low, high), cmap="viridis",
                          norm=LogNorm(vmin=vmin, vmax=max(top, vmin * 10)), aspect="equal", interpolation="nearest")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        (ea, eb), (ia, ib) = stars["erm"], stars["invariant"]
        ax.plot([ea, ia], [eb, ib], color="white", ls="--", lw=1)
        for star, (a, b) in stars.items():
            color, label = styles[star]
            ax.plot(a, b, marker="*", ms=15, color=color, mec="black", mew=0.8, ls="none", label=label)
        ax.set_title(f"{TITLES[name]} penalty (log scale)")
        ax.set_xlabel("a = Psi(1,1) = -Psi(-1,-1)")
        ax.set_ylabel("b = Psi(1,-1) = -Psi(-1,1)")
    axes[0][0].legend(loc="lower left", fontsize=8, framealpha=0.8)
    envs = ", ".join(f"({a:g}, {b:g})" for a, b in cfg.environments)
    fig.suptitle(f"TwoBits penalty landscapes, environments (alpha, beta) in {{{envs}}}, MSE, symmetric Psi")
    fig.tight_layout()
    run.save_figure(fig, "figA.2-twobits")
