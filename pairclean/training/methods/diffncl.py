"""DiffNCL, diffusion-driven weakly-noisy correspondence learning (seeds/diffncl-diffusion-weakly-noisy.txt;
training-methods.md), on a dual encoder.

Two co-trained networks: the main one (trained by the trainer) and a peer with its own data order,
each with its own reverse-diffusion denoiser. After `warmup_epochs` of plain InfoNCE, each epoch
starts with a no-grad pass per network giving every pair its InfoNCE loss l (at the method's
temperature, 0.07 as in the paper) and its diffusion discrepancy Psi (Eq. 4-6: the unit
embeddings, scaled by sqrt(d), noised over T steps with alpha_t = cos^2(pi t / 2T), beta_t =
cos^3(pi t / 2T), an independent Gaussian draw per side (the paper's eps1, eps2); Psi = sum_t
gamma_t (s_t - s_{t-1})^2 over the pair's cosines s_t). A 3-component GMM on [minmax l, zeta *
minmax Psi] per network labels each pair clean / weak / noisy (components ordered by their mean
loss); a pair is clean (noisy) only when both networks say so, otherwise weak (Eq. 11).
Training as Algorithm 1 (`loops=batches`): full batches of clean pairs (the main network's own
loader reads only them) get plain InfoNCE; each is followed by a step on a full batch of weak pairs
(their own loader, restarted when it runs out) with L_intra + L_cross + L_robust through the
denoiser (Eq. 14-17; L_cross with the other pairs' originals in its denominator, as the paper's
prose says); noisy pairs are dropped. `loops=rows` splits one batch of every pair instead. The
denoisers serve training only; evaluation averages both networks' similarities.

Settled here (options keep the paper's letter): the GMM's components are ordered by their loss
(with independent draws Psi grows with a pair's similarity, so the sum of both means orders
nothing); zeta, the paper's E[sigmoid(-l)], is taken on the min-max normalised loss the GMM sees
(on the raw loss it is 0.001-0.01 here and flattens Psi below the GMM's covariance floor); the
reverse diffusion starts from step `denoise_from` (the paper: T, where alpha_T = beta_T = 0 leaves
pure noise and a weak pair's L_robust no image-text gradient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pairclean.core.mixture import clean_posterior, minmax
from pairclean.config import COUNT, above, at_least, check_choice, setting, within
from pairclean.errors import ConfigError, UserError
from pairclean.ops.records import JsonObject, Keyed, StateDict
from pairclean.training.loss import infonce_terms
from pairclean.training.methods.base import (EPOCH_LENGTHS, Embeddings, FollowUp, LossOutput, Method, MethodContext,
                                          every_parameter, register_method, scaled_epoch, too_short)
from pairclean.training.robust import (EpochWeights, NetworkBatches, OwnModule, PairIndex, Peer, embedding_dim, pair_pass,
                                    write_pair_table)
CLEAN, WEAK, NOISY = 0, 1, 2
PARTITION_NAMES = np.array(["clean", "weak", "noisy"], dtype=object)


def noise_schedules(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha_t, beta_t) for t = 1..T: cos^2(pi t / 2T) for images, cos^3 for texts (texts noised more slowly)."""
    c = torch.cos(math.pi * torch.arange(1, steps + 1, dtype=torch.float64) / (2 * steps))
    return c ** 2, c ** 3


def step_weights(alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """gamma_t proportional to (1 - alpha_t)(1 - beta_t), summing to 1."""
    w = (1 - alpha) * (1 - beta)
    return w / w.sum()


def forward_diffusion(f: torch.Tensor, g: torch.Tensor, steps: int, shared_noise: bool = True,
                      generator: torch.Generator | None = None,
                      total: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """[f_0 .. f_steps], [g_0 .. g_steps] from unit embeddings scaled by sqrt(d) (so signal and noise have
    the same per-dimension scale): f_t = sqrt(a_t) f_{t-1} + sqrt(1 - a_t) eps1 (b_t and eps2 for g; with
    `shared_noise` eps2 = eps1), the first `steps` steps of a `total`-step schedule (default: all)."""
    alpha, beta = (s.to(f.dtype) for s in noise_schedules(total or steps))
    scale = math.sqrt(f.shape[-1])
    fs, gs = [f * scale], [g * scale]
    for t in range(steps):
        eps_f = torch.randn(f.shape, generator=generator, device=f.device, dtype=f.dtype)
        eps_g = eps_f if shared_noise else torch.randn(g.shape, generator=generator, device=g.device, dtype=g.dtype)
        fs.append(alpha[t].sqrt() * fs[-1] + (1 - alpha[t]).sqrt() * eps_f)
        gs.append(beta[t].sqrt() * gs[-1] + (1 - beta[t]).sqrt() * eps_g)
    return fs, gs


def diffusion_discrepancy(f: torch.Tensor, g: torch.Tensor, steps: int, shared_noise: bool = True,
                          generator: torch.Generator | None = None) -> torch.Tensor:
    """Psi_i = sum_t gamma_t (s_t - s_{t-1})^2 with s_t = cos(f_t, g_t) (Eq. 6, the derivative in t as a difference)."""
    fs, gs = forward_diffusion(f, g, steps, shared_noise, generator)
    s = torch.stack([F.cosine_similarity(a, b, dim=-1) for a, b in zip(fs, gs)])  # (T + 1, B)
    gamma = step_weights(*noise_schedules(steps)).to(s.dtype).to(s.device)
    return (gamma[:, None] * (s[1:] - s[:-1]) ** 2).sum(0)


def dynamic_zeta(losses: list[np.ndarray], normalised: bool = False) -> float:
    """zeta = mean over the networks of E[sigmoid(-l)] (Eq. 7); `normalised`: of the min-max normalised
    loss the GMM sees, so zeta does not depend on the loss's scale (temperature, batch size)."""
    return float(np.mean([np.mean(1.0 / (1.0 + np.exp(minmax(l) if normalised else np.asarray(l, dtype=np.float64))))
                          for l in losses]))


ORDER_BY = ("loss", "sum")


def three_way_labels(loss: np.ndarray, psi: np.ndarray, zeta: float, seed: int = 0, max_iter: int = 100,
                     reg_covar: float = 1e-3, order_by: str = "loss") -> tuple[np.ndarray, np.ndarray]:
    """(argmax label clean/weak/noisy, posteriors ordered clean, weak, noisy) of a 3-component GMM on
    [minmax l, zeta * minmax Psi]; components ordered by their mean loss (`loss`) or by the sum of
    their mean coordinates (`sum`), lowest = clean."""
    post, gmm = clean_posterior(np.column_stack([loss, psi]), n_components=3, higher_is_clean=False, seed=seed,
                                max_iter=max_iter, reg_covar=reg_covar, column_scale=(1.0, zeta))
    if order_by == "loss":  # clean_posterior ordered the columns by the sum; order them by the loss coordinate
        by_component = np.empty_like(post)
        by_component[:, np.argsort(gmm.means_.sum(axis=1))] = post
        post = by_component[:, np.argsort(gmm.means_[:, 0])]
    return post.argmax(axis=1).astype(np.int8), post


def consensus(labels_a: np.ndarray, labels_b: np.ndarray) -> np.ndarray:
    """Eq. 11: clean (noisy) only when both networks say clean (noisy); every other pair is weak."""
    out = np.full(len(labels_a), WEAK, dtype=np.int8)
    out[(labels_a == CLEAN) & (labels_b == CLEAN)] = CLEAN
    out[(labels_a == NOISY) & (labels_b == NOISY)] = NOISY
    return out


class Denoiser(torch.nn.Module):
    """Reverse diffusion for one network (Eq. 12-13), the same weights at every step. Per modality
    a bottleneck M(x) = LN(x + W_expand ReLU(W_reduce x)) (d -> h -> d), plus rho times the value
    projection of the other modality's M(clean embedding): the paper's cross-attention, whose
    softmax over the single key a dual encoder has for a pair is 1."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.reduce = torch.nn.ModuleList([torch.nn.Linear(dim, hidden) for _ in range(2)])
        self.expand = torch.nn.ModuleList([torch.nn.Linear(hidden, dim) for _ in range(2)])
        self.norm = torch.nn.ModuleList([torch.nn.LayerNorm(dim) for _ in range(2)])
        self.value = torch.nn.ModuleList([torch.nn.Linear(dim, dim) for _ in range(2)])
        self.rho = torch.nn.Parameter(torch.ones(2))

    def bottleneck(self, side: int, x: torch.Tensor) -> torch.Tensor:
        return self.norm[side](x + self.expand[side](F.relu(self.reduce[side](x))))

    def forward(self, f_noised: torch.Tensor, g_noised: torch.Tensor, f_clean: torch.Tensor, g_clean: torch.Tensor,
                steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(f_hat, g_hat) after `steps` denoising steps from the step-T embeddings (all scaled by sqrt(d))."""
        attend_f = self.rho[0] * self.value[0](self.bottleneck(1, g_clean))
        attend_g = self.rho[1] * self.value[1](self.bottleneck(0, f_clean))
        f, g = f_noised, g_noised
        for _ in range(steps):
            f, g = self.bottleneck(0, f) + attend_f, self.bottleneck(1, g) + attend_g
        return f, g


CROSS_FORMS = ("prose", "as-written")


def cross_consistency(f_hat: torch.Tensor, g_hat: torch.Tensor, f: torch.Tensor, g: torch.Tensor,
                      logit_scale, detach_originals: bool = False, form: str = "prose") -> torch.Tensor:
    """L_cross (Eq. 15): the denoised pair (numerator) against the denoised image with the original texts
    and the original images with the denoised text. `prose` (the paper's text: "other original
    features"): the denominator holds the positive and every OTHER pair's originals; `as-written`: the
    equation's denominator, every original including the pair's own and no positive, which pushes each
    original embedding away from its own pair's denoised one. `detach_originals` keeps the originals out
    of the gradient (targets, as in L_intra)."""
    if detach_originals:
        f, g = f.detach(), g.detach()
    positive = logit_scale * (f_hat * g_hat).sum(-1)
    others = torch.cat([logit_scale * f_hat @ g.T, logit_scale * g_hat @ f.T], dim=1).float()
    if form == "as-written":
        return (torch.logsumexp(others, dim=1) - positive.float()).mean()
    own = torch.eye(len(f_hat), dtype=torch.bool, device=f_hat.device).repeat(1, 2)
    logits = torch.cat([positive.float()[:, None], others.masked_fill(own, float("-inf"))], dim=1)
    return (torch.logsumexp(logits, dim=1) - positive.float()).mean()


def weak_pair_losses(f: torch.Tensor, g: torch.Tensor, denoiser: Denoiser, steps: int, logit_scale,
                     shared_noise: bool = True, cross_detach: bool = False, cross_form: str = "prose",
                     start: int | None = None) -> Keyed[str, torch.Tensor]:
    """L_intra, L_cross, L_robust (Eq. 14, 15, 17) of weakly-noisy pairs with unit embeddings f, g; the
    reverse diffusion runs `start` steps from the step-`start` noised embeddings (None: T, the paper)."""
    scale = math.sqrt(f.shape[-1])
    start = steps if start is None else start
    fs, gs = forward_diffusion(f, g, start, shared_noise, total=steps)
    f_hat, g_hat = denoiser(fs[-1], gs[-1], fs[0], gs[0], start)
    intra = ((f_hat / scale - f.detach()) ** 2).sum(-1).mean() + ((g_hat / scale - g.detach()) ** 2).sum(-1).mean()
    f_hat_unit, g_hat_unit = F.normalize(f_hat, dim=-1), F.normalize(g_hat, dim=-1)
    robust = 0.5 * (infonce_terms(f_hat_unit, g, logit_scale).per_sample.mean() +
                    infonce_terms(f, g_hat_unit, logit_scale).per_sample.mean())
    cross = cross_consistency(f_hat_unit, g_hat_unit, f, g, logit_scale, cross_detach, cross_form)
    return {"intra": intra, "cross": cross, "robust": robust}


PAPER_EPOCHS, PAPER_WARMUP = 45, 5  # Flickr30K: 5 warm-up epochs, then 40
LOOPS = ("batches", "rows")
WEAK_LOOPS = ("cycle", "once", "none")
ZETA_ON = ("normalised", "raw")


@dataclass
class DiffnclOptions:
    warmup_epochs: int | None = setting(None, at_least(0))  # plain InfoNCE on everything, both networks; None: the paper's 5 of 45, scaled
    steps: int = setting(4, COUNT)  # diffusion steps T
    shared_noise: bool = False  # False: eps1, eps2 drawn independently (the paper); True: one draw for both sides
    temperature: float | None = setting(0.07, above(0))  # of the partition loss, L_cross and L_robust (the paper's, for every one);
    # None: the run's. Clean pairs train with the trainer's InfoNCE at the run's temperature.
    zeta: float | None = setting(None, above(0))  # weight of Psi in the GMM features; None: the paper's dynamic E[sigmoid(-l)]
    zeta_on: str = "normalised"  # the dynamic zeta over the min-max normalised loss, or the raw loss (the paper)
    order_by: str = "loss"  # GMM components: clean = lowest mean loss; sum: lowest sum of both means
    cross: str = "prose"  # L_cross's denominator: the positive and the other pairs' originals; as-written: Eq. 15
    denoise_from: int | None = setting(None, COUNT)  # the reverse diffusion starts from this step; None: T (the paper)
    loops: str = "batches"  # batches: clean and weak pairs in full batches of their own (Algorithm 1); rows
    weak_loop: str = "cycle"  # loops=batches: the weak loader restarts when it runs out (a weak batch after every
    # clean one); once: one pass over the weak pairs per epoch (Algorithm 1, lines 17-21); none: weak pairs not trained
    epoch: str = "subset"  # loops=batches: an epoch is one pass over the clean pairs (Algorithm 1); all: as many
    # steps as a pass over every pair (plain training's), the clean pairs re-read to fill them
    hidden_ratio: float = setting(0.5, within(0, 1, low_open=True))  # the denoiser's bottleneck width h = d * hidden_ratio (paper: 512 of 1024)
    noisy_as_weak: bool = False  # route noisy pairs through the denoiser with the weak ones instead of dropping them
    intra_weight: float = setting(1.0, at_least(0))  # weights of the weak pairs' three losses (the paper: all 1)
    cross_weight: float = setting(1.0, at_least(0))
    robust_weight: float = setting(1.0, at_least(0))
    cross_detach: bool = False  # L_cross trains the denoiser only: the original embeddings enter it detached
    gmm_max_iter: int = setting(100, COUNT)
    gmm_reg_covar: float = setting(1e-3, above(0))

    def __post_init__(self):
        if self.denoise_from is not None and self.denoise_from > self.steps:
            raise ConfigError(f"diffncl: denoise_from must be within [1, steps], got {self.denoise_from}",
                              "denoise_from", "steps")
        check_choice(self.zeta_on, ZETA_ON, "zeta_on", "zeta input")
        check_choice(self.order_by, ORDER_BY, "order_by", "component order")
        check_choice(self.cross, CROSS_FORMS, "cross", "L_cross form")
        check_choice(self.loops, LOOPS, "loops", "loop form")
        check_choice(self.weak_loop, WEAK_LOOPS, "weak_loop", "weak loop")
        check_choice(self.epoch, EPOCH_LENGTHS, "epoch", "epoch length")


@register_method
class Diffncl(Method):
    """Two co-trained networks; clean / weak / noisy by consensus of per-network GMMs on [loss, zeta * Psi]."""

    name = "diffncl"
    Options = DiffnclOptions
    pays = "+8 rSum over plain on real text at 40% shuffle, +4 with weak captions: the least of these (docs/methods.md)"

    def __init__(self, options):
        super().__init__(options)
        self.saved = None  # a resumed run's method state, applied at the first epoch
        self.partition = None
        self.denoise = None  # the denoiser the main network's current backward trains (after_backward steps it)
        self.weak_metrics: dict = {}  # the last weak step's losses per network, for the step log

    def schedule(self, epochs: int) -> Keyed:
        o = self.options
        return {"warmup_epochs": o.warmup_epochs if o.warmup_epochs is not None else
                scaled_epoch(epochs, PAPER_WARMUP, PAPER_EPOCHS)}

    def setup(self, ctx: MethodContext):
        self.index = PairIndex(ctx.shards)
        self.plan = self.schedule(ctx.config.epochs)
        too_short(self.name, self.plan, ctx.config.epochs, {})
        self.loops = self.options.loops == "batches"
        # loops=batches: both networks read the consensus's clean pairs (the main one through the trainer's
        # loader) and its weak ones (through a loader each)
        self.clean_pairs = EpochWeights(ctx, self.index, "clean") if self.loops else None
        self.peer = Peer(ctx, subset=self.clean_pairs)
        if self.loops:
            self.weak_pairs = EpochWeights(ctx, self.index, "weak")
            self.weak_batches = [NetworkBatches(ctx, net.preparer, ctx.seed + 20 + k, self.weak_pairs,
                                                cycle=self.options.weak_loop == "cycle")
                                 for k, net in enumerate((ctx.target, self.peer.target))]
        dim = embedding_dim(ctx.target)
        hidden = max(1, round(dim * self.options.hidden_ratio))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed)
            self.denoisers = [OwnModule(Denoiser(dim, hidden).to(net.device), ctx.config.grad_clip)
                              for net in (ctx.target, self.peer.target)]
        return self.clean_pairs.plan(self.index.size) if self.loops else super().setup(ctx)

    def on_epoch_start(self, epoch: int, ctx: MethodContext) -> None:
        if self.peer.start_epoch(epoch, ctx, self.saved and self.saved["peer"]):
            for k, denoiser in enumerate(self.denoisers):
                denoiser.start(ctx)
                if self.saved is not None:
                    denoiser.load_state_dict(self.saved["denoisers"][k])
        self.saved = None
        if epoch <= self.plan["warmup_epochs"]:
            self.partition = None
            if self.loops:
                self.clean_pairs.select(np.ones(self.index.size, dtype=bool))
            return
        self._partition(epoch, ctx)
        if self.loops:
            clean = self.partition == CLEAN
            if not clean.any():
                raise UserError(f"diffncl: no pair is clean by both networks' consensus at epoch {epoch}: nothing "
                                "to train the clean loop on")
            self.clean_pairs.select(clean)
            self.weak_pairs.select(self._weak(self.partition))
            for loader in self.weak_batches:
                loader.start(epoch)

    def epoch_pairs(self) -> int | None:
        """loops=batches: an epoch is one pass over the clean pairs (Algorithm 1's loop over D_c)."""
        if not self.loops:
            return None
        return self.index.size if self.partition is None else int(np.sum(self.partition == CLEAN))

    def epoch_span(self) -> int | None:
        """epoch=all: the clean pairs fill as many steps as a pass over every pair."""
        return self.index.size if self.loops and self.options.epoch == "all" else None

    def _weak(self, part: np.ndarray) -> np.ndarray:
        weak = part == WEAK
        return weak | (part == NOISY) if self.options.noisy_as_weak else weak

    def _scale(self, net) -> torch.Tensor | float:
        """The logit scale of the method's own terms: 1 / temperature, or the network's."""
        t = self.options.temperature
        return net.logit_scale().detach() if t is None else 1.0 / t

    def _partition(self, epoch: int, ctx: MethodContext) -> None:
        """Loss and Psi of every pair under each network (its own seeded noise), the GMMs, the consensus."""
        o = self.options
        passes = []
        for k, net in enumerate((ctx.target, self.peer.target)):
            scale = self._scale(net)
            generator = torch.Generator(device=net.device).manual_seed(ctx.seed * 1_000_003 + epoch * 2 + k)
            passes.append(pair_pass(ctx, net, lambda batch, left, right: {
                "loss": infonce_terms(left, right, scale).per_sample,
                "psi": diffusion_discrepancy(left, right, o.steps, o.shared_noise, generator)}, self.index))
        seen = passes[0].seen & passes[1].seen
        zeta = o.zeta if o.zeta is not None else dynamic_zeta([t["loss"][seen] for t in passes], o.zeta_on == "normalised")
        self.labels, self.posteriors = [], []
        for table in passes:
            labels = np.full(self.index.size, WEAK, dtype=np.int8)
            post = np.full((self.index.size, 3), np.nan, dtype=np.float32)
            labels[seen], post[seen] = three_way_labels(table["loss"][seen], table["psi"][seen], zeta, ctx.seed,
                                                        o.gmm_max_iter, o.gmm_reg_covar, o.order_by)
            self.labels.append(labels)
            self.posteriors.append(post)
        self.partition = consensus(*self.labels)
        self.passes, self.seen, self.zeta = passes, seen, zeta

    def _weak_loss(self, left: torch.Tensor, right: torch.Tensor, net, denoiser: Denoiser) -> tuple[torch.Tensor, Keyed]:
        o = self.options
        parts = weak_pair_losses(left, right, denoiser, o.steps, self._scale(net), o.shared_noise, o.cross_detach,
                                 o.cross, o.denoise_from)
        term = o.intra_weight * parts["intra"] + o.cross_weight * parts["cross"] + o.robust_weight * parts["robust"]
        return term, {f"l_{k}": v.detach() for k, v in parts.items()}

    def _rows_loss(self, emb: Embeddings, ids: np.ndarray, net, denoiser: Denoiser) -> tuple[torch.Tensor, Keyed]:
        """loops=rows: plain InfoNCE on the batch's clean rows + the weak-pair losses on its weak rows."""
        part = self.partition[ids]
        loss = every_parameter(emb)
        metrics = {}
        for name, rows in (("clean", part == CLEAN), ("weak", self._weak(part))):
            rows = torch.from_numpy(np.flatnonzero(rows)).to(emb.left.device)
            if len(rows) < 2:
                continue
            left, right = emb.left[rows], emb.right[rows]
            if name == "clean":
                term = infonce_terms(left, right, emb.logit_scale).per_sample.mean()
            else:
                term, parts = self._weak_loss(left, right, net, denoiser)
                metrics.update(parts)
            loss = loss + term
            metrics[f"l_{name}"] = term.detach()
        return loss, metrics

    def _weak_step(self, k: int, net) -> tuple | None:
        """loops=batches: network k's next full batch of weak pairs and its loss (None when there is none)."""
        if self.options.weak_loop == "none":
            return None
        batch = self.weak_batches[k].next()
        if batch is None:
            return None
        denoiser = self.denoisers[k]

        def loss(emb: Embeddings) -> torch.Tensor:
            denoiser.zero_grad()
            self.denoise = denoiser if k == 0 else None
            term, parts = self._weak_loss(emb.left, emb.right, net, denoiser.module)
            self.weak_metrics[k] = {**parts, "l_weak": term.detach()}
            return term + every_parameter(emb)
        return batch, loss

    def loss(self, batch: dict, emb: Embeddings, ctx: MethodContext) -> LossOutput:
        self.denoise = None
        peer_metrics = self._peer_step(ctx)
        per_pair = infonce_terms(emb.left, emb.right, emb.logit_scale, emb.all_left, emb.all_right, emb.offset).per_sample
        if self.partition is None:  # warm-up: plain InfoNCE on everything
            return LossOutput(per_pair.mean(), {"loss": per_pair.detach()}, peer_metrics)
        ids = self.index.ids(batch["shard"], batch["index"])
        diag = {"loss": per_pair.detach(), "partition_code": torch.from_numpy(self.partition[ids].astype(np.float32))}
        if not self.loops:
            self.denoisers[0].zero_grad()
            self.denoise = self.denoisers[0]
            loss, metrics = self._rows_loss(emb, ids, ctx.target, self.denoisers[0].module)
            return LossOutput(loss, diag, {**metrics, **peer_metrics})
        loss = per_pair.mean()  # a batch of clean pairs: the trainer's InfoNCE
        follow_ups = []
        weak = self._weak_step(0, ctx.target)
        if weak is not None:
            follow_ups.append(FollowUp(weak[0]["left"], weak[0]["right"], weak[1]))
        return LossOutput(loss, diag, {"l_clean": loss.detach(), **self.weak_metrics.get(0, {}), **peer_metrics},
                          follow_ups)

    def after_backward(self, ctx: MethodContext) -> None:
        if self.denoise is not None:
            self.denoise.step()
            self.denoise = None

    def _peer_step(self, ctx: MethodContext) -> Keyed:
        batch = self.peer.next_batch()
        if batch is None:  # its subset holds no batch on some rank: the peer skips this iteration
            return {}
        emb = self.peer.embed(ctx, batch)
        if self.partition is None:
            loss = infonce_terms(emb.left, emb.right, emb.logit_scale).per_sample.mean()
            self.peer.step(loss)
            return {"peer_loss": loss.detach()}
        target, denoiser = self.peer.target, self.denoisers[1]
        if not self.loops:
            denoiser.zero_grad()
            loss, _ = self._rows_loss(emb, self.index.ids(batch["shard"], batch["index"]), target, denoiser.module)
            self.peer.step(loss)
            denoiser.step()
            return {"peer_loss": loss.detach()}
        loss = infonce_terms(emb.left, emb.right, emb.logit_scale).per_sample.mean()
        self.peer.step(loss)
        weak = self._weak_step(1, target)
        if weak is not None:
            weak_emb = self.peer.embed(ctx, weak[0])
            self.peer.step(weak[1](weak_emb))
            denoiser.step()
        return {"peer_loss": loss.detach()}

    def on_epoch_end(self, epoch: int, ctx: MethodContext) -> JsonObject:
        self.peer.close()
        for loader in getattr(self, "weak_batches", ()):
            loader.close()
        if self.partition is None:
            return {}
        columns = {"partition": PARTITION_NAMES[self.partition]}
        for k, suffix in enumerate(("", "_peer")):
            columns.update({f"loss{suffix}": self.passes[k]["loss"], f"psi{suffix}": self.passes[k]["psi"],
                            f"label{suffix}": PARTITION_NAMES[self.labels[k]],
                            **{f"p_{name}{suffix}": self.posteriors[k][:, j] for j, name in enumerate(PARTITION_NAMES)}})
        columns["zeta"] = np.full(self.index.size, self.zeta)
        write_pair_table(ctx, epoch, self.index, self.seen, columns)
        counts = np.bincount(self.partition[self.seen], minlength=3)
        return {"diffncl_clean": int(counts[CLEAN]), "diffncl_weak": int(counts[WEAK]),
                "diffncl_noisy": int(counts[NOISY]), "diffncl_zeta": self.zeta}

    def state_dict(self) -> StateDict:
        return {"peer": self.peer.state_dict(), "denoisers": [d.state_dict() for d in self.denoisers]}

    def load_state_dict(self, state: dict) -> None:
        self.saved = state

    def extra_networks(self) -> Keyed:
        return {"peer": self.peer.target}
