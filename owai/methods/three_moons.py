"""Three moons predictive disentanglement (thesis sec 3.3, Figures 3.5, 3.6, B.1).

Trains the 1-memory (Nh=1) and 3-memory (Nh=3) networks of Fig 3.4 on sequences from the training
period sets, then measures the error of 25 autoregressive predictions against the context length
on a training and a held-out period set. The claims: the 1-head net only becomes accurate once the
context passes lcm(p1, p2, p3); the 3-head net improves at each moon's period and is accurate after
max(p), having learned one moon per memory (near-permutation matrices).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from owai import console
from owai.config import BaseConfig
from owai.data.moons import TRAIN_PERIODS, VAL_PERIODS, lcm_periods, sample_sequences, time_step
from owai.errors import OwaiError
from owai.methods import Method, Outcome
from owai.models.moon_memory import MoonMemory, MoonMemoryConfig, clipped_mse
from owai.optim import MLXAdamW, linear_schedule
from owai.runs import Run
from owai.runtime import derive_seed, generator
from owai.train import LoopConfig, train_loop

Metric = Literal["exact", "reference"]

# The reference's Adam eps (1e-8) acts on its raw 6x6 weights. owai stores each complex entry as
# (r, s), whose gradients are twice the raw entries' (r sits in two of its 2x2 block's four cells),
# so Adam's m and sqrt(v) are doubled too: doubling eps gives the reference's update exactly.
# Without bias correction eps is not negligible: with 1e-8 the weights drift 1e-2 from the reference
# within 30 steps (docs/results.md, "owai beside the official code").
COMPLEX_ADAM_EPS = 2e-8


@dataclass
class DataConfig:
    block_size: int = 800  # training sequence length
    min_periods_in_block: int = 3  # a block holds this many lcm periods of the slowest system
    phase: float = 0.3
    train_periods: list[list[float]] = field(default_factory=lambda: [list(p) for p in TRAIN_PERIODS])
    val_periods: list[list[float]] = field(default_factory=lambda: [list(p) for p in VAL_PERIODS])


@dataclass
class ModelConfig:
    heads: list[int] = field(default_factory=lambda: [1, 3])  # the variants to train
    beta: float = 50.0


@dataclass
class TrainConfig:
    steps: int = 500
    batch_size: int = 64
    lr: float = 1e-2  # linear decay lr -> lr_end over `steps` (MLX linear_schedule)
    lr_end: float = 5e-6
    clip: float = 0.5  # clipped-MSE threshold
    # inits per variant {heads: n} (absent = 1); the lowest held-out training loss is kept. The
    # 3-head net sometimes stops at a partial solution (App. B.1: "resembles XOR").
    restarts: dict[int, int] = field(default_factory=lambda: {1: 1, 3: 1})
    selection_sequences: int = 64  # held-out training-period sequences for that choice
    checkpoint_every: int = 50
    log_every: int = 10


@dataclass
class EvalConfig:
    n_sequences: int = 512  # per period set, as the thesis
    n_gen: int = 25  # autoregressive predictions per context length
    tau_stride: int = 1  # evaluate every k-th context length
    train_panel: int = 5  # the training period set shown (reference: train[5] = (0.5, 1, 2.5))
    metrics: list[Metric] = field(default_factory=lambda: ["exact", "reference"])
    chunk: int = 16  # sequences per rollout batch (memory: chunk * heads * taus * length floats)


@dataclass
class ThreeMoonsConfig(BaseConfig):
    seed: int = 100
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


class ThreeMoons(Method):
    Config = ThreeMoonsConfig
    cli = "owai moons three-moons"
    resume_overrides = ("train.lr", "train.lr_end")

    @staticmethod
    def validate(cfg: ThreeMoonsConfig) -> None:
        check(cfg)

    def run(self, cfg: ThreeMoonsConfig, run: Run) -> Outcome:
        device = run.device
        train_sets = [tuple(p) for p in cfg.data.train_periods]
        val_sets = [tuple(p) for p in cfg.data.val_periods]
        dt = time_step(train_sets + val_sets, cfg.data.block_size, cfg.data.min_periods_in_block)
        panels = {"train": train_sets[cfg.eval.train_panel], "val": val_sets[0]}

        measured: dict[str, Any] = {}
        details: dict[str, Any] = {"dt": dt, "panels": {k: list(v) for k, v in panels.items()}, "variants": {}}
        for heads in cfg.model.heads:
            model, restarts = train_variant(cfg, run, heads, train_sets, dt, device)
            curves = evaluate(cfg, model, panels, dt, device)
            var = summarise(model, curves, panels, dt)
            var["restarts"] = restarts
            details["variants"][f"heads{heads}"] = var
            measured.update(headline(heads, var, cfg.eval.metrics[0]))
            plot_curves(run, heads, curves, panels, dt)
        plot_matrices(run, details["variants"])
        return Outcome(measured=measured, details=details)


def check(cfg: ThreeMoonsConfig) -> None:
    """Reject impossible sizes before any work."""
    d, e = cfg.data, cfg.eval
    heads = cfg.model.heads
    if not heads or any(h not in (1, 3) for h in heads) or len(set(heads)) != len(heads):
        raise OwaiError(f"model.heads must be a non-empty subset of [1, 3], got {heads}")
    if not d.train_periods or not d.val_periods:
        raise OwaiError("data.train_periods and data.val_periods must be non-empty")
    for p in d.train_periods + d.val_periods:
        if len(p) != 3 or min(p) <= 0:
            raise OwaiError(f"a period set is three positive periods, got {p}")
    if {tuple(p) for p in d.train_periods} & {tuple(p) for p in d.val_periods}:
        raise OwaiError("data.val_periods must be disjoint from data.train_periods")
    if not 0 <= e.train_panel < len(d.train_periods):
        raise OwaiError(f"eval.train_panel={e.train_panel} is not an index of data.train_periods")
    t = cfg.train
    positive = {
        "data.block_size": d.block_size,
        "data.min_periods_in_block": d.min_periods_in_block,
        "train.steps": t.steps,
        "train.batch_size": t.batch_size,
        "train.restarts": min(t.restarts.values(), default=1),
        "train.selection_sequences": t.selection_sequences,
        "train.checkpoint_every": t.checkpoint_every,
        "train.log_every": t.log_every,
        "eval.n_sequences": e.n_sequences,
        "eval.n_gen": e.n_gen,
        "eval.tau_stride": e.tau_stride,
        "eval.chunk": e.chunk,
    }
    for name, value in positive.items():
        if value < 1:
            raise OwaiError(f"{name} must be >= 1, got {value}")
    if cfg.model.beta <= 0:
        raise OwaiError(f"model.beta must be > 0, got {cfg.model.beta}")
    if d.block_size < 2 * e.n_gen:
        raise OwaiError(f"data.block_size={d.block_size} is too short for eval.n_gen={e.n_gen}")
    if not e.metrics:
        raise OwaiError("eval.metrics must name at least one metric")


def train_variant(
    cfg: ThreeMoonsConfig, run: Run, heads: int, train_sets: list, dt: float, device: torch.device
) -> tuple[MoonMemory, list[dict[str, Any]]]:
    """Train `restarts` inits of the Nh=`heads` net; keep the one with the lowest held-out loss."""
    t, d = cfg.train, cfg.data
    length = d.block_size + 1

    def batch(purpose: str, n: int, *key: object) -> torch.Tensor:
        gen = generator(cfg.seed, purpose, *key)
        return sample_sequences(train_sets, n, length, dt, gen, d.phase, block_size=d.block_size).to(device)

    held_out = batch("selection", t.selection_sequences)
    best: tuple[float, MoonMemory] | None = None
    restarts = []
    for r in range(t.restarts.get(heads, 1)):
        stage = f"heads{heads}-r{r}"
        torch.manual_seed(derive_seed(cfg.seed, "init", heads, r))
        model = MoonMemory(MoonMemoryConfig(n_heads=heads, beta=cfg.model.beta)).to(device)
        optimizer = MLXAdamW(model.parameters(), lr=t.lr, eps=COMPLEX_ADAM_EPS)

        def loss_at(step: int, micro: int = 0, model: MoonMemory = model, stage: str = stage) -> torch.Tensor:
            x = batch("train", t.batch_size, stage, step)
            return clipped_mse(model(x[:, :-1]), x[:, 1:], t.clip)

        loop = LoopConfig(steps=t.steps, checkpoint_every=t.checkpoint_every, log_every=t.log_every)
        summary = train_loop(run, stage, model, optimizer, loss_at, loop, linear_schedule(t.lr, t.lr_end, t.steps))
        with torch.no_grad():
            selection = clipped_mse(model(held_out[:, :-1]), held_out[:, 1:], t.clip).item()
        restarts.append({"restart": r, "final_loss": summary["final_loss"], "selection_loss": selection})
        if best is None or selection < best[0]:
            best = (selection, model)
    assert best is not None
    return best[1], restarts


def evaluate(
    cfg: ThreeMoonsConfig, model: MoonMemory, panels: dict[str, tuple], dt: float, device: torch.device
) -> dict[str, Any]:
    """Mean |prediction - truth| over 25 rollout steps, 6 coordinates and the sequences, per tau.

    exact:     the prediction of x_{tau+g} against x_{tau+g}, g = 0..n_gen-1, every stored value
               correct.
    reference: the published procedure (`plotctx`, memory_mosaics spec 4.3-4.4): cached generation
               storing value 0 for the newest pairs, and its n_gen predictions after the prompt's own
               (of x_{tau+1} .. x_{tau+n_gen}), each compared with the truth one position earlier.
    """
    e, d = cfg.eval, cfg.data
    length = d.block_size + 1
    taus = torch.arange(1, length - e.n_gen + 1, e.tau_stride, device=device)  # prompt lengths
    curves: dict[str, Any] = {"tau": taus.tolist()}
    for panel, periods in panels.items():
        gen = generator(cfg.seed, "eval", panel)
        seqs = sample_sequences([periods], e.n_sequences, length, dt, gen, d.phase, block_size=d.block_size).to(device)
        offsets = torch.arange(e.n_gen, device=device)
        sums = {m: torch.zeros(len(taus), dtype=torch.float64, device=device) for m in e.metrics}
        chunks = range(0, e.n_sequences, e.chunk)
        for start in console.track(chunks, total=len(chunks), description=f"eval Nh={model.config.n_heads} {panel}"):
            seq = seqs[start : start + e.chunk]  # (b, L, 6)
            for metric in e.metrics:
                if metric == "reference":  # drop the prompt's prediction: gend[tau+g] against y[tau-1+g] = x[tau+g]
                    preds = model.rollout(seq, taus, e.n_gen + 1, zero_recent_values=True)[:, :, 1:]
                else:
                    preds = model.rollout(seq, taus, e.n_gen)  # (b, N, G, 6): preds[:, i, g] predicts x[tau_i + g]
                truth = seq[:, taus[:, None] + offsets[None, :]]  # (b, N, G, 6)
                sums[metric] += (preds - truth).abs().mean(dim=(2, 3)).sum(0).double()
        curves[panel] = {m: (s / e.n_sequences).tolist() for m, s in sums.items()}
    return curves


# --- measurements -------------------------------------------------------------------------------


def transition_points(tau: list[int], err: list[float], window: float = 6.0, min_drop: float = 0.03) -> list[dict]:
    """Context lengths where the error drops sharply.

    drop(t) = mean error over (t - window, t] minus mean error over (t, t + window]; a transition
    is a local maximum of drop(t) of at least `min_drop` (absolute) and 10% of the curve's total
    fall. Returns [{"tau", "drop"}] in increasing tau.
    """
    t, e = np.asarray(tau, dtype=float), np.asarray(err, dtype=float)
    drop = np.full(len(t), 0.0)
    for i, ti in enumerate(t):
        if ti - window < t[0]:  # too little context before it (the tau = 1 artefact: empty memory)
            continue
        before = e[(t > ti - window) & (t <= ti)]
        after = e[(t > ti) & (t <= ti + window)]
        if len(before) and len(after):
            drop[i] = before.mean() - after.mean()
    total = max(e[: max(3, len(e) // 50)].mean() - e[-max(3, len(e) // 10) :].mean(), 0.0)
    threshold = max(min_drop, 0.1 * total)
    points = []
    i = 0
    while i < len(t):
        if drop[i] >= threshold:  # one region above threshold = one transition at its peak
            j = i
            while j + 1 < len(t) and drop[j + 1] >= threshold:
                j += 1
            k = i + int(np.argmax(drop[i : j + 1]))
            points.append({"tau": float(t[k]), "drop": float(drop[k])})
            i = j + 1
        else:
            i += 1
    return points


def accurate_from(tau: list[int], err: list[float], fraction: float = 0.9) -> float:
    """The context length from which the error stays within (1 - fraction) of its total fall:
    err(t') <= end + (1 - fraction) (start - end) for every t' >= t."""
    e = np.asarray(err, dtype=float)
    start, end = e[: max(3, len(e) // 50)].mean(), e[-max(3, len(e) // 10) :].mean()
    level = end + (1 - fraction) * (start - end)
    above = np.nonzero(e > level)[0]
    i = 0 if len(above) == 0 else min(above[-1] + 1, len(e) - 1)
    return float(tau[i])


def permutation_score(matrix: np.ndarray) -> tuple[float, list[int]]:
    """How close a (complex) square matrix is to a scaled permutation.

    score = max over permutations pi of sum_i |W[i, pi(i)]|^2 / sum |W|^2: 1 for a permutation
    (one moon per head), about 1/n-to-1/2 for a dense matrix. Returns (score, pi).
    """
    power = np.abs(matrix) ** 2
    n = power.shape[0]
    best = max(itertools.permutations(range(n)), key=lambda pi: sum(power[i, pi[i]] for i in range(n)))
    return float(sum(power[i, best[i]] for i in range(n)) / power.sum()), list(best)


def disentanglement(model: MoonMemory) -> dict[str, Any]:
    """Permutation scores of W_phi, W_psi (rows = heads) and W_z^T, and whether all three assign
    the same moon to each head. `score` is the smallest of the three."""
    mats = {
        "W_phi": model.key.complex_matrix(),
        "W_psi": model.value.complex_matrix(),
        "W_z": model.out.complex_matrix(),
    }
    out: dict[str, Any] = {"moduli": {k: v.abs().detach().cpu().tolist() for k, v in mats.items()}}
    perms = {}
    for name, w in mats.items():
        w = w.detach().cpu().numpy()
        out[f"{name}_score"], perms[name] = permutation_score(w.T if name == "W_z" else w)
    out["permutation"] = perms["W_phi"]
    out["consistent"] = perms["W_phi"] == perms["W_psi"] == perms["W_z"]
    out["score"] = min(out[f"{k}_score"] for k in mats)
    return out


def summarise(model: MoonMemory, curves: dict[str, Any], panels: dict[str, tuple], dt: float) -> dict[str, Any]:
    summary: dict[str, Any] = {"curves": curves, "matrices": disentanglement(model), "panels": {}}
    for panel, periods in panels.items():
        steps = [p / dt for p in periods]
        info: dict[str, Any] = {"periods_steps": steps, "lcm_steps": lcm_periods(periods) / dt}
        for metric, err in curves[panel].items():
            info[metric] = {
                "transitions": transition_points(curves["tau"], err),
                "accurate_from": accurate_from(curves["tau"], err),
                "error_start": float(np.mean(err[: max(3, len(err) // 50)])),
                "error_end": float(np.mean(err[-max(3, len(err) // 10) :])),
            }
        summary["panels"][panel] = info
    return summary


PERIOD_TOLERANCE = 0.1  # a transition within 10 % of a moon's period is that period's drop


def period_drops(transitions: list[float], periods_steps: list[float], lcm_steps: float) -> dict[str, int]:
    """How the measured transitions sit against the moon periods, as Figs 3.5 / 3.6 describe them:
    `periods_with_drop`, the periods with a transition within PERIOD_TOLERANCE of them (the 3-head
    net "drops after seeing exactly p1, p2 and p3 observations"), and `drops_before_lcm`, the
    transitions before (1 - PERIOD_TOLERANCE) x lcm (none for the 1-head net, which repeats the last
    observation until the lcm)."""
    return {
        "periods_with_drop": sum(any(abs(t - p) <= PERIOD_TOLERANCE * p for t in transitions) for p in periods_steps),
        "drops_before_lcm": sum(t < (1 - PERIOD_TOLERANCE) * lcm_steps for t in transitions),
    }


def headline(heads: int, var: dict[str, Any], metric: str) -> dict[str, Any]:
    """The numbers set beside the thesis in results.json (names match the recipe's thesis keys)."""
    out: dict[str, Any] = {}
    for panel, info in var["panels"].items():
        m = info[metric]
        out[f"heads{heads}.{panel}.accurate_from"] = round(m["accurate_from"], 1)
        out[f"heads{heads}.{panel}.transitions"] = [round(p["tau"], 1) for p in m["transitions"]]
        drops = period_drops([p["tau"] for p in m["transitions"]], info["periods_steps"], info["lcm_steps"])
        out.update({f"heads{heads}.{panel}.{k}": v for k, v in drops.items()})
        out[f"heads{heads}.{panel}.accurate_from_over_lcm"] = round(m["accurate_from"] / info["lcm_steps"], 3)
        if metric != "reference" and "reference" in info:  # the published procedure, as Figs 3.5-3.6 plot it
            out[f"heads{heads}.{panel}.accurate_from_published"] = round(info["reference"]["accurate_from"], 1)
    out[f"heads{heads}.disentanglement"] = round(var["matrices"]["score"], 4)
    out[f"heads{heads}.one_moon_per_head"] = bool(var["matrices"]["consistent"] and var["matrices"]["score"] > 0.9)
    return out


# --- figures ------------------------------------------------------------------------------------


def plot_curves(run: Run, heads: int, curves: dict[str, Any], panels: dict[str, tuple], dt: float) -> None:
    """Fig 3.5 (Nh=1) / Fig 3.6 (Nh=3): error vs context length with period and lcm lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(11, 4.5), sharey=True)
    for ax, (panel, periods) in zip(np.atleast_1d(axes), panels.items()):
        for metric, err in curves[panel].items():
            ax.plot(curves["tau"], err, lw=1.4 if metric == "exact" else 1.0, label=f"{metric} metric")
        for i, p in enumerate(periods):
            ax.axvline(p / dt, color="0.45", ls="--", lw=0.9, label="moon period" if i == 0 else None)
        ax.axvline(lcm_periods(periods) / dt, color="red", lw=1.2, label="lcm(p1,p2,p3)")
        ax.set_title(f"{panel} periods {tuple(periods)}")
        ax.set_xlabel("context length (observations)")
        ax.set_ylim(-0.02, 1.0)
    np.atleast_1d(axes)[0].set_ylabel("mean |prediction - truth| over 25 steps")
    np.atleast_1d(axes)[-1].legend(loc="upper right", fontsize=8)
    fig.suptitle(f"Three moons, Nh={heads}: generation error vs context length")
    run.save_figure(fig, "fig3.5-single-head" if heads == 1 else "fig3.6-three-heads")


def plot_matrices(run: Run, variants: dict[str, Any]) -> None:
    """Fig B.1: moduli |w_ij| of the learned complex matrices, one row per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["W_phi", "W_psi", "W_z"]
    fig, axes = plt.subplots(len(variants), 3, figsize=(9, 3 * len(variants)), squeeze=False)
    for row, (variant, var) in enumerate(variants.items()):
        for col, name in enumerate(names):
            ax = axes[row, col]
            mod = np.asarray(var["matrices"]["moduli"][name])
            im = ax.imshow(mod, cmap="viridis", vmin=0, vmax=max(1.0, float(mod.max())))
            for (i, j), v in np.ndenumerate(mod):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k", fontsize=8)
            ax.set_title(f"{variant}: |{name}|")
            ax.set_xticks(range(mod.shape[1]))
            ax.set_yticks(range(mod.shape[0]))
            ax.set_xlabel("memory coordinate" if name == "W_z" else "moon")
            ax.set_ylabel("moon" if name == "W_z" else "memory coordinate")
        fig.colorbar(im, ax=list(axes[row]), shrink=0.8)
    fig.suptitle("Learned complex matrices (modulus); one moon per head = permutation")
    run.save_figure(fig, "figB.1-matrices")


def identity_check(n_heads: int) -> MoonMemory:
    """The thesis's analytic solution W_phi = W_psi = W_z = I (used by tests and docs)."""
    model = MoonMemory(MoonMemoryConfig(n_heads=n_heads))
    for lin in (model.key, model.value, model.out):
        lin.set_identity()
    return model

