"""Three-moons measurements: transition detection, permutation score, and the thesis's analytic
solution (W = I) showing the transitions the figures claim."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from owai.data.moons import CANDIDATE_RATIOS, TRAIN_PERIODS, VAL_PERIODS, lcm_periods, sample_sequences, time_step
from owai.methods.three_moons import (
    ThreeMoonsConfig,
    accurate_from,
    disentanglement,
    evaluate,
    headline,
    identity_check,
    period_drops,
    permutation_score,
    transition_points,
)
from owai.models.moon_memory import MoonMemory, MoonMemoryConfig
from owai.runtime import generator

DT = 0.0225


def test_period_split_is_the_reference_one():
    import itertools

    triples = list(itertools.combinations(CANDIDATE_RATIOS, 3))
    assert len(triples) == 35
    smallest = sorted(lcm_periods(t) for t in triples)[:9]
    chosen = sorted(lcm_periods(t) for t in TRAIN_PERIODS + VAL_PERIODS)
    assert chosen == smallest  # the 9 triples with the smallest lcm (ties broken as the reference)
    assert not set(TRAIN_PERIODS) & set(VAL_PERIODS)
    assert lcm_periods((0.5, 1.0, 2.5)) == 5.0 and lcm_periods((1.0, 1.5, 2.0)) == 6.0
    assert time_step(TRAIN_PERIODS + VAL_PERIODS, 800, 3) == pytest.approx(DT)  # 800 steps = 3 x lcm 6


def test_observations_are_unit_complex_numbers_with_the_right_period():
    seq = sample_sequences([(1.0, 2.0, 3.0)], 2, 300, DT, torch.Generator().manual_seed(0))
    z = torch.complex(seq[..., 0::2], seq[..., 1::2])
    torch.testing.assert_close(z.abs(), torch.ones_like(z.abs()))
    # moon 1 (period 1.0 = 44.4 steps) advances 2 pi dt / 1.0 rad per step
    step = torch.angle(z[:, 1:, 0] * z[:, :-1, 0].conj())
    torch.testing.assert_close(step, torch.full_like(step, -2 * np.pi * DT), atol=1e-4, rtol=0)


def test_transition_points_find_steps_of_a_staircase():
    tau = list(range(1, 401))
    err = [0.6 if t < 50 else 0.4 if t < 120 else 0.2 for t in tau]
    points = transition_points(tau, err)
    assert [round(p["tau"]) for p in points] == [49, 119]
    assert accurate_from(tau, err) == 120
    assert transition_points(tau, [0.5] * 400) == []


def test_permutation_score():
    perm = np.array([[0, 2j, 0], [0, 0, -1], [1.5, 0, 0]])
    score, pi = permutation_score(perm)
    assert score == pytest.approx(1.0) and pi == [1, 2, 0]
    assert permutation_score(np.ones((3, 3)))[0] == pytest.approx(1 / 3)


def test_identity_weights_are_a_consistent_permutation():
    d = disentanglement(identity_check(3))
    assert d["score"] == pytest.approx(1.0) and d["consistent"] and d["permutation"] == [0, 1, 2]


@pytest.fixture(scope="module")
def identity_curves():
    """The analytic solution W = I on the held-out period set, exact metric, every context length."""
    cfg = ThreeMoonsConfig()
    cfg.eval.n_sequences, cfg.eval.chunk, cfg.eval.metrics = 6, 6, ["exact"]
    panels = {"val": VAL_PERIODS[0]}
    return {h: evaluate(cfg, identity_check(h), panels, DT, torch.device("cpu")) for h in (1, 3)}


def test_one_memory_needs_the_full_lcm(identity_curves):
    curves = identity_curves[1]
    lcm = lcm_periods(VAL_PERIODS[0]) / DT  # 266.7 observations
    points = [p["tau"] for p in transition_points(curves["tau"], curves["val"]["exact"])]
    assert points and abs(points[0] - lcm) <= 6  # the first drop is at the lcm ...
    assert all(p > 0.9 * lcm for p in points)  # ... and nothing drops before it
    assert accurate_from(curves["tau"], curves["val"]["exact"], fraction=0.75) == pytest.approx(lcm, abs=6)


def test_three_memories_drop_at_each_period(identity_curves):
    err1, err3 = identity_curves[1]["val"]["exact"], identity_curves[3]["val"]["exact"]
    tau = identity_curves[3]["tau"]
    periods = [p / DT for p in VAL_PERIODS[0]]  # 44.4, 88.9, 133.3
    points = [p["tau"] for p in transition_points(tau, err3)]
    assert len(points) >= 3
    for found, period in zip(points[:3], periods):  # one drop per memorised orbit, in order
        assert abs(found - period) <= 6
    # after the slowest period (and long before the lcm) three memories predict far better than one:
    # about half the error here (0.49-0.50 over the sequences of seeds 100-104, whose periods fall off
    # the observation grid), where one memory's stays at its flat level until the lcm; the bound
    # leaves room for the draw of sequences (0.5 did not: seed 102 gives 0.504)
    after = tau.index(round(max(periods)) + 12)
    assert err3[after] < 0.6 * err1[after]


@pytest.mark.parametrize("metric", ["reference", "exact"])
def test_metrics_follow_their_definitions(metric):
    """`reference` is the published `plotctx`, written here in its own indexing: gend holds the prompt's
    outputs and then the cached steps' (gend[t] predicts x[t+1]), and for each context tau it takes
    mean |y[tau-1 : tau-1+G] - gend[tau : tau+G]| with y[t] = x[t+1]. `exact` compares the prediction of
    x[tau+g] with x[tau+g]. Both from the step-by-step generation of test_moon_memory."""
    from test_moon_memory import naive_rollout

    torch.manual_seed(7)
    model = MoonMemory(MoonMemoryConfig(n_heads=3, beta=8.0))
    cfg = ThreeMoonsConfig()
    cfg.data.block_size, cfg.eval.n_gen, cfg.eval.tau_stride, cfg.eval.metrics = 40, 5, 4, [metric]
    cfg.eval.n_sequences = cfg.eval.chunk = 3
    panels = {"val": VAL_PERIODS[0]}
    curves = evaluate(cfg, model, panels, DT, torch.device("cpu"))
    seq = sample_sequences([VAL_PERIODS[0]], 3, 41, DT, generator(cfg.seed, "eval", "val"), block_size=40)
    G, want = cfg.eval.n_gen, []
    with torch.no_grad():
        for tau in curves["tau"]:
            if metric == "exact":
                want.append((naive_rollout(model, seq, tau, G, False) - seq[:, tau : tau + G]).abs().mean())
                continue
            gend = torch.cat([model(seq[:, :tau]), naive_rollout(model, seq, tau, G + 1, True)[:, 1:]], 1)
            y = seq[:, 1:]
            want.append((y[:, tau - 1 : tau - 1 + G] - gend[:, tau : tau + G]).abs().mean())
    np.testing.assert_allclose(curves["val"][metric], torch.stack(want).numpy(), rtol=1e-5, atol=1e-6)


def test_period_drops_count_the_periods_with_a_drop_and_the_drops_before_the_lcm():
    """Figs 3.5 / 3.6 as the thesis reads them: the 3-head net drops at each moon's period, the 1-head
    net not before the lcm. The cpu run's exact transitions (docs/results.md) give 3 and 0; a drop
    far from every period, or a 1-head drop half-way to the lcm, is counted against them."""
    val, lcm = [44.4, 88.9, 133.3], 266.7
    assert period_drops([43.0, 85.0, 130.0], val, lcm) == {"periods_with_drop": 3, "drops_before_lcm": 3}
    assert period_drops([43.0, 110.0, 130.0], val, lcm)["periods_with_drop"] == 2  # 88.9 has none within 10 %
    assert period_drops([262.0], val, lcm) == {"periods_with_drop": 0, "drops_before_lcm": 0}
    assert period_drops([130.0, 262.0], val, lcm)["drops_before_lcm"] == 1



def test_period_drops_bounds_and_counting():
    """The edges of the recipe's readings, as its claims state them: a transition exactly 10 % from a
    period is "within 10 %" of it (inclusive), a transition exactly at 0.9 x lcm is not "before" it
    (strict), and `periods_with_drop` counts periods, not transitions: two drops around one period
    are one period with a drop (three drops around p1 must not pass for a drop at each of p1, p2, p3)."""
    periods, lcm = [50.0, 100.0, 150.0], 200.0
    assert period_drops([110.0], periods, lcm)["periods_with_drop"] == 1  # |110 - 100| = 10 % of 100
    assert period_drops([110.5], periods, lcm)["periods_with_drop"] == 0
    assert period_drops([180.0], periods, lcm)["drops_before_lcm"] == 0  # 0.9 x 200 is not before it
    assert period_drops([179.5], periods, lcm)["drops_before_lcm"] == 1
    assert period_drops([46.0, 50.0, 54.0], periods, lcm)["periods_with_drop"] == 1

def test_the_recipes_period_claims_judge_the_counts():
    from owai import recipes
    from owai.claims import judge_all

    by_id = {c["id"]: c for c in recipes.load("three-moons").claims}
    claims = [by_id["three-heads-drop-at-each-period-val"], by_id["one-head-no-drop-before-lcm-val"]]
    record = {**headline(3, {"panels": {"val": {"periods_steps": [44.4, 88.9, 133.3], "lcm_steps": 266.7,
                                                  "exact": {"accurate_from": 175.0, "transitions": [{"tau": 43.0}, {"tau": 85.0}, {"tau": 130.0}]}}},
                             "matrices": {"score": 1.0, "consistent": True}}, "exact"),
              **headline(1, {"panels": {"val": {"periods_steps": [44.4, 88.9, 133.3], "lcm_steps": 266.7,
                                                  "exact": {"accurate_from": 265.0, "transitions": [{"tau": 130.0}, {"tau": 262.0}]}}},
                             "matrices": {"score": 0.5, "consistent": False}}, "exact")}
    verdicts = {v["id"]: v["verdict"] for v in judge_all(claims, [record], "cpu")}
    assert verdicts == {"three-heads-drop-at-each-period-val": "holds", "one-head-no-drop-before-lcm-val": "misses"}


def test_headline_gives_the_published_procedures_accurate_from_beside_the_exact_one():
    """The figures' own measurement (the `reference` metric) is reported beside the headline metric,
    so the recipe can judge a claim on each; a run with only one metric reports only that one."""
    def info(exact: float, published: float) -> dict:
        return {"periods_steps": [44.4, 88.9, 133.3], "lcm_steps": 266.7, "exact": {"accurate_from": exact, "transitions": []},
                "reference": {"accurate_from": published, "transitions": []}}

    var = {"panels": {"val": info(175.0, 133.0)}, "matrices": {"score": 1.0, "consistent": True}}
    out = headline(3, var, "exact")
    assert out["heads3.val.accurate_from"] == 175.0 and out["heads3.val.accurate_from_published"] == 133.0
    assert "heads3.val.accurate_from_published" not in headline(3, var, "reference")
    del var["panels"]["val"]["reference"]
    assert "heads3.val.accurate_from_published" not in headline(3, var, "exact")
