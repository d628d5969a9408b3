"""What a run leaves behind in the process that ran it: an in-process sweep's next point, a recipe's next
stage, a notebook or the tests run after it (docs/decisions.md "What a run leaves behind"). Its loader
workers end with it, failed or not, even while its exception is kept; the process's torch settings come
back; and on a GPU the objects it left in reference cycles (its models) are freed when it returns."""

from __future__ import annotations

import gc
import multiprocessing
import os
import weakref
from pathlib import Path

import pytest
import torch

from conftest import TINY_MOONS
from owai import runtime
from owai.config import Runtime
from owai.data import domainbed, images
from owai.errors import OwaiError
from owai.methods import Outcome
from owai.methods.three_moons import ThreeMoons


class _Pid(torch.utils.data.Dataset):
    """Example i is the pid of the process that read it; example `bad` is bad data, found mid-pass."""

    def __init__(self, bad: int = -1) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        import os

        if i == self.bad:
            raise ValueError(f"example {i} cannot be read")
        return os.getpid()


class _PidSteps(torch.utils.data.Dataset):
    """Step s's batch: (the reader's pid, s, s); step `bad` cannot be read."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 6

    def __getitem__(self, step: int) -> tuple[torch.Tensor, int, int]:
        import os

        if step == self.bad:
            raise ValueError(f"step {step} cannot be read")
        return torch.tensor([os.getpid()]), step, step


def _workers() -> set[int]:
    """The pids of this process's live multiprocessing children (DataLoader workers among them)."""
    return {p.pid for p in multiprocessing.active_children()}


def kill_step_streams_at(monkeypatch, update: int) -> tuple[list[int], list[int], set[int]]:
    """Every `StepStream.at` read counted, the `update`-th raising KeyboardInterrupt (a Ctrl-C in a
    stage's training): (the steps read, the new workers alive at the kill, the workers before)."""
    real, calls, alive = images.StepStream.at, [], []
    before = _workers()

    def killed(self, step):  # noqa: ANN001, ANN202
        calls.append(step)
        if len(calls) == update:
            alive.append(len(_workers() - before))  # the stream's workers, running when it is killed
            raise KeyboardInterrupt
        return real(self, step)

    monkeypatch.setattr(images.StepStream, "at", killed)
    return calls, alive, before


def interrupt_kept(run) -> list[KeyboardInterrupt]:  # noqa: ANN001
    """`run()`'s KeyboardInterrupt, kept as a notebook keeps its last exception (with its traceback,
    which holds the frames, and so the loaders, of the run)."""
    kept = []
    try:
        run()
    except KeyboardInterrupt as e:
        kept.append(e)
    return kept


@pytest.mark.parametrize("fails_in", ["passes", "stream", "caller"])
def test_streams_and_evaluation_passes_end_their_workers_with_their_block_though_still_referenced(fails_in):
    """A failed run's exception, kept by the caller (pytest's report, a notebook's last traceback),
    holds the run's frames, and with them its training stream and evaluation passes; bad data met by a
    worker holds the loader's iterator itself in the traceback. The `with` block ends their worker
    processes all the same; both read again afterwards, through new workers."""
    before = _workers()
    kept: list[BaseException] = []
    try:
        with images.StepStream(_PidSteps(bad=2 if fails_in == "stream" else -1), 2) as stream, \
                images.EvalPasses(_Pid(bad=9 if fails_in == "passes" else -1), 4, 2, list) as passes:
            stream.at(0)
            list(passes(torch.arange(6)))
            ended = _workers() - before  # the block's workers, which must not serve a read after it
            assert len(ended) == 4
            if fails_in == "caller":
                raise KeyboardInterrupt  # the kill, from inside the run
            stream.at(1)
            stream.at(2)
            list(passes(torch.arange(12)))
    except (KeyboardInterrupt, ValueError) as e:
        kept.append(e)  # its traceback holds this frame (`stream`, `passes`), and the loader's own frames
    assert len(kept) == 1 and "cannot be read" in str(kept[0]) or fails_in == "caller"
    assert _workers() - before == set()
    if fails_in == "caller":
        x, _ = stream.at(1)  # the next step after the kill: read by a new worker, not the ended iterator's
        assert int(x) not in before | ended
        readers = {pid for batch in passes(torch.arange(8)) for pid in batch}
        assert readers and not readers & (before | ended)
        stream.close()
        passes.close()
        assert _workers() - before == set()


class _BadImage(domainbed.TensorDomains):
    """Digits-like domains whose image 7 of domain 0 is bad data, met by a loader worker."""

    def image(self, domain: int, index: int):  # noqa: ANN201
        if (domain, index) == (0, 7):
            raise OSError("image 7 is truncated")
        return super().image(domain, index)


@pytest.mark.parametrize("one_pass", ["domainbed", "camelyon17"])
def test_a_one_pass_evaluation_ends_its_workers_after_it_and_when_bad_data_stops_it(one_pass, tmp_path):
    """An evaluation pass of its own (DomainBed's, for dropout-ft and the rich features; Camelyon17's
    `eval_batches`) ends its workers when the pass is done, though the iterator is still referenced,
    and when a worker meets bad data: the exception's traceback holds the loader's iterator."""
    before = _workers()
    if one_pass == "domainbed":
        gen = torch.Generator().manual_seed(0)
        data = _BadImage("t", ["a"], ["0", "1"], [torch.randint(0, 256, (12, 8, 8), dtype=torch.uint8, generator=gen)],
                         [torch.arange(12) % 2])

        def batches(indices):  # noqa: ANN001, ANN202
            return domainbed.eval_batches(data, 0, indices, 8, 2, workers=2)
    else:
        from camelyon_tree import make_camelyon

        from owai.data import camelyon17
        cam = camelyon17.Camelyon17(make_camelyon(tmp_path, train_per_center=2, id_val_per_center=1, eval_per_center=2),
                                    image_size=8)
        patch = cam.dir / "patches" / cam.files[7]

        def batches(indices):  # noqa: ANN001, ANN202
            return camelyon17.eval_batches(cam, indices, 2, workers=2)
    done = batches(torch.arange(6))
    assert len(list(done)) == 3 and _workers() - before == set()
    if one_pass == "camelyon17":
        patch.unlink()
    kept = []
    try:
        list(batches(torch.arange(12)))
    except Exception as e:  # noqa: BLE001 - kept, as a notebook keeps its last exception
        kept.append(e)
    assert len(kept) == 1 and _workers() - before == set()


def test_runtime_settings_are_the_runs_alone():
    """`runtime.applied`: the run's threads, deterministic mode and subnormal flushing inside, the
    process's own after it, after a failure too."""
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), runtime.flushes_denormals(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(False)
    torch.set_flush_denormal(False)
    try:
        with pytest.raises(KeyboardInterrupt):
            with runtime.applied(Runtime(threads=1, deterministic=True, flush_denormal=True), seed=0) as (device, dtype):
                assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == (1, True)
                assert runtime.flushes_denormals() and torch.is_deterministic_algorithms_warn_only_enabled()
                assert device.type in ("cpu", "cuda") and dtype is torch.float32
                raise KeyboardInterrupt
        assert (torch.are_deterministic_algorithms_enabled(), runtime.flushes_denormals()) == (False, False)
        assert torch.get_num_threads() == saved[0]
        torch.use_deterministic_algorithms(True)  # a caller's own deterministic mode, turned off by a run asking for that
        with runtime.applied(Runtime(deterministic=False), seed=0):
            assert not torch.are_deterministic_algorithms_enabled()
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1], warn_only=saved[3])
        torch.set_flush_denormal(saved[2])


def test_runtime_gives_back_cudnn_autotuning_and_the_cublas_workspace(monkeypatch):
    """`runtime.applied` also puts back cuDNN autotuning and CUBLAS_WORKSPACE_CONFIG, which a
    deterministic run turns off and sets: a caller that autotunes its own convolutions, or never set
    the workspace, gets its own back (both are plain settings, checked here without a GPU)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), runtime.flushes_denormals())
    try:
        with runtime.applied(Runtime(deterministic=True), seed=0):
            assert torch.backends.cudnn.benchmark is False
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.backends.cudnn.benchmark is True
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the caller's own: kept, and kept after
        with runtime.applied(Runtime(deterministic=True), seed=0):
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1], warn_only=saved[2])
        torch.set_flush_denormal(saved[3])


def test_a_deterministic_run_warns_where_its_caller_is_strict():
    """A run's deterministic mode only warns on an operation without a deterministic kernel
    (warn_only), as `setup` always set it, even when the caller's own mode is the strict one: the run
    does not fail on such an operation because of the caller's setting, and the caller is strict again
    after it. (`_deterministic` skips the call only when neither the mode nor warn_only changes.)"""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)  # strict: warn_only off
    try:
        with runtime.applied(Runtime(deterministic=True), seed=0):
            assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def test_a_step_stream_reads_consecutive_steps_through_the_same_workers():
    """`StepStream.at` restarts its loader only when a step is not the next one (a resume): consecutive
    steps are read on by the workers already started (a start is seconds under spawn), a jump starts
    new ones, and the batches are the steps' either way."""
    before = _workers()
    with images.StepStream(_PidSteps(bad=-1), 2) as stream:
        read = [stream.at(s) for s in range(4)]
        assert [int(y) for _, y in read] == [0, 1, 2, 3]
        first = {int(x) for x, _ in read}
        assert len(first) == 2 and not first & before  # two workers, for the four steps
        x, y = stream.at(1)  # a resume at an earlier step
        assert int(y) == 1 and int(x) not in first | before
    assert _workers() - before == set()


def test_evaluation_passes_refuse_a_batch_size_below_one():
    with pytest.raises(OwaiError, match="evaluation batch size must be >= 1, got 0"):
        images.EvalPasses(_Pid(), 0, 0, list)


def _sets(settings: list[str]) -> list[str]:
    return [*TINY_MOONS, *settings]


def test_a_run_leaves_the_callers_torch_settings_and_a_later_run_gets_its_own(tmp_path: Path, monkeypatch):
    """Two runs in one process (an in-process sweep, chained stages): each runs with its own config's
    settings, not with what the one before left, and the caller gets its own back."""
    from owai.experiment import execute

    seen: list[tuple[int, bool, bool]] = []

    def probe(self, cfg, run) -> Outcome:  # noqa: ANN001
        seen.append((torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), runtime.flushes_denormals()))
        return Outcome({}, {})

    monkeypatch.setattr(ThreeMoons, "run", probe)
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(False)
    flush = runtime.flushes_denormals()
    try:
        execute("three-moons", None, _sets(["runtime.threads=1"]), out=tmp_path)  # deterministic and flushing: the defaults
        after_first = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), runtime.flushes_denormals())
        execute("three-moons", None, _sets(["runtime.deterministic=false", "runtime.flush_denormal=false"]), out=tmp_path)
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(flush)
    assert seen == [(1, True, True), (threads, False, False)]
    assert after_first == (threads, False, flush)
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_runs_reference_cycles_are_freed_when_it_returns_on_a_gpu(tmp_path: Path, monkeypatch):
    """A figure's text drawn during a run (matplotlib's mathtext: pyparsing keeps exceptions whose
    tracebacks hold the stack's frames) left the run's models in reference cycles, alive until the
    cyclic collector's next full pass, beside the next in-process run's in GPU memory. Here a frame in
    such a cycle holds the run's "model", in a process that has used CUDA."""
    from owai.experiment import execute

    models: list[weakref.ref] = []

    class Model:
        pass

    def cyclic(self, cfg, run) -> Outcome:  # noqa: ANN001
        model = Model()
        models.append(weakref.ref(model))
        try:
            raise ValueError("parsed")
        except ValueError as e:
            kept = e  # this frame -> kept -> its traceback -> this frame: a cycle that holds `model`
        assert kept and model
        return Outcome({}, {})

    monkeypatch.setattr(ThreeMoons, "run", cyclic)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    enabled = gc.isenabled()
    gc.disable()  # no automatic pass in between: only the run's own collection frees the cycle
    try:
        execute("three-moons", None, TINY_MOONS, out=tmp_path)
        assert models[0]() is None
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("killed_in", ["training", "evaluation"])
def test_a_failed_camelyon17_run_kept_by_its_caller_leaves_no_workers(killed_in, tmp_path: Path, monkeypatch):
    """A Camelyon17 run killed in a stage's training (its step stream's workers) or in an evaluation
    pass (the run's evaluation workers), its exception kept as a notebook keeps its last one: no
    worker process is left."""
    from camelyon_tree import make_camelyon
    from test_camelyon17 import tiny

    from owai.experiment import execute
    from owai.methods import camelyon17 as method

    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    if killed_in == "training":
        target, name, at = images.StepStream, "at", 3
    else:
        target, name, at = method, "forward_split", 2
    real, calls = getattr(target, name), []

    def killed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, killed)
    sets = [s for s in tiny(make_camelyon(tmp_path / "data")) if not s.startswith(("data.workers", "bonsai.synthesis"))]
    before = _workers()
    kept = []
    try:
        execute("table2.6-camelyon17", None, [*sets, "data.workers=2", "train.epochs=1", "init=none", "rounds=1"],
                out=tmp_path / "runs")
    except KeyboardInterrupt as e:
        kept.append(e)
    assert len(kept) == 1 and len(calls) == at
    assert _workers() - before == set()


@pytest.mark.parametrize("stage", ["train", "pretrain"])
def test_a_failed_dropout_ft_run_kept_by_its_caller_leaves_no_workers(stage, tmp_path: Path, monkeypatch):
    """A dropout fine-tuning run (two loader workers) killed in its fine-tuning stage (a DomainBed-style
    tree) or in its pre-training stage (the tiny preset's rotated MNIST, packaged file), its exception
    kept as a notebook keeps its last one: the stage's step stream ends its workers with the stage
    (`with stream:` in dropout_ft.train and dropout_ft._pretrain), not when the exception is dropped."""
    from domainbed_tree import make_tree
    from test_dropout_ft import TINY

    from owai.experiment import execute

    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    calls, alive, before = kill_step_streams_at(monkeypatch, 3)  # at the stage's third update
    if stage == "train":
        root = make_tree(tmp_path / "tree", per_class=6, size=16)
        preset, sets = None, [s for s in TINY if not s.startswith("data.workers")] + [f"data.root={root}", "data.workers=2"]
    else:
        preset, sets = "tiny", ["data.per_domain=16", "data.pool=32", "data.image_size=16", "data.workers=2",
                                "data.eval_batch_size=16", "pretrain.steps=4", "pretrain.batch_size=8", "train.steps=2"]
    kept = interrupt_kept(lambda: execute("table2.8-dropout", preset, sets, out=tmp_path / "runs"))
    assert len(kept) == 1 and len(calls) == 3 and alive == [2]
    assert _workers() - before == set()


def test_a_failed_rich_features_pretraining_kept_by_its_caller_leaves_no_workers(tmp_path: Path, monkeypatch):
    """The rich-features pre-training stage (the packaged MNIST file's miniature, two loader workers)
    killed in its training, its exception kept: the stage's step stream ends its workers with the
    stage (`with stream:` in rich_features.run_pretrain), not when the exception is dropped."""
    from test_rich_features_method import RECIPE, TINY

    from owai.experiment import execute

    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    calls, alive, before = kill_step_streams_at(monkeypatch, 2)  # at the stage's second update
    kept = interrupt_kept(lambda: execute(RECIPE, "tiny", [*TINY, "stage=pretrain", "data.workers=2"], out=tmp_path / "runs"))
    assert len(kept) == 1 and len(calls) == 2 and alive == [2]
    assert _workers() - before == set()


@pytest.mark.parametrize("stage, settings", [("synthesis", ["init=bonsai", "rounds=2"]), ("downstream", ["init=erm"])])
def test_a_camelyon17_run_killed_in_a_later_stage_leaves_no_workers(stage, settings, tmp_path: Path, monkeypatch):
    """As the test above, for the stages after the discovery rounds: Bonsai's synthesis and the
    downstream training (from round 0's network, `init: erm`), each killed at its own second update
    with two loader workers, its exception kept: each stage's step stream ends its workers with it."""
    from camelyon_tree import make_camelyon
    from test_camelyon17 import tiny

    from owai.experiment import execute
    from owai.methods import camelyon17 as method

    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    current: list[str] = []
    real_stage = method.train_stage

    def staged(ctx, name, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - which stage is training
        current.append(name)
        return real_stage(ctx, name, *args, **kwargs)

    real_at, calls, alive = images.StepStream.at, [], []
    before = _workers()

    def killed(self, step):  # noqa: ANN001, ANN202
        if current and current[-1] == stage:
            calls.append(step)
            if len(calls) == 2:
                alive.append(len(_workers() - before))  # this stage's workers (and the run's evaluation workers)
                raise KeyboardInterrupt
        return real_at(self, step)

    monkeypatch.setattr(method, "train_stage", staged)
    monkeypatch.setattr(images.StepStream, "at", killed)
    sets = [s for s in tiny(make_camelyon(tmp_path / "data"))
            if not s.startswith(("data.workers", *(("bonsai.synthesis",) if stage == "downstream" else ())))]
    kept = []
    try:
        execute("table2.6-camelyon17", None, [*sets, "data.workers=2", "train.epochs=1", *settings],
                out=tmp_path / "runs")
    except KeyboardInterrupt as e:
        kept.append(e)
    assert len(kept) == 1 and len(calls) == 2 and alive and alive[0] >= 2, (kept, calls, alive, current)
    assert _workers() - before == set()
