"""JPEG decode on the device: workers leave JPEGs undecoded, the main process decodes a whole batch
there. The registry of device decoders (`decode` gpu: torchvision's nvjpeg, the default; nvimgcodec
and dali, NVIDIA's libraries, in their own modules; others register under their own name), the
failure handling they share (`BatchedDeviceDecoder`), and the torchvision one: one nvjpeg call per
batch, then resize and crop with two batched matmuls (`resample`).

Per batch, not per image: the decoded images are sorted by size and padded into a few tensors
(bounded in size, so one huge image does not pad the batch to its size), each resized and
cropped in one call; the main process spends a few microseconds per image on bookkeeping.
What the device's decoder does not take - non-JPEGs, CMYK, EXIF-rotated and oversized JPEGs -
the worker decodes, and the device resizes it with the batch; a JPEG the device cannot
decode goes through PIL here; a CPU-only machine never builds a decoder unless asked to (the
pipeline-only benchmark measures this path's cost on the CPU). Where the device's decoder, not
the CPU, is the bound, a fixed share of the JPEGs (`worker_decodes`) can be decoded in the
workers too - or every image (`decode` gpu-resize: `DeviceResize`); either way the resize, about
half of PIL's work, stays on the device.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import multiprocessing
import os
import warnings
from abc import ABC, abstractmethod

import torch
from PIL import Image

from pairclean.ops.extras import install_line
from pairclean.backends.base import host_values, pick_device
from pairclean.backends.feed import DeviceFeed
from pairclean.backends.inputs import DecodedImages, DeviceImages, ImageBatch, JpegBlob, StandardTransform
from pairclean.backends.resample import resize_crop
from pairclean.config import SHARE, check_choice, check_value
from pairclean.data.decode import DecodeError, decode_image, plain_jpeg
from pairclean.errors import ConfigError
from pairclean.ops import distributed
from pairclean.ops.records import JsonObject, Keyed

WORKER_DECODES = ("fast", "exact")  # decoded in the workers; every other `decode` is a registered device decoder
FAST_RESIZE = "torch"  # how `decode` fast's workers resize (pinned by a run: `pinned_decoding`)
PAD_BUDGET = 48 << 20  # padded input pixels per resize call (x 3 bytes as uint8, x 12 as float32)


def worker_decodes(data: bytes, share: float) -> bool:
    """Whether a JPEG a device decoder could take is decoded by the CPU workers instead
    (`cpu_decode_share`): a hash of its bytes lies in the first `share` of the hash's range, so the
    same file takes the same way in every run, worker and machine, and `share` of the files do
    (BLAKE2b: no structure in the files' bytes can skew the share, as a CRC's linearity may; ~0.1 ms
    a 100 kB file, beside the ~0.5 ms of PIL's decode of a web JPEG). It splits the decoding between
    a busy device decoder and idle cores, as DALI's `hw_decoder_load` splits it between the GPU's
    hardware decoder and nvJPEG's hybrid one."""
    return share > 0 and int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") < share * 2**64


def device_takes(data, progressive: bool, share: float) -> bool:
    """Whether a worker leaves this image to a device decoder undecoded: a `plain_jpeg` (a progressive
    one only where the decoder takes them) that is whole - its last two bytes the end-of-image marker -
    and not among the `cpu_decode_share` the workers keep (`worker_decodes`). A file cut short (a
    download that stopped: its header is whole, so `plain_jpeg` passes it) fails a batched decode as a
    whole (torchvision's, DALI's); checked here, it costs the worker its own decode (PIL then says why
    it cannot), and its row and error are those the workers' path gives (`decode` fast)."""
    return plain_jpeg(data, progressive=progressive) and data[-2:] == b"\xff\xd9" and not worker_decodes(data, share)


def check_decode(decode: str) -> None:
    """`decode` names a way to decode: in the workers (fast, exact) or a registered device decoder."""
    check_choice(decode, (*WORKER_DECODES, *DEVICE_DECODERS), "decode")


def check_cpu_decode_share(share: float, decode: str) -> float:
    """`cpu_decode_share` as a float in [0, 1]; a ConfigError where it is set without a device
    decoder (every image is decoded in the workers then: the share would silently mean nothing)."""
    share = check_value(share, float, SHARE, "cpu_decode_share")
    check_decode(decode)
    if share and (decode not in DEVICE_DECODERS or DEVICE_DECODERS[decode].workers_decode):
        jpeg_decoders = [name for name, cls in DEVICE_DECODERS.items() if not cls.workers_decode]
        raise ConfigError(f"`cpu_decode_share` splits the JPEGs between a device decoder and the CPU workers; "
                          f"`decode` {decode} decodes every image in the workers already: use `decode` "
                          f"{' or '.join(jpeg_decoders)}, or leave the share at 0", "cpu_decode_share", "decode")
    return share


class DeviceDecoder(ABC):
    """A way to finish a batch's images on the device - decode its JPEGs there (or take the
    workers' decoded images: `workers_decode`), then resize and crop them as the model's
    preprocessing does. Subclass, name it, and decorate with `register_device_decoder`: `decode`
    NAME then selects it. Built once per estimator; called once per batch."""

    name: str
    version: int = 1  # raised whenever its pixels change: a run's settings pin it, so a resumed run never mixes two
    progressive: bool = True  # decodes progressive JPEGs within its batch (False: the CPU workers decode them)
    # True: the workers decode every image (PIL) and send it at its own size (`DecodedImages`); the
    # device resizes and crops. False: the workers leave it the JPEGs (`ImageBatch`).
    workers_decode: bool = False
    package: str | None = None  # the PyPI package it needs beyond pairclean's own dependencies
    module: str | None = None  # the module `package` installs (imported to tell whether it can run)

    def __init__(self, transform: StandardTransform, device: torch.device, preprocess):
        self.transform, self.device, self.preprocess = transform, device, preprocess
        self.filter = transform.filter_name

    def resized(self, images: list[torch.Tensor]) -> torch.Tensor:
        """uint8 (C, H, W) images of any sizes resized and cropped as the model's preprocessing does."""
        return resize_many(images, self.transform.resize, self.transform.crop, self.filter)

    @classmethod
    def supports(cls, transform: StandardTransform | None) -> bool:
        """Whether it reproduces this preprocessing (checked before it is built)."""
        return transform is not None and transform.resamplable

    @classmethod
    def load(cls):
        """Its library's module, imported."""
        return importlib.import_module(cls.module)

    @classmethod
    def unavailable(cls) -> str | None:
        """Why it cannot run in this environment (its package missing or failing to load), else None."""
        if cls.module is None:
            return None
        try:
            cls.load()
        except (ImportError, OSError) as exc:  # OSError: a shared library it loads is missing
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return f"needs the {cls.package} package ({first}): {install_line('gpu')}"
        return None

    @classmethod
    def cannot_run(cls, device: torch.device) -> str | None:
        """Why it cannot decode on `device` (its package first: what to install), else None."""
        return cls.unavailable() or ("needs a CUDA device" if device.type != "cuda" else None)

    @abstractmethod
    def __call__(self, batch: DeviceImages) -> tuple[torch.Tensor, Keyed[int, str]]:
        """(uint8 (rows, 3, crop, crop) pixels of every row on the device, zeros where decoding
        failed; {row: reason} for those rows)."""

    def warm_up(self) -> None:
        """Pay the first call's costs now - the library's handles and buffers, the calling thread's
        BLAS handle and kernels - on one small JPEG: the prefetching thread does this while the
        DataLoader's workers prepare their first batches, instead of on the run's first batch."""
        image = io.BytesIO()
        Image.new("RGB", (48, 40), (90, 140, 200)).save(image, format="JPEG")
        self(ImageBatch(1, JpegBlob.pack([image.getvalue()]), (0,)))


DEVICE_DECODERS: dict[str, type[DeviceDecoder]] = {}


def register_device_decoder(cls: type[DeviceDecoder]) -> type[DeviceDecoder]:
    DEVICE_DECODERS[cls.name] = cls
    return cls


def device_decoder_for(decode: str, device: str) -> type[DeviceDecoder] | None:
    """The device decoder a run with these settings decodes with, known before its model loads:
    None where `decode` names none or it cannot run here (its package missing, no CUDA device),
    and the workers decode every image. (A model whose preprocessing it cannot reproduce also
    leaves every image to the workers; a run pins its model, so a resumed run decides alike.)"""
    cls = DEVICE_DECODERS.get(decode)
    return cls if cls is not None and cls.cannot_run(pick_device(device)) is None else None


def pinned_decoding(decode: str, device: str, share: float = 0.0) -> JsonObject:
    """What a run pins of how its images are decoded: the device decoder's version (and the share the
    workers keep) where one decodes; where the workers decode every image, how they resize: torch's
    resize for `fast` (`StandardTransform.fast_pixels`), nothing for `exact` (PIL's, as every
    earlier pairclean). A resumed run decodes alike, or is refused (a missing key compares as None)."""
    decoder = device_decoder_for(decode, device)
    if decoder is None:
        return {} if decode == "exact" else {"worker_resize": FAST_RESIZE}
    return {"device_decoder": decoder.version, **({"cpu_decode_share": share} if share else {})}


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def host_threads() -> int:
    """CPU threads a device decoder's library may use for its host work (JPEG headers, Huffman
    decoding of small images, the images the device cannot take): the cores this process may run on
    less its live child processes (the DataLoader's workers, started before a decoder makes its
    library's handle at its first batch) and the two threads that feed the device (the main one and
    the prefetching one), at most 8, at least 1. 14 workers on 16 hyperthreads leave it one thread,
    not 8 more beside them; 6 workers (`DEVICE_DECODE_WORKERS`), 8."""
    return max(1, min(8, usable_cores() - len(multiprocessing.active_children()) - 2))


# `workers` auto where the device decodes every JPEG: a worker then reads and tokenises only (0.126 ms
# a pair on an H100 machine's cores: docs/benchmarks.md), so 6 prepare ~47,000 pairs/s, 2.8x ViT-B-32's
# compiled ceiling there, and each further worker would only add its fork to the start (~40 ms from a
# large main process).
DEVICE_DECODE_WORKERS = 6


def auto_workers(device: str, decode: str = "fast", cpu_decode_share: float = 0.0) -> int:
    """`workers` left to pairclean. On a CUDA device, where the workers decode, every usable core of
    this rank's share of the node but two (the main thread, and the thread that feeds the device:
    scoring's prefetching thread, the DataLoader's pin thread in training), at least 2: a worker
    decodes ~420 web pairs/s at `--decode fast` (an H100 machine's cores: docs/benchmarks.md), a
    fortieth of what the GPU encodes; where a device decoder takes every JPEG, DEVICE_DECODE_WORKERS
    at most. Elsewhere
    2: the model itself needs the cores, and a worker prepares pairs far faster than a CPU encodes
    them."""
    if pick_device(device).type != "cuda":
        return 2
    free = usable_cores() // distributed.local_world_size() - 2
    decoder = device_decoder_for(decode, device)
    if decoder is not None and not decoder.workers_decode and not cpu_decode_share:
        free = min(free, DEVICE_DECODE_WORKERS)
    return max(2, free)


class BatchedDeviceDecoder(DeviceDecoder):
    """A device decoder made of one batched library call (`decode_crop`), with the failure
    handling every such decoder needs. The workers send only whole, plain JPEGs (`device_takes`), so
    a call rarely fails; when one fails as a whole (a file whose scan is corrupt fails torchvision's
    or DALI's batch), each file of the batch is decoded alone, once: a bad file costs its batch one
    failed call and a call per file, never more (halving the batch down to the bad file cost about
    2 k log2(n) calls, each a stream synchronisation, and decoded each good file log2(n) times). A file
    the library cannot decode goes through PIL, as in the workers, and one PIL cannot decode either
    becomes a failed row with PIL's reason."""

    batch_errors: tuple[type[BaseException], ...] = (RuntimeError,)  # how the library says a call failed

    @abstractmethod
    def decode_crop(self, files: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """(uint8 (k, 3, crop, crop) pixels on the device of the k files it decoded, resized and
        cropped as the model's preprocessing; their positions in `files`). A file it cannot decode
        is left out; a call that fails as a whole raises one of `batch_errors`."""

    def _decode_all(self, files: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
        """`decode_crop` of the batch; where the call fails as a whole, of each file alone: (pixel
        tensors, the positions they hold, in order)."""
        try:
            pixels, decoded = self.decode_crop(files)
            return [pixels], decoded
        except self.batch_errors:
            pass
        parts, decoded = [], []
        for position, data in enumerate(files):
            try:
                pixels, got = self.decode_crop([data])
            except self.batch_errors:
                continue
            if got:
                parts.append(pixels)
                decoded.append(position)
        return parts, decoded

    def __call__(self, batch: ImageBatch) -> tuple[torch.Tensor, Keyed[int, str]]:
        """(uint8 pixels of every row on the device, zeros where decoding failed; {row: reason})."""
        crop = self.transform.crop
        out = torch.zeros((batch.rows, 3, crop, crop), dtype=torch.uint8, device=self.device)
        files = batch.jpegs.files()
        parts, decoded = self._decode_all(files) if files else ([], [])
        if decoded:
            rows = host_values([batch.jpeg_rows[p] for p in decoded], self.device)
            out[rows] = torch.cat(parts) if len(parts) > 1 else parts[0]
        failed: dict[int, str] = {}
        for position in sorted(set(range(len(files))) - set(decoded)):  # the library refused it: PIL's reading, or its reason
            row = batch.jpeg_rows[position]
            try:
                image = decode_image(batch.jpegs.file_bytes(position))
                out[row] = self.transform.geometry_pixels(image).permute(2, 0, 1).to(self.device, non_blocking=True)
            except DecodeError as exc:
                failed[row] = str(exc)
        if batch.decoded is not None:  # what the workers decoded (on the device already: the feed moved it)
            out[host_values(batch.decoded_rows, self.device)] = self.resized(batch.decoded.images())
        return out, failed


@register_device_decoder
class DeviceJpegDecoder(BatchedDeviceDecoder):
    """`decode` gpu: a batch of JPEGs decoded with torchvision.io.decode_jpeg on the device (nvjpeg
    on CUDA), then the model's shortest-side Resize and CenterCrop applied to all of them at once.

    Gives uint8 pixels; the estimator normalises them as the first step of its image tower.
    Pixels differ from PIL's (the workers' path) where libjpeg's and nvjpeg's IDCTs round
    otherwise and where PIL's fixed-point resampling weights do (docs/benchmarks.md gives the
    measured differences); the run's settings pin `decode`, so a resumed run does not mix them.
    """

    name = "gpu"
    # 4: the images the workers decode (PNGs, progressive JPEGs, the share) resized on the device too;
    # 3: progressive JPEGs decoded in the workers; 2: on the device; 1 (a6e2769): a resize per image
    version = 4
    # torchvision batches baseline JPEGs to nvJPEG's hardware decoder (A100, H100) but decodes every
    # other JPEG one at a time, Huffman on the host and a stream synchronisation each
    # (decode_jpegs_cuda.cpp, pytorch/vision 156b4ec): in the workers, with PIL, they cost the
    # prefetching thread nothing.
    progressive = False

    def __init__(self, transform: StandardTransform, device: torch.device, preprocess):
        super().__init__(transform, device, preprocess)
        self.feed = DeviceFeed(device)  # CUDA: the side stream torchvision's images are allocated on (`_decode`)

    def decode_crop(self, files: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        images = self._decode(files)
        return self.resized(images), list(range(len(files)))

    def _decode(self, files: list[torch.Tensor]) -> list[torch.Tensor]:
        """The files decoded on the device. On CUDA, torchvision allocates the images on the caller's
        current stream but writes them on a stream of its own, which never waits for the caller's:
        an image freed while the caller's queued work still reads it (the resize; nothing waits for
        the device any more) could be handed to the next decode and overwritten. So they are decoded
        on a side stream and handed to the caller's as a `DeviceFeed` hands its copies: the caller's
        stream waits for them, and their memory is reused only once its queued work is done."""
        from torchvision.io import ImageReadMode, decode_jpeg

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchvision 0.29 deprecates its image decoders
            images = self.feed.run(lambda: decode_jpeg(files, mode=ImageReadMode.RGB, device=self.device))
        return images if isinstance(images, list) else [images]


@register_device_decoder
class DeviceResize(DeviceDecoder):
    """`decode` gpu-resize: the workers decode every image as `decode` fast does (plain JPEGs by libjpeg, the
    rest by PIL, draft scaling included) and send it at its own size; the device resizes and crops the whole
    batch (`resize_many`). The resize, about half a worker's time with PIL (`decode` exact), a third with
    torch's (`decode` fast), leaves the workers; nvJPEG's host-side decoding, which bounds `decode` gpu's
    prefetching thread, is not on any path. The pixels differ from `exact`'s by the resize alone (PIL's
    weights and 8-bit rounding between the passes, as `resize_many` does for `decode` gpu)."""

    name = "gpu-resize"
    version = 2  # 2: an image over SENT_PIXELS_PER_RESIZE is shrunk in the worker by PIL (`device_sized`)
    workers_decode = True

    def __call__(self, batch: DecodedImages) -> tuple[torch.Tensor, Keyed[int, str]]:
        return self.resized(batch.images()), {}

    def warm_up(self) -> None:
        self(DecodedImages.pack([Image.new("RGB", (48, 40), (90, 140, 200))]).to(self.device))


def resize_many(images: list[torch.Tensor], resize: int, crop: int, filter_name: str) -> torch.Tensor:
    """uint8 (C, H, W) images of any sizes -> uint8 (N, C, crop, crop), in their order: sorted by
    size and cut into runs whose padded size stays under PAD_BUDGET pixels, each run padded into
    one tensor (one C++ loop of copies: `_foreach_copy_`) and resized in one `resize_crop` call."""
    device, channels = images[0].device, images[0].shape[0]
    sizes = [(image.shape[1], image.shape[2]) for image in images]
    order = sorted(range(len(images)), key=lambda k: sizes[k][0] * sizes[k][1])
    out = torch.empty((len(images), channels, crop, crop), dtype=torch.uint8, device=device)
    start = 0
    while start < len(order):
        end, hmax, wmax = start, 0, 0
        while end < len(order):  # a run grows while its padded size stays within budget (one image at least)
            h, w = max(hmax, sizes[order[end]][0]), max(wmax, sizes[order[end]][1])
            if end > start and h * w * (end - start + 1) > PAD_BUDGET:
                break
            hmax, wmax, end = h, w, end + 1
        run = order[start:end]
        padded = torch.zeros((len(run), channels, hmax, wmax), dtype=torch.uint8, device=device)
        torch._foreach_copy_([padded[j, :, :sizes[k][0], :sizes[k][1]] for j, k in enumerate(run)],
                             [images[k] for k in run])
        out[host_values(run, device)] = resize_crop(padded, [sizes[k] for k in run], resize, crop, filter_name)
        start = end
    return out
