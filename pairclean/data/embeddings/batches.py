"""Rows of embeddings as the readers hand them on: a batch of (key, shard, index) and its two sides'
vectors, in memory (a Parquet batch) or read block by block from .npy data into reused per-thread
buffers, so resident memory is a few blocks, not the file."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairclean.data.embeddings.npy import ORIGIN_COLUMNS, NpyFiles, NpyPair
from pairclean.ops.records import Keyed

BLOCK_ROWS = 2048  # rows read at a time into a per-thread buffer (see docs/pair-kinds.md for the measurement)

_buffers = threading.local()  # per-thread, reused block buffers: no allocation, no page faults


def block_buffer(slot: str, dtype: np.dtype, dim: int) -> np.ndarray:
    """A per-thread buffer of BLOCK_ROWS rows, reused for every block read into (or converted in) this slot."""
    cache = _buffers.__dict__.setdefault("arrays", {})
    key = (slot, dtype.str, dim, BLOCK_ROWS)
    if key not in cache:
        cache[key] = np.empty((BLOCK_ROWS, dim), dtype=dtype)
    return cache[key]


class ArrayRows:
    """Row pairs already in memory (a Parquet batch)."""

    def __init__(self, left: np.ndarray, right: np.ndarray):
        self.left, self.right = left, right

    def __len__(self) -> int:
        return len(self.left)

    def block(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        return self.left[a:b], self.right[a:b]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self.left, self.right


class NpyRows:
    """Rows [start, stop) of an .npy pair, read block by block into per-thread buffers."""

    def __init__(self, files: NpyFiles, start: int, stop: int):
        self.files, self.start, self.stop = files, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def block(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        out = []
        for side, slot in ((0, "raw-left"), (1, "raw-right")):
            buf = block_buffer(slot, self.files.dtype, self.files.dim)[:b - a]
            self.files.read(side, self.start + a, buf)
            out.append(buf)
        return out[0], out[1]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self.array(0), self.array(1)

    def array(self, side: int) -> np.ndarray:
        """One side's rows (0: left, 1: right), read whole into a new array."""
        array = np.empty((len(self), self.files.dim), dtype=self.files.dtype)
        self.files.read(side, self.start, array)
        return array


@dataclass
class EmbeddingBatch:
    shard: str
    index: np.ndarray  # row numbers within `shard`
    keys: pa.Array | None
    rows: ArrayRows | NpyRows
    bad: dict[int, str] = field(default_factory=dict)  # row position -> reason it has no usable vector
    origin: tuple[pa.Array, pa.Array] | None = None  # (shard, index) of each row's pair in its dataset, if recorded

    def identity(self) -> tuple[pa.Array, pa.Array, np.ndarray]:
        """(key, shard, index) of every row, as the scores file names the pair: where the metadata
        records the pair's dataset shard and index (`score --save-embeddings`), those, so scores
        computed again from the embeddings join the first run's and its truth; else the embedding
        file and the row in it, and `<file stem>/<row>` for a missing key."""
        keys = self.keys if self.keys is not None else default_keys(self.shard, self.index)
        if self.origin is not None:
            return keys, self.origin[0], self.origin[1].to_numpy(zero_copy_only=False)
        return keys, pa.repeat(self.shard, len(self.index)), self.index


def default_keys(shard: str, index: np.ndarray) -> pa.Array:
    """`<file stem>/<row>` for rows without a key file."""
    return pc.binary_join_element_wise(Path(shard).stem, pc.cast(pa.array(index), pa.string()), "/")


def read_metadata(pair: NpyPair, start: int, stop: int) -> pa.Table | None:
    """The key (and origin) columns of rows [start, stop) from the pair's metadata file, reading
    only the row groups they span."""
    if pair.keys is None:
        return None
    pf = pq.ParquetFile(pair.keys)
    groups, first, offset = [], None, 0
    for i in range(pf.num_row_groups):
        n = pf.metadata.row_group(i).num_rows
        if offset + n > start and offset < stop:
            groups.append(i)
            first = offset if first is None else first
        offset += n
    columns = [pair.key_column, *(ORIGIN_COLUMNS if pair.origin else ())]
    table = pf.read_row_groups(groups, columns=columns).slice(start - first, stop - start)
    return pa.table([pc.cast(table.column(0), pa.string()),
                     *([pc.cast(table.column(1), pa.string()), pc.cast(table.column(2), pa.int64())]
                       if pair.origin else [])],
                    names=["key", *(ORIGIN_COLUMNS if pair.origin else ())])


def list_column(column: pa.Array, dim: int, what: str) -> tuple[np.ndarray, Keyed[int, str]]:
    """(rows x dim float array, bad rows) from a list<float> column; a null or wrongly sized list
    becomes a bad row (zeros in the array)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    nulls = column.is_null().to_numpy(zero_copy_only=False)
    good = ~nulls & (np.nan_to_num(lengths, nan=-1) == dim)
    out = np.zeros((len(column), dim), dtype=np.float32)
    if good.all():
        out[:] = column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), dim)
    elif good.any():
        kept = column.filter(pa.array(good))
        out[good] = kept.flatten().to_numpy(zero_copy_only=False).reshape(int(good.sum()), dim)
    bad = {int(i): (f"missing {what} embedding" if nulls[i] else
                    f"{what} embedding has {int(lengths[i])} values, expected {dim}") for i in np.flatnonzero(~good)}
    return out, bad
