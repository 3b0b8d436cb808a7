"""JPEG decode on the device: workers leave JPEGs undecoded, the main process decodes a whole batch
there. The registry of device decoders (`decode` gpu: torchvision's nvjpeg, the default; others
register under their own name) and the torchvision one: one nvjpeg call per batch, then resize and
crop with two batched matmuls (`resample`).

Per batch, not per image: the decoded images are sorted by size and padded into a few tensors
(bounded in size, so one huge image does not pad the batch to its size), each resized and
cropped in one call; the main process spends a few microseconds per image on bookkeeping.
Everything degrades to the worker path: non-JPEGs, CMYK, EXIF-rotated and oversized JPEGs go
through PIL in the worker, a JPEG the device cannot decode through PIL here, and a CPU-only
machine never builds a decoder unless asked to (the pipeline-only benchmark measures this path's
cost on the CPU).
"""

from __future__ import annotations

import io
import warnings
from abc import ABC, abstractmethod

import torch
from PIL import Image

from pairclean.backends.inputs import ImageBatch, StandardTransform
from pairclean.backends.resample import FILTERS, resize_crop
from pairclean.data.decode import MAX_PIXELS, DecodeError, decode_image

PAD_BUDGET = 48 << 20  # padded input pixels per resize call (x 3 bytes as uint8, x 12 as float32)
EXIF_ORIENTATION = 0x0112


def device_decodable(data: bytes, max_pixels: int = MAX_PIXELS) -> bool:
    """A JPEG whose header says the device decoder gives the pixels PIL would: RGB or greyscale,
    within the pixel limit, not rotated by an EXIF tag (PIL's path applies the rotation).

    Reads the header only; every other image goes through PIL in the worker.
    """
    if not isinstance(data, (bytes, bytearray)) or data[:3] != b"\xff\xd8\xff":
        return False
    try:
        with Image.open(io.BytesIO(data), formats=["JPEG"]) as img:
            return (img.mode in ("RGB", "L") and img.size[0] * img.size[1] <= max_pixels
                    and img.getexif().get(EXIF_ORIENTATION, 1) == 1)
    except Exception:  # any header PIL cannot parse: the worker's decode reports why
        return False


def _filter_name(transform: StandardTransform) -> str | None:
    name = getattr(transform.interpolation, "value", str(transform.interpolation))
    return name if name in FILTERS else None


class DeviceDecoder(ABC):
    """A way to decode a batch's JPEGs on the device, then resize and crop them as the model's
    preprocessing does. Subclass, name it, and decorate with `register_device_decoder`: `decode`
    NAME then selects it. Built once per estimator; called once per batch."""

    name: str
    version: int = 1  # raised whenever its pixels change: a run's settings pin it, so a resumed run never mixes two
    package: str | None = None  # the PyPI package it needs beyond pairclean's own dependencies

    def __init__(self, transform: StandardTransform, device: torch.device, preprocess):
        self.transform, self.device, self.preprocess = transform, device, preprocess

    @classmethod
    def supports(cls, transform: StandardTransform | None) -> bool:
        """Whether it reproduces this preprocessing (checked before it is built)."""
        return transform is not None and _filter_name(transform) is not None and transform.resize >= transform.crop

    @classmethod
    def unavailable(cls) -> str | None:
        """Why it cannot run in this environment (a missing package), else None."""
        return None

    @abstractmethod
    def __call__(self, batch: ImageBatch) -> tuple[torch.Tensor, dict[int, str]]:
        """(uint8 (rows, 3, crop, crop) pixels of every row on the device, zeros where decoding
        failed; {row: reason} for those rows)."""


DEVICE_DECODERS: dict[str, type[DeviceDecoder]] = {}


def register_device_decoder(cls: type[DeviceDecoder]) -> type[DeviceDecoder]:
    DEVICE_DECODERS[cls.name] = cls
    return cls


@register_device_decoder
class DeviceJpegDecoder(DeviceDecoder):
    """`decode` gpu: a batch of JPEGs decoded with torchvision.io.decode_jpeg on the device (nvjpeg
    on CUDA), then the model's shortest-side Resize and CenterCrop applied to all of them at once.

    Gives uint8 pixels; the estimator normalises them as the first step of its image tower.
    Pixels differ from PIL's (the workers' path) where libjpeg's and nvjpeg's IDCTs round
    otherwise and where PIL's fixed-point resampling weights do (docs/benchmarks.md gives the
    measured differences); the run's settings pin `decode`, so a resumed run does not mix them.
    """

    name = "gpu"
    version = 2  # 1 (a6e2769): torchvision's tensor resize per image, no 8-bit rounding between the passes

    def __init__(self, transform: StandardTransform, device: torch.device, preprocess):
        super().__init__(transform, device, preprocess)
        self.filter = _filter_name(transform)

    def _decode(self, files: list[torch.Tensor]) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchvision 0.29 deprecates its image decoders
            out = decode_jpeg(files, mode=ImageReadMode.RGB, device=self.device)
        return out if isinstance(out, list) else [out]

    def _decode_each(self, batch: ImageBatch) -> tuple[list[torch.Tensor | None], dict[int, str], dict[int, torch.Tensor]]:
        """One file at a time, after a batched call failed: (decoded images or None; {position:
        reason} for those PIL cannot decode either; {position: PIL's pixels} for the others)."""
        images: list[torch.Tensor | None] = []
        failed: dict[int, str] = {}
        pil_pixels: dict[int, torch.Tensor] = {}
        for position, data in enumerate(batch.jpegs.files()):
            try:
                images.append(self._decode([data])[0])
                continue
            except RuntimeError:  # nvjpeg refused this file: PIL's reading of it, or its reason
                images.append(None)
            try:
                image = decode_image(batch.jpegs.file_bytes(position))
                pil_pixels[position] = self.transform.geometry_pixels(image).permute(2, 0, 1)
            except DecodeError as exc:
                failed[position] = str(exc)
        return images, failed, pil_pixels

    def __call__(self, batch: ImageBatch) -> tuple[torch.Tensor, dict[int, str]]:
        """(uint8 pixels of every row on the device, zeros where decoding failed; {row: reason})."""
        crop = self.transform.crop
        out = torch.zeros((batch.rows, 3, crop, crop), dtype=torch.uint8, device=self.device)
        try:
            images: list[torch.Tensor | None] = self._decode(batch.jpegs.files())
            failed, pil_pixels = {}, {}
        except RuntimeError:  # one bad file fails the whole batched call
            images, failed, pil_pixels = self._decode_each(batch)
        decoded = [i for i, image in enumerate(images) if image is not None]
        if decoded:
            rows = torch.tensor([batch.jpeg_rows[i] for i in decoded], device=self.device)
            out[rows] = resize_many([images[i] for i in decoded], self.transform.resize, crop, self.filter)
        for position, pixels in pil_pixels.items():
            out[batch.jpeg_rows[position]] = pixels.to(self.device)
        if batch.pixels is not None:
            out[torch.tensor(batch.pixel_rows, device=self.device)] = batch.pixels.to(self.device, non_blocking=True)
        return out, {batch.jpeg_rows[position]: reason for position, reason in failed.items()}


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
        out[torch.tensor(run, device=device)] = resize_crop(padded, [sizes[k] for k in run], resize, crop, filter_name)
        start = end
    return out
