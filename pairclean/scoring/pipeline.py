"""The main process of a scoring run, batch after batch:

    receive (a PairBatch from whichever worker has one ready, page-locked by the DataLoader's pin thread)
    -> to device (asynchronous copies, on a side stream: they overlap the previous batch's model)
    -> device preprocessing (`estimator.finish_batch`: JPEGs decoded, resized, cropped)
       (on CUDA these three run one batch ahead in a thread of their own: `DevicePrefetcher`)
    -> encode (u, v) -> scorer (sims, and u and v, copied back to the host asynchronously)
    -> sink (rows into each unit's part, its null pairs drawn, commits), one batch behind

The sink handles batch i-1 after batch i's work is queued on the device, so on a GPU the host's
bookkeeping and Parquet writes run while the model computes, and the host never waits for the
device except for results it already queued. On a CPU device the same stages run in order.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import closing
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from pairclean.backends.base import Estimator, move_batch
from pairclean.backends.feed import DeviceFeed, DevicePrefetcher, HostCopies, device_tensors
from pairclean.backends.oom import OomBackoff, take_rows
from pairclean.core.beta import ShuffledAccumulator
from pairclean.core.scorer import NullDraw
from pairclean.ops.measure import StageMeter
from pairclean.ops.records import Keyed
from pairclean.scoring.batches import PairBatch, ScoringCounts, UnitEnd

# Device types whose batches are prepared one ahead in a thread of their own (`run_pipeline`).
PREFETCH_DEVICES = ("cuda",)

STAGES = ("receive", "to device", "device preprocessing", "encode", "scorer", "sink")


def finish_on_device(estimator: Estimator, batch: PairBatch, left: str, right: str) -> PairBatch:
    """Device preprocessing of both sides. A row either side could not finish (an image the device
    cannot decode) becomes an error row and leaves both sides' inputs, so the sides stay aligned."""
    if batch.left is None:
        return batch
    batch.left, failed_left = estimator.finish_batch(left, batch.left)
    batch.right, failed_right = estimator.finish_batch(right, batch.right)
    failed = {**failed_right, **failed_left}
    if failed:
        valid = batch.valid_rows()
        keep = [p for p in range(len(valid)) if p not in failed]
        batch.left, batch.right = take_rows(batch.left, keep), take_rows(batch.right, keep)
        for position, reason in failed.items():
            batch.error[valid[position]] = reason
        if not keep:
            batch.left = batch.right = None
    return batch


@dataclass
class ScoredBatch:
    """A batch's rows and what the device computed for its valid rows (`encoded`, in order) on
    its way to host memory: similarities (`sims`) and, where the sink needs them (the null draw,
    shuffled beta, saved embeddings), the embeddings (`left`, `right`)."""

    batch: PairBatch
    encoded: list[int]
    results: HostCopies = field(default_factory=HostCopies)


class Scorer:
    """Encodes a batch's valid rows (each side in chunks that fit: `OomBackoff`) and computes each
    pair's cosine. The null pairs are not drawn here: a batch's rows depend on the batch size and
    the packing, so the sink draws them per unit (`core.scorer.NullDraw`)."""

    def __init__(self, estimator: Estimator, left: str, right: str):
        self.estimator, self.left_mod, self.right_mod = estimator, left, right
        self.backoff = {left: OomBackoff(), right: OomBackoff()}

    def encode(self, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        u = self.backoff[self.left_mod](lambda b: self.estimator.encode(self.left_mod, b), batch.left)
        v = self.backoff[self.right_mod](lambda b: self.estimator.encode(self.right_mod, b), batch.right)
        return u, v

    def score(self, batch: PairBatch, u: torch.Tensor, v: torch.Tensor) -> ScoredBatch:
        # u and v go to the host too: the sink draws each unit's null pairs from them (and keeps them
        # for shuffled beta and saved embeddings)
        scored = ScoredBatch(batch, batch.valid_rows(), HostCopies({"sims": (u * v).sum(-1), "left": u, "right": v}))
        batch.left = batch.right = None  # the inputs are no longer needed: free them now
        return scored


@dataclass
class _UnitRows:
    """A unit's rows gathered so far, as column chunks (one per batch it spans), and its null draw."""

    key: list[str] = field(default_factory=list)
    shard: list[str] = field(default_factory=list)
    index: list[int] = field(default_factory=list)
    error: list[str | None] = field(default_factory=list)
    sim: list[np.ndarray] = field(default_factory=list)
    null: NullDraw = field(default_factory=NullDraw)

    def columns(self) -> Keyed:
        empty = np.zeros(0, dtype=np.float32)
        return {"key": self.key, "shard": self.shard, "index": self.index, "error": self.error,
                "sim": np.concatenate(self.sim) if self.sim else empty, "null_sim": self.null.column(len(self.key))}


@dataclass
class UnitEmbeddings:
    """A unit's embeddings for `save_embeddings`, in its row order."""

    left: list[torch.Tensor] = field(default_factory=list)
    right: list[torch.Tensor] = field(default_factory=list)
    key: list[str] = field(default_factory=list)
    shard: list[str] = field(default_factory=list)
    index: list[int] = field(default_factory=list)


# commit(unit, columns, record); save_block(unit, block or None) -> what the commit record says of it
Commit = Callable[[str, dict, dict], None]
SaveBlock = Callable[[str, UnitEmbeddings | None], dict]


class PartSink:
    """Rows into each unit's part, one batch behind the device: `put(batch i)` first takes batch
    i-1 (whose results are in host memory by then, or nearly), then keeps batch i. A unit is
    committed, with its null pairs (drawn from its own rows: `core.scorer.NullDraw`), its
    shuffled-beta sums and its saved embeddings, once its last row is in.
    Rows of units an earlier run committed only filled their batches: they are dropped here."""

    def __init__(self, done: frozenset[str], commit: Commit, accumulate: bool, save_block: SaveBlock | None,
                 save_dtype: torch.dtype = torch.float16):
        self.done, self.commit, self.accumulate = done, commit, accumulate
        self.save_block, self.save_dtype = save_block, save_dtype
        self.rows: dict[str, _UnitRows] = defaultdict(_UnitRows)
        self.sums: dict[str, ShuffledAccumulator] = defaultdict(ShuffledAccumulator)
        self.blocks: dict[str, UnitEmbeddings] = defaultdict(UnitEmbeddings)
        self.pending: ScoredBatch | None = None

    def put(self, scored: ScoredBatch) -> None:
        if self.pending is not None:
            self._take(self.pending)
        self.pending = scored

    def close(self) -> None:
        if self.pending is not None:
            self._take(self.pending)
            self.pending = None

    def _take(self, scored: ScoredBatch) -> None:
        results = scored.results.wait()
        batch, n = scored.batch, len(scored.batch)
        sims = np.full(n, np.nan, dtype=np.float32)
        if scored.encoded:
            sims[scored.encoded] = results["sims"].numpy()
        # Position of each row among the encoded ones: a span's encoded rows are contiguous in u, v.
        first_encoded = np.searchsorted(np.asarray(scored.encoded, dtype=np.int64), np.arange(n + 1))
        index = np.asarray(batch.index, dtype=np.int64)
        for span in batch.spans:
            if span.unit in self.done:
                continue
            part, rows = self.rows[span.unit], slice(span.start, span.stop)
            first = len(part.key)  # the span's first row's place in the unit
            part.key.extend(batch.key[rows])
            part.shard.extend(batch.shard[rows])
            part.index.extend(batch.index[rows])
            part.error.extend(batch.error[rows])
            part.sim.append(sims[rows])
            lo, hi = int(first_encoded[span.start]), int(first_encoded[span.stop])
            if hi > lo:
                encoded = np.asarray(scored.encoded[lo:hi], dtype=np.int64)
                finite = np.flatnonzero(np.isfinite(sims[encoded]))  # the scored rows draw; no error row does
                drawing = encoded[finite]
                part.null.add(first + drawing - span.start, index[drawing],
                              results["left"][lo:hi], results["right"][lo:hi], at=finite)
                if self.accumulate or self.save_block is not None:
                    self._keep_embeddings(span.unit, scored, results, lo, hi)
        for end in batch.done:
            self._commit(end)

    def _keep_embeddings(self, unit: str, scored: ScoredBatch, results: dict, lo: int, hi: int) -> None:
        u, v = results["left"][lo:hi], results["right"][lo:hi]
        if self.accumulate:
            self.sums[unit].add(u, v)
        if self.save_block is not None:
            block, batch = self.blocks[unit], scored.batch
            block.left.append(u.to(self.save_dtype))
            block.right.append(v.to(self.save_dtype))
            for row in scored.encoded[lo:hi]:
                block.key.append(batch.key[row])
                block.shard.append(batch.shard[row])
                block.index.append(batch.index[row])

    def _commit(self, end: UnitEnd) -> None:
        columns = self.rows.pop(end.unit, _UnitRows()).columns()
        record = {"failure": end.failure, "shuffled": self.sums.pop(end.unit, ShuffledAccumulator()).state()}
        if self.save_block is not None:  # the unit's block first: committed units have theirs
            record.update(self.save_block(end.unit, self.blocks.pop(end.unit, None)))
        self.commit(end.unit, columns, record)


def run_pipeline(batches: Iterable[PairBatch], estimator: Estimator, left: str, right: str, sink: PartSink,
                 batch_size: int, meter: StageMeter | None = None,
                 after_batch: Callable[[], None] | None = None) -> ScoringCounts:
    """Drive every batch through the stages; the counts of the batches seen (how full they were).
    `meter`: where the main process's time goes, stage by stage (STAGES). On PREFETCH_DEVICES batch
    i+1 is received, copied and preprocessed in a thread of its own while the main thread runs batch
    i (`DevicePrefetcher`: nvJPEG's decode blocks the thread calling it); the main thread's `receive`
    is then its wait for a prepared batch."""
    scorer = Scorer(estimator, left, right)
    seen = full = rows = 0
    mark = meter.mark if meter is not None else (lambda stage: None)
    threaded = estimator.device.type in PREFETCH_DEVICES
    # The prefetching thread copies on its own side stream, which the compute stream waits for
    # (DevicePrefetcher): a DeviceFeed's second side stream there would only repeat that.
    feed = (lambda value: move_batch(value, estimator.device)) if threaded else DeviceFeed(estimator.device)
    inline_mark = (lambda stage: None) if threaded else mark  # the meter is the main thread's

    def prepare(batch: PairBatch) -> tuple[PairBatch, int]:
        inline_mark("receive")
        worker_bytes = batch.worker_bytes() if meter is not None else 0  # what crossed, before the device has it
        batch.left, batch.right = feed(batch.left), feed(batch.right)
        inline_mark("to device")
        batch = finish_on_device(estimator, batch, left, right)
        inline_mark("device preprocessing")
        return batch, worker_bytes

    if meter is not None:
        meter.start()
        batches = meter.timed(batches)
    prepared = DevicePrefetcher(batches, prepare, estimator.device, threaded=threaded,
                                held=lambda item: device_tensors((item[0].left, item[0].right)),
                                warm_up=getattr(estimator, "warm_up", None))
    with closing(iter(prepared)) as ready:  # an error below stops the prefetching thread at once
        for batch, worker_bytes in ready:
            if threaded:  # the thread did these: the main thread waited for them in `receive`
                for stage in STAGES[:3]:
                    mark(stage)
            pairs = sum(s.stop - s.start for s in batch.spans if s.unit not in sink.done)
            if len(batch):
                seen += 1
                full += len(batch) == batch_size
                rows += len(batch)
            if batch.left is not None:
                u, v = scorer.encode(batch)
                mark("encode")
                scored = scorer.score(batch, u, v)
            else:
                scored = ScoredBatch(batch, [])
            mark("scorer")
            sink.put(scored)
            if after_batch is not None:
                after_batch()
            mark("sink")
            if meter is not None:
                meter.batch(pairs, worker_bytes)
    sink.close()
    mark("sink")
    if meter is not None:
        meter.stop()
    return ScoringCounts(batches=seen, full_batches=full, batch_rows=rows)
