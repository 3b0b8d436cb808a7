"""osa-weights: each pair's loss times its weight from a scores file (OSA Eq. 6), joined per shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pairclean.config import check_choice
from pairclean.ops.records import Keyed
from pairclean.training.loss import REDUCTIONS
from pairclean.training.methods.base import MethodContext, Shortcut, register_method
from pairclean.training.methods.scored import FILTER_SHORTCUT, SCORES_SHORTCUTS, ScoredMethod, ScoresOptions, needs_scores

REDUCTION_SHORTCUT = Shortcut("--reduction", "reduction",
                              "Weighted loss: mean (sum w*l / B, the paper) or weight-sum (sum w*l / sum w).")


@dataclass
class OsaWeightsOptions(ScoresOptions):
    column: str = "weight_norm"  # weight_norm = the OSA weight mapped to [0, 1]; `weight` = raw
    reduction: str = "mean"

    def __post_init__(self):
        super().__post_init__()
        needs_scores("osa-weights", self)
        check_choice(self.reduction, REDUCTIONS, "reduction")


@register_method
class OsaWeights(ScoredMethod):
    """Each pair's loss times its weight from the scores file (OSA Eq. 6), joined per shard."""

    name = "osa-weights"
    Options = OsaWeightsOptions
    pays = "the best on real text with shuffled captions: +15 rSum over plain at 40% shuffle (docs/methods.md)"
    shortcuts = (Shortcut("--weights", "scores", "Scores Parquet: weight each pair's loss by a column of it "
                                                 "(method osa-weights).", selects=2),
                 Shortcut("--weight-column", "column", "Column of the scores used as weight (default weight_norm, "
                                                       "the OSA weight in [0, 1])."),
                 FILTER_SHORTCUT,
                 *SCORES_SHORTCUTS, REDUCTION_SHORTCUT)

    @property
    def reduction(self) -> str:
        return self.options.reduction

    def weight_column(self) -> str | None:
        return self.options.column

    def batch_weights(self, batch: dict, ctx: MethodContext) -> tuple[torch.Tensor, Keyed]:
        return batch["weight"], {}
