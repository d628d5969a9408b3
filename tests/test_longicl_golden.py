"""LongICLBench as published (issue #37): golden values from TIGER-AI-Lab/LongICLBench's own code.

banking77: produced outside the project by running `select_data`, `format_discovery_prompt` and the
answer parsing block of `banking77_infer.py` (commit 9c5da3d) on the real banking77 files (PolyAI's
train.csv / test.csv, labels as HF ids). Only the values are kept here.

goemotion and tacred: produced outside the project the same way from `goemotion_infer.py` and
`tacred_infer.py` (9c5da3d). Their `select_data` / `select_test` / `format_discovery_prompt`, the
query lines at the top of the evaluation loop, its answer-parsing block and its scoring lines were
taken out of the scripts' source with `ast` and run as they stand, without the model and API code
(a response string given in place of the model's). goemotion ran on the real GoEmotions TSVs read
as the hub's `go_emotions` ("simplified") loading script reads them; tacred on the files that
`write_tacred` below generates (TACRED is licence-gated). Only the values are kept here.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import pytest

from owai.errors import OwaiError
from owai.evals.longicl import (NO_RELATION, TACRED_LONGICL_LABEL, TACRED_RELATIONS, PromptOptions, is_correct,
                                load_banking77, load_goemotions, load_tacred, parse_prediction, render_context,
                                render_query, score_prompts, select_demonstrations, select_queries)

# sha256 of the prompt of the first query, and of all 500 prompts joined by "\x1e", per round count
PROMPTS = {
    1: ('788ca9715fa89212c9ba681f2963bd9667db32f77fb221d50862d56b54c112c3',
        'c73e18f24ae37e412eeed8a90312736c7ede7fa2d4d5210fb929065c414cdd82'),
    2: ('b6cab64021245e0cc7742da527323fc627c666bc9b9a161455e046a1fe542fc2',
        '53bc1ee3543a01075e3fdcbd1bb3243148001c87a3a93428053917fe0d3b781d'),
}
FIRST_300 = 'Given a customer service query, please predict the intent of the query. The predict answer must come from the demonstration examples with the exact format. The examples are as follows: \nservice query: I am still waiting on my card?\nintent category: card_arrival\nservice query: My card has been found.'
QUERY_0 = 'How do I locate my card?'
# (continuation, LongICLBench's prediction on its API path, on its local path: prompt + continuation)
PARSED = [
    ('card_arrival', 'card_arrival', 'card_arrival'),
    (' card_arrival\nservice query: x', 'card_arrival', 'card_arrival'),
    ('\ncard_arrival', 'card_arrival', 'card_arrival'),
    ('  Card_Arrival  \n\nmore', 'card_arrival', 'card_arrival'),
    ('card_arrival service query: where intent category: lost', 'card_arrival', 'card_arrival'),
    ('I think it is card_arrival', 'i think it is card_arrival', 'i think it is card_arrival'),
    ('\n\nservice query: abc\nintent category: lost_or_stolen_card', '', ''),
    ('', '', ''),
    (' top_up_failed intent category: card_arrival', 'top_up_failed intent category: card_arrival', 'top_up_failed'),
    (' How do I locate my card?\nintent category: pin_blocked\n', 'pin_blocked', 'pin_blocked'),
]


@pytest.fixture(scope="module")
def banking():
    root = Path(os.environ.get("OWAI_DATA", "")) / "icl" / "banking77"
    if not os.environ.get("OWAI_DATA") or not (root / "train.csv").is_file():
        pytest.skip("$OWAI_DATA lacks icl/banking77 (train.csv, test.csv, categories.json)")
    return load_banking77(root)


@pytest.mark.parametrize("rounds", [1, 2])
def test_default_prompt_byte_identical(banking, rounds: int) -> None:
    options = PromptOptions()
    context = render_context(banking, select_demonstrations(banking, rounds), options)
    prompts = [context + render_query(banking, q, options) for q in select_queries(banking)]
    first, every = PROMPTS[rounds]
    assert hashlib.sha256(prompts[0].encode()).hexdigest() == first
    assert hashlib.sha256("\x1e".join(prompts).encode()).hexdigest() == every
    if rounds == 1:
        assert prompts[0][:300] == FIRST_300


@pytest.mark.parametrize("continuation,api,local", PARSED)
def test_parsing_as_longiclbench(banking, continuation: str, api: str, local: str) -> None:
    queries = select_queries(banking)
    assert queries[0].text == QUERY_0
    options = PromptOptions()
    prompt = render_context(banking, select_demonstrations(banking, 1), options) + render_query(banking, queries[0], options)
    assert parse_prediction(continuation, "banking77", QUERY_0) == api
    assert parse_prediction(continuation, "banking77", QUERY_0, prompt) == local


# ------------------------------------------------------------------------------------------- goemotion

# goemotion_infer.py's `select_data(test, 25)` selects 641 queries; the scripts score the first 500.
GOEMOTION_SELECTED = 641
# sha256 of the prompt of the first query, and of all 500 prompts joined by "\x1e", per round count
# (LongICLBench's script_goemotion.sh runs rounds 1 to 5)
GOEMOTION_PROMPTS = {
    1: ('ba0913f1c764fbdc29af90dc10cc9e99bce717ce467075e464806dc89724ccea',
        'ceef197b991e3806bba9ed1b3579ba6d58e3d9554a452762330fce5fa75a6dde'),
    2: ('93f5e36222a2251e89360d640972a49d62e2a36e6ad6bb37b40d90278ab14ad4',
        '31ea359589c2c61f17e5a990b1c7cde5b15299bb8a8caa8c6a69bb4f9ffd1d64'),
    3: ('43b4f20611b00a93e0d334274fd1a9dcb53e25bcd07e4cb7b7b1719ea596a215',
        'fa561f8e9adf9fe02f8c27f9b7162f71907ac2535f37e75665c327339f0a9fbd'),
    4: ('e3557ead58ea66e29578108f023e7353510a2c55c5ef267196a767ccb5025c47',
        'c4993c49a729562cfa4fafea582b79df2f31cc6aab88045cba81c7e4f2dd6de4'),
    5: ('51968dfeac5ed357c9ba9638f999c2bc3e98c028634767a6f2ab7501df5f223d',
        'e556ee2eea331308fe6893e01c158745bb538b03bdaf9587a8ea80cbefa08ff4'),
}
GOEMOTION_FIRST_300 = "Given a comment, please predict the emotion category of this comment. The predict answer must come from the demonstration examples with the exact format. The examples are as follows: \ncomment: My favourite food is anything I didn't have to cook myself.\nemotion category: neutral\ncomment: WHY THE FUCK"
GOEMOTION_QUERY_0 = 'I’m really sorry about your situation :( Although I love the names Sapphira, Cirilla, and Scarlett!'
# (continuation, LongICLBench's prediction on its API path, on its local path: prompt + continuation)
GOEMOTION_PARSED = [
    ('sadness', 'sadness', 'sadness'),
    (' Sadness\ncomment: x', 'sadness', 'sadness'),
    ('\nremorse', 'remorse', 'remorse'),
    ('  Caring  \n\nmore', 'caring', 'caring'),
    ('caring comment: where emotion category: joy', 'caring', 'caring'),
    ('I think it is caring', 'i think it is caring', 'i think it is caring'),
    ('\n\ncomment: abc\nemotion category: joy', '', ''),
    ('', '', ''),
    (' joy emotion category: love', 'joy emotion category: love', 'joy'),
    (' I’m really sorry about your situation :( Although I love the names Sapphira, Cirilla, and Scarlett!\nemotion category: love\n', 'love', 'love'),
    (' joy comment:x', 'joy comment:x', 'joy comment:x'),
    (' I’m really sorry about your situation :( Although I love the names Sapphira, Cirilla, and Scarlett!', '', ''),
    ('neutral\ncomment: x\nemotion category: joy', 'neutral', 'neutral'),
    ('Emotion Category: joy', 'emotion category: joy', 'emotion category: joy'),
    (' joy\temotion category: anger', 'joy\temotion category: anger', 'joy'),
]
# (prediction, gold label, LongICLBench's verdict: the prediction equals the lower-cased gold label)
GOEMOTION_SCORED = [
    ('sadness', 'sadness', True),
    ('sadness', 'Sadness', True),
    ('Sadness', 'sadness', False),
    ('sadness ', 'sadness', False),
    ('', 'neutral', False),
]


@pytest.fixture(scope="module")
def goemotions():
    root = Path(os.environ.get("OWAI_DATA", "")) / "icl" / "goemotions"
    if not os.environ.get("OWAI_DATA") or not (root / "train.tsv").is_file():
        pytest.skip("$OWAI_DATA lacks icl/goemotions (train.tsv, test.tsv, labels.txt)")
    return load_goemotions(root)


class _Says:
    """A model that answers every prompt with one continuation."""

    def __init__(self, continuation: str) -> None:
        self.continuation = continuation

    def generate(self, prompt: str) -> str:
        return self.continuation


def _through_scoring(data, options: PromptOptions, continuation: str) -> str:
    """The prediction `score_prompts` makes of `continuation` for the first query at one shot."""
    result = score_prompts(_Says(continuation), data, select_demonstrations(data, 1), select_queries(data)[:1], options)
    return result["examples"][0]["prediction"]


@pytest.mark.parametrize("rounds", sorted(GOEMOTION_PROMPTS))
def test_goemotion_prompt_byte_identical(goemotions, rounds: int) -> None:
    options = PromptOptions()
    context = render_context(goemotions, select_demonstrations(goemotions, rounds), options)
    prompts = [context + render_query(goemotions, q, options) for q in select_queries(goemotions)]
    first, every = GOEMOTION_PROMPTS[rounds]
    assert len(prompts) == 500
    assert hashlib.sha256(prompts[0].encode()).hexdigest() == first
    assert hashlib.sha256("\x1e".join(prompts).encode()).hexdigest() == every
    if rounds == 1:
        assert prompts[0][:300] == GOEMOTION_FIRST_300
        assert len(select_queries(goemotions, 10**6)) == GOEMOTION_SELECTED


@pytest.mark.parametrize("continuation,api,local", GOEMOTION_PARSED)
def test_goemotion_parsing_as_longiclbench(goemotions, continuation: str, api: str, local: str) -> None:
    queries = select_queries(goemotions)
    assert queries[0].text == GOEMOTION_QUERY_0
    options = PromptOptions()
    prompt = (render_context(goemotions, select_demonstrations(goemotions, 1), options)
              + render_query(goemotions, queries[0], options))
    assert parse_prediction(continuation, "goemotion", GOEMOTION_QUERY_0) == api
    assert parse_prediction(continuation, "goemotion", GOEMOTION_QUERY_0, prompt) == local
    assert _through_scoring(goemotions, PromptOptions(parse="api"), continuation) == api
    assert _through_scoring(goemotions, PromptOptions(parse="local"), continuation) == local


@pytest.mark.parametrize("prediction,gold,verdict", GOEMOTION_SCORED)
def test_goemotion_scoring_as_longiclbench(prediction: str, gold: str, verdict: bool) -> None:
    assert is_correct(prediction, gold, fold_case=True) is verdict


# ---------------------------------------------------------------------------------------------- tacred

_WORDS = "the a of in and said was for his her its at by on with from who has been to as an official company".split()
_NAMES = "Ana Bo Cyr Dee Eli Fay Gus Hal Ivo Jun Kai Lev Mo Ned Ola Pim Quy Rex Sol Tam Uma Vic Wes Xia Yul Zed".split()


def tacred_rows(n: int, seed: str) -> list[dict[str, str]]:
    """n rows in LongICLBench's processed TACRED format (sentence, relation, subject_entity,
    object_entity) from a seeded RNG: four frequent relations and 37 rarer ones, about 10 %
    no_relation, both entities inside the sentence, now and then a quote, an "é" or a " 's"."""
    rng = random.Random(seed)
    weights = [12 if i < 4 else 1 + (i % 3) for i in range(len(TACRED_RELATIONS))]
    rows = []
    for i in range(n):
        relation = NO_RELATION if rng.random() < 0.1 else rng.choices(TACRED_RELATIONS, weights)[0]
        subject = " ".join(rng.sample(_NAMES, rng.randint(1, 2)))
        obj = rng.choice(_NAMES) + rng.choice(["", " Inc", "é", " 's"])
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        words.insert(rng.randint(0, len(words)), subject)
        words.insert(rng.randint(0, len(words)), obj)
        if rng.random() < 0.1:
            words.append('" quoted "')
        rows.append({"sentence": " ".join(words) + f" #{i} .", "relation": relation, "subject_entity": subject,
                     "object_entity": obj})
    return rows


def write_tacred(folder: Path) -> Path:
    """train_tacred.json (3,000 rows: nine complete shots of the 41 relations in LongICLBench's single
    pass, which skips the rows whose relation the current shot already holds) and test_tacred.json
    (900 rows: 542 within its 20 per relation, some relations below 20), as its scripts read them."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 3000), ("test", 900)):
        (folder / f"{split}_tacred.json").write_text(json.dumps(tacred_rows(n, f"tacred-{split}"), indent=2))
    return folder



# tacred_infer.py's `select_test(test, 20)` on write_tacred's test file selects 542 queries; the
# scripts score the first 500 (`--test_number 500`). Prompts in LongICLBench's own template
# (tacred_format="longiclbench"; owai's default is the thesis's, App. C.2.3).
TACRED_SELECTED = 542
TACRED = PromptOptions(tacred_format="longiclbench")
# sha256 of the prompt of the first query, and of all 500 prompts joined by "\x1e", per round count
# (LongICLBench's script_tacred.sh runs rounds 1 to 5)
TACRED_PROMPTS = {
    1: ('3994fb45d370cb8d2e0890f505c30e06bdd7c87b00dc8b2d78fb3b76ebeabad1',
        'df19bbf285742bc0825ebab62dc6a2c587d1fcf3546bb07cc1a8ced06e4214ff'),
    2: ('d49779612c2e504ffc422a2596b310621dd61c5661267a7023b5180659167df9',
        'f6442db0eab5b7bdec49a69454de6f360708a955295db430d6f94651bd6f50dc'),
    3: ('c64398a21a19f4d831649978fd9d293cd9070f457eb445cab96f0bd322caf1d4',
        '52571534ee80d35d262072eab7a53919c7bf59eb684eec87f4b6e432436c2ece'),
    4: ('7aa342434d2956872b34ab13b4b15499839a930f5db7f672b90c2c9e6a0e771d',
        '57388f42a435d096076b2f8d88fa0bc34248e7d4206400b3e21f7d02fd5fa390'),
    5: ('daabe60d220f6935f4e58b560b8eb445afda45eaa085c947646d4206f6268d58',
        '5944ff085c24593da5de9daa61353a1d60760a21cca1f0abc548d8772344545c'),
}
TACRED_FIRST_300 = 'Given a sentence and a pair of subject and object entities within the sentence, please predict the relation between the given entities. The examples are as follows: \nsentence: in by was Quy Pim has her at was been Umaé #0 .\nthe subject is Quy Pim and the object is Umaé\nthe relation between the two e'
TACRED_QUERY_0 = 'with her has an Yul an on said company was Hal Inc official as to its " quoted " #0 .'
# (continuation, LongICLBench's prediction on its API path, on its local path: prompt + continuation)
TACRED_PARSED = [
    ('per:title', 'per:title', 'per:title'),
    (' Per:Title\nsentence: x', 'Per:Title', 'Per:Title'),
    ('\norg:founded_by', 'org:founded_by', 'org:founded_by'),
    ('per:title sentence: x the relation between the two entities is: per:age', 'per:title', 'per:title'),
    (' per:age the relation between the two entities is: per:title', 'per:age the relation between the two entities is: per:title', 'per:age'),
    ('\nthe subject is A and the object is B\nthe relation between the two entities is: per:spouse', 'the subject is A and the object is B', 'the subject is A and the object is B'),
    ('sentence: with her has an Yul an on said company was Hal Inc official as to its " quoted " #0 .\nthe relation between the two entities is: per:age', 'per:age', 'per:age'),
    ('', '', ''),
    (' is: per:title', 'is: per:title', 'is: per:title'),
    (' with her has an Yul an on said company was Hal Inc official as to its " quoted " #0 .', '', ''),
    (' with her has an Yul an on said company was Hal Inc official as to its " quoted " #0 .\nthe subject is A and the object is B\nthe relation between the two entities is: org:members\n', 'org:members', 'org:members'),
    ('PER:TITLE', 'PER:TITLE', 'PER:TITLE'),
    (' per:title sentence:x', 'per:title', 'per:title'),
    ('The relation between the two entities is: per:age', 'The relation between the two entities is: per:age', 'The relation between the two entities is: per:age'),
]
# (prediction, gold relation, LongICLBench's verdict: equal as written)
TACRED_SCORED = [
    ('per:title', 'per:title', True),
    ('Per:Title', 'per:title', False),
    ('per:title', 'org:founded_by', False),
    ('', 'per:title', False),
]


@pytest.fixture(scope="module")
def tacred(tmp_path_factory):
    return load_tacred(write_tacred(tmp_path_factory.mktemp("tacred")))


@pytest.mark.parametrize("rounds", sorted(TACRED_PROMPTS))
def test_tacred_prompt_byte_identical(tacred, rounds: int) -> None:
    context = render_context(tacred, select_demonstrations(tacred, rounds), TACRED)
    prompts = [context + render_query(tacred, q, TACRED) for q in select_queries(tacred)]
    first, every = TACRED_PROMPTS[rounds]
    assert len(prompts) == 500
    assert hashlib.sha256(prompts[0].encode()).hexdigest() == first
    assert hashlib.sha256("\x1e".join(prompts).encode()).hexdigest() == every
    if rounds == 1:
        assert prompts[0][:300] == TACRED_FIRST_300
        assert len(select_queries(tacred, 10**6)) == TACRED_SELECTED


@pytest.mark.parametrize("continuation,api,local", TACRED_PARSED)
def test_tacred_parsing_as_longiclbench(tacred, continuation: str, api: str, local: str) -> None:
    queries = select_queries(tacred)
    assert queries[0].text == TACRED_QUERY_0
    prompt = render_context(tacred, select_demonstrations(tacred, 1), TACRED) + render_query(tacred, queries[0], TACRED)
    assert parse_prediction(continuation, "tacred", TACRED_QUERY_0, label_marker=TACRED_LONGICL_LABEL) == api
    assert parse_prediction(continuation, "tacred", TACRED_QUERY_0, prompt, TACRED_LONGICL_LABEL) == local
    assert _through_scoring(tacred, PromptOptions(tacred_format="longiclbench", parse="api"), continuation) == api
    assert _through_scoring(tacred, PromptOptions(tacred_format="longiclbench", parse="local"), continuation) == local


@pytest.mark.parametrize("prediction,gold,verdict", TACRED_SCORED)
def test_tacred_scoring_as_longiclbench(prediction: str, gold: str, verdict: bool) -> None:
    assert is_correct(prediction, gold, fold_case=False) is verdict


def test_tacred_only_complete_shots(tacred) -> None:
    """LongICLBench's pass keeps a last, incomplete shot; owai refuses it (docs/decisions.md)."""
    assert len(select_demonstrations(tacred, 9)) == 9
    with pytest.raises(OwaiError, match="9 complete shots"):
        select_demonstrations(tacred, 10)
