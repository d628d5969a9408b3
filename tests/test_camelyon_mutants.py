"""Mutation-audit tests of the Camelyon17 pipeline (owai/methods/camelyon17.py): the rules a
hand-made mutant of the pipeline broke without any other test failing.

Each expected value comes from the module's docstrings (thesis §2.3.4, RFC's and WILDS's code as
they describe it) or from the project's rules (a cache entry is reused only under exactly the same
settings; model selection never reads the test split; a killed run resumes to the uninterrupted
run's result), never from owai's own output. The pipeline tests run on the miniature tree of
tests/camelyon_tree.py with the settings of tests/test_camelyon17.py's `tiny`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from camelyon_tree import make_camelyon
from owai.methods import camelyon17 as cam
from owai.methods.invariance import make_penalty
from test_camelyon17 import tiny

RECIPE = "table2.6-camelyon17"


def rounds_only(tree: Path) -> list[str]:
    """tiny's settings without the synthesis's, which an `init: none` run refuses as unused."""
    return [s for s in tiny(tree) if not s.startswith("bonsai.synthesis")]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A smaller miniature than test_camelyon17's: 24 training patches, 3 updates per epoch at batch 8."""
    return make_camelyon(tmp_path_factory.mktemp("camelyon"), train_per_center=8, id_val_per_center=4, eval_per_center=8)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))


# -- GroupDRO rounds: WILDS's group-wise losses --------------------------------------------------


def test_a_training_group_absent_from_the_batch_keeps_its_weight_with_loss_zero():
    """group_dro_loss's docstring (WILDS's `compute_group_wise` and GroupDRO): q is uniform over the
    groups present in the *training set*, and a group absent from the batch enters the update with
    loss 0. So with groups {0, 1, 2, 3} in training and a batch of groups 0, 1 and 3 only, q_2 still
    exists and shrinks relative to the others, and the loss is sum_g q_g l_g over four groups. A
    mutant that weighs only the batch's groups keeps three weights (each 1/3 at first)."""
    eta = 0.5
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 2, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (12,), generator=gen)
    g = torch.tensor([0, 0, 0, 1, 1, 1, 1, 3, 3, 3, 3, 3])
    present = torch.tensor([0, 1, 2, 3])
    pen = make_penalty("groupdro", eta=eta)
    loss = cam.group_dro_loss(pen, logits, y, g, present)
    ce = [-torch.log_softmax(logits[i], 0)[y[i]].item() for i in range(12)]
    group_loss = [sum(ce[i] for i in range(12) if g[i] == k) / max(1, int((g == k).sum())) for k in range(4)]
    q = [0.25 * math.exp(eta * l) for l in group_loss]  # l_2 = 0: exp(0) = 1
    q = [v / sum(q) for v in q]
    assert pen.q.tolist() == pytest.approx(q, rel=1e-12)
    assert loss.item() == pytest.approx(sum(a * b for a, b in zip(q, group_loss)), rel=1e-12)


# -- selection never reads the test split --------------------------------------------------------


def test_selected_metrics_choose_by_id_val_and_val_never_by_test_and_the_first_of_ties():
    """selected_metrics' docstring: the IID numbers at the epoch chosen by id_val, the OOD numbers at
    the epoch chosen by val (the first of tied epochs, as StageResult's `epoch`); the test split is
    only reported. The curves below put the best test accuracy at an epoch neither validation picks,
    and tie epochs 1 and 3 on id_val and epochs 2 and 4 on val."""
    curves = [
        {"epoch": 1, "id_val.acc": 0.8, "val.acc": 0.1, "test.acc": 0.11, "test.acc_wg": 0.01},
        {"epoch": 2, "id_val.acc": 0.2, "val.acc": 0.7, "test.acc": 0.22, "test.acc_wg": 0.02},
        {"epoch": 3, "id_val.acc": 0.8, "val.acc": 0.3, "test.acc": 0.99, "test.acc_wg": 0.03},
        {"epoch": 4, "id_val.acc": 0.4, "val.acc": 0.7, "test.acc": 0.44, "test.acc_wg": 0.04},
    ]
    m = cam.selected_metrics(curves)
    assert (m["epoch.iid"], m["test_acc.iid"], m["id_val_acc.iid"], m["test_acc_wg.iid"]) == (1, 0.11, 0.8, 0.01)
    assert (m["epoch.ood"], m["test_acc.ood"], m["val_acc.ood"], m["test_acc_wg.ood"]) == (2, 0.22, 0.7, 0.02)


# -- cache keys: an entry is reused only under exactly the same settings -------------------------


def _ctx(cfg: cam.Config, root: Path) -> cam.Context:
    return cam.Context(cfg, None, SimpleNamespace(dir=root), torch.device("cpu"), None)


def _with(cfg: cam.Config, section: str, **values) -> cam.Config:
    if not section:
        return dataclasses.replace(cfg, **values)
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)})


def test_the_rounds_cache_key_holds_every_setting_the_rounds_train_with(tmp_path):
    """discovery_key: what the discovery rounds depend on. Round 0 is WILDS ERM with train.{epochs,
    lr, momentum, weight_decay}, the data's fraction, image size and batch size, the architecture
    and the seed; rounds >= 1 add bonsai.dro_eta (the GroupDRO step). Changing any one of them must
    change the rounds' cache directory; checkpoint_every / log_every and the loader's workers do not
    change what is trained, and must keep it."""
    base = cam.Config()
    key = cam.discovery_key(_ctx(base, tmp_path))
    changed = {
        "seed": _with(base, "", seed=1),
        "train.epochs": _with(base, "train", epochs=3),
        "train.lr": _with(base, "train", lr=0.1),
        "train.momentum": _with(base, "train", momentum=0.5),
        "train.weight_decay": _with(base, "train", weight_decay=0.1),
        "bonsai.dro_eta": _with(base, "bonsai", dro_eta=0.1),
        "data.fraction": _with(base, "data", fraction=0.5),
        "data.fraction_seed": _with(base, "data", fraction_seed=1),
        "data.image_size": _with(base, "data", image_size=64),
        "data.batch_size": _with(base, "data", batch_size=16),
        "model.arch": _with(base, "model", arch="densenet-tiny"),
    }
    for name, cfg in changed.items():
        assert cam.discovery_key(_ctx(cfg, tmp_path)) != key, name
    assert cam.discovery_key(_ctx(base, tmp_path / "other")) != key  # another data root
    same = [_with(base, "train", checkpoint_every=7), _with(base, "train", log_every=3), _with(base, "data", workers=0)]
    assert all(cam.discovery_key(_ctx(cfg, tmp_path)) == key for cfg in same)


def test_the_synthesis_cache_name_holds_every_setting_the_synthesis_trains_with(tmp_path):
    """synthesis_key: the synthesis is mtERM over `rounds` heads, trained for synthesis_epochs at
    synthesis_lr and synthesis_weight_decay on the group loader of group_method's groups with
    data.n_groups_per_batch groups per batch; Distill_n's uses bonsai.distill_groups instead. Each
    change must name another cache entry; a Distill_n entry is never a Bonsai one, and only the
    group choice the synthesis uses (group_method for Bonsai, distill_groups for Distill_n) counts."""
    base = cam.Config()
    ctx = _ctx(base, tmp_path)
    for distill in (False, True):
        name = cam.synthesis_name(ctx, 2, distill)
        assert cam.synthesis_name(ctx, 3, distill) != name
        for section, values in (("bonsai", {"synthesis_epochs": 5}), ("bonsai", {"synthesis_lr": 0.1}),
                                ("bonsai", {"synthesis_weight_decay": 1e-2}), ("data", {"n_groups_per_batch": 3})):
            assert cam.synthesis_name(_ctx(_with(base, section, **values), tmp_path), 2, distill) != name, values
    bonsai, distill = cam.synthesis_name(ctx, 2), cam.synthesis_name(ctx, 2, True)
    assert bonsai != distill
    other_group = "balance" if base.bonsai.group_method == "old" else "old"
    other_distill = "balance" if base.bonsai.distill_groups == "old" else "old"
    assert cam.synthesis_name(_ctx(_with(base, "bonsai", group_method=other_group), tmp_path), 2) != bonsai
    assert cam.synthesis_name(_ctx(_with(base, "bonsai", distill_groups=other_distill), tmp_path), 2, True) != distill
    # the head is chosen after the cache (convert): one synthesis serves both heads (Table A.15)
    assert cam.synthesis_name(_ctx(_with(base, "bonsai", head="random"), tmp_path), 2) == bonsai


# -- the downstream penalty: RFC-Camelyon's schedule and WILDS's options -------------------------


@pytest.mark.parametrize("method", ["irm", "vrex", "clove"])
def test_the_downstream_penalty_is_off_before_the_anneal_step_and_resets_sgd_there(method):
    """Module docstring, step 3 (spec appendix #8): the penalty weight is 0 before
    penalty.anneal_iters and SGD's state is reset there (RFC-Camelyon); the risk is the mean over
    the groups; IRMv1 with the unbiased even/odd estimate (WILDS), vREx divided by the number of
    groups, CLOvE with the configured kernel width; the loss divided by a weight above 1 unless
    divide_by_weight is off."""
    cfg = cam.Config(method=method, penalty=cam.PenaltyConfig(weight=10.0, anneal_iters=5, clove_width=0.3))
    pen = cam.make_downstream_penalty(cfg)
    assert pen.name == method and pen.risk_reduction == "mean"
    assert [pen.weight_at(t) for t in (0, 4, 5, 9)] == [0.0, 0.0, 10.0, 10.0]
    assert [t for t in range(12) if pen.reset_optimizer_at(t)] == [5]
    assert pen.divisor_at(5) == 10.0
    assert {"irm": lambda: pen.unbiased, "vrex": lambda: pen.divide_by_groups and not pen.biased,
            "clove": lambda: pen.width == 0.3}[method]()
    raw = cam.make_downstream_penalty(dataclasses.replace(cfg, penalty=dataclasses.replace(cfg.penalty,
                                                                                         divide_by_weight=False)))
    assert raw.divisor_at(5) == 1.0
    erm = cam.make_downstream_penalty(cam.Config(method="erm"))
    assert erm.name == "erm" and erm.risk_reduction == "mean" and not any(erm.reset_optimizer_at(t) for t in range(12))


# -- initialisations -----------------------------------------------------------------------------


def _round(state: dict[str, torch.Tensor]) -> cam.RoundResult:
    return cam.RoundResult(state, {}, [], 1, Path("round.safetensors"))


def test_each_init_starts_from_its_network(tmp_path, monkeypatch):
    """Module docstring, step 3: `rand` from scratch (no state), `erm` round 0's trained network,
    `erm-cf` the same frozen, `bonsai` the synthesis network with the K two-class heads averaged
    (`average_heads`), `bonsai-cf` the same frozen; the synthesis is over the run's `rounds`
    discovery rounds."""
    cfg = cam.Config(model=cam.ModelConfig(arch="densenet-tiny"))
    round0 = {k: v.clone() for k, v in cam.build_network(cfg, 2, "round", 0).state_dict().items()}
    round1 = {k: v + 1 for k, v in round0.items()}
    rounds = [_round(round0), _round(round1)]
    syn_state = dict(cam.build_network(cfg, 4, "synthesis").state_dict())
    seen = []

    def fake_synthesis(ctx, given, distill=False):
        seen.append((len(given), distill, given[0].state is round0, given[1].state is round1))
        return cam.Synthesis(syn_state, [], 1, {"train": 1.0, "id_val": 1.0}, tmp_path / "s.safetensors")

    monkeypatch.setattr(cam, "synthesis", fake_synthesis)
    starts = {}
    for init in ("rand", "erm", "erm-cf", "bonsai", "bonsai-cf"):
        ctx = _ctx(dataclasses.replace(cfg, init=init), tmp_path)
        starts[init] = cam.initial_network(ctx, rounds, {"caches": {}}, {})
    assert starts["rand"].state is None and not starts["rand"].frozen
    for init, frozen in (("erm", False), ("erm-cf", True)):
        assert starts[init].state is round0 and starts[init].frozen == frozen, init
    w, b = average_heads_by_hand(syn_state["classifier.weight"], syn_state["classifier.bias"])
    for init, frozen in (("bonsai", False), ("bonsai-cf", True)):
        state = starts[init].state
        assert starts[init].frozen == frozen, init
        assert torch.equal(state["classifier.weight"], w) and torch.equal(state["classifier.bias"], b)
        assert all(torch.equal(state[k], v) for k, v in syn_state.items() if not k.startswith("classifier."))
    assert seen == [(2, False, True, True)] * 2


def average_heads_by_hand(weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows 2k and 2k + 1 of a Linear(d, 2K) are head k's classes 0 and 1 (spec pitfall 15)."""
    k = weight.shape[0] // 2
    return (sum(weight[2 * i : 2 * i + 2] for i in range(k)) / k, sum(bias[2 * i : 2 * i + 2] for i in range(k)) / k)


# -- the downstream stage ------------------------------------------------------------------------


def test_a_penalty_from_scratch_starts_at_round_0s_init_with_hospital_environments(tree, tmp_path, monkeypatch):
    """Module docstring, step 3: `init: rand` with a penalty trains from scratch from round 0's
    initialisation (build_network(seed, "round", 0)), with train.weight_decay (0.01 unless set), on the
    group loader whose environments are the batch's 2 hospitals (batch 8: 4 + 4), and SGD's state is
    reset at penalty.anneal_iters (spec appendix #8)."""
    from owai.experiment import execute

    seen = {}
    train_stage = cam.train_stage

    def spied(ctx, stage, model, optimizer, loss_at, *args, **kwargs):
        seen.update(stage=stage, start={k: v.detach().clone() for k, v in model.state_dict().items()},
                    weight_decay=[g["weight_decay"] for g in optimizer.param_groups],
                    reset=kwargs.get("reset_optimizer_at"), cfg=ctx.cfg)
        return train_stage(ctx, stage, model, optimizer, loss_at, *args, **kwargs)

    sizes: list[list[int]] = []
    make = cam.make_downstream_penalty

    def recording(cfg):
        pen = make(cfg)
        objective = pen.objective

        def recorded(envs, step, *args, **kwargs):
            sizes.append([int(env.logits.shape[0]) for env in envs])
            return objective(envs, step, *args, **kwargs)

        pen.objective = recorded
        return pen

    monkeypatch.setattr(cam, "train_stage", spied)
    monkeypatch.setattr(cam, "make_downstream_penalty", recording)
    sets = [s for s in tiny(tree) if not s.startswith("bonsai.")]
    execute(RECIPE, "cpu", sets + ["init=rand", "method=vrex", "penalty.weight=2.0", "penalty.anneal_iters=3",
                                   "train.epochs=1"], out=tmp_path / "runs")
    assert seen["stage"] == "downstream"
    expected = cam.build_network(seen["cfg"], 2, "round", 0).state_dict()
    assert set(seen["start"]) == set(expected) and all(torch.equal(seen["start"][k], v) for k, v in expected.items())
    assert seen["weight_decay"] == [0.01]
    assert seen["reset"] is not None and [t for t in range(6) if seen["reset"](t)] == [3]
    assert sizes and all(s == [4, 4] for s in sizes)


# -- the synthesis fits each round's own pseudo-labels -------------------------------------------


def test_synthesis_head_k_fits_round_k_pseudo_labels(tree, tmp_path, monkeypatch):
    """Module docstring, step 2: mtERM with loss sum_k CE(head_k, pseudo_k), head k = logits
    2k..2k+1 and pseudo_k round k's predictions on the training split. With round 0 predicting class
    0 everywhere and round 1 class 1 everywhere, every batch must ask head 0 for 0 and head 1 for 1
    (a synthesis that fits the true labels, or the rounds in another order, does not). The weight
    decays: the synthesis's 1e-6, then bonsai-cf's downstream head 0.01 (only `bonsai` takes 1e-6)."""
    from owai.experiment import execute
    from owai.methods import invariance

    def fake_round(ctx, k, earlier, checkpoints=None):
        n = {s: int(ctx.data.split(s).numel()) for s in ("train", *cam.EVAL_SPLITS)}
        preds = {s: torch.full((m,), k, dtype=torch.long) for s, m in n.items()}
        curve = {"epoch": 1, "test.acc": 0.5, "id_val.acc": 0.5}
        state = cam.build_network(ctx.cfg, 2, "round", k).state_dict()
        return cam.RoundResult(state, preds, [curve], 1, tmp_path / f"round{k}.safetensors")

    targets: list[list[torch.Tensor]] = []
    real_make_penalty = invariance.make_penalty

    def spying(name, **options):
        pen = real_make_penalty(name, **options)
        if name == "erm" and options.get("risk_reduction") == "sum":  # the synthesis's objective
            objective = pen.objective

            def recorded(envs, step, *args, **kwargs):
                assert all(env.logits.shape[1] == 2 for env in envs)
                targets.append([env.y.detach().cpu() for env in envs])
                return objective(envs, step, *args, **kwargs)

            pen.objective = recorded
        return pen

    decays = {}
    train_stage = cam.train_stage

    def spied(ctx, stage, model, optimizer, *args, **kwargs):
        decays[stage] = [g["weight_decay"] for g in optimizer.param_groups]
        return train_stage(ctx, stage, model, optimizer, *args, **kwargs)

    monkeypatch.setattr(cam, "discovery_round", fake_round)
    monkeypatch.setattr(invariance, "make_penalty", spying)
    monkeypatch.setattr(cam, "train_stage", spied)
    execute(RECIPE, "cpu", tiny(tree) + ["init=bonsai-cf", "rounds=2", "bonsai.synthesis_epochs=1", "train.epochs=1"],
            out=tmp_path / "runs")
    assert targets, "the synthesis trained"
    # synthesis: bonsai.synthesis_weight_decay (1e-6); a frozen bonsai-cf head: wd 0.01 (docstring, step 3)
    assert decays == {"synthesis": [1e-6], "downstream": [0.01]}
    for heads in targets:
        assert len(heads) == 2
        assert heads[0].eq(0).all() and heads[1].eq(1).all()


# -- discovery rounds: the epoch chosen by id_val, and that epoch's predictions -------------------


def test_a_round_keeps_its_id_val_epoch_and_that_epochs_predictions(tree, tmp_path, monkeypatch):
    """Module docstring, step 1: each round is evaluated every epoch; its epoch is chosen by id_val
    accuracy, and that epoch's predictions on every split are the round's pseudo-labels. Here the
    evaluation is scripted so that id_val peaks at epoch 1 while test (and the last epoch) say 3: the
    round must report epoch 1 and carry the predictions of the network as it was at epoch 1."""
    from owai.experiment import execute

    scores = {1: (0.9, 0.1), 2: (0.5, 0.5), 3: (0.2, 0.95)}  # epoch -> (id_val acc, test acc)
    logged: list[dict[str, torch.Tensor]] = []

    def scripted(ctx, logits):
        logged.append({s: lg.clone() for s, lg in logits.items()})
        id_val, test = scores[(len(logged) - 1) % 3 + 1]
        return {"id_val.acc": id_val, "id_val.acc_wg": id_val, "val.acc": 0.5, "val.acc_wg": 0.5,
                "test.acc": test, "test.acc_wg": test}

    monkeypatch.setattr(cam, "split_metrics", scripted)
    _, results = execute(RECIPE, "cpu", rounds_only(tree) + ["init=none", "rounds=1", "train.epochs=3", "train.lr=0.001"],
                         out=tmp_path / "runs")
    assert len(logged) == 3  # one evaluation per epoch
    assert results["details"]["rounds"]["round0"]["epoch"] == 1
    measured = {r["metric"]: r["measured"] for r in results["rows"]}
    assert measured["round0.test_acc"] == 0.1 and measured["round0.id_val_acc"] == 0.9
    from safetensors.torch import load_file

    entry = load_file(results["details"]["caches"]["round0"])
    for split in cam.EVAL_SPLITS:  # the pseudo-labels of epoch 1's network
        assert torch.equal(entry[f"pred.{split}"], logged[0][split].argmax(1)), split
    assert any(not torch.equal(logged[0][s].argmax(1), logged[2][s].argmax(1)) for s in cam.EVAL_SPLITS), \
        "epochs 1 and 3 predict alike: the check above could not tell them apart"


def test_a_groupdro_round_weighs_only_the_groups_its_training_set_holds(tree, tmp_path, monkeypatch):
    """discovery_round ("WILDS: q is uniform over the groups present in train") and group_dro_loss's
    docstring: GroupDRO's groups are those of round_groups present in the replicated training set.
    With a round 0 that is right on every training patch, round 1's training set holds group 0
    (correct) alone, so q has one entry: a round that also weighs the absent group 1 (every group
    index 0..2K-1) trains on q_0 l_0 with q_0 < 1 instead of l_0."""
    from owai.experiment import execute

    discovery_round = cam.discovery_round

    def perfect_round0(ctx, k, earlier, checkpoints=None):
        if k > 0:
            return discovery_round(ctx, k, earlier, checkpoints)
        preds = {s: ctx.data.labels[ctx.data.split(s)].clone() for s in ("train", *cam.EVAL_SPLITS)}
        state = cam.build_network(ctx.cfg, 2, "round", 0).state_dict()
        return cam.RoundResult(state, preds, [{"epoch": 1, "test.acc": 1.0, "id_val.acc": 1.0}], 1,
                               tmp_path / "round0.safetensors")

    present: list[torch.Tensor] = []
    group_dro_loss = cam.group_dro_loss

    def kept(penalty, logits, target, g, groups):
        present.append(groups.cpu())
        out = group_dro_loss(penalty, logits, target, g, groups)
        assert penalty.q.numel() == len(groups)
        return out

    monkeypatch.setattr(cam, "discovery_round", perfect_round0)
    monkeypatch.setattr(cam, "group_dro_loss", kept)
    execute(RECIPE, "cpu", rounds_only(tree) + ["init=none", "rounds=2", "train.epochs=1"], out=tmp_path / "runs")
    assert present and all(p.tolist() == [0] for p in present)


# -- resume: a killed GroupDRO round resumes to the uninterrupted run's network ----------------


def test_a_killed_groupdro_round_resumes_to_the_uninterrupted_round(tree, tmp_path, monkeypatch):
    """Project rule: a killed run resumes from its last checkpoint and equals the uninterrupted run.
    A GroupDRO round's state beside the weights is GroupDRO's q and the curves so far (train_stage's
    companion). Round 1 is killed after its first epoch (its later checkpoints and its cache entry
    removed) and resumed: its weights, q, chosen epoch and curves must be the uninterrupted run's.
    On the way, its GroupDRO weighs the groups present in its training set (discovery_round: "WILDS:
    q is uniform over the groups present in train"), here those round_groups made of round 0."""
    import shutil

    from safetensors.torch import load_file

    from owai.checkpoint import latest_checkpoint, load_checkpoint
    from owai.experiment import execute

    seen: dict[str, list[torch.Tensor]] = {"groups": [], "present": []}
    round_groups, group_dro_loss = cam.round_groups, cam.group_dro_loss

    def kept_groups(preds, y):
        examples, groups = round_groups(preds, y)
        seen["groups"].append(groups)
        return examples, groups

    def kept_present(penalty, logits, target, g, present):
        seen["present"].append(present.cpu())
        return group_dro_loss(penalty, logits, target, g, present)

    monkeypatch.setattr(cam, "round_groups", kept_groups)
    monkeypatch.setattr(cam, "group_dro_loss", kept_present)
    # lr 1e-3 (WILDS's): round 0 still errs on some training patches, so round 1 has two groups and a q that moves
    sets = rounds_only(tree) + ["init=none", "rounds=2", "train.checkpoint_every=2", "train.lr=0.001"]
    run, results = execute(RECIPE, "cpu", sets, out=tmp_path / "runs")
    # WILDS: q over the groups present in the (replicated) training set, whichever a batch holds
    assert len(seen["groups"]) == 1 and seen["present"]
    assert all(torch.equal(p, seen["groups"][0].unique()) for p in seen["present"])
    assert len(seen["present"][0]) >= 2, "one group: q is 1 whatever happens, the resume check would be empty"
    cache = Path(results["details"]["caches"]["round1"])
    full = load_file(cache)
    stage = run.path / "checkpoints" / "round1"
    _, final = load_checkpoint(latest_checkpoint(stage))
    steps = sorted(stage.iterdir())
    assert [int(p.name.split("-")[1]) for p in steps[-2:]] == [4, 6], steps  # 2 epochs of 3 updates
    shutil.rmtree(steps[-1])  # resumed from the step-4 checkpoint: mid-epoch 2, after epoch 1's evaluation
    cache.unlink()
    (run.path / "results.json").unlink()
    _, again = execute(resume=run.path)
    resumed = load_file(cache)
    assert set(resumed) == set(full) and all(torch.equal(resumed[k], full[k]) for k in full)
    _, end = load_checkpoint(latest_checkpoint(stage))
    assert all(torch.equal(end["model"][k], v) for k, v in final["model"].items())
    assert again["details"]["rounds"] == results["details"]["rounds"]
