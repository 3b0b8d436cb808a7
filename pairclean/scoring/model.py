"""The model producer: shards -> decode -> estimator -> similarities, as `score()`.

DataLoader workers read units (tar shards / Parquet row groups), decode and preprocess images
and tokenise texts, and hand over ready batches; each batch carries the units that finished
inside it, so the main process commits a unit's part as soon as its last row is scored. The
rest of the run (parts, beta, resume, finalize) is `pairclean.scoring.run`.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset

from pairclean.backends import build_estimator, check_backend
from pairclean.backends.base import file_sha256, resolve_precision
from pairclean.backends.device_jpeg import finish_batch
from pairclean.backends.oom import OomBackoff
from pairclean.ops.faults import slow_point
from pairclean.ops import distributed
from pairclean.ops.notices import notice_once
from pairclean.ops.worker_memory import steady_worker_memory
from pairclean.config import check_numbers, check_pretrained, unpinned
from pairclean.core.beta import BetaEstimate, ShuffledAccumulator
from pairclean.core.scorer import null_partners
from pairclean.data.manifest import DatasetSpec, open_dataset
from pairclean.data.reader import UnitFailure, count_pairs, list_units, modalities, read_unit
from pairclean.errors import ConfigError
from pairclean.scoring.beta_cache import BetaCache, cached_random_input_beta
from pairclean.scoring.run import Commit, Producer, RunConfig, ScoreResult, Work, run_scoring


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
        if self.batch_size < 1:
            raise ConfigError("batch_size must be at least 1", "batch_size")
        check_numbers(self, at_least={"workers": 0, "beta_k": 1})
        check_pretrained(self.pretrained)


GROUP_BATCHES = 16  # a group of units holds at least this many batches' worth of pairs
PACKING_SAMPLE = 4  # leading units whose pairs are counted (headers only) to size the groups


def pack_units(units: list[str], pairs_per_unit: float, batch_size: int) -> list[list[str]]:
    """Consecutive units in groups of GROUP_BATCHES batches' worth of pairs (a unit alone once it
    holds that many): only a group's last batch can be partial, and the same pairs in the same
    order are batched alike however they are cut into shards, as long as each layout's groups
    hold them whole."""
    size = max(1, math.ceil(GROUP_BATCHES * batch_size / max(pairs_per_unit, 1.0)))
    return [units[i:i + size] for i in range(0, len(units), size)]


class PreparedBatches(IterableDataset):
    """Batches of prepared pairs from the groups this worker claims.

    A group's units are read in order as one stream cut every `batch_size` rows, whichever
    process claims it and whether or not some of its units were committed before: a resumed run
    encodes every pair in the same batch as an uninterrupted one, bit for bit. Rows of committed
    units are read to fill those batches and decoded only when a batch also holds rows to score.
    A batch carries the units whose last row it (or an earlier batch) holds, to be committed."""

    def __init__(self, spec: DatasetSpec, work: Work, preparer, batch_size: int):
        self.spec, self.work, self.preparer, self.batch_size = spec, work, preparer, batch_size
        self.left, self.right = modalities(spec.pair)

    def _empty(self) -> dict:
        return {"unit": [], "key": [], "shard": [], "index": [], "error": [], "left": [], "right": [], "done": []}

    def _prepared(self, buf: dict) -> dict | None:
        """The batch with its pairs decoded and collated; None when it holds nothing to score or commit."""
        if not buf["done"] and all(unit in self.work.done for unit in buf["unit"]):
            return None
        for i, (left, right) in enumerate(zip(buf["left"], buf["right"])):
            if buf["error"][i] is None:
                try:
                    buf["left"][i] = self.preparer.prepare(self.left, left)
                    buf["right"][i] = self.preparer.prepare(self.right, right)
                except Exception as exc:  # a bad item becomes an error row, never a dead worker
                    buf["error"][i] = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        ok_left = [x for x, e in zip(buf["left"], buf["error"]) if e is None]
        ok_right = [x for x, e in zip(buf["right"], buf["error"]) if e is None]
        buf["left"] = self.preparer.collate(self.left, ok_left) if ok_left else None
        buf["right"] = self.preparer.collate(self.right, ok_right) if ok_right else None
        return buf

    def __iter__(self):
        for group in self.work.claimed():
            buf = self._empty()
            for unit in group:
                count = 0
                failure = None
                for item in read_unit(self.spec, unit):
                    if isinstance(item, UnitFailure):
                        failure = item.reason
                        continue
                    for name, value in (("unit", unit), ("key", item.key), ("shard", item.shard),
                                        ("index", item.index), ("error", item.error), ("left", item.left),
                                        ("right", item.right)):
                        buf[name].append(value)
                    count += 1
                    if len(buf["key"]) >= self.batch_size:
                        if (batch := self._prepared(buf)) is not None:
                            yield batch
                        buf = self._empty()
                if unit not in self.work.done:
                    buf["done"].append((unit, failure, count))
            if (batch := self._prepared(buf)) is not None:
                yield batch


def small_shards_notice(pairs: int, units: int, batch_size: int, fill: float) -> str | None:
    """Say so when many small units left batches at most half full on average (a batch spans
    units only within a group, so a run or groups of few pairs cannot fill them)."""
    per_unit = pairs / units if units else 0.0
    if units < 4 or per_unit == 0 or per_unit >= batch_size / 2 or fill > 0.5:
        return None
    return (f"the shards hold {per_unit:,.0f} pairs on average and batches were filled to {fill:.0%} of "
            f"batch_size {batch_size} on average (a batch spans shards only within a group of "
            f"{GROUP_BATCHES} batches' worth); on a GPU that caps throughput (ViT-B-32 on an H100: 1.8k pairs/s "
            f"in 40-pair batches, ~10k in 512): score more pairs per run, or use a smaller batch_size")


class ModelProducer(Producer):
    """Similarities from a frozen estimator over a dataset's shards."""

    def __init__(self, spec: DatasetSpec, cfg: ScoreConfig, estimator=None):
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
        return {"pair": spec.pair, "format": spec.format, "fields": asdict(spec.fields),
                "label_template": spec.label_template, "split": spec.split, "image_root": spec.image_root,
                "weights_sha256": weights}

    def prepare(self) -> None:
        if self.estimator is None:  # built (and so validated) before anything is written
            cfg = self.cfg
            torch.manual_seed(cfg.seed)  # a randomly initialised model (--pretrained none) is then reproducible
            self.estimator = build_estimator(cfg.backend, model=cfg.model, pretrained=cfg.pretrained,
                                             device=distributed.default_device_for_rank(cfg.device),
                                             precision=cfg.precision, decode=cfg.decode, compile=cfg.compile)

    def groups(self, units: list[str]) -> list[list[str]]:
        """Small units packed so that batches span them (sized from the leading units' pair counts)."""
        sample = units[:PACKING_SAMPLE]
        pairs = sum(count_pairs(self.spec, unit) for unit in sample) / len(sample) if sample else 0.0
        return pack_units(units, pairs, self.cfg.batch_size)

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

    def score(self, work: Work, commit: Commit, task) -> dict[str, int]:
        spec, cfg, estimator = self.spec, self.cfg, self.estimator
        left_mod, right_mod = modalities(spec.pair)
        dataset = PreparedBatches(spec, work, estimator.preparer, cfg.batch_size)
        workers = min(cfg.workers, len(work.groups))
        # Two ready batches per worker hide decoding (each worker builds whole batches) without
        # holding more than 2 x workers batches of pixels in (pinned) memory.
        loader = DataLoader(dataset, batch_size=None, num_workers=workers,
                            pin_memory=estimator.device.type == "cuda", prefetch_factor=2 if workers else None,
                            persistent_workers=False, worker_init_fn=steady_worker_memory)
        rows: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        accumulators: dict[str, ShuffledAccumulator] = defaultdict(ShuffledAccumulator)
        backoff = {left_mod: OomBackoff(), right_mod: OomBackoff()}  # halves a side's chunks on out-of-memory
        counters = {"batches": 0, "full_batches": 0, "batch_rows": 0}
        for batch in loader:
            if batch["key"]:
                counters["batches"] += 1
                counters["full_batches"] += len(batch["key"]) == cfg.batch_size
                counters["batch_rows"] += len(batch["key"])
            if any(e is None for e in batch["error"]):
                batch = finish_batch(estimator, batch, left_mod, right_mod)  # --decode gpu: JPEGs -> pixels here
            ok = [e is None for e in batch["error"]]
            sims = nulls = [None] * len(ok)
            if any(ok):
                u = backoff[left_mod](lambda b: estimator.encode(left_mod, b), batch["left"])
                v = backoff[right_mod](lambda b: estimator.encode(right_mod, b), batch["right"])
                values = (u * v).sum(-1).cpu().tolist()
                partners = torch.from_numpy(null_partners(len(u))).to(v.device)
                null_values = iter((u * v[partners]).sum(-1).cpu().tolist() if len(partners) else [None] * len(u))
                ok_units = [unit for unit, good in zip(batch["unit"], ok) if good]
                for unit in dict.fromkeys(ok_units):
                    if unit not in work.done:
                        mask = torch.tensor([x == unit for x in ok_units])
                        accumulators[unit].add(u[mask], v[mask])
                it = iter(values)
                sims = [next(it) if good else None for good in ok]
                nulls = [next(null_values) if good else None for good in ok]
            for unit, key, shard, index, error, sim, null in zip(batch["unit"], batch["key"], batch["shard"],
                                                                batch["index"], batch["error"], sims, nulls):
                if unit in work.done:  # read again only to fill the batch it shares with units to score
                    continue
                part = rows[unit]
                part["null_sim"].append(null)
                part["key"].append(key)
                part["shard"].append(shard)
                part["index"].append(index)
                part["sim"].append(sim)
                part["error"].append(error)
            for unit, failure, count in batch["done"]:
                columns = rows.pop(unit, {"key": [], "shard": [], "index": [], "sim": [], "null_sim": [], "error": []})
                errors = sum(e is not None for e in columns["error"])
                commit(unit, dict(columns), {"errors": errors, "failure": failure,
                                             "shuffled": accumulators.pop(unit, ShuffledAccumulator()).state()})
            slow_point()
        return counters

    def finish(self, records: dict[str, dict], counters: dict[str, int], todo: int) -> tuple[dict, dict]:
        batches = counters["batches"]
        fill = counters["batch_rows"] / (batches * self.cfg.batch_size) if batches else 0.0
        if notice := small_shards_notice(counters["pairs"], todo, self.cfg.batch_size, fill):
            notice_once("small-shards", notice, "batch_size")
        return ({"estimator": self.estimator.provenance(), "pair": self.spec.pair, "input_shards": self.spec.shards,
                 "dataset": self.spec.record()},
                {"batches": batches, "full_batches": counters["full_batches"], "mean_batch_fill": fill})


def score(source: str | list[str] | DatasetSpec, out: str | Path, config: ScoreConfig | None = None,
          estimator=None) -> ScoreResult:
    """Score every pair of `source` and write `out` (Parquet); resumes an interrupted run."""
    cfg = config or ScoreConfig()
    spec = source if isinstance(source, DatasetSpec) else open_dataset(source)
    if cfg.precision == "auto":  # pinned in the settings as what it means on this machine
        cfg = replace(cfg, precision=resolve_precision(cfg.device, "auto"))
    return run_scoring(ModelProducer(spec, cfg, estimator), out, cfg)
