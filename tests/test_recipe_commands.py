"""The command `owai recipes list` prints for each recipe starts that recipe as printed (issue #40).

Every printed command is parsed by the CLI itself (a missing required option fails here, as
"Missing option '--stage'" did for every rich-features recipe). Then it is validated as the run
would validate it, from an empty cache, without training: a rich-features recipe through the same
command with --dry-run (its whole chain: every pretrain sweep point, then each evaluation step),
any other recipe through the resolution and `validate` of its method (data not on this machine
may be missing: DataMissing, the run's own one-line refusal).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from conftest import as_sets, cli_in_process, parse_owai


def _printed() -> dict[str, str]:
    """Recipe id -> the command `owai recipes list` prints for it (implemented recipes)."""
    import io
    from contextlib import redirect_stdout

    from owai.cli import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        try:
            main(["recipes", "list", "--json"])
        except SystemExit as e:
            assert not e.code
    return {r["id"]: r["command"] for r in json.loads(buf.getvalue()) if r["command"]}


PRINTED = _printed()


def test_recipes_list_prints_a_command_for_each() -> None:
    assert len(PRINTED) >= 30
    rich = [rid for rid, cmd in PRINTED.items() if cmd.startswith("owai rich-features")]
    assert len(rich) == 12 and all("--stage" not in PRINTED[rid] for rid in rich)


@pytest.mark.parametrize("rid", sorted(PRINTED))
def test_printed_command_parses_and_validates(rid: str, shared_data: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from owai import recipes
    from owai.experiment import resolve

    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "empty-cache"))
    command = PRINTED[rid]
    words = shlex.split(command)
    assert words[0] == "owai"
    inputs = [w for w in words if w.endswith("...") and w[:-3].isupper()]  # what the user gives (MODELS...)
    _, params = parse_owai([str(tmp_path) if w in inputs else w for w in words[1:]])  # a UsageError fails the test
    rec = recipes.load(rid)
    if inputs:
        assert rid == "mosaic-eval"  # the one recipe that evaluates the user's own models
        code, _, err = cli_in_process([w for w in words[1:] if w not in inputs], capsys)
        assert code == 2 and "error: give the model directories" in err  # without them: refused in one line
    elif rec.method == "rich_features":
        assert params.get("stage") is None, command
        code, out, err = cli_in_process([*words[1:], "--dry-run", "--json"], capsys)
        assert code == 0, f"{command} --dry-run: {err}"
        steps = json.loads(out)
        chain = rec.params.get("chain") or [rec.params["stage"]]
        assert steps and steps[-1]["stage"] == chain[-1]
        assert len(steps) > 1 or chain == ["pretrain"]  # evaluation stages come with their pretraining
    else:  # settings are validated before the data is looked for; of these datasets only Camelyon17 is
        # not in the test data, and then the run would refuse in one line naming it (not an error here)
        missing = resolve(rec, None, [], missing_ok=True)[1].get("missing")
        assert missing is None or missing.startswith("Camelyon17-WILDS v1.0"), missing
    assert not list((tmp_path / "empty-cache").glob("pretrained/*"))  # validation trained nothing


def test_table22_chain_trains_networks_and_baselines_then_probes(shared_data: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The one command of Table 2.2 plans its 4 networks, the 4 baselines Table 2.2 needs, then the
    probe; networks already in the cache are skipped."""
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    code, out, err = cli_in_process(["rich-features", "--recipe", "table2.2-cat-probe", "--dry-run", "--json"], capsys)
    assert code == 0, err
    steps = json.loads(out)
    assert [s["stage"] for s in steps] == ["pretrain", "pretrain", "probe"]
    assert "--seeds 0,1,2,3" in steps[0]["command"]
    for variant in ("model.backbone=resnet18_w2", "model.backbone=resnet18_w4", "model.joint=2", "model.joint=4"):
        assert variant in steps[1]["command"]
    assert not any(s["cached"] for s in steps)

    from owai.experiment import resolve
    from owai.methods.rich_features import plan_chain
    from owai.recipes import load

    first = plan_chain("table2.2-cat-probe", None, [])[0]
    for path in first.entries:  # as if the 4 networks were trained
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    code, out, err = cli_in_process(["rich-features", "--recipe", "table2.2-cat-probe", "--dry-run", "--json"], capsys)
    assert [s["cached"] for s in json.loads(out)] == [True, False, False]
    assert resolve(load("table2.2-cat-probe"), None, ["stage=probe"], validate=False)[0].chain == ["pretrain", "probe"]


@pytest.mark.parametrize("args, message", [
    (["--set", "chain=[probe, pretrain]"], "pretrain (if any) first"),
    (["--set", "chain=[pretrain, nope]"], "stage 'nope'"),
    (["--networks", "/nonexistent", "-r", "tableA.1-joint"], "--networks and --n are options of the evaluation stages"),
])
def test_bad_chains_are_one_line(args: list[str], message: str, no_data: Path, shared_data: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli_in_process(["rich-features", *args, "--dry-run"], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("stage, key", [("distill", "distill.lr"), ("probe-net0", "probe.lr"), ("pretrain", "pretrain.lr"),
                                        ("finetune-cat4", "finetune.lr"), ("ft-net1", "finetune.lr")])
def test_a_nan_names_the_failed_stages_own_learning_rate(stage: str, key: str, tmp_path: Path) -> None:
    """A NaN in distill suggests `--set distill.lr=...` (issue #40: it named pretrain.lr)."""
    from owai.experiment import resolve, resume_hint
    from owai.recipes import load
    from owai.runs import Run

    rec = load("tableA.8-fewshot")
    _, resolved = resolve(rec, None, ["stage=distill,probe,fewshot"], validate=False)
    run = Run.create(tmp_path, rec.id, resolved)
    run.set_status("failed", error="non-finite loss", nonfinite={"stage": stage, "step": 3, "checkpoint": None})
    value = {"distill.lr": 0.05, "probe.lr": 0.01, "pretrain.lr": 0.05, "finetune.lr": 0.01}[key]
    assert f"--set {key}={value / 10:g}`" in resume_hint(run)
    run.set_status("failed", error="non-finite loss", nonfinite={"stage": "two-stage-head4", "step": 3, "checkpoint": None})
    assert "start a new run" in resume_hint(run)


# Table 2.2's recipe at miniature scale: the packaged MNIST file, 10 images per class, 16 px, two
# networks and two baselines, a few updates each
TINY22 = ["data.base=mnist-t10k", "data.target=mnist-t10k", "data.limit_per_class=10", "data.image_size=16",
          "data.eval_batch_size=64", "pretrain.epochs=1.0", "pretrain.batch_size=16", "pretrain.milestones=[0.5]",
          "pretrain.checkpoint_every=2", "probe.n=2", "probe.sizes=[1,2]", "probe.epochs=2", "probe.milestones=[1]",
          "probe.batch_size=8", "probe.checkpoint_every=2", "probe.log_every=2", "probe.baselines=[wide2,joint2]"]


def test_the_chain_runs_from_an_empty_cache_then_reuses_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           one_thread: None, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    args = ["rich-features", *as_sets(TINY22), "-o", str(tmp_path / "runs"), "--json"]
    code, out, err = cli_in_process(args, capsys)
    assert code == 0, err
    first = json.loads(out)
    measured = {r["metric"]: r["measured"] for r in first["rows"]}
    assert {"cat1.acc", "cat2.acc", "single.acc", "wide2.acc", "joint2.acc"} <= set(measured)
    assert {c["id"]: c["verdict"] for c in first["claims"]}["cat2-beats-wide2"] in ("holds", "misses")
    assert len(list((tmp_path / "cache" / "pretrained").glob("*.safetensors"))) == 4  # 2 networks, 2 baselines
    sweeps = sorted((tmp_path / "runs" / "table2.2-cat-probe").glob("sweep-*"))
    assert len(sweeps) == 2
    code, out, err = cli_in_process(args[:-1], capsys)  # again: the networks come from the cache
    assert code == 0, err
    assert err.count("in the cache, skipped") == 2  # info lines are on stderr
    assert sorted((tmp_path / "runs" / "table2.2-cat-probe").glob("sweep-*")) == sweeps
    runs = [p for p in (tmp_path / "runs" / "table2.2-cat-probe").iterdir() if not p.name.startswith("sweep-")]
    again = [json.loads((p / "results.json").read_text()) for p in runs]
    assert len(runs) == 2 and again[0]["rows"] == again[1]["rows"]  # deterministic: the same table twice
