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
import shutil
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pyarrow as pa
import torch
from torch.utils.data import DataLoader, IterableDataset

from pairclean import __version__
from pairclean.backends import build_estimator, default_model, resolve_backend
from pairclean.backends.base import file_sha256, resolve_precision
from pairclean.backends.device_jpeg import finish_batch
from pairclean.backends.oom import OomBackoff
from pairclean.ops.faults import slow_point
from pairclean.ops.guard import Output, open_output
from pairclean.ops import distributed
from pairclean.ops.notices import notice_once
from pairclean.ops.worker_memory import steady_worker_memory
from pairclean.config import COUNT, at_least, check_choice, check_pretrained, setting, unpinned
from pairclean.core.beta import BetaEstimate, ShuffledAccumulator
from pairclean.core.scorer import null_partners
from pairclean.data.manifest import DatasetSpec, open_dataset
from pairclean.data.reader import UnitFailure, count_pairs, list_units, modalities, read_unit
from pairclean.data.formats.embeddings import SAVED_PROVENANCE, write_embedding_block
from pairclean.errors import ConfigError
from pairclean.ops.atomic import remove_stale_temps, write_json
from pairclean.scoring.beta_cache import BetaCache, cached_random_input_beta, weights_fingerprint
from pairclean.scoring.run import Commit, Producer, RunConfig, ScoreResult, Work, run_scoring


@dataclass
class ScoreConfig(RunConfig):
    model: str | None = None  # None: the backend's default model (ViT-B-32 for open_clip)
    pretrained: str | None = None  # None: the model's own weights (openai for an open_clip architecture name)
    backend: str = "auto"  # auto: from the model name and the pair kind (`resolved`)
    device: str = unpinned("auto")
    precision: str = "fp32"  # fp32 | bf16 | fp16 | auto (resolved before anything is pinned)
    decode: str = "fast"  # fast (JPEG draft decode) | exact | gpu (JPEGs decoded on the CUDA device)
    compile: bool = unpinned(False)  # torch.compile the towers (eager fallback if compiling fails)
    beta_cache: bool = unpinned(True)  # reuse a random-inputs beta computed earlier for the same weights/K/seed
    batch_size: int = setting(256, COUNT, pinned=False)
    workers: int = setting(2, at_least(0), pinned=False)
    beta_k: int = setting(1024, COUNT)
    save_embeddings: str | None = None  # directory: also write every pair's embeddings in clip-retrieval's layout
    embeddings_dtype: str = "float16"  # what they are stored as

    def __post_init__(self):
        super().__post_init__()
        check_pretrained(self.pretrained)
        check_choice(self.embeddings_dtype, EMBEDDING_DTYPES, "embeddings_dtype")
        if self.save_embeddings is not None:
            self.save_embeddings = str(self.save_embeddings)

    def resolved(self, pair: str) -> ScoreConfig:
        """This config with the backend named (`auto`: the one that recognises the model; a name none
        recognises is a sentence-transformers model for text-only pairs, else open_clip's) and an
        unset model made the backend's default: what a run pins and records."""
        backend = resolve_backend(self.backend, self.model, modalities(pair))
        return replace(self, backend=backend, model=self.model or default_model(backend))


EMBEDDING_DTYPES = ("float16", "float32")
LAYOUT_ENTRIES = ("img_emb", "text_emb", "metadata", SAVED_PROVENANCE)  # what a fresh run clears in save_embeddings
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

    def __init__(self, spec: DatasetSpec, cfg: ScoreConfig, estimator=None, embeddings: Output | None = None):
        cfg = cfg.resolved(spec.pair)  # before any output exists: a backend that cannot encode the pairs is refused
        self.spec, self.cfg, self.estimator = spec, cfg, estimator
        self.embeddings = embeddings  # save_embeddings, opened through the output guard
        self.built_from_config = estimator is None
        self.device_type = "cuda" if cfg.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"

    def units(self) -> list[str]:
        units = list_units(self.spec)
        self.block_of = {unit: number for number, unit in enumerate(units)}  # save_embeddings: block N = unit N
        return units

    def started(self, resumed: bool) -> None:
        """save_embeddings: a fresh run starts from an empty directory (a resumed one keeps the
        blocks of its committed units; any other block is rewritten when its unit is scored)."""
        if self.embeddings is None:
            return
        directory = self.embeddings.path
        found = [directory / name for name in LAYOUT_ENTRIES if (directory / name).exists()]
        if not resumed and found:
            if not self.cfg.overwrite:
                raise ConfigError(f"`save_embeddings` {directory} already holds embeddings; pass `overwrite` to "
                                  "replace them, or give another directory", "save_embeddings", "overwrite")
            for path in found:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        directory.mkdir(exist_ok=True)
        for folder in (directory, *(directory / name for name in LAYOUT_ENTRIES)):
            remove_stale_temps(folder)  # a killed run's half-written block files (this run holds the lock)

    def settings(self) -> dict:
        spec, pretrained = self.spec, self.cfg.pretrained
        # A checkpoint replaced at the same path between a kill and the re-run is another model:
        # its hash is pinned, so the resumed run is refused instead of mixing two models' scores.
        weights = file_sha256(pretrained) if pretrained and os.path.isfile(pretrained) else None
        return {"pair": spec.pair, "format": spec.format, "fields": asdict(spec.fields),
                "label_template": spec.label_template, "split": spec.split, "image_root": spec.image_root,
                "weights_sha256": weights}

    def input_files(self) -> list[str]:
        return [self.cfg.pretrained] if self.cfg.pretrained and os.path.isfile(self.cfg.pretrained) else []

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
        saved: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))  # save_embeddings, per unit
        save_dtype = getattr(torch, cfg.embeddings_dtype)
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
                ok_rows = [i for i, good in enumerate(ok) if good]
                for unit in dict.fromkeys(ok_units):
                    if unit not in work.done:
                        mask = torch.tensor([x == unit for x in ok_units])
                        accumulators[unit].add(u[mask], v[mask])
                        if self.embeddings is not None:
                            block = saved[unit]
                            block["left"].append(u[mask].to(save_dtype).cpu())
                            block["right"].append(v[mask].to(save_dtype).cpu())
                            for name in ("key", "shard", "index"):
                                block[name].extend(batch[name][i] for i, m in zip(ok_rows, mask.tolist()) if m)
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
                record = {"errors": errors, "failure": failure,
                          "shuffled": accumulators.pop(unit, ShuffledAccumulator()).state()}
                if self.embeddings is not None:  # the unit's block first: committed units have theirs
                    record.update(self._save_block(unit, saved.pop(unit, None)))
                commit(unit, dict(columns), record)
            slow_point()
        return counters

    def _save_block(self, unit: str, block: dict | None) -> dict:
        """Write the unit's embeddings as block N (N: the unit's place in the run) and return what
        its commit record says of them. A unit without a usable pair writes no block."""
        if not block or not block["left"]:
            return {"embeddings": 0, "embedding_bytes": 0}
        left, right = torch.cat(block["left"]).numpy(), torch.cat(block["right"]).numpy()
        metadata = pa.table({"key": pa.array(block["key"], pa.string()), "shard": pa.array(block["shard"], pa.string()),
                             "index": pa.array(block["index"], pa.int64())})
        written = write_embedding_block(self.embeddings.path, self.block_of[unit], left, right, metadata)
        return {"embeddings": len(left), "embedding_bytes": written}

    def finish(self, records: dict[str, dict], counters: dict[str, int], todo: int,
               beta: BetaEstimate | None) -> tuple[dict, dict]:
        batches = counters["batches"]
        fill = counters["batch_rows"] / (batches * self.cfg.batch_size) if batches else 0.0
        if notice := small_shards_notice(counters["pairs"], todo, self.cfg.batch_size, fill):
            notice_once("small-shards", notice, "batch_size")
        extra = {"batches": batches, "full_batches": counters["full_batches"], "mean_batch_fill": fill}
        if self.embeddings is not None and beta is not None:
            extra.update(self._saved_provenance(records, beta))
        return ({"estimator": self.estimator.provenance(), "pair": self.spec.pair, "input_shards": self.spec.shards,
                 "dataset": self.spec.record()}, extra)

    def _saved_provenance(self, records: dict[str, dict], beta: BetaEstimate) -> dict:
        """DIR/provenance.json, written when every unit is committed (its presence marks the
        directory complete): the model, its weights' hash, the preprocessing, the run's beta."""
        estimator, cfg = self.estimator, self.cfg
        rows = sum(r.get("embeddings", 0) for r in records.values())
        written = sum(r.get("embedding_bytes", 0) for r in records.values())
        model = getattr(estimator, "model", None)
        left, right = modalities(self.spec.pair)
        provenance = {
            "written_by": "pairclean score", "pairclean_version": __version__, "estimator": estimator.provenance(),
            "weights_sha1": weights_fingerprint(model) if isinstance(model, torch.nn.Module) else None,
            "preprocessing": repr(estimator.input_signature()) if hasattr(estimator, "input_signature") else None,
            "pair": self.spec.pair, "img_emb": left, "text_emb": right, "dtype": cfg.embeddings_dtype,
            "normalised": True, "rows": rows, "bytes": written, "dataset": self.spec.record(),
            "input_shards": self.spec.shards, "beta": beta.as_dict(),
            "blocks": {str(self.block_of[u]): {"unit": u, "rows": r.get("embeddings", 0)}
                       for u, r in records.items() if r.get("embeddings")}}
        write_json(self.embeddings.path / SAVED_PROVENANCE, provenance)
        return {"embeddings_saved": rows, "embedding_bytes": written, "embeddings_dir": str(self.embeddings.path)}


def score(source: str | list[str] | DatasetSpec, out: str | Path | Output, config: ScoreConfig | None = None,
          estimator=None) -> ScoreResult:
    """Score every pair of `source` and write `out` (Parquet); resumes an interrupted run."""
    cfg = config or ScoreConfig()
    spec = source if isinstance(source, DatasetSpec) else open_dataset(source)
    # A directory the run owns (it resumes): the blocks of committed units stay; `started` clears the rest.
    embeddings = None if cfg.save_embeddings is None else open_output(
        cfg.save_embeddings, [*spec.sources, *spec.shards], "save_embeddings", kind="directory", overwrite=None)
    if cfg.precision == "auto":  # pinned in the settings as what it means on this machine
        cfg = replace(cfg, precision=resolve_precision(cfg.device, "auto"))
    producer = ModelProducer(spec, cfg, estimator, embeddings)
    return run_scoring(producer, out, producer.cfg)
