"""The training-method interface and its registry: how each pair's loss is weighted (or the pair dropped).

A method is a class registered under a name (`TrainConfig.method`) with an `Options` dataclass
(`TrainConfig.method_options`; each Options checks its own values in `__post_init__`) and the
command-line shortcuts it answers to (`shortcuts`: e.g. osa-weights' `--weights FILE`, which sets
its `scores` option and picks it when no method is named). The trainer calls:

    setup(ctx) -> BatchPlan          once, before training (join scores, load an estimator ...)
    on_epoch_start(epoch, ctx)       e.g. per-epoch passes over the training set
    loss(batch, emb: Embeddings, ctx) -> LossOutput   per step: loss + per-pair diagnostics (+ follow-up steps)
    after_backward(ctx)              gradients are in place: step modules the method trains itself
    on_epoch_end(epoch, ctx) -> dict metrics for metrics.jsonl
    state_dict() / load_state_dict() what a resumed run must restore
    extra_networks()                 a second network that is part of the result (GSC's peer)
    input_files()                    files the method reads, which the run directory must not overwrite
    epoch_pairs()                    pairs chosen for this epoch (the LR schedule is re-planned), or None
    epoch_span()                     the pairs an epoch of chosen pairs spans (re-read to fill it), or None
    schedule(epochs)                 its warm-up and phases for a run of that length (help shows it)

The default `loss` is the weighted symmetric InfoNCE with `batch_weights(batch, ctx)` (None =
plain). Each method lives in its own module of this package (plain, osa_weights, filter,
osa_online, sdd, gsc, sps, diffncl); importing the package registers them all.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from pairclean.config import check_choice, check_value, field_types, parse_value
from pairclean.data.dataset import Dataset
from pairclean.errors import UserError
from pairclean.ops.notices import notice
from pairclean.ops.records import JsonObject, Keyed, StateDict
from pairclean.training.data import BatchPlan, ShardInfo
from pairclean.training.loss import weighted_infonce


# `epoch` of the subset-training methods (SPS, DiffNCL): one pass over the pairs they chose, or as many
# steps as a pass over every pair.
EPOCH_LENGTHS = ("subset", "all")


@dataclass
class MethodContext:
    """What a method may use: the data, the target, the run directory, the trainer's settings."""

    dataset: Dataset  # what reads the training data
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
    # Batch-level values for the step log: numbers, or 0-d tensors left on the device (the trainer
    # reads them a step late, without waiting for the device: `float(t)` here would wait for it)
    metrics: dict[str, float | torch.Tensor] = field(default_factory=dict)
    follow_ups: list[FollowUp] = field(default_factory=list)  # every rank must return as many


@dataclass(frozen=True)
class Shortcut:
    """A command-line flag a method answers to: it sets one of the method's options (`option`; None for a
    switch that only picks the method) and, when `selects` > 0 and no method is named, picks the method
    (of several given, the highest `selects` wins). The CLI builds its flags from these declarations."""

    flag: str
    option: str | None
    help: str
    kind: type = str  # str, int or bool (a bool flag is a switch)
    selects: int = 0


class Method:
    name: ClassVar[str] = ""
    Options: ClassVar[type] = None
    shortcuts: ClassVar[tuple[Shortcut, ...]] = ()
    reduction: ClassVar[str] = "mean"  # how the default loss reduces the weighted per-pair losses
    pays: ClassVar[str] = ""  # when it beats plain training, as measured (docs/methods.md); `--method-option help`

    def __init__(self, options):
        self.options = options

    def input_files(self) -> list[str]:
        """Files the method reads (a scores file ...): the run directory must not be one of them."""
        return []

    def setup(self, ctx: MethodContext) -> BatchPlan:
        return BatchPlan()

    def on_epoch_start(self, epoch: int, ctx: MethodContext) -> None:
        """Nothing to do between epochs for a fixed weighting."""

    def epoch_pairs(self) -> int | None:
        """After on_epoch_start: the pairs this epoch trains on when the method chose them for the epoch
        (the LR schedule is re-planned so it still ends with the run); None: as planned at setup."""
        return None

    def epoch_span(self) -> int | None:
        """With epoch_pairs: the pairs this epoch's steps should span when that is more than the pairs chosen
        (the trainer re-reads the chosen ones, each pass in a new order, until it has taken as many steps as
        one pass over `span` pairs); None: one pass over the chosen pairs."""
        return None

    def schedule(self, epochs: int) -> Keyed:
        """The method's epoch schedule (warm-up, phases) for a run of `epochs` epochs, as it will run;
        empty for a method without one. Shown by `pairclean train --method-option help`."""
        return {}

    def batch_weights(self, batch: dict, ctx: MethodContext) -> tuple[torch.Tensor | None, Keyed]:
        """(per-pair loss weights or None for unweighted, extra per-pair diagnostics columns)."""
        return None, {}

    def loss(self, batch: dict, emb: Embeddings, ctx: MethodContext) -> LossOutput:
        weights, extra = self.batch_weights(batch, ctx)
        loss, per_pair = weighted_infonce(emb.left, emb.right, emb.logit_scale, weights, reduction=self.reduction,
                                          all_left=emb.all_left, all_right=emb.all_right, offset=emb.offset)
        diag = {"loss": per_pair, **extra}
        metrics = {}
        if weights is not None:
            diag["weight"] = weights.detach().float()
            metrics["mean_weight"] = weights.detach().float().mean()
        return LossOutput(loss, diag, metrics)

    def after_backward(self, ctx: MethodContext) -> None:
        """Called after each backward of the main network's loss, before its optimiser step: a method
        whose loss also trains modules of its own (DiffNCL's denoisers) steps them here."""

    def on_epoch_end(self, epoch: int, ctx: MethodContext) -> JsonObject:
        return {}

    def state_dict(self) -> StateDict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """A fixed weighting has no state beyond its options."""

    def extra_networks(self) -> Keyed:
        """name -> target of networks trained beside the main one that are part of the result
        (exported per epoch as model-...-NAME, evaluated with the main one by averaged similarity)."""
        return {}

    def describe(self) -> JsonObject:
        return {"method": self.name, **dataclasses.asdict(self.options)}


METHODS: dict[str, type[Method]] = {}


def register_method(cls: type[Method]) -> type[Method]:
    METHODS[cls.name] = cls
    return cls


def build_method(name: str, options: dict | None = None) -> Method:
    """The registered method `name` with its options: text is read as each field's type
    (`config.parse_value`: numbers checked against their declarations, `config.setting` on each
    Options field), numbers given as numbers checked likewise; each Options checks what concerns
    several fields at once."""
    check_choice(name, sorted(METHODS), "method")
    cls = METHODS[name]
    fields = {f.name: f for f in dataclasses.fields(cls.Options)}
    options = dict(options or {})
    unknown = sorted(set(options) - set(fields))
    if unknown:
        known = ", ".join(fields) or "none"
        raise UserError(f"method {name} has no option(s) {', '.join(unknown)} (its options: {known})")
    declared = field_types(cls.Options)  # numbers with their declared bounds, checked here for every method
    values = {k: parse_value(v, declared[k], k) if isinstance(v, str) else
              check_value(v, declared[k].kind, declared[k].bounds, k, declared[k].optional)
              if declared[k].kind in (int, float) else v for k, v in options.items()}
    try:
        opts = cls.Options(**values)
    except TypeError as exc:
        raise UserError(f"method {name}: {exc}") from None
    return cls(opts)


def every_parameter(emb: Embeddings) -> torch.Tensor:
    """0, with every trained parameter in its graph (both towers, a learned logit scale): a step whose loss
    leaves some out (too few rows of a kind, a loss at the method's own temperature) still gives each a
    gradient, as DistributedDataParallel needs."""
    scale = emb.logit_scale if isinstance(emb.logit_scale, torch.Tensor) else 0.0
    return 0.0 * (emb.left.sum() + emb.right.sum() + scale)


def scaled_epoch(epochs: int, paper_epoch: int, paper_epochs: int) -> int:
    """An epoch count of a paper's schedule (`paper_epoch` of its `paper_epochs`) in a run of `epochs`,
    in the same proportion, rounded: the papers train 30-60 epochs from scratch, a fine-tune a few."""
    return int(math.floor(epochs * paper_epoch / paper_epochs + 0.5))


def too_short(name: str, schedule: dict, epochs: int, phases: dict) -> None:
    """A notice when a run of `epochs` ends before the method's training starts, or before some phase does."""
    warmup = schedule["warmup_epochs"]
    if warmup >= epochs:
        notice(f"{name}: warmup_epochs={warmup} covers the whole {epochs}-epoch run, so it trains as plain; set "
               f"warmup_epochs below epochs")
        return
    late = [f"{option}={schedule[option]} ({what})" for option, what in phases.items() if schedule[option] > epochs]
    if late:
        notice(f"{name}: the {epochs}-epoch run ends before {', '.join(late)} starts")
