"""The scores file contract: its columns, the metadata keys, and the provenance and summary records.

A scores file is one Parquet file: the base columns, then each decision rule's columns in rule
order, then `error`. Its schema metadata holds the provenance (how the scores were made, written
first); its file metadata holds the run summary (counts, added at close), which the run manifest
`OUT.run.json` beside it repeats. Everything that reads a scores file goes through here (or through
`scores.db.ScoresDB`, which reads both once for the commands that query the file). Both are
records (`ops.records`): read back as strictly as a flag, so an edited or foreign file is one line
naming the field, never a number taken on trust.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.config import COSINE, COSINE_STD, COUNT, setting
from pairclean.core.mixture import FittedMixture
from pairclean.data.spec import PAIR_KINDS
from pairclean.data.record import DatasetRecord
from pairclean.errors import UserError
from pairclean.ops.atomic import write_json
from pairclean.ops.places import RemotePath, is_remote
from pairclean.ops.records import Json, JsonObject, Keyed, Record
from pairclean.runs.store import ReadBack, WrittenBy
from pairclean.scorefile.rules import DEFAULT_RULES, REGISTRY, DecisionRule, RuleRecord, recorded_rules

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


def column_meanings(provenance: "Provenance | None", columns) -> Keyed[str, str]:
    """What each of `columns` of a scores file means: the contract's columns, then each rule's."""
    meanings = {column: COLUMN_MEANINGS[column] for column in columns if column in COLUMN_MEANINGS}
    for record in recorded_rules(provenance, columns):
        rule = REGISTRY.get(record.name)
        for column in record.columns:
            if column == record.decision:
                meanings[column] = f"{record.label} rule's decision: true = flagged noisy ({record.noisy_if})"
            elif rule is not None and column == rule.clean_probability:
                meanings[column] = f"{record.label} rule's probability that the pair is clean"
            else:
                meanings[column] = f"written by the {record.label} rule"
    return meanings


def scored_pairs(provenance: "Provenance | None") -> DatasetRecord | None:
    """The dataset of pairs a scores file describes: the one it scored, or, for scores made from
    precomputed embeddings, the pairs the embeddings' layout names (DataComp's shards); None
    when the file does not say (an older file, or embeddings without a link to their pairs)."""
    dataset = provenance.dataset if provenance is not None else None
    if dataset is None:
        return None
    return dataset.pairs if from_embeddings(provenance) else dataset


def from_embeddings(provenance: "Provenance | None") -> bool:
    """Scores made from precomputed embeddings: their rows are (embedding file, row), so they meet
    the pairs' shards by key, never by (shard, index)."""
    return provenance is not None and (provenance.estimator or {}).get("backend") == "precomputed-embeddings"


@dataclass(frozen=True)
class Renormalised(Record):
    """Scores from embeddings: the vectors that were not unit length, and the largest deviation."""

    what = "record of renormalised vectors"
    left: int
    right: int
    max_norm_deviation: float


@dataclass(frozen=True)
class Provenance(Record):
    """How a scores file was made: written first, in the file's schema metadata. Every field is
    optional, as files from before a field existed lack it; what a producer or a rule adds is a
    field here (a rule's `provenance()` entries name fields of this class)."""

    what = "scores provenance"
    estimator: dict[str, Json] | None = None  # the backend's own `provenance()` (open: each backend names its own)
    pair: str | None = None
    seed: int | None = None
    input_shards: list[str] | None = None
    dataset: DatasetRecord | None = None
    renormalised: Renormalised | None = None  # scores from embeddings
    world_size: int | None = None
    units_by_rank: dict[str, int] | None = None  # units this run scored, by the torchrun rank that claimed them
    engine: str | None = None  # where the units were scored: local (this process or torchrun ranks) or ray
    units_by_node: dict[str, int] | None = None  # units this run scored, by the Ray node that scored them
    workers_lost: int | None = None  # ray: workers lost mid-run (their groups were handed to others)
    pairclean_version: str | None = None
    beta: float | None = setting(None, COSINE)
    beta_std: float | None = setting(None, COSINE_STD)
    beta_k: int | None = setting(None, COUNT)
    beta_mode: str | None = None
    beta_source: str | None = None
    weight_fn: str | None = None
    official_scale: float | None = None
    gmm: FittedMixture | None = None  # the GMM rule's fitted mixture
    gmm_sample: int | None = None  # similarities in the sample the rules were fitted on
    null_sample: int | None = None  # null similarities (in-data pairs that do not belong together) the rules were given
    null_quantiles: list[float] | None = None  # their quantiles at 0, 0.1%, ..., 100% (the threshold sweep reads them)
    rules: list[RuleRecord] | None = None  # one entry per rule in column order (None: a file from before)
    run_id: str | None = None
    settings_sha1: str | None = None
    finished_at: str | None = None

    def problems(self):
        if self.pair is not None and self.pair not in PAIR_KINDS:
            yield "pair", f"must be one of {', '.join(PAIR_KINDS)}, got {self.pair!r}"


@dataclass(frozen=True)
class FailedUnit(Record):
    """A unit that broke (truncated tar, vanished shard ...): why, and the rows it gave before."""

    what = "failed unit"
    unit: str
    reason: str
    rows: int


@dataclass(frozen=True)
class ErrorCount(Record):
    what = "error count"
    error: str
    rows: int


@dataclass(frozen=True)
class RuleCount(Record):
    """What one rule flagged, and the measurements of its own it reports (`notes`: each rule
    names its own, so they are an open map, kept beside the other keys on disk)."""

    what = "rule summary"
    name: str
    label: str
    decision: str
    noisy_if: str
    flagged: int
    share_flagged: float
    abstains: str | None = None
    notes: dict[str, Json] = field(default_factory=dict)

    @classmethod
    def upgraded(cls, value: dict) -> JsonObject:
        known = {f.name for f in fields(cls)} - {"notes"}
        return {**{k: v for k, v in value.items() if k in known},
                "notes": {k: v for k, v in value.items() if k not in known}}

    def to_json(self) -> JsonObject:
        written = super().to_json()
        return {**{k: v for k, v in written.items() if k != "notes"}, **written.get("notes", {})}


FLAGGED, SHARE_FLAGGED = "flagged_", "share_flagged_"  # the summary keys flagged_NAME, share_flagged_NAME


@dataclass(frozen=True)
class Summary(Record):
    """The run summary: added at close, in the file's key-value metadata, and in the run manifest."""

    what = "run summary"
    pairs: int  # = scored + errors
    errors: int
    scored: int | None = None
    unit_failures: list[FailedUnit] = field(default_factory=list)
    failed_units: int | None = None
    units: int | None = None
    beta: float | None = setting(None, COSINE)
    beta_std: float | None = setting(None, COSINE_STD)
    beta_k: int | None = setting(None, COUNT)
    beta_mode: str | None = None
    random_pairing_share: float | None = None  # share of pairs that look like random pairings (not all noise)
    random_pairing_share_low: float | None = None  # its 95% interval
    random_pairing_share_high: float | None = None
    rules: list[RuleCount] = field(default_factory=list)
    flagged: dict[str, int] = field(default_factory=dict)  # on disk: flagged_NAME for every rule NAME
    share_flagged: dict[str, float] = field(default_factory=dict)  # on disk: share_flagged_NAME
    # added by the scoring run after finalize
    pairs_per_second: float | None = None
    scoring_seconds: float | None = None
    scoring_cpu_seconds: float | None = None
    beta_seconds: float | None = None
    beta_source: str | None = None
    # the model producer's batches and the DataLoader workers it started (all processes), and what it saved (`save_embeddings`)
    batches: int | None = None
    workers: int | None = None
    full_batches: int | None = None
    mean_batch_fill: float | None = None
    embeddings_saved: int | None = None
    embedding_bytes: int | None = None
    embeddings_dir: str | None = None
    # the embeddings producer: vectors that were not unit length
    not_unit_left: int | None = None
    not_unit_right: int | None = None
    # a run that gave no scores file (its run manifest only)
    failed: str | None = None
    error_reasons: list[ErrorCount] | None = None

    @classmethod
    def upgraded(cls, value: dict) -> JsonObject:
        """`flagged_NAME` / `share_flagged_NAME` keys into the two maps."""
        flat = {k: v for k, v in value.items() if not k.startswith((FLAGGED, SHARE_FLAGGED))}
        flat.setdefault("flagged", {k[len(FLAGGED):]: v for k, v in value.items() if k.startswith(FLAGGED)})
        flat.setdefault("share_flagged", {k[len(SHARE_FLAGGED):]: v for k, v in value.items()
                                          if k.startswith(SHARE_FLAGGED)})
        return flat

    def to_json(self) -> JsonObject:
        written = super().to_json()
        flagged, share = written.pop("flagged", {}), written.pop("share_flagged", {})
        return {**written, **{FLAGGED + k: v for k, v in flagged.items()},
                **{SHARE_FLAGGED + k: v for k, v in share.items()}}


def flagged_summary(records: list[RuleRecord], flagged: dict[str, int], scored: int) -> Keyed:
    """The summary's per-rule entries (`Summary` fields): flagged counts and shares among the scored pairs."""
    share = {name: count / scored if scored else 0.0 for name, count in flagged.items()}
    return {"rules": [RuleCount(name=r.name, label=r.label, decision=r.decision, noisy_if=r.noisy_if,
                                abstains=r.abstains, flagged=flagged[r.name], share_flagged=share[r.name],
                                notes=dict(r.notes)) for r in records],
            "flagged": dict(flagged), "share_flagged": share}


def run_manifest_path(out: Path | RemotePath) -> Path | RemotePath:
    return out.with_name(out.stem + ".run.json")


def provenance_metadata(provenance: Record) -> Keyed[bytes, bytes]:
    """The schema metadata holding a provenance (a scores file's, or another output's: dedup's)."""
    return {METADATA_KEY: provenance.dumps().encode()}


def summary_metadata(summary: Record) -> Keyed[bytes, bytes]:
    return {SUMMARY_KEY: summary.dumps().encode()}


def write_run_manifest(out: Path, summary: Record, provenance: Record, temp_dir: Path | None = None,
                       written: bool = True) -> None:
    """OUT.run.json: the summary and provenance beside the output (`written` False: the run gave none)."""
    write_json(run_manifest_path(out), {"output": str(out) if written else None, "summary": summary.to_json(),
                                        "provenance": provenance.to_json()}, temp_dir=temp_dir)


def _metadata(scores: str | Path | RemotePath | pa.Table) -> tuple[Keyed, Keyed]:
    if isinstance(scores, pa.Table):  # `pairclean.score_embeddings`' table: both in its schema's metadata
        return scores.schema.metadata or {}, scores.schema.metadata or {}
    if isinstance(scores, RemotePath):
        with scores.open() as fh:
            meta = pq.read_metadata(fh)
    else:
        meta = pq.read_metadata(scores)
    return meta.schema.to_arrow_schema().metadata or {}, meta.metadata or {}  # schema metadata: written first


def _kind(raw) -> str | None:
    """The kind of output a provenance's JSON names (`kind`: dedup's output; None: a scores file)."""
    return raw.get("kind") if isinstance(raw, dict) else None


def _named(scores: str | Path | pa.Table) -> str | Path:
    """How messages name where the records were read from."""
    return "the scored table" if isinstance(scores, pa.Table) else scores


def read_metadata(scores: str | Path | pa.Table, provenance_type: type[Record] = Provenance,
                  summary_type: type[Record] = Summary) -> tuple:
    """The provenance and the summary of a scores file (or of another output pairclean writes the
    same way: dedup's, with its own records; or of the table `pairclean.score_embeddings` returns)
    from one read of its footer, each checked as strictly as a flag (a `RecordError` naming the
    file and the field); None where absent (a Parquet file not written by `pairclean score`, or an
    output of another kind)."""
    schema, added = _metadata(scores)  # file key-value metadata, added at close
    scores = _named(scores)
    raw = provenance_type.parse(schema[METADATA_KEY], scores) if METADATA_KEY in schema else None
    if raw is None or _kind(raw) != getattr(provenance_type, "kind_written", None):
        return None, None
    summary = None
    if SUMMARY_KEY in added:
        summary = summary_type.from_json(summary_type.parse(added[SUMMARY_KEY], scores), scores)
    return provenance_type.from_json(raw, scores), summary


def recorded_inputs(scores: str | Path) -> list[str]:
    """The scores file and the files of the dataset it recorded: what an output of a command that
    reads the scores alone (query, evaluate) must stay apart from (`ops.guard.open_output`), as
    the commands that open the dataset again keep theirs apart from `Dataset.input_paths`."""
    if not Path(scores).is_file():
        return [str(scores)]  # the command's reading names what is missing
    provenance = read_metadata(scores)[0]
    dataset = provenance.dataset if provenance is not None else None
    return [str(scores), *(dataset.input_paths() if dataset is not None else [])]


def run_identity(out: str | Path) -> tuple[str | None, str | None]:
    """(run id, settings digest) of an output a pairclean run wrote (scores or dedup), or (None,
    None): what tells a finished run's output from another (`runs.store.PartStore.finished`)."""
    try:
        raw = json.loads(_metadata(out)[0].get(METADATA_KEY, b"null"))
    except Exception:  # not Parquet, or not written by pairclean
        return None, None
    if not isinstance(raw, dict):
        return None, None
    run_id, digest = raw.get("run_id"), raw.get("settings_sha1")
    return (run_id if isinstance(run_id, str) else None), (digest if isinstance(digest, str) else None)



def written_by(out: Path) -> WrittenBy | None:
    """The run a pairclean output (scores, dedup) records in its footer; None for any other file."""
    run_id, digest = run_identity(out)
    return None if run_id is None and digest is None else WrittenBy(run_id, digest)


# How a resumable run (`runs.open_run`) reads back the outputs written with this footer.
READ_BACK = ReadBack(written_by, run_manifest_path)

def path_is_file(path: str | Path | RemotePath) -> bool:
    return path.is_file() if isinstance(path, RemotePath) else Path(path).is_file()


def is_scores_file(path: str | Path) -> bool:
    """A Parquet file `pairclean score` wrote (it carries a provenance; whether that is valid is
    checked when it is read)."""
    try:
        if is_remote(path):
            path = path if isinstance(path, RemotePath) else RemotePath(str(path))
        if not (str(path).endswith(".parquet") and path_is_file(path)):
            return False
        raw = _metadata(path)[0].get(METADATA_KEY)
        return raw is not None and _kind(json.loads(raw)) is None
    except Exception:  # noqa: BLE001 - any file a user names: one that pyarrow or JSON cannot read is not one
        return False


def read_provenance(scores: str | Path | pa.Table) -> Provenance:
    """The provenance stored in a scores file's Parquet key-value metadata (or in the table
    `pairclean.score_embeddings` returns)."""
    provenance = read_metadata(scores)[0]
    if provenance is None:
        raise UserError(f"{_named(scores)} has no pairclean provenance (not written by pairclean score?)")
    return provenance


def read_summary(scores: str | Path | pa.Table) -> Summary:
    """The run summary stored in a scores file (the same one its run manifest holds), or in the
    table `pairclean.score_embeddings` returns."""
    summary = read_metadata(scores)[1]
    if summary is None:
        raise UserError(f"{_named(scores)} has no pairclean summary (not written by pairclean score?)")
    return summary
