"""Scores through DuckDB: the views that `pairclean query`, `filter` and `report` share.

A `ScoresDB` is an in-memory DuckDB connection holding views over the Parquet files, never a
copy of them: `scores` (the scores file, optionally restricted to some shards), `truth` and
`labeled` (scores + the ground-truth `noisy` column) when a truth file is given. Results come
back as Arrow record batches, so printing or exporting a result is bounded by a batch.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import IO, Iterable, Iterator

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from rich.table import Table

from pairclean.ops.atomic import atomic_path
from pairclean.errors import UserError

SCORE_COLUMNS = ("key", "shard", "index")
OUTPUT_FORMATS = ("table", "csv", "json", "parquet")


def sql_string(value: str) -> str:
    """A SQL string literal (paths go into view definitions, which take no parameters)."""
    return "'" + str(value).replace("'", "''") + "'"


def sql_identifier(name: str) -> str:
    """A quoted SQL identifier (column names recorded in a file's metadata go into queries)."""
    return '"' + str(name).replace('"', '""') + '"'


def sandboxed_connection(temp_dir: str | Path, files: Iterable[str | Path] = (),
                         directories: Iterable[str | Path] = (), database: str = ":memory:") -> duckdb.DuckDBPyConnection:
    """A DuckDB connection that can read only `files` and `directories` (the ones pairclean opened
    itself): user SQL cannot read host files, write files, attach databases, install or autoload
    extensions, or change these settings back. Arrow tables registered from Python still work."""
    con = duckdb.connect(database, config={"autoinstall_known_extensions": False,
                                           "autoload_known_extensions": False})
    con.execute(f"SET temp_directory = {sql_string(temp_dir)}")
    con.execute("SET allowed_paths = ?", [[os.path.realpath(f) for f in files] + [str(f) for f in files]])
    con.execute("SET allowed_directories = ?", [[os.path.join(os.path.realpath(d), "") for d in directories]])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def compile_predicate(db: "ScoresDB", predicate: str, option: str, view: str = "scores") -> str:
    """The one way a user's predicate enters SQL: parsed by DuckDB as exactly one expression,
    re-rendered from the parse tree (so nothing around it can be closed or appended), and bound
    over the view's columns as a BOOLEAN. Returns the parenthesised SQL."""
    try:
        expression = f"({duckdb.SQLExpression(predicate)})"
    except duckdb.Error as exc:
        raise UserError(f"bad {option} predicate {predicate!r}: give one boolean SQL expression "
                        f"({duckdb_message(exc)})") from None
    try:
        names, types = db.describe(f"SELECT {expression} AS keep FROM {view}")
    except duckdb.Error as exc:
        raise UserError(f"bad {option} predicate {predicate!r}: {duckdb_message(exc)}") from None
    if len(names) != 1:
        raise UserError(f"bad {option} predicate {predicate!r}: give one boolean SQL expression")
    if str(types[0]) != "BOOLEAN":
        raise UserError(f"bad {option} predicate {predicate!r}: it is {types[0]}, not BOOLEAN")
    return expression


READ_ONLY_STATEMENTS = ("SELECT", "EXPLAIN")


def duckdb_message(exc: BaseException) -> str:
    """DuckDB's error as one line: its first line plus the candidate-bindings hint, no caret art."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    keep = [ln for ln in lines if not ln.startswith("LINE ") and set(ln) != {"^"}]
    if not keep:
        return type(exc).__name__
    return keep[0] + "".join(f" ({ln})" for ln in keep[1:] if ln.startswith("Candidate"))


class ScoresDB:
    """An in-memory DuckDB session over a scores file (and an optional truth file).

    `scores_file` is always the whole file; `scores` is too unless `restrict` narrows it.
    """

    def __init__(self, scores: str | Path, truth: str | Path | None = None, truth_key: str | None = None):
        self.path = Path(scores)
        if not self.path.is_file():
            raise UserError(f"scores file not found: {self.path}")
        # Sorts and joins larger than memory spill here, not into a `.tmp` in the working directory.
        self._tmp = tempfile.mkdtemp(prefix="pairclean-duckdb-")
        self.con = sandboxed_connection(self._tmp, [self.path] + ([Path(truth)] if truth is not None else []))
        try:
            self.con.execute(f"CREATE VIEW scores_file AS SELECT * FROM read_parquet({sql_string(self.path)})")
        except duckdb.Error as exc:
            self.close()
            raise UserError(f"cannot read {self.path} as Parquet: {duckdb_message(exc)}") from None
        missing = [c for c in SCORE_COLUMNS if c not in self.columns("scores_file")]
        if missing:
            self.close()
            raise UserError(f"{self.path} is not a pairclean scores file (no column {', '.join(missing)})")
        self.con.execute("CREATE VIEW scores AS SELECT * FROM scores_file")
        self.truth_join: str | None = None
        if truth is not None:
            try:
                self._attach_truth(Path(truth), truth_key)
            except UserError:
                self.close()
                raise

    def restrict(self, shards: list[str]) -> None:
        """Narrow `scores` to these scored shard names: filter works on the dataset it is given,
        which may be part of what was scored."""
        self.con.register("selected_shards_arrow", pa.table({"shard": pa.array(shards, pa.string())}))
        self.con.execute("CREATE OR REPLACE TEMP TABLE selected_shards AS SELECT * FROM selected_shards_arrow")
        self.con.unregister("selected_shards_arrow")
        self.con.execute("CREATE OR REPLACE VIEW scores AS SELECT * FROM scores_file "
                         "WHERE shard IN (SELECT shard FROM selected_shards)")

    def __enter__(self) -> "ScoresDB":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.con.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def columns(self, view: str = "scores") -> dict[str, str]:
        """Column name -> DuckDB type of a view."""
        return {name: str(kind) for name, kind in zip(*self.describe(f"SELECT * FROM {view}"))}

    def describe(self, sql: str) -> tuple[list[str], list]:
        rel = self.con.sql(sql)
        return rel.columns, rel.types

    def _attach_truth(self, truth: Path, key: str | None = None) -> None:
        """Views `truth` and `labeled`; join on (shard, index) when the truth file has them, else on key
        (the truth's column `key`, or the one named)."""
        if not truth.is_file():
            raise UserError(f"truth file not found: {truth}")
        try:
            self.con.execute(f"CREATE VIEW truth AS SELECT * FROM read_parquet({sql_string(truth)})")
        except duckdb.Error as exc:
            raise UserError(f"cannot read truth file {truth}: {duckdb_message(exc)}") from None
        cols = self.columns("truth")
        if "noisy" not in cols:
            raise UserError(f"truth file {truth} has no 'noisy' column (has {', '.join(cols)})")
        if key is not None:
            if key not in cols:
                raise UserError(f"truth file {truth} has no key column {key!r} (has {', '.join(cols)})")
            candidates = [(f"key = {key}", f"s.key = t.{sql_identifier(key)}", sql_identifier(key))]
        elif {"shard", "index"} <= set(cols):
            candidates = [("shard, index", "s.shard = t.shard AND s.\"index\" = t.\"index\"", "shard, \"index\""),
                          ("shard file name, index",
                           "parse_filename(s.shard) = parse_filename(t.shard) AND s.\"index\" = t.\"index\"",
                           "parse_filename(shard), \"index\"")]
        elif "key" in cols:
            candidates = [("key", "s.key = t.key", "key")]
        else:
            raise UserError(f"truth file {truth} needs columns shard and index, or key")
        for label, condition, ident in candidates:
            dupes = self.scalar(f"SELECT count(*) - count(DISTINCT ({ident})) FROM truth")
            if dupes:
                raise UserError(f"truth file {truth} has {dupes} repeated ({label}) rows: cannot join it")
            matched = self.scalar(f"SELECT count(*) FROM scores s JOIN truth t ON {condition}")
            if matched:
                self.truth_join = label
                self.con.execute(f"CREATE VIEW labeled AS SELECT s.*, t.noisy::BOOLEAN AS noisy "
                                 f"FROM scores s LEFT JOIN truth t ON {condition}")
                return
        raise UserError(f"truth file {truth} matches no scored pair (joined on {candidates[-1][0]})")

    def scalar(self, sql: str, params: list | None = None):
        return self.con.execute(sql, params or []).fetchall()[0][0]

    def run(self, sql: str, params: list | None = None) -> duckdb.DuckDBPyRelation:
        """One user statement -> a relation; any DuckDB error becomes a one-line UserError."""
        try:
            statements = self.con.extract_statements(sql)
        except duckdb.Error as exc:
            raise UserError(f"query failed: {duckdb_message(exc)}") from None
        if len(statements) != 1:
            raise UserError(f"give one SQL statement (got {len(statements)})")
        kind = statements[0].type.name
        if kind not in READ_ONLY_STATEMENTS:
            raise UserError(f"query is read-only: {kind} statements are refused (give a SELECT; "
                            "write results with --format and --out)")
        try:
            rel = self.con.sql(sql, params=params)
        except duckdb.Error as exc:
            raise UserError(f"query failed: {duckdb_message(exc)}") from None
        if rel is None:
            raise UserError("the statement returned no rows to show (use a SELECT)")
        return rel

    def stream(self, rel: duckdb.DuckDBPyRelation,
               batch_rows: int = 65536) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
        """The result's schema and its record batches; errors met while running become UserError."""
        try:
            reader = rel.to_arrow_reader(batch_rows)
        except duckdb.Error as exc:
            raise UserError(f"query failed: {duckdb_message(exc)}") from None

        def batches() -> Iterator[pa.RecordBatch]:
            try:
                yield from reader
            except (duckdb.Error, pa.ArrowInvalid) as exc:
                raise UserError(f"query failed: {duckdb_message(exc)}") from None

        return reader.schema, batches()

    def scored_shards(self, view: str = "scores_file") -> list[str]:
        return [r[0] for r in self.con.sql(f"SELECT DISTINCT shard FROM {view} ORDER BY shard").fetchall()]


def match_shards(given: list[str], scored: list[str]) -> dict[str, str | None]:
    """Map each given shard path to the name it has in the scores file.

    Exact string first, then the same real path, then the same file name when that name is
    unique on both sides (the dataset was moved after scoring). None: not scored.
    """
    scored_set = set(scored)
    by_real = {os.path.realpath(s): s for s in scored if "://" not in s}
    by_name: dict[str, list[str]] = {}
    for s in scored:
        by_name.setdefault(os.path.basename(s), []).append(s)
    given_names: dict[str, int] = {}
    for g in given:
        given_names[os.path.basename(g)] = given_names.get(os.path.basename(g), 0) + 1
    out: dict[str, str | None] = {}
    for g in given:
        if g in scored_set:
            out[g] = g
        elif "://" not in g and os.path.realpath(g) in by_real:
            out[g] = by_real[os.path.realpath(g)]
        elif len(by_name.get(os.path.basename(g), [])) == 1 and given_names[os.path.basename(g)] == 1:
            out[g] = by_name[os.path.basename(g)][0]
        else:
            out[g] = None
    return out


def _cell(value) -> str:
    if value is None:
        return "[dim]NULL[/dim]"
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
        table.add_column(f.name, justify="right" if numeric else "left", overflow="fold")
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


def _json_value(value, float32: bool):
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        # A float32 printed through float64 shows noise digits: keep the shortest float32 form.
        return float(str(np.float32(value))) if float32 else value
    if isinstance(value, bytes):
        return value.hex()
    return value


def write_result(batches: Iterable[pa.RecordBatch], schema: pa.Schema, fmt: str, out: Path | None,
                 stdout: IO[bytes] | None = None) -> int:
    """Stream a result as CSV, JSON Lines or Parquet to `out` (atomically) or stdout; returns rows."""
    if fmt not in OUTPUT_FORMATS[1:]:
        raise UserError(f"unknown format {fmt!r}; choose one of {', '.join(OUTPUT_FORMATS)}")
    stdout = stdout if stdout is not None else sys.stdout.buffer
    if fmt == "parquet" and out is None and stdout.isatty():
        raise UserError("refusing to write Parquet to a terminal: pass --out FILE or redirect stdout")

    def emit(sink) -> int:
        rows = 0
        if fmt == "csv":
            with pacsv.CSVWriter(sink, schema) as writer:
                for batch in batches:
                    writer.write_batch(batch)
                    rows += batch.num_rows
        elif fmt == "json":
            single = {f.name for f in schema if f.type == pa.float32()}
            for batch in batches:
                for row in batch.to_pylist():
                    line = {k: _json_value(v, k in single) for k, v in row.items()}
                    sink.write(json.dumps(line, default=str).encode() + b"\n")
                rows += batch.num_rows
        else:
            with pq.ParquetWriter(sink, schema, compression="zstd") as writer:
                for batch in batches:
                    writer.write_batch(batch)
                    rows += batch.num_rows
        return rows

    if out is None:
        rows = emit(stdout)
        stdout.flush()
        return rows
    with atomic_path(out) as tmp, open(tmp, "wb") as fh:
        return emit(fh)
