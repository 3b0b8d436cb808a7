"""The threshold sweep: what each similarity threshold would keep, with estimated precision and
recall, so that a user picks a threshold with numbers in front of them.

The estimates come from the run's null (the provenance's `null_quantiles`: similarities of in-data
pairs that do not belong together), not from labels. With S0(t) the share of random pairings
above t and K(t) the share of scored pairs above t:
- the random-pairing share pi0 (Storey, lambda = 1/2): twice the share of pairs at or below the
  null's median, the share of pairs that look like random pairings;
- expected random-pairing noise among the kept pairs: pi0 S0(t) / K(t); precision = 1 - that;
- clean kept (recall of the clean pairs): (K(t) - pi0 S0(t)) / (1 - pi0); noise caught: 1 - S0(t).
They hold for noise that looks like a random pairing (shuffled captions); noise that is more
similar than that (a caption of a similar item) is counted as clean, so the figures are upper
bounds on precision when such noise exists. Every estimate is a share and is kept within [0, 1]:
the sampling error of pi0 and of the stored null quantiles can push the raw ratios past it
(`filter --dry-run` once showed "est. clean kept 142.9%").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pairclean.scorefile.db import ScoresDB

NULL_LEVELS = (0.5, 0.75, 0.9, 0.95, 0.99, 0.999)  # thresholds: these quantiles of the null


@dataclass
class SweepRow:
    threshold: float  # keep sim > threshold
    null_above: float  # share of random pairings above it
    kept: float  # share of the scored pairs kept
    precision: float | None  # estimated share of clean pairs among the kept
    clean_kept: float | None  # estimated share of the clean pairs kept
    noise_caught: float  # estimated share of the (random-pairing) noise removed


@dataclass
class Sweep:
    random_pairing_share: float  # pi0: the pairs that look like random pairings (not all noise)
    rows: list[SweepRow]


def _share(value: float) -> float:
    return min(max(value, 0.0), 1.0)


def _null_above(quantiles: np.ndarray, t: float) -> float:
    """S0(t) from the stored quantiles (linear between them)."""
    levels = np.linspace(0, 1, len(quantiles))
    return float(1.0 - np.interp(t, quantiles, levels, left=0.0, right=1.0))


def threshold_sweep(db: ScoresDB, null_quantiles: list[float] | None, view: str = "scores") -> Sweep | None:
    """The sweep over the scored pairs of `view`; None when the run drew no null (older files)."""
    if not null_quantiles:
        return None
    quantiles = np.asarray(null_quantiles, dtype=np.float64)
    levels = np.linspace(0, 1, len(quantiles))
    thresholds = [float(np.interp(q, levels, quantiles)) for q in NULL_LEVELS]
    median = float(np.interp(0.5, levels, quantiles))
    cells = ", ".join(f"avg((sim > {t!r})::DOUBLE)" for t in thresholds)
    row = db.con.execute(f"SELECT count(*), avg((sim <= {median!r})::DOUBLE), {cells} FROM {view} "
                         "WHERE sim IS NOT NULL AND NOT isnan(sim)").fetchone()
    if not row[0]:
        return None
    pi0 = min(1.0, 2.0 * row[1])
    rows = []
    for t, kept in zip(thresholds, row[2:]):
        s0 = _null_above(quantiles, t)
        noise_kept = min(pi0 * s0, kept)
        rows.append(SweepRow(threshold=t, null_above=s0, kept=kept,
                             precision=_share(1.0 - noise_kept / kept) if kept else None,
                             clean_kept=_share((kept - noise_kept) / (1.0 - pi0)) if pi0 < 1 else None,
                             noise_caught=_share(1.0 - s0)))
    return Sweep(pi0, rows)
