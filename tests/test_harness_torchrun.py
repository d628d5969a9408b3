"""`owai eval harness` under torchrun (`owai.evals.harness.DataParallelLM`, `_share_documents`): each rank
answers the requests of its share of every task's documents, built as one process builds them; rank 0's
answer log is the job's one log, keyed by question, so a run killed on any number of ranks resumes on
any other; the results are one process's. Fast tests: threads standing for the ranks; the slow one
runs `torchrun --nproc_per_node 2` (gloo)."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


class Killed(KeyboardInterrupt):
    """The kill, raised from inside the model."""


class ThreadRanks:
    """`n` threads standing for the ranks of a torchrun job: owai.distributed's world and collectives
    exchange Python objects between them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
        import torch

        from owai import distributed

        self.n, self.local = n, threading.local()
        barrier, box = threading.Barrier(n, timeout=60), {}

        def exchange(obj: Any) -> list[Any]:  # all_gather_object: every rank's object, in rank order
            box[self.local.rank] = obj
            barrier.wait()
            out = [box[r] for r in range(n)]
            barrier.wait()
            return out

        monkeypatch.setattr(distributed, "world", lambda: distributed.World(self.local.rank, n, self.local.rank))
        monkeypatch.setattr(distributed, "gather_objects", exchange)
        monkeypatch.setattr(distributed, "broadcast_object", lambda obj: exchange(obj)[0])
        monkeypatch.setattr(distributed, "gather_tensors", lambda t: torch.cat([x.reshape(-1) for x in exchange(t)]))
        monkeypatch.setattr(distributed, "barrier", lambda: exchange(None) and None)

    def run(self, work: Callable[[int], Any]) -> dict[int, Any]:
        """`work(rank)` on every rank; {rank: what it returned or raised}."""
        got: dict[int, Any] = {}

        def rank(r: int) -> None:
            self.local.rank = r
            try:
                got[r] = work(r)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                got[r] = exc

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return got


def lengths_lm(kill_at: int | None = None) -> Any:
    """A harness LM answering a generation with the prompt's length and a log-likelihood with minus the
    continuation's length; it records what it is asked and can be killed at its `kill_at`-th request."""
    from lm_eval.api.model import LM

    class Lengths(LM):
        def __init__(self) -> None:
            super().__init__()
            self.asked: list[str] = []
            self.calls = 0

        def _ask(self, text: str) -> None:
            if len(self.asked) == kill_at:
                raise Killed
            self.asked.append(text)

        def generate_until(self, requests, disable_tqdm=False):
            self.calls += 1
            out = []
            for request in requests:
                self._ask(request.args[0])
                out.append(str(len(request.args[0])))
                self.cache_hook.add_partial("generate_until", request.args, out[-1])
            return out

        def loglikelihood(self, requests, disable_tqdm=False):
            self.calls += 1
            out = []
            for request in requests:
                self._ask(request.args[1])
                out.append((-float(len(request.args[1])), True))
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

    return Lengths()


def generations(n: int) -> list[Any]:
    from lm_eval.api.instance import Instance

    return [Instance("generate_until", {}, ("x" * k, {"until": ["\n"]}), k) for k in range(1, n + 1)]


def test_each_rank_answers_only_what_rank_0s_log_lacks_and_rank_0_logs_every_answer(tmp_path, monkeypatch) -> None:
    """A run killed in one process after 3 answers, resumed on two ranks (each its own share of the
    requests, as lm-eval gives them): each rank asks its model only the requests the log lacks, in
    rounds, and gets the others from rank 0's log; rank 0 logs every answer of every rank, in the one
    answers.jsonl. The log of that run then serves a resume on three ranks (nothing asked again)."""
    from owai.evals import harness
    from owai.evals.answers import AnswerLog

    requests = generations(9)
    path = tmp_path / "answers.jsonl"
    with pytest.raises(Killed):
        harness.log_answers(lengths_lm(kill_at=3), AnswerLog(path)).generate_until(requests)
    want = [str(k) for k in range(1, 10)]

    shares = {r: requests[r::2] for r in range(2)}  # lm-eval's share: document i on rank i mod W
    models = {r: lengths_lm() for r in range(2)}
    got = ThreadRanks(monkeypatch, 2).run(
        lambda r: harness.DataParallelLM(models[r], AnswerLog(path) if r == 0 else None).generate_until(shares[r]))
    assert got == {0: want[0::2], 1: want[1::2]}
    assert models[0].asked == ["x" * k for k in (5, 7, 9)] and models[1].asked == ["x" * k for k in (4, 6, 8)]
    assert models[0].calls == models[1].calls == 2  # rounds of 1 then 2 (a quick round doubles)
    assert len(AnswerLog(path)) == 9 and sorted(p.name for p in tmp_path.iterdir()) == ["answers.jsonl"]

    with monkeypatch.context() as three:
        models = {r: lengths_lm(kill_at=0) for r in range(3)}
        got = ThreadRanks(three, 3).run(
            lambda r: harness.DataParallelLM(models[r], AnswerLog(path) if r == 0 else None).generate_until(requests[r::3]))
    assert got == {r: want[r::3] for r in range(3)}


def test_a_round_is_logged_once_every_rank_finished_it_and_a_kill_keeps_the_rounds_before(tmp_path, monkeypatch) -> None:
    """Two ranks killed in their third round: the log holds the first two rounds of both ranks (1 + 2
    requests each) and a one-process resume asks only for the rest, to the same answers."""
    from owai.evals import harness
    from owai.evals.answers import AnswerLog

    requests = generations(10)
    path = tmp_path / "answers.jsonl"
    got = ThreadRanks(monkeypatch, 2).run(
        lambda r: harness.DataParallelLM(lengths_lm(kill_at=3), AnswerLog(path) if r == 0 else None)
        .generate_until(requests[r::2]))
    assert all(isinstance(v, Killed) for v in got.values()), got
    assert len(AnswerLog(path)) == 6 and len(path.read_text().splitlines()) == 2
    resumed = lengths_lm()
    with monkeypatch.context() as one:
        from owai import distributed

        one.setattr(distributed, "world", lambda: distributed.World())
        answers = harness.log_answers(resumed, AnswerLog(path)).generate_until(requests)
    assert answers == [str(k) for k in range(1, 11)]
    assert resumed.asked == ["x" * k for k in (7, 8, 9, 10)]


def test_round_sizes_follow_the_slowest_rank() -> None:
    from owai.evals import harness
    from owai.evals.answers import FLUSH_SECONDS

    assert harness.next_round(4, 0.0) == 8 and harness.next_round(harness.MAX_ROUND, 0.0) == harness.MAX_ROUND
    assert harness.next_round(4, FLUSH_SECONDS) == 4
    assert harness.next_round(4, 3 * FLUSH_SECONDS) == 2 and harness.next_round(1, 3 * FLUSH_SECONDS) == 1


def test_ranks_left_with_different_numbers_of_requests_meet_until_every_rank_is_done(tmp_path, monkeypatch) -> None:
    """A run killed after 2 answers, resumed on two ranks: rank 0 has 4 requests left, rank 1 three. The
    rank done first keeps joining the rounds' gathers until the other is done too (else that one waits
    in its gather for ever)."""
    from owai.evals import harness
    from owai.evals.answers import AnswerLog

    requests = generations(9)
    path = tmp_path / "answers.jsonl"
    with pytest.raises(Killed):
        harness.log_answers(lengths_lm(kill_at=2), AnswerLog(path)).generate_until(requests)
    models = {r: lengths_lm() for r in range(2)}
    got = ThreadRanks(monkeypatch, 2).run(
        lambda r: harness.DataParallelLM(models[r], AnswerLog(path) if r == 0 else None).generate_until(requests[r::2]))
    want = [str(k) for k in range(1, 10)]
    assert got == {0: want[0::2], 1: want[1::2]}
    assert (len(models[0].asked), len(models[1].asked)) == (4, 3) and len(AnswerLog(path)) == 9


def test_a_job_without_an_answer_log_answers_each_ranks_share(monkeypatch) -> None:
    """`evaluate` wraps a model that is not one yet as DataParallelLM(model), with no log on rank 0."""
    from owai.evals import harness

    models = {r: lengths_lm() for r in range(2)}
    got = ThreadRanks(monkeypatch, 2).run(lambda r: harness.DataParallelLM(models[r]).generate_until(generations(5)[r::2]))
    assert got == {0: ["1", "3", "5"], 1: ["2", "4"]}


def test_a_slow_rank_keeps_every_ranks_rounds_short(monkeypatch) -> None:
    """Round sizes follow the slowest rank (every rank computes them from the same gathered times): a
    rank over 2 FLUSH_SECONDS per round keeps both ranks' rounds at one request, however quick the other."""
    import time

    from owai.evals import answers, harness

    monkeypatch.setattr(answers, "FLUSH_SECONDS", 0.1)
    models = {r: lengths_lm() for r in range(2)}
    quick = models[1].generate_until
    models[1].generate_until = lambda requests, disable_tqdm=False: time.sleep(0.25) or quick(requests)
    got = ThreadRanks(monkeypatch, 2).run(lambda r: harness.DataParallelLM(models[r]).generate_until(generations(6)[r::2]))
    assert got == {0: ["1", "3", "5"], 1: ["2", "4", "6"]}
    assert models[0].calls == models[1].calls == 3


def test_an_inner_lm_that_answers_fewer_requests_is_one_line(monkeypatch) -> None:
    from owai.errors import OwaiError
    from owai.evals import harness

    inner = lengths_lm()
    whole = inner.generate_until
    inner.generate_until = lambda requests, disable_tqdm=False: whole(requests)[:-1]
    got = ThreadRanks(monkeypatch, 1).run(lambda r: harness.DataParallelLM(inner).generate_until(generations(3)))
    assert isinstance(got[0], OwaiError) and str(got[0]) == "the harness model answered 0 of 1 generate_until requests"


def test_ranks_asking_different_request_types_at_once_stop_with_one_line(monkeypatch) -> None:
    from owai.errors import OwaiError
    from owai.evals import harness
    from lm_eval.api.instance import Instance

    scoring = [Instance("loglikelihood", {}, ("a", " b"), 0)]

    def work(r: int) -> Any:
        lm = harness.DataParallelLM(lengths_lm())
        return lm.generate_until(generations(2)) if r == 0 else lm.loglikelihood(scoring)

    got = ThreadRanks(monkeypatch, 2).run(work)
    assert all(isinstance(v, OwaiError) and "different harness requests" in str(v) for v in got.values()), got


def test_the_lms_collectives_are_owais(monkeypatch) -> None:
    """What lm-eval's evaluator calls: the ranks' request counts gathered as one tensor (0-d counts
    too), every rank's metrics on rank 0 only, a barrier."""
    import torch

    from owai import distributed
    from owai.evals import harness

    assert distributed.gather_tensors(torch.tensor(7)).tolist() == [7]  # one process: itself, as one element

    def work(r: int) -> Any:
        inner = lengths_lm()
        inner._rank, inner._world_size = r, 2  # an HFLM that took accelerate's ranks: set back to answer alone
        lm = harness.DataParallelLM(inner)
        lm.barrier()
        return (lm.rank, lm.world_size, lm.all_gather(torch.tensor(10 + r)).tolist(), lm.gather_object({"rank": r}),
                (inner.rank, inner.world_size))

    got = ThreadRanks(monkeypatch, 2).run(work)
    assert got == {0: (0, 2, [10, 11], [{"rank": 0}, {"rank": 1}], (0, 1)), 1: (1, 2, [10, 11], None, (0, 1))}


def test_the_results_read_the_models_information_through_the_wrapper() -> None:
    """simple_evaluate adds the LM's tokenizer information to the results (`add_tokenizer_info`, an HFLM's
    tokenizer): the same under torchrun, through DataParallelLM, as in one process."""
    from types import SimpleNamespace

    from lm_eval.loggers.utils import add_tokenizer_info

    from owai.evals import harness

    inner = lengths_lm()
    inner.tokenizer = SimpleNamespace(pad_token="<pad>", pad_token_id=0, eos_token="</s>", eos_token_id=2,
                                      bos_token="<s>", bos_token_id=1)
    one, ranked = {}, {}
    add_tokenizer_info(one, inner)
    add_tokenizer_info(ranked, harness.DataParallelLM(inner))
    assert ranked == one and one["tokenizer_eos_token"] == ["</s>", "2"]


def test_the_harness_before_its_ranked_lm_api_is_refused(monkeypatch) -> None:
    from lm_eval.api.model import LM

    from owai.errors import OwaiError
    from owai.evals import harness

    monkeypatch.delattr(LM, "gather_object")
    with pytest.raises(OwaiError, match="only through accelerate's Accelerator"):
        harness.check_data_parallel()


def _built(task: Any, **kwargs: Any) -> list[tuple[int, Any]]:
    task.set_config(key="num_fewshot", value=3)
    task.set_fewshot_seed(seed=1234)  # as simple_evaluate sets it
    task.build_all_requests(**kwargs)
    return [(i.doc_id, i.args) for i in task.instances]


def test_a_ranks_share_of_the_requests_is_one_processs_few_shot_prompts_included() -> None:
    """With shots, lm-eval's own sharded build draws a rank's few-shot examples afresh: its prompts are
    not one process's. `_share_documents` builds every document as one process does and keeps the rank's."""
    from owai.distributed import World
    from owai.evals import harness

    manager = harness.builtin_tasks()  # indexed once per process
    task = "owai_gen_smoke"
    whole = _built(manager.load([task])["tasks"][task], limit=9)
    for rank in range(3):
        load = harness._share_documents(manager, 9, World(rank, 3, rank))
        share = _built(load([task])["tasks"][task], limit=9, rank=rank, world_size=3)
        assert share == [(i, args) for i, args in whole if i % 3 == rank]
    theirs = _built(manager.load([task])["tasks"][task], limit=9, rank=1, world_size=3)
    assert [i for i, _ in theirs] == [1, 4, 7] and theirs != [(i, args) for i, args in whole if i % 3 == 1]


def test_a_task_with_fewer_documents_than_ranks_is_one_line(monkeypatch) -> None:
    """A --limit under the number of ranks is refused before the run; a task with fewer documents than
    ranks, when it is loaded (on every rank alike)."""
    from owai.distributed import World
    from owai.errors import OwaiError
    from owai.evals import harness
    from owai.methods.harness_eval import Config, Harness

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(OwaiError, match="limit 2: fewer documents per task than the 3 ranks"):
        Harness.validate(Config(model="reference:oracle", tasks=["owai_mc_smoke"], limit=2))

    load = harness._share_documents(harness.builtin_tasks(), 2, World(0, 3, 0))
    with pytest.raises(OwaiError, match=r"owai_mc_smoke has 2 documents \(--limit\), fewer than the 3 ranks"):
        load(["owai_mc_smoke"])
    load = harness._share_documents(harness.builtin_tasks(), 3, World(0, 3, 0))  # one document per rank will do
    assert list(load(["owai_mc_smoke"])["tasks"]) == ["owai_mc_smoke"]


# ---------------------------------------------------------------- torchrun, 2 gloo ranks


def rolling_task(folder: Path) -> Path:
    """An include_path task of loglikelihood_rolling requests (word perplexity) on a local JSONL."""
    folder.mkdir()
    rows = [{"text": " ".join(["the cat sat on the mat"] * (k + 1)) + f" {k}"} for k in range(5)]
    (folder / "rolling.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "rolling.yaml").write_text(
        "task: owai_local_rolling\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(folder / 'rolling.jsonl'))}\n"
        "output_type: loglikelihood_rolling\ntest_split: test\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n")
    return folder


@pytest.mark.slow  # three torchrun jobs and three runs in this process (about two minutes on 2 cores); `pytest -m slow`
def test_under_torchrun_the_ranks_share_the_documents_out_to_one_processs_results(tmp_path, capsys, monkeypatch) -> None:
    """`owai eval harness` on 2 gloo ranks: a tiny model on the two smoke tasks with 2 shots (a random
    sampler) and 9 documents (unequal shares, padded), and a rolling task of 5 documents: the same
    results as one process (0/1 means equal, the perplexity to its last bits), one run directory, one
    answers.jsonl with the same answers. A run killed in one process resumes on two ranks, and a
    two-rank run killed after its first rounds resumes in one process, both to the same results."""
    from conftest import as_if_killed, cli_in_process, save_tiny_gpt2, torchrun
    from owai.evals import harness
    from owai.evals.answers import AnswerLog

    model = save_tiny_gpt2(tmp_path / "lm", positions=2048)
    tasks = rolling_task(tmp_path / "tasks")
    args = ["eval", "harness", "-q", "--model", str(model), "--tasks", "owai_mc_smoke,owai_gen_smoke,owai_local_rolling",
            "--num-fewshot", "2", "--limit", "9", "--set", f"include_path=[{json.dumps(str(tasks))}]"]

    def run_dir(out: Path) -> Path:
        (found,) = (out / "table4.1-harness").iterdir()
        return found

    def results(run: Path) -> dict[str, Any]:
        return json.loads((run / "results.json").read_text())

    def same(a: dict[str, Any], b: dict[str, Any]) -> None:
        rows_a, rows_b = ({r["metric"]: r["measured"] for r in x["rows"]} for x in (a, b))
        assert rows_a.keys() == rows_b.keys() and len(rows_a) == 3
        for metric, value in rows_a.items():
            assert rows_b[metric] == (pytest.approx(value, rel=1e-12) if "perplexity" in metric else value), metric
        assert {t: r["sample_len"] for t, r in a["details"]["results"].items()} == \
            {t: r["sample_len"] for t, r in b["details"]["results"].items()} == \
            {"owai_mc_smoke": 9, "owai_gen_smoke": 9, "owai_local_rolling": 5}

    def two_ranks(extra: list[str], out: Path | None = None) -> None:
        where = ["-o", str(out)] if out is not None else []
        proc = torchrun(2, ["-m", "owai", *extra, *where], cwd=tmp_path, timeout=300,
                        before_retry=lambda: out is not None and shutil.rmtree(out, ignore_errors=True))
        assert proc.returncode == 0, proc.stderr[-3000:]

    code, _, err = cli_in_process([*args, "-o", str(tmp_path / "one")], capsys)
    assert code == 0, err
    one = run_dir(tmp_path / "one")
    two_ranks(args, tmp_path / "two")
    two = run_dir(tmp_path / "two")
    same(results(one), results(two))
    assert sorted(p.name for p in two.glob("answers*")) == ["answers.jsonl"] and not list(two.glob("error.rank*"))
    logged = dict(AnswerLog(one / "answers.jsonl")._answers)
    assert dict(AnswerLog(two / "answers.jsonl")._answers) == logged and len(logged) == 9 * 4 + 9 + 5

    # killed in one process at its 21st log-likelihood, resumed on two ranks
    real, scored = harness.OwaiLM._score, []

    def score(self, context, continuation):
        if len(scored) == 20:
            raise Killed
        scored.append(continuation)
        return real(self, context, continuation)

    with monkeypatch.context() as patch:
        patch.setattr(harness.OwaiLM, "_score", score)
        code, _, err = cli_in_process([*args, "-o", str(tmp_path / "killed")], capsys)
    assert code == 130, err
    killed = run_dir(tmp_path / "killed")
    assert 0 < len(AnswerLog(killed / "answers.jsonl")) < len(logged)
    two_ranks(["eval", "harness", "-q", "--resume", str(killed)])
    same(results(one), results(killed))
    assert sorted(p.name for p in killed.glob("answers*")) == ["answers.jsonl"]

    # the two-rank run as if killed after its first two rounds, resumed in one process
    lines = (two / "answers.jsonl").read_text().splitlines(keepends=True)
    (two / "answers.jsonl").write_text("".join(lines[:2]))
    as_if_killed(two)
    code, _, err = cli_in_process(["eval", "harness", "-q", "--resume", str(two)], capsys)
    assert code == 0, err
    same(results(one), results(two))
