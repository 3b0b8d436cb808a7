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

from pairclean.cli.app import app, console
from pairclean.errors import UserError
from pairclean.ops.guard import open_output

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
    title = "pairclean filter --dry-run (nothing written)" if result.dry_run else f"pairclean filter -> {result.out}"
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
    table.add_row("[dim]scored pairs of the given shards[/dim]", f"{result.total_pairs:,}", "",
                  *([_size(result.total_bytes), ""] if result.dry_run else []))
    if not result.dry_run:
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


@app.command("filter")
def filter_command(
    source: List[str] = typer.Argument(..., help="The scored shards: directory, glob, brace pattern, list file, Parquet files, or a manifest YAML."),
    scores: Path = typer.Option(..., "--scores", "-s", help="Scores Parquet written by `pairclean score` for these shards."),
    where: Optional[List[str]] = typer.Option(None, "--where", "-w", help="Keep pairs where this DuckDB SQL expression over the scores columns is true (repeatable: all must hold)."),
    top_fraction: Optional[float] = typer.Option(None, help="Keep this fraction of the scored pairs with the highest --by (DataComp-style)."),
    by: str = typer.Option("sim", help="Score column ranked by --top-fraction."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Directory for the filtered dataset (with manifest.yaml and filter.json)."),
    dry_run: bool = typer.Option(False, help="Print how many pairs and bytes each rule keeps; write nothing."),
    shard_size: int = typer.Option(10_000, help="WebDataset output: samples per shard at most."),
    shard_bytes: float = typer.Option(1e9, help="WebDataset output: bytes per shard at most."),
    prefix: str = typer.Option("shard", help="Output file names: PREFIX-000000.tar / .parquet."),
    pair: Optional[str] = typer.Option(None, help="Pair kind written into the new manifest (default: the one the scores were made with)."),
    overwrite: bool = typer.Option(False, help="Replace a non-empty --out directory."),
) -> None:
    """Write the pairs the rules keep as new shards (members byte-identical), or preview with --dry-run."""
    if out is None and not dry_run:
        raise UserError("give --out DIR (or --dry-run)")
    if out is not None and not dry_run:  # the directories named; filter_dataset checks the files it reads
        out = open_output(out, [*source, scores], "out", kind="directory", overwrite=overwrite)
    from pairclean.curate.filter import filter_dataset
    from pairclean.data.manifest import open_dataset
    from pairclean.scores.db import ScoresDB

    with ScoresDB(scores) as db:  # opened once: its provenance names the pair kind, filter_dataset reads it
        spec = open_dataset(source, pair=pair or (db.provenance or {}).get("pair"))
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("shards"),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task("dry run" if dry_run else "filtering", total=len(spec.shards))
            result = filter_dataset(spec, db, out or Path("."), where=where, top_fraction=top_fraction, by=by,
                                    dry_run=dry_run, shard_size=shard_size, shard_bytes=shard_bytes, prefix=prefix,
                                    overwrite=overwrite, progress=lambda _shard: bar.advance(task))
    console.print(result_table(result))
    if result.sweep is not None:
        console.print(sweep_table(result.sweep))
    if result.read_failures:
        console.print(f"[yellow]{len(result.read_failures)} shard read failure(s)[/yellow], first: "
                      f"{result.read_failures[0]['shard']}: {result.read_failures[0]['reason']}", highlight=False)
