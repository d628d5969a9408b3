"""Linear disentanglement (thesis sec 3.1, Figure 3.1): data, selection, measurement, end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from owai.data.linear_tasks import entangle, random_orthonormal, sample_task
from owai.errors import OwaiError
from owai.methods import linear_disentanglement as ld
from owai.methods.linear_disentanglement import LinearDisentanglementConfig, check, fit_select, run_repeat, size_to_reach


def small_cfg(**eval_kw) -> LinearDisentanglementConfig:
    cfg = LinearDisentanglementConfig()
    cfg.eval.test_size = 1000
    cfg.eval.workers = 1
    for k, v in eval_kw.items():
        setattr(cfg.eval, k, v)
    return cfg


# --- data -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 5, 100])
def test_random_orthonormal_is_orthonormal(n):
    a = random_orthonormal(n, np.random.default_rng(n))
    assert a.shape == (n, n)
    np.testing.assert_allclose(a @ a.T, np.eye(n), atol=1e-10)
    np.testing.assert_allclose(a.T @ a, np.eye(n), atol=1e-10)


def test_random_orthonormal_differs_per_seed_and_is_not_trivial():
    a = random_orthonormal(100, np.random.default_rng(0))
    b = random_orthonormal(100, np.random.default_rng(1))
    assert not np.allclose(a, b)
    # a random rotation spreads coordinate 0 over all coordinates: no entry close to +-1
    assert np.abs(a).max() < 0.6


def test_label_noise_rate_is_eps():
    m = 200_000
    for eps in (0.0, 0.1, 0.3):
        x, y = sample_task(m, 10, np.random.default_rng(1), task=0, noise=eps)
        flipped = np.mean(y != (x[:, 0] > 0))
        assert abs(flipped - eps) < 4 * math.sqrt(max(eps * (1 - eps), 1e-12) / m) + 1e-12
    assert set(np.unique(y)) == {0, 1}


def test_labels_depend_only_on_the_task_coordinate():
    x, y = sample_task(50_000, 20, np.random.default_rng(2), task=3, sigma=2.0, noise=0.0)
    assert x.shape == (50_000, 20)
    np.testing.assert_array_equal(y, (x[:, 3] > 0).astype(int))
    # with noise, the class-conditional means differ along coordinate 3 only
    x, y = sample_task(50_000, 20, np.random.default_rng(3), task=3, sigma=2.0, noise=0.1)
    gap = np.abs(x[y == 1].mean(0) - x[y == 0].mean(0))
    assert gap[3] > 2.0  # 2 * 0.8 * E|X| = 2 * 0.8 * 2 * sqrt(2/pi) ~ 2.55
    assert np.delete(gap, 3).max() < 0.1


def test_entangle_is_a_rotation_of_each_sample():
    rng = np.random.default_rng(4)
    a = random_orthonormal(30, rng)
    x, _ = sample_task(500, 30, rng)
    xe = entangle(x, a)
    np.testing.assert_allclose(xe[7], a @ x[7])
    np.testing.assert_allclose(np.linalg.norm(xe, axis=1), np.linalg.norm(x, axis=1))
    np.testing.assert_allclose(xe @ a, x, atol=1e-10)  # invertible: same information


# --- measurement --------------------------------------------------------------------------------------


def test_size_to_reach_interpolates_in_log_size():
    sizes = [10, 100, 1000]
    # 0.8 is halfway from 0.7 (n=100) to 0.9 (n=1000): halfway in log n is sqrt(100 * 1000)
    assert size_to_reach(sizes, [0.6, 0.7, 0.9], 0.8) == pytest.approx(math.sqrt(1e5))
    assert size_to_reach(sizes, [0.6, 0.7, 0.9], 0.75) == pytest.approx(10 ** 2.25)
    assert size_to_reach(sizes, [0.6, 0.8, 0.9], 0.8) == pytest.approx(100)  # exactly on a grid point
    assert size_to_reach(sizes, [0.85, 0.88, 0.9], 0.8) == 10  # reached at once: the first size
    assert size_to_reach(sizes, [0.6, 0.7, 0.75], 0.8) is None  # never reached
    # not monotone: the first crossing counts
    assert size_to_reach([10, 20, 40, 80], [0.5, 0.9, 0.7, 0.95], 0.7) == pytest.approx(10 * 2**0.5)


def test_single_class_training_set_predicts_that_class():
    cfg = small_cfg()
    rng = np.random.default_rng(5)
    x_test, y_test = sample_task(1000, 100, rng)
    x_train = rng.standard_normal((5, 100))
    res = fit_select(cfg, x_train, np.ones(5, dtype=int), x_test[:10], y_test[:10], x_test, y_test, 0)
    assert res["degenerate"] and res["penalty"] == "constant" and res["C"] is None
    assert res["acc"] == pytest.approx(np.mean(y_test == 1))


def test_selection_prefers_l1_on_the_disentangled_representation():
    """From 100 examples the validation set picks a sparse (L1) model that ignores the 99 noise
    coordinates and sits at the Bayes accuracy."""
    cfg = small_cfg()
    rng = np.random.default_rng(6)
    parts = [sample_task(m, 100, rng) for m in (100, 100, 4000)]
    res = fit_select(cfg, *parts[0], *parts[1], *parts[2], 0)
    assert res["penalty"] == "l1" and not res["degenerate"]
    assert res["acc"] > 0.87


def test_run_repeat_is_deterministic_per_seed_size_repeat():
    cfg = small_cfg(test_size=300)
    a, b = run_repeat(cfg, 20, 3), run_repeat(cfg, 20, 3)
    assert a == b
    c = run_repeat(cfg, 20, 4)
    assert c["disentangled"]["acc"] != a["disentangled"]["acc"] or c["entangled"]["acc"] != a["entangled"]["acc"]


def test_l2_alone_cannot_tell_the_representations_apart():
    """L2-regularised logistic regression is rotation invariant: with L2 only, the entangled and
    disentangled accuracies coincide (up to the solver's tolerance). The gap comes from L1."""
    cfg = small_cfg(test_size=2000)
    cfg.learner.penalties = ["l2"]
    rows = [run_repeat(cfg, 50, r) for r in range(5)]
    for row in rows:
        assert row["disentangled"]["acc"] == pytest.approx(row["entangled"]["acc"], abs=0.01)


def test_disentangled_beats_entangled_at_small_sizes():
    cfg = small_cfg(test_size=1000)
    rows = [run_repeat(cfg, 50, r) for r in range(16)]
    dis = np.mean([r["disentangled"]["acc"] for r in rows])
    ent = np.mean([r["entangled"]["acc"] for r in rows])
    assert dis > 0.85  # near the 0.9 Bayes rate from 50 examples
    assert ent < 0.7  # far from it
    assert dis - ent > 0.15


@pytest.mark.parametrize(
    "field, value",
    [("eval.train_sizes", [10, 10]), ("eval.train_sizes", []), ("eval.repeats", 0), ("data.task", 100),
     ("data.noise", 0.5), ("learner.Cs", [0.0]), ("eval.val_size", 0), ("eval.target_accuracy", 1.0)],
)
def test_check_rejects_bad_settings(field, value):
    cfg = LinearDisentanglementConfig()
    section, name = field.split(".")
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(OwaiError):
        check(cfg)
    check(LinearDisentanglementConfig())  # the defaults are fine


# --- end to end -----------------------------------------------------------------------------------------


TINY = [
    "eval.train_sizes=[10, 50, 200]",
    "eval.repeats=4",
    "eval.test_size=500",
    "eval.workers=1",
    "learner.Cs=[0.1, 1.0]",
]


def test_recipe_presets():
    from owai.recipes import load

    recipe = load("linear-disentanglement")
    assert recipe.method == "linear_disentanglement" and recipe.default_preset == "cpu"
    assert [r.ref for r in recipe.reproduces] == ["Figure 3.1"]
    assert recipe.params_for("paper")["eval"]["repeats"] == 500
    assert set(recipe.thesis) == {"disentangled.n_to_target", "entangled.n_to_target", "sample_complexity_ratio"}


def test_end_to_end_tiny_run(tmp_path):
    from owai.experiment import execute

    run, results = execute("linear-disentanglement", "cpu", TINY, out=tmp_path)
    rows = {r["metric"]: r for r in results["rows"]}
    assert set(rows) == {"disentangled.n_to_target", "entangled.n_to_target", "sample_complexity_ratio"}
    assert all(r["ref"] == "Figure 3.1" and r["thesis_claim"] for r in rows.values())
    assert (run.figures / "fig3.1-sample-complexity.png").stat().st_size > 1000
    on_disk = json.loads((run.path / "results.json").read_text())
    assert on_disk["rows"] == results["rows"]
    details = results["details"]
    assert details["train_sizes"] == [10, 50, 200] and details["bayes_accuracy"] == pytest.approx(0.9)
    for rep in ("disentangled", "entangled"):
        curve = details["curves"][rep]
        assert len(curve["mean"]) == len(curve["se"]) == len(curve["penalties"]) == 3
        assert all(0 <= m <= 1 for m in curve["mean"])
        assert all(sum(p.values()) == 4 for p in curve["penalties"])
    dis = rows["disentangled.n_to_target"]["measured"]
    assert dis is not None and 10 <= dis <= 200  # the disentangled curve passes 0.8 within the grid
    ent = rows["entangled.n_to_target"]["measured"]
    ratio = rows["sample_complexity_ratio"]["measured"]
    assert (ratio is None) == (ent is None)
    assert sorted(p.name for p in (run.path / "partial").iterdir()) == ["n10.json", "n200.json", "n50.json"]


def test_finished_sizes_are_reused(tmp_path, monkeypatch):
    """A resumed run reads finished training sizes from <run>/partial instead of refitting."""
    from owai.experiment import execute, resolve
    from owai.recipes import load
    from owai.runs import Run

    run, first = execute("linear-disentanglement", "cpu", TINY, out=tmp_path)
    cfg, _ = resolve(load("linear-disentanglement"), "cpu", TINY)

    def boom(*args, **kwargs):
        raise AssertionError("refitted a cached size")

    monkeypatch.setattr(ld, "run_repeat", boom)
    again = ld.collect(cfg, Run(run.path))
    assert ld.aggregate(cfg, again) == first["details"]["curves"]
    # a cache made under other settings is not reused
    cfg.eval.repeats = 5
    with pytest.raises(AssertionError, match="refitted"):
        ld.collect(cfg, Run(run.path))
