"""GSC, geometrical structure consistency (seeds/gsc-geometrical-structure-consistency.txt;
training-methods.md; the authors' code, MediaBrain-SJTU/GSC [C]), on a dual encoder.

Per step, from the training forward pass: the cross-modal indicator y_CM (Eq. 3, both softmax
directions of S / tau1 at the diagonal, tau1 = 0.07) and the intra-modal structure similarity
S_IM (Eq. 8, the cosine between a pair's rows of S_II and S_TT with columns scaled by the labels),
both stored detached per pair. Per epoch: a 2-component GMM over min-max normalised S_IM gives
y_IM (Eq. 4), y_CM and y_IM are each ensembled with the previous epoch's (Eq. 10, weight beta on
the new one), and the label is y = min(y_CM, y_IM) (Eq. 5). Loss: L_CM (y-weighted symmetric
InfoNCE at the run's temperature, as every method trains; noisy pairs stay as negatives) + gamma *
L_IM (Eq. 7, CE over the rows of (S_II * y)(S_TT * y)^T / tau2, weighted by y_i). With networks=2
a peer network, with its own data order, trains beside the main one; each trains with the other's
labels and evaluation averages both networks' similarities.

The paper's premises come from its model, SGR, whose similarity is a learned score squashed by a
sigmoid: clean pairs saturate (y_CM near 1) and intra-modal rows are sparse (`sigmoid(sims) *
targets` [C]). A dual encoder's cosine does neither: a clean pair's in-batch softmax diagonal stays
near 0.1 and every cosine row shares a common offset, so S_IM is nearly 1 for every pair. Three
adaptations, each an option with the paper's letter beside it:
* `y_cm=posterior`: y_CM is the clean posterior of a 2-component GMM over the epoch's log
  softmax diagonals (it ranks pairs as Eq. 3 does, on the 0-1 scale Eq. 5 and 6 assume);
  `softmax`: Eq. 3 itself.
* `structure=centred`: each intra-modal row without its diagonal, centred on its label-weighted
  mean before the labels scale it (S_IM then reads the shape of the row, not its offset; L_IM uses
  the same rows); `paper`: Eq. 7-8 on the raw rows.
* `init_labels=pass`: y_CM and y_IM start from a no-grad pass of the starting model (a fine-tune
  starts from a model that already ranks pairs); `ones`: the paper's start at 1, which makes the
  first epoch plain training on the noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pairclean.config import COUNT, SHARE, above, at_least, check_choice, setting, within
from pairclean.backends.base import host_values
from pairclean.backends.feed import HostCopies
from pairclean.core.mixture import clean_posterior
from pairclean.ops.records import JsonObject, Keyed, StateDict
from pairclean.training.loss import infonce_terms, weighted_infonce
from pairclean.training.methods.base import Embeddings, LossOutput, Method, MethodContext, register_method, too_short
from pairclean.training.robust import PairIndex, Peer, gather_batch_ids, gather_pairs, pair_pass, write_pair_table

Y_CM_FORMS = ("posterior", "softmax")
STRUCTURES = ("centred", "paper")
INITIAL_LABELS = ("pass", "ones")


def cross_modal_indicator(left, right, logit_scale, all_left=None, all_right=None, offset: int = 0) -> torch.Tensor:
    """Eq. 3: 0.5 * (softmax_row(S / tau1)_ii + softmax_col(S / tau1)_ii) = mean of exp(-CE) both ways,
    logit_scale = 1 / tau1."""
    terms = infonce_terms(left, right, logit_scale, all_left, all_right, offset)
    return 0.5 * (torch.exp(-terms.left_to_right) + torch.exp(-terms.right_to_left))


def structure_rows(items, all_items, labels, offset: int = 0, centred: bool = False) -> torch.Tensor:
    """Intra-modal rows of `items` (global positions offset, offset + 1, ...) against `all_items`, column j
    scaled by the label y_j (Eq. 7-8). `centred`: the item's own column left out, and each row centred
    on its label-weighted mean over the other columns before the scaling."""
    rows = items @ all_items.T
    if not centred:
        return rows * labels[None, :]
    own = torch.zeros_like(rows, dtype=torch.bool)
    own[torch.arange(len(items), device=rows.device), torch.arange(len(items), device=rows.device) + offset] = True
    weights = labels[None, :].expand_as(rows).masked_fill(own, 0.0)
    mean = (weights * rows).sum(1, keepdim=True) / weights.sum(1, keepdim=True).clamp(min=1e-12)
    return (rows - mean) * weights


def masked_structures(left, right, labels, all_left=None, all_right=None, offset: int = 0,
                      centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of S_II * y and S_TT * y: this rank's items against every item, column j scaled by y_j."""
    all_left = left if all_left is None else all_left
    all_right = right if all_right is None else all_right
    return (structure_rows(left, all_left, labels, offset, centred),
            structure_rows(right, all_right, labels, offset, centred))


def intra_modal_similarity(left, right, labels, all_left=None, all_right=None, offset: int = 0,
                           centred: bool = False) -> torch.Tensor:
    """Eq. 8: S_IM_i = cos(row_i(S_II * y), row_i(S_TT * y))."""
    image_rows, text_rows = masked_structures(left, right, labels, all_left, all_right, offset, centred)
    return F.cosine_similarity(image_rows, text_rows, dim=1)


def intra_modal_loss(left, right, labels, own_labels, tau2: float, all_left=None, all_right=None,
                     offset: int = 0, centred: bool = False) -> torch.Tensor:
    """Eq. 7, weighted by y_i: CE over rows of M = (S_II * y)(S_TT * y)^T / tau2, targets on the diagonal."""
    all_left = left if all_left is None else all_left
    all_right = right if all_right is None else all_right
    image_rows = structure_rows(left, all_left, labels, offset, centred)
    all_text_rows = structure_rows(all_right, all_right, labels, 0, centred)
    logits = image_rows @ all_text_rows.T / tau2
    target = torch.arange(left.shape[0], device=left.device) + offset
    return (own_labels * F.cross_entropy(logits.float(), target, reduction="none")).mean()


def calibrated_indicator(y_cm: np.ndarray, seed: int = 0, max_iter: int = 10, tol: float = 1e-2,
                         reg_covar: float = 5e-4) -> np.ndarray:
    """y_CM as a clean posterior: a 2-component GMM over log y_CM (min-max normalised), the posterior of
    the higher component. The ranking of Eq. 3 on the scale y = min(y_CM, y_IM) needs."""
    logs = np.log(np.clip(np.asarray(y_cm, dtype=np.float64), 1e-12, None))
    return clean_posterior(logs, n_components=2, seed=seed, max_iter=max_iter, tol=tol, reg_covar=reg_covar)[0][:, 0]


def momentum(previous: np.ndarray, current: np.ndarray, beta: float) -> np.ndarray:
    """Eq. 10: beta * this epoch's estimate + (1 - beta) * the previous one."""
    return beta * current + (1 - beta) * previous


@dataclass
class GscOptions:
    tau1: float | None = setting(0.07, above(0))  # temperature of the cross-modal indicator (the paper's); None: the run's
    tau2: float = setting(1.0, above(0))  # temperature of the intra-modal loss
    gamma: float = setting(0.01, at_least(0))  # weight of L_IM
    beta1: float = setting(0.7, SHARE)  # momentum of y_CM (weight of the new epoch's estimate)
    beta2: float = setting(0.7, SHARE)  # momentum of y_IM
    networks: int = setting(1, within(1, 2))  # 2: a peer network; each trains with the other's labels
    gmm_max_iter: int = setting(10, COUNT)
    gmm_tol: float = setting(1e-2, above(0))
    gmm_reg_covar: float = setting(5e-4, above(0))
    y_cm: str = "posterior"  # posterior: a GMM's clean posterior over the indicator; softmax: Eq. 3 as is
    structure: str = "centred"  # centred: intra-modal rows centred, without the diagonal; paper: Eq. 7-8 as is
    init_labels: str = "pass"  # pass: labels from a no-grad pass of the starting model; ones: the paper's start

    def __post_init__(self):
        check_choice(self.y_cm, Y_CM_FORMS, "y_cm", "indicator form")
        check_choice(self.structure, STRUCTURES, "structure", "structure form")
        check_choice(self.init_labels, INITIAL_LABELS, "init_labels", "label start")


class _Labels:
    """One network's correspondence estimates: ensembled y_CM, y_IM over all pairs, and this epoch's raw values."""

    def __init__(self, size: int):
        self.y_cm = np.ones(size, dtype=np.float32)
        self.y_im = np.ones(size, dtype=np.float32)
        self.new_epoch()

    @property
    def y(self) -> np.ndarray:
        return np.minimum(self.y_cm, self.y_im)

    def new_epoch(self) -> None:
        self.ids, self.steps = [], []

    def record(self, ids: np.ndarray, cm: torch.Tensor, sim: torch.Tensor) -> None:
        """A step's values, on their way to the host (read at the epoch's end: a step never waits for them)."""
        self.ids.append(ids)
        self.steps.append(HostCopies({"cm": cm.float(), "sim": sim.float()}))

    @staticmethod
    def estimates(cm: np.ndarray, sim: np.ndarray, seen: np.ndarray, o: GscOptions, seed: int) -> tuple:
        """This epoch's y_CM (Eq. 3, or its calibrated posterior) and y_IM (Eq. 4, the GMM over S_IM) of the
        seen pairs (NaN elsewhere)."""
        y_cm_now = np.full(len(cm), np.nan, dtype=np.float32)
        y_im_now = np.full(len(cm), np.nan, dtype=np.float32)
        if seen.sum() >= 2:
            gmm = {"seed": seed, "max_iter": o.gmm_max_iter, "tol": o.gmm_tol, "reg_covar": o.gmm_reg_covar}
            y_cm_now[seen] = calibrated_indicator(cm[seen], **gmm) if o.y_cm == "posterior" else cm[seen]
            y_im_now[seen] = clean_posterior(sim[seen], n_components=2, **gmm)[0][:, 0]
        return y_cm_now, y_im_now

    def start_from(self, table, o: GscOptions, seed: int) -> None:
        """init_labels=pass: y_CM and y_IM of the starting model (no ensembling with the start at 1)."""
        y_cm, y_im = self.estimates(table["cm"], table["sim"], table.seen, o, seed)
        self.y_cm[table.seen], self.y_im[table.seen] = y_cm[table.seen], y_im[table.seen]

    def update(self, size: int, o: GscOptions, seed: int) -> Keyed[str, np.ndarray]:
        """End of an epoch: gather every rank's values, this epoch's estimates, ensemble; pairs no step
        saw keep their labels."""
        cat = (lambda xs, dtype: np.concatenate(xs) if xs else np.zeros(0, dtype=dtype))
        steps = [step.wait() for step in self.steps]
        table = gather_pairs(size, cat(self.ids, np.int64), {name: cat([v[name].numpy() for v in steps], np.float32)
                                                             for name in ("cm", "sim")})
        seen = table.seen
        y_cm_now, y_im_now = self.estimates(table["cm"], table["sim"], seen, o, seed)
        self.y_cm[seen] = momentum(self.y_cm[seen], y_cm_now[seen], o.beta1)
        self.y_im[seen] = momentum(self.y_im[seen], y_im_now[seen], o.beta2)
        self.new_epoch()
        return {"seen": seen, "softmax_now": table["cm"], "s_im": table["sim"], "y_cm_now": y_cm_now,
                "y_im_now": y_im_now}

    def state_dict(self) -> StateDict:
        return {"y_cm": torch.from_numpy(self.y_cm), "y_im": torch.from_numpy(self.y_im)}

    def load_state_dict(self, state: dict) -> None:
        self.y_cm, self.y_im = state["y_cm"].numpy(), state["y_im"].numpy()


@register_method
class Gsc(Method):
    """Labels y = min(ensembled y_CM, GMM over S_IM); loss L_CM(y) + gamma * L_IM(y); 1 or 2 networks."""

    name = "gsc"
    Options = GscOptions
    pays = ("the best with weak captions mixed in (two networks: +9.5 rSum over plain at 30% shuffle + 30% weak); "
            "+14 at 40% shuffle (docs/methods.md)")

    def __init__(self, options):
        super().__init__(options)
        self.saved = None  # a resumed run's method state, applied in setup and at the first epoch
        self.peer = None
        self.labels_on_device: dict[int, torch.Tensor] = {}  # this epoch's training labels, by network

    def setup(self, ctx: MethodContext):
        self.index = PairIndex(ctx.shards)
        self.labels = [_Labels(self.index.size) for _ in range(self.options.networks)]
        if self.options.networks == 2:
            self.peer = Peer(ctx)
        if self.saved is not None:
            for labels, state in zip(self.labels, self.saved["labels"]):
                labels.load_state_dict(state)
        elif self.options.init_labels == "pass":
            for labels, target in zip(self.labels, self._targets(ctx)):
                labels.start_from(self._initial_pass(ctx, target), self.options, ctx.seed)
        elif ctx.config.epochs == 1:
            too_short(self.name, {"warmup_epochs": 1}, 1, {})  # labels from 1 take effect from epoch 2
        return super().setup(ctx)

    def _targets(self, ctx: MethodContext) -> list:
        return [ctx.target] + ([self.peer.target] if self.peer is not None else [])

    def _initial_pass(self, ctx: MethodContext, target):
        """Eq. 3 and Eq. 8 of every pair under the starting model (file-order batches of the training size,
        every label 1)."""
        o = self.options
        scale = target.logit_scale().detach() if o.tau1 is None else 1.0 / o.tau1
        centred = o.structure == "centred"

        def columns(batch, left, right):
            ones = torch.ones(len(left), device=left.device)
            return {"cm": cross_modal_indicator(left, right, scale),
                    "sim": intra_modal_similarity(left, right, ones, centred=centred)}
        return pair_pass(ctx, target, columns, self.index)

    def on_epoch_start(self, epoch: int, ctx: MethodContext) -> None:
        self.labels_on_device.clear()  # the labels changed at the last epoch's end (or in setup)
        if self.peer is not None:
            self.peer.start_epoch(epoch, ctx, self.saved and self.saved["peer"])
        self.saved = None

    def _training_labels(self, network: int, device: torch.device) -> torch.Tensor:
        """The labels network k trains with (its own with one network, the other's with two) on the
        device: copied once an epoch - they change only at an epoch's end - not every step (the
        whole dataset's labels, with a wait for the device each time)."""
        if network not in self.labels_on_device:
            labels = torch.from_numpy(self.labels[(network + 1) % len(self.labels)].y)
            self.labels_on_device[network] = labels.to(device)
        return self.labels_on_device[network]

    def _network_loss(self, network: int, ids: np.ndarray, emb: Embeddings):
        o = self.options
        device = emb.left.device
        labels = self._training_labels(network, device)
        own_ids = host_values(ids, device)
        y_all, y_own = labels[gather_batch_ids(own_ids)], labels[own_ids]
        scale = emb.logit_scale.detach() if o.tau1 is None else 1.0 / o.tau1
        centred = o.structure == "centred"
        y_cm = cross_modal_indicator(emb.left, emb.right, scale, emb.all_left, emb.all_right, emb.offset)
        s_im = intra_modal_similarity(emb.left, emb.right, y_all, emb.all_left, emb.all_right, emb.offset, centred)
        self.labels[network].record(ids, y_cm, s_im)
        l_cm, per_pair = weighted_infonce(emb.left, emb.right, emb.logit_scale, y_own, all_left=emb.all_left,
                                          all_right=emb.all_right, offset=emb.offset)
        l_im = intra_modal_loss(emb.left, emb.right, y_all, y_own, o.tau2, emb.all_left, emb.all_right, emb.offset,
                                centred)
        diag = {"loss": per_pair, "y": y_own.detach(), "y_cm_step": y_cm.detach(), "s_im_step": s_im.detach()}
        return l_cm + o.gamma * l_im, diag, {"l_cm": l_cm.detach(), "l_im": l_im.detach()}

    def loss(self, batch: dict, emb: Embeddings, ctx: MethodContext) -> LossOutput:
        ids = self.index.ids(batch["shard"], batch["index"])
        loss, diag, metrics = self._network_loss(0, ids, emb)
        if self.peer is not None:
            peer_batch = self.peer.next_batch()
            peer_emb = self.peer.embed(ctx, peer_batch, across_ranks=True)
            peer_ids = self.index.ids(peer_batch["shard"], peer_batch["index"])
            peer_loss, _, peer_metrics = self._network_loss(1, peer_ids, peer_emb)
            self.peer.step(peer_loss)
            metrics.update({f"peer_{k}": v for k, v in peer_metrics.items()})
        return LossOutput(loss, diag, metrics)

    def on_epoch_end(self, epoch: int, ctx: MethodContext) -> JsonObject:
        if self.peer is not None:
            self.peer.close()
        columns, seen = {}, np.zeros(self.index.size, dtype=bool)
        for k, labels in enumerate(self.labels):
            suffix = "" if k == 0 else "_peer"
            now = labels.update(self.index.size, self.options, ctx.seed)
            seen |= now["seen"]
            columns.update({f"s_im{suffix}": now["s_im"], f"softmax{suffix}": now["softmax_now"],
                            f"y_cm{suffix}": labels.y_cm, f"y_im{suffix}": labels.y_im, f"y{suffix}": labels.y})
        y = np.mean([labels.y for labels in self.labels], axis=0)
        clean = y >= 0.5
        columns["partition"] = np.where(clean, "clean", "noisy").astype(object)
        write_pair_table(ctx, epoch, self.index, seen, columns)
        return {"gsc_clean": int(np.sum(clean & seen)), "gsc_noisy": int(np.sum(~clean & seen)),
                "gsc_mean_y": float(y[seen].mean()) if seen.any() else None}

    def state_dict(self) -> StateDict:
        state = {"labels": [labels.state_dict() for labels in self.labels]}
        if self.peer is not None:
            state["peer"] = self.peer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.saved = state

    def extra_networks(self) -> Keyed:
        return {"peer": self.peer.target} if self.peer is not None else {}
