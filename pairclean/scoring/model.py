"""The model producer: shards -> decode -> estimator -> similarities, as `score()`.

DataLoader workers read units (tar shards / Parquet row groups), decode and prepare images and
tokenise texts, and hand over ready batches (`scoring.batches`); the main process moves them to
the device, encodes and scores them and commits each unit's part as soon as its last row is in
(`scoring.pipeline`). The rest of the run (parts, beta, resume, finalize) is `scoring.run`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pyarrow as pa
import torch

from pairclean import __version__
from pairclean.backends import BACKENDS, build_estimator, check_model, default_model, resolve_backend
from pairclean.backends.base import file_sha256, resolve_precision
from pairclean.backends.device_jpeg import auto_workers, check_cpu_decode_share, pinned_decoding
from pairclean.ops.faults import slow_point
from pairclean.ops.guard import Output, open_output
from pairclean.ops.places import RemotePath, is_remote
from pairclean.ops import distributed
from pairclean.ops.notices import notice_once
from pairclean.ops.measure import StageMeter
from pairclean.config import COUNT, SHARE, at_least, check_choice, check_pretrained, setting, unpinned
from pairclean.core.beta import BetaEstimate
from pairclean.data.dataset import Dataset, as_dataset
from pairclean.data.embeddings import (SAVED_PROVENANCE, UNFINISHED, SavedBeta, SavedBlock, SavedEmbeddings,
                                      write_embedding_block)
from pairclean.data.spec import DatasetSpec, modalities
from pairclean.errors import ConfigError
from pairclean.ops.atomic import remove_stale_temps, write_json
from pairclean.ops.records import JsonObject
from pairclean.scoring.beta_cache import BetaCache, cached_random_input_beta, weights_fingerprint
from pairclean.scoring.batches import PreparedBatches, ScoringCounts, batch_loader
from pairclean.scoring.parts import ScoredUnit
from pairclean.scoring.pipeline import PartSink, UnitEmbeddings, run_pipeline
from pairclean.scoring.engines import ENGINE_NAMES, build_engine
from pairclean.scoring.run import Commit, Finishing, Producer, RunConfig, ScoreResult, Work, run_scoring


@dataclass(frozen=True)
class EstimatorFacts:
    """What a run records of its estimator, taken where it was built (this process or a Ray worker).
    `weights_sha1` (every tensor hashed: only the saved embeddings record it) is taken where asked."""

    provenance: dict
    weights_sha1: str | None
    preprocessing: str | None

    @classmethod
    def of(cls, estimator, weights: bool) -> EstimatorFacts:
        model = getattr(estimator, "model", None)
        return cls(estimator.provenance(),
                   weights_fingerprint(model) if weights and isinstance(model, torch.nn.Module) else None,
                   repr(estimator.input_signature()) if hasattr(estimator, "input_signature") else None)


@dataclass
class ScoreConfig(RunConfig):
    model: str | None = None  # None: the backend's default model (ViT-B-32 for open_clip)
    pretrained: str | None = None  # None: the model's own weights (openai for an open_clip architecture name)
    backend: str = "auto"  # auto: from the model name and the pair kind (`resolved`)
    device: str = unpinned("auto")
    precision: str = "fp32"  # fp32 | bf16 | fp16 | auto (resolved before anything is pinned)
    decode: str = "fast"  # fast (draft decode, torch's resize) | exact (PIL's: the model's pixels) | a device decoder (gpu ...)
    # with a device decoder: the share of the JPEGs the CPU workers decode instead (pinned in `settings` where it applies)
    cpu_decode_share: float = setting(0.0, SHARE, pinned=False)
    compile: bool = unpinned(False)  # torch.compile the towers (eager fallback if compiling fails)
    beta_cache: bool = unpinned(True)  # reuse a random-inputs beta computed earlier for the same weights/K/seed
    batch_size: int = setting(256, COUNT, pinned=False)
    workers: int | None = setting(None, at_least(0), pinned=False)  # None: auto (`auto_workers`)
    beta_k: int = setting(1024, COUNT)
    save_embeddings: str | None = None  # directory or object-store URL: also write every pair's embeddings in clip-retrieval's layout
    embeddings_dtype: str = "float16"  # what they are stored as
    engine: str = unpinned("local")  # where the units are scored (`scoring.engines`): local or ray
    ray_address: str | None = unpinned(None)  # ray: the cluster (None: RAY_ADDRESS, else a Ray started here)
    ray_workers: int | None = setting(None, COUNT, pinned=False)  # ray: scoring workers (None: as many as the cluster fits)
    ray_gpus: float | None = setting(None, SHARE, pinned=False)  # ray: GPUs per worker (None: 1 where the cluster has GPUs)

    def __post_init__(self):
        super().__post_init__()
        check_pretrained(self.pretrained)
        check_cpu_decode_share(self.cpu_decode_share, self.decode)
        check_choice(self.embeddings_dtype, EMBEDDING_DTYPES, "embeddings_dtype")
        check_choice(self.engine, ENGINE_NAMES, "engine")
        if self.save_embeddings is not None and not is_remote(self.save_embeddings):
            # pinned as the directory it names: a resume from elsewhere is refused
            self.save_embeddings = os.path.abspath(str(self.save_embeddings))

    def resolved(self, pair: str) -> ScoreConfig:
        """This config with the backend named (`auto`: the one that recognises the model; a name none
        recognises is a sentence-transformers model for text-only pairs, else open_clip's) and an
        unset model made the backend's default: what a run pins and records."""
        backend = resolve_backend(self.backend, self.model, modalities(pair))
        workers = self.workers if self.workers is not None else auto_workers(self.device, self.decode, self.cpu_decode_share)
        return replace(self, backend=backend, model=self.model or default_model(backend), workers=workers)


EMBEDDING_DTYPES = ("float16", "float32")
# what a fresh run clears in save_embeddings
LAYOUT_ENTRIES = ("img_emb", "text_emb", "metadata", SAVED_PROVENANCE, UNFINISHED)
GROUP_BATCHES = 16  # a group of units holds at least this many batches' worth of pairs
PACKING_SAMPLE = 4  # leading units whose pairs are counted (headers only) to size the groups


def pack_units(units: list[str], pairs_per_unit: float, batch_size: int, readers: int = 1) -> list[list[str]]:
    """Consecutive units in groups of GROUP_BATCHES batches' worth of pairs (a unit alone once it
    holds that many): only a group's last batch can be partial, and the same pairs in the same
    order are batched alike however they are cut into shards, as long as each layout's groups
    hold them whole. `readers` (DataLoader workers x processes): a worker reads whole groups, so
    the units are cut into at least that many groups where there are enough of them, or workers
    sit idle (an H100 run of 14 shards of 2,500 pairs at batch 1,024 packed them into 2 groups:
    2 of its 14 workers decoded, 603 pairs/s)."""
    size = max(1, math.ceil(GROUP_BATCHES * batch_size / max(pairs_per_unit, 1.0)))
    size = min(size, max(1, math.ceil(len(units) / max(readers, 1))))
    return [units[i:i + size] for i in range(0, len(units), size)]


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

    def __init__(self, dataset: Dataset, cfg: ScoreConfig, estimator=None, embeddings: Output | None = None,
                 meter: StageMeter | None = None):
        cfg = cfg.resolved(dataset.spec.pair)  # before any output exists: a backend that cannot encode the pairs is refused
        check_model(cfg.backend, cfg.model, cfg.pretrained)  # and a model name or weights tag it does not know,
        dataset.check_fields()  # and fields the data do not hold: all before the model loads
        self.dataset, self.spec, self.cfg, self.estimator = dataset, dataset.spec, cfg, estimator
        self.meter = meter  # where the main process's time goes (`pairclean bench score`)
        self.embeddings = embeddings  # save_embeddings, opened through the output guard
        self._dataset = None  # the dataset's record, its files fingerprinted once (`dataset_record`)
        self._facts = None  # the estimator's, taken once (`facts`), or from a Ray worker (`adopt`)
        self.built_from_config = estimator is None
        self.device_type = "cuda" if cfg.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"

    def units(self) -> list[str]:
        units = self.dataset.units()
        self.block_of = {unit: number for number, unit in enumerate(units)}  # save_embeddings: block N = unit N
        return units

    def started(self, resumed: bool) -> None:
        """save_embeddings: a fresh run starts from an empty directory (a resumed one keeps the
        blocks of its committed units; any other block is rewritten when its unit is scored),
        marked unfinished until `provenance.json` is written (readers refuse it until then)."""
        if self.embeddings is None:
            return
        directory = self.embeddings.path
        found = [directory / name for name in LAYOUT_ENTRIES if (directory / name).exists()]
        if not resumed and found:
            if not self.cfg.overwrite:
                raise ConfigError(f"`save_embeddings` {directory} already holds embeddings; pass `overwrite` to "
                                  "replace them, or give another directory", "save_embeddings", "overwrite")
            for path in found:
                if isinstance(path, RemotePath):
                    path.remove_tree()
                else:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        directory.mkdir(exist_ok=True)
        if not isinstance(directory, RemotePath):  # an object store keeps no half-written objects
            for folder in (directory, *(directory / name for name in LAYOUT_ENTRIES)):
                remove_stale_temps(folder)  # a killed run's half-written block files (this run holds the lock)
        (directory / SAVED_PROVENANCE).unlink(missing_ok=True)  # a resumed run's directory is complete only at its end
        write_json(directory / UNFINISHED, {"written_by": "pairclean score"})

    def settings(self) -> JsonObject:
        spec, pretrained = self.spec, self.cfg.pretrained
        # A checkpoint replaced at the same path between a kill and the re-run is another model:
        # its hash is pinned, so the resumed run is refused instead of mixing two models' scores.
        weights = file_sha256(pretrained) if pretrained and os.path.isfile(pretrained) else None
        # How bf16/fp16 computes, where not under autocast (absent: autocast, as in every earlier pairclean)
        low = BACKENDS[self.cfg.backend].low_precision
        decoding = pinned_decoding(self.cfg.decode, self.cfg.device, self.cfg.cpu_decode_share) \
            if "image" in modalities(spec.pair) else {}
        return {"pair": spec.pair, "format": spec.format, "fields": asdict(spec.fields),
                "label_template": spec.label_template, "split": spec.split, "image_root": spec.image_root,
                "weights_sha256": weights, **decoding,
                **({"low_precision": low} if self.cfg.precision != "fp32" and low != "autocast" else {})}

    def input_files(self) -> list[str]:
        """The checkpoint, the dataset's sources and files (sidecars included), and the saved
        embeddings' directory: another output of the run, which the scores may not touch either."""
        checkpoint = [self.cfg.pretrained] if self.cfg.pretrained and os.path.isfile(self.cfg.pretrained) else []
        return [*checkpoint, *self.dataset.input_paths(), *([self.embeddings] if self.embeddings else [])]

    def prepare(self) -> None:
        if self.estimator is None:  # built (and so validated) before anything is written
            cfg = self.cfg
            if distributed.is_main():  # a large model takes a while to load, longer on a CPU
                weights = {None: "its own weights", "none": "random weights"}.get(cfg.pretrained, cfg.pretrained)
                cfg.progress.note(f"loading {cfg.model} ({cfg.backend}, {weights}) ...")
            torch.manual_seed(cfg.seed)  # a randomly initialised model (--pretrained none) is then reproducible
            self.estimator = build_estimator(cfg.backend, model=cfg.model, pretrained=cfg.pretrained,
                                             device=distributed.default_device_for_rank(cfg.device),
                                             precision=cfg.precision, decode=cfg.decode, compile=cfg.compile,
                                             cpu_decode_share=cfg.cpu_decode_share)

    def groups(self, units: list[str], processes: int) -> list[list[str]]:
        """Small units packed so that batches span them (sized from the leading units' pair counts),
        in enough groups for every DataLoader worker of every process to read one."""
        sample = units[:PACKING_SAMPLE]
        pairs = sum(self.dataset.count(unit) for unit in sample) / len(sample) if sample else 0.0
        return pack_units(units, pairs, self.cfg.batch_size, readers=max(1, self.cfg.workers) * processes)

    def readers(self) -> int:
        return max(1, self.cfg.workers)

    def prepared(self) -> EstimatorFacts:
        return self.facts

    def adopt(self, prepared: EstimatorFacts) -> None:
        self._facts = prepared

    @property
    def facts(self) -> EstimatorFacts:
        """What the scores and the saved embeddings record of the estimator (built here or in a
        worker), taken once."""
        if self._facts is None:
            self._facts = EstimatorFacts.of(self.estimator, weights=self.embeddings is not None)
        return self._facts

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
                                             cache=BetaCache() if cfg.beta_cache else None, weights_id=weights_id,
                                             progress=cfg.progress)
        return beta, "cache" if hit else "computed"

    def score(self, work: Work, commit: Commit) -> ScoringCounts:
        spec, cfg, estimator = self.spec, self.cfg, self.estimator
        left, right = modalities(spec.pair)
        workers = min(cfg.workers, len(work.groups))
        loader = batch_loader(PreparedBatches(self.dataset, work, estimator.preparer, cfg.batch_size), workers=workers,
                              pin_memory=estimator.device.type == "cuda")
        sink = PartSink(work.done, commit, accumulate=cfg.beta_mode == "shuffled",
                        save_block=self._save_block if self.embeddings is not None else None,
                        save_dtype=getattr(torch, cfg.embeddings_dtype))
        counts = run_pipeline(loader, estimator, left, right, sink, cfg.batch_size, self.meter, after_batch=slow_point)
        return replace(counts, workers=workers)

    def _save_block(self, unit: str, block: UnitEmbeddings | None) -> JsonObject:
        """Write the unit's embeddings as block N (N: the unit's place in the run) and return what
        its commit record says of them. A unit without a usable pair writes no block."""
        if not block or not block.left:
            return {"embeddings": 0, "embedding_bytes": 0}
        left, right = torch.cat(block.left).numpy(), torch.cat(block.right).numpy()
        metadata = pa.table({"key": pa.array(block.key, pa.string()), "shard": pa.array(block.shard, pa.string()),
                             "index": pa.array(block.index, pa.int64())})
        written = write_embedding_block(self.embeddings.path, self.block_of[unit], left, right, metadata)
        return {"embeddings": len(left), "embedding_bytes": written}

    def finish(self, records: dict[str, ScoredUnit], counts: ScoringCounts, todo: int,
               beta: BetaEstimate | None) -> Finishing:
        batches = counts.batches
        fill = counts.batch_rows / (batches * self.cfg.batch_size) if batches else 0.0
        if notice := small_shards_notice(counts.pairs, todo, self.cfg.batch_size, fill):
            notice_once("small-shards", notice, "batch_size")
        extra = {"batches": batches, "full_batches": counts.full_batches, "mean_batch_fill": fill,
                 "workers": counts.workers}
        if self.embeddings is not None and beta is not None:
            extra.update(self._saved_provenance(records, beta))
        return Finishing({"estimator": self.facts.provenance, "pair": self.spec.pair,
                          "input_shards": self.spec.shards, "dataset": self.dataset_record()}, extra)

    def dataset_record(self):
        """The dataset scored, its files fingerprinted once (the scores and the saved embeddings record it)."""
        if self._dataset is None:
            self._dataset = self.dataset.record(fingerprint=True)
        return self._dataset

    def _saved_provenance(self, records: dict[str, ScoredUnit], beta: BetaEstimate) -> JsonObject:
        """DIR/provenance.json, written when every unit is committed (its presence marks the
        directory complete): the model, its weights' hash, the preprocessing, the run's beta. Returns
        the scores summary's entries of the saved embeddings."""
        facts, cfg = self.facts, self.cfg
        rows = sum(r.embeddings for r in records.values())
        written = sum(r.embedding_bytes for r in records.values())
        left, right = modalities(self.spec.pair)
        provenance = SavedEmbeddings(
            written_by="pairclean score", pairclean_version=__version__, estimator=facts.provenance,
            weights_sha1=facts.weights_sha1, preprocessing=facts.preprocessing,
            pair=self.spec.pair, img_emb=left, text_emb=right, dtype=cfg.embeddings_dtype,
            normalised=True, rows=rows, bytes=written, dataset=self.dataset_record(),
            input_shards=self.spec.shards, beta=SavedBeta(**beta.as_dict()),
            blocks={str(self.block_of[u]): SavedBlock(unit=u, rows=r.embeddings)
                    for u, r in records.items() if r.embeddings})
        write_json(self.embeddings.path / SAVED_PROVENANCE, provenance.to_json())
        (self.embeddings.path / UNFINISHED).unlink(missing_ok=True)  # the directory is complete
        return {"embeddings_saved": rows, "embedding_bytes": written, "embeddings_dir": str(self.embeddings.path)}


def score(source: str | list[str] | DatasetSpec | Dataset, out: str | Path | Output, config: ScoreConfig | None = None,
          estimator=None, meter: StageMeter | None = None) -> ScoreResult:
    """Score every pair of `source` and write `out` (Parquet); resumes an interrupted run."""
    cfg = config or ScoreConfig()
    dataset = as_dataset(source)
    # A directory the run owns (it resumes): the blocks of committed units stay; `started` clears the rest.
    # It is another output of the run: the run's guard keeps the scores, their parts and their run manifest apart from it.
    embeddings = None if cfg.save_embeddings is None else open_output(
        cfg.save_embeddings, dataset.input_paths(), "save_embeddings", kind="directory", overwrite=None)
    if cfg.precision == "auto":  # pinned in the settings as what it means on this machine
        cfg = replace(cfg, precision=resolve_precision(cfg.device, "auto"))
    producer = ModelProducer(dataset, cfg, estimator, embeddings, meter)
    engine = build_engine(cfg.engine, **({"address": cfg.ray_address, "workers": cfg.ray_workers, "gpus": cfg.ray_gpus}
                                         if cfg.engine == "ray" else {}))
    return run_scoring(producer, out, producer.cfg, engine)
