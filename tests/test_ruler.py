"""RULER task construction and scoring (owai/evals/ruler.py; shared/specs/evals.md sec 1).

Loaders run on generated files in the official SQuAD v2 / HotpotQA JSON formats; fitting, haystacks
and reference models use the real GPT-2 tokenizer and Paul Graham essays from $OWAI_DATA."""

from __future__ import annotations

import json
import os
import re
import sys
import types
from collections import Counter
from pathlib import Path

import pytest

from owai.errors import DataMissing, OwaiError
from owai.evals import ruler as R

# ------------------------------------------------------------------------------------ data helpers


def squad_question(question: str, answers: list[str], context: str, qid: str) -> dict:
    return {"question": question, "id": qid, "is_impossible": False,
            "answers": [{"text": a, "answer_start": max(context.find(a), 0)} for a in answers]}


def squad_impossible(question: str, qid: str) -> dict:
    return {"plausible_answers": [{"text": "x", "answer_start": 0}], "question": question, "id": qid,
            "answers": [], "is_impossible": True}


# A tiny SQuAD v2 dev file: 2 articles, 4 paragraphs (one paragraph text in both articles), answerable
# and unanswerable questions.
P_NORMANS = ("The Normans were the people who in the 10th and 11th centuries gave their name to Normandy, a region "
             "in France.")
P_RELIGION = "The Normans were famed for their Catholic piety and their martial spirit."
P_SHARED = "Zebras appear in both articles."
P_COMPLEXITY = "Computational complexity theory classifies problems by their inherent difficulty."
SMALL_SQUAD = {"version": "v2.0", "data": [
    {"title": "Normans", "paragraphs": [
        {"context": P_NORMANS, "qas": [
            squad_question("In what country is Normandy located?", ["France"] * 4, P_NORMANS, "q1"),
            squad_impossible("Who gave their name to Normandy in the 1000's and 1100's", "q2"),
            squad_question("When were the Normans in Normandy?",
                           ["10th and 11th centuries", "in the 10th and 11th centuries"], P_NORMANS, "q3")]},
        {"context": P_RELIGION, "qas": [
            squad_question("What religion were the Normans?", ["Catholic", "Catholic piety"], P_RELIGION, "q4"),
            squad_impossible("What religion were the Franks?", "q5")]},
        {"context": P_SHARED, "qas": [squad_impossible("What appears nowhere?", "q6")]}]},
    {"title": "Computational_complexity_theory", "paragraphs": [
        {"context": P_COMPLEXITY, "qas": [
            squad_question("What does complexity theory classify?", ["problems"], P_COMPLEXITY, "q7")]},
        {"context": P_SHARED, "qas": [squad_question("What appears in both articles?", ["Zebras"], P_SHARED, "q8")]}]}]}


def hotpot_row(qid: str, question: str, answer: str, context: list[list], facts: list[list]) -> dict:
    return {"_id": qid, "answer": answer, "question": question, "supporting_facts": facts, "context": context,
            "type": "bridge", "level": "hard"}


SMALL_HOTPOT = [
    hotpot_row("h1", "Which band did the singer of Zeta join?", "The Quarks",
               [["Zeta (song)", ["Zeta is a song.", " It was sung by Ann Lee."]],
                ["Ann Lee", ["Ann Lee is a singer.", " She joined The Quarks in 1990."]],
                ["Shared Page", ["A page both questions use."]]],
               [["Zeta (song)", 1], ["Ann Lee", 1]]),
    hotpot_row("h2", "Are Alpha and Beta both rivers?", "yes",
               [["Alpha", ["Alpha is a river."]], ["Beta", ["Beta is a river", " in Spain."]],
                ["Shared Page", ["A page both questions use."]]],
               [["Alpha", 0], ["Beta", 0]]),
]


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj), encoding="utf-8")
    return path


def essay_sentences(data_root: Path) -> list[str]:
    text = R.read_essays(data_root / "text" / "paul_graham_essays")
    return [s for s in R.split_sentences(re.sub(r"\s+", " ", text)) if 30 <= len(s) <= 220]


def longest_word(text: str) -> str:
    return max(re.findall(r"[A-Za-z]{4,}", text), key=len)


def essay_squad(data_root: Path, tokenizer, articles: int = 14, per_article: int = 5) -> dict:
    """A SQuAD v2 file of real English: paragraphs of 2 essay sentences (39-41 GPT-2 tokens each, so
    that a haystack's length depends on its size only), 5 per article; one answerable question per
    paragraph (its longest word, twice: duplicate answers) and some unanswerable ones."""
    sentences = essay_sentences(data_root)
    pairs = (" ".join(sentences[i:i + 2]) for i in range(0, len(sentences) - 1, 2))
    texts = [p for p in pairs if 39 <= tokenizer.count(p) <= 41][: articles * per_article]
    data, k = [], 0
    for a in range(articles):
        paragraphs = []
        for _ in range(per_article):
            context = texts[k]
            word = longest_word(context)
            qas = [squad_question(f"Question {k}: which long word is in passage {k}?", [word, word], context, f"s{k}")]
            if k % 3 == 0:
                qas.append(squad_impossible(f"Unanswerable question {k}?", f"u{k}"))
            paragraphs.append({"context": context, "qas": qas})
            k += 1
        data.append({"title": f"Article {a}", "paragraphs": paragraphs})
    return {"version": "v2.0", "data": data}


def essay_hotpot(data_root: Path, tokenizer, questions: int = 10) -> list[dict]:
    """HotpotQA rows of real English: 10 one-sentence paragraphs (15 GPT-2 tokens) per question, 2 gold."""
    sentences = [s for s in essay_sentences(data_root) if tokenizer.count(s) == 15]
    rows = []
    for q in range(questions):
        context = [[f"Page {q}-{j}", [sentences[10 * q + j]]] for j in range(10)]
        answer = longest_word(sentences[10 * q])
        rows.append(hotpot_row(f"h{q}", f"Question {q}: which long word is on page {q}-0?", answer, context,
                               [[f"Page {q}-0", 0], [f"Page {q}-1", 0]]))
    return rows


@pytest.fixture
def gpt2(shared_data: Path) -> R.HFTokenizer:
    return R.gpt2_tokenizer(Path(os.environ["OWAI_DATA"]) / "tokenizers" / "gpt2")


@pytest.fixture
def essays(shared_data: Path) -> Path:
    return Path(os.environ["OWAI_DATA"]) / "text" / "paul_graham_essays"


@pytest.fixture
def pools(gpt2, tmp_path: Path) -> tuple[R.QAData, R.QAData]:
    root = Path(os.environ["OWAI_DATA"])
    squad = R.read_squad(write_json(tmp_path / "dev-v2.0.json", essay_squad(root, gpt2)))
    hotpot = R.read_hotpotqa(write_json(tmp_path / "hotpot_dev_distractor_v1.json", essay_hotpot(root, gpt2)))
    return squad, hotpot


def score(model, task: R.Task, length, n: int, tokenizer) -> float | None:
    """`model`'s score on one task at one length (seed 42)."""
    return R.evaluate(model, [task], [length], n=n, seed=42, tokenizer=tokenizer)["results"][task.name][
        R.context_label(length)]["score"]


def document_headers(prompt: str) -> list[int]:
    return [int(k) for k in re.findall(r"(?:^|\n\n)Document (\d+):\n", prompt)]


# ------------------------------------------------------------------------------------------- loaders


def test_read_squad_pool_and_records(tmp_path: Path) -> None:
    data = R.read_squad(write_json(tmp_path / "dev-v2.0.json", SMALL_SQUAD))
    docs = sorted({P_NORMANS, P_RELIGION, P_SHARED, P_COMPLEXITY})  # unique, sorted
    assert data.kind == "squad" and data.docs == tuple(docs)
    i = {text: docs.index(text) for text in docs}
    assert data.records == (  # file order, unanswerable skipped, duplicate answers kept
        R.QARecord("In what country is Normandy located?", ("France",) * 4, (i[P_NORMANS],),
                   (i[P_RELIGION], i[P_SHARED])),
        R.QARecord("When were the Normans in Normandy?", ("10th and 11th centuries", "in the 10th and 11th centuries"),
                   (i[P_NORMANS],), (i[P_RELIGION], i[P_SHARED])),
        R.QARecord("What religion were the Normans?", ("Catholic", "Catholic piety"), (i[P_RELIGION],),
                   (i[P_NORMANS], i[P_SHARED])),
        R.QARecord("What does complexity theory classify?", ("problems",), (i[P_COMPLEXITY],), (i[P_SHARED],)),
        R.QARecord("What appears in both articles?", ("Zebras",), (i[P_SHARED],), (i[P_COMPLEXITY],)),
    )


def test_read_hotpotqa_pool_and_records(tmp_path: Path) -> None:
    data = R.read_hotpotqa(write_json(tmp_path / "hotpot.json", SMALL_HOTPOT))
    zeta, ann, shared = ("Zeta (song)\nZeta is a song. It was sung by Ann Lee.",
                         "Ann Lee\nAnn Lee is a singer. She joined The Quarks in 1990.",
                         "Shared Page\nA page both questions use.")
    docs = sorted({zeta, ann, shared, "Alpha\nAlpha is a river.", "Beta\nBeta is a river in Spain."})
    assert data.kind == "hotpotqa" and data.docs == tuple(docs)  # sentences joined with no separator
    assert [r.query for r in data.records] == [SMALL_HOTPOT[0]["question"], SMALL_HOTPOT[1]["question"]]
    assert [r.outputs for r in data.records] == [("The Quarks",), ("yes",)]
    assert data.records[0].context == (docs.index(zeta), docs.index(ann), docs.index(shared))
    assert all(r.more_context == () for r in data.records)


def fake_datasets(monkeypatch: pytest.MonkeyPatch, rows_for: dict) -> list:
    calls = []

    def load_dataset(hub_id, config=None, split=None, revision=None):
        calls.append((hub_id, config, split))
        if hub_id not in rows_for:
            raise ConnectionError("Couldn't reach 'https://huggingface.co'\n(offline)")
        return rows_for[hub_id]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_hub_loaders_rebuild_the_file_pools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    squad_rows = [{"id": qa["id"], "title": a["title"], "context": p["context"], "question": qa["question"],
                   "answers": {"text": [x["text"] for x in qa["answers"]], "answer_start": [0] * len(qa["answers"])}}
                  for a in SMALL_SQUAD["data"] for p in a["paragraphs"] for qa in p["qas"]]
    hotpot_rows = [{"id": r["_id"], "question": r["question"], "answer": r["answer"], "type": r["type"],
                    "level": r["level"],
                    "supporting_facts": {"title": [f[0] for f in r["supporting_facts"]],
                                         "sent_id": [f[1] for f in r["supporting_facts"]]},
                    "context": {"title": [c[0] for c in r["context"]], "sentences": [c[1] for c in r["context"]]}}
                   for r in SMALL_HOTPOT]
    calls = fake_datasets(monkeypatch, {R.SQUAD_HUB_ID: squad_rows, R.HOTPOTQA_HUB_ID: hotpot_rows})
    hub_squad, file_squad = R.load_qa("squad", "hf"), R.read_squad(write_json(tmp_path / "s.json", SMALL_SQUAD))
    assert (hub_squad.docs, hub_squad.records) == (file_squad.docs, file_squad.records)
    hub_hotpot = R.load_qa("hotpotqa", "hf")
    file_hotpot = R.read_hotpotqa(write_json(tmp_path / "h.json", SMALL_HOTPOT))
    assert (hub_hotpot.docs, hub_hotpot.records) == (file_hotpot.docs, file_hotpot.records)
    assert calls == [(R.SQUAD_HUB_ID, None, "validation"), (R.HOTPOTQA_HUB_ID, "distractor", "validation")]
    # an article that repeats a paragraph: the rows rebuild it in order, as RULER's read_squad walks it
    repeated = json.loads(json.dumps(SMALL_SQUAD))
    repeated["data"][0]["paragraphs"].append(
        {"context": P_NORMANS, "qas": [squad_question("Where is Normandy?", ["France"], P_NORMANS, "q9")]})
    rows = [{"id": qa["id"], "title": a["title"], "context": p["context"], "question": qa["question"],
             "answers": {"text": [x["text"] for x in qa["answers"]], "answer_start": [0] * len(qa["answers"])}}
            for a in repeated["data"] for p in a["paragraphs"] for qa in p["qas"]]
    fake_datasets(monkeypatch, {R.SQUAD_HUB_ID: rows})
    hub, file = R.load_qa("squad", "hf"), R.read_squad(write_json(tmp_path / "r.json", repeated))
    assert (hub.docs, hub.records) == (file.docs, file.records)
    assert [r.query for r in hub.records].index("Where is Normandy?") == 3  # after the religion paragraph's
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # unreachable on any machine (no real connection is tried)
    with pytest.raises(DataMissing) as err:  # an unreachable hub: one line
        R.load_qa("squad", "hf:someone/squad-copy")
    assert "someone/squad-copy" in str(err.value) and "\n" not in str(err.value)


def test_bad_inputs_are_one_line_errors(tmp_path: Path) -> None:
    errors = []
    with pytest.raises(DataMissing) as err:
        R.read_squad(tmp_path / "missing.json")
    errors.append(err.value)
    (tmp_path / "broken.json").write_text('{"data": [', encoding="utf-8")
    with pytest.raises(OwaiError) as err:
        R.read_squad(tmp_path / "broken.json")
    errors.append(err.value)
    assert "not valid JSON" in str(err.value)
    squad_file = write_json(tmp_path / "squad.json", SMALL_SQUAD)
    for call in (lambda: R.read_hotpotqa(squad_file),  # the wrong format
                 lambda: R.read_squad(write_json(tmp_path / "hotpot.json", SMALL_HOTPOT)),
                 lambda: R.read_squad(write_json(tmp_path / "none.json", {"data": [{"title": "t", "paragraphs": [
                     {"context": "c", "qas": [squad_impossible("q?", "q")]}]}]})),  # no answerable question
                 lambda: R.load_qa("nq", squad_file)):
        with pytest.raises(OwaiError) as err:
            call()
        errors.append(err.value)
    with pytest.raises(DataMissing) as err:
        R.read_essays(tmp_path / "no-essays")
    errors.append(err.value)
    with pytest.raises(DataMissing) as err:
        R.read_essays(tmp_path)  # a folder without .txt files
    errors.append(err.value)
    for name in ("4q", "", "k", "-1", "0", 0, "4.5k", True):
        with pytest.raises(OwaiError) as err:
            R.parse_context_length(name)
        errors.append(err.value)
    with pytest.raises(OwaiError) as err:
        R.synthetic_task("niah_single_2")  # essay variant without --haystack-dir
    errors.append(err.value)
    with pytest.raises(OwaiError) as err:
        R.synthetic_task("niah_single_9")
    errors.append(err.value)
    assert all(str(e) and "\n" not in str(e) for e in errors)


def test_context_lengths() -> None:
    assert [R.parse_context_length(n) for n in ("4k", "8k", "16k", "32k", "64k", "128K")] == [
        4096, 8192, 16384, 32768, 65536, 131072]
    assert R.parse_context_length(1000) == R.parse_context_length("1000") == R.parse_context_length(" 1000 ") == 1000
    assert R.context_label("4K") == "4k" and R.context_label(512) == "512"


# ------------------------------------------------------------------------------------------- scoring


def test_postprocess_and_metrics() -> None:
    assert R.postprocess("  Paris\x00\tFrance \n\x1f") == "Paris\n\nFrance"
    assert R.postprocess(" a\rb\x7f ") == "a\nb\x7f"  # only \x00-\x1f are control characters here
    assert R.match_part("The answer is PARIS.", ["paris", "London"]) == 1.0
    assert R.match_part("Lyon", ["Paris", "London"]) == 0.0
    assert R.match_all("paris and rome", ["Paris", "London", "Rome"]) == pytest.approx(2 / 3)
    # any-match (QA) vs fraction (synthetic): SQuAD's differently-bounded gold strings
    refs = [["10th and 11th centuries", "in the 10th and 11th centuries"], ["Catholic"], ["x", "y", "z"]]
    preds = ["10th and 11th centuries", "catholicism", "x and z"]
    assert R.string_match_part(preds, refs) == 100.0
    assert R.string_match_all(preds, refs) == round(100 * (0.5 + 1 + 2 / 3) / 3, 2) == 72.22
    assert R.string_match_part(["", "no"], [["a"], ["no"]]) == 50.0
    assert R.string_match_all([], []) == 0.0


# ------------------------------------------------------------------------------------ QA construction


def test_qa_template_exact(pools) -> None:
    squad, _ = pools
    task = R.QATask("qa_1", squad)
    prompt = task.render([3, 1], "Who?")
    instruction = ("Answer the question based on the given documents. Only give me the answer and do not output any "
                   "other words.")
    assert prompt == (f"{instruction}\n\nThe following are given documents.\n\nDocument 1:\n{squad.docs[3]}\n\n"
                      f"Document 2:\n{squad.docs[1]}\n\n{instruction}\n\nQuestion: Who? Answer:")
    short = R.QATask("qa_1", squad, template="thesis-short").render([3], "Who?")
    assert "Only give me" not in short and short.startswith("Answer the question based on the given documents.\n\n")


def test_search_size_rules() -> None:
    def linear(size: int) -> int:  # probe tokens with `size` documents of 45 tokens
        return 70 + 45 * size

    assert R.search_size(linear, 2048, 10, "2024", reserve=32) == 40  # 43 fit: the step rule stops at 40
    assert R.search_size(linear, 2048, 10, "2025", reserve=32) == 43  # the binary search finds 43
    assert R.search_size(linear, 1902, 10, "2024", reserve=32) == 50  # an exact hit at 40 exits one step too large
    assert R.search_size(linear, 1902, 10, "2025", reserve=32) == 40
    assert R.search_size(linear, 2048, 10, "2024", cap=25, reserve=32) == 25
    assert R.search_size(linear, 2048, 10, "2025", cap=25, reserve=32) == 25
    assert R.search_size(lambda s: 1500 + s, 2048, 10, "2025", reserve=32) == 40  # head never searches above its 3x bound
    assert R.search_size(lambda s: 1500 + s, 2048, 10, "2025", reserve=32, upper=600) == 516
    assert R.search_size(lambda s: 5000, 2048, 10, "2024") == 0
    assert R.search_size(lambda s: 5000, 2048, 10, "2025") == 10
    probes: list[int] = []
    R.search_size(lambda s: probes.append(s) or linear(s), 2048, 10, "2024", reserve=32)
    assert probes == [10, 20, 30, 40, 50]
    with pytest.raises(OwaiError):
        R.search_size(linear, 2048, 10, "2023")


@pytest.mark.parametrize("rule", R.RULES)
def test_fitting_never_exceeds_the_budget_and_fills_it(gpt2, pools, rule) -> None:
    for data, name in zip(pools, ("qa_1", "qa_2")):
        task = R.qa_task(name, data, rule=rule)
        doc_tokens = max(gpt2.count(R.DOCUMENT_PROMPT.format(i=100, document=d) + "\n\n") for d in data.docs)
        sizes = []
        for budget in (512, 1024, 2048):
            built = task.build(5, budget, gpt2)
            sizes.append(built.size)
            step = 10 if rule == "2024" else 1
            if rule == "2024":
                assert built.size % 10 == 0  # the step rule gives multiples of 10
            assert len(built.samples) == 5
            for sample in built.samples:
                assert sample.fits and sample.tokens == gpt2.count(sample.prompt)
                assert sample.tokens + 32 <= budget
                answer_quirk = gpt2.count(f" {list(sample.outputs)}")
                if sample.size == built.size and built.size > 0:
                    # within one step of the budget (+ the probe's answer quirk; documents differ by <= 2 tokens)
                    slack = answer_quirk + 2 * (sample.size + step) + 8
                    assert budget - (sample.tokens + 32) < step * doc_tokens + slack, (name, rule, budget)
        # (2024 at 512: 10 documents do not fit -> 0, then each question's minimum)
        assert sizes[0] <= sizes[1] < sizes[2]


def test_gold_documents_numbering_and_same_article_distractors(gpt2, pools) -> None:
    squad, hotpot = pools
    for data, name in ((squad, "qa_1"), (hotpot, "qa_2")):
        built = R.qa_task(name, data).build(8, 2048, gpt2)
        for sample in built.samples:
            record = data.records[sample.index]
            headers = document_headers(sample.prompt)
            assert headers == list(range(1, sample.size + 1))  # contiguous from 1
            documents = R.qa_documents(sample.prompt)
            assert len(sample.info["doc_ids"]) == sample.size == len(set(sample.info["doc_ids"]))
            assert [documents[k] for k in range(1, sample.size + 1)] == [data.docs[d] for d in sample.info["doc_ids"]]
            assert {documents[k] for k in sample.info["gold_slots"]} == {data.docs[d] for d in record.context}
            assert set(record.more_context) <= set(sample.info["doc_ids"])  # hard distractors first
            assert R.qa_question(sample.prompt) == record.query
    # SQuAD: for one haystack size the gold paragraph sits in the same slot for every question (sec 1.4.4)
    built = R.qa_task("qa_1", squad).build(12, 1024, gpt2)
    slots = {tuple(s.info["gold_slots"]) for s in built.samples if s.size == built.size}
    assert len(slots) == 1 and len(next(iter(slots))) == 1


def test_same_seed_same_prompts(gpt2, pools) -> None:
    squad, _ = pools
    task = R.qa_task("qa_1", squad)
    first, again, other = (task.build(4, 1024, gpt2, seed=s).samples for s in (42, 42, 7))
    assert [s.prompt for s in first] == [s.prompt for s in again]
    assert [s.prompt for s in first] != [s.prompt for s in other]
    assert R.qa_task("qa_1", squad, rule="2025").build(4, 1024, gpt2, seed=42).samples[0].prompt == \
        R.qa_task("qa_1", squad, rule="2025").build(4, 1024, gpt2, seed=42).samples[0].prompt


def test_haystack_draws_follow_the_rules(pools) -> None:
    squad, hotpot = pools
    task, rng = R.QATask("qa_1", squad), __import__("random").Random(0)
    small = task.documents(rng, 42, 0, 3)  # fewer than the article: own + a sample of more_context
    record = squad.records[0]
    assert len(small) == 3 and record.context[0] in small and set(small) <= set(record.context + record.more_context)
    assert sorted(task.documents(rng, 42, 0, len(squad.docs) + 5)) == list(range(len(squad.docs)))  # 2024: all docs
    cyclic = R.QATask("qa_1", squad, rule="2025").documents(rng, 42, 0, len(squad.docs) + 5)
    assert len(cyclic) == len(squad.docs) + 5 and Counter(Counter(cyclic).values()) == {1: len(squad.docs) - 5, 2: 5}
    # the fresh Random(seed) shuffle: the same permutation pattern for every question of a size
    a, b = task.documents(rng, 42, 0, 20), task.documents(rng, 42, 7, 20)
    assert a.index(squad.records[0].context[0]) == b.index(squad.records[7].context[0])


# ------------------------------------------------------------------------------------ reference models


def test_reference_models_on_qa(gpt2, pools) -> None:
    squad, hotpot = pools
    tasks = [R.qa_task("qa_1", squad), R.qa_task("qa_2", hotpot)]
    oracle = R.evaluate(R.OracleReader(squad, hotpot), tasks, ["1k", 2048], n=8, seed=42, tokenizer=gpt2)
    json.dumps(oracle)  # JSON-able
    for task in ("qa_1", "qa_2"):
        for label in ("1k", "2048"):
            cell = oracle["results"][task][label]
            assert cell["score"] == 100.0 and cell["n"] == 8 and cell["overflow"] == 0 and cell["nulls"] == 0
    assert oracle["qa_mean"] == {"1k": 100.0, "2048": 100.0}
    null = R.evaluate(R.NullModel(), tasks, ["1k"], n=8, seed=42, tokenizer=gpt2)
    assert null["results"]["qa_1"]["1k"] == {**null["results"]["qa_1"]["1k"], "score": 0.0, "nulls": 8, "overflow": 0}
    assert null["qa_mean"] == {"1k": 0.0}
    # an oracle that does not know the pool cannot answer
    assert score(R.OracleReader(), tasks[0], "1k", 3, gpt2) == 0.0


def test_slot_reader_scores_exactly_its_slot(gpt2, pools) -> None:
    squad, _ = pools
    task = R.qa_task("qa_1", squad)
    built = task.build(12, 1024, gpt2)
    max_size = max(s.size for s in built.samples)
    total = 0.0
    for slot in range(1, max_size + 1):
        result = R.evaluate(R.SlotReader(slot, squad), [task], ["1024"], n=12, seed=42, tokenizer=gpt2)
        rows = result["records"]["qa_1"]["1024"]
        assert [r["score"] for r in rows] == [float(slot in r["gold_slots"]) for r in rows]
        fraction = sum(slot in r["gold_slots"] for r in rows) / len(rows)
        assert result["results"]["qa_1"]["1024"]["score"] == round(100 * fraction, 2)
        total += result["results"]["qa_1"]["1024"]["score"]
    assert total == pytest.approx(100.0)  # SQuAD: one gold paragraph, in exactly one slot per question
    gold = built.samples[0].info["gold_slots"][0]
    assert R.evaluate(R.SlotReader(gold, squad), [task], ["1024"], n=12, seed=42,
                      tokenizer=gpt2)["results"]["qa_1"]["1024"]["score"] > 0


def test_overflow_is_reported_never_truncated(gpt2, pools) -> None:
    squad, hotpot = pools
    task = R.qa_task("qa_1", squad)
    built = task.build(6, 2048, gpt2)
    cut = sorted(s.tokens for s in built.samples)[2] + 32  # the model takes exactly the 3 shortest prompts
    result = R.evaluate(R.OracleReader(squad), [task], ["2k"], n=6, seed=42, tokenizer=gpt2, max_tokens=cut)
    cell = result["results"]["qa_1"]["2k"]
    expected = sum(s.tokens + 32 > cut for s in built.samples)
    assert cell["overflow"] == expected >= 3 and cell["score"] == round(100 * (6 - expected) / 6, 2)
    assert all((r["prediction"] is None) == r["overflow"] for r in result["records"]["qa_1"]["2k"])
    none = R.evaluate(R.OracleReader(squad), [task], ["2k"], n=6, seed=42, tokenizer=gpt2, max_tokens=100)
    assert none["results"]["qa_1"]["2k"]["score"] is None and none["results"]["qa_1"]["2k"]["overflow"] == 6
    # a budget the question's own 10 documents cannot fit: overflow, not a truncated prompt
    tiny = R.evaluate(R.OracleReader(hotpot), [R.qa_task("qa_2", hotpot)], ["300"], n=3, seed=42, tokenizer=gpt2)
    assert tiny["results"]["qa_2"]["300"]["overflow"] == 3


# ----------------------------------------------------------------------------------- synthetic tasks


def test_essay_haystack_from_the_real_essays(essays: Path, gpt2) -> None:
    files = sorted(essays.glob("*.txt"))
    assert len(files) == 49
    text = R.read_essays(essays)
    first_words = re.sub(r"\s+", " ", files[0].read_text(encoding="utf-8")).split(" ")[:8]
    task = R.synthetic_task("niah_single_2", essays)
    assert len(task.essay_words) > 100_000
    sample = task.build(1, 2048, gpt2).samples[0]
    needle = R.NEEDLE.format(type_needle_v="numbers", key=sample.info["keys"][0], value=sample.outputs[0])
    context = sample.prompt.split("afterwards.\n", 1)[1].split("\nWhat is the special magic", 1)[0]
    assert context.count(needle) == 1
    # the essays in file-name order
    assert re.sub(r"\s+", " ", context.replace(needle, "")).strip().startswith(" ".join(first_words))
    assert len(text) > 600_000 and sample.size >= 1000 and sample.size % 500 == 0


def test_hf_tokenizer_adapter(gpt2, shared_data: Path) -> None:
    from transformers import GPT2TokenizerFast

    folder = Path(os.environ["OWAI_DATA"]) / "tokenizers" / "gpt2"
    files = (str(folder / "encoder.json"), str(folder / "vocab.bpe"))
    # transformers 5 takes vocab=/merges= (and silently ignores vocab_file=/merges_file=); 4.x the reverse
    candidates = [GPT2TokenizerFast(vocab=files[0], merges=files[1]),
                  GPT2TokenizerFast(vocab_file=files[0], merges_file=files[1])]
    loaded = [t for t in candidates if t.encode("The", add_special_tokens=False)]
    assert loaded
    hf = R.HFTokenizer(loaded[0])
    text = "Document 1:\nThe Normans were famed for their Catholic piety. Answer:"
    assert hf.encode(text) == gpt2.encode(text) and hf.count(text) == gpt2.count(text) == len(gpt2.encode(text))
    assert gpt2.decode(gpt2.encode(text)) == text == hf.decode(hf.encode(text))
    empty = types.SimpleNamespace(encode=lambda text, add_special_tokens=False: [], decode=lambda ids: "")
    with pytest.raises(OwaiError):  # an empty vocabulary would fit any haystack: refused
        R.HFTokenizer(empty)
    with pytest.raises(DataMissing):
        R.gpt2_tokenizer(folder.parent / "no-such-tokenizer")


@pytest.mark.parametrize("name", list(R.NIAH_VARIANTS))
def test_niah_needles_in_the_prompt(name: str, essays: Path, gpt2) -> None:
    task = R.synthetic_task(name, essays)
    built = task.build(3, 1024, gpt2)
    config = R.NIAH_VARIANTS[name]
    num_k, num_v, num_q = config.get("num_k", 1), config.get("num_v", 1), config.get("num_q", 1)
    for sample in built.samples:
        assert sample.fits and sample.tokens + 128 <= 1024
        needles = re.findall(r"One of the special magic \w+ for (\S+) is: (\S+?)\.(?=\s|$)", sample.prompt)
        asked = sample.info["keys"]
        assert len(asked) == num_q and len(sample.outputs) == num_q * num_v
        real = [(k, v) for k, v in needles if k in asked]
        assert sorted(v for _, v in real) == sorted(sample.outputs)  # every answer is a needle for an asked key
        if config["haystack"] == "needle":
            assert len(needles) == sample.size + 1  # distractor needles with other keys
        else:
            assert len(needles) == num_k * num_v
        question = sample.prompt.rsplit("\n", 1)[1]
        assert all(k in question for k in asked)
        if num_q * num_v == 1:
            assert sample.prompt.startswith("A special magic")
            assert question.endswith("mentioned in the provided text is")
        else:
            assert sample.prompt.startswith("Some special magic")
            assert question.endswith("mentioned in the provided text are")
    assert score(R.OracleReader(), task, 1024, 3, gpt2) == 100.0


@pytest.mark.parametrize("rule", R.RULES)
def test_variable_tracking_chains_resolve(gpt2, rule: str) -> None:
    task = R.synthetic_task("vt", rule=rule)
    verb = "assgined" if rule == "2024" else "assigned"  # the 2024 code's typo
    for budget in (1024, 4096):
        built = task.build(3, budget, gpt2)
        examples = set()
        for sample in built.samples:
            assert sample.prompt.count("Memorize and track the chain(s)") == 2
            example_end = sample.prompt.rfind("Memorize and track the chain(s)")
            example = sample.prompt[:example_end]
            separator = "\n\n\n\n" if rule == "2024" else "\n\n"  # example "\n\n" / "\n", then "\n\n" / "\n"
            assert example.endswith(separator) and not example.endswith(separator + "\n")
            examples.add(re.findall(r"VAR ([A-Z]{3}) =", example)[0])  # 3-letter names, redrawn per sample
            assert sample.fits
            text = sample.prompt[example_end:]
            value = re.search(r"assigned the value (\d+) in the text above", text).group(1)
            names = sample.outputs
            assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
            assert f"VAR {names[0]} = {value}" in text
            positions = [text.index(f"VAR {names[0]} = {value}")]
            for j in range(1, 5):
                positions.append(text.index(f"VAR {names[j]} = VAR {names[j - 1]} "))
            assert positions == sorted(positions)  # the chain in order
            assert text.endswith(f"5 variables are {verb} the value {value}, they are: ")
            assert ("again.\nThe grass" if rule == "2025" else "again.\n The grass") in text
        assert len(examples) == 3
        assert score(R.OracleReader(), task, budget, 3, gpt2) == 100.0


@pytest.mark.parametrize("budget,common,uncommon", [(1024, 6, 1), (4096, 30, 3)])
def test_common_words_counts(gpt2, budget: int, common: int, uncommon: int) -> None:
    task = R.synthetic_task("cwe")
    built = task.build(2, budget, gpt2)
    for sample in built.samples:
        assert sample.fits and sample.tokens + 120 <= budget
        example, query = sample.prompt.rsplit("Below is a numbered list of words.", 1)
        listed = re.findall(r"(\d+)\. (\S+)", query.split("\n")[1])
        assert [int(i) for i, _ in listed] == list(range(1, len(listed) + 1))
        counts = Counter(w for _, w in listed)
        assert len(sample.outputs) == 10 and len(counts) == sample.size
        assert {counts[w] for w in sample.outputs} == {common}
        assert {c for w, c in counts.items() if w not in sample.outputs} == {uncommon}
        example_counts = Counter(re.findall(r"\d+\. (\S+)", example.split("\n")[1]))
        assert len(example_counts) == (20 if budget < 4096 else 40)
        assert sample.prompt.endswith(R.CWE_ANSWER_PREFIX)
    assert score(R.OracleReader(), task, budget, 2, gpt2) == 100.0


def test_frequent_words_counts(gpt2) -> None:
    task = R.synthetic_task("fwe")
    built = task.build(3, 2048, gpt2)
    for sample in built.samples:
        assert sample.fits and sample.tokens + 50 <= 2048
        words = sample.prompt.split("coded words. ", 1)[1].split("\nQuestion:")[0].split(" ")
        counts = Counter(words)
        expected = task.counts(sample.size, 2048 // 50)
        assert sorted(counts.values(), reverse=True) == [c for c in expected if c > 0]
        assert counts.most_common(1)[0] == ("...", expected[0])
        assert [counts[w] for w in sample.outputs] == expected[1:4]
        assert len(set(sample.outputs)) == 3 and all(re.fullmatch(r"[a-z]{6}", w) for w in sample.outputs)
    assert R.zeta(2.0) == pytest.approx(3.141592653589793 ** 2 / 6, rel=1e-12)
    assert score(R.OracleReader(), task, 2048, 3, gpt2) == 100.0


def test_synthetic_tasks_are_seeded(gpt2, essays: Path) -> None:
    for name in ("niah_multikey_2", "niah_multivalue", "vt", "cwe", "fwe"):
        task = R.synthetic_task(name, essays, rule="2025")
        a, b, c = (task.build(2, 1024, gpt2, seed=s).samples for s in (1, 1, 2))
        assert [s.prompt for s in a] == [s.prompt for s in b] and [s.prompt for s in a] != [s.prompt for s in c]
        assert all(s.tokens + task.tokens_to_generate <= 1024 for s in a)


def test_null_model_and_word_lists(gpt2) -> None:
    result = R.evaluate(R.NullModel(), [R.synthetic_task("niah_single_1"), R.synthetic_task("vt")], ["1k"], n=2,
                        seed=42, tokenizer=gpt2, keep_records=False)
    assert "records" not in result and "qa_mean" not in result
    assert all(result["results"][t]["1k"]["score"] == 0.0 and result["results"][t]["1k"]["nulls"] == 2
               for t in ("niah_single_1", "vt"))
    words = R.word_list()
    assert len(words) == len(set(words)) > 600 and words == sorted(words)
    extra = R.pseudo_words(500)
    assert len(set(extra)) == 500 and not set(extra) & set(words) and extra == R.pseudo_words(500)
    extra.reverse()  # cwe shuffles its copy in place: the next caller's words are in the fixed order
    assert R.pseudo_words(500) == extra[::-1] and R.pseudo_words(500) is not R.pseudo_words(500)


def test_pair_list_equals_the_sorted_pairs() -> None:
    """niah's keys: indexing the adjective-noun cross product equals building and sorting it, with
    adjectives that interleave ("blue" / "blue-eyed"), a space, duplicates and prefix words."""
    adjectives = ["blue", "blue-eyed", "bluebird", "ad hoc", "ad", "old", "old-fashioned", "x-rated", "blue"]
    nouns = ["eyed-cat", "cat", "dog", "a", "zebra", "cat", "-x"]
    pairs = R._PairList(adjectives, nouns)
    assert list(pairs) == sorted({f"{a}-{n}" for a in adjectives for n in nouns})
    words = R.adjective_noun_pairs()
    assert len(words) == 6_171_620 and words[0] < words[1] < words[-1]


def test_sentences_by_punkt_and_wonderwords_lists() -> None:
    """Punkt with NLTK's English parameters: "Dr." stays inside its sentence (the regex this replaces
    split there), and "i.e. little" splits as NLTK 3.10's sent_tokenize splits it (values taken from
    NLTK); wonderwords' lists are read in file order, as RULER reads them."""
    assert R.split_sentences("Dr. Smith went home. He was tired.") == ["Dr. Smith went home.", "He was tired."]
    assert R.split_sentences("It cost 3.5 dollars, i.e. little. Then he left.") == [
        "It cost 3.5 dollars, i.e.", "little.", "Then he left."]
    nouns = R.wonderwords_list("noun")
    assert len(nouns) > 6000 and len(R.word_list()) == len(set(R.word_list())) > 8000
    with pytest.raises(OwaiError):
        R.wonderwords_list("adverb")


@pytest.mark.parametrize("rule", R.RULES)
def test_prompts_counted_a_batch_at_a_time_are_the_one_at_a_time_prompts(gpt2, essays, monkeypatch, rule) -> None:
    """With a tokenizer that counts a batch in parallel, the search's probes and the samples are built
    ahead and counted as one batch (`R.SPECULATE`): the draws, sizes, counts and prompts must be those
    of one prompt at a time, samples that shrink included (qa_2, niah_multikey_2 and cwe shrink some at
    4k: the path where the rest of a block built ahead is thrown away)."""
    tasks = [R.qa_task("qa_2", R.synthetic_hotpotqa(), rule=rule)] + [
        R.synthetic_task(name, essays, rule=rule) for name in ("niah_multikey_2", "vt", "cwe", "fwe")]
    shrunk = 0
    for task in tasks:
        built = {}
        for width in (1, 3):
            monkeypatch.setattr(R, "SPECULATE", width)
            built[width] = task.build(8, 4096, gpt2, seed=42)
        one, batched = built[1], built[3]
        assert batched.size == one.size, task.name
        assert [(s.prompt, s.outputs, s.size, s.tokens, s.fits) for s in batched.samples] == \
               [(s.prompt, s.outputs, s.size, s.tokens, s.fits) for s in one.samples], task.name
        shrunk += sum(s.size < one.size for s in one.samples)
    assert shrunk  # the throw-away path ran
    assert gpt2.count_many(["The grass is green.", "", "a b"]) == [gpt2.count(t) for t in ("The grass is green.", "", "a b")]
