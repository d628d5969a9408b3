"""Pins of the distributed and command wiring that a mutation audit found unguarded in-process.

Each test fails on one small, plausible mistake in owai/distributed.py, owai/experiment.py,
owai/console.py, owai/cli.py or owai/commands/ that no fast test caught (the torchrun jobs that do
catch some of them take minutes on a CPU). The ranks of a torchrun job are stood in for by a fake
process group (`FakeGroup`: torch.distributed's calls answered for this rank and its peers), so no
process is started. Expected values come from the docstrings of the functions under test, torch's
torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK) and docs/architecture.md.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from owai import distributed


class FakeGroup:
    """torch.distributed as rank `rank` of `world_size` sees it, the other ranks contributing `peers`
    (one value per other rank, in rank order, for each collective's input) to every collective."""

    def __init__(self, rank: int, world_size: int, peers: list[Any]) -> None:
        self.rank, self.world_size, self.peers = rank, world_size, peers
        self.calls: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeGroup:
        dist = distributed.dist
        monkeypatch.setattr(dist, "is_available", lambda: True)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: self.rank)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: self.world_size)
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)
        monkeypatch.setattr(dist, "all_gather", self.all_gather)
        monkeypatch.setattr(dist, "broadcast_object_list", self.broadcast_object_list)
        monkeypatch.setattr(dist, "barrier", lambda *a, **k: self.calls.append("barrier"))
        monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: self.calls.append("destroy"))
        return self

    def everyone(self, mine: Any) -> list[Any]:
        """Every rank's value in rank order: the peers' around this rank's own."""
        return [*self.peers[:self.rank], mine, *self.peers[self.rank:]]

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        assert op in (None, distributed.dist.ReduceOp.SUM), op  # torch's default: a sum
        total = sum(torch.as_tensor(v, dtype=tensor.dtype) for v in self.everyone(tensor.clone()))
        tensor.copy_(total)

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> None:
        for part, value in zip(parts, self.everyone(tensor), strict=True):
            part.copy_(torch.as_tensor(value, dtype=tensor.dtype).reshape(tensor.shape))

    def broadcast_object_list(self, box: list[Any], src: int = 0, group: Any = None, device: Any = None) -> None:
        box[0] = self.everyone(box[0])[src]


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch):
    """Set torchrun's per-process variables (None: unset)."""

    def set_env(**values: str | None) -> None:
        for name, value in values.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)

    return set_env


# -- owai/distributed.py ----------------------------------------------------------------------------


def test_a_scalar_logged_under_torchrun_is_the_mean_over_the_ranks(monkeypatch: pytest.MonkeyPatch):
    """`mean_across_ranks`: "The mean of a scalar over ranks" (the training loss each logged step).
    Rank 0's 1.0 beside rank 1's 3.0 is 2.0: a sum that is not divided by the world size logged 4.0,
    twice the loss one process logs on the same global batch."""
    FakeGroup(0, 2, [3.0]).install(monkeypatch)
    assert distributed.mean_across_ranks(1.0, torch.device("cpu")) == pytest.approx(2.0)


def test_values_summed_over_ranks_are_each_ranks_values_added(monkeypatch: pytest.MonkeyPatch):
    """`sum_across_ranks`: "Each value summed over ranks" (the evaluation's loss sums and target
    counts, whose ratio is then one process's mean). In one process it is the values themselves."""
    cpu = torch.device("cpu")
    assert distributed.sum_across_ranks([1.5, 2.0], cpu) == [1.5, 2.0]
    FakeGroup(1, 3, [[1.0, 10.0], [2.0, 20.0]]).install(monkeypatch)
    assert distributed.sum_across_ranks([4.0, 40.0], cpu) == pytest.approx([7.0, 70.0])


@pytest.mark.parametrize("mine, peer, agreed", [(True, True, True), (True, False, False), (False, True, False)])
def test_a_flag_holds_on_every_rank_only_when_it_holds_on_each(monkeypatch: pytest.MonkeyPatch, mine: bool, peer: bool,
                                                               agreed: bool):
    """`on_every_rank`: "Whether `flag` holds on every rank": a rank may skip a forward pass (a
    collective under FSDP) only when every rank skips it, so one rank's True is not enough."""
    FakeGroup(0, 2, [1.0 if peer else 0.0]).install(monkeypatch)
    assert distributed.on_every_rank(mine, torch.device("cpu")) is agreed


def test_the_world_reads_the_local_rank_from_local_rank(monkeypatch: pytest.MonkeyPatch, torchrun_env):
    """`World.local_rank` is the process's index on its own node, torchrun's LOCAL_RANK; the global
    rank (RANK, the process group's rank) differs from it on every node but the first."""
    FakeGroup(5, 8, [0] * 7).install(monkeypatch)
    torchrun_env(RANK="5", LOCAL_RANK="1", WORLD_SIZE="8")
    assert distributed.world() == distributed.World(rank=5, world_size=8, local_rank=1)
    assert not distributed.is_main()


def test_each_rank_computes_on_its_local_ranks_device(torchrun_env):
    """`device_for`: "Under torchrun on CUDA each rank uses its LOCAL_RANK device" (rank 5 of a job of
    two 4-GPU nodes is GPU 1 of its node); a CPU device and a single process are left alone."""
    torchrun_env(RANK="5", LOCAL_RANK="1", WORLD_SIZE="8")
    assert distributed.device_for(torch.device("cuda")) == torch.device("cuda", 1)
    assert distributed.device_for(torch.device("cpu")) == torch.device("cpu")
    torchrun_env(RANK=None, LOCAL_RANK=None, WORLD_SIZE=None)
    assert distributed.device_for(torch.device("cuda")) == torch.device("cuda")


def test_the_launch_is_read_from_torchruns_environment(torchrun_env):
    """Before the process group is joined: a torchrun job is WORLD_SIZE > 1; the rank is RANK (0
    outside torchrun, whatever RANK says); the world size WORLD_SIZE, 1 outside torchrun."""
    torchrun_env(RANK=None, WORLD_SIZE=None, LOCAL_RANK=None)
    assert (distributed.launched_by_torchrun(), distributed.launch_rank(), distributed.launch_world_size()) == (False, 0, 1)
    torchrun_env(RANK="3", WORLD_SIZE="1")
    assert (distributed.launched_by_torchrun(), distributed.launch_rank(), distributed.launch_world_size()) == (False, 0, 1)
    torchrun_env(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1")
    assert (distributed.launched_by_torchrun(), distributed.launch_rank(), distributed.launch_world_size()) == (True, 3, 4)


def test_every_rank_gets_rank_0s_object(monkeypatch: pytest.MonkeyPatch):
    """`broadcast_object`: "Rank 0's `obj` on every rank (e.g. the run directory rank 0 created)"."""
    FakeGroup(1, 2, ["runs/made-by-rank-0"]).install(monkeypatch)
    assert distributed.broadcast_object("rank 1's own") == "runs/made-by-rank-0"


def test_gathered_tensors_are_concatenated_in_rank_order(monkeypatch: pytest.MonkeyPatch):
    """`gather_tensors`: every rank's tensor "concatenated along its first dimension in rank order"; a
    0-d tensor counts as one element, in one process too (lm-evaluation-harness's `all_gather`)."""
    assert distributed.gather_tensors(torch.tensor(7)).tolist() == [7]
    FakeGroup(1, 3, [[1, 2], [5, 6]]).install(monkeypatch)
    assert distributed.gather_tensors(torch.tensor([3, 4])).tolist() == [1, 2, 3, 4, 5, 6]


def test_a_job_is_left_through_a_barrier_first(monkeypatch: pytest.MonkeyPatch):
    """`shutdown`: "first a barrier, so that no rank closes its connections while a peer's last
    collective is still in flight", then `destroy_process_group`."""
    group = FakeGroup(0, 2, [None]).install(monkeypatch)
    distributed.shutdown()
    assert group.calls == ["barrier", "destroy"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_process_is_neither_sharded_nor_wrapped(strategy: str):
    """`Parallel`: "Outside torchrun both are the same object" (`forward_module` and `module`), the
    model is not sharded, and `no_sync` (an accumulation's micro-batches before the last) is a no-op:
    a single process is the same code path with world_size 1 (owai/distributed.py's docstring)."""
    model = torch.nn.Linear(3, 2)
    parallel = distributed.Parallel(model, strategy)
    assert parallel.forward_module is model and parallel.module is model
    assert not parallel.sharded and not parallel.fsdp
    with parallel.no_sync(True):
        model(torch.ones(1, 3)).sum().backward()
    assert model.weight.grad is not None


# -- owai/experiment.py: what a rank other than 0 does -----------------------------------------------


@pytest.fixture
def as_rank_1(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """This process as rank 1 of a 2-rank job whose run directory is already agreed on (the process
    group itself stood in for: `world` and `is_main` answer as rank 1's do), with the seeds that
    `owai.runtime.applied` is given recorded (returned)."""
    from owai import runtime

    monkeypatch.setattr(distributed, "world", lambda: distributed.World(rank=1, world_size=2, local_rank=1))
    monkeypatch.setattr(distributed, "is_main", lambda: False)
    seeds: list[int] = []
    original = runtime.applied

    def applied(settings: Any, seed: int) -> Any:
        seeds.append(seed)
        return original(settings, seed)

    monkeypatch.setattr(runtime, "applied", applied)
    return seeds


def test_a_rank_other_than_0_writes_no_results_and_prints_none(as_rank_1: list[int], tmp_path, capsys):
    """docs/architecture.md: "every rank runs the method, and only rank 0 writes" (`Run.writes`):
    rank 1's results.json, status and env would race rank 0's copies of the same files; and rank 0
    reports (`run_recipe`), so rank 1 prints no result."""
    from conftest import TINY_MOONS, as_sets, cli_in_process

    code, out, err = cli_in_process(["moons", "-q", "-o", str(tmp_path), *as_sets(TINY_MOONS)],
                                    capsys)
    assert code == 0, err
    (run_dir,) = (tmp_path / "three-moons").iterdir()  # made by `_prepare`, which only rank 0 runs under torchrun
    # config.yaml and status.json are `_prepare`'s; nothing of the method's run (results, env,
    # metrics, checkpoints, figures) is rank 1's to write
    written = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    assert written == ["config.yaml", "status.json"]
    assert out == ""


def test_each_rank_seeds_its_run_with_the_seed_plus_its_rank(as_rank_1: list[int], tmp_path, capsys):
    """docs/decisions.md: "dropout is seeded per rank (seed + rank, as the reference's 1337 + rank)":
    rank 1 of a run of seed 7 sets up its runtime with seed 8 (the same seed on every rank draws
    the same dropout masks on each rank's different rows)."""
    from conftest import TINY_MOONS, as_sets, cli_in_process

    code, _, err = cli_in_process(["moons", "-q", "-o", str(tmp_path), *as_sets([*TINY_MOONS, "seed=7"])], capsys)
    assert code == 0, err
    assert as_rank_1 == [8]


# -- owai/console.py ----------------------------------------------------------------------------------


def test_json_mode_shows_no_progress_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch):
    """`console.Bar`: "On a terminal: a Rich bar on stderr (not under --quiet/--json)", and `track`
    is "hidden under --quiet/--json": with --json a terminal shows no bar (the plain lines are for
    output that is not a terminal)."""
    import io

    from rich.console import Console

    from owai import console

    screen = io.StringIO()
    monkeypatch.setattr(console, "stderr", Console(file=screen, force_terminal=True, width=80))
    console.configure(as_json=True)
    try:
        assert not console.progress_enabled()
        with console.Bar("train mm", total=3) as bar:
            for _ in range(3):
                bar.update(status="loss 1.5")
        assert list(console.track(range(2), total=2, description="eval")) == [0, 1]
    finally:
        console.configure()
    assert screen.getvalue() == ""


# -- owai/cli.py ----------------------------------------------------------------------------------------


def test_recipes_run_hands_json_on_to_the_command_it_runs(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys):
    """`delegated_run`: the subcommand gets "the options of `owai recipes run` given on"; without
    --json the study command printed its table, not the one JSON document `--json` promises on stdout."""
    from conftest import cli_in_process

    from owai import cli

    calls: list[list[str]] = []
    monkeypatch.setattr(cli, "run_subcommand", lambda argv: calls.append(list(argv)) or 0)
    code, _, err = cli_in_process(["recipes", "run", "fig2.11-scratch", "--json", "-o", str(tmp_path)], capsys)
    assert code == 0, err
    (argv,) = calls
    assert argv[:3] == ["dropout-ft", "--recipe", "fig2.11-scratch"] and "--json" in argv and "--quiet" not in argv


# -- owai/commands/: each flag lands on the setting it names ------------------------------------------


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What each command hands `run_recipe` (recorded, nothing runs): recipe, preset, sets, out,
    resume, quiet, as_json."""
    from owai.commands import _common

    calls: list[dict[str, Any]] = []

    def record(recipe, preset, sets, out, resume, quiet, as_json, methods=None):
        calls.append({"recipe": recipe, "preset": preset, "sets": list(sets or []), "out": out, "resume": resume,
                      "quiet": quiet, "as_json": as_json})

    monkeypatch.setattr(_common, "run_recipe", record)
    return calls


def test_mosaic_train_flags_are_the_settings_its_docstring_names(runs: list[dict[str, Any]], tmp_path, capsys):
    """owai/commands/mosaic.py: "`--depth` = model.n_layer, `--arch` = archs, `--dataset` =
    data.source, `--tokenizer` = data.tokenizer, `--context` = data.block_size"; --out, -q and --json
    reach the run as they are."""
    from conftest import cli_in_process

    code, _, err = cli_in_process(["mosaic-train", "--depth", "3", "--arch", "mm,gpt", "--dataset", "owai-stories",
                                   "--tokenizer", "bytes", "--context", "48", "-s", "seed=5", "-o", str(tmp_path), "-q",
                                   "--json"], capsys)
    assert code == 0, err
    (call,) = runs
    assert call["recipe"] == "fig3.8-depth" and call["preset"] is None
    assert call["sets"] == ["archs=[mm, gpt]", "model.n_layer=3", "data.source=owai-stories", "data.tokenizer=bytes",
                            "data.block_size=48", "seed=5"]
    assert (call["out"], call["quiet"], call["as_json"]) == (tmp_path, True, True)


@pytest.mark.parametrize("size, preset", [("tiny", "cpu"), ("small", "paper-small"), ("large", "paper")])
def test_a_model_size_runs_chapter_4s_recipe_at_that_sizes_preset(runs: list[dict[str, Any]], size: str, preset: str, capsys):
    """owai/commands/mosaic.py: "A size (tiny, small, large) means chapter 4: recipe
    table4.2-pretrain, its preset of that size (cpu, paper-small, paper), and Memory Mosaics v2
    unless --arch says otherwise"."""
    from conftest import cli_in_process

    code, _, err = cli_in_process(["mosaic-train", "--size", size], capsys)
    assert code == 0, err
    (call,) = runs
    assert (call["recipe"], call["preset"]) == ("table4.2-pretrain", preset)
    assert call["sets"] == [f"model.size={size}", "archs=[mmv2]"]


def test_evaluation_flags_are_the_settings_they_name(runs: list[dict[str, Any]], capsys):
    """owai/commands/eval.py: ruler's --seed is "The haystacks' seed" (setting `seed`) and --n / --samples
    its samples per task (`n`); icl's --n / --queries the number of queries (`n_queries`); posloss and
    mosaic-eval's --context is data.block_size (owai/commands/_common.py `Context`)."""
    import json

    from conftest import cli_in_process

    code, _, err = cli_in_process(["eval", "ruler", "--model", "reference:oracle", "--seed", "5", "--samples", "7",
                                   "--ctx", "4k"], capsys)
    assert code == 0, err
    code, _, err = cli_in_process(["eval", "icl", "--model", "reference:knn", "--queries", "9", "--shots", "1,2"], capsys)
    assert code == 0, err
    code, _, err = cli_in_process(["eval", "posloss", "some/model", "--context", "40"], capsys)
    assert code == 0, err
    ruler, icl, posloss = runs
    assert ruler["recipe"] == "table4.4-ruler" and {"model=reference:oracle", "seed=5", "n=7", 'ctx=["4k"]'} <= set(ruler["sets"])
    assert icl["recipe"] == "fig4.6-icl" and {"model=reference:knn", "n_queries=9", "shots=[1, 2]"} <= set(icl["sets"])
    assert not any(s.startswith(("n=", "seed=")) for s in icl["sets"])
    assert posloss["recipe"] == "mosaic-eval" and "data.block_size=40" in posloss["sets"]
    assert "eval.train_loss=false" in posloss["sets"]  # posloss is mosaic-eval --posloss-only
    assert json.loads(posloss["sets"][0].split("=", 1)[1])[0].endswith("some/model")


def test_a_runs_json_is_the_one_thing_on_stdout(tmp_path, capsys):
    """owai/commands/_common.py `Json`: "Print the result as JSON on stdout (nothing else)", without
    -q too: the results table beside it made stdout two documents that no JSON reader takes."""
    import json

    from conftest import TINY_MOONS, as_sets, cli_in_process

    code, out, err = cli_in_process(["moons", "--json", "-o", str(tmp_path), *as_sets(TINY_MOONS)], capsys)
    assert code == 0, err
    results = json.loads(out)  # the whole of stdout is one JSON document
    assert results["recipe"] == "three-moons" and (tmp_path / "three-moons").is_dir()


def test_under_torchrun_a_rank_other_than_0_shows_no_progress(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """`experiment._agree_on_run`: a rank other than 0 runs quiet, "one progress display and one
    report: rank 0's" (docs/architecture.md: every rank runs the method, rank 0 reports); rank 0
    keeps the mode it was given."""
    from conftest import TINY_MOONS

    from owai import console, experiment

    made = experiment._prepare("three-moons", None, list(TINY_MOONS), tmp_path, None, None)
    monkeypatch.setattr(distributed, "init", lambda: distributed.World(1, 2, 1))
    monkeypatch.setattr(distributed, "broadcast_object", lambda message: (str(made.path), None))
    try:
        for rank, quiet in ((0, False), (1, True)):
            console.configure()
            monkeypatch.setattr(distributed, "is_main", lambda rank=rank: rank == 0)
            if rank == 0:
                monkeypatch.setattr(experiment, "_prepare", lambda *args: made)
            run = experiment._agree_on_run("three-moons", None, [], tmp_path, None, None)
            assert run.path == made.path and console.state.quiet is quiet
    finally:
        console.configure()


# -- each rank's share of the data (owai/methods/language_model.py) -------------------------------------


def test_the_ranks_training_rows_together_are_one_processs_batch(monkeypatch: pytest.MonkeyPatch):
    """`global_batch`: "Every rank draws the same global batch (batch_size x world_size windows ...)
    and keeps its own rows, so 1 process and N processes train on identical data": rank 0's rows
    then rank 1's are the batch one process of twice the batch size draws; no row is read twice."""
    from types import SimpleNamespace

    from owai.methods import language_model as lm

    class Windows:
        def batch(self, size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randint(0, 10**6, (size, 3), generator=gen)
            return x, x + 1

    cpu = torch.device("cpu")

    def rows(rank: int, world_size: int, batch_size: int) -> torch.Tensor:
        monkeypatch.setattr(distributed, "world", lambda: distributed.World(rank, world_size, rank))
        cfg = SimpleNamespace(seed=3, train=SimpleNamespace(batch_size=batch_size))
        x, y = lm.global_batch(Windows(), cfg, step=5, micro=1, device=cpu)
        assert torch.equal(y, x + 1)
        return x

    one = rows(0, 1, 4)
    assert torch.equal(torch.cat([rows(0, 2, 2), rows(1, 2, 2)]), one)
