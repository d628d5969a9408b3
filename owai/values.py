"""One measured value: what counts as a number (`numeric`) and how it prints (`fmt`; beside the
thesis's number and claim, `thesis_text`; in a Markdown table, `md_row`; in a JSON file or on
stdout, `finite_json`).

Below the results layer (claims, sweeps, reports, the methods' study tables), which all read and
print the same values and so share these rules instead of importing each other for them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def numeric(value: Any) -> float | None:
    """Numbers count (booleans as 0/1, so their mean is a fraction); lists, text and null do not."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def finite_json(value: Any) -> Any:
    """`value` as owai writes JSON (results.json, status.json, summary.json, study files,
    metrics.jsonl, `--json` on stdout): every NaN or infinite number replaced by null. JSON has no
    such numbers; Python would write `NaN` / `Infinity`, which strict readers (jq, JavaScript,
    most JSON libraries) refuse. Numpy and torch values are turned into Python ones first (`tolist`)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy / torch scalars and arrays
        return finite_json(value.tolist())
    return value


def fmt(value: Any) -> str:
    """A value in a table: 4 significant digits, yes/no, "-" for none, lists in brackets."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return str(value)


def thesis_text(value: Any, claim: str | None) -> str:
    """The thesis cell of a results row: its number with its claim in brackets, the claim alone
    when the thesis gives no number, "-" when it gives neither (a run's table and a sweep's alike)."""
    claim = claim or ""
    if value is None:
        return claim or "-"
    return f"{fmt(value)} ({claim})" if claim else fmt(value)


def md_row(cells: Iterable[Any]) -> str:
    """One row of a Markdown table: each cell as text, its `|` escaped and its line breaks made
    spaces (a claim's check `|a - b| <= tol` or a continuation's text would otherwise split the row)."""
    texts = (str(c).replace("|", "\\|").replace("\n", " ") for c in cells)
    return "|" + "|".join(f" {t} " if t else " " for t in texts) + "|"
