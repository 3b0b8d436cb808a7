"""osa-online: OSA weights computed in the loop by a frozen estimator through pairclean.core.scorer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pairclean.backends import build_estimator, resolve_backend
from pairclean.config import COSINE, COUNT, check_choice, setting
from pairclean.errors import ConfigError
from pairclean.core.beta import check_beta_mode, random_input_beta, resolve_beta
from pairclean.core.scorer import WEIGHT_FUNCTIONS, cone_weight, debias, normalised_weight
from pairclean.ops.records import JsonObject, Keyed, StateDict
from pairclean.training.data import BatchPlan
from pairclean.training.loss import REDUCTIONS
from pairclean.training.methods.base import Method, MethodContext, Shortcut, register_method
from pairclean.training.methods.osa_weights import REDUCTION_SHORTCUT

ONLINE_BETA_MODES = ("random-inputs", "fixed")  # shuffled needs a full pass over the data before training


@dataclass
class OsaOnlineOptions:
    estimator_model: str | None = None  # None: a frozen copy of the target before training (official code)
    estimator_pretrained: str = "default"  # the model's own weights, a tag, a checkpoint path, or none (random;
    #                                        it also allows a random frozen copy on purpose)
    estimator_backend: str = "auto"  # auto | open_clip | sentence-transformers
    weight_fn: str = "cubic"
    normalise: bool = True  # weight_norm, as the offline default column
    beta_mode: str = "random-inputs"  # or fixed
    beta: float | None = setting(None, COSINE)
    beta_k: int = setting(1024, COUNT)
    reduction: str = "mean"

    def __post_init__(self):
        check_choice(self.weight_fn, WEIGHT_FUNCTIONS, "weight_fn", "weight function")
        check_choice(self.beta_mode, ONLINE_BETA_MODES, "beta_mode", "online beta mode")
        check_beta_mode(self.beta_mode, self.beta)
        check_choice(self.reduction, REDUCTIONS, "reduction")


def _same_inputs(a, b) -> bool:
    """Whether two estimators take the same prepared inputs (see Estimator.input_signature)."""
    signature = a.input_signature()
    return signature is not None and signature == b.input_signature()


@register_method
class OsaOnline(Method):
    """OSA weights computed in the loop by a frozen estimator through pairclean.core.scorer."""

    name = "osa-online"
    Options = OsaOnlineOptions
    shortcuts = (Shortcut("--online", None, "OSA weights computed in the loop by a frozen estimator (method "
                                            "osa-online).", kind=bool, selects=3),
                 Shortcut("--estimator-model", "estimator_model", "--online estimator (default: a frozen copy of the "
                                                                  "model before training)."),
                 Shortcut("--estimator-pretrained", "estimator_pretrained", "--online estimator weights: tag, path, "
                                                                            "none, or default (the model's own; none "
                                                                            "also allows a random frozen copy)."),
                 Shortcut("--weight-fn", "weight_fn", "--online weight function: cubic, linear, cosine, official."),
                 Shortcut("--beta-k", "beta_k", "--online: K random inputs per side for beta.", kind=int),
                 REDUCTION_SHORTCUT)

    def __init__(self, options):
        super().__init__(options)
        self.beta = None
        self.estimator = None

    @property
    def reduction(self) -> str:
        return self.options.reduction

    def setup(self, ctx: MethodContext) -> BatchPlan:
        o = self.options
        target = ctx.target
        if o.estimator_model is None:
            self.estimator = target.frozen_estimator()
        else:
            backend = resolve_backend(o.estimator_backend, o.estimator_model, (ctx.left, ctx.right))
            torch.manual_seed(ctx.seed)  # a randomly initialised estimator is then reproducible
            self.estimator = build_estimator(backend, model=o.estimator_model, device=str(target.device),
                                             pretrained=None if o.estimator_pretrained == "default"
                                             else o.estimator_pretrained)
        if self.estimator.random_init and o.estimator_pretrained != "none":  # none: a random estimator on purpose
            raise ConfigError("the online estimator is a frozen copy of the model before training, and that model is "
                              "randomly initialised (`pretrained` none): its similarities, and so the weights, would "
                              "be noise. Give the model trained weights with `pretrained`, or a trained estimator "
                              "with `estimator_model` (and `estimator_pretrained`); `estimator_pretrained` none trains "
                              "against the random copy on purpose", "pretrained", "estimator_model",
                              "estimator_pretrained")
        if self.beta is None:  # a resumed run keeps the beta it started with
            estimate, _ = resolve_beta(o.beta_mode, o.beta, lambda: (random_input_beta(
                self.estimator, ctx.left, ctx.right, k=o.beta_k, seed=ctx.seed), "computed"))
            self.beta = estimate.beta
        if o.estimator_model is None or _same_inputs(target.estimator, self.estimator):
            return BatchPlan()
        return BatchPlan(extra_preparers={"estimator": self.estimator.preparer})

    def batch_weights(self, batch: dict, ctx: MethodContext) -> tuple[torch.Tensor, Keyed]:
        left = batch.get("estimator_left", batch["left"])
        right = batch.get("estimator_right", batch["right"])
        sim = (self.estimator.encode(ctx.left, left) * self.estimator.encode(ctx.right, right)).sum(-1)
        w = cone_weight(debias(sim, self.beta), self.options.weight_fn)  # official: scale = the batch max
        if self.options.normalise:
            w = normalised_weight(w, self.options.weight_fn, self.beta)
        return w, {"sim": sim.float()}

    def state_dict(self) -> StateDict:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        self.beta = state.get("beta")

    def describe(self) -> JsonObject:
        return {**super().describe(), "beta": self.beta,
                "estimator": self.estimator.provenance() if self.estimator is not None else None}
