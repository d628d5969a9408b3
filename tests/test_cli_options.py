"""Every flag a command's source declares reaches its command line, on every Python owai supports.

Python 3.10's `typing.get_type_hints` wraps the type of a function parameter whose default is None
in Optional[...] (3.11 stopped), which hides an `Annotated[..., typer.Option(...)]` from Typer: the
option then loses its short flag and help, and an argument becomes an option. On 3.10, 149 tests
failed or errored that way until `@options` read annotations with inspect instead (docs/results.md).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Annotated, Optional

import pytest
import typer
from typer.models import ArgumentInfo, OptionInfo, ParameterInfo

from owai.cli import app
from owai.commands._common import OptionGroup, RunOptions, options


def _commands(command: typing.Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], typing.Any]]:
    """(path, leaf command) of a click group, Typer's vendored click or click itself."""
    if hasattr(command, "commands"):
        return [leaf for name, sub in sorted(command.commands.items()) for leaf in _commands(sub, path + (name,))]
    return [(path, command)]


def _declared(function: typing.Callable[..., typing.Any]) -> dict[str, ParameterInfo]:
    """Parameter name -> the typer.Option / typer.Argument its source declares (OptionGroups spread)."""
    declared: dict[str, ParameterInfo] = {}
    for param in inspect.signature(function, eval_str=True).parameters.values():
        kind = param.annotation
        if isinstance(kind, type) and issubclass(kind, OptionGroup):
            hints = typing.get_type_hints(kind, include_extras=True)
            items = [(field.name, hints[field.name]) for field in dataclasses.fields(kind)]
        else:
            items = [(param.name, kind)]
        for name, hint in items:
            infos = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, ParameterInfo)]
            if infos:
                declared[name] = infos[0]
    return declared


COMMANDS = _commands(typer.main.get_command(app))


@pytest.mark.parametrize("path,command", COMMANDS, ids=[" ".join(path) for path, _ in COMMANDS])
def test_every_declared_flag_and_help_reaches_the_command_line(path, command):
    declared = _declared(inspect.unwrap(command.callback))
    assert declared, f"owai {' '.join(path)}: no Annotated parameters found"
    params = {p.name: p for p in command.params}
    for name, info in declared.items():
        param = params[name]
        if isinstance(info, ArgumentInfo):
            assert param.param_type_name == "argument", (path, name)
            continue
        assert isinstance(info, OptionInfo) and param.param_type_name == "option", (path, name)
        # in Annotated, typer.Option's first positional (its `default` field) is the first flag
        decls = ((info.default,) if isinstance(info.default, str) else ()) + tuple(info.param_decls or ())
        flags = {part.strip() for decl in decls for part in decl.split("/")}
        assert flags <= set(param.opts) | set(param.secondary_opts), (path, name, flags, param.opts)
        assert param.help == info.help, (path, name)


def test_options_does_not_rely_on_get_type_hints_of_functions(monkeypatch):
    """`@options` under Python 3.10's get_type_hints (emulated on any Python): the flags survive."""
    real = typing.get_type_hints

    def as_on_python_310(obj, *args, **kwargs):
        hints = real(obj, *args, **kwargs)
        if inspect.isfunction(obj):
            for param in inspect.signature(obj).parameters.values():
                if param.default is None and param.name in hints:
                    hints[param.name] = Optional[hints[param.name]]
        return hints

    monkeypatch.setattr(typing, "get_type_hints", as_on_python_310)
    command = options(_a_command)
    parameters = inspect.signature(command).parameters
    name = parameters["name"].annotation
    assert typing.get_origin(name) is Annotated and name.__metadata__[0].help == "A name."
    assert typing.get_origin(parameters["preset"].annotation) is Annotated  # a group's option, spread


def _a_command(name: Annotated[Optional[str], typer.Option("--name", "-n", help="A name.")] = None,
               opts: RunOptions = RunOptions()) -> None:
    """A command as owai's are written (an option defaulting to None, and an option group)."""
