"""Terminal output: one Rich console, the --quiet / --json switches, progress bars.

Streams: stdout carries only a command's result (its table, or with --json one JSON document);
informational lines and progress go to stderr, so `owai ... > result.txt` keeps the result alone.
--quiet silences everything but errors: owai's info lines and progress, and the libraries' too
(Python warnings, library logging below ERROR, every tqdm bar: transformers' "Loading weights",
lm-evaluation-harness's, the hub's and datasets'), for this process and the processes it starts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.markup import escape
from rich.table import Table
from rich.text import Text

T = TypeVar("T")

# Width of output that is not a terminal (a file, a pipe): wide enough that tables are never cut
# or wrapped at Rich's 80-column default; a table still takes only the width it needs. COLUMNS wins.
PIPE_WIDTH = 1000
# Seconds between the plain progress lines a bar prints when stderr is not a terminal
# (environment: OWAI_PROGRESS_SECONDS).
PROGRESS_SECONDS = 30.0

stdout = Console(highlight=False)
stderr = Console(stderr=True, highlight=False)


def _fit_width(con: Console) -> None:
    """A terminal keeps its own width; anything else gets PIPE_WIDTH unless COLUMNS is set."""
    if not con.is_terminal and not os.environ.get("COLUMNS"):
        con.width = PIPE_WIDTH


_fit_width(stdout)
_fit_width(stderr)


def fit_table(table: Table, whole: Sequence[int] = ()) -> Table:
    """`table` (returned) fitted to stdout's width, for the columns a user copies from: `whole` are
    their indices (ids, metric names, commands). Every column folds instead of ending in "…". On a
    console too narrow for one line per cell, the `whole` columns keep their full width where the
    others can still have 8 columns each, else the width of their longest word (so they wrap between
    words, never inside one); the other columns share the rest, narrowest first, each up to its
    natural width. Rich's own narrowing cuts every column evenly, ids included; it is left to fold
    them only where even this does not fit."""
    for column in table.columns:
        column.overflow = "fold"

    def lines(cell: Any) -> list[str]:
        text = cell.plain if isinstance(cell, Text) else Text.from_markup(cell).plain if isinstance(cell, str) else ""
        return text.splitlines() or [""]

    texts = [lines(column.header) + [line for cell in column.cells for line in lines(cell)] for column in table.columns]
    natural = [max(cell_len(line) for line in column) for column in texts]
    unbounded = stdout.options.update_width(10**6)
    overhead = Measurement.get(stdout, unbounded, table).maximum - sum(natural)  # borders and padding
    width = stdout.width
    if sum(natural) + overhead <= width:
        return table
    # a word with its indentation ("  metric" in a sweep's grid cell) is one unit
    words = {i: max(cell_len(word) for line in texts[i] for word in re.findall(r"^\s*\S+|\S+", line) or [""])
             for i in whole}
    others = sorted((i for i in range(len(natural)) if i not in words), key=natural.__getitem__)
    for widths in ({i: natural[i] for i in whole}, words):
        free = width - overhead - sum(widths.values())
        if free >= 8 * len(others):
            break
    else:
        return table
    for k, i in enumerate(others):
        widths[i] = min(natural[i], free // (len(others) - k))
        free -= widths[i]
    for i, column in enumerate(table.columns):
        column.width = widths[i]
    return table


class _State:
    def __init__(self) -> None:
        self.quiet = False
        self.json = False
        self.said: set[str] = set()  # the `info(..., once=True)` lines this command has printed


state = _State()


def configure(quiet: bool = False, as_json: bool = False) -> None:
    """Set the output mode for this process (called once per command; a sweep point sets quiet and
    restores the mode after). Quiet also silences the libraries (`silence_libraries`)."""
    state.quiet = quiet
    state.json = as_json
    state.said = set()
    silence_libraries(quiet)
    _fit_width(stdout)
    _fit_width(stderr)


# What --quiet sets for the processes this one starts (torchrun ranks, sweep workers, the harness's
# own subprocesses), which import the libraries afresh: they read these at import.
QUIET_ENV = {
    "PYTHONWARNINGS": "ignore",
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


# tqdm(iterable, desc, total, leave, file, ncols, mininterval, maxinterval, miniters, ascii, disable, ...)
TQDM_DISABLE_POSITION = 10


class _Silenced:
    """What `silence_libraries(True)` changed, to put back (in-process callers, tests, sweep points)."""

    def __init__(self) -> None:
        self.filters = list(warnings.filters)
        self.logging_disable = logging.root.manager.disable
        self.environ = {key: os.environ.get(key) for key in QUIET_ENV}
        self.tqdm_init: Any = None


_silenced: _Silenced | None = None


def silence_libraries(quiet: bool) -> None:
    """Under --quiet, nothing but errors from the libraries either: Python warnings ignored (e.g.
    transformers' FutureWarnings), logging below ERROR off (lm-evaluation-harness's notices,
    transformers' and the hub's messages), every tqdm bar disabled (all the libraries' bars are tqdm,
    and some pass disable=False explicitly, so tqdm's own __init__ is wrapped), and QUIET_ENV set
    for child processes. `quiet=False` puts back what a previous `silence_libraries(True)` changed."""
    global _silenced
    if quiet and _silenced is None:
        saved = _Silenced()
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        os.environ.update(QUIET_ENV)
        try:
            import tqdm.std
        except ImportError:  # no tqdm, no bars
            pass
        else:
            saved.tqdm_init = tqdm.std.tqdm.__init__

            def quiet_init(self: Any, *args: Any, **kwargs: Any) -> None:
                if len(args) > TQDM_DISABLE_POSITION:  # given positionally
                    args = (*args[:TQDM_DISABLE_POSITION], True, *args[TQDM_DISABLE_POSITION + 1:])
                else:
                    kwargs["disable"] = True
                saved.tqdm_init(self, *args, **kwargs)

            tqdm.std.tqdm.__init__ = quiet_init  # type: ignore[method-assign]
        _silenced = saved
    elif not quiet and _silenced is not None:
        saved, _silenced = _silenced, None
        warnings.filters[:] = saved.filters
        getattr(warnings, "_filters_mutated", lambda: None)()  # as catch_warnings does on exit
        logging.disable(saved.logging_disable)
        for key, value in saved.environ.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if saved.tqdm_init is not None:
            import tqdm.std

            tqdm.std.tqdm.__init__ = saved.tqdm_init  # type: ignore[method-assign]


def text_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], left: Sequence[str] = ()) -> Table:
    """A table of plain text, the one shape of the studies' tables: the title and every cell are
    escaped (a preset's "[cpu]" in a title is text, not a style Rich drops); the columns named in
    `left` are left-aligned (labels), the others right-aligned (numbers)."""
    table = Table(title=escape(title))
    for name in columns:
        table.add_column(escape(name), justify="left" if name in left else "right")
    for row in rows:
        table.add_row(*(escape(str(cell)) for cell in row))
    return table


def info(message: str, once: bool = False) -> None:
    """A human-readable status line on stderr (stdout carries only the result); nothing under --quiet.
    `once`: not again in this command (a sweep checks every point's config, and a note about the
    config would otherwise repeat a line per point)."""
    if state.quiet or (once and message in state.said):
        return
    if once:
        state.said.add(message)
    stderr.print(message, markup=False)  # paths and names may hold '[...]'


def emit_json(obj: Any) -> None:
    """Write the command's single JSON result to stdout, as owai writes its JSON files (a NaN or
    infinite number as null: `values.finite_json`)."""
    from owai.values import finite_json

    sys.stdout.write(json.dumps(finite_json(obj), indent=2, default=str) + "\n")
    sys.stdout.flush()


def progress_enabled() -> bool:
    return not state.quiet and not state.json


def _progress_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get("OWAI_PROGRESS_SECONDS", PROGRESS_SECONDS)))
    except ValueError:
        return PROGRESS_SECONDS


class Bar:
    """A manually advanced progress bar with a status field (for training loops).

    On a terminal: a Rich bar on stderr (not under --quiet/--json). Not on a terminal (a log file,
    a pipe, a batch job): a plain stderr line every `OWAI_PROGRESS_SECONDS` (30) seconds with
    step/total, percentage, status (e.g. the loss) and elapsed time, and a last line at the end
    if any was printed; under --json too (stdout stays one JSON document), never under --quiet.
    `total` None: a count not known in advance (a pulsing bar, "n/?")."""

    def __init__(self, description: str, total: int | None, completed: int = 0) -> None:
        self._progress: Progress | None = None
        self._lines = False
        self.description, self.total, self.completed, self.status = description, total, completed, ""
        self._start = self._last = time.monotonic()
        self._every = _progress_seconds()
        self._printed = False
        self._printed_at: tuple[int, str] | None = None
        if not stderr.is_terminal:
            self._lines = not state.quiet
        elif progress_enabled():
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
                console=stderr,
            )
            self._task = self._progress.add_task(description, total=total, completed=completed, status="")

    def __enter__(self) -> "Bar":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._printed and exc[0] is None:
            self._line()

    def _line(self) -> None:
        if self._printed_at == (self.completed, self.status):
            return
        self._printed_at = (self.completed, self.status)
        elapsed = int(time.monotonic() - self._start)
        share = f" ({100 * self.completed / self.total:.0f}%)" if self.total else ""
        status = f", {self.status}" if self.status else ""
        stderr.print(f"{self.description}: {self.completed}/{'?' if self.total is None else self.total}{share}{status}, "
                     f"elapsed {elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}",
                     markup=False, highlight=False, soft_wrap=True)
        self._printed = True

    def update(self, advance: int = 1, status: str | None = None) -> None:
        """Advance the bar; `status` (e.g. the latest loss) stays until replaced."""
        self.completed += advance
        if status is not None:
            self.status = status
        if self._lines:
            now = time.monotonic()
            if now - self._last >= self._every:
                self._last = now
                self._line()
        if self._progress is None:
            return
        if status is None:
            self._progress.update(self._task, advance=advance)
        else:
            self._progress.update(self._task, advance=advance, status=status)


def track(iterable: Iterable[T], total: int, description: str = "") -> Iterator[T]:
    """Iterate with a progress bar on stderr (hidden under --quiet/--json)."""
    with Bar(description, total) as bar:
        for item in iterable:
            yield item
            bar.update()
