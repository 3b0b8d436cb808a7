"""Noise-detection metrics: how well a scores file separates the pairs a truth file marks noisy.

Per decision rule the file records (`pairclean.scorefile.rules`: by default the OSA beta boundary
and the GMM rule) and the oracle (the single threshold on `sim` with the best balanced accuracy,
which no rule computed without labels can beat): clean kept % (OSA Table 5's "accuracy"), noise
caught % ("recall"), their mean, the balanced accuracy, and precision %, all from one confusion
count (`truth_metrics`), which the report uses too. Threshold-free: ROC-AUC and average precision
of `-sim` as a noise detector (sklearn), and OSA Table 11's mean noise rank: the mean rank of the
noisy pairs when all pairs are sorted by weight, highest first (ties share their mean rank),
against its optimum (every noisy pair ranked last). A rule that claims a probability of being
clean (`clean_probability`, the GMM's p_clean) gets its expected calibration error (ECE, 10 bins),
unless it abstains on the file: its probability is then no claim (NULL since it abstains; a
number in files scored before) and its ECE is None, with the rule's `abstains` reason.

Scores and truth are joined by `pairclean.scorefile.db.ScoresDB`: on (shard, index), then on (shard file
name, index), else on key. The metrics need every labelled similarity in memory at once (a sort),
8 bytes per pair per column.

A truth file made from a blind audit's marks (it carries the audit's design: `scores/stratified.py`)
labels a stratified random sample, not the dataset: `audit_estimates` weights the marks back to
every scored pair, giving the noise share and each rule's precision, recall and the noise left in
what it keeps, each with a 95% interval; the figures above are then those of the marked pairs alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy.stats import rankdata
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

from pairclean.errors import ConfigError, UserError
from pairclean.ops.records import JsonObject, Keyed
from pairclean.scorefile.db import ScoresDB
from pairclean.scorefile.rules import REGISTRY, recorded_rules
from pairclean.scorefile.sql import sql_identifier
from pairclean.scorefile.stratified import CONFIDENCE, AuditDesign, Estimate, JudgeError, audit_design, audit_figures


def _share(numerator: int, denominator: int) -> float | None:
    return 100.0 * numerator / denominator if denominator else None


@dataclass(frozen=True)
class DecisionMetrics:
    """A noisy/clean decision against the truth labels (`truth_metrics`): clean kept %, noise caught %,
    their mean (the balanced accuracy) and precision %, None where a share has no denominator; the
    pairs it flags."""

    clean_kept: float | None
    noise_caught: float | None
    balanced_accuracy: float | None
    precision: float | None
    flagged: int

    def to_json(self) -> JsonObject:
        return asdict(self)


@dataclass(frozen=True)
class OracleDetection(DecisionMetrics):
    """The single threshold t on sim (flag sim <= t) with the best balanced accuracy, which no rule
    fitted without labels can beat (`oracle_threshold`; None when the truth holds one class only),
    and how tables name it."""

    threshold: float | None
    label: str
    noisy_if: str


@dataclass(frozen=True)
class RuleDetection(DecisionMetrics):
    """A rule the scores file records, measured against the truth: its decisions' metrics, its
    threshold, table label, decision in words and why it abstains (None: it decides); for a rule
    claiming a probability of being clean (`probability`: its column), that claim's expected
    calibration error (`ece`, points; None when the rule abstains)."""

    threshold: float | None
    label: str
    noisy_if: str
    abstains: str | None
    probability: str | None = None
    ece: float | None = None

    def to_json(self) -> JsonObject:
        """As `evaluate detection` writes it: `ece` only for a rule claiming a probability (the
        probability's column is not written)."""
        written = asdict(self)
        del written["probability"]
        if self.probability is None:
            del written["ece"]
        return written


def truth_metrics(caught: int, missed: int, false_alarms: int, kept: int) -> DecisionMetrics:
    """Clean kept %, noise caught %, balanced accuracy % and precision % of a noisy/clean decision,
    from its confusion counts: noisy pairs flagged (caught) and not (missed), clean pairs flagged
    (false alarms) and not (kept). None where a share has no denominator."""
    clean_kept = _share(kept, kept + false_alarms)
    noise_caught = _share(caught, caught + missed)
    return DecisionMetrics(clean_kept=clean_kept, noise_caught=noise_caught,
                           balanced_accuracy=(clean_kept + noise_caught) / 2
                           if clean_kept is not None and noise_caught is not None else None,
                           precision=_share(caught, caught + false_alarms), flagged=caught + false_alarms)


def rule_metrics(noisy, flagged) -> DecisionMetrics:
    """`truth_metrics` of per-pair truth labels and decisions."""
    noisy = np.asarray(noisy, dtype=bool)
    flagged = np.asarray(flagged, dtype=bool)
    return truth_metrics(int((noisy & flagged).sum()), int((noisy & ~flagged).sum()),
                         int((~noisy & flagged).sum()), int((~noisy & ~flagged).sum()))


def oracle_threshold(noisy, sim) -> OracleDetection:
    """The threshold t (flag sim <= t) with the best balanced accuracy, and that rule's metrics."""
    noisy = np.asarray(noisy, dtype=bool)
    sim = np.asarray(sim, dtype=np.float64)
    if noisy.all() or not noisy.any():
        threshold, flagged = None, np.zeros_like(noisy)
    else:
        fpr, tpr, thresholds = roc_curve(noisy, -sim, drop_intermediate=False)
        threshold = float(-thresholds[int(np.argmax(tpr + (1 - fpr)))])
        flagged = sim <= threshold
    return OracleDetection(**vars(rule_metrics(noisy, flagged)), threshold=threshold, label="oracle",
                           noisy_if="sim <= " + (f"{threshold:.4f}" if threshold is not None else "n/a"))


def mean_noise_rank(noisy, weight) -> tuple[float | None, float | None]:
    """(mean rank of the noisy pairs by weight descending, ties averaged; its optimum N - (k - 1) / 2)."""
    noisy = np.asarray(noisy, dtype=bool)
    k = int(noisy.sum())
    if k == 0:
        return None, None
    ranks = rankdata(-np.asarray(weight, dtype=np.float64), method="average")
    return float(ranks[noisy].mean()), float(len(noisy) - (k - 1) / 2)


ECE_BINS = 10


def expected_calibration_error(clean, probability, bins: int = ECE_BINS) -> float | None:
    """ECE of a claimed P(clean) against the truth: over `bins` equal-width bins of the claim, the
    pair-weighted mean of |mean claim - share actually clean| (0 = calibrated), in points (x100)."""
    clean = np.asarray(clean, dtype=np.float64)
    p = np.asarray(probability, dtype=np.float64)
    known = np.isfinite(p)
    clean, p = clean[known], p[known]
    if not len(p):
        return None
    which = np.minimum((p * bins).astype(int), bins - 1)
    gap = np.abs(np.bincount(which, weights=p, minlength=bins) - np.bincount(which, weights=clean, minlength=bins))
    return float(100.0 * gap.sum() / len(p))


@dataclass(frozen=True)
class DetectionMetrics:
    """Every metric of one labelled set of pairs (`detection_metrics`): its pairs and noisy pairs
    (and their share, %), each rule's decisions (by name) then the oracle's (`"oracle"`),
    ROC-AUC and average precision of -sim as a noise detector (None with one class only), and the
    mean noise rank by weight, its optimum, and by sim."""

    pairs: int
    noisy: int
    noise_share: float | None
    rules: Keyed[str, DecisionMetrics]
    roc_auc: float | None
    average_precision: float | None
    mean_noise_rank: float | None
    mean_noise_rank_optimal: float | None
    mean_noise_rank_by_sim: float | None


@dataclass(frozen=True)
class RuleAudit:
    """One rule's figures for the whole file from a blind audit's marks: the share of the scored
    pairs it flags (exact, from the file), and its precision, recall and the noise left in the
    pairs it keeps, each an `Estimate`."""

    label: str
    noisy_if: str
    abstains: str | None
    flagged_share: float
    precision: Estimate
    recall: Estimate
    noise_left: Estimate


@dataclass(frozen=True)
class AuditEstimates:
    """A blind audit's marks weighted back to every scored pair (`audit_estimates`): the pairs
    marked and scored, the intervals' confidence and what they are (`interval`) and cover
    (`covers`), the design, the strata no mark fell in, the judge, the noise share and each rule's
    figures (by name)."""

    marked: int
    scored_pairs: int
    confidence: float
    interval: str
    design: AuditDesign
    unmarked_strata: list[int]
    judge: JudgeError
    covers: str
    noise_share: Estimate
    rules: Keyed[str, RuleAudit]

    def to_json(self) -> JsonObject:
        """As `evaluate detection` writes it: the design as its record reads back, the judge with its error rate."""
        return {**asdict(self), "design": self.design.to_json(), "judge": self.judge.as_dict()}


@dataclass(frozen=True)
class DetectionReport(DetectionMetrics):
    """`evaluate detection`: the metrics of the labelled pairs, each recorded rule's entry a
    `RuleDetection`; which files were joined and how; the rows left out (an error, no truth label);
    the estimator, beta mode and weight function the scores record; for a blind audit's marks, its
    estimates for the whole file (`audit`), the metrics above being those of the marked pairs alone."""

    scores: str
    truth: str
    join: str
    scores_rows: int
    error_rows: int
    unlabelled_rows: int
    truth_rows: int
    estimator: JsonObject | None
    beta_mode: str | None
    weight_fn: str | None
    audit: AuditEstimates | None = None

    def to_json(self) -> JsonObject:
        """The JSON `evaluate detection --json` and the demo write: each rule's entry flat, `audit`
        only for a blind audit's marks."""
        written = {**asdict(self), "rules": {name: rule.to_json() for name, rule in self.rules.items()}}
        if self.audit is None:
            del written["audit"]
        else:
            written["audit"] = self.audit.to_json()
        return written


def detection_metrics(noisy, sim, weight, decisions: dict[str, np.ndarray]) -> DetectionMetrics:
    """Every metric for one labelled set of pairs; `decisions` maps a rule name to its noisy flags."""
    noisy = np.asarray(noisy, dtype=bool)
    sim = np.asarray(sim, dtype=np.float64)
    both = bool(noisy.any() and (~noisy).any())
    rank, optimum = mean_noise_rank(noisy, weight)
    rank_sim, _ = mean_noise_rank(noisy, sim)
    return DetectionMetrics(
        pairs=int(len(noisy)), noisy=int(noisy.sum()),
        noise_share=100.0 * float(noisy.mean()) if len(noisy) else None,
        rules={**{name: rule_metrics(noisy, flags) for name, flags in decisions.items()},
               "oracle": oracle_threshold(noisy, sim)},
        roc_auc=float(roc_auc_score(noisy, -sim)) if both else None,
        average_precision=float(average_precision_score(noisy, -sim)) if both else None,
        mean_noise_rank=rank, mean_noise_rank_optimal=optimum, mean_noise_rank_by_sim=rank_sim)


def evaluate_detection(scores: str | Path, truth: str | Path | None = None,
                       truth_key: str | None = None) -> DetectionReport:
    """Join a scores file with a truth file (`db.resolve_truth`: Parquet, a manifest whose `truth:` names
    one, or the directory of that manifest; by default the truth of the dataset the scores recorded,
    e.g. the copy `corrupt` wrote) and measure every rule the file holds; rows with an error or
    without a truth label are counted, not scored. Each rule's entry carries its table label,
    `noisy_if` and `threshold`."""
    truth = truth if truth is not None else recorded_truth(scores)
    with ScoresDB(scores, truth, truth_key=truth_key) as db:
        provenance = db.provenance
        rules = recorded_rules(provenance, db.columns("labeled"))
        decisions = [rule.decision for rule in rules]
        missing = [c for c in ("sim", "weight", *decisions) if c not in db.columns("labeled")]
        if missing or not rules:
            raise UserError(f"{scores} lacks column(s) {', '.join(missing) or 'of any decision rule'}: "
                            "score it with `pairclean score`")
        counts = db.con.execute("SELECT count(*), count(*) FILTER (WHERE sim IS NULL), "
                                "count(*) FILTER (WHERE sim IS NOT NULL AND noisy IS NULL) FROM labeled").fetchall()[0]
        probabilities = {rule.name: REGISTRY[rule.name].clean_probability for rule in rules
                         if rule.name in REGISTRY and REGISTRY[rule.name].clean_probability in rule.columns}
        table = db.con.sql(f"SELECT sim, weight, {''.join(f'{sql_identifier(d)}, ' for d in decisions)}"
                           f"{''.join(f'{sql_identifier(c)}, ' for c in set(probabilities.values()))}noisy FROM labeled "
                           "WHERE sim IS NOT NULL AND noisy IS NOT NULL").to_arrow_table()
        truth_rows = db.scalar("SELECT count(*) FROM truth")
        join = db.truth_join
        design = audit_design(db.truth_path)
        audit = audit_estimates(db, design, rules) if design is not None else None
    if table.num_rows == 0:
        raise UserError(f"no scored pair of {scores} has a truth label in {truth}")
    column = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
    noisy = column["noisy"].astype(bool)
    found = detection_metrics(noisy, column["sim"], column["weight"],
                              {rule.name: column[rule.decision].astype(bool) for rule in rules})
    measured = {rule.name: RuleDetection(
        **vars(found.rules[rule.name]), threshold=rule.threshold, label=rule.label, noisy_if=rule.noisy_if,
        abstains=rule.abstains, probability=probabilities.get(rule.name),
        ece=expected_calibration_error(~noisy, column[probabilities[rule.name]])
        if rule.name in probabilities and not rule.abstains else None) for rule in rules}
    return DetectionReport(
        **{**vars(found), "rules": {**measured, "oracle": found.rules["oracle"]}},
        scores=str(scores), truth=str(truth), join=join, scores_rows=int(counts[0]), error_rows=int(counts[1]),
        unlabelled_rows=int(counts[2]), truth_rows=int(truth_rows),
        estimator=provenance.estimator if provenance else None, beta_mode=provenance.beta_mode if provenance else None,
        weight_fn=provenance.weight_fn if provenance else None, audit=audit)


def audit_estimates(db: ScoresDB, design: AuditDesign, rules) -> AuditEstimates:
    """The blind audit's marks (`labeled` joined to a truth file carrying `design`) weighted back to
    every scored pair of the file (`stratified.audit_figures`): the noise share, and per rule the share
    it flags (exact, from the file), its precision, its recall and the noise left in the pairs it
    keeps, each a `stratified.Estimate` (share 0..1 with its 95% interval); the judge as the pairs
    shown twice measure it; the strata no mark fell in, named.

    The design is recounted in the file first: each stratum's sim range must still hold its N_h
    pairs, and each marked pair must still be the pair (key) marked: marks of another scores file,
    or of a shard changed and scored again, would be weighted as pairs they are not."""
    scored = "FROM scores WHERE sim IS NOT NULL AND NOT isnan(sim)"
    pairs = db.scalar(f"SELECT count(*) {scored}")
    if pairs != design.scored_pairs:
        raise UserError(f"the audit was drawn from {design.scored_pairs:,} scored pairs ({design.scores}); "
                        f"{db.path} holds {pairs:,}: draw the audit from the scores file it evaluates")
    if "audit_stratum" not in db.columns("labeled"):
        raise UserError(f"{db.truth_path} carries an audit design but no stratum column")
    flags = [f"coalesce({sql_identifier(rule.decision)}, false)" for rule in rules]
    counts = db.con.execute("SELECT " + ", ".join(
        f"count(*) FILTER (WHERE {design.in_stratum(s)}{extra})" for s in design.strata
        for extra in ["", *(f" AND {flag}" for flag in flags)]) + f" {scored}").fetchall()[0]
    width = 1 + len(flags)
    held = {s.stratum: counts[i * width] for i, s in enumerate(design.strata)}
    flagged = {rule.name: {s.stratum: counts[i * width + 1 + r] for i, s in enumerate(design.strata)}
               for r, rule in enumerate(rules)}  # per rule, its flagged pairs per stratum
    for s in design.strata:
        if held[s.stratum] != s.pairs:
            raise UserError(f"stratum {s.stratum} of the audit ({s.sim_above} < sim <= {s.sim_at_most}) holds "
                            f"{held[s.stratum]:,} scored pairs of {db.path}, its design {s.pairs:,}: the sims moved "
                            f"since the audit was drawn ({design.scores}); draw it again from the file it evaluates")
    moved = db.con.execute(f"SELECT shard, \"index\", audit_key, key FROM labeled WHERE noisy IS NOT NULL "
                           "AND audit_key IS DISTINCT FROM key LIMIT 1").fetchall() \
        if "audit_key" in db.columns("labeled") else []
    if moved:
        shard, index, marked_key, key = moved[0]
        raise UserError(f"{db.truth_path} marks {shard} #{index} as the pair {marked_key!r}, which {db.path} holds as "
                        f"{key!r}: the shard changed since the audit was drawn; draw the audit again")
    again = "audit_again" if "audit_again" in db.columns("labeled") else "NULL::BOOLEAN"
    marked = db.con.execute(f"SELECT audit_stratum, sim, noisy, {again}{''.join(', ' + f for f in flags)} FROM labeled "
                            "WHERE noisy IS NOT NULL AND sim IS NOT NULL AND NOT isnan(sim)").fetchall()
    strata = {s.stratum: s for s in design.strata}
    for h, sim, *_ in marked:
        if h not in strata:
            raise UserError(f"{db.truth_path} marks a pair of stratum {h}, which its audit design does not have")
        low, high = strata[h].sim_above, strata[h].sim_at_most
        if (low is not None and not sim > low) or (high is not None and not sim <= high):
            raise UserError(f"a marked pair's sim {sim:.4f} lies outside its audit stratum {h} ({low} < sim <= {high}): "
                            f"{db.path} is not the scores file the audit was drawn from ({design.scores})")
    columns = list(zip(*marked)) if marked else [[] for _ in range(4 + len(rules))]
    figures = audit_figures(np.asarray(columns[0], dtype=np.int64), np.asarray(columns[2], dtype=bool),
                            [None if v is None else bool(v) for v in columns[3]],
                            {rule.name: np.asarray(columns[4 + i], dtype=bool) for i, rule in enumerate(rules)},
                            held, flagged)
    return AuditEstimates(
        marked=len(marked), scored_pairs=pairs, confidence=CONFIDENCE, interval=INTERVAL, design=design,
        unmarked_strata=figures.unmarked, judge=figures.judge, covers=COVERS, noise_share=figures.noise_share,
        rules={rule.name: RuleAudit(label=rule.label, noisy_if=rule.noisy_if, abstains=rule.abstains,
                                    flagged_share=sum(flagged[rule.name].values()) / pairs,
                                    **figures.rules[rule.name]) for rule in rules})


INTERVAL = ("stratified estimate (each stratum's variance at least Jeffreys'), Wilson at Kish's effective n (at most the "
            "pairs), corrected for the judge's error rate measured on the pairs shown twice, over its whole interval")
COVERS = ("the intervals cover which pairs were drawn and the judge's inconsistency as the pairs shown twice measure it; "
          "not errors the judge makes alike on both looks, errors more frequent on noisy than on clean pairs, nor pairs "
          "left unmarked for a reason tied to their noise")


def recorded_truth(scores: str | Path, required: bool = True) -> Path | None:
    """The truth file of the dataset a scores file recorded (a dataset `corrupt` wrote names one);
    None when it names none and the truth is not `required`."""
    from pairclean.scorefile.contract import read_metadata, scored_pairs

    if not Path(scores).is_file():
        raise UserError(f"scores file not found: {scores}")
    dataset = scored_pairs(read_metadata(scores)[0])
    if dataset is None or not dataset.truth:
        if not required:
            return None
        raise ConfigError(f"{scores} names no truth file (the dataset it scored records none, as data `corrupt` wrote "
                          "would): give `truth`", "truth")
    return Path(dataset.truth)

