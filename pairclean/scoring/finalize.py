"""Finalize: merge committed parts into one scores Parquet with OSA weights and GMM p_clean.

Two streaming passes over the parts (pyarrow record batches, memory bounded by a batch):
1. the similarities' maximum and a uniform sample (at most `gmm_sample` values) for the GMM;
2. every derived column through the scorer, written row group by row group to a temp file
   that is renamed over the output only when complete.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairclean import __version__
from pairclean.ops.atomic import atomic_path, write_json
from pairclean.core.beta import BetaEstimate
from pairclean.ops.faults import fault_point
from pairclean.core.mixture import FittedMixture, fit_similarity_mixture
from pairclean.core.scorer import beta_noisy, cone_weight, debias, normalised_weight
from pairclean.scoring.parts import PartStore

SCORES_SCHEMA = pa.schema([
    ("key", pa.string()),
    ("shard", pa.string()),
    ("index", pa.int64()),
    ("sim", pa.float32()),
    ("sim_debiased", pa.float32()),
    ("weight", pa.float32()),
    ("weight_norm", pa.float32()),
    ("osa_noisy", pa.bool_()),
    ("p_clean", pa.float32()),
    ("gmm_noisy", pa.bool_()),
    ("error", pa.string()),
])
METADATA_KEY = b"pairclean"
SUMMARY_KEY = b"pairclean_summary"


def run_manifest_path(out: Path) -> Path:
    return out.with_name(out.stem + ".run.json")


def read_provenance(scores: str | Path) -> dict:
    """The provenance stored in a scores file's Parquet key-value metadata."""
    meta = pq.ParquetFile(scores).schema_arrow.metadata or {}
    if METADATA_KEY not in meta:
        raise ValueError(f"{scores} has no pairclean provenance (not written by pairclean score?)")
    return json.loads(meta[METADATA_KEY])


def _iter_parts(store: PartStore, units: list[str], columns=None, batch_size: int = 65536):
    for unit in units:
        pf = pq.ParquetFile(store.part_path(unit))
        yield from pf.iter_batches(batch_size=batch_size, columns=columns)


def _sample_and_max(store: PartStore, units: list[str], n_valid: int, gmm_sample: int, seed: int):
    rng = np.random.default_rng(seed)
    take = np.sort(rng.choice(n_valid, size=min(gmm_sample, n_valid), replace=False)) if n_valid else np.array([], int)
    sample, seen, maximum = [], 0, -np.inf
    for batch in _iter_parts(store, units, columns=["sim"]):
        sims = batch.column(0).to_numpy(zero_copy_only=False)
        valid = sims[~np.isnan(sims)] if sims.dtype.kind == "f" else sims
        valid = valid[np.isfinite(valid)]
        if len(valid):
            maximum = max(maximum, float(valid.max()))
            lo, hi = np.searchsorted(take, [seen, seen + len(valid)])
            sample.append(valid[take[lo:hi] - seen])
        seen += len(valid)
    return (np.concatenate(sample) if sample else np.array([])), maximum


def derive_columns(sim: np.ndarray, beta: float, weight_fn: str, mixture: FittedMixture | None,
                   official_scale: float | None) -> dict[str, np.ndarray]:
    """All per-pair columns computed from the similarity (NaN for error rows)."""
    valid = ~np.isnan(sim)
    sd = debias(sim.astype(np.float64), beta)
    w = np.where(valid, cone_weight(np.nan_to_num(sd, nan=-1.0), weight_fn, scale=official_scale), 0.0)
    wn = np.where(valid, normalised_weight(w, weight_fn, beta), 0.0)
    p = mixture.p_clean(np.nan_to_num(sim, nan=0.0)) if mixture is not None else np.full(len(sim), np.nan)
    return {"sim_debiased": sd, "weight": w, "weight_norm": wn, "osa_noisy": beta_noisy(sd),
            "p_clean": np.where(valid, p, np.nan), "gmm_noisy": p < 0.5, "valid": valid}


def read_summary(scores: str | Path) -> dict:
    """The run summary stored in a scores file (the same one its run manifest holds)."""
    meta = pq.ParquetFile(scores).metadata.metadata or {}  # file key-value metadata, added at close
    if SUMMARY_KEY not in meta:
        raise ValueError(f"{scores} has no pairclean summary (not written by pairclean score?)")
    return json.loads(meta[SUMMARY_KEY])


def finalize(store: PartStore, units: list[str], out: Path, beta: BetaEstimate, weight_fn: str,
             seed: int, gmm_sample: int, provenance: dict, records: dict[str, dict]) -> dict:
    """Write the final scores Parquet + run manifest; returns the run summary.

    Reconciliation: every row of the output is either scored (`sim` set) or an error row
    (`error` set), so pairs = scored + errors. A unit that broke (truncated tar, vanished
    shard, unreadable Parquet) keeps the rows read before the break and is listed in
    `unit_failures` with its reason and that row count; pairs it never yielded are not rows.
    The counts are taken again from the rows as they are written and checked against the
    commit records before the output is renamed into place.
    """
    n_rows = sum(records[u]["rows"] for u in units)
    n_errors = sum(records[u]["errors"] for u in units)
    n_valid = n_rows - n_errors
    sample, max_sim = _sample_and_max(store, units, n_valid, gmm_sample, seed)
    mixture = fit_similarity_mixture(sample, seed=seed) if len(sample) >= 2 else None
    official_scale = max(max_sim - beta.beta, 0.0) if weight_fn == "official" and n_valid else None

    unit_failures = [{"unit": u, "reason": records[u]["failure"], "rows": records[u]["rows"]}
                     for u in units if records[u].get("failure")]
    run = store.run_info()
    provenance = {**provenance, "pairclean_version": __version__, "beta": beta.beta, "beta_std": beta.std,
                  "beta_k": beta.k, "beta_mode": beta.mode, "weight_fn": weight_fn,
                  "official_scale": official_scale, "gmm": mixture.as_dict() if mixture else None,
                  "gmm_sample": int(len(sample)), "run_id": run.get("run_id"),
                  "settings_sha1": store.settings_sha1(),
                  "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    schema = SCORES_SCHEMA.with_metadata({METADATA_KEY: json.dumps(provenance, default=str).encode()})

    flagged_beta = flagged_gmm = written = scored = errored = 0
    with atomic_path(out, temp_dir=store.dir, no_clobber=not run.get("replaces_output")) as tmp:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            for batch in _iter_parts(store, units):
                sim = batch.column("sim").to_numpy(zero_copy_only=False).astype(np.float64)  # nulls -> NaN
                cols = derive_columns(sim, beta.beta, weight_fn, mixture, official_scale)
                valid = cols["valid"]
                flagged_beta += int((cols["osa_noisy"] & valid).sum())
                flagged_gmm += int((cols["gmm_noisy"] & valid).sum())
                has_error = batch.column("error").is_valid().to_numpy(zero_copy_only=False)
                written += batch.num_rows
                scored += int((valid & ~has_error).sum())
                errored += int((has_error & ~valid).sum())

                def nullable(values, dtype):
                    return pa.array(values, type=dtype, mask=~valid)

                table = pa.table({
                    "key": batch.column("key"), "shard": batch.column("shard"), "index": batch.column("index"),
                    "sim": batch.column("sim"),
                    "sim_debiased": nullable(cols["sim_debiased"], pa.float32()),
                    "weight": pa.array(cols["weight"], type=pa.float32()),
                    "weight_norm": pa.array(cols["weight_norm"], type=pa.float32()),
                    "osa_noisy": nullable(cols["osa_noisy"], pa.bool_()),
                    "p_clean": nullable(cols["p_clean"], pa.float32()),
                    "gmm_noisy": nullable(cols["gmm_noisy"], pa.bool_()),
                    "error": batch.column("error"),
                }, schema=schema)
                writer.write_table(table)
                fault_point("finalize-batch")
            if (written, scored, errored) != (n_rows, n_valid, n_errors):
                raise RuntimeError(f"parts do not reconcile with their commit records: rows {written} vs {n_rows}, "
                                   f"scored {scored} vs {n_valid}, errors {errored} vs {n_errors}")
            summary = {"pairs": n_rows, "scored": n_valid, "errors": n_errors, "unit_failures": unit_failures,
                       "failed_units": len(unit_failures), "units": len(units),
                       "beta": beta.beta, "beta_std": beta.std, "beta_k": beta.k, "beta_mode": beta.mode,
                       "flagged_beta": flagged_beta, "flagged_gmm": flagged_gmm,
                       "share_flagged_beta": flagged_beta / n_valid if n_valid else 0.0,
                       "share_flagged_gmm": flagged_gmm / n_valid if n_valid else 0.0}
            writer.add_key_value_metadata({SUMMARY_KEY: json.dumps(summary, default=str).encode()})
        # The run manifest lands before the Parquet is renamed into place: an output file
        # that exists is always complete and always has its manifest.
        write_json(run_manifest_path(out), {"output": str(out), "summary": summary, "provenance": provenance},
                   temp_dir=store.dir)  # temps live in the parts directory: a kill leaves nothing beside the output
    fault_point("finalize-renamed")
    return summary
