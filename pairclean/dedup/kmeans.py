"""Spherical k-means on a sample, and the nearest centroid of every vector: faiss where installed,
torch where not.

SemDeDup clusters with `faiss.Kmeans(d, k, niter, seed, spherical=True)` (its config: cosine,
spherical, 100 iterations, 50,000 centroids for LAION-440M) and assigns every vector to its
nearest centroid by inner product. With faiss importable (`pip install faiss-cpu`, or
faiss-gpu) that is what runs here. Without it, the same algorithm in torch: centroids start as
k distinct sample vectors drawn with the seed, each iteration assigns by the largest cosine and
moves each centroid to the normalised mean of its members, and an empty cluster takes half of a
large one (faiss's rule: a member-weighted draw, the two centroids pushed apart by a small
perturbation). Both are exact nearest-centroid searches (one matrix product per block of
vectors); they differ in their random draws, so the backend is part of a run's pinned settings.
"""

from __future__ import annotations

import numpy as np
import torch

from pairclean.config import check_choice
from pairclean.errors import ConfigError

BACKENDS = ("auto", "faiss", "torch")
SEARCH_ELEMENTS = 1 << 24  # rows x centroids per block of the nearest-centroid search (64 MB of float32)
SPLIT_EPS = 1.0 / 1024  # faiss's perturbation when a large cluster is split for an empty one


def faiss_module():
    try:
        import faiss
    except ImportError:
        return None
    return faiss


def resolve_backend(backend: str) -> str:
    """`auto` -> faiss if it can be imported, else torch; `faiss` without faiss is refused."""
    check_choice(backend, BACKENDS, "backend", "k-means backend")
    if backend == "auto":
        return "faiss" if faiss_module() is not None else "torch"
    if backend == "faiss" and faiss_module() is None:
        raise ConfigError("backend faiss needs the faiss package (pip install faiss-cpu); "
                          "or use backend torch", "backend")
    return backend


def nearest_centroid(x: np.ndarray, centroids: np.ndarray, backend: str) -> tuple[np.ndarray, np.ndarray]:
    """(index int32, cosine float32) of each unit vector's nearest centroid (largest inner product)."""
    if len(x) == 0:
        return np.empty(0, np.int32), np.empty(0, np.float32)
    if backend == "faiss":
        faiss = faiss_module()
        index = faiss.IndexFlatIP(centroids.shape[1])
        index.add(np.ascontiguousarray(centroids, dtype=np.float32))
        sims, labels = index.search(np.ascontiguousarray(x, dtype=np.float32), 1)
        return labels[:, 0].astype(np.int32), sims[:, 0].astype(np.float32)
    c = torch.from_numpy(np.ascontiguousarray(centroids, dtype=np.float32))
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    step = max(256, SEARCH_ELEMENTS // max(len(c), 1))
    labels, sims = np.empty(len(t), np.int32), np.empty(len(t), np.float32)
    for a in range(0, len(t), step):
        best = (t[a:a + step] @ c.T).max(dim=1)
        labels[a:a + step] = best.indices.numpy()
        sims[a:a + step] = best.values.numpy()
    return labels, sims


def train_kmeans(sample: np.ndarray, k: int, iterations: int, seed: int, backend: str) -> np.ndarray:
    """k unit-length centroids (float32) of the unit vectors `sample` (at least k of them)."""
    sample = np.ascontiguousarray(sample, dtype=np.float32)
    if backend == "faiss":
        faiss = faiss_module()
        # the sample is already drawn: faiss must not subsample it again (max_points_per_centroid)
        kmeans = faiss.Kmeans(sample.shape[1], k, niter=iterations, seed=seed, spherical=True, verbose=False,
                              max_points_per_centroid=max(1, -(-len(sample) // k)), min_points_per_centroid=1)
        kmeans.train(sample)
        return np.ascontiguousarray(kmeans.centroids, dtype=np.float32)
    return _torch_kmeans(sample, k, iterations, seed)


def _unit(t: torch.Tensor) -> torch.Tensor:
    return t / t.norm(dim=1, keepdim=True).clamp_min(1e-30)


def _torch_kmeans(sample: np.ndarray, k: int, iterations: int, seed: int) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    x = torch.from_numpy(sample)
    centroids = x[torch.randperm(len(x), generator=generator)[:k]].clone()
    labels = None
    for _ in range(iterations):
        new_labels, _ = nearest_centroid(sample, centroids.numpy(), "torch")
        new_labels = torch.from_numpy(new_labels).long()
        if labels is not None and torch.equal(new_labels, labels):
            break  # converged: another iteration would change nothing
        labels = new_labels
        sums = torch.zeros_like(centroids).index_add_(0, labels, x)
        counts = torch.bincount(labels, minlength=k)
        centroids = torch.where((counts > 0)[:, None], _unit(sums), centroids)
        _split_for_empty(centroids, counts, generator)
    return centroids.numpy().astype(np.float32)


def _split_for_empty(centroids: torch.Tensor, counts: torch.Tensor, generator: torch.Generator) -> None:
    """Give each empty cluster half of a large one, as faiss does: a cluster drawn with probability
    proportional to (members - 1), its centroid and the empty one pushed apart symmetrically."""
    counts = counts.clone().double()
    for empty in torch.nonzero(counts == 0).flatten().tolist():
        weights = (counts - 1).clamp_min(0)
        if weights.sum() <= 0:
            return
        donor = int(torch.multinomial(weights, 1, generator=generator))
        noise = SPLIT_EPS * (2 * torch.rand(centroids.shape[1], generator=generator) - 1)
        base = centroids[donor].clone()
        centroids[empty] = _unit((base + noise)[None])[0]
        centroids[donor] = _unit((base - noise)[None])[0]
        counts[empty] = counts[donor] / 2
        counts[donor] -= counts[empty]
