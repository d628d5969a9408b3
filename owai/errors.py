"""The one user-facing error type.

Anything a user can get wrong (a recipe id, a YAML file, a --set path, a run directory, a
checkpoint) raises `OwaiError` with a single-line message; the CLI prints it and exits non-zero.
"""


class OwaiError(Exception):
    """A user-facing error: printed as one line, exit code 2, no traceback."""

    exit_code = 2


class DataMissing(OwaiError):
    """An input the config names is not on this machine (a dataset, a tokenizer from the hub): the
    run cannot start here, though the config itself is valid (`owai recipes show` still shows it)."""
