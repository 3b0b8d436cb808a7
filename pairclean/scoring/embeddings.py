"""Scoring from precomputed embeddings: no model and no GPU, the same parts, finalize and output.

The layouts (clip-retrieval, two .npy files, Parquet embedding columns, DataComp's .npz) are read by
`data.embeddings` (`open_embeddings` returns an immutable `EmbeddingSource`): a unit's rows arrive
block by block (`EmbeddingSource.batches`) in reused per-thread buffers, and a block is scored here
while it is in cache.

The similarity is the cosine from three row-wise dot products (`core.scorer.cosine_from_products`):
the norms are computed anyway to check that the vectors are unit length (a user may hand over
unnormalised ones), and a zero or non-finite vector becomes an error row. beta cannot come from a model here: it is given
(`fixed`), computed from embeddings of random inputs that the user supplies (`random-inputs`),
or the shuffled-pairs diagnostic.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import torch

from pairclean.config import COUNT, at_least, setting, unpinned
from pairclean.core.beta import BETA_MODES, BetaEstimate, ShuffledAccumulator
from pairclean.core.scorer import NullDraw, cosine_from_products
from pairclean.data.embeddings import BLOCK_ROWS, SAVED_PROVENANCE, ArrayRows, EmbeddingBatch, EmbeddingSource, NpyRows
from pairclean.data.embeddings.batches import block_buffer
from pairclean.errors import ConfigError, UserError
from pairclean.ops.guard import Output
from pairclean.ops.notices import notice
from pairclean.ops.records import JsonObject, Keyed
from pairclean.scorefile.contract import Renormalised
from pairclean.scoring.batches import ScoringCounts
from pairclean.scoring.parts import ScoredUnit
from pairclean.scoring.run import Commit, Finishing, Producer, RunConfig, ScoreResult, Work, run_scoring

UNIT_TOLERANCE = 1e-2  # |norm - 1| above this is "not unit length" (float16 storage rounds to ~1e-3)
JOB_ROWS = 16384  # rows per thread-pool job (a run of blocks)


# -- the arithmetic ----------------------------------------------------------------------------


def _as_float32(block: np.ndarray, slot: str) -> np.ndarray:
    """The block as float32: itself, or converted into a reused per-thread buffer."""
    if block.dtype == np.float32:
        return block
    view = torch.from_numpy(block_buffer(slot, np.dtype(np.float32), block.shape[1])[:len(block)])
    view.copy_(torch.from_numpy(block))  # torch converts float16 with F16C; numpy's cast is several times slower
    return view.numpy()


def _job(rows: ArrayRows | NpyRows, start: int, stop: int, out: np.ndarray) -> None:
    """Rows [start, stop), one cache-sized block at a time: read, convert, three row-wise dots."""
    for a in range(start, stop, BLOCK_ROWS):
        b = min(a + BLOCK_ROWS, stop)
        left, right = rows.block(a, b)
        u, v = _as_float32(left, "f32-left"), _as_float32(right, "f32-right")
        np.einsum("ij,ij->i", u, v, out=out[0, a:b])
        np.einsum("ij,ij->i", u, u, out=out[1, a:b])
        np.einsum("ij,ij->i", v, v, out=out[2, a:b])


def row_products(rows: ArrayRows | NpyRows, pool: ThreadPoolExecutor | None) -> np.ndarray:
    """3 x n float32: u.v, u.u and v.v row by row (numpy and torch release the GIL: the pool's
    threads run in parallel)."""
    n = len(rows)
    out = np.empty((3, n), dtype=np.float32)
    jobs = [(a, min(a + JOB_ROWS, n)) for a in range(0, n, JOB_ROWS)]
    if pool is None:
        for a, b in jobs:
            _job(rows, a, b, out)
    else:
        list(pool.map(lambda job: _job(rows, job[0], job[1], out), jobs))
    return out


@dataclass
class BatchScores:
    sim: np.ndarray  # float32, NaN where the row has no score
    error: list[str | None]
    not_unit_left: int
    not_unit_right: int
    max_deviation: float


def score_batch(batch: EmbeddingBatch, pool: ThreadPoolExecutor | None,
                accumulator: ShuffledAccumulator | None = None) -> BatchScores:
    """Cosine of each row pair; zero, non-finite or missing vectors become error rows."""
    dot, nu2, nv2 = row_products(batch.rows, pool)
    sim = cosine_from_products(dot, nu2, nv2)
    nu, nv = np.sqrt(nu2), np.sqrt(nv2)
    usable = np.isfinite(sim)
    if batch.bad:
        usable[list(batch.bad)] = False
    sim = np.where(usable, sim, np.nan).astype(np.float32)
    error: list[str | None] = [None] * len(sim)
    for i in np.flatnonzero(~usable).tolist():
        error[i] = batch.bad.get(i) or ("zero-length embedding" if (nu[i] == 0 or nv[i] == 0)
                                        else "non-finite embedding")
    dev_u, dev_v = np.abs(nu[usable] - 1), np.abs(nv[usable] - 1)
    if accumulator is not None and usable.any():
        rows = np.flatnonzero(usable)
        left, right = batch.rows.arrays()
        u = torch.from_numpy(np.asarray(left[rows], dtype=np.float64) / nu[rows, None])
        v = torch.from_numpy(np.asarray(right[rows], dtype=np.float64) / nv[rows, None])
        accumulator.add(u, v)
    return BatchScores(sim, error, int((dev_u > UNIT_TOLERANCE).sum()), int((dev_v > UNIT_TOLERANCE).sum()),
                       float(max(dev_u.max(initial=0.0), dev_v.max(initial=0.0))))


# -- beta ----------------------------------------------------------------------------------------


def _unit_vectors(spec: EmbeddingSource, side: str, batch_rows: int) -> Iterator[np.ndarray]:
    """One side's usable vectors, normalised, in float64 batches."""
    for unit in spec.units(1 << 62):
        for batch in spec.batches(unit, batch_rows):
            x = np.asarray(batch.rows.arrays()[side == "right"], dtype=np.float64)
            norms = np.linalg.norm(x, axis=1)
            keep = np.isfinite(norms) & (norms > 0)
            if batch.bad:
                keep[list(batch.bad)] = False
            yield x[keep] / norms[keep, None]


def random_embeddings_beta(spec: EmbeddingSource, batch_rows: int = 65536) -> BetaEstimate:
    """beta = mean cosine over all K_left x K_right pairs of user-supplied random-input embeddings.

    Streamed exactly, without the K x K matrix: mean = (sum u^).(sum v^) / (K_l K_r) and
    E[s^2] = sum_i u^_i' M u^_i / (K_l K_r) with M = sum_j v^_j v^_j' (d x d).
    """
    dim = spec.dim or 0
    sum_v, m, k_right = np.zeros(dim), np.zeros((dim, dim)), 0
    for v in _unit_vectors(spec, "right", batch_rows):
        sum_v += v.sum(0)
        m += v.T @ v
        k_right += len(v)
    sum_u, sq, k_left = np.zeros(dim), 0.0, 0
    for u in _unit_vectors(spec, "left", batch_rows):
        sum_u += u.sum(0)
        sq += float(((u @ m) * u).sum())
        k_left += len(u)
    if k_left < 2 or k_right < 2:
        raise UserError(f"the random-input embeddings hold {k_left} usable left and {k_right} right vectors; "
                        "beta needs at least 2 of each (1024 or more is the default)")
    n = k_left * k_right
    mean = float(sum_u @ sum_v) / n
    var = max(sq / n - mean * mean, 0.0) * n / (n - 1)
    return BetaEstimate("random-inputs", mean, float(np.sqrt(var)), min(k_left, k_right))


# -- the producer --------------------------------------------------------------------------------


@dataclass
class EmbeddingScoreConfig(RunConfig):
    random_embeddings: EmbeddingSource | None = unpinned(None)  # for beta_mode random-inputs (pinned by its paths)
    batch_rows: int = setting(65536, COUNT, pinned=False)  # rows read at a time: what bounds memory
    unit_rows: int = setting(1 << 18, COUNT)  # rows per unit of an .npy pair: the grain of resume; held until commit
    threads: int = setting(0, at_least(0), pinned=False)  # 0: torch.get_num_threads()

    def __post_init__(self):
        super().__post_init__()
        if self.beta_mode != "random-inputs" and self.random_embeddings is not None:
            raise ConfigError(f"random_embeddings is only used with beta_mode random-inputs, not {self.beta_mode}",
                              "random_embeddings", "beta_mode")


def score_unit(batches: Iterable[EmbeddingBatch], pool: ThreadPoolExecutor | None,
               shuffled: bool) -> tuple[Keyed, JsonObject]:
    """Score one unit's batches: (its part's columns by name, the entries it adds to its commit
    record, `parts.ScoredUnit`). A unit that breaks keeps its rows so far and says why in the record.
    Its null pairs are drawn from its scored rows as the model producer draws a unit's
    (`core.scorer.NullDraw`), whatever `batch_rows`."""
    keys, shards, index, sims, errors = [], [], [], [], []
    null, rows = NullDraw(), 0
    not_unit = [0, 0]
    deviation = 0.0
    accumulator = ShuffledAccumulator() if shuffled else None
    failure = None
    try:
        for batch in batches:
            scores = score_batch(batch, pool, accumulator)
            batch_keys, batch_shards, batch_index = batch.identity()
            scored = np.flatnonzero(np.isfinite(scores.sim))  # the scored rows draw; no error row does
            left, right = batch.rows.arrays()
            null.add(rows + scored, np.asarray(batch_index, dtype=np.int64)[scored], left, right, at=scored)
            rows += len(scores.sim)
            keys.append(batch_keys)
            shards.append(batch_shards)
            index.append(batch_index)
            sims.append(scores.sim)
            errors.extend(scores.error)
            not_unit[0] += scores.not_unit_left
            not_unit[1] += scores.not_unit_right
            deviation = max(deviation, scores.max_deviation)
    except (OSError, ValueError) as exc:  # a file that vanished or broke mid-run: keep what was read
        failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    columns = {"key": pa.concat_arrays(keys) if keys else pa.array([], pa.string()),
               "shard": pa.concat_arrays(shards) if shards else pa.array([], pa.string()),
               "index": np.concatenate(index) if index else np.array([], np.int64),
               "sim": np.concatenate(sims) if sims else np.array([], np.float32),
               "null_sim": null.column(rows), "error": errors}
    record = {"failure": failure, "shuffled": accumulator.state() if accumulator else None,
              "not_unit_left": not_unit[0], "not_unit_right": not_unit[1], "max_norm_deviation": deviation}
    return columns, record


class EmbeddingsProducer(Producer):
    """Similarities of precomputed embedding pairs: no model, no GPU."""

    def __init__(self, spec: EmbeddingSource, cfg: EmbeddingScoreConfig):
        self.spec, self.cfg = spec, cfg
        # random-inputs needs embeddings of random inputs from the same model (there is no model to draw
        # them), or the random-inputs beta that the run which saved these embeddings computed with it
        saved = spec.saved.beta if spec.saved is not None else None
        self.saved_beta = BetaEstimate(**asdict(saved)) if saved is not None and saved.mode == "random-inputs" else None
        self.beta_modes = BETA_MODES if cfg.random_embeddings is not None or self.saved_beta else ("fixed", "shuffled")

    def missing_beta(self) -> ConfigError:
        return ConfigError("scoring from embeddings has no model to draw random inputs with: pass "
                           "`random_embeddings` PATH (embeddings of random inputs from the same model), "
                           "or `beta_mode` fixed `beta` VALUE, or `beta_mode` shuffled (a diagnostic)",
                           "random_embeddings", "beta_mode", "beta")

    def units(self) -> list[str]:
        return self.spec.units(self.cfg.unit_rows)

    def settings(self) -> JsonObject:
        spec, rand = self.spec, self.cfg.random_embeddings
        return {"source": "embeddings", "layout": spec.layout, "pair": spec.pair, "left_field": spec.left_field,
                "right_field": spec.right_field, "key_field": spec.key_field,
                "random_embeddings": rand.inputs() if rand else None}

    def input_files(self) -> list[str]:
        rand = self.cfg.random_embeddings
        return [*self.spec.sources, *self.spec.inputs(), *([*rand.sources, *rand.inputs()] if rand else [])]

    def random_beta(self) -> tuple[BetaEstimate, str]:
        rand = self.cfg.random_embeddings
        if rand is None:
            return self.saved_beta, (f"recorded with the embeddings by the run that saved them "
                                     f"({Path(self.spec.sources[0]) / SAVED_PROVENANCE}: the same model's random inputs)")
        beta = random_embeddings_beta(rand, self.cfg.batch_rows)
        return beta, f"computed from random-input embeddings supplied by the user ({', '.join(rand.sources)})"

    def score(self, work: Work, commit: Commit) -> ScoringCounts:
        intra_op = torch.get_num_threads()
        threads = self.cfg.threads or intra_op
        pool = ThreadPoolExecutor(threads) if threads > 1 else None
        # A unit's part is written on its own thread while the next unit is scored (pyarrow's write
        # releases the GIL); waiting for it before the next commit keeps parts in order and memory at
        # two units' columns. The `finally` waits for a commit in flight: a stopped run leaves whole parts.
        writer = ThreadPoolExecutor(1)
        pending = None
        # The pool is the parallelism; torch's own threads on block-sized conversions only contend
        # (measured: 10x more CPU per pair with 2 intra-op threads on a busy machine).
        torch.set_num_threads(1)
        try:
            for unit in (u for group in work.claimed() for u in group if u not in work.done):
                columns, record = score_unit(self.spec.batches(unit, self.cfg.batch_rows), pool,
                                             shuffled=self.cfg.beta_mode == "shuffled")
                if pending is not None:
                    pending.result()
                pending = writer.submit(commit, unit, columns, record)
            if pending is not None:
                pending.result()
        finally:
            writer.shutdown(wait=True)
            torch.set_num_threads(intra_op)
            if pool is not None:
                pool.shutdown()
        return ScoringCounts()

    def finish(self, records: dict[str, ScoredUnit], counts: ScoringCounts, todo: int,
               beta: BetaEstimate | None) -> Finishing:
        units = list(records)
        not_unit = {"left": sum(records[u].not_unit_left for u in units),
                    "right": sum(records[u].not_unit_right for u in units)}
        deviation = max((records[u].max_norm_deviation for u in units), default=0.0)
        if not_unit["left"] or not_unit["right"]:
            notice(f"{not_unit['left']:,} left and {not_unit['right']:,} right vectors were not unit length "
                   f"(largest |norm - 1| = {deviation:.3g}); they were re-normalised")
        spec = self.spec
        estimator = {"backend": "precomputed-embeddings", "layout": spec.layout, "embedding_dim": spec.dim,
                     "dtype": sorted({n.dtype for n in spec.npy}) or None}
        if spec.saved:  # the model that computed them, as the saving run recorded it
            estimator["saved_by"] = {"estimator": spec.saved.estimator, "weights_sha1": spec.saved.weights_sha1,
                                     "preprocessing": spec.saved.preprocessing}
        provenance = {"estimator": estimator, "pair": spec.pair, "input_shards": spec.inputs(), "dataset": spec.record(),
                      "renormalised": Renormalised(**not_unit, max_norm_deviation=deviation)}
        return Finishing(provenance, {"not_unit_left": not_unit["left"], "not_unit_right": not_unit["right"]})


def score_embeddings(spec: EmbeddingSource, out: str | Path | Output, config: EmbeddingScoreConfig | None = None) -> ScoreResult:
    """Score every row pair of precomputed embeddings into `out`, resumably, like `score()`."""
    cfg = config or EmbeddingScoreConfig()
    return run_scoring(EmbeddingsProducer(spec, cfg), out, cfg)
