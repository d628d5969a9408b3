"""The one user-facing error type.

Anything a user can get wrong (a recipe id, a YAML file, a --set path, a run directory, a
checkpoint) raises `OwaiError` with a single-line message; the CLI prints it and exits non-zero.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """" (did you mean 'x'?)" for the known name closest to a mistyped `word`, or "" if none is close:
    the hint every unknown-name error ends with."""
    close = difflib.get_close_matches(word, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class OwaiError(Exception):
    """A user-facing error: printed as one line, exit code 2, no traceback."""

    exit_code = 2


class DataMissing(OwaiError):
    """An input the config names is not on this machine (a dataset, a tokenizer from the hub), or one
    the user gives at run time is not given yet (the model to evaluate): the run cannot start as it
    stands, though the config itself is valid (`owai recipes show` still shows it)."""
