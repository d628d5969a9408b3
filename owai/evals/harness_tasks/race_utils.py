"""The race_middle task: lm-evaluation-harness's `race` protocol on RACE's middle-school split.

The harness's `race` (race high) scores one question per article: the article, then the article's
earlier questions each with its answer (a fill-in-the-blank question ending in "  _  ." completed
by its answer, any other as "Question: ...\\nAnswer: ..."), then the last question as it is, and
the four options of that last question as the choices. Its dataset (EleutherAI/race) holds one row
per article with the questions in a `problems` field. ehovy/race, which has the middle split, holds
one row per question; `process_docs` groups its rows by article text, as the harness's own
collation that built EleutherAI/race did (rows in their stored order), into the same shape, so race
middle and race high are measured the same way.
"""

from __future__ import annotations

from typing import Any

LETTERS = "ABCD"
CLOZE_END = "  _  ."  # the harness's test for a fill-in-the-blank question that its answer completes


def process_docs(dataset: Any) -> Any:
    """One document per article: {article, problems: [{question, options, answer}, ...]} in order."""
    from datasets import Dataset

    articles: dict[str, dict[str, Any]] = {}
    for row in dataset:
        doc = articles.setdefault(row["article"], {"article": row["article"], "problems": []})
        doc["problems"].append({"question": row["question"], "options": list(row["options"]), "answer": row["answer"]})
    return Dataset.from_list(list(articles.values()))


def _answer(problem: dict) -> str:
    return problem["options"][LETTERS.index(problem["answer"].strip())]


def doc_to_text(doc: dict) -> str:
    text = "Article: " + doc["article"] + "\n\n"
    for problem in doc["problems"][:-1]:
        if problem["question"][-len(CLOZE_END):] == CLOZE_END:
            text += problem["question"][:-(len(CLOZE_END) - 1)] + _answer(problem) + "\n"
        else:
            text += "Question: " + problem["question"] + "\n" + "Answer: " + _answer(problem) + "\n"
    return text + doc["problems"][-1]["question"]


def doc_to_choice(doc: dict) -> list[str]:
    return list(doc["problems"][-1]["options"])


def doc_to_target(doc: dict) -> int:
    return LETTERS.index(doc["problems"][-1]["answer"].strip())
