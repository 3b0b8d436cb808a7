"""Estimates for a whole dataset from a stratified random sample of it, with 95% intervals.

A blind audit (`curate/audit.py`) draws `drawn_h` pairs at random from each stratum h of the scored
pairs (strata: ranges of `sim` holding about equally many of the N_h pairs) and a person marks
them. Every share the audit reports is a ratio of two population totals, Y / X, where y and x are
per-pair indicators: the noise share (y = noisy, x = 1), a rule's precision (y = noisy and
flagged, x = flagged), its recall (y = noisy and flagged, x = noisy), the noise left in what it
keeps (y = noisy and kept, x = kept). Each is estimated the same way (Cochran, Sampling
Techniques, 3rd ed., sections 5.2 and 6.11):

* the combined ratio estimator R = sum_h (N_h / n_h) sum_i y_i / sum_h (N_h / n_h) sum_i x_i, where
  n_h is the number of pairs of stratum h that were marked (a pair left unmarked is missing at
  random: the page shows the pairs in random order);
* its linearised variance v = sum_h N_h^2 (1 - n_h / N_h) s_h^2(z) / n_h / X^2, with
  z_i = x_i (y_i - R) and s_h^2 the within-stratum sample variance (ddof 1);
* the Wilson score interval at Kish's effective sample size n_eff = R (1 - R) / v (the sample
  size a simple random sample would need for the same variance; the number of sampled pairs with
  x = 1 when v = 0, i.e. when every stratum is pure).

Why this interval: a share near 0 or 1 (a rule's precision is often 95-100%) is where the
normal-approximation interval R +- 1.96 sqrt(v) fails (it covered the GMM rule's precision 75% of
the time at 100 marked pairs in the simulation of docs/lab.md); Wilson's interval stays inside
[0, 1] and keeps its coverage there, and n_eff carries the gain of stratification (v below a
simple random sample's) into it. Measured coverage: docs/lab.md, "The blind audit".

The design a blind audit records (its strata's sim ranges, pairs N_h and pairs drawn) travels from
the page through the exported marks into the truth Parquet's metadata (DESIGN_KEY); `read_design`
types it strictly wherever it is read, `audit_design` finds it in a truth file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from scipy.stats import norm

from pairclean.config import INT64_MAX
from pairclean.core.null import wilson
from pairclean.errors import UserError

CONFIDENCE = 0.95
DESIGN_KEY = b"pairclean_audit"  # a blind audit's design, in its truth Parquet's key-value metadata
DESIGN_VERSION = 1


@dataclass(frozen=True)
class Estimate:
    """A share of the whole dataset (0..1) with its interval; `sampled`: the sampled pairs with x = 1."""

    value: float | None
    low: float | None
    high: float | None
    effective_n: float | None
    sampled: int

    def as_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high, "effective_n": self.effective_n,
                "sampled": self.sampled}


def ratio_estimate(y, x, strata, population: dict[int, int], confidence: float = CONFIDENCE) -> Estimate:
    """sum Y / sum X over the population, from the sampled pairs' indicators `y`, `x` (y implies x)
    and their `strata`; `population`: pairs per stratum (N_h). No sampled pair with x = 1: no estimate."""
    y = np.asarray(y, dtype=float)
    x = np.asarray(x, dtype=float)
    strata = np.asarray(strata)
    sampled = int(x.sum())
    rows = {h: strata == h for h in population}
    counts = {h: int(sel.sum()) for h, sel in rows.items()}
    weights = {h: population[h] / counts[h] for h in population if counts[h]}
    total_x = sum(w * x[rows[h]].sum() for h, w in weights.items())
    if sampled == 0 or total_x == 0:
        return Estimate(None, None, None, None, sampled)
    ratio = sum(w * y[rows[h]].sum() for h, w in weights.items()) / total_x
    variance = 0.0
    for h in weights:
        n, big_n = counts[h], population[h]
        if n > 1:
            z = x[rows[h]] * (y[rows[h]] - ratio)
            variance += big_n * big_n * (1 - n / big_n) * z.var(ddof=1) / n
    variance /= total_x * total_x
    effective = ratio * (1 - ratio) / variance if variance > 0 and 0 < ratio < 1 else float(sampled)
    low, high = wilson(ratio, effective, z=float(norm.ppf(0.5 + confidence / 2)))
    return Estimate(float(ratio), low, high, float(effective), sampled)


# ---------------------------------------------------------------- the design a blind audit records

def whole_number(value, low: int = 0) -> bool:
    """An int (not a bool) from `low` to INT64_MAX: how a count or index read from JSON is checked."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= INT64_MAX


def _sim_bound(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def read_design(design, where: str) -> dict:
    """A blind audit's design, typed strictly: its version, seed, the scores file's name and scored
    pairs, and strata numbered 1.. with their sim range, pairs (N_h >= 1) and pairs drawn."""
    if not isinstance(design, dict) or design.get("version") != DESIGN_VERSION:
        raise UserError(f"{where}: design must be an object of version {DESIGN_VERSION}")
    if not whole_number(design.get("scored_pairs"), 1) or not whole_number(design.get("seed")) or \
            not isinstance(design.get("scores"), str):
        raise UserError(f"{where}: design needs scored_pairs (an integer >= 1), seed and scores")
    strata = design.get("strata")
    if not isinstance(strata, list) or not strata:
        raise UserError(f"{where}: design.strata must be a non-empty list")
    for n, stratum in enumerate(strata):
        if not isinstance(stratum, dict) or stratum.get("stratum") != n + 1 or not whole_number(stratum.get("pairs"), 1) \
                or not whole_number(stratum.get("drawn")) or stratum["drawn"] > stratum["pairs"] \
                or not _sim_bound(stratum.get("sim_above")) or not _sim_bound(stratum.get("sim_at_most")):
            raise UserError(f"{where}: design.strata[{n}] must be stratum {n + 1} with pairs >= 1, drawn <= pairs "
                            "and its sim range")
    if sum(s["pairs"] for s in strata) != design["scored_pairs"]:
        raise UserError(f"{where}: the strata hold {sum(s['pairs'] for s in strata):,} pairs, not the "
                        f"{design['scored_pairs']:,} scored")
    return {"version": DESIGN_VERSION, "seed": design["seed"], "scores": design["scores"],
            "scored_pairs": design["scored_pairs"],
            "strata": [{name: s[name] for name in ("stratum", "sim_above", "sim_at_most", "pairs", "drawn")}
                       for s in strata]}


def audit_design(truth: str | Path) -> dict | None:
    """The blind audit design a truth Parquet carries (None: not a blind audit's marks)."""
    try:
        metadata = pq.read_schema(truth).metadata or {}
    except Exception:  # not Parquet or unreadable: not an audit's marks (reading the truth names the failure)
        return None
    if DESIGN_KEY not in metadata:
        return None
    try:
        design = json.loads(metadata[DESIGN_KEY])
    except ValueError:
        raise UserError(f"{truth}: its audit design is not JSON") from None
    return read_design(design, f"{truth}: the audit design")
