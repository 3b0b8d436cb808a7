"""The read side of a scores file: DuckDB over it, opened once per command.

A `ScoresDB` is a sandboxed in-memory DuckDB connection holding views over the Parquet files,
never a copy of them: `scores_file` (the whole scores file), `scores` (the same, or the shards a
command was given), `truth` and `labeled` (scores + the ground-truth `noisy` column) when a truth
file is given, and the tables a user attached (`attach`: NAME -> Parquet files, or a key list read
by `data.keys`), read-only and the only other files the sandbox lets SQL read. It also carries the
file's provenance and summary (`scores.contract`), read once, so a command opens the file once and
passes this object, not the path. Results come back as Arrow record batches, so printing or
exporting a result is bounded by a batch.

Rows are matched to a dataset by (shard, index); scores whose rows are not the dataset's
(scores from precomputed embeddings) are matched by key instead (`join_keys`), refused when a key
repeats on either side.

Here too: the one way a user's predicate enters SQL (`compile_predicate`), the SQL quoting
helpers, and the matching of given shard paths to the names the file holds (`match_shards`).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Mapping

import duckdb
import pyarrow as pa

from pairclean.errors import ConfigError, UserError
from pairclean.ops.places import readable
from pairclean.ops.records import Keyed
from pairclean.scorefile.contract import Provenance, Summary, read_metadata
from pairclean.scorefile.sql import duckdb_message, sandboxed_connection, sql_identifier, sql_string

SCORE_COLUMNS = ("key", "shard", "index")
NUMERIC_TYPES = ("FLOAT", "DOUBLE", "TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT",
                 "USMALLINT", "UINTEGER", "UBIGINT", "DECIMAL")  # DuckDB type names a column may start with


def compile_predicate(db: "ScoresDB", predicate: str, field: str, view: str = "scores") -> str:
    """The one way a user's predicate enters SQL: parsed by DuckDB as exactly one expression,
    re-rendered from the parse tree (so nothing around it can be closed or appended), and bound
    over the view's columns as a BOOLEAN. Returns the parenthesised SQL; errors name `field`, the
    setting that holds the predicate."""
    def bad(reason: str) -> ConfigError:
        return ConfigError(f"bad `{field}` predicate {predicate!r}: {reason}", field)

    try:
        expression = f"({duckdb.SQLExpression(predicate)})"
    except duckdb.Error as exc:
        raise bad(f"give one boolean SQL expression ({duckdb_message(exc)})") from None
    try:
        names, types = db.describe(f"SELECT {expression} AS keep FROM {view}")
    except duckdb.Error as exc:
        raise bad(duckdb_message(exc)) from None
    if len(names) != 1:
        raise bad("give one boolean SQL expression")
    if str(types[0]) != "BOOLEAN":
        raise bad(f"it is {types[0]}, not BOOLEAN")
    _warn_if_abstaining(db, predicate, expression, field, view)
    return expression


def _warn_if_abstaining(db: "ScoresDB", predicate: str, expression: str, field: str, view: str) -> None:
    """A predicate over a column of a rule that abstained on this file decides nothing: say so.
    Whether the predicate uses the column is asked of DuckDB itself (it binds the predicate over
    the view without that column), not guessed from the text."""
    from pairclean.ops.notices import notice
    from pairclean.scorefile.rules import recorded_rules

    rules = recorded_rules(db.provenance, db.columns(view))
    deciding = ", ".join(r.decision for r in rules if not r.abstains) or "none"
    for rule in rules:
        for column in rule.value_columns if rule.abstains else ():
            try:
                db.describe(f"SELECT {expression} FROM (SELECT * EXCLUDE ({sql_identifier(column)}) FROM {view})")
                continue  # it binds without the column: the predicate does not use it
            except duckdb.Error:
                pass
            notice(f"`{field}` {predicate!r} uses {column}, a column of the {rule.label} rule, which abstains on "
                   f"{db.path.name} ({rule.abstains}): {column} decides nothing here (NULL for every pair; in "
                   f"files scored before, a number that only looks usable). Decide with the decision column of "
                   f"a rule that decides (here: {deciding})", field)


READ_ONLY_STATEMENTS = ("SELECT", "EXPLAIN")
VIEWS = ("scores_file", "scores", "scores_keyed", "truth", "labeled", "dataset_keys", "selected_shards", "keep_keys")
TABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_attach_name(name: str, field: str = "attach") -> str:
    """A table name a user may attach: a plain SQL identifier, not one of the views pairclean makes."""
    if not TABLE_NAME.fullmatch(name) or name.lower() in VIEWS:
        raise ConfigError(f"`{field}` name {name!r} must be a plain identifier (letters, digits, _) and not one of "
                          f"{', '.join(VIEWS)}", field)
    return name


def resolve_truth(truth: str | Path) -> Path:
    """The truth Parquet a truth argument names: the file itself, the `truth:` entry of a dataset
    manifest, or that of the manifest in a directory (`pairclean corrupt` writes DIR/manifest.yaml)."""
    from pairclean.data.manifest import load_manifest
    from pairclean.data.spec import MANIFEST_NAME

    truth = Path(truth)
    if truth.is_dir():
        if not (truth / MANIFEST_NAME).is_file():
            raise UserError(f"{truth} is a directory without a {MANIFEST_NAME} naming a truth file: give the truth "
                            "Parquet")
        truth = truth / MANIFEST_NAME
    if truth.suffix in (".yaml", ".yml"):
        spec = load_manifest(truth)
        if not spec.truth:
            raise UserError(f"manifest {truth} names no truth file")
        return Path(spec.truth)
    return truth


class ScoresDB:
    """A scores file opened once: a DuckDB session over it (and an optional truth file), its
    provenance and its summary.

    `scores_file` is always the whole file; `scores` is too unless `restrict` narrows it.
    """

    def __init__(self, scores: str | Path, truth: str | Path | None = None, truth_key: str | None = None,
                 attach: Mapping[str, list[str]] | None = None):
        truth = resolve_truth(truth) if truth is not None else None
        attach = dict(attach or {})
        for name in attach:
            check_attach_name(name)
        tables = {name: files for name, files in attach.items() if all(f.endswith(".parquet") for f in files)}
        # Sorts and joins larger than memory spill here, not into a `.tmp` in the working directory.
        self._tmp = tempfile.mkdtemp(prefix="pairclean-duckdb-")
        try:  # a scores file on an object store is read from its local mirror (DuckDB reads local files)
            self.path = readable(scores)
        except UserError:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        if not self.path.is_file():
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise UserError(f"scores file not found: {self.path}")
        allowed = [self.path] + ([Path(truth)] if truth is not None else []) + [Path(f) for fs in tables.values() for f in fs]
        self.con = sandboxed_connection(self._tmp, allowed)
        self.base = "scores_file"  # what `scores` selects from: the file, or its rows joined by key to a dataset
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
        self._metadata: tuple[Provenance | None, Summary | None] | None = None
        self.truth_join: str | None = None
        self.truth_path: Path | None = Path(truth) if truth is not None else None  # the truth Parquet resolved
        try:
            for name, files in attach.items():
                self._attach(name, files, name in tables)
            if truth is not None:
                self._attach_truth(truth, truth_key)
        except UserError:
            self.close()
            raise

    def _attach(self, name: str, files: list[str], parquet: bool) -> None:
        """A read-only table NAME: a view over the Parquet files (readable because they are listed
        in the sandbox's allowed paths, and nothing else is), or a key list read by pairclean."""
        missing = [f for f in files if not os.path.isfile(f)]
        if missing or not files:
            raise UserError(f"attached table {name}: file not found: {missing[0] if missing else '(none given)'}")
        if parquet:
            listed = "[" + ", ".join(sql_string(f) for f in files) + "]"
            try:
                self.con.execute(f"CREATE VIEW {sql_identifier(name)} AS SELECT * FROM read_parquet({listed}, "
                                 "union_by_name = true)")
                self.con.execute(f"SELECT * FROM {sql_identifier(name)} LIMIT 0")
            except duckdb.Error as exc:
                raise UserError(f"cannot read attached table {name} ({files[0]}): {duckdb_message(exc)}") from None
            return
        if len(files) != 1:
            raise UserError(f"attached table {name}: give one key list (.txt, .npy) or Parquet files")
        from pairclean.data.keys import read_keys

        self.register(name, pa.table({"key": read_keys(files[0])}))

    def register(self, name: str, table: pa.Table) -> None:
        """A table pairclean built (a key list) as a read-only temp table NAME."""
        self.con.register(f"{name}_arrow", table)
        self.con.execute(f"CREATE OR REPLACE TEMP TABLE {sql_identifier(name)} AS SELECT * FROM {name}_arrow")
        self.con.unregister(f"{name}_arrow")

    def check_unique_keys(self, view: str = "scores_file", label: str | None = None) -> None:
        """Refuse a key that repeats in `view`: rows matched by key must be one row each."""
        dup = self.con.execute(f"SELECT key, count(*) AS n FROM {view} GROUP BY key HAVING n > 1 "
                               "ORDER BY n DESC, key LIMIT 1").fetchone()
        if dup:
            raise UserError(f"key {dup[0]!r} is {dup[1]} rows of {label or self.path}: rows are matched by key here "
                            "(the scores were not made from these shards), and keys must then be unique")

    def join_keys(self, dataset_keys) -> tuple[int, int]:
        """Meet a dataset whose rows are not the scores' rows by key: `dataset_keys` (an Arrow table
        or dataset of the dataset's shard, index, key) is joined on `key`, and `scores` then holds
        the joined rows with the dataset's (shard, index). Refused when a key repeats on either side.
        Returns (scores rows joined, scores rows whose key is not in the dataset)."""
        self.con.register("dataset_keys", dataset_keys)
        for view, label in (("scores_file", str(self.path)), ("dataset_keys", "the dataset")):
            self.check_unique_keys(view, label)
        self.con.execute('CREATE OR REPLACE VIEW scores_keyed AS SELECT s.* REPLACE (d.shard AS shard, '
                         'd."index" AS "index") FROM scores_file s JOIN dataset_keys d ON s.key = d.key')
        self.con.execute("CREATE OR REPLACE VIEW scores AS SELECT * FROM scores_keyed")
        self.base = "scores_keyed"
        joined = self.scalar("SELECT count(*) FROM scores_keyed")
        return joined, self.scalar("SELECT count(*) FROM scores_file") - joined

    def _read_metadata(self) -> tuple[Provenance | None, Summary | None]:
        if self._metadata is None:
            self._metadata = read_metadata(self.path)
        return self._metadata

    @property
    def provenance(self) -> Provenance | None:
        """How the scores were made (None: the file was not written by `pairclean score`)."""
        return self._read_metadata()[0]

    @property
    def summary(self) -> Summary | None:
        """The run summary (None: the file was not written by `pairclean score`)."""
        return self._read_metadata()[1]

    def restrict(self, shards: list[str]) -> None:
        """Narrow `scores` to these scored shard names: filter works on the dataset it is given,
        which may be part of what was scored."""
        self.register("selected_shards", pa.table({"shard": pa.array(shards, pa.string())}))
        self.con.execute(f"CREATE OR REPLACE VIEW scores AS SELECT * FROM {self.base} "
                         "WHERE shard IN (SELECT shard FROM selected_shards)")

    def __enter__(self) -> "ScoresDB":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.con.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def columns(self, view: str = "scores") -> Keyed[str, str]:
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
                # a blind audit's marks: the stratum, the key marked (a pair is its key, not only its place)
                # and the second look's mark
                stratum = "".join(f", t.{sql_identifier(c)} AS {name}" for c, name in (
                    ("stratum", "audit_stratum"), ("key", "audit_key"), ("noisy_again", "audit_again"))
                    if "stratum" in cols and c in cols)
                self.con.execute(f"CREATE VIEW labeled AS SELECT s.*, t.noisy::BOOLEAN AS noisy{stratum} "
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
            raise ConfigError(f"query is read-only: {kind} statements are refused (give a SELECT; "
                              "write results with `format` and `out`)", "format", "out")
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

    def scored_shards(self, view: str | None = None) -> list[str]:
        view = view or self.base
        return [r[0] for r in self.con.sql(f"SELECT DISTINCT shard FROM {view} ORDER BY shard").fetchall()]


def match_shards(given: list[str], scored: list[str]) -> Keyed[str, str | None]:
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
