"""Very-large dropout fine-tuning (owai.methods.dropout_ft, `owai dropout-ft`): the model's dropout
and frozen BatchNorm, the ensemble / weight-average arithmetic, IID selection on a generated
DomainBed-style tree, resume, and the one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from owai.methods.dropout_ft import (
    EvalSet,
    Tracks,
    TrainConfig,
    accuracies,
    average_states,
    lr_schedule,
)
from owai.models.vision import FineTuneClassifier, build_backbone
from conftest import as_sets, cli_in_process
from domainbed_tree import make_tree

# A miniature fine-tuning run on the generated tree: ResNet-18 at 16 px, 6 updates, evaluation every 2.
TINY = [
    "data.dataset=imagefolder", "data.image_size=16", "data.batch_per_domain=4", "data.workers=0",
    "data.eval_batch_size=16", "model.backbone=resnet18", "model.weights=''", "pretrain.steps=0",
    "train.steps=6", "train.eval_every=2", "train.average_start=2", "train.checkpoint_every=2",
    "train.log_every=2", "train.milestones=[4]", "train.lr=0.01",
]


def _net(p: float, freeze_bn: bool = True) -> FineTuneClassifier:
    torch.manual_seed(0)
    return FineTuneClassifier(build_backbone("resnet18", 1000), num_classes=5, dropout=p, freeze_bn=freeze_bn)


def test_dropout_acts_only_on_the_penultimate_features_and_only_in_training() -> None:
    net = _net(0.9)
    x = torch.randn(4, 3, 32, 32)
    seen = []
    net.classifier[1].register_forward_hook(lambda mod, inp, out: seen.append(inp[0].detach()))
    net.train()
    feats_a, feats_b = net.features(x), net.features(x)
    assert torch.equal(feats_a, feats_b), "the backbone itself is deterministic in training mode (frozen BN, no dropout)"
    net(x)
    ratio = seen[-1][feats_a != 0] / feats_a[feats_a != 0]
    kept = torch.isclose(ratio, torch.tensor(10.0))
    assert bool((kept | (ratio == 0)).all()), "head inputs are the features dropped (0) or scaled by 1/(1-p)"
    assert 0.03 < kept.float().mean() < 0.2, "about 10% of the units are kept at p = 0.9"
    net.eval()
    out = net(x)
    assert torch.equal(seen[-1], net.features(x)), "eval mode: the head reads the features unchanged"
    assert torch.equal(out, net(x))


def test_frozen_batchnorm_keeps_running_statistics_while_affine_parameters_train() -> None:
    for freeze in (True, False):
        net = _net(0.0, freeze_bn=freeze)
        bn = {k: v.clone() for k, v in net.state_dict().items() if "running_" in k}
        affine = net.backbone.bn1.weight.detach().clone()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2):
            net.train()
            loss = torch.nn.functional.cross_entropy(net(torch.randn(8, 3, 32, 32) * 3 + 1), torch.randint(0, 5, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
        same = all(torch.equal(v, net.state_dict()[k]) for k, v in bn.items())
        assert same == freeze, f"freeze_bn={freeze}: running statistics {'changed' if not same else 'stayed'}"
        assert not torch.equal(affine, net.backbone.bn1.weight), "BatchNorm's affine parameters still train"


def test_weight_average_and_ensemble_of_identical_models_equal_the_model() -> None:
    net = _net(0.9)
    state = net.state_dict()
    avg = average_states([state, state, state])
    assert set(avg) == set(state)
    for k, v in state.items():
        assert avg[k].dtype == v.dtype
        assert torch.allclose(avg[k].float(), v.float(), atol=1e-6), k
    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    logits = torch.randn(6, 5)
    sets = [EvalSet("val", "a", labels, lambda: iter(())), EvalSet("test", "b", labels, lambda: iter(())),
            EvalSet("test_out", "b", labels, lambda: iter(()))]
    one = accuracies({s.name: logits for s in sets}, sets)
    three = accuracies({s.name: logits + logits + logits for s in sets}, sets)
    assert one == three


def test_weight_average_is_the_uniform_mean() -> None:
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(5)}
    avg = average_states([a, b])
    assert torch.allclose(avg["w"], torch.tensor([2.0, 4.0]))
    assert int(avg["n"]) == 5, "integer buffers take the newest value"


def test_selection_keeps_the_first_best_iid_evaluation() -> None:
    tracks = Tracks()
    for step, iid, ood in [(0, 0.5, 0.1), (300, 0.8, 0.2), (600, 0.8, 0.9), (900, 0.7, 0.95)]:
        tracks.record("model", step, {"iid_acc": iid, "ood_acc": ood, "ood_out_acc": ood})
    assert tracks.best["model"] == {"step": 300, "iid_acc": 0.8, "ood_acc": 0.2, "ood_out_acc": 0.2}


def test_multistep_schedule_and_last_layer_factor() -> None:
    lr = lr_schedule(TrainConfig(lr=1e-3, milestones=[5000, 10000], gamma=0.1))
    assert lr(0) == pytest.approx(1e-3) and lr(4999) == pytest.approx(1e-3)
    assert lr(5000) == pytest.approx(1e-4) and lr(10000) == pytest.approx(1e-5)


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One `owai dropout-ft` study on a generated 3-domain tree: test domain 0, dropout 0 and 0.9, two lrs."""
    import os

    from owai.cli import main

    tmp = tmp_path_factory.mktemp("dft")
    root = make_tree(tmp / "tree", domains=("d0", "d1", "d2"), classes=("a", "b"), per_class=10, size=16, corrupt=1)
    saved = os.environ.get("OWAI_CACHE")
    os.environ["OWAI_CACHE"] = str(tmp / "cache")
    args = ["dropout-ft", "--root", str(root), "--test-domain", "0", "--dropout", "0.0,0.9",
            "--grid", "train.lr=0.01,0.003", "--out", str(tmp / "runs"), "-q", *as_sets(TINY),
            "--set", "data.skip_unreadable=true"]
    try:
        main(args)
    except SystemExit as e:
        assert not e.code, f"owai dropout-ft failed with {e.code}"
    finally:
        if saved is None:
            os.environ.pop("OWAI_CACHE", None)
        else:
            os.environ["OWAI_CACHE"] = saved
    sweep = next((tmp / "runs" / "table2.8-dropout").glob("sweep-*"))
    return {"sweep": sweep, "rows": json.loads((sweep / "dropout_ft.json").read_text())["rows"],
            "summary": json.loads((sweep / "summary.json").read_text())}


def test_study_on_the_miniature_tree_writes_every_track(study: dict) -> None:
    rows = study["rows"]
    tracks = {(r["variant"], r["track"]) for r in rows}
    for p in ("dropout 0.0", "dropout 0.9"):
        for t in ("model", "swa", "ens", "wa_multi", "ens_multi"):
            assert (p, t) in tracks
    for r in rows:
        assert set(r["ood"]) == {"d0"} and 0.0 <= r["avg"] <= 1.0
    assert (study["sweep"] / "figures" / "dropout_ft.png").stat().st_size > 0
    # Fig 2.10's box of every single-run track (one value per lr here: one test domain), for the claims
    import numpy as np

    from owai.methods.dropout_ft import grid_boxes

    boxes = grid_boxes(study["summary"])
    for r in rows:
        if r["track"] in ("wa_multi", "ens_multi"):
            assert "box" not in r  # single points in the figure, not boxes
            continue
        values = boxes[r["dataset"]][r["label"]]
        assert len(values) == 2 == r["box"]["n"]
        assert [r["box"][q] for q in ("q25", "median", "q75")] == pytest.approx(
            [v / 100 for v in np.percentile(values, [25, 50, 75])])
        assert min(values) / 100 <= r["box"]["q25"] <= r["box"]["q75"] <= max(values) / 100
    assert "| dropout 0.9+Ens-multi |" in (study["sweep"] / "dropout_ft.md").read_text()


def test_multi_run_results_name_their_device_and_another_device_computes_them_again(study: dict) -> None:
    """Ens-multi / WA-multi run where the study command runs: multi_run.json records the device and
    precision, and an entry of another device is not taken as this one's."""
    import torch

    from owai.methods.dropout_ft import HP_KEYS, MULTI_JSON, _grid_keys, multi_run
    from owai.sweep import open_sweep, summarise

    path = study["sweep"] / MULTI_JSON
    cache = json.loads(path.read_text())
    assert cache and all(e["device"] == "cpu" and e["precision"] == "float32" for e in cache.values())
    sweep = open_sweep(study["sweep"])
    summary = summarise(sweep)
    per = [k for k in _grid_keys(summary) if k not in HP_KEYS]
    again = multi_run(sweep, summary, per, torch.device("cpu"))  # all cached: the same entries
    assert again and again == {k: cache[k] for k in again}
    tampered = {k: {**v, "device": "cuda", "ens_multi": {"d0": -1.0}} for k, v in cache.items()}
    path.write_text(json.dumps(tampered))
    try:
        assert multi_run(sweep, summary, per, torch.device("cpu")) == again  # another device's numbers not reused
    finally:
        path.write_text(json.dumps(cache))


def test_the_multi_run_step_runs_on_the_cpu_when_the_points_were_told_to(study: dict, monkeypatch) -> None:
    """`--set runtime.device=cpu` reaches the study's last step (it ran on CUDA wherever the
    submitting machine had it); 'auto' (the study's points here) takes CUDA where there is one."""
    import torch
    import yaml

    from owai.methods.dropout_ft import study_device
    from owai.sweep import open_sweep, summarise

    summary = summarise(open_sweep(study["sweep"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert study_device(summary) == torch.device("cuda")
    first = next(p for p in summary["points"] if p["status"] == "complete")
    config = Path(first["run_dir"]) / "config.yaml"
    original = config.read_text()
    told = yaml.safe_load(original)
    told["params"]["runtime"]["device"] = "cpu"
    try:
        config.write_text(yaml.safe_dump(told))
        assert study_device(summary) == torch.device("cpu")
    finally:
        config.write_text(original)


def test_fig_2_10_boxes_hold_every_choice_of_cell_per_test_domain() -> None:
    """One value per choice of (lr, wd) cell for each test domain, averaged over the test domains
    (the verylarge_dropout README's 6^4 = 1296 per method), per track."""
    from owai.methods.dropout_ft import grid_boxes

    def group(domain: int, lr: float, dropout: float, model: float, swa: float) -> dict:
        return {"grid": {"data.test_domain": domain, "train.lr": lr, "model.dropout": dropout},
                "metrics": [{"metric": "model.ood_acc", "mean": model}, {"metric": "swa.ood_acc", "mean": swa}]}

    summary = {"grid": {"data.test_domain": [0, 1], "train.lr": [0.1, 0.2], "model.dropout": [0.0, 0.9]},
               "points": [], "groups": [group(0, 0.1, 0.0, 0.5, 0.6), group(0, 0.2, 0.0, 0.7, 0.8),
                                        group(1, 0.1, 0.0, 0.9, 0.9), group(1, 0.2, 0.0, 0.3, 0.4),
                                        group(0, 0.1, 0.9, 0.6, 0.6), group(1, 0.1, 0.9, 0.8, 0.8)]}
    boxes = grid_boxes(summary)["None"]
    assert sorted(boxes["dropout 0.0"]) == pytest.approx([40.0, 50.0, 70.0, 80.0])  # (50|70) + (90|30), halved
    assert sorted(boxes["dropout 0.0+WA-single"]) == pytest.approx([50.0, 60.0, 75.0, 85.0])
    assert boxes["dropout 0.9"] == pytest.approx([70.0])
    summary["groups"] = summary["groups"][:-1]  # dropout 0.9 without results on domain 1: no box
    assert "dropout 0.9" not in grid_boxes(summary)["None"]


def test_study_selects_the_cell_and_checkpoint_with_the_best_iid_accuracy(study: dict) -> None:
    points = [p for p in study["summary"]["points"] if p["grid"]["model.dropout"] == 0.9]
    results = {}
    for p in points:
        run = Path(p["run_dir"])
        measured = {r["metric"]: r["measured"] for r in json.loads((run / "results.json").read_text())["rows"]}
        evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        evals = [e for e in evals if "model.iid_acc" in e]
        assert [e["update"] for e in evals] == [0, 2, 4, 5]
        best = max(evals, key=lambda e: e["model.iid_acc"])  # max() keeps the first of ties
        assert measured["model.step"] == best["update"] and measured["model.ood_acc"] == best["model.ood_acc"]
        results[p["grid"]["train.lr"]] = measured
    chosen = max(results.values(), key=lambda m: m["model.iid_acc"])
    row = next(r for r in study["rows"] if r["variant"] == "dropout 0.9" and r["track"] == "model")
    assert row["ood"]["d0"] == pytest.approx(chosen["model.ood_acc"])


def test_corrupt_files_are_skipped_and_counted(study: dict) -> None:
    """With data.skip_unreadable=true (by default an unreadable file stops the command before any
    directory: tests/test_hardening_cli.py)."""
    run = Path(study["summary"]["points"][0]["run_dir"])
    assert json.loads((run / "results.json").read_text())["details"]["skipped_files"] == 1


def test_resumed_run_equals_uninterrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import owai.methods.dropout_ft as dft

    root = make_tree(tmp_path / "tree", per_class=6, size=16)
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    sets = as_sets([*TINY, f"data.root={root}", "model.dropout=0.9"])
    code, _, err = cli_in_process(["recipes", "run", "table2.8-dropout", "--single", *sets, "-o", str(tmp_path / "a"), "-q"], capsys)
    assert code == 0, err
    whole = json.loads(next((tmp_path / "a").rglob("results.json")).read_text())["rows"]

    original = dft._update_average
    calls = {"n": 0}

    def dying(tracks, model):  # the process dies after update 3 (its checkpoint at update 2 is kept)
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        original(tracks, model)

    monkeypatch.setattr(dft, "_update_average", dying)
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        from owai.cli import main

        main(["recipes", "run", "table2.8-dropout", "--single", *sets, "-o", str(tmp_path / "b"), "-q"])
    monkeypatch.setattr(dft, "_update_average", original)
    run_dir = next((tmp_path / "b" / "table2.8-dropout").iterdir())
    code, _, err = cli_in_process(["recipes", "run", "table2.8-dropout", "--resume", str(run_dir), "-q"], capsys)
    assert code == 0, err
    resumed = json.loads((run_dir / "results.json").read_text())["rows"]
    assert {r["metric"]: r["measured"] for r in resumed} == {r["metric"]: r["measured"] for r in whole}


@pytest.mark.parametrize("make, sets, message", [
    (lambda t: make_tree(t / "one", domains=("only",)), [], "domain"),
    (lambda t: make_tree(t / "tree"), ["model.backbone=resnet7"], "unknown backbone"),
    (lambda t: make_tree(t / "tree"), ["data.test_domain=5"], "test_domain"),
    (lambda t: make_tree(t / "tree"), ["data.dataset=officehome"], "data.dataset"),
    # a ViT takes one size: refused before the study, where each point failed after the sweep existed
    (lambda t: make_tree(t / "tree"), ["model.backbone=vit_mini_4", "data.image_size=16"], "vit_mini_4 is built for 32 px"),
])
def test_bad_input_is_one_line(tmp_path: Path, capsys, make, sets, message) -> None:
    root = make(tmp_path)
    code, _, err = cli_in_process(["recipes", "run", "table2.8-dropout", *as_sets([*TINY, f"data.root={root}", *sets]),
                                   "-o", str(tmp_path / "runs")], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_weight_file_with_wrong_keys_is_one_line(tmp_path: Path, capsys) -> None:
    from safetensors.torch import save_file

    root = make_tree(tmp_path / "tree")
    bad = tmp_path / "bad.safetensors"
    save_file({"conv1.weight": torch.zeros(64, 3, 7, 7), "nonsense": torch.zeros(2)}, str(bad))
    code, _, err = cli_in_process(["recipes", "run", "table2.8-dropout",
                                   *as_sets([*TINY, f"data.root={root}", f"model.weights={bad}"]),
                                   "-o", str(tmp_path / "runs")], capsys)
    assert code == 2 and "does not match ResNet" in err and "unexpected keys" in err, err
    assert len(err.strip().splitlines()) == 1


def test_cpu_preset_pretrains_on_mnists_training_file(monkeypatch: pytest.MonkeyPatch, shared_data: Path) -> None:
    """Issue #25 item 5: the cpu preset's stand-in for ImageNet pre-training is all 60 000 upright
    images of MNIST's training file (the domains come from the test file); the tiny preset keeps the
    2 000-image pool of the test file, under the cache key it had before `pretrain.source` existed."""
    import owai.methods.dropout_ft as dft
    from owai.data.mnist import load_mnist
    from owai.experiment import resolve
    from owai.recipes import load

    seen = {}
    monkeypatch.setattr(dft, "pretrained_backbone", lambda cfg, run, pool, device: seen.setdefault(cfg.pretrain.source, pool))
    recipe = load("table2.8-dropout")
    cpu, _ = resolve(recipe, "cpu", [])
    tiny, _ = resolve(recipe, "tiny", [])
    data = dft.load_data(tiny)  # both presets deal the same test-file images to the domains
    assert [d.tolist() for d in data.source_indices] == [d.tolist() for d in dft.load_data(cpu).source_indices]
    dft.initial_weights(cpu, None, data, torch.device("cpu"))
    dft.initial_weights(tiny, None, data, torch.device("cpu"))
    train = load_mnist("train")
    assert seen["mnist-train"].size(0) == 60_000 and torch.equal(seen["mnist-train"].labels(0), train.labels.long())
    assert seen["pool"].size(0) == 2_000
    assert dft.pretrain_key(cpu) != dft.pretrain_key(tiny)
    import hashlib

    from owai.config import to_dict

    before = {k: v for k, v in to_dict(tiny.pretrain).items() if k != "source"}  # the key's form before the field
    d = tiny.data
    what = {"backbone": "resnet18", "pretrain": before, "root": d.root, "pool": d.pool, "trial_seed": d.trial_seed,
            "image_size": d.image_size, "augment": d.augment, "version": 1}
    assert dft.pretrain_key(tiny) == hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
