"""Issue #38: recall and in-context classification episodes (owai/data/recall.py), their scoring
(owai/evals/recall.py) and the table4.4-recall pipeline (owai/methods/recall.py) on its tiny preset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from owai.data.recall import (KEYS, Pieces, bucket_of, buckets_for, icl_episode, recall_episode, training_episode)
from owai.errors import OwaiError
from owai.evals.recall import accuracy_by_group, score
from conftest import SHARED_DATA, as_if_killed, as_sets, cli_in_process, run_owai
from test_chapter4_training import corpus

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "table4.4-recall.yaml"
FILLER_ID = 10_000  # filler tokens are >= this, so no piece of text can repeat a planted fact


WORD_IDS: dict[str, int] = {}


def toy_encode(text: str) -> list[int]:
    """A word-level stand-in tokenizer: one id per distinct word, digits one id each (like a small BPE's)."""
    out = []
    for word in text.replace(".", " .").replace(":", " :").split():
        if word.isdigit():
            out += [5000 + int(d) for d in word]
        else:
            out.append(WORD_IDS.setdefault(word, len(WORD_IDS) + 1))
    return out


@pytest.fixture
def pieces() -> Pieces:
    return Pieces(toy_encode, value_digits=2)


def filler(n: int) -> np.ndarray:
    return np.arange(FILLER_ID, FILLER_ID + n, dtype=np.int64)


def count(tokens: np.ndarray, sub: tuple[int, ...]) -> list[int]:
    """Start positions where `sub` occurs in `tokens`."""
    n = len(sub)
    return [i for i in range(len(tokens) - n + 1) if tuple(int(t) for t in tokens[i:i + n]) == sub]


@pytest.mark.parametrize("length,buckets", [(512, ["near", "near", "mid", "mid"]),
                                            (2048, ["near", "mid", "far"] * 2),
                                            (4096, ["near", "mid", "far"] * 3)])
@pytest.mark.parametrize("seed", range(5))
def test_recall_answers_are_planted_once_at_the_stated_distance_in_their_bucket(pieces, length, buckets, seed):
    rng = np.random.default_rng(seed)
    ep = recall_episode(rng, pieces, filler(length), length, buckets)
    assert ep.tokens.shape == (length,) and len(ep.queries) == len(buckets)
    assert sorted(q.group for q in ep.queries) == sorted(buckets)
    assert len({q.key for q in ep.queries}) == len(buckets)  # distinct keys
    assert ep.queries[-1].start + len(ep.queries[-1].answer) + len(pieces.end) == length  # the queries end the episode
    first_query = min(q.start for q in ep.queries)
    for q in ep.queries:
        fact = pieces.prefix + pieces.word(q.key) + pieces.is_ + q.answer + pieces.end
        before = count(ep.tokens[:first_query - len(pieces.prefix + pieces.word(q.key) + pieces.is_)], fact)
        assert len(before) == 1, f"fact {q.key} planted {len(before)} times"
        value_at = before[0] + len(pieces.prefix + pieces.word(q.key) + pieces.is_)
        assert value_at == q.source and q.start - q.source == q.distance
        assert tuple(ep.tokens[q.start:q.start + len(q.answer)]) == q.answer  # teacher-forced answer in place
        # the key's query prompt appears exactly twice: the fact and the query
        assert len(count(ep.tokens, pieces.prefix + pieces.word(q.key) + pieces.is_)) == 2
        lo, hi = buckets_for(256, 512)[q.group]
        assert lo <= q.distance and (hi is None or q.distance < hi)
        assert bucket_of(q.distance, 256, 512) == q.group
    assert ep.filler == int((ep.tokens >= FILLER_ID).sum())  # the rest is the filler text, in order
    text = ep.tokens[ep.tokens >= FILLER_ID]
    assert (np.diff(text) == 1).all()


def test_recall_episode_is_a_function_of_its_seed(pieces):
    a = recall_episode(np.random.default_rng(3), pieces, filler(2048), 2048, ["near", "mid", "far"])
    b = recall_episode(np.random.default_rng(3), pieces, filler(2048), 2048, ["near", "mid", "far"])
    c = recall_episode(np.random.default_rng(4), pieces, filler(2048), 2048, ["near", "mid", "far"])
    assert np.array_equal(a.tokens, b.tokens) and a.queries == b.queries
    assert not np.array_equal(a.tokens, c.tokens)


def test_recall_buckets_and_refusals(pieces):
    assert [bucket_of(d, 256, 512) for d in (1, 255, 256, 511, 512, 4000)] == ["near", "near", "mid", "mid", "far", "far"]
    with pytest.raises(OwaiError, match="cannot plant"):
        recall_episode(np.random.default_rng(0), pieces, filler(512), 512, ["far"])  # no room past 512 in 512 tokens
    with pytest.raises(OwaiError, match="unknown distance bucket"):
        recall_episode(np.random.default_rng(0), pieces, filler(512), 512, ["nearby"])
    with pytest.raises(OwaiError, match="filler text"):
        recall_episode(np.random.default_rng(0), pieces, filler(10), 512, ["near"])
    assert len(set(KEYS)) >= 64


@pytest.mark.parametrize("labels", ["semantic", "anonymous"])
@pytest.mark.parametrize("shots", [1, 3, 8])
def test_icl_demonstrations_and_queries(pieces, labels, shots):
    rng = np.random.default_rng(shots)
    length, classes, items = 1024, 4, 8
    ep = icl_episode(rng, pieces, filler(length), length, shots, labels, classes, items, n_queries=classes)
    assert ep.tokens.shape == (length,) and len(ep.spans) == shots * classes
    # every demonstration "item: label." maps items to one label; each class has its own label
    label_of: dict[tuple[int, ...], tuple[int, ...]] = {}
    per_label: dict[tuple[int, ...], int] = {}
    for start, end in ep.spans:
        demo = tuple(int(t) for t in ep.tokens[start:end])
        colon = demo.index(pieces.label[0])
        item, label = demo[:colon], demo[colon + len(pieces.label):-len(pieces.end)]
        assert label_of.setdefault(item, label) == label
        per_label[label] = per_label.get(label, 0) + 1
    assert sorted(per_label.values()) == [shots] * classes  # `shots` demonstrations per class
    if labels == "anonymous":
        assert {pieces.word(f"class_{j}") for j in range(classes)} == set(per_label)
    last = max(e for _, e in ep.spans)
    for q in ep.queries:
        assert q.answer in per_label and q.start > last
        assert tuple(ep.tokens[q.start:q.start + len(q.answer)]) == q.answer
        item = pieces.word(q.key)
        if q.group == "seen":  # the nearest demonstration of the item carries the answer, at the stated distance
            assert label_of[item] == q.answer
            assert tuple(ep.tokens[q.source:q.source + len(q.answer)]) == q.answer and q.distance == q.start - q.source
        else:
            assert item not in label_of and q.source == -1
    if shots >= items:
        assert all(q.group == "seen" for q in ep.queries)  # a full cycle shows every item


@pytest.mark.parametrize("n_facts", [1, 12, 17])
def test_dense_training_recall_episodes_plant_every_fact_once_before_its_query(pieces, n_facts):
    # training places facts by random gaps, not rejection: 17 facts fill 513 tokens nearly full
    for seed in range(5):
        ep = recall_episode(np.random.default_rng(seed), pieces, filler(513), 513, None, n_facts)
        assert len(ep.queries) == n_facts and ep.tokens.shape == (513,)
        first_query = min(q.start for q in ep.queries)
        for q in ep.queries:
            lead = pieces.prefix + pieces.word(q.key) + pieces.is_
            fact = lead + q.answer + pieces.end
            (at,) = count(ep.tokens[:first_query - len(lead)], fact)
            assert at + len(lead) == q.source and q.start - q.source == q.distance > 0
            assert tuple(ep.tokens[q.start:q.start + len(q.answer)]) == q.answer
        text = ep.tokens[ep.tokens >= FILLER_ID]
        assert ep.filler == len(text) and (np.diff(text) == 1).all()
    with pytest.raises(OwaiError, match="cannot plant 30 facts"):
        recall_episode(np.random.default_rng(0), pieces, filler(513), 513, None, 30)


def test_icl_query_classes_are_drawn_on_their_own_and_items_never_repeat(pieces):
    # classes in turn would leak: the answers already in the query block tell the next one
    sequences = []
    for seed in range(30):
        ep = icl_episode(np.random.default_rng(seed), pieces, filler(1024), 1024, 1, "anonymous", 4, 8, n_queries=8)
        assert len(ep.queries) == 8 and len({q.key for q in ep.queries}) == 8  # a repeat could copy the first's answer
        sequences.append(tuple(q.answer for q in ep.queries))
    # some episode asks a class twice within its first 4 queries, and query 5 is not always query 1's class
    assert any(len(set(s[:4])) < 4 for s in sequences) and any(s[4] != s[0] for s in sequences)
    # more queries than items: repeats only once a class's items are all asked
    ep = icl_episode(np.random.default_rng(0), pieces, filler(1024), 1024, 1, "anonymous", 2, 2, n_queries=6)
    assert len(ep.queries) == 6 and len({q.key for q in ep.queries}) <= 4
    counts = {a: [q.answer for q in ep.queries].count(a) for a in {q.answer for q in ep.queries}}
    for q_ans, n in counts.items():
        keys = {q.key for q in ep.queries if q.answer == q_ans}
        assert len(keys) == min(n, 2)


def test_training_episodes_fit_and_mix(pieces):
    rng = np.random.default_rng(0)
    kinds = set()
    for _ in range(40):
        ep = training_episode(rng, pieces, filler(513), 513, 0.5, 8, 8, 4, 8, queries_per_class=2)
        assert ep.tokens.shape == (513,) and ep.queries
        icl = ep.queries[0].group in ("seen", "unseen")
        kinds.add(icl)
        if icl:
            assert len(ep.queries) == 8 and len({q.key for q in ep.queries}) == 8
    assert kinds == {True, False}


class Copier(torch.nn.Module):
    """A 'model' that predicts, after a query prompt, the value of the fact with the same key: it
    looks up the tokens that followed the previous occurrence of the current 3-token context."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids: torch.Tensor):
        B, T = input_ids.shape
        logits = torch.zeros(B, T, self.vocab)
        for b in range(B):
            seen: dict[tuple[int, ...], int] = {}
            ids = input_ids[b].tolist()
            for t in range(T):
                ctx = tuple(ids[max(0, t - 2):t + 1])
                if ctx in seen and seen[ctx] + 1 < T:
                    logits[b, t, ids[seen[ctx] + 1]] = 1.0
                seen[ctx] = t
        return type("Out", (), {"logits": logits})()


def test_scoring_by_teacher_forcing(pieces):
    rng = np.random.default_rng(1)
    episodes = [recall_episode(rng, pieces, filler(512), 512, ["near", "mid"]) for _ in range(3)]
    right = score(Copier(FILLER_ID + 600), episodes, torch.device("cpu"), batch_size=2)
    assert [len(r) for r in right] == [2, 2, 2] and all(all(r) for r in right)
    groups = accuracy_by_group(episodes, right)
    assert groups["all"] == (1.0, 6) and groups["near"] == (1.0, 3) and groups["mid"] == (1.0, 3)
    wrong = score(Copier(FILLER_ID + 600), [e.__class__(np.roll(e.tokens, 0) * 0 + FILLER_ID, e.queries) for e in episodes],
                  torch.device("cpu"))  # nothing planted: nothing recalled
    assert accuracy_by_group(episodes, wrong)["all"] == (0.0, 6)


# -- the recipe's pipeline, tiny preset -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    text = corpus(tmp_path_factory.mktemp("corpus") / "docs.jsonl", docs=300)
    out = tmp_path_factory.mktemp("recall-runs")
    proc = run_owai("recipes", "run", str(RECIPE), "-p", "tiny", "-q", "-o", str(out), *as_sets([f"data.source={text}"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = [p for p in (out / "table4.4-recall").iterdir() if p.is_dir()]
    return run


def test_tiny_pipeline_trains_both_models_and_measures_every_point(tiny_run):
    results = json.loads((tiny_run / "results.json").read_text())
    rows = {r["metric"]: r["measured"] for r in results["rows"]}
    for arch in ("mmv2", "transformer"):
        for scale in ("1x", "4x", "8x"):  # 256, 1024 and 2048 tokens, trained at 256
            for name in (f"{arch}.recall.{scale}", f"{arch}.recall.{scale}.near", f"{arch}.recall.{scale}.mid"):
                assert 0.0 <= rows[name] <= 1.0
            for labels in ("semantic", "anonymous"):
                for shots in (1, 8):
                    assert 0.0 <= rows[f"{arch}.icl.{labels}.{scale}.{shots}shot"] <= 1.0
        assert f"{arch}.recall.4x.far" in rows and f"{arch}.recall.1x.far" not in rows  # far: lengths >= 2x training
    assert "mmv2.recall_no_ltm.8x.far" in rows and "transformer.recall_no_ltm.8x" not in rows
    assert rows["recall.chance"] == pytest.approx(1 / 90) and rows["icl.chance"] == 0.5
    assert (tiny_run / "figures" / "recall.png").stat().st_size > 10_000
    assert (tiny_run / "models" / "mmv2" / "config.json").is_file()
    claims = {c["id"]: c for c in results["claims"]}
    # every claim's metrics measured (the tiny run's lengths are 1x / 4x / 8x too); a claim is n/a only
    # for its premise (4 steps learn nothing) or its presets, never for a missing number
    assert len(claims) == 12
    for c in claims.values():
        assert c["verdict"] in ("holds", "misses") or c["detail"].startswith(("premise fails", "judged at preset")), c
    evals = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in evals} >= {"mmv2-eval", "transformer-eval"}


def test_a_resume_after_the_evaluations_logs_each_models_scores_once(tiny_run, tmp_path, capsys):
    """Killed after both models' evaluations were logged (before results.json): the resume evaluates
    them again and replaces their rows, to the same numbers; each row used to be there twice."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    as_if_killed(run)
    # in this process (an `owai` subprocess costs seconds of imports; the fixture's run is the console script)
    code, _, err = cli_in_process(["recipes", "run", str(RECIPE), "--resume", str(run), "-q"], capsys)
    assert code == 0, err[-3000:]

    def evaluation_rows(path: Path) -> list[dict]:
        rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if r["stage"].endswith("-eval")]

    assert evaluation_rows(run) == evaluation_rows(tiny_run) and len(evaluation_rows(run)) == 2
    before = {r["metric"]: r["measured"] for r in json.loads((tiny_run / "results.json").read_text())["rows"]}
    after = {r["metric"]: r["measured"] for r in json.loads((run / "results.json").read_text())["rows"]}
    assert after == before


def test_owai_report_prints_the_verdicts(tiny_run, capsys):
    code, out, err = cli_in_process(["report", str(tiny_run)], capsys)
    assert code == 0, err
    for claim in ("v2-recall-holds-8x", "no-ltm-far-to-chance", "v2-icl-rises-8x-anonymous", "transformer-icl-flat-8x"):
        assert claim in out
    assert "holds" in out or "misses" in out


def test_episodes_that_cannot_fit_are_refused_before_a_run_directory(tmp_path, capsys):
    # in process (the console script's own one-line path: tests/test_invocations_issue40.py)
    text = corpus(tmp_path / "docs.jsonl", docs=40)
    code, _, err = cli_in_process(["recipes", "run", str(RECIPE), "-p", "tiny", "-o", str(tmp_path / "out"),
                                   *as_sets([f"data.source={text}", "episodes.max_shots=40"])], capsys)
    assert code == 2 and err.startswith("error: episodes do not fit")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    code, _, err = cli_in_process(["recipes", "run", str(RECIPE), "-p", "tiny", "-o", str(tmp_path / "out"),
                                   *as_sets([f"data.source={text}", "data.documents=true"])], capsys)
    assert code == 2 and "data.documents must be false" in err and not (tmp_path / "out").exists()


def test_every_preset_of_the_recipe_validates():
    from owai import recipes
    from owai.experiment import resolve

    r = recipes.load(str(RECIPE))
    assert {"cpu", "paper", "tiny"} <= set(r.presets) and r.method == "lm_recall"
    have_data = (SHARED_DATA / "text" / "sotu.tar.gz").is_file()  # else all but the corpus (`missing_ok`)
    for preset in r.presets:
        cfg, resolved = resolve(r, preset, [], missing_ok=not have_data)
        assert resolved["preset"] == preset and ("missing" in resolved) == (not have_data)
    cpu, _ = resolve(r, "cpu", [], missing_ok=not have_data)
    assert cpu.data.block_size == 512 and cpu.recall.lengths == [512, 2048, 4096] and cpu.model.size == "tiny"
