"""`pairclean query`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pairclean.cli.app import app, console
from pairclean.curate.query import OUTPUT_FORMATS, ScoresDB, rich_result, write_result
from pairclean.errors import UserError
from pairclean.ops.guard import check_output


@app.command("query")
def query_command(
    scores: Path = typer.Argument(..., help="Scores Parquet written by `pairclean score`."),
    sql: Optional[str] = typer.Argument(None, help="One SQL statement over the views `scores` (and `truth`, `labeled`)."),
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="Read the SQL from this file instead."),
    truth: Optional[Path] = typer.Option(None, help="Ground-truth Parquet (key, shard, index, noisy): adds views `truth` and `labeled`."),
    fmt: str = typer.Option("table", "--format", help="table, csv, json (JSON Lines) or parquet."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write csv/json/parquet here (atomically) instead of stdout."),
    limit: int = typer.Option(50, help="Rows shown by --format table (the rest are counted)."),
) -> None:
    """Run SQL through DuckDB over the scores: `pairclean query scores.parquet "SELECT ..."`."""
    if (sql is None) == (file is None):
        raise UserError("give the SQL as an argument or with --file, not both")
    if file is not None:
        if not file.is_file():
            raise UserError(f"SQL file not found: {file}")
        sql = file.read_text()
    if limit < 0:
        raise UserError(f"--limit must be at least 0, got {limit}")
    if fmt not in OUTPUT_FORMATS:
        raise UserError(f"unknown format {fmt!r}; choose one of {', '.join(OUTPUT_FORMATS)}")
    if fmt == "table" and out is not None:
        raise UserError("--out needs --format csv, json or parquet")
    if out is not None:
        check_output(out, [scores, truth])
    with ScoresDB(scores, truth=truth) as db:
        schema, batches = db.stream(db.run(sql))
        if fmt == "table":
            table, note = rich_result(batches, schema, limit)
            console.print(table)
            console.print(note, style="dim", highlight=False)
        else:
            write_result(batches, schema, fmt, out)
