"""Prompt of the race_middle task (ehovy/race rows: article, question, options, answer letter)."""

from __future__ import annotations

LETTERS = "ABCD"


def doc_to_text(doc: dict) -> str:
    question = doc["question"].strip()
    text = "Article: " + doc["article"] + "\n\n"
    if "_" in question:  # a cloze question: the options complete the text before the blank
        return text + question[: question.index("_")].rstrip()
    return text + "Question: " + question + "\nAnswer:"


def doc_to_target(doc: dict) -> int:
    return LETTERS.index(doc["answer"].strip())
