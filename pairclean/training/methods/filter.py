"""filter: train only on the pairs a predicate over a scores file keeps (they are not even negatives)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pairclean.errors import ConfigError
from pairclean.training.methods.base import register_method
from pairclean.training.methods.scored import FILTER_SHORTCUT, SCORES_SHORTCUTS, ScoredMethod, ScoresOptions, needs_scores


@dataclass
class FilterOptions(ScoresOptions):
    def __post_init__(self):
        super().__post_init__()
        needs_scores("filter", self)
        if not self.filter:
            raise ConfigError("method filter needs a predicate: set filter (a DuckDB expression over the scores)",
                              "filter")


@register_method
class Filter(ScoredMethod):
    """Train only on the pairs the predicate keeps (they are not even negatives); no weighting."""

    name = "filter"
    Options = FilterOptions
    shortcuts = (replace(FILTER_SHORTCUT, selects=1),
                 *SCORES_SHORTCUTS)
