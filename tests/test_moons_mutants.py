"""Mutation audit of the Three Moons experiments (thesis sec 3.1 / 3.3, Figs 3.2-3.5, B.1).

Each test here pins a rule that a hand-made mutant of owai/methods/three_moons.py,
owai/models/moon_memory.py or owai/runtime.py broke without any existing test failing: the training
set-up of `train_variant` (optimizer, schedule, model, keyed batches and inits, restart selection),
the evaluation's context range, the measurement constants of docs/decisions.md, the reference's
initialisation, and the keyed generators of runtime.py. Expected values come from docstrings,
docs/decisions.md or the reference's formulas, never from owai's own output. Each runs in seconds.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
import torch

from owai import runtime
from owai.data.moons import TRAIN_PERIODS, VAL_PERIODS, sample_sequences
from owai.methods import three_moons
from owai.methods.three_moons import (
    ThreeMoonsConfig,
    accurate_from,
    evaluate,
    headline,
    train_variant,
    transition_points,
)
from owai.models.moon_memory import (
    ComplexLinear,
    MoonMemory,
    MoonMemoryConfig,
    clipped_mse,
)
from owai.optim import MLXAdamW

DT = 0.0225  # docs/decisions.md: 800 steps hold 3 lcm periods
CPU = torch.device("cpu")


def _tiny(**train: Any) -> ThreeMoonsConfig:
    cfg = ThreeMoonsConfig()
    cfg.data.block_size = 60
    cfg.train.batch_size, cfg.train.selection_sequences, cfg.train.steps = 2, 4, 6
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def _train(cfg: ThreeMoonsConfig, heads: int, monkeypatch: pytest.MonkeyPatch, on_stage=None) -> tuple[MoonMemory, list, list]:
    """train_variant with train_loop replaced by a recorder (no Run needed: only train_loop reads it).
    `on_stage(stage, model)` may set the weights the "training" ends with."""
    calls: list[dict[str, Any]] = []

    def fake_loop(run, stage, model, optimizer, loss_at, loop, schedule):
        calls.append({"stage": stage, "model": model, "optimizer": optimizer, "loss_at": loss_at, "loop": loop,
                      "schedule": schedule, "init": [p.detach().clone() for p in model.parameters()]})
        if on_stage is not None:
            on_stage(stage, model)
        return {"final_loss": 0.0}

    monkeypatch.setattr(three_moons, "train_loop", fake_loop)
    model, restarts = train_variant(cfg, None, heads, [tuple(p) for p in cfg.data.train_periods], DT, CPU)
    return model, restarts, calls


# --- train_variant: the reference's training set-up -------------------------------------------------


def test_training_uses_mlx_adam_at_train_lr_with_the_doubled_eps_and_the_linear_schedule_over_train_steps(monkeypatch):
    """docs/decisions.md: MLX 0.9 Adam (no weight decay), lr falling linearly from train.lr to
    train.lr_end over train.steps updates, eps 2e-8 (COMPLEX_ADAM_EPS: the reference's 1e-8 on the raw
    6x6 entries, whose gradients are half owai's). Fails if the lr, the eps or the schedule's length is
    read from the wrong field (e.g. lr_end, checkpoint_every) or eps falls back to Adam's 1e-8."""
    cfg = _tiny(lr=0.02, lr_end=1e-4, steps=40, checkpoint_every=5, log_every=5)
    _, _, calls = _train(cfg, 3, monkeypatch)
    (call,) = calls
    opt = call["optimizer"]
    assert isinstance(opt, MLXAdamW)
    assert opt.defaults["lr"] == 0.02 and opt.defaults["eps"] == 2e-8 and opt.defaults["weight_decay"] == 0.0
    assert three_moons.COMPLEX_ADAM_EPS == 2e-8
    lr = call["schedule"]
    assert lr(0) == pytest.approx(0.02) and lr(20) == pytest.approx((0.02 + 1e-4) / 2) and lr(40) == pytest.approx(1e-4)
    assert call["loop"].steps == 40


def test_the_trained_net_has_the_variants_head_count_and_the_configured_beta(monkeypatch):
    """Nh = 1 or 3 memories (thesis Fig 3.4) and the configured fixed beta (model.beta; reference 50),
    with train.restarts[heads] inits, one where the variant is absent (TrainConfig: "absent = 1"):
    fails if train_variant builds every variant with one head, drops model.beta for the default, or
    reads another variant's restart count."""
    for heads in (1, 3):
        cfg = _tiny(restarts={3: 2})
        cfg.model.beta = 7.0
        model, _, calls = _train(cfg, heads, monkeypatch)
        assert model.config.n_heads == heads and model.config.beta == 7.0
        assert [c["stage"] for c in calls] == [f"heads{heads}-r{r}" for r in range({1: 1, 3: 2}[heads])]


def test_each_restart_gets_its_own_init_keyed_by_the_seed_not_the_global_rng(monkeypatch):
    """The init comes from derive_seed(seed, "init", heads, restart) (never the global RNG's state):
    two restarts start from different weights, a second call (after the global RNG moved) starts from
    the same ones, and another seed from others. Fails if the key drops the restart index or the seed."""
    cfg = _tiny(restarts={3: 2})
    torch.manual_seed(1)
    _, _, first = _train(cfg, 3, monkeypatch)
    torch.manual_seed(2)
    torch.rand(10)
    _, _, again = _train(cfg, 3, monkeypatch)
    assert [c["stage"] for c in first] == ["heads3-r0", "heads3-r1"]
    assert not torch.equal(first[0]["init"][0], first[1]["init"][0])
    for a, b in zip(first, again):
        assert all(torch.equal(x, y) for x, y in zip(a["init"], b["init"]))
    other = _tiny(restarts={3: 2})
    other.seed = 101
    _, _, moved = _train(other, 3, monkeypatch)
    assert not torch.equal(first[0]["init"][0], moved[0]["init"][0])


def test_the_training_loss_is_clipped_mse_of_z_t_against_x_t_plus_1_on_the_batch_keyed_by_seed_stage_and_step(monkeypatch):
    """Thesis eq. 4.1 / Fig 3.4: z_t predicts x_{t+1}; the loss is the clipped MSE at train.clip
    (App. B.1); docs/decisions.md: batches are drawn from derive_seed(seed, purpose, stage, step), so a
    resumed stage replays them. Fails if the target is x_t, the batch ignores the step (one batch for
    every update) or the seed, or the clip is not train.clip."""
    cfg = _tiny(clip=0.3)
    _, _, calls = _train(cfg, 3, monkeypatch)
    (call,) = calls
    model, loss_at = call["model"], call["loss_at"]
    train_sets = [tuple(p) for p in cfg.data.train_periods]
    with torch.no_grad():
        for step in (0, 1, 5):
            gen = runtime.generator(cfg.seed, "train", "heads3-r0", step)
            x = sample_sequences(train_sets, 2, 61, DT, gen, cfg.data.phase, block_size=60)
            want = clipped_mse(model(x[:, :-1]), x[:, 1:], 0.3)
            assert loss_at(step).item() == pytest.approx(want.item(), rel=1e-6)
        assert loss_at(0).item() != pytest.approx(loss_at(1).item(), rel=1e-6)


@pytest.mark.parametrize("good", [0, 1])
def test_the_restart_with_the_lowest_held_out_loss_is_kept(good, monkeypatch):
    """docs/decisions.md "Restarts": of train.restarts inits, the one with the lower clipped MSE on
    held-out training-period sequences is kept. Here one restart ends at the thesis's analytic solution
    W = I and the other predicts 0 everywhere; the identity must be kept wherever it comes. Fails if
    the worst, the first or the last restart is kept."""
    cfg = _tiny(restarts={3: 2})
    cfg.data.block_size = 300  # long enough for W = I to have seen each training moon's period

    def finish(stage: str, model: MoonMemory) -> None:
        if stage == f"heads3-r{good}":
            for lin in (model.key, model.value, model.out):
                lin.set_identity()
        else:
            with torch.no_grad():
                model.out.r.zero_()
                model.out.s.zero_()

    model, restarts, calls = _train(cfg, 3, monkeypatch, finish)
    assert model is calls[good]["model"]
    losses = [r["selection_loss"] for r in restarts]
    assert losses[good] < losses[1 - good]


def test_complex_adam_eps_gives_the_reference_update_on_its_raw_matrix():
    """docs/decisions.md: the reference keeps a raw real 6x6 matrix, projects each 2x2 block
    [[a, b], [c, d]] onto r = (a + d)/2, s = (b - c)/2 on every forward, and runs MLX Adam (no bias
    correction, eps 1e-8 outside the sqrt) on the raw entries; owai's MLXAdamW with COMPLEX_ADAM_EPS on
    (r, s) must give the same weights. Gradients are scaled down so that eps matters (as it does late
    in training). Fails with eps 1e-8 for owai."""
    torch.manual_seed(0)
    lin = ComplexLinear(3)
    raw = lin.real_matrix().detach().clone().double().requires_grad_(True)
    owai_lin = ComplexLinear(3)
    with torch.no_grad():
        owai_lin.r.copy_(lin.r)
        owai_lin.s.copy_(lin.s)
    owai_lin.double()
    x, target = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)

    def project(m: torch.Tensor) -> torch.Tensor:
        a, b, c, d = m[0::2, 0::2], m[0::2, 1::2], m[1::2, 0::2], m[1::2, 1::2]
        r, s = (a + d) / 2, (b - c) / 2
        out = torch.empty_like(m)
        out[0::2, 0::2], out[0::2, 1::2], out[1::2, 0::2], out[1::2, 1::2] = r, s, -s, r
        return out

    def loss(w: torch.Tensor) -> torch.Tensor:
        return 1e-9 * ((x @ w.T - target) ** 2).mean()

    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    m = torch.zeros_like(raw)
    v = torch.zeros_like(raw)
    opt = MLXAdamW(owai_lin.parameters(), lr=lr, eps=three_moons.COMPLEX_ADAM_EPS)
    for _ in range(20):
        (g,) = torch.autograd.grad(loss(project(raw)), raw)
        with torch.no_grad():
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            raw -= lr * m / (v.sqrt() + eps)
        opt.zero_grad()
        loss(owai_lin.real_matrix()).backward()
        opt.step()
    torch.testing.assert_close(owai_lin.real_matrix().detach(), project(raw.detach()), atol=1e-9, rtol=1e-7)


def test_complex_linear_init_is_the_references_uniform_raw_entries_projected():
    """docs/decisions.md / ComplexLinear: raw entries ~ U(+-1/sqrt(2n)) (MLX Linear on 2n = 6 inputs:
    U(+-1/sqrt 6)), projected, so r = (a + d)/2 and s = (b - c)/2 lie within the bound with variance
    bound^2 / 6. Fails if the bound is 1/sqrt(n) or the entries are not the projection of two uniforms."""
    torch.manual_seed(0)
    r = torch.cat([ComplexLinear(3).r.detach().flatten() for _ in range(2000)])
    s = torch.cat([ComplexLinear(3).s.detach().flatten() for _ in range(2000)])
    bound = 1 / math.sqrt(6)
    for w in (r, s):
        assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound
        assert w.std().item() == pytest.approx(bound / math.sqrt(6), rel=0.03)


# --- evaluation and measurements --------------------------------------------------------------------


def test_context_lengths_run_from_1_to_the_last_with_n_gen_observations_left():
    """docs/decisions.md "Evaluation range": tau runs from 1 to 776 over 801-step sequences (the last
    25 predictions end at the sequence's last observation). With tau_stride 25 the evaluated taus are
    1, 26, ..., 776. Fails if the range stops one stride (or one tau) short."""
    cfg = ThreeMoonsConfig()
    cfg.eval.n_sequences, cfg.eval.chunk, cfg.eval.tau_stride, cfg.eval.metrics = 1, 1, 25, ["exact"]
    model = MoonMemory(MoonMemoryConfig(n_heads=3))
    curves = evaluate(cfg, model, {"val": VAL_PERIODS[0]}, DT, CPU)
    assert curves["tau"] == list(range(1, 777, 25)) and curves["tau"][-1] == 776


def test_accurate_from_is_within_ten_percent_of_the_total_fall():
    """docs/decisions.md "accurate_from": the first tau after which the error stays within 10 % of its
    total fall. A staircase 1.0 -> 0.15 -> 0.05 -> 0 (fall 1.0): 0.15 is not within 0.1 of the end,
    0.05 is, so the answer is where 0.05 starts (200). Fails with another default fraction (0.75: 100)."""
    tau = list(range(1, 401))
    err = [1.0 if t < 100 else 0.15 if t < 200 else 0.05 if t < 300 else 0.0 for t in tau]
    assert accurate_from(tau, err) == 200


def test_a_transitions_drop_compares_six_contexts_before_with_six_after():
    """docs/decisions.md "Measured transition points": drop(tau) = mean error over (tau - 6, tau] minus
    over (tau, tau + 6]. On a linear ramp of slope s that is exactly 6 s: 0.048 for s = 0.008. Fails if
    the window is not 6 (3 gives 0.024, below the 0.03 floor: no transition at all)."""
    tau = list(range(1, 401))
    err = [0.6 if t < 100 else 0.6 - 0.008 * (t - 100) if t < 150 else 0.2 for t in tau]
    points = transition_points(tau, err)
    assert len(points) == 1 and 100 <= points[0]["tau"] < 150
    assert points[0]["drop"] == pytest.approx(6 * 0.008)


@pytest.mark.parametrize("score, expected", [(0.85, False), (0.95, True)])
def test_one_moon_per_head_needs_a_permutation_score_above_0_9(score, expected):
    """docs/decisions.md "Disentanglement score": `one_moon_per_head` means the score is above 0.9 and
    all three matrices assign the same moon to each head. Fails with another threshold (0.5, 0.8)."""
    var = {"panels": {}, "matrices": {"score": score, "consistent": True}}
    assert headline(3, var, "exact")["heads3.one_moon_per_head"] is expected


# --- runtime: keyed generators, seeding, devices ------------------------------------------------------


def test_generators_are_keyed_by_the_seed_and_every_name():
    """runtime.generator(*parts) is a torch.Generator seeded with derive_seed(*parts), a stable 63-bit
    number of all the parts: another seed or another name gives another stream, and the global RNG
    plays no part. Fails if the generator or derive_seed drops the seed, the names, or the 63-bit cut."""
    def draw(*parts: object) -> torch.Tensor:
        return torch.rand(4, generator=runtime.generator(*parts))

    torch.manual_seed(0)
    a = draw(100, "eval", "val")
    torch.manual_seed(1)
    assert torch.equal(a, draw(100, "eval", "val"))
    assert torch.equal(a, torch.rand(4, generator=torch.Generator().manual_seed(runtime.derive_seed(100, "eval", "val"))))
    for other in [(101, "eval", "val"), (100, "eval", "train"), (100, "train", "val"), (100, "eval")]:
        assert not torch.equal(a, draw(*other)), other
    seeds = {runtime.derive_seed(s, name, step) for s in range(5) for name in ("a", "b") for step in range(5)}
    assert len(seeds) == 50 and all(0 <= x < 2**63 for x in seeds)
    assert runtime.derive_seed(1, "train", 5) != runtime.derive_seed(2, "train", 5)


def test_seed_everything_seeds_python_numpy_and_torch():
    """seed_everything's docstring: Python, NumPy and torch are seeded, so the same seed draws the same
    numbers from each. Fails if one of the three is left unseeded."""
    def draws() -> tuple:
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    runtime.seed_everything(5)
    first = draws()
    random.random(), np.random.rand(), torch.rand(3)
    runtime.seed_everything(5)
    assert draws() == first


def test_auto_device_is_cuda_where_cuda_is_available(monkeypatch):
    """select_device's docstring: 'auto' picks CUDA when available (and the CPU otherwise); an explicit
    'cpu' stays the CPU. Fails if 'auto' always falls back to the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runtime.select_device("auto") == torch.device("cuda")
    assert runtime.select_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.select_device("auto") == torch.device("cpu")


# --- the run: which panels are evaluated and which metric is the headline ---------------------------


def _staircase(drop_at: int) -> list[float]:
    return [1.0 if t < drop_at else 0.0 for t in range(1, 401)]


def test_a_run_evaluates_the_configured_train_panel_and_headlines_the_first_metric(monkeypatch):
    """EvalConfig: the train panel is data.train_periods[eval.train_panel] (reference: train[5] =
    (0.5, 1, 2.5)) and the val panel val_periods[0]; docs/decisions.md: the headline keys are the first
    metric's (`exact`), the published procedure's accurate_from sits beside them. Training, rollouts
    and figures are replaced by stand-ins whose curves drop at known contexts (exact at 150, reference
    at 120). Fails if the train panel ignores eval.train_panel or the headline reads another metric."""
    from types import SimpleNamespace

    from owai.methods.three_moons import ThreeMoons, identity_check

    seen: list[dict] = []

    def fake_evaluate(cfg, model, panels, dt, device):
        seen.append(dict(panels))
        curve = {"exact": _staircase(150), "reference": _staircase(120)}
        return {"tau": list(range(1, 401)), **{p: dict(curve) for p in panels}}

    monkeypatch.setattr(three_moons, "train_variant", lambda cfg, run, heads, *a: (identity_check(heads), []))
    monkeypatch.setattr(three_moons, "evaluate", fake_evaluate)
    monkeypatch.setattr(three_moons, "plot_curves", lambda *a, **k: None)
    monkeypatch.setattr(three_moons, "plot_matrices", lambda *a, **k: None)
    run = SimpleNamespace(device=CPU)

    cfg = ThreeMoonsConfig()
    cfg.model.heads = [3]
    out = ThreeMoons().run(cfg, run)
    assert seen[-1] == {"train": (0.5, 1.0, 2.5), "val": (1.0, 2.0, 3.0)}
    assert out.measured["heads3.val.accurate_from"] == 150 and out.measured["heads3.val.accurate_from_published"] == 120

    cfg.eval.train_panel = 2
    ThreeMoons().run(cfg, run)
    assert seen[-1]["train"] == tuple(TRAIN_PERIODS[2])


def test_a_drop_is_measured_from_the_first_context_with_a_full_window():
    """docs/decisions.md "Measured transition points": only contexts shorter than the window are
    skipped (at tau = 1 the memory is empty). tau = 7 has a full window (1, 7] that leaves tau = 1 out,
    so an error that falls right after tau = 7 is a transition at 7. Fails if tau = 7 is skipped too."""
    tau = list(range(1, 401))
    err = [1.0 if t <= 7 else 0.0 for t in tau]
    assert [p["tau"] for p in transition_points(tau, err)] == [7.0]


@pytest.mark.parametrize("beta", [0.0, -1.0])
def test_a_kernel_bandwidth_that_is_not_positive_is_refused(beta):
    """Thesis eq. 4.1: beta is the kernel's (inverse) bandwidth, a positive number (fixed at 50 in the
    reference); beta = 0 makes every memory a plain average and a negative beta prefers the least
    similar keys. `check` refuses both before any work. Fails if beta = 0 passes."""
    from owai.errors import OwaiError
    from owai.methods.three_moons import check

    cfg = ThreeMoonsConfig()
    check(cfg)
    cfg.model.beta = beta
    with pytest.raises(OwaiError, match="model.beta must be > 0"):
        check(cfg)


def test_the_error_curve_is_the_mean_over_all_sequences_whatever_the_chunking():
    """evaluate's docstring: the mean |prediction - truth| over the rollout steps, the 6 coordinates
    and the sequences; eval.chunk only bounds memory. A net whose output map is 0 predicts 0 everywhere,
    so its exact error at tau is mean |x[tau : tau + n_gen]| over the evaluation sequences (keyed by
    (seed, "eval", panel), docs/decisions.md). Four sequences in chunks of 3 (the last one short) must
    give that mean. Fails if the sums are divided by the chunk size or a short chunk is mis-counted."""
    cfg = ThreeMoonsConfig()
    cfg.data.block_size, cfg.eval.n_gen, cfg.eval.tau_stride, cfg.eval.metrics = 40, 5, 7, ["exact"]
    cfg.eval.n_sequences, cfg.eval.chunk = 4, 3
    model = MoonMemory(MoonMemoryConfig(n_heads=3))
    with torch.no_grad():
        model.out.r.zero_()
        model.out.s.zero_()
    curves = evaluate(cfg, model, {"val": VAL_PERIODS[0]}, DT, CPU)
    seq = sample_sequences([VAL_PERIODS[0]], 4, 41, DT, runtime.generator(cfg.seed, "eval", "val"), block_size=40)
    want = [seq[:, t : t + 5].abs().mean().item() for t in curves["tau"]]
    np.testing.assert_allclose(curves["val"]["exact"], want, rtol=1e-6)


def test_each_metrics_measurements_are_taken_on_its_own_curve_in_observation_steps():
    """summarise: every metric's transitions and accurate_from come from that metric's curve, and the
    periods and their lcm are in observations (period / dt): the held-out set (1, 2, 3) at dt = 0.0225
    has periods 44.4, 88.9, 133.3 and lcm 266.7 steps (thesis Fig 3.5; docs/decisions.md). With the
    exact curve falling after tau 149 and the reference one after 119 (as `transition_points` places a
    step, tests/test_three_moons_method.py), each must report its own. Fails if one metric's numbers
    are read off the other's curve or the lcm is left in time units."""
    from owai.methods.three_moons import identity_check, summarise

    tau = list(range(1, 401))
    curves = {"tau": tau, "val": {"exact": _staircase(150), "reference": _staircase(120)}}
    info = summarise(identity_check(3), curves, {"val": (1.0, 2.0, 3.0)}, DT)["panels"]["val"]
    assert info["lcm_steps"] == pytest.approx(266.7, abs=0.05)
    assert info["periods_steps"] == pytest.approx([44.4, 88.9, 133.3], abs=0.05)
    assert [p["tau"] for p in info["exact"]["transitions"]] == [149.0]
    assert [p["tau"] for p in info["reference"]["transitions"]] == [119.0]
    assert (info["exact"]["accurate_from"], info["reference"]["accurate_from"]) == (150.0, 120.0)
    assert info["exact"]["error_start"] == 1.0 and info["exact"]["error_end"] == 0.0
