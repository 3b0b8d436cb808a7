"""OSA scoring functions (osa.md): cosine similarity, cone debiasing, weight functions, decisions.

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
