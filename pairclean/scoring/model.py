"""The model producer: shards -> decode -> estimator -> similarities, as `score()`.

DataLoader workers read units (tar shards / Parquet row groups), decode and preprocess images
and tokenise texts, and hand over ready batches; each batch carries the units that finished
inside it, so the main process commits a unit's part as soon as its last row is scored. The
rest of the run (parts, beta, resume, finalize) is `pairclean.scoring.run`.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset

from pairclean.backends import build_estimator, check_backend
from pairclean.backends.base import file_sha256, resolve_precision
from pairclean.backends.device_jpeg import finish_batch
from pairclean.backends.oom import OomBackoff
from pairclean.ops.notices import notice_once
from pairclean.ops.worker_memory import steady_worker_memory
from pairclean.config import check_numbers, check_pretrained, unpinned
from pairclean.core.beta import BetaCache, BetaEstimate, ShuffledAccumulator, cached_random_input_beta
from pairclean.data.manifest import DatasetSpec, open_dataset
from pairclean.data.reader import UnitFailure, list_units, modalities, read_unit
from pairclean.errors import ConfigError
from pairclean.scoring.run import Commit, Producer, RunConfig, ScoreResult, run_scoring


@dataclass
class ScoreConfig(RunConfig):
    model: str = "ViT-B-32"
    pretrained: str = "openai"
    backend: str = "open_clip"
    device: str = unpinned("auto")
    precision: str = "fp32"  # fp32 | bf16 | fp16 | auto (resolved before anything is pinned)
    decode: str = "fast"  # fast (JPEG draft decode) | exact | gpu (JPEGs decoded on the CUDA device)
    compile: bool = unpinned(False)  # torch.compile the towers (eager fallback if compiling fails)
    beta_cache: bool = unpinned(True)  # reuse a random-inputs beta computed earlier for the same weights/K/seed
    batch_size: int = unpinned(256)
    workers: int = unpinned(2)
    beta_k: int = 1024

    def __post_init__(self):
        super().__post_init__()
        check_numbers(self, at_least={"workers": 0, "beta_k": 1})
        check_pretrained(self.pretrained)


class PreparedBatches(IterableDataset):
    """Batches of prepared pairs from this worker's share of the units."""

    def __init__(self, spec: DatasetSpec, units: list[str], preparer, batch_size: int):
        self.spec, self.units, self.preparer, self.batch_size = spec, units, preparer, batch_size
        self.left, self.right = modalities(spec.pair)

    def _empty(self) -> dict:
        return {"unit": [], "key": [], "shard": [], "index": [], "error": [], "left": [], "right": [], "done": []}

    def _emit(self, buf: dict) -> dict:
        ok_left = [x for x, e in zip(buf["left"], buf["error"]) if e is None]
        ok_right = [x for x, e in zip(buf["right"], buf["error"]) if e is None]
        buf["left"] = self.preparer.collate(self.left, ok_left) if ok_left else None
        buf["right"] = self.preparer.collate(self.right, ok_right) if ok_right else None
        return buf

    def __iter__(self):
        buf = self._empty()
        for unit in wds.split_by_worker(self.units):
            count = 0
            failure = None
            for item in read_unit(self.spec, unit):
                if isinstance(item, UnitFailure):
                    failure = item.reason
                    continue
                left = right = None
                error = item.error
                if error is None:
                    try:
                        left = self.preparer.prepare(self.left, item.left)
                        right = self.preparer.prepare(self.right, item.right)
                    except Exception as exc:  # a bad item becomes an error row, never a dead worker
                        error = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
                for name, value in (("unit", unit), ("key", item.key), ("shard", item.shard), ("index", item.index),
                                    ("error", error), ("left", left), ("right", right)):
                    buf[name].append(value)
                count += 1
                if len(buf["key"]) >= self.batch_size:
                    yield self._emit(buf)
                    buf = self._empty()
            buf["done"].append((unit, failure, count))
            # A batch never spans two units: a unit is encoded in the same batches whichever units
            # ran before it, so a resumed run reproduces an uninterrupted one bit for bit.
            yield self._emit(buf)
            buf = self._empty()


def small_shards_notice(pairs: int, units: int, batch_size: int) -> str | None:
    """Say so when the shards, not --batch-size, set the batch size: a batch never spans two
    units (for bit-identical resume), so units under half a batch leave batches under half full."""
    per_unit = pairs / units if units else 0.0
    if units < 4 or per_unit == 0 or per_unit >= batch_size / 2:
        return None
    return (f"the shards hold {per_unit:,.0f} pairs on average and a batch never spans two shards, so batches "
            f"were about {per_unit / batch_size:.0%} of --batch-size {batch_size}; on a GPU that caps throughput "
            f"(ViT-B-32 on an H100: 1.8k pairs/s in 40-pair batches, ~10k in 512): use shards of thousands of pairs")


class ModelProducer(Producer):
    """Similarities from a frozen estimator over a dataset's shards."""

    def __init__(self, spec: DatasetSpec, cfg: ScoreConfig, estimator=None):
        if cfg.batch_size < 1:
            raise ConfigError("batch_size must be at least 1", "batch_size")
        if estimator is None:
            check_backend(cfg.backend, modalities(spec.pair))  # before any output exists
        self.spec, self.cfg, self.estimator = spec, cfg, estimator
        self.built_from_config = estimator is None
        self.device_type = "cuda" if cfg.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"

    def units(self) -> list[str]:
        return list_units(self.spec)

    def settings(self) -> dict:
        spec, pretrained = self.spec, self.cfg.pretrained
        # A checkpoint replaced at the same path between a kill and the re-run is another model:
        # its hash is pinned, so the resumed run is refused instead of mixing two models' scores.
        weights = file_sha256(pretrained) if pretrained and os.path.isfile(pretrained) else None
        return {"pair": spec.pair, "fields": asdict(spec.fields), "label_template": spec.label_template,
                "weights_sha256": weights}

    def prepare(self) -> None:
        if self.estimator is None:  # built (and so validated) before anything is written
            from pairclean.ops import distributed

            cfg = self.cfg
            torch.manual_seed(cfg.seed)  # a randomly initialised model (--pretrained none) is then reproducible
            self.estimator = build_estimator(cfg.backend, model=cfg.model, pretrained=cfg.pretrained,
                                             device=distributed.default_device_for_rank(cfg.device),
                                             precision=cfg.precision, decode=cfg.decode, compile=cfg.compile)

    def random_beta(self) -> tuple[BetaEstimate, str]:
        """K random inputs per side through the estimator (cached across runs of the same weights).
        `built_from_config`: the estimator was built from the config (after seeding), so its
        provenance, the seed and the library versions name its weights and the cache need not hash them."""
        cfg = self.cfg
        left, right = modalities(self.spec.pair)
        weights_id = None
        if self.built_from_config:
            from importlib.metadata import PackageNotFoundError, version

            def known(package: str) -> str | None:
                try:
                    return version(package)
                except PackageNotFoundError:
                    return None

            weights_id = json.dumps({"built_with_seed": cfg.seed, **{p: known(p) for p in
                                     ("torch", "open_clip_torch", "sentence-transformers", "transformers")}})
        beta, hit = cached_random_input_beta(self.estimator, left, right, k=cfg.beta_k, seed=cfg.seed,
                                             batch_size=min(cfg.batch_size, 256),
                                             cache=BetaCache() if cfg.beta_cache else None, weights_id=weights_id)
        return beta, "cache" if hit else "computed"

    def score(self, units: list[str], commit: Commit, task) -> int:
        spec, cfg, estimator = self.spec, self.cfg, self.estimator
        left_mod, right_mod = modalities(spec.pair)
        dataset = PreparedBatches(spec, units, estimator.preparer, cfg.batch_size)
        workers = min(cfg.workers, len(units))
        # Two ready batches per worker hide decoding (each worker builds whole batches) without
        # holding more than 2 x workers batches of pixels in (pinned) memory.
        loader = DataLoader(dataset, batch_size=None, num_workers=workers,
                            pin_memory=estimator.device.type == "cuda", prefetch_factor=2 if workers else None,
                            persistent_workers=False, worker_init_fn=steady_worker_memory)
        rows: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        accumulators: dict[str, ShuffledAccumulator] = defaultdict(ShuffledAccumulator)
        backoff = {left_mod: OomBackoff(), right_mod: OomBackoff()}  # halves a side's chunks on out-of-memory
        scored = 0
        for batch in loader:
            if any(e is None for e in batch["error"]):
                batch = finish_batch(estimator, batch, left_mod, right_mod)  # --decode gpu: JPEGs -> pixels here
            ok = [e is None for e in batch["error"]]
            sims = [None] * len(ok)
            if any(ok):
                u = backoff[left_mod](lambda b: estimator.encode(left_mod, b), batch["left"])
                v = backoff[right_mod](lambda b: estimator.encode(right_mod, b), batch["right"])
                values = (u * v).sum(-1).cpu().tolist()
                ok_units = [unit for unit, good in zip(batch["unit"], ok) if good]
                for unit in dict.fromkeys(ok_units):
                    mask = torch.tensor([x == unit for x in ok_units])
                    accumulators[unit].add(u[mask], v[mask])
                it = iter(values)
                sims = [next(it) if good else None for good in ok]
            for unit, key, shard, index, error, sim in zip(batch["unit"], batch["key"], batch["shard"], batch["index"],
                                                          batch["error"], sims):
                part = rows[unit]
                part["key"].append(key)
                part["shard"].append(shard)
                part["index"].append(index)
                part["sim"].append(sim)
                part["error"].append(error)
            scored += len(ok)
            for unit, failure, count in batch["done"]:
                columns = rows.pop(unit, {"key": [], "shard": [], "index": [], "sim": [], "error": []})
                errors = sum(e is not None for e in columns["error"])
                commit(unit, dict(columns), {"errors": errors, "failure": failure,
                                             "shuffled": accumulators.pop(unit, ShuffledAccumulator()).state()})
        return scored

    def finish(self, records: dict[str, dict], scored_now: int, todo: int) -> tuple[dict, dict]:
        if notice := small_shards_notice(scored_now, todo, self.cfg.batch_size):
            notice_once("small-shards", notice)
        return {"estimator": self.estimator.provenance(), "pair": self.spec.pair, "input_shards": self.spec.shards,
                "dataset": self.spec.name}, {}


def score(source: str | list[str] | DatasetSpec, out: str | Path, config: ScoreConfig | None = None,
          estimator=None) -> ScoreResult:
    """Score every pair of `source` and write `out` (Parquet); resumes an interrupted run."""
    cfg = config or ScoreConfig()
    spec = source if isinstance(source, DatasetSpec) else open_dataset(source)
    if cfg.precision == "auto":  # pinned in the settings as what it means on this machine
        cfg = replace(cfg, precision=resolve_precision(cfg.device, "auto"))
    return run_scoring(ModelProducer(spec, cfg, estimator), out, cfg)
