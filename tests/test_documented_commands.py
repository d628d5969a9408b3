"""Every `owai ...` command line the documents quote parses with the CLI's own parser.

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
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
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


@pytest.mark.parametrize("text, refusal", [
    ("owai mosaic-train --no-such-option", "NoSuchOption: No such option: --no-such-option"),
    ("owai no-such-command --json", "No such command 'no-such-command'"),
    ("owai mosaic-train --depth deep", "'--depth'"),
    ("owai recipes show --preset cpu", "Missing"),
    ("owai report", "Missing argument 'run_dir'"),  # a command line, not a span that names the command
    ("owai report --markdown", "Missing"),
    ("owai report RUN_DIR extra words", "unexpected extra argument"),
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
    "torchrun --nproc_per_node 8 -m owai mosaic-train --size large --set train.accumulate=32",
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


@pytest.mark.parametrize("text", ["owai report", "owai recipes list / show / run", "owai sweep --resume", "owai data fetch"])
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
