"""A `--set` that the run never reads is refused, with one line and exit 2, before any run
directory (`Method.unused_settings`, `experiment.refuse_unused`); presets and sweep grids may still
carry such settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import cli_in_process
from owai.errors import OwaiError


@pytest.mark.parametrize("args, message", [
    (["mosaic-train", "--arch", "gpt", "--set", "model.logit_scale=none"], "model.logit_scale is unused here: a setting of mm; this run trains gpt"),
    (["mosaic-train", "--arch", "gpt-rope", "--set", "model.position=alibi"], "model.position is unused here: the position encoding of a plain gpt"),
    (["mosaic-train", "--size", "tiny", "--set", "model.dropout=0.1"], "model.dropout is unused here: a setting of mm and gpt and lstm; this run trains mmv2"),
    (["mosaic-train", "--size", "tiny", "--arch", "transformer", "--set", "model.short_window=8", "--dry-run"],
     "model.short_window is unused here: a setting of mmv2; this run trains transformer"),
    (["mosaic-train", "--arch", "mm", "--set", "model.n_kv_head=2"], "model.n_kv_head is unused here: a setting of transformer; this run trains mm"),
    (["mosaic-train", "--set", "data.prefetch=2"], "data.prefetch is unused here: a setting of data.stream; this run reads token windows"),
    (["bonsai", "-p", "tiny", "--method", "vrex", "--init", "rand", "--set", "penalty.anneal_iters=50"],
     "penalty.anneal_iters is unused here: a setting of the ERM phase of --init erm; --init rand has none"),
    (["bonsai", "-p", "tiny", "--method", "irm", "--init", "erm", "--set", "bonsai.rounds=3"],
     "bonsai.rounds is unused here: settings of --init bonsai / bonsai-cf; this run's is --init erm"),
    (["bonsai", "-p", "tiny", "--method", "irm", "--init", "bonsai", "--set", "bonsai.stopping=fixed", "--set", "bonsai.val_every=5"],
     "bonsai.val_every is unused here: a setting of bonsai.stopping: validation"),
    (["bonsai", "-p", "tiny", "--method", "irm", "--init", "bonsai", "--set", "perfect.steps=3"],
     "perfect.steps is unused here: settings of --init perfect; this run's is --init bonsai"),
    # Camelyon17: refused before its data is looked for
    (["bonsai", "--dataset", "camelyon17", "--init", "erm-cf", "--set", "networks=5"],
     "networks is unused here: the number of ERM networks of --init cat-cf / distill-cf; this run's is --init erm-cf"),
    (["bonsai", "--dataset", "camelyon17", "--init", "erm", "--set", "rounds=3"],
     "rounds is unused here: the discovery rounds of --init bonsai / bonsai-cf / none; --init erm reads round 0 alone"),
    (["bonsai", "--dataset", "camelyon17", "--recipe", "table2.7-camelyon17-rounds", "--method", "irm"],
     "method is unused here: the downstream method (--method); --init none trains the discovery rounds only"),
    (["bonsai", "--dataset", "camelyon17", "--init", "bonsai-cf", "--method", "vrex", "--set", "penalty.clove_width=0.2"],
     "penalty.clove_width is unused here: the kernel width of --method clove; this run's is --method vrex"),
    (["bonsai", "--dataset", "camelyon17", "--init", "bonsai-cf", "--method", "erm", "--set", "penalty.weight=10"],
     "penalty.weight is unused here: a setting of the penalty of --method irm / vrex / clove; --method erm has none"),
    (["bonsai", "--dataset", "camelyon17", "--init", "rand", "--method", "irm", "--set", "bonsai.dro_eta=0.1"],
     "bonsai.dro_eta is unused here: the GroupDRO step of the discovery rounds; --init rand --method irm trains from scratch"),
    (["bonsai", "--dataset", "camelyon17", "--init", "erm-cf", "--set", "bonsai.synthesis_lr=0.01"],
     "bonsai.synthesis_lr is unused here: a setting of the synthesis of --init bonsai / bonsai-cf / distill-cf; this run's is --init erm-cf"),
    (["bonsai", "--recipe", "table2.3-camelyon17-frozen", "--init", "distill-cf", "--set", "bonsai.group_method=balance"],
     "bonsai.group_method is unused here: the synthesis groups of --init bonsai / bonsai-cf; --init distill-cf's are bonsai.distill_groups"),
    (["bonsai", "--dataset", "camelyon17", "--init", "bonsai", "--set", "downstream.frozen_bn=train"],
     "downstream.frozen_bn is unused here: the frozen featurizer's BatchNorm mode of --init erm-cf / cat-cf / distill-cf / bonsai-cf"),
    (["bonsai", "--dataset", "camelyon17", "--init", "rand", "--method", "erm", "--set", "downstream.weight_decay=0.1"],
     "downstream.weight_decay is unused here: a setting of the downstream stage; --init rand --method erm is round 0 itself"),
    # dropout-ft: a study, so the base --set is refused when no point reads it
    (["dropout-ft", "--dataset", "pacs", "--set", "data.angles=[0.0,45.0]"],  # (a mapping is read key by key below)
     "data.angles is unused in every point of the sweep: a setting of --dataset rotated-mnist; this run's is --dataset pacs"),
    (["dropout-ft", "--dataset", "pacs", "--set", "pretrain.lr=0.1"],  # --dataset pacs turns the pretrain stage off
     "pretrain.lr is unused in every point of the sweep: a setting of the pretrain stage (pretrain.steps > 0"),
    (["dropout-ft", "-p", "tiny", "--set", "data.skip_unreadable=true"],
     "data.skip_unreadable is unused in every point of the sweep: a setting of the image-folder datasets; --dataset rotated-mnist reads MNIST's file"),
    # RegBench's in-context n-gram trains nothing; the trained models have no n-gram order
    (["eval", "regbench", "--model", "ngram", "--set", "train.epochs=3"],
     "train.epochs is unused in every point of the sweep: settings of the trained models (--model mm / transformer / lstm); --model ngram"),
    (["eval", "regbench", "--model", "mm", "--set", "eval.ngram_order=2"],
     "eval.ngram_order is unused in every point of the sweep: the order of --model ngram, the in-context n-gram; this run's is --model mm"),
    # RULER: the inputs of tasks the run does not score, a reference model's tokenizer
    (["eval", "ruler", "--model", "reference:oracle", "--tasks", "niah_single_1", "--set", "squad=synthetic"],
     "squad is unused here: the SQuAD v2 dev file of task qa_1; this run's tasks are niah_single_1 (--tasks)"),
    (["eval", "ruler", "--model", "reference:oracle", "--tasks", "qa_1", "--set", "hotpotqa=synthetic"],
     "hotpotqa is unused here: the HotpotQA dev file of task qa_2; this run's tasks are qa_1 (--tasks)"),
    (["eval", "ruler", "--model", "reference:oracle", "--tasks", "vt", "--set", "template=thesis-short"],
     "template is unused here: the QA prompt of tasks qa_1 / qa_2; this run's tasks are vt"),
    (["eval", "ruler", "--model", "reference:oracle", "--tasks", "qa_1,qa_2", "--haystack-dir", "/nonexistent/essays"],
     "haystack_dir is unused here: the essay haystack (--haystack-dir) of tasks niah_single_2, niah_single_3"),
    (["eval", "ruler", "--model", "reference:oracle", "--tasks", "niah_single_1,vt", "--haystack-dir", "/nonexistent/essays"],
     "haystack_dir is unused here"),  # noise haystacks: the run went on without reading it
    (["eval", "ruler", "--model", "/nonexistent/run", "--tasks", "vt", "--set", "reference_tokenizer=bytes"],
     "reference_tokenizer is unused here: the tokenizer that fits the prompts of a reference model"),
    (["eval", "harness", "--model", "reference:oracle", "--set", "max_gen_toks=16"],
     "max_gen_toks is unused here: the generation budget of owai's adapter for a model; --model reference:oracle"),
    (["eval", "harness", "--model", "hflm:gpt2", "--set", "max_gen_toks=16"],
     "max_gen_toks is unused here: the generation budget of owai's adapter for a model; --model hflm:gpt2 runs the harness's own HFLM"),
    (["bonsai", "--recipe", "figA.2-twobits", "--set", "figure=false", "--set", "log_floor=0.001"],
     "log_floor is unused here: the heat-map floor of Figure A.2; this run draws no figure"),
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


@pytest.mark.parametrize("recipe_id, preset, sets", [
    ("table2.6-camelyon17", None, ["init=cat-cf", "networks=5"]),
    ("table2.6-camelyon17", None, ["init=bonsai", "rounds=3"]),
    ("table2.7-camelyon17-rounds", None, ["init=bonsai-cf", "method=irm"]),
    ("table2.6-camelyon17", None, ["init=bonsai-cf", "method=clove", "penalty.clove_width=0.2"]),
    ("table2.6-camelyon17", None, ["init=erm-cf", "method=irm", "penalty.weight=10"]),
    ("table2.6-camelyon17", None, ["init=rand", "method=erm", "bonsai.dro_eta=0.1"]),  # round 0's cache key
    ("table2.6-camelyon17", None, ["init=distill-cf", "bonsai.synthesis_lr=0.01", "bonsai.distill_groups=old"]),
    ("table2.6-camelyon17", None, ["init=erm-cf", "downstream.frozen_bn=train", "downstream.weight_decay=0.1"]),
    ("table2.8-dropout", "cpu", ["data.dataset=rotated-mnist", "data.angles=[0.0, 45.0]", "pretrain.lr=0.1"]),
    ("table2.8-dropout", "cpu", ["data.dataset=imagefolder", "data.skip_unreadable=true"]),
    ("fig3.10-regbench", None, ["arch=lstm", "train.epochs=3"]),
    ("fig3.10-regbench", None, ["arch=ngram", "eval.ngram_order=2"]),
    ("table4.4-ruler", None, ["tasks=[niah_single_2, qa_1]", "squad=synthetic", "template=thesis-short", "haystack_dir=/x"]),
    ("table4.4-ruler", None, ["model=reference:oracle", "tasks=[qa_2]", "hotpotqa=synthetic", "reference_tokenizer=bytes"]),
    ("table4.1-harness", None, ["model=/some/run", "max_gen_toks=16"]),
    ("figA.2-twobits", None, ["log_floor=0.001"]),
    ("table2.4-coloredmnist", "tiny", ["init=bonsai", "bonsai.stopping=validation", "bonsai.val_every=5"]),
])
def test_a_setting_that_the_run_reads_is_kept(recipe_id: str, preset: str | None, sets: list[str]) -> None:
    """The same keys, in runs that read them."""
    from owai.experiment import refuse_unused, resolve
    from owai.recipes import load

    recipe = load(recipe_id)
    cfg, _ = resolve(recipe, preset, sets, validate=False)
    refuse_unused(recipe, [cfg], sets)  # no refusal


def test_camelyon17_names_each_key_so_a_sweep_refuses_what_no_point_reads() -> None:
    """A sweep refuses a base --set that every point names unread: Camelyon17 names its penalty
    settings one by one (ERM names all four, IRMv1 the CLOvE width), so the width is refused across
    an ERM and an IRMv1 point and the weight is not."""
    from owai.experiment import refuse_unused, resolve
    from owai.recipes import load

    recipe = load("table2.6-camelyon17")
    cfgs = [resolve(recipe, None, [f"method={m}", "init=bonsai-cf"], validate=False)[0] for m in ("erm", "irm")]
    with pytest.raises(OwaiError, match=r"penalty.clove_width is unused in every point of the sweep: "):
        refuse_unused(recipe, cfgs, ["penalty.clove_width=0.2"], sweep=True)
    refuse_unused(recipe, cfgs, ["penalty.weight=10"], sweep=True)  # the IRMv1 point reads it
    cfgs = [resolve(recipe, None, [f"init={i}", "method=irm"], validate=False)[0] for i in ("rand", "erm-cf")]
    with pytest.raises(OwaiError, match="bonsai.head is unused in every point of the sweep: a setting of the synthesis"):
        refuse_unused(recipe, cfgs, ["bonsai.head=random"], sweep=True)


def test_presets_carry_unread_settings_and_still_run() -> None:
    """fig3.8-depth's cpu preset sets Memory Mosaics fields (model.init, logit_scale) that a gpt-only
    run does not read: only what the user typed is refused."""
    from owai.experiment import resolve
    from owai.recipes import load

    recipe = load("fig3.8-depth")
    cfg, _ = resolve(recipe, None, ["archs=[gpt]"], validate=False, refuse_unread=True)
    assert cfg.archs == ["gpt"]
    with pytest.raises(OwaiError, match="model.init is unused here: a setting of mm"):
        resolve(recipe, None, ["archs=[gpt]", "model.init=nano"], validate=False, refuse_unread=True)


def test_a_sweep_refuses_a_base_setting_only_when_no_point_reads_it(shared_data: Path) -> None:
    from owai.sweep import plan

    points = plan("table2.4-coloredmnist", "tiny", ["penalty.anneal_iters=5"], ["init=rand,erm"], [0])
    inits = {p.grid["init"] for p in points}
    assert inits == {"rand", "erm"}, inits
    with pytest.raises(OwaiError, match=r"penalty.anneal_iters is unused in every point of the sweep: "):
        plan("table2.4-coloredmnist", "tiny", ["penalty.anneal_iters=5"], ["init=rand,bonsai"], [0])
    # a grid value that a point does not read is the grid's business: init rand beside erm with anneal lengths
    plan("table2.4-coloredmnist", "tiny", [], ["init=rand,erm", "penalty.anneal_iters=5,10"], [0])


def test_a_section_named_in_one_point_and_a_key_in_another_is_still_unread(shared_data: Path) -> None:
    """ColoredMNIST names all of `bonsai` for init rand and only bonsai.val_fraction / val_every for
    a Bonsai init with fixed stopping: a sweep over both refuses bonsai.val_fraction, whichever
    point comes first, and says that the points' reasons differ."""
    from owai.sweep import plan

    for inits in (["rand", "bonsai-cf"], ["bonsai-cf", "rand"]):
        with pytest.raises(OwaiError, match=r"bonsai.val_fraction is unused in every point of the sweep: .*\(and 1 more reasons\)"):
            plan("table2.4-coloredmnist", "cpu", ["bonsai.val_fraction=0.2"], None, [0], grid={"method": ["irm"], "init": inits})


def test_a_mapping_is_read_key_by_key() -> None:
    from owai.experiment import refuse_unused, resolve
    from owai.recipes import load

    recipe = load("table2.6-camelyon17")
    sets = ["init=bonsai-cf", "method=erm", "penalty={weight: 3.0}"]
    cfg, _ = resolve(recipe, None, sets, validate=False)
    with pytest.raises(OwaiError, match="penalty.weight is unused here"):
        refuse_unused(recipe, [cfg], sets)


@pytest.mark.parametrize("args, message", [
    (["mosaic-train", "--set", "archs=[]", "--set", "model.dropout=0.1"], "archs: give one or more distinct architectures"),
    (["eval", "ruler", "--model", "reference:oracle", "--set", "tasks=[]", "--set", "squad=synthetic"], "tasks"),
])
def test_an_invalid_config_gets_its_own_message_not_an_unused_one(args: list[str], message: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = cli_in_process([*args, "--out", str(tmp_path / "runs")], capsys)
    assert code == 2 and message in err and "unused" not in err, err

