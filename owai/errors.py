"""The one user-facing error type.

Anything a user can get wrong (a recipe id, a YAML file, a --set path, a run directory, a
checkpoint) raises `OwaiError` with a single-line message; the CLI prints it and exits non-zero.
"""

from __future__ import annotations

import contextlib
import difflib
import re
import signal
import threading
import traceback
from collections.abc import Iterable, Iterator
from typing import Any


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


class PeerFailed(OwaiError):
    """This rank of a torchrun job lost contact with another rank (gloo's closed connection, an NCCL
    error): a symptom, said as its cause, the other rank's error where that rank recorded it
    (`owai.runs.Run.record_failure`), instead of an internal error naming the transport. Exit code 1:
    nothing the user gave was wrong."""

    exit_code = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (torchrun stopping its ranks, SLURM's cancel or time limit, `kill`, a closed
    terminal), raised where the signal arrives: a run stops as on Ctrl-C (status.json `interrupted`,
    its checkpoints kept for --resume) instead of dying with status.json `running`."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    def __reduce__(self) -> tuple[type, tuple[int]]:  # pickled by its number (args holds the name)
        return type(self), (self.signum,)


class Termination:
    """What `stop_on_termination` saw: the signal that stopped the block, if one did (`signum`),
    which survives the CLI library's turning a KeyboardInterrupt into its own Abort / exit 130."""

    signum: int | None = None


_OPEN: list[Termination] = []  # the records of the open `stop_on_termination` blocks, outermost first


@contextlib.contextmanager
def stop_on_termination() -> Iterator[Termination]:
    """SIGTERM and SIGHUP raise `Terminated` inside the block, the handlers before it restored after.
    Not over an ignored signal (a job started under nohup keeps running when its terminal closes), and
    only in the main thread, where Python runs signal handlers. Nested blocks (a SLURM sweep's inside
    the CLI's) each see the signal, so the outer one still says which signal stopped it."""
    seen = Termination()
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return

    def stop(signum: int, frame: object) -> None:
        for record in _OPEN:
            record.signum = signum
        raise Terminated(signum)

    previous: dict[int, Any] = {}
    _OPEN.append(seen)
    try:  # installed inside the try: a signal between the two installations finds the first restored
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, stop)
        yield seen
    finally:
        _OPEN.remove(seen)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def termination_deferred() -> Iterator[None]:
    """SIGTERM and SIGHUP held back for the block, then acted on as they would have been (a
    `Terminated` raised as the block ends, under `stop_on_termination`): for a short write that a stop
    must not cut half-way, such as the status.json of a torchrun rank that torchrun stops while it
    records why the run failed. A Python handler stands in for the block (a signal mask would not do:
    the kernel hands a process's signal to any thread that does not block it, and torch's threads do
    not). Only in the main thread, and not over an ignored signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        held.append(signum)

    previous: dict[int, Any] = {}
    try:  # installed inside the try: a signal between two installations still finds the first restored
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, hold)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])


def not_utf8(path: object, error: UnicodeDecodeError | None = None) -> OwaiError:
    """The one refusal of a text file that is not UTF-8 (corpora, essays, CSV and TSV files): owai reads
    text exactly. With the decoding `error`, the byte where it stopped."""
    return OwaiError(f"{path}: not UTF-8 text ({f'byte {error.start}' if error is not None else 'wrong file format?'})")


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:: (.*))?$")  # `module.Type: message` (or `Type`)


def worker_message(text: str) -> str | None:
    """The message of an exception raised in a DataLoader worker, from the text torch re-raises it
    with ("Caught OwaiError in DataLoader worker process 0.", "Original Traceback ...", the frames,
    then `module.Type: message`); None for any other text."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) < 3 or not lines[0].startswith("Caught ") or not lines[1].startswith("Original Traceback"):
        return None
    frames = [i for i, line in enumerate(lines) if line.startswith('File "')]
    for line in lines[frames[-1] + 1 if frames else 2:]:  # the first line after the last frame that names a type
        match = _EXCEPTION_LINE.match(line)
        if match:
            return match.group(1) or line
    return lines[-1]


def user_message(exc: BaseException) -> str:
    """What an error says to the user: its text, or for one re-raised from a DataLoader worker, the
    worker's own message (the file it could not read), not torch's wrapper."""
    return worker_message(str(exc)) or str(exc)


def one_line(exc: BaseException, limit: int | None = 240, typed: bool = False) -> str:
    """An exception as one short line for an error message: an OwaiError's own first line (it is
    already written for the user), any other as `Type: first non-empty line`; cut at `limit` (None:
    not cut). A DataLoader worker's exception by its own message (`worker_message`). `typed`: an
    OwaiError's line too after its type's name (a record that names the exception's type)."""
    line = first_line(user_message(exc), None)
    if isinstance(exc, OwaiError) and not typed:
        text = line or type(exc).__name__
    else:
        text = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return first_line(text, limit)


def release_frames(error: BaseException | None) -> None:
    """Drop the locals of the frames `error` (and each error it chains) came through, as
    `traceback.clear_frames` does, once the error has been said. An exception re-raised from a
    DataLoader worker is in a reference cycle with its traceback (torch's `reraise` frame holds it),
    so without this what the failed run held (its model and optimizer, GPU memory, loader workers)
    stays until the garbage collector reaches the cycle: in a process that goes on (a notebook
    calling `main`, a sweep worker's next point) that is memory the next run needs, and torch's
    shutdown of workers whose iterator the collector reclaims waited out a 5-s join per worker
    (their index queue went in the same cycle; with the queue held elsewhere the shutdown was
    immediate). Frames still executing (the caller's) are left as they are."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def first_line(text: str, limit: int | None = 240) -> str:
    """`text`'s first non-empty line, stripped, cut at `limit` characters (None: not cut): what a
    one-line message keeps of a longer one."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return line if limit is None or len(line) <= limit else line[: limit - 3] + "..."
