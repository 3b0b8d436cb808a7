"""Precomputed embeddings, opened: the immutable record every reader of them works from.

`layouts.open_embeddings` recognises and checks the files once and returns an `EmbeddingSource`;
nothing fills it in afterwards. Its `reader` (the layout class) reads it (units, batches)
through the one contract every embeddings layout honours (`layouts.EmbeddingLayout`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import pyarrow.parquet as pq

from pairclean.data.embeddings.batches import EmbeddingBatch
from pairclean.data.embeddings.npy import NpyPair
from pairclean.data.embeddings.saved import SavedEmbeddings
from pairclean.data.record import DatasetRecord


class Reads(Protocol):
    """What an embeddings layout does with an opened source (`layouts.EmbeddingLayout`)."""

    name: str
    label: str
    rows_in_place: bool

    @classmethod
    def units(cls, source: EmbeddingSource, unit_rows: int) -> list[str]: ...

    @classmethod
    def batches(cls, source: EmbeddingSource, unit: str, batch_rows: int) -> Iterator[EmbeddingBatch]: ...


@dataclass(frozen=True)
class EmbeddingSource:
    layout: str  # the registered layout's name: clip-retrieval, numpy, parquet-embeddings, datacomp-npz
    pair: str
    sources: tuple[str, ...]  # what the user named (a directory, .npy / .npz files, Parquet files)
    left_field: str | None
    right_field: str | None
    key_field: str | None  # the key column (the layout's metadata key when not named)
    dim: int | None
    reader: Reads = field(repr=False, compare=False)  # the layout class that reads it
    npy: tuple[NpyPair, ...] = ()  # array pairs read in place (clip-retrieval, numpy, DataComp .npz)
    parquet: tuple[str, ...] = ()  # Parquet files with two list<float> columns
    keys_file: str | None = None  # the numpy layout's key Parquet
    pairs: DatasetRecord | None = None  # the dataset of pairs the embeddings describe, when the layout says
    # (DataComp, or the record `score --save-embeddings` kept of the dataset it scored)
    saved: SavedEmbeddings | None = None  # DIR/provenance.json of a directory `score --save-embeddings` wrote

    @property
    def rows_in_place(self) -> bool:
        """Rows are arrays at fixed offsets (`npy`), readable by position (what dedup needs)."""
        return self.reader.rows_in_place

    def inputs(self) -> list[str]:
        """Every file the source reads: the arrays, their metadata, the Parquet files."""
        return list(dict.fromkeys([p for n in self.npy for p in (n.left, n.right, n.keys) if p] + list(self.parquet)))

    def rows(self) -> int:
        return sum(n.rows for n in self.npy) if self.npy else sum(pq.ParquetFile(p).metadata.num_rows
                                                                for p in self.parquet)

    def units(self, unit_rows: int) -> list[str]:
        """Every unit in output order: row chunks of each array pair, or each Parquet row group."""
        return self.reader.units(self, unit_rows)

    def batches(self, unit: str, batch_rows: int) -> Iterator[EmbeddingBatch]:
        """The unit's rows in batches of at most `batch_rows`, as the layout reads them."""
        return self.reader.batches(self, unit, batch_rows)

    def describe(self) -> str:
        """The one line a run over these embeddings starts with."""
        key = self.key_field or next((n.key_column for n in self.npy if n.key_column), None) or "none (file/row)"
        pairs = f"; the pairs they describe: {', '.join(self.pairs.sources)}" if self.pairs else ""
        return (f"reading {self.reader.label}: left={self.left_field}, right={self.right_field} ({self.dim}-d), "
                f"key={key}; {len(self.npy) or len(self.parquet)} file(s), {self.rows():,} rows{pairs}")

    def record(self) -> DatasetRecord:
        """What a scores file records about the embeddings it scored (and the pairs they describe)."""
        return DatasetRecord(format=self.layout, sources=[s if "://" in s else os.path.abspath(s) for s in self.sources], pair=self.pair,
                             fields={"left": self.left_field, "right": self.right_field, "key": self.key_field},
                             key=self.key_field, pairs=self.pairs)
