"""Estimates for a whole dataset from a stratified random sample of it marked by a person, with
95% intervals that carry the sample's uncertainty and the judge's measured inconsistency.

A blind audit (`curate/audit.py`) draws pairs at random from each stratum h of the scored pairs
(strata: ranges of `sim` holding about equally many of the N_h pairs) and a person marks them.
Every figure it reports is the share of noisy pairs in a set the scores file knows exactly, or a
ratio of two such counts: the noise share (noisy among all pairs), a rule's precision (among the
pairs it flags), the noise left in what it keeps (among the pairs it keeps), its recall (noisy
flagged over all noisy). So the scored pairs fall into cells, one per stratum and (for a rule)
flagged or kept, each of N_c pairs (counted in the scores file) of which m_c were marked and k_c
marked noisy; a pair left unmarked is missing at random (the page shows the pairs in random
order).

* A share (`stratified_share`): the stratified estimate sum N_c k_c / m_c / N (Cochran, Sampling
  Techniques, 3rd ed., 5.3) with its finite-population-corrected variance, each cell's variance
  at least that of Jeffreys' centre (k_c + 1/2) / (m_c + 1): a cell of one mark, or whose marks
  are all alike (a pure sample of a mixed stratum), still adds variance (before, it added none,
  float round-off made that ~1e-33 instead of 0, and intervals came out of zero width); a Wilson
  interval at Kish's effective n, never above the pairs in the set (before, it ran past the
  dataset's size). A cell without marks takes its stratum's share (a stratum without marks, the
  pooled share, and the audit names it).
* Recall, flagged s_f / (flagged s_f + kept s_k): from the two shares' intervals, each at
  1 - (1 - 95%) / 2, the high end of one with the low end of the other.
* The judge (`JudgeError`): each mark is taken to be wrong with one probability e for noisy and
  clean pairs alike, independently; the page shows a share of its pairs twice, unannounced, and
  two looks at a pair disagree with probability 2e(1 - e), so d disagreements in r pairs marked
  twice give e (its 95% interval from the Jeffreys posterior of d / r). A share marked s_obs is
  truly (s_obs - e) / (1 - 2e) (the misclassification correction: a judge who errs pulls every
  share towards 1/2); each figure is corrected at the estimated e, and its interval is the union
  of the corrected intervals for every e from 0 to the interval's high end. With no pair marked
  twice the judge is not measured and e = 0: the output says so.

What the intervals cover: which pairs were drawn, and the judge's inconsistency as the repeats
measure it. What they do not: errors the judge makes the same way on both looks (a consistent
misjudgement; only a second judge or a known truth measures that), a judge whose errors differ
between noisy and clean pairs (taken as alike), and pairs left unmarked for a reason tied to
their noise. Measured coverage: docs/lab.md, "The blind audit".

The design a blind audit records (its strata's sim ranges, pairs N_h and pairs drawn, the pairs
shown twice) travels from the page through the exported marks into the truth Parquet's metadata
(DESIGN_KEY); `AuditDesign` reads it back strictly wherever it is read, `audit_design` finds it
in a truth file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pyarrow.parquet as pq
from scipy.stats import beta, norm

from pairclean.config import INT64_MAX
from pairclean.core.null import wilson
from pairclean.ops.records import JsonObject, Record

CONFIDENCE = 0.95
JEFFREYS = 0.5  # the prior's pseudo-count on each side of a share
GRID = 9  # error rates across the judge's interval the figures' intervals are taken over
MAX_ERROR = 0.49  # a judge wrong half the time says nothing: the correction stops short of dividing by 0
Z = float(norm.ppf(0.5 + CONFIDENCE / 2))
DESIGN_KEY = b"pairclean_audit"  # a blind audit's design, in its truth Parquet's key-value metadata
DESIGN_VERSION = 1


@dataclass(frozen=True)
class Estimate:
    """A share of the whole dataset (0..1) with its interval; `sampled`: the marks in its denominator."""

    value: float | None
    low: float | None
    high: float | None
    effective_n: float | None
    sampled: int

    def as_dict(self) -> JsonObject:
        return asdict(self)


NO_ESTIMATE = Estimate(None, None, None, None, 0)


@dataclass(frozen=True)
class Cell:
    """Scored pairs of one stratum (and, for a rule, flagged or kept): `pairs` in the scores file,
    `marked` of them marked (first look), `noisy` of those marked drop; `fill`, the share a cell
    without marks is taken at (its stratum's)."""

    pairs: int
    marked: int
    noisy: int
    fill: float = 0.5

    @property
    def share(self) -> float:
        return self.noisy / self.marked if self.marked else self.fill

    @property
    def centre(self) -> float:
        """Jeffreys' centre (k + 1/2) / (m + 1): never 0 or 1, so a pure cell keeps a variance."""
        return (self.noisy + JEFFREYS) / (self.marked + 2 * JEFFREYS) if self.marked else self.fill


@dataclass(frozen=True)
class JudgeError:
    """The judge measured on the pairs shown twice: `repeated` pairs marked on both looks, of
    which `disagreed` got two different marks."""

    repeated: int
    disagreed: int

    @staticmethod
    def rate(disagreement):
        """The error rate e with 2e(1 - e) = the disagreement rate (at most 1/2)."""
        return (1 - np.sqrt(1 - 2 * np.minimum(disagreement, 0.5))) / 2

    def interval(self) -> tuple[float, float, float]:
        """(estimate, low, high) of the error rate: e is monotone in the disagreement rate, whose
        CONFIDENCE interval is its Jeffreys posterior's."""
        low, high = self.rate(beta.ppf([(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2], self.disagreed + JEFFREYS,
                                       self.repeated - self.disagreed + JEFFREYS))
        return float(self.rate(self.disagreed / self.repeated)), float(low), float(high)

    def rates(self) -> np.ndarray:
        """The error rates the figures' intervals are taken over: the estimate, then GRID points
        from 0 to the interval's high end (0 always among them: a judge who did not err is never
        ruled out, and a share marked pure keeps an interval); [0] when no pair was marked twice
        (not measured: every mark taken as right)."""
        if not self.repeated:
            return np.zeros(1)
        value, _, high = self.interval()
        return np.concatenate([[value], np.linspace(0.0, high, GRID)])

    @property
    def agreement(self) -> float | None:
        """The share of the pairs marked twice given the same mark both times (None: none was)."""
        return 1 - self.disagreed / self.repeated if self.repeated else None

    def as_dict(self) -> JsonObject:
        """The counts, the agreement and the error rate with its interval (as `evaluate detection` writes them)."""
        if not self.repeated:
            return {"repeated": 0, "disagreed": 0, "agreement": None, "error_rate": None}
        value, low, high = self.interval()
        return {"repeated": self.repeated, "disagreed": self.disagreed, "agreement": self.agreement,
                "error_rate": {"value": value, "low": low, "high": high}}


@dataclass(frozen=True)
class Share:
    """A share of noisy pairs in a set the scores file knows (all, a rule's flagged, its kept),
    before the judge's correction: the estimate, its interval at `z` and the effective n of that
    Wilson interval."""

    value: float
    low: float
    high: float
    effective: float


def stratified_share(cells: list[Cell], z: float = Z) -> Share | None:
    """The noisy share of the cells' pairs from their marks (None: no pair or no mark in them).

    The stratified estimate sum N_c p_c / N with p_c = k_c / m_c (a cell without marks takes its
    stratum's share, `fill`); its variance sum (N_c / N)^2 (1 - m_c / N_c) v_c / m_c with v_c at
    least p~(1 - p~), p~ = (k_c + 1/2) / (m_c + 1) (Jeffreys' centre: a cell of one mark, or whose
    marks are all alike, still adds variance; the sample's own variance where it is larger); the
    Wilson interval at Kish's effective n, share~(1 - share~) / variance, between 1 and N (a census
    is exact, yet never taken for more pairs than there are)."""
    total = sum(c.pairs for c in cells)
    if not total or not any(c.marked for c in cells if c.pairs):
        return None
    value = adjusted = variance = 0.0
    for cell in cells:
        if not cell.pairs:
            continue
        weight = cell.pairs / total
        share, centre, marks = cell.share, cell.centre, max(cell.marked, 1)
        spread = share * (1 - share) * marks / (marks - 1) if marks > 1 else 0.0
        value += weight * share
        adjusted += weight * centre
        variance += weight * weight * (1 - cell.marked / cell.pairs) * max(spread, centre * (1 - centre)) / marks
    effective = total if variance <= 0 else min(total, max(1.0, adjusted * (1 - adjusted) / variance))
    low, high = wilson(value, effective, z)
    return Share(value, low, high, float(effective))


def corrected(marked_share: float, error: float) -> float:
    """The share of pairs truly noisy, from the share a judge who errs at rate `error` (on noisy and
    clean pairs alike) would mark noisy: marked = error + true (1 - 2 error)."""
    return float(np.clip((marked_share - error) / (1 - 2 * min(error, MAX_ERROR)), 0.0, 1.0))


def estimate(value: float, ends: list[tuple[float, float]], sampled: int, effective: float) -> Estimate:
    """An Estimate from its value and the interval ends found for each error rate the judge's
    measure allows (the interval is their union); `effective`: the effective n of the Wilson
    interval the ends came from (before the judge's correction widened it)."""
    return Estimate(value, min(e[0] for e in ends), max(e[1] for e in ends), effective, sampled)


@dataclass(frozen=True)
class AuditFigures:
    """What a blind audit's marks say of the whole file: the noise share, per rule its precision,
    recall and the noise left in what it keeps, the judge, and the strata no mark fell in."""

    noise_share: Estimate
    rules: dict[str, dict[str, Estimate]]
    judge: JudgeError
    unmarked: list[int]


def audit_figures(stratum: np.ndarray, noisy: np.ndarray, again: list[bool | None], flags: dict[str, np.ndarray],
                  pairs: dict[int, int], flagged: dict[str, dict[int, int]]) -> AuditFigures:
    """The figures from the marked pairs: their `stratum`, first-look mark (`noisy`), second-look
    mark (`again`, None where the pair was not marked twice) and each rule's flag on them; the
    scored pairs per stratum (`pairs`) and, per rule, its flagged pairs per stratum (`flagged`),
    counted in the scores file."""
    twice = [(first, second) for first, second in zip(noisy.tolist(), again) if second is not None]
    judge = JudgeError(len(twice), sum(first != second for first, second in twice))
    errors = judge.rates()
    in_stratum = {h: stratum == h for h in pairs}
    fill = {h: Cell(pairs[h], int(rows.sum()), int((rows & noisy).sum())).centre if rows.any() else None
            for h, rows in in_stratum.items()}
    pooled = (int(noisy.sum()) + JEFFREYS) / (len(noisy) + 2 * JEFFREYS)

    def cells(rows: np.ndarray, held: dict[int, int]) -> list[Cell]:
        return [Cell(held[h], int((rows & in_stratum[h]).sum()), int((rows & noisy & in_stratum[h]).sum()),
                     fill[h] if fill[h] is not None else pooled) for h in held]

    def linear(found: Share | None, sampled: int) -> Estimate:
        if found is None or not sampled:
            return NO_ESTIMATE
        return estimate(corrected(found.value, errors[0]),
                        [(corrected(found.low, e), corrected(found.high, e)) for e in errors], sampled, found.effective)

    rules = {}
    wide = float(norm.ppf(0.5 + (1 + CONFIDENCE) / 4))  # each of two shares at 1 - (1 - CONFIDENCE) / 2
    for name, flag in flags.items():
        in_flagged = flagged[name]
        in_kept = {h: pairs[h] - in_flagged[h] for h in pairs}
        n_flagged, n_kept = sum(in_flagged.values()), sum(in_kept.values())
        caught, left = cells(flag, in_flagged), cells(~flag, in_kept)
        rules[name] = {"precision": linear(stratified_share(caught), int(flag.sum())),
                       "recall": _recall(stratified_share(caught, wide), stratified_share(left, wide), n_flagged,
                                         n_kept, errors, int(noisy.sum()),
                                         (stratified_share(caught), stratified_share(left))),
                       "noise_left": linear(stratified_share(left), int((~flag).sum()))}
    return AuditFigures(linear(stratified_share(cells(np.ones(len(noisy), dtype=bool), pairs)), len(noisy)), rules,
                        judge, [h for h in pairs if fill[h] is None])


def _recall(caught: Share | None, left: Share | None, flagged: int, kept: int, errors: np.ndarray, sampled: int,
            point: tuple[Share | None, Share | None]) -> Estimate:
    """Noisy flagged pairs over all noisy pairs, flagged * s_f / (flagged * s_f + kept * s_k): its
    interval from the two shares' (each at the wider level: together they hold at CONFIDENCE),
    the highest share flagged with the lowest kept and the reverse, at every error rate; its
    effective n the smaller of the two shares'."""
    if not sampled or (caught is None and flagged) or (left is None and kept):
        return NO_ESTIMATE

    def ratio(s_f: float, s_k: float, e: float) -> float:
        found, missed = flagged * corrected(s_f, e) if flagged else 0.0, kept * corrected(s_k, e) if kept else 0.0
        return found / (found + missed) if found + missed > 0 else 0.0

    f, k = caught or Share(0, 0, 0, 0), left or Share(0, 0, 0, 0)
    pf, pk = point[0] or f, point[1] or k
    effective = min(s.effective for s in (caught, left) if s is not None)
    return estimate(ratio(pf.value, pk.value, errors[0]),
                    [(ratio(f.low, k.high, e), ratio(f.high, k.low, e)) for e in errors], sampled, effective)


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
    scored pairs, its strata, numbered 1.. in order of sim, each range starting where the one
    before ends (none overlaps, none is left out), holding the scored pairs between them, and the
    pairs the page shows a second time (None: a page from before repeats)."""

    what: ClassVar[str] = "blind audit design"
    version: int
    seed: int
    scores: str
    scored_pairs: int
    strata: list[Stratum]
    repeated: int | None = None

    def in_stratum(self, stratum: Stratum, column: str = "sim") -> str:
        """SQL: `column` lies in the stratum's range."""
        bounds = [f"{column} > {stratum.sim_above!r}"] * (stratum.sim_above is not None) + \
                 [f"{column} <= {stratum.sim_at_most!r}"] * (stratum.sim_at_most is not None)
        return " AND ".join(bounds) or "true"

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
            above = self.strata[n - 1].sim_at_most if n else None
            if stratum.sim_above != above:
                yield f"strata[{n}].sim_above", (f"must be {above} (where stratum {n} ends: the ranges are cut "
                                                 f"at one list of sims), got {stratum.sim_above}")
            if None not in (stratum.sim_above, stratum.sim_at_most) and not stratum.sim_above < stratum.sim_at_most:
                yield f"strata[{n}].sim_at_most", f"must be above sim_above ({stratum.sim_above}), got {stratum.sim_at_most}"
        if self.repeated is not None and (not whole_number(self.repeated)
                                          or self.repeated > sum(s.drawn for s in self.strata)):
            yield "repeated", f"must be from 0 to the pairs drawn, got {self.repeated}"
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
