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
the page through the exported marks into the truth Parquet's metadata (DESIGN_KEY); `AuditDesign`
reads it back strictly wherever it is read, `audit_design` finds it in a truth file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pyarrow.parquet as pq
from scipy.stats import norm

from pairclean.config import INT64_MAX
from pairclean.core.null import wilson
from pairclean.ops.records import JsonObject, Record

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

    def as_dict(self) -> JsonObject:
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


@dataclass(frozen=True)
class Stratum:
    """One stratum of a blind audit: pairs with sim_above < sim <= sim_at_most (None: unbounded)."""

    stratum: int  # numbered 1.. in order of sim
    sim_above: float | None
    sim_at_most: float | None
    pairs: int  # N_h, the scored pairs in it
    drawn: int  # n_h drawn for the page (the marks may be fewer)


@dataclass(frozen=True)
class AuditDesign(Record):
    """A blind audit's design, read back wherever it travels (the page, the exported marks, the
    truth Parquet's metadata) as strictly as a flag: its version, seed, the scores file's name and
    scored pairs, and its strata, numbered 1.., holding the scored pairs between them."""

    what: ClassVar[str] = "blind audit design"
    version: int
    seed: int
    scores: str
    scored_pairs: int
    strata: list[Stratum]

    def problems(self):
        if self.version != DESIGN_VERSION:
            yield "version", f"must be {DESIGN_VERSION}, got {self.version}"
        if not whole_number(self.seed):
            yield "seed", f"must be an integer from 0 to {INT64_MAX}"
        if not whole_number(self.scored_pairs, 1):
            yield "scored_pairs", f"must be an integer from 1 to {INT64_MAX}"
        if not self.strata:
            yield "strata", "must hold at least one stratum"
        for n, stratum in enumerate(self.strata):
            if stratum.stratum != n + 1:
                yield f"strata[{n}].stratum", f"must be {n + 1} (strata are numbered 1.. in order)"
            if not whole_number(stratum.pairs, 1):
                yield f"strata[{n}].pairs", f"must be an integer from 1 to {INT64_MAX}"
            if not whole_number(stratum.drawn) or stratum.drawn > stratum.pairs:
                yield f"strata[{n}].drawn", f"must be from 0 to the stratum's pairs ({stratum.pairs}), got {stratum.drawn}"
        held = sum(s.pairs for s in self.strata)
        if held != self.scored_pairs:
            yield "scored_pairs", f"the strata hold {held:,} pairs, not the {self.scored_pairs:,} scored"


def audit_design(truth: str | Path) -> AuditDesign | None:
    """The blind audit design a truth Parquet carries (None: not a blind audit's marks)."""
    try:
        metadata = pq.read_schema(truth).metadata or {}
    except Exception:  # not Parquet or unreadable: not an audit's marks (reading the truth names the failure)
        return None
    if DESIGN_KEY not in metadata:
        return None
    source = f"the audit design in {truth}"
    return AuditDesign.from_json(AuditDesign.parse(metadata[DESIGN_KEY], source), source)
