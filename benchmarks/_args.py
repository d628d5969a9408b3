"""The benchmark scripts' one error path for bad input, as owai's own: one `error:` line on stderr and
exit code 2, before anything is built or timed (argparse's own two-line usage message otherwise, and
a traceback, or figures of nothing, for values it cannot check)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn


def say_error(message: str) -> int:
    """Print the one `error:` line; the exit code to return (for a `main` that returns its code)."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def fail(message: str) -> NoReturn:
    raise SystemExit(say_error(message))


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with the one-line error."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see {self.prog} --help)")


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


positive = at_least(1)  # a count, a length, a size


def check_device(device: str, allowed: tuple[str, ...] = ("cpu", "cuda")) -> None:
    """--device is one of `allowed`, and CUDA is there when it asks for it."""
    if device not in allowed:
        fail(f"--device {device!r}: choose {', '.join(allowed[:-1])} or {allowed[-1]}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            fail(f"--device cuda: torch {torch.__version__} sees no CUDA device here")
