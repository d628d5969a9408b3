"""`owai data`: the datasets owai reads, where it finds them, and how to get them.

    owai data list                       every dataset: found or not, where, size, how to get it
    owai data fetch mnist                download the official MNIST files into the cache, md5-verified
    owai data fetch mnist --data-root ~/data      ... into ~/data/mnist instead
    owai data verify mnist               check a local copy against its checksums
    owai data verify banking77           ... sha256 of fixed files (banking77, goemotions, sotu, gpt2, the essays)
    owai data fetch gpt2                 GPT-2's tokenizer files from OpenAI, sha256-verified

Lookup rule (every data-reading command, `--data-root` on each): an explicit `--data-root DIR`
(DIR/<dataset>, or the dataset's own folder), else $OWAI_DATA/<dataset>, else the cache
<$OWAI_CACHE or ~/.cache/owai>/data/<dataset>. Commands that only generate data (`owai moons`,
`owai eval regbench`) take no data flag.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from owai import console
from owai.commands._common import DataRoot, Json, Quiet

data_app = typer.Typer(help="Datasets and tokenizers: list where they are found, fetch them (verified), verify local copies.",
                       no_args_is_help=True)

Name = Annotated[str, typer.Argument(help="Dataset name (see `owai data list`).", show_default=False)]


@data_app.command("list")
def data_list(data_root: DataRoot = None, quiet: Quiet = False, as_json: Json = False) -> None:
    """Every dataset and tokenizer owai reads: found or not, verified, where it looks, its size, how to get it."""
    from rich.table import Table

    from owai.data.registry import status

    console.configure(quiet, as_json)
    rows = status(data_root)
    if as_json:
        console.emit_json(rows)
        return
    table = Table(title="owai datasets")
    for col in ("name", "found", "verified", "where", "size", "how to get it"):
        table.add_column(col)
    for row in rows:
        found = "[green]yes[/green]" if row["found"] == "yes" else "[red]no[/red]"
        verified = {"yes": "[green]yes[/green]", "FAILED": "[red]FAILED[/red]"}.get(row["verified"], row["verified"])
        name = row["name"] + (" (tokenizer)" if row["kind"] == "tokenizer" else "")
        table.add_row(name, found, verified, row["where"], row["size"], row["get"] + (f"; {row['note']}" if row["note"] else ""))
    console.stdout.print(console.fit_table(table, whole=(0,)))


@data_app.command("fetch")
def data_fetch(
    name: Name,
    data_root: DataRoot = None,
    mirror: Annotated[Optional[str], typer.Option(
        "--mirror", help="MNIST, CIFAR, gpt2: base URL(s) of the official files, comma-separated (MNIST default: "
                         "$OWAI_MNIST_MIRROR, else the well-known mirrors; CIFAR: the official page; gpt2: OpenAI's); "
                         "every file or archive is checked against its published md5 (gpt2: its sha256).")] = None,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Download a dataset from its canonical source into the cache (or --data-root), verified."""
    from owai.data.registry import fetch, verify

    console.configure(quiet, as_json)
    folder = fetch(name, data_root, mirror, info=console.info)
    checked = verify(name, folder)
    if as_json:
        console.emit_json({"name": name, "path": str(folder), "verified": checked})
    elif not quiet:
        console.stdout.print(f"{name}: {folder} (verified: {len(checked)} check(s))", markup=False)


@data_app.command("verify")
def data_verify(name: Name, data_root: DataRoot = None, quiet: Quiet = False, as_json: Json = False) -> None:
    """Check the local copy the lookup rule finds against its checksums (or its layout)."""
    from owai.data.registry import require, verify

    console.configure(quiet, as_json)
    folder = require(name, data_root)
    checked = verify(name, folder)
    if as_json:
        console.emit_json({"name": name, "path": str(folder), "verified": checked})
        return
    console.stdout.print(f"{name}: {folder}", markup=False)
    for line in checked:
        console.stdout.print(f"  {line}", markup=False)


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
