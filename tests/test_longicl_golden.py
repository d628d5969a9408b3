"""LongICLBench as published (issue #37): golden values from TIGER-AI-Lab/LongICLBench's own code.

Produced outside the project by running `select_data`, `format_discovery_prompt` and the answer
parsing block of `banking77_infer.py` (commit 9c5da3d) on the real banking77 files (PolyAI's
train.csv / test.csv, labels as HF ids). Only the values are kept here.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from owai.evals.longicl import (PromptOptions, load_banking77, parse_prediction, render_context, render_query,
                                select_demonstrations, select_queries)

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
