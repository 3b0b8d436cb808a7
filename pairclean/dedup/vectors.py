"""The embeddings dedup reads, by side and by position.

Rows are numbered across the input in the order of its units (file pair after file pair): that
number (`row`) is the dedup's own identity of a pair; the output names it by key, shard and index.
Streaming (the assignment pass) goes through the embeddings reader (`data.embeddings`); the
k-means sample and each cluster's members are read by position with pread from the arrays in
place (.npy files, or the uncompressed members of DataComp's .npz; no memory map: resident memory
stays the rows asked for, however large the files). Parquet embedding columns cannot be read by
row in place, so that layout is refused.

A side is `image` (the left vectors: img_emb/), `text` (the right ones: text_emb/) or `both`.
Vectors are compared by cosine: rows are L2-normalised when read; a zero or non-finite vector
cannot be compared and takes no part (it is kept, in no cluster). For k-means, `both` is the
concatenation of the two unit vectors divided by sqrt(2), whose dot product is the mean of the
two cosines; duplicates on both sides are decided on each side's own cosine.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from pairclean.config import check_choice
from pairclean.errors import UserError
from pairclean.data.embeddings import EmbeddingBatch, EmbeddingSource, NpyFiles

SIDES = ("image", "text", "both")
SIDE_COLUMNS = {"image": (0,), "text": (1,), "both": (0, 1)}  # 0: left (img_emb), 1: right (text_emb)
OPEN_FILES = 64  # .npy pairs kept open at a time (a clip-retrieval output can hold thousands)


def normalised(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows as float32 unit vectors, which rows are usable): zero or non-finite rows are zeros, unusable."""
    t = torch.from_numpy(np.ascontiguousarray(x)).float()  # torch converts float16 with F16C
    norms = t.norm(dim=1)
    usable = torch.isfinite(norms) & (norms > 0) & torch.isfinite(t).all(dim=1)
    t = torch.where(usable[:, None], t / norms.clamp_min(1e-30)[:, None], torch.zeros((), dtype=t.dtype))
    return t.numpy(), usable.numpy()


def joined(sides: list[np.ndarray]) -> np.ndarray:
    """One vector per row for k-means: the side itself, or both unit vectors side by side / sqrt(2)."""
    if len(sides) == 1:
        return sides[0]
    return np.concatenate(sides, axis=1) / np.float32(np.sqrt(len(sides)))


class Vectors:
    """The rows of an array embeddings input (clip-retrieval, a numpy pair, DataComp's .npz) by global position."""

    def __init__(self, spec: EmbeddingSource, side: str):
        check_choice(side, SIDES, "side")
        if not spec.rows_in_place:
            raise UserError(f"dedup reads array embeddings by row in place (clip-retrieval, numpy or datacomp-npz "
                            f"layouts; `pairclean score --save-embeddings` writes clip-retrieval's); this input is "
                            f"{spec.layout}, whose rows cannot be read by position: write its columns as .npy arrays")
        self.spec, self.side = spec, side
        self.columns = SIDE_COLUMNS[side]
        self.starts = np.cumsum([0] + [pair.rows for pair in spec.npy]).astype(np.int64)
        self.rows = int(self.starts[-1])
        self.dim = int(spec.dim or 0)
        self._open: OrderedDict[int, NpyFiles] = OrderedDict()

    def unit_start(self, left: str, start: int) -> int:
        """The global row of row `start` of the file pair whose left file is `left`."""
        number = next(i for i, pair in enumerate(self.spec.npy) if pair.left == left)
        return int(self.starts[number]) + start

    def batch(self, batch: EmbeddingBatch) -> tuple[list[np.ndarray], np.ndarray]:
        """A streamed batch's vectors of this side (the other side is not read), normalised, and
        which rows are usable."""
        return self._normalise([batch.rows.array(c) for c in self.columns])

    def read(self, positions: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """The vectors of rows `positions` (global, any order), in that order, normalised."""
        positions = np.asarray(positions, dtype=np.int64)
        order = np.argsort(positions, kind="stable")
        ordered = positions[order]
        dtype = np.dtype(self.spec.npy[0].dtype) if self.spec.npy else np.dtype(np.float32)
        raw = [np.empty((len(positions), self.dim), dtype=dtype) for _ in self.columns]
        pair_of = np.searchsorted(self.starts, ordered, side="right") - 1
        # runs of consecutive rows of one file pair are read with one pread per side
        breaks = np.flatnonzero((np.diff(ordered) != 1) | (np.diff(pair_of) != 0)) + 1
        for a, b in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(ordered)]])):
            if a == b:
                continue
            files = self._files(int(pair_of[a]))
            row = int(ordered[a] - self.starts[pair_of[a]])
            for out, column in zip(raw, self.columns):
                files.read(column, row, out[a:b])
        sides, usable = self._normalise(raw)
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        return [s[back] for s in sides], usable[back]

    def _normalise(self, raw: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
        sides, usable = [], None
        for x in raw:
            unit, ok = normalised(x)
            sides.append(unit)
            usable = ok if usable is None else usable & ok
        return sides, usable

    def _files(self, number: int) -> NpyFiles:
        files = self._open.pop(number, None)
        if files is None:
            files = NpyFiles(self.spec.npy[number])
            if len(self._open) >= OPEN_FILES:
                self._open.popitem(last=False)[1].close()
        self._open[number] = files
        return files

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()
