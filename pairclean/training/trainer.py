"""The training loop: weighted symmetric InfoNCE, AdamW, warm-up + cosine, clipping, autocast,
a checkpoint per epoch plus the best by validation rSum, exact resume, JSONL metrics, progress reports.

Order of an epoch's end (state.pt last, it is the commit point of the epoch): validation ->
model-epoch-NNN (+ model-best) -> diagnostics -> metrics line -> state.pt. A run killed anywhere
resumes from the last state.pt and redoes the epoch after it with the same batches (the data
order depends only on seed and epoch) and the same RNG streams, so it ends with the same weights.
"""

from __future__ import annotations

import itertools
import math
from contextlib import closing
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from pairclean.ops.guard import Output, open_output
from pairclean.ops.records import JsonObject, Keyed
from pairclean.runs import settings_changes
from pairclean.config import (COUNT, SEED, SHARE, above, at_least, check_settings, pinned_settings, setting,
                              unpinned)
from pairclean.ops import distributed
from pairclean.ops.notices import notice
from pairclean.ops.progress import SILENT, Progress
from pairclean.ops.worker_memory import steady_worker_memory
from pairclean.ops.atomic import write_json
from pairclean.config import check_choice, check_pretrained
from pairclean.errors import ConfigError, UserError
from pairclean.backends import load_target
from pairclean.backends.base import PRECISIONS, autocast_context
from pairclean.backends.device_jpeg import auto_workers, check_decode, pinned_decoding
from pairclean.backends.feed import DeviceFeed, DevicePrefetcher, HostCopies, device_tensors
from pairclean.backends.inputs import DeviceImages
from pairclean.backends.oom import take_rows
from pairclean.data.dataset import Dataset, as_dataset
from pairclean.data.spec import DatasetSpec, modalities
from pairclean.training.retrieval import JointTarget, evaluate_target
from pairclean.training.checkpoint import (BEST, RUN_FILE, STATE_FILE, epoch_model_name, is_training_run, load_state,
                                        model_path, read_run, save_state, set_rng_state)
from pairclean.training.data import TrainBatches, index_shards, unit_spans
from pairclean.training.methods import Embeddings, MethodContext, build_method
from pairclean.training.logs import DiagnosticsWriter, MetricsLog



@dataclass
class TrainConfig:
    model: str = "ViT-B-32"  # open_clip name (or pairclean tiny config), or a sentence-transformers dir/name
    pretrained: str | None = None  # open_clip: tag, checkpoint path, or "none" (random init); None: the model's own
    backend: str = "auto"  # auto | open_clip | sentence-transformers
    device: str = unpinned("auto")
    precision: str = "fp32"  # fp32 | bf16 (autocast) | fp16 (CUDA, with a grad scaler)
    # fast | exact (PIL in the workers) | gpu, nvimgcodec, dali: the training loop's JPEGs decoded on the
    # CUDA device (the workers' PIL elsewhere); pinned by `_settings` where it is not fast
    decode: str = unpinned("fast")
    epochs: int = setting(5, COUNT)
    batch_size: int = setting(256, at_least(2))  # in-batch negatives need two pairs
    lr: float = setting(5e-6, above(0))
    weight_decay: float = setting(0.2, at_least(0))
    warmup_steps: int = setting(500, at_least(0))
    min_lr_ratio: float = setting(0.0, SHARE)  # the cosine ends at lr * min_lr_ratio
    grad_clip: float | None = setting(1.0, above(0))  # max gradient norm; None disables
    temperature: float | None = setting(None, above(0))  # None: open_clip learns it, sentence-transformers uses 0.05
    method: str = "plain"
    method_options: dict = field(default_factory=dict)
    workers: int | None = setting(None, at_least(0))  # None: auto (a resumed run: the number it began with)
    shuffle_buffer: int = setting(1000, at_least(0))
    val_batch_size: int = setting(256, COUNT, pinned=False)
    log_every: int = setting(10, COUNT)
    diagnostics: bool = True
    seed: int = setting(0, SEED)
    resume: bool = unpinned(False)
    overwrite: bool = unpinned(False)
    progress: Progress = unpinned(SILENT)

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        check_settings(self)
        check_pretrained(self.pretrained)
        check_choice(self.precision, PRECISIONS, "precision")
        check_decode(self.decode)


@dataclass
class TrainResult:
    run_dir: Path
    epochs: list[dict]  # the epoch records of metrics.jsonl
    best_epoch: int | None
    best_rsum: float | None
    best_model: Path | None
    last_model: Path
    resumed_from: int  # epochs already done when this call started
    seconds: float


WARMUP_SHARE = 0.2  # the longest warm-up a run gets, as a share of its steps


def bounded_warmup(warmup: int, total: int) -> int:
    """The warm-up a run of `total` steps gets: `warmup`, but at most a fifth of the run (at least
    one step where one was asked for), so that the peak lr is reached and most steps are near it."""
    return min(warmup, max(1, int(total * WARMUP_SHARE)))


def epoch_steps(reader_pairs: list[list[float]], local_batch: int, across_ranks: bool) -> int:
    """The steps `_Loop._batches` takes from readers holding these pairs (`TrainBatches.reader_pairs`):
    every reader's full batches and, in one process, its last partial one when it has 2 pairs or more
    (a lone pair has no negatives); under torch.distributed only full batches, as many as the rank
    with the fewest has."""
    def batches(pairs: float) -> int:
        n = round(pairs)
        return n // local_batch + (not across_ranks and n % local_batch >= 2)

    return min(sum(batches(pairs) for pairs in rank) for rank in reader_pairs)


def warmup_notice(cfg: TrainConfig, total: int, warmup: int) -> str:
    """Why the warm-up was shortened: the one the settings asked for would keep the run from learning."""
    steps = f"{total:,} step{'s' if total != 1 else ''}"
    if cfg.warmup_steps >= total:
        why = f"is longer than this run ({steps}), so lr {cfg.lr:g} would never be reached"
    else:
        why = f"is more than a fifth of this run ({steps})"
    return (f"warmup_steps {cfg.warmup_steps:,} {why}: warming up over {warmup:,} step{'s' if warmup != 1 else ''} "
            "instead")


def cosine_lr(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine down to min_ratio at `total` steps (flat after)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """open_clip's split: no weight decay on gains, biases, norms and the logit scale."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        exclude = p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name
        (no_decay if exclude else decay).append(p)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


def _prepare_run_dir(out: Path, cfg: TrainConfig) -> bool:
    """Create or check RUN_DIR; True when a saved state will be resumed. Only a training run's
    directory is ever removed (`overwrite`): a directory holding any other run.json (a scoring
    run's parts) or other files is refused."""
    if out.exists() and any(out.iterdir()) and not is_training_run(out):
        raise UserError(f"{out} exists, is not empty and holds no pairclean training run: choose another run directory")
    if (out / STATE_FILE).is_file() and cfg.resume and not cfg.overwrite:
        return True
    if out.exists() and any(out.iterdir()):
        if not (cfg.overwrite or cfg.resume):
            raise ConfigError(f"{out} holds a run: set resume to continue it or overwrite to start over", "resume",
                              "overwrite")
        shutil.rmtree(out)  # overwrite, or resume of a run that never finished an epoch
    out.mkdir(parents=True, exist_ok=True)
    return False


def _settings(cfg: TrainConfig, spec: DatasetSpec, val: DatasetSpec | None) -> JsonObject:
    # How the loop's images are decoded: `decode` where not fast (every earlier pairclean's), and how the
    # workers resize or which device decoder decodes (`pinned_decoding`)
    decoding = {}
    if "image" in modalities(spec.pair):
        decoding = {**({"decode": cfg.decode} if cfg.decode != "fast" else {}),
                    **pinned_decoding(cfg.decode, distributed.default_device_for_rank(cfg.device))}
    return {**pinned_settings(cfg), "pair": spec.pair, "train_shards": spec.shards, "fields": asdict(spec.fields),
            "val_shards": val.shards if val else None, **decoding}


def train(source: str | list[str] | DatasetSpec | Dataset, out: str | Path | Output, config: TrainConfig | None = None,
          val: str | list[str] | DatasetSpec | Dataset | None = None, pair: str | None = None) -> TrainResult:
    """Train `config.model` on `source` into the run directory `out`; see the package docstring."""
    cfg = config or TrainConfig()
    cfg.check()
    distributed.init_from_env()
    world = distributed.world_size()
    if cfg.batch_size % world:
        raise ConfigError(f"batch_size {cfg.batch_size} (the global batch) must be a multiple of the {world} ranks",
                          "batch_size")
    data = as_dataset(source, pair=pair)
    spec = data.spec
    val_data = as_dataset(val, pair=pair or spec.pair) if val is not None else None
    val_spec = val_data.spec if val_data is not None else None
    method = build_method(cfg.method, cfg.method_options)
    pretrained = [cfg.pretrained] if cfg.pretrained and os.path.isfile(cfg.pretrained) else []
    out = open_output(out, [*spec.shards, *(val_spec.shards if val_spec else []), *method.input_files(), *pretrained],
                      "out", kind="directory", overwrite=None, parents=True).path
    resuming = distributed.on_main(lambda: _prepare_run_dir(out, cfg))  # rank 0 owns the run directory
    if cfg.workers is None:  # auto: the data order depends on it, so a resumed run reads as it began
        began = read_run(out).get("settings", {}).get("workers") if resuming else None
        cfg = replace(cfg, workers=began if began is not None else auto_workers(cfg.device, cfg.decode))
    settings = _settings(cfg, spec, val_spec)
    state = None
    if resuming:
        earlier = read_run(out).get("settings", {})
        differ = settings_changes(earlier, settings)  # the resumable run's one comparison (runs.store)
        if differ:
            shown = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in differ[:4])
            raise ConfigError(f"{out} was trained with different settings ({shown}); resume with the same settings "
                              "or set overwrite", "overwrite")
        state = load_state(out)
        method.load_state_dict(state["method"])  # before setup: e.g. online OSA keeps its beta

    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)
    left_mod, right_mod = modalities(spec.pair)
    if distributed.is_main():  # a large model takes a while to load, longer on a CPU
        cfg.progress.note(f"loading {cfg.model} to train ...")
    target = load_target(cfg.model, cfg.pretrained, backend=cfg.backend, needed=(left_mod, right_mod),
                         device=distributed.default_device_for_rank(cfg.device), temperature=cfg.temperature,
                         decode=cfg.decode)
    autocast_context(target.device, cfg.precision)  # refuses fp16 without CUDA before any work
    shards = index_shards(data)
    ctx = MethodContext(dataset=data, shards=shards, target=target, run_dir=out, seed=cfg.seed, left=left_mod,
                        right=right_mod, config=cfg)
    plan = method.setup(ctx)  # before the saved weights are loaded: a frozen estimator copies the initial model
    pairs = plan.pairs if plan.pairs is not None else sum(s.rows for s in shards)
    # Each rank reads its own shards (split_by_node) in batches of batch_size / world.
    dataset = TrainBatches(data, getattr(target, "loop_preparer", target.preparer), cfg.batch_size // world, cfg.seed,
                           cfg.shuffle_buffer, plan)
    workers = min(cfg.workers, len(dataset.units))
    spans = unit_spans(data, dataset.units, shards)

    def steps_in(epoch: int, kept: dict) -> int:
        return epoch_steps(dataset.reader_pairs(epoch, kept, workers, world), cfg.batch_size // world,
                           distributed.is_distributed())

    kept = dataset.kept_pairs(spans)
    planned = [steps_in(epoch, kept) for epoch in range(1, cfg.epochs + 1)]
    loop = _Loop(cfg, target, method, ctx, out, sum(planned))
    ctx.new_optimizer, ctx.current_step = loop.new_optimizer, lambda: loop.step
    if state is not None:
        loop.restore(state)
    else:
        loop.metrics.reset()
    resumed_from = loop.done_epochs
    if distributed.is_main():
        write_json(out / RUN_FILE, {"settings": settings, "world_size": world, "target": target.describe(),
                                    "method": method.describe(), "extra_networks": sorted(method.extra_networks()),
                                    "train": {"shards": len(shards), "pairs": sum(s.rows for s in shards),
                                              "pairs_trained_per_epoch": pairs, "steps_per_epoch": planned,
                                              "schedule_steps": loop.total_steps, "warmup_steps": loop.warmup,
                                              "unreadable_shards": [f"{s.shard}: {s.failure}" for s in shards if s.failure]}})
    started = time.perf_counter()
    progress = cfg.progress if distributed.is_main() else SILENT
    for epoch in range(loop.done_epochs + 1, cfg.epochs + 1):
        dataset.set_epoch(epoch)
        method.on_epoch_start(epoch, ctx)  # may rewrite the weight arrays this epoch reads (its bar counts them)

        def loader(repeat: int = 0, epoch: int = epoch) -> DataLoader:
            """The epoch's pass over its pairs; repeat > 0: a further pass, in an order of its own."""
            dataset.set_epoch(epoch, repeat)
            return DataLoader(dataset, batch_size=None, num_workers=workers,
                              pin_memory=target.device.type == "cuda", worker_init_fn=steady_worker_memory,
                              generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
        chosen = method.epoch_pairs()  # a method that picks this epoch's pairs re-plans the schedule to them
        span = method.epoch_span() if chosen is not None else None  # ... and may ask them to fill a longer epoch
        steps = loop.replan(epoch, span or chosen) if chosen is not None else steps_in(epoch, dataset.kept_pairs(spans))
        with progress.task(f"epoch {epoch}", total=steps, loss=0.0, lr=0.0, rate=0.0) as task:
            record = loop.run_epoch(epoch, _Passes(loader, steps if span else None), task)
        if val_data is not None and distributed.is_main():
            progress.note(f"epoch {epoch}: retrieval on the validation pairs (R@1/5/10 both ways) ...")
            val_metrics = evaluate_target(JointTarget([target, *method.extra_networks().values()]), val_data,
                                          cfg.val_batch_size, workers, autocast_context(target.device, cfg.precision))
            record.update({f"val_{k}": v for k, v in val_metrics.to_json().items()})
        loop.finish_epoch(epoch, record)
        distributed.barrier()  # the other ranks wait for rank 0's validation and checkpoints
    best_model = model_path(out, BEST, target.backend) if loop.best_epoch is not None else None
    return TrainResult(out, loop.history, loop.best_epoch, loop.best_rsum, best_model,
                       model_path(out, epoch_model_name(cfg.epochs), target.backend), resumed_from,
                       time.perf_counter() - started)


class _Passes:
    """An epoch's batches: one pass of the loader, or, with `steps`, as many passes (each in an order of its
    own) as the loop needs to take `steps` steps: a method's chosen pairs re-read to fill an epoch as long as a
    pass over more pairs (`Method.epoch_span`). Stops when a pass has no batch of two pairs."""

    def __init__(self, loader, steps: int | None = None):
        self.loader, self.steps = loader, steps

    def __iter__(self):
        repeat = 0
        while True:
            usable = False
            for batch in self.loader(repeat):
                usable = usable or len(batch["key"]) >= 2
                yield batch
            if self.steps is None or not usable:
                return
            repeat += 1


class _Towers(torch.nn.Module):
    """Both towers in one forward, so that DistributedDataParallel sees every step."""

    def __init__(self, target, left: str, right: str):
        super().__init__()
        self.target, self.left, self.right = target, left, right
        self.model = target.module  # registered: DDP syncs its gradients

    def forward(self, left_batch, right_batch):
        return self.target.encode(self.left, left_batch), self.target.encode(self.right, right_batch)


# A batch's values the feed moves to the device: both sides' inputs, an extra preparer's
# (`estimator_left`), and the pairs' loss weights (copied with the inputs, not when the loss needs them).
FED = ("left", "right", "weight")


@dataclass
class _Settled:
    """What a step leaves to be read once the next one is queued (`_Loop._settle`): its values
    on their way to the host (`results`: the loss, the logit scale, tensor metrics as `metric:NAME`
    and, when diagnostics are written, the per-pair columns as `pair:NAME`)."""

    out: object  # the method's StepOutput
    batch: dict
    lr: float
    step: int
    results: HostCopies


class _Loop:
    """The optimisation state of a run and what one epoch does with it."""

    def __init__(self, cfg: TrainConfig, target, method, ctx: MethodContext, out: Path, total_steps: int):
        self.cfg, self.target, self.method, self.ctx, self.out = cfg, target, method, ctx, out
        self.total_steps = max(total_steps, 1)
        self.warmup = bounded_warmup(cfg.warmup_steps, self.total_steps)
        if self.warmup < cfg.warmup_steps and distributed.is_main():
            notice(warmup_notice(cfg, self.total_steps, self.warmup), "warmup_steps", "lr")
        self.optimizer, self.scheduler = self.new_optimizer(target.module)
        self.scaler = torch.amp.GradScaler(target.device.type, enabled=cfg.precision == "fp16")
        self.metrics = MetricsLog(out / "metrics.jsonl")
        self.done_epochs, self.step, self.best_rsum, self.best_epoch, self.history = 0, 0, None, None, []
        self.diag: DiagnosticsWriter | None = None
        self.towers = _Towers(target, ctx.left, ctx.right)
        self.feed = DeviceFeed(target.device)  # batch i+1's copies to the device overlap step i
        if distributed.is_distributed():
            from torch.nn.parallel import DistributedDataParallel

            self.towers = DistributedDataParallel(
                self.towers, device_ids=[target.device.index] if target.device.type == "cuda" else None)

    def new_optimizer(self, module: torch.nn.Module, start_step: int = 0):
        """AdamW and the warm-up + cosine schedule of this run for `module`, the schedule at `start_step`."""
        cfg = self.cfg
        optimizer = torch.optim.AdamW(param_groups(module, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-6)
        scheduler = torch.optim.lr_scheduler.LambdaLR(  # reads the schedule when it steps: a resume or a re-plan reaches it
            optimizer, lambda step: cosine_lr(step + start_step, self.warmup, self.total_steps, cfg.min_lr_ratio))
        return optimizer, scheduler

    def replan(self, epoch: int, pairs: int) -> int:
        """The method trains `pairs` pairs this epoch (and, as far as anyone knows, in each later one): the
        schedule's end moves so the cosine still ends with the run. Deterministic, so a resumed run re-plans alike. Returns the epoch's steps."""
        steps = max(math.ceil(pairs / self.cfg.batch_size), 1)
        self.total_steps = self.step + steps * (self.cfg.epochs - epoch + 1)
        self.warmup = bounded_warmup(self.cfg.warmup_steps, self.total_steps)
        return steps

    def restore(self, state: dict) -> None:
        # The schedule the run started with (a method that rewrites its weight arrays changes the count since).
        self.total_steps = state.get("total_steps", self.total_steps)
        self.warmup = bounded_warmup(self.cfg.warmup_steps, self.total_steps)
        self.target.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.done_epochs, self.step = state["epoch"], state["step"]
        self.best_rsum, self.best_epoch, self.history = state["best_rsum"], state["best_epoch"], state["history"]
        set_rng_state(state["rng"])
        self.metrics.resume(self.done_epochs)

    def _encode(self, left_batch, right_batch, across_ranks: bool) -> Embeddings:
        left, right = self.towers(left_batch, right_batch)
        emb = Embeddings(left, right, self.target.logit_scale())
        if across_ranks and distributed.is_distributed():  # negatives from every rank's rows
            emb.all_left, emb.all_right = distributed.gather_with_grad(left), distributed.gather_with_grad(right)
            emb.offset = distributed.rank() * left.shape[0]
        return emb

    def _optimise(self, loss: torch.Tensor) -> None:
        cfg = self.cfg
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.method.after_backward(self.ctx)
        if cfg.grad_clip is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.target.module.parameters(), cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def _step(self, batch: dict):
        """The method's loss on the batch, then its follow-up steps; the schedule advances once."""
        precision, device = self.cfg.precision, self.target.device
        with autocast_context(device, precision):
            out = self.method.loss(batch, self._encode(batch["left"], batch["right"], across_ranks=True), self.ctx)
        self._optimise(out.loss)
        for follow in out.follow_ups:
            with autocast_context(device, precision):
                loss = follow.loss(self._encode(follow.left, follow.right, across_ranks=False))
            self._optimise(loss)
        self.scheduler.step()
        self.step += 1
        return out

    def _batches(self, loader: _Passes, totals: dict, failures: list):
        """The epoch's usable batches (at most `loader.steps`). Under torch.distributed every rank takes a
        step only while every rank has a full local batch (DDP needs the same steps everywhere); a rank's
        partial batches are left out and counted as dropped."""
        full = self.cfg.batch_size // distributed.world_size()

        def usable(n: int) -> bool:  # a lone pair has no negatives
            return n >= 2 and (n == full or not distributed.is_distributed())

        def prepare(batch: Keyed) -> tuple[Keyed, int]:
            return self._on_device(batch) if usable(len(batch["key"])) else (batch, 0)

        # Where a device decoder finishes the images on CUDA, batch i+1 goes to the device and is decoded
        # there in a thread of its own (nvJPEG's decode blocks the thread that calls it) while the main
        # thread queues step i, as scoring's batches are; otherwise in order, its copies on the feed's stream.
        decoder = getattr(getattr(self.target, "estimator", None), "device_decoder", None)
        prepared = DevicePrefetcher(loader, prepare, self.target.device, held=lambda item: device_tensors(item[0]),
                                    threaded=self.target.device.type == "cuda" and decoder is not None)
        with closing(iter(prepared)) as it:
            for _ in (range(loader.steps) if loader.steps is not None else itertools.count()):
                batch = None
                for batch, errors in it:
                    left_out = batch["stats"]
                    totals["errors"] += left_out.errors + errors
                    totals["dropped"] += left_out.dropped
                    failures.extend(left_out.failures)
                    if usable(len(batch["key"])):
                        break
                    if distributed.is_distributed():
                        totals["dropped"] += len(batch["key"])
                    batch = None
                if not distributed.all_reduce_min(batch is not None):
                    return
                yield batch

    def _on_device(self, batch: Keyed) -> tuple[Keyed, int]:
        """The batch's inputs on the device, copied on the feed's side stream; JPEGs the loader left
        for the device (`decode` gpu ...) decoded there too, overlapping the step before; the rows
        that failed there. A row neither the device nor PIL can decode leaves the batch, counted as
        an error."""
        batch = {k: self.feed(v) if k.endswith(FED) else v for k, v in batch.items()}
        failed: dict[int, str] = {}
        for side, modality in (("left", self.ctx.left), ("right", self.ctx.right)):
            if isinstance(batch[side], DeviceImages):
                batch[side], bad = self.feed.run(self.target.estimator.finish_batch, modality, batch[side])
                failed.update(bad)
        if failed:
            keep = [row for row in range(len(batch["key"])) if row not in failed]
            batch = {k: v if k == "stats" else take_rows(v, keep) for k, v in batch.items()}
        return batch, len(failed)

    def _results(self, out) -> HostCopies:
        """What `_settle` reads of a step, copied to the host as soon as the step is queued."""
        tensors = {"loss": out.loss, "logit_scale": self.target.logit_scale(),
                   **{f"metric:{k}": v for k, v in out.metrics.items() if isinstance(v, torch.Tensor)}}
        if self.diag is not None:
            tensors.update({f"pair:{k}": v for k, v in out.per_pair.items()})
        return HostCopies(tensors)

    def _settle(self, done: "_Settled", epoch: int, totals: dict, task, epoch_start: float) -> None:
        """A step's loss, diagnostics, log line and progress, read one step late, once its values
        have reached the host: reading a device value (`float(loss)`) would wait for every step
        queued, the one after it too, and the device would idle while the host fetched the next batch."""
        results = done.results.wait()
        loss, n = distributed.all_reduce_mean(float(results["loss"].float().numpy())), len(done.batch["key"])
        if not math.isfinite(loss):  # every rank sees the same mean: all stop, none saves a checkpoint
            raise ConfigError(f"the training loss became {loss} at step {done.step}: stopped before saving a "
                              "checkpoint (check the loss weights, or lower lr)", "lr")
        totals["loss_sum"] += loss * n
        totals["pairs"] += n
        totals["steps"] += 1
        batch = done.batch
        if self.diag is not None:
            self.diag.add({"key": batch["key"], "shard": batch["shard"], "index": batch["index"].numpy(),
                           "epoch": [epoch] * n, **{name.removeprefix("pair:"): v.float().numpy()
                                                    for name, v in results.items() if name.startswith("pair:")}})
        if done.step % self.cfg.log_every == 0 and distributed.is_main():
            # host values as float32 first: numpy has no bfloat16 (a method's metric computed under autocast)
            metrics = {k: results[f"metric:{k}"].float().numpy().item() if isinstance(v, torch.Tensor) else v
                       for k, v in done.out.metrics.items()}
            self.metrics.write({"event": "step", "epoch": epoch, "step": done.step, "loss": loss, "lr": done.lr,
                                "logit_scale": float(results["logit_scale"].float().numpy()), **metrics})
        elapsed = time.perf_counter() - epoch_start
        task.update(advance=1, loss=loss, lr=done.lr, rate=totals["pairs"] / elapsed if elapsed else 0.0)

    def run_epoch(self, epoch: int, loader: _Passes, task) -> JsonObject:
        """One pass over the training data; returns the epoch's metrics record so far."""
        cfg = self.cfg
        if cfg.diagnostics:
            rank = f"-rank{distributed.rank()}" if distributed.is_distributed() else ""
            self.diag = DiagnosticsWriter(self.out / "diagnostics" / f"epoch-{epoch:03d}{rank}.parquet")
        totals = {"loss_sum": 0.0, "pairs": 0, "steps": 0, "errors": 0, "dropped": 0, "compute_s": 0.0, "data_s": 0.0}
        failures: list[str] = []
        epoch_start = ready = time.perf_counter()
        pending, first_batch = None, None
        for batch in self._batches(loader, totals, failures):
            began = time.perf_counter()
            totals["data_s"] += began - ready
            if first_batch is None:  # the loader's start: its workers forked, each one's first batch prepared
                first_batch = began - epoch_start
            lr = self.optimizer.param_groups[0]["lr"]  # this step's (the schedule moves on after it)
            out = self._step(batch)
            if pending is not None:  # the step before's figures: the device is on this step already
                self._settle(pending, epoch, totals, task, epoch_start)
            pending = _Settled(out, batch, lr, self.step, self._results(out))
            ready = time.perf_counter()
            totals["compute_s"] += ready - began
        if pending is not None:
            self._settle(pending, epoch, totals, task, epoch_start)
        if totals["steps"] == 0:
            if self.diag is not None:
                self.diag.abort()
            first = f"; first failure: {failures[0]}" if failures else ""
            raise UserError(f"epoch {epoch} had no batch of at least 2 usable pairs (errors: {totals['errors']}, "
                            f"dropped: {totals['dropped']}, failed shards: {len(failures)}){first}")
        seconds = time.perf_counter() - epoch_start
        record = {"event": "epoch", "epoch": epoch, "step": self.step,
                  "train_loss": totals["loss_sum"] / totals["pairs"], "pairs": totals["pairs"],
                  "steps": totals["steps"], "skipped_errors": totals["errors"], "dropped": totals["dropped"],
                  "failed_shards": failures, "seconds": seconds,
                  "compute_seconds_per_step": totals["compute_s"] / totals["steps"],
                  "data_seconds_per_step": totals["data_s"] / totals["steps"], "first_batch_seconds": first_batch,
                  "pairs_per_second": totals["pairs"] / seconds}
        record.update(self.method.on_epoch_end(epoch, self.ctx))
        return record

    def finish_epoch(self, epoch: int, record: dict) -> None:
        """Models, diagnostics, the metrics line, then state.pt: the epoch's commit point
        (written by rank 0 alone under torch.distributed)."""
        target = self.target
        if self.diag is not None:
            self.diag.close()
            self.diag = None
        if not distributed.is_main():
            self.history.append(record)
            self.done_epochs = epoch
            return
        networks = {"": target, **{f"-{name}": net for name, net in self.method.extra_networks().items()}}
        for suffix, net in networks.items():
            net.export(model_path(self.out, epoch_model_name(epoch) + suffix, target.backend))
        rsum = record.get("val_rsum")
        if rsum is not None and (self.best_rsum is None or rsum > self.best_rsum):
            self.best_rsum, self.best_epoch = rsum, epoch
            for suffix, net in networks.items():
                net.export(model_path(self.out, BEST + suffix, target.backend))
        record.update({"best_epoch": self.best_epoch, "best_rsum": self.best_rsum})
        self.history.append(record)
        self.metrics.write(record)
        save_state(self.out, {"model": target.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                              "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                              "method": self.method.state_dict(), "epoch": epoch, "step": self.step,
                              "total_steps": self.total_steps,
                              "best_rsum": self.best_rsum, "best_epoch": self.best_epoch, "history": self.history})
        self.done_epochs = epoch
