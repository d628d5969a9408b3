"""Linear disentanglement and sample complexity (thesis sec 3.1, Figure 3.1).

A task that depends on one coordinate of a disentangled representation X ~ N(0, sigma^2 I_n)
(Y = 1[X_i > 0] with label noise eps) is learned by L1/L2-regularised logistic regression
(liblinear) from the disentangled X or from an entangled X' = A X (A random orthonormal, fresh per
repeat, same samples and labels). (penalty, C) is chosen on an IID validation set and the IID test
accuracy is recorded against the number of training examples. The claim (Ng 2004): from the
disentangled representation, L1 needs O(log n) examples; any rotation-invariant learner (L2
included, which is why L2 does equally well on both) needs Omega(n), so the entangled
representation needs many more.

Measured: for each representation, the training size at which the mean test accuracy first
reaches `eval.target_accuracy` (linear interpolation in log n between grid points), and their
ratio entangled / disentangled.

Each repeat draws its data from seeds derived from (seed, part, size, repeat), so results do not
depend on the order or the process that computes them; finished training sizes are cached in
<run>/partial/ and reused by `--resume`.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from owai import console
from owai.config import BaseConfig, memory_bytes
from owai.data.linear_tasks import entangle, random_orthonormal, sample_task
from owai.errors import OwaiError
from owai.io import atomic_write_json
from owai.methods import Method, Outcome
from owai.runs import Run
from owai.runtime import derive_seed

Penalty = Literal["l1", "l2"]
REPRESENTATIONS = ("disentangled", "entangled")


@dataclass
class DataConfig:
    n_features: int = 100  # n, the thesis's dimension
    task: int = 0  # i: the coordinate the labels depend on (assumption; any i is equivalent)
    sigma: float = 1.0  # X ~ N(0, sigma^2 I) (assumption; irrelevant for the labels)
    noise: float = 0.1  # eps, the label flip probability (assumption); Bayes accuracy 1 - eps


@dataclass
class LearnerConfig:
    penalties: list[Penalty] = field(default_factory=lambda: ["l1", "l2"])
    Cs: list[float] = field(default_factory=lambda: [0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 50.0, 100.0])
    max_iter: int = 100  # liblinear's iteration cap (scikit-learn's default)
    tol: float = 1e-4


@dataclass
class EvalConfig:
    train_sizes: list[int] = field(default_factory=lambda: [10, 20, 50, 100, 200, 500, 1000, 2000])
    repeats: int = 500  # per training size: fresh data and a fresh A each time
    val_size: int | None = None  # None: the same as the training size
    test_size: int = 10000
    # between chance (0.5) and the Bayes rate (0.9 at eps = 0.1); 0.8, not 0.85, because the
    # entangled curve only reaches 0.85 at about 3000 examples, beyond the grid
    target_accuracy: float = 0.8
    workers: int = 1  # processes for the repeats; 0 = all CPU cores


@dataclass
class LinearDisentanglementConfig(BaseConfig):
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


class LinearDisentanglement(Method):
    Config = LinearDisentanglementConfig
    cli = "owai moons linear"

    @staticmethod
    def validate(cfg: LinearDisentanglementConfig) -> None:
        check(cfg)

    def run(self, cfg: LinearDisentanglementConfig, run: Run) -> Outcome:
        per_size = collect(cfg, run)
        curves = aggregate(cfg, per_size)
        target = cfg.eval.target_accuracy
        sizes = cfg.eval.train_sizes
        n_to = {rep: size_to_reach(sizes, curves[rep]["mean"], target) for rep in REPRESENTATIONS}
        ratio = None
        if n_to["disentangled"] is not None and n_to["entangled"] is not None:
            ratio = n_to["entangled"] / n_to["disentangled"]
        measured: dict[str, Any] = {
            f"{rep}.n_to_target": None if n_to[rep] is None else round(n_to[rep], 1) for rep in REPRESENTATIONS
        }
        measured["sample_complexity_ratio"] = None if ratio is None else round(ratio, 2)
        e, d = cfg.eval, cfg.data
        details: dict[str, Any] = {
            "assumptions": {
                "n_features": d.n_features,
                "task": d.task,
                "sigma": d.sigma,
                "noise": d.noise,
                "val_size": "same as the training size" if e.val_size is None else e.val_size,
                "test_size": e.test_size,
                "repeats": e.repeats,
                "selection": "highest validation accuracy; ties broken by lower validation log-loss",
                "single_class_training_set": "predict that class (liblinear cannot fit one class)",
            },
            "bayes_accuracy": 1.0 - d.noise,
            "target_accuracy": target,
            "train_sizes": list(sizes),
            "n_to_target": n_to,
            # reached at the smallest grid size: the number is an upper bound, the ratio a lower one
            "censored": {rep: n_to[rep] is not None and n_to[rep] <= sizes[0] for rep in REPRESENTATIONS},
            "convergence_warnings": int(sum(sum(r["warnings"] for r in rows) for rows in per_size.values())),
            "curves": curves,
        }
        plot(run, cfg, curves, n_to)
        return Outcome(measured=measured, details=details)


def check(cfg: LinearDisentanglementConfig) -> None:
    """Reject impossible settings before any work."""
    d, lr, e = cfg.data, cfg.learner, cfg.eval
    if d.n_features < 1:
        raise OwaiError(f"data.n_features must be >= 1, got {d.n_features}")
    if not 0 <= d.task < d.n_features:
        raise OwaiError(f"data.task={d.task} is not a coordinate of data.n_features={d.n_features}")
    if d.sigma <= 0:
        raise OwaiError(f"data.sigma must be > 0, got {d.sigma}")
    if not 0 <= d.noise < 0.5:
        raise OwaiError(f"data.noise must be in [0, 0.5), got {d.noise}")
    if not lr.penalties or len(set(lr.penalties)) != len(lr.penalties):
        raise OwaiError(f"learner.penalties must be a non-empty list of distinct 'l1'/'l2', got {lr.penalties}")
    if not lr.Cs or any(c <= 0 for c in lr.Cs):
        raise OwaiError(f"learner.Cs must be a non-empty list of positive numbers, got {lr.Cs}")
    if lr.max_iter < 1 or lr.tol <= 0:
        raise OwaiError(f"learner.max_iter must be >= 1 and learner.tol > 0, got {lr.max_iter}, {lr.tol}")
    sizes = e.train_sizes
    if not sizes or any(n < 1 for n in sizes) or any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise OwaiError(f"eval.train_sizes must be a non-empty increasing list of sizes >= 1, got {sizes}")
    for name, value in [("eval.repeats", e.repeats), ("eval.test_size", e.test_size)]:
        if value < 1:
            raise OwaiError(f"{name} must be >= 1, got {value}")
    if e.val_size is not None and e.val_size < 1:
        raise OwaiError(f"eval.val_size must be >= 1 (or null for the training size), got {e.val_size}")
    rows = sizes[-1] + (e.val_size or sizes[-1]) + e.test_size  # one repeat's samples at the largest size
    needed = 3 * 8 * rows * d.n_features  # float64, disentangled and entangled views, the solver's copy
    if needed > memory_bytes():
        raise OwaiError(f"eval.test_size={e.test_size}, eval.train_sizes up to {sizes[-1]} and data.n_features={d.n_features} "
                        f"need about {needed / 2**30:,.0f} GiB for one repeat, more than this machine's "
                        f"{memory_bytes() / 2**30:,.0f} GiB; lower eval.test_size")
    if not 0 < e.target_accuracy < 1:
        raise OwaiError(f"eval.target_accuracy must be in (0, 1), got {e.target_accuracy}")
    if e.workers < 0:
        raise OwaiError(f"eval.workers must be >= 0, got {e.workers}")


# --- one repeat -----------------------------------------------------------------------------------


def make_learner(penalty: str, c: float, max_iter: int, tol: float, random_state: int) -> Any:
    """liblinear logistic regression with an L1 or L2 penalty on the weights and the intercept.

    scikit-learn 1.8 deprecated `penalty` for `l1_ratio` (1 = L1, 0 = L2); older versions only
    know `penalty`.
    """
    import sklearn
    from sklearn.linear_model import LogisticRegression

    major, minor = (int(p) for p in sklearn.__version__.split(".")[:2])
    kind = {"l1_ratio": 1.0 if penalty == "l1" else 0.0} if (major, minor) >= (1, 8) else {"penalty": penalty}
    return LogisticRegression(solver="liblinear", C=c, max_iter=max_iter, tol=tol, random_state=random_state, **kind)


def fit_select(
    cfg: LinearDisentanglementConfig,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_val: np.ndarray,
    y_val: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    random_state: int,
) -> dict[str, Any]:
    """Fit every (penalty, C), keep the best on validation, return its test accuracy.

    Selection: highest validation accuracy, ties (frequent with small validation sets) broken by
    the lower validation log-loss, so the grid's order does not matter.

    A tiny training set can hold a single class, which liblinear refuses to fit. Then there is
    nothing to select: the learner predicts that (majority) class everywhere and the repeat is
    recorded with penalty "constant", C None and degenerate True.
    """
    classes = np.unique(y_train)
    if len(classes) < 2:
        label = int(classes[0])
        return {"acc": float(np.mean(y_test == label)), "penalty": "constant", "C": None, "degenerate": True, "warnings": 0}
    sign_val = 2.0 * y_val - 1.0
    best: tuple[float, float] | None = None
    chosen: tuple[str, float, np.ndarray, float] | None = None
    n_warnings = 0
    for penalty in cfg.learner.penalties:
        for c in cfg.learner.Cs:
            model = make_learner(penalty, c, cfg.learner.max_iter, cfg.learner.tol, random_state)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.fit(x_train, y_train)
            n_warnings += sum(1 for w in caught if "converge" in str(w.message).lower())
            w, b = model.coef_.ravel(), float(model.intercept_[0])  # classes_ = [0, 1]
            score = x_val @ w + b
            acc = float(np.mean((score > 0) == (y_val == 1)))
            loss = float(np.mean(np.logaddexp(0.0, -sign_val * score)))
            key = (-acc, loss)
            if best is None or key < best:
                best, chosen = key, (penalty, float(c), w, b)
    assert chosen is not None
    penalty, c, w, b = chosen
    test_acc = float(np.mean(((x_test @ w + b) > 0) == (y_test == 1)))
    return {"acc": test_acc, "penalty": penalty, "C": c, "degenerate": False, "warnings": n_warnings}


def run_repeat(cfg: LinearDisentanglementConfig, size: int, repeat: int) -> dict[str, Any]:
    """One repeat at one training size: the same samples and labels seen through both
    representations. Each part (A, train, val, test) has its own generator seeded from
    (seed, part, size, repeat), so e.g. the test size does not change the training data.

    The matrices are small (n = 100), so BLAS runs single-threaded (multithreaded OpenBLAS is
    slower here, and much slower on a busy machine), and scikit-learn's per-call input
    validation, a large share of the cost of fitting tiny problems, is skipped (inputs are ours).
    """
    import sklearn
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1), sklearn.config_context(assume_finite=True, skip_parameter_validation=True):
        return _run_repeat(cfg, size, repeat)


def _run_repeat(cfg: LinearDisentanglementConfig, size: int, repeat: int) -> dict[str, Any]:
    d, e = cfg.data, cfg.eval

    def rng(part: str) -> np.random.Generator:
        return np.random.default_rng(derive_seed(cfg.seed, "linear", part, size, repeat))

    a = random_orthonormal(d.n_features, rng("rotation"))
    parts = {}
    for part, m in (("train", size), ("val", e.val_size or size), ("test", e.test_size)):
        parts[part] = sample_task(m, d.n_features, rng(part), d.task, d.sigma, d.noise)
    random_state = derive_seed(cfg.seed, "liblinear", size, repeat) % 2**31
    out: dict[str, Any] = {"repeat": repeat, "warnings": 0}
    for rep in REPRESENTATIONS:
        view = (lambda x: x) if rep == "disentangled" else (lambda x: entangle(x, a))
        (xt, yt), (xv, yv), (xs, ys) = parts["train"], parts["val"], parts["test"]
        res = fit_select(cfg, view(xt), yt, view(xv), yv, view(xs), ys, random_state)
        out["warnings"] += res.pop("warnings")
        out[rep] = res
    return out


# --- all repeats, cached per training size ---------------------------------------------------------


def cache_key(cfg: LinearDisentanglementConfig) -> int:
    """What a cached size depends on: everything but the worker count and the target."""
    params = asdict(cfg)
    params["eval"] = {k: v for k, v in params["eval"].items() if k not in ("workers", "target_accuracy", "train_sizes")}
    params.pop("runtime", None)
    return derive_seed(sorted(params.items()))


def collect(cfg: LinearDisentanglementConfig, run: Run) -> dict[int, list[dict[str, Any]]]:
    """Every repeat at every training size; sizes finished by an earlier (killed) attempt of this
    run are read back from <run>/partial/ instead of being recomputed."""
    e = cfg.eval
    key = cache_key(cfg)
    partial = run.path / "partial"
    partial.mkdir(exist_ok=True)
    results: dict[int, list[dict[str, Any]]] = {}
    todo = []
    for size in e.train_sizes:
        cached = read_cache(partial / f"n{size}.json", key, e.repeats)
        if cached is not None:
            results[size] = cached
        else:
            todo.append(size)
    if len(todo) < len(e.train_sizes):
        console.info(f"reusing {len(e.train_sizes) - len(todo)} finished training sizes from {partial}")
    workers = e.workers or _cpu_count()
    # progress in units of fitted examples, so that the bar moves with the work
    weight = {n: max(n, 20) for n in todo}
    total = sum(weight[n] * e.repeats for n in todo)
    chunk = max(1, 8 * workers)
    pool = None
    if workers > 1 and todo:
        from joblib import Parallel

        pool = Parallel(n_jobs=workers)
    with console.Bar("linear disentanglement", total=total) as bar:
        for size in todo:
            rows: list[dict[str, Any]] = []
            for start in range(0, e.repeats, chunk):
                reps = range(start, min(start + chunk, e.repeats))
                if pool is None:
                    rows.extend(run_repeat(cfg, size, r) for r in reps)
                else:
                    from joblib import delayed

                    rows.extend(pool(delayed(run_repeat)(cfg, size, r) for r in reps))
                bar.update(weight[size] * len(reps), status=f"n={size}")
            atomic_write_json(partial / f"n{size}.json", {"size": size, "key": key, "repeats": e.repeats, "rows": rows})
            results[size] = rows
    return results


def _cpu_count() -> int:
    """CPU cores this process may use (affinity and cgroup quotas included, via joblib)."""
    try:
        from joblib import cpu_count

        return max(1, cpu_count())
    except ImportError:
        return os.cpu_count() or 1


def read_cache(path: Path, key: int, repeats: int) -> list[dict[str, Any]] | None:
    """The rows of a finished size, or None if absent, unreadable or made under other settings."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != key or data.get("repeats") != repeats or len(data.get("rows", [])) != repeats:
        return None
    return data["rows"]


def aggregate(cfg: LinearDisentanglementConfig, per_size: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per representation and training size: mean, std and standard error of the test accuracy,
    how often each penalty and C was chosen, and how many training sets held one class."""
    curves: dict[str, Any] = {}
    for rep in REPRESENTATIONS:
        c: dict[str, list[Any]] = {k: [] for k in ("mean", "std", "se", "penalties", "C", "degenerate", "l1_share")}
        for size in cfg.eval.train_sizes:
            res = [row[rep] for row in per_size[size]]
            acc = np.array([r["acc"] for r in res])
            std = float(acc.std(ddof=1)) if len(acc) > 1 else 0.0
            c["mean"].append(float(acc.mean()))
            c["std"].append(std)
            c["se"].append(std / math.sqrt(len(acc)))
            pens = [r["penalty"] for r in res]
            c["penalties"].append({p: pens.count(p) for p in sorted(set(pens))})
            cs = [r["C"] for r in res if r["C"] is not None]
            c["C"].append({f"{v:g}": cs.count(v) for v in sorted(set(cs))})
            c["degenerate"].append(sum(r["degenerate"] for r in res))
            c["l1_share"].append(pens.count("l1") / len(pens))
        curves[rep] = c
    return curves


def size_to_reach(sizes: list[int], accuracy: list[float], target: float) -> float | None:
    """The training size at which the accuracy curve first reaches `target`.

    Between the last grid point below the target and the first at or above it, the curve is
    interpolated linearly in log(size). Returns sizes[0] when the first point already reaches the
    target (an upper bound) and None when no point does.
    """
    for i, acc in enumerate(accuracy):
        if acc >= target:
            if i == 0:
                return float(sizes[0])
            a0, a1 = accuracy[i - 1], acc
            l0, l1 = math.log(sizes[i - 1]), math.log(sizes[i])
            frac = (target - a0) / (a1 - a0)
            return float(math.exp(l0 + frac * (l1 - l0)))
    return None


# --- figure ------------------------------------------------------------------------------------------


def plot(run: Run, cfg: LinearDisentanglementConfig, curves: dict[str, Any], n_to: dict[str, float | None]) -> None:
    """Fig 3.1: mean test accuracy vs training size (log x), error bars = standard error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = cfg.eval.train_sizes
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    colors = {"disentangled": "tab:blue", "entangled": "tab:orange"}
    for rep in REPRESENTATIONS:
        ax.errorbar(sizes, curves[rep]["mean"], yerr=curves[rep]["se"], marker="o", ms=4, capsize=3,
                    color=colors[rep], label=f"{rep} (X)" if rep == "disentangled" else f"{rep} (AX)")
        if n_to[rep] is not None:
            ax.axvline(n_to[rep], color=colors[rep], ls=":", lw=1)
    bayes = 1.0 - cfg.data.noise
    ax.axhline(bayes, color="k", ls="--", lw=1, label=f"Bayes accuracy 1-eps = {bayes:g}")
    ax.axhline(cfg.eval.target_accuracy, color="0.5", ls=":", lw=1, label=f"target {cfg.eval.target_accuracy:g}")
    ax.set_xscale("log")
    ax.set_xlabel("training examples")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0.45, 1.0)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"Linear disentanglement: {cfg.data.n_features} features, {cfg.eval.repeats} repeats per point")
    run.save_figure(fig, "fig3.1-sample-complexity")
