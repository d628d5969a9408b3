"""Bonsai for ColoredMNIST (owai/methods/bonsai.py, spec §3.1): the RERM groups of every earlier
round, the agree/disagree balance trick, head averaging, the frozen featurizer staying bit-identical
through `init=bonsai-cf` training, and a tiny end-to-end run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from owai.checkpoint import latest_checkpoint, load_checkpoint
from owai.errors import OwaiError
from owai.experiment import execute
from owai.methods.bonsai import (BonsaiConfig, agreement_mask, average_heads, balanced_indices,
                                 build_representation, init_from, round_groups)
from owai.models.mlp import ColoredMNISTMLP, MLPConfig
from owai.runs import Run

RECIPE = "table2.4-coloredmnist"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test its own Bonsai cache (the cache would otherwise skip the stages under test)."""
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
TINY = ["method=erm", "init=bonsai-cf", "model.hidden=16", "train.steps=6", "train.eval_every=3",
        "train.checkpoint_every=3", "train.log_every=3", "bonsai.erm_steps=4", "bonsai.rerm_steps=4",
        "bonsai.synthesis_steps=4"]


def test_round_groups_for_two_rounds():
    c0 = torch.tensor([1, 1, 0, 0, 1, 0], dtype=torch.bool)
    c1 = torch.tensor([1, 0, 1, 0, 0, 0], dtype=torch.bool)
    groups = round_groups([c0, c1])
    assert len(groups) == 4
    members = [torch.nonzero(g).reshape(-1).tolist() for g in groups]
    assert members == [[2, 3, 5], [0, 1, 4], [1, 3, 4, 5], [0, 2]]  # incorrect_0, correct_0, incorrect_1, correct_1
    # each example lies in exactly one group per round (k = 2 of them)
    assert torch.stack(groups).sum(0).tolist() == [2] * 6


def test_agreement_mask_and_balance_trick():
    c0 = torch.tensor([1, 1, 0, 0, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    c1 = torch.tensor([1, 0, 0, 1, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    agree = agreement_mask([c0, c1])
    assert agree.tolist() == [True, False, True, False] + [True] * 6  # 8 agree, 2 disagree
    idx = balanced_indices(agree, torch.Generator().manual_seed(0))
    assert len(idx) == len(agree)
    picked = agree[idx]
    assert int(picked.sum()) == int((~picked).sum()) == 5  # equal weight to A and not-A
    assert set(idx[~picked].tolist()) <= {1, 3} and set(idx[picked].tolist()) <= {0, 2, 4, 5, 6, 7, 8, 9}
    # nothing to balance: all from the one side
    assert len(balanced_indices(torch.ones(5, dtype=torch.bool), torch.Generator().manual_seed(0))) == 5


def test_head_averaging_on_a_toy_and_through_the_pipeline(tmp_path):
    w = torch.tensor([[1.0, 2.0, 3.0], [3.0, 0.0, -1.0]])
    b = torch.tensor([0.5, -1.5])
    hw, hb = average_heads(w, b)
    assert torch.equal(hw, torch.tensor([[2.0, 1.0, 1.0]])) and torch.equal(hb, torch.tensor([-0.5]))

    gen = torch.Generator().manual_seed(0)
    envs = [SimpleNamespace(x=torch.rand(40, 2, 14, 14, generator=gen), y=(torch.rand(40, generator=gen) > 0.5).float())
            for _ in range(2)]
    run = Run(tmp_path)
    rep = build_representation(run, SimpleNamespace(train=envs), "coloredmnist",
                               BonsaiConfig(rounds=2, erm_steps=3, rerm_steps=3, synthesis_steps=3),
                               seed=0, hidden=8, lr=5e-4, l2=0.0011, device="cpu", checkpoint_every=3, log_every=1)
    _, state = load_checkpoint(latest_checkpoint(run.path / "checkpoints" / "bonsai.synthesis"))
    heads_w, heads_b = state["model"]["head.weight"], state["model"]["head.bias"]
    assert heads_w.shape == (2, 8)  # K = 2 heads of one logit
    torch.testing.assert_close(rep.head_weight, heads_w.mean(0, keepdim=True), rtol=0, atol=0)
    torch.testing.assert_close(rep.head_bias, heads_b.mean(0, keepdim=True), rtol=0, atol=0)
    model = ColoredMNISTMLP(MLPConfig(hidden=8))
    init_from(model, rep)
    assert torch.equal(model.head.weight, heads_w.mean(0, keepdim=True)) and torch.equal(model.head.bias, heads_b.mean(0, keepdim=True))
    for k, v in model.featurizer.state_dict().items():
        assert torch.equal(v, state["model"][f"featurizer.{k}"]), k
    assert [r["round"] for r in rep.details["rounds"]] == [0, 1]
    # a second call reloads the finished stages and gives the same representation
    again = build_representation(run, SimpleNamespace(train=envs), "coloredmnist",
                                 BonsaiConfig(rounds=2, erm_steps=3, rerm_steps=3, synthesis_steps=3),
                                 seed=0, hidden=8, lr=5e-4, l2=0.0011, device="cpu", checkpoint_every=3, log_every=1)
    assert torch.equal(again.head_weight, rep.head_weight) and torch.equal(again.featurizer["lin1.weight"], rep.featurizer["lin1.weight"])


def test_bonsai_cf_end_to_end_keeps_the_featurizer_bit_identical(tmp_path):
    run, results = execute(RECIPE, "tiny", TINY, out=tmp_path / "runs")
    saved = json.loads((run.path / "results.json").read_text())
    rows = {r["metric"]: r for r in saved["rows"]}
    assert rows["erm.bonsai-cf.worst_test_acc"]["measured"] is not None
    assert rows["erm.bonsai-cf.worst_test_acc"]["thesis"] == 0.356
    assert saved["details"]["frozen_featurizer"] is True
    assert [r["round"] for r in saved["details"]["bonsai"]["rounds"]] == [0, 1]
    ckpts = run.path / "checkpoints"
    for stage in ("bonsai.round0", "bonsai.round1", "bonsai.synthesis", "train"):
        assert latest_checkpoint(ckpts / stage) is not None, stage
    _, syn = load_checkpoint(latest_checkpoint(ckpts / "bonsai.synthesis"))
    _, down = load_checkpoint(latest_checkpoint(ckpts / "train"))
    feat = [k for k in down["model"] if k.startswith("featurizer.")]
    assert feat
    for k in feat:
        assert torch.equal(down["model"][k], syn["model"][k]), k  # bit-identical after head training
    head_init = syn["model"]["head.weight"].mean(0, keepdim=True)
    assert not torch.equal(down["model"]["head.weight"], head_init)  # the head did train
    assert len(down["optimizer"]["state"]) == 2  # Adam saw only the head's weight and bias


def test_bonsai_fine_tunes_the_featurizer_and_resumes_identically(tmp_path):
    overrides = [o.replace("init=bonsai-cf", "init=bonsai") for o in TINY]
    run, results = execute(RECIPE, "tiny", overrides, out=tmp_path / "runs")
    ckpts = run.path / "checkpoints"
    _, syn = load_checkpoint(latest_checkpoint(ckpts / "bonsai.synthesis"))
    _, down = load_checkpoint(latest_checkpoint(ckpts / "train"))
    assert not torch.equal(down["model"]["featurizer.lin1.weight"], syn["model"]["featurizer.lin1.weight"])
    assert results["details"]["frozen_featurizer"] is False
    (run.path / "results.json").unlink()
    _, again = execute(resume=run.path)  # every stage reloaded from its final checkpoint
    strip = lambda r: {k: v for k, v in r.items() if k not in ("run_dir", "finished")}  # noqa: E731
    assert strip(again) == strip(results)


def test_a_second_run_of_the_seed_loads_the_cached_representation(tmp_path):
    first, r1 = execute(RECIPE, "tiny", TINY, out=tmp_path / "runs")
    assert (first.path / "checkpoints" / "bonsai.round0").is_dir()  # built here
    cached = list((tmp_path / "cache" / "bonsai").glob("coloredmnist-seed0-*.safetensors"))
    assert len(cached) == 1
    second, r2 = execute(RECIPE, "tiny", [o.replace("method=erm", "method=vrex") for o in TINY], out=tmp_path / "runs")
    assert r2["details"]["bonsai"]["cache"] == str(cached[0])
    assert not (second.path / "checkpoints" / "bonsai.round0").exists()  # nothing rebuilt
    assert r2["details"]["bonsai"]["rounds"] == r1["details"]["bonsai"]["rounds"]
    # the same downstream run from the cache equals the one that built it
    third, r3 = execute(RECIPE, "tiny", TINY, out=tmp_path / "runs")
    assert r3["rows"] == r1["rows"]
    # the downstream L2 (the ERM rows' grid) does not touch the representation; bonsai.l2 does
    fourth, r4 = execute(RECIPE, "tiny", TINY + ["train.l2=0.01"], out=tmp_path / "runs")
    assert r4["details"]["bonsai"]["cache"] == str(cached[0])
    assert not (fourth.path / "checkpoints" / "bonsai.round0").exists()
    assert r4["details"]["l2"] == 0.01
    head = lambda run: load_checkpoint(latest_checkpoint(run.path / "checkpoints" / "train"))[1]["model"]  # noqa: E731
    assert head(fourth).keys() == head(first).keys()
    assert any(not torch.equal(head(fourth)[k], head(first)[k]) for k in head(first))  # the L2 reached the head
    execute(RECIPE, "tiny", TINY + ["bonsai.l2=0.01"], out=tmp_path / "runs")
    assert len(list((tmp_path / "cache" / "bonsai").glob("*.safetensors"))) == 2
    # another seed is another representation
    execute(RECIPE, "tiny", TINY + ["seed=1"], out=tmp_path / "runs")
    assert len(list((tmp_path / "cache" / "bonsai").glob("*.safetensors"))) == 3
    cached[0].write_bytes(b"garbage")  # a damaged entry is rebuilt (owai.io.read_cache_entry), to the same one
    rebuilt, r5 = execute(RECIPE, "tiny", TINY, out=tmp_path / "runs")
    assert (rebuilt.path / "checkpoints" / "bonsai.round0").is_dir() and r5["rows"] == r1["rows"]
    assert r5["details"]["bonsai"]["cache"] == str(cached[0]) and cached[0].read_bytes()[:8] != b"garbage"


def test_selection_across_restarts_is_the_best_mean_over_restarts():
    from owai.methods.coloredmnist import select_across_restarts

    def rec(weight, seed, curve):
        return {"searched": {"penalty.weight": weight}, "seed": seed, "curve": curve}

    records = [rec(1.0, 0, {1: 0.50, 21: 0.70}), rec(1.0, 1, {1: 0.60, 21: 0.50}),  # means 0.55, 0.60
               rec(2.0, 0, {1: 0.90, 21: 0.20}), rec(2.0, 1, {1: 0.40, 21: 0.30, 41: 0.99})]  # 0.65, 0.25
    best = select_across_restarts(records)
    assert best["searched"] == {"penalty.weight": 2.0} and best["step"] == 1  # step 41 is not in every restart
    assert best["mean"] == pytest.approx(0.65) and best["std"] == pytest.approx(0.25)  # population std
    assert best["values"] == [0.90, 0.40] and best["n"] == 2
    # a single per-restart peak (0.90) does not win over a better mean
    assert select_across_restarts([rec(1.0, 0, {1: 0.5}), rec(1.0, 1, {1: 0.5})])["std"] == 0.0


def test_a12_window_keeps_only_table_a12_grid_steps():
    """Table A.12: steps 1 + k * i with i <= 24, k the table's multiplier for (init, method), for its
    penalised methods on ColoredMNIST; evaluations off that grid or after it are dropped. ERM, PI,
    init perfect and InverseColoredMNIST keep their whole curves. The selection then cannot pick a
    step outside the grid."""
    from owai.methods.coloredmnist import a12_window, select_across_restarts

    curve = {1: 0.5, 3: 0.52, 25: 0.55, 31: 0.56, 61: 0.57, 461: 0.6, 481: 0.7, 501: 0.9, 721: 0.91, 1001: 0.95}

    def rec(method, dataset="coloredmnist", init="rand"):
        return {"method": method, "dataset": dataset, "init": init, "curve": dict(curve), "searched": {}, "seed": 0}

    assert list(a12_window(rec("irm"))["curve"]) == [1, 61, 461, 481]  # 20 i, i <= 24: up to 481
    assert list(a12_window(rec("irm", init="erm"))["curve"]) == [1, 61, 461, 481]
    assert list(a12_window(rec("clove"))["curve"]) == [1, 31, 61, 481, 721]  # 30 i from Rand: up to 721
    assert list(a12_window(rec("clove", init="bonsai-cf"))["curve"]) == [1, 61, 461, 481]  # 20 i there
    assert list(a12_window(rec("irm", init="bonsai-cf"))["curve"]) == [1, 501, 1001]  # 125 i: up to 3001
    assert list(a12_window(rec("fishr", init="bonsai"))["curve"]) == [1, 3, 25]  # 1 i: up to 25
    assert list(a12_window(rec("vrex", init="bonsai"))["curve"]) == [1, 3, 25, 31]  # 2 i: up to 49
    assert a12_window(rec("erm"))["curve"] == curve and a12_window(rec("pi"))["curve"] == curve
    assert a12_window(rec("irm", init="perfect"))["curve"] == curve
    assert a12_window(rec("irm", "inverse-coloredmnist"))["curve"] == curve
    assert list(a12_window(rec("irm", "coloredmnist-gray"))["curve"]) == [1, 61, 461, 481]
    assert select_across_restarts([a12_window(rec("vrex"))])["step"] == 481
    assert select_across_restarts([rec("vrex")])["step"] == 1001


def test_single_run_peek_uses_the_same_grid():
    """A run's own peek (its table metric) follows the study's rule: Table A.12's grid for IRMv1,
    every evaluation for ERM."""
    from owai.methods.coloredmnist import ColoredMNISTConfig, headline

    curve = [{"step": s, "worst_test_acc": a} for s, a in ((1, 0.3), (11, 0.9), (21, 0.5), (31, 0.4))]
    final = {"worst_test_acc": 0.4}
    irm = headline(ColoredMNISTConfig(method="irm", init="rand"), final, curve)
    assert irm["peek.step"] == 21 and irm["irm.rand.worst_test_acc"] == 0.5
    erm = headline(ColoredMNISTConfig(method="erm", init="rand"), final, curve)
    assert erm["peek.step"] == 11 and erm["erm.rand.worst_test_acc"] == 0.9


def test_study_restricts_the_grid_and_writes_table_and_figure(tmp_path, capsys):
    from conftest import cli_in_process
    from owai.commands.bonsai import restricted_grid

    grid = restricted_grid(RECIPE, "tiny", {"method": ["erm", "irm"], "init": ["rand", "bonsai-cf"]})
    assert {"method": ["irm"], "init": ["rand"]} in grid and {"dataset": ["coloredmnist-gray"], "method": ["erm"], "init": ["rand"]} in grid
    assert all(set(g["init"]) <= {"rand", "bonsai-cf"} for g in grid)
    # 41 steps evaluated every 10, of which Table A.12's 20 i grid keeps steps 1, 21 and 41 for
    # IRMv1 (ERM keeps all five); --grid also shortens the grid's own head lengths (1001/3001)
    longer = {"train.steps=6": "train.steps=41", "train.eval_every=3": "train.eval_every=10"}
    tiny = [a for s in TINY[2:] for a in ("--set", longer.get(s, s))]  # no anneal_iters: no point has init erm
    short = ["--grid", "train.steps=41", "--grid", "train.eval_every=10"]
    code, out, err = cli_in_process(["bonsai", "--study", "-p", "tiny", "--method", "erm,irm", "--init", "rand,bonsai-cf", "--seeds", "0,1",
                                     *tiny, *short, "--out", str(tmp_path / "runs"), "-q", "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    cells = {(r["dataset"], r["method"], r["init"]) for r in report["rows"]}
    assert cells == {("coloredmnist", m, i) for m in ("erm", "irm") for i in ("rand", "bonsai-cf")} | {("coloredmnist-gray", "erm", "rand")}
    sweep_dir = tmp_path / "runs" / RECIPE
    (study,) = list(sweep_dir.glob("sweep-*"))
    assert (study / "bonsai.md").is_file() and (study / "figures" / "bonsai.png").is_file()
    saved = json.loads((study / "bonsai.json").read_text())
    assert saved["rows"] == report["rows"]
    row = next(r for r in report["rows"] if (r["method"], r["init"]) == ("irm", "rand"))
    assert row["n"] == 2 and row["thesis"] == 0.540 and row["metric"] == "irm.rand.worst_test_acc"
    def rand_points(method):  # the two restarts of (coloredmnist, method, rand), not the gray oracle
        return [p for p in (study / "points").iterdir() if f"method={method}_init=rand" in p.name and "gray" not in p.name]

    def curves_of(method):
        return [{c["step"]: c["worst_test_acc"] for c in json.loads((p / "results.json").read_text())["details"]["curve"]}
                for p in rand_points(method)]

    # the chosen step's mean is the best mean over the two restarts' common evaluation steps
    curves = curves_of("irm")
    assert len(curves) == 2 and len(rand_points("erm")) == 2
    assert sorted(curves[0]) == [1, 11, 21, 31, 41]
    means = {s: (curves[0][s] + curves[1][s]) / 2 for s in (1, 21, 41)}  # selection on Table A.12's grid only
    assert row["step"] in means and row["mean"] == pytest.approx(max(means.values()))
    erm = next(r for r in report["rows"] if (r["method"], r["init"]) == ("erm", "rand"))
    erm_curves = curves_of("erm")
    erm_means = {s: (erm_curves[0][s] + erm_curves[1][s]) / 2 for s in erm_curves[0]}
    assert erm["mean"] == pytest.approx(max(erm_means.values()))  # ERM is not in Table A.12: every step
    assert len(list((tmp_path / "cache" / "bonsai").glob("*.safetensors"))) == 2  # one representation per seed
    # --resume of the finished study reruns nothing and rewrites the same table
    code, out2, err = cli_in_process(["bonsai", "--resume", str(study), "-q", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out2)["rows"] == report["rows"]
    # an off-grid step that beats every grid step is never selected for IRMv1; ERM may take it
    for point in rand_points("irm") + rand_points("erm"):
        results = json.loads((point / "results.json").read_text())
        for c in results["details"]["curve"]:
            c["worst_test_acc"] = 0.99 if c["step"] == 11 else c["worst_test_acc"]
        (point / "results.json").write_text(json.dumps(results))
    code, out3, err = cli_in_process(["bonsai", "--resume", str(study), "-q", "--json"], capsys)
    assert code == 0, err
    rows = {(r["dataset"], r["method"], r["init"]): r for r in json.loads(out3)["rows"]}
    assert rows["coloredmnist", "irm", "rand"]["step"] == row["step"] != 11
    assert rows["coloredmnist", "erm", "rand"]["step"] == 11 and rows["coloredmnist", "erm", "rand"]["mean"] == pytest.approx(0.99)


def test_validation_stopping_keeps_each_phase_best_validated_weights(tmp_path):
    """bonsai.stopping=validation: a keyed hold-out scores every phase every val_every steps; the
    phase ends with its best-scoring weights (the logged maximum), the hold-out is not trained on,
    and a second call reloads the same representation."""
    from owai.data.colored_mnist import load_colored_mnist

    data = load_colored_mnist("coloredmnist", 0, "test")
    run = Run.create(tmp_path / "runs", "t", {"x": 1})
    cfg = BonsaiConfig(rounds=2, erm_steps=6, rerm_steps=6, synthesis_steps=6, stopping="validation", val_every=2)
    rep = build_representation(run, data, "coloredmnist", cfg, seed=0, hidden=8, lr=5e-3, l2=0.0011, device="cpu",
                               checkpoint_every=3, log_every=3)
    scores = {}
    for r in run.metrics():
        if "val_score" in r:
            scores.setdefault(r["stage"], {})[r["step"]] = r["val_score"]
    phases = rep.details["rounds"] + [dict(rep.details["synthesis"], round="synthesis")]
    for stage, phase in zip(("bonsai.round0", "bonsai.round1", "bonsai.synthesis"), phases):
        assert sorted(scores[stage]) == [2, 4, 6]
        best = max(scores[stage].values())
        assert phase["val_score"] == pytest.approx(best, abs=1e-4)
        assert phase["best_step"] == min(s for s, v in scores[stage].items() if v == best)  # ties: the earlier
    again = build_representation(run, data, "coloredmnist", cfg, seed=0, hidden=8, lr=5e-3, l2=0.0011, device="cpu",
                                 checkpoint_every=3, log_every=3)
    assert torch.equal(again.featurizer["lin1.weight"], rep.featurizer["lin1.weight"]) and again.details == rep.details


def test_validation_stopping_changes_the_cache_key_and_validates_settings(tmp_path):
    from owai.methods.bonsai import representation_key

    fixed, val = BonsaiConfig(), BonsaiConfig(stopping="validation")
    assert representation_key("coloredmnist", fixed, seed=0) != representation_key("coloredmnist", val, seed=0)
    with pytest.raises(OwaiError, match=r"^params.bonsai.val_fraction must be in \[0, 1\], got 1.5$"):
        execute(RECIPE, "tiny", TINY + ["bonsai.stopping=validation", "bonsai.val_fraction=1.5"], out=tmp_path / "runs")
    with pytest.raises(OwaiError, match=r"^params.bonsai.l2 must be >= 0, got -1.0$"):
        execute(RECIPE, "tiny", TINY + ["bonsai.l2=-1"], out=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_train_size_keeps_old_cache_keys_and_changes_the_key_when_set():
    from owai.methods.bonsai import representation_key
    from owai.methods.coloredmnist import DataConfig, data_key

    def key(data: DataConfig) -> str:
        return representation_key("coloredmnist", BonsaiConfig(stopping="validation"), seed=0, hidden=390, lr=5e-4,
                                  l2=0.0011, data=data_key(data))

    # the key of this setting before data.train_size existed (computed with commit e0e586a)
    assert key(DataConfig(split="paper", root="/d")) == "bfd5adff95a0f563"
    assert key(DataConfig(split="paper", root="/d", train_size=8000)) != "bfd5adff95a0f563"


def test_study_points_run_through_submitit(tmp_path, capsys):
    """`--executor submitit-debug` (submitit's in-process cluster, SLURM's code path) runs a study's
    points as one job array and writes the same study; a run directory does not take --executor."""
    from conftest import cli_in_process

    tiny = [a for s in TINY[2:] if not s.startswith("bonsai.") for a in ("--set", s)]  # init rand reads no bonsai.*
    code, out, err = cli_in_process(["bonsai", "--study", "-p", "tiny", "--method", "irm", "--init", "rand", "--seeds", "0",
                                     "--executor", "submitit-debug", *tiny, "--out", str(tmp_path / "runs"), "-q", "--json"],
                                    capsys)
    assert code == 0, err
    (study,) = list((tmp_path / "runs" / RECIPE).glob("sweep-*"))
    assert any((study / "slurm").iterdir())  # submitit's job files
    assert [(r["method"], r["init"], r["n"]) for r in json.loads(out)["rows"]] == [("irm", "rand", 1)]
    assert (study / "bonsai.md").is_file()
    (point,) = list((study / "points").iterdir())
    for option in (["--executor", "submitit-debug"], ["--study"]):  # --study was ignored here
        code, _, err = cli_in_process(["bonsai", "--resume", str(point), *option], capsys)
        assert code == 2 and "a run directory resumes as the one run it is" in err, err


def test_fig_2_8_study_rows_record_the_drift_from_the_perfect_initialisation(tmp_path, capsys):
    """Fig 2.8 top: each (method, perfect) row carries the initialisation's own accuracy (the blue star,
    `start_acc`) and the accuracy at the last evaluated step (`last_acc`), means over restarts, and
    `owai report` judges perfect-drifts-away on them (start - last, the smallest over the methods, > 0)."""
    from conftest import cli_in_process

    sets = ["model.hidden=16", "train.steps=9", "train.eval_every=4", "train.checkpoint_every=4", "train.log_every=4",
            "perfect.steps=5"]
    code, out, err = cli_in_process(["bonsai", "--recipe", "fig2.8-init", "--study", "-p", "tiny", "--method", "irm,sd",
                                     "--init", "perfect", "--seeds", "0,1", *(a for s in sets for a in ("--set", s)),
                                     "--out", str(tmp_path / "runs"), "-q", "--json"], capsys)
    assert code == 0, err
    (study,) = list((tmp_path / "runs" / "fig2.8-init").glob("sweep-*"))
    rows = {r["method"]: r for r in json.loads((study / "bonsai.json").read_text())["rows"]}
    assert set(rows) == {"irm", "sd"}
    for method, row in rows.items():
        results = [json.loads((p / "results.json").read_text()) for p in (study / "points").iterdir()
                   if f"method={method}" in p.name]
        assert len(results) == 2 and row["n"] == 2
        starts = [r["details"]["perfect"]["worst_test_acc"] for r in results]
        lasts = [r["details"]["curve"][-1] for r in results]
        assert row["start_acc"] == pytest.approx(sum(starts) / 2)
        assert row["last_step"] == 9 and all(c["step"] == 9 for c in lasts)
        assert row["last_acc"] == pytest.approx(sum(c["worst_test_acc"] for c in lasts) / 2)
    code, out, err = cli_in_process(["report", str(study), "--json"], capsys)
    assert code == 0, err
    drift = next(v for v in json.loads(out)["claims"] if v["id"] == "perfect-drifts-away")
    smallest = min(rows[m]["start_acc"] - rows[m]["last_acc"] for m in ("irm", "sd"))
    assert drift["verdict"] == ("holds" if smallest > 0 else "misses")
    assert drift["numbers"][next(k for k in drift["numbers"] if k.startswith("min("))] == pytest.approx(smallest)
