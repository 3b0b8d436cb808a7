"""The scores file contract: its columns, the metadata keys, and the typed provenance and summary.

A scores file is one Parquet file: the base columns, then each decision rule's columns in rule
order, then `error`. Its schema metadata holds the provenance (how the scores were made, written
first); its file metadata holds the run summary (counts, added at close), which the run manifest
`OUT.run.json` beside it repeats. Everything that reads a scores file goes through here (or through
`scores.db.ScoresDB`, which reads both once for the commands that query the file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, TypedDict

import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.ops.atomic import write_json
from pairclean.scores.rules import DEFAULT_RULES, REGISTRY, DecisionRule, RuleRecord

BASE_COLUMNS = [
    ("key", pa.string()),
    ("shard", pa.string()),
    ("index", pa.int64()),
    ("sim", pa.float32()),
    ("sim_debiased", pa.float32()),
    ("weight", pa.float32()),
    ("weight_norm", pa.float32()),
]
ERROR_COLUMN = ("error", pa.string())
METADATA_KEY = b"pairclean"  # schema metadata: the provenance
SUMMARY_KEY = b"pairclean_summary"  # file metadata: the summary


def scores_schema(rules: Iterable[DecisionRule | type[DecisionRule]]) -> pa.Schema:
    """The columns of a scores file holding these rules."""
    return pa.schema([*BASE_COLUMNS, *(column for rule in rules for column in rule.columns), ERROR_COLUMN])


SCORES_SCHEMA = scores_schema(REGISTRY[name] for name in DEFAULT_RULES)


class Provenance(TypedDict, total=False):
    """How a scores file was made (producers add their own entries, e.g. `renormalised`)."""

    estimator: dict
    pair: str
    seed: int
    input_shards: list[str]
    dataset: str | None
    world_size: int
    units_by_rank: dict[str, int]  # units this run scored, by the torchrun rank that claimed them
    pairclean_version: str
    beta: float
    beta_std: float | None
    beta_k: int
    beta_mode: str
    weight_fn: str
    official_scale: float | None
    gmm: dict | None  # the GMM rule's fitted mixture (FittedMixture fields)
    gmm_sample: int  # similarities in the sample the rules were fitted on
    null_sample: int  # null similarities (in-data pairs that do not belong together) the rules were given
    null_quantiles: list[float] | None  # their quantiles at 0, 0.1%, ..., 100% (the threshold sweep reads them)
    rules: list[dict]  # RuleRecord fields, one entry per rule in column order
    run_id: str | None
    settings_sha1: str
    finished_at: str


class Summary(TypedDict, total=False):
    """The run summary; also `flagged_NAME` and `share_flagged_NAME` for every rule NAME."""

    pairs: int  # = scored + errors
    scored: int
    errors: int
    unit_failures: list[dict]
    failed_units: int
    units: int
    beta: float
    beta_std: float | None
    beta_k: int
    beta_mode: str
    random_pairing_share: float  # share of pairs that look like random pairings (not all noise), when null pairs were drawn
    random_pairing_share_low: float  # its 95% interval
    random_pairing_share_high: float
    rules: list[dict]  # name, label, decision, noisy_if, flagged, share_flagged, abstains, and the rule's notes
    # added by the scoring run after finalize
    pairs_per_second: float
    scoring_seconds: float
    beta_seconds: float
    beta_source: str


def flagged_summary(records: list[RuleRecord], flagged: dict[str, int], scored: int) -> dict:
    """The summary's per-rule entries: flagged counts and shares among the scored pairs."""
    share = {name: count / scored if scored else 0.0 for name, count in flagged.items()}
    return {"rules": [{"name": r.name, "label": r.label, "decision": r.decision, "noisy_if": r.noisy_if,
                       "abstains": r.abstains, "flagged": flagged[r.name], "share_flagged": share[r.name], **r.notes}
                      for r in records],
            **{f"flagged_{name}": count for name, count in flagged.items()},
            **{f"share_flagged_{name}": value for name, value in share.items()}}


def run_manifest_path(out: Path) -> Path:
    return out.with_name(out.stem + ".run.json")


def provenance_metadata(provenance: Provenance) -> dict[bytes, bytes]:
    return {METADATA_KEY: json.dumps(provenance, default=str).encode()}


def summary_metadata(summary: Summary) -> dict[bytes, bytes]:
    return {SUMMARY_KEY: json.dumps(summary, default=str).encode()}


def write_run_manifest(out: Path, summary: Summary, provenance: Provenance, temp_dir: Path) -> None:
    write_json(run_manifest_path(out), {"output": str(out), "summary": summary, "provenance": provenance},
               temp_dir=temp_dir)


def read_metadata(scores: str | Path) -> tuple[Provenance | None, Summary | None]:
    """The provenance and the summary of a scores file from one read of its footer (None where
    absent: a Parquet file not written by `pairclean score`)."""
    meta = pq.read_metadata(scores)
    schema = meta.schema.to_arrow_schema().metadata or {}  # schema metadata: written first
    added = meta.metadata or {}  # file key-value metadata, added at close
    return (json.loads(schema[METADATA_KEY]) if METADATA_KEY in schema else None,
            json.loads(added[SUMMARY_KEY]) if SUMMARY_KEY in added else None)


def read_provenance(scores: str | Path) -> Provenance:
    """The provenance stored in a scores file's Parquet key-value metadata."""
    provenance = read_metadata(scores)[0]
    if provenance is None:
        raise ValueError(f"{scores} has no pairclean provenance (not written by pairclean score?)")
    return provenance


def read_summary(scores: str | Path) -> Summary:
    """The run summary stored in a scores file (the same one its run manifest holds)."""
    summary = read_metadata(scores)[1]
    if summary is None:
        raise ValueError(f"{scores} has no pairclean summary (not written by pairclean score?)")
    return summary
