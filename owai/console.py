"""Terminal output: one Rich console, the --quiet / --json switches, progress bars.

--quiet hides progress bars and informational lines; errors still go to stderr.
--json keeps stdout for exactly one JSON document (the command's result); everything
human-readable goes to stderr or is suppressed.
"""

from __future__ import annotations

import json
import sys
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

stdout = Console(highlight=False)
stderr = Console(stderr=True, highlight=False)


class _State:
    quiet: bool = False
    json: bool = False


state = _State()


def configure(quiet: bool = False, as_json: bool = False) -> None:
    """Set the output mode for this process (called once per command)."""
    state.quiet = quiet
    state.json = as_json


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


class Bar:
    """A manually advanced progress bar with a status field (for training loops)."""

    def __init__(self, description: str, total: int, completed: int = 0) -> None:
        self._progress: Progress | None = None
        if progress_enabled():
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

    def update(self, advance: int = 1, status: str | None = None) -> None:
        """Advance the bar; `status` (e.g. the latest loss) stays until replaced."""
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
