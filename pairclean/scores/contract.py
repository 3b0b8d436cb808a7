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
from pairclean.runs.store import ReadBack, WrittenBy
from pairclean.scores.rules import DEFAULT_RULES, REGISTRY, DecisionRule, RuleRecord, recorded_rules

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

# What the columns every scores file has mean (a rule's columns are described by the rule's record).
COLUMN_MEANINGS = {
    "key": "the sample's key in its shard, or the Parquet id column (keys may repeat)",
    "shard": "the tar shard or Parquet file the pair came from",
    "index": "position of the pair within its shard (from 0); (shard, index) is unique",
    "sim": "cosine of the two embeddings; NULL on error",
    "sim_debiased": "sim - beta; NULL on error",
    "weight": "OSA weight w(sim_debiased); 0 on error",
    "weight_norm": "weight mapped onto [0, 1]; 0 on error",
    "error": "NULL when fine, else why the pair could not be scored",
}


def columns_phrase() -> str:
    """The columns a scores file can have, in words (for help texts): the default ones, then the
    columns each other rule adds when it is enabled."""
    others = "; ".join(f"{name}: {', '.join(column for column, _ in cls.columns)}"
                       for name, cls in REGISTRY.items() if name not in DEFAULT_RULES)
    return ", ".join(SCORES_SCHEMA.names) + (f"; a rule enabled when scoring adds its own ({others})" if others else "")


def column_meanings(provenance: dict | None, columns) -> dict[str, str]:
    """What each of `columns` of a scores file means: the contract's columns, then each rule's."""
    meanings = {column: COLUMN_MEANINGS[column] for column in columns if column in COLUMN_MEANINGS}
    for record in recorded_rules(provenance or {}, columns):
        rule = REGISTRY.get(record.name)
        for column in record.columns:
            if column == record.decision:
                meanings[column] = f"{record.label} rule's decision: true = flagged noisy ({record.noisy_if})"
            elif rule is not None and column == rule.clean_probability:
                meanings[column] = f"{record.label} rule's probability that the pair is clean"
            else:
                meanings[column] = f"written by the {record.label} rule"
    return meanings


class DatasetRecord(TypedDict, total=False):
    """The dataset a scores file was made from (`data.manifest.DatasetSpec.record`, or an
    embeddings spec's): every later command opens it again from here, so none needs a shard list
    or field flags (flags still override)."""

    format: str  # the input format (`data.formats`): webdataset, img2dataset-parquet, hf-parquet, clip-retrieval ...
    sources: list[str]  # what the user named (patterns, directories, a manifest), made absolute
    pair: str
    fields: dict[str, str]  # which member or column held each side of a pair (embeddings: left, right, key)
    key: str | None  # the field the rows' `key` came from
    label_template: str | None
    split: str | None
    image_root: str | None
    name: str | None
    truth: str | None  # a dataset `corrupt` wrote names its truth file
    pairs: "DatasetRecord | None"  # scores from embeddings: the dataset of pairs they describe, when known


def scored_pairs(provenance: "Provenance | None") -> DatasetRecord | None:
    """The dataset of pairs a scores file describes: the one it scored, or, for scores made from
    precomputed embeddings, the pairs the embeddings' layout names (DataComp's shards); None
    when the file does not say (an older file, or embeddings without a link to their pairs)."""
    dataset = (provenance or {}).get("dataset")
    if not isinstance(dataset, dict):
        return None
    return dataset.get("pairs") if from_embeddings(provenance) else dataset


def from_embeddings(provenance: "Provenance | None") -> bool:
    """Scores made from precomputed embeddings: their rows are (embedding file, row), so they meet
    the pairs' shards by key, never by (shard, index)."""
    return ((provenance or {}).get("estimator") or {}).get("backend") == "precomputed-embeddings"


class Provenance(TypedDict, total=False):
    """How a scores file was made (producers add their own entries, e.g. `renormalised`)."""

    estimator: dict
    pair: str
    seed: int
    input_shards: list[str]
    dataset: DatasetRecord | None
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


def is_scores_file(path: str | Path) -> bool:
    """A Parquet file `pairclean score` wrote (it carries a provenance)."""
    try:
        return str(path).endswith(".parquet") and Path(path).is_file() and read_metadata(path)[0] is not None
    except Exception:  # noqa: BLE001 - any file a user names: one that pyarrow cannot read is not a scores file
        return False


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


def written_by(path: Path) -> WrittenBy | None:
    """The run a pairclean output (scores, dedup) records in its footer; None for any other file."""
    try:
        provenance = read_provenance(path)
    except (ValueError, OSError):  # not Parquet, or no pairclean provenance
        return None
    return WrittenBy(provenance.get("run_id"), provenance.get("settings_sha1")) if provenance else None


# How a resumable run (`runs.open_run`) reads back the outputs written with this footer.
READ_BACK = ReadBack(written_by, read_summary, run_manifest_path)
