"""DiffNCL, diffusion-driven weakly-noisy correspondence learning (seeds/diffncl-diffusion-weakly-noisy.txt;
training-methods.md), on a dual encoder.

Two co-trained networks: the main one (trained by the trainer) and a peer with its own data order,
each with its own reverse-diffusion denoiser. After `warmup_epochs` of plain InfoNCE, each epoch
starts with a no-grad pass per network giving every pair its InfoNCE loss l and its diffusion
discrepancy Psi (Eq. 4-6: the unit embeddings, scaled by sqrt(d), noised over T steps with
alpha_t = cos^2(pi t / 2T), beta_t = cos^3(pi t / 2T); Psi = sum_t gamma_t (s_t - s_{t-1})^2 over
the pair's cosines s_t). A 3-component GMM on [minmax l, zeta * minmax Psi] per network labels
each pair clean / weak / noisy (components ordered by the sum of their means); a pair is clean
(noisy) only when both networks say so, otherwise weak (Eq. 11). Training: clean rows plain
InfoNCE; weak rows L_intra + L_cross + L_robust through the denoiser (Eq. 14-17); noisy rows
dropped. The denoisers serve training only; evaluation averages both networks' similarities.

The SAME Gaussian draw noises both sides of a pair at each step by default: the paper calls the
noise "synchronized", and with independent draws Psi grows with the clean similarity (a clean
pair loses its high cosine, a mismatched pair had none to lose), the opposite of the paper's
ordering. `shared_noise=false` gives the independent draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pairclean.core.mixture import clean_posterior
from pairclean.config import COUNT, above, at_least, setting, within
from pairclean.train.loss import infonce_terms
from pairclean.train.methods.base import Embeddings, LossOutput, Method, MethodContext, register_method
from pairclean.train.robust import OwnModule, PairIndex, Peer, embedding_dim, pair_pass, write_pair_table
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
                      generator: torch.Generator | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """[f_0 .. f_T], [g_0 .. g_T] from unit embeddings scaled by sqrt(d) (so signal and noise have
    the same per-dimension scale): f_t = sqrt(a_t) f_{t-1} + sqrt(1 - a_t) eps (b_t for g)."""
    alpha, beta = (s.to(f.dtype) for s in noise_schedules(steps))
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


def dynamic_zeta(losses: list[np.ndarray]) -> float:
    """zeta = mean over the networks of E[sigmoid(-l)] (Eq. 7)."""
    return float(np.mean([np.mean(1.0 / (1.0 + np.exp(np.asarray(l, dtype=np.float64)))) for l in losses]))


def three_way_labels(loss: np.ndarray, psi: np.ndarray, zeta: float, seed: int = 0, max_iter: int = 100,
                     reg_covar: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    """(argmax label clean/weak/noisy, posteriors ordered clean, weak, noisy) of a 3-component GMM on
    [minmax l, zeta * minmax Psi]; components ordered by the sum of their mean coordinates."""
    post, _ = clean_posterior(np.column_stack([loss, psi]), n_components=3, higher_is_clean=False, seed=seed,
                              max_iter=max_iter, reg_covar=reg_covar, column_scale=(1.0, zeta))
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


def cross_consistency(f_hat: torch.Tensor, g_hat: torch.Tensor, f: torch.Tensor, g: torch.Tensor,
                      logit_scale, detach_originals: bool = False) -> torch.Tensor:
    """L_cross (Eq. 15, as written): the denoised pair against the denoised image with every original
    text and every original image with the denoised text, in one softmax. The originals include the
    pair's own: as written, the loss pushes each original embedding away from its pair's denoised
    one; `detach_originals` keeps them out of the gradient (targets, as in L_intra)."""
    if detach_originals:
        f, g = f.detach(), g.detach()
    positive = logit_scale * (f_hat * g_hat).sum(-1)
    others = torch.cat([logit_scale * f_hat @ g.T, logit_scale * g_hat @ f.T], dim=1)
    return (torch.logsumexp(others.float(), dim=1) - positive.float()).mean()


def weak_pair_losses(f: torch.Tensor, g: torch.Tensor, denoiser: Denoiser, steps: int, logit_scale,
                     shared_noise: bool = True, cross_detach: bool = False) -> dict[str, torch.Tensor]:
    """L_intra, L_cross, L_robust (Eq. 14, 15, 17) of weakly-noisy pairs with unit embeddings f, g."""
    scale = math.sqrt(f.shape[-1])
    fs, gs = forward_diffusion(f, g, steps, shared_noise)
    f_hat, g_hat = denoiser(fs[-1], gs[-1], fs[0], gs[0], steps)
    intra = ((f_hat / scale - f.detach()) ** 2).sum(-1).mean() + ((g_hat / scale - g.detach()) ** 2).sum(-1).mean()
    f_hat_unit, g_hat_unit = F.normalize(f_hat, dim=-1), F.normalize(g_hat, dim=-1)
    robust = 0.5 * (infonce_terms(f_hat_unit, g, logit_scale).per_sample.mean() +
                    infonce_terms(f, g_hat_unit, logit_scale).per_sample.mean())
    cross = cross_consistency(f_hat_unit, g_hat_unit, f, g, logit_scale, cross_detach)
    return {"intra": intra, "cross": cross, "robust": robust}


@dataclass
class DiffnclOptions:
    warmup_epochs: int = setting(5, at_least(0))  # plain InfoNCE on everything for both networks (the paper: 5 on Flickr30K)
    steps: int = setting(4, COUNT)  # diffusion steps T
    shared_noise: bool = True  # one Gaussian draw for both sides per step (see the module docstring)
    zeta: float | None = setting(None, above(0))  # weight of Psi in the GMM features; None: the paper's dynamic E[sigmoid(-l)]
    hidden_ratio: float = setting(0.5, within(0, 1, low_open=True))  # the denoiser's bottleneck width h = d * hidden_ratio (paper: 512 of 1024)
    noisy_as_weak: bool = False  # route noisy pairs through the denoiser with the weak ones instead of dropping them
    intra_weight: float = setting(1.0, at_least(0))  # weights of the weak pairs' three losses (the paper: all 1)
    cross_weight: float = setting(1.0, at_least(0))
    robust_weight: float = setting(1.0, at_least(0))
    cross_detach: bool = False  # L_cross trains the denoiser only: the original embeddings enter it detached
    gmm_max_iter: int = setting(100, COUNT)
    gmm_reg_covar: float = setting(1e-3, above(0))


@register_method
class Diffncl(Method):
    """Two co-trained networks; clean / weak / noisy by consensus of per-network GMMs on [loss, zeta * Psi]."""

    name = "diffncl"
    Options = DiffnclOptions

    def __init__(self, options):
        super().__init__(options)
        self.saved = None  # a resumed run's method state, applied at the first epoch
        self.partition = None
        self.denoise_main = False

    def setup(self, ctx: MethodContext):
        self.index = PairIndex(ctx.shards)
        self.peer = Peer(ctx)
        dim = embedding_dim(ctx.target)
        hidden = max(1, round(dim * self.options.hidden_ratio))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed)
            self.denoisers = [OwnModule(Denoiser(dim, hidden).to(net.device), ctx.config.grad_clip)
                              for net in (ctx.target, self.peer.target)]
        return super().setup(ctx)

    def on_epoch_start(self, epoch: int, ctx: MethodContext) -> None:
        if self.peer.start_epoch(epoch, ctx, self.saved and self.saved["peer"]):
            for k, denoiser in enumerate(self.denoisers):
                denoiser.start(ctx)
                if self.saved is not None:
                    denoiser.load_state_dict(self.saved["denoisers"][k])
        self.saved = None
        if epoch <= self.options.warmup_epochs:
            self.partition = None
            return
        self._partition(epoch, ctx)

    def _partition(self, epoch: int, ctx: MethodContext) -> None:
        """Loss and Psi of every pair under each network (its own seeded noise), the GMMs, the consensus."""
        o = self.options
        passes = []
        for k, net in enumerate((ctx.target, self.peer.target)):
            scale = net.logit_scale().detach()
            generator = torch.Generator(device=net.device).manual_seed(ctx.seed * 1_000_003 + epoch * 2 + k)
            passes.append(pair_pass(ctx, net, lambda batch, left, right: {
                "loss": infonce_terms(left, right, scale).per_sample,
                "psi": diffusion_discrepancy(left, right, o.steps, o.shared_noise, generator)}, self.index))
        seen = passes[0].seen & passes[1].seen
        zeta = o.zeta if o.zeta is not None else dynamic_zeta([t["loss"][seen] for t in passes])
        self.labels, self.posteriors = [], []
        for table in passes:
            labels = np.full(self.index.size, WEAK, dtype=np.int8)
            post = np.full((self.index.size, 3), np.nan, dtype=np.float32)
            labels[seen], post[seen] = three_way_labels(table["loss"][seen], table["psi"][seen], zeta, ctx.seed,
                                                        o.gmm_max_iter, o.gmm_reg_covar)
            self.labels.append(labels)
            self.posteriors.append(post)
        self.partition = consensus(*self.labels)
        self.passes, self.seen, self.zeta = passes, seen, zeta

    def _loss(self, emb: Embeddings, ids: np.ndarray, denoiser: Denoiser) -> tuple[torch.Tensor, dict]:
        """Plain InfoNCE on the clean rows + the weak-pair losses through the denoiser (rows on this rank)."""
        part = self.partition[ids]
        weak = part == WEAK
        if self.options.noisy_as_weak:
            weak |= part == NOISY
        loss = 0.0 * (emb.left.sum() + emb.right.sum())  # every parameter gets a gradient (DDP)
        metrics = {}
        for name, rows in (("clean", part == CLEAN), ("weak", weak)):
            rows = torch.from_numpy(np.flatnonzero(rows)).to(emb.left.device)
            if len(rows) < 2:
                continue
            left, right = emb.left[rows], emb.right[rows]
            if name == "clean":
                term = infonce_terms(left, right, emb.logit_scale).per_sample.mean()
            else:
                parts = weak_pair_losses(left, right, denoiser, self.options.steps, emb.logit_scale,
                                         self.options.shared_noise, self.options.cross_detach)
                o = self.options
                term = o.intra_weight * parts["intra"] + o.cross_weight * parts["cross"] + o.robust_weight * parts["robust"]
                metrics.update({f"l_{k}": float(v.detach()) for k, v in parts.items()})
            loss = loss + term
            metrics[f"l_{name}"] = float(term.detach())
        return loss, metrics

    def loss(self, batch: dict, emb: Embeddings, ctx: MethodContext) -> LossOutput:
        peer_metrics = self._peer_step(ctx)
        per_pair = infonce_terms(emb.left, emb.right, emb.logit_scale, emb.all_left, emb.all_right, emb.offset).per_sample
        if self.partition is None:  # warm-up: plain InfoNCE on everything
            self.denoise_main = False
            return LossOutput(per_pair.mean(), {"loss": per_pair.detach()}, peer_metrics)
        ids = self.index.ids(batch["shard"], batch["index"])
        self.denoisers[0].zero_grad()
        self.denoise_main = True
        loss, metrics = self._loss(emb, ids, self.denoisers[0].module)
        diag = {"loss": per_pair.detach(), "partition_code": torch.from_numpy(self.partition[ids].astype(np.float32))}
        return LossOutput(loss, diag, {**metrics, **peer_metrics})

    def after_backward(self, ctx: MethodContext) -> None:
        if self.denoise_main:
            self.denoisers[0].step()

    def _peer_step(self, ctx: MethodContext) -> dict:
        batch = self.peer.next_batch()
        emb = self.peer.embed(ctx, batch)
        if self.partition is None:
            loss = infonce_terms(emb.left, emb.right, emb.logit_scale).per_sample.mean()
            self.peer.step(loss)
            return {"peer_loss": float(loss.detach())}
        denoiser = self.denoisers[1]
        denoiser.zero_grad()
        loss, _ = self._loss(emb, self.index.ids(batch["shard"], batch["index"]), denoiser.module)
        self.peer.step(loss)
        denoiser.step()
        return {"peer_loss": float(loss.detach())}

    def on_epoch_end(self, epoch: int, ctx: MethodContext) -> dict:
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

    def state_dict(self) -> dict:
        return {"peer": self.peer.state_dict(), "denoisers": [d.state_dict() for d in self.denoisers]}

    def load_state_dict(self, state: dict) -> None:
        self.saved = state

    def extra_networks(self) -> dict:
        return {"peer": self.peer.target}
