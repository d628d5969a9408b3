"""LongICLBench in-context classification, the model-independent part (fast, CPU, no downloads).

Loaders on the real banking77/goemotions files and on a generated tacred file; demonstration and
query selection (spec 2.3/2.4); prompt rendering (2.5); parsing and scoring (2.6); the reference
models on the synthetic corpus and on real banking77 (2.9); overflow reporting (2.8).
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import pytest

from owai.errors import DataMissing, OwaiError
from owai.evals.longicl import (
    STRATEGIES,
    TACRED_RELATIONS,
    TASKS,
    Example,
    ICLData,
    InContextKNN,
    MajorityLast,
    PromptOptions,
    accuracy,
    best_strategy,
    evaluate,
    is_correct,
    label_order,
    label_space,
    load_banking77,
    load_goemotions,
    load_hf,
    load_tacred,
    parse_prediction,
    read_prompt,
    render_context,
    render_prompt,
    render_query,
    round_robin,
    select_demonstrations,
    select_queries,
    synthetic_task,
    tacred_shots,
)

# Quoted from spec evals.md sec 2.5.
BANKING_HEADER = ("Given a customer service query, please predict the intent of the query. The predict answer must "
                  "come from the demonstration examples with the exact format. The examples are as follows:")
GOEMOTION_HEADER = ("Given a comment, please predict the emotion category of this comment. The predict answer must "
                    "come from the demonstration examples with the exact format. The examples are as follows:")
TACRED_HEADER = ("Given a sentence and a pair of subject and object entities within the sentence, please predict the "
                 "relation between the given entities. The examples are as follows:")


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert msg and "\n" not in msg
    return msg


def _ex(label: str, i: int) -> Example:
    return Example(f"{label} text {i}", label)


def _tiny(train: list[Example], test: list[Example] | None = None, labels: list[str] | None = None) -> ICLData:
    labels = labels or label_order(train)
    return ICLData("banking77", train, test or list(train), labels)


@pytest.fixture(scope="module")
def synth8() -> ICLData:
    return synthetic_task(8, seed=0)


@pytest.fixture
def banking(shared_data) -> ICLData:
    return load_banking77(Path(os.environ["OWAI_DATA"]) / "icl" / "banking77")


# ------------------------------------------------------------------------------ real data


def test_banking77_real_files(banking):
    assert (len(banking.labels), len(banking.train), len(banking.test)) == (77, 10_003, 3_080)
    root = Path(os.environ["OWAI_DATA"]) / "icl" / "banking77"
    categories = json.loads((root / "categories.json").read_text())
    # categories.json is in first-appearance order; the canonical list is HF ClassLabel id order
    assert label_order(banking.train) == categories
    assert sorted(banking.labels) == sorted(categories)
    assert banking.labels[0] == "activate_my_card" and banking.labels[11] == "card_arrival"
    assert banking.labels.index("Refund_not_showing_up") == 51 and banking.labels.index("reverted_card_payment?") == 53
    assert banking.train[0] == Example("I am still waiting on my card?", "card_arrival")
    queries = select_queries(banking)
    assert len(queries) == 500
    # 7 round-robin rounds over 40 rows per class: the first 77 queries are one per class, in test first-appearance order
    assert [q.label for q in queries[:77]] == label_order(banking.test)
    assert max(sum(q.label == y for q in queries) for y in banking.labels) == 7


def test_goemotions_single_label(shared_data):
    root = Path(os.environ["OWAI_DATA"]) / "icl" / "goemotions"
    data = load_goemotions(root)
    assert len(data.labels) == 28 and data.labels[0] == "admiration" and data.labels[27] == "neutral"
    # count single-label rows independently of the loader
    counts = {}
    for split in ("train", "test"):
        lines = [ln.split("\t") for ln in (root / f"{split}.tsv").read_text(encoding="utf-8").splitlines() if ln]
        counts[split] = (len(lines), sum("," not in f[1] for f in lines))
    assert counts == {"train": (43_410, 36_308), "test": (5_427, 4_590)}
    assert (len(data.train), len(data.test)) == (36_308, 4_590)
    assert (data.info["train_rows"], data.info["test_rows"]) == (43_410, 5_427)
    assert data.train[0].label == "neutral" and data.train[0].extra["id"] == "eebbqej"
    queries = select_queries(data)
    assert len(queries) == 500 and {q.label for q in queries} == set(data.labels)


# ------------------------------------------------------------------------------ selection


@pytest.mark.parametrize("delimiter", ["\n", " "])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shot_nesting(synth8, delimiter, shuffle):
    opts = PromptOptions(delimiter=delimiter, shuffle=shuffle, shuffle_seed=3)
    query = select_queries(synth8, 5)[2]
    shots = select_demonstrations(synth8, 4)
    prompts = [render_prompt(synth8, shots[:n], query, opts)[0] for n in range(1, 5)]
    tail = render_query(synth8, query, opts)
    for short, long in zip(prompts, prompts[1:]):
        assert short.endswith(tail) and long.endswith(tail)
        head = short[: -len(tail)]
        assert long.startswith(head) and len(long) > len(short)
    # selecting for fewer shots gives the same prefix
    assert select_demonstrations(synth8, 2) == shots[:2]


def test_one_demonstration_per_class_per_shot(synth8):
    shots = select_demonstrations(synth8, 8)
    first = label_order(synth8.train)
    for shot in shots:
        assert [ex.label for ex in shot] == first  # every class once, in first-appearance order
    flat = [ex for shot in shots for ex in shot]
    assert len({id(ex) for ex in flat}) == len(flat) == 64


def test_one_demonstration_per_class_real(banking):
    shots = select_demonstrations(banking, 3)
    assert [len({ex.label for ex in s}) for s in shots] == [77, 77, 77]


def test_label_order_is_first_appearance():
    pool = [_ex("b", 0), _ex("c", 0), _ex("b", 1), _ex("a", 0)]
    assert label_order(pool) == ["b", "c", "a"]
    assert [ex.label for ex in round_robin(pool, 1)[0]] == ["b", "c", "a"]


def test_fallback_when_a_class_is_exhausted():
    a1, b1, c1, a2, c2, c3 = _ex("a", 1), _ex("b", 1), _ex("c", 1), _ex("a", 2), _ex("c", 2), _ex("c", 3)
    # b is exhausted in round 2: the next later label with rows (c) fills its slot
    assert round_robin([a1, b1, c1, a2, c2, c3], 2) == [[a1, b1, c1], [a2, c2, c3]]
    # c (last) exhausted: no later label, so nothing fills its slot (LongICLBench's select_data
    # never looks back); a's third row comes in the next round
    a3, b2 = _ex("a", 3), _ex("b", 2)
    assert round_robin([a1, b1, c1, a2, a3, b2], 3) == [[a1, b1, c1], [a2, b2], [a3]]
    # a whole pool used up: the last round is short and selection refuses it
    assert round_robin([a1, b1, c1, a2], 3) == [[a1, b1, c1], [a2]]
    with pytest.raises(OwaiError) as err:
        select_demonstrations(_tiny([a1, b1, c1, a2]), 2)
    assert "too small" in _one_line(err)


def test_queries_do_not_depend_on_shots(synth8):
    queries = select_queries(synth8, 40)
    assert queries == select_queries(synth8, 40)
    assert len(queries) == 40 and [q.label for q in queries[:8]] == label_order(synth8.test)
    res = evaluate(MajorityLast(), synth8, [1, 2, 4], n_queries=40, strategies=STRATEGIES[:1], n_examples=40)
    golds = [[r["gold"] for r in res["results"][n]["strategies"]["newline-fixed"]["examples"]] for n in ("1", "2", "4")]
    assert golds[0] == golds[1] == golds[2] == [q.label for q in queries]
    assert [res["results"][n]["n_demonstrations"] for n in ("1", "2", "4")] == [8, 16, 32]


# ------------------------------------------------------------------------------ prompts


def test_headers_and_exact_rendering():
    assert [TASKS[t].header for t in ("banking77", "goemotion", "tacred")] == [BANKING_HEADER, GOEMOTION_HEADER, TACRED_HEADER]
    train = [Example("where is my card", "card_arrival"), Example("link my card", "card_linking")]
    data = _tiny(train)
    query = Example("card not here", "card_arrival")
    bare = PromptOptions(trailing_space=False)  # owai's variant without LongICLBench's two spaces
    prompt, gold = render_prompt(data, [train], query, bare)
    assert gold == "card_arrival"
    assert prompt == (BANKING_HEADER + "\nservice query: where is my card\nintent category: card_arrival\n"
                      "service query: link my card\nintent category: card_linking\n"
                      "service query: card not here\nintent category:")
    spaced, _ = render_prompt(data, [train], query, PromptOptions(delimiter=" ", trailing_space=False))
    assert spaced == prompt.replace("\n", " ")
    trailing, _ = render_prompt(data, [train], query)  # the default: LongICLBench's spaces
    assert trailing.startswith(BANKING_HEADER + " \nservice query:") and trailing.endswith("intent category: ")
    goemo = ICLData("goemotion", [Example("so happy", "joy")], [], ["joy"])
    assert render_prompt(goemo, [goemo.train], Example("sad now", "joy"), bare)[0] == (
        GOEMOTION_HEADER + "\ncomment: so happy\nemotion category: joy\ncomment: sad now\nemotion category:")


def test_tacred_formats():
    demo = Example("Ann works at Acme .", "per:employee_of", {"subject": "Ann", "object": "Acme"})
    query = Example("Bob founded Zed .", "org:founded_by", {"subject": "Zed", "object": "Bob"})
    data = ICLData("tacred", [demo], [query], list(TACRED_RELATIONS))
    bare = PromptOptions(trailing_space=False)
    thesis, gold = render_prompt(data, [[demo]], query, bare)
    assert gold == "org:founded_by"
    assert thesis == (TACRED_HEADER + "\nsentence: Ann works at Acme .\nthe relation between Ann and Acme is: per:employee_of\n"
                      "sentence: Bob founded Zed .\nthe relation between Zed and Bob is:")
    long, _ = render_prompt(data, [[demo]], query, PromptOptions(tacred_format="longiclbench", trailing_space=False))
    assert long == (TACRED_HEADER + "\nsentence: Ann works at Acme .\nthe subject is Ann and the object is Acme\n"
                    "the relation between the two entities is: per:employee_of\n"
                    "sentence: Bob founded Zed .\nthe subject is Zed and the object is Bob\n"
                    "the relation between the two entities is:")
    for p in (thesis, long, long.replace("\n", " ")):
        assert read_prompt(p)[1][0][1] == "per:employee_of"
        assert MajorityLast().generate(p) == " per:employee_of"
    anon, gold = render_prompt(data, [[demo]], query, PromptOptions(labels="anonymous", trailing_space=False))
    assert gold == "class_0" and anon.endswith("is: class_1\nsentence: Bob founded Zed .\nthe relation between Zed and Bob is:")


def test_anonymous_labels_bijective_and_stable(synth8):
    labels = synth8.labels
    space = label_space(labels, "anonymous")
    assert space == {y: f"class_{j}" for j, y in enumerate(labels)}
    assert space == label_space(list(labels), "anonymous")  # stable
    permuted = label_space(labels, "anonymous", permute_seed=5)
    assert sorted(permuted.values()) == sorted(space.values()) and permuted != space  # a different bijection
    assert permuted == label_space(labels, "anonymous", permute_seed=5)
    assert permuted != label_space(labels, "anonymous", permute_seed=6)
    # one map for all shots and queries: the same label is shown the same everywhere in a prompt
    opts = PromptOptions(labels="anonymous", anon_permute=5)
    shots = select_demonstrations(synth8, 3)
    for q in select_queries(synth8, 10):
        prompt, gold = render_prompt(synth8, shots, q, opts)
        assert gold == permuted[q.label]
        _, demos, _ = read_prompt(prompt)
        assert [y for _, y in demos] == [permuted[ex.label] for s in shots for ex in s]
    assert not any(y in render_context(synth8, shots, opts) for y in labels)


def test_within_shot_shuffle_is_seeded(synth8):
    shots = select_demonstrations(synth8, 2)
    q = synth8.test[0]
    fixed = render_prompt(synth8, shots, q)[0]
    a = render_prompt(synth8, shots, q, PromptOptions(shuffle=True, shuffle_seed=1))[0]
    assert a == render_prompt(synth8, shots, q, PromptOptions(shuffle=True, shuffle_seed=1))[0]
    assert a != fixed and a != render_prompt(synth8, shots, q, PromptOptions(shuffle=True, shuffle_seed=2))[0]
    _, demos, _ = read_prompt(a)
    labels = [y for _, y in demos]
    assert set(labels[:8]) == set(labels[8:]) == set(synth8.labels)  # permuted inside each shot only


# ------------------------------------------------------------------------------ parsing and metrics


def test_parse_both_delimiters():
    assert parse_prediction(" card_arrival\nservice query: where is it\nintent category: x", "banking77") == "card_arrival"
    assert parse_prediction(" card_arrival service query: where is it intent category: x", "banking77") == "card_arrival"
    assert parse_prediction(" Card_Arrival   \n", "banking77") == "card_arrival"
    assert parse_prediction("card_arrival\n\nmore", "banking77") == "card_arrival"
    assert parse_prediction(" joy comment: meh emotion category: sadness", "goemotion") == "joy"
    assert parse_prediction(" per:title sentence: x", "tacred") == "per:title"
    assert parse_prediction(" joy comment:x", "goemotion") == "joy comment:x"  # its script cuts at "comment: "
    # tacred's script compares as written (no lower-casing) and, in its own template, splits the
    # response at its whole label field
    assert parse_prediction(" PER:TITLE", "tacred") == "PER:TITLE" and not is_correct("PER:TITLE", "per:title", False)
    said = "sentence: Birds sing.\nthe relation between the two entities is: per:title is: other"
    assert parse_prediction(said, "tacred", "Birds sing.", label_marker="the relation between the two entities is:") == \
        "per:title is: other"
    assert parse_prediction(said, "tacred", "Birds sing.") == "per:title"  # the thesis template's marker, " is:"
    assert parse_prediction("", "banking77") == ""
    assert is_correct(parse_prediction(" REFUND_NOT_SHOWING_UP", "banking77"), "Refund_not_showing_up")
    assert is_correct(parse_prediction(" reverted_card_payment? service query:", "banking77"), "reverted_card_payment?")
    assert not is_correct(parse_prediction(" card arrival", "banking77"), "card_arrival")
    assert not is_correct(parse_prediction(" card_arrival_x", "banking77"), "card_arrival")
    assert not is_correct(parse_prediction(" class_1", "banking77"), "class_11")


def test_metrics_hand_computed():
    assert accuracy(["a", "b", "c"], ["A", "x", "c"]) == pytest.approx(2 / 3)
    assert accuracy(["class_7"], ["class_7"]) == 1.0
    with pytest.raises(OwaiError):
        accuracy(["a"], ["a", "b"])
    with pytest.raises(OwaiError):
        accuracy([], [])
    assert best_strategy({"n-f": 0.5, "n-s": 0.7, "s-f": 0.7, "s-s": 0.1}) == ("n-s", 0.7)  # tie: first
    assert best_strategy({"n-f": None, "n-s": 0.0}) == ("n-s", 0.0)
    assert best_strategy({"n-f": None}) == (None, None)


# ------------------------------------------------------------------------------ reference models


def _acc(res: dict, n: int, strategy: str = "newline-fixed") -> float:
    return res["results"][str(n)]["strategies"][strategy]["accuracy"]


def test_knn_rises_with_shots_and_ignores_label_names(synth8):
    sem = evaluate(InContextKNN(), synth8, [1, 4], n_queries=80)
    anon = evaluate(InContextKNN(), synth8, [1, 4], PromptOptions(labels="anonymous", anon_permute=1), n_queries=80)
    assert sem["n_queries"] == 80
    assert _acc(sem, 4) > _acc(sem, 1) + 0.15 and _acc(sem, 1) > 1 / 8
    for n in ("1", "4"):
        for s in STRATEGIES:
            assert sem["results"][n]["strategies"][s.name]["accuracy"] == anon["results"][n]["strategies"][s.name]["accuracy"]
        assert sem["results"][n]["best"] == anon["results"][n]["best"]
    assert "label_map" in anon["config"] and "label_map" not in sem["config"]
    json.dumps(sem)


@pytest.mark.parametrize("k", [8, 16])
def test_majority_last_is_chance(k):
    data = synthetic_task(k, seed=2, n_train=8, n_test=5)
    res = evaluate(MajorityLast(), data, [1, 2], n_queries=5 * k)
    for n in ("1", "2"):
        for s in STRATEGIES:
            assert res["results"][n]["strategies"][s.name]["accuracy"] == pytest.approx(1 / k, abs=0.5 / k)


def test_knn_on_real_banking77(banking):
    res = evaluate(InContextKNN(), banking, [1], n_queries=50)
    assert res["n_queries"] == 50 and res["results"]["1"]["n_demonstrations"] == 77
    assert _acc(res, 1) > 5 / 77 and res["results"]["1"]["best"]["accuracy"] >= _acc(res, 1)
    assert res["thesis"]["accuracy"] == 0.895
    assert MajorityLast().generate(render_prompt(banking, select_demonstrations(banking, 1), banking.test[0])[0]) == \
        " " + label_order(banking.train)[-1]


def test_knn_hand_written():
    train = [Example("my card is lost", "lost_or_stolen_card"), Example("card never arrived", "card_arrival"),
             Example("the card has not arrived yet", "card_arrival"), Example("what fee was charged", "card_payment_fee_charged")]
    data = _tiny(train)
    for d in ("\n", " "):
        opts = PromptOptions(delimiter=d)
        ask = lambda text: InContextKNN().generate(render_prompt(data, [train], Example(text, "card_arrival"), opts)[0])  # noqa: E731
        assert ask("has my card arrived yet") == " card_arrival"  # 4 shared words with the third demo
        assert ask("card") == " lost_or_stolen_card"  # one shared word with three demos: the earliest wins
        assert ask("fee charged") == " card_payment_fee_charged"
        assert ask("zzz") == " lost_or_stolen_card"  # no overlap at all: still the earliest


def test_read_prompt_round_trip(synth8):
    shots = select_demonstrations(synth8, 2)
    q = synth8.test[3]
    for d in ("\n", " "):
        task, demos, query = read_prompt(render_prompt(synth8, shots, q, PromptOptions(delimiter=d, trailing_space=True))[0])
        assert task == "banking77" and query == q.text
        assert demos == [(ex.text, ex.label) for s in shots for ex in s]
    with pytest.raises(OwaiError):
        read_prompt("no header here")


# ------------------------------------------------------------------------------ overflow


class WordCounting(InContextKNN):
    """InContextKNN that counts words as tokens and records which prompts it was asked to continue."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def count_tokens(self, prompt: str) -> int:
        return len(prompt.split())

    def generate(self, prompt: str) -> str:
        self.seen.append(self.count_tokens(prompt))
        return super().generate(prompt)


def test_overflow_reported_not_scored(synth8):
    model = WordCounting()
    res = evaluate(model, synth8, [1, 4], n_queries=40, strategies=STRATEGIES[:1])
    longest1, longest4 = (res["results"][n]["strategies"]["newline-fixed"]["max_prompt_tokens"] for n in ("1", "4"))
    assert longest1 < longest4
    budget = longest1 + 10
    model = WordCounting()
    res = evaluate(model, synth8, [1, 4], n_queries=40, strategies=STRATEGIES[:1], max_tokens=budget, n_examples=2)
    one, four = (res["results"][n]["strategies"]["newline-fixed"] for n in ("1", "4"))
    assert one["n_overflow"] == 0 and one["n_scored"] == 40
    assert four["n_overflow"] == 40 and four["n_scored"] == 0 and four["accuracy"] is None
    assert all(r.get("overflow") and "prediction" not in r for r in four["examples"])
    assert res["results"]["4"]["best"] == {"strategy": None, "accuracy": None}
    assert len(model.seen) == 40 and max(model.seen) <= budget  # overflowing prompts never reach the model
    # a budget in the middle of the 1-shot lengths: some scored, some not, accuracy over the scored ones
    model = WordCounting()
    mid = sorted(WordCounting().count_tokens(render_prompt(synth8, select_demonstrations(synth8, 1), q)[0])
                 for q in select_queries(synth8, 40))[20]
    part = evaluate(model, synth8, [1], n_queries=40, strategies=STRATEGIES[:1], max_tokens=mid)["results"]["1"]
    r = part["strategies"]["newline-fixed"]
    assert 0 < r["n_overflow"] < 40 and r["n_scored"] + r["n_overflow"] == 40
    assert r["accuracy"] == r["n_correct"] / r["n_scored"]
    with pytest.raises(OwaiError) as err:
        evaluate(InContextKNN(), synth8, [1], n_queries=4, max_tokens=100)
    assert "count_tokens" in _one_line(err)


def test_a_logged_prompt_set_with_counts_that_do_not_add_up_is_scored_again(synth8, tmp_path):
    """A finished prompt set is read back from the answer log only when its counts are whole numbers
    adding up to the queries; any other value (a log of another format) is scored again. The check runs
    on rank 0 alone while the other ranks wait for its verdict: it raised a TypeError there."""
    from owai.evals.answers import AnswerLog

    path = tmp_path / "answers.jsonl"
    args = (InContextKNN(), synth8, [1])
    whole = evaluate(*args, n_queries=6, strategies=STRATEGIES[:1], answers=AnswerLog(path))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    cells = [v for row in rows for v in row["answers"].values() if isinstance(v, dict)]
    assert len(cells) == 1 and cells[0]["n_scored"] == 6
    cells[0]["n_scored"] = None
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert evaluate(*args, n_queries=6, strategies=STRATEGIES[:1], answers=AnswerLog(path)) == whole


# ------------------------------------------------------------------------------ tacred and loader errors


def _tacred_rows(reps: int, offset: int = 0) -> list[dict]:
    rows = []
    for r in range(reps):
        for i, rel in enumerate(TACRED_RELATIONS):
            rows.append({"sentence": f"S{r + offset} {i} x", "relation": rel, "subject_entity": f"A{i}", "object_entity": f"B{r}"})
            if i % 10 == 0:
                rows.append({"sentence": "nothing", "relation": "no_relation", "subject_entity": "a", "object_entity": "b"})
    return rows


def test_tacred_loader_and_selection(tmp_path):
    (tmp_path / "train_tacred.json").write_text(json.dumps(_tacred_rows(3)))
    (tmp_path / "test_tacred.json").write_text(json.dumps(_tacred_rows(3, offset=10)))
    data = load_tacred(tmp_path)
    assert len(data.labels) == 41 and data.labels[:3] == ["org:founded_by", "per:employee_of", "org:alternate_names"]
    assert data.labels[-1] == "per:country_of_death"
    assert len(data.train) == len(data.test) == 123 and data.info["train_rows"] == 123 + 15
    assert data.train[0].extra == {"subject": "A0", "object": "B0"}
    shots = select_demonstrations(data, 2)
    assert [len({ex.label for ex in s}) for s in shots] == [41, 41] and shots[1][0].text == "S1 0 x"
    with pytest.raises(OwaiError):
        select_demonstrations(data, 4)
    queries = select_queries(data, 500, quota=2)
    assert len(queries) == 82 and queries == data.test[:82]  # file order, at most 2 per relation
    assert select_queries(data, 30) == data.test[:30]
    res = evaluate(InContextKNN(), data, [1], PromptOptions(tacred_format="longiclbench"), n_queries=20)
    assert res["config"]["tacred_format"] == "longiclbench" and res["n_queries"] == 20


def test_tacred_shots_single_pass():
    a1, a2, b1, b2, a3, b3 = _ex("a", 1), _ex("a", 2), _ex("b", 1), _ex("b", 2), _ex("a", 3), _ex("b", 3)
    # a2 is skipped (a already in shot 1) and not revisited; shot 2 keeps data order (b before a)
    assert tacred_shots([a1, a2, b1, b2, a3, b3, _ex("z", 1)], ["a", "b"]) == [[a1, b1], [b2, a3]]


def test_tacred_malformed_files(tmp_path):
    with pytest.raises(DataMissing) as err:
        load_tacred(tmp_path)
    assert "train_tacred.json" in _one_line(err)
    (tmp_path / "test_tacred.json").write_text("[]")
    train = tmp_path / "train_tacred.json"
    train.write_text('[{"sentence": "x",\n "relation": ')
    with pytest.raises(OwaiError) as err:
        load_tacred(tmp_path)
    assert "train_tacred.json" in _one_line(err) and "JSON" in str(err.value)
    rows = _tacred_rows(1)
    del rows[3]["object_entity"]
    train.write_text(json.dumps(rows))
    with pytest.raises(OwaiError) as err:
        load_tacred(tmp_path)
    assert "row 3" in _one_line(err)
    rows = _tacred_rows(1)
    rows[5]["relation"] = "per:favourite_colour"
    train.write_text(json.dumps(rows))
    with pytest.raises(OwaiError) as err:
        load_tacred(tmp_path)
    assert "row 5" in _one_line(err) and "per:favourite_colour" in str(err.value)
    train.write_text('{"sentence": "x"}')
    with pytest.raises(OwaiError) as err:
        load_tacred(tmp_path)
    assert "list" in _one_line(err)


def _write_csv(path: Path, rows: list[list[str]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(rows)


def test_banking77_and_goemotions_errors(tmp_path):
    with pytest.raises(DataMissing) as err:
        load_banking77(tmp_path)
    assert "categories.json" in _one_line(err)
    (tmp_path / "categories.json").write_text(json.dumps(["card_arrival", "Refund_not_showing_up"]))
    _write_csv(tmp_path / "train.csv", [["text", "category"], ["hi, there", "card_arrival"], ["refund?", "Refund_not_showing_up"]])
    _write_csv(tmp_path / "test.csv", [["text", "category"], ["where", "card_arrival"], ["what", "card_arival"]])
    with pytest.raises(OwaiError) as err:
        load_banking77(tmp_path)
    assert "test.csv line 3" in _one_line(err) and "card_arival" in str(err.value)
    _write_csv(tmp_path / "test.csv", [["text", "label"], ["where", "card_arrival"]])
    with pytest.raises(OwaiError) as err:
        load_banking77(tmp_path)
    assert "header" in _one_line(err)
    _write_csv(tmp_path / "test.csv", [["text", "category"], ["where", "card_arrival", "extra"]])
    with pytest.raises(OwaiError) as err:
        load_banking77(tmp_path)
    assert "line 2" in _one_line(err)
    _write_csv(tmp_path / "test.csv", [["text", "category"], ["where", "card_arrival"]])
    data = load_banking77(tmp_path)
    assert data.labels == ["card_arrival", "Refund_not_showing_up"]  # id order: case-insensitive alphabetical
    assert data.train[0].text == "hi, there"

    g = tmp_path / "goemo"
    g.mkdir()
    (g / "labels.txt").write_text("joy\nsadness\n")
    (g / "train.tsv").write_text("happy\t0\tid1\nmixed\t0,1\tid2\nsad\t1\tid3\n")
    (g / "test.tsv").write_text("ok\t0\tid4\nbad\t2\tid5\n")
    with pytest.raises(OwaiError) as err:
        load_goemotions(g)
    assert "test.tsv line 2" in _one_line(err)
    (g / "test.tsv").write_text("ok\t0\tid4\nbad\tx\n")
    with pytest.raises(OwaiError) as err:
        load_goemotions(g)
    assert "test.tsv line 2" in _one_line(err)
    (g / "test.tsv").write_text('ok\t0\tid4\n"what ""hurt"" means"\t1\tid6\n')
    data = load_goemotions(g)
    assert [ex.text for ex in data.train] == ["happy", "sad"] and data.info["train_rows"] == 3
    assert data.test[1].text == 'what "hurt" means'  # a quoted field unescaped, as the hub's go_emotions reader


def test_load_hf_offline_is_data_missing(monkeypatch):
    with pytest.raises(OwaiError) as err:
        load_hf("imdb")
    _one_line(err)
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails
    with pytest.raises(DataMissing) as err:
        load_hf("banking77")
    assert "datasets" in _one_line(err)

    class Hub:
        @staticmethod
        def load_dataset(*args, **kwargs):
            raise ConnectionError("Couldn't reach 'PolyAI/banking77' on the Hub\n(LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", Hub)
    for name in ("banking77", "go_emotions"):
        with pytest.raises(DataMissing) as err:
            load_hf(name)
        assert "hub" in _one_line(err)


def test_synthetic_task_shape():
    data = synthetic_task(16, seed=4, n_train=20, n_test=10)
    assert len(data.labels) == len(set(data.labels)) == 16 and data.task == "banking77"
    assert (len(data.train), len(data.test)) == (320, 160)
    assert synthetic_task(16, seed=4) == data and synthetic_task(16, seed=5).train != data.train
    for ex in data.train[:50]:
        words = ex.text.split()
        sig = set(data.info["signatures"][ex.label])
        assert 8 <= len(words) <= 20 and 1 <= len(sig & set(words)) <= 2
        assert all(w.startswith(ex.label.split("_")[0]) for w in sig)  # the label shares the signature stem
    assert [q.label for q in select_queries(data, 500)].count(data.labels[0]) == 10


def test_parse_paths_local_and_api():
    """LongICLBench's local path reads prompt + continuation, cutting between label markers; the API
    path reads the continuation alone and keeps a later marker in the first line."""
    prompt = "Header: \nservice query: my card?\nintent category: "
    out = " top_up_failed intent category: card_arrival"
    assert parse_prediction(out, "banking77", "my card?", prompt) == "top_up_failed"
    assert parse_prediction(out, "banking77", "my card?") == "top_up_failed intent category: card_arrival"
    assert parse_prediction("\ncard_arrival", "banking77", "my card?") == "card_arrival"  # stripped before the first line
    with pytest.raises(OwaiError):
        PromptOptions(parse="chat")
