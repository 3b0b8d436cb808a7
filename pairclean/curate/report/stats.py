"""What the report counts, all by DuckDB over the scores file: one scan per section, never the
dataset in memory (summary, the truth table, the histogram, per-shard shares, the gallery rows,
the error reasons, the threshold sweep)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pairclean.curate.sweep import Sweep, threshold_sweep
from pairclean.errors import UserError
from pairclean.ops.records import Keyed
from pairclean.scorefile.contract import Provenance
from pairclean.scorefile.db import ScoresDB
from pairclean.scorefile.evaluation import DecisionMetrics, truth_metrics
from pairclean.scorefile.rules import RuleRecord, recorded_rules
from pairclean.scorefile.sql import sql_identifier


@dataclass(frozen=True)
class ReportSummary:
    """The page's counts and similarity statistics (`summary`): pairs, scored pairs, pairs with an
    error, scored pairs weighing 0, the mean, lowest and highest sim and the mean weight of the
    scored pairs (None without one), and each rule's flagged pairs (by name)."""

    pairs: int
    scored: int
    errors: int
    zero_weight: int
    mean_sim: float | None
    min_sim: float | None
    max_sim: float | None
    mean_weight: float | None
    flagged: Keyed[str, int]


@dataclass(frozen=True)
class TruthByRule:
    """The scored pairs with a truth label, the truly noisy among them, and each rule's decisions
    against the labels (by name; `truth_by_rule`)."""

    labelled: int
    noisy: int
    rules: Keyed[str, DecisionMetrics]


@dataclass
class ReportStats:
    """Everything the page shows that comes from the scores (and truth) file."""

    rules: list[RuleRecord]  # as the file records them, in column order
    summary: ReportSummary
    truth: TruthByRule | None  # with a truth file
    truth_join: str | None  # the columns the truth was joined on
    edges: np.ndarray  # histogram bin edges
    counts: Keyed[str, np.ndarray]  # histogram counts per label
    shards: list[dict]  # `per_shard`
    lowest: list[dict]  # gallery rows, lowest similarity first
    highest: list[dict]  # gallery rows, highest first (none of the lowest)
    errors: list[dict]  # `error_reasons`
    sweep: Sweep | None


def gather(db: ScoresDB, provenance: Provenance, has_truth: bool, bins: int, gallery: int,
           contrast: int) -> ReportStats:
    """Every section's numbers; `labeled` (scores joined with the truth) is read when there is a truth."""
    view = "labeled" if has_truth else "scores"
    rules = recorded_rules(provenance, db.columns(view))
    s = summary(db, view, rules)
    if s.pairs == 0:
        raise UserError(f"{db.path} holds no pairs")
    lo = s.min_sim if s.min_sim is not None else 0.0
    hi = s.max_sim if s.max_sim is not None else 1.0
    if provenance.beta is not None:
        lo, hi = min(lo, provenance.beta), max(hi, provenance.beta)
    pad = max(hi - lo, 1e-3) * 0.03
    edges, counts = histogram(db, view, lo - pad, hi + pad, bins, has_truth)
    lowest = gallery_rows(db, view, min(gallery, s.scored), True, has_truth, rules)
    # Few pairs: the highest are the ones not already shown as lowest.
    highest = gallery_rows(db, view, min(contrast, s.scored - len(lowest)), False, has_truth, rules)
    return ReportStats(rules=rules, summary=s, truth=truth_by_rule(db, rules) if has_truth else None,
                       truth_join=db.truth_join, edges=edges, counts=counts,
                       shards=per_shard(db, view, has_truth, rules), lowest=lowest, highest=highest,
                       errors=error_reasons(db), sweep=threshold_sweep(db, provenance.null_quantiles, view))


def _rows(db: ScoresDB, sql: str, params: list | None = None) -> list[dict]:
    rel = db.con.execute(sql, params or [])
    names = [d[0] for d in rel.description]
    return [dict(zip(names, r)) for r in rel.fetchall()]


def summary(db: ScoresDB, view: str, rules: list[RuleRecord]) -> ReportSummary:
    """Counts and similarity statistics; `flagged` maps each rule's name to its flagged pairs."""
    flagged = "".join(f", count(*) FILTER (WHERE {sql_identifier(r.decision)} AND sim IS NOT NULL)" for r in rules)
    row = db.con.execute(f"""
        SELECT count(*) AS pairs, count(sim) AS scored, count(error) AS errors,
               count(*) FILTER (WHERE weight = 0 AND sim IS NOT NULL) AS zero_weight,
               avg(sim) AS mean_sim, min(sim) AS min_sim, max(sim) AS max_sim,
               avg(weight) FILTER (WHERE sim IS NOT NULL) AS mean_weight{flagged}
        FROM {view}""").fetchone()
    pairs, scored, errors, zero_weight, mean_sim, min_sim, max_sim, mean_weight = row[:8]
    return ReportSummary(pairs, scored, errors, zero_weight, mean_sim, min_sim, max_sim, mean_weight,
                         flagged={r.name: n for r, n in zip(rules, row[8:])})


def truth_by_rule(db: ScoresDB, rules: list[RuleRecord]) -> TruthByRule:
    """The scored pairs with a label, the truly noisy among them, and `truth_metrics` of each rule
    (by name) against the labels, counted by DuckDB."""
    labelled, noisy = db.con.execute("SELECT count(noisy), count(*) FILTER (WHERE noisy) FROM labeled "
                                     "WHERE sim IS NOT NULL").fetchone()
    found = {}
    for rule in rules:
        flagged = sql_identifier(rule.decision)
        counts = db.con.execute(f"""
            SELECT count(*) FILTER (WHERE {flagged} AND noisy), count(*) FILTER (WHERE NOT {flagged} AND noisy),
                   count(*) FILTER (WHERE {flagged} AND NOT noisy), count(*) FILTER (WHERE NOT {flagged} AND NOT noisy)
            FROM labeled WHERE sim IS NOT NULL""").fetchone()
        found[rule.name] = truth_metrics(*counts)
    return TruthByRule(labelled, noisy, found)


def histogram(db: ScoresDB, view: str, lo: float, hi: float, bins: int, split: bool) -> tuple[np.ndarray, Keyed]:
    """Bin edges and counts per label (all | clean | noisy | unlabelled), counted by DuckDB."""
    width = (hi - lo) / bins
    label = "CASE WHEN noisy IS NULL THEN 'unlabelled' WHEN noisy THEN 'noisy' ELSE 'clean' END" if split else "'all'"
    rows = db.con.execute(f"""
        SELECT least(greatest(CAST(floor((sim - ?) / ?) AS BIGINT), 0), ?) AS b, {label} AS label, count(*) AS n
        FROM {view} WHERE sim IS NOT NULL AND NOT isnan(sim) GROUP BY ALL""", [lo, width, bins - 1]).fetchall()
    counts: dict[str, np.ndarray] = {}
    for b, name, n in rows:
        counts.setdefault(name, np.zeros(bins, np.int64))[int(b)] += n
    return np.linspace(lo, hi, bins + 1), counts


def per_shard(db: ScoresDB, view: str, truth: bool, rules: list[RuleRecord]) -> list[dict]:
    """Per shard: counts, mean similarity and weight, and `share` flagged by each rule (by name)."""
    extra = ", avg(noisy::INT) FILTER (WHERE sim IS NOT NULL) AS share_true" if truth else ""
    shares = "".join(f", avg({sql_identifier(r.decision)}::INT) FILTER (WHERE sim IS NOT NULL) AS share_{i}"
                     for i, r in enumerate(rules))
    rows = _rows(db, f"""
        SELECT shard, count(*) AS pairs, count(error) AS errors, avg(sim) AS mean_sim,
               avg(weight) FILTER (WHERE sim IS NOT NULL) AS mean_weight{extra}{shares}
        FROM {view} GROUP BY shard ORDER BY shard""")
    return [{**row, "share": {r.name: row.pop(f"share_{i}") for i, r in enumerate(rules)}} for row in rows]


def gallery_rows(db: ScoresDB, view: str, n: int, lowest: bool, truth: bool, rules: list[RuleRecord]) -> list[dict]:
    if n <= 0:
        return []
    order = "ASC" if lowest else "DESC"
    extra = "".join(f", {sql_identifier(column)}" for r in rules for column in r.columns) + (", noisy" if truth else "")
    return _rows(db, f"""
        SELECT key, shard, "index", sim, sim_debiased, weight{extra}
        FROM {view} WHERE sim IS NOT NULL AND NOT isnan(sim)
        ORDER BY sim {order}, shard, "index" LIMIT ?""", [n])


def error_reasons(db: ScoresDB) -> list[dict]:
    return _rows(db, """SELECT error, count(*) AS n, min(key) AS example FROM scores
                        WHERE error IS NOT NULL GROUP BY error ORDER BY n DESC, error LIMIT 12""")
