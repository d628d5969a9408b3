"""Terminal output: one Rich console, the --quiet / --json switches, progress bars.

--quiet hides progress bars and informational lines; errors still go to stderr.
--json keeps stdout for exactly one JSON document (the command's result); everything
human-readable goes to stderr or is suppressed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

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


class _State:
    quiet: bool = False
    json: bool = False


state = _State()


def configure(quiet: bool = False, as_json: bool = False) -> None:
    """Set the output mode for this process (called once per command)."""
    state.quiet = quiet
    state.json = as_json
    _fit_width(stdout)
    _fit_width(stderr)


def info(message: str) -> None:
    """A human-readable status line: stdout normally, stderr under --json, nothing under --quiet."""
    if state.quiet:
        return
    (stderr if state.json else stdout).print(message)


def emit_json(obj: Any) -> None:
    """Write the command's single JSON result to stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
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
    if any was printed; under --json too (stdout stays one JSON document), never under --quiet."""

    def __init__(self, description: str, total: int, completed: int = 0) -> None:
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
        stderr.print(f"{self.description}: {self.completed}/{self.total}{share}{status}, "
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
