"""`owai data`: the datasets owai reads, where it finds them, and how to get them.

    owai data list                       every dataset: found or not, where, size, how to get it
    owai data fetch mnist                download the official MNIST files into the cache, md5-verified
    owai data fetch mnist --data-root ~/data      ... into ~/data/mnist instead
    owai data verify mnist               check a local copy against its checksums
    owai data verify banking77           ... sha256 of fixed files (banking77, goemotions, sotu, gpt2, the essays)
    owai data fetch gpt2                 GPT-2's tokenizer files from OpenAI, sha256-verified
    owai data stats                      Table B.1's statistics of a corpus and Figure 4.4's lengths (a run)
    owai data stats babistories          ... of BabiStories, beside the thesis's numbers

Lookup rule (every data-reading command, `--data-root` on each): an explicit `--data-root DIR`
(DIR/<dataset>, or the dataset's own folder), else $OWAI_DATA/<dataset>, else the cache
<$OWAI_CACHE or ~/.cache/owai>/data/<dataset>. Commands that only generate data (`owai moons`,
`owai eval regbench`) take no data flag.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from rich.markup import escape

from owai import console
from owai.commands._common import DataRoot, Json, Quiet, RunOptions, csv_values, data_root_sets, options, set_str, study_recipe

data_app = typer.Typer(help="Datasets and tokenizers: list where they are found, fetch them (verified), verify local copies; stats: a corpus's Table B.1 statistics and Figure 4.4's lengths.",
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
        verified = {"yes": "[green]yes[/green]", "FAILED": "[red]FAILED[/red]"}.get(row["verified"], escape(row["verified"]))
        name = row["name"] + (" (tokenizer)" if row["kind"] == "tokenizer" else "")
        how = row["get"] + (f"; {row['note']}" if row["note"] else "")
        table.add_row(escape(name), found, verified, escape(row["where"]), escape(row["size"]), escape(how))  # paths: not markup
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
    if mirror is not None:
        _check_mirrors(mirror)
    folder = fetch(name, data_root, mirror, info=console.info)
    checked = verify(name, folder)
    if as_json:
        console.emit_json({"name": name, "path": str(folder), "verified": checked})
    elif not quiet:
        console.stdout.print(f"{name}: {folder} (verified: {len(checked)} check(s))", markup=False)


def _check_mirrors(text: str) -> None:
    """--mirror must be base URLs (http, https, ftp or file), checked before fetch makes any folder:
    a bare word would otherwise fail only as a download, after the data root's folders exist."""
    from urllib.parse import urlparse

    from owai.errors import OwaiError

    urls = [u.strip() for u in text.split(",") if u.strip()]
    bad = [u for u in urls if urlparse(u).scheme not in ("http", "https", "ftp", "file")
           or not (urlparse(u).netloc or urlparse(u).scheme == "file")]
    if not urls or bad:
        raise OwaiError(f"--mirror {bad[0] if bad else text!r}: not a URL; give base URLs such as "
                        "https://host/path/ or file:///dir/, comma-separated")


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


STATS_RECIPE = "tableB.1-babistories"
STATS_METHODS = ("corpus_stats",)


@options
def data_stats(
    source: Annotated[Optional[str], typer.Argument(
        help="The corpus: babistories, tinystories, text/sotu.tar.gz, a local file or folder, a hub id "
             "(default: the recipe's; the cpu preset measures owai's embedded stories).", show_default=False)] = None,
    tokenizer: Annotated[Optional[str], typer.Option(
        "--tokenizer", "-t", help="Tokenizer whose tokens are counted (default tokenizers/gpt2: Table B.1 counts GPT-2 "
                                  "tokens; `owai data fetch gpt2` gets it).", show_default=False)] = None,
    truncate: Annotated[Optional[str], typer.Option(
        "--truncate", help="Training contexts at which Figure 4.4 cuts the lengths, comma-separated (e.g. 4096,32768).",
        show_default=False)] = None,
    max_documents: Annotated[Optional[int], typer.Option(
        "--max-documents", min=1, help="Read only the first N documents of each split (a streamed hub corpus).",
        show_default=False)] = None,
    recipe: Annotated[Optional[str], typer.Option("--recipe", "-r", help=f"A corpus_stats recipe id or file (default {STATS_RECIPE}).")] = None,
    data_root: DataRoot = None,
    opts: RunOptions = RunOptions(),
) -> None:
    """Table B.1's statistics of a corpus (documents, GPT-2 tokens, characters per document) and
    Figure 4.4's length distributions, as a run beside the thesis's numbers."""
    from owai.errors import OwaiError

    if opts.resume is not None:
        if any(v is not None for v in (source, tokenizer, truncate, max_documents, recipe, data_root)):
            raise OwaiError("--resume takes its config from the run directory; drop the other options")
        opts.run(None, opts.sets, methods=STATS_METHODS)
        return
    chosen = recipe or STATS_RECIPE
    study_recipe(chosen, STATS_METHODS)
    sets = data_root_sets(data_root, chosen)
    if source is not None:
        sets.append(set_str("data.source", source))  # quoted: a path stays the path given
    if tokenizer is not None:
        sets.append(set_str("data.tokenizer", tokenizer))
    if truncate is not None:
        contexts = csv_values(truncate, "--truncate")
        if not all(c.isdigit() and int(c) > 0 for c in contexts):
            raise OwaiError(f"--truncate {truncate!r}: give positive whole numbers of tokens, comma-separated")
        sets.append(f"truncate=[{','.join(contexts)}]")
    if max_documents is not None:
        sets.append(f"data.max_documents={max_documents}")
    opts.run(chosen, [*sets, *(opts.sets or [])])


data_app.command("stats")(data_stats)


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
