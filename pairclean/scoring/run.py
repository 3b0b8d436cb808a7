"""`score`: source -> decode -> estimator -> scorer -> sink -> finalize, as one importable function.

DataLoader workers read units (tar shards / Parquet row groups), decode and preprocess images
and tokenise texts, and hand over ready batches; each batch carries the units that finished
inside it, so the main process commits a unit's part as soon as its last row is scored.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset

from pairclean.ops import distributed
from pairclean.backends import build_estimator, check_backend
from pairclean.backends.base import resolve_precision
from pairclean.backends.device_jpeg import finish_batch
from pairclean.backends.oom import OomBackoff
from pairclean.ops.notices import notice_once
from pairclean.ops.worker_memory import steady_worker_memory
from pairclean.core.beta import BETA_MODES, BetaCache, BetaEstimate, ShuffledAccumulator, cached_random_input_beta, shuffled_beta
from pairclean.errors import UserError
from pairclean.scoring.finalize import finalize, read_provenance
from pairclean.data.manifest import DatasetSpec, open_dataset
from pairclean.core.scorer import WEIGHT_FUNCTIONS
from pairclean.scoring.parts import PartStore, parts_dir_for
from pairclean.data.reader import UnitFailure, list_units, modalities, read_unit


@dataclass
class ScoreConfig:
    model: str = "ViT-B-32"
    pretrained: str = "openai"
    backend: str = "open_clip"
    device: str = "auto"
    precision: str = "fp32"  # fp32 | bf16 | fp16 | auto (resolved before anything is pinned)
    decode: str = "fast"  # fast (JPEG draft decode) | exact | gpu (JPEGs decoded on the CUDA device)
    compile: bool = False  # torch.compile the towers (eager fallback if compiling fails)
    beta_cache: bool = True  # reuse a random-inputs beta computed earlier for the same weights/K/seed
    batch_size: int = 256
    workers: int = 2
    beta_mode: str = "random-inputs"
    beta: float | None = None  # for beta_mode == "fixed"
    beta_k: int = 1024
    weight_fn: str = "cubic"
    seed: int = 0
    gmm_sample: int = 1_000_000
    overwrite: bool = False
    resume: bool = False  # insist on continuing an unfinished run (re-running resumes anyway)
    show_progress: bool = False

    def settings(self, spec: DatasetSpec, units: list[str]) -> dict:
        """What a resumed run must share with the run it continues."""
        keep = {k: v for k, v in asdict(self).items() if k not in ("device", "batch_size", "workers", "overwrite", "resume", "show_progress",
                                                                 "compile", "beta_cache")}
        return {**keep, "pair": spec.pair, "fields": asdict(spec.fields), "label_template": spec.label_template,
                "units_sha1": hashlib.sha1(json.dumps(units).encode()).hexdigest(), "n_units": len(units)}


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


@dataclass
class ScoreResult:
    out: Path
    summary: dict
    seconds: float
    pairs_scored_now: int
    resumed: bool
    provenance: dict = field(default_factory=dict)
    already_complete: bool = False  # the output was already this run's finished result

    @property
    def pairs_per_second(self) -> float:
        return self.pairs_scored_now / self.seconds if self.seconds > 0 else 0.0


def compute_beta(estimator, spec: DatasetSpec, cfg: ScoreConfig, built_from_config: bool = False
                 ) -> tuple[BetaEstimate | None, str]:
    """beta before scoring (random-inputs, fixed) and where it came from (given, cache, computed);
    None for shuffled (known only after scoring). `built_from_config`: the estimator was built
    from cfg (after seeding), so its provenance, the seed and the library versions name its
    weights and the beta cache need not hash them."""
    if cfg.beta_mode not in BETA_MODES:
        raise UserError(f"unknown beta mode {cfg.beta_mode!r}; choose one of {', '.join(BETA_MODES)}")
    if cfg.beta_mode == "fixed":
        if cfg.beta is None:
            raise UserError("--beta-mode fixed needs --beta VALUE")
        return BetaEstimate("fixed", float(cfg.beta), None, None), "given"
    if cfg.beta_mode == "shuffled":
        return None, "scored pairs"
    left, right = modalities(spec.pair)
    weights_id = None
    if built_from_config:
        from importlib.metadata import PackageNotFoundError, version

        def known(package: str) -> str | None:
            try:
                return version(package)
            except PackageNotFoundError:
                return None

        weights_id = json.dumps({"built_with_seed": cfg.seed, **{p: known(p) for p in
                                 ("torch", "open_clip_torch", "sentence-transformers", "transformers")}})
    beta, hit = cached_random_input_beta(estimator, left, right, k=cfg.beta_k, seed=cfg.seed,
                                         batch_size=min(cfg.batch_size, 256),
                                         cache=BetaCache() if cfg.beta_cache else None, weights_id=weights_id)
    return beta, "cache" if hit else "computed"


def scoring_progress(enabled: bool, total_units: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]scoring"), BarColumn(), MofNCompleteColumn(), TextColumn("units"),
                    TextColumn("{task.fields[pairs]:,} pairs"), TextColumn("{task.fields[rate]:,.0f} pairs/s"),
                    TimeElapsedColumn(), disable=not enabled, transient=False)


def score(source: str | list[str] | DatasetSpec, out: str | Path, config: ScoreConfig | None = None,
          estimator=None) -> ScoreResult:
    """Score every pair of `source` and write `out` (Parquet); resumes an interrupted run."""
    cfg = config or ScoreConfig()
    out = Path(out)
    distributed.init_from_env(device_type="cuda" if cfg.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    if not distributed.is_main():
        cfg = replace(cfg, show_progress=False)
    if cfg.weight_fn not in WEIGHT_FUNCTIONS:
        raise UserError(f"unknown weight function {cfg.weight_fn!r}; choose one of {', '.join(WEIGHT_FUNCTIONS)}")
    if cfg.batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    spec = source if isinstance(source, DatasetSpec) else open_dataset(source)
    if estimator is None:
        check_backend(cfg.backend, modalities(spec.pair))  # before any output exists
    if cfg.precision == "auto":  # pinned in the settings as what it means on this machine
        cfg = replace(cfg, precision=resolve_precision(cfg.device, "auto"))
    if not out.parent.exists():
        raise UserError(f"output directory {out.parent} does not exist")
    units = list_units(spec)
    store = PartStore(parts_dir_for(out))
    settings = cfg.settings(spec, units)
    # Under torchrun, rank 0 alone decides (finished? fresh or resumed? beta) and tells the others.
    finished = distributed.on_main(lambda: store.finished(out, settings, overwrite=cfg.overwrite, resume=cfg.resume))
    if finished is not None:  # the same command, re-run after it finished: nothing to do
        return ScoreResult(out, finished, 0.0, 0, True, read_provenance(out), already_complete=True)
    built_from_config = estimator is None
    if estimator is None:  # built (and so validated) before anything is written
        torch.manual_seed(cfg.seed)  # a randomly initialised model (--pretrained none) is then reproducible
        estimator = build_estimator(cfg.backend, model=cfg.model, pretrained=cfg.pretrained,
                                    device=distributed.default_device_for_rank(cfg.device),
                                    precision=cfg.precision, decode=cfg.decode, compile=cfg.compile)

    def start_run():
        start = store.begin(out, settings, units, overwrite=cfg.overwrite, resume=cfg.resume)
        saved = store.load_beta()
        began = time.perf_counter()
        if saved is not None:
            beta, source = BetaEstimate(**saved), "resumed"
        else:
            beta, source = compute_beta(estimator, spec, cfg, built_from_config)
            if beta is not None:
                store.save_beta(beta.as_dict())
        done = store.committed()
        return (start.units, start.resumed, beta, source, time.perf_counter() - began,
                [u for u in start.units if u not in done], len(done))

    units, resumed, beta, beta_source, beta_seconds, todo, n_done = distributed.on_main(start_run)
    # Units are split across ranks after the committed ones are removed, so a job restarted
    # with another world size still scores every remaining unit exactly once.
    mine = list(wds.split_by_node(todo))
    started = time.perf_counter()
    scored_now = _score_units(spec, mine, estimator, store, cfg, len(units), n_done)
    elapsed = time.perf_counter() - started
    scored_now = int(distributed.all_reduce_sum(scored_now))  # the whole job's pairs (also a barrier)
    if distributed.is_main() and (notice := small_shards_notice(scored_now, len(todo), cfg.batch_size)):
        notice_once("small-shards", notice)
    elapsed = distributed.all_reduce_sum(elapsed) / distributed.world_size()
    if not distributed.is_main():
        return ScoreResult(out, {}, elapsed, scored_now, resumed, {})

    records = store.committed()
    missing = [u for u in units if u not in records]
    if missing:
        raise RuntimeError(f"{len(missing)} unit(s) were not committed (first: {missing[0]})")
    if beta is None:
        beta = shuffled_beta([records[u].get("shuffled") for u in units])
    provenance = {"estimator": estimator.provenance(), "pair": spec.pair, "seed": cfg.seed,
                  "input_shards": spec.shards, "dataset": spec.name, "beta_mode": cfg.beta_mode,
                  "world_size": distributed.world_size()}
    summary = finalize(store, units, out, beta, cfg.weight_fn, cfg.seed, cfg.gmm_sample, provenance, records)
    summary["pairs_per_second"] = scored_now / elapsed if elapsed > 0 else 0.0
    summary["scoring_seconds"] = elapsed
    summary["beta_seconds"], summary["beta_source"] = beta_seconds, beta_source
    store.remove()
    return ScoreResult(out, summary, elapsed, scored_now, resumed, provenance)


def small_shards_notice(pairs: int, units: int, batch_size: int) -> str | None:
    """Say so when the shards, not --batch-size, set the batch size: a batch never spans two
    units (for bit-identical resume), so units under half a batch leave batches under half full."""
    per_unit = pairs / units if units else 0.0
    if units < 4 or per_unit == 0 or per_unit >= batch_size / 2:
        return None
    return (f"the shards hold {per_unit:,.0f} pairs on average and a batch never spans two shards, so batches "
            f"were about {per_unit / batch_size:.0%} of --batch-size {batch_size}; on a GPU that caps throughput "
            f"(ViT-B-32 on an H100: 1.8k pairs/s in 40-pair batches, ~10k in 512): use shards of thousands of pairs")


def _score_units(spec: DatasetSpec, units: list[str], estimator, store: PartStore, cfg: ScoreConfig,
                 total_units: int, already: int) -> int:
    if not units:
        return 0
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
    started = time.perf_counter()
    with scoring_progress(cfg.show_progress, total_units) as progress:
        task = progress.add_task("score", total=total_units, completed=already, pairs=0, rate=0.0)
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
                store.commit(unit, dict(columns), {"errors": errors, "failure": failure,
                                                   "shuffled": accumulators.pop(unit, ShuffledAccumulator()).state()})
                progress.advance(task)
            elapsed = time.perf_counter() - started
            progress.update(task, pairs=scored, rate=scored / elapsed if elapsed else 0.0)
    return scored
