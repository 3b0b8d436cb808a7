"""The device JPEG decoders (`decode` gpu, nvimgcodec, dali) run on the CPU against PIL's
preprocessing, on real COCO JPEGs with the rows a web batch brings (a greyscale JPEG, a truncated
one, a PNG the workers decode), and the registry's fallback when a decoder's package is missing.

nvImageCodec and DALI are the `gpu` extra (`pip install 'pairclean[gpu]'`, about 260 MB of wheels): their
tests skip without them."""

from __future__ import annotations

import io
import logging
import sys

import numpy as np

import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from pairclean.backends.device_jpeg import DEVICE_DECODERS, BatchedDeviceDecoder, DeviceJpegDecoder
from pairclean.backends.inputs import DecodedImages, ImageBatch, JpegBlob, StandardTransform
from pairclean.backends.open_clip import OpenClipEstimator, OpenClipPreparer
from pairclean.data.decode import DecodeError, decode_image
from pairclean.lab.coco import read_pairs

pytestmark = pytest.mark.usefixtures("fresh_notices")

LIBRARIES = {"nvimgcodec": "nvidia.nvimgcodec", "dali": "nvidia.dali"}
NORMALIZE = T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
# Shortest-side Resize + CenterCrop as open_clip builds them: bicubic, bilinear, and a crop smaller
# than the resize (an odd margin: CenterCrop's start rounds half to even).
PREPROCESSINGS = {
    "bicubic-64": T.Compose([T.Resize(64, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(64), T.ToTensor(), NORMALIZE]),
    "bilinear-96": T.Compose([T.Resize(96, interpolation=T.InterpolationMode.BILINEAR), T.CenterCrop(96), T.ToTensor(), NORMALIZE]),
    "bicubic-73-crop-64": T.Compose([T.Resize(73, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(64), T.ToTensor(),
                                     NORMALIZE]),
}
# How far each decoder's pixels may be from PIL's (the workers' path), measured on these files
# (docs/benchmarks.md, "Device decoders"): (largest difference, share of values off by more than 1).
# torchvision and nvImageCodec decode with libjpeg-turbo on a CPU, as PIL does, and resize with
# `resample`; DALI resamples in float, without PIL's 8-bit rounding between its passes.
TOLERANCE = {"gpu": (1, 0.0), "nvimgcodec": (1, 0.0), "dali": (16, 0.01)}
# Decoders that give pixels for a whole JPEG whose scan is corrupt (nvImageCodec's CPU backend, 0.9:
# every one of 16 COCO files with a frame marker, a start-of-image or zeros spliced into the scan), where
# PIL and torchvision refuse it: such a row is scored, not an error row, as `decode` fast would have it.
LENIENT = {"nvimgcodec"}


def _decoder_class(name: str):
    if name in LIBRARIES:
        pytest.importorskip(LIBRARIES[name], reason=f"`decode` {name} needs {DEVICE_DECODERS[name].package} "
                                                    "(pip install 'pairclean[gpu]')")
    return DEVICE_DECODERS[name]


def corrupt_scan(data: bytes) -> bytes:
    """A JPEG whose header and end are whole and whose scan meets a frame marker midway (as in a file
    spliced from two): the workers' checks (`device_takes`) pass it, PIL, libjpeg and a batched
    device decode refuse it (every one of 16 COCO files; garbled bytes instead were decoded in 5 of 16)."""
    middle = len(data) // 2
    return data[:middle] + b"\xff\xc0" + data[middle + 2:]


def _web_batch(coco_src, preprocess):
    """A batch as the workers hand it over with JPEGs left for the device: 6 COCO JPEGs, a
    greyscale JPEG, a JPEG with a corrupt scan (its header and end pass the workers' checks), a PNG
    (decoded in the worker). (batch, the PIL-decodable files by row, the PNG's row, the corrupt file's row)."""
    jpegs = [(coco_src / p["image"]).read_bytes() for p in read_pairs(coco_src)[:6]]
    grey, png = io.BytesIO(), io.BytesIO()
    Image.open(io.BytesIO(jpegs[0])).convert("L").save(grey, format="JPEG")
    Image.open(io.BytesIO(jpegs[1])).save(png, format="PNG")
    items = jpegs[:3] + [corrupt_scan(jpegs[3]), png.getvalue(), grey.getvalue()] + jpegs[3:]
    preparer = OpenClipPreparer(preprocess, None, draft_size=None, device_jpeg=True)
    batch = preparer.collate("image", [preparer.prepare("image", x) for x in items])
    assert isinstance(batch, ImageBatch) and batch.decoded_rows == (4,) and len(batch.jpegs) == 8
    readable = {row: data for row, data in enumerate(items) if row != 3}
    return batch, readable, 4, 3


@pytest.mark.parametrize("preprocessing", sorted(PREPROCESSINGS))
@pytest.mark.parametrize("name", ["gpu", "nvimgcodec", "dali"])
def test_each_decoder_gives_pils_preprocessing_on_the_cpu(name, preprocessing, coco_src):
    cls = _decoder_class(name)
    preprocess = PREPROCESSINGS[preprocessing]
    transform = StandardTransform.parse(preprocess)
    assert cls.supports(transform) and cls.unavailable() is None
    batch, readable, png_row, corrupt_row = _web_batch(coco_src, preprocess)
    pixels, failed = cls(transform, torch.device("cpu"), preprocess)(batch)

    crop = transform.crop
    assert pixels.dtype == torch.uint8 and pixels.shape == (batch.rows, 3, crop, crop)
    if name in LENIENT:  # its libjpeg-turbo decodes through a corrupt scan: pixels, where PIL says why not
        assert not failed and pixels[corrupt_row].any()
    else:
        assert list(failed) == [corrupt_row] and failed[corrupt_row].startswith("cannot decode image")
        assert not pixels[corrupt_row].any()
    decoder = cls(transform, torch.device("cpu"), preprocess)
    assert torch.equal(pixels[png_row], decoder.resized(batch.decoded.images())[0])  # decoded by the worker, resized here
    rows = sorted(readable)
    reference = torch.stack([transform.geometry_pixels(Image.open(io.BytesIO(readable[r])).convert("RGB"))
                             for r in rows]).permute(0, 3, 1, 2)
    # the 640 x 480 PNG is over SENT_PIXELS_PER_RESIZE times the Resize's square: shrunk by PIL in the
    # worker, so the device's resize of it is the identity and its pixels are PIL's (exact's) exactly
    assert torch.equal(pixels[png_row], reference[rows.index(png_row)])
    difference = (pixels[rows].int() - reference.int()).abs()
    largest, share_over_one = TOLERANCE[name]
    assert difference.max() <= largest and (difference > 1).float().mean() <= share_over_one
    assert (difference > 0).float().mean() < 0.25  # a geometry half a pixel off moves most values (DALI's resize_shorter + crop: 68%)


@pytest.mark.parametrize("name", ["gpu", "nvimgcodec", "dali"])
def test_a_batch_of_files_no_library_can_read_gives_failed_rows_and_worker_pixels(name, coco_src):
    cls = _decoder_class(name)
    preprocess = PREPROCESSINGS["bicubic-64"]
    good = (coco_src / read_pairs(coco_src)[0]["image"]).read_bytes()
    truncated = [good[:600], good[:700]]
    image = Image.open(io.BytesIO(good)).convert("RGB")
    batch = ImageBatch(3, JpegBlob.pack(truncated), (0, 2), DecodedImages.pack([image]), (1,))
    out, failed = cls(StandardTransform.parse(preprocess), torch.device("cpu"), preprocess)(batch)
    assert sorted(failed) == [0, 2] and not out[0].any() and not out[2].any()
    reference = StandardTransform.parse(preprocess).geometry_pixels(image).permute(2, 0, 1)
    assert (out[1].int() - reference.int()).abs().max() <= TOLERANCE["gpu"][0]  # the worker's image, resized here


@pytest.mark.parametrize("name", ["gpu", "nvimgcodec", "dali"])
def test_a_batch_with_no_jpeg_for_the_device_is_resized_from_the_workers_images(name, coco_src):
    """A batch of PNGs only (or of JPEGs the share gave the workers): the decoder gets no file, calls
    its library with none, and resizes what the workers decoded."""
    cls = _decoder_class(name)
    preprocess = PREPROCESSINGS["bicubic-64"]
    transform = StandardTransform.parse(preprocess)
    pngs = []
    for p in read_pairs(coco_src)[:3]:
        buffer = io.BytesIO()
        Image.open(coco_src / p["image"]).save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    preparer = OpenClipPreparer(preprocess, None, draft_size=None).leaving_to(cls)
    batch = preparer.collate("image", [preparer.prepare("image", x) for x in pngs])
    assert isinstance(batch, ImageBatch) and len(batch.jpegs) == 0 and batch.decoded_rows == (0, 1, 2)
    pixels, failed = cls(transform, torch.device("cpu"), preprocess)(batch)
    reference = torch.stack([transform.geometry_pixels(Image.open(io.BytesIO(x)).convert("RGB")) for x in pngs])
    assert not failed and torch.equal(pixels, reference.permute(0, 3, 1, 2))  # shrunk by PIL in the workers: fast's


def test_a_bad_file_in_the_batch_costs_one_failed_call_and_one_call_a_file(coco_src):
    """A library that fails the whole batch for one bad file (torchvision's, DALI's) on a file the
    workers' checks pass (a corrupt scan): each file is then decoded alone, once - 1 + 16 calls for 1
    bad file in 16, each good file decoded at most twice (halving the batch made 1 + 2 x 4 calls, and
    decoded each good file up to 5 times) - and every good file is still decoded, as in a clean batch."""
    preprocess = PREPROCESSINGS["bicubic-64"]
    files = [(coco_src / p["image"]).read_bytes() for p in read_pairs(coco_src)[:16]]
    files[11] = corrupt_scan(files[11])
    batch = ImageBatch(16, JpegBlob.pack(files), tuple(range(16)))
    calls = []

    class Counted(DeviceJpegDecoder):
        def decode_crop(self, chunk):
            calls.append(len(chunk))
            return super().decode_crop(chunk)

    counted = Counted(StandardTransform.parse(preprocess), torch.device("cpu"), preprocess)
    out, failed = counted(batch)
    assert calls == [16] + [1] * 16 and list(failed) == [11] and failed[11].startswith("cannot decode image")
    plain, _ = DeviceJpegDecoder(StandardTransform.parse(preprocess), torch.device("cpu"), preprocess)(
        ImageBatch(15, JpegBlob.pack(files[:11] + files[12:]), tuple(range(15))))
    assert torch.equal(torch.cat([out[:11], out[12:]]), plain) and not out[11].any()


def test_a_truncated_jpeg_is_decoded_by_its_worker_and_never_reaches_the_device(coco_src):
    """A download cut short has a whole header (`plain_jpeg` passes it) but no end-of-image marker:
    the worker decodes it (`device_takes`), so PIL's reason is its row's error as with `decode`
    fast, and the device's batch never fails for it. Broken variant caught: the header check alone
    (89907df), which left it to the device."""
    from pairclean.backends.device_jpeg import device_takes

    preprocess = PREPROCESSINGS["bicubic-64"]
    good = (coco_src / read_pairs(coco_src)[0]["image"]).read_bytes()
    truncated = good[:len(good) // 2]
    assert device_takes(good, True, 0.0) and not device_takes(truncated, True, 0.0)
    assert device_takes(corrupt_scan(good), True, 0.0)  # what only the device's decode can find out
    on_device = OpenClipPreparer(preprocess, None, draft_size=64).leaving_to(DeviceJpegDecoder)
    fast = OpenClipPreparer(preprocess, None, draft_size=64)
    with pytest.raises(DecodeError) as device_path:
        on_device.prepare("image", truncated)
    with pytest.raises(DecodeError) as worker_path:
        fast.prepare("image", truncated)
    assert str(device_path.value) == str(worker_path.value) and "truncated" in str(device_path.value)


def test_dali_rebuilds_its_pipeline_for_a_bigger_batch(coco_src):
    cls = _decoder_class("dali")
    preprocess = PREPROCESSINGS["bicubic-64"]
    files = [(coco_src / p["image"]).read_bytes() for p in read_pairs(coco_src)[:7]]
    decoder = cls(StandardTransform.parse(preprocess), torch.device("cpu"), preprocess)
    small, _ = decoder(ImageBatch(2, JpegBlob.pack(files[:2]), (0, 1)))
    assert decoder.capacity == 2
    big, _ = decoder(ImageBatch(7, JpegBlob.pack(files), tuple(range(7))))
    assert decoder.capacity == 7 and torch.equal(big[:2], small)
    again, _ = decoder(ImageBatch(3, JpegBlob.pack(files[4:]), (0, 1, 2)))
    assert decoder.capacity == 7 and torch.equal(again, big[4:])


def test_the_registry_lists_every_decoder_and_the_package_each_needs():
    assert {"gpu", "nvimgcodec", "dali"} <= set(DEVICE_DECODERS)
    assert DEVICE_DECODERS["gpu"].package is None and DEVICE_DECODERS["gpu"].unavailable() is None
    assert DEVICE_DECODERS["nvimgcodec"].package == "nvidia-nvimgcodec-cu13"
    assert DEVICE_DECODERS["dali"].package == "nvidia-dali-cuda130"
    assert all(issubclass(cls, BatchedDeviceDecoder) for cls in DEVICE_DECODERS.values() if not cls.workers_decode)
    assert [name for name, cls in DEVICE_DECODERS.items() if cls.workers_decode] == ["gpu-resize"]
    assert DEVICE_DECODERS["gpu-resize"].unavailable() is None  # torch alone


@pytest.mark.parametrize("name", ["nvimgcodec", "dali"])
def test_a_decoder_whose_package_is_missing_leaves_decoding_to_the_workers_and_names_the_package(name, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, LIBRARIES[name], None)  # what importing it does where it is not installed
    package = DEVICE_DECODERS[name].package
    assert package in DEVICE_DECODERS[name].unavailable()
    with caplog.at_level(logging.WARNING, logger="pairclean"):
        est = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", decode=name)
    assert est.decode == "fast" and est.device_decoder is None and not est.preparer.device_jpeg
    (message,) = [r.getMessage() for r in caplog.records if f"`decode` {name}" in r.getMessage()]
    assert "\n" not in message and f"needs the {package} package" in message
    assert "pip install 'pairclean[gpu]'" in message and message.endswith("decoding JPEGs in the CPU workers (fast)")


def test_nvimgcodec_backend_the_device_cannot_create_counts_as_not_decoding(monkeypatch):
    """On an H100, nvImageCodec 0.9 raised 'Could not create decoder. Code: 7' for a decoder
    restricted to its GPU_ONLY backend: the probe goes on to the next backend and, with none left,
    says the GPU does not decode (the run then notes the CPU decoder) instead of crashing the run."""
    cls = _decoder_class("nvimgcodec")
    preprocess = PREPROCESSINGS["bicubic-64"]
    decoder = cls(StandardTransform.parse(preprocess), torch.device("cpu"), preprocess)
    library, tried = decoder.library, []

    class Refusing:
        def __init__(self, device_id=None, backends=(), **kwargs):
            tried.append(device_id)
            raise RuntimeError("Internal error - Could not create decoder. Code: 7")

    monkeypatch.setattr(decoder, "library", type("Library", (), {**{k: getattr(library, k) for k in dir(library)
                                                                     if not k.startswith("__")}, "Decoder": Refusing}))
    assert decoder._gpu_decodes(0) is False and tried == [0, 0, 0]


def _fast_decode(fast, data: bytes):
    """The image `decode` fast decodes from `data`, as a worker sends it for the device to resize."""
    return fast.transform.device_sized(decode_image(data, draft_size=fast.draft_size))


def test_progressive_jpegs_go_to_the_workers_where_the_decoder_would_take_them_one_at_a_time(coco_src):
    """torchvision's decoder batches baseline JPEGs but decodes progressive ones one by one with a
    stream synchronisation each: with `gpu` they are decoded in the worker, with PIL, as `fast`
    decodes them (the device resizes them with the batch); baseline JPEGs still travel undecoded.
    Decoders that batch them keep them."""
    from pairclean.data.decode import plain_jpeg

    baseline = (coco_src / read_pairs(coco_src)[0]["image"]).read_bytes()
    buffer = io.BytesIO()
    Image.open(io.BytesIO(baseline)).save(buffer, format="JPEG", quality=90, progressive=True)
    progressive = buffer.getvalue()
    assert plain_jpeg(progressive) and not plain_jpeg(progressive, progressive=False)
    assert plain_jpeg(baseline, progressive=False)
    assert DeviceJpegDecoder.progressive is False
    assert all(DEVICE_DECODERS[name].progressive for name in DEVICE_DECODERS if name != "gpu")

    preprocess = PREPROCESSINGS["bicubic-64"]
    fast = OpenClipPreparer(preprocess, None, draft_size=64)
    gpu = OpenClipPreparer(preprocess, None, draft_size=64, device_jpeg=True, device_progressive=DeviceJpegDecoder.progressive)
    items = [gpu.prepare("image", x) for x in (baseline, progressive)]
    assert items[0] == baseline and np.array_equal(np.asarray(items[1]), np.asarray(_fast_decode(fast, progressive)))
    batch = gpu.collate("image", items)
    assert isinstance(batch, ImageBatch) and batch.jpeg_rows == (0,) and batch.decoded_rows == (1,)


def test_a_fixed_share_of_the_jpegs_is_decoded_in_the_workers_picked_by_content(coco_src):
    """`cpu_decode_share`: the workers decode about that share of the JPEGs a device decoder
    would take, decoded as `fast` decodes them and left for the device to resize with the batch;
    which ones depends on the file alone (the same
    file takes the same way in another run, batch or worker), and the share grows by adding files."""
    from pairclean.backends.device_jpeg import worker_decodes

    many = [f"file {i}".encode() for i in range(4000)]
    chosen = {share: {i for i, data in enumerate(many) if worker_decodes(data, share)} for share in (0, 0.25, 0.5, 1)}
    assert chosen[0] == set() and chosen[1] == set(range(len(many))) and chosen[0.25] < chosen[0.5]
    assert [len(chosen[share]) / len(many) for share in (0.25, 0.5)] == pytest.approx([0.25, 0.5], abs=0.02)  # 2.5 sd

    files = [(coco_src / p["image"]).read_bytes() for p in read_pairs(coco_src)]
    half = {i for i, data in enumerate(files) if worker_decodes(data, 0.5)}
    assert half == {i for i, data in enumerate(files) if worker_decodes(memoryview(data), 0.5)}  # a view: the same

    preprocess = PREPROCESSINGS["bicubic-64"]
    fast = OpenClipPreparer(preprocess, None, draft_size=64)
    shared = OpenClipPreparer(preprocess, None, draft_size=64, device_jpeg=True, cpu_decode_share=0.5)
    items = [shared.prepare("image", data) for data in files[:12]]
    for i, item in enumerate(items):
        if i in half:
            assert np.array_equal(np.asarray(item), np.asarray(_fast_decode(fast, files[i])))
        else:
            assert item == files[i]
    batch = shared.collate("image", items)
    assert 0 < len(batch.decoded_rows) < 12 and set(batch.decoded_rows) == half & set(range(12))
    assert set(batch.jpeg_rows).isdisjoint(batch.decoded_rows)


@pytest.mark.parametrize("argv, says", [
    (["--cpu-decode-share", "0.3"], "--decode fast decodes every image in the workers already: use --decode gpu"),
    (["--decode", "gpu", "--cpu-decode-share", "1.5"], "--cpu-decode-share must be within [0, 1], got 1.5"),
    (["--decode", "GPU", "--cpu-decode-share", "0.3"], "unknown decode 'GPU'"),
    (["--decode", "gpu-resize", "--cpu-decode-share", "0.3"], "--decode gpu-resize decodes every image in the workers already"),
])
def test_a_cpu_decode_share_without_a_device_decoder_or_out_of_range_is_refused(argv, says, coco_shards, tmp_path, capsys):
    from helpers import run_cli

    out = tmp_path / "s.parquet"
    code, _, err = run_cli(["score", coco_shards, "--model", "pairclean-tiny", "--pretrained", "none", "--out", out, *argv],
                           capsys)
    assert code == 2 and says in err and "Traceback" not in err and not out.exists()


def test_the_device_path_passes_cudas_device_and_dtype_checks_and_never_waits_for_the_device():
    """What runs only on a GPU - decoded images resized together (`resize_many`), the images the
    workers decoded resized too, merged by row, normalised channels-last - on fake CUDA tensors,
    whose ops run CUDA's device checks with no GPU (images left in host memory fail them). Nothing in it waits for
    the device: each `torch.tensor(values, device=cuda)` of the sizes and rows was a stream
    synchronisation (11 in this batch, ~30 in a batch of 1,024), the prefetching thread then waiting
    for the decode, the resizes and, beside them, the model's kernels."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pairclean.backends.device_jpeg import resize_many
    from pairclean.backends.inputs import PixelNormalizer
    from pairclean.bench.measure import DeviceReads

    preprocess = PREPROCESSINGS["bicubic-73-crop-64"]

    class Sized(BatchedDeviceDecoder):  # the library's call stood in for by images of several sizes
        name = "sized"

        def decode_crop(self, files):
            images = [torch.zeros((3, 80 + 9 * i, 70 + 5 * i), dtype=torch.uint8, device=self.device) for i in range(len(files))]
            return resize_many(images, self.transform.resize, self.transform.crop, self.filter), list(range(len(files)))

    workers = DecodedImages.pack([np.zeros((64 + 7 * i, 90, 3), dtype=np.uint8) for i in range(2)])  # decoded in the workers
    batch = ImageBatch(7, JpegBlob.pack([b"\xff\xd8\xff" + bytes(64)] * 5), (0, 1, 2, 4, 6), workers, (3, 5))
    with FakeTensorMode(allow_non_fake_inputs=True), DeviceReads() as waits:
        device = torch.device("cuda")
        batch = batch.to(device, non_blocking=True)  # what the feed does
        pixels, failed = Sized(StandardTransform.parse(preprocess), device, preprocess)(batch)
        assert pixels.device.type == "cuda" and pixels.dtype == torch.uint8 and pixels.shape == (7, 3, 64, 64) and not failed
        model_input = PixelNormalizer(list(NORMALIZE.mean), list(NORMALIZE.std))(pixels, torch.channels_last)
        assert model_input.dtype == torch.float32 and model_input.is_contiguous(memory_format=torch.channels_last)
        torch.tensor([0, 1], device=device)  # what such a wait looks like: counted
    assert dict(waits.sites) == {"?": 1}


def test_gpu_resize_resizes_the_images_the_workers_decoded_on_the_device(coco_src):
    """`decode` gpu-resize: the workers decode every image with PIL - a PNG and a greyscale JPEG too -
    and send it at its own size (one tensor a batch); the device resizes and crops the batch. Its
    pixels are PIL's (`decode` exact) within `resize_many`'s rounding, and `decode` gpu's where both
    decode with libjpeg (here, on a CPU: the same resize). An image of more than
    SENT_PIXELS_PER_RESIZE times the Resize's square (COCO's 640 x 480 against 73 x 73) is shrunk by
    PIL in the worker: its pixels are exactly PIL's (the device's resize of it is the identity). A
    file PIL cannot decode fails in the worker, as with fast."""
    from pairclean.backends.inputs import SENT_PIXELS_PER_RESIZE
    from pairclean.backends.resample import resized_size

    preprocess = PREPROCESSINGS["bicubic-73-crop-64"]
    transform = StandardTransform.parse(preprocess)
    jpegs = [(coco_src / p["image"]).read_bytes() for p in read_pairs(coco_src)[:6]]
    small = [Image.open(io.BytesIO(data)).resize((120, 90)) for data in jpegs[:3]]
    grey, png, plain = io.BytesIO(), io.BytesIO(), io.BytesIO()
    small[0].convert("L").save(grey, format="JPEG")
    small[1].save(png, format="PNG")
    small[2].save(plain, format="JPEG")
    items = [*jpegs, grey.getvalue(), png.getvalue(), plain.getvalue()]
    opened = [Image.open(io.BytesIO(x)).convert("RGB") for x in items]
    big = [i for i, im in enumerate(opened) if im.width * im.height > SENT_PIXELS_PER_RESIZE * 73 ** 2]
    assert big == list(range(6))
    cls = DEVICE_DECODERS["gpu-resize"]
    preparer = OpenClipPreparer(preprocess, None, draft_size=None).leaving_to(cls)
    assert preparer.device_resize and not preparer.device_jpeg
    batch = preparer.collate("image", [preparer.prepare("image", x) for x in items])
    assert isinstance(batch, DecodedImages) and batch.shapes == tuple(
        resized_size(im.height, im.width, 73) if i in big else (im.height, im.width) for i, im in enumerate(opened))
    assert batch.nbytes() == sum(h * w * 3 for h, w in batch.shapes)
    assert torch.equal(batch.images()[6][0], torch.from_numpy(np.array(opened[6])[:, :, 0]))
    pixels, failed = cls(transform, torch.device("cpu"), preprocess)(batch)
    assert not failed and pixels.dtype == torch.uint8 and pixels.shape == (len(items), 3, 64, 64)

    reference = torch.stack([transform.geometry_pixels(im) for im in opened]).permute(0, 3, 1, 2)
    assert torch.equal(pixels[big], reference[big])  # shrunk by PIL in the worker: its pixels exactly
    difference = (pixels.int() - reference.int()).abs()
    assert difference.max() <= TOLERANCE["gpu"][0] and 0 < (difference > 0).float().mean() < 0.01
    on_device = OpenClipPreparer(preprocess, None, draft_size=None).leaving_to(DeviceJpegDecoder)
    jpeg_batch = on_device.collate("image", [on_device.prepare("image", items[i]) for i in (6, 8)])
    gpu, _ = DeviceJpegDecoder(transform, torch.device("cpu"), preprocess)(jpeg_batch)
    assert jpeg_batch.jpeg_rows == (0, 1) and torch.equal(pixels[[6, 8]], gpu)
    with pytest.raises(DecodeError):
        preparer.prepare("image", jpegs[2][:len(jpegs[2]) // 2])


@pytest.mark.parametrize("preprocessing", sorted(PREPROCESSINGS))
def test_a_sliver_is_resized_over_its_crop_alone_to_resize_and_crops_pixels(preprocessing, monkeypatch):
    """An image whose shortest-side Resize is mostly cut away (1,200 x 3 noise: 25,600 x 64 before
    the crop) is resized over the crop's window only, in PIL's own order of its passes: `fast`'s
    pixels are Resize + CenterCrop's within PIL's float32 box coordinates (a rare grey level; one
    call of both passes: 24 levels off), PIL is never asked for the whole Resize, and with a device
    resize the worker sends the Resize's square window, which the device resizes by the identity
    and crops to the same pixels."""
    from pairclean.backends.inputs import uint8_hwc

    preprocess = PREPROCESSINGS[preprocessing]
    transform = StandardTransform.parse(preprocess)
    rng = np.random.default_rng(0)
    for size in [(1200, 3), (3, 1200)]:
        image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
        assert transform.resizes_to_sliver(*size)
        reference = image
        for t in transform.geometry:
            reference = t(reference)
        asked, resize = [], Image.Image.resize
        monkeypatch.setattr(Image.Image, "resize", lambda im, to, *a, **k: asked.append(to) or resize(im, to, *a, **k))
        pixels = transform.geometry_pixels(image)
        sent = transform.device_sized(image)
        monkeypatch.undo()
        assert max(w * h for w, h in asked) <= transform.resize * max(size)  # never the 25,600 x 64 Resize
        assert sent.size == (transform.resize, transform.resize)
        on_device = DeviceJpegDecoder(transform, torch.device("cpu"), preprocess).resized([uint8_hwc(sent).permute(2, 0, 1)])
        for got in (pixels, on_device[0].permute(1, 2, 0)):
            difference = (got.int() - uint8_hwc(reference).int()).abs()  # PIL's float32 box: a rare grey level
            assert difference.max() <= 2 and (difference > 0).float().mean() < 0.01


def test_gpu_resize_on_cuda_resizes_the_moved_batch_without_waiting_for_the_device():
    """`decode` gpu-resize as a GPU runs it, on fake CUDA tensors (CUDA's device checks, no GPU): the
    workers' images moved to the device in one copy (`DecodedImages.to`, what the feed does), viewed
    there image by image and resized in one batch; nothing in it waits for the device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pairclean.bench.measure import DeviceReads

    preprocess = PREPROCESSINGS["bicubic-73-crop-64"]
    host = DecodedImages.pack([np.zeros((80 + 9 * i, 70 + 5 * i, 3), dtype=np.uint8) for i in range(5)])
    with FakeTensorMode(allow_non_fake_inputs=True), DeviceReads() as waits:
        moved = host.to(torch.device("cuda"), non_blocking=True)
        assert moved.data.device.type == "cuda" and moved.shapes == host.shapes
        pixels, failed = DEVICE_DECODERS["gpu-resize"](StandardTransform.parse(preprocess), torch.device("cuda"),
                                                       preprocess)(moved)
        assert pixels.device.type == "cuda" and pixels.dtype == torch.uint8 and pixels.shape == (5, 3, 64, 64)
    assert not failed and not waits.sites
