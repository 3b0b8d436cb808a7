"""SPS, seeking proxy points in a stable feature space (seeds/sps-proxy-point-stable-feature-space.txt;
training-methods.md), on a dual encoder.

Two co-trained networks: the main one (trained by the trainer) and a peer with its own data order.
After `warmup_epochs` of plain InfoNCE on everything, each epoch starts with a no-grad pass per
network: per-pair InfoNCE loss, min-max normalised, 2-component GMM, p = posterior of the low-loss
component, and the three-way partition reliable (p > eps1) / quasi-clean / noisy (p <= eps2). Each
network trains on its PEER's partition and p, three optimiser steps per iteration [C]:
1. reliable rows: InfoNCE + lambda_cro * L_cro + lambda_met * L_met (the stable-space constraints);
2. quasi-clean rows (from epoch e_qc): y_qc * InfoNCE, y_qc = p + (1 - p) * y_hat;
3. noisy rows (from epoch e_n): the caption is replaced by the proxy, the caption of the reliable
   pair of the batch whose image is nearest; loss y_p * InfoNCE with the proxy label y_p.
The sub-batches are rows of the network's own batch, with that rank's rows as negatives.
Evaluation averages both networks' similarities.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pairclean.backends.oom import take_rows
from pairclean.config import COUNT, FINITE, SHARE, above, at_least, check_choice, setting
from pairclean.core.mixture import clean_posterior
from pairclean.errors import ConfigError
from pairclean.ops import distributed
from pairclean.train.loss import infonce_terms
from pairclean.train.methods.base import Embeddings, FollowUp, LossOutput, Method, MethodContext, register_method
from pairclean.train.robust import PairIndex, Peer, gather_pairs, pair_pass, write_pair_table
RELIABLE, QUASI_CLEAN, NOISY = 0, 1, 2
PARTITION_NAMES = np.array(["reliable", "quasi_clean", "noisy"], dtype=object)
PROXY_LABELS = ("threshold", "paper")
CONSTRAINT_ON = ("cosine", "logit")


def cross_constraint(left: torch.Tensor, right: torch.Tensor, alpha: float = 0.0, scale: float = 1.0) -> torch.Tensor:
    """L_cro = mean(relu((S - S^T)^2 - alpha)) with S = scale * U V^T: image i -> text j agrees with image j -> text i."""
    s = scale * left @ right.T
    return F.relu((s - s.T) ** 2 - alpha).mean()


def metric_constraint(left: torch.Tensor, right: torch.Tensor, alpha: float = 0.0) -> torch.Tensor:
    """L_met = mean(relu((cos(u_i, u_j) - cos(v_j, v_i))^2 - alpha)): both modalities keep the same geometry."""
    return F.relu((left @ left.T - right @ right.T) ** 2 - alpha).mean()


def match_probability(left: torch.Tensor, right: torch.Tensor, logit_scale) -> torch.Tensor:
    """y_hat = 0.5 * (P_i2t_ii + P_t2i_ii) over the batch: exp(-CE) in both directions."""
    terms = infonce_terms(left, right, logit_scale)
    return 0.5 * (torch.exp(-terms.left_to_right) + torch.exp(-terms.right_to_left))


def soft_label(p: torch.Tensor, y_hat: torch.Tensor) -> torch.Tensor:
    """Quasi-clean label y_qc = p + (1 - p) * y_hat."""
    return p + (1 - p) * y_hat


def nearest_proxies(noisy_left: torch.Tensor, reliable_left: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each noisy image, the reliable pair whose image is most similar: (its position, the cosine)."""
    cos = noisy_left @ reliable_left.T
    best, position = cos.max(dim=1)
    return position, best


def proxy_label(y_hat: torch.Tensor, cos: torch.Tensor, form: str = "threshold", threshold: float = 0.5,
                gamma: float = 1.0, beta: float = 5.0) -> torch.Tensor:
    """threshold [C]: y_hat(I_n, T_proxy) * cos(I_n, I_proxy), zeroed below `threshold`;
    paper (Eq. 12): 1 / (gamma + exp(-beta * cos(I_n, I_proxy)))."""
    if form == "paper":
        return 1.0 / (gamma + torch.exp(-beta * cos))
    y = y_hat * cos
    return torch.where(y < threshold, torch.zeros_like(y), y)


def three_way_partition(p: np.ndarray, eps1: float, eps2: float) -> np.ndarray:
    """reliable p > eps1, quasi-clean eps2 < p <= eps1, noisy p <= eps2; when every p > eps2 the
    noisy bound is the 1st percentile of p (the authors' code), so some pairs stay noisy."""
    if len(p) and p.min() > eps2:
        eps2 = float(np.percentile(p, 1))
    part = np.full(len(p), QUASI_CLEAN, dtype=np.int8)
    part[p > eps1] = RELIABLE
    part[p <= eps2] = NOISY
    return part


def _nullable(values: np.ndarray) -> np.ndarray:
    """NaN (no value for this pair) as None, so the Parquet column holds NULL and SQL aggregates skip it."""
    out = values.astype(object)
    out[~np.isfinite(values)] = None
    return out


@dataclass
class SpsOptions:
    warmup_epochs: int = setting(5, at_least(0))  # plain InfoNCE on everything for both networks (essential, per the paper)
    e_qc: int = setting(10, COUNT)  # quasi-clean pairs are trained from this epoch
    e_n: int = setting(15, COUNT)  # noisy pairs, with proxy captions, from this epoch
    eps1: float = setting(0.99, SHARE)  # reliable: p > eps1 (the paper's value; the authors' code uses 0.6)
    eps2: float = setting(0.5, SHARE)  # noisy: p <= eps2
    lambda_cro: float = setting(25.0, at_least(0))  # [C]
    lambda_met: float = setting(25.0, at_least(0))  # [C]
    alpha: float = setting(0.0, FINITE)  # margin of both constraints [C]
    constraint_on: str = "cosine"  # cosine: S = U V^T (SGR's S is a score in [0, 1]); logit: S = U V^T / tau
    proxy_label: str = "threshold"  # threshold [C] or paper (Eq. 12)
    proxy_threshold: float = setting(0.5, SHARE)
    proxy_gamma: float = setting(1.0, FINITE)  # Eq. 12 (the paper gives no values)
    proxy_beta: float = setting(5.0, FINITE)
    gmm_max_iter: int = setting(100, COUNT)
    gmm_tol: float = setting(1e-3, above(0))
    gmm_reg_covar: float = setting(5e-4, above(0))

    def __post_init__(self):
        if not (self.warmup_epochs < self.e_qc <= self.e_n):
            raise ConfigError(f"sps: need 0 <= warmup_epochs < e_qc <= e_n, got {self.warmup_epochs}, {self.e_qc}, "
                              f"{self.e_n}", "warmup_epochs", "e_qc", "e_n")
        if not self.eps2 <= self.eps1:
            raise ConfigError(f"sps: need 0 <= eps2 <= eps1 <= 1, got eps1={self.eps1}, eps2={self.eps2}", "eps1", "eps2")
        check_choice(self.proxy_label, PROXY_LABELS, "proxy_label", "proxy label")
        check_choice(self.constraint_on, CONSTRAINT_ON, "constraint_on", "constraint matrix")


@dataclass
class _Batch:
    """One network's batch with the partition it trains on (rows on this rank)."""

    batch: dict
    emb: Embeddings
    ids: np.ndarray
    part: np.ndarray
    p: np.ndarray

    def rows(self, kind: int) -> np.ndarray:
        return np.flatnonzero(self.part == kind)


@register_method
class Sps(Method):
    """Two co-trained networks; reliable / quasi-clean / noisy pairs from the peer's loss GMM, three steps."""

    name = "sps"
    Options = SpsOptions

    def __init__(self, options):
        super().__init__(options)
        self.saved = None  # a resumed run's method state, applied at the first epoch
        self.epoch, self.recording = 0, False
        self.p = self.partition = None

    def setup(self, ctx: MethodContext):
        self.index = PairIndex(ctx.shards)
        self.peer = Peer(ctx)
        return super().setup(ctx)

    # ------------------------------------------------------------------ per epoch

    def _clean_posterior(self, ctx: MethodContext, target) -> tuple[np.ndarray, np.ndarray]:
        """(p over all pairs, seen): the low-loss component's posterior of a 2-component GMM."""
        scale = target.logit_scale().detach()
        table = pair_pass(ctx, target, lambda batch, left, right: {
            "loss": infonce_terms(left, right, scale).per_sample}, self.index)
        o, seen = self.options, table.seen
        p = np.full(self.index.size, np.nan, dtype=np.float32)
        p[seen] = clean_posterior(table["loss"][seen], n_components=2, higher_is_clean=False, seed=ctx.seed,
                                  max_iter=o.gmm_max_iter, tol=o.gmm_tol, reg_covar=o.gmm_reg_covar)[0][:, 0]
        return p, seen

    def on_epoch_start(self, epoch: int, ctx: MethodContext) -> None:
        self.peer.start_epoch(epoch, ctx, self.saved and self.saved["peer"])
        self.saved = None
        self.epoch = epoch
        self.records = {name: [] for name in ("ids", "y_qc", "y_proxy", "proxy_id")}
        if epoch <= self.options.warmup_epochs:
            self.p = self.partition = None
            return
        o = self.options
        self.p, self.seen = zip(*(self._clean_posterior(ctx, net) for net in (ctx.target, self.peer.target)))
        self.partition = [three_way_partition(np.nan_to_num(p, nan=0.0), o.eps1, o.eps2) for p in self.p]

    # ------------------------------------------------------------------ per step

    def _reliable_loss(self, b: _Batch) -> torch.Tensor:
        rows = torch.from_numpy(b.rows(RELIABLE)).to(b.emb.left.device)
        left, right = b.emb.left[rows], b.emb.right[rows]
        keep_graph = 0.0 * (b.emb.left.sum() + b.emb.right.sum())  # every parameter gets a gradient (DDP)
        if len(rows) < 2:
            return keep_graph
        o = self.options
        scale = b.emb.logit_scale if o.constraint_on == "logit" else 1.0
        infonce = infonce_terms(left, right, b.emb.logit_scale).per_sample.mean()
        return keep_graph + infonce + o.lambda_cro * cross_constraint(left, right, o.alpha, scale) + \
            o.lambda_met * metric_constraint(left, right, o.alpha)

    def _sub_batches(self, b: _Batch) -> list[tuple]:
        """The quasi-clean and noisy steps due this epoch: (left batch, right batch, loss(emb), record(values))."""
        o, device = self.options, b.emb.left.device
        steps = []
        if self.epoch >= o.e_qc:
            rows, real = self._rows_on_every_rank(b.rows(QUASI_CLEAN), len(b.ids))
            if rows is not None:
                p = torch.from_numpy(b.p[rows]).to(device)
                steps.append((take_rows(b.batch["left"], rows.tolist()), take_rows(b.batch["right"], rows.tolist()),
                              self._quasi_clean_loss(p, b.ids[rows], real)))
        if self.epoch >= o.e_n:
            reliable = b.rows(RELIABLE)
            rows, real = self._rows_on_every_rank(b.rows(NOISY) if len(reliable) else reliable, len(b.ids))
            if rows is not None:
                if real:
                    position, cos = nearest_proxies(b.emb.left[torch.from_numpy(rows).to(device)].detach(),
                                                    b.emb.left[torch.from_numpy(reliable).to(device)].detach())
                    proxies = reliable[position.cpu().numpy()]
                else:
                    proxies, cos = rows, torch.zeros(len(rows), device=device)
                steps.append((take_rows(b.batch["left"], rows.tolist()), take_rows(b.batch["right"], proxies.tolist()),
                              self._noisy_loss(cos, b.ids[rows], b.ids[proxies], real)))
        return steps

    @staticmethod
    def _rows_on_every_rank(rows: np.ndarray, batch_rows: int) -> tuple[np.ndarray | None, bool]:
        """(the step's rows, whether they are real), rows None when no rank has two of them. Under
        torchrun every rank takes the same steps: a rank with fewer than two stands in two rows of
        its batch whose loss is multiplied by 0."""
        most = -distributed.all_reduce_min(-len(rows))
        if most < 2:
            return None, False
        if len(rows) >= 2:
            return rows, True
        return np.arange(min(2, batch_rows)), False

    def _quasi_clean_loss(self, p: torch.Tensor, ids: np.ndarray, real: bool):
        def loss(emb: Embeddings) -> torch.Tensor:
            per_sample = infonce_terms(emb.left, emb.right, emb.logit_scale).per_sample
            y_qc = soft_label(p, match_probability(emb.left.detach(), emb.right.detach(), emb.logit_scale.detach()))
            if not real:
                return 0.0 * per_sample.sum()
            if self.recording:
                self._record(ids, y_qc=y_qc)
            return (y_qc * per_sample).mean()
        return loss

    def _noisy_loss(self, cos: torch.Tensor, ids: np.ndarray, proxy_ids: np.ndarray, real: bool):
        o = self.options

        def loss(emb: Embeddings) -> torch.Tensor:
            per_sample = infonce_terms(emb.left, emb.right, emb.logit_scale).per_sample
            if not real:
                return 0.0 * per_sample.sum()
            y_hat = match_probability(emb.left.detach(), emb.right.detach(), emb.logit_scale.detach())
            y_p = proxy_label(y_hat, cos, o.proxy_label, o.proxy_threshold, o.proxy_gamma, o.proxy_beta)
            if self.recording:
                self._record(ids, y_proxy=y_p, proxy_id=torch.from_numpy(proxy_ids.astype(np.float64)))
            return (y_p * per_sample).mean()
        return loss

    def _record(self, ids: np.ndarray, **values: torch.Tensor) -> None:
        self.records["ids"].append(ids)
        for name in ("y_qc", "y_proxy", "proxy_id"):
            v = values.get(name)
            self.records[name].append(np.full(len(ids), np.nan) if v is None else v.detach().double().cpu().numpy())

    def _peer_steps(self, ctx: MethodContext) -> dict:
        """The peer's iteration on its own batch: plain InfoNCE in warm-up, else SPS's three steps
        on the main network's partition."""
        batch = self.peer.next_batch()
        twin = self.peer.target
        emb = self.peer.embed(ctx, batch)
        if self.partition is None:
            loss = infonce_terms(emb.left, emb.right, emb.logit_scale).per_sample.mean()
            self.peer.step(loss)
            return {"peer_loss": float(loss.detach())}
        b = self._partitioned(batch, emb, trains_on=0)
        loss = self._reliable_loss(b)
        self.peer.step(loss)
        self.recording = False
        for left, right, step_loss in self._sub_batches(b):
            sub = Embeddings(twin.encode(ctx.left, left), twin.encode(ctx.right, right), twin.logit_scale())
            self.peer.step(step_loss(sub))
        return {"peer_loss": float(loss.detach())}

    def _partitioned(self, batch: dict, emb: Embeddings, trains_on: int) -> _Batch:
        ids = self.index.ids(batch["shard"], batch["index"])
        return _Batch(batch, emb, ids, self.partition[trains_on][ids], self.p[trains_on][ids].astype(np.float32))

    def loss(self, batch: dict, emb: Embeddings, ctx: MethodContext) -> LossOutput:
        if self.partition is None:  # warm-up: plain InfoNCE on everything, both networks
            loss = infonce_terms(emb.left, emb.right, emb.logit_scale, emb.all_left, emb.all_right,
                                 emb.offset).per_sample
            metrics = self._peer_steps(ctx)
            return LossOutput(loss.mean(), {"loss": loss.detach()}, metrics)
        b = self._partitioned(batch, emb, trains_on=1)
        per_pair = infonce_terms(emb.left, emb.right, emb.logit_scale).per_sample.detach()
        follow_ups = []
        for left, right, step_loss in self._sub_batches(b):
            follow_ups.append(FollowUp(left, right, self._recorded(step_loss)))
        loss = self._reliable_loss(b)
        metrics = self._peer_steps(ctx)
        counts = np.bincount(b.part, minlength=3)
        metrics.update({"reliable": int(counts[RELIABLE]), "quasi_clean": int(counts[QUASI_CLEAN]),
                        "noisy": int(counts[NOISY])})
        diag = {"loss": per_pair, "p": torch.from_numpy(b.p), "partition_code": torch.from_numpy(b.part.astype(np.float32))}
        return LossOutput(loss, diag, metrics, follow_ups)

    def _recorded(self, step_loss):
        """The main network's sub-batch losses record their labels (the peer's are not written)."""
        def loss(emb: Embeddings) -> torch.Tensor:
            self.recording = True
            try:
                return step_loss(emb)
            finally:
                self.recording = False
        return loss

    def on_epoch_end(self, epoch: int, ctx: MethodContext) -> dict:
        if self.partition is None:
            return {}
        ids = np.concatenate(self.records["ids"]) if self.records["ids"] else np.zeros(0, dtype=np.int64)
        steps = gather_pairs(self.index.size, ids.astype(np.int64),
                             {name: (np.concatenate(v) if v else np.zeros(0)).astype(np.float64)
                              for name, v in self.records.items() if name != "ids"})
        unset = np.full(self.index.size, np.nan)
        proxy = steps.columns.get("proxy_id", unset)
        has_proxy = np.isfinite(proxy)
        proxy_shard = np.full(self.index.size, None, dtype=object)
        proxy_index = np.full(self.index.size, None, dtype=object)
        if has_proxy.any():
            shards, positions = self.index.locate(proxy[has_proxy].astype(np.int64))
            proxy_shard[has_proxy] = shards
            proxy_index[has_proxy] = positions.tolist()
        columns = {"p": self.p[0], "p_peer": self.p[1],
                   "partition": PARTITION_NAMES[self.partition[1]],  # what the main network trains on
                   "partition_peer": PARTITION_NAMES[self.partition[0]],
                   "y_qc": _nullable(steps.columns.get("y_qc", unset)),
                   "y_proxy": _nullable(steps.columns.get("y_proxy", unset)),
                   "proxy_shard": proxy_shard, "proxy_index": proxy_index}
        write_pair_table(ctx, epoch, self.index, self.seen[0] | self.seen[1], columns)
        counts = np.bincount(self.partition[1][self.seen[1]], minlength=3)
        return {"sps_reliable": int(counts[RELIABLE]), "sps_quasi_clean": int(counts[QUASI_CLEAN]),
                "sps_noisy": int(counts[NOISY])}

    def state_dict(self) -> dict:
        return {"peer": self.peer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.saved = state

    def extra_networks(self) -> dict:
        return {"peer": self.peer.target}
