"""Filter a dataset by its scores: the kept pairs as new files in the shape the dataset came in.

Each rule is a predicate: a boolean SQL expression over the `scores` view that DuckDB evaluates
(`where`, which may read the tables a user attached, and the dataset's own metadata sidecars as
`metadata`), the top fraction by a score column (`scores.rules.TopFractionRule`, DataComp style),
or a keep-list of keys (`keep_keys`: text, Parquet or DataComp's uid .npy); a pair is kept when
every predicate keeps it (NULL counts as no). All rules are run over every row before anything is
written, so a bad predicate fails with DuckDB's message and leaves nothing behind. The kept keys
can be exported (`keys_out`: a DataComp uid .npy for their resharder, text or Parquet).

The dataset's rewriter writes the kept samples (`data.rewriting`, `Rewriter.write_kept`): tar members
or Parquet rows byte for byte, img2dataset's per-shard metadata and stats beside each tar. It fetches
the kept set one shard (or Parquet row group) at a time from DuckDB (`ScoresKept`): memory holds
one shard's decisions and one sample, never every key. Each kept sample is checked against the
key the scores have for its (shard, index), so a shard that changed after scoring stops the run
instead of producing a silently wrong dataset. Scores whose rows are not the dataset's (made from
precomputed embeddings) meet it by key (`ScoresDB.join_keys`).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import duckdb
import numpy as np
import pyarrow as pa

from pairclean.config import COUNT, at_least, declare
from pairclean.curate.sweep import Sweep, threshold_sweep
from pairclean.data.keys import read_keys, write_keys
from pairclean.data.dataset import Dataset, as_dataset
from pairclean.data.manifest import write_manifest
from pairclean.data.record import check_same_dataset
from pairclean.data.rewriting import Decisions, KeptRows, rewriter_for
from pairclean.data.spec import DatasetSpec
from pairclean.errors import ConfigError, UserError
from pairclean.ops.atomic import write_json
from pairclean.ops.guard import Output, check_file_prefix, open_output
from pairclean.ops.records import Keyed
from pairclean.scorefile.contract import from_embeddings, scored_pairs
from pairclean.scorefile.db import NUMERIC_TYPES, ScoresDB, compile_predicate, match_shards
from pairclean.scorefile.rules import TopFractionRule
from pairclean.scorefile.sql import duckdb_message

METADATA_TABLE = "metadata"  # the dataset's own per-shard metadata (img2dataset's sidecars), attached under this name


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
    out: Path | None
    dry_run: bool
    format: str | None
    total_pairs: int  # scored pairs of the given shards
    total_bytes: int | None
    counts: list[RuleCount]  # one per rule, then "all rules" when there are several
    kept_pairs: int
    kept_bytes: int | None
    bytes_estimated: bool  # Parquet: row-group sizes shared out by rows, not exact
    output_files: list[str] = field(default_factory=list)
    read_failures: list[dict] = field(default_factory=list)
    sweep: Sweep | None = None  # dry run: what each similarity threshold would keep (`curate.sweep`)
    join: str = "shard, index"  # how scores met the dataset: "shard, index" or "key"
    unmatched: int = 0  # key join: scored rows whose key is not in the dataset (not downloaded, another split)
    keys_written: int | None = None  # pairs whose keys went to `keys_out`


def _top_fraction(db: ScoresDB, fraction: float, by: str) -> Predicate:
    """The `fraction` of the scored pairs with the highest `by`, exactly (`TopFractionRule.keep_sql`)."""
    rule = TopFractionRule(keep=fraction)
    columns = db.columns("scores")
    if by not in columns:
        raise ConfigError(f"`by` {by!r} is not a column of the scores (has {', '.join(columns)})", "by")
    if not columns[by].startswith(NUMERIC_TYPES):
        raise ConfigError(f"`by` {by!r} is {columns[by]}, not numeric", "by")
    return Predicate(f"top {fraction:g} by {by}", rule.keep_sql(db, by))


def keep_predicates(db: ScoresDB, where: list[str], top_fraction: float | None, by: str,
                    keep_keys: str | None = None) -> list[Predicate]:
    predicates = [Predicate(w, compile_predicate(db, w, "where")) for w in where]
    if top_fraction is not None:
        predicates.append(_top_fraction(db, top_fraction, by))
    if keep_keys is not None:
        keys = read_keys(keep_keys)
        db.register("keep_keys", pa.table({"key": keys}))
        predicates.append(Predicate(f"key in {Path(keep_keys).name} ({len(keys):,} keys)",
                                    "(key IN (SELECT key FROM keep_keys))"))
    if not predicates:
        raise ConfigError("give at least one rule: `where` (a predicate), `top_fraction` and/or `keep_keys`",
                          "where", "top_fraction", "keep_keys")
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


def shard_decisions(db: ScoresDB, rules: list[Predicate], shard: str, lo: int | None = None,
                    hi: int | None = None) -> Decisions:
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
    return Decisions(scored, keys, flags)


class ScoresKept(KeptRows):
    """The decisions a format writes by, from DuckDB, for the dataset's shards (named as the
    dataset names them; `mapping` gives the name each has in the scores)."""

    def __init__(self, db: ScoresDB, rules: list[Predicate], mapping: dict[str, str]):
        self.db, self.predicates, self.mapping, self.rules = db, rules, mapping, len(rules)

    def decisions(self, shard: str, lo: int | None = None, hi: int | None = None) -> Decisions:
        return shard_decisions(self.db, self.predicates, self.mapping[shard], lo, hi)

    def last_index(self, shard: str) -> int | None:
        return self.db.scalar("SELECT max(\"index\") FROM scores WHERE shard = ?", [self.mapping[shard]])


def _dataset_keys(dataset: Dataset) -> pa.Table:
    """(shard, index, key) of every pair the dataset's shards hold, as its format keys them."""
    shards, index, keys = [], [], []
    for shard in dict.fromkeys(dataset.spec.shards):
        listed = dataset.keys(shard)
        shards.extend([shard] * len(listed))
        index.extend(range(len(listed)))
        keys.extend(listed)
    return pa.table({"shard": pa.array(shards, pa.string()), "index": pa.array(index, pa.int64()),
                     "key": pa.array(keys, pa.string())})


def match_dataset(db: ScoresDB, dataset: Dataset, result: FilterResult) -> Keyed[str, str]:
    """Given shard -> its name in `scores`, narrowed to those shards. Scores made from these shards
    meet them by (shard, index); scores made elsewhere (precomputed embeddings) by key."""
    spec = dataset.spec
    mapping = match_shards(spec.shards, db.scored_shards())
    missing = [s for s, m in mapping.items() if m is None]
    if missing and (len(missing) == len(mapping) or from_embeddings(db.provenance)):
        result.join = "key"
        joined, result.unmatched = db.join_keys(_dataset_keys(dataset))
        if not joined:
            raise UserError(f"no key of {db.path} is a key of the given shards (first: {spec.shards[0]}): "
                            "filter the data these scores describe")
        mapping = {s: s for s in spec.shards}
    elif missing:
        raise UserError(f"{len(missing)} of the {len(spec.shards)} given shards have no rows in {db.path} "
                        f"(first: {missing[0]}); filter the shards that were scored")
    db.restrict(sorted(set(mapping.values())))
    return mapping  # type: ignore[return-value]


def attachments(dataset: Dataset | None, attach: dict[str, list[str]] | None) -> Keyed[str, list[str]]:
    """The tables filter's predicates may read: the user's, and the dataset's own metadata sidecars
    as `metadata` (img2dataset's per-shard Parquet: width, status, url, ...) unless a user table has the name."""
    attach = dict(attach or {})
    sidecars = dataset.input_format.metadata_files() if dataset is not None else []
    if sidecars and METADATA_TABLE not in attach:
        attach[METADATA_TABLE] = sidecars
    return attach


def _kept_keys(db: ScoresDB, rules: list[Predicate]) -> list[str]:
    """The kept pairs' keys, sorted."""
    return [str(k) for k in db.con.sql(f"SELECT key FROM ({_decision_sql(rules)}) WHERE keep ORDER BY key")
            .fetchnumpy()["key"]]


@declare(top_fraction=TopFractionRule.OPTIONS["keep"].bounds, shard_size=COUNT, shard_bytes=at_least(1))
def filter_dataset(source: Dataset | DatasetSpec | None, scores: str | Path | ScoresDB, out: str | Path | Output | None = None,
                   where: list[str] | None = None, top_fraction: float | None = None, by: str = "sim",
                   dry_run: bool = False, shard_size: int = 10_000, shard_bytes: float = 1e9, prefix: str = "shard",
                   overwrite: bool = False, progress: Callable[[str], None] | None = None,
                   keep_keys: str | None = None, keys_out: str | Path | None = None,
                   attach: dict[str, list[str]] | None = None, allow_other_dataset: bool = False) -> FilterResult:
    """Keep the pairs every rule keeps; write them under `out` (nothing at all on a dry run, nor
    when the rules keep no pair).

    `source`: the dataset to write from (None: work on the scores alone, for a dry run's counts or
    `keys_out`). `scores`: the scores file, or a `ScoresDB` the caller opened (and closes) on it.
    WebDataset in -> shards of at most `shard_size` samples / `shard_bytes` bytes; Parquet in ->
    one file per input file that keeps rows. `prefix` '' names outputs like the input
    (img2dataset's `00000.tar`). `out` also gets `manifest.yaml` (the new dataset) and
    `filter.json` (rules, counts, provenance). `keys_out`: also write the kept keys there. The
    dataset's files must be the ones the scores recorded (`data.record`; `allow_other_dataset`
    waives it), and every kept sample is the pair the scores name at its position.
    """
    if prefix:
        check_file_prefix(prefix)
    dataset = as_dataset(source) if source is not None else None
    spec = dataset.spec if dataset is not None else None
    scores_path = scores.path if isinstance(scores, ScoresDB) else Path(scores)
    inputs = [*(dataset.input_paths() if dataset else []), scores_path, keep_keys,
              *(f for fs in (attach or {}).values() for f in fs)]
    writing = not dry_run and out is not None
    target = None
    if writing:
        if spec is None:
            raise ConfigError("writing the kept pairs needs the dataset: the scores file does not name one", "out")
        target = open_output(out, inputs, "out", kind="directory", overwrite=overwrite)
        out = target.path
        rewriter_for(dataset).check_rewritable()
    elif not dry_run and keys_out is None:
        raise ConfigError("give `out` (a directory for the kept pairs), `keys_out`, or `dry_run`", "out", "keys_out",
                          "dry_run")
    elif out is not None:
        out = out.path if isinstance(out, Output) else Path(out)
    keys_target = None
    if keys_out is not None and not dry_run:  # the kept directory is another output of this run
        keys_target = open_output(keys_out, [*inputs, *([target] if target else [])], "keys_out", overwrite=overwrite)
    opened = contextlib.nullcontext(scores) if isinstance(scores, ScoresDB) \
        else ScoresDB(scores, attach=attachments(dataset, attach))
    with opened as db:
        result = FilterResult(out=out, dry_run=dry_run, format=spec.format if spec else None, total_pairs=0,
                              total_bytes=None, counts=[], kept_pairs=0, kept_bytes=None,
                              bytes_estimated=bool(dataset and rewriter_for(dataset).bytes_estimated()))
        if dataset is not None:
            check_same_dataset(scored_pairs(db.provenance), dataset.files(), f"the scores file {db.path}",
                               allow_other_dataset)
        mapping = match_dataset(db, dataset, result) if dataset is not None else {}
        rules = keep_predicates(db, where or [], top_fraction, by, keep_keys)
        total, per_rule, kept = count_rules(db, rules)
        names = [r.name for r in rules] + (["all rules"] if len(rules) > 1 else [])
        pair_counts = per_rule + ([kept] if len(rules) > 1 else [])
        result.total_pairs, result.kept_pairs = total, kept
        result.counts = [RuleCount(n, c) for n, c in zip(names, pair_counts)]
        if dry_run:
            if dataset is not None:
                _dry_run_bytes(ScoresKept(db, rules, mapping), dataset, result, progress)
            # over the whole file, as the run's null was drawn
            result.sweep = threshold_sweep(db, db.provenance.null_quantiles if db.provenance else None,
                                           view="scores_file")
            return result
        if kept == 0:  # a failed run writes nothing: no directory, no key list
            raise UserError(f"the rules keep none of the {total:,} pairs; nothing written")
        # Each output is written under a temp name; the key list (in the format its suffix names)
        # is renamed into place after the directory, so a failure while writing either leaves neither.
        with keys_target.write() if keys_target is not None else contextlib.nullcontext() as keys_tmp:
            if keys_tmp is not None:
                result.keys_written = write_keys(keys_tmp, _kept_keys(db, rules), suffix=keys_target.path.suffix)
            if writing:
                _write(db, rules, dataset, mapping, result, shard_size, shard_bytes, prefix, target, progress)
    return result


def _dry_run_bytes(kept: ScoresKept, dataset: Dataset, result: FilterResult, progress) -> None:
    total, per_rule = 0, np.zeros(kept.rules + 1, np.int64)
    rewriter = rewriter_for(dataset)
    for shard in dataset.spec.shards:
        t, r = rewriter.kept_bytes(kept, shard, result.read_failures)
        total += t
        per_rule += r
        if progress:
            progress(shard)
    result.total_bytes = total
    sizes = list(per_rule[:-1]) + ([per_rule[-1]] if kept.rules > 1 else [])
    for count, size in zip(result.counts, sizes):
        count.bytes = int(size)
    result.kept_bytes = int(per_rule[-1])


def _write(db: ScoresDB, rules, dataset: Dataset, mapping, result: FilterResult, shard_size, shard_bytes, prefix,
           target: Output, progress) -> None:
    out, spec, rewriter = target.path, dataset.spec, rewriter_for(dataset)
    with target.stage() as tmp:
        written = rewriter.write_kept(ScoresKept(db, rules, mapping), tmp, prefix, shard_size, shard_bytes, progress)
        result.read_failures = written.read_failures
        if written.pairs != result.kept_pairs:
            # Every shard was read to its last scored index, so only repeated rows get here.
            raise UserError(f"wrote {written.pairs:,} pairs but the rules keep {result.kept_pairs:,} rows: "
                            f"{db.path} holds some (shard, index) more than once")
        result.kept_bytes = written.bytes
        result.output_files = [str(out / f.name) for f in written.files]
        new_spec = DatasetSpec(format=spec.format, shards=result.output_files, pair=spec.pair, fields=spec.fields,
                               label_template=spec.label_template, image_root=rewriter.copy_root(),
                               name=f"{spec.name}-filtered" if spec.name else out.name)
        write_manifest(tmp / "manifest.yaml", new_spec, shards_relative_to=out)
        write_json(tmp / "filter.json", {
            "source": spec.shards, "source_format": spec.format, "scores": str(db.path), "join": result.join,
            "rules": [asdict(r) for r in rules], "pairs": result.total_pairs,
            "counts": [asdict(c) for c in result.counts], "kept_pairs": result.kept_pairs,
            "kept_bytes": result.kept_bytes, "bytes_estimated": result.bytes_estimated,
            "output": [Path(f).name for f in result.output_files],
            "read_failures": result.read_failures,
            "scores_provenance": db.provenance.to_json() if db.provenance is not None else None})
