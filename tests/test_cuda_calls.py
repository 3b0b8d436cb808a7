"""The CUDA call patterns, checked on a CPU (a GPU is lent rarely and briefly): what the host waits
for in a steady-state batch of scoring and training (a), the order of the streams and events that
hand batches to the model and results back (b), torch.compile over the padded steady loop and the
CUDA-only text path (c), and the calls into nvImageCodec and DALI against the installed packages (d).
Each check has a test of a deliberately broken variant that it fails on.

Fake CUDA: `FakeTensorMode` (CUDA's device and dtype checks, no kernels) with `fake_cuda`'s streams
and events, which keep the order a device would."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch
from fake_cuda import Event, FakeStreams, StreamOrder
from PIL import Image
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode,
                                          unset_fake_temporarily)

from pairclean.backends import feed
from pairclean.backends.feed import DeviceFeed, DevicePrefetcher, HostCopies
from pairclean.backends.open_clip import OpenClipEstimator
from pairclean.backends.text_trim import TextCuts
from pairclean.bench.measure import DeviceReads
from pairclean.scoring import pipeline
from pairclean.scoring.batches import PairBatch, UnitEnd, UnitSpan

pytestmark = pytest.mark.usefixtures("fresh_notices")
CUDA = torch.device("cuda")


# ---------------------------------------------------------------- (b) streams and events

def _fed_and_used(streams: FakeStreams) -> StreamOrder:
    """A batch through `DeviceFeed` (its copies and a device step queued on its side stream), then
    used by the compute stream, as training and the CPU-less scoring path do."""
    with FakeTensorMode(allow_non_fake_inputs=True), StreamOrder(streams) as order:
        fed = DeviceFeed(CUDA)
        batch = fed({"left": torch.zeros(4, 3), "right": torch.zeros(4, 5)})
        decoded = fed.run(lambda: torch.zeros(4, device="cuda") + 1)  # a decode on the side stream
        (batch["left"].sum() + batch["right"].sum() + decoded.sum()).neg()
    return order


def test_the_feeds_copies_reach_the_compute_stream_in_order(monkeypatch):
    streams = FakeStreams().install(monkeypatch)
    assert not _fed_and_used(streams).violations


def test_the_stream_check_fails_without_the_feeds_wait_or_its_record_stream(monkeypatch):
    """Broken variants: the compute stream's `wait_stream` made a no-op (its reads could see memory
    before the copies wrote it), `record_stream` made a no-op (the copies' memory could be handed out
    again while the compute stream still reads it)."""
    streams = FakeStreams().install(monkeypatch)
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda.Stream, "wait_stream", lambda self, other: None)
        assert any("without a wait" in v for v in _fed_and_used(streams).violations)
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
        assert any("without record_stream" in v for v in _fed_and_used(streams).violations)


def _prefetched(streams: FakeStreams) -> StreamOrder:
    """Batches prepared by `DevicePrefetcher`'s thread on its side stream, then used by the
    consumer's compute stream (host tensors stand for device memory here: the thread has no fake mode)."""
    order = StreamOrder(streams, devices=("cpu",))

    def prepare(value):
        with order:
            return torch.full((3,), float(value)) + 1

    prefetched = DevicePrefetcher(range(3), prepare, CUDA, threaded=True, held=lambda batch: [batch])
    for batch in prefetched:
        with order:
            batch.neg()
    return order


def test_the_prefetching_threads_batches_reach_the_compute_stream_in_order(monkeypatch):
    assert not _prefetched(FakeStreams().install(monkeypatch)).violations


def test_the_stream_check_fails_without_the_prefetchers_wait_or_its_record_stream(monkeypatch):
    """Broken variants: the consumer's `wait_event` made a no-op, `record_stream` made a no-op."""
    streams = FakeStreams().install(monkeypatch)
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda.Stream, "wait_event", lambda self, event: None)
        assert any("without a wait" in v for v in _prefetched(streams).violations)
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
        assert any("without record_stream" in v for v in _prefetched(streams).violations)


def _copied_back(streams: FakeStreams, monkeypatch) -> tuple[StreamOrder, dict]:
    """Results through `HostCopies`, read after `wait()`."""
    monkeypatch.setattr(feed, "to_host", lambda t: t.to("cpu", non_blocking=True))  # page-locked needs a driver
    with FakeTensorMode(allow_non_fake_inputs=True), StreamOrder(streams) as order:
        sims = torch.zeros(4, device="cuda") * 2
        values = HostCopies({"sims": sims, "nulls": sims + 1}).wait()
    return order, values


def test_results_are_read_once_a_blocking_event_says_their_copies_are_done(monkeypatch):
    streams = FakeStreams().install(monkeypatch)
    order, values = _copied_back(streams, monkeypatch)
    assert all(order.host_ready(v) for v in values.values()) and not order.violations
    assert streams.host_waits and all(e.blocking for e in streams.host_waits)  # the host sleeps, not spins


def test_the_host_copy_check_fails_on_a_read_before_the_wait_or_a_spinning_event(monkeypatch):
    """Broken variants: `HostCopies.wait` without the event's `synchronize` (values read while the
    copies may still be running), and a default (spinning) event (89907df: a core held for as long as
    the device computes)."""
    streams = FakeStreams().install(monkeypatch)
    with monkeypatch.context() as patch:
        patch.setattr(HostCopies, "wait", lambda self: self.values)
        order, values = _copied_back(streams, monkeypatch)
        assert not any(order.host_ready(v) for v in values.values())
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "Event", lambda blocking=False: Event())
        _copied_back(streams, monkeypatch)
        assert not all(e.blocking for e in streams.host_waits)


# ---------------------------------------------------------------- (a) what the host waits for

def _on_fake_cuda(est, mode):
    """The tiny open_clip estimator as a CUDA run has it, its weights fake CUDA tensors."""
    from test_towers import _on_fake_cuda as weights_on_fake_cuda

    est.model, est.device, est.channels_last = weights_on_fake_cuda(est.model, mode), CUDA, True
    return est


def _steady_batches(est, n_batches: int = 4, rows: int = 6) -> list[PairBatch]:
    captions = ["a dog on a beach", "two people riding horses along a beach at sunset", "x", "a red car", "tea", "a cup"]
    batches = []
    for b in range(n_batches):
        keys = [f"{b}-{i}" for i in range(rows)]
        batch = PairBatch([UnitSpan(f"u{b}", 0, rows)], keys, ["s"] * rows, list(range(rows)), [None] * rows,
                          done=[UnitEnd(f"u{b}", None, rows)])
        batch.left = torch.randint(0, 256, (rows, 3, est.image_size, est.image_size), dtype=torch.uint8)
        batch.right = est.preparer.collate("text", captions[:rows])
        batches.append(batch)
    return batches


def _score_steady_state(monkeypatch) -> tuple[DeviceReads, StreamOrder, list]:
    """`run_pipeline` over four batches on fake CUDA (the prefetching thread's part inline: its
    stream order is checked above), counting every read the host would wait for (`DeviceReads`: a
    scalar read, `nonzero`, a copy without `non_blocking`) and checking the streams' order."""
    streams = FakeStreams().install(monkeypatch)
    committed = []

    def real_host_copy(t):  # the sink reads numpy: the copy's values made real (numpy's memory: no fake storage)
        assert t.dtype == torch.float32  # sims and null sims
        with unset_fake_temporarily():
            return torch.from_numpy(np.zeros(tuple(t.shape), dtype=np.float32))

    def on_the_host(method):  # host arithmetic on real values (the text tower's cuts, the sink's numpy)
        def real(self, *args):
            with unset_fake_temporarily():
                return method(self, *args)
        return real

    monkeypatch.setattr(feed, "to_host", real_host_copy)
    monkeypatch.setattr(TextCuts, "groups", on_the_host(TextCuts.groups))
    monkeypatch.setattr(pipeline.PartSink, "_take", on_the_host(pipeline.PartSink._take))
    monkeypatch.setattr(pipeline, "PREFETCH_DEVICES", ())
    torch.manual_seed(0)
    est = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu")
    batches = _steady_batches(est)  # as the DataLoader hands them over, in host memory
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        est = _on_fake_cuda(est, mode)
        sink = pipeline.PartSink(frozenset(), lambda unit, columns, record: committed.append(unit), False, None)
        with DeviceReads() as reads, StreamOrder(streams) as order:
            pipeline.run_pipeline(batches, est, "image", "text", sink, batch_size=6)
    return reads, order, committed


def test_a_steady_scoring_batch_waits_for_nothing_and_keeps_the_streams_in_order(monkeypatch):
    reads, order, committed = _score_steady_state(monkeypatch)
    assert committed == ["u0", "u1", "u2", "u3"]
    assert not reads.sites and not order.violations


@pytest.mark.parametrize("broken", ["item", "nonzero", "blocking copy"])
def test_the_wait_check_fails_on_a_scalar_read_a_nonzero_or_a_blocking_copy_in_the_scorer(broken, monkeypatch):
    """Broken variants: the scorer reading the batch's mean similarity (`.item()`), the rows of
    positive similarity (`nonzero`), or its sims with a blocking `.cpu()` - each a wait for all the
    device's queued work."""
    score = pipeline.Scorer.score
    reading = {"item": lambda s: s.mean().item(), "nonzero": lambda s: (s > 0).nonzero(), "blocking copy": lambda s: s.cpu()}

    def broken_score(self, batch, u, v):
        with contextlib.suppress(DataDependentOutputException, DynamicOutputShapeException):  # fake values: none to read
            reading[broken]((u * v).sum(-1))
        return score(self, batch, u, v)

    monkeypatch.setattr(pipeline.Scorer, "score", broken_score)
    reads, _, _ = _score_steady_state(monkeypatch)
    assert reads.reads >= 4  # one a batch


def test_the_wait_check_fails_on_a_scalar_read_in_the_training_loss(tmp_path, coco_shards, monkeypatch):
    """Training's steady state is checked by `test_train.py`'s `DeviceReads` over whole epochs (no read
    of a device value a step); broken variant: the plain method's loss read with `.item()` each step."""
    from helpers import tiny_train_config

    from pairclean.training import trainer
    from pairclean.training.methods import plain

    loss = plain.Plain.loss

    def reading_loss(self, batch, emb, ctx):
        out = loss(self, batch, emb, ctx)
        out.loss.item()
        return out

    monkeypatch.setattr(plain.Plain, "loss", reading_loss)
    with DeviceReads() as reads:
        trainer.train(str(coco_shards), tmp_path / "run", tiny_train_config())
    assert reads.reads >= 2  # one a step


# ---------------------------------------------------------------- (c) torch.compile

@pytest.fixture
def strict_compile(monkeypatch):
    """torch.compile as the towers ask for it, with `fullgraph` (a graph break is an error, so the
    tower falls back and says why) on the eager backend: dynamo's whole trace and guards, without
    inductor's minutes of C++ on 2 cores (`test_towers.py`'s slow tests run inductor)."""
    import torch._dynamo

    real = torch.compile

    def strict(fn, **kwargs):
        kwargs.pop("mode", None)  # reduce-overhead (CUDA graphs) is inductor's
        return real(fn, **{**kwargs, "backend": "eager", "fullgraph": True})

    monkeypatch.setattr(torch, "compile", strict)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


CAPTIONS = "a large red star above a small blue circle on a green background near the top left corner".split()


def _padded_steady_loop(coco_src) -> dict[str, str]:
    """The tiny model compiled, fed as a run feeds it: full batches first (the shapes it compiles
    for), then partial ones and captions of other lengths, every later call under
    `error_on_recompile`; how each tower ran at the end (`compiled_towers`)."""
    import torch._dynamo

    from pairclean.backends.oom import take_rows
    from test_towers import _coco_pixels

    torch.manual_seed(0)
    est = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", compile=True)
    pixels = _coco_pixels(est, coco_src, 6)
    texts = est.preparer.collate("text", [" ".join(CAPTIONS[: 1 + (i * 5) % len(CAPTIONS)]) for i in range(300)])
    short = est.preparer.collate("text", ["a dog", "x", "two cats"] * 100)
    with torch.no_grad():
        est.encode("image", pixels)
        est.encode("text", texts)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for rows in (5, 2, 6):
                est.encode("image", pixels[:rows])
            for batch in (take_rows(texts, slice(0, 200)), short, take_rows(short, slice(0, 40))):
                est.encode("text", batch)
    return est.compiled_towers()


def test_the_towers_trace_whole_and_compile_once_over_a_padded_steady_loop(strict_compile, coco_src):
    assert _padded_steady_loop(coco_src) == {"image": "compiled", "text": "compiled"}


def _as_on_cuda(monkeypatch) -> list:
    """The text tower's CUDA path taken here (`FUSED_DEVICES`); a list counting `causal_blocks`' calls."""
    from pairclean.backends import text_trim

    calls, blocks = [], text_trim.causal_blocks
    monkeypatch.setattr(text_trim, "FUSED_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(text_trim, "causal_blocks", lambda *args: calls.append(1) or blocks(*args))
    return calls


def test_the_cuda_text_path_compiles_once_and_stays_fused_when_eager(strict_compile, coco_src, monkeypatch):
    """The text tower as a CUDA run has it: compiled, it is traced with open_clip's float mask and
    compiles once over the steady loop; eager, it takes the boolean mask (`causal_blocks`)."""
    calls = _as_on_cuda(monkeypatch)
    assert _padded_steady_loop(coco_src) == {"image": "compiled", "text": "compiled"} and not calls
    est = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu")
    with torch.no_grad():
        est.encode("text", est.tokenizer(["a dog", "x"]))
    assert calls


def test_the_compile_check_fails_on_the_fused_text_path_traced(strict_compile, coco_src, monkeypatch):
    """Broken variant: the boolean mask's path traced too (the compile test not excluded: 89907df on
    CUDA). It traces whole, but MultiheadAttention's traced path guards on the cut's length, so a
    caption cut of another length recompiles (found by this check: on the H100, up to five graphs of
    the text tower per group size)."""
    calls = _as_on_cuda(monkeypatch)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    state = _padded_steady_loop(coco_src)
    assert calls and state["image"] == "compiled" and state["text"].startswith("eager after: RecompileError")


@pytest.mark.slow
def test_inductor_compiles_the_cuda_text_path_and_the_image_tower_once(coco_src, monkeypatch):
    """The same steady loop through inductor itself (this machine's C++ compiler: minutes on 2 cores),
    every call `fullgraph`: no graph break, no recompilation, no fallback."""
    import torch._dynamo

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real(fn, **{**kwargs, "fullgraph": True}))
    _as_on_cuda(monkeypatch)
    torch._dynamo.reset()
    assert _padded_steady_loop(coco_src) == {"image": "compiled", "text": "compiled"}


@pytest.mark.parametrize("broken", ["graph break", "recompile"])
def test_the_compile_check_fails_on_a_graph_break_or_a_recompilation(broken, strict_compile, coco_src, monkeypatch):
    """Broken variants: a host read inside the image tower (`.item()`: a graph break, so no full
    graph), and batches no longer padded to the rows seen (each partial batch a new shape to compile)."""
    from pairclean.backends import compiled, open_clip

    if broken == "graph break":
        tower = open_clip._plain_encode_image
        def reading(model, x):
            if x.float().mean().item() > -1e9:  # a branch on a value read back from the device
                return tower(model, x)
            return tower(model, -x)

        monkeypatch.setattr(open_clip, "_plain_encode_image", reading)
    else:
        monkeypatch.setattr(compiled.RowPadding, "target", lambda self, name, rows: rows)
    state = _padded_steady_loop(coco_src)
    assert state["image"].startswith("eager after:") and state["text"] == "compiled"


# ---------------------------------------------------------------- (d) the libraries' calls

def _keywords(doc: str) -> set[str]:
    """The parameter names of a pybind11 function's signatures, as its docstring states them."""
    import re

    return {name for line in doc.splitlines() if "(" in line and ")" in line
            for name in re.findall(r"(\w+): ", line.split("(", 1)[1].rsplit(")", 1)[0])}


def test_nvimgcodecs_calls_match_the_installed_package():
    """Every call `decode` nvimgcodec makes - the CUDA-only ones too (a decoder on a device index,
    the probe's GPU backends, a device buffer's kind, a decode ordered on a stream) - names keywords
    and members the installed nvImageCodec has: a rename fails here, not on the device. The CPU path
    itself runs in test_device_decoders.py."""
    nvimgcodec = pytest.importorskip("nvidia.nvimgcodec", reason="`decode` nvimgcodec's package (pip install 'pairclean[gpu]')")
    assert {"device_id", "max_num_cpu_threads", "backends"} <= _keywords(nvimgcodec.Decoder.__init__.__doc__)
    assert {"params", "cuda_stream"} <= _keywords(nvimgcodec.Decoder.decode.__doc__)
    assert {"apply_exif_orientation", "color_spec", "sample_format"} <= _keywords(nvimgcodec.DecodeParams.__init__.__doc__)
    for kind in ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU", "CPU_ONLY"):
        nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, kind))
    assert nvimgcodec.ImageBufferKind.STRIDED_DEVICE != nvimgcodec.ImageBufferKind.STRIDED_HOST
    assert isinstance(nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY, int)
    assert nvimgcodec.ColorSpec.SRGB is not None and nvimgcodec.SampleFormat.P_RGB is not None


def test_the_signature_check_fails_on_a_renamed_keyword():
    """Broken variant: a keyword the library does not have (`cuda_streams`) is not among its signatures'."""
    nvimgcodec = pytest.importorskip("nvidia.nvimgcodec")
    assert "cuda_streams" not in _keywords(nvimgcodec.Decoder.decode.__doc__)
    assert {"params", "cuda_stream"} <= _keywords("decode(self: D, srcs: list, *, params: P | None = None, cuda_stream: int = 0) -> object")


def test_dalis_calls_match_the_installed_package():
    """`decode` dali's pipeline keywords, its stream-bound `run` (the dynamic executor's keyword as this
    DALI spells it) and the operators' arguments, against the installed DALI."""
    import inspect

    dali = pytest.importorskip("nvidia.dali", reason="`decode` dali's package (pip install 'pairclean[gpu]')")
    from nvidia.dali import Pipeline, fn

    from pairclean.backends.dali_jpeg import _dynamic

    known = inspect.signature(Pipeline.__init__).parameters
    assert set(_dynamic()) <= set(known) and {"batch_size", "num_threads", "device_id", "prefetch_queue_depth"} <= set(known)
    run = list(inspect.signature(Pipeline.run).parameters.values())
    assert run[1].kind is inspect.Parameter.POSITIONAL_ONLY or run[1].name == "cuda_stream"
    for op, arguments in ((fn.decoders.image, ("output_type", "adjust_orientation")),
                          (fn.resize, ("size", "roi_start", "roi_end", "interp_type", "antialias", "dtype")),
                          (fn.peek_image_shape, ("dtype",)), (fn.external_source, ("name", "dtype", "ndim"))):
        assert all(a in op.__doc__ for a in arguments), (op, dali.__version__)


class _Library:
    """nvImageCodec stood in for by torchvision's CPU decoder: enough of its API for `decode_crop`,
    each call's images returned as it would (None for a file it cannot decode); `drop`: a call that
    leaves out the images of these files (what the row check must not misalign)."""

    class CodeStream:
        def __init__(self, data):
            self.data = bytes(data)

    class ImageBufferKind:
        STRIDED_DEVICE, STRIDED_HOST = "device", "host"

    class Image:
        buffer_kind = "host"

        def __init__(self, planes):
            self.planes = planes

        def __array__(self, dtype=None, copy=None):
            return self.planes

    def __init__(self, drop: set[int]):
        self.drop, self.calls = drop, []

    def decode(self, streams, params=None, cuda_stream=0):
        from torchvision.io import decode_jpeg

        self.calls.append(len(streams))
        images = []
        for k, stream in enumerate(streams):
            try:
                planes = decode_jpeg(torch.frombuffer(bytearray(stream.data), dtype=torch.uint8)).numpy()
            except RuntimeError:
                planes = None
            if not (len(streams) > 1 and k in self.drop):
                images.append(None if planes is None else self.Image(planes))
        return images


def test_nvimgcodec_rows_stay_aligned_when_a_call_gives_fewer_images(coco_src):
    """A decode that returns fewer images than files (one left out, not None) cannot say which row is
    which: it counts as a failed call, each file is then decoded alone, and every row gets its own
    pixels. Broken variant caught: pairing files and images in order (89907df's zip), which gave row 2
    row 3's pixels and so on."""
    from pairclean.backends.device_jpeg import DEVICE_DECODERS
    from pairclean.backends.inputs import ImageBatch, JpegBlob, StandardTransform
    from pairclean.lab.coco import read_pairs
    from test_device_decoders import PREPROCESSINGS

    cls = DEVICE_DECODERS["nvimgcodec"]
    preprocess = PREPROCESSINGS["bicubic-64"]
    transform = StandardTransform.parse(preprocess)
    files = [(coco_src / p["image"]).read_bytes() for p in read_pairs(coco_src)[:5]]
    decoder = cls.__new__(cls)  # its library stood in for: no package needed
    super(cls, decoder).__init__(transform, torch.device("cpu"), preprocess)
    decoder.library = decoder.__dict__["decoder"] = _Library(drop={2})
    decoder.params = None
    pixels, failed = decoder(ImageBatch(5, JpegBlob.pack(files), tuple(range(5))))
    assert not failed and decoder.library.calls == [5, 1, 1, 1, 1, 1]
    reference = torch.stack([transform.geometry_pixels(Image.open(io.BytesIO(f)).convert("RGB")) for f in files])
    assert (pixels.int() - reference.permute(0, 3, 1, 2).int()).abs().max() <= 1


def test_a_device_decoders_host_threads_are_the_cores_its_workers_leave(monkeypatch):
    """nvImageCodec's and DALI's host threads: the cores less the live workers and the two threads that
    feed the device. Broken variant caught: half the cores, at most 8, whatever the workers (89907df:
    8 threads beside 14 workers on 16 hyperthreads)."""
    import multiprocessing

    from pairclean.backends import device_jpeg

    monkeypatch.setattr(device_jpeg, "usable_cores", lambda: 16)
    for workers, threads in ((14, 1), (6, 8), (0, 8), (10, 4)):
        monkeypatch.setattr(multiprocessing, "active_children", lambda: [object()] * workers)
        assert device_jpeg.host_threads() == threads
