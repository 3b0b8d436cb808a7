"""The training data path: shard index, per-shard weight arrays, shuffled prepared batches.

`index_shards` counts the pairs of every shard without reading pixel data (the dataset's input
format: Parquet metadata, a tar shard's header listing, whose indexes are those `Dataset.read` gives).
`TrainBatches` is an IterableDataset: units (tar shards / Parquet row groups) are shuffled per
epoch, split by node (torch.distributed rank, a no-op in one process) then by DataLoader worker
(webdataset's `split_by_node` / `split_by_worker`), read with `Dataset.read`, joined with
the shard's weight array when the shard is opened, shuffled in a bounded buffer, prepared and
collated in the worker. The order depends only on (seed, epoch, rank, worker), so a resumed run
sees the same batches.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import IterableDataset

from pairclean.backends.base import prepare_each
from pairclean.errors import UserError
from pairclean.data.dataset import Dataset
from pairclean.data.spec import UnitFailure, modalities
from pairclean.data.units import unit_shard
from pairclean.ops.records import Keyed
from pairclean.ops.urls import is_local
from pairclean.ops.worker_start import first_batch_at_once

DROPPED = -1.0  # weight-array value of a pair the method leaves out (filtered); NaN = not in the scores


@dataclass
class ShardInfo:
    shard: str
    rows: int
    failure: str | None = None  # the shard could only be listed partly


def index_shards(dataset: Dataset) -> list[ShardInfo]:
    """Pairs per shard, in the spec's order, as the dataset's format counts them (no pixel data read)."""
    out = []
    for shard in dict.fromkeys(dataset.spec.shards):  # a shard listed twice is one unit (Dataset.units)
        if is_local(shard) and not os.path.isfile(shard):
            raise UserError(f"shard not found: {shard}")
        rows, failure = dataset.rows(shard)
        out.append(ShardInfo(shard, rows, failure))
    return out


def content_digest(value: bytes | str) -> str:
    """Identity of an item by content: the same image (or text) under several captions."""
    return hashlib.sha1(value.encode() if isinstance(value, str) else value).hexdigest()


@dataclass
class UnitSpan:
    """Where a unit's pairs lie in its shard: indexes start .. start + rows - 1."""

    shard: str
    start: int
    rows: int


def unit_spans(dataset: Dataset, units: list[str], shards: list[ShardInfo]) -> Keyed[str, UnitSpan]:
    """Each unit's span: a whole shard's from the shard index, a part's (a Parquet row group) as the
    dataset's format counts it (file metadata)."""
    rows = {s.shard: s.rows for s in shards}
    spans, next_start = {}, {}
    for unit in units:
        shard = unit_shard(unit)
        n = rows[shard] if unit == shard else dataset.count(unit)
        spans[unit] = UnitSpan(shard, next_start.get(shard, 0), n)
        next_start[shard] = spans[unit].start + n
    return spans


@dataclass
class BatchPlan:
    """What the workers put into each batch besides the target's inputs."""

    weights_dir: str | None = None  # per-shard weight arrays written by `weights.build_weight_arrays`
    shard_files: dict[str, str] | None = None  # shard -> array file name inside weights_dir
    extra_preparers: dict | None = None  # name -> preparer, e.g. an online estimator's own transforms
    pairs: int | None = None  # pairs the method trains on per epoch (sets the LR schedule); None: all
    left_digest: bool = False  # add each left item's content hash (groups captions of one image)


@dataclass(frozen=True)
class LeftOut:
    """The pairs a loader worker left out since its previous batch, which carries them (`"stats"`):
    pairs with an error or that did not decode (`errors`), pairs their weight drops (`dropped`), and
    the units that broke (`failures`, "unit: reason")."""

    errors: int = 0
    dropped: int = 0
    failures: tuple[str, ...] = ()


@dataclass
class _Tally:
    """A worker's live count of what it leaves out (`LeftOut`)."""

    errors: int = 0
    dropped: int = 0
    failures: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.errors or self.dropped or self.failures)

    def take(self) -> LeftOut:
        """What was counted since the last batch; the tally keeps counting from zero."""
        taken = LeftOut(self.errors, self.dropped, tuple(self.failures))
        self.errors, self.dropped, self.failures = 0, 0, []
        return taken


class TrainBatches(IterableDataset):
    """Prepared training batches; each worker reads its own share of the (shuffled) units."""

    def __init__(self, dataset: Dataset, preparer, batch_size: int, seed: int, shuffle_buffer: int = 1000,
                 plan: BatchPlan | None = None, shuffle: bool = True):
        self.dataset, self.spec = dataset, dataset.spec
        self.preparer, self.batch_size, self.seed = preparer, batch_size, seed
        self.shuffle_buffer, self.shuffle = shuffle_buffer, shuffle
        self.plan = plan or BatchPlan()
        self.units = dataset.units()
        self.left, self.right = modalities(self.spec.pair)
        self.epoch, self.repeat = 0, 0

    def set_epoch(self, epoch: int, repeat: int = 0) -> None:
        """The epoch the next pass reads; `repeat` > 0: a further pass over the same pairs within the epoch,
        in an order of its own (a method that re-reads the pairs it chose, `Method.epoch_span`)."""
        self.epoch, self.repeat = epoch, repeat

    def _order_key(self, epoch: int, repeat: int = 0) -> str:
        return f"{self.seed}-{epoch}" + (f"-{repeat}" if repeat else "")

    def _unit_order(self, epoch: int, repeat: int = 0) -> list[str]:
        units = list(self.units)
        if self.shuffle:
            random.Random(f"units-{self._order_key(epoch, repeat)}").shuffle(units)
        return units

    def kept_pairs(self, spans: dict[str, UnitSpan]) -> Keyed[str, float]:
        """The pairs each unit gives as far as is known before reading it: its rows less those the
        plan's weight arrays drop or, where the arrays are not written yet, its rows times the plan's
        share of kept pairs. Pairs found unusable only when read (a missing caption, an undecodable
        image) are not known here."""
        plan, rows = self.plan, sum(span.rows for span in spans.values())
        share = plan.pairs / rows if plan.pairs is not None and rows else 1.0
        kept = {}
        for unit, span in spans.items():
            path = os.path.join(plan.weights_dir, plan.shard_files[span.shard]) if plan.weights_dir else None
            if path is not None and os.path.isfile(path):
                weights = np.load(path, mmap_mode="r")[span.start:span.start + span.rows]
                kept[unit] = float(np.count_nonzero(weights != DROPPED))
            else:
                kept[unit] = span.rows * share
        return kept

    def reader_pairs(self, epoch: int, kept: dict[str, float], workers: int, world: int) -> list[list[float]]:
        """The pairs each (rank, DataLoader worker) reads in `epoch` (`kept`: per unit): the split
        `__iter__` makes, webdataset's split_by_node then split_by_worker of the epoch's unit order."""
        order, readers = self._unit_order(epoch), max(workers, 1)
        return [[sum(kept[u] for u in order[rank::world][worker::readers]) for worker in range(readers)]
                for rank in range(world)]

    def _weights_for(self, shard: str) -> np.ndarray | None:
        if self.plan.weights_dir is None:
            return None
        return np.load(os.path.join(self.plan.weights_dir, self.plan.shard_files[shard]), mmap_mode="r")

    def _pairs(self, units: Iterator[str], stats: _Tally) -> Iterator[tuple]:
        """(RawPair, weight) for every usable pair of the units; counts what was left out."""
        for unit in units:
            weights = self._weights_for(unit_shard(unit))
            for item in self.dataset.read(unit):
                if isinstance(item, UnitFailure):
                    stats.failures.append(f"{item.unit}: {item.reason}")
                    continue
                if item.error is not None:
                    stats.errors += 1
                    continue
                weight = 1.0
                if weights is not None:
                    weight = float(weights[item.index]) if item.index < len(weights) else float("nan")
                    if weight == DROPPED:
                        stats.dropped += 1
                        continue
                    if np.isnan(weight):  # the join checked every indexed pair: the shard changed since
                        raise RuntimeError(f"pair {item.shard}#{item.index} (key {item.key}) has no weight; "
                                           "the shard changed after training started")
                yield item, weight

    def _emit(self, rows: list[tuple], stats: LeftOut) -> Keyed:
        batch = {"key": [r[0].key for r in rows], "shard": [r[0].shard for r in rows],
                 "index": torch.tensor([r[0].index for r in rows], dtype=torch.long),
                 "weight": torch.tensor([r[1] for r in rows], dtype=torch.float32),
                 "left": self.preparer.collate(self.left, [r[2] for r in rows]),
                 "right": self.preparer.collate(self.right, [r[3] for r in rows]),
                 "stats": stats}
        if self.plan.left_digest:
            batch["left_digest"] = [content_digest(r[0].left) for r in rows]
        for name, preparer in (self.plan.extra_preparers or {}).items():
            batch[f"{name}_left"] = preparer.collate(self.left, [r[4][name][0] for r in rows])
            batch[f"{name}_right"] = preparer.collate(self.right, [r[4][name][1] for r in rows])
        return batch

    def _prepared(self, items: list) -> list[tuple | None]:
        """(left, right, {extra preparer: (left, right)}) of each item, None for one that failed."""
        preparers = {"": self.preparer, **(self.plan.extra_preparers or {})}
        sides = {name: (prepare_each(p, self.left, [item.left for item in items]),
                        prepare_each(p, self.right, [item.right for item in items])) for name, p in preparers.items()}
        prepared = []
        for i in range(len(items)):
            by_preparer = {name: (left[i], right[i]) for name, (left, right) in sides.items()}
            if any(isinstance(value, Exception) for pair in by_preparer.values() for value in pair):
                prepared.append(None)
                continue
            left, right = by_preparer.pop("")
            prepared.append((left, right, by_preparer))
        return prepared

    def __iter__(self):
        return first_batch_at_once(self._batches())

    def _batches(self):
        rank, _, worker, _ = wds.utils.pytorch_worker_info()
        units = wds.split_by_worker(wds.split_by_node(self._unit_order(self.epoch, self.repeat)))
        stats = _Tally()
        pairs = self._pairs(iter(units), stats)
        if self.shuffle and self.shuffle_buffer > 1:
            rng = random.Random(f"pairs-{self._order_key(self.epoch, self.repeat)}-{rank}-{worker}")
            pairs = wds.filters.shuffle(bufsize=self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng)(pairs)
        rows: list[tuple] = []
        pairs = iter(pairs)
        # As many pairs at a time as the batch still needs: the same batches as one pair at a time,
        # their images decoded a run at a time (`prepare_each`).
        while chunk := list(itertools.islice(pairs, self.batch_size - len(rows))):
            for (item, weight), prepared in zip(chunk, self._prepared([item for item, _ in chunk])):
                if prepared is None:  # an undecodable pair is skipped, never a dead worker
                    stats.errors += 1
                    continue
                rows.append((item, weight, *prepared))
            if len(rows) == self.batch_size:
                yield self._emit(rows, stats.take())
                rows = []
        if rows or stats:
            yield self._emit(rows, stats.take()) if rows else {"key": [], "stats": stats.take()}
