"""`pairclean dedup`: semantic deduplication of saved embeddings (the SemDeDup recipe), keeping from
each group of duplicates the pair whose caption matches its image best.

SemDeDup (Abbas et al. 2023; facebookresearch/SemDeDup) clusters the embeddings with spherical
k-means, compares every pair inside a cluster by cosine, and removes a member whose cosine to an
earlier member of its cluster exceeds 1 - eps; "earlier" is an order of its choice (by default
the member farthest from the centroid first, `which_to_keep: hard`), so that order decides which
copy survives. Here the order is by default the scores file's `sim_debiased`, highest first
(`keep cleanest`): of a group of copies the one whose caption fits its image best is kept, and a
copy that carries a wrong caption is the one removed. `keep semdedup` is SemDeDup's own order,
`keep random` a seeded arbitrary one.

The run, in stages, each committed in the run's parts directory (`OUT.parts/`: the resumable run
of `runs.open_run`, with its pinned settings, lock, parts and commit records), so a killed run
resumes where it stopped and ends with the rows an uninterrupted run writes:

1. k-means (rank 0): a uniform sample of `clusters` x `sample_per_cluster` rows -> centroids.npy;
2. assignment: each unit of rows streamed through the embeddings reader, every vector given its
   nearest centroid -> one part per unit (row, key, shard, index, cluster, centroid_sim);
3. index (rank 0): DuckDB sorts the usable rows by cluster and keep order (joining the scores'
   sim_debiased for `cleanest`) and cuts them into groups of whole clusters -> clusters/*.parquet;
4. clusters: each group of clusters, cluster by cluster, through `pairwise.cluster_duplicates` ->
   one part per group (row, group_id, group_size, kept, nearest_row, nearest_sim);
5. finalize (rank 0): the two kinds of parts joined back in input order into OUT.

Units (stage 2) and groups (stage 4) are claimed one at a time by whichever torchrun rank is free
(`GroupClaims`). Memory is bounded by a batch of rows, a block pair of a cluster, and DuckDB's
`memory_limit` (its sorts and joins spill to disk), never by the number of rows.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pairclean import __version__
from pairclean.dedup.defaults import DEFAULT_THRESHOLD
from pairclean.config import COUNT, SEED, at_least, check_choice, check_settings, pinned_settings, setting, unpinned, within
from pairclean.data.embeddings import EmbeddingSource, open_embeddings
from pairclean.data.units import Unit, unit_shard
from pairclean.dedup.kmeans import BACKENDS, nearest_centroid, resolve_backend, train_kmeans
from pairclean.dedup.pairwise import cluster_duplicates
from pairclean.dedup.vectors import SIDES, Vectors, joined
from pairclean.errors import ConfigError, UserError
from pairclean.ops import distributed
from pairclean.ops.atomic import atomic_path
from pairclean.ops.places import readable
from pairclean.ops.faults import fault_point
from pairclean.ops.guard import Output
from pairclean.ops.notices import notice
from pairclean.ops.progress import SILENT, Progress
from pairclean.ops.worker_memory import give_back_freed_memory
from pairclean.data.record import DatasetRecord, check_same_dataset
from pairclean.ops.records import Record
from pairclean.scorefile.contract import (READ_BACK, provenance_metadata, read_metadata, scored_pairs, summary_metadata,
                                       write_run_manifest)
from pairclean.scorefile.sql import duckdb_message, sandboxed_connection, sql_string
from pairclean.runs import CommitRecord, GroupClaims, PartStore, Run, by_rank, open_run

KEEP_ORDERS = ("cleanest", "semdedup", "random")
DUCKDB_MEMORY = "512MB"  # the index and finalize queries spill above this, with one DuckDB thread. At
# 256MB the index's sort, joined with a 10M-row scores file, ran out of memory (DuckDB could not
# spill the join's build side); at 512MB it took 611 MiB and 4.4 s (docs/dedup.md, "Scale").
SCORE_COLUMN = "sim_debiased"
CLUSTERS_UNIT = "clusters#"  # stage-4 parts are named clusters#N (N: the group)
CROWDED = 0.5  # removing more than this share of the rows is worth a warning

ASSIGN_SCHEMA = pa.schema([("row", pa.int64()), ("key", pa.string()), ("shard", pa.string()), ("index", pa.int64()),
                           ("cluster", pa.int32()), ("centroid_sim", pa.float32())])
CLUSTER_SCHEMA = pa.schema([("row", pa.int64()), ("group_id", pa.int64()), ("group_size", pa.int32()),
                            ("kept", pa.bool_()), ("nearest_row", pa.int64()), ("nearest_sim", pa.float32())])
DEDUP_SCHEMA = pa.schema([
    ("key", pa.string()), ("shard", pa.string()), ("index", pa.int64()),
    ("cluster", pa.int32()),  # the k-means cluster (null: no usable vector, never a duplicate)
    ("group_id", pa.int64()),  # a kept row and the rows removed as its duplicates share it (null: no duplicate)
    ("group_size", pa.int32()),  # 1 for a row without duplicates
    ("kept", pa.bool_()),  # false: a duplicate of a pair that comes first in keep order
    ("nearest_key", pa.string()), ("nearest_shard", pa.string()), ("nearest_index", pa.int64()),
    ("nearest_sim", pa.float32()),  # the most similar other member of its cluster, duplicate or not
])


@dataclass
class DedupConfig:
    side: str = "image"  # image (left vectors), text (right vectors), or both (each side above the threshold)
    # duplicates: cosine > threshold (SemDeDup: > 1 - eps); a cosine, below 1 (nothing is above 1)
    threshold: float = setting(DEFAULT_THRESHOLD, within(-1, 1, high_open=True))
    keep: str = "cleanest"  # cleanest (highest sim_debiased), semdedup (farthest from the centroid), random
    clusters: int | None = setting(None, COUNT)  # k-means clusters; None: ceil(sqrt(usable rows))
    sample_per_cluster: int = setting(40, COUNT)  # k-means is trained on clusters x this many rows (faiss warns below 39)
    iterations: int = setting(20, COUNT)  # k-means iterations (faiss's default is 25; SemDeDup ran 100 on GPUs)
    seed: int = setting(0, SEED)
    backend: str = "auto"  # auto (faiss if installed), faiss, torch
    block_rows: int = setting(4096, COUNT)  # members compared per block: a block x block matrix of float32
    group_rows: int = setting(65536, COUNT)  # a group (claimed by one rank, committed as one part) holds at least this many rows
    unit_rows: int = setting(1 << 18, COUNT)  # rows per assignment unit (the grain of its resume)
    batch_rows: int = setting(16384, COUNT, pinned=False)  # rows read at a time while assigning
    threads: int = setting(0, at_least(0), pinned=False)  # torch intra-op threads during the run (0: leave torch's setting)
    overwrite: bool = unpinned(False)
    resume: bool = unpinned(False)
    allow_other_dataset: bool = unpinned(False)  # use scores recording another dataset than the embeddings' anyway
    progress: Progress = unpinned(SILENT)

    def __post_init__(self):
        check_settings(self)
        check_choice(self.side, SIDES, "side")
        check_choice(self.keep, KEEP_ORDERS, "keep", "keep order")
        check_choice(self.backend, BACKENDS, "backend", "k-means backend")


@dataclass(frozen=True)
class DedupUnit(CommitRecord):
    """A dedup part's commit record: which stage committed it, the rows with a cluster (assign), the
    rows removed (clusters)."""

    stage: str = "assign"
    usable: int | None = None
    removed: int | None = None


@dataclass(frozen=True)
class KMeansRecord(Record):
    """Stage 1's record (`kmeans.json`, and the output's provenance): how the centroids were trained."""

    what = "k-means record"
    clusters: int
    sample: int
    iterations: int
    backend: str
    seconds: float


@dataclass(frozen=True)
class ClusterGroup(Record):
    what = "group of clusters"
    first: int
    last: int
    rows: int


@dataclass(frozen=True)
class IndexRecord(Record):
    """Stage 3's record (`index.json`): the groups of whole clusters and how the scores were joined."""

    what = "dedup index record"
    groups: list[ClusterGroup]
    scores_join: str | None
    scored_rows: int
    clusters_used: int


@dataclass(frozen=True)
class DedupProvenance(Record):
    """How a dedup output was made (its schema metadata; `kind` tells it from a scores file's)."""

    what = "dedup provenance"
    kind_written: ClassVar[str] = "dedup"
    kind: str
    pairclean_version: str | None = None
    input: list[str] | None = None
    layout: str | None = None
    embeddings: DatasetRecord | None = None
    embedding_dim: int | None = None
    side: str | None = None
    threshold: float | None = None
    eps: float | None = None
    keep: str | None = None
    scores: str | None = None
    seed: int | None = None
    backend: str | None = None
    kmeans: KMeansRecord | None = None
    scores_join: str | None = None
    world_size: int | None = None
    work_by_rank: dict[str, dict[str, int]] | None = None
    run_id: str | None = None
    settings_sha1: str | None = None
    finished_at: str | None = None


@dataclass(frozen=True)
class DedupSummary(Record):
    what = "dedup summary"
    rows: int
    usable: int
    in_groups: int
    removed: int
    duplicate_groups: int
    kept: int
    share_removed: float
    clusters: int
    scores_join: str | None = None
    scored_rows: int | None = None
    groups_of_clusters: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)


def read_dedup_metadata(path: str | Path) -> tuple[DedupProvenance | None, DedupSummary | None]:
    """The provenance and summary of a dedup output (None, None: not one)."""
    return read_metadata(path, DedupProvenance, DedupSummary)


@dataclass
class DedupResult:
    out: Path
    summary: DedupSummary | None  # None on the ranks other than 0
    seconds: float
    resumed: bool
    already_complete: bool = False


# -- the run -------------------------------------------------------------------------------------


def dedup(source: str | list[str] | EmbeddingSource, out: str | Path | Output, scores: str | Path | None = None,
          config: DedupConfig | None = None) -> DedupResult:
    """Deduplicate the embeddings `source` into `out` (Parquet, one row per input row); resumes an
    interrupted run. `scores`: the scores file whose sim_debiased decides the copy kept (`cleanest`)."""
    cfg = config or DedupConfig()
    spec = source if isinstance(source, EmbeddingSource) else open_embeddings(source)
    distributed.init_from_env(device_type="cpu")
    progress = cfg.progress if distributed.is_main() else SILENT
    named_scores = str(scores) if scores is not None else None
    # A scores file on an object store is read from a local mirror (DuckDB joins it; the mirror is pinned as it).
    scores = readable(scores) if scores is not None else None
    _check_scores(scores, cfg.keep)
    if scores is not None:  # the scores must describe the pairs these embeddings describe
        check_same_dataset(scored_pairs(read_metadata(scores)[0]), spec.pairs, f"the scores file {scores}",
                           cfg.allow_other_dataset, other="the embeddings")
    vectors = Vectors(spec, cfg.side)
    units = spec.units(cfg.unit_rows)
    backend = resolve_backend(cfg.backend)
    settings = {**pinned_settings(cfg), "backend": backend, "layout": spec.layout, "rows": vectors.rows,
                "dim": vectors.dim, "scores": _identity(scores)}
    # The output (with its parts directory and run manifest beside it) may touch no input.
    # On an object store the output is uploaded at the end; the parts stay on this machine (dedup runs on one).
    run = open_run(out, [*spec.sources, *spec.inputs(), scores], settings, units, READ_BACK, unit_shard,
                   overwrite=cfg.overwrite, resume=cfg.resume, record=DedupUnit, local_parts=True)
    out, store = run.out, run.store
    finished = distributed.on_main(run.finished)
    if finished:
        return DedupResult(out, read_dedup_metadata(out)[1], 0.0, True, already_complete=True)
    started = time.perf_counter()
    resumed = distributed.on_main(lambda: _begin(run))
    seconds = {}
    intra_op = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or intra_op)
    try:
        tick = time.perf_counter()
        kmeans = distributed.on_main(lambda: _centroids(store, vectors, cfg, backend, progress))
        centroids = np.load(store.dir / "centroids.npy")
        seconds["kmeans"] = time.perf_counter() - tick
        tick = time.perf_counter()
        _assign(run, units, vectors, centroids, backend, cfg, progress)
        distributed.barrier()
        seconds["assign"] = time.perf_counter() - tick
        tick = time.perf_counter()
        index = distributed.on_main(lambda: _index(store, units, scores, cfg, progress))
        seconds["index"] = time.perf_counter() - tick
        tick = time.perf_counter()
        _clusters(run, index, vectors, cfg, progress)
        distributed.barrier()
        seconds["clusters"] = time.perf_counter() - tick
    finally:
        vectors.close()
        torch.set_num_threads(intra_op)
    if not distributed.is_main():
        return DedupResult(out, None, time.perf_counter() - started, resumed)
    records = run.committed().values()
    provenance = DedupProvenance(
        kind=DedupProvenance.kind_written, pairclean_version=__version__, input=spec.sources, layout=spec.layout,
        embeddings=spec.record(), embedding_dim=spec.dim, side=cfg.side, threshold=cfg.threshold,
        eps=1 - cfg.threshold, keep=cfg.keep, scores=named_scores, seed=cfg.seed, backend=backend,
        kmeans=kmeans, scores_join=index.scores_join, world_size=distributed.world_size(),
        work_by_rank={stage: by_rank(r for r in records if r.stage == stage) for stage in ("assign", "clusters")})
    summary = _finalize(run, units, index, provenance, seconds, progress)
    run.close()
    if summary.share_removed > CROWDED:
        notice(f"{summary.share_removed:.0%} of the rows were removed at threshold {cfg.threshold}: in this "
               "embedding space most rows have a neighbour that close; look at the distribution of nearest_sim "
               "and raise `threshold` (docs/dedup.md)", "threshold")
    return DedupResult(out, summary, time.perf_counter() - started, resumed)


def _check_scores(scores: Path | None, keep: str) -> None:
    if scores is None:
        if keep == "cleanest":
            raise ConfigError("keep cleanest keeps the copy with the highest sim_debiased of a scores file: pass "
                              "`scores` (the Parquet `pairclean score` wrote), or choose `keep` semdedup or random",
                              "scores", "keep")
        return
    if not scores.is_file():
        raise UserError(f"scores file not found: {scores}")
    try:
        names = pq.read_schema(scores).names
    except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
        raise UserError(f"cannot read {scores} as Parquet: {str(exc).splitlines()[0][:200]}") from None
    missing = [c for c in ("key", "shard", "index", SCORE_COLUMN) if c not in names]
    if missing:
        raise UserError(f"{scores} is not a pairclean scores file (no column {', '.join(missing)})")


def _identity(path: Path | None) -> dict | None:
    """What pins a file to a run: a scores file replaced between a kill and the re-run is refused."""
    if path is None:
        return None
    info = os.stat(path)
    return {"path": os.path.realpath(path), "size": info.st_size, "mtime_ns": info.st_mtime_ns}


def _begin(run: Run) -> bool:
    """Rank 0: start or resume the run; the claims of a dead run are cleared while the lock is held."""
    started = run.begin()
    for stage in ("assign", "clusters"):
        run.claims(f"claims-{stage}")
    return started.resumed


# -- stage 1: k-means on a sample -------------------------------------------------------------


def _centroids(store: PartStore, vectors: Vectors, cfg: DedupConfig, backend: str,
               progress: Progress) -> KMeansRecord:
    record = store.dir / "kmeans.json"
    if record.is_file() and (store.dir / "centroids.npy").is_file():
        return KMeansRecord.read(record)
    began = time.perf_counter()
    n = vectors.rows
    k = cfg.clusters or max(1, math.ceil(math.sqrt(n)))
    size = min(n, k * cfg.sample_per_cluster)
    rng = np.random.default_rng([cfg.seed, 1])
    positions = np.sort(rng.choice(n, size=size, replace=False)) if size else np.empty(0, np.int64)
    progress.note(f"k-means: {k:,} clusters on a sample of {size:,} of {n:,} rows ({backend})")
    sides, usable = vectors.read(positions)
    sample = joined(sides)[usable]
    if len(sample) == 0:
        raise UserError(f"no usable vector in the sample of {size:,} rows: every one is zero or not finite")
    k = min(k, len(sample))
    centroids = train_kmeans(sample, k, cfg.iterations, cfg.seed, backend)
    with atomic_path(store.dir / "centroids.npy", temp_dir=store.dir) as tmp:
        with open(tmp, "wb") as fh:
            np.save(fh, centroids)
    info = KMeansRecord(clusters=k, sample=int(len(sample)), iterations=cfg.iterations, backend=backend,
                        seconds=round(time.perf_counter() - began, 3))
    store.write_record(record.name, info.to_json())
    return info


# -- stage 2: every vector's nearest centroid -------------------------------------------------


def _assign(run: Run, units: list[str], vectors: Vectors, centroids: np.ndarray, backend: str,
            cfg: DedupConfig, progress: Progress) -> None:
    done = set(run.committed())
    claims = GroupClaims(run.store.dir / "claims-assign")
    began, rows = time.perf_counter(), 0
    with progress.task("assigning", total=len(units), completed=sum(u in done for u in units), pairs=0) as task:
        for number, unit in enumerate(units):
            if unit in done or not claims.claim(number):
                continue
            table = _assign_unit(unit, vectors, centroids, backend, cfg.batch_rows)
            run.commit(unit, table, {"stage": "assign", "usable": table.num_rows - table.column("cluster").null_count})
            rows += table.num_rows
            elapsed = time.perf_counter() - began
            task.update(advance=1, pairs=rows, rate=rows / elapsed if elapsed else 0.0)


def _assign_unit(unit: str, vectors: Vectors, centroids: np.ndarray, backend: str, batch_rows: int) -> pa.Table:
    first = vectors.unit_start(Unit.parse(unit).path, 0)
    tables = []
    for batch in vectors.spec.batches(unit, batch_rows):
        keys, shards, index = batch.identity()
        sides, usable = vectors.batch(batch)
        labels, sims = nearest_centroid(joined(sides)[usable], centroids, backend)
        cluster = np.zeros(len(usable), np.int32)
        sim = np.zeros(len(usable), np.float32)
        cluster[usable], sim[usable] = labels, sims
        tables.append(pa.table({
            "row": pa.array(first + batch.index, pa.int64()), "key": keys, "shard": shards,
            "index": pa.array(index, pa.int64()), "cluster": pa.array(cluster, pa.int32(), mask=~usable),
            "centroid_sim": pa.array(sim, pa.float32(), mask=~usable)}, schema=ASSIGN_SCHEMA))
        give_back_freed_memory()  # else the freed batch buffers stay in the heap (docs/dedup.md: memory)
    return pa.concat_tables(tables) if tables else ASSIGN_SCHEMA.empty_table()


# -- stage 3: rows in cluster and keep order, cut into groups of whole clusters ----------------


ORDERS = {  # keep order inside a cluster: the first of a group of duplicates is kept
    "cleanest": f's."{SCORE_COLUMN}" DESC NULLS LAST, a.row',
    "semdedup": "a.centroid_sim ASC, a.row",  # SemDeDup's `hard`: the farthest from the centroid first
    "random": "md5(concat(?, ':', a.row)), a.row",
}


def _scores_join(con, scores: Path | None) -> tuple[str | None, str]:
    """How the rows meet the scores file: on (shard, index), then on (shard file name, index, key)
    (the files moved; clip-retrieval's file names repeat across outputs, so the key must agree
    too), then on key, the first that matches a row and is unique on the scores' side."""
    if scores is None:
        return None, "FALSE"
    candidates = [("shard, index", 'a.shard = s.shard AND a."index" = s."index"', 'shard, "index"'),
                  ("shard file name, index, key", 'parse_filename(a.shard) = parse_filename(s.shard) AND '
                   'a."index" = s."index" AND a.key = s.key', 'parse_filename(shard), "index", key'),
                  ("key", "a.key = s.key", "key")]
    for label, condition, ident in candidates:
        repeated = con.execute(f"SELECT count(*) - count(DISTINCT ({ident})) FROM s").fetchall()[0][0]
        if repeated:
            continue
        if con.execute(f"SELECT count(*) FROM a JOIN s ON {condition}").fetchall()[0][0]:
            return label, condition
    raise UserError(f"no row of the embeddings matches a pair of {scores} (by shard and index, shard file name, "
                    "index and key, or a unique key): give the scores of these embeddings")


def _index(store: PartStore, units: list[str], scores: Path | None, cfg: DedupConfig,
           progress: Progress) -> IndexRecord:
    record = store.dir / "index.json"
    if record.is_file():
        return IndexRecord.read(record)
    progress.note("sorting the rows by cluster and keep order")
    parts = [str(store.part_path(u)) for u in units]
    spill = Path(tempfile.mkdtemp(prefix="pairclean-dedup-", dir=store.dir))
    con = sandboxed_connection(spill, files=[scores] if scores else [], directories=[store.dir],
                               memory_limit=DUCKDB_MEMORY, threads=1)
    try:
        con.execute(f"CREATE VIEW a AS SELECT * FROM read_parquet([{', '.join(map(sql_string, parts))}])")
        if scores is not None:
            con.execute(f"CREATE VIEW s AS SELECT key, shard, \"index\", \"{SCORE_COLUMN}\" "
                        f"FROM read_parquet({sql_string(scores)})")
        join, condition = _scores_join(con, scores)
        scored = (con.execute(f"SELECT count(*) FROM a JOIN s ON {condition} WHERE s.\"{SCORE_COLUMN}\" IS NOT NULL")
                  .fetchall()[0][0] if scores is not None else 0)
        counts = con.execute("SELECT cluster, count(*) FROM a WHERE cluster IS NOT NULL GROUP BY cluster "
                             "ORDER BY cluster").fetchall()
        groups = _pack_clusters(counts, cfg.group_rows)
        source = f"a LEFT JOIN s ON {condition}" if scores is not None else "a"
        params = [str(cfg.seed)] if cfg.keep == "random" else []
        reader = con.sql(f"SELECT a.cluster, a.row FROM {source} WHERE a.cluster IS NOT NULL "
                             f"ORDER BY a.cluster, {ORDERS[cfg.keep]}", params=params).to_arrow_reader(65536)
        (store.dir / "clusters").mkdir(exist_ok=True)
        _write_groups(store, groups, reader)
    except duckdb.Error as exc:
        raise UserError(f"dedup could not sort the rows: {duckdb_message(exc)}") from None
    finally:
        con.close()
        shutil.rmtree(spill, ignore_errors=True)
    index = IndexRecord(groups=groups, scores_join=join, scored_rows=int(scored), clusters_used=len(counts))
    store.write_record(record.name, index.to_json())  # last: the stage is done
    return index


def _pack_clusters(counts: list[tuple[int, int]], group_rows: int) -> list[ClusterGroup]:
    """Consecutive clusters in groups of at least `group_rows` rows (the last may hold fewer)."""
    groups, current = [], None
    for cluster, n in counts:
        if current is None:
            current = ClusterGroup(first=int(cluster), last=int(cluster), rows=0)
        current = replace(current, last=int(cluster), rows=current.rows + int(n))
        if current.rows >= group_rows:
            groups.append(current)
            current = None
    if current is not None:
        groups.append(current)
    return groups


def _group_path(store: PartStore, number: int) -> Path:
    return store.dir / "clusters" / f"group-{number:06d}.parquet"


def _write_groups(store: PartStore, groups: list[ClusterGroup], reader: pa.RecordBatchReader) -> None:
    """The sorted (cluster, row) stream split into one file per group, written as it comes."""
    schema = pa.schema([("cluster", pa.int32()), ("row", pa.int64())])
    pending: list[pa.RecordBatch] = []
    batches = iter(reader)
    for number, group in enumerate(groups):
        with atomic_path(_group_path(store, number), temp_dir=store.dir) as tmp:
            with pq.ParquetWriter(tmp, schema) as writer:
                written = 0
                while written < group.rows:
                    batch = pending.pop() if pending else next(batches)
                    take = min(batch.num_rows, group.rows - written)
                    writer.write_batch(pa.RecordBatch.from_arrays(
                        [batch.column(0).cast(pa.int32()).slice(0, take), batch.column(1).slice(0, take)],
                        schema=schema))
                    written += take
                    if take < batch.num_rows:
                        pending.append(batch.slice(take))


# -- stage 4: duplicates inside each cluster --------------------------------------------------


def _clusters(run: Run, index: IndexRecord, vectors: Vectors, cfg: DedupConfig, progress: Progress) -> None:
    done = set(run.committed())
    claims = GroupClaims(run.store.dir / "claims-clusters")
    groups = index.groups
    names = [f"{CLUSTERS_UNIT}{g}" for g in range(len(groups))]
    began, rows = time.perf_counter(), 0
    with progress.task("clusters", total=len(groups), completed=sum(n in done for n in names), pairs=0) as task:
        for number, name in enumerate(names):
            if name in done or not claims.claim(number):
                continue
            table = _cluster_group(pq.read_table(_group_path(run.store, number)), vectors, cfg)
            give_back_freed_memory()
            run.commit(name, table, {"stage": "clusters", "removed": table.num_rows - _count_true(table.column("kept"))},
                       fingerprint=False)
            rows += table.num_rows
            elapsed = time.perf_counter() - began
            task.update(advance=1, pairs=rows, rate=rows / elapsed if elapsed else 0.0)


def _count_true(column: pa.ChunkedArray) -> int:
    return int(np.count_nonzero(column.to_numpy(zero_copy_only=False)))


def _cluster_group(group: pa.Table, vectors: Vectors, cfg: DedupConfig) -> pa.Table:
    clusters = group.column("cluster").to_numpy()
    rows = group.column("row").to_numpy()
    bounds = np.flatnonzero(np.diff(clusters)) + 1
    out = {name: [] for name in CLUSTER_SCHEMA.names}
    for a, b in zip(np.concatenate([[0], bounds]), np.concatenate([bounds, [len(rows)]])):
        members = rows[a:b]
        found = cluster_duplicates(lambda i, j: vectors.read(members[i:j])[0], len(members), cfg.threshold,
                                   cfg.block_rows)
        size = np.bincount(found.root, minlength=len(members))[found.root]
        out["row"].append(members)
        out["group_id"].append(np.where(size > 1, members[found.root], -1))  # named after its kept member
        out["group_size"].append(size.astype(np.int32))
        out["kept"].append(~found.removed)
        out["nearest_row"].append(np.where(found.nearest >= 0, members[np.maximum(found.nearest, 0)], -1))
        out["nearest_sim"].append(found.nearest_sim)
    columns = {name: np.concatenate(values) if values else np.array([]) for name, values in out.items()}
    return pa.table({
        "row": pa.array(columns["row"], pa.int64()),
        "group_id": pa.array(columns["group_id"], pa.int64(), mask=columns["group_id"] < 0),
        "group_size": pa.array(columns["group_size"], pa.int32()), "kept": pa.array(columns["kept"], pa.bool_()),
        "nearest_row": pa.array(columns["nearest_row"], pa.int64(), mask=columns["nearest_row"] < 0),
        "nearest_sim": pa.array(columns["nearest_sim"], pa.float32(), from_pandas=True)}, schema=CLUSTER_SCHEMA)


# -- stage 5: one file in input order ---------------------------------------------------------


def _finalize(run: Run, units: list[str], index: IndexRecord, provenance: DedupProvenance,
              seconds: dict[str, float], progress: Progress) -> DedupSummary:
    """Write OUT (and OUT.run.json) from the parts; its summary counts the rows as they are written.
    `seconds`: the stages' times in this process (a resumed run's earlier work is not in them)."""
    out, store = run.out, run.store
    progress.note(f"writing {out}")
    assigned = ", ".join(sql_string(store.part_path(u)) for u in units)
    clustered = ", ".join(sql_string(store.part_path(f"{CLUSTERS_UNIT}{g}")) for g in range(len(index.groups)))
    spill = Path(tempfile.mkdtemp(prefix="pairclean-dedup-", dir=store.dir))
    con = sandboxed_connection(spill, directories=[store.dir], memory_limit=DUCKDB_MEMORY, threads=1)
    provenance = replace(provenance, **asdict(run.identity()))
    schema = DEDUP_SCHEMA.with_metadata(provenance_metadata(provenance))
    counts = {"rows": 0, "usable": 0, "in_groups": 0, "removed": 0}
    try:
        con.execute(f"CREATE VIEW a AS SELECT * FROM read_parquet([{assigned}])")
        con.execute(f"CREATE VIEW c AS SELECT * FROM read_parquet([{clustered}])" if clustered else
                    "CREATE VIEW c AS SELECT NULL::BIGINT AS row, NULL::BIGINT AS group_id, NULL::INTEGER AS group_size, "
                    "NULL::BOOLEAN AS kept, NULL::BIGINT AS nearest_row, NULL::FLOAT AS nearest_sim WHERE FALSE")
        groups = con.execute("SELECT count(DISTINCT group_id) FROM c").fetchall()[0][0]
        reader = con.sql("""
            SELECT a.key, a.shard, a."index", a.cluster, c.group_id, coalesce(c.group_size, 1) AS group_size,
                   coalesce(c.kept, TRUE) AS kept, n.key AS nearest_key, n.shard AS nearest_shard,
                   n."index" AS nearest_index, c.nearest_sim
            FROM a LEFT JOIN c ON a.row = c.row LEFT JOIN a AS n ON n.row = c.nearest_row
            ORDER BY a.row""").to_arrow_reader(65536)
        with run.write_output() as tmp:
            with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
                for batch in reader:
                    table = pa.Table.from_batches([batch]).cast(schema)
                    writer.write_table(table)
                    counts["rows"] += table.num_rows
                    counts["usable"] += table.num_rows - table.column("cluster").null_count
                    counts["in_groups"] += table.num_rows - table.column("group_id").null_count
                    counts["removed"] += table.num_rows - _count_true(table.column("kept"))
                    fault_point("finalize-batch")
                summary = DedupSummary(
                    **counts, duplicate_groups=int(groups), kept=counts["rows"] - counts["removed"],
                    share_removed=counts["removed"] / counts["rows"] if counts["rows"] else 0.0,
                    clusters=provenance.kmeans.clusters, scores_join=index.scores_join,
                    scored_rows=index.scored_rows, groups_of_clusters=len(index.groups),
                    seconds={k: round(v, 3) for k, v in seconds.items()})
                writer.add_key_value_metadata(summary_metadata(summary))
            write_run_manifest(out, summary, provenance, temp_dir=store.dir)
    finally:
        con.close()
        shutil.rmtree(spill, ignore_errors=True)
    fault_point("finalize-renamed")
    return summary


