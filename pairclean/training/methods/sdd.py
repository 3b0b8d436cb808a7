"""SDD, self-drop and dual-weight (seeds/sdd-self-drop-dual-weight.txt; training-methods.md).

Each epoch a no-grad pass of the base model gives every pair's similarity s = 100 cos; pairs
with s <= alpha are dropped for the epoch (not even negatives: they are never read), and a
2-component GMM over all s gives the confidence weight w_con. Before training, the memory bank
assigns each pair the clean pairs (s > beta under the initial model) whose image is nearest to
its image and whose text is nearest to its text. Per step a siamese copy of the base (re-copied
each epoch) measures the bank entries' losses, takes one step on the batch with w_con * l and
measures them again: c = their loss ratio before/after, w_sig = tanh(c) below 1, else 1. The
base trains on mean(w_con * w_sig * l). Qua-partition per pair: noisy (dropped), vague
(w_con < 0.5), clean-insignificant (c < 1), clean-significant.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pairclean.core.mixture import clean_posterior
from pairclean.config import COUNT, above, setting, within
from pairclean.errors import ConfigError
from pairclean.ops import distributed
from pairclean.ops.records import JsonObject, StateDict
from pairclean.training.data import DROPPED, BatchPlan
from pairclean.training.loss import infonce_terms, weighted_infonce
from pairclean.training.methods.base import Embeddings, LossOutput, Method, MethodContext, register_method
from pairclean.training.robust import (EpochWeights, Network, PairIndex, gather_pairs, pair_embeddings, pair_pass,
                                    read_pairs, replica, write_pair_table)

PARTITIONS = ("noisy", "vague", "clean_insignificant", "clean_significant", "clean_unmeasured")


def self_drop(sim100: np.ndarray, alpha: float) -> np.ndarray:
    """Eq. 4: the pairs kept for the epoch, s > alpha."""
    return sim100 > alpha


def confidence_weights(sim100: np.ndarray, seed: int = 0) -> np.ndarray:
    """Eq. 5-6: posterior of the higher-mean component of a 2-component GMM over the similarities."""
    return clean_posterior(sim100, n_components=2, seed=seed)[0][:, 0]


def significance(before_i2t: torch.Tensor, before_t2i: torch.Tensor, after_i2t: torch.Tensor,
                 after_t2i: torch.Tensor, eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 10-11: c = mean of the bank losses' before/after ratios; w_sig = tanh(c) if c < 1 else 1."""
    c = 0.5 * (before_i2t / (after_i2t + eps) + before_t2i / (after_t2i + eps))
    return c, torch.where(c < 1, torch.tanh(c), torch.ones_like(c))


def partition(sim100: np.ndarray, alpha: float, w_con: np.ndarray, c: np.ndarray) -> np.ndarray:
    """The qua-partition label of each pair; a kept pair no step measured (c NaN) is clean_unmeasured."""
    label = np.where(c < 1, "clean_insignificant", np.where(np.isnan(c), "clean_unmeasured", "clean_significant"))
    label = np.where(w_con < 0.5, "vague", label)
    return np.where(sim100 <= alpha, "noisy", label).astype(object)


def nearest(queries: torch.Tensor, bank: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Row of `bank` with the highest inner product for each query, in chunks of queries (no N x M matrix)."""
    out = torch.empty(len(queries), dtype=torch.long)
    for start in range(0, len(queries), chunk):
        out[start:start + chunk] = (queries[start:start + chunk] @ bank.T).argmax(dim=1)
    return out


def memory_bank(left: np.ndarray, right: np.ndarray, clean: np.ndarray, chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 7-8: for every pair, the id of the clean pair whose left item is nearest to its left item
    and the id of the clean pair whose right item is nearest to its right item (itself included)."""
    clean_ids = np.flatnonzero(clean)
    u, v = torch.from_numpy(np.nan_to_num(left)), torch.from_numpy(np.nan_to_num(right))
    image = clean_ids[nearest(u, u[clean_ids], chunk).numpy()]
    text = clean_ids[nearest(v, v[clean_ids], chunk).numpy()]
    return image, text


def bank_losses(target, scale, entries_image: tuple, entries_text: tuple, left_mod: str, right_mod: str):
    """Eq. 9: (l_i2t, l_t2i) of each pair's two bank entries, each set of entries one in-batch InfoNCE."""
    terms = [infonce_terms(target.encode(left_mod, lb), target.encode(right_mod, rb), scale)
             for lb, rb in (entries_image, entries_text)]
    return terms[0].left_to_right + terms[1].left_to_right, terms[0].right_to_left + terms[1].right_to_left


@dataclass
class SddOptions:
    alpha: float = setting(20.0, within(-100, 100))  # self-drop: pairs with 100 * cos <= alpha are left out of the epoch
    beta: float = setting(30.0, within(-100, 100))  # memory bank: clean pairs have 100 * cos > beta under the initial model
    eps: float = setting(1e-8, above(0))  # in the denominators of c
    chunk: int = setting(1024, COUNT)  # queries per block of the nearest-neighbour search

    def __post_init__(self):
        if self.beta < self.alpha:
            raise ConfigError(f"sdd: beta ({self.beta}) must be at least alpha ({self.alpha}): the memory bank holds "
                              "clean pairs", "beta", "alpha")


@register_method
class Sdd(Method):
    """Self-drop below alpha, loss x w_con (GMM) x w_sig (siamese copy + memory bank)."""

    name = "sdd"
    Options = SddOptions
    pays = "+12 rSum over plain on real text at 40% shuffle, +7 with weak captions mixed in (docs/methods.md)"

    def __init__(self, options):
        super().__init__(options)
        self.bank_image = self.bank_text = None
        self.initial_kept = None
        self.initial = None

    def setup(self, ctx: MethodContext) -> BatchPlan:
        self.index = PairIndex(ctx.shards)
        self.weights = EpochWeights(ctx, self.index)
        if self.bank_image is None:  # a resumed run restored the bank built by the initial model
            self.initial = pair_pass(ctx, ctx.target, pair_embeddings, self.index)
            sim100 = 100 * self.initial["sim"]
            clean = self.initial.seen & (sim100 > self.options.beta)
            if not clean.any():
                raise ConfigError(f"sdd: no pair has 100 * cos > beta = {self.options.beta} under the initial model, "
                                  "so the memory bank is empty; lower beta or start from a trained model", "beta")
            self.bank_image, self.bank_text = memory_bank(self.initial["left"], self.initial["right"], clean,
                                                          self.options.chunk)
            self.initial_kept = int(np.sum(self.initial.seen & self_drop(sim100, self.options.alpha)))
        self.entries = read_pairs(ctx.dataset, set(self.bank_image.tolist()) | set(self.bank_text.tolist()), self.index)
        self.siamese = Network(ctx, replica(ctx.target))
        return self.weights.plan(pairs=max(self.initial_kept, 1))

    def on_epoch_start(self, epoch: int, ctx: MethodContext) -> None:
        table = self.initial if epoch == 1 and self.initial is not None else \
            pair_pass(ctx, ctx.target, pair_embeddings, self.index)
        self.initial = None
        sim100 = np.where(table.seen, 100 * table["sim"], -np.inf)
        kept = self_drop(sim100, self.options.alpha)
        if not kept.any():
            raise ConfigError(f"sdd: epoch {epoch} keeps no pair (100 * cos > alpha = {self.options.alpha}); lower alpha",
                              "alpha")
        self.w_con = np.zeros(self.index.size, dtype=np.float32)
        self.w_con[table.seen] = confidence_weights(sim100[table.seen], seed=ctx.seed)
        self.sim100, self.seen = sim100, table.seen
        self.weights.write(np.where(kept, self.w_con, DROPPED))
        self.siamese.copy_weights(ctx.target)
        self.siamese.start(ctx, ctx.current_step())
        self.measured_ids, self.measured_c = [], []

    def _entries(self, ids: np.ndarray, ctx: MethodContext) -> tuple:
        preparer = ctx.target.preparer
        items = [self.entries[int(i)] for i in ids]
        return (preparer.collate(ctx.left, [preparer.prepare(ctx.left, x.left) for x in items]),
                preparer.collate(ctx.right, [preparer.prepare(ctx.right, x.right) for x in items]))

    def loss(self, batch: dict, emb: Embeddings, ctx: MethodContext) -> LossOutput:
        ids = self.index.ids(batch["shard"], batch["index"])
        w_con = batch["weight"].to(emb.left.device)
        by_image, by_text = self._entries(self.bank_image[ids], ctx), self._entries(self.bank_text[ids], ctx)
        twin = self.siamese.target
        with torch.no_grad():
            before = bank_losses(twin, twin.logit_scale(), by_image, by_text, ctx.left, ctx.right)
        left, right = twin.encode(ctx.left, batch["left"]), twin.encode(ctx.right, batch["right"])
        all_left, all_right = distributed.gather_with_grad(left), distributed.gather_with_grad(right)
        twin_loss, _ = weighted_infonce(left, right, twin.logit_scale(), w_con, all_left=all_left, all_right=all_right,
                                        offset=emb.offset)
        self.siamese.step(twin_loss)
        with torch.no_grad():
            after = bank_losses(twin, twin.logit_scale(), by_image, by_text, ctx.left, ctx.right)
        c, w_sig = significance(*before, *after, eps=self.options.eps)
        self.measured_ids.append(ids)
        self.measured_c.append(c.float().cpu().numpy())
        weights = w_con * w_sig.to(w_con.device)
        loss, per_pair = weighted_infonce(emb.left, emb.right, emb.logit_scale, weights, all_left=emb.all_left,
                                          all_right=emb.all_right, offset=emb.offset)
        diag = {"loss": per_pair, "w_con": w_con.detach(), "c": c.detach(), "w_sig": w_sig.detach(),
                "weight": weights.detach()}
        return LossOutput(loss, diag, {"mean_weight": weights.detach().mean(), "mean_w_sig": w_sig.detach().mean()})

    def on_epoch_end(self, epoch: int, ctx: MethodContext) -> JsonObject:
        ids = np.concatenate(self.measured_ids) if self.measured_ids else np.zeros(0, dtype=np.int64)
        c = np.concatenate(self.measured_c) if self.measured_c else np.zeros(0, dtype=np.float32)
        c = gather_pairs(self.index.size, ids, {"c": c})["c"]
        labels = partition(self.sim100, self.options.alpha, self.w_con, c)
        w_sig = np.where(c < 1, np.tanh(c), np.where(np.isnan(c), np.nan, 1.0))
        write_pair_table(ctx, epoch, self.index, self.seen,
                         {"sim": self.sim100 / 100, "kept": self_drop(self.sim100, self.options.alpha),
                          "w_con": self.w_con, "c": c, "w_sig": w_sig, "partition": labels})
        seen = labels[self.seen]
        return {f"sdd_{name}": int(np.sum(seen == name)) for name in PARTITIONS} | \
            {"sdd_memory_bank_pairs": len(np.unique(np.concatenate([self.bank_image, self.bank_text])))}

    def state_dict(self) -> StateDict:
        return {"bank_image": torch.from_numpy(self.bank_image), "bank_text": torch.from_numpy(self.bank_text),
                "initial_kept": self.initial_kept}

    def load_state_dict(self, state: dict) -> None:
        self.bank_image, self.bank_text = state["bank_image"].numpy(), state["bank_text"].numpy()
        self.initial_kept = state["initial_kept"]
