"""OSA scoring functions (osa.md): cosine similarity, cone debiasing, weight functions, decisions,
and the draw of the null sample (pairs of the data that do not belong together).

One implementation serves offline scoring (numpy arrays from Parquet parts) and online
training (torch tensors in the loss): every function accepts either and returns the same type.
"""

from __future__ import annotations

import math

import numpy as np
import torch

WEIGHT_FUNCTIONS = ("cubic", "linear", "cosine", "official")
CUBIC_PEAK = 4.0 / 27.0  # s~^2 (1 - s~) peaks at s~ = 2/3
OFFICIAL_PEAK = 0.25  # x^2 (1 - x^2) peaks at x^2 = 1/2


def _as_tensor(x):
    if isinstance(x, torch.Tensor):
        return x, False
    return torch.as_tensor(np.asarray(x, dtype=np.float64)), True


def _back(t: torch.Tensor, was_numpy: bool):
    return t.numpy() if was_numpy else t


def cosine_from_products(dot, left_sq, right_sq):
    """The cosine from the row products u.v, u.u and v.v: u.v / (|u| |v|), NaN where either
    vector is zero or not finite (a pair with no cosine: the scores file's error row). The one
    division every scorer of stored vectors makes, in the products' own dtype (float32 there)."""
    if isinstance(dot, torch.Tensor):
        sim = dot / (left_sq.sqrt() * right_sq.sqrt())
        return torch.where(torch.isfinite(sim), sim, torch.full_like(sim, math.nan))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        sim = dot / (np.sqrt(left_sq) * np.sqrt(right_sq))
    return np.where(np.isfinite(sim), sim, np.nan).astype(np.asarray(dot).dtype, copy=False)


def cosine_similarity(left, right):
    """Row-wise cosine of paired embeddings (Eq. 3, broadcasting over leading axes); inputs need
    not be normalised. numpy in (as float64), numpy out; a torch tensor stays a tensor. NaN where
    a vector is zero or not finite (`cosine_from_products`)."""
    if isinstance(left, torch.Tensor):
        a, b = left, right.to(left.dtype)
    else:
        a, b = np.asarray(left, dtype=np.float64), np.asarray(right, dtype=np.float64)
    return cosine_from_products((a * b).sum(-1), (a * a).sum(-1), (b * b).sum(-1))


def null_partners(n: int) -> np.ndarray:
    """The right side each of n rows is paired with to draw "pairs that do not belong together"
    from the data itself: row i with row (i + n // 2) mod n, a fixed derangement (no row keeps its
    own partner for n >= 2), deterministic, so a resumed run draws the same null pairs; half a
    block apart, so neighbouring rows (often related in crawl order) are not paired."""
    return (np.arange(n) + n // 2) % n if n >= 2 else np.zeros(0, dtype=np.int64)


NULL_ROWS = 4096  # scored rows of a unit that draw a null pair: what a unit holds until it is committed


def null_keys(index) -> np.ndarray:
    """Each row's draw key (uint64) from its index in its shard alone (splitmix64's mix): which
    rows draw a null pair is then a property of the data, not of where it lies or how it is cut
    into batches, and the same pair saved as embeddings and scored again draws alike."""
    x = np.asarray(index, dtype=np.int64).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _host_rows(vectors, take: np.ndarray) -> np.ndarray:
    """Rows `take` of a numpy array (as stored) or a host tensor (as float32 or float64), taken by
    numpy (torch's indexing of a batch's rows cost 20-30 us a row here, numpy's a memcpy)."""
    if isinstance(vectors, torch.Tensor):
        vectors = (vectors if vectors.dtype in (torch.float32, torch.float64) else vectors.float()).numpy()
    return np.asarray(vectors[take])


class NullDraw:
    """One unit's null sample, drawn as its scored rows stream in, whatever batches carry them:
    the `size` rows (default NULL_ROWS) whose `null_keys` are least, each row's left paired, in row
    order, with the right of the row half the draw away (`null_partners`). A function of the
    unit's rows only, so another batch size, DataLoader workers, a torchrun or Ray world, or a
    resumed run draws the same pairs. Holds the vectors of at most about 3 x size rows."""

    def __init__(self, size: int | None = None):
        self.size = NULL_ROWS if size is None else size
        self.keys: list[np.ndarray] = []
        self.places: list[np.ndarray] = []
        self.left: list[np.ndarray] = []
        self.right: list[np.ndarray] = []
        self.held = 0
        self.bound: np.uint64 | None = None  # once `size` rows are held: the largest key among them

    def add(self, places: np.ndarray, index: np.ndarray, left, right, at: np.ndarray | None = None) -> None:
        """Scored rows: their places in the unit (increasing across calls), their indices in their
        shard, and their vectors (numpy or torch: place i's at row `at[i]`, default i). Only the
        rows that can still be among the least are copied."""
        keys = null_keys(index)
        take = np.arange(len(keys)) if self.bound is None else np.flatnonzero(keys < self.bound)
        if self.held + len(take) > 2 * self.size:  # a large block: copy only the rows that can be among the least
            every = np.concatenate([*self.keys, keys[take]])
            take = take[keys[take] <= np.partition(every, self.size - 1)[self.size - 1]]
        if not len(take):
            return
        rows = take if at is None else np.asarray(at)[take]
        self.keys.append(keys[take])
        self.places.append(np.asarray(places, dtype=np.int64)[take])
        self.left.append(_host_rows(left, rows))
        self.right.append(_host_rows(right, rows))
        self.held += len(take)
        if self.held >= 2 * self.size:
            self._keep_least()

    def _keep_least(self) -> None:
        """Keep the `size` least keys (ties: the earlier row; a later row never displaces an equal
        key), in row order: the held rows are always in row order, chunk after chunk."""
        keys, places = np.concatenate(self.keys), np.concatenate(self.places)
        least = np.sort(np.lexsort((places, keys))[:self.size])
        self.keys, self.places = [keys[least]], [places[least]]
        self.left, self.right = [np.concatenate(self.left)[least]], [np.concatenate(self.right)[least]]
        self.held = len(least)
        if self.held == self.size:
            self.bound = self.keys[0].max()

    def column(self, rows: int) -> np.ndarray:
        """The unit's `null_sim` column for its `rows` rows (float32): each drawing row's null
        cosine, from float32 row products as every cosine of stored vectors is
        (`cosine_from_products`), NaN elsewhere; none below two drawing rows (a row is never its
        own partner)."""
        column = np.full(rows, np.nan, dtype=np.float32)
        if self.held < 2:
            return column
        if self.held > self.size:
            self._keep_least()
        left = np.concatenate(self.left).astype(np.float32, copy=False)
        right = np.concatenate(self.right)[null_partners(self.held)].astype(np.float32, copy=False)
        column[np.concatenate(self.places)] = cosine_from_products(
            np.einsum("ij,ij->i", left, right), np.einsum("ij,ij->i", left, left), np.einsum("ij,ij->i", right, right))
        return column


def debias(sim, beta: float):
    """s~ = s - beta: move the origin to the centre of the embedding cone (Eq. 4)."""
    return sim - beta


def cone_weight(sim_debiased, fn: str = "cubic", scale: float | None = None):
    """The OSA weight w(s~) (Eq. 5 and Appendix F.1); zero for pairs outside the cone boundary.

    `official` follows the authors' code: x = clamp(s~, 0) / scale, w = x^2 (1 - x^2), where
    `scale` is max(clamp(s~, 0)) over the dataset (offline) or the batch (online).
    """
    t, was_np = _as_tensor(sim_debiased)
    pos = t.clamp(min=0)
    if fn == "cubic":
        w = pos.pow(2) * (1 - pos)
    elif fn == "linear":
        w = pos
    elif fn == "cosine":
        w = torch.where(t > 0, (torch.cos(math.pi * (t - 1)) + 1) / 2, torch.zeros_like(t))
    elif fn == "official":
        if scale is None:
            scale = float(pos.max()) if pos.numel() else 1.0
        x = pos / scale if scale > 0 else pos
        w = x.pow(2) * (1 - x.pow(2))
    else:
        raise ValueError(f"unknown weight function {fn!r}; choose one of {', '.join(WEIGHT_FUNCTIONS)}")
    return _back(w.clamp(min=0), was_np)


def normalised_weight(weight, fn: str = "cubic", beta: float = 0.0):
    """Map a weight function's range onto [0, 1] so users can threshold it across functions."""
    t, was_np = _as_tensor(weight)
    if fn == "cubic":
        t = t / CUBIC_PEAK
    elif fn == "linear":
        t = t / max(1.0 - beta, 1e-12)  # s~ <= 1 - beta
    elif fn == "official":
        t = t / OFFICIAL_PEAK
    elif fn != "cosine":
        raise ValueError(f"unknown weight function {fn!r}")
    return _back(t.clamp(0, 1), was_np)


def beta_noisy(sim_debiased):
    """The cone-boundary decision: a pair is noisy iff s~ <= 0 (Table 5 protocol)."""
    return sim_debiased <= 0
