"""Table 2.3 on the generated Camelyon17 miniature (tests/camelyon_tree.py): frozen Cat_n (init cat-cf)
and Distill_n (init distill-cf) under a downstream ERM / vREx head, their caches, the recipe
table2.3-camelyon17-frozen and its study rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from camelyon_tree import make_camelyon
from conftest import as_sets, cli_in_process
from owai.methods import camelyon17 as cam

RECIPE = "table2.3-camelyon17-frozen"

# Table 2.3: init -> (IID vREx, IID ERM, OOD vREx, OOD ERM), in %
THESIS = {("erm-cf", None): (69.6, 66.6, 70.6, 70.2),
          ("cat-cf", 2): (74.3, 74.3, 73.7, 74.2), ("cat-cf", 5): (75.2, 75.0, 74.9, 75.1),
          ("cat-cf", 20): (76.4, 76.5, 76.8, 76.4),
          ("distill-cf", 2): (67.1, 66.9, 67.4, 66.7), ("distill-cf", 5): (69.9, 69.9, 71.8, 69.9),
          ("distill-cf", 20): (73.3, 73.2, 74.8, 73.1),
          ("bonsai-cf", 2): (77.9, 78.2, 79.5, 78.6)}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return make_camelyon(tmp_path_factory.mktemp("camelyon"))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))


def sets(tree: Path, *extra: str) -> list[str]:
    return [f"data.root={tree}", *extra]


class Spy:
    """Counts the training stages and keeps what cat_features and downstream returned."""

    def __init__(self, monkeypatch):
        self.stages: list[str] = []
        self.features: list[dict[str, torch.Tensor]] = []
        self.networks: list[torch.nn.Module] = []
        train_stage, cat_features, downstream = cam.train_stage, cam.cat_features, cam.downstream

        def counted(ctx, stage, *args, **kwargs):
            self.stages.append(stage)
            return train_stage(ctx, stage, *args, **kwargs)

        def kept_features(members):
            feats, paths = cat_features(members)
            self.features.append(feats)
            return feats, paths

        def kept_network(ctx, start, details):
            curves, net = downstream(ctx, start, details)
            self.networks.append(net)
            return curves, net

        monkeypatch.setattr(cam, "train_stage", counted)
        monkeypatch.setattr(cam, "cat_features", kept_features)
        monkeypatch.setattr(cam, "downstream", kept_network)


def _state(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k[len("state."):]: v for k, v in load_file(path).items() if k.startswith("state.")}


@torch.no_grad()
def _features(tree: Path, state: dict[str, torch.Tensor], split: str) -> torch.Tensor:
    """Eval-mode features of a tiny DenseNet with `state` on every image of `split`, computed here."""
    from owai.data.camelyon17 import Camelyon17, eval_batches
    from owai.models.vision import DenseNet, features

    net = DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16, bn_size=2, num_classes=2)
    net.load_state_dict(state)
    net.eval()
    data = Camelyon17(tree, image_size=16, cache_images=True)
    return torch.cat([features(net, x) for x in eval_batches(data, data.split(split), 64, 0)])


def test_cat_and_distill_end_to_end(tree, tmp_path, monkeypatch):
    """erm-cf trains round 0; cat-cf (n = 2) reuses it and trains only network 1 and the head, on the
    concatenated features; distill-cf (n = 2) reuses both networks and trains the synthesis and the
    head. Every featurizer stays bit-identical."""
    from owai.experiment import execute

    run0, res0 = execute(RECIPE, "tiny", sets(tree, "init=erm-cf"), out=tmp_path / "runs")
    round0 = res0["details"]["caches"]["round0"]
    stamp = Path(round0).stat().st_mtime_ns

    spy = Spy(monkeypatch)
    run, results = execute(RECIPE, "tiny", sets(tree, "init=cat-cf", "networks=2", "method=vrex", "penalty.weight=1.0"),
                           out=tmp_path / "runs")
    measured = {r["metric"]: r["measured"] for r in results["rows"]}
    assert all(0.0 <= measured[k] <= 1.0 for k in ("test_acc.iid", "test_acc.ood", "networks.mean_test_acc"))
    assert spy.stages == ["erm1", "downstream"]  # network 0 = the cached round 0: not retrained
    assert not (run.path / "checkpoints" / "round0").exists() and (run.path / "checkpoints" / "erm1").is_dir()
    details = results["details"]
    caches = details["caches"]
    assert caches["round0"] == round0 and Path(round0).stat().st_mtime_ns == stamp
    seeds = [n["seed"] for n in details["networks"]]
    assert seeds == [0, cam.network_seed(0, 1)] and seeds[1] != 0
    assert caches["erm1"] != round0 and Path(caches["erm1"]).parent.name != Path(round0).parent.name
    assert caches["features"][0] == res0["details"]["caches"]["features"]  # erm-cf's feature cache, shared

    # the head reads the concatenation of the two ERM featurizers' features (d = 32 for the tiny DenseNet)
    states = [_state(round0), _state(caches["erm1"])]
    feats = spy.features[0]
    width = 2 * states[0]["classifier.weight"].shape[1]
    for split in ("train", "test"):
        expected = torch.cat([_features(tree, s, split) for s in states], dim=1)
        assert feats[split].shape == expected.shape == (expected.shape[0], width)
        assert torch.allclose(feats[split], expected, atol=1e-6, rtol=0)
    from owai.checkpoint import latest_checkpoint, load_checkpoint

    trained = load_checkpoint(latest_checkpoint(run.path / "checkpoints" / "downstream"))[1]["model"]
    assert set(trained) == {"weight", "bias"} and trained["weight"].shape == (2, width)
    net = spy.networks[0]
    assert isinstance(net, cam.CatNetwork) and torch.equal(net.classifier.weight.cpu(), trained["weight"])
    for member, state in zip(net.networks, states):  # frozen: parameters and BN buffers bit-identical
        now = member.state_dict()
        assert all(torch.equal(now[k].cpu(), state[k]) for k in state)

    spy.stages.clear()
    run2, results2 = execute(RECIPE, "tiny", sets(tree, "init=distill-cf", "networks=2"), out=tmp_path / "runs")
    assert spy.stages == ["synthesis", "downstream"]  # both ERM networks from the cache
    measured2 = {r["metric"]: r["measured"] for r in results2["rows"]}
    assert all(0.0 <= measured2[k] <= 1.0 for k in ("test_acc.iid", "test_acc.ood", "synthesis.pseudo_acc.train"))
    caches2 = results2["details"]["caches"]
    assert caches2["round0"] == round0 and caches2["erm1"] == caches["erm1"]
    syn = Path(caches2["synthesis"])
    assert syn.name.startswith("distill-2-") and syn.is_file()
    synthesis = _state(str(syn))
    assert synthesis["classifier.weight"].shape[0] == 4  # one two-class head per ERM network
    distilled = spy.networks[1].state_dict()
    assert all(torch.equal(distilled[k].cpu(), synthesis[k]) for k in synthesis if not k.startswith("classifier."))
    assert results2["details"]["downstream_setup"]["cached_features"]
    assert Path(caches2["features"]).name == f"features-{syn.stem}.safetensors"

    # the reference's BN quirk also runs for Cat_n: parameters frozen, BN running statistics move
    spy.stages.clear()
    run3, results3 = execute(RECIPE, "tiny", sets(tree, "init=cat-cf", "downstream.frozen_bn=train"), out=tmp_path / "runs")
    assert spy.stages == ["downstream"] and not results3["details"]["downstream_setup"]["cached_features"]
    ref = spy.networks[2].state_dict()
    params = [f"networks.{i}.{k}" for i, s in enumerate(states) for k in s]
    frozen = [k for k in params if "running" not in k and "num_batches" not in k]
    assert all(torch.equal(ref[k].cpu(), states[int(k.split(".")[1])][k.split(".", 2)[2]]) for k in frozen)
    assert any(not torch.equal(ref[k].cpu(), states[int(k.split(".")[1])][k.split(".", 2)[2]])
               for k in params if "running_mean" in k)


@pytest.mark.parametrize("setting, message", [
    ("networks=1", "networks must be >= 2 for init cat-cf"),
    ("init=cat", "init"),
])
def test_bad_values_are_one_line_errors_without_a_run_directory(tree, tmp_path, capsys, setting, message):
    runs = tmp_path / "runs"
    code, out, err = cli_in_process(["bonsai", "--recipe", RECIPE, "-p", "tiny", "--out", str(runs),
                                     *as_sets(sets(tree, setting))], capsys)
    assert code == 2 and message in err and "Traceback" not in err + out
    assert len([line for line in err.splitlines() if line.strip()]) == 1
    assert not runs.exists()
    code, _, err = cli_in_process(["bonsai", "--recipe", RECIPE, "-p", "tiny", "--out", str(runs), "--init", "distill-cf",
                                   *as_sets(sets(tree, "networks=0"))], capsys)
    assert code == 2 and "networks must be >= 2 for init distill-cf" in err and not runs.exists()


def test_recipe_presets_and_thesis_numbers(tree):
    from owai import recipes
    from owai.experiment import resolve

    r = recipes.load(RECIPE)
    assert [x.ref for x in r.reproduces] == ["Table 2.3"] and {"tiny", "cpu", "paper"} <= set(r.presets)
    for preset in r.presets:  # the miniature tree keeps every hospital only whole (cpu's 0.5 % sample holds one)
        cfg, resolved = resolve(r, preset, [f"data.root={tree}", "data.fraction=1.0"])
        assert resolved["preset"] == preset and cfg.init == "cat-cf" and cfg.networks == 2
    tiny, _ = resolve(r, "tiny", [f"data.root={tree}"])
    assert tiny.model.arch == "densenet-tiny" and tiny.data.image_size == 16
    paper, _ = resolve(r, "paper", [f"data.root={tree}"])
    assert paper.model.arch == "densenet121" and paper.train.epochs == 10 and paper.bonsai.synthesis_epochs == 20
    assert paper.bonsai.distill_groups == "balance" and paper.bonsai.group_method == "old"
    for (init, n), values in THESIS.items():
        for metric, method, value in zip(("iid", "iid", "ood", "ood"), ("vrex", "erm", "vrex", "erm"), values):
            # the ERM row's ERM-head cells are plain WILDS ERM (init rand = round 0), as Table 2.6's "- / ERM"
            row_init = "rand" if (init, method) == ("erm-cf", "erm") else init
            cell = {"init": row_init, "method": method, "rounds": 2, "networks": n if n is not None else 2}
            number = recipes.thesis_for(r, f"test_acc.{metric}", cell)
            assert number is not None and number.value == pytest.approx(value / 100), (init, n, metric, method)
    subs, seeds = r.sweep.for_preset("paper")
    inits = {i for sub in subs for i in sub["init"]}
    assert inits == {"rand", "erm-cf", "cat-cf", "distill-cf", "bonsai-cf"} and seeds == [0, 1, 2, 3, 4]
    weights = {w for sub in subs for w in sub.get("penalty.weight", [])}
    assert weights == {0.0, 0.5, 1.0, 5.0, 10.0, 50.0, 100.0}  # lambda 0, as RFC's *linear.sh grids
    assert {n for sub in subs for n in sub.get("networks", [])} == {2, 5, 20}
    assert all(c.get("presets") == ["paper"] for c in r.claims)


def test_study_labels_cat_and_distill_rows(tree, tmp_path):
    """The study's rows name Cat2 / Distill2 with their thesis numbers; the claims stay n/a off paper."""
    from owai import sweep as sweeps
    from owai.methods.camelyon17 import study_table, write_study

    grid = [{"init": ["rand"], "method": ["erm"]}, {"init": ["erm-cf"], "method": ["erm"]},
            {"init": ["cat-cf", "distill-cf"], "networks": [2], "method": ["erm"]}]
    plan = sweeps.create(RECIPE, "tiny", sets(tree), seeds=[0], out=tmp_path / "study", grid=grid)
    summary = sweeps.write_summary(plan, sweeps.run(plan, "local", 1))
    assert summary["counts"].get("complete") == 4
    rows, info = write_study(plan, summary)
    by_label = {r["label"]: r for r in rows}
    assert list(by_label) == ["- / ERM", "ERM-cf / ERM", "Cat2 / ERM", "Distill2 / ERM"]
    assert by_label["Cat2 / ERM"]["networks"] == 2 and by_label["ERM-cf / ERM"]["networks"] is None
    assert by_label["Cat2 / ERM"]["iid"]["thesis"] == pytest.approx(0.743)
    assert by_label["Distill2 / ERM"]["ood"]["thesis"] == pytest.approx(0.667)
    assert by_label["- / ERM"]["iid"]["thesis"] == pytest.approx(0.666)  # Table 2.3's ERM / ERM: plain WILDS ERM
    assert by_label["ERM-cf / ERM"]["iid"]["thesis"] is None
    study = json.loads((plan.path / "camelyon17.json").read_text())
    assert len(study["claims"]) == 6 and {c["verdict"] for c in study["claims"]} == {"n/a"}  # judged at paper only
    assert "Cat2 / ERM" in (plan.path / "camelyon17.md").read_text()
    assert study_table(rows, info["title"]).row_count == 4
