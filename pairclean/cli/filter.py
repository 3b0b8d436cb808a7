"""`pairclean filter`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

import pairclean.cli.options as options
from pairclean.cli.app import announce, app, console
from pairclean.cli.terminal import literal, print_table
from pairclean.errors import UserError
from pairclean.ops.guard import open_output
from pairclean.ops.places import readable
from pairclean.scorefile.contract import columns_phrase

if TYPE_CHECKING:
    from pairclean.curate.filter import FilterResult
    from pairclean.curate.sweep import Sweep


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    exponent = min(int(math.log10(n) // 3), 4) if n >= 1000 else 0
    return f"{n:,} B" if exponent == 0 else f"{n / 1000 ** exponent:,.1f} {('kB', 'MB', 'GB', 'TB')[exponent - 1]}"


def _share(part: int | None, whole: int | None) -> str:
    return f"{part / whole:.1%}" if part is not None and whole else "-"


def result_table(result: FilterResult) -> Table:
    """Pairs (and, on a dry run, bytes) each rule keeps; a pair is kept when all rules keep it."""
    title = "pairclean filter --dry-run (nothing written)" if result.dry_run else f"pairclean filter -> {result.out or 'keys'}"
    table = Table(title=title, header_style="bold")
    table.add_column("rule")
    table.add_column("pairs kept", justify="right")
    table.add_column("share", justify="right")
    if result.dry_run:
        table.add_column("bytes kept" + (" (est.)" if result.bytes_estimated else ""), justify="right")
        table.add_column("share", justify="right")
    for c in result.counts:
        bytes_cells = [_size(c.bytes), _share(c.bytes, result.total_bytes)] if result.dry_run else []
        table.add_row(c.rule, f"{c.pairs:,}", _share(c.pairs, result.total_pairs), *bytes_cells)
    table.add_row(Text("scored pairs of the given shards", style="dim"), f"{result.total_pairs:,}", "",
                  *([_size(result.total_bytes), ""] if result.dry_run else []))
    if not result.dry_run and result.out is not None:
        table.caption = (f"wrote {result.kept_pairs:,} pairs, {_size(result.kept_bytes)}, "
                         f"in {len(result.output_files)} file(s)")
    return table


def sweep_table(sweep: Sweep) -> Table:
    """The threshold sweep (`curate.sweep`): kept share and estimated precision / recall per threshold."""
    table = Table(title="thresholds, estimated from the run's random pairings (pairs like random pairings: "
                        f"{sweep.random_pairing_share:.1%})", header_style="bold")
    table.add_column("--where", no_wrap=True)
    for name in ("random\npairings\nabove", "kept", "est.\nprecision", "est. clean\nkept", "est. noise\ncaught"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in sweep.rows:
        table.add_row(f"sim > {r.threshold:.4f}", _share(r.null_above, 1), _share(r.kept, 1),
                      _share(r.precision, 1), _share(r.clean_kept, 1), _share(r.noise_caught, 1))
    table.caption = "noise as dissimilar as a random pairing; a caption of a similar item counts as clean here"
    return table


WHERE_HELP = (f"Keep pairs where this DuckDB SQL expression over the scores columns is true (repeatable: all must "
              f"hold). Columns: {columns_phrase()}. `pairclean query SCORES --columns` lists a file's.")


def scores_and_shards(source: list[str], scores: str | None) -> tuple[str, list[str] | None]:
    """(the scores file, the shards given or None): `filter scores.parquet` alone reads the
    dataset the scores recorded; `filter SHARDS --scores scores.parquet` reads SHARDS."""
    from pairclean.scorefile.contract import is_scores_file

    if scores is not None:
        return scores, source or None
    if len(source) == 1 and is_scores_file(source[0]):
        return source[0], None
    if len(source) == 1 and not any(c in source[0] for c in "*?[{:") and not Path(source[0]).exists():
        raise UserError(f"{'scores file' if source[0].endswith('.parquet') else 'file or directory'} not found: "
                        f"{source[0]}")
    raise UserError("give the scores file alone (pairclean filter scores.parquet --out kept/), or the shards "
                    "with --scores scores.parquet")


@app.command("filter")
@options.dataset_options
def filter_command(
    ctx: typer.Context,
    source: List[str] = typer.Argument(..., metavar="SOURCE", help="A scores file (its dataset is read from it), or the "
                                       "shards to filter (directory, glob, list file, Parquet files, manifest) with --scores."),
    scores: Optional[str] = typer.Option(None, "--scores", "-s", metavar="PATH", help="Scores Parquet written by "
                                         "`pairclean score`, when SOURCE is the shards (a path or an object-store URL)."),
    where: Optional[List[str]] = typer.Option(None, "--where", "-w", metavar="SQL", help=WHERE_HELP),
    top_fraction: Optional[float] = typer.Option(None, help="Keep this fraction of the scored pairs with the highest --by (DataComp-style)."),
    by: str = typer.Option("sim", help="Score column ranked by --top-fraction."),
    keep_keys: Optional[Path] = typer.Option(None, help="Keep only pairs whose key is listed in this file: text (one key per "
                                             "line), Parquet (key or uid column), or DataComp's uid .npy."),
    keys_out: Optional[Path] = typer.Option(None, help="Also write the kept pairs' keys here: .npy (DataComp's uid "
                                            "array, for their resharder), .parquet or text."),
    attach: options.Attach = None,
    out: Optional[str] = typer.Option(None, "--out", "-o", metavar="DIR", help="Directory (or object-store URL) for the "
                                      "filtered dataset (with manifest.yaml and filter.json)."),
    dry_run: bool = typer.Option(False, help="Print how many pairs and bytes each rule keeps; write nothing."),
    shard_size: int = typer.Option(10_000, help="WebDataset output: samples per shard at most."),
    shard_bytes: float = typer.Option(1e9, help="WebDataset output: bytes per shard at most."),
    prefix: str = typer.Option("shard", help="Output file names: PREFIX-000000.tar / .parquet; '' names them like "
                                             "the input (00000.tar, Parquet files keep their names)."),
    overwrite: bool = typer.Option(False, help="Replace a non-empty --out directory."),
    allow_other_dataset: options.AllowOtherDataset = False,
) -> None:
    """Write the pairs the rules keep as new shards in the input's shape (members byte-identical), or preview with --dry-run."""
    dataset = options.dataset_given(ctx)
    if out is None and not dry_run and keys_out is None:
        raise UserError("give --out DIR (or --keys-out FILE, or --dry-run)")
    from pairclean.curate.filter import attachments, filter_dataset
    from pairclean.scorefile.contract import read_metadata, scored_pairs
    from pairclean.config import parse_attachments
    from pairclean.scorefile.db import ScoresDB, check_attach_name

    scores, shards = scores_and_shards(source, scores)
    if out is not None and not dry_run:  # the names given; filter_dataset checks the files it reads
        out = open_output(out, [*source, scores], "out", kind="directory", overwrite=overwrite)
    scores = readable(scores)  # a scores file on an object store: its local mirror
    if not scores.is_file():
        raise UserError(f"scores file not found: {scores}")
    provenance = read_metadata(scores)[0]
    recorded_pair = provenance.pair if provenance else None
    data = dataset.reopen(scored_pairs(provenance), shards, pair=dataset.pair or recorded_pair)
    if data is None and out is not None and not dry_run:
        raise UserError(f"{scores} does not say which shards it describes (scored from embeddings without a link to "
                        "their pairs): give the shards, pairclean filter SHARDS --scores SCORES")
    if data is not None:
        announce(data)
    tables = parse_attachments(attach, check_name=check_attach_name)
    with ScoresDB(scores, attach=attachments(data, tables)) as db:
        with Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TextColumn("shards", markup=False),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task("dry run" if dry_run else "filtering", total=len(data.spec.shards) if data else 0)
            result = filter_dataset(data, db, out, where=where, top_fraction=top_fraction, by=by,
                                    dry_run=dry_run, shard_size=shard_size, shard_bytes=shard_bytes, prefix=prefix,
                                    overwrite=overwrite, progress=lambda _shard: bar.advance(task),
                                    keep_keys=str(keep_keys) if keep_keys else None, keys_out=keys_out,
                                    attach=tables, allow_other_dataset=allow_other_dataset)
    print_table(console, result_table(result))
    if result.join == "key":
        console.print(f"matched by key: {result.unmatched:,} scored row(s) have no pair in the given shards")
    if result.keys_written is not None:
        console.print(f"wrote {result.keys_written:,} keys to {keys_out}")
    if result.sweep is not None:
        print_table(console, sweep_table(result.sweep))
    if result.read_failures:
        console.print(Text.assemble((f"{len(result.read_failures)} shard read failure(s)", "yellow"), ", first: ",
                                    literal(f"{result.read_failures[0]['shard']}: {result.read_failures[0]['reason']}")))
