"""ColoredMNIST trainer (`owai bonsai`, recipe table2.4-coloredmnist): the reference MLP, the loop's
optimizer-reset / after-step hooks, an end-to-end run on the offline split, ERM learning the
colour, resume equality, and the one-line errors for impossible or not-yet-implemented settings."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import cli_in_process
from owai.checkpoint import latest_checkpoint, load_checkpoint
from owai.errors import OwaiError
from owai.experiment import execute
from owai.models.mlp import ColoredMNISTMLP, MLPConfig, n_parameters
from owai.runs import Run
from owai.train import LoopConfig, train_loop

RECIPE = "table2.4-coloredmnist"
# the thesis's model (hidden 390) and optimiser, shortened: ERM learns the colour within 10 steps
TINY = ["method=erm", "train.steps=12", "train.eval_every=4", "train.checkpoint_every=4", "train.log_every=4"]


def test_mlp_shapes_parameters_and_init():
    torch.manual_seed(0)
    model = ColoredMNISTMLP()
    assert n_parameters(model) == 392 * 390 + 390 + 390 * 390 + 390 + 390 + 1 == 306_151
    x = torch.rand(5, 2, 14, 14)
    z, logits = model.features_and_logits(x)
    assert z.shape == (5, 390) and logits.shape == (5, 1) and (z >= 0).all()
    torch.testing.assert_close(model(x.reshape(5, -1)), logits)  # flat rows work too
    for lin in (model.featurizer.lin1, model.featurizer.lin2, model.head):
        assert (lin.bias == 0).all()
        bound = (6 / (lin.in_features + lin.out_features)) ** 0.5  # xavier_uniform
        assert lin.weight.abs().max() <= bound and lin.weight.abs().max() > 0.9 * bound
    two = ColoredMNISTMLP(MLPConfig(hidden=16, n_targets=2))
    assert two(x).shape == (5, 2)


def test_frozen_featurizer_stays_bit_identical():
    torch.manual_seed(0)
    model = ColoredMNISTMLP(MLPConfig(hidden=32))
    model.freeze_featurizer()
    before = {k: v.clone() for k, v in model.featurizer.state_dict().items()}
    head_before = model.head.weight.clone()
    opt = torch.optim.Adam(model.trainable_parameters(), lr=1e-2)
    for _ in range(3):
        loss = model(torch.rand(8, 392)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert len(model.trainable_parameters()) == 2
    for k, v in model.featurizer.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not torch.equal(model.head.weight, head_before)


def test_train_loop_hooks_reset_optimizer_and_after_step(tmp_path):
    run = Run(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen, steps_at_reset = [], []

    def loss_at(step: int, micro: int = 0) -> torch.Tensor:
        if step == 3:  # the hook ran just before this update: Adam starts afresh
            steps_at_reset.extend(int(opt.state[p]["step"]) if opt.state[p] else 0 for p in model.parameters())
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
        return model(x).pow(2).mean()

    def after_step(done: int) -> None:
        seen.append((done, model.training))
        run.log("s", done, probe=float(done))

    train_loop(run, "s", model, opt, loss_at, LoopConfig(steps=5, checkpoint_every=2, log_every=1),
               reset_optimizer_at=lambda step: step == 3, after_step=after_step)
    assert seen == [(d, True) for d in range(1, 6)]
    assert steps_at_reset == [0, 0]  # the state was cleared before update 3
    assert int(opt.state[model.weight]["step"]) == 2  # updates 3 and 4 (0-based) after the reset
    assert [r["step"] for r in run.metrics() if "probe" in r] == [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def erm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    run, results = execute(RECIPE, "tiny", TINY, out=out)
    return run, results


def test_end_to_end_results_hold_the_test_environments(erm_run):
    run, results = erm_run
    saved = json.loads((run.path / "results.json").read_text())
    rows = {r["metric"]: r for r in saved["rows"]}
    for name in ("train_acc", "test_acc.flip0.9", "test_acc.flip0.1", "test_acc.flip0.5", "worst_test_acc",
                 "peek.worst_test_acc", "erm.rand.worst_test_acc"):
        assert rows[name]["measured"] is not None, name
    accs = [rows[f"test_acc.flip{f}"]["measured"] for f in ("0.9", "0.1", "0.5")]
    assert rows["worst_test_acc"]["measured"] == min(accs)
    assert rows["erm.rand.worst_test_acc"]["thesis"] == 0.273
    assert rows["oracle.worst_test_acc"]["measured"] is None and rows["oracle.worst_test_acc"]["thesis"] == 0.721
    details = saved["details"]
    assert details["data"]["train_sizes"] == [4000, 4000] and details["data"]["test_sizes"] == [2000] * 3
    assert [c["step"] for c in details["curve"]] == [1, 5, 9, 12]  # after update 1 + 4 i (the reference's step 4 i), and the last
    assert saved["command"].startswith("owai bonsai --recipe table2.4-coloredmnist --preset tiny")


def test_erm_learns_the_colour(erm_run):
    """Train accuracy near the colour's 85 % (above the 75 % that shape allows, the oracle's level),
    worst test environment (colour flipped 90 %) far below the oracle's ~72 %."""
    _, results = erm_run
    m = {r["metric"]: r["measured"] for r in results["rows"]}
    assert m["train_acc"] > 0.8
    assert m["worst_test_acc"] < 0.3 and m["test_acc.flip0.9"] == m["worst_test_acc"]
    assert m["test_acc.flip0.1"] > 0.85  # colour agrees with the label 90 % there


def _without_times(results: dict) -> dict:
    return {k: v for k, v in results.items() if k not in ("run_dir", "finished")}


def test_resume_reproduces_identical_results(erm_run):
    run, results = erm_run
    (run.path / "results.json").unlink()
    again_run, again = execute(resume=run.path)  # the finished stage is reloaded, not retrained
    assert _without_times(again) == _without_times(results)
    # resume from a mid-run checkpoint: the last one removed, training replays steps 9-12
    (run.path / "results.json").unlink()
    last = latest_checkpoint(run.path / "checkpoints" / "train")
    assert last is not None and last.name.endswith("12")
    shutil.rmtree(last)
    _, replayed = execute(resume=run.path)
    assert _without_times(replayed) == _without_times(results)
    curve_steps = [r["step"] for r in again_run.metrics() if "worst_test_acc" in r]
    assert curve_steps == [1, 5, 9, 12]  # no duplicated evaluation rows after the resumes


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["init=bonsai", "bonsai.rounds=0"], "bonsai.rounds must be >= 1"),
        (["init=bonsai-cf", "bonsai.rerm_steps=0"], "bonsai.rerm_steps must be >= 1"),
        (["dataset=camelyon17"], "dataset"),
        (["method=rsc", "init=bonsai"], "method 'rsc' runs with init rand or erm, not 'bonsai'"),
        (["method=pi", "init=erm"], "method 'pi' runs with init rand, not 'erm'"),
        (["method=pi", "penalty.options={steps1: 0}"], "pi steps1 must be an int >= 1"),
        (["perfect.steps=0", "init=perfect"], "perfect.steps must be >= 1"),
        (["method=nope"], "unknown invariance method 'nope'"),
        (["init=erm", "penalty.anneal_iters=0"], "init=erm needs penalty.anneal_iters"),
        (["init=erm", "penalty.anneal_iters=500", "train.steps=100"], "leaves no penalty step"),
        (["penalty.weight=abc"], "penalty.weight"),
        (["penalty.weight=-1"], "penalty weight must be a finite number >= 0"),
        (["penalty.options={unbiased: true, bogus: 1}"], "bogus"),
        (["data.train_size=-2"], "data.train_size must be 0 (every training image) or from 2 to the 8000"),
        (["data.train_size=9000"], "data.train_size must be 0 (every training image) or from 2 to the 8000"),
        (["data.train_size=many"], "data.train_size"),
    ],
)
def test_impossible_settings_fail_before_a_run_exists(tmp_path, overrides, fragment):
    with pytest.raises(OwaiError, match=None) as err:
        execute(RECIPE, "tiny", overrides, out=tmp_path / "runs")
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args, fragment", [
    (["--dataset", "mnist"], "--dataset 'mnist': choose from"),
    (["--init", "warm"], "params.init: expected one of 'rand' | 'erm' | 'bonsai' | 'bonsai-cf' | 'perfect', got 'warm'"),
    (["--study", "--init", "warm"], "has no sweep point with --init warm"),
    (["--method", "irm,vrex"], "one value per run (several need --study)"),
    (["--grid", "penalty.weight=1,2"], "--grid/--seeds/--workers/--executor need --study"),
    (["--executor", "submitit-debug"], "--grid/--seeds/--workers/--executor need --study"),
    (["--study", "--partition", "gpu"], "SLURM options (--partition, --gpus-per-node, ...) need --executor slurm"),
    (["--study", "--workers", "2", "--executor", "submitit-debug"], "--workers is for --executor local"),
    (["--method", "nope"], "unknown invariance method 'nope'"),
    (["--method", "irm", "--resume", "somewhere"], "--resume takes its config from the run or sweep directory"),
    (["--recipe", "three-moons"], "runs method 'three_moons', not coloredmnist, camelyon17 or twobits"),
    (["--method", "irm", "--set", "penalty.weight=high"], "penalty.weight"),
])
def test_cli_bad_options_are_one_line_errors(tmp_path, capsys, args, fragment):
    code, out, err = cli_in_process(["bonsai", *args, "--out", str(tmp_path / "runs")], capsys)
    assert code == 2, out + err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error:") and fragment in err, err
    assert not (tmp_path / "runs").exists()


SMALL = ["model.hidden=16", "train.steps=12", "train.eval_every=4", "train.checkpoint_every=4", "train.log_every=4"]


@pytest.mark.parametrize("sets", [
    ["method=groupdro"],  # group weights q: companion state
    ["method=lff", "init=erm", "penalty.anneal_iters=4"],  # biased copy + loss averages
    ["method=rsc", "init=erm", "penalty.anneal_iters=4"],
    ["method=pi", "penalty.options={steps1: 3}"],  # stage models, then RERM over their groups
    ["method=pi", "penalty.options={steps1: 9, stopping: validation, val_every: 3}"],  # best hold-out step
    ["method=irm", "init=perfect", "perfect.steps=3"],
])
def test_the_other_trainers_run_and_resume_bit_exactly(tmp_path, monkeypatch, sets):
    """RSC, LfF, GroupDRO, PI and the perfect initialisation train end to end; a run killed after
    step 8 resumes to the same weights as the uninterrupted run (companion state included)."""
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    run, results = execute(RECIPE, "tiny", sets + SMALL, out=tmp_path / "runs")
    method, init = sets[0].split("=")[1], next((s.split("=")[1] for s in sets if s.startswith("init=")), "rand")
    rows = {r["metric"]: r["measured"] for r in results["rows"]}
    assert rows[f"{method}.{init}.worst_test_acc"] is not None
    ckpts = run.path / "checkpoints" / "train"
    _, full = load_checkpoint(latest_checkpoint(ckpts))
    if method in ("groupdro", "lff"):
        assert full["companion"], "the penalty's state is checkpointed"
    if method == "lff":
        assert any(k.startswith("biased.") for k in full["model"])
        assert full["optimizer"]["param_groups"][0]["lr"] == pytest.approx(5e-4 * 0.01)
    if method == "pi":
        assert set(results["details"]["pi"]["groups"]) <= {"model1-env1-correct", "model1-env1-incorrect",
                                                           "model2-env2-correct", "model2-env2-incorrect"}
        assert (run.path / "checkpoints" / "pi.env1").is_dir() and (run.path / "checkpoints" / "pi.env2").is_dir()
        if "stopping: validation" in sets[1]:  # each stage model ends at its best hold-out score
            for k, chosen in enumerate(results["details"]["pi"]["stage_models"], start=1):
                scores = {r["step"]: r["val_score"] for r in run.metrics() if r.get("stage") == f"pi.env{k}"
                          and "val_score" in r}
                assert sorted(scores) == [3, 6, 9]
                best = max(scores.values())
                assert chosen["steps"] == min(s for s, v in scores.items() if v == best)
                assert chosen["holdout_acc"] == round(best, 4)
        for chosen in results["details"]["pi"]["stage_models"]:  # which feature each stage model uses
            assert 0 <= chosen["acc_colour_agrees"] <= 1 and 0 <= chosen["acc_colour_disagrees"] <= 1
        sizes, group_acc = results["details"]["pi"]["groups"], results["details"]["pi"]["group_acc"]
        assert list(group_acc) == list(sizes)
        # the groups split each training environment in two, so their size-weighted accuracy is the
        # pooled training accuracy
        pooled = sum(group_acc[g] * n for g, n in sizes.items()) / sum(sizes.values())
        assert pooled == pytest.approx(rows["train_acc"], abs=1e-3)
        logged = [r for r in run.metrics() if r.get("stage") == "train" and "worst_test_acc" in r]
        assert logged and all(set(f"group_acc.{g}" for g in sizes) <= set(r) for r in logged)
        assert {g: round(logged[-1][f"group_acc.{g}"], 4) for g in sizes} == group_acc  # the last step's
    shutil.rmtree(latest_checkpoint(ckpts))
    (run.path / "results.json").unlink()
    _, again = execute(resume=run.path)
    _, resumed = load_checkpoint(latest_checkpoint(ckpts))
    for k, v in full["model"].items():
        assert torch.equal(resumed["model"][k], v), k
    assert _without_times(again) == _without_times(results)


def test_pi_gray_stage_models_rely_on_shape(tmp_path, monkeypatch):
    """The `stage_data: gray` diagnostic trains PI's stage models on the gray variant (same images
    and labels): they cannot use the colour, so their accuracy hardly depends on whether the
    colour agrees with the label, unlike the reference's stage models on the coloured data."""
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    sets = ["method=pi", "dataset=inverse-coloredmnist", "model.hidden=64", "train.steps=2", "train.eval_every=1"]
    gaps = {}
    for stage_data in ("coloured", "gray"):
        _, results = execute(RECIPE, "tiny", sets + [f"penalty.options={{steps1: 30, stage_data: {stage_data}}}"],
                             out=tmp_path / stage_data)
        info = results["details"]["pi"]
        assert info["stage_data"] == stage_data
        gaps[stage_data] = [m["acc_colour_agrees"] - m["acc_colour_disagrees"] for m in info["stage_models"]]
    assert all(g > 0.5 for g in gaps["coloured"]), gaps  # 30 steps: colour models (0.99 / 0.02)
    assert all(abs(g) < 0.15 for g in gaps["gray"]), gaps


def test_cli_bad_mnist_directories_are_one_line_errors(tmp_path, capsys):
    """A missing MNIST directory and an images file with the labels' IDX magic: exit 2, one line,
    and no half-written run (the data are read before training)."""
    import gzip

    from owai.data.mnist import PACKAGED_DIR

    bad = tmp_path / "mnist"
    bad.mkdir()
    for f in PACKAGED_DIR.glob("t10k-*.gz"):
        (bad / f.name).write_bytes(f.read_bytes())
    images = bad / "t10k-images-idx3-ubyte.gz"
    payload = gzip.decompress(images.read_bytes())
    images.write_bytes(gzip.compress(b"\x00\x00\x08\x01" + payload[4:], compresslevel=1))
    for root, fragment in [(tmp_path / "nowhere", "nowhere"), (bad, "magic")]:
        code, out, err = cli_in_process(["bonsai", "-p", "tiny", "--set", f"data.root={root}", "--out", str(tmp_path / "runs")], capsys)
        assert code == 2, out + err
        lines = err.strip().splitlines()  # the files are read in validation: no run directory
        assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], err
        assert not (tmp_path / "runs").exists()
