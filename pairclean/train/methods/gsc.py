"""GSC, geometrical structure consistency (seeds/gsc-geometrical-structure-consistency.txt;
training-methods.md), on a dual encoder.

Per step, from the training forward pass: the cross-modal indicator y_CM (Eq. 3, both softmax
directions of S / tau1 at the diagonal; tau1 defaults to the run's temperature, the one L_CM
trains with, as the paper uses one tau1 for both) and the intra-modal structure similarity S_IM (Eq. 8, the
cosine between a pair's rows of S_II and S_TT with columns scaled by the labels), both stored
detached per pair. Per epoch: a 2-component GMM over min-max normalised S_IM gives y_IM (Eq. 4),
y_CM and y_IM are each ensembled with the previous epoch's (Eq. 10, weight beta on the new one,
starting at 1), and the label is y = min(y_CM, y_IM) (Eq. 5). Loss: L_CM (y-weighted symmetric
InfoNCE at the run's temperature; noisy pairs stay as negatives) + gamma * L_IM (Eq. 7, CE over
the rows of (S_II * y)(S_TT * y)^T / tau2, weighted by y_i). With networks=2 a peer network, with
its own data order, trains beside the main one; each trains with the other's labels and
evaluation averages both networks' similarities.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pairclean.config import COUNT, SHARE, above, at_least, setting, within
from pairclean.core.mixture import clean_posterior
from pairclean.train.loss import infonce_terms, weighted_infonce
from pairclean.train.methods.base import Embeddings, LossOutput, Method, MethodContext, register_method
from pairclean.train.robust import PairIndex, Peer, gather_batch_ids, gather_pairs, write_pair_table


def cross_modal_indicator(left, right, logit_scale, all_left=None, all_right=None, offset: int = 0) -> torch.Tensor:
    """Eq. 3: 0.5 * (softmax_row(S / tau1)_ii + softmax_col(S / tau1)_ii) = mean of exp(-CE) both ways,
    logit_scale = 1 / tau1."""
    terms = infonce_terms(left, right, logit_scale, all_left, all_right, offset)
    return 0.5 * (torch.exp(-terms.left_to_right) + torch.exp(-terms.right_to_left))


def masked_structures(left, right, labels, all_left=None, all_right=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of S_II * y and S_TT * y: this rank's items against every item, column j scaled by y_j."""
    all_left = left if all_left is None else all_left
    all_right = right if all_right is None else all_right
    return (left @ all_left.T) * labels[None, :], (right @ all_right.T) * labels[None, :]


def intra_modal_similarity(left, right, labels, all_left=None, all_right=None) -> torch.Tensor:
    """Eq. 8: S_IM_i = cos(row_i(S_II * y), row_i(S_TT * y))."""
    image_rows, text_rows = masked_structures(left, right, labels, all_left, all_right)
    return F.cosine_similarity(image_rows, text_rows, dim=1)


def intra_modal_loss(left, right, labels, own_labels, tau2: float, all_left=None, all_right=None,
                     offset: int = 0) -> torch.Tensor:
    """Eq. 7, weighted by y_i: CE over rows of M = (S_II * y)(S_TT * y)^T / tau2, targets on the diagonal."""
    all_left = left if all_left is None else all_left
    all_right = right if all_right is None else all_right
    image_rows, _ = masked_structures(left, right, labels, all_left, all_right)
    all_text_rows = (all_right @ all_right.T) * labels[None, :]
    logits = image_rows @ all_text_rows.T / tau2
    target = torch.arange(left.shape[0], device=left.device) + offset
    return (own_labels * F.cross_entropy(logits.float(), target, reduction="none")).mean()


def momentum(previous: np.ndarray, current: np.ndarray, beta: float) -> np.ndarray:
    """Eq. 10: beta * this epoch's estimate + (1 - beta) * the previous one."""
    return beta * current + (1 - beta) * previous


@dataclass
class GscOptions:
    tau1: float | None = setting(None, above(0))  # temperature of the cross-modal indicator; None: the run's (the paper's L_CM and
    # y_CM share tau1 = 0.07; here L_CM trains at the run's temperature, so y_CM follows it unless set)
    tau2: float = setting(1.0, above(0))  # temperature of the intra-modal loss
    gamma: float = setting(0.01, at_least(0))  # weight of L_IM
    beta1: float = setting(0.7, SHARE)  # momentum of y_CM (weight of the new epoch's estimate)
    beta2: float = setting(0.7, SHARE)  # momentum of y_IM
    networks: int = setting(1, within(1, 2))  # 2: a peer network; each trains with the other's labels
    gmm_max_iter: int = setting(10, COUNT)
    gmm_tol: float = setting(1e-2, above(0))
    gmm_reg_covar: float = setting(5e-4, above(0))


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
        self.ids, self.cm, self.sim = [], [], []

    def record(self, ids: np.ndarray, cm: torch.Tensor, sim: torch.Tensor) -> None:
        self.ids.append(ids)
        self.cm.append(cm.detach().float().cpu().numpy())
        self.sim.append(sim.detach().float().cpu().numpy())

    def update(self, size: int, o: GscOptions, seed: int) -> dict[str, np.ndarray]:
        """End of an epoch: gather every rank's values, fit the GMM over S_IM, ensemble; pairs no step
        saw keep their labels."""
        cat = (lambda xs, dtype: np.concatenate(xs) if xs else np.zeros(0, dtype=dtype))
        table = gather_pairs(size, cat(self.ids, np.int64), {"cm": cat(self.cm, np.float32),
                                                             "sim": cat(self.sim, np.float32)})
        seen = table.seen
        y_im_now = np.full(size, np.nan, dtype=np.float32)
        if seen.sum() >= 2:
            y_im_now[seen] = clean_posterior(table["sim"][seen], n_components=2, seed=seed, max_iter=o.gmm_max_iter,
                                             tol=o.gmm_tol, reg_covar=o.gmm_reg_covar)[0][:, 0]
        self.y_cm[seen] = momentum(self.y_cm[seen], table["cm"][seen], o.beta1)
        self.y_im[seen] = momentum(self.y_im[seen], y_im_now[seen], o.beta2)
        self.new_epoch()
        return {"seen": seen, "y_cm_now": table["cm"], "s_im": table["sim"], "y_im_now": y_im_now}

    def state_dict(self) -> dict:
        return {"y_cm": torch.from_numpy(self.y_cm), "y_im": torch.from_numpy(self.y_im)}

    def load_state_dict(self, state: dict) -> None:
        self.y_cm, self.y_im = state["y_cm"].numpy(), state["y_im"].numpy()


@register_method
class Gsc(Method):
    """Labels y = min(ensembled y_CM, GMM over S_IM); loss L_CM(y) + gamma * L_IM(y); 1 or 2 networks."""

    name = "gsc"
    Options = GscOptions

    def __init__(self, options):
        super().__init__(options)
        self.saved = None  # a resumed run's method state, applied in setup and at the first epoch
        self.peer = None

    def setup(self, ctx: MethodContext):
        self.index = PairIndex(ctx.shards)
        self.labels = [_Labels(self.index.size) for _ in range(self.options.networks)]
        if self.options.networks == 2:
            self.peer = Peer(ctx)
        if self.saved is not None:
            for labels, state in zip(self.labels, self.saved["labels"]):
                labels.load_state_dict(state)
        return super().setup(ctx)

    def on_epoch_start(self, epoch: int, ctx: MethodContext) -> None:
        if self.peer is not None:
            self.peer.start_epoch(epoch, ctx, self.saved and self.saved["peer"])
        self.saved = None

    def _training_labels(self, network: int) -> np.ndarray:
        """The labels network k trains with: its own with one network, the other's with two."""
        return self.labels[(network + 1) % len(self.labels)].y

    def _network_loss(self, network: int, ids: np.ndarray, emb: Embeddings):
        o = self.options
        device = emb.left.device
        labels = torch.from_numpy(self._training_labels(network)).to(device)
        own_ids = torch.from_numpy(ids).to(device)
        y_all, y_own = labels[gather_batch_ids(own_ids)], labels[own_ids]
        scale = emb.logit_scale.detach() if o.tau1 is None else 1.0 / o.tau1
        y_cm = cross_modal_indicator(emb.left, emb.right, scale, emb.all_left, emb.all_right, emb.offset)
        s_im = intra_modal_similarity(emb.left, emb.right, y_all, emb.all_left, emb.all_right)
        self.labels[network].record(ids, y_cm, s_im)
        l_cm, per_pair = weighted_infonce(emb.left, emb.right, emb.logit_scale, y_own, all_left=emb.all_left,
                                          all_right=emb.all_right, offset=emb.offset)
        l_im = intra_modal_loss(emb.left, emb.right, y_all, y_own, o.tau2, emb.all_left, emb.all_right, emb.offset)
        diag = {"loss": per_pair, "y": y_own.detach().cpu(), "y_cm_step": y_cm.detach().cpu(),
                "s_im_step": s_im.detach().cpu()}
        return l_cm + o.gamma * l_im, diag, {"l_cm": float(l_cm.detach()), "l_im": float(l_im.detach())}

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

    def on_epoch_end(self, epoch: int, ctx: MethodContext) -> dict:
        columns, seen = {}, np.zeros(self.index.size, dtype=bool)
        for k, labels in enumerate(self.labels):
            suffix = "" if k == 0 else "_peer"
            now = labels.update(self.index.size, self.options, ctx.seed)
            seen |= now["seen"]
            columns.update({f"s_im{suffix}": now["s_im"], f"y_cm{suffix}": labels.y_cm, f"y_im{suffix}": labels.y_im,
                            f"y{suffix}": labels.y})
        y = np.mean([labels.y for labels in self.labels], axis=0)
        clean = y >= 0.5
        columns["partition"] = np.where(clean, "clean", "noisy").astype(object)
        write_pair_table(ctx, epoch, self.index, seen, columns)
        return {"gsc_clean": int(np.sum(clean & seen)), "gsc_noisy": int(np.sum(~clean & seen)),
                "gsc_mean_y": float(y[seen].mean()) if seen.any() else None}

    def state_dict(self) -> dict:
        state = {"labels": [labels.state_dict() for labels in self.labels]}
        if self.peer is not None:
            state["peer"] = self.peer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.saved = state

    def extra_networks(self) -> dict:
        return {"peer": self.peer.target} if self.peer is not None else {}
