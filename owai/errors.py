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


class CannotRunHere(OwaiError):
    """The config is valid but cannot run as it stands on this machine: an input is missing
    (DataMissing), or a rank here cannot hold the model. `owai recipes show` still shows it."""


class DataMissing(CannotRunHere):
    """An input the config names is not on this machine (a dataset, a tokenizer from the hub), or one
    the user gives at run time is not given yet (the model to evaluate)."""


def not_utf8(path: object, error: UnicodeDecodeError | None = None) -> OwaiError:
    """The one refusal of a text file that is not UTF-8 (corpora, essays, CSV and TSV files): owai reads
    text exactly. With the decoding `error`, the byte where it stopped."""
    return OwaiError(f"{path}: not UTF-8 text ({f'byte {error.start}' if error is not None else 'wrong file format?'})")


def one_line(exc: BaseException, limit: int | None = 240) -> str:
    """An exception as one short line for an error message: an OwaiError's own first line (it is
    already written for the user), any other as `Type: first non-empty line`; cut at `limit` (None:
    not cut)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 2 and lines[0].startswith("Caught ") and lines[1].startswith("Original Traceback"):
        # raised in a DataLoader worker and re-raised by torch: the worker's message is the traceback's
        # last line, `module.Type: message`
        head, sep, message = lines[-1].partition(": ")
        lines = [message if sep and " " not in head else lines[-1]]
    if isinstance(exc, OwaiError):
        text = lines[0] if lines else type(exc).__name__
    else:
        text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."
