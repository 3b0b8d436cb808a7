"""Finalize: merge committed parts into one scores file (`pairclean.scores.contract`) with OSA
weights and every decision rule's columns.

Two streaming passes over the parts (pyarrow record batches, memory bounded by a batch):
1. the similarities' maximum and a uniform sample (at most `gmm_sample` values) that the decision
   rules are fitted on (the GMM among them), and as large a uniform sample of the null
   similarities: each part's `null_sim` column holds, for the rows that drew one, the cosine of
   the row's left with another row's right in the same batch (`core.scorer.null_partners`), a
   sample of "pairs that do not belong together" drawn from the data itself (`FitContext.null_sample`);
2. the scorer's columns and each rule's columns, written row group by row group to a temp file
   that is renamed over the output only when complete.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairclean import __version__
from pairclean.core.beta import BetaEstimate
from pairclean.core.null import NullCalibration
from pairclean.core.scorer import cone_weight, debias, normalised_weight
from pairclean.ops.faults import fault_point
from pairclean.ops.progress import SILENT, Progress
from pairclean.scores.contract import (FailedUnit, Provenance, Summary, flagged_summary, provenance_metadata,
                                       scores_schema, summary_metadata, write_run_manifest)
from pairclean.scores.rules import DEFAULT_RULES, FitContext, build_rules
from pairclean.runs import PartStore, Run


def _iter_parts(store: PartStore, units: list[str], columns=None, batch_size: int = 65536):
    for unit in units:
        pf = pq.ParquetFile(store.part_path(unit))
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
                     task=None):
    """(uniform sample of the similarities, uniform sample of the null similarities, the maximum)."""
    rng = np.random.default_rng(seed)
    sample, null = _UniformSample(n_valid, size, rng), _UniformSample(n_null, size, rng)
    maximum = -np.inf
    for batch in _iter_parts(store, units, columns=["sim", "null_sim"]):
        if task is not None:
            task.update(advance=batch.num_rows)
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


def random_pairing_share(sample: np.ndarray, null_sample: np.ndarray) -> dict:
    """The share of the scored pairs that look like random pairings, with a 95% interval
    (`core.null.NullCalibration.random_pairing_share`): an estimate of the noise that is as dissimilar
    as a random pairing, not of all noise (a caption of a similar item is not counted). Empty when
    the run drew no null pairs."""
    if len(null_sample) < 2 or not len(sample):
        return {}
    estimate, low, high = NullCalibration.fit(null_sample, sample).random_pairing_share(sample)
    return {"random_pairing_share": estimate, "random_pairing_share_low": low, "random_pairing_share_high": high}


def weight_columns(sim: np.ndarray, beta: float, weight_fn: str, official_scale: float | None) -> dict[str, np.ndarray]:
    """The scorer's per-pair columns computed from the similarity (NaN for error rows)."""
    valid = ~np.isnan(sim)
    sd = debias(sim.astype(np.float64), beta)
    w = np.where(valid, cone_weight(np.nan_to_num(sd, nan=-1.0), weight_fn, scale=official_scale), 0.0)
    wn = np.where(valid, normalised_weight(w, weight_fn, beta), 0.0)
    return {"sim_debiased": sd, "weight": w, "weight_norm": wn}


def failed_units(units: list[str], records: dict[str, dict]) -> list[FailedUnit]:
    """The units that broke, with their reasons and the rows they gave before (from the commit records)."""
    return [FailedUnit(unit=u, reason=records[u]["failure"], rows=records[u]["rows"])
            for u in units if records[u].get("failure")]


def finalize(run: Run, units: list[str], beta: BetaEstimate, weight_fn: str, seed: int, gmm_sample: int,
             provenance: dict, records: dict[str, dict], rules: Sequence[str] = DEFAULT_RULES,
             progress: Progress = SILENT) -> Summary:
    """Write the run's scores Parquet + run manifest; returns the run summary (`progress`: one
    task over both passes, each row counted once in each).

    `rules` are decision-rule specs (`pairclean.scores.rules`), fitted on the sample and written in
    this order. Reconciliation: every row of the output is either scored (`sim` set) or an error row
    (`error` set), so pairs = scored + errors. A unit that broke (truncated tar, vanished
    shard, unreadable Parquet) keeps the rows read before the break and is listed in
    `unit_failures` with its reason and that row count; pairs it never yielded are not rows.
    The counts are taken again from the rows as they are written and checked against the
    commit records before the output is renamed into place.
    """
    deciders = build_rules(rules)
    n_rows = sum(records[u]["rows"] for u in units)
    n_valid = n_rows - sum(records[u]["errors"] for u in units)
    n_null = sum(records[u].get("null_rows", 0) for u in units)
    with progress.task("finalize (2 passes)", total=2 * n_rows) as task:
        sample, null_sample, max_sim = _samples_and_max(run.store, units, n_valid, n_null, gmm_sample, seed, task)
        for rule in deciders:
            rule.fit(sample, FitContext(beta=beta.beta, seed=seed, null_sample=null_sample))
        return _write(run, units, beta, weight_fn, provenance, records, deciders, (sample, null_sample, max_sim), task)


def _write(run: Run, units: list[str], beta: BetaEstimate, weight_fn: str, provenance: dict,
           records: dict[str, dict], deciders, fitted: tuple[np.ndarray, np.ndarray, float], task) -> Summary:
    """Finalize's second pass: every row with its weights and each rule's columns (fitted on the
    first pass's samples), then the run manifest."""
    sample, null_sample, max_sim = fitted
    store = run.store
    n_rows = sum(records[u]["rows"] for u in units)
    n_errors = sum(records[u]["errors"] for u in units)
    n_valid = n_rows - n_errors
    rule_records = [rule.record() for rule in deciders]
    official_scale = max(max_sim - beta.beta, 0.0) if weight_fn == "official" and n_valid else None

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
            for batch in _iter_parts(store, units):
                sim = batch.column("sim").to_numpy(zero_copy_only=False).astype(np.float64)  # nulls -> NaN
                valid = ~np.isnan(sim)
                has_error = batch.column("error").is_valid().to_numpy(zero_copy_only=False)
                written += batch.num_rows
                scored += int((valid & ~has_error).sum())
                errored += int((has_error & ~valid).sum())
                weights = weight_columns(sim, beta.beta, weight_fn, official_scale)
                columns = {name: batch.column(name) for name in ("key", "shard", "index", "sim")}
                columns["sim_debiased"] = pa.array(weights["sim_debiased"], type=pa.float32(), mask=~valid)
                columns["weight"] = pa.array(weights["weight"], type=pa.float32())
                columns["weight_norm"] = pa.array(weights["weight_norm"], type=pa.float32())
                for rule in deciders:
                    derived = rule.derive(sim)
                    flagged[rule.name] += int((derived[rule.decision] & valid).sum())
                    for name, dtype in rule.columns:  # a rule's NaN (no value: it abstains) is NULL, never a number
                        values = np.asarray(derived[name])
                        missing = ~valid | np.isnan(values) if pa.types.is_floating(dtype) else ~valid
                        columns[name] = pa.array(values, type=dtype, mask=missing)
                columns["error"] = batch.column("error")
                writer.write_table(pa.table(columns, schema=schema))
                task.update(advance=batch.num_rows)
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
