"""Measured-vs-thesis tables for a run's results.json (Rich and Markdown)."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return str(value)


def _thesis(row: dict[str, Any]) -> str:
    value, claim = row.get("thesis"), row.get("thesis_claim") or ""
    if value is None:
        return claim or "-"
    return f"{fmt(value)} ({claim})" if claim else fmt(value)


def table(results: dict[str, Any]) -> Table:
    title = f"{results['recipe']}: {results.get('reproduces', '')} [{results.get('preset', '')}]"
    t = Table(title=escape(title))
    t.add_column("metric", style="bold")
    t.add_column("measured", justify="right")
    t.add_column("thesis")
    t.add_column("ref")
    for row in results["rows"]:
        t.add_row(row["metric"], fmt(row["measured"]), _thesis(row), row.get("ref") or "")
    return t


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"### {results['recipe']}: {results.get('reproduces', '')}",
        "",
        f"Command: `{results.get('command', '')}`  ",
        f"Run: `{results.get('run_dir', '')}`",
        "",
        "| metric | measured | thesis | ref |",
        "|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(f"| {row['metric']} | {fmt(row['measured'])} | {_thesis(row)} | {row.get('ref') or ''} |")
    return "\n".join(lines) + "\n"
