"""`pairclean bench score`: how close end-to-end scoring comes to the model's own ceiling.

Three measurements in one process, on one estimator (loaded once), same batch size and precision:

(a) ceiling   - the estimator's encode on batches already on the device: the same rows per batch
                and the same tokenised captions as the data (so the text tower runs the same
                lengths), random pixels for images. No reading, no decoding, no copies; each
                batch's sims read back one batch behind, as the pipeline's sink reads them (the
                host queues batch i+1 while the device computes batch i).
(b) end-to-end - `pairclean.scoring.model.score` on the given shards: workers, decode, encode, sink,
                finalize. Its scoring loop is what (b)/(a) compares; the whole call (beta and
                finalize included) is reported beside it.
(c) naive     - the loop most people write first, as open_clip's README shows it: PIL decodes
                each image in full in the main process, open_clip's own preprocess and
                tokenizer, batched encode_image / encode_text of the model as loaded (fp32
                weights; under torch.autocast for bf16/fp16), no workers.
(d) pipeline only - (b)'s scoring loop with the towers replaced by a zero-cost stand-in: the same
                loader, workers, collation, copies to the device, device preprocessing, scorer and
                sink. What it cannot do faster than, with any model: its pairs/s, the main
                process's CPU per pair by stage, the bytes a pair costs between worker and main
                process. With `decode` gpu it runs the device decoder even on a CPU, so its
                per-batch cost shows on a machine without a GPU too.

Peak memory, GPU use and CPU seconds per phase are measured by `bench.measure`. The JSON report is
written after each phase (a run stopped by a timeout keeps what it had measured), and records
whether each tower ran compiled (`compiled_towers`: a tower that fell back to eager says why), so a
`compile` figure is never an eager one unawares.
"""

from __future__ import annotations

import copy
import functools
import io
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pyarrow as pa
import torch
from PIL import Image

from pairclean.backends import build_estimator, check_backend
from pairclean.backends.base import autocast_context, move_batch, prepare_each, resolve_precision
from pairclean.backends.device_jpeg import DEVICE_DECODERS
from pairclean.backends.feed import HostCopies
from pairclean.backends.inputs import DeviceImages, StandardTransform, TokenBatch
from pairclean.backends.oom import OomBackoff, batch_rows
from pairclean.backends.open_clip import OpenClipEstimator
from pairclean.backends.text_trim import TextCuts
from pairclean.data.dataset import Dataset, as_dataset
from pairclean.data.spec import DatasetSpec, UnitFailure, modalities
from pairclean.config import COUNT, at_least, declare
from pairclean.errors import UserError
from pairclean.ops.guard import Output, open_output
from pairclean.ops.measure import StageMeter
from pairclean.bench.measure import GpuBusy, PeakMemory, cpu_seconds, gpu_peak_mib, gpu_peak_reset, in_a_worker
from pairclean.ops.progress import SILENT, Progress
from pairclean.ops.records import JsonObject, Keyed
from pairclean.scoring.model import ModelProducer, ScoreConfig, score


# ---------------------------------------------------------------- results

@dataclass
class Phase:
    name: str
    pairs: int
    seconds: float
    peak_mib: float  # PSS of this process + its workers
    peak_rss_mib: float  # this process
    gpu_peak_mib: float | None = None
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average before / after
    cpu_seconds: float = 0.0  # this process + its workers
    extra: dict = field(default_factory=dict)

    @property
    def pairs_per_second(self) -> float:
        return self.pairs / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_ms_per_pair(self) -> float:
        return 1000 * self.cpu_seconds / self.pairs if self.pairs else 0.0


@dataclass
class PipelineOnly:
    """(d): the scoring loop around a zero-cost model. `meter`: `StageMeter.summary()` of the main
    process; `worker_ms_per_pair`: a worker's CPU per pair with the round's preparer (both
    sides), so `workers` of them can prepare `worker_capacity` pairs/s."""

    decode: str
    workers: int
    worker_ms_per_pair: float
    meter: dict
    load: tuple[float, float] = (0.0, 0.0)

    @property
    def worker_capacity(self) -> float:
        return max(self.workers, 1) * 1000 / self.worker_ms_per_pair if self.worker_ms_per_pair > 0 else 0.0

    @property
    def over_worker_capacity(self) -> float | None:
        capacity = self.worker_capacity
        return self.meter["pairs_per_second"] / capacity if capacity else None

    def as_dict(self) -> JsonObject:
        return {**self.meter, "decode": self.decode, "workers": self.workers,
                "worker_ms_per_pair": self.worker_ms_per_pair, "worker_capacity_pairs_per_second": self.worker_capacity,
                "over_worker_capacity": self.over_worker_capacity, "load": self.load}


@dataclass
class BenchRound:
    ceiling: Phase | None
    end_to_end: Phase | None
    naive: Phase | None
    pipeline_only: PipelineOnly | None = None

    def _ratio(self, top: Phase | None, bottom: Phase | None, attr: str) -> float | None:
        if top is None or bottom is None or not getattr(bottom, attr):
            return None
        return getattr(top, attr) / getattr(bottom, attr)

    @property
    def vs_ceiling(self) -> float | None:
        return self._ratio(self.end_to_end, self.ceiling, "pairs_per_second")

    @property
    def vs_naive(self) -> float | None:
        return self._ratio(self.end_to_end, self.naive, "pairs_per_second")

    @property
    def cpu_vs_ceiling(self) -> float | None:
        """Ceiling CPU per pair over end-to-end CPU per pair: the share of the machine's work
        that is the model's own (1.0 = decoding, reading and writing cost nothing)."""
        return self._ratio(self.ceiling, self.end_to_end, "cpu_ms_per_pair")

    @property
    def cpu_vs_naive(self) -> float | None:
        return self._ratio(self.naive, self.end_to_end, "cpu_ms_per_pair")


@dataclass
class BenchReport:
    config: dict
    rounds: list[BenchRound]
    prepare_ms: dict[str, float] = field(default_factory=dict)  # worker CPU ms per pair and side

    def median(self, attr: str) -> float | None:
        values = [getattr(r, attr) for r in self.rounds]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def as_dict(self) -> JsonObject:
        def phase(p: Phase | None) -> dict | None:
            return None if p is None else {**asdict(p), "pairs_per_second": p.pairs_per_second,
                                           "cpu_ms_per_pair": p.cpu_ms_per_pair}

        pipelines = [r.pipeline_only for r in self.rounds if r.pipeline_only is not None]
        # Top level: the round whose pipeline-only pairs/s is the median (the only one, with one round).
        median = sorted(pipelines, key=lambda p: p.meter["pairs_per_second"])[len(pipelines) // 2] if pipelines else None
        return {"config": self.config, "prepare_ms": self.prepare_ms,
                "pipeline_only": median.as_dict() if median else None,
                "worker_bytes_per_pair": median.meter["worker_bytes_per_pair"] if median else None,
                "rounds": [{"ceiling": phase(r.ceiling), "end_to_end": phase(r.end_to_end), "naive": phase(r.naive),
                            "pipeline_only": r.pipeline_only.as_dict() if r.pipeline_only else None,
                            "end_to_end_over_ceiling": r.vs_ceiling, "end_to_end_over_naive": r.vs_naive,
                            "cpu_end_to_end_over_ceiling": r.cpu_vs_ceiling, "cpu_end_to_end_over_naive": r.cpu_vs_naive}
                           for r in self.rounds],
                "median_end_to_end_over_ceiling": self.median("vs_ceiling"),
                "median_end_to_end_over_naive": self.median("vs_naive"),
                "median_cpu_end_to_end_over_ceiling": self.median("cpu_vs_ceiling"),
                "median_cpu_end_to_end_over_naive": self.median("cpu_vs_naive")}


# ---------------------------------------------------------------- (a) the ceiling

def _batch_plan(data: Dataset, groups: list[list[str]], batch_size: int, max_pairs: int) -> list[dict[str, list]]:
    """The valid rows of the data as the pipeline batches them (a group's units as one stream,
    `batch_size` rows counted with error rows), text values kept, image bytes dropped."""
    left, right = modalities(data.spec.pair)
    plan: list[dict[str, list]] = []
    seen = 0
    for group in groups:
        rows, count = {"left": [], "right": []}, 0
        for unit in group:
            for item in data.read(unit):
                if isinstance(item, UnitFailure):
                    continue
                if item.error is None:
                    rows["left"].append(item.left if left == "text" else None)
                    rows["right"].append(item.right if right == "text" else None)
                count += 1
                seen += 1
                if count == batch_size or seen >= max_pairs:
                    if rows["left"]:
                        plan.append(rows)
                    rows, count = {"left": [], "right": []}, 0
                if seen >= max_pairs:
                    return plan
        if rows["left"]:
            plan.append(rows)
    return plan


def ceiling_pixels(estimator, n: int, generator: torch.Generator) -> torch.Tensor:
    """Random pixels as the pipeline hands them to the estimator: uint8 (normalised in `encode`, as
    the pipeline's are) where workers send uint8, in their layout (planar where torch resizes in the
    workers, channels last otherwise: `stack_pixels`); the estimator's own random images otherwise."""
    preparer = getattr(estimator, "preparer", None)
    transform = getattr(preparer, "transform", None)
    if transform is None:
        return estimator.random_batch("image", n, generator)
    size = transform.crop
    if getattr(preparer, "worker_resize", None) == "torch":
        return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=generator)
    return torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=generator).permute(0, 3, 1, 2)


def measure_ceiling(estimator, data: Dataset, batch_size: int, min_seconds: float,
                    max_pairs: int = 8192, groups: list[list[str]] | None = None) -> Phase:
    """Encode batches shaped like the data's, held on the device, until `min_seconds` have passed
    (one pass at least), each batch's sims read back after the next batch is queued (`HostCopies`,
    as the pipeline's sink): a read of each batch as it is queued (`.cpu()`) idled the device while
    the host queued the next, understating the ceiling. `groups`: the run's packing of the units
    (default: one unit each)."""
    left, right = modalities(data.spec.pair)
    plan = _batch_plan(data, groups or [[u] for u in data.units()], batch_size, max_pairs)
    if not plan:
        raise UserError("no valid pair in the given shards to benchmark on")
    generator = torch.Generator().manual_seed(0)
    pixels = ceiling_pixels(estimator, batch_size, generator) if "image" in (left, right) else None
    batches = []
    for rows in plan:
        n = len(rows["left"])
        inputs = {}
        for side, modality in (("left", left), ("right", right)):
            if modality == "image":
                inputs[side] = pixels[:n]
            else:
                prep = estimator.preparer
                inputs[side] = prep.collate(modality, [prep.prepare(modality, t) for t in rows[side]])
        batches.append((n, move_batch(inputs, estimator.device)))  # once: the model alone is measured
    backoff = {left: OomBackoff(), right: OomBackoff()}
    behind: list[HostCopies] = []  # the batch queued before, whose sims are read once the next is queued

    def step(inputs) -> None:
        u = backoff[left](lambda b: estimator.encode(left, b), inputs["left"])
        v = backoff[right](lambda b: estimator.encode(right, b), inputs["right"])
        behind.append(HostCopies({"sims": (u * v).sum(-1)}))
        if len(behind) > 1:
            behind.pop(0).wait()

    def drain() -> None:
        while behind:
            behind.pop(0).wait()

    # Warm-up on every distinct input shape (rows, and trimmed caption length per text bucket):
    # oneDNN/cuDNN build kernels per shape and torch.compile per shape, a one-time cost that a
    # long job amortises. The end-to-end run that follows meets the same shapes.
    seen: set = set()
    for _, inputs in batches:
        shape = _shape_key(inputs, getattr(estimator, "text_cuts", None))
        if shape not in seen:
            seen.add(shape)
            step(inputs)
            drain()
    load0 = os.getloadavg()[0]
    gpu_peak_reset(estimator.device)
    pairs, elapsed, passes = 0, 0.0, 0
    cpu0 = cpu_seconds()
    with PeakMemory() as mem, GpuBusy(estimator.device) as busy:
        started = time.perf_counter()
        while passes == 0 or elapsed < min_seconds:
            for n, inputs in batches:
                step(inputs)
                pairs += n
                elapsed = time.perf_counter() - started
                if passes > 0 and elapsed >= min_seconds:
                    break
            passes += 1
        drain()
        elapsed = time.perf_counter() - started
    cpu = cpu_seconds() - cpu0
    extra = {"batches_per_pass": len(batches), "passes": passes, "warmup_shapes": len(seen),
             "gpu_utilisation": busy.percent,
             "chunk_after_oom": {m: b.chunk for m, b in backoff.items() if b.halvings}}
    extra.update(_text_trim_gain(estimator, left, right, batches))
    extra["compiled_towers"] = compiled_towers(estimator)
    return Phase("ceiling (model only)", pairs, elapsed, mem.peak_mib, mem.peak_rss_mib,
                 gpu_peak_mib(estimator.device), (load0, os.getloadavg()[0]), cpu, extra)


def _shape_key(inputs: dict, cuts: TextCuts | None) -> tuple:
    """The shapes the towers see for a batch (the text tower's: each group's rows and cut; token
    ends come only from an estimator that cuts its captions)."""
    key = []
    for value in inputs.values():
        if isinstance(value, TokenBatch):
            key.append(tuple((len(rows), cut) for rows, cut in cuts.groups(value.ends, value.tokens.shape[1])))
        else:
            key.append(tuple(getattr(value, "shape", ())) or type(value).__name__)
    return tuple(key)


def _text_trim_gain(estimator, left: str, right: str, batches) -> JsonObject:
    """Seconds per caption of the text tower with and without trimming on the first batch, and
    the positions per caption it computes: what the exact trimming contributes (open_clip only)."""
    if not getattr(estimator, "text_trim", False) or "text" not in (left, right):
        return {}
    side = "right" if right == "text" else "left"
    batch = batches[0][1][side]
    tokens, ends = batch.tokens.to(estimator.device), batch.ends
    n = tokens.shape[0]

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(2):  # the faster of two: the first call of a new shape pays for kernel setup
            started = time.perf_counter()
            with torch.no_grad(), estimator.tower_context("text"):  # as `encode` runs the tower
                fn(tokens).float().cpu()
            best = min(best, time.perf_counter() - started)
        return best / n

    trimmed = timed(lambda t: estimator.encode("text", TokenBatch(t, ends)))
    full = timed(estimator.model.encode_text)
    positions = sum(cut * len(rows) for rows, cut in estimator.text_cuts.groups(ends, tokens.shape[1])) / n
    return {"text_tokens_trimmed": positions, "text_tokens_full": int(tokens.shape[1]),
            "text_seconds_per_caption_trimmed": trimmed, "text_seconds_per_caption_full": full}


# ---------------------------------------------------------------- worker cost per pair

def sample_items(data: Dataset, max_items: int) -> list:
    """The first `max_items` pairs of `data` that read without error."""
    items = []
    for unit in data.units():
        for item in data.read(unit):
            if not isinstance(item, UnitFailure) and item.error is None:
                items.append(item)
            if len(items) >= max_items:
                return items
    return items


def measure_prepare_cost(estimator, data: Dataset, max_items: int = 256, preparers: dict | None = None,
                         repeats: int = 3) -> Keyed[str, float]:
    """CPU milliseconds a DataLoader worker spends per pair on each side (decode + preprocess for
    images, tokenising for texts, collation), measured in a DataLoader worker (what a worker
    does differs from the main process's: `decode_plain_jpeg`), on its thread's CPU clock and its
    one torch thread, so a busy machine does not inflate it; the best of `repeats` passes (one pass
    read 417-623 pairs/s of capacity on the same quiet machine: the first pass pays cold caches)
    over the first `max_items` pairs (64 web pairs cost 1.52 ms an image, 256 of them 1.65: too few
    make the capacity an overestimate).
    For open_clip, full decode ("exact") too; `preparers`: label -> preparer to measure instead."""
    left, right = modalities(data.spec.pair)
    items = sample_items(data, max_items)
    if not items:
        return {}
    if preparers is None:
        preparers = {"": estimator.preparer}
        if isinstance(estimator, OpenClipEstimator) and "image" in (left, right) and estimator.preparer.draft_size:
            p = estimator.preparer
            preparers["exact "] = type(p)(p.preprocess, p.tokenizer, None, exact=True)
    jobs = [(f"{label}{side} {modality}", prep, modality, [getattr(it, side) for it in items])
            for label, prep in preparers.items() for side, modality in (("left", left), ("right", right))
            if not (label and modality != "image")]
    return {**dict(in_a_worker(functools.partial(_best_pass, repeats=max(1, repeats)), jobs)), "items": len(items)}


def _best_pass(job: tuple, repeats: int) -> tuple[str, float]:
    """One of `measure_prepare_cost`'s jobs, timed where it runs: its best pass, ms a pair."""
    name, prep, modality, values = job
    passes = []
    for _ in range(repeats):
        started = time.thread_time()
        prep.collate(modality, [x for x in prepare_each(prep, modality, values) if not isinstance(x, Exception)])
        passes.append((time.thread_time() - started) * 1000 / len(values))
    return name, min(passes)


# ---------------------------------------------------------------- (b) end to end

def measure_end_to_end(estimator, data: Dataset, cfg: ScoreConfig, workdir: Path) -> Phase:
    """`score()` on the shards, its main process metered stage by stage (`extra["meter"]`: on a GPU,
    where the host waited - for the workers in `receive`, for the device in `sink` - tells which
    side bounds the run)."""
    out = workdir / "bench-scores.parquet"
    meter = StageMeter()
    load0 = os.getloadavg()[0]
    gpu_peak_reset(estimator.device)
    cpu0 = cpu_seconds()
    with PeakMemory() as mem, GpuBusy(estimator.device) as busy:
        started = time.perf_counter()
        result = score(data, out, replace(cfg, overwrite=True, progress=SILENT), estimator=estimator, meter=meter)
        whole = time.perf_counter() - started
    cpu = cpu_seconds() - cpu0  # the whole call: beta (none with shuffled/fixed/cached) and finalize included
    s = result.summary
    extra = {"whole_call_seconds": whole, "whole_call_pairs_per_second": result.pairs_scored_now / whole,
             "beta_seconds": s.beta_seconds, "beta_source": s.beta_source,
             "errors": s.errors, "workers": cfg.workers, "gpu_utilisation": busy.percent,
             "batches": s.batches,
             "full_batches": s.full_batches, "mean_batch_fill": s.mean_batch_fill,
             "meter": meter.summary(), "compiled_towers": compiled_towers(estimator)}
    return Phase("end-to-end scoring loop", result.pairs_scored_now, result.seconds, mem.peak_mib, mem.peak_rss_mib,
                 gpu_peak_mib(estimator.device), (load0, os.getloadavg()[0]), cpu, extra)


# ---------------------------------------------------------------- (c) the naive loop

def measure_naive(estimator, data: Dataset, batch_size: int, max_pairs: int) -> Phase | None:
    """PIL full decode per sample + open_clip's own preprocess/tokenizer/encode, no workers.
    None where it does not apply (not open_clip, or the left side is not an image)."""
    left, right = modalities(data.spec.pair)
    if not isinstance(estimator, OpenClipEstimator) or (left, right) != ("image", "text") or max_pairs <= 0:
        return None
    model, preprocess, tokenizer = estimator.model, estimator.preparer.preprocess, estimator.tokenizer
    device = estimator.device
    if estimator.precision != "fp32":
        # The estimator keeps its matmul weights in bf16/fp16, open_clip loads them as fp32: an fp32
        # copy (of the rounded values; only the timing is used) runs the way the README's loop does.
        model = copy.deepcopy(model).float()
    images: list[torch.Tensor] = []
    texts: list[str] = []
    pairs = 0

    @torch.no_grad()
    def flush() -> None:
        with autocast_context(device, estimator.precision):
            u = model.encode_image(torch.stack(images).to(device))
            v = model.encode_text(tokenizer(texts).to(device))
        torch.nn.functional.cosine_similarity(u.float(), v.float()).cpu()
        images.clear()
        texts.clear()

    load0 = os.getloadavg()[0]
    gpu_peak_reset(device)
    cpu0 = cpu_seconds()
    with PeakMemory() as mem:
        started = time.perf_counter()
        for unit in data.units():
            for item in data.read(unit):
                if isinstance(item, UnitFailure) or item.error is not None:
                    continue
                try:
                    image = Image.open(io.BytesIO(item.left)).convert("RGB")
                except Exception:  # noqa: BLE001 - PIL raises many types for data it cannot read
                    continue  # the naive loop skips what it cannot read
                images.append(preprocess(image))
                texts.append(item.right)
                pairs += 1
                if len(images) == batch_size:
                    flush()
                if pairs >= max_pairs:
                    break
            if pairs >= max_pairs:
                break
        if images:
            flush()
        elapsed = time.perf_counter() - started
    return Phase("naive loop", pairs, elapsed, mem.peak_mib, mem.peak_rss_mib, gpu_peak_mib(device),
                 (load0, os.getloadavg()[0]), cpu_seconds() - cpu0)


# ---------------------------------------------------------------- (d) pipeline only

class ZeroCostEstimator:
    """An estimator's stand-in for the pipeline-only round: its device, preparer and device
    preprocessing, with `encode` returning rows of a fixed table of unit vectors (a gather, no
    model arithmetic). With `device_decode` (a device decoder's name), JPEGs are left for that
    decoder even on a CPU device, so the device path's per-batch cost is measured where there is
    no GPU."""

    TABLE_ROWS = 4096

    def __init__(self, estimator, modality: str, device_decode: str | None = None):
        self.inner, self.device, self.precision = estimator, estimator.device, estimator.precision
        self.model = estimator.model
        self.preparer, self.decoder = estimator.preparer, getattr(estimator, "device_decoder", None)
        if device_decode and self.decoder is None and isinstance(estimator, OpenClipEstimator):
            transform, cls = StandardTransform.parse(estimator.preparer.preprocess), DEVICE_DECODERS[device_decode]
            if cls.supports(transform) and cls.unavailable() is None:
                self.preparer = estimator.preparer.leaving_to(cls)  # the estimator's, leaving the decoder its part
                self.decoder = cls(transform, self.device, estimator.preparer.preprocess)
        self.decode = self.decoder.name if self.decoder is not None else getattr(estimator, "decode", "-")
        generator = torch.Generator().manual_seed(0)
        width = estimator.encode(modality, estimator.random_batch(modality, 2, generator)).shape[1]  # `modality`: one it encodes
        table = torch.randn((self.TABLE_ROWS, width), generator=generator)
        self.table = torch.nn.functional.normalize(table, dim=-1).to(self.device)
        self.offset = 0

    def finish_batch(self, modality: str, inputs):
        if isinstance(inputs, DeviceImages):
            return self.decoder(inputs)
        return inputs, {}

    def warm_up(self) -> None:
        if self.decoder is not None:
            self.decoder.warm_up()

    def encode(self, modality: str, batch) -> torch.Tensor:
        n = batch_rows(batch)
        rows = torch.arange(self.offset, self.offset + n, device=self.device) % self.TABLE_ROWS
        self.offset += n
        return self.table[rows]

    def random_batch(self, modality: str, n: int, generator: torch.Generator):
        return self.inner.random_batch(modality, n, generator)

    def provenance(self) -> JsonObject:
        return {**self.inner.provenance(), "model": "zero-cost stand-in (pipeline-only benchmark)"}


def measure_pipeline_only(estimator, data: Dataset, cfg: ScoreConfig, workdir: Path) -> PipelineOnly:
    """(b)'s scoring loop around `ZeroCostEstimator(estimator)`, metered stage by stage. beta is
    fixed (0): a beta from a stand-in model must never reach the beta cache; the beta rule alone
    (finalize is not measured, and a GMM over stand-in similarities would only warn)."""
    left, right = modalities(data.spec.pair)
    zero = ZeroCostEstimator(estimator, right, device_decode=cfg.decode if cfg.decode in DEVICE_DECODERS else None)
    cost = measure_prepare_cost(zero, data, preparers={"": zero.preparer})
    worker_ms = sum(cost.get(f"{side} {m}", 0.0) for side, m in (("left", left), ("right", right)))
    run_cfg = replace(cfg, overwrite=True, progress=SILENT, beta_mode="fixed", beta=0.0, beta_cache=False, rules=("beta",))
    meter = StageMeter()
    pa.array([0.0])  # pyarrow imports pandas at its first conversion: 1.7 s of CPU once per process, not per pair
    load0 = os.getloadavg()[0]
    children = _children_cpu()
    score(data, workdir / "pipeline-only.parquet", run_cfg, estimator=zero, meter=meter)
    summary = meter.summary()
    # The workers' CPU in the run (reaped when it ends), start-up included: beside `worker_ms`, what
    # reading, collating and handing batches over cost them on top of preparing the pairs.
    summary["worker_cpu_ms_per_pair"] = 1000 * (_children_cpu() - children) / max(meter.pairs, 1)
    return PipelineOnly(zero.decode, cfg.workers, worker_ms, summary, (load0, os.getloadavg()[0]))


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------- all four

def compiled_towers(estimator) -> dict[str, str] | None:
    """How each tower of the estimator runs now (`compiled`, `eager`, or `eager after: <why>` where
    compiling failed); None for an estimator that compiles nothing."""
    state = getattr(estimator, "compiled_towers", None)
    return state() if state is not None else None


@declare(naive_pairs=at_least(0), min_seconds=at_least(0), repeat=COUNT)
def bench_score(source: str | list[str] | DatasetSpec | Dataset, cfg: ScoreConfig, naive_pairs: int = 512,
                min_seconds: float = 10.0, repeat: int = 1, estimator=None, progress: Progress = SILENT,
                pipeline_only: bool = False, out: Output | None = None) -> BenchReport:
    """Measure (a), (b), (c), (d) `repeat` times, interleaved, with one estimator; `pipeline_only`:
    (d) alone (no model arithmetic: quick on any machine). `out`: the report, written after each
    phase, so a run cut short keeps the phases it measured."""
    data = as_dataset(source)
    spec = data.spec
    cfg = cfg.resolved(spec.pair)
    if cfg.precision == "auto":
        cfg = replace(cfg, precision=resolve_precision(cfg.device, "auto"))
    if estimator is None:
        check_backend(cfg.backend, modalities(spec.pair))
        torch.manual_seed(cfg.seed)
        estimator = build_estimator(cfg.backend, model=cfg.model, pretrained=cfg.pretrained, device=cfg.device,
                                    precision=cfg.precision, decode=cfg.decode, compile=cfg.compile,
                                    cpu_decode_share=cfg.cpu_decode_share)
    say = progress.note
    report = BenchReport({}, [])

    def keep() -> None:
        """The report so far, as it stands after a phase (the towers' compile state as of now)."""
        report.config = {
            "model": cfg.model, "pretrained": cfg.pretrained, "backend": cfg.backend,
            "device": str(estimator.device), "precision": estimator.precision,
            "batch_size": cfg.batch_size, "workers": cfg.workers, "decode": getattr(estimator, "decode", cfg.decode),
            "cpu_decode_share": cfg.cpu_decode_share,
            "compile": cfg.compile, "compiled_towers": compiled_towers(estimator),
            "text_trim": getattr(estimator, "text_trim", False),
            "text_cuts": asdict(cuts) if (cuts := getattr(estimator, "text_cuts", None)) else None,
            "autocast": getattr(estimator, "autocast", None),  # the towers under autocast (open_clip)
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "shards": len(spec.shards), "pair": spec.pair, "pipeline_only": pipeline_only}
        if out is not None:
            write_report(report, out)

    say("worker cost per pair ...")
    report.prepare_ms = measure_prepare_cost(estimator, data)
    keep()
    if cfg.beta_mode == "random-inputs" and cfg.beta_cache and not pipeline_only:
        say("beta (once; the measured runs read it from the beta cache) ...")
        ModelProducer(data, cfg, estimator).random_beta()
    groups = ModelProducer(data, cfg, estimator).groups(data.units(), 1)  # as a scoring run of one process packs them
    with tempfile.TemporaryDirectory(prefix="pairclean-bench-") as tmp:
        for i in range(repeat):
            tag = f"[{i + 1}/{repeat}] " if repeat > 1 else ""
            done = BenchRound(None, None, None)
            report.rounds.append(done)
            if not pipeline_only:
                say(f"{tag}(a) model-only ceiling ...")
                done.ceiling = measure_ceiling(estimator, data, cfg.batch_size, min_seconds, groups=groups)
                keep()
                say(f"{tag}(b) end-to-end pairclean score ...")
                done.end_to_end = measure_end_to_end(estimator, data, cfg, Path(tmp))
                keep()
                say(f"{tag}(c) naive reference loop ...")
                done.naive = measure_naive(estimator, data, cfg.batch_size, naive_pairs)
                keep()
            say(f"{tag}(d) pipeline only (zero-cost model) ...")
            done.pipeline_only = measure_pipeline_only(estimator, data, cfg, Path(tmp))
            keep()
    return report


def write_report(report: BenchReport, out: Output | Path) -> None:
    """The report as JSON, through the output guard (`out` opened by the caller against its inputs)."""
    open_output(out).write_json(report.as_dict())
