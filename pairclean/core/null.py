"""Null calibration: similarities judged against in-data pairs that do not belong together.

The null sample (finalize's `FitContext.null_sample`) holds the cosines of one row's left with
another row's right. Against its m sorted values:

- p-value of a pair with similarity s: (1 + #{null >= s}) / (1 + m), the share of random
  pairings at least as similar, with the +1 that keeps it valid for a finite null.
- Benjamini-Hochberg q-value. p takes one of m + 1 values (p_k = (1 + k) / (1 + m), k = the count
  of null values >= s), so BH reduces to a table over k: q_k = min over j >= k of p_j / F(p_j),
  where F(p_j) is the share of all pairs with a p-value <= p_j (the BH rank divided by N). F is
  taken from finalize's uniform sample of the similarities: exact when the sample holds every
  pair (N <= gmm_sample, default one million), within the sampling error of a million-pair
  uniform sample (about 0.1 pt of rank share) beyond. Memory: m + 1 floats, whatever N is.
- Random-pairing share (Storey's pi0 at lambda = 1/2): twice the share of pairs whose p-value
  exceeds 1/2, i.e. the share of pairs that look like random pairings, with a 95% Wilson interval
  on the sample. It is named for what it measures: it estimates only the noise that is as
  dissimilar as a random pairing; a caption that belongs to a similar item (hard noise) is not
  counted, so it is no estimate of all noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

STOREY_LAMBDA = 0.5
Z95 = 1.959963984540054


@dataclass
class NullCalibration:
    null: np.ndarray  # sorted null similarities
    q_table: np.ndarray  # q-value per count k of null values >= s, k = 0..m

    @classmethod
    def fit(cls, null_sample: np.ndarray, sample: np.ndarray) -> NullCalibration:
        null = np.sort(np.asarray(null_sample, dtype=np.float64))
        cal = cls(null, np.ones(len(null) + 1))
        counts = cal.counts(np.asarray(sample, dtype=np.float64))
        if len(counts):
            share = np.cumsum(np.bincount(counts, minlength=len(null) + 1)) / len(counts)  # F(p_k)
            with np.errstate(divide="ignore"):
                ratio = np.where(share > 0, cal.p_levels() / share, np.inf)
            cal.q_table = np.minimum(np.minimum.accumulate(ratio[::-1])[::-1], 1.0)
        return cal

    @property
    def m(self) -> int:
        return len(self.null)

    def p_levels(self) -> np.ndarray:
        return (1.0 + np.arange(self.m + 1)) / (1.0 + self.m)

    def counts(self, sim: np.ndarray) -> np.ndarray:
        """#{null >= s} per similarity (NaN counts as 0; callers mask those rows)."""
        return self.m - np.searchsorted(self.null, np.nan_to_num(sim, nan=np.inf), side="left")

    def p_values(self, sim: np.ndarray) -> np.ndarray:
        return (1.0 + self.counts(sim)) / (1.0 + self.m)

    def q_values(self, sim: np.ndarray) -> np.ndarray:
        return self.q_table[self.counts(sim)]

    def cut(self, alpha: float) -> float:
        """The similarity at or below which q > alpha (-inf: every pair passes; +inf: none does)."""
        passing = np.flatnonzero(self.q_table <= alpha)
        if not len(passing):
            return np.inf
        k = int(passing.max())  # q is non-decreasing in k: pairs with count <= k pass
        return -np.inf if k >= self.m else float(self.null[self.m - k - 1])

    def random_pairing_share(self, sample: np.ndarray) -> tuple[float, float, float]:
        """(estimate, low, high): Storey's pi0 with a 95% Wilson interval, clipped to [0, 1]."""
        n = len(sample)
        if n == 0:
            return np.nan, np.nan, np.nan
        above = float((self.p_values(np.asarray(sample, dtype=np.float64)) > STOREY_LAMBDA).mean())
        scale = 1.0 / (1.0 - STOREY_LAMBDA)
        return tuple(float(min(x * scale, 1.0)) for x in (above, *wilson(above, n)))


def wilson(share: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion observed as `share` of `n` (n may be fractional),
    at the normal quantile `z` (Z95: 95%)."""
    denominator = 1 + z * z / n
    centre = (share + z * z / (2 * n)) / denominator
    half = z * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n)) / denominator
    low, high = max(0.0, centre - half), min(1.0, centre + half)
    # exactly 0 and 1 at the ends (the formula's, which float rounding misses by an ulp)
    return (0.0 if share == 0 else low), (1.0 if share == 1 else high)
