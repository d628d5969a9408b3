"""Camelyon17-WILDS reader and the 2-/3-Bonsai pipeline (owai.data.camelyon17, owai.methods.camelyon17)
on a miniature WILDS tree (tests/camelyon_tree.py)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from camelyon_tree import make_camelyon
from conftest import as_sets, cli_in_process
from owai.data.camelyon17 import Camelyon17, GroupSampler, StandardSampler, UniformGroupSampler, evaluate
from owai.errors import OwaiError
from owai.methods.camelyon17 import average_heads, round_groups, synthesis_groups


def tiny(root: Path) -> list[str]:
    """Settings that shrink the pipeline to seconds (the miniature is 16x16 pixels)."""
    return [f"data.root={root}", "data.fraction=1.0", "data.image_size=16", "data.batch_size=8", "data.workers=0",
            "data.cache_images=true", "data.eval_batch_size=64", "model.arch=densenet-tiny", "train.epochs=2",
            "bonsai.synthesis_epochs=2", "train.lr=0.05", "bonsai.synthesis_lr=0.05", "runtime.threads=2"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return make_camelyon(tmp_path_factory.mktemp("camelyon"))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))


def test_splits_centres_and_labels(tree):
    data = Camelyon17(tree, image_size=16)
    assert {s: data.split(s).numel() for s in ("train", "id_val", "val", "test")} == {
        "train": 48, "id_val": 12, "val": 12, "test": 12}
    assert set(data.centers[data.split("train")].tolist()) == {0, 3, 4}
    assert set(data.centers[data.split("id_val")].tolist()) == {0, 3, 4}
    assert set(data.centers[data.split("val")].tolist()) == {1}
    assert set(data.centers[data.split("test")].tolist()) == {2}
    rows = list(csv.DictReader(open(tree / "camelyon17_v1.0" / "metadata.csv")))
    assert data.labels.tolist() == [int(r["tumor"]) for r in rows]
    assert data.files[0] == "patient_000_node_0/patch_patient_000_node_0_x_0_y_0.png"
    x = data.tensor(int(data.split("test")[0]))
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32
    m = evaluate(torch.tensor([1, 1, 0, 0]), torch.tensor([1, 0, 0, 0]), torch.tensor([0, 0, 1, 1]))
    assert m.acc == 0.75 and m.acc_wg == 0.5
    half = Camelyon17(tree, fraction=0.5)
    assert half.split("train").numel() == 24 and set(half.split("train").tolist()) <= set(data.split("train").tolist())


def test_group_loader_composition_and_determinism():
    hospitals = torch.tensor([0] * 10 + [3] * 7 + [4] * 20)
    sampler = GroupSampler(hospitals, 32, 2, seed=5, stage="downstream")
    seen = set()
    for step in range(30):
        pos = sampler.positions(step)
        g = hospitals[pos]
        assert pos.numel() == 32 and g[:16].unique().numel() == 1 and g[16:].unique().numel() == 1
        assert g[0] != g[16]
        seen.add(tuple(sorted((int(g[0]), int(g[16])))))
        for half in (slice(0, 16), slice(16, 32)):  # hospital 4 is larger than a half-batch: no repeats in its half
            if int(g[half][0]) == 4:
                assert pos[half].unique().numel() == 16
        assert torch.equal(pos, GroupSampler(hospitals, 32, 2, seed=5, stage="downstream").positions(step))
    assert seen == {(0, 3), (0, 4), (3, 4)}  # uniform over hospital pairs
    assert not torch.equal(sampler.positions(0), GroupSampler(hospitals, 32, 2, seed=6, stage="downstream").positions(0))
    std = StandardSampler(37, 8, seed=0, stage="round0")
    epoch = torch.cat([std.positions(s) for s in range(std.steps_per_epoch)])
    assert epoch.unique().numel() == epoch.numel() == 32  # a permutation, 4 full batches
    groups = torch.tensor([0] * 95 + [1] * 5)
    drawn = torch.cat([UniformGroupSampler(groups, 32, 0, "round1").positions(s) for s in range(20)])
    assert 0.35 < float((groups[drawn] == 1).float().mean()) < 0.65  # groups sampled uniformly, not by size
    with pytest.raises(OwaiError, match="1 group"):
        GroupSampler(torch.zeros(5, dtype=torch.long), 4, 2, 0, "x")


def test_pseudo_label_groups_and_replication():
    y = torch.tensor([0, 1, 1, 0])
    pred0, pred1 = torch.tensor([0, 0, 1, 1]), torch.tensor([1, 1, 1, 0])
    examples, groups = round_groups([pred0, pred1], y)
    assert examples.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]  # the dataset once per earlier round
    assert groups.tolist() == [0, 1, 0, 1, 3, 2, 2, 2]  # (pred_j XOR y) + 2j
    pseudo = torch.stack([pred0, pred1])
    assert synthesis_groups(pseudo, y, "old").tolist() == [0, 0, 1, 0]  # all rounds correct vs rest
    assert synthesis_groups(pseudo, y, "balance").tolist() == [0, 0, 1, 0]
    assert synthesis_groups(torch.stack([pred0, pred0]), y, "balance").tolist() == [1, 1, 1, 1]


def test_head_averaging():
    weight = torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(6, 4)  # K = 3 heads of Linear(4, 2)
    bias = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    w, b = average_heads(weight, bias)
    assert w.shape == (2, 4) and b.tolist() == [3.0, 4.0]
    assert torch.equal(w[0], (weight[0] + weight[2] + weight[4]) / 3)
    assert torch.equal(w[1], (weight[1] + weight[3] + weight[5]) / 3)


@pytest.mark.parametrize("case, message", [
    ("no-metadata", "run `owai data fetch camelyon17 --data-root"),
    ("missing-patch", "is missing"),
    ("empty-split", "split 'test' is empty"),
    ("bad-column", "lacks column(s) tumor"),
])
def test_bad_input_is_one_line_error(case, message, tmp_path, capsys):
    root = make_camelyon(tmp_path / "data", train_per_center=2, id_val_per_center=1, eval_per_center=2)
    base = root / "camelyon17_v1.0"
    if case == "no-metadata":
        (base / "metadata.csv").unlink()
    elif case == "missing-patch":
        next((base / "patches").rglob("*.png")).unlink()
    else:
        lines = (base / "metadata.csv").read_text().splitlines()
        if case == "empty-split":
            lines = [lines[0]] + [l for l in lines[1:] if l.split(",")[7] != "2"]
        else:
            lines = [l.replace("tumor", "tumour") if i == 0 else l for i, l in enumerate(lines)]
        (base / "metadata.csv").write_text("\n".join(lines) + "\n")
    code, out, err = cli_in_process(["bonsai", "--dataset", "camelyon17", "--out", str(tmp_path / "runs"),
                                     *as_sets(tiny(root))], capsys)
    assert code != 0 and message in err and "Traceback" not in err + out
    assert len([l for l in err.splitlines() if l.strip()]) == 1


def test_more_groups_per_batch_than_training_hospitals_is_refused_before_the_run(tmp_path, capsys):
    """The group loader draws n_groups_per_batch distinct hospitals; Camelyon17's training split has 3."""
    root = make_camelyon(tmp_path / "data", train_per_center=2, id_val_per_center=1, eval_per_center=2)
    code, out, err = cli_in_process(["bonsai", "--dataset", "camelyon17", "--out", str(tmp_path / "runs"),
                                     *as_sets([*tiny(root), "data.n_groups_per_batch=4", "data.batch_size=8"])], capsys)
    assert code == 2 and "the training split has 3 hospital(s)" in err, err + out
    assert len([l for l in err.splitlines() if l.strip()]) == 1
    assert not (tmp_path / "runs").exists()


def _final_state(run_dir: Path, stage: str) -> dict[str, torch.Tensor]:
    from owai.checkpoint import latest_checkpoint, load_checkpoint

    return load_checkpoint(latest_checkpoint(run_dir / "checkpoints" / stage))[1]["model"]


def test_pipeline_end_to_end_with_the_study(tree, tmp_path):
    """ERM round, GroupDRO round, synthesis, frozen downstream (cached and reference BN), then the
    IID/OOD selection of the study over two seeds."""
    from safetensors.torch import load_file

    from owai import sweep as sweeps
    from owai.experiment import execute
    from owai.methods.camelyon17 import study_table, write_study

    sets = tiny(tree)
    run, results = execute("table2.6-camelyon17", "cpu", sets + ["init=bonsai-cf", "method=irm", "penalty.weight=10.0"],
                           out=tmp_path / "runs")
    measured = {r["metric"]: r["measured"] for r in results["rows"]}
    for key in ("round0.test_acc", "round1.test_acc", "test_acc.iid", "test_acc.ood", "id_val_acc.iid", "val_acc.ood",
                "synthesis.pseudo_acc.train"):
        assert 0.0 <= measured[key] <= 1.0, key
    assert measured["round0.test_acc"] > 0.7  # colour is learnable
    details = results["details"]
    assert len(details["downstream"]["curves"]) == 2 and details["downstream_setup"]["cached_features"]
    caches = details["caches"]
    assert {"round0", "round1", "synthesis", "features"} <= set(caches) and all(Path(p).is_file() for p in caches.values())
    for stage in ("round0", "round1", "synthesis", "downstream"):
        assert (run.path / "checkpoints" / stage).is_dir()
    assert set(_final_state(run.path, "downstream")) == {"weight", "bias"}  # cached features: only the head trains

    # the reference's frozen featurizer (BN in train mode): parameters bit-identical, running stats move
    run2, results2 = execute("table2.6-camelyon17", "cpu", sets + ["init=bonsai-cf", "downstream.frozen_bn=train"],
                             out=tmp_path / "runs")
    assert not (run2.path / "checkpoints" / "round0").exists()  # the rounds came from the cache
    synthesis = {k[len("state."):]: v for k, v in load_file(caches["synthesis"]).items()}
    trained = _final_state(run2.path, "downstream")
    feats = [k for k in trained if k.startswith("features.")]
    assert all(torch.equal(trained[k], synthesis[k]) for k in feats if "running" not in k and "num_batches" not in k)
    assert any(not torch.equal(trained[k], synthesis[k]) for k in feats if "running_mean" in k)
    assert not torch.equal(trained["classifier.weight"], average_heads(synthesis["classifier.weight"],
                                                                       synthesis["classifier.bias"])[0])

    grid = [{"init": ["rand"], "method": ["erm"]},
            {"init": ["bonsai-cf"], "rounds": [2], "method": ["irm"], "penalty.weight": [1.0, 100.0]}]
    plan = sweeps.create("table2.6-camelyon17", "cpu", sets, seeds=[0, 1], out=tmp_path / "study", grid=grid)
    summary = sweeps.write_summary(plan, sweeps.run(plan, "local", 1))
    assert summary["counts"].get("complete") == 6
    rows, info = write_study(plan, summary)
    by_label = {r["label"]: r for r in rows}
    assert set(by_label) == {"- / ERM", "2-Bonsai-cf / IRMv1"}
    irm = by_label["2-Bonsai-cf / IRMv1"]
    cells = {json.dumps(g["grid"].get("penalty.weight")): {m["metric"]: m["mean"] for m in g["metrics"]}
             for g in summary["groups"] if g["grid"].get("method") == "irm"}
    best_iid = max(cells.values(), key=lambda m: m["id_val_acc.iid"])
    assert irm["iid"]["mean"] == pytest.approx(best_iid["test_acc.iid"]) and irm["iid"]["seeds"] == 2
    assert irm["iid"]["thesis"] == pytest.approx(0.780) and irm["ood"]["thesis"] == pytest.approx(0.791)
    assert by_label["- / ERM"]["iid"]["thesis"] == pytest.approx(0.666)
    assert [r["round"] for r in info["rounds"]] == [0, 1] and info["rounds"][0]["seeds"] == 2
    assert Path(info["figure"]).is_file() and (plan.path / "camelyon17.md").is_file()
    assert "2-Bonsai-cf / IRMv1" in (plan.path / "camelyon17.md").read_text()
    assert study_table(rows, info["title"]).row_count == 2


def test_table_2_6_names_a_penalty_from_scratch_its_erm_row():
    """TH 2.3.4: the ERM-initialised rows pre-train with ERM for penalty.anneal_iters steps of the
    same run, from scratch (RFC's camelyon17_irm.sh); init erm (round 0's trained network) is owai's
    extra and says so."""
    from owai.methods.camelyon17 import init_label

    assert init_label("rand", "", None, "erm") == "-"
    assert init_label("rand", "", None, "irm") == "ERM"
    assert init_label("erm", "", None, "vrex") == "ERM (round 0)"
    assert init_label("bonsai-cf", 2, None, "irm") == "2-Bonsai-cf"


def test_figure_2_9_leaves_lambda_zero_off_its_log_axis():
    from owai.methods.camelyon17 import plot_study

    def group(weight: float, test: float) -> dict:
        return {"grid": {"init": "bonsai-cf", "rounds": 2, "method": "irm", "penalty.weight": weight},
                "metrics": [{"metric": m, "mean": v, "values": [v]} for m, v in
                            (("id_val_acc.iid", 0.9), ("test_acc.iid", test), ("val_acc.ood", 0.8), ("test_acc.ood", test))]}

    fig = plot_study({"groups": [group(0.0, 0.5), group(1.0, 0.6), group(10.0, 0.7)]}, "t")
    left = fig.axes[0]
    xs = sorted({x for line in left.get_lines() for x in line.get_xdata()})
    assert xs == [1.0, 10.0]


@pytest.mark.parametrize("recipe, key, values", [
    ("tableA.13-synthesis-wd", "bonsai.synthesis_weight_decay", [1e-6, 1e-2]),
    ("tableA.15-head-init", "bonsai.head", ["average", "random"]),
])
def test_appendix_a10_studies_keep_a_row_per_variant(recipe, key, values, tree, tmp_path):
    """Tables A.13 / A.15 vary a setting beside init and method: the study keeps one row per value
    (labelled with it, with its own thesis numbers), and A.13's rows carry the synthesis's accuracy
    on its pseudo-labels (Table A.14)."""
    from owai import sweep as sweeps
    from owai.methods.camelyon17 import write_study

    plan = sweeps.create(recipe, "cpu", tiny(tree), seeds=[0], out=tmp_path / "study")
    summary = sweeps.write_summary(plan, sweeps.run(plan, "local", 1))
    assert summary["counts"].get("complete") == 6
    rows, _ = write_study(plan, summary)
    by_label = {r["label"]: r for r in rows}
    short = key.split(".")[-1]
    assert set(by_label) == {f"2-Bonsai-cf / {m} [{short}={v}]" for m in ("ERM", "vREx") for v in values}
    first, last = (by_label[f"2-Bonsai-cf / vREx [{short}={v}]"] for v in values)
    assert first[key] == values[0] and last[key] == values[1]
    expected = {"tableA.13-synthesis-wd": (0.795, 0.758), "tableA.15-head-init": (0.795, 0.797)}[recipe]
    assert (first["ood"]["thesis"], last["ood"]["thesis"]) == pytest.approx(expected)
    if recipe == "tableA.13-synthesis-wd":
        assert 0.0 <= first["synthesis_pseudo_acc"]["train"] <= 1.0
        caches = {json.loads((Path(pt["run_dir"]) / "results.json").read_text())["details"]["caches"]["synthesis"]
                  for pt in summary["points"]}
        assert len(caches) == 2  # a synthesis per weight decay, each its own cache entry
    study = json.loads((plan.path / "camelyon17.json").read_text())
    assert {c["verdict"] for c in study["claims"]} == {"n/a"}  # judged at the paper preset only
    legend = [t.get_text() for t in info_figure_legend(plan.path)]
    assert f"vREx, 2-Bonsai-cf [{short}={values[0]}], OOD tune" in legend  # init and rounds from the params


def info_figure_legend(sweep_dir: Path) -> list:
    """The Figure 2.9 legend of a study, drawn again from its summary."""
    from owai.methods.camelyon17 import plot_study

    summary = json.loads((sweep_dir / "summary.json").read_text())
    return plot_study(summary, "t").axes[0].get_legend().get_texts()


def test_a_setting_one_rows_grid_fixes_is_not_a_variant():
    """Table 2.6's CLOvE-from-scratch grid fixes the kernel width at 0.2: its row stays "ERM / CLOvE",
    in Table 2.6's order; a key with several values in one row's groups is a variant."""
    from owai.methods.camelyon17 import _variant_order, variant_keys

    groups = [{"grid": {"init": "rand", "method": "clove", "penalty.weight": w, "penalty.clove_width": 0.2}}
              for w in (0.1, 1.0)]
    assert variant_keys(groups, {}) == set()
    groups += [{"grid": {"init": "bonsai-cf", "method": "erm", "bonsai.synthesis_weight_decay": wd}} for wd in (1e-2, 1e-6)]
    assert variant_keys(groups, {}) == {"bonsai.synthesis_weight_decay"}
    assert sorted([{"w": 1e-2}, {"w": 1e-6}, {"w": 1e-4}], key=_variant_order) == [{"w": 1e-6}, {"w": 1e-4}, {"w": 1e-2}]


def _fetch_from(tmp_path: Path, monkeypatch, archive: Path, capsys) -> tuple[int, str, str]:
    from conftest import cli_in_process
    from owai.data import camelyon17

    monkeypatch.setattr(camelyon17, "DOWNLOAD_URL", archive.as_uri())
    return cli_in_process(["data", "fetch", "camelyon17", "--data-root", str(tmp_path / "data")], capsys)


def test_a_download_that_is_not_an_archive_is_one_line_and_leaves_nothing(tmp_path: Path, monkeypatch, capsys) -> None:
    page = tmp_path / "page.html"
    page.write_text("<html>maintenance</html>")
    code, _, err = _fetch_from(tmp_path, monkeypatch, page, capsys)
    assert code == 2 and err.startswith("error: ") and "is not a readable tar.gz archive" in err and err.count("\n") == 1, err
    assert not (tmp_path / "data" / "camelyon17").exists()


def test_an_archive_member_outside_plain_files_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    """WILDS publishes no checksum: an archive with a link (the way out of tarfile's data filter on
    older Pythons) is refused before anything of it is written."""
    import io
    import tarfile

    archive = tmp_path / "camelyon17_v1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        link = tarfile.TarInfo("camelyon17_v1.0/escape")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc"
        tar.addfile(link)
        data = b"patch,node\n"
        info = tarfile.TarInfo("camelyon17_v1.0/metadata.csv")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    code, _, err = _fetch_from(tmp_path, monkeypatch, archive, capsys)
    assert code == 2 and "member 'camelyon17_v1.0/escape' is not a plain file or folder" in err, err
    assert not (tmp_path / "data" / "camelyon17").exists()


def test_mirror_is_refused_where_it_would_be_ignored(tmp_path: Path, capsys) -> None:
    from conftest import cli_in_process

    code, _, err = cli_in_process(["data", "fetch", "camelyon17", "--mirror", "https://example.org/",
                                   "--data-root", str(tmp_path)], capsys)
    assert code == 2 and "--mirror is for datasets downloaded from checked URLs" in err, err
