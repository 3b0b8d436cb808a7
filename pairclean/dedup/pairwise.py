"""Duplicates inside one cluster: pairwise cosines in blocks, SemDeDup's rule, and the groups.

The members come in keep order (the one to keep first). As in SemDeDup (`semdedup.py`: the
column maximum of the upper triangle of the similarity matrix), member j is removed when its
largest cosine to any member before it exceeds the threshold (`> 1 - eps`), whether or not that
earlier member was itself removed; so the first of any set of near-copies is always kept, and
which copy survives is decided by the order alone.

A removed member belongs to the group of the member it duplicates: the most similar earlier
member that was kept, when one is above the threshold, else the most similar earlier member
(removed itself, so its group is followed: SemDeDup's rule can remove a member whose only near
copy was removed too). Every group therefore holds exactly one kept member and is named after it.
Each member's nearest other member (any similarity, before or after it) is recorded too.

The matrix is never whole: blocks of `block_rows` members are read and compared with every
earlier block (the lower triangle only: each pair once), so memory is two blocks of vectors and a
block x block matrix, whatever the cluster's size. With `both` sides, a pair's similarity is the
smaller of its two cosines: a duplicate on both sides has both above the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch


@dataclass
class ClusterDuplicates:
    """Per member, in keep order."""

    nearest: np.ndarray  # int64: the most similar other member (-1: the cluster has one member)
    nearest_sim: np.ndarray  # float32: its similarity (NaN: none)
    earlier_sim: np.ndarray  # float32: the largest similarity to a member before it (-inf: the first)
    removed: np.ndarray  # bool: earlier_sim > threshold
    parent: np.ndarray  # int64: the earlier member a removed one duplicates (-1: kept)
    root: np.ndarray  # int64: the kept member whose group it is in (itself when kept)


def _similarity(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    sims = [x @ y.T for x, y in zip(a, b)]
    return sims[0] if len(sims) == 1 else torch.minimum(*sims)


class _Best:
    """A running maximum and where it was, per member of a span."""

    def __init__(self, n: int):
        self.value = np.full(n, -np.inf, np.float32)
        self.where = np.full(n, -1, np.int64)

    def update(self, start: int, values: torch.Tensor, where: torch.Tensor, offset: int) -> None:
        values, where = values.numpy(), where.numpy() + offset
        span = slice(start, start + len(values))
        better = values > self.value[span]  # ties keep the earlier-found (lower) member
        self.value[span] = np.where(better, values, self.value[span])
        self.where[span] = np.where(better, where, self.where[span])


def _row_best(sims: torch.Tensor, allowed: torch.Tensor | None = None):
    """Row maxima (and arg) of `sims` over the allowed columns (bool matrix or column mask)."""
    if allowed is not None:
        sims = torch.where(allowed, sims, torch.tensor(-torch.inf))
    return sims.max(dim=1)


def cluster_duplicates(read: Callable[[int, int], list[np.ndarray]], n: int, threshold: float,
                       block_rows: int) -> ClusterDuplicates:
    """`read(a, b)`: members a..b-1 (keep order) as unit float32 vectors, one array per side."""
    nearest, earlier, earlier_kept = _Best(n), _Best(n), _Best(n)
    removed = np.zeros(n, bool)
    blocks = [(a, min(a + block_rows, n)) for a in range(0, n, block_rows)]
    for jb, (ja, jz) in enumerate(blocks):
        xj = [torch.from_numpy(x) for x in read(ja, jz)]
        for ia, iz in blocks[:jb]:  # earlier blocks: every member there comes before, its fate is known
            sims = _similarity(xj, [torch.from_numpy(x) for x in read(ia, iz)])
            earlier.update(ja, *_row_best(sims), ia)
            kept = torch.from_numpy(~removed[ia:iz])
            if kept.any():
                earlier_kept.update(ja, *_row_best(sims, kept[None, :]), ia)
            nearest.update(ja, *sims.max(dim=1), ia)
            nearest.update(ia, *sims.max(dim=0), ja)  # the same pairs seen from the earlier block
        sims = _similarity(xj, xj)  # the diagonal block, last: its members' fate is decided by it
        sims.fill_diagonal_(-torch.inf)
        below = torch.tril(torch.ones_like(sims, dtype=torch.bool), diagonal=-1)
        earlier.update(ja, *_row_best(sims, below), ja)
        removed[ja:jz] = earlier.value[ja:jz] > threshold
        kept = torch.from_numpy(~removed[ja:jz])
        earlier_kept.update(ja, *_row_best(sims, below & kept[None, :]), ja)
        nearest.update(ja, *sims.max(dim=1), ja)
    own_kept = earlier_kept.value > threshold
    parent = np.where(removed, np.where(own_kept, earlier_kept.where, earlier.where), -1)
    root = np.arange(n, dtype=np.int64)
    for j in np.flatnonzero(removed):  # parents come earlier: their root is already final
        root[j] = root[parent[j]]
    nearest_sim = np.where(nearest.where >= 0, nearest.value, np.nan).astype(np.float32)
    return ClusterDuplicates(nearest.where, nearest_sim, earlier.value, removed, parent, root)
