"""`owai rich-features` evaluation stages chained on n pretrained networks (distill, probe, finetune,
two-stage, fewshot; thesis App. A.2-A.4) and Table 2.1's weight-decay sweep with its transfer probe:
miniatures end to end on the packaged MNIST file, resume, and the one-line errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import as_if_killed, as_sets, cli_in_process

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
FEWSHOT = str(RECIPES / "tableA.8-fewshot.yaml")
# The packaged MNIST test file's digits 0-4 -> 5-9, 10 images per class of each split (train / test by
# the keyed 80/20 split), ResNet-18 at 16 px; every training stage a few updates with checkpoints
TINY = [
    "data.base=mnist-t10k", "data.target=mnist-t10k", "data.limit_per_class=10", "data.image_size=16",
    "data.eval_batch_size=64",
    "pretrain.epochs=1.0", "pretrain.batch_size=16", "pretrain.milestones=[0.5]", "pretrain.checkpoint_every=2",
    "probe.n=2", "probe.sizes=[1,2]", "probe.epochs=2", "probe.milestones=[1]", "probe.batch_size=8",
    "probe.checkpoint_every=2", "probe.log_every=2",
    "distill.epochs=1.0", "distill.batch_size=16", "distill.warmup_epochs=0.5", "distill.milestones=[0.8]",
    "distill.checkpoint_every=2", "distill.log_every=2",
    "finetune.epochs=1.0", "finetune.batch_size=16", "finetune.checkpoint_every=2", "finetune.log_every=2",
    "fewshot.episodes=20", "fewshot.queries=5", "fewshot.epochs=5",
]
CHAIN = "distill,probe,finetune,two-stage,fewshot"


def _cli(args: list[str], capsys, recipe: str = FEWSHOT) -> tuple[int, str, str]:
    return cli_in_process(["rich-features", "-r", recipe, "-p", "cpu", *args, "-q"], capsys)


def _measured(run_dir: Path) -> dict[str, float]:
    return {r["metric"]: r["measured"] for r in json.loads((run_dir / "results.json").read_text())["rows"]}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, one_thread) -> dict[str, Path]:
    """Two networks (seeds 0, 1) of the few-shot recipe's cpu preset at TINY scale, in a cache."""
    root = tmp_path_factory.mktemp("rich-stages")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OWAI_CACHE", str(root / "cache"))
        from owai.cli import main

        try:
            main(["rich-features", "--stage", "pretrain", "-r", FEWSHOT, "-p", "cpu", "--seeds", "0,1",
                  *as_sets(TINY), "-o", str(root / "runs"), "-q"])
        except SystemExit as e:
            assert not e.code
    return {"root": root, "cache": root / "cache"}


@pytest.fixture
def cache(pretrained, monkeypatch) -> Path:
    monkeypatch.setenv("OWAI_CACHE", str(pretrained["cache"]))
    return pretrained["cache"]


@pytest.fixture(scope="module")
def chain_run(pretrained, tmp_path_factory) -> Path:
    """Every evaluation stage chained in one run on the two cached networks."""
    out = tmp_path_factory.mktemp("chain")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OWAI_CACHE", str(pretrained["cache"]))
        from owai.cli import main

        try:
            main(["rich-features", "--stage", CHAIN, "-r", FEWSHOT, "-p", "cpu", "--seeds", "0,1", *as_sets(TINY),
                  "-o", str(out), "-q"])
        except SystemExit as e:
            assert not e.code
    return next((out / "tableA.8-fewshot").iterdir())


def test_the_chain_measures_every_stage(chain_run) -> None:
    m = _measured(chain_run)
    expected = {"distill2.base_acc", "teachers.base_acc", "cat1.acc", "cat2.acc", "catsub2.acc", "single.acc",
                "distill2.acc", "ft.cat2.acc", "ft.distill2.acc", "ft.single.acc", "ft.ensemble.acc",
                "two_stage.cat2.acc"}
    expected |= {f"fewshot.{rep}.{head}.{k}shot" for rep in ("single", "cat2", "distill2")
                 for head in ("linear", "cosine") for k in (1, 5)}
    assert expected <= set(m)
    assert all(0.0 <= v <= 1.0 for v in m.values())
    details = json.loads((chain_run / "results.json").read_text())["details"]
    assert set(details["fewshot"]) >= {"net0.cosine.5shot", "net1.linear.1shot", "cat2.linear.5shot"}
    singles = [details["fewshot"][f"net{i}.cosine.1shot"]["mean"] for i in (0, 1)]
    assert m["fewshot.single.cosine.1shot"] == pytest.approx(sum(singles) / 2)
    # the last network alone (Fig 2.4's ViT-L/16 baseline), beside the mean of the two
    assert m["single.last.acc"] == details["single_acc"][1] and m["single.acc"] == pytest.approx(sum(details["single_acc"]) / 2)
    assert m["ft.single.last.acc"] == details["ft_single_acc"][1]
    stages = sorted(p.name for p in (chain_run / "checkpoints").iterdir())
    assert stages == sorted(["distill", "probe-net0", "probe-net1", "probe-cat2", "probe-distill", "finetune-cat2",
                             "finetune-distill2", "ft-net0", "ft-net1", "two-stage-head2"])


def test_two_stage_head_starts_as_the_ensemble_of_the_fine_tuned_networks(chain_run, cache) -> None:
    """ft.ensemble.acc is the two-stage head before training: recompute the logit average of the two
    fine-tuned networks from their final checkpoints and compare the logits (to 1e-6) and the accuracy."""
    from owai.checkpoint import latest_checkpoint, load_checkpoint
    from owai.experiment import resolve
    from owai.methods import rich_features as rf
    from owai.models.rich import ConcatFeatures, strip_head, two_stage_head
    from owai.recipes import load
    from owai.runs import Run

    cfg, _ = resolve(load(FEWSHOT), "cpu", [*TINY, f"stage={CHAIN}", "probe.seeds=[0,1]"])
    run = Run.open(chain_run)
    test_set = rf.load_split(cfg, cfg.data.target, "test", cfg.data.target_classes)
    tuned = []  # each fine-tuned network rebuilt from its final checkpoint: Sequential(ConcatFeatures([backbone]), Linear)
    for i in (0, 1):
        _, checkpoint = load_checkpoint(latest_checkpoint(run.checkpoints(f"ft-net{i}")))
        state = checkpoint["model"]
        backbone = strip_head(rf.build_network(cfg.model.backbone, 5, i))
        model = torch.nn.Sequential(ConcatFeatures([backbone]), torch.nn.Linear(backbone.feature_dim, 5))
        model.load_state_dict(state)
        tuned.append(model.eval())
    x, y = next(iter(rf._batches(cfg, test_set)))
    with torch.no_grad():
        ensemble = torch.stack([m(x) for m in tuned]).mean(0)
        cat = ConcatFeatures([m[0].backbones[0] for m in tuned], frozen=True)
        head = two_stage_head([m[1] for m in tuned])
        assert torch.allclose(head(cat(x)), ensemble, atol=1e-6)
    assert _measured(chain_run)["ft.ensemble.acc"] == pytest.approx(float((ensemble.argmax(1) == y).float().mean()))


def test_a_killed_chain_resumes_to_the_same_result(chain_run, cache, tmp_path, monkeypatch, capsys) -> None:
    import owai.methods.rich_features as rf

    original, calls = rf.finetune_model, {"n": 0}

    def dying(cfg, run, stage, backbones, train_set):  # dies when the second per-network fine-tuning starts
        calls["n"] += 1  # after finetune-cat2, finetune-distill2 and ft-net0
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return original(cfg, run, stage, backbones, train_set)

    monkeypatch.setattr(rf, "finetune_model", dying)
    from owai.cli import main

    with pytest.raises((KeyboardInterrupt, SystemExit)):
        main(["rich-features", "--stage", CHAIN, "-r", FEWSHOT, "-p", "cpu", "--seeds", "0,1", *as_sets(TINY),
              "-o", str(tmp_path / "killed"), "-q"])
    monkeypatch.setattr(rf, "finetune_model", original)
    run_dir = next((tmp_path / "killed" / "tableA.8-fewshot").iterdir())
    assert not (run_dir / "results.json").exists()
    assert (run_dir / "checkpoints" / "ft-net0").is_dir() and not (run_dir / "checkpoints" / "ft-net1").exists()
    # without --stage: the run's own stages (they were taken for "probe", which refused this run)
    code, _, err = cli_in_process(["rich-features", "--resume", str(run_dir), "-q"], capsys)
    assert code == 0, err
    assert _measured(run_dir) == _measured(chain_run)


def test_the_distilled_student_is_fine_tuned_from_its_distilled_weights(cache, tmp_path, monkeypatch, capsys) -> None:
    """Table A.3's Distill_n row: stage finetune fine-tunes the student the distill stage produced (its
    final weights, every parameter trainable), not a fresh network, and leaves the probes' copy frozen."""
    import owai.methods.rich_features as rf
    from owai.checkpoint import latest_checkpoint, load_checkpoint
    from owai.runs import Run

    original, seen = rf.finetune_model, {}

    def spying(cfg, run, stage, backbones, train_set):
        seen[stage] = ({k: v.clone() for k, v in backbones[0].state_dict().items()},
                       all(p.requires_grad for b in backbones for p in b.parameters()))
        return original(cfg, run, stage, backbones, train_set)

    monkeypatch.setattr(rf, "finetune_model", spying)
    code, _, err = _cli(["--stage", "distill,finetune", "--seeds", "0,1", *as_sets(TINY), "-o", str(tmp_path)], capsys)
    assert code == 0, err
    assert sorted(seen) == ["finetune-cat2", "finetune-distill2"]
    start, trainable = seen["finetune-distill2"]
    assert trainable
    run_dir = next((tmp_path / "tableA.8-fewshot").iterdir())
    _, distilled = load_checkpoint(latest_checkpoint(Run.open(run_dir).checkpoints("distill")))
    backbone = {k[len("backbone."):]: v for k, v in distilled["model"].items() if k.startswith("backbone.")}
    assert set(backbone) == set(start)
    assert all(torch.equal(start[k], backbone[k]) for k in start)
    _, tuned = load_checkpoint(latest_checkpoint(Run.open(run_dir).checkpoints("finetune-distill2")))
    moved = [k for k in start if k.endswith("weight") and not torch.equal(tuned["model"][f"0.backbones.0.{k}"], start[k])]
    assert moved  # it trained
    assert 0.0 <= _measured(run_dir)["ft.distill2.acc"] <= 1.0


def test_distillation_accumulates_micro_batches(cache, tmp_path, monkeypatch, capsys) -> None:
    """distill.accumulate = k: each update reads distill.batch_size images in k micro-batches of
    batch_size / k (the paper preset's 2048 as 8 x 256); the update count is unchanged."""
    import owai.models.rich as rich

    original, sizes = rich.distill_loss, []

    def recording(student_logits, teacher_logits, *args, **kwargs):
        sizes.append(student_logits[0].shape[0])
        return original(student_logits, teacher_logits, *args, **kwargs)

    monkeypatch.setattr(rich, "distill_loss", recording)
    code, _, err = _cli(["--stage", "distill", "--seeds", "0,1", *as_sets([*TINY, "distill.accumulate=2"]),
                         "-o", str(tmp_path)], capsys)
    assert code == 0, err
    run_dir = next((tmp_path / "tableA.8-fewshot").iterdir())
    steps = json.loads((run_dir / "results.json").read_text())["details"]["distill"]["steps"]
    assert sizes == [8] * (2 * steps)  # batch 16 as 2 x 8, two micro-batches per update
    code, _, err = _cli(["--stage", "distill", "--seeds", "0,1", *as_sets([*TINY, "distill.accumulate=3"]),
                         "-o", str(tmp_path / "bad")], capsys)
    assert code == 2 and "distill.accumulate 3: a divisor of distill.batch_size 16" in err, err
    assert not (tmp_path / "bad").exists()


def test_the_students_base_accuracy_reads_the_mean_of_its_heads(cache, tmp_path, monkeypatch, capsys) -> None:
    """Table A.3's Distill_n base accuracy is the student's prediction by the MEAN of its n heads' logits
    (head i fits teacher i), beside the teachers' ensemble by the mean of theirs, not one head's. The
    model each `predict` call scores is read on a batch of the base test images."""
    import owai.models.rich as rich
    from owai.methods import rich_features as rf

    students, scored = [], []

    class Recorded(rich.MultiHeadStudent):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            students.append(self)

    real_predict = rf.predict

    def spy(cfg, model, data, device):
        out = real_predict(cfg, model, data, device)
        x, _ = next(iter(rf._batches(cfg, data)))
        with torch.no_grad():
            scored.append((x, model(x)))
        return out

    monkeypatch.setattr(rich, "MultiHeadStudent", Recorded)
    monkeypatch.setattr(rf, "predict", spy)
    code, _, err = _cli(["--stage", "distill", "--seeds", "0,1", *as_sets(TINY), "-o", str(tmp_path)], capsys)
    assert code == 0, err
    (student,), (x, by_student) = students, scored[0]
    assert len(scored) == 2  # the student, then the teachers' ensemble
    with torch.no_grad():
        heads = student(x)
    assert len(heads) == 2 and not torch.allclose(heads[0], heads[1])
    torch.testing.assert_close(by_student, torch.stack(heads).mean(0))


def _one_line_error(args: list[str], out: Path, capsys, message: str, recipe: str = FEWSHOT) -> None:
    code, _, err = _cli([*args, "-o", str(out)], capsys, recipe)
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() or not any(out.rglob("config.yaml"))  # nothing written


def test_fine_tuning_accumulates_micro_batches(cache, tmp_path, monkeypatch, capsys) -> None:
    """finetune.accumulate = k: each fine-tuning update reads finetune.batch_size images in k passes of
    batch_size / k (Figure 2.4's 512 ViT images at 384 px as 8 x 64); the update count is unchanged."""
    from owai.models.rich import ConcatFeatures

    original, sizes = ConcatFeatures.forward, []

    def recording(self, x):
        if self.training:  # fine-tuning passes, not the evaluations
            sizes.append(x.shape[0])
        return original(self, x)

    monkeypatch.setattr(ConcatFeatures, "forward", recording)
    code, _, err = _cli(["--stage", "finetune", "--seeds", "0,1", *as_sets([*TINY, "finetune.accumulate=2"]),
                         "-o", str(tmp_path)], capsys)
    assert code == 0, err
    run_dir = next((tmp_path / "tableA.8-fewshot").iterdir())
    steps = max(json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                if json.loads(line).get("stage", "").startswith("finetune") and "loss" in json.loads(line))
    assert sizes and set(sizes) == {8} and len(sizes) == 2 * steps  # batch 16 as 2 x 8, two passes per update
    code, _, err = _cli(["--stage", "finetune", "--seeds", "0,1", *as_sets([*TINY, "finetune.accumulate=3"]),
                         "-o", str(tmp_path / "bad")], capsys)
    assert code == 2 and "finetune.accumulate 3: a divisor of finetune.batch_size 16" in err, err
    assert not (tmp_path / "bad").exists()


def test_fewer_images_in_a_class_than_the_episodes_need(cache, tmp_path, capsys) -> None:
    _one_line_error(["--stage", "fewshot", "--seeds", "0,1", *as_sets([*TINY, "fewshot.queries=15"])],
                    tmp_path / "out", capsys, "5-shot episodes with 15 queries need 20 images per class")


@pytest.mark.parametrize("stage, message", [
    ("probe,tune", "stage 'probe,tune': choose pretrain, or evaluation stages"),
    ("pretrain,probe", "stage pretrain runs alone"),
    ("probe,probe", "names a stage twice"),
])
def test_bad_stage_chains(cache, tmp_path, capsys, stage, message) -> None:
    _one_line_error(["--stage", stage, "--seeds", "0,1", *as_sets(TINY)], tmp_path / "out", capsys, message)


def test_distill_needs_the_networks_base_classes(cache, tmp_path, capsys) -> None:
    """Teachers with 5-class heads, a base of 4 classes: found before any run directory (the cache key
    changes with the base classes, so the networks are given by run directory)."""
    runs = sorted((cache.parent / "runs" / "tableA.8-fewshot").glob("sweep-*/points/*"))
    _one_line_error(["--stage", "distill", "--networks", ",".join(map(str, runs)),
                     *as_sets([*TINY, "data.base_classes=['0','1','2','3']"])],
                    tmp_path / "out", capsys, "5-class head; distill reads data.base")


# -- Table 2.1: weight decay 0 against 5e-4 ------------------------------------------------------


WD = str(RECIPES / "table2.1-weight-decay.yaml")
WD_TINY = ["data.base=mnist-t10k", "data.target=mnist-t10k", "data.limit_per_class=10", "data.image_size=16",
           "pretrain.epochs=1.0", "pretrain.batch_size=16", "pretrain.milestones=[0.5]", "probe.epochs=2",
           "probe.milestones=[1]", "probe.batch_size=8"]


def test_the_weight_decay_arms_differ_only_in_weight_decay(tmp_path) -> None:
    from owai import sweep as sweeps
    from owai.config import to_dict
    from owai.experiment import resolve
    from owai.recipes import load

    plan = sweeps.create(WD, "cpu", WD_TINY, [], None, tmp_path)
    assert sorted((p.grid["pretrain.weight_decay"], p.seed) for p in plan.points) == [
        (wd, seed) for wd in (0.0, 5e-4, 4e-2) for seed in (0, 1)]

    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    configs = {(p.grid["pretrain.weight_decay"], p.seed): flat(to_dict(resolve(load(WD), "cpu", [*WD_TINY, *p.overrides])[0]))
               for p in plan.points}
    for seed in (0, 1):
        for wd in (5e-4, 4e-2):
            a, b = configs[(0.0, seed)], configs[(wd, seed)]
            assert {k for k in a if a[k] != b[k]} == {"pretrain.weight_decay"}
    assert configs[(0.0, 0)]["pretrain.transfer_probe"] is True and configs[(0.0, 0)]["probe.batchnorm"] is False


def test_weight_decay_sweep_measures_transfer_and_judges_its_claims(tmp_path, monkeypatch, capsys, one_thread) -> None:
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    code, _, err = _cli(["--stage", "pretrain", "--seeds", "0", *as_sets(WD_TINY), "-o", str(tmp_path / "runs")],
                        capsys, WD)
    assert code == 0, err
    sweep = next((tmp_path / "runs" / "table2.1-weight-decay").glob("sweep-*"))
    summary = json.loads((sweep / "summary.json").read_text())
    cells = {g["grid"]["pretrain.weight_decay"]: {m["metric"] for m in g["metrics"]} for g in summary["groups"]}
    assert set(cells) == {0.0, 5e-4, 4e-2} and all({"pretrain.base_acc", "transfer.acc"} <= v for v in cells.values())
    code, out, err = cli_in_process(["report", str(sweep), "--json"], capsys)
    assert code == 0, err
    verdicts = {v["id"]: v["verdict"] for v in json.loads(out)["claims"]}
    assert set(verdicts) == {"wd-helps-in-distribution", "wd-hurts-transfer", "wd-helps-in-distribution-matched",
                             "wd-hurts-transfer-matched"}
    assert set(verdicts.values()) <= {"holds", "misses"}  # measured, never n/a


def test_the_probe_schedule_is_step_or_cosine() -> None:
    """probe.schedule: "step" (the default, §6.2) multiplies lr by gamma at each milestone; "cosine"
    is lr (1 + cos(pi e / epochs)) / 2 at fractional epoch e, whatever the milestones say."""
    import math

    from owai.methods.rich_features import ProbeConfig, probe_lr

    step = probe_lr(ProbeConfig(lr=0.1, epochs=28, milestones=[8, 16, 24]))
    assert [step(e) for e in (0, 7.9, 8, 16, 24, 27.9)] == pytest.approx([0.1, 0.1, 0.01, 1e-3, 1e-4, 1e-4])
    cosine = probe_lr(ProbeConfig(lr=0.1, epochs=200, schedule="cosine", milestones=[100, 150]))
    assert [cosine(e) for e in (0, 50, 100, 150, 200)] == pytest.approx([0.1, 0.1 * (1 + math.sqrt(0.5)) / 2, 0.05,
                                                                           0.1 * (1 - math.sqrt(0.5)) / 2, 0.0])
    assert cosine(99.9) > cosine(100.1)  # no step at a milestone: smooth through 100


def test_step_and_cosine_schedules_equal_torchs_schedulers() -> None:
    """`optim.step_schedule` (every milestone schedule of chapter 2) is torch's MultiStepLR update by
    update, the lr at a milestone already multiplied; with a warm-up it first climbs linearly from
    warmup_lr. The cosine that pre-training and fine-tuning use (`warmup_cosine_schedule` with no
    warm-up) is CosineAnnealingLR's closed form in the float32 that SGD applies."""
    import numpy as np

    from owai.optim import step_schedule, warmup_cosine_schedule

    param = torch.nn.Parameter(torch.zeros(1))
    sgd = torch.optim.SGD([param], lr=0.1)
    torch_step = torch.optim.lr_scheduler.MultiStepLR(sgd, milestones=[3, 7], gamma=0.2)
    ours = step_schedule(0.1, 0.2, [3, 7])
    for update in range(10):
        assert ours(update) == pytest.approx(sgd.param_groups[0]["lr"], rel=1e-12), update
        sgd.step()
        torch_step.step()
    assert ours(2.99) == 0.1 and ours(3) == pytest.approx(0.02)  # fractional epochs count too
    warm = step_schedule(0.1, 0.1, [10], warmup=4, warmup_lr=0.02)
    assert [warm(t) for t in (0, 2, 4, 9, 10)] == pytest.approx([0.02, 0.06, 0.1, 0.1, 0.01])

    sgd = torch.optim.SGD([param], lr=0.05)
    torch_cosine = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, T_max=37, eta_min=1e-4)
    ours = warmup_cosine_schedule(0.05, 0, 37, 1e-4)
    for update in range(37):
        closed = torch_cosine._get_closed_form_lr()[0]
        assert np.float32(ours(update)) == np.float32(closed), update
        sgd.step()
        torch_cosine.step()


def test_table_2_1s_paper_probe_shares_the_pre_trainings_hyper_parameters() -> None:
    """TH A.1: "The linear probing process shares the same training hyper-parameters as the supervised
    training part except for a zero L2 weight decay": optimiser, lr, batch, epochs, cosine schedule and
    the training augmentation."""
    from owai.experiment import resolve
    from owai.recipes import load

    cfg = resolve(load(WD), "paper", [], validate=False)[0]
    p, q = cfg.pretrain, cfg.probe
    assert (q.schedule, q.lr, q.batch_size, q.epochs, q.momentum, q.nesterov) == (
        p.schedule, p.lr, p.batch_size, p.epochs, p.momentum, False) == ("cosine", 0.1, 128, 200, 0.9, False)
    assert q.weight_decay == 0.0 and q.augment and cfg.data.augment and not q.batchnorm
    assert resolve(load(WD), "cpu", [], validate=False)[0].probe.schedule == "step"  # the stand-in keeps its steps


def test_the_transfer_probe_trains_under_the_schedule_it_names(tmp_path, monkeypatch, capsys, one_thread) -> None:
    """The learning rates the transfer probe logs are the cosine's (lr at update s = the schedule at
    epoch s / updates per epoch), on augmented crops as the paper preset trains it."""
    import math

    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    sets = [*WD_TINY, "probe.schedule=cosine", "probe.augment=true", "probe.epochs=3", "probe.log_every=1"]
    code, _, err = _cli(["--stage", "pretrain", "--seeds", "0", *as_sets(sets), "-o", str(tmp_path / "runs")], capsys, WD)
    assert code == 0, err
    point = next(p for p in (tmp_path / "runs").rglob("metrics.jsonl"))
    lines = [json.loads(x) for x in point.read_text().splitlines()]
    logged = [(x["step"], x["lr"]) for x in lines if x.get("stage") == "transfer-probe" and "lr" in x]
    steps = logged[-1][0]
    assert [s for s, _ in logged] == list(range(1, steps + 1)) and steps >= 3
    per_epoch = steps / 3  # updates per epoch of the 3-epoch probe
    # the lr logged after update s is the one update s - 1 trained with
    assert [lr for _, lr in logged] == pytest.approx([0.1 * 0.5 * (1 + math.cos(math.pi * (s - 1) / per_epoch / 3))
                                                     for s, _ in logged])


@pytest.mark.parametrize("stage", ["probe", "pretrain"])
def test_a_corrupt_cifar_file_is_one_line_before_any_run(cache, tmp_path, capsys, stage) -> None:
    from test_classification_data import make_cifar10

    folder, _, _ = make_cifar10(tmp_path / "data")
    good = (folder / "data_batch_3").read_bytes()
    (folder / "data_batch_3").write_bytes(good[: len(good) // 2])
    where = "data.target=cifar10" if stage == "probe" else "data.base=cifar10"
    extra = ["--seeds", "0,1"] if stage == "probe" else ["--seeds", "0"]
    _one_line_error(["--stage", stage, *extra, "--data-root", str(tmp_path / "data"),
                     *as_sets([*TINY, where, "data.base_classes=[]", "data.target_classes=[]"])],
                    tmp_path / "out", capsys, "data_batch_3 is corrupt or truncated")


# -- Table 2.2's baselines: wide and jointly trained networks ----------------------------------------


def test_joint_network_trains_every_backbone_under_one_head() -> None:
    from owai.methods.rich_features import build_network
    from owai.models.rich import JointNetwork, strip_head

    net = build_network("resnet18", 5, seed=0, joint=2)
    assert isinstance(net, JointNetwork) and net.feature_dim == 1024 and net.fc.in_features == 1024
    a, b = net.features.backbones
    assert not torch.equal(a.conv1.weight, b.conv1.weight)  # two differently initialised backbones
    assert torch.equal(build_network("resnet18", 5, seed=0, joint=2).fc.weight, net.fc.weight)  # keyed by the seed
    x = torch.randn(4, 3, 16, 16)
    net(x).sum().backward()
    assert a.conv1.weight.grad is not None and b.conv1.weight.grad is not None
    net.eval()
    with torch.no_grad():  # the joint logits are the sum of the sub-networks' blocks (Table A.1 reads each alone)
        w_a, w_b = torch.split(net.fc.weight, [512, 512], dim=1)
        assert torch.allclose(net(x), a(x) @ w_a.T + b(x) @ w_b.T + net.fc.bias, atol=1e-5)
        z = strip_head(net)(x)
        assert torch.allclose(z, torch.cat([a(x), b(x)], 1))


def test_joint_sub_networks_are_measured_alone_on_training_images(monkeypatch) -> None:
    """Table A.1 is "Training accuracy": each sub-network's block of the joint head alone, in eval mode on
    the training images with the evaluation transform; above JOINT_TRAIN_IMAGES a keyed subset of them."""
    from owai.config import build
    from owai.data.classification import ClassificationData
    from owai.methods import rich_features as R

    cfg = build(R.Config, {"data": {"image_size": 16, "eval_batch_size": 7, "workers": 0}})
    torch.manual_seed(0)
    data = ClassificationData(torch.randint(0, 255, (20, 16, 16), dtype=torch.uint8), torch.arange(20) % 5,
                              list("abcde"), "test images")
    net = R.build_network("resnet18", 5, seed=0, joint=2)
    with torch.no_grad():  # make sub-network 1's block of the head point away from the truth
        net.fc.weight[:, 512:] *= 0
    got = R.joint_sub_accuracies(cfg, net, data, torch.device("cpu"), "train_acc")
    assert set(got) == {"joint.sub0.train_acc", "joint.sub1.train_acc"} and not net.training
    x = torch.cat([xb for xb, _ in R._batches(cfg, data)])  # the evaluation transform, in order
    a, b = net.features.backbones
    w_a, w_b = torch.split(net.fc.weight, [512, 512], dim=1)
    with torch.no_grad():
        expect = [float(((z @ w.T + net.fc.bias).argmax(1) == data.labels).float().mean())
                  for z, w in ((a(x), w_a), (b(x), w_b))]
    assert [got["joint.sub0.train_acc"], got["joint.sub1.train_acc"]] == pytest.approx(expect)
    assert R.joint_train_subset(data, 0) is data  # few images: all of them
    monkeypatch.setattr(R, "JOINT_TRAIN_IMAGES", 8)
    first, again, other = R.joint_train_subset(data, 0), R.joint_train_subset(data, 0), R.joint_train_subset(data, 1)
    assert len(first) == 8 and torch.equal(first.images, again.images) and torch.equal(first.labels, again.labels)
    assert not torch.equal(first.images, other.images)  # keyed by the seed
    rows = [next(i for i in range(20) if torch.equal(data.images[i], im)) for im in first.images]
    assert rows == sorted(rows) and torch.equal(first.labels, data.labels[rows])  # training images, in index order


def test_the_joint_recipe_judges_its_claims_on_training_accuracy(tmp_path, monkeypatch, capsys, one_thread) -> None:
    """tableA.1-joint end to end at miniature scale: every joint size measures its sub-networks on the
    training images and the test split, and `owai report` judges both claims on the training accuracy."""
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    joint = str(RECIPES / "tableA.1-joint.yaml")
    sets = ["data.base=mnist-t10k", "data.target=mnist-t10k", "data.limit_per_class=10", "data.image_size=16",
            "pretrain.epochs=1.0", "pretrain.batch_size=16", "pretrain.milestones=[0.5]"]
    code, _, err = _cli(["--stage", "pretrain", *as_sets(sets), "-o", str(tmp_path / "runs")], capsys, joint)
    assert code == 0, err
    sweep = next((tmp_path / "runs" / "tableA.1-joint").glob("sweep-*"))
    summary = json.loads((sweep / "summary.json").read_text())
    cells = {g["grid"]["model.joint"]: {m["metric"] for m in g["metrics"]} for g in summary["groups"]}
    for k in (2, 4):
        assert {f"joint.sub{i}.{what}" for i in range(k) for what in ("train_acc", "base_acc")} <= cells[k]
    code, out, err = cli_in_process(["report", str(sweep), "--json"], capsys)
    assert code == 0, err
    verdicts = {v["id"]: v for v in json.loads(out)["claims"]}
    assert set(verdicts) == {"one-dominates-2x", "one-dominates-4x"}
    assert all(v["verdict"] in ("holds", "misses") for v in verdicts.values())  # measured, never n/a
    numbers = [k for v in verdicts.values() for k in v["numbers"]]
    assert "joint.sub3.train_acc[joint=4]" in numbers and not any("base_acc" in k for k in numbers)


@pytest.mark.slow  # a full end-to-end path (tens of seconds); `pytest -m slow`
def test_wide_and_joint_baselines_are_probed_beside_cat(cache, tmp_path, capsys) -> None:
    for extra in (["model.joint=2"], ["model.backbone=resnet18_w2"]):
        code, _, err = _cli(["--stage", "pretrain", "--seeds", "0", *as_sets([*TINY, *extra]), "-o", str(tmp_path / "pre")],
                            capsys)
        assert code == 0, err
    code, _, err = _cli(["--stage", "probe", "--seeds", "0,1", *as_sets([*TINY, "probe.baselines=[wide2,joint2]"]),
                         "-o", str(tmp_path / "probe")], capsys)
    assert code == 0, err
    joint_run = next(p for p in (tmp_path / "pre").rglob("results.json") if "joint.sub0.base_acc" in p.read_text())
    assert {"joint.sub0.base_acc", "joint.sub1.base_acc", "joint.sub0.train_acc", "joint.sub1.train_acc",
            "pretrain.base_acc"} <= set(_measured(joint_run.parent))
    probe_run = next((tmp_path / "probe" / "tableA.8-fewshot").iterdir())
    m = _measured(probe_run)
    assert {"cat2.acc", "single.acc", "wide2.acc", "joint2.acc"} <= set(m)
    assert (probe_run / "figures" / "probe.png").stat().st_size > 0  # Figure 2.1's top row for this target
    _one_line_error(["--stage", "probe", "--seeds", "0,1", *as_sets([*TINY, "probe.baselines=[joint4]"])],
                    tmp_path / "out", capsys, "baseline joint4 (seed 0) is not in the cache")
    _one_line_error(["--stage", "probe", "--seeds", "0,1", *as_sets([*TINY, "probe.baselines=[deep2]"])],
                    tmp_path / "out", capsys, "'deep2' is not wide<k> or joint<k>")


def test_the_figure_is_drawn_without_cat_1(cache, tmp_path, capsys) -> None:
    """probe.sizes without 1: Cat_2 and catsub_2 alone, nothing to start the curves at (it used to fail
    the finished run on cat1.acc)."""
    code, _, err = _cli(["--stage", "probe", "--seeds", "0,1", *as_sets([*TINY, "probe.sizes=[2]"]), "-o", str(tmp_path)],
                        capsys)
    assert code == 0, err
    run_dir = next((tmp_path / "tableA.8-fewshot").iterdir())
    assert {"cat2.acc", "catsub2.acc"} <= set(_measured(run_dir)) and "cat1.acc" not in _measured(run_dir)
    assert (run_dir / "figures" / "probe.png").is_file()


def test_the_inference_architectures_have_table_2_2s_parameter_counts() -> None:
    """Figure 2.1's x axis: resnet50 23.5M, resnet50w2 93.9M, resnet50w4 375M (Table 2.2, heads excluded)."""
    from owai.methods.rich_features import feature_params

    counts = {b: round(feature_params(b) / 1e6, 1) for b in ("resnet50", "resnet50_w2", "resnet50_w4")}
    assert counts == {"resnet50": 23.5, "resnet50_w2": 93.9, "resnet50_w4": 375.4}


def test_the_probe_weight_decay_grid_is_a_sweep(cache, tmp_path, capsys) -> None:
    """§6.2's weight-decay grid: `owai sweep` over probe.weight_decay, one probe run per value."""
    code, out, err = cli_in_process(["sweep", "-r", FEWSHOT, "-p", "cpu", "--set", "stage=probe", "--set",
                                     "probe.seeds=[0,1]", *as_sets(TINY), "--grid", "probe.weight_decay=0,0.01",
                                     "--seeds", "0", "-o", str(tmp_path), "--json"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    cells = {g["grid"]["probe.weight_decay"]: {m["metric"] for m in g["metrics"]} for g in summary["groups"]}
    assert set(cells) == {0, 0.01} and all({"cat2.acc", "single.acc"} <= v for v in cells.values())


# -- snapshots: Cat_n-s / Distill_n-s (Table A.7) ----------------------------------------------------


def test_snapshots_of_one_run_are_its_networks(tmp_path, monkeypatch, capsys) -> None:
    from safetensors.torch import load_file

    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    snap = ["pretrain.snapshots=[0.5,1.0]"]
    code, _, err = _cli(["--stage", "pretrain", "--seeds", "0", *as_sets([*TINY, *snap]), "-o", str(tmp_path / "pre")],
                        capsys)
    assert code == 0, err
    files = sorted((tmp_path / "cache" / "pretrained").glob("*.safetensors"))
    snapshots = [f for f in files if re.search(r"-e[0-9.]+\.safetensors$", f.name)]
    assert [f.name.rsplit("-", 1)[-1] for f in snapshots] == ["e0.5.safetensors", "e1.safetensors"]
    final = next(f for f in files if f not in snapshots)
    last = next(f for f in files if f.name.endswith("-e1.safetensors"))
    early = next(f for f in files if f.name.endswith("-e0.5.safetensors"))
    a, b, c = load_file(str(final)), load_file(str(last)), load_file(str(early))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the epoch-1 snapshot is the final network
    assert any(not torch.equal(a[k], c[k]) for k in a)
    early.unlink()  # a missing snapshot: pretrain trains again (the same weights) and writes it
    code, _, err = _cli(["--stage", "pretrain", "--seeds", "0", *as_sets([*TINY, *snap]), "-o", str(tmp_path / "pre")],
                        capsys)
    assert code == 0, err
    assert all(torch.equal(load_file(str(early))[k], c[k]) for k in c)
    probe = [*TINY, "probe.snapshots=[0.5,1.0]", "probe.seeds=[0]", "probe.n=2"]
    code, _, err = _cli(["--stage", "probe,fewshot", *as_sets(probe), "-o", str(tmp_path / "probe")], capsys)
    assert code == 0, err
    m = _measured(next((tmp_path / "probe" / "tableA.8-fewshot").iterdir()))
    assert {"cat2.acc", "single.acc", "fewshot.cat2.cosine.1shot"} <= set(m)
    _one_line_error(["--stage", "probe", *as_sets([*probe[:-2], "probe.snapshots=[0.5,0.75]", "probe.seeds=[0]",
                                                   "probe.n=2"])],
                    tmp_path / "out", capsys, "the snapshot of network seed 0 at epoch 0.75 is not in the cache")


# -- networks trained elsewhere: checkpoint files (SwAV-style) -----------------------------------------


def test_checkpoint_files_from_elsewhere_are_the_networks(chain_run, cache, tmp_path, capsys) -> None:
    """SwAV-style files: DataParallel's `module.` prefix, a projection head, no classifier. Made from the
    cached networks of seeds 0 and 1, their probes equal the chain's probes of those networks."""
    from safetensors.torch import load_file

    from owai.experiment import resolve
    from owai.methods.rich_features import weights_path
    from owai.recipes import load

    cfg, _ = resolve(load(FEWSHOT), "cpu", [*TINY, "stage=probe", "probe.seeds=[0,1]"])
    files = []
    for i, path in enumerate(weights_path(cfg, seed) for seed in (0, 1)):
        state = {f"module.{k}": v for k, v in load_file(str(path)).items() if not k.startswith("fc.")}
        state["module.projection_head.0.weight"] = torch.zeros(8, 512)
        files.append(tmp_path / f"ssl{i}.pth")
        torch.save({"state_dict": state, "epoch": 800}, files[-1])
    probe = [*TINY, f"probe.weights=['{files[0]}','{files[1]}']", "probe.n=2"]
    code, _, err = _cli(["--stage", "probe", *as_sets(probe), "-o", str(tmp_path / "ext")], capsys)
    assert code == 0, err
    m, chain = _measured(next((tmp_path / "ext" / "tableA.8-fewshot").iterdir())), _measured(chain_run)
    assert {k: m[k] for k in ("cat1.acc", "cat2.acc", "catsub2.acc", "single.acc")} == {
        k: chain[k] for k in ("cat1.acc", "cat2.acc", "catsub2.acc", "single.acc")}
    wrong = tmp_path / "r50.pth"
    from owai.models.vision import build_backbone

    torch.save(build_backbone("resnet50", num_classes=1).state_dict(), wrong)
    _one_line_error(["--stage", "probe", *as_sets([*TINY, f"probe.weights=['{files[0]}','{wrong}']", "probe.n=2"])],
                    tmp_path / "out", capsys, "is not a resnet18")
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(files[0].read_bytes()[:1000])
    _one_line_error(["--stage", "probe", *as_sets([*TINY, f"probe.weights=['{corrupt}','{files[1]}']", "probe.n=2"])],
                    tmp_path / "out", capsys, "cannot read weights file")
    _one_line_error(["--stage", "distill", *as_sets(probe)], tmp_path / "out", capsys, "distill.target=logits needs the networks' base-class heads")


@pytest.fixture
def trainings(monkeypatch) -> dict[str, dict]:
    """What each training stage's train_loop is given, by stage: the optimizer's class and groups
    (settings and parameter count) and the schedule's lr at every step. The training runs as usual."""
    import owai.train

    seen: dict[str, dict] = {}
    original = owai.train.train_loop

    def recording(run, stage, model, optimizer, loss_at, loop, lr_at=None, **kwargs):
        seen[stage] = {"optimizer": type(optimizer).__name__, "model": model,
                       "groups": [{k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])}
                                  for g in optimizer.param_groups],
                       "lrs": [lr_at(s) for s in range(loop.steps)] if lr_at else []}
        return original(run, stage, model, optimizer, loss_at, loop, lr_at=lr_at, **kwargs)

    monkeypatch.setattr(owai.train, "train_loop", recording)
    return seen


def test_fine_tuning_with_a_step_schedule_a_classifier_lr_and_the_heads_own_weight_decay(cache, tmp_path, capsys,
                                                                                        trainings) -> None:
    """TH A.3.1's ImageNet fine-tuning of SwAV: the backbone at lr, the new classifier 20 times higher,
    both x gamma at each milestone epoch; the two-stage head at head_weight_decay. Checked on the
    optimizer and schedule each training stage is given."""
    sets = [*TINY, "finetune.lr=0.01", "finetune.classifier_lr_scale=20", "finetune.milestones=[0.5]", "finetune.gamma=0.2",
            "finetune.weight_decay=0.0", "finetune.head_weight_decay=0.001"]
    code, _, err = _cli(["--stage", "finetune,two-stage", "--seeds", "0,1", *as_sets(sets), "-o", str(tmp_path)], capsys)
    assert code == 0, err
    groups, lrs = trainings["finetune-cat2"]["groups"], trainings["finetune-cat2"]["lrs"]
    assert [g.get("lr_scale", 1.0) for g in groups][-1] == pytest.approx(20.0) and groups[-1]["n"] == 2  # the Linear head
    assert all(g.get("lr_scale", 1.0) == 1.0 for g in groups[:-1])
    half = len(lrs) // 2  # finetune.epochs=1: the milestone at 0.5 epochs is half-way
    assert lrs[0] == pytest.approx(0.01) and lrs[-1] == pytest.approx(0.002) and set(lrs) == {lrs[0], lrs[-1]}
    assert lrs.index(lrs[-1]) in (half, half + 1)
    assert [g["weight_decay"] for g in trainings["two-stage-head2"]["groups"]] == [0.001]
    code, _, err = _cli(["--stage", "finetune", "--seeds", "0,1", *as_sets([*TINY, "finetune.milestones=[2.0]"])], capsys)
    assert code == 2 and "finetune.milestones [2.0]" in err


def test_the_few_shot_student_trains_with_adam(cache, tmp_path, capsys, trainings) -> None:
    """TH A.4.3: Distill_n of the few-shot tables keeps A.4.2's Adam (lr 1e-3, no schedule)."""
    sets = [*TINY, "distill.optimizer=adam", "distill.lr=0.001", "distill.warmup_epochs=0.0", "distill.milestones=[]"]
    code, _, err = _cli(["--stage", "distill", "--seeds", "0,1", *as_sets(sets), "-o", str(tmp_path)], capsys)
    assert code == 0, err
    assert (trainings["distill"]["optimizer"], set(trainings["distill"]["lrs"])) == ("Adam", {0.001})


# -- Baseline++: networks pre-trained under Chen et al.'s cosine classifier (TH A.4.2, Fig. 2.5) --------


def test_baseline_plus_plus_networks_pretrain_and_distil_under_cosine_heads(tmp_path, monkeypatch, capsys,
                                                                            trainings) -> None:
    """pretrain.head=cosine trains each network under a cosine base-class head and caches it (fc.direction,
    fc.gain; a cache entry of its own); the evaluation stages read it back with that head (base accuracy,
    teachers' logits) and Distill_n's student heads are cosine heads too."""
    from safetensors.torch import load_file

    from owai.experiment import resolve
    from owai.methods.rich_features import pretrain_key
    from owai.models.rich import CosineClassifier
    from owai.recipes import load

    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    sets = [*TINY, "pretrain.head=cosine"]
    code, _, err = _cli(["--stage", "pretrain", "--seeds", "0,1", *as_sets(sets), "-o", str(tmp_path / "pre")], capsys)
    assert code == 0, err
    assert isinstance(trainings["pretrain"]["model"].fc, CosineClassifier)
    files = sorted((tmp_path / "cache" / "pretrained").glob("*.safetensors"))
    assert len(files) == 2
    for f in files:
        keys = set(load_file(str(f)))
        assert {"fc.direction", "fc.gain"} <= keys and "fc.weight" not in keys
    cosine, linear = (resolve(load(FEWSHOT), "cpu", x)[0] for x in (sets, TINY))
    assert pretrain_key(cosine, 0) != pretrain_key(linear, 0)
    assert [f.name for f in files if pretrain_key(linear, 0) in f.name] == []
    for run in (tmp_path / "pre" / "tableA.8-fewshot").rglob("results.json"):
        assert 0.0 <= _measured(run.parent)["pretrain.base_acc"] <= 1.0
    code, _, err = _cli(["--stage", "distill,fewshot", "--seeds", "0,1", *as_sets(sets), "-o", str(tmp_path / "eval")],
                        capsys)
    assert code == 0, err
    heads = trainings["distill"]["model"].heads
    assert len(heads) == 2 and all(isinstance(h, CosineClassifier) for h in heads)
    m = _measured(next((tmp_path / "eval" / "tableA.8-fewshot").iterdir()))
    assert {"distill2.base_acc", "teachers.base_acc", "fewshot.distill2.cosine.1shot", "fewshot.cat2.cosine.5shot"} <= set(m)


@pytest.mark.parametrize("extra", [["model.joint=2"], ["pretrain.objective=simsiam"]])
def test_the_cosine_base_head_is_a_supervised_single_networks(tmp_path, capsys, extra) -> None:
    _one_line_error(["--stage", "pretrain", "--seeds", "0", *as_sets([*TINY, "pretrain.head=cosine", *extra])],
                    tmp_path / "out", capsys, "pretrain.head=cosine is a supervised single network's head")


@pytest.mark.parametrize("transforms, error", [("domainbed", None), ("thesis", "pre-trained with data.transforms=domainbed")])
def test_networks_of_run_directories_read_images_as_they_were_trained(pretrained, cache, tmp_path, capsys, monkeypatch,
                                                                      transforms, error) -> None:
    """probe.networks takes pretrain runs, which must have seen their images with the same transforms
    (the digits stand in for a set whose style the thesis's transforms change)."""
    from owai.methods import rich_features

    monkeypatch.setitem(rich_features.TRANSFORM_STYLES, "mnist-t10k", "cifar")
    run_dir = next((pretrained["root"] / "runs" / "tableA.8-fewshot").iterdir())
    args = ["--stage", "probe", *as_sets([*TINY, f"probe.networks=[{run_dir}]", f"data.transforms={transforms}"])]
    if error is None:
        code, _, err = _cli([*args, "--dry-run", "-o", str(tmp_path / "out")], capsys)
        assert code == 0, err
    else:
        _one_line_error(args, tmp_path / "out", capsys, error)


def test_networks_pre_trained_with_the_thesis_transforms_are_refused_under_domainbed(tmp_path, capsys,
                                                                                    monkeypatch) -> None:
    """The same check the other way round: a network trained under data.transforms=thesis."""
    from owai.methods import rich_features

    monkeypatch.setitem(rich_features.TRANSFORM_STYLES, "mnist-t10k", "cifar")
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    code, _, err = _cli(["--stage", "pretrain", "--seeds", "0", *as_sets([*TINY, "data.transforms=thesis"]),
                         "-o", str(tmp_path / "runs")], capsys)
    assert code == 0, err
    run_dir = next((tmp_path / "runs" / "tableA.8-fewshot").iterdir())
    _one_line_error(["--stage", "probe", *as_sets([*TINY, f"probe.networks=[{run_dir}]", "probe.n=1",
                                                  "probe.sizes=[1]"])],
                    tmp_path / "out", capsys, "pre-trained with data.transforms=thesis")


def test_probes_on_augmented_crops_train_as_rrls(cache, tmp_path, capsys) -> None:
    """probe.augment: the probes train together on freshly augmented crops (one resumable stage, the
    frozen networks run on every batch). Each head only reads its own gradient, so a probe trained
    beside others is the probe trained alone on the same batches: Cat_1's accuracy is the same with
    and without the Cat_2 head, and a killed stage resumes to the same numbers."""
    crops = [*TINY, "probe.augment=true", "probe.catsub=false"]
    code, _, err = _cli(["--stage", "distill,probe", "--seeds", "0,1", *as_sets(crops), "-o", str(tmp_path / "both")],
                        capsys)
    assert code == 0, err
    run_dir = next((tmp_path / "both" / "tableA.8-fewshot").iterdir())
    both = _measured(run_dir)
    assert {"cat1.acc", "cat2.acc", "single.acc", "distill2.acc"} <= set(both)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["distill", "probe-crops"]
    code, _, err = _cli(["--stage", "probe", "--seeds", "0,1", *as_sets([*crops, "probe.sizes=[1]"]),
                         "-o", str(tmp_path / "alone")], capsys)
    assert code == 0, err
    alone = _measured(next((tmp_path / "alone" / "tableA.8-fewshot").iterdir()))
    assert alone["cat1.acc"] == both["cat1.acc"] and alone["single.acc"] == both["single.acc"]
    # killed after the crops stage's first checkpoint: the resume replays the rest of its batches
    killed = tmp_path / "killed"
    shutil.copytree(run_dir, killed)
    steps = sorted((killed / "checkpoints" / "probe-crops").iterdir())
    assert len(steps) >= 2
    as_if_killed(killed, *steps[1:])
    code, _, err = cli_in_process(["rich-features", "--stage", "distill,probe", "--resume", str(killed), "-q"], capsys)
    assert code == 0, err
    assert _measured(killed) == both


def test_batches_without_replacement_walk_keyed_epochs() -> None:
    """StepBatches(sampling="epochs"): each epoch's steps take disjoint slices of one keyed
    permutation (the last incomplete batch dropped), and another epoch another permutation."""
    from owai.data.domainbed import StepBatches
    from owai.errors import OwaiError

    class Data:
        name, domains = "d", ["all"]

        def size(self, domain):
            return 10

        def labels(self, domain):
            return torch.arange(10)

        def image(self, domain, i):
            from PIL import Image

            return Image.new("RGB", (4, 4), (i, 0, 0))

    batches = StepBatches(Data(), [0], [torch.arange(10)], 3, 4, False, 7, 9, sampling="epochs")
    epochs = [[batches[s][1].tolist() for s in range(e * 3, e * 3 + 3)] for e in range(3)]
    for epoch in epochs:
        seen = [i for batch in epoch for i in batch]
        assert len(seen) == len(set(seen)) == 9  # 3 batches of 3 of 10, without replacement
    assert epochs[0] != epochs[1]
    assert [batches[s][1].tolist() for s in range(3)] == epochs[0]  # a function of the step
    with pytest.raises(OwaiError, match="sampling must be"):
        StepBatches(Data(), [0], [torch.arange(10)], 3, 4, False, 7, 9, sampling="sometimes")


def test_two_processes_that_need_the_same_network_train_it_once(tmp_path):
    """Two chains (or sweeps) started together on an empty cache need seed 0's network: one trains it
    under the entry's build lock, the other waits and reads it (`cached` in its results)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, OWAI_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "owai", "rich-features", "-r", FEWSHOT, "-p", "cpu", "--stage", "pretrain",
                               "--seeds", "0", *as_sets(TINY), "-o", str(tmp_path / f"runs{i}"), "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    cached = sorted(json.loads(results.read_text())["details"]["cached"]
                    for i in range(2) for results in (tmp_path / f"runs{i}").rglob("points/*/results.json"))
    assert cached == [False, True]


@pytest.mark.parametrize("stage, sets", [
    ("distill", []),
    ("finetune", []),
    ("probe", ["probe.augment=true", "probe.catsub=false", "probe.sizes=[1]"]),  # the probes on crops
])
def test_a_killed_training_stage_kept_by_its_caller_leaves_no_workers(cache, tmp_path, monkeypatch, capsys, stage, sets) -> None:
    """Each evaluation stage that trains on batches by step (distill, the fine-tuning, the probes on
    augmented crops), killed at its second update with two loader workers and its exception kept (a
    notebook's last one): its step stream ends its workers with the stage (`with stream:`), not when
    the exception is dropped."""
    from test_run_leftovers import _workers, interrupt_kept, kill_step_streams_at

    from owai.experiment import execute

    calls, alive, before = kill_step_streams_at(monkeypatch, 2)
    # the run itself, not `owai.cli.main`, which turns the interrupt into an exit and drops its traceback
    kept = interrupt_kept(lambda: execute(FEWSHOT, "cpu", [*TINY, *sets, "probe.seeds=[0, 1]", f"stage={stage}",
                                                           "data.workers=2"], out=tmp_path / "out"))
    capsys.readouterr()
    assert len(kept) == 1 and len(calls) == 2 and alive == [2], (kept, calls, alive)
    assert _workers() - before == set()
