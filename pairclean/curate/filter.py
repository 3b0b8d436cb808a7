"""Filter a dataset by its scores: new WebDataset shards, or Parquet files, holding the kept pairs.

Each rule is a predicate: a boolean SQL expression over the `scores` view that DuckDB evaluates
(`where`), or the top fraction by a score column (`scores.rules.TopFractionRule`, DataComp style);
a pair is kept when every predicate keeps it (NULL counts as no). All rules are run over every row before anything is written, so a bad
predicate fails with DuckDB's message and leaves nothing behind. The kept set is then fetched
one shard (or Parquet row group) at a time and joined with a stream of the shard's samples:
memory holds one shard's decisions and one sample, never every key. Each kept sample is checked
against the key the scores have for its (shard, index), so a shard that changed after scoring
stops the run instead of producing a silently wrong dataset.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.config import COUNT, at_least, declare
from pairclean.curate.sweep import Sweep, threshold_sweep
from pairclean.data.manifest import DatasetSpec, write_manifest
from pairclean.data.reader import OnFailure, UnitFailure, list_samples, read_samples
from pairclean.data.writer import write_shards
from pairclean.errors import ConfigError, UserError
from pairclean.ops.atomic import write_json
from pairclean.ops.guard import Output, check_file_prefix, open_output
from pairclean.scores.db import NUMERIC_TYPES, ScoresDB, compile_predicate, match_shards
from pairclean.scores.rules import TopFractionRule
from pairclean.scores.sql import duckdb_message


@dataclass
class Predicate:
    name: str  # as the user wrote it, for tables and errors
    sql: str  # boolean SQL over the columns of `scores`


@dataclass
class RuleCount:
    rule: str
    pairs: int
    bytes: int | None = None


@dataclass
class FilterResult:
    out: Path
    dry_run: bool
    format: str
    total_pairs: int  # scored pairs of the given shards
    total_bytes: int | None
    counts: list[RuleCount]  # one per rule, then "all rules" when there are several
    kept_pairs: int
    kept_bytes: int | None
    bytes_estimated: bool  # Parquet: row-group sizes shared out by rows, not exact
    output_files: list[str] = field(default_factory=list)
    read_failures: list[dict] = field(default_factory=list)
    sweep: Sweep | None = None  # dry run: what each similarity threshold would keep (`curate.sweep`)


def _top_fraction(db: ScoresDB, fraction: float, by: str) -> Predicate:
    """The `fraction` of the scored pairs with the highest `by`, exactly (`TopFractionRule.keep_sql`)."""
    rule = TopFractionRule(keep=fraction)
    columns = db.columns("scores")
    if by not in columns:
        raise ConfigError(f"`by` {by!r} is not a column of the scores (has {', '.join(columns)})", "by")
    if not columns[by].startswith(NUMERIC_TYPES):
        raise ConfigError(f"`by` {by!r} is {columns[by]}, not numeric", "by")
    return Predicate(f"top {fraction:g} by {by}", rule.keep_sql(db, by))


def keep_predicates(db: ScoresDB, where: list[str], top_fraction: float | None, by: str) -> list[Predicate]:
    predicates = [Predicate(w, compile_predicate(db, w, "where")) for w in where]
    if top_fraction is not None:
        predicates.append(_top_fraction(db, top_fraction, by))
    if not predicates:
        raise ConfigError("give at least one rule: `where` (a predicate) and/or `top_fraction`", "where", "top_fraction")
    return predicates


def _decision_sql(rules: list[Predicate]) -> str:
    flags = ", ".join(f"COALESCE({r.sql}, false) AS r{j}" for j, r in enumerate(rules))
    keep = " AND ".join(f"r{j}" for j in range(len(rules)))
    return f"SELECT *, ({keep}) AS keep FROM (SELECT shard, \"index\", key, {flags} FROM scores)"


def count_rules(db: ScoresDB, rules: list[Predicate]) -> tuple[int, list[int], int]:
    """Run every rule over every row (so runtime errors surface before any output): totals."""
    counts = ", ".join(f"count(*) FILTER (WHERE r{j})" for j in range(len(rules)))
    try:
        sql = f"SELECT count(*), {counts}, count(*) FILTER (WHERE keep) FROM ({_decision_sql(rules)})"
        row = db.con.execute(sql).fetchall()[0]
    except duckdb.Error as exc:
        names = "; ".join(r.name for r in rules)
        raise UserError(f"bad predicate ({names}): {duckdb_message(exc)}") from None
    return int(row[0]), [int(c) for c in row[1:-1]], int(row[-1])


@dataclass
class ShardDecisions:
    """One shard's scored rows, positioned by index: keys[i] and flags[rule][i] (keep is the last)."""

    scored: np.ndarray  # bool, True where the scores have this index
    keys: np.ndarray  # object
    flags: np.ndarray  # bool, (n_rules + 1, size)

    @property
    def keep(self) -> np.ndarray:
        return self.flags[-1]


def shard_decisions(db: ScoresDB, rules: list[Predicate], shard: str, lo: int | None = None,
                    hi: int | None = None) -> ShardDecisions:
    """The rule flags of one scored shard (or its index range [lo, hi]), from DuckDB."""
    where, params = "shard = ?", [shard]
    if lo is not None:
        where, params = where + " AND \"index\" BETWEEN ? AND ?", params + [lo, hi]
    res = db.con.sql(f"SELECT * FROM ({_decision_sql(rules)}) WHERE {where}", params=params).fetchnumpy()
    index = np.asarray(res["index"], dtype=np.int64) - (lo or 0)
    size = int(index.max()) + 1 if len(index) else 0
    if hi is not None:
        size = hi - lo + 1
    scored = np.zeros(size, bool)
    scored[index] = True
    keys = np.empty(size, object)
    keys[index] = np.asarray(res["key"], dtype=object)
    flags = np.zeros((len(rules) + 1, size), bool)
    for j in range(len(rules)):
        flags[j, index] = np.asarray(res[f"r{j}"], dtype=bool)
    flags[-1, index] = np.asarray(res["keep"], dtype=bool)
    return ShardDecisions(scored, keys, flags)


def _recorder(failures: list[dict]) -> OnFailure:
    """The error policy of scoring: keep what could be read, report the shard (in filter.json)."""
    def record(failure: UnitFailure) -> None:
        failures.append({"shard": failure.unit, "reason": failure.reason})

    return record


def _changed(shard: str, detail: str) -> UserError:
    return UserError(f"{shard} changed since it was scored ({detail}); score it again before filtering")


def _check_key(shard: str, dec: ShardDecisions, i: int, key: str) -> None:
    if i >= len(dec.scored):
        return  # past the last scored row: not kept, nothing to compare
    if dec.scored[i] and dec.keys[i] != key:
        raise _changed(shard, f"sample {i} is {key!r} in the shard but {dec.keys[i]!r} in the scores")


def _kept_tar_samples(spec: DatasetSpec, shard: str, dec: ShardDecisions, failures: list[dict],
                      tally: dict) -> Iterator[dict]:
    """The kept samples of one shard, members exactly as stored."""
    i = -1
    for i, sample in enumerate(read_samples(shard, _recorder(failures), spec.allow_pipe)):
        _check_key(shard, dec, i, sample.key)
        if i < len(dec.keep) and dec.keep[i]:
            tally["pairs"] += 1
            tally["bytes"] += sum(len(data) for data in sample.members.values())
            yield {"__key__": sample.key, **sample.members}
    if i + 1 < len(dec.scored):
        raise _changed(shard, f"it has {i + 1} samples, the scores have index {len(dec.scored) - 1}")


def _tar_bytes_per_rule(spec: DatasetSpec, shard: str, dec: ShardDecisions,
                        failures: list[dict]) -> tuple[int, np.ndarray]:
    """Dry run: (bytes of the scored samples, bytes each rule keeps) from the headers."""
    total, per_rule, i = 0, np.zeros(len(dec.flags), np.int64), -1
    for i, sample in enumerate(list_samples(shard, _recorder(failures), spec.allow_pipe)):
        _check_key(shard, dec, i, sample.key)
        size = sum(sample.members.values())
        if i < len(dec.scored) and dec.scored[i]:
            total += size
            per_rule += size * dec.flags[:, i]
    if i + 1 < len(dec.scored):
        raise _changed(shard, f"it has {i + 1} samples, the scores have index {len(dec.scored) - 1}")
    return total, per_rule


def _parquet_key_check(path: str, key_column: str, table: pa.Table, dec: ShardDecisions) -> None:
    if key_column not in table.column_names:
        return  # scoring named rows by position: nothing stored to compare
    for i, value in enumerate(table.column(key_column).to_pylist()):
        _check_key(path, dec, i, str(value))


class _RowGroupBuffer:
    """Re-pack filtered rows into row groups of the input's size (heavy filtering would
    otherwise leave many tiny row groups)."""

    def __init__(self, writer: pq.ParquetWriter, rows: int):
        self.writer, self.rows, self.parts, self.count = writer, max(rows, 1), [], 0

    def add(self, table: pa.Table) -> None:
        self.parts.append(table)
        self.count += table.num_rows
        if self.count >= self.rows:
            whole = pa.concat_tables(self.parts)
            full = self.count // self.rows * self.rows
            self.writer.write_table(whole.slice(0, full), row_group_size=self.rows)
            rest = whole.slice(full)
            self.parts, self.count = ([rest] if rest.num_rows else []), rest.num_rows

    def flush(self) -> None:
        """Write the last, partial row group."""
        if self.count:
            self.writer.write_table(pa.concat_tables(self.parts), row_group_size=self.rows)
        self.parts, self.count = [], 0


def _filter_parquet_file(db: ScoresDB, rules: list[Predicate], path: str, scored_name: str, key_column: str,
                         target: Path, tally: dict) -> bool:
    """Write the kept rows of one Parquet file to `target`; False (and no file) when none is kept."""
    pf = pq.ParquetFile(path)
    meta = pf.metadata
    max_rows = max((meta.row_group(g).num_rows for g in range(meta.num_row_groups)), default=0)
    last_scored = db.scalar("SELECT max(\"index\") FROM scores WHERE shard = ?", [scored_name])
    if last_scored is not None and last_scored >= meta.num_rows:
        raise _changed(path, f"it has {meta.num_rows} rows, the scores have index {last_scored}")
    writer = buffer = None
    offset = 0
    try:
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            dec = shard_decisions(db, rules, scored_name, offset, offset + n - 1)
            if dec.keep.any():
                table = pf.read_row_group(g)
                _parquet_key_check(path, key_column, table, dec)
                kept = table.filter(pa.array(dec.keep))
                tally["pairs"] += kept.num_rows
                if writer is None:
                    writer = pq.ParquetWriter(target, pf.schema_arrow, compression="zstd")
                    buffer = _RowGroupBuffer(writer, max_rows)
                buffer.add(kept)
            offset += n
        if buffer is not None:
            buffer.flush()
    finally:
        if writer is not None:
            writer.close()
    if writer is None:
        return False
    tally["bytes"] += target.stat().st_size
    return True


def _parquet_bytes_per_rule(db: ScoresDB, rules: list[Predicate], path: str, scored_name: str) -> tuple[int, np.ndarray]:
    """Dry run: each row group's compressed size shared out over its rows (an estimate)."""
    meta = pq.ParquetFile(path).metadata
    total, per_rule, offset = 0, np.zeros(len(rules) + 1, np.int64), 0
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        dec = shard_decisions(db, rules, scored_name, offset, offset + n - 1)
        rg = meta.row_group(g)
        size = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns)) / max(n, 1)
        total += round(size * int(dec.scored.sum()))
        per_rule += np.round(size * dec.flags.sum(axis=1)).astype(np.int64)
        offset += n
    return total, per_rule


def _match(db: ScoresDB, spec: DatasetSpec) -> dict[str, str]:
    mapping = match_shards(spec.shards, db.scored_shards())
    missing = [s for s, m in mapping.items() if m is None]
    if missing:
        raise UserError(f"{len(missing)} of the {len(spec.shards)} given shards have no rows in {db.path} "
                        f"(first: {missing[0]}); filter the shards that were scored")
    return mapping  # type: ignore[return-value]


@declare(top_fraction=TopFractionRule.OPTIONS["keep"].bounds, shard_size=COUNT, shard_bytes=at_least(1))
def filter_dataset(spec: DatasetSpec, scores: str | Path | ScoresDB, out: str | Path | Output,
                   where: list[str] | None = None, top_fraction: float | None = None, by: str = "sim",
                   dry_run: bool = False, shard_size: int = 10_000, shard_bytes: float = 1e9, prefix: str = "shard",
                   overwrite: bool = False, progress: Callable[[str], None] | None = None) -> FilterResult:
    """Keep the pairs every rule keeps; write them under `out` (nothing at all on a dry run).

    `scores`: the scores file, or a `ScoresDB` the caller opened (and closes) on it.
    WebDataset in -> WebDataset shards of at most `shard_size` samples / `shard_bytes` bytes;
    Parquet in -> one Parquet file per input file that keeps rows (row groups of the input's size).
    `out` also gets `manifest.yaml` (the new dataset) and `filter.json` (rules, counts, provenance).
    """
    check_file_prefix(prefix)
    scores_path = scores.path if isinstance(scores, ScoresDB) else Path(scores)
    target = None if dry_run else open_output(out, [*spec.shards, scores_path], "out", kind="directory",
                                               overwrite=overwrite)
    out = target.path if target is not None else Path(out.path if isinstance(out, Output) else out)
    if spec.format == "parquet" and (spec.fields.image_path or spec.fields.image2_path):
        raise UserError("this Parquet dataset names images by relative path: filtered files in another "
                        "directory could not find them; filter a Parquet that holds the image bytes")
    opened = contextlib.nullcontext(scores) if isinstance(scores, ScoresDB) else ScoresDB(scores)
    with opened as db:
        mapping = _match(db, spec)
        db.restrict(sorted(set(mapping.values())))
        rules = keep_predicates(db, where or [], top_fraction, by)
        total, per_rule, kept = count_rules(db, rules)
        names = [r.name for r in rules] + (["all rules"] if len(rules) > 1 else [])
        pair_counts = per_rule + ([kept] if len(rules) > 1 else [])
        result = FilterResult(out=out, dry_run=dry_run, format=spec.format, total_pairs=total, total_bytes=None,
                              counts=[RuleCount(n, c) for n, c in zip(names, pair_counts)], kept_pairs=kept,
                              kept_bytes=None, bytes_estimated=spec.format == "parquet")
        if dry_run:
            _dry_run_bytes(db, rules, spec, mapping, result, progress)
            # over the whole file, as the run's null was drawn
            result.sweep = threshold_sweep(db, (db.provenance or {}).get("null_quantiles"), view="scores_file")
            return result
        if kept == 0:
            raise UserError(f"the rules keep none of the {total:,} pairs; nothing written")
        _write(db, rules, spec, mapping, result, shard_size, shard_bytes, prefix, target, progress)
    return result


def _dry_run_bytes(db, rules, spec, mapping, result: FilterResult, progress) -> None:
    total, per_rule = 0, np.zeros(len(rules) + 1, np.int64)
    for shard in spec.shards:
        if spec.format == "webdataset":
            dec = shard_decisions(db, rules, mapping[shard])
            t, r = _tar_bytes_per_rule(spec, shard, dec, result.read_failures)
        else:
            t, r = _parquet_bytes_per_rule(db, rules, shard, mapping[shard])
        total += t
        per_rule += r
        if progress:
            progress(shard)
    result.total_bytes = total
    sizes = list(per_rule[:-1]) + ([per_rule[-1]] if len(rules) > 1 else [])
    for count, size in zip(result.counts, sizes):
        count.bytes = int(size)
    result.kept_bytes = int(per_rule[-1])


def _write(db: ScoresDB, rules, spec, mapping, result: FilterResult, shard_size, shard_bytes, prefix,
           target: Output, progress) -> None:
    tally = {"pairs": 0, "bytes": 0}
    out = target.path
    with target.stage() as tmp:
        if spec.format == "webdataset":
            def samples() -> Iterator[dict]:
                for shard in spec.shards:
                    dec = shard_decisions(db, rules, mapping[shard])
                    yield from _kept_tar_samples(spec, shard, dec, result.read_failures, tally)
                    if progress:
                        progress(shard)

            files = write_shards(samples(), tmp, prefix=prefix, maxcount=shard_size, maxsize=shard_bytes,
                                 encoder=False)
        else:
            files = []
            for shard in spec.shards:
                target = tmp / f"{prefix}-{len(files):06d}.parquet"
                if _filter_parquet_file(db, rules, shard, mapping[shard], spec.fields.key, target, tally):
                    files.append(target)
                if progress:
                    progress(shard)
        if tally["pairs"] != result.kept_pairs:
            # Every shard was read to its last scored index, so only repeated rows get here.
            raise UserError(f"wrote {tally['pairs']:,} pairs but the rules keep {result.kept_pairs:,} rows: "
                            f"{db.path} holds some (shard, index) more than once")
        result.kept_bytes = tally["bytes"]
        result.output_files = [str(out / f.name) for f in files]
        new_spec = DatasetSpec(format=spec.format, shards=result.output_files, pair=spec.pair, fields=spec.fields,
                               label_template=spec.label_template,
                               name=f"{spec.name}-filtered" if spec.name else out.name)
        write_manifest(tmp / "manifest.yaml", new_spec, shards_relative_to=out)
        write_json(tmp / "filter.json", {
            "source": spec.shards, "source_format": spec.format, "scores": str(db.path),
            "rules": [asdict(r) for r in rules], "pairs": result.total_pairs,
            "counts": [asdict(c) for c in result.counts], "kept_pairs": result.kept_pairs,
            "kept_bytes": result.kept_bytes, "bytes_estimated": result.bytes_estimated,
            "output": [os.path.basename(f) for f in result.output_files],
            "read_failures": result.read_failures, "scores_provenance": db.provenance})
