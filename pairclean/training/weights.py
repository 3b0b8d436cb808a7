"""Join a scores Parquet to the training shards as per-shard weight arrays (DuckDB, streamed).

One DuckDB query selects the chosen weight column and the optional filter predicate for every
scored pair, joined to the training shards and ordered by (shard, index); the result streams in
record batches and is cut into one float32 array per training shard (`weights/shard-NNNNNN.npy`,
position = pair index in the shard). Workers memory-map a shard's array when they open the
shard: nothing holds a per-key dictionary and memory is bounded by the largest shard.

Array values: the weight (NULL weights count as 0), `data.DROPPED` for pairs the predicate
rejects, NaN for pairs missing from the scores (then `on_missing` decides: error, drop, or keep
with weight 1).

Join modes: `shard-index` matches the scores' `shard` column to the training shards (same path,
else same file name) and uses `index`, the identity `pairclean score` writes, after checking that
every matched pair has the same key in the scores and in the shard (a listing of the training
keys, from tar headers or the Parquet key column, is written once for this); `key` joins on the
pair key (data re-sharded after scoring; keys must be unique in the scores); `auto` uses
shard-index when the shards match pair for pair, else key.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from pairclean.ops.atomic import atomic_path
from pairclean.config import check_choice
from pairclean.errors import ConfigError, UserError
from pairclean.data.dataset import Dataset
from pairclean.data.record import check_same_dataset
from pairclean.ops.atomic import atomic_directory
from pairclean.ops.records import JsonObject, Keyed
from pairclean.scorefile.contract import scored_pairs
from pairclean.scorefile.db import NUMERIC_TYPES, ScoresDB, compile_predicate
from pairclean.scorefile.sql import duckdb_message
from pairclean.training.data import DROPPED, ShardInfo

JOINS = ("auto", "shard-index", "key")
ON_MISSING = ("error", "drop", "keep")
WEIGHTS_DIR = "weights"


@dataclass
class WeightJoin:
    directory: str
    shard_files: dict[str, str]
    join: str
    rows: int
    kept: int
    dropped: int
    missing: int
    mean_weight: float  # over kept pairs

    def summary(self) -> JsonObject:
        d = asdict(self)
        d.pop("shard_files")
        return d


class _Scores:
    """`query.ScoresDB` (views, spill directory) plus the user's weight column and predicate, checked."""

    def __init__(self, path: str | Path, column: str | None, predicate: str | None,
                 attach: dict[str, list[str]] | None = None):
        self.db = ScoresDB(path, attach=attach)
        self.path, self.con = self.db.path, self.db.con
        try:
            self._check(column, predicate)
        except UserError:
            self.db.close()
            raise

    def _check(self, column: str | None, predicate: str | None) -> None:
        self.names = list(self.db.columns())
        if column is not None and column not in self.names:
            raise UserError(f"scores {self.path} has no column {column!r} (columns: {', '.join(self.names)})")
        self.weight_sql = f'COALESCE(CAST(s."{column}" AS DOUBLE), 0.0)' if column else "1.0"
        self.keep_sql = f"COALESCE({compile_predicate(self.db, predicate, 'filter')}, FALSE)" if predicate else "TRUE"
        if column is not None:
            kind = self.db.columns()[column]
            if not kind.startswith(NUMERIC_TYPES):
                raise UserError(f"column {column!r} is {kind}, not numeric: it cannot serve as a weight")
            try:
                lowest, bad = self.con.execute(f"SELECT min({self.weight_sql}), count(*) FILTER "
                                               f"(WHERE NOT isfinite({self.weight_sql})) FROM scores s").fetchall()[0]
            except duckdb.Error as exc:
                raise UserError(f"column {column!r} cannot serve as a weight: {duckdb_message(exc)}") from None
            if bad:
                raise UserError(f"column {column!r} has {bad:,} NaN or infinite values; loss weights must be finite")
            if lowest is not None and lowest < 0:
                raise UserError(f"column {column!r} has negative values (min {lowest:.4g}); loss weights must be >= 0")

    def shard_map(self, shards: list[ShardInfo]) -> Keyed[str, int]:
        """Scored shard name -> training shard id, by real path, else by unique file name."""
        scored = [row[0] for row in self.con.execute("SELECT DISTINCT shard FROM scores WHERE shard IS NOT NULL").fetchall()]
        by_path = {os.path.realpath(s.shard): i for i, s in enumerate(shards)}
        mapping = {name: by_path[os.path.realpath(name)] for name in scored if os.path.realpath(name) in by_path}
        if mapping:
            return mapping
        train_names = [os.path.basename(s.shard) for s in shards]
        scored_names = [os.path.basename(n) for n in scored]
        if len(set(train_names)) == len(train_names) and len(set(scored_names)) == len(scored_names):
            by_name = {name: i for i, name in enumerate(train_names)}
            return {full: by_name[base] for full, base in zip(scored, scored_names) if base in by_name}
        return {}


def build_weight_arrays(scores: str | Path, dataset: Dataset, shards: list[ShardInfo], run_dir: Path,
                        column: str | None = "weight_norm", predicate: str | None = None, join: str = "auto",
                        on_missing: str = "error", batch_rows: int = 65536,
                        attach: dict[str, list[str]] | None = None, allow_other_dataset: bool = False) -> WeightJoin:
    """Write one weight array per training shard under RUN_DIR/weights and return the join summary.
    The training shards must be the files the scores recorded, as `filter` requires of the data it
    copies (`data.record.check_same_dataset`; `allow_other_dataset` waives it)."""
    check_choice(join, JOINS, "join")
    check_choice(on_missing, ON_MISSING, "on_missing")
    src = _Scores(scores, column, predicate, attach)
    con = src.con
    out = Path(run_dir) / WEIGHTS_DIR
    with src.db, atomic_directory(out, overwrite=True) as tmp:
        check_same_dataset(scored_pairs(src.db.provenance), dataset.files(), f"the scores file {src.path}",
                           allow_other_dataset, other="the training shards")
        keys_file = tmp / "train-keys.parquet"
        _write_train_keys(dataset, shards, keys_file)
        con.register("train_keys", pads.dataset(keys_file))
        mode = _choose_join(src, shards, join)
        # The weight and the predicate are evaluated over the scores alone, so a column they name
        # (`key`, `shard`) is never ambiguous with the join's own tables.
        scored = f"(SELECT s.*, {src.weight_sql} AS pc_weight, {src.keep_sql} AS pc_keep FROM scores s) s"
        if mode == "shard-index":
            query = (f'SELECT m.shard_id, s."index" AS idx, s.pc_weight AS w, s.pc_keep AS keep FROM {scored} '
                     'JOIN shard_map m ON s.shard = m.scored ORDER BY m.shard_id, idx')
        else:
            query = (f"SELECT k.shard_id, k.idx, s.pc_weight AS w, s.pc_keep AS keep FROM train_keys k "
                     f"JOIN {scored} ON k.key = s.key ORDER BY k.shard_id, k.idx")
        try:
            reader = con.sql(query).to_arrow_reader(batch_rows)
            files, counts = _write_arrays(reader, shards, tmp, on_missing)
        except duckdb.Error as exc:
            raise UserError(f"joining {src.path} failed: {duckdb_message(exc)}") from None
        con.unregister("train_keys")
        keys_file.unlink()
    return WeightJoin(directory=str(out), shard_files={s.shard: files[i] for i, s in enumerate(shards)}, join=mode,
                      **counts)


def _choose_join(src: _Scores, shards: list[ShardInfo], join: str) -> str:
    """shard-index when the scores' shards are the training shards pair for pair (keys checked), else key."""
    con = src.con
    mismatch = None
    mapping = src.shard_map(shards) if join in ("auto", "shard-index") else {}
    if mapping:
        _check_unique(con, 'shard, "index"', "(shard, index)")
        con.register("shard_map", pa.table({"scored": list(mapping), "shard_id": list(mapping.values())}))
        mismatch = con.execute(
            'SELECT s.shard, s."index", s.key, k.key FROM scores s JOIN shard_map m ON s.shard = m.scored '
            'LEFT JOIN train_keys k ON k.shard_id = m.shard_id AND k.idx = s."index" '
            "WHERE k.key IS NULL OR s.key IS DISTINCT FROM k.key LIMIT 1").fetchone()
        if mismatch is None:
            return "shard-index"
    if join == "shard-index":
        if mismatch is None:
            raise UserError(f"no shard of {src.path} matches a training shard by path or file name; join by key")
        shard, index, scored_key, data_key = mismatch
        found = f"key {data_key!r}" if data_key is not None else "no pair"
        raise UserError(f"{shard} pair {index} is {scored_key!r} in the scores but the shard now holds {found}: "
                        "it changed after scoring; join by key")
    _check_unique(con, "key", "key")
    return "key"


def _check_unique(con, columns: str, label: str) -> None:
    dup = con.execute(f"SELECT {columns}, count(*) AS n FROM scores GROUP BY ALL HAVING n > 1 LIMIT 1").fetchone()
    if dup:
        raise UserError(f"scores hold {label} {dup[:-1]} {dup[-1]} times: the join needs it to be unique")


def _write_train_keys(dataset: Dataset, shards: list[ShardInfo], path: Path) -> None:
    """(shard_id, idx, key) of every training pair, one shard in memory at a time."""
    schema = pa.schema([("shard_id", pa.int32()), ("idx", pa.int64()), ("key", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for shard_id, info in enumerate(shards):
            keys = dataset.keys(info.shard)[:info.rows]
            writer.write_table(pa.table({"shard_id": pa.array([shard_id] * len(keys), pa.int32()),
                                         "idx": pa.array(range(len(keys)), pa.int64()), "key": keys}, schema=schema))


def _write_arrays(reader, shards: list[ShardInfo], out: Path, on_missing: str) -> tuple[Keyed[int, str], Keyed]:
    """Cut the ordered (shard_id, idx, w, keep) stream into per-shard arrays and save them."""
    files: dict[int, str] = {}
    totals = {"rows": 0, "kept": 0, "dropped": 0, "missing": 0, "weight_sum": 0.0}
    first_missing: tuple | None = None
    current, array = -1, None

    def finish(shard_id: int, arr: np.ndarray) -> None:
        nonlocal first_missing
        missing = np.isnan(arr)
        n_missing = int(missing.sum())
        if n_missing and first_missing is None:
            first_missing = (shards[shard_id].shard, int(np.argmax(missing)))
        if on_missing == "drop":
            arr[missing] = DROPPED
        elif on_missing == "keep":
            arr[missing] = 1.0
        kept = arr != DROPPED
        kept &= ~np.isnan(arr)
        totals["rows"] += len(arr)
        totals["missing"] += n_missing
        totals["dropped"] += int((arr == DROPPED).sum())
        totals["kept"] += int(kept.sum())
        totals["weight_sum"] += float(arr[kept].sum())
        name = f"shard-{shard_id:06d}.npy"
        with atomic_path(out / name) as tmp, open(tmp, "wb") as fh:
            np.save(fh, arr)
        files[shard_id] = name

    def advance_to(shard_id: int) -> np.ndarray:
        nonlocal current, array
        while current < shard_id:
            if array is not None:
                finish(current, array)
            current += 1
            array = np.full(shards[current].rows, np.nan, dtype=np.float32)
        return array

    for batch in reader:
        ids = batch.column(0).to_numpy()
        idx = batch.column(1).to_numpy()
        w = batch.column(2).to_numpy(zero_copy_only=False)
        keep = batch.column(3).to_numpy(zero_copy_only=False)
        values = np.where(keep, w, DROPPED).astype(np.float32)
        cuts = np.flatnonzero(np.diff(ids)) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(ids)]):
            arr = advance_to(int(ids[lo]))
            arr[idx[lo:hi]] = values[lo:hi]
    if shards:
        advance_to(len(shards) - 1)  # shards after the last scored one get their (all-missing) arrays too
    if array is not None:
        finish(current, array)
    if totals["missing"] and on_missing == "error":
        shard, index = first_missing
        raise ConfigError(f"{totals['missing']:,} training pairs have no row in the scores (first: {shard} pair "
                          f"{index}); score them, or set on_missing to drop (leave them out) or keep (weight 1)",
                          "on_missing")
    if totals["kept"] == 0:
        raise UserError("no training pair is left after the join and filter")
    mean = totals.pop("weight_sum") / totals["kept"]
    return files, {**totals, "mean_weight": mean}
