"""The scoring run's main process (`scoring/pipeline.py`) and what measures it: the pipeline-only
round of `pairclean bench score`, the stage meter, what crosses from the workers, and the pinned
version of the device decoder."""

from __future__ import annotations

import json
import signal
import time
from dataclasses import replace

import duckdb
import pytest
import torch
from helpers import forked, host_copies_without_a_driver
from torchvision import transforms as T

from pairclean.backends.device_jpeg import DeviceJpegDecoder
from pairclean.backends.inputs import StandardTransform
from pairclean.cli import main
from pairclean.errors import UserError
from pairclean.ops.measure import StageMeter
from pairclean.scoring.batches import AS_THEY_COME, batch_loader
from pairclean.scoring.model import ModelProducer, score
from pairclean.scoring.pipeline import STAGES

pytestmark = pytest.mark.usefixtures("fresh_notices")


def bench_pipeline_only(coco_shards, tmp_path, *extra) -> dict:
    out = tmp_path / "bench.json"
    main(["bench", "score", str(coco_shards), "--model", "pairclean-tiny", "--pretrained", "none", "--batch-size", "4",
          "--workers", "1", "--pipeline-only", "--json", str(out), *extra])
    return json.loads(out.read_text())


def test_pipeline_only_round_reports_the_main_process_by_stage_and_what_a_pair_costs(coco_shards, tmp_path, capsys):
    report = bench_pipeline_only(coco_shards, tmp_path)
    printed = capsys.readouterr().out
    p = report["pipeline_only"]
    assert p["decode"] == "fast" and p["workers"] == 1
    assert set(p["stages"]) == {*STAGES, "other threads"} and all(v >= 0 for v in p["stages"].values())
    assert p["main_cpu_ms_per_pair"] >= sum(v for k, v in p["stages"].items() if k != "other threads") - 1e-9
    # 16 pairs in batches of 4: the first batch is start-up, the other 12 pairs the steady state.
    assert p["pairs"] == 12 and p["pairs_per_second"] == pytest.approx(p["pairs"] / p["seconds"])
    # uint8 pixels (3 x 64 x 64 for the tiny model) and int64 tokens (32), not float32 pixels.
    assert 3 * 64 * 64 + 32 * 8 <= report["worker_bytes_per_pair"] < 3 * 64 * 64 + 32 * 8 + 200
    assert p["worker_capacity_pairs_per_second"] == pytest.approx(1000 / p["worker_ms_per_pair"])
    assert report["rounds"][0]["ceiling"] is None and report["config"]["pipeline_only"]
    assert report["config"]["text_cuts"] == {"buckets": 4, "step": 1}  # how the text tower ran (eager CPU)
    assert "main process in all" in printed and "pipeline only (decode fast)" in printed


def test_pipeline_only_runs_the_device_decoder_on_a_cpu(coco_shards, tmp_path):
    """--decode gpu without CUDA: the scoring falls back to the workers, the pipeline-only round
    still runs the device path (JPEG bytes cross, the main process decodes) to measure it."""
    import webdataset as wds

    p = bench_pipeline_only(coco_shards, tmp_path, "--decode", "gpu")["pipeline_only"]
    assert p["decode"] == "gpu" and p["pairs"] == 12
    sizes = [len(s["jpg"]) for s in wds.WebDataset(sorted(map(str, coco_shards.glob("*.tar"))), shardshuffle=False)]
    assert min(sizes) <= p["worker_bytes_per_pair"] <= max(sizes) + 32 * 8 + 200  # the JPEG files, not pixels
    assert p["stages"]["device preprocessing"] > 0


def test_stage_meter_measures_the_steady_state_after_the_first_batch():
    def loader():  # iter() takes 20 ms (a DataLoader forking its workers), its first batch 10 ms more
        time.sleep(0.02)
        return iter(slow_batches())

    def slow_batches():
        for size in (100, 10, 10):
            time.sleep(0.01)
            yield size

    class Loader:
        __iter__ = staticmethod(loader)

    meter = StageMeter()
    meter.start()
    for size in meter.timed(Loader()):
        meter.mark("receive")
        meter.mark("sink")
        meter.batch(size, 50 * size)  # the first (start-up) batch is not counted
    meter.stop()
    summary = meter.summary()
    assert summary["pairs"] == 20 and summary["worker_bytes_per_pair"] == 50
    assert summary["startup_seconds"] >= 0.03 and summary["seconds"] >= 0.02  # sleeps: lower bounds only
    assert summary["stage_wall_ms_per_pair"]["receive"] >= 1.0  # 2 x 10 ms over 20 pairs
    steps = summary["startup_milestones"]
    assert list(steps) == ["loader started", "first batch received", "first batch through"]
    assert 0.02 <= steps["loader started"] <= steps["first batch received"] <= steps["first batch through"]
    assert steps["first batch received"] >= 0.03 and steps["first batch through"] == summary["startup_seconds"]


def test_a_metered_loader_starts_in_the_callers_thread_before_the_prefetching_threads_warm_up():
    """`StageMeter.timed` starts the loader where it is called, as an unmetered run's prefetcher does
    (`iter()` in the consumer's thread, then the thread's warm-up beside the workers' start). Broken
    variant caught: `timed` as a generator (89907df), whose `iter()` ran in the prefetching thread
    after the warm-up - a bench round serialising what `score` overlaps."""
    import threading

    from pairclean.backends.feed import DevicePrefetcher

    events = []

    class Loader:
        def __iter__(self):
            events.append(("loader started", threading.current_thread().name))
            return iter([1, 2])

    meter = StageMeter()
    meter.start()
    prefetched = DevicePrefetcher(meter.timed(Loader()), lambda x: x, torch.device("cpu"), threaded=True,
                                  warm_up=lambda: events.append(("warm-up", threading.current_thread().name)))
    assert list(prefetched) == [1, 2]
    main_thread = threading.current_thread().name
    assert events == [("loader started", main_thread), ("warm-up", "pairclean-device-prefetch")]


def as_if_the_device_decodes(monkeypatch) -> None:
    """Runs pin what they would pin where the device decoder runs (CUDA and its package here):
    the CPU's workers still decode the pixels, which no pin test looks at."""
    from pairclean.backends import device_jpeg

    monkeypatch.setattr(device_jpeg, "device_decoder_for", lambda decode, device: device_jpeg.DEVICE_DECODERS.get(decode))


@pytest.fixture
def device_decodes(monkeypatch):
    as_if_the_device_decodes(monkeypatch)


def test_a_device_decoder_of_another_version_does_not_resume_the_run_it_did_not_start(
        coco_shards, fast_config, tmp_path, monkeypatch, device_decodes):
    cfg = replace(fast_config, decode="gpu")
    out = tmp_path / "s.parquet"
    assert forked(lambda: score(str(coco_shards), out, cfg), "committed:1") == -signal.SIGKILL
    version = DeviceJpegDecoder.version
    monkeypatch.setattr(DeviceJpegDecoder, "version", version + 1)
    with pytest.raises(UserError, match="settings"):
        score(str(coco_shards), out, cfg)
    monkeypatch.setattr(DeviceJpegDecoder, "version", version)
    assert score(str(coco_shards), out, cfg).resumed  # the same version goes on


def test_gpu_resize_scores_within_the_resizes_rounding_of_fast_and_pins_its_way(coco_shards, fast_config, tmp_path,
                                                                                 monkeypatch):
    """A run with `decode` gpu-resize where it runs (forced onto the CPU here): every pair scored,
    `sim` within the resize's rounding of `decode` fast's (the same PIL decode; PIL's resize there,
    `resize_many` here), and the way recorded (and pinned, as every device decoder's: a resume
    cannot mix the two)."""
    from pairclean.backends.device_jpeg import DeviceResize

    as_if_the_device_decodes(monkeypatch)
    monkeypatch.setattr(DeviceResize, "cannot_run", classmethod(lambda cls, device: None))
    fast = score(str(coco_shards), tmp_path / "fast.parquet", fast_config)
    resized = score(str(coco_shards), tmp_path / "resized.parquet", replace(fast_config, decode="gpu-resize"))
    assert resized.summary.errors == fast.summary.errors == 0
    joined = duckdb.sql(f"SELECT max(abs(a.sim - b.sim)), count(*) FROM '{tmp_path / 'fast.parquet'}' a "
                        f"JOIN '{tmp_path / 'resized.parquet'}' b USING (key)").fetchall()
    assert joined[0][1] == 16 and 0 < joined[0][0] < 1e-3
    recorded = resized.provenance.estimator
    assert recorded["decode"] == "gpu-resize" and recorded["device_decoder_version"] == DeviceResize.version


def test_training_batches_carry_uint8_pixels_that_the_target_normalises(coco_shards):
    from pairclean.backends import load_target
    from pairclean.data.dataset import open_dataset
    from pairclean.training.data import TrainBatches

    torch.manual_seed(0)
    target = load_target("pairclean-tiny", "none", device="cpu")
    batch = next(iter(TrainBatches(open_dataset(str(coco_shards)), target.preparer, 4, seed=0)))
    assert batch["left"].dtype == torch.uint8 and batch["left"].shape == (4, 3, 64, 64)
    normalised = target.estimator.image_input(batch["left"])
    assert normalised.dtype == torch.float32 and normalised.is_contiguous()
    assert torch.equal(target.encode("image", batch["left"]), target.encode("image", normalised))


def test_prefetching_thread_gives_the_scores_of_the_inline_pipeline(coco_shards, fast_config, tmp_path, monkeypatch):
    """On CUDA batch i+1 is received, copied and decoded in a thread of its own while batch i
    runs; forced on here, on a CPU, the run's rows are the inline run's."""
    import pyarrow.parquet as pq

    from pairclean.scoring import pipeline

    cfg = replace(fast_config, batch_size=3, workers=1)
    inline = score(str(coco_shards), tmp_path / "inline.parquet", cfg)
    monkeypatch.setattr(pipeline, "PREFETCH_DEVICES", ("cuda", "cpu"))
    threads = []
    original = pipeline.DevicePrefetcher.__iter__

    def watched(self):
        threads.append(self.threaded)
        return original(self)

    monkeypatch.setattr(pipeline.DevicePrefetcher, "__iter__", watched)
    ahead = score(str(coco_shards), tmp_path / "ahead.parquet", cfg)
    assert threads == [True] and ahead.pairs_scored_now == inline.pairs_scored_now == 16
    a, b = (pq.read_table(tmp_path / name).sort_by([("shard", "ascending"), ("index", "ascending")])
            for name in ("inline.parquet", "ahead.parquet"))
    for column in ("key", "sim", "weight", "error"):
        assert a.column(column).to_pylist() == b.column(column).to_pylist()


class _FirstWorkerWaits(torch.utils.data.IterableDataset):
    """Worker 0's one batch is ready only once the main process has taken another worker's (60 s at most)."""

    def __init__(self, taken):
        self.taken = taken

    def __iter__(self):
        worker = torch.utils.data.get_worker_info().id
        yield worker, self.taken.wait(timeout=60) if worker == 0 else True


@pytest.mark.skipif(not AS_THEY_COME, reason="torch < 2.6 takes a DataLoader's batches from each worker in turn")
def test_a_scoring_run_takes_each_batch_as_it_comes_so_a_slow_worker_holds_up_only_its_own():
    """Taken in turn, worker 0's batch would come first, after its 60 s wait."""
    import multiprocessing

    taken = multiprocessing.get_context("fork").Event()
    got = []
    for batch in batch_loader(_FirstWorkerWaits(taken), workers=2, pin_memory=False):
        got.append(batch)
        taken.set()
    assert got == [[1, True], [0, True]]


def test_the_scores_do_not_depend_on_the_order_the_workers_batches_come_in(coco_shards, fast_config, tmp_path,
                                                                          monkeypatch):
    """One group a unit, read by 3 workers whose batches come as they are ready, gives every
    column of the same groups read in order by the main process: the null similarities (the FDR
    rule's p-values) and the shuffled beta (summed unit by unit) included."""
    import pyarrow.parquet as pq

    monkeypatch.setattr(ModelProducer, "groups", lambda self, units, processes: [[u] for u in units])
    cfg = replace(fast_config, batch_size=4, beta_mode="shuffled", rules=("beta", "gmm", "fdr"))
    first = score(str(coco_shards), tmp_path / "in-order.parquet", cfg)
    second = score(str(coco_shards), tmp_path / "as-they-come.parquet", replace(cfg, workers=3))
    assert first.summary.beta == second.summary.beta
    assert (first.summary.workers, second.summary.workers) == (0, 3)  # the workers started, reported
    a, b = (pq.read_table(tmp_path / name) for name in ("in-order.parquet", "as-they-come.parquet"))
    assert a.num_rows == b.num_rows == 16 and a.column_names == b.column_names and "p_null" in a.column_names
    for column in a.column_names:
        assert a.column(column).to_pylist() == b.column(column).to_pylist(), column


class _FlagOnFirstPair:
    """A preparer that touches `flag` when it prepares its first pair (then prepares as `inner`)."""

    def __init__(self, inner, flag):
        self.inner, self.flag = inner, flag

    def prepare(self, modality, value):
        self.flag.touch()
        return self.inner.prepare(modality, value)

    def collate(self, modality, items):
        return self.inner.collate(modality, items)


def test_a_worker_starts_on_its_first_batch_before_the_loader_has_started_the_others(coco_shards, tiny_estimator,
                                                                                      tmp_path):
    """The DataLoader asks its workers for batches only once it has started them all (a fork each,
    tens of ms from a large main process): here the second worker is started only once the first
    has begun preparing pairs (30 s at most), which it does unasked; then every pair comes through."""
    import multiprocessing.context

    from pairclean.data.dataset import as_dataset
    from pairclean.runs.claims import GroupClaims
    from pairclean.scoring.batches import PreparedBatches
    from pairclean.scoring.run import Work

    flag = tmp_path / "preparing"

    class LaterWorkersWait(multiprocessing.context.ForkContext):
        made, waited = 0, []

        def Process(self, *args, **kwargs):
            process = super().Process(*args, **kwargs)
            LaterWorkersWait.made += 1
            if LaterWorkersWait.made > 1:  # every worker but the first
                deadline = time.monotonic() + 30
                while not flag.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                self.waited.append(flag.exists())
            return process

    data = as_dataset(str(coco_shards))
    (tmp_path / "claims").mkdir()
    work = Work([(i, [u]) for i, u in enumerate(data.units())], frozenset(), GroupClaims(tmp_path / "claims"))
    batches = PreparedBatches(data, work, _FlagOnFirstPair(tiny_estimator.preparer, flag), batch_size=4)
    loader = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=2, multiprocessing_context=LaterWorkersWait())
    assert sum(len(batch) for batch in loader) == 16
    assert LaterWorkersWait.waited == [True]


class _Batches(torch.utils.data.IterableDataset):
    def __init__(self, count, fail_at=None):
        self.count, self.fail_at = count, fail_at

    def _batches(self):
        for i in range(self.count):
            if i == self.fail_at:
                raise ValueError(f"batch {i} is bad")
            yield i

    def __iter__(self):
        from pairclean.ops.worker_start import first_batch_at_once

        return first_batch_at_once(self._batches())


@pytest.mark.parametrize("count, fail_at, expected", [(3, None, [0, 1, 2]), (0, None, []), (3, 0, "batch 0 is bad"),
                                                      (3, 2, "batch 2 is bad")])
def test_a_first_batch_built_at_once_keeps_the_order_the_end_and_the_errors(count, fail_at, expected):
    loader = torch.utils.data.DataLoader(_Batches(count, fail_at), batch_size=None, num_workers=1)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            list(loader)
    else:
        assert [int(b) for b in loader] == expected


def test_prefetcher_raises_the_threads_error_in_order_and_stops_when_the_consumer_does():
    import threading

    from pairclean.backends.feed import DevicePrefetcher

    def prepare(x):
        if x == 3:
            raise ValueError("batch 3 is bad")
        return x * 10

    seen = []
    with pytest.raises(ValueError, match="batch 3 is bad"):
        for item in DevicePrefetcher(range(6), prepare, torch.device("cpu"), threaded=True):
            seen.append(item)
    assert seen == [0, 10, 20]

    pulled = []

    def source():
        for i in range(1000):
            pulled.append(i)
            yield i

    ahead = iter(DevicePrefetcher(source(), lambda x: x, torch.device("cpu"), threaded=True, depth=2))
    assert next(ahead) == 0
    ahead.close()  # the consumer stops: the thread ends without draining the source
    assert not any(t.name == "pairclean-device-prefetch" for t in threading.enumerate())
    assert len(pulled) <= 5


def test_the_prefetching_thread_warms_the_device_decoder_up_before_its_first_batch(monkeypatch):
    """The decoder's first-call costs (nvJPEG's handles and buffers, the thread's BLAS handle) are
    paid in the prefetching thread while the workers prepare their first batches: the warm-up runs
    there, before the thread takes a batch; the decoder's own warm-up decodes one real JPEG."""
    import threading

    import torchvision.io

    from pairclean.backends.feed import DevicePrefetcher

    events = []

    def source():
        for i in range(3):
            events.append(("pulled", i))
            yield i

    def warm_up():
        events.append(("warm", threading.current_thread().name))

    assert list(DevicePrefetcher(source(), lambda x: x, torch.device("cpu"), threaded=True, warm_up=warm_up)) == [0, 1, 2]
    assert events[0] == ("warm", "pairclean-device-prefetch") and events[1:] == [("pulled", i) for i in range(3)]

    decoded = []
    decode_jpeg = torchvision.io.decode_jpeg
    monkeypatch.setattr(torchvision.io, "decode_jpeg", lambda files, **kw: decoded.append(len(files)) or decode_jpeg(files, **kw))
    preprocess = T.Compose([T.Resize(32, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(32), T.ToTensor(),
                            T.Normalize((0.5,) * 3, (0.5,) * 3)])
    DeviceJpegDecoder(StandardTransform.parse(preprocess), torch.device("cpu"), preprocess).warm_up()
    assert decoded == [1]


def test_pipeline_only_round_with_the_prefetching_thread_charges_its_work_to_other_threads(coco_shards, tmp_path,
                                                                                            monkeypatch):
    """As on CUDA: the device decoder runs in the prefetching thread, so the main thread's
    `device preprocessing` is empty and the decode shows under `other threads`."""
    from pairclean.scoring import pipeline

    monkeypatch.setattr(pipeline, "PREFETCH_DEVICES", ("cuda", "cpu"))
    p = bench_pipeline_only(coco_shards, tmp_path, "--decode", "gpu")["pipeline_only"]
    assert p["decode"] == "gpu" and p["pairs"] == 12
    # two clock reads a batch (a scheduler hiccup on a loaded machine aside); decoding costs ~3 ms a pair here
    assert p["stages"]["device preprocessing"] < 0.1 and p["stages"]["to device"] < 0.1
    assert p["stages"]["other threads"] > 0 and p["stage_wall_ms_per_pair"]["receive"] > 0


def test_pipeline_only_with_every_jpeg_left_to_the_workers_sends_decoded_images(coco_shards, tmp_path, capsys):
    """--cpu-decode-share 1: the device decoder's round with all JPEGs decoded in the workers
    crosses uint8 images at their own sizes for the device to resize, as --decode gpu-resize does:
    at least the crop's pixels, at most SENT_PIXELS_PER_RESIZE times the Resize's square (COCO's
    640 x 480 JPEGs draft-decode to 160 x 120 for pairclean-tiny's 64 px, over that: shrunk in the
    worker); the share is in the config and the summary."""
    from pairclean.backends.inputs import SENT_PIXELS_PER_RESIZE

    report = bench_pipeline_only(coco_shards, tmp_path, "--decode", "gpu", "--cpu-decode-share", "1")
    p = report["pipeline_only"]
    assert p["decode"] == "gpu" and report["config"]["cpu_decode_share"] == 1.0
    assert 3 * 64 * 64 + 32 * 8 <= p["worker_bytes_per_pair"] < 3 * SENT_PIXELS_PER_RESIZE * 64 * 64 + 32 * 8 + 200
    assert "pipeline only (decode gpu, 100% of the JPEGs in the workers)" in capsys.readouterr().out


def _pinned(out) -> dict:
    return json.loads((out.parent / f"{out.name}.parts" / "settings.json").read_text())


@pytest.mark.parametrize("began, then", [(0.5, 0.25), (0.0, 0.5)])
def test_a_run_resumes_only_with_the_cpu_decode_share_it_began_with(began, then, coco_shards, fast_config, tmp_path,
                                                                    device_decodes):
    """The share decides which pixels each JPEG gets (the workers' PIL or the device's decoder):
    pinned where set, so a resumed run does not mix two splits; a run without it pins nothing new
    (an unfinished run from before the option resumes)."""
    cfg = replace(fast_config, decode="gpu", cpu_decode_share=began)
    out = tmp_path / "s.parquet"
    assert forked(lambda: score(str(coco_shards), out, cfg), "committed:1") == -signal.SIGKILL
    assert _pinned(out).get("cpu_decode_share") == (began or None) and _pinned(out)["device_decoder"] == DeviceJpegDecoder.version
    with pytest.raises(UserError, match="cpu_decode_share"):
        score(str(coco_shards), out, replace(cfg, cpu_decode_share=then))
    assert score(str(coco_shards), out, cfg).resumed


def test_a_run_where_the_device_cannot_decode_pins_the_workers_and_is_not_resumed_where_it_can(
        coco_shards, fast_config, tmp_path, monkeypatch):
    """--decode gpu without CUDA decodes every image in the workers: nothing of the device decoder
    is pinned (nor the share, which then splits nothing), so the same run resumed where the device
    decodes is refused instead of mixing PIL's pixels with nvJPEG's."""
    from pairclean.backends.device_jpeg import device_decoder_for

    assert device_decoder_for("gpu", "cpu") is None
    cfg = replace(fast_config, decode="gpu", cpu_decode_share=0.5, device="cpu")
    out = tmp_path / "s.parquet"
    assert forked(lambda: score(str(coco_shards), out, cfg), "committed:1") == -signal.SIGKILL
    assert "device_decoder" not in _pinned(out) and "cpu_decode_share" not in _pinned(out)
    as_if_the_device_decodes(monkeypatch)
    with pytest.raises(UserError, match=f"device_decoder: None -> {DeviceJpegDecoder.version}"):
        score(str(coco_shards), out, cfg)


def test_a_run_pins_how_its_workers_resize_and_a_run_begun_before_is_not_resumed_with_other_pixels(
        coco_shards, fast_config, tmp_path):
    """`decode` fast resizes with torch, exact with PIL (the resize of every earlier pairclean): a fast
    run pins it, so an unfinished fast run begun by an earlier pairclean (no such key) is refused
    instead of mixing two resizes' pixels; exact pins nothing new, so a run begun with it resumes."""
    out = tmp_path / "s.parquet"
    assert forked(lambda: score(str(coco_shards), out, fast_config), "committed:1") == -signal.SIGKILL
    assert _pinned(out)["worker_resize"] == "torch"
    earlier = {k: v for k, v in _pinned(out).items() if k != "worker_resize"}
    (out.parent / f"{out.name}.parts" / "settings.json").write_text(json.dumps(earlier))
    with pytest.raises(UserError, match="worker_resize: None -> 'torch'"):
        score(str(coco_shards), out, fast_config)
    exact, began = replace(fast_config, decode="exact"), tmp_path / "e.parquet"
    assert forked(lambda: score(str(coco_shards), began, exact), "committed:1") == -signal.SIGKILL
    assert "worker_resize" not in _pinned(began)
    assert score(str(coco_shards), began, exact).resumed


def test_the_scorer_queues_its_work_without_waiting_for_the_device(monkeypatch):
    """Scoring a batch on CUDA queues the sims and the embeddings (the sink draws the unit's null
    pairs from them) and their copies to the host; the host waits only when the sink takes the
    batch, one batch later. Its null partners were once a blocking copy to the device, a stream
    synchronisation that held the main thread until the batch's model was done (0.023 ms a pair on
    the H100, session 14) before it could take the batch before and receive the next. Fake CUDA
    tensors (no GPU): `DeviceReads` counts what would wait."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pairclean.bench.measure import DeviceReads
    from pairclean.scoring import pipeline
    from pairclean.scoring.batches import PairBatch, UnitSpan

    host_copies_without_a_driver(monkeypatch)
    batch = PairBatch([UnitSpan("u", 0, 6)], list("abcdef"), ["s"] * 6, list(range(6)), [None] * 6)
    with FakeTensorMode(allow_non_fake_inputs=True), DeviceReads() as waits:
        u = torch.nn.functional.normalize(torch.randn(6, 8, device="cuda"), dim=-1)
        v = torch.nn.functional.normalize(torch.randn(6, 8, device="cuda"), dim=-1)
        scored = pipeline.Scorer(None, "image", "text").score(batch, u, v)
    results = scored.results.values
    assert results["sims"].shape == (6,) and results["left"].shape == results["right"].shape == (6, 8)
    assert all(results[name].device.type == "cpu" for name in ("sims", "left", "right"))
    assert not waits.sites

