"""The answers an evaluation has already had from its model, kept in its run directory so that a
killed evaluation, resumed, asks the model only for the rest (RULER's own code appends its
predictions to a file and skips those on a restart; lm-evaluation-harness keeps a request cache).

`answers.jsonl` holds one line per write, `{"answers": {KEY: VALUE, ...}}`, appended and fsynced: a
batch's answers are one line. KEY is a hash of what was asked (`answer_key`), VALUE what the model
answered (a continuation, a log-likelihood). A kill can cut only the last line: it is dropped when
the log is opened, and the file cut back to its last whole line before anything is appended, so
every line read is one whole write, and a batch is in the log whole or not at all. A run is resumed only with the settings it was started with
(`owai.experiment`), so every answer in the log is one the same model gave to the same question.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from owai.errors import OwaiError
from owai.runs import ANSWERS

FLUSH_SECONDS = 10.0  # answers buffered by `add` reach the disk at least this often


def answer_key(*parts: Any) -> str:
    """The key of one question: a hash of `parts` (the request kind, the prompt, the generation
    settings, ...) as canonical JSON."""
    text = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def occurrence_keys(parts: Iterable[tuple[Any, ...]]) -> list[str]:
    """`answer_key` of each question in a list, with the number of times the same question came before
    it in the list: a question asked twice in one call is answered twice, as it is without a log (the
    batches a resumed call makes are then the uninterrupted call's)."""
    seen: dict[str, int] = {}
    keys = []
    for p in parts:
        base = answer_key(*p)
        keys.append(answer_key(base, seen.get(base, 0)))
        seen[base] = seen.get(base, 0) + 1
    return keys


def rank0_value(answers: AnswerLog | None, key: str, valid: Callable[[Any], bool]) -> Any:
    """What rank 0's log holds under `key` (None when nothing, or nothing `valid`), on every rank:
    RULER and the in-context suites keep one log, rank 0's (None on the other ranks), and every
    rank must decide alike whether a part of the evaluation is done. In one process: the log's."""
    value = answers.get(key) if answers is not None else None
    value = value if value is not None and valid(value) else None
    from owai import distributed

    return distributed.broadcast_object(value) if distributed.world().world_size > 1 else value


def run_log(run_dir: Path) -> AnswerLog:
    """This process's answer log in the run in `run_dir`: its `answers.jsonl`, or under torchrun
    rank R's `answers.rankR.jsonl` for R > 0 (the language-model evaluations run on every rank, each
    on its own batches, and a file has one writer)."""
    from owai.distributed import world

    rank = world().rank
    name = ANSWERS if rank == 0 else ANSWERS.replace(".jsonl", f".rank{rank}.jsonl")
    return AnswerLog(Path(run_dir) / name)


class AnswerLog:
    """The answers in `path` (module docstring), and new ones appended to it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._answers: dict[str, Any] = {}
        self._pending: dict[str, Any] = {}
        self._last_flush = time.monotonic()
        self._read()
        try:  # a log that cannot be appended to is refused now, before the model is loaded
            open(self.path, "a").close()
        except OSError as e:
            raise OwaiError(f"cannot write {self.path}: {e.strerror or type(e).__name__}") from None

    def _read(self) -> None:
        """Load the whole lines; cut a last line a kill left unfinished off the file."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as e:
            raise OwaiError(f"{self.path} cannot be read ({e.strerror or type(e).__name__})") from None
        whole = data.rfind(b"\n") + 1  # bytes up to the end of the last whole line
        for line in data[:whole].splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # damaged: that answer is asked again
                continue
            if isinstance(row, dict) and isinstance(row.get("answers"), dict):
                self._answers.update(row["answers"])
        if whole < len(data):
            try:
                with open(self.path, "r+b") as f:
                    f.truncate(whole)
            except OSError as e:
                raise OwaiError(f"cannot write {self.path}: {e.strerror or type(e).__name__}") from None

    def __len__(self) -> int:
        return len(self._answers)

    def __contains__(self, key: str) -> bool:
        return key in self._answers

    def get(self, key: str, kind: type | tuple[type, ...] = object) -> Any:
        """The answer logged under `key`, or None when there is none or it is not of `kind` (a line
        damaged into another JSON value: that question is asked again)."""
        value = self._answers.get(key)
        return value if isinstance(value, kind) else None

    def add(self, key: str, value: Any) -> None:
        """Log one answer; it reaches the disk at the next `flush`, or within FLUSH_SECONDS (for
        answers that come one at a time, as the harness's cache hook reports them)."""
        self._remember(key, value)
        if time.monotonic() - self._last_flush >= FLUSH_SECONDS:
            self.flush()

    def add_batch(self, answers: dict[str, Any]) -> None:
        """Log a batch's answers and flush them as one line: the log never holds part of a batch,
        so a resume asks for the batches the uninterrupted run made."""
        for key, value in answers.items():
            self._remember(key, value)
        self.flush()

    def _remember(self, key: str, value: Any) -> None:
        self._answers[key] = value
        self._pending[key] = value

    def flush(self) -> None:
        """Append the answers logged since the last flush as one line, and fsync."""
        self._last_flush = time.monotonic()
        if not self._pending:
            return
        text = json.dumps({"answers": self._pending}, allow_nan=True) + "\n"
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise OwaiError(f"cannot write {self.path}: {e.strerror or type(e).__name__}") from None
        self._pending = {}
