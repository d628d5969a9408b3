"""One measured value: what counts as a number (`numeric`) and how it prints (`fmt`).

Below the results layer (claims, sweeps, reports, the methods' study tables), which all read and
print the same values and so share these two rules instead of importing each other for them.
"""

from __future__ import annotations

import math
from typing import Any


def numeric(value: Any) -> float | None:
    """Numbers count (booleans as 0/1, so their mean is a fraction); lists, text and null do not."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


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
