"""The documentation's own links lead somewhere: every relative link in the README and docs/ names a
file of the repository, and every `#anchor` a heading of the page it points into, as GitHub renders
them. The indexes of docs/results.md and docs/decisions.md link to their sections by heading, and a
heading edited later would otherwise leave a dead link behind, silently."""
from __future__ import annotations

import functools
import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")  # a closing run of # after a space is not the text
INLINE_CODE = re.compile(r"(`+).*?\1")
LINK = re.compile(r"\]\(([^()\s]+)\)")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of a Markdown page outside its fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, every character but letters, digits, `_`, `-` and
    spaces dropped (backticks, dots, apostrophes, `§`), spaces made hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(page: Path) -> frozenset[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: Counter[str] = Counter()
    found = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            found.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return frozenset(found)


def dead_links(page: Path, root: Path = ROOT) -> list[str]:
    """'page:line: target' (the page named from `root`) for each relative link of `page` whose file or
    anchor does not exist."""
    dead = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto: ...: not the repository's
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                dead.append(f"{page.relative_to(root)}:{number}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                dead.append(f"{page.relative_to(root)}:{number}: {target} (no such heading)")
    return dead


def test_github_anchors_of_headings() -> None:
    assert slug("Table 2.2 from an empty cache in one command (issue #40), `cpu` preset") == \
        "table-22-from-an-empty-cache-in-one-command-issue-40-cpu-preset"
    assert slug("Camelyon17-WILDS and 2-/3-Bonsai (thesis §2.3.4, Fig. 2.9)") == \
        "camelyon17-wilds-and-2-3-bonsai-thesis-234-fig-29"
    assert slug("The run's device: `owai/claims.py`") == "the-runs-device-owaiclaimspy"


def test_a_dead_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n## Same\n## Same\n")
    page = tmp_path / "page.md"
    page.write_text("# Top\n[a](#top) [b](other.md#same-1) [c](https://example.org/#x) `[d](#nowhere)`\n"
                    "```\n[e](#fenced)\n```\n[f](#nowhere) [g](missing.md) [h](other.md#same-2)\n")
    assert dead_links(page, tmp_path) == ["page.md:6: #nowhere (no such heading)", "page.md:6: missing.md (no such file)",
                    "page.md:6: other.md#same-2 (no such heading)"]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_link_of_the_documentation_leads_somewhere(page: Path) -> None:
    assert page.is_file()
    assert not dead_links(page), "\n".join(dead_links(page))


def test_the_decisions_index_lists_every_section_once() -> None:
    """docs/decisions.md's index by subject ("Where to find a decision") links each section once."""
    page = ROOT / "docs" / "decisions.md"
    text = page.read_text(encoding="utf-8")
    index, _, body = text.partition("\n## Foundation\n")
    sections = {slug(m.group(2)) for _, line in prose_lines("## Foundation\n" + body)
                if (m := HEADING.match(line)) and m.group(1) == "##"}
    linked = re.findall(r"\]\(#([^)]+)\)", index)
    assert len(linked) == len(set(linked)), "a section listed twice"
    assert sections == set(linked), (sorted(sections - set(linked)), sorted(set(linked) - sections))
