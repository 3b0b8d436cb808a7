"""SPS, seeking proxy points in a stable feature space (seeds/sps-proxy-point-stable-feature-space.txt;
training-methods.md; the authors' code, C-TeaRanger/SPS [C]), on a dual encoder.

Two co-trained networks: the main one (trained by the trainer) and a peer with its own data order.
After `warmup_epochs` of plain InfoNCE on everything, each epoch starts with a no-grad pass per
network: per-pair InfoNCE loss, min-max normalised, 2-component GMM, p = posterior of the low-loss
component, and the three-way partition reliable (p > eps1) / quasi-clean / noisy (p <= eps2). Each
network trains on its PEER's partition and p, three optimiser steps per iteration [C]:
1. a batch of reliable pairs: InfoNCE + lambda_cro * L_cro + lambda_met * L_met (the stable-space
   constraints);
2. a batch of quasi-clean pairs (from epoch e_qc): y_qc * InfoNCE, y_qc = p + (1 - p) * y_hat;
3. a batch of noisy pairs (from epoch e_n): each caption replaced by the proxy, the caption of the
   pair of the reliable batch whose image is nearest; loss y_p * InfoNCE with the proxy label y_p.
As the authors run it (`batches=loaders`), each kind comes from its own loader in full batches: the
reliable pairs drive the epoch (for the main network, the trainer's own loader reads only them),
the quasi-clean loader stops when its pass is over, the noisy one restarts [C]. `batches=rows`
takes the three kinds from the rows of one batch of every pair instead. Evaluation averages both
networks' similarities. Without given epochs, the warm-up and phases follow the authors' 45-epoch
schedule (5 warm-up, quasi-clean from 16, noisy from 21) scaled to the run's length.
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
from pairclean.ops.records import JsonObject, Keyed, StateDict
from pairclean.training.loss import infonce_terms
from pairclean.training.methods.base import (EPOCH_LENGTHS, Embeddings, FollowUp, LossOutput, Method, MethodContext,
                                          every_parameter, register_method, scaled_epoch, too_short)
from pairclean.training.robust import (EpochWeights, NetworkBatches, PairIndex, Peer, gather_pairs, pair_pass,
                                    write_pair_table)

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


PAPER_EPOCHS, PAPER_WARMUP, PAPER_QC_AFTER, PAPER_N_AFTER = 45, 5, 15, 20  # [C]: 5 warm-up + 40; quasi-clean
# pairs from co-training epoch 10 (after 15 epochs in all), noisy ones from co-training epoch 15 (after 20)
BATCH_SOURCES = ("loaders", "rows")


@dataclass
class SpsOptions:
    warmup_epochs: int | None = setting(None, at_least(0))  # plain InfoNCE on everything for both networks; None: scaled from [C]'s 5 of 45
    e_qc: int | None = setting(None, at_least(0))  # quasi-clean pairs are trained from this epoch; None: scaled from [C]'s 16 of 45
    e_n: int | None = setting(None, at_least(0))  # noisy pairs, with proxy captions, from this epoch; None: scaled from [C]'s 21 of 45
    eps1: float = setting(0.6, SHARE)  # reliable: p > eps1 ([C]; the paper's text says 0.99)
    eps2: float = setting(0.5, SHARE)  # noisy: p <= eps2
    lambda_cro: float = setting(25.0, at_least(0))  # [C]
    lambda_met: float = setting(25.0, at_least(0))  # [C]
    alpha: float = setting(0.0, FINITE)  # margin of both constraints [C]
    constraint_on: str = "cosine"  # cosine: S = U V^T (SGR's S is a score in [0, 1]); logit: S = U V^T / tau
    proxy_label: str = "threshold"  # threshold [C] or paper (Eq. 12)
    proxy_threshold: float = setting(0.5, SHARE)
    proxy_gamma: float = setting(1.0, FINITE)  # Eq. 12 (the paper gives no values)
    proxy_beta: float = setting(5.0, FINITE)
    batches: str = "loaders"  # loaders [C]: each kind in full batches of its own; rows: the rows of one batch
    epoch: str = "subset"  # batches=loaders: an epoch is one pass over the reliable pairs [C]; all: as many
    # iterations as a pass over every pair (plain training's steps), the reliable pairs re-read to fill them
    gmm_max_iter: int = setting(10, COUNT)  # [C]
    gmm_tol: float = setting(1e-2, above(0))  # [C]
    gmm_reg_covar: float = setting(5e-4, above(0))  # [C]

    def __post_init__(self):
        self.check_schedule(self.warmup_epochs, self.e_qc, self.e_n)
        if not self.eps2 <= self.eps1:
            raise ConfigError(f"sps: need 0 <= eps2 <= eps1 <= 1, got eps1={self.eps1}, eps2={self.eps2}", "eps1", "eps2")
        check_choice(self.proxy_label, PROXY_LABELS, "proxy_label", "proxy label")
        check_choice(self.constraint_on, CONSTRAINT_ON, "constraint_on", "constraint matrix")
        check_choice(self.batches, BATCH_SOURCES, "batches", "batch source")
        check_choice(self.epoch, EPOCH_LENGTHS, "epoch", "epoch length")

    @staticmethod
    def check_schedule(warmup: int | None, e_qc: int | None, e_n: int | None) -> None:
        """warmup_epochs < e_qc <= e_n among the values given (None: scaled to the run)."""
        w, q, n = warmup, e_qc, e_n
        if (w is not None and q is not None and w >= q) or (q is not None and n is not None and q > n) or \
                (w is not None and n is not None and w >= n):
            raise ConfigError(f"sps: need 0 <= warmup_epochs < e_qc <= e_n, got {w}, {q}, {n}", "warmup_epochs",
                              "e_qc", "e_n")


def sps_schedule(options: SpsOptions, epochs: int) -> Keyed:
    """warmup_epochs, e_qc, e_n for a run of `epochs`: each given value as given, the others scaled from [C]."""
    warmup = options.warmup_epochs if options.warmup_epochs is not None else \
        scaled_epoch(epochs, PAPER_WARMUP, PAPER_EPOCHS)
    e_qc = options.e_qc if options.e_qc is not None else \
        max(warmup, scaled_epoch(epochs, PAPER_QC_AFTER, PAPER_EPOCHS)) + 1
    e_n = options.e_n if options.e_n is not None else max(e_qc - 1, scaled_epoch(epochs, PAPER_N_AFTER, PAPER_EPOCHS)) + 1
    options.check_schedule(warmup, e_qc, e_n)
    return {"warmup_epochs": warmup, "e_qc": e_qc, "e_n": e_n}


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


class _Network:
    """What one network trains with: its target, the loaders of the pairs it trains on (the peer's
    partition), and the index of the partition it reads."""

    def __init__(self, target, trains_on: int):
        self.target, self.trains_on = target, trains_on
        # batches=loaders: the pairs each loader reads (EpochWeights) and the loaders (NetworkBatches)
        self.drive = self.quasi_pairs = self.noisy_pairs = self.quasi = self.noisy = None


@register_method
class Sps(Method):
    """Two co-trained networks; reliable / quasi-clean / noisy pairs from the peer's loss GMM, three steps."""

    name = "sps"
    Options = SpsOptions
    pays = "+10 rSum over plain on real text at 40% shuffle, training about half of plain's steps (docs/methods.md)"

    def __init__(self, options):
        super().__init__(options)
        self.saved = None  # a resumed run's method state, applied at the first epoch
        self.epoch, self.recording = 0, False
        self.p = self.partition = None

    def schedule(self, epochs: int) -> Keyed:
        return sps_schedule(self.options, epochs)

    def setup(self, ctx: MethodContext):
        self.index = PairIndex(ctx.shards)
        self.plan = self.schedule(ctx.config.epochs)
        too_short(self.name, self.plan, ctx.config.epochs, {"e_qc": "quasi-clean pairs", "e_n": "noisy pairs"})
        self.loaders = self.options.batches == "loaders"
        if not self.loaders:
            self.peer = Peer(ctx)
            self.networks = [_Network(ctx.target, 1), _Network(self.peer.target, 0)]
            return super().setup(ctx)
        drives = [EpochWeights(ctx, self.index, f"reliable-{k}") for k in range(2)]
        self.peer = Peer(ctx, subset=drives[1])
        self.networks = [_Network(ctx.target, 1), _Network(self.peer.target, 0)]
        for k, net in enumerate(self.networks):
            net.drive = drives[k]
            net.quasi_pairs = EpochWeights(ctx, self.index, f"quasi-clean-{k}")
            net.noisy_pairs = EpochWeights(ctx, self.index, f"noisy-{k}")
            preparer, seed = net.target.preparer, ctx.seed + 10 * (k + 1)
            net.quasi = NetworkBatches(ctx, preparer, seed + 1, net.quasi_pairs, cycle=False)  # [C] no restart
            net.noisy = NetworkBatches(ctx, preparer, seed + 2, net.noisy_pairs, cycle=True)  # [C] restarts
        return drives[0].plan(self.index.size)

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
        if epoch <= self.plan["warmup_epochs"]:
            self.p = self.partition = None
            if self.loaders:
                for net in self.networks:
                    net.drive.select(np.ones(self.index.size, dtype=bool))
            return
        o = self.options
        self.p, self.seen = zip(*(self._clean_posterior(ctx, net) for net in (ctx.target, self.peer.target)))
        self.partition = [three_way_partition(np.nan_to_num(p, nan=0.0), o.eps1, o.eps2) for p in self.p]
        if self.loaders:
            for net in self.networks:
                part = self.partition[net.trains_on]
                if not np.any(part == RELIABLE):
                    raise ConfigError(f"sps: no pair is reliable at epoch {epoch} (p > eps1 = {o.eps1} for none): "
                                      "lower eps1", "eps1")
                net.drive.select(part == RELIABLE)
                net.quasi_pairs.select(part == QUASI_CLEAN)
                net.noisy_pairs.select(part == NOISY)
                net.quasi.start(epoch)
                net.noisy.start(epoch)

    def epoch_pairs(self) -> int | None:
        """batches=loaders: the main network's epoch is one pass over its reliable pairs [C]."""
        if not self.loaders:
            return None
        if self.partition is None:
            return self.index.size
        return int(np.sum(self.partition[self.networks[0].trains_on] == RELIABLE))

    def epoch_span(self) -> int | None:
        """epoch=all: the reliable pairs fill as many iterations as a pass over every pair."""
        return self.index.size if self.loaders and self.options.epoch == "all" else None

    # ------------------------------------------------------------------ per step

    def _reliable_loss(self, b: _Batch) -> torch.Tensor:
        rows = torch.from_numpy(b.rows(RELIABLE)).to(b.emb.left.device)
        left, right = b.emb.left[rows], b.emb.right[rows]
        keep_graph = every_parameter(b.emb)
        if len(rows) < 2:
            return keep_graph
        o = self.options
        scale = b.emb.logit_scale if o.constraint_on == "logit" else 1.0
        infonce = infonce_terms(left, right, b.emb.logit_scale).per_sample.mean()
        return keep_graph + infonce + o.lambda_cro * cross_constraint(left, right, o.alpha, scale) + \
            o.lambda_met * metric_constraint(left, right, o.alpha)

    def _sub_batches(self, b: _Batch, net: _Network, ctx: MethodContext) -> list[tuple]:
        """The quasi-clean and noisy steps due this epoch: (left batch, right batch, loss(emb))."""
        if self.loaders:
            return self._loader_batches(b, net, ctx)
        device = b.emb.left.device
        steps = []
        if self.epoch >= self.plan["e_qc"]:
            rows, real = self._rows_on_every_rank(b.rows(QUASI_CLEAN), len(b.ids))
            if rows is not None:
                p = torch.from_numpy(b.p[rows]).to(device)
                steps.append((take_rows(b.batch["left"], rows.tolist()), take_rows(b.batch["right"], rows.tolist()),
                              self._quasi_clean_loss(p, b.ids[rows], real)))
        if self.epoch >= self.plan["e_n"]:
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

    def _loader_batches(self, b: _Batch, net: _Network, ctx: MethodContext) -> list[tuple]:
        """[C]: a full quasi-clean batch (until its pass is over) and a full noisy batch whose captions are
        replaced by those of the reliable batch `b` (the proxies of its nearest images)."""
        steps = []
        p = self.p[net.trains_on]
        if self.epoch >= self.plan["e_qc"]:
            batch = net.quasi.next()
            if batch is not None:
                ids = self.index.ids(batch["shard"], batch["index"])
                steps.append((batch["left"], batch["right"],
                              self._quasi_clean_loss(torch.from_numpy(p[ids]).to(b.emb.left.device), ids, True)))
        if self.epoch >= self.plan["e_n"]:
            batch = net.noisy.next()
            if batch is not None:
                with torch.no_grad():
                    noisy_left = net.target.encode(ctx.left, batch["left"])
                position, cos = nearest_proxies(noisy_left, b.emb.left.detach())
                proxies = position.cpu().numpy()
                ids = self.index.ids(batch["shard"], batch["index"])
                steps.append((batch["left"], take_rows(b.batch["right"], proxies.tolist()),
                              self._noisy_loss(cos, ids, b.ids[proxies], True)))
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

    def _peer_steps(self, ctx: MethodContext) -> Keyed:
        """The peer's iteration on its own batch: plain InfoNCE in warm-up, else SPS's three steps
        on the main network's partition."""
        batch = self.peer.next_batch()
        if batch is None:  # its subset holds no batch on some rank: the peer skips this iteration
            return {}
        twin = self.peer.target
        emb = self.peer.embed(ctx, batch)
        if self.partition is None:
            loss = infonce_terms(emb.left, emb.right, emb.logit_scale).per_sample.mean()
            self.peer.step(loss)
            return {"peer_loss": loss.detach()}
        net = self.networks[1]
        b = self._partitioned(batch, emb, net.trains_on)
        loss = self._reliable_loss(b)
        self.peer.step(loss)
        self.recording = False
        for left, right, step_loss in self._sub_batches(b, net, ctx):
            sub = Embeddings(twin.encode(ctx.left, left), twin.encode(ctx.right, right), twin.logit_scale())
            self.peer.step(step_loss(sub))
        return {"peer_loss": loss.detach()}

    def _partitioned(self, batch: dict, emb: Embeddings, trains_on: int) -> _Batch:
        ids = self.index.ids(batch["shard"], batch["index"])
        return _Batch(batch, emb, ids, self.partition[trains_on][ids], self.p[trains_on][ids].astype(np.float32))

    def loss(self, batch: dict, emb: Embeddings, ctx: MethodContext) -> LossOutput:
        if self.partition is None:  # warm-up: plain InfoNCE on everything, both networks
            loss = infonce_terms(emb.left, emb.right, emb.logit_scale, emb.all_left, emb.all_right,
                                 emb.offset).per_sample
            metrics = self._peer_steps(ctx)
            return LossOutput(loss.mean(), {"loss": loss.detach()}, metrics)
        net = self.networks[0]
        b = self._partitioned(batch, emb, net.trains_on)
        per_pair = infonce_terms(emb.left, emb.right, emb.logit_scale).per_sample.detach()
        follow_ups = []
        for left, right, step_loss in self._sub_batches(b, net, ctx):
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

    def on_epoch_end(self, epoch: int, ctx: MethodContext) -> JsonObject:
        self.peer.close()
        for net in self.networks:
            for loader in (net.quasi, net.noisy):
                if loader is not None:
                    loader.close()
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

    def state_dict(self) -> StateDict:
        return {"peer": self.peer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.saved = state

    def extra_networks(self) -> Keyed:
        return {"peer": self.peer.target}
