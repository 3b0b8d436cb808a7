"""Training methods: how each pair's loss is weighted (or the pair dropped), behind one interface.

A method is a class registered under a name (`--method NAME`) with an `Options` dataclass
(`--method-option key=value`). The trainer calls:

    setup(ctx) -> BatchPlan          once, before training (join scores, load an estimator ...)
    on_epoch_start(epoch, ctx)       e.g. per-epoch passes over the training set
    loss(batch, emb: Embeddings, ctx) -> LossOutput   per step: loss + per-pair diagnostics (+ follow-up steps)
    after_backward(ctx)              gradients are in place: step modules the method trains itself
    on_epoch_end(epoch, ctx) -> dict metrics for metrics.jsonl
    state_dict() / load_state_dict() what --resume must restore
    extra_networks()                 a second network that is part of the result (GSC's peer)

The default `loss` is the weighted symmetric InfoNCE with `batch_weights(batch, ctx)` (None =
plain). Methods of the other seeds (SDD, GSC, SPS, DiffNCL) override `loss` and the epoch hooks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from pairclean.ops import distributed
from pairclean.core.beta import check_beta_mode, random_input_beta, resolve_beta
from pairclean.errors import UserError
from pairclean.backends import build_estimator, resolve_backend
from pairclean.data.manifest import DatasetSpec
from pairclean.core.scorer import WEIGHT_FUNCTIONS, cone_weight, debias, normalised_weight
from pairclean.train.data import BatchPlan, ShardInfo
from pairclean.train.loss import REDUCTIONS, weighted_infonce
from pairclean.train.weights import JOINS, ON_MISSING, build_weight_arrays


@dataclass
class MethodContext:
    """What a method may use: the data, the target, the run directory, the trainer's settings."""

    spec: DatasetSpec
    shards: list[ShardInfo]
    target: Any
    run_dir: Path
    seed: int
    left: str
    right: str
    config: Any = None  # the run's TrainConfig (batch size, workers, precision, model ...)
    # Set by the trainer once the schedule is known: (module, start_step) -> (AdamW, LR schedule) with
    # the run's settings, and the number of optimiser steps taken so far (for a second network).
    new_optimizer: Callable[[torch.nn.Module, int], tuple] | None = None
    current_step: Callable[[], int] | None = None


@dataclass
class Embeddings:
    """One step's L2-normalised embeddings. Under torch.distributed, `all_left`/`all_right` hold
    every rank's rows (negatives across ranks) with this rank's at `offset`; alone, they are None."""

    left: torch.Tensor
    right: torch.Tensor
    logit_scale: torch.Tensor
    all_left: torch.Tensor | None = None
    all_right: torch.Tensor | None = None
    offset: int = 0


@dataclass
class FollowUp:
    """A further optimiser step of the main network within the same trainer step (SPS takes three
    per iteration): the trainer encodes `left`/`right` (prepared batches; each rank's own rows,
    no negatives across ranks) after its previous step and minimises `loss(emb)`."""

    left: Any
    right: Any
    loss: Callable[[Embeddings], torch.Tensor]


@dataclass
class LossOutput:
    loss: torch.Tensor
    per_pair: dict[str, torch.Tensor] = field(default_factory=dict)  # diagnostics columns, detached
    metrics: dict[str, float] = field(default_factory=dict)  # batch-level values for the step log
    follow_ups: list[FollowUp] = field(default_factory=list)  # every rank must return as many


class Method:
    name: ClassVar[str] = ""
    Options: ClassVar[type] = None

    def __init__(self, options):
        self.options = options

    def validate(self) -> None:
        """Check the options (UserError); called once by build_method."""

    def setup(self, ctx: MethodContext) -> BatchPlan:
        return BatchPlan()

    def on_epoch_start(self, epoch: int, ctx: MethodContext) -> None:
        """Nothing to do between epochs for a fixed weighting."""

    def batch_weights(self, batch: dict, ctx: MethodContext) -> tuple[torch.Tensor | None, dict]:
        """(per-pair loss weights or None for unweighted, extra per-pair diagnostics columns)."""
        return None, {}

    def loss(self, batch: dict, emb: Embeddings, ctx: MethodContext) -> LossOutput:
        weights, extra = self.batch_weights(batch, ctx)
        reduction = getattr(self.options, "reduction", "mean")
        loss, per_pair = weighted_infonce(emb.left, emb.right, emb.logit_scale, weights, reduction=reduction,
                                          all_left=emb.all_left, all_right=emb.all_right, offset=emb.offset)
        diag = {"loss": per_pair, **extra}
        metrics = {}
        if weights is not None:
            diag["weight"] = weights.detach().float().cpu()
            metrics["mean_weight"] = float(weights.float().mean())
        return LossOutput(loss, diag, metrics)

    def after_backward(self, ctx: MethodContext) -> None:
        """Called after each backward of the main network's loss, before its optimiser step: a method
        whose loss also trains modules of its own (DiffNCL's denoisers) steps them here."""

    def on_epoch_end(self, epoch: int, ctx: MethodContext) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """A fixed weighting has no state beyond its options."""

    def extra_networks(self) -> dict:
        """name -> target of networks trained beside the main one that are part of the result
        (exported per epoch as model-...-NAME, evaluated with the main one by averaged similarity)."""
        return {}

    def describe(self) -> dict:
        return {"method": self.name, **dataclasses.asdict(self.options)}


METHODS: dict[str, type[Method]] = {}


def register_method(cls: type[Method]) -> type[Method]:
    METHODS[cls.name] = cls
    return cls


def _coerce(value: Any, annotation: str, name: str):
    """CLI option strings -> the option's declared type."""
    if not isinstance(value, str):
        return value
    kind = annotation.replace(" ", "").split("|")
    if value.lower() in ("none", "null") and "None" in kind:
        return None
    try:
        if "bool" in kind:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if "int" in kind:
            return int(value)
        if "float" in kind:
            return float(value)
    except ValueError:
        raise UserError(f"method option {name}={value!r} is not a valid {annotation}") from None
    return value


def build_method(name: str, options: dict | None = None) -> Method:
    if name not in METHODS:
        raise UserError(f"unknown method {name!r}; choose one of {', '.join(sorted(METHODS))}")
    cls = METHODS[name]
    fields = {f.name: f for f in dataclasses.fields(cls.Options)}
    options = dict(options or {})
    unknown = sorted(set(options) - set(fields))
    if unknown:
        known = ", ".join(fields) or "none"
        raise UserError(f"method {name} has no option(s) {', '.join(unknown)} (options: {known})")
    values = {k: _coerce(v, str(fields[k].type), k) for k, v in options.items()}
    try:
        opts = cls.Options(**values)
    except TypeError as exc:
        raise UserError(f"method {name}: {exc}") from None
    method = cls(opts)
    method.validate()
    return method


@dataclass
class PlainOptions:
    pass


@register_method
class Plain(Method):
    """Every pair counts fully: the baseline."""

    name = "plain"
    Options = PlainOptions


@dataclass
class ScoresOptions:
    scores: str | None = None  # the scores Parquet written by `pairclean score`
    filter: str | None = None  # DuckDB predicate over the scores: pairs where it is false are dropped
    join: str = "auto"
    on_missing: str = "error"


def _join_on_main(opts, ctx: MethodContext, column: str | None):
    """The weight arrays, built once by rank 0 under torch.distributed (RUN_DIR is shared) and
    announced to every rank; in one process, built here."""
    return distributed.on_main(lambda: build_weight_arrays(opts.scores, ctx.spec, ctx.shards, ctx.run_dir,
                                                           column=column, predicate=opts.filter, join=opts.join,
                                                           on_missing=opts.on_missing))


def _check_scores_options(name: str, opts) -> None:
    if not opts.scores:
        raise UserError(f"method {name} needs a scores file (--weights FILE or --scores FILE)")
    if opts.join not in JOINS:
        raise UserError(f"unknown join {opts.join!r}; choose one of {', '.join(JOINS)}")
    if opts.on_missing not in ON_MISSING:
        raise UserError(f"unknown --on-missing {opts.on_missing!r}; choose one of {', '.join(ON_MISSING)}")


@dataclass
class OsaWeightsOptions(ScoresOptions):
    column: str = "weight_norm"  # weight_norm = the OSA weight mapped to [0, 1]; `weight` = raw
    reduction: str = "mean"


@register_method
class OsaWeights(Method):
    """Each pair's loss times its weight from the scores file (OSA Eq. 6), joined per shard."""

    name = "osa-weights"
    Options = OsaWeightsOptions

    def validate(self) -> None:
        _check_scores_options(self.name, self.options)
        self.join = None
        if self.options.reduction not in REDUCTIONS:
            raise UserError(f"unknown reduction {self.options.reduction!r}; choose one of {', '.join(REDUCTIONS)}")

    def setup(self, ctx: MethodContext) -> BatchPlan:
        o = self.options
        self.join = _join_on_main(o, ctx, column=o.column)
        return BatchPlan(weights_dir=self.join.directory, shard_files=self.join.shard_files, pairs=self.join.kept)

    def batch_weights(self, batch: dict, ctx: MethodContext) -> tuple[torch.Tensor, dict]:
        return batch["weight"], {}

    def describe(self) -> dict:
        return {**super().describe(), "join_summary": self.join.summary() if self.join else None}


@dataclass
class FilterOptions(ScoresOptions):
    pass


@register_method
class Filter(Method):
    """Train only on the pairs the predicate keeps (they are not even negatives); no weighting."""

    name = "filter"
    Options = FilterOptions

    def validate(self) -> None:
        _check_scores_options(self.name, self.options)
        if not self.options.filter:
            raise UserError("method filter needs a predicate (--filter \"SQL over the scores\")")
        self.join = None

    def setup(self, ctx: MethodContext) -> BatchPlan:
        self.join = _join_on_main(self.options, ctx, column=None)
        return BatchPlan(weights_dir=self.join.directory, shard_files=self.join.shard_files, pairs=self.join.kept)

    def describe(self) -> dict:
        return {**super().describe(), "join_summary": self.join.summary() if self.join else None}


@dataclass
class OsaOnlineOptions:
    estimator_model: str | None = None  # None: a frozen copy of the target before training (official code)
    estimator_pretrained: str = "none"  # open_clip estimators: tag, checkpoint path, or none
    estimator_backend: str = "auto"  # auto | open_clip | sentence-transformers
    weight_fn: str = "cubic"
    normalise: bool = True  # weight_norm, as the offline default column
    beta_mode: str = "random-inputs"  # or fixed
    beta: float | None = None
    beta_k: int = 1024
    reduction: str = "mean"


def _same_inputs(a, b) -> bool:
    """Whether two estimators take the same prepared inputs (see Estimator.input_signature)."""
    signature = a.input_signature()
    return signature is not None and signature == b.input_signature()


@register_method
class OsaOnline(Method):
    """OSA weights computed in the loop by a frozen estimator through pairclean.core.scorer."""

    name = "osa-online"
    Options = OsaOnlineOptions

    def validate(self) -> None:
        o = self.options
        if o.weight_fn not in WEIGHT_FUNCTIONS:
            raise UserError(f"unknown weight function {o.weight_fn!r}; choose one of {', '.join(WEIGHT_FUNCTIONS)}")
        check_beta_mode(o.beta_mode, o.beta, supported=("random-inputs", "fixed"),
                        hint="online OSA needs --beta-mode random-inputs or fixed (shuffled needs a full pass)")
        if o.reduction not in REDUCTIONS:
            raise UserError(f"unknown reduction {o.reduction!r}; choose one of {', '.join(REDUCTIONS)}")
        self.beta = None
        self.estimator = None

    def setup(self, ctx: MethodContext) -> BatchPlan:
        o = self.options
        target = ctx.target
        if o.estimator_model is None:
            self.estimator = target.frozen_estimator()
        else:
            backend = resolve_backend(o.estimator_backend, o.estimator_model, (ctx.left, ctx.right))
            torch.manual_seed(ctx.seed)  # a randomly initialised estimator is then reproducible
            self.estimator = build_estimator(backend, model=o.estimator_model, pretrained=o.estimator_pretrained,
                                             device=str(target.device))
        if self.beta is None:  # a resumed run keeps the beta it started with
            estimate, _ = resolve_beta(o.beta_mode, o.beta, lambda: (random_input_beta(
                self.estimator, ctx.left, ctx.right, k=o.beta_k, seed=ctx.seed), "computed"))
            self.beta = estimate.beta
        if o.estimator_model is None or _same_inputs(target.estimator, self.estimator):
            return BatchPlan()
        return BatchPlan(extra_preparers={"estimator": self.estimator.preparer})

    def batch_weights(self, batch: dict, ctx: MethodContext) -> tuple[torch.Tensor, dict]:
        left = batch.get("estimator_left", batch["left"])
        right = batch.get("estimator_right", batch["right"])
        sim = (self.estimator.encode(ctx.left, left) * self.estimator.encode(ctx.right, right)).sum(-1)
        w = cone_weight(debias(sim, self.beta), self.options.weight_fn)  # official: scale = the batch max
        if self.options.normalise:
            w = normalised_weight(w, self.options.weight_fn, self.beta)
        return w, {"sim": sim.float().cpu()}

    def state_dict(self) -> dict:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        self.beta = state.get("beta")

    def describe(self) -> dict:
        return {**super().describe(), "beta": self.beta,
                "estimator": self.estimator.provenance() if self.estimator is not None else None}
