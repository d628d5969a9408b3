"""A `--set` that the run never reads is refused, with one line and exit 2, before any run
directory (`Method.unused_settings`, `experiment.refuse_unused`); presets and sweep grids may still
carry such settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import cli_in_process
from owai.errors import OwaiError


@pytest.mark.parametrize("args, message", [
    (["mosaic-train", "--arch", "gpt", "--set", "model.logit_scale=none"], "--set model.logit_scale: a setting of mm; this run trains gpt"),
    (["mosaic-train", "--arch", "gpt-rope", "--set", "model.position=alibi"], "--set model.position: the position encoding of a plain gpt"),
    (["mosaic-train", "--size", "tiny", "--set", "model.dropout=0.1"], "--set model.dropout: a setting of mm and gpt; this run trains mmv2"),
    (["mosaic-train", "--size", "tiny", "--arch", "transformer", "--set", "model.short_window=8", "--dry-run"],
     "--set model.short_window: a setting of mmv2; this run trains transformer"),
    (["mosaic-train", "--arch", "mm", "--set", "model.n_kv_head=2"], "--set model.n_kv_head: a setting of transformer; this run trains mm"),
    (["bonsai", "-p", "tiny", "--method", "vrex", "--init", "rand", "--set", "penalty.anneal_iters=50"],
     "--set penalty.anneal_iters: a setting of the ERM phase of --init erm; --init rand has none"),
    (["bonsai", "-p", "tiny", "--method", "irm", "--init", "erm", "--set", "bonsai.rounds=3"],
     "--set bonsai.rounds: settings of --init bonsai / bonsai-cf; this run's is --init erm"),
    (["bonsai", "-p", "tiny", "--method", "irm", "--init", "bonsai", "--set", "perfect.steps=3"],
     "--set perfect.steps: settings of --init perfect; this run's is --init bonsai"),
])
def test_an_unread_setting_is_refused_before_the_run(args: list[str], message: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = cli_in_process([*args, "--out", str(tmp_path / "runs")] if "--dry-run" not in args else args, capsys)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not (tmp_path / "runs").exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("args", [
    ["mosaic-train", "--arch", "mm,gpt", "--set", "model.logit_scale=none"],  # mm reads it
    ["mosaic-train", "--arch", "gpt", "--set", "model.position=rope"],
    ["bonsai", "-p", "tiny", "--method", "vrex", "--init", "erm", "--set", "penalty.anneal_iters=50"],
])
def test_a_setting_that_some_model_reads_is_kept(args: list[str]) -> None:
    from owai.experiment import refuse_unused, resolve
    from owai.recipes import load

    recipe = load({"mosaic-train": "fig3.8-depth", "bonsai": "table2.4-coloredmnist"}[args[0]])
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    if args[0] == "mosaic-train":
        sets.append(f"archs=[{args[args.index('--arch') + 1]}]")
    else:
        sets += [f"method={args[args.index('--method') + 1]}", f"init={args[args.index('--init') + 1]}"]
    cfg, _ = resolve(recipe, "tiny" if "-p" in args else None, sets, validate=False)
    refuse_unused(recipe, [cfg], sets)  # no refusal


def test_presets_carry_unread_settings_and_still_run() -> None:
    """fig3.8-depth's cpu preset sets Memory Mosaics fields (model.init, logit_scale) that a gpt-only
    run does not read: only what the user typed is refused."""
    from owai.experiment import resolve
    from owai.recipes import load

    recipe = load("fig3.8-depth")
    cfg, _ = resolve(recipe, None, ["archs=[gpt]"], validate=False, refuse_unread=True)
    assert cfg.archs == ["gpt"]
    with pytest.raises(OwaiError, match="model.init: a setting of mm"):
        resolve(recipe, None, ["archs=[gpt]", "model.init=nano"], validate=False, refuse_unread=True)


def test_a_sweep_refuses_a_base_setting_only_when_no_point_reads_it(shared_data: Path) -> None:
    from owai.sweep import plan

    points = plan("table2.4-coloredmnist", "tiny", ["penalty.anneal_iters=5"], ["init=rand,erm"], [0])
    inits = {p.grid["init"] for p in points}
    assert inits == {"rand", "erm"}, inits
    with pytest.raises(OwaiError, match=r"--set penalty.anneal_iters: .* \(so in every point of the sweep\)"):
        plan("table2.4-coloredmnist", "tiny", ["penalty.anneal_iters=5"], ["init=rand,bonsai"], [0])
    # a grid value that a point does not read is the grid's business: init rand beside erm with anneal lengths
    plan("table2.4-coloredmnist", "tiny", [], ["init=rand,erm", "penalty.anneal_iters=5,10"], [0])
