"""Pieces the robust-training methods (SDD, GSC, SPS, DiffNCL) share, written once.

* `PairIndex`: one global id per training pair (shard offset + index), so per-pair state
  (labels, weights, memory banks) lives in flat arrays that resume saves and restores.
* `pair_pass`: a no-grad pass over the whole training set with a model in eval mode, each rank
  reading its own units (webdataset's split_by_node), the per-pair columns gathered to every rank.
* `gather_pairs`: per-pair values collected during an epoch on each rank, merged on every rank.
* `write_pair_table`: RUN_DIR/diagnostics/pairs-epoch-NNN.parquet, one row per pair (shard,
  index, epoch, the method's columns), joinable with `pairclean corrupt`'s truth on (shard, index).
* `EpochWeights`: per-shard weight arrays the data workers read (`data.DROPPED` leaves a
  pair out of the epoch altogether), rewritten between epochs for per-epoch selection.
* `Network`: a second dual encoder a method trains itself (a peer, a siamese copy) with the
  trainer's optimiser settings; `NetworkBatches`: that network's own data order; `Peer`: the two
  together, the co-trained second network of SPS, DiffNCL and two-network GSC.
* `OwnModule`: a small module a method trains beside a network (DiffNCL's denoisers), stepped
  on gradients another backward left in it.

GMMs over per-pair values: `pairclean.core.mixture.clean_posterior`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from pairclean.backends import load_target
from pairclean.backends.base import autocast_context
from pairclean.data.spec import UnitFailure
from pairclean.errors import ConfigError, UserError
from pairclean.ops import distributed
from pairclean.ops.atomic import atomic_path
from pairclean.ops.records import Keyed, StateDict
from pairclean.ops.worker_memory import steady_worker_memory
from pairclean.training.data import DROPPED, BatchPlan, ShardInfo, TrainBatches
from pairclean.training.logs import DiagnosticsWriter
from pairclean.training.methods.base import Embeddings

PAIR_TABLE = "pairs-epoch-{epoch:03d}.parquet"
PEER_SEED_OFFSET = 1  # a peer's initialisation and data order: seed + 1
METHOD_WEIGHTS_DIR = "method-weights"


class PairIndex:
    """Global pair ids in the order of the training shards: id = shard offset + index in the shard."""

    def __init__(self, shards: list[ShardInfo]):
        self.shards = [s.shard for s in shards]
        self.offsets = np.cumsum([0] + [s.rows for s in shards])
        self.start = {s: int(o) for s, o in zip(self.shards, self.offsets[:-1])}
        self.size = int(self.offsets[-1])

    def ids(self, shards: list[str], index) -> np.ndarray:
        index = index.numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
        return np.array([self.start[s] for s in shards], dtype=np.int64) + index.astype(np.int64)

    def locate(self, ids: np.ndarray) -> tuple[list[str], np.ndarray]:
        """(shard, index) of each id."""
        pos = np.searchsorted(self.offsets, ids, side="right") - 1
        return [self.shards[p] for p in pos], ids - self.offsets[pos]


@dataclass
class PairColumns:
    """Per-pair values over the training set; `seen[i]` is False for pairs nobody read (unreadable)."""

    seen: np.ndarray
    columns: dict[str, np.ndarray]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]


def gather_pairs(size: int, ids: np.ndarray, columns: dict[str, np.ndarray]) -> PairColumns:
    """Every rank's (ids, columns) merged into full arrays on every rank (NaN where unseen)."""
    parts = distributed.gather_objects((ids, columns))
    seen = np.zeros(size, dtype=bool)
    full: dict[str, np.ndarray] = {}
    for part_ids, part in parts:
        seen[part_ids] = True
        for name, values in part.items():
            if name not in full:
                full[name] = np.full((size, *values.shape[1:]), np.nan, dtype=np.float32)
            full[name][part_ids] = values
    return PairColumns(seen, full)


def _cat(chunks: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)


@torch.no_grad()
def pair_pass(ctx, target, columns: Callable[[dict, torch.Tensor, torch.Tensor], dict[str, torch.Tensor]],
              index: PairIndex) -> PairColumns:
    """`columns(batch, left_emb, right_emb)` for every training pair, the model in eval mode.

    Batches are the training batch size in file order (a per-pair loss over in-batch negatives
    sees the same batches every epoch); the DataLoader has its own generator, so the pass leaves
    the global RNG streams, and with them exact resume, untouched."""
    cfg = ctx.config
    dataset = TrainBatches(ctx.dataset, target.preparer, cfg.batch_size // distributed.world_size(), ctx.seed,
                           shuffle=False, plan=BatchPlan())
    loader = DataLoader(dataset, batch_size=None, num_workers=min(cfg.workers, len(dataset.units)),
                        generator=torch.Generator().manual_seed(0))
    ids, values = [], {}
    was_training = target.module.training
    target.module.eval()
    try:
        for batch in loader:
            if not batch["key"]:
                continue
            with autocast_context(target.device, cfg.precision):
                left = target.encode(ctx.left, batch["left"])
                right = target.encode(ctx.right, batch["right"])
                out = columns(batch, left, right)
            ids.append(index.ids(batch["shard"], batch["index"]))
            for name, v in out.items():
                values.setdefault(name, []).append(v.detach().float().cpu().numpy())
    finally:
        target.module.train(was_training)
    return gather_pairs(index.size, _cat(ids).astype(np.int64), {k: _cat(v) for k, v in values.items()})


def pair_similarity(batch: dict, left: torch.Tensor, right: torch.Tensor) -> Keyed[str, torch.Tensor]:
    """The cosine of each pair (embeddings are L2-normalised)."""
    return {"sim": (left * right).sum(-1)}


def pair_embeddings(batch: dict, left: torch.Tensor, right: torch.Tensor) -> Keyed[str, torch.Tensor]:
    return {"left": left, "right": right, "sim": (left * right).sum(-1)}


def gather_batch_ids(ids: torch.Tensor) -> torch.Tensor:
    """The global ids of every rank's rows of this step, in rank order (the rows of `Embeddings.all_left`)."""
    if not distributed.is_distributed():
        return ids
    parts = [torch.empty_like(ids) for _ in range(distributed.world_size())]
    dist.all_gather(parts, ids)
    return torch.cat(parts)


def write_pair_table(ctx, epoch: int, index: PairIndex, seen: np.ndarray, columns: dict[str, np.ndarray]) -> Path | None:
    """RUN_DIR/diagnostics/pairs-epoch-NNN.parquet (rank 0): one row per seen pair with the
    method's per-pair columns (arrays over all pair ids: numbers, or strings such as a partition)."""
    if not distributed.is_main() or not ctx.config.diagnostics:
        return None
    ids = np.flatnonzero(seen)
    shards, positions = index.locate(ids)
    writer = DiagnosticsWriter(Path(ctx.run_dir) / "diagnostics" / PAIR_TABLE.format(epoch=epoch))
    writer.add({"shard": shards, "index": positions, "epoch": np.full(len(ids), epoch, dtype=np.int64),
                **{name: values[ids] for name, values in columns.items()}})
    return writer.close()


class EpochWeights:
    """Per-shard float32 weight arrays under RUN_DIR/method-weights[/NAME] that the data workers read
    (`data.DROPPED` = the pair is not read this epoch). Workers map a shard's array when they
    open the shard and every epoch starts new workers, so rewriting the arrays between epochs
    changes what the next epoch reads: per-epoch selection without a second data path. A named
    set selects the pairs of one loader (a method that loops over subsets keeps one per subset)."""

    def __init__(self, ctx, index: PairIndex, name: str = ""):
        self.index, self.directory = index, Path(ctx.run_dir) / METHOD_WEIGHTS_DIR / name
        self.files = {shard: f"shard-{i:06d}.npy" for i, shard in enumerate(index.shards)}

    def plan(self, pairs: int | None = None) -> BatchPlan:
        return BatchPlan(weights_dir=str(self.directory), shard_files=self.files, pairs=pairs)

    def select(self, keep: np.ndarray) -> None:
        """Read exactly the pairs where `keep` is true (weight 1)."""
        self.write(np.where(keep, 1.0, DROPPED))

    def write(self, weights: np.ndarray) -> None:
        """Rank 0 writes every shard's array; the other ranks wait for it."""
        def write() -> None:
            self.directory.mkdir(parents=True, exist_ok=True)
            for shard, start, end in zip(self.index.shards, self.index.offsets[:-1], self.index.offsets[1:]):
                with atomic_path(self.directory / self.files[shard]) as tmp, open(tmp, "wb") as fh:
                    np.save(fh, weights[start:end].astype(np.float32))

        distributed.on_main(write)


def read_pairs(dataset, wanted: set[int], index: PairIndex) -> Keyed[int, object]:
    """The raw pairs (RawPair) with these global ids, read once in file order (for a memory bank)."""
    found = {}
    for unit in dataset.units():
        for item in dataset.read(unit):
            if isinstance(item, UnitFailure) or item.error is not None:
                continue
            pid = int(index.ids([item.shard], [item.index])[0])
            if pid in wanted:
                found[pid] = item
    return found


def embedding_dim(target) -> int:
    """The width of a target's embeddings, for modules a method builds on them before any forward."""
    module = target.module
    if hasattr(module, "get_sentence_embedding_dimension"):  # a sentence-transformers model, either version
        from pairclean.backends.sentence_transformers import embedding_width
        return embedding_width(module)
    return int(module.visual.output_dim)


def replica(target):
    """A trainable copy of a target (same preprocessing, its own weights)."""
    twin = copy.copy(target)
    twin.module = copy.deepcopy(target.module).train()
    return twin


def apply_gradients(module: torch.nn.Module, optimizer, scheduler, grad_clip: float | None) -> None:
    """Average the gradients across ranks by hand (the module is not wrapped in
    DistributedDataParallel), clip them, take the optimiser step and advance the schedule."""
    params = [p for p in module.parameters() if p.requires_grad]
    if distributed.is_distributed():
        world = distributed.world_size()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # every rank reduces the same tensors
            dist.all_reduce(p.grad)
            p.grad /= world
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    scheduler.step()


class OwnModule:
    """A module a method trains beside a network with the run's optimiser settings, on the
    gradients that network's backward left in it (zero them before that backward)."""

    def __init__(self, module: torch.nn.Module, grad_clip: float | None):
        self.module, self.grad_clip = module, grad_clip
        self.optimizer = self.scheduler = None

    def start(self, ctx, start_step: int = 0) -> None:
        self.optimizer, self.scheduler = ctx.new_optimizer(self.module, start_step)

    def zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)

    def step(self) -> None:
        apply_gradients(self.module, self.optimizer, self.scheduler, self.grad_clip)

    def state_dict(self) -> StateDict:
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


class Network:
    """A second dual encoder the method trains itself, with the trainer's optimiser settings
    (AdamW, warm-up + cosine, clipping): a co-trained peer or a siamese copy. Under torchrun its
    gradients are averaged across ranks by hand (it is not wrapped in DistributedDataParallel)."""

    def __init__(self, ctx, target):
        if ctx.config.precision == "fp16":
            raise ConfigError(f"method {ctx.config.method} trains a second network, which has no fp16 grad scaler: "
                              "set precision to fp32 or bf16", "precision")
        self.target, self.grad_clip = target, ctx.config.grad_clip
        self.optimizer = self.scheduler = None

    def start(self, ctx, start_step: int = 0) -> None:
        """A fresh optimiser, the schedule at `start_step` (the trainer's schedule is known only after setup)."""
        self.optimizer, self.scheduler = ctx.new_optimizer(self.target.module, start_step)

    def copy_weights(self, target) -> None:
        self.target.module.load_state_dict(target.module.state_dict())

    @classmethod
    def fresh(cls, ctx, seed_offset: int) -> Network:
        """A newly built target (random init seeded with seed + seed_offset; pretrained weights as the main one)."""
        cfg = ctx.config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed + seed_offset)
            target = load_target(cfg.model, cfg.pretrained, backend=cfg.backend, device=str(ctx.target.device),
                                 temperature=cfg.temperature)
        return cls(ctx, target)

    def step(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        apply_gradients(self.target.module, self.optimizer, self.scheduler, self.grad_clip)

    def state_dict(self) -> StateDict:
        return {"model": self.target.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.target.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


class NetworkBatches:
    """A loader a method drives itself, one batch per call: a second network's pass over the training
    data (its own shuffle seed), or, with `subset`, a pass over the pairs an `EpochWeights` selects
    (SPS's quasi-clean and noisy sets, DiffNCL's weak set). With `cycle` a finished pass restarts;
    without, `next()` returns None until `start()`. Under torchrun a rank's last, partial batch is
    used too (these networks and steps need the same number of steps on every rank, not the same
    batch size: a subset's share on a rank may be smaller than a batch); `next()` agrees across
    ranks (None on every rank when one has none)."""

    def __init__(self, ctx, preparer, seed: int, subset: EpochWeights | None = None, cycle: bool = True):
        cfg = ctx.config
        self.full = cfg.batch_size // distributed.world_size()
        plan = subset.plan() if subset is not None else BatchPlan()
        self.dataset = TrainBatches(ctx.dataset, preparer, self.full, seed, cfg.shuffle_buffer, plan)
        self.workers = min(cfg.workers, len(self.dataset.units))
        self.seed, self.cycle, self.iterator, self.finished = seed, cycle, None, False

    def start(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)
        self.iterator, self.finished = None, False

    def close(self) -> None:
        """Drop the pass under way, which shuts its DataLoader workers down (a method closes its loaders at
        each epoch's end: a pass left open would keep its workers alive after the run, e.g. in a process
        that trains several runs)."""
        self.iterator = None

    def _restart(self):
        loader = DataLoader(self.dataset, batch_size=None, num_workers=self.workers, worker_init_fn=steady_worker_memory,
                            generator=torch.Generator().manual_seed(self.seed * 1000 + self.dataset.epoch))
        return iter(loader)

    def _next_local(self) -> dict | None:
        for _ in range(2 if self.cycle else 1):  # the rest of the current pass, then (cycling) one fresh pass
            if self.finished:
                return None
            if self.iterator is None:
                self.iterator = self._restart()
            for batch in self.iterator:
                if len(batch["key"]) >= 2:
                    return batch
            self.iterator = None
            self.finished = not self.cycle
        return None

    def next(self) -> dict | None:
        batch = self._next_local()
        return batch if distributed.all_reduce_min(batch is not None) else None


class Peer:
    """A second network co-trained beside the main one, with its own initialisation and data order
    (seed + PEER_SEED_OFFSET): SPS's and DiffNCL's second network, GSC's with networks=2. Built in
    the method's setup; its optimiser starts at the first epoch this process trains (the trainer's
    schedule is known only then), from the saved state when the run is resumed. `subset`: it reads
    only the pairs an EpochWeights selects (a method that picks the pairs each network trains on)."""

    def __init__(self, ctx, subset: EpochWeights | None = None):
        self.network = Network.fresh(ctx, PEER_SEED_OFFSET)
        self.target = self.network.target
        self.subset = subset
        self.batches = NetworkBatches(ctx, self.target.preparer, ctx.seed + PEER_SEED_OFFSET, subset)

    def start_epoch(self, epoch: int, ctx, saved: dict | None) -> bool:
        """The optimiser at the first epoch (restored from `saved`), then this epoch's data order; True
        at that first epoch (a method restores the modules it trains beside the peer then)."""
        first = self.network.optimizer is None
        if first:
            self.network.start(ctx)
            if saved is not None:
                self.network.load_state_dict(saved)
        self.batches.start(epoch)
        return first

    def next_batch(self) -> dict | None:
        """The peer's next batch; None (on every rank) when it reads a subset of which some rank has no
        batch (the peer skips that step), an error when it reads every pair and has none."""
        batch = self.batches.next()
        if batch is None and self.subset is None:
            raise UserError("the second network's pass over the training data has no batch of at least 2 usable pairs")
        return batch

    def embed(self, ctx, batch: dict, across_ranks: bool = False) -> Embeddings:
        """The peer's embeddings of a batch; `across_ranks`: with every rank's rows as negatives (torchrun)."""
        left, right = self.target.encode(ctx.left, batch["left"]), self.target.encode(ctx.right, batch["right"])
        emb = Embeddings(left, right, self.target.logit_scale())
        if across_ranks and distributed.is_distributed():
            emb.all_left, emb.all_right = distributed.gather_with_grad(left), distributed.gather_with_grad(right)
            emb.offset = distributed.rank() * left.shape[0]
        return emb

    def step(self, loss: torch.Tensor) -> None:
        self.network.step(loss)

    def close(self) -> None:
        self.batches.close()

    def state_dict(self) -> StateDict:
        return self.network.state_dict()
