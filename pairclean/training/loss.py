"""Symmetric per-sample InfoNCE, optionally weighted per pair (OSA Eq. 6).

Per sample i (training-methods.md): `l_i = CE_row_i + CE_col_i`, the left->right and right->left
cross-entropies of the in-batch similarity matrix with the positives on the diagonal. The batch
loss is `sum_i w_i * l_i / B` (the paper multiplies each sample's loss by its weight), or
`sum_i w_i * l_i / sum_i w_i` with reduction "weight-sum" (keeps the loss scale when most weights
are small). Weights are detached: they steer the gradient, they never receive one.

Distributed-ready: the columns may be embeddings gathered from every rank (`all_left`,
`all_right`), with this rank's rows at `offset` in them; by default the batch is its own world.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "weight-sum")


@dataclass
class InfoNCETerms:
    left_to_right: torch.Tensor  # (B,) CE of each left item over all right items
    right_to_left: torch.Tensor  # (B,) CE of each right item over all left items

    @property
    def per_sample(self) -> torch.Tensor:
        return self.left_to_right + self.right_to_left


def infonce_terms(left: torch.Tensor, right: torch.Tensor, logit_scale: torch.Tensor | float,
                  all_left: torch.Tensor | None = None, all_right: torch.Tensor | None = None,
                  offset: int = 0) -> InfoNCETerms:
    """Both directions' per-sample cross-entropies; `left`, `right` are L2-normalised (B, d)."""
    all_left = left if all_left is None else all_left
    all_right = right if all_right is None else all_right
    target = torch.arange(left.shape[0], device=left.device) + offset
    logits_lr = (logit_scale * left @ all_right.T).float()
    logits_rl = (logit_scale * right @ all_left.T).float()
    return InfoNCETerms(F.cross_entropy(logits_lr, target, reduction="none"),
                        F.cross_entropy(logits_rl, target, reduction="none"))


def weighted_infonce(left: torch.Tensor, right: torch.Tensor, logit_scale: torch.Tensor | float,
                     weights: torch.Tensor | None = None, reduction: str = "mean",
                     all_left: torch.Tensor | None = None, all_right: torch.Tensor | None = None,
                     offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch loss, detached per-sample loss l_i); `weights=None` is plain symmetric InfoNCE."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}")
    per_sample = infonce_terms(left, right, logit_scale, all_left, all_right, offset).per_sample
    if weights is None:
        return per_sample.mean(), per_sample.detach()
    w = weights.detach().to(per_sample.device, per_sample.dtype)
    total = (w * per_sample).sum()
    if reduction == "weight-sum":
        loss = total / w.sum().clamp(min=1e-12)
    else:
        loss = total / per_sample.shape[0]
    return loss, per_sample.detach()
