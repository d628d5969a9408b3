"""Loaders of owai's offline smoke tasks: the JSONL files beside this module as a test split (the
harness's `custom_dataset` hook; no `datasets` cache, no hub)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _load(name: str) -> Any:
    import datasets

    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_mc(**kwargs: Any) -> Any:
    return _load("owai_mc_smoke.jsonl")


def load_gen(**kwargs: Any) -> Any:
    return _load("owai_gen_smoke.jsonl")
