"""Finalize: merge committed parts into one scores file (`pairclean.scorefile.contract`) with OSA
weights and every decision rule's columns.

Two streaming passes over the parts (pyarrow record batches, memory bounded by a batch):
1. the similarities' maximum and a uniform sample (at most `gmm_sample` values) that the decision
   rules are fitted on (the GMM among them), and as large a uniform sample of the null
   similarities: each part's `null_sim` column holds, for the rows that drew one, the cosine of
   the row's left with another drawing row's right of the same unit (`core.scorer.NullDraw`), a
   sample of "pairs that do not belong together" drawn from the data itself (`FitContext.null_sample`);
2. the scorer's columns and each rule's columns, written row group by row group to a temp file
   that is renamed over the output only when complete.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairclean import __version__
from pairclean.core.beta import BetaEstimate
from pairclean.core.null import NullCalibration
from pairclean.core.scorer import cone_weight, debias, normalised_weight
from pairclean.ops.faults import fault_point
from pairclean.ops.progress import SILENT, Progress
from pairclean.ops.records import JsonObject
from pairclean.scorefile.contract import (FailedUnit, Provenance, Summary, flagged_summary, provenance_metadata,
                                       scores_schema, summary_metadata, write_run_manifest)
from pairclean.scorefile.rules import DEFAULT_RULES, DecisionRule, FitContext, build_rules
from pairclean.runs import PartStore, Run
from pairclean.scoring.parts import ScoredUnit


def _iter_parts(store: PartStore, units: list[str], columns=None, batch_size: int = 65536):
    for unit in units:
        pf = store.open_part(unit)
        names = pf.schema_arrow.names
        if columns is not None and not all(c in names for c in columns):  # a part from before null_sim
            for batch in pf.iter_batches(batch_size=batch_size, columns=[c for c in columns if c in names]):
                yield pa.RecordBatch.from_arrays(
                    [batch.column(c) if c in names else pa.nulls(batch.num_rows, pa.float32()) for c in columns],
                    names=list(columns))
            continue
        yield from pf.iter_batches(batch_size=batch_size, columns=columns)


class _UniformSample:
    """At most `size` of `n` values streamed in order, drawn uniformly without replacement."""

    def __init__(self, n: int, size: int, rng: np.random.Generator):
        self.take = np.sort(rng.choice(n, size=min(size, n), replace=False)) if n else np.array([], int)
        self.parts, self.seen = [], 0

    def add(self, values: np.ndarray) -> None:
        lo, hi = np.searchsorted(self.take, [self.seen, self.seen + len(values)])
        self.parts.append(values[self.take[lo:hi] - self.seen])
        self.seen += len(values)

    def values(self) -> np.ndarray:
        return np.concatenate(self.parts) if self.parts else np.array([])


def _finite(column) -> np.ndarray:
    values = column.to_numpy(zero_copy_only=False).astype(np.float64)  # nulls -> NaN
    return values[np.isfinite(values)]


def _samples_and_max(store: PartStore, units: list[str], n_valid: int, n_null: int, size: int, seed: int,
                     task) -> tuple[np.ndarray, np.ndarray, float]:
    """(uniform sample of the similarities, uniform sample of the null similarities, the maximum)."""
    return similarity_samples(_counted(_iter_parts(store, units, columns=["sim", "null_sim"]), task),
                              n_valid, n_null, size, seed)


def _counted(batches: Iterable[pa.RecordBatch], task) -> Iterator[pa.RecordBatch]:
    """The batches, each counted on the progress task as it is read."""
    for batch in batches:
        task.update(advance=batch.num_rows)
        yield batch


def similarity_samples(batches: Iterable[pa.RecordBatch], n_valid: int, n_null: int, size: int,
                       seed: int) -> tuple[np.ndarray, np.ndarray, float]:
    """What the rules are fitted on, from batches of (`sim`, `null_sim`) in output order holding
    `n_valid` similarities and `n_null` null ones: (a uniform sample of at most `size` of each, the
    largest similarity). The same seed and values give the same samples however they are batched."""
    rng = np.random.default_rng(seed)
    sample, null = _UniformSample(n_valid, size, rng), _UniformSample(n_null, size, rng)
    maximum = -np.inf
    for batch in batches:
        valid = _finite(batch.column(0))
        if len(valid):
            maximum = max(maximum, float(valid.max()))
        sample.add(valid)
        null.add(_finite(batch.column(1)))
    return sample.values(), null.values(), maximum


NULL_QUANTILE_LEVELS = 1000  # the null distribution kept in the provenance: its quantiles at 0, 0.1%, ..., 100%


def null_quantiles(null_sample: np.ndarray) -> list[float] | None:
    """The null similarities' distribution as readers after the run need it (the threshold sweep)."""
    if len(null_sample) < 2:
        return None
    return np.quantile(null_sample, np.linspace(0, 1, NULL_QUANTILE_LEVELS + 1)).round(6).tolist()


def random_pairing_share(sample: np.ndarray, null_sample: np.ndarray) -> JsonObject:
    """The share of the scored pairs that look like random pairings, with a 95% interval
    (`core.null.NullCalibration.random_pairing_share`): an estimate of the noise that is as dissimilar
    as a random pairing, not of all noise (a caption of a similar item is not counted): the
    summary's entries (`scores.contract.Summary`). Empty when the run drew no null pairs."""
    if len(null_sample) < 2 or not len(sample):
        return {}
    estimate, low, high = NullCalibration.fit(null_sample, sample).random_pairing_share(sample)
    return {"random_pairing_share": estimate, "random_pairing_share_low": low, "random_pairing_share_high": high}


@dataclass(frozen=True)
class PairColumns:
    """What turns similarities into a scores file's per-pair columns once the rules are fitted:
    finalize calls it on every batch it writes, `pairclean.score_embeddings` on the arrays it is
    handed, so both give the same columns for the same similarities."""

    beta: float
    weight_fn: str
    official_scale: float | None  # the `official` weight function's max(sim) - beta over the data
    rules: tuple[DecisionRule, ...]

    @classmethod
    def fit(cls, rules: Sequence[DecisionRule], sample: np.ndarray, null_sample: np.ndarray, max_sim: float,
            beta: float, weight_fn: str, seed: int) -> "PairColumns":
        """Fit each rule on the samples (`similarity_samples`); `max_sim`: the largest similarity."""
        for rule in rules:
            rule.fit(sample, FitContext(beta=beta, seed=seed, null_sample=null_sample))
        official_scale = max(max_sim - beta, 0.0) if weight_fn == "official" and len(sample) else None
        return cls(beta, weight_fn, official_scale, tuple(rules))

    def table(self, sim: np.ndarray) -> pa.Table:
        """`sim_debiased`, `weight`, `weight_norm`, then each rule's columns, for float64
        similarities (NaN: the pair has no score; its columns are NULL, its weights 0)."""
        valid = ~np.isnan(sim)
        sd = debias(sim, self.beta)
        w = np.where(valid, cone_weight(np.nan_to_num(sd, nan=-1.0), self.weight_fn, scale=self.official_scale), 0.0)
        wn = np.where(valid, normalised_weight(w, self.weight_fn, self.beta), 0.0)
        columns = {"sim_debiased": pa.array(sd, type=pa.float32(), mask=~valid),
                   "weight": pa.array(w, type=pa.float32()), "weight_norm": pa.array(wn, type=pa.float32())}
        for rule in self.rules:
            derived = rule.derive(sim)
            for name, dtype in rule.columns:  # a rule's NaN (no value: it abstains) is NULL, never a number
                values = np.asarray(derived[name])
                missing = ~valid | np.isnan(values) if pa.types.is_floating(dtype) else ~valid
                columns[name] = pa.array(values, type=dtype, mask=missing)
        return pa.table(columns)

    def flagged(self, table: pa.Table) -> tuple[int, ...]:
        """Pairs each rule flags in `table` (a scored pair whose decision is true), in rule order."""
        return tuple(int(pc.sum(table.column(rule.decision)).as_py() or 0) for rule in self.rules)


def failed_units(units: list[str], records: dict[str, ScoredUnit]) -> list[FailedUnit]:
    """The units that broke, with their reasons and the rows they gave before (from the commit records)."""
    return [FailedUnit(unit=u, reason=records[u].failure, rows=records[u].rows)
            for u in units if records[u].failure]


def finalize(run: Run, units: list[str], beta: BetaEstimate, weight_fn: str, seed: int, gmm_sample: int,
             provenance: dict, records: dict[str, ScoredUnit], rules: Sequence[str] = DEFAULT_RULES,
             progress: Progress = SILENT) -> Summary:
    """Write the run's scores Parquet + run manifest; returns the run summary (`progress`: one
    task over both passes, each row counted once in each).

    `rules` are decision-rule specs (`pairclean.scorefile.rules`), fitted on the sample and written in
    this order. Reconciliation: every row of the output is either scored (`sim` set) or an error row
    (`error` set), so pairs = scored + errors. A unit that broke (truncated tar, vanished
    shard, unreadable Parquet) keeps the rows read before the break and is listed in
    `unit_failures` with its reason and that row count; pairs it never yielded are not rows.
    The counts are taken again from the rows as they are written and checked against the
    commit records before the output is renamed into place.
    """
    deciders = build_rules(rules)
    n_rows = sum(records[u].rows for u in units)
    n_null = sum(records[u].null_rows for u in units)
    n_valid = n_rows - sum(records[u].errors for u in units)
    with progress.task("finalize (2 passes)", total=2 * n_rows) as task:
        samples = _samples_and_max(run.store, units, n_valid, n_null, gmm_sample, seed, task)
        return _write(run, units, beta, weight_fn, seed, provenance, records, deciders, samples, task)


def _write(run: Run, units: list[str], beta: BetaEstimate, weight_fn: str, seed: int, provenance: dict,
           records: dict[str, ScoredUnit], deciders: list[DecisionRule],
           samples: tuple[np.ndarray, np.ndarray, float], task) -> Summary:
    """Finalize's second pass: every row with its weights and each rule's columns (fitted on the
    first pass's samples), then the run manifest."""
    sample, null_sample, max_sim = samples
    store = run.store
    n_rows = sum(records[u].rows for u in units)
    n_errors = sum(records[u].errors for u in units)
    n_valid = n_rows - n_errors
    scorer = PairColumns.fit(deciders, sample, null_sample, max_sim, beta.beta, weight_fn, seed)
    rule_records = [rule.record() for rule in deciders]
    official_scale = scorer.official_scale

    unit_failures = failed_units(units, records)
    provenance = Provenance(**{
        **provenance, "pairclean_version": __version__, "beta": beta.beta, "beta_std": beta.std,
        "beta_k": beta.k, "beta_mode": beta.mode, "weight_fn": weight_fn, "official_scale": official_scale,
        **{key: value for rule in deciders for key, value in rule.provenance().items()},
        "gmm_sample": int(len(sample)), "null_sample": int(len(null_sample)),
        "null_quantiles": null_quantiles(null_sample), "rules": rule_records, **asdict(run.identity())})
    schema = scores_schema(deciders).with_metadata(provenance_metadata(provenance))

    flagged = {rule.name: 0 for rule in deciders}
    written = scored = errored = 0
    out = run.out
    with run.write_output() as tmp:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            for batch in _counted(_iter_parts(store, units), task):
                sim = batch.column("sim").to_numpy(zero_copy_only=False).astype(np.float64)  # nulls -> NaN
                valid = ~np.isnan(sim)
                has_error = batch.column("error").is_valid().to_numpy(zero_copy_only=False)
                written += batch.num_rows
                scored += int((valid & ~has_error).sum())
                errored += int((has_error & ~valid).sum())
                derived = scorer.table(sim)
                for rule, count in zip(deciders, scorer.flagged(derived)):
                    flagged[rule.name] += count
                columns = {name: batch.column(name) for name in ("key", "shard", "index", "sim")}
                columns.update(zip(derived.column_names, derived.columns))
                columns["error"] = batch.column("error")
                writer.write_table(pa.table(columns, schema=schema))
                fault_point("finalize-batch")
            if (written, scored, errored) != (n_rows, n_valid, n_errors):
                raise RuntimeError(f"parts do not reconcile with their commit records: rows {written} vs {n_rows}, "
                                   f"scored {scored} vs {n_valid}, errors {errored} vs {n_errors}")
            summary = Summary(
                pairs=n_rows, scored=n_valid, errors=n_errors, unit_failures=unit_failures,
                failed_units=len(unit_failures), units=len(units),
                beta=beta.beta, beta_std=beta.std, beta_k=beta.k, beta_mode=beta.mode,
                **random_pairing_share(sample, null_sample), **flagged_summary(rule_records, flagged, n_valid))
            writer.add_key_value_metadata(summary_metadata(summary))
        # The run manifest lands before the Parquet is renamed into place: an output file
        # that exists is always complete and always has its manifest.
        write_run_manifest(out, summary, provenance,
                           temp_dir=store.dir)  # temps live in the parts directory: a kill leaves nothing beside the output
    fault_point("finalize-renamed")
    return summary
