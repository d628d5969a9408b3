"""A killed evaluation resumes where it was killed (`owai.evals.answers`): `eval ruler`, `eval icl`
and `eval harness` log each answer in the run directory, and `--resume` asks the model only for the
prompts a kill left unanswered, in the batches the uninterrupted run made, to its results."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import cli_in_process, save_tiny_gpt2
from owai.evals.answers import AnswerLog

pytestmark = pytest.mark.usefixtures("one_thread")

CLOCK = ("date", "start_time", "end_time", "total_evaluation_time_seconds")  # what the harness records of when it ran


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> Path:
    return save_tiny_gpt2(tmp_path_factory.mktemp("tiny-lm"), positions=2048)


class Killed(KeyboardInterrupt):
    """The kill, raised from inside the model (a Ctrl-C arrives the same way; a SIGKILL, which runs
    no Python at all, is tested apart)."""


class Echo:
    """A suite model that records every batch it is asked and answers each prompt with its length."""

    def __init__(self, batch_size: int, kill_at: int | None = None) -> None:
        self.batch_size, self.kill_at, self.batches = batch_size, kill_at, []

    def generate_many(self, prompts: list[str], **kwargs: Any) -> list[str]:
        if self.kill_at is not None and len(self.batches) == self.kill_at:
            raise Killed
        self.batches.append(list(prompts))
        return [f"{len(p)}:{kwargs.get('max_new_tokens')}" for p in prompts]


def test_a_line_cut_by_a_kill_is_dropped_and_the_log_goes_on_after_the_whole_ones(tmp_path) -> None:
    """One line per write: a line cut by a kill (the last) loses that whole write, never part of it."""

    path = tmp_path / "answers.jsonl"
    path.write_text('{"answers": {"a": "one"}}\n{"answers": {"b": [-1.5, true], "e": "x"}}\n{"answers": {"c": "z", "f')
    log = AnswerLog(path)
    assert len(log) == 3 and log.get("a") == "one" and log.get("b") == [-1.5, True] and "c" not in log
    assert path.read_text().endswith('"x"}}\n')  # cut back to the last whole line before anything is appended
    log.add("c", "line\nbreak")
    log.add("d", float("-inf"))
    log.flush()
    log.add_batch({"f": "1", "g": "2"})
    again = AnswerLog(path)
    assert [again.get(k) for k in "abcdefg"] == ["one", [-1.5, True], "line\nbreak", float("-inf"), "x", "1", "2"]
    assert len(path.read_text().splitlines()) == 4


def test_generate_all_asks_again_only_what_a_kill_left_in_the_uninterrupted_batches(tmp_path) -> None:
    from owai.evals.causal_lm import generate_all

    prompts = ["p0", "p11", "p222", "p0", "p4444", "p55555", "p666666", "p0"]  # "p0" asked three times
    whole = Echo(3)
    want = generate_all(whole, prompts, answers=AnswerLog(tmp_path / "whole.jsonl"), max_new_tokens=5)
    assert want == [f"{len(p)}:5" for p in prompts] and len(whole.batches) == 3
    killed = Echo(3, kill_at=2)
    with pytest.raises(Killed):
        generate_all(killed, prompts, answers=AnswerLog(tmp_path / "killed.jsonl"), max_new_tokens=5)
    resumed, done = Echo(3), []
    got = generate_all(resumed, prompts, progress=done.append, answers=AnswerLog(tmp_path / "killed.jsonl"),
                       max_new_tokens=5)
    assert got == want
    assert killed.batches + resumed.batches == whole.batches  # the third batch, as it was, and nothing else
    assert done == [6, 2]  # answered before the kill, then the last batch
    other = Echo(3)  # other generation settings are other questions
    generate_all(other, prompts, answers=AnswerLog(tmp_path / "killed.jsonl"), max_new_tokens=6)
    assert other.batches == whole.batches



def test_batches_are_made_longest_first_and_answered_in_the_prompts_order(tmp_path) -> None:
    """Prompts of similar lengths share a batch (less padding; equal-length rows for the models that
    read none), longest first as lm-evaluation-harness makes them; one prompt at a time keeps the
    prompts' order. The answers come back in the prompts' order either way."""
    from owai.evals.causal_lm import generate_all

    prompts = ["bb", "dddd", "a", "cc", "eeeee", "ff"]
    want = [f"{len(p)}:None" for p in prompts]
    model = Echo(2)
    assert generate_all(model, prompts, answers=AnswerLog(tmp_path / "a.jsonl")) == want
    assert model.batches == [["eeeee", "dddd"], ["bb", "cc"], ["ff", "a"]]  # ties in the prompts' order
    model = Echo(2)  # no log, no progress: one generate_many call, which makes the batches itself
    assert generate_all(model, prompts) == want and model.batches == [["eeeee", "dddd", "bb", "cc", "ff", "a"]]
    alone = Echo(1)
    assert generate_all(alone, prompts) == want and alone.batches == [prompts]  # one call: generate_many's own order
    alone = Echo(1)
    assert generate_all(alone, prompts, progress=lambda k: None) == want and alone.batches == [[p] for p in prompts]


def _thread_ranks(monkeypatch, timeout: float) -> Any:
    """Two threads as two torchrun ranks: `distributed.world()` is the calling thread's rank (set
    `local.rank` in each thread), and the object collectives exchange through a barrier."""
    import threading

    from owai import distributed

    local, barrier, box = threading.local(), threading.Barrier(2, timeout=timeout), {}

    def exchange(obj):  # all_gather_object: every rank's object, in rank order
        box[local.rank] = obj
        barrier.wait()
        out = [box[0], box[1]]
        barrier.wait()
        return out

    monkeypatch.setattr(distributed, "world", lambda: distributed.World(local.rank, 2, local.rank))
    monkeypatch.setattr(distributed, "gather_objects", exchange)
    monkeypatch.setattr(distributed, "broadcast_object", lambda obj: exchange(obj)[0])
    return local


def _in_two_threads(rank: Any) -> None:
    """rank(0) and rank(1) at once, each in its thread; returns when both are done."""
    import threading

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_under_torchrun_each_rank_answers_its_share_of_the_batches(tmp_path, monkeypatch) -> None:
    """Two ranks (threads standing for them): the batches one process makes go to the ranks in turn,
    every rank returns every answer, rank 0's log says what a kill left and is the only one written."""
    from owai import distributed
    from owai.evals.causal_lm import generate_all

    local = _thread_ranks(monkeypatch, timeout=60)
    prompts = [f"p{'x' * i}" for i in reversed(range(9))]  # longest first: the order batches are made in
    path = tmp_path / "answers.jsonl"
    with monkeypatch.context() as one:  # a killed one-process run answered the first batch
        one.setattr(distributed, "world", lambda: distributed.World())
        with pytest.raises(Killed):
            generate_all(Echo(2, kill_at=1), prompts, answers=AnswerLog(path))
    models, got, done = {0: Echo(2), 1: Echo(2)}, {}, {0: [], 1: []}

    def rank(r: int) -> None:
        local.rank = r
        got[r] = generate_all(models[r], prompts, progress=done[r].append, answers=AnswerLog(path) if r == 0 else None)

    _in_two_threads(rank)
    want = [f"{len(p)}:None" for p in prompts]
    assert got == {0: want, 1: want} and done[0] == done[1] == [2, 2, 2, 2, 1]
    assert models[0].batches == [prompts[2:4], prompts[6:8]] and models[1].batches == [prompts[4:6], prompts[8:]]
    assert len(AnswerLog(path)) == 9 and sorted(p.name for p in tmp_path.iterdir()) == ["answers.jsonl"]


def test_under_torchrun_a_rank_without_log_or_progress_answers_its_share(tmp_path, monkeypatch) -> None:
    """Rank 0 holds the log and the progress bar, rank 1 neither (as under torchrun): rank 1 still takes
    its turn in the rounds rather than answering every prompt alone (and leaving rank 0 waiting)."""
    from owai.evals.causal_lm import generate_all

    local = _thread_ranks(monkeypatch, timeout=10)
    prompts = [f"p{'x' * i}" for i in reversed(range(5))]  # longest first: the order batches are made in
    models, got, done = {0: Echo(2), 1: Echo(2)}, {}, []

    def rank(r: int) -> None:
        local.rank = r
        try:
            got[r] = generate_all(models[r], prompts, **({"progress": done.append, "answers": AnswerLog(tmp_path / "a.jsonl")}
                                                         if r == 0 else {}))
        except Exception as exc:  # noqa: BLE001 - the assertion reads it
            got[r] = exc

    _in_two_threads(rank)
    want = [f"{len(p)}:None" for p in prompts]
    assert got == {0: want, 1: want} and done == [2, 2, 1]
    assert models[0].batches == [prompts[:2], prompts[4:]] and models[1].batches == [prompts[2:4]]


def test_a_model_that_answers_fewer_prompts_than_asked_is_one_line() -> None:
    """Else the suites, which zip prompts with answers, would score the rest against nothing."""
    from owai.errors import OwaiError
    from owai.evals.causal_lm import generate_all

    class Short(Echo):
        def generate_many(self, prompts: list[str], **kwargs: Any) -> list[str]:
            return super().generate_many(prompts, **kwargs)[:-1]

    with pytest.raises(OwaiError, match="^Short answered 1 of 2 prompts$"):
        generate_all(Short(2), ["a", "b"])


def test_a_batch_reaches_the_log_whole_however_long_it_took(tmp_path, monkeypatch) -> None:
    """A batch slower than FLUSH_SECONDS (RULER at 128k tokens) is still written in one piece: a kill
    after a write never leaves part of a batch, which would shift every later batch of the resume."""
    from owai.evals import answers as answer_log
    from owai.evals.causal_lm import generate_all

    monkeypatch.setattr(answer_log, "FLUSH_SECONDS", 0.0)
    real, writes = answer_log.AnswerLog.flush, []

    def flush_then_killed(self) -> None:
        real(self)
        writes.append(len(answer_log.AnswerLog(self.path)))
        if len(writes) == 2:
            raise Killed

    prompts = [f"p{i}" * (i + 1) for i in range(8)]
    whole = Echo(3)
    generate_all(whole, prompts, answers=answer_log.AnswerLog(tmp_path / "whole.jsonl"))
    monkeypatch.setattr(answer_log.AnswerLog, "flush", flush_then_killed)
    with pytest.raises(Killed):
        generate_all(Echo(3), prompts, answers=answer_log.AnswerLog(tmp_path / "killed.jsonl"))
    monkeypatch.setattr(answer_log.AnswerLog, "flush", real)
    assert writes == [3, 6]
    resumed = Echo(3)
    generate_all(resumed, prompts, answers=answer_log.AnswerLog(tmp_path / "killed.jsonl"))
    assert resumed.batches == whole.batches[2:]


def test_an_answer_damaged_into_another_json_value_is_asked_again(tmp_path) -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import LM

    from owai.evals import harness
    from owai.evals.answers import answer_key, occurrence_keys
    from owai.evals.causal_lm import generate_all

    path = tmp_path / "answers.jsonl"
    (key,) = occurrence_keys([("generate", "p0", {})])
    path.write_text(json.dumps({"answers": {key: None}}) + "\n")
    model = Echo(2)
    assert generate_all(model, ["p0"], answers=AnswerLog(path)) == ["2:None"] and model.batches == [["p0"]]

    class Scores(LM):
        asked: list = []

        def loglikelihood(self, requests, disable_tqdm=False):
            self.asked += [r.args for r in requests]
            return [(-1.0, True) for _ in requests]

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            self.asked += [r.args for r in requests]
            return [-2.0 for _ in requests]

        def generate_until(self, requests, disable_tqdm=False):
            raise NotImplementedError

    pairs = [("a", " b"), ("c", " d"), ("e", " f"), ("i", " j"), ("g", " h")]
    damaged = [7, ["x", True], [-1.0, "yes"], [True, True], [-3.5, False]]  # the last one is whole; a bool is no score
    path = tmp_path / "harness.jsonl"
    logged = {answer_key("loglikelihood", *pair): value for pair, value in zip(pairs, damaged)}
    rolled = {answer_key("loglikelihood_rolling", "text"): "oops", answer_key("loglikelihood_rolling", "flag"): True}
    path.write_text(json.dumps({"answers": {**logged, **rolled}}) + "\n")
    lm = harness.log_answers(Scores(), AnswerLog(path))
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    assert got == [(-1.0, True)] * 4 + [(-3.5, False)]
    rolling = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(("text", "flag"))]
    assert lm.loglikelihood_rolling(rolling) == [-2.0, -2.0]
    assert Scores.asked == [*pairs[:4], ("text",), ("flag",)]


def _run_dir(out: Path, recipe: str) -> Path:
    (run_dir,) = (out / recipe).iterdir()
    return run_dir


def _killed_then_resumed(args: list[str], recipe: str, out: Path, capsys, monkeypatch, kill_at: int) -> tuple[dict, int]:
    """Run `owai ARGS` with the model killed at its `kill_at`-th batch (counted from 0), resume it;
    its results and the number of batches the resume asked."""
    from owai.evals.causal_lm import CausalLM

    real, asked, statuses = CausalLM.generate_many, [], []

    def generate_many(self: CausalLM, prompts: list[str], **kwargs: Any) -> list[str]:
        if len(asked) == kill_at:
            asked.append(None)
            raise Killed
        asked.append(prompts)
        statuses.append(json.loads((_run_dir(out, recipe) / "status.json").read_text())["status"])
        return real(self, prompts, **kwargs)

    monkeypatch.setattr(CausalLM, "generate_many", generate_many)
    rc, _, err = cli_in_process([*args, "-o", str(out)], capsys)
    assert rc == 130, err
    run_dir = _run_dir(out, recipe)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "interrupted"
    assert not (run_dir / "results.json").exists()
    assert len(AnswerLog(run_dir / "answers.jsonl")) > 0
    before = len(asked)
    rc, _, err = cli_in_process([*args[:2], "-q", "--resume", str(run_dir)], capsys)
    assert rc == 0, err
    assert set(statuses) == {"running"}  # while the resume runs, not the killed attempt's "interrupted"
    return json.loads((run_dir / "results.json").read_text()), len(asked) - before


def _logged(path: Path) -> tuple[int, int]:
    """(the model's answers, the finished cells) in an answer log: a continuation is a string, a
    finished cell (a RULER task at one length, an in-context prompt set) a dict."""
    values = list(AnswerLog(path)._answers.values())
    return sum(isinstance(v, str) for v in values), sum(isinstance(v, dict) for v in values)


def _uninterrupted(args: list[str], recipe: str, out: Path, capsys) -> tuple[dict, int, int]:
    """Run `owai ARGS`; its results, the number of answers it logged and of cells it finished."""
    rc, _, err = cli_in_process([*args, "-o", str(out)], capsys)
    assert rc == 0, err
    run_dir = _run_dir(out, recipe)
    return json.loads((run_dir / "results.json").read_text()), *_logged(run_dir / "answers.jsonl")


def test_eval_ruler_killed_in_a_cell_resumes_there_to_the_uninterrupted_results(tiny_lm, shared_data, tmp_path, capsys,
                                                                               monkeypatch) -> None:
    from owai.evals import ruler

    args = ["eval", "ruler", "-q", "--model", str(tiny_lm), "--tasks", "niah_single_1,niah_multikey_2",
            "--ctx", "1024,1536", "--n", "3", "--set", "tokenizer=", "--set", "batch_size=2"]
    whole, answered, cells = _uninterrupted(args, "table4.4-ruler", tmp_path / "whole", capsys)
    assert (answered, cells) == (12, 4)  # 2 tasks x 2 lengths x 3 prompts, each logged once; each cell once
    real, built = ruler.Task.build, []
    monkeypatch.setattr(ruler.Task, "build", lambda self, n, length, *a, **k: built.append((self.name, length))
                        or real(self, n, length, *a, **k))
    resumed, asked = _killed_then_resumed(args, "table4.4-ruler", tmp_path / "killed", capsys, monkeypatch, kill_at=5)
    # the first task's 4 batches (2 per length) and the second's first were logged: 3 batches are left,
    # and the first task's two finished cells are read back, not built again (the checks before each
    # run build the 1024-token cells of both: short lengths are tried for room)
    assert asked == 3
    assert built[-2:] == [("niah_multikey_2", 1024), ("niah_multikey_2", 1536)]
    assert built.count(("niah_single_1", 1536)) == 1
    assert resumed["rows"] == whole["rows"]
    assert resumed["details"]["results"] == whole["details"]["results"]


def test_eval_icl_killed_between_strategies_resumes_there_to_the_uninterrupted_results(tiny_lm, tmp_path, capsys,
                                                                                      monkeypatch) -> None:
    args = ["eval", "icl", "-q", "--model", str(tiny_lm), "--task", "synthetic", "--shots", "1", "--n", "4",
            "--set", "synthetic_classes=4", "--set", "max_new_tokens=3", "--labels", "semantic", "--set", "batch_size=3"]
    from owai.evals.causal_lm import CausalLM

    whole, answered, cells = _uninterrupted(args, "fig4.6-icl", tmp_path / "whole", capsys)
    assert cells == 4  # one per prompt strategy
    real, counted = CausalLM.count_tokens_many, []
    monkeypatch.setattr(CausalLM, "count_tokens_many", lambda self, texts: counted.append(len(texts)) or real(self, texts))
    resumed, asked = _killed_then_resumed(args, "fig4.6-icl", tmp_path / "killed", capsys, monkeypatch, kill_at=3)
    per_strategy = 2  # 4 queries in batches of 3
    assert answered % 4 == 0 and asked == answered // 4 * per_strategy - 3
    # killed in the second strategy: the resume counts the prompts of the last three, the first read back
    assert counted == [4] * (2 + 3)
    assert resumed["rows"] == whole["rows"]
    assert resumed["details"]["semantic"]["results"] == whole["details"]["semantic"]["results"]


def test_a_harness_model_answers_a_logged_request_from_the_log(tiny_lm, tmp_path) -> None:
    """`log_answers` on owai's adapter: every request's answer is logged; on a new adapter over the
    same log (a resumed run) those are answered without the model, as they were, and only the
    others are computed."""
    import torch
    from lm_eval.api.instance import Instance

    from owai.evals import harness
    from owai.evals.causal_lm import open_model

    lm = open_model(str(tiny_lm), "", torch.device("cpu"), "float32")
    pairs = [("The cat", " sat."), ("", "hello"), ("a b", " c")]
    scoring = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    rolling = [Instance("loglikelihood_rolling", {}, ("one two three " * 3,), 0)]
    generating = [Instance("generate_until", {}, ("Once", {"until": ["\n"], "max_gen_toks": 4}), 0)]
    first = harness.log_answers(harness.OwaiLM(lm), AnswerLog(tmp_path / "answers.jsonl"))
    want = (first.loglikelihood(scoring[:2]), first.loglikelihood_rolling(rolling), first.generate_until(generating))

    again = harness.OwaiLM(lm)
    scored = []
    real = again._score
    again._score = lambda context, continuation: scored.append(continuation) or real(context, continuation)
    again.greedy = lambda *a: pytest.fail("a logged generation was computed again")
    harness.log_answers(again, AnswerLog(tmp_path / "answers.jsonl"))
    got = (again.loglikelihood(scoring), again.loglikelihood_rolling(rolling), again.generate_until(generating))
    assert got[0][:2] == want[0] and got[1:] == want[1:]
    assert all(isinstance(answer, tuple) for answer in got[0])
    assert len(scored) == 1  # the third pair only
    assert got[0][2] == harness.OwaiLM(lm).loglikelihood(scoring[2:])[0]


def test_a_harness_model_killed_in_a_call_keeps_the_answers_it_gave(tmp_path, monkeypatch) -> None:
    """Any harness LM (here a minimal one, as the harness's HFLM reports each answer to its cache
    hook): the answers given before a kill in the middle of one call are logged, flushed within
    FLUSH_SECONDS, and the resumed call asks only for the rest."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import LM

    from owai.evals import answers as answer_log
    from owai.evals import harness

    class Lengths(LM):
        def __init__(self, kill_at: int | None = None) -> None:
            super().__init__()
            self.kill_at, self.asked = kill_at, []

        def generate_until(self, requests, disable_tqdm=False):
            out = []
            for request in requests:
                if len(self.asked) == self.kill_at:
                    raise Killed
                self.asked.append(request.args[0])
                out.append(str(len(request.args[0])))
                self.cache_hook.add_partial("generate_until", request.args, out[-1])
            return out

        def loglikelihood(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

    requests = [Instance("generate_until", {}, ("x" * n, {"until": ["\n"]}), n) for n in range(1, 7)]
    # Ctrl-C inside the call, FLUSH_SECONDS not yet past: what the hook logged is flushed on the way out
    with pytest.raises(Killed):
        harness.log_answers(Lengths(kill_at=4), answer_log.AnswerLog(tmp_path / "ctrl-c.jsonl")).generate_until(requests)
    assert len(answer_log.AnswerLog(tmp_path / "ctrl-c.jsonl")) == 4
    killed = harness.log_answers(Lengths(kill_at=4), answer_log.AnswerLog(tmp_path / "answers.jsonl"))
    monkeypatch.setattr(answer_log, "FLUSH_SECONDS", 0.0)  # every hook call reaches the disk
    with pytest.raises(Killed):
        killed.generate_until(requests)
    resumed = Lengths()
    assert harness.log_answers(resumed, answer_log.AnswerLog(tmp_path / "answers.jsonl")).generate_until(requests) == \
        ["1", "2", "3", "4", "5", "6"]
    assert resumed.asked == ["xxxxx", "xxxxxx"]


# -- the language-model evaluations (mosaic-eval, mosaic-train's final evaluation, eval posloss) --


class CountedLM:
    """A tiny GPT-2 over the byte tokenizer that counts its forward passes and can be killed at one."""

    def __init__(self, kill_at: int | None = None) -> None:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=64, n_embd=16, n_layer=1, n_head=2,
                                                bos_token_id=256, eos_token_id=256))
        self.calls, self.kill_at = 0, kill_at

        def count(*_: Any) -> None:
            if self.kill_at is not None and self.calls == self.kill_at:
                raise Killed
            self.calls += 1

        self.model.register_forward_pre_hook(count)


def lm_windows(n: int = 5, batch: int = 3, length: int = 16) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 256, (n * batch, length + 1), generator=g)
    rows[::4, 5] = 256  # some end-of-text tokens: documents read apart
    windows = [(rows[i:i + batch, :-1], rows[i:i + batch, 1:].clone()) for i in range(0, n * batch, batch)]
    windows[1][1][0, -3:] = -100  # masked targets are not counted
    return windows


def test_lm_losses_resume_bit_exactly_computing_only_the_batches_a_kill_left(tmp_path) -> None:
    """`loss_totals` and `per_position_loss` log each batch's numbers; killed and resumed, they compute
    only the batches left and add up to the uninterrupted run's values to the last bit."""
    import torch

    from owai.evals.lm import BatchLog, loss_totals, per_position_loss

    cpu = torch.device("cpu")
    windows = lm_windows()
    whole = CountedLM()
    want_totals = loss_totals(whole.model, windows, cpu, eot=256)
    want_curve = per_position_loss(whole.model, windows, cpu, eot=256)
    assert whole.calls == 10
    for kill_at in (0, 2, 4):
        path = tmp_path / f"answers-{kill_at}.jsonl"
        for evaluate, scope, want in ((loss_totals, "val", want_totals), (per_position_loss, "posloss", want_curve)):
            with pytest.raises(Killed):
                evaluate(CountedLM(kill_at).model, windows, cpu, 256, BatchLog(AnswerLog(path), ("m", scope), cpu))
            resumed = CountedLM()
            got = evaluate(resumed.model, windows, cpu, 256, BatchLog(AnswerLog(path), ("m", scope), cpu))
            assert got == want and resumed.calls == 5 - kill_at
    again = CountedLM()  # everything logged: nothing is computed
    assert loss_totals(again.model, windows, cpu, 256, BatchLog(AnswerLog(path), ("m", "val"), cpu)) == want_totals
    assert again.calls == 0
    other = CountedLM()  # another scope (model, pass) or other tokens are other batches
    loss_totals(other.model, windows, cpu, 256, BatchLog(AnswerLog(path), ("other", "val"), cpu))
    changed = [(x, y) for x, y in windows]
    changed[3] = (changed[3][0].flip(1), changed[3][1])
    loss_totals(other.model, changed, cpu, 256, BatchLog(AnswerLog(path), ("m", "val"), cpu))
    assert other.calls == 5 + 1


def test_a_damaged_batch_result_is_computed_again(tmp_path) -> None:
    import torch

    from owai.evals.lm import BatchLog, per_position_loss

    cpu = torch.device("cpu")
    windows = lm_windows()
    path = tmp_path / "answers.jsonl"
    want = per_position_loss(CountedLM().model, windows, cpu, None, BatchLog(AnswerLog(path), ("m",), cpu))
    rows = [json.loads(line)["answers"] for line in path.read_text().splitlines()]
    assert [len(r) for r in rows] == [1] * 5  # one line per batch, written as it is computed
    ((first, curve),), ((second, _),) = rows[0].items(), rows[1].items()
    rows[:2] = [{first: curve[:-1]}, {second: ["x"] * len(curve)}]  # a curve one number short, one of strings
    path.write_text("".join(json.dumps({"answers": r}) + "\n" for r in rows))
    again = CountedLM()
    assert per_position_loss(again.model, windows, cpu, None, BatchLog(AnswerLog(path), ("m",), cpu)) == want
    assert again.calls == 2


def test_continuations_resume_from_the_prompts_a_kill_left(tmp_path) -> None:
    import torch

    from owai.data.text import ByteTokenizer
    from owai.evals.lm import BatchLog, continuations

    cpu = torch.device("cpu")
    prompts = ["Once upon a time", "The cat", "Lily and"]
    tok = ByteTokenizer()
    whole = CountedLM()
    want = continuations(whole.model, tok, prompts, cpu, max_new_tokens=4)
    per_prompt = whole.calls // 3
    path = tmp_path / "answers.jsonl"
    killed = CountedLM(kill_at=per_prompt + 1)  # inside the second prompt's generation
    with pytest.raises(Killed):
        continuations(killed.model, tok, prompts, cpu, max_new_tokens=4, log=BatchLog(AnswerLog(path), ("m",), cpu))
    resumed, done = CountedLM(), []
    got = continuations(resumed.model, tok, prompts, cpu, max_new_tokens=4, progress=lambda: done.append(1),
                        log=BatchLog(AnswerLog(path), ("m",), cpu))
    assert got == want and resumed.calls == 2 * per_prompt and len(done) == 3
    longer = CountedLM()  # other generation settings: asked again
    continuations(longer.model, tok, prompts, cpu, max_new_tokens=5, log=BatchLog(AnswerLog(path), ("m",), cpu))
    assert longer.calls > 0


def test_mosaic_eval_killed_in_its_losses_resumes_there_to_the_uninterrupted_results(tiny_lm, tmp_path, capsys,
                                                                                   monkeypatch) -> None:
    """`owai mosaic-eval` killed in the middle of its per-position losses: the resume computes only the
    batches left, and its results are the uninterrupted run's to the last digit."""
    from owai.evals import lm as lme

    sets = ["data.source=owai-stories:600", "data.block_size=32", "eval.val_batches=3", "eval.batch_size=2",
            "eval.posloss_windows=6", "eval.lengths=[64]", "eval.attention_multiples=[]", "eval.max_new_tokens=3"]
    args = ["mosaic-eval", str(tiny_lm), "-q", *[a for s in sets for a in ("--set", s)]]
    real, calls = lme.token_losses, []

    def counted(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(lme, "token_losses", counted)
    whole, *_ = _uninterrupted(args, "mosaic-eval", tmp_path / "whole", capsys)
    total = len(calls)
    assert total == 3 + 3 + 3 + 3  # validation, training, per-position loss at 32 and at 64 tokens

    def killed_at_8(*a: Any, **kw: Any) -> Any:
        if len(calls) == 8:
            raise Killed
        return counted(*a, **kw)

    calls.clear()
    monkeypatch.setattr(lme, "token_losses", killed_at_8)
    out = tmp_path / "killed"
    rc, _, err = cli_in_process([*args, "-o", str(out)], capsys)
    assert rc == 130, err
    (run_dir,) = out.glob("*/*")
    monkeypatch.setattr(lme, "token_losses", counted)
    calls.clear()
    rc, _, err = cli_in_process(["mosaic-eval", "-q", "--resume", str(run_dir)], capsys)
    assert rc == 0, err
    assert len(calls) == total - 8
    resumed = json.loads((run_dir / "results.json").read_text())
    assert resumed["rows"] == whole["rows"]
    for name in ("posloss", "posloss_64", "continuations"):
        (key,) = [k for k in whole["details"] if k.endswith(f".{name}")]
        assert whole["details"][key] and resumed["details"][key] == whole["details"][key]


def test_mosaic_train_killed_in_its_final_evaluation_resumes_there(tmp_path, capsys, monkeypatch) -> None:
    """mosaic-train killed in the first model's final evaluation (its training done): the resume
    evaluates the model it reads back from its last checkpoint from where the kill was, to the
    uninterrupted run's results."""
    from owai.evals import lm as lme
    from owai.methods import language_model

    sets = ["data.source=owai-stories:1500", "data.tokenizer=bytes", "data.block_size=32", "model.n_layer=1",
            "model.n_embd=32", "model.n_head=2", "model.dropout=0.0", "train.steps=20", "train.batch_size=8",
            "train.warmup=5", "train.eval_every=10", "train.eval_batches=2", "train.checkpoint_every=10",
            "eval.posloss_windows=8", "eval.batch_size=2", "eval.val_batches=2", "eval.attention_sequences=2",
            "eval.max_new_tokens=3"]
    args = ["mosaic-train", "-q", *[a for s in sets for a in ("--set", s)]]
    real_losses, real_evaluate = lme.token_losses, language_model.evaluate_model
    calls: list[str] = []  # the model evaluated at each call of token_losses in a final evaluation
    evaluating: list[str] = []
    kill_at: list[int] = []

    def evaluate_model(ev: Any, run: Any, label: str, *a: Any, **kw: Any) -> Any:
        evaluating.append(label)
        try:
            return real_evaluate(ev, run, label, *a, **kw)
        finally:
            evaluating.clear()

    def token_losses(*a: Any, **kw: Any) -> Any:
        if evaluating:
            if kill_at and len(calls) == kill_at[0]:
                raise Killed
            calls.append(evaluating[0])
        return real_losses(*a, **kw)

    monkeypatch.setattr(language_model, "evaluate_model", evaluate_model)
    monkeypatch.setattr(lme, "token_losses", token_losses)
    whole, *_ = _uninterrupted(args, "fig3.8-depth", tmp_path / "whole", capsys)
    total = len(calls)
    assert calls.count("mm") == calls.count("gpt") > 4
    calls.clear()
    kill_at.append(5)  # the mm evaluation's per-position loss, its second batch
    out = tmp_path / "killed"
    rc, _, err = cli_in_process([*args, "-o", str(out)], capsys)
    assert rc == 130 and calls == ["mm"] * 5, err
    kill_at.clear()
    calls.clear()
    (run_dir,) = out.glob("*/*")
    rc, _, err = cli_in_process(["mosaic-train", "-q", "--resume", str(run_dir)], capsys)
    assert rc == 0, err
    assert len(calls) == total - 5
    resumed = json.loads((run_dir / "results.json").read_text())
    assert resumed["rows"] == whole["rows"] and resumed["details"] == whole["details"]


AGREEMENT_SCRIPT = '''
import json, sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

from owai.evals.answers import AnswerLog
from owai.evals.lm import BatchLog, loss_totals

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=64, n_embd=16, n_layer=1, n_head=2))
calls = []
model.register_forward_pre_hook(lambda *_: calls.append(1))
rows = torch.randint(0, 256, (10, 17), generator=torch.Generator().manual_seed(1))
windows = [(rows[i:i + 2, :-1], rows[i:i + 2, 1:]) for i in range(0, 10, 2)]
cpu = torch.device("cpu")
rank = int(sys.argv[2])
log = lambda: BatchLog(AnswerLog(Path(sys.argv[1]) / f"rank{rank}.jsonl"), ("m",), cpu)
# before the job: rank 0 logged all five batches, rank 1 (killed earlier) the first two
want = loss_totals(model, windows if rank == 0 else windows[:2], cpu, log=log())
want = loss_totals(model, windows, cpu)
calls.clear()
dist.init_process_group("gloo")
assert dist.get_rank() == rank
got = loss_totals(model, windows, cpu, log=log())
first = len(calls)
again = loss_totals(model, windows, cpu, log=log())
print(json.dumps({"rank": rank, "first": first, "again": len(calls) - first, "equal": [got == want, again == want]}))
dist.destroy_process_group()
'''


def test_under_torchrun_a_batch_is_read_back_only_when_every_rank_logged_it(tmp_path) -> None:
    """Rank 0 has all five batches logged, rank 1 two: both compute the last three (under FSDP a forward
    pass is a collective every rank must enter), and a second pass computes nothing."""
    from conftest import torchrun

    script = tmp_path / "agree.py"
    script.write_text(AGREEMENT_SCRIPT.replace("int(sys.argv[2])", "int(__import__('os').environ['RANK'])"))
    proc = torchrun(2, [str(script), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the two ranks' lines can reach the shared output interleaved on one line
    reports = sorted((json.loads(m) for m in re.findall(r'\{"rank".*?\]\}', proc.stdout)), key=lambda r: r["rank"])
    assert reports == [{"rank": r, "first": 3, "again": 0, "equal": [True, True]} for r in (0, 1)]


SIGKILL_SCRIPT = """
import os, signal, sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from owai.evals.answers import AnswerLog
from owai.evals.lm import BatchLog, per_position_loss

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=64, n_embd=16, n_layer=1, n_head=2))
calls = []

def count(*_):
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # nothing of Python runs after this: no finally, no flush
    calls.append(1)

model.register_forward_pre_hook(count)
rows = torch.randint(0, 256, (10, 17), generator=torch.Generator().manual_seed(1))
windows = [(rows[i:i + 2, :-1], rows[i:i + 2, 1:]) for i in range(0, 10, 2)]
cpu = torch.device("cpu")
per_position_loss(model, windows, cpu, log=BatchLog(AnswerLog(Path(sys.argv[1])), ("m",), cpu))
"""


def test_a_sigkilled_evaluation_keeps_every_batch_it_finished(tmp_path) -> None:
    """SIGKILL (what the out-of-memory killer sends, and what follows SLURM's SIGTERM) runs no
    `finally`: the batches computed before it are on disk all the same, and the resume computes the
    rest only."""
    import signal
    import subprocess
    import sys

    import torch

    from owai.evals.lm import BatchLog, per_position_loss

    script, log = tmp_path / "killed.py", tmp_path / "answers.jsonl"
    script.write_text(SIGKILL_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(log)], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert len(AnswerLog(log)) == 3
    rows = torch.randint(0, 256, (10, 17), generator=torch.Generator().manual_seed(1))
    windows = [(rows[i:i + 2, :-1], rows[i:i + 2, 1:]) for i in range(0, 10, 2)]
    cpu = torch.device("cpu")
    whole = CountedLM()
    want = per_position_loss(whole.model, windows, cpu)
    resumed = CountedLM()
    assert per_position_loss(resumed.model, windows, cpu, log=BatchLog(AnswerLog(log), ("m",), cpu)) == want
    assert resumed.calls == 2


def test_each_rank_has_its_own_answer_log(tmp_path, monkeypatch) -> None:
    """Under torchrun the language-model evaluations log on every rank: one file per rank, one writer
    per file (rank 0's is the run's answers.jsonl)."""
    from owai import distributed
    from owai.evals.answers import run_log

    assert run_log(tmp_path).path == tmp_path / "answers.jsonl"
    monkeypatch.setattr(distributed, "world", lambda: distributed.World(3, 4, 3))
    assert run_log(tmp_path).path == tmp_path / "answers.rank3.jsonl"
