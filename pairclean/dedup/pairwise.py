"""Duplicates inside one cluster: pairwise cosines in blocks, SemDeDup's rule, and the groups.

The members come in keep order (the one to keep first). As in SemDeDup (`semdedup.py`: the
column maximum of the upper triangle of the similarity matrix), member j is removed when its
largest cosine to any member before it exceeds the threshold (`> 1 - eps`), whether or not that
earlier member was itself removed; so the first member of every group is always kept, and which
copy survives is decided by the order alone. A group is a connected component of the pairs above
the threshold. Each member's nearest other member (any similarity) is recorded too.

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
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components


@dataclass
class ClusterDuplicates:
    """Per member, in keep order."""

    nearest: np.ndarray  # int64: the most similar other member (-1: the cluster has one member)
    nearest_sim: np.ndarray  # float32: its similarity (NaN: none)
    earlier_sim: np.ndarray  # float32: the largest similarity to a member before it (-inf: the first)
    component: np.ndarray  # int64: groups = components of the pairs above the threshold (labels 0..)
    removed: np.ndarray  # bool: earlier_sim > threshold


def _similarity(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    sims = [x @ y.T for x, y in zip(a, b)]
    return sims[0] if len(sims) == 1 else torch.minimum(*sims)


def cluster_duplicates(read: Callable[[int, int], list[np.ndarray]], n: int, threshold: float,
                       block_rows: int) -> ClusterDuplicates:
    """`read(a, b)`: members a..b-1 (keep order) as unit float32 vectors, one array per side."""
    nearest = np.full(n, -1, np.int64)
    nearest_sim = np.full(n, -np.inf, np.float32)
    earlier = np.full(n, -np.inf, np.float32)
    edges_i, edges_j = [], []
    blocks = [(a, min(a + block_rows, n)) for a in range(0, n, block_rows)]
    for jb, (ja, jz) in enumerate(blocks):
        xj = [torch.from_numpy(x) for x in read(ja, jz)]
        for ia, iz in blocks[:jb + 1]:
            xi = xj if ia == ja else [torch.from_numpy(x) for x in read(ia, iz)]
            sims = _similarity(xj, xi)  # rows: members ja..jz, columns: ia..iz
            if ia == ja:  # the diagonal block: a member is not its own duplicate; earlier = below the diagonal
                sims.fill_diagonal_(-torch.inf)
                below = torch.tril(torch.ones_like(sims, dtype=torch.bool), diagonal=-1)
                before = torch.where(below, sims, torch.tensor(-torch.inf)).max(dim=1).values
                pairs = torch.nonzero(below & (sims > threshold))
            else:
                before = sims.max(dim=1).values
                pairs = torch.nonzero(sims > threshold)
            earlier[ja:jz] = np.maximum(earlier[ja:jz], before.numpy())
            _update_nearest(nearest, nearest_sim, ja, sims.max(dim=1), ia)
            if ia != ja:  # the same pairs seen from the earlier block's side
                _update_nearest(nearest, nearest_sim, ia, sims.max(dim=0), ja)
            if len(pairs):
                edges_j.append(pairs[:, 0].numpy() + ja)
                edges_i.append(pairs[:, 1].numpy() + ia)
    component = _components(n, edges_i, edges_j)
    nearest_sim[nearest < 0] = np.nan
    return ClusterDuplicates(nearest, nearest_sim, earlier, component, earlier > threshold)


def _update_nearest(nearest: np.ndarray, nearest_sim: np.ndarray, start: int, best, offset: int) -> None:
    values, where = best.values.numpy(), best.indices.numpy() + offset
    span = slice(start, start + len(values))
    better = values > nearest_sim[span]  # ties keep the earlier-found (lower) member
    nearest_sim[span] = np.where(better, values, nearest_sim[span])
    nearest[span] = np.where(better, where, nearest[span])


def _components(n: int, edges_i: list[np.ndarray], edges_j: list[np.ndarray]) -> np.ndarray:
    if not edges_i:
        return np.arange(n, dtype=np.int64)
    i, j = np.concatenate(edges_i), np.concatenate(edges_j)
    graph = coo_matrix((np.ones(len(i), np.int8), (i, j)), shape=(n, n))
    return connected_components(graph, directed=False)[1].astype(np.int64)
