"""`pairclean query`."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Iterable, Optional

import pyarrow as pa
import typer
from rich.table import Table
from rich.text import Text

import pairclean.cli.options as options
from pairclean.cli.app import app, console
from pairclean.cli.terminal import print_table
from pairclean.curate.query import OUTPUT_FORMATS, write_result
from pairclean.config import at_least, check_value
from pairclean.errors import UserError
from pairclean.ops.guard import open_output
from pairclean.scorefile.contract import column_meanings
from pairclean.config import parse_attachments
from pairclean.scorefile.db import ScoresDB, check_attach_name

MAX_SQL_BYTES = 2**20  # a statement read with --file (/dev/zero would never end)


def _cell(value) -> str | Text:
    if value is None:
        return Text("NULL", style="dim")
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        return f"{value:.4f}" if 1e-4 <= abs(value) < 1e6 or value == 0 else f"{value:.4g}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, bytes):
        return f"<{len(value):,} bytes>"
    text = str(value)
    return text if len(text) <= 120 else text[:117] + "..."


def rich_result(batches: Iterable[pa.RecordBatch], schema: pa.Schema, limit: int) -> tuple[Table, str]:
    """The first `limit` rows as a rich table and a line saying how many rows there were.

    Rows past the limit are counted, not kept."""
    table = Table(show_lines=False, header_style="bold")
    for f in schema:
        numeric = pa.types.is_integer(f.type) or pa.types.is_floating(f.type) or pa.types.is_decimal(f.type)
        table.add_column(f.name, justify="right" if numeric else "left")
    shown = total = 0
    for batch in batches:
        total += batch.num_rows
        if shown < limit:
            for row in batch.slice(0, limit - shown).to_pylist():
                table.add_row(*(_cell(v) for v in row.values()))
                shown += 1
    if total == shown:
        return table, f"{total:,} rows"
    return table, f"first {shown:,} of {total:,} rows (raise --limit, or --format csv|json|parquet for all)"


def columns_table(db: ScoresDB, views: list[str]) -> Table:
    """The columns of each view with their DuckDB types and, for the scores file's, what they mean."""
    meanings = column_meanings(db.provenance, list(db.columns("scores")))
    table = Table(title=f"columns of {db.path.name}", header_style="bold")
    for name in ("view", "column", "type", "meaning"):
        table.add_column(name)
    for view in views:
        for column, kind in db.columns(view).items():
            table.add_row(view, column, kind, meanings.get(column, ""))
    return table


@app.command("query")
def query_command(
    scores: Path = typer.Argument(..., help="Scores Parquet written by `pairclean score`."),
    sql: Optional[str] = typer.Argument(None, help="One SQL statement over the views `scores` (and `truth`, `labeled`, "
                                                   "the --attach tables)."),
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="Read the SQL from this file instead."),
    truth: Optional[Path] = typer.Option(None, help="Ground-truth Parquet (key, shard, index, noisy): adds views `truth` "
                                                    "and `labeled` (default: the truth file of the dataset the scores "
                                                    "recorded, e.g. one `pairclean corrupt` wrote, when it is there)."),
    fmt: str = typer.Option("table", "--format", help="table, csv, json (JSON Lines) or parquet."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write csv/json/parquet here (atomically) instead of stdout."),
    limit: int = typer.Option(50, help="Rows shown by --format table (the rest are counted)."),
    columns: bool = typer.Option(False, "--columns", help="List the columns of the views (what --where, "
                                                          "--filter and SQL can use) with their types and meaning."),
    attach: options.Attach = None,
    overwrite: bool = typer.Option(False, help="Replace an existing output file."),
) -> None:
    """Run SQL through DuckDB over the scores: `pairclean query scores.parquet "SELECT ..."`."""
    from pairclean.scorefile.contract import recorded_inputs
    from pairclean.scorefile.evaluation import recorded_truth

    if truth is None and (recorded := recorded_truth(scores, required=False)) is not None and recorded.is_file():
        truth = recorded  # a recorded truth file that is gone leaves the query without the truth views
    if columns:
        if sql is not None or file is not None:
            raise UserError("--columns lists the columns: give no SQL with it")
        with ScoresDB(scores, truth=truth) as db:
            print_table(console, columns_table(db, ["scores", *(["truth", "labeled"] if truth else [])]))
        return
    if (sql is None) == (file is None):
        raise UserError("give the SQL as an argument or with --file, not both")
    tables = parse_attachments(attach, check_name=check_attach_name)
    target = open_output(out, [*recorded_inputs(scores), truth, file, *(f for files in tables.values() for f in files)],
                         overwrite=overwrite) if out is not None else None  # before anything is read
    if file is not None:
        if not file.exists() or file.is_dir():
            raise UserError(f"SQL file not found: {file}")
        with open(file, "rb") as fh:
            text = fh.read(MAX_SQL_BYTES + 1)
        if len(text) > MAX_SQL_BYTES:
            raise UserError(f"{file} is over {MAX_SQL_BYTES:,} bytes: not one SQL statement")
        sql = text.decode("utf-8", errors="replace")
    check_value(limit, int, at_least(0), "limit")
    if fmt not in OUTPUT_FORMATS:
        raise UserError(f"unknown format {fmt!r}; choose one of {', '.join(OUTPUT_FORMATS)}")
    if fmt == "table" and out is not None:
        raise UserError("--out needs --format csv, json or parquet")
    with ScoresDB(scores, truth=truth, attach=tables) as db:
        try:
            result = db.run(sql)
        except UserError as exc:
            if truth is None and re.search(r"Table with name (labeled|truth) does not exist", str(exc)):
                raise UserError(f"{exc}: the views truth and labeled need --truth FILE ({scores} records no "
                                "truth file)") from None
            raise
        schema, batches = db.stream(result)
        if fmt == "table":
            table, note = rich_result(batches, schema, limit)
            print_table(console, table)
            console.print(note, style="dim", highlight=False)
        else:
            rows = write_result(batches, schema, fmt, target)
            if target is not None:  # stdout carries no data then: say what was written
                console.print(f"{rows:,} rows ({fmt}) written to {target.path}", soft_wrap=True)
