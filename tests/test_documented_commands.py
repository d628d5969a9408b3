"""Every `owai ...` command line the documents quote parses with the CLI's own parser, and each one
that starts a run gets, through the command's own code, to where its run would begin.

The README, docs/*.md, the recipes' text and comments, and the commands' own docstrings and help
texts (owai/cli.py, owai/commands/*.py) show command lines a user copies: an option renamed since must
not leave them behind. Each quoted command (an inline code span, a line of a fenced code block, an
example line of a docstring) is parsed as `owai` would parse it, nothing run: an unknown command or
option, a missing required option or argument or a bad value fails here, naming the file, the line
and the command.

How a quote is read:
- the shell around the command: env assignments, `torchrun ... -m owai`, `python -m owai`, pipes,
  `&&`, `;`, redirections, `\\` continuations, `# comments`;
- the remark after it: in a code block, what follows two spaces (unless an option follows), an arrow
  (`─►`) or an unquoted `(`; in a docstring's examples, what follows two spaces;
- placeholders: RUN_DIR, MODEL_DIR..., `<run>`, `$VAR` stand for a value (a name or a number;
  `$VAR` and `<several words>` may also stand for nothing), `...` for more options; `[--opt V]` and
  `[SOURCE]` are optional parts, given; `a|b` in one word, `[a | b]` and `a / b` are alternatives,
  each parsed (a table's `tiny\\|small\\|large` included); `owai CMD` is any method command;
- a quote that only names a command (`owai report`) must name one that exists; one that ends with an
  option and no value (`owai sweep --resume`) names the option, which must exist.

Parsing does not see what the command body checks: a `--set` key renamed since, a value of the wrong
type, an unknown preset, `--size` or `--init`, a `--set` the run never reads, options the command does
not combine. So each command line that parses is also run in this process, with each run stopped
where it would begin and its config resolved against the method's schema, nothing validated against
this machine's inputs (`stopped_where_runs_begin`, and the comment above PARSE_ONLY for what each kind
of command line goes through). Its refusal fails here, naming the file, the line and the message.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import owai_command, parse_owai

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = ["README.md", "docs/architecture.md", "docs/results.md", "docs/decisions.md"]
YAML = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "recipes").glob("*.yaml"))
PYTHON = ["owai/cli.py", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "owai" / "commands").glob("*.py"))]

# Quoted commands that do not parse and stay as written: (file, the quote as read) -> why. Each is an
# expected failure (strict): once the quote parses, or is gone, its entry must go.
ALLOWED: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Quote:
    path: str  # relative to the repository root
    line: int  # 1-based line of the quote's first character
    text: str  # as read: continuation lines joined, a code line's remark cut
    whole: bool  # a command line (a code block's line, a docstring's example), not an inline span

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


# ---------------------------------------------------------------------------------------------------
# Extraction: the quoted text that runs owai
# ---------------------------------------------------------------------------------------------------

_SPAN = re.compile(r"(?<![`\\])`([^`]+)`(?!`)")  # a code span (a backslash-escaped backtick opens none)
_FENCE = re.compile(r"^\s*(```|~~~)")
_ARROW = re.compile(r"\s*(─►|►|→|⟶).*$")
# owai run at the start of a command: after env assignments and wrappers, or by torchrun / python -m
_RUNS_OWAI = re.compile(r"(^|&&|\|\||[;|])\s*(\$\s+)?([A-Za-z_]\w*=\S*\s+)*((time|nohup|env|exec|srun)\s+)*"
                        r"(owai|\S*(torchrun|python3?)\s(\S+\s+)*?-m\s+owai)\s+\S")


Found = tuple[int, str, bool]  # (line, text, whole command line)


def _spans(lines: list[tuple[int, str]]) -> list[Found]:
    """The inline code spans of one paragraph's lines (a span may wrap), each with its first line's number."""
    text, starts = "", []
    for number, line in lines:
        starts.append((len(text), number))
        text += line + "\n"
    return [(max(n for offset, n in starts if offset <= m.start()), " ".join(m.group(1).split()), False)
            for m in _SPAN.finditer(text)]


def _paragraphs(lines: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    out: list[list[tuple[int, str]]] = [[]]
    for number, line in lines:
        if line.strip():
            out[-1].append((number, line))
        elif out[-1]:
            out.append([])
    return [p for p in out if p]


def _code_lines(lines: list[tuple[int, str]]) -> list[Found]:
    """A code block's lines, `\\` continuations joined, each cut before its remark (an arrow, or two
    spaces then anything but an option: `# comment`, a description column), with its first line's number."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in lines:
        if pending is not None:
            number, line = pending[0], pending[1].rstrip() + " " + line.strip()
            pending = None
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1])
            continue
        out.append((number, line))
    if pending is not None:
        out.append(pending)
    return [(n, re.split(r"\s{2,}(?!-)", _ARROW.sub("", line).strip())[0], True) for n, line in out]


def markdown_quotes(text: str) -> list[Found]:
    """Fenced code blocks' lines and inline code spans (a table's `\\|` read as `|`)."""
    prose: list[tuple[int, str]] = []
    block: list[tuple[int, str]] | None = None
    found: list[Found] = []
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            if block is None:
                block = []
            else:
                found += _code_lines(block)
                block = None
            prose.append((number, ""))  # a fence ends a paragraph
        elif block is not None:
            block.append((number, line))
        else:
            prose.append((number, line.replace("\\|", "|")))
    return sorted(found + [q for p in _paragraphs(prose) for q in _spans(p)])


def yaml_quotes(text: str) -> list[Found]:
    """Inline code spans of a recipe's text and comments (a span may wrap over `#` comment lines)."""
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        lines.append((number, line[1:] if line.startswith("#") else line))
    return [q for p in _paragraphs(lines) for q in _spans(p)]


def python_quotes(source: str) -> list[Found]:
    """From a module's string constants (docstrings, help texts, messages; not f-strings): inline code
    spans, and a docstring's example lines (indented under its text: `owai ...`, then two spaces and
    its description)."""
    tree = ast.parse(source)
    formatted = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    found: list[Found] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in formatted:
            continue
        lines = [(node.lineno + i, line.replace("\\[", "[")) for i, line in enumerate(node.value.split("\n"))]
        found += [q for p in _paragraphs(lines) for q in _spans(p)]
        examples = {n for n, line in lines[1:] if _RUNS_OWAI.match(_placeholders(line.strip()))}
        prose = [_indent(line) for n, line in lines[1:] if line.strip() and n not in examples]
        base = min(prose, default=0)  # an example is indented under the prose (a line of prose may start with owai)
        found += [(n, re.split(r"\s{2,}", _ARROW.sub("", line).strip())[0], True) for n, line in lines[1:]
                  if n in examples and _indent(line) > base]
    return sorted(found)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def quotes() -> list[Quote]:
    """Every quote that runs owai, in every documented place."""
    out: list[Quote] = []
    for files, extract in ((MARKDOWN, markdown_quotes), (YAML, yaml_quotes), (PYTHON, python_quotes)):
        for path in files:
            out += [Quote(path, *found) for found in extract((ROOT / path).read_text()) if _RUNS_OWAI.search(_placeholders(found[1]))]
    return out


# ---------------------------------------------------------------------------------------------------
# From a quote to the argument lists owai is given
# ---------------------------------------------------------------------------------------------------

_OPERATORS = {"|", "||", "&&", ";", "&", ";;"}
_WRAPPERS = {"time", "nohup", "env", "exec", "srun", "$"}
_ENV = re.compile(r"^[A-Za-z_]\w*=")
_REDIRECT = re.compile(r"^\d*(>>?|<)(&\d+)?")
_PLACEHOLDER = re.compile(r"^\$?\{?[A-Z][A-Z0-9_]*\}?$")  # RUN_DIR, MODEL_DIR, N, $OWAI_DATA
_ANY_COMMAND = "moons"  # `owai CMD ...`, `owai <command> ...`: a method command (each takes the run options)


def _notation(text: str) -> str:
    """Documentation notation as shell words: optional parts given, `[a | b]` and `a / b` as `a|b`,
    `<x>` as a placeholder."""
    text = re.sub(r"(?<!\S)\[([^\[\]]*?\s\|\s[^\[\]]*?)\](?!\S)", lambda m: re.sub(r"\s*\|\s*", "|", m.group(1)), text)
    text = re.sub(r"(?<!\S)\[(-[^\[\]]*|[A-Z][A-Z0-9_.]*(\.\.\.)?)\](?!\S)", r"\1", text)
    text = re.sub(r"(?<!\S)(\S+)((?:\s/\s\S+)+)", lambda m: "|".join([m.group(1), *m.group(2).split(" / ")[1:]]), text)
    return _placeholders(text)


def _placeholders(text: str) -> str:
    """`<x>` as a placeholder word, `<several words>` as one that may also stand for nothing (as `$VAR`),
    `<x>` in a word (`runs/<run>`) as x."""
    text = re.sub(r"(?<!\S)<[^<>\n]*\s[^<>\n]*>(?!\S)", "$PLACEHOLDER", text)
    text = re.sub(r"(?<!\S)<[^<>\s]+>(?!\S)", "PLACEHOLDER", text)
    return re.sub(r"<[^<>\n]*>", "x", text)


def _alternatives(text: str) -> list[str]:
    """`owai eval ruler|icl` -> ["owai eval ruler", "owai eval icl"]: a `|` with no space on either side,
    in a word with no quote, joins alternatives (a shell pipe has spaces)."""
    words = text.split(" ")
    choices = [w.split("|") if re.search(r"[^\s|]\|[^\s|]", w) and not re.search("['\"]", w) else [w] for w in words]
    return [" ".join(c[min(i, len(c) - 1)] for c in choices) for i in range(max(len(c) for c in choices))]


def _words(text: str) -> list[str]:
    """Shell words and operators (`|`, `&&`, `;`), up to a `# comment` or a `(remark)`."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars="|&;")
    lexer.whitespace_split = True
    lexer.commenters = ""
    words: list[str] = []
    while True:
        position = lexer.instream.tell()
        word = lexer.get_token()
        if word is None:
            return words
        raw = text[position:].lstrip()
        if raw.startswith(("#", "(")):
            return words  # the rest of the line is a remark, not read by the shell
        words.append(word)


def _owai_args(segment: list[str]) -> list[str] | None:
    """The arguments owai gets from one simple command, or None when it does not run owai."""
    i = 0
    while i < len(segment) and (_ENV.match(segment[i]) or segment[i] in _WRAPPERS):
        i += 1
    rest = segment[i:]
    if rest and rest[0] == "owai":
        return rest[1:]
    if rest and Path(rest[0]).name in ("torchrun", "python", "python3"):
        for j in range(1, len(rest) - 1):
            if rest[j] == "-m" and rest[j + 1] == "owai":
                return rest[j + 2:]
    return None


def command_lines(text: str) -> list[list[str]]:
    """The argument lists owai is given by a quote (one per command and alternative), placeholders
    still in place. Raises ValueError on a quote the shell could not read."""
    out = []
    for variant in _alternatives(_notation(text)):
        segment: list[str] = []
        for word in [*_words(variant), ";"]:
            if word in _OPERATORS:
                args = _owai_args(segment)
                if args is not None and args not in out:
                    out.append(args)
                segment = []
            else:
                segment.append(word)
    return out


def _cleaned(args: list[str]) -> tuple[list[str], list[int]]:
    """Redirections and `...` dropped, `MODELS...` read as MODELS; the indices of the placeholders."""
    out: list[str] = []
    holes: list[int] = []
    skip = False
    for word in args:
        if skip:
            skip = False
            continue
        m = _REDIRECT.match(word)
        if m:
            skip = m.end() == len(word) and not m.group(2)  # `> FILE`: the target is the next word
            continue
        if re.fullmatch(r"\.{3}|…", word):
            continue
        if len(word) > 3 and word.endswith("...") and not word.startswith("-"):
            word = word[:-3]
        if _PLACEHOLDER.match(word):
            holes.append(len(out))
        out.append(word)
    return out, holes


def _fillings(words: list[str], holes: list[int]) -> list[list[str]]:
    """The argument lists a command with placeholders stands for: each placeholder a name, or a
    number; `$VAR` also nothing (a shell variable may hold several options, or none)."""
    def filled(value: str, drop_variables: bool) -> list[str]:
        out = []
        for i, word in enumerate(words):
            if i not in holes:
                out.append(word)
            elif i == 0:
                out.append(_ANY_COMMAND)
            elif not (drop_variables and word.startswith("$")):
                out.append(value)
        return out

    return [filled("x", False), filled("1", False), filled("x", True)]


def _names_a_command(words: list[str]) -> bool:
    """Whether the words only name a command (`owai report`, `owai data list`): each one a subcommand."""
    cmd = owai_command()
    for word in words:
        commands = getattr(cmd, "commands", None)
        if not commands or word not in commands:
            return False
        cmd = commands[word]
    return True


def _parse_error(words: list[str]) -> Exception | None:
    """The CLI's refusal of `owai WORDS`, or None when it parses (`--help`, `--version`: exit 0)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            parse_owai(words)
    except Exception as e:  # noqa: BLE001 - a UsageError of Typer's own Click, or an exit
        return None if getattr(e, "exit_code", None) == 0 else e
    return None


def check(text: str, whole: bool = True) -> list[str]:
    """The problems of a quote's commands, one line each as owai would refuse them (empty: all parse).
    An inline span (not `whole`) may only name a command (`owai report`) or end with an option that it
    names (`owai sweep --resume`); a command line is parsed as it stands."""
    try:
        lines = command_lines(text)
    except ValueError as e:
        return [f"the shell cannot read it: {e}"]
    if not lines:
        return ["no owai command in it"]
    problems = []
    for args in lines:
        words, holes = _cleaned(args)
        if not whole and _names_a_command(words):
            continue
        tries = _fillings(words, holes)
        errors = [_parse_error(t) for t in tries]
        if not whole and all(errors) and all("requires an argument" in str(e) for e in errors):
            errors = [_parse_error([*t, "x"]) for t in tries]  # `owai sweep --resume`: the option, named
        if all(errors):
            error = errors[0]
            message = error.format_message() if hasattr(error, "format_message") else str(error)
            problems.append(f"owai {shlex.join(words)}: {type(error).__name__}: {' '.join(message.split())}")
    return problems


# ---------------------------------------------------------------------------------------------------
# Through the command: each command line that starts a run, up to where its run would begin
# ---------------------------------------------------------------------------------------------------

# What each kind of command line is taken through, past the parse:
# - a run (the method commands, `owai sweep`, `owai recipes run`, `owai eval ...`, `owai data stats`):
#   the command's own code with the documented arguments, up to where the run would begin. A new
#   run's config is resolved against its method's schema with the run's own refusal of a `--set` it
#   never reads (experiment._prepare's `resolve(..., refuse_unread=True)`), and stops at the first
#   write (`ensure_writable`); a sweep or study plans every point of its grid (sweep._design: the
#   base config and each point's config resolved, a base `--set` that no point reads refused) and
#   stops at the same place; rich-features without --stage plans its chain (`plan_chain`: every
#   pretrain sweep point, each evaluation step's settings), then each evaluation step is resolved as
#   its run would be; mosaic-train's --dry-run stops after its resolution, before the plan is built.
#   Never validated: no input is looked for (`resolve(..., validate=False)`: data, tokenizers, the
#   model to evaluate; plan_chain's own checks may look, and a missing input is then no failure), no
#   device is asked for (`runtime.device=cuda` is the documentation's, not this machine's), `--executor
#   slurm` finds `sbatch` and `srun` stand-ins on PATH (never called), nothing is written, run or downloaded.
#   So a value that only the method's `validate` checks (`--task`, `--ctx`, dropout-ft's `--dataset`,
#   harness task names) is not checked here: validate mixes the settings' checks with reading the
#   inputs (data, tokenizers, the models): minutes over the documented commands, not seconds;
# - a resumed run or sweep (`--resume DIR`) and `owai report DIR`: the command's own checks of its
#   options, up to where it opens the directory (a placeholder, which is not there);
# - `owai recipes show`: run as it is (it resolves the recipe, read only; nothing validated);
# - parsed only (PARSE_ONLY: they read data, checksum it or download it; or list every recipe), and a
#   quote that says too little to be taken further: one that stands for any command (`owai CMD ...`,
#   `owai <command> ...`) or any recipe (`owai sweep RECIPE`, `-r ID`, `-r TREE/recipes/x.yaml`), one
#   with a shell variable (`--set $x`), `--help`, `--version`, a bare group, an inline span that only
#   names a command or an option.
# Placeholders are filled as for the parse (a name, a number, or nothing), a `--set KEY=S` /
# `--set data.root=DIR` value too (`_VALUE_HOLE`); one filling that gets to its run is enough.
# An input not on this machine (CannotRunHere, DataMissing) is no failure; a refusal of the command
# (OwaiError: an unknown key or name, a bad value, options it does not combine) is.
PARSE_ONLY = {("data", "list"), ("data", "fetch"), ("data", "verify"), ("recipes", "list")}

# Quotes that parse but are refused once taken through the command, and stay as written:
# (file, the quote as read) -> why. Strict expected failures, as ALLOWED.
REFUSED: dict[tuple[str, str], str] = {
    ("docs/results.md", "owai dropout-ft --dropout 1.5"): "quoted as a bad value that owai refuses (the sweep planner's order)",
    ("docs/decisions.md", "owai dropout-ft --dropout 1.5"): "quoted as a bad value that owai refuses (the sweep planner's order)",
    ("docs/decisions.md", "owai moons --set train.lr=-1"): "quoted as a bad value that owai once trained with and now refuses",
}


class Reached(BaseException):
    """The command got to where its run begins, or to the run directory it opens. Not an Exception:
    no handler of the command's takes it for an error of its own."""


class WouldRun(BaseException):
    """Past every stop: the command would have run (a test failure, never tolerated)."""


def _command_path(words: list[str]) -> tuple[str, ...]:
    """The subcommand the words name: ("eval", "ruler"), ("moons",), () for the bare `owai`."""
    cmd, path = owai_command(), []
    for word in words:
        commands = getattr(cmd, "commands", None)
        if not commands or word not in commands:
            break
        cmd = commands[word]
        path.append(word)
    return tuple(path)


@contextlib.contextmanager
def stopped_where_runs_begin():
    """owai with each run stopped where it would begin (see the comment above PARSE_ONLY)."""
    import torch

    from owai import experiment, runs, runtime, sweep
    from owai.methods import language_model, rich_features
    from owai.recipes import load

    resolve, plan_chain = experiment.resolve, rich_features.plan_chain

    def unvalidated(recipe, preset, overrides, missing_ok=False, validate=True, refuse_unread=False):
        return resolve(recipe, preset, overrides, missing_ok=missing_ok, validate=False, refuse_unread=refuse_unread)

    def chain(recipe, preset, sets, seeds=None):
        steps = plan_chain(recipe, preset, sets, seeds)
        for step in steps:  # each evaluation step resolved as its run will be (plan_chain does not refuse unread keys)
            if step.stage != "pretrain":
                resolve(load(recipe), preset, step.sets, validate=False, refuse_unread=True)
        raise Reached(f"the chain of {len(steps)} step(s) of {recipe}")

    def stop(what):
        def stopped(*args, **kwargs):
            raise Reached(what)
        return stopped

    def would_run(what):
        def ran(*args, **kwargs):
            raise WouldRun(f"{what}: the command was not stopped before its run")
        return ran

    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as bin_dir:
        for tool in ("sbatch", "srun"):  # `--executor slurm` as on a cluster (never called: nothing is submitted)
            stand_in = Path(bin_dir) / tool
            stand_in.write_text("#!/bin/sh\nexit 1\n")
            stand_in.chmod(0o755)
        mp.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(experiment, "resolve", unvalidated)  # every resolution: the run's, a sweep's points', a chain's, show's
        mp.setattr(runtime, "select_device", lambda name: torch.device("cpu" if name == "auto" else name))  # not this machine's
        mp.setattr(experiment, "ensure_writable", stop("a new run"))  # _prepare: resolved, refuse_unread
        mp.setattr(sweep, "ensure_writable", stop("a new sweep"))  # sweep.create: every point planned
        mp.setattr(rich_features, "plan_chain", chain)
        mp.setattr(language_model, "dry_run_plan", stop("mosaic-train --dry-run's plan"))  # print_plan: resolved
        mp.setattr(runs.Run, "open", classmethod(stop("an existing run directory")))  # --resume RUN_DIR, report
        mp.setattr(sweep, "open_sweep", stop("an existing sweep directory"))
        for module, name in ((experiment, "_run_method"), (sweep, "run"), (sweep, "run_point"), (runs.Run, "create"),
                             (runs.Run, "create_at")):
            mp.setattr(module, name, would_run(name) if module is not runs.Run else classmethod(would_run(name)))
        yield


def _taken_through(words: list[str]) -> Exception | None:
    """The command body's refusal of `owai WORDS` (an OwaiError other than an input not on this
    machine, or any other error), or None when it gets to its run (or, `owai recipes show`, to its end)."""
    from owai import console
    from owai.errors import CannotRunHere

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            owai_command().main(args=list(words), prog_name="owai", standalone_mode=False)
    except (Reached, CannotRunHere):
        return None
    except Exception as e:  # noqa: BLE001 - an OwaiError of the command's, or an internal error
        return e
    finally:
        console.configure()
    return None


def taken_through(words: list[str]) -> str:
    """How far a command line (placeholders filled, parsed) goes here: "resolved" (to where its run
    begins), "opened" (to the run or sweep directory it opens), "shown" (`owai recipes show`, run)
    or "parsed" (see the comment above PARSE_ONLY)."""
    path = _command_path(words)
    group = bool(path) and hasattr(owai_command().commands[path[0]], "commands") and len(path) < 2
    if not path or group or path in PARSE_ONLY or any(w in ("--help", "--version") for w in words):
        return "parsed"
    if path == ("report",) or "--resume" in words[len(path):]:
        return "opened"
    return "shown" if path == ("recipes", "show") else "resolved"


# `--set KEY=S`, `--set data.root=DIR`: a value that is a placeholder (one capital letter, or a name
# ending in DIR, PATH or VALUE), filled as a placeholder word is
_VALUE_HOLE = re.compile(r"^([\w.]+=)\$?\{?([A-Z]|[A-Z][A-Z0-9_]*(DIR|PATH|VALUE))\}?$")
_FILLER = "\0"


def _unsaid(words: list[str], holes: list[int]) -> str | None:
    """Why a filled command line says too little to be taken through its command, or None: a shell
    variable (`--set $x`), a recipe that is a placeholder (`owai sweep RECIPE`, `-r ID`, `<lm recipe>`)
    or lies under one (`-r TREE/recipes/a.yaml`)."""
    if any("$" in w for w in words):
        return "a shell variable"
    _, params = parse_owai(words)  # it parses (`through`)
    for name in ("recipe", "recipe_option"):
        value = params.get(name)
        if isinstance(value, str) and (holes and value in ("x", "1") or re.match(r"[A-Z][A-Z0-9_]*/", value)):
            return "the recipe is a placeholder"
    return None


def through(text: str, whole: bool = True) -> list[tuple[str, list[list[str]], str]]:
    """Each command of a quote: (`owai WORDS` as quoted, its fillings that parse, how far it is taken:
    `taken_through`'s kind, or "parsed" for one that says too little: a span that names a command,
    `owai CMD ...`, a shell variable, a recipe placeholder). A command that does not parse is the
    parse test's: "parsed", with no fillings."""
    try:
        lines = command_lines(text)
    except ValueError:
        return []
    out = []
    for args in lines:
        words, holes = _cleaned(args)
        marked = [m.group(1) + _FILLER if (m := _VALUE_HOLE.match(w)) and i and words[i - 1] in ("--set", "-s", "--grid", "-g")
                  else w for i, w in enumerate(words)]
        filled = [[w.replace(_FILLER, value) for w in t] for t, value in zip(_fillings(marked, holes), ("x", "1", "x"))]
        tries = [t for i, t in enumerate(filled) if t not in filled[:i] and _parse_error(t) is None]
        kind = "parsed" if not whole and _names_a_command(words) or 0 in holes or not tries else taken_through(tries[0])
        if kind != "parsed" and _unsaid(tries[0], holes + [i for i, w in enumerate(marked) if w != words[i]]):
            kind = "parsed"
        out.append((f"owai {shlex.join(words)}", tries, kind))
    return out


def check_through(text: str, whole: bool = True) -> list[str]:
    """The problems of a quote's commands once taken through each command (empty: each gets as far as
    `through` says). A filled command line (of those that parse) that gets there is enough."""
    problems = []
    for command, tries, kind in through(text, whole):
        if kind == "parsed":
            continue
        errors: list[Exception | None] = []
        with stopped_where_runs_begin():
            for t in tries:
                errors.append(_taken_through(t))
                if errors[-1] is None:
                    break
        if all(errors):
            said = list(dict.fromkeys(f"{type(e).__name__}: {' '.join(str(e).split())}" for e in errors))
            problems.append(f"{command}: " + "; with the placeholders filled otherwise: ".join(said))
    return problems


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------

QUOTES = quotes()


def _param(q: Quote):
    reason = ALLOWED.get((q.path, q.text))
    return pytest.param(q, id=str(q), marks=[pytest.mark.xfail(strict=True, reason=reason)] if reason else [])


@pytest.mark.parametrize("quote", [_param(q) for q in QUOTES])
def test_documented_command_parses(quote: Quote) -> None:
    problems = check(quote.text, quote.whole)
    assert not problems, f"{quote.path}:{quote.line}: `{quote.text}` does not parse:\n  " + "\n  ".join(problems)


def _through_param(q: Quote):
    reason = REFUSED.get((q.path, q.text))
    return pytest.param(q, id=str(q), marks=[pytest.mark.xfail(strict=True, reason=reason)] if reason else [])


@pytest.mark.parametrize("quote", [_through_param(q) for q in QUOTES])
def test_documented_command_gets_to_its_run(quote: Quote) -> None:
    problems = check_through(quote.text, quote.whole)
    assert not problems, (f"{quote.path}:{quote.line}: `{quote.text}` parses, but the command refuses it:\n  "
                          + "\n  ".join(problems))


def test_every_place_quotes_commands() -> None:
    """The extractor finds each place's commands (one that found none would pass)."""
    found = Counter(q.path for q in QUOTES)
    assert all(found[p] >= 20 for p in MARKDOWN), found
    assert sum(found[p] for p in YAML) >= 50 and sum(found[p] for p in PYTHON) >= 60, found
    assert found["owai/commands/mosaic.py"] >= 10, found


def test_allowed_entries_are_quoted() -> None:
    """Each allow-list entry names a quote still in its file."""
    quoted = {(q.path, q.text) for q in QUOTES}
    assert [key for key in ALLOWED if key not in quoted] == []
    assert [key for key in REFUSED if key not in quoted] == []


def test_most_commands_are_taken_through() -> None:
    """The run commands are resolved, not just parsed (a rule that made them all "parsed" would pass)."""
    kinds = Counter(kind for q in QUOTES for _, _, kind in through(q.text, q.whole))
    assert kinds["resolved"] >= 250 and kinds["opened"] >= 30 and kinds["shown"] >= 3, kinds


@pytest.mark.parametrize("text, refusal", [
    ("owai mosaic-train --no-such-option", "NoSuchOption: No such option: --no-such-option"),
    ("owai no-such-command --json", "No such command 'no-such-command'"),
    ("owai mosaic-train --depth deep", "'--depth'"),
    ("owai data verify --data-root DIR", "Missing argument 'name'"),
    ("owai report", "Missing argument 'run_dir'"),  # a command line, not a span that names the command
    ("owai report --markdown", "Missing"),
    ("owai data verify NAME extra words", "unexpected extra argument"),  # `owai report` takes several run dirs
    ("OWAI_DATA=~/data owai moons --nope   # a comment", "No such option: --nope"),
    ("torchrun --nproc_per_node 8 -m owai mosaic-train --sizes large", "No such option: --sizes"),
    ("owai report RUN_DIR --json | jq . && owai moons --bad", "No such option: --bad"),
    ("owai eval ruler|nope", "No such command 'nope'"),
    ("owai sweep --no-such", "No such option: --no-such"),
    ("owai moons --set 'unclosed", "the shell cannot read it"),
    ("Library GPT / owai gpt (gelu)", "no owai command in it"),  # never a vacuous pass
])
def test_a_broken_command_is_reported(text: str, refusal: str) -> None:
    problems = check(text)
    assert len(problems) == 1 and refusal in problems[0], problems


@pytest.mark.parametrize("text", [
    "owai moons --preset paper # the thesis's own settings",
    "OWAI_DATA=~/data owai recipes run table4.4-recall",
    "torchrun --nproc_per_node 8 -m owai mosaic-train --size large --set train.global_batch=2048",
    "python -m owai report runs/three-moons/<run> --json | jq .rows > out.json",
    "owai report RUN_DIR",
    "owai mosaic-eval MODEL_DIR... --dataset wikipedia",
    "owai data stats [SOURCE]",
    "owai rich-features --stage pretrain ...",
    "owai eval ruler|icl|harness",
    "owai mosaic-train --size tiny|small|large",
    "owai moons [three-moons | linear] (the positional study is an alias of --recipe)",
    "owai eval ruler|icl --model x",
    "owai <command> [--preset P] [--set a.b=v] [--resume RUN]",
    "owai eval harness --model RUN_DIR [--tasks arc_easy,hellaswag,...] [--limit N]",
    "owai sweep three-moons --seeds 0,1 $EXTRA",
    "owai recipes run three-moons <the change below>",
    "owai --help",
    "owai moons --help",
    "owai eval",
])
def test_a_good_command_passes(text: str) -> None:
    assert check(text) == [] and check(text, whole=False) == []


@pytest.mark.parametrize("text, refusal", [
    ("owai moons --set train.stepz=3", "unknown key 'stepz' in train (did you mean 'steps'?)"),
    ("owai moons three-moons --set seed=S --set train.lr=fast", "params.train.lr: expected float, got str 'fast'"),
    ("owai rich-features --stage probe --n N --set probe.lrr=1", "unknown key 'lrr' in probe"),
    ("owai moons -p nope", "recipe 'three-moons' has no preset 'nope'"),
    ("owai recipes run three-moons --set train.stepz=3", "unknown key 'stepz'"),
    ("owai mosaic-train --size huge", "--size must be one of"),
    ("owai mosaic-train --arch gpt --set model.pmem_size=2", "a setting of mm; this run trains gpt"),  # never read
    ("owai mosaic-train --size large --arch transformer --dry-run --set model.n_layerz=2", "unknown key 'n_layerz'"),
    ("owai bonsai --init nope", "params.init: expected one of"),
    ("owai bonsai --set penalty.anneal_iters=10", "a setting of the ERM phase of --init erm"),
    ("owai bonsai --study --method irm --seeds 0,1 --set bonsai.roundz=2", "unknown key 'roundz' in bonsai"),
    ("owai sweep three-moons --grid train.lrr=1e-2,1e-3", "--grid train.lrr: unknown key 'lrr'"),
    ("owai dropout-ft --dropout 1.5", "params.model.dropout must be in [0, 1)"),  # a grid point's value
    ("owai rich-features -r tableA.8-fewshot --set probe.nn=2", "unknown key 'nn' in probe"),  # the chain
    ("owai eval ruler --model RUN_DIR --set ctxx=[4k]", "unknown key 'ctxx'"),
    ("owai mosaic-eval MODEL_DIR --set eval.sourc=x", "unknown key 'sourc'"),
    ("owai data stats --set data.max_documentz=3", "unknown key 'max_documentz'"),
    ("owai recipes show three-moons --set train.stepz=3", "unknown key 'stepz'"),
    ("owai moons --resume RUN_DIR -p paper", "drop --preset"),  # an option the resume refuses, before RUN_DIR is opened
    ("owai sweep three-moons --resume SWEEP_DIR", "drop RECIPE"),
    ("owai report RUN_DIR --markdown --json", "two output formats"),
])
def test_a_refused_command_is_reported(text: str, refusal: str) -> None:
    assert check(text) == []  # it parses
    problems = check_through(text)
    assert len(problems) == 1 and refusal in problems[0], problems


@pytest.mark.parametrize("text, kind", [
    ("owai moons --set train.steps=3", "resolved"),
    ("owai moons --set runtime.device=cuda", "resolved"),  # the documentation's device, not this machine's
    ("owai moons --set seed=S", "resolved"),  # a value placeholder
    ("owai sweep three-moons --executor slurm --partition gpu --gpus-per-node 1", "resolved"),  # as on a cluster
    ("owai bonsai --study --method irm,vrex --init rand,erm --seeds 0,1", "resolved"),
    ("owai rich-features -r tableA.8-fewshot", "resolved"),  # its chain, from an empty cache
    ("owai rich-features --stage probe --networks SWEEP_DIR", "resolved"),
    ("owai mosaic-train --size large --arch transformer --dry-run", "resolved"),
    ("owai mosaic-eval runs/fig3.8-depth/<run> --dataset wikipedia", "resolved"),  # no model needed to resolve
    ("owai eval ruler --ctx 32k --model RUN_DIR", "resolved"),
    ("owai eval harness --model hflm:mistralai/Mistral-7B-v0.1 --tasks arc_easy,hellaswag", "resolved"),
    ("owai bonsai --dataset camelyon17 --study -p paper --data-root ~/data", "resolved"),  # data not there: fine
    ("owai bonsai --resume runs/table2.4-coloredmnist/sweep-...", "opened"),
    ("owai rich-features --stage probe --resume RUN_DIR", "opened"),
    ("owai report RUN_DIR --json", "opened"),
    ("owai recipes show three-moons -p paper", "shown"),
    ("owai sweep RECIPE --seeds 0,1", "parsed"),  # which recipe is not said
    ("owai recipes show <lm recipe> -p paper", "parsed"),
    ("owai rich-features -r TREE/recipes/tableA.8-fewshot.yaml", "parsed"),
    ("owai moons --set $x", "parsed"),  # a shell variable (a loop's)
    ("owai CMD --set a.b=1", "parsed"),
    ("owai data fetch mnist", "parsed"),  # never downloads
    ("owai data verify mnist", "parsed"),
    ("owai recipes list --runs runs/", "parsed"),
    ("owai eval", "parsed"),
    ("owai moons --help", "parsed"),
])
def test_a_command_that_gets_to_its_run_passes(text: str, kind: str) -> None:
    assert [k for _, _, k in through(text)] == [kind]
    assert check_through(text) == []


def test_nothing_runs_past_the_stops(tmp_path: Path) -> None:
    """The stops come before anything is written; had a run got past them, it would fail loudly."""
    from owai import experiment, sweep

    with stopped_where_runs_begin():
        with pytest.raises(Reached):
            experiment.execute("three-moons", None, [], tmp_path)
        with pytest.raises(Reached):
            sweep.create("three-moons", seeds=[0, 1], out=tmp_path)
        with pytest.raises(WouldRun):
            sweep.run(None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text", ["owai report", "owai data list / fetch / verify", "owai sweep --resume", "owai data fetch"])
def test_a_span_may_name_a_command_or_an_option(text: str) -> None:
    assert check(text, whole=False) == [] and check(text) != []


def test_extraction_reads_fences_continuations_spans_and_examples() -> None:
    text = "\n".join([
        "Run `owai moons --preset\npaper` first, not `pip install owai` or \\`owai nope\\`.",
        "",
        "| `owai mosaic-train --size tiny\\|large` | x |",
        "```bash",
        "owai sweep three-moons \\",
        "    --seeds 0,1   # two seeds",
        "echo owai moons",
        "owai report RUN_DIR [--markdown]          owai/report.py",
        "owai moons ─► methods/moons.py",
        "```",
    ])
    found = [q for q in markdown_quotes(text) if _RUNS_OWAI.search(q[1])]
    assert found == [(1, "owai moons --preset paper", False), (4, "owai mosaic-train --size tiny|large", False),
                     (6, "owai sweep three-moons --seeds 0,1", True), (9, "owai report RUN_DIR [--markdown]", True),
                     (10, "owai moons", True)]
    assert command_lines("owai sweep three-moons --seeds 0,1 # two seeds") == [["sweep", "three-moons", "--seeds", "0,1"]]
    assert command_lines("echo owai moons") == []
    source = ('def f():\n    """Text `owai report RUN_DIR`.\n\n'
              '        owai moons -p paper    the thesis\'s scale\n'
              '    The prose, which wraps where\n    owai bonsai happens to start a line.\n    """\n')
    assert python_quotes(source) == [(2, "owai report RUN_DIR", False), (4, "owai moons -p paper", True)]
    module = '"""`owai sweep`: grids.\n\n    owai sweep three-moons --seeds 1,2\n"""\n'
    assert python_quotes(module) == [(1, "owai sweep", False), (3, "owai sweep three-moons --seeds 1,2", True)]
    yaml = "description: >-\n  the networks (`owai rich-features --stage\n  pretrain`)\nx: 1  # `owai data fetch\n  # mnist`\n"
    assert yaml_quotes(yaml) == [(2, "owai rich-features --stage pretrain", False), (4, "owai data fetch mnist", False)]
