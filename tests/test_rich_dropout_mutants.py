"""Mutation audit, second pass: the rich-features stages (owai/methods/rich_features.py; thesis §2.1-2.2,
App. A.1-A.4) and very-large dropout fine-tuning (owai/methods/dropout_ft.py; §2.4).

Each test pins one rule that a small, plausible change of the code broke without any other test
failing: every stage reads ITS OWN section of the config (optimizer, lr, epochs, schedule, batch,
weight decay), each network has its own seed, the cache key holds every setting, the selection never
reads test data, the dropout is off at evaluation. The stage under test is stopped where it hands
its optimizer and schedule to `owai.train.train_loop` (a spy), so the tests take seconds; every
expected value comes from a docstring, docs/decisions.md or the thesis's formulas.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from owai.runs import Run


class Stop(Exception):
    """Raised by the train_loop spy: the stage has shown what it trains with."""


def _spy_train_loop(monkeypatch, stop: bool = True) -> list[SimpleNamespace]:
    """Replace owai.train.train_loop (imported by each stage when it runs) with a recorder."""
    import owai.train

    calls: list[SimpleNamespace] = []

    def spy(run, stage, model, optimizer, loss_at, loop, lr_at=None, **kw):
        calls.append(SimpleNamespace(stage=stage, model=model, optimizer=optimizer, loss_at=loss_at, loop=loop,
                                     lr_at=lr_at, kw=kw))
        if stop:
            raise Stop
        return {"final_loss": 0.0}

    monkeypatch.setattr(owai.train, "train_loop", spy)
    return calls


def _run(tmp_path) -> Run:
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    run = Run(tmp_path / "run")
    run.device = torch.device("cpu")
    return run


def _rich_cfg(tmp_path, monkeypatch, **sections):
    """A rich-features config on the packaged MNIST file (digits 0-1 -> 5-6, 10 images per class of
    each split), ResNet-18 at 16 px, loader in-process; `sections` = {"pretrain__lr": 0.3, ...}."""
    from owai.methods import rich_features as rf

    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    cfg = rf.Config(stage="pretrain")
    d = cfg.data
    d.base = d.target = "mnist-t10k"
    d.base_classes, d.target_classes = ["0", "1"], ["5", "6"]
    d.limit_per_class, d.image_size, d.workers, d.eval_batch_size = 10, 16, 0, 64
    cfg.model.backbone = "resnet18"
    for key, value in sections.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


# --- rich features: pre-training (TH A.2.1 / spec §6.1) ------------------------------------------



def _record_step_batches(monkeypatch, keep) -> list:
    """Spy on `domainbed.StepBatches`: each stream built appends `keep(args, kwargs)` of its
    construction to the returned list (the streams themselves are the real ones)."""
    from owai.data import domainbed

    seen: list = []
    real = domainbed.StepBatches

    class Recorded(real):
        def __init__(self, *args, **kwargs):
            seen.append(keep(args, kwargs))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(domainbed, "StepBatches", Recorded)
    return seen

def test_pretraining_trains_with_the_pretrain_sections_optimizer_and_epoch_milestones(tmp_path, monkeypatch):
    """PretrainConfig's docstring: SGD with pretrain.lr, momentum and weight decay, lr x gamma at the
    milestones given IN EPOCHS, steps = round(epochs * N / batch). Here N = 20 base images, batch 4:
    5 updates per epoch, 3 epochs = 15 updates, milestones 1 and 2 at updates 5 and 10. Every other
    section holds other values, so a stage reading another section's settings fails."""
    from owai.methods import rich_features as rf

    cfg = _rich_cfg(tmp_path, monkeypatch, pretrain__epochs=3.0, pretrain__batch_size=4, pretrain__lr=0.3,
                    pretrain__momentum=0.7, pretrain__weight_decay=3e-3, pretrain__milestones=[1.0, 2.0],
                    pretrain__gamma=0.5)
    calls = _spy_train_loop(monkeypatch)
    with pytest.raises(Stop):
        rf.run_pretrain(cfg, _run(tmp_path))
    (call,) = calls
    assert call.stage == "pretrain" and call.loop.steps == 15
    opt = call.optimizer
    assert isinstance(opt, torch.optim.SGD)
    (group,) = opt.param_groups
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.3, 0.7, 3e-3)
    assert [call.lr_at(s) for s in (0, 4, 5, 9, 10, 14)] == pytest.approx([0.3, 0.3, 0.15, 0.15, 0.075, 0.075])


def test_pretrainings_cosine_spans_the_whole_run(tmp_path, monkeypatch):
    """pretrain.schedule=cosine (SimSiam, Table 2.1's paper preset): lr (1 + cos(pi t / T)) / 2 with T
    the run's update count (15 here), so lr is half at T / 2 and 0 at T, milestones unused."""
    import math

    from owai.methods import rich_features as rf

    cfg = _rich_cfg(tmp_path, monkeypatch, pretrain__epochs=3.0, pretrain__batch_size=4, pretrain__lr=0.2,
                    pretrain__schedule="cosine", pretrain__milestones=[1.0])
    calls = _spy_train_loop(monkeypatch)
    with pytest.raises(Stop):
        rf.run_pretrain(cfg, _run(tmp_path))
    lr_at, steps = calls[0].lr_at, calls[0].loop.steps
    assert steps == 15
    assert [lr_at(t) for t in (0, 5, 15)] == pytest.approx([0.2, 0.2 * (1 + math.cos(math.pi / 3)) / 2, 0.0])


def test_each_seeds_network_starts_from_its_own_initialisation_and_batches(tmp_path, monkeypatch):
    """Cat_n's networks differ only by seed (§2.2): network `seed` is initialised from that seed
    (`build_network`: the same seed gives the same weights, another seed others) and trained on
    batches keyed by it (StepBatches' seed = the run's seed)."""
    from owai.methods import rich_features as rf

    a, b, a2 = (rf.build_network("resnet18", 2, s).state_dict()["conv1.weight"] for s in (0, 1, 0))
    assert torch.equal(a, a2) and not torch.equal(a, b)
    seen = _record_step_batches(monkeypatch, lambda args, kwargs: args[6] if len(args) > 6 else kwargs["seed"])
    for seed in (3, 4):
        cfg = _rich_cfg(tmp_path / str(seed), monkeypatch, pretrain__epochs=1.0, pretrain__batch_size=4)
        cfg.seed = seed
        calls = _spy_train_loop(monkeypatch)
        with pytest.raises(Stop):
            rf.run_pretrain(cfg, _run(tmp_path / str(seed)))
        init = rf.build_network("resnet18", 2, seed).state_dict()
        assert all(torch.equal(v, init[k]) for k, v in calls[0].model.state_dict().items())
    assert seen == [3, 4]


def test_the_pretraining_cache_key_holds_every_setting_the_network_depends_on(tmp_path, monkeypatch):
    """`pretrain_key`'s docstring: "every setting it depends on" (seed, backbone, the pretrain
    section, the base data and how its images are read); bookkeeping (checkpoint_every, log_every,
    transfer_probe, snapshots) is left out, so those reuse the network. A cache entry is reused only
    under exactly the same settings."""
    from owai.methods import rich_features as rf

    cfg = _rich_cfg(tmp_path, monkeypatch)
    key = rf.pretrain_key(cfg, 0)
    changed = {
        "seed": lambda c: None, "model.backbone": lambda c: setattr(c.model, "backbone", "resnet50"),
        "model.joint": lambda c: setattr(c.model, "joint", 2),
        "pretrain.epochs": lambda c: setattr(c.pretrain, "epochs", 45.0),
        "pretrain.batch_size": lambda c: setattr(c.pretrain, "batch_size", 128),
        "pretrain.lr": lambda c: setattr(c.pretrain, "lr", 0.05),
        "pretrain.momentum": lambda c: setattr(c.pretrain, "momentum", 0.8),
        "pretrain.weight_decay": lambda c: setattr(c.pretrain, "weight_decay", 5e-4),
        "pretrain.milestones": lambda c: setattr(c.pretrain, "milestones", [30.0]),
        "pretrain.gamma": lambda c: setattr(c.pretrain, "gamma", 0.2),
        "pretrain.optimizer": lambda c: setattr(c.pretrain, "optimizer", "adam"),
        "pretrain.schedule": lambda c: setattr(c.pretrain, "schedule", "cosine"),
        "pretrain.head": lambda c: setattr(c.pretrain, "head", "cosine"),
        "pretrain.objective": lambda c: setattr(c.pretrain, "objective", "simsiam"),
        "pretrain.sampling": lambda c: setattr(c.pretrain, "sampling", "epochs"),
        "data.base": lambda c: setattr(c.data, "base", "digits"),
        "data.base_classes": lambda c: setattr(c.data, "base_classes", ["0", "2"]),
        "data.root": lambda c: setattr(c.data, "root", str(tmp_path)),
        "data.image_size": lambda c: setattr(c.data, "image_size", 32),
        "data.augment": lambda c: setattr(c.data, "augment", False),
        "data.limit_per_class": lambda c: setattr(c.data, "limit_per_class", 20),
        "data.split_seed": lambda c: setattr(c.data, "split_seed", 1),
    }
    import copy

    for name, change in changed.items():
        other = copy.deepcopy(cfg)
        change(other)
        assert rf.pretrain_key(other, 1 if name == "seed" else 0) != key, name
    same = copy.deepcopy(cfg)
    same.pretrain.checkpoint_every, same.pretrain.log_every, same.pretrain.transfer_probe = 7, 3, True
    same.pretrain.snapshots = [0.5]
    same.data.target, same.data.target_classes, same.data.workers = "digits", ["7"], 3
    assert rf.pretrain_key(same, 0) == key


# --- rich features: fine-tuning, two-stage, distillation (spec §6.3-6.5) --------------------------


def _target_train(cfg):
    from owai.methods import rich_features as rf

    return rf.load_split(cfg, cfg.data.target, "train", cfg.data.target_classes)


def _backbone(seed: int = 0):
    from owai.methods import rich_features as rf
    from owai.models.rich import strip_head

    return strip_head(rf.build_network("resnet18", 2, seed))


def test_fine_tuning_reads_the_finetune_section_and_its_cosine_spans_the_run(tmp_path, monkeypatch):
    """FinetuneConfig's docstring (§6.3): SGD momentum finetune.momentum, cosine from finetune.lr to
    finetune.min_lr over the run's updates, round(epochs * N / batch) of them (20 target images,
    batch 4, 2 epochs: 10); the batches keyed by (seed, stage) and augmented as data.augment says."""
    import math

    from owai.methods import rich_features as rf

    cfg = _rich_cfg(tmp_path, monkeypatch, finetune__epochs=2.0, finetune__batch_size=4, finetune__lr=0.02,
                    finetune__min_lr=0.002, finetune__momentum=0.6, finetune__weight_decay=2e-3)
    seen = _record_step_batches(monkeypatch, lambda args, kwargs: args)
    calls = _spy_train_loop(monkeypatch)
    with pytest.raises(Stop):
        rf.finetune_model(cfg, _run(tmp_path), "finetune-cat1", [_backbone()], _target_train(cfg))
    (call,) = calls
    assert call.stage == "finetune-cat1" and call.loop.steps == 10
    assert {g["momentum"] for g in call.optimizer.param_groups} == {0.6}
    assert {g["weight_decay"] for g in call.optimizer.param_groups} == {2e-3, 0.0}  # BatchNorm's: none
    mid = 0.002 + (0.02 - 0.002) * (1 + math.cos(math.pi * 0.5)) / 2
    assert [call.lr_at(s) for s in (0, 5, 10)] == pytest.approx([0.02, mid, 0.002])
    (args,) = seen
    assert args[3] == 4 and args[5] is True and args[7] == 10  # batch, augment, steps
    from owai.runtime import derive_seed

    assert args[6] == derive_seed(cfg.seed, "finetune-batches", "finetune-cat1")


def test_fine_tunings_step_schedule_counts_milestones_in_epochs(tmp_path, monkeypatch):
    """finetune.milestones (TH A.3's self-supervised networks on ImageNet) are epochs: with 5 updates
    per epoch, milestone 1.0 is update 5, where lr becomes lr x gamma; the new head trains at
    classifier_lr_scale x lr (SwAV's 20x)."""
    from owai.methods import rich_features as rf

    cfg = _rich_cfg(tmp_path, monkeypatch, finetune__epochs=2.0, finetune__batch_size=4, finetune__lr=0.02,
                    finetune__milestones=[1.0], finetune__gamma=0.1, finetune__classifier_lr_scale=20.0)
    calls = _spy_train_loop(monkeypatch)
    with pytest.raises(Stop):
        rf.finetune_model(cfg, _run(tmp_path), "finetune-cat1", [_backbone()], _target_train(cfg))
    (call,) = calls
    assert [call.lr_at(s) for s in (0, 4, 5, 9)] == pytest.approx([0.02, 0.02, 0.002, 0.002])
    head = {id(p) for p in call.model[1].parameters()}
    scale = {id(p): g.get("lr_scale", 1.0) for g in call.optimizer.param_groups for p in g["params"]}
    assert all(scale[i] == 20.0 for i in head) and all(s == 1.0 for i, s in scale.items() if i not in head)


class _Features(torch.nn.Module):
    """A stand-in backbone: features = a fixed linear map of the flattened image (width 3)."""

    feature_dim = 3

    def __init__(self, tag: int) -> None:
        super().__init__()
        self.tag = tag
        self.w = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.w(x.reshape(len(x), -1)[:, :4])


@pytest.mark.parametrize("head_wd", [None, 0.0])
def test_two_stage_fine_tunes_each_network_alone_then_the_head_with_the_head_settings(tmp_path, monkeypatch, head_wd):
    """Spec §6.4 / FinetuneConfig: stage ft-net{i} fine-tunes network i (its own weights) alone; the
    head over their frozen concatenation then trains finetune.head_epochs at the constant
    finetune.head_lr, Nesterov, finetune.momentum, on the TRAINING images' features, with
    head_weight_decay (None: finetune.weight_decay). The fine-tuning and the features are stubs; the
    head's training is read."""
    from owai.methods import rich_features as rf
    from owai.models.rich import ConcatFeatures

    cfg = _rich_cfg(tmp_path, monkeypatch, finetune__head_epochs=3.0, finetune__head_lr=7e-4, finetune__lr=0.05,
                    finetune__epochs=9.0, finetune__momentum=0.8, finetune__weight_decay=2e-3, finetune__batch_size=6,
                    finetune__head_weight_decay=head_wd)
    nets = [SimpleNamespace(label=f"net{i}", seed=i) for i in range(2)]
    tuned = []

    def finetune_model(cfg_, run, stage, backbones, train_set):
        (backbone,) = backbones
        tuned.append((stage, backbone.tag))
        return torch.nn.Sequential(ConcatFeatures([backbone]), torch.nn.Linear(3, 2))

    train_set, test_set = SimpleNamespace(style="domainbed", n=10), SimpleNamespace(style="domainbed", n=6)
    extracted, trained = [], {}
    monkeypatch.setattr(rf, "network_backbones", lambda ns, style, size: [_Features(int(n.label[3:])) for n in ns])
    monkeypatch.setattr(rf, "finetune_model", finetune_model)
    monkeypatch.setattr(rf, "predict", lambda cfg_, model, data, device: (torch.zeros(data.n, 2), torch.zeros(data.n)))

    def extract(cfg_, cat, data, device, store, origin):
        extracted.append((store.name, data))
        return [torch.full((data.n, 3), float(data.n)) for _ in cat.backbones], torch.zeros(data.n, dtype=torch.long)

    def train_head(run, stage, head, groups, blocks, y, **kw):
        trained.update(stage=stage, groups=groups, blocks=blocks, **kw)
        return head

    monkeypatch.setattr(rf, "extract", extract)
    monkeypatch.setattr(rf, "train_head", train_head)
    rf.run_two_stage(cfg, _run(tmp_path), nets, train_set, test_set, {}, {})
    assert tuned == [("ft-net0", 0), ("ft-net1", 1)]
    assert trained["stage"] == "two-stage-head2"
    assert trained["epochs"] == 3.0 and trained["nesterov"] is True and trained["momentum"] == 0.8
    assert trained["batch_size"] == 6
    assert [trained["lr_at_epoch"](e) for e in (0.0, 1.5, 2.9)] == [7e-4] * 3
    assert [g["weight_decay"] for g in trained["groups"]] == [2e-3 if head_wd is None else head_wd]
    assert all(b.shape[0] == 10 for b in trained["blocks"])  # the training images' features
    assert ("two-stage-train", train_set) in extracted and ("two-stage-test", test_set) in extracted


def test_distillation_fits_the_eval_mode_teachers_logits_at_tau_with_the_distill_schedule(tmp_path, monkeypatch):
    """DistillConfig (spec §6.5, TH Eq. A.1): head i fits teacher i's logits (the teachers in eval
    mode, no gradient) at distill.tau, mixed with the labels by distill.alpha; SGD with the distill
    section's momentum and weight decay; lr warms up linearly from warmup_lr to lr over warmup_epochs,
    then x gamma at each milestone (epochs). 20 base images, batch 4: 5 updates per epoch. The student
    starts from its own initialisation, not a network's."""
    from owai.methods import rich_features as rf
    from owai.models import rich

    cfg = _rich_cfg(tmp_path, monkeypatch, distill__epochs=2.0, distill__batch_size=4, distill__lr=0.8,
                    distill__warmup_epochs=1.0, distill__warmup_lr=0.1, distill__milestones=[1.6], distill__gamma=0.2,
                    distill__momentum=0.85, distill__weight_decay=1e-5, distill__tau=4.0, distill__alpha=0.5)
    teachers = {}

    def load_network(net, style="domainbed", image_size=None):
        teachers[net.seed] = rf.build_network("resnet18", 2, 10 + net.seed)  # in training mode, as built
        return teachers[net.seed]

    monkeypatch.setattr(rf, "load_network", load_network)
    nets = [SimpleNamespace(label=f"net{i}", seed=i) for i in range(2)]
    seen = {}

    def distill_loss(student_logits, teacher_logits, tau, labels=None, alpha=1.0):
        seen.update(student=student_logits, teacher=teacher_logits, tau=tau, labels=labels, alpha=alpha)
        return sum(s.sum() for s in student_logits) * 0

    monkeypatch.setattr(rich, "distill_loss", distill_loss)
    calls = _spy_train_loop(monkeypatch)
    with pytest.raises(Stop):
        rf.run_distill(cfg, _run(tmp_path), nets, {}, {})
    (call,) = calls
    assert call.stage == "distill" and call.loop.steps == 10
    (group,) = call.optimizer.param_groups
    assert (group["momentum"], group["weight_decay"]) == (0.85, 1e-5)
    assert [call.lr_at(s) for s in (0, 2.5, 5, 7, 8, 9)] == pytest.approx([0.1, 0.45, 0.8, 0.8, 0.16, 0.16])
    student0 = {k: v.clone() for k, v in call.model.backbone.state_dict().items()}
    for seed in (0, 1):  # not network seed's initialisation
        assert not torch.equal(student0["conv1.weight"], rf.build_network("resnet18", 2, seed).state_dict()["conv1.weight"])
    call.loss_at(0, 0)
    assert seen["tau"] == 4.0 and seen["alpha"] == 0.5 and seen["labels"] is not None
    assert len(seen["teacher"]) == 2 and len(seen["student"]) == 2
    from owai.data.domainbed import StepBatches
    from owai.runtime import derive_seed

    base = rf.load_split(cfg, "mnist-t10k", "train", ["0", "1"])
    x, y, _ = StepBatches(rf.OneDomain(base), [0], [torch.arange(len(base))], 4, 16, True,
                          derive_seed(cfg.seed, "distill-batches"), 10)[0]
    assert torch.equal(seen["labels"], y)
    with torch.no_grad():
        for i in (0, 1):
            assert not teachers[i].training
            torch.testing.assert_close(seen["teacher"][i], teachers[i].eval()(x))


# --- very-large dropout fine-tuning (§2.4, docs/decisions.md "owai dropout-ft") --------------------


def _dft_setup(tmp_path, **sections):
    """test_method_mutants' generated 3-domain tree (2 classes, 10 images per class, 16 px)."""
    from test_method_mutants import _dropout_ft_setup

    return _dropout_ft_setup(tmp_path, **sections)


def _pool(n: int = 24):
    from owai.data.domainbed import TensorDomains

    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 16, 16), generator=gen, dtype=torch.uint8)
    return TensorDomains("pool", ["upright"], ["a", "b"], [images], [torch.arange(n) % 2])


def test_the_stand_in_pretraining_reads_the_pretrain_section_and_decays_at_two_thirds(tmp_path, monkeypatch):
    """docs/decisions.md (Table 2.8's stand-in pre-training): SGD at pretrain.lr with x0.1 at 2/3 of
    pretrain.steps, pretrain.momentum and pretrain.weight_decay, batches of pretrain.batch_size keyed
    by pretrain.seed; "every run of the grid starts from the same network", so neither the
    initialisation nor the batches depend on the run's own seed (nor on the fine-tuning's train.*)."""
    import owai.methods.dropout_ft as dft

    seen = _record_step_batches(monkeypatch, lambda args, kwargs: args)
    models = []
    for run_seed in (0, 7):
        cfg, _ = _dft_setup(tmp_path / str(run_seed), pretrain__steps=9, pretrain__lr=0.05, pretrain__momentum=0.8,
                            pretrain__weight_decay=5e-4, pretrain__batch_size=6, pretrain__seed=3)
        cfg.seed = run_seed
        cfg.train.lr, cfg.train.momentum, cfg.train.weight_decay = 1e-3, 0.9, 1e-4
        calls = _spy_train_loop(monkeypatch)
        with pytest.raises(Stop):
            dft._pretrain(cfg, _run(tmp_path / str(run_seed)), _pool(), torch.device("cpu"))
        (call,) = calls
        assert call.stage == "pretrain" and call.loop.steps == 9
        (group,) = call.optimizer.param_groups
        assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.05, 0.8, 5e-4)
        assert [call.lr_at(s) for s in (0, 5, 6, 8)] == pytest.approx([0.05, 0.05, 0.005, 0.005])
        models.append(call.model.state_dict())
    assert [(a[3], a[6], a[7]) for a in seen] == [(6, 3, 9), (6, 3, 9)]  # batch, seed, steps
    assert all(torch.equal(v, models[1][k]) for k, v in models[0].items())


def test_fine_tuning_batches_come_from_the_training_domains_in_splits_keyed_by_the_run_seed(tmp_path, monkeypatch):
    """DomainBed's protocol (module docstring): each step draws data.batch_per_domain images from the
    `in` split of each TRAINING domain (never the test domain, never the `out` splits that select),
    augmented as data.augment says, keyed by the run's seed; SGD at train.momentum and
    train.weight_decay."""
    import owai.methods.dropout_ft as dft

    seen = _record_step_batches(monkeypatch, lambda args, kwargs: args)
    cfg, data = _dft_setup(tmp_path, train__momentum=0.7, train__weight_decay=3e-3)
    cfg.seed, cfg.data.augment = 5, False
    model = dft.build_model(cfg, len(data.classes), None, torch.device("cpu"))
    calls = _spy_train_loop(monkeypatch)
    with pytest.raises(Stop):
        dft.train(cfg, _run(tmp_path), model, data, dft.eval_sets(cfg, data), torch.device("cpu"))
    (args,) = seen
    parts = dft.splits(cfg, data)
    assert args[1] == [1, 2] and all(torch.equal(a, parts[i][0]) for a, i in zip(args[2], (1, 2)))
    assert (args[3], args[5], args[6], args[7]) == (4, False, 5, 4)  # batch per domain, augment, seed, steps
    assert {(g["momentum"], g["weight_decay"]) for g in calls[0].optimizer.param_groups} == {(0.7, 3e-3)}


def test_the_domain_splits_are_the_trial_seeds_not_the_runs(tmp_path):
    """DomainBed's convention (module docstring): every domain's in/out split is keyed by
    data.trial_seed, "the same split for every seed", so the runs averaged over seeds select and
    test on the same images."""
    import owai.methods.dropout_ft as dft

    cfg, data = _dft_setup(tmp_path)
    before = [(s.name, s.labels) for s in dft.eval_sets(cfg, data)]
    parts = dft.splits(cfg, data)
    cfg.seed = 9
    assert all(torch.equal(a, b) for (x, y), (z, w) in zip(parts, dft.splits(cfg, data)) for a, b in ((x, z), (y, w)))
    assert all(n == m and torch.equal(a, b) for (n, a), (m, b) in zip(before, [(s.name, s.labels)
                                                                           for s in dft.eval_sets(cfg, data)]))
    cfg.data.trial_seed = 1
    assert not torch.equal(parts[0][1], dft.splits(cfg, data)[0][1])


def test_evaluation_runs_the_network_without_dropout_and_restores_its_mode(tmp_path):
    """§2.4: the very large dropout acts during fine-tuning only; every evaluation (selection and
    test accuracies) reads the network in eval mode, deterministic, then training goes on in
    training mode."""
    import owai.methods.dropout_ft as dft

    cfg, data = _dft_setup(tmp_path, model__dropout=0.9)
    model = dft.build_model(cfg, len(data.classes), None, torch.device("cpu"))
    model.train()
    sets = dft.eval_sets(cfg, data)[:1]
    first = dft.predict(model, sets, torch.device("cpu"), "float32")
    assert model.training
    second = dft.predict(model, sets, torch.device("cpu"), "float32")
    x = torch.cat([x for x, _ in sets[0].batches()])
    with torch.no_grad():
        expected = model.eval()(x)
    assert torch.equal(first[sets[0].name], second[sets[0].name])
    torch.testing.assert_close(first[sets[0].name], expected)


def test_the_single_run_ensemble_and_average_start_at_average_start(tmp_path, monkeypatch):
    """docs/decisions.md: the weight average is a running mean updated after every update FROM
    average_start on (`average_every: step`), the ensemble sums the logits of the evaluations from
    average_start on. 6 updates (0-5), evaluations after updates 0, 2, 4 and 5, average_start 2:
    the average holds updates 2-5 (4), the ensemble the evaluations at 2, 4, 5 (3). The loop's
    after-step calls are replayed without training, the evaluations' logits are stubs."""
    import owai.methods.dropout_ft as dft
    import owai.train

    cfg, data = _dft_setup(tmp_path)
    t = cfg.train
    t.steps, t.eval_every, t.average_start, t.checkpoint_every, t.log_every, t.milestones = 6, 2, 2, 6, 6, [4]
    model = dft.build_model(cfg, len(data.classes), None, torch.device("cpu"))

    def updates_only(run, stage, model_, optimizer, loss_at, loop, lr_at=None, after_step=None, **kw):
        for done in range(1, loop.steps + 1):  # the loop's calls after each update, without the updates
            after_step(done)
        return {}

    monkeypatch.setattr(owai.train, "train_loop", updates_only)
    monkeypatch.setattr(dft, "predict", lambda model_, sets, device, precision: {  # the counts, not the scores
        s.name: torch.zeros(s.size, 2) for s in sets})
    tracks = dft.train(cfg, _run(tmp_path), model, data, dft.eval_sets(cfg, data), torch.device("cpu"))
    assert (tracks.swa_n, tracks.ens_n) == (4, 3)
    assert tracks.best["ens"]["step"] in (2, 4, 5) and tracks.best["swa"]["step"] in (2, 4, 5)
    assert tracks.best["model"]["step"] in (0, 2, 4, 5)


# --- rich features: the probes (spec §6.2) ---------------------------------------------------------


def test_cat_k_reads_the_first_k_networks_and_the_student_its_own_block():
    """probe_specs' docstring: one probe per network, one per Cat_k with k > 1 reading the FIRST k
    blocks, and the Distill_n student's block n."""
    from owai.methods.rich_features import probe_specs

    assert probe_specs(4, [4, 1, 2], True) == {
        "probe-net0": [0], "probe-net1": [1], "probe-net2": [2], "probe-net3": [3],
        "probe-cat2": [0, 1], "probe-cat4": [0, 1, 2, 3], "probe-distill": [4]}
    assert "probe-distill" not in probe_specs(3, [3], False)


def test_the_probe_measures_cat1_single_catsub_and_the_student_from_their_own_heads():
    """run_probes' docstring: cat1 = the FIRST network's probe, single.acc = the mean of the
    per-network probes, single.last.acc = the n-th's, catsub_k = the mean of the first k
    per-network probes' logits, Cat_k its own head on the first k blocks, distill{n} the student's
    probe on block n. Hand-set one-feature probes (class 1 iff w z > 0) on 4 test images, labels
    0, 0, 1, 1: network 0 scores 1.0, network 1 0.5, network 2 0.0."""
    from owai.methods.rich_features import Config, run_probes
    from owai.models.rich import ProbeHead

    def head(weights):
        h = ProbeHead(len(weights), 2, bn=False)
        with torch.no_grad():
            h.linear.weight.copy_(torch.tensor([[-w for w in weights], weights]))
        return h

    z = [torch.tensor([[-1.0], [-1.0], [1.0], [1.0]]), torch.tensor([[1.0], [-1.0], [-1.0], [1.0]]),
         torch.tensor([[1.0], [1.0], [-1.0], [-1.0]]), torch.tensor([[-1.0], [1.0], [1.0], [1.0]])]
    y = torch.tensor([0, 0, 1, 1])
    heads = {f"probe-net{i}": head([w]) for i, w in enumerate((1.0, 2.0, 1.0))}  # net1's logits doubled
    heads["probe-cat2"] = head([0.0, 1.0])  # reads network 1's block: 0.5
    heads["probe-cat3"] = head([0.0, 0.0, -1.0])  # minus network 2's: 1.0
    heads["probe-distill"] = head([1.0])  # the student's block (z[3]): 0.75
    cfg = Config(stage="probe")
    cfg.probe.n, cfg.probe.sizes = 3, [1, 2, 3]
    measured, details = {}, {}
    run_probes(cfg, heads, z, y, 3, True, measured, details)
    assert measured["cat1.acc"] == 1.0 and measured["single.last.acc"] == 0.0
    assert measured["single.acc"] == pytest.approx(0.5)
    assert measured["cat2.acc"] == 0.5 and measured["cat3.acc"] == 1.0
    # catsub2: sign of (z0 + 2 z1) / 2 = +, -, -, +: 0.5 (probe 0 on z1 and probe 1 on z0 would give
    # -, -, +, +: 1.0); catsub3 adds z2: +, -, -, +: 0.5
    assert measured["catsub2.acc"] == 0.5 and measured["catsub3.acc"] == 0.5
    assert measured["distill3.acc"] == 0.75


def test_each_probe_trains_with_the_probe_sections_settings_and_epoch_schedule(tmp_path, monkeypatch):
    """ProbeConfig (spec §6.2): SGD Nesterov (probe.nesterov) at probe.momentum, weight decay
    probe.weight_decay on the Linear and none on BN, probe.epochs passes of probe.batch_size (the last
    incomplete batch dropped: 20 examples, batch 6 -> 3 updates per epoch), lr x gamma at the
    milestones counted in epochs: update s trains at the schedule's lr at epoch s / 3."""
    from owai.methods import rich_features as rf

    cfg = _rich_cfg(tmp_path, monkeypatch, probe__epochs=4, probe__batch_size=6, probe__lr=0.03, probe__momentum=0.6,
                    probe__weight_decay=2e-3, probe__milestones=[2], probe__gamma=0.5, probe__nesterov=True)
    calls = _spy_train_loop(monkeypatch)
    blocks, y = [torch.randn(20, 3), torch.randn(20, 2)], torch.arange(20) % 2
    with pytest.raises(Stop):
        rf.fit_probe(cfg, _run(tmp_path), "probe-cat2", blocks, y, 2, torch.device("cpu"))
    (call,) = calls
    assert call.stage == "probe-cat2" and call.loop.steps == 12
    groups = call.optimizer.param_groups
    assert {(g["momentum"], g["nesterov"]) for g in groups} == {(0.6, True)}
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 2e-3]
    assert call.model.linear.in_features == 5
    assert [call.lr_at(s) for s in (0, 5, 6, 11)] == pytest.approx([0.03, 0.03, 0.015, 0.015])


def test_without_probe_seeds_the_networks_are_seeds_0_to_n_minus_1(tmp_path, monkeypatch):
    """ProbeConfig: probe.seeds [] = 0..n-1, the cache entries of this config's pre-training at those
    seeds; given seeds are read in their order."""
    from owai.methods import rich_features as rf

    cfg = _rich_cfg(tmp_path, monkeypatch)
    cfg.stage = "probe"
    for seed in range(4):
        path = rf.weights_path(cfg, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    cfg.probe.n = 3
    assert [n.seed for n in rf.find_networks(cfg)] == [0, 1, 2]
    assert [n.weights for n in rf.find_networks(cfg)] == [rf.weights_path(cfg, s) for s in range(3)]
    cfg.probe.seeds = [3, 1, 0]
    assert [n.seed for n in rf.find_networks(cfg)] == [3, 1, 0]


def test_probes_on_crops_read_freshly_augmented_epochs_of_the_training_images(tmp_path, monkeypatch):
    """probe.augment (ProbeConfig; RRL's linear evaluation): "every probe trains on freshly augmented
    crops of its training images", each update the next batch of an epoch's permutation (the last
    incomplete batch dropped): the stage's StepBatches augment, sample by epochs, probe.batch_size per
    update, probe.epochs x (N // batch) updates (20 images, batch 6: 3 per epoch, 4 epochs = 12)."""
    from owai.methods import rich_features as rf
    from owai.models.rich import ConcatFeatures

    cfg = _rich_cfg(tmp_path, monkeypatch, probe__epochs=4, probe__batch_size=6, probe__augment=True)
    cfg.data.augment = False  # pre-training's switch: the crops are augmented whatever it says
    seen = _record_step_batches(monkeypatch, lambda args, kwargs: (args, kwargs))
    calls = _spy_train_loop(monkeypatch)
    frozen = ConcatFeatures([_backbone()], frozen=True)
    with pytest.raises(Stop):
        rf.fit_probes_on_crops(cfg, _run(tmp_path), "probe-crops", frozen, {"probe-net0": [0]}, _target_train(cfg), 2,
                               torch.device("cpu"))
    ((args, kwargs),) = seen
    assert args[3] == 6 and args[5] is True and args[7] == 12 and kwargs["sampling"] == "epochs"
    assert calls[0].loop.steps == 12


def test_adam_pretraining_keeps_the_pretrain_sections_weight_decay(tmp_path, monkeypatch):
    """pretrain.optimizer=adam (the few-shot baselines', Chen et al.: lr 1e-3) is Adam at pretrain.lr
    with pretrain.weight_decay: the optimizer changes, the section's other settings stay."""
    from owai.methods import rich_features as rf

    cfg = _rich_cfg(tmp_path, monkeypatch, pretrain__epochs=1.0, pretrain__batch_size=4, pretrain__lr=1e-3,
                    pretrain__weight_decay=3e-3, pretrain__optimizer="adam")
    calls = _spy_train_loop(monkeypatch)
    with pytest.raises(Stop):
        rf.run_pretrain(cfg, _run(tmp_path))
    opt = calls[0].optimizer
    assert isinstance(opt, torch.optim.Adam)
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(1e-3, 3e-3)]


def test_multi_run_combinations_average_every_runs_weights_and_sum_every_runs_logits(tmp_path, monkeypatch):
    """docs/decisions.md (Ens-multi / WA-multi): the final weights of a group's (lr, wd) runs are
    combined, the ensemble summing their logits, the weight average their uniform mean (DiWA). Three
    runs of a one-weight-per-class linear model on one image of class 1: runs 1 and 3 predict class 0,
    run 2 class 1; the summed logits and the averaged weights (4/3 against 2) both predict class 1, so
    a combination that keeps one run's weights or logits fails. Data and runs are stubs."""
    import owai.methods.dropout_ft as dft

    weights = {"a": [[2.0], [0.0]], "b": [[0.0], [6.0]], "c": [[2.0], [0.0]]}
    cfg = dft.Config()
    monkeypatch.setattr(dft, "final_state", lambda d: (cfg, {"weight": torch.tensor(weights[d.name])}))
    monkeypatch.setattr(dft, "load_data", lambda cfg_: SimpleNamespace(classes=["0", "1"]))
    labels = torch.tensor([1])
    sets = [dft.EvalSet(g, "d", labels, lambda: iter(())) for g in ("val", "test", "test_out")]
    monkeypatch.setattr(dft, "eval_sets", lambda cfg_, data: sets)
    monkeypatch.setattr(dft, "build_model", lambda cfg_, n, w, device: torch.nn.Linear(1, 2, bias=False))
    monkeypatch.setattr(dft, "predict", lambda model, sets_, device, precision: {
        s.name: model(torch.ones(1, 1)).detach() for s in sets_})
    points = [{"status": "complete", "run_dir": str(tmp_path / name), "grid": {"train.lr": i}, "seed": 0}
              for i, name in enumerate("abc")]
    out = dft.multi_run(SimpleNamespace(path=tmp_path), {"points": points}, [], torch.device("cpu"))
    ((_, result),) = out.items()
    assert result["ens_multi"]["ood_acc"] == 1.0 and result["wa_multi"]["ood_acc"] == 1.0


def test_few_shot_cat_k_reads_the_first_k_networks_and_the_student_its_block(monkeypatch):
    """run_fewshot's docstring (§6.6): the same episodes for each network alone, Cat_k (k in
    probe.sizes, k > 1) = the FIRST k networks' features, and the Distill_n student (block n). Each
    block is constant (network i: i + 1, the student: 10) and the stubbed episode accuracy is the
    sum of a row of the features it is given, so each representation's blocks are read off."""
    from owai.evals import fewshot
    from owai.methods.rich_features import Config, run_fewshot

    monkeypatch.setattr(fewshot, "sample_episodes", lambda y, ways, shot, queries, episodes, seed: None)
    monkeypatch.setattr(fewshot, "episode_accuracies", lambda z, episodes, **kw: [float(z[0].sum())])
    monkeypatch.setattr(fewshot, "mean_ci95", lambda accs: (accs[0], 0.0))
    cfg = Config(stage="fewshot")
    cfg.probe.n, cfg.probe.sizes = 3, [1, 2, 3]
    cfg.fewshot.shots, cfg.fewshot.heads = [1], ["linear"]
    z = [torch.full((4, 1), float(i + 1)) for i in range(3)] + [torch.full((4, 1), 10.0)]
    measured, details = {}, {}
    run_fewshot(cfg, z, torch.zeros(4, dtype=torch.long), 3, True, measured, details)
    assert measured["fewshot.cat2.linear.1shot"] == 3.0 and measured["fewshot.cat3.linear.1shot"] == 6.0
    assert measured["fewshot.distill3.linear.1shot"] == 10.0
    assert measured["fewshot.single.linear.1shot"] == pytest.approx(2.0)
