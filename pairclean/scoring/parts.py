"""A scoring run's own records in its part store (`runs.store.PartStore`): the part of a unit
(key, shard, index, sim, null_sim, error), the beta computed once, and the packing of units
into groups whose pairs share batches.

    <out>.parts/beta.json       beta, computed once
    <out>.parts/groups.json     the packing: units in groups whose pairs share batches (pinned at start)
    <out>.parts/part-*.parquet  one part per unit (its `null_sim` column holds the run's null sample: see finalize)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairclean.core.beta import BetaEstimate
from pairclean.ops.records import Json, Problem, RecordError, convert
from pairclean.runs.store import CommitRecord, PartStore

PART_SCHEMA = pa.schema([
    ("key", pa.string()),
    ("shard", pa.string()),
    ("index", pa.int64()),
    ("sim", pa.float32()),
    ("null_sim", pa.float32()),  # the row's left with another row's right (core.scorer.NullDraw); null where not drawn
    ("error", pa.string()),
])
NON_FINITE = "no finite similarity"  # NaN/inf from the estimator, or a row it never scored
MAX_ERROR_CHARS = 300  # an error row's reason is cut here: one line, never a dump of the row's data
BETA_RECORD, GROUPS_RECORD = "beta.json", "groups.json"


def float32_values(column) -> np.ndarray:
    """A column of floats (an array, or a list holding None) as float32, None as NaN. Not through
    pyarrow's `from_pandas`, which imports pandas: 1.7 s of the first commit's CPU, measured."""
    if isinstance(column, np.ndarray):
        return column.astype(np.float32, copy=False)
    return np.array([np.nan if v is None else v for v in column], dtype=np.float32)


@dataclass(frozen=True)
class ScoredUnit(CommitRecord):
    """A scored unit's commit record: its rows (errors among them, those that drew a null
    partner), why the unit broke if it did (the rows read before count), its shuffled-beta sums,
    the embeddings it saved, and what precomputed embeddings held that were not unit length."""

    null_rows: int = 0
    failure: str | None = None
    shuffled: Json = None  # core.beta.ShuffledAccumulator.state()
    embeddings: int = 0
    embedding_bytes: int = 0
    not_unit_left: int = 0
    not_unit_right: int = 0
    max_norm_deviation: float = 0.0


@dataclass(frozen=True)
class ScoredPart:
    """A unit's part, and the counts its commit record holds, taken from the rows themselves."""

    table: pa.Table
    errors: int  # rows without a similarity (an error reason, or no finite value)
    null_rows: int  # rows that drew a null partner


def part_table(columns: dict) -> ScoredPart:
    """A unit's scored rows as its part: a row without a finite similarity and without an error
    reason becomes an error row (it could be neither scored nor weighted). Columns: lists or arrays."""
    values = float32_values(columns["sim"])
    bad = ~np.isfinite(values)  # NaN, inf, and None
    error = pc.utf8_slice_codeunits(pa.array(columns["error"], type=pa.string()), 0, MAX_ERROR_CHARS)
    unexplained = pa.array(bad & ~error.is_valid().to_numpy(zero_copy_only=False))
    null = columns.get("null_sim")
    null = float32_values(null) if null is not None else np.full(len(values), np.nan, dtype=np.float32)
    null = pa.array(null, type=pa.float32(), mask=~np.isfinite(null))
    table = pa.table({"key": columns["key"], "shard": columns["shard"], "index": columns["index"],
                      "sim": pa.array(values, type=pa.float32(), mask=bad), "null_sim": null,
                      "error": pc.if_else(unexplained, pa.scalar(NON_FINITE), error)}, schema=PART_SCHEMA)
    return ScoredPart(table, table.num_rows - table.column("error").null_count, table.num_rows - null.null_count)


PART_WRITE_OPTIONS = {"use_dictionary": ["shard", "error"]}  # keys are unique: no dictionary


def error_counts(store: PartStore, units: list[str], top: int = 5) -> list[dict]:
    """The commonest error reasons of the committed parts, most frequent first."""
    counts: dict[str, int] = {}
    for unit in units:
        column = store.open_part(unit).read(columns=["error"]).column("error")
        for item in pc.value_counts(pc.drop_null(column.combine_chunks())).to_pylist():
            counts[item["values"]] = counts.get(item["values"], 0) + item["counts"]
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    return [{"error": reason, "rows": n} for reason, n in ranked]


def common_errors(store: PartStore, units: list[str]) -> str:
    """The commonest error reasons as one line: `12 x 'missing image'; 4 x '...'`."""
    return "; ".join(f"{c['rows']:,} x {c['error']!r}" for c in error_counts(store, units, top=2))


def load_groups(store: PartStore, units: list[str]) -> list[list[str]] | None:
    """The pinned packing (None before it is saved), checked against the run's own units: every
    unit in exactly one group, no other unit, every group a non-empty list of units."""
    groups = store.read_record(GROUPS_RECORD, list)
    if groups is None:
        return None
    if not all(isinstance(g, list) and g and all(isinstance(u, str) for u in g) for g in groups):
        raise store.invalid(GROUPS_RECORD, "not a list of non-empty lists of units")
    packed = [u for g in groups for u in g]
    missing, foreign = set(units) - set(packed), set(packed) - set(units)
    if missing or foreign or len(packed) != len(units):
        why = "; ".join([f"{len(missing)} unit(s) in no group"] * bool(missing)
                        + [f"{len(foreign)} unit(s) not of this run"] * bool(foreign)
                        + ["a unit in two groups"] * (not missing and not foreign))
        raise store.invalid(GROUPS_RECORD, why)
    return groups


def load_beta(store: PartStore) -> tuple[BetaEstimate, str] | None:
    """beta as saved when the run started, and where it came from (None before), read as strictly
    as a flag (`core.beta.BetaEstimate`'s fields and `source`)."""
    where = store.dir / BETA_RECORD

    def read(value: dict) -> tuple[BetaEstimate, str]:
        source = value.get("source", "resumed")
        if not isinstance(source, str):
            raise RecordError(where, "saved beta", "source", "must be a string")
        try:
            return convert({k: v for k, v in value.items() if k != "source"}, BetaEstimate), source
        except Problem as problem:
            raise RecordError(where, "saved beta", problem.field, problem.problem) from None

    return store.read_as(BETA_RECORD, read)


def save_beta(store: PartStore, beta: BetaEstimate, source: str) -> None:
    store.write_record(BETA_RECORD, {**beta.as_dict(), "source": source})
