"""A scoring run's pairs as batches: what DataLoader workers build and hand the main process.

Workers read the groups they claim, decode and prepare every pair (uint8 pixels, tokens, or JPEG
bytes left for the device) and collate whole batches; a `PairBatch` is the one record that
crosses to the main process. Its rows are columns (lists), its units contiguous runs of rows
(`UnitSpan`), so the main process handles a batch with a few operations per unit, not per row.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from pairclean.backends.base import Preparer, prepare_each
from pairclean.data.dataset import Dataset
from pairclean.data.spec import UnitFailure, modalities
from pairclean.ops.worker_memory import steady_worker_memory
from pairclean.ops.worker_start import first_batch_at_once

# Batches are taken as they come, not from each worker in turn (torch >= 2.6; older torch takes
# them in turn). A worker reads whole groups and builds whole batches, so its own batches keep
# their order and every batch its rows whoever takes it first: the scores cannot depend on the
# order, and a worker slowed by one shard (larger images, a slow disk) holds up only its own.
AS_THEY_COME = {"in_order": False} if "in_order" in inspect.signature(DataLoader).parameters else {}


@dataclass(frozen=True)
class ScoringCounts:
    """What a scoring process counts of its batches (how full they were), its DataLoader workers and
    the pairs it committed: summed over torchrun ranks and Ray calls (workers: the most any had)."""

    batches: int = 0
    full_batches: int = 0
    batch_rows: int = 0
    workers: int = 0
    pairs: int = 0

    def __add__(self, other: ScoringCounts) -> ScoringCounts:
        return ScoringCounts(self.batches + other.batches, self.full_batches + other.full_batches,
                             self.batch_rows + other.batch_rows, max(self.workers, other.workers),
                             self.pairs + other.pairs)


@dataclass(frozen=True)
class UnitSpan:
    """Rows `start:stop` of a batch belong to `unit`."""

    unit: str
    start: int
    stop: int


@dataclass(frozen=True)
class UnitEnd:
    """A unit whose last row a batch (or an earlier one) holds: it can be committed once that batch
    is scored. `rows`: the rows read from it; `failure`: why its reading stopped early, if it did."""

    unit: str
    failure: str | None
    rows: int


def nbytes(inputs: Any) -> int:
    """Bytes of the tensors in one side's collated inputs."""
    if isinstance(inputs, torch.Tensor):
        return inputs.nbytes
    if isinstance(inputs, dict):
        return sum(nbytes(v) for v in inputs.values())
    return inputs.nbytes() if hasattr(inputs, "nbytes") else 0


def _pinned(inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return {k: _pinned(v) for k, v in inputs.items()}
    return inputs.pin_memory() if hasattr(inputs, "pin_memory") else inputs


@dataclass
class PairBatch:
    """One batch of pairs: row columns, each side's collated inputs (valid rows only, in row
    order; None when no row is valid) and the units it ends."""

    spans: list[UnitSpan]
    key: list[str]
    shard: list[str]
    index: list[int]
    error: list[str | None]
    left: Any = None
    right: Any = None
    done: list[UnitEnd] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.key)

    def valid_rows(self) -> list[int]:
        return [i for i, e in enumerate(self.error) if e is None]

    def pin_memory(self) -> "PairBatch":
        """Called by the DataLoader's pin-memory thread (a record it does not know is passed on
        unpinned): both sides' tensors page-locked, so the copy to the device is asynchronous."""
        self.left, self.right = _pinned(self.left), _pinned(self.right)
        return self

    def worker_bytes(self) -> int:
        """What crossed from the worker for this batch: the inputs' tensors, and the row columns
        as their text (keys, error reasons, 8 bytes an index; a unit's and its shard's names once
        per span, as pickle sends a repeated object once)."""
        text = sum(len(k) for k in self.key) + sum(len(e) for e in self.error if e)
        text += sum(len(s.unit) + len(self.shard[s.start]) for s in self.spans) + 8 * len(self.index)
        return nbytes(self.left) + nbytes(self.right) + text


class _Rows:
    """A batch being filled in a worker: row columns, unit spans, units ended."""

    def __init__(self):
        self.spans: list[UnitSpan] = []
        self.key, self.shard, self.index, self.error = [], [], [], []
        self.left, self.right = [], []
        self.done: list[UnitEnd] = []

    def __len__(self) -> int:
        return len(self.key)

    def add(self, unit: str, item) -> None:
        if self.spans and self.spans[-1].unit == unit:
            last = self.spans[-1]
            self.spans[-1] = UnitSpan(unit, last.start, last.stop + 1)
        else:
            self.spans.append(UnitSpan(unit, len(self.key), len(self.key) + 1))
        self.key.append(item.key)
        self.shard.append(item.shard)
        self.index.append(item.index)
        self.error.append(item.error)
        self.left.append(item.left)
        self.right.append(item.right)


class PreparedBatches(IterableDataset):
    """Batches of prepared pairs from the groups this worker claims.

    A group's units are read in order as one stream cut every `batch_size` rows, whichever
    process claims it and whether or not some of its units were committed before: a resumed run
    encodes every pair in the same batch as an uninterrupted one, bit for bit. Rows of committed
    units are read to fill those batches and decoded only when a batch also holds rows to score.
    A batch carries the units whose last row it (or an earlier batch) holds, to be committed."""

    def __init__(self, dataset: Dataset, work, preparer: Preparer, batch_size: int):
        self.dataset, self.work, self.preparer, self.batch_size = dataset, work, preparer, batch_size
        self.left, self.right = modalities(dataset.spec.pair)

    def _prepared(self, rows: _Rows) -> PairBatch | None:
        """The batch with its pairs decoded and collated; None when it holds nothing to score or commit."""
        if not rows.done and all(span.unit in self.work.done for span in rows.spans):
            return None
        valid = [i for i, error in enumerate(rows.error) if error is None]
        lefts = prepare_each(self.preparer, self.left, [rows.left[i] for i in valid])
        rights = prepare_each(self.preparer, self.right, [rows.right[i] for i in valid])
        prepared_left, prepared_right = [], []
        for i, left, right in zip(valid, lefts, rights):
            failed = left if isinstance(left, Exception) else right if isinstance(right, Exception) else None
            if failed is not None:  # a bad item becomes an error row, never a dead worker
                rows.error[i] = str(failed).splitlines()[0][:300] if str(failed) else type(failed).__name__
                continue
            prepared_left.append(left)
            prepared_right.append(right)
        return PairBatch(rows.spans, rows.key, rows.shard, rows.index, rows.error,
                         self.preparer.collate(self.left, prepared_left) if prepared_left else None,
                         self.preparer.collate(self.right, prepared_right) if prepared_right else None, rows.done)

    def __iter__(self):
        return first_batch_at_once(self._batches())

    def _batches(self):
        for group in self.work.claimed():
            rows = _Rows()
            for unit in group:
                count = 0
                failure = None
                for item in self.dataset.read(unit):
                    if isinstance(item, UnitFailure):
                        failure = item.reason
                        continue
                    rows.add(unit, item)
                    count += 1
                    if len(rows) >= self.batch_size:
                        if (batch := self._prepared(rows)) is not None:
                            yield batch
                        rows = _Rows()
                if unit not in self.work.done:
                    rows.done.append(UnitEnd(unit, failure, count))
            if (batch := self._prepared(rows)) is not None:
                yield batch


def batch_loader(batches: IterableDataset, workers: int, pin_memory: bool) -> DataLoader:
    """The DataLoader a scoring run takes its batches from: `workers` processes (0: this one),
    two ready batches a worker (they hide decoding without holding more than 2 x workers
    batches of pixels in page-locked memory), each batch taken as soon as it is ready."""
    return DataLoader(batches, batch_size=None, num_workers=workers, pin_memory=pin_memory,
                      prefetch_factor=2 if workers else None, persistent_workers=False,
                      worker_init_fn=steady_worker_memory, **(AS_THEY_COME if workers else {}))
