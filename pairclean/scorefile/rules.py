"""Decision rules: each turns similarities into a noisy/clean decision column of the scores file.

A rule is one class registered by name (`@register`): the columns it writes (name, Arrow type),
`fit` on finalize's uniform sample of similarities, `derive` on each record batch (numpy in,
columns out), its decision column (True = flagged noisy) and `noisy_if`, a human description of
its fitted threshold that every table shows. finalize, score's summary, `evaluate detection`, the
report and the demo iterate the rules a file records in its provenance (`recorded_rules`), so a new
rule needs no edit anywhere else.

A rule that cannot decide on some data (a mixture that does not separate, no null pairs) abstains,
and abstains everywhere: it flags nothing, its other columns are NULL (not numbers that look
usable), its record says why (`RuleRecord.abstains`, also in `noisy_if`, which every table prints),
and a predicate over its columns is warned about (`scores.db.compile_predicate`); the report draws
no boundary for it and `evaluate detection` reports no calibration for it.

Rules are named at score time as specs `NAME[:key=value,...]` (`ScoreConfig.rules`, `--rule`).
The rules' own computations are imported when they run: the CLI lists the registry at start-up
without importing torch or sklearn.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import pyarrow as pa

from pairclean.config import Declared, check_choice, check_value, parse_value, split_option, within
from pairclean.errors import ConfigError, UserError
from pairclean.ops.records import JsonObject, Keyed, Record
from pairclean.scorefile.sql import sql_identifier

if TYPE_CHECKING:
    from pairclean.core.mixture import FittedMixture

DEFAULT_RULES = ("beta", "gmm")
REGISTRY: dict[str, type[DecisionRule]] = {}


@dataclass(frozen=True)
class FitContext:
    """What a rule may use besides the sample: the run's cone bias and seed, and a uniform sample
    of null similarities (in-data pairs of one row's left with another row's right: pairs that do
    not belong together; empty for runs that drew none)."""

    beta: float | None
    seed: int = 0
    null_sample: np.ndarray = field(default_factory=lambda: np.array([]))


@dataclass(frozen=True)
class RuleRecord(Record):
    """What a scores file records about one of its rules (an entry of the provenance's `rules`)."""

    what = "rule record"

    name: str
    label: str
    decision: str
    columns: list[str]
    noisy_if: str
    threshold: float | None  # the similarity at or below which pairs are flagged, when one exists
    options: dict
    notes: dict = field(default_factory=dict)  # what the rule measured on the data (an estimate, a check)
    abstains: str | None = None  # why the rule decides nothing on this file (None: it decides)

    @property
    def value_columns(self) -> list[str]:
        """Its columns other than the decision: NULL in every row when the rule abstains."""
        return [c for c in self.columns if c != self.decision]

    @classmethod
    def upgraded(cls, value: dict) -> JsonObject:
        """Files scored before `abstains` was recorded said it only in `noisy_if` (and still wrote
        the unusable posterior)."""
        noisy_if = value.get("noisy_if")
        if not value.get("abstains") and isinstance(noisy_if, str) and noisy_if.startswith("abstains"):
            return {**value, "abstains": noisy_if.split(":", 1)[1].strip() if ":" in noisy_if else noisy_if}
        return value


class DecisionRule(ABC):
    """One way to decide which pairs are noisy. Subclasses set the class attributes, take their
    options as keyword arguments (`OPTIONS` declares each one's type and bounds, checked here) and
    implement the methods."""

    name: ClassVar[str]  # registry key: `--rule NAME`, summary keys flagged_NAME / share_flagged_NAME
    label: ClassVar[str]  # how tables name it
    columns: ClassVar[tuple[tuple[str, pa.DataType], ...]]  # written in this order
    decision: ClassVar[str]  # the bool column among `columns`: True = flagged noisy
    clean_probability: ClassVar[str | None] = None  # a column among `columns` claiming P(clean): its calibration is measured
    OPTIONS: ClassVar[dict[str, Declared]] = {}

    def __init__(self, **options):
        for key, value in options.items():
            declared = self.OPTIONS[key]
            options[key] = check_value(value, declared.kind, declared.bounds, key, declared.optional)
        self.options = options

    @abstractmethod
    def fit(self, sample: np.ndarray, context: FitContext) -> None:
        """Learn the threshold from a uniform sample of the valid similarities (may be empty)."""

    @abstractmethod
    def derive(self, sim: np.ndarray) -> Keyed[str, np.ndarray]:
        """Every column of the rule for a batch of similarities (NaN where a pair has no score;
        finalize writes those rows as NULL)."""

    @abstractmethod
    def noisy_if(self) -> str:
        """The fitted decision in words, e.g. "sim <= 0.4350" or "p_clean < 0.5"."""

    def threshold(self) -> float | None:
        """The similarity at or below which this rule flags, when the rule is such a threshold."""
        return None

    def provenance(self) -> JsonObject:
        """Top-level provenance entries this rule owns (what it fitted, for readers of the file):
        fields of `scores.contract.Provenance`."""
        return {}

    def notes(self) -> JsonObject:
        """What the rule measured on the data that a reader of the summary should see (JSON values)."""
        return {}

    def abstains(self) -> str | None:
        """Why the rule decides nothing on the data it was fitted on (None: it decides). An abstaining
        rule's `derive` flags nothing and gives NaN (written as NULL) in its other columns."""
        return None

    def record(self) -> RuleRecord:
        return RuleRecord(name=self.name, label=self.label, decision=self.decision,
                          columns=[name for name, _ in self.columns], noisy_if=self.noisy_if(),
                          threshold=self.threshold(), options=dict(self.options), notes=self.notes(),
                          abstains=self.abstains())


def register(cls: type[DecisionRule]) -> type[DecisionRule]:
    """Class decorator: make a rule available by its name."""
    if cls.name in REGISTRY:
        raise TypeError(f"a rule named {cls.name} is already registered ({REGISTRY[cls.name].__qualname__})")
    if cls.decision not in dict(cls.columns):
        raise TypeError(f"rule {cls.name}: decision column {cls.decision} is not among its columns")
    REGISTRY[cls.name] = cls
    return cls


@register
class BetaRule(DecisionRule):
    """The OSA boundary: a pair is noisy when its debiased similarity s - beta is <= 0 (Table 5)."""

    name, label, decision = "beta", "beta", "osa_noisy"
    columns = (("osa_noisy", pa.bool_()),)

    def fit(self, sample, context):
        self.beta = context.beta

    def derive(self, sim):
        from pairclean.core.scorer import beta_noisy, debias

        return {"osa_noisy": beta_noisy(debias(sim, self.beta))}

    def noisy_if(self):
        return f"sim <= {self.beta:.4f}" if self.beta is not None else "sim <= beta"

    def threshold(self):
        return self.beta


@register
class GmmRule(DecisionRule):
    """Two Gaussians over the similarities: noisy when the clean component's posterior is < 0.5.

    NCR/SDD style; the mixture is recorded in the provenance under "gmm". It abstains (flags
    nothing, p_clean NULL, says why in `noisy_if`, the summary and a warning) when the mixture does
    not separate the data (`core.mixture.mixture_separation`): a mixture fitted to one hump, or
    whose noisy component is far from the run's random pairings, would flag clean pairs, and its
    posterior would look like a probability that means nothing."""

    name, label, decision = "gmm", "GMM", "gmm_noisy"
    columns = (("p_clean", pa.float32()), ("gmm_noisy", pa.bool_()))
    clean_probability = "p_clean"

    def fit(self, sample, context):
        from pairclean.core.mixture import fit_similarity_mixture, mixture_separation
        from pairclean.ops.notices import notice

        self.mixture: FittedMixture | None = fit_similarity_mixture(sample, seed=context.seed) \
            if len(sample) >= 2 else None
        self.separation, self.why = {}, None
        if self.mixture is not None:
            self.separation, self.why = mixture_separation(self.mixture, context.null_sample, sample)
        if self.why:
            notice(f"the GMM rule abstains (flags nothing, p_clean is NULL): {self.why}; the noise is not "
                   "separable by this estimator's similarity. Use the null-calibrated rule (`rules` fdr) or an audit",
                   "rules")

    def abstains(self):
        return self.why

    def derive(self, sim):
        if self.mixture is None or self.abstains():
            return {"p_clean": np.full(len(sim), np.nan), "gmm_noisy": np.zeros(len(sim), bool)}
        p = self.mixture.p_clean(np.nan_to_num(sim, nan=0.0))
        return {"p_clean": p, "gmm_noisy": p < 0.5}

    def noisy_if(self):
        if self.abstains():
            return f"abstains: {self.abstains()}"
        return "p_clean < 0.5"  # the crossing in sim depends on both components (one or two boundaries)

    def provenance(self):
        return {"gmm": self.mixture}

    def notes(self):
        return {**self.separation, "separates": self.mixture is not None and self.abstains() is None}


@register
class FdrRule(DecisionRule):
    """Null-calibrated: a pair is kept when its similarity is significantly above random pairings.

    Each pair's p-value is the share of the run's null similarities (in-data pairs that do not
    belong together) at least as high; Benjamini-Hochberg q-values over all pairs; flagged when
    q > alpha, so that among the kept pairs the expected share of random-pairing noise is at most
    alpha (`core.null`). It abstains when the run drew no null pairs."""

    name, label, decision = "fdr", "FDR", "fdr_noisy"
    columns = (("p_null", pa.float32()), ("q_null", pa.float32()), ("fdr_noisy", pa.bool_()))
    OPTIONS = {"alpha": Declared(float, within(0, 1, low_open=True, high_open=True))}

    def __init__(self, alpha: float = 0.05):
        super().__init__(alpha=alpha)
        self.calibration = None

    def fit(self, sample, context):
        from pairclean.core.null import NullCalibration
        from pairclean.ops.notices import notice

        null = np.asarray(context.null_sample, dtype=np.float64)
        if len(null) < 2 or not len(sample):
            notice("the fdr rule abstains (flags nothing): this run drew no null pairs "
                   "(every batch held fewer than two scored pairs)")
            return
        self.calibration = NullCalibration.fit(null, sample)
        self.cut = self.calibration.cut(self.options["alpha"])

    def abstains(self):
        return None if self.calibration is not None else "no null pairs were drawn"

    def derive(self, sim):
        if self.calibration is None:
            nan = np.full(len(sim), np.nan)
            return {"p_null": nan, "q_null": nan, "fdr_noisy": np.zeros(len(sim), bool)}
        q = self.calibration.q_values(sim)
        return {"p_null": self.calibration.p_values(sim), "q_null": q, "fdr_noisy": q > self.options["alpha"]}

    def noisy_if(self):
        if self.abstains():
            return f"abstains: {self.abstains()}"
        return f"q > {self.options['alpha']:g} (sim <= {self.cut:.4f})"

    def threshold(self):
        return self.cut if self.calibration is not None and np.isfinite(self.cut) else None

    def notes(self):
        if self.calibration is None:
            return {}
        return {"null_pairs": self.calibration.m, "null_mean": float(self.calibration.null.mean())}


def top_count(keep: float, n: int) -> int:
    """How many of `n` ranked values the top fraction `keep` keeps: floor(keep x n), rounded to 6
    places first so that 0.7 of 10 keeps 7 (in binary floating point 0.7 x 10 is 6.99...)."""
    return math.floor(round(keep * n, 6))


@register
class TopFractionRule(DecisionRule):
    """Keep the `keep` share of the pairs with the highest similarity, flag the rest.

    DataComp style, and pairclean's one "top fraction" (default keep=0.8): of n ranked values the
    `top_count` highest are kept. Fitted at scoring time on finalize's sample, the cut is the
    highest sample value not kept. Over a whole scores file (`filter`'s top fraction) `keep_sql`
    ranks every row by any numeric column, ties broken by (shard, index), so the count is exact."""

    name, label, decision = "top-fraction", "top-fraction", "top_fraction_noisy"
    columns = (("top_fraction_noisy", pa.bool_()),)
    OPTIONS = {"keep": Declared(float, within(0, 1, low_open=True))}

    def __init__(self, keep: float = 0.8):
        super().__init__(keep=keep)
        self.cut: float | None = None
        self.ranked = 0

    def fit(self, sample, context):
        values = np.sort(np.asarray(sample, dtype=np.float64))
        self.ranked = len(values)
        kept = top_count(self.options["keep"], len(values))
        self.cut = float(values[len(values) - kept - 1]) if kept < len(values) else None

    def derive(self, sim):
        return {"top_fraction_noisy": sim <= self.cut if self.cut is not None else np.zeros(len(sim), bool)}

    def noisy_if(self):
        if self.cut is not None:
            return f"sim <= {self.cut:.4f}"
        return "nothing (keeps every pair)" if self.ranked else "nothing (no similarity to rank)"

    def threshold(self):
        return self.cut

    def keep_sql(self, db, column: str, view: str = "scores") -> str:
        """A boolean SQL expression over `view` of a `scores.db.ScoresDB`, true for the
        `top_count` rows with the highest `column` (a numeric column; NULL and NaN rank nowhere).

        The cut-off row is found once and kept in a temp table, so per-shard evaluation is a
        comparison, not a ranking."""
        col = sql_identifier(column)
        n = db.scalar(f"SELECT count({col}) FROM {view} WHERE NOT isnan({col}::DOUBLE)")
        k = top_count(self.options["keep"], n)
        if k == 0:
            return "false"
        db.con.execute(f"CREATE OR REPLACE TEMP TABLE top_cutoff AS SELECT {col}::DOUBLE AS v, shard AS s, "
                       f"\"index\" AS i FROM {view} WHERE {col} IS NOT NULL AND NOT isnan({col}::DOUBLE) "
                       f"ORDER BY {col} DESC, shard, \"index\" LIMIT 1 OFFSET {k - 1}")
        v, s, i = "(SELECT v FROM top_cutoff)", "(SELECT s FROM top_cutoff)", "(SELECT i FROM top_cutoff)"
        return (f"(NOT isnan({col}::DOUBLE) AND ({col} > {v} OR ({col} = {v} AND "
                f"(shard < {s} OR (shard = {s} AND \"index\" <= {i})))))")


def parse_rule(spec: str) -> DecisionRule:
    """A rule from its spec `NAME[:key=value,...]`: an unknown name or option, an option given twice,
    or a value outside its declaration is a ConfigError naming `rules` (the CLI's --rule)."""
    name, _, rest = spec.strip().partition(":")
    check_choice(name, tuple(REGISTRY), "rules", "rule")
    cls = REGISTRY[name]
    options = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, value = split_option(item) or (None, None)
        if key not in cls.OPTIONS:
            allowed = ", ".join(cls.OPTIONS) or "none"
            raise ConfigError(f"`rules` {spec!r}: bad option {item!r} (options of {name}: {allowed}; "
                              "write NAME:key=value)", "rules")
        if key in options:
            raise ConfigError(f"`rules` {spec!r}: option {key} is given twice", "rules")
        try:
            options[key] = parse_value(value, cls.OPTIONS[key], key)
        except ConfigError as exc:
            raise ConfigError(f"`rules` {spec!r}: {exc}", "rules") from None
    return cls(**options)


def build_rules(specs) -> list[DecisionRule]:
    """The rules named by `specs`; no two may write the same column (a rule is enabled once)."""
    rules = [parse_rule(spec) for spec in specs]
    owner: dict[str, str] = {}
    for rule in rules:
        for column, _ in rule.columns:
            if column in owner:
                raise UserError(f"rules {owner[column]} and {rule.name} both write column {column}: "
                                "enable each rule once")
            owner[column] = rule.name
    return rules


def recorded_rules(provenance, columns) -> list[RuleRecord]:
    """The rules a scores file holds (`provenance`: its `scores.contract.Provenance`, or None): as
    its provenance records them (those whose columns it still has), else (files written before
    rules were recorded) the default rules whose decision column it has, with the file's beta."""
    if provenance is not None and provenance.rules is not None:
        return [record for record in provenance.rules if all(column in columns for column in record.columns)]
    present = []
    for name in DEFAULT_RULES:
        rule = REGISTRY[name]()
        if rule.decision in columns:
            rule.fit(np.array([]), FitContext(beta=provenance.beta if provenance is not None else None))
            present.append(rule.record())
    return present
